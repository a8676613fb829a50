//! A clean restart (SIGTERM) keeps events, fences, the token counter, the
//! dedupe index and live leases.

use std::time::Duration;

use palisade::core::{partition_for, TwinId};
use serde_json::json;

use crate::support::{lease_id_of, token_of, ServeProcess};
use crate::{history, partitions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_restart_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let twin = "device-7";
    // A twin of another partition, written under partition leases.
    let other = (0..)
        .map(|i| format!("other-{i}"))
        .find(|t| {
            partition_for(&TwinId::new(t.as_str()).unwrap(), 16)
                != partition_for(&TwinId::new(twin).unwrap(), 16)
        })
        .unwrap();
    let q = partition_for(&TwinId::new(other.as_str()).unwrap(), 16).0;

    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    let a = token_of(&c.acquire("twin/device-7", "A", 200).await);
    let p = token_of(&c.acquire(&format!("partition/{q}"), "P", 200).await);
    for (i, id) in ["a-1", "a-2"].iter().enumerate() {
        let r = c.put(twin, a, id, json!({"owner": "A", "i": i})).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    assert_eq!(
        c.put(&other, p, "p-1", json!({"by": "P"})).await.status,
        201
    );
    tokio::time::sleep(Duration::from_millis(260)).await;
    let b_lease = c.acquire("twin/device-7", "B", 60_000).await;
    let b = token_of(&b_lease);
    let qq = token_of(&c.acquire(&format!("partition/{q}"), "Q", 60_000).await);
    let mut b_seqs = Vec::new();
    for id in ["b-1", "b-2"] {
        let r = c.put(twin, b, id, json!({"owner": "B", "last": id})).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
        b_seqs.push(r.body["seqs"][0].as_u64().unwrap());
    }
    assert_eq!(
        c.put(&other, qq, "q-1", json!({"by": "Q"})).await.status,
        201
    );

    // The highest token before the restart belongs to a released lease, so
    // only the durable counter (not the restored leases) remembers it.
    let scratch = c.acquire("twin/scratch", "S", 60_000).await;
    let r = c
        .delete(&format!("/v1/leases/{}", lease_id_of(&scratch)))
        .await;
    assert_eq!(r.status, 204, "{:?}", r.body);

    let twin_before = c.twin(twin).await.body;
    let other_before = c.twin(&other).await.body;
    let history_before = history(&c, twin).await;
    let (parts_before, last_before) = partitions(&c).await;
    assert_eq!(last_before, token_of(&scratch));
    assert!(last_before > qq);
    assert_eq!(history_before.len(), 4);

    proc.terminate();
    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();

    assert_eq!(c.twin(twin).await.body, twin_before);
    assert_eq!(c.twin(&other).await.body, other_before);
    assert_eq!(history(&c, twin).await, history_before);
    let (parts_after, last_after) = partitions(&c).await;
    assert_eq!(parts_after, parts_before);
    assert_eq!(last_after, last_before);

    // The counter survived: a new grant is above every token before.
    let fresh = token_of(&c.acquire("twin/fresh", "F", 60_000).await);
    assert!(
        fresh > last_before,
        "token {fresh} after restart, {last_before} before"
    );

    // The fences survived: A and P are still refused.
    let r = c.put(twin, a, "a-3", json!({"owner": "A"})).await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["error"], "stale_token");
    assert_eq!(r.body["fence"], b);
    let r = c.put(&other, p, "p-2", json!({"by": "P"})).await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["fence"], qq);

    // The dedupe index survived: B's retry is acknowledged, not re-appended.
    let r = c
        .put(twin, b, "b-1", json!({"owner": "B", "last": "b-1"}))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.body["duplicates"], 1);
    assert_eq!(r.body["seqs"], json!([b_seqs[0]]));
    assert_eq!(history(&c, twin).await, history_before);

    // B's lease survived: others are refused, B renews by id and writes on.
    let r = c.try_acquire("twin/device-7", "C", 1000).await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["error"], "lease_held");
    assert_eq!(r.body["holder"], "B");
    let r = c
        .post_json(
            &format!("/v1/leases/{}/renew", lease_id_of(&b_lease)),
            &json!({}),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["token"], b);
    let r = c
        .put(twin, b, "b-3", json!({"owner": "B", "last": "b-3"}))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(history(&c, twin).await.len(), 5);

    proc.terminate();
}
