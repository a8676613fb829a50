//! Rust client for Palisade's HTTP API (`docs/http-api.md`).
//!
//! - [`Client`]: leases (acquire, renew, release), fenced appends, reads:
//!   a twin's state now or as of a past seq or HLC
//!   ([`twin_at_seq`](Client::twin_at_seq), [`twin_at_hlc`](Client::twin_at_hlc)),
//!   with its device-shadow [`delta`](TwinState::delta); its events; the
//!   [`partitions`](Client::partitions).
//! - Change streams: [`Client::watch_twin`] and [`Client::watch_partition`]
//!   give an [`EventStream`] (a `futures` `Stream` of [`StoredEvent`]s over
//!   Server-Sent Events), resumable with no gap and no duplicate from
//!   [`EventStream::last_event_id`].
//! - [`Lease`]: a lease kept renewed in the background, whose
//!   [`lost`](Lease::lost) future lets a healthy but partitioned worker stop
//!   early. It is an optimisation, never the safety mechanism: the store's
//!   fencing check is what refuses a stale writer, and it reaches you as the
//!   typed [`ClientError::Stale`].
//! - Appends are retried only where it is safe: on transport failures, and
//!   only when every event has an `event_id` (the store dedupes by it).
//! - The JSON types are the server's own (`palisade-api`), so what the store
//!   sends is what these types read; refusals carry the store's stable
//!   [`ErrorName`] ([`ClientError::name`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use palisade_client::{Client, ClientError, Event, LeaseOptions};
//! use serde_json::json;
//!
//! # async fn run() -> Result<(), ClientError> {
//! let client = Client::new("http://127.0.0.1:7070")?;
//! let lease = client
//!     .lease("twin/pump-7", "worker-a", Duration::from_secs(10), LeaseOptions::default())
//!     .await?;
//!
//! for n in 0..100u64 {
//!     // Optimisation: stop early once the guard knows the lease is gone.
//!     // (Or race `lease.lost()` against your work in a `tokio::select!`.)
//!     if lease.is_lost() {
//!         break;
//!     }
//!     let batch = [Event::new("reading", json!({ "rpm": 1200 + n })).with_id(format!("worker-a-{n}"))];
//!     match lease.append("pump-7", &batch).await {
//!         Ok(a) => println!("stored at seq {:?}", a.seqs),
//!         // The safety mechanism: a later lease exists and the store fenced us off.
//!         Err(ClientError::Stale { token, fence }) => {
//!             eprintln!("token {token} fenced off by {fence}; stopping");
//!             break;
//!         }
//!         Err(e) => return Err(e),
//!     }
//! }
//!
//! let state = client.twin("pump-7").await?;
//! println!("{state:?}");
//! lease.release().await?;
//! # Ok(())
//! # }
//! ```

mod client;
mod error;
mod lease;
mod types;
mod watch;

pub use client::{
    Client, APPEND_ATTEMPTS, APPEND_BACKOFF, CONNECT_TIMEOUT, MAX_REDIRECTS, REQUEST_TIMEOUT,
};
pub use error::ClientError;
pub use lease::{Lease, LeaseOptions};
pub use palisade_api::ErrorName;
pub use palisade_core::{Hlc, Purpose, Scope};
pub use types::{
    Appended, Effect, Event, LeaseAdvice, LeaseGrant, OutboxEntry, PartitionInfo, PartitionOwner,
    Partitions, Refusal, StoredEvent, TwinState,
};
pub use watch::{EventStream, WatchFrom, WATCH_IDLE_TIMEOUT};
