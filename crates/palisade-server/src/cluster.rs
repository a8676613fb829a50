//! `palisade serve` with a lease authority outside the store (etcd), and
//! cluster mode (docs/decisions/0011-etcd-lease-authority.md,
//! docs/decisions/0012-cluster-mode.md).
//!
//! Cluster mode's decisions are `palisade_cluster::Machine`'s
//! (docs/decisions/0021-cluster-state-machine.md); this is the thin runtime
//! that feeds it events and carries its actions out through the etcd owner
//! leases, the Kafka producer and the clock, and the node's side of the
//! store's, the ingester's and the HTTP layer's seams.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Context;
use palisade_cluster::{
    Action, Clock, Event, Gate, Machine, Outcomes, OwnerLeaseId, OwnerLeases, RecordLog,
    SystemClock, Taken, OWNER_TTL,
};
use palisade_core::{BoxFuture, FencingToken, NewEvent, TwinId};
use palisade_etcd::{EtcdAuthority, EtcdConfig};
use palisade_http::auth::Auth;
use palisade_http::cluster::{ClusterRouting, Holding, Peer, Route};
use palisade_kafka::cluster::{
    Admission, Applied, Ownership, CONTROL_HEADER, IF_MATCH_HEADER, NODE_HEADER, OUTBOX_CONTROL,
    OUTBOX_REMOVE_CONTROL, OWNER_TOKEN_HEADER, STALE_OWNER,
};
use palisade_kafka::KafkaLog;
use palisade_lease::RemoteAuthority;
use palisade_log::{
    AppendError, AppendRoute, Appended, IngestOutcome, LeaseBackend, OutboxEntry, OutboxOutcome,
    Store,
};
use reqwest::header::HeaderValue;
use sha2::Digest;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tracing::{info, warn};

use crate::config::{EtcdSettings, Leases, Mode, ServeConfig};

mod authority;
#[cfg(test)]
mod tests;

/// The lease backend of a mode, made before the store opens: the store
/// takes it at open (and refuses it if its tokens came from another). In
/// cluster mode the authority needs the node, and the node needs the opened
/// store: the authority is made unbound here and given its node in
/// [`start`], before the store serves a single lease call.
#[derive(Debug)]
pub struct Authority {
    backend: LeaseBackend,
    /// Cluster mode: the authority the node is given to, and the etcd
    /// connection the node's owner leases use.
    cluster: Option<(Arc<authority::ClusterAuthority>, Arc<EtcdAuthority>)>,
}

impl Authority {
    /// What `StoreConfig::leases` is set to.
    pub fn backend(&self) -> LeaseBackend {
        self.backend.clone()
    }
}

/// The lease authority of `mode`: the embedded one, a connected etcd
/// authority for a single node on etcd, or cluster mode's etcd-through-Kafka
/// one (its node started later by [`start`]).
pub async fn authority(mode: &Mode) -> anyhow::Result<Authority> {
    Ok(match mode {
        Mode::Single {
            leases: Leases::Embedded,
        } => Authority {
            backend: LeaseBackend::Embedded,
            cluster: None,
        },
        Mode::Single {
            leases: Leases::Etcd(etcd),
        } => Authority {
            backend: LeaseBackend::Remote(connect(etcd).await?),
            cluster: None,
        },
        Mode::Cluster { etcd, .. } => {
            let etcd = connect(etcd).await?;
            let cluster = Arc::new(authority::ClusterAuthority::unbound());
            Authority {
                backend: LeaseBackend::Remote(cluster.clone()),
                cluster: Some((cluster, etcd)),
            }
        }
    })
}

/// Start the cluster node in cluster mode, on the store opened with
/// `authority` (whose leases and appends go through etcd and Kafka from now
/// on); nothing in the other modes.
pub async fn start(
    store: &Arc<Store>,
    authority: Authority,
    mode: &Mode,
    config: &ServeConfig,
    auth: Option<Arc<Auth>>,
) -> anyhow::Result<Option<Arc<Node>>> {
    match (mode, authority.cluster) {
        (
            Mode::Cluster {
                node,
                kafka_brokers,
                ..
            },
            Some((cluster, etcd)),
        ) => {
            let node = Node::start(store.clone(), node, kafka_brokers, config, etcd).await?;
            if let Some(a) = auth {
                let _ = node.auth.set(a);
            }
            cluster.bind(node.clone())?;
            Ok(Some(node))
        }
        (Mode::Cluster { .. }, None) => {
            anyhow::bail!("cluster mode needs the authority made for it by cluster::authority")
        }
        _ => Ok(None),
    }
}

async fn connect(settings: &EtcdSettings) -> anyhow::Result<Arc<EtcdAuthority>> {
    let mut cfg = EtcdConfig::new(settings.endpoints.clone());
    cfg.prefix.clone_from(&settings.prefix);
    let etcd = EtcdAuthority::connect(cfg)
        .await
        .context("lease backend etcd")?;
    info!(endpoints = ?settings.endpoints, prefix = %settings.prefix, "leases from etcd");
    Ok(Arc::new(etcd))
}

/// How long an HTTP append waits for its record to be applied.
const APPEND_WAIT: Duration = Duration::from_secs(30);
/// Outcomes remembered for appends waiting on them.
const OUTCOMES_KEPT: usize = 65_536;
/// How often a node asks again for an owner lease another node holds (it
/// releases on its revoke, or its lease expires if it died or is paused).
const RETAKE_EVERY: Duration = Duration::from_millis(250);
/// How long a cluster-wide view waits for each owner's own view (a paused
/// or partitioned owner is then reported `unreachable`).
const VIEW_WAIT: Duration = Duration::from_secs(2);
/// How long `admit` tries before the ingester rejoins the group.
const ADMIT_GIVES_UP: Duration = Duration::from_secs(60);

/// The owner key's value: who owns a partition and where it is reached
/// (read by other nodes to redirect).
#[derive(serde::Serialize, serde::Deserialize)]
struct OwnerValue {
    node: String,
    url: String,
}

/// This node in cluster mode: partition ownership (etcd owner leases),
/// routing of requests, appends through Kafka, grants through Kafka.
pub struct Node {
    /// Itself, for the tasks it spawns from `&self` callbacks.
    me: std::sync::Weak<Node>,
    id: String,
    url: OnceLock<String>,
    /// Authentication on: the principals, whose signing keys sign the
    /// records of their appends (docs/security.md, "Cluster mode").
    auth: OnceLock<Arc<Auth>>,
    /// The lease authority (etcd): grants, scopes of tokens.
    authority: Arc<dyn RemoteAuthority>,
    owners: Arc<dyn OwnerLeases>,
    log: Arc<dyn RecordLog>,
    clock: Arc<dyn Clock>,
    store: Arc<Store>,
    runtime: tokio::runtime::Handle,
    machine: Mutex<Machine>,
    /// Running keep-alive tasks, stopped on the machine's word.
    keepers: Mutex<HashMap<OwnerLeaseId, AbortHandle>>,
    /// Bumped on every ownership change: `admit` waits on it.
    changed: watch::Sender<u64>,
    outcomes: Mutex<Outcomes<Applied>>,
    /// Bumped on every handled record: appends wait on it.
    handled: watch::Sender<u64>,
    /// Asks other nodes for their own views (cluster-wide views), each
    /// request bounded by [`VIEW_WAIT`].
    peers: OnceLock<reqwest::Client>,
    /// etcd's member registry (`<prefix>nodes/<node>`); unset in the
    /// tests' fakes.
    registry: OnceLock<Arc<EtcdAuthority>>,
    /// The lease of this node's member record, while registered.
    member_lease: Mutex<Option<OwnerLeaseId>>,
}

/// A member's record in etcd (`<prefix>nodes/<node>`).
#[derive(serde::Serialize, serde::Deserialize)]
struct MemberValue {
    node: String,
    url: String,
    /// SHA-256 (hex) of the node's `--security` file; `None`: auth off.
    security_sha256: Option<String>,
}

/// A member's record lives this long without its node renewing it.
const MEMBER_TTL: Duration = Duration::from_secs(10);

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// What a node carries its decisions out through (etcd, Kafka, the clock
/// in production; fakes in the tests).
struct Seams {
    authority: Arc<dyn RemoteAuthority>,
    owners: Arc<dyn OwnerLeases>,
    log: Arc<dyn RecordLog>,
    clock: Arc<dyn Clock>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Node {
    /// The cluster node of `palisade serve --cluster-node`, bound to the
    /// store (its appends go through the node from now on; its leases once
    /// [`start`] gives the node to the store's authority).
    pub async fn start(
        store: Arc<Store>,
        id: &str,
        brokers: &str,
        config: &ServeConfig,
        etcd: Arc<EtcdAuthority>,
    ) -> anyhow::Result<Arc<Self>> {
        let log = KafkaLog::new(brokers, &config.kafka_topic, &config.kafka_settings)
            .context("kafka producer")?;
        let etcd_members = etcd.clone();
        let node = Self::new(
            id.to_owned(),
            store.clone(),
            Seams {
                authority: etcd.clone(),
                owners: etcd,
                log: Arc::new(log),
                clock: Arc::new(SystemClock),
            },
        );
        if let Some(u) = &config.cluster_advertise {
            let _ = node.url.set(u.clone());
        }
        let _ = node.peers.set(peers_client(config)?);
        let _ = node.registry.set(etcd_members);
        store.route_appends(node.clone())?;
        info!(node = %node.id, "cluster mode");
        Ok(node)
    }

    /// A node over its seams, not yet bound to the store.
    fn new(id: String, store: Arc<Store>, seams: Seams) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            id,
            url: OnceLock::new(),
            auth: OnceLock::new(),
            authority: seams.authority,
            owners: seams.owners,
            log: seams.log,
            clock: seams.clock,
            store,
            runtime: tokio::runtime::Handle::current(),
            machine: Mutex::new(Machine::default()),
            keepers: Mutex::new(HashMap::new()),
            changed: watch::channel(0).0,
            outcomes: Mutex::new(Outcomes::new(OUTCOMES_KEPT)),
            handled: watch::channel(0).0,
            peers: OnceLock::new(),
            registry: OnceLock::new(),
            member_lease: Mutex::new(None),
        })
    }

    /// Leave the member registry (a clean shutdown): the record goes at
    /// once instead of when its lease expires.
    pub async fn leave(&self) {
        let lease = lock(&self.member_lease).take();
        if let (Some(etcd), Some(lease)) = (self.registry.get(), lease) {
            if let Err(e) = etcd.revoke(lease).await {
                warn!(node = %self.id, error = %e, "cluster: this node's member record stays until its lease expires");
            }
        }
    }

    /// Join the cluster's member registry, once this node's URL is known:
    /// refuse to start if a live member runs with another security file
    /// (every node must decide who may do what alike; `allow_change`: warn
    /// only, for a rolling change of the file), then register this node and
    /// keep its record alive while it runs.
    pub async fn join(
        self: &Arc<Self>,
        security_file: Option<&std::path::Path>,
        allow_change: bool,
    ) -> anyhow::Result<()> {
        let Some(etcd) = self.registry.get().cloned() else {
            return Ok(());
        };
        let security_sha256 = match security_file {
            Some(path) => {
                let bytes =
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                Some(
                    sha2::Sha256::digest(&bytes)
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>(),
                )
            }
            None => None,
        };
        let members = etcd
            .members()
            .await
            .context("reading the cluster's members from etcd")?;
        for (node, value) in members {
            if node == self.id {
                // This node's record from before a restart.
                continue;
            }
            let Ok(other) = serde_json::from_slice::<MemberValue>(&value) else {
                continue;
            };
            if other.security_sha256 != security_sha256 {
                let shown = |h: &Option<String>| {
                    h.as_deref().map_or_else(
                        || "no --security file (authentication off)".to_owned(),
                        |h| format!("a --security file with SHA-256 {h}"),
                    )
                };
                let problem = format!(
                    "node {node} of this cluster runs with {}, this node with {}: every node of a cluster needs the same --security file (docs/security.md, \"Cluster mode\")",
                    shown(&other.security_sha256),
                    shown(&security_sha256)
                );
                if !allow_change {
                    anyhow::bail!("{problem}; not starting (--cluster-security-change starts anyway, for a rolling change of the file)");
                }
                warn!("{problem}; starting anyway (--cluster-security-change): restart every node with the new file");
            }
        }
        let value = serde_json::to_vec(&MemberValue {
            node: self.id.clone(),
            url: self.url(),
            security_sha256,
        })?;
        let lease = etcd
            .register_member(&self.id, value.clone(), MEMBER_TTL)
            .await
            .context("registering this node with the cluster in etcd")?;
        *lock(&self.member_lease) = Some(lease);
        let (me, id) = (Arc::downgrade(self), self.id.clone());
        self.runtime.spawn(async move {
            let mut lease = lease;
            loop {
                let kept = match etcd.keep_alive(lease).await {
                    Ok(mut k) => loop {
                        tokio::time::sleep(MEMBER_TTL / 3).await;
                        let Some(node) = me.upgrade() else { return };
                        if lock(&node.member_lease).is_none() {
                            // Left the registry.
                            return;
                        }
                        if let Err(e) = k.renew().await {
                            break e.to_string();
                        }
                    },
                    Err(e) => e.to_string(),
                };
                warn!(node = %id, error = %kept, "cluster: this node's member record lapsed; registering again");
                tokio::time::sleep(MEMBER_TTL / 3).await;
                match etcd.register_member(&id, value.clone(), MEMBER_TTL).await {
                    Ok(l) => {
                        lease = l;
                        match me.upgrade() {
                            Some(node) => *lock(&node.member_lease) = Some(l),
                            None => return,
                        }
                    }
                    Err(e) => warn!(node = %id, error = %e, "cluster: registering this node again failed"),
                }
            }
        });
        Ok(())
    }

    /// The URL others reach this node at (default: `scheme://` + listen
    /// address; `--cluster-advertise` set earlier wins).
    pub fn set_listen_addr(&self, scheme: &str, addr: SocketAddr) {
        let _ = self.url.set(format!("{scheme}://{addr}"));
    }

    fn url(&self) -> String {
        self.url.get().cloned().unwrap_or_default()
    }

    /// An owning handle to self, for spawned tasks.
    fn me(&self) -> Option<Arc<Self>> {
        self.me.upgrade()
    }

    /// Feed the machine one event about partition `p` and carry its
    /// actions out.
    fn step(self: &Arc<Self>, p: u32, event: Event) {
        let actions = lock(&self.machine).handle(p, event, self.clock.now());
        let quiet = actions.is_empty() && matches!(event, Event::Wanted | Event::Tick);
        for a in actions {
            self.carry_out(p, a);
        }
        if !quiet {
            self.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn carry_out(self: &Arc<Self>, p: u32, action: Action) {
        let me = self.clone();
        match action {
            Action::TakeLease => {
                self.runtime.spawn(me.take(p));
            }
            Action::ProduceMarker { token } => {
                self.runtime.spawn(me.produce_marker(p, token));
            }
            Action::StartKeepAlive { lease } => {
                let task = self.runtime.spawn(me.keep_alive(p, lease));
                lock(&self.keepers).insert(lease, task.abort_handle());
            }
            Action::StopKeepAlive { lease } => {
                if let Some(task) = lock(&self.keepers).remove(&lease) {
                    task.abort();
                }
            }
            Action::RevokeLease { lease } => {
                self.runtime.spawn(async move {
                    let _ = me.owners.revoke(lease).await;
                });
            }
            Action::StopServing { token, why } => {
                warn!(partition = p, owner_token = token.0, node = %self.id, why = why.as_str(), "cluster: gave up the partition-owner lease; stopped applying and serving it");
            }
            Action::StartServing { token } => {
                info!(partition = p, owner_token = token.0, node = %self.id, "cluster: caught up; serving the partition");
            }
        }
    }

    /// Take p's owner lease (create-if-absent on the owner key).
    async fn take(self: Arc<Self>, p: u32) {
        // The deadline counts from before the request: conservative.
        let sent = self.clock.now();
        let value = serde_json::to_vec(&OwnerValue {
            node: self.id.clone(),
            url: self.url(),
        })
        .unwrap_or_default();
        let event = match self.owners.take(p, value, OWNER_TTL).await {
            Ok(Taken::Taken { token, lease, ttl }) => {
                info!(partition = p, owner_token = token.0, node = %self.id, "cluster: took the partition-owner lease");
                Event::LeaseTaken {
                    token,
                    lease,
                    sent,
                    ttl,
                }
            }
            Ok(Taken::HeldElsewhere) => Event::TakeFailed,
            Err(e) => {
                warn!(partition = p, error = %e, "cluster: cannot take the partition-owner lease");
                Event::TakeFailed
            }
        };
        self.step(p, event);
    }

    /// The marker: from its place in the log on, a former owner's late
    /// writes are refused; once applied here, this node serves p.
    async fn produce_marker(self: Arc<Self>, p: u32, token: FencingToken) {
        let headers = vec![
            (CONTROL_HEADER, "owner".to_owned()),
            (OWNER_TOKEN_HEADER, token.0.to_string()),
            (NODE_HEADER, self.id.clone()),
        ];
        let event = match self.log.produce(p, None, Vec::new(), headers).await {
            Ok(_) => Event::MarkerProduced { token },
            Err(e) => {
                warn!(partition = p, error = %e, "cluster: owner marker not produced");
                Event::MarkerFailed { token }
            }
        };
        self.step(p, event);
    }

    /// Renew p's owner lease every TTL/3 until the machine stops it.
    async fn keep_alive(self: Arc<Self>, p: u32, lease: OwnerLeaseId) {
        let period = OWNER_TTL / 3;
        let mut keeper = match self.owners.keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => {
                warn!(partition = p, error = %e, "cluster: keep-alive could not start");
                return self.step(p, Event::KeepAliveFailed { lease });
            }
        };
        loop {
            tokio::time::sleep(period).await;
            let sent = self.clock.now();
            let event = match keeper.renew().await {
                Ok(ttl) => Event::KeepAliveOk { lease, sent, ttl },
                Err(e) => {
                    warn!(partition = p, error = %e, "cluster: keep-alive failed");
                    Event::KeepAliveFailed { lease }
                }
            };
            let failed = matches!(event, Event::KeepAliveFailed { .. });
            self.step(p, event);
            let held = lock(&self.machine)
                .live(p, self.clock.now())
                .map(|o| o.lease);
            if failed || held != Some(lease) {
                return;
            }
        }
    }

    async fn outcome(&self, p: u32, offset: u64) -> Option<Applied> {
        let mut rx = self.handled.subscribe();
        let wait = async {
            loop {
                if let Some(a) = lock(&self.outcomes).get(p, offset) {
                    return Some(a);
                }
                // Not the owner any more: the outcome may never come here.
                lock(&self.machine).live(p, self.clock.now())?;
                // Wake on the next handled record (or re-check ownership).
                let _ = tokio::time::timeout(Duration::from_millis(200), rx.changed()).await;
            }
        };
        tokio::time::timeout(APPEND_WAIT, wait).await.ok().flatten()
    }

    async fn append_via_kafka(
        &self,
        principal: Option<String>,
        twin: TwinId,
        token: FencingToken,
        mut events: Vec<NewEvent>,
        effects: Vec<Vec<palisade_core::effect::Effect>>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        let p = self.store.partition_of(&twin).0;
        let Some(owner) = lock(&self.machine).serving(p, self.clock.now()) else {
            return Err(AppendError::NotServing(format!(
                "node {} does not serve partition {p} right now; retry",
                self.id
            )));
        };
        // No fence pre-check here: the writer checks the token's scope
        // before its fence, and only it knows the scope; a stale append costs
        // one record in the log and gets the same 409 as on one node.
        // Fix every HLC now, so that every node replaying the record
        // computes the same state. Effects travel with their event: the
        // applying node records them in the event's fenced round.
        let body: Vec<serde_json::Value> = events
            .iter_mut()
            .enumerate()
            .map(|(i, e)| {
                let h = *e.hlc.get_or_insert_with(|| self.store.clock().now());
                let mut v = serde_json::json!({
                    "type": e.event_type,
                    "patch": e.patch,
                    "event_id": e.event_id,
                    "hlc": h.to_string(),
                });
                if let Some(list) = effects.get(i).filter(|l| !l.is_empty()) {
                    v["effects"] = list
                        .iter()
                        .map(palisade_core::effect::Effect::to_json)
                        .collect();
                }
                v
            })
            .collect();
        let value = serde_json::to_vec(&body).map_err(|e| AppendError::BadEvent(e.to_string()))?;
        let token_text = token.0.to_string();
        let mut headers = vec![
            (palisade_kafka::decode::TOKEN_HEADER, token_text.clone()),
            (
                palisade_kafka::decode::CONTENT_TYPE_HEADER,
                palisade_kafka::decode::JSON.to_owned(),
            ),
            (OWNER_TOKEN_HEADER, owner.token.0.to_string()),
            (NODE_HEADER, self.id.clone()),
        ];
        // Authentication on: the record is signed as the principal the
        // HTTP layer authenticated, so the applying node (and every node
        // replaying the log) checks its grants and the token's owner again.
        let if_match_text = if_match.map(|v| v.to_string());
        if let (Some(auth), Some(p)) = (self.auth.get(), principal.as_deref()) {
            let Some(id) = auth.identity(p) else {
                return Err(AppendError::BadEvent(format!("no principal named {p:?}")));
            };
            // The If-Match header is signed too: nobody can strip or add it.
            let signature = palisade_kafka::sign::sign(
                &id.key_sha256(),
                p,
                &palisade_kafka::sign::Signed {
                    twin: twin.as_bytes(),
                    token: token_text.as_bytes(),
                    content_type: palisade_kafka::decode::JSON.as_bytes(),
                    hlc: b"",
                    value: &value,
                    if_match: if_match_text.as_deref().map(str::as_bytes),
                },
            );
            headers.push((palisade_kafka::sign::PRINCIPAL_HEADER, p.to_owned()));
            headers.push((palisade_kafka::sign::SIGNATURE_HEADER, signature));
        }
        // Checked by whoever applies the record, against the twin's version
        // at its place in the log (a 412 comes back through the outcome).
        if let Some(v) = if_match_text {
            headers.push((IF_MATCH_HEADER, v));
        }
        let started = std::time::Instant::now();
        let offset = self
            .log
            .produce(p, Some(twin.as_bytes().to_vec()), value, headers)
            .await
            .map_err(|e| AppendError::NotServing(e.to_string()))?;
        let produced = std::time::Instant::now();
        let outcome = self.outcome(p, offset).await;
        self.count_stages(produced - started, produced.elapsed());
        match outcome {
            Some(Applied::Outcome(IngestOutcome::Applied(a))) => Ok(a),
            Some(Applied::Outcome(IngestOutcome::Dropped(e))) => Err(e),
            // Refused by the writer when applied: the same refusal as on
            // one node (a token never issued, another twin's token, ...).
            Some(Applied::Outcome(IngestOutcome::DeadLettered {
                refused: Some(e), ..
            })) => Err(e),
            Some(Applied::Outcome(IngestOutcome::DeadLettered {
                reason,
                refused: None,
            })) if reason == STALE_OWNER => Err(AppendError::NotServing(format!(
                "node {} lost partition {p} before its append was applied; it was not applied",
                self.id
            ))),
            Some(Applied::Outcome(IngestOutcome::DeadLettered { reason, .. })) => {
                Err(AppendError::BadEvent(format!(
                    "refused when applied from Kafka ({reason}); see /v1/dead-letters"
                )))
            }
            _ => Err(AppendError::NotServing(format!(
                "the outcome of offset {offset} of partition {p} is unknown (ownership moved); retry with the same event ids"
            ))),
        }
    }
}

impl Node {
    /// Where an append's time went: producing it (until the broker
    /// acknowledged it, acks=all) and then until it was applied here (the
    /// consumer fetched it and the store committed it). Summed in µs, so
    /// the means show what bounds cluster appends (docs/scaling.md).
    fn count_stages(&self, produce: Duration, apply: Duration) {
        let m = self.store.metrics();
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        const NAME: &str = "palisade_cluster_append_stage_microseconds_total";
        const HELP: &str = "Time appends spent per stage in cluster mode (produce: until the broker acknowledged; apply: then until applied here), in microseconds.";
        m.add(NAME, HELP, &[("stage", "produce")], micros(produce));
        m.add(NAME, HELP, &[("stage", "apply")], micros(apply));
        m.add(
            "palisade_cluster_appends_total",
            "Appends this node sent through Kafka and waited for.",
            &[],
            1,
        );
    }
}

/// The outbox dispatcher's side of ownership (`outbox.rs`): only the node
/// serving a partition delivers its effects, and each try's outcome is a
/// `palisade-control: outbox` record of the partition, applied by every
/// node (`docs/decisions/0035-outbox-in-cluster-mode.md`).
impl crate::outbox::Dispatch for Node {
    fn may_dispatch(&self, partition: u32) -> bool {
        lock(&self.machine)
            .serving(partition, self.clock.now())
            .is_some()
    }

    fn ownership_changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.changed.subscribe())
    }

    fn record<'a>(&'a self, entry: &'a OutboxEntry) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let p = entry.partition;
            let Some(owner) = lock(&self.machine).serving(p, self.clock.now()) else {
                return Err(format!("node {} no longer serves partition {p}", self.id));
            };
            let headers = vec![
                (CONTROL_HEADER, OUTBOX_CONTROL.to_owned()),
                (OWNER_TOKEN_HEADER, owner.token.0.to_string()),
                (NODE_HEADER, self.id.clone()),
            ];
            let value = OutboxOutcome::of(entry).to_json();
            let offset = self
                .log
                .produce(p, None, value, headers)
                .await
                .map_err(|e| format!("outcome record not produced: {e}"))?;
            // Applied by this node's own consumer (in log order, after the
            // entry's event) before the dispatcher moves on.
            match self.outcome(p, offset).await {
                Some(Applied::Control) => Ok(()),
                Some(other) => Err(format!("the outcome record was handled as {other:?}")),
                None => Err(format!(
                    "partition {p} moved before the outcome record at offset {offset} was applied here"
                )),
            }
        })
    }
}

impl Ownership for Node {
    fn assigned(&self, partitions: &[u32]) {
        let Some(me) = self.me() else { return };
        for p in partitions.iter().copied() {
            me.step(p, Event::Assigned);
            // Keep at the lease until it is had, not only at the first
            // record: a partition with no new records must still be served.
            let me = me.clone();
            self.runtime.spawn(async move {
                let _ = me.admit(p).await;
            });
        }
    }

    fn revoked(&self, partitions: &[u32]) {
        let Some(me) = self.me() else { return };
        for p in partitions {
            me.step(*p, Event::Revoked);
        }
    }

    fn admit(&self, partition: u32) -> BoxFuture<'_, Admission> {
        Box::pin(async move {
            let started = self.clock.now();
            let mut next_want = started;
            loop {
                let mut changed = self.changed.subscribe();
                let now = self.clock.now();
                let gate = lock(&self.machine).gate(partition, now);
                match gate {
                    Gate::NotAssigned => return Admission::NotAssigned,
                    Gate::Owned(t) => return Admission::Owned(t),
                    Gate::Wait => {}
                }
                if now.duration_since(started) > ADMIT_GIVES_UP {
                    return Admission::Lost;
                }
                if now >= next_want {
                    let Some(me) = self.me() else {
                        return Admission::Lost;
                    };
                    me.step(partition, Event::Wanted);
                    next_want = now + RETAKE_EVERY;
                }
                // Wake on an ownership change, or ask again in a while.
                let wait = next_want.saturating_duration_since(self.clock.now());
                let _ = tokio::time::timeout(wait, changed.changed()).await;
            }
        })
    }

    fn admitted(&self, partition: u32) -> Option<Admission> {
        match lock(&self.machine).gate(partition, self.clock.now()) {
            Gate::NotAssigned => Some(Admission::NotAssigned),
            Gate::Owned(t) => Some(Admission::Owned(t)),
            Gate::Wait => None,
        }
    }

    fn handled(
        &self,
        partition: u32,
        offset: u64,
        applied: Applied,
        owner_marker: Option<(FencingToken, String)>,
    ) {
        if let (Some((token, node)), Some(me)) = (owner_marker, self.me()) {
            let mine = node == self.id;
            me.step(partition, Event::MarkerApplied { token, mine });
        }
        // A replay after a consumer restart reports AlreadyApplied for
        // offsets handled before: the first, real outcome is kept.
        let replay = matches!(applied, Applied::Outcome(IngestOutcome::AlreadyApplied));
        lock(&self.outcomes).record(partition, offset, applied, replay);
        self.handled.send_modify(|n| *n += 1);
    }
}

impl ClusterRouting for Node {
    fn route(&self, partition: u32) -> BoxFuture<'_, Route> {
        Box::pin(async move {
            let (live, serving) = {
                let m = lock(&self.machine);
                let now = self.clock.now();
                (m.live(partition, now), m.serving(partition, now))
            };
            if live.is_some() {
                return if serving.is_some() {
                    Route::Local {
                        node: self.id.clone(),
                    }
                } else {
                    Route::Unavailable {
                        reason: format!("node {} is rebuilding it from Kafka", self.id),
                    }
                };
            }
            match self.owner_of(partition).await.ok().flatten() {
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

    fn node(&self) -> String {
        self.id.clone()
    }

    fn holding(&self, partition: u32) -> Holding {
        let m = lock(&self.machine);
        let now = self.clock.now();
        Holding {
            owner_token: m.live(partition, now).map(|o| o.token.0),
            serving: m.serving(partition, now).is_some(),
        }
    }

    fn owners(&self, partitions: u32) -> BoxFuture<'_, Result<Vec<Option<Peer>>, String>> {
        Box::pin(async move {
            let mut each = tokio::task::JoinSet::new();
            for p in 0..partitions {
                let Some(me) = self.me() else {
                    return Err("the node is shutting down".into());
                };
                each.spawn(async move { (p, me.owner_of(p).await) });
            }
            let mut owners = vec![None; partitions as usize];
            while let Some(r) = each.join_next().await {
                let (p, owner) = r.map_err(|e| e.to_string())?;
                owners[p as usize] = owner?;
            }
            Ok(owners)
        })
    }

    fn members(&self) -> BoxFuture<'_, Result<Vec<Peer>, String>> {
        Box::pin(async move {
            let Some(etcd) = self.registry.get() else {
                return Ok(Vec::new());
            };
            let members = etcd.members().await.map_err(|e| e.to_string())?;
            Ok(members
                .into_iter()
                .filter_map(|(_, v)| serde_json::from_slice::<MemberValue>(&v).ok())
                .map(|m| Peer {
                    node: m.node,
                    url: m.url,
                })
                .collect())
        })
    }

    fn ask(
        &self,
        peer: Peer,
        path_and_query: String,
        authorization: Option<HeaderValue>,
    ) -> BoxFuture<'_, Result<Vec<u8>, String>> {
        Box::pin(async move {
            let url = format!("{}{path_and_query}", peer.url.trim_end_matches('/'));
            let mut req = self.peers().get(&url);
            // The caller's key: the other node checks the caller itself,
            // with the same principals.
            if let Some(a) = authorization {
                req = req.header(reqwest::header::AUTHORIZATION, a);
            }
            let r = req
                .send()
                .await
                .map_err(|e| format!("node {} at {url}: {e}", peer.node))?;
            let status = r.status();
            let body = r
                .bytes()
                .await
                .map_err(|e| format!("node {} at {url}: {e}", peer.node))?;
            if !status.is_success() {
                return Err(format!(
                    "node {} at {url} answered {status}: {}",
                    peer.node,
                    String::from_utf8_lossy(&body)
                ));
            }
            Ok(body.to_vec())
        })
    }
}

/// The client a node asks other nodes with (the cluster-wide views):
/// bounded by the view wait, no redirects, and for HTTPS nodes the roots of
/// `--cluster-ca-file`, else of this node's `--tls-cert`.
fn peers_client(config: &ServeConfig) -> anyhow::Result<reqwest::Client> {
    let mut b = reqwest::Client::builder()
        .timeout(VIEW_WAIT)
        .connect_timeout(VIEW_WAIT)
        .redirect(reqwest::redirect::Policy::none());
    let (flag, roots) = match (&config.cluster_ca_file, &config.tls_cert) {
        (Some(f), _) => ("--cluster-ca-file", Some(f)),
        (None, Some(c)) => ("--tls-cert", Some(c)),
        (None, None) => ("", None),
    };
    if let Some(path) = roots {
        for c in crate::security::pem_roots(path, flag)? {
            b = b.add_root_certificate(c);
        }
    }
    b.build().context("the client for other nodes")
}

impl Node {
    fn peers(&self) -> &reqwest::Client {
        self.peers.get_or_init(reqwest::Client::new)
    }

    fn owner_of(&self, partition: u32) -> BoxFuture<'_, Result<Option<Peer>, String>> {
        Box::pin(async move {
            let v = self
                .owners
                .owner(partition)
                .await
                .map_err(|e| e.to_string())?;
            Ok(
                v.and_then(|v| serde_json::from_slice::<OwnerValue>(&v).ok())
                    .map(|o| Peer {
                        node: o.node,
                        url: o.url,
                    }),
            )
        })
    }
}

impl AppendRoute for Node {
    fn append(
        &self,
        principal: Option<String>,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        effects: Vec<Vec<palisade_core::effect::Effect>>,
        if_match: Option<u64>,
    ) -> BoxFuture<'_, Result<Appended, AppendError>> {
        Box::pin(self.append_via_kafka(principal, twin, token, events, effects, if_match))
    }

    /// Checked on this node's copy (it must serve the partition), then a
    /// `palisade-control: outbox-remove` record every node applies.
    fn remove_dead_effect(
        &self,
        partition: u32,
        seq: u64,
        index: u16,
    ) -> BoxFuture<'_, Result<OutboxEntry, palisade_log::OutboxRemoveError>> {
        use palisade_log::OutboxRemoveError as E;
        Box::pin(async move {
            let Some(owner) = lock(&self.machine).serving(partition, self.clock.now()) else {
                return Err(E::NotServing(format!(
                    "node {} does not serve partition {partition}; ask its owner (GET /v1/twins/<a twin of it> names it)",
                    self.id
                )));
            };
            let p = palisade_core::PartitionId(partition);
            let entry = self.store.outbox_get(p, seq, index)?.ok_or(E::NotFound {
                partition,
                seq,
                index,
            })?;
            if entry.state != palisade_log::DeliveryState::Dead {
                return Err(E::NotDead {
                    state: entry.state.name(),
                });
            }
            let headers = vec![
                (CONTROL_HEADER, OUTBOX_REMOVE_CONTROL.to_owned()),
                (OWNER_TOKEN_HEADER, owner.token.0.to_string()),
                (NODE_HEADER, self.id.clone()),
            ];
            let offset = self
                .log
                .produce(
                    partition,
                    None,
                    palisade_log::removal_json(partition, seq, index),
                    headers,
                )
                .await
                .map_err(|e| E::NotServing(format!("removal record not produced: {e}")))?;
            match self.outcome(partition, offset).await {
                Some(Applied::Control) => {}
                _ => {
                    return Err(E::NotServing(format!(
                        "partition {partition} moved before the removal at offset {offset} was applied here; it is applied by whoever applies the log"
                    )))
                }
            }
            match self.store.outbox_get(p, seq, index)? {
                None => Ok(entry),
                Some(now) => Err(E::NotDead {
                    state: now.state.name(),
                }),
            }
        })
    }
}
