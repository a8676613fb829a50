//! Cluster mode (docs/decisions/0012-cluster-mode.md): a request for a twin
//! whose partition another node owns is redirected there (`307`, so an
//! append keeps its method and body), and every twin response names the
//! node that answered it in `Palisade-Owner`.

use std::fmt::Debug;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use palisade_core::{BoxFuture, TwinId};

use crate::ApiError;

/// Header naming the node that owns (and answered for) a twin's partition.
pub const OWNER_HEADER: &str = "palisade-owner";

/// Where a partition is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Here, by this node.
    Local { node: String },
    /// By another node, reachable at `url` (scheme://host:port).
    Elsewhere { node: String, url: String },
    /// Nowhere right now (a takeover or a rebuild in progress).
    Unavailable { reason: String },
}

/// A node as a partition's owner key names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub node: String,
    /// Where it is reached (scheme://host:port).
    pub url: String,
}

/// This node's own hold on a partition (the local view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The owner token it holds the partition under, while its owner lease
    /// is live by its own clock.
    pub owner_token: Option<u64>,
    /// Whether it serves the partition (caught up since its takeover).
    pub serving: bool,
}

/// The node's view of partition ownership.
pub trait ClusterRouting: Send + Sync + Debug {
    fn route(&self, partition: u32) -> BoxFuture<'_, Route>;
    /// This node's id.
    fn node(&self) -> String;
    /// This node's hold on `partition`.
    fn holding(&self, partition: u32) -> Holding;
    /// Every partition's owner as etcd names it, by partition (`None`: no
    /// node holds its owner lease); `Err` if etcd cannot be read.
    fn owners(&self, partitions: u32) -> BoxFuture<'_, Result<Vec<Option<Peer>>, String>>;
    /// Every live node of the cluster, owner of a partition or not (the
    /// nodes registered in etcd); none known by default.
    fn members(&self) -> BoxFuture<'_, Result<Vec<Peer>, String>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// `GET path_and_query` on `peer` with the caller's `authorization`
    /// (the peer checks the caller itself), bounded in time: its `200`
    /// body, or why not (no answer in time, another status, not JSON).
    fn ask(
        &self,
        peer: Peer,
        path_and_query: String,
        authorization: Option<axum::http::HeaderValue>,
    ) -> BoxFuture<'_, Result<Vec<u8>, String>>;
}

#[derive(Clone)]
struct Routing {
    routing: Arc<dyn ClusterRouting>,
    partitions: u32,
}

/// Put the redirect in front of `app`.
pub(crate) fn layer(app: Router, routing: Arc<dyn ClusterRouting>, partitions: u32) -> Router {
    app.layer(axum::middleware::from_fn_with_state(
        Routing {
            routing,
            partitions,
        },
        redirect,
    ))
}

/// The twin id of a `/v1/twins/{id}...` path, percent-decoded.
fn twin_of(path: &str) -> Option<TwinId> {
    let rest = path.strip_prefix("/v1/twins/")?;
    let seg = rest.split('/').next()?;
    TwinId::new(percent_decode(seg)?).ok()
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

async fn redirect(State(r): State<Routing>, req: Request, next: Next) -> Response {
    let Some(twin) = twin_of(req.uri().path()) else {
        return next.run(req).await;
    };
    let p = palisade_core::partition_for(&twin, r.partitions);
    match r.routing.route(p.0).await {
        Route::Local { node } => {
            let mut resp = next.run(req).await;
            if let Ok(v) = HeaderValue::from_str(&node) {
                resp.headers_mut().insert(OWNER_HEADER, v);
            }
            resp
        }
        Route::Elsewhere { node, url } => {
            let target = format!(
                "{}{}",
                url.trim_end_matches('/'),
                req.uri()
                    .path_and_query()
                    .map_or(req.uri().path(), axum::http::uri::PathAndQuery::as_str)
            );
            let body = axum::Json(serde_json::json!({
                "error": "not_owner",
                "message": format!("partition {} of twin {twin} is served by node {node}", p.0),
                "owner": node,
                "location": target,
            }));
            let mut resp = (StatusCode::TEMPORARY_REDIRECT, body).into_response();
            if let Ok(v) = HeaderValue::from_str(&target) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            if let Ok(v) = HeaderValue::from_str(&node) {
                resp.headers_mut().insert(OWNER_HEADER, v);
            }
            resp
        }
        Route::Unavailable { reason } => {
            let mut resp = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_serving",
                format!(
                    "partition {} of twin {twin} is not served right now: {reason}; retry",
                    p.0
                ),
            )
            .into_response();
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twin_paths_are_recognised_and_decoded() {
        assert_eq!(
            twin_of("/v1/twins/pump-7").map(|t| t.to_string()),
            Some("pump-7".into())
        );
        assert_eq!(
            twin_of("/v1/twins/a%2Fb/events").map(|t| t.to_string()),
            Some("a/b".into())
        );
        assert_eq!(twin_of("/v1/partitions"), None);
        assert_eq!(twin_of("/v1/twins/%zz"), None);
    }
}
