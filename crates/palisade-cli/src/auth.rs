//! `palisade auth mint-key` and `palisade auth hash-key`: API keys for the
//! security file (docs/security.md).

use anyhow::{bail, Context};
use clap::Subcommand;

/// `palisade auth ...`: API keys for the security file.
#[derive(Debug, Subcommand)]
pub enum AuthCommand {
    /// Mint a new API key and print it with its SHA-256. The security file
    /// keeps only the hash; give the key to the principal and keep no copy.
    MintKey {
        /// The principal's name, to print a ready `[[principals]]` entry.
        #[arg(long)]
        name: Option<String>,
        /// Print `{"key": ..., "key_sha256": ...}`.
        #[arg(long)]
        json: bool,
    },
    /// Print the SHA-256 of a key read from stdin (one line).
    HashKey,
}

pub fn auth_command(cmd: AuthCommand) -> anyhow::Result<()> {
    match cmd {
        AuthCommand::MintKey { name, json } => {
            let (key, hash) = palisade_auth::mint_key()?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "key": key, "key_sha256": hash, "name": name })
                );
            } else {
                println!("key:        {key}");
                println!("key_sha256: {hash}");
                println!();
                println!("# for the security file (the key itself goes to the principal only):");
                println!("[[principals]]");
                println!(
                    "name = {}",
                    serde_json::Value::String(name.unwrap_or_else(|| "worker-a".into()))
                );
                println!("key_sha256 = \"{hash}\"");
                println!("roles = [\"worker\"]");
            }
        }
        AuthCommand::HashKey => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("cannot read the key from stdin")?;
            let key = line.trim_end_matches(['\r', '\n']);
            if key.is_empty() {
                bail!("no key on stdin");
            }
            println!("{}", palisade_auth::hash_key(key));
        }
    }
    Ok(())
}
