//! Palisade: a digital-twin event store whose storage enforces fencing tokens.
//!
//! This facade re-exports the store's layers for the examples, tests and
//! benches of the root package (see `docs/architecture.md`):
//! [`core`] (ids, tokens, HLC, codec), [`lease`] (the lease authority),
//! [`log`] (the fenced log on sled), [`twin`] (HLC last-writer-wins twin
//! state) and [`http`] (the axum API). What `palisade serve` runs is
//! `palisade-server`; the binary itself is `src/main.rs`, a dispatcher.

pub use palisade_core as core;
pub use palisade_http as http;
pub use palisade_lease as lease;
pub use palisade_log as log;
pub use palisade_twin as twin;
