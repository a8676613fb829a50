//! The store's side of a lease authority outside it (etcd) and of cluster
//! mode: keeping the authority a store's tokens came from (checked at open),
//! registering what a remote authority grants with the partition writers,
//! and routing appends through the cluster
//! (docs/decisions/0011-etcd-lease-authority.md,
//! docs/decisions/0025-lease-backend-at-open.md). The lease operations
//! themselves are dispatched in leases.rs.

use std::sync::Arc;

use std::path::Path;

use palisade_core::{BoxFuture, FencingToken, NewEvent, PartitionId, Scope, TwinId};
use tokio::sync::oneshot;

use crate::error::{AppendError, LeaseOpError, OpenError};
use crate::leases::LeaseBackend;
use crate::writer::Command;
use crate::{Appended, Store};

/// Meta key naming the lease authority a store's tokens come from. Tokens of
/// two authorities are two unrelated counters: mixing them in one store
/// would let a token number mean two grants, so a store keeps one.
pub(crate) const LEASE_BACKEND_KEY: &[u8] = b"lease_backend";

/// Why a store cannot use the lease authority it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("this store's fencing tokens came from the {recorded} lease authority; it cannot switch to {requested} (token numbers of two authorities collide). Use a new data folder, or the {recorded} backend")]
    Mismatch { recorded: String, requested: String },
    /// `route_appends` was called twice.
    #[error("this store's appends are already routed through the cluster")]
    AlreadySet,
    #[error("store metadata: {0}")]
    Storage(String),
}

/// Cluster mode: where [`Store::append`] sends appends instead of the
/// partition writer (produce to Kafka, answer once applied). `effects` as
/// [`Store::append_with_effects`] takes them (empty, or one list per
/// event): they travel in the record, and the applying node records them
/// in the outbox in the event's fenced round.
pub trait AppendRoute: Send + Sync + std::fmt::Debug {
    /// Append for `principal` (authentication on), as
    /// [`Store::append_for`](crate::Store::append_for).
    fn append(
        &self,
        principal: Option<String>,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        effects: Vec<Vec<palisade_core::effect::Effect>>,
        if_match: Option<u64>,
    ) -> BoxFuture<'_, Result<Appended, AppendError>>;

    /// Remove a dead outbox effect through the partition's log (a
    /// `palisade-control: outbox-remove` record every node applies); the
    /// entry as it was.
    fn remove_dead_effect(
        &self,
        partition: u32,
        seq: u64,
        index: u16,
    ) -> BoxFuture<'_, Result<crate::OutboxEntry, crate::OutboxRemoveError>>;
}

/// Tree of cluster-mode state: each partition's owner fence.
pub(crate) const CLUSTER_TREE: &str = "cluster";

impl Store {
    /// Send every append through `route` from now on (cluster mode; once,
    /// at start-up).
    pub fn route_appends(&self, route: Arc<dyn AppendRoute>) -> Result<(), BackendError> {
        self.append_route
            .set(route)
            .map_err(|_| BackendError::AlreadySet)
    }

    /// The highest owner token seen in partition `p`'s source log (cluster
    /// mode): records produced under a lower owner token are refused.
    pub fn owner_fence(&self, p: PartitionId) -> Result<u64, sled::Error> {
        crate::writer::owner_fence_in(&self.trees.cluster, p)
    }

    /// Raise partition `p`'s owner fence to `token` (never lowers it),
    /// durably, before returning: decided by the partition's state machine,
    /// in the order of its other writes.
    pub async fn raise_owner_fence(&self, p: PartitionId, token: u64) -> Result<(), AppendError> {
        if p.0 >= self.partitions {
            return Err(AppendError::BadEvent(format!(
                "partition {p} does not exist; the store has {} partitions",
                self.partitions
            )));
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::OwnerFence {
            partition: p,
            token,
            reply,
        })
        .map_err(|_| AppendError::Closed)?;
        rx.await.map_err(|_| AppendError::Closed)?
    }

    /// The lease authority recorded for this store's tokens: `"embedded"`
    /// unless a remote one was bound to it.
    pub fn lease_backend(&self) -> Result<String, BackendError> {
        Ok(
            match self
                .trees
                .meta
                .get(LEASE_BACKEND_KEY)
                .map_err(|e| BackendError::Storage(e.to_string()))?
            {
                Some(v) => String::from_utf8_lossy(&v).into_owned(),
                None => "embedded".to_owned(),
            },
        )
    }

    /// Register a grant made elsewhere (by a remote authority, possibly
    /// through another node) with the writer that enforces its scope: the
    /// token becomes valid for the scope and the scope's fence is raised to
    /// it, durably, before this returns. Idempotent.
    pub async fn register_grant(
        &self,
        token: FencingToken,
        scope: Scope,
        holder: String,
    ) -> Result<(), LeaseOpError> {
        let p = scope.partition(self.partitions);
        if p.0 >= self.partitions {
            return Err(LeaseOpError::UnknownPartition {
                scope,
                partition: p,
                partitions: self.partitions,
            });
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Grant {
            token,
            scope,
            holder,
            reply,
        })
        .map_err(|_| LeaseOpError::Closed)?;
        rx.await.map_err(|_| LeaseOpError::Closed)?
    }
}

/// At open: refuse a lease backend other than the one the store's tokens
/// came from, and record a remote one for a store that has none yet
/// (written straight to sled and synced, before the sequencer starts, like
/// the store's creation). Tokens of two authorities are unrelated counters.
pub(crate) fn check_backend(
    db: &sled::Db,
    path: &Path,
    meta: &sled::Tree,
    backend: &LeaseBackend,
    embedded_last: FencingToken,
) -> Result<(), OpenError> {
    let sled_err = |source| OpenError::Sled {
        path: path.display().to_string(),
        source,
    };
    let requested = backend.name();
    let recorded = match meta.get(LEASE_BACKEND_KEY).map_err(sled_err)? {
        Some(v) => String::from_utf8_lossy(&v).into_owned(),
        None => "embedded".to_owned(),
    };
    if recorded == requested {
        return Ok(());
    }
    // Only a store whose embedded authority never granted may take a
    // remote one; nothing may go back to embedded or switch remotes.
    if recorded != "embedded" || embedded_last.0 > 0 {
        return Err(BackendError::Mismatch {
            recorded,
            requested: requested.into(),
        }
        .into());
    }
    meta.insert(LEASE_BACKEND_KEY, requested.as_bytes())
        .map_err(sled_err)?;
    db.flush().map_err(sled_err)?;
    crate::commit::sync_sled_files(path, &std::sync::Mutex::default())
        .map_err(|e| sled_err(sled::Error::Io(e)))?;
    Ok(())
}
