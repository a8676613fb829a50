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

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use palisade_core::{FencingToken, PartitionId, Scope};
use palisade_log::{AppendError, DeadLetter, IngestOutcome, IngestRecord, Source, Store};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use crate::message::to_record;
use crate::{IngestConfig, KafkaIngestError};

/// Header naming a control record's kind (`owner` or `grant`).
pub const CONTROL_HEADER: &str = "palisade-control";
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

/// A boxed, sendable future (the trait is used as `dyn Ownership`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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

struct ClusterContext {
    store: Arc<Store>,
    topic: String,
    ownership: Arc<dyn Ownership>,
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
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                for p in &parts {
                    // Resume at the offset stored with the data: a node that
                    // owned p before replays only what it missed; a new one
                    // replays the whole partition.
                    let resume = self
                        .store
                        .source_offset(&Source::new(self.topic.as_str(), *p))
                        .ok()
                        .flatten()
                        .map_or(Offset::Beginning, |o| {
                            Offset::Offset(i64::try_from(o).unwrap_or(i64::MAX - 1) + 1)
                        });
                    let _ = tpl.set_partition_offset(
                        &self.topic,
                        i32::try_from(*p).unwrap_or(0),
                        resume,
                    );
                    info!(partition = p, ?resume, "cluster: assigned");
                }
                self.ownership.assigned(&parts);
                consumer.assign(tpl)
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.ownership.revoked(&parts);
                info!(partitions = ?parts, "cluster: revoked");
                consumer.unassign()
            }
            other => {
                error!(error = ?other, "rebalance error");
                self.ownership.revoked(&parts);
                consumer.unassign()
            }
        };
        if let Err(e) = result {
            error!(error = %e, "applying the rebalance failed");
        }
    }
}

type ClusterConsumer = StreamConsumer<ClusterContext>;

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
            // Eager rebalancing: a revoke reaches every member before any
            // assignment, so two nodes never both think Kafka gave them p.
            .set("partition.assignment.strategy", "range");
        for (k, v) in &cfg.client_settings {
            cc.set(k, v);
        }
        let consumer: Arc<ClusterConsumer> = Arc::new(cc.create_with_context(ClusterContext {
            store: store.clone(),
            topic: cfg.topic.clone(),
            ownership: ownership.clone(),
        })?);
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
        let (tx, mut rx) = mpsc::channel::<Done>(4096);
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
        let result: Result<(), KafkaIngestError> = async {
            loop {
                let msg = tokio::select! {
                    m = consumer.recv() => m?,
                    () = tx.closed() => return Ok(()),
                };
                let (Ok(p), Ok(o)) = (u32::try_from(msg.partition()), u64::try_from(msg.offset())) else {
                    continue;
                };
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
                let record = control.is_none().then(|| to_record(&msg, Some(store.partitions()), cfg.max_value_bytes));
                // A borrowed message is not Send: nothing below may hold it.
                drop(msg);
                let token = match ownership.admit(p).await {
                    Admission::Owned(t) => t,
                    Admission::NotAssigned => continue,
                    Admission::Lost => {
                        warn!(partition = p, "cluster: owner lease lost while assigned; rejoining");
                        return Ok(());
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
                            }
                            _ => warn!(partition = p, offset = o, "cluster: malformed grant record ignored"),
                        }
                        ownership.handled(p, o, Applied::Control, None);
                    }
                    Some(other) => {
                        warn!(partition = p, offset = o, control = other, "cluster: unknown control record ignored");
                    }
                    None => {
                        let mut record = record.unwrap_or_else(|| unreachable_dead(p, o));
                        if let Some(t) = owner_token.filter(|t| *t < fence) {
                            record = IngestRecord::Dead(DeadLetter {
                                partition: p,
                                offset: o,
                                key: None,
                                reason: "stale_owner".into(),
                                detail: format!("produced by {node} under owner token {t}, below the partition's owner fence {fence}"),
                                headers: Vec::new(),
                                value: Vec::new(),
                                value_len: 0,
                                at_ms: 0,
                            });
                            info!(partition = p, offset = o, owner_token = t, fence, "cluster: late write of a former owner refused");
                        }
                        let outcome = store.enqueue_ingest(&Source::new(cfg.topic.as_str(), p), o, record).await?;
                        if tx.send(Done::Record { partition: p, offset: o, outcome }).await.is_err() {
                            return Ok(());
                        }
                    }
                }
            }
        }
        .await;
        drop(tx);
        let acked = acker.await.unwrap_or(Ok(()));
        result.and(acked)
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

async fn barrier(tx: &mpsc::Sender<Done>) {
    let (b, done) = oneshot::channel();
    if tx.send(Done::Barrier(b)).await.is_ok() {
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
