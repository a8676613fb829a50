//! Issue 15 in cluster mode: records produced with librdkafka's default
//! partitioner (`consistent_random`, CRC32 of the key: a plain rdkafka
//! producer, as every librdkafka client's default) land mostly outside
//! their twin's partition. The owner of the partition a record lands in
//! forwards a copy to the twin's partition; whoever owns that applies it,
//! once. Asserted, with two `palisade serve --cluster-node` processes on a
//! real broker and a real etcd:
//!
//! - every fresh record applied exactly once, in order, per twin (histories
//!   read through the cluster); records under a superseded token dropped and
//!   listed in `/v1/rejections` with their event ids and the Kafka
//!   partition and offset they were produced at; garbage dead-lettered;
//! - a node SIGKILLed while it forwards, then restarted: still every record
//!   once (a forward retried after the crash is recognised);
//! - a copy produced again verbatim (a forwarder's retry) is not applied
//!   twice (`duplicate`); a copy that claims to follow a copy never seen (a
//!   lost one) is set aside (`out_of_order`), and the chain goes on;
//! - a fresh node replaying the whole topic alone reaches the same state
//!   and version for every twin, and refuses the same garbage; restarted
//!   cleanly (every forward's offset stored, so nothing is forwarded again),
//!   its next copies continue the chains it stored.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use palisade::core::{partition_for, TwinId};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::broker::{broker, unique, PARTITIONS};
use crate::etcd::Etcd;
use crate::three_nodes::{http, read, twin, Cluster, Node, STEP};

/// CRC-32 (IEEE): librdkafka's `consistent_random` partition of a key.
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

/// A producer with librdkafka's default partitioner.
fn default_producer() -> FutureProducer {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &broker().bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "1");
    cc.create().unwrap()
}

/// Produce JSON events (`[(twin, token, event id)]`), all at once; where
/// each landed.
async fn produce(
    p: &FutureProducer,
    topic: &str,
    recs: &[(String, Option<Vec<u64>>, String)],
) -> Vec<(u32, u64)> {
    let mut waiting = Vec::new();
    for (twin, tokens, id) in recs {
        let mut h = OwnedHeaders::new().insert(Header {
            key: "content-type",
            value: Some(b"application/json".as_slice()),
        });
        for t in tokens.iter().flatten() {
            let t = t.to_string();
            h = h.insert(Header {
                key: "fencing-token",
                value: Some(t.as_bytes()),
            });
        }
        let value = json!({"type": "set", "patch": {"last": id}, "event_id": id}).to_string();
        let rec: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .key(twin.as_str())
            .payload(value.as_str())
            .headers(h);
        waiting.push(p.send_result(rec).map_err(|(e, _)| e).unwrap());
    }
    let mut out = Vec::new();
    for w in waiting {
        let d = w.await.unwrap().map_err(|(e, _)| e).unwrap();
        out.push((
            u32::try_from(d.partition).unwrap(),
            u64::try_from(d.offset).unwrap(),
        ));
    }
    out
}

/// A twin's event ids through the cluster (redirects followed).
async fn ids(nodes: &[&Node], t: &str) -> Vec<String> {
    let h = twin(nodes, t, "/events?limit=1000").await;
    h["events"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| e["event_id"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Wait until every twin's history is `want` (panics with the difference).
async fn wait_histories(nodes: &[&Node], want: &BTreeMap<String, Vec<String>>, what: &str) {
    let started = Instant::now();
    loop {
        let mut diff = Vec::new();
        for (t, w) in want {
            let got = ids(nodes, t).await;
            if &got != w {
                diff.push(format!("{t}: {} of {} events", got.len(), w.len()));
                // Never more than produced, never out of order, never twice.
                assert!(
                    got.len() <= w.len() && w[..got.len()] == got[..],
                    "{what}: {t}'s history is not a prefix of its records: {got:?}"
                );
            }
        }
        if diff.is_empty() {
            return;
        }
        assert!(started.elapsed() < STEP, "{what}: {diff:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `palisade_kafka_records_total{outcome}` summed over nodes.
async fn outcome(nodes: &[&Node], name: &str) -> u64 {
    let mut n = 0.0;
    for node in nodes {
        let Ok(r) = http().get(format!("{}/metrics", node.base)).send().await else {
            continue;
        };
        let text = r.text().await.unwrap_or_default();
        n += text
            .lines()
            .filter(|l| {
                l.starts_with("palisade_kafka_records_total{")
                    && l.contains(&format!("outcome=\"{name}\""))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>();
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = n as u64;
    n
}

async fn lease(node: &Node, twin: &str, holder: &str) -> Value {
    let r = http()
        .post(format!("{}/v1/leases", node.base))
        .json(&json!({"scope": format!("twin/{twin}"), "holder": holder, "ttl_ms": 3_600_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    r.json().await.unwrap()
}

/// Record headers, owned.
type OwnedHeaderList = Vec<(String, Vec<u8>)>;

/// The first forwarded copy in partition `p`: key, value, headers.
fn first_copy(topic: &str, p: u32) -> (Vec<u8>, Vec<u8>, OwnedHeaderList) {
    let c = broker().consumer(&unique("copy-reader"), &[("enable.auto.commit", "false")]);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, i32::try_from(p).unwrap(), Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < STEP,
            "no forwarded copy in partition {p}"
        );
        let Some(m) = c.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let headers: Vec<(String, Vec<u8>)> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        if headers
            .iter()
            .any(|(k, _)| k == "palisade-origin-partition")
        {
            return (
                m.key().unwrap().to_vec(),
                m.payload().unwrap().to_vec(),
                headers,
            );
        }
    }
}

async fn produce_raw(topic: &str, p: u32, key: &[u8], value: &[u8], headers: &[(String, Vec<u8>)]) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_slice()),
        });
    }
    let rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic)
        .partition(i32::try_from(p).unwrap())
        .key(key)
        .payload(value)
        .headers(h);
    broker()
        .raw_producer()
        .send(rec, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_of_any_partition_are_forwarded_and_applied_once_when_installed() {
    let Some(etcd) =
        Etcd::start("records_of_any_partition_are_forwarded_and_applied_once_when_installed").await
    else {
        return;
    };
    let cluster = Cluster::on(&etcd, "forward");
    let topic = cluster.topic.clone();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (0..2)
        .map(|i| cluster.start(&format!("f{i}"), dir.path()))
        .collect();
    let twins: Vec<String> = (0..8).map(|i| format!("fw-{i}")).collect();
    let misrouted = twins
        .iter()
        .filter(|t| {
            crc32(t.as_bytes()) % PARTITIONS
                != partition_for(&TwinId::new(t.as_str()).unwrap(), PARTITIONS).0
        })
        .count();
    assert!(
        misrouted >= 4,
        "pick twins that CRC32 puts elsewhere: {misrouted}"
    );

    // A superseded and a current token per twin (etcd grants through the
    // cluster).
    let mut stale = BTreeMap::new();
    let mut fresh = BTreeMap::new();
    for t in &twins {
        let a = lease(&nodes[0], t, "a").await;
        let r = http()
            .delete(format!(
                "{}/v1/leases/{}",
                nodes[0].base,
                a["lease_id"].as_str().unwrap()
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 204);
        let b = lease(&nodes[0], t, "b").await;
        stale.insert(t.clone(), a["token"].as_u64().unwrap());
        fresh.insert(t.clone(), b["token"].as_u64().unwrap());
    }
    let producer = default_producer();

    // 1. Fresh, stale and garbage records.
    let mut want: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut recs = Vec::new();
    for i in 0..5 {
        for t in &twins {
            let id = format!("{t}-f{i}");
            recs.push((t.clone(), Some(vec![fresh[t]]), id.clone()));
            want.entry(t.clone()).or_default().push(id);
        }
    }
    for t in &twins {
        recs.push((t.clone(), Some(vec![stale[t]]), format!("{t}-stale")));
    }
    let g = &twins[0];
    recs.push((g.clone(), None, "g-no-token".into()));
    recs.push((
        g.clone(),
        Some(vec![fresh[g], fresh[g]]),
        "g-two-tokens".into(),
    ));
    let landed = produce(&producer, &topic, &recs).await;
    let all: Vec<&Node> = nodes.iter().collect();
    wait_histories(&all, &want, "phase 1").await;
    // Cluster mode reports each assigned partition's lag, as the single node
    // does: between them the nodes cover every partition (measured every 5 s).
    let started = Instant::now();
    loop {
        let mut reported = BTreeSet::new();
        for n in &nodes {
            let text = http()
                .get(format!("{}/metrics", n.base))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            for l in text.lines() {
                if let Some(rest) = l.strip_prefix("palisade_kafka_lag{partition=\"") {
                    reported.insert(rest.split('"').next().unwrap().to_owned());
                }
            }
        }
        if reported.len() == PARTITIONS as usize {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "lag reported for partitions {reported:?} of {PARTITIONS}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Stale records are listed by the node that decided them, naming where
    // they were produced.
    let started = Instant::now();
    loop {
        let mut listed = BTreeMap::new();
        for n in &nodes {
            let r: Value = http()
                .get(format!("{}/v1/rejections?limit=1000", n.base))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            for x in r["rejections"].as_array().unwrap() {
                if x["reason"] == "stale_token" {
                    listed.insert(
                        x["event_ids"][0].as_str().unwrap().to_owned(),
                        (
                            x["source_partition"].as_u64().unwrap(),
                            x["offset"].as_u64().unwrap(),
                        ),
                    );
                }
            }
        }
        let expected: BTreeMap<String, (u64, u64)> = recs
            .iter()
            .zip(&landed)
            .filter(|((_, _, id), _)| id.ends_with("-stale"))
            .map(|((_, _, id), (p, o))| (id.clone(), (u64::from(*p), *o)))
            .collect();
        if listed == expected {
            break;
        }
        assert!(
            started.elapsed() < STEP,
            "rejections {listed:?}, want {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // 2. A longer stream; SIGKILL a node while it forwards; restart it.
    let mut recs2 = Vec::new();
    for i in 0..400 {
        for t in &twins {
            let id = format!("{t}-s{i:03}");
            recs2.push((t.clone(), Some(vec![fresh[t]]), id.clone()));
            want.get_mut(t).unwrap().push(id);
        }
    }
    let before = outcome(&all, "forwarded").await;
    produce(&producer, &topic, &recs2).await;
    let started = Instant::now();
    while outcome(&[&nodes[1]], "forwarded").await < 20
        && outcome(&all, "forwarded").await < before + 200
    {
        assert!(started.elapsed() < STEP, "no forwarding");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nodes[1].kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.launch(&mut nodes[1]);
    let all: Vec<&Node> = nodes.iter().collect();
    wait_histories(&all, &want, "after a SIGKILL while forwarding").await;

    // 3. A forwarder's retry, verbatim, is recognised; a copy that follows
    //    one never seen is set aside; the chain goes on.
    let j = partition_for(&TwinId::new(twins[1].as_str()).unwrap(), PARTITIONS).0;
    let (key, value, headers) = first_copy(&topic, j);
    produce_raw(&topic, j, &key, &value, &headers).await;
    let gap_twin = String::from_utf8(key.clone()).unwrap();
    let gap_value = json!({"type": "set", "patch": {"gap": true}, "event_id": "gap-1"}).to_string();
    let gap_headers: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|(k, v)| match k.as_str() {
            "palisade-origin-offset" => (k.clone(), b"900000000".to_vec()),
            "palisade-origin-prev" => (k.clone(), b"899999999".to_vec()),
            _ => (k.clone(), v.clone()),
        })
        .chain(
            (!headers.iter().any(|(k, _)| k == "palisade-origin-prev"))
                .then(|| ("palisade-origin-prev".to_owned(), b"899999999".to_vec())),
        )
        .collect();
    produce_raw(&topic, j, &key, gap_value.as_bytes(), &gap_headers).await;
    let mut recs3 = Vec::new();
    for t in &twins {
        let id = format!("{t}-after");
        recs3.push((t.clone(), Some(vec![fresh[t]]), id.clone()));
        want.get_mut(t).unwrap().push(id);
    }
    produce(&producer, &topic, &recs3).await;
    wait_histories(&all, &want, "after a retried and a gapped copy").await;
    assert!(
        !ids(&all, &gap_twin).await.contains(&"gap-1".to_owned()),
        "a copy following a lost one must not be applied"
    );
    let started = Instant::now();
    while outcome(&all, "duplicate").await == 0 || outcome(&all, "out_of_order").await == 0 {
        assert!(
            started.elapsed() < STEP,
            "no duplicate or out_of_order counted"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The cluster's state, then a fresh node alone replaying the topic.
    let mut seen = BTreeMap::new();
    for t in &twins {
        let s = twin(&all, t, "").await;
        seen.insert(t.clone(), (s["state"].clone(), s["version"].clone()));
    }
    for n in &mut nodes {
        n.terminate();
    }
    let solo_cluster = Cluster {
        group: format!("{topic}-solo"),
        ..cluster
    };
    let solo = solo_cluster.start("solo", dir.path());
    for t in &twins {
        let started = Instant::now();
        loop {
            let s = twin(&[&solo], t, "").await;
            if (s["state"].clone(), s["version"].clone()) == seen[t] {
                break;
            }
            assert!(
                started.elapsed() < STEP,
                "{t}: a single node replaying the log disagrees with the cluster: {s} vs {:?}",
                seen[t]
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    let dl: Value = http()
        .get(format!("{}/v1/dead-letters?limit=1000", solo.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let dead: Vec<(u64, u64, String)> = dl["dead_letters"]
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
        .collect();
    let n = recs.len();
    let garbage = [
        (landed[n - 2], "missing_token"),
        (landed[n - 1], "bad_token"),
    ];
    for ((p, o), reason) in garbage {
        assert!(
            dead.contains(&(u64::from(p), o, reason.to_owned())),
            "{reason} at {p}/{o} not dead-lettered: {dead:?}; log:\n{}",
            read(&dir.path().join("solo.log"))
        );
    }
    // A clean restart of the one node: its next copies must take their
    // `prev` from the chains it stored (with the offsets), or the owner of
    // the twin's partition sets them aside forever.
    let mut solo = solo;
    solo.terminate();
    solo_cluster.launch(&mut solo);
    let mut recs4 = Vec::new();
    for t in &twins {
        let id = format!("{t}-restarted");
        recs4.push((t.clone(), Some(vec![fresh[t]]), id.clone()));
        want.get_mut(t).unwrap().push(id);
    }
    produce(&producer, &topic, &recs4).await;
    wait_histories(&[&solo], &want, "after a clean restart").await;
    drop(solo);
}
