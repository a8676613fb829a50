//! `GET /v1/audit`: the audit log, oldest first, for principals with
//! `admin` on `admin/audit`.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;
use utoipa::IntoParams;

use palisade_auth::{Action, Resource};
use palisade_log::AuditAction;

use crate::caller::Caller;
use crate::error::ApiError;
use crate::routes::{query, AppState};
use crate::wire::{AuditOut, AuditResponse, ErrorBody};

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct AuditQuery {
    /// Records with a seq above this (default 0: from the oldest kept).
    after: Option<u64>,
    /// At most this many (default 100, at least 1, at most 1000; larger
    /// values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
}

/// The audit log of lease operations and refused requests, oldest first.
#[utoipa::path(
    get,
    path = "/v1/audit",
    tag = "operations",
    params(AuditQuery),
    responses(
        (status = 200, description = "Audit records, oldest first", body = AuditResponse),
        (status = 400, description = "`bad_query`", body = ErrorBody),
        (status = 401, description = "`unauthenticated` (authentication on)", body = ErrorBody),
        (status = 403, description = "`forbidden`: needs `admin` on `admin/audit`", body = ErrorBody),
        (status = 500, description = "`storage`", body = ErrorBody),
    )
)]
pub(crate) async fn audit(
    State(s): State<AppState>,
    caller: Caller,
    q: Result<Query<AuditQuery>, QueryRejection>,
) -> Result<Json<AuditResponse>, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Admin, &Resource::Admin("audit".into()))?;
    let q = query(q)?;
    let limit = crate::routes::page_limit(q.limit, 100, s.config.max_page)?;
    let records: Vec<AuditOut> = s
        .store
        .audit()
        .list(q.after.unwrap_or(0), limit)
        .await?
        .into_iter()
        .map(|r| AuditOut {
            seq: r.seq,
            at_ms: r.at_ms,
            action: r.action.name().to_owned(),
            outcome: r.outcome.name().to_owned(),
            principal: r.principal,
            scope: r.scope,
            token: r.token,
            lease_id: if r.lease_id == 0 {
                String::new()
            } else {
                format!("{:032x}", r.lease_id)
            },
            detail: r.detail,
        })
        .collect();
    Ok(Json(AuditResponse {
        next_after: records.last().map(|r| r.seq),
        records,
    }))
}
