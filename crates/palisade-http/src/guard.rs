//! The guard in front of every route: authentication, authorization, limits,
//! lease ownership, and the audit trail of lease operations and refusals.
//!
//! It runs as one axum middleware (`route_layer`, so it sees the matched
//! route) and leaves the handlers as they were: a refused request never
//! reaches its handler, so a refusal changes nothing but the audit log.
//!
//! With authentication on:
//! - every route but `/`, `/healthz` and `/v1/openapi.json` needs a valid
//!   `Authorization: Bearer <key>` (401 otherwise);
//! - leases: `lease` on the scope; the holder is the principal's name
//!   (whatever the body says); renew and release only by the principal
//!   holding the lease (403 `lease_not_yours`);
//! - appends: `write` on `twin/<id>` or its `partition/<p>`, and the
//!   `Fencing-Token` must have been granted to this principal (403
//!   `token_not_yours`), even if it is the current one;
//! - reads: `read` on `twin/<id>` or `partition/<p>`; `/v1/partitions`,
//!   `/v1/rejections`, `/v1/dead-letters` and `/metrics` need `read` or
//!   `admin` on `admin/<name>`; `/v1/audit` needs `admin` on `admin/audit`;
//!   a route this guard does not know needs `admin`.
//!
//! With it off every request is `anonymous` and allowed; the limits and the
//! audit log apply either way.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::RequestExt;
use palisade_core::{FencingToken, LeaseId, NewEvent, Scope, TwinId};
use palisade_log::{AuditAction, AuditOutcome, AuditRecord};
use serde_json::Value;

use crate::error::ApiError;
use crate::routes::AppState;
use crate::security::ANONYMOUS;
use palisade_auth::{Action, Identity};

/// The rate bucket of requests without a valid key (not a valid principal
/// name: names have no control characters).
const UNAUTHENTICATED: &str = "\u{0}unauthenticated";

/// Why the guard refused a request. Becomes a status code in `error.rs`.
#[derive(Debug)]
pub enum Refusal {
    /// No `Authorization: Bearer` header, or not a key of any principal.
    Unauthenticated {
        reason: &'static str,
    },
    /// No grant of `action` covers `scope`.
    Forbidden {
        principal: String,
        action: Action,
        scope: String,
    },
    /// The lease belongs to another principal.
    LeaseNotYours {
        principal: String,
    },
    /// The fencing token was granted to another principal (or before
    /// authentication was on).
    TokenNotYours {
        token: u64,
    },
    /// Too many requests from this principal; retry after this long.
    RateLimited {
        retry_after: Duration,
    },
    /// The principal holds as many live leases as it may.
    TooManyLeases {
        held: usize,
        max: usize,
    },
    TwinIdTooLong {
        len: usize,
        max: usize,
    },
    PatchTooDeep {
        max: usize,
    },
    PatchTooLarge {
        len: usize,
        max: usize,
    },
    BodyTooLarge {
        max: usize,
    },
    /// The token could not be bound to its owner: it is not handed out.
    AuditStorage(String),
}

/// Apply the settings the store keeps (the audit log's size cap).
pub(crate) fn install(store: &palisade_log::Store, config: &crate::HttpConfig) {
    if let Some(n) = config.security.audit_max_records {
        store.audit().set_max_records(n);
    }
}

/// The route a request matched, with what the guard needs of it.
enum Target {
    Public,
    Acquire,
    LeaseOp(AuditAction),
    Append(TwinId),
    ReadTwin(TwinId),
    /// The partition number as the handler will read it (`03` is 3), so a
    /// grant is matched against the canonical `partition/3`.
    ReadPartition(u32),
    AdminRead(&'static str),
    Audit,
    /// A route added later that this guard does not know: admin only.
    Unknown(String),
    /// The path did not decode: the handler refuses it (400) without effect.
    Undecodable,
}

fn classify(
    matched: &str,
    method: &Method,
    params: Option<&std::collections::HashMap<String, String>>,
) -> Target {
    let param = |k: &str| params.and_then(|p| p.get(k)).cloned();
    let twin = || param("twin_id").and_then(|t| TwinId::new(t).ok());
    match matched {
        "/" | "/healthz" | "/v1/openapi.json" => Target::Public,
        "/v1/leases" => Target::Acquire,
        "/v1/leases/{lease_id}/renew" => Target::LeaseOp(AuditAction::Renew),
        "/v1/leases/{lease_id}" => Target::LeaseOp(AuditAction::Release),
        "/v1/twins/{twin_id}/events" if method == Method::POST => {
            twin().map_or(Target::Undecodable, Target::Append)
        }
        "/v1/twins/{twin_id}" | "/v1/twins/{twin_id}/events" | "/v1/twins/{twin_id}/watch" => {
            twin().map_or(Target::Undecodable, Target::ReadTwin)
        }
        "/v1/partitions/{partition}/events" | "/v1/partitions/{partition}/watch" => {
            param("partition")
                .and_then(|p| p.parse().ok())
                .map_or(Target::Undecodable, Target::ReadPartition)
        }
        "/v1/partitions" => Target::AdminRead("partitions"),
        "/v1/rejections" => Target::AdminRead("rejections"),
        "/v1/dead-letters" => Target::AdminRead("dead-letters"),
        "/metrics" => Target::AdminRead("metrics"),
        "/v1/audit" => Target::Audit,
        other => Target::Unknown(other.to_owned()),
    }
}

/// Who is asking: an identity, or anonymous with authentication off.
struct Caller<'a> {
    id: Option<&'a Identity>,
}

impl Caller<'_> {
    fn name(&self) -> &str {
        self.id.map_or(ANONYMOUS, Identity::name)
    }

    fn allows(&self, action: Action, scope: &str) -> bool {
        self.id.is_none_or(|i| i.allows(action, scope))
    }
}

fn bearer(headers: &HeaderMap) -> Result<&str, Refusal> {
    let raw = headers
        .get(header::AUTHORIZATION)
        .ok_or(Refusal::Unauthenticated {
            reason: "an Authorization: Bearer <api key> header is required",
        })?;
    let text = raw.to_str().map_err(|_| Refusal::Unauthenticated {
        reason: "the Authorization header is not text",
    })?;
    let (scheme, key) = text
        .trim()
        .split_once(' ')
        .ok_or(Refusal::Unauthenticated {
            reason: "the Authorization header must be `Bearer <api key>`",
        })?;
    if !scheme.eq_ignore_ascii_case("bearer") || key.trim().is_empty() {
        return Err(Refusal::Unauthenticated {
            reason: "the Authorization header must be `Bearer <api key>`",
        });
    }
    Ok(key.trim())
}

/// One audit record with the fields a guard step knows.
struct Audit<'a> {
    s: &'a AppState,
    principal: String,
    action: AuditAction,
    scope: String,
    token: u64,
    lease_id: u128,
}

impl Audit<'_> {
    fn record(&self, outcome: AuditOutcome, detail: &str) {
        self.s.store.audit().record(AuditRecord {
            seq: 0,
            at_ms: 0,
            action: self.action,
            outcome,
            principal: self.principal.clone(),
            scope: self.scope.clone(),
            token: self.token,
            lease_id: self.lease_id,
            detail: detail.to_owned(),
        });
    }

    /// Record a refusal and turn it into its response.
    fn refuse(&self, outcome: AuditOutcome, r: Refusal) -> Response {
        let e = ApiError::from(r);
        self.record(outcome, e.name());
        e.into_response()
    }
}

/// The audit outcome of an append the handler refused (`None`: not worth a
/// record, e.g. malformed input).
fn outcome_of(status: StatusCode) -> Option<AuditOutcome> {
    match status.as_u16() {
        409 => Some(AuditOutcome::Stale),
        403 => Some(AuditOutcome::Forbidden),
        413 | 429 => Some(AuditOutcome::Limited),
        _ => None,
    }
}

/// The audit outcome of a lease operation the handler refused (409 there
/// is `lease_held`, not a stale token).
fn lease_outcome_of(status: StatusCode) -> AuditOutcome {
    match status.as_u16() {
        403 => AuditOutcome::Forbidden,
        413 | 429 => AuditOutcome::Limited,
        _ => AuditOutcome::Refused,
    }
}

async fn buffered(resp: Response) -> (axum::http::response::Parts, Bytes) {
    let (parts, body) = resp.into_parts();
    // Our own small JSON bodies; a failure reads as empty.
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    (parts, bytes)
}

fn error_name(bytes: &[u8]) -> String {
    serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_default()
}

/// The guard middleware.
pub(crate) async fn guard(State(s): State<AppState>, mut req: Request, next: Next) -> Response {
    let matched = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_default();
    let params = req
        .extract_parts::<Path<std::collections::HashMap<String, String>>>()
        .await
        .ok()
        .map(|Path(p)| p);
    let target = classify(&matched, req.method(), params.as_ref());
    if matches!(target, Target::Public) {
        return next.run(req).await;
    }
    let security = s.config.security.clone();
    let action = match &target {
        Target::Acquire => AuditAction::Grant,
        Target::LeaseOp(a) => *a,
        Target::Append(_) => AuditAction::Write,
        Target::ReadTwin(_) | Target::ReadPartition(_) | Target::Undecodable => AuditAction::Read,
        _ => AuditAction::Admin,
    };
    let mut audit = Audit {
        s: &s,
        principal: String::new(),
        action,
        scope: String::new(),
        token: 0,
        lease_id: 0,
    };
    // Who: with authentication on, a valid key or 401.
    let caller = match &security.auth {
        None => Caller { id: None },
        Some(auth) => {
            let refusal = match bearer(req.headers()) {
                Ok(key) => match auth.authenticate(key) {
                    Some(id) => Ok(Caller { id: Some(id) }),
                    None => Err(Refusal::Unauthenticated {
                        reason: "the API key is not known to this store",
                    }),
                },
                Err(r) => Err(r),
            };
            match refusal {
                Ok(c) => c,
                Err(r) => {
                    // Requests without a valid key share one budget of the
                    // per-principal rate: past it they are refused without
                    // an audit record, so a flood cannot churn the log.
                    if let Err(retry_after) =
                        security
                            .state
                            .take(UNAUTHENTICATED, &security.limits, Instant::now())
                    {
                        return ApiError::from(Refusal::RateLimited { retry_after })
                            .into_response();
                    }
                    return audit.refuse(AuditOutcome::Unauthenticated, r);
                }
            }
        }
    };
    audit.principal = caller.name().to_owned();
    // How often: the principal's request rate.
    if let Err(retry_after) = security
        .state
        .take(caller.name(), &security.limits, Instant::now())
    {
        return audit.refuse(AuditOutcome::Limited, Refusal::RateLimited { retry_after });
    }
    let limits = &security.limits;
    let twin_limit = |t: &TwinId| -> Result<(), Refusal> {
        let len = t.as_str().len();
        if len > limits.max_twin_id_bytes {
            return Err(Refusal::TwinIdTooLong {
                len,
                max: limits.max_twin_id_bytes,
            });
        }
        Ok(())
    };
    let forbidden = |action: Action, scope: &str| Refusal::Forbidden {
        principal: caller.name().to_owned(),
        action,
        scope: scope.to_owned(),
    };
    match target {
        Target::Public => next.run(req).await,
        // A path that does not decode names nothing: its handler refuses
        // it (400) before doing anything.
        Target::Undecodable => next.run(req).await,
        Target::Acquire => acquire(&s, &caller, audit, req, next).await,
        Target::LeaseOp(_) => lease_op(&s, &caller, audit, params, req, next).await,
        Target::Append(twin) => {
            let p = s.store.partition_of(&twin);
            audit.scope = format!("twin/{}", twin.as_str());
            if let Err(r) = twin_limit(&twin) {
                return audit.refuse(AuditOutcome::Limited, r);
            }
            if !caller.allows(Action::Write, &audit.scope)
                && !caller.allows(Action::Write, &format!("partition/{}", p.0))
            {
                let r = forbidden(Action::Write, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            let token = fencing_token(req.headers());
            if let Some(t) = token {
                audit.token = t.0;
            }
            if let (Some(id), Some(t)) = (caller.id, token) {
                match s.store.audit().token_owner(t) {
                    Ok(Some(owner)) if owner == id.name() => {}
                    Ok(_) => {
                        return audit.refuse(
                            AuditOutcome::Forbidden,
                            Refusal::TokenNotYours { token: t.0 },
                        )
                    }
                    Err(e) => {
                        return audit
                            .refuse(AuditOutcome::Refused, Refusal::AuditStorage(e.to_string()))
                    }
                }
            }
            let resp = next.run(req).await;
            match outcome_of(resp.status()) {
                None => resp,
                Some(outcome) => {
                    let (parts, bytes) = buffered(resp).await;
                    audit.record(outcome, &error_name(&bytes));
                    Response::from_parts(parts, Body::from(bytes))
                }
            }
        }
        Target::ReadTwin(twin) => {
            let p = s.store.partition_of(&twin);
            audit.scope = format!("twin/{}", twin.as_str());
            if let Err(r) = twin_limit(&twin) {
                return audit.refuse(AuditOutcome::Limited, r);
            }
            if !caller.allows(Action::Read, &audit.scope)
                && !caller.allows(Action::Read, &format!("partition/{}", p.0))
            {
                let r = forbidden(Action::Read, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            next.run(req).await
        }
        Target::ReadPartition(p) => {
            audit.scope = format!("partition/{p}");
            if !caller.allows(Action::Read, &audit.scope) {
                let r = forbidden(Action::Read, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            next.run(req).await
        }
        Target::AdminRead(name) => {
            audit.scope = format!("admin/{name}");
            let public = name == "metrics" && security.public_metrics;
            if !public
                && !caller.allows(Action::Read, &audit.scope)
                && !caller.allows(Action::Admin, &audit.scope)
            {
                let r = forbidden(Action::Read, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            next.run(req).await
        }
        Target::Audit => {
            audit.scope = "admin/audit".into();
            if !caller.allows(Action::Admin, &audit.scope) {
                let r = forbidden(Action::Admin, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            next.run(req).await
        }
        Target::Unknown(path) => {
            audit.scope = format!("admin{path}");
            if !caller.allows(Action::Admin, &audit.scope) {
                let r = forbidden(Action::Admin, &audit.scope);
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            next.run(req).await
        }
    }
}

/// The token header, if it parses (else the handler refuses it).
fn fencing_token(headers: &HeaderMap) -> Option<FencingToken> {
    let t = headers.get("fencing-token")?.to_str().ok()?.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok().map(FencingToken)
}

/// `POST /v1/leases`: authorize the scope, enforce the live-lease limit,
/// take the holder from the principal, bind the granted token to it.
async fn acquire(
    s: &AppState,
    caller: &Caller<'_>,
    mut audit: Audit<'_>,
    req: Request,
    next: Next,
) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let max_body = s.config.max_body_bytes;
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, max_body).await else {
        return audit.refuse(
            AuditOutcome::Limited,
            Refusal::BodyTooLarge { max: max_body },
        );
    };
    let mut json: Option<serde_json::Map<String, Value>> = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| match v {
            Value::Object(m) => Some(m),
            _ => None,
        });
    let scope = json
        .as_ref()
        .and_then(|m| m.get("scope"))
        .and_then(Value::as_str)
        .and_then(|t| t.parse::<Scope>().ok());
    let Some(scope) = scope else {
        // Not a lease request the handler will accept: it refuses it (400)
        // before anything happens.
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    audit.scope = scope.to_string();
    if let Scope::Twin(t) = &scope {
        let len = t.as_str().len();
        let max = s.config.security.limits.max_twin_id_bytes;
        if len > max {
            return audit.refuse(AuditOutcome::Limited, Refusal::TwinIdTooLong { len, max });
        }
    }
    if !caller.allows(Action::Lease, &audit.scope) {
        let r = Refusal::Forbidden {
            principal: caller.name().to_owned(),
            action: Action::Lease,
            scope: audit.scope.clone(),
        };
        return audit.refuse(AuditOutcome::Forbidden, r);
    }
    // The holder: the principal, never the body, with authentication on.
    let holder = match (caller.id, json.as_mut()) {
        (Some(id), Some(m)) => {
            m.insert("holder".into(), Value::String(id.name().to_owned()));
            id.name().to_owned()
        }
        _ => json
            .as_ref()
            .and_then(|m| m.get("holder"))
            .and_then(Value::as_str)
            .unwrap_or(ANONYMOUS)
            .to_owned(),
    };
    audit.principal = if caller.id.is_some() {
        holder.clone()
    } else {
        format!("{ANONYMOUS}:{holder}")
    };
    let bytes = match (caller.id, &json) {
        (Some(_), Some(m)) => Bytes::from(serde_json::to_vec(m).unwrap_or_default()),
        _ => bytes,
    };
    // The live-lease limit, checked and used under the principal's lock so
    // two concurrent acquires cannot both pass it.
    let max = s.config.security.limits.max_leases_per_principal;
    let lock = (max > 0).then(|| s.config.security.state.lease_lock(&holder));
    let _held = match &lock {
        Some(l) => Some(l.lock().await),
        None => None,
    };
    if max > 0 {
        // Acquiring a scope the principal already holds replaces that lease
        // (a new lease and token, the old one superseded): the count of its
        // live leases does not grow, so the limit does not refuse it. It is
        // how a holder that lost its lease id, or wants a newer token, gets
        // one back.
        let replaces_own = s
            .store
            .lease_holder(&scope)
            .is_some_and(|l| l.holder == holder);
        let held = s.store.live_leases_of(&holder);
        if held >= max && !replaces_own {
            return audit.refuse(AuditOutcome::Limited, Refusal::TooManyLeases { held, max });
        }
    }
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let status = resp.status();
    let (parts, bytes) = buffered(resp).await;
    if status == StatusCode::CREATED {
        let v: Value = serde_json::from_slice(&bytes).unwrap_or_default();
        audit.token = v["token"].as_u64().unwrap_or(0);
        audit.lease_id = v["lease_id"]
            .as_str()
            .and_then(|t| t.parse::<LeaseId>().ok())
            .map_or(0, |l| l.0);
        if caller.id.is_some() {
            // Bound before the token leaves the store: a token (or lease)
            // nobody is bound to is refused for every principal.
            let audit_log = s.store.audit();
            let bound = match audit_log
                .bind_token(FencingToken(audit.token), &holder)
                .await
            {
                Ok(()) => audit_log.bind_lease(audit.lease_id, &holder).await,
                Err(e) => Err(e),
            };
            if let Err(e) = bound {
                return audit.refuse(AuditOutcome::Refused, Refusal::AuditStorage(e.to_string()));
            }
        }
        audit.record(AuditOutcome::Ok, "");
        if let Err(e) = s.store.audit().flush().await {
            tracing::warn!(error = %e, "audit flush failed");
        }
    } else {
        audit.record(lease_outcome_of(status), &error_name(&bytes));
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Renew or release: only the principal holding the lease.
async fn lease_op(
    s: &AppState,
    caller: &Caller<'_>,
    mut audit: Audit<'_>,
    params: Option<std::collections::HashMap<String, String>>,
    req: Request,
    next: Next,
) -> Response {
    let doing = if audit.action == AuditAction::Renew {
        Method::POST
    } else {
        Method::DELETE
    };
    if req.method() != doing {
        return next.run(req).await;
    }
    let id = params
        .as_ref()
        .and_then(|p| p.get("lease_id"))
        .and_then(|t| t.parse::<LeaseId>().ok());
    let Some(id) = id else {
        return next.run(req).await;
    };
    audit.lease_id = id.0;
    if let Some(lease) = s.store.lease(id) {
        audit.scope = lease.scope.to_string();
        audit.token = lease.token.0;
        if !caller.allows(Action::Lease, &audit.scope) {
            let r = Refusal::Forbidden {
                principal: caller.name().to_owned(),
                action: Action::Lease,
                scope: audit.scope.clone(),
            };
            return audit.refuse(AuditOutcome::Forbidden, r);
        }
    }
    if caller.id.is_some() {
        // The owner recorded at grant time, not the lease table: it holds
        // for any lease backend, and a lease granted before authentication
        // was on (or an unknown id) belongs to nobody.
        match s.store.audit().lease_owner(id.0) {
            Ok(Some(owner)) if owner == caller.name() => {}
            Ok(_) => {
                let r = Refusal::LeaseNotYours {
                    principal: caller.name().to_owned(),
                };
                return audit.refuse(AuditOutcome::Forbidden, r);
            }
            Err(e) => {
                return audit.refuse(AuditOutcome::Refused, Refusal::AuditStorage(e.to_string()))
            }
        }
    }
    let resp = next.run(req).await;
    let status = resp.status();
    if status.is_success() {
        audit.record(AuditOutcome::Ok, "");
        if let Err(e) = s.store.audit().flush().await {
            tracing::warn!(error = %e, "audit flush failed");
        }
        return resp;
    }
    let (parts, bytes) = buffered(resp).await;
    audit.record(lease_outcome_of(status), &error_name(&bytes));
    Response::from_parts(parts, Body::from(bytes))
}

/// The patch limits of an append (called by the handler once the body is
/// parsed; the log's own checks still apply after these).
pub(crate) fn check_patches(
    limits: &crate::security::Limits,
    events: &[NewEvent],
) -> Result<(), ApiError> {
    for e in events {
        if depth(&e.patch) > limits.max_patch_depth {
            return Err(Refusal::PatchTooDeep {
                max: limits.max_patch_depth,
            }
            .into());
        }
        let mut counter = Counter(0);
        // Writing to a counter cannot fail.
        let _ = serde_json::to_writer(&mut counter, &e.patch);
        if counter.0 > limits.max_patch_bytes {
            return Err(Refusal::PatchTooLarge {
                len: counter.0,
                max: limits.max_patch_bytes,
            }
            .into());
        }
    }
    Ok(())
}

/// Container levels of a patch, counted as the log counts them (the patch
/// object is level 1, each nested object or array one more). Parsed JSON is
/// at most serde_json's recursion limit (128) deep, so recursion is bounded.
fn depth(m: &serde_json::Map<String, Value>) -> usize {
    1 + m.values().map(value_depth).max().unwrap_or(0)
}

fn value_depth(v: &Value) -> usize {
    match v {
        Value::Object(o) => depth(o),
        Value::Array(a) => 1 + a.iter().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

struct Counter(usize);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn patch_depth_counts_object_levels() {
        let m = |v: Value| v.as_object().cloned().unwrap();
        assert_eq!(depth(&m(serde_json::json!({}))), 1);
        assert_eq!(depth(&m(serde_json::json!({"a": 1, "b": [{"c": {}}]}))), 4);
        assert_eq!(
            depth(&m(serde_json::json!({"a": {"b": {"c": 1}}, "d": 2}))),
            3
        );
    }
}
