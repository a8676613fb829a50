//! Lease bodies: the grant request and the lease the store answers with.

use serde::{Deserialize, Serialize};

/// The body of `POST /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(
    feature = "openapi",
    schema(examples(
        json!({"scope": "twin/boiler-7", "holder": "worker-a", "ttl_ms": 10000}),
        json!({"scope": "partition/3", "holder": "worker-b", "ttl_ms": 30000}),
    ))
)]
// `expecting`: serde would otherwise say "expected struct LeaseIn",
// naming a Rust type the client has never seen.
#[serde(
    deny_unknown_fields,
    expecting = "a lease request object {\"scope\", \"holder\", \"ttl_ms\"}"
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
    // How long the lease had left as the store saw it when answering (for
    // a fresh grant or renewal: `ttl_ms`). A `//` comment: a doc comment
    // would add a description to the OpenAPI document.
    pub expires_in_ms: u64,
}
