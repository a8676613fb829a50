//! Palisade's shared vocabulary: twin ids, fencing tokens, lease scopes, HLC
//! timestamps, events, Kafka's partitioner and the on-disk codec.
//!
//! Nothing here does I/O; every other crate builds on these types.
//!
//! ```
//! use palisade_core::{partition_for, Scope, TwinId};
//!
//! let twin = TwinId::new("device-7").unwrap();
//! let p = partition_for(&twin, 16);
//! assert!(Scope::Partition(p).covers(&twin, p));
//! assert_eq!("partition/3".parse::<Scope>().unwrap(), Scope::Partition(3.into()));
//! ```

pub mod codec;
pub mod effect;
mod event;
mod hlc;
mod ids;
pub mod json;
mod partition;
mod purpose;

pub use event::{
    check_event_fields, Event, EventFieldError, NewEvent, MAX_EVENT_ID_LEN, MAX_EVENT_TYPE_LEN,
};
pub use hlc::{Clock, ClockDrift, Hlc, HlcParseError};
pub use ids::{
    excerpt, FencingToken, IdError, LeaseId, PartitionId, Scope, TwinId, EXCERPT_CHARS,
    MAX_TWIN_ID_LEN,
};
pub use partition::{murmur2, partition_for};
pub use purpose::{Purpose, PurposeError};

/// A boxed, sendable future: the workspace's traits used as trait objects
/// (`dyn RemoteAuthority`, `dyn Ownership`, `dyn ClusterRouting`, ...)
/// return it, since `async fn` in a trait makes it not object-safe. One
/// alias for every crate (the `futures` crate is not in the tree).
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
