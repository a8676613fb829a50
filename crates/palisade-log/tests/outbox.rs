#![allow(clippy::unwrap_used)]
//! The fenced outbox's read side sees only what is durable: while the
//! commit round holding an event and its effects waits for its
//! `fdatasync` (held by a test hook), neither `outbox_list` nor
//! `outbox_pending` (what the dispatcher reads) shows the effects; once the
//! round is synced and applied they are there. A backup keeps the outbox
//! with its delivery states. Cluster mode's part (decision 0035): effects
//! of ingested records are fenced like an append's, and delivery outcomes
//! merge forward, the same on every store. `docs/outbox.md`.

mod support;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use palisade_core::effect::{Effect, EffectKind};
use palisade_core::{NewEvent, TwinId};
use palisade_log::{CommitHooks, Store, StoreConfig};

#[derive(Debug, Default)]
struct Gate {
    state: Mutex<(bool, bool)>, // (hold, holding)
    changed: Condvar,
}

impl CommitHooks for Gate {
    fn before_sync(&self, _rounds: std::ops::RangeInclusive<u64>) -> std::io::Result<()> {
        let mut s = self.state.lock().unwrap();
        if s.0 {
            s.1 = true;
            self.changed.notify_all();
            while s.0 {
                s = self.changed.wait(s).unwrap();
            }
            s.1 = false;
        }
        Ok(())
    }
}

impl Gate {
    fn hold(&self, on: bool) {
        self.state.lock().unwrap().0 = on;
        self.changed.notify_all();
    }

    fn wait_holding(&self) {
        let s = self.state.lock().unwrap();
        let (s, t) = self
            .changed
            .wait_timeout_while(s, Duration::from_secs(10), |s| !s.1)
            .unwrap();
        assert!(s.1 && !t.timed_out(), "no sync reached the gate");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_are_readable_only_once_their_round_is_synced() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let store = Arc::new(
        Store::open(
            dir.path(),
            StoreConfig {
                partitions: Some(1),
                hooks: Some(gate.clone()),
                ..StoreConfig::default()
            },
        )
        .unwrap(),
    );
    let twin = TwinId::new("fan-1").unwrap();
    let lease = support::twin_lease(&store, &twin, "w").await.unwrap();
    gate.hold(true);
    let effect = Effect {
        kind: EffectKind::Webhook,
        url: "http://127.0.0.1:9/x".into(),
        body: "1".into(),
        headers: Vec::new(),
    };
    let append = {
        let (store, twin) = (store.clone(), twin.clone());
        tokio::spawn(async move {
            let ev = NewEvent {
                event_id: "e1".into(),
                event_type: "t".into(),
                patch: serde_json::Map::new(),
                hlc: None,
            };
            store
                .append_with_effects(twin, lease.token, vec![ev], vec![vec![effect]], None)
                .await
        })
    };
    let g = gate.clone();
    tokio::task::spawn_blocking(move || g.wait_holding())
        .await
        .unwrap();
    // Decided and staged, not yet synced: invisible to every reader.
    let p = store.partition_of(&twin);
    assert!(store.outbox_list(None, 10).unwrap().is_empty());
    assert!(store.outbox_pending(p, None, 10).unwrap().is_empty());
    assert!(!append.is_finished());
    gate.hold(false);
    let done = append.await.unwrap().unwrap();
    let pending = store.outbox_pending(p, None, 10).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].seq, done.seqs[0]);
    assert_eq!(pending[0].idempotency_key(), "e1:0");
    store.close().await;
}

/// A backup carries the outbox with its delivery states (they change in
/// place, so they are read while writes are held); the restored store lists
/// them as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_keeps_the_outbox_and_its_delivery_states() {
    use palisade_log::backup::{frame, restore, FolderWriter, RestoreOptions};
    use palisade_log::DeliveryState;

    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::open(
            &dir.path().join("data"),
            StoreConfig {
                partitions: Some(2),
                ..StoreConfig::default()
            },
        )
        .unwrap(),
    );
    let twin = TwinId::new("fan-2").unwrap();
    let lease = support::twin_lease(&store, &twin, "w").await.unwrap();
    let effect = |n: u8| Effect {
        kind: EffectKind::Webhook,
        url: format!("http://127.0.0.1:9/{n}"),
        body: n.to_string(),
        headers: vec![("X-N".into(), n.to_string())],
    };
    let ev = |id: &str| NewEvent {
        event_id: id.into(),
        event_type: "t".into(),
        patch: serde_json::Map::new(),
        hlc: None,
    };
    store
        .append_with_effects(
            twin.clone(),
            lease.token,
            vec![ev("e1"), ev("e2")],
            vec![vec![effect(1)], vec![effect(2)]],
            None,
        )
        .await
        .unwrap();
    let mut first = store.outbox_list(None, 10).unwrap()[0].clone();
    first.state = DeliveryState::Delivered;
    first.attempts = 2;
    store.outbox_update(&first).await.unwrap();
    let before = store.outbox_list(None, 10).unwrap();

    let to = dir.path().join("backup");
    let s = store.clone();
    let to2 = to.clone();
    tokio::task::spawn_blocking(move || {
        let mut w = FolderWriter::create(&to2).unwrap();
        let mut manifest = Vec::new();
        s.backup(&mut |kind, bytes| {
            match kind {
                frame::DATA => w.data(bytes).unwrap(),
                frame::MANIFEST => manifest = bytes.to_vec(),
                _ => {}
            }
            Ok(())
        })
        .unwrap();
        w.finish(&manifest).unwrap();
    })
    .await
    .unwrap();
    store.close().await;
    let restored = dir.path().join("restored");
    restore(&to, &restored, &RestoreOptions::default(), &mut |_, _| {}).unwrap();
    let store = Store::open(
        &restored,
        StoreConfig {
            partitions: Some(2),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    assert_eq!(store.outbox_list(None, 10).unwrap(), before);
    assert_eq!(before.len(), 2);
    assert_eq!(before[0].state, DeliveryState::Delivered);
    store.close().await;
}

/// Cluster mode routes appends through the partition's Kafka log: the
/// effects go to the route with their events (the node carries them in the
/// record, and the applying node records them), and nothing is recorded
/// locally before the record is applied.
#[tokio::test]
async fn cluster_routed_appends_hand_their_effects_to_the_route() {
    use palisade_core::{BoxFuture, FencingToken};
    use palisade_log::{AppendError, AppendRoute, Appended};
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Route(Mutex<Vec<Vec<Vec<Effect>>>>);
    impl AppendRoute for Route {
        fn append(
            &self,
            _principal: Option<String>,
            _twin: TwinId,
            _token: FencingToken,
            _events: Vec<NewEvent>,
            effects: Vec<Vec<Effect>>,
            _if_match: Option<u64>,
        ) -> BoxFuture<'_, Result<Appended, AppendError>> {
            self.0.lock().unwrap().push(effects);
            Box::pin(async { Err(AppendError::Closed) })
        }

        fn remove_dead_effect(
            &self,
            _partition: u32,
            _seq: u64,
            _index: u16,
        ) -> BoxFuture<'_, Result<palisade_log::OutboxEntry, palisade_log::OutboxRemoveError>>
        {
            Box::pin(async { Err(palisade_log::OutboxRemoveError::NotServing("fake".into())) })
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
    let route = Arc::new(Route::default());
    store.route_appends(route.clone()).unwrap();
    let twin = TwinId::new("c-1").unwrap();
    let ev = || NewEvent {
        event_id: "e".into(),
        event_type: "t".into(),
        patch: serde_json::Map::new(),
        hlc: None,
    };
    let effect = Effect {
        kind: EffectKind::Webhook,
        url: "http://h/x".into(),
        body: "1".into(),
        headers: Vec::new(),
    };
    let r = store
        .append_with_effects(
            twin.clone(),
            FencingToken(1),
            vec![ev()],
            vec![vec![effect.clone()]],
            None,
        )
        .await;
    assert!(matches!(r, Err(AppendError::Closed)), "{r:?}");
    // A mismatched effects list is refused before it is routed.
    let r = store
        .append_with_effects(
            twin,
            FencingToken(1),
            vec![ev()],
            vec![vec![], vec![]],
            None,
        )
        .await;
    assert!(matches!(r, Err(AppendError::BadEvent(_))), "{r:?}");
    assert_eq!(*route.0.lock().unwrap(), vec![vec![vec![effect]]]);
    // Removing a dead effect goes to the route too (a record of the log).
    let r = store
        .outbox_remove_dead(palisade_core::PartitionId(0), 1, 0)
        .await;
    assert!(
        matches!(&r, Err(palisade_log::OutboxRemoveError::NotServing(m)) if m == "fake"),
        "{r:?}"
    );
    assert!(store.outbox_list(None, 10).unwrap().is_empty());
    store.close().await;
}

/// Cluster mode's side of the outbox at the log level (decision 0035): a
/// Kafka record's effects are recorded by the writer in the event's fenced
/// round (a stale record's are not), and delivery outcomes read from the
/// log are merged forward: applying the same outcomes in the same order
/// on two fresh stores gives the same outbox, and a late, older outcome
/// changes nothing.
#[tokio::test]
async fn ingested_effects_are_fenced_and_outcomes_merge_the_same_on_every_store() {
    use palisade_core::FencingToken;
    use palisade_log::{DeliveryState, IngestOutcome, IngestRecord, OutboxOutcome, Source};

    let effect = |url: &str| Effect {
        kind: EffectKind::Webhook,
        url: url.into(),
        body: "{}".into(),
        headers: Vec::new(),
    };
    let ev = |id: &str| NewEvent {
        event_id: id.into(),
        event_type: "t".into(),
        patch: serde_json::Map::new(),
        hlc: None,
    };
    let rec = |token: FencingToken, id: &str, url: &str| IngestRecord::Append {
        twin: TwinId::new("k-1").unwrap(),
        token,
        events: vec![ev(id)],
        effects: vec![vec![effect(url)]],
        if_match: None,
    };
    let src = Source::new("t", 0);
    let mut outboxes = Vec::new();
    for _ in 0..2 {
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
        let twin = TwinId::new("k-1").unwrap();
        let a = support::twin_lease(&store, &twin, "a").await.unwrap();
        let old = a.token;
        store.release(a.id).await.unwrap();
        let new = support::twin_lease(&store, &twin, "b").await.unwrap().token;
        let ingest = |offset: u64, r: IngestRecord| {
            let (store, src) = (store.clone(), src.clone());
            async move {
                store
                    .enqueue_ingest(&src, offset, r)
                    .await
                    .unwrap()
                    .await
                    .unwrap()
                    .unwrap()
            }
        };
        assert!(matches!(
            ingest(0, rec(new, "e1", "http://h/1")).await,
            IngestOutcome::Applied(_)
        ));
        // A superseded writer's record: dropped, its effect never recorded.
        assert!(matches!(
            ingest(1, rec(old, "late", "http://h/late")).await,
            IngestOutcome::Dropped(_)
        ));
        assert!(matches!(
            ingest(2, rec(new, "e2", "http://h/2")).await,
            IngestOutcome::Applied(_)
        ));
        let entries = store.outbox_list(None, 10).unwrap();
        let ids: Vec<&str> = entries.iter().map(|e| e.event_id.as_str()).collect();
        assert_eq!(ids, ["e1", "e2"]);
        // Outcomes as the log carries them: e1 failed once then delivered;
        // a late "failed" report of e1 (a former owner's) arrives last.
        let o = |e: &palisade_log::OutboxEntry, state, attempts| OutboxOutcome {
            state,
            attempts,
            last_error: (state == DeliveryState::Pending).then(|| "500".to_owned()),
            updated_at_ms: u64::from(attempts),
            ..OutboxOutcome::of(e)
        };
        let log = [
            o(&entries[0], DeliveryState::Pending, 1),
            o(&entries[0], DeliveryState::Delivered, 2),
            o(&entries[1], DeliveryState::Dead, 3),
            o(&entries[0], DeliveryState::Pending, 5),
        ];
        let changed: Vec<bool> = {
            let mut v = Vec::new();
            for outcome in &log {
                v.push(store.outbox_settle(outcome).await.unwrap());
            }
            v
        };
        assert_eq!(changed, [true, true, true, false]);
        let after = store.outbox_list(None, 10).unwrap();
        assert_eq!(
            after
                .iter()
                .map(|e| (e.state, e.attempts))
                .collect::<Vec<_>>(),
            [(DeliveryState::Delivered, 2), (DeliveryState::Dead, 3)]
        );
        outboxes.push(
            after
                .into_iter()
                .map(|e| {
                    (
                        e.partition,
                        e.seq,
                        e.index,
                        e.event_id,
                        e.state,
                        e.attempts,
                        e.last_error,
                    )
                })
                .collect::<Vec<_>>(),
        );
        store.close().await;
    }
    assert_eq!(
        outboxes[0], outboxes[1],
        "two stores applying one log disagree"
    );
}
