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

/// Entries per state ([`crate::Store::outbox_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxCounts {
    pub pending: usize,
    pub delivered: usize,
    pub dead: usize,
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

/// A delivery outcome as cluster mode publishes it: the value of a
/// `palisade-control: outbox` record of the entry's partition
/// (`docs/decisions/0035-outbox-in-cluster-mode.md`). Every node applying
/// the partition merges it into its copy of the entry
/// ([`OutboxOutcome::merge_into`]), so the outbox is the same on every node
/// that replays the log, and a new owner does not deliver again what a
/// former owner confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxOutcome {
    pub partition: u32,
    pub seq: u64,
    pub index: u16,
    pub state: DeliveryState,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub updated_at_ms: u64,
}

impl OutboxOutcome {
    /// The outcome `entry` holds now.
    pub fn of(entry: &OutboxEntry) -> Self {
        Self {
            partition: entry.partition,
            seq: entry.seq,
            index: entry.index,
            state: entry.state,
            attempts: entry.attempts,
            last_error: entry.last_error.clone(),
            updated_at_ms: entry.updated_at_ms,
        }
    }

    /// The record value: `{"partition", "seq", "index", "state",
    /// "attempts", "last_error", "updated_at_ms"}`.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::json!({
            "partition": self.partition,
            "seq": self.seq,
            "index": self.index,
            "state": self.state.name(),
            "attempts": self.attempts,
            "last_error": self.last_error,
            "updated_at_ms": self.updated_at_ms,
        })
        .to_string()
        .into_bytes()
    }

    /// Read a record value back; what is wrong with it otherwise.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        let num = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("{k} is not a non-negative integer"))
        };
        let state = v
            .get("state")
            .and_then(serde_json::Value::as_str)
            .and_then(DeliveryState::from_name)
            .ok_or("state is not pending, delivered or dead")?;
        let last_error = match v.get("last_error") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(e)) => Some(e.clone()),
            Some(_) => return Err("last_error is not a string".into()),
        };
        Ok(Self {
            partition: u32::try_from(num("partition")?).map_err(|e| e.to_string())?,
            seq: num("seq")?,
            index: u16::try_from(num("index")?).map_err(|e| e.to_string())?,
            state,
            attempts: u32::try_from(num("attempts")?).map_err(|e| e.to_string())?,
            last_error,
            updated_at_ms: num("updated_at_ms")?,
        })
    }

    /// Merge into `entry`; whether it changed. States only move forward
    /// (`pending` < `dead` < `delivered`: a receiver's confirmation is
    /// final, whoever reports it and in whatever order), and within
    /// `pending` or `dead` the higher try count wins (a `delivered` entry
    /// is never rewritten: retention may remove it meanwhile, and a rewrite
    /// would bring it back). So the result depends only on the
    /// outcomes applied, in log order, not on which owner produced them:
    /// a former owner's late outcome cannot undo a newer one.
    pub fn merge_into(&self, entry: &mut OutboxEntry) -> bool {
        let rank = |s: DeliveryState| match s {
            DeliveryState::Pending => 0,
            DeliveryState::Dead => 1,
            DeliveryState::Delivered => 2,
        };
        let newer = match rank(self.state).cmp(&rank(entry.state)) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Equal => {
                self.state != DeliveryState::Delivered && self.attempts > entry.attempts
            }
            std::cmp::Ordering::Less => false,
        };
        if newer {
            entry.state = self.state;
            entry.attempts = self.attempts;
            entry.last_error.clone_from(&self.last_error);
            entry.updated_at_ms = self.updated_at_ms;
        }
        newer
    }
}

/// Cluster mode: the value of a `palisade-control: outbox-remove` record,
/// `{"partition", "seq", "index"}` (an operator removes a dead effect).
pub fn removal_json(partition: u32, seq: u64, index: u16) -> Vec<u8> {
    serde_json::json!({"partition": partition, "seq": seq, "index": index})
        .to_string()
        .into_bytes()
}

/// Read [`removal_json`] back: `(partition, seq, index)`.
pub fn parse_removal(bytes: &[u8]) -> Result<(u32, u64, u16), String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let num = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| format!("{k} is not a non-negative integer"))
    };
    Ok((
        u32::try_from(num("partition")?).map_err(|e| e.to_string())?,
        num("seq")?,
        u16::try_from(num("index")?).map_err(|e| e.to_string())?,
    ))
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

    fn entry() -> OutboxEntry {
        OutboxEntry {
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
        }
    }

    #[test]
    fn outcomes_round_trip_and_only_move_forward() {
        let mut e = entry();
        let failed = OutboxOutcome {
            attempts: 2,
            last_error: Some("the receiver answered 500".into()),
            updated_at_ms: 7,
            ..OutboxOutcome::of(&e)
        };
        assert_eq!(OutboxOutcome::from_json(&failed.to_json()).unwrap(), failed);
        assert_eq!(
            parse_removal(&removal_json(3, 70_000, 2)),
            Ok((3, 70_000, 2))
        );
        assert!(parse_removal(br#"{"partition":0,"seq":1,"index":70000}"#).is_err());
        assert!(OutboxOutcome::from_json(b"{}").is_err());
        assert!(OutboxOutcome::from_json(
            br#"{"partition":0,"seq":1,"index":0,"state":"gone","attempts":0,"updated_at_ms":0}"#
        )
        .is_err());
        assert!(failed.merge_into(&mut e));
        assert_eq!(
            (e.attempts, e.last_error.as_deref()),
            (2, Some("the receiver answered 500"))
        );
        // An older try count of the same state changes nothing.
        let older = OutboxOutcome {
            attempts: 1,
            ..failed.clone()
        };
        assert!(!older.merge_into(&mut e));
        let delivered = OutboxOutcome {
            state: DeliveryState::Delivered,
            attempts: 3,
            last_error: None,
            ..failed.clone()
        };
        assert!(delivered.merge_into(&mut e));
        assert_eq!(e.state, DeliveryState::Delivered);
        // A late failure or dead verdict (a former owner's), or a second
        // confirmation, cannot change it.
        for late in [
            OutboxOutcome {
                attempts: 9,
                ..delivered.clone()
            },
            OutboxOutcome {
                attempts: 9,
                ..failed.clone()
            },
            OutboxOutcome {
                state: DeliveryState::Dead,
                attempts: 9,
                ..failed
            },
        ] {
            assert!(!late.merge_into(&mut e));
            assert_eq!((e.state, e.attempts), (DeliveryState::Delivered, 3));
        }
    }

    #[test]
    fn the_idempotency_key_is_event_id_and_index() {
        let e = entry();
        assert_eq!(e.idempotency_key(), "ev-1:2");
        let bytes = palisade_core::codec::encode(&e);
        assert_eq!(
            palisade_core::codec::decode::<OutboxEntry>(&bytes).unwrap(),
            e
        );
    }
}
