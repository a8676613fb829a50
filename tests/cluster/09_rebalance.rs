//! Incremental rebalancing under load (issue 16, decision 0034): the
//! cluster consumer uses `cooperative-sticky` assignment, so a rebalance
//! revokes only the partitions that move, and a partition waiting for its
//! owner lease is paused aside instead of blocking the consume loop.
//! Asserted, with real `palisade serve --cluster-node` processes on a real
//! broker and a real etcd, while writers append without pause (each event
//! retried with its id until acknowledged):
//!
//! - a third node joins two that serve appends: the partitions that did not
//!   move (same owner node and owner token before and after) see no failed
//!   append at all while the group rebalances; some partitions do move;
//! - a node leaves with SIGTERM, later another is SIGKILLed, under load;
//! - nothing acknowledged is lost: every acknowledged event is in its
//!   twin's history exactly once.
//!
//! Shown to fail with eager assignment (`--kafka-setting
//! partition.assignment.strategy=range` on the nodes): every partition is
//! revoked on the join, and the unmoved partitions' appends get `503`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use palisade::core::{partition_for, TwinId};
use serde_json::{json, Value};

use crate::broker::{broker, unique, PARTITIONS};
use crate::etcd::Etcd;
use crate::three_nodes::{http, twin, Cluster, Node, STEP};

/// The third node is joining (from its start until every partition is
/// served again).
const JOINING: u8 = 1;

#[derive(Default)]
struct Report {
    /// Acknowledged event ids, in order.
    acked: Vec<String>,
    /// Failed attempts: (phase, what failed).
    failures: Vec<(u8, String)>,
    /// When the first and the last failed attempt of the join happened (for
    /// the printed summary only: how long a moved partition paused).
    join_window: Option<(Instant, Instant)>,
}

/// Append events `{twin}-0`, `{twin}-1`, ... through `base` (redirects
/// followed), each retried with its id until acknowledged, until `stop`.
async fn writer(
    base: String,
    tw: String,
    token: u64,
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicU8>,
    report: Arc<Mutex<Report>>,
) {
    let c = http();
    let started = Instant::now();
    for i in 0u64.. {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let id = format!("{tw}-{i}");
        loop {
            let r = c
                .post(format!("{base}/v1/twins/{tw}/events"))
                .header("fencing-token", token.to_string())
                .json(&json!({"type": "set", "patch": {"i": i}, "event_id": id}))
                .send()
                .await;
            let failure = match r {
                Ok(r) if r.status().as_u16() == 201 => None,
                Ok(r) => Some(format!(
                    "{} {}",
                    r.status(),
                    r.text().await.unwrap_or_default()
                )),
                Err(e) => Some(e.to_string()),
            };
            let Some(f) = failure else {
                report.lock().unwrap().acked.push(id);
                break;
            };
            assert!(
                !f.starts_with("4"),
                "{id}: refused, not a transient failure: {f}"
            );
            {
                let ph = phase.load(Ordering::SeqCst);
                let mut rep = report.lock().unwrap();
                if ph == JOINING {
                    let now = Instant::now();
                    rep.join_window = Some(rep.join_window.map_or((now, now), |(a, _)| (a, now)));
                }
                rep.failures.push((ph, f));
            }
            assert!(started.elapsed() < STEP * 4, "{id} never acknowledged");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Partition -> (owner node, owner token), once every partition is served
/// by `owners` distinct nodes (asked of `node`).
async fn settled(node: &Node, owners: usize) -> BTreeMap<u64, (String, u64)> {
    let started = Instant::now();
    loop {
        if let Ok(r) = http()
            .get(format!("{}/v1/partitions", node.base))
            .send()
            .await
        {
            if let Ok(view) = r.json::<Value>().await {
                let parts: BTreeMap<u64, (String, u64)> = view["partitions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["cluster"]["status"] == "serving")
                    .map(|p| {
                        (
                            p["partition"].as_u64().unwrap(),
                            (
                                p["cluster"]["node"].as_str().unwrap().to_owned(),
                                p["cluster"]["owner_token"].as_u64().unwrap(),
                            ),
                        )
                    })
                    .collect();
                let nodes: BTreeSet<&String> = parts.values().map(|(n, _)| n).collect();
                if parts.len() == PARTITIONS as usize && nodes.len() == owners {
                    return parts;
                }
            }
        }
        assert!(started.elapsed() < STEP, "never settled on {owners} nodes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Until every writer has `n` more acknowledged events than now.
async fn progress(reports: &[Arc<Mutex<Report>>], n: usize) {
    let from: Vec<usize> = reports
        .iter()
        .map(|r| r.lock().unwrap().acked.len())
        .collect();
    let started = Instant::now();
    while reports
        .iter()
        .zip(&from)
        .any(|(r, f)| r.lock().unwrap().acked.len() < f + n)
    {
        assert!(started.elapsed() < STEP, "writers stalled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebalances_move_only_what_moves_and_lose_nothing_when_installed() {
    let Some(etcd) =
        Etcd::start("rebalances_move_only_what_moves_and_lose_nothing_when_installed").await
    else {
        return;
    };
    let cluster = Cluster::on(&etcd, "cluster-rebalance");
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (0..2)
        .map(|i| cluster.start(&format!("n{i}"), dir.path()))
        .collect();
    // Two twins per partition, each with its own lease and writer.
    let twins: Vec<(String, u32)> = (0..)
        .map(|i| format!("rb-{i}"))
        .map(|t| {
            let p = partition_for(&TwinId::new(t.as_str()).unwrap(), PARTITIONS).0;
            (t, p)
        })
        .scan(BTreeMap::<u32, usize>::new(), |per, (t, p)| {
            let n = per.entry(p).or_default();
            *n += 1;
            Some((*n <= 2).then_some((t, p)))
        })
        .flatten()
        .take(2 * PARTITIONS as usize)
        .collect();
    let mut tokens = BTreeMap::new();
    for (t, _) in &twins {
        let r = http()
            .post(format!("{}/v1/leases", nodes[0].base))
            .json(&json!({"scope": format!("twin/{t}"), "holder": format!("w-{t}"), "ttl_ms": 3_600_000}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
        tokens.insert(
            t.clone(),
            r.json::<Value>().await.unwrap()["token"].as_u64().unwrap(),
        );
    }
    let before = settled(&nodes[0], 2).await;

    let stop = Arc::new(AtomicBool::new(false));
    let phase = Arc::new(AtomicU8::new(0));
    let reports: Vec<Arc<Mutex<Report>>> = twins.iter().map(|_| Arc::default()).collect();
    let writers: Vec<_> = twins
        .iter()
        .zip(&reports)
        .map(|((t, _), r)| {
            tokio::spawn(writer(
                nodes[0].base.clone(),
                t.clone(),
                tokens[t],
                stop.clone(),
                phase.clone(),
                r.clone(),
            ))
        })
        .collect();
    progress(&reports, 3).await;

    // A third node joins while the two serve appends.
    phase.store(JOINING, Ordering::SeqCst);
    nodes.push(cluster.start("n2", dir.path()));
    let after = settled(&nodes[0], 3).await;
    phase.store(2, Ordering::SeqCst);
    progress(&reports, 3).await;
    let unmoved: BTreeSet<u64> = before
        .iter()
        .filter(|(p, o)| after.get(p) == Some(o))
        .map(|(p, _)| *p)
        .collect();
    assert!(
        unmoved.len() < PARTITIONS as usize,
        "the third node took partitions: {before:?} -> {after:?}"
    );
    assert!(
        !unmoved.is_empty(),
        "some partitions stayed: {before:?} -> {after:?}"
    );
    for ((t, p), r) in twins.iter().zip(&reports) {
        if unmoved.contains(&u64::from(*p)) {
            let failed: Vec<String> = r
                .lock()
                .unwrap()
                .failures
                .iter()
                .filter(|(ph, _)| *ph == JOINING)
                .map(|(_, f)| f.clone())
                .collect();
            assert!(
                failed.is_empty(),
                "{t} (partition {p}, which did not move: {before:?} -> {after:?}) failed while the third node joined: {failed:?}"
            );
        }
    }

    eprintln!("rebalance: owners {before:?} -> {after:?}; unmoved {unmoved:?}");
    for ((t, p), r) in twins.iter().zip(&reports) {
        let r = r.lock().unwrap();
        let n = r.failures.iter().filter(|(ph, _)| *ph == JOINING).count();
        let ms = r.join_window.map_or(0, |(a, b)| (b - a).as_millis());
        eprintln!("rebalance: join: {t} (partition {p}): {n} failed attempts over {ms} ms");
    }

    // A node leaves cleanly, then another dies, both under load.
    phase.store(3, Ordering::SeqCst);
    nodes[2].terminate();
    settled(&nodes[0], 2).await;
    progress(&reports, 3).await;
    nodes[1].kill();
    settled(&nodes[0], 1).await;
    progress(&reports, 3).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }

    // Nothing acknowledged is lost, nor stored twice.
    let live = [&nodes[0]];
    for ((t, _), r) in twins.iter().zip(&reports) {
        let mut ids: Vec<String> = Vec::new();
        let mut after = 0u64;
        loop {
            let page = twin(&live, t, &format!("/events?after={after}&limit=1000")).await;
            let events = page["events"].as_array().unwrap();
            if events.is_empty() {
                break;
            }
            ids.extend(
                events
                    .iter()
                    .map(|e| e["event_id"].as_str().unwrap().to_owned()),
            );
            after = page["next_after"].as_u64().unwrap();
        }
        let acked = r.lock().unwrap().acked.clone();
        let failures = r.lock().unwrap().failures.len();
        eprintln!(
            "rebalance: {t}: {} acknowledged, {failures} failed attempts",
            acked.len()
        );
        assert!(acked.len() >= 12, "{t}: {} acknowledged", acked.len());
        for id in &acked {
            assert_eq!(
                ids.iter().filter(|i| *i == id).count(),
                1,
                "acknowledged {id} must be in {t}'s history once: {ids:?}"
            );
        }
    }
    drop(nodes);
}

/// Standard base64 (for etcd's JSON gateway).
fn b64(data: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// POST `body` to etcd's JSON gateway (`/v3/...`).
async fn etcd_v3(endpoint: &str, path: &str, body: Value) -> Value {
    let r = http()
        .post(format!("{endpoint}/v3/{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "etcd {path}: {}", r.status());
    r.json().await.unwrap()
}

/// A partition whose owner lease another holder keeps (as a node that is
/// still alive in etcd but no longer in the group would) is paused aside:
/// the node's other partitions are served and acknowledge appends
/// meanwhile, and once the lease is free the paused partition resumes at
/// the record that waited (it is not skipped).
///
/// Shown to fail with the consume loop awaiting the owner lease in line
/// (the other partitions' appends are never acknowledged).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_waiting_for_its_owner_lease_holds_up_no_other_when_installed() {
    let Some(etcd) =
        Etcd::start("a_partition_waiting_for_its_owner_lease_holds_up_no_other_when_installed")
            .await
    else {
        return;
    };
    let topic = unique("cluster-squat");
    broker().create_topic(&topic, PARTITIONS);
    let prefix = format!("/{topic}/");
    // Partition 0's owner key, held under a long etcd lease by someone else.
    let squatted = 0u32;
    let lease = etcd_v3(&etcd.endpoint, "lease/grant", json!({"TTL": 600})).await;
    let lease_id = lease["ID"].as_str().unwrap().to_owned();
    etcd_v3(
        &etcd.endpoint,
        "kv/put",
        json!({
            "key": b64(format!("{prefix}owner/{squatted:05}").as_bytes()),
            "value": b64(br#"{"node":"squatter","url":"http://127.0.0.1:9"}"#),
            "lease": lease_id,
        }),
    )
    .await;
    // A record waiting in the squatted partition (garbage: a dead letter
    // once applied).
    let waiting_offset = {
        use rdkafka::message::{Header, OwnedHeaders};
        let rec = rdkafka::producer::FutureRecord::to(&topic)
            .partition(i32::try_from(squatted).unwrap())
            .key("waiting")
            .payload("not json")
            .headers(OwnedHeaders::new().insert(Header {
                key: "content-type",
                value: Some(b"application/json".as_slice()),
            }));
        let d = broker()
            .raw_producer()
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        u64::try_from(d.offset).unwrap()
    };
    let cluster = Cluster {
        group: format!("{topic}-group"),
        topic: topic.clone(),
        etcd: etcd.endpoint.clone(),
        prefix,
        partitions: PARTITIONS,
    };
    let dir = tempfile::tempdir().unwrap();
    let node = cluster.start("n0", dir.path());
    let twin_of = |p: u32| {
        (0..)
            .map(|i| format!("sq-{i}"))
            .find(|t| partition_for(&TwinId::new(t.as_str()).unwrap(), PARTITIONS).0 == p)
            .unwrap()
    };
    let token = |t: String| {
        let base = node.base.clone();
        async move {
            let r = http()
                .post(format!("{base}/v1/leases"))
                .json(&json!({"scope": format!("twin/{t}"), "holder": "w", "ttl_ms": 3_600_000}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 201);
            r.json::<Value>().await.unwrap()["token"].as_u64().unwrap()
        }
    };
    let append = |t: String, token: u64| {
        let base = node.base.clone();
        async move {
            let started = Instant::now();
            loop {
                let r = http()
                    .post(format!("{base}/v1/twins/{t}/events"))
                    .header("fencing-token", token.to_string())
                    .json(&json!({"type": "set", "patch": {"ok": true}, "event_id": "e1"}))
                    .send()
                    .await;
                let last = match r {
                    Ok(r) if r.status().as_u16() == 201 => return,
                    Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                    Err(e) => e.to_string(),
                };
                assert!(
                    started.elapsed() < STEP,
                    "{t} never acknowledged while partition {squatted} waits: {last}"
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    // The other partitions acknowledge while partition 0 waits.
    for p in (0..PARTITIONS).filter(|p| *p != squatted) {
        let t = twin_of(p);
        let k = token(t.clone()).await;
        append(t, k).await;
    }
    let view: Value = http()
        .get(format!("{}/v1/partitions", node.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let p0 = &view["partitions"][squatted as usize]["cluster"];
    assert_eq!(
        (p0["node"].as_str(), p0["status"].as_str()),
        (Some("squatter"), Some("unreachable")),
        "partition {squatted} is still held elsewhere: {view}"
    );

    // The lease is let go: the partition resumes at the record that waited.
    etcd_v3(&etcd.endpoint, "lease/revoke", json!({"ID": lease_id})).await;
    let t = twin_of(squatted);
    let k = token(t.clone()).await;
    append(t, k).await;
    let dl: Value = http()
        .get(format!(
            "{}/v1/dead-letters?partition={squatted}&limit=100",
            node.base
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        dl["dead_letters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["offset"] == waiting_offset && d["key"] == "waiting"),
        "the record that waited at offset {waiting_offset} was skipped: {dl}"
    );
    drop(node);
}
