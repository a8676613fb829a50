//! The security settings of the HTTP layer: authentication (optional),
//! limits, and the per-principal state they need (rate buckets, a lock per
//! principal so the live-lease limit holds under concurrent acquires).
//!
//! The binary reads them from the `--security FILE` TOML file
//! ([`SecurityFile`]); `Security::default()` is authentication off and
//! limits that refuse nothing an unconfigured store accepted before.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;

use palisade_auth::{Auth, PrincipalFile, RoleFile};

pub use palisade_auth::ANONYMOUS;

/// Slowest request rate a principal may be limited to: below it the wait
/// before the next request no longer fits a `Duration`, let alone a person.
const MIN_RATE: f64 = 0.001;
/// Fastest: a limit above a million requests a second limits nothing.
const MAX_RATE: f64 = 1_000_000.0;
/// Largest burst above the rate.
const MAX_BURST: u64 = 1_000_000;
/// Most live leases per principal (0: no limit).
const MAX_LEASES_PER_PRINCIPAL: u64 = 1_000_000;
/// Most audit records kept.
const MAX_AUDIT_RECORDS: u64 = 1_000_000_000;

/// Limits on requests; each refusal is an error that changes nothing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Longest twin id, in bytes (at most 256, the id's own bound).
    pub max_twin_id_bytes: usize,
    /// Deepest patch, in object levels (at most 32, the log's own bound).
    pub max_patch_depth: usize,
    /// Largest patch of one event, in bytes of compact JSON.
    pub max_patch_bytes: usize,
    /// Most live leases one principal may hold (0: no limit).
    pub max_leases_per_principal: usize,
    /// Sustained requests per second per principal (0: no limit).
    pub requests_per_second: f64,
    /// Requests a principal may make at once above the sustained rate.
    pub burst: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_twin_id_bytes: palisade_core::MAX_TWIN_ID_LEN,
            max_patch_depth: palisade_twin::MAX_PATCH_DEPTH,
            max_patch_bytes: 1 << 20,
            max_leases_per_principal: 0,
            requests_per_second: 0.0,
            burst: 10,
        }
    }
}

/// The `--security` file, as written. Authentication is on iff it lists
/// principals.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecurityFile {
    #[serde(default)]
    pub limits: Limits,
    /// Serve `/metrics` without a key (for a scraper on a trusted network).
    #[serde(default)]
    pub public_metrics: bool,
    /// Audit records kept; the oldest are pruned past this.
    pub audit_max_records: Option<u64>,
    #[serde(default)]
    pub roles: BTreeMap<String, RoleFile>,
    #[serde(default)]
    pub principals: Vec<PrincipalFile>,
}

/// The security settings in force.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// `None`: authentication off (every request is [`ANONYMOUS`] and may do
    /// everything; lease holders come from the request body).
    pub auth: Option<Arc<Auth>>,
    pub limits: Limits,
    pub public_metrics: bool,
    pub audit_max_records: Option<u64>,
    pub(crate) state: Arc<PrincipalState>,
}

impl Security {
    /// Check a file's settings and build them. Every limit has a range
    /// (issue 18): a value outside it is refused here, before the store
    /// opens, rather than misbehaving later (a rate of 1e-300 made the
    /// `Retry-After` computation panic).
    pub fn from_file(f: &SecurityFile) -> Result<Self, String> {
        let l = &f.limits;
        let range = |key: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{key} must be {lo}..={hi}, got {v}"))
            }
        };
        let z = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        range(
            "limits.max_twin_id_bytes",
            z(l.max_twin_id_bytes),
            1,
            z(palisade_core::MAX_TWIN_ID_LEN),
        )?;
        range(
            "limits.max_patch_depth",
            z(l.max_patch_depth),
            1,
            z(palisade_twin::MAX_PATCH_DEPTH),
        )?;
        // `{}` is the smallest patch; the codec's largest value the largest.
        range(
            "limits.max_patch_bytes",
            z(l.max_patch_bytes),
            2,
            z(palisade_core::codec::MAX_VALUE_BYTES),
        )?;
        range(
            "limits.max_leases_per_principal",
            z(l.max_leases_per_principal),
            0,
            MAX_LEASES_PER_PRINCIPAL,
        )?;
        let rate = l.requests_per_second;
        if !(rate == 0.0 || (MIN_RATE..=MAX_RATE).contains(&rate)) {
            return Err(format!(
                "limits.requests_per_second must be 0 (no limit) or {MIN_RATE}..={MAX_RATE}, got {rate:?}"
            ));
        }
        if rate > 0.0 {
            range("limits.burst", l.burst.into(), 1, MAX_BURST)?;
        }
        if let Some(n) = f.audit_max_records {
            range("audit_max_records", n, 1, MAX_AUDIT_RECORDS)?;
        }
        let auth = if f.principals.is_empty() {
            None
        } else {
            Some(Arc::new(
                Auth::new(&f.roles, &f.principals).map_err(|e| e.to_string())?,
            ))
        };
        Ok(Self {
            auth,
            limits: f.limits.clone(),
            public_metrics: f.public_metrics,
            audit_max_records: f.audit_max_records,
            state: Arc::default(),
        })
    }

    /// Read and check a security file (TOML, `SecurityFile`): what
    /// `palisade serve --security` and `palisade proxy --security` take.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read security file {}: {e}", path.display()))?;
        let f: SecurityFile = toml::from_str(&text).map_err(|e| {
            format!(
                "security file {}: {}",
                path.display(),
                e.to_string().trim_end()
            )
        })?;
        Self::from_file(&f).map_err(|e| format!("security file {}: {e}", path.display()))
    }

    pub fn auth_enabled(&self) -> bool {
        self.auth.is_some()
    }
}

/// Mutable per-principal state.
#[derive(Debug, Default)]
pub(crate) struct PrincipalState {
    buckets: Mutex<HashMap<String, Bucket>>,
    lease_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl PrincipalState {
    /// Take one request from `principal`'s bucket, or say how long until
    /// one is available. A refused request takes nothing.
    pub(crate) fn take(
        &self,
        principal: &str,
        limits: &Limits,
        now: Instant,
    ) -> Result<(), Duration> {
        let rate = limits.requests_per_second;
        if rate <= 0.0 {
            return Ok(());
        }
        let burst = f64::from(limits.burst.max(1));
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let b = buckets.entry(principal.to_owned()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let refill = now.saturating_duration_since(b.at).as_secs_f64() * rate;
        b.tokens = (b.tokens + refill).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            // `try_`: `Limits` built in code skip `from_file`'s range, and
            // `from_secs_f64` panics past `Duration::MAX`.
            Err(Duration::try_from_secs_f64((1.0 - b.tokens) / rate).unwrap_or(Duration::MAX))
        }
    }

    /// The lock that serialises `principal`'s acquires.
    pub(crate) fn lease_lock(&self, principal: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.lease_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(principal.to_owned())
            .or_default()
            .clone()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_allows_a_burst_then_refuses_until_it_refills() {
        let s = PrincipalState::default();
        let limits = Limits {
            requests_per_second: 2.0,
            burst: 3,
            ..Limits::default()
        };
        let t0 = Instant::now();
        for _ in 0..3 {
            s.take("a", &limits, t0).unwrap();
        }
        let wait = s.take("a", &limits, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        // Another principal has its own bucket.
        s.take("b", &limits, t0).unwrap();
        // Half a second later one request is back, and only one.
        let t1 = t0 + Duration::from_millis(500);
        s.take("a", &limits, t1).unwrap();
        assert!(s.take("a", &limits, t1).is_err());
    }

    #[test]
    fn no_rate_means_no_limit() {
        let s = PrincipalState::default();
        let t0 = Instant::now();
        for _ in 0..10_000 {
            s.take("a", &Limits::default(), t0).unwrap();
        }
    }

    #[test]
    fn bad_limits_are_named() {
        let mut f = SecurityFile::default();
        f.limits.max_patch_depth = 33;
        assert!(Security::from_file(&f)
            .unwrap_err()
            .contains("max_patch_depth"));
        let mut f = SecurityFile::default();
        f.limits.requests_per_second = f64::NAN;
        assert!(Security::from_file(&f)
            .unwrap_err()
            .contains("requests_per_second"));
        assert!(!Security::from_file(&SecurityFile::default())
            .unwrap()
            .auth_enabled());
    }

    /// One bad value set on a valid file.
    type Change = fn(&mut SecurityFile);

    /// Issue 18: every limit has a range, and the message names the key,
    /// the range and the value.
    #[test]
    fn every_limit_is_range_checked() {
        let cases: [(Change, &str); 8] = [
            (
                |f| f.limits.requests_per_second = 1e-300,
                "limits.requests_per_second must be 0 (no limit) or 0.001..=1000000, got 1e-300",
            ),
            (
                |f| f.limits.requests_per_second = -1.0,
                "requests_per_second",
            ),
            (
                |f| f.limits.requests_per_second = f64::INFINITY,
                "requests_per_second",
            ),
            (
                |f| {
                    f.limits.requests_per_second = 5.0;
                    f.limits.burst = 0;
                },
                "limits.burst must be 1..=1000000, got 0",
            ),
            (
                |f| f.limits.max_patch_bytes = 1,
                "limits.max_patch_bytes must be 2..=67108864, got 1",
            ),
            (
                |f| f.limits.max_twin_id_bytes = 0,
                "limits.max_twin_id_bytes must be 1..=256, got 0",
            ),
            (
                |f| f.limits.max_leases_per_principal = usize::MAX,
                "limits.max_leases_per_principal must be 0..=1000000",
            ),
            (
                |f| f.audit_max_records = Some(0),
                "audit_max_records must be 1..=1000000000, got 0",
            ),
        ];
        for (set, want) in cases {
            let mut f = SecurityFile::default();
            set(&mut f);
            let e = Security::from_file(&f).unwrap_err();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
    }

    #[test]
    fn a_tiny_rate_built_in_code_waits_long_not_a_panic() {
        let s = PrincipalState::default();
        let limits = Limits {
            requests_per_second: 1e-300,
            burst: 1,
            ..Limits::default()
        };
        let t0 = Instant::now();
        s.take("a", &limits, t0).unwrap();
        assert_eq!(s.take("a", &limits, t0).unwrap_err(), Duration::MAX);
    }
}
