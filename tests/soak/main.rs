//! The soak test (issue 18): a real `palisade serve` under mixed load for a
//! fixed time, SIGKILLed and restarted on the same folder every few
//! seconds, sampled once a second. It guards against what only shows over
//! time and across many crashes: an acknowledged event lost or stored
//! twice, a stale token accepted, descriptors or memory that leak, slow
//! clients that are never closed, ingestion that falls behind for good.
//!
//! Load, all at once: writers appending single events and batches of 2-20
//! under twin leases (retrying in-flight requests with the same event ids
//! after a crash); readers (twin state, history pages, partitions); SSE
//! watchers that come and go; lease churn (acquire, write, release, a second
//! holder, the first holder's stale write, which must be refused); slow
//! clients (half headers, silence, idle keep-alive, a body that never
//! comes); and Kafka records under their own twin leases (the broker of the
//! Kafka suite, `tests/kafka/broker.rs`; `PALISADE_SOAK_KAFKA=0` turns it off).
//!
//! Every second a CSV row: elapsed time, the server's pid, RSS, open fds,
//! threads, the data folder's size on disk, and the load's running counts
//! (`PALISADE_SOAK_OUT`, default `target/soak/soak-<unix time>.csv`;
//! `docs/plot_soak.py` draws it). At the end, with the load stopped and the
//! Kafka records all applied: every acknowledged event is in its twin's
//! history exactly once at its acknowledged seq, no event id appears twice,
//! no stale write was accepted, every slow client was closed in time, no
//! request ever got `storage_failed`, and open fds and RSS are back to a
//! bounded level.
//!
//! `PALISADE_SOAK_SECS` (default 75: the short form run by `cargo test`),
//! `PALISADE_SOAK_KILL_EVERY_SECS` (default 20), `PALISADE_SOAK_WRITERS`
//! (default 4). The long form: `PALISADE_SOAK_SECS=3600
//! PALISADE_SOAK_KILL_EVERY_SECS=120 cargo test --test soak -- --nocapture`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "../kafka/broker.rs"]
#[allow(dead_code)]
mod broker;

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use palisade::core::{FencingToken, NewEvent, TwinId};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::ServeProcess;

const HEADER_MS: u64 = 2000;
const BODY_MS: u64 = 2000;
const IDLE_MS: u64 = 5000;
const CACHE_MB: u64 = 64;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

/// The load's running counts (one CSV column each).
#[derive(Default)]
struct Counts {
    acked_events: AtomicU64,
    append_requests: AtomicU64,
    append_retries: AtomicU64,
    reads: AtomicU64,
    watch_streams: AtomicU64,
    watch_events: AtomicU64,
    lease_ops: AtomicU64,
    stale_refused: AtomicU64,
    slow_closed: AtomicU64,
    kafka_sent: AtomicU64,
    transport_errors: AtomicU64,
    restarts: AtomicU64,
    // Failures: each must stay 0.
    stale_accepted: AtomicU64,
    slow_late: AtomicU64,
    storage_failed: AtomicU64,
    unexpected: AtomicU64,
}

const COLUMNS: &str = "elapsed_s,pid,rss_kib,fds,threads,data_kib,acked_events,append_requests,\
append_retries,reads,watch_streams,watch_events,lease_ops,stale_refused,slow_closed,kafka_sent,\
transport_errors,restarts";

impl Counts {
    fn row(&self) -> String {
        [
            &self.acked_events,
            &self.append_requests,
            &self.append_retries,
            &self.reads,
            &self.watch_streams,
            &self.watch_events,
            &self.lease_ops,
            &self.stale_refused,
            &self.slow_closed,
            &self.kafka_sent,
            &self.transport_errors,
            &self.restarts,
        ]
        .iter()
        .map(|c| c.load(Relaxed).to_string())
        .collect::<Vec<_>>()
        .join(",")
    }
}

struct Soak {
    base: RwLock<String>,
    addr: RwLock<std::net::SocketAddr>,
    stop: AtomicBool,
    counts: Counts,
    http: reqwest::Client,
    /// event id -> (twin, seq) of every acknowledged HTTP append.
    acked: Mutex<HashMap<String, (String, u64)>>,
    /// (twin, event id) of every record the broker acknowledged.
    kafka: Mutex<Vec<(String, String)>>,
    /// Unexpected answers, for the failure message.
    oddities: Mutex<Vec<String>>,
}

/// A response, or `None` on a transport error (the server is restarting).
struct Ans {
    status: u16,
    body: Value,
}

impl Soak {
    fn base(&self) -> String {
        self.base.read().unwrap().clone()
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    fn odd(&self, what: String) {
        self.counts.unexpected.fetch_add(1, Relaxed);
        let mut o = self.oddities.lock().unwrap();
        if o.len() < 20 {
            o.push(what);
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Option<Ans> {
        match req.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let body = r.json().await.unwrap_or(Value::Null);
                if body["error"] == "storage_failed" {
                    self.counts.storage_failed.fetch_add(1, Relaxed);
                }
                Some(Ans { status, body })
            }
            Err(_) => {
                self.counts.transport_errors.fetch_add(1, Relaxed);
                None
            }
        }
    }

    async fn get(&self, path: &str) -> Option<Ans> {
        self.send(self.http.get(format!("{}{path}", self.base())))
            .await
    }

    async fn post(&self, path: &str, token: Option<u64>, body: &Value) -> Option<Ans> {
        let mut r = self.http.post(format!("{}{path}", self.base())).json(body);
        if let Some(t) = token {
            r = r.header("Fencing-Token", t.to_string());
        }
        self.send(r).await
    }

    async fn delete(&self, path: &str) -> Option<Ans> {
        self.send(self.http.delete(format!("{}{path}", self.base())))
            .await
    }

    /// Acquire `scope`, retrying through restarts; `None` if held by someone.
    async fn acquire(&self, scope: &str, holder: &str, ttl_ms: u64) -> Option<(String, u64)> {
        loop {
            if self.stopped() {
                return None;
            }
            let body = json!({"scope": scope, "holder": holder, "ttl_ms": ttl_ms});
            match self.post("/v1/leases", None, &body).await {
                Some(a) if a.status == 201 => {
                    self.counts.lease_ops.fetch_add(1, Relaxed);
                    return Some((
                        a.body["lease_id"].as_str().unwrap().to_owned(),
                        a.body["token"].as_u64().unwrap(),
                    ));
                }
                Some(a) if a.status == 409 => return None,
                Some(a) if a.status >= 500 => {}
                Some(a) => self.odd(format!("acquire {scope}: {} {}", a.status, a.body)),
                None => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A writer: one twin, its lease renewed as it goes, single events and
/// batches; a request that got no answer is sent again, same event ids.
async fn writer(s: Arc<Soak>, w: usize) {
    let twin = format!("soak-w{w}");
    let scope = format!("twin/{twin}");
    let mut lease: Option<(String, u64)> = None;
    let mut renewed = Instant::now();
    let mut n = 0u64;
    let mut rng = w as u64 * 7919 + 1;
    let pause = env_u64("PALISADE_SOAK_PAUSE_MS", 5);
    'outer: while !s.stopped() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let size = if rng % 3 == 0 { 2 + (rng >> 8) % 19 } else { 1 };
        let ids: Vec<String> = (0..size).map(|i| format!("w{w}-{}", n + i)).collect();
        n += size;
        let events: Vec<Value> = ids
            .iter()
            .map(|id| json!({"type": "tick", "event_id": id, "patch": {"n": id, "w": w}}))
            .collect();
        let body = if size == 1 {
            events[0].clone()
        } else {
            Value::Array(events)
        };
        // Send until answered (a crash in between: same ids again).
        let mut first = true;
        loop {
            if lease.is_none() || renewed.elapsed() > Duration::from_secs(5) {
                if let Some((id, _)) = &lease {
                    match s
                        .post(&format!("/v1/leases/{id}/renew"), None, &json!({}))
                        .await
                    {
                        Some(a) if a.status == 200 => renewed = Instant::now(),
                        Some(a) if a.status == 410 || a.status == 404 || a.status == 409 => {
                            lease = None
                        }
                        _ => {}
                    }
                }
                if lease.is_none() {
                    lease = s.acquire(&scope, &format!("writer-{w}"), 30_000).await;
                    renewed = Instant::now();
                    if lease.is_none() {
                        // Our own earlier lease, lost track of: it expires.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue 'outer;
                    }
                }
            }
            if s.stopped() && !first {
                break 'outer; // abandoned: never acknowledged
            }
            let token = lease.as_ref().map(|l| l.1);
            if !first {
                s.counts.append_retries.fetch_add(1, Relaxed);
            }
            first = false;
            match s
                .post(&format!("/v1/twins/{twin}/events"), token, &body)
                .await
            {
                Some(a) if a.status == 201 => {
                    s.counts.append_requests.fetch_add(1, Relaxed);
                    let seqs = a.body["seqs"].as_array().unwrap();
                    let mut acked = s.acked.lock().unwrap();
                    for (id, seq) in ids.iter().zip(seqs) {
                        acked.insert(id.clone(), (twin.clone(), seq.as_u64().unwrap()));
                    }
                    s.counts.acked_events.fetch_add(size, Relaxed);
                    break;
                }
                Some(a) if a.status == 409 || a.status == 403 => lease = None,
                Some(a) if a.status >= 500 => {}
                Some(a) => {
                    s.odd(format!("append {twin}: {} {}", a.status, a.body));
                    break;
                }
                None => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

async fn reader(s: Arc<Soak>, writers: usize) {
    let mut i = 0usize;
    while !s.stopped() {
        i += 1;
        let w = i % writers;
        let path = match i % 3 {
            0 => format!("/v1/twins/soak-w{w}"),
            1 => format!(
                "/v1/twins/soak-w{w}/events?after={}&limit=100",
                (i * 37) % 500
            ),
            _ => "/v1/partitions".to_owned(),
        };
        match s.get(&path).await {
            Some(a) if a.status == 200 || a.status == 404 => {
                s.counts.reads.fetch_add(1, Relaxed);
            }
            Some(a) if a.status >= 500 => {}
            Some(a) => s.odd(format!("GET {path}: {} {}", a.status, a.body)),
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Change streams that come and go: each reads a writer's twin for 2-6 s.
async fn watchers(s: Arc<Soak>, writers: usize) {
    let mut i = 0u64;
    let mut live = tokio::task::JoinSet::new();
    while !s.stopped() {
        i += 1;
        if live.len() < 4 {
            let s2 = s.clone();
            let (w, secs) = (i as usize % writers, 2 + i % 5);
            live.spawn(async move {
                let url = format!("{}/v1/twins/soak-w{w}/watch", s2.base());
                let Ok(mut r) = s2
                    .http
                    .get(url)
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await
                else {
                    return;
                };
                if r.status() != 200 {
                    return;
                }
                s2.counts.watch_streams.fetch_add(1, Relaxed);
                let until = Instant::now() + Duration::from_secs(secs);
                while let Ok(Ok(Some(chunk))) =
                    tokio::time::timeout_at(until.into(), r.chunk()).await
                {
                    let n = String::from_utf8_lossy(&chunk)
                        .matches("event: event")
                        .count();
                    s2.counts.watch_events.fetch_add(n as u64, Relaxed);
                }
            });
        }
        while live.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    live.shutdown().await;
}

/// Leases change hands; the former holder's write must always be refused.
async fn lease_churn(s: Arc<Soak>) {
    let mut k = 0u64;
    while !s.stopped() {
        k += 1;
        let twin = format!("churn-{}", k % 16);
        let scope = format!("twin/{twin}");
        let Some((id_a, t_a)) = s.acquire(&scope, "churn-a", 10_000).await else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        };
        let body = json!({"type": "churn", "patch": {"k": k}});
        let _ = s
            .post(&format!("/v1/twins/{twin}/events"), Some(t_a), &body)
            .await;
        // A second holder is refused while A holds it.
        if let Some(a) = s
            .post(
                "/v1/leases",
                None,
                &json!({"scope": scope, "holder": "churn-b", "ttl_ms": 2000}),
            )
            .await
        {
            if a.status == 201 {
                s.odd(format!(
                    "{scope}: a second holder got a live lease: {}",
                    a.body
                ));
            }
        }
        if s.delete(&format!("/v1/leases/{id_a}")).await.is_none() {
            continue; // a crash: start over (A's lease expires in 2 s)
        }
        s.counts.lease_ops.fetch_add(1, Relaxed);
        let Some((id_b, t_b)) = s.acquire(&scope, "churn-b", 2000).await else {
            continue;
        };
        // The fence: A's write under its old token, after B's grant.
        match s
            .post(&format!("/v1/twins/{twin}/events"), Some(t_a), &body)
            .await
        {
            Some(a) if a.status == 409 => {
                s.counts.stale_refused.fetch_add(1, Relaxed);
            }
            Some(a) if a.status == 201 => {
                s.counts.stale_accepted.fetch_add(1, Relaxed);
                s.odd(format!(
                    "{twin}: stale token {t_a} accepted after grant {t_b}: {}",
                    a.body
                ));
            }
            _ => {}
        }
        if k % 3 != 0 {
            let _ = s.delete(&format!("/v1/leases/{id_b}")).await;
            s.counts.lease_ops.fetch_add(1, Relaxed);
        } // else: left to expire
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Slow clients, one kind after another; each must be closed (or answered
/// 408) within its timeout plus slack, or by a crash of the server.
async fn slow_clients(s: Arc<Soak>) {
    let slack = Duration::from_secs(10);
    let mut k = 0u64;
    while !s.stopped() {
        k += 1;
        let addr = *s.addr.read().unwrap();
        let Ok(mut c) = TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let limit = match k % 4 {
            0 => {
                let _ = c.write_all(b"GET /healthz HTTP/1.1\r\nHost: s\r\n").await;
                Duration::from_millis(HEADER_MS)
            }
            1 => Duration::from_millis(HEADER_MS),
            2 => {
                let _ = c
                    .write_all(
                        b"POST /v1/leases HTTP/1.1\r\nHost: s\r\nContent-Length: 50\r\n\r\n{",
                    )
                    .await;
                Duration::from_millis(BODY_MS)
            }
            _ => {
                let _ = c
                    .write_all(b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n")
                    .await;
                Duration::from_millis(IDLE_MS)
            }
        } + slack;
        let s2 = s.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let until = tokio::time::Instant::now() + limit;
            loop {
                match tokio::time::timeout_at(until, c.read(&mut buf)).await {
                    Ok(Ok(0) | Err(_)) => {
                        s2.counts.slow_closed.fetch_add(1, Relaxed);
                        return;
                    }
                    Ok(Ok(_)) => {}
                    Err(_) => {
                        s2.counts.slow_late.fetch_add(1, Relaxed);
                        return;
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Records through Kafka, each twin under one lease and one token for its
/// whole life (a lost lease starts a new twin), so every record the broker
/// acknowledged must be applied.
async fn kafka_load(s: Arc<Soak>, publisher: palisade_kafka::Publisher) {
    let mut gen = 0u64;
    'twin: while !s.stopped() {
        gen += 1;
        let twin = format!("soak-k{gen}");
        let Some((lease_id, token)) = s
            .acquire(&format!("twin/{twin}"), "kafka-writer", 30_000)
            .await
        else {
            continue;
        };
        let mut renewed = Instant::now();
        let id = TwinId::new(&twin).unwrap();
        let mut n = 0u64;
        while !s.stopped() {
            if renewed.elapsed() > Duration::from_secs(5) {
                match s
                    .post(&format!("/v1/leases/{lease_id}/renew"), None, &json!({}))
                    .await
                {
                    Some(a) if a.status == 200 => renewed = Instant::now(),
                    Some(a) if a.status < 500 => continue 'twin,
                    _ => {}
                }
            }
            n += 1;
            let event_id = format!("k{gen}-{n}");
            let mut patch = serde_json::Map::new();
            patch.insert("n".into(), json!(n));
            let ev = NewEvent {
                event_id: event_id.clone(),
                event_type: "kafka".into(),
                patch,
                hlc: None,
            };
            if publisher
                .publish(&id, FencingToken(token), &ev)
                .await
                .is_ok()
            {
                s.counts.kafka_sent.fetch_add(1, Relaxed);
                s.kafka.lock().unwrap().push((twin.clone(), event_id));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// RSS (KiB) and threads of `pid`.
fn proc_status(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Size on disk of a folder, in KiB (allocated blocks, as `du`).
fn disk_kib(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_kib(&e.path()),
            Ok(m) => m.blocks() / 2,
            Err(_) => 0,
        })
        .sum()
}

fn addr_of(base: &str) -> std::net::SocketAddr {
    base.rsplit("//").next().unwrap().parse().unwrap()
}

/// Every event of `twin`, by event id -> seqs.
async fn history(s: &Soak, twin: &str) -> BTreeMap<String, Vec<u64>> {
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut after = 0u64;
    loop {
        let a = s
            .get(&format!("/v1/twins/{twin}/events?after={after}&limit=1000"))
            .await
            .expect("read history");
        assert_eq!(a.status, 200, "history of {twin}: {}", a.body);
        let events = a.body["events"].as_array().unwrap();
        if events.is_empty() {
            return out;
        }
        for e in events {
            let seq = e["seq"].as_u64().unwrap();
            out.entry(e["event_id"].as_str().unwrap().to_owned())
                .or_default()
                .push(seq);
            after = after.max(seq);
        }
    }
}

fn csv_path() -> PathBuf {
    if let Ok(p) = std::env::var("PALISADE_SOAK_OUT") {
        return PathBuf::from(p);
    }
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("target/soak/soak-{stamp}.csv"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak() {
    let secs = env_u64("PALISADE_SOAK_SECS", 75);
    let kill_every = env_u64("PALISADE_SOAK_KILL_EVERY_SECS", 20).max(1);
    let writers = env_u64("PALISADE_SOAK_WRITERS", 4).max(1) as usize;
    let use_kafka = std::env::var("PALISADE_SOAK_KAFKA").map_or(true, |v| v != "0");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // A copy of the binary: a rebuild during a long run must not change it.
    let bin = dir.path().join("palisade");
    std::fs::copy(env!("CARGO_BIN_EXE_palisade"), &bin).unwrap();
    let mut args: Vec<String> = [
        "--cache-mb",
        &CACHE_MB.to_string(),
        "--header-timeout-ms",
        &HEADER_MS.to_string(),
        "--body-timeout-ms",
        &BODY_MS.to_string(),
        "--idle-timeout-ms",
        &IDLE_MS.to_string(),
        "--partitions",
        &broker::PARTITIONS.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let publisher = if use_kafka {
        let topic = broker::TestTopic::new("soak");
        args.extend(topic.serve_args().into_iter().skip(2)); // --partitions is above
        Some(
            palisade_kafka::Publisher::new(
                &broker::broker().bootstrap,
                &topic.topic,
                &broker::broker().producer_settings(),
            )
            .expect("a Kafka publisher"),
        )
    } else {
        None
    };
    let start_server = |args: &[String]| {
        let child = std::process::Command::new(&bin)
            .arg("serve")
            .arg("--data")
            .arg(&data)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn palisade serve");
        ServeProcess::ready(child)
    };

    let mut server = start_server(&args);
    // Give the store a moment, then the quiet baseline (no load yet).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base_fds = open_fds(server.child.id());
    let (base_rss, _) = proc_status(server.child.id());
    let s = Arc::new(Soak {
        base: RwLock::new(server.base.clone()),
        addr: RwLock::new(addr_of(&server.base)),
        stop: AtomicBool::new(false),
        counts: Counts::default(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            // Below the server's idle timeout: never reuse a connection the
            // server is closing.
            .pool_idle_timeout(Duration::from_millis(IDLE_MS / 2))
            .build()
            .unwrap(),
        acked: Mutex::new(HashMap::new()),
        kafka: Mutex::new(Vec::new()),
        oddities: Mutex::new(Vec::new()),
    });
    let mut load = tokio::task::JoinSet::new();
    for w in 0..writers {
        load.spawn(writer(s.clone(), w));
    }
    load.spawn(reader(s.clone(), writers));
    load.spawn(watchers(s.clone(), writers));
    load.spawn(lease_churn(s.clone()));
    load.spawn(slow_clients(s.clone()));
    if let Some(p) = publisher {
        load.spawn(kafka_load(s.clone(), p));
    }

    let csv = csv_path();
    std::fs::create_dir_all(csv.parent().unwrap()).unwrap();
    let mut out = std::fs::File::create(&csv).unwrap();
    writeln!(out, "{COLUMNS}").unwrap();
    println!("soak: {secs} s, SIGKILL every {kill_every} s, {writers} writers, kafka {use_kafka}; CSV {}", csv.display());
    let t0 = Instant::now();
    let mut next_kill = Duration::from_secs(kill_every);
    let (mut rss_max, mut fds_max) = (0u64, 0u64);
    let sample = |server: &ServeProcess, out: &mut std::fs::File| {
        let pid = server.child.id();
        let (rss, threads) = proc_status(pid);
        let fds = open_fds(pid);
        writeln!(
            out,
            "{:.1},{pid},{rss},{fds},{threads},{},{}",
            t0.elapsed().as_secs_f64(),
            disk_kib(&data),
            s.counts.row()
        )
        .unwrap();
        (rss, fds)
    };
    while t0.elapsed() < Duration::from_secs(secs) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (rss, fds) = sample(&server, &mut out);
        rss_max = rss_max.max(rss);
        fds_max = fds_max.max(fds);
        if t0.elapsed() >= next_kill
            && t0.elapsed() + Duration::from_secs(5) < Duration::from_secs(secs)
        {
            next_kill += Duration::from_secs(kill_every);
            server.kill();
            server = start_server(&args);
            *s.base.write().unwrap() = server.base.clone();
            *s.addr.write().unwrap() = addr_of(&server.base);
            s.counts.restarts.fetch_add(1, Relaxed);
        }
    }
    s.stop.store(true, Relaxed);
    while load.join_next().await.is_some() {}

    // Kafka: wait until every record the broker acknowledged is applied.
    let sent: Vec<(String, String)> = s.kafka.lock().unwrap().clone();
    let mut by_twin: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (twin, id) in &sent {
        by_twin.entry(twin.clone()).or_default().push(id.clone());
    }
    let wait = Instant::now();
    let mut kafka_histories = BTreeMap::new();
    for (twin, ids) in &by_twin {
        loop {
            let h = history(&s, twin).await;
            if ids.iter().all(|id| h.contains_key(id)) || wait.elapsed() > Duration::from_secs(180)
            {
                kafka_histories.insert(twin.clone(), h);
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            sample(&server, &mut out);
        }
    }

    // Quiet: the server closes idle connections, then the final sample.
    tokio::time::sleep(Duration::from_millis(IDLE_MS + 3000)).await;
    let (end_rss, end_fds) = sample(&server, &mut out);
    out.flush().unwrap();

    // Nothing acknowledged missing or twice; no event id twice anywhere.
    let acked = s.acked.lock().unwrap().clone();
    let mut missing = Vec::new();
    let mut twice = Vec::new();
    let mut wrong_seq = Vec::new();
    for w in 0..writers {
        let twin = format!("soak-w{w}");
        let h = history(&s, &twin).await;
        for (id, seqs) in &h {
            if seqs.len() > 1 {
                twice.push(format!("{twin} {id} {seqs:?}"));
            }
        }
        for (id, (t, seq)) in acked.iter().filter(|(_, (t, _))| *t == twin) {
            match h.get(id) {
                None => missing.push(format!("{t} {id} (acked at seq {seq})")),
                Some(seqs) if !seqs.contains(seq) => {
                    wrong_seq.push(format!("{t} {id}: acked {seq}, stored {seqs:?}"))
                }
                Some(_) => {}
            }
        }
    }
    for (twin, ids) in &by_twin {
        let h = &kafka_histories[twin];
        for id in ids {
            match h.get(id).map(Vec::len) {
                None => missing.push(format!("kafka {twin} {id}")),
                Some(1) => {}
                Some(n) => twice.push(format!("kafka {twin} {id} x{n}")),
            }
        }
    }
    let c = &s.counts;
    let summary = format!(
        "SOAK secs={secs} restarts={} acked_events={} append_requests={} retries={} reads={} \
         watch_streams={} watch_events={} lease_ops={} stale_refused={} kafka_records={} slow_closed={} \
         transport_errors={} | rss_kib baseline={base_rss} max={rss_max} end={end_rss} | fds baseline={base_fds} \
         max={fds_max} end={end_fds} | data_kib={} | missing={} twice={} wrong_seq={} stale_accepted={} \
         slow_late={} storage_failed={} unexpected={}",
        c.restarts.load(Relaxed),
        c.acked_events.load(Relaxed),
        c.append_requests.load(Relaxed),
        c.append_retries.load(Relaxed),
        c.reads.load(Relaxed),
        c.watch_streams.load(Relaxed),
        c.watch_events.load(Relaxed),
        c.lease_ops.load(Relaxed),
        c.stale_refused.load(Relaxed),
        sent.len(),
        c.slow_closed.load(Relaxed),
        c.transport_errors.load(Relaxed),
        disk_kib(&data),
        missing.len(),
        twice.len(),
        wrong_seq.len(),
        c.stale_accepted.load(Relaxed),
        c.slow_late.load(Relaxed),
        c.storage_failed.load(Relaxed),
        c.unexpected.load(Relaxed),
    );
    println!("{summary}");
    let summary_path = csv.with_extension("summary.txt");
    std::fs::write(&summary_path, format!("{summary}\n")).unwrap();
    server.terminate();

    assert!(
        missing.is_empty(),
        "acknowledged but missing: {:?}",
        &missing[..missing.len().min(20)]
    );
    assert!(
        twice.is_empty(),
        "stored twice: {:?}",
        &twice[..twice.len().min(20)]
    );
    assert!(
        wrong_seq.is_empty(),
        "at another seq than acknowledged: {:?}",
        &wrong_seq[..wrong_seq.len().min(20)]
    );
    assert_eq!(c.stale_accepted.load(Relaxed), 0, "stale writes accepted");
    assert_eq!(
        c.slow_late.load(Relaxed),
        0,
        "slow clients not closed within their timeout + 10 s"
    );
    assert_eq!(
        c.storage_failed.load(Relaxed),
        0,
        "answers with storage_failed"
    );
    assert_eq!(
        c.unexpected.load(Relaxed),
        0,
        "unexpected answers: {:?}",
        s.oddities.lock().unwrap()
    );
    assert!(
        c.acked_events.load(Relaxed) > 0
            && c.reads.load(Relaxed) > 0
            && c.stale_refused.load(Relaxed) > 0,
        "{summary}"
    );
    assert!(
        secs < kill_every + 5 || c.restarts.load(Relaxed) >= 1,
        "{summary}"
    );
    // Back to a bounded level once the load is gone: descriptors near the
    // fresh store's (a few more log segments and sled files are fine), and
    // memory within the page cache and a margin of a fresh store's.
    assert!(
        end_fds <= base_fds + 16,
        "open fds {end_fds} after the load vs {base_fds} on a fresh store"
    );
    let rss_bound = base_rss + 2 * CACHE_MB * 1024 + 128 * 1024;
    assert!(
        end_rss <= rss_bound,
        "RSS {end_rss} KiB after the load, bound {rss_bound} KiB"
    );
}
