//! Error bodies: `{"error": "<stable name>", "message": "<for people>", ...details}`.
//!
//! [`ErrorName`] lists every stable name the server sends, so the server
//! writes them and the SDK branches on them without either side spelling a
//! string. The per-error bodies ([`StaleTokenError`], [`LeaseHeldError`] ...)
//! carry the details a client acts on.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Declares [`ErrorName`] from `Variant => "wire_name"` pairs, so each name
/// is spelled once and `as_str`, `from_name` and `ALL` cannot disagree.
macro_rules! error_names {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        /// The stable, machine-readable name in an error body's `error`
        /// (and a rejection's `reason`), as listed in `docs/http-api.md`.
        ///
        /// A client built against an older list may meet a name it does not
        /// know: [`ErrorBody::name`] is `None` then, and the text is still in
        /// [`ErrorBody::error`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ErrorName {
            $($(#[$doc])* $variant,)+
        }

        impl ErrorName {
            /// Every name, in the order declared.
            pub const ALL: &'static [ErrorName] = &[$(ErrorName::$variant,)+];

            /// The name as it appears on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorName::$variant => $name,)+
                }
            }

            /// The name for its wire text; `None` for a name this build does
            /// not know.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(ErrorName::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

error_names! {
    /// `400`: the request body could not be read.
    BadBody => "bad_body",
    /// `400`: an event's `effects` is not a valid list of effects (bad URL,
    /// too many, unknown kind ...), or effects where they are not taken.
    BadEffects => "bad_effects",
    /// `400`: an event is not a valid event object.
    BadEvent => "bad_event",
    /// `400`: an event's `hlc` is not `<ntp64>/<hex id>`.
    BadHlc => "bad_hlc",
    /// `400`: the lease holder is empty, too long or has control characters.
    BadHolder => "bad_holder",
    /// `400`: `If-Match` is not one version tag.
    BadIfMatch => "bad_if_match",
    /// `400`: the body is not the JSON asked for.
    BadJson => "bad_json",
    /// `400`: `Last-Event-ID` of a watch is not a seq.
    BadLastEventId => "bad_last_event_id",
    /// `400`: the lease id is not 32 hex characters.
    BadLeaseId => "bad_lease_id",
    /// `400`: the partition in the path is not a number.
    BadPartition => "bad_partition",
    /// `400`: a patch is not an object, or nests too deep.
    BadPatch => "bad_patch",
    /// `400`: a query parameter is unknown or out of range.
    BadQuery => "bad_query",
    /// `400`: the scope is not `partition/<p>` or `twin/<id>`.
    BadScope => "bad_scope",
    /// `400`: `Fencing-Token` is not a decimal number.
    BadToken => "bad_token",
    /// `400`: the lease TTL is out of range.
    BadTtl => "bad_ttl",
    /// `400`: the twin id is not valid.
    BadTwinId => "bad_twin_id",
    /// `413`: more events in one request than the store takes.
    BatchTooLarge => "batch_too_large",
    /// `408`: the request body did not arrive in time.
    BodyTimeout => "body_timeout",
    /// `413`: the request body is over the limit.
    BodyTooLarge => "body_too_large",
    /// `422`: the event's HLC is too far ahead of the store's clock.
    ClockDrift => "clock_drift",
    /// `503`: the store is shutting down.
    Closed => "closed",
    /// `403`: the principal's roles do not grant the action on the scope.
    Forbidden => "forbidden",
    /// `503`: the lease authority (etcd) cannot be reached.
    LeaseAuthorityUnavailable => "lease_authority_unavailable",
    /// `410`: the lease expired.
    LeaseExpired => "lease_expired",
    /// `409`: another holder's lease on the scope is live.
    LeaseHeld => "lease_held",
    /// `503`: a new lease id collided with a live one; retry.
    LeaseIdCollision => "lease_id_collision",
    /// `404`: no such lease.
    LeaseNotFound => "lease_not_found",
    /// `403`: the lease was granted to another principal.
    LeaseNotYours => "lease_not_yours",
    /// `410`: the lease was released.
    LeaseReleased => "lease_released",
    /// `410`: a later grant on the scope superseded the lease.
    LeaseSuperseded => "lease_superseded",
    /// `405`: the path does not take that method.
    MethodNotAllowed => "method_not_allowed",
    /// `400`: an append without a `Fencing-Token` header.
    MissingToken => "missing_token",
    /// `400`: an append body with no event.
    NoEvents => "no_events",
    /// `404`: no such route.
    NoSuchRoute => "no_such_route",
    /// `307` (cluster mode): another node serves the twin's partition; follow `Location`.
    NotOwner => "not_owner",
    /// `503`: this node does not serve the partition (now).
    NotServing => "not_serving",
    /// `500`: the OpenAPI document could not be built.
    Openapi => "openapi",
    /// `409`: the outbox effect is pending or delivered; only dead ones
    /// can be removed.
    OutboxEffectNotDead => "outbox_effect_not_dead",
    /// `404`: no outbox effect at that partition, seq and index.
    OutboxEffectNotFound => "outbox_effect_not_found",
    /// `413`: a patch is over the per-event limit.
    PatchTooLarge => "patch_too_large",
    /// `429`: too many requests from this principal.
    RateLimited => "rate_limited",
    /// `409`: a later lease covers the twin; the token is fenced off.
    StaleToken => "stale_token",
    /// `500`: a storage error (the log has the cause under the incident id).
    Storage => "storage",
    /// `503`: a storage failure stopped the store from acknowledging writes.
    StorageFailed => "storage_failed",
    /// `403`: the store never issued the token.
    TokenNotIssued => "token_not_issued",
    /// `403`: the token was granted to another principal.
    TokenNotYours => "token_not_yours",
    /// `403`: the token's lease does not cover the twin.
    TokenScopeMismatch => "token_scope_mismatch",
    /// `500`: the store has issued every fencing token.
    TokensExhausted => "tokens_exhausted",
    /// `503`: the store is at its connection limit.
    TooManyConnections => "too_many_connections",
    /// `503`: this address is at its connection limit.
    TooManyConnectionsFromAddress => "too_many_connections_from_address",
    /// `429`: the principal holds as many live leases as it may.
    TooManyLeases => "too_many_leases",
    /// `400`: the twin id is longer than the store allows.
    TwinIdTooLong => "twin_id_too_long",
    /// `404`: no such twin (or none as of the time asked for).
    TwinNotFound => "twin_not_found",
    /// `401`: no valid API key.
    Unauthenticated => "unauthenticated",
    /// `400`/`404`: the partition is not below the partition count.
    UnknownPartition => "unknown_partition",
    /// `412`: `If-Match` does not name the twin's version.
    VersionMismatch => "version_mismatch",
    /// `412`: `If-Match` is a weak tag, which never matches.
    WeakIfMatch => "weak_if_match",
}

impl fmt::Display for ErrorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ErrorName> for &'static str {
    fn from(n: ErrorName) -> Self {
        n.as_str()
    }
}

/// Every error: a stable name, a message for people, and per error some
/// details (further properties).
// Reading this ignores the details; the per-error bodies below read them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// Stable name of the error, e.g. `bad_json`.
    pub error: String,
    /// For people.
    pub message: String,
    /// On a `500`: the id under which the store logged the cause (the body
    /// carries no OS or storage error text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incident: Option<String>,
}

impl ErrorBody {
    /// The error's name, if this build knows it.
    pub fn name(&self) -> Option<ErrorName> {
        ErrorName::from_name(&self.error)
    }
}

/// `409 stale_token`: a later grant covering this twin was seen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StaleTokenError {
    /// `stale_token`.
    pub error: String,
    pub message: String,
    /// The token of the request.
    pub token: u64,
    /// The fence it is below.
    pub fence: u64,
}

/// `403`: `token_not_issued` or `token_scope_mismatch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenRefusedError {
    /// `token_not_issued` or `token_scope_mismatch`.
    pub error: String,
    pub message: String,
    pub token: u64,
    /// `token_scope_mismatch` only: the scope the token was issued for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(required = false, nullable = false))]
    pub scope: Option<String>,
}

/// `412 version_mismatch`: `If-Match` does not name the twin's version; or
/// `412 weak_if_match`: `If-Match` is a weak tag (`W/"12"`), which never
/// matches under the strong comparison an append needs (no `expected`,
/// `current`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VersionMismatchError {
    /// `version_mismatch` or `weak_if_match`.
    pub error: String,
    pub message: String,
    /// The version in `If-Match` (`version_mismatch` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<u64>,
    /// The twin's version (`version_mismatch` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<u64>,
}

/// `422 clock_drift`: the event's HLC is too far ahead of the store's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClockDriftError {
    /// `clock_drift`.
    pub error: String,
    pub message: String,
    pub hlc: String,
    pub ahead_ms: u64,
    pub max_drift_ms: u64,
}

/// `409 lease_held`: another holder's lease on the scope is live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseHeldError {
    /// `lease_held`.
    pub error: String,
    pub message: String,
    pub scope: String,
    pub holder: String,
    pub token: u64,
    pub expires_in_ms: u64,
}

/// `410`: `lease_expired`, `lease_superseded` or `lease_released`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseGoneError {
    /// `lease_expired`, `lease_superseded` or `lease_released`.
    pub error: String,
    pub message: String,
    /// `lease_superseded` only: the token of the grant that superseded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(required = false, nullable = false))]
    pub by_token: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `from_name` is `as_str` backwards for every name: the SDK maps what
    /// the server wrote back to the same variant.
    #[test]
    fn every_name_reads_back() {
        for &n in ErrorName::ALL {
            assert_eq!(ErrorName::from_name(n.as_str()), Some(n), "{n}");
        }
        assert_eq!(ErrorName::from_name("no_such_name"), None);
    }
}
