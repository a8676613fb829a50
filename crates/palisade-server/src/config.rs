//! `palisade serve`'s configuration, defined once: [`ServeConfig`]'s fields
//! are the settings. Each field's clap attributes give its flag, its
//! `PALISADE_*` variable, its default and its value parser ([`bounds`]); the
//! TOML file ([`file`]) takes the same keys and hands its values to the same
//! parsers; `palisade config check` prints them by serializing the struct.
//! [`ServeConfig::validate`] checks the rules across settings and returns the
//! [`Mode`] the server runs in.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

pub mod bounds;
pub mod file;

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

/// `palisade serve` settings; every flag is also an environment variable
/// (`PALISADE_` + the key in capitals) and a key of the config file (the
/// field name). Serialized, it is the TOML `palisade config check` prints.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct ServeConfig {
    /// Folder of the store (created if missing).
    #[arg(long, env = "PALISADE_DATA", default_value = "palisade-data", value_parser = bounds::folder)]
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
    /// Refused writes kept per partition in the durable refusal journal
    /// (`GET /v1/twins/{id}/refusals`); past it the oldest go (1..=10000000).
    #[arg(long, env = "PALISADE_REFUSALS_PER_PARTITION", default_value_t = palisade_log::DEFAULT_REFUSALS_PER_PARTITION, value_parser = bounds::parser::<u64>(bounds::REFUSALS_PER_PARTITION))]
    pub refusals_per_partition: u64,
    /// Outbox: delivery tries of one effect before it goes to the dead
    /// list (1..=1000; docs/outbox.md).
    #[arg(long, env = "PALISADE_OUTBOX_MAX_ATTEMPTS", default_value_t = 8, value_parser = bounds::parser::<u32>(bounds::OUTBOX_MAX_ATTEMPTS))]
    pub outbox_max_attempts: u32,
    /// Outbox: the wait after a failed try, in milliseconds, doubled after
    /// each further failure up to `outbox_backoff_max_ms` (1..=3600000).
    #[arg(long, env = "PALISADE_OUTBOX_BACKOFF_MS", default_value_t = 500, value_parser = bounds::parser::<u64>(bounds::OUTBOX_BACKOFF_MS))]
    pub outbox_backoff_ms: u64,
    /// Outbox: the longest wait between two tries, in milliseconds
    /// (1..=3600000).
    #[arg(long, env = "PALISADE_OUTBOX_BACKOFF_MAX_MS", default_value_t = 60_000, value_parser = bounds::parser::<u64>(bounds::OUTBOX_BACKOFF_MS))]
    pub outbox_backoff_max_ms: u64,
    /// Outbox: how long one delivery try may take, in milliseconds
    /// (1..=3600000).
    #[arg(long, env = "PALISADE_OUTBOX_TIMEOUT_MS", default_value_t = 10_000, value_parser = bounds::parser::<u64>(bounds::OUTBOX_BACKOFF_MS))]
    pub outbox_timeout_ms: u64,
    /// Outbox: delivered effects kept per partition (the newest); older
    /// ones are removed through the commit path. Dead and pending effects
    /// are never removed (0..=100000000; docs/outbox.md).
    #[arg(long, env = "PALISADE_OUTBOX_KEEP_DELIVERED", default_value_t = 1000, value_parser = bounds::parser::<u64>(bounds::OUTBOX_KEEP_DELIVERED))]
    pub outbox_keep_delivered: u64,
    /// Outbox: PEM file of the certificate authorities the dispatcher
    /// trusts for `https://` effects (one or more certificates). Without
    /// it no root is trusted and https effects end dead (docs/outbox.md).
    #[arg(long, env = "PALISADE_OUTBOX_CA_FILE", value_name = "PEM")]
    pub outbox_ca_file: Option<PathBuf>,
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
    #[arg(long, env = "PALISADE_KAFKA_BROKERS", value_parser = bounds::text)]
    pub kafka_brokers: Option<String>,
    /// Topic of twin events.
    #[arg(long, env = "PALISADE_KAFKA_TOPIC", default_value = "twin-events", value_parser = bounds::topic)]
    pub kafka_topic: String,
    /// Consumer group id.
    #[arg(long, env = "PALISADE_KAFKA_GROUP", default_value = "palisade", value_parser = bounds::text)]
    pub kafka_group: String,
    /// Also copy dead-lettered records to this topic (they are always kept in the store).
    #[arg(long, env = "PALISADE_KAFKA_DEAD_LETTER_TOPIC", value_parser = bounds::topic)]
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
    #[arg(long = "kafka-setting", env = "PALISADE_KAFKA_SETTINGS", value_delimiter = ',', value_parser = bounds::kafka_setting)]
    #[serde(serialize_with = "as_table")]
    pub kafka_settings: Vec<(String, String)>,
    /// Where leases and fencing tokens come from: `embedded` (in the store,
    /// one node) or `etcd` (etcd leases; token = the lock key's create
    /// revision; see docs/decisions/0011-etcd-lease-authority.md). A store
    /// keeps the backend its first token came from.
    #[arg(long, env = "PALISADE_LEASE_BACKEND", value_enum, default_value_t = LeaseBackend::Embedded)]
    pub lease_backend: LeaseBackend,
    /// etcd members, `http://host:port`; repeatable (env: comma separated).
    #[arg(long, env = "PALISADE_ETCD_ENDPOINTS", value_delimiter = ',', value_parser = bounds::etcd_endpoint)]
    pub etcd_endpoints: Vec<String>,
    /// Prefix of every etcd key Palisade writes (clusters can share one etcd).
    #[arg(long, env = "PALISADE_ETCD_PREFIX", default_value = "/palisade/", value_parser = bounds::text)]
    pub etcd_prefix: String,
    /// Cluster mode: this node's id in the consumer group (see
    /// docs/decisions/0012-cluster-mode.md). Needs --lease-backend etcd and
    /// --kafka-brokers.
    #[arg(long, env = "PALISADE_CLUSTER_NODE", value_parser = bounds::node_id)]
    pub cluster_node: Option<String>,
    /// Cluster mode: the URL other nodes and clients reach this node at
    /// (default: http:// + the listen address).
    #[arg(long, env = "PALISADE_CLUSTER_ADVERTISE", value_parser = bounds::url)]
    pub cluster_advertise: Option<String>,
    /// Cluster mode: PEM root certificate(s) trusted when this node asks
    /// other nodes over HTTPS for the cluster-wide views (default: this
    /// node's --tls-cert, enough when every node serves the same
    /// certificate or one signed by the roots in it).
    #[arg(long, env = "PALISADE_CLUSTER_CA_FILE", value_name = "FILE")]
    pub cluster_ca_file: Option<PathBuf>,
    /// Cluster mode: start even if other nodes run with another --security
    /// file (a node refuses to by default: nodes would decide differently).
    /// For a rolling change of the file: restart each node with it.
    #[arg(long, env = "PALISADE_CLUSTER_SECURITY_CHANGE")]
    pub cluster_security_change: bool,
    /// Cluster mode: a folder every node reaches (a shared volume) for
    /// partition snapshots. The owner of a partition writes one there every
    /// --partition-snapshot-interval-ms; a node that gains the partition
    /// loads the newest and replays only the log after it, so a handoff is
    /// bounded by the interval, not the log's length
    /// (docs/decisions/0038-partition-snapshots.md).
    #[arg(long, env = "PALISADE_PARTITION_SNAPSHOT_DIR", value_name = "DIR")]
    pub partition_snapshot_dir: Option<PathBuf>,
    /// Cluster mode: how often the owner of a partition writes its snapshot
    /// (only if the partition moved on since the last one).
    #[arg(long, env = "PALISADE_PARTITION_SNAPSHOT_INTERVAL_MS", default_value_t = 60_000, value_parser = bounds::parser::<u64>(bounds::TIMEOUT_MS))]
    pub partition_snapshot_interval_ms: u64,
}

/// Where leases and fencing tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
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

/// `kafka_settings` as the TOML table the file takes.
fn as_table<S: serde::Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(v.iter().map(|(k, v)| (k, v)))
}

/// Why the settings cannot be served with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// One setting's value (the config file's: its clap error, with the key).
    #[error("{key} (--{flag}): {reason}")]
    Invalid {
        key: String,
        flag: String,
        reason: String,
    },
    /// Settings that only work together.
    #[error("{0}")]
    Combination(&'static str),
    /// The config file cannot be read or is not TOML.
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
}

impl ConfigError {
    /// `key`'s value breaks a rule; the flag is the key with dashes (the
    /// one repeatable flag is named in the singular).
    pub fn invalid(key: &str, reason: impl Into<String>) -> Self {
        let flag = match key {
            "kafka_settings" => "kafka-setting".to_owned(),
            _ => key.replace('_', "-"),
        };
        Self::Invalid {
            key: key.to_owned(),
            flag,
            reason: reason.into(),
        }
    }
}

/// What `palisade serve` runs as, decided once from the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// One node; leases from the store itself or from etcd.
    Single { leases: Leases },
    /// One node of a cluster (docs/decisions/0012-cluster-mode.md): etcd
    /// owner leases and Kafka as the log.
    Cluster {
        node: String,
        etcd: EtcdSettings,
        kafka_brokers: String,
    },
}

/// Where a single node's leases come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leases {
    Embedded,
    Etcd(EtcdSettings),
}

/// The etcd cluster to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    pub prefix: String,
}

impl ServeConfig {
    /// The rules across settings ([`bounds::check`]; each value alone
    /// passed its parser), and the mode they describe. Runs before anything
    /// touches the disk.
    pub fn validate(&self) -> Result<Mode, ConfigError> {
        bounds::check(self)?;
        if self.partition_snapshot_dir.is_some() && self.cluster_node.is_none() {
            return Err(ConfigError::Combination(
                "--partition-snapshot-dir is for cluster mode (--cluster-node): one node has no handoff",
            ));
        }
        let etcd = || EtcdSettings {
            endpoints: self.etcd_endpoints.clone(),
            prefix: self.etcd_prefix.clone(),
        };
        match (&self.cluster_node, self.lease_backend) {
            (_, LeaseBackend::Etcd) if self.etcd_endpoints.is_empty() => Err(
                ConfigError::Combination("--lease-backend etcd needs --etcd-endpoints"),
            ),
            (None, LeaseBackend::Embedded) => Ok(Mode::Single {
                leases: Leases::Embedded,
            }),
            (None, LeaseBackend::Etcd) => Ok(Mode::Single {
                leases: Leases::Etcd(etcd()),
            }),
            (Some(node), LeaseBackend::Etcd) if self.kafka_brokers.is_some() => Ok(Mode::Cluster {
                node: node.clone(),
                etcd: etcd(),
                kafka_brokers: self.kafka_brokers.clone().unwrap_or_default(),
            }),
            (Some(_), _) => Err(ConfigError::Combination(
                "--cluster-node (cluster mode) needs --lease-backend etcd and --kafka-brokers",
            )),
        }
    }

    /// The outbox dispatcher's settings (reads `--outbox-ca-file`: an
    /// unreadable file, or one without a usable certificate, is an error).
    pub fn dispatch_config(&self) -> anyhow::Result<crate::outbox::DispatchConfig> {
        let ms = std::time::Duration::from_millis;
        Ok(crate::outbox::DispatchConfig {
            max_attempts: self.outbox_max_attempts,
            backoff: ms(self.outbox_backoff_ms),
            backoff_max: ms(self.outbox_backoff_max_ms),
            timeout: ms(self.outbox_timeout_ms),
            keep_delivered: usize::try_from(self.outbox_keep_delivered).unwrap_or(usize::MAX),
            roots: crate::outbox::trust_roots(self.outbox_ca_file.as_deref())?,
            kafka: self
                .kafka_brokers
                .clone()
                .map(|b| (b, self.kafka_settings.clone())),
        })
    }

    pub fn store_config(&self) -> palisade_log::StoreConfig {
        palisade_log::StoreConfig {
            partitions: self.partitions,
            max_drift: std::time::Duration::from_millis(self.max_drift_ms),
            snapshot_every: self.snapshot_every,
            refusals_per_partition: self.refusals_per_partition,
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
        c.snapshots =
            self.partition_snapshot_dir
                .clone()
                .map(|dir| palisade_kafka::SnapshotSettings {
                    dir,
                    every: std::time::Duration::from_millis(self.partition_snapshot_interval_ms),
                });
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    fn mode(args: &[&str]) -> Result<Mode, ConfigError> {
        let mut argv = vec!["serve"];
        argv.extend(args);
        let m = ServeConfig::augment_args(clap::Command::new("serve"))
            .mut_args(|a| a.env(None))
            .try_get_matches_from(argv)
            .unwrap();
        ServeConfig::from_arg_matches(&m).unwrap().validate()
    }

    #[test]
    fn validate_names_the_mode_the_settings_describe() {
        let etcd = EtcdSettings {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "/palisade/".into(),
        };
        assert_eq!(
            mode(&[]),
            Ok(Mode::Single {
                leases: Leases::Embedded
            })
        );
        let on_etcd = [
            "--lease-backend",
            "etcd",
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
        ];
        assert_eq!(
            mode(&on_etcd),
            Ok(Mode::Single {
                leases: Leases::Etcd(etcd.clone())
            })
        );
        let mut cluster = on_etcd.to_vec();
        cluster.extend(["--cluster-node", "n1", "--kafka-brokers", "127.0.0.1:9092"]);
        let mut with_snapshots = cluster.clone();
        with_snapshots.extend(["--partition-snapshot-dir", "/tmp/snaps"]);
        assert!(matches!(mode(&with_snapshots), Ok(Mode::Cluster { .. })));
        assert_eq!(
            mode(&cluster),
            Ok(Mode::Cluster {
                node: "n1".into(),
                etcd,
                kafka_brokers: "127.0.0.1:9092".into()
            })
        );
        // Settings that only work together.
        for args in [
            &["--lease-backend", "etcd"][..],
            &["--cluster-node", "n1", "--kafka-brokers", "k:1"],
            &[
                "--cluster-node",
                "n1",
                "--lease-backend",
                "etcd",
                "--etcd-endpoints",
                "e:1",
            ],
            // Partition snapshots are for a cluster's handoffs.
            &["--partition-snapshot-dir", "/tmp/snaps"],
        ] {
            assert!(
                matches!(mode(args), Err(ConfigError::Combination(_))),
                "{args:?}: {:?}",
                mode(args)
            );
        }
    }
}
