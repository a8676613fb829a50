//! The store against a model, with proptest: random grants (on partition and
//! twin scopes), releases, same-holder re-grants, restarts of the store on
//! the same folder, and writes with any token ever issued (or never issued).
//!
//! The model is the invariant itself: a write with token `t` on twin `k` is
//! accepted iff `t` was granted on a scope covering `k` and no grant covering
//! `k` with a higher token has been seen. Anything else must be refused with
//! the right reason, and the refused write must leave no trace.

use std::path::Path;

use palisade::core::{partition_for, FencingToken, NewEvent, PartitionId, Scope, TwinId};
use palisade::lease::AcquireRequest;
use palisade::log::{AppendError, AsOf, Store, StoreConfig};
use proptest::prelude::*;

const PARTITIONS: u32 = 2;
const TWINS: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Debug, Clone)]
enum Op {
    Acquire { scope: usize, holder: u8 },
    Release { grant: usize },
    Write { twin: usize, token: TokenPick },
    Restart,
}

#[derive(Debug, Clone)]
enum TokenPick {
    Issued(usize),
    NeverIssued,
}

fn scopes() -> Vec<Scope> {
    let mut s: Vec<Scope> = (0..PARTITIONS)
        .map(|p| Scope::Partition(PartitionId(p)))
        .collect();
    s.extend(TWINS.iter().map(|t| Scope::Twin(TwinId::new(*t).unwrap())));
    s
}

fn op() -> impl Strategy<Value = Op> {
    let n_scopes = PARTITIONS as usize + TWINS.len();
    prop_oneof![
        3 => (0..n_scopes, 0u8..3).prop_map(|(scope, holder)| Op::Acquire { scope, holder }),
        1 => (0usize..64).prop_map(|grant| Op::Release { grant }),
        6 => (0..TWINS.len(), prop_oneof![9 => (0usize..64).prop_map(TokenPick::Issued), 1 => Just(TokenPick::NeverIssued)])
            .prop_map(|(twin, token)| Op::Write { twin, token }),
        1 => Just(Op::Restart),
    ]
}

struct Granted {
    token: FencingToken,
    scope: Scope,
    lease: palisade::core::LeaseId,
}

fn open(dir: &Path) -> Store {
    crate::support::open_store(
        dir,
        StoreConfig {
            partitions: Some(PARTITIONS),
            ..StoreConfig::default()
        },
    )
}

fn event(n: usize) -> NewEvent {
    NewEvent {
        event_id: format!("e{n}"),
        event_type: "set".into(),
        patch: serde_json::json!({ "v": n }).as_object().cloned().unwrap(),
        hlc: None,
    }
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let scopes = scopes();
    let twins: Vec<TwinId> = TWINS.iter().map(|t| TwinId::new(*t).unwrap()).collect();
    let mut store = open(dir.path());
    let mut grants: Vec<Granted> = Vec::new();
    // Model: the accepted writes of each twin, in order: (token, value).
    let mut history: Vec<Vec<(u64, usize)>> = vec![Vec::new(); TWINS.len()];
    let mut last_token = 0u64;
    let mut n = 0usize;

    for op in ops {
        match op {
            Op::Acquire { scope, holder } => {
                let req = AcquireRequest {
                    scope: scopes[scope].clone(),
                    holder: format!("h{holder}"),
                    ttl_ms: 60_000,
                    purpose: Default::default(),
                };
                if let Ok(l) = store.acquire(req).await {
                    prop_assert!(
                        l.token.0 > last_token,
                        "token {} after {}",
                        l.token,
                        last_token
                    );
                    last_token = l.token.0;
                    grants.push(Granted {
                        token: l.token,
                        scope: l.scope,
                        lease: l.id,
                    });
                }
            }
            Op::Release { grant } => {
                if !grants.is_empty() {
                    let _ = store.release(grants[grant % grants.len()].lease).await;
                }
            }
            Op::Restart => {
                store.close().await;
                drop(store);
                store = open(dir.path());
                prop_assert_eq!(
                    store.last_token().0,
                    last_token,
                    "token counter after restart"
                );
            }
            Op::Write { twin, token } => {
                n += 1;
                let k = &twins[twin];
                let p = partition_for(k, PARTITIONS);
                let t = match token {
                    TokenPick::Issued(i) if !grants.is_empty() => grants[i % grants.len()].token,
                    _ => FencingToken(last_token + 1000),
                };
                let covering_max = grants
                    .iter()
                    .filter(|g| g.scope.covers(k, p))
                    .map(|g| g.token)
                    .max();
                let own = grants.iter().find(|g| g.token == t);
                let got = store.append(k.clone(), t, vec![event(n)], None).await;
                match (own, covering_max) {
                    (None, _) => prop_assert!(
                        matches!(got, Err(AppendError::NotIssued { .. })),
                        "never issued {t}: {got:?}"
                    ),
                    (Some(g), _) if !g.scope.covers(k, p) => {
                        prop_assert!(
                            matches!(got, Err(AppendError::WrongScope { .. })),
                            "{t} on {} writing {k}: {got:?}",
                            g.scope
                        )
                    }
                    (Some(_), Some(max)) if t < max => {
                        prop_assert_eq!(
                            got,
                            Err(AppendError::Stale {
                                token: t,
                                fence: max
                            })
                        )
                    }
                    (Some(_), _) => {
                        prop_assert!(
                            got.is_ok(),
                            "{t} on {k} should pass (covering max {covering_max:?}): {got:?}"
                        );
                        history[twin].push((t.0, n));
                    }
                }
            }
        }
        // The log holds exactly the accepted writes, and state is the last one.
        for (i, k) in twins.iter().enumerate() {
            let events = store.twin_events(k, 0, 10_000).unwrap();
            let logged: Vec<(u64, usize)> = events
                .iter()
                .map(|e| (e.token.0, e.event_id[1..].parse().unwrap()))
                .collect();
            prop_assert_eq!(&logged, &history[i], "history of {}", k);
            let state = store
                .twin(k, AsOf::Latest)
                .unwrap()
                .map(|v| v.state["v"].as_u64().unwrap() as usize);
            prop_assert_eq!(state, history[i].last().map(|h| h.1));
        }
    }
    store.close().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn no_write_below_a_later_covering_grant_ever_lands(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(ops))?;
    }
}
