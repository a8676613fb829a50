use palisade_core::codec::CodecError;
use palisade_core::{ClockDrift, FencingToken, PartitionId, Scope, TwinId};
use palisade_lease::LeaseError;
use palisade_twin::PatchError;

use crate::commit::StorageFailure;

/// Why an append was refused. Every refusal leaves the store unchanged: the
/// whole request is checked before any of it is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendError {
    #[error("stale fencing token {token}: a later grant covering this twin has been seen (fence {fence})")]
    Stale {
        token: FencingToken,
        fence: FencingToken,
    },
    #[error("fencing token {token} was never issued by this store")]
    NotIssued { token: FencingToken },
    #[error("fencing token {token} was granted on {scope}, which does not cover twin {twin:?}")]
    WrongScope {
        token: FencingToken,
        scope: Scope,
        twin: TwinId,
    },
    #[error("If-Match {expected} does not match the twin's current version {current}")]
    VersionMismatch { expected: u64, current: u64 },
    #[error(transparent)]
    ClockDrift(#[from] ClockDrift),
    #[error("bad patch: {0}")]
    BadPatch(#[from] PatchError),
    #[error("bad event: {0}")]
    BadEvent(String),
    /// A record could not be read (a damaged twin record, a sled read
    /// error): this request is refused, the store goes on.
    #[error("storage failed, nothing was acknowledged: {0}")]
    Storage(String),
    /// The store stopped acknowledging writes after a storage failure
    /// (fail-stop): HTTP 503 until it is restarted.
    #[error(transparent)]
    StorageFailed(#[from] StorageFailure),
    #[error("the store is shutting down")]
    Closed,
    /// Cluster mode: this node does not (or no longer) serve the twin's
    /// partition, or its record could not be produced to Kafka.
    #[error("{0}")]
    NotServing(String),
}

impl AppendError {
    /// A short, stable name for metrics and error bodies.
    pub fn reason(&self) -> &'static str {
        match self {
            AppendError::Stale { .. } => "stale_token",
            AppendError::NotIssued { .. } => "token_not_issued",
            AppendError::WrongScope { .. } => "token_scope_mismatch",
            AppendError::VersionMismatch { .. } => "version_mismatch",
            AppendError::ClockDrift(_) => "clock_drift",
            AppendError::BadPatch(_) => "bad_patch",
            AppendError::BadEvent(_) => "bad_event",
            AppendError::Storage(_) => "storage",
            AppendError::StorageFailed(_) => "storage_failed",
            AppendError::Closed => "closed",
            AppendError::NotServing(_) => "not_serving",
        }
    }
}

/// Why a lease operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseOpError {
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(
        "scope {scope} names partition {partition}, but this store has {partitions} partitions"
    )]
    UnknownPartition {
        scope: Scope,
        partition: PartitionId,
        partitions: u32,
    },
    #[error("lease storage failed: {0}")]
    Storage(String),
    /// The store stopped acknowledging writes after a storage failure.
    #[error(transparent)]
    StorageFailed(#[from] StorageFailure),
    /// The remote lease authority (etcd) could not be reached.
    #[error("{0}")]
    Unavailable(String),
    #[error("the store is shutting down")]
    Closed,
}

/// Why the store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot open the sled database at {path}: {source}. If the process was killed, see docs/operations.md (recovery)")]
    Sled { path: String, source: sled::Error },
    #[error("the data folder {path} is in use: another process (or a store not yet released in this one) holds sled's lock on its db file; waited {waited_ms} ms. Stop the other `palisade serve` first")]
    InUse { path: String, waited_ms: u64 },
    #[error("the store at {path} was created with {stored} partitions; it cannot be opened with {requested} (the partition of a twin depends on the count)")]
    PartitionCount {
        path: String,
        stored: u32,
        requested: u32,
    },
    #[error("a store needs between 1 and {max} partitions, got {got}")]
    BadPartitionCount { got: u32, max: u32 },
    #[error("the store at {path} has on-disk format {found}; this build reads format {supported}")]
    Format {
        path: String,
        found: u8,
        supported: u8,
    },
    #[error("damaged record in {tree} under key {key:02x?}: {source}")]
    Damaged {
        tree: String,
        key: Vec<u8>,
        source: CodecError,
    },
    #[error("lease authority: {0}")]
    Lease(#[from] palisade_lease::AuthorityError),
    /// The store's tokens came from another lease backend than the one it
    /// was opened with (message unchanged from the check's own).
    #[error(transparent)]
    Backend(#[from] crate::BackendError),
    #[error("cannot start the store's threads: {0}")]
    Thread(std::io::Error),
    #[error("cannot recover the store's write-ahead log: {0}. See docs/operations.md (recovery)")]
    Wal(#[from] crate::commit::RecoverError),
    #[error("cannot start the store's write-ahead log: {0}")]
    WalStart(#[from] crate::wal::WalError),
}

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("partition {partition} does not exist; this store has {partitions}")]
    UnknownPartition { partition: u32, partitions: u32 },
    #[error("storage failed: {0}")]
    Storage(#[from] sled::Error),
    #[error("damaged record under key {key:02x?}: {source}")]
    Damaged { key: Vec<u8>, source: CodecError },
    /// Cluster mode: the partition was loaded from a partition snapshot
    /// and its history up to `through` is still being written.
    #[error("partition {partition}'s history up to seq {through} is still being written from a partition snapshot; retry in a moment (current state reads work)")]
    HistoryLoading { partition: u32, through: u64 },
}

/// Why a dead outbox effect was not removed ([`crate::Store::outbox_remove_dead`]).
#[derive(Debug, thiserror::Error)]
pub enum OutboxRemoveError {
    #[error("no outbox effect at partition {partition}, seq {seq}, index {index}")]
    NotFound {
        partition: u32,
        seq: u64,
        index: u16,
    },
    /// Only dead effects are removed: a pending one is still being
    /// delivered, a delivered one goes by the retention.
    #[error("the effect is {state}, not dead: only dead effects can be removed")]
    NotDead { state: &'static str },
    /// Cluster mode: delivery states come from the partition's log, so a
    /// removal would have to be a record of it (not built).
    /// Cluster mode: this node does not serve the effect's partition (ask
    /// its owner), or lost it before the removal was applied.
    #[error("{0}")]
    NotServing(String),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Storage(#[from] crate::StorageFailure),
}
