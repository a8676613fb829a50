//! What every `palisade serve` setting accepts (issue 18: a bad setting used
//! to panic in uhlc or sled after the data folder was created).
//!
//! Each rule on one value is a clap value parser named on its field in
//! `ServeConfig` (ranges, text, topic names, URLs, librdkafka settings), and
//! every value passes through clap: flags, `PALISADE_*` variables and the
//! config file alike (`file.rs` hands the file's values to clap). [`check`]
//! holds the rules that span values. All of it runs before anything touches
//! the disk; messages name the flag (and, for a file, the key), the accepted
//! range and the value.

use std::ops::RangeInclusive;

use clap::builder::RangedU64ValueParser;

use super::{ConfigError, ServeConfig};

/// Partitions of a new store: the log's own bound.
pub const PARTITIONS: RangeInclusive<u64> = 1..=palisade_log::MAX_PARTITIONS as u64;
/// How far ahead a writer's HLC may be. uhlc asserts below 2^32 s; past an
/// hour the bound no longer protects the store's clock from a writer's.
/// 0 accepts no HLC ahead of the store's clock.
pub const MAX_DRIFT_MS: RangeInclusive<u64> = 0..=3_600_000;
/// Request body: below 1 KiB ordinary events are refused; above the codec's
/// largest value a batch could be accepted and then not stored.
pub const MAX_BODY_BYTES: RangeInclusive<u64> = 1024..=palisade_core::codec::MAX_VALUE_BYTES as u64;
/// Events per append request (all of them go into one commit round).
pub const MAX_BATCH_EVENTS: RangeInclusive<u64> = 1..=100_000;
/// Twin snapshot period: a time-travel read replays up to this many events.
pub const SNAPSHOT_EVERY: RangeInclusive<u64> = 1..=1_000_000;
/// Refusal journal entries kept per partition (decision 0024).
pub const REFUSALS_PER_PARTITION: RangeInclusive<u64> = 1..=10_000_000;
/// Delivered outbox entries kept per partition.
pub const OUTBOX_KEEP_DELIVERED: RangeInclusive<u64> = 0..=100_000_000;
/// Outbox delivery tries per effect.
pub const OUTBOX_MAX_ATTEMPTS: RangeInclusive<u64> = 1..=1_000;
/// Outbox waits and timeouts, in milliseconds (up to an hour).
pub const OUTBOX_BACKOFF_MS: RangeInclusive<u64> = 1..=3_600_000;
/// sled's page cache in MiB: sled panics below 256 bytes, and the value is
/// shifted into bytes (1 TiB leaves room in a u64).
pub const CACHE_MB: RangeInclusive<u64> = 1..=1 << 20;
/// Client connections open at once, overall and per IP address (a per-IP
/// budget above the overall cap is simply never reached).
pub const MAX_CONNECTIONS: RangeInclusive<u64> = 1..=1_000_000;
/// Header, body and idle timeouts: 100 ms to a day.
pub const TIMEOUT_MS: RangeInclusive<u64> = 100..=86_400_000;
/// A Kafka record's value (one event): as for a request body.
pub const KAFKA_MAX_RECORD_BYTES: RangeInclusive<u64> = MAX_BODY_BYTES;
/// `--kafka-setting` entries.
pub const MAX_KAFKA_SETTINGS: usize = 100;
/// `--etcd-endpoints` entries.
pub const MAX_ETCD_ENDPOINTS: usize = 64;
/// Longest free-form string setting (broker lists, URLs, prefixes), in bytes.
pub const MAX_TEXT_BYTES: usize = 4096;

/// librdkafka settings Palisade sets itself: its exactly-once ingestion,
/// `acks=all` acknowledgements and partitioning depend on them (or they have
/// their own flag), so `--kafka-setting` may not override them.
pub const RESERVED_KAFKA_SETTINGS: [&str; 12] = [
    "bootstrap.servers",
    "metadata.broker.list",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "enable.partition.eof",
    "partition.assignment.strategy",
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "partitioner",
];

/// The value parser of a numeric setting in `range`.
pub fn parser<T>(range: RangeInclusive<u64>) -> RangedU64ValueParser<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
    <T as TryFrom<u64>>::Error: std::fmt::Display,
{
    RangedU64ValueParser::<T>::new().range(range)
}

/// A non-empty string of at most [`MAX_TEXT_BYTES`] without control
/// characters (they would end up in logs, headers and librdkafka).
pub fn text(v: &str) -> Result<String, String> {
    if v.trim().is_empty() {
        return Err("must not be empty".into());
    }
    if v.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "must be at most {MAX_TEXT_BYTES} bytes, got {}",
            v.len()
        ));
    }
    if v.chars().any(char::is_control) {
        return Err("must not contain control characters".into());
    }
    Ok(v.to_owned())
}

/// The data folder: any non-empty path.
pub fn folder(v: &str) -> Result<std::path::PathBuf, String> {
    if v.is_empty() {
        return Err("must not be empty".into());
    }
    Ok(v.into())
}

/// Kafka's rule for topic names: 1..=249 of `A-Z a-z 0-9 . _ -`, not `.` or `..`.
pub fn topic(v: &str) -> Result<String, String> {
    let ok = !v.is_empty()
        && v.len() <= 249
        && v != "."
        && v != ".."
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if ok {
        return Ok(v.to_owned());
    }
    Err("must be a Kafka topic name (1 to 249 of A-Z a-z 0-9 . _ -, not \".\" or \"..\")".into())
}

/// An `http://` or `https://` URL with a host, for other nodes and clients.
pub fn url(v: &str) -> Result<String, String> {
    text(v)?;
    let host = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"));
    match host {
        Some(rest) if !rest.is_empty() && !rest.starts_with('/') && !rest.contains(' ') => {
            Ok(v.to_owned())
        }
        _ => Err("must be an http:// or https:// URL with a host".into()),
    }
}

/// An etcd member: `host:port` or an `http://` or `https://` URL.
pub fn etcd_endpoint(v: &str) -> Result<String, String> {
    text(v)?;
    if v.contains(char::is_whitespace)
        || v.split_once("://")
            .is_some_and(|(s, _)| s != "http" && s != "https")
    {
        return Err("must be host:port or an http:// or https:// URL".into());
    }
    Ok(v.to_owned())
}

/// A cluster node id: it names the node in Kafka headers, etcd values and logs.
pub fn node_id(v: &str) -> Result<String, String> {
    if v.is_empty()
        || v.len() > 128
        || !v
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err("must be 1 to 128 of A-Z a-z 0-9 - _ .".into());
    }
    Ok(v.to_owned())
}

/// One `--kafka-setting KEY=VALUE`: its form, reserved keys, and
/// librdkafka's own check of the name and value (`rd_kafka_conf_set`, no
/// connection), so a misspelt or malformed setting is refused here rather
/// than after the store opened.
pub fn kafka_setting(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("empty key in {s:?}"));
    }
    text(k).map_err(|e| format!("the key {k:?} {e}"))?;
    if v.len() > MAX_TEXT_BYTES || v.chars().any(char::is_control) {
        return Err(format!(
            "the value of {k:?} must be at most {MAX_TEXT_BYTES} bytes without control characters"
        ));
    }
    if RESERVED_KAFKA_SETTINGS.contains(&k) {
        return Err(format!(
            "{k:?} is set by Palisade itself and cannot be overridden \
             (brokers: --kafka-brokers, group: --kafka-group)"
        ));
    }
    if let Err(e) = rdkafka::ClientConfig::new()
        .set(k, v)
        .create_native_config()
    {
        let why = match e {
            rdkafka::error::KafkaError::ClientConfig(_, desc, _, _) => desc,
            other => other.to_string(),
        };
        return Err(format!("librdkafka refuses {k}={v}: {why}"));
    }
    Ok((k.to_owned(), v.to_owned()))
}

/// The rules that span values (each value alone passed its parser).
pub fn check(c: &ServeConfig) -> Result<(), ConfigError> {
    if let Some(t) = &c.kafka_dead_letter_topic {
        if *t == c.kafka_topic {
            // The ingester would read its own dead letters back, forever.
            return Err(ConfigError::invalid(
                "kafka_dead_letter_topic",
                format!("must differ from kafka_topic ({t:?})"),
            ));
        }
    }
    if c.kafka_settings.len() > MAX_KAFKA_SETTINGS {
        return Err(ConfigError::invalid(
            "kafka_settings",
            format!(
                "takes at most {MAX_KAFKA_SETTINGS} entries, got {}",
                c.kafka_settings.len()
            ),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (k, _) in &c.kafka_settings {
        if !seen.insert(k.as_str()) {
            return Err(ConfigError::invalid(
                "kafka_settings",
                format!("{k:?} is given twice"),
            ));
        }
    }
    if c.etcd_endpoints.len() > MAX_ETCD_ENDPOINTS {
        return Err(ConfigError::invalid(
            "etcd_endpoints",
            format!(
                "takes at most {MAX_ETCD_ENDPOINTS} endpoints, got {}",
                c.etcd_endpoints.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};

    fn parse(args: &[&str]) -> Result<ServeConfig, String> {
        let mut argv = vec!["serve"];
        argv.extend(args);
        // No variable of the test's environment may leak in.
        let m = ServeConfig::augment_args(clap::Command::new("serve"))
            .mut_args(|a| a.env(None))
            .try_get_matches_from(argv)
            .map_err(|e| e.to_string())?;
        ServeConfig::from_arg_matches(&m).map_err(|e| e.to_string())
    }

    fn config(args: &[&str]) -> ServeConfig {
        parse(args).unwrap()
    }

    #[test]
    fn the_defaults_are_valid() {
        check(&config(&[])).unwrap();
    }

    /// Every value passes through clap (a config file's too: file.rs), so
    /// each rule is one value parser; the message names the flag, the rule
    /// and the value.
    #[test]
    fn bad_values_are_refused_naming_the_flag_and_the_rule() {
        let cases: [(&str, &str, &str); 27] = [
            ("--partitions", "0", "0 is not in 1..=1024"),
            ("--max-drift-ms", "4294967296000", "not in 0..=3600000"),
            ("--cache-mb", "0", "not in 1..=1048576"),
            ("--cache-mb", "18446744073709551615", "not in 1..=1048576"),
            ("--max-body-bytes", "10", "not in 1024..="),
            ("--max-batch-events", "0", "not in 1..=100000"),
            ("--snapshot-every", "0", "not in 1..=1000000"),
            ("--kafka-max-record-bytes", "0", "not in 1024..="),
            ("--kafka-topic", "a b", "Kafka topic name"),
            ("--kafka-topic", "..", "Kafka topic name"),
            ("--kafka-group", "", "must not be empty"),
            ("--kafka-brokers", " ", "must not be empty"),
            ("--kafka-brokers", "a\u{7}b", "control characters"),
            (
                "--kafka-setting",
                "group.id=x",
                "\"group.id\" is set by Palisade",
            ),
            (
                "--kafka-setting",
                "fetch.wiat.max.ms=5",
                "librdkafka refuses fetch.wiat.max.ms=5",
            ),
            (
                "--kafka-setting",
                "session.timeout.ms=soon",
                "librdkafka refuses",
            ),
            ("--kafka-setting", "linger.ms", "expected KEY=VALUE"),
            ("--etcd-endpoints", "ftp://x:1", "host:port or an http://"),
            ("--etcd-prefix", "", "must not be empty"),
            (
                "--cluster-advertise",
                "node-1:7070",
                "http:// or https:// URL",
            ),
            ("--cluster-node", "a b", "1 to 128 of"),
            ("--data", "", "must not be empty"),
            ("--max-connections", "0", "not in 1..=1000000"),
            ("--max-connections-per-ip", "0", "not in 1..=1000000"),
            ("--header-timeout-ms", "99", "not in 100..=86400000"),
            ("--body-timeout-ms", "86400001", "not in 100..=86400000"),
            ("--idle-timeout-ms", "0", "not in 100..=86400000"),
        ];
        for (flag, bad, want) in cases {
            let e = parse(&[&format!("{flag}={bad}")]).unwrap_err();
            assert!(
                e.contains(flag) && e.contains(want),
                "{flag}={bad:?}: {e:?} should name the flag and contain {want:?}"
            );
        }
    }

    #[test]
    fn rules_across_values_are_named() {
        let cases: [(&[&str], &str); 4] = [
            (
                &["--kafka-dead-letter-topic", "twin-events"],
                "kafka_dead_letter_topic (--kafka-dead-letter-topic): must differ",
            ),
            (
                &[
                    "--kafka-setting",
                    "linger.ms=5",
                    "--kafka-setting",
                    "linger.ms=6",
                ],
                "kafka_settings (--kafka-setting): \"linger.ms\" is given twice",
            ),
            (
                &["--kafka-setting", &too_many_settings()],
                "at most 100 entries",
            ),
            (
                &["--etcd-endpoints", &too_many_endpoints()],
                "at most 64 endpoints",
            ),
        ];
        for (args, want) in cases {
            let e = check(&config(args)).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e:?} should contain {want:?}");
        }
    }

    fn too_many_settings() -> String {
        (0..=MAX_KAFKA_SETTINGS)
            .map(|i| format!("client.id=c{i}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn too_many_endpoints() -> String {
        (0..=MAX_ETCD_ENDPOINTS)
            .map(|i| format!("http://127.0.0.1:{}", 2000 + i))
            .collect::<Vec<_>>()
            .join(",")
    }

    #[test]
    fn the_bounds_themselves_are_accepted() {
        let c = config(&[
            "--partitions=1024",
            "--max-drift-ms=3600000",
            "--cache-mb=1",
            "--max-body-bytes=1024",
            "--kafka-dead-letter-topic=twin-events.dead",
            "--kafka-setting=session.timeout.ms=6000",
            "--kafka-setting=socket.keepalive.enable=true",
            "--etcd-endpoints=http://127.0.0.1:2379,etcd-2:2379",
            "--cluster-advertise=https://node-1.example:7070",
        ]);
        check(&c).unwrap();
        assert_eq!(c.partitions, Some(1024));
        assert_eq!(c.etcd_endpoints.len(), 2);
    }
}
