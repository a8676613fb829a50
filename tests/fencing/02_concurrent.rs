//! Many writers racing grants on one partition. Whatever the interleaving,
//! the log shows it: in every twin's history tokens never go down, and no
//! event carries a token below a grant that was acknowledged before the
//! event was appended (checked through the grant order and the sequence
//! numbers observed by the writers themselves).

use std::sync::Arc;

use palisade::core::{FencingToken, NewEvent, PartitionId, Scope, TwinId};
use palisade::lease::AcquireRequest;
use palisade::log::{AppendError, Store, StoreConfig};
use tokio::sync::Mutex;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_holders_never_regress_a_twins_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::open(
            dir.path(),
            StoreConfig {
                partitions: Some(1),
                ..StoreConfig::default()
            },
        )
        .unwrap(),
    );
    let twins: Vec<TwinId> = (0..4)
        .map(|i| TwinId::new(format!("t{i}")).unwrap())
        .collect();
    // (token, partition head when the grant was acknowledged)
    let grant_log: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..6u32 {
        let (store, twins, grant_log) = (store.clone(), twins.clone(), grant_log.clone());
        tasks.push(tokio::spawn(async move {
            let mut stale = 0;
            for round in 0..15u32 {
                // Each worker takes the single-writer partition lease in
                // turn: same scope, so every grant fences all earlier holders.
                let req = AcquireRequest {
                    scope: Scope::Partition(PartitionId(0)),
                    holder: format!("w{w}-{round}"),
                    ttl_ms: 100,
                    purpose: Default::default(),
                };
                let lease = loop {
                    match store.acquire(req.clone()).await {
                        Ok(l) => break l,
                        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
                    }
                };
                let head = store.partition_infos().unwrap()[0].head;
                grant_log.lock().await.push((lease.token.0, head));
                for (i, twin) in twins.iter().enumerate() {
                    let ev = NewEvent {
                        event_id: format!("w{w}-r{round}-{i}"),
                        event_type: "set".into(),
                        patch: serde_json::json!({ "by": w }).as_object().cloned().unwrap(),
                        hlc: None,
                    };
                    match store
                        .append(twin.clone(), lease.token, vec![ev], None)
                        .await
                    {
                        Ok(_) => {}
                        Err(AppendError::Stale { token, fence }) => {
                            assert!(fence > token);
                            stale += 1;
                        }
                        Err(e) => panic!("unexpected refusal: {e}"),
                    }
                }
                let _ = store.release(lease.id).await;
            }
            stale
        }));
    }
    let mut stale_total = 0;
    for t in tasks {
        stale_total += t.await.unwrap();
    }
    let events = store.partition_events(PartitionId(0), 0, 100_000).unwrap();
    assert!(!events.is_empty());
    // Tokens never go down along the partition's log (a partition lease
    // fences the whole partition).
    for pair in events.windows(2) {
        assert!(
            pair[1].token >= pair[0].token,
            "token went down: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
    // No event after a grant's acknowledgement carries a lower token.
    for (token, head) in grant_log.lock().await.iter() {
        for e in events.iter().filter(|e| e.seq > *head) {
            assert!(
                e.token >= FencingToken(*token),
                "event {} with token {} after grant {token} at head {head}",
                e.seq,
                e.token
            );
        }
    }
    eprintln!(
        "{} events, {stale_total} stale writes refused",
        events.len()
    );
    store.close().await;
}
