//! A measurement, not a test (`#[ignore]`; no assertion on time): appends
//! per second over plain HTTP on loopback with authentication off and on
//! (same store settings, same client), to see what the guard costs.
//!
//!     cargo test --release --test security -- --ignored --nocapture overhead

use std::time::Instant;

use palisade::http::{HttpConfig, Security, SecurityFile};
use palisade::log::{Store, StoreConfig};
use serde_json::json;
use tokio::net::TcpListener;

use crate::{fresh_keys, security_toml};

async fn run(auth: bool, requests: usize, tasks: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let keys = fresh_keys();
    let text = if auth {
        security_toml(&keys, "")
    } else {
        String::new()
    };
    let file: SecurityFile = toml::from_str(&text).unwrap();
    let http = HttpConfig {
        security: Security::from_file(&file).unwrap(),
        ..HttpConfig::default()
    };
    let store = std::sync::Arc::new(Store::open(dir.path(), StoreConfig::default()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(palisade::http::run(listener, store.clone(), http, async {
        let _ = rx.await;
    }));
    let client = reqwest::Client::new();
    let key = keys["pworker"].clone();
    let with_key = |r: reqwest::RequestBuilder| if auth { r.bearer_auth(&key) } else { r };
    // One partition lease per task's partition, so tasks do not contend on
    // one twin's lease.
    let mut tokens = Vec::new();
    for p in 0..tasks {
        let r = with_key(client.post(format!("{base}/v1/leases")))
            .json(
                &json!({"scope": format!("partition/{p}"), "holder": "pworker", "ttl_ms": 600_000}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let v: serde_json::Value = r.json().await.unwrap();
        tokens.push(v["token"].as_u64().unwrap());
    }
    let started = Instant::now();
    let mut handles = Vec::new();
    for (i, token) in tokens.into_iter().enumerate() {
        let twin = crate::table::twin_in(i as u32, "bench");
        let (client, base, key) = (client.clone(), base.clone(), key.clone());
        handles.push(tokio::spawn(async move {
            for n in 0..requests / tasks {
                let mut r = client
                    .post(format!("{base}/v1/twins/{twin}/events"))
                    .header("fencing-token", token.to_string())
                    .json(&json!({"type": "u", "patch": {"n": n}}));
                if auth {
                    r = r.bearer_auth(&key);
                }
                assert_eq!(r.send().await.unwrap().status(), 201);
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let rate = requests as f64 / started.elapsed().as_secs_f64();
    let _ = tx.send(());
    server.await.unwrap().unwrap();
    store.close().await;
    rate
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run with --ignored --nocapture"]
async fn overhead_of_the_guard_on_appends() {
    for round in 0..3 {
        for tasks in [1, 8] {
            let off = run(false, 4000, tasks).await;
            let on = run(true, 4000, tasks).await;
            println!(
                "round {round} tasks {tasks}: auth off {off:.0} appends/s, auth on {on:.0} appends/s ({:+.1}%)",
                (on / off - 1.0) * 100.0
            );
        }
    }
}
