//! Bad input gets a clear 400 (or the store's 403/404-class refusal) and
//! nothing reaches the upstream: no token, a token that is not a number,
//! two tokens, a path outside the scope rule, a twin id the store refuses,
//! a token never issued, and a header-rule proxy without its header.

use serde_json::json;

use super::support::token_of;
use super::{put, ProxyProcess, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_never_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();
    let t = token_of(&store.acquire("twin/part-6", "w", 60_000).await).to_string();
    let body = json!({"token": 0});

    let r = put(&proxy.url, "part-6", "", None, None, &body).await;
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (400, Some("missing_token")),
        "{:?}",
        r.body
    );
    for bad in ["abc", "-1", "1.5", "99999999999999999999999"] {
        let r = put(&proxy.url, "part-6", "", Some(bad), None, &body).await;
        assert_eq!(
            (r.status, r.body["error"].as_str()),
            (400, Some("bad_token")),
            "{bad}: {:?}",
            r.body
        );
    }
    // Two Fencing-Token headers are two claims: refused.
    let two = reqwest::Client::new()
        .put(format!("{}/api/parts/part-6", proxy.url))
        .header("fencing-token", &t)
        .header("fencing-token", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(two.status(), 400);
    // Outside the scope rule: no twin named.
    let other = reqwest::Client::new()
        .put(format!("{}/api/orders/o-1", proxy.url))
        .header("fencing-token", &t)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 400);
    let v: serde_json::Value = other.json().await.unwrap();
    assert_eq!(v["error"], "unknown_scope", "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("/api/parts/{twin}"),
        "{v}"
    );
    // A twin id the store would refuse (too long).
    let long = "x".repeat(300);
    let r = put(&proxy.url, &long, "", Some(&t), None, &body).await;
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (400, Some("unknown_scope")),
        "{:?}",
        r.body
    );
    // A token the store never issued: the store's own refusal.
    let r = put(&proxy.url, "part-6", "", Some("999999"), None, &body).await;
    assert_eq!(r.body["error"], "token_not_issued", "{:?}", r.body);
    assert!(r.status >= 400 && r.status < 500);
    // A token issued for another twin: the store's own refusal.
    let other_twin = token_of(&store.acquire("twin/part-7", "w", 60_000).await).to_string();
    let r = put(&proxy.url, "part-6", "", Some(&other_twin), None, &body).await;
    assert_eq!(r.body["error"], "token_scope_mismatch", "{:?}", r.body);

    assert!(
        upstream.seen().is_empty(),
        "forwarded: {:?}",
        upstream.seen()
    );
    // Nothing was admitted either: the twin has no history.
    let events = store.get("/v1/twins/part-6/events").await;
    assert_eq!(
        events.body["events"].as_array().map(Vec::len),
        Some(0),
        "{:?}",
        events.body
    );
    // The good request still flows.
    let r = put(&proxy.url, "part-6", "", Some(&t), None, &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_rule_needs_its_header() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    // --scope-header conflicts with the harness's --scope-path: start by hand.
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("proxy")
        .arg("--data")
        .arg(dir.path())
        .args(["--store-listen", "127.0.0.1:0", "--listen", "127.0.0.1:0"])
        .args([
            "--upstream",
            &upstream.url,
            "--scope-header",
            "Palisade-Twin",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let proxy = super::ProxyProcess::from_child(child);
    let store = proxy.store();
    let t = token_of(&store.acquire("twin/dev-1", "w", 60_000).await).to_string();
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/gateway/commands", proxy.url))
        .header("fencing-token", &t)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"], "unknown_scope", "{v}");
    assert!(upstream.seen().is_empty());
    let r = http
        .post(format!("{}/gateway/commands", proxy.url))
        .header("fencing-token", &t)
        .header("palisade-twin", "dev-1")
        .json(&json!({"token": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/gateway/commands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_the_limit_is_refused_and_not_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &["--max-body-bytes", "64"]);
    let store = proxy.store();
    let t = token_of(&store.acquire("twin/part-6", "w", 60_000).await).to_string();
    let big = json!({"token": 1, "blob": "x".repeat(100)});
    let r = put(&proxy.url, "part-6", "", Some(&t), None, &big).await;
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (413, Some("body_too_large")),
        "{:?}",
        r.body
    );
    assert!(upstream.seen().is_empty());
    let events = store.get("/v1/twins/part-6/events").await;
    assert_eq!(events.body["events"].as_array().map(Vec::len), Some(0));
    let r = put(
        &proxy.url,
        "part-6",
        "",
        Some(&t),
        None,
        &json!({"token": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

/// Settings that cannot work stop the proxy before it listens, with a
/// message naming the problem (exit 1; 2 for a clap usage error).
#[test]
fn bad_settings_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
            .arg("proxy")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let up = ["--upstream", "http://127.0.0.1:9"];
    for (args, code, needle) in [
        (
            vec!["--data", data, "--scope-path", "/api/{twin}"],
            Some(2),
            "--upstream",
        ),
        (
            vec![
                "--data",
                data,
                "--store-url",
                "http://127.0.0.1:1",
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
            ],
            Some(2),
            "cannot be used with",
        ),
        (vec!["--data", data, up[0], up[1]], Some(2), "--scope-path"),
        (
            vec!["--data", data, "--scope-path", "/api/parts", up[0], up[1]],
            Some(1),
            "exactly one {twin}",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                "--upstream",
                "ftp://plm:21",
            ],
            Some(1),
            "only http:// and https://",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
                "--upstream-ca-file",
                "/nonexistent/ca.pem",
            ],
            Some(1),
            "--upstream-ca-file /nonexistent/ca.pem",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
                "--security",
                "/nonexistent/security.toml",
            ],
            Some(1),
            "cannot read security file",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
                "--listen",
                "0.0.0.0:0",
            ],
            Some(1),
            "not a loopback address",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
                "--upstream-timeout-ms",
                "0",
            ],
            Some(1),
            "at least 1",
        ),
        (
            vec![
                "--data",
                data,
                "--scope-path",
                "/api/{twin}",
                up[0],
                up[1],
                "--store-listen",
                "0.0.0.0:0",
            ],
            Some(1),
            "loopback only",
        ),
    ] {
        let (got, stdout, stderr) = run(&args);
        assert_eq!(got, code, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stdout.contains("listening"), "{args:?} started: {stdout}");
    }
}

/// A token of a `partition/<p>` lease covers the partition's twins through
/// the proxy as it does in the store; a twin of another partition is
/// `token_scope_mismatch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_lease_covers_its_twins() {
    use palisade::core::{partition_for, TwinId};
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();
    let p = |t: &str| partition_for(&TwinId::new(t).unwrap(), 16).0;
    let mine = "part-11";
    let other = (0..100)
        .map(|i| format!("part-x{i}"))
        .find(|t| p(t) != p(mine))
        .unwrap();
    let t = token_of(
        &store
            .acquire(&format!("partition/{}", p(mine)), "pw", 60_000)
            .await,
    )
    .to_string();
    let r = put(&proxy.url, mine, "", Some(&t), None, &json!({"token": 1})).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = put(&proxy.url, &other, "", Some(&t), None, &json!({"token": 1})).await;
    assert_eq!(r.body["error"], "token_scope_mismatch", "{:?}", r.body);
    assert_eq!(upstream.seen().len(), 1);
}
