//! The runtime over fake seams (no etcd, no Kafka): that it carries the
//! machine's actions out — the marker produced, the lease given back on a
//! revoke, a failed or silent keep-alive stopping the partition — under
//! tokio's paused clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use palisade_cluster::{ClusterError, KeepAlive};
use palisade_core::{LeaseId, Scope};
use palisade_lease::{AcquireRequest, Lease, Millis, RemoteError};
use palisade_log::StoreConfig;

use super::*;

/// What the fake etcd's keep-alives do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renew {
    Ok,
    /// etcd answers that the lease is gone.
    Fail,
    /// No answer ever (etcd unreachable, a partition).
    Hang,
}

#[derive(Debug, Default)]
struct Etcd {
    revision: u64,
    next_lease: i64,
    /// Owner keys: partition -> (lease, value).
    keys: HashMap<u32, (i64, Vec<u8>)>,
    revoked: Vec<i64>,
}

#[derive(Debug)]
struct FakeOwners {
    etcd: Mutex<Etcd>,
    renew: Renew,
}

impl FakeOwners {
    fn held(&self, p: u32) -> bool {
        lock(&self.etcd).keys.contains_key(&p)
    }
}

struct FakeKeepAlive(Renew, i64);

impl KeepAlive for FakeKeepAlive {
    fn renew(&mut self) -> BoxFuture<'_, Result<Duration, ClusterError>> {
        let (mode, lease) = (self.0, self.1);
        Box::pin(async move {
            match mode {
                Renew::Ok => Ok(OWNER_TTL),
                Renew::Fail => Err(ClusterError::LeaseGone(lease)),
                Renew::Hang => std::future::pending().await,
            }
        })
    }
}

impl OwnerLeases for FakeOwners {
    fn take(
        &self,
        partition: u32,
        value: Vec<u8>,
        ttl: Duration,
    ) -> BoxFuture<'_, Result<Taken, ClusterError>> {
        Box::pin(async move {
            let mut e = lock(&self.etcd);
            if e.keys.contains_key(&partition) {
                return Ok(Taken::HeldElsewhere);
            }
            e.revision += 1;
            e.next_lease += 1;
            let lease = e.next_lease;
            e.keys.insert(partition, (lease, value));
            Ok(Taken::Taken {
                token: FencingToken(e.revision),
                lease: OwnerLeaseId(lease),
                ttl,
            })
        })
    }
    fn keep_alive(
        &self,
        lease: OwnerLeaseId,
    ) -> BoxFuture<'_, Result<Box<dyn KeepAlive>, ClusterError>> {
        Box::pin(
            async move { Ok(Box::new(FakeKeepAlive(self.renew, lease.0)) as Box<dyn KeepAlive>) },
        )
    }
    fn revoke(&self, lease: OwnerLeaseId) -> BoxFuture<'_, Result<(), ClusterError>> {
        Box::pin(async move {
            let mut e = lock(&self.etcd);
            e.keys.retain(|_, (l, _)| *l != lease.0);
            e.revoked.push(lease.0);
            Ok(())
        })
    }
    fn owner(&self, partition: u32) -> BoxFuture<'_, Result<Option<Vec<u8>>, ClusterError>> {
        Box::pin(async move {
            Ok(lock(&self.etcd)
                .keys
                .get(&partition)
                .map(|(_, v)| v.clone()))
        })
    }
}

/// A record's headers.
type Headers = Vec<(&'static str, String)>;

/// Kafka: every produced record (partition, headers), in order.
#[derive(Debug, Default)]
struct FakeLog(Mutex<Vec<(u32, Headers)>>);

impl FakeLog {
    /// (partition, owner token) of every owner marker produced.
    fn markers(&self) -> Vec<(u32, u64)> {
        lock(&self.0)
            .iter()
            .filter(|(_, h)| h.iter().any(|(k, v)| *k == CONTROL_HEADER && v == "owner"))
            .map(|(p, h)| {
                let t = h.iter().find(|(k, _)| *k == OWNER_TOKEN_HEADER).unwrap();
                (*p, t.1.parse().unwrap())
            })
            .collect()
    }
}

impl RecordLog for FakeLog {
    fn produce(
        &self,
        partition: u32,
        _key: Option<Vec<u8>>,
        _value: Vec<u8>,
        headers: Vec<(&'static str, String)>,
    ) -> BoxFuture<'_, Result<u64, ClusterError>> {
        Box::pin(async move {
            let mut l = lock(&self.0);
            l.push((partition, headers));
            Ok(u64::try_from(l.len() - 1).unwrap())
        })
    }
}

/// tokio's clock, so that a paused test moves the deadlines too.
#[derive(Debug)]
struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// The node never asks for grants here.
#[derive(Debug)]
struct NoAuthority;

impl RemoteAuthority for NoAuthority {
    fn name(&self) -> &'static str {
        "none"
    }
    fn acquire(&self, _: AcquireRequest) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(async { Err(unavailable()) })
    }
    fn renew(&self, _: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(async { Err(unavailable()) })
    }
    fn release(&self, _: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(async { Err(unavailable()) })
    }
    fn scope_of_token(&self, _: FencingToken) -> BoxFuture<'_, Option<Scope>> {
        Box::pin(async { None })
    }
    fn holder_of(&self, _: &Scope) -> Option<Lease> {
        None
    }
    fn lease(&self, _: LeaseId) -> Option<Lease> {
        None
    }
    fn live_leases_of(&self, _: &str) -> usize {
        0
    }
    fn now(&self) -> Millis {
        Millis(0)
    }
}

fn unavailable() -> RemoteError {
    RemoteError::Unavailable {
        authority: "none",
        detail: "not in this test".into(),
    }
}

struct Harness {
    node: Arc<Node>,
    owners: Arc<FakeOwners>,
    log: Arc<FakeLog>,
    _dir: tempfile::TempDir,
}

fn harness(renew: Renew) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        partitions: Some(2),
        ..StoreConfig::default()
    };
    let store = Arc::new(Store::open(dir.path(), cfg).unwrap());
    let owners = Arc::new(FakeOwners {
        etcd: Mutex::default(),
        renew,
    });
    let log = Arc::new(FakeLog::default());
    let node = Node::new(
        "n1".into(),
        store,
        Seams {
            authority: Arc::new(NoAuthority),
            owners: owners.clone(),
            log: log.clone(),
            clock: Arc::new(TokioClock),
        },
    );
    Harness {
        node,
        owners,
        log,
        _dir: dir,
    }
}

/// Wait (in paused time, well inside one TTL) until `cond` holds.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..50 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

fn local() -> Route {
    Route::Local { node: "n1".into() }
}

#[tokio::test(start_paused = true)]
async fn an_assignment_is_taken_marked_and_served_and_a_revoke_gives_the_lease_back() {
    let h = harness(Renew::Ok);
    h.node.assigned(&[0]);
    let Admission::Owned(token) = h.node.admit(0).await else {
        panic!("not admitted")
    };
    assert_eq!(h.log.markers(), vec![(0, token.0)]);
    // Not served before its own marker is applied, nor for another's.
    assert!(matches!(h.node.route(0).await, Route::Unavailable { .. }));
    h.node
        .handled(0, 0, Applied::Control, Some((token, "n2".into())));
    assert!(matches!(h.node.route(0).await, Route::Unavailable { .. }));
    h.node
        .handled(0, 0, Applied::Control, Some((token, "n1".into())));
    assert_eq!(h.node.route(0).await, local());
    // Keep-alives keep it served well past one TTL.
    tokio::time::sleep(OWNER_TTL * 3).await;
    assert_eq!(h.node.route(0).await, local());
    h.node.revoked(&[0]);
    assert_ne!(h.node.route(0).await, local());
    assert_eq!(h.node.admit(0).await, Admission::NotAssigned);
    eventually("the owner lease revoked in etcd", || !h.owners.held(0)).await;
}

/// The consume loop's non-blocking question (decision 0034) and the views'
/// `holding` (decision 0033) follow the machine: not assigned, waiting
/// (`None`: the loop pauses the partition), owned, served, revoked.
#[tokio::test(start_paused = true)]
async fn admitted_and_holding_answer_at_once_what_the_machine_says() {
    let h = harness(Renew::Ok);
    let not_held = Holding {
        owner_token: None,
        serving: false,
    };
    assert_eq!(h.node.admitted(0), Some(Admission::NotAssigned));
    h.node.assigned(&[0]);
    // The lease is being taken (nothing ran yet): admit would wait.
    assert_eq!(h.node.admitted(0), None);
    assert_eq!(h.node.holding(0), not_held);
    let Admission::Owned(token) = h.node.admit(0).await else {
        panic!("not admitted")
    };
    assert_eq!(h.node.admitted(0), Some(Admission::Owned(token)));
    assert_eq!(
        h.node.holding(0),
        Holding {
            owner_token: Some(token.0),
            serving: false
        }
    );
    h.node
        .handled(0, 0, Applied::Control, Some((token, "n1".into())));
    assert!(h.node.holding(0).serving);
    h.node.revoked(&[0]);
    assert_eq!(h.node.admitted(0), Some(Admission::NotAssigned));
    assert_eq!(h.node.holding(0), not_held);
}

#[tokio::test(start_paused = true)]
async fn a_failed_keep_alive_stops_serving_and_gives_the_lease_up() {
    let h = harness(Renew::Fail);
    h.node.assigned(&[1]);
    let Admission::Owned(token) = h.node.admit(1).await else {
        panic!("not admitted")
    };
    h.node
        .handled(1, 0, Applied::Control, Some((token, "n1".into())));
    assert_eq!(h.node.route(1).await, local());
    // The first keep-alive goes out after TTL/3 and fails.
    tokio::time::sleep(OWNER_TTL / 3 + Duration::from_millis(50)).await;
    assert_ne!(h.node.route(1).await, local());
    eventually("the owner lease revoked in etcd", || !h.owners.held(1)).await;
}

#[tokio::test(start_paused = true)]
async fn a_silent_etcd_stops_the_partition_at_the_deadline_and_it_is_taken_anew_higher() {
    let h = harness(Renew::Hang);
    h.node.assigned(&[0]);
    let Admission::Owned(token) = h.node.admit(0).await else {
        panic!("not admitted")
    };
    h.node
        .handled(0, 0, Applied::Control, Some((token, "n1".into())));
    tokio::time::sleep(OWNER_TTL - Duration::from_millis(100)).await;
    assert_eq!(h.node.route(0).await, local());
    // No answer, no event: the deadline alone stops it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_ne!(h.node.route(0).await, local());
    // The ingester's next record takes it anew, with a higher token.
    let Admission::Owned(again) = h.node.admit(0).await else {
        panic!("not admitted again")
    };
    assert!(again > token, "{again:?} after {token:?}");
    assert_eq!(h.log.markers(), vec![(0, token.0), (0, again.0)]);
}

/// Cluster mode's authority is made before the store opens and gets its
/// node afterwards: until then it grants nothing (unavailable), then every
/// call reaches the node's authority; it takes a node once.
#[tokio::test(start_paused = true)]
async fn the_cluster_authority_refuses_until_it_has_its_node_then_asks_it() {
    let h = harness(Renew::Ok);
    let cluster = authority::ClusterAuthority::unbound();
    let req = || AcquireRequest {
        scope: "twin/a".parse().unwrap(),
        holder: "A".into(),
        ttl_ms: 5_000,
        purpose: Default::default(),
    };
    match cluster.acquire(req()).await {
        Err(RemoteError::Unavailable { detail, .. }) => {
            assert!(detail.contains("not started"), "{detail}");
        }
        other => panic!("an unbound authority must refuse: {other:?}"),
    }
    assert!(cluster.renew(LeaseId(1)).await.is_err());
    assert_eq!(cluster.live_leases_of("A"), 0);
    cluster.bind(h.node.clone()).unwrap();
    // Bound: the request reaches the node's authority (which, in this
    // test, answers "not in this test").
    match cluster.acquire(req()).await {
        Err(RemoteError::Unavailable { detail, .. }) => {
            assert_eq!(detail, "not in this test");
        }
        other => panic!("a bound authority must ask the node's: {other:?}"),
    }
    assert!(cluster.bind(h.node.clone()).is_err(), "bound only once");
}
