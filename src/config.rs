//! Command-line and environment configuration (one clap `Config`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "palisade",
    version,
    about = "A digital-twin event store where stale writers never win"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the store: sled in a local folder, the lease authority in-process.
    Serve(ServeConfig),
}

/// `palisade serve` settings; every flag is also an environment variable.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Folder of the store (created if missing).
    #[arg(long, env = "PALISADE_DATA", default_value = "palisade-data")]
    pub data: PathBuf,
    /// Address to listen on. Port 0 picks a free port; the chosen address is printed.
    #[arg(long, env = "PALISADE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Partition count of a new store (default 16). Reopening an existing store
    /// with a different count is refused.
    #[arg(long, env = "PALISADE_PARTITIONS")]
    pub partitions: Option<u32>,
    /// How far ahead of the store's clock a writer's HLC may be, in milliseconds.
    #[arg(long, env = "PALISADE_MAX_DRIFT_MS", default_value_t = 500)]
    pub max_drift_ms: u64,
    /// Largest request body, in bytes.
    #[arg(long, env = "PALISADE_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Most events in one append request.
    #[arg(long, env = "PALISADE_MAX_BATCH_EVENTS", default_value_t = 1000)]
    pub max_batch_events: usize,
    /// Snapshot a twin's state every this many of its events (bounds time-travel reads).
    #[arg(long, env = "PALISADE_SNAPSHOT_EVERY", default_value_t = 64)]
    pub snapshot_every: u64,
    /// sled page cache, in MiB.
    #[arg(long, env = "PALISADE_CACHE_MB", default_value_t = 256)]
    pub cache_mb: u64,
}

impl ServeConfig {
    /// Rules that span fields or bound values.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(n) = self.partitions {
            if n == 0 || n > palisade_log::MAX_PARTITIONS {
                return Err(format!(
                    "--partitions must be 1..={}, got {n}",
                    palisade_log::MAX_PARTITIONS
                ));
            }
        }
        if self.max_body_bytes < 1024 {
            return Err("--max-body-bytes below 1024 would refuse ordinary events".into());
        }
        if self.max_batch_events == 0 {
            return Err("--max-batch-events must be at least 1".into());
        }
        if self.snapshot_every == 0 {
            return Err("--snapshot-every must be at least 1".into());
        }
        Ok(())
    }

    pub fn store_config(&self) -> palisade_log::StoreConfig {
        palisade_log::StoreConfig {
            partitions: self.partitions,
            max_drift: std::time::Duration::from_millis(self.max_drift_ms),
            snapshot_every: self.snapshot_every,
            cache_bytes: self.cache_mb << 20,
        }
    }

    pub fn http_config(&self) -> palisade_http::HttpConfig {
        palisade_http::HttpConfig {
            max_body_bytes: self.max_body_bytes,
            max_batch_events: self.max_batch_events,
            ..palisade_http::HttpConfig::default()
        }
    }
}
