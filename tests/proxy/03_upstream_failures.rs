//! The upstream times out, answers 5xx or is not there: the proxy answers
//! 504/502 with a JSON error naming the idempotency key, counts it,
//! records the failure in the twin's history, and releases the twin, so
//! the next request flows.

use serde_json::json;

use super::support::token_of;
use super::{metric, put, ProxyProcess, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_and_5xx_answer_504_and_502_and_release_the_twin() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy =
        ProxyProcess::embedded(dir.path(), &upstream.url, &["--upstream-timeout-ms", "300"]);
    let store = proxy.store();
    let t = token_of(&store.acquire("twin/part-3", "w", 60_000).await).to_string();

    // The upstream never answers this one (until released, at the end).
    let r = put(
        &proxy.url,
        "part-3",
        "/slow",
        Some(&t),
        Some("r-slow"),
        &json!({"token": 1}),
    )
    .await;
    assert_eq!(r.status, 504, "{:?}", r.body);
    assert_eq!(r.body["error"], "upstream_timeout");
    let key = r.body["idempotency_key"].as_str().unwrap().to_owned();
    assert!(key.starts_with("pxy-"));
    // The twin is free again: the next request of the same twin flows.
    let r = put(
        &proxy.url,
        "part-3",
        "",
        Some(&t),
        Some("r-2"),
        &json!({"token": 2}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);

    // A 5xx answer becomes 502, and the twin is free again too.
    let r = put(
        &proxy.url,
        "part-3",
        "/fail",
        Some(&t),
        Some("r-3"),
        &json!({"token": 3}),
    )
    .await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(r.body["error"], "upstream_failed");
    assert_eq!(r.body["upstream_status"], 500);
    let r = put(
        &proxy.url,
        "part-3",
        "",
        Some(&t),
        Some("r-4"),
        &json!({"token": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);

    // A retry of the timed-out request (same request id) carries the same
    // idempotency key, so an upstream that honours it applies it once.
    upstream.release_slow();
    let r = put(
        &proxy.url,
        "part-3",
        "",
        Some(&t),
        Some("r-slow"),
        &json!({"token": 1}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["idempotency-key"].to_str().unwrap(), key);

    assert_eq!(
        metric(
            &proxy.url,
            "palisade_proxy_upstream_failed_total{kind=\"timeout\"}"
        )
        .await,
        1
    );
    assert_eq!(
        metric(
            &proxy.url,
            "palisade_proxy_upstream_failed_total{kind=\"status\"}"
        )
        .await,
        1
    );
    assert_eq!(
        metric(&proxy.url, "palisade_proxy_forwarded_total").await,
        3
    );
    // The retry was admitted again as a duplicate of its first admission.
    assert_eq!(metric(&proxy.url, "palisade_proxy_retried_total").await, 1);
    // The history: four admissions (the retry is the first one's
    // duplicate) and a failure record for each failed request, after its
    // admission, naming its key and what happened.
    let events = store.get("/v1/twins/part-3/events").await;
    let list = events.body["events"].as_array().unwrap();
    let kinds: Vec<&str> = list.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "palisade.proxy.admitted",
            "palisade.proxy.upstream_failed",
            "palisade.proxy.admitted",
            "palisade.proxy.admitted",
            "palisade.proxy.upstream_failed",
            "palisade.proxy.admitted",
        ],
        "{:?}",
        events.body
    );
    let timeout = &list[1]["patch"]["palisade_proxy"];
    assert_eq!(timeout["idempotency_key"], key.as_str());
    assert_eq!(timeout["upstream_failure"], "timeout");
    let failed = &list[4]["patch"]["palisade_proxy"];
    assert_eq!(failed["upstream_failure"], "status");
    assert_eq!(failed["upstream_status"], 500);
    // The twin's state shows the last request, with no stale failure.
    let state = store.twin("part-3").await;
    let last = &state.body["state"]["palisade_proxy"];
    assert_eq!(last["request_id"], "r-4", "{:?}", state.body);
    assert!(last.get("upstream_failure").is_none(), "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_not_there_answers_502() {
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on: bind, note it, close.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let proxy = ProxyProcess::embedded(dir.path(), &gone, &[]);
    let store = proxy.store();
    let t = token_of(&store.acquire("twin/part-4", "w", 60_000).await).to_string();
    let r = put(&proxy.url, "part-4", "", Some(&t), None, &json!({})).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(r.body["error"], "upstream_unreachable");
    let r = put(&proxy.url, "part-4", "", Some(&t), None, &json!({})).await;
    assert_eq!(r.status, 502, "the twin was released: {:?}", r.body);
    assert_eq!(
        metric(
            &proxy.url,
            "palisade_proxy_upstream_failed_total{kind=\"connect\"}"
        )
        .await,
        2
    );
}
