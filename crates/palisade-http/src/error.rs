//! The one place where errors become HTTP status codes and JSON bodies.
//! Every error body is `{"error": "<stable_name>", "message": "<for people>", ...details}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use palisade_auth::AuthError;
use palisade_lease::LeaseError;
use palisade_log::{AppendError, AuditOutcome, LeaseOpError, ReadError};
use serde::Serialize;
use serde_json::{json, Value};

use crate::wire::{
    ClockDriftError, ErrorBody, ErrorName, LeaseGoneError, LeaseHeldError, StaleTokenError,
    TokenRefusedError, VersionMismatchError,
};

/// An API error: status, stable name, message and extra fields.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    message: String,
    details: Value,
    /// How the audit log records this error when the request is audited
    /// (an append, a lease operation); `None`: not worth a record (e.g.
    /// malformed input). Set where the typed error becomes an `ApiError`,
    /// so nobody reads a response back to find out.
    audit: Option<AuditOutcome>,
}

impl ApiError {
    /// `error` is an [`ErrorName`], or the text of one (a reason name from
    /// a layer below, e.g. `palisade_core::json`'s).
    pub fn new(
        status: StatusCode,
        error: impl Into<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            error: error.into(),
            message: message.into(),
            details: Value::Null,
            audit: None,
        }
    }

    /// This error, audited as `outcome`.
    pub(crate) fn audited(mut self, outcome: AuditOutcome) -> Self {
        self.audit = Some(outcome);
        self
    }

    /// How the audit log records this error, if it is worth a record.
    pub(crate) fn audit_outcome(&self) -> Option<AuditOutcome> {
        self.audit
    }

    pub fn bad_request(error: impl Into<&'static str>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, message)
    }

    pub fn not_found(error: impl Into<&'static str>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, error, message)
    }

    /// A 5xx whose cause the client cannot act on (a sled or OS error: file
    /// paths, errno text). The cause goes to the log under a short incident
    /// id; the body carries the stable name, a generic message and the id,
    /// so an operator can find the log line (issue 18: 500 bodies carried
    /// raw OS error text).
    pub fn internal(error: impl Into<&'static str>, cause: &dyn std::fmt::Display) -> Self {
        let error = error.into();
        let incident = incident_id();
        tracing::error!(error, incident = %incident, cause = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            error,
            internal_message(error, &incident),
        )
        .with(json!({ "incident": incident }))
    }

    /// 503 `storage_failed`: the store stopped acknowledging writes after a
    /// storage failure (fail-stop) and says which.
    pub fn storage_failed(f: &palisade_log::StorageFailure) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorName::StorageFailed,
            f.to_string(),
        )
        .with(json!({
            "failure": {
                "op": f.op,
                "kind": f.kind.to_string(),
                "detail": f.detail,
                "at_ms": f.at_ms,
            }
        }))
    }

    fn with(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    /// The details from one of the wire crate's typed error bodies, so the
    /// bodies the SDK reads (`StaleTokenError`, ...) are written by the same
    /// definition. Its `error` and `message` repeat this error's.
    fn with_body(self, body: &impl Serialize) -> Self {
        // A struct of strings and integers always serializes.
        let details = serde_json::to_value(body).unwrap_or(Value::Null);
        self.with(details)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable error name.
    pub fn name(&self) -> &'static str {
        self.error
    }

    /// The message for people.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// 12 hex characters: enough to find one log line, short enough to quote.
pub(crate) fn incident_id() -> String {
    let mut id = uuid::Uuid::new_v4().simple().to_string();
    id.truncate(12);
    id
}

/// What a client is told of an internal error.
pub(crate) fn internal_message(error: &str, incident: &str) -> String {
    format!("internal error ({error}); the store's log has the details under incident {incident}")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = (self.status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| self.details.get("retry_after_s").and_then(Value::as_u64))
            .flatten();
        let head = ErrorBody {
            error: self.error.to_owned(),
            message: self.message,
            incident: None,
        };
        // Through a `Value`: its object (a `BTreeMap`) writes the keys
        // sorted, the order error bodies have always had on the wire.
        let mut body = serde_json::to_value(head).unwrap_or(Value::Null);
        if let (Value::Object(b), Value::Object(d)) = (&mut body, self.details) {
            b.extend(d);
        }
        let mut resp = (self.status, axum::Json(body)).into_response();
        // A store stopped by a storage failure does not come back by
        // itself: no Retry-After for it.
        if self.status == StatusCode::SERVICE_UNAVAILABLE
            && self.error != ErrorName::StorageFailed.as_str()
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"palisade\""),
            );
        }
        resp
    }
}

impl From<AppendError> for ApiError {
    fn from(e: AppendError) -> Self {
        let msg = e.to_string();
        let reason = e.reason();
        match e {
            AppendError::Stale { token, fence } => {
                let body = StaleTokenError {
                    error: reason.to_owned(),
                    message: msg.clone(),
                    token: token.0,
                    fence: fence.0,
                };
                Self::new(StatusCode::CONFLICT, reason, msg)
                    .with_body(&body)
                    .audited(AuditOutcome::Stale)
            }
            AppendError::NotIssued { token } => {
                let body = TokenRefusedError {
                    error: reason.to_owned(),
                    message: msg.clone(),
                    token: token.0,
                    scope: None,
                };
                Self::new(StatusCode::FORBIDDEN, reason, msg)
                    .with_body(&body)
                    .audited(AuditOutcome::Forbidden)
            }
            AppendError::WrongScope { token, scope, .. } => {
                let body = TokenRefusedError {
                    error: reason.to_owned(),
                    message: msg.clone(),
                    token: token.0,
                    scope: Some(scope.to_string()),
                };
                Self::new(StatusCode::FORBIDDEN, reason, msg)
                    .with_body(&body)
                    .audited(AuditOutcome::Forbidden)
            }
            AppendError::VersionMismatch { expected, current } => {
                let body = VersionMismatchError {
                    error: reason.to_owned(),
                    message: msg.clone(),
                    expected: Some(expected),
                    current: Some(current),
                };
                Self::new(StatusCode::PRECONDITION_FAILED, reason, msg).with_body(&body)
            }
            AppendError::ClockDrift(d) => {
                let body = ClockDriftError {
                    error: reason.to_owned(),
                    message: msg.clone(),
                    hlc: d.hlc.to_string(),
                    ahead_ms: d.ahead_ms,
                    max_drift_ms: d.max_drift_ms,
                };
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, reason, msg).with_body(&body)
            }
            AppendError::BadPatch(_) | AppendError::BadEvent(_) => Self::bad_request(reason, msg),
            AppendError::Storage(cause) => Self::internal(reason, &cause),
            AppendError::StorageFailed(f) => Self::storage_failed(&f),
            AppendError::Closed => Self::new(StatusCode::SERVICE_UNAVAILABLE, reason, msg),
            AppendError::NotServing(_) => Self::new(StatusCode::SERVICE_UNAVAILABLE, reason, msg),
        }
    }
}

impl From<LeaseOpError> for ApiError {
    fn from(e: LeaseOpError) -> Self {
        let msg = e.to_string();
        match e {
            LeaseOpError::Lease(l) => match l {
                LeaseError::Held {
                    scope,
                    holder,
                    token,
                    expires_in_ms,
                } => {
                    let name = ErrorName::LeaseHeld;
                    let body = LeaseHeldError {
                        error: name.to_string(),
                        message: msg.clone(),
                        scope: scope.to_string(),
                        holder,
                        token: token.0,
                        expires_in_ms,
                    };
                    Self::new(StatusCode::CONFLICT, name, msg).with_body(&body)
                }
                LeaseError::Expired(_) => Self::new(StatusCode::GONE, ErrorName::LeaseExpired, msg),
                LeaseError::Superseded { by_token, .. } => {
                    let name = ErrorName::LeaseSuperseded;
                    let body = LeaseGoneError {
                        error: name.to_string(),
                        message: msg.clone(),
                        by_token: Some(by_token.0),
                    };
                    Self::new(StatusCode::GONE, name, msg).with_body(&body)
                }
                LeaseError::Released(_) => {
                    Self::new(StatusCode::GONE, ErrorName::LeaseReleased, msg)
                }
                LeaseError::Unknown(_) => Self::not_found(ErrorName::LeaseNotFound, msg),
                LeaseError::BadTtl(_) => Self::bad_request(ErrorName::BadTtl, msg),
                LeaseError::BadHolder => Self::bad_request(ErrorName::BadHolder, msg),
                LeaseError::DuplicateId(_) => Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorName::LeaseIdCollision,
                    msg,
                ),
                LeaseError::TokensExhausted => Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ErrorName::TokensExhausted,
                    msg,
                ),
            },
            LeaseOpError::UnknownPartition { .. } => {
                Self::bad_request(ErrorName::UnknownPartition, msg)
            }
            LeaseOpError::Storage(cause) => Self::internal(ErrorName::Storage, &cause),
            LeaseOpError::StorageFailed(f) => Self::storage_failed(&f),
            LeaseOpError::Unavailable(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorName::LeaseAuthorityUnavailable,
                msg,
            ),
            LeaseOpError::Closed => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorName::Closed, msg)
            }
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        let msg = e.to_string();
        match e {
            ReadError::UnknownPartition { .. } => Self::not_found(ErrorName::UnknownPartition, msg),
            ReadError::HistoryLoading { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorName::NotServing, msg)
            }
            ReadError::Storage(_) | ReadError::Damaged { .. } => {
                Self::internal(ErrorName::Storage, &msg)
            }
        }
    }
}

impl From<palisade_log::OutboxRemoveError> for ApiError {
    fn from(e: palisade_log::OutboxRemoveError) -> Self {
        use palisade_log::OutboxRemoveError as E;
        let msg = e.to_string();
        match e {
            E::NotFound { .. } => Self::not_found(ErrorName::OutboxEffectNotFound, msg),
            E::NotDead { .. } => {
                Self::new(StatusCode::CONFLICT, ErrorName::OutboxEffectNotDead, msg)
            }
            E::NotServing(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorName::NotServing, msg)
            }
            E::Read(r) => r.into(),
            E::Storage(f) => Self::storage_failed(&f),
        }
    }
}

impl From<crate::caller::Refusal> for ApiError {
    fn from(r: crate::caller::Refusal) -> Self {
        use crate::caller::Refusal as R;
        match r {
            R::Unauthenticated { reason } => {
                Self::new(StatusCode::UNAUTHORIZED, ErrorName::Unauthenticated, reason)
            }
            R::Policy(AuthError::Forbidden {
                principal,
                action,
                scope,
            }) => Self::new(
                StatusCode::FORBIDDEN,
                ErrorName::Forbidden,
                format!("principal {principal:?} may not {action} on {scope}"),
            )
            .with(json!({ "action": action.name(), "scope": scope })),
            R::Policy(other) => Self::new(StatusCode::FORBIDDEN, "forbidden", other.to_string()),
            R::LeaseNotYours { principal } => Self::new(
                StatusCode::FORBIDDEN,
                ErrorName::LeaseNotYours,
                format!(
                    "this lease was not granted to {principal:?} (another principal's, \
                     granted before authentication was on, or unknown)"
                ),
            ),
            R::TokenNotYours { token } => Self::new(
                StatusCode::FORBIDDEN,
                ErrorName::TokenNotYours,
                format!(
                    "fencing token {token} was not granted to you; take a lease of your own \
                     (tokens granted before authentication was on belong to nobody)"
                ),
            )
            .with(json!({ "token": token })),
            R::RateLimited { retry_after } => {
                // Whole seconds, rounded up: a client that waits that long
                // is let through.
                let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
                Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    ErrorName::RateLimited,
                    format!("too many requests from this principal; retry in {secs} s"),
                )
                .with(json!({ "retry_after_s": secs.max(1) }))
            }
            R::TooManyLeases { held, max } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                ErrorName::TooManyLeases,
                format!("this principal holds {held} live leases; the limit is {max}; release one first"),
            )
            .with(json!({ "held": held, "max": max })),
            R::TwinIdTooLong { len, max } => Self::bad_request(
                ErrorName::TwinIdTooLong,
                format!("twin id of {len} bytes; this store's limit is {max}"),
            ),
            R::PatchTooDeep { max } => Self::bad_request(
                ErrorName::BadPatch,
                format!("patch nests deeper than {max} levels (this store's limit)"),
            ),
            R::PatchTooLarge { len, max } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorName::PatchTooLarge,
                format!("a patch of {len} bytes; this store's limit is {max} per event"),
            )
            .audited(AuditOutcome::Limited),
            R::BodyTooLarge { max } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorName::BodyTooLarge,
                format!("request body is larger than the {max}-byte limit"),
            )
            .audited(AuditOutcome::Limited),
            R::AuditStorage(e) => Self::internal(ErrorName::Storage, &format!("audit log: {e}")),
        }
    }
}

impl From<palisade_log::AuditError> for ApiError {
    fn from(e: palisade_log::AuditError) -> Self {
        match e {
            palisade_log::AuditError::Failed(f) => Self::storage_failed(&f),
            other => Self::internal(ErrorName::Storage, &other),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Issue 18: 500 bodies carried the OS's words ("No space left on
    /// device (os error 28)", file paths). They carry a generic message and
    /// an incident id; the cause is logged.
    #[test]
    fn internal_errors_carry_no_os_text() {
        let os = "IO error: No space left on device (os error 28) at /srv/palisade/db";
        let errors = [
            ApiError::from(AppendError::Storage(os.into())),
            ApiError::from(LeaseOpError::Storage(os.into())),
            ApiError::from(ReadError::Damaged {
                key: b"/srv sled key".to_vec(),
                source: palisade_core::codec::CodecError::Empty,
            }),
            ApiError::from(crate::caller::Refusal::AuditStorage(os.into())),
        ];
        for e in errors {
            assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(e.error, "storage");
            for leak in ["os error", "No space", "/srv", "IO error", "sled"] {
                assert!(!e.message.contains(leak), "{}", e.message);
            }
            let incident = e.details["incident"].as_str().unwrap();
            assert_eq!(incident.len(), 12);
            assert!(e.message.contains(incident), "{}", e.message);
        }
    }

    /// The names that reach `ApiError` as text from the layers below (the
    /// log's append refusals, the event parser's kinds) are all
    /// `ErrorName`s, so the SDK can branch on every name the store sends.
    #[test]
    fn names_from_lower_layers_are_error_names() {
        use palisade_core::{ClockDrift, FencingToken, TwinId};
        let t = FencingToken(1);
        let appends = [
            AppendError::Stale { token: t, fence: t },
            AppendError::NotIssued { token: t },
            AppendError::WrongScope {
                token: t,
                scope: "twin/a".parse().unwrap(),
                twin: TwinId::new("b").unwrap(),
            },
            AppendError::VersionMismatch {
                expected: 1,
                current: 2,
            },
            AppendError::ClockDrift(ClockDrift {
                hlc: "1/1".parse().unwrap(),
                ahead_ms: 1,
                max_drift_ms: 1,
            }),
            AppendError::BadPatch(palisade_twin::PatchError::TooDeep { max: 1 }),
            AppendError::BadEvent("x".into()),
            AppendError::Storage("x".into()),
            AppendError::StorageFailed(palisade_log::StorageFailure {
                op: "wal sync",
                kind: std::io::ErrorKind::Other,
                detail: "x".into(),
                at_ms: 0,
            }),
            AppendError::Closed,
            AppendError::NotServing("x".into()),
        ];
        for e in appends {
            let reason = e.reason();
            assert_eq!(ApiError::from(e).name(), reason);
            assert!(ErrorName::from_name(reason).is_some(), "{reason}");
        }
        let bodies: [&[u8]; 6] = [
            b"{",
            b"[]",
            b"7",
            br#"{"type":"t"}"#,
            br#"{"type":"t","patch":{},"hlc":"x"}"#,
            br#"{"type":"t","patch":{},"effects":7}"#,
        ];
        for body in bodies {
            let kind = palisade_core::json::parse_events(body, |_| "id".into())
                .unwrap_err()
                .kind;
            assert!(ErrorName::from_name(kind).is_some(), "{kind}");
        }
    }

    /// Refusals a client can act on keep their specific message.
    #[test]
    fn client_errors_keep_their_message() {
        let e = ApiError::from(AppendError::BadEvent("type must be 1 to 128 bytes".into()));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("type must be"), "{}", e.message);
    }
}
