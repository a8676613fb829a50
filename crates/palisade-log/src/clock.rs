//! The real clocks the store's embedded leases run on (the lease crate reads
//! none itself: `palisade_lease::Clock`).

use std::time::{Duration, Instant};

/// `Instant` for expiry, the system's wall clock for stored deadlines.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl palisade_lease::Clock for SystemClock {
    fn elapsed(&self) -> Duration {
        self.origin.elapsed()
    }

    fn wall_ms(&self) -> u64 {
        crate::ingest::now_ms()
    }
}
