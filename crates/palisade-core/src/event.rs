use bincode::{Decode, Encode};

use crate::{FencingToken, Hlc, TwinId};

/// Longest accepted `event_id`, in bytes (it is part of the dedupe key).
pub const MAX_EVENT_ID_LEN: usize = 128;
/// Longest accepted event `type`, in bytes.
pub const MAX_EVENT_TYPE_LEN: usize = 128;

/// An event as a writer submits it, after validation and before the store
/// gives it a sequence number.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Idempotency key: a repeated id for the same twin is acknowledged again
    /// with its original sequence number and not appended twice.
    pub event_id: String,
    pub event_type: String,
    /// A JSON merge patch (RFC 7396) on the twin's state; always an object.
    pub patch: serde_json::Map<String, serde_json::Value>,
    /// The writer's HLC, if it sent one; the store stamps events without one.
    pub hlc: Option<Hlc>,
}

/// An event as stored in the log.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Event {
    /// Per-partition sequence number, from 1, without gaps.
    pub seq: u64,
    pub twin_id: TwinId,
    pub event_id: String,
    pub event_type: String,
    /// The merge patch as compact JSON text (bincode cannot carry
    /// self-describing `serde_json::Value`s, and text keeps the bytes exact).
    pub patch: String,
    pub hlc: Hlc,
    /// Holder name of the lease whose token admitted the event.
    pub writer: String,
    pub token: FencingToken,
    /// Store wall-clock time at append, milliseconds since the Unix epoch.
    /// For people only: ordering uses `hlc`, safety uses `token`.
    pub appended_at_ms: u64,
}

impl Event {
    /// The patch as a JSON object. Stored patches were validated on the way
    /// in, so a failure here means a damaged record.
    pub fn patch_json(
        &self,
    ) -> Result<serde_json::Map<String, serde_json::Value>, serde_json::Error> {
        serde_json::from_str(&self.patch)
    }
}
