//! The client's one error type, and how a server error body becomes it.

use serde_json::Value;

/// Everything a call can fail with.
///
/// The typed variants cover the refusals a writer acts on; every other
/// non-2xx response is [`ClientError::Api`] with the server's stable error
/// name (see `docs/http-api.md`).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `409 stale_token`: a lease covering this twin was granted after the
    /// one that issued `token`; the store's fence is `fence`. The writer has
    /// been fenced off and must stop writing under this token.
    #[error(
        "fencing token {token} is stale: the fence is {fence} (a later lease covers this twin)"
    )]
    Stale { token: u64, fence: u64 },
    /// `409 lease_held`: another holder's lease on the scope is live.
    #[error("the scope is held by {holder:?} for another {expires_in_ms} ms")]
    LeaseHeld { holder: String, expires_in_ms: u64 },
    /// The lease can no longer be renewed or released: `410` with `reason`
    /// `lease_expired`, `lease_superseded` or `lease_released`, or `404`
    /// `lease_not_found`.
    #[error("the lease is gone ({reason})")]
    LeaseGone { reason: String },
    /// Any other non-2xx response, with the server's error body.
    #[error("HTTP {status} {error}: {message}")]
    Api {
        status: u16,
        error: String,
        message: String,
    },
    /// The request did not get a usable response: connect failure, timeout,
    /// connection dropped, or a 2xx body that could not be decoded.
    #[error("transport error: {0}")]
    Transport(#[from] reqwest::Error),
    /// A change stream ([`EventStream`](crate::EventStream)) reported a
    /// problem. `error` is `storage` (the server could not read the log; it
    /// retries and the stream goes on), `bad_event` (data that is not an
    /// event; skipped, the stream goes on) or `idle_timeout` (nothing, not
    /// even a keep-alive, for [`WATCH_IDLE_TIMEOUT`](crate::WATCH_IDLE_TIMEOUT);
    /// the stream ends: resume from its last event id).
    #[error("change stream: {error}: {message}")]
    Stream { error: String, message: String },
    /// The base URL given to [`Client::new`](crate::Client::new) is unusable.
    #[error("bad base URL: {0}")]
    BadUrl(String),
}

impl ClientError {
    /// The HTTP status of a refusal, if the server sent one.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Stale { .. } | Self::LeaseHeld { .. } => Some(409),
            Self::LeaseGone { reason } if reason == "lease_not_found" => Some(404),
            Self::LeaseGone { .. } => Some(410),
            Self::Api { status, .. } => Some(*status),
            Self::Transport(e) => e.status().map(|s| s.as_u16()),
            Self::Stream { .. } | Self::BadUrl(_) => None,
        }
    }

    /// The server's stable error name (`stale_token`, `lease_held`, …), if any.
    pub fn error_name(&self) -> Option<&str> {
        match self {
            Self::Stale { .. } => Some("stale_token"),
            Self::LeaseHeld { .. } => Some("lease_held"),
            Self::LeaseGone { reason } => Some(reason),
            Self::Api { error, .. } | Self::Stream { error, .. } => Some(error),
            Self::Transport(_) | Self::BadUrl(_) => None,
        }
    }
}

/// The most of a non-JSON error body kept in [`ClientError::Api`]'s message.
const MAX_RAW_MESSAGE: usize = 512;

/// Turn a non-2xx response (status and body) into a [`ClientError`].
pub(crate) fn from_response(status: u16, body: &[u8]) -> ClientError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let error = v.get("error").and_then(Value::as_str);
    let num = |k: &str| v.get(k).and_then(Value::as_u64);
    match (status, error) {
        (409, Some("stale_token")) => {
            if let (Some(token), Some(fence)) = (num("token"), num("fence")) {
                return ClientError::Stale { token, fence };
            }
        }
        (409, Some("lease_held")) => {
            return ClientError::LeaseHeld {
                holder: v
                    .get("holder")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                expires_in_ms: num("expires_in_ms").unwrap_or(0),
            };
        }
        (410, reason) => {
            return ClientError::LeaseGone {
                reason: reason.unwrap_or("lease_gone").to_owned(),
            };
        }
        (404, Some("lease_not_found")) => {
            return ClientError::LeaseGone {
                reason: "lease_not_found".to_owned(),
            };
        }
        _ => {}
    }
    let message = match v.get("message").and_then(Value::as_str) {
        Some(m) => m.to_owned(),
        None => {
            let raw = String::from_utf8_lossy(body);
            let mut end = raw.len().min(MAX_RAW_MESSAGE);
            while !raw.is_char_boundary(end) {
                end -= 1;
            }
            raw[..end].to_owned()
        }
    };
    ClientError::Api {
        status,
        error: error.unwrap_or("unexpected_response").to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(status: u16, body: &str) -> ClientError {
        from_response(status, body.as_bytes())
    }

    #[test]
    fn typed_refusals() {
        assert!(matches!(
            err(
                409,
                r#"{"error":"stale_token","message":"m","token":3,"fence":5}"#
            ),
            ClientError::Stale { token: 3, fence: 5 }
        ));
        match err(
            409,
            r#"{"error":"lease_held","message":"m","scope":"twin/x","holder":"b","token":4,"expires_in_ms":90}"#,
        ) {
            ClientError::LeaseHeld {
                holder,
                expires_in_ms,
            } => {
                assert_eq!(holder, "b");
                assert_eq!(expires_in_ms, 90);
            }
            other => panic!("{other:?}"),
        }
        for reason in ["lease_expired", "lease_superseded", "lease_released"] {
            let e = err(410, &format!(r#"{{"error":"{reason}","message":"m"}}"#));
            assert!(matches!(&e, ClientError::LeaseGone { reason: r } if r == reason));
            assert_eq!(e.status(), Some(410));
        }
        let e = err(404, r#"{"error":"lease_not_found","message":"m"}"#);
        assert!(matches!(&e, ClientError::LeaseGone { reason } if reason == "lease_not_found"));
        assert_eq!(e.status(), Some(404));
    }

    #[test]
    fn everything_else_is_api() {
        match err(
            412,
            r#"{"error":"version_mismatch","message":"nope","expected":1,"current":2}"#,
        ) {
            ClientError::Api {
                status,
                error,
                message,
            } => {
                assert_eq!(
                    (status, error.as_str(), message.as_str()),
                    (412, "version_mismatch", "nope")
                );
            }
            other => panic!("{other:?}"),
        }
        // A 404 that is not about a lease (e.g. a wrong base URL) stays Api.
        assert!(matches!(
            err(404, r#"{"error":"no_such_route","message":"m"}"#),
            ClientError::Api { status: 404, .. }
        ));
        // A stale_token body missing its numbers is not invented into Stale.
        assert!(matches!(
            err(409, r#"{"error":"stale_token","message":"m"}"#),
            ClientError::Api { status: 409, .. }
        ));
        // Not JSON (a proxy's page): the text is kept, bounded.
        let long = "é".repeat(1000);
        match err(502, &long) {
            ClientError::Api {
                status: 502,
                error,
                message,
            } => {
                assert_eq!(error, "unexpected_response");
                assert!(message.len() <= MAX_RAW_MESSAGE && !message.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }
}
