//! The limit: raw sled batch insert + flush of the same events, made durable
//! for real, no fencing, no dedupe, no twin state, no HTTP. W threads, each
//! appending batches of N encoded events to its partition's tree (P trees)
//! with one `apply_batch`, then sled's `flush` and an `fdatasync` of sled's
//! `db` file: sled's flush alone is `sync_file_range`, which is not
//! durability (decision 0015), so the baseline pays the same real sync per
//! commit that the store pays per round.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use palisade_core::{codec, Event, FencingToken, Hlc, TwinId};

use super::load::{self, Events, LoadResult, OpStats, Phase, Window, DONE, MEASURE};

/// The encoded value of one event, as the store would write it.
pub fn encoded_event(events: &Events, writer: usize) -> anyhow::Result<Vec<u8>> {
    let e = Event {
        seq: 1,
        twin_id: TwinId::new("twin-0000000")?,
        event_id: format!("{}-raw{writer}-000000000", events.nonce),
        event_type: "telemetry".into(),
        patch: events.patch.clone(),
        hlc: Hlc {
            time: 7_400_000_000_000_000_000,
            id: [1; 16],
        },
        writer: format!("bench-w{writer}"),
        token: FencingToken(1),
        appended_at_ms: 1_700_000_000_000,
    };
    Ok(codec::encode(&e))
}

#[allow(clippy::too_many_arguments)]
pub async fn run(
    base: Option<&Path>,
    partitions: u32,
    writers: usize,
    batch: usize,
    events: &Events,
    warmup: Duration,
    window: Window,
    label: &str,
) -> anyhow::Result<LoadResult> {
    let dir = super::target::temp_dir(base, "palisade-bench-sled-")?;
    let path = dir.path().to_path_buf();
    let db = tokio::task::spawn_blocking(move || {
        sled::Config::new()
            .path(path)
            .cache_capacity(256 << 20)
            .open()
    })
    .await
    .context("sled open task")?
    .context("cannot open sled")?;
    let db_file =
        Arc::new(std::fs::File::open(dir.path().join("db")).context("cannot open sled's db file")?);
    let mut trees = Vec::new();
    for p in 0..partitions {
        trees.push(db.open_tree(format!("partition/{p:05}"))?);
    }
    let seqs: Arc<Vec<AtomicU64>> = Arc::new((0..partitions).map(|_| AtomicU64::new(0)).collect());
    let phase = Arc::new(Phase::default());
    let live = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for w in 0..writers {
        let p = w % partitions.max(1) as usize;
        let tree = trees[p].clone();
        let value = encoded_event(events, w)?;
        let (phase, live, seqs, db_file) =
            (phase.clone(), live.clone(), seqs.clone(), db_file.clone());
        let h = std::thread::Builder::new()
            .name(format!("bench-sled-{w}"))
            .spawn(move || -> anyhow::Result<OpStats> {
                let mut stats = OpStats::default();
                while phase.get() != DONE {
                    let started = Instant::now();
                    let first = seqs[p].fetch_add(batch as u64, Ordering::Relaxed) + 1;
                    let mut b = sled::Batch::default();
                    for seq in first..first + batch as u64 {
                        let mut k = [0u8; 9];
                        k[0] = 0x01;
                        k[1..].copy_from_slice(&seq.to_be_bytes());
                        b.insert(&k[..], value.as_slice());
                    }
                    tree.apply_batch(b)?;
                    tree.flush()?;
                    db_file.sync_data()?;
                    if phase.get() == MEASURE {
                        stats.requests += 1;
                        stats.events += batch as u64;
                        stats.latency.record(started.elapsed());
                        phase.measured.fetch_add(1, Ordering::Relaxed);
                        live.fetch_add(batch as u64, Ordering::Relaxed);
                    }
                }
                Ok(stats)
            })
            .context("cannot start a sled writer thread")?;
        threads.push(h);
    }
    let bar = load::progress(label, window);
    let (elapsed, cpu) = load::drive(
        &phase,
        warmup,
        window,
        &bar,
        || live.load(Ordering::Relaxed),
        async {},
    )
    .await;
    let joined = tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a sled writer thread panicked"))?
            })
            .collect::<anyhow::Result<Vec<OpStats>>>()
    })
    .await
    .context("sled join task")??;
    let mut out = LoadResult {
        elapsed,
        cpu,
        ..LoadResult::default()
    };
    for s in joined {
        out.append.requests += s.requests;
        out.append.events += s.events;
        out.append.latency.merge(&s.latency);
    }
    drop(trees);
    drop(db);
    drop(dir);
    Ok(out)
}
