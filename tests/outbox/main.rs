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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Fast retries for the tests (the backoff's shape is the unit tests').
pub const FAST: &[&str] = &[
    "--outbox-backoff-ms",
    "5",
    "--outbox-backoff-max-ms",
    "20",
    "--outbox-max-attempts",
    "3",
];

/// One POST as the receiver saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub key: String,
    pub token: String,
    pub body: Value,
    pub headers: HeaderMap,
}

/// The webhook receiver: an axum server on 127.0.0.1:0 recording every
/// request with its headers, before it answers. Paths:
/// `/ok/...` answers 200; `/flaky/<k>/...` answers 500 to its first `k`
/// requests, then 200; `/down/...` always 500; `/hold/<n>/...` answers 200
/// to its first `n` requests and holds every later one unanswered until
/// [`Receiver::release`].
#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    counts: Arc<Mutex<HashMap<String, usize>>>,
    released: Arc<watch::Sender<bool>>,
}

impl Receiver {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let r = Self {
            url,
            seen: Arc::default(),
            counts: Arc::default(),
            released: Arc::new(watch::Sender::new(false)),
        };
        let state = r.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let s = state.clone();
            async move { s.handle(uri, headers, body).await }
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        r
    }

    async fn handle(&self, uri: Uri, headers: HeaderMap, body: Bytes) -> StatusCode {
        let path = uri.path().to_owned();
        let h = |n: &str| {
            headers
                .get(n)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        self.seen.lock().unwrap().push(Seen {
            path: path.clone(),
            key: h("idempotency-key"),
            token: h("fencing-token"),
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            headers: headers.clone(),
        });
        let n = {
            let mut c = self.counts.lock().unwrap();
            let n = c.entry(path.clone()).or_default();
            *n += 1;
            *n
        };
        let parts: Vec<&str> = path.split('/').collect();
        let arg = || parts.get(2).and_then(|k| k.parse::<usize>().ok()).unwrap();
        match parts.get(1).copied() {
            Some("ok") => StatusCode::OK,
            Some("flaky") if n <= arg() => StatusCode::INTERNAL_SERVER_ERROR,
            Some("flaky") => StatusCode::OK,
            Some("hold") if n <= arg() => StatusCode::OK,
            Some("hold") => {
                let _ = self.released.subscribe().wait_for(|r| *r).await;
                StatusCode::OK
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn release(&self) {
        self.released.send_replace(true);
    }

    /// Wait until `f` holds for what the receiver saw (panics after 60 s:
    /// a liveness bound, not a speed check).
    pub async fn wait_for(&self, what: &str, f: impl Fn(&[Seen]) -> bool) -> Vec<Seen> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let seen = self.seen();
            if f(&seen) {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "receiver: never {what}; saw {seen:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

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
