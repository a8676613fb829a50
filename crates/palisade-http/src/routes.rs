use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use palisade_auth::{Action, Resource};
use palisade_core::{FencingToken, LeaseId, PartitionId, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{AsOf, AuditAction, AuditOutcome, Store};
use serde::Deserialize;

use utoipa::IntoParams;

use crate::caller::Caller;
use crate::error::ApiError;
use crate::openapi::EventsIn;
use crate::wire::{
    advice_out, hlc_text, lease_out, AppendResponse, ClockDriftError, DeadLetterOut,
    DeadLettersResponse, ErrorBody, ErrorName, EventOut, EventsPage, Health, LeaseAdviceOut,
    LeaseGoneError, LeaseHeldError, LeaseIn, LeaseOut, OutboxEntryOut, OutboxResponse,
    PartitionOut, PartitionsResponse, RefusalOut, RefusalsResponse, RejectionOut,
    RejectionsResponse, StaleTokenError, TokenRefusedError, TwinResponse, VersionMismatchError,
};
use crate::HttpConfig;

#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) store: Arc<Store>,
    pub(crate) config: HttpConfig,
    /// Turns true when the server starts shutting down: change streams end
    /// then, or graceful shutdown would wait for them forever.
    pub(crate) closing: tokio::sync::watch::Receiver<bool>,
    /// Keeps `closing` open for a router built without a shutdown signal.
    _keep_open: Option<Arc<tokio::sync::watch::Sender<bool>>>,
}

/// The API's routes over `store`, never closing its change streams (see
/// [`crate::run`] for a server that ends them on shutdown).
pub fn router(store: Arc<Store>, config: HttpConfig) -> Router {
    let (tx, rx) = tokio::sync::watch::channel(false);
    build(store, config, rx, Some(Arc::new(tx)))
}

/// The routes, with change streams that end once `closing` turns true.
pub(crate) fn router_closing(
    store: Arc<Store>,
    config: HttpConfig,
    closing: tokio::sync::watch::Receiver<bool>,
) -> Router {
    build(store, config, closing, None)
}

fn build(
    store: Arc<Store>,
    config: HttpConfig,
    closing: tokio::sync::watch::Receiver<bool>,
    keep_open: Option<Arc<tokio::sync::watch::Sender<bool>>>,
) -> Router {
    let limit = config.max_body_bytes;
    crate::caller::install(&store, &config);
    let state = AppState {
        store,
        config,
        closing,
        _keep_open: keep_open,
    };
    Router::new()
        .route("/", get(operator_page))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/leases", post(acquire))
        .route("/v1/leases/advice", get(lease_advice))
        .route("/v1/leases/{lease_id}/renew", post(renew))
        .route("/v1/leases/{lease_id}", axum::routing::delete(release))
        .route("/v1/twins/{twin_id}", get(get_twin))
        .route("/v1/twins/{twin_id}/events", post(append).get(twin_events))
        .route("/v1/partitions", get(partitions))
        .route("/v1/partitions/{partition}/events", get(partition_events))
        .route("/v1/twins/{twin_id}/watch", get(crate::watch::watch_twin))
        .route(
            "/v1/partitions/{partition}/watch",
            get(crate::watch::watch_partition),
        )
        .route("/v1/rejections", get(rejections))
        .route("/v1/twins/{twin_id}/refusals", get(twin_refusals))
        .route(
            "/v1/partitions/{partition}/refusals",
            get(partition_refusals),
        )
        .route("/v1/dead-letters", get(dead_letters))
        .route("/v1/outbox", get(outbox))
        .route(
            "/v1/outbox/{partition}/{seq}/{index}",
            axum::routing::delete(remove_dead_effect),
        )
        .route("/v1/openapi.json", get(crate::openapi::openapi_json))
        .route("/v1/audit", get(crate::audit_api::audit))
        .route("/v1/cluster/audit", get(crate::audit_api::cluster_audit))
        .route("/v1/admin/backup", post(crate::backup_api::backup))
        .fallback(|| async {
            ApiError::not_found(
                ErrorName::NoSuchRoute,
                "no such route; see /v1/openapi.json and docs/http-api.md",
            )
        })
        // A known path with another method: JSON too (axum adds `Allow`).
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorName::MethodNotAllowed,
                "this path does not take that method; see the Allow header",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// The operator page: one self-contained HTML file (no build step) that
/// reads the same JSON API and SSE streams as any client.
#[utoipa::path(
    get,
    path = "/",
    tag = "operations",
    responses((status = 200, description = "The operator page", content_type = "text/html", body = String))
)]
pub(crate) async fn operator_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("../assets/index.html"),
    )
        .into_response()
}

/// Health: 200 while the store acknowledges writes; 503 once a storage
/// failure stopped it (fail-stop: reads still work, writes get 503
/// `storage_failed`, a restart recovers).
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses(
        (status = 200, description = "The store is serving", body = Health),
        (status = 503, description = "A storage failure stopped the store from acknowledging writes", body = Health)
    )
)]
pub(crate) async fn healthz(State(s): State<AppState>) -> Response {
    match s.store.failure() {
        None => Json(Health {
            status: "ok".to_owned(),
            failure: None,
        })
        .into_response(),
        Some(f) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "failed".to_owned(),
                failure: Some(crate::wire::HealthFailure {
                    op: f.op.to_owned(),
                    kind: f.kind.to_string(),
                    detail: f.detail.clone(),
                    at_ms: f.at_ms,
                    message: f.to_string(),
                }),
            }),
        )
            .into_response(),
    }
}

/// Prometheus metrics (text exposition format 0.0.4).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text", content_type = "text/plain", body = String))
)]
pub(crate) async fn metrics(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Admin)?;
    if !call.security().public_metrics {
        call.authorize(Action::Read, &Resource::Admin("metrics".into()))?;
    }
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.store.metrics().render() + &s.store.audit().render_metrics(),
    )
        .into_response())
}

/// Read a body, turning the limit rejection into a JSON 413.
fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorName::BodyTooLarge,
                format!("request body is larger than the {limit}-byte limit"),
            )
            .audited(AuditOutcome::Limited)
        } else {
            ApiError::bad_request(ErrorName::BadBody, r.body_text())
        }
    })
}

fn json_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(
            ErrorName::BadJson,
            format!("request body is not valid: {e}"),
        )
    })
}

/// The path of the twin routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct TwinPath {
    /// 1..256 bytes of UTF-8 without control characters (URL-encoded).
    #[param(min_length = 1, pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]+$")]
    twin_id: String,
}

/// The path of the partition routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct PartitionPath {
    /// Partition number, below the partition count.
    #[param(value_type = u32)]
    partition: String,
}

/// The path of the lease routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct LeasePath {
    /// The lease id: 32 hex characters.
    #[param(pattern = "^[0-9a-fA-F]{32}$")]
    lease_id: String,
}

/// A path; axum's own rejection (plain text, e.g. for `%FF`, which does not
/// decode to UTF-8) becomes a JSON 400 named `error`.
fn path<T>(p: Result<Path<T>, PathRejection>, error: ErrorName) -> Result<T, ApiError> {
    p.map(|Path(t)| t)
        .map_err(|e| ApiError::bad_request(error, e.body_text()))
}

pub(crate) fn twin_id(p: Result<Path<TwinPath>, PathRejection>) -> Result<TwinId, ApiError> {
    TwinId::new(path(p, ErrorName::BadTwinId)?.twin_id)
        .map_err(|e| ApiError::bad_request(ErrorName::BadTwinId, e.to_string()))
}

/// The partition number, unchecked against the partition count.
pub(crate) fn partition(
    p: Result<Path<PartitionPath>, PathRejection>,
) -> Result<Option<u32>, ApiError> {
    Ok(path(p, ErrorName::BadPartition)?.partition.parse().ok())
}

/// A `{partition}` path segment that must be a number (`400 bad_partition`
/// otherwise; a number past the store's count is the store's 404).
fn partition_number(
    s: &AppState,
    p: Result<Path<PartitionPath>, PathRejection>,
) -> Result<u32, ApiError> {
    partition(p)?.ok_or_else(|| {
        ApiError::bad_request(
            ErrorName::BadPartition,
            format!("partition must be a number below {}", s.store.partitions()),
        )
    })
}

fn lease_id(p: Result<Path<LeasePath>, PathRejection>) -> Result<LeaseId, ApiError> {
    path(p, ErrorName::BadLeaseId)?
        .lease_id
        .parse()
        .map_err(|e: palisade_core::IdError| {
            ApiError::bad_request(ErrorName::BadLeaseId, e.to_string())
        })
}

/// A lease request body and its scope.
fn lease_request(bytes: &[u8]) -> Result<(LeaseIn, Scope), ApiError> {
    let req: LeaseIn = json_body(bytes)?;
    let scope = req.scope.parse().map_err(|e: palisade_core::IdError| {
        ApiError::bad_request(ErrorName::BadScope, e.to_string())
    })?;
    Ok((req, scope))
}

/// Acquire a lease on a partition or a twin: a new fencing token.
#[utoipa::path(
    post,
    path = "/v1/leases",
    tag = "leases",
    request_body(content = LeaseIn, content_type = "application/json"),
    responses(
        (status = 201, description = "Granted; the scope's fence is already raised to the token", body = LeaseOut),
        (status = 400, description = "`bad_json`, `bad_scope`, `bad_ttl`, `bad_holder`, `unknown_partition`, `bad_body`, \
            `twin_id_too_long` (a configured limit)", body = ErrorBody),
        (status = 409, description = "`lease_held`: another holder's lease is live", body = LeaseHeldError),
        (status = 413, description = "`body_too_large`", body = ErrorBody),
        (status = 429, description = "`too_many_leases` (`held`, `max`), `rate_limited` (with `Retry-After`): configured limits", body = ErrorBody),
        (status = 500, description = "`storage`, `tokens_exhausted`", body = ErrorBody),
        (status = 503, description = "`closed` (shutting down), `lease_id_collision`; retry", body = ErrorBody),
    )
)]
pub(crate) async fn acquire(
    State(s): State<AppState>,
    caller: Caller,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Grant)?;
    let bytes = body(b, s.config.max_body_bytes).map_err(|e| call.failed(e, None))?;
    // The scope, to authorize before anything else; a body without one the
    // handler would accept is refused below (400) without an audit record.
    let mut fields = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(m)) => Some(m),
        _ => None,
    };
    let scope = fields
        .as_ref()
        .and_then(|m| m.get("scope"))
        .and_then(serde_json::Value::as_str)
        .and_then(|t| t.parse::<Scope>().ok());
    let Some(scope) = scope else {
        return Err(lease_request(&bytes).err().unwrap_or_else(|| {
            ApiError::bad_request(
                ErrorName::BadScope,
                "scope must be partition/<p> or twin/<id>",
            )
        }));
    };
    call.authorize(Action::Lease, &Resource::Lease(scope.clone()))?;
    let claimed = fields
        .as_ref()
        .and_then(|m| m.get("holder"))
        .and_then(serde_json::Value::as_str);
    let holder = call.holder(claimed);
    let _limit = call.lease_limit(&holder, &scope).await?;
    // With authentication on the holder is the principal, whatever the
    // body says (or whether it says anything).
    let req = match (call.authenticated(), fields.as_mut()) {
        (true, Some(m)) => {
            m.insert("holder".into(), serde_json::Value::String(holder.clone()));
            lease_request(&serde_json::to_vec(m).unwrap_or_default())
        }
        _ => lease_request(&bytes),
    };
    let (req, scope) = req.map_err(|e| call.failed(e, Some(AuditOutcome::Refused)))?;
    // With authentication on, the token and lease are bound to the
    // principal inside the grant: nobody else can use them, ever.
    let lease = s
        .store
        .acquire_for(
            AcquireRequest {
                scope,
                holder: req.holder,
                ttl_ms: req.ttl_ms,
                purpose: req.purpose.unwrap_or_default(),
            },
            call.owner(),
        )
        .await
        .map_err(|e| call.failed(e.into(), Some(AuditOutcome::Refused)))?;
    call.granted(lease.token, lease.id, lease.purpose).await;
    let out = lease_out(&lease, lease.ttl_ms);
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// Renew a lease: same token, TTL restarted.
#[utoipa::path(
    post,
    path = "/v1/leases/{lease_id}/renew",
    tag = "leases",
    params(LeasePath),
    responses(
        (status = 200, description = "Renewed", body = LeaseOut),
        (status = 400, description = "`bad_lease_id`", body = ErrorBody),
        (status = 404, description = "`lease_not_found`", body = ErrorBody),
        (status = 410, description = "`lease_expired`, `lease_superseded` (`by_token`), `lease_released`", body = LeaseGoneError),
        (status = 500, description = "`storage`", body = ErrorBody),
        (status = 503, description = "`closed` (shutting down); retry", body = ErrorBody),
    )
)]
pub(crate) async fn renew(
    State(s): State<AppState>,
    caller: Caller,
    id: Result<Path<LeasePath>, PathRejection>,
) -> Result<Json<LeaseOut>, ApiError> {
    let mut call = caller.admit(AuditAction::Renew)?;
    let id = lease_id(id)?;
    call.owns_lease(id).await?;
    let lease = s
        .store
        .renew(id)
        .await
        .map_err(|e| call.failed(e.into(), Some(AuditOutcome::Refused)))?;
    call.done().await;
    Ok(Json(lease_out(&lease, lease.ttl_ms)))
}

/// Release a lease: its scope can be granted at once.
#[utoipa::path(
    delete,
    path = "/v1/leases/{lease_id}",
    tag = "leases",
    params(LeasePath),
    responses(
        (status = 204, description = "Released"),
        (status = 400, description = "`bad_lease_id`", body = ErrorBody),
        (status = 404, description = "`lease_not_found`", body = ErrorBody),
        (status = 410, description = "`lease_expired`, `lease_superseded` (`by_token`), `lease_released`", body = LeaseGoneError),
        (status = 500, description = "`storage`", body = ErrorBody),
        (status = 503, description = "`closed` (shutting down); retry", body = ErrorBody),
    )
)]
pub(crate) async fn release(
    State(s): State<AppState>,
    caller: Caller,
    id: Result<Path<LeasePath>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let mut call = caller.admit(AuditAction::Release)?;
    let id = lease_id(id)?;
    call.owns_lease(id).await?;
    s.store
        .release(id)
        .await
        .map_err(|e| call.failed(e.into(), Some(AuditOutcome::Refused)))?;
    call.done().await;
    Ok(StatusCode::NO_CONTENT)
}

fn fencing_token(headers: &HeaderMap) -> Result<FencingToken, ApiError> {
    let mut all = headers.get_all("fencing-token").iter();
    let raw = all.next().ok_or_else(|| {
        ApiError::bad_request(
            ErrorName::MissingToken,
            "the Fencing-Token header is required: the token of your lease",
        )
    })?;
    // Two tokens are two claims: taking either one (the first, as proxies
    // and frameworks disagree on which) could let a write through under a
    // token its sender did not mean. Refuse rather than guess.
    if all.next().is_some() {
        return Err(ApiError::bad_request(
            ErrorName::BadToken,
            "give exactly one Fencing-Token header",
        ));
    }
    let text = raw
        .to_str()
        .map_err(|_| {
            ApiError::bad_request(
                ErrorName::BadToken,
                "Fencing-Token must be a decimal number",
            )
        })?
        .trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::bad_request(
            ErrorName::BadToken,
            format!("Fencing-Token must be a non-negative decimal number, got {text:?}"),
        ));
    }
    text.parse::<u64>().map(FencingToken).map_err(|_| {
        ApiError::bad_request(
            ErrorName::BadToken,
            format!("Fencing-Token {text} does not fit in 64 bits"),
        )
    })
}

/// `If-Match`: one entity tag, the twin version the append expects.
///
/// RFC 9110 13.1.1: If-Match compares strongly, and a weak tag never
/// matches strongly, so `W/"12"` is a precondition that fails (412), not a
/// malformed header. Lists and `*` are not supported (400).
fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let mut all = headers.get_all(header::IF_MATCH).iter();
    let Some(raw) = all.next() else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_request(
            ErrorName::BadIfMatch,
            "If-Match must be one twin version (its ETag), e.g. \"12\"",
        )
    };
    if all.next().is_some() {
        return Err(bad());
    }
    let text = raw.to_str().unwrap_or("").trim();
    let (weak, tag) = match text.strip_prefix("W/") {
        Some(t) => (true, t),
        None => (false, text),
    };
    let version = tag.trim_matches('"').parse::<u64>().map_err(|_| bad())?;
    if weak {
        return Err(ApiError::new(
            StatusCode::PRECONDITION_FAILED,
            ErrorName::WeakIfMatch,
            format!(
                "If-Match compares entity tags strongly (RFC 9110 13.1.1): the weak tag \
                 W/\"{version}\" never matches; send \"{version}\""
            ),
        ));
    }
    Ok(Some(version))
}

/// Append one event or a batch to a twin, fenced by the lease's token.
#[utoipa::path(
    post,
    path = "/v1/twins/{twin_id}/events",
    tag = "events",
    params(
        TwinPath,
        ("Fencing-Token" = u64, Header, description = "The token of your lease (decimal); exactly one such header"),
        ("If-Match" = Option<String>, Header, nullable = false, pattern = "^(W/)?\"?[0-9]{1,20}\"?$", description = "Append only if the twin's version is this ETag, e.g. `\"12\"` (strong comparison: a weak `W/` tag never matches, `412 weak_if_match`)"),
    ),
    request_body(content = EventsIn, content_type = "application/json"),
    responses(
        (status = 201, description = "Appended (on disk) or acknowledged as duplicates", body = AppendResponse,
            headers(("ETag" = String, description = "The twin's version, quoted"))),
        (status = 400, description = "`missing_token`, `bad_token` (also for two `Fencing-Token` headers), `bad_json`, `bad_patch`, \
            `bad_event` (`type` or `event_id` empty, too long or with a control character), `bad_hlc`, \
            `bad_effects` (an `effects` list that is not an array, has more than 16 effects, an unknown kind, a URL that is not http(s) or over 2048 bytes, a reserved header), \
            `bad_if_match`, `bad_twin_id`, `no_events`, `bad_body`, `twin_id_too_long` (a configured limit)", body = ErrorBody),
        (status = 403, description = "`token_not_issued`, `token_scope_mismatch` (`scope`)", body = TokenRefusedError),
        (status = 409, description = "`stale_token`: a later grant covering this twin was seen", body = StaleTokenError),
        (status = 412, description = "`version_mismatch` (`expected`, `current`); `weak_if_match` (a weak `W/` tag, which never matches strongly)", body = VersionMismatchError),
        (status = 413, description = "`body_too_large`, `batch_too_large`, `patch_too_large`", body = ErrorBody),
        (status = 422, description = "`clock_drift`: the event's HLC is too far ahead", body = ClockDriftError),
        (status = 500, description = "`storage`", body = ErrorBody),
        (status = 503, description = "`closed` (shutting down); retry", body = ErrorBody),
    )
)]
pub(crate) async fn append(
    State(s): State<AppState>,
    caller: Caller,
    twin: Result<Path<TwinPath>, PathRejection>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Write)?;
    // A path that does not decode names no twin: refused below (400)
    // before anything happens, and not audited.
    let twin = twin_id(twin);
    let audited = twin.is_ok();
    if let Ok(t) = &twin {
        let resource = call.twin(t);
        call.authorize(Action::Write, &resource)?;
        if let Some(token) = crate::caller::claimed_token(&headers) {
            call.owns_token(token).await?;
        }
    }
    let principal = call.principal_name().map(str::to_owned);
    append_events(&s, principal.as_deref(), twin, &headers, b)
        .await
        .map_err(|e| if audited { call.failed(e, None) } else { e })
}

/// [`append`] once the caller may: the request's checks in the order the
/// API documents them, then the store's.
async fn append_events(
    s: &AppState,
    principal: Option<&str>,
    twin: Result<TwinId, ApiError>,
    headers: &HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body(b, s.config.max_body_bytes)?;
    let twin = twin?;
    let token = fencing_token(headers)?;
    let expected = if_match(headers)?;
    // Without an id there is no retry dedupe; a random one keeps ids unique.
    let (events, effects) = palisade_core::json::parse_events_with_effects(&bytes, |_| {
        uuid::Uuid::new_v4().simple().to_string()
    })
    .map_err(|e| ApiError::bad_request(e.kind, e.message))?;
    // No effects at all: the plain append (nothing staged in the outbox).
    let effects = if effects.iter().all(Vec::is_empty) {
        Vec::new()
    } else {
        effects
    };
    if events.len() > s.config.max_batch_events {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorName::BatchTooLarge,
            format!(
                "{} events in one request; the limit is {}",
                events.len(),
                s.config.max_batch_events
            ),
        )
        .audited(AuditOutcome::Limited));
    }
    crate::caller::check_patches(&s.config.security.limits, &events)?;
    let done = s
        .store
        .append_for(principal, twin, token, events, effects, expected)
        .await?;
    let mut resp = (
        StatusCode::CREATED,
        Json(AppendResponse {
            duplicates: done.duplicates,
            fence: done.fence.0,
            partition: done.partition.0,
            seqs: done.seqs,
            version: done.version,
        }),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("\"{}\"", done.version)) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    Ok(resp)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct TwinQuery {
    /// The state after the twin's events up to this partition seq.
    at_seq: Option<u64>,
    /// The state from the twin's events with HLC <= this (`<ntp64>/<hex id>`).
    /// Not together with `at_seq`.
    #[param(pattern = "^[0-9]{1,20}/[0-9a-fA-F]*[1-9a-fA-F][0-9a-fA-F]*$")]
    at_hlc: Option<String>,
}

pub(crate) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(t)| t)
        .map_err(|e| ApiError::bad_request(ErrorName::BadQuery, e.body_text()))
}

/// A twin's state (now, or as of a seq or an HLC).
#[utoipa::path(
    get,
    path = "/v1/twins/{twin_id}",
    tag = "events",
    params(
        TwinPath,
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you have: `304` if it is still the version of what you asked for (now, or at that `at_seq`/`at_hlc`)"),
        TwinQuery,
    ),
    responses(
        (status = 200, description = "The twin", body = TwinResponse,
            headers(("ETag" = String, description = "The twin's version, quoted"))),
        (status = 304, description = "Not modified (`If-None-Match` names the version of the state asked for, `*`, or a list including it; weak tags compare equal), with its `ETag`",
            headers(("ETag" = String, description = "The version, quoted"))),
        (status = 400, description = "`bad_twin_id`, `bad_query`, `bad_hlc`", body = ErrorBody),
        (status = 404, description = "`twin_not_found`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn get_twin(
    State(s): State<AppState>,
    caller: Caller,
    twin: Result<Path<TwinPath>, PathRejection>,
    headers: HeaderMap,
    q: Result<Query<TwinQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let twin = twin_id(twin)?;
    let resource = call.twin(&twin);
    call.authorize(Action::Read, &resource)?;
    let q = query(q)?;
    let at = match (q.at_seq, q.at_hlc) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                ErrorName::BadQuery,
                "give at_seq or at_hlc, not both",
            ))
        }
        (Some(seq), None) => AsOf::Seq(seq),
        (None, Some(h)) => AsOf::Hlc(h.parse().map_err(|e: palisade_core::HlcParseError| {
            ApiError::bad_request(ErrorName::BadHlc, e.to_string())
        })?),
        (None, None) => AsOf::Latest,
    };
    let view = s.store.twin_async(&twin, at).await?.ok_or_else(|| {
        ApiError::not_found(
            ErrorName::TwinNotFound,
            format!(
                "twin {twin:?} has no events{}",
                if at == AsOf::Latest {
                    ""
                } else {
                    " at that point"
                }
            ),
        )
    })?;
    let etag = format!("\"{}\"", view.version);
    // For historic reads too (RFC 9110 13.1.2): `?at_seq=` and `?at_hlc=`
    // name their own resource, whose version is the ETag sent with it.
    if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| if_none_match_hits(v, &etag))
    {
        // RFC 9110 15.4.5: a 304 carries the ETag a 200 would have.
        let mut resp = StatusCode::NOT_MODIFIED.into_response();
        if let Ok(v) = HeaderValue::from_str(&etag) {
            resp.headers_mut().insert(header::ETAG, v);
        }
        return Ok(resp);
    }
    let hlc = view
        .field_hlcs
        .into_iter()
        .map(|(k, h)| (k, hlc_text(h)))
        .collect();
    let mut resp = Json(TwinResponse {
        delta: palisade_twin::delta(&view.state),
        fence: view.fence.0,
        hlc,
        partition: view.partition.0,
        state: view.state,
        twin_id: view.twin_id.as_str().to_owned(),
        version: view.version,
    })
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&etag) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    Ok(resp)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct PageQuery {
    /// Events with a seq above this (default 0: from the start).
    after: Option<u64>,
    /// Page size: default 100, at least 1 (`0` is `400 bad_query`), at
    /// most 1000 (larger values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
}

/// A `limit` query parameter: `default` if absent, clamped to `max`. `0` is
/// refused: an empty page reads as "no more events", which a pager would
/// take for the end of the log.
pub(crate) fn page_limit(
    limit: Option<usize>,
    default: usize,
    max: usize,
) -> Result<usize, ApiError> {
    match limit {
        Some(0) => Err(ApiError::bad_request(
            ErrorName::BadQuery,
            format!("limit must be 1 to {max} (larger values are clamped), got 0"),
        )),
        other => Ok(other.unwrap_or(default).min(max)),
    }
}

fn page(events: Vec<palisade_core::Event>) -> Json<EventsPage> {
    let next_after = events.last().map(|e| e.seq);
    let events = events.into_iter().map(EventOut::from).collect();
    Json(EventsPage { events, next_after })
}

/// A twin's events, oldest first.
#[utoipa::path(
    get,
    path = "/v1/twins/{twin_id}/events",
    tag = "events",
    params(
        TwinPath,
        PageQuery,
    ),
    responses(
        (status = 200, description = "A page of the twin's events", body = EventsPage),
        (status = 400, description = "`bad_twin_id`, `bad_query`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn twin_events(
    State(s): State<AppState>,
    caller: Caller,
    twin: Result<Path<TwinPath>, PathRejection>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<EventsPage>, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let twin = twin_id(twin)?;
    let resource = call.twin(&twin);
    call.authorize(Action::Read, &resource)?;
    let q = query(q)?;
    let limit = page_limit(q.limit, 100, s.config.max_page)?;
    Ok(page(
        s.store
            .twin_events_async(&twin, q.after.unwrap_or(0), limit)
            .await?,
    ))
}

/// A partition's events, oldest first.
#[utoipa::path(
    get,
    path = "/v1/partitions/{partition}/events",
    tag = "partitions",
    params(
        PartitionPath,
        PageQuery,
    ),
    responses(
        (status = 200, description = "A page of the partition's events", body = EventsPage),
        (status = 400, description = "`bad_partition`, `bad_query`", body = ErrorBody),
        (status = 404, description = "`unknown_partition`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn partition_events(
    State(s): State<AppState>,
    caller: Caller,
    p: Result<Path<PartitionPath>, PathRejection>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<EventsPage>, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let p = partition_number(&s, p)?;
    call.authorize(Action::Read, &Resource::Partition(PartitionId(p)))?;
    let q = query(q)?;
    let limit = page_limit(q.limit, 100, s.config.max_page)?;
    Ok(page(
        s.store
            .partition_events_async(PartitionId(p), q.after.unwrap_or(0), limit)
            .await?,
    ))
}

/// Which view a cluster node answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ViewScope {
    /// This node's own view only (how the cluster view asks each owner).
    Local,
    /// The whole cluster, gathered from every partition's owner (default).
    Cluster,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct PartitionsQuery {
    /// Cluster mode: `local` for this node's own view only; default
    /// `cluster` (every partition from its owner). Ignored on one node.
    #[param(inline)]
    scope: Option<ViewScope>,
}

/// Every partition: fence, head and owner; in cluster mode also its owner
/// node, owner token, lag and whether it is served, gathered from every
/// partition's owner (a view: each owner answers for its partitions at a
/// slightly different moment, not a snapshot).
#[utoipa::path(
    get,
    path = "/v1/partitions",
    tag = "partitions",
    params(PartitionsQuery),
    responses(
        (status = 200, description = "The partitions", body = PartitionsResponse),
        (status = 400, description = "`bad_query`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
        (status = 503, description = "`lease_authority_unavailable` (cluster mode: etcd's owner keys cannot be read)", body = ErrorBody),
    )
)]
pub(crate) async fn partitions(
    State(s): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    q: Result<Query<PartitionsQuery>, QueryRejection>,
) -> Result<Json<PartitionsResponse>, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Read, &Resource::Admin("partitions".into()))?;
    let q = query(q)?;
    let infos = s.store.partition_infos_async().await?;
    let cluster = s.config.cluster.as_deref();
    let partitions = infos
        .into_iter()
        .map(|i| PartitionOut {
            cluster: cluster.map(|c| crate::views::holding_out(c, &s.store, i.partition.0)),
            fence: i.fence.0,
            head: i.head,
            owner: i.owner.map(|l| lease_out(&l, s.store.lease_expires_in(&l))),
            partition: i.partition.0,
        })
        .collect();
    let local = PartitionsResponse {
        last_token: s.store.last_token().0,
        partitions,
    };
    Ok(Json(match cluster {
        Some(c) if q.scope != Some(ViewScope::Local) => {
            crate::views::partitions(
                c,
                s.store.partitions(),
                local,
                headers.get(header::AUTHORIZATION),
            )
            .await?
        }
        _ => local,
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct AdviceQuery {
    /// `partition/<p>` or `twin/<id>`.
    scope: String,
    /// Only this holder's renewals (default: every holder's on the scope).
    holder: Option<String>,
}

/// The TTL a scope's measured renewal gaps call for: gaps between a lease's
/// renewals and the store's answer latency, per scope and holder, since the
/// store started (docs/decisions/0026-ttl-advice.md).
#[utoipa::path(
    get,
    path = "/v1/leases/advice",
    tag = "leases",
    params(AdviceQuery),
    responses(
        (status = 200, description = "The measured tails and the recommended TTL (null until 20 renewal gaps were measured)", body = LeaseAdviceOut),
        (status = 400, description = "`bad_scope`, `bad_query`", body = ErrorBody),
    )
)]
pub(crate) async fn lease_advice(
    State(s): State<AppState>,
    caller: Caller,
    q: Result<Query<AdviceQuery>, QueryRejection>,
) -> Result<Json<LeaseAdviceOut>, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let q = query(q)?;
    let scope = q.scope.parse::<Scope>().map_err(|_| {
        ApiError::bad_request(
            ErrorName::BadScope,
            "scope must be partition/<p> or twin/<id>",
        )
    })?;
    // Whoever may lease the scope may see how its leases fare.
    call.authorize(Action::Lease, &Resource::Lease(scope.clone()))?;
    let advice = s.store.lease_advice(&scope, q.holder.as_deref());
    let current = s.store.lease_holder(&scope);
    Ok(Json(advice_out(
        scope.to_string(),
        q.holder,
        &advice,
        current.as_ref(),
    )))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct LimitQuery {
    /// At most this many (default 100, at least 1, at most 1024; larger
    /// values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
}

/// Recent refused writes (HTTP and Kafka), newest first (bounded, in memory).
#[utoipa::path(
    get,
    path = "/v1/rejections",
    tag = "partitions",
    params(LimitQuery),
    responses(
        (status = 200, description = "Recent refused writes, newest first (last 1024)", body = RejectionsResponse),
        (status = 400, description = "`bad_query`", body = ErrorBody),
    )
)]
pub(crate) async fn rejections(
    State(s): State<AppState>,
    caller: Caller,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<RejectionsResponse>, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Read, &Resource::Admin("rejections".into()))?;
    let limit = page_limit(query(q)?.limit, 100, palisade_log::REJECTION_LOG_LEN)?;
    let rejections = s
        .store
        .rejections(limit)
        .into_iter()
        .map(|r| RejectionOut {
            at_ms: r.at_ms,
            event_ids: r.event_ids,
            message: r.detail,
            offset: r.offset,
            partition: r.partition.0,
            reason: r.reason.to_owned(),
            source: r.source.to_owned(),
            source_partition: r.source_partition,
            token: r.token.0,
            twin_id: r.twin.as_str().to_owned(),
        })
        .collect();
    Ok(Json(RejectionsResponse { rejections }))
}

/// Most refusals listed per request (the journal keeps up to its cap per
/// partition; older ones are pruned).
const MAX_REFUSALS_LISTED: usize = 1024;

fn refusal_out(s: &AppState, r: palisade_log::Refusal) -> RefusalOut {
    use std::fmt::Write as _;
    let digest = r.digest.iter().fold(String::with_capacity(64), |mut h, b| {
        let _ = write!(h, "{b:02x}");
        h
    });
    // Looked up when read: the owner is bound durably at grant time, and
    // the sequencer that journals the refusal does not know it.
    let principal = s
        .store
        .audit()
        .token_owner(palisade_core::FencingToken(r.token))
        .ok()
        .flatten();
    RefusalOut {
        at_ms: r.at_ms,
        digest,
        event_count: r.event_count,
        event_ids: r.event_ids,
        fence: r.fence,
        holder: r.holder,
        message: r.detail,
        offset: r.kafka.map(|k| k.1),
        partition: r.partition,
        principal,
        reason: r.reason,
        seq: r.seq,
        source: r.source.name().to_owned(),
        source_partition: r.kafka.map(|k| k.0),
        token: r.token,
        twin_id: r.twin,
    }
}

/// A twin's refused writes from the durable refusal journal, newest first.
#[utoipa::path(
    get,
    path = "/v1/twins/{twin_id}/refusals",
    tag = "events",
    params(TwinPath, LimitQuery),
    responses(
        (status = 200, description = "The twin's refused writes, newest first (empty for an unknown twin)", body = RefusalsResponse),
        (status = 400, description = "`bad_twin_id`, `bad_query`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn twin_refusals(
    State(s): State<AppState>,
    caller: Caller,
    twin: Result<Path<TwinPath>, PathRejection>,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<RefusalsResponse>, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let twin = twin_id(twin)?;
    let resource = call.twin(&twin);
    call.authorize(Action::Read, &resource)?;
    let limit = page_limit(query(q)?.limit, 100, MAX_REFUSALS_LISTED)?;
    let list = s.store.refusals_of_twin_async(&twin, limit).await?;
    let refusals = list.into_iter().map(|r| refusal_out(&s, r)).collect();
    Ok(Json(RefusalsResponse { refusals }))
}

/// A partition's refused writes from the durable refusal journal, newest first.
#[utoipa::path(
    get,
    path = "/v1/partitions/{partition}/refusals",
    tag = "partitions",
    params(PartitionPath, LimitQuery),
    responses(
        (status = 200, description = "The partition's refused writes, newest first", body = RefusalsResponse),
        (status = 400, description = "`bad_partition`, `bad_query`", body = ErrorBody),
        (status = 404, description = "`unknown_partition`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn partition_refusals(
    State(s): State<AppState>,
    caller: Caller,
    p: Result<Path<PartitionPath>, PathRejection>,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<RefusalsResponse>, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let p = partition_number(&s, p)?;
    call.authorize(Action::Read, &Resource::Partition(PartitionId(p)))?;
    let limit = page_limit(query(q)?.limit, 100, MAX_REFUSALS_LISTED)?;
    let list = s
        .store
        .refusals_of_partition_async(PartitionId(p), limit)
        .await?;
    let refusals = list.into_iter().map(|r| refusal_out(&s, r)).collect();
    Ok(Json(RefusalsResponse { refusals }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct OutboxQuery {
    /// Only effects in this state: `pending`, `delivered` or `dead`.
    #[param(pattern = "^(pending|delivered|dead)$")]
    state: Option<String>,
    /// At most this many (default 100, at least 1, at most 1024; larger
    /// values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
}

/// Most outbox entries listed per request.
const MAX_OUTBOX_LISTED: usize = 1024;

/// The fenced outbox: effects of admitted events and their delivery
/// states, in order of partition, seq and effect index.
#[utoipa::path(
    get,
    path = "/v1/outbox",
    tag = "partitions",
    params(OutboxQuery),
    responses(
        (status = 200, description = "Effects, oldest first per partition", body = OutboxResponse),
        (status = 400, description = "`bad_query` (unknown state or parameter, zero limit)", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn outbox(
    State(s): State<AppState>,
    caller: Caller,
    q: Result<Query<OutboxQuery>, QueryRejection>,
) -> Result<Json<OutboxResponse>, ApiError> {
    // Effect bodies and URLs may carry what only operators should see:
    // `admin`, not `read`.
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Admin, &Resource::Admin("outbox".into()))?;
    let q = query(q)?;
    let state = match q.state.as_deref() {
        None => None,
        Some(name) => Some(palisade_log::DeliveryState::from_name(name).ok_or_else(|| {
            ApiError::bad_request(
                ErrorName::BadQuery,
                format!("state must be pending, delivered or dead, not {name:?}"),
            )
        })?),
    };
    let limit = page_limit(q.limit, 100, MAX_OUTBOX_LISTED)?;
    let list = s.store.outbox_list_async(state, limit).await?;
    let counts = s.store.outbox_counts_async().await?;
    let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
    let counts = palisade_api::OutboxCountsOut {
        pending: n(counts.pending),
        delivered: n(counts.delivered),
        dead: n(counts.dead),
    };
    let effects = list
        .into_iter()
        .map(|e| OutboxEntryOut {
            attempts: e.attempts,
            idempotency_key: e.idempotency_key(),
            body: e.effect.body,
            created_at_ms: e.created_at_ms,
            event_id: e.event_id,
            index: e.index,
            kind: e.effect.kind.name().to_owned(),
            last_error: e.last_error,
            partition: e.partition,
            seq: e.seq,
            state: e.state.name().to_owned(),
            token: e.token,
            twin_id: e.twin,
            updated_at_ms: e.updated_at_ms,
            url: e.effect.url,
        })
        .collect();
    Ok(Json(OutboxResponse { effects, counts }))
}

/// Where an outbox effect is: its event's partition and seq, and its place
/// in the event's `effects` (as `GET /v1/outbox` lists them).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct EffectPath {
    partition: u32,
    seq: u64,
    index: u16,
}

/// Remove a dead outbox effect (an operator has dealt with it). Only dead
/// effects; in cluster mode on the node serving the partition.
#[utoipa::path(
    delete,
    path = "/v1/outbox/{partition}/{seq}/{index}",
    tag = "partitions",
    params(EffectPath),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "`bad_query` (not numbers)", body = ErrorBody),
        (status = 404, description = "`outbox_effect_not_found`", body = ErrorBody),
        (status = 409, description = "`outbox_effect_not_dead` (pending or delivered)", body = ErrorBody),
        (status = 503, description = "`not_serving` (cluster mode: ask the node serving the partition), `storage_failed`, `closed`", body = ErrorBody),
    )
)]
pub(crate) async fn remove_dead_effect(
    State(s): State<AppState>,
    caller: Caller,
    p: Result<Path<EffectPath>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Admin, &Resource::Admin("outbox".into()))?;
    let p = path(p, ErrorName::BadQuery)?;
    let e = s
        .store
        .outbox_remove_dead(palisade_core::PartitionId(p.partition), p.seq, p.index)
        .await?;
    tracing::info!(key = %e.idempotency_key(), partition = p.partition, seq = p.seq,
        "outbox: dead effect removed by an operator");
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct DeadLetterQuery {
    /// Only the dead letters of this Kafka partition (of the ingested
    /// topic; it may have more partitions than the store).
    partition: Option<u32>,
    /// Only Kafka offsets above this (within each partition).
    after: Option<u64>,
    /// At most this many (default 100, at least 1, at most 1000; larger
    /// values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
    /// Cluster mode: `local` for this node's own store only; default
    /// `cluster` (each partition's from its owner). Ignored on one node.
    #[param(inline)]
    scope: Option<ViewScope>,
}

/// Stored dead letters (Kafka records that could not be applied), oldest
/// first (by Kafka partition, then offset). In cluster mode each
/// partition's come from its owner, which holds every dead letter of the
/// partition (it applied or replayed the whole partition); partitions whose
/// owner did not answer are listed in `missing`.
#[utoipa::path(
    get,
    path = "/v1/dead-letters",
    tag = "partitions",
    params(DeadLetterQuery),
    responses(
        (status = 200, description = "Dead letters, oldest first (last 10,000 per partition)", body = DeadLettersResponse),
        (status = 400, description = "`bad_query`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
        (status = 503, description = "`lease_authority_unavailable` (cluster mode: etcd's owner keys cannot be read)", body = ErrorBody),
    )
)]
pub(crate) async fn dead_letters(
    State(s): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    q: Result<Query<DeadLetterQuery>, QueryRejection>,
) -> Result<Json<DeadLettersResponse>, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Read, &Resource::Admin("dead-letters".into()))?;
    let q = query(q)?;
    // `partition` is a Kafka partition: the topic may have more than the
    // store (records are routed by key), so any number is a valid filter.
    let limit = page_limit(q.limit, 100, s.config.max_page)?;
    if let Some(c) = s.config.cluster.as_deref() {
        if q.scope != Some(ViewScope::Local) {
            return Ok(Json(
                crate::views::dead_letters(
                    c,
                    &s.store,
                    q.partition,
                    q.after,
                    limit,
                    headers.get(header::AUTHORIZATION),
                )
                .await?,
            ));
        }
    }
    let dead_letters = s
        .store
        .dead_letters_async(q.partition, q.after, limit)
        .await?
        .into_iter()
        .map(dead_letter_out)
        .collect();
    Ok(Json(DeadLettersResponse {
        dead_letters,
        missing: Vec::new(),
    }))
}

pub(crate) fn dead_letter_out(d: palisade_log::DeadLetter) -> DeadLetterOut {
    DeadLetterOut {
        at_ms: d.at_ms,
        headers: d.headers,
        key: d.key,
        message: d.detail,
        offset: d.offset,
        partition: d.partition,
        reason: d.reason,
        value: String::from_utf8_lossy(&d.value).into_owned(),
        value_len: d.value_len,
    }
}

/// Whether an `If-None-Match` value names `etag` (RFC 9110 13.1.2): `*`
/// (the twin exists), or a comma-separated list of entity tags compared
/// weakly (a `W/` prefix is ignored on either side).
fn if_none_match_hits(header: &str, etag: &str) -> bool {
    let strip = |t: &str| {
        let t = t.trim();
        t.strip_prefix("W/").unwrap_or(t).to_owned()
    };
    let etag = strip(etag);
    header.trim() == "*" || header.split(',').any(|t| strip(t) == etag)
}

#[cfg(test)]
mod if_none_match_tests {
    use super::if_none_match_hits;

    #[test]
    fn matches_exact_weak_star_and_lists() {
        assert!(if_none_match_hits("\"7\"", "\"7\""));
        assert!(if_none_match_hits("W/\"7\"", "\"7\""));
        assert!(if_none_match_hits(" * ", "\"7\""));
        assert!(if_none_match_hits("\"3\", W/\"7\" ,\"9\"", "\"7\""));
        assert!(!if_none_match_hits("\"6\"", "\"7\""));
        assert!(!if_none_match_hits("\"3\", \"9\"", "\"7\""));
        assert!(!if_none_match_hits("7", "\"7\""));
        assert!(!if_none_match_hits("", "\"7\""));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod header_tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn exactly_one_fencing_token() {
        assert_eq!(
            fencing_token(&headers(&[("fencing-token", "7")])).unwrap(),
            FencingToken(7)
        );
        for twice in [
            &[("fencing-token", "7"), ("fencing-token", "9")][..],
            &[("fencing-token", "7"), ("fencing-token", "7")],
        ] {
            let e = fencing_token(&headers(twice)).unwrap_err();
            assert_eq!(
                (e.status(), e.name()),
                (StatusCode::BAD_REQUEST, "bad_token")
            );
        }
    }

    #[test]
    fn if_match_is_strong() {
        let im = |v: &'static str| if_match(&headers(&[("if-match", v)]));
        assert_eq!(im("\"12\"").unwrap(), Some(12));
        assert_eq!(if_match(&HeaderMap::new()).unwrap(), None);
        // RFC 9110 13.1.1: a weak tag never matches strongly: 412, not 400.
        let e = im("W/\"12\"").unwrap_err();
        assert_eq!(
            (e.status(), e.name()),
            (StatusCode::PRECONDITION_FAILED, "weak_if_match")
        );
        for bad in ["abc", "*", "\"1\", \"2\"", "W/abc"] {
            assert_eq!(im(bad).unwrap_err().name(), "bad_if_match", "{bad}");
        }
        let two = headers(&[("if-match", "\"1\""), ("if-match", "\"1\"")]);
        assert_eq!(if_match(&two).unwrap_err().name(), "bad_if_match");
    }

    #[test]
    fn a_zero_limit_is_refused_and_large_ones_clamped() {
        assert_eq!(page_limit(None, 100, 1000).unwrap(), 100);
        assert_eq!(page_limit(Some(1), 100, 1000).unwrap(), 1);
        assert_eq!(page_limit(Some(5000), 100, 1000).unwrap(), 1000);
        let e = page_limit(Some(0), 100, 1000).unwrap_err();
        assert_eq!(
            (e.status(), e.name()),
            (StatusCode::BAD_REQUEST, "bad_query")
        );
    }

    /// Issue 18: serde named the body's Rust type ("expected struct LeaseIn").
    #[test]
    fn bad_lease_bodies_name_no_rust_type() {
        for body in [&b"5"[..], b"[]", b"\"x\"", b"null", b"[1, 2]"] {
            let e = json_body::<LeaseIn>(body).unwrap_err();
            assert_eq!(e.name(), "bad_json");
            let m = e.message();
            assert!(!m.contains("LeaseIn") && !m.contains("struct"), "{m}");
        }
        let e = json_body::<LeaseIn>(b"5").unwrap_err();
        assert!(
            e.message().contains("a lease request object"),
            "{}",
            e.message()
        );
    }
}
