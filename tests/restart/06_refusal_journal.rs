//! Issue 14 (section 3): refused writes are kept in the durable refusal
//! journal. Before it, refusals lived only in an in-memory ring
//! (`/v1/rejections`), so a crash erased what a paused worker had tried to
//! write. Here a real `palisade serve` answers three refused writes (two
//! stale, one with a token never issued), is killed with SIGKILL, and after
//! the restart `GET /v1/twins/{id}/refusals` and
//! `GET /v1/partitions/{p}/refusals` still list them, newest first, with
//! token, fence, holder, reason, event ids and payload digest. The journal
//! entry of a refusal is durable before the refusal is answered, so the
//! kill may come right after the last answer. Its cap is a `palisade serve`
//! setting (`--refusals-per-partition`).

use std::time::Duration;

use palisade::core::{partition_for, TwinId};
use serde_json::json;

use crate::support::{token_of, ServeProcess};

const TWIN: &str = "refused-pump";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(dir.path(), &[]);
    let c = serve.client();
    let a = c.acquire(&format!("twin/{TWIN}"), "worker-a", 200).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = c.acquire(&format!("twin/{TWIN}"), "worker-b", 60_000).await;
    for id in ["late-1", "late-2"] {
        let r = c.put(TWIN, token_of(&a), id, json!({"rpm": 1})).await;
        assert_eq!(r.status, 409, "{:?}", r.body);
        assert_eq!(r.body["error"], "stale_token");
    }
    let r = c.put(TWIN, 987_654, "forged", json!({})).await;
    assert_eq!(r.body["error"], "token_not_issued", "{:?}", r.body);
    serve.kill();

    let serve = ServeProcess::start(dir.path(), &[]);
    let c = serve.client();
    let r = c.get(&format!("/v1/twins/{TWIN}/refusals")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let list = r.body["refusals"].as_array().unwrap();
    let ids: Vec<&str> = list
        .iter()
        .map(|e| e["event_ids"][0].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["forged", "late-2", "late-1"], "{list:?}");
    assert_eq!(list[0]["reason"], "token_not_issued");
    assert_eq!(list[0]["token"], 987_654);
    let stale = &list[1];
    assert_eq!(stale["reason"], "stale_token");
    assert_eq!(stale["source"], "http");
    assert_eq!(stale["token"], token_of(&a));
    assert_eq!(stale["fence"], token_of(&b));
    assert_eq!(stale["holder"], "worker-a");
    assert_eq!(stale["event_count"], 1);
    assert_eq!(stale["digest"].as_str().unwrap().len(), 64);
    assert_ne!(stale["digest"], list[2]["digest"]);

    let p = partition_for(&TwinId::new(TWIN).unwrap(), 16).0;
    let r = c.get(&format!("/v1/partitions/{p}/refusals?limit=2")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["refusals"].as_array().unwrap().len(), 2);

    // An unknown twin has an empty journal; a bad limit is a 400.
    let r = c.get("/v1/twins/never-seen/refusals").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["refusals"], json!([]));
    for q in ["limit=0", "limit=abc"] {
        let r = c.get(&format!("/v1/twins/{TWIN}/refusals?{q}")).await;
        assert_eq!(r.status, 400, "{q}: {:?}", r.body);
        assert_eq!(r.body["error"], "bad_query");
    }
    let r = c.get("/v1/partitions/999/refusals").await;
    assert!(r.status == 404 || r.status == 400, "{:?}", r.body);
    serve.terminate();
}

/// The journal's cap is a `palisade serve` setting: with
/// `--refusals-per-partition 2` a partition keeps its two newest refused
/// writes, across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_cap_is_a_serve_setting() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--refusals-per-partition", "2"];
    let serve = ServeProcess::start(dir.path(), &args);
    let c = serve.client();
    for id in ["forged-1", "forged-2", "forged-3", "forged-4"] {
        let r = c.put(TWIN, 987_654, id, json!({})).await;
        assert_eq!(r.body["error"], "token_not_issued", "{:?}", r.body);
    }
    serve.kill();
    let serve = ServeProcess::start(dir.path(), &args);
    let r = serve
        .client()
        .get(&format!("/v1/twins/{TWIN}/refusals"))
        .await;
    let ids: Vec<&str> = r.body["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_ids"][0].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["forged-4", "forged-3"], "{:?}", r.body);
}
