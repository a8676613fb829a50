//! Kafka for the `ingest` scenario: librdkafka's mock cluster on its own
//! thread (it is not `Send`), pre-loading a topic as a worker would
//! (`palisade_kafka::Publisher`), the raw-consume baseline, and the store's
//! ingester measured from its first applied record to its last.

use std::collections::BTreeMap;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use palisade_core::{NewEvent, TwinId};
use palisade_log::Store;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;

use super::load::{self, Events};
use super::stats::StoreMetrics;
use super::target::Twins;

enum MockCmd {
    CreateTopic(String, i32, std_mpsc::Sender<Result<(), String>>),
}

/// librdkafka's mock cluster (what `palisade dev-kafka` serves), kept on a
/// thread of its own because it is not `Send`. Stopped when dropped.
#[derive(Debug)]
pub struct MockKafka {
    pub bootstrap: String,
    cmds: Option<std_mpsc::Sender<MockCmd>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockKafka {
    pub fn start() -> anyhow::Result<Self> {
        let (boot_tx, boot_rx) = std_mpsc::channel::<Result<String, String>>();
        let (cmd_tx, cmd_rx) = std_mpsc::channel::<MockCmd>();
        let thread = std::thread::Builder::new()
            .name("bench-mock-kafka".into())
            .spawn(move || {
                let cluster: MockCluster<'static, DefaultProducerContext> =
                    match MockCluster::new(1) {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = boot_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                let _ = boot_tx.send(Ok(cluster.bootstrap_servers()));
                // Runs until every sender is gone (the MockKafka was dropped).
                while let Ok(cmd) = cmd_rx.recv() {
                    match cmd {
                        MockCmd::CreateTopic(name, parts, reply) => {
                            let r = cluster
                                .create_topic(&name, parts, 1)
                                .map_err(|e| e.to_string());
                            let _ = reply.send(r);
                        }
                    }
                }
                drop(cluster);
            })
            .context("cannot start the mock Kafka thread")?;
        let bootstrap = boot_rx
            .recv_timeout(Duration::from_secs(30))
            .context("the mock Kafka cluster did not start")?
            .map_err(|e| anyhow::anyhow!("cannot start librdkafka's mock cluster: {e}"))?;
        Ok(Self {
            bootstrap,
            cmds: Some(cmd_tx),
            thread: Some(thread),
        })
    }

    pub fn create_topic(&self, name: &str, partitions: i32) -> anyhow::Result<()> {
        let (tx, rx) = std_mpsc::channel();
        self.cmds
            .as_ref()
            .context("mock cluster stopped")?
            .send(MockCmd::CreateTopic(name.to_owned(), partitions, tx))
            .map_err(|_| anyhow::anyhow!("the mock Kafka thread is gone"))?;
        rx.recv_timeout(Duration::from_secs(30))
            .context("the mock cluster did not answer")?
            .map_err(|e| anyhow::anyhow!("cannot create topic {name}: {e}"))
    }
}

impl Drop for MockKafka {
    fn drop(&mut self) {
        self.cmds.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The broker the bench uses: its own mock cluster, or `--kafka-brokers`.
#[derive(Debug)]
pub enum Broker {
    Mock(MockKafka),
    External(String),
}

impl Broker {
    pub fn bootstrap(&self) -> &str {
        match self {
            Self::Mock(m) => &m.bootstrap,
            Self::External(b) => b,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Mock(_) => "librdkafka mock cluster (in-process, as `palisade dev-kafka`)",
            Self::External(_) => "external (--kafka-brokers)",
        }
    }

    pub async fn create_topic(&self, name: &str, partitions: u32) -> anyhow::Result<()> {
        let parts = i32::try_from(partitions).context("partition count")?;
        match self {
            Self::Mock(m) => m.create_topic(name, parts),
            Self::External(b) => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", b)
                    .create()
                    .context("cannot create a Kafka admin client")?;
                let topic = NewTopic::new(name, parts, TopicReplication::Fixed(1));
                let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
                let r = tokio::time::timeout(
                    Duration::from_secs(45),
                    admin.create_topics([&topic], &opts),
                )
                .await
                .with_context(|| format!("creating topic {name} on {b} timed out"))?
                .with_context(|| format!("cannot create topic {name} on {b}"))?;
                for res in r {
                    match res {
                        Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                        Err((t, code)) => bail!("cannot create topic {t}: {code:?}"),
                    }
                }
                Ok(())
            }
        }
    }
}

/// How the pre-load producer picks a record's partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioner {
    /// Kafka's Java partitioner (murmur2 of the key): every record is in its
    /// twin's store partition.
    Murmur2,
    /// librdkafka's default, `consistent_random` (CRC32 of the key), as
    /// kcat, confluent-kafka and rdkafka produce by default: most records are
    /// in another partition than their twin's, and the store routes them.
    LibrdkafkaDefault,
}

/// What the pre-load produced.
#[derive(Debug, Clone, Default)]
pub struct Preloaded {
    /// The last offset of each Kafka partition.
    pub last: BTreeMap<i32, i64>,
    /// Records per second produced.
    pub rate: f64,
    /// Records outside their twin's store partition.
    pub foreign: u64,
}

/// Produce `records` events (one per record) for random twins, each under
/// its partition's token, with `partitioner`.
#[allow(clippy::too_many_arguments)]
pub async fn preload(
    bootstrap: &str,
    topic: &str,
    partitions: u32,
    twins: &Twins,
    tokens: &[u64],
    records: u64,
    events: &Events,
    partitioner: Partitioner,
) -> anyhow::Result<Preloaded> {
    let mut settings: Vec<(String, String)> = vec![
        ("linger.ms".into(), "5".into()),
        ("queue.buffering.max.messages".into(), "1000000".into()),
        ("batch.num.messages".into(), "10000".into()),
    ];
    if partitioner == Partitioner::LibrdkafkaDefault {
        // Overrides the publisher's murmur2_random (settings come last).
        settings.push(("partitioner".into(), "consistent_random".into()));
    }
    let publisher = palisade_kafka::Publisher::new(bootstrap, topic, &settings)
        .context("cannot create the Kafka producer")?;
    let publisher = Arc::new(match partitioner {
        Partitioner::Murmur2 => publisher.with_partitions(partitions),
        Partitioner::LibrdkafkaDefault => publisher,
    });
    let patch: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&events.patch).context("bench patch")?;
    let mut rng = load::Rng::new();
    let mut last: BTreeMap<i32, i64> = BTreeMap::new();
    let mut foreign = 0u64;
    let started = Instant::now();
    let bar = load::progress(
        "ingest: pre-loading the topic",
        load::Window::Requests(records),
    );
    let mut sent = 0u64;
    while sent < records {
        let chunk = (records - sent).min(5000);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..chunk {
            let idx = rng.below(twins.ids.len());
            let twin = TwinId::new(twins.ids[idx].clone())?;
            let token = palisade_core::FencingToken(tokens[twins.partition[idx] as usize]);
            let ev = NewEvent {
                event_id: format!("{}-k{}", events.nonce, sent + i),
                event_type: "telemetry".into(),
                patch: patch.clone(),
                hlc: None,
            };
            let p = publisher.clone();
            let own = twins.partition[idx];
            set.spawn(async move { (own, p.publish(&twin, token, &ev).await) });
        }
        while let Some(r) = set.join_next().await {
            let (own, r) = r.context("a publish task panicked")?;
            let (part, off) = r.context("publishing to Kafka failed")?;
            if i64::from(part) != i64::from(own) {
                foreign += 1;
            }
            let e = last.entry(part).or_insert(off);
            *e = (*e).max(off);
        }
        sent += chunk;
        bar.set_position(sent);
    }
    bar.finish_and_clear();
    #[allow(clippy::cast_precision_loss)]
    let rate = records as f64 / started.elapsed().as_secs_f64();
    Ok(Preloaded {
        last,
        rate,
        foreign,
    })
}

/// Progress of one consumer: (seconds since its first record, records).
#[derive(Debug, Clone, Default)]
pub struct Consumed {
    pub records: u64,
    /// From the first record to the last.
    pub elapsed: Duration,
    /// From the start (subscribe or assign) to the first record.
    pub to_first: Duration,
    pub series: Vec<(f64, f64)>,
}

impl Consumed {
    pub fn rate(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let r = self.records.saturating_sub(1) as f64;
        r / self.elapsed.as_secs_f64().max(1e-6)
    }
}

/// The baseline: a plain rdkafka consumer (the ingester's kind,
/// `StreamConsumer`), assigned every partition from the beginning, reading
/// every record and touching its payload. No group join, no store.
pub async fn raw_consume(
    bootstrap: &str,
    topic: &str,
    partitions: u32,
    total: u64,
    timeout: Duration,
) -> anyhow::Result<Consumed> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("{topic}-raw"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .context("cannot create the raw Kafka consumer")?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, i32::try_from(p)?, Offset::Beginning)?;
    }
    consumer.assign(&tpl).context("assign")?;
    let bar = load::progress("ingest: raw rdkafka consume", load::Window::Requests(total));
    let started = Instant::now();
    let mut first: Option<Instant> = None;
    let mut out = Consumed::default();
    let mut bytes = 0usize;
    let step = (total / 200).max(1);
    while out.records < total {
        let left = timeout.saturating_sub(started.elapsed());
        let msg = tokio::time::timeout(left, consumer.recv())
            .await
            .with_context(|| {
                format!(
                    "raw consume: {} of {total} records after {timeout:?}",
                    out.records
                )
            })?
            .context("raw consume")?;
        bytes += msg.payload().map_or(0, <[u8]>::len) + msg.key().map_or(0, <[u8]>::len);
        drop(msg);
        let now = Instant::now();
        let f = *first.get_or_insert(now);
        out.records += 1;
        if out.records % step == 0 || out.records == total || out.records == 1 {
            #[allow(clippy::cast_precision_loss)]
            out.series
                .push(((now - f).as_secs_f64(), out.records as f64));
            bar.set_position(out.records);
        }
        out.elapsed = now - f;
    }
    bar.finish_and_clear();
    out.to_first = first.map_or(Duration::ZERO, |f| f - started);
    tracing::debug!(bytes, "raw consume done");
    Ok(out)
}

/// The store's ingester (`palisade serve --kafka-brokers`) on the topic:
/// consumed -> fenced -> appended -> flushed -> offset stored. Measured from
/// the first record applied to the last (the group join is reported apart).
pub async fn ingest(
    rt: &tokio::runtime::Handle,
    store: &Arc<Store>,
    bootstrap: &str,
    topic: &str,
    last: &BTreeMap<i32, i64>,
    total: u64,
    timeout: Duration,
) -> anyhow::Result<(Consumed, Vec<(f64, f64)>)> {
    let mut cfg = palisade_kafka::IngestConfig::new(bootstrap.to_owned());
    cfg.topic = topic.to_owned();
    cfg.group = format!("{topic}-ingest");
    cfg.topic_wait = Duration::from_secs(30);
    cfg.client_settings = vec![
        ("session.timeout.ms".into(), "6000".into()),
        ("heartbeat.interval.ms".into(), "500".into()),
    ];
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let task = rt.spawn(palisade_kafka::Ingester::run(
        store.clone(),
        cfg,
        async move {
            let _ = stop_rx.await;
        },
    ));
    let bar = load::progress("ingest: palisade ingester", load::Window::Requests(total));
    let applied = |store: &Store| -> u64 {
        last.keys()
            .filter_map(|p| u32::try_from(*p).ok())
            .filter_map(|p| {
                store
                    .source_offset(&palisade_log::Source::new(topic, p))
                    .ok()
                    .flatten()
            })
            .map(|o| o + 1)
            .sum()
    };
    let mut first: Option<(Instant, u64)> = None;
    let mut out = Consumed::default();
    let mut lag = Vec::new();
    let step = Duration::from_millis(2);
    let mut last_sample = Instant::now() - Duration::from_secs(1);
    let result = loop {
        if task.is_finished() {
            break Err(anyhow::anyhow!("the ingester stopped early"));
        }
        let n = applied(store);
        let now = Instant::now();
        if n > 0 && first.is_none() {
            first = Some((now, n));
        }
        if let Some((f, _)) = first {
            if now - last_sample >= Duration::from_millis(20) || n >= total {
                #[allow(clippy::cast_precision_loss)]
                {
                    out.series.push(((now - f).as_secs_f64(), n as f64));
                    lag.push(((now - f).as_secs_f64(), (total - n.min(total)) as f64));
                }
                last_sample = now;
            }
        }
        bar.set_position(n);
        if n >= total {
            out.records = n;
            if let Some((f, _)) = first {
                out.elapsed = now - f;
                out.to_first = f - started;
            }
            break Ok(());
        }
        if started.elapsed() > timeout {
            break Err(anyhow::anyhow!(
                "ingest: {n} of {total} records applied after {timeout:?}"
            ));
        }
        tokio::time::sleep(step).await;
    };
    bar.finish_and_clear();
    let _ = stop_tx.send(());
    match tokio::time::timeout(Duration::from_secs(30), task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => {
            return Err(anyhow::Error::from(e).context("the ingester failed"));
        }
        Ok(Err(e)) => bail!("the ingester task failed: {e}"),
        Err(_) => bail!("the ingester did not stop within 30 s"),
    }
    result?;
    // Records applied in the first observed flush are not part of the timed span.
    if let Some((_, n0)) = first {
        out.records = total - n0 + 1;
    }
    Ok((out, lag))
}

/// Outcomes the ingester counted, by `outcome` label.
pub fn outcomes(store: &Store) -> BTreeMap<String, f64> {
    let m = StoreMetrics::parse(&store.metrics().render());
    [
        "applied",
        "already_applied",
        "dropped_stale",
        "dead_lettered",
    ]
    .iter()
    .map(|o| {
        (
            (*o).to_owned(),
            m.sum("palisade_kafka_records_total", &format!("outcome=\"{o}\"")),
        )
    })
    .collect()
}
