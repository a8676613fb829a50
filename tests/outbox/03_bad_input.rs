//! Bad effects are refused with `400 bad_effects` and nothing is stored:
//! no event, no twin, no outbox entry.

use serde_json::{json, Value};

use crate::support::{token_of, ServeProcess};
use crate::{hook, outbox, Receiver};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_effects_are_refused_and_change_nothing() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let c = server.client();
    let t = token_of(&c.acquire("twin/gauge-1", "w", 60_000).await);
    let ok = format!("{}/ok/x", rx.url);
    let ev = |effects: Value| json!({"type": "t", "patch": {"a": 1}, "effects": effects});
    let too_many = Value::Array(vec![hook(&ok, json!(1)); 17]);
    let long_url = format!("http://h/{}", "a".repeat(2100));
    let cases = [
        ("not an array", ev(json!({"kind": "webhook"}))),
        ("a string", ev(json!("http://h/"))),
        ("too many", ev(too_many)),
        ("ftp url", ev(json!([hook("ftp://h/x", json!(1))]))),
        ("no scheme", ev(json!([hook("h/x", json!(1))]))),
        ("no host", ev(json!([hook("http:///x", json!(1))]))),
        ("long url", ev(json!([hook(&long_url, json!(1))]))),
        (
            "unknown kind",
            ev(json!([{"kind": "kafka", "url": ok, "body": 1}])),
        ),
        ("no body", ev(json!([{"kind": "webhook", "url": ok}]))),
        (
            "reserved header",
            ev(json!([{"kind": "webhook", "url": ok, "body": 1,
            "headers": {"Idempotency-Key": "mine"}}])),
        ),
        // One bad event in a batch refuses the whole batch.
        (
            "half-bad batch",
            json!([
                {"type": "t", "patch": {"a": 1}, "effects": [hook(&ok, json!(1))]},
                {"type": "t", "patch": {"a": 2}, "effects": [hook("gopher://h", json!(1))]},
            ]),
        ),
    ];
    for (what, body) in cases {
        let r = c.append("gauge-1", t, &body).await;
        assert_eq!(r.status, 400, "{what}: {:?}", r.body);
        assert_eq!(r.body["error"], "bad_effects", "{what}: {:?}", r.body);
        let msg = r.body["message"].as_str().unwrap();
        assert!(msg.len() < 300 && !msg.contains("struct"), "{what}: {msg}");
    }
    // Nothing was stored.
    assert_eq!(c.twin("gauge-1").await.status, 404);
    assert!(outbox(&c, "").await.is_empty());
    let parts = c.get("/v1/partitions").await;
    let heads: Vec<u64> = parts.body["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["head"].as_u64().unwrap())
        .collect();
    assert!(heads.iter().all(|h| *h == 0), "{heads:?}");
    assert!(rx.seen().is_empty());
    // The store still takes a good one.
    let r = c
        .append("gauge-1", t, &ev(json!([hook(&ok, json!(1))])))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    server.terminate();
}
