#![allow(clippy::unwrap_used)]
//! On-disk layout 2 (docs/decisions/0013-event-batches.md): events stored
//! in batches, reads by seq that land inside a batch, the per-twin history
//! index per batch, the bounded in-memory dedupe window across restarts,
//! batched ingestion, and a layout-1 store refused at open. Layouts 3 and
//! 4 migrated to 5 (refusal journal, outbox).

mod support;

use std::sync::Arc;

use palisade_core::effect::{Effect, EffectKind};
use palisade_core::{FencingToken, NewEvent, PartitionId, TwinId};
use palisade_lease::Lease;
use palisade_log::{
    AppendError, AsOf, DeliveryState, IngestOutcome, IngestRecord, LeaseOpError, OpenError, Source,
    Store, StoreConfig,
};

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
    support::twin_lease(store, twin, &format!("holder-{twin}"))
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
        if_match: None,
        effects: Vec::new(),
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
                supported: 5,
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

/// Layout 3 -> 5 (docs/decisions/0024-refusal-journal.md, 0030): a store a
/// layout-3 build left (no `refusals` tree, `meta/format` 3) opens, keeps
/// its events, is marked 5 (this build's), and journals refusals from then on.
#[tokio::test]
async fn a_layout_3_store_opens_and_gains_the_refusal_journal() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("pump-3").unwrap();
    let token = {
        let store = Store::open(dir.path(), cfg()).unwrap();
        let lease = support::twin_lease(&store, &twin, "old").await.unwrap();
        store
            .append(twin.clone(), lease.token, vec![ev("before", 1)], None)
            .await
            .unwrap();
        store.close().await;
        lease.token
    };
    {
        // What a layout-3 build left: no refusals or outbox tree, format 3.
        let db = support::sled_open(dir.path());
        db.drop_tree("refusals").unwrap();
        db.drop_tree("outbox").unwrap();
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
    assert_eq!(format.as_deref(), Some(&[5u8][..]));
}

fn webhook(n: u64) -> Effect {
    Effect {
        kind: EffectKind::Webhook,
        url: "http://127.0.0.1:9/hook".into(),
        body: format!("{{\"n\":{n}}}"),
        headers: Vec::new(),
    }
}

/// Layout 4 -> 5 (docs/decisions/0030-fenced-outbox.md): a store a
/// layout-4 build left (no `outbox` tree, `meta/format` 4) opens, keeps its
/// events, is marked 5, and records effects from then on: those of an
/// admitted append, in the same commit, and none of a refused (stale) one.
#[tokio::test]
async fn a_layout_4_store_opens_and_gains_the_outbox_which_only_admitted_appends_fill() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("pump-4").unwrap();
    async fn acquire(store: &Store, holder: &str) -> Result<Lease, LeaseOpError> {
        support::twin_lease(store, &TwinId::new("pump-4").unwrap(), holder).await
    }
    let old = {
        let store = Store::open(dir.path(), cfg()).unwrap();
        let lease = acquire(&store, "old").await.unwrap();
        store
            .append(twin.clone(), lease.token, vec![ev("before", 1)], None)
            .await
            .unwrap();
        store.release(lease.id).await.unwrap();
        store.close().await;
        lease.token
    };
    {
        let db = support::sled_open(dir.path());
        db.drop_tree("outbox").unwrap();
        db.open_tree("meta")
            .unwrap()
            .insert("format", &[4u8][..])
            .unwrap();
        db.flush().unwrap();
    }
    {
        let store = Store::open(dir.path(), cfg()).unwrap();
        assert_eq!(store.twin_events(&twin, 0, 10).unwrap().len(), 1);
        assert!(store.outbox_list(None, 100).unwrap().is_empty());
        let new = acquire(&store, "new").await.unwrap();
        // Stale: refused, and nothing in the outbox.
        let r = store
            .append_with_effects(
                twin.clone(),
                old,
                vec![ev("stale", 9)],
                vec![vec![webhook(9)]],
                None,
            )
            .await;
        assert!(matches!(r, Err(AppendError::Stale { .. })), "{r:?}");
        assert!(store.outbox_list(None, 100).unwrap().is_empty());
        // Admitted: its effects are durable when it is acknowledged.
        let done = store
            .append_with_effects(
                twin.clone(),
                new.token,
                vec![ev("a", 2), ev("b", 3)],
                vec![vec![webhook(2), webhook(22)], vec![]],
                None,
            )
            .await
            .unwrap();
        let list = store.outbox_list(None, 100).unwrap();
        let got: Vec<_> = list
            .iter()
            .map(|e| (e.seq, e.index, e.event_id.as_str(), e.token))
            .collect();
        assert_eq!(
            got,
            [
                (done.seqs[0], 0, "a", new.token.0),
                (done.seqs[0], 1, "a", new.token.0)
            ]
        );
        assert_eq!(list[1].effect, webhook(22));
        assert!(list.iter().all(|e| e.state == DeliveryState::Pending));
        let p = store.partition_of(&twin);
        assert_eq!(store.outbox_pending(p, None, 100).unwrap().len(), 2);
        assert_eq!(
            store
                .outbox_pending(p, Some((done.seqs[0], 0)), 100)
                .unwrap()
                .len(),
            1
        );
        // A delivery state written through the commit path is durable.
        let mut e = list[0].clone();
        e.state = DeliveryState::Delivered;
        e.attempts = 1;
        store.outbox_update(&e).await.unwrap();
        store.close().await;
    }
    let store = Store::open(dir.path(), cfg()).unwrap();
    let list = store.outbox_list(None, 100).unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0].state, DeliveryState::Delivered);
    assert_eq!(
        store
            .outbox_list(Some(DeliveryState::Pending), 100)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(store.outbox_count(DeliveryState::Pending).unwrap(), 1);
    assert_eq!(store.outbox_count(DeliveryState::Delivered).unwrap(), 1);
    assert_eq!(store.outbox_count(DeliveryState::Dead).unwrap(), 0);
    store.close().await;
    drop(store);
    let db = support::sled_open(dir.path());
    let format = db.open_tree("meta").unwrap().get("format").unwrap();
    assert_eq!(format.as_deref(), Some(&[5u8][..]));
}
