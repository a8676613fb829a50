//! What every lease backend must do, written once and run against each
//! (openraft's `testing::suite` pattern): the embedded authority on a
//! `ManualClock` (tests/fencing/03_backends.rs) and etcd
//! (tests/cluster/06_lease_suite.rs). Each case drives a store opened with
//! the backend through its public lease calls and appends, so the store's
//! dispatch (crates/palisade-log/src/leases.rs) is under test too.
//!
//! Included with `#[path]` by both test binaries, so nothing test-only
//! reaches a normal build.

use std::path::Path;

use palisade::core::{BoxFuture, FencingToken, NewEvent, Scope, TwinId};
use palisade::lease::{AcquireRequest, Lease, LeaseError};
use palisade::log::{AppendError, LeaseOpError, Store};

/// A lease backend under test.
pub trait Backend: Sync {
    /// A store in `dir` whose leases come from this backend; `case` names
    /// the case (an etcd backend keeps cases apart by key prefix).
    fn open<'a>(&'a self, dir: &'a Path, case: &'a str) -> BoxFuture<'a, Store>;

    /// Let `ms` of lease time pass (move a manual clock, or wait).
    fn pass(&self, ms: u64) -> BoxFuture<'_, ()>;

    /// How many further 200 ms passes a lease may take to end after its
    /// TTL has passed: 0 where expiry is exact (a manual clock), more where
    /// the authority expires leases on its own schedule (etcd).
    fn patience(&self) -> u32;
}

/// Run every case, each on its own store.
pub async fn run_all(b: &impl Backend) {
    tokens_increase_across_grants_and_scopes(b).await;
    a_held_scope_is_refused_to_another_holder(b).await;
    renew_keeps_the_token(b).await;
    release_frees_the_scope_at_once_and_ends_the_lease(b).await;
    a_reacquire_after_expiry_gets_a_higher_token(b).await;
    a_tokens_scope_is_known(b).await;
}

fn req(scope: &str, holder: &str, ttl_ms: u64) -> AcquireRequest {
    AcquireRequest {
        scope: scope.parse::<Scope>().unwrap(),
        holder: holder.into(),
        ttl_ms,
        purpose: Default::default(),
    }
}

/// Long enough that no case's lease expires unless the case lets it.
const LONG: u64 = 60_000;

/// A store of the backend in a new folder (kept until the case ends).
async fn fresh(b: &impl Backend, case: &str) -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = b.open(dir.path(), case).await;
    (dir, store)
}

pub async fn tokens_increase_across_grants_and_scopes(b: &impl Backend) {
    let (_dir, store) = fresh(b, "tokens").await;
    let s = &store;
    let a = s.acquire(req("twin/a", "A", LONG)).await.unwrap();
    let t = s.acquire(req("twin/b", "B", LONG)).await.unwrap();
    let p = s.acquire(req("partition/0", "C", LONG)).await.unwrap();
    s.release(a.id).await.unwrap();
    let again = s.acquire(req("twin/a", "D", LONG)).await.unwrap();
    let tokens = [a.token, t.token, p.token, again.token];
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens must strictly increase: {tokens:?}"
    );
    store.close().await;
}

pub async fn a_held_scope_is_refused_to_another_holder(b: &impl Backend) {
    let (_dir, store) = fresh(b, "held").await;
    let s = &store;
    let a = s.acquire(req("twin/h", "A", LONG)).await.unwrap();
    match s.acquire(req("twin/h", "B", LONG)).await {
        Err(LeaseOpError::Lease(LeaseError::Held { holder, token, .. })) => {
            assert_eq!(holder, "A");
            assert_eq!(token, a.token);
        }
        other => panic!("B must be refused while A holds the scope: {other:?}"),
    }
    let held = s.lease_holder(&a.scope).expect("A holds the scope");
    assert_eq!((held.id, held.token), (a.id, a.token));
    store.close().await;
}

pub async fn renew_keeps_the_token(b: &impl Backend) {
    let (_dir, store) = fresh(b, "renew").await;
    let s = &store;
    let a = s.acquire(req("twin/r", "A", LONG)).await.unwrap();
    b.pass(1_000).await;
    let renewed = s.renew(a.id).await.unwrap();
    assert_eq!((renewed.id, renewed.token), (a.id, a.token));
    assert_eq!(renewed.scope, a.scope);
    assert!(s.lease_expires_in(&renewed) > 0);
    // Still A's: refused to another holder.
    assert!(matches!(
        s.acquire(req("twin/r", "B", LONG)).await,
        Err(LeaseOpError::Lease(LeaseError::Held { .. }))
    ));
    store.close().await;
}

pub async fn release_frees_the_scope_at_once_and_ends_the_lease(b: &impl Backend) {
    let (_dir, store) = fresh(b, "release").await;
    let s = &store;
    let a = s.acquire(req("twin/f", "A", LONG)).await.unwrap();
    s.release(a.id).await.unwrap();
    // At once: no time passes between the release and B's grant.
    let next = s
        .acquire(req("twin/f", "B", LONG))
        .await
        .expect("a released scope is free at once");
    assert!(next.token > a.token);
    match s.renew(a.id).await {
        Err(LeaseOpError::Lease(LeaseError::Released(_) | LeaseError::Unknown(_))) => {}
        other => panic!("a released lease cannot be renewed: {other:?}"),
    }
    store.close().await;
}

pub async fn a_reacquire_after_expiry_gets_a_higher_token(b: &impl Backend) {
    let (_dir, store) = fresh(b, "expiry").await;
    let s = &store;
    // The shortest TTL every backend grants (etcd: whole seconds).
    let a = s.acquire(req("twin/e", "A", 1_000)).await.unwrap();
    b.pass(a.ttl_ms + 1).await;
    let mut waited = 0;
    let next = loop {
        match s.acquire(req("twin/e", "B", LONG)).await {
            Ok(l) => break l,
            Err(LeaseOpError::Lease(LeaseError::Held { .. })) if waited < b.patience() => {
                waited += 1;
                b.pass(200).await;
            }
            other => panic!("A's lease must have expired: {other:?}"),
        }
    };
    assert!(next.token > a.token, "{next:?} after {a:?}");
    // A's late renewal fails: expired, or superseded by B's grant.
    match s.renew(a.id).await {
        Err(LeaseOpError::Lease(
            LeaseError::Expired(_) | LeaseError::Superseded { .. } | LeaseError::Unknown(_),
        )) => {}
        other => panic!("an expired lease cannot be renewed: {other:?}"),
    }
    store.close().await;
}

fn event(id: &str) -> NewEvent {
    NewEvent {
        event_id: id.into(),
        event_type: "set".into(),
        patch: serde_json::json!({ "v": 1 }).as_object().cloned().unwrap(),
        hlc: None,
    }
}

pub async fn a_tokens_scope_is_known(b: &impl Backend) {
    let (_dir, store) = fresh(b, "scope").await;
    let s = &store;
    let a: Lease = s.acquire(req("twin/s1", "A", LONG)).await.unwrap();
    let twin = |t: &str| TwinId::new(t).unwrap();
    s.append(twin("s1"), a.token, vec![event("e1")], None)
        .await
        .expect("the holder writes its own twin");
    match s.append(twin("s2"), a.token, vec![event("e2")], None).await {
        Err(AppendError::WrongScope { token, scope, .. }) => {
            assert_eq!(token, a.token);
            assert_eq!(scope, a.scope);
        }
        other => panic!("another twin must be refused naming the scope: {other:?}"),
    }
    let never = FencingToken(a.token.0 + 1_000_000);
    match s.append(twin("s1"), never, vec![event("e3")], None).await {
        Err(AppendError::NotIssued { token }) => assert_eq!(token, never),
        other => panic!("a token never issued must be refused: {other:?}"),
    }
    store.close().await;
}
