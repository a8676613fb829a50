//! Admission: a request goes on only if the store admits a fenced append
//! with its token on its twin, now. The append IS the admission (decision
//! 0027): an event of the reserved type [`ADMITTED_TYPE`] whose id is the
//! request's idempotency key, through the store's normal commit, so the
//! check is the store's own (same fence, same `>=`, token issued and
//! covering the twin, owned by the caller when auth is on), the record is
//! durable before the request is forwarded, the twin's fence rises to the
//! token for every later write, and the twin's history keeps an audit
//! trail. A retried request (same idempotency key) is a duplicate event:
//! acknowledged again, not stored twice, and still fenced (the store checks
//! the fence before its dedupe).
//!
//! Both modes ask the store the same question the same way: a `POST
//! /v1/twins/{twin}/events` with the caller's token and key. Embedded, it
//! goes to the store's own routes in this process (no socket), so
//! authentication, the policy, token ownership, limits and the audit log
//! are the store's own there too, from `--security`; remote, to a running
//! `palisade serve` over HTTP(S).

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use palisade_core::{FencingToken, TwinId};
use serde_json::{json, Map, Value};
use tower_service::Service;

/// The event type of an admission record in the twin's history.
pub const ADMITTED_TYPE: &str = "palisade.proxy.admitted";
/// The event type recording that an admitted request's upstream failed.
pub const FAILED_TYPE: &str = "palisade.proxy.upstream_failed";
/// The key under which an admission record's patch describes the request.
pub const PATCH_KEY: &str = "palisade_proxy";
/// Longest request path kept in an admission record.
const MAX_RECORDED_PATH: usize = 512;
/// Longest caller's request id kept in an admission record (the key is
/// derived from all of it).
const MAX_RECORDED_REQUEST_ID: usize = 256;

/// `s` cut to at most `max` bytes, on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut at = s.len().min(max);
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    &s[..at]
}

/// Where admissions are decided.
#[derive(Debug, Clone)]
pub enum Admitter {
    /// The store opened by this process (`--data`), asked through its own
    /// HTTP routes (`palisade_http::router`) in process.
    Embedded(axum::Router),
    /// A running `palisade serve` (`--store-url`), through its HTTP API.
    Remote {
        http: reqwest::Client,
        /// `http(s)://host:port`, no trailing slash.
        base: String,
    },
}

/// What an admission record says about the request it admitted.
#[derive(Debug, Clone)]
pub struct Admission<'a> {
    pub twin: &'a TwinId,
    pub token: FencingToken,
    pub key: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub body_sha256: &'a str,
    pub request_id: &'a str,
    /// `Authorization` value to present to the store (the caller's
    /// `Palisade-Authorization`), when auth is on.
    pub authorization: Option<&'a HeaderValue>,
}

/// Why a request was not admitted: the response to give (the store's own
/// error body), the error name for metrics and logs, and the fence if known.
#[derive(Debug)]
pub struct Refused {
    pub reason: String,
    pub response: Box<Response>,
}

/// An admitted request: `duplicate` when its idempotency key was admitted
/// before (a retry).
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    pub duplicate: bool,
}

impl Admission<'_> {
    fn patch(&self) -> Map<String, Value> {
        let path = cut(self.path, MAX_RECORDED_PATH);
        let request_id = cut(self.request_id, MAX_RECORDED_REQUEST_ID);
        let mut m = Map::new();
        m.insert(
            PATCH_KEY.into(),
            json!({
                "method": self.method,
                "path": path,
                "body_sha256": self.body_sha256,
                "request_id": request_id,
                "idempotency_key": self.key,
                // Cleared: they describe an earlier request's failure.
                "upstream_failure": null,
                "upstream_status": null,
            }),
        );
        m
    }
}

impl Admitter {
    /// Admit the request: the fenced append of its admission record.
    pub async fn admit(&self, a: &Admission<'_>) -> Result<Admitted, Refused> {
        self.append(a, a.key.to_owned(), ADMITTED_TYPE, a.patch())
            .await
    }

    /// Record, in the twin's history, that an admitted request's upstream
    /// failed (`kind`: timeout, connect, status): its outcome is unknown
    /// or negative, which an operator reconciling the upstream needs to
    /// know. Under the same token and fence as the admission; event id =
    /// the key + `-failed` (a retry that fails again is not recorded twice).
    pub async fn record_failure(
        &self,
        a: &Admission<'_>,
        kind: &str,
        upstream_status: Option<u16>,
    ) -> Result<(), Refused> {
        let mut failure = Map::new();
        failure.insert("idempotency_key".into(), json!(a.key));
        failure.insert("upstream_failure".into(), json!(kind));
        failure.insert("upstream_status".into(), json!(upstream_status));
        let mut patch = Map::new();
        patch.insert(PATCH_KEY.into(), Value::Object(failure));
        self.append(a, format!("{}-failed", a.key), FAILED_TYPE, patch)
            .await
            .map(|_| ())
    }

    async fn append(
        &self,
        a: &Admission<'_>,
        event_id: String,
        event_type: &str,
        patch: Map<String, Value>,
    ) -> Result<Admitted, Refused> {
        let body = json!({
            "event_id": event_id,
            "type": event_type,
            "patch": Value::Object(patch),
        });
        let (status, bytes) = match self {
            Self::Embedded(router) => {
                let url = events_url("http://embedded", a.twin)?;
                let mut req = axum::http::Request::post(url.path())
                    .header(CONTENT_TYPE, "application/json")
                    .header("fencing-token", a.token.0.to_string());
                if let Some(auth) = a.authorization {
                    req = req.header(AUTHORIZATION, auth.clone());
                }
                let req = req
                    .body(axum::body::Body::from(body.to_string()))
                    .map_err(|e| {
                        proxy_error(StatusCode::BAD_REQUEST, "bad_request", &e.to_string())
                    })?;
                let mut svc = router.clone();
                // A router is always ready; its error type is Infallible.
                let resp = match std::future::poll_fn(|cx| {
                    Service::<axum::http::Request<axum::body::Body>>::poll_ready(&mut svc, cx)
                })
                .await
                {
                    Ok(()) => match svc.call(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    },
                    Err(never) => match never {},
                };
                let status = resp.status();
                let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
                    .await
                    .map_err(|e| {
                        proxy_error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "store_error",
                            &format!("the store's admission answer could not be read: {e}"),
                        )
                    })?;
                (status, bytes)
            }
            Self::Remote { http, base } => {
                let mut req = http
                    .post(events_url(base, a.twin)?)
                    .header("fencing-token", a.token.0.to_string())
                    .json(&body);
                if let Some(auth) = a.authorization {
                    req = req.header(AUTHORIZATION, auth.clone());
                }
                let resp = req.send().await.map_err(|e| {
                    proxy_error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "store_unreachable",
                        &format!("the store at {base} did not answer the admission: {e}"),
                    )
                })?;
                let status = resp.status();
                let bytes = resp.bytes().await.map_err(|e| {
                    proxy_error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "store_unreachable",
                        &format!("the store's admission answer was cut off: {e}"),
                    )
                })?;
                (status, bytes)
            }
        };
        let parsed: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status.is_success() {
            let duplicate = parsed
                .get("duplicates")
                .and_then(Value::as_u64)
                .is_some_and(|d| d > 0);
            return Ok(Admitted { duplicate });
        }
        // The store's own status and error body, as it gave them.
        let reason = parsed
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("store_error")
            .to_owned();
        let mut response = (status, bytes).into_response();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Err(Refused {
            reason,
            response: Box::new(response),
        })
    }
}

/// `{base}/v1/twins/{twin}/events`, the twin's id percent-encoded.
fn events_url(base: &str, twin: &TwinId) -> Result<reqwest::Url, Refused> {
    let bad = |m: String| proxy_error(StatusCode::INTERNAL_SERVER_ERROR, "store_url", &m);
    let mut url =
        reqwest::Url::parse(base).map_err(|e| bad(format!("bad store URL {base:?}: {e}")))?;
    url.path_segments_mut()
        .map_err(|()| bad("the store URL cannot take a path".into()))?
        .pop_if_empty()
        .extend(["v1", "twins", twin.as_str(), "events"]);
    Ok(url)
}

/// An error of the proxy's own, in the store's error shape
/// (`{"error": name, "message": text}`).
pub fn proxy_error(status: StatusCode, name: &str, message: &str) -> Refused {
    Refused {
        reason: name.to_owned(),
        response: Box::new(error_response(status, name, message, Value::Null)),
    }
}

/// `{"error", "message", ...details}` with `status`.
pub fn error_response(status: StatusCode, name: &str, message: &str, details: Value) -> Response {
    let mut body = json!({ "error": name, "message": message });
    if let (Value::Object(b), Value::Object(d)) = (&mut body, details) {
        b.extend(d);
    }
    (status, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_strings_are_cut_on_char_boundaries() {
        assert_eq!(cut("abc", 10), "abc");
        assert_eq!(cut("abcdef", 3), "abc");
        // 'é' is two bytes: a cut inside it falls back before it.
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("", 0), "");
    }
}
