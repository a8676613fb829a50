//! `examples/python/worker.py`, run as a user would run it, against a real
//! `palisade serve` consuming the Kafka suite's broker (`tests/kafka/broker.rs`:
//! `PALISADE_KAFKA_BOOTSTRAP`, or an in-process mock). Its protobuf module
//! is generated from `proto/` with grpcio-tools into a temp folder first, so
//! a change to the envelope that the example does not follow fails here.
//!
//! - `worker_json_and_protobuf_when_installed`: one worker per record format,
//!   30 events each; both must exit 0 with every event applied in order, the
//!   state read back, the lease released; the records in the topic must carry
//!   the format's content type and encoding (read back from the broker).
//!   The JSON worker talks to the store through a redirector that answers
//!   every request with a `307` to the store, as a cluster node does for a
//!   twin it does not own: the worker must follow it for POST, GET and
//!   DELETE alike, with the same body.
//! - `worker_stops_on_lease_loss_when_installed`: a worker publishing without
//!   end; its lease is released and taken by another holder right after a
//!   renewal. The worker must stop on its next renewal (exit 3) and the
//!   store must have applied a prefix of what it delivered and dropped the
//!   rest as stale, all before the new holder's write.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::message::{Headers, Message};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use tempfile::TempDir;

use crate::broker::{broker, TestTopic, PARTITIONS};
use crate::support::{Client, ServeProcess};
use crate::{field, python_with, repo, run_python, PyProcess};

const WORKER_MODULES: &[&str] = &["confluent_kafka", "google.protobuf", "grpc_tools"];

/// `palisade/v1/event_pb2.py`, generated from `proto/` as the example's README says.
fn generate_pb2(python: &Path) -> TempDir {
    let out = tempfile::tempdir().unwrap();
    let proto = repo().join("proto");
    let out_arg = format!("--python_out={}", out.path().display());
    let include = format!("-I{}", proto.display());
    let file = proto.join("palisade/v1/event.proto");
    run_python(
        python,
        &[
            "-m",
            "grpc_tools.protoc",
            &include,
            &out_arg,
            file.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.path().join("palisade/v1/event_pb2.py").is_file());
    out
}

/// An HTTP server answering every request with a `307` to the same path on
/// `target`, as a cluster node does for a twin another node owns; it
/// records the methods it redirected.
struct Redirector {
    base: String,
    methods: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

impl Redirector {
    async fn start(target: &str) -> Self {
        use axum::http::{header, StatusCode, Uri};
        let methods = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
        let (seen, target) = (methods.clone(), target.to_owned());
        let app = axum::Router::new().fallback(move |method: axum::http::Method, uri: Uri| {
            let (seen, target) = (seen.clone(), target.clone());
            async move {
                seen.lock().unwrap().insert(method.to_string());
                let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
                (
                    StatusCode::TEMPORARY_REDIRECT,
                    [(header::LOCATION, format!("{target}{path}"))],
                )
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { base, methods }
    }

    fn methods(&self) -> std::collections::BTreeSet<String> {
        self.methods.lock().unwrap().clone()
    }
}

struct Worker<'a> {
    base: &'a str,
    topic: &'a str,
    twin: &'a str,
    holder: &'a str,
    format: &'a str,
    proto_dir: &'a Path,
}

impl Worker<'_> {
    fn args(&self, extra: &[&str]) -> Vec<String> {
        let script: PathBuf = repo().join("examples/python/worker.py");
        let mut a: Vec<String> = vec![
            script.to_str().unwrap().into(),
            "--url".into(),
            self.base.into(),
            "--brokers".into(),
            broker().bootstrap.clone(),
            "--topic".into(),
            self.topic.into(),
            "--twin".into(),
            self.twin.into(),
            "--holder".into(),
            self.holder.into(),
            "--format".into(),
            self.format.into(),
            "--proto-dir".into(),
            self.proto_dir.to_str().unwrap().into(),
        ];
        // The suite's producer settings (tansu needs one record per batch).
        for (k, v) in broker().producer_settings() {
            a.push("-X".into());
            a.push(format!("{k}={v}"));
        }
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a
    }
}

/// Every stored event of a twin, oldest first (all pages).
async fn history(c: &Client, twin: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let r = c
            .get(&format!("/v1/twins/{twin}/events?after={after}&limit=1000"))
            .await;
        if r.status == 404 {
            return out;
        }
        assert_eq!(r.status, 200, "{:?}", r.body);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = r.body["next_after"].as_u64().unwrap();
        out.extend(page);
    }
}

fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Kafka records refused for `twin`, oldest first.
async fn rejections(c: &Client, twin: &str) -> Vec<Value> {
    let r = c.get("/v1/rejections?limit=1024").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let mut v: Vec<Value> = r.body["rejections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["source"] == "kafka" && r["twin_id"] == twin)
        .cloned()
        .collect();
    v.reverse();
    v
}

/// (content types seen, values) of every record of `topic`, by key.
fn records_by_key(topic: &str, want: usize) -> BTreeMap<String, Vec<(String, Vec<u8>)>> {
    let consumer = broker().consumer(&format!("{topic}-reader"), &[]);
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, i32::try_from(p).unwrap(), Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out: BTreeMap<String, Vec<(String, Vec<u8>)>> = BTreeMap::new();
    let mut n = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while n < want {
        assert!(
            Instant::now() < deadline,
            "read {n} of {want} records back from {topic}"
        );
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let key = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
        let ct = m
            .headers()
            .and_then(|h| {
                h.iter()
                    .find(|h| h.key == "content-type")
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
            .unwrap_or_default();
        out.entry(key)
            .or_default()
            .push((ct, m.payload().unwrap_or_default().to_vec()));
        n += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_json_and_protobuf_when_installed() {
    let Some(python) = python_with(WORKER_MODULES) else {
        return;
    };
    let pb2 = generate_pb2(&python);
    let t = TestTopic::new("py-worker");
    let dir = tempfile::tempdir().unwrap();
    let args = t.serve_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let s = ServeProcess::start(dir.path(), &args);
    let c = s.client();

    const N: usize = 30;
    let count = N.to_string();
    let runs = [("py-json-pump", "json"), ("py-proto-pump", "protobuf")];
    let redirector = Redirector::start(&s.base).await;
    let mut workers: Vec<PyProcess> = runs
        .iter()
        .map(|(twin, format)| {
            let holder = format!("w-{format}");
            let w = Worker {
                base: if *format == "json" {
                    &redirector.base
                } else {
                    &s.base
                },
                topic: &t.topic,
                twin,
                holder: &holder,
                format,
                proto_dir: pb2.path(),
            };
            let a = w.args(&["--count", &count, "--interval-ms", "10"]);
            PyProcess::spawn(&python, &a, &[])
        })
        .collect();

    for (w, (twin, format)) in workers.iter_mut().zip(runs) {
        let (status, lines) = w.wait(Duration::from_secs(120));
        let out = lines.join("\n");
        assert_eq!(status.code(), Some(0), "{format} worker:\n{out}");
        let holder = format!("w-{format}");
        let token: u64 = lines
            .iter()
            .find_map(|l| field(l, "token"))
            .expect("a lease line")
            .parse()
            .unwrap();
        let want: Vec<String> = (0..N).map(|i| format!("{holder}-{token}-{i}")).collect();
        assert_eq!(ids(&history(&c, twin).await), want, "{format}: {out}");
        let state = json!({ "n": N - 1, "by": holder, "format": format });
        assert_eq!(c.twin(twin).await.body["state"], state);
        // The worker read the same state back, then released its lease.
        let printed = lines
            .iter()
            .find_map(|l| l.strip_prefix("state "))
            .expect("a state line");
        assert_eq!(serde_json::from_str::<Value>(printed).unwrap(), state);
        assert!(lines.contains(&format!("applied {N} events")), "{out}");
        assert!(lines.iter().any(|l| l.starts_with("released ")), "{out}");
        let r = c.try_acquire(&format!("twin/{twin}"), "next", 1000).await;
        assert_eq!(r.status, 201, "the lease is free again: {:?}", r.body);
    }

    // The JSON worker's every call went through a 307 it followed: its lease,
    // renewals, reads and release all arrived (checked above), and each
    // method was redirected.
    let seen = redirector.methods();
    for m in ["POST", "GET", "DELETE"] {
        assert!(seen.contains(m), "no {m} was redirected: {seen:?}");
    }

    // The records themselves: JSON values as the HTTP body, protobuf
    // `TwinEvent`s (field 1, the event id, first), each with its content type.
    let recs = records_by_key(&t.topic, 2 * N);
    let json_recs = &recs["py-json-pump"];
    assert_eq!(json_recs.len(), N);
    for (ct, v) in json_recs {
        assert_eq!(ct, "application/json");
        let v: Value = serde_json::from_slice(v).unwrap();
        assert_eq!(v["type"], "telemetry");
    }
    let proto_recs = &recs["py-proto-pump"];
    assert_eq!(proto_recs.len(), N);
    for (ct, v) in proto_recs {
        assert_eq!(ct, "application/x-protobuf");
        assert_eq!(v.first(), Some(&0x0a), "field 1 (event_id) first: {v:?}");
        assert!(serde_json::from_slice::<Value>(v).is_err());
    }
    s.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_stops_on_lease_loss_when_installed() {
    let Some(python) = python_with(WORKER_MODULES) else {
        return;
    };
    let pb2 = generate_pb2(&python);
    let t = TestTopic::new("py-lease-loss");
    let dir = tempfile::tempdir().unwrap();
    let args = t.serve_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let s = ServeProcess::start(dir.path(), &args);
    let c = s.client();
    let twin = "py-loss-pump";

    // Publishing without end, renewing every second: after a renewal there
    // is a second of records before the worker can learn anything.
    let w = Worker {
        base: &s.base,
        topic: &t.topic,
        twin,
        holder: "w-a",
        format: "protobuf",
        proto_dir: pb2.path(),
    };
    let a = w.args(&[
        "--count",
        "0",
        "--interval-ms",
        "20",
        "--ttl-ms",
        "10000",
        "--renew-every-ms",
        "1000",
    ]);
    let mut worker = PyProcess::spawn(&python, &a, &[]);
    let (lease_id, token_a) = worker.wait_for("the lease", Duration::from_secs(30), |lines| {
        let l = lines.iter().find(|l| l.starts_with("lease acquired"))?;
        Some((
            field(l, "lease_id")?.to_owned(),
            field(l, "token")?.parse::<u64>().unwrap(),
        ))
    });
    worker.wait_for("a renewal", Duration::from_secs(30), |lines| {
        lines
            .iter()
            .any(|l| l.starts_with("renewed "))
            .then_some(())
    });

    // Another holder takes the twin: release, grant, write.
    let released_at = Instant::now();
    let r = c.delete(&format!("/v1/leases/{lease_id}")).await;
    assert_eq!(r.status, 204, "{:?}", r.body);
    let b = c.acquire(&format!("twin/{twin}"), "w-b", 60_000).await;
    let token_b = crate::support::token_of(&b);
    assert!(token_b > token_a);
    let r = c
        .append(
            twin,
            token_b,
            &json!({ "type": "takeover", "patch": { "by": "w-b" }, "event_id": "w-b-1" }),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    let (status, lines) = worker.wait(Duration::from_secs(30));
    assert!(
        released_at.elapsed() < Duration::from_secs(5),
        "stopped at its next renewal (every 1 s, TTL 10 s), not {:?} after the release",
        released_at.elapsed()
    );
    let fenced = check_stopped(&c, twin, token_a, status, &lines, &["lease_released"], 20).await;
    assert!(
        fenced > 0,
        "the worker's last records (a second of them) were fenced"
    );
    s.terminate();
}

/// A worker paused (SIGSTOP) past its TTL while another holder takes the
/// twin: on waking it must renew before anything else, learn the lease is
/// gone and stop; whatever it had queued is never applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_worker_stops_when_installed() {
    let Some(python) = python_with(WORKER_MODULES) else {
        return;
    };
    let pb2 = generate_pb2(&python);
    let t = TestTopic::new("py-paused");
    let dir = tempfile::tempdir().unwrap();
    let args = t.serve_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let s = ServeProcess::start(dir.path(), &args);
    let c = s.client();
    let twin = "py-paused-pump";
    let w = Worker {
        base: &s.base,
        topic: &t.topic,
        twin,
        holder: "w-a",
        format: "json",
        proto_dir: pb2.path(),
    };
    let a = w.args(&[
        "--count",
        "0",
        "--interval-ms",
        "20",
        "--ttl-ms",
        "1000",
        "--renew-every-ms",
        "300",
    ]);
    let mut worker = PyProcess::spawn(&python, &a, &[]);
    // Three renewals (about a second of records) before the pause.
    let token_a = worker.wait_for("3 renewals", Duration::from_secs(30), |lines| {
        let renewals = lines.iter().filter(|l| l.starts_with("renewed ")).count();
        (renewals >= 3).then_some(())?;
        let l = lines.iter().find(|l| l.starts_with("lease acquired"))?;
        Some(field(l, "token")?.parse::<u64>().unwrap())
    });
    let signal = |sig: &str| {
        let st = std::process::Command::new("kill")
            .args([sig, &worker.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig}");
    };
    signal("-STOP");
    // Past the TTL: the lease expires in the store, and w-b takes the twin.
    let b = {
        let start = Instant::now();
        loop {
            let r = c.try_acquire(&format!("twin/{twin}"), "w-b", 60_000).await;
            if r.status == 201 {
                break r.body;
            }
            assert_eq!(r.status, 409, "{:?}", r.body);
            assert!(start.elapsed() < Duration::from_secs(10), "{:?}", r.body);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let token_b = crate::support::token_of(&b);
    let r = c
        .append(
            twin,
            token_b,
            &json!({ "type": "takeover", "patch": { "by": "w-b" }, "event_id": "w-b-1" }),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    signal("-CONT");
    let (status, lines) = worker.wait(Duration::from_secs(30));
    // The store answers the renewal of a lease whose scope was granted
    // again `lease_superseded`, of one merely expired `lease_expired`.
    check_stopped(
        &c,
        twin,
        token_a,
        status,
        &lines,
        &["lease_superseded", "lease_expired"],
        20,
    )
    .await;
    s.terminate();
}

/// The worker exited 3 for one of `reasons`; every record it delivered is decided,
/// a prefix applied and the rest refused as stale under `token_a`, all
/// before w-b's event `w-b-1`, which ends the history; at least
/// `min_delivered` were delivered (so there was something to decide).
/// Returns how many were refused.
async fn check_stopped(
    c: &Client,
    twin: &str,
    token_a: u64,
    status: std::process::ExitStatus,
    lines: &[String],
    reasons: &[&str],
    min_delivered: usize,
) -> usize {
    let out = lines.join("\n");
    assert_eq!(status.code(), Some(3), "exit 3, lease lost:\n{out}");
    assert!(
        reasons
            .iter()
            .any(|r| lines.contains(&format!("lease lost reason={r}: stopping"))),
        "lost for one of {reasons:?}:\n{out}"
    );
    let delivered: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with("delivered "))
        .map(|l| field(l, "event_id").unwrap().to_owned())
        .collect();
    assert!(delivered.len() >= min_delivered, "{out}");

    // Every delivered record is decided: applied, or refused as stale.
    let (applied, refused) = {
        let start = Instant::now();
        loop {
            let applied: Vec<String> = ids(&history(c, twin).await)
                .into_iter()
                .filter(|id| id.starts_with("w-a-"))
                .collect();
            let refused: Vec<Value> = rejections(c, twin).await;
            if applied.len() + refused.len() >= delivered.len() {
                break (applied, refused);
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{} applied + {} refused of {} delivered",
                applied.len(),
                refused.len(),
                delivered.len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // A prefix applied, the rest dropped: nothing of the old holder after
    // the fence went up.
    let k = applied.len();
    assert_eq!(applied, delivered[..k], "applied = a prefix of delivered");
    let refused_ids: Vec<String> = refused
        .iter()
        .flat_map(|r| r["event_ids"].as_array().unwrap().clone())
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(refused_ids, delivered[k..], "refused = the rest, in order");
    for r in &refused {
        assert_eq!(r["reason"], "stale_token", "{r}");
        assert_eq!(r["token"], token_a, "{r}");
    }
    let all = ids(&history(c, twin).await);
    assert_eq!(all.last().map(String::as_str), Some("w-b-1"), "{all:?}");
    assert_eq!(c.twin(twin).await.body["state"]["by"], "w-b");
    refused_ids.len()
}
