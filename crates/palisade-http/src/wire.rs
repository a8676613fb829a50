//! JSON shapes of the API. Each one also describes itself for the OpenAPI
//! document (`utoipa::ToSchema`, see `openapi.rs`).
//!
//! The response structs that replaced `json!` bodies keep their fields in
//! alphabetical order: that is the order `json!` (a `BTreeMap`) wrote them
//! in, so the bytes on the wire did not change.

use std::collections::BTreeMap;

use palisade_core::{Event, Hlc};
use palisade_lease::Lease;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// An event as stored.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventOut {
    /// Its sequence number in the partition.
    pub seq: u64,
    pub twin_id: String,
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    /// The JSON merge patch the event applied.
    #[schema(value_type = Object)]
    pub patch: serde_json::Value,
    /// Hybrid logical clock, `<ntp64>/<hex id>`.
    pub hlc: String,
    /// The holder of the lease whose token wrote it.
    pub writer: String,
    /// The fencing token it was written with.
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

/// The body of `POST /v1/leases`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(examples(
    json!({"scope": "twin/boiler-7", "holder": "worker-a", "ttl_ms": 10000}),
    json!({"scope": "partition/3", "holder": "worker-b", "ttl_ms": 30000}),
))]
// `expecting`: serde would otherwise say "expected struct LeaseIn",
// naming a Rust type the client has never seen.
#[serde(
    deny_unknown_fields,
    expecting = "a lease request object {\"scope\", \"holder\", \"ttl_ms\"}"
)]
pub struct LeaseIn {
    /// `partition/<p>` (p below the partition count) or `twin/<id>`.
    #[schema(pattern = "^(partition/[0-9]+|twin/.+)$")]
    pub scope: String,
    /// Who holds the lease (shown to other holders, stored with each event):
    /// 1..256 bytes without control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]+$"
    )]
    pub holder: String,
    /// Time to live: 100..=86400000 ms.
    #[schema(minimum = 100, maximum = 86_400_000)]
    pub ttl_ms: u64,
}

/// A lease as returned by acquire and renew.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LeaseOut {
    /// 32 lowercase hex characters.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    pub lease_id: String,
    /// `partition/<p>` or `twin/<id>`.
    pub scope: String,
    pub holder: String,
    /// The fencing token: send it as `Fencing-Token` with every append.
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

/// `201` of `POST /v1/twins/{twin_id}/events`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
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

/// `200` of `GET /v1/twins/{twin_id}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TwinResponse {
    /// Desired fields that differ from (or are missing in) `reported`; `null`
    /// unless the state has a `desired` object.
    #[schema(value_type = Option<Object>)]
    pub delta: Option<Value>,
    /// The twin's current fence (also for time travel).
    pub fence: u64,
    /// Per leaf, keyed by JSON Pointer: the HLC of the write that set it.
    pub hlc: BTreeMap<String, String>,
    pub partition: u32,
    /// The twin's state: its events' merge patches applied in HLC order.
    #[schema(value_type = Object)]
    pub state: Value,
    pub twin_id: String,
    /// Sequence number of the latest event included; also the `ETag`.
    pub version: u64,
}

/// A page of events (`GET .../events`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventsPage {
    /// `EventOut`s as `Value`s: their keys keep the (sorted) order this body
    /// has always had (the SSE `data` keeps `EventOut`'s field order).
    #[schema(value_type = Vec<EventOut>)]
    pub events: Vec<Value>,
    /// The `after` for the next page: the last event's seq (`null` if the page is empty).
    pub next_after: Option<u64>,
}

/// `200` of `GET /v1/partitions`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PartitionsResponse {
    /// The last fencing token the store issued (0: none yet).
    pub last_token: u64,
    pub partitions: Vec<PartitionOut>,
}

/// A partition's summary.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PartitionOut {
    pub fence: u64,
    /// Sequence number of the latest event (0: empty).
    pub head: u64,
    /// The live partition-scoped lease, if any. A `LeaseOut` as a `Value`:
    /// its keys keep the (sorted) order this body has always had.
    #[schema(value_type = Option<LeaseOut>)]
    pub owner: Option<Value>,
    pub partition: u32,
}

/// `200` of `GET /v1/rejections`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RejectionsResponse {
    /// Newest first.
    pub rejections: Vec<RejectionOut>,
}

/// A refused write (HTTP or Kafka): enough to find the record and to
/// reconcile what the writer tried to do.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RejectionOut {
    pub at_ms: u64,
    /// The ids of the refused events, in order.
    pub event_ids: Vec<String>,
    pub message: String,
    /// The Kafka offset (`null` for HTTP), in `source_partition`.
    pub offset: Option<u64>,
    /// The store partition of the twin.
    pub partition: u32,
    /// Stable reason name, as the `error` of the refused request.
    pub reason: String,
    /// `http` or `kafka`.
    pub source: String,
    /// The Kafka partition the record was read from (`null` for HTTP); it
    /// may differ from `partition`: records are routed by key.
    pub source_partition: Option<u32>,
    pub token: u64,
    /// The twin (the record's key).
    pub twin_id: String,
}

/// `200` of `GET /v1/dead-letters`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DeadLettersResponse {
    pub dead_letters: Vec<DeadLetterOut>,
}

/// A Kafka record that could not be applied.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DeadLetterOut {
    pub at_ms: u64,
    /// Record headers as `[name, value]` pairs (UTF-8, lossy).
    #[schema(value_type = Vec<Vec<String>>)]
    pub headers: Vec<(String, String)>,
    /// The record key (UTF-8, lossy), if it had one.
    pub key: Option<String>,
    pub message: String,
    pub offset: u64,
    pub partition: u32,
    pub reason: String,
    /// The first bytes of the value (UTF-8, lossy).
    pub value: String,
    pub value_len: u64,
}

/// `GET /healthz`: `200` with `ok`, or `503` with `failed` and the storage
/// failure that stopped the store from acknowledging writes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`, or `failed` after a storage failure (restart the store).
    pub status: String,
    /// What failed, when `status` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<HealthFailure>,
}

/// The storage failure behind a `failed` health.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HealthFailure {
    /// `wal write`, `wal sync`, `sled apply`, `checkpoint`.
    pub op: String,
    /// The OS error kind (e.g. `no storage space`).
    pub kind: String,
    pub detail: String,
    /// When it happened (ms since 1970).
    pub at_ms: u64,
    /// For people.
    pub message: String,
}

pub(crate) fn hlc_text(h: Hlc) -> String {
    h.to_string()
}
