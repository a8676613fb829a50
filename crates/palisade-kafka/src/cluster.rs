//! Cluster-mode ingestion (docs/decisions/0012-cluster-mode.md): several
//! `palisade serve` nodes in one consumer group. A node applies a record of
//! partition p only while it holds p's owner lease (asked of an
//! [`Ownership`], etcd in `palisade serve`), and besides worker records the
//! partition carries control records, applied in log order by whichever
//! node owns it, so replaying the partition gives every node the same state:
//!
//! - `palisade-control: owner` (`palisade-owner-token: T`, `palisade-node`):
//!   written by a node that has just taken p's owner lease with token T.
//!   From there on, records a node produced for HTTP appends under an owner
//!   token below T are refused (`stale_owner`): a former owner's late write
//!   is fenced by the new owner's higher token.
//! - `palisade-control: grant` (`fencing-token`, `palisade-scope`,
//!   `palisade-holder`): a lease granted by etcd through any node; applying
//!   it registers the token with the partition writer and raises the fence,
//!   at its place in the log.
//! - `palisade-control: outbox` (`palisade-owner-token`, `palisade-node`;
//!   value: a JSON [`palisade_log::OutboxOutcome`]): the outcome of a try
//!   to deliver one of p's outbox effects, published by the owner that
//!   tried. Applying it merges it into the entry (states only move forward),
//!   so a later owner does not deliver again what was confirmed
//!   (`docs/decisions/0035-outbox-in-cluster-mode.md`).
//!
//! The records a node produces for HTTP appends (`palisade-owner-token`
//! set, not a forwarded copy) may carry effects in their JSON events; the
//! applying node records them in the outbox in the event's fenced round.
//!
//! A worker record in partition k whose twin belongs to partition j != k
//! (any producer partitioner but murmur2 puts most records there) is
//! **forwarded**: the owner of k produces a copy to j with its origin
//! (`palisade-origin-partition`, `-offset`, `-prev`) and stores k's offset
//! only once the copy is acknowledged; whoever owns j applies the copy once,
//! by the relay rule of `palisade_log` (a copy at or below the last decided
//! from its origin is a retry; one that overtook a lost copy is set aside
//! until it is sent again). See `docs/kafka.md` ("Forwarding") and
//! `docs/decisions/0018-ingest-any-partition.md`.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use palisade_core::{partition_for, BoxFuture, FencingToken, PartitionId, Scope};
use palisade_log::{AppendError, DeadLetter, IngestOutcome, IngestRecord, Origin, Source, Store};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use crate::message::{to_record, to_record_as};
use crate::{IngestConfig, KafkaIngestError};

/// Header naming a control record's kind (`owner`, `grant` or
/// [`OUTBOX_CONTROL`]).
pub const CONTROL_HEADER: &str = "palisade-control";
/// The [`CONTROL_HEADER`] value of an outbox delivery outcome.
pub const OUTBOX_CONTROL: &str = "outbox";
/// The [`CONTROL_HEADER`] value of an operator's removal of a dead outbox
/// effect.
pub const OUTBOX_REMOVE_CONTROL: &str = "outbox-remove";
/// Owner token: of an `owner` marker, or of the node that produced an HTTP
/// append.
pub const OWNER_TOKEN_HEADER: &str = "palisade-owner-token";
/// The node that produced a record (for people reading the log).
pub const NODE_HEADER: &str = "palisade-node";
/// Scope of a `grant` record.
pub const SCOPE_HEADER: &str = "palisade-scope";
/// Holder of a `grant` record.
pub const HOLDER_HEADER: &str = "palisade-holder";
/// A forwarded record: the partition it was produced to (its origin).
pub const ORIGIN_PARTITION_HEADER: &str = "palisade-origin-partition";
/// A forwarded record: its offset in the origin partition.
pub const ORIGIN_OFFSET_HEADER: &str = "palisade-origin-offset";
/// A forwarded record: the origin offset of the record of the same origin
/// partition forwarded to the same partition just before it (absent for
/// the first).
pub const ORIGIN_PREV_HEADER: &str = "palisade-origin-prev";
/// A forwarded record: the owner token under which its forwarder held the
/// origin partition (for people reading the log; the copy's content is the
/// origin record's, whoever forwards it).
pub const FORWARDED_BY_HEADER: &str = "palisade-forwarded-by";
/// An HTTP append's `If-Match` (decimal twin version): the record applies
/// only if its twin's version is this at the record's place in the log,
/// and is refused (`version_mismatch`) otherwise, by every node alike.
pub const IF_MATCH_HEADER: &str = "palisade-if-match";
/// Dead-letter reason of a record produced for an HTTP append under an
/// owner token below the partition's owner fence (a former owner's write).
pub const STALE_OWNER: &str = "stale_owner";

/// Whether this node may apply a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It holds the owner lease with this token.
    Owned(FencingToken),
    /// Kafka no longer assigns it here: drop the record unapplied (the next
    /// owner applies it).
    NotAssigned,
    /// Assigned, but the owner lease cannot be had (another node holds it,
    /// or it was lost): stop consuming and rejoin.
    Lost,
}

/// What happened to a record, for an HTTP append waiting on it.
#[derive(Debug, Clone)]
pub enum Applied {
    Outcome(IngestOutcome),
    /// A control record.
    Control,
}

/// The node's side of ownership (etcd owner leases in `palisade serve`).
pub trait Ownership: Send + Sync + Debug {
    /// Kafka assigned these partitions. Called from the rebalance callback:
    /// must not block.
    fn assigned(&self, partitions: &[u32]);
    /// Kafka revoked these: stop applying and serving them at once. Must
    /// not block.
    fn revoked(&self, partitions: &[u32]);
    /// Wait until this node holds p's owner lease (taking it, and writing
    /// its owner marker, on first use).
    fn admit(&self, partition: u32) -> BoxFuture<'_, Admission>;
    /// [`Ownership::admit`]'s answer if it is known now; `None` if admit
    /// would wait (the consumer then pauses p and waits aside, so the other
    /// partitions keep flowing).
    fn admitted(&self, partition: u32) -> Option<Admission>;
    /// The record at `offset` of `partition` was handled (for HTTP appends
    /// waiting on their record, and for "caught up" after a takeover).
    fn handled(
        &self,
        partition: u32,
        offset: u64,
        applied: Applied,
        owner_marker: Option<(FencingToken, String)>,
    );
}

/// Settings of a client that is a consumer elsewhere, for a producer: less
/// those librdkafka's producer warns about (TLS and SASL settings apply to
/// both).
pub fn producer_settings(settings: &[(String, String)]) -> Vec<(String, String)> {
    let consumer_only = [
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "partition.assignment.strategy",
        "isolation.level",
        "queued.min.messages",
        "queued.max.messages.kbytes",
        "max.partition.fetch.bytes",
    ];
    settings
        .iter()
        .filter(|(k, _)| {
            !(consumer_only.contains(&k.as_str())
                || ["group.", "auto.", "enable.auto.", "fetch."]
                    .iter()
                    .any(|p| k.starts_with(p)))
        })
        .cloned()
        .collect()
}

/// Per (origin partition, partition forwarded to): the origin offset of the
/// last record forwarded, i.e. the `prev` of the next one. Reloaded from the
/// store whenever a partition is (re)assigned, right after its resume offset
/// is read, so it always matches a point at or after where consumption
/// resumes (re-forwarded records before that point are duplicates at the
/// receiver, whatever their `prev`).
type Chains = Arc<std::sync::Mutex<HashMap<(u32, u32), u64>>>;

/// Partitions waiting for this node's owner lease, paused in the consumer:
/// partition -> (the first record not handled, to seek back to once
/// admitted; the wait's number, so that a late answer of an ended wait is
/// ignored). A revoke or a new assignment of the partition ends its wait
/// (the assignment sets the position itself).
pub(crate) type Waiting = Arc<std::sync::Mutex<HashMap<u32, (u64, u64)>>>;

struct ClusterContext {
    store: Arc<Store>,
    topic: String,
    ownership: Arc<dyn Ownership>,
    chains: Chains,
    waiting: Waiting,
    /// Numbers the waits of [`Waiting`].
    waits: Arc<AtomicU64>,
    /// The partition snapshots' folder (decision 0038), if any.
    snapshots: Option<PathBuf>,
    /// Partitions assigned with a snapshot newer than this node's copy:
    /// paused, waiting for the consume loop to load it.
    loads: mpsc::UnboundedSender<Load>,
}

/// A partition snapshot to load before a partition assigned here resumes.
#[derive(Debug)]
pub(crate) struct Load {
    pub partition: u32,
    pub path: PathBuf,
    /// The last source offset the snapshot covers.
    pub offset: u64,
    /// The partition's wait in [`Waiting`].
    pub wait: u64,
}

fn tpl_of(topic: &str, partitions: &[u32]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        tpl.add_partition(topic, i32::try_from(*p).unwrap_or(i32::MAX));
    }
    tpl
}

impl ClientContext for ClusterContext {}

impl ConsumerContext for ClusterContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let parts: Vec<u32> = tpl
            .elements_for_topic(&self.topic)
            .iter()
            .filter_map(|e| u32::try_from(e.partition()).ok())
            .collect();
        // Cooperative (incremental) rebalancing: `tpl` holds only the
        // partitions that move, and the others keep flowing (decision 0034).
        // Eager (`range`, `roundrobin`): every partition is revoked, then
        // all assigned.
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        {
            let mut waiting = self
                .waiting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for p in &parts {
                waiting.remove(p);
            }
        }
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let mut loads = Vec::new();
                for p in &parts {
                    // Resume at the offset stored with the data: a node that
                    // owned p before replays only what it missed; a new one
                    // replays the whole partition, unless a snapshot ahead
                    // of its copy is there to load first (decision 0038).
                    let source = Source::new(self.topic.as_str(), *p);
                    let local = self.store.source_offset(&source).ok().flatten();
                    let mut resume = resume_after(local);
                    if let Some(dir) = &self.snapshots {
                        match palisade_log::handoff::latest(dir, &self.topic, *p) {
                            Ok(Some((path, offset))) if local.is_none_or(|l| l < offset) => {
                                resume = resume_after(Some(offset));
                                loads.push((*p, path, offset));
                            }
                            Ok(_) => {}
                            Err(e) => {
                                warn!(partition = p, error = %e, "cluster: cannot list partition snapshots; replaying the log")
                            }
                        }
                    }
                    // After the offset (see `Chains`).
                    reload_chains(&self.store, &self.chains, &source);
                    let _ = tpl.set_partition_offset(
                        &self.topic,
                        i32::try_from(*p).unwrap_or(0),
                        resume,
                    );
                    info!(partition = p, ?resume, "cluster: assigned");
                }
                self.ownership.assigned(&parts);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                // A pause outlives an unassign: a partition paused while it
                // waited for its owner lease, revoked and now assigned
                // again must flow (a no-op for one not paused).
                let assigned =
                    assigned.and_then(|()| consumer.resume(&tpl_of(&self.topic, &parts)));
                // Partitions with a snapshot to load wait for it, paused
                // (the others flow meanwhile).
                let ps: Vec<u32> = loads.iter().map(|(p, _, _)| *p).collect();
                assigned.and_then(|()| {
                    if ps.is_empty() {
                        return Ok(());
                    }
                    consumer.pause(&tpl_of(&self.topic, &ps))?;
                    let mut waiting = self
                        .waiting
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for (partition, path, offset) in loads {
                        let wait = self.waits.fetch_add(1, Ordering::Relaxed) + 1;
                        waiting.insert(partition, (offset + 1, wait));
                        info!(partition, offset, path = %path.display(), "cluster: partition paused until its snapshot is loaded");
                        let _ = self.loads.send(Load {
                            partition,
                            path,
                            offset,
                            wait,
                        });
                    }
                    Ok(())
                })
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.ownership.revoked(&parts);
                info!(partitions = ?parts, cooperative, "cluster: revoked");
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                error!(error = ?other, "rebalance error");
                self.ownership.revoked(&parts);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
        };
        if let Err(e) = result {
            error!(error = %e, "applying the rebalance failed");
        }
    }
}

type ClusterConsumer = StreamConsumer<ClusterContext>;

/// What the consume loop hands on, in log order: records for the store,
/// forwards whose copy is on its way, barriers.
enum Step {
    Record {
        partition: u32,
        offset: u64,
        record: IngestRecord,
    },
    /// The record at `offset` of `partition` was produced to partition
    /// `to`; once its copy is acknowledged, `IngestRecord::Forwarded` is
    /// queued in its place. Later records of every partition wait for it,
    /// so no stored offset passes a copy not yet in Kafka.
    Forward {
        partition: u32,
        offset: u64,
        to: u32,
        delivery: DeliveryFuture,
    },
    Barrier(oneshot::Sender<()>),
}

/// In-order completion of queued records.
enum Done {
    Record {
        partition: u32,
        offset: u64,
        outcome: oneshot::Receiver<Result<IngestOutcome, AppendError>>,
    },
    /// Everything before it is handled.
    Barrier(oneshot::Sender<()>),
}

/// The cluster-mode consumer-group member.
#[derive(Debug)]
pub struct ClusterIngester;

impl ClusterIngester {
    /// Consume until `shutdown`; transient failures (and a lost owner
    /// lease) restart the consumer, which rejoins the group and resumes from
    /// the offsets stored with the data.
    pub async fn run(
        store: Arc<Store>,
        cfg: IngestConfig,
        ownership: Arc<dyn Ownership>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), KafkaIngestError> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                r = Self::run_once(store.clone(), &cfg, ownership.clone()) => match r {
                    Err(e @ KafkaIngestError::PartitionMismatch { .. }) => return Err(e),
                    Err(e) => error!(error = %e, "cluster ingest stopped; rejoining from the stored offsets"),
                    Ok(()) => {}
                },
            }
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }

    async fn run_once(
        store: Arc<Store>,
        cfg: &IngestConfig,
        ownership: Arc<dyn Ownership>,
    ) -> Result<(), KafkaIngestError> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &cfg.brokers)
            .set("group.id", &cfg.group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            // Incremental rebalancing (decision 0034): only the partitions
            // that move are revoked (before they are assigned elsewhere, in
            // a second rebalance, so two nodes never both think Kafka gave
            // them p); the others keep flowing.
            .set("partition.assignment.strategy", "cooperative-sticky");
        for (k, v) in &cfg.client_settings {
            cc.set(k, v);
        }
        let chains: Chains = Arc::default();
        let waiting: Waiting = Arc::default();
        let waits = Arc::new(AtomicU64::new(0));
        let (loads_tx, mut loads) = mpsc::unbounded_channel::<Load>();
        let consumer: Arc<ClusterConsumer> = Arc::new(cc.create_with_context(ClusterContext {
            store: store.clone(),
            topic: cfg.topic.clone(),
            ownership: ownership.clone(),
            chains: chains.clone(),
            waiting: waiting.clone(),
            waits: waits.clone(),
            snapshots: cfg.snapshots.as_ref().map(|s| s.dir.clone()),
            loads: loads_tx,
        })?);
        // The forwarding producer: acks=all and idempotent, so copies of one
        // partition land in the order they are produced, each once.
        let mut pc = ClientConfig::new();
        pc.set("bootstrap.servers", &cfg.brokers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "10000");
        for (k, v) in producer_settings(&cfg.client_settings) {
            pc.set(k, v);
        }
        let producer: FutureProducer = pc.create()?;
        // Offsets of a store migrated from layout 2 (see the single-node
        // ingester): this topic takes them before any assignment.
        store.claim_legacy_offsets(&cfg.topic).await?;
        let topic: Arc<str> = cfg.topic.as_str().into();
        let md = consumer.fetch_metadata(Some(&cfg.topic), Duration::from_secs(10))?;
        if let Some(t) = md.topics().iter().find(|t| t.name() == cfg.topic) {
            let n = t.partitions().len();
            if n != 0 && n != store.partitions() as usize {
                return Err(KafkaIngestError::PartitionMismatch {
                    topic: cfg.topic.clone(),
                    topic_partitions: n,
                    store_partitions: store.partitions(),
                });
            }
        }
        consumer.subscribe(&[&cfg.topic])?;
        info!("cluster: consuming");
        // Lag per assigned partition, and the progress of a partition
        // rebuilt after a handoff (a replay from its stored offset).
        let lag = tokio::spawn(crate::ingester::report_lag(
            consumer.clone(),
            store.clone(),
            cfg.topic.clone(),
        ));
        let (done_tx, mut rx) = mpsc::channel::<Done>(4096);
        let (tx, mut steps) = mpsc::channel::<Step>(4096);
        let stepper = {
            let store = store.clone();
            let topic = topic.clone();
            tokio::spawn(async move {
                let source = |partition| Source {
                    topic: topic.clone(),
                    partition,
                };
                while let Some(step) = steps.recv().await {
                    let done = match step {
                        Step::Record {
                            partition,
                            offset,
                            record,
                        } => Done::Record {
                            partition,
                            offset,
                            outcome: store
                                .enqueue_ingest(&source(partition), offset, record)
                                .await?,
                        },
                        Step::Forward {
                            partition,
                            offset,
                            to,
                            delivery,
                        } => {
                            let at = match delivery.await {
                                Ok(Ok(d)) => u64::try_from(d.offset).unwrap_or(0),
                                // Not stored: the consumer restarts at the
                                // stored offset and forwards it again.
                                Ok(Err((e, _))) => return Err(KafkaIngestError::Kafka(e)),
                                Err(_) => {
                                    return Err(KafkaIngestError::Kafka(KafkaError::Canceled))
                                }
                            };
                            let record = IngestRecord::Forwarded { to, at };
                            Done::Record {
                                partition,
                                offset,
                                outcome: store
                                    .enqueue_ingest(&source(partition), offset, record)
                                    .await?,
                            }
                        }
                        Step::Barrier(b) => Done::Barrier(b),
                    };
                    if done_tx.send(done).await.is_err() {
                        break;
                    }
                }
                Ok::<(), KafkaIngestError>(())
            })
        };
        let acker = {
            let ownership = ownership.clone();
            let store = store.clone();
            tokio::spawn(async move {
                while let Some(d) = rx.recv().await {
                    match d {
                        Done::Record {
                            partition,
                            offset,
                            outcome,
                        } => match outcome.await {
                            Ok(Ok(o)) => {
                                count(&store, partition, &o);
                                ownership.handled(partition, offset, Applied::Outcome(o), None);
                            }
                            Ok(Err(e)) => return Err(KafkaIngestError::Store(e)),
                            Err(_) => return Err(KafkaIngestError::Store(AppendError::Closed)),
                        },
                        Done::Barrier(b) => {
                            let _ = b.send(());
                        }
                    }
                }
                Ok(())
            })
        };
        let mut owner_fences: HashMap<u32, u64> = HashMap::new();
        // Owner-lease waits that ended: (partition, wait number, answer).
        let (admitted_tx, mut admitted) = mpsc::unbounded_channel::<(u32, u64, Admission)>();
        // Snapshot loads and writes take turns (one partition's keys are
        // never read while they are replaced).
        let handoff = Arc::new(tokio::sync::Mutex::new(()));
        let (loaded_tx, mut loaded) =
            mpsc::unbounded_channel::<(Load, Result<(), palisade_log::handoff::SnapshotError>)>();
        let snapshotter = cfg.snapshots.clone().map(|s| {
            tokio::spawn(crate::snapshots::write_loop(
                store.clone(),
                cfg.topic.clone(),
                s,
                ownership.clone(),
                waiting.clone(),
                handoff.clone(),
            ))
        });
        let result: Result<(), KafkaIngestError> = async {
            loop {
                let msg = tokio::select! {
                    m = consumer.recv() => m?,
                    Some((p, wait, answer)) = admitted.recv() => {
                        if !admit_waited(&consumer, &cfg.topic, &waiting, p, wait, answer) {
                            return Ok(());
                        }
                        continue;
                    }
                    Some(load) = loads.recv() => {
                        let (store, topic, tx, done, handoff) = (store.clone(), cfg.topic.clone(), tx.clone(), loaded_tx.clone(), handoff.clone());
                        tokio::spawn(async move {
                            let _turn = handoff.lock().await;
                            // Whatever of p is still queued is applied first.
                            barrier(&tx).await;
                            let r = crate::snapshots::load(&store, &topic, &load).await;
                            let _ = done.send((load, r));
                        });
                        continue;
                    }
                    Some((load, r)) = loaded.recv() => {
                        let p = load.partition;
                        match r {
                            Ok(()) => {}
                            Err(e @ (palisade_log::handoff::SnapshotError::Storage(_) | palisade_log::handoff::SnapshotError::Closed)) => {
                                return Err(KafkaIngestError::Store(AppendError::Storage(e.to_string())));
                            }
                            Err(e) => warn!(partition = p, error = %e, "cluster: partition snapshot not loaded; replaying the log from this node's copy"),
                        }
                        // Whatever happened, the store's offset is where p
                        // resumes; its owner fence and chains are re-read.
                        owner_fences.remove(&p);
                        let source = Source::new(cfg.topic.as_str(), p);
                        reload_chains(&store, &chains, &source);
                        let at = resume_after(store.source_offset(&source).ok().flatten());
                        if !resume_waited(&consumer, &cfg.topic, &waiting, p, load.wait, at) {
                            return Ok(());
                        }
                        continue;
                    }
                    () = tx.closed() => return Ok(()),
                };
                let (Ok(p), Ok(o)) = (u32::try_from(msg.partition()), u64::try_from(msg.offset())) else {
                    continue;
                };
                // Fetched before p was paused: read again once admitted.
                if waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains_key(&p) {
                    continue;
                }
                let control = header_str(&msg, CONTROL_HEADER);
                let owner_token = header_str(&msg, OWNER_TOKEN_HEADER).and_then(|t| t.parse::<u64>().ok());
                let node = header_str(&msg, NODE_HEADER).unwrap_or_default();
                let grant = match control.as_deref() {
                    Some("grant") => Some((
                        header_str(&msg, crate::decode::TOKEN_HEADER).and_then(|t| t.parse::<u64>().ok()),
                        header_str(&msg, SCOPE_HEADER).and_then(|s| s.parse::<Scope>().ok()),
                        header_str(&msg, HOLDER_HEADER).unwrap_or_default(),
                    )),
                    _ => None,
                };
                let outbox = (control.as_deref() == Some(OUTBOX_CONTROL))
                    .then(|| msg.payload().map(palisade_log::OutboxOutcome::from_json));
                let removal = (control.as_deref() == Some(OUTBOX_REMOVE_CONTROL))
                    .then(|| msg.payload().map(palisade_log::parse_removal));
                let strict = cfg.strict_partitioning.then(|| store.partitions());
                let record = control.is_none().then(|| match origin_of(&msg) {
                    // A node's record of an HTTP append: its events may
                    // carry effects (the fenced outbox).
                    None if owner_token.is_some() => {
                        crate::message::to_record_with_effects(&msg, strict, cfg.max_value_bytes)
                    }
                    None => to_record(&msg, strict, cfg.max_value_bytes),
                    Some(Ok(origin)) => IngestRecord::Relayed {
                        origin,
                        // Event ids default from the origin position, as if
                        // the record had been read there.
                        record: Box::new(to_record_as(
                            &msg,
                            i32::try_from(origin.partition).unwrap_or(0),
                            i64::try_from(origin.offset).unwrap_or(0),
                            cfg.max_value_bytes,
                        )),
                    },
                    Some(Err(refusal)) => {
                        let headers = crate::message::headers_of(&msg);
                        crate::message::dead_letter(&msg, &headers, refusal)
                    }
                });
                let record = record.map(|r| expecting(r, &msg));
                // Its twin's partition, if another: forward a copy there.
                let copy = match &record {
                    Some(IngestRecord::Append { twin, .. }) => {
                        let to = partition_for(twin, store.partitions()).0;
                        (to != p).then(|| (to, Copy::of(&msg)))
                    }
                    _ => None,
                };
                // A copy belongs in its twin's partition: this node applies
                // partition p only, so one elsewhere cannot be applied here.
                let record = record.map(|r| match r {
                    IngestRecord::Relayed { record: inner, .. }
                        if matches!(&*inner, IngestRecord::Append { twin, .. } if partition_for(twin, store.partitions()).0 != p) =>
                    {
                        let headers = crate::message::headers_of(&msg);
                        crate::message::dead_letter(&msg, &headers, crate::decode::Refusal {
                            reason: "bad_forward",
                            detail: format!("a forwarded copy in partition {p}, which does not hold its twin"),
                        })
                    }
                    other => other,
                });
                // Authentication on: a record decided here (not one
                // forwarded elsewhere, whose token's grant is in another
                // partition) must be signed by a principal that may write
                // it with a token granted to it (`sign.rs`), exactly as on
                // one node; the owner of a token granted through any node
                // was learnt from etcd when its grant record was applied.
                let record = match (record, &copy) {
                    (Some(r), None) if cfg.auth.is_some() => {
                        Some(crate::sign::check_decided(r, &msg, cfg))
                    }
                    (r, _) => r,
                };
                // A borrowed message is not Send: nothing below may hold it.
                drop(msg);
                let token = match ownership.admitted(p) {
                    Some(Admission::Owned(t)) => t,
                    Some(Admission::NotAssigned) => continue,
                    Some(Admission::Lost) => {
                        warn!(partition = p, "cluster: owner lease lost while assigned; rejoining");
                        return Ok(());
                    }
                    None => {
                        // Wait for p's owner lease aside, p paused, so the
                        // other partitions keep flowing; this record is read
                        // again once admitted.
                        if let Err(e) = consumer.pause(&tpl_of(&cfg.topic, &[p])) {
                            warn!(partition = p, error = %e, "cluster: cannot pause a partition waiting for its owner lease; rejoining");
                            return Ok(());
                        }
                        let wait = waits.fetch_add(1, Ordering::Relaxed) + 1;
                        waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(p, (o, wait));
                        info!(partition = p, offset = o, "cluster: partition paused until this node holds its owner lease");
                        let (ownership, done) = (ownership.clone(), admitted_tx.clone());
                        tokio::spawn(async move {
                            let answer = ownership.admit(p).await;
                            let _ = done.send((p, wait, answer));
                        });
                        continue;
                    }
                };
                let fence = match owner_fences.get(&p) {
                    Some(f) => *f,
                    None => {
                        let f = store.owner_fence(PartitionId(p)).map_err(|e| KafkaIngestError::Store(AppendError::Storage(e.to_string())))?;
                        owner_fences.insert(p, f);
                        f
                    }
                };
                match control.as_deref() {
                    Some("owner") => {
                        // Log order decides: everything queued before the
                        // marker is handled under the old fence.
                        barrier(&tx).await;
                        let t = owner_token.unwrap_or(0);
                        if t > fence {
                            store.raise_owner_fence(PartitionId(p), t).await.map_err(KafkaIngestError::Store)?;
                            owner_fences.insert(p, t);
                            info!(partition = p, offset = o, owner_token = t, owner = %node, applier_token = token.0, "cluster: owner marker applied");
                        } else {
                            warn!(partition = p, offset = o, owner_token = t, fence, owner = %node, "cluster: owner marker below the fence ignored");
                        }
                        ownership.handled(p, o, Applied::Control, Some((FencingToken(t), node)));
                    }
                    Some("grant") => {
                        barrier(&tx).await;
                        match grant {
                            Some((Some(t), Some(scope), holder)) => {
                                store.register_grant(FencingToken(t), scope, holder).await.map_err(|e| KafkaIngestError::Store(AppendError::Storage(e.to_string())))?;
                                if cfg.auth.is_some() {
                                    learn_owner(&store, FencingToken(t), p, o).await;
                                }
                            }
                            _ => warn!(partition = p, offset = o, "cluster: malformed grant record ignored"),
                        }
                        ownership.handled(p, o, Applied::Control, None);
                    }
                    Some(OUTBOX_CONTROL) => {
                        // After the event records queued before it: the
                        // entry it names exists once they are applied.
                        barrier(&tx).await;
                        match outbox {
                            Some(Some(Ok(outcome))) if outcome.partition == p => {
                                store.outbox_settle(&outcome).await.map_err(|e| KafkaIngestError::Store(AppendError::Storage(e.to_string())))?;
                            }
                            other => warn!(partition = p, offset = o, problem = ?other, "cluster: malformed outbox outcome record ignored"),
                        }
                        ownership.handled(p, o, Applied::Control, None);
                    }
                    Some(OUTBOX_REMOVE_CONTROL) => {
                        barrier(&tx).await;
                        match removal {
                            Some(Some(Ok((part, seq, index)))) if part == p => {
                                match store.outbox_remove_local(PartitionId(p), seq, index).await {
                                    Ok(_) => info!(partition = p, offset = o, seq, index, "cluster: dead outbox effect removed"),
                                    // Not there or not dead (any more) here: nothing to do.
                                    Err(palisade_log::OutboxRemoveError::NotFound { .. } | palisade_log::OutboxRemoveError::NotDead { .. }) => {}
                                    Err(e) => return Err(KafkaIngestError::Store(AppendError::Storage(e.to_string()))),
                                }
                            }
                            other => warn!(partition = p, offset = o, problem = ?other, "cluster: malformed outbox removal record ignored"),
                        }
                        ownership.handled(p, o, Applied::Control, None);
                    }
                    Some(other) => {
                        warn!(partition = p, offset = o, control = other, "cluster: unknown control record ignored");
                    }
                    None => {
                        let mut record = record.unwrap_or_else(|| unreachable_dead(p, o));
                        let stale_owner = owner_token.filter(|t| *t < fence);
                        if let (None, Some((to, copy))) = (stale_owner, copy) {
                            // Forwarded only while this node owns p; the
                            // copy's content is the record's, whoever
                            // forwards it, so a late forward of a former
                            // owner is a duplicate at the receiver.
                            let prev = chains
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .insert((p, to), o);
                            let delivery = copy.forward(&producer, &cfg.topic, p, o, to, prev, token).await?;
                            if tx.send(Step::Forward { partition: p, offset: o, to, delivery }).await.is_err() {
                                return Ok(());
                            }
                            continue;
                        }
                        if let Some(t) = stale_owner {
                            record = IngestRecord::Dead(DeadLetter {
                                partition: p,
                                offset: o,
                                key: None,
                                reason: STALE_OWNER.into(),
                                detail: format!("produced by {node} under owner token {t}, below the partition's owner fence {fence}"),
                                headers: Vec::new(),
                                value: Vec::new(),
                                value_len: 0,
                                at_ms: 0,
                            });
                            info!(partition = p, offset = o, owner_token = t, fence, "cluster: late write of a former owner refused");
                        }
                        if tx.send(Step::Record { partition: p, offset: o, record }).await.is_err() {
                            return Ok(());
                        }
                    }
                }
            }
        }
        .await;
        drop(tx);
        lag.abort();
        if let Some(s) = snapshotter {
            s.abort();
        }
        let stepped = stepper.await.unwrap_or(Ok(()));
        let acked = acker.await.unwrap_or(Ok(()));
        result.and(stepped).and(acked)
    }
}

/// A wait for p's owner lease ended with `answer`: if it is still p's
/// current wait, resume p at the first record it did not handle (admitted),
/// or leave it to the next assignment (not assigned here any more). `false`:
/// rejoin the group (the lease cannot be had, or p cannot be resumed where
/// it stopped; the stored offsets are where it resumes then).
fn admit_waited(
    consumer: &ClusterConsumer,
    topic: &str,
    waiting: &Waiting,
    p: u32,
    wait: u64,
    answer: Admission,
) -> bool {
    let Some(from) = end_wait(waiting, p, wait) else {
        return true;
    };
    match answer {
        Admission::Owned(_) => {
            // The pause moved the fetch position past the record that
            // waited (librdkafka resumes after the last record handed
            // out): seek back to it first.
            let at = Offset::Offset(i64::try_from(from).unwrap_or(i64::MAX));
            resume_at(consumer, topic, p, at, "owner lease had")
        }
        Admission::NotAssigned => true,
        Admission::Lost => {
            warn!(
                partition = p,
                "cluster: owner lease lost while assigned; rejoining"
            );
            false
        }
    }
}

/// Seek paused partition `p` to `at` and resume it; `false`: rejoin.
fn resume_at(consumer: &ClusterConsumer, topic: &str, p: u32, at: Offset, why: &str) -> bool {
    let partition = i32::try_from(p).unwrap_or(i32::MAX);
    match consumer
        .seek(topic, partition, at, Duration::from_secs(10))
        .and_then(|()| consumer.resume(&tpl_of(topic, &[p])))
    {
        Ok(()) => {
            info!(partition = p, offset = ?at, "cluster: {why}; partition resumed");
            true
        }
        Err(e) => {
            warn!(partition = p, error = %e, "cluster: cannot resume a partition where it waited; rejoining");
            false
        }
    }
}

/// The snapshot load of `p`'s wait `wait` ended: if it is still p's
/// current wait, resume p at `at`. `false`: rejoin.
fn resume_waited(
    consumer: &ClusterConsumer,
    topic: &str,
    waiting: &Waiting,
    p: u32,
    wait: u64,
    at: Offset,
) -> bool {
    if end_wait(waiting, p, wait).is_none() {
        return true;
    }
    resume_at(consumer, topic, p, at, "snapshot handled")
}

/// End p's wait number `wait` if it is still p's current one: the offset
/// it waited at. `None`: ended meanwhile by a revoke or a new assignment
/// (which set the position itself).
fn end_wait(waiting: &Waiting, p: u32, wait: u64) -> Option<u64> {
    let mut w = waiting
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match w.get(&p) {
        Some((from, n)) if *n == wait => {
            let from = *from;
            w.remove(&p);
            Some(from)
        }
        _ => None,
    }
}

/// Load `source`'s forward chains from the store again (after its resume
/// offset was read, see `Chains`).
fn reload_chains(store: &Store, chains: &Chains, source: &Source) {
    let stored = store.forward_chains(source).unwrap_or_default();
    let p = source.partition;
    let mut chains = chains
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    chains.retain(|(from, _), _| *from != p);
    chains.extend(stored.into_iter().map(|(to, o)| ((p, to), o)));
}

/// Where a partition resumes after `stored`, the last offset handled.
fn resume_after(stored: Option<u64>) -> Offset {
    stored.map_or(Offset::Beginning, |o| {
        Offset::Offset(i64::try_from(o).unwrap_or(i64::MAX - 1) + 1)
    })
}

/// `record` with the version its `palisade-if-match` header expects (a
/// forwarded copy's inner record too: the header travels with the copy and
/// is checked where the twin is). A malformed header refuses the record
/// (`bad_if_match`) rather than applying it unconditionally.
fn expecting(record: IngestRecord, msg: &BorrowedMessage<'_>) -> IngestRecord {
    match record {
        IngestRecord::Append {
            twin,
            token,
            events,
            effects,
            ..
        } => match header_str(msg, IF_MATCH_HEADER).map(|v| (v.trim().parse::<u64>(), v)) {
            None => IngestRecord::Append {
                twin,
                token,
                events,
                effects,
                if_match: None,
            },
            Some((Ok(v), _)) => IngestRecord::Append {
                twin,
                token,
                events,
                effects,
                if_match: Some(v),
            },
            Some((Err(_), v)) => {
                let headers = crate::message::headers_of(msg);
                crate::message::dead_letter(
                    msg,
                    &headers,
                    crate::decode::Refusal {
                        reason: "bad_if_match",
                        detail: format!(
                            "{IF_MATCH_HEADER} must be a twin version (decimal), not {v:?}"
                        ),
                    },
                )
            }
        },
        // Inside, so that the copy still counts in its origin's chain.
        IngestRecord::Relayed { origin, record } => IngestRecord::Relayed {
            origin,
            record: Box::new(expecting(*record, msg)),
        },
        other => other,
    }
}

/// The origin of a forwarded copy (`None`: not a copy). Only cluster nodes
/// write these headers (`docs/kafka.md`).
fn origin_of(msg: &BorrowedMessage<'_>) -> Option<Result<Origin, crate::decode::Refusal>> {
    let partition = header_str(msg, ORIGIN_PARTITION_HEADER)?;
    let bad = |what: &str| crate::decode::Refusal {
        reason: "bad_forward",
        detail: format!("a forwarded copy with a bad {what} header"),
    };
    let parse = |name: &str| {
        header_str(msg, name)
            .map(|v| v.trim().parse::<u64>().map_err(|_| bad(name)))
            .transpose()
    };
    Some((|| {
        Ok(Origin {
            partition: partition
                .trim()
                .parse()
                .map_err(|_| bad(ORIGIN_PARTITION_HEADER))?,
            offset: parse(ORIGIN_OFFSET_HEADER)?.ok_or_else(|| bad(ORIGIN_OFFSET_HEADER))?,
            prev: parse(ORIGIN_PREV_HEADER)?,
        })
    })())
}

/// An owned copy of a record to forward (a borrowed message is not Send).
struct Copy {
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Copy {
    fn of(msg: &BorrowedMessage<'_>) -> Self {
        let headers = msg
            .headers()
            .map(|h| {
                (0..h.count())
                    .map(|i| h.get(i))
                    // Headers only nodes write are the forwarder's to set.
                    .filter(|h| {
                        let k = h.key.to_ascii_lowercase();
                        !(k.starts_with("palisade-origin-")
                            || k == OWNER_TOKEN_HEADER
                            || k == NODE_HEADER
                            || k == CONTROL_HEADER)
                    })
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            key: msg.key().map(<[u8]>::to_vec),
            value: msg.payload().map(<[u8]>::to_vec),
            headers,
        }
    }

    /// Produce the copy to partition `to` (without waiting for it).
    #[allow(clippy::too_many_arguments)]
    async fn forward(
        self,
        producer: &FutureProducer,
        topic: &str,
        from: u32,
        offset: u64,
        to: u32,
        prev: Option<u64>,
        owner: FencingToken,
    ) -> Result<DeliveryFuture, KafkaIngestError> {
        let (from_s, offset_s, owner_s) =
            (from.to_string(), offset.to_string(), owner.0.to_string());
        let prev_s = prev.map(|p| p.to_string());
        let mut headers = OwnedHeaders::new();
        for (k, v) in &self.headers {
            headers = headers.insert(Header {
                key: k,
                value: v.as_deref(),
            });
        }
        for (k, v) in [
            (ORIGIN_PARTITION_HEADER, Some(&from_s)),
            (ORIGIN_OFFSET_HEADER, Some(&offset_s)),
            (ORIGIN_PREV_HEADER, prev_s.as_ref()),
            // For people reading the log: who forwarded it, under which
            // owner token of the origin partition.
            (FORWARDED_BY_HEADER, Some(&owner_s)),
        ] {
            if let Some(v) = v {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic)
            .partition(i32::try_from(to).unwrap_or(0))
            .headers(headers);
        if let Some(k) = &self.key {
            rec = rec.key(k.as_slice());
        }
        if let Some(v) = &self.value {
            rec = rec.payload(v.as_slice());
        }
        loop {
            match producer.send_result(rec) {
                Ok(d) => return Ok(d),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    rec = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }
}

/// `palisade_kafka_records_total{outcome,partition}`, as the single-node
/// ingester counts them.
fn count(store: &Store, partition: u32, o: &IngestOutcome) {
    let name = crate::ingester::OUTCOMES[crate::ingester::outcome_index(o)];
    store.metrics().add(
        "palisade_kafka_records_total",
        "Kafka records handled, by outcome.",
        &[("outcome", name), ("partition", &partition.to_string())],
        1,
    );
}

fn unreachable_dead(p: u32, o: u64) -> IngestRecord {
    IngestRecord::Dead(DeadLetter {
        partition: p,
        offset: o,
        key: None,
        reason: "internal".into(),
        detail: "no record decoded".into(),
        headers: Vec::new(),
        value: Vec::new(),
        value_len: 0,
        at_ms: 0,
    })
}

/// Wait until everything queued before is handled.
async fn barrier(tx: &mpsc::Sender<Step>) {
    let (b, done) = oneshot::channel();
    if tx.send(Step::Barrier(b)).await.is_ok() {
        let _ = done.await;
    }
}

fn header_str(msg: &BorrowedMessage<'_>, name: &str) -> Option<String> {
    let h = msg.headers()?;
    (0..h.count())
        .map(|i| h.get(i))
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned)
}

/// Copy a granted token's owner from etcd into the store (authentication
/// on), retrying a few times over ~10 s while etcd does not answer. If it
/// still cannot, the token stays without an owner here and its writes are
/// refused (`token_not_yours`): the safe side, never a write let through.
async fn learn_owner(store: &Store, token: FencingToken, p: u32, o: u64) {
    let mut wait = Duration::from_millis(100);
    for attempt in 0..8 {
        match store.learn_token_owner(token).await {
            Ok(()) => return,
            Err(e) if attempt == 7 => {
                error!(partition = p, offset = o, token = token.0, error = %e, "cluster: the owner of a granted token could not be learnt; its writes will be refused as token_not_yours");
            }
            Err(e) => {
                warn!(partition = p, offset = o, token = token.0, error = %e, "cluster: learning a token's owner failed; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
        }
    }
}
