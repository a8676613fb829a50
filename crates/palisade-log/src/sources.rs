//! The sequencer's bookkeeping of Kafka sources (the `ingest` tree): per
//! source partition, the last offset handled and the dead letters kept;
//! in cluster mode, the forward chains and relay marks
//! (`docs/decisions/0018-ingest-any-partition.md`).
//!
//! A record of source partition k is applied to the store partition of its
//! twin, whichever that is. Its offset is set here and written into the same
//! commit round as what the record produced in that partition (a round is
//! one write-ahead log record, atomic across partitions), so after a crash
//! either both are on disk or neither is, and a consumer resuming at the
//! stored offset + 1 applies nothing twice and skips nothing.
//!
//! Like a partition's state, this runs ahead of the disk by the rounds in
//! flight (safe because the store is fail-stop, see `writer.rs`). Values are
//! staged once per round ([`Sources::close`]), not once per record.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use palisade_core::codec;

use crate::error::{AppendError, OpenError};
use crate::ingest::{DeadLetter, Origin, Source, DEAD_LETTERS_PER_PARTITION};
use crate::keys::ingest as keys;
use crate::wal::{Ops, TreeId};

/// (topic, a, b): a chain (from, to) or a relay mark (at, origin).
type Pair = (Arc<str>, u32, u32);

/// What to do with a forwarded record, given the last origin offset its
/// partition decided from the same origin partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RelayCheck {
    /// The next one of the chain: decide it.
    Next,
    /// At or below the last decided: a retry; nothing to do.
    Duplicate,
    /// It follows a forward this partition has not seen (one lost in
    /// between): set aside, its forwarder sends both again.
    Gap,
}

/// The relay rule, pure: `last` is the origin offset of the last forward
/// from the same origin partition decided here.
pub(crate) fn relay_check(last: Option<u64>, origin: &Origin) -> RelayCheck {
    if last.is_some_and(|l| origin.offset <= l) {
        return RelayCheck::Duplicate;
    }
    if origin.prev == last {
        RelayCheck::Next
    } else {
        RelayCheck::Gap
    }
}

#[derive(Debug, Default)]
pub(crate) struct Sources {
    offsets: HashMap<Source, u64>,
    /// Offsets migrated from layout 2 (topic unknown), by partition.
    legacy: BTreeMap<u32, u64>,
    /// Offsets of the dead letters kept, per source partition, oldest first.
    dead_letters: HashMap<u32, VecDeque<u64>>,
    chains: HashMap<Pair, u64>,
    relays: HashMap<Pair, u64>,
    dirty_offsets: HashSet<Source>,
    dirty_chains: HashSet<Pair>,
    dirty_relays: HashSet<Pair>,
    /// A record of this source failed in the open round (not applied, its
    /// offset not set): later ones of the same source must not pass it.
    failed: HashMap<Source, AppendError>,
}

impl Sources {
    /// Everything the `ingest` tree holds but the dead letters themselves.
    pub fn load(tree: &sled::Tree) -> Result<Self, OpenError> {
        let damaged = |k: &[u8]| OpenError::Damaged {
            tree: "ingest".into(),
            key: k.to_vec(),
            source: codec::CodecError::Empty,
        };
        let sled_err = |source| OpenError::Sled {
            path: "ingest".into(),
            source,
        };
        let mut s = Self::default();
        for kv in tree.iter() {
            let (k, v) = kv.map_err(sled_err)?;
            match k.first().copied() {
                Some(keys::LEGACY_OFFSET) => {
                    let p = k
                        .get(1..5)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map(u32::from_be_bytes)
                        .ok_or_else(|| damaged(&k))?;
                    let o = keys::u64_value(&v).ok_or_else(|| damaged(&k))?;
                    s.legacy.insert(p, o);
                }
                Some(keys::OFFSET) => {
                    let (topic, p) = keys::parse(keys::OFFSET, &k, 1).ok_or_else(|| damaged(&k))?;
                    let o = keys::u64_value(&v).ok_or_else(|| damaged(&k))?;
                    s.offsets.insert(Source::new(topic, p[0]), o);
                }
                Some(keys::DEAD_LETTER) => {
                    let p = k
                        .get(1..5)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map(u32::from_be_bytes)
                        .ok_or_else(|| damaged(&k))?;
                    let o = k
                        .get(5..13)
                        .and_then(keys::u64_value)
                        .ok_or_else(|| damaged(&k))?;
                    s.dead_letters.entry(p).or_default().push_back(o);
                }
                Some(kind @ (keys::CHAIN | keys::RELAY)) => {
                    let (topic, ab) = keys::parse(kind, &k, 2).ok_or_else(|| damaged(&k))?;
                    let o = keys::u64_value(&v).ok_or_else(|| damaged(&k))?;
                    let map = if kind == keys::CHAIN {
                        &mut s.chains
                    } else {
                        &mut s.relays
                    };
                    map.insert((topic.into(), ab[0], ab[1]), o);
                }
                _ => return Err(damaged(&k)),
            }
        }
        Ok(s)
    }

    /// The last offset of `source` handled (applied, dropped, dead-lettered
    /// or forwarded), including rounds not yet durable.
    pub fn offset(&self, source: &Source) -> Option<u64> {
        self.offsets.get(source).copied()
    }

    /// Whether a record of `source` at `offset` was handled before.
    pub fn handled(&self, source: &Source, offset: u64) -> bool {
        self.offset(source).is_some_and(|o| offset <= o)
    }

    pub fn failed(&self, source: &Source) -> Option<&AppendError> {
        self.failed.get(source)
    }

    pub fn fail(&mut self, source: &Source, e: AppendError) {
        self.failed.insert(source.clone(), e);
    }

    /// The record at `offset` of `source` was handled.
    pub fn advance(&mut self, source: &Source, offset: u64) {
        self.offsets.insert(source.clone(), offset);
        self.dirty_offsets.insert(source.clone());
    }

    /// Keep `dl` (at its source partition and offset), pruning the oldest of
    /// that partition past [`DEAD_LETTERS_PER_PARTITION`].
    pub fn stage_dead_letter(&mut self, ops: &mut Ops, dl: &DeadLetter) {
        ops.put(
            TreeId::INGEST,
            &keys::dead_letter(dl.partition, dl.offset),
            &codec::encode(dl),
        );
        let kept = self.dead_letters.entry(dl.partition).or_default();
        kept.push_back(dl.offset);
        while kept.len() as u64 > DEAD_LETTERS_PER_PARTITION {
            if let Some(old) = kept.pop_front() {
                ops.remove(TreeId::INGEST, &keys::dead_letter(dl.partition, old));
            }
        }
    }

    /// The relay rule for a record forwarded to `at` from `origin`.
    pub fn relay(&self, at: &Source, origin: &Origin) -> (RelayCheck, Option<u64>) {
        let last = self
            .relays
            .get(&(at.topic.clone(), at.partition, origin.partition))
            .copied();
        (relay_check(last, origin), last)
    }

    /// `at` decided the forward of `origin`.
    pub fn relayed(&mut self, at: &Source, origin: &Origin) {
        let k = (at.topic.clone(), at.partition, origin.partition);
        self.relays.insert(k.clone(), origin.offset);
        self.dirty_relays.insert(k);
    }

    /// The record at `offset` of `from` was forwarded to partition `to`.
    pub fn forwarded(&mut self, from: &Source, to: u32, offset: u64) {
        let k = (from.topic.clone(), from.partition, to);
        self.chains.insert(k.clone(), offset);
        self.dirty_chains.insert(k);
    }

    /// Whether offsets migrated from layout 2 wait for a topic.
    pub fn has_legacy(&self) -> bool {
        !self.legacy.is_empty()
    }

    /// Give the offsets migrated from layout 2 to `topic` (unless it has
    /// its own already), and delete them. Returns how many were given.
    pub fn claim_legacy(&mut self, topic: &str, ops: &mut Ops) -> usize {
        let topic: Arc<str> = topic.into();
        let mut n = 0;
        for (p, o) in std::mem::take(&mut self.legacy) {
            let s = Source {
                topic: topic.clone(),
                partition: p,
            };
            if !self.offsets.contains_key(&s) {
                self.advance(&s, o);
                n += 1;
            }
            ops.remove(TreeId::INGEST, &keys::legacy_offset(p));
        }
        n
    }

    /// Stage this round's changed values into `ops`; forget the round's
    /// failures.
    pub fn close(&mut self, ops: &mut Ops) {
        for s in self.dirty_offsets.drain() {
            if let Some(o) = self.offsets.get(&s) {
                ops.put(
                    TreeId::INGEST,
                    &keys::offset(&s.topic, s.partition),
                    &o.to_be_bytes(),
                );
            }
        }
        for (kind, dirty, map) in [
            (keys::CHAIN, &mut self.dirty_chains, &self.chains),
            (keys::RELAY, &mut self.dirty_relays, &self.relays),
        ] {
            for k in dirty.drain() {
                if let Some(o) = map.get(&k) {
                    ops.put(
                        TreeId::INGEST,
                        &keys::pair(kind, &k.0, k.1, k.2),
                        &o.to_be_bytes(),
                    );
                }
            }
        }
        self.failed.clear();
    }

    /// Whether anything is staged for the next [`Sources::close`].
    #[cfg(test)]
    pub fn is_dirty(&self) -> bool {
        !(self.dirty_offsets.is_empty()
            && self.dirty_chains.is_empty()
            && self.dirty_relays.is_empty())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn origin(offset: u64, prev: Option<u64>) -> Origin {
        Origin {
            partition: 1,
            offset,
            prev,
        }
    }

    #[test]
    fn relay_rule() {
        assert_eq!(relay_check(None, &origin(5, None)), RelayCheck::Next);
        assert_eq!(relay_check(None, &origin(9, Some(5))), RelayCheck::Gap);
        assert_eq!(relay_check(Some(5), &origin(9, Some(5))), RelayCheck::Next);
        assert_eq!(
            relay_check(Some(5), &origin(5, None)),
            RelayCheck::Duplicate
        );
        assert_eq!(
            relay_check(Some(9), &origin(5, None)),
            RelayCheck::Duplicate
        );
        assert_eq!(relay_check(Some(5), &origin(12, Some(9))), RelayCheck::Gap);
    }

    /// One forward as a receiving partition's log holds it.
    #[derive(Debug, Clone, Copy)]
    struct Forward {
        offset: u64,
        prev: Option<u64>,
    }

    /// A forwarder over one origin partition: `routed` are the origin
    /// offsets whose twin belongs to the receiving partition, in order. It
    /// sends them through a producer that may lose some of a batch while
    /// later ones of it land (a timed-out message: the gap the relay rule
    /// exists for), may crash after a batch landed but before it stored its
    /// offset, and after a loss or a crash resumes at its stored offset
    /// (the first one not confirmed) with its stored chain, as the cluster
    /// ingester does. Returns the receiving log.
    fn forward_log(routed: &[u64], script: &[(usize, u8)]) -> Vec<Forward> {
        let mut log = Vec::new();
        let mut stored = 0usize; // index of the first not confirmed
        let mut chain: Option<u64> = None; // stored with `stored`
        let mut steps = script.iter().copied().cycle().take(64);
        while stored < routed.len() {
            let (batch, fate) = steps.next().unwrap_or((routed.len(), 0));
            let end = (stored + 1 + batch % 5).min(routed.len());
            let mut prev = chain;
            let mut lost = None;
            // fate 1: one of the batch is lost, the others (before and
            // after it) land.
            let victim = stored + usize::from(fate / 4) % (end - stored);
            for (i, &o) in routed.iter().enumerate().take(end).skip(stored) {
                if fate % 4 == 1 && i == victim {
                    lost = Some(i);
                } else {
                    log.push(Forward { offset: o, prev });
                }
                prev = Some(o);
            }
            match (lost, fate % 4) {
                // A loss is seen: nothing of the batch is stored.
                (Some(_), _) => {}
                // A crash after the batch landed, before its offsets were
                // stored: the next life sends it again.
                (None, 2) => {}
                _ => {
                    stored = end;
                    chain = Some(routed[end - 1]);
                }
            }
        }
        log
    }

    proptest! {
        /// Whatever the producer loses or repeats, the receiving partition
        /// decides every routed record exactly once, in origin order.
        #[test]
        fn relays_decide_each_forward_once_in_order(
            gaps in proptest::collection::vec(1u64..5, 1..40),
            script in proptest::collection::vec((0usize..8, 0u8..32), 1..12),
        ) {
            let routed: Vec<u64> = gaps
                .iter()
                .scan(0u64, |o, g| {
                    *o += g;
                    Some(*o)
                })
                .collect();
            let mut sources = Sources::default();
            let at = Source::new("t", 0);
            let mut decided = Vec::new();
            for f in forward_log(&routed, &script) {
                let o = Origin { partition: 1, offset: f.offset, prev: f.prev };
                match sources.relay(&at, &o).0 {
                    RelayCheck::Next => {
                        decided.push(f.offset);
                        sources.relayed(&at, &o);
                    }
                    RelayCheck::Duplicate | RelayCheck::Gap => {}
                }
            }
            prop_assert_eq!(decided, routed);
        }
    }

    #[test]
    fn offsets_are_staged_once_per_round_and_reload() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let tree = db.open_tree("ingest").unwrap();
        let mut s = Sources::default();
        let a = Source::new("t", 0);
        for o in 0..100 {
            s.advance(&a, o);
        }
        s.forwarded(&a, 3, 42);
        s.relayed(&Source::new("t", 3), &origin(7, None));
        let mut ops = Ops::default();
        s.close(&mut ops);
        assert!(!s.is_dirty());
        let applied: Vec<_> = crate::wal::decode_ops(ops.payload())
            .map(Result::unwrap)
            .collect();
        assert_eq!(applied.len(), 3, "one put per changed value: {applied:?}");
        for op in applied {
            if let crate::wal::Op::Put { key, value, .. } = op {
                tree.insert(key, value).unwrap();
            }
        }
        let back = Sources::load(&tree).unwrap();
        assert_eq!(back.offset(&a), Some(99));
        assert!(back.handled(&a, 99) && !back.handled(&a, 100));
        assert_eq!(back.chains.get(&("t".into(), 0, 3)), Some(&42));
        assert_eq!(back.relays.get(&("t".into(), 3, 1)), Some(&7));
    }

    #[test]
    fn legacy_offsets_go_to_the_first_topic_that_claims_them() {
        let mut s = Sources::default();
        s.legacy.insert(0, 10);
        s.legacy.insert(1, 20);
        s.advance(&Source::new("t", 1), 25);
        let mut ops = Ops::default();
        assert_eq!(s.claim_legacy("t", &mut ops), 1);
        assert_eq!(s.offset(&Source::new("t", 0)), Some(10));
        assert_eq!(s.offset(&Source::new("t", 1)), Some(25), "its own wins");
        assert_eq!(s.claim_legacy("u", &mut ops), 0, "claimed once");
        assert_eq!(s.offset(&Source::new("u", 0)), None);
    }

    #[test]
    fn dead_letters_are_pruned_per_source_partition() {
        let mut s = Sources::default();
        let mut ops = Ops::default();
        let dl = |partition, offset| DeadLetter {
            partition,
            offset,
            key: None,
            reason: "r".into(),
            detail: String::new(),
            headers: Vec::new(),
            value: Vec::new(),
            value_len: 0,
            at_ms: 0,
        };
        for o in 0..=DEAD_LETTERS_PER_PARTITION {
            s.stage_dead_letter(&mut ops, &dl(0, o));
        }
        s.stage_dead_letter(&mut ops, &dl(1, 0));
        assert_eq!(s.dead_letters[&0].len() as u64, DEAD_LETTERS_PER_PARTITION);
        assert_eq!(s.dead_letters[&0].front(), Some(&1));
        assert_eq!(s.dead_letters[&1].len(), 1);
    }
}
