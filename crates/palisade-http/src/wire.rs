//! The JSON shapes of the API are defined once, in `palisade-api` (shared
//! with the SDK; decision 0020), with their OpenAPI schemas behind its
//! `openapi` feature. What is left here turns the store's own types into
//! them: those conversions need `palisade-lease`, which the wire crate does
//! not depend on.

use palisade_core::Hlc;
use palisade_lease::Lease;

pub use palisade_api::{
    AppendResponse, AuditOut, AuditResponse, ClockDriftError, DeadLetterOut, DeadLettersResponse,
    ErrorBody, ErrorName, EventIn, EventOut, EventsPage, Health, HealthFailure, LeaseGoneError,
    LeaseHeldError, LeaseIn, LeaseOut, PartitionOut, PartitionsResponse, RefusalOut,
    RefusalsResponse, RejectionOut, RejectionsResponse, StaleTokenError, TokenRefusedError,
    TwinResponse, VersionMismatchError,
};

/// A lease as acquire, renew and `GET /v1/partitions` show it.
pub(crate) fn lease_out(l: &Lease, expires_in_ms: u64) -> LeaseOut {
    LeaseOut {
        lease_id: l.id.to_string(),
        scope: l.scope.to_string(),
        holder: l.holder.clone(),
        token: l.token.0,
        ttl_ms: l.ttl_ms,
        expires_in_ms,
    }
}

pub(crate) fn hlc_text(h: Hlc) -> String {
    h.to_string()
}
