//! Lease bodies: the grant request and the lease the store answers with.

use palisade_core::Purpose;
use serde::{Deserialize, Serialize};

/// The body of `POST /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(
    feature = "openapi",
    schema(examples(
        json!({"scope": "twin/boiler-7", "holder": "worker-a", "ttl_ms": 10000}),
        json!({"scope": "partition/3", "holder": "worker-b", "ttl_ms": 30000}),
        json!({"scope": "twin/job-17", "holder": "worker-c", "ttl_ms": 10000, "purpose": "efficiency"}),
    ))
)]
// `expecting`: serde would otherwise say "expected struct LeaseIn",
// naming a Rust type the client has never seen.
#[serde(
    deny_unknown_fields,
    expecting = "a lease request object {\"scope\", \"holder\", \"ttl_ms\", \"purpose\"?}"
)]
pub struct LeaseIn {
    /// `partition/<p>` (p below the partition count) or `twin/<id>`.
    #[cfg_attr(feature = "openapi", schema(pattern = "^(partition/[0-9]+|twin/.+)$"))]
    pub scope: String,
    /// Who holds the lease (shown to other holders, stored with each event):
    /// 1..256 bytes without control characters.
    #[cfg_attr(
        feature = "openapi",
        schema(
            min_length = 1,
            max_length = 256,
            pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]+$"
        )
    )]
    pub holder: String,
    /// Time to live: 100..=86400000 ms.
    #[cfg_attr(feature = "openapi", schema(minimum = 100, maximum = 86_400_000))]
    pub ttl_ms: u64,
    /// What the lease is for: `correctness` (the default: two holders at
    /// once would corrupt data) or `efficiency` (they would only duplicate
    /// work). Both are fenced alike; see docs/decisions/0028-lease-purpose.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(value_type = Option<String>, pattern = "^(correctness|efficiency)$")
    )]
    pub purpose: Option<Purpose>,
}

/// A lease as returned by acquire and renew.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseOut {
    /// 32 lowercase hex characters.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[0-9a-f]{32}$"))]
    pub lease_id: String,
    /// `partition/<p>` or `twin/<id>`.
    pub scope: String,
    pub holder: String,
    /// The fencing token: send it as `Fencing-Token` with every append.
    pub token: u64,
    pub ttl_ms: u64,
    /// `correctness` or `efficiency` (absent from stores before purposes: correctness).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = String, pattern = "^(correctness|efficiency)$"))]
    pub purpose: Purpose,
    // How long the lease had left as the store saw it when answering (for
    // a fresh grant or renewal: `ttl_ms`). A `//` comment: a doc comment
    // would add a description to the OpenAPI document.
    pub expires_in_ms: u64,
}

/// p50, tail and maximum of a set of measurements, in milliseconds. The
/// tail is the p99 from 100 samples on, the maximum below.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TailsOut {
    pub p50_ms: f64,
    pub tail_ms: f64,
    pub max_ms: f64,
}

/// `GET /v1/leases/advice`: the TTL a scope's measured renewal gaps call
/// for (docs/decisions/0026-ttl-advice.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseAdviceOut {
    pub scope: String,
    /// The holder the samples were narrowed to; absent = every holder of the scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Renewal gaps measured since the store started (newest 512 per holder).
    pub gaps: u64,
    /// Time between a lease's consecutive grant or renewal and its next renewal.
    pub renewal_gap: TailsOut,
    /// Time the store took to answer grants and renewals.
    pub answer_latency: TailsOut,
    /// `renewal_gap.tail_ms - renewal_gap.p50_ms`: what pauses added.
    pub pause_tail_ms: f64,
    /// `3 * (pause_tail_ms + answer_latency.tail_ms)`, rounded up to 100 ms:
    /// the shortest TTL the measured tails allow; null until 20 gaps were measured.
    pub tail_ttl_ms: Option<u64>,
    /// `tail_ttl_ms`, at least 1000; null until 20 gaps were measured.
    pub recommended_ttl_ms: Option<u64>,
    /// A third of the recommended TTL (the SDK's default renewal period).
    pub recommended_renew_every_ms: Option<u64>,
    /// Renewals that arrived after their lease had expired.
    pub late_renewals: u64,
    /// The live lease on the scope, if any, and whether its TTL is below `tail_ttl_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<AdvisedLeaseOut>,
}

/// The live lease a [`LeaseAdviceOut`] was computed for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdvisedLeaseOut {
    pub holder: String,
    pub ttl_ms: u64,
    /// `ttl_ms` is below `tail_ttl_ms`: a pause as long as the measured
    /// tail may expire this lease while its holder is healthy.
    pub ttl_below_tail: bool,
}
