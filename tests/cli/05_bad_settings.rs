//! Issue 18, item 3: a bad setting is refused with a clear message, never a
//! panic, and before anything touches the disk. `--max-drift-ms
//! 4294967296000` used to panic in uhlc (rc 101) after creating the data
//! folder, and `config check` accepted it; `--cache-mb 0` panicked in sled.
//!
//! Every case runs through every way a setting arrives: a `serve` flag, a
//! `PALISADE_*` variable (`serve` and `config check`) and a config file
//! (`serve --config` and `config check --config`); a file's values go
//! through the same clap parsers as flags (config/file.rs), so each case
//! also checks that the file layer names the key it refuses.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::palisade;

/// One bad value of one setting.
struct Case {
    /// The file key; the flag is `--` + it with dashes, the variable
    /// `PALISADE_` + it upper-cased.
    key: &'static str,
    /// As a flag or variable value.
    value: &'static str,
    /// The file's text, when it is not `key = value` (strings are quoted).
    toml: Option<&'static str>,
    /// What the message must say besides the key: the range or the rule.
    want: &'static str,
}

const fn case(key: &'static str, value: &'static str, want: &'static str) -> Case {
    Case {
        key,
        value,
        toml: None,
        want,
    }
}

fn cases() -> Vec<Case> {
    vec![
        case("partitions", "0", "1..=1024"),
        case("partitions", "1025", "1..=1024"),
        case("max_drift_ms", "4294967296000", "0..=3600000"),
        case("max_drift_ms", "3600001", "0..=3600000"),
        case("max_body_bytes", "100", "1024..=67108864"),
        case("max_body_bytes", "1000000000", "1024..=67108864"),
        case("max_batch_events", "0", "1..=100000"),
        case("max_batch_events", "100001", "1..=100000"),
        case("snapshot_every", "0", "1..=1000000"),
        case("cache_mb", "0", "1..=1048576"),
        // 2^44 MiB is 2^64 bytes: it used to overflow the shift into bytes.
        case("cache_mb", "17592186044416", "1..=1048576"),
        case("max_connections", "0", "1..=1000000"),
        case("max_connections_per_ip", "1000001", "1..=1000000"),
        case("header_timeout_ms", "0", "100..=86400000"),
        case("partition_snapshot_interval_ms", "5", "100..=86400000"),
        case("body_timeout_ms", "99", "100..=86400000"),
        case("idle_timeout_ms", "86400001", "100..=86400000"),
        case("kafka_max_record_bytes", "0", "1024..=67108864"),
        case("kafka_topic", "twin events", "Kafka topic name"),
        case("kafka_topic", "..", "Kafka topic name"),
        case("kafka_dead_letter_topic", "twin-events", "must differ"),
        case(
            "kafka_dead_letter_topic",
            "dead/letters",
            "Kafka topic name",
        ),
        case("kafka_group", "grp\tone", "control characters"),
        case("kafka_brokers", "  ", "must not be empty"),
        Case {
            key: "kafka_settings",
            value: "group.id=other",
            toml: Some("[kafka_settings]\n\"group.id\" = \"other\"\n"),
            want: "set by Palisade",
        },
        Case {
            key: "kafka_settings",
            value: "fetch.wiat.max.ms=5",
            toml: Some("[kafka_settings]\n\"fetch.wiat.max.ms\" = \"5\"\n"),
            want: "No such configuration property",
        },
        Case {
            key: "kafka_settings",
            value: "session.timeout.ms=soon",
            toml: Some("[kafka_settings]\n\"session.timeout.ms\" = \"soon\"\n"),
            want: "librdkafka refuses session.timeout.ms=soon",
        },
        Case {
            key: "etcd_endpoints",
            value: "ftp://etcd:2379",
            toml: Some("etcd_endpoints = [\"ftp://etcd:2379\"]\n"),
            want: "http:// or https://",
        },
        Case {
            key: "etcd_prefix",
            value: "/pal\u{1}isade/",
            toml: Some("etcd_prefix = \"/pal\\u0001isade/\"\n"),
            want: "control characters",
        },
        case(
            "cluster_advertise",
            "node-1:7070",
            "http:// or https:// URL",
        ),
    ]
}

/// A run that must be refused: exit code, stdout, stderr.
struct Refused {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Run `cmd` to completion; a `serve` that starts anyway (its first stdout
/// line says it listens) is killed at once and reported as such.
fn refused(mut cmd: Command) -> Refused {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn palisade");
    let (tx, rx) = std::sync::mpsc::channel();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut first = [0u8; 1];
        // One byte is enough to know something was printed (a refused
        // start prints nothing on stdout); the rest follows after the kill.
        let n = stdout.read(&mut first).unwrap_or(0);
        if n > 0 {
            let _ = tx.send(());
        }
        let mut rest = Vec::new();
        let _ = stdout.read_to_end(&mut rest);
        let mut all = first[..n].to_vec();
        all.extend(rest);
        String::from_utf8_lossy(&all).into_owned()
    });
    let until = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if rx.try_recv().is_ok() || Instant::now() > until {
            // Printed something (its listening line) or hangs: it started.
            std::thread::sleep(Duration::from_millis(200));
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = reader.join().unwrap();
    Refused {
        // Killed by a signal (ours) reads as -1: "did not exit by itself".
        code: out.status.code().unwrap_or(-1),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn flag(key: &str) -> String {
    match key {
        "kafka_settings" => "--kafka-setting".to_owned(),
        _ => format!("--{}", key.replace('_', "-")),
    }
}

fn env_var(key: &str) -> String {
    format!("PALISADE_{}", key.to_uppercase())
}

fn toml_of(c: &Case) -> String {
    match c.toml {
        Some(t) => t.to_owned(),
        None if c.value.parse::<u64>().is_ok() => format!("{} = {}\n", c.key, c.value),
        None => format!("{} = {:?}\n", c.key, c.value),
    }
}

fn serve(data: &Path) -> Command {
    let mut cmd = palisade();
    cmd.arg("serve")
        .arg("--data")
        .arg(data)
        .args(["--listen", "127.0.0.1:0"]);
    cmd
}

#[test]
fn every_bad_setting_is_refused_before_the_disk_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let file = dir.path().join(format!("case-{i}.toml"));
        std::fs::write(&file, toml_of(c)).unwrap();
        let data = |j: usize| dir.path().join(format!("data-{i}-{j}"));
        let ways: Vec<(&str, Command)> = vec![
            ("serve flag", {
                let mut cmd = serve(&data(0));
                cmd.args([flag(c.key).as_str(), c.value]);
                cmd
            }),
            ("serve env", {
                let mut cmd = serve(&data(1));
                cmd.env(env_var(c.key), c.value);
                cmd
            }),
            ("serve --config", {
                let mut cmd = serve(&data(2));
                cmd.arg("--config").arg(&file);
                cmd
            }),
            ("config check env", {
                let mut cmd = palisade();
                cmd.args(["config", "check"]).env(env_var(c.key), c.value);
                cmd
            }),
            ("config check --config", {
                let mut cmd = palisade();
                cmd.args(["config", "check", "--config"]).arg(&file);
                cmd
            }),
        ];
        for (j, (how, cmd)) in ways.into_iter().enumerate() {
            let r = refused(cmd);
            // (`config check` runs get no folder: data(3) and data(4) stay absent.)
            let created = data(j).exists();
            let what = format!("{} = {:?} via {how}", c.key, c.value);
            let named = r.stderr.contains(c.key) || r.stderr.contains(&flag(c.key));
            let problems = [
                (r.code == 0 || r.code == -1, "was accepted"),
                (r.code == 101, "exit code 101 (a panic)"),
                (r.stderr.contains("panicked"), "panicked"),
                (!named, "message does not name the key"),
                (
                    !r.stderr.contains(c.want),
                    "message lacks the range or rule",
                ),
                (created, "the data folder was created"),
                (r.stdout.contains("listening"), "the store started"),
            ];
            for (bad, why) in problems {
                if bad {
                    failures.push(format!(
                        "{what}: {why} (exit {}); stderr: {}",
                        r.code,
                        r.stderr.trim()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `kafka_strict_partitioning` is a switch: `--kafka-strict-partitioning`
/// takes no value, but its variable and the file's key do, and anything but
/// a boolean there is refused (clap's default for a switch's variable reads
/// any unknown word as true, which would turn strict mode on by a typo).
#[test]
fn a_bad_strict_partitioning_value_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("strict.toml");
    std::fs::write(&file, "kafka_strict_partitioning = \"maybe\"\n").unwrap();
    let key = "kafka_strict_partitioning";
    let ways: Vec<(&str, Command)> = vec![
        ("serve env", {
            let mut cmd = serve(&dir.path().join("data-env"));
            cmd.env(env_var(key), "maybe");
            cmd
        }),
        ("config check env", {
            let mut cmd = palisade();
            cmd.args(["config", "check"]).env(env_var(key), "maybe");
            cmd
        }),
        ("serve --config", {
            let mut cmd = serve(&dir.path().join("data-file"));
            cmd.arg("--config").arg(&file);
            cmd
        }),
    ];
    for (how, cmd) in ways {
        let r = refused(cmd);
        assert!(
            r.code != 0 && r.code != -1 && r.code != 101,
            "{how}: exit {}",
            r.code
        );
        assert!(
            r.stderr.contains(key) || r.stderr.contains(&flag(key)),
            "{how}: {}",
            r.stderr
        );
        assert!(!r.stdout.contains("listening"), "{how}: started");
    }
    assert!(!dir.path().join("data-env").exists());
    assert!(!dir.path().join("data-file").exists());
    // The accepted spellings.
    for v in ["true", "false", "yes", "off", "1"] {
        let out = palisade()
            .args(["config", "check"])
            .env(env_var(key), v)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{v}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Values the range checks let through leave no room for a panic later:
/// the smallest cache and body, the largest drift and snapshot period.
#[test]
fn the_bounds_themselves_start_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let server = crate::try_serve(
        &mut palisade(),
        &dir.path().join("data"),
        "127.0.0.1:0",
        &[
            "--cache-mb",
            "1",
            "--max-drift-ms",
            "3600000",
            "--max-body-bytes",
            "1024",
            "--max-batch-events",
            "100000",
            "--snapshot-every",
            "1000000",
            "--partitions",
            "1",
        ],
    )
    .expect("serve at the bounds");
    let (_, token) = crate::acquire(&server.base, "twin/edge", "h");
    crate::append(&server.base, "edge", token, "e-1", r#"{"a":1}"#);
    server.terminate();
}

/// The security file's limits are checked by `serve` and `config check`
/// alike, before the store opens (a rate of 1e-300 a second made the
/// `Retry-After` computation panic on the second request).
#[test]
fn bad_security_limits_are_refused_before_the_disk_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (limits, want)) in [
        (
            "requests_per_second = 1e-300\n",
            "limits.requests_per_second must be 0 (no limit) or 0.001..=1000000, got 1e-300",
        ),
        (
            "requests_per_second = 10.0\nburst = 0\n",
            "limits.burst must be 1..=1000000, got 0",
        ),
        (
            "max_patch_bytes = 1\n",
            "limits.max_patch_bytes must be 2..=67108864, got 1",
        ),
        (
            "max_leases_per_principal = 10000000\n",
            "limits.max_leases_per_principal must be 0..=1000000, got 10000000",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let file = dir.path().join(format!("security-{i}.toml"));
        std::fs::write(&file, format!("[limits]\n{limits}")).unwrap();
        let data = dir.path().join(format!("data-{i}"));
        let mut serve = serve(&data);
        serve.arg("--security").arg(&file);
        let mut check = palisade();
        check
            .args(["config", "check"])
            .env("PALISADE_SECURITY", &file);
        for (how, cmd) in [("serve", serve), ("config check", check)] {
            let r = refused(cmd);
            assert!(
                r.code != 0 && r.code != -1 && r.code != 101,
                "{limits:?} via {how}: exit {}; {}",
                r.code,
                r.stderr
            );
            assert!(!r.stderr.contains("panicked"), "{how}: {}", r.stderr);
            assert!(r.stderr.contains(want), "{how}: {}", r.stderr);
            assert!(!data.exists(), "{how} created the data folder");
        }
    }
}
