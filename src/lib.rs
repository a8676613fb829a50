//! Palisade: a digital-twin event store whose storage enforces fencing tokens.
//!
//! This facade re-exports the layers (see `docs/design.md`):
//! [`core`] (ids, tokens, HLC, codec), [`lease`] (the lease authority),
//! [`log`] (the fenced log on sled), [`twin`] (HLC last-writer-wins twin
//! state) and [`http`] (the axum API), plus [`serve`], which is what
//! `palisade serve` runs.

pub use palisade_core as core;
pub use palisade_http as http;
pub use palisade_lease as lease;
pub use palisade_log as log;
pub use palisade_twin as twin;

pub mod bench;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod dev_kafka;
pub mod fd_limit;
pub mod publish;
pub mod security;
pub mod serve;
