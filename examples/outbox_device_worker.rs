//! A worker whose device commands go through the fenced outbox
//! (docs/outbox.md): each command is an effect of the event that records
//! it, stored in the same fenced commit and delivered by the store after
//! that commit is durable. A worker fenced off (`409 stale_token`) leaves
//! no event and so no command: the device never hears from it.
//!
//! Three shells:
//!
//! ```text
//! cargo run --example outbox_device_worker -- gateway 127.0.0.1:8090      # the device gateway
//! palisade serve                                                           # the store (127.0.0.1:7070)
//! cargo run --example outbox_device_worker -- worker http://127.0.0.1:7070 http://127.0.0.1:8090 valve-7
//! ```
//!
//! Run two workers on one device and `kill -STOP` the first past its TTL,
//! `kill -CONT` it after the second took over: its next command is refused
//! by the store and never reaches the gateway. The gateway applies each
//! `Idempotency-Key` once (deliveries are at least once) and, as a second
//! line of defence, refuses a `Fencing-Token` below the highest it has seen
//! for the device.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::bail;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use palisade_client::{Client, ClientError, Effect, Event, LeaseOptions};
use serde_json::{json, Value};

#[derive(Default)]
struct Gateway {
    /// Highest fencing token seen per device.
    tokens: HashMap<String, u64>,
    applied: HashSet<String>,
}

type Shared = Arc<Mutex<Gateway>>;

async fn command(
    State(gw): State<Shared>,
    Path(device): Path<String>,
    headers: HeaderMap,
    Json(cmd): Json<Value>,
) -> StatusCode {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let key = header("idempotency-key").unwrap_or_default();
    let token: u64 = header("fencing-token")
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let mut gw = gw.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !gw.applied.insert(key.clone()) {
        return StatusCode::OK; // a repeated delivery: already applied
    }
    let highest = gw.tokens.entry(device.clone()).or_default();
    if token < *highest {
        println!("gateway: {device}: refused token {token} below {highest} ({key})");
        return StatusCode::CONFLICT;
    }
    *highest = token;
    println!("gateway: {device}: applies {cmd} under token {token} ({key})");
    StatusCode::OK
}

async fn serve_gateway(addr: &str) -> anyhow::Result<()> {
    let app = axum::Router::new()
        .route("/devices/{id}/commands", axum::routing::post(command))
        .with_state(Shared::default());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("device gateway on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

async fn worker(store: &str, gateway: &str, device: &str) -> anyhow::Result<()> {
    let client = Client::new(store)?;
    let holder = format!("device-worker-{}", std::process::id());
    let scope = format!("twin/{device}");
    println!("{holder}: waiting for {scope}");
    let lease = loop {
        match client
            .lease(
                &scope,
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
    println!("{holder}: holds {scope} with token {}", lease.token());
    let url = format!("{gateway}/devices/{device}/commands");
    for step in 1..=20u32 {
        let opening = step * 5;
        // The event records the decision; its effect is the command. Both
        // or neither: the store admits them in one fenced commit.
        let event = Event::new("valve_set", json!({"opening_pct": opening}))
            .with_id(format!("{holder}-{step}"))
            .with_effect(Effect::webhook(
                url.clone(),
                json!({"set": "opening_pct", "value": opening}),
            ));
        match lease.append(device, &[event]).await {
            Ok(a) => println!("{holder}: step {step} recorded at seq {:?}", a.seqs),
            Err(ClientError::Stale { token, fence }) => {
                println!("{holder}: fenced off (token {token} < fence {fence}); no command sent; stopping");
                return Ok(());
            }
            Err(e) => bail!("{holder}: step {step}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    lease.release().await?;
    println!("{holder}: done");
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
        ["gateway", addr] => serve_gateway(addr).await,
        ["worker", store, gateway, device] => worker(store, gateway, device).await,
        _ => {
            bail!("usage: outbox_device_worker gateway ADDR | worker STORE_URL GATEWAY_URL DEVICE")
        }
    }
}
