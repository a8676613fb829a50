//! The partition writer: one thread per partition, the only code that writes
//! the partition's tree. It drains its queue, checks every request against
//! the fences in order, and commits the whole batch with one `apply_batch` and
//! one `flush` (group commit). Replies go out only after the flush.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use palisade_core::{codec, Clock, FencingToken, NewEvent, PartitionId, Scope, TwinId};
use palisade_core::{MAX_EVENT_ID_LEN, MAX_EVENT_TYPE_LEN};
use palisade_twin::TwinState;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, error};

use crate::batch::{BatchEvent, Batches, DedupeWindow};
use crate::error::{AppendError, OpenError};
use crate::ingest::{
    is_drop, now_ms, DeadLetter, IngestOutcome, IngestRecord, Rejection, RejectionLog,
    DEAD_LETTERS_PER_PARTITION, DEAD_LETTER_VALUE_BYTES,
};
use crate::keys;
use crate::records::{PartitionMeta, Snapshot, TokenGrant, TwinRecord};
use crate::Metrics;

/// Most requests folded into one group commit.
const MAX_BATCH: usize = 1024;
/// Twin records kept decoded in memory per partition; past this the cache is
/// dropped wholesale (cheap, and the writer reloads from sled).
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
}

pub(crate) struct AppendCmd {
    pub req: AppendReq,
    pub reply: oneshot::Sender<Result<Appended, AppendError>>,
}

pub(crate) type IngestReply = oneshot::Sender<Result<IngestOutcome, AppendError>>;
pub(crate) type IngestBatchReply = oneshot::Sender<Result<Vec<IngestOutcome>, AppendError>>;

pub(crate) enum Command {
    Append(AppendCmd),
    /// Register a lease grant whose scope this partition enforces, and raise
    /// the scope's fence to its token.
    Grant {
        token: FencingToken,
        scope: Scope,
        holder: String,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// A record from the source stream (Kafka partition = this partition)
    /// at `offset`: applied, dropped or dead-lettered, and the offset stored,
    /// all in one batch.
    Ingest {
        offset: u64,
        record: IngestRecord,
        reply: IngestReply,
    },
    /// Source records of this partition in offset order, each handled as
    /// `Ingest` is, in one group commit, with one reply for all.
    IngestBatch {
        records: Vec<(u64, IngestRecord)>,
        reply: IngestBatchReply,
    },
    /// Finish everything queued before, then stop.
    Stop,
}

/// What the writers of one store share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub clock: Arc<Clock>,
    pub metrics: Arc<Metrics>,
    pub rejections: Arc<RejectionLog>,
    pub snapshot_every: u64,
}

pub(crate) struct Writer {
    partition: PartitionId,
    tree: sled::Tree,
    meta: PartitionMeta,
    grants: HashMap<u64, TokenGrant>,
    cache: HashMap<TwinId, TwinRecord>,
    /// Ids of the partition's recent events (layout 2 keeps no durable
    /// dedupe keys): a retry within the window gets its first seq back.
    dedupe: DedupeWindow,
    /// The last source (Kafka) offset applied, stored with the events.
    source_offset: Option<u64>,
    /// Dead letters stored in this partition (bounded).
    dead_letters: u64,
    /// The durable head: published after each flush, for live readers
    /// (change streams), who then read the new events from sled.
    head: watch::Sender<u64>,
    shared: Arc<Shared>,
}

/// Changes of the batch being built, visible to later requests in it.
#[derive(Default)]
struct Pending {
    batch: sled::Batch,
    /// The staged events, grouped into event batches.
    events: Batches,
    dirty: HashMap<TwinId, TwinRecord>,
    /// Ids staged in this commit; they join the dedupe window once durable.
    dedupe: HashMap<Vec<u8>, u64>,
    grants_added: Vec<u64>,
    /// A source record of this commit failed (not applied, offset not
    /// stored): later records must not be applied past it.
    ingest_failed: Option<AppendError>,
}

enum Reply {
    Append(
        oneshot::Sender<Result<Appended, AppendError>>,
        Result<Appended, AppendError>,
    ),
    Grant(oneshot::Sender<Result<(), String>>),
    Ingest(IngestReply, Result<IngestOutcome, AppendError>),
    IngestBatch(IngestBatchReply, Result<Vec<IngestOutcome>, AppendError>),
}

impl Writer {
    pub fn load(
        partition: PartitionId,
        tree: sled::Tree,
        shared: Arc<Shared>,
    ) -> Result<(Self, watch::Receiver<u64>), OpenError> {
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
        let source_offset = match tree.get(keys::SOURCE_OFFSET).map_err(sled_err)? {
            Some(v) => Some(
                keys::trailing_seq(&v)
                    .ok_or_else(|| damaged(&keys::SOURCE_OFFSET, codec::CodecError::Empty))?,
            ),
            None => None,
        };
        let dead_letters = tree.scan_prefix([keys::DEAD_LETTER]).count() as u64;
        let dedupe = DedupeWindow::load(&tree)?;
        let (head, head_rx) = watch::channel(meta.head);
        let writer = Self {
            partition,
            tree,
            meta,
            grants,
            cache: HashMap::new(),
            dedupe,
            source_offset,
            dead_letters,
            head,
            shared,
        };
        Ok((writer, head_rx))
    }

    pub fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut stop = false;
        while !stop {
            let Some(first) = rx.blocking_recv() else {
                break;
            };
            let mut cmds = vec![first];
            while cmds.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(c) => cmds.push(c),
                    Err(_) => break,
                }
            }
            if let Some(i) = cmds.iter().position(|c| matches!(c, Command::Stop)) {
                // Everything after a Stop was sent by a caller racing the
                // shutdown: it is dropped, and its caller sees `Closed`.
                cmds.truncate(i);
                stop = true;
            }
            if !cmds.is_empty() {
                self.commit(cmds);
            }
        }
        if let Err(e) = self.tree.flush() {
            error!(partition = %self.partition, error = %e, "final flush failed");
        }
    }

    fn commit(&mut self, cmds: Vec<Command>) {
        let _span =
            tracing::debug_span!("commit", partition = %self.partition, requests = cmds.len())
                .entered();
        let meta_before = self.meta;
        let source_before = self.source_offset;
        let dead_before = self.dead_letters;
        let mut pending = Pending::default();
        let mut replies = Vec::with_capacity(cmds.len());
        for cmd in cmds {
            match cmd {
                Command::Append(a) => {
                    let r = self.append(&a.req, &mut pending, None);
                    replies.push(Reply::Append(a.reply, r));
                }
                Command::Ingest {
                    offset,
                    record,
                    reply,
                } => {
                    let r = self.ingest(offset, record, &mut pending);
                    replies.push(Reply::Ingest(reply, r));
                }
                Command::IngestBatch { records, reply } => {
                    let mut outcomes = Vec::with_capacity(records.len());
                    let mut failed = None;
                    for (offset, record) in records {
                        match self.ingest(offset, record, &mut pending) {
                            Ok(o) => outcomes.push(o),
                            // Not applied and its offset not stored: the
                            // records after it must not be applied either,
                            // or the stored offset would pass over it.
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        }
                    }
                    let r = failed.map_or(Ok(outcomes), Err);
                    replies.push(Reply::IngestBatch(reply, r));
                }
                Command::Grant {
                    token,
                    scope,
                    holder,
                    reply,
                } => match self.grant(token, scope, holder, &mut pending) {
                    Ok(()) => replies.push(Reply::Grant(reply)),
                    Err(e) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                },
                Command::Stop => {}
            }
        }
        let Pending {
            mut batch,
            events,
            dirty,
            dedupe,
            grants_added,
            ..
        } = pending;
        events.write_into(&mut batch);
        for (twin, rec) in &dirty {
            batch.insert(keys::twin(twin), codec::encode(rec));
        }
        if self.meta != meta_before {
            batch.insert(&keys::META_KEY[..], codec::encode(&self.meta));
        }
        if let (true, Some(o)) = (self.source_offset != source_before, self.source_offset) {
            batch.insert(&keys::SOURCE_OFFSET[..], &o.to_be_bytes()[..]);
        }
        let started = Instant::now();
        let written = self
            .tree
            .apply_batch(batch)
            .and_then(|()| self.tree.flush().map(drop));
        self.shared
            .metrics
            .flushed(started.elapsed(), replies.len());
        match written {
            Ok(()) => {
                self.head.send_if_modified(|h| {
                    let changed = *h != self.meta.head;
                    *h = self.meta.head;
                    changed
                });
                if self.cache.len() + dirty.len() > CACHE_MAX {
                    self.cache.clear();
                }
                self.cache.extend(dirty);
                // In seq order, so the window's generations cut at a seq.
                let mut ids: Vec<_> = dedupe.into_iter().collect();
                ids.sort_unstable_by_key(|(_, seq)| *seq);
                for (key, seq) in ids {
                    self.dedupe.insert(key, seq);
                }
                for r in replies {
                    match r {
                        Reply::Append(tx, res) => {
                            if let Ok(a) = &res {
                                let m = &self.shared.metrics;
                                m.append_requests.fetch_add(1, Ordering::Relaxed);
                                m.events_appended.fetch_add(
                                    (a.seqs.len() - a.duplicates) as u64,
                                    Ordering::Relaxed,
                                );
                                m.events_deduplicated
                                    .fetch_add(a.duplicates as u64, Ordering::Relaxed);
                            }
                            let _ = tx.send(res);
                        }
                        Reply::Grant(tx) => {
                            let _ = tx.send(Ok(()));
                        }
                        Reply::Ingest(tx, res) => {
                            let _ = tx.send(res);
                        }
                        Reply::IngestBatch(tx, res) => {
                            let _ = tx.send(res);
                        }
                    }
                }
            }
            Err(e) => {
                // Nothing of this batch is acknowledged. The in-memory view
                // goes back to what it was; the cache is dropped because a
                // partially applied batch cannot happen in sled, but a failed
                // flush leaves us unsure what reached the disk.
                error!(partition = %self.partition, error = %e, "group commit failed");
                self.meta = meta_before;
                self.source_offset = source_before;
                self.dead_letters = dead_before;
                for t in grants_added {
                    self.grants.remove(&t);
                }
                self.cache.clear();
                let msg = e.to_string();
                for r in replies {
                    match r {
                        Reply::Append(tx, res) => {
                            let _ = tx.send(res.and(Err(AppendError::Storage(msg.clone()))));
                        }
                        Reply::Grant(tx) => {
                            let _ = tx.send(Err(msg.clone()));
                        }
                        Reply::Ingest(tx, _) => {
                            let _ = tx.send(Err(AppendError::Storage(msg.clone())));
                        }
                        Reply::IngestBatch(tx, _) => {
                            let _ = tx.send(Err(AppendError::Storage(msg.clone())));
                        }
                    }
                }
            }
        }
    }

    /// Take a twin's record out of the batch being built, the cache, or the
    /// tree (moved, not cloned: its state can be large). A refused request
    /// gives it back with [`Writer::put_back`].
    fn take_record(
        &mut self,
        twin: &TwinId,
        pending: &mut Pending,
    ) -> Result<(TwinRecord, Origin), AppendError> {
        if let Some(r) = pending.dirty.remove(twin) {
            return Ok((r, Origin::Pending));
        }
        if let Some(r) = self.cache.remove(twin) {
            return Ok((r, Origin::Cache));
        }
        match self.tree.get(keys::twin(twin)) {
            Ok(Some(v)) => codec::decode(&v)
                .map(|r| (r, Origin::Disk))
                .map_err(|e| AppendError::Storage(format!("damaged twin record of {twin:?}: {e}"))),
            Ok(None) => Ok((TwinRecord::default(), Origin::Disk)),
            Err(e) => Err(AppendError::Storage(e.to_string())),
        }
    }

    fn put_back(&mut self, twin: &TwinId, rec: TwinRecord, origin: Origin, pending: &mut Pending) {
        match origin {
            Origin::Pending => {
                pending.dirty.insert(twin.clone(), rec);
            }
            Origin::Cache => {
                self.cache.insert(twin.clone(), rec);
            }
            Origin::Disk => {}
        }
    }

    fn grant(
        &mut self,
        token: FencingToken,
        scope: Scope,
        holder: String,
        pending: &mut Pending,
    ) -> Result<(), AppendError> {
        match &scope {
            Scope::Partition(_) => self.meta.fence = self.meta.fence.max(token.0),
            Scope::Twin(twin) => {
                let (mut rec, _) = self.take_record(twin, pending)?;
                rec.fence = rec.fence.max(token.0);
                pending.dirty.insert(twin.clone(), rec);
            }
        }
        let g = TokenGrant { scope, holder };
        pending
            .batch
            .insert(&keys::grant(token.0)[..], codec::encode(&g));
        self.grants.insert(token.0, g);
        pending.grants_added.push(token.0);
        debug!(partition = %self.partition, token = token.0, "fence raised by grant");
        Ok(())
    }

    /// Check one append request and stage it. Everything is checked before
    /// anything is staged, so a refused request leaves no trace.
    fn append(
        &mut self,
        cmd: &AppendReq,
        pending: &mut Pending,
        offset: Option<u64>,
    ) -> Result<Appended, AppendError> {
        let r = self.try_append(cmd, pending);
        if let Err(e) = &r {
            // For HTTP the store refines NotIssued (it may be WrongScope) and
            // counts the final reason itself.
            let refined_later = offset.is_none() && matches!(e, AppendError::NotIssued { .. });
            if refined_later {
                return r;
            }
            self.shared.metrics.rejected(e.reason());
            if !matches!(e, AppendError::Storage(_) | AppendError::Closed) {
                self.shared.rejections.push(Rejection {
                    at_ms: now_ms(),
                    source: if offset.is_some() { "kafka" } else { "http" },
                    partition: self.partition,
                    offset,
                    twin: cmd.twin.clone(),
                    token: cmd.token,
                    reason: e.reason(),
                    detail: e.to_string(),
                });
            }
        }
        r
    }

    /// Apply, drop or dead-letter one source record and advance the stored
    /// source offset, all staged in the current batch.
    fn ingest(
        &mut self,
        offset: u64,
        record: IngestRecord,
        pending: &mut Pending,
    ) -> Result<IngestOutcome, AppendError> {
        if let Some(e) = &pending.ingest_failed {
            return Err(e.clone());
        }
        let r = self.ingest_one(offset, record, pending);
        if let Err(e) = &r {
            pending.ingest_failed = Some(e.clone());
        }
        r
    }

    fn ingest_one(
        &mut self,
        offset: u64,
        record: IngestRecord,
        pending: &mut Pending,
    ) -> Result<IngestOutcome, AppendError> {
        if self.source_offset.is_some_and(|o| offset <= o) {
            return Ok(IngestOutcome::AlreadyApplied);
        }
        let outcome = match record {
            IngestRecord::Append {
                twin,
                token,
                events,
            } => {
                let req = AppendReq {
                    twin,
                    token,
                    events,
                    if_match: None,
                };
                match self.append(&req, pending, Some(offset)) {
                    Ok(a) => IngestOutcome::Applied(a),
                    Err(e @ (AppendError::Storage(_) | AppendError::Closed)) => return Err(e),
                    Err(e) if is_drop(&e) => IngestOutcome::Dropped(e),
                    Err(e) => {
                        let reason = e.reason().to_owned();
                        self.stage_dead_letter(
                            DeadLetter {
                                partition: self.partition.0,
                                offset,
                                key: Some(req.twin.to_string()),
                                reason: reason.clone(),
                                detail: e.to_string(),
                                headers: Vec::new(),
                                value: Vec::new(),
                                value_len: 0,
                                at_ms: now_ms(),
                            },
                            pending,
                        );
                        IngestOutcome::DeadLettered { reason }
                    }
                }
            }
            IngestRecord::Dead(mut dl) => {
                dl.partition = self.partition.0;
                dl.offset = offset;
                dl.at_ms = now_ms();
                dl.value.truncate(DEAD_LETTER_VALUE_BYTES);
                let reason = dl.reason.clone();
                self.shared.metrics.rejected("dead_letter");
                self.stage_dead_letter(dl, pending);
                IngestOutcome::DeadLettered { reason }
            }
        };
        self.source_offset = Some(offset);
        Ok(outcome)
    }

    fn stage_dead_letter(&mut self, dl: DeadLetter, pending: &mut Pending) {
        pending
            .batch
            .insert(&keys::dead_letter(dl.offset)[..], codec::encode(&dl));
        self.dead_letters += 1;
        if self.dead_letters > DEAD_LETTERS_PER_PARTITION {
            // Prune the oldest stored one (keys sort by offset).
            if let Some(Ok((k, _))) = self.tree.scan_prefix([keys::DEAD_LETTER]).next() {
                pending.batch.remove(k);
                self.dead_letters -= 1;
            }
        }
    }

    /// Every check of an append after the token's scope: fences, If-Match,
    /// event fields, patches, HLC drift. Dedupe needs no read (the window is
    /// in memory), so nothing after these checks can fail.
    fn check_append(&self, cmd: &AppendReq, rec: &TwinRecord) -> Result<(), AppendError> {
        let fence = rec.fence.max(self.meta.fence);
        if cmd.token.0 < fence {
            return Err(AppendError::Stale {
                token: cmd.token,
                fence: FencingToken(fence),
            });
        }
        if let Some(expected) = cmd.if_match {
            if expected != rec.version {
                return Err(AppendError::VersionMismatch {
                    expected,
                    current: rec.version,
                });
            }
        }
        for e in &cmd.events {
            if e.event_id.is_empty() || e.event_id.len() > MAX_EVENT_ID_LEN {
                return Err(AppendError::BadEvent(format!(
                    "event_id must be 1 to {MAX_EVENT_ID_LEN} bytes"
                )));
            }
            if e.event_type.is_empty() || e.event_type.len() > MAX_EVENT_TYPE_LEN {
                return Err(AppendError::BadEvent(format!(
                    "type must be 1 to {MAX_EVENT_TYPE_LEN} bytes"
                )));
            }
            TwinState::validate(&e.patch)?;
        }
        for e in &cmd.events {
            if let Some(h) = e.hlc {
                self.shared.clock.observe(h)?;
            }
        }
        Ok(())
    }

    fn try_append(
        &mut self,
        cmd: &AppendReq,
        pending: &mut Pending,
    ) -> Result<Appended, AppendError> {
        let t = cmd.token;
        let Some(grant) = self.grants.get(&t.0) else {
            // Not granted for this partition. The store refines this into
            // WrongScope when the token was issued for another scope.
            return Err(AppendError::NotIssued { token: t });
        };
        if !grant.scope.covers(&cmd.twin, self.partition) {
            return Err(AppendError::WrongScope {
                token: t,
                scope: grant.scope.clone(),
                twin: cmd.twin.clone(),
            });
        }
        let holder = grant.holder.clone();
        let partition_scoped = matches!(grant.scope, Scope::Partition(_));
        let (mut rec, origin) = self.take_record(&cmd.twin, pending)?;
        if let Err(e) = self.check_append(cmd, &rec) {
            self.put_back(&cmd.twin, rec, origin, pending);
            return Err(e);
        }

        // All checks passed: stage the events. Nothing below can fail.
        let now_ms = now_ms();
        let mut seqs = Vec::with_capacity(cmd.events.len());
        let mut duplicates = 0;
        for e in &cmd.events {
            let dkey = keys::dedupe(&cmd.twin, &e.event_id);
            // Earlier events of this commit (this request included) first.
            let seen = pending
                .dedupe
                .get(&dkey)
                .copied()
                .or_else(|| self.dedupe.get(&dkey));
            if let Some(seq) = seen {
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
            pending
                .events
                .push(seq, &cmd.twin, &holder, t, now_ms, event);
            pending.dedupe.insert(dkey, seq);
            rec.version = seq;
            rec.events += 1;
            if rec.events % self.shared.snapshot_every == 0 {
                let snap = Snapshot {
                    max_hlc: rec.state.max_hlc(),
                    state: rec.state.clone(),
                };
                pending
                    .batch
                    .insert(keys::snapshot(&cmd.twin, seq), codec::encode(&snap));
            }
            seqs.push(seq);
        }
        rec.fence = rec.fence.max(t.0);
        if partition_scoped {
            self.meta.fence = self.meta.fence.max(t.0);
        }
        let out = Appended {
            partition: self.partition,
            seqs,
            duplicates,
            fence: FencingToken(rec.fence),
            version: rec.version,
        };
        pending.dirty.insert(cmd.twin.clone(), rec);
        Ok(out)
    }
}

/// Where [`Writer::take_record`] found a twin record.
enum Origin {
    Pending,
    Cache,
    Disk,
}
