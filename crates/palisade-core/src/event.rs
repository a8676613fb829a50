use bincode::{Decode, Encode};

use crate::{FencingToken, Hlc, TwinId};

/// Longest accepted `event_id`, in bytes (it is part of the dedupe key).
pub const MAX_EVENT_ID_LEN: usize = 128;
/// Longest accepted event `type`, in bytes.
pub const MAX_EVENT_TYPE_LEN: usize = 128;

/// Why an event's `event_id` or `type` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventFieldError {
    #[error("{field} must be 1 to {max} bytes, got {len}")]
    Length {
        field: &'static str,
        len: usize,
        max: usize,
    },
    /// Like twin ids and lease holders: these strings are printed in logs,
    /// listings and change streams.
    #[error("{field} contains a control character at byte {at}")]
    ControlChar { field: &'static str, at: usize },
}

/// The rules for an event's `event_id` and `type`: 1 to 128 bytes, no
/// control characters (NUL, newlines, escapes, DEL, C1), as for twin ids.
pub fn check_event_fields(event_id: &str, event_type: &str) -> Result<(), EventFieldError> {
    for (field, v, max) in [
        ("event_id", event_id, MAX_EVENT_ID_LEN),
        ("type", event_type, MAX_EVENT_TYPE_LEN),
    ] {
        if v.is_empty() || v.len() > max {
            return Err(EventFieldError::Length {
                field,
                len: v.len(),
                max,
            });
        }
        if let Some((at, _)) = v.char_indices().find(|(_, c)| c.is_control()) {
            return Err(EventFieldError::ControlChar { field, at });
        }
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_fields_are_bounded_and_printable() {
        assert!(check_event_fields("e-1", "telemetry/ü").is_ok());
        assert!(check_event_fields(&"e".repeat(MAX_EVENT_ID_LEN), "t").is_ok());
        for (id, ty, want) in [
            ("", "t", "event_id must be 1 to 128 bytes, got 0"),
            ("e", "", "type must be 1 to 128 bytes, got 0"),
            (
                "e",
                &"t".repeat(129),
                "type must be 1 to 128 bytes, got 129",
            ),
            (
                "a\0b",
                "t",
                "event_id contains a control character at byte 1",
            ),
            (
                "e",
                "x\u{1b}[31m",
                "type contains a control character at byte 1",
            ),
            (
                "e",
                "tab\there",
                "type contains a control character at byte 3",
            ),
            (
                "e\u{7f}",
                "t",
                "event_id contains a control character at byte 1",
            ),
            (
                "e\u{85}",
                "t",
                "event_id contains a control character at byte 1",
            ),
        ] {
            assert_eq!(check_event_fields(id, ty).unwrap_err().to_string(), want);
        }
    }
}
