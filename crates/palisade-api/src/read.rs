//! What the read and operations endpoints answer: a twin, partitions,
//! refused writes, dead letters, the audit log, health.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::LeaseOut;

// The response structs that replaced `json!` bodies keep their fields in
// alphabetical order: that is the order `json!` (a `BTreeMap`) wrote them
// in, so the bytes on the wire did not change.

/// `200` of `GET /v1/twins/{twin_id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TwinResponse {
    /// Desired fields that differ from (or are missing in) `reported`; `null`
    /// unless the state has a `desired` object.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub delta: Option<Value>,
    /// The twin's current fence (also for time travel).
    pub fence: u64,
    /// Per leaf, keyed by JSON Pointer: the HLC of the write that set it.
    pub hlc: BTreeMap<String, String>,
    pub partition: u32,
    /// The twin's state: its events' merge patches applied in HLC order.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub state: Value,
    pub twin_id: String,
    /// Sequence number of the latest event included; also the `ETag`.
    pub version: u64,
}

/// `200` of `GET /v1/partitions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PartitionsResponse {
    /// The last fencing token the store issued (0: none yet).
    pub last_token: u64,
    pub partitions: Vec<PartitionOut>,
}

/// A partition's summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PartitionOut {
    /// Cluster mode only (absent on one node): who owns the partition and
    /// how it is doing. In the cluster view, `fence`, `head` and `owner`
    /// are the owner node's; for a partition whose owner did not answer
    /// (`unreachable`) or that no node owns (`unowned`) they are not known
    /// and are `0` and `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterPartitionOut>,
    pub fence: u64,
    /// Sequence number of the latest event (0: empty).
    pub head: u64,
    /// The live partition-scoped lease, if any. A `LeaseOut` as a `Value`:
    /// its keys keep the (sorted) order this body has always had.
    #[serde(serialize_with = "crate::sorted::serialize")]
    pub owner: Option<LeaseOut>,
    pub partition: u32,
}

/// Cluster mode: a partition's owner and state (`GET /v1/partitions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterPartitionOut {
    /// Why the owner did not answer (`unreachable` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Records of the partition in Kafka not yet applied by its owner, as
    /// last measured (every 5 s; `palisade_kafka_lag`); `null` unless the
    /// owner answered.
    pub lag: Option<u64>,
    /// The owner node (etcd's owner key; in `scope=local`, this node if it
    /// holds the partition); `null`: no node owns it.
    pub node: Option<String>,
    /// The partition-owner token the owner holds it under (its etcd owner
    /// key's create revision); `null` unless the owner answered.
    pub owner_token: Option<u64>,
    /// Whether the owner serves it (appends and reads).
    pub serving: bool,
    /// `serving`; `rebuilding` (the owner is replaying it from Kafka);
    /// `unowned` (no node holds its owner lease: a rebalance or takeover);
    /// `unreachable` (its owner did not answer in time); `moving` (the
    /// node etcd names says it does not hold it: a handoff in progress);
    /// in `scope=local`, `elsewhere` (this node does not hold it).
    pub status: String,
}

/// `200` of `GET /v1/rejections`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RejectionsResponse {
    /// Newest first.
    pub rejections: Vec<RejectionOut>,
}

/// A refused write (HTTP or Kafka): enough to find the record and to
/// reconcile what the writer tried to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

/// `200` of `GET /v1/twins/{id}/refusals` and
/// `GET /v1/partitions/{p}/refusals`: the durable refusal journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RefusalsResponse {
    /// Newest first (at most the partition's cap are kept).
    pub refusals: Vec<RefusalOut>,
}

/// A refused write kept in the durable refusal journal (HTTP or Kafka):
/// who tried what with which token, and what stopped it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RefusalOut {
    /// Wall-clock milliseconds since 1970 when it was refused.
    pub at_ms: u64,
    /// SHA-256 (hex) of the refused events' canonical JSON: an array of
    /// `{"event_id","hlc"?,"patch","type"}`, keys sorted, no whitespace.
    pub digest: String,
    /// How many events the refused write carried.
    pub event_count: u32,
    /// The ids of the refused events, in order (at most 64).
    pub event_ids: Vec<String>,
    /// The fence the token hit (`stale_token` only).
    pub fence: Option<u64>,
    /// The holder the token was granted to, if the partition knows it.
    pub holder: Option<String>,
    pub message: String,
    /// The Kafka offset (`null` for HTTP), in `source_partition`.
    pub offset: Option<u64>,
    /// The store partition of the twin.
    pub partition: u32,
    /// The principal the token was granted to (authentication on), if known.
    pub principal: Option<String>,
    /// Stable reason name, as the `error` of the refused request.
    pub reason: String,
    /// Position in the partition's journal (grows, never reused).
    pub seq: u64,
    /// `http` or `kafka`.
    pub source: String,
    /// The Kafka partition the record was read from (`null` for HTTP).
    pub source_partition: Option<u32>,
    pub token: u64,
    pub twin_id: String,
}

/// `200` of `GET /v1/outbox`: effects of admitted events and their
/// delivery states (the fenced outbox, `docs/outbox.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutboxResponse {
    /// In order of partition, event seq, effect index.
    pub effects: Vec<OutboxEntryOut>,
    /// How many entries are in each state now, over all partitions (not
    /// only those listed; delivered ones are bounded by the retention).
    #[serde(default)]
    pub counts: OutboxCountsOut,
}

/// Outbox entries per delivery state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutboxCountsOut {
    pub pending: u64,
    pub delivered: u64,
    pub dead: u64,
}

/// One effect of one admitted event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutboxEntryOut {
    /// Delivery tries so far.
    pub attempts: u32,
    /// The POST's body, as compact JSON text.
    pub body: String,
    /// When the event was admitted (ms since 1970).
    pub created_at_ms: u64,
    pub event_id: String,
    /// `Idempotency-Key` of every try: `<event_id>:<index>`.
    pub idempotency_key: String,
    /// The effect's place in the event's `effects`.
    pub index: u16,
    /// `webhook`.
    pub kind: String,
    /// The last failed try's error.
    pub last_error: Option<String>,
    pub partition: u32,
    /// The event's seq in its partition.
    pub seq: u64,
    /// `pending`, `delivered` or `dead`.
    pub state: String,
    /// The token the event was admitted under (`Fencing-Token` of every try).
    pub token: u64,
    pub twin_id: String,
    /// When the state last changed (ms since 1970; 0: never tried).
    pub updated_at_ms: u64,
    /// A webhook's URL, or a `kafka` effect's topic.
    pub url: String,
}

/// `200` of `GET /v1/dead-letters`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeadLettersResponse {
    pub dead_letters: Vec<DeadLetterOut>,
    /// Cluster mode: partitions whose dead letters are not in the answer
    /// because their owner did not answer (`unreachable`) or no node owns
    /// them (`unowned`); absent when every partition answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<MissingPartitionOut>,
}

/// Cluster mode: a partition left out of a cluster-wide answer, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MissingPartitionOut {
    /// What went wrong (the owner's error, or that none owns it).
    pub error: String,
    /// The owner etcd names (`null`: none).
    pub node: Option<String>,
    pub partition: u32,
    /// `unreachable` or `unowned`.
    pub status: String,
}

/// A Kafka record that could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeadLetterOut {
    pub at_ms: u64,
    /// Record headers as `[name, value]` pairs (UTF-8, lossy).
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Vec<String>>))]
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

/// One audit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditOut {
    /// Position in the log: increasing, never reused.
    pub seq: u64,
    /// Wall-clock milliseconds since 1970.
    pub at_ms: u64,
    /// `grant`, `renew`, `release`, `write`, `read` or `admin`.
    pub action: String,
    /// `ok`, `stale`, `forbidden`, `limited`, `unauthenticated` or `refused`.
    pub outcome: String,
    /// The principal (`anonymous:<holder>` for grants with authentication
    /// off, empty when the request had no valid key).
    pub principal: String,
    /// `twin/<id>`, `partition/<p>` or `admin/<name>`; empty if unknown.
    pub scope: String,
    /// The fencing token involved (0: none).
    pub token: u64,
    /// The lease id, 32 hex characters (empty: none).
    pub lease_id: String,
    /// The stable error name of a refusal; for a granted lease its purpose
    /// (`correctness` or `efficiency`); empty for other successes.
    pub detail: String,
}

/// `200` of `GET /v1/audit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditResponse {
    pub records: Vec<AuditOut>,
    /// Pass as `after` for the next page (`null`: no records in this page).
    pub next_after: Option<u64>,
}

/// One node's part of `GET /v1/cluster/audit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeAuditOut {
    /// The node (`--cluster-node`; `local` on a single node).
    pub node: String,
    /// `ok`, or `unreachable` (the node did not answer; `error` says why).
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its records after its cursor, oldest first.
    pub records: Vec<AuditOut>,
    /// This node's part of the next cursor (`null`: no records here).
    pub next_after: Option<u64>,
}

/// `200` of `GET /v1/cluster/audit`: every node's audit log, node by node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterAuditResponse {
    pub nodes: Vec<NodeAuditOut>,
    /// Pass as `after` for the next page: `node:seq` per node, comma
    /// separated.
    pub next_after: String,
}

/// `GET /healthz`: `200` with `ok`, or `503` with `failed` and the storage
/// failure that stopped the store from acknowledging writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// `ok`, or `failed` after a storage failure (restart the store).
    pub status: String,
    /// What failed, when `status` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<HealthFailure>,
}

/// The storage failure behind a `failed` health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
