//! Helpers shared by this crate's test binaries.

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
