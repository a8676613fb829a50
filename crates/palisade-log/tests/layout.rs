#![allow(clippy::unwrap_used)]
//! On-disk layout 2 (docs/decisions/0013-event-batches.md): events stored
//! in batches, reads by seq that land inside a batch, the per-twin history
//! index per batch, the bounded in-memory dedupe window across restarts,
//! batched ingestion, and a layout-1 store refused at open.

mod support;

use std::sync::Arc;

use palisade_core::{FencingToken, NewEvent, PartitionId, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{AsOf, IngestOutcome, IngestRecord, OpenError, Source, Store, StoreConfig};

fn cfg() -> StoreConfig {
    StoreConfig {
        partitions: Some(1),
        snapshot_every: 4,
        ..StoreConfig::default()
    }
}

fn ev(id: &str, n: u64) -> NewEvent {
    NewEvent {
        event_id: id.into(),
        event_type: "t".into(),
        patch: serde_json::json!({ "n": n, "last": id })
            .as_object()
            .cloned()
            .unwrap(),
        hlc: None,
    }
}

async fn lease(store: &Store, twin: &TwinId) -> FencingToken {
    store
        .acquire(AcquireRequest {
            scope: Scope::Twin(twin.clone()),
            holder: format!("holder-{twin}"),
            ttl_ms: 60_000,
            purpose: Default::default(),
        })
        .await
        .unwrap()
        .token
}

/// Requests of 1 to 7 events to three twins, interleaved; then every page
/// of the partition and of each twin, from every starting point, against
/// the model of what was acknowledged.
#[tokio::test]
async fn reads_by_seq_cut_batches_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let twins: Vec<TwinId> = ["a", "b", "ab"]
        .iter()
        .map(|t| TwinId::new(*t).unwrap())
        .collect();
    let mut tokens = Vec::new();
    for t in &twins {
        tokens.push(lease(&store, t).await);
    }
    // (seq, twin index, event id, n) of every acknowledged event.
    let mut model = Vec::new();
    let mut n = 0;
    for round in 0..12u64 {
        let i = usize::try_from(round % 3).unwrap();
        let size = 1 + round % 7;
        let events: Vec<NewEvent> = (0..size)
            .map(|k| {
                n += 1;
                ev(&format!("r{round}-{k}"), n)
            })
            .collect();
        let ids: Vec<(String, u64)> = events
            .iter()
            .map(|e| (e.event_id.clone(), e.patch["n"].as_u64().unwrap()))
            .collect();
        let done = store
            .append(twins[i].clone(), tokens[i], events, None)
            .await
            .unwrap();
        for (seq, (id, n)) in done.seqs.iter().zip(ids) {
            model.push((*seq, i, id, n));
        }
    }
    let total = model.len();
    let seqs: Vec<u64> = model.iter().map(|m| m.0).collect();
    assert_eq!(seqs, (1..=total as u64).collect::<Vec<_>>());

    for after in 0..=total as u64 + 1 {
        for limit in [1, 2, 5, 100] {
            let got: Vec<(u64, String)> = store
                .partition_events(PartitionId(0), after, limit)
                .unwrap()
                .into_iter()
                .map(|e| (e.seq, e.event_id))
                .collect();
            let want: Vec<(u64, String)> = model
                .iter()
                .filter(|m| m.0 > after)
                .take(limit)
                .map(|m| (m.0, m.2.clone()))
                .collect();
            assert_eq!(got, want, "partition after {after} limit {limit}");
            for (i, twin) in twins.iter().enumerate() {
                let got: Vec<(u64, String)> = store
                    .twin_events(twin, after, limit)
                    .unwrap()
                    .into_iter()
                    .map(|e| {
                        assert_eq!(&e.twin_id, twin);
                        (e.seq, e.event_id)
                    })
                    .collect();
                let want: Vec<(u64, String)> = model
                    .iter()
                    .filter(|m| m.1 == i && m.0 > after)
                    .take(limit)
                    .map(|m| (m.0, m.2.clone()))
                    .collect();
                assert_eq!(got, want, "twin {twin} after {after} limit {limit}");
            }
        }
    }

    // Time travel to every seq (snapshots every 4 events of a twin, so most
    // replays start inside a batch).
    for (i, twin) in twins.iter().enumerate() {
        for at in 1..=total as u64 {
            let last = model.iter().rfind(|m| m.1 == i && m.0 <= at);
            let view = store.twin(twin, AsOf::Seq(at)).unwrap();
            match last {
                None => assert!(view.is_none(), "twin {twin} at {at}"),
                Some(m) => {
                    let v = view.unwrap();
                    assert_eq!(v.version, m.0, "twin {twin} at {at}");
                    assert_eq!(v.state["n"], m.3, "twin {twin} at {at}");
                    assert_eq!(v.state["last"], m.2.as_str(), "twin {twin} at {at}");
                }
            }
        }
    }
    store.close().await;
}

/// Concurrent requests to one twin may share a batch (one group commit);
/// each still gets its own seqs, and the events read back in order.
#[tokio::test]
async fn concurrent_requests_to_one_twin_read_back_in_seq_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), cfg()).unwrap());
    let twin = TwinId::new("hot").unwrap();
    let token = lease(&store, &twin).await;
    let tasks: Vec<_> = (0..32u64)
        .map(|r| {
            let (store, twin) = (store.clone(), twin.clone());
            tokio::spawn(async move {
                let events = (0..3).map(|k| ev(&format!("c{r}-{k}"), r)).collect();
                store.append(twin, token, events, None).await.unwrap()
            })
        })
        .collect();
    let mut acked = Vec::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.seqs.len(), 3);
        assert_eq!(a.seqs[1], a.seqs[0] + 1);
        assert_eq!(a.seqs[2], a.seqs[0] + 2);
        acked.extend(a.seqs);
    }
    acked.sort_unstable();
    let read: Vec<u64> = store
        .twin_events(&twin, 0, 1000)
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(read, acked);
    assert_eq!(read, (1..=96).collect::<Vec<u64>>());
    store.close().await;
}

/// A retry within the window is recognised after a restart; one from
/// beyond the window is appended again. The bound is documented
/// (docs/on-disk-format.md, "Event-id dedupe"); this pins it.
#[tokio::test]
async fn dedupe_window_survives_restarts_and_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("d").unwrap();
    let (old_seq, recent_id, recent_seq, token);
    {
        let store = Store::open(dir.path(), cfg()).unwrap();
        token = lease(&store, &twin).await;
        old_seq = store
            .append(twin.clone(), token, vec![ev("old", 0)], None)
            .await
            .unwrap()
            .seqs[0];
        // Two full windows' worth of other events, in large requests.
        for r in 0..64u64 {
            let events = (0..1024).map(|k| ev(&format!("f{r}-{k}"), k)).collect();
            store
                .append(twin.clone(), token, events, None)
                .await
                .unwrap();
        }
        recent_id = "f63-1000".to_owned();
        recent_seq = old_seq + 63 * 1024 + 1001;
        store.close().await;
    }
    let store = Store::open(dir.path(), cfg()).unwrap();
    let a = store
        .append(twin.clone(), token, vec![ev(&recent_id, 0)], None)
        .await
        .unwrap();
    assert_eq!((a.duplicates, a.seqs[0]), (1, recent_seq));
    let a = store
        .append(twin.clone(), token, vec![ev("old", 0)], None)
        .await
        .unwrap();
    assert_eq!(a.duplicates, 0, "beyond the window, an id is new again");
    assert!(a.seqs[0] > old_seq);
    store.close().await;
}

#[tokio::test]
async fn ingest_batches_apply_in_order_and_store_the_last_offset() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let twin = TwinId::new("k").unwrap();
    let token = lease(&store, &twin).await;
    let rec = |id: &str| IngestRecord::Append {
        twin: twin.clone(),
        token,
        events: vec![ev(id, 0)],
    };
    let outcomes = store
        .enqueue_ingest_batch(
            &Source::new("t", 0),
            (10..20).map(|o| (o, rec(&format!("k{o}")))).collect(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcomes.len(), 10);
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, IngestOutcome::Applied(_))));
    assert_eq!(store.source_offset(&Source::new("t", 0)).unwrap(), Some(19));
    // Redelivery overlapping the stored offset: only the new ones apply.
    let outcomes = store
        .enqueue_ingest_batch(
            &Source::new("t", 0),
            (15..25).map(|o| (o, rec(&format!("k{o}")))).collect(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .unwrap();
    let applied = outcomes
        .iter()
        .filter(|o| matches!(o, IngestOutcome::Applied(_)))
        .count();
    assert_eq!(applied, 5);
    assert_eq!(outcomes[0], IngestOutcome::AlreadyApplied);
    assert_eq!(store.source_offset(&Source::new("t", 0)).unwrap(), Some(24));
    let ids: Vec<String> = store
        .twin_events(&twin, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, (10..25).map(|o| format!("k{o}")).collect::<Vec<_>>());
    store.close().await;
}

/// A store written by a layout-1 build is refused with a clear error, not
/// misread.
#[test]
fn a_layout_1_store_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = support::sled_open(dir.path());
        let meta = db.open_tree("meta").unwrap();
        meta.insert("format", &[1u8][..]).unwrap();
        meta.insert("partitions", &1u32.to_be_bytes()[..]).unwrap();
        db.flush().unwrap();
    }
    match Store::open(dir.path(), cfg()) {
        Err(
            e @ OpenError::Format {
                found: 1,
                supported: 4,
                ..
            },
        ) => {
            assert!(e.to_string().contains("format 1"), "{e}");
        }
        other => panic!("expected a format error, got {other:?}"),
    }
}

/// A folder whose sled lock is held is refused with `InUse` (not a raw sled
/// error) once the bounded wait is over; a lock released within the wait (a
/// store closed a moment ago whose sled jobs still hold the file: seen as a
/// failed reopen in CI) is waited for.
#[tokio::test]
async fn a_held_folder_is_waited_for_then_refused_as_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let started = std::time::Instant::now();
    match Store::open(dir.path(), cfg()) {
        Err(e @ OpenError::InUse { .. }) => {
            assert!(e.to_string().contains("in use"), "{e}");
            assert!(started.elapsed() >= std::time::Duration::from_secs(1));
        }
        other => panic!("expected InUse, got {other:?}"),
    }
    store.close().await;
    drop(store);

    // Held by a raw sled handle released 300 ms later, on another thread.
    let holder = support::sled_open(dir.path());
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(holder);
    });
    let store = Store::open(dir.path(), cfg()).expect("the released lock is waited for");
    release.join().unwrap();
    store.close().await;
}

/// Layout 3 -> 4 (docs/decisions/0024-refusal-journal.md): a store a
/// layout-3 build left (no `refusals` tree, `meta/format` 3) opens, keeps
/// its events, is marked 4, and journals refusals from then on.
#[tokio::test]
async fn a_layout_3_store_opens_and_gains_the_refusal_journal() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("pump-3").unwrap();
    let token = {
        let store = Store::open(dir.path(), cfg()).unwrap();
        let lease = store
            .acquire(AcquireRequest {
                scope: Scope::Twin(twin.clone()),
                holder: "old".into(),
                ttl_ms: 60_000,
                purpose: Default::default(),
            })
            .await
            .unwrap();
        store
            .append(twin.clone(), lease.token, vec![ev("before", 1)], None)
            .await
            .unwrap();
        store.close().await;
        lease.token
    };
    {
        // What a layout-3 build left: no refusals tree, format 3.
        let db = support::sled_open(dir.path());
        db.drop_tree("refusals").unwrap();
        db.open_tree("meta")
            .unwrap()
            .insert("format", &[3u8][..])
            .unwrap();
        db.flush().unwrap();
    }
    {
        let store = Store::open(dir.path(), cfg()).unwrap();
        assert_eq!(store.twin_events(&twin, 0, 10).unwrap().len(), 1);
        assert!(store.refusals_of_twin(&twin, 10).unwrap().is_empty());
        let r = store
            .append(twin.clone(), token, vec![ev("late", 2)], Some(99))
            .await;
        assert!(r.is_err());
        assert_eq!(store.refusals_of_twin(&twin, 10).unwrap().len(), 1);
        store.close().await;
    }
    let db = support::sled_open(dir.path());
    let format = db.open_tree("meta").unwrap().get("format").unwrap();
    assert_eq!(format.as_deref(), Some(&[4u8][..]));
}
