//! Issue 18, item 2: a lease that expired before a restart stays expired
//! after it (SIGTERM and SIGKILL), and a lease still live at the restart
//! keeps only what was left of its TTL, not a fresh one.
//!
//! Before lease deadlines were persisted, a restart gave every stored lease
//! a full TTL again: the holder whose renew had just been refused with `410
//! lease_expired` could renew it after the restart, and another holder got
//! `409 lease_held`. The fence kept writes safe; the authority contradicted
//! itself. Everything here happens well inside the 5 s sweep period, so it is
//! the stored deadline, not the sweep, that keeps the lease expired.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{lease_id_of, token_of, Client, ServeProcess};

/// TTL of the leases that expire.
const SHORT_MS: u64 = 200;
/// TTL of the lease that is still live at the restart.
const LONG_MS: u64 = 30_000;

async fn renew(c: &Client, lease: &serde_json::Value) -> crate::support::Resp {
    c.post_json(
        &format!("/v1/leases/{}/renew", lease_id_of(lease)),
        &json!({}),
    )
    .await
}

/// Take a short lease on `scope` and let it expire: the renew is refused.
async fn expire(c: &Client, scope: &str) -> serde_json::Value {
    let lease = c.acquire(scope, "A", SHORT_MS).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = renew(c, &lease).await;
    assert_eq!(r.status, 410, "renew before the restart: {:?}", r.body);
    assert_eq!(r.body["error"], "lease_expired");
    lease
}

/// After a restart: A's expired lease is still refused and B gets the scope
/// with a newer token, which fences A's writes out.
async fn still_expired(c: &Client, scope: &str, twin: &str, a: &serde_json::Value, how: &str) {
    let r = renew(c, a).await;
    assert_eq!(r.status, 410, "renew after {how}: {:?}", r.body);
    assert_eq!(r.body["error"], "lease_expired", "after {how}");
    let r = c.try_acquire(scope, "B", 60_000).await;
    assert_eq!(r.status, 201, "another holder after {how}: {:?}", r.body);
    let b = token_of(&r.body);
    assert!(b > token_of(a), "after {how}: B's token {b} <= A's");
    let r = c
        .put(twin, token_of(a), &format!("a-{how}"), json!({}))
        .await;
    assert_eq!(r.status, 409, "A's write after {how}: {:?}", r.body);
    assert_eq!(r.body["error"], "stale_token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_stay_expired_across_restarts() {
    let dir = tempfile::tempdir().unwrap();

    // SIGTERM: a clean stop.
    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    let live = c.acquire("twin/exp-live", "K", LONG_MS).await;
    let granted = Instant::now();
    let a1 = expire(&c, "twin/exp-term").await;
    proc.terminate();
    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    still_expired(&c, "twin/exp-term", "exp-term", &a1, "SIGTERM").await;

    // The live lease came back with what was left of its TTL: the time
    // since its grant (at least the 500 ms wait and the restart) is gone.
    let asked = Instant::now();
    let r = c.try_acquire("twin/exp-live", "C", 1000).await;
    assert_eq!(r.status, 409, "live lease after the restart: {:?}", r.body);
    assert_eq!(r.body["holder"], "K");
    let left = r.body["expires_in_ms"].as_u64().unwrap();
    let gone = u64::try_from(asked.duration_since(granted).as_millis()).unwrap();
    assert!(gone >= 500, "{gone}");
    assert!(
        left <= LONG_MS - gone,
        "{left} ms left of a {LONG_MS} ms lease granted {gone} ms ago: the restart renewed it"
    );
    // Its holder renews it by id as before.
    let r = renew(&c, &live).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["token"], token_of(&live));

    // SIGKILL: a crash right after the refused renew.
    let a2 = expire(&c, "twin/exp-kill").await;
    proc.kill();
    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    still_expired(&c, "twin/exp-kill", "exp-kill", &a2, "SIGKILL").await;
    proc.terminate();
}
