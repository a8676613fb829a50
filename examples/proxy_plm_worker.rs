//! A PLM integration worker that drives a PLM-like REST API through
//! `palisade proxy` (docs/proxy.md): the PLM API knows nothing of fencing
//! tokens; the proxy lets a request through only if the store's fence
//! admits the worker's token on the part's twin.
//!
//! Three shells:
//!
//! ```text
//! cargo run --example proxy_plm_worker -- plm 127.0.0.1:8080          # the PLM-like API
//! palisade proxy --data ./proxy-data --store-listen 127.0.0.1:7070 \
//!     --upstream http://127.0.0.1:8080 --scope-path '/api/parts/{twin}'
//! cargo run --example proxy_plm_worker -- worker http://127.0.0.1:7070 http://127.0.0.1:7080 p-7
//! ```
//!
//! Run two workers on the same part: the second waits for the lease; stop
//! the first with `kill -STOP` past its TTL and `kill -CONT` it after the
//! second took over: its next revision is refused with `409 stale_token`
//! and never reaches the PLM API.
//!
//! The PLM-like API applies `PUT /api/parts/{id}` (a JSON revision) and
//! keeps the `Idempotency-Key`s it has applied, so a retried request is
//! applied once; `GET /api/parts/{id}` shows what it holds.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use palisade_client::{Client, LeaseOptions};
use serde_json::{json, Value};

#[derive(Default)]
struct Plm {
    parts: HashMap<String, Value>,
    applied: HashSet<String>,
}

type Shared = Arc<Mutex<Plm>>;

async fn put_part(
    State(plm): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(rev): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut plm = plm
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(k) = &key {
        if !plm.applied.insert(k.clone()) {
            return (StatusCode::OK, Json(json!({"part": id, "duplicate": true})));
        }
    }
    println!("PLM applies {id}: {rev} (key {key:?})");
    plm.parts.insert(id.clone(), rev);
    (StatusCode::OK, Json(json!({"part": id, "applied": true})))
}

async fn get_part(State(plm): State<Shared>, Path(id): Path<String>) -> (StatusCode, Json<Value>) {
    let plm = plm
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match plm.parts.get(&id) {
        Some(v) => (StatusCode::OK, Json(v.clone())),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such part"})),
        ),
    }
}

async fn serve_plm(addr: &str) -> anyhow::Result<()> {
    let app = axum::Router::new()
        .route(
            "/api/parts/{id}",
            axum::routing::put(put_part).get(get_part),
        )
        .with_state(Shared::default());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("PLM-like API on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

async fn worker(store: &str, proxy: &str, part: &str) -> anyhow::Result<()> {
    let client = Client::new(store)?;
    let holder = format!("plm-worker-{}", std::process::id());
    println!("{holder}: waiting for twin/{part}");
    let lease = loop {
        match client
            .lease(
                &format!("twin/{part}"),
                &holder,
                Duration::from_secs(3),
                LeaseOptions::default(),
            )
            .await
        {
            Ok(l) => break l,
            Err(e) if e.error_name() == Some("lease_held") => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let token = lease.token();
    println!("{holder}: holds twin/{part} with token {token}");
    let http = reqwest::Client::new();
    for rev in 1..=20u32 {
        // A real worker would also stop early on `lease.is_lost()` (the
        // guard's warning, an optimisation). This one does not, to show the
        // safety net: a worker paused past its lease sends anyway, and the
        // proxy refuses it before the PLM API sees it.
        let r = http
            .put(format!("{proxy}/api/parts/{part}"))
            .header("fencing-token", token.to_string())
            // A stable request id: a retry of this revision gets the same
            // Idempotency-Key upstream.
            .header("x-request-id", format!("{holder}-rev-{rev}"))
            .json(&json!({"revision": rev, "by": holder}))
            .send()
            .await
            .context("the proxy did not answer")?;
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        match status.as_u16() {
            200..=299 => println!("{holder}: revision {rev} applied: {body}"),
            409 => {
                println!("{holder}: fenced off ({body}); stopping");
                return Ok(());
            }
            _ => bail!("{holder}: revision {rev}: {status} {body}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if let Err(e) = lease.release().await {
        println!("{holder}: release: {e}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["plm", addr] => serve_plm(addr).await,
        ["worker", store, proxy, part] => worker(store, proxy, part).await,
        _ => bail!("usage: proxy_plm_worker plm ADDR | worker STORE_URL PROXY_URL PART"),
    }
}
