//! Every limit triggers its own clear error, and a refused request changes
//! nothing the store shows.

use palisade::http::HttpConfig;
use reqwest::Method;
use serde_json::{json, Value};

use crate::{assert_error, start, start_open, start_with, token_of};

const LIMITS: &str = r#"
[limits]
max_twin_id_bytes = 16
max_patch_depth = 4
max_patch_bytes = 64
max_leases_per_principal = 2
"#;

fn nested(levels: usize) -> Value {
    // `levels` object levels counting the patch itself.
    let mut v = json!(1);
    for _ in 0..levels {
        v = json!({ "a": v });
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_limit_refuses_with_its_error_and_changes_nothing() {
    let s = start_with(
        LIMITS,
        HttpConfig {
            max_body_bytes: 4096,
            max_batch_events: 3,
            ..HttpConfig::default()
        },
    )
    .await;
    let t = token_of(&s.acquire("worker-a", "twin/device-1").await.body);
    assert_eq!(
        s.put("worker-a", "device-1", t, json!({"v": 1}))
            .await
            .status,
        201
    );
    let long = "device-123456789"; // 16 bytes: at the limit
    let t_long = token_of(&s.acquire("worker-b", &format!("twin/{long}")).await.body);
    let before = s.snapshot(&["device-1", long]).await;

    // Body size (HTTP layer): an append and a lease request.
    let big = json!({"type": "u", "patch": {"s": "x".repeat(5000)}});
    assert_error(
        &s.append("worker-a", "device-1", t, &big).await,
        413,
        "body_too_large",
    );
    let r = s
        .call(
            Some("worker-a"),
            Method::POST,
            "/v1/leases",
            Some(&json!({"scope": "twin/device-2", "ttl_ms": 1000, "pad": "x".repeat(5000)})),
            &[],
        )
        .await;
    assert_error(&r, 413, "body_too_large");

    // Batch size.
    let ev = |i: u32| json!({"type": "u", "patch": {"i": i}});
    let r = s
        .append(
            "worker-a",
            "device-1",
            t,
            &json!([ev(1), ev(2), ev(3), ev(4)]),
        )
        .await;
    assert_error(&r, 413, "batch_too_large");

    // Twin id length: 17 bytes, for a write, a read and a lease.
    let longer = "device-1234567890";
    assert_error(
        &s.put("worker-a", longer, t, json!({"v": 1})).await,
        400,
        "twin_id_too_long",
    );
    assert_error(
        &s.get("worker-a", &format!("/v1/twins/{longer}")).await,
        400,
        "twin_id_too_long",
    );
    assert_error(
        &s.acquire("worker-a", &format!("twin/{longer}")).await,
        400,
        "twin_id_too_long",
    );

    // Patch depth: 5 levels where 4 are allowed (4 pass).
    assert_error(
        &s.put("worker-a", "device-1", t, nested(5)).await,
        400,
        "bad_patch",
    );
    // Patch size: 65+ bytes of JSON where 64 are allowed, also inside a batch.
    let fat = json!({"s": "y".repeat(60)});
    assert_error(
        &s.put("worker-a", "device-1", t, fat.clone()).await,
        413,
        "patch_too_large",
    );
    let r = s
        .append(
            "worker-a",
            "device-1",
            t,
            &json!([ev(9), {"type": "u", "patch": fat}]),
        )
        .await;
    assert_error(&r, 413, "patch_too_large");

    // Live leases per principal: worker-a holds one, takes a second, and is
    // refused a third; no token is drawn for the refusal.
    s.acquire("worker-a", "twin/device-2").await;
    let mid = s.snapshot(&["device-1", long]).await;
    let r = s.acquire("worker-a", "twin/device-3").await;
    assert_error(&r, 429, "too_many_leases");
    assert_eq!(
        (r.body["held"].as_u64(), r.body["max"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(r.headers.get("retry-after").is_none());
    assert_eq!(
        s.snapshot(&["device-1", long]).await,
        mid,
        "a refused lease changed the store"
    );
    // Another principal is not limited by worker-a's leases.
    assert_eq!(s.acquire("worker-b", "twin/device-4").await.status, 201);

    // Issue 18: at the limit, worker-a may still re-acquire a scope it
    // holds: that replaces its lease (new token, old one superseded) and
    // adds no live lease, so the limit does not refuse it...
    let old = s.acquire("worker-a", "twin/device-2").await;
    assert_eq!(old.status, 201, "{}", old.text);
    let again = s.acquire("worker-a", "twin/device-2").await;
    assert_eq!(again.status, 201, "re-acquire at the limit: {}", again.text);
    assert!(token_of(&again.body) > token_of(&old.body));
    // ...and it still holds two: a new scope is still refused.
    let r = s.acquire("worker-a", "twin/device-3").await;
    assert_error(&r, 429, "too_many_leases");
    assert_eq!(r.body["held"].as_u64(), Some(2));

    // Within every limit, the same requests pass.
    assert_eq!(
        s.put("worker-a", "device-1", t, nested(4)).await.status,
        201
    );
    assert_eq!(
        s.put("worker-b", long, t_long, json!({"s": "y".repeat(50)}))
            .await
            .status,
        201
    );
    let after = s.snapshot(&["device-1", long]).await;
    assert_ne!(after, before);
    // ... and only they were appended: 1 + 1 events on device-1.
    let n = s.get("reader", "/v1/twins/device-1/events").await.body["events"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(n, 2);
    let _ = before;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_principal_are_rate_limited_with_retry_after() {
    // One request per 1000 s after a burst of 4: no refill during the test.
    let s = start("[limits]\nrequests_per_second = 0.001\nburst = 4\n").await;
    let t = token_of(&s.acquire("worker-a", "twin/device-1").await.body); // 1
    assert_eq!(
        s.put("worker-a", "device-1", t, json!({"v": 1}))
            .await
            .status,
        201
    ); // 2
       // reader has a bucket of its own (two requests in this test).
    let before = s.get("reader", "/v1/twins/device-1/events").await.body;
    assert_eq!(s.get("worker-a", "/v1/twins/device-1").await.status, 200); // 3
    assert_eq!(s.get("worker-a", "/v1/twins/device-1").await.status, 200); // 4
    let r = s.put("worker-a", "device-1", t, json!({"v": 2})).await;
    assert_error(&r, 429, "rate_limited");
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=1000).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.body["retry_after_s"], retry);
    assert_error(
        &s.acquire("worker-a", "twin/device-2").await,
        429,
        "rate_limited",
    );
    // Other principals have their own budget; the refused write changed nothing.
    assert_eq!(
        s.get("reader", "/v1/twins/device-1/events").await.body,
        before
    );
    assert_eq!(s.acquire("worker-b", "twin/device-2").await.status, 201);
    // Requests without a valid key share one budget: 4 refusals with 401
    // (audited), then 429 (not audited).
    async fn audited(s: &crate::Secure) -> usize {
        s.store.audit().list(0, 10_000).await.unwrap().len()
    }
    for _ in 0..4 {
        let r = s
            .call(Some("!bad"), Method::GET, "/v1/twins/device-1", None, &[])
            .await;
        assert_error(&r, 401, "unauthenticated");
    }
    let n = audited(&s).await;
    let r = s
        .call(None, Method::GET, "/v1/twins/device-1", None, &[])
        .await;
    assert_error(&r, 429, "rate_limited");
    assert!(r.headers.get("retry-after").is_some());
    assert_eq!(
        audited(&s).await,
        n,
        "a rate-limited unauthenticated request was audited"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_apply_with_authentication_off_too() {
    let s = start_open(LIMITS).await;
    let r = s
        .call(
            None,
            Method::POST,
            "/v1/leases",
            Some(&json!({"scope": "twin/device-1", "holder": "w", "ttl_ms": 60_000})),
            &[],
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(
        r.body["holder"], "w",
        "with auth off the holder comes from the body"
    );
    let t = token_of(&r.body);
    let put = |patch: Value| {
        let t = t.to_string();
        let s = &s;
        async move {
            s.call(
                None,
                Method::POST,
                "/v1/twins/device-1/events",
                Some(&json!({"type": "u", "patch": patch})),
                &[("fencing-token", t.as_str())],
            )
            .await
        }
    };
    assert_eq!(put(json!({"v": 1})).await.status, 201);
    let before = s.snapshot(&["device-1"]).await;
    assert_error(&put(nested(5)).await, 400, "bad_patch");
    assert_error(
        &put(json!({"s": "z".repeat(80)})).await,
        413,
        "patch_too_large",
    );
    assert_eq!(s.snapshot(&["device-1"]).await, before);
    s.stop().await;
}
