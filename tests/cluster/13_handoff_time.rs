//! Measurement, not a check (ignored; run by hand, release build): how long
//! a handoff takes against the length of the partition's log, with and
//! without partition snapshots (issue 16, decision 0038; figures in
//! `docs/scaling.md`, "Handoff with and without snapshots").
//!
//! ```text
//! PALISADE_HANDOFF_EVENTS=10000,30000 \
//!   cargo test --release --test cluster handoff_time -- --ignored --nocapture
//! ```
//!
//! librdkafka's mock broker keeps at most 5 MiB (or 100,000 records) per
//! partition and drops the oldest past it, so a node replaying from the
//! beginning finds the log cut: on the mock, lengths stay under ~40,000 of
//! these records. The rebuild alone at 10k/100k/1M, on real sled, is
//! `palisade-log`'s `rebuild_time` (`crates/palisade-log/tests/handoff.rs`).
//!
//! For each length N and each mode: a one-partition topic; node A takes it,
//! leases are granted, N worker records (one event each, over 100 twins)
//! are produced straight to Kafka and applied by A; with snapshots, A
//! writes one covering them all. A stops (SIGTERM: it gives its owner lease
//! up), and B, a fresh node, starts. Reported: from B's start to B's copy
//! holding all N events ("rebuilt"), and to B acknowledging an append
//! ("serving"); the snapshot's size and B's load time. Group join and the
//! owner-lease handover are in both modes' figures alike.

use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::{json, Value};

use crate::broker::{broker, unique};
use crate::etcd::Etcd;
use crate::three_nodes::{append_acked, http, lease_twins, read, Cluster, Node};

const TWINS: usize = 100;

/// Partition 0's head in `node`'s own copy (0 if it does not answer).
async fn local_head(node: &Node) -> u64 {
    let Ok(r) = http()
        .get(format!("{}/v1/partitions?scope=local", node.base))
        .send()
        .await
    else {
        return 0;
    };
    let v: Value = r.json().await.unwrap_or(Value::Null);
    v["partitions"][0]["head"].as_u64().unwrap_or(0)
}

struct Row {
    events: usize,
    snapshots: bool,
    rebuilt: Duration,
    serving: Duration,
    snapshot_bytes: u64,
    load_s: f64,
}

async fn one(etcd: &Etcd, events: usize, snapshots: bool) -> Row {
    let topic = unique("handoff");
    broker().create_topic(&topic, 1);
    let cluster = Cluster {
        group: format!("{topic}-group"),
        prefix: format!("/{topic}/"),
        etcd: etcd.endpoint.clone(),
        topic,
        partitions: 1,
    };
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snapshots");
    let snaps_arg = snaps.to_str().unwrap().to_owned();
    let args: Vec<&str> = if snapshots {
        vec![
            "--partition-snapshot-dir",
            &snaps_arg,
            "--partition-snapshot-interval-ms",
            "1000",
        ]
    } else {
        Vec::new()
    };
    let mut a = cluster.start_with("a", dir.path(), &args);
    let names: Vec<String> = (0..TWINS).map(|t| format!("h-{t}")).collect();
    let leases = lease_twins(&a, &names).await;
    let tokens: Vec<u64> = names.iter().map(|t| leases[t].0).collect();
    let producer = broker().raw_producer();
    let mut last_offset = 0i64;
    for chunk in (0..events).collect::<Vec<_>>().chunks(20_000) {
        let mut pending = Vec::with_capacity(chunk.len());
        for &i in chunk {
            let t = i % TWINS;
            let key = format!("h-{t}");
            let value =
                json!({"type": "reading", "patch": {"n": i, "v": i % 97}, "event_id": format!("e{i}")})
                    .to_string();
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: "fencing-token",
                    value: Some(tokens[t].to_string().as_bytes()),
                })
                .insert(Header {
                    key: "content-type",
                    value: Some("application/json".as_bytes()),
                });
            let rec = FutureRecord::to(&cluster.topic)
                .partition(0)
                .key(&key)
                .payload(&value)
                .headers(headers);
            // Queued at once (at most 20,000 at a time, below librdkafka's
            // queue limit); the delivery is awaited below.
            pending.push(
                producer
                    .send_result(rec)
                    .map_err(|(e, _)| e)
                    .expect("queued"),
            );
        }
        for f in pending {
            let d = f
                .await
                .expect("delivered")
                .map_err(|(e, _)| e)
                .expect("produced");
            last_offset = last_offset.max(d.offset);
        }
    }
    let started = Instant::now();
    let target = events as u64;
    while local_head(&a).await < target {
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "A never applied {events}; log:\n{}",
            read(&dir.path().join("a.log"))
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut snapshot_bytes = 0;
    if snapshots {
        let last = u64::try_from(last_offset).unwrap();
        loop {
            if let Ok(Some((path, o))) = palisade_log::handoff::latest(&snaps, &cluster.topic, 0) {
                if o >= last {
                    snapshot_bytes = std::fs::metadata(path).unwrap().len();
                    break;
                }
            }
            assert!(started.elapsed() < Duration::from_secs(1800), "no snapshot");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let head = local_head(&a).await;
    a.terminate();

    let t0 = Instant::now();
    let b = cluster.start_with("b", dir.path(), &args);
    while local_head(&b).await < head {
        assert!(
            t0.elapsed() < Duration::from_secs(1800),
            "B never rebuilt; log:\n{}",
            read(&dir.path().join("b.log"))
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rebuilt = t0.elapsed();
    append_acked(
        &[&b],
        "h-0",
        tokens[0],
        "after-handoff",
        &json!({"after": true}),
    )
    .await;
    let serving = t0.elapsed();
    let load_s = crate::snapshot::metric(&b, "palisade_partition_snapshot_load_seconds").await;
    Row {
        events,
        snapshots,
        rebuilt,
        serving,
        snapshot_bytes,
        load_s,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/scaling.md, run by hand in release"]
async fn handoff_time_against_log_length_with_and_without_snapshots_when_installed() {
    let Some(etcd) =
        Etcd::start("handoff_time_against_log_length_with_and_without_snapshots_when_installed")
            .await
    else {
        return;
    };
    let lengths: Vec<usize> = std::env::var("PALISADE_HANDOFF_EVENTS").map_or_else(
        |_| vec![10_000, 30_000],
        |v| v.split(',').map(|x| x.trim().parse().unwrap()).collect(),
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", load.trim());
    println!("| events | snapshots | rebuilt (s) | serving (s) | snapshot MB | load (s) |");
    println!("|---|---|---|---|---|---|");
    for n in lengths {
        for snapshots in [false, true] {
            let r = one(&etcd, n, snapshots).await;
            #[allow(clippy::cast_precision_loss)]
            let mb = r.snapshot_bytes as f64 / 1e6;
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.1} | {:.2} |",
                r.events,
                if r.snapshots { "yes" } else { "no" },
                r.rebuilt.as_secs_f64(),
                r.serving.as_secs_f64(),
                mb,
                r.load_s
            );
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average after: {}", load.trim());
}
