//! Settings for `palisade serve` from a TOML file (`--config FILE`,
//! `PALISADE_CONFIG`), and `palisade config check`.
//!
//! Keys are the long flags with underscores (`max_drift_ms`); the one table
//! is `kafka_settings` (the repeatable `--kafka-setting KEY=VALUE`, named
//! like its variable `PALISADE_KAFKA_SETTINGS`). Precedence, per key:
//! command-line flag > environment variable > file > default. A key given
//! by a flag or variable keeps that value; every other key that the file
//! sets takes the file's value. Unknown keys are an error naming the key.
//! Relative paths (`data`) are relative to the working directory, as for
//! the flag. See `docs/decisions/0007-config-file.md`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::parser::ValueSource;
use clap::ArgMatches;
use serde::Deserialize;

use crate::config::{ServeArgs, ServeConfig};

/// Every key of the file: the ids of [`ServeConfig`]'s arguments.
pub const KEYS: [&str; 29] = [
    "data",
    "listen",
    "partitions",
    "max_drift_ms",
    "max_body_bytes",
    "max_batch_events",
    "snapshot_every",
    "cache_mb",
    "max_connections",
    "max_connections_per_ip",
    "header_timeout_ms",
    "body_timeout_ms",
    "idle_timeout_ms",
    "security",
    "tls_cert",
    "tls_key",
    "insecure",
    "kafka_brokers",
    "kafka_topic",
    "kafka_group",
    "kafka_dead_letter_topic",
    "kafka_max_record_bytes",
    "kafka_strict_partitioning",
    "kafka_settings",
    "lease_backend",
    "etcd_endpoints",
    "etcd_prefix",
    "cluster_node",
    "cluster_advertise",
];

/// The file, as written: every key optional, unknown keys refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    data: Option<PathBuf>,
    listen: Option<SocketAddr>,
    partitions: Option<u32>,
    max_drift_ms: Option<u64>,
    max_body_bytes: Option<usize>,
    max_batch_events: Option<usize>,
    snapshot_every: Option<u64>,
    cache_mb: Option<u64>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    header_timeout_ms: Option<u64>,
    body_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    security: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    insecure: Option<bool>,
    kafka_brokers: Option<String>,
    kafka_topic: Option<String>,
    kafka_group: Option<String>,
    kafka_dead_letter_topic: Option<String>,
    kafka_max_record_bytes: Option<usize>,
    kafka_strict_partitioning: Option<bool>,
    /// librdkafka settings: `{ "security.protocol" = "ssl", ... }`, string
    /// values (checked by [`FileConfig::parse`]).
    kafka_settings: Option<toml::Table>,
    lease_backend: Option<crate::config::LeaseBackend>,
    etcd_endpoints: Option<Vec<String>>,
    etcd_prefix: Option<String>,
    cluster_node: Option<String>,
    cluster_advertise: Option<String>,
}

/// `kafka_settings` as `--kafka-setting` pairs (values checked by `parse`).
fn settings_of(t: toml::Table) -> Vec<(String, String)> {
    t.into_iter()
        .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_owned())))
        .collect()
}

impl FileConfig {
    pub fn parse(text: &str) -> Result<Self, String> {
        let f: Self = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())?;
        for (k, v) in f.kafka_settings.iter().flatten() {
            if k.trim().is_empty() {
                return Err("kafka_settings: empty key".into());
            }
            match v {
                toml::Value::String(_) => {}
                toml::Value::Table(_) => {
                    return Err(format!(
                        "kafka_settings: {k:?} is a table; quote keys that contain dots, \
                         as in \"{k}.…\" = \"value\""
                    ))
                }
                other => {
                    return Err(format!(
                        "kafka_settings: the value of {k:?} must be a string, not {} \
                         (write \"{other}\")",
                        other.type_str()
                    ))
                }
            }
        }
        Ok(f)
    }

    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }
}

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env,
    File,
    Default,
    /// No value and no default (an optional setting left out).
    Unset,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Self::Flag => "flag",
            Self::Env => "env",
            Self::File => "file",
            Self::Default => "default",
            Self::Unset => "unset",
        }
    }
}

/// The settings `palisade serve` runs with, and where each came from.
#[derive(Debug)]
pub struct Resolved {
    pub config: ServeConfig,
    pub file: Option<PathBuf>,
    /// One entry per key of [`KEYS`].
    pub sources: BTreeMap<&'static str, Source>,
}

/// Apply the file named by `args.config` under the flags and environment
/// variables that `m` (the matches `args` was parsed from) saw.
pub fn resolve(args: ServeArgs, m: &ArgMatches) -> Result<Resolved, String> {
    let mut sources: BTreeMap<&'static str, Source> = KEYS
        .iter()
        .map(|&k| {
            let s = match m.value_source(k) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => Source::Env,
                Some(ValueSource::DefaultValue) => Source::Default,
                _ => Source::Unset,
            };
            (k, s)
        })
        .collect();
    let mut cfg = args.settings;
    if let Some(path) = &args.config {
        let f = FileConfig::load(path)?;
        // For each key the file sets: take it unless a flag or variable did.
        macro_rules! take {
            ($key:ident) => {
                take!($key, |v| v)
            };
            ($key:ident, $conv:expr) => {
                if let Some(v) = f.$key {
                    let src = sources.entry(stringify!($key)).or_insert(Source::Unset);
                    if matches!(*src, Source::Default | Source::Unset) {
                        cfg.$key = ($conv)(v);
                        *src = Source::File;
                    }
                }
            };
        }
        take!(data);
        take!(listen);
        take!(partitions, Some);
        take!(max_drift_ms);
        take!(max_body_bytes);
        take!(max_batch_events);
        take!(snapshot_every);
        take!(cache_mb);
        take!(max_connections);
        take!(max_connections_per_ip);
        take!(header_timeout_ms);
        take!(body_timeout_ms);
        take!(idle_timeout_ms);
        take!(security, Some);
        take!(tls_cert, Some);
        take!(tls_key, Some);
        take!(insecure);
        take!(kafka_brokers, Some);
        take!(kafka_topic);
        take!(kafka_group);
        take!(kafka_dead_letter_topic, Some);
        take!(kafka_max_record_bytes);
        take!(kafka_strict_partitioning);
        take!(kafka_settings, settings_of);
        take!(lease_backend);
        take!(etcd_endpoints);
        take!(etcd_prefix);
        take!(cluster_node, Some);
        take!(cluster_advertise, Some);
    }
    Ok(Resolved {
        config: cfg,
        file: args.config,
        sources,
    })
}

/// `palisade serve [--config FILE]`: resolve the settings, then serve.
/// `top` are the matches of the whole command line.
pub async fn serve(args: ServeArgs, top: &ArgMatches) -> anyhow::Result<()> {
    let m = top
        .subcommand_matches("serve")
        .context("no `serve` arguments")?;
    let r = resolve(args, m).map_err(anyhow::Error::msg)?;
    if let Some(f) = &r.file {
        tracing::info!(config = %f.display(), "settings from a config file");
    }
    crate::serve::serve(r.config).await
}

/// Each key's effective value as TOML (`None`: unset).
pub fn values(c: &ServeConfig) -> Vec<(&'static str, Option<toml::Value>)> {
    use toml::Value as V;
    let s = |v: &str| Some(V::String(v.to_owned()));
    let n = |v: u64| Some(i64::try_from(v).map_or_else(|_| V::String(v.to_string()), V::Integer));
    let z = |v: usize| n(u64::try_from(v).unwrap_or(u64::MAX));
    let settings = (!c.kafka_settings.is_empty()).then(|| {
        V::Table(
            c.kafka_settings
                .iter()
                .map(|(k, v)| (k.clone(), V::String(v.clone())))
                .collect(),
        )
    });
    vec![
        ("data", s(&c.data.to_string_lossy())),
        ("listen", s(&c.listen.to_string())),
        ("partitions", c.partitions.and_then(|p| n(p.into()))),
        ("max_drift_ms", n(c.max_drift_ms)),
        ("max_body_bytes", z(c.max_body_bytes)),
        ("max_batch_events", z(c.max_batch_events)),
        ("snapshot_every", n(c.snapshot_every)),
        ("cache_mb", n(c.cache_mb)),
        ("max_connections", z(c.max_connections)),
        ("max_connections_per_ip", z(c.max_connections_per_ip)),
        ("header_timeout_ms", n(c.header_timeout_ms)),
        ("body_timeout_ms", n(c.body_timeout_ms)),
        ("idle_timeout_ms", n(c.idle_timeout_ms)),
        (
            "security",
            c.security.as_deref().and_then(|p| s(&p.to_string_lossy())),
        ),
        (
            "tls_cert",
            c.tls_cert.as_deref().and_then(|p| s(&p.to_string_lossy())),
        ),
        (
            "tls_key",
            c.tls_key.as_deref().and_then(|p| s(&p.to_string_lossy())),
        ),
        ("insecure", Some(V::Boolean(c.insecure))),
        ("kafka_brokers", c.kafka_brokers.as_deref().and_then(s)),
        ("kafka_topic", s(&c.kafka_topic)),
        ("kafka_group", s(&c.kafka_group)),
        (
            "kafka_dead_letter_topic",
            c.kafka_dead_letter_topic.as_deref().and_then(s),
        ),
        ("kafka_max_record_bytes", z(c.kafka_max_record_bytes)),
        (
            "kafka_strict_partitioning",
            Some(V::Boolean(c.kafka_strict_partitioning)),
        ),
        ("kafka_settings", settings),
        ("lease_backend", s(c.lease_backend.name())),
        (
            "etcd_endpoints",
            (!c.etcd_endpoints.is_empty()).then(|| {
                V::Array(
                    c.etcd_endpoints
                        .iter()
                        .map(|e| V::String(e.clone()))
                        .collect(),
                )
            }),
        ),
        ("etcd_prefix", s(&c.etcd_prefix)),
        ("cluster_node", c.cluster_node.as_deref().and_then(s)),
        (
            "cluster_advertise",
            c.cluster_advertise.as_deref().and_then(s),
        ),
    ]
}

/// What an unset optional key means.
pub fn unset_note(key: &str) -> &'static str {
    match key {
        "partitions" => "a new store gets 16; an existing store keeps its count",
        "kafka_brokers" => "no Kafka ingestion",
        "security" => "authentication off: loopback only",
        "tls_cert" | "tls_key" => "plain HTTP",
        "kafka_dead_letter_topic" => "dead letters are kept in the store only",
        "etcd_endpoints" => "none (needed by lease_backend = \"etcd\")",
        "cluster_node" => "single-node mode",
        "cluster_advertise" => "http:// + listen",
        _ => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};
    use std::collections::BTreeSet;
    use std::ffi::OsString;

    fn arg_ids() -> BTreeSet<String> {
        ServeConfig::augment_args(clap::Command::new("t"))
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect()
    }

    /// The example file with its `# key = value` lines uncommented.
    fn example_uncommented() -> String {
        include_str!("../../../../palisade.example.toml")
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with('[')
                        || rest.split_once(" = ").is_some_and(|(k, _)| {
                            !k.is_empty()
                                && k.chars()
                                    .all(|c| c.is_ascii_alphanumeric() || "_.\"-".contains(c))
                        }) =>
                {
                    rest
                }
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn keys_are_exactly_the_serve_flags() {
        let keys: BTreeSet<String> = KEYS.iter().map(|k| (*k).to_owned()).collect();
        assert_eq!(keys, arg_ids(), "KEYS and ServeConfig's flags differ");
        let shown: BTreeSet<String> = values(
            &ServeConfig::augment_args(clap::Command::new("t"))
                .try_get_matches_from(["t"])
                .map(|m| ServeConfig::from_arg_matches(&m).unwrap())
                .unwrap(),
        )
        .into_iter()
        .map(|(k, _)| k.to_owned())
        .collect();
        assert_eq!(shown, keys, "config check would not print every key");
    }

    #[test]
    fn the_example_file_names_every_key_and_parses() {
        let text = example_uncommented();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let keys: BTreeSet<String> = table.keys().cloned().collect();
        assert_eq!(keys, arg_ids(), "palisade.example.toml misses or adds keys");
        let f = FileConfig::parse(&text).unwrap();
        assert!(f.partitions.is_some() && f.kafka_settings.is_some_and(|m| !m.is_empty()));
        // As shipped (all commented out) it is valid too and sets nothing.
        let shipped = FileConfig::parse(include_str!("../../../../palisade.example.toml")).unwrap();
        assert!(shipped.data.is_none() && shipped.partitions.is_none());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = FileConfig::parse("partitions = 4\nmax_drift = 10\n").unwrap_err();
        assert!(e.contains("max_drift"), "{e}");
        let e = FileConfig::parse("partitions = -1\n").unwrap_err();
        assert!(e.contains("partitions"), "{e}");
        let e = FileConfig::parse("listen = \"nowhere\"\n").unwrap_err();
        assert!(e.contains("listen"), "{e}");
        let e = FileConfig::parse("[kafka_settings]\n\"\" = \"x\"\n").unwrap_err();
        assert!(e.contains("empty key"), "{e}");
        let e = FileConfig::parse("[kafka_settings]\nsecurity.protocol = \"ssl\"\n").unwrap_err();
        assert!(e.contains("quote keys"), "{e}");
        let e = FileConfig::parse("[kafka_settings]\n\"linger.ms\" = 5\n").unwrap_err();
        assert!(e.contains("\"linger.ms\"") && e.contains("string"), "{e}");
    }

    fn resolve_with(file: &str, cli: &[&str]) -> Resolved {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(&path, file).unwrap();
        let mut argv: Vec<OsString> = vec!["serve".into(), "--config".into(), path.into()];
        argv.extend(cli.iter().map(OsString::from));
        let m = ServeArgs::augment_args(clap::Command::new("serve"))
            .try_get_matches_from(argv)
            .unwrap();
        let args = ServeArgs::from_arg_matches(&m).unwrap();
        resolve(args, &m).unwrap()
    }

    // (Environment-variable precedence is tested with real processes in
    // tests/cli: setting variables here would race other tests.)
    #[test]
    fn flags_beat_the_file_which_beats_defaults() {
        let file = "partitions = 4\nmax_drift_ms = 900\nkafka_topic = \"t\"\n[kafka_settings]\n\"a.b\" = \"1\"\n";
        let r = resolve_with(file, &[]);
        assert_eq!(r.config.partitions, Some(4));
        assert_eq!(r.config.max_drift_ms, 900);
        assert_eq!(r.config.kafka_topic, "t");
        assert_eq!(
            r.config.kafka_settings,
            [("a.b".to_owned(), "1".to_owned())]
        );
        assert_eq!(r.sources["partitions"], Source::File);
        assert_eq!(r.config.snapshot_every, 64);
        assert_eq!(r.sources["snapshot_every"], Source::Default);

        let r = resolve_with(
            file,
            &[
                "--partitions",
                "8",
                "--max-drift-ms",
                "500",
                "--kafka-setting",
                "c=2",
            ],
        );
        assert_eq!(r.config.partitions, Some(8));
        // Even when the flag's value equals the default, the flag wins.
        assert_eq!(r.config.max_drift_ms, 500);
        assert_eq!(r.config.kafka_settings, [("c".to_owned(), "2".to_owned())]);
        assert_eq!(r.sources["partitions"], Source::Flag);
        assert_eq!(r.config.kafka_topic, "t");
    }
}
