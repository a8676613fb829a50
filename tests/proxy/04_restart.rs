//! The proxy (with its embedded store) is killed (SIGKILL) and started
//! again on the same data: the fences its admissions raised survive, an
//! old token is refused and never forwarded, the current one still flows,
//! and a retried request is not admitted twice.

use serde_json::json;

use super::support::token_of;
use super::{hand_over, put, ProxyProcess, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_survive_a_proxy_crash() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();
    let a = store.acquire("twin/part-5", "worker-a", 60_000).await;
    let ta = token_of(&a);
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&ta.to_string()),
        Some("a-1"),
        &json!({"token": ta}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // A's lease goes (released here; expiry is the same), B takes over.
    let tb = hand_over(&store, &a, "twin/part-5").await;
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&tb.to_string()),
        Some("b-1"),
        &json!({"token": tb}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let key_b1 = r.headers["idempotency-key"].to_str().unwrap().to_owned();

    proxy.kill();
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();

    // A's token is below the fence B's grant and admission raised.
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&ta.to_string()),
        Some("a-2"),
        &json!({"token": ta}),
    )
    .await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["error"], "stale_token");
    assert_eq!(r.body["fence"], tb);
    // B still writes, and its retried request is admitted once only.
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&tb.to_string()),
        Some("b-1"),
        &json!({"token": tb}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.headers["idempotency-key"].to_str().unwrap(), key_b1);
    let events = store.get("/v1/twins/part-5/events").await;
    let list = events.body["events"].as_array().unwrap();
    assert_eq!(list.len(), 2, "{:?}", events.body);

    let tokens: Vec<u64> = upstream.seen().iter().map(super::Seen::token).collect();
    assert_eq!(
        tokens,
        vec![ta, tb, tb],
        "A's late request never reached the upstream"
    );
}

/// SIGTERM: the proxy stops accepting, finishes, closes its store and
/// exits 0; the fences are there on the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_cleanly_and_the_fences_stay() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let mut proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();
    let a = store.acquire("twin/part-5", "worker-a", 60_000).await;
    let ta = token_of(&a);
    // A's lease goes (released here; expiry is the same), B takes over.
    let tb = hand_over(&store, &a, "twin/part-5").await;
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&tb.to_string()),
        None,
        &json!({"token": tb}),
    )
    .await;
    assert_eq!(r.status, 200);
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &proxy.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let status = proxy.child.wait().unwrap();
    assert!(status.success(), "palisade proxy exited with {status}");
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let r = put(
        &proxy.url,
        "part-5",
        "",
        Some(&ta.to_string()),
        None,
        &json!({"token": ta}),
    )
    .await;
    assert_eq!(
        (r.status, r.body["fence"].as_u64()),
        (409, Some(tb)),
        "{:?}",
        r.body
    );
    assert_eq!(upstream.seen().len(), 1);
}
