//! `kafka` effects: a record of the effect's body to its topic, keyed by
//! the twin id, with the same `Idempotency-Key` and `Fencing-Token` as a
//! webhook's POST, on the brokers of `palisade serve --kafka-brokers` (the
//! suite's broker: `../kafka/broker.rs`). Read back by a consumer of the
//! test's own; a stale writer's kafka effect never reaches the topic;
//! without `--kafka-brokers` the effect ends dead saying why; a bad topic
//! is `400 bad_effects`.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use serde_json::{json, Value};

use crate::broker::{broker, unique, PARTITIONS};
use crate::support::{lease_id_of, token_of, ServeProcess};
use crate::{settled, FAST};

/// One record as the test's consumer read it.
#[derive(Debug)]
struct Record {
    key: String,
    value: Value,
    headers: Vec<(String, String)>,
}

/// Every record of `topic` (one partition) until `n` are read.
fn read(topic: &str, n: usize) -> Vec<Record> {
    let c: BaseConsumer = broker().consumer(&unique("fx-reader"), &[]);
    c.subscribe(&[topic]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {out:#?} of {n} records in {topic}"
        );
        let Some(m) = c.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let headers = m.headers().map_or_else(Vec::new, |h| {
            h.iter()
                .map(|x| {
                    (
                        x.key.to_owned(),
                        String::from_utf8_lossy(x.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        });
        out.push(Record {
            key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
            value: serde_json::from_slice(m.payload().unwrap_or_default()).unwrap_or(Value::Null),
            headers,
        });
    }
    out
}

fn header<'a>(r: &'a Record, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn command(id: &str, topic: &str, open: bool) -> Value {
    json!([{"type": "valve", "patch": {"open": open}, "event_id": id,
        "effects": [{"kind": "kafka", "topic": topic, "body": {"open": open},
            "headers": {"X-Site": "plant-7"}}]}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_effects_are_records_with_the_key_and_token() {
    let ingest = unique("fx-ingest");
    broker().create_topic(&ingest, PARTITIONS);
    let fx = unique("fx-commands");
    broker().create_topic(&fx, 1);
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = broker().serve_args(&ingest, &unique("fx-group"));
    args.extend(FAST.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = ServeProcess::start(&dir.path().join("data"), &args);
    let c = server.client();

    let lease_a = c.acquire("twin/valve-1", "a", 60_000).await;
    let a = token_of(&lease_a);
    let r = c.append("valve-1", a, &command("c1", &fx, true)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    // A goes, a newer holder comes, then the old one's late command:
    // refused, and its effect never recorded.
    let r = c
        .delete(&format!("/v1/leases/{}", lease_id_of(&lease_a)))
        .await;
    assert_eq!(r.status, 204, "{:?}", r.body);
    let b = token_of(&c.acquire("twin/valve-1", "b", 60_000).await);
    let late = c.append("valve-1", a, &command("c-late", &fx, false)).await;
    assert_eq!(late.status, 409, "{:?}", late.body);
    let r = c.append("valve-1", b, &command("c2", &fx, false)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    let all = settled(&c, 2).await;
    assert!(all.iter().all(|e| e["state"] == "delivered"), "{all:#?}");
    let got = read(&fx, 2);
    assert_eq!(got.len(), 2);
    for (rec, (id, token, open)) in got.iter().zip([("c1", a, true), ("c2", b, false)]) {
        assert_eq!(rec.key, "valve-1", "{rec:?}");
        assert_eq!(rec.value, json!({"open": open}), "{rec:?}");
        assert_eq!(
            header(rec, "idempotency-key"),
            Some(format!("{id}:0").as_str())
        );
        assert_eq!(
            header(rec, "fencing-token"),
            Some(token.to_string().as_str())
        );
        assert_eq!(header(rec, "x-site"), Some("plant-7"));
        assert_eq!(header(rec, "content-type"), Some("application/json"));
    }
    // Nothing more: the refused command's effect was never produced.
    let c2: BaseConsumer = broker().consumer(&unique("fx-reader"), &[]);
    c2.subscribe(&[fx.as_str()]).unwrap();
    let mut ids = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        if let Some(Ok(m)) = c2.poll(Duration::from_millis(200)) {
            let h = m.headers().unwrap();
            let key = h
                .iter()
                .find(|x| x.key == "idempotency-key")
                .and_then(|x| x.value)
                .map(|v| String::from_utf8_lossy(v).into_owned());
            ids.push(key.unwrap_or_default());
        }
    }
    assert!(!ids.iter().any(|k| k.starts_with("c-late")), "{ids:?}");
    server.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_brokers_a_kafka_effect_ends_dead_and_a_bad_topic_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(&dir.path().join("data"), FAST);
    let c = server.client();
    let t = token_of(&c.acquire("twin/valve-2", "a", 60_000).await);
    let bad = c
        .append(
            "valve-2",
            t,
            &json!([{"type": "valve", "patch": {}, "effects": [
                {"kind": "kafka", "topic": "no spaces", "body": 1}]}]),
        )
        .await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    assert_eq!(bad.body["error"], "bad_effects", "{:?}", bad.body);
    assert!(
        crate::outbox(&c, "").await.is_empty(),
        "a refused append left an effect"
    );

    let r = c
        .append("valve-2", t, &command("c1", "valve-commands", true))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = settled(&c, 1).await;
    assert_eq!(all[0]["state"], "dead", "{all:#?}");
    let error = all[0]["last_error"].as_str().unwrap();
    assert!(error.contains("--kafka-brokers"), "{error}");
    server.terminate();
}
