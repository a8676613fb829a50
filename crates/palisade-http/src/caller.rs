//! Who is calling: the [`Caller`] extractor, and the audit trail of what
//! it was allowed and refused.
//!
//! Every route but `/`, `/healthz` and `/v1/openapi.json` takes a `Caller`
//! and states, in its handler, what it needs: [`Caller::admit`] with the
//! audit action (authentication and the rate limit), then
//! [`Admitted::authorize`] with the action and the typed resource, asked of
//! the one policy, `palisade_auth::authorize` (the Kafka path asks the same
//! one). A refusal is audited with the fields the handler knows and happens
//! before the handler does anything.
//!
//! With authentication on:
//! - every such route needs a valid `Authorization: Bearer <key>` (401);
//! - leases: `lease` on the scope; the holder is the principal's name
//!   (whatever the body says); renew and release only by the principal
//!   the lease was granted to (403 `lease_not_yours`);
//! - appends: `write` on the twin or its partition, and the
//!   `Fencing-Token` must have been granted to this principal (403
//!   `token_not_yours`), even if it is the current one;
//! - reads: `read` on the twin or partition; admin data (`/v1/partitions`,
//!   `/v1/rejections`, `/v1/dead-letters`, `/metrics`) `read` or `admin` on
//!   `admin/<name>`; `/v1/audit` `admin` on `admin/audit`.
//!
//! With it off every request is `anonymous` and allowed; the limits and the
//! audit log apply either way. Handlers audit their own outcomes from typed
//! errors ([`ApiError::audit_outcome`]), never by reading a response back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use palisade_auth::{authorize, owns, Action, AuthError, Identity, Principal, Resource};
use palisade_core::{FencingToken, LeaseId, NewEvent, Purpose, Scope, TwinId};
use palisade_log::{AuditAction, AuditOutcome, AuditRecord, Store};
use serde_json::Value;

use crate::error::ApiError;
use crate::routes::AppState;
use crate::security::{Security, ANONYMOUS};

/// The rate bucket of requests without a valid key (not a valid principal
/// name: names have no control characters).
const UNAUTHENTICATED: &str = "\u{0}unauthenticated";

/// Why a request was refused before its handler did anything. Becomes a status code in `error.rs`.
#[derive(Debug)]
pub enum Refusal {
    /// No `Authorization: Bearer` header, or not a key of any principal.
    Unauthenticated {
        reason: &'static str,
    },
    /// The policy refused it (no grant of the action covers the scope).
    Policy(AuthError),
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

/// The caller of a route, authenticated and counted against its rate by
/// the extractor. A refusal waits for the handler's [`Caller::admit`],
/// which knows the audit action to record it under.
#[derive(Debug)]
pub(crate) struct Caller {
    store: Arc<Store>,
    security: Security,
    /// `None`: authentication is off (anonymous).
    identity: Option<Identity>,
    /// Why the request may not go on (no valid key, rate limited), with
    /// the outcome it is audited as.
    refused: Option<(AuditOutcome, Refusal)>,
}

impl FromRequestParts<AppState> for Caller {
    /// Requests without a valid key past their shared budget: refused
    /// without an audit record, so a flood cannot churn the log.
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, Response> {
        let security = s.config.security.clone();
        let mut caller = Self {
            store: s.store.clone(),
            identity: None,
            refused: None,
            security,
        };
        if let Some(auth) = &caller.security.auth {
            match bearer(&parts.headers).and_then(|key| {
                auth.authenticate(key)
                    .cloned()
                    .ok_or(Refusal::Unauthenticated {
                        reason: "the API key is not known to this store",
                    })
            }) {
                Ok(id) => caller.identity = Some(id),
                Err(r) => {
                    let sec = &caller.security;
                    if let Err(retry_after) =
                        sec.state.take(UNAUTHENTICATED, &sec.limits, Instant::now())
                    {
                        return Err(
                            ApiError::from(Refusal::RateLimited { retry_after }).into_response()
                        );
                    }
                    caller.refused = Some((AuditOutcome::Unauthenticated, r));
                    return Ok(caller);
                }
            }
        }
        let sec = &caller.security;
        if let Err(retry_after) = sec.state.take(caller.name(), &sec.limits, Instant::now()) {
            caller.refused = Some((AuditOutcome::Limited, Refusal::RateLimited { retry_after }));
        }
        Ok(caller)
    }
}

impl Caller {
    fn name(&self) -> &str {
        self.identity.as_ref().map_or(ANONYMOUS, Identity::name)
    }

    /// Let the request in, or refuse it (401, 429) with an audit record of
    /// `action`. Every handler of a route with a `Caller` calls it first.
    pub(crate) fn admit(self, action: AuditAction) -> Result<Admitted, ApiError> {
        let principal = match (&self.identity, &self.refused) {
            // No valid key: nobody to name.
            (None, Some((AuditOutcome::Unauthenticated, _))) => String::new(),
            _ => self.name().to_owned(),
        };
        let admitted = Admitted {
            store: self.store,
            security: self.security,
            identity: self.identity,
            record: AuditRecord {
                seq: 0,
                at_ms: 0,
                action,
                outcome: AuditOutcome::Ok,
                principal,
                scope: String::new(),
                token: 0,
                lease_id: 0,
                detail: String::new(),
            },
        };
        match self.refused {
            Some((outcome, r)) => Err(admitted.refuse(outcome, r)),
            None => Ok(admitted),
        }
    }
}

/// An admitted request: who, and the audit record of what it does so far.
#[derive(Debug)]
pub(crate) struct Admitted {
    store: Arc<Store>,
    security: Security,
    identity: Option<Identity>,
    /// Filled in as the handler learns the scope, token and lease.
    record: AuditRecord,
}

impl Admitted {
    fn principal(&self) -> Principal<'_> {
        self.identity
            .as_ref()
            .map_or(Principal::Anonymous, Principal::Known)
    }

    fn name(&self) -> &str {
        self.principal().name()
    }

    /// Authentication is on: ownership of tokens and leases is checked.
    pub(crate) fn authenticated(&self) -> bool {
        self.identity.is_some()
    }

    /// The authenticated principal's name (`None` with authentication off).
    pub(crate) fn principal_name(&self) -> Option<&str> {
        self.identity.as_ref().map(Identity::name)
    }

    /// `twin` as the policy sees it: with the partition it lives in.
    pub(crate) fn twin(&self, twin: &TwinId) -> Resource {
        Resource::Twin {
            twin: twin.clone(),
            partition: self.store.partition_of(twin),
        }
    }

    /// The security settings in force (limits, public metrics).
    pub(crate) fn security(&self) -> &Security {
        &self.security
    }

    /// May this caller do `action` on `resource`? A twin id past the
    /// configured length limit is refused first (`limited`); a refusal is
    /// audited under the resource's scope.
    pub(crate) fn authorize(
        &mut self,
        action: Action,
        resource: &Resource,
    ) -> Result<(), ApiError> {
        self.record.scope = resource.scope();
        let twin = match resource {
            Resource::Twin { twin, .. } | Resource::Lease(Scope::Twin(twin)) => Some(twin),
            _ => None,
        };
        if let Some(t) = twin {
            let (len, max) = (t.as_str().len(), self.security.limits.max_twin_id_bytes);
            if len > max {
                return Err(self.refuse(AuditOutcome::Limited, Refusal::TwinIdTooLong { len, max }));
            }
        }
        self.policy(action, resource)
    }

    /// The policy's answer alone, audited under the resource's scope.
    fn policy(&mut self, action: Action, resource: &Resource) -> Result<(), ApiError> {
        self.record.scope = resource.scope();
        authorize(self.principal(), action, resource)
            .map_err(|e| self.refuse(AuditOutcome::Forbidden, Refusal::Policy(e)))
    }

    /// The token of an append, recorded; with authentication on, it must
    /// have been granted to this principal.
    pub(crate) async fn owns_token(&mut self, token: FencingToken) -> Result<(), ApiError> {
        self.record.token = token.0;
        if !self.authenticated() {
            return Ok(());
        }
        match self.store.token_owner(token).await {
            Ok(owner) if owns(self.principal(), owner.as_deref()) => Ok(()),
            Ok(_) => Err(self.refuse(
                AuditOutcome::Forbidden,
                Refusal::TokenNotYours { token: token.0 },
            )),
            Err(e) => Err(self.refuse(AuditOutcome::Refused, Refusal::AuditStorage(e.to_string()))),
        }
    }

    /// Renew or release `id`: `lease` on its scope (if the lease is known
    /// here) and, with authentication on, granted to this principal. The
    /// owner recorded at grant time decides, not the lease table: it holds
    /// for any lease backend, and a lease granted before authentication
    /// was on (or an unknown id) belongs to nobody.
    pub(crate) async fn owns_lease(&mut self, id: LeaseId) -> Result<(), ApiError> {
        self.record.lease_id = id.0;
        if let Some(lease) = self.store.lease(id) {
            self.record.token = lease.token.0;
            // Not `authorize`: the twin id limit is for new names, and this
            // lease exists.
            self.policy(Action::Lease, &Resource::Lease(lease.scope))?;
        }
        if !self.authenticated() {
            return Ok(());
        }
        match self.store.lease_owner(id).await {
            Ok(owner) if owns(self.principal(), owner.as_deref()) => Ok(()),
            Ok(_) => {
                let principal = self.name().to_owned();
                Err(self.refuse(
                    AuditOutcome::Forbidden,
                    Refusal::LeaseNotYours { principal },
                ))
            }
            Err(e) => Err(self.refuse(AuditOutcome::Refused, Refusal::AuditStorage(e.to_string()))),
        }
    }

    /// The holder of a lease this caller takes: its principal's name with
    /// authentication on (whatever the body says), else the body's. The
    /// audit names an unauthenticated holder `anonymous:<holder>`.
    pub(crate) fn holder(&mut self, claimed: Option<&str>) -> String {
        let holder = match &self.identity {
            Some(id) => id.name().to_owned(),
            None => claimed.unwrap_or(ANONYMOUS).to_owned(),
        };
        if !self.authenticated() {
            self.record.principal = format!("{ANONYMOUS}:{holder}");
        }
        holder
    }

    /// The live-lease limit for `holder` taking `scope`, checked and then
    /// held (the lock guard returned) until the grant is done, so two
    /// concurrent acquires cannot both pass it.
    pub(crate) async fn lease_limit(
        &mut self,
        holder: &str,
        scope: &Scope,
    ) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, ApiError> {
        let max = self.security.limits.max_leases_per_principal;
        if max == 0 {
            return Ok(None);
        }
        let held_lock = self.security.state.lease_lock(holder).lock_owned().await;
        // Acquiring a scope the principal already holds replaces that lease
        // (a new lease and token, the old one superseded): the count of its
        // live leases does not grow, so the limit does not refuse it. It is
        // how a holder that lost its lease id, or wants a newer token, gets
        // one back.
        let replaces_own = self
            .store
            .lease_holder(scope)
            .is_some_and(|l| l.holder == holder);
        let held = self.store.live_leases_of(holder);
        if held >= max && !replaces_own {
            return Err(self.refuse(AuditOutcome::Limited, Refusal::TooManyLeases { held, max }));
        }
        Ok(Some(held_lock))
    }

    /// Who a lease taken now is bound to inside the store's grant
    /// (`Store::acquire_for`): the principal, with authentication on.
    pub(crate) fn owner(&self) -> Option<&str> {
        self.identity.as_ref().map(Identity::name)
    }

    /// A granted lease, audited with its token and id.
    /// A lease granted: audited with its token, id and purpose (the
    /// detail of a successful grant; decision 0028), and flushed.
    pub(crate) async fn granted(&mut self, token: FencingToken, id: LeaseId, purpose: Purpose) {
        self.record.token = token.0;
        self.record.lease_id = id.0;
        self.finish(purpose.as_str()).await;
    }

    /// A lease operation done: audited and flushed (grants, renewals and
    /// releases are the records an investigation needs most).
    pub(crate) async fn done(&mut self) {
        self.finish("").await;
    }

    async fn finish(&mut self, detail: &str) {
        self.record_as(AuditOutcome::Ok, detail);
        if let Err(e) = self.store.audit().flush().await {
            tracing::warn!(error = %e, "audit flush failed");
        }
    }

    /// A handler's error, audited if its type says it is worth a record
    /// (`otherwise`: the outcome of errors that do not say, `None` to skip
    /// them).
    pub(crate) fn failed(&self, e: ApiError, otherwise: Option<AuditOutcome>) -> ApiError {
        if let Some(outcome) = e.audit_outcome().or(otherwise) {
            self.record_as(outcome, e.name());
        }
        e
    }

    fn record_as(&self, outcome: AuditOutcome, detail: &str) {
        let mut r = self.record.clone();
        r.outcome = outcome;
        detail.clone_into(&mut r.detail);
        self.store.audit().record(r);
    }

    /// Record a refusal and turn it into its error.
    fn refuse(&self, outcome: AuditOutcome, r: Refusal) -> ApiError {
        let e = ApiError::from(r);
        self.record_as(outcome, e.name());
        e
    }
}

/// The append's `Fencing-Token`, if it parses, for the ownership check and
/// the audit record (a malformed one the handler refuses, 400).
pub(crate) fn claimed_token(headers: &HeaderMap) -> Option<FencingToken> {
    let t = headers.get("fencing-token")?.to_str().ok()?.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok().map(FencingToken)
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
