//! Palisade's fenced append-only log on sled.
//!
//! A [`Store`] owns one sled database: a `meta` tree (format version and
//! partition count), a `leases` tree (the durable lease authority) and one
//! tree per partition. Each partition has exactly one writer thread; every
//! append and every fence raise of that partition goes through it, so the
//! fence check and the append are one step with no locks on the hot path,
//! and the fences are written in the same atomic batch as the events they
//! admit. An append is acknowledged only after its batch is flushed.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use palisade_core::{NewEvent, Scope, TwinId};
//! use palisade_lease::AcquireRequest;
//! use palisade_log::{AppendError, Store, StoreConfig};
//!
//! let dir = tempfile::tempdir()?;
//! let store = Store::open(dir.path(), StoreConfig::default())?;
//! let twin = TwinId::new("pump-7")?;
//! let lease = |holder: &str| AcquireRequest {
//!     scope: Scope::Twin(twin.clone()),
//!     holder: holder.into(),
//!     ttl_ms: 100,
//!     purpose: Default::default(),
//! };
//! let event = |id: &str, rpm: u32| NewEvent {
//!     event_id: id.into(),
//!     event_type: "telemetry".into(),
//!     patch: serde_json::json!({ "rpm": rpm }).as_object().cloned().unwrap_or_default(),
//!     hlc: None,
//! };
//!
//! let a = store.acquire(lease("A")).await?;
//! store.append(twin.clone(), a.token, vec![event("e1", 100)], None).await?;
//! // A pauses past its TTL; B takes over and the fence rises at once.
//! tokio::time::sleep(std::time::Duration::from_millis(150)).await;
//! let b = store.acquire(lease("B")).await?;
//! // A wakes up and writes with its old token: refused by the store.
//! let late = store.append(twin.clone(), a.token, vec![event("e2", 0)], None).await;
//! assert!(matches!(late, Err(AppendError::Stale { .. })));
//! store.append(twin.clone(), b.token, vec![event("e3", 120)], None).await?;
//! let view = store.twin(&twin, palisade_log::AsOf::Latest)?.unwrap();
//! assert_eq!(view.state["rpm"], 120);
//! store.close().await;
//! # Ok(()) }
//! ```

mod audit;
pub mod backup;
mod batch;
mod cache;
mod clock;
mod cluster;
mod commit;
mod error;
pub mod fence;
pub mod handoff;
mod ingest;
mod keys;
mod leases;
mod metrics;
mod migrate;
pub mod outbox;
mod read;
mod records;
mod refusals;
mod sources;
mod store;
mod wal;
mod writer;

pub use audit::{
    AuditAction, AuditError, AuditLog, AuditOutcome, AuditRecord, DEFAULT_AUDIT_MAX_RECORDS,
};
pub use clock::SystemClock;
pub use cluster::{AppendRoute, BackendError};
pub use commit::{CommitHooks, RecoverError, StorageFailure};
pub use error::{AppendError, LeaseOpError, OpenError, OutboxRemoveError, ReadError};
pub use ingest::{
    DeadLetter, IngestOutcome, IngestRecord, Origin, Rejection, Source, DEAD_LETTERS_PER_PARTITION,
    DEAD_LETTER_VALUE_BYTES, REJECTION_LOG_LEN,
};
pub use leases::LeaseBackend;
pub use metrics::Metrics;
pub use outbox::{
    parse_removal, removal_json, DeliveryState, OutboxCounts, OutboxEntry, OutboxOutcome,
};
pub use read::{AsOf, PartitionInfo, TwinView};
pub use refusals::{payload_digest, Refusal, RefusalSource, DEFAULT_REFUSALS_PER_PARTITION};
pub use store::{Store, StoreConfig, DEFAULT_PARTITIONS, MAX_PARTITIONS};
pub use wal::{WalDamage, WalError};
pub use writer::Appended;
