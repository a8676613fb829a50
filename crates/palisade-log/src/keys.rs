//! Key layout of a partition tree. Every key starts with a one-byte record
//! kind; integers are big-endian so keys sort numerically; twin ids are
//! length-prefixed (u16 BE) so that one twin's prefix never matches another
//! twin whose id merely starts with it. Byte-by-byte layout:
//! `docs/on-disk-format.md`.

use palisade_core::TwinId;

/// The store's on-disk layout version, kept in `meta/format`. Layout 2
/// stores events in batches and has no durable dedupe keys
/// (`docs/decisions/0013-event-batches.md`); value encodings did not change,
/// so every value still starts with `codec::FORMAT_VERSION` (1).
pub const LAYOUT_VERSION: u8 = 2;

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

/// `0x08` -> u64 BE: the last Kafka offset applied to this partition
/// (Kafka partition p feeds Palisade partition p).
pub(crate) const SOURCE_OFFSET: [u8; 1] = [0x08];
/// `0x09 ++ offset` -> `DeadLetter`: a Kafka record that could not be applied.
pub(crate) const DEAD_LETTER: u8 = 0x09;

pub(crate) fn dead_letter(offset: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = DEAD_LETTER;
    k[1..].copy_from_slice(&offset.to_be_bytes());
    k
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
    fn event_keys_sort_by_seq() {
        assert!(event(255) < event(256));
        assert_eq!(seq_of_event_key(&event(42)), Some(42));
    }
}
