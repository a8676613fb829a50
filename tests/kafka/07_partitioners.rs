//! Issue 15: Kafka as users really produce to it. Records from clients
//! nobody here wrote, each with its own partitioner, must be applied
//! whatever partition they land in (the store routes them by key), exactly
//! once, and a topic's partition count need not be the store's:
//!
//! | test | producer | partitioner | topic |
//! |---|---|---|---|
//! | `kcat_default_partitioner_when_installed` | Debian's kcat | librdkafka's default, `consistent_random` (CRC32) | 4 partitions |
//! | `confluent_kafka_default_partitioner_when_installed` | Python confluent-kafka | its default, `consistent_random` | 4 partitions |
//! | `confluent_kafka_murmur2_when_installed` | Python confluent-kafka | `murmur2_random` (Java's) | 4 partitions |
//! | `topic_with_more_partitions_than_the_store_when_installed` | Python confluent-kafka | default | 7 partitions |
//!
//! Each, against a `palisade serve` of 4 partitions: fresh records applied
//! (each twin's history exactly its records, in order); records under a
//! superseded token dropped and listed in `GET /v1/rejections` with their
//! event ids, key, Kafka partition and offset; garbage (no token, two
//! `fencing-token` headers, undecodable JSON, a control character in an
//! event type, in JSON and, from Python, in a protobuf record)
//! dead-lettered at its partition and offset; then a second stream,
//! produced while the store consumes it, SIGKILL mid-stream, restart: every
//! record once. Where each record
//! landed is read back from the broker with a plain consumer, and checked
//! against the partitioner's own rule (CRC32 or murmur2 of the key), so a
//! test cannot pass with every record in its murmur2 partition by luck.
//!
//! Missing tools fail in CI and are skipped loudly elsewhere, as in
//! `06_interop.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use palisade::core::{partition_for, TwinId};
use rdkafka::consumer::Consumer;
use rdkafka::message::{Headers, Message};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::broker::{broker, TestTopic, PARTITIONS};
use crate::interop::{kcat_ld_path, missing, python_with_confluent_kafka, PYTHON_INSTALL};
use crate::support::{Client, ServeProcess};
use crate::{
    event_ids, heads, history, kafka_rejections, proto_event, serve, twin_token, wait_handled,
};

/// Which client produces, and how.
#[derive(Debug, Clone)]
enum Producer {
    /// kcat with librdkafka's default partitioner; `LD_LIBRARY_PATH` for
    /// tansu.
    Kcat { ld_path: Option<PathBuf> },
    /// confluent-kafka; `partitioner` = `None` for its default.
    Python {
        python: PathBuf,
        partitioner: Option<&'static str>,
    },
}

impl Producer {
    /// The partition its partitioner puts `key` in, of `n`.
    fn expected_partition(&self, key: &str, n: u32) -> u32 {
        match self {
            Self::Python {
                partitioner: Some("murmur2_random"),
                ..
            } => partition_for(&TwinId::new(key).unwrap(), n).0,
            // librdkafka's consistent_random: CRC32 of the key mod n.
            _ => crc32(key.as_bytes()) % n,
        }
    }
}

/// CRC-32 (IEEE), as librdkafka's `rd_crc32` for `consistent_random`.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for b in data {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A record's headers, in order.
type Headers_ = Vec<(&'static str, String)>;

/// One record to produce.
#[derive(Debug, Clone)]
struct Rec {
    key: String,
    headers: Headers_,
    value: Vec<u8>,
}

fn json_rec(key: &str, token: Option<u64>, value: &Value) -> Rec {
    let mut headers = vec![("content-type", "application/json".to_owned())];
    if let Some(t) = token {
        headers.push(("fencing-token", t.to_string()));
    }
    Rec {
        key: key.to_owned(),
        headers,
        value: value.to_string().into_bytes(),
    }
}

const PY_PRODUCER: &str = r#"
import base64, json, sys
from confluent_kafka import Producer
PACE_CHUNK = 100

import time
bootstrap, topic, conf_extra, recs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.load(open(sys.argv[4]))
pace = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
conf = {"bootstrap.servers": bootstrap, "acks": "all"}
conf.update(conf_extra)
p = Producer(conf)
failed = []
def done(err, msg):
    if err is not None:
        failed.append(str(err))
for i, r in enumerate(recs):
    p.produce(topic, key=r["key"].encode(), value=base64.b64decode(r["value"]),
              headers=[(k, v) for k, v in r["headers"]], on_delivery=done)
    p.poll(0)
    if pace and i % PACE_CHUNK == PACE_CHUNK - 1:
        p.flush(30)
        time.sleep(pace)
left = p.flush(60)
if failed or left:
    sys.exit("delivery failed: %r, %d not delivered" % (failed[:5], left))
print("delivered", len(recs))
"#;

fn b64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Records produced between two pauses of a paced production.
const PACE_CHUNK: usize = 100;
/// The pause: 12,000 records take about 6 s, longer than a group join, so
/// a consumer started with the producer is still behind it when it is
/// killed, on any broker.
const PACE: Duration = Duration::from_millis(50);

/// Produce `recs` with the client, in order per header set (kcat takes
/// one header set per run; records of one twin under one token share one);
/// with `pace`, `PACE_CHUNK` records at a time with a pause in between.
fn produce(p: &Producer, topic: &str, recs: &[Rec]) {
    produce_paced(p, topic, recs, None);
}

fn produce_paced(p: &Producer, topic: &str, recs: &[Rec], pace: Option<Duration>) {
    match p {
        Producer::Kcat { ld_path } => {
            let mut groups: Vec<(Headers_, Vec<&Rec>)> = Vec::new();
            for r in recs {
                match groups.iter_mut().find(|(h, _)| *h == r.headers) {
                    Some((_, g)) => g.push(r),
                    None => groups.push((r.headers.clone(), vec![r])),
                }
            }
            // One kcat per header set, all running at once, fed in turn.
            let mut children = Vec::new();
            for (headers, group) in groups {
                let mut cmd = Command::new("kcat");
                // Key and value per line, split at the first tab; no
                // `-X partitioner`: librdkafka's default.
                cmd.args(["-P", "-b", &broker().bootstrap, "-t", topic, "-K", "\\t"]);
                for (k, v) in &headers {
                    cmd.args(["-H", &format!("{k}={v}")]);
                }
                if broker().is_tansu() {
                    cmd.args(["-X", "batch.num.messages=1"]);
                }
                if let Some(l) = ld_path {
                    cmd.env("LD_LIBRARY_PATH", l);
                }
                let mut child = cmd
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("run kcat");
                let stdin = child.stdin.take().unwrap();
                children.push((child, Some(stdin), group, 0usize));
            }
            // PACE_CHUNK records per pause in all.
            let per_child = (PACE_CHUNK / children.len().max(1)).max(1);
            loop {
                let mut fed = false;
                for (_, stdin, group, at) in &mut children {
                    let Some(w) = stdin.as_mut() else { continue };
                    let end = (*at + per_child).min(group.len());
                    let mut buf = Vec::new();
                    for r in &group[*at..end] {
                        assert!(!r.value.contains(&b'\n') && !r.key.contains('\t'));
                        buf.extend_from_slice(r.key.as_bytes());
                        buf.push(b'\t');
                        buf.extend_from_slice(&r.value);
                        buf.push(b'\n');
                    }
                    w.write_all(&buf).unwrap();
                    w.flush().unwrap();
                    *at = end;
                    fed = true;
                    if *at == group.len() {
                        // Closing stdin ends kcat once it delivered all.
                        *stdin = None;
                    }
                }
                if !fed {
                    break;
                }
                if let Some(d) = pace {
                    std::thread::sleep(d);
                }
            }
            for (child, ..) in children {
                let out = child.wait_with_output().unwrap();
                assert!(
                    out.status.success(),
                    "kcat failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Producer::Python {
            python,
            partitioner,
        } => {
            let mut extra = serde_json::Map::new();
            if let Some(pt) = partitioner {
                extra.insert("partitioner".into(), json!(pt));
            }
            if broker().is_tansu() {
                extra.insert("batch.num.messages".into(), json!(1));
            }
            let file = tempfile::NamedTempFile::new().unwrap();
            let list: Vec<Value> = recs
                .iter()
                .map(|r| json!({ "key": r.key, "headers": r.headers, "value": b64(&r.value) }))
                .collect();
            std::fs::write(file.path(), serde_json::to_vec(&list).unwrap()).unwrap();
            let pace = pace.map_or(0.0, |d| d.as_secs_f64()).to_string();
            let out = Command::new(python)
                .args([
                    "-c",
                    PY_PRODUCER,
                    &broker().bootstrap,
                    topic,
                    &Value::Object(extra).to_string(),
                    &file.path().to_string_lossy(),
                    &pace,
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
        }
    }
}

/// Where a record landed, read back from the broker.
#[derive(Debug, Clone)]
struct Landed {
    partition: u32,
    offset: u64,
    key: String,
}

/// Read `n` records of `topic` (all `partitions`) from the start; by value.
fn read_back(topic: &str, partitions: u32, n: usize) -> BTreeMap<Vec<u8>, Landed> {
    let c = broker().consumer(&format!("{topic}-readback"), &[]);
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, i32::try_from(p).unwrap(), Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut out = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "read back {} of {n} records of {topic}",
            out.len()
        );
        let Some(m) = c.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let landed = Landed {
            partition: u32::try_from(m.partition()).unwrap(),
            offset: u64::try_from(m.offset()).unwrap(),
            key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
        };
        // Headers are not needed: every value is unique.
        let _ = m.headers().map(|h| h.count());
        let prev = out.insert(m.payload().unwrap_or_default().to_vec(), landed);
        assert!(prev.is_none(), "values must be unique");
    }
    out
}

/// Dead letters as (partition, offset, reason).
async fn dead_letters(c: &Client) -> BTreeSet<(u64, u64, String)> {
    let r = c.get("/v1/dead-letters?limit=1000").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["partition"].as_u64().unwrap(),
                d["offset"].as_u64().unwrap(),
                d["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Histories of `twins` read from a folder, without Kafka.
async fn histories_offline(data: &Path, twins: &[String]) -> BTreeMap<String, Vec<String>> {
    let s = ServeProcess::start(data, &[]);
    let c = s.client();
    let mut out = BTreeMap::new();
    for t in twins {
        out.insert(t.clone(), event_ids(&history(&c, t).await));
    }
    s.terminate();
    out
}

const TWINS: usize = 6;
const FRESH: usize = 3;
/// Records per twin in the second stream: 12,000 in all, as in
/// `03_restart_exactly_once.rs`, so the kill lands mid-stream.
const SECOND: usize = 2000;

/// The scenario of the module doc, for one producer and topic size.
async fn scenario(name: &str, producer: Producer, topic_partitions: u32) {
    let t = TestTopic::with_partitions(name, topic_partitions);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let s = serve(data, &t, &[]);
    let c = s.client();
    let twins: Vec<String> = (0..TWINS).map(|i| format!("{name}-pump-{i}")).collect();

    // A superseded (stale) and a current token per twin.
    let mut stale = Vec::new();
    let mut fresh = Vec::new();
    for twin in &twins {
        let (old, lease) = twin_token(&c, twin, "worker-a").await;
        crate::release(&c, &lease).await;
        let (new, _) = twin_token(&c, twin, "worker-b").await;
        assert!(new > old);
        stale.push(old);
        fresh.push(new);
    }

    // Phase 1: fresh, stale and garbage records.
    let mut recs = Vec::new();
    let mut want: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (i, twin) in twins.iter().enumerate() {
        for k in 0..FRESH {
            let id = format!("{twin}-f{k}");
            recs.push(json_rec(
                twin,
                Some(fresh[i]),
                &json!({ "type": "set", "patch": { "k": k }, "event_id": id }),
            ));
            want.entry(twin.clone()).or_default().push(id);
        }
    }
    let mut stale_values = Vec::new();
    for (i, twin) in twins.iter().enumerate() {
        let r = json_rec(
            twin,
            Some(stale[i]),
            &json!({ "type": "set", "patch": { "late": true }, "event_id": format!("{twin}-stale") }),
        );
        stale_values.push((r.value.clone(), format!("{twin}-stale"), twin.clone()));
        recs.push(r);
    }
    // Garbage: (value, reason).
    let g = &twins[0];
    let mut garbage: Vec<(Rec, &str)> = vec![
        (
            json_rec(
                g,
                None,
                &json!({ "type": "set", "patch": {}, "event_id": "g-no-token" }),
            ),
            "missing_token",
        ),
        (
            Rec {
                headers: vec![
                    ("content-type", "application/json".into()),
                    ("fencing-token", fresh[0].to_string()),
                    ("fencing-token", fresh[0].to_string()),
                ],
                ..json_rec(
                    g,
                    None,
                    &json!({ "type": "set", "patch": {}, "event_id": "g-two-tokens" }),
                )
            },
            "bad_token",
        ),
        (
            Rec {
                value: b"{not json: g-bad-json".to_vec(),
                ..json_rec(g, Some(fresh[0]), &json!(null))
            },
            "bad_json",
        ),
        (
            json_rec(
                g,
                Some(fresh[0]),
                &json!({ "type": "set\u{1b}[2J", "patch": {}, "event_id": "g-ctrl-json" }),
            ),
            "bad_event",
        ),
    ];
    if matches!(producer, Producer::Python { .. }) {
        // A protobuf record (content-type absent: the default) with a
        // control character in its type: refused by the store's own check,
        // as on HTTP.
        garbage.push((
            Rec {
                key: g.clone(),
                headers: vec![("fencing-token", fresh[0].to_string())],
                value: proto_event("g-ctrl-proto", "set\u{7}", "{}"),
            },
            "bad_event",
        ));
    }
    recs.extend(garbage.iter().map(|(r, _)| r.clone()));
    produce(&producer, &t.topic, &recs);
    let landed = read_back(&t.topic, topic_partitions, recs.len());

    // Each record is where its producer's partitioner put it, and the test
    // is worth something only if many are outside their murmur2 partition
    // (the store's).
    let mut foreign = 0;
    for r in &recs {
        let l = &landed[&r.value];
        assert_eq!(l.key, r.key);
        assert_eq!(
            l.partition,
            producer.expected_partition(&r.key, topic_partitions),
            "{}: the client's partitioner",
            r.key
        );
        if l.partition != partition_for(&TwinId::new(r.key.clone()).unwrap(), PARTITIONS).0 {
            foreign += 1;
        }
    }
    let murmur_same_count = matches!(
        producer,
        Producer::Python {
            partitioner: Some("murmur2_random"),
            ..
        }
    ) && topic_partitions == PARTITIONS;
    if murmur_same_count {
        assert_eq!(foreign, 0, "murmur2 on a topic of the store's size");
    } else {
        assert!(
            foreign * 2 >= recs.len(),
            "{foreign} of {} records outside their store partition: pick other twins",
            recs.len()
        );
    }

    let o = wait_handled(&c, recs.len() as u64, Duration::from_secs(90)).await;
    assert_eq!(o["applied"], (TWINS * FRESH) as u64, "{o:?}");
    assert_eq!(o["dropped_stale"], TWINS as u64, "{o:?}");
    assert_eq!(o["dead_lettered"], garbage.len() as u64, "{o:?}");
    for twin in &twins {
        assert_eq!(event_ids(&history(&c, twin).await), want[twin], "{twin}");
    }
    // Stale records listed with their event ids, key, partition, offset.
    let all_rej = kafka_rejections(&c).await;
    let rej: BTreeSet<(String, String, u64, u64)> = all_rej
        .iter()
        .filter(|r| r["reason"] == "stale_token")
        .map(|r| {
            let ids = r["event_ids"].as_array().unwrap();
            assert_eq!(ids.len(), 1, "{r}");
            (
                ids[0].as_str().unwrap().to_owned(),
                r["twin_id"].as_str().unwrap().to_owned(),
                r["source_partition"].as_u64().unwrap(),
                r["offset"].as_u64().unwrap(),
            )
        })
        .collect();
    // The protobuf record refused by the store (not at decoding) is logged
    // too; nothing else is.
    let others: Vec<&Value> = all_rej
        .iter()
        .filter(|r| r["reason"] != "stale_token")
        .collect();
    let proto_refused = usize::from(matches!(producer, Producer::Python { .. }));
    assert_eq!(others.len(), proto_refused, "{others:?}");
    for r in others {
        assert_eq!(r["reason"], "bad_event");
        assert_eq!(r["event_ids"], json!(["g-ctrl-proto"]));
    }
    let want_rej: BTreeSet<(String, String, u64, u64)> = stale_values
        .iter()
        .map(|(v, id, twin)| {
            let l = &landed[v];
            (id.clone(), twin.clone(), u64::from(l.partition), l.offset)
        })
        .collect();
    assert_eq!(rej, want_rej);
    // Garbage dead-lettered where it landed, with its reason.
    let want_dead: BTreeSet<(u64, u64, String)> = garbage
        .iter()
        .map(|(r, reason)| {
            let l = &landed[&r.value];
            (u64::from(l.partition), l.offset, (*reason).to_owned())
        })
        .collect();
    assert_eq!(dead_letters(&c).await, want_dead);

    // Phase 2: a longer stream, SIGKILL mid-stream, restart. The stream is
    // produced, paced, while the store consumes it: a broker that answers a
    // fetch with all it has (tansu ignores fetch size limits) would let a
    // store apply a pre-loaded stream whole between two polls of its heads.
    let before: u64 = heads(&c).await.iter().sum();
    s.kill();
    let mut second = Vec::new();
    for k in 0..SECOND {
        for (i, twin) in twins.iter().enumerate() {
            let id = format!("{twin}-s{k:04}");
            second.push(json_rec(
                twin,
                Some(fresh[i]),
                &json!({ "type": "set", "patch": { "s": k }, "event_id": id }),
            ));
            want.get_mut(twin).unwrap().push(id);
        }
    }
    let total = before + second.len() as u64;
    let s = serve(data, &t, &[]);
    // A first chunk, then (once it is applied: the consumer is live) the
    // rest, paced, in the background; a consumer that joined only after a
    // paced stream was all produced would get it whole (seen on tansu).
    let rest = second.split_off(PACE_CHUNK);
    produce(&producer, &t.topic, &second);
    let primed = before + second.len() as u64;
    let progress_past = |above: u64| {
        let c = s.client();
        async move {
            let start = Instant::now();
            loop {
                let n: u64 = heads(&c).await.iter().sum();
                if n > above {
                    break n;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(90),
                    "no progress past {n} (waiting for {above})"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    progress_past(primed - 1).await;
    let producing = {
        let (producer, topic) = (producer.clone(), t.topic.clone());
        std::thread::spawn(move || produce_paced(&producer, &topic, &rest, Some(PACE)))
    };
    let at_kill = progress_past(primed + 50).await;
    s.kill();
    producing.join().expect("the producer thread");
    let got = histories_offline(data, &twins).await;
    let mut durable = 0;
    for twin in &twins {
        let h = &got[twin];
        assert_eq!(
            h[..],
            want[twin][..h.len()],
            "{twin}: a prefix of its records, each once"
        );
        durable += h.len() as u64;
    }
    eprintln!(
        "{name}: heads showed {at_kill} before the kill, {durable} of {total} events were durable after it"
    );
    assert!(
        durable >= at_kill,
        "heads showed {at_kill}, {durable} survived the kill"
    );
    assert!(
        durable < total,
        "all {total} events were applied before the kill; it must land mid-stream"
    );

    // A new consumer group: the store resumes from the offsets stored with
    // its data, never the group's (a group that started from the beginning
    // would show as `already_applied` below). In the killed process's group,
    // the restart got no record for over 120 s on tansu 0.6 in 4 of 5 runs
    // (one of the 4 tests each time; never on the mock broker; also with
    // max.poll.interval.ms=10000): not diagnosed, see tests/kafka/README.md.
    let after_kill = TestTopic {
        topic: t.topic.clone(),
        group: format!("{}-after-kill", t.group),
    };
    let s = serve(data, &after_kill, &[]);
    let c = s.client();
    let left = total - durable;
    let o = wait_handled(&c, left, Duration::from_secs(120)).await;
    assert_eq!(
        o["applied"], left,
        "only what the killed process had not: {o:?}"
    );
    assert_eq!(
        o["already_applied"], 0,
        "resumed from the stored offsets: {o:?}"
    );
    for twin in &twins {
        assert_eq!(
            event_ids(&history(&c, twin).await),
            want[twin],
            "{twin}: every record once"
        );
    }
    assert_eq!(
        dead_letters(&c).await,
        want_dead,
        "dead letters kept, none twice"
    );
    s.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcat_default_partitioner_when_installed() {
    let Some(ld_path) = kcat_ld_path() else {
        return;
    };
    scenario("kcat-default", Producer::Kcat { ld_path }, PARTITIONS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_default_partitioner_when_installed() {
    let Some(python) = python_with_confluent_kafka() else {
        missing("python3 with confluent_kafka", PYTHON_INSTALL);
        return;
    };
    let p = Producer::Python {
        python,
        partitioner: None,
    };
    scenario("py-default", p, PARTITIONS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_murmur2_when_installed() {
    let Some(python) = python_with_confluent_kafka() else {
        missing("python3 with confluent_kafka", PYTHON_INSTALL);
        return;
    };
    let p = Producer::Python {
        python,
        partitioner: Some("murmur2_random"),
    };
    scenario("py-murmur2", p, PARTITIONS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_with_more_partitions_than_the_store_when_installed() {
    let Some(python) = python_with_confluent_kafka() else {
        missing("python3 with confluent_kafka", PYTHON_INSTALL);
        return;
    };
    let p = Producer::Python {
        python,
        partitioner: None,
    };
    scenario("py-seven", p, 7).await;
}

#[test]
fn crc32_is_ieee() {
    // The check value of CRC-32/ISO-HDLC.
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
}
