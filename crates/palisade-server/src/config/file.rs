//! Settings for `palisade serve` from a TOML file (`--config FILE`,
//! `PALISADE_CONFIG`), and `palisade config check`.
//!
//! Keys are the ids of [`ServeConfig`]'s arguments (the long flags with
//! underscores: `max_drift_ms`); the one table is `kafka_settings` (the
//! repeatable `--kafka-setting KEY=VALUE`). Nothing here lists the keys: the
//! file's values become the flags they stand for and go through the same
//! clap parsers as the command line, so every rule is checked once, where
//! the setting is defined. Precedence, per key: command-line flag >
//! environment variable > file > default. Unknown keys are an error naming
//! the key. Relative paths (`data`) are relative to the working directory,
//! as for the flag. See `docs/decisions/0007-config-file.md`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, Command, FromArgMatches};

use crate::config::{ConfigError, ServeArgs, ServeConfig};

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env,
    File,
    Default,
    /// No value and no default (an optional setting left out).
    Unset,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Self::Flag => "flag",
            Self::Env => "env",
            Self::File => "file",
            Self::Default => "default",
            Self::Unset => "unset",
        }
    }
}

/// The settings `palisade serve` runs with, and where each came from.
#[derive(Debug)]
pub struct Resolved {
    pub config: ServeConfig,
    pub file: Option<PathBuf>,
    /// One entry per setting.
    pub sources: BTreeMap<String, Source>,
}

/// One setting as `palisade config check` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub key: String,
    /// Its environment variable.
    pub env: Option<String>,
    /// Its effective value (`None`: unset).
    pub value: Option<toml::Value>,
    pub source: Source,
}

/// The settings' clap command: the one definition of every key.
fn command() -> Command {
    ServeConfig::augment_args(Command::new("serve"))
}

/// Apply the file named by `args.config` under the flags and environment
/// variables that `m` (the matches `args` was parsed from) saw.
pub fn resolve(args: ServeArgs, m: &ArgMatches) -> Result<Resolved, ConfigError> {
    let cmd = command();
    let mut sources: BTreeMap<String, Source> = cmd
        .get_arguments()
        .map(|a| {
            let id = a.get_id().as_str();
            let s = match m.value_source(id) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => Source::Env,
                Some(ValueSource::DefaultValue) => Source::Default,
                _ => Source::Unset,
            };
            (id.to_owned(), s)
        })
        .collect();
    let Some(path) = args.config else {
        return Ok(Resolved {
            config: args.settings,
            file: None,
            sources,
        });
    };
    let file_error = |reason: String| ConfigError::File {
        path: path.clone(),
        reason,
    };
    let text =
        std::fs::read_to_string(&path).map_err(|e| file_error(format!("cannot read it: {e}")))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| file_error(e.to_string().trim_end().to_owned()))?;
    // The command line again (as clap saw it), then each key the file sets
    // that no flag or variable did, as its flag.
    let mut argv: Vec<OsString> = vec!["serve".into()];
    argv.extend(command_line(&cmd, m));
    for (key, value) in table {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id().as_str() == key)
            .ok_or_else(|| {
                file_error(format!(
                    "unknown key {key:?} (keys are the long flags of `palisade serve` \
                     with underscores; see palisade.example.toml)"
                ))
            })?;
        let src = sources.entry(key.clone()).or_insert(Source::Unset);
        if matches!(*src, Source::Flag | Source::Env) {
            continue;
        }
        let flags = as_flags(arg, &key, value).map_err(|r| file_error(format!("{key}: {r}")))?;
        // The key's values alone (no variable, no other key), so that a
        // refusal names this key of this file.
        command()
            .mut_args(|a| a.env(None))
            .try_get_matches_from(std::iter::once(OsString::from("serve")).chain(flags.clone()))
            .map_err(|e| file_error(format!("{key}: {}", clap_reason(&e))))?;
        argv.extend(flags);
        *src = Source::File;
    }
    let merged = command()
        .try_get_matches_from(argv)
        .and_then(|mm| ServeConfig::from_arg_matches(&mm))
        .map_err(|e| file_error(clap_reason(&e)))?;
    Ok(Resolved {
        config: merged,
        file: Some(path),
        sources,
    })
}

/// The flags of the command line that `m` holds, as clap parsed them.
fn command_line(cmd: &Command, m: &ArgMatches) -> Vec<OsString> {
    let mut out = Vec::new();
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        if m.value_source(id) != Some(ValueSource::CommandLine) {
            continue;
        }
        let long = a.get_long().unwrap_or(id);
        if a.get_action().takes_values() {
            for v in m.get_raw(id).into_iter().flatten() {
                let mut f = OsString::from(format!("--{long}="));
                f.push(v);
                out.push(f);
            }
        } else if m.get_flag(id) {
            out.push(format!("--{long}").into());
        }
    }
    out
}

/// A file's value of `arg` as that argument's flags.
fn as_flags(arg: &clap::Arg, key: &str, value: toml::Value) -> Result<Vec<OsString>, String> {
    use toml::Value as V;
    let long = arg.get_long().unwrap_or(key);
    let flag = |v: &str| OsString::from(format!("--{long}={v}"));
    let repeatable = matches!(arg.get_action(), ArgAction::Append);
    let scalar = |v: &V| match v {
        V::String(s) => Ok(s.clone()),
        V::Integer(_) | V::Float(_) | V::Boolean(_) | V::Datetime(_) => Ok(v.to_string()),
        V::Array(_) | V::Table(_) => Err(format!("expected a single value, got {}", v.type_str())),
    };
    match value {
        // A switch (`--insecure`): true or false only.
        v if !arg.get_action().takes_values() => match v {
            V::Boolean(true) => Ok(vec![format!("--{long}").into()]),
            V::Boolean(false) => Ok(Vec::new()),
            other => Err(format!(
                "must be true or false, not {} (write {key} = true)",
                other.type_str()
            )),
        },
        V::Array(items) if repeatable => {
            items.iter().map(|v| scalar(v).map(|s| flag(&s))).collect()
        }
        // The one table: `[kafka_settings]` of `"name" = "value"`.
        V::Table(t) if repeatable => t
            .iter()
            .map(|(k, v)| match v {
                V::String(s) => Ok(flag(&format!("{k}={s}"))),
                V::Table(_) => Err(format!(
                    "{k:?} is a table; quote keys that contain dots, as in \"{k}.…\" = \"value\""
                )),
                other => Err(format!(
                    "the value of {k:?} must be a string, not {} (write \"{other}\")",
                    other.type_str()
                )),
            })
            .collect(),
        v => Ok(vec![flag(&scalar(&v)?)]),
    }
}

/// A clap error's first line, without clap's `error: ` prefix.
fn clap_reason(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    first.strip_prefix("error: ").unwrap_or(first).to_owned()
}

/// `palisade serve [--config FILE]`: resolve the settings, then serve.
/// `top` are the matches of the whole command line.
pub async fn serve(args: ServeArgs, top: &ArgMatches) -> anyhow::Result<()> {
    let m = top
        .subcommand_matches("serve")
        .context("no `serve` arguments")?;
    let r = resolve(args, m)?;
    if let Some(f) = &r.file {
        tracing::info!(config = %f.display(), "settings from a config file");
    }
    crate::serve::serve(r.config).await
}

/// Every setting, in the order of `palisade serve --help`, with its value,
/// its variable and where it came from.
pub fn settings(r: &Resolved) -> Vec<Setting> {
    let values = toml::Table::try_from(&r.config).unwrap_or_default();
    command()
        .get_arguments()
        .map(|a| {
            let key = a.get_id().as_str().to_owned();
            Setting {
                env: a.get_env().map(|e| e.to_string_lossy().into_owned()),
                value: values
                    .get(&key)
                    .filter(|v| !matches!(v, toml::Value::Table(t) if t.is_empty()))
                    .filter(|v| !matches!(v, toml::Value::Array(a) if a.is_empty()))
                    .cloned(),
                source: r.sources.get(&key).copied().unwrap_or(Source::Unset),
                key,
            }
        })
        .collect()
}

/// What an unset optional key means.
pub fn unset_note(key: &str) -> &'static str {
    match key {
        "partitions" => "a new store gets 16; an existing store keeps its count",
        "kafka_brokers" => "no Kafka ingestion",
        "security" => "authentication off: loopback only",
        "tls_cert" | "tls_key" => "plain HTTP",
        "outbox_ca_file" => "no root trusted: https effects end dead",
        "kafka_dead_letter_topic" => "dead letters are kept in the store only",
        "etcd_endpoints" => "none (needed by lease_backend = \"etcd\")",
        "cluster_node" => "single-node mode",
        "cluster_advertise" => "http:// + listen",
        "partition_snapshot_dir" => "no partition snapshots: a handoff replays the partition's log",
        _ => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn arg_ids() -> BTreeSet<String> {
        command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect()
    }

    /// The example file with its `# key = value` lines uncommented.
    fn example_uncommented() -> String {
        include_str!("../../../../palisade.example.toml")
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with('[')
                        || rest.split_once(" = ").is_some_and(|(k, _)| {
                            !k.is_empty()
                                && k.chars()
                                    .all(|c| c.is_ascii_alphanumeric() || "_.\"-".contains(c))
                        }) =>
                {
                    rest
                }
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn try_resolve(file: &str, cli: &[&str]) -> Result<Resolved, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(&path, file).unwrap();
        let mut argv: Vec<OsString> = vec!["serve".into(), "--config".into(), path.into()];
        argv.extend(cli.iter().map(OsString::from));
        // No variable of the test's environment may leak in.
        let m = ServeArgs::augment_args(Command::new("serve"))
            .mut_args(|a| a.env(None))
            .try_get_matches_from(argv)
            .unwrap();
        let args = ServeArgs::from_arg_matches(&m).unwrap();
        resolve(args, &m)
    }

    fn resolve_with(file: &str, cli: &[&str]) -> Resolved {
        try_resolve(file, cli).unwrap()
    }

    #[test]
    fn every_setting_is_shown_with_its_variable() {
        let r = resolve_with("", &[]);
        let shown = settings(&r);
        let keys: BTreeSet<String> = shown.iter().map(|s| s.key.clone()).collect();
        assert_eq!(keys, arg_ids(), "config check would not print every key");
        for s in &shown {
            assert_eq!(
                s.env.as_deref(),
                Some(format!("PALISADE_{}", s.key.to_uppercase()).as_str()),
                "{}: variables are PALISADE_ + the key",
                s.key
            );
        }
        let get = |k: &str| shown.iter().find(|s| s.key == k).unwrap().clone();
        assert_eq!(get("partitions").value, None);
        assert_eq!(get("partitions").source, Source::Unset);
        assert_eq!(get("snapshot_every").value, Some(toml::Value::Integer(64)));
        assert_eq!(get("insecure").value, Some(toml::Value::Boolean(false)));
        assert_eq!(get("kafka_settings").value, None);
    }

    #[test]
    fn the_example_file_names_every_key_and_parses() {
        let text = example_uncommented();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let keys: BTreeSet<String> = table.keys().cloned().collect();
        assert_eq!(keys, arg_ids(), "palisade.example.toml misses or adds keys");
        let r = resolve_with(&text, &[]);
        assert!(r.config.partitions.is_some() && !r.config.kafka_settings.is_empty());
        assert!(r.sources.values().all(|s| *s == Source::File), "{r:?}");
        // What the file says is what config check shows, key by key.
        for s in settings(&r) {
            let want = &table[&s.key];
            assert_eq!(s.value.as_ref(), Some(want), "{}", s.key);
        }
        // As shipped (all commented out) it is valid too and sets nothing.
        let shipped = resolve_with(include_str!("../../../../palisade.example.toml"), &[]);
        assert!(shipped.sources.values().all(|s| *s != Source::File));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let cases = [
            (
                "partitions = 4\nmax_drift = 10\n",
                "unknown key \"max_drift\"",
            ),
            (
                "partitions = -1\n",
                "partitions: invalid value '-1' for '--partitions",
            ),
            ("partitions = 0\n", "not in 1..=1024"),
            ("listen = \"nowhere\"\n", "listen: invalid value 'nowhere'"),
            (
                "listen = [\"a\"]\n",
                "listen: expected a single value, got array",
            ),
            ("insecure = \"yes\"\n", "insecure: must be true or false"),
            ("kafka_topic = \"a b\"\n", "Kafka topic name"),
            ("[kafka_settings]\n\"\" = \"x\"\n", "empty key"),
            (
                "[kafka_settings]\nsecurity.protocol = \"ssl\"\n",
                "quote keys",
            ),
            (
                "[kafka_settings]\n\"linger.ms\" = 5\n",
                "\"linger.ms\" must be a string",
            ),
            (
                "[kafka_settings]\n\"group.id\" = \"x\"\n",
                "set by Palisade",
            ),
            ("this is not toml\n", "p.toml: "),
        ];
        for (file, want) in cases {
            let e = try_resolve(file, &[]).unwrap_err().to_string();
            assert!(e.contains(want), "{file:?}: {e:?} should contain {want:?}");
            assert!(e.starts_with("config file "), "{e}");
        }
        // A flag's value is not the file's to refuse: the flag wins unread.
        let r = resolve_with("partitions = 0\n", &["--partitions", "8"]);
        assert_eq!(r.config.partitions, Some(8));
    }

    // (Environment-variable precedence is tested with real processes in
    // tests/cli: setting variables here would race other tests.)
    #[test]
    fn flags_beat_the_file_which_beats_defaults() {
        let file = "partitions = 4\nmax_drift_ms = 900\nkafka_topic = \"t\"\ninsecure = true\netcd_endpoints = [\"a:1\", \"b:2\"]\n[kafka_settings]\n\"client.id\" = \"1\"\n";
        let r = resolve_with(file, &[]);
        assert_eq!(r.config.partitions, Some(4));
        assert_eq!(r.config.max_drift_ms, 900);
        assert_eq!(r.config.kafka_topic, "t");
        assert!(r.config.insecure);
        assert_eq!(r.config.etcd_endpoints, ["a:1", "b:2"]);
        assert_eq!(
            r.config.kafka_settings,
            [("client.id".to_owned(), "1".to_owned())]
        );
        assert_eq!(r.sources["partitions"], Source::File);
        assert_eq!(r.config.snapshot_every, 64);
        assert_eq!(r.sources["snapshot_every"], Source::Default);

        let r = resolve_with(
            file,
            &[
                "--partitions",
                "8",
                "--max-drift-ms",
                "500",
                "--kafka-setting",
                "client.id=2",
                "--kafka-setting",
                "linger.ms=5",
                "--cache-mb=7",
            ],
        );
        assert_eq!(r.config.partitions, Some(8));
        // Even when the flag's value equals the default, the flag wins.
        assert_eq!(r.config.max_drift_ms, 500);
        assert_eq!(
            r.config.kafka_settings,
            [
                ("client.id".to_owned(), "2".to_owned()),
                ("linger.ms".to_owned(), "5".to_owned())
            ]
        );
        assert_eq!(r.sources["partitions"], Source::Flag);
        assert_eq!(r.config.cache_mb, 7);
        assert_eq!(r.config.kafka_topic, "t");
        assert!(r.config.insecure);
    }
}
