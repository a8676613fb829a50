//! Failed deliveries are retried with the same idempotency key until the
//! receiver accepts, or go to the dead list with the error after the
//! configured number of tries; either way the partition goes on.

use serde_json::json;

use crate::support::{token_of, ServeProcess};
use crate::{hook, outbox, settled, Receiver, FAST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_then_delivered_or_dead_after_n_tries() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // FAST: 3 tries at most.
    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    let t = token_of(&c.acquire("twin/valve-1", "w", 60_000).await);
    let flaky = format!("{}/flaky/2/x", rx.url);
    let down = format!("{}/down/x", rx.url);
    let ok = format!("{}/ok/after", rx.url);
    let batch = json!([
        {"type": "t", "patch": {}, "event_id": "f", "effects": [hook(&flaky, json!(1))]},
        {"type": "t", "patch": {}, "event_id": "d", "effects": [hook(&down, json!(2))]},
        {"type": "t", "patch": {}, "event_id": "k", "effects": [hook(&ok, json!(3))]},
    ]);
    let r = c.append("valve-1", t, &batch).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = settled(&c, 3).await;
    let seen = rx.seen();
    let keys: Vec<&str> = seen.iter().map(|s| s.key.as_str()).collect();
    // Two failures then the delivery; three failures; then the next one.
    assert_eq!(
        keys,
        ["f:0", "f:0", "f:0", "d:0", "d:0", "d:0", "k:0"],
        "{seen:#?}"
    );
    assert!(seen.iter().all(|s| s.token == t.to_string()));
    assert_eq!(all[0]["state"], "delivered");
    assert_eq!(all[0]["attempts"], 3);
    assert_eq!(all[0]["last_error"], serde_json::Value::Null);
    assert_eq!(all[1]["state"], "dead");
    assert_eq!(all[1]["attempts"], 3);
    let err = all[1]["last_error"].as_str().unwrap();
    assert!(err.contains("500"), "{err}");
    assert_eq!(all[2]["state"], "delivered");
    let dead = outbox(&c, "&state=dead").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["idempotency_key"], "d:0");
    // The counters say the same: 3 recorded, 2 delivered, 5 failed tries
    // (2 + 3), 1 dead.
    let text = c
        .http
        .get(format!("{}/metrics", c.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let metric = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .map(|v| v.parse::<f64>().unwrap())
    };
    assert_eq!(
        metric("palisade_outbox_recorded_total"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(metric("palisade_outbox_delivered_total"), Some(2.0));
    assert_eq!(metric("palisade_outbox_failed_total"), Some(5.0));
    assert_eq!(metric("palisade_outbox_dead_total"), Some(1.0));
    assert!(metric("palisade_outbox_pending").is_some());
    server.terminate();
}
