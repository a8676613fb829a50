//! Helpers shared by this crate's test binaries (not every binary uses
//! every helper).
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

/// `sled::open` for a test that looks at (or forges) a store's files after
/// closing it. A store closed a moment ago may still hold sled's lock on
/// the `db` file (sled's own thread pool finishes its last writes after the
/// last handle is dropped; `Store::open` waits for it the same way). Seen in
/// CI as `could not acquire lock ... WouldBlock` on the line after a close.
pub fn sled_open(path: &Path) -> sled::Db {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match sled::open(path) {
            Ok(db) => return db,
            Err(sled::Error::Io(e))
                if e.to_string().starts_with("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("sled::open({}): {e}", path.display()),
        }
    }
}

/// Take a 60 s correctness lease on `twin` for `holder`.
pub async fn twin_lease(
    store: &palisade_log::Store,
    twin: &palisade_core::TwinId,
    holder: &str,
) -> Result<palisade_lease::Lease, palisade_log::LeaseOpError> {
    store
        .acquire(palisade_lease::AcquireRequest {
            scope: palisade_core::Scope::Twin(twin.clone()),
            holder: holder.into(),
            ttl_ms: 60_000,
            purpose: palisade_core::Purpose::Correctness,
        })
        .await
}
