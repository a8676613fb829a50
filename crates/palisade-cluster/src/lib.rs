//! Cluster mode's partition ownership (docs/decisions/0012-cluster-mode.md,
//! docs/decisions/0021-cluster-state-machine.md), kept pure: a [`Machine`]
//! takes an [`Event`] for a partition and an explicit `now` and returns the
//! [`Action`]s to carry out. A runtime (`palisade-server`'s `cluster.rs`)
//! carries them out through the small traits of [`ports`]: the etcd owner
//! lease ([`OwnerLeases`]), the Kafka producer ([`RecordLog`]) and the
//! clock ([`Clock`]), and feeds what came of them back in as events.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use palisade_cluster::{Action, Event, Gate, Machine, OwnerLeaseId};
//! use palisade_core::FencingToken;
//!
//! let mut m = Machine::default();
//! let t0 = Instant::now();
//! assert_eq!(m.handle(0, Event::Assigned, t0), vec![Action::TakeLease]);
//! let (token, lease) = (FencingToken(7), OwnerLeaseId(1));
//! let ttl = Duration::from_secs(3);
//! let actions = m.handle(0, Event::LeaseTaken { token, lease, sent: t0, ttl }, t0);
//! assert!(actions.contains(&Action::ProduceMarker { token }));
//! m.handle(0, Event::MarkerProduced { token }, t0);
//! assert_eq!(m.gate(0, t0), Gate::Owned(token));
//! m.handle(0, Event::MarkerApplied { token, mine: true }, t0);
//! assert!(m.serving(0, t0).is_some());
//! // Past the deadline (send time + TTL) it stops at once, asking no one.
//! assert!(m.serving(0, t0 + ttl).is_none());
//! ```

use std::time::Duration;

mod error;
mod machine;
mod outcomes;
pub mod ports;

pub use error::ClusterError;
pub use machine::{Action, Event, Gate, Machine, Owned, OwnerLeaseId, StopReason};
pub use outcomes::Outcomes;
pub use ports::{Clock, KeepAlive, OwnerLeases, RecordLog, SystemClock, Taken};

/// TTL asked for a partition-owner lease: how long a paused or dead node
/// keeps its partitions from the others.
pub const OWNER_TTL: Duration = Duration::from_secs(3);
