//! TTL advice from measured tails (reference article's checklist; decision
//! 0026): `GET /v1/leases/advice` reports the renewal gaps the store saw on
//! a scope, recommends `3 * (pause tail + answer tail)`, flags a live lease
//! whose TTL is below it, counts a renewal that came too late, and refuses
//! bad queries.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::lease_id_of;
use crate::{assert_error, start_clocked};

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_gaps_give_a_recommended_ttl_and_flag_a_short_lease() {
    let (_dir, server, c, clock) = start_clocked().await;
    let id = lease_id_of(&c.acquire("twin/adv-1", "worker-a", 2_000).await);

    // Too few gaps: measured, but no recommendation yet.
    for _ in 0..5 {
        clock.advance(Duration::from_millis(600));
        let r = c
            .post_json(&format!("/v1/leases/{id}/renew"), &json!({}))
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let r = c.get("/v1/leases/advice?scope=twin/adv-1").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["gaps"], 5);
    assert_eq!(r.body["recommended_ttl_ms"], Value::Null, "{:?}", r.body);
    assert_eq!(r.body["current"]["ttl_below_tail"], false);

    // 25 more renewals every 600 ms, one of them 1300 ms late (a pause
    // that nearly lost the 2 s lease).
    for i in 0..25 {
        let gap = if i == 12 { 1_900 } else { 600 };
        clock.advance(Duration::from_millis(gap));
        let r = c
            .post_json(&format!("/v1/leases/{id}/renew"), &json!({}))
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let r = c.get("/v1/leases/advice?scope=twin/adv-1").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let a = &r.body;
    assert_eq!(a["scope"], "twin/adv-1");
    assert_eq!(a["gaps"], 30);
    assert_eq!(f(&a["renewal_gap"]["p50_ms"]), 600.0);
    assert_eq!(f(&a["renewal_gap"]["tail_ms"]), 1_900.0);
    assert_eq!(f(&a["pause_tail_ms"]), 1_300.0);
    let answer_tail = f(&a["answer_latency"]["tail_ms"]);
    assert!(
        answer_tail > 0.0,
        "the store's answer time was not measured: {a:?}"
    );
    let want = (3.0 * (1_300.0 + answer_tail) / 100.0).ceil() as u64 * 100;
    assert_eq!(a["tail_ttl_ms"], want, "{a:?}");
    assert_eq!(a["recommended_ttl_ms"], want.max(1_000), "{a:?}");
    assert_eq!(a["recommended_renew_every_ms"], want.max(1_000) / 3);
    assert_eq!(a["current"]["holder"], "worker-a");
    assert_eq!(a["current"]["ttl_ms"], 2_000);
    assert_eq!(a["current"]["ttl_below_tail"], true, "{a:?}");
    assert_eq!(a["late_renewals"], 0);

    // The renewals past the 20th gap were each below the advice.
    let metrics = c.metrics_text().await;
    let below = metrics
        .lines()
        .find_map(|l| l.strip_prefix("palisade_lease_ttl_below_advice_total "))
        .unwrap_or_else(|| panic!("no ttl-below-advice counter in /metrics"));
    assert!(below.parse::<u64>().unwrap() >= 10, "{below}");
    assert!(
        metrics.contains("palisade_lease_renewal_gap_seconds_count 30"),
        "renewal gaps not in /metrics"
    );

    // The holder pauses past its TTL: the late renewal is refused and counted,
    // with the gap that lost the lease.
    clock.advance(Duration::from_millis(2_500));
    let r = c
        .post_json(&format!("/v1/leases/{id}/renew"), &json!({}))
        .await;
    assert_error(&r, 410, "lease_expired");
    let r = c
        .get("/v1/leases/advice?scope=twin/adv-1&holder=worker-a")
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["holder"], "worker-a");
    assert_eq!(r.body["late_renewals"], 1, "{:?}", r.body);
    assert_eq!(r.body["gaps"], 31);
    assert_eq!(f(&r.body["renewal_gap"]["max_ms"]), 2_500.0);
    assert!(
        r.body.get("current").is_none(),
        "no live lease: {:?}",
        r.body
    );

    // Another holder's samples, and another scope's, are kept apart.
    let r = c
        .get("/v1/leases/advice?scope=twin/adv-1&holder=worker-b")
        .await;
    assert_eq!(r.body["gaps"], 0, "{:?}", r.body);
    let r = c.get("/v1/leases/advice?scope=twin/other").await;
    assert_eq!(r.body["gaps"], 0, "{:?}", r.body);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_advice_query_is_refused() {
    let (_dir, server, c, _clock) = start_clocked().await;
    assert_error(&c.get("/v1/leases/advice").await, 400, "bad_query");
    assert_error(
        &c.get("/v1/leases/advice?scope=nope").await,
        400,
        "bad_scope",
    );
    assert_error(
        &c.get("/v1/leases/advice?scope=twin/a&extra=1").await,
        400,
        "bad_query",
    );
    server.stop().await;
}
