#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Records of any source partition, applied to their twin's partition
//! (issue 15; `docs/decisions/0018-ingest-any-partition.md`): a Kafka
//! producer's partitioner need not be murmur2, and a topic's partition count
//! need not be the store's. What must hold, checked here at the log level:
//!
//! - routing: a record's events land in `murmur2(twin) mod N`, whichever
//!   source partition it came from; per twin, in source order;
//! - exactly once: a source offset is stored in the same commit round as
//!   what its record produced, in whatever partition; a redelivery from any
//!   earlier offset and a restart apply nothing twice; a crash after any
//!   round (the write-ahead log cut there) leaves offsets and events
//!   together;
//! - refusals name the record (event ids, source partition, offset);
//!   control characters in an event's type or id are refused on every path;
//! - a layout-2 store (offsets and dead letters per partition tree) is
//!   migrated on open and its consumer resumes where it stopped.

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use palisade_core::{partition_for, FencingToken, NewEvent, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{
    AppendError, DeadLetter, IngestOutcome, IngestRecord, Source, Store, StoreConfig,
};
use proptest::prelude::*;

const PARTITIONS: u32 = 4;
const TOPIC: &str = "twin-events";

fn cfg() -> StoreConfig {
    StoreConfig {
        partitions: Some(PARTITIONS),
        ..StoreConfig::default()
    }
}

fn src(p: u32) -> Source {
    Source::new(TOPIC, p)
}

fn ev(id: &str) -> NewEvent {
    NewEvent {
        event_id: id.into(),
        event_type: "t".into(),
        patch: serde_json::json!({ "last": id })
            .as_object()
            .cloned()
            .unwrap(),
        hlc: None,
    }
}

fn rec(twin: &TwinId, token: FencingToken, id: &str) -> IngestRecord {
    IngestRecord::Append {
        twin: twin.clone(),
        token,
        events: vec![ev(id)],
        if_match: None,
        effects: Vec::new(),
    }
}

async fn lease(store: &Store, twin: &TwinId, holder: &str) -> FencingToken {
    store
        .acquire(AcquireRequest {
            scope: Scope::Twin(twin.clone()),
            holder: holder.into(),
            ttl_ms: 600_000,
            purpose: Default::default(),
        })
        .await
        .unwrap()
        .token
}

async fn batch(
    store: &Store,
    source: &Source,
    records: Vec<(u64, IngestRecord)>,
) -> Vec<IngestOutcome> {
    store
        .enqueue_ingest_batch(source, records)
        .await
        .unwrap()
        .await
        .unwrap()
        .unwrap()
}

fn history(store: &Store, twin: &TwinId) -> Vec<String> {
    store
        .twin_events(twin, 0, 10_000)
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect()
}

/// `n` twins `PREFIX-i`, at least one in every store partition.
fn twins(prefix: &str, n: usize) -> Vec<TwinId> {
    let all: Vec<TwinId> = (0..n)
        .map(|i| TwinId::new(format!("{prefix}-{i}")).unwrap())
        .collect();
    for p in 0..PARTITIONS {
        assert!(
            all.iter().any(|t| partition_for(t, PARTITIONS).0 == p),
            "pick more twins: none in partition {p}"
        );
    }
    all
}

/// A source partition that is not the twin's store partition (as
/// librdkafka's CRC32 would give), among 7 source partitions.
fn foreign_source(twin: &TwinId) -> u32 {
    let own = partition_for(twin, PARTITIONS).0;
    let h = twin.as_bytes().iter().map(|b| u32::from(*b)).sum::<u32>();
    let p = h % 7;
    if p == own {
        (p + 1) % 7
    } else {
        p
    }
}

#[tokio::test]
async fn records_are_routed_by_key_whatever_their_source_partition() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let twins = twins("r", 12);
    let mut tokens = Vec::new();
    for t in &twins {
        tokens.push(lease(&store, t, "w").await);
    }
    // Each twin's records come from a source partition other than its
    // store partition, some from partitions the store does not have (4..7).
    let mut by_source: BTreeMap<u32, Vec<(u64, IngestRecord)>> = BTreeMap::new();
    let mut want: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for round in 0..5 {
        for (t, tok) in twins.iter().zip(&tokens) {
            let s = foreign_source(t);
            let list = by_source.entry(s).or_default();
            let offset = list.len() as u64;
            let id = format!("{t}/{round}");
            list.push((offset, rec(t, *tok, &id)));
            want.entry(t.to_string()).or_default().push(id);
        }
    }
    assert!(
        by_source.keys().any(|s| *s >= PARTITIONS),
        "a source partition the store lacks"
    );
    for (s, records) in &by_source {
        let outcomes = batch(&store, &src(*s), records.clone()).await;
        for ((_, r), o) in records.iter().zip(&outcomes) {
            let IngestRecord::Append { twin, .. } = r else {
                unreachable!()
            };
            let IngestOutcome::Applied(a) = o else {
                panic!("{twin}: {o:?}")
            };
            assert_eq!(a.partition, partition_for(twin, PARTITIONS), "{twin}");
        }
        assert_eq!(
            store.source_offset(&src(*s)).unwrap(),
            Some(records.len() as u64 - 1)
        );
    }
    for t in &twins {
        assert_eq!(
            history(&store, t),
            want[t.as_str()],
            "{t}: in source order, once"
        );
        // In the twin's own partition.
        let p = partition_for(t, PARTITIONS);
        let events = store.partition_events(p, 0, 10_000).unwrap();
        assert_eq!(
            events.iter().filter(|e| e.twin_id == *t).count(),
            5,
            "{t} in partition {p}"
        );
    }
    // Redelivered from the start (a consumer resuming too early): nothing.
    for (s, records) in &by_source {
        let outcomes = batch(&store, &src(*s), records.clone()).await;
        assert!(outcomes.iter().all(|o| *o == IngestOutcome::AlreadyApplied));
    }
    // Another topic's partition 0 is another source.
    assert_eq!(store.source_offset(&Source::new("other", 0)).unwrap(), None);

    // A stale record and a dead one, from source partition 6: the rejection
    // names the record's events, source partition and offset; the dead
    // letter is kept under its source partition, which the store lacks.
    let t = &twins[0];
    let held = store.lease_holder(&Scope::Twin(t.clone())).unwrap();
    store.release(held.id).await.unwrap();
    let newer = lease(&store, t, "w2").await;
    let s6 = src(6);
    let next = store.source_offset(&s6).unwrap().map_or(0, |o| o + 1);
    let stale = IngestRecord::Append {
        twin: t.clone(),
        token: tokens[0],
        events: vec![ev("late-1"), ev("late-2")],
        if_match: None,
        effects: Vec::new(),
    };
    let dead = IngestRecord::Dead(DeadLetter {
        partition: 0,
        offset: 0,
        key: None,
        reason: "missing_key".into(),
        detail: "no key".into(),
        headers: Vec::new(),
        value: b"x".to_vec(),
        value_len: 1,
        at_ms: 0,
    });
    let ctrl = IngestRecord::Append {
        twin: t.clone(),
        token: newer,
        events: vec![NewEvent {
            event_type: "reported\u{1b}[2J".into(),
            ..ev("ctrl")
        }],
        if_match: None,
        effects: Vec::new(),
    };
    let out = batch(
        &store,
        &s6,
        vec![(next, stale), (next + 1, dead), (next + 2, ctrl)],
    )
    .await;
    assert!(matches!(out[0], IngestOutcome::Dropped(_)), "{out:?}");
    assert_eq!(
        out[1],
        IngestOutcome::DeadLettered {
            reason: "missing_key".into(),
            refused: None
        }
    );
    // A control character in the type: refused as on HTTP, the refusal typed.
    assert!(
        matches!(&out[2], IngestOutcome::DeadLettered { reason, refused: Some(AppendError::BadEvent(_)) } if reason == "bad_event"),
        "{out:?}"
    );
    let r = store
        .rejections(100)
        .into_iter()
        .find(|r| r.reason == "stale_token")
        .unwrap();
    assert_eq!(r.event_ids, ["late-1", "late-2"]);
    assert_eq!(
        (r.source, r.source_partition, r.offset),
        ("kafka", Some(6), Some(next))
    );
    assert_eq!((r.partition, &r.twin), (partition_for(t, PARTITIONS), t));
    let dl = store.dead_letters(Some(6), None, 100).unwrap();
    assert_eq!(
        dl.iter()
            .map(|d| (d.partition, d.offset, d.reason.as_str()))
            .collect::<Vec<_>>(),
        [(6, next + 1, "missing_key"), (6, next + 2, "bad_event")]
    );
    assert!(
        dl[1].detail.contains("control character"),
        "{}",
        dl[1].detail
    );
    assert_eq!(store.dead_letters(Some(5), None, 100).unwrap(), []);
    assert_eq!(store.dead_letters(None, None, 100).unwrap().len(), 2);
    store.close().await;
    drop(store);

    // After a restart: offsets kept, redelivery still applies nothing.
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.source_offset(&s6).unwrap(), Some(next + 2));
    for (s, records) in &by_source {
        let outcomes = batch(&store, &src(*s), records.clone()).await;
        assert!(outcomes.iter().all(|o| *o == IngestOutcome::AlreadyApplied));
    }
    for t in &twins {
        assert_eq!(history(&store, t), want[t.as_str()]);
    }
    store.close().await;
}

/// Record `i` of the crash test: (source partition, twin index).
fn crash_plan(i: u64, twins: usize) -> (u32, usize) {
    (
        u32::try_from(i % 5).unwrap(),
        usize::try_from(i * 7 % twins as u64).unwrap(),
    )
}

/// The write-ahead log's records (docs/on-disk-format.md, "Write-ahead
/// log"): (round, end byte) of each, in the one segment of `wal`.
fn wal_rounds(wal: &Path) -> (std::path::PathBuf, Vec<u8>, Vec<usize>) {
    let mut segs: Vec<_> = std::fs::read_dir(wal)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segs.sort();
    assert_eq!(segs.len(), 1, "one segment: {segs:?}");
    let bytes = std::fs::read(&segs[0]).unwrap();
    assert_eq!(&bytes[..8], b"PALWAL01");
    let mut ends = Vec::new();
    let mut at = 16;
    while at + 16 <= bytes.len() {
        let n = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        at += 16 + n;
        ends.push(at);
    }
    assert_eq!(at, bytes.len(), "whole records");
    (segs[0].clone(), bytes, ends)
}

/// A crash after any round: the log cut after round r, replayed into an
/// empty store, must hold, for every source partition, exactly the records
/// up to its stored offset: each twin's history is the prefix of its
/// records whose offsets the store says it handled (nothing applied whose
/// offset was not stored with it, nothing stored whose events were not).
#[tokio::test]
async fn a_crash_after_any_round_keeps_offsets_and_events_together() {
    let dir = tempfile::tempdir().unwrap();
    let live = dir.path().join("live");
    let keep_log = StoreConfig {
        checkpoint_every: std::time::Duration::from_secs(3600),
        checkpoint_bytes: u64::MAX,
        ..cfg()
    };
    let twins = twins("c", 8);
    const N: u64 = 300;
    let mut per_source: BTreeMap<u32, u64> = BTreeMap::new();
    let mut plan = Vec::new(); // (source, offset, twin index, id)
    for i in 0..N {
        let (s, t) = crash_plan(i, twins.len());
        let o = per_source.entry(s).or_insert(0);
        plan.push((s, *o, t, format!("{}/{i}", twins[t])));
        *o += 1;
    }
    let store = Store::open(&live, keep_log.clone()).unwrap();
    let mut tokens = Vec::new();
    for t in &twins {
        tokens.push(lease(&store, t, "w").await);
    }
    // Waves of small batches of every source queued at once: a wave's
    // rounds hold records of several sources for several partitions.
    for wave in plan.chunks(21) {
        let mut waiting = Vec::new();
        for chunk in wave.chunks(7) {
            for s in 0..5 {
                let records: Vec<(u64, IngestRecord)> = chunk
                    .iter()
                    .filter(|(src_p, ..)| *src_p == s)
                    .map(|(_, o, t, id)| (*o, rec(&twins[*t], tokens[*t], id)))
                    .collect();
                if !records.is_empty() {
                    waiting.push(store.enqueue_ingest_batch(&src(s), records).await.unwrap());
                }
            }
        }
        for w in waiting {
            assert!(w
                .await
                .unwrap()
                .unwrap()
                .iter()
                .all(|o| matches!(o, IngestOutcome::Applied(_))));
        }
    }
    let (seg, bytes, ends) = wal_rounds(&live.join("wal"));
    assert!(ends.len() > 10, "{} rounds: too few to test", ends.len());
    // An empty store of the same shape to replay cut logs into.
    let empty = dir.path().join("empty");
    Store::open(&empty, cfg()).unwrap().close().await;
    let mut cuts = 0;
    for (r, end) in ends.iter().enumerate() {
        let at = dir.path().join(format!("cut-{r}"));
        copy_dir(&empty, &at);
        std::fs::create_dir_all(at.join("wal")).unwrap();
        std::fs::write(
            at.join("wal").join(seg.file_name().unwrap()),
            &bytes[..*end],
        )
        .unwrap();
        let s = Store::open(&at, cfg()).unwrap();
        let offsets: BTreeMap<u32, Option<u64>> = (0..5)
            .map(|p| (p, s.source_offset(&src(p)).unwrap()))
            .collect();
        for (ti, t) in twins.iter().enumerate() {
            let want: Vec<String> = plan
                .iter()
                .filter(|(sp, o, tj, _)| *tj == ti && offsets[sp].is_some_and(|so| *o <= so))
                .map(|(.., id)| id.clone())
                .collect();
            assert_eq!(history(&s, t), want, "cut after round {}: {t}", r + 1);
        }
        s.close().await;
        drop(s);
        std::fs::remove_dir_all(&at).unwrap();
        cuts += 1;
    }
    assert_eq!(cuts, ends.len());
    store.close().await;
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A layout-2 store: Kafka partition p's offset and dead letters in
/// partition tree p (keys `0x08`, `0x09 ++ offset`), `meta/format` 2.
fn make_layout_2(dir: &Path, offsets: &[(u32, u64)], dead: &[(u32, u64)]) {
    let db = support::sled_open(dir);
    db.open_tree("meta")
        .unwrap()
        .insert("format", &[2u8][..])
        .unwrap();
    for (p, o) in offsets {
        db.open_tree(format!("partition/{p:05}"))
            .unwrap()
            .insert([0x08], &o.to_be_bytes()[..])
            .unwrap();
    }
    for (p, o) in dead {
        let dl = DeadLetter {
            partition: *p,
            offset: *o,
            key: Some("k".into()),
            reason: "bad_value".into(),
            detail: "old".into(),
            headers: Vec::new(),
            value: Vec::new(),
            value_len: 0,
            at_ms: 1,
        };
        let mut k = vec![0x09];
        k.extend_from_slice(&o.to_be_bytes());
        db.open_tree(format!("partition/{p:05}"))
            .unwrap()
            .insert(k, palisade_core::codec::encode(&dl))
            .unwrap();
    }
    db.flush().unwrap();
}

#[tokio::test]
async fn a_layout_2_store_is_migrated_and_its_consumer_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // A store created by this build, then turned into what a layout-2
    // build left: its offsets and dead letters in the partition trees.
    Store::open(dir.path(), cfg()).unwrap().close().await;
    make_layout_2(dir.path(), &[(0, 41), (3, 7)], &[(0, 40), (3, 2), (3, 5)]);

    let store = Store::open(dir.path(), cfg()).unwrap();
    // Dead letters are listed as before, by Kafka partition and offset.
    let dl = store.dead_letters(None, None, 100).unwrap();
    assert_eq!(
        dl.iter()
            .map(|d| (d.partition, d.offset))
            .collect::<Vec<_>>(),
        [(0, 40), (3, 2), (3, 5)]
    );
    assert_eq!(store.dead_letters(Some(3), Some(2), 100).unwrap().len(), 1);
    // The offsets wait for the first topic to claim them.
    assert_eq!(store.source_offset(&src(0)).unwrap(), None);
    assert_eq!(store.claim_legacy_offsets(TOPIC).await.unwrap(), 2);
    assert_eq!(store.source_offset(&src(0)).unwrap(), Some(41));
    assert_eq!(store.source_offset(&src(3)).unwrap(), Some(7));
    assert_eq!(store.claim_legacy_offsets("another").await.unwrap(), 0);
    // Redelivered old records are recognised.
    let t = TwinId::new("m").unwrap();
    let tok = lease(&store, &t, "w").await;
    let out = batch(
        &store,
        &src(3),
        vec![(7, rec(&t, tok, "old")), (8, rec(&t, tok, "new"))],
    )
    .await;
    assert_eq!(out[0], IngestOutcome::AlreadyApplied);
    assert!(matches!(out[1], IngestOutcome::Applied(_)));
    store.close().await;
    drop(store);

    // This build's layout on disk now (5: layout 2 goes straight there,
    // decisions 0024 and 0030), the old keys gone.
    {
        let db = support::sled_open(dir.path());
        assert_eq!(
            db.open_tree("meta")
                .unwrap()
                .get("format")
                .unwrap()
                .unwrap()
                .as_ref(),
            [5]
        );
        for p in 0..PARTITIONS {
            let tree = db.open_tree(format!("partition/{p:05}")).unwrap();
            assert!(tree.get([0x08]).unwrap().is_none());
            assert_eq!(tree.scan_prefix([0x09]).count(), 0);
        }
    }
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.source_offset(&src(3)).unwrap(), Some(8));
    assert_eq!(store.dead_letters(None, None, 100).unwrap().len(), 3);
    store.close().await;
}

/// A consumer's life over 3 source partitions feeding a 4-partition store:
/// deliveries start anywhere at or before the stored offset + 1 (a
/// rebalance, a lagging group commit) and may stop anywhere; the store may
/// restart between them.
#[derive(Debug, Clone)]
enum Step {
    Deliver {
        source: u32,
        back: u64,
        count: usize,
    },
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u32..3, 0u64..6, 1usize..9).prop_map(|(source, back, count)| Step::Deliver { source, back, count }),
        1 => Just(Step::Restart),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// Whatever is redelivered and whenever the store restarts, every
    /// record is applied once, per twin in source order.
    #[test]
    fn each_record_once_in_order_under_redelivery_and_restarts(
        keys in proptest::collection::vec(0usize..6, 60),
        steps in proptest::collection::vec(step(), 1..25),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let twins: Vec<TwinId> = (0..6).map(|i| TwinId::new(format!("p-{i}")).unwrap()).collect();
            let mut store = Store::open(dir.path(), cfg()).unwrap();
            let mut tokens = Vec::new();
            for t in &twins {
                tokens.push(lease(&store, t, "w").await);
            }
            // Source partition s holds records i with i % 3 == s.
            let log: Vec<Vec<(usize, String)>> = (0..3)
                .map(|s| keys.iter().enumerate().filter(|(i, _)| i % 3 == s).map(|(i, k)| (*k, format!("e{i}"))).collect())
                .collect();
            let all = steps.iter().cloned().chain((0..3).map(|source| Step::Deliver { source, back: 0, count: 1000 }));
            for st in all {
                match st {
                    Step::Restart => {
                        store.close().await;
                        drop(store);
                        store = Store::open(dir.path(), cfg()).unwrap();
                    }
                    Step::Deliver { source, back, count } => {
                        let next = store.source_offset(&src(source)).unwrap().map_or(0, |o| o + 1);
                        let from = next.saturating_sub(back);
                        let records: Vec<(u64, IngestRecord)> = log[source as usize]
                            .iter()
                            .enumerate()
                            .skip(usize::try_from(from).unwrap())
                            .take(count)
                            .map(|(o, (k, id))| (o as u64, rec(&twins[*k], tokens[*k], id)))
                            .collect();
                        if !records.is_empty() {
                            batch(&store, &src(source), records).await;
                        }
                    }
                }
            }
            for (k, t) in twins.iter().enumerate() {
                let want: Vec<String> = (0..3)
                    .flat_map(|s| log[s].iter().filter(|(kk, _)| *kk == k).map(|(_, id)| id.clone()))
                    .collect();
                let mut got = history(&store, t);
                // Per twin, records of one source partition keep their
                // order; across source partitions there is no order.
                for (s, records) in log.iter().enumerate().take(3) {
                    let of_s: Vec<&String> = records.iter().filter(|(kk, _)| *kk == k).map(|(_, id)| id).collect();
                    let seen: Vec<&String> = got.iter().filter(|id| of_s.contains(id)).collect();
                    assert_eq!(seen, of_s, "{t}: source {s}'s records once, in order");
                }
                got.sort();
                let mut want = want;
                want.sort();
                assert_eq!(got, want, "{t}: every record once");
            }
            store.close().await;
        });
    }
}

/// Cluster mode at the log level: a copy forwarded from another partition
/// is decided once, in its origin's order (the relay rule), across a
/// restart; the forwarding side records its chain with its offset; refusals
/// of a copy name the original record.
#[tokio::test]
async fn forwarded_copies_are_decided_once_in_origin_order() {
    use palisade_log::Origin;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let t = TwinId::new("relay-1").unwrap();
    let j = partition_for(&t, PARTITIONS).0;
    let k = (j + 1) % PARTITIONS;
    let tok = lease(&store, &t, "w").await;
    let copy = |o: u64, prev: Option<u64>, id: &str| IngestRecord::Relayed {
        origin: Origin {
            partition: k,
            offset: o,
            prev,
        },
        record: Box::new(rec(&t, tok, id)),
    };
    let out = batch(
        &store,
        &src(j),
        vec![
            (0, copy(10, None, "e10")),
            // A retry of the same copy (its forwarder crashed before it
            // stored its offset).
            (1, copy(10, None, "e10")),
            // A copy that overtook a lost one (15): set aside.
            (2, copy(20, Some(15), "e20")),
            (3, copy(15, Some(10), "e15")),
            (4, copy(20, Some(15), "e20")),
        ],
    )
    .await;
    assert!(matches!(out[0], IngestOutcome::Applied(_)), "{out:?}");
    assert_eq!(
        out[1],
        IngestOutcome::Duplicate {
            origin: k,
            offset: 10
        }
    );
    assert_eq!(
        out[2],
        IngestOutcome::OutOfOrder {
            origin: k,
            expected: Some(10),
            prev: Some(15)
        }
    );
    assert!(matches!(out[3], IngestOutcome::Applied(_)), "{out:?}");
    assert!(matches!(out[4], IngestOutcome::Applied(_)), "{out:?}");
    assert_eq!(history(&store, &t), ["e10", "e15", "e20"]);

    // The forwarding side: k's record at 10 went to j (at j's offset 0).
    let fwd = batch(
        &store,
        &src(k),
        vec![(10, IngestRecord::Forwarded { to: j, at: 0 })],
    )
    .await;
    assert_eq!(fwd, [IngestOutcome::Forwarded { to: j, at: 0 }]);
    assert_eq!(
        store
            .forward_chains(&src(k))
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        [(j, 10)]
    );
    store.close().await;
    drop(store);

    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.source_offset(&src(j)).unwrap(), Some(4));
    assert_eq!(store.source_offset(&src(k)).unwrap(), Some(10));
    let newer = {
        let held = store.lease_holder(&Scope::Twin(t.clone())).unwrap();
        store.release(held.id).await.unwrap();
        lease(&store, &t, "w2").await
    };
    let stale = IngestRecord::Relayed {
        origin: Origin {
            partition: k,
            offset: 30,
            prev: Some(20),
        },
        record: Box::new(rec(&t, tok, "late")),
    };
    let dead = IngestRecord::Relayed {
        origin: Origin {
            partition: k,
            offset: 31,
            prev: Some(30),
        },
        record: Box::new(rec(&t, FencingToken(newer.0 + 1000), "never-issued")),
    };
    let out = batch(
        &store,
        &src(j),
        vec![(5, copy(20, Some(15), "e20")), (6, stale), (7, dead)],
    )
    .await;
    assert_eq!(
        out[0],
        IngestOutcome::Duplicate {
            origin: k,
            offset: 20
        },
        "after a restart"
    );
    assert!(matches!(out[1], IngestOutcome::Dropped(_)), "{out:?}");
    assert_eq!(
        out[2],
        IngestOutcome::DeadLettered {
            reason: "token_not_issued".into(),
            refused: Some(AppendError::NotIssued {
                token: FencingToken(newer.0 + 1000)
            })
        }
    );
    let r = store
        .rejections(10)
        .into_iter()
        .find(|r| r.reason == "stale_token")
        .unwrap();
    assert_eq!(
        (r.source_partition, r.offset, r.event_ids.clone()),
        (Some(k), Some(30), vec!["late".to_owned()]),
        "names the original record"
    );
    let dl = store.dead_letters(Some(j), None, 10).unwrap();
    assert_eq!(
        (dl[0].partition, dl[0].offset),
        (j, 7),
        "kept where the copy is"
    );
    assert!(
        dl[0]
            .detail
            .contains(&format!("forwarded from partition {k} offset 31")),
        "{}",
        dl[0].detail
    );
    assert_eq!(history(&store, &t), ["e10", "e15", "e20"]);
    store.close().await;
}
