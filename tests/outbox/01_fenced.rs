//! Effects exist only for admitted events, are delivered once each, in
//! order per twin, with the documented headers; a stale writer's effects
//! appear nowhere.

use serde_json::json;

use crate::support::{lease_id_of, token_of, ServeProcess};
use crate::{hook, outbox, settled, Receiver, FAST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_effects_are_delivered_once_in_order_and_a_stale_writers_never_exist() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    let ok = format!("{}/ok/pump", rx.url);

    // Writer A: a batch of three events, the second with two effects.
    let a = c.acquire("twin/pump-1", "worker-a", 60_000).await;
    let ta = token_of(&a);
    let batch = json!([
        {"type": "t", "patch": {"n": 1}, "event_id": "a1",
         "effects": [hook(&ok, json!({"n": 1}))]},
        {"type": "t", "patch": {"n": 2}, "event_id": "a2",
         "effects": [hook(&ok, json!({"n": 2})), {"kind": "webhook", "url": ok,
            "body": {"n": 2, "second": true}, "headers": {"X-Tenant": "t-7"}}]},
        {"type": "t", "patch": {"n": 3}, "event_id": "a3"},
    ]);
    let r = c.append("pump-1", ta, &batch).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    // A retry of a1 is a duplicate: its effect is not recorded twice.
    let retry = json!({"type": "t", "patch": {"n": 1}, "event_id": "a1",
        "effects": [hook(&ok, json!({"n": 1}))]});
    let r = c.append("pump-1", ta, &retry).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body["duplicates"], 1);

    // A goes away; B takes the twin over, which fences A's token off.
    let r = c.delete(&format!("/v1/leases/{}", lease_id_of(&a))).await;
    assert_eq!(r.status, 204, "{:?}", r.body);
    let b = c.acquire("twin/pump-1", "worker-b", 60_000).await;
    let tb = token_of(&b);
    assert!(tb > ta);
    let r = c
        .append(
            "pump-1",
            tb,
            &json!({"type": "t", "patch": {"n": 4}, "event_id": "b1",
            "effects": [hook(&ok, json!({"n": 4}))]}),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    // A, paused, comes back with its old token: refused, effect and all.
    let stale_url = format!("{}/ok/stale", rx.url);
    let r = c
        .append(
            "pump-1",
            ta,
            &json!({"type": "t", "patch": {"n": 99}, "event_id": "stale-1",
            "effects": [hook(&stale_url, json!({"stale": true}))]}),
        )
        .await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["error"], "stale_token");
    // The refusal is answered once its round is durable: had the round
    // recorded the effects, they would be listed now.
    let now = outbox(&c, "").await;
    assert!(
        now.iter().all(|e| e["event_id"] != "stale-1"),
        "a refused append's effects were recorded: {now:#?}"
    );

    // B's last event: delivered after anything recorded before it (one
    // partition dispatches in order), so once it arrived a stale effect,
    // had it been recorded, would have arrived too.
    let r = c
        .append(
            "pump-1",
            tb,
            &json!({"type": "t", "patch": {"n": 5}, "event_id": "b2",
            "effects": [hook(&ok, json!({"n": 5, "last": true}))]}),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    let seen = rx
        .wait_for("saw b2's effect", |s| s.iter().any(|x| x.key == "b2:0"))
        .await;
    let all = settled(&c, 5).await;

    // Every effect of an admitted event once, in order, with its headers.
    let keys: Vec<&str> = seen.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["a1:0", "a2:0", "a2:1", "b1:0", "b2:0"], "{seen:#?}");
    let tokens: Vec<String> = seen.iter().map(|s| s.token.clone()).collect();
    let (ta_s, tb_s) = (ta.to_string(), tb.to_string());
    assert_eq!(
        tokens,
        [&ta_s, &ta_s, &ta_s, &tb_s, &tb_s].map(String::clone)
    );
    assert_eq!(seen[0].body, json!({"n": 1}));
    assert_eq!(seen[2].body, json!({"n": 2, "second": true}));
    assert_eq!(seen[2].headers["x-tenant"], "t-7");
    assert_eq!(seen[0].headers["content-type"], "application/json");
    assert!(seen.iter().all(|s| s.path == "/ok/pump"));

    // The stale writer's effect is nowhere: not at the receiver, not in
    // the outbox (any state), not as an event.
    assert!(seen.iter().all(|s| !s.key.starts_with("stale")));
    assert!(all.iter().all(|e| e["event_id"] != "stale-1"));
    for e in &all {
        assert_eq!(e["state"], "delivered", "{e}");
        assert_eq!(e["attempts"], 1, "{e}");
        assert_eq!(e["twin_id"], "pump-1");
    }
    let idem: Vec<&str> = all
        .iter()
        .map(|e| e["idempotency_key"].as_str().unwrap())
        .collect();
    assert_eq!(idem, ["a1:0", "a2:0", "a2:1", "b1:0", "b2:0"]);
    // Each effect's seq is its event's.
    let twin = c.get("/v1/twins/pump-1/events").await;
    let seq_of = |id: &str| {
        twin.body["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["event_id"] == id)
            .map(|e| e["seq"].clone())
            .unwrap()
    };
    assert_eq!(all[0]["seq"], seq_of("a1"));
    assert_eq!(all[3]["seq"], seq_of("b1"));
    assert_eq!(outbox(&c, "&state=pending").await.len(), 0);
    assert_eq!(outbox(&c, "&state=delivered").await.len(), 5);
    assert_eq!(outbox(&c, "&state=dead").await.len(), 0);
    let r = c.get("/v1/outbox?state=lost").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.body["error"], "bad_query");
    server.terminate();
}
