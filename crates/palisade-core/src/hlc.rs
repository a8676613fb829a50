use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use bincode::{Decode, Encode};

/// A hybrid logical clock timestamp: uhlc's 64-bit NTP time and the 128-bit
/// id of the clock that made it. Ordered by time, then id, exactly as
/// `uhlc::Timestamp` orders, so it is a total order across writers.
///
/// Text form is uhlc's: `<ntp64 time as decimal>/<id as hex>`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Encode, Decode)]
pub struct Hlc {
    /// NTP64 time: seconds since 1970 in the high 32 bits, fraction below.
    pub time: u64,
    /// The clock's id in uhlc's little-endian byte order, so that byte-wise
    /// comparison matches uhlc's.
    pub id: [u8; 16],
}

impl Hlc {
    pub fn to_uhlc(self) -> Result<uhlc::Timestamp, HlcParseError> {
        let id = uhlc::ID::try_from(u128::from_le_bytes(self.id)).map_err(|_| HlcParseError)?;
        Ok(uhlc::Timestamp::new(uhlc::NTP64(self.time), id))
    }

    /// Milliseconds since the Unix epoch of the physical part (for display).
    pub fn unix_millis(self) -> u64 {
        uhlc::NTP64(self.time)
            .to_duration()
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX)
    }
}

impl From<uhlc::Timestamp> for Hlc {
    fn from(ts: uhlc::Timestamp) -> Self {
        Self {
            time: ts.get_time().as_u64(),
            id: ts.get_id().to_le_bytes(),
        }
    }
}

impl fmt::Display for Hlc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{:x}", self.time, u128::from_le_bytes(self.id))
    }
}

impl fmt::Debug for Hlc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hlc({self})")
    }
}

/// An HLC string that is not `<decimal time>/<non-zero hex id>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an HLC timestamp is `<ntp64 time as decimal>/<clock id as hex, non-zero>`")]
pub struct HlcParseError;

impl FromStr for Hlc {
    type Err = HlcParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (time, id) = s.split_once('/').ok_or(HlcParseError)?;
        if time.is_empty() || !time.bytes().all(|b| b.is_ascii_digit()) {
            return Err(HlcParseError);
        }
        let time: u64 = time.parse().map_err(|_| HlcParseError)?;
        let ts = uhlc::Timestamp::new(uhlc::NTP64(time), id.parse().map_err(|_| HlcParseError)?);
        Ok(ts.into())
    }
}

/// A writer's HLC is too far ahead of the store's clock.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "HLC {hlc} is {ahead_ms} ms ahead of the store's clock; at most {max_drift_ms} ms is accepted"
)]
pub struct ClockDrift {
    pub hlc: Hlc,
    pub ahead_ms: u64,
    pub max_drift_ms: u64,
}

/// The store's hybrid logical clock (a `uhlc::HLC` with a bounded drift).
pub struct Clock {
    hlc: uhlc::HLC,
    max_drift: Duration,
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Clock")
            .field("max_drift", &self.max_drift)
            .finish_non_exhaustive()
    }
}

/// The largest drift uhlc takes: its NTP64 time has 32 bits of seconds, and
/// `with_max_delta` asserts that the delta fits (issue 18: a huge
/// `--max-drift-ms` panicked there).
pub const MAX_DRIFT: Duration = Duration::from_secs(u32::MAX as u64);

impl Clock {
    /// A clock refusing HLCs more than `max_drift` ahead of it. A drift above
    /// [`MAX_DRIFT`] (136 years) is taken as [`MAX_DRIFT`]: no bound either
    /// way, and never a panic. `palisade serve` refuses far smaller values.
    pub fn new(max_drift: Duration) -> Self {
        let max_drift = max_drift.min(MAX_DRIFT);
        Self {
            hlc: uhlc::HLCBuilder::new().with_max_delta(max_drift).build(),
            max_drift,
        }
    }

    /// A fresh timestamp, later than every timestamp this clock has made or seen.
    pub fn now(&self) -> Hlc {
        self.hlc.new_timestamp().into()
    }

    /// Merge a writer's timestamp into the clock, refusing one that is more
    /// than the configured drift ahead of the store's physical time.
    pub fn observe(&self, hlc: Hlc) -> Result<(), ClockDrift> {
        let ts = hlc.to_uhlc().map_err(|_| self.drift(hlc))?;
        self.hlc
            .update_with_timestamp(&ts)
            .map_err(|_| self.drift(hlc))
    }

    fn drift(&self, hlc: Hlc) -> ClockDrift {
        let now = uhlc::system_time_clock();
        let ahead = uhlc::NTP64(hlc.time.saturating_sub(now.as_u64()));
        ClockDrift {
            hlc,
            ahead_ms: ahead
                .to_duration()
                .as_millis()
                .try_into()
                .unwrap_or(u64::MAX),
            max_drift_ms: self.max_drift.as_millis().try_into().unwrap_or(u64::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18: `--max-drift-ms 4294967296000` panicked in uhlc's builder.
    #[test]
    fn a_drift_beyond_uhlcs_range_is_capped_not_a_panic() {
        let clock = Clock::new(Duration::from_millis(4_294_967_296_000));
        assert!(clock.observe(clock.now()).is_ok());
        let _ = Clock::new(Duration::MAX).now();
    }

    #[test]
    fn text_form_round_trips_and_orders_like_uhlc() {
        let clock = Clock::new(Duration::from_millis(500));
        let a = clock.now();
        let b = clock.now();
        assert!(b > a);
        let a2: Hlc = a.to_string().parse().unwrap();
        assert_eq!(a2, a);
        assert!(b.to_uhlc().unwrap() > a.to_uhlc().unwrap());
        for junk in ["", "1", "/1", "x/1", "1/", "1/0", "1/zz", "-1/1", "1/1/1"] {
            assert!(junk.parse::<Hlc>().is_err(), "{junk:?}");
        }
    }

    #[test]
    fn far_future_timestamps_are_refused() {
        let clock = Clock::new(Duration::from_millis(500));
        let now = clock.now();
        let ahead = Hlc {
            time: now.time + uhlc::NTP64::from(Duration::from_secs(60)).as_u64(),
            id: [7; 16],
        };
        let err = clock.observe(ahead).unwrap_err();
        assert!(err.ahead_ms >= 59_000, "{err}");
        assert_eq!(err.max_drift_ms, 500);
        // A timestamp from the past is fine, and the clock moves past it.
        let past = Hlc {
            time: now.time - 1_000_000,
            id: [9; 16],
        };
        clock.observe(past).unwrap();
        assert!(clock.now() > now);
    }
}
