//! The fenced outbox end to end (docs/outbox.md): a real `palisade serve`
//! process, a real webhook receiver of the test's own. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_fenced.rs"]
mod fenced;

#[path = "02_retries.rs"]
mod retries;

#[path = "03_bad_input.rs"]
mod bad_input;

#[path = "04_sigkill.rs"]
mod sigkill;

#[path = "05_sdk_cli.rs"]
mod sdk_cli;

#[path = "06_https.rs"]
mod https;

#[path = "07_prune.rs"]
mod prune;

#[path = "08_remove_dead.rs"]
mod remove_dead;

#[path = "09_kafka.rs"]
mod kafka;

#[allow(dead_code)]
#[path = "../kafka/broker.rs"]
mod broker;

mod receiver;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub use receiver::{Receiver, Seen};

/// Fast retries for the tests (the backoff's shape is the unit tests').
pub const FAST: &[&str] = &[
    "--outbox-backoff-ms",
    "5",
    "--outbox-backoff-max-ms",
    "20",
    "--outbox-max-attempts",
    "3",
];

/// `GET /v1/outbox` (all states), the entries.
pub async fn outbox(c: &support::Client, query: &str) -> Vec<Value> {
    let r = c.get(&format!("/v1/outbox?limit=1024{query}")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body["effects"].as_array().unwrap().clone()
}

/// Wait until the outbox has `n` entries and none is pending.
pub async fn settled(c: &support::Client, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all = outbox(c, "").await;
        if all.len() == n && all.iter().all(|e| e["state"] != "pending") {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "the outbox never settled at {n}: {all:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A webhook effect.
pub fn hook(url: &str, body: Value) -> Value {
    json!({"kind": "webhook", "url": url, "body": body})
}
