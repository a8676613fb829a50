use clap::{CommandFactory, FromArgMatches};
use palisade::config::{Cli, Command};
use tracing_subscriber::EnvFilter;

/// mimalloc instead of glibc's malloc: allocation was a fifth of the
/// server's CPU on the single-event append path (docs/decisions/0017-allocator.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        Command::Serve(args) => palisade::cli::serve(args, &matches).await,
        Command::Client(cmd) => return palisade::cli::run(cmd, &matches).await,
        Command::DevKafka(cfg) => palisade::dev_kafka::run(cfg).await,
        Command::Publish(cfg) => palisade::publish::publish(cfg).await,
        Command::Bench(cfg) => palisade::bench::run(cfg).await,
        Command::Auth(cmd) => palisade::security::auth_command(cmd),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("palisade: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
