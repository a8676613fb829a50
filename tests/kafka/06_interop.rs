//! Records produced by other Kafka clients are ingested: `kcat` (Debian's
//! package) with JSON values, and Python's confluent-kafka. Both must use
//! `partitioner=murmur2_random` (docs/kafka.md).
//!
//! A missing tool fails the test when `CI` is set (README.md has the install
//! commands) and is skipped with a loud notice otherwise, hence the
//! `_when_installed` names.
//!
//! Debian's kcat (librdkafka 2.0.2) cannot talk to tansu 0.6.0
//! (docs/kafka-brokers.md): against tansu the kcat test loads the newer
//! librdkafka bundled in confluent-kafka's wheel through `LD_LIBRARY_PATH`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::broker::{broker, TestTopic};
use crate::{event_ids, history, partition_of, serve, twin_token, wait_handled};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.trim().is_empty())
}

/// Fail in CI, skip loudly elsewhere. Returns whether to skip.
pub(crate) fn missing(what: &str, install: &str) -> bool {
    let msg = format!(
        "{what} is not available. Install it with:\n{install}\n(see tests/kafka/README.md)"
    );
    assert!(!in_ci(), "CI is set, so the interop test must run: {msg}");
    eprintln!("\n******** SKIPPED: {msg}\n******** (this fails when CI is set)\n");
    true
}

fn home_cache() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/palisade")
}

/// `librdkafka X.Y.Z` from `kcat -V` run with `ld_path`.
fn kcat_librdkafka(ld_path: Option<&Path>) -> Option<(u32, u32)> {
    let mut cmd = Command::new("kcat");
    cmd.arg("-V");
    if let Some(p) = ld_path {
        cmd.env("LD_LIBRARY_PATH", p);
    }
    let out = cmd.output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = text.split("librdkafka ").nth(1)?;
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

const KCAT_INSTALL: &str = "  apt-get install -y kcat";
const KCAT_TANSU_INSTALL: &str = "  python3 -m venv ~/.cache/palisade/venv
  ~/.cache/palisade/venv/bin/pip install confluent-kafka
  mkdir -p ~/.cache/palisade/librdkafka-wheel
  ln -sf ~/.cache/palisade/venv/lib/python3.*/site-packages/confluent_kafka.libs/librdkafka-*.so.1 \\
    ~/.cache/palisade/librdkafka-wheel/librdkafka.so.1
  (or set PALISADE_KCAT_LD_LIBRARY_PATH to a folder holding a librdkafka.so.1 >= 2.1)";
pub(crate) const PYTHON_INSTALL: &str = "  pip install confluent-kafka   (for the python3 on PATH)
  or: python3 -m venv ~/.cache/palisade/venv && ~/.cache/palisade/venv/bin/pip install confluent-kafka
  or: set PALISADE_PYTHON to a python that has it";

/// kcat, and the `LD_LIBRARY_PATH` it needs on this broker: `None` when it
/// is missing (the test is skipped, or fails in CI); `Some(None)` when
/// Debian's own librdkafka does.
pub(crate) fn kcat_ld_path() -> Option<Option<PathBuf>> {
    let Some(debian) = kcat_librdkafka(None) else {
        missing("kcat", KCAT_INSTALL);
        return None;
    };
    // Against tansu, kcat needs a librdkafka newer than Debian's 2.0.2.
    Some(if broker().is_tansu() {
        let dir = std::env::var_os("PALISADE_KCAT_LD_LIBRARY_PATH")
            .map_or_else(|| home_cache().join("librdkafka-wheel"), PathBuf::from);
        match kcat_librdkafka(Some(&dir)) {
            Some(v) if v >= (2, 1) => {
                eprintln!(
                    "kcat interop: against tansu with librdkafka {v:?} from {}",
                    dir.display()
                );
                Some(dir)
            }
            other => {
                missing(
                    &format!(
                        "a librdkafka >= 2.1 for kcat (tansu rejects Debian's {debian:?}; {} gives {other:?})",
                        dir.display()
                    ),
                    KCAT_TANSU_INSTALL,
                );
                return None;
            }
        }
    } else {
        None
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interop_kcat_when_installed() {
    let Some(ld_path) = kcat_ld_path() else {
        return;
    };

    let t = TestTopic::new("kcat");
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &t, &[]);
    let c = s.client();
    let twins = ["kcat-pump-1", "kcat-pump-2", "kcat-pump-3"];
    let mut want = 0;
    for twin in twins {
        let (token, _) = twin_token(&c, twin, "kcat").await;
        // One record per line; the second has no event_id (it gets one
        // from its position), the third is a JSON array of two events.
        let lines = [
            json!({ "type": "set", "patch": { "rpm": 1200 }, "event_id": format!("{twin}-a") }),
            json!({ "type": "set", "patch": { "rpm": 1300, "on": true } }),
            json!([
                { "type": "set", "patch": { "rpm": 1400 }, "event_id": format!("{twin}-c1") },
                { "type": "set", "patch": { "temp": 71.5 }, "event_id": format!("{twin}-c2") }
            ]),
        ];
        let mut cmd = Command::new("kcat");
        cmd.args(["-P", "-b", &broker().bootstrap, "-t", &t.topic, "-k", twin])
            .args(["-H", &format!("fencing-token={token}")])
            .args(["-H", "content-type=application/json"])
            .args(["-X", "partitioner=murmur2_random"]);
        if broker().is_tansu() {
            cmd.args(["-X", "batch.num.messages=1"]);
        }
        if let Some(p) = &ld_path {
            cmd.env("LD_LIBRARY_PATH", p);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kcat");
        {
            let mut stdin = child.stdin.take().unwrap();
            for l in &lines {
                writeln!(stdin, "{l}").unwrap();
            }
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kcat failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        want += lines.len() as u64;
    }
    let o = wait_handled(&c, want, Duration::from_secs(60)).await;
    assert_eq!(o["applied"], want, "every kcat record applied: {o:?}");
    for twin in twins {
        let events = history(&c, twin).await;
        let ids = event_ids(&events);
        assert_eq!(ids.len(), 4, "{twin}: {ids:?}");
        assert_eq!(ids[0], format!("{twin}-a"));
        let p = partition_of(twin);
        assert!(
            ids[1].starts_with(&format!("kafka-{p}-")),
            "an event without an id gets kafka-<partition>-<offset>-<i>: {ids:?}"
        );
        assert_eq!(&ids[2..], [format!("{twin}-c1"), format!("{twin}-c2")]);
        let v = c.twin(twin).await;
        assert_eq!(
            v.body["state"],
            json!({ "rpm": 1400, "on": true, "temp": 71.5 })
        );
    }
    s.terminate();
}

/// A python with confluent_kafka: `PALISADE_PYTHON`, else `python3`, else
/// the venv docs/kafka-brokers.md creates.
pub(crate) fn python_with_confluent_kafka() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("PALISADE_PYTHON") {
        candidates.push(p.into());
    }
    candidates.push("python3".into());
    candidates.push(home_cache().join("venv/bin/python3"));
    candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import confluent_kafka"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

const PRODUCER: &str = r#"
import json, sys
from confluent_kafka import Producer

bootstrap, topic, extra, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
conf = {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "acks": "all"}
conf.update(extra)
p = Producer(conf)
failed = []
def done(err, msg):
    if err is not None:
        failed.append(str(err))
for twin, token, value in jobs:
    p.produce(topic, key=twin.encode(), value=json.dumps(value).encode(),
              headers=[("fencing-token", str(token)), ("content-type", "application/json")],
              on_delivery=done)
    p.poll(0)
left = p.flush(30)
if failed or left:
    sys.exit("delivery failed: %r, %d not delivered" % (failed, left))
print("delivered", len(jobs))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interop_confluent_kafka_when_installed() {
    let Some(python) = python_with_confluent_kafka() else {
        missing("python3 with confluent_kafka", PYTHON_INSTALL);
        return;
    };
    eprintln!("confluent-kafka interop: using {}", python.display());
    let t = TestTopic::new("python");
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &t, &[]);
    let c = s.client();
    let twins = ["py-robot-1", "py-robot-2", "py-robot-3", "py-robot-4"];
    let mut jobs = Vec::new();
    for twin in twins {
        let (token, _) = twin_token(&c, twin, "python").await;
        for i in 0..5 {
            jobs.push(json!([
                twin,
                token,
                { "type": "move", "patch": { "x": i, "by": "python" }, "event_id": format!("{twin}-{i}") }
            ]));
        }
    }
    let extra = if broker().is_tansu() {
        json!({ "batch.num.messages": 1 })
    } else {
        json!({})
    };
    let out = Command::new(&python)
        .args([
            "-c",
            PRODUCER,
            &broker().bootstrap,
            &t.topic,
            &extra.to_string(),
            &json!(jobs).to_string(),
        ])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "the confluent-kafka producer failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let o = wait_handled(&c, jobs.len() as u64, Duration::from_secs(60)).await;
    assert_eq!(o["applied"], jobs.len() as u64, "{o:?}");
    for twin in twins {
        let want: Vec<String> = (0..5).map(|i| format!("{twin}-{i}")).collect();
        assert_eq!(event_ids(&history(&c, twin).await), want, "{twin}");
        let v = c.twin(twin).await;
        assert_eq!(v.body["state"], json!({ "x": 4, "by": "python" }));
    }
    s.terminate();
}
