//! The client's one error type, and how a server error body becomes it.

use palisade_api::{ErrorBody, ErrorName, LeaseHeldError, StaleTokenError};

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
            Self::LeaseGone { reason } if reason == ErrorName::LeaseNotFound.as_str() => Some(404),
            Self::LeaseGone { .. } => Some(410),
            Self::Api { status, .. } => Some(*status),
            Self::Transport(e) => e.status().map(|s| s.as_u16()),
            Self::Stream { .. } | Self::BadUrl(_) => None,
        }
    }

    /// The server's stable error name (`stale_token`, `lease_held`, …), if any.
    pub fn error_name(&self) -> Option<&str> {
        match self {
            Self::Stale { .. } => Some(ErrorName::StaleToken.as_str()),
            Self::LeaseHeld { .. } => Some(ErrorName::LeaseHeld.as_str()),
            Self::LeaseGone { reason } => Some(reason),
            Self::Api { error, .. } | Self::Stream { error, .. } => Some(error),
            Self::Transport(_) | Self::BadUrl(_) => None,
        }
    }

    /// [`error_name`](Self::error_name) as the typed name to branch on;
    /// `None` also for a name this SDK does not know (a newer server's), or
    /// one the SDK made up (`unexpected_response`, `idle_timeout`, ...).
    pub fn name(&self) -> Option<ErrorName> {
        self.error_name().and_then(ErrorName::from_name)
    }
}

/// The most of a non-JSON error body kept in [`ClientError::Api`]'s message.
const MAX_RAW_MESSAGE: usize = 512;

/// Turn a non-2xx response (status and body) into a [`ClientError`].
pub(crate) fn from_response(status: u16, body: &[u8]) -> ClientError {
    // The server's error body; `None` for anything else (a proxy's page).
    let head: Option<ErrorBody> = serde_json::from_slice(body).ok();
    let name = head.as_ref().and_then(ErrorBody::name);
    match (status, name) {
        (409, Some(ErrorName::StaleToken)) => {
            // A body missing its numbers is not invented into `Stale`.
            if let Ok(s) = serde_json::from_slice::<StaleTokenError>(body) {
                return ClientError::Stale {
                    token: s.token,
                    fence: s.fence,
                };
            }
        }
        (409, Some(ErrorName::LeaseHeld)) => {
            if let Ok(h) = serde_json::from_slice::<LeaseHeldError>(body) {
                return ClientError::LeaseHeld {
                    holder: h.holder,
                    expires_in_ms: h.expires_in_ms,
                };
            }
        }
        (410, _) => {
            return ClientError::LeaseGone {
                reason: head.map_or_else(|| "lease_gone".to_owned(), |h| h.error),
            };
        }
        (404, Some(ErrorName::LeaseNotFound)) => {
            return ClientError::LeaseGone {
                reason: ErrorName::LeaseNotFound.as_str().to_owned(),
            };
        }
        _ => {}
    }
    let (error, message) = match head {
        Some(h) => (h.error, h.message),
        None => {
            let raw = String::from_utf8_lossy(body);
            let mut end = raw.len().min(MAX_RAW_MESSAGE);
            while !raw.is_char_boundary(end) {
                end -= 1;
            }
            ("unexpected_response".to_owned(), raw[..end].to_owned())
        }
    };
    ClientError::Api {
        status,
        error,
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
