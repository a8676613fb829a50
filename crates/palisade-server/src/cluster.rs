//! `palisade serve` with a lease authority outside the store (etcd), and
//! cluster mode (docs/decisions/0011-etcd-lease-authority.md,
//! docs/decisions/0012-cluster-mode.md).

use std::sync::Arc;

use anyhow::Context;
use palisade_etcd::{EtcdAuthority, EtcdConfig};
use palisade_log::Store;
use tracing::info;

use crate::config::{LeaseBackend, ServeConfig};

/// Bind the configured lease authority to the store before it serves:
/// nothing for the embedded one (after checking the store's tokens came
/// from it), a connected etcd authority otherwise.
pub async fn bind_lease_backend(
    store: &Store,
    config: &ServeConfig,
) -> anyhow::Result<Option<Arc<EtcdAuthority>>> {
    match config.lease_backend {
        LeaseBackend::Embedded => {
            store.check_embedded_backend()?;
            Ok(None)
        }
        LeaseBackend::Etcd => {
            let mut cfg = EtcdConfig::new(config.etcd_endpoints.clone());
            cfg.prefix.clone_from(&config.etcd_prefix);
            let etcd = Arc::new(
                EtcdAuthority::connect(cfg)
                    .await
                    .context("lease backend etcd")?,
            );
            if config.cluster_node.is_none() {
                store.use_remote_authority(etcd.clone()).await?;
            }
            info!(endpoints = ?config.etcd_endpoints, prefix = %config.etcd_prefix, "leases from etcd");
            Ok(Some(etcd))
        }
    }
}

// ---------------------------------------------------------------------------
// Cluster mode (docs/decisions/0012-cluster-mode.md)
// ---------------------------------------------------------------------------

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use palisade_core::{FencingToken, LeaseId, NewEvent, Scope, TwinId};
use palisade_etcd::etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use palisade_http::cluster::{ClusterRouting, Route};
use palisade_kafka::cluster::{
    Admission, Applied, Ownership, CONTROL_HEADER, HOLDER_HEADER, NODE_HEADER, OWNER_TOKEN_HEADER,
    SCOPE_HEADER,
};
use palisade_lease::{AcquireRequest, Lease, Millis, RemoteAuthority, RemoteError};
use palisade_log::{AppendError, AppendRoute, Appended, IngestOutcome};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::watch;
use tracing::warn;

/// TTL of a partition-owner lease in etcd, in seconds: how long a paused or
/// dead node keeps its partitions from the others.
const OWNER_TTL_S: i64 = 3;
/// How long an HTTP append waits for its record to be applied.
const APPEND_WAIT: Duration = Duration::from_secs(30);
/// Outcomes remembered for appends waiting on them.
const OUTCOMES_KEPT: usize = 65_536;

/// Recent outcomes by (partition, offset), and their insertion order (for
/// eviction).
type Outcomes = (HashMap<(u32, u64), Applied>, VecDeque<(u32, u64)>);

/// A partition-owner lease held by this node.
#[derive(Debug, Clone, Copy)]
struct Owned {
    token: FencingToken,
    lease: i64,
    /// Local, conservative end of the lease: the send time of the last
    /// successful keep-alive plus the TTL. Past it the node stops at once,
    /// without asking anyone (a paused node wakes up past it).
    deadline: Instant,
}

#[derive(Debug, Default, Clone, Copy)]
struct Part {
    assigned: bool,
    owned: Option<Owned>,
    /// Caught up: this node's own owner marker has been applied, so every
    /// record before its takeover is in its store.
    serving: bool,
}

impl Part {
    fn live(&self) -> Option<Owned> {
        self.owned.filter(|o| Instant::now() < o.deadline)
    }
}

/// This node in cluster mode: partition ownership (etcd owner leases),
/// routing of requests, appends through Kafka, grants through Kafka.
pub struct Node {
    /// Itself, for the keep-alive tasks it spawns.
    me: std::sync::Weak<Node>,
    id: String,
    url: OnceLock<String>,
    etcd: Arc<EtcdAuthority>,
    store: Arc<Store>,
    producer: FutureProducer,
    topic: String,
    runtime: tokio::runtime::Handle,
    parts: Mutex<HashMap<u32, Part>>,
    outcomes: Mutex<Outcomes>,
    handled: watch::Sender<u64>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct OwnerValue {
    node: String,
    url: String,
}

impl Node {
    /// The cluster node of `palisade serve --cluster-node`, bound to the
    /// store (its leases and appends go through the node from now on).
    pub async fn start(
        store: Arc<Store>,
        config: &ServeConfig,
        etcd: Arc<EtcdAuthority>,
    ) -> anyhow::Result<Arc<Self>> {
        let id = config
            .cluster_node
            .clone()
            .context("cluster mode needs --cluster-node")?;
        let brokers = config
            .kafka_brokers
            .clone()
            .context("cluster mode needs --kafka-brokers")?;
        let mut pc = rdkafka::ClientConfig::new();
        pc.set("bootstrap.servers", &brokers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "10000");
        // The consumer's settings, less those librdkafka's producer warns
        // about (TLS and SASL settings apply to both).
        for (k, v) in palisade_kafka::cluster::producer_settings(&config.kafka_settings) {
            pc.set(k, v);
        }
        let producer = pc.create().context("kafka producer")?;
        let node = Arc::new_cyclic(|me| Self {
            me: me.clone(),
            id,
            url: OnceLock::new(),
            etcd,
            store: store.clone(),
            producer,
            topic: config.kafka_topic.clone(),
            runtime: tokio::runtime::Handle::current(),
            parts: Mutex::new(HashMap::new()),
            outcomes: Mutex::new((HashMap::new(), VecDeque::new())),
            handled: watch::channel(0).0,
        });
        if let Some(u) = &config.cluster_advertise {
            let _ = node.url.set(u.clone());
        }
        store
            .use_remote_authority(Arc::new(ClusterAuthority { node: node.clone() }))
            .await?;
        store.route_appends(node.clone())?;
        info!(node = %node.id, "cluster mode");
        Ok(node)
    }

    /// The URL others reach this node at (default: http:// + listen address).
    pub fn set_listen_addr(&self, addr: SocketAddr) {
        let _ = self.url.set(format!("http://{addr}"));
    }

    fn url(&self) -> String {
        self.url.get().cloned().unwrap_or_default()
    }

    fn parts(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Part>> {
        self.parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn owner_key(&self, p: u32) -> String {
        format!("{}owner/{p:05}", self.etcd.prefix())
    }

    /// Produce one record to partition `p`, acks=all; its offset.
    async fn produce(
        &self,
        p: u32,
        key: Option<&[u8]>,
        value: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<u64, String> {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic)
            .partition(i32::try_from(p).map_err(|e| e.to_string())?)
            .payload(value)
            .headers(h);
        if let Some(k) = key {
            rec = rec.key(k);
        }
        match self.producer.send(rec, Duration::from_secs(10)).await {
            Ok(d) => u64::try_from(d.offset).map_err(|e| e.to_string()),
            Err((e, _)) => Err(e.to_string()),
        }
    }

    /// Take p's owner lease (create-if-absent on the owner key) and write
    /// the owner marker. `Ok(None)`: another node holds it.
    async fn take(self: &Arc<Self>, p: u32) -> Result<Option<Owned>, String> {
        let mut c = self.etcd.client();
        let lease = c
            .lease_grant(OWNER_TTL_S, None)
            .await
            .map_err(|e| e.to_string())?;
        let sent = Instant::now();
        let ttl = Duration::from_secs(u64::try_from(lease.ttl()).unwrap_or(1));
        let key = self.owner_key(p);
        let value = serde_json::to_vec(&OwnerValue {
            node: self.id.clone(),
            url: self.url(),
        })
        .map_err(|e| e.to_string())?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    key.clone(),
                    value,
                    Some(PutOptions::new().with_lease(lease.id())),
                ),
                TxnOp::get(key.clone(), None),
            ]);
        let resp = c.txn(txn).await.map_err(|e| e.to_string())?;
        if !resp.succeeded() {
            let _ = c.lease_revoke(lease.id()).await;
            return Ok(None);
        }
        let token = resp
            .op_responses()
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision()),
                _ => None,
            })
            .and_then(|r| u64::try_from(r).ok())
            .ok_or("the owner key vanished inside its own transaction")?;
        let owned = Owned {
            token: FencingToken(token),
            lease: lease.id(),
            deadline: sent + ttl,
        };
        info!(partition = p, owner_token = token, node = %self.id, "cluster: took the partition-owner lease");
        // The marker: from its place in the log on, a former owner's late
        // writes are refused; once applied here, this node serves p.
        let t = token.to_string();
        if let Err(e) = self
            .produce(
                p,
                None,
                b"",
                &[
                    (CONTROL_HEADER, "owner"),
                    (OWNER_TOKEN_HEADER, &t),
                    (NODE_HEADER, &self.id),
                ],
            )
            .await
        {
            let _ = c.lease_revoke(lease.id()).await;
            return Err(format!("owner marker not produced: {e}"));
        }
        self.runtime.spawn(self.clone().keep_alive(p, owned));
        Ok(Some(owned))
    }

    /// Renew p's owner lease every TTL/3 while this node holds it; on any
    /// failure, stop applying and serving p at once.
    async fn keep_alive(self: Arc<Self>, p: u32, owned: Owned) {
        let period = Duration::from_millis(u64::try_from(OWNER_TTL_S).unwrap_or(3) * 1000 / 3);
        let mut c = self.etcd.client();
        let stream = c.lease_keep_alive(owned.lease).await;
        let Ok((mut keeper, mut stream)) = stream else {
            self.lose(p, owned.lease, "keep-alive could not start");
            return;
        };
        loop {
            tokio::time::sleep(period).await;
            if self.parts().get(&p).and_then(|s| s.owned).map(|o| o.lease) != Some(owned.lease) {
                return; // released or replaced
            }
            let sent = Instant::now();
            let ok = match keeper.keep_alive().await {
                Ok(()) => match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => Some(r.ttl()),
                    _ => None,
                },
                Err(_) => None,
            };
            match ok {
                Some(ttl) => {
                    let mut parts = self.parts();
                    if let Some(o) = parts.get_mut(&p).and_then(|s| s.owned.as_mut()) {
                        if o.lease == owned.lease && Instant::now() < o.deadline {
                            o.deadline =
                                sent + Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
                        }
                    }
                }
                None => {
                    self.lose(
                        p,
                        owned.lease,
                        "keep-alive failed (lease expired or etcd unreachable)",
                    );
                    return;
                }
            }
        }
    }

    fn lose(&self, p: u32, lease: i64, why: &str) {
        let mut parts = self.parts();
        if let Some(s) = parts.get_mut(&p) {
            if s.owned.map(|o| o.lease) == Some(lease) {
                warn!(partition = p, node = %self.id, why, "cluster: lost the partition-owner lease; stopped applying and serving it");
                s.owned = None;
                s.serving = false;
            }
        }
    }

    async fn outcome(&self, p: u32, offset: u64) -> Option<Applied> {
        let mut rx = self.handled.subscribe();
        let wait = async {
            loop {
                if let Some(a) = self
                    .outcomes
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0
                    .get(&(p, offset))
                    .cloned()
                {
                    return Some(a);
                }
                let still_owner = self.parts().get(&p).is_some_and(|s| s.live().is_some());
                if !still_owner {
                    return None;
                }
                // Wake on the next handled record (or re-check ownership).
                let _ = tokio::time::timeout(Duration::from_millis(200), rx.changed()).await;
            }
        };
        tokio::time::timeout(APPEND_WAIT, wait).await.ok().flatten()
    }

    async fn append_via_kafka(
        &self,
        twin: TwinId,
        token: FencingToken,
        mut events: Vec<NewEvent>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        if if_match.is_some() {
            return Err(AppendError::BadEvent(
                "If-Match is not supported in cluster mode (docs/decisions/0012-cluster-mode.md)"
                    .into(),
            ));
        }
        let p = self.store.partition_of(&twin).0;
        let owner = {
            let parts = self.parts();
            parts.get(&p).filter(|s| s.serving).and_then(Part::live)
        };
        let Some(owner) = owner else {
            return Err(AppendError::NotServing(format!(
                "node {} does not serve partition {p} right now; retry",
                self.id
            )));
        };
        // No fence pre-check here: the writer checks the token's scope
        // before its fence, and only it knows the scope; a stale append costs
        // one record in the log and gets the same 409 as on one node.
        // Fix every HLC now, so that every node replaying the record
        // computes the same state.
        let body: Vec<serde_json::Value> = events
            .iter_mut()
            .map(|e| {
                let h = *e.hlc.get_or_insert_with(|| self.store.clock().now());
                serde_json::json!({
                    "type": e.event_type,
                    "patch": e.patch,
                    "event_id": e.event_id,
                    "hlc": h.to_string(),
                })
            })
            .collect();
        let value = serde_json::to_vec(&body).map_err(|e| AppendError::BadEvent(e.to_string()))?;
        let (t, ot) = (token.0.to_string(), owner.token.0.to_string());
        let offset = self
            .produce(
                p,
                Some(twin.as_bytes()),
                &value,
                &[
                    (palisade_kafka::decode::TOKEN_HEADER, &t),
                    (
                        palisade_kafka::decode::CONTENT_TYPE_HEADER,
                        palisade_kafka::decode::JSON,
                    ),
                    (OWNER_TOKEN_HEADER, &ot),
                    (NODE_HEADER, &self.id),
                ],
            )
            .await
            .map_err(|e| AppendError::NotServing(format!("could not produce to Kafka: {e}")))?;
        match self.outcome(p, offset).await {
            Some(Applied::Outcome(IngestOutcome::Applied(a))) => Ok(a),
            Some(Applied::Outcome(IngestOutcome::Dropped(e))) => Err(e),
            Some(Applied::Outcome(IngestOutcome::DeadLettered { reason })) => {
                Err(match reason.as_str() {
                    "stale_owner" => AppendError::NotServing(format!(
                        "node {} lost partition {p} before its append was applied; it was not applied",
                        self.id
                    )),
                    // The same 403s as on one node.
                    "token_not_issued" => AppendError::NotIssued { token },
                    "token_scope_mismatch" => match self.etcd.scope_of_token(token).await {
                        Some(scope) => AppendError::WrongScope { token, scope, twin },
                        None => AppendError::NotIssued { token },
                    },
                    _ => AppendError::BadEvent(format!(
                        "refused when applied from Kafka ({reason}); see /v1/dead-letters"
                    )),
                })
            }
            _ => Err(AppendError::NotServing(format!(
                "the outcome of offset {offset} of partition {p} is unknown (ownership moved); retry with the same event ids"
            ))),
        }
    }
}

impl Ownership for Node {
    fn assigned(&self, partitions: &[u32]) {
        {
            let mut parts = self.parts();
            for p in partitions {
                parts.entry(*p).or_default().assigned = true;
            }
        }
        // Take the owner leases now, not at the first record: a partition
        // with no new records must still be served.
        if let Some(me) = self.me() {
            for p in partitions.iter().copied() {
                let me = me.clone();
                self.runtime.spawn(async move {
                    let _ = me.admit(p).await;
                });
            }
        }
    }

    fn revoked(&self, partitions: &[u32]) {
        // `release` needs an Arc; the callback has &self: do it inline.
        for p in partitions {
            let owned = {
                let mut parts = self.parts();
                let s = parts.entry(*p).or_default();
                s.assigned = false;
                s.serving = false;
                s.owned.take()
            };
            if let Some(o) = owned {
                info!(partition = p, owner_token = o.token.0, node = %self.id, "cluster: released the partition");
                let etcd = self.etcd.clone();
                self.runtime.spawn(async move {
                    let _ = etcd.client().lease_revoke(o.lease).await;
                });
            }
        }
    }

    fn admit(&self, partition: u32) -> palisade_kafka::cluster::BoxFuture<'_, Admission> {
        Box::pin(async move {
            let started = Instant::now();
            loop {
                let state = self.parts().get(&partition).copied().unwrap_or_default();
                if !state.assigned {
                    return Admission::NotAssigned;
                }
                if let Some(o) = state.live() {
                    return Admission::Owned(o.token);
                }
                if state.owned.is_some() {
                    // Past the local deadline: stop at once; take it anew.
                    warn!(partition, node = %self.id, "cluster: owner lease past its deadline; stopped applying");
                    let mut parts = self.parts();
                    if let Some(s) = parts.get_mut(&partition) {
                        s.owned = None;
                        s.serving = false;
                    }
                }
                let Some(me) = self.me() else {
                    return Admission::Lost;
                };
                match me.take(partition).await {
                    Ok(Some(o)) => {
                        let kept = {
                            let mut parts = self.parts();
                            let s = parts.entry(partition).or_default();
                            if s.assigned {
                                s.owned = Some(o);
                                s.serving = false;
                            }
                            s.assigned
                        };
                        if kept {
                            return Admission::Owned(o.token);
                        }
                        let _ = self.etcd.client().lease_revoke(o.lease).await;
                        return Admission::NotAssigned;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        warn!(partition, error = %e, "cluster: cannot take the partition-owner lease")
                    }
                }
                if started.elapsed() > Duration::from_secs(60) {
                    return Admission::Lost;
                }
                // Held by another node: it releases on its revoke, or its
                // lease expires if it died or is paused.
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    }

    fn handled(
        &self,
        partition: u32,
        offset: u64,
        applied: Applied,
        owner_marker: Option<(FencingToken, String)>,
    ) {
        if let Some((t, node)) = owner_marker {
            let mut parts = self.parts();
            if let Some(s) = parts.get_mut(&partition) {
                if node == self.id && s.owned.is_some_and(|o| o.token == t) && !s.serving {
                    s.serving = true;
                    info!(partition, owner_token = t.0, node = %self.id, "cluster: caught up; serving the partition");
                }
            }
        }
        {
            let mut o = self
                .outcomes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // A replay after a consumer restart reports AlreadyApplied for
            // offsets handled before: keep the first, real outcome.
            let replay = matches!(applied, Applied::Outcome(IngestOutcome::AlreadyApplied));
            if !(replay && o.0.contains_key(&(partition, offset)))
                && o.0.insert((partition, offset), applied).is_none()
            {
                o.1.push_back((partition, offset));
            }
            while o.1.len() > OUTCOMES_KEPT {
                if let Some(k) = o.1.pop_front() {
                    o.0.remove(&k);
                }
            }
        }
        self.handled.send_modify(|n| *n += 1);
    }
}

impl Node {
    /// An owning handle to self, for spawned keep-alive tasks.
    fn me(&self) -> Option<Arc<Self>> {
        self.me.upgrade()
    }
}

impl ClusterRouting for Node {
    fn route(&self, partition: u32) -> palisade_http::cluster::BoxFuture<'_, Route> {
        Box::pin(async move {
            let state = self.parts().get(&partition).copied().unwrap_or_default();
            if state.live().is_some() {
                return if state.serving {
                    Route::Local {
                        node: self.id.clone(),
                    }
                } else {
                    Route::Unavailable {
                        reason: format!("node {} is rebuilding it from Kafka", self.id),
                    }
                };
            }
            let got = self
                .etcd
                .client()
                .get(self.owner_key(partition), None)
                .await;
            let owner = got
                .ok()
                .and_then(|g| g.kvs().first().map(|kv| kv.value().to_vec()))
                .and_then(|v| serde_json::from_slice::<OwnerValue>(&v).ok());
            match owner {
                Some(o) if o.node != self.id => Route::Elsewhere {
                    node: o.node,
                    url: o.url,
                },
                _ => Route::Unavailable {
                    reason: "no node owns it yet (a rebalance or takeover is in progress)".into(),
                },
            }
        })
    }
}

impl AppendRoute for Node {
    fn append(
        &self,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        if_match: Option<u64>,
    ) -> palisade_lease::BoxFuture<'_, Result<Appended, AppendError>> {
        Box::pin(self.append_via_kafka(twin, token, events, if_match))
    }
}

/// etcd leases whose grants reach the partition writers through Kafka: a
/// grant record in the scope's partition, applied in log order by whichever
/// node owns it (and by every node that replays it later).
#[derive(Debug)]
struct ClusterAuthority {
    node: Arc<Node>,
}

impl ClusterAuthority {
    async fn acquire_and_log(&self, req: AcquireRequest) -> Result<Lease, RemoteError> {
        let lease = self.node.etcd.acquire(req).await?;
        let p = lease.scope.partition(self.node.store.partitions()).0;
        let (t, s) = (lease.token.0.to_string(), lease.scope.to_string());
        if let Err(e) = self
            .node
            .produce(
                p,
                None,
                b"",
                &[
                    (CONTROL_HEADER, "grant"),
                    (palisade_kafka::decode::TOKEN_HEADER, &t),
                    (SCOPE_HEADER, &s),
                    (HOLDER_HEADER, &lease.holder),
                ],
            )
            .await
        {
            // Nobody got the token: give the lease back.
            let _ = self.node.etcd.release(lease.id).await;
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
    fn acquire(
        &self,
        req: AcquireRequest,
    ) -> palisade_lease::BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.acquire_and_log(req))
    }
    fn renew(&self, id: LeaseId) -> palisade_lease::BoxFuture<'_, Result<Lease, RemoteError>> {
        self.node.etcd.renew(id)
    }
    fn release(&self, id: LeaseId) -> palisade_lease::BoxFuture<'_, Result<Lease, RemoteError>> {
        self.node.etcd.release(id)
    }
    fn scope_of_token(&self, token: FencingToken) -> palisade_lease::BoxFuture<'_, Option<Scope>> {
        self.node.etcd.scope_of_token(token)
    }
    fn holder_of(&self, scope: &Scope) -> Option<Lease> {
        self.node.etcd.holder_of(scope)
    }
    fn lease(&self, id: LeaseId) -> Option<Lease> {
        self.node.etcd.lease(id)
    }
    fn live_leases_of(&self, holder: &str) -> usize {
        self.node.etcd.live_leases_of(holder)
    }
    fn now(&self) -> Millis {
        self.node.etcd.now()
    }
    fn registers_grants(&self) -> bool {
        true
    }
}
