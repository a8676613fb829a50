//! The etcd lease authority on its own, against a real etcd: grants,
//! refusals, renewals and releases by lease id, expiry, and the token being
//! the lock key's create revision (so monotonic across handovers).

use std::time::{Duration, Instant};

use palisade::core::FencingToken;
use palisade::lease::{AcquireRequest, LeaseError, RemoteAuthority, RemoteError};

use crate::etcd::{create_revision, Etcd};

fn req(scope: &str, holder: &str, ttl_ms: u64) -> AcquireRequest {
    AcquireRequest {
        scope: scope.parse().unwrap(),
        holder: holder.into(),
        ttl_ms,
        purpose: Default::default(),
    }
}

fn lease_err(r: Result<impl std::fmt::Debug, RemoteError>) -> LeaseError {
    match r {
        Err(RemoteError::Lease(e)) => e,
        other => panic!("expected a lease refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_renew_release_by_lease_id_when_installed() {
    let Some(etcd) = Etcd::start("grant_renew_release_by_lease_id_when_installed").await else {
        return;
    };
    let auth = etcd.authority("t01a").await;

    let a = auth.acquire(req("twin/pump-7", "A", 2500)).await.unwrap();
    // The token is the lock key's create revision, and the TTL is whole
    // seconds, rounded up.
    assert_eq!(Some(a.token.0), create_revision(&auth, "twin/pump-7").await);
    assert_eq!(a.ttl_ms % 1000, 0);
    assert!(
        a.ttl_ms >= 3000,
        "2500 ms rounds up to 3 s, got {}",
        a.ttl_ms
    );
    assert_eq!(a.holder, "A");

    // Held: refused to another holder, naming the holder and its token.
    match lease_err(auth.acquire(req("twin/pump-7", "B", 2000)).await) {
        LeaseError::Held { holder, token, .. } => {
            assert_eq!(holder, "A");
            assert_eq!(token, a.token);
        }
        other => panic!("expected Held, got {other:?}"),
    }
    // The refusal left A's key alone.
    assert_eq!(Some(a.token.0), create_revision(&auth, "twin/pump-7").await);

    // Renew by id: same token, same scope.
    let r = auth.renew(a.id).await.unwrap();
    assert_eq!(
        (r.token, &r.scope, &r.holder),
        (a.token, &a.scope, &a.holder)
    );

    // Bad input is refused before etcd is touched.
    assert!(matches!(
        lease_err(auth.acquire(req("twin/x", "A", 10)).await),
        LeaseError::BadTtl(10)
    ));
    assert!(matches!(
        lease_err(auth.acquire(req("twin/x", "", 2000)).await),
        LeaseError::BadHolder
    ));
    assert_eq!(None, create_revision(&auth, "twin/x").await);

    // Release by id frees the scope at once; the lease is gone.
    let released = auth.release(a.id).await.unwrap();
    assert_eq!(released.token, a.token);
    assert_eq!(None, create_revision(&auth, "twin/pump-7").await);
    assert!(matches!(
        lease_err(auth.renew(a.id).await),
        LeaseError::Released(_)
    ));
    assert!(matches!(
        lease_err(auth.release(a.id).await),
        LeaseError::Released(_)
    ));

    let b = auth.acquire(req("twin/pump-7", "B", 2000)).await.unwrap();
    assert!(b.token > a.token, "{:?} after {:?}", b.token, a.token);
    assert_eq!(Some(b.token.0), create_revision(&auth, "twin/pump-7").await);

    // The same holder acquiring again gets a new lease and a higher token;
    // its earlier lease is superseded.
    let b2 = auth.acquire(req("twin/pump-7", "B", 2000)).await.unwrap();
    assert!(b2.token > b.token);
    assert_ne!(b2.id, b.id);
    match lease_err(auth.renew(b.id).await) {
        LeaseError::Superseded { by_token, .. } => assert_eq!(by_token, b2.token),
        other => panic!("expected Superseded, got {other:?}"),
    }

    // The scope of a token is known from etcd (any node can ask).
    assert_eq!(
        auth.scope_of_token(b2.token).await,
        Some("twin/pump-7".parse().unwrap())
    );
    assert_eq!(auth.scope_of_token(FencingToken(u64::MAX)).await, None);

    // A lease id etcd never issued.
    let unknown: palisade::core::LeaseId = "000000000000000000000000deadbeef".parse().unwrap();
    assert!(matches!(
        lease_err(auth.renew(unknown).await),
        LeaseError::Expired(_) | LeaseError::Unknown(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_hands_the_scope_over_with_a_higher_token_when_installed() {
    let Some(etcd) =
        Etcd::start("expiry_hands_the_scope_over_with_a_higher_token_when_installed").await
    else {
        return;
    };
    let auth = etcd.authority("t01b").await;
    // Two authorities (two nodes) on one etcd: grants of one are seen by
    // the other.
    let other = etcd.authority("t01b").await;
    let mut last = FencingToken(0);
    for round in 0..3 {
        let a = auth
            .acquire(req("partition/3", &format!("A{round}"), 1000))
            .await
            .unwrap();
        assert!(
            a.token > last,
            "round {round}: {:?} after {:?}",
            a.token,
            last
        );
        // B waits for A's lease to expire (A never renews). No timing is
        // asserted: B polls until etcd hands the scope over.
        let started = Instant::now();
        let b = loop {
            match other
                .acquire(req("partition/3", &format!("B{round}"), 1000))
                .await
            {
                Ok(b) => break b,
                Err(RemoteError::Lease(LeaseError::Held { holder, .. })) => {
                    assert_eq!(holder, format!("A{round}"));
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "A's lease never expired"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(b.token > a.token);
        assert_eq!(
            Some(b.token.0),
            create_revision(&other, "partition/3").await
        );
        // A's late renewal fails: expired, or superseded by B's token.
        match lease_err(auth.renew(a.id).await) {
            LeaseError::Expired(_) => {}
            LeaseError::Superseded { by_token, .. } => assert_eq!(by_token, b.token),
            e => panic!("unexpected {e:?}"),
        }
        other.release(b.id).await.unwrap();
        last = b.token;
    }
}
