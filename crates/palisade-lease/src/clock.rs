//! The time a lease authority runs on, injected so that expiry can be
//! tested by moving a clock instead of sleeping past a TTL.
//!
//! Two readings, for two jobs: a monotonic one decides expiry while the
//! process runs (it never goes back, whatever NTP does); the wall clock is
//! only stored, as each lease's deadline, and read back on open (a restart
//! loses every monotonic reading).
//!
//! This crate reads no clock itself: the store passes the real one
//! (`palisade_log::SystemClock`), tests a [`ManualClock`].

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of time for leases.
pub trait Clock: Send + Sync + Debug {
    /// Monotonic time since an origin fixed when the clock was made.
    fn elapsed(&self) -> Duration;
    /// Wall-clock milliseconds since 1970.
    fn wall_ms(&self) -> u64;
}

/// A clock that moves only when told to (tests): both readings advance
/// together, from the wall reading it is made at.
#[derive(Debug)]
pub struct ManualClock {
    elapsed_ms: AtomicU64,
    wall_start_ms: u64,
}

impl ManualClock {
    /// A clock whose wall reading starts at `wall_ms` (ms since 1970).
    pub fn at(wall_ms: u64) -> Self {
        Self {
            elapsed_ms: AtomicU64::new(0),
            wall_start_ms: wall_ms,
        }
    }

    /// Move both readings forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.elapsed_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn elapsed(&self) -> Duration {
        Duration::from_millis(self.elapsed_ms.load(Ordering::SeqCst))
    }

    fn wall_ms(&self) -> u64 {
        self.wall_start_ms
            .saturating_add(self.elapsed_ms.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_both_readings_together_and_only_when_told() {
        let c = ManualClock::at(1_700_000_000_000);
        let (e0, w0) = (c.elapsed(), c.wall_ms());
        assert_eq!((c.elapsed(), c.wall_ms()), (e0, w0));
        c.advance(Duration::from_millis(250));
        assert_eq!(c.elapsed(), e0 + Duration::from_millis(250));
        assert_eq!(c.wall_ms(), w0 + 250);
    }
}
