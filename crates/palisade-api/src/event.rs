//! Events: what a writer sends, what the store keeps and answers.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One event to append.
// Give every event an `event_id` when you can: the store acknowledges a
// repeated id for the same twin with its original sequence number instead
// of appending it twice, which is what makes an append safe to retry. (A
// `//` comment: the doc comment is the OpenAPI document's description.)
// The server parses append bodies with `palisade_core::json` (its own
// messages, limits and defaults); `Deserialize` is here for the SDK and the
// CLI, and `deny_unknown_fields` makes the document show
// `additionalProperties: false`, as that parser behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "openapi",
    schema(examples(
        json!({"type": "reading", "patch": {"reported": {"temp": 21.5}}}),
        json!({"type": "config", "patch": {"desired": {"fan": "on"}}, "event_id": "cfg-42"}),
    ))
)]
pub struct EventIn {
    /// The event's type, 1..128 bytes.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub event_type: String,
    /// A JSON merge patch (RFC 7396) applied to the twin's state; nested at most 32 deep.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub patch: Value,
    /// Hybrid logical clock of the event, `<ntp64>/<hex id>`; the store's if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[0-9]{1,20}/[0-9a-fA-F]*[1-9a-fA-F][0-9a-fA-F]*$")
    )]
    pub hlc: Option<String>,
    /// 1..128 bytes; a retry with an id already stored for the twin is
    /// acknowledged with the original seq, not appended twice. Random if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub event_id: Option<String>,
    /// Side effects recorded with the event in the same fenced commit and
    /// delivered after it is durable (the fenced outbox, `docs/outbox.md`):
    /// at most 16; HTTP appends only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<EffectIn>,
}

/// A side effect of an event: a webhook, an HTTP POST of `body` to `url`, or
/// a `kafka` record of `body` to `topic` keyed by the twin id; either
/// carries `Idempotency-Key: <event_id>:<index>` and `Fencing-Token: <the
/// event's token>` (docs/outbox.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EffectIn {
    /// `webhook` or `kafka`.
    pub kind: String,
    /// A webhook's target: `http://` or `https://`, at most 2048 bytes of
    /// visible ASCII.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub url: String,
    /// A `kafka` effect's topic (1 to 249 of `A-Z a-z 0-9 . _ -`), on the
    /// store's `--kafka-brokers`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub topic: String,
    /// Any JSON: the POST's body, or the record's value.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub body: Value,
    /// Extra request headers (at most 16; not `Idempotency-Key`,
    /// `Fencing-Token`, `Content-Type`, `Content-Length`, `Host`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headers: std::collections::BTreeMap<String, String>,
}

impl EffectIn {
    /// A webhook POST of `body` to `url`.
    pub fn webhook(url: impl Into<String>, body: Value) -> Self {
        Self {
            kind: "webhook".into(),
            url: url.into(),
            topic: String::new(),
            body,
            headers: std::collections::BTreeMap::new(),
        }
    }

    /// A Kafka record of `body` to `topic`, keyed by the twin id.
    pub fn kafka(topic: impl Into<String>, body: Value) -> Self {
        Self {
            kind: "kafka".into(),
            url: String::new(),
            topic: topic.into(),
            body,
            headers: std::collections::BTreeMap::new(),
        }
    }
}

impl EventIn {
    pub fn new(event_type: impl Into<String>, patch: Value) -> Self {
        Self {
            event_type: event_type.into(),
            patch,
            hlc: None,
            event_id: None,
            effects: Vec::new(),
        }
    }

    /// Add a side effect (the fenced outbox).
    #[must_use]
    pub fn with_effect(mut self, effect: EffectIn) -> Self {
        self.effects.push(effect);
        self
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

/// An event as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventOut {
    /// Its sequence number in the partition.
    pub seq: u64,
    pub twin_id: String,
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    /// The JSON merge patch the event applied.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub patch: Value,
    /// Hybrid logical clock, `<ntp64>/<hex id>`.
    pub hlc: String,
    /// The holder of the lease whose token wrote it.
    pub writer: String,
    /// The fencing token it was written with.
    pub token: u64,
    pub appended_at_ms: u64,
}

impl From<palisade_core::Event> for EventOut {
    fn from(e: palisade_core::Event) -> Self {
        Self {
            // A stored patch was validated on the way in; one that no longer
            // parses is a damaged record, shown as `null` rather than
            // failing the whole page.
            patch: serde_json::from_str(&e.patch).unwrap_or(Value::Null),
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

/// `201` of `POST /v1/twins/{twin_id}/events`.
// Fields in alphabetical order: the order the server's `json!` body had,
// kept so the bytes on the wire did not change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AppendResponse {
    /// How many events were already stored (same `event_id`) and only acknowledged.
    pub duplicates: usize,
    /// The twin's fence after the append.
    pub fence: u64,
    pub partition: u32,
    /// The sequence number of each event of the request, in order.
    pub seqs: Vec<u64>,
    /// The twin's version (sequence number of its latest event); also the `ETag`.
    pub version: u64,
}

/// A page of events (`GET .../events`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventsPage {
    /// `EventOut`s as `Value`s: their keys keep the (sorted) order this body
    /// has always had (the SSE `data` keeps `EventOut`'s field order).
    #[serde(serialize_with = "crate::sorted::serialize")]
    pub events: Vec<EventOut>,
    /// The `after` for the next page: the last event's seq (`null` if the page is empty).
    pub next_after: Option<u64>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The SDK sends events with this type: absent options stay absent
    /// (the store stamps an HLC and an id itself), not `null`.
    #[test]
    fn events_serialize_to_the_wire_shape() {
        let plain = EventIn::new("update", json!({"t": 1}));
        assert_eq!(
            serde_json::to_value(&plain).unwrap(),
            json!({"type": "update", "patch": {"t": 1}})
        );
        let full = EventIn::new("update", json!({}))
            .with_id("e-1")
            .with_hlc("123/abc");
        assert_eq!(
            serde_json::to_value(&full).unwrap(),
            json!({"type": "update", "patch": {}, "event_id": "e-1", "hlc": "123/abc"})
        );
    }
}
