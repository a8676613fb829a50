//! Values stored in a partition tree (besides `palisade_core::Event`).

use bincode::{Decode, Encode};
use palisade_core::{FencingToken, Hlc, Scope};
use palisade_twin::TwinState;

/// One twin's current record: its fence, version and materialized state.
/// Rewritten in the same batch as every event it admits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Encode, Decode)]
pub(crate) struct TwinRecord {
    /// fence(k): the highest token accepted for the twin or granted on a
    /// twin-scoped lease for it.
    pub fence: u64,
    /// Sequence number of the twin's latest event (0: none yet). The twin's
    /// ETag and the value `If-Match` compares with.
    pub version: u64,
    /// Number of events of the twin, for snapshot spacing.
    pub events: u64,
    pub state: TwinState,
}

/// A twin's state as of one of its events, so that time travel replays at
/// most `snapshot_every` events.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub(crate) struct Snapshot {
    /// Greatest HLC among the events folded in: an `at_hlc` query may start
    /// from this snapshot only if it is at or after this time.
    pub max_hlc: Option<Hlc>,
    pub state: TwinState,
}

/// A lease grant whose scope this partition enforces: the token is valid for
/// writes here only if it is recorded here.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub(crate) struct TokenGrant {
    pub scope: Scope,
    pub holder: String,
}

/// The partition's own fence and head.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub(crate) struct PartitionMeta {
    /// fence(p): highest token granted on a partition-scoped lease for this
    /// partition or accepted from such a lease's holder.
    pub fence: u64,
    /// Sequence number of the latest event (0: empty).
    pub head: u64,
    /// Greatest HLC of any event in the partition. On open the store's clock
    /// is moved past it, so that an event stamped after a restart is never
    /// ordered before one accepted (up to the allowed drift ahead) before it.
    pub max_hlc: Option<Hlc>,
}

impl PartitionMeta {
    pub fn fence(&self) -> FencingToken {
        FencingToken(self.fence)
    }
}
