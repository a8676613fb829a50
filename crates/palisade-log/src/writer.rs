//! The sequencer: one thread that decides every write of the store, in
//! arrival order, and closes commit rounds for the committer (`commit.rs`).
//!
//! Each partition is a single-threaded state machine ([`Partition`]): its
//! fences, head, token grants, dedupe window and twin records live here and
//! nowhere else, and every append, Kafka record, grant and owner marker of
//! the partition is checked against them by the pure fence (`fence.rs`) in
//! order. The sequencer drains its queue, runs each command through the
//! state machine of its partition (or the lease authority), and stages what
//! the command changes into the open round: the events, the twin records,
//! the fences, the source offsets, lease records, audit records. It then
//! hands the round to the committer and goes on with the next while the
//! round is synced: one `fdatasync` covers every partition. Replies go out
//! only after the round is durable and applied.
//!
//! The state here runs ahead of the disk (it includes rounds being synced);
//! that is safe because the store is fail-stop: if a round cannot be made
//! durable, nothing after it is acknowledged either, and a restart rebuilds
//! this state from what the log and sled hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use palisade_core::{
    check_event_fields, codec, partition_for, Clock, FencingToken, LeaseId, NewEvent, PartitionId,
    Scope, TwinId,
};
use palisade_lease::{AcquireRequest, AuthorityError, Lease, LeaseAuthority, LeaseWrites};
use palisade_twin::TwinState;
use tokio::sync::{oneshot, watch};
use tracing::{debug, error, warn};

use crate::batch::{BatchEvent, Batches, DedupeWindow};
use crate::commit::{Ack, CommitShared, Round, StorageFailure, ToSync};
use crate::error::{AppendError, LeaseOpError, OpenError};
use crate::fence::{self, Fences, Reach};
use crate::ingest::{
    is_drop, now_ms, DeadLetter, IngestOutcome, IngestRecord, Origin, Rejection, RejectionLog,
    Source, DEAD_LETTER_VALUE_BYTES,
};
use crate::keys;
use crate::outbox::{DeliveryState, OutboxEntry};
use crate::records::{PartitionMeta, Snapshot, TokenGrant, TwinRecord};
use crate::refusals::{Refusal, RefusalSource};
use crate::sources::{RelayCheck, Sources};
use crate::wal::{Ops, TreeId};
use crate::Metrics;

/// Most commands decided into one drain of the queue.
const MAX_DRAIN: usize = 4096;
/// A round is closed once its ops reach this size, so one huge request
/// gets a round of its own instead of delaying every other reply.
const MAX_ROUND_BYTES: usize = 4 << 20;
/// Twin records kept decoded per partition for the sequencer's decisions;
/// past this the ones already applied are dropped (sled holds them).
const CACHE_MAX: usize = 16_384;

/// An acknowledged append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub partition: PartitionId,
    /// The sequence number of each event of the request, in order. A
    /// duplicate event id gets the sequence number it was first stored under.
    pub seqs: Vec<u64>,
    /// How many of the events were duplicates, acknowledged without a new append.
    pub duplicates: usize,
    /// fence(k) after the append.
    pub fence: FencingToken,
    /// The twin's version (sequence number of its latest event) after the append.
    pub version: u64,
}

pub(crate) struct AppendReq {
    pub twin: TwinId,
    pub token: FencingToken,
    pub events: Vec<NewEvent>,
    pub if_match: Option<u64>,
    /// Each event's effects (the fenced outbox), in the events' order;
    /// empty when no event declares any.
    pub effects: Vec<Vec<palisade_core::effect::Effect>>,
}

pub(crate) type IngestReply = oneshot::Sender<Result<IngestOutcome, AppendError>>;
pub(crate) type IngestBatchReply = oneshot::Sender<Result<Vec<IngestOutcome>, AppendError>>;

/// A write to make durable as is (audit records, token owners, store
/// metadata): `value` `None` removes the key.
#[derive(Debug, Clone)]
pub(crate) struct RawWrite {
    pub tree: TreeId,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

pub(crate) enum Command {
    Append {
        partition: PartitionId,
        req: AppendReq,
        reply: oneshot::Sender<Result<Appended, AppendError>>,
    },
    /// A record of source (Kafka) partition `source` at `offset`: applied
    /// to its twin's partition, dropped or dead-lettered, and the source
    /// offset stored, in one round.
    Ingest {
        source: Source,
        offset: u64,
        record: IngestRecord,
        reply: IngestReply,
    },
    /// Source records of one source partition in offset order, each handled
    /// as `Ingest` is, with one reply for all.
    IngestBatch {
        source: Source,
        records: Vec<(u64, IngestRecord)>,
        reply: IngestBatchReply,
    },
    /// Give the source offsets migrated from layout 2 (whose topic was not
    /// recorded) to `topic`; the reply counts them.
    ClaimLegacy {
        topic: String,
        reply: oneshot::Sender<Result<usize, AppendError>>,
    },
    /// Grant a lease from the embedded authority: the lease records and the
    /// fence raise of the scope go into the same round.
    Acquire {
        req: AcquireRequest,
        id: LeaseId,
        /// The principal the token and lease are bound to in the grant's
        /// round (`token_owners`); `None` with authentication off.
        owner: Option<String>,
        reply: oneshot::Sender<Result<Lease, LeaseOpError>>,
    },
    Renew {
        id: LeaseId,
        reply: oneshot::Sender<Result<Lease, LeaseOpError>>,
    },
    Release {
        id: LeaseId,
        reply: oneshot::Sender<Result<Lease, LeaseOpError>>,
    },
    /// Retire expired leases; the reply counts them.
    Sweep {
        reply: oneshot::Sender<Result<usize, LeaseOpError>>,
    },
    /// Register a grant made by another authority (etcd): the token becomes
    /// valid for its scope and the scope's fence rises to it.
    Grant {
        token: FencingToken,
        scope: Scope,
        holder: String,
        reply: oneshot::Sender<Result<(), LeaseOpError>>,
    },
    /// Cluster mode: raise a partition's owner fence.
    OwnerFence {
        partition: PartitionId,
        token: u64,
        reply: oneshot::Sender<Result<(), AppendError>>,
    },
    Write {
        writes: Vec<RawWrite>,
        reply: Option<oneshot::Sender<Result<(), StorageFailure>>>,
    },
    /// Backup (`backup.rs`): make everything decided before durable and
    /// applied to sled, answer `paused`, then decide nothing until `resume`
    /// says so (or its sender is dropped, or [`MAX_PAUSE`] passes).
    Pause {
        paused: std::sync::mpsc::Sender<Result<(), StorageFailure>>,
        resume: std::sync::mpsc::Receiver<()>,
    },
    /// A partition snapshot was written into partition `partition`'s keys
    /// straight to sled (`handoff.rs`): once everything decided before is
    /// applied, load the partition's state machine, the sources and the
    /// partition's refusal span again from sled, and answer once a round
    /// publishing its head is applied.
    Reload {
        partition: PartitionId,
        cluster: sled::Tree,
        ingest: sled::Tree,
        reply: oneshot::Sender<Result<(), StorageFailure>>,
    },
    /// Finish everything queued before, then stop.
    Stop,
}

/// Longest a [`Command::Pause`] holds the sequencer: a backup whose copy of
/// the mutable keys takes longer than this loses its point in time
/// (`backup.rs` checks) rather than stopping writes for good.
pub(crate) const MAX_PAUSE: std::time::Duration = std::time::Duration::from_secs(60);

/// What the sequencer shares with the store.
#[derive(Debug)]
pub(crate) struct Shared {
    pub clock: Arc<Clock>,
    pub metrics: Arc<Metrics>,
    pub rejections: Arc<RejectionLog>,
    /// The durable refusal journal: refused appends are staged in it, in
    /// the round that refuses them.
    pub refusals: Arc<crate::refusals::RefusalJournal>,
    pub snapshot_every: u64,
    pub commit: Arc<CommitShared>,
    /// The greatest token this store has durably registered.
    pub last_token: Arc<AtomicU64>,
}

/// The open round.
#[derive(Default)]
struct OpenRound {
    ops: Ops,
    acks: Vec<Ack>,
    /// Partitions with staged changes.
    touched: Vec<usize>,
    requests: usize,
}

impl OpenRound {
    fn ack(&mut self, a: Ack) {
        self.acks.push(a);
        self.requests += 1;
    }
}

/// A reply sent once its round is durable: `r` then, or the failure.
fn ack<T, E>(
    tx: oneshot::Sender<Result<T, E>>,
    r: Result<T, E>,
    failed: fn(StorageFailure) -> E,
) -> Ack
where
    T: Send + 'static,
    E: Send + 'static,
{
    Box::new(move |outcome| {
        let _ = tx.send(match outcome {
            Ok(()) => r,
            Err(f) => Err(failed(f.clone())),
        });
    })
}

/// The metric name of a lease refusal, and the error callers see.
pub(crate) fn lease_failure(metrics: &Metrics, e: AuthorityError) -> LeaseOpError {
    match e {
        AuthorityError::Lease(e) => {
            metrics.lease_refused(match &e {
                palisade_lease::LeaseError::Held { .. } => "held",
                palisade_lease::LeaseError::Expired(_) => "expired",
                palisade_lease::LeaseError::Superseded { .. } => "superseded",
                palisade_lease::LeaseError::Released(_) => "released",
                palisade_lease::LeaseError::Unknown(_) => "unknown",
                _ => "bad_request",
            });
            LeaseOpError::Lease(e)
        }
        other => LeaseOpError::Storage(other.to_string()),
    }
}

pub(crate) struct Sequencer {
    parts: Vec<Partition>,
    /// Source offsets, dead letters, forward chains (the `ingest` tree).
    sources: Sources,
    authority: Arc<Mutex<LeaseAuthority>>,
    shared: Arc<Shared>,
    out: mpsc::Sender<ToSync>,
    next_round: u64,
    open: OpenRound,
}

impl Sequencer {
    pub fn new(
        parts: Vec<Partition>,
        sources: Sources,
        authority: Arc<Mutex<LeaseAuthority>>,
        shared: Arc<Shared>,
        out: mpsc::Sender<ToSync>,
        next_round: u64,
        first_writes: LeaseWrites,
    ) -> Self {
        let mut s = Self {
            parts,
            sources,
            authority,
            shared,
            out,
            next_round,
            open: OpenRound::default(),
        };
        s.stage_lease_writes(first_writes);
        s
    }

    pub fn run(mut self, rx: &mpsc::Receiver<Command>) {
        let mut stop = false;
        while !stop {
            let Ok(first) = rx.recv() else {
                break;
            };
            let mut next = Some(first);
            let mut n = 0;
            while let Some(cmd) = next.take() {
                if matches!(cmd, Command::Stop) {
                    // Everything after a Stop was sent by a caller racing the
                    // shutdown: it stays queued, and its caller sees `Closed`.
                    stop = true;
                    break;
                }
                if let Command::Pause { paused, resume } = cmd {
                    self.pause(&paused, &resume);
                    n += 1;
                    if n < MAX_DRAIN {
                        next = rx.try_recv().ok();
                    }
                    continue;
                }
                if let Command::Reload {
                    partition,
                    cluster,
                    ingest,
                    reply,
                } = cmd
                {
                    self.reload(partition, &cluster, &ingest, reply);
                    n += 1;
                    if n < MAX_DRAIN {
                        next = rx.try_recv().ok();
                    }
                    continue;
                }
                self.decide(cmd);
                if self.open.ops.bytes() >= MAX_ROUND_BYTES {
                    self.close_round();
                }
                n += 1;
                if n < MAX_DRAIN {
                    next = rx.try_recv().ok();
                }
            }
            self.close_round();
        }
        let _ = self.out.send(ToSync::Stop);
    }

    fn failure(&self) -> Option<StorageFailure> {
        self.shared.commit.health.failure().cloned()
    }

    /// Stop at a round boundary for a backup: close the open round, then a
    /// round holding only an acknowledgement, which the committer answers
    /// once it and every round before it are synced and applied to sled.
    /// Then sled holds exactly what was decided; nothing more is decided
    /// until the backup resumes us.
    fn pause(
        &mut self,
        paused: &std::sync::mpsc::Sender<Result<(), StorageFailure>>,
        resume: &std::sync::mpsc::Receiver<()>,
    ) {
        let outcome = self.wait_applied();
        let ok = outcome.is_ok();
        if paused.send(outcome).is_ok() && ok {
            let _ = resume.recv_timeout(MAX_PAUSE);
        }
    }

    /// Close the open round, then a round holding only an acknowledgement,
    /// and wait until the committer has synced and applied both: sled then
    /// holds exactly what was decided.
    fn wait_applied(&mut self) -> Result<(), StorageFailure> {
        self.close_round();
        if let Some(f) = self.failure() {
            return Err(f);
        }
        let (applied_tx, applied_rx) = std::sync::mpsc::channel();
        self.open.ack(Box::new(move |outcome| {
            let _ = applied_tx.send(outcome.map_err(StorageFailure::clone));
        }));
        self.close_round();
        applied_rx.recv().unwrap_or_else(|_| {
            Err(StorageFailure::new(
                "commit",
                std::io::ErrorKind::BrokenPipe,
                "the commit threads are gone".into(),
            ))
        })
    }

    /// [`Command::Reload`]. A state that cannot be loaded again stops the
    /// store (fail-stop): the sequencer's state would no longer be sled's.
    fn reload(
        &mut self,
        p: PartitionId,
        cluster: &sled::Tree,
        ingest: &sled::Tree,
        reply: oneshot::Sender<Result<(), StorageFailure>>,
    ) {
        if let Err(f) = self.wait_applied() {
            let _ = reply.send(Err(f));
            return;
        }
        let i = p.0 as usize;
        let loaded = self.parts.get(i).map(|part| part.tree.clone()).map(|tree| {
            Partition::load(p, tree, cluster, self.shared.clone())
                .map(|(part, _, _)| part)
                .and_then(|part| Ok((part, Sources::load(ingest)?)))
        });
        match loaded {
            Some(Ok((mut part, sources))) => {
                // Its META goes into the next round, which publishes its head.
                part.meta_dirty = true;
                self.parts[i] = part;
                self.sources = sources;
                let _ = self.shared.refusals.reload(p.0);
                self.shared.commit.cache.clear();
                self.touch(i);
                self.open.ack(ack(reply, Ok(()), std::convert::identity));
            }
            Some(Err(e)) => {
                let f = StorageFailure::new(
                    "snapshot load",
                    std::io::ErrorKind::InvalidData,
                    format!("partition {p}: its state does not load from the snapshot written into it: {e}"),
                );
                let f = self.shared.commit.health.fail(f, &self.shared.metrics);
                let _ = reply.send(Err(f));
            }
            None => {
                let _ = reply.send(Err(StorageFailure::new(
                    "snapshot load",
                    std::io::ErrorKind::InvalidInput,
                    format!("partition {p} does not exist"),
                )));
            }
        }
    }

    /// Send the open round to the committer (if it holds anything).
    fn close_round(&mut self) {
        // The source offsets go into the round of the records they cover.
        self.sources.close(&mut self.open.ops);
        let mut round = std::mem::take(&mut self.open);
        if round.acks.is_empty() && round.ops.is_empty() {
            return;
        }
        let no = self.next_round;
        self.next_round += 1;
        let applied = self.shared.commit.applied.load(Ordering::Acquire);
        let mut publish = Vec::new();
        let mut heads = Vec::new();
        for p in std::mem::take(&mut round.touched) {
            self.parts[p].close(no, applied, &mut round.ops, &mut publish, &mut heads);
        }
        let r = Round {
            no,
            ops: round.ops,
            acks: round.acks,
            publish,
            heads,
            requests: round.requests,
        };
        if let Err(mpsc::SendError(ToSync::Round(r))) = self.out.send(ToSync::Round(r)) {
            let f = StorageFailure::new(
                "commit",
                std::io::ErrorKind::BrokenPipe,
                "the commit threads are gone".into(),
            );
            for a in r.acks {
                a(Err(&f));
            }
        }
    }

    /// Partition `p`'s state machine and the open round's ops, with `p`
    /// marked as changed in this round.
    fn touch(&mut self, p: usize) -> (&mut Partition, &mut Ops) {
        let part = &mut self.parts[p];
        if !part.touched {
            part.touched = true;
            self.open.touched.push(p);
        }
        (part, &mut self.open.ops)
    }

    fn stage_lease_writes(&mut self, writes: LeaseWrites) {
        for (k, v) in writes {
            match v {
                Some(v) => self.open.ops.put(TreeId::LEASES, &k, &v),
                None => self.open.ops.remove(TreeId::LEASES, &k),
            }
        }
    }

    fn authority(&self) -> std::sync::MutexGuard<'_, LeaseAuthority> {
        self.authority
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn decide(&mut self, cmd: Command) {
        if let Some(f) = self.failure() {
            refuse(cmd, &f);
            return;
        }
        let metrics = self.shared.metrics.clone();
        match cmd {
            Command::Append {
                partition,
                req,
                reply,
            } => {
                let (part, ops) = self.touch(partition.0 as usize);
                let r = part.append(ops, &req, None);
                let m = metrics;
                self.open.ack(Box::new(move |outcome| {
                    let res = match outcome {
                        Ok(()) => {
                            if let Ok(a) = &r {
                                m.append_requests.fetch_add(1, Ordering::Relaxed);
                                m.events_appended.fetch_add(
                                    (a.seqs.len() - a.duplicates) as u64,
                                    Ordering::Relaxed,
                                );
                                m.events_deduplicated
                                    .fetch_add(a.duplicates as u64, Ordering::Relaxed);
                            }
                            r
                        }
                        Err(f) => Err(AppendError::StorageFailed(f.clone())),
                    };
                    let _ = reply.send(res);
                }));
            }
            Command::Ingest {
                source,
                offset,
                record,
                reply,
            } => {
                let r = self.ingest(&source, offset, record);
                self.open.ack(ack(reply, r, AppendError::StorageFailed));
            }
            Command::IngestBatch {
                source,
                records,
                reply,
            } => {
                let mut outcomes = Vec::with_capacity(records.len());
                let mut failed = None;
                for (offset, record) in records {
                    match self.ingest(&source, offset, record) {
                        Ok(o) => outcomes.push(o),
                        // Not applied and its offset not stored: the records
                        // after it must not be applied either, or the stored
                        // offset would pass over it.
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                let r = failed.map_or(Ok(outcomes), Err);
                self.open.ack(ack(reply, r, AppendError::StorageFailed));
            }
            Command::ClaimLegacy { topic, reply } => {
                if !self.sources.has_legacy() {
                    // Every start of a consumer asks: no round (and no
                    // sync) for nothing to claim.
                    let _ = reply.send(Ok(0));
                    return;
                }
                let n = self.sources.claim_legacy(&topic, &mut self.open.ops);
                self.open.ack(ack(reply, Ok(n), AppendError::StorageFailed));
            }
            Command::Acquire {
                req,
                id,
                owner,
                reply,
            } => {
                let decided = self.authority().acquire(req, id);
                let r = match decided {
                    Ok((grant, writes)) => {
                        self.stage_lease_writes(writes);
                        let l = grant.lease;
                        let p = l.scope.partition(self.partitions());
                        let (part, ops) = self.touch(p.0 as usize);
                        match part.grant(ops, l.token, &l.scope, &l.holder) {
                            Ok(()) => {
                                // Bound in the round that grants: durable
                                // together, so the token never exists
                                // without its owner.
                                if let Some(o) = &owner {
                                    for w in [
                                        crate::audit::token_owner_write(l.token, o),
                                        crate::audit::lease_owner_write(l.id.0, o),
                                    ] {
                                        if let Some(v) = &w.value {
                                            self.open.ops.put(w.tree, &w.key, v);
                                        }
                                    }
                                }
                                Ok(l)
                            }
                            // The counter moved (its write is staged): the
                            // token is burnt, never reused.
                            Err(e) => Err(LeaseOpError::Storage(e.to_string())),
                        }
                    }
                    Err(e) => Err(lease_failure(&metrics, e)),
                };
                let (m, last) = (metrics, self.shared.last_token.clone());
                self.open.ack(Box::new(move |outcome| {
                    let res = match outcome {
                        Ok(()) => r.inspect(|l| {
                            last.fetch_max(l.token.0, Ordering::SeqCst);
                            m.lease_grants.fetch_add(1, Ordering::Relaxed);
                        }),
                        Err(f) => Err(LeaseOpError::StorageFailed(f.clone())),
                    };
                    let _ = reply.send(res);
                }));
            }
            Command::Renew { id, reply } => {
                let decided = self.authority().renew(id);
                let r = match decided {
                    Ok((lease, writes)) => {
                        self.stage_lease_writes(writes);
                        metrics.lease_renewals.fetch_add(1, Ordering::Relaxed);
                        Ok(lease)
                    }
                    Err(e) => Err(lease_failure(&metrics, e)),
                };
                self.open.ack(ack(reply, r, LeaseOpError::StorageFailed));
            }
            Command::Release { id, reply } => {
                let decided = self.authority().release(id);
                let r = match decided {
                    Ok((lease, writes)) => {
                        self.stage_lease_writes(writes);
                        metrics.lease_releases.fetch_add(1, Ordering::Relaxed);
                        Ok(lease)
                    }
                    Err(e) => Err(lease_failure(&metrics, e)),
                };
                self.open.ack(ack(reply, r, LeaseOpError::StorageFailed));
            }
            Command::Sweep { reply } => {
                let (gone, writes) = self.authority().sweep();
                self.stage_lease_writes(writes);
                metrics
                    .lease_expiries
                    .fetch_add(gone.len() as u64, Ordering::Relaxed);
                self.open
                    .ack(ack(reply, Ok(gone.len()), LeaseOpError::StorageFailed));
            }
            Command::Grant {
                token,
                scope,
                holder,
                reply,
            } => {
                let p = scope.partition(self.partitions());
                let (part, ops) = self.touch(p.0 as usize);
                let r = part
                    .grant(ops, token, &scope, &holder)
                    .map_err(|e| LeaseOpError::Storage(e.to_string()));
                let last = self.shared.last_token.clone();
                self.open.ack(Box::new(move |outcome| {
                    let res = match outcome {
                        Ok(()) => r.inspect(|()| {
                            last.fetch_max(token.0, Ordering::SeqCst);
                        }),
                        Err(f) => Err(LeaseOpError::StorageFailed(f.clone())),
                    };
                    let _ = reply.send(res);
                }));
            }
            Command::OwnerFence {
                partition,
                token,
                reply,
            } => {
                self.touch(partition.0 as usize).0.raise_owner(token);
                self.open
                    .ack(ack(reply, Ok(()), AppendError::StorageFailed));
            }
            Command::Write { writes, reply } => {
                for w in writes {
                    match w.value {
                        Some(v) => self.open.ops.put(w.tree, &w.key, &v),
                        None => self.open.ops.remove(w.tree, &w.key),
                    }
                }
                if let Some(reply) = reply {
                    self.open.ack(ack(reply, Ok(()), std::convert::identity));
                }
            }
            // Handled by `run` before it decides anything.
            Command::Pause { .. } | Command::Reload { .. } | Command::Stop => {}
        }
    }

    fn partitions(&self) -> u32 {
        u32::try_from(self.parts.len()).unwrap_or(u32::MAX)
    }

    /// Apply, drop, dead-letter or forward one source record and advance
    /// the source offset, all staged in the open round. The record goes to
    /// its twin's partition, whatever source partition it came from: the
    /// round is one log record, so the offset and the events are durable
    /// together even when they are in different partitions.
    fn ingest(
        &mut self,
        source: &Source,
        offset: u64,
        record: IngestRecord,
    ) -> Result<IngestOutcome, AppendError> {
        if let Some(e) = self.sources.failed(source) {
            // An earlier record of this source failed in this round: this
            // one must not pass it (the stored offset would skip it).
            return Err(e.clone());
        }
        if self.sources.handled(source, offset) {
            return Ok(IngestOutcome::AlreadyApplied);
        }
        match self.decide_record(source, offset, record, None) {
            Ok(outcome) => {
                self.sources.advance(source, offset);
                Ok(outcome)
            }
            Err(e) => {
                self.sources.fail(source, e.clone());
                Err(e)
            }
        }
    }

    /// What one record of `source` at `offset` does (its offset is the
    /// caller's business). `Err` only for a storage error: nothing of the
    /// record was staged. `origin`: the record is a forwarded copy of the
    /// record there, which a rejection names (the worker produced that one).
    fn decide_record(
        &mut self,
        source: &Source,
        offset: u64,
        record: IngestRecord,
        origin: Option<&Origin>,
    ) -> Result<IngestOutcome, AppendError> {
        let named = origin.map_or((source.partition, offset), |o| (o.partition, o.offset));
        let forwarded = |detail: String| match origin {
            Some(o) => format!(
                "{detail} (forwarded from partition {} offset {})",
                o.partition, o.offset
            ),
            None => detail,
        };
        Ok(match record {
            IngestRecord::Append {
                twin,
                token,
                events,
                if_match,
                effects,
            } => {
                let p = partition_for(&twin, self.partitions());
                let (part, ops) = self.touch(p.0 as usize);
                let req = AppendReq {
                    twin,
                    token,
                    events,
                    if_match,
                    effects,
                };
                match part.append(ops, &req, Some(named)) {
                    Ok(a) => IngestOutcome::Applied(a),
                    Err(e @ (AppendError::Storage(_) | AppendError::Closed)) => return Err(e),
                    Err(e) if is_drop(&e) => IngestOutcome::Dropped(e),
                    Err(e) => {
                        let reason = e.reason().to_owned();
                        let detail = forwarded(e.to_string());
                        self.dead_letter(
                            source,
                            offset,
                            DeadLetter {
                                partition: source.partition,
                                offset,
                                key: Some(req.twin.to_string()),
                                reason: reason.clone(),
                                detail,
                                headers: Vec::new(),
                                value: Vec::new(),
                                value_len: 0,
                                at_ms: 0,
                            },
                        );
                        IngestOutcome::DeadLettered {
                            reason,
                            refused: Some(e),
                        }
                    }
                }
            }
            IngestRecord::Dead(mut dl) => {
                dl.detail = forwarded(std::mem::take(&mut dl.detail));
                let reason = dl.reason.clone();
                self.shared.metrics.rejected("dead_letter");
                self.dead_letter(source, offset, dl);
                IngestOutcome::DeadLettered {
                    reason,
                    refused: None,
                }
            }
            IngestRecord::Relayed { origin, record } => {
                let (check, last) = self.sources.relay(source, &origin);
                match check {
                    RelayCheck::Duplicate => IngestOutcome::Duplicate {
                        origin: origin.partition,
                        offset: origin.offset,
                    },
                    RelayCheck::Gap => {
                        warn!(source = %source, offset, origin = origin.partition, origin_offset = origin.offset, prev = ?origin.prev, last = ?last, "a forwarded record overtook an earlier one of its origin partition; set aside until it is forwarded again");
                        IngestOutcome::OutOfOrder {
                            origin: origin.partition,
                            expected: last,
                            prev: origin.prev,
                        }
                    }
                    RelayCheck::Next => {
                        let outcome = match *record {
                            inner @ (IngestRecord::Append { .. } | IngestRecord::Dead(_)) => {
                                self.decide_record(source, offset, inner, Some(&origin))?
                            }
                            IngestRecord::Relayed { .. } | IngestRecord::Forwarded { .. } => {
                                let reason = "bad_forward".to_owned();
                                self.dead_letter(
                                    source,
                                    offset,
                                    DeadLetter {
                                        partition: source.partition,
                                        offset,
                                        key: None,
                                        reason: reason.clone(),
                                        detail: "a forwarded record must hold an event record"
                                            .into(),
                                        headers: Vec::new(),
                                        value: Vec::new(),
                                        value_len: 0,
                                        at_ms: 0,
                                    },
                                );
                                IngestOutcome::DeadLettered {
                                    reason,
                                    refused: None,
                                }
                            }
                        };
                        self.sources.relayed(source, &origin);
                        outcome
                    }
                }
            }
            IngestRecord::Forwarded { to, at } => {
                self.sources.forwarded(source, to, offset);
                IngestOutcome::Forwarded { to, at }
            }
        })
    }

    /// Keep a dead letter of `source` at `offset` (durable, bounded per
    /// source partition).
    fn dead_letter(&mut self, source: &Source, offset: u64, mut dl: DeadLetter) {
        dl.partition = source.partition;
        dl.offset = offset;
        dl.at_ms = now_ms();
        dl.value.truncate(DEAD_LETTER_VALUE_BYTES);
        self.sources.stage_dead_letter(&mut self.open.ops, &dl);
    }
}

/// Answer a command at once with the failure that stopped the store.
fn refuse(cmd: Command, f: &StorageFailure) {
    let e = || AppendError::StorageFailed(f.clone());
    let l = || LeaseOpError::StorageFailed(f.clone());
    match cmd {
        Command::Append { reply, .. } => drop(reply.send(Err(e()))),
        Command::Ingest { reply, .. } => drop(reply.send(Err(e()))),
        Command::IngestBatch { reply, .. } => drop(reply.send(Err(e()))),
        Command::ClaimLegacy { reply, .. } => drop(reply.send(Err(e()))),
        Command::OwnerFence { reply, .. } => drop(reply.send(Err(e()))),
        Command::Acquire { reply, .. }
        | Command::Renew { reply, .. }
        | Command::Release { reply, .. } => drop(reply.send(Err(l()))),
        Command::Sweep { reply } => drop(reply.send(Err(l()))),
        Command::Grant { reply, .. } => drop(reply.send(Err(l()))),
        Command::Write { reply, .. } => {
            if let Some(r) = reply {
                let _ = r.send(Err(f.clone()));
            }
        }
        Command::Pause { paused, .. } => drop(paused.send(Err(f.clone()))),
        Command::Reload { reply, .. } => drop(reply.send(Err(f.clone()))),
        Command::Stop => {}
    }
}

/// A twin record in the sequencer's cache, with the round that last wrote
/// it (0: read from sled), so that only applied ones are ever dropped.
struct Cached {
    rec: Arc<TwinRecord>,
    round: u64,
}

/// Changes of the open round, visible to later requests in it.
#[derive(Default)]
struct Pending {
    /// The staged events, grouped into event batches.
    events: Batches,
    dirty: HashMap<TwinId, TwinRecord>,
}

/// One partition's state machine.
pub(crate) struct Partition {
    id: PartitionId,
    tree: sled::Tree,
    meta: PartitionMeta,
    meta_dirty: bool,
    grants: HashMap<u64, TokenGrant>,
    cache: HashMap<TwinId, Cached>,
    /// Ids of the partition's recent events (layout 2 keeps no durable
    /// dedupe keys): a retry within the window gets its first seq back.
    dedupe: DedupeWindow,
    /// Cluster mode: the highest owner token seen in the source log.
    owner_fence: u64,
    owner_dirty: bool,
    pending: Pending,
    /// In the open round's touched list.
    touched: bool,
    shared: Arc<Shared>,
}

impl Partition {
    /// Load partition `partition`'s state from sled (after the log replay).
    pub fn load(
        partition: PartitionId,
        tree: sled::Tree,
        cluster: &sled::Tree,
        shared: Arc<Shared>,
    ) -> Result<(Self, watch::Sender<u64>, watch::Receiver<u64>), OpenError> {
        let damaged = |key: &[u8], source| OpenError::Damaged {
            tree: String::from_utf8_lossy(&tree.name()).into_owned(),
            key: key.to_vec(),
            source,
        };
        let sled_err = |source| OpenError::Sled {
            path: String::from_utf8_lossy(&tree.name()).into_owned(),
            source,
        };
        let meta = match tree.get(keys::META_KEY).map_err(sled_err)? {
            Some(v) => codec::decode(&v).map_err(|e| damaged(&keys::META_KEY, e))?,
            None => PartitionMeta::default(),
        };
        let mut grants = HashMap::new();
        for kv in tree.scan_prefix([keys::GRANT]) {
            let (k, v) = kv.map_err(sled_err)?;
            let token =
                keys::seq_of_event_key(&k).ok_or_else(|| damaged(&k, codec::CodecError::Empty))?;
            grants.insert(token, codec::decode(&v).map_err(|e| damaged(&k, e))?);
        }
        if let Some(h) = meta.max_hlc {
            if let Err(e) = shared.clock.observe(h) {
                // Only if the wall clock went back by more than the allowed
                // drift since the event was accepted.
                tracing::warn!(partition = %partition, error = %e, "the store's clock is behind events already stored; new events may be ordered before them");
            }
        }
        let owner_fence = owner_fence_in(cluster, partition).map_err(sled_err)?;
        let dedupe = DedupeWindow::load(&tree)?;
        let (head, head_rx) = watch::channel(meta.head);
        let part = Self {
            id: partition,
            tree,
            meta,
            meta_dirty: false,
            grants,
            cache: HashMap::new(),
            dedupe,
            owner_fence,
            owner_dirty: false,
            pending: Pending::default(),
            touched: false,
            shared,
        };
        Ok((part, head, head_rx))
    }

    fn tree_id(&self) -> TreeId {
        TreeId::partition(self.id.0)
    }

    /// Stage the open round's changes of this partition into `ops`.
    fn close(
        &mut self,
        round: u64,
        applied: u64,
        ops: &mut Ops,
        publish: &mut Vec<(PartitionId, TwinId, Arc<TwinRecord>)>,
        heads: &mut Vec<(PartitionId, u64)>,
    ) {
        self.touched = false;
        let tree = self.tree_id();
        let pending = std::mem::take(&mut self.pending);
        pending.events.stage(tree, ops);
        for (twin, rec) in pending.dirty {
            ops.put(tree, &keys::twin(&twin), &codec::encode(&rec));
            let rec = Arc::new(rec);
            publish.push((self.id, twin.clone(), rec.clone()));
            self.cache.insert(twin, Cached { rec, round });
        }
        if std::mem::take(&mut self.meta_dirty) {
            ops.put(tree, &keys::META_KEY, &codec::encode(&self.meta));
            heads.push((self.id, self.meta.head));
        }
        if std::mem::take(&mut self.owner_dirty) {
            ops.put(
                TreeId::CLUSTER,
                &self.id.0.to_be_bytes(),
                &self.owner_fence.to_be_bytes(),
            );
        }
        if self.cache.len() > CACHE_MAX {
            // Records of rounds not yet applied must stay: sled does not
            // have them yet.
            self.cache.retain(|_, c| c.round > applied);
        }
    }

    /// Make sure the twin's record is in the open round or the cache.
    fn load_record(&mut self, twin: &TwinId) -> Result<(), AppendError> {
        if self.pending.dirty.contains_key(twin) || self.cache.contains_key(twin) {
            return Ok(());
        }
        // Not changed by any round the apply thread has not applied (those
        // stay cached), so sled has its latest record.
        let rec = match self.tree.get(keys::twin(twin)) {
            Ok(Some(v)) => codec::decode(&v).map_err(|e| {
                AppendError::Storage(format!("damaged twin record of {twin:?}: {e}"))
            })?,
            Ok(None) => TwinRecord::default(),
            Err(e) => return Err(AppendError::Storage(e.to_string())),
        };
        self.cache.insert(
            twin.clone(),
            Cached {
                rec: Arc::new(rec),
                round: 0,
            },
        );
        Ok(())
    }

    /// The twin's latest record (after [`Partition::load_record`]).
    fn peek(&self, twin: &TwinId) -> Option<&TwinRecord> {
        self.pending
            .dirty
            .get(twin)
            .or_else(|| self.cache.get(twin).map(|c| &*c.rec))
    }

    /// The twin's record, to change and put back into the open round
    /// (copied out of the cache: the cached copy may be shared with readers
    /// and with rounds in flight).
    fn take_record(&mut self, twin: &TwinId) -> Result<TwinRecord, AppendError> {
        if let Some(r) = self.pending.dirty.remove(twin) {
            return Ok(r);
        }
        self.load_record(twin)?;
        self.peek(twin)
            .cloned()
            .ok_or_else(|| AppendError::Storage(format!("twin record of {twin:?} not loaded")))
    }

    /// Register a lease grant whose scope this partition enforces and raise
    /// the scope's fence to its token.
    fn grant(
        &mut self,
        ops: &mut Ops,
        token: FencingToken,
        scope: &Scope,
        holder: &str,
    ) -> Result<(), AppendError> {
        match scope {
            Scope::Partition(_) => {
                self.meta.fence = fence::raise_by_grant(self.meta.fence, token);
                self.meta_dirty = true;
            }
            Scope::Twin(twin) => {
                let mut rec = self.take_record(twin)?;
                rec.fence = fence::raise_by_grant(rec.fence, token);
                self.pending.dirty.insert(twin.clone(), rec);
            }
        }
        let g = TokenGrant {
            scope: scope.clone(),
            holder: holder.to_owned(),
        };
        ops.put(self.tree_id(), &keys::grant(token.0), &codec::encode(&g));
        self.grants.insert(token.0, g);
        debug!(partition = %self.id, token = token.0, "fence raised by grant");
        Ok(())
    }

    fn raise_owner(&mut self, token: u64) {
        if token > self.owner_fence {
            self.owner_fence = token;
            self.owner_dirty = true;
        }
    }

    /// Check one append request and stage it. Everything is checked before
    /// anything is staged, so a refused request leaves no trace.
    /// `kafka`: the source partition and offset of a Kafka record.
    fn append(
        &mut self,
        ops: &mut Ops,
        cmd: &AppendReq,
        kafka: Option<(u32, u64)>,
    ) -> Result<Appended, AppendError> {
        let r = self.try_append(ops, cmd);
        if let Err(e) = &r {
            // For HTTP the store refines NotIssued (it may be WrongScope) and
            // counts the final reason itself.
            let refined_later = kafka.is_none() && matches!(e, AppendError::NotIssued { .. });
            if refined_later {
                return r;
            }
            self.shared.metrics.rejected(e.reason());
            if !matches!(e, AppendError::Storage(_) | AppendError::Closed) {
                let source = if kafka.is_some() {
                    RefusalSource::Kafka
                } else {
                    RefusalSource::Http
                };
                let holder = self.grants.get(&cmd.token.0).map(|g| g.holder.as_str());
                let entry = Refusal::new(
                    self.id,
                    &cmd.twin,
                    source,
                    kafka,
                    cmd.token,
                    e,
                    holder,
                    &cmd.events,
                );
                for w in self.shared.refusals.stage(entry) {
                    match w.value {
                        Some(v) => ops.put(w.tree, &w.key, &v),
                        None => ops.remove(w.tree, &w.key),
                    }
                }
                self.shared.rejections.push(Rejection {
                    at_ms: now_ms(),
                    source: if kafka.is_some() { "kafka" } else { "http" },
                    partition: self.id,
                    source_partition: kafka.map(|k| k.0),
                    offset: kafka.map(|k| k.1),
                    twin: cmd.twin.clone(),
                    token: cmd.token,
                    event_ids: cmd.events.iter().map(|e| e.event_id.clone()).collect(),
                    reason: e.reason(),
                    detail: e.to_string(),
                });
            }
        }
        r
    }

    /// Every check of an append after the token's scope: fences, If-Match,
    /// event fields, patches, HLC drift. Dedupe needs no read (the window is
    /// in memory), so nothing after these checks can fail.
    fn check_append(&self, cmd: &AppendReq, rec: &TwinRecord) -> Result<(), AppendError> {
        let fences = Fences {
            twin: rec.fence,
            partition: self.meta.fence,
        };
        fence::admit(fences, cmd.token).map_err(|s| AppendError::Stale {
            token: s.token,
            fence: s.fence,
        })?;
        if let Some(expected) = cmd.if_match {
            if expected != rec.version {
                return Err(AppendError::VersionMismatch {
                    expected,
                    current: rec.version,
                });
            }
        }
        for e in &cmd.events {
            // The same rules as the HTTP and Kafka JSON parsers apply, here
            // where every path (Kafka protobuf records too) passes.
            check_event_fields(&e.event_id, &e.event_type)
                .map_err(|err| AppendError::BadEvent(err.to_string()))?;
            TwinState::validate(&e.patch)?;
        }
        for e in &cmd.events {
            if let Some(h) = e.hlc {
                self.shared.clock.observe(h)?;
            }
        }
        Ok(())
    }

    fn try_append(&mut self, ops: &mut Ops, cmd: &AppendReq) -> Result<Appended, AppendError> {
        let t = cmd.token;
        let Some(grant) = self.grants.get(&t.0) else {
            // Not granted for this partition. The store refines this into
            // WrongScope when the token was issued for another scope.
            return Err(AppendError::NotIssued { token: t });
        };
        if !grant.scope.covers(&cmd.twin, self.id) {
            return Err(AppendError::WrongScope {
                token: t,
                scope: grant.scope.clone(),
                twin: cmd.twin.clone(),
            });
        }
        let holder = grant.holder.clone();
        let reach = match grant.scope {
            Scope::Partition(_) => Reach::Partition,
            Scope::Twin(_) => Reach::Twin,
        };
        self.load_record(&cmd.twin)?;
        let rec = self
            .peek(&cmd.twin)
            .ok_or_else(|| AppendError::Storage("twin record not loaded".into()))?;
        self.check_append(cmd, rec)?;

        // All checks passed: stage the events. Nothing below can fail.
        let mut rec = self.take_record(&cmd.twin)?;
        let now_ms = now_ms();
        let tree = self.tree_id();
        let mut seqs = Vec::with_capacity(cmd.events.len());
        let mut duplicates = 0;
        for (i, e) in cmd.events.iter().enumerate() {
            let dkey = keys::dedupe(&cmd.twin, &e.event_id);
            // Earlier events (this request's too) are in the window already.
            // A duplicate's effects were recorded with its first copy (or
            // it had none): a retry never records them twice.
            if let Some(seq) = self.dedupe.get(&dkey) {
                seqs.push(seq);
                duplicates += 1;
                continue;
            }
            let seq = self.meta.head + 1;
            self.meta.head = seq;
            let hlc = e.hlc.unwrap_or_else(|| self.shared.clock.now());
            self.meta.max_hlc = self.meta.max_hlc.max(Some(hlc));
            // Validated above; a failure here would be a bug in validate.
            if let Err(err) = rec.state.apply(&e.patch, hlc) {
                error!(%err, "patch passed validation but failed to apply");
            }
            let event = BatchEvent {
                event_id: e.event_id.clone(),
                event_type: e.event_type.clone(),
                // A map serializes exactly as the `Value::Object` holding it.
                patch: serde_json::to_string(&e.patch).unwrap_or_default(),
                hlc,
            };
            self.pending
                .events
                .push(seq, &cmd.twin, &holder, t, now_ms, event);
            self.dedupe.insert(dkey, seq);
            // The event's effects, in this round: durable exactly when the
            // event is (the fenced outbox, `outbox.rs`).
            for (index, effect) in cmd.effects.get(i).into_iter().flatten().enumerate() {
                let entry = OutboxEntry {
                    partition: self.id.0,
                    seq,
                    index: u16::try_from(index).unwrap_or(u16::MAX),
                    twin: cmd.twin.to_string(),
                    event_id: e.event_id.clone(),
                    token: t.0,
                    created_at_ms: now_ms,
                    effect: effect.clone(),
                    state: DeliveryState::Pending,
                    attempts: 0,
                    last_error: None,
                    updated_at_ms: 0,
                };
                let w = entry.write();
                if let Some(v) = &w.value {
                    ops.put(w.tree, &w.key, v);
                }
                self.shared.metrics.outbox_recorded();
            }
            rec.version = seq;
            rec.events += 1;
            if rec.events % self.shared.snapshot_every == 0 {
                let snap = Snapshot {
                    max_hlc: rec.state.max_hlc(),
                    state: rec.state.clone(),
                };
                ops.put(tree, &keys::snapshot(&cmd.twin, seq), &codec::encode(&snap));
            }
            seqs.push(seq);
        }
        let marks = fence::raise_by_write(
            Fences {
                twin: rec.fence,
                partition: self.meta.fence,
            },
            t,
            reach,
        );
        rec.fence = marks.twin;
        self.meta.fence = marks.partition;
        self.meta_dirty = true;
        let out = Appended {
            partition: self.id,
            seqs,
            duplicates,
            fence: FencingToken(rec.fence),
            version: rec.version,
        };
        self.pending.dirty.insert(cmd.twin.clone(), rec);
        Ok(out)
    }
}

/// Partition `p`'s owner fence as stored in the `cluster` tree (0: none).
pub(crate) fn owner_fence_in(tree: &sled::Tree, p: PartitionId) -> Result<u64, sled::Error> {
    Ok(tree
        .get(p.0.to_be_bytes())?
        .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
        .map_or(0, u64::from_be_bytes))
}
