//! The refusal journal: every write the store refused (HTTP and Kafka,
//! stale tokens, tokens never issued, tokens of another scope, bad events
//! ...), kept durably per partition so an operator can reconcile what a
//! paused worker tried to do after the fact, across restarts
//! (`docs/decisions/0024-refusal-journal.md`).
//!
//! Entries live in their own sled tree (`refusals`), keyed
//! `partition:u32 BE ++ seq:u64 BE` (`docs/on-disk-format.md`). They are
//! written through the store's commit path: the sequencer stages an entry
//! in the very round whose refusal it records, so the entry is durable
//! before the refusal is answered (an append's reply waits for its round),
//! and a Kafka record's entry is durable with its offset advance. Only
//! `token_not_issued` refined by the store after the reply is staged in the
//! next round, which the store waits for before answering.
//!
//! Bounded: each partition keeps its newest `max_per_partition` entries
//! ([`DEFAULT_REFUSALS_PER_PARTITION`]); staging an entry past the cap stages
//! the removal of the oldest in the same round.

use std::sync::Mutex;

use bincode::{Decode, Encode};
use palisade_core::{codec, FencingToken, NewEvent, PartitionId, TwinId};
use sha2::{Digest, Sha256};

use crate::wal::TreeId;
use crate::writer::RawWrite;

/// Entries kept per partition by default; the oldest are pruned past this.
pub const DEFAULT_REFUSALS_PER_PARTITION: u64 = 10_000;
/// Longest free-text field kept (detail, holder), in bytes.
const MAX_TEXT: usize = 512;
/// Most event ids kept per entry: the digest covers all of them.
const MAX_EVENT_IDS: usize = 64;

/// Where a refused write came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum RefusalSource {
    Http,
    Kafka,
}

impl RefusalSource {
    pub fn name(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Kafka => "kafka",
        }
    }
}

/// One refused write.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Refusal {
    /// Position in its partition's journal (assigned when staged;
    /// increasing, never reused).
    pub seq: u64,
    /// Wall-clock milliseconds since 1970 when it was refused.
    pub at_ms: u64,
    pub partition: u32,
    pub twin: String,
    pub source: RefusalSource,
    /// Kafka: the source partition and offset of the record (for a record a
    /// cluster node forwarded, the original's).
    pub kafka: Option<(u32, u64)>,
    /// The refused fencing token.
    pub token: u64,
    /// The fence the token hit (`stale_token` only).
    pub fence: Option<u64>,
    /// The holder the token was granted to, if this partition knows it.
    pub holder: Option<String>,
    /// Stable reason name (`stale_token`, `token_not_issued`, ...).
    pub reason: String,
    /// For people: the error message.
    pub detail: String,
    /// The ids of the refused events (at most 64 kept), in order.
    pub event_ids: Vec<String>,
    pub event_count: u32,
    /// SHA-256 of the events' canonical JSON ([`payload_digest`]).
    pub digest: [u8; 32],
}

fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// JSON with object keys sorted at every depth and no whitespace, so equal
/// payloads digest equally whatever order their writer sent the keys in.
fn canonical(v: &serde_json::Value, out: &mut String) {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push(':');
                if let Some(v) = m.get(k) {
                    canonical(v, out);
                }
            }
            out.push('}');
        }
        serde_json::Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// SHA-256 of the events' canonical JSON: an array of
/// `{"event_id","hlc"?,"patch","type"}` objects, keys sorted at every depth,
/// no whitespace (`docs/http-api.md`, refusals). A client holding what it
/// sent can compute the same digest and match it.
pub fn payload_digest(events: &[NewEvent]) -> [u8; 32] {
    let arr = events
        .iter()
        .map(|e| {
            let mut o = serde_json::Map::new();
            o.insert("event_id".into(), e.event_id.clone().into());
            o.insert("type".into(), e.event_type.clone().into());
            o.insert("patch".into(), serde_json::Value::Object(e.patch.clone()));
            if let Some(h) = &e.hlc {
                o.insert("hlc".into(), h.to_string().into());
            }
            serde_json::Value::Object(o)
        })
        .collect();
    let mut s = String::new();
    canonical(&serde_json::Value::Array(arr), &mut s);
    Sha256::digest(s.as_bytes()).into()
}

impl Refusal {
    /// An entry for a refused append (`seq` is assigned when staged).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        partition: PartitionId,
        twin: &TwinId,
        source: RefusalSource,
        kafka: Option<(u32, u64)>,
        token: FencingToken,
        error: &crate::AppendError,
        holder: Option<&str>,
        events: &[NewEvent],
    ) -> Self {
        let fence = match error {
            crate::AppendError::Stale { fence, .. } => Some(fence.0),
            _ => None,
        };
        Self {
            seq: 0,
            at_ms: crate::ingest::now_ms(),
            partition: partition.0,
            twin: twin.to_string(),
            source,
            kafka,
            token: token.0,
            fence,
            holder: holder.map(|h| truncated(h, MAX_TEXT)),
            reason: error.reason().to_owned(),
            detail: truncated(&error.to_string(), MAX_TEXT),
            event_ids: events
                .iter()
                .take(MAX_EVENT_IDS)
                .map(|e| truncated(&e.event_id, palisade_core::MAX_EVENT_ID_LEN))
                .collect(),
            event_count: u32::try_from(events.len()).unwrap_or(u32::MAX),
            digest: payload_digest(events),
        }
    }
}

/// `partition:u32 BE ++ seq:u64 BE`.
pub(crate) fn key(partition: u32, seq: u64) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(&partition.to_be_bytes());
    k[4..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// The seq at the end of a journal key.
fn seq_of(k: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(k.get(4..12)?.try_into().ok()?))
}

/// The next seq and the oldest kept seq of one partition's journal.
#[derive(Debug, Clone, Copy)]
struct Span {
    next: u64,
    first: u64,
}

/// Partition `p`'s span as the tree holds it.
fn span_in(tree: &sled::Tree, p: u32) -> Result<Span, sled::Error> {
    let lo = key(p, 0);
    let hi = key(p, u64::MAX);
    let last = tree.range(lo..=hi).next_back().transpose()?;
    let first = tree.range(lo..=hi).next().transpose()?;
    let next = last
        .and_then(|(k, _)| seq_of(&k))
        .map_or(1, |s| s.saturating_add(1));
    let first = first.and_then(|(k, _)| seq_of(&k)).unwrap_or(next);
    Ok(Span { next, first })
}

/// The journal: its tree and each partition's seq span. Shared by the
/// sequencer (which stages most entries) and the store (which stages the
/// refined `token_not_issued` ones).
#[derive(Debug)]
pub(crate) struct RefusalJournal {
    tree: sled::Tree,
    spans: Mutex<Vec<Span>>,
    cap: u64,
}

impl RefusalJournal {
    /// Load each partition's span from the tree (after the log's replay).
    pub fn open(tree: sled::Tree, partitions: u32, cap: u64) -> Result<Self, sled::Error> {
        let mut spans = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            spans.push(span_in(&tree, p)?);
        }
        Ok(Self {
            tree,
            spans: Mutex::new(spans),
            cap: cap.max(1),
        })
    }

    /// Load partition `p`'s span again from the tree (its entries were
    /// replaced by a partition snapshot's, `handoff.rs`).
    pub fn reload(&self, p: u32) -> Result<(), sled::Error> {
        let span = span_in(&self.tree, p)?;
        if let Some(s) = self
            .spans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(p as usize)
        {
            *s = span;
        }
        Ok(())
    }

    /// The writes that record `r` (its seq assigned here) and prune its
    /// partition's oldest entries past the cap.
    pub fn stage(&self, mut r: Refusal) -> Vec<RawWrite> {
        let mut spans = self
            .spans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(span) = spans.get_mut(r.partition as usize) else {
            return Vec::new();
        };
        r.seq = span.next;
        span.next += 1;
        let mut writes = vec![RawWrite {
            tree: TreeId::REFUSALS,
            key: key(r.partition, r.seq).to_vec(),
            value: Some(codec::encode(&r)),
        }];
        // Keep seqs [next - cap, next): by key range, not by what sled holds
        // yet, so entries of rounds still being synced are pruned too.
        let keep_from = span.next.saturating_sub(self.cap);
        for seq in span.first..keep_from {
            writes.push(RawWrite {
                tree: TreeId::REFUSALS,
                key: key(r.partition, seq).to_vec(),
                value: None,
            });
        }
        span.first = span.first.max(keep_from);
        writes
    }

    /// A partition's newest durable entries, newest first, optionally of
    /// one twin only (a scan of at most the partition's cap).
    pub fn list(
        &self,
        partition: u32,
        twin: Option<&TwinId>,
        limit: usize,
    ) -> Result<Vec<Refusal>, crate::ReadError> {
        let mut out = Vec::new();
        let range = self
            .tree
            .range(key(partition, 0)..=key(partition, u64::MAX));
        for kv in range.rev() {
            if out.len() >= limit {
                break;
            }
            let (k, v) = kv?;
            let r: Refusal = codec::decode(&v).map_err(|source| crate::ReadError::Damaged {
                key: k.to_vec(),
                source,
            })?;
            if twin.is_some_and(|t| t.as_str() != r.twin) {
                continue;
            }
            out.push(r);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ev(id: &str, patch: serde_json::Value) -> NewEvent {
        NewEvent {
            event_id: id.into(),
            event_type: "t".into(),
            patch: patch.as_object().cloned().unwrap(),
            hlc: None,
        }
    }

    #[test]
    fn the_digest_ignores_key_order_and_sees_every_byte() {
        let a = payload_digest(&[ev("e1", serde_json::json!({"a": 1, "b": {"y": 2, "x": 1}}))]);
        let mut m = serde_json::Map::new();
        let mut inner = serde_json::Map::new();
        inner.insert("x".into(), 1.into());
        inner.insert("y".into(), 2.into());
        m.insert("b".into(), inner.into());
        m.insert("a".into(), 1.into());
        let b = payload_digest(&[ev("e1", serde_json::Value::Object(m))]);
        assert_eq!(a, b);
        let c = payload_digest(&[ev("e1", serde_json::json!({"a": 2, "b": {"y": 2, "x": 1}}))]);
        assert_ne!(a, c);
        // The documented form, so a client can recompute it.
        let doc = r#"[{"event_id":"e1","patch":{"a":1},"type":"t"}]"#;
        assert_eq!(
            payload_digest(&[ev("e1", serde_json::json!({"a": 1}))]),
            <[u8; 32]>::from(Sha256::digest(doc.as_bytes()))
        );
    }

    /// Entries of both staging paths (the sequencer's round, the store's
    /// refined `token_not_issued`) are durable, listed newest first,
    /// pruned past the cap, and survive a reopen with seqs still growing.
    #[tokio::test]
    async fn the_journal_is_bounded_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let config = || crate::StoreConfig {
            partitions: Some(1),
            refusals_per_partition: 3,
            ..crate::StoreConfig::default()
        };
        let twin = TwinId::new("pump-1").unwrap();
        {
            let store = crate::Store::open(dir.path(), config()).unwrap();
            let lease = store
                .acquire(palisade_lease::AcquireRequest {
                    scope: palisade_core::Scope::Twin(twin.clone()),
                    holder: "worker-a".into(),
                    ttl_ms: 60_000,
                    purpose: Default::default(),
                })
                .await
                .unwrap();
            for i in 0..4 {
                let e = vec![ev(&format!("m{i}"), serde_json::json!({"i": i}))];
                let r = store.append(twin.clone(), lease.token, e, Some(99)).await;
                assert!(matches!(r, Err(crate::AppendError::VersionMismatch { .. })));
            }
            let e = vec![ev("x", serde_json::json!({"a": 1}))];
            let r = store.append(twin.clone(), FencingToken(999), e, None).await;
            assert!(matches!(r, Err(crate::AppendError::NotIssued { .. })));
            let list = store.refusals_of_twin(&twin, 10).unwrap();
            let ids: Vec<_> = list.iter().map(|r| r.event_ids[0].as_str()).collect();
            assert_eq!(ids, ["x", "m3", "m2"]);
            assert_eq!(list[0].reason, "token_not_issued");
            assert_eq!(list[1].holder.as_deref(), Some("worker-a"));
            assert_eq!(list[1].source, RefusalSource::Http);
            store.close().await;
        }
        let store = crate::Store::open(dir.path(), config()).unwrap();
        let list = store.refusals_of_partition(PartitionId(0), 10).unwrap();
        let seqs: Vec<_> = list.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [5, 4, 3]);
        assert!(store
            .refusals_of_twin(&TwinId::new("other").unwrap(), 10)
            .unwrap()
            .is_empty());
        assert!(store.refusals_of_partition(PartitionId(1), 10).is_err());
        store.close().await;
    }

    /// The sizes `docs/on-disk-format.md` quotes for the bound's cost.
    #[test]
    fn entries_are_small_and_their_size_is_bounded() {
        let twin = TwinId::new("pump-0007-line-3").unwrap();
        let stale = crate::AppendError::Stale {
            token: FencingToken(1_234),
            fence: FencingToken(1_240),
        };
        let typical = Refusal::new(
            PartitionId(3),
            &twin,
            RefusalSource::Http,
            None,
            FencingToken(1_234),
            &stale,
            Some("worker-a"),
            &[ev(
                "0b6f3c2e-7d1a-4f0e-9a51-2c8d",
                serde_json::json!({"rpm": 1}),
            )],
        );
        let len = codec::encode(&typical).len();
        assert!(len < 300, "typical entry {len} bytes");
        let long = "x".repeat(4096);
        let many: Vec<NewEvent> = (0..500)
            .map(|i| ev(&format!("{i}{long}"), serde_json::json!({})))
            .collect();
        let worst = Refusal::new(
            PartitionId(3),
            &TwinId::new("t".repeat(palisade_core::MAX_TWIN_ID_LEN)).unwrap(),
            RefusalSource::Kafka,
            Some((u32::MAX, u64::MAX)),
            FencingToken(u64::MAX),
            &crate::AppendError::BadEvent(long.clone()),
            Some(&long),
            &many,
        );
        let len = codec::encode(&worst).len();
        assert!(len < 10 * 1024, "largest entry {len} bytes");
        assert_eq!(worst.event_count, 500);
        assert_eq!(worst.event_ids.len(), MAX_EVENT_IDS);
    }

    #[test]
    fn keys_are_as_documented() {
        assert_eq!(key(2, 0x0102), [0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 2]);
        assert!(key(1, u64::MAX) < key(2, 0));
        assert_eq!(seq_of(&key(9, 77)), Some(77));
    }
}
