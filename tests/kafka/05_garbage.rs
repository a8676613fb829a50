//! Records that cannot be applied: undecodable values, missing, duplicated
//! or malformed tokens and keys, records in the wrong partition (the store
//! runs in strict partitioning mode here; without it such a record is
//! routed by key, `07_partitioners.rs`), oversized values, bad JSON, unknown
//! content types, a control character in a protobuf event's type, unissued
//! or foreign tokens, a copy a cluster node forwarded. Each is dead-lettered
//! with its stable reason (and copied to the dead-letter topic), the
//! partition keeps flowing, the server stays healthy.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use serde_json::{json, Value};

use crate::broker::{broker, unique, TestTopic, PARTITIONS};
use crate::{
    event_ids, healthy, partition_events, proto_event, publish, publisher, serve, twin_token,
    twins_in, wait_handled, Sent,
};

const MAX_RECORD_BYTES: usize = 1024;

/// A record as the raw producer sends it.
struct Raw {
    what: &'static str,
    partition: u32,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(&'static str, Option<Vec<u8>>)>,
    reason: &'static str,
}

async fn send_raw(p: &FutureProducer, topic: &str, r: &Raw) -> u64 {
    let mut headers = OwnedHeaders::new();
    for (k, v) in &r.headers {
        headers = headers.insert(Header {
            key: k,
            value: v.as_deref(),
        });
    }
    let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic)
        .partition(i32::try_from(r.partition).unwrap())
        .headers(headers);
    if let Some(k) = &r.key {
        rec = rec.key(k.as_slice());
    }
    if let Some(v) = &r.value {
        rec = rec.payload(v.as_slice());
    }
    let d = p
        .send(rec, Duration::from_secs(30))
        .await
        .unwrap_or_else(|(e, _)| panic!("produce {}: {e}", r.what));
    assert_eq!(u32::try_from(d.partition).unwrap(), r.partition);
    u64::try_from(d.offset).unwrap()
}

fn h(k: &'static str, v: &str) -> (&'static str, Option<Vec<u8>>) {
    (k, Some(v.as_bytes().to_vec()))
}

fn json_event(id: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({ "type": "update", "patch": { "ok": false }, "event_id": id }))
        .unwrap()
}

/// Every dead letter the store has, by (partition, offset).
async fn dead_letters(c: &crate::support::Client) -> BTreeMap<(u64, u64), Value> {
    let r = c.get("/v1/dead-letters?limit=1000").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                (
                    d["partition"].as_u64().unwrap(),
                    d["offset"].as_u64().unwrap(),
                ),
                d.clone(),
            )
        })
        .collect()
}

/// Read the dead-letter topic from the start until `n` records arrived:
/// `(palisade-dead-reason, palisade-source, key)` of each.
fn read_dead_letter_topic(topic: &str, n: usize) -> Vec<(String, String, Option<Vec<u8>>)> {
    let c = broker().consumer(&unique("dlq-reader"), &[("enable.auto.commit", "false")]);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {} of {n} dead letters reached {topic}: {out:?}",
            out.len()
        );
        let Some(m) = c.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let header = |name: &str| {
            m.headers().and_then(|hs| {
                hs.iter()
                    .find(|h| h.key == name)
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        let reason = header("palisade-dead-reason")
            .unwrap_or_else(|| panic!("a record on {topic} without palisade-dead-reason"));
        let source = header("palisade-source").unwrap_or_default();
        out.push((reason, source, m.key().map(<[u8]>::to_vec)));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_dead_lettered_and_the_partitions_keep_flowing() {
    let t = TestTopic::new("garbage");
    let dlq = unique("dlq");
    broker().create_topic(&dlq, 1);
    let dir = tempfile::tempdir().unwrap();
    let max = MAX_RECORD_BYTES.to_string();
    let s = serve(
        dir.path(),
        &t,
        &[
            "--kafka-max-record-bytes",
            &max,
            "--kafka-dead-letter-topic",
            &dlq,
            "--kafka-strict-partitioning",
        ],
    );
    let c = s.client();

    // Two twins per partition: `good[p]` has a lease, `other[p]` too (its
    // token is used on the wrong twin below).
    let mut good = Vec::new();
    let mut token = Vec::new();
    let mut other_token = Vec::new();
    for p in 0..PARTITIONS {
        let tw = twins_in("garbage", p, 2);
        token.push(twin_token(&c, &tw[0], "worker").await.0);
        other_token.push(twin_token(&c, &tw[1], "other").await.0);
        good.push(tw[0].clone());
    }
    let publisher = publisher(&t.topic);
    let raw = broker().raw_producer();

    // One valid record per partition first.
    let mut valid: Vec<Sent> = Vec::new();
    for p in 0..PARTITIONS as usize {
        let id = format!("{}-before", good[p]);
        valid.push(
            publish(
                &publisher,
                &good[p],
                token[p],
                &id,
                json!({ "at": "before" }),
            )
            .await,
        );
    }

    let key = |p: u32| Some(good[p as usize].as_bytes().to_vec());
    let tok = |p: u32| h("fencing-token", &token[p as usize].to_string());
    let json_ct = h("content-type", "application/json");
    let garbage: Vec<Raw> = vec![
        Raw {
            what: "undecodable protobuf",
            partition: 0,
            key: key(0),
            value: Some(vec![0xff, 0xff, 0xff]),
            headers: vec![tok(0)],
            reason: "bad_value",
        },
        Raw {
            what: "no token header",
            partition: 1,
            key: key(1),
            value: Some(json_event("x1")),
            headers: vec![json_ct.clone()],
            reason: "missing_token",
        },
        Raw {
            what: "token header without value",
            partition: 2,
            key: key(2),
            value: Some(json_event("x2")),
            headers: vec![("fencing-token", None), json_ct.clone()],
            reason: "missing_token",
        },
        Raw {
            what: "non-numeric token",
            partition: 3,
            key: key(3),
            value: Some(json_event("x3")),
            headers: vec![h("fencing-token", "abc"), json_ct.clone()],
            reason: "bad_token",
        },
        Raw {
            what: "negative token",
            partition: 0,
            key: key(0),
            value: Some(json_event("x4")),
            headers: vec![h("fencing-token", "-5"), json_ct.clone()],
            reason: "bad_token",
        },
        Raw {
            what: "overflowing token",
            partition: 1,
            key: key(1),
            value: Some(json_event("x5")),
            headers: vec![h("fencing-token", "18446744073709551616"), json_ct.clone()],
            reason: "bad_token",
        },
        Raw {
            what: "two token headers",
            partition: 2,
            key: key(2),
            value: Some(json_event("x15")),
            headers: vec![tok(2), tok(2), json_ct.clone()],
            reason: "bad_token",
        },
        Raw {
            what: "empty key",
            partition: 2,
            key: Some(Vec::new()),
            value: Some(json_event("x6")),
            headers: vec![tok(2), json_ct.clone()],
            reason: "missing_key",
        },
        Raw {
            what: "no key",
            partition: 3,
            key: None,
            value: Some(json_event("x7")),
            headers: vec![tok(3), json_ct.clone()],
            reason: "missing_key",
        },
        Raw {
            what: "non-UTF-8 key",
            partition: 0,
            key: Some(vec![0xff, 0xfe]),
            value: Some(json_event("x8")),
            headers: vec![tok(0), json_ct.clone()],
            reason: "bad_key",
        },
        Raw {
            what: "key of another partition",
            partition: 1,
            key: key(2),
            value: Some(json_event("x9")),
            headers: vec![tok(2), json_ct.clone()],
            reason: "wrong_partition",
        },
        Raw {
            what: "oversized value",
            partition: 2,
            key: key(2),
            value: Some(
                serde_json::to_vec(
                    &json!({ "type": "update", "patch": { "blob": "z".repeat(2000) } }),
                )
                .unwrap(),
            ),
            headers: vec![tok(2), json_ct.clone()],
            reason: "too_large",
        },
        Raw {
            what: "bad JSON",
            partition: 3,
            key: key(3),
            value: Some(b"{nope".to_vec()),
            headers: vec![tok(3), json_ct.clone()],
            reason: "bad_json",
        },
        Raw {
            what: "JSON patch not an object",
            partition: 0,
            key: key(0),
            value: Some(br#"{"type":"update","patch":[1]}"#.to_vec()),
            headers: vec![tok(0), json_ct.clone()],
            reason: "bad_patch",
        },
        Raw {
            what: "unknown content type",
            partition: 1,
            key: key(1),
            value: Some(json_event("x10")),
            headers: vec![tok(1), h("content-type", "text/plain")],
            reason: "bad_content_type",
        },
        Raw {
            what: "no value",
            partition: 2,
            key: key(2),
            value: None,
            headers: vec![tok(2)],
            reason: "missing_value",
        },
        Raw {
            what: "bad hlc header",
            partition: 3,
            key: key(3),
            value: Some(json_event("x11")),
            headers: vec![tok(3), json_ct.clone(), h("hlc", "soon")],
            reason: "bad_hlc",
        },
        Raw {
            what: "a cluster node's forwarded copy",
            partition: 3,
            key: key(3),
            value: Some(json_event("x16")),
            headers: vec![
                tok(3),
                json_ct.clone(),
                h("palisade-origin-partition", "1"),
                h("palisade-origin-offset", "7"),
            ],
            reason: "forwarded_record",
        },
        // Decoded fine, refused by the writer's checks (not stale):
        Raw {
            what: "control character in a protobuf event's type",
            partition: 3,
            key: key(3),
            value: Some(proto_event("x17", "update\u{1b}[2J", r#"{"ok":false}"#)),
            headers: vec![tok(3)],
            reason: "bad_event",
        },
        Raw {
            what: "token never issued",
            partition: 0,
            key: key(0),
            value: Some(json_event("x12")),
            headers: vec![h("fencing-token", "999999"), json_ct.clone()],
            reason: "token_not_issued",
        },
        Raw {
            what: "token of another twin in the partition",
            partition: 1,
            key: key(1),
            value: Some(json_event("x13")),
            headers: vec![
                h("fencing-token", &other_token[1].to_string()),
                json_ct.clone(),
            ],
            reason: "token_scope_mismatch",
        },
        Raw {
            what: "token of a twin in another partition",
            partition: 2,
            key: key(2),
            value: Some(json_event("x14")),
            headers: vec![tok(3), json_ct.clone()],
            reason: "token_not_issued",
        },
    ];
    let mut expected: BTreeMap<(u64, u64), &Raw> = BTreeMap::new();
    for g in &garbage {
        let offset = send_raw(&raw, &t.topic, g).await;
        expected.insert((u64::from(g.partition), offset), g);
    }

    // Valid records after the garbage, in every partition, in both encodings.
    for p in 0..PARTITIONS as usize {
        for i in 0..3 {
            let id = format!("{}-after-{i}", good[p]);
            valid.push(
                publish(
                    &publisher,
                    &good[p],
                    token[p],
                    &id,
                    json!({ "at": "after", "i": i }),
                )
                .await,
            );
        }
        let id = format!("{}-after-json", good[p]);
        let value = serde_json::to_vec(
            &json!({ "type": "update", "patch": { "json": true }, "event_id": id }),
        )
        .unwrap();
        let offset = send_raw(
            &raw,
            &t.topic,
            &Raw {
                what: "valid JSON",
                partition: u32::try_from(p).unwrap(),
                key: Some(good[p].as_bytes().to_vec()),
                value: Some(value),
                headers: vec![h("fencing-token", &token[p].to_string()), json_ct.clone()],
                reason: "",
            },
        )
        .await;
        valid.push(Sent {
            twin: good[p].clone(),
            token: token[p],
            event_id: id,
            partition: u32::try_from(p).unwrap(),
            offset,
        });
    }

    let total = (garbage.len() + valid.len()) as u64;
    let o = wait_handled(&c, total, Duration::from_secs(60)).await;
    assert_eq!(o["dead_lettered"], garbage.len() as u64, "{o:?}");
    assert_eq!(o["applied"], valid.len() as u64, "{o:?}");
    assert_eq!(o["dropped_stale"], 0, "{o:?}");
    healthy(&c).await;

    // Each dead letter where it was produced, with its key and reason.
    let dead = dead_letters(&c).await;
    let got: BTreeSet<&(u64, u64)> = dead.keys().collect();
    let want: BTreeSet<&(u64, u64)> = expected.keys().collect();
    assert_eq!(
        got, want,
        "dead letters at exactly the garbage's (partition, offset)"
    );
    for (at, g) in &expected {
        let d = &dead[at];
        assert_eq!(d["reason"], g.reason, "{}: {d}", g.what);
        let key = g
            .key
            .as_ref()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        assert_eq!(d["key"], json!(key), "{}: {d}", g.what);
        assert!(
            !d["message"].as_str().unwrap().is_empty(),
            "{}: {d}",
            g.what
        );
    }
    let oversized = dead.values().find(|d| d["reason"] == "too_large").unwrap();
    assert!(oversized["value_len"].as_u64().unwrap() > MAX_RECORD_BYTES as u64);
    let abc = dead.values().find(|d| {
        d["headers"]
            .as_array()
            .unwrap()
            .contains(&json!(["fencing-token", "abc"]))
    });
    assert!(abc.is_some(), "a dead letter keeps its headers: {dead:?}");
    let r = c.get("/v1/dead-letters?partition=1&limit=1000").await;
    let only1 = r.body["dead_letters"].as_array().unwrap();
    assert_eq!(
        only1.len(),
        garbage.iter().filter(|g| g.partition == 1).count()
    );
    assert!(only1.iter().all(|d| d["partition"] == 1));

    // The partitions kept flowing: every valid record applied, in order.
    for p in 0..PARTITIONS {
        let mut want: Vec<&Sent> = valid.iter().filter(|s| s.partition == p).collect();
        want.sort_by_key(|s| s.offset);
        let want: Vec<String> = want.iter().map(|s| s.event_id.clone()).collect();
        assert_eq!(
            event_ids(&partition_events(&c, p).await),
            want,
            "partition {p}"
        );
    }
    for (p, twin) in good.iter().enumerate() {
        let v = c.twin(twin).await;
        assert_eq!(v.body["state"]["json"], true, "{p}: {:?}", v.body);
        assert_eq!(
            v.body["state"]["ok"],
            Value::Null,
            "no garbage applied: {:?}",
            v.body
        );
    }

    // The same records were copied to the dead-letter topic, with their reason.
    let dlq_name = dlq.clone();
    let n = garbage.len();
    let copies = tokio::task::spawn_blocking(move || read_dead_letter_topic(&dlq_name, n))
        .await
        .unwrap();
    let got: BTreeSet<(String, String)> = copies
        .iter()
        .map(|(r, s, _)| (r.clone(), s.clone()))
        .collect();
    let want: BTreeSet<(String, String)> = expected
        .iter()
        .map(|((p, o), g)| (g.reason.to_owned(), format!("{}/{p}/{o}", t.topic)))
        .collect();
    assert_eq!(got, want, "dead-letter topic records (reason, source)");
    assert_eq!(copies.len(), n, "each dead letter copied once: {copies:?}");
    healthy(&c).await;
    s.terminate();
}
