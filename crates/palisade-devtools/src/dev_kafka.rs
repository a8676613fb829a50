//! `palisade dev-kafka`: librdkafka's mock Kafka cluster, run in this process
//! and served on loopback to other processes, for trying things out and for
//! tests. It is NOT a production broker: everything lives in memory, there is
//! no security, and its behaviour is whatever librdkafka's test broker does.
//!
//! Contract with scripts (`scripts/kafka-broker`, CI, tests):
//! - the last line printed on stdout before it blocks is
//!   `bootstrap: 127.0.0.1:PORT[,127.0.0.1:PORT...]`;
//! - it runs until SIGTERM or Ctrl-C;
//! - topics come from `--topic NAME:PARTITIONS` at start, or from lines
//!   `NAME:PARTITIONS` appended to `--control-file` while it runs (the mock
//!   cluster's own CreateTopics admin call hangs, so it is not used);
//! - `--probe BOOTSTRAP` starts no cluster: it fetches metadata from any Kafka
//!   broker, prints `broker ID HOST:PORT` and `topic NAME partitions N` lines
//!   and exits 0 if the broker answered.
//!
//! `rdkafka::mocking::MockCluster` is not `Send`: it lives in this future,
//! which `main` drives with `block_on` on the main thread, and is never moved.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use tracing::{info, warn};

/// `palisade dev-kafka` settings: librdkafka's mock cluster, served on
/// loopback to other processes. For trying things out and tests only, never
/// for production (no persistence, no security, librdkafka's test broker).
#[derive(Debug, Clone, Args)]
pub struct DevKafkaConfig {
    /// Number of mock brokers (1..=16).
    #[arg(long, env = "PALISADE_DEV_KAFKA_BROKERS", default_value_t = 1)]
    pub brokers: u32,
    /// Pre-create a topic, as NAME:PARTITIONS (repeatable; env: comma separated).
    /// Topics auto-created on first use get 4 partitions.
    #[arg(
        long = "topic",
        value_name = "NAME:PARTITIONS",
        env = "PALISADE_DEV_KAFKA_TOPICS",
        value_delimiter = ','
    )]
    pub topics: Vec<String>,
    /// A file polled while running: each new line `NAME:PARTITIONS` creates a
    /// topic (how `scripts/kafka-broker topic` adds topics to a running cluster).
    #[arg(long, value_name = "FILE", env = "PALISADE_DEV_KAFKA_CONTROL")]
    pub control_file: Option<PathBuf>,
    /// Start no cluster: fetch metadata from the broker(s) at this bootstrap
    /// address, print brokers and topics, exit 0 if it answered (for scripts).
    #[arg(long, value_name = "BOOTSTRAP")]
    pub probe: Option<String>,
    /// How long --probe waits for an answer, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub probe_timeout_ms: u64,
}

/// Most brokers `--brokers` accepts (the mock cluster is one thread; more is pointless).
const MAX_BROKERS: u32 = 16;
/// Most partitions a topic may be created with.
const MAX_PARTITIONS: i32 = 10_000;
/// How often the control file is re-read.
const CONTROL_POLL: Duration = Duration::from_millis(200);

type Cluster = MockCluster<'static, DefaultProducerContext>;

/// A topic to create: `NAME:PARTITIONS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: i32,
}

impl std::str::FromStr for TopicSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (name, parts) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("topic `{s}`: expected NAME:PARTITIONS"))?;
        if name.is_empty()
            || name.len() > 249
            || name == "."
            || name == ".."
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(format!(
                "topic `{s}`: name must be 1..=249 of [a-zA-Z0-9._-] (not `.` or `..`)"
            ));
        }
        let partitions: i32 = parts
            .trim()
            .parse()
            .map_err(|_| format!("topic `{s}`: PARTITIONS must be a number"))?;
        if !(1..=MAX_PARTITIONS).contains(&partitions) {
            return Err(format!(
                "topic `{s}`: PARTITIONS must be 1..={MAX_PARTITIONS}"
            ));
        }
        Ok(TopicSpec {
            name: name.to_owned(),
            partitions,
        })
    }
}

/// Serve the mock cluster until `shutdown` resolves (the binary passes
/// SIGTERM or Ctrl-C), or probe a broker (`--probe`).
pub async fn run(config: DevKafkaConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if let Some(bootstrap) = config.probe.clone() {
        return probe(bootstrap, Duration::from_millis(config.probe_timeout_ms)).await;
    }
    if !(1..=MAX_BROKERS).contains(&config.brokers) {
        bail!(
            "--brokers must be 1..={MAX_BROKERS}, got {}",
            config.brokers
        );
    }
    let topics = config
        .topics
        .iter()
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.parse::<TopicSpec>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;

    let brokers = i32::try_from(config.brokers).context("--brokers")?;
    let cluster = MockCluster::new(brokers).context("cannot start librdkafka's mock cluster")?;
    let bootstrap = cluster.bootstrap_servers();
    ensure_loopback(&bootstrap)?;
    let replication = brokers.min(3);
    for topic in &topics {
        create_topic(&cluster, topic, replication)
            .with_context(|| format!("cannot create topic {}", topic.name))?;
    }
    let mut control = config.control_file.clone().map(ControlFile::new);
    if let Some(c) = control.as_mut() {
        c.poll(&cluster, replication);
    }
    info!(
        %bootstrap,
        brokers,
        topics = topics.len(),
        "dev-kafka (librdkafka mock cluster, NOT for production) is ready"
    );
    // Scripts read this line; it must stay the last thing printed on stdout.
    let mut out = std::io::stdout().lock();
    writeln!(out, "bootstrap: {bootstrap}")?;
    out.flush()?;
    drop(out);

    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(CONTROL_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = tick.tick(), if control.is_some() => {
                if let Some(c) = control.as_mut() {
                    c.poll(&cluster, replication);
                }
            }
        }
    }
    info!("dev-kafka: shutting down (all data is discarded)");
    drop(cluster);
    Ok(())
}

/// Refuses to serve unless every bootstrap entry is a loopback address.
fn ensure_loopback(bootstrap: &str) -> anyhow::Result<()> {
    for entry in bootstrap.split(',') {
        let addr: SocketAddr = entry
            .trim()
            .parse()
            .with_context(|| format!("unexpected mock bootstrap entry `{entry}`"))?;
        if !addr.ip().is_loopback() {
            bail!("mock cluster listens on {addr}, which is not loopback; refusing to serve");
        }
    }
    Ok(())
}

fn create_topic(cluster: &Cluster, topic: &TopicSpec, replication: i32) -> anyhow::Result<()> {
    cluster.create_topic(&topic.name, topic.partitions, replication)?;
    info!(topic = %topic.name, partitions = topic.partitions, "topic created");
    Ok(())
}

/// A file of `NAME:PARTITIONS` lines; complete lines not yet seen create topics.
#[derive(Debug)]
struct ControlFile {
    path: PathBuf,
    /// Bytes already processed.
    done: usize,
}

impl ControlFile {
    fn new(path: PathBuf) -> Self {
        ControlFile { path, done: 0 }
    }

    fn poll(&mut self, cluster: &Cluster, replication: i32) {
        let text = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "cannot read control file");
                return;
            }
        };
        if text.len() < self.done {
            // Truncated or replaced: start over (existing topics are reported, not recreated).
            self.done = 0;
        }
        let fresh = &text[self.done..];
        let Some(end) = fresh.iter().rposition(|&b| b == b'\n') else {
            return; // no complete line yet
        };
        let complete = String::from_utf8_lossy(&fresh[..=end]).into_owned();
        self.done += end + 1;
        for line in complete.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match line.parse::<TopicSpec>() {
                Err(e) => warn!(line, error = %e, "control file: ignored line"),
                Ok(topic) => match cluster.create_topic(&topic.name, topic.partitions, replication)
                {
                    Ok(()) => info!(
                        topic = %topic.name,
                        partitions = topic.partitions,
                        "topic created (control file)"
                    ),
                    Err(KafkaError::MockCluster(RDKafkaErrorCode::TopicAlreadyExists)) => {
                        info!(topic = %topic.name, "control file: topic already exists")
                    }
                    Err(e) => {
                        warn!(topic = %topic.name, error = %e, "control file: cannot create topic")
                    }
                },
            }
        }
    }
}

/// `--probe`: one metadata request to any Kafka broker; prints what it learned.
async fn probe(bootstrap: String, timeout: Duration) -> anyhow::Result<()> {
    let lines = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("allow.auto.create.topics", "false")
            .create()
            .context("cannot create a Kafka client")?;
        let md = consumer
            .fetch_metadata(None, timeout)
            .with_context(|| format!("no metadata from {bootstrap} within {timeout:?}"))?;
        let mut lines = Vec::new();
        for b in md.brokers() {
            lines.push(format!("broker {} {}:{}", b.id(), b.host(), b.port()));
        }
        for t in md.topics() {
            let mut line = format!("topic {} partitions {}", t.name(), t.partitions().len());
            if let Some(err) = t.error() {
                line.push_str(&format!(" error {:?}", RDKafkaErrorCode::from(err)));
            }
            lines.push(line);
        }
        Ok(lines)
    })
    .await
    .context("probe task failed")??;
    let mut out = std::io::stdout().lock();
    for line in lines {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::TopicSpec;

    #[test]
    fn topic_specs_parse() {
        assert_eq!(
            "twin-events:8".parse::<TopicSpec>(),
            Ok(TopicSpec {
                name: "twin-events".into(),
                partitions: 8
            })
        );
        assert!("twin-events".parse::<TopicSpec>().is_err());
        assert!("a:0".parse::<TopicSpec>().is_err());
        assert!(":3".parse::<TopicSpec>().is_err());
        assert!("bad name:3".parse::<TopicSpec>().is_err());
        assert!("..:3".parse::<TopicSpec>().is_err());
    }

    #[test]
    fn loopback_only() {
        assert!(super::ensure_loopback("127.0.0.1:9092,127.0.0.1:9093").is_ok());
        assert!(super::ensure_loopback("0.0.0.0:9092").is_err());
        assert!(super::ensure_loopback("10.0.0.1:9092").is_err());
    }
}
