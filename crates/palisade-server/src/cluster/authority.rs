//! Cluster mode's lease authority: etcd's, with every grant also written to
//! the scope's partition in Kafka.

use std::sync::{Arc, OnceLock};

use palisade_core::{BoxFuture, FencingToken, LeaseId, Scope};
use palisade_kafka::cluster::{CONTROL_HEADER, HOLDER_HEADER, SCOPE_HEADER};
use palisade_lease::{AcquireRequest, Lease, Millis, RemoteAuthority, RemoteError};

use super::Node;

/// etcd leases whose grants reach the partition writers through Kafka: a
/// grant record in the scope's partition, applied in log order by whichever
/// node owns it (and by every node that replays it later).
#[derive(Debug)]
pub(super) struct ClusterAuthority {
    /// The node, given once it is built on the store that was opened with
    /// this authority (the store comes first: the node needs it). Until
    /// then, which is before the server listens, every call is refused as
    /// unavailable.
    node: OnceLock<Arc<Node>>,
}

impl ClusterAuthority {
    pub(super) fn unbound() -> Self {
        Self {
            node: OnceLock::new(),
        }
    }

    /// Give the authority its node (once).
    pub(super) fn bind(&self, node: Arc<Node>) -> anyhow::Result<()> {
        self.node
            .set(node)
            .map_err(|_| anyhow::anyhow!("the cluster lease authority already has its node"))
    }

    fn node(&self) -> Result<&Node, RemoteError> {
        self.node
            .get()
            .map(AsRef::as_ref)
            .ok_or(RemoteError::Unavailable {
                authority: "etcd",
                detail: "the cluster node is not started yet".into(),
            })
    }

    /// Grant through etcd (with its owner recorded there first, when
    /// authentication is on), then write the grant record: a node applying
    /// the record can always find the token's owner in etcd.
    async fn acquire_and_log(
        &self,
        req: AcquireRequest,
        owner: Option<String>,
    ) -> Result<Lease, RemoteError> {
        let node = self.node()?;
        let lease = node.authority.acquire_for(req, owner).await?;
        let p = lease.scope.partition(node.store.partitions()).0;
        let headers = vec![
            (CONTROL_HEADER, "grant".to_owned()),
            (
                palisade_kafka::decode::TOKEN_HEADER,
                lease.token.0.to_string(),
            ),
            (SCOPE_HEADER, lease.scope.to_string()),
            (HOLDER_HEADER, lease.holder.clone()),
        ];
        if let Err(e) = node.log.produce(p, None, Vec::new(), headers).await {
            // Nobody got the token: give the lease back.
            let _ = node.authority.release(lease.id).await;
            return Err(RemoteError::Unavailable {
                authority: "etcd",
                detail: format!("the grant could not be written to Kafka: {e}"),
            });
        }
        Ok(lease)
    }
}

impl RemoteAuthority for ClusterAuthority {
    fn name(&self) -> &'static str {
        "etcd"
    }
    fn acquire(&self, req: AcquireRequest) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.acquire_and_log(req, None))
    }
    fn acquire_for(
        &self,
        req: AcquireRequest,
        owner: Option<String>,
    ) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.acquire_and_log(req, owner))
    }
    fn token_owner(
        &self,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        match self.node() {
            Ok(node) => node.authority.token_owner(token),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn lease_owner(&self, id: LeaseId) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        match self.node() {
            Ok(node) => node.authority.lease_owner(id),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn renew(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        match self.node() {
            Ok(node) => node.authority.renew(id),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn release(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        match self.node() {
            Ok(node) => node.authority.release(id),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn scope_of_token(&self, token: FencingToken) -> BoxFuture<'_, Option<Scope>> {
        match self.node() {
            Ok(node) => node.authority.scope_of_token(token),
            Err(_) => Box::pin(std::future::ready(None)),
        }
    }
    fn holder_of(&self, scope: &Scope) -> Option<Lease> {
        self.node().ok()?.authority.holder_of(scope)
    }
    fn lease(&self, id: LeaseId) -> Option<Lease> {
        self.node().ok()?.authority.lease(id)
    }
    fn live_leases_of(&self, holder: &str) -> usize {
        self.node()
            .map_or(0, |n| n.authority.live_leases_of(holder))
    }
    fn now(&self) -> Millis {
        // Unbound, no lease of this authority exists to compare with.
        self.node().map_or(Millis(0), |n| n.authority.now())
    }
    fn registers_grants(&self) -> bool {
        true
    }
}
