//! Key layout of a partition tree. Every key starts with a one-byte record
//! kind; integers are big-endian so keys sort numerically; twin ids are
//! length-prefixed (u16 BE) so that one twin's prefix never matches another
//! twin whose id merely starts with it. Byte-by-byte layout:
//! `docs/on-disk-format.md`.

use palisade_core::TwinId;

/// The store's on-disk layout version, kept in `meta/format`. Layout 2
/// stores events in batches and has no durable dedupe keys
/// (`docs/decisions/0013-event-batches.md`). Layout 3 moves what belongs to
/// a Kafka source partition (its offset, its dead letters) out of the
/// partition trees into the `ingest` tree, keyed by source partition, since
/// a record may now be applied to any store partition
/// (`docs/decisions/0018-ingest-any-partition.md`); a layout-2 store is
/// migrated on open (`migrate.rs`). Value encodings did not change, so every
/// value still starts with `codec::FORMAT_VERSION` (1). Layout 4 adds the
/// `refusals` tree, the durable journal of refused writes
/// (`docs/decisions/0024-refusal-journal.md`); nothing else changed, so a
/// layout-3 store is migrated by marking it 4 (the tree starts empty).
/// Layout 5 adds the `outbox` tree, the effects events declared
/// (`docs/decisions/0030-fenced-outbox.md`); nothing else changed, so a
/// layout-4 (or 3) store is migrated by marking it 5.
pub const LAYOUT_VERSION: u8 = 5;
/// The layout before this one, migrated on open by marking it.
pub const PREVIOUS_LAYOUT_VERSION: u8 = 4;
/// Layout 3 differs from 5 only by trees that start empty: marked too.
pub const LAYOUT_3: u8 = 3;
/// The oldest layout this build migrates from on open (`migrate.rs`).
pub const LAYOUT_2: u8 = 2;

/// `0x01 ++ first_seq` -> `EventBatch`: consecutive events of one twin.
pub(crate) const EVENT: u8 = 0x01;
/// `0x02 ++ twin` -> `TwinRecord` (fence, version, current state).
pub(crate) const TWIN: u8 = 0x02;
/// `0x03 ++ twin ++ first_seq` -> empty: the twin's history index, one
/// entry per event batch.
pub(crate) const HISTORY: u8 = 0x03;
/// `0x04 ++ twin ++ event_id bytes`: the key of the in-memory dedupe window
/// (layout 1 stored it; layout 2 does not).
pub(crate) const DEDUPE: u8 = 0x04;
/// `0x05 ++ twin ++ seq` -> `Snapshot` of the twin's state at that seq.
pub(crate) const SNAPSHOT: u8 = 0x05;
/// `0x06 ++ token` -> `TokenGrant`: a lease grant whose scope this partition enforces.
pub(crate) const GRANT: u8 = 0x06;
/// `0x07` -> `PartitionMeta` (partition fence, head sequence).
pub(crate) const META: u8 = 0x07;

/// Layout 2 only: `0x08` -> u64 BE, the last Kafka offset applied to this
/// partition (Kafka partition p fed Palisade partition p). Moved to the
/// `ingest` tree by the layout-3 migration.
pub(crate) const LEGACY_SOURCE_OFFSET: [u8; 1] = [0x08];
/// Layout 2 only: `0x09 ++ offset` -> `DeadLetter`. Moved to the `ingest`
/// tree by the layout-3 migration.
pub(crate) const LEGACY_DEAD_LETTER: u8 = 0x09;

/// Keys of the `ingest` tree (layout 3): everything the store keeps about
/// its Kafka sources, keyed by source (topic, partition), not by the store
/// partition a record was applied to.
pub(crate) mod ingest {
    /// `0x00 ++ partition:u32` -> u64 BE: an offset migrated from layout 2,
    /// whose topic was never recorded; the first ingester to start claims it
    /// for its topic (`Store::claim_legacy_offsets`).
    pub const LEGACY_OFFSET: u8 = 0x00;
    /// `0x01 ++ topic ++ partition:u32` -> u64 BE: the last offset of that
    /// source partition handled (applied, dropped, dead-lettered, forwarded).
    pub const OFFSET: u8 = 0x01;
    /// `0x02 ++ partition:u32 ++ offset:u64` -> `DeadLetter`.
    pub const DEAD_LETTER: u8 = 0x02;
    /// Cluster mode, forwarding side: `0x03 ++ topic ++ from:u32 ++ to:u32`
    /// -> u64 BE, the origin offset of the last record of partition `from`
    /// forwarded to partition `to` (the `prev` of the next one).
    pub const CHAIN: u8 = 0x03;
    /// Cluster mode, receiving side: `0x04 ++ topic ++ at:u32 ++ origin:u32`
    /// -> u64 BE, the origin offset of the last record forwarded from
    /// partition `origin` that partition `at` decided.
    pub const RELAY: u8 = 0x04;

    fn topic_prefixed(kind: u8, topic: &str, extra: usize) -> Vec<u8> {
        let t = topic.as_bytes();
        let mut k = Vec::with_capacity(3 + t.len() + extra);
        k.push(kind);
        // Kafka topic names are at most 249 bytes.
        let len = u16::try_from(t.len()).unwrap_or(u16::MAX);
        k.extend_from_slice(&len.to_be_bytes());
        k.extend_from_slice(t);
        k
    }

    pub fn legacy_offset(partition: u32) -> [u8; 5] {
        let mut k = [0u8; 5];
        k[0] = LEGACY_OFFSET;
        k[1..].copy_from_slice(&partition.to_be_bytes());
        k
    }

    pub fn offset(topic: &str, partition: u32) -> Vec<u8> {
        let mut k = topic_prefixed(OFFSET, topic, 4);
        k.extend_from_slice(&partition.to_be_bytes());
        k
    }

    pub fn dead_letter(partition: u32, offset: u64) -> [u8; 13] {
        let mut k = [0u8; 13];
        k[0] = DEAD_LETTER;
        k[1..5].copy_from_slice(&partition.to_be_bytes());
        k[5..].copy_from_slice(&offset.to_be_bytes());
        k
    }

    /// `(kind, topic, a, b)` keys: chains and relays.
    pub fn pair(kind: u8, topic: &str, a: u32, b: u32) -> Vec<u8> {
        let mut k = topic_prefixed(kind, topic, 8);
        k.extend_from_slice(&a.to_be_bytes());
        k.extend_from_slice(&b.to_be_bytes());
        k
    }

    /// The topic and trailing u32s of a topic-prefixed key of `kind`.
    pub fn parse(kind: u8, k: &[u8], ints: usize) -> Option<(String, Vec<u32>)> {
        if k.first() != Some(&kind) {
            return None;
        }
        let len = usize::from(u16::from_be_bytes(k.get(1..3)?.try_into().ok()?));
        let topic = std::str::from_utf8(k.get(3..3 + len)?).ok()?.to_owned();
        let rest = k.get(3 + len..)?;
        if rest.len() != 4 * ints {
            return None;
        }
        let nums = rest
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some((topic, nums))
    }

    /// A u64 BE value (offsets, chains, relays).
    pub fn u64_value(v: &[u8]) -> Option<u64> {
        Some(u64::from_be_bytes(v.try_into().ok()?))
    }
}

pub(crate) fn event(seq: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = EVENT;
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

pub(crate) fn seq_of_event_key(k: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(k.get(1..9)?.try_into().ok()?))
}

fn twin_prefixed(kind: u8, twin: &TwinId, extra: usize) -> Vec<u8> {
    let id = twin.as_bytes();
    let mut k = Vec::with_capacity(3 + id.len() + extra);
    k.push(kind);
    // Twin ids are at most 256 bytes (palisade_core::MAX_TWIN_ID_LEN).
    let len = u16::try_from(id.len()).unwrap_or(u16::MAX);
    k.extend_from_slice(&len.to_be_bytes());
    k.extend_from_slice(id);
    k
}

pub(crate) fn twin(twin: &TwinId) -> Vec<u8> {
    twin_prefixed(TWIN, twin, 0)
}

pub(crate) fn history_prefix(twin: &TwinId) -> Vec<u8> {
    twin_prefixed(HISTORY, twin, 8)
}

pub(crate) fn history(twin: &TwinId, seq: u64) -> Vec<u8> {
    let mut k = history_prefix(twin);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// The sequence number at the end of a history or snapshot key.
pub(crate) fn trailing_seq(k: &[u8]) -> Option<u64> {
    let start = k.len().checked_sub(8)?;
    Some(u64::from_be_bytes(k[start..].try_into().ok()?))
}

pub(crate) fn dedupe(twin: &TwinId, event_id: &str) -> Vec<u8> {
    let mut k = twin_prefixed(DEDUPE, twin, event_id.len());
    k.extend_from_slice(event_id.as_bytes());
    k
}

pub(crate) fn snapshot_prefix(twin: &TwinId) -> Vec<u8> {
    twin_prefixed(SNAPSHOT, twin, 8)
}

pub(crate) fn snapshot(twin: &TwinId, seq: u64) -> Vec<u8> {
    let mut k = snapshot_prefix(twin);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(crate) fn grant(token: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = GRANT;
    k[1..].copy_from_slice(&token.to_be_bytes());
    k
}

pub(crate) const META_KEY: [u8; 1] = [META];

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn twin_prefixes_do_not_overlap() {
        let ab = TwinId::new("ab").unwrap();
        let abc = TwinId::new("abc").unwrap();
        assert!(!history(&abc, 1).starts_with(&history_prefix(&ab)));
        assert_eq!(
            history(&ab, 0x0102),
            [&[3u8, 0, 2, b'a', b'b'][..], &0x0102u64.to_be_bytes()].concat()
        );
        assert_eq!(trailing_seq(&history(&ab, 77)), Some(77));
    }

    #[test]
    fn ingest_keys_are_as_documented() {
        // docs/on-disk-format.md, tree `ingest`.
        assert_eq!(ingest::legacy_offset(3), [0, 0, 0, 0, 3]);
        assert_eq!(ingest::offset("tw", 2), [1, 0, 2, b't', b'w', 0, 0, 0, 2]);
        assert_eq!(
            ingest::dead_letter(1, 0x0102),
            [2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 2]
        );
        let chain = ingest::pair(ingest::CHAIN, "t", 5, 7);
        assert_eq!(chain, [3, 0, 1, b't', 0, 0, 0, 5, 0, 0, 0, 7]);
        assert_eq!(
            ingest::parse(ingest::CHAIN, &chain, 2),
            Some(("t".to_owned(), vec![5, 7]))
        );
        assert_eq!(ingest::parse(ingest::RELAY, &chain, 2), None);
        assert_eq!(ingest::parse(ingest::CHAIN, &chain, 1), None);
        // Dead letters of one partition sort by offset, and before the next
        // partition's.
        assert!(ingest::dead_letter(1, 255) < ingest::dead_letter(1, 256));
        assert!(ingest::dead_letter(1, u64::MAX) < ingest::dead_letter(2, 0));
    }

    #[test]
    fn event_keys_sort_by_seq() {
        assert!(event(255) < event(256));
        assert_eq!(seq_of_event_key(&event(42)), Some(42));
    }
}
