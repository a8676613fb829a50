//! Reads: twin state (current or as of a sequence number or HLC time), twin
//! history, partition tails and partition summaries. Reads never pass
//! through the sequencer, and never go past the durable head: the latest
//! state of a recently written twin comes from the read cache, which the
//! commit path fills only after a round is synced and applied; everything
//! else comes from sled, which holds only synced rounds, cut at each
//! partition's published head (a round being applied is not read halfway).
//! Async callers use the `*_async` variants, which run sled reads on tokio's
//! blocking pool (a cache hit needs no disk and is answered at once).

use std::collections::BTreeMap;
use std::sync::Arc;

use palisade_core::{codec, Event, FencingToken, Hlc, PartitionId, Scope, TwinId};
use palisade_lease::Lease;
use palisade_twin::TwinState;

use crate::batch::EventBatch;
use crate::error::ReadError;
use crate::keys;
use crate::records::{PartitionMeta, Snapshot, TwinRecord};
use crate::Store;

/// Which state of a twin to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsOf {
    Latest,
    /// After the twin's events with sequence numbers up to this one.
    Seq(u64),
    /// After the twin's events whose HLC is at or before this time.
    Hlc(Hlc),
}

/// A twin's state as read.
#[derive(Debug, Clone, PartialEq)]
pub struct TwinView {
    pub twin_id: TwinId,
    pub partition: PartitionId,
    /// Sequence number of the latest event included.
    pub version: u64,
    /// The twin's current fence (always the latest, also for time travel).
    pub fence: FencingToken,
    pub state: serde_json::Value,
    /// Per leaf: the JSON Pointer and the HLC of the write that set it.
    pub field_hlcs: BTreeMap<String, Hlc>,
}

/// A partition's summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionInfo {
    pub partition: PartitionId,
    pub fence: FencingToken,
    /// Sequence number of the latest event (0: empty).
    pub head: u64,
    /// The live partition-scoped lease, if any.
    pub owner: Option<Lease>,
}

fn damaged(key: &[u8], source: codec::CodecError) -> ReadError {
    ReadError::Damaged {
        key: key.to_vec(),
        source,
    }
}

fn get_decoded<T: bincode::Decode<()>>(
    tree: &sled::Tree,
    key: &[u8],
) -> Result<Option<T>, ReadError> {
    match tree.get(key)? {
        Some(v) => codec::decode(&v).map(Some).map_err(|e| damaged(key, e)),
        None => Ok(None),
    }
}

/// Run a read on tokio's blocking pool: a sled read may wait for the disk,
/// which on an async worker would stall every connection it serves.
pub(crate) async fn off_worker<T: Send + 'static>(
    read: impl FnOnce() -> Result<T, ReadError> + Send + 'static,
) -> Result<T, ReadError> {
    match tokio::task::spawn_blocking(read).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only when the runtime shuts down under the read.
        Err(e) => Err(ReadError::Storage(sled::Error::Unsupported(format!(
            "the read was cancelled: {e}"
        )))),
    }
}

impl Store {
    fn tree(&self, p: PartitionId) -> Result<&sled::Tree, ReadError> {
        self.trees
            .partitions
            .get(p.0 as usize)
            .ok_or(ReadError::UnknownPartition {
                partition: p.0,
                partitions: self.partitions,
            })
    }

    /// A twin's state; `None` if the twin has no events (as of `at`).
    pub fn twin(&self, twin: &TwinId, at: AsOf) -> Result<Option<TwinView>, ReadError> {
        let partition = self.partition_of(twin);
        let Some(rec) = self.twin_record(partition, twin)? else {
            return Ok(None);
        };
        self.twin_view(partition, twin, &rec, at)
    }

    /// The twin's latest durable record: from the read cache, else sled.
    fn twin_record(
        &self,
        partition: PartitionId,
        twin: &TwinId,
    ) -> Result<Option<Arc<TwinRecord>>, ReadError> {
        if let Some(rec) = self.commit.cache.get(partition, twin) {
            return Ok(Some(rec));
        }
        let tree = self.tree(partition)?;
        Ok(get_decoded::<TwinRecord>(tree, &keys::twin(twin))?.map(Arc::new))
    }

    fn twin_view(
        &self,
        partition: PartitionId,
        twin: &TwinId,
        rec: &TwinRecord,
        at: AsOf,
    ) -> Result<Option<TwinView>, ReadError> {
        if rec.version == 0 {
            return Ok(None);
        }
        let tree = self.tree(partition)?;
        match at {
            AsOf::Seq(s) if s < rec.version => self.history_ready(partition, s)?,
            AsOf::Hlc(_) => self.history_ready(partition, rec.version)?,
            _ => {}
        }
        let past;
        let (version, state) = match at {
            AsOf::Latest => (rec.version, &rec.state),
            AsOf::Seq(s) if s >= rec.version => (rec.version, &rec.state),
            AsOf::Seq(s) => {
                past = self.state_at_seq(tree, twin, s)?;
                (past.0, &past.1)
            }
            AsOf::Hlc(h) => {
                past = self.state_at_hlc(tree, twin, h)?;
                (past.0, &past.1)
            }
        };
        if version == 0 {
            return Ok(None);
        }
        Ok(Some(TwinView {
            twin_id: twin.clone(),
            partition,
            version,
            fence: FencingToken(rec.fence),
            field_hlcs: state.field_hlcs(),
            state: state.to_json(),
        }))
    }

    /// Partition `p`'s published durable head: reads never go past it.
    fn head(&self, p: PartitionId) -> u64 {
        self.heads.get(p.0 as usize).map_or(0, |h| *h.borrow())
    }

    /// Latest snapshot at or before `seq`, then the twin's later events up to `seq`.
    fn state_at_seq(
        &self,
        tree: &sled::Tree,
        twin: &TwinId,
        seq: u64,
    ) -> Result<(u64, TwinState), ReadError> {
        let seq = seq.min(self.head(self.partition_of(twin)));
        let (mut version, mut state) = (0, TwinState::new());
        if let Some(kv) = tree
            .range(keys::snapshot_prefix(twin)..=keys::snapshot(twin, seq))
            .next_back()
        {
            let (k, v) = kv?;
            let snap: Snapshot = codec::decode(&v).map_err(|e| damaged(&k, e))?;
            version = keys::trailing_seq(&k).unwrap_or(0);
            state = snap.state;
        }
        for ev in self.twin_history(tree, twin, version, seq)? {
            let ev = ev?;
            apply_event(&mut state, &ev)?;
            version = ev.seq;
        }
        Ok((version, state))
    }

    /// Latest snapshot whose events are all at or before `at`, then every
    /// later event of the twin that is at or before `at` (late arrivals
    /// included: HLC order, not arrival order, decides).
    fn state_at_hlc(
        &self,
        tree: &sled::Tree,
        twin: &TwinId,
        at: Hlc,
    ) -> Result<(u64, TwinState), ReadError> {
        let head = self.head(self.partition_of(twin));
        let (mut version, mut state, mut from) = (0, TwinState::new(), 0);
        for kv in tree.scan_prefix(keys::snapshot_prefix(twin)).rev() {
            let (k, v) = kv?;
            if keys::trailing_seq(&k).is_none_or(|s| s > head) {
                continue;
            }
            let snap: Snapshot = codec::decode(&v).map_err(|e| damaged(&k, e))?;
            if snap.max_hlc.is_none_or(|m| m <= at) {
                from = keys::trailing_seq(&k).unwrap_or(0);
                version = from;
                state = snap.state;
                break;
            }
        }
        for ev in self.twin_history(tree, twin, from, u64::MAX)? {
            let ev = ev?;
            if ev.hlc <= at {
                apply_event(&mut state, &ev)?;
                version = version.max(ev.seq);
            }
        }
        Ok((version, state))
    }

    /// The twin's events with `after < seq <= upto`, in sequence order: its
    /// history entries (one per event batch) from the last one at or before
    /// `after + 1`, each batch read and cut to the range.
    fn twin_history<'a>(
        &self,
        tree: &'a sled::Tree,
        twin: &TwinId,
        after: u64,
        upto: u64,
    ) -> Result<impl Iterator<Item = Result<Event, ReadError>> + 'a, ReadError> {
        let upto = upto.min(self.head(self.partition_of(twin)));
        let from = after.saturating_add(1);
        let empty = after >= upto;
        // The batch holding `from` may start before it.
        let start = match tree
            .range(keys::history(twin, 0)..=keys::history(twin, from))
            .next_back()
        {
            Some(kv) => kv?.0.to_vec(),
            None => keys::history(twin, 0),
        };
        let end = keys::history(twin, upto);
        Ok(tree
            .range(start..=end)
            .take_while(move |_| !empty)
            .map(move |kv| -> Result<Vec<Event>, ReadError> {
                let (k, _) = kv?;
                let first = keys::trailing_seq(&k).unwrap_or(0);
                let key = keys::event(first);
                let b = get_decoded::<EventBatch>(tree, &key)?
                    .ok_or_else(|| damaged(&key, codec::CodecError::Empty))?;
                Ok(b.events_from(first, from)
                    .take_while(|e| e.seq <= upto)
                    .collect())
            })
            .flat_map(|r| match r {
                Ok(events) => events.into_iter().map(Ok).collect::<Vec<_>>(),
                Err(e) => vec![Err(e)],
            }))
    }

    /// Up to `limit` events of a twin with sequence numbers after `after`.
    pub fn twin_events(
        &self,
        twin: &TwinId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, ReadError> {
        let p = self.partition_of(twin);
        self.history_ready(p, after.saturating_add(1))?;
        let tree = self.tree(p)?;
        self.twin_history(tree, twin, after, u64::MAX)?
            .take(limit)
            .collect()
    }

    /// Up to `limit` events of a partition with sequence numbers after `after`.
    pub fn partition_events(
        &self,
        p: PartitionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, ReadError> {
        let tree = self.tree(p)?;
        let head = self.head(p);
        if after >= head {
            return Ok(Vec::new());
        }
        self.history_ready(p, after + 1)?;
        let from = after + 1;
        // The batch holding `from` may start before it.
        let start = match tree.range(keys::event(0)..=keys::event(from)).next_back() {
            Some(kv) => kv?.0.to_vec(),
            None => keys::event(from).to_vec(),
        };
        let mut out = Vec::with_capacity(limit.min(1024));
        for kv in tree.range(start..=keys::event(head).to_vec()) {
            if out.len() >= limit {
                break;
            }
            let (k, v) = kv?;
            let first = keys::seq_of_event_key(&k).unwrap_or(0);
            let b: EventBatch = codec::decode(&v).map_err(|e| damaged(&k, e))?;
            out.extend(
                b.events_from(first, from)
                    .take_while(|e| e.seq <= head)
                    .take(limit - out.len()),
            );
        }
        Ok(out)
    }

    /// Every partition's fence, head and owner.
    pub fn partition_infos(&self) -> Result<Vec<PartitionInfo>, ReadError> {
        let mut out = Vec::with_capacity(self.trees.partitions.len());
        for (i, tree) in self.trees.partitions.iter().enumerate() {
            let p = PartitionId(u32::try_from(i).unwrap_or(u32::MAX));
            let meta: PartitionMeta = get_decoded(tree, &keys::META_KEY)?.unwrap_or_default();
            out.push(PartitionInfo {
                partition: p,
                fence: meta.fence(),
                head: meta.head,
                owner: self.lease_holder(&Scope::Partition(p)),
            });
        }
        Ok(out)
    }

    /// [`Store::twin`] on tokio's blocking pool, for async callers (HTTP).
    pub async fn twin_async(
        self: &Arc<Self>,
        twin: &TwinId,
        at: AsOf,
    ) -> Result<Option<TwinView>, ReadError> {
        let partition = self.partition_of(twin);
        if let (AsOf::Latest, Some(rec)) = (at, self.commit.cache.get(partition, twin)) {
            return self.twin_view(partition, twin, &rec, at);
        }
        let (store, twin) = (self.clone(), twin.clone());
        off_worker(move || store.twin(&twin, at)).await
    }

    /// [`Store::twin_events`] on tokio's blocking pool.
    pub async fn twin_events_async(
        self: &Arc<Self>,
        twin: &TwinId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, ReadError> {
        let (store, twin) = (self.clone(), twin.clone());
        off_worker(move || store.twin_events(&twin, after, limit)).await
    }

    /// [`Store::partition_events`] on tokio's blocking pool.
    pub async fn partition_events_async(
        self: &Arc<Self>,
        p: PartitionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, ReadError> {
        let store = self.clone();
        off_worker(move || store.partition_events(p, after, limit)).await
    }

    /// [`Store::partition_infos`] on tokio's blocking pool.
    pub async fn partition_infos_async(self: &Arc<Self>) -> Result<Vec<PartitionInfo>, ReadError> {
        let store = self.clone();
        off_worker(move || store.partition_infos()).await
    }

    /// [`Store::dead_letters`] on tokio's blocking pool.
    pub async fn dead_letters_async(
        self: &Arc<Self>,
        partition: Option<u32>,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<crate::DeadLetter>, ReadError> {
        let store = self.clone();
        off_worker(move || store.dead_letters(partition, after, limit)).await
    }

    /// A twin's current fence (0 if no grant or write has touched it).
    pub fn twin_fence(&self, twin: &TwinId) -> Result<FencingToken, ReadError> {
        Ok(FencingToken(
            self.twin_record(self.partition_of(twin), twin)?
                .map_or(0, |r| r.fence),
        ))
    }
}

fn apply_event(state: &mut TwinState, ev: &Event) -> Result<(), ReadError> {
    let key = keys::event(ev.seq);
    let patch = ev
        .patch_json()
        .map_err(|e| damaged(&key, codec::CodecError::TrailingBytes { extra: e.column() }))?;
    state
        .apply(&patch, ev.hlc)
        .map_err(|_| damaged(&key, codec::CodecError::Empty))
}
