//! Live change streams as Server-Sent Events: one SSE event per appended
//! event, `id` = its partition sequence number, resumable with
//! `Last-Event-ID`. The writer only publishes its durable head; the stream
//! always reads the events after the last one it sent from the log, so a
//! reconnect or a missed wake-up can neither skip nor repeat an event.

use palisade_auth::{Action, Resource};
use palisade_log::AuditAction;

use crate::caller::Caller;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use palisade_core::{Event, PartitionId, TwinId};
use palisade_log::Store;
use serde::Deserialize;
use utoipa::IntoParams;

use crate::error::ApiError;
use crate::routes::{AppState, PartitionPath, TwinPath};
use crate::wire::{ErrorBody, ErrorName, EventOut};

/// Events read from the log per wake-up.
const PAGE: usize = 256;

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct WatchQuery {
    /// Start after this sequence number (0: from the beginning). Without it
    /// (and without `Last-Event-ID`) the stream starts at the current head.
    after: Option<u64>,
}

#[derive(Clone)]
enum Source {
    Twin(TwinId),
    Partition(PartitionId),
}

struct Cursor {
    store: Arc<Store>,
    source: Source,
    head: tokio::sync::watch::Receiver<u64>,
    closing: tokio::sync::watch::Receiver<bool>,
    last: u64,
    buf: VecDeque<Event>,
}

fn start_after(headers: &HeaderMap, q: &WatchQuery, head: u64) -> Result<u64, ApiError> {
    match headers.get("last-event-id") {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::bad_request(
                    ErrorName::BadLastEventId,
                    "Last-Event-ID must be a sequence number",
                )
            }),
        None => Ok(q.after.unwrap_or(head)),
    }
}

fn stream_of(cursor: Cursor) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(cursor, |mut c| async move {
        loop {
            if *c.closing.borrow() {
                return None;
            }
            if let Some(ev) = c.buf.pop_front() {
                c.last = ev.seq;
                let id = ev.seq.to_string();
                let data = serde_json::to_string(&EventOut::from(ev)).unwrap_or_default();
                return Some((Ok(SseEvent::default().id(id).event("event").data(data)), c));
            }
            // Mark the current head seen *before* reading, so an append that
            // lands during the read still wakes us.
            c.head.borrow_and_update();
            let page = match &c.source {
                Source::Twin(t) => c.store.twin_events_async(t, c.last, PAGE).await,
                Source::Partition(p) => c.store.partition_events_async(*p, c.last, PAGE).await,
            };
            match page {
                Ok(events) if !events.is_empty() => c.buf.extend(events),
                Ok(_) => {
                    tokio::select! {
                        changed = c.head.changed() => if changed.is_err() {
                            return None; // the store is closed
                        },
                        _ = c.closing.wait_for(|closing| *closing) => return None, // server shutdown
                    }
                }
                Err(e) => {
                    // As for a 500: the cause (sled's or the OS's words) is
                    // logged, the client gets the name and an incident id.
                    let incident = crate::error::incident_id();
                    let name = ErrorName::Storage;
                    let body = ErrorBody {
                        error: name.to_string(),
                        message: crate::error::internal_message(name.as_str(), &incident),
                        incident: Some(incident.clone()),
                    };
                    // Through a `Value`, whose keys are sorted: the order
                    // this frame has always had.
                    let msg = serde_json::to_value(body)
                        .map(|v| v.to_string())
                        .unwrap_or_default();
                    tracing::warn!(error = %e, incident = %incident, "change stream read failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    return Some((Ok(SseEvent::default().event("error").data(msg)), c));
                }
            }
        }
    })
}

/// Open a stream over `source`, starting after `Last-Event-ID`, `after`, or
/// the partition's current head, in that order of precedence.
fn open_stream(
    s: &AppState,
    source: Source,
    p: PartitionId,
    headers: &HeaderMap,
    q: &WatchQuery,
) -> Result<Response, ApiError> {
    let head = s.store.watch_head(p).ok_or_else(|| {
        ApiError::not_found(
            ErrorName::UnknownPartition,
            format!(
                "partition {p} does not exist; this store has {}",
                s.store.partitions()
            ),
        )
    })?;
    let last = start_after(headers, q, *head.borrow())?;
    let cursor = Cursor {
        store: s.store.clone(),
        source,
        head,
        closing: s.closing.clone(),
        last,
        buf: VecDeque::new(),
    };
    Ok(Sse::new(stream_of(cursor))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// A twin's appended events, live, as Server-Sent Events.
#[utoipa::path(
    get,
    path = "/v1/twins/{twin_id}/watch",
    tag = "events",
    params(
        TwinPath,
        ("Last-Event-ID" = Option<u64>, Header, nullable = false, description = "Resume right after this seq (wins over `after`)"),
        WatchQuery,
    ),
    responses(
        (status = 200, description = "An endless SSE stream: per event `id: <seq>`, `event: event`, \
            `data: <EventOut JSON>`; `event: error` if a read fails; keep-alive comments every 15 s",
            content_type = "text/event-stream", body = String),
        (status = 400, description = "`bad_twin_id`, `bad_query`, `bad_last_event_id`", body = ErrorBody),
        (status = 404, description = "`unknown_partition`", body = ErrorBody),
    )
)]
pub(crate) async fn watch_twin(
    State(s): State<AppState>,
    caller: Caller,
    twin: Result<Path<TwinPath>, PathRejection>,
    headers: HeaderMap,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let twin = crate::routes::twin_id(twin);
    if let Ok(t) = &twin {
        let resource = call.twin(t);
        call.authorize(Action::Read, &resource)?;
    }
    let q = crate::routes::query(q)?;
    let twin = twin?;
    let p = s.store.partition_of(&twin);
    open_stream(&s, Source::Twin(twin), p, &headers, &q)
}

/// A partition's appended events, live, as Server-Sent Events.
#[utoipa::path(
    get,
    path = "/v1/partitions/{partition}/watch",
    tag = "partitions",
    params(
        PartitionPath,
        ("Last-Event-ID" = Option<u64>, Header, nullable = false, description = "Resume right after this seq (wins over `after`)"),
        WatchQuery,
    ),
    responses(
        (status = 200, description = "An endless SSE stream, as for a twin's watch",
            content_type = "text/event-stream", body = String),
        (status = 400, description = "`bad_partition`, `bad_query`, `bad_last_event_id`", body = ErrorBody),
        (status = 404, description = "`unknown_partition`", body = ErrorBody),
    )
)]
pub(crate) async fn watch_partition(
    State(s): State<AppState>,
    caller: Caller,
    p: Result<Path<PartitionPath>, PathRejection>,
    headers: HeaderMap,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let mut call = caller.admit(AuditAction::Read)?;
    let p = crate::routes::partition(p);
    if let Ok(Some(n)) = &p {
        call.authorize(Action::Read, &Resource::Partition(PartitionId(*n)))?;
    }
    let q = crate::routes::query(q)?;
    let p = p?.ok_or_else(|| {
        ApiError::bad_request(ErrorName::BadPartition, "partition must be a number")
    })?;
    open_stream(
        &s,
        Source::Partition(PartitionId(p)),
        PartitionId(p),
        &headers,
        &q,
    )
}
