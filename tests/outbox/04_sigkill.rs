//! SIGKILL the store while a delivery is in flight, restart it: every
//! effect is delivered at least once, none is lost, a repeat carries the
//! same idempotency key, and a confirmed delivery is not repeated.

use std::collections::HashMap;

use serde_json::json;

use crate::support::{token_of, ServeProcess};
use crate::{hook, settled, Receiver, FAST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_delivery_loses_nothing_and_repeats_only_the_unconfirmed() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    let t = token_of(&c.acquire("twin/motor-1", "w", 60_000).await);
    // The receiver answers the first two, then holds the third.
    let url = format!("{}/hold/2/x", rx.url);
    let events: Vec<_> = (1..=5)
        .map(|i| {
            json!({"type": "t", "patch": {"i": i}, "event_id": format!("m{i}"),
                "effects": [hook(&url, json!({"i": i}))]})
        })
        .collect();
    let r = c.append("motor-1", t, &json!(events)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    // m3's delivery is in flight (m1 and m2 were confirmed before it was
    // tried: a confirmation is durable before the next try).
    rx.wait_for("m3 in flight", |s| s.iter().any(|x| x.key == "m3:0"))
        .await;
    server.kill();
    rx.release();

    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    let all = settled(&c, 5).await;
    assert!(all.iter().all(|e| e["state"] == "delivered"), "{all:#?}");
    let seen = rx.seen();
    let mut count: HashMap<String, usize> = HashMap::new();
    for s in &seen {
        *count.entry(s.key.clone()).or_default() += 1;
        assert_eq!(s.token, t.to_string());
    }
    // None lost.
    for i in 1..=5 {
        assert!(
            count.contains_key(&format!("m{i}:0")),
            "m{i} lost: {seen:#?}"
        );
    }
    // Confirmed before the crash: exactly once.
    assert_eq!(count["m1:0"], 1, "{seen:#?}");
    assert_eq!(count["m2:0"], 1, "{seen:#?}");
    // In flight at the crash: repeated, under the same key.
    assert_eq!(count["m3:0"], 2, "{seen:#?}");
    assert_eq!(count["m4:0"], 1);
    assert_eq!(count["m5:0"], 1);
    // Nothing else arrived (every request carried one of the five keys).
    assert_eq!(seen.len(), 6);
    // Still in order: the first try of each key in seq order.
    let mut first: Vec<&str> = Vec::new();
    for s in &seen {
        if !first.contains(&s.key.as_str()) {
            first.push(&s.key);
        }
    }
    assert_eq!(first, ["m1:0", "m2:0", "m3:0", "m4:0", "m5:0"]);
    server.terminate();
}
