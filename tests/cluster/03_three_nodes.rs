//! Three `palisade serve` nodes in one consumer group, on a real
//! Kafka-protocol broker and a real etcd, all on loopback. A node is killed,
//! another paused past its owner lease (SIGSTOP), then every node restarted
//! in turn, with appends between the faults. Asserted:
//!
//! - every acknowledged event is in its twin's history, exactly once;
//! - owner tokens never go down for any partition (the owner markers in the
//!   nodes' logs, in Kafka order), and every node that applied a marker saw
//!   the same token at the same offset;
//! - a takeover at a later time never has a lower token;
//! - a fresh node replaying the whole topic alone reaches the same state and
//!   version for every twin (it converges to what one node computes).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::broker::{broker, unique, PARTITIONS};
use crate::etcd::Etcd;

/// A node process; its stderr (the tracing log) is appended to `log`
/// across restarts.
pub(crate) struct Node {
    pub(crate) id: String,
    data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    pub(crate) base: String,
    /// More `palisade serve` arguments, kept across restarts.
    extra: Vec<String>,
}

#[derive(Clone)]
pub(crate) struct Cluster {
    pub(crate) topic: String,
    pub(crate) group: String,
    pub(crate) etcd: String,
    pub(crate) prefix: String,
    /// Store partitions (= topic partitions).
    pub(crate) partitions: u32,
}

impl Cluster {
    /// A cluster of its own on `etcd` and the suite's broker: a new topic of
    /// [`PARTITIONS`] partitions named after `name`, its group and etcd
    /// prefix.
    pub(crate) fn on(etcd: &Etcd, name: &str) -> Self {
        let topic = unique(name);
        broker().create_topic(&topic, PARTITIONS);
        Self {
            group: format!("{topic}-group"),
            prefix: format!("/{topic}/"),
            etcd: etcd.endpoint.clone(),
            topic,
            partitions: PARTITIONS,
        }
    }

    pub(crate) fn start(&self, id: &str, dir: &Path) -> Node {
        self.start_with(id, dir, &[])
    }

    /// [`Self::launch`] with these more `palisade serve` arguments, kept
    /// for later restarts.
    pub(crate) fn launch_with(&self, n: &mut Node, extra: &[&str]) {
        n.extra = extra.iter().map(|&a| a.to_owned()).collect();
        self.launch(n);
    }

    /// [`Self::start`] with more `palisade serve` arguments (kept for
    /// restarts).
    pub(crate) fn start_with(&self, id: &str, dir: &Path, extra: &[&str]) -> Node {
        self.try_start_with(id, dir, extra)
            .unwrap_or_else(|log| panic!("node {id} did not start: {log}"))
    }

    /// (Re)start node `n`'s process with its more arguments.
    pub(crate) fn launch(&self, n: &mut Node) {
        if let Err(log) = self.try_launch(n) {
            panic!("node {} did not start; log:\n{log}", n.id);
        }
    }

    /// [`Self::start_with`] for a node that may refuse to start: its log
    /// if it exits before listening.
    pub(crate) fn try_start_with(
        &self,
        id: &str,
        dir: &Path,
        extra: &[&str],
    ) -> Result<Node, String> {
        let mut n = Node {
            id: id.to_owned(),
            data: dir.join(id),
            log: dir.join(format!("{id}.log")),
            child: None,
            base: String::new(),
            extra: extra.iter().map(|&a| a.to_owned()).collect(),
        };
        self.try_launch(&mut n).map(|()| n)
    }

    /// (Re)start node `n`'s process: `Err(its log)` if it exits before it
    /// listens.
    fn try_launch(&self, n: &mut Node) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&n.log)
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
            .arg("serve")
            .arg("--data")
            .arg(&n.data)
            .args(["--listen", "127.0.0.1:0"])
            .args(["--partitions", &self.partitions.to_string()])
            .args(["--kafka-brokers", &broker().bootstrap])
            .args(["--kafka-topic", &self.topic, "--kafka-group", &self.group])
            .args(["--kafka-setting", "session.timeout.ms=6000"])
            .args(["--kafka-setting", "heartbeat.interval.ms=500"])
            // librdkafka's mock broker holds every fetch for the full
            // fetch.wait.max.ms (500 ms by default) even when records
            // arrive; Apache Kafka answers as soon as one is there. Without
            // this, every cluster-mode append waits ~500 ms on the mock.
            .args(["--kafka-setting", "fetch.wait.max.ms=5"])
            .args(["--lease-backend", "etcd", "--etcd-endpoints", &self.etcd])
            .args(["--etcd-prefix", &self.prefix, "--cluster-node", &n.id])
            .args(&n.extra)
            .env(
                "RUST_LOG",
                "warn,palisade_server::cluster=info,palisade_kafka::cluster=info",
            )
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn palisade serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let Some(base) = line.trim().strip_prefix("palisade listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("first line {line:?}; log:\n{}", read(&n.log)));
        };
        n.base = base.to_owned();
        n.child = Some(child);
        Ok(())
    }
}

impl Node {
    pub(crate) fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id();
        assert!(Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success());
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let status = c.wait().unwrap();
            assert!(
                status.success(),
                "node {} exited with {status}; log:\n{}",
                self.id,
                read(&self.log)
            );
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(c.id().to_string())
                .status();
        }
        self.kill();
    }
}

pub(crate) fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

pub(crate) fn http() -> reqwest::Client {
    // Follows the cluster's 307 redirects (method and body kept).
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Liveness deadline for one step (a rebalance plus a lease expiry on the
/// mock broker take seconds); not a timing assertion.
pub(crate) const STEP: Duration = Duration::from_secs(180);

/// POST until acknowledged (201), through whichever live node answers,
/// with the same event id every time (a retried append is stored once).
pub(crate) async fn append_acked(
    nodes: &[&Node],
    twin: &str,
    token: u64,
    event_id: &str,
    patch: &Value,
) {
    let c = http();
    let started = Instant::now();
    let mut i = 0usize;
    let mut last;
    loop {
        let n = nodes[i % nodes.len()];
        i += 1;
        let r = c
            .post(format!("{}/v1/twins/{twin}/events", n.base))
            .header("fencing-token", token.to_string())
            .header("content-type", "application/json")
            .body(json!({"type": "set", "patch": patch, "event_id": event_id}).to_string())
            .send()
            .await;
        match r {
            Ok(r) if r.status().as_u16() == 201 => {
                let owner = r
                    .headers()
                    .get("palisade-owner")
                    .map(|v| v.to_str().unwrap().to_owned());
                assert!(owner.is_some(), "a 201 names the node that owns the twin");
                return;
            }
            Ok(r) => {
                let s = r.status().as_u16();
                let body = r.text().await.unwrap_or_default();
                assert!(s == 503, "append {event_id} of {twin}: {s} {body}");
                last = body;
            }
            Err(e) => last = e.to_string(),
        }
        assert!(
            started.elapsed() < STEP,
            "append {event_id} of {twin} never acknowledged: {last}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// GET a twin through the cluster (redirects followed) until a node serves it.
pub(crate) async fn twin(nodes: &[&Node], twin: &str, what: &str) -> Value {
    let c = http();
    let started = Instant::now();
    let mut i = 0usize;
    loop {
        let n = nodes[i % nodes.len()];
        i += 1;
        if let Ok(r) = c
            .get(format!("{}/v1/twins/{twin}{what}", n.base))
            .send()
            .await
        {
            if r.status().as_u16() == 200 {
                assert!(
                    r.headers().get("palisade-owner").is_some(),
                    "a read names the owner"
                );
                return r.json().await.unwrap();
            }
            if r.status().as_u16() == 404 {
                return Value::Null;
            }
        }
        assert!(started.elapsed() < STEP, "{twin} never served");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The cluster-wide `/v1/partitions` through `node`.
async fn partitions(node: &Node) -> Value {
    http()
        .get(format!("{}/v1/partitions", node.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A one-hour lease on each twin (holder `w-<twin>`), granted through
/// `node`: twin -> (token, lease id).
pub(crate) async fn lease_twins(node: &Node, twins: &[String]) -> BTreeMap<String, (u64, String)> {
    let mut out = BTreeMap::new();
    for t in twins {
        let r = http()
            .post(format!("{}/v1/leases", node.base))
            .json(&json!({"scope": format!("twin/{t}"), "holder": format!("w-{t}"), "ttl_ms": 3_600_000}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
        let v: Value = r.json().await.unwrap();
        out.insert(
            t.clone(),
            (
                v["token"].as_u64().unwrap(),
                v["lease_id"].as_str().unwrap().to_owned(),
            ),
        );
    }
    out
}

/// `key=value` fields of the log lines containing `needle`.
fn log_fields(log: &str, needle: &str) -> Vec<(String, HashMap<String, String>)> {
    log.lines()
        .filter(|l| l.contains(needle))
        .map(|l| {
            let time = l.split_whitespace().next().unwrap_or_default().to_owned();
            let fields = l
                .split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            (time, fields)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_kill_pause_restart_lose_nothing_and_converge_when_installed() {
    let Some(etcd) =
        Etcd::start("three_nodes_kill_pause_restart_lose_nothing_and_converge_when_installed")
            .await
    else {
        return;
    };
    let cluster = Cluster::on(&etcd, "cluster3");
    let topic = cluster.topic.clone();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| cluster.start(&format!("n{i}"), dir.path()))
        .collect();
    let twins: Vec<String> = (0..8).map(|i| format!("tw-{i}")).collect();

    // One twin lease per twin, granted by etcd through node 0; the grant
    // reaches the owner through the partition's log.
    let tokens: BTreeMap<String, u64> = lease_twins(&nodes[0], &twins)
        .await
        .into_iter()
        .map(|(t, (token, _))| (t, token))
        .collect();
    // Acknowledged events: twin -> (event id -> key written).
    let mut acked: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut r = 0u32;
    macro_rules! round {
        ($live:expr) => {{
            r += 1;
            let live: Vec<&Node> = $live.iter().map(|i: &usize| &nodes[*i]).collect();
            for t in &twins {
                let (id, key) = (format!("{t}-r{r}"), format!("r{r}"));
                append_acked(&live, t, tokens[t], &id, &json!({ key.clone(): r })).await;
                acked.entry(t.clone()).or_default().push((id, key));
            }
        }};
    }

    round!([0usize, 1, 2]);

    // Refusals through the cluster are those of one node: a superseded
    // holder gets 409 stale_token (the new grant fenced it, in log order),
    // a token of another twin 403 token_scope_mismatch; neither is stored.
    {
        let all: Vec<&Node> = nodes.iter().collect();
        let c = http();
        let lease = |holder: &'static str| {
            let c = c.clone();
            let base = nodes[2].base.clone();
            async move {
                let r = c
                    .post(format!("{base}/v1/leases"))
                    .json(&json!({"scope": "twin/tw-x", "holder": holder, "ttl_ms": 60_000}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 201);
                r.json::<Value>().await.unwrap()
            }
        };
        let a = lease("a").await;
        let ta = a["token"].as_u64().unwrap();
        append_acked(&all, "tw-x", ta, "x-a", &json!({"by": "a"})).await;
        let released = c
            .delete(format!(
                "{}/v1/leases/{}",
                nodes[1].base,
                a["lease_id"].as_str().unwrap()
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(released.status().as_u16(), 204);
        let tb = lease("b").await["token"].as_u64().unwrap();
        assert!(tb > ta);
        let refused = |twin: &'static str, token: u64, id: &'static str| {
            let c = c.clone();
            let base = nodes[0].base.clone();
            async move {
                loop {
                    let r = c
                        .post(format!("{base}/v1/twins/{twin}/events"))
                        .header("fencing-token", token.to_string())
                        .json(&json!({"type": "set", "patch": {"by": id}, "event_id": id}))
                        .send()
                        .await
                        .unwrap();
                    if r.status().as_u16() != 503 {
                        return (r.status().as_u16(), r.json::<Value>().await.unwrap());
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
        };
        let (s, body) = refused("tw-x", ta, "x-late").await;
        assert_eq!(
            (s, body["error"].as_str()),
            (409, Some("stale_token")),
            "{body}"
        );
        assert_eq!(body["fence"], tb);
        let (s, body) = refused("tw-1", tokens["tw-0"], "x-scope").await;
        assert_eq!(
            (s, body["error"].as_str()),
            (403, Some("token_scope_mismatch")),
            "{body}"
        );
        append_acked(&all, "tw-x", tb, "x-b", &json!({"by": "b"})).await;
        let x = twin(&all, "tw-x", "").await;
        assert_eq!(x["state"]["by"], "b");
        assert_eq!(x["fence"], tb);
    }

    // 1. SIGKILL a node: its partitions move once Kafka and etcd notice.
    nodes[1].kill();
    round!([0usize, 2]);
    let n1 = &mut nodes[1];
    cluster.launch(n1);
    round!([0usize, 1, 2]);

    // 2. SIGSTOP a node past its owner lease (3 s) and its Kafka session
    //    (6 s): the others take its partitions over with higher tokens.
    nodes[2].signal("STOP");
    round!([0usize, 1]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    nodes[2].signal("CONT");
    round!([0usize, 1, 2]);

    // A former owner's late write: a record produced under the first owner
    // token of tw-0's partition (long superseded), with the twin's valid
    // fencing token. Whoever applies it must refuse it (stale_owner).
    let late_p =
        palisade::core::partition_for(&palisade::core::TwinId::new("tw-0").unwrap(), PARTITIONS).0;
    // The partition must have had a former owner: with sticky assignment it
    // may have stayed on a node the faults above spared. Restart its owner
    // so it moves (to a higher owner token) whatever the assignment did.
    let owner = {
        let started = Instant::now();
        loop {
            let v = partitions(&nodes[0]).await;
            let node = v["partitions"][late_p as usize]["cluster"]["node"]
                .as_str()
                .map(str::to_owned);
            if let Some(n) = node.and_then(|n| nodes.iter().position(|x| x.id == n)) {
                break n;
            }
            assert!(
                started.elapsed() < STEP,
                "tw-0's partition has no owner: {v}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    nodes[owner].terminate();
    let others: Vec<usize> = (0..3).filter(|j| *j != owner).collect();
    round!(others);
    cluster.launch(&mut nodes[owner]);
    round!([0usize, 1, 2]);
    let first_owner = nodes
        .iter()
        .flat_map(|n| log_fields(&read(&n.log), "cluster: owner marker applied"))
        .filter(|(_, f)| f["partition"] == late_p.to_string())
        .map(|(_, f)| f["owner_token"].parse::<u64>().unwrap())
        .min()
        .expect("tw-0's partition had an owner");
    // The precondition of the check below: the partition's owner token now
    // is above the one the late write claims.
    let now_owner = partitions(&nodes[0]).await;
    let current = now_owner["partitions"][late_p as usize]["cluster"]["owner_token"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        first_owner < current,
        "tw-0's partition never changed owner ({first_owner} -> {current}): {now_owner}"
    );
    let late_offset = {
        use rdkafka::message::{Header, OwnedHeaders};
        let (t, o) = (tokens["tw-0"].to_string(), first_owner.to_string());
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "fencing-token",
                value: Some(t.as_bytes()),
            })
            .insert(Header {
                key: "content-type",
                value: Some(b"application/json".as_slice()),
            })
            .insert(Header {
                key: "palisade-owner-token",
                value: Some(o.as_bytes()),
            })
            .insert(Header {
                key: "palisade-node",
                value: Some(b"a-former-owner".as_slice()),
            });
        let value =
            json!([{"type": "set", "patch": {"late": 1}, "event_id": "late-write"}]).to_string();
        let rec = rdkafka::producer::FutureRecord::to(&topic)
            .partition(i32::try_from(late_p).unwrap())
            .key("tw-0")
            .payload(&value)
            .headers(headers);
        let delivery = broker()
            .raw_producer()
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        u64::try_from(delivery.offset).unwrap()
    };
    round!([0usize, 1, 2]);

    // 3. Restart every node in turn.
    for i in 0..3 {
        nodes[i].terminate();
        let others: Vec<usize> = (0..3).filter(|j| *j != i).collect();
        round!(others);
        let n = &mut nodes[i];
        cluster.launch(n);
    }
    round!([0usize, 1, 2]);

    // The late write was refused everywhere it was applied.
    let h = twin(
        &nodes.iter().collect::<Vec<_>>(),
        "tw-0",
        "/events?limit=1000",
    )
    .await;
    assert!(
        !h.to_string().contains("late-write"),
        "a former owner's late write was applied: {h}"
    );

    // No acknowledged event is lost (nor stored twice).
    let all: Vec<&Node> = nodes.iter().collect();
    let mut seen = BTreeMap::new();
    for t in &twins {
        let history = twin(&all, t, "/events?limit=1000").await;
        let ids: Vec<String> = history["events"]
            .as_array()
            .unwrap_or_else(|| panic!("history of {t}: {history}"))
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().to_owned())
            .collect();
        let state = twin(&all, t, "").await;
        for (id, key) in &acked[t] {
            assert_eq!(
                ids.iter().filter(|i| *i == id).count(),
                1,
                "acknowledged event {id} of {t} must be in its history once: {ids:?}"
            );
            assert!(state["state"].get(key).is_some(), "{t} lost {key}: {state}");
        }
        seen.insert(
            t.clone(),
            (state["state"].clone(), state["version"].clone()),
        );
    }
    for n in &mut nodes {
        n.terminate();
    }

    // Owner tokens never go down, per partition, in log order; all nodes
    // agree on the marker at each offset; later takeovers have higher tokens.
    let logs: Vec<String> = nodes.iter().map(|n| read(&n.log)).collect();
    let mut markers: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for log in &logs {
        for (_, f) in log_fields(log, "cluster: owner marker applied") {
            let key = (
                f["partition"].parse().unwrap(),
                f["offset"].parse().unwrap(),
            );
            let t: u64 = f["owner_token"].parse().unwrap();
            if let Some(prev) = markers.insert(key, t) {
                assert_eq!(
                    prev, t,
                    "two nodes applied different owner tokens at {key:?}"
                );
            }
        }
    }
    let mut last: HashMap<u64, u64> = HashMap::new();
    for ((p, offset), t) in &markers {
        let before = last.insert(*p, *t).unwrap_or(0);
        assert!(
            *t > before,
            "partition {p}: owner token {t} at offset {offset} after {before}"
        );
    }
    assert!(
        last.len() == PARTITIONS as usize,
        "every partition had an owner: {markers:?}"
    );
    let mut takes: Vec<(String, u64, u64)> = logs
        .iter()
        .flat_map(|l| log_fields(l, "cluster: took the partition-owner lease"))
        .map(|(time, f)| {
            (
                time,
                f["partition"].parse().unwrap(),
                f["owner_token"].parse().unwrap(),
            )
        })
        .collect();
    takes.sort();
    let mut by_time: HashMap<u64, u64> = HashMap::new();
    for (time, p, t) in &takes {
        let before = by_time.insert(*p, *t).unwrap_or(0);
        assert!(
            *t > before,
            "partition {p}: taken at {time} with token {t} after token {before}"
        );
    }
    // The pause was long enough to move partitions: someone logged a loss
    // or a late write refused, or the paused node gave partitions up.
    assert!(
        takes.len() > PARTITIONS as usize,
        "partitions never changed hands: {takes:?}"
    );

    // A fresh node alone, replaying the whole topic, converges to the same
    // state and version for every twin.
    let solo_cluster = Cluster {
        group: format!("{topic}-solo"),
        ..cluster
    };
    let solo = solo_cluster.start("solo", dir.path());
    for t in &twins {
        let s = twin(&[&solo], t, "").await;
        assert_eq!(
            (s["state"].clone(), s["version"].clone()),
            seen[t],
            "{t}: a single node replaying the log disagrees with the cluster"
        );
    }
    // ...and by a node replaying the log from scratch, for the same reason.
    let dl: Value = http()
        .get(format!(
            "{}/v1/dead-letters?partition={late_p}&limit=1000",
            solo.base
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        dl["dead_letters"].as_array().unwrap().iter().any(|d| d["offset"] == late_offset && d["reason"] == "stale_owner"),
        "the late write at offset {late_offset} of partition {late_p} is not a stale_owner dead letter: {dl}"
    );
    assert!(twin(&[&solo], "tw-0", "").await["state"]
        .get("late")
        .is_none());
    drop(solo);
}
