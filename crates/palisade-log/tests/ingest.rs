#![allow(clippy::unwrap_used)]
//! Stream ingestion at the log level: the source offset is stored in the
//! same batch as the outcome of its record, so redelivery (after a crash or
//! a rebalance) applies each record exactly once; stale records are dropped
//! and logged; undecodable or refused records become durable dead letters.

use palisade_core::{FencingToken, NewEvent, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{
    AppendError, DeadLetter, IngestOutcome, IngestRecord, Source, Store, StoreConfig,
};

fn cfg() -> StoreConfig {
    StoreConfig {
        partitions: Some(1),
        ..StoreConfig::default()
    }
}

fn src() -> Source {
    Source::new("twin-events", 0)
}

fn rec(twin: &TwinId, token: FencingToken, id: &str) -> IngestRecord {
    IngestRecord::Append {
        twin: twin.clone(),
        token,
        events: vec![NewEvent {
            event_id: id.into(),
            event_type: "t".into(),
            patch: serde_json::json!({ "id": id })
                .as_object()
                .cloned()
                .unwrap(),
            hlc: None,
        }],
        if_match: None,
        effects: Vec::new(),
    }
}

async fn ingest(store: &Store, offset: u64, r: IngestRecord) -> IngestOutcome {
    store
        .enqueue_ingest(&src(), offset, r)
        .await
        .unwrap()
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn offsets_make_redelivery_exactly_once_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("w-1").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let a = store
        .acquire(AcquireRequest {
            scope: Scope::Twin(twin.clone()),
            holder: "A".into(),
            ttl_ms: 100,
            purpose: Default::default(),
        })
        .await
        .unwrap();
    assert!(matches!(
        ingest(&store, 0, rec(&twin, a.token, "e0")).await,
        IngestOutcome::Applied(_)
    ));
    assert!(matches!(
        ingest(&store, 1, rec(&twin, a.token, "e1")).await,
        IngestOutcome::Applied(_)
    ));
    // Redelivery of offset 1 (e.g. the group's commit lagged): nothing happens.
    assert_eq!(
        ingest(&store, 1, rec(&twin, a.token, "e1-again")).await,
        IngestOutcome::AlreadyApplied
    );
    assert_eq!(store.source_offset(&src()).unwrap(), Some(1));
    store.close().await;
    drop(store);

    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.source_offset(&src()).unwrap(), Some(1));
    assert_eq!(
        ingest(&store, 0, rec(&twin, a.token, "x")).await,
        IngestOutcome::AlreadyApplied
    );
    assert!(matches!(
        ingest(&store, 2, rec(&twin, a.token, "e2")).await,
        IngestOutcome::Applied(_)
    ));
    let ids: Vec<String> = store
        .twin_events(&twin, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, ["e0", "e1", "e2"]);
    store.close().await;
}

#[tokio::test]
async fn stale_records_are_dropped_and_bad_ones_dead_lettered_while_the_partition_flows() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("w-2").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let lease = |h: &str| AcquireRequest {
        scope: Scope::Twin(twin.clone()),
        holder: h.into(),
        ttl_ms: 100,
        purpose: Default::default(),
    };
    let a = store.acquire(lease("A")).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(120)).await;
    let b = store.acquire(lease("B")).await.unwrap();
    // Scenario 3 over a stream: B's record arrives first, A's delayed one after.
    assert!(matches!(
        ingest(&store, 10, rec(&twin, b.token, "b1")).await,
        IngestOutcome::Applied(_)
    ));
    assert_eq!(
        ingest(&store, 11, rec(&twin, a.token, "a1")).await,
        IngestOutcome::Dropped(AppendError::Stale {
            token: a.token,
            fence: b.token
        })
    );
    // A token never issued: dead letter, not a drop.
    assert_eq!(
        ingest(&store, 12, rec(&twin, FencingToken(9999), "z")).await,
        IngestOutcome::DeadLettered {
            reason: "token_not_issued".into(),
            refused: Some(AppendError::NotIssued {
                token: FencingToken(9999)
            })
        }
    );
    // An undecodable record, as the consumer hands it over.
    let dl = DeadLetter {
        partition: 0,
        offset: 0,
        key: None,
        reason: "missing_key".into(),
        detail: "record has no key".into(),
        headers: vec![("fencing-token".into(), "3".into())],
        value: vec![0xff; 10_000],
        value_len: 10_000,
        at_ms: 0,
    };
    assert_eq!(
        ingest(&store, 13, IngestRecord::Dead(dl)).await,
        IngestOutcome::DeadLettered {
            reason: "missing_key".into(),
            refused: None
        }
    );
    // The partition keeps flowing.
    assert!(matches!(
        ingest(&store, 14, rec(&twin, b.token, "b2")).await,
        IngestOutcome::Applied(_)
    ));

    let ids: Vec<String> = store
        .twin_events(&twin, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, ["b1", "b2"]);
    let dead = store.dead_letters(None, None, 100).unwrap();
    assert_eq!(
        dead.iter()
            .map(|d| (d.offset, d.reason.as_str()))
            .collect::<Vec<_>>(),
        [(12, "token_not_issued"), (13, "missing_key")]
    );
    assert_eq!(
        dead[1].value.len(),
        palisade_log::DEAD_LETTER_VALUE_BYTES,
        "value is truncated"
    );
    let rej = store.rejections(10);
    assert!(rej
        .iter()
        .any(|r| r.source == "kafka" && r.offset == Some(11) && r.reason == "stale_token"));
    assert_eq!(store.metrics().rejections("stale_token"), 1);
    assert_eq!(store.source_offset(&src()).unwrap(), Some(14));
    store.close().await;
}

/// Cluster mode's `If-Match` (an HTTP append's expected version, carried in
/// its record): checked against the twin's version at the record's place
/// in the source log, so two records expecting the same version are decided
/// the same way by every store that applies the log: the first applies, the
/// second is refused as on one node (dead letter `version_mismatch`, events
/// not stored), and the offset advances past both.
#[tokio::test]
async fn a_record_expecting_a_version_applies_only_at_that_version() {
    let dir = tempfile::tempdir().unwrap();
    let twin = TwinId::new("w-im").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let a = store
        .acquire(AcquireRequest {
            scope: Scope::Twin(twin.clone()),
            holder: "A".into(),
            ttl_ms: 60_000,
            purpose: Default::default(),
        })
        .await
        .unwrap();
    let expecting = |id: &str, v: u64| match rec(&twin, a.token, id) {
        IngestRecord::Append {
            twin,
            token,
            events,
            ..
        } => IngestRecord::Append {
            twin,
            token,
            events,
            effects: Vec::new(),
            if_match: Some(v),
        },
        other => other,
    };
    let IngestOutcome::Applied(first) = ingest(&store, 0, rec(&twin, a.token, "e0")).await else {
        panic!("an unconditional record applies")
    };
    let v = first.version;
    let IngestOutcome::Applied(won) = ingest(&store, 1, expecting("win", v)).await else {
        panic!("the record expecting the current version applies")
    };
    assert_eq!(
        ingest(&store, 2, expecting("lose", v)).await,
        IngestOutcome::DeadLettered {
            reason: "version_mismatch".into(),
            refused: Some(AppendError::VersionMismatch {
                expected: v,
                current: won.version
            })
        }
    );
    assert_eq!(store.source_offset(&src()).unwrap(), Some(2));
    let ids: Vec<String> = store
        .twin_events(&twin, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, ["e0", "win"], "the refused record stored nothing");
    let dead = store.dead_letters(Some(0), None, 10).unwrap();
    assert!(
        dead.iter()
            .any(|d| d.offset == 2 && d.reason == "version_mismatch"),
        "{dead:?}"
    );
    store.close().await;
}
