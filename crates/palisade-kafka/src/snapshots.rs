//! Cluster mode's side of partition snapshots (decision 0038;
//! `palisade_log::handoff` writes and loads them): the owner of a
//! partition writes one every `SnapshotSettings::every` into the shared
//! folder; a node assigned a partition whose newest snapshot is ahead of
//! its own copy loads it (`cluster.rs` pauses the partition meanwhile) and
//! resumes after the snapshot's offset.

use std::sync::Arc;

use palisade_log::handoff::SnapshotError;
use palisade_log::{Source, Store};
use tracing::{info, warn};

use crate::cluster::{Admission, Load, Ownership, Waiting};
use crate::SnapshotSettings;

/// Write a snapshot of every partition this node owns (and is not
/// loading), every `settings.every`, for as long as the consumer runs. A
/// partition that did not move on since its newest snapshot is skipped.
pub(crate) async fn write_loop(
    store: Arc<Store>,
    topic: String,
    settings: SnapshotSettings,
    ownership: Arc<dyn Ownership>,
    waiting: Waiting,
    turn: Arc<tokio::sync::Mutex<()>>,
) {
    let mut tick = tokio::time::interval(settings.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the first snapshot waits one interval.
    tick.tick().await;
    loop {
        tick.tick().await;
        for p in 0..store.partitions() {
            let loading = waiting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains_key(&p);
            if loading || !matches!(ownership.admitted(p), Some(Admission::Owned(_))) {
                continue;
            }
            let _turn = turn.lock().await;
            let (s, t, dir) = (store.clone(), topic.clone(), settings.dir.clone());
            match tokio::task::spawn_blocking(move || s.write_partition_snapshot(p, &t, &dir)).await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    store.metrics().add(
                        "palisade_partition_snapshot_failures_total",
                        "Partition snapshots that could not be written (retried at the next interval).",
                        &[],
                        1,
                    );
                    warn!(partition = p, error = %e, "cluster: partition snapshot not written");
                }
                Err(e) => {
                    warn!(partition = p, error = %e, "cluster: partition snapshot task failed")
                }
            }
        }
    }
}

/// Load `load`'s snapshot unless this node's copy of the partition already
/// reached its offset (a load of the same snapshot before a quick revoke
/// and reassignment).
pub(crate) async fn load(
    store: &Arc<Store>,
    topic: &str,
    load: &Load,
) -> Result<(), SnapshotError> {
    let local = store
        .source_offset(&Source::new(topic, load.partition))
        .ok()
        .flatten();
    if local.is_some_and(|l| l >= load.offset) {
        return Ok(());
    }
    let s = store.load_partition_snapshot(&load.path, topic).await?;
    info!(
        partition = load.partition,
        offset = s.info.offset,
        head = s.info.head,
        records = s.records,
        took_ms = s.took.as_millis() as u64,
        "cluster: partition snapshot loaded; replaying only the log after it"
    );
    Ok(())
}
