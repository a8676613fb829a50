//! The `palisade` binary: parses the command line and hands each command to
//! the crate that owns it (`docs/architecture.md`): `serve` to
//! `palisade-server`, the client commands to `palisade-cli`, `dev-kafka` to
//! `palisade-devtools`, `bench` to `palisade-bench`, `proxy` to `palisade-proxy`.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use palisade_bench::BenchConfig;
use palisade_cli::auth::AuthCommand;
use palisade_cli::publish::PublishConfig;
use palisade_devtools::DevKafkaConfig;
use palisade_server::ServeArgs;
use tracing_subscriber::EnvFilter;

/// mimalloc instead of glibc's malloc: allocation was a fifth of the
/// server's CPU on the single-event append path (docs/decisions/0017-allocator.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "palisade",
    version,
    about = "A digital-twin event store where stale writers never win",
    after_help = palisade_cli::EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// `serve`'s settings make it the largest variant; the command line is
// parsed once at start-up, so boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the store: sled in a local folder, the lease authority in-process.
    Serve(ServeArgs),
    // lease, append, get, events, tail, partitions, config (palisade-cli).
    #[command(flatten)]
    Client(palisade_cli::CliCommand),
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
    Auth(AuthCommand),
    /// Load benchmark: Palisade over HTTP beside its baselines, measured in
    /// the same run (see docs/benchmarks.md).
    ///
    /// Prints one `BENCH <scenario> key=value ...` line per scenario on stdout,
    /// writes a JSON result file and SVG plots; exits non-zero if a request
    /// failed unexpectedly or the churn scenario found a stale write in the log.
    Bench(BenchConfig),
    /// A fencing reverse proxy in front of an HTTP API that cannot check
    /// tokens: each request is admitted by the store's fence (a durable,
    /// fenced append to its twin) before it is forwarded (docs/proxy.md).
    ///
    /// Prints `palisade proxy listening on URL` as its last line once ready
    /// (after `palisade store listening on URL` with --store-listen), then
    /// runs until SIGTERM or Ctrl-C.
    Proxy(palisade_proxy::ProxyArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    // Parsed in two steps: `serve --config` asks the matches where each value came from.
    let matches = Cli::command().get_matches();
    let cli =
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut Cli::command()).exit());
    let result = match cli.command {
        Command::Serve(args) => palisade_server::config::file::serve(args, &matches).await,
        Command::Client(cmd) => return palisade_cli::run(cmd, &matches).await,
        Command::DevKafka(cfg) => {
            palisade_devtools::dev_kafka::run(cfg, palisade_server::shutdown_signal()).await
        }
        Command::Publish(cfg) => palisade_cli::publish::publish(cfg).await,
        Command::Bench(cfg) => palisade_bench::run(cfg).await,
        Command::Auth(cmd) => palisade_cli::auth::auth_command(cmd),
        Command::Proxy(args) => palisade_proxy::run(args, palisade_server::shutdown_signal()).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("palisade: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
