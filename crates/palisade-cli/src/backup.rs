//! `palisade backup --to DIR` (an online backup of a running store, over
//! `POST /v1/admin/backup`) and `palisade restore --from DIR --data NEW_DIR`
//! (offline: a new store folder from a backup). The format and the token
//! rule live in `palisade_log::backup`; `docs/backup.md` has them byte by
//! byte.

use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::Args;
use palisade_log::backup::{
    frame, restore as restore_store, BackupError, FolderWriter, FrameReader, RestoreOptions,
    DEFAULT_TOKEN_JUMP,
};
use serde_json::json;

use crate::commands::compact;
use crate::progress::Progress;
use crate::{out, Conn, Failure};

#[derive(Debug, Clone, Args)]
pub struct BackupArgs {
    /// A new (or empty) folder to write the backup into (`data.pbk`, then
    /// `manifest.json` once complete).
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct RestoreArgs {
    /// A backup folder written by `palisade backup`.
    #[arg(long, value_name = "DIR")]
    pub from: PathBuf,
    /// The new store's data folder (must not exist, or be empty); then run
    /// `palisade serve --data` on it.
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    /// The restored token counter is the backup's highest token plus this;
    /// every fence is raised to it. Choose it above the number of leases the
    /// original store may have granted after the backup (embedded leases).
    #[arg(long, default_value_t = DEFAULT_TOKEN_JUMP, value_parser = clap::value_parser!(u64).range(1..))]
    pub token_jump: u64,
    /// Stores whose tokens come from etcd: etcd's current revision; every
    /// fence is raised to it (required for them, refused otherwise).
    #[arg(long, value_name = "REVISION")]
    pub fence_at: Option<u64>,
    /// Print JSON.
    #[arg(long, env = "PALISADE_JSON", value_parser = BoolishValueParser::new())]
    pub json: bool,
}

fn failure(e: BackupError) -> Failure {
    match e {
        BackupError::Refused(m) => Failure::Usage(m),
        other => Failure::Unexpected(other.to_string()),
    }
}

/// `palisade backup --to DIR`.
pub(crate) async fn backup(a: BackupArgs) -> Result<(), Failure> {
    let http = crate::http_builder(a.conn.api_key.as_deref(), a.conn.ca_cert.as_deref())
        .map_err(Failure::Usage)?
        .connect_timeout(palisade_client::CONNECT_TIMEOUT)
        .build()
        .map_err(|e| Failure::Unexpected(format!("cannot build an HTTP client: {e}")))?;
    let mut url = reqwest::Url::parse(&a.conn.url)
        .map_err(|e| Failure::Usage(format!("--url {}: {e}", a.conn.url)))?;
    url.path_segments_mut()
        .map_err(|()| Failure::Usage(format!("--url {}: cannot be a base", a.conn.url)))?
        .pop_if_empty()
        .extend(["v1", "admin", "backup"]);
    let mut folder = FolderWriter::create(&a.to).map_err(failure)?;
    let mut resp = http
        .post(url)
        .send()
        .await
        .map_err(|e| Failure::transport(&e, &a.conn.url))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.bytes().await.unwrap_or_default();
        return Err(Failure::refused(status.as_u16(), &body));
    }
    let mut progress = Progress::new("backup", "events", 0, true);
    let mut frames = FrameReader::default();
    let incomplete = |why: String| {
        Failure::Unexpected(format!(
            "{why}; {} holds no manifest.json and is not a backup (delete it and run again)",
            a.to.display()
        ))
    };
    loop {
        let chunk = resp
            .chunk()
            .await
            .map_err(|e| incomplete(format!("the backup stream broke: {e}")))?;
        let Some(chunk) = chunk else {
            return Err(incomplete(format!(
                "the store ended the backup stream before its manifest ({} bytes received)",
                folder.bytes()
            )));
        };
        frames.push(&chunk);
        while let Some((kind, body)) = frames.next_frame() {
            match kind {
                frame::DATA => folder.data(&body).map_err(failure)?,
                frame::PROGRESS if body.len() == 16 => {
                    let done = u64::from_be_bytes(body[..8].try_into().unwrap_or_default());
                    let total = u64::from_be_bytes(body[8..].try_into().unwrap_or_default());
                    progress.set_total(total);
                    progress.set(done);
                }
                frame::ERROR => {
                    return Err(incomplete(format!(
                        "the store could not take the backup: {}",
                        String::from_utf8_lossy(&body)
                    )))
                }
                frame::MANIFEST => {
                    let bytes = folder.bytes();
                    let (info, _) = folder.finish(&body).map_err(failure)?;
                    progress.finish();
                    let events: u64 = info.heads.iter().sum();
                    #[allow(clippy::cast_precision_loss)]
                    let pause_ms = info.pause_us as f64 / 1000.0;
                    return if a.conn.json {
                        out(compact(&json!({
                            "to": a.to.display().to_string(),
                            "bytes": bytes,
                            "partitions": info.partitions,
                            "heads": info.heads,
                            "events": events,
                            "last_token": info.last_token,
                            "pause_us": info.pause_us,
                            "taken_at_ms": info.taken_at_ms,
                        })))
                    } else {
                        out(format!(
                            "backup in {}: {} partitions, {events} events, {bytes} bytes, token counter {}; writes held {pause_ms:.1} ms",
                            a.to.display(),
                            info.partitions,
                            info.last_token
                        ))
                    };
                }
                _ => {}
            }
        }
    }
}

/// `palisade restore --from DIR --data NEW_DIR [--token-jump N | --fence-at REV]`.
pub(crate) async fn restore(a: RestoreArgs) -> Result<(), Failure> {
    let opts = RestoreOptions {
        token_jump: a.token_jump,
        fence_at: a.fence_at,
    };
    let (from, to) = (a.from.clone(), a.data.clone());
    let done = tokio::task::spawn_blocking(move || {
        let mut progress = Progress::new("restore", "bytes", 0, true);
        let r = restore_store(&from, &to, &opts, &mut |d, t| {
            progress.set_total(t);
            progress.set(d);
        });
        if r.is_ok() {
            progress.finish();
        }
        r
    })
    .await
    .map_err(|e| Failure::Unexpected(format!("the restore stopped: {e}")))?
    .map_err(failure)?;
    let events: u64 = done.info.heads.iter().sum();
    if a.json {
        out(compact(&json!({
            "data": a.data.display().to_string(),
            "partitions": done.info.partitions,
            "events": events,
            "records": done.records,
            "fence": done.fence,
            "highest_token_seen": done.highest_token_seen,
            "leases_dropped": done.leases_dropped,
            "lease_backend": done.info.lease_backend,
        })))
    } else {
        out(format!(
            "restored {} ({} partitions, {events} events) from {}: every fence raised to {} (highest token in the backup {}), {} leases dropped; start it with palisade serve --data {}",
            a.data.display(),
            done.info.partitions,
            a.from.display(),
            done.fence,
            done.highest_token_seen,
            done.leases_dropped,
            a.data.display()
        ))
    }
}
