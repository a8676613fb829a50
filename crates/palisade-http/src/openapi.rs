//! The OpenAPI 3 document of the API, generated from the handlers'
//! `#[utoipa::path]` annotations and the `ToSchema` wire types of
//! `palisade-api` (its `openapi` feature), served at `GET /v1/openapi.json`
//! (built once). CI checks the running store against it with schemathesis
//! (`scripts/api-fuzz`).
//!
//! Their doc comments are the document's descriptions. Request bodies are
//! parsed by `palisade_core::json` and `wire::LeaseIn`; error bodies are
//! built in `error.rs`; `EventsIn` below only describes the append body.

use std::borrow::Cow;
use std::sync::OnceLock;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
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
        crate::routes::lease_advice,
        crate::routes::get_twin,
        crate::routes::append,
        crate::routes::twin_events,
        crate::watch::watch_twin,
        crate::routes::partitions,
        crate::routes::partition_events,
        crate::watch::watch_partition,
        crate::routes::rejections,
        crate::routes::twin_refusals,
        crate::routes::partition_refusals,
        crate::routes::dead_letters,
        crate::routes::outbox,
        crate::routes::remove_dead_effect,
        crate::audit_api::audit,
        crate::audit_api::cluster_audit,
        crate::backup_api::backup,
    ),
    components(schemas(
        wire::EventIn,
        EventsIn,
        wire::LeaseIn,
        wire::ErrorBody,
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
        (status = 500, description = "`openapi` (the document could not be built)", body = wire::ErrorBody),
    )
)]
pub(crate) async fn openapi_json() -> Response {
    match document() {
        Ok(doc) => ([(header::CONTENT_TYPE, "application/json")], doc).into_response(),
        Err(e) => crate::ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            wire::ErrorName::Openapi,
            format!("the OpenAPI document could not be built: {e}"),
        )
        .into_response(),
    }
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
