use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use palisade_core::{FencingToken, LeaseId, PartitionId, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{AsOf, Store};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::wire::{hlc_text, EventOut, LeaseIn, LeaseOut};
use crate::HttpConfig;

#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) store: Arc<Store>,
    pub(crate) config: HttpConfig,
}

/// The API's routes over `store`.
pub fn router(store: Arc<Store>, config: HttpConfig) -> Router {
    let limit = config.max_body_bytes;
    Router::new()
        .route("/", get(operator_page))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/leases", post(acquire))
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
        .route("/v1/dead-letters", get(dead_letters))
        .fallback(|| async {
            ApiError::not_found(
                "no_such_route",
                "no such route; the API is documented in docs/http-api.md",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(AppState { store, config })
}

/// The operator page: one self-contained HTML file (no build step) that
/// reads the same JSON API and SSE streams as any client.
async fn operator_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("../assets/index.html"),
    )
        .into_response()
}

async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.store.metrics().render(),
    )
        .into_response()
}

/// Read a body, turning the limit rejection into a JSON 413.
fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("request body is larger than the {limit}-byte limit"),
            )
        } else {
            ApiError::bad_request("bad_body", r.body_text())
        }
    })
}

fn json_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request("bad_json", format!("request body is not valid: {e}")))
}

fn twin_id(raw: String) -> Result<TwinId, ApiError> {
    TwinId::new(raw).map_err(|e| ApiError::bad_request("bad_twin_id", e.to_string()))
}

fn lease_id(raw: &str) -> Result<LeaseId, ApiError> {
    raw.parse()
        .map_err(|e: palisade_core::IdError| ApiError::bad_request("bad_lease_id", e.to_string()))
}

async fn acquire(
    State(s): State<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: LeaseIn = json_body(&body(b, s.config.max_body_bytes)?)?;
    let scope: Scope = req
        .scope
        .parse()
        .map_err(|e: palisade_core::IdError| ApiError::bad_request("bad_scope", e.to_string()))?;
    let lease = s
        .store
        .acquire(AcquireRequest {
            scope,
            holder: req.holder,
            ttl_ms: req.ttl_ms,
        })
        .await?;
    let out = LeaseOut::new(&lease, lease.ttl_ms);
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

async fn renew(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<LeaseOut>, ApiError> {
    let lease = s.store.renew(lease_id(&id)?).await?;
    Ok(Json(LeaseOut::new(&lease, lease.ttl_ms)))
}

async fn release(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    s.store.release(lease_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn fencing_token(headers: &HeaderMap) -> Result<FencingToken, ApiError> {
    let raw = headers.get("fencing-token").ok_or_else(|| {
        ApiError::bad_request(
            "missing_token",
            "the Fencing-Token header is required: the token of your lease",
        )
    })?;
    let text = raw
        .to_str()
        .map_err(|_| ApiError::bad_request("bad_token", "Fencing-Token must be a decimal number"))?
        .trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::bad_request(
            "bad_token",
            format!("Fencing-Token must be a non-negative decimal number, got {text:?}"),
        ));
    }
    text.parse::<u64>().map(FencingToken).map_err(|_| {
        ApiError::bad_request(
            "bad_token",
            format!("Fencing-Token {text} does not fit in 64 bits"),
        )
    })
}

fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(raw) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let text = raw.to_str().unwrap_or("").trim();
    let text = text.strip_prefix("W/").unwrap_or(text).trim_matches('"');
    text.parse::<u64>().map(Some).map_err(|_| {
        ApiError::bad_request(
            "bad_if_match",
            "If-Match must be a twin version (its ETag), e.g. \"12\"",
        )
    })
}

async fn append(
    State(s): State<AppState>,
    Path(twin): Path<String>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body(b, s.config.max_body_bytes)?;
    let twin = twin_id(twin)?;
    let token = fencing_token(&headers)?;
    let expected = if_match(&headers)?;
    // Without an id there is no retry dedupe; a random one keeps ids unique.
    let events =
        palisade_core::json::parse_events(&bytes, |_| uuid::Uuid::new_v4().simple().to_string())
            .map_err(|e| ApiError::bad_request(e.kind, e.message))?;
    if events.len() > s.config.max_batch_events {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "batch_too_large",
            format!(
                "{} events in one request; the limit is {}",
                events.len(),
                s.config.max_batch_events
            ),
        ));
    }
    let done = s.store.append(twin, token, events, expected).await?;
    let mut resp = (
        StatusCode::CREATED,
        Json(json!({
            "partition": done.partition.0,
            "seqs": done.seqs,
            "duplicates": done.duplicates,
            "fence": done.fence.0,
            "version": done.version,
        })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("\"{}\"", done.version)) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    Ok(resp)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TwinQuery {
    at_seq: Option<u64>,
    at_hlc: Option<String>,
}

pub(crate) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(t)| t)
        .map_err(|e| ApiError::bad_request("bad_query", e.body_text()))
}

async fn get_twin(
    State(s): State<AppState>,
    Path(twin): Path<String>,
    headers: HeaderMap,
    q: Result<Query<TwinQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let twin = twin_id(twin)?;
    let q = query(q)?;
    let at = match (q.at_seq, q.at_hlc) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "bad_query",
                "give at_seq or at_hlc, not both",
            ))
        }
        (Some(seq), None) => AsOf::Seq(seq),
        (None, Some(h)) => AsOf::Hlc(h.parse().map_err(|e: palisade_core::HlcParseError| {
            ApiError::bad_request("bad_hlc", e.to_string())
        })?),
        (None, None) => AsOf::Latest,
    };
    let view = s.store.twin(&twin, at)?.ok_or_else(|| {
        ApiError::not_found(
            "twin_not_found",
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
    if at == AsOf::Latest
        && headers
            .get(header::IF_NONE_MATCH)
            .and_then(|v| v.to_str().ok())
            == Some(etag.as_str())
    {
        return Ok(StatusCode::NOT_MODIFIED.into_response());
    }
    let hlc: serde_json::Map<String, Value> = view
        .field_hlcs
        .into_iter()
        .map(|(k, h)| (k, Value::String(hlc_text(h))))
        .collect();
    let mut resp = Json(json!({
        "twin_id": view.twin_id.as_str(),
        "partition": view.partition.0,
        "version": view.version,
        "fence": view.fence.0,
        "delta": palisade_twin::delta(&view.state),
        "state": view.state,
        "hlc": hlc,
    }))
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&etag) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    Ok(resp)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PageQuery {
    after: Option<u64>,
    limit: Option<usize>,
}

fn page(events: Vec<palisade_core::Event>) -> Json<Value> {
    let next = events.last().map(|e| e.seq);
    let events: Vec<EventOut> = events.into_iter().map(EventOut::from).collect();
    Json(json!({ "events": events, "next_after": next }))
}

async fn twin_events(
    State(s): State<AppState>,
    Path(twin): Path<String>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let twin = twin_id(twin)?;
    let q = query(q)?;
    let limit = q.limit.unwrap_or(100).clamp(1, s.config.max_page);
    Ok(page(s.store.twin_events(
        &twin,
        q.after.unwrap_or(0),
        limit,
    )?))
}

async fn partition_events(
    State(s): State<AppState>,
    Path(p): Path<String>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let p: u32 = p.parse().map_err(|_| {
        ApiError::bad_request(
            "bad_partition",
            format!("partition must be a number below {}", s.store.partitions()),
        )
    })?;
    let q = query(q)?;
    let limit = q.limit.unwrap_or(100).clamp(1, s.config.max_page);
    Ok(page(s.store.partition_events(
        PartitionId(p),
        q.after.unwrap_or(0),
        limit,
    )?))
}

async fn partitions(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let infos = s.store.partition_infos()?;
    let list: Vec<Value> = infos
        .into_iter()
        .map(|i| {
            json!({
                "partition": i.partition.0,
                "fence": i.fence.0,
                "head": i.head,
                "owner": i.owner.map(|l| {
                    let left = s.store.lease_expires_in(&l);
                    LeaseOut::new(&l, left)
                }),
            })
        })
        .collect();
    Ok(Json(
        json!({ "partitions": list, "last_token": s.store.last_token().0 }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitQuery {
    limit: Option<usize>,
}

/// Recent refused writes (HTTP and Kafka), newest first (bounded, in memory).
async fn rejections(
    State(s): State<AppState>,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let limit = query(q)?
        .limit
        .unwrap_or(100)
        .clamp(1, palisade_log::REJECTION_LOG_LEN);
    let list: Vec<Value> = s
        .store
        .rejections(limit)
        .into_iter()
        .map(|r| {
            json!({
                "at_ms": r.at_ms,
                "source": r.source,
                "partition": r.partition.0,
                "offset": r.offset,
                "twin_id": r.twin.as_str(),
                "token": r.token.0,
                "reason": r.reason,
                "message": r.detail,
            })
        })
        .collect();
    Ok(Json(json!({ "rejections": list })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeadLetterQuery {
    partition: Option<u32>,
    after: Option<u64>,
    limit: Option<usize>,
}

/// Stored dead letters (Kafka records that could not be applied), oldest first.
async fn dead_letters(
    State(s): State<AppState>,
    q: Result<Query<DeadLetterQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let q = query(q)?;
    if let Some(p) = q.partition {
        if p >= s.store.partitions() {
            return Err(ApiError::not_found(
                "unknown_partition",
                format!(
                    "partition {p} does not exist; this store has {}",
                    s.store.partitions()
                ),
            ));
        }
    }
    let limit = q.limit.unwrap_or(100).clamp(1, s.config.max_page);
    let list: Vec<Value> = s
        .store
        .dead_letters(q.partition.map(PartitionId), q.after, limit)?
        .into_iter()
        .map(|d| {
            json!({
                "partition": d.partition,
                "offset": d.offset,
                "key": d.key,
                "reason": d.reason,
                "message": d.detail,
                "headers": d.headers.into_iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
                "value": String::from_utf8_lossy(&d.value),
                "value_len": d.value_len,
                "at_ms": d.at_ms,
            })
        })
        .collect();
    Ok(Json(json!({ "dead_letters": list })))
}
