//! Leases over HTTP: grant, conflict, renew by id, the renewal race
//! (reference article, scenario 6), release, and refused requests.

use std::time::Duration;

use serde_json::json;

use crate::support::{lease_id_of, token_of};
use crate::{assert_error, start, start_clocked};

/// Just past a 200 ms TTL (on the store's lease clock, moved by the test).
const PAST_TTL: Duration = Duration::from_millis(260);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_conflict_and_renew_keep_the_token() {
    let (_dir, server, c) = start().await;

    let r = c.try_acquire("twin/dev-1", "A", 60_000).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let a = r.body;
    let id = lease_id_of(&a);
    assert_eq!(id.len(), 32, "{id}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    assert_eq!(a["scope"], "twin/dev-1");
    assert_eq!(a["holder"], "A");
    assert_eq!(a["ttl_ms"], 60_000);
    let ta = token_of(&a);
    assert!(ta > 0);

    // A second holder is refused while A's lease is live, and told who holds it.
    let r = c.try_acquire("twin/dev-1", "B", 60_000).await;
    assert_error(&r, 409, "lease_held");
    assert_eq!(r.body["holder"], "A");
    let left = r.body["expires_in_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 60_000, "expires_in_ms {left}");

    // Tokens come from one counter: strictly increasing across scopes.
    let mut last = ta;
    for (scope, holder) in [
        ("twin/dev-2", "B"),
        ("partition/3", "C"),
        ("twin/dev-3", "A"),
        ("partition/0", "B"),
    ] {
        let t = token_of(&c.acquire(scope, holder, 60_000).await);
        assert!(t > last, "token {t} after {last} ({scope})");
        last = t;
    }

    // Renewing by id keeps the lease and its token: a renewal is not a grant.
    let r = c
        .post_json(&format!("/v1/leases/{id}/renew"), &json!({}))
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["token"], ta);
    assert_eq!(r.body["lease_id"], id.as_str());
    assert_eq!(r.body["holder"], "A");
    assert_eq!(r.body["scope"], "twin/dev-1");

    // And nothing drew a token from the counter.
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.body["last_token"], last);

    server.stop().await;
}

/// Scenario 6: A's renewal arrives after its lease expired and B was granted
/// the scope. It must be refused and must not touch B's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_renewal_after_a_new_grant_is_superseded_and_leaves_b_alone() {
    let (_dir, server, c, clock) = start_clocked().await;

    let a = c.acquire("twin/s6", "A", 200).await;
    clock.advance(PAST_TTL);
    let b = c.acquire("twin/s6", "B", 300).await;
    assert!(token_of(&b) > token_of(&a));
    let (a_id, b_id) = (lease_id_of(&a), lease_id_of(&b));

    let r = c
        .post_json(&format!("/v1/leases/{a_id}/renew"), &json!({}))
        .await;
    assert_error(&r, 410, "lease_superseded");
    assert_eq!(r.body["by_token"], token_of(&b));

    // The scope is still B's.
    let r = c.try_acquire("twin/s6", "C", 1000).await;
    assert_error(&r, 409, "lease_held");
    assert_eq!(r.body["holder"], "B");
    assert_eq!(r.body["token"], token_of(&b));

    // B renews its own lease normally, same token.
    let r = c
        .post_json(&format!("/v1/leases/{b_id}/renew"), &json!({}))
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["token"], token_of(&b));
    assert_eq!(r.body["holder"], "B");

    // A keeps trying; it never gets the lease back.
    let r = c
        .post_json(&format!("/v1/leases/{a_id}/renew"), &json!({}))
        .await;
    assert_error(&r, 410, "lease_superseded");

    // A's attempts did not extend B's lease: past B's own TTL, C gets it.
    clock.advance(Duration::from_millis(360));
    let cl = c.acquire("twin/s6", "C", 1000).await;
    assert!(token_of(&cl) > token_of(&b));
    let r = c
        .post_json(&format!("/v1/leases/{b_id}/renew"), &json!({}))
        .await;
    assert_error(&r, 410, "lease_superseded");

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_after_expiry_is_refused_even_if_nobody_took_the_scope() {
    let (_dir, server, c, clock) = start_clocked().await;

    let a = c.acquire("twin/exp", "A", 200).await;
    clock.advance(PAST_TTL);
    let r = c
        .post_json(&format!("/v1/leases/{}/renew", lease_id_of(&a)), &json!({}))
        .await;
    assert_error(&r, 410, "lease_expired");

    // The scope is free; the next grant gets a new, larger token.
    let b = c.acquire("twin/exp", "B", 1000).await;
    assert!(token_of(&b) > token_of(&a));

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_only_the_named_live_lease() {
    let (_dir, server, c, clock) = start_clocked().await;

    let a = c.acquire("twin/rel", "A", 200).await;
    clock.advance(PAST_TTL);
    let b = c.acquire("twin/rel", "B", 60_000).await;

    // A releases with its stale id: refused, and B's lease stays.
    let r = c.delete(&format!("/v1/leases/{}", lease_id_of(&a))).await;
    assert_error(&r, 410, "lease_superseded");
    let r = c.try_acquire("twin/rel", "C", 1000).await;
    assert_error(&r, 409, "lease_held");
    assert_eq!(r.body["holder"], "B");

    // B releases its live lease: 204, and the scope is free at once.
    let r = c.delete(&format!("/v1/leases/{}", lease_id_of(&b))).await;
    assert_eq!(r.status, 204, "{:?}", r.body);
    let cl = c.acquire("twin/rel", "C", 1000).await;
    assert!(token_of(&cl) > token_of(&b));

    // A released lease can be neither released again nor renewed.
    let r = c.delete(&format!("/v1/leases/{}", lease_id_of(&b))).await;
    assert_error(&r, 410, "lease_released");
    let r = c
        .post_json(&format!("/v1/leases/{}/renew", lease_id_of(&b)), &json!({}))
        .await;
    assert_error(&r, 410, "lease_released");
    // ...and C still holds the scope.
    let r = c.try_acquire("twin/rel", "D", 1000).await;
    assert_eq!(r.body["holder"], "C");

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_malformed_lease_ids() {
    let (_dir, server, c) = start().await;
    c.acquire("twin/x", "A", 60_000).await;

    let unknown = "0123456789abcdef0123456789abcdef";
    let r = c
        .post_json(&format!("/v1/leases/{unknown}/renew"), &json!({}))
        .await;
    assert_error(&r, 404, "lease_not_found");
    let r = c.delete(&format!("/v1/leases/{unknown}")).await;
    assert_error(&r, 404, "lease_not_found");

    for bad in [
        "xyz",
        "0123456789abcdef0123456789abcde",   // 31
        "0123456789abcdef0123456789abcdef0", // 33
        "0123456789abcdef0123456789abcdeg",
        "+123456789abcdef0123456789abcdef",
    ] {
        let r = c
            .post_json(&format!("/v1/leases/{bad}/renew"), &json!({}))
            .await;
        assert_error(&r, 400, "bad_lease_id");
        let r = c.delete(&format!("/v1/leases/{bad}")).await;
        assert_error(&r, 400, "bad_lease_id");
    }
    // A's lease was not disturbed.
    let r = c.try_acquire("twin/x", "B", 1000).await;
    assert_error(&r, 409, "lease_held");

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_acquires_draw_no_token() {
    let (_dir, server, c) = start().await;
    let first = token_of(&c.acquire("twin/base", "A", 60_000).await);

    let cases: &[(&str, &str, u64, &str)] = &[
        ("partition/x", "A", 1000, "bad_scope"),
        ("partition/", "A", 1000, "bad_scope"),
        ("partition/+1", "A", 1000, "bad_scope"),
        ("lock/a", "A", 1000, "bad_scope"),
        ("twin/", "A", 1000, "bad_scope"),
        ("", "A", 1000, "bad_scope"),
        ("partition/999", "A", 1000, "unknown_partition"),
        ("partition/16", "A", 1000, "unknown_partition"),
        ("twin/t", "A", 0, "bad_ttl"),
        ("twin/t", "A", 99, "bad_ttl"),
        ("twin/t", "A", 86_400_001, "bad_ttl"),
        ("twin/t", "", 1000, "bad_holder"),
        ("twin/t", "line\nbreak", 1000, "bad_holder"),
    ];
    for (scope, holder, ttl, error) in cases {
        let r = c.try_acquire(scope, holder, *ttl).await;
        assert_error(&r, 400, error);
    }
    let r = c.get("/v1/partitions").await;
    assert_eq!(
        r.body["last_token"], first,
        "a refused acquire drew a token"
    );
    // The boundaries themselves are accepted.
    assert_eq!(c.try_acquire("partition/15", "A", 100).await.status, 201);

    server.stop().await;
}

/// What a lease is for (decision 0028): correctness unless asked, shown in
/// the lease, the partition owner, the audit log and the metrics; both
/// purposes fenced alike; anything else refused and nothing granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_carries_its_purpose_and_both_purposes_are_fenced() {
    let (_dir, server, c) = start().await;

    let a = c.acquire("twin/job-1", "A", 60_000).await;
    assert_eq!(a["purpose"], "correctness");
    let r = c
        .post_json(
            "/v1/leases",
            &json!({"scope": "partition/2", "holder": "B", "ttl_ms": 60_000, "purpose": "efficiency"}),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.body["purpose"], "efficiency");
    let eff = r.body;
    let r = c
        .post_json(
            &format!("/v1/leases/{}/renew", lease_id_of(&eff)),
            &json!({}),
        )
        .await;
    assert_eq!(r.body["purpose"], "efficiency", "{:?}", r.body);
    let parts = c.get("/v1/partitions").await;
    assert_eq!(
        parts.body["partitions"][2]["owner"]["purpose"],
        "efficiency"
    );

    // Refused, and no token drawn.
    let before = c.get("/v1/partitions").await.body["last_token"].clone();
    for bad in [json!("Efficiency"), json!("safety"), json!(1), json!(null)] {
        let r = c
            .post_json(
                "/v1/leases",
                &json!({"scope": "twin/job-2", "holder": "C", "ttl_ms": 60_000, "purpose": bad}),
            )
            .await;
        if bad.is_null() {
            // null = not given: the default.
            assert_eq!(r.status, 201, "{:?}", r.body);
            assert_eq!(r.body["purpose"], "correctness");
            c.delete(&format!("/v1/leases/{}", lease_id_of(&r.body)))
                .await;
            continue;
        }
        assert_error(&r, 400, "bad_json");
        assert!(
            r.body["message"]
                .as_str()
                .unwrap()
                .contains(r#""correctness" or "efficiency""#),
            "{:?}",
            r.body
        );
    }
    let after = c.get("/v1/partitions").await.body["last_token"].clone();
    assert_eq!(after.as_u64().unwrap(), before.as_u64().unwrap() + 1);

    // An efficiency lease's token is fenced like any other: a later grant
    // on the scope refuses it.
    let twin = crate::twin_in(2, "job");
    let w = |token: u64| {
        c.http
            .post(format!("{}/v1/twins/{twin}/events", c.base))
            .header("Fencing-Token", token.to_string())
            .json(&json!({"type": "t", "patch": {"n": token}}))
    };
    assert_eq!(crate::send(w(token_of(&eff))).await.status, 201);
    c.delete(&format!("/v1/leases/{}", lease_id_of(&eff))).await;
    let next = c.acquire("partition/2", "D", 60_000).await;
    assert_error(&crate::send(w(token_of(&eff))).await, 409, "stale_token");
    assert_eq!(crate::send(w(token_of(&next))).await.status, 201);

    // The audit log names each grant's purpose; the metrics count them.
    let audit = c.get("/v1/audit?limit=100").await;
    let grants: Vec<(&str, &str)> = audit.body["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "grant" && r["outcome"] == "ok")
        .map(|r| (r["scope"].as_str().unwrap(), r["detail"].as_str().unwrap()))
        .collect();
    assert!(
        grants.contains(&("partition/2", "efficiency")),
        "{grants:?}"
    );
    assert!(
        grants.contains(&("twin/job-1", "correctness")),
        "{grants:?}"
    );
    let metrics = c.metrics_text().await;
    assert!(
        metrics.contains("palisade_lease_grants_by_purpose_total{purpose=\"efficiency\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("palisade_lease_grants_by_purpose_total{purpose=\"correctness\"} 3"),
        "{metrics}"
    );
    server.stop().await;
}
