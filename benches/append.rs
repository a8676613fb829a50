//! Durable append throughput: Palisade's fenced path beside raw sled.
//!
//! Every Palisade figure has its baseline in the same run, so the ratio is
//! meaningful even on a noisy machine (absolute numbers are not).
//!
//! - `raw_sled/<n>`: the limit. One `sled::Batch` of `n` encoded events under
//!   the store's event keys (`0x01 ++ seq` big-endian), `apply_batch`,
//!   `flush`, and an `fdatasync` of sled's `db` file: the same real sync the
//!   store pays (sled's flush alone is `sync_file_range`, not durability;
//!   decision 0015). No fencing, no dedupe, no twin state.
//! - `palisade/<n>`: `Store::append` of `n` events to one twin with a lease
//!   acquired once: sequencer (fence check, dedupe in memory, LWW state
//!   apply), one write-ahead log record + `fdatasync`, then the event-batch
//!   value, history entry, twin record and meta applied to sled (on-disk
//!   layout 2, docs/decisions/0013-event-batches.md).
//! - `raw_sled_store_keys/<n>` (diagnostic, not a baseline): the sled work
//!   of `palisade/<n>` without the store's CPU work: one value holding the
//!   `n` encoded events (a `Vec<Event>`, a few bytes per event larger than
//!   the store's batch), one history entry, a twin record and the partition
//!   meta; `apply_batch`, `flush`, `fdatasync`. Splits the gap into key layout (raw_sled
//!   -> store_keys) and fenced-path CPU (store_keys -> palisade).
//! - `palisade_concurrent/16x16`: 16 appends of 16 events to 16 twins of one
//!   partition issued at once, so the writer folds them into group commits.
//!   Compare with `raw_sled/256`.
//!
//! Run: `cargo bench --bench append` (see docs/benchmarks.md). Smoke test:
//! `cargo bench --bench append -- --test`. With `PALISADE_BENCH_METRICS=1`
//! the stores' metrics (requests per flush, flush latency) go to stderr at
//! the end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use criterion::{SamplingMode, Throughput};
use palisade_core::{codec, Event, FencingToken, Hlc, NewEvent, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{Store, StoreConfig};

/// Events per commit for the single-writer cases.
const BATCH_SIZES: [usize; 3] = [1, 16, 256];
/// Concurrent requests (each to its own twin) and events per request.
const CONCURRENT_TWINS: usize = 16;
const CONCURRENT_EVENTS: usize = 16;
/// Lease TTL: long enough that nothing expires during a run (it would not
/// matter anyway: nobody else acquires, so the fence never rises).
const TTL_MS: u64 = 3_600_000;

/// The event patch, ~100 bytes of compact JSON.
fn patch() -> serde_json::Map<String, serde_json::Value> {
    let v = serde_json::json!({
        "temp": 21.5,
        "rpm": 1200,
        "status": "running",
        "note": "x".repeat(47),
    });
    v.as_object().cloned().unwrap()
}

/// Unique event ids across the whole run: the store dedupes on them.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn new_events(n: usize, patch: &serde_json::Map<String, serde_json::Value>) -> Vec<NewEvent> {
    (0..n)
        .map(|_| NewEvent {
            event_id: format!("ev-{:016}", NEXT_ID.fetch_add(1, Ordering::Relaxed)),
            event_type: "telemetry".into(),
            patch: patch.clone(),
            hlc: None,
        })
        .collect()
}

/// A stored event like the ones the store writes for `new_events`.
fn stored_event(seq: u64, twin: &TwinId, patch_text: &str) -> Event {
    Event {
        seq,
        twin_id: twin.clone(),
        event_id: format!("ev-{seq:016}"),
        event_type: "telemetry".into(),
        patch: patch_text.to_owned(),
        hlc: Hlc {
            time: 7_400_000_000_000_000_000 + seq,
            id: [1; 16],
        },
        writer: "bench".into(),
        token: FencingToken(1),
        appended_at_ms: 1_700_000_000_000,
    }
}

fn event_key(seq: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = 0x01;
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// `kind ++ u16 BE length ++ twin id`, the prefix of the store's per-twin keys.
fn twin_key(kind: u8, twin: &TwinId, extra: &[u8]) -> Vec<u8> {
    let id = twin.as_bytes();
    let mut k = Vec::with_capacity(3 + id.len() + extra.len());
    k.push(kind);
    k.extend_from_slice(&u16::try_from(id.len()).unwrap().to_be_bytes());
    k.extend_from_slice(id);
    k.extend_from_slice(extra);
    k
}

/// Bytes the size of the store's encoded twin record for this patch: the
/// encoded LWW state plus fence, version and event count (varints).
fn twin_record_standin(patch: &serde_json::Map<String, serde_json::Value>) -> Vec<u8> {
    let mut state = palisade_twin::TwinState::new();
    let hlc = Hlc {
        time: 7_400_000_000_000_000_000,
        id: [1; 16],
    };
    state.apply(patch, hlc).unwrap();
    vec![0x5a; codec::encode(&state).len() + 3 * 5]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn open_store(dir: &tempfile::TempDir) -> Store {
    let config = StoreConfig {
        partitions: Some(1),
        ..StoreConfig::default()
    };
    Store::open(dir.path(), config).unwrap()
}

fn twin_lease(rt: &tokio::runtime::Runtime, store: &Store, twin: &TwinId) -> FencingToken {
    let req = AcquireRequest {
        scope: Scope::Twin(twin.clone()),
        holder: "bench".into(),
        ttl_ms: TTL_MS,
        purpose: Default::default(),
    };
    rt.block_on(store.acquire(req)).unwrap().token
}

fn durable_append(c: &mut Criterion) {
    let rt = runtime();
    let patch = patch();
    let patch_text = serde_json::Value::Object(patch.clone()).to_string();

    let mut group = c.benchmark_group("durable_append");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        // Every iteration is an fsync: far too slow for linear sampling.
        .sampling_mode(SamplingMode::Flat);

    // raw sled (the limit), the store-keys diagnostic and the store, each in
    // a tempdir of its own. Each batch size runs the three back to back, so a
    // change in the machine's load hits both sides of a ratio alike.
    let raw_dir = tempfile::tempdir().unwrap();
    let raw_db = sled::Config::new()
        .path(raw_dir.path())
        .cache_capacity(StoreConfig::default().cache_bytes)
        .open()
        .unwrap();
    let raw = raw_db.open_tree("partition/00000").unwrap();
    let raw_file = std::fs::File::open(raw_dir.path().join("db")).unwrap();
    let raw_twin = TwinId::new("pump-raw").unwrap();
    let mut raw_seq = 0u64;

    let keys_dir = tempfile::tempdir().unwrap();
    let keys_db = sled::Config::new()
        .path(keys_dir.path())
        .cache_capacity(StoreConfig::default().cache_bytes)
        .open()
        .unwrap();
    let keys = keys_db.open_tree("partition/00000").unwrap();
    let keys_file = std::fs::File::open(keys_dir.path().join("db")).unwrap();
    let keys_twin = TwinId::new("pump-1").unwrap();
    let twin_record = sled::IVec::from(twin_record_standin(&patch));
    let mut keys_seq = 0u64;

    let store_dir = tempfile::tempdir().unwrap();
    let store = open_store(&store_dir);
    let twin = TwinId::new("pump-1").unwrap();
    let token = twin_lease(&rt, &store, &twin);

    for n in BATCH_SIZES {
        group.throughput(Throughput::Elements(n as u64));

        // raw_sled/<n>: n encoded events under event keys, apply, flush.
        group.bench_with_input(BenchmarkId::new("raw_sled", n), &n, |b, &n| {
            b.iter_batched(
                || {
                    let mut batch = sled::Batch::default();
                    for _ in 0..n {
                        raw_seq += 1;
                        let ev = stored_event(raw_seq, &raw_twin, &patch_text);
                        batch.insert(&event_key(raw_seq)[..], codec::encode(&ev));
                    }
                    batch
                },
                |batch| {
                    raw.apply_batch(batch).unwrap();
                    black_box(raw.flush().unwrap());
                    raw_file.sync_data().unwrap();
                },
                BatchSize::SmallInput,
            );
        });

        // raw_sled_store_keys/<n>: the store's sled operations, nothing else.
        group.bench_with_input(BenchmarkId::new("raw_sled_store_keys", n), &n, |b, &n| {
            b.iter_batched(
                || {
                    let first = keys_seq + 1;
                    let events: Vec<Event> = (0..n)
                        .map(|_| {
                            keys_seq += 1;
                            stored_event(keys_seq, &keys_twin, &patch_text)
                        })
                        .collect();
                    (first, keys_seq, codec::encode(&events))
                },
                |(first, head, value)| {
                    let mut batch = sled::Batch::default();
                    batch.insert(&event_key(first)[..], value);
                    let history = twin_key(0x03, &keys_twin, &first.to_be_bytes());
                    batch.insert(history, &[][..]);
                    batch.insert(twin_key(0x02, &keys_twin, &[]), twin_record.clone());
                    batch.insert(&[0x07u8][..], &head.to_be_bytes()[..]);
                    keys.apply_batch(batch).unwrap();
                    black_box(keys.flush().unwrap());
                    keys_file.sync_data().unwrap();
                },
                BatchSize::SmallInput,
            );
        });

        // palisade/<n>: the full fenced append of n events to one twin.
        group.bench_with_input(BenchmarkId::new("palisade", n), &n, |b, &n| {
            b.iter_batched(
                || new_events(n, &patch),
                |events| {
                    let done = rt
                        .block_on(store.append(twin.clone(), token, events, None))
                        .unwrap();
                    debug_assert_eq!(done.duplicates, 0);
                    black_box(done)
                },
                BatchSize::SmallInput,
            );
        });
    }

    // --- palisade: 16 concurrent writers, one partition (group commit) ----
    // A store of its own, so its metrics show only this case's group commits.
    let conc_dir = tempfile::tempdir().unwrap();
    let conc = Arc::new(open_store(&conc_dir));
    let twins: Vec<(TwinId, FencingToken)> = (0..CONCURRENT_TWINS)
        .map(|i| {
            let t = TwinId::new(format!("pump-c{i:02}")).unwrap();
            let tok = twin_lease(&rt, &conc, &t);
            (t, tok)
        })
        .collect();
    group.throughput(Throughput::Elements(
        (CONCURRENT_TWINS * CONCURRENT_EVENTS) as u64,
    ));
    group.bench_function(
        BenchmarkId::new(
            "palisade_concurrent",
            format!("{CONCURRENT_TWINS}x{CONCURRENT_EVENTS}"),
        ),
        |b| {
            b.iter_batched(
                || {
                    (0..CONCURRENT_TWINS)
                        .map(|_| new_events(CONCURRENT_EVENTS, &patch))
                        .collect::<Vec<_>>()
                },
                |requests| {
                    rt.block_on(async {
                        let handles: Vec<_> = twins
                            .iter()
                            .cloned()
                            .zip(requests)
                            .map(|((twin, token), events)| {
                                let store = conc.clone();
                                tokio::spawn(async move {
                                    store.append(twin, token, events, None).await
                                })
                            })
                            .collect();
                        for h in handles {
                            black_box(h.await.unwrap().unwrap());
                        }
                    });
                },
                BatchSize::SmallInput,
            );
        },
    );
    group.finish();

    if std::env::var_os("PALISADE_BENCH_METRICS").is_some() {
        // Requests per flush and flush latency, to check group commit.
        eprintln!("--- palisade/<n> store ---\n{}", store.metrics().render());
        eprintln!(
            "--- palisade_concurrent store ---\n{}",
            conc.metrics().render()
        );
    }
    rt.block_on(store.close());
    rt.block_on(conc.close());
    raw_db.flush().unwrap();
    keys_db.flush().unwrap();
}

criterion_group!(benches, durable_append);
criterion_main!(benches);
