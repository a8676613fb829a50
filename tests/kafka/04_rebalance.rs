//! Rebalances with one store: `palisade serve` (A) and a second member of its
//! consumer group (a plain rdkafka consumer in this test, which takes
//! partitions away from A, reads their records and *commits* past them).
//! When the second member leaves, A regains the partitions and must resume
//! from the offsets stored with its data, not from the group's committed
//! offsets: every record is applied exactly once.
//!
//! Mock cluster rebalances take 10-20 s (docs/kafka-brokers.md): deadlines
//! here are generous.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use palisade_kafka::Publisher;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use serde_json::json;

use crate::broker::{broker, TestTopic, PARTITIONS};
use crate::support::Client;
use crate::{
    event_ids, eventually, heads, history, outcomes, partition_events, publish, publisher, serve,
    twin_token, twins_in, Sent,
};

const DEADLINE: Duration = Duration::from_secs(90);

#[derive(Debug, Default)]
struct MemberView {
    assigned: Vec<u32>,
    /// Offsets received, per partition.
    received: BTreeMap<u32, BTreeSet<u64>>,
}

/// The second group member: joins, holds what it is assigned, reads and
/// commits (synchronously) every record it gets, applies nothing.
struct OtherMember {
    stop: Arc<AtomicBool>,
    view: Arc<Mutex<MemberView>>,
    thread: Option<JoinHandle<()>>,
}

impl OtherMember {
    fn join(t: &TestTopic) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let view = Arc::new(Mutex::new(MemberView::default()));
        let (topic, group) = (t.topic.clone(), t.group.clone());
        let thread = {
            let (stop, view) = (stop.clone(), view.clone());
            std::thread::spawn(move || {
                let c = broker().consumer(&group, &[("enable.auto.commit", "true")]);
                c.subscribe(&[&topic]).unwrap();
                while !stop.load(Ordering::SeqCst) {
                    if let Some(m) = c.poll(Duration::from_millis(100)) {
                        match m {
                            Ok(m) => {
                                let (p, o) = (m.partition(), m.offset());
                                c.commit_message(&m, CommitMode::Sync)
                                    .unwrap_or_else(|e| panic!("commit {p}/{o}: {e}"));
                                view.lock()
                                    .unwrap()
                                    .received
                                    .entry(u32::try_from(p).unwrap())
                                    .or_default()
                                    .insert(u64::try_from(o).unwrap());
                            }
                            Err(e) => eprintln!("rebalance test: the other member: {e}"),
                        }
                    }
                    if let Ok(a) = c.assignment() {
                        view.lock().unwrap().assigned = a
                            .elements_for_topic(&topic)
                            .iter()
                            .map(|e| u32::try_from(e.partition()).unwrap())
                            .collect();
                    }
                }
                c.unsubscribe();
                // Dropping the consumer closes it: it leaves the group.
                drop(c);
            })
        };
        Self {
            stop,
            view,
            thread: Some(thread),
        }
    }

    /// Wait until the group gave this member some partitions (A lost them).
    async fn wait_assigned(&self) -> Vec<u32> {
        eventually(
            "the second member to be assigned partitions",
            DEADLINE,
            || async {
                let v = self.view.lock().unwrap();
                if v.assigned.is_empty() {
                    Err("nothing assigned yet".to_owned())
                } else {
                    Ok(v.assigned.clone())
                }
            },
        )
        .await
    }

    /// Close the consumer (it leaves the group) and wait for it.
    fn leave(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("the second member panicked");
        }
    }
}

impl Drop for OtherMember {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

async fn partition_heads(c: &Client) -> Vec<u64> {
    heads(c).await
}

fn count_by_partition(sent: &[Sent]) -> Vec<u64> {
    let mut n = vec![0; PARTITIONS as usize];
    for s in sent {
        n[s.partition as usize] += 1;
    }
    n
}

async fn publish_round(p: &Publisher, twins: &[(String, u64)], round: &str, k: usize) -> Vec<Sent> {
    let mut out = Vec::new();
    for i in 0..k {
        for (twin, token) in twins {
            let id = format!("{twin}/{round}-{i:03}");
            out.push(publish(p, twin, *token, &id, json!({ "round": round, "i": i })).await);
        }
    }
    out
}

/// Every produced record exactly once: per twin in produce order, per
/// partition in offset order, gapless sequence numbers.
async fn assert_exactly_once(c: &Client, sent: &[Sent], twins: &[(String, u64)]) {
    for (twin, _) in twins {
        let want: Vec<String> = sent
            .iter()
            .filter(|s| &s.twin == twin)
            .map(|s| s.event_id.clone())
            .collect();
        assert_eq!(
            event_ids(&history(c, twin).await),
            want,
            "history of {twin}"
        );
    }
    for part in 0..PARTITIONS {
        let events = partition_events(c, part).await;
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        let mut want: Vec<&Sent> = sent.iter().filter(|s| s.partition == part).collect();
        want.sort_by_key(|s| s.offset);
        let want: Vec<String> = want.iter().map(|s| s.event_id.clone()).collect();
        assert_eq!(event_ids(&events), want, "partition {part}");
    }
}

/// Wait until the group's committed offsets are `want` (auto-commit runs
/// every 5 s). Asked with OffsetFetch by a client that does not join.
async fn wait_committed(t: &TestTopic, want: &[u64]) {
    let (topic, group) = (t.topic.clone(), t.group.clone());
    let probe = broker().consumer(&group, &[("enable.auto.commit", "false")]);
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(&topic, i32::try_from(p).unwrap());
    }
    eventually("the group's committed offsets", DEADLINE, || async {
        let got: Vec<Option<u64>> = probe
            .committed_offsets(tpl.clone(), Duration::from_secs(10))
            .map_err(|e| e.to_string())?
            .elements_for_topic(&topic)
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => u64::try_from(o).ok(),
                _ => None,
            })
            .collect();
        let want: Vec<Option<u64>> = want.iter().map(|w| Some(*w)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.is_none() || g <= w,
                "committed offsets {got:?} are past the records applied {want:?}"
            );
        }
        if got == want {
            Ok(())
        } else {
            Err(format!("committed {got:?}, want {want:?}"))
        }
    })
    .await;
}

async fn wait_heads(c: &Client, want: &[u64], what: &str) {
    eventually(what, DEADLINE, || async {
        let h = partition_heads(c).await;
        for (got, want) in h.iter().zip(want) {
            assert!(
                got <= want,
                "heads {h:?} passed {want:?}: a record applied twice"
            );
        }
        if h == want {
            Ok(())
        } else {
            Err(format!("heads {h:?}, want {want:?}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_taken_by_another_member_are_applied_after_the_store_regains_them() {
    let t = TestTopic::new("rebalance");
    let dir = tempfile::tempdir().unwrap();
    let a = serve(dir.path(), &t, &[]);
    let c = a.client();
    let mut twins = Vec::new();
    for twin in (0..PARTITIONS).flat_map(|p| twins_in("rb", p, 2)) {
        let token = twin_token(&c, &twin, "worker").await.0;
        twins.push((twin, token));
    }
    let p = publisher(&t.topic);

    // Phase 1: A alone holds every partition and applies everything.
    let mut sent = publish_round(&p, &twins, "one", 10).await;
    wait_heads(&c, &count_by_partition(&sent), "phase 1 applied by A alone").await;
    // A also commits to the group (for lag tooling): the committed offset of
    // each partition is the next record to apply, i.e. its record count.
    wait_committed(&t, &count_by_partition(&sent)).await;

    // A second member joins: A loses some partitions.
    let other = OtherMember::join(&t);
    let taken = other.wait_assigned().await;
    assert!(
        taken.len() < PARTITIONS as usize,
        "the second member took every partition: {taken:?}"
    );
    eprintln!("rebalance test: the second member holds partitions {taken:?}");
    let before = partition_heads(&c).await;

    // Phase 2, produced while the other member holds `taken`: it reads and
    // commits those records; A applies only its own partitions'.
    let phase2 = publish_round(&p, &twins, "two", 10).await;
    let mut want_taken: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for s in phase2.iter().filter(|s| taken.contains(&s.partition)) {
        want_taken.entry(s.partition).or_default().insert(s.offset);
    }
    eventually(
        "the second member to read and commit its partitions' records",
        DEADLINE,
        || async {
            let v = other.view.lock().unwrap();
            let missing: Vec<(u32, Vec<u64>)> = want_taken
                .iter()
                .map(|(p, offs)| {
                    let got = v.received.get(p).cloned().unwrap_or_default();
                    (*p, offs.difference(&got).copied().collect::<Vec<_>>())
                })
                .filter(|(_, m)| !m.is_empty())
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "missing (partition, offsets): {missing:?}; received {:?}",
                    v.received
                ))
            }
        },
    )
    .await;
    sent.extend(phase2);
    let mut want = count_by_partition(&sent);
    for p in &taken {
        want[*p as usize] = before[*p as usize];
    }
    wait_heads(&c, &want, "A to apply its own partitions' phase 2").await;
    let h = partition_heads(&c).await;
    for p in &taken {
        assert_eq!(
            h[*p as usize], before[*p as usize],
            "A applied records of partition {p} while another member held it"
        );
    }

    // The other member leaves: A regains everything and catches up from the
    // offsets in its store (the group's committed offsets are past phase 2).
    other.leave();
    wait_heads(
        &c,
        &count_by_partition(&sent),
        "A to regain the partitions and apply what the other member had read",
    )
    .await;

    // Phase 3: business as usual.
    sent.extend(publish_round(&p, &twins, "three", 3).await);
    wait_heads(&c, &count_by_partition(&sent), "phase 3").await;
    assert_exactly_once(&c, &sent, &twins).await;
    let o = outcomes(&c).await;
    eprintln!("rebalance test: outcomes {o:?}");
    assert_eq!(o["applied"], sent.len() as u64, "{o:?}");
    assert_eq!(o["dropped_stale"] + o["dead_lettered"], 0, "{o:?}");
    // Nothing was in flight at either rebalance (each phase was applied
    // before the next step), so resuming from the stored offsets re-reads
    // nothing. Resuming from the beginning would re-read phase 1.
    assert_eq!(o["already_applied"], 0, "{o:?}");
    a.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalances_while_records_stream_in_apply_each_exactly_once() {
    let t = TestTopic::new("rebalance-stream");
    let dir = tempfile::tempdir().unwrap();
    let a = serve(dir.path(), &t, &[]);
    let c = a.client();
    let mut twins = Vec::new();
    for twin in (0..PARTITIONS).flat_map(|p| twins_in("rs", p, 2)) {
        let token = twin_token(&c, &twin, "worker").await.0;
        twins.push((twin, token));
    }
    let p = Arc::new(publisher(&t.topic));

    // One producer per twin, a record every ~10 ms, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let mut producers = Vec::new();
    for (twin, token) in twins.clone() {
        let (p, stop) = (p.clone(), stop.clone());
        producers.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let id = format!("{twin}/{i:05}");
                sent.push(publish(&p, &twin, token, &id, json!({ "i": i })).await);
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            sent
        }));
    }
    // A is consuming the stream...
    eventually("A to apply records", DEADLINE, || async {
        let n: u64 = partition_heads(&c).await.iter().sum();
        if n > 50 {
            Ok(())
        } else {
            Err(format!("{n} applied"))
        }
    })
    .await;
    // ...when a second member joins and later leaves, mid-stream.
    let other = OtherMember::join(&t);
    let taken = other.wait_assigned().await;
    eprintln!("rebalance stream test: the second member holds {taken:?}");
    let held = partition_heads(&c).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    other.leave();
    eventually(
        "A to apply records of the regained partitions again",
        DEADLINE,
        || async {
            let h = partition_heads(&c).await;
            if taken
                .iter()
                .all(|p| h[*p as usize] > held[*p as usize] + 20)
            {
                Ok(())
            } else {
                Err(format!(
                    "heads {h:?}, when the other member held {taken:?}: {held:?}"
                ))
            }
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut sent: Vec<Sent> = Vec::new();
    for task in producers {
        sent.extend(task.await.unwrap());
    }
    wait_heads(&c, &count_by_partition(&sent), "every streamed record").await;
    assert_exactly_once(&c, &sent, &twins).await;
    let o = outcomes(&c).await;
    eprintln!(
        "rebalance stream test: {} records, outcomes {o:?}",
        sent.len()
    );
    // Records in flight at a rebalance may be read again (already_applied);
    // each is applied once.
    assert_eq!(o["applied"], sent.len() as u64, "{o:?}");
    assert_eq!(o["dropped_stale"] + o["dead_lettered"], 0, "{o:?}");
    a.terminate();
}
