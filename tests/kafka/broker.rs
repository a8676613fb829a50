//! Which Kafka broker the suite talks to (see README.md):
//!
//! 1. `PALISADE_KAFKA_BOOTSTRAP` set: that broker, started by
//!    `scripts/kafka-broker start mock|tansu` (its `env` command also exports
//!    `PALISADE_BROKER=mock|tansu`, which turns on tansu's workarounds).
//!    Topics are created with `scripts/kafka-broker topic NAME PARTITIONS`.
//! 2. Else, `CI` set: panic. CI must run the suite against a real broker, and
//!    a suite that silently skips proves nothing.
//! 3. Else (a developer's plain `cargo test`): librdkafka's mock cluster in
//!    this test process, on a thread of its own (it is not `Send`), alive
//!    until the test binary exits. No setup needed.
//!
//! Every test uses its own topic and consumer group ([`unique`]), so the
//! tests share one broker and run in parallel.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::BaseConsumer;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;

/// Partitions of every test topic, and of every test store.
pub const PARTITIONS: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `rdkafka::mocking::MockCluster` inside this test process.
    InProcessMock,
    /// `palisade dev-kafka` (librdkafka's mock cluster) via scripts/kafka-broker.
    Mock,
    /// tansu 0.6.0 via scripts/kafka-broker.
    Tansu,
}

type TopicRequest = (String, i32, mpsc::Sender<Result<(), String>>);

#[derive(Debug)]
pub struct Broker {
    pub bootstrap: String,
    pub kind: Kind,
    /// Topic requests to the in-process mock cluster's thread.
    mock: Option<Mutex<mpsc::Sender<TopicRequest>>>,
}

/// The broker of this test binary, chosen once.
pub fn broker() -> &'static Broker {
    static BROKER: OnceLock<Broker> = OnceLock::new();
    BROKER.get_or_init(select)
}

fn env_set(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

fn select() -> Broker {
    if let Some(bootstrap) = env_set("PALISADE_KAFKA_BOOTSTRAP") {
        let kind = match env_set("PALISADE_BROKER").as_deref() {
            Some("tansu") => Kind::Tansu,
            Some("mock") | None => Kind::Mock,
            Some(other) => panic!(
                "PALISADE_BROKER={other:?}: expected mock or tansu (eval \"$(scripts/kafka-broker env)\" sets it)"
            ),
        };
        eprintln!(
            "kafka tests: using the {kind:?} broker at {bootstrap} (PALISADE_KAFKA_BOOTSTRAP)"
        );
        return Broker {
            bootstrap,
            kind,
            mock: None,
        };
    }
    if env_set("CI").is_some() {
        panic!(
            "PALISADE_KAFKA_BOOTSTRAP is not set; .ci/run starts a broker with scripts/kafka-broker \
             (eval \"$(scripts/kafka-broker start mock >/dev/null; scripts/kafka-broker env)\"). \
             The Kafka suite never skips in CI."
        );
    }
    start_in_process()
}

fn start_in_process() -> Broker {
    let (boot_tx, boot_rx) = mpsc::channel::<Result<String, String>>();
    let (req_tx, req_rx) = mpsc::channel::<TopicRequest>();
    std::thread::Builder::new()
        .name("kafka-mock-cluster".into())
        .spawn(move || {
            // Lives on this thread until the test binary exits: the sender
            // half of `req_rx` sits in a static and is never dropped.
            let cluster = match MockCluster::new(1) {
                Ok(c) => c,
                Err(e) => {
                    let _ = boot_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = boot_tx.send(Ok(cluster.bootstrap_servers()));
            while let Ok((name, partitions, reply)) = req_rx.recv() {
                let r = cluster
                    .create_topic(&name, partitions, 1)
                    .map_err(|e| e.to_string());
                let _ = reply.send(r);
            }
        })
        .expect("spawn the mock cluster thread");
    let bootstrap = boot_rx
        .recv()
        .expect("the mock cluster thread died")
        .unwrap_or_else(|e| panic!("cannot start rdkafka's MockCluster: {e}"));
    eprintln!(
        "kafka tests: PALISADE_KAFKA_BOOTSTRAP is not set, so they run against an in-process \
         librdkafka mock cluster at {bootstrap} (CI runs them against scripts/kafka-broker's mock and tansu)"
    );
    Broker {
        bootstrap,
        kind: Kind::InProcessMock,
        mock: Some(Mutex::new(req_tx)),
    }
}

impl Broker {
    pub fn is_tansu(&self) -> bool {
        self.kind == Kind::Tansu
    }

    /// Create `name` with `partitions` partitions (returns once it exists).
    pub fn create_topic(&self, name: &str, partitions: u32) {
        let parts = i32::try_from(partitions).unwrap();
        if let Some(tx) = &self.mock {
            let (reply_tx, reply_rx) = mpsc::channel();
            tx.lock()
                .unwrap()
                .send((name.to_owned(), parts, reply_tx))
                .expect("the mock cluster thread is gone");
            reply_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("the mock cluster did not answer create_topic")
                .unwrap_or_else(|e| panic!("create_topic {name}: {e}"));
            return;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kafka-broker");
        let out = Command::new(script)
            .args(["topic", name, &partitions.to_string()])
            // Probe with the binary under test; never run cargo from a test.
            .env("PALISADE_BIN", env!("CARGO_BIN_EXE_palisade"))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
        assert!(
            out.status.success(),
            "{script} topic {name} {partitions} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Settings every producer of the suite uses: tansu 0.6.0 loses records
    /// when a fetch starts inside a batch (docs/kafka-brokers.md), so against
    /// it every record is its own batch.
    pub fn producer_settings(&self) -> Vec<(String, String)> {
        let mut s = vec![("linger.ms".to_owned(), "1".to_owned())];
        if self.is_tansu() {
            s.push(("batch.num.messages".to_owned(), "1".to_owned()));
        }
        s
    }

    /// A raw producer, for records the Publisher would never make. Its
    /// partitioner is Kafka's murmur2; tests that need a record in a given
    /// partition set it explicitly.
    pub fn raw_producer(&self) -> FutureProducer {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.bootstrap)
            .set("partitioner", "murmur2_random")
            .set("acks", "all")
            .set("enable.idempotence", "true");
        for (k, v) in self.producer_settings() {
            cc.set(k, v);
        }
        cc.create().expect("create a producer")
    }

    /// A consumer of `group` with the short session timeout every group
    /// member of the suite uses (mock rebalances take seconds, not 45 s).
    pub fn consumer(&self, group: &str, extra: &[(&str, &str)]) -> BaseConsumer {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.bootstrap)
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("enable.partition.eof", "false");
        for (k, v) in extra {
            cc.set(*k, *v);
        }
        cc.create().expect("create a consumer")
    }

    /// `palisade serve` arguments that make it consume `topic` as `group`
    /// into a store of [`PARTITIONS`] partitions.
    pub fn serve_args(&self, topic: &str, group: &str) -> Vec<String> {
        [
            "--partitions",
            &PARTITIONS.to_string(),
            "--kafka-brokers",
            &self.bootstrap,
            "--kafka-topic",
            topic,
            "--kafka-group",
            group,
            "--kafka-setting",
            "session.timeout.ms=6000",
            "--kafka-setting",
            "heartbeat.interval.ms=500",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    }
}

/// A name no other test (of this run, or of an earlier run against the same
/// long-lived broker) uses: `PREFIX-<pid>-<start time>-<counter>`.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static STAMP: OnceLock<u128> = OnceLock::new();
    let stamp = STAMP.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() % 100_000_000)
            .unwrap_or(0)
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{stamp}-{n}", std::process::id())
}

/// A fresh topic (created with [`PARTITIONS`] partitions, unless asked
/// otherwise) and consumer group.
#[derive(Debug, Clone)]
pub struct TestTopic {
    pub topic: String,
    pub group: String,
}

impl TestTopic {
    pub fn new(prefix: &str) -> Self {
        Self::with_partitions(prefix, PARTITIONS)
    }

    /// A topic of `partitions` partitions (the store keeps [`PARTITIONS`]).
    pub fn with_partitions(prefix: &str, partitions: u32) -> Self {
        let topic = unique(prefix);
        broker().create_topic(&topic, partitions);
        Self {
            group: format!("{topic}-group"),
            topic,
        }
    }

    pub fn serve_args(&self) -> Vec<String> {
        broker().serve_args(&self.topic, &self.group)
    }
}
