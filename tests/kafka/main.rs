//! Kafka ingestion end to end: real `palisade serve` processes consuming a
//! real Kafka-protocol broker (librdkafka's mock cluster or tansu 0.6.0).
//! See README.md for the broker selection and what each file guards against.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

mod broker;

#[path = "01_stale_tokens.rs"]
mod stale_tokens;

#[path = "02_scenario3.rs"]
mod scenario3;

#[path = "03_restart_exactly_once.rs"]
mod restart_exactly_once;

#[path = "04_rebalance.rs"]
mod rebalance;

#[path = "05_garbage.rs"]
mod garbage;

#[path = "06_interop.rs"]
mod interop;

#[path = "07_partitioners.rs"]
mod partitioners;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use palisade::core::{partition_for, FencingToken, NewEvent, TwinId};
use palisade_kafka::Publisher;
use serde_json::{json, Value};

use broker::{broker, TestTopic, PARTITIONS};
use support::{Client, ServeProcess};

/// Start `palisade serve` on `data`, consuming `t`, with `extra` arguments.
pub fn serve(data: &Path, t: &TestTopic, extra: &[&str]) -> ServeProcess {
    let mut args = t.serve_args();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ServeProcess::start(data, &args)
}

/// A protobuf publisher (the workers' API) for `topic`.
pub fn publisher(topic: &str) -> Publisher {
    Publisher::new(&broker().bootstrap, topic, &broker().producer_settings())
        .expect("create a publisher")
}

/// One record as produced, and where the broker put it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub twin: String,
    pub token: u64,
    pub event_id: String,
    pub partition: u32,
    pub offset: u64,
}

/// Publish one `update` event `{ "n": n, "by": by }` with id `event_id`.
/// Checks the broker put it in the partition Palisade computes (murmur2).
pub async fn publish(p: &Publisher, twin: &str, token: u64, event_id: &str, patch: Value) -> Sent {
    let id = TwinId::new(twin).unwrap();
    let Value::Object(patch) = patch else {
        panic!("a patch is an object")
    };
    let ev = NewEvent {
        event_id: event_id.to_owned(),
        event_type: "update".into(),
        patch,
        hlc: None,
    };
    let (partition, offset) = p
        .publish(&id, FencingToken(token), &ev)
        .await
        .unwrap_or_else(|e| panic!("publish {event_id}: {e}"));
    let partition = u32::try_from(partition).unwrap();
    assert_eq!(
        partition,
        partition_of(twin),
        "the producer's murmur2 partitioner and Palisade disagree about {twin}"
    );
    Sent {
        twin: twin.to_owned(),
        token,
        event_id: event_id.to_owned(),
        partition,
        offset: u64::try_from(offset).unwrap(),
    }
}

/// A `palisade.v1.TwinEvent` encoded by hand (fields 1 `event_id`, 2
/// `type`, 3 `patch_json`; each shorter than 128 bytes), for records no
/// publisher would make.
pub fn proto_event(event_id: &str, ty: &str, patch: &str) -> Vec<u8> {
    let mut v = Vec::new();
    for (field, s) in [(1u8, event_id), (2, ty), (3, patch)] {
        v.push((field << 3) | 2);
        v.push(u8::try_from(s.len()).unwrap());
        v.extend_from_slice(s.as_bytes());
    }
    v
}

pub fn partition_of(twin: &str) -> u32 {
    partition_for(&TwinId::new(twin).unwrap(), PARTITIONS).0
}

/// `n` twin ids `PREFIX-<i>` that land in partition `p`.
pub fn twins_in(prefix: &str, p: u32, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|t| partition_of(t) == p)
        .take(n)
        .collect()
}

/// Poll `f` every 100 ms until it returns `Ok`, or panic after `timeout`
/// with the last state it described.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(state) => assert!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}; last seen: {state}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Prometheus text of `/metrics`.
pub async fn metrics_text(c: &Client) -> String {
    let r = c
        .http
        .get(format!("{}/metrics", c.base))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "/metrics: {}", r.status());
    r.text().await.unwrap()
}

/// Sum of every sample of `name` whose labels include all of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            (n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())
            .flatten()
        })
        .sum()
}

/// `palisade_kafka_records_total` by outcome (summed over partitions).
pub async fn outcomes(c: &Client) -> BTreeMap<&'static str, u64> {
    let text = metrics_text(c).await;
    [
        "applied",
        "already_applied",
        "dropped_stale",
        "dead_lettered",
    ]
    .into_iter()
    .map(|o| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = metric_sum(&text, "palisade_kafka_records_total", &[("outcome", o)]) as u64;
        (o, n)
    })
    .collect()
}

/// Records this process handled, whatever their outcome.
pub fn handled(o: &BTreeMap<&'static str, u64>) -> u64 {
    o.values().sum()
}

/// Wait until this process has handled `n` records (any outcome).
pub async fn wait_handled(c: &Client, n: u64, timeout: Duration) -> BTreeMap<&'static str, u64> {
    eventually(&format!("{n} records handled"), timeout, || async {
        let o = outcomes(c).await;
        match handled(&o).cmp(&n) {
            std::cmp::Ordering::Less => Err(format!("{o:?}")),
            std::cmp::Ordering::Equal => Ok(o),
            std::cmp::Ordering::Greater => panic!("more records handled than produced: {o:?}"),
        }
    })
    .await
}

/// Every stored event of a twin, oldest first (all pages).
pub async fn history(c: &Client, twin: &str) -> Vec<Value> {
    paged(c, &format!("/v1/twins/{twin}/events")).await
}

/// Every event of a partition, in sequence order (all pages).
pub async fn partition_events(c: &Client, p: u32) -> Vec<Value> {
    paged(c, &format!("/v1/partitions/{p}/events")).await
}

async fn paged(c: &Client, path: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let r = c.get(&format!("{path}?after={after}&limit=1000")).await;
        assert_eq!(r.status, 200, "{path}: {:?}", r.body);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = r.body["next_after"].as_u64().unwrap();
        out.extend(page);
    }
}

pub fn event_ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Partition heads (the last sequence number of each partition).
pub async fn heads(c: &Client) -> Vec<u64> {
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["head"].as_u64().unwrap())
        .collect()
}

/// Rejections logged for Kafka records, oldest first.
pub async fn kafka_rejections(c: &Client) -> Vec<Value> {
    let r = c.get("/v1/rejections?limit=1024").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let mut v: Vec<Value> = r.body["rejections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["source"] == "kafka")
        .cloned()
        .collect();
    v.reverse();
    v
}

/// Take a twin lease and return its token.
pub async fn twin_token(c: &Client, twin: &str, holder: &str) -> (u64, String) {
    let l = c.acquire(&format!("twin/{twin}"), holder, 600_000).await;
    (support::token_of(&l), support::lease_id_of(&l))
}

pub async fn release(c: &Client, lease_id: &str) {
    let r = c.delete(&format!("/v1/leases/{lease_id}")).await;
    assert_eq!(r.status, 204, "release {lease_id}: {:?}", r.body);
}

pub async fn healthy(c: &Client) {
    let r = c.get("/healthz").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body, json!({ "status": "ok" }));
}
