//! The HTTP API end to end: a real store in a temp folder, served by the real
//! axum router on 127.0.0.1:0, driven over real HTTP. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_leases.rs"]
mod leases;

#[path = "02_fencing.rs"]
mod fencing;

#[path = "03_reads.rs"]
mod reads;

#[path = "04_bad_input.rs"]
mod bad_input;

#[path = "05_watch.rs"]
mod watch;

#[path = "06_shadow.rs"]
mod shadow;

#[path = "07_durable.rs"]
mod durable;

#[path = "08_ttl_advice.rs"]
mod ttl_advice;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use palisade::http::HttpConfig;
use palisade::lease::ManualClock;
use palisade::log::StoreConfig;

use palisade::core::{partition_for, TwinId};
use serde_json::Value;
use support::{Client, Resp, TestServer};
use tempfile::TempDir;

/// Partition count of a store created with the default settings.
pub const PARTITIONS: u32 = 16;

/// A fresh store whose embedded leases run on a clock the test moves
/// (`clock.advance(..)` past a TTL instead of sleeping). Keep the `TempDir` alive.
pub async fn start_clocked() -> (TempDir, TestServer, Client, Arc<ManualClock>) {
    let dir = tempfile::tempdir().unwrap();
    let wall_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let clock = Arc::new(ManualClock::at(wall_ms));
    let config = StoreConfig {
        lease_clock: clock.clone(),
        ..StoreConfig::default()
    };
    let server = TestServer::start_with(dir.path(), config, HttpConfig::default()).await;
    let client = server.client();
    (dir, server, client, clock)
}

/// A fresh store in a temp folder, served over HTTP. Keep the `TempDir` alive.
pub async fn start() -> (TempDir, TestServer, Client) {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path()).await;
    let client = server.client();
    (dir, server, client)
}

/// The partition of `twin` in a 16-partition store.
pub fn partition_of(twin: &str) -> u32 {
    partition_for(&TwinId::new(twin).unwrap(), PARTITIONS).0
}

/// The first twin id `<prefix>-<n>` that lives in partition `p`.
pub fn twin_in(p: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| partition_of(t) == p)
        .unwrap()
}

/// The first twin id `<prefix>-<n>` that does not live in partition `p`.
pub fn twin_not_in(p: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| partition_of(t) != p)
        .unwrap()
}

/// Now as NTP64 (seconds since 1970 in the high 32 bits, fraction below),
/// shifted by `ahead`.
pub fn ntp64_in(ahead: Duration) -> u64 {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap() + ahead;
    (d.as_secs() << 32) | ((u64::from(d.subsec_nanos()) << 32) / 1_000_000_000)
}

/// An HLC string in uhlc's text form.
pub fn hlc_string(ntp64: u64, id: u128) -> String {
    format!("{ntp64}/{id:x}")
}

/// Send a hand-built request and collect it like `Client` does.
pub async fn send(req: reqwest::RequestBuilder) -> Resp {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let bytes = r.bytes().await.unwrap();
    Resp {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        headers,
    }
}

/// Every stored event of a twin (one page of up to 1000).
pub async fn history(c: &Client, twin: &str) -> Vec<Value> {
    let r = c.get(&format!("/v1/twins/{twin}/events?limit=1000")).await;
    assert_eq!(r.status, 200, "history of {twin}: {:?}", r.body);
    r.body["events"].as_array().unwrap().clone()
}

/// Assert an error response: status and stable `error` name.
#[track_caller]
pub fn assert_error(r: &Resp, status: u16, error: &str) {
    assert_eq!(r.status, status, "want {status} {error}, got {:?}", r.body);
    assert_eq!(r.body["error"], error, "body: {:?}", r.body);
    assert!(
        r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error body without a message: {:?}",
        r.body
    );
}
