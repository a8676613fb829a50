//! JSON shapes of the API.

use palisade_core::{Event, Hlc};
use palisade_lease::Lease;
use serde::{Deserialize, Serialize};

/// An event as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventOut {
    pub seq: u64,
    pub twin_id: String,
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    pub patch: serde_json::Value,
    pub hlc: String,
    pub writer: String,
    pub token: u64,
    pub appended_at_ms: u64,
}

impl From<Event> for EventOut {
    fn from(e: Event) -> Self {
        Self {
            patch: serde_json::from_str(&e.patch).unwrap_or(serde_json::Value::Null),
            seq: e.seq,
            twin_id: e.twin_id.to_string(),
            event_id: e.event_id,
            event_type: e.event_type,
            hlc: e.hlc.to_string(),
            writer: e.writer,
            token: e.token.0,
            appended_at_ms: e.appended_at_ms,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseIn {
    pub scope: String,
    pub holder: String,
    pub ttl_ms: u64,
}

/// A lease as returned by acquire and renew.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseOut {
    pub lease_id: String,
    pub scope: String,
    pub holder: String,
    pub token: u64,
    pub ttl_ms: u64,
    pub expires_in_ms: u64,
}

impl LeaseOut {
    pub fn new(l: &Lease, expires_in_ms: u64) -> Self {
        Self {
            lease_id: l.id.to_string(),
            scope: l.scope.to_string(),
            holder: l.holder.clone(),
            token: l.token.0,
            ttl_ms: l.ttl_ms,
            expires_in_ms,
        }
    }
}

pub(crate) fn hlc_text(h: Hlc) -> String {
    h.to_string()
}
