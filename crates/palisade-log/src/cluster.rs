//! The store's side of a lease authority outside it (etcd) and of cluster
//! mode: choosing the authority, asking it, and registering what it grants
//! with the partition writers (docs/decisions/0011-etcd-lease-authority.md).
//! Kept out of store.rs so the hooks there stay one line each.

use std::sync::Arc;

use palisade_core::{BoxFuture, FencingToken, LeaseId, NewEvent, PartitionId, Scope, TwinId};
use palisade_lease::{AcquireRequest, Lease, RemoteAuthority, RemoteError};
use tokio::sync::oneshot;
use tracing::warn;

use crate::error::{AppendError, LeaseOpError};
use crate::wal::TreeId;
use crate::writer::{Command, RawWrite};
use crate::{Appended, Store};

/// Meta key naming the lease authority a store's tokens come from. Tokens of
/// two authorities are two unrelated counters: mixing them in one store
/// would let a token number mean two grants, so a store keeps one.
const LEASE_BACKEND_KEY: &[u8] = b"lease_backend";

/// Why a store cannot use the lease authority it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("this store's fencing tokens came from the {recorded} lease authority; it cannot switch to {requested} (token numbers of two authorities collide). Use a new data folder, or the {recorded} backend")]
    Mismatch { recorded: String, requested: String },
    #[error("a lease authority is already in use by this store")]
    AlreadySet,
    #[error("store metadata: {0}")]
    Storage(String),
}

/// Cluster mode: where [`Store::append`] sends appends instead of the
/// partition writer (produce to Kafka, answer once applied).
pub trait AppendRoute: Send + Sync + std::fmt::Debug {
    fn append(
        &self,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        if_match: Option<u64>,
    ) -> BoxFuture<'_, Result<Appended, AppendError>>;
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

    /// Check that the embedded authority may serve this store: refused if
    /// the store's tokens came from a remote one.
    pub fn check_embedded_backend(&self) -> Result<(), BackendError> {
        match self.lease_backend()? {
            b if b == "embedded" => Ok(()),
            recorded => Err(BackendError::Mismatch {
                recorded,
                requested: "embedded".into(),
            }),
        }
    }

    /// Hand every lease operation to `authority` from now on (once, at
    /// start-up, before serving). Refused for a store whose tokens came from
    /// another authority; a new store records the choice durably.
    pub async fn use_remote_authority(
        &self,
        authority: Arc<dyn RemoteAuthority>,
    ) -> Result<(), BackendError> {
        let name = authority.name();
        let recorded = self.lease_backend()?;
        let embedded_used = self.authority().last_token().0 > 0;
        if recorded != name && (recorded != "embedded" || embedded_used) {
            return Err(BackendError::Mismatch {
                recorded,
                requested: name.into(),
            });
        }
        if recorded != name {
            let (reply, rx) = oneshot::channel();
            self.send(Command::Write {
                writes: vec![RawWrite {
                    tree: TreeId::META,
                    key: LEASE_BACKEND_KEY.to_vec(),
                    value: Some(name.as_bytes().to_vec()),
                }],
                reply: Some(reply),
            })
            .map_err(|_| BackendError::Storage("the store is shutting down".into()))?;
            rx.await
                .map_err(|_| BackendError::Storage("the store is shutting down".into()))?
                .map_err(|e| BackendError::Storage(e.to_string()))?;
        }
        self.remote
            .set(authority)
            .map_err(|_| BackendError::AlreadySet)
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

    pub(crate) async fn remote_acquire(
        &self,
        remote: &dyn RemoteAuthority,
        req: AcquireRequest,
    ) -> Result<Lease, LeaseOpError> {
        let before = self.last_token();
        let lease = remote
            .acquire(req)
            .await
            .map_err(|e| self.remote_failure(e))?;
        if lease.token <= before {
            // Only after a store was moved to a fresh authority; the fence
            // refuses such tokens (never regress), so say why.
            warn!(token = lease.token.0, last = before.0, authority = remote.name(), "the authority granted a token at or below one this store has seen; writes with it will be refused as stale");
        }
        Ok(lease)
    }

    pub(crate) async fn remote_renew(
        &self,
        remote: &dyn RemoteAuthority,
        id: LeaseId,
    ) -> Result<Lease, LeaseOpError> {
        let lease = remote.renew(id).await.map_err(|e| self.remote_failure(e))?;
        self.metrics()
            .lease_renewals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(lease)
    }

    pub(crate) async fn remote_release(
        &self,
        remote: &dyn RemoteAuthority,
        id: LeaseId,
    ) -> Result<Lease, LeaseOpError> {
        let lease = remote
            .release(id)
            .await
            .map_err(|e| self.remote_failure(e))?;
        self.metrics()
            .lease_releases
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(lease)
    }

    fn remote_failure(&self, e: RemoteError) -> LeaseOpError {
        match e {
            RemoteError::Lease(l) => self.lease_failure(palisade_lease::AuthorityError::Lease(l)),
            RemoteError::Unavailable { .. } => {
                self.metrics().lease_refused("unavailable");
                LeaseOpError::Unavailable(e.to_string())
            }
        }
    }
}
