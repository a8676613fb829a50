//! The one place where errors become HTTP status codes and JSON bodies.
//! Every error body is `{"error": "<stable_name>", "message": "<for people>", ...details}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use palisade_lease::LeaseError;
use palisade_log::{AppendError, LeaseOpError, ReadError};
use serde_json::{json, Value};

/// An API error: status, stable name, message and extra fields.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    message: String,
    details: Value,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            error,
            message: message.into(),
            details: Value::Null,
        }
    }

    pub fn bad_request(error: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, message)
    }

    pub fn not_found(error: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, error, message)
    }

    fn with(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({ "error": self.error, "message": self.message });
        if let (Value::Object(b), Value::Object(d)) = (&mut body, self.details) {
            b.extend(d);
        }
        let mut resp = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

impl From<AppendError> for ApiError {
    fn from(e: AppendError) -> Self {
        let msg = e.to_string();
        let reason = e.reason();
        match e {
            AppendError::Stale { token, fence } => Self::new(StatusCode::CONFLICT, reason, msg)
                .with(json!({ "token": token.0, "fence": fence.0 })),
            AppendError::NotIssued { token } => {
                Self::new(StatusCode::FORBIDDEN, reason, msg).with(json!({ "token": token.0 }))
            }
            AppendError::WrongScope { token, scope, .. } => {
                Self::new(StatusCode::FORBIDDEN, reason, msg)
                    .with(json!({ "token": token.0, "scope": scope.to_string() }))
            }
            AppendError::VersionMismatch { expected, current } => {
                Self::new(StatusCode::PRECONDITION_FAILED, reason, msg)
                    .with(json!({ "expected": expected, "current": current }))
            }
            AppendError::ClockDrift(d) => Self::new(StatusCode::UNPROCESSABLE_ENTITY, reason, msg)
                .with(json!({
                    "hlc": d.hlc.to_string(),
                    "ahead_ms": d.ahead_ms,
                    "max_drift_ms": d.max_drift_ms,
                })),
            AppendError::BadPatch(_) | AppendError::BadEvent(_) => Self::bad_request(reason, msg),
            AppendError::Storage(_) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, reason, msg),
            AppendError::Closed => Self::new(StatusCode::SERVICE_UNAVAILABLE, reason, msg),
        }
    }
}

impl From<LeaseOpError> for ApiError {
    fn from(e: LeaseOpError) -> Self {
        let msg = e.to_string();
        match e {
            LeaseOpError::Lease(l) => match l {
                LeaseError::Held { scope, holder, token, expires_in_ms } => Self::new(StatusCode::CONFLICT, "lease_held", msg)
                    .with(json!({ "scope": scope.to_string(), "holder": holder, "token": token.0, "expires_in_ms": expires_in_ms })),
                LeaseError::Expired(_) => Self::new(StatusCode::GONE, "lease_expired", msg),
                LeaseError::Superseded { by_token, .. } => {
                    Self::new(StatusCode::GONE, "lease_superseded", msg).with(json!({ "by_token": by_token.0 }))
                }
                LeaseError::Released(_) => Self::new(StatusCode::GONE, "lease_released", msg),
                LeaseError::Unknown(_) => Self::not_found("lease_not_found", msg),
                LeaseError::BadTtl(_) => Self::bad_request("bad_ttl", msg),
                LeaseError::BadHolder => Self::bad_request("bad_holder", msg),
                LeaseError::DuplicateId(_) => Self::new(StatusCode::SERVICE_UNAVAILABLE, "lease_id_collision", msg),
                LeaseError::TokensExhausted => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "tokens_exhausted", msg),
            },
            LeaseOpError::UnknownPartition { .. } => Self::bad_request("unknown_partition", msg),
            LeaseOpError::Storage(_) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "storage", msg),
            LeaseOpError::Closed => Self::new(StatusCode::SERVICE_UNAVAILABLE, "closed", msg),
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        let msg = e.to_string();
        match e {
            ReadError::UnknownPartition { .. } => Self::not_found("unknown_partition", msg),
            ReadError::Storage(_) | ReadError::Damaged { .. } => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "storage", msg)
            }
        }
    }
}
