//! The OpenAPI 3 document of the API, generated from the handlers'
//! `#[utoipa::path]` annotations and the `ToSchema` types of `wire.rs`,
//! served at `GET /v1/openapi.json` (built once). CI checks the running store
//! against it with schemathesis (`scripts/api-fuzz`).
//!
//! The types below only describe bodies for the document: request bodies are
//! parsed by `palisade_core::json` and `wire::LeaseIn`, error bodies are
//! built in `error.rs`.

use std::borrow::Cow;
use std::sync::OnceLock;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{OpenApi, PartialSchema, ToSchema};

use crate::wire;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Palisade HTTP API",
        description = "A digital-twin event store with single-writer partitions and \
            storage-enforced fencing tokens. The contract in prose: docs/http-api.md.\n\n\
            Every error is JSON: `{\"error\": \"<stable name>\", \"message\": \"<for people>\", \
            ...details}`. Besides the statuses listed per operation, the router answers an \
            unknown path with `404 no_such_route` and a known path with an unsupported method \
            with `405 method_not_allowed` (and an `Allow` header).\n\n\
            Authentication is off by default. With principals configured (docs/security.md), \
            every operation except `/`, `/healthz` and `/v1/openapi.json` also answers \
            `401 unauthenticated` without a valid `Authorization: Bearer <api key>`, \
            `403 forbidden` when the principal's roles do not grant the action on the scope, \
            `403 lease_not_yours` / `403 token_not_yours` for another principal's lease or token, \
            and `429 rate_limited` (with `Retry-After`) past the principal's request rate."
    ),
    paths(
        crate::routes::operator_page,
        crate::routes::healthz,
        crate::routes::metrics,
        openapi_json,
        crate::routes::acquire,
        crate::routes::renew,
        crate::routes::release,
        crate::routes::get_twin,
        crate::routes::append,
        crate::routes::twin_events,
        crate::watch::watch_twin,
        crate::routes::partitions,
        crate::routes::partition_events,
        crate::watch::watch_partition,
        crate::routes::rejections,
        crate::routes::dead_letters,
        crate::audit_api::audit,
    ),
    components(schemas(
        EventIn,
        EventsIn,
        wire::LeaseIn,
        ErrorBody,
        wire::EventOut,
        wire::LeaseOut,
    )),
    tags(
        (name = "leases", description = "Leases and the fencing tokens they carry"),
        (name = "events", description = "Appending events and reading twins"),
        (name = "partitions", description = "Partitions, refused writes and dead letters"),
        (name = "operations", description = "Health, metrics, this document, the operator page"),
    )
)]
pub(crate) struct ApiDoc;

/// The document as JSON text, built on first use.
pub(crate) fn document() -> Result<&'static str, &'static str> {
    static DOC: OnceLock<Result<String, String>> = OnceLock::new();
    DOC.get_or_init(|| {
        ApiDoc::openapi()
            .to_pretty_json()
            .map_err(|e| e.to_string())
    })
    .as_deref()
    .map_err(String::as_str)
}

/// This OpenAPI document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "operations",
    responses(
        (status = 200, description = "The OpenAPI 3 document of this API",
            content_type = "application/json", body = Object),
        (status = 500, description = "`openapi` (the document could not be built)", body = ErrorBody),
    )
)]
pub(crate) async fn openapi_json() -> Response {
    match document() {
        Ok(doc) => ([(header::CONTENT_TYPE, "application/json")], doc).into_response(),
        Err(e) => crate::ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "openapi",
            format!("the OpenAPI document could not be built: {e}"),
        )
        .into_response(),
    }
}

/// One event to append.
// `Deserialize` only for `deny_unknown_fields`, which the document then shows
// as `additionalProperties: false`, as the parser behaves.
#[allow(dead_code)] // schema only: parsed by `palisade_core::json`
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(examples(
    json!({"type": "reading", "patch": {"reported": {"temp": 21.5}}}),
    json!({"type": "config", "patch": {"desired": {"fan": "on"}}, "event_id": "cfg-42"}),
))]
pub(crate) struct EventIn {
    /// The event's type, 1..128 bytes.
    #[serde(rename = "type")]
    #[schema(min_length = 1, max_length = 128)]
    event_type: String,
    /// A JSON merge patch (RFC 7396) applied to the twin's state; nested at most 32 deep.
    #[schema(value_type = Object)]
    patch: serde_json::Value,
    /// Hybrid logical clock of the event, `<ntp64>/<hex id>`; the store's if absent.
    #[schema(pattern = "^[0-9]{1,20}/[0-9a-fA-F]*[1-9a-fA-F][0-9a-fA-F]*$")]
    hlc: Option<String>,
    /// 1..128 bytes; a retry with an id already stored for the twin is
    /// acknowledged with the original seq, not appended twice. Random if absent.
    #[schema(min_length = 1, max_length = 128)]
    event_id: Option<String>,
}

/// The append body: one event object, or an array of 1 to `max_batch_events`
/// (default 1000) of them, appended all or none.
pub(crate) struct EventsIn;

impl PartialSchema for EventsIn {
    fn schema() -> RefOr<Schema> {
        let one = Ref::from_schema_name("EventIn");
        OneOfBuilder::new()
            .item(one.clone())
            .item(ArrayBuilder::new().items(one).min_items(Some(1)))
            .description(Some(
                "One event object or an array of 1 to `max_batch_events` (default 1000) of them.",
            ))
            .into()
    }
}

impl ToSchema for EventsIn {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("EventsIn")
    }
}

/// Every error: a stable name, a message for people, and per error some
/// details (further properties).
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct ErrorBody {
    /// Stable name of the error, e.g. `bad_json`.
    error: String,
    /// For people.
    message: String,
    /// On a `500`: the id under which the store logged the cause (the body
    /// carries no OS or storage error text).
    incident: Option<String>,
}

/// `409 stale_token`: a later grant covering this twin was seen.
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct StaleTokenError {
    /// `stale_token`.
    error: String,
    message: String,
    /// The token of the request.
    token: u64,
    /// The fence it is below.
    fence: u64,
}

/// `403`: `token_not_issued` or `token_scope_mismatch`.
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct TokenRefusedError {
    /// `token_not_issued` or `token_scope_mismatch`.
    error: String,
    message: String,
    token: u64,
    /// `token_scope_mismatch` only: the scope the token was issued for.
    #[schema(required = false, nullable = false)]
    scope: Option<String>,
}

/// `412 version_mismatch`: `If-Match` does not name the twin's version; or
/// `412 weak_if_match`: `If-Match` is a weak tag (`W/"12"`), which never
/// matches under the strong comparison an append needs (no `expected`,
/// `current`).
#[allow(dead_code)] // schema only: built in `error.rs` and `routes.rs`
#[derive(ToSchema)]
pub(crate) struct VersionMismatchError {
    /// `version_mismatch` or `weak_if_match`.
    error: String,
    message: String,
    /// The version in `If-Match` (`version_mismatch` only).
    expected: Option<u64>,
    /// The twin's version (`version_mismatch` only).
    current: Option<u64>,
}

/// `422 clock_drift`: the event's HLC is too far ahead of the store's clock.
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct ClockDriftError {
    /// `clock_drift`.
    error: String,
    message: String,
    hlc: String,
    ahead_ms: u64,
    max_drift_ms: u64,
}

/// `409 lease_held`: another holder's lease on the scope is live.
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct LeaseHeldError {
    /// `lease_held`.
    error: String,
    message: String,
    scope: String,
    holder: String,
    token: u64,
    expires_in_ms: u64,
}

/// `410`: `lease_expired`, `lease_superseded` or `lease_released`.
#[allow(dead_code)] // schema only: built in `error.rs`
#[derive(ToSchema)]
pub(crate) struct LeaseGoneError {
    /// `lease_expired`, `lease_superseded` or `lease_released`.
    error: String,
    message: String,
    /// `lease_superseded` only: the token of the grant that superseded it.
    #[schema(required = false, nullable = false)]
    by_token: Option<u64>,
}
