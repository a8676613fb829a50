//! `palisade bench`'s settings: every flag is also a `PALISADE_BENCH_*`
//! variable.

use std::path::PathBuf;

use clap::Args;

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
