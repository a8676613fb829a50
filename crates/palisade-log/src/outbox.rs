//! The fenced outbox (layout 5, `docs/decisions/0030-fenced-outbox.md`,
//! `docs/outbox.md`): the side effects events declared, recorded in the
//! same commit round as their event, so an effect exists only if its
//! event was admitted (the sequencer stages them after every check of the
//! append has passed; a refused append stages nothing here).
//!
//! Entries live in their own sled tree (`outbox`), keyed
//! `partition:u32 BE ++ seq:u64 BE ++ index:u16 BE`
//! (`docs/on-disk-format.md`), so they sort by partition, then by the
//! event's sequence number, then by the effect's place in the event. The
//! value is one [`OutboxEntry`], whose delivery state the dispatcher
//! rewrites through the store's commit path ([`crate::Store::outbox_update`]),
//! so a confirmed delivery is durable before the dispatcher moves on.
//!
//! sled only ever holds what is durable (rounds are applied after their
//! sync), so whatever a reader finds here is durable; the dispatcher also
//! stops at each partition's durable head.

use bincode::{Decode, Encode};
use palisade_core::effect::Effect;

use crate::wal::TreeId;
use crate::writer::RawWrite;

/// Where an effect is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum DeliveryState {
    /// Not delivered yet (maybe tried and failed, see `attempts`).
    Pending,
    /// The receiver answered 2xx; not delivered again.
    Delivered,
    /// Failed on every one of its tries; kept with the last error.
    Dead,
}

impl DeliveryState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Dead => "dead",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "delivered" => Some(Self::Delivered),
            "dead" => Some(Self::Dead),
            _ => None,
        }
    }
}

/// One effect of one admitted event.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct OutboxEntry {
    pub partition: u32,
    /// The event's sequence number in its partition.
    pub seq: u64,
    /// The effect's place in its event's `effects`.
    pub index: u16,
    pub twin: String,
    pub event_id: String,
    /// The fencing token the event was admitted under.
    pub token: u64,
    /// When the event was admitted (ms since 1970).
    pub created_at_ms: u64,
    pub effect: Effect,
    pub state: DeliveryState,
    /// Delivery tries so far.
    pub attempts: u32,
    /// The last failed try's error.
    pub last_error: Option<String>,
    /// When the state last changed (ms since 1970; 0: never tried).
    pub updated_at_ms: u64,
}

impl OutboxEntry {
    /// `<event_id>:<index>`: the same on every try, across restarts.
    pub fn idempotency_key(&self) -> String {
        format!("{}:{}", self.event_id, self.index)
    }

    pub(crate) fn key(&self) -> [u8; 14] {
        key(self.partition, self.seq, self.index)
    }

    /// The write that stores this entry as it is.
    pub(crate) fn write(&self) -> RawWrite {
        RawWrite {
            tree: TreeId::OUTBOX,
            key: self.key().to_vec(),
            value: Some(palisade_core::codec::encode(self)),
        }
    }
}

/// `partition:u32 BE ++ seq:u64 BE ++ index:u16 BE`.
pub(crate) fn key(partition: u32, seq: u64, index: u16) -> [u8; 14] {
    let mut k = [0u8; 14];
    k[..4].copy_from_slice(&partition.to_be_bytes());
    k[4..12].copy_from_slice(&seq.to_be_bytes());
    k[12..].copy_from_slice(&index.to_be_bytes());
    k
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_as_documented_and_sort_by_partition_seq_index() {
        // docs/on-disk-format.md, tree `outbox`.
        assert_eq!(
            key(1, 0x0203, 4),
            [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2, 3, 0, 4]
        );
        assert!(key(0, 1, 15) < key(0, 2, 0));
        assert!(key(0, 255, 0) < key(0, 256, 0));
        assert!(key(0, u64::MAX, u16::MAX) < key(1, 0, 0));
    }

    #[test]
    fn the_idempotency_key_is_event_id_and_index() {
        let e = OutboxEntry {
            partition: 0,
            seq: 9,
            index: 2,
            twin: "t".into(),
            event_id: "ev-1".into(),
            token: 5,
            created_at_ms: 0,
            effect: Effect {
                kind: palisade_core::effect::EffectKind::Webhook,
                url: "http://h/".into(),
                body: "null".into(),
                headers: Vec::new(),
            },
            state: DeliveryState::Pending,
            attempts: 0,
            last_error: None,
            updated_at_ms: 0,
        };
        assert_eq!(e.idempotency_key(), "ev-1:2");
        let bytes = palisade_core::codec::encode(&e);
        assert_eq!(
            palisade_core::codec::decode::<OutboxEntry>(&bytes).unwrap(),
            e
        );
    }
}
