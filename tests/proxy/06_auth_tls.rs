//! Authentication and TLS. Remote mode against a `palisade serve` with
//! principals: the admission is made with the caller's own key
//! (`Palisade-Authorization`), so a token taken by worker-a and presented
//! with worker-b's key is `403 token_not_yours`, and without a key `401`:
//! neither is forwarded, and the key never reaches the upstream. The
//! proxy's listener over HTTPS (`--tls-cert`, `--tls-key`).

use std::time::Duration;

use serde_json::{json, Value};

use super::support::ServeProcess;
use super::{ProxyProcess, Upstream};

const ROLES: &str = r#"
[roles.part-worker]
grants = [
  { actions = ["lease", "write", "read"], scopes = ["twin/part-*"] },
]
"#;

async fn send(http: &reqwest::Client, url: &str, token: u64, key: Option<&str>) -> (u16, Value) {
    let mut req = http
        .put(url)
        .header("fencing-token", token.to_string())
        .json(&json!({"token": token}));
    if let Some(k) = key {
        req = req.header("palisade-authorization", format!("Bearer {k}"));
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_admission_is_made_with_the_callers_key() {
    let dir = tempfile::tempdir().unwrap();
    let (key_a, key_b) = (
        palisade::http::auth::mint_key().unwrap().0,
        palisade::http::auth::mint_key().unwrap().0,
    );
    let mut file = ROLES.to_owned();
    for (name, key) in [("worker-a", &key_a), ("worker-b", &key_b)] {
        file.push_str(&format!(
            "[[principals]]\nname = \"{name}\"\nkey_sha256 = \"{}\"\nroles = [\"part-worker\"]\n",
            palisade::http::auth::hash_key(key)
        ));
    }
    let security = dir.path().join("security.toml");
    std::fs::write(&security, file).unwrap();
    let data = dir.path().join("data");
    let serve = ServeProcess::start(&data, &["--security", security.to_str().unwrap()]);
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::remote(&serve.base, &upstream.url, &[]);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    let lease: Value = http
        .post(format!("{}/v1/leases", serve.base))
        .bearer_auth(&key_a)
        .json(&json!({"scope": "twin/part-1", "ttl_ms": 60_000}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = lease["token"].as_u64().expect("a token");
    let url = format!("{}/api/parts/part-1", proxy.url);

    let (status, body) = send(&http, &url, token, None).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (401, Some("unauthenticated")),
        "{body}"
    );
    let (status, body) = send(&http, &url, token, Some(&key_b)).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("token_not_yours")),
        "{body}"
    );
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());

    let (status, body) = send(&http, &url, token, Some(&key_a)).await;
    assert_eq!(status, 200, "{body}");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.get("palisade-authorization").is_none());
    assert!(seen[0].headers.get("fencing-token").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_https() {
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(
        &dir.path().join("data"),
        &upstream.url,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    assert!(proxy.url.starts_with("https://"), "{}", proxy.url);
    let token = super::support::token_of(&proxy.store().acquire("twin/part-2", "w", 60_000).await);
    let https = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ck.cert.pem().as_bytes()).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let (status, body) = send(
        &https,
        &format!("{}/api/parts/part-2", proxy.url),
        token,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(upstream.seen().len(), 1);
    // Plain HTTP to the TLS port gets nothing forwarded.
    let plain = proxy.url.replace("https://", "http://");
    let r = reqwest::Client::new()
        .put(format!("{plain}/api/parts/part-2"))
        .header("fencing-token", token.to_string())
        .send()
        .await;
    assert!(r.is_err() || !r.unwrap().status().is_success());
    assert_eq!(upstream.seen().len(), 1);
}
