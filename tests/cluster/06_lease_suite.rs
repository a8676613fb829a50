//! The lease backend suite (tests/lease_suite.rs) against etcd, a real
//! etcd process. etcd TTLs are whole seconds and etcd expires leases on
//! its own clock, so the expiry case waits real time: one lease of the
//! shortest TTL (about 1 to 3 s, polled every 200 ms, at most 60 s).

use std::path::Path;
use std::sync::Arc;

use palisade::core::BoxFuture;
use palisade::log::{LeaseBackend, Store, StoreConfig};

use crate::etcd::Etcd;
use crate::lease_suite::{run_all, Backend};

struct OnEtcd {
    etcd: Etcd,
}

impl Backend for OnEtcd {
    fn open<'a>(&'a self, dir: &'a Path, case: &'a str) -> BoxFuture<'a, Store> {
        Box::pin(async move {
            // One key prefix per case: the cases share the etcd process.
            let authority = self.etcd.authority(&format!("t06-{case}")).await;
            let cfg = StoreConfig {
                leases: LeaseBackend::Remote(Arc::new(authority)),
                ..StoreConfig::default()
            };
            crate::support::open_store(dir, cfg)
        })
    }

    fn pass(&self, ms: u64) -> BoxFuture<'_, ()> {
        // etcd cannot be paused: real time.
        Box::pin(tokio::time::sleep(std::time::Duration::from_millis(ms)))
    }

    fn patience(&self) -> u32 {
        300
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_passes_the_lease_backend_suite_when_installed() {
    let Some(etcd) = Etcd::start("etcd_passes_the_lease_backend_suite_when_installed").await else {
        return;
    };
    run_all(&OnEtcd { etcd }).await;
}
