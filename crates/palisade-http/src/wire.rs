//! The JSON shapes of the API are defined once, in `palisade-api` (shared
//! with the SDK; decision 0020), with their OpenAPI schemas behind its
//! `openapi` feature. What is left here turns the store's own types into
//! them: those conversions need `palisade-lease`, which the wire crate does
//! not depend on.

use palisade_core::Hlc;
use palisade_lease::{Advice, Lease, Tails};

pub use palisade_api::{
    AdvisedLeaseOut, AppendResponse, AuditOut, AuditResponse, ClockDriftError,
    ClusterAuditResponse, ClusterPartitionOut, DeadLetterOut, DeadLettersResponse, ErrorBody,
    ErrorName, EventIn, EventOut, EventsPage, Health, HealthFailure, LeaseAdviceOut,
    LeaseGoneError, LeaseHeldError, LeaseIn, LeaseOut, MissingPartitionOut, NodeAuditOut,
    OutboxEntryOut, OutboxResponse, PartitionOut, PartitionsResponse, RefusalOut, RefusalsResponse,
    RejectionOut, RejectionsResponse, StaleTokenError, TailsOut, TokenRefusedError, TwinResponse,
    VersionMismatchError,
};

/// A lease as acquire, renew and `GET /v1/partitions` show it.
pub(crate) fn lease_out(l: &Lease, expires_in_ms: u64) -> LeaseOut {
    LeaseOut {
        lease_id: l.id.to_string(),
        scope: l.scope.to_string(),
        holder: l.holder.clone(),
        token: l.token.0,
        ttl_ms: l.ttl_ms,
        purpose: l.purpose,
        expires_in_ms,
    }
}

fn tails_out(t: Tails) -> TailsOut {
    TailsOut {
        p50_ms: t.p50_ms,
        tail_ms: t.tail_ms,
        max_ms: t.max_ms,
    }
}

/// The advice for `scope` (and `holder`, if narrowed), with the scope's
/// live lease measured against it.
pub(crate) fn advice_out(
    scope: String,
    holder: Option<String>,
    a: &Advice,
    current: Option<&Lease>,
) -> LeaseAdviceOut {
    LeaseAdviceOut {
        scope,
        holder,
        gaps: a.gaps as u64,
        renewal_gap: tails_out(a.gap),
        answer_latency: tails_out(a.latency),
        pause_tail_ms: a.pause_tail_ms,
        tail_ttl_ms: a.tail_ttl_ms,
        recommended_ttl_ms: a.recommended_ttl_ms,
        recommended_renew_every_ms: a.recommended_renew_every_ms,
        late_renewals: a.late_renewals,
        current: current.map(|l| AdvisedLeaseOut {
            holder: l.holder.clone(),
            ttl_ms: l.ttl_ms,
            ttl_below_tail: a.ttl_below(l.ttl_ms),
        }),
    }
}

pub(crate) fn hlc_text(h: Hlc) -> String {
    h.to_string()
}
