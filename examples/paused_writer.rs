//! The reference article's pause demo, against the real store.
//!
//! Client A takes a lease on `twin/device-7`, then "pauses" (a simulated GC
//! pause) for longer than its TTL. Meanwhile client B takes the lease and
//! writes. When A wakes up it writes with its old token, and the store
//! refuses it: B's value stands.
//!
//! ```text
//! cargo run --example paused_writer                          # embedded store in a temp folder
//! cargo run --example paused_writer -- http://127.0.0.1:7070 # a running `palisade serve`
//! ```

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

const TWIN: &str = "device-7";
const TTL_MS: u64 = 300;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (base, _embedded) = match std::env::args().nth(1) {
        Some(url) => (url.trim_end_matches('/').to_owned(), None),
        None => {
            let dir = tempfile::tempdir()?;
            let store = Arc::new(palisade::log::Store::open(dir.path(), Default::default())?);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let base = format!("http://{}", listener.local_addr()?);
            tokio::spawn(palisade::http::run(
                listener,
                store,
                Default::default(),
                std::future::pending(),
            ));
            println!(
                "embedded store at {base} (data in {})",
                dir.path().display()
            );
            (base, Some(dir))
        }
    };
    let http = reqwest::Client::new();
    let scope = format!("twin/{TWIN}");

    let a = acquire(&http, &base, &scope, "client-A").await?;
    println!("A acquires {scope}: token {}", a.1);

    let b = {
        let (http, base, scope) = (http.clone(), base.clone(), scope.clone());
        tokio::spawn(async move {
            // B arrives after A's lease has expired.
            tokio::time::sleep(Duration::from_millis(TTL_MS + 100)).await;
            let (_, token) = acquire(&http, &base, &scope, "client-B").await?;
            println!("B acquires {scope}: token {token} (A's lease expired while A was paused)");
            let r = write(&http, &base, token, "fresh-from-B").await?;
            println!("B writes with token {token}: {r}");
            anyhow::Ok(token)
        })
    };

    println!(
        "A pauses for {} ms (longer than its {TTL_MS} ms lease)...",
        2 * TTL_MS
    );
    tokio::time::sleep(Duration::from_millis(2 * TTL_MS)).await;
    let b_token = b.await??;
    let r = write(&http, &base, a.1, "stale-from-A").await?;
    println!("A wakes up and writes with token {}: {r}", a.1);

    let state: Value = http
        .get(format!("{base}/v1/twins/{TWIN}"))
        .send()
        .await?
        .json()
        .await?;
    println!("final state: {} (fence {})", state["state"], state["fence"]);
    if state["state"]["value"] != "fresh-from-B" || state["fence"] != b_token {
        bail!("the stale write won: this store is not fencing");
    }
    println!("the stale write was refused by the store; B's value stands");
    Ok(())
}

async fn acquire(
    http: &reqwest::Client,
    base: &str,
    scope: &str,
    holder: &str,
) -> anyhow::Result<(String, u64)> {
    let r = http
        .post(format!("{base}/v1/leases"))
        .json(&json!({ "scope": scope, "holder": holder, "ttl_ms": TTL_MS }))
        .send()
        .await
        .context("acquire")?;
    let status = r.status();
    let body: Value = r.json().await?;
    if !status.is_success() {
        bail!("acquire by {holder} refused: {status} {body}");
    }
    Ok((
        body["lease_id"].as_str().unwrap_or_default().to_owned(),
        body["token"].as_u64().unwrap_or_default(),
    ))
}

async fn write(
    http: &reqwest::Client,
    base: &str,
    token: u64,
    value: &str,
) -> anyhow::Result<String> {
    let r = http
        .post(format!("{base}/v1/twins/{TWIN}/events"))
        .header("Fencing-Token", token)
        .json(&json!({ "type": "set", "patch": { "value": value } }))
        .send()
        .await?;
    let status = r.status();
    let body: Value = r.json().await?;
    Ok(if status.is_success() {
        format!("accepted (seq {})", body["seqs"][0])
    } else {
        format!(
            "refused: {} {} (token {}, fence {})",
            status.as_u16(),
            body["error"],
            body["token"],
            body["fence"]
        )
    })
}
