//! Palisade's wire types: every JSON body of the HTTP API (`docs/http-api.md`),
//! defined once. The server (`palisade-http`) writes them, the Rust SDK
//! (`palisade-client`) reads them, so a field one side renames or drops is
//! a compile error on the other instead of a silent `null` (issue 13;
//! `docs/decisions/0020-wire-crate.md`).
//!
//! With the `openapi` feature every type also derives `utoipa::ToSchema`;
//! the server's OpenAPI document (`/v1/openapi.json`) is built from these
//! definitions, doc comments included. The SDK leaves the feature off.
//!
//! The bytes on the wire are part of the contract: some bodies keep their
//! keys sorted (the order the server's `json!` bodies always had), see the
//! notes on [`EventsPage`] and [`PartitionOut`].
//!
//! ```
//! use palisade_api::{ErrorBody, ErrorName, StaleTokenError};
//!
//! let body = br#"{"error":"stale_token","message":"m","token":3,"fence":5}"#;
//! let e: ErrorBody = serde_json::from_slice(body).unwrap();
//! assert_eq!(e.name(), Some(ErrorName::StaleToken));
//! let stale: StaleTokenError = serde_json::from_slice(body).unwrap();
//! assert_eq!((stale.token, stale.fence), (3, 5));
//! ```

mod error;
mod event;
mod lease;
mod read;
mod sorted;

pub use error::{
    ClockDriftError, ErrorBody, ErrorName, LeaseGoneError, LeaseHeldError, StaleTokenError,
    TokenRefusedError, VersionMismatchError,
};
pub use event::{AppendResponse, EffectIn, EventIn, EventOut, EventsPage};
pub use lease::{AdvisedLeaseOut, LeaseAdviceOut, LeaseIn, LeaseOut, TailsOut};
pub use read::{
    AuditOut, AuditResponse, ClusterAuditResponse, ClusterPartitionOut, DeadLetterOut,
    DeadLettersResponse, Health, HealthFailure, MissingPartitionOut, NodeAuditOut, OutboxCountsOut,
    OutboxEntryOut, OutboxResponse, PartitionOut, PartitionsResponse, RefusalOut, RefusalsResponse,
    RejectionOut, RejectionsResponse, TwinResponse,
};
