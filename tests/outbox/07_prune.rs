//! Retention (`--outbox-keep-delivered`): delivered entries past the newest
//! N of a partition are removed through the commit path (durably: gone
//! after a restart too); dead entries stay, with their error, whatever
//! their age; nothing is delivered again because of the removal.

use serde_json::{json, Value};

use crate::support::{token_of, ServeProcess};
use crate::{hook, outbox, Receiver, FAST};

/// Wait until the outbox holds exactly `delivered` delivered and `dead`
/// dead entries and nothing pending.
async fn pruned_to(c: &crate::support::Client, delivered: usize, dead: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let all = outbox(c, "").await;
        let n = |s: &str| all.iter().filter(|e| e["state"] == s).count();
        if n("pending") == 0 && n("delivered") == delivered && n("dead") == dead {
            return all;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never pruned to {delivered} delivered and {dead} dead: {all:#?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_entries_past_the_retention_are_pruned_and_dead_ones_kept() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut args = FAST.to_vec();
    args.extend(["--outbox-keep-delivered", "2"]);
    let server = ServeProcess::start(dir.path(), &args);
    let c = server.client();
    let t = token_of(&c.acquire("twin/pump-9", "w", 60_000).await);
    let ok = format!("{}/ok/x", rx.url);
    let down = format!("{}/down/x", rx.url);
    let ev = |id: &str, url: &str| json!({"type": "t", "patch": {}, "event_id": id, "effects": [hook(url, json!(id))]});
    let batch = json!([
        ev("e1", &ok),
        ev("e2", &ok),
        ev("d1", &down),
        ev("e3", &ok),
        ev("e4", &ok),
        ev("e5", &ok),
    ]);
    let r = c.append("pump-9", t, &batch).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = pruned_to(&c, 2, 1).await;
    let ids: Vec<&str> = all
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    // The newest two delivered, and the dead one (older than both).
    assert_eq!(ids, ["d1", "e4", "e5"], "{all:#?}");
    assert_eq!(all[0]["state"], "dead");
    assert!(all[0]["last_error"].as_str().unwrap().contains("500"));
    // Every effect reached the receiver once (the dead one 3 times).
    let keys: Vec<String> = rx.seen().iter().map(|s| s.key.clone()).collect();
    for k in ["e1:0", "e2:0", "e3:0", "e4:0", "e5:0"] {
        assert_eq!(keys.iter().filter(|x| *x == k).count(), 1, "{keys:?}");
    }
    assert_eq!(keys.iter().filter(|x| *x == "d1:0").count(), 3, "{keys:?}");
    let metrics = c.metrics_text().await;
    assert!(
        metrics.contains("palisade_outbox_pruned_total 3"),
        "{metrics}"
    );
    server.terminate();

    // Durable: the removal survives a restart, and nothing is sent again.
    let seen_before = rx.seen().len();
    let server = ServeProcess::start(dir.path(), &args);
    let c = server.client();
    let again = pruned_to(&c, 2, 1).await;
    assert_eq!(again, all);
    // One more delivery prunes the oldest kept one.
    let r = c.append("pump-9", t, &json!([ev("e6", &ok)])).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = pruned_to(&c, 2, 1).await;
    let ids: Vec<&str> = all
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["d1", "e5", "e6"], "{all:#?}");
    assert_eq!(rx.seen().len(), seen_before + 1);
    server.terminate();
}
