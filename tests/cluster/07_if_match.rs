//! `If-Match` in cluster mode (issue 16). An HTTP append's expected version
//! travels in its Kafka record (`palisade-if-match`) and is checked by
//! whoever applies the record, against the twin's version at that place in
//! the partition's log: the decision depends on the log alone, so every
//! node that ever applies the partition decides the same. Asserted, with
//! two `palisade serve --cluster-node` processes on a real broker and a
//! real etcd:
//!
//! - two writers sending the same `If-Match` at once, through different
//!   nodes: one gets `201`, the other the single-node `412
//!   version_mismatch` (`expected`, `current`), and only the winner's event
//!   is stored; a later append with the new ETag succeeds, one with the old
//!   ETag is refused again;
//! - the refused records are dead letters `version_mismatch` of the
//!   partition, at their offsets, on the node that applied them, and in
//!   the twin's refusal journal;
//! - a fresh node replaying the topic alone reaches the same state and
//!   version, and refuses the same records at the same offsets.
//!
//! Shown to fail with the consumer not reading `palisade-if-match` (both
//! writers get `201`).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::broker::PARTITIONS;
use crate::etcd::Etcd;
use crate::three_nodes::{http, twin, Cluster, Node, STEP};

/// POST one event with `If-Match: "<expected>"` through `node` until the
/// cluster decides it (anything but `503`): (status, body, answering node).
async fn append_if_match(
    node: &Node,
    twin: &str,
    token: u64,
    event_id: &str,
    expected: Option<u64>,
) -> (u16, Value) {
    let c = http();
    let started = Instant::now();
    loop {
        let mut req = c
            .post(format!("{}/v1/twins/{twin}/events", node.base))
            .header("fencing-token", token.to_string())
            .json(&json!({"type": "set", "patch": {"by": event_id}, "event_id": event_id}));
        if let Some(v) = expected {
            req = req.header("if-match", format!("\"{v}\""));
        }
        let last = match req.send().await {
            Ok(r) if r.status().as_u16() != 503 => {
                let s = r.status().as_u16();
                assert!(
                    r.headers().get("palisade-owner").is_some(),
                    "the answer names the owner"
                );
                return (s, r.json().await.unwrap());
            }
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(e) => e.to_string(),
        };
        assert!(
            started.elapsed() < STEP,
            "{event_id} of {twin} never decided: {last}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The dead letters of Kafka partition `p` on `node`.
async fn dead_letters(node: &Node, p: u32) -> Vec<Value> {
    let dl: Value = http()
        .get(format!(
            "{}/v1/dead-letters?partition={p}&limit=1000",
            node.base
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    dl["dead_letters"].as_array().unwrap().clone()
}

/// Offsets of the `version_mismatch` dead letters of `twin`.
fn mismatches(dead: &[Value], twin: &str) -> Vec<u64> {
    dead.iter()
        .filter(|d| d["reason"] == "version_mismatch" && d["key"] == twin)
        .map(|d| d["offset"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn if_match_is_decided_in_log_order_by_every_node_when_installed() {
    let Some(etcd) =
        Etcd::start("if_match_is_decided_in_log_order_by_every_node_when_installed").await
    else {
        return;
    };
    let cluster = Cluster::on(&etcd, "cluster-ifmatch");
    let topic = cluster.topic.clone();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (0..2)
        .map(|i| cluster.start(&format!("n{i}"), dir.path()))
        .collect();
    let tw = "im-1";
    let p = palisade::core::partition_for(&palisade::core::TwinId::new(tw).unwrap(), PARTITIONS).0;
    let r = http()
        .post(format!("{}/v1/leases", nodes[0].base))
        .json(&json!({"scope": format!("twin/{tw}"), "holder": "w", "ttl_ms": 3_600_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let token = r.json::<Value>().await.unwrap()["token"].as_u64().unwrap();

    // A first, unconditional event: the version both writers read.
    let (s, first) = append_if_match(&nodes[0], tw, token, "e0", None).await;
    assert_eq!(s, 201, "{first}");
    let v = first["version"].as_u64().unwrap();

    // Two writers, the same If-Match, through different nodes, at once.
    let (a, b) = tokio::join!(
        append_if_match(&nodes[0], tw, token, "writer-a", Some(v)),
        append_if_match(&nodes[1], tw, token, "writer-b", Some(v)),
    );
    let mut outcomes = [("writer-a", a), ("writer-b", b)];
    outcomes.sort_by_key(|(_, (s, _))| *s);
    let [(winner, (ws, won)), (loser, (ls, lost))] = outcomes;
    assert_eq!(
        (ws, ls),
        (201, 412),
        "one writer wins, the other gets 412: {won} / {lost}"
    );
    let v2 = won["version"].as_u64().unwrap();
    assert!(v2 > v);
    assert_eq!(
        (
            lost["error"].as_str(),
            lost["expected"].as_u64(),
            lost["current"].as_u64()
        ),
        (Some("version_mismatch"), Some(v), Some(v2)),
        "the single-node refusal: {lost}"
    );

    // In sequence: the new ETag applies, the old one is refused again.
    let (s, next) = append_if_match(&nodes[1], tw, token, "e-next", Some(v2)).await;
    assert_eq!(s, 201, "{next}");
    let v3 = next["version"].as_u64().unwrap();
    let (s, again) = append_if_match(&nodes[0], tw, token, "e-old", Some(v2)).await;
    assert_eq!((s, again["current"].as_u64()), (412, Some(v3)), "{again}");

    let all: Vec<&Node> = nodes.iter().collect();
    let history = twin(&all, tw, "/events?limit=100").await;
    let ids: Vec<&str> = history["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["e0", winner, "e-next"],
        "only the accepted appends are stored ({loser} and e-old refused)"
    );
    let state = twin(&all, tw, "").await;
    assert_eq!(state["version"].as_u64(), Some(v3));

    // The refusals are the partition's dead letters, on the node that
    // applied them (the owner, which answered the appends).
    let owner_dead = {
        let mut found = Vec::new();
        for n in &nodes {
            found.extend(mismatches(&dead_letters(n, p).await, tw));
        }
        found.sort_unstable();
        found.dedup();
        found
    };
    assert_eq!(
        owner_dead.len(),
        2,
        "{loser}'s and e-old's records are version_mismatch dead letters: {owner_dead:?}"
    );

    // A fresh node replaying the topic alone (the others stopped, so it
    // owns every partition) decides the same, record by record: same state
    // and version, the same records refused.
    for n in &mut nodes {
        n.terminate();
    }
    let solo_cluster = Cluster {
        group: format!("{topic}-solo"),
        ..cluster
    };
    let solo = solo_cluster.start("solo", dir.path());
    let replayed = twin(&[&solo], tw, "").await;
    assert_eq!(
        (replayed["state"].clone(), replayed["version"].clone()),
        (state["state"].clone(), state["version"].clone()),
        "a node replaying the log disagrees with the cluster"
    );
    let solo_dead = dead_letters(&solo, p).await;
    assert_eq!(
        mismatches(&solo_dead, tw),
        owner_dead,
        "the replaying node refuses the same records: {solo_dead:?}"
    );
    // ...and keeps them in the twin's refusal journal, by event id.
    let journal: Value = http()
        .get(format!("{}/v1/twins/{tw}/refusals", solo.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut refused: Vec<(String, String)> = journal["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["event_ids"][0].as_str().unwrap().to_owned(),
                format!(
                    "{}/{}",
                    r["reason"].as_str().unwrap(),
                    r["source"].as_str().unwrap()
                ),
            )
        })
        .collect();
    refused.sort();
    let mut want = vec![
        ("e-old".to_owned(), "version_mismatch/kafka".to_owned()),
        (loser.to_owned(), "version_mismatch/kafka".to_owned()),
    ];
    want.sort();
    assert_eq!(refused, want, "{journal}");
    drop(solo);
}
