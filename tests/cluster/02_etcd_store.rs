//! The store with leases from etcd, over its real HTTP API: tokens from etcd
//! are fenced exactly like embedded ones (scope, never regress), handovers
//! keep tokens monotonic, the fence survives a restart of the store, and a
//! store never mixes tokens of two authorities.

use std::sync::Arc;

use palisade::http::HttpConfig;
use palisade::log::{BackendError, LeaseBackend, OpenError, Store, StoreConfig};
use serde_json::json;

use crate::etcd::{create_revision, Etcd};
use crate::support::{lease_id_of, token_of, ServeProcess, TestServer};

async fn server_on_etcd(dir: &std::path::Path, etcd: &Etcd, prefix: &str) -> TestServer {
    TestServer::start_with(dir, on_etcd(etcd, prefix).await, HttpConfig::default()).await
}

/// A store configuration whose leases come from `etcd` under `prefix`.
async fn on_etcd(etcd: &Etcd, prefix: &str) -> StoreConfig {
    StoreConfig {
        leases: LeaseBackend::Remote(Arc::new(etcd.authority(prefix).await)),
        ..StoreConfig::default()
    }
}

/// Open a store closed a moment ago in this process, returning the error
/// other than sled's lock (still held for a moment after a close).
fn reopen(path: &std::path::Path, cfg: StoreConfig) -> Result<Store, OpenError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match Store::open(path, cfg.clone()) {
            Err(OpenError::InUse { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_fences_etcd_tokens_and_keeps_them_across_a_restart_when_installed() {
    let Some(etcd) =
        Etcd::start("store_fences_etcd_tokens_and_keeps_them_across_a_restart_when_installed")
            .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = server_on_etcd(dir.path(), &etcd, "t02a").await;
    let c = server.client();

    let a = c.acquire("twin/pump-7", "A", 60_000).await;
    let ta = token_of(&a);
    // The token is the lock key's create revision in etcd.
    let probe = etcd.authority("t02a").await;
    assert_eq!(create_revision(&probe, "twin/pump-7").await, Some(ta));
    assert_eq!(
        c.put("pump-7", ta, "e1", json!({"rpm": 1})).await.status,
        201
    );
    // Scope: A's twin token does not write another twin.
    let wrong = c.put("pump-8", ta, "e2", json!({"rpm": 1})).await;
    assert_eq!(wrong.status, 403, "{:?}", wrong.body);
    assert_eq!(
        wrong.body["error"], "token_scope_mismatch",
        "{:?}",
        wrong.body
    );
    // Never issued (above anything etcd handed out).
    let unissued = c
        .put("pump-7", ta + 1_000_000, "e3", json!({"rpm": 1}))
        .await;
    assert_eq!(
        unissued.body["error"], "token_not_issued",
        "{:?}",
        unissued.body
    );

    // Held: 409 naming the holder.
    let held = c.try_acquire("twin/pump-7", "B", 60_000).await;
    assert_eq!(held.status, 409, "{:?}", held.body);
    assert_eq!(held.body["holder"], "A");

    // Handovers by release: tokens strictly increase, and every earlier
    // holder is fenced out by the grant alone (before the new holder writes).
    let mut holder_token = ta;
    let mut lease = lease_id_of(&a);
    for round in 0..4 {
        assert_eq!(
            c.delete(&format!("/v1/leases/{lease}")).await.status,
            204,
            "release round {round}"
        );
        let next = c.acquire("twin/pump-7", &format!("H{round}"), 60_000).await;
        let t = token_of(&next);
        assert!(t > holder_token, "round {round}: {t} after {holder_token}");
        let stale = c
            .put(
                "pump-7",
                holder_token,
                &format!("late-{round}"),
                json!({"rpm": 666}),
            )
            .await;
        assert_eq!(stale.status, 409, "{:?}", stale.body);
        assert_eq!(stale.body["error"], "stale_token");
        assert_eq!(stale.body["fence"], t);
        assert_eq!(
            c.put("pump-7", t, &format!("ok-{round}"), json!({"rpm": round}))
                .await
                .status,
            201
        );
        holder_token = t;
        lease = lease_id_of(&next);
    }
    // Renew by lease id: same token.
    let renewed = c
        .post_json(&format!("/v1/leases/{lease}/renew"), &json!({}))
        .await;
    assert_eq!(renewed.status, 200, "{:?}", renewed.body);
    assert_eq!(renewed.body["token"], holder_token);
    let before = c.twin("pump-7").await.body;
    server.stop().await;

    // Restart the store on the same etcd: the fence stays, the live etcd
    // lease is still renewable by id, and new grants are higher still.
    let server = server_on_etcd(dir.path(), &etcd, "t02a").await;
    let c = server.client();
    let after = c.twin("pump-7").await.body;
    assert_eq!(before["state"], after["state"]);
    assert_eq!(after["fence"], holder_token);
    let stale = c
        .put("pump-7", ta, "after-restart", json!({"rpm": 666}))
        .await;
    assert_eq!(stale.body["error"], "stale_token", "{:?}", stale.body);
    assert_eq!(
        c.put("pump-7", holder_token, "ok-after", json!({"rpm": 7}))
            .await
            .status,
        201
    );
    let renewed = c
        .post_json(&format!("/v1/leases/{lease}/renew"), &json!({}))
        .await;
    assert_eq!(renewed.status, 200, "{:?}", renewed.body);
    let p = c.acquire("partition/0", "P", 60_000).await;
    assert!(token_of(&p) > holder_token);
    assert_eq!(c.twin("pump-7").await.body["state"]["rpm"], 7);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_keeps_the_authority_its_tokens_came_from_when_installed() {
    let Some(etcd) =
        Etcd::start("a_store_keeps_the_authority_its_tokens_came_from_when_installed").await
    else {
        return;
    };
    // Embedded tokens first: etcd is refused at open (token numbers would
    // collide).
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path()).await;
    server.client().acquire("twin/a", "A", 60_000).await;
    server.stop().await;
    let err = reopen(dir.path(), on_etcd(&etcd, "t02b").await).unwrap_err();
    assert!(
        matches!(err, OpenError::Backend(BackendError::Mismatch { .. })),
        "{err}"
    );
    // Still the embedded store it was: it opens as one.
    reopen(dir.path(), StoreConfig::default())
        .unwrap()
        .close()
        .await;

    // etcd first: the store records it and refuses the embedded authority.
    let dir = tempfile::tempdir().unwrap();
    let server = server_on_etcd(dir.path(), &etcd, "t02b").await;
    server.client().acquire("twin/a", "A", 60_000).await;
    server.stop().await;
    let err = reopen(dir.path(), StoreConfig::default()).unwrap_err();
    assert!(
        matches!(err, OpenError::Backend(BackendError::Mismatch { .. })),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("came from the etcd lease authority; it cannot switch to embedded"),
        "{err}"
    );
    reopen(dir.path(), on_etcd(&etcd, "t02b").await)
        .unwrap()
        .close()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn palisade_serve_with_lease_backend_etcd_when_installed() {
    let Some(etcd) = Etcd::start("palisade_serve_with_lease_backend_etcd_when_installed").await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        dir.path(),
        &[
            "--lease-backend",
            "etcd",
            "--etcd-endpoints",
            &etcd.endpoint,
            "--etcd-prefix",
            "/t02c/",
        ],
    );
    let c = serve.client();
    let a = c.acquire("partition/1", "A", 1500).await;
    // 1500 ms is granted as whole seconds, rounded up.
    let ttl = a["ttl_ms"].as_u64().unwrap();
    assert!(ttl >= 2000 && ttl % 1000 == 0, "{a}");
    let probe = etcd.authority("t02c").await;
    assert_eq!(
        create_revision(&probe, "partition/1").await,
        Some(token_of(&a))
    );
    serve.terminate();

    // Misconfiguration is a clear error at start: etcd without endpoints.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--lease-backend",
            "etcd",
            "--data",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--etcd-endpoints"), "{err}");
}

/// What the security guard asks the store about leases (the scope of a lease
/// id on renew/release, the live leases of a principal for its limit) is
/// answered from the etcd authority when it is the store's backend, not from
/// the (empty) embedded table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_lookups_follow_the_etcd_backend_when_installed() {
    let Some(etcd) = Etcd::start("lease_lookups_follow_the_etcd_backend_when_installed").await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = server_on_etcd(dir.path(), &etcd, "t02d").await;
    let c = server.client();

    let a = c.acquire("twin/pump-1", "A", 60_000).await;
    let b = c.acquire("twin/pump-2", "A", 60_000).await;
    c.acquire("twin/pump-3", "B", 60_000).await;
    assert_eq!(server.store.live_leases_of("A"), 2);
    assert_eq!(server.store.live_leases_of("B"), 1);
    let id_a: palisade::core::LeaseId = lease_id_of(&a).parse().unwrap();
    let seen = server
        .store
        .lease(id_a)
        .expect("a lease granted here is known");
    assert_eq!(seen.scope.to_string(), "twin/pump-1");
    assert_eq!(seen.token.0, token_of(&a));

    let released = c.delete(&format!("/v1/leases/{}", lease_id_of(&b))).await;
    assert_eq!(released.status, 204, "{:?}", released.body);
    assert_eq!(server.store.live_leases_of("A"), 1);
    let id_b: palisade::core::LeaseId = lease_id_of(&b).parse().unwrap();
    assert!(server.store.lease(id_b).is_none());
}
