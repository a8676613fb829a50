//! Event batches (on-disk layout 2, `docs/decisions/0013-event-batches.md`).
//!
//! The events a writer stages for one twin under one token in one group
//! commit, with consecutive sequence numbers, are stored as ONE value under
//! `0x01 ++ first_seq` (as Kafka stores a record batch), with one per-twin
//! history entry `0x03 ++ twin ++ first_seq` per batch. The fields every
//! event of a batch shares (twin, writer, token, append time) are stored
//! once. A read by sequence number seeks to the last batch key at or before
//! it.
//!
//! Event ids are deduplicated against an in-memory window of the
//! partition's most recent events ([`DedupeWindow`]), rebuilt on open from
//! the tail of the log (the ids are in the batches), so dedupe costs neither
//! a key per event nor a read per event.

use std::collections::HashMap;

use bincode::{Decode, Encode};
use palisade_core::{codec, Event, FencingToken, Hlc, TwinId};

use crate::error::OpenError;
use crate::keys;
use crate::wal::{Ops, TreeId};

/// One event of a batch; its sequence number is the batch's first plus its
/// index.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub(crate) struct BatchEvent {
    pub event_id: String,
    pub event_type: String,
    /// Compact JSON text of the merge patch.
    pub patch: String,
    pub hlc: Hlc,
}

/// The value under `0x01 ++ first_seq`.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub(crate) struct EventBatch {
    pub twin_id: TwinId,
    /// The holder of the lease the events were written under.
    pub writer: String,
    pub token: FencingToken,
    /// When the writer staged the batch's first event (ms since 1970).
    pub appended_at_ms: u64,
    pub events: Vec<BatchEvent>,
}

impl EventBatch {
    /// Sequence number of the batch's last event.
    pub fn last_seq(&self, first: u64) -> u64 {
        first + (self.events.len() as u64).saturating_sub(1)
    }

    /// The batch's events with `seq >= from`, as API events.
    pub fn events_from(&self, first: u64, from: u64) -> impl Iterator<Item = Event> + '_ {
        let skip = usize::try_from(from.saturating_sub(first)).unwrap_or(usize::MAX);
        self.events
            .iter()
            .enumerate()
            .skip(skip)
            .map(move |(i, e)| Event {
                seq: first + i as u64,
                twin_id: self.twin_id.clone(),
                event_id: e.event_id.clone(),
                event_type: e.event_type.clone(),
                patch: e.patch.clone(),
                hlc: e.hlc,
                writer: self.writer.clone(),
                token: self.token,
                appended_at_ms: self.appended_at_ms,
            })
    }
}

/// The batch a writer is filling: staged events are appended to it while
/// they continue it (same twin, same token, next seq); otherwise it is closed
/// and a new one opened.
#[derive(Debug, Default)]
pub(crate) struct Batches {
    done: Vec<(u64, EventBatch)>,
    open: Option<(u64, EventBatch)>,
}

impl Batches {
    /// Stage one event with sequence number `seq`.
    pub fn push(
        &mut self,
        seq: u64,
        twin: &TwinId,
        writer: &str,
        token: FencingToken,
        now_ms: u64,
        event: BatchEvent,
    ) {
        if let Some((first, b)) = &mut self.open {
            if b.twin_id == *twin
                && b.token == token
                && b.writer == writer
                && b.last_seq(*first) + 1 == seq
            {
                b.events.push(event);
                return;
            }
        }
        if let Some(closed) = self.open.take() {
            self.done.push(closed);
        }
        self.open = Some((
            seq,
            EventBatch {
                twin_id: twin.clone(),
                writer: writer.to_owned(),
                token,
                appended_at_ms: now_ms,
                events: vec![event],
            },
        ));
    }

    /// Stage every batch into a commit round's ops: its value, then its
    /// history entry (readers stop at the published head anyway).
    pub fn stage(self, tree: TreeId, ops: &mut Ops) {
        for (first, b) in self.done.into_iter().chain(self.open) {
            ops.put(tree, &keys::event(first), &codec::encode(&b));
            ops.put(tree, &keys::history(&b.twin_id, first), &[]);
        }
    }
}

/// Event ids of the partition's recent events, for dedupe: `(twin, event_id)`
/// -> seq. Two generations of at most [`DEDUPE_GENERATION`] new events each;
/// when the current one is full it becomes the previous one and the old
/// previous one is dropped. So the window always holds at least the last
/// `DEDUPE_GENERATION` events and at most twice that.
#[derive(Debug, Default)]
pub(crate) struct DedupeWindow {
    current: HashMap<Vec<u8>, u64>,
    previous: HashMap<Vec<u8>, u64>,
}

/// Events per dedupe generation, per partition: a retry is recognised if its
/// first attempt is among the partition's last 16,384 to 32,768 events.
pub(crate) const DEDUPE_GENERATION: usize = 16_384;

impl DedupeWindow {
    pub fn get(&self, key: &[u8]) -> Option<u64> {
        self.current
            .get(key)
            .or_else(|| self.previous.get(key))
            .copied()
    }

    pub fn insert(&mut self, key: Vec<u8>, seq: u64) {
        if self.current.len() >= DEDUPE_GENERATION {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, seq);
    }

    /// Rebuild from the tail of a partition tree: the ids of its last
    /// `DEDUPE_GENERATION` (or more, up to a whole batch) events.
    pub fn load(tree: &sled::Tree) -> Result<Self, OpenError> {
        let name = || String::from_utf8_lossy(&tree.name()).into_owned();
        let damaged = |key: &[u8], source| OpenError::Damaged {
            tree: name(),
            key: key.to_vec(),
            source,
        };
        let mut tail = Vec::new();
        let mut events = 0;
        for kv in tree.range(keys::event(0)..=keys::event(u64::MAX)).rev() {
            let (k, v) = kv.map_err(|source| OpenError::Sled {
                path: name(),
                source,
            })?;
            let first =
                keys::seq_of_event_key(&k).ok_or_else(|| damaged(&k, codec::CodecError::Empty))?;
            let b: EventBatch = codec::decode(&v).map_err(|e| damaged(&k, e))?;
            events += b.events.len();
            tail.push((first, b));
            if events >= DEDUPE_GENERATION {
                break;
            }
        }
        let mut w = Self::default();
        for (first, b) in tail.into_iter().rev() {
            for (i, e) in b.events.iter().enumerate() {
                w.current
                    .insert(keys::dedupe(&b.twin_id, &e.event_id), first + i as u64);
            }
        }
        Ok(w)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sample() -> EventBatch {
        EventBatch {
            twin_id: TwinId::new("d7").unwrap(),
            writer: "w".into(),
            token: FencingToken(34),
            appended_at_ms: 5,
            events: vec![
                BatchEvent {
                    event_id: "e1".into(),
                    event_type: "t".into(),
                    patch: r#"{"a":1}"#.into(),
                    hlc: Hlc {
                        time: 1,
                        id: [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    },
                },
                BatchEvent {
                    event_id: "e2".into(),
                    event_type: "t".into(),
                    patch: "{}".into(),
                    hlc: Hlc {
                        time: 300,
                        id: [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    },
                },
            ],
        }
    }

    /// Golden bytes of an event batch: if this fails, the on-disk layout
    /// changed. Bump `keys::LAYOUT_VERSION` and update docs/on-disk-format.md.
    #[test]
    fn event_batch_golden_bytes() {
        let bytes = codec::encode(&sample());
        let id2 = [vec![2], vec![0; 15]].concat();
        let want: Vec<u8> = [
            vec![1],             // value encoding version
            vec![2, b'd', b'7'], // twin_id
            vec![1, b'w'],       // writer
            vec![34],            // token
            vec![5],             // appended_at_ms
            vec![2],             // 2 events
            vec![2, b'e', b'1'], // event_id
            vec![1, b't'],       // event_type
            [vec![7], br#"{"a":1}"#.to_vec()].concat(),
            vec![1],     // hlc.time
            id2.clone(), // hlc.id
            vec![2, b'e', b'2'],
            vec![1, b't'],
            vec![2, b'{', b'}'],
            vec![251, 44, 1], // hlc.time 300
            id2,
        ]
        .concat();
        assert_eq!(bytes, want);
        assert_eq!(codec::decode::<EventBatch>(&bytes).unwrap(), sample());
    }

    #[test]
    fn batch_events_get_consecutive_seqs() {
        let b = sample();
        let all: Vec<u64> = b.events_from(300, 0).map(|e| e.seq).collect();
        assert_eq!(all, [300, 301]);
        let tail: Vec<_> = b.events_from(300, 301).collect();
        assert_eq!(tail.len(), 1);
        assert_eq!(tail[0].event_id, "e2");
        assert_eq!(tail[0].token, FencingToken(34));
        assert_eq!(b.events_from(300, 302).count(), 0);
        assert_eq!(b.last_seq(300), 301);
    }

    #[test]
    fn staging_continues_a_batch_only_for_the_same_twin_token_and_next_seq() {
        let a = TwinId::new("a").unwrap();
        let c = TwinId::new("c").unwrap();
        let ev = || sample().events[0].clone();
        let mut b = Batches::default();
        b.push(1, &a, "w", FencingToken(1), 0, ev());
        b.push(2, &a, "w", FencingToken(1), 0, ev()); // continues
        b.push(3, &c, "w", FencingToken(1), 0, ev()); // other twin
        b.push(4, &c, "w", FencingToken(2), 0, ev()); // other token
        b.push(6, &c, "w", FencingToken(2), 0, ev()); // gap
        let firsts: Vec<(u64, usize)> = b
            .done
            .iter()
            .chain(b.open.as_ref())
            .map(|(f, b)| (*f, b.events.len()))
            .collect();
        assert_eq!(firsts, [(1, 2), (3, 1), (4, 1), (6, 1)]);
    }

    #[test]
    fn dedupe_window_keeps_at_least_one_generation() {
        let mut w = DedupeWindow::default();
        for i in 0..(3 * DEDUPE_GENERATION as u64) {
            w.insert(i.to_be_bytes().to_vec(), i);
        }
        let total = 3 * DEDUPE_GENERATION as u64;
        for i in (total - DEDUPE_GENERATION as u64)..total {
            assert_eq!(w.get(&i.to_be_bytes()), Some(i));
        }
        assert_eq!(w.get(&0u64.to_be_bytes()), None);
        assert!(w.current.len() + w.previous.len() <= 2 * DEDUPE_GENERATION);
    }
}
