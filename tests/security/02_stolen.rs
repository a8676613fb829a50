//! A lease is bound to the principal that took it: another principal with
//! the same rights who learns its lease id or its (current) token is
//! refused, and the holder name comes from the principal, not the body.

use reqwest::Method;
use serde_json::json;

use crate::{assert_error, start, token_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stolen_lease_id_or_token_is_refused_and_changes_nothing() {
    let s = start("").await;

    // worker-a claims to be worker-b in the body: the store does not care.
    let r = s
        .call(
            Some("worker-a"),
            Method::POST,
            "/v1/leases",
            Some(&json!({"scope": "twin/device-7", "holder": "worker-b", "ttl_ms": 600_000})),
            &[],
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["holder"], "worker-a", "holder from the principal");
    let ta = token_of(&r.body);
    let id = r.body["lease_id"].as_str().unwrap().to_owned();
    // With authentication on, the holder may be left out of the body.
    let r = s
        .call(
            Some("worker-a"),
            Method::POST,
            "/v1/leases",
            Some(&json!({"scope": "twin/device-70", "ttl_ms": 600_000})),
            &[],
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["holder"], "worker-a");

    assert_eq!(
        s.put("worker-a", "device-7", ta, json!({"v": 1}))
            .await
            .status,
        201
    );
    let before = s.snapshot(&["device-7"]).await;

    // worker-b has lease and write rights on twin/device-* too, and knows
    // worker-a's lease id and current token.
    let r = s
        .call(
            Some("worker-b"),
            Method::POST,
            &format!("/v1/leases/{id}/renew"),
            Some(&json!({})),
            &[],
        )
        .await;
    assert_error(&r, 403, "lease_not_yours");
    let r = s
        .call(
            Some("worker-b"),
            Method::DELETE,
            &format!("/v1/leases/{id}"),
            None,
            &[],
        )
        .await;
    assert_error(&r, 403, "lease_not_yours");
    let r = s.put("worker-b", "device-7", ta, json!({"v": 666})).await;
    assert_error(&r, 403, "token_not_yours");
    assert_eq!(r.body["token"], ta);
    // A batch, an If-Match, a retry: all the same.
    let r = s
        .append(
            "worker-b",
            "device-7",
            ta,
            &json!([{"type": "u", "patch": {"v": 7}}, {"type": "u", "patch": {"w": 7}}]),
        )
        .await;
    assert_error(&r, 403, "token_not_yours");
    // The lease is still worker-a's and live: worker-b cannot take the scope.
    let r = s.acquire("worker-b", "twin/device-7").await;
    assert_error(&r, 409, "lease_held");
    assert_eq!(r.body["holder"], "worker-a");
    assert_eq!(
        s.snapshot(&["device-7"]).await,
        before,
        "refusals changed the store"
    );

    // worker-a itself still can.
    let r = s
        .call(
            Some("worker-a"),
            Method::POST,
            &format!("/v1/leases/{id}/renew"),
            Some(&json!({})),
            &[],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        s.put("worker-a", "device-7", ta, json!({"v": 2}))
            .await
            .status,
        201
    );
    let r = s
        .call(
            Some("worker-a"),
            Method::DELETE,
            &format!("/v1/leases/{id}"),
            None,
            &[],
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);

    // worker-b takes over; worker-a's old token is now stale (the fence),
    // and worker-a cannot use worker-b's new token either.
    let tb = token_of(&s.acquire("worker-b", "twin/device-7").await.body);
    assert!(tb > ta);
    assert_error(
        &s.put("worker-a", "device-7", ta, json!({"v": 3})).await,
        409,
        "stale_token",
    );
    assert_error(
        &s.put("worker-a", "device-7", tb, json!({"v": 3})).await,
        403,
        "token_not_yours",
    );
    assert_eq!(
        s.put("worker-b", "device-7", tb, json!({"v": 4}))
            .await
            .status,
        201
    );
    let state = s.get("reader", "/v1/twins/device-7").await.body;
    assert_eq!(state["state"]["v"], 4, "{state}");
    let writers: Vec<String> = s.get("reader", "/v1/twins/device-7/events").await.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["writer"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(writers, ["worker-a", "worker-a", "worker-b"]);
    s.stop().await;
}

/// Tokens granted while authentication was off belong to nobody: once it is
/// on, every principal is refused with them (take a new lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_from_before_authentication_belong_to_nobody() {
    let s = start("").await;
    // A grant made directly on the store, as with authentication off.
    let lease = s
        .store
        .acquire(palisade::lease::AcquireRequest {
            scope: "twin/device-5".parse().unwrap(),
            holder: "worker-a".into(),
            ttl_ms: 600_000,
            purpose: Default::default(),
        })
        .await
        .unwrap();
    let r = s
        .put("worker-a", "device-5", lease.token.0, json!({"v": 1}))
        .await;
    assert_error(&r, 403, "token_not_yours");
    // Its lease id too, even for the principal named as its holder.
    let r = s
        .call(
            Some("worker-a"),
            Method::POST,
            &format!("/v1/leases/{}/renew", lease.id),
            Some(&json!({})),
            &[],
        )
        .await;
    assert_error(&r, 403, "lease_not_yours");
    // And an id nobody was ever granted.
    let r = s
        .call(
            Some("worker-a"),
            Method::DELETE,
            "/v1/leases/0123456789abcdef0123456789abcdef",
            None,
            &[],
        )
        .await;
    assert_error(&r, 403, "lease_not_yours");
    s.stop().await;
}
