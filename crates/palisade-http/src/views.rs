//! Cluster mode's cluster-wide views (issue 16, docs/decisions/0033-cluster-views.md):
//! `GET /v1/partitions` and `GET /v1/dead-letters` answered by any node
//! for every partition. The answering node reads every partition's owner
//! from etcd, asks each owner for its own view (`?scope=local`, which never
//! asks further) and merges; a partition whose owner did not answer in
//! time is marked `unreachable`, one no node owns `unowned`, never left
//! out. A view, not a snapshot: each owner answers at its own moment, and
//! ownership may move while the answers are gathered.

use axum::http::HeaderValue;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::http::StatusCode;
use futures_util::future::join_all;
use palisade_log::Store;

use crate::cluster::{ClusterRouting, Peer};
use crate::error::ApiError;
use crate::wire::{
    ClusterPartitionOut, DeadLettersResponse, ErrorName, MissingPartitionOut, PartitionOut,
    PartitionsResponse,
};

/// This node's own hold on partition `p`, as `scope=local` shows it.
pub(crate) fn holding_out(c: &dyn ClusterRouting, store: &Store, p: u32) -> ClusterPartitionOut {
    let h = c.holding(p);
    let held = h.owner_token.is_some();
    ClusterPartitionOut {
        error: None,
        // The last measurement of the consumer's lag reporter (every 5 s).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        lag: held.then(|| {
            store
                .metrics()
                .value("palisade_kafka_lag", &[("partition", &p.to_string())]) as u64
        }),
        node: held.then(|| c.node()),
        owner_token: h.owner_token,
        serving: h.serving,
        status: match (held, h.serving) {
            (true, true) => "serving",
            (true, false) => "rebuilding",
            (false, _) => "elsewhere",
        }
        .into(),
    }
}

fn owners_unavailable(e: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorName::LeaseAuthorityUnavailable,
        format!("the cluster view needs the partitions' owners from etcd, which cannot be read: {e}; ask a node for its own view with ?scope=local"),
    )
}

/// A partition whose owner's view is not in the answer.
fn unknown(
    partition: u32,
    node: Option<String>,
    status: &str,
    error: Option<String>,
) -> PartitionOut {
    PartitionOut {
        cluster: Some(ClusterPartitionOut {
            error,
            lag: None,
            node,
            owner_token: None,
            serving: false,
            status: status.into(),
        }),
        fence: 0,
        head: 0,
        owner: None,
        partition,
    }
}

/// `GET /v1/partitions` for the whole cluster: `local` is this node's own
/// view (used for the partitions it owns).
pub(crate) async fn partitions(
    c: &dyn ClusterRouting,
    n: u32,
    local: PartitionsResponse,
    authorization: Option<&HeaderValue>,
) -> Result<PartitionsResponse, ApiError> {
    let owners = c.owners(n).await.map_err(|e| owners_unavailable(&e))?;
    let me = c.node();
    // One request per other owner, all at once, each bounded in time.
    let peers: BTreeMap<String, Peer> = owners
        .iter()
        .flatten()
        .filter(|p| p.node != me)
        .map(|p| (p.node.clone(), p.clone()))
        .collect();
    let answers: HashMap<String, Result<PartitionsResponse, String>> =
        join_all(peers.into_values().map(|peer| async move {
            let node = peer.node.clone();
            let r = c
                .ask(
                    peer,
                    "/v1/partitions?scope=local".into(),
                    authorization.cloned(),
                )
                .await
                .and_then(|b| {
                    serde_json::from_slice::<PartitionsResponse>(&b)
                        .map_err(|e| format!("not a partitions answer: {e}"))
                });
            (node, r)
        }))
        .await
        .into_iter()
        .collect();
    let last_token = answers
        .values()
        .flatten()
        .map(|a| a.last_token)
        .fold(local.last_token, u64::max);
    let from = |view: &PartitionsResponse, p: u32, node: &str| -> PartitionOut {
        match view.partitions.iter().find(|o| o.partition == p) {
            Some(o) if o.cluster.as_ref().is_some_and(|c| c.owner_token.is_some()) => o.clone(),
            // The node etcd names does not hold it (any more, or yet).
            _ => unknown(p, Some(node.to_owned()), "moving", None),
        }
    };
    let partitions = (0..n)
        .map(|p| match owners.get(p as usize).cloned().flatten() {
            None => unknown(p, None, "unowned", None),
            Some(peer) if peer.node == me => from(&local, p, &me),
            Some(peer) => match answers.get(&peer.node) {
                Some(Ok(view)) => from(view, p, &peer.node),
                Some(Err(e)) => unknown(p, Some(peer.node), "unreachable", Some(e.clone())),
                None => unknown(p, Some(peer.node), "unreachable", None),
            },
        })
        .collect();
    Ok(PartitionsResponse {
        last_token,
        partitions,
    })
}

/// `GET /v1/dead-letters` for the whole cluster (or one partition): each
/// partition's from its owner, in partition order, at most `limit`.
pub(crate) async fn dead_letters(
    c: &dyn ClusterRouting,
    store: &Arc<Store>,
    partition: Option<u32>,
    after: Option<u64>,
    limit: usize,
    authorization: Option<&HeaderValue>,
) -> Result<DeadLettersResponse, ApiError> {
    let n = store.partitions();
    let wanted: Vec<u32> = match partition {
        // The topic has exactly the store's partitions in cluster mode.
        Some(p) if p >= n => Vec::new(),
        Some(p) => vec![p],
        None => (0..n).collect(),
    };
    if wanted.is_empty() {
        return Ok(DeadLettersResponse {
            dead_letters: Vec::new(),
            missing: Vec::new(),
        });
    }
    let owners = c.owners(n).await.map_err(|e| owners_unavailable(&e))?;
    let me = c.node();
    let after_q = after.map(|a| format!("&after={a}")).unwrap_or_default();
    let parts = join_all(wanted.into_iter().map(|p| {
        let owner = owners.get(p as usize).cloned().flatten();
        let me = me.clone();
        let after_q = after_q.clone();
        async move {
            let r = match owner {
                None => Err(MissingPartitionOut {
                    error: "no node owns the partition right now (a rebalance or takeover)".into(),
                    node: None,
                    partition: p,
                    status: "unowned".into(),
                }),
                Some(peer) if peer.node == me => store
                    .dead_letters_async(Some(p), after, limit)
                    .await
                    .map(|d| d.into_iter().map(crate::routes::dead_letter_out).collect())
                    .map_err(|e| MissingPartitionOut {
                        error: e.to_string(),
                        node: Some(me.clone()),
                        partition: p,
                        status: "unreachable".into(),
                    }),
                Some(peer) => {
                    let node = peer.node.clone();
                    c.ask(
                        peer,
                        format!(
                            "/v1/dead-letters?scope=local&partition={p}&limit={limit}{after_q}"
                        ),
                        authorization.cloned(),
                    )
                    .await
                    .and_then(|b| {
                        serde_json::from_slice::<DeadLettersResponse>(&b)
                            .map_err(|e| format!("not a dead-letters answer: {e}"))
                    })
                    .map(|r| r.dead_letters)
                    .map_err(|error| MissingPartitionOut {
                        error,
                        node: Some(node),
                        partition: p,
                        status: "unreachable".into(),
                    })
                }
            };
            r
        }
    }))
    .await;
    let mut dead_letters = Vec::new();
    let mut missing = Vec::new();
    for r in parts {
        match r {
            Ok(d) => dead_letters.extend(d),
            Err(m) => missing.push(m),
        }
    }
    dead_letters.truncate(limit);
    Ok(DeadLettersResponse {
        dead_letters,
        missing,
    })
}

/// Every node's audit page after its cursor (`GET /v1/cluster/audit`):
/// every live member of the cluster (registered in etcd, owner of a
/// partition or not), the owners of partitions, and this one; each asked at
/// once with the caller's key, bounded in time; one that does not answer is
/// listed `unreachable`.
pub(crate) async fn audits(
    c: &dyn ClusterRouting,
    store: &Arc<Store>,
    cursor: &BTreeMap<String, u64>,
    limit: usize,
    authorization: Option<&HeaderValue>,
) -> Result<Vec<crate::wire::NodeAuditOut>, ApiError> {
    use crate::wire::{AuditResponse, NodeAuditOut};
    let owners = c
        .owners(store.partitions())
        .await
        .map_err(|e| owners_unavailable(&e))?;
    let members = c.members().await.map_err(|e| owners_unavailable(&e))?;
    let me = c.node();
    let mut peers: BTreeMap<String, Option<Peer>> = owners
        .into_iter()
        .flatten()
        .chain(members)
        .filter(|p| p.node != me)
        .map(|p| (p.node.clone(), Some(p)))
        .collect();
    peers.insert(me.clone(), None);
    let answers = join_all(peers.into_iter().map(|(node, peer)| async move {
        let after = cursor.get(&node).copied().unwrap_or(0);
        let r = match peer {
            None => crate::audit_api::page(store, after, limit)
                .await
                .map_err(|e| format!("{e:?}")),
            Some(peer) => c
                .ask(
                    peer,
                    format!("/v1/audit?after={after}&limit={limit}"),
                    authorization.cloned(),
                )
                .await
                .and_then(|b| {
                    serde_json::from_slice::<AuditResponse>(&b)
                        .map_err(|e| format!("not an audit answer: {e}"))
                }),
        };
        match r {
            Ok(p) => NodeAuditOut {
                node,
                status: "ok".into(),
                error: None,
                next_after: p.next_after,
                records: p.records,
            },
            Err(error) => NodeAuditOut {
                node,
                status: "unreachable".into(),
                error: Some(error),
                next_after: None,
                records: Vec::new(),
            },
        }
    }))
    .await;
    Ok(answers)
}
