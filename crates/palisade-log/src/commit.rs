//! The committer: one group commit for the whole store.
//!
//! The sequencer (`writer.rs`) decides every request in order and closes
//! *rounds*: the ops a batch of requests produced, with their replies. Two
//! threads carry a round out:
//!
//! 1. **sync** takes every round queued (up to a cap), appends them to the
//!    write-ahead log in one write and makes them durable with ONE
//!    `fdatasync` of the log segment, whatever the number of partitions
//!    they touch (`wal.rs`). The sequencer stages the next rounds meanwhile.
//! 2. **apply** applies each synced round to sled (plain inserts and
//!    removes; sled holds only what is durable), publishes the twin records
//!    it wrote to the read cache and each partition's new head, and only
//!    then sends the round's replies. Reads therefore never see what a crash
//!    could take back, and a client that got its reply reads its own write.
//!    The sled inserts of a group of rounds are split by tree over one
//!    *lane* per core (at most four; [`Lanes`]): each tree is written by one
//!    lane, in round order, and the group's replies go out once every lane
//!    is done.
//!
//! A third thread, **checkpoint**, makes sled itself durable from time to
//! time (sled's flush, then `fsync` of each of its files) and deletes the
//! log segments that covers. Nothing acknowledged depends on a checkpoint
//! (the log holds it), so a failed one is reported and retried, not fatal;
//! if sled itself can no longer write, the next apply fails and that is.
//!
//! **Fail-stop.** The first storage error on the path of an acknowledgement
//! (a log write or sync, a sled write) stops the store from acknowledging
//! anything more:
//! the failure is recorded once ([`Health`]), every reply not yet sent and
//! every later request gets [`StorageFailure`] (HTTP 503), and nothing is
//! rolled back in memory (after a failed `fsync` nobody knows what reached
//! the disk; PostgreSQL stops for the same reason). Reads keep working from
//! what was applied. A restart recovers from the log.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use palisade_core::{PartitionId, TwinId};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::cache::ReadCache;
use crate::records::TwinRecord;
use crate::wal::{self, decode_ops, encode_record, Op, Ops, TreeId, Wal};
use crate::Metrics;

/// Most log bytes written and synced in one go: past this the rest waits for
/// the next sync, so one huge round does not hold every later one's reply.
const MAX_SYNC_BYTES: usize = 8 << 20;

/// A storage failure that stopped the store (fail-stop).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the store stopped accepting writes after a storage failure ({op}: {detail}); nothing after it was acknowledged; restart the store once the cause is fixed (it recovers from its write-ahead log)")]
pub struct StorageFailure {
    /// What failed: `wal write`, `wal sync`, `sled apply`, `checkpoint`, ...
    pub op: &'static str,
    /// The OS error kind, for callers that branch (disk full, ...).
    pub kind: std::io::ErrorKind,
    /// The error as the OS or sled reported it.
    pub detail: String,
    /// When (ms since 1970).
    pub at_ms: u64,
}

impl StorageFailure {
    pub(crate) fn new(op: &'static str, kind: std::io::ErrorKind, detail: String) -> Self {
        Self {
            op,
            kind,
            detail,
            at_ms: crate::ingest::now_ms(),
        }
    }

    fn io(op: &'static str, e: &std::io::Error) -> Self {
        Self::new(op, e.kind(), e.to_string())
    }

    fn wal(op: &'static str, e: &wal::WalError) -> Self {
        let kind = match e {
            wal::WalError::Io { source, .. } => source.kind(),
            _ => std::io::ErrorKind::InvalidData,
        };
        Self::new(op, kind, e.to_string())
    }

    fn sled(op: &'static str, e: &sled::Error) -> Self {
        let kind = match e {
            sled::Error::Io(io) => io.kind(),
            _ => std::io::ErrorKind::Other,
        };
        Self::new(op, kind, e.to_string())
    }
}

/// Whether the store may still acknowledge writes.
#[derive(Debug, Default)]
pub(crate) struct Health {
    failure: OnceLock<StorageFailure>,
}

impl Health {
    pub fn failure(&self) -> Option<&StorageFailure> {
        self.failure.get()
    }

    /// Record the first failure (later ones are consequences) and say so.
    pub fn fail(&self, f: StorageFailure, metrics: &Metrics) -> StorageFailure {
        if self.failure.set(f.clone()).is_ok() {
            error!(op = f.op, error = %f.detail, "storage failure: the store accepts no more writes until it is restarted");
            metrics.set_gauge(
                "palisade_storage_failed",
                "1 once a storage failure stopped the store from acknowledging writes (fail-stop; restart to recover).",
                &[("op", f.op)],
                1.0,
            );
        }
        self.failure.get().cloned().unwrap_or(f)
    }
}

/// Test hooks into the commit path (fault injection). `None` in production.
pub trait CommitHooks: Send + Sync + std::fmt::Debug {
    /// Called before each log sync with the rounds it will make durable. A
    /// hook may block (to hold a round un-synced while a test reads) or fail
    /// (an injected storage error, handled exactly like a failed `fdatasync`).
    fn before_sync(&self, rounds: std::ops::RangeInclusive<u64>) -> std::io::Result<()>;
}

/// One reply, sent after its round is durable and applied (`Ok`) or when
/// the store failed before that (`Err`).
pub(crate) type Ack = Box<dyn FnOnce(Result<(), &StorageFailure>) + Send>;

/// A closed commit round.
pub(crate) struct Round {
    pub no: u64,
    pub ops: Ops,
    pub acks: Vec<Ack>,
    /// Twin records to publish to the read cache once applied.
    pub publish: Vec<(PartitionId, TwinId, Arc<TwinRecord>)>,
    /// Partition heads to publish once applied.
    pub heads: Vec<(PartitionId, u64)>,
    /// Requests the round answers (for metrics).
    pub requests: usize,
}

impl Round {
    fn fail(self, f: &StorageFailure) {
        for a in self.acks {
            a(Err(f));
        }
    }
}

pub(crate) enum ToSync {
    Round(Round),
    Stop,
}

enum ToApply {
    Rounds(Vec<Round>),
    Stop,
}

/// The sled trees ops name, by [`TreeId`].
#[derive(Debug, Clone)]
pub(crate) struct Trees {
    pub partitions: Vec<sled::Tree>,
    pub meta: sled::Tree,
    pub leases: sled::Tree,
    pub audit: sled::Tree,
    pub token_owners: sled::Tree,
    pub cluster: sled::Tree,
    pub ingest: sled::Tree,
    /// The refusal journal (layout 4, `refusals.rs`).
    pub refusals: sled::Tree,
    /// The fenced outbox (layout 5, `outbox.rs`).
    pub outbox: sled::Tree,
}

impl Trees {
    pub(crate) fn by_id(&self, id: TreeId) -> Option<&sled::Tree> {
        match id {
            TreeId::META => Some(&self.meta),
            TreeId::LEASES => Some(&self.leases),
            TreeId::AUDIT => Some(&self.audit),
            TreeId::TOKEN_OWNERS => Some(&self.token_owners),
            TreeId::CLUSTER => Some(&self.cluster),
            TreeId::INGEST => Some(&self.ingest),
            TreeId::REFUSALS => Some(&self.refusals),
            TreeId::OUTBOX => Some(&self.outbox),
            TreeId(p) => self.partitions.get(p as usize),
        }
    }

    /// Apply one round's payload, in order.
    pub fn apply(&self, payload: &[u8]) -> Result<(), StorageFailure> {
        self.apply_lane(payload, Lane::ALL)
    }

    /// Apply the ops of one round's payload that write the trees of `lane`,
    /// in order (ops on other trees are skipped: another lane applies them).
    fn apply_lane(&self, payload: &[u8], lane: Lane) -> Result<(), StorageFailure> {
        for op in decode_ops(payload) {
            let op = op.map_err(|e| {
                StorageFailure::new("sled apply", std::io::ErrorKind::InvalidData, e.to_string())
            })?;
            let tree = match op {
                Op::Put { tree, .. } | Op::Remove { tree, .. } => tree,
            };
            if !lane.owns(tree) {
                continue;
            }
            let (tree, r) = match op {
                Op::Put { tree, key, value } => {
                    (tree, self.tree(tree)?.insert(key, value).map(drop))
                }
                Op::Remove { tree, key } => (tree, self.tree(tree)?.remove(key).map(drop)),
            };
            r.map_err(|e| {
                let mut f = StorageFailure::sled("sled apply", &e);
                f.detail = format!("tree {:#x}: {}", tree.0, f.detail);
                f
            })?;
        }
        Ok(())
    }

    fn tree(&self, id: TreeId) -> Result<&sled::Tree, StorageFailure> {
        self.by_id(id).ok_or_else(|| {
            StorageFailure::new(
                "sled apply",
                std::io::ErrorKind::InvalidData,
                format!(
                    "an op names tree {:#x}, which this store does not have",
                    id.0
                ),
            )
        })
    }
}

/// Which trees an apply lane writes: partition trees are spread over the
/// lanes by partition number, every other tree (meta, leases, audit, token
/// owners, cluster) belongs to lane 0. One tree is only ever written by one
/// lane, so each tree still sees its ops in round order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lane {
    index: usize,
    of: usize,
}

impl Lane {
    /// One lane that writes every tree (recovery, a single-core machine).
    const ALL: Lane = Lane { index: 0, of: 1 };

    fn owns(self, tree: TreeId) -> bool {
        if self.of <= 1 {
            return true;
        }
        let lane = if tree.0 >= TreeId::META.0 {
            0
        } else {
            tree.0 as usize % self.of
        };
        lane == self.index
    }
}

/// Most op bytes applied between two acknowledgements: a group of rounds up
/// to this size is applied across the lanes, then its replies go out, so an
/// 8 MiB sync does not hold its first round's reply until all of it is
/// applied.
const APPLY_GROUP_BYTES: usize = 256 << 10;

/// Groups smaller than this are applied by the apply thread alone: waking
/// the other lanes costs more than they save on a few small rounds (with
/// lanes for every group, single-event appends at 64 connections took 30%
/// more server CPU per request; Kafka ingest, whose rounds are hundreds of
/// KiB, gained 25-45%).
const LANES_MIN_BYTES: usize = 64 << 10;

/// Work for one helper lane: the payloads of a group of rounds.
struct LaneJob {
    payloads: Arc<Vec<Ops>>,
    done: mpsc::Sender<Result<(), StorageFailure>>,
}

/// The apply lanes beyond lane 0 (which the apply thread runs itself).
///
/// sled inserts are most of the apply thread's time (a profile of Kafka
/// ingest showed the apply thread alone at one full core, the other core
/// idle), and sled takes concurrent inserts into different trees; so a
/// group's ops are split by tree over `lanes` threads and applied at once.
struct Lanes {
    helpers: Vec<mpsc::Sender<LaneJob>>,
}

impl Lanes {
    /// Start `count - 1` helper threads (lane 0 is the caller's).
    fn start(count: usize, trees: &Trees) -> std::io::Result<(Self, Vec<JoinHandle<()>>)> {
        let mut helpers = Vec::new();
        let mut handles = Vec::new();
        for index in 1..count.max(1) {
            let (tx, rx) = mpsc::channel::<LaneJob>();
            let trees = trees.clone();
            let lane = Lane { index, of: count };
            handles.push(
                std::thread::Builder::new()
                    .name(format!("palisade-apply-{index}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            let r = job
                                .payloads
                                .iter()
                                .try_for_each(|ops| trees.apply_lane(ops.payload(), lane));
                            // Let go of the payloads before saying done, so
                            // the apply thread gets them back whole.
                            drop(job.payloads);
                            let _ = job.done.send(r);
                        }
                    })?,
            );
            helpers.push(tx);
        }
        Ok((Self { helpers }, handles))
    }

    /// Apply every payload, in order per tree, across the lanes; the first
    /// failure of any lane is returned once every lane has finished.
    fn apply(&self, trees: &Trees, payloads: Vec<Ops>) -> Result<(), StorageFailure> {
        let bytes: usize = payloads.iter().map(Ops::bytes).sum();
        if self.helpers.is_empty() || bytes < LANES_MIN_BYTES {
            return payloads
                .iter()
                .try_for_each(|ops| trees.apply(ops.payload()));
        }
        self.apply_split(trees, payloads)
    }

    /// Apply across every lane, whatever the size.
    fn apply_split(&self, trees: &Trees, payloads: Vec<Ops>) -> Result<(), StorageFailure> {
        let lanes = self.helpers.len() + 1;
        let payloads = Arc::new(payloads);
        let (done_tx, done_rx) = mpsc::channel();
        let mut sent = 0;
        for tx in &self.helpers {
            let job = LaneJob {
                payloads: payloads.clone(),
                done: done_tx.clone(),
            };
            if tx.send(job).is_ok() {
                sent += 1;
            }
        }
        let own = Lane {
            index: 0,
            of: lanes,
        };
        let mut result = payloads
            .iter()
            .try_for_each(|ops| trees.apply_lane(ops.payload(), own));
        for _ in 0..sent {
            let r = done_rx.recv().unwrap_or_else(|_| {
                Err(StorageFailure::new(
                    "sled apply",
                    std::io::ErrorKind::BrokenPipe,
                    "an apply lane stopped".into(),
                ))
            });
            result = result.and(r);
        }
        if sent < self.helpers.len() {
            result = result.and(Err(StorageFailure::new(
                "sled apply",
                std::io::ErrorKind::BrokenPipe,
                "an apply lane is gone".into(),
            )));
        }
        result
    }
}

/// How many apply lanes: one per core, at most four (sled's inserts share
/// its log reservation and epoch GC; past a few threads they contend).
fn lane_count() -> usize {
    std::thread::available_parallelism()
        .map(std::num::NonZeroUsize::get)
        .unwrap_or(1)
        .clamp(1, 4)
}

/// What the commit threads share with the store.
#[derive(Debug)]
pub(crate) struct CommitShared {
    pub health: Arc<Health>,
    pub metrics: Arc<Metrics>,
    /// The last round applied to sled (and so durable and visible).
    pub applied: AtomicU64,
    pub cache: Arc<ReadCache>,
}

/// The running commit threads.
#[derive(Debug)]
pub(crate) struct Committer {
    sync: Option<JoinHandle<()>>,
    apply: Option<JoinHandle<()>>,
    /// The apply lanes' helper threads (they stop when the apply thread,
    /// which holds their queues, has).
    lanes: Vec<JoinHandle<()>>,
    checkpoint: Option<JoinHandle<()>>,
    checkpointer: Arc<Checkpointer>,
}

/// Settings of the commit path.
#[derive(Debug, Clone)]
pub(crate) struct CommitConfig {
    pub checkpoint_every: Duration,
    /// Log bytes after which a checkpoint is due before `checkpoint_every`.
    pub checkpoint_bytes: u64,
    pub hooks: Option<Arc<dyn CommitHooks>>,
}

impl Committer {
    /// Start the threads. `heads` are the partitions' durable-head senders.
    pub fn start(
        wal: Wal,
        db: sled::Db,
        data_dir: PathBuf,
        trees: Trees,
        shared: Arc<CommitShared>,
        heads: Vec<watch::Sender<u64>>,
        config: CommitConfig,
    ) -> std::io::Result<(Self, mpsc::Sender<ToSync>)> {
        let wal = Arc::new(Mutex::new(wal));
        let checkpointer = Arc::new(Checkpointer {
            db,
            data_dir,
            wal: wal.clone(),
            shared: shared.clone(),
            state: Mutex::new(CheckpointState::default()),
            wake: Condvar::new(),
            synced_files: Mutex::new(HashSet::new()),
            bytes_since: AtomicU64::new(0),
            bytes_due: config.checkpoint_bytes,
            every: config.checkpoint_every,
        });
        let (sync_tx, sync_rx) = mpsc::channel();
        let (apply_tx, apply_rx) = mpsc::channel();
        let sync = {
            let (shared, cp, hooks) = (shared.clone(), checkpointer.clone(), config.hooks.clone());
            std::thread::Builder::new()
                .name("palisade-sync".into())
                .spawn(move || {
                    sync_loop(&sync_rx, &apply_tx, &wal, &shared, &cp, hooks.as_deref())
                })?
        };
        let (lanes, lane_handles) = Lanes::start(lane_count(), &trees)?;
        let apply = {
            let (shared, cp) = (shared.clone(), checkpointer.clone());
            std::thread::Builder::new()
                .name("palisade-apply".into())
                .spawn(move || apply_loop(&apply_rx, &trees, &lanes, &shared, &heads, &cp))?
        };
        let checkpoint = {
            let cp = checkpointer.clone();
            std::thread::Builder::new()
                .name("palisade-checkpoint".into())
                .spawn(move || cp.run())?
        };
        Ok((
            Self {
                sync: Some(sync),
                apply: Some(apply),
                lanes: lane_handles,
                checkpoint: Some(checkpoint),
                checkpointer,
            },
            sync_tx,
        ))
    }

    /// The checkpointer (a partition snapshot's load takes one itself,
    /// `handoff.rs`).
    pub fn checkpointer(&self) -> Arc<Checkpointer> {
        self.checkpointer.clone()
    }

    /// Wait for the sync and apply threads to finish (after the sequencer
    /// sent `Stop`), then take a last checkpoint unless the store failed, so
    /// the next open has no log to replay. Blocking.
    pub fn finish(&mut self) {
        for h in [self.sync.take(), self.apply.take()].into_iter().flatten() {
            let _ = h.join();
        }
        for h in self.lanes.drain(..) {
            let _ = h.join();
        }
        self.checkpointer.stop();
        if let Some(h) = self.checkpoint.take() {
            let _ = h.join();
        }
        if self.checkpointer.shared.health.failure().is_none() {
            let r = self.checkpointer.checkpoint().and_then(|()| {
                self.checkpointer
                    .wal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove_all()
                    .map_err(|e| StorageFailure::wal("checkpoint", &e))
            });
            if let Err(f) = r {
                warn!(error = %f, "final checkpoint failed; the next open replays the log");
            }
        }
    }
}

fn sync_loop(
    rx: &mpsc::Receiver<ToSync>,
    apply: &mpsc::Sender<ToApply>,
    wal: &Mutex<Wal>,
    shared: &CommitShared,
    cp: &Checkpointer,
    hooks: Option<&dyn CommitHooks>,
) {
    let mut buf = Vec::new();
    let mut carry: Option<ToSync> = None;
    loop {
        let first = match carry.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
            },
        };
        let mut rounds = Vec::new();
        let mut bytes = 0;
        let mut stop = false;
        let mut next = Some(first);
        while let Some(m) = next.take() {
            match m {
                ToSync::Stop => stop = true,
                ToSync::Round(r) => {
                    bytes += r.ops.bytes();
                    rounds.push(r);
                }
            }
            if stop {
                break;
            }
            match rx.try_recv() {
                Ok(m) if bytes < MAX_SYNC_BYTES => next = Some(m),
                Ok(m) => carry = Some(m),
                Err(_) => {}
            }
        }
        if !rounds.is_empty() {
            match sync_rounds(&rounds, &mut buf, wal, shared, hooks) {
                Ok(()) => {
                    cp.wrote(buf.len() as u64);
                    let _ = apply.send(ToApply::Rounds(rounds));
                }
                Err(f) => {
                    let f = shared.health.fail(f, &shared.metrics);
                    for r in rounds {
                        r.fail(&f);
                    }
                }
            }
        }
        if stop {
            break;
        }
    }
    let _ = apply.send(ToApply::Stop);
}

/// Append `rounds` to the log and sync it once.
fn sync_rounds(
    rounds: &[Round],
    buf: &mut Vec<u8>,
    wal: &Mutex<Wal>,
    shared: &CommitShared,
    hooks: Option<&dyn CommitHooks>,
) -> Result<(), StorageFailure> {
    if let Some(f) = shared.health.failure() {
        return Err(f.clone());
    }
    let (Some(first), Some(last)) = (rounds.first(), rounds.last()) else {
        return Ok(());
    };
    buf.clear();
    for r in rounds {
        encode_record(r.no, r.ops.payload(), buf);
    }
    let started = Instant::now();
    let file = {
        let mut wal = wal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Rounds are numbered by the sequencer; the log must get them with
        // no gap, or recovery would stop at the gap and lose what follows.
        if wal.next_round() != first.no {
            return Err(StorageFailure::new(
                "wal write",
                std::io::ErrorKind::InvalidData,
                format!(
                    "round {} handed to the log, which expects round {} (a bug)",
                    first.no,
                    wal.next_round()
                ),
            ));
        }
        wal.append(buf, rounds.len() as u64)
            .map_err(|e| StorageFailure::wal("wal write", &e))?
    };
    if let Some(h) = hooks {
        h.before_sync(first.no..=last.no)
            .map_err(|e| StorageFailure::io("wal sync", &e))?;
    }
    file.sync_data()
        .map_err(|e| StorageFailure::io("wal sync", &e))?;
    let requests = rounds.iter().map(|r| r.requests).sum();
    shared.metrics.flushed(started.elapsed(), requests);
    Ok(())
}

fn apply_loop(
    rx: &mpsc::Receiver<ToApply>,
    trees: &Trees,
    lanes: &Lanes,
    shared: &CommitShared,
    heads: &[watch::Sender<u64>],
    cp: &Checkpointer,
) {
    while let Ok(ToApply::Rounds(rounds)) = rx.recv() {
        let mut rounds = rounds.into_iter().peekable();
        while rounds.peek().is_some() {
            // The next group: rounds up to APPLY_GROUP_BYTES (at least one).
            let mut group = Vec::new();
            let mut bytes = 0;
            while let Some(r) = rounds.next_if(|_| group.is_empty() || bytes < APPLY_GROUP_BYTES) {
                bytes += r.ops.bytes();
                group.push(r);
            }
            apply_group(group, trees, lanes, shared, heads);
        }
        cp.maybe_due();
    }
}

/// Apply a group of synced rounds to sled, then publish what they wrote
/// and send their replies (or fail them all: after a failed apply nobody
/// knows which of the group's ops reached sled; the log has them all, and a
/// restart applies them again).
fn apply_group(
    mut group: Vec<Round>,
    trees: &Trees,
    lanes: &Lanes,
    shared: &CommitShared,
    heads: &[watch::Sender<u64>],
) {
    if let Some(f) = shared.health.failure() {
        for r in group {
            r.fail(f);
        }
        return;
    }
    let payloads = group
        .iter_mut()
        .map(|r| std::mem::take(&mut r.ops))
        .collect();
    if let Err(f) = lanes.apply(trees, payloads) {
        let f = shared.health.fail(f, &shared.metrics);
        for r in group {
            r.fail(&f);
        }
        return;
    }
    for r in group {
        for (p, twin, rec) in r.publish {
            shared.cache.put(p, twin, rec);
        }
        for (p, head) in r.heads {
            if let Some(h) = heads.get(p.0 as usize) {
                h.send_if_modified(|cur| {
                    let changed = *cur != head;
                    *cur = head;
                    changed
                });
            }
        }
        shared.applied.store(r.no, Ordering::Release);
        for a in r.acks {
            a(Ok(()));
        }
    }
}

#[derive(Debug, Default)]
struct CheckpointState {
    stop: bool,
    due: bool,
    /// The last round a checkpoint covered.
    done_through: u64,
}

/// Makes sled durable and trims the log.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    db: sled::Db,
    data_dir: PathBuf,
    wal: Arc<Mutex<Wal>>,
    shared: Arc<CommitShared>,
    state: Mutex<CheckpointState>,
    wake: Condvar,
    /// sled blob files already synced (they are written once, never changed).
    synced_files: Mutex<HashSet<OsString>>,
    bytes_since: AtomicU64,
    bytes_due: u64,
    every: Duration,
}

impl Checkpointer {
    fn wrote(&self, n: u64) {
        self.bytes_since.fetch_add(n, Ordering::Relaxed);
    }

    fn maybe_due(&self) {
        if self.bytes_since.load(Ordering::Relaxed) >= self.bytes_due {
            let mut s = self.lock();
            s.due = true;
            self.wake.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CheckpointState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stop(&self) {
        self.lock().stop = true;
        self.wake.notify_one();
    }

    fn run(&self) {
        loop {
            {
                let s = self.lock();
                let (mut s, _) = self
                    .wake
                    .wait_timeout_while(s, self.every, |s| !s.stop && !s.due)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if s.stop {
                    return;
                }
                s.due = false;
            }
            if self.shared.health.failure().is_some() {
                continue;
            }
            if let Err(f) = self.checkpoint() {
                // The log keeps every round until a checkpoint succeeds.
                warn!(error = %f, "checkpoint failed; the write-ahead log keeps its segments and the next checkpoint retries");
                self.shared.metrics.add(
                    "palisade_checkpoint_failures_total",
                    "Checkpoints that failed (retried; the write-ahead log keeps what they would have trimmed).",
                    &[],
                    1,
                );
            }
        }
    }

    /// Make everything applied so far durable in sled and delete the log
    /// segments it covers.
    pub fn checkpoint(&self) -> Result<(), StorageFailure> {
        let through = self.shared.applied.load(Ordering::Acquire);
        if through == self.lock().done_through {
            return Ok(());
        }
        let started = Instant::now();
        self.bytes_since.store(0, Ordering::Relaxed);
        self.db
            .flush()
            .map_err(|e| StorageFailure::sled("checkpoint", &e))?;
        sync_sled_files(&self.data_dir, &self.synced_files)
            .map_err(|e| StorageFailure::io("checkpoint", &e))?;
        let removed = self
            .wal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove_through(through)
            .map_err(|e| StorageFailure::wal("checkpoint", &e))?;
        self.lock().done_through = through;
        self.shared
            .metrics
            .checkpointed(started.elapsed(), removed as u64);
        Ok(())
    }
}

/// `fsync` every file sled keeps in `dir` (its `db` file, `conf`,
/// snapshots) and every blob file not synced before, then the directories,
/// so that what sled's `flush` wrote is on the device and its new files'
/// entries too. sled's own flush only issues `sync_file_range` and never
/// syncs blob files (spacejam/sled #1452, #1351).
pub(crate) fn sync_sled_files(
    dir: &Path,
    synced_blobs: &Mutex<HashSet<OsString>>,
) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            File::open(entry.path())?.sync_all()?;
        }
    }
    let blobs = dir.join("blobs");
    if blobs.is_dir() {
        let mut seen = synced_blobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut present = HashSet::new();
        for entry in std::fs::read_dir(&blobs)? {
            let entry = entry?;
            let name = entry.file_name();
            if !seen.contains(&name) {
                match File::open(entry.path()) {
                    Ok(f) => f.sync_all()?,
                    // sled removed it meanwhile (an obsolete blob).
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
            }
            present.insert(name);
        }
        *seen = present;
        File::open(&blobs)?.sync_all()?;
    }
    File::open(dir)?.sync_all()?;
    Ok(())
}

/// A start-up replay logs its progress this often.
const REPLAY_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Replay what the log holds into sled on open, make it durable, and delete
/// the log. Returns the next round number and how many rounds were replayed.
pub(crate) fn recover(
    db: &sled::Db,
    data_dir: &Path,
    wal_dir: &Path,
    trees: &Trees,
) -> Result<(u64, usize), RecoverError> {
    let rec = wal::recover(wal_dir)?;
    let next = rec.rounds.last().map_or(1, |(r, _)| r + 1);
    let replayed = rec.rounds.len();
    let bytes: usize = rec.rounds.iter().map(|(_, p)| p.len()).sum();
    if replayed > 0 {
        info!(
            rounds = replayed,
            bytes, "replaying the write-ahead log into sled"
        );
    }
    // Progress of a long replay: a line every few seconds.
    let started = std::time::Instant::now();
    let mut last_line = started;
    for (i, (round, payload)) in rec.rounds.iter().enumerate() {
        trees.apply(payload).map_err(|f| RecoverError::Apply {
            round: *round,
            failure: f,
        })?;
        if last_line.elapsed() >= REPLAY_PROGRESS_EVERY {
            last_line = std::time::Instant::now();
            let secs = started.elapsed().as_secs_f64().max(1e-3);
            #[allow(clippy::cast_precision_loss)]
            let rate = (i + 1) as f64 / secs;
            #[allow(clippy::cast_precision_loss)]
            let eta_s = (replayed - i - 1) as f64 / rate.max(1e-9);
            info!(
                done = i + 1,
                total = replayed,
                rounds_per_s = rate.round(),
                eta_s = eta_s.round(),
                "replaying the write-ahead log"
            );
        }
    }
    if rec.torn_bytes > 0 {
        warn!(
            bytes = rec.torn_bytes,
            "write-ahead log: cut a torn tail (rounds never acknowledged)"
        );
    }
    if !rec.segments.is_empty() {
        db.flush()?;
        sync_sled_files(data_dir, &Mutex::new(HashSet::new()))
            .map_err(|e| RecoverError::Sync(e.to_string()))?;
        wal::remove_files(wal_dir, &rec.segments)?;
    }
    if replayed > 0 {
        info!(rounds = replayed, "write-ahead log replayed into sled");
    }
    Ok((next, replayed))
}

/// Why the log could not be replayed on open.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error(transparent)]
    Wal(#[from] wal::WalError),
    #[error("replaying round {round} of the write-ahead log: {failure}")]
    Apply { round: u64, failure: StorageFailure },
    #[error("making the replayed log durable in sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("making the replayed log durable in sled: {0}")]
    Sync(String),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn trees(dir: &Path, partitions: u32) -> (sled::Db, Trees) {
        let db = sled::Config::new().path(dir).open().unwrap();
        let t = Trees {
            partitions: (0..partitions)
                .map(|p| db.open_tree(format!("p{p}")).unwrap())
                .collect(),
            meta: db.open_tree("meta").unwrap(),
            leases: db.open_tree("leases").unwrap(),
            audit: db.open_tree("audit").unwrap(),
            token_owners: db.open_tree("owners").unwrap(),
            cluster: db.open_tree("cluster").unwrap(),
            ingest: db.open_tree("ingest").unwrap(),
            refusals: db.open_tree("refusals").unwrap(),
            outbox: db.open_tree("outbox").unwrap(),
        };
        (db, t)
    }

    fn dump(t: &Trees) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let all = t.partitions.iter().chain([
            &t.meta,
            &t.leases,
            &t.audit,
            &t.token_owners,
            &t.cluster,
            &t.ingest,
        ]);
        all.map(|tree| {
            tree.iter()
                .map(|kv| {
                    let (k, v) = kv.unwrap();
                    (k.to_vec(), v.to_vec())
                })
                .collect()
        })
        .collect()
    }

    #[test]
    fn every_tree_belongs_to_exactly_one_lane() {
        let ids = (0..70).map(TreeId::partition).chain([
            TreeId::META,
            TreeId::LEASES,
            TreeId::AUDIT,
            TreeId::CLUSTER,
        ]);
        for id in ids {
            for of in 1..=4 {
                let owners = (0..of).filter(|&index| Lane { index, of }.owns(id)).count();
                assert_eq!(owners, 1, "{id:?} with {of} lanes");
            }
            assert!(Lane::ALL.owns(id));
        }
    }

    /// Rounds of puts and removes that overwrite and delete the same keys
    /// across trees, applied by 3 lanes, give exactly what one thread
    /// applying them in order gives: each tree sees its ops in round order.
    #[test]
    fn lanes_apply_what_one_thread_applies() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ((_db1, serial), (_db2, parallel)) = (trees(a.path(), 7), trees(b.path(), 7));
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (lanes, handles) = Lanes::start(3, &parallel).unwrap();
        for _ in 0..40 {
            let mut group = Vec::new();
            for _ in 0..1 + next(5) {
                let mut ops = Ops::default();
                for _ in 0..next(60) {
                    let tree = match next(9) {
                        7 => TreeId::META,
                        8 => TreeId::AUDIT,
                        p => TreeId::partition(p as u32),
                    };
                    let key = next(16).to_be_bytes();
                    if next(4) == 0 {
                        ops.remove(tree, &key);
                    } else {
                        ops.put(tree, &key, &next(1 << 20).to_be_bytes());
                    }
                }
                serial.apply(ops.payload()).unwrap();
                group.push(ops);
            }
            lanes.apply_split(&parallel, group).unwrap();
        }
        drop(lanes);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(dump(&serial), dump(&parallel));
        // The ops reached every partition tree (the comparison is not of
        // empty trees).
        assert!(dump(&serial)[..7].iter().all(|t| !t.is_empty()));
    }
}
