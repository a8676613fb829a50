//! The lease backend suite (tests/lease_suite.rs) against the embedded
//! authority. Its time is a `ManualClock` the suite moves past a TTL, so no
//! case sleeps and expiry is exact (no patience).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use palisade::core::BoxFuture;
use palisade::lease::ManualClock;
use palisade::log::{LeaseBackend, Store, StoreConfig};

use crate::lease_suite::{run_all, Backend};

struct Embedded {
    clock: Arc<ManualClock>,
}

impl Backend for Embedded {
    fn open<'a>(&'a self, dir: &'a Path, _case: &'a str) -> BoxFuture<'a, Store> {
        let cfg = StoreConfig {
            leases: LeaseBackend::Embedded,
            lease_clock: self.clock.clone(),
            ..StoreConfig::default()
        };
        Box::pin(async move { crate::support::open_store(dir, cfg) })
    }

    fn pass(&self, ms: u64) -> BoxFuture<'_, ()> {
        self.clock.advance(Duration::from_millis(ms));
        Box::pin(std::future::ready(()))
    }

    fn patience(&self) -> u32 {
        0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_authority_passes_the_lease_backend_suite() {
    run_all(&Embedded {
        clock: Arc::new(ManualClock::at(1_700_000_000_000)),
    })
    .await;
}
