//! Live change streams as Server-Sent Events: one SSE event per appended
//! event, `id` = its partition sequence number, resumable with
//! `Last-Event-ID`. The writer only publishes its durable head; the stream
//! always reads the events after the last one it sent from the log, so a
//! reconnect or a missed wake-up can neither skip nor repeat an event.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use palisade_core::{Event, PartitionId, TwinId};
use palisade_log::Store;
use serde::Deserialize;

use crate::error::ApiError;
use crate::routes::AppState;
use crate::wire::EventOut;

/// Events read from the log per wake-up.
const PAGE: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
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
                    "bad_last_event_id",
                    "Last-Event-ID must be a sequence number",
                )
            }),
        None => Ok(q.after.unwrap_or(head)),
    }
}

fn stream_of(cursor: Cursor) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(cursor, |mut c| async move {
        loop {
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
                Source::Twin(t) => c.store.twin_events(t, c.last, PAGE),
                Source::Partition(p) => c.store.partition_events(*p, c.last, PAGE),
            };
            match page {
                Ok(events) if !events.is_empty() => c.buf.extend(events),
                Ok(_) => {
                    if c.head.changed().await.is_err() {
                        return None; // the store is shutting down
                    }
                }
                Err(e) => {
                    let msg = serde_json::json!({ "error": "storage", "message": e.to_string() })
                        .to_string();
                    tracing::warn!(error = %e, "change stream read failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    return Some((Ok(SseEvent::default().event("error").data(msg)), c));
                }
            }
        }
    })
}

fn sse(cursor: Cursor) -> Response {
    Sse::new(stream_of(cursor))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

pub(crate) async fn watch_twin(
    State(s): State<AppState>,
    Path(twin): Path<String>,
    headers: HeaderMap,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = crate::routes::query(q)?;
    let twin =
        TwinId::new(twin).map_err(|e| ApiError::bad_request("bad_twin_id", e.to_string()))?;
    let p = s.store.partition_of(&twin);
    let head = s
        .store
        .watch_head(p)
        .ok_or_else(|| ApiError::not_found("unknown_partition", "no such partition"))?;
    let last = start_after(&headers, &q, *head.borrow())?;
    Ok(sse(Cursor {
        store: s.store.clone(),
        source: Source::Twin(twin),
        head,
        last,
        buf: VecDeque::new(),
    }))
}

pub(crate) async fn watch_partition(
    State(s): State<AppState>,
    Path(p): Path<String>,
    headers: HeaderMap,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = crate::routes::query(q)?;
    let p: u32 = p
        .parse()
        .map_err(|_| ApiError::bad_request("bad_partition", "partition must be a number"))?;
    let head = s.store.watch_head(PartitionId(p)).ok_or_else(|| {
        ApiError::not_found(
            "unknown_partition",
            format!(
                "partition {p} does not exist; this store has {}",
                s.store.partitions()
            ),
        )
    })?;
    let last = start_after(&headers, &q, *head.borrow())?;
    Ok(sse(Cursor {
        store: s.store.clone(),
        source: Source::Partition(PartitionId(p)),
        head,
        last,
        buf: VecDeque::new(),
    }))
}
