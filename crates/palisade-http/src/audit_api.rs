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
use crate::wire::{AuditOut, AuditResponse, ClusterAuditResponse, ErrorBody, NodeAuditOut};

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
    Ok(Json(page(&s.store, q.after.unwrap_or(0), limit).await?))
}

/// This store's audit records after `after`, at most `limit`.
pub(crate) async fn page(
    store: &palisade_log::Store,
    after: u64,
    limit: usize,
) -> Result<AuditResponse, ApiError> {
    let records: Vec<AuditOut> = store
        .audit()
        .list(after, limit)
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
    Ok(AuditResponse {
        next_after: records.last().map(|r| r.seq),
        records,
    })
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ClusterAuditQuery {
    /// The cursor of the previous page: `node:seq` per node, comma
    /// separated (a node not named: from its oldest record kept).
    after: Option<String>,
    /// At most this many per node (default 100, at least 1, at most 1000;
    /// larger values are clamped).
    #[param(minimum = 1)]
    limit: Option<usize>,
}

/// Every node's audit log, read through any node: the answering node asks
/// every node of the cluster (the members registered in etcd, and the
/// owners of partitions) for its records after the cursor, with the
/// caller's key. A node that does not answer is listed
/// `unreachable`, never left out silently. On a single node: its own, as
/// node `local`.
#[utoipa::path(
    get,
    path = "/v1/cluster/audit",
    tag = "operations",
    params(ClusterAuditQuery),
    responses(
        (status = 200, description = "Each node's audit records, oldest first", body = ClusterAuditResponse),
        (status = 400, description = "`bad_query` (a cursor that is not `node:seq,...`)", body = ErrorBody),
        (status = 401, description = "`unauthenticated` (authentication on)", body = ErrorBody),
        (status = 403, description = "`forbidden`: needs `admin` on `admin/audit`", body = ErrorBody),
        (status = 503, description = "`lease_authority_unavailable` (cluster mode: etcd's owner keys cannot be read)", body = ErrorBody),
    )
)]
pub(crate) async fn cluster_audit(
    State(s): State<AppState>,
    caller: Caller,
    headers: axum::http::HeaderMap,
    q: Result<Query<ClusterAuditQuery>, QueryRejection>,
) -> Result<Json<ClusterAuditResponse>, ApiError> {
    caller
        .admit(AuditAction::Admin)?
        .authorize(Action::Admin, &Resource::Admin("audit".into()))?;
    let q = query(q)?;
    let limit = crate::routes::page_limit(q.limit, 100, s.config.max_page)?;
    let cursor = parse_cursor(q.after.as_deref().unwrap_or(""))?;
    let nodes = match s.config.cluster.as_deref() {
        Some(c) => {
            crate::views::audits(
                c,
                &s.store,
                &cursor,
                limit,
                headers.get(axum::http::header::AUTHORIZATION),
            )
            .await?
        }
        None => {
            let after = cursor.get("local").copied().unwrap_or(0);
            let p = page(&s.store, after, limit).await?;
            vec![NodeAuditOut {
                node: "local".into(),
                status: "ok".into(),
                error: None,
                next_after: p.next_after,
                records: p.records,
            }]
        }
    };
    let next_after = nodes
        .iter()
        .filter_map(|n| {
            n.next_after
                .or_else(|| cursor.get(&n.node).copied())
                .map(|s| format!("{}:{s}", n.node))
        })
        .collect::<Vec<_>>()
        .join(",");
    Ok(Json(ClusterAuditResponse { nodes, next_after }))
}

/// `node:seq,node:seq` (empty: nothing read yet).
fn parse_cursor(text: &str) -> Result<std::collections::BTreeMap<String, u64>, ApiError> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (node, seq) = p.rsplit_once(':').ok_or_else(|| bad_cursor(p))?;
            let seq = seq.trim().parse::<u64>().map_err(|_| bad_cursor(p))?;
            Ok((node.trim().to_owned(), seq))
        })
        .collect()
}

fn bad_cursor(part: &str) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::BAD_REQUEST,
        crate::wire::ErrorName::BadQuery,
        format!("after: {part:?} is not node:seq (the cursor is node:seq,node:seq,...)"),
    )
}
