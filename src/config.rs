//! Command-line and environment configuration (one clap `Config`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

pub mod bounds;

#[derive(Debug, Parser)]
#[command(
    name = "palisade",
    version,
    about = "A digital-twin event store where stale writers never win",
    after_help = crate::cli::EXIT_CODES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// `serve`'s settings make it the largest variant; the command line is
// parsed once at start-up, so boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the store: sled in a local folder, the lease authority in-process.
    Serve(ServeArgs),
    // lease, append, get, events, tail, partitions, config (src/cli.rs).
    #[command(flatten)]
    Client(crate::cli::CliCommand),
    /// Run a mock Kafka cluster (librdkafka's) on loopback, for trying things
    /// out and for tests only: NOT for production.
    ///
    /// Runs librdkafka's in-process mock cluster on 127.0.0.1 and serves it to
    /// other processes. Not a production broker: all data is in memory and lost
    /// on exit, there is no security, and it is librdkafka's test broker.
    ///
    /// Prints `bootstrap: 127.0.0.1:PORT[,...]` as its last stdout line, then runs
    /// until SIGTERM or Ctrl-C. With --probe it starts no cluster and instead asks
    /// a running broker for its metadata (used by scripts/kafka-broker).
    DevKafka(DevKafkaConfig),
    /// Publish one twin event to Kafka under a fencing token (for scripts).
    Publish(PublishConfig),
    /// API keys for the security file: `palisade auth mint-key`.
    #[command(subcommand)]
    Auth(crate::security::AuthCommand),
    /// Load benchmark: Palisade over HTTP beside its baselines, measured in
    /// the same run (see docs/benchmarks.md).
    ///
    /// Prints one `BENCH <scenario> key=value ...` line per scenario on stdout,
    /// writes a JSON result file and SVG plots; exits non-zero if a request
    /// failed unexpectedly or the churn scenario found a stale write in the log.
    Bench(BenchConfig),
}

/// What `palisade bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchScenario {
    /// Fenced appends over HTTP (single events and batches) vs raw sled, a
    /// do-nothing HTTP handler and the PostgreSQL fencing recipe.
    Append,
    /// GET twin state under concurrent appends vs a do-nothing handler.
    Read,
    /// Kafka records consumed, fenced, appended and committed vs raw consume.
    Ingest,
    /// Leases change hands under load; the log is checked for stale writes.
    Churn,
    /// The append load across partitions and twins, and recovery time vs log size.
    Scaling,
    /// All of the above, in that order.
    All,
}

/// `palisade bench` settings; every flag is also a `PALISADE_BENCH_*` variable.
#[derive(Debug, Clone, Args)]
pub struct BenchConfig {
    #[arg(value_enum)]
    pub scenario: BenchScenario,
    /// A running store to load (e.g. http://127.0.0.1:7070). Default: an
    /// in-process store in a temporary folder, served over HTTP on 127.0.0.1:0.
    /// `ingest` and `scaling` need the in-process store.
    #[arg(long, env = "PALISADE_BENCH_URL")]
    pub url: Option<String>,
    /// Concurrent writers (request loops). Partition p's lease is held by
    /// writer p mod W; with more writers than partitions, writers share a
    /// partition's lease as tasks of one holder.
    #[arg(long, env = "PALISADE_BENCH_WRITERS", default_value_t = 16)]
    pub writers: usize,
    /// Partitions of the in-process store (a --url store has its own count).
    #[arg(long, env = "PALISADE_BENCH_PARTITIONS", default_value_t = 16)]
    pub partitions: u32,
    /// Twins the load is spread over (uniformly at random).
    #[arg(long, env = "PALISADE_BENCH_TWINS", default_value_t = 1000)]
    pub twins: u64,
    /// Size of each event's patch, in bytes of compact JSON.
    #[arg(long, env = "PALISADE_BENCH_EVENT_BYTES", default_value_t = 100)]
    pub event_bytes: usize,
    /// Events per append request (1 = single events). `append` also runs a
    /// single-event case when this is above 1.
    #[arg(long, env = "PALISADE_BENCH_BATCH", default_value_t = 100)]
    pub batch: usize,
    /// Measured seconds per case, after a warm-up (default 5; 0.6 with --quick).
    #[arg(long, env = "PALISADE_BENCH_DURATION_SECS")]
    pub duration_secs: Option<f64>,
    /// Measure a fixed number of requests per case instead of a duration.
    #[arg(
        long,
        env = "PALISADE_BENCH_REQUESTS",
        conflicts_with = "duration_secs"
    )]
    pub requests: Option<u64>,
    /// Run each scenario this many times; the report gives medians.
    #[arg(long, env = "PALISADE_BENCH_REPEAT", default_value_t = 1)]
    pub repeat: usize,
    /// The JSON result file (default bench-results/<scenario>-<timestamp>.json).
    #[arg(long, env = "PALISADE_BENCH_OUT")]
    pub out: Option<PathBuf>,
    /// Folder for the SVG plots (default: next to --out, `<out stem>-plots/`).
    #[arg(long, env = "PALISADE_BENCH_PLOT_DIR")]
    pub plot_dir: Option<PathBuf>,
    /// Short cases and small sizes, about 35 s for `all` (the CI smoke run).
    #[arg(long, env = "PALISADE_BENCH_QUICK")]
    pub quick: bool,
    /// Kafka bootstrap servers for `ingest`. Default: librdkafka's mock
    /// cluster, started in-process (as `palisade dev-kafka`).
    #[arg(long, env = "PALISADE_BENCH_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// Records pre-loaded into the topic for `ingest` (default 200000; 20000 with --quick).
    #[arg(long, env = "PALISADE_BENCH_INGEST_RECORDS")]
    pub ingest_records: Option<u64>,
    /// The PostgreSQL baseline: a connection URL, `auto` (start a throwaway
    /// server from Debian's packages if initdb/pg_ctl are installed, else skip
    /// with a notice) or `off`.
    #[arg(long, env = "PALISADE_BENCH_POSTGRES", default_value = "auto")]
    pub postgres: String,
    /// `append`: also run the single-event case at these connection counts
    /// (comma-separated), each beside raw sled and PostgreSQL at the same
    /// count. Empty: none.
    #[arg(
        long,
        env = "PALISADE_BENCH_SINGLE_CONNECTIONS",
        value_delimiter = ',',
        default_value = "32,64"
    )]
    pub single_connections: Vec<usize>,
    /// `scaling`: also run with 1,000,000 twins (slow; off by default).
    #[arg(long, env = "PALISADE_BENCH_MILLION_TWINS")]
    pub million_twins: bool,
    /// Folder for temporary stores and databases (default: the system's temp folder).
    #[arg(long, env = "PALISADE_BENCH_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

/// `palisade publish`: one event to the twin-events topic, with the same
/// headers and partitioning a worker's publisher uses.
#[derive(Debug, Clone, Args)]
pub struct PublishConfig {
    /// Kafka bootstrap servers.
    #[arg(long, env = "PALISADE_KAFKA_BROKERS")]
    pub brokers: String,
    #[arg(long, env = "PALISADE_KAFKA_TOPIC", default_value = "twin-events")]
    pub topic: String,
    /// Partition count of the topic (= the store's): the record goes to
    /// `murmur2(twin) mod N`, as Palisade computes it.
    #[arg(long, env = "PALISADE_PARTITIONS", default_value_t = 16)]
    pub partitions: u32,
    /// The twin id (the record key).
    #[arg(long)]
    pub twin: String,
    /// Your lease's fencing token.
    #[arg(long, env = "PALISADE_FENCING_TOKEN")]
    pub token: u64,
    /// Event type.
    #[arg(long = "type", default_value = "update")]
    pub event_type: String,
    /// The JSON merge patch (an object).
    #[arg(long)]
    pub patch: String,
    /// Idempotency key (default: random).
    #[arg(long)]
    pub event_id: Option<String>,
    /// Sign the record as this principal (a store with authentication on
    /// applies only signed records; see docs/security.md). Needs --api-key.
    #[arg(long, env = "PALISADE_PRINCIPAL", requires = "api_key")]
    pub principal: Option<String>,
    /// The principal's API key (signs the record; never sent).
    #[arg(
        long,
        env = "PALISADE_API_KEY",
        hide_env_values = true,
        requires = "principal"
    )]
    pub api_key: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `palisade serve`: its settings, optionally from a TOML file as well.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Read settings from this TOML file (keys as the long flags, with
    /// underscores; see palisade.example.toml). Per setting: flag >
    /// environment variable > file > default. Check one with `palisade config check`.
    #[arg(long, env = "PALISADE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: ServeConfig,
}

/// `palisade serve` settings; every flag is also an environment variable.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Folder of the store (created if missing).
    #[arg(long, env = "PALISADE_DATA", default_value = "palisade-data")]
    pub data: PathBuf,
    /// Address to listen on. Port 0 picks a free port; the chosen address is printed.
    #[arg(long, env = "PALISADE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Partition count of a new store (default 16). Reopening an existing store
    /// with a different count is refused.
    #[arg(long, env = "PALISADE_PARTITIONS", value_parser = bounds::parser::<u32>(bounds::PARTITIONS))]
    pub partitions: Option<u32>,
    /// How far ahead of the store's clock a writer's HLC may be, in
    /// milliseconds (0..=3600000).
    #[arg(long, env = "PALISADE_MAX_DRIFT_MS", default_value_t = 500, value_parser = bounds::parser::<u64>(bounds::MAX_DRIFT_MS))]
    pub max_drift_ms: u64,
    /// Largest request body, in bytes (1 KiB..=64 MiB).
    #[arg(long, env = "PALISADE_MAX_BODY_BYTES", default_value_t = 1 << 20, value_parser = bounds::parser::<usize>(bounds::MAX_BODY_BYTES))]
    pub max_body_bytes: usize,
    /// Most events in one append request (1..=100000).
    #[arg(long, env = "PALISADE_MAX_BATCH_EVENTS", default_value_t = 1000, value_parser = bounds::parser::<usize>(bounds::MAX_BATCH_EVENTS))]
    pub max_batch_events: usize,
    /// Snapshot a twin's state every this many of its events (bounds
    /// time-travel reads; 1..=1000000).
    #[arg(long, env = "PALISADE_SNAPSHOT_EVERY", default_value_t = 64, value_parser = bounds::parser::<u64>(bounds::SNAPSHOT_EVERY))]
    pub snapshot_every: u64,
    /// sled page cache, in MiB (1..=1048576).
    #[arg(long, env = "PALISADE_CACHE_MB", default_value_t = 256, value_parser = bounds::parser::<u64>(bounds::CACHE_MB))]
    pub cache_mb: u64,
    /// Most client connections open at once; past it a new connection is
    /// answered `503 too_many_connections` and closed. Lowered at start to
    /// fit the open-file limit (see docs/operations.md).
    #[arg(long, env = "PALISADE_MAX_CONNECTIONS", default_value_t = 1024, value_parser = bounds::parser::<usize>(bounds::MAX_CONNECTIONS))]
    pub max_connections: usize,
    /// Most client connections open at once from one IP address (503
    /// `too_many_connections_from_address` past it).
    #[arg(long, env = "PALISADE_MAX_CONNECTIONS_PER_IP", default_value_t = 256, value_parser = bounds::parser::<usize>(bounds::MAX_CONNECTIONS))]
    pub max_connections_per_ip: usize,
    /// Time a client has to send a request's headers (and to finish a TLS
    /// handshake), in milliseconds; the connection is closed past it.
    #[arg(long, env = "PALISADE_HEADER_TIMEOUT_MS", default_value_t = 10_000, value_parser = bounds::parser::<u64>(bounds::TIMEOUT_MS))]
    pub header_timeout_ms: u64,
    /// Time a client has to send a request's body after its headers, in
    /// milliseconds (`408 body_timeout` past it).
    #[arg(long, env = "PALISADE_BODY_TIMEOUT_MS", default_value_t = 30_000, value_parser = bounds::parser::<u64>(bounds::TIMEOUT_MS))]
    pub body_timeout_ms: u64,
    /// How long a keep-alive connection may sit idle between requests, and a
    /// response wait for a client that stopped reading, in milliseconds.
    /// Change streams (SSE) are not idle: they last while their client reads.
    #[arg(long, env = "PALISADE_IDLE_TIMEOUT_MS", default_value_t = 60_000, value_parser = bounds::parser::<u64>(bounds::TIMEOUT_MS))]
    pub idle_timeout_ms: u64,
    /// Security file (TOML): principals and their API key hashes, roles,
    /// limits (see docs/security.md). Without principals in it,
    /// authentication is off and the store serves loopback only.
    #[arg(long, env = "PALISADE_SECURITY", value_name = "FILE")]
    pub security: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, env = "PALISADE_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "PALISADE_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Listen on a non-loopback address without authentication or without
    /// TLS anyway (a loud warning is printed). Never needed on loopback.
    #[arg(long, env = "PALISADE_INSECURE")]
    pub insecure: bool,
    /// Kafka bootstrap servers. When set, the store joins the consumer group
    /// and ingests the topic: each record is applied to its twin's
    /// partition, whichever partition of the topic it is in (any producer
    /// partitioner, any partition count; see --kafka-strict-partitioning).
    #[arg(long, env = "PALISADE_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// Topic of twin events.
    #[arg(long, env = "PALISADE_KAFKA_TOPIC", default_value = "twin-events")]
    pub kafka_topic: String,
    /// Consumer group id.
    #[arg(long, env = "PALISADE_KAFKA_GROUP", default_value = "palisade")]
    pub kafka_group: String,
    /// Also copy dead-lettered records to this topic (they are always kept in the store).
    #[arg(long, env = "PALISADE_KAFKA_DEAD_LETTER_TOPIC")]
    pub kafka_dead_letter_topic: Option<String>,
    /// Largest Kafka record value accepted; larger records are dead-lettered
    /// (1 KiB..=64 MiB).
    #[arg(long, env = "PALISADE_KAFKA_MAX_RECORD_BYTES", default_value_t = 1 << 20, value_parser = bounds::parser::<usize>(bounds::KAFKA_MAX_RECORD_BYTES))]
    pub kafka_max_record_bytes: usize,
    /// Strict partitioning: the topic must have as many partitions as the
    /// store and a record outside its twin's murmur2 partition (Kafka's
    /// Java partitioner) is dead-lettered as `wrong_partition` instead of
    /// being routed by key. For fleets that must prove every producer uses
    /// murmur2. The variable takes true/false (also yes/no, on/off, 1/0).
    #[arg(long, env = "PALISADE_KAFKA_STRICT_PARTITIONING", value_parser = clap::builder::BoolishValueParser::new())]
    pub kafka_strict_partitioning: bool,
    /// Extra librdkafka client setting KEY=VALUE (TLS, SASL, timeouts); repeatable,
    /// comma separated in the environment variable.
    #[arg(long = "kafka-setting", env = "PALISADE_KAFKA_SETTINGS", value_delimiter = ',', value_parser = parse_setting)]
    pub kafka_settings: Vec<(String, String)>,
    /// Where leases and fencing tokens come from: `embedded` (in the store,
    /// one node) or `etcd` (etcd leases; token = the lock key's create
    /// revision; see docs/decisions/0011-etcd-lease-authority.md). A store
    /// keeps the backend its first token came from.
    #[arg(long, env = "PALISADE_LEASE_BACKEND", value_enum, default_value_t = LeaseBackend::Embedded)]
    pub lease_backend: LeaseBackend,
    /// etcd members, `http://host:port`; repeatable (env: comma separated).
    #[arg(long, env = "PALISADE_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Prefix of every etcd key Palisade writes (clusters can share one etcd).
    #[arg(long, env = "PALISADE_ETCD_PREFIX", default_value = "/palisade/")]
    pub etcd_prefix: String,
    /// Cluster mode: this node's id in the consumer group (see
    /// docs/decisions/0012-cluster-mode.md). Needs --lease-backend etcd and
    /// --kafka-brokers.
    #[arg(long, env = "PALISADE_CLUSTER_NODE")]
    pub cluster_node: Option<String>,
    /// Cluster mode: the URL other nodes and clients reach this node at
    /// (default: http:// + the listen address).
    #[arg(long, env = "PALISADE_CLUSTER_ADVERTISE")]
    pub cluster_advertise: Option<String>,
}

/// Where leases and fencing tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseBackend {
    /// The store's own durable counter (one node).
    Embedded,
    /// etcd leases; the token is the lock key's create revision.
    Etcd,
}

impl LeaseBackend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::Etcd => "etcd",
        }
    }
}

fn parse_setting(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if k.trim().is_empty() {
        return Err(format!("empty key in {s:?}"));
    }
    Ok((k.trim().to_owned(), v.to_owned()))
}

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

impl ServeConfig {
    /// Every setting's range ([`bounds`]: a config file's values skip
    /// clap's parsers) and the rules that span fields. Runs before anything
    /// touches the disk.
    pub fn validate(&self) -> Result<(), String> {
        bounds::check(self)?;
        if self.lease_backend == LeaseBackend::Etcd && self.etcd_endpoints.is_empty() {
            return Err("--lease-backend etcd needs --etcd-endpoints".into());
        }
        if self.cluster_node.is_some()
            && (self.lease_backend != LeaseBackend::Etcd || self.kafka_brokers.is_none())
        {
            return Err(
                "--cluster-node (cluster mode) needs --lease-backend etcd and --kafka-brokers"
                    .into(),
            );
        }
        if self.cluster_node.as_deref().is_some_and(|n| {
            n.is_empty()
                || n.len() > 128
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        }) {
            return Err("--cluster-node must be 1 to 128 of A-Z a-z 0-9 - _ .".into());
        }
        Ok(())
    }

    pub fn store_config(&self) -> palisade_log::StoreConfig {
        palisade_log::StoreConfig {
            partitions: self.partitions,
            max_drift: std::time::Duration::from_millis(self.max_drift_ms),
            snapshot_every: self.snapshot_every,
            cache_bytes: self.cache_mb << 20,
            ..palisade_log::StoreConfig::default()
        }
    }

    /// The Kafka ingester's settings, if `--kafka-brokers` is set.
    pub fn ingest_config(&self) -> Option<palisade_kafka::IngestConfig> {
        let brokers = self.kafka_brokers.as_ref()?;
        let mut c = palisade_kafka::IngestConfig::new(brokers.clone());
        c.topic.clone_from(&self.kafka_topic);
        c.group.clone_from(&self.kafka_group);
        c.dead_letter_topic
            .clone_from(&self.kafka_dead_letter_topic);
        c.max_value_bytes = self.kafka_max_record_bytes;
        c.strict_partitioning = self.kafka_strict_partitioning;
        c.client_settings.clone_from(&self.kafka_settings);
        Some(c)
    }

    pub fn http_config(&self) -> palisade_http::HttpConfig {
        palisade_http::HttpConfig {
            max_body_bytes: self.max_body_bytes,
            max_batch_events: self.max_batch_events,
            connections: palisade_http::ConnectionLimits {
                max_connections: self.max_connections,
                max_connections_per_ip: self.max_connections_per_ip,
                header_timeout: std::time::Duration::from_millis(self.header_timeout_ms),
                body_timeout: std::time::Duration::from_millis(self.body_timeout_ms),
                idle_timeout: std::time::Duration::from_millis(self.idle_timeout_ms),
            },
            ..palisade_http::HttpConfig::default()
        }
    }
}
