//! `POST /v1/admin/backup`: an online backup of the store, streamed to the
//! caller (`palisade backup --to DIR` writes it into a folder), for
//! principals with `admin` on `admin/backup`. The server writes nothing to
//! its own disk: the backup lands where the operator runs the command, and
//! the API names no server path. Frames and files: `docs/backup.md`.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use palisade_auth::{Action, Resource};
use palisade_log::backup::{encode_frame, frame};
use palisade_log::AuditAction;

use crate::caller::Caller;
use crate::error::ApiError;
use crate::routes::AppState;
use crate::wire::ErrorBody;

/// Frames buffered between the backup thread and the connection.
const QUEUE: usize = 8;

/// Take an online backup, streamed as frames.
///
/// Writes are held only while the keys that change in place are read into
/// memory (the manifest's `info.pause_us`); then the append-only keys are
/// copied while writes flow. The body is a sequence of frames
/// `kind:u8 ++ len:u32 BE ++ bytes`: `1` data, `4` progress, then `2` the
/// manifest (complete) or `3` an error message. A body without a manifest
/// frame is an incomplete backup.
#[utoipa::path(
    post,
    path = "/v1/admin/backup",
    tag = "operations",
    responses(
        (status = 200, description = "The backup as frames (docs/backup.md)", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 401, description = "`unauthenticated` (authentication on)", body = ErrorBody),
        (status = 403, description = "`forbidden`: needs `admin` on `admin/backup`", body = ErrorBody),
    )
)]
pub(crate) async fn backup(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Admin, &Resource::Admin("backup".into()))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(QUEUE);
    let store = s.store.clone();
    tokio::task::spawn_blocking(move || {
        let mut send = |kind: u8, b: &[u8]| {
            tx.blocking_send(Bytes::from(encode_frame(kind, b)))
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        };
        if let Err(e) = store.backup(&mut send) {
            tracing::warn!(error = %e, "backup failed");
            let _ = send(frame::ERROR, e.to_string().as_bytes());
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|b| b.map(Ok::<_, std::convert::Infallible>))
    });
    let mut r = Body::from_stream(stream).into_response();
    *r.status_mut() = StatusCode::OK;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(r)
}
