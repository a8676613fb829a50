//! Partition-owner leases of cluster mode (docs/decisions/0012-cluster-mode.md):
//! the key `<prefix>owner/<p, 5 digits>`, created only if absent, on a
//! short etcd lease; its create revision is the node's owner token.

use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use palisade_cluster::{ClusterError, KeepAlive, OwnerLeaseId, OwnerLeases, Taken};
use palisade_core::{BoxFuture, FencingToken};

use crate::EtcdAuthority;

fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> ClusterError {
    move |e| ClusterError::OwnerLease {
        op,
        source: Box::new(e),
    }
}

impl EtcdAuthority {
    /// The owner key of partition `p`.
    pub fn owner_key(&self, p: u32) -> String {
        format!("{}owner/{p:05}", self.cfg.prefix)
    }

    async fn take_owner(
        &self,
        p: u32,
        value: Vec<u8>,
        ttl: Duration,
    ) -> Result<Taken, ClusterError> {
        let mut c = self.client.clone();
        let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = c.lease_grant(ttl_s, None).await.map_err(etcd("grant"))?;
        let key = self.owner_key(p);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    key.clone(),
                    value,
                    Some(PutOptions::new().with_lease(lease.id())),
                ),
                TxnOp::get(key, None),
            ]);
        let resp = match c.txn(txn).await {
            Ok(r) => r,
            Err(e) => {
                let _ = c.lease_revoke(lease.id()).await;
                return Err(etcd("take")(e));
            }
        };
        if !resp.succeeded() {
            // Held by another node: the lease just granted is not needed.
            let _ = c.lease_revoke(lease.id()).await;
            return Ok(Taken::HeldElsewhere);
        }
        let token = resp
            .op_responses()
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(g) => {
                    g.kvs().first().map(etcd_client::KeyValue::create_revision)
                }
                _ => None,
            })
            .and_then(|r| u64::try_from(r).ok())
            .ok_or(ClusterError::Inconsistent(
                "the owner key vanished inside its own transaction",
            ))?;
        Ok(Taken::Taken {
            token: FencingToken(token),
            lease: OwnerLeaseId(lease.id()),
            ttl: Duration::from_secs(u64::try_from(lease.ttl()).unwrap_or(1)),
        })
    }

    async fn owner_value(&self, p: u32) -> Result<Option<Vec<u8>>, ClusterError> {
        let got = self
            .client
            .clone()
            .get(self.owner_key(p), None)
            .await
            .map_err(etcd("read owner"))?;
        Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
    }
}

/// An open keep-alive stream on one owner lease.
struct EtcdKeepAlive {
    lease: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

impl KeepAlive for EtcdKeepAlive {
    fn renew(&mut self) -> BoxFuture<'_, Result<Duration, ClusterError>> {
        Box::pin(async move {
            self.keeper.keep_alive().await.map_err(etcd("keep-alive"))?;
            match self.stream.message().await.map_err(etcd("keep-alive"))? {
                Some(r) if r.ttl() > 0 => {
                    Ok(Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(1)))
                }
                // A TTL of 0 (or the stream closed): etcd let it expire.
                _ => Err(ClusterError::LeaseGone(self.lease)),
            }
        })
    }
}

impl OwnerLeases for EtcdAuthority {
    fn take(
        &self,
        partition: u32,
        value: Vec<u8>,
        ttl: Duration,
    ) -> BoxFuture<'_, Result<Taken, ClusterError>> {
        Box::pin(self.take_owner(partition, value, ttl))
    }

    fn keep_alive(
        &self,
        lease: OwnerLeaseId,
    ) -> BoxFuture<'_, Result<Box<dyn KeepAlive>, ClusterError>> {
        Box::pin(async move {
            let (keeper, stream) = self
                .client
                .clone()
                .lease_keep_alive(lease.0)
                .await
                .map_err(etcd("keep-alive"))?;
            Ok(Box::new(EtcdKeepAlive {
                lease: lease.0,
                keeper,
                stream,
            }) as Box<dyn KeepAlive>)
        })
    }

    fn revoke(&self, lease: OwnerLeaseId) -> BoxFuture<'_, Result<(), ClusterError>> {
        Box::pin(async move {
            self.client
                .clone()
                .lease_revoke(lease.0)
                .await
                .map(|_| ())
                .map_err(etcd("revoke"))
        })
    }

    fn owner(&self, partition: u32) -> BoxFuture<'_, Result<Option<Vec<u8>>, ClusterError>> {
        Box::pin(self.owner_value(partition))
    }
}

/// Cluster members (`<prefix>nodes/<node>`): each node's record, on an etcd
/// lease of its own kept alive while it runs, so the key goes when the node
/// does. The cluster-wide views ask every member, not only the owners of a
/// partition, and a node starting checks its settings against the others'.
impl EtcdAuthority {
    fn member_key(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.cfg.prefix)
    }

    /// Every live member's record: (node, value).
    pub async fn members(&self) -> Result<Vec<(String, Vec<u8>)>, ClusterError> {
        let prefix = format!("{}nodes/", self.cfg.prefix);
        let got = self
            .client
            .clone()
            .get(
                prefix.clone(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .map_err(etcd("read members"))?;
        Ok(got
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                Some((key.strip_prefix(&prefix)?.to_owned(), kv.value().to_vec()))
            })
            .collect())
    }

    /// Put `node`'s record on a new lease of `ttl`: the lease, for
    /// [`OwnerLeases::keep_alive`] and [`OwnerLeases::revoke`].
    pub async fn register_member(
        &self,
        node: &str,
        value: Vec<u8>,
        ttl: Duration,
    ) -> Result<OwnerLeaseId, ClusterError> {
        let mut c = self.client.clone();
        let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = c.lease_grant(ttl_s, None).await.map_err(etcd("grant"))?;
        if let Err(e) = c
            .put(
                self.member_key(node),
                value,
                Some(PutOptions::new().with_lease(lease.id())),
            )
            .await
        {
            let _ = c.lease_revoke(lease.id()).await;
            return Err(etcd("register member")(e));
        }
        Ok(OwnerLeaseId(lease.id()))
    }
}
