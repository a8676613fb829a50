//! Fencing over HTTP: the reference article's Figure 1, the fence raised by the
//! grant itself, partition vs twin scopes, `>=`, If-Match and event-id dedupe.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{lease_id_of, token_of, Client};
use crate::{
    assert_error, history, partition_of, send, start, start_clocked, twin_in, twin_not_in,
};

const PAST_TTL: Duration = Duration::from_millis(260);

/// Append with an explicit If-Match header.
async fn append_if_match(
    c: &Client,
    twin: &str,
    token: u64,
    if_match: &str,
    body: &Value,
) -> crate::support::Resp {
    send(
        c.http
            .post(format!("{}/v1/twins/{twin}/events", c.base))
            .header("fencing-token", token.to_string())
            .header("if-match", if_match)
            .json(body),
    )
    .await
}

/// Figure 1: A pauses past its TTL, B acquires and writes, A's late write is
/// refused by the store and B's value stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn figure_1_paused_holder_cannot_overwrite() {
    let (_dir, server, c, clock) = start_clocked().await;
    let twin = "device-7";

    let a = token_of(&c.acquire("twin/device-7", "A", 200).await);
    let r = c.put(twin, a, "a-1", json!({"owner": "A"})).await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    clock.advance(PAST_TTL); // A "pauses"

    let b = token_of(&c.acquire("twin/device-7", "B", 60_000).await);
    assert!(b > a);
    let r = c.put(twin, b, "b-1", json!({"owner": "B"})).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let b_first_seq = r.body["seqs"][0].as_u64().unwrap();

    // A wakes up and writes: refused, with its token and the fence.
    let r = c.put(twin, a, "a-2", json!({"owner": "A"})).await;
    assert_error(&r, 409, "stale_token");
    assert_eq!(r.body["token"], a);
    assert_eq!(r.body["fence"], b);

    let t = c.twin(twin).await;
    assert_eq!(t.status, 200);
    assert_eq!(t.body["state"], json!({"owner": "B"}));
    assert_eq!(t.body["fence"], b);

    let events = history(&c, twin).await;
    assert_eq!(events.len(), 2, "{events:?}");
    for e in &events {
        let seq = e["seq"].as_u64().unwrap();
        assert!(
            !(e["token"] == a && seq > b_first_seq),
            "an event of A's token after B's first write: {e}"
        );
        assert_ne!(e["event_id"], "a-2");
    }
    assert_eq!(events[1]["writer"], "B");

    server.stop().await;
}

/// The grant raises the fence: A is refused even before B writes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grant_itself_raises_the_fence() {
    let (_dir, server, c, clock) = start_clocked().await;
    let twin = "device-8";

    let a = token_of(&c.acquire("twin/device-8", "A", 200).await);
    assert_eq!(c.put(twin, a, "a-1", json!({"v": 1})).await.status, 201);
    clock.advance(PAST_TTL);
    let b = token_of(&c.acquire("twin/device-8", "B", 60_000).await);

    let r = c.put(twin, a, "a-2", json!({"v": 2})).await;
    assert_error(&r, 409, "stale_token");
    assert_eq!(r.body["fence"], b);

    let t = c.twin(twin).await;
    assert_eq!(t.body["state"], json!({"v": 1}));
    assert_eq!(t.body["fence"], b);
    assert_eq!(history(&c, twin).await.len(), 1);

    // The fence also holds for a twin nobody ever wrote.
    let fresh = "device-9";
    let x = token_of(&c.acquire("twin/device-9", "X", 200).await);
    clock.advance(PAST_TTL);
    c.acquire("twin/device-9", "Y", 60_000).await;
    let r = c.put(fresh, x, "x-1", json!({"v": 1})).await;
    assert_error(&r, 409, "stale_token");
    assert_eq!(c.twin(fresh).await.status, 404);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_only_write_what_their_scope_covers() {
    let (_dir, server, c) = start().await;
    let p = 5;
    let in_p1 = twin_in(p, "pa");
    let in_p2 = twin_in(p, "pb");
    let outside = twin_not_in(p, "pc");

    // A partition token writes any twin of its partition...
    let tp = token_of(&c.acquire(&format!("partition/{p}"), "P", 60_000).await);
    for twin in [&in_p1, &in_p2] {
        let r = c.put(twin, tp, "e-1", json!({"by": "P"})).await;
        assert_eq!(r.status, 201, "{twin}: {:?}", r.body);
        assert_eq!(r.body["partition"], p);
    }
    // ...but no twin of another partition.
    let r = c.put(&outside, tp, "e-1", json!({"by": "P"})).await;
    assert_error(&r, 403, "token_scope_mismatch");
    assert_eq!(r.body["token"], tp);
    assert_eq!(r.body["scope"], format!("partition/{p}"));

    // A twin token writes its twin only: not another twin of its partition,
    // nor a twin elsewhere.
    let own = twin_in(7, "own");
    let neighbour = twin_in(7, "nb");
    let far = twin_not_in(7, "far");
    let tt = token_of(&c.acquire(&format!("twin/{own}"), "T", 60_000).await);
    assert_eq!(c.put(&own, tt, "e-1", json!({"by": "T"})).await.status, 201);
    for other in [&neighbour, &far] {
        let r = c.put(other, tt, "e-1", json!({"by": "T"})).await;
        assert_error(&r, 403, "token_scope_mismatch");
        assert_eq!(r.body["scope"], format!("twin/{own}"));
    }

    // Tokens never issued.
    for bogus in [999_999, 0, tt + 1] {
        let r = c.put(&own, bogus, "e-2", json!({"by": "?"})).await;
        assert_error(&r, 403, "token_not_issued");
    }

    for twin in [&outside, &neighbour, &far] {
        assert_eq!(c.twin(twin).await.status, 404, "{twin} was written");
    }
    assert_eq!(history(&c, &own).await.len(), 1);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twin_and_partition_grants_fence_each_other() {
    let (_dir, server, c) = start().await;

    // A twin lease granted after a partition lease fences the partition
    // holder on that twin only.
    let p = 2;
    let (t1, t2) = (twin_in(p, "ta"), twin_in(p, "tb"));
    let tp = token_of(&c.acquire(&format!("partition/{p}"), "P", 60_000).await);
    assert_eq!(c.put(&t1, tp, "p-1", json!({"v": "P"})).await.status, 201);
    assert_eq!(c.put(&t2, tp, "p-1", json!({"v": "P"})).await.status, 201);
    let tt = token_of(&c.acquire(&format!("twin/{t1}"), "T", 60_000).await);
    assert!(tt > tp);
    let r = c.put(&t1, tp, "p-2", json!({"v": "P2"})).await;
    assert_error(&r, 409, "stale_token");
    assert_eq!(r.body["fence"], tt);
    assert_eq!(c.put(&t2, tp, "p-2", json!({"v": "P2"})).await.status, 201);
    assert_eq!(c.put(&t1, tt, "t-1", json!({"v": "T"})).await.status, 201);
    assert_eq!(c.twin(&t1).await.body["state"], json!({"v": "T"}));
    assert_eq!(c.twin(&t2).await.body["state"], json!({"v": "P2"}));

    // A partition lease granted later fences an older twin-scoped holder.
    let q = 9;
    let t3 = twin_in(q, "tc");
    let old = token_of(&c.acquire(&format!("twin/{t3}"), "T3", 60_000).await);
    assert_eq!(
        c.put(&t3, old, "o-1", json!({"v": "old"})).await.status,
        201
    );
    let tq = token_of(&c.acquire(&format!("partition/{q}"), "Q", 60_000).await);
    let r = c.put(&t3, old, "o-2", json!({"v": "old2"})).await;
    assert_error(&r, 409, "stale_token");
    assert_eq!(r.body["fence"], tq);
    assert_eq!(c.put(&t3, tq, "q-1", json!({"v": "Q"})).await.status, 201);
    assert_eq!(c.twin(&t3).await.body["state"], json!({"v": "Q"}));
    assert_eq!(partition_of(&t3), q);

    server.stop().await;
}

/// `>=`, not `>`: one grant, many writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_writes_many_times_with_one_token() {
    let (_dir, server, c) = start().await;
    let lease = c.acquire("twin/many", "A", 60_000).await;
    let t = token_of(&lease);
    let mut last_version = 0;
    for i in 0..20 {
        let r = c.put("many", t, &format!("e-{i}"), json!({"i": i})).await;
        assert_eq!(r.status, 201, "write {i}: {:?}", r.body);
        let v = r.body["version"].as_u64().unwrap();
        assert!(v > last_version);
        assert_eq!(r.body["fence"], t);
        last_version = v;
    }
    let body = c.twin("many").await.body;
    assert_eq!(body["state"], json!({"i": 19}));
    assert_eq!(body["version"], last_version);
    assert_eq!(history(&c, "many").await.len(), 20);
    // Renewing does not change the token, and the token keeps writing.
    c.post_json(
        &format!("/v1/leases/{}/renew", lease_id_of(&lease)),
        &json!({}),
    )
    .await;
    assert_eq!(c.put("many", t, "e-20", json!({"i": 20})).await.status, 201);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_match_is_checked_together_with_the_fence() {
    let (_dir, server, c, clock) = start_clocked().await;
    let twin = "im";
    let a = token_of(&c.acquire("twin/im", "A", 200).await);
    let r = c.put(twin, a, "e-1", json!({"n": 1})).await;
    let v1 = r.body["version"].as_u64().unwrap();
    assert_eq!(r.headers["etag"], format!("\"{v1}\"").as_str());

    let ev = |n: u32| json!({"type": "update", "patch": {"n": n}});
    let r = append_if_match(&c, twin, a, &format!("\"{v1}\""), &ev(2)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let v2 = r.body["version"].as_u64().unwrap();
    assert!(v2 > v1);

    // Stale version: 412 with the current one, nothing written.
    let r = append_if_match(&c, twin, a, &format!("\"{v1}\""), &ev(3)).await;
    assert_error(&r, 412, "version_mismatch");
    assert_eq!(r.body["current"], v2);
    assert_eq!(r.body["expected"], v1);
    assert_eq!(c.twin(twin).await.body["state"], json!({"n": 2}));

    // Both must pass: right version, stale token is still 409.
    clock.advance(PAST_TTL);
    let b = token_of(&c.acquire("twin/im", "B", 60_000).await);
    let r = append_if_match(&c, twin, a, &format!("\"{v2}\""), &ev(4)).await;
    assert_error(&r, 409, "stale_token");
    // If-Match compares strongly (RFC 9110 13.1.1): a weak tag of the
    // right version never matches.
    let r = append_if_match(&c, twin, b, &format!("W/\"{v2}\""), &ev(5)).await;
    assert_error(&r, 412, "weak_if_match");
    let r = append_if_match(&c, twin, b, &format!("\"{v2}\""), &ev(5)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(c.twin(twin).await.body["state"], json!({"n": 5}));
    assert_eq!(history(&c, twin).await.len(), 3);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_event_id_is_stored_once() {
    let (_dir, server, c) = start().await;
    let twin = "dup";
    let t = token_of(&c.acquire("twin/dup", "A", 60_000).await);

    let r = c.put(twin, t, "once", json!({"x": 1})).await;
    assert_eq!(r.status, 201);
    let seq = r.body["seqs"][0].as_u64().unwrap();
    assert_eq!(r.body["duplicates"], 0);

    // The retry (even with another patch) is acknowledged with the original seq.
    let r = c.put(twin, t, "once", json!({"x": 2})).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.body["seqs"], json!([seq]));
    assert_eq!(r.body["duplicates"], 1);
    assert_eq!(r.body["version"], seq);

    // Within one batch, and mixed with a new event.
    let r = c
        .append(
            twin,
            t,
            &json!([
                {"type": "u", "patch": {"y": 1}, "event_id": "twice"},
                {"type": "u", "patch": {"y": 2}, "event_id": "twice"},
                {"type": "u", "patch": {"x": 3}, "event_id": "once"},
            ]),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let new_seq = r.body["seqs"][0].as_u64().unwrap();
    assert_eq!(r.body["seqs"], json!([new_seq, new_seq, seq]));
    assert_eq!(r.body["duplicates"], 2);

    let events = history(&c, twin).await;
    let ids: Vec<&str> = events
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["once", "twice"]);
    assert_eq!(c.twin(twin).await.body["state"], json!({"x": 1, "y": 1}));

    server.stop().await;
}
