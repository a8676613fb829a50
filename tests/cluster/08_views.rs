//! Cluster-wide views (issue 16): `GET /v1/partitions` and
//! `GET /v1/dead-letters` answered by any node for the whole cluster, each
//! partition's part from its owner. Asserted, with three
//! `palisade serve --cluster-node` processes on a real broker and a real
//! etcd:
//!
//! - every node's `/v1/partitions` covers every partition once, each
//!   `serving` with its owner node, owner token and lag, and all three name
//!   the same owner and token per partition; the owner named is the node
//!   that answers for a twin of that partition (`Palisade-Owner`);
//! - every node's `/v1/dead-letters` lists the dead letter of every
//!   partition (one garbage record produced to each), the same list;
//! - with one owner SIGSTOPped, a node still answers both (within its HTTP
//!   client's timeout): the stopped node's partitions are `unreachable` (or
//!   `unowned`, once its owner lease ran out), never missing and never
//!   `serving`, and the dead letters list them in `missing` while the
//!   others' dead letters are there.
//!
//! Shown to fail with the views answering the local view only (partitions
//! owned elsewhere are `elsewhere`, their dead letters absent).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use palisade::core::{partition_for, TwinId};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::Value;

use crate::broker::{broker, unique, PARTITIONS};
use crate::etcd::Etcd;
use crate::three_nodes::{http, Cluster, Node, STEP};

async fn get(node: &Node, path: &str) -> Value {
    let r = http()
        .get(format!("{}{path}", node.base))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{path} on {}: no answer: {e}", node.id));
    assert_eq!(r.status().as_u16(), 200, "{path} on {}", node.id);
    r.json().await.unwrap()
}

/// Partition -> its `cluster` object, checking each partition is there once.
fn by_partition(view: &Value) -> BTreeMap<u64, Value> {
    let mut out = BTreeMap::new();
    for p in view["partitions"].as_array().unwrap() {
        let n = p["partition"].as_u64().unwrap();
        assert!(
            out.insert(n, p["cluster"].clone()).is_none(),
            "partition {n} twice: {view}"
        );
    }
    assert_eq!(
        out.keys().copied().collect::<Vec<_>>(),
        (0..u64::from(PARTITIONS)).collect::<Vec<_>>(),
        "every partition, once: {view}"
    );
    out
}

/// A twin id of partition `p`.
fn twin_in(p: u32) -> String {
    (0..)
        .map(|i| format!("view-{i}"))
        .find(|t| partition_for(&TwinId::new(t.as_str()).unwrap(), PARTITIONS).0 == p)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_node_answers_for_every_partition_when_installed() {
    let Some(etcd) = Etcd::start("every_node_answers_for_every_partition_when_installed").await
    else {
        return;
    };
    let topic = unique("cluster-views");
    broker().create_topic(&topic, PARTITIONS);
    // One garbage record (no fencing token) per partition: a dead letter
    // of that partition, kept by whoever applies it.
    let mut garbage = BTreeMap::new();
    for p in 0..PARTITIONS {
        let key = format!("garbage-{p}");
        let rec = FutureRecord::to(&topic)
            .partition(i32::try_from(p).unwrap())
            .key(&key)
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
        garbage.insert(u64::from(p), u64::try_from(d.offset).unwrap());
    }
    let cluster = Cluster {
        group: format!("{topic}-group"),
        topic: topic.clone(),
        etcd: etcd.endpoint.clone(),
        prefix: format!("/{topic}/"),
        partitions: PARTITIONS,
    };
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<Node> = (0..3)
        .map(|i| cluster.start(&format!("n{i}"), dir.path()))
        .collect();

    // Until the rebalances settle: every partition served, by all three
    // nodes (every node is a member of the group once it owns something).
    let started = Instant::now();
    loop {
        let view = get(&nodes[0], "/v1/partitions").await;
        let parts = by_partition(&view);
        let owners: std::collections::BTreeSet<&str> =
            parts.values().filter_map(|c| c["node"].as_str()).collect();
        if parts.values().all(|c| c["status"] == "serving") && owners.len() == 3 {
            break;
        }
        assert!(started.elapsed() < STEP, "never all served: {view}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // Every node, the whole cluster, the same owners.
    let mut owners: Option<BTreeMap<u64, (String, u64)>> = None;
    for n in &nodes {
        let view = get(n, "/v1/partitions").await;
        let parts = by_partition(&view);
        let mine: BTreeMap<u64, (String, u64)> = parts
            .iter()
            .map(|(p, c)| {
                assert_eq!(c["status"], "serving", "{} partition {p}: {view}", n.id);
                assert_eq!(c["serving"], true);
                assert!(c["lag"].is_u64(), "lag of {p}: {view}");
                let token = c["owner_token"].as_u64().unwrap();
                assert!(token > 0);
                (*p, (c["node"].as_str().unwrap().to_owned(), token))
            })
            .collect();
        match &owners {
            None => owners = Some(mine),
            Some(o) => assert_eq!(o, &mine, "{} names other owners", n.id),
        }
    }
    let owners = owners.unwrap();
    // The owner named is the one that answers for the partition's twins.
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    for (p, (node, _)) in &owners {
        let t = twin_in(u32::try_from(*p).unwrap());
        let r = no_redirects
            .get(format!("{}/v1/twins/{t}", nodes[0].base))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.headers()
                .get("palisade-owner")
                .and_then(|v| v.to_str().ok()),
            Some(node.as_str()),
            "partition {p}: the view and the routing disagree ({})",
            r.status()
        );
    }

    // Every node lists every partition's dead letter, the same list.
    let mut lists = Vec::new();
    for n in &nodes {
        let dl = get(n, "/v1/dead-letters?limit=1000").await;
        assert!(dl.get("missing").is_none(), "{}: {dl}", n.id);
        let list: Vec<(u64, u64, String)> = dl["dead_letters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["partition"].as_u64().unwrap(),
                    d["offset"].as_u64().unwrap(),
                    d["key"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        for (p, o) in &garbage {
            assert!(
                list.contains(&(*p, *o, format!("garbage-{p}"))),
                "{}: partition {p}'s dead letter at {o} missing: {dl}",
                n.id
            );
        }
        lists.push(list);
    }
    assert!(lists.windows(2).all(|w| w[0] == w[1]), "{lists:?}");

    // SIGSTOP an owner other than n0: n0 still answers, naming the
    // stopped node's partitions unreachable (or unowned), never missing.
    let stopped = &nodes[1];
    let theirs: Vec<u64> = owners
        .iter()
        .filter(|(_, (n, _))| *n == stopped.id)
        .map(|(p, _)| *p)
        .collect();
    assert!(!theirs.is_empty(), "n1 owns a partition: {owners:?}");
    stopped.signal("STOP");
    let (view, dl) = tokio::join!(
        get(&nodes[0], "/v1/partitions"),
        get(&nodes[0], "/v1/dead-letters?limit=1000")
    );
    stopped.signal("CONT");
    let parts = by_partition(&view);
    let mut unreachable = 0;
    for p in &theirs {
        let c = &parts[p];
        match c["status"].as_str() {
            Some("unreachable") => {
                assert_eq!(c["node"], stopped.id.as_str(), "{view}");
                assert!(c["error"].is_string(), "{view}");
                unreachable += 1;
            }
            Some("unowned") => {}
            other => panic!("partition {p} of a stopped node is {other:?}: {view}"),
        }
    }
    assert!(
        unreachable > 0,
        "the stopped node's partitions were reported unreachable (its owner lease outlives the view's wait): {view}"
    );
    let missing: Vec<u64> = dl["missing"]
        .as_array()
        .unwrap_or_else(|| panic!("no missing partitions listed: {dl}"))
        .iter()
        .map(|m| m["partition"].as_u64().unwrap())
        .collect();
    assert_eq!(missing, theirs, "{dl}");
    for (p, o) in garbage.iter().filter(|(p, _)| !theirs.contains(p)) {
        assert!(
            dl["dead_letters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["partition"] == *p && d["offset"] == *o),
            "partition {p}'s dead letter missing while another node is stopped: {dl}"
        );
    }
    drop(nodes);
}
