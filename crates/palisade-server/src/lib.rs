//! `palisade serve`: its settings ([`config`]: flags, `PALISADE_*`
//! variables and a TOML file), security at start-up ([`security`]), the
//! open-file limit ([`fd_limit`]), the lease backend and cluster mode
//! ([`cluster`]), and [`serve`], which opens the store and serves it until
//! SIGTERM or Ctrl-C.
//!
//! The production server's crate: it depends on the store's layers only,
//! never on the benchmark harness or the command-line client
//! (`docs/architecture.md`).

pub mod cluster;
pub mod config;
pub mod fd_limit;
pub mod outbox;
pub mod security;
pub mod serve;

pub use config::{LeaseBackend, ServeArgs, ServeConfig};
pub use serve::{serve, shutdown_signal};
