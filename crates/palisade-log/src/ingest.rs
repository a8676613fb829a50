//! What the log offers a stream ingester (the Kafka consumer): records of a
//! source partition (a Kafka topic's partition), each applied to the store
//! partition that owns its twin, whatever source partition it came from,
//! with the source offset stored in the same commit round as what the
//! record produced, so a crash or a redelivery applies each record exactly
//! once; a durable dead-letter store; and a bounded log of recent
//! rejections.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bincode::{Decode, Encode};
use palisade_core::{FencingToken, NewEvent, PartitionId, TwinId};

use crate::{AppendError, Appended};

/// Most rejections kept in memory for `GET /v1/rejections`.
pub const REJECTION_LOG_LEN: usize = 1024;
/// Most dead letters kept per partition; the oldest are pruned past this.
pub const DEAD_LETTERS_PER_PARTITION: u64 = 10_000;
/// Bytes of a dead record's value kept for inspection.
pub const DEAD_LETTER_VALUE_BYTES: usize = 4096;

/// A partition of a Kafka topic the store ingests: what source offsets are
/// kept per (`docs/on-disk-format.md`, tree `ingest`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source {
    pub topic: Arc<str>,
    pub partition: u32,
}

impl Source {
    pub fn new(topic: impl Into<Arc<str>>, partition: u32) -> Self {
        Self {
            topic: topic.into(),
            partition,
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.topic, self.partition)
    }
}

/// Cluster mode: where a forwarded record came from. Another node read it
/// at `offset` of source partition `partition` (of the same topic), found
/// its twin belongs to another partition and produced a copy there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub partition: u32,
    pub offset: u64,
    /// The origin offset of the record of the same origin partition
    /// forwarded to the same partition just before this one (`None`: the
    /// first). The receiver applies a forward only if this is the last one
    /// it decided, so a forward that overtook an earlier, lost one (a
    /// producer gap) is set aside until the forwarder sends both again.
    pub prev: Option<u64>,
}

/// One record of a source partition, already decoded (or not decodable).
#[derive(Debug, Clone)]
pub enum IngestRecord {
    /// Events for one twin under one token, checked like an HTTP append,
    /// and applied to the twin's partition (`murmur2(twin) mod N`),
    /// whichever source partition the record came from.
    Append {
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        /// Cluster mode: apply only if the twin's version is this at the
        /// record's place in the log (an HTTP append's `If-Match`, which
        /// the node carries in the record's `palisade-if-match` header), so
        /// every node replaying the log decides alike; refused otherwise
        /// (`VersionMismatch`, kept as a dead letter). `None`: unconditional
        /// (every worker record).
        if_match: Option<u64>,
        /// Each event's effects (the fenced outbox), aligned with
        /// `events`; empty for none. Only the records cluster nodes
        /// produce for HTTP appends carry any (`docs/outbox.md`).
        effects: Vec<Vec<palisade_core::effect::Effect>>,
    },
    /// A record that could not be turned into an append (no key, no token,
    /// undecodable value, too large ...).
    Dead(DeadLetter),
    /// Cluster mode, receiving side: a record forwarded here from `origin`
    /// (an `Append` or a `Dead`). Applied once: a forward at or below the
    /// last one decided from its origin partition is a retry.
    Relayed {
        origin: Origin,
        record: Box<IngestRecord>,
    },
    /// Cluster mode, forwarding side: this record's twin belongs to store
    /// partition `to`, and a copy of it is durably in Kafka partition `to`
    /// (at `at`). Nothing is applied here; the offset advances and the
    /// forward chain to `to` records this offset.
    Forwarded { to: u32, at: u64 },
}

/// What became of an ingested record. Every outcome but `AlreadyApplied`
/// advanced the stored source offset in the same round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestOutcome {
    Applied(Appended),
    /// The offset is at or below the stored one: applied before (a
    /// redelivery after a crash or rebalance). Nothing was done.
    AlreadyApplied,
    /// Cluster mode: a forwarded record whose origin offset is at or below
    /// the last one decided from its origin partition (a forwarder's retry
    /// after a crash, or a rebuilt node forwarding again). Not applied.
    Duplicate {
        origin: u32,
        offset: u64,
    },
    /// Below its twin's fence (or otherwise refused as stale): dropped,
    /// counted and logged in the rejection log, never applied.
    Dropped(AppendError),
    /// Refused for a reason other than staleness: stored as a dead letter.
    DeadLettered {
        /// The dead letter's reason name (as stored and listed).
        reason: String,
        /// The writer's refusal, when the record decoded but its append was
        /// refused (a token never issued, another twin's token, a bad
        /// event); `None` for a record refused at decoding (`reason` says
        /// why). Callers branch on this, not on `reason`.
        refused: Option<AppendError>,
    },
    /// Cluster mode: handed on to partition `to` (see
    /// [`IngestRecord::Forwarded`]).
    Forwarded {
        to: u32,
        at: u64,
    },
    /// Cluster mode: a forwarded record that overtook an earlier forward of
    /// its origin partition (`expected` is the last one decided, `prev` the
    /// one this record follows). Not applied: its forwarder saw the earlier
    /// one fail and sends both again.
    OutOfOrder {
        origin: u32,
        expected: Option<u64>,
        prev: Option<u64>,
    },
}

/// A record that could not be applied, kept durably for inspection.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct DeadLetter {
    pub partition: u32,
    pub offset: u64,
    /// The record key as UTF-8 (lossy), if it had one.
    pub key: Option<String>,
    /// Stable reason name (`missing_key`, `bad_token`, `bad_value`, `token_not_issued`, ...).
    pub reason: String,
    /// For people: what exactly was wrong.
    pub detail: String,
    /// Record headers, UTF-8 (lossy).
    pub headers: Vec<(String, String)>,
    /// The first bytes of the value.
    pub value: Vec<u8>,
    pub value_len: u64,
    pub at_ms: u64,
}

/// A refused write, for the operator's view: enough to find the record
/// (source partition and offset) and reconcile what a paused writer tried
/// to do (twin, event ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub at_ms: u64,
    /// `http` or `kafka`.
    pub source: &'static str,
    /// The store partition of the twin.
    pub partition: PartitionId,
    /// Kafka: the partition the record was produced to (it may differ from
    /// `partition`: records are routed by key; for a copy a cluster node
    /// forwarded, the original's).
    pub source_partition: Option<u32>,
    /// Kafka: the record's offset in `source_partition`.
    pub offset: Option<u64>,
    pub twin: TwinId,
    pub token: FencingToken,
    /// The ids of the refused events, in order.
    pub event_ids: Vec<String>,
    pub reason: &'static str,
    pub detail: String,
}

/// The bounded rejection log.
#[derive(Debug, Default)]
pub(crate) struct RejectionLog {
    entries: Mutex<VecDeque<Rejection>>,
}

impl RejectionLog {
    pub fn push(&self, r: Rejection) {
        if let Ok(mut q) = self.entries.lock() {
            if q.len() >= REJECTION_LOG_LEN {
                q.pop_front();
            }
            q.push_back(r);
        }
    }

    /// Newest first.
    pub fn recent(&self, limit: usize) -> Vec<Rejection> {
        self.entries
            .lock()
            .map(|q| q.iter().rev().take(limit).cloned().collect())
            .unwrap_or_default()
    }
}

/// Whether a refusal of a streamed record is a drop (stale) or a dead letter.
pub(crate) fn is_drop(e: &AppendError) -> bool {
    matches!(e, AppendError::Stale { .. })
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
