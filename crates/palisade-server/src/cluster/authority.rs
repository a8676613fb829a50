//! Cluster mode's lease authority: etcd's, with every grant also written to
//! the scope's partition in Kafka.

use std::sync::Arc;

use palisade_core::{BoxFuture, FencingToken, LeaseId, Scope};
use palisade_kafka::cluster::{CONTROL_HEADER, HOLDER_HEADER, SCOPE_HEADER};
use palisade_lease::{AcquireRequest, Lease, Millis, RemoteAuthority, RemoteError};

use super::Node;

/// etcd leases whose grants reach the partition writers through Kafka: a
/// grant record in the scope's partition, applied in log order by whichever
/// node owns it (and by every node that replays it later).
#[derive(Debug)]
pub(super) struct ClusterAuthority {
    node: Arc<Node>,
}

impl ClusterAuthority {
    pub(super) fn new(node: Arc<Node>) -> Self {
        Self { node }
    }

    async fn acquire_and_log(&self, req: AcquireRequest) -> Result<Lease, RemoteError> {
        let lease = self.node.authority.acquire(req).await?;
        let p = lease.scope.partition(self.node.store.partitions()).0;
        let headers = vec![
            (CONTROL_HEADER, "grant".to_owned()),
            (
                palisade_kafka::decode::TOKEN_HEADER,
                lease.token.0.to_string(),
            ),
            (SCOPE_HEADER, lease.scope.to_string()),
            (HOLDER_HEADER, lease.holder.clone()),
        ];
        if let Err(e) = self.node.log.produce(p, None, Vec::new(), headers).await {
            // Nobody got the token: give the lease back.
            let _ = self.node.authority.release(lease.id).await;
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
        Box::pin(self.acquire_and_log(req))
    }
    fn renew(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        self.node.authority.renew(id)
    }
    fn release(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        self.node.authority.release(id)
    }
    fn scope_of_token(&self, token: FencingToken) -> BoxFuture<'_, Option<Scope>> {
        self.node.authority.scope_of_token(token)
    }
    fn holder_of(&self, scope: &Scope) -> Option<Lease> {
        self.node.authority.holder_of(scope)
    }
    fn lease(&self, id: LeaseId) -> Option<Lease> {
        self.node.authority.lease(id)
    }
    fn live_leases_of(&self, holder: &str) -> usize {
        self.node.authority.live_leases_of(holder)
    }
    fn now(&self) -> Millis {
        self.node.authority.now()
    }
    fn registers_grants(&self) -> bool {
        true
    }
}
