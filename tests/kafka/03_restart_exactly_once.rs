//! Kill `palisade serve` (SIGKILL) twice while it is ingesting, restart it on
//! the same folder each time: every record is applied exactly once, in order.
//!
//! Between a kill and the restart, the folder is opened once *without* Kafka
//! to read what the crashed process made durable. That gives the exact number
//! of records the next process must apply (no more: nothing twice; no fewer:
//! nothing skipped), and a check that each twin's history is a gapless prefix
//! of what was produced.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use palisade_kafka::Publisher;
use serde_json::json;

use crate::broker::{TestTopic, PARTITIONS};
use crate::support::{Client, ServeProcess};
use crate::{
    event_ids, handled, heads, history, outcomes, partition_events, publish, publisher, serve,
    twin_token, twins_in, Sent,
};

const TWINS_PER_PARTITION: usize = 2;
/// Long enough that a kill lands mid-stream: the store ingests tens of
/// thousands of one-event records a second, so the few milliseconds between
/// the heads read that triggers a kill and the kill itself can apply
/// hundreds of records (2,000 in all was too short: CI saw a round apply the
/// whole stream before its kill landed).
const PER_TWIN: usize = 1500;
const N: u64 = (PARTITIONS as u64) * (TWINS_PER_PARTITION as u64) * (PER_TWIN as u64);
const KILLS: usize = 2;

/// The pause between two records of one twin while a segment is produced
/// in the background: a segment's rest takes at least
/// `PER_TWIN / (KILLS + 1) * PACE` (about 2 s), far longer than the poll
/// of the heads that triggers a kill.
const PACE: Duration = Duration::from_millis(4);

/// Segment `k` of each twin's records (indices), one per process.
fn segment(k: usize) -> std::ops::Range<usize> {
    let len = PER_TWIN / (KILLS + 1);
    let end = if k == KILLS { PER_TWIN } else { (k + 1) * len };
    k * len..end
}

/// Start publishing records `range` of every twin, each twin's in order (a
/// task a twin), with `pace` between two records of a twin; the future
/// returned waits for them all.
fn produce(
    p: &Arc<Publisher>,
    twins: &[String],
    tokens: &[u64],
    range: std::ops::Range<usize>,
    pace: Option<Duration>,
) -> impl std::future::Future<Output = Vec<Sent>> + Send + 'static {
    let mut tasks = Vec::new();
    for (twin, &token) in twins.iter().zip(tokens) {
        let (p, twin, range) = (p.clone(), twin.clone(), range.clone());
        tasks.push(tokio::spawn(async move {
            let mut sent = Vec::with_capacity(range.len());
            for i in range {
                sent.push(publish(&p, &twin, token, &id(&twin, i), json!({ "i": i })).await);
                if let Some(d) = pace {
                    tokio::time::sleep(d).await;
                }
            }
            sent
        }));
    }
    async move {
        let mut sent = Vec::new();
        for task in tasks {
            sent.extend(task.await.unwrap());
        }
        sent
    }
}

fn id(twin: &str, i: usize) -> String {
    format!("{twin}/{i:04}")
}

/// Open the folder without Kafka, check every twin's history is a prefix of
/// its produced sequence, and return how many records are applied.
async fn applied_so_far(data: &Path, twins: &[String], round: usize) -> u64 {
    let s = ServeProcess::start(data, &[]);
    let c = s.client();
    let mut total = 0;
    for twin in twins {
        let got = event_ids(&history(&c, twin).await);
        let want: Vec<String> = (0..got.len()).map(|i| id(twin, i)).collect();
        assert_eq!(
            got, want,
            "after kill {round}: {twin}'s history must be a prefix of its records, each once"
        );
        total += got.len() as u64;
    }
    assert_eq!(heads(&c).await.iter().sum::<u64>(), total);
    s.terminate();
    total
}

/// Poll the partition heads every 10 ms until they pass `above`.
async fn wait_progress(c: &Client, above: u64, round: usize) -> u64 {
    let start = Instant::now();
    loop {
        let n: u64 = heads(c).await.iter().sum();
        if n > above {
            return n;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "round {round}: no progress past {above} records in 60 s (at {n})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_twice_applies_every_record_exactly_once() {
    let t = TestTopic::new("restart");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let twins: Vec<String> = (0..PARTITIONS)
        .flat_map(|p| twins_in("crash", p, TWINS_PER_PARTITION))
        .collect();

    // Leases first (stored in the folder), then the whole stream.
    let mut tokens = Vec::new();
    {
        let s = ServeProcess::start(data, &["--partitions", &PARTITIONS.to_string()]);
        for twin in &twins {
            tokens.push(
                twin_token(&s.client(), twin, &format!("worker-{twin}"))
                    .await
                    .0,
            );
        }
        s.terminate();
    }
    // The stream is produced in KILLS + 1 segments, one per process, while
    // that process consumes: the first record of each twin's segment, then
    // (once the heads show everything produced so far applied: the consumer
    // is live and caught up) the rest, paced, in the background. The kill
    // follows the first progress past that, so it lands while records flow,
    // on any broker (tansu ignores fetch size limits: a pre-loaded stream
    // can be applied whole between two polls of the heads).
    let p = Arc::new(publisher(&t.topic));
    let mut sent: Vec<Sent> = Vec::new();
    let mut applied_before = 0;
    // Each process joins a consumer group of its own: the store resumes
    // from the offsets stored with its data, never the group's (a group
    // that started from the beginning would show as `already_applied`
    // below). In the killed process's group, tansu 0.6 at times gives the
    // restart no record for minutes (tests/kafka/README.md).
    let group = |n: usize| TestTopic {
        topic: t.topic.clone(),
        group: format!("{}-process-{n}", t.group),
    };
    for round in 1..=KILLS {
        let s = serve(data, &group(round), &[]);
        let seg = segment(round - 1);
        sent.extend(produce(&p, &twins, &tokens, seg.start..seg.start + 1, None).await);
        let produced = sent.len() as u64;
        wait_progress(&s.client(), produced - 1, round).await;
        let rest = produce(&p, &twins, &tokens, seg.start + 1..seg.end, Some(PACE));
        let at_kill = wait_progress(&s.client(), produced + 50, round).await;
        s.kill();
        sent.extend(rest.await);
        let produced = sent.len() as u64;
        // Reads come from the durable head (decision 0015): what the heads
        // showed before the kill was synced, so the kill cannot take it back.
        let now = applied_so_far(data, &twins, round).await;
        assert!(
            now >= at_kill,
            "round {round}: heads showed {at_kill} records before the kill, only {now} survived it"
        );
        assert!(
            now < produced,
            "round {round}: all {produced} records produced so far were applied before the kill (seen at {at_kill}); the kill must land mid-stream"
        );
        eprintln!(
            "restart test: kill {round} after {now} of {produced} produced ({N} in all) were applied"
        );
        applied_before = now;
    }

    // The last process gets the backlog and the last segment.
    let s = serve(data, &group(KILLS + 1), &[]);
    let c = s.client();
    let seg = segment(KILLS);
    sent.extend(produce(&p, &twins, &tokens, seg, None).await);
    assert_eq!(sent.len() as u64, N);
    crate::eventually(
        "every record applied after the restarts",
        Duration::from_secs(90),
        || async {
            let n: u64 = heads(&c).await.iter().sum();
            assert!(
                n <= N,
                "{n} events from {N} records: something was applied twice"
            );
            if n == N {
                Ok(())
            } else {
                Err(format!("{n} of {N}"))
            }
        },
    )
    .await;
    let o = crate::eventually(
        "the last records' outcomes to be counted",
        Duration::from_secs(30),
        || async {
            let o = outcomes(&c).await;
            if handled(&o) >= N - applied_before {
                Ok(o)
            } else {
                Err(format!("{o:?}"))
            }
        },
    )
    .await;
    eprintln!("restart test: the last process handled {o:?} ({applied_before} were applied before it started)");
    assert_eq!(
        o["applied"],
        N - applied_before,
        "the last process must apply exactly what the crashed ones did not: {o:?}"
    );
    assert_eq!(o["dropped_stale"] + o["dead_lettered"], 0, "{o:?}");
    // It resumes at the offsets stored with the data, so it re-reads nothing
    // (a redelivery would be skipped by the writer and counted here).
    assert_eq!(
        o["already_applied"], 0,
        "a restart must resume after the stored offsets, not re-read applied records: {o:?}"
    );

    // Exactly once, in order, per twin and per partition.
    for twin in &twins {
        let events = history(&c, twin).await;
        let want: Vec<String> = (0..PER_TWIN).map(|i| id(twin, i)).collect();
        assert_eq!(event_ids(&events), want, "history of {twin}");
        let view = c.twin(twin).await;
        assert_eq!(view.body["state"], json!({ "i": PER_TWIN - 1 }));
    }
    for part in 0..PARTITIONS {
        let events = partition_events(&c, part).await;
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        let mut want: Vec<&Sent> = sent.iter().filter(|s| s.partition == part).collect();
        want.sort_by_key(|s| s.offset);
        let want: Vec<String> = want.iter().map(|s| s.event_id.clone()).collect();
        assert_eq!(event_ids(&events), want, "partition {part} in offset order");
    }
    s.terminate();
}
