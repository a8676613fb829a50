//! What every `palisade serve` setting accepts (issue 18: a bad setting used
//! to panic in uhlc or sled after the data folder was created).
//!
//! One table of ranges serves clap's parsers (flags and `PALISADE_*`
//! variables) and [`check`], which [`ServeConfig::validate`] runs again
//! because a config file's values never pass through clap. Both run before
//! anything touches the disk. Messages name the key (as in the file and as
//! a flag), the accepted range and the value.

use std::ops::RangeInclusive;

use clap::builder::RangedU64ValueParser;

use super::ServeConfig;

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

/// clap's parser for a numeric flag in `range`.
pub fn parser<T>(range: RangeInclusive<u64>) -> RangedU64ValueParser<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
    <T as TryFrom<u64>>::Error: std::fmt::Display,
{
    RangedU64ValueParser::<T>::new().range(range)
}

/// `key (--flag)`: how a setting is named in messages, as in the file and
/// on the command line.
fn name(key: &str) -> String {
    let flag = match key {
        // The one repeatable flag named in the singular.
        "kafka_settings" => "kafka-setting".to_owned(),
        _ => key.replace('_', "-"),
    };
    format!("{key} (--{flag})")
}

fn in_range(key: &str, v: u64, r: &RangeInclusive<u64>, unit: &str) -> Result<(), String> {
    if r.contains(&v) {
        return Ok(());
    }
    Err(format!(
        "{} must be {}..={}{unit}, got {v}",
        name(key),
        r.start(),
        r.end()
    ))
}

fn as_u64(v: usize) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// A non-empty string of at most [`MAX_TEXT_BYTES`] without control
/// characters (they would end up in logs, headers and librdkafka).
fn text(key: &str, v: &str) -> Result<(), String> {
    if v.trim().is_empty() {
        return Err(format!("{} must not be empty", name(key)));
    }
    if v.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "{} must be at most {MAX_TEXT_BYTES} bytes, got {}",
            name(key),
            v.len()
        ));
    }
    if v.chars().any(char::is_control) {
        return Err(format!(
            "{} must not contain control characters, got {v:?}",
            name(key)
        ));
    }
    Ok(())
}

/// Kafka's rule for topic names: 1..=249 of `A-Z a-z 0-9 . _ -`, not `.` or `..`.
fn topic(key: &str, v: &str) -> Result<(), String> {
    let ok = !v.is_empty()
        && v.len() <= 249
        && v != "."
        && v != ".."
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if ok {
        return Ok(());
    }
    Err(format!(
        "{} must be a Kafka topic name (1 to 249 of A-Z a-z 0-9 . _ -, not \".\" or \"..\"), got {v:?}",
        name(key)
    ))
}

/// An `http://` or `https://` URL with a host, for other nodes and clients.
fn url(key: &str, v: &str) -> Result<(), String> {
    text(key, v)?;
    let host = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"));
    match host {
        Some(rest) if !rest.is_empty() && !rest.starts_with('/') && !rest.contains(' ') => Ok(()),
        _ => Err(format!(
            "{} must be an http:// or https:// URL with a host, got {v:?}",
            name(key)
        )),
    }
}

/// Every rule of one setting at a time; the first broken one is reported.
pub fn check(c: &ServeConfig) -> Result<(), String> {
    if c.data.as_os_str().is_empty() {
        return Err(format!("{} must not be empty", name("data")));
    }
    if let Some(p) = c.partitions {
        in_range("partitions", p.into(), &PARTITIONS, "")?;
    }
    in_range("max_drift_ms", c.max_drift_ms, &MAX_DRIFT_MS, " ms")?;
    in_range(
        "max_body_bytes",
        as_u64(c.max_body_bytes),
        &MAX_BODY_BYTES,
        " bytes",
    )?;
    in_range(
        "max_batch_events",
        as_u64(c.max_batch_events),
        &MAX_BATCH_EVENTS,
        "",
    )?;
    in_range(
        "snapshot_every",
        c.snapshot_every,
        &SNAPSHOT_EVERY,
        " events",
    )?;
    in_range("cache_mb", c.cache_mb, &CACHE_MB, " MiB")?;
    in_range(
        "max_connections",
        as_u64(c.max_connections),
        &MAX_CONNECTIONS,
        "",
    )?;
    in_range(
        "max_connections_per_ip",
        as_u64(c.max_connections_per_ip),
        &MAX_CONNECTIONS,
        "",
    )?;
    in_range("header_timeout_ms", c.header_timeout_ms, &TIMEOUT_MS, " ms")?;
    in_range("body_timeout_ms", c.body_timeout_ms, &TIMEOUT_MS, " ms")?;
    in_range("idle_timeout_ms", c.idle_timeout_ms, &TIMEOUT_MS, " ms")?;
    if let Some(b) = &c.kafka_brokers {
        text("kafka_brokers", b)?;
    }
    topic("kafka_topic", &c.kafka_topic)?;
    text("kafka_group", &c.kafka_group)?;
    if let Some(t) = &c.kafka_dead_letter_topic {
        topic("kafka_dead_letter_topic", t)?;
        if *t == c.kafka_topic {
            // The ingester would read its own dead letters back, forever.
            return Err(format!(
                "{} must differ from kafka_topic ({t:?})",
                name("kafka_dead_letter_topic")
            ));
        }
    }
    in_range(
        "kafka_max_record_bytes",
        as_u64(c.kafka_max_record_bytes),
        &KAFKA_MAX_RECORD_BYTES,
        " bytes",
    )?;
    kafka_settings(&c.kafka_settings)?;
    if c.etcd_endpoints.len() > MAX_ETCD_ENDPOINTS {
        return Err(format!(
            "{} takes at most {MAX_ETCD_ENDPOINTS} endpoints, got {}",
            name("etcd_endpoints"),
            c.etcd_endpoints.len()
        ));
    }
    for e in &c.etcd_endpoints {
        text("etcd_endpoints", e)?;
        if e.contains(char::is_whitespace)
            || e.split_once("://")
                .is_some_and(|(s, _)| s != "http" && s != "https")
        {
            return Err(format!(
                "{} must be host:port or an http:// or https:// URL, got {e:?}",
                name("etcd_endpoints")
            ));
        }
    }
    text("etcd_prefix", &c.etcd_prefix)?;
    if let Some(u) = &c.cluster_advertise {
        url("cluster_advertise", u)?;
    }
    Ok(())
}

/// Count, reserved keys, duplicates, and librdkafka's own check of each
/// name and value (`rd_kafka_conf_set`, no connection), so a misspelt or
/// malformed setting is refused here rather than after the store opened.
fn kafka_settings(settings: &[(String, String)]) -> Result<(), String> {
    let key = name("kafka_settings");
    if settings.len() > MAX_KAFKA_SETTINGS {
        return Err(format!(
            "{key} takes at most {MAX_KAFKA_SETTINGS} entries, got {}",
            settings.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (k, v) in settings {
        text("kafka_settings", k)?;
        if v.len() > MAX_TEXT_BYTES || v.chars().any(char::is_control) {
            return Err(format!(
                "{key}: the value of {k:?} must be at most {MAX_TEXT_BYTES} bytes without control characters"
            ));
        }
        if RESERVED_KAFKA_SETTINGS.contains(&k.as_str()) {
            return Err(format!(
                "{key}: {k:?} is set by Palisade itself and cannot be overridden \
                 (brokers: --kafka-brokers, group: --kafka-group)"
            ));
        }
        if !seen.insert(k.as_str()) {
            return Err(format!("{key}: {k:?} is given twice"));
        }
        if let Err(e) = rdkafka::ClientConfig::new()
            .set(k, v)
            .create_native_config()
        {
            let why = match e {
                rdkafka::error::KafkaError::ClientConfig(_, desc, _, _) => desc,
                other => other.to_string(),
            };
            return Err(format!("{key}: librdkafka refuses {k}={v}: {why}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};

    fn config(args: &[&str]) -> ServeConfig {
        let mut argv = vec!["serve"];
        argv.extend(args);
        let m = ServeConfig::augment_args(clap::Command::new("serve"))
            .try_get_matches_from(argv)
            .unwrap();
        ServeConfig::from_arg_matches(&m).unwrap()
    }

    #[test]
    fn the_defaults_are_valid() {
        check(&config(&[])).unwrap();
    }

    /// One bad value set on a valid config.
    type Change = fn(&mut ServeConfig);

    /// Values that skip clap (a config file's) are checked all the same.
    #[test]
    fn out_of_range_values_are_named_with_their_range() {
        let cases: [(Change, &str); 27] = [
            (
                |c| c.partitions = Some(0),
                "partitions (--partitions) must be 1..=1024, got 0",
            ),
            (
                |c| c.max_drift_ms = 4_294_967_296_000,
                "max_drift_ms (--max-drift-ms) must be 0..=3600000 ms, got 4294967296000",
            ),
            (
                |c| c.cache_mb = 0,
                "cache_mb (--cache-mb) must be 1..=1048576 MiB, got 0",
            ),
            (|c| c.cache_mb = u64::MAX, "got 18446744073709551615"),
            (
                |c| c.max_body_bytes = 10,
                "max_body_bytes (--max-body-bytes) must be 1024..=",
            ),
            (|c| c.max_batch_events = 0, "max_batch_events"),
            (|c| c.snapshot_every = 0, "snapshot_every"),
            (|c| c.kafka_max_record_bytes = 0, "kafka_max_record_bytes"),
            (|c| c.kafka_topic = "a b".into(), "kafka_topic"),
            (|c| c.kafka_topic = "..".into(), "kafka_topic"),
            (
                |c| c.kafka_dead_letter_topic = Some("twin-events".into()),
                "must differ",
            ),
            (|c| c.kafka_group = String::new(), "kafka_group"),
            (|c| c.kafka_brokers = Some(" ".into()), "kafka_brokers"),
            (
                |c| c.kafka_settings = vec![("group.id".into(), "x".into())],
                "kafka_settings (--kafka-setting): \"group.id\" is set by Palisade",
            ),
            (
                |c| c.kafka_settings = vec![("fetch.wiat.max.ms".into(), "5".into())],
                "librdkafka refuses fetch.wiat.max.ms=5",
            ),
            (
                |c| c.kafka_settings = vec![("session.timeout.ms".into(), "soon".into())],
                "librdkafka refuses",
            ),
            (
                |c| c.kafka_settings = vec![("linger.ms".into(), "5".into()); 2],
                "given twice",
            ),
            (
                |c| {
                    c.kafka_settings = (0..=MAX_KAFKA_SETTINGS)
                        .map(|i| (format!("k{i}"), "v".into()))
                        .collect();
                },
                "at most 100 entries",
            ),
            (
                |c| c.etcd_endpoints = vec!["ftp://x:1".into()],
                "etcd_endpoints",
            ),
            (|c| c.etcd_prefix = String::new(), "etcd_prefix"),
            (
                |c| c.cluster_advertise = Some("node-1:7070".into()),
                "cluster_advertise",
            ),
            (|c| c.data = "".into(), "data (--data) must not be empty"),
            (
                |c| c.max_connections = 0,
                "max_connections (--max-connections) must be 1..=1000000, got 0",
            ),
            (
                |c| c.max_connections_per_ip = 0,
                "max_connections_per_ip (--max-connections-per-ip) must be 1..=1000000, got 0",
            ),
            (
                |c| c.header_timeout_ms = 99,
                "header_timeout_ms (--header-timeout-ms) must be 100..=86400000 ms, got 99",
            ),
            (
                |c| c.body_timeout_ms = 86_400_001,
                "body_timeout_ms (--body-timeout-ms) must be 100..=86400000 ms",
            ),
            (|c| c.idle_timeout_ms = 0, "idle_timeout_ms"),
        ];
        for (set, want) in cases {
            let mut c = config(&[]);
            set(&mut c);
            let e = check(&c).unwrap_err();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
    }

    #[test]
    fn the_bounds_themselves_are_accepted() {
        let mut c = config(&[]);
        c.partitions = Some(1024);
        c.max_drift_ms = 3_600_000;
        c.cache_mb = 1;
        c.max_body_bytes = 1024;
        c.kafka_dead_letter_topic = Some("twin-events.dead".into());
        c.kafka_settings = vec![
            ("session.timeout.ms".into(), "6000".into()),
            ("socket.keepalive.enable".into(), "true".into()),
        ];
        c.etcd_endpoints = vec!["http://127.0.0.1:2379".into(), "etcd-2:2379".into()];
        c.cluster_advertise = Some("https://node-1.example:7070".into());
        check(&c).unwrap();
    }

    #[test]
    fn clap_refuses_flags_out_of_range_with_the_range() {
        let cmd = || ServeConfig::augment_args(clap::Command::new("serve"));
        for (flag, bad, range) in [
            ("--max-drift-ms", "4294967296000", "0..=3600000"),
            ("--cache-mb", "0", "1..=1048576"),
            ("--partitions", "0", "1..=1024"),
            ("--max-batch-events", "0", "1..=100000"),
        ] {
            let e = cmd()
                .try_get_matches_from(["serve", flag, bad])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(flag) && e.contains(bad) && e.contains(range),
                "{e}"
            );
        }
    }
}
