//! The client side of the `palisade` binary: `lease`, `append`, `get`,
//! `events`, `tail`, `partitions` (over the HTTP API, built on
//! `palisade-client`), `publish` (one event to Kafka), `config check` (the
//! settings `palisade serve` would run with) and `auth` (API keys for the
//! security file).
//!
//! Every flag is also a `PALISADE_*` environment variable. Output is a short
//! readable line or table by default; `--json` prints one JSON document (one
//! JSON line per event for `events` and `tail`) on stdout, errors included.
//! Exit codes: see [`EXIT_CODES`].
//!
//! Alternatives (`--file` or `--patch`, `--twin` or `--partition`, `--at-seq`
//! or `--at-hlc`) are resolved by [`pick`], not by clap's conflicts: a flag
//! on the command line beats an exported variable of the other alternative,
//! so `PALISADE_TWIN` set for `append` does not break `tail --partition 3`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{ArgGroup, ArgMatches, Args, Subcommand};
use palisade_client::ClientError;
use serde_json::{json, Value};

pub mod auth;
mod backup;
mod commands;
mod config_check;
mod progress;
pub mod publish;
mod tail;
mod transfer;

pub use backup::{BackupArgs, RestoreArgs};
pub use transfer::{ExportArgs, ImportArgs};

/// The exit codes of every `palisade` command (shown by `palisade --help`).
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  refused by the store (its error name and message are printed, e.g. stale_token),
     invalid settings (`config check`, `serve`), or an unexpected failure
  2  usage error: bad flags (clap), or bad input such as a --patch that is not a JSON object
  3  the store could not be reached: connection refused, timeout, connection dropped

Client commands talk to --url (PALISADE_URL, default http://127.0.0.1:7070).";

/// The client subcommands, flattened into the `palisade` binary's commands.
#[derive(Debug, Subcommand)]
pub enum CliCommand {
    /// Take, renew or release a lease (its fencing token guards your writes).
    #[command(subcommand)]
    Lease(LeaseCommand),
    /// Append events to a twin under a fencing token (all or none).
    Append(AppendArgs),
    /// Read a twin's state: now, or as of a sequence number or HLC.
    Get(GetArgs),
    /// List a twin's stored events, oldest first (one page).
    Events(EventsArgs),
    /// Follow a twin's or a partition's events as they are appended
    /// (Server-Sent Events; reconnects and resumes after the last event seen).
    Tail(TailArgs),
    /// List refused writes (stale tokens, tokens never issued ...) of a twin
    /// or a partition from the store's durable refusal journal, newest first.
    Refusals(RefusalsArgs),
    /// List the effects of admitted events from the fenced outbox and their
    /// delivery states (docs/outbox.md).
    Outbox(OutboxArgs),
    /// List the store's partitions: head, fence and owner.
    Partitions(PartitionsArgs),
    /// Settings files for `palisade serve`.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Write the store's events (or a partition's, or a twin's) as NDJSON,
    /// up to the partition heads read at the start (docs/export.md).
    Export(ExportArgs),
    /// Append the events of an export to a store, twin by twin in their
    /// exported order, with their event ids and HLCs (safe to run again).
    Import(ImportArgs),
    /// Take an online backup of a running store into a new folder: a point
    /// in time with its events, twins, fences, token counter, Kafka offsets,
    /// audit log and refusals (docs/backup.md).
    Backup(BackupArgs),
    /// Build a new store folder from a backup (offline), raising the token
    /// counter and every fence past any token issued before (docs/backup.md).
    Restore(RestoreArgs),
}

/// Where the store is and how to print.
#[derive(Debug, Clone, Args)]
pub struct Conn {
    /// Base URL of the store.
    #[arg(long, env = "PALISADE_URL", default_value = "http://127.0.0.1:7070")]
    pub url: String,
    /// Print JSON for scripts: one document, or one line per event for
    /// `events` and `tail`; errors too (on stdout).
    #[arg(long, env = "PALISADE_JSON", value_parser = BoolishValueParser::new())]
    pub json: bool,
    /// API key, sent as `Authorization: Bearer` (stores with authentication
    /// on; see docs/security.md).
    #[arg(long, env = "PALISADE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// PEM certificate to trust for an https:// --url (the CLI trusts no
    /// built-in roots).
    #[arg(long, env = "PALISADE_CA_CERT", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum LeaseCommand {
    /// Take a lease on a scope; prints its lease id and fencing token.
    Acquire(AcquireArgs),
    /// Restart a lease's TTL (same token).
    Renew(LeaseIdArgs),
    /// Release a lease so the scope can be granted at once.
    Release(LeaseIdArgs),
    /// The TTL the store recommends for a scope, from the renewal gaps and
    /// answer latencies it measured (docs/decisions/0026-ttl-advice.md).
    Advice(AdviceArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AdviceArgs {
    /// `twin/<id>` or `partition/<p>`.
    #[arg(long, env = "PALISADE_SCOPE")]
    pub scope: String,
    /// Only this holder's renewals (default: every holder's on the scope).
    #[arg(long)]
    pub holder: Option<String>,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct AcquireArgs {
    /// `twin/<id>` (an entity lock) or `partition/<p>` (a single-writer partition).
    #[arg(long, env = "PALISADE_SCOPE")]
    pub scope: String,
    /// Your name, as stored with every event written under the lease.
    #[arg(long, env = "PALISADE_HOLDER")]
    pub holder: String,
    /// Time to live in milliseconds (100 to 86400000).
    #[arg(long, env = "PALISADE_LEASE_TTL_MS", default_value_t = 30_000)]
    pub ttl_ms: u64,
    /// What the lease is for: `correctness` (default: two holders at once
    /// would corrupt data) or `efficiency` (they would only duplicate work).
    #[arg(long, env = "PALISADE_LEASE_PURPOSE", default_value = "correctness",
        value_parser = ["correctness", "efficiency"])]
    pub purpose: String,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct LeaseIdArgs {
    /// The lease id (32 hex characters) printed by `lease acquire`.
    #[arg(env = "PALISADE_LEASE_ID")]
    pub lease_id: String,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct AppendArgs {
    /// The twin id.
    #[arg(long, env = "PALISADE_TWIN")]
    pub twin: String,
    /// Your lease's fencing token.
    #[arg(long, env = "PALISADE_FENCING_TOKEN")]
    pub token: u64,
    /// Event type.
    #[arg(long = "type", env = "PALISADE_EVENT_TYPE", default_value = "update")]
    pub event_type: String,
    /// The JSON merge patch (an object), e.g. '{"rpm":1200}'.
    #[arg(long, env = "PALISADE_PATCH", required_unless_present = "file")]
    pub patch: Option<String>,
    /// Idempotency key (default: a random one, so a retry after a dropped
    /// connection cannot store the event twice).
    #[arg(long, env = "PALISADE_EVENT_ID")]
    pub event_id: Option<String>,
    /// Append only if the twin's version (its ETag) is still this.
    #[arg(long, env = "PALISADE_IF_MATCH", value_name = "VERSION", value_parser = parse_version)]
    pub if_match: Option<u64>,
    /// Read the request body from a file (`-`: stdin), as the HTTP API takes
    /// it: one event `{"type","patch","event_id"?,"hlc"?}` or an array of them
    /// (instead of --patch, --type, --event-id).
    #[arg(long, short = 'f', env = "PALISADE_APPEND_FILE", value_name = "FILE")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub conn: Conn,
}

/// A version as printed (`3`) or as an ETag (`"3"`).
fn parse_version(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_prefix("W/").unwrap_or(t).trim_matches('"');
    t.parse()
        .map_err(|_| format!("expected a version number, got {s:?}"))
}

#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    /// The twin id.
    #[arg(long, env = "PALISADE_TWIN")]
    pub twin: String,
    /// The state after the twin's events up to this partition sequence number.
    #[arg(long, env = "PALISADE_AT_SEQ")]
    pub at_seq: Option<u64>,
    /// The state from the twin's events with HLC at most this (`<ntp64>/<hex
    /// id>`); instead of --at-seq.
    #[arg(long, env = "PALISADE_AT_HLC")]
    pub at_hlc: Option<String>,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct EventsArgs {
    /// The twin id.
    #[arg(long, env = "PALISADE_TWIN")]
    pub twin: String,
    /// Only events with a partition sequence number above this.
    #[arg(long, env = "PALISADE_AFTER", default_value_t = 0)]
    pub after: u64,
    /// At most this many events, at least 1 (the store caps it, by default
    /// at 1000, and refuses 0).
    #[arg(long, env = "PALISADE_LIMIT", default_value_t = 100,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub limit: usize,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct OutboxArgs {
    /// Only effects in this state.
    #[arg(long, value_parser = ["pending", "delivered", "dead"])]
    pub state: Option<String>,
    /// Remove this dead effect instead of listing (`PARTITION/SEQ/INDEX`,
    /// as listed): once an operator has dealt with it. Pending and
    /// delivered effects are refused.
    #[arg(long, value_name = "PARTITION/SEQ/INDEX", value_parser = effect_at, conflicts_with = "state")]
    pub remove_dead: Option<(u32, u64, u16)>,
    /// At most this many, at least 1 (the store caps it at 1024).
    #[arg(long, env = "PALISADE_LIMIT", default_value_t = 100,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub limit: usize,
    #[command(flatten)]
    pub conn: Conn,
}

/// `PARTITION/SEQ/INDEX` of an outbox effect.
fn effect_at(s: &str) -> Result<(u32, u64, u16), String> {
    let bad = || {
        format!("{s:?} is not PARTITION/SEQ/INDEX (three numbers, as `palisade outbox` lists them)")
    };
    let mut it = s.split('/');
    let (Some(p), Some(seq), Some(i), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    Ok((
        p.parse().map_err(|_| bad())?,
        seq.parse().map_err(|_| bad())?,
        i.parse().map_err(|_| bad())?,
    ))
}

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("of").required(true).args(["twin", "partition"])))]
pub struct RefusalsArgs {
    /// The twin whose refused writes to list.
    #[arg(long)]
    pub twin: Option<String>,
    /// The partition whose refused writes to list (instead of --twin).
    #[arg(long)]
    pub partition: Option<u32>,
    /// At most this many, at least 1 (the store caps it at 1024).
    #[arg(long, env = "PALISADE_LIMIT", default_value_t = 100,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub limit: usize,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("source").required(true).multiple(true).args(["twin", "partition"])))]
pub struct TailArgs {
    /// Follow this twin's events.
    #[arg(long, env = "PALISADE_TWIN")]
    pub twin: Option<String>,
    /// Follow every event of this partition (instead of --twin).
    #[arg(long, env = "PALISADE_TAIL_PARTITION")]
    pub partition: Option<u32>,
    /// Start after this partition sequence number (0: the whole history
    /// first). Default: the head when tail starts (new events only).
    #[arg(long, env = "PALISADE_AFTER")]
    pub after: Option<u64>,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct PartitionsArgs {
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a `palisade serve` config file (TOML) and print the effective
    /// settings with where each comes from (flag > environment > file > default).
    Check(CheckArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// The TOML file (see palisade.example.toml). Without one, the
    /// environment and the defaults are checked.
    #[arg(long, env = "PALISADE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print JSON.
    #[arg(long, env = "PALISADE_JSON", value_parser = BoolishValueParser::new())]
    pub json: bool,
}

impl CliCommand {
    fn json(&self) -> bool {
        match self {
            Self::Lease(LeaseCommand::Acquire(a)) => a.conn.json,
            Self::Lease(LeaseCommand::Advice(a)) => a.conn.json,
            Self::Lease(LeaseCommand::Renew(a) | LeaseCommand::Release(a)) => a.conn.json,
            Self::Append(a) => a.conn.json,
            Self::Get(a) => a.conn.json,
            Self::Events(a) => a.conn.json,
            Self::Tail(a) => a.conn.json,
            Self::Refusals(a) => a.conn.json,
            Self::Outbox(a) => a.conn.json,
            Self::Partitions(a) => a.conn.json,
            Self::Config(ConfigCommand::Check(a)) => a.json,
            Self::Export(a) => a.conn.json,
            Self::Import(a) => a.conn.json,
            Self::Backup(a) => a.conn.json,
            Self::Restore(a) => a.json,
        }
    }
}

/// Run a client subcommand; prints its output or its error and returns the
/// exit code (see [`EXIT_CODES`]). `top` are the matches of the whole
/// command line `cmd` was parsed from.
pub async fn run(cmd: CliCommand, top: &ArgMatches) -> ExitCode {
    let json = cmd.json();
    let m = leaf(top);
    let result = match cmd {
        CliCommand::Lease(LeaseCommand::Acquire(a)) => commands::acquire(a).await,
        CliCommand::Lease(LeaseCommand::Renew(a)) => commands::renew(a).await,
        CliCommand::Lease(LeaseCommand::Release(a)) => commands::release(a).await,
        CliCommand::Lease(LeaseCommand::Advice(a)) => commands::advice(a).await,
        CliCommand::Append(a) => commands::append(a, m).await,
        CliCommand::Get(a) => commands::get(a, m).await,
        CliCommand::Events(a) => commands::events(a).await,
        CliCommand::Tail(a) => tail::tail(a, m).await,
        CliCommand::Refusals(a) => commands::refusals(a).await,
        CliCommand::Outbox(a) => commands::outbox(a).await,
        CliCommand::Partitions(a) => commands::partitions(a).await,
        CliCommand::Config(ConfigCommand::Check(a)) => config_check::check(&a),
        CliCommand::Export(a) => transfer::export(a).await,
        CliCommand::Import(a) => transfer::import(a).await,
        CliCommand::Backup(a) => backup::backup(a).await,
        CliCommand::Restore(a) => backup::restore(a).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(json),
    }
}

/// The matches of the innermost subcommand (`lease acquire`'s, not `lease`'s).
fn leaf(m: &ArgMatches) -> &ArgMatches {
    match m.subcommand() {
        Some((_, sub)) => leaf(sub),
        None => m,
    }
}

/// Which of two alternative sets of settings to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pick {
    First,
    Second,
    Neither,
}

/// Choose between alternatives (`first` and `second` are argument ids): the
/// side given on the command line beats a side given only by environment
/// variables; both given the same way is a usage error (`both`).
pub(crate) fn pick(
    m: &ArgMatches,
    first: &[&str],
    second: &[&str],
    both: &str,
) -> Result<Pick, Failure> {
    let level = |ids: &[&str]| {
        ids.iter()
            .filter_map(|id| match m.value_source(id) {
                Some(ValueSource::CommandLine) => Some(2),
                Some(ValueSource::EnvVariable) => Some(1),
                _ => None,
            })
            .max()
    };
    match (level(first), level(second)) {
        (None, None) => Ok(Pick::Neither),
        (Some(_), None) => Ok(Pick::First),
        (None, Some(_)) => Ok(Pick::Second),
        (Some(a), Some(b)) if a > b => Ok(Pick::First),
        (Some(a), Some(b)) if b > a => Ok(Pick::Second),
        _ => Err(Failure::Usage(both.to_owned())),
    }
}

/// Why a command failed; decides the exit code and how it is printed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The store answered with an error (`body` has `error`, `message` and
    /// any details). Exit 1.
    Refused { status: u16, body: Value },
    /// No usable answer: connect failure, timeout, connection dropped. Exit 3.
    Unreachable { url: String, message: String },
    /// Bad input found before sending anything. Exit 2.
    Usage(String),
    /// Settings that `palisade serve` would refuse. Exit 1.
    Invalid(String),
    /// Anything else (an answer that could not be understood, I/O). Exit 1.
    Unexpected(String),
    /// stdout was closed (e.g. `palisade tail | head -n 3`): a quiet success.
    Closed,
}

impl Failure {
    /// A `ClientError` from a call to the store at `url`.
    pub(crate) fn client(e: ClientError, url: &str) -> Self {
        let message = e.to_string();
        match e {
            ClientError::Stale { token, fence } => Self::Refused {
                status: 409,
                body: json!({ "error": "stale_token", "message": message, "token": token, "fence": fence }),
            },
            ClientError::LeaseHeld {
                ref holder,
                expires_in_ms,
            } => Self::Refused {
                status: 409,
                body: json!({ "error": "lease_held", "message": message, "holder": holder, "expires_in_ms": expires_in_ms }),
            },
            ClientError::LeaseGone { ref reason } => Self::Refused {
                status: e.status().unwrap_or(410),
                body: json!({ "error": reason, "message": message }),
            },
            ClientError::Api {
                status,
                error,
                message,
            } => Self::Refused {
                status,
                body: json!({ "error": error, "message": message }),
            },
            ClientError::Transport(e) => Self::transport(&e, url),
            ClientError::BadUrl(m) => Self::Usage(format!("--url: {m}")),
            // Only change streams report this; `tail` reads them itself.
            ClientError::Stream { .. } => Self::Unexpected(format!("{url}: {message}")),
        }
    }

    /// A reqwest failure: unreachable, unless an answer arrived and could
    /// not be decoded.
    pub(crate) fn transport(e: &reqwest::Error, url: &str) -> Self {
        if e.is_decode() || e.is_builder() {
            return Self::Unexpected(format!("unexpected answer from {url}: {}", chain(e)));
        }
        Self::Unreachable {
            url: url.to_owned(),
            message: chain(e),
        }
    }

    /// A non-2xx answer with its raw body.
    pub(crate) fn refused(status: u16, body: &[u8]) -> Self {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        if v.get("error").and_then(Value::as_str).is_some() {
            return Self::Refused { status, body: v };
        }
        let text = String::from_utf8_lossy(body);
        let text: String = text.chars().take(300).collect();
        Self::Refused {
            status,
            body: json!({ "error": "unexpected_response", "message": text.trim() }),
        }
    }

    fn code(&self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::Refused { .. } | Self::Invalid(_) | Self::Unexpected(_) => 1,
            Self::Usage(_) => 2,
            Self::Unreachable { .. } => 3,
        }
    }

    fn report(self, json: bool) -> ExitCode {
        let code = ExitCode::from(self.code());
        let doc = match &self {
            Self::Closed => return code,
            Self::Refused { status, body } => {
                let mut body = body.clone();
                if let Value::Object(m) = &mut body {
                    m.insert("status".into(), json!(status));
                }
                body
            }
            Self::Unreachable { url, message } => {
                json!({ "error": "unreachable", "message": format!("cannot reach the store at {url}: {message}"), "url": url })
            }
            Self::Usage(m) => json!({ "error": "usage", "message": m }),
            Self::Invalid(m) => json!({ "error": "invalid_config", "message": m }),
            Self::Unexpected(m) => json!({ "error": "failed", "message": m }),
        };
        if json {
            let _ = writeln!(std::io::stdout().lock(), "{doc}");
            return code;
        }
        let text = |k: &str| doc.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let line = match &self {
            Self::Refused { status, .. } => {
                format!("{} (HTTP {status}): {}", text("error"), text("message"))
            }
            Self::Unreachable { .. } => format!(
                "{}\n  (is `palisade serve` running there? set --url or PALISADE_URL)",
                text("message")
            ),
            Self::Invalid(m) => format!("invalid settings: {m}"),
            _ => text("message"),
        };
        eprintln!("palisade: {line}");
        code
    }
}

/// A plain left-aligned text table (the last column is not padded).
#[derive(Debug)]
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new<const N: usize>(head: [&str; N]) -> Self {
        Self {
            rows: vec![head.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    pub(crate) fn row<const N: usize>(&mut self, cells: [String; N]) {
        self.rows.push(cells.into());
    }

    fn render(&self) -> Vec<String> {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let width: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        self.rows
            .iter()
            .map(|r| {
                let mut line = String::new();
                for (c, cell) in r.iter().enumerate() {
                    if c + 1 == r.len() {
                        line.push_str(cell);
                    } else {
                        let pad = width[c].saturating_sub(cell.chars().count()) + 2;
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
                line
            })
            .collect()
    }

    pub(crate) fn print(&self) -> Result<(), Failure> {
        self.render().into_iter().try_for_each(out)
    }
}

/// An HTTP client builder for the CLI: `Authorization: Bearer <api_key>` on
/// every request, and `ca_cert` (PEM) as the only trusted root for HTTPS
/// (the CLI trusts no built-in roots).
pub(crate) fn http_builder(
    api_key: Option<&str>,
    ca_cert: Option<&Path>,
) -> Result<reqwest::ClientBuilder, String> {
    let mut b = reqwest::Client::builder();
    if let Some(key) = api_key {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", key.trim()))
            .map_err(|_| "--api-key: not a valid header value".to_owned())?;
        v.set_sensitive(true);
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::AUTHORIZATION, v);
        b = b.default_headers(h);
    }
    if let Some(path) = ca_cert {
        let pem = std::fs::read(path).map_err(|e| format!("--ca-cert {}: {e}", path.display()))?;
        let cert = reqwest::Certificate::from_pem(&pem)
            .map_err(|e| format!("--ca-cert {}: {e}", path.display()))?;
        b = b.add_root_certificate(cert);
    }
    Ok(b)
}

/// An error and its sources, for people (`reqwest`'s own text is terse).
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

/// Print one line on stdout; a closed stdout ends the command quietly.
pub(crate) fn out(line: impl std::fmt::Display) -> Result<(), Failure> {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{line}")
        .and_then(|()| o.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::Closed,
            _ => Failure::Unexpected(format!("cannot write to stdout: {e}")),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_as_numbers_or_etags() {
        assert_eq!(parse_version("3"), Ok(3));
        assert_eq!(parse_version("\"3\""), Ok(3));
        assert_eq!(parse_version("W/\"7\""), Ok(7));
        assert!(parse_version("x").is_err());
        assert!(parse_version("").is_err());
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new(["SEQ", "TYPE", "PATCH"]);
        t.row(["1".into(), "update".into(), "{}".into()]);
        t.row(["12345".into(), "x".into(), "{\"a\":1}".into()]);
        assert_eq!(
            t.render(),
            [
                "SEQ    TYPE    PATCH",
                "1      update  {}",
                "12345  x       {\"a\":1}"
            ]
        );
    }

    #[test]
    fn exit_codes_by_failure() {
        assert_eq!(
            Failure::refused(409, br#"{"error":"stale_token","message":"m"}"#).code(),
            1
        );
        assert_eq!(Failure::Usage("u".into()).code(), 2);
        let unreachable = Failure::Unreachable {
            url: "u".into(),
            message: "m".into(),
        };
        assert_eq!(unreachable.code(), 3);
        assert_eq!(Failure::Invalid("i".into()).code(), 1);
        // A proxy's HTML page is kept as a bounded message.
        match Failure::refused(502, "<html>bad gateway</html>".repeat(100).as_bytes()) {
            Failure::Refused { status: 502, body } => {
                assert_eq!(body["error"], "unexpected_response");
                assert!(body["message"].as_str().unwrap().len() <= 300);
            }
            other => panic!("{other:?}"),
        }
        let stale = Failure::client(ClientError::Stale { token: 3, fence: 5 }, "u");
        match stale {
            Failure::Refused { status: 409, body } => {
                assert_eq!(body["error"], "stale_token");
                assert_eq!(
                    (body["token"].as_u64(), body["fence"].as_u64()),
                    (Some(3), Some(5))
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
