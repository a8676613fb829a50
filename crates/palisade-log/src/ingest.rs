//! What the log offers a stream ingester (the Kafka consumer): appends that
//! carry their source offset, stored in the same atomic batch as the events
//! they produce, so a crash or a redelivery applies each record exactly once;
//! a durable dead-letter store; and a bounded log of recent rejections.

use std::collections::VecDeque;
use std::sync::Mutex;

use bincode::{Decode, Encode};
use palisade_core::{FencingToken, NewEvent, PartitionId, TwinId};

use crate::{AppendError, Appended};

/// Most rejections kept in memory for `GET /v1/rejections`.
pub const REJECTION_LOG_LEN: usize = 1024;
/// Most dead letters kept per partition; the oldest are pruned past this.
pub const DEAD_LETTERS_PER_PARTITION: u64 = 10_000;
/// Bytes of a dead record's value kept for inspection.
pub const DEAD_LETTER_VALUE_BYTES: usize = 4096;

/// One record of a source partition, already decoded (or not decodable).
#[derive(Debug, Clone)]
pub enum IngestRecord {
    /// Events for one twin under one token, checked like an HTTP append.
    Append {
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
    },
    /// A record that could not be turned into an append (no key, no token,
    /// undecodable value, wrong partition, too large ...).
    Dead(DeadLetter),
}

/// What became of an ingested record. Every outcome but `AlreadyApplied`
/// advanced the stored source offset in the same batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestOutcome {
    Applied(Appended),
    /// The offset is at or below the stored one: applied before (a
    /// redelivery after a crash or rebalance). Nothing was done.
    AlreadyApplied,
    /// Below its twin's fence (or otherwise refused as stale): dropped,
    /// counted and logged in the rejection log, never applied.
    Dropped(AppendError),
    /// Refused for a reason other than staleness: stored as a dead letter.
    DeadLettered {
        reason: String,
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

/// A refused write, for the operator's view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub at_ms: u64,
    /// `http` or `kafka`.
    pub source: &'static str,
    pub partition: PartitionId,
    pub offset: Option<u64>,
    pub twin: TwinId,
    pub token: FencingToken,
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
