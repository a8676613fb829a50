//! The JSON shapes the client sends and receives.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A lease as granted (or renewed) by `POST /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// 32 hex characters; renewals and releases name the lease by it.
    pub lease_id: String,
    /// `partition/<p>` or `twin/<id>`.
    pub scope: String,
    pub holder: String,
    /// The fencing token: send it with every write made under this lease.
    pub token: u64,
    pub ttl_ms: u64,
}

/// An event to append: `{"type", "patch", "event_id"?, "hlc"?}`.
///
/// Give every event an `event_id` when you can: the store acknowledges a
/// repeated id for the same twin with its original sequence number instead of
/// appending it twice, which is what makes [`Client::append`](crate::Client::append)
/// safe to retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    #[serde(rename = "type")]
    pub event_type: String,
    /// A JSON merge patch (RFC 7396) on the twin's state; must be an object.
    pub patch: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The writer's HLC (`<ntp64>/<hex id>`); the store stamps events without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hlc: Option<String>,
}

impl Event {
    pub fn new(event_type: impl Into<String>, patch: Value) -> Self {
        Self {
            event_type: event_type.into(),
            patch,
            event_id: None,
            hlc: None,
        }
    }

    /// Set the idempotency key.
    #[must_use]
    pub fn with_id(mut self, event_id: impl Into<String>) -> Self {
        self.event_id = Some(event_id.into());
        self
    }

    /// Set the writer's HLC: a [`palisade_core::Hlc`] or its text form.
    #[must_use]
    pub fn with_hlc(mut self, hlc: impl fmt::Display) -> Self {
        self.hlc = Some(hlc.to_string());
        self
    }
}

/// The store's answer to an accepted append (`201`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Appended {
    pub partition: u32,
    /// One partition sequence number per event, in order; a duplicate gets the
    /// seq it was first stored under.
    pub seqs: Vec<u64>,
    /// How many events were already stored (same `event_id`) and not appended again.
    pub duplicates: usize,
    /// The twin's fence after the append.
    pub fence: u64,
    /// The twin's version after the append (its ETag), for `append_if_match`.
    pub version: u64,
}

/// A twin's current state (`GET /v1/twins/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TwinState {
    pub twin_id: String,
    pub partition: u32,
    pub version: u64,
    pub fence: u64,
    pub state: Value,
    /// The HLC of the last write to each field, keyed by JSON pointer.
    pub hlc: BTreeMap<String, String>,
    /// The device-shadow delta: when `state` has a `desired` object, the
    /// desired leaves whose value differs from (or is missing in) `reported`
    /// (nested objects compared member by member, arrays and scalars whole).
    /// `None` when there is no `desired` object or nothing differs. Computed
    /// by the store for every read, time-travel reads included.
    #[serde(default)]
    pub delta: Option<Value>,
}

/// An event as stored (`GET /v1/twins/{id}/events`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    /// Partition sequence number.
    pub seq: u64,
    pub twin_id: String,
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    pub patch: Value,
    pub hlc: String,
    /// Holder name of the lease whose token admitted the event.
    pub writer: String,
    pub token: u64,
    pub appended_at_ms: u64,
}

/// `GET /v1/partitions`: every partition of the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partitions {
    /// The last fencing token the store issued (0: none yet).
    pub last_token: u64,
    pub partitions: Vec<PartitionInfo>,
}

/// One partition's fence, head and owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionInfo {
    pub partition: u32,
    pub fence: u64,
    /// Sequence number of the partition's latest event (0: empty).
    pub head: u64,
    /// The live `partition/<p>` lease, if any.
    pub owner: Option<PartitionOwner>,
}

/// The live lease on a partition, as `GET /v1/partitions` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionOwner {
    pub lease_id: String,
    /// `partition/<p>`.
    pub scope: String,
    pub holder: String,
    pub token: u64,
    pub ttl_ms: u64,
    /// How long the lease has left, as the store saw it when answering.
    pub expires_in_ms: u64,
}

/// `{"events": [...], "next_after"}`.
#[derive(Debug, Deserialize)]
pub(crate) struct EventPage {
    pub events: Vec<StoredEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_serialize_to_the_wire_shape() {
        let plain = Event::new("update", json!({"t": 1}));
        assert_eq!(
            serde_json::to_value(&plain).unwrap(),
            json!({"type": "update", "patch": {"t": 1}})
        );
        let full = Event::new("update", json!({}))
            .with_id("e-1")
            .with_hlc("123/abc");
        assert_eq!(
            serde_json::to_value(&full).unwrap(),
            json!({"type": "update", "patch": {}, "event_id": "e-1", "hlc": "123/abc"})
        );
    }
}
