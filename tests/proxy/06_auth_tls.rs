//! Authentication and TLS. Remote mode against a `palisade serve` with
//! principals: the admission is made with the caller's own key
//! (`Palisade-Authorization`), so a token taken by worker-a and presented
//! with worker-b's key is `403 token_not_yours`, and without a key `401`:
//! neither is forwarded, and the key never reaches the upstream. The same
//! in embedded mode with `--security` (the store's own routes decide, and
//! audit, in process). The proxy's listener over HTTPS (`--tls-cert`,
//! `--tls-key`); an HTTPS upstream trusted through `--upstream-ca-file`.

use std::time::Duration;

use serde_json::{json, Value};

use super::support::ServeProcess;
use super::{ProxyProcess, Upstream};

const ROLES: &str = r#"
[roles.part-worker]
grants = [
  { actions = ["lease", "write", "read"], scopes = ["twin/part-*"] },
]
[roles.ops]
grants = [
  { actions = ["admin"], scopes = ["admin/*"] },
]
"#;

/// The principals of these tests: worker-a and worker-b (part workers),
/// ops (admin); their keys by name.
type Keys = std::collections::HashMap<String, String>;

fn security_file(dir: &std::path::Path) -> (std::path::PathBuf, Keys) {
    super::support::security_file(
        dir,
        ROLES,
        &[
            ("worker-a", "part-worker"),
            ("worker-b", "part-worker"),
            ("ops", "ops"),
        ],
    )
}

/// worker-a's lease on `scope` from the store at `base`: its token.
async fn lease_of(http: &reqwest::Client, base: &str, key: &str, scope: &str) -> u64 {
    let lease: Value = http
        .post(format!("{base}/v1/leases"))
        .bearer_auth(key)
        .json(&json!({"scope": scope, "ttl_ms": 60_000}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    lease["token"].as_u64().expect("a token")
}

/// No key: 401; worker-b's key with worker-a's token: 403; neither
/// forwarded. worker-a's key: forwarded, without the token or the key.
async fn only_the_owner_gets_through(
    http: &reqwest::Client,
    url: &str,
    token: u64,
    keys: &Keys,
    upstream: &Upstream,
) {
    let (status, body) = send(http, url, token, None).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (401, Some("unauthenticated")),
        "{body}"
    );
    let (status, body) = send(http, url, token, Some(&keys["worker-b"])).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("token_not_yours")),
        "{body}"
    );
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());

    let (status, body) = send(http, url, token, Some(&keys["worker-a"])).await;
    assert_eq!(status, 200, "{body}");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.get("palisade-authorization").is_none());
    assert!(seen[0].headers.get("authorization").is_none());
    assert!(seen[0].headers.get("fencing-token").is_none());
}

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
    let (security, keys) = security_file(dir.path());
    let data = dir.path().join("data");
    let serve = ServeProcess::start(&data, &["--security", security.to_str().unwrap()]);
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::remote(&serve.base, &upstream.url, &[]);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let token = lease_of(&http, &serve.base, &keys["worker-a"], "twin/part-1").await;
    let url = format!("{}/api/parts/part-1", proxy.url);
    only_the_owner_gets_through(&http, &url, token, &keys, &upstream).await;
}

/// Embedded mode with `--security`: the store API on `--store-listen` has
/// the principals, and the proxy's admissions are decided and audited by
/// the store's own routes, so the rules are the remote store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_admission_is_made_with_the_callers_key_and_audited() {
    let dir = tempfile::tempdir().unwrap();
    let (security, keys) = security_file(dir.path());
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(
        &dir.path().join("data"),
        &upstream.url,
        &["--security", security.to_str().unwrap()],
    );
    let store = proxy.store.clone().unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    // The store API has authentication too: no key, no lease.
    let r = http
        .post(format!("{store}/v1/leases"))
        .json(&json!({"scope": "twin/part-1", "ttl_ms": 60_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let token = lease_of(&http, &store, &keys["worker-a"], "twin/part-1").await;
    let url = format!("{}/api/parts/part-1", proxy.url);
    only_the_owner_gets_through(&http, &url, token, &keys, &upstream).await;

    // The store's audit log has the admission and both refusals.
    let audit: Value = http
        .get(format!("{store}/v1/audit"))
        .bearer_auth(&keys["ops"])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // (Accepted appends are not audited: the twin's history has them.)
    let writes: Vec<(&str, &str, &str)> = audit["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "write")
        .map(|r| {
            (
                r["outcome"].as_str().unwrap(),
                r["principal"].as_str().unwrap(),
                r["detail"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        writes,
        [
            ("unauthenticated", "", "unauthenticated"),
            ("forbidden", "worker-b", "token_not_yours"),
        ],
        "{audit}"
    );
}

/// An HTTPS upstream: refused (502, not reached) without its root, reached
/// with `--upstream-ca-file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_reached_with_its_root() {
    let dir = tempfile::tempdir().unwrap();
    let minted = super::support::mint_cert(dir.path());
    let (cert, key) = (minted.cert.clone(), minted.key.clone());
    let upstream = Upstream::start_tls(&cert, &key).await;
    assert!(upstream.url.starts_with("https://"));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    let untrusting = ProxyProcess::embedded(&dir.path().join("a"), &upstream.url, &[]);
    let token =
        super::support::token_of(&untrusting.store().acquire("twin/part-3", "w", 60_000).await);
    let url = format!("{}/api/parts/part-3", untrusting.url);
    let (status, body) = send(&http, &url, token, None).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (502, Some("upstream_unreachable")),
        "{body}"
    );
    assert!(upstream.seen().is_empty());
    drop(untrusting);

    let trusting = ProxyProcess::embedded(
        &dir.path().join("b"),
        &upstream.url,
        &["--upstream-ca-file", cert.to_str().unwrap()],
    );
    let token =
        super::support::token_of(&trusting.store().acquire("twin/part-3", "w", 60_000).await);
    let url = format!("{}/api/parts/part-3", trusting.url);
    let (status, body) = send(&http, &url, token, None).await;
    assert_eq!(status, 200, "{body}");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.get("idempotency-key").is_some());
    assert!(seen[0].headers.get("fencing-token").is_none());
}

/// A remote store over HTTPS: admissions reach it with `--store-ca-file`;
/// without the root nothing is admitted, so nothing is forwarded (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_store_over_https_is_reached_with_its_root() {
    let dir = tempfile::tempdir().unwrap();
    let minted = super::support::mint_cert(dir.path());
    let (cert, key) = (minted.cert.clone(), minted.key.clone());
    let serve = ServeProcess::start(
        &dir.path().join("data"),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    assert!(serve.base.starts_with("https://"), "{}", serve.base);
    let https = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(minted.cert_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let lease: Value = https
        .post(format!("{}/v1/leases", serve.base))
        .json(&json!({"scope": "twin/part-4", "holder": "w", "ttl_ms": 60_000}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = lease["token"].as_u64().expect("a token");
    let upstream = Upstream::start().await;

    let untrusting = ProxyProcess::remote(&serve.base, &upstream.url, &[]);
    let url = format!("{}/api/parts/part-4", untrusting.url);
    let (status, body) = send(&https, &url, token, None).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("store_unreachable")),
        "{body}"
    );
    assert!(upstream.seen().is_empty());
    drop(untrusting);

    let trusting = ProxyProcess::remote(
        &serve.base,
        &upstream.url,
        &["--store-ca-file", cert.to_str().unwrap()],
    );
    let url = format!("{}/api/parts/part-4", trusting.url);
    let (status, body) = send(&https, &url, token, None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(upstream.seen().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_https() {
    let dir = tempfile::tempdir().unwrap();
    let minted = super::support::mint_cert(dir.path());
    let (cert, key) = (minted.cert.clone(), minted.key.clone());
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
    // The store API on --store-listen is served with the same certificate.
    let store = proxy.store.clone().unwrap();
    assert!(store.starts_with("https://"), "{store}");
    let https = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(minted.cert_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let lease: Value = https
        .post(format!("{store}/v1/leases"))
        .json(&json!({"scope": "twin/part-2", "holder": "w", "ttl_ms": 60_000}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = lease["token"].as_u64().expect("a token");
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
