use clap::Parser;
use palisade::config::{Cli, Command};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(cfg) => palisade::serve::serve(cfg).await,
        Command::DevKafka(cfg) => palisade::dev_kafka::run(cfg).await,
        Command::Publish(cfg) => palisade::publish::publish(cfg).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("palisade: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
