use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use palisade_log::{AppendError, IngestOutcome, IngestRecord, Source, Store};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, instrument, warn};

use crate::message::to_record;

/// Settings of the Kafka ingester (`palisade serve --kafka-*`).
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Bootstrap servers, `host:port[,host:port]`.
    pub brokers: String,
    pub topic: String,
    pub group: String,
    /// Also produce each dead-lettered record to this topic (best effort;
    /// the durable copy is the store's dead-letter store).
    pub dead_letter_topic: Option<String>,
    /// Largest record value accepted; larger ones are dead-lettered.
    pub max_value_bytes: usize,
    /// Strict mode: the topic must have as many partitions as the store,
    /// and a record outside its twin's murmur2 partition is dead-lettered
    /// (`wrong_partition`) instead of routed by key. Off by default: any
    /// producer's partitioner, and any partition count, work.
    pub strict_partitioning: bool,
    /// Extra librdkafka settings passed through (TLS, SASL, timeouts).
    pub client_settings: Vec<(String, String)>,
    /// How long to wait for the topic to appear before giving up.
    pub topic_wait: Duration,
    /// With authentication on: who may write what (`sign.rs`); a record it
    /// refuses is dead-lettered. `None`: every well-formed record is fenced
    /// and applied as before.
    pub auth: Option<std::sync::Arc<dyn crate::RecordAuth>>,
    /// Cluster mode: partition snapshots that bound a handoff
    /// (`cluster.rs`, decision 0038). `None`: a node that gains a
    /// partition replays its log from its own copy's offset.
    pub snapshots: Option<SnapshotSettings>,
}

/// Where partition snapshots go and how often the owner writes them.
#[derive(Debug, Clone)]
pub struct SnapshotSettings {
    /// A folder every node reaches.
    pub dir: std::path::PathBuf,
    pub every: Duration,
}

impl IngestConfig {
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topic: "twin-events".into(),
            group: "palisade".into(),
            dead_letter_topic: None,
            max_value_bytes: 1 << 20,
            strict_partitioning: false,
            client_settings: Vec::new(),
            topic_wait: Duration::from_secs(60),
            auth: None,
            snapshots: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KafkaIngestError {
    #[error("kafka client error: {0}")]
    Kafka(#[from] KafkaError),
    #[error("topic {topic} has {topic_partitions} partitions but the store has {store_partitions}; they must be equal in strict partitioning mode (--kafka-strict-partitioning, where Kafka partition p feeds Palisade partition p) and in cluster mode (a partition is the unit of ownership)")]
    PartitionMismatch {
        topic: String,
        topic_partitions: usize,
        store_partitions: u32,
    },
    #[error("topic {topic} did not appear within {waited:?}")]
    NoTopic { topic: String, waited: Duration },
    #[error("the store refused to ingest: {0}")]
    Store(#[from] AppendError),
}

/// Resumes every newly assigned partition at the offset stored with the data,
/// not at the group's committed offset: the committed offset can lag (or
/// lead) what the store applied, the stored one cannot.
struct IngestContext {
    store: Arc<Store>,
    topic: Arc<str>,
}

impl IngestContext {
    fn source(&self, partition: u32) -> Source {
        Source {
            topic: self.topic.clone(),
            partition,
        }
    }
}

impl ClientContext for IngestContext {}

impl ConsumerContext for IngestContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let parts: Vec<i32> = tpl
                    .elements_for_topic(&self.topic)
                    .iter()
                    .map(|e| e.partition())
                    .collect();
                for p in &parts {
                    let resume = u32::try_from(*p)
                        .ok()
                        .and_then(|p| self.store.source_offset(&self.source(p)).ok().flatten())
                        .map_or(Offset::Beginning, |o| {
                            Offset::Offset(i64::try_from(o).unwrap_or(i64::MAX - 1) + 1)
                        });
                    if let Err(e) = tpl.set_partition_offset(&self.topic, *p, resume) {
                        error!(partition = p, error = %e, "cannot set resume offset");
                    }
                    info!(partition = p, ?resume, "assigned");
                }
                if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                info!(partitions = ?tpl.elements().iter().map(|e| e.partition()).collect::<Vec<_>>(), "revoked");
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                error!(error = ?other, "rebalance error");
                consumer.unassign()
            }
        };
        if let Err(e) = result {
            error!(error = %e, "applying the rebalance failed");
        }
    }
}

type Consumer_ = StreamConsumer<IngestContext>;

/// Records of one partition queued in its writer as one batch, waiting
/// for their outcomes.
struct Pending {
    partition: i32,
    /// The batch's last offset: stored for the group commit once every
    /// outcome of the batch is durable.
    offset: i64,
    outcomes: oneshot::Receiver<Result<Vec<IngestOutcome>, AppendError>>,
    /// Per record, with a dead-letter topic: a copy of a decoded record,
    /// forwarded if the writer refuses it (unissued token, wrong scope,
    /// clock drift).
    copies: Vec<Option<DeadCopy>>,
}

/// Most records taken from the consumer's queue before they are handed to
/// the writers (one batch per partition).
const FETCH_MAX: usize = 2048;

/// Records of one partition taken in one fetch, in offset order.
struct Fetched {
    partition: i32,
    last_offset: i64,
    records: Vec<(u64, IngestRecord)>,
    copies: Vec<Option<DeadCopy>>,
}

/// The consumer-group member that feeds the store.
#[derive(Debug)]
pub struct Ingester;

impl Ingester {
    /// Consume until `shutdown` completes. Transient failures (broker gone,
    /// a storage error on one batch) restart the consumer after a pause; it
    /// resumes from the offsets stored with the data, so nothing is applied
    /// twice or skipped. Returns an error only for misconfiguration.
    pub async fn run(
        store: Arc<Store>,
        cfg: IngestConfig,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), KafkaIngestError> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                r = Self::run_once(store.clone(), &cfg) => match r {
                    Err(e @ (KafkaIngestError::PartitionMismatch { .. } | KafkaIngestError::NoTopic { .. })) => return Err(e),
                    Err(e) => {
                        error!(error = %e, "kafka ingest stopped; restarting from the stored offsets");
                        store.metrics().add("palisade_kafka_restarts_total", "Kafka consumer restarts after an error.", &[], 1);
                    }
                    Ok(()) => {}
                },
            }
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    #[instrument(skip_all, fields(topic = %cfg.topic, group = %cfg.group))]
    async fn run_once(store: Arc<Store>, cfg: &IngestConfig) -> Result<(), KafkaIngestError> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &cfg.brokers)
            .set("group.id", &cfg.group)
            .set("enable.auto.commit", "true")
            // Offsets are stored only once their record's outcome is durable.
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        for (k, v) in &cfg.client_settings {
            cc.set(k, v);
        }
        // Offsets of a store migrated from layout 2 were kept per partition
        // without their topic: this topic takes them (once), before any
        // assignment reads them.
        let claimed = store.claim_legacy_offsets(&cfg.topic).await?;
        if claimed > 0 {
            info!(
                partitions = claimed,
                "resuming from the offsets of the store's previous layout"
            );
        }
        let topic: Arc<str> = cfg.topic.as_str().into();
        let consumer: Arc<Consumer_> = Arc::new(cc.create_with_context(IngestContext {
            store: store.clone(),
            topic: topic.clone(),
        })?);
        check_topic(&consumer, &store, cfg).await?;
        consumer.subscribe(&[&cfg.topic])?;
        let dlq = match &cfg.dead_letter_topic {
            Some(t) => {
                let mut pc = ClientConfig::new();
                pc.set("bootstrap.servers", &cfg.brokers);
                for (k, v) in &cfg.client_settings {
                    pc.set(k, v);
                }
                Some((pc.create::<FutureProducer>()?, t.clone()))
            }
            None => None,
        };
        info!("consuming");

        let (tx, rx) = mpsc::channel::<Pending>(8192);
        let acks = tokio::spawn(acknowledge(
            consumer.clone(),
            store.clone(),
            cfg.topic.clone(),
            rx,
            dlq.clone(),
        ));
        let lag = tokio::spawn(report_lag(
            consumer.clone(),
            store.clone(),
            cfg.topic.clone(),
        ));
        let result = async {
            loop {
                let msg = tokio::select! {
                    m = consumer.recv() => m?,
                    // The acknowledger stops only on a failed batch.
                    () = tx.closed() => return Ok(()),
                };
                // Take what else is already in the consumer's queue, without
                // waiting, and hand it to the writers as one batch per
                // partition: one queue message and one reply per batch, not
                // per record.
                let mut fetched: Vec<Fetched> = Vec::new();
                let mut forward = Vec::new();
                let mut taken = 1;
                let strict = cfg.strict_partitioning.then(|| store.partitions());
                take(&msg, strict, cfg, dlq.is_some(), &mut fetched, &mut forward);
                // A borrowed message is not Send: nothing below may hold it.
                drop(msg);
                while taken < FETCH_MAX {
                    let ready = {
                        let mut next = std::pin::pin!(consumer.recv());
                        std::future::poll_fn(|cx| std::task::Poll::Ready(next.as_mut().poll(cx)))
                            .await
                    };
                    match ready {
                        std::task::Poll::Ready(m) => {
                            let m = m?;
                            take(&m, strict, cfg, dlq.is_some(), &mut fetched, &mut forward);
                            taken += 1;
                        }
                        std::task::Poll::Pending => break,
                    }
                }
                if let Some((producer, topic)) = &dlq {
                    for (copy, reason) in forward {
                        copy.send(&reason, producer, topic).await;
                    }
                }
                for f in fetched {
                    let Ok(p) = u32::try_from(f.partition) else {
                        continue;
                    };
                    let source = Source {
                        topic: topic.clone(),
                        partition: p,
                    };
                    let outcomes = store.enqueue_ingest_batch(&source, f.records).await?;
                    if tx
                        .send(Pending {
                            partition: f.partition,
                            offset: f.last_offset,
                            outcomes,
                            copies: f.copies,
                        })
                        .await
                        .is_err()
                    {
                        return Ok(());
                    }
                }
            }
        }
        .await;
        drop(tx);
        let acked = acks.await.unwrap_or(Ok(()));
        lag.abort();
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            warn!(error = %e, "final offset commit to Kafka failed (lag tooling only; the store has its offsets)");
        }
        result.and(acked)
    }
}

async fn check_topic(
    consumer: &Consumer_,
    store: &Store,
    cfg: &IngestConfig,
) -> Result<(), KafkaIngestError> {
    let started = std::time::Instant::now();
    loop {
        let md = consumer.fetch_metadata(Some(&cfg.topic), Duration::from_secs(5));
        if let Ok(md) = &md {
            if let Some(t) = md.topics().iter().find(|t| {
                t.name() == cfg.topic && t.error().is_none() && !t.partitions().is_empty()
            }) {
                let n = t.partitions().len();
                // Records are routed by key, so any count works, except in
                // strict mode, where partition p feeds partition p.
                if cfg.strict_partitioning && n != store.partitions() as usize {
                    return Err(KafkaIngestError::PartitionMismatch {
                        topic: cfg.topic.clone(),
                        topic_partitions: n,
                        store_partitions: store.partitions(),
                    });
                }
                return Ok(());
            }
        }
        if started.elapsed() > cfg.topic_wait {
            return match md {
                Err(e) => Err(e.into()),
                Ok(_) => Err(KafkaIngestError::NoTopic {
                    topic: cfg.topic.clone(),
                    waited: cfg.topic_wait,
                }),
            };
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Decode one consumed record into its partition's batch (`fetched`), and
/// queue a dead-letter-topic copy of an undecodable one (`forward`).
fn take(
    msg: &BorrowedMessage<'_>,
    strict_partitions: Option<u32>,
    cfg: &IngestConfig,
    with_dlq: bool,
    fetched: &mut Vec<Fetched>,
    forward: &mut Vec<(DeadCopy, String)>,
) {
    let (partition, offset) = (msg.partition(), msg.offset());
    let Ok(o) = u64::try_from(offset) else {
        warn!(partition, offset, "record with a negative offset ignored");
        return;
    };
    if partition < 0 {
        warn!(
            partition,
            offset, "record with a negative partition ignored"
        );
        return;
    }
    let record = match forwarded_by_a_cluster(msg) {
        Some(dead) => dead,
        None => crate::sign::check_record(
            to_record(msg, strict_partitions, cfg.max_value_bytes),
            msg,
            cfg,
        ),
    };
    let copy = match (&record, with_dlq) {
        (IngestRecord::Dead(dl), true) => {
            forward.push((DeadCopy::of(msg), dl.reason.clone()));
            None
        }
        (IngestRecord::Append { .. }, true) => Some(DeadCopy::of(msg)),
        _ => None,
    };
    let i = match fetched.iter().position(|f| f.partition == partition) {
        Some(i) => i,
        None => {
            fetched.push(Fetched {
                partition,
                last_offset: offset,
                records: Vec::new(),
                copies: Vec::new(),
            });
            fetched.len() - 1
        }
    };
    let f = &mut fetched[i];
    f.last_offset = offset;
    f.records.push((o, record));
    f.copies.push(copy);
}

/// A copy a cluster node forwarded to its twin's partition (it carries the
/// `palisade-origin-*` headers, `docs/kafka.md`): a single-node store
/// applies the original from its own partition, so the copy is
/// dead-lettered, as control records are (they have no key).
fn forwarded_by_a_cluster(msg: &BorrowedMessage<'_>) -> Option<IngestRecord> {
    let headers = crate::message::headers_of(msg);
    let origin = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case(crate::cluster::ORIGIN_PARTITION_HEADER));
    origin.then(|| {
        crate::message::dead_letter(
            msg,
            &headers,
            crate::decode::Refusal {
                reason: "forwarded_record",
                detail: "a copy a cluster node forwarded to its twin's partition; this single-node store applies the original record from the partition it was produced to".into(),
            },
        )
    })
}

/// An owned copy of a record, forwarded to the dead-letter topic if it is
/// dead-lettered.
struct DeadCopy {
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    source: String,
}

impl DeadCopy {
    fn of(msg: &BorrowedMessage<'_>) -> Self {
        let headers = msg
            .headers()
            .map(|h| {
                (0..h.count())
                    .map(|i| h.get(i))
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            key: msg.key().map(<[u8]>::to_vec),
            value: msg.payload().map(<[u8]>::to_vec),
            headers,
            source: format!("{}/{}/{}", msg.topic(), msg.partition(), msg.offset()),
        }
    }

    /// Best effort: the durable copy is the store's dead-letter store.
    async fn send(self, reason: &str, producer: &FutureProducer, topic: &str) {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &self.headers {
            headers = headers.insert(rdkafka::message::Header {
                key: k,
                value: v.as_deref(),
            });
        }
        headers = headers
            .insert(rdkafka::message::Header {
                key: "palisade-dead-reason",
                value: Some(reason.as_bytes()),
            })
            .insert(rdkafka::message::Header {
                key: "palisade-source",
                value: Some(self.source.as_bytes()),
            });
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = &self.key {
            rec = rec.key(k.as_slice());
        }
        if let Some(v) = &self.value {
            rec = rec.payload(v.as_slice());
        }
        if let Err((e, _)) = producer.send(rec, Duration::from_secs(5)).await {
            warn!(error = %e, "could not forward a dead letter to the dead-letter topic (it is in the store)");
        }
    }
}

/// Await each record's outcome in order, count it, and store its offset for
/// the group commit (lag tooling). A failed outcome stops the consumer: the
/// record was not applied and its offset not stored, so a restart resumes at it.
async fn acknowledge(
    consumer: Arc<Consumer_>,
    store: Arc<Store>,
    topic: String,
    mut rx: mpsc::Receiver<Pending>,
    dlq: Option<(FutureProducer, String)>,
) -> Result<(), KafkaIngestError> {
    const HELP: &str = "Kafka records handled, by outcome.";
    while let Some(p) = rx.recv().await {
        let outcomes = match p.outcomes.await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(AppendError::Closed.into()),
        };
        let mut counts = [0u64; OUTCOMES.len()];
        for (outcome, copy) in outcomes.iter().zip(p.copies) {
            // Refused by the writer (not at decoding): forward it now.
            if let (
                IngestOutcome::DeadLettered { reason, .. },
                Some(copy),
                Some((producer, topic)),
            ) = (outcome, copy, &dlq)
            {
                copy.send(reason, producer, topic).await;
            }
            counts[outcome_index(outcome)] += 1;
        }
        let part = p.partition.to_string();
        for (name, n) in OUTCOMES.into_iter().zip(counts) {
            if n > 0 {
                store.metrics().add(
                    "palisade_kafka_records_total",
                    HELP,
                    &[("outcome", name), ("partition", &part)],
                    n,
                );
            }
        }
        // librdkafka's rd_kafka_offset_store stores (and commits) offset + 1.
        if let Err(e) = consumer.store_offset(&topic, p.partition, p.offset) {
            // Happens after a revoke; harmless, the store has the offset.
            warn!(partition = p.partition, error = %e, "could not store the offset for the group commit");
        }
    }
    Ok(())
}

/// `outcome` label values of `palisade_kafka_records_total`, by
/// [`outcome_index`].
pub(crate) const OUTCOMES: [&str; 7] = [
    "applied",
    "already_applied",
    "dropped_stale",
    "dead_lettered",
    "forwarded",
    "duplicate",
    "out_of_order",
];

pub(crate) fn outcome_index(o: &IngestOutcome) -> usize {
    match o {
        IngestOutcome::Applied(_) => 0,
        IngestOutcome::AlreadyApplied => 1,
        IngestOutcome::Dropped(_) => 2,
        IngestOutcome::DeadLettered { .. } => 3,
        IngestOutcome::Forwarded { .. } => 4,
        IngestOutcome::Duplicate { .. } => 5,
        IngestOutcome::OutOfOrder { .. } => 6,
    }
}

/// Lag per assigned partition: high watermark minus the next offset to apply.
/// For dashboards only: some brokers (tansu 0.6) report wrong watermarks,
/// and nothing depends on this number. Used by the single-node ingester and
/// by cluster mode, where a partition gained in a rebalance is rebuilt by
/// replaying it: while a partition is far behind, a progress line with its
/// rate and ETA is logged on every tick ([`catch_up_line`]).
pub(crate) async fn report_lag<C, X>(consumer: Arc<C>, store: Arc<Store>, topic: String)
where
    C: Consumer<X> + Send + Sync + 'static,
    X: ConsumerContext + 'static,
{
    let mut tick = tokio::time::interval(LAG_EVERY);
    let mut before: std::collections::HashMap<i32, u64> = std::collections::HashMap::new();
    loop {
        tick.tick().await;
        // A partition list is not Send: copy the numbers out first.
        let parts: Vec<i32> = match consumer.assignment() {
            Ok(a) => a
                .elements_for_topic(&topic)
                .iter()
                .map(|e| e.partition())
                .collect(),
            Err(_) => continue,
        };
        for p in parts {
            let c = consumer.clone();
            let t = topic.clone();
            let Ok(Ok((_, high))) = tokio::task::spawn_blocking(move || {
                c.fetch_watermarks(&t, p, Duration::from_secs(2))
            })
            .await
            else {
                continue;
            };
            let next = u32::try_from(p)
                .ok()
                .and_then(|p| {
                    store
                        .source_offset(&Source::new(topic.as_str(), p))
                        .ok()
                        .flatten()
                })
                .map_or(0, |o| o.saturating_add(1));
            let lag = (high.max(0).cast_unsigned()).saturating_sub(next);
            #[allow(clippy::cast_precision_loss)]
            store.metrics().set_gauge(
                "palisade_kafka_lag",
                "Records in Kafka not yet applied (high watermark - next offset).",
                &[("partition", &p.to_string())],
                lag as f64,
            );
            if let Some(line) = catch_up_line(before.insert(p, lag), lag, LAG_EVERY) {
                info!(partition = p, lag, "{line}");
            }
        }
    }
}

/// How often lag is measured (and catch-up progress logged).
const LAG_EVERY: Duration = Duration::from_secs(5);
/// Records behind from which a partition's catch-up is logged.
const CATCH_UP_LOGGED_FROM: u64 = 1_000;

/// The progress line of a partition `lag` records behind that was
/// `before` records behind one tick (`every`) ago: applied records per
/// second and the time left at that rate. `None` below
/// [`CATCH_UP_LOGGED_FROM`] records (a live partition's normal lag).
fn catch_up_line(before: Option<u64>, lag: u64, every: Duration) -> Option<String> {
    if lag < CATCH_UP_LOGGED_FROM {
        return None;
    }
    let Some(before) = before else {
        return Some(format!("catching up: {lag} records behind"));
    };
    // Applied in the tick, net of what was produced meanwhile.
    #[allow(clippy::cast_precision_loss)]
    let rate = before.saturating_sub(lag) as f64 / every.as_secs_f64();
    if rate <= 0.0 {
        return Some(format!("catching up: {lag} records behind, not gaining"));
    }
    #[allow(clippy::cast_precision_loss)]
    let eta = lag as f64 / rate;
    Some(format!(
        "catching up: {lag} records behind, {rate:.0} records/s, about {eta:.0} s left"
    ))
}

#[cfg(test)]
mod catch_up_tests {
    use super::*;

    #[test]
    fn progress_is_logged_only_for_a_partition_far_behind() {
        let every = Duration::from_secs(5);
        assert_eq!(catch_up_line(Some(900), 999, every), None);
        assert_eq!(
            catch_up_line(None, 50_000, every).unwrap(),
            "catching up: 50000 records behind"
        );
        assert_eq!(
            catch_up_line(Some(60_000), 50_000, every).unwrap(),
            "catching up: 50000 records behind, 2000 records/s, about 25 s left"
        );
        assert_eq!(
            catch_up_line(Some(40_000), 50_000, every).unwrap(),
            "catching up: 50000 records behind, not gaining"
        );
    }
}
