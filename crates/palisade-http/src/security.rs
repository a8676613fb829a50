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

use crate::auth::{Auth, PrincipalFile, RoleFile};

/// The principal of every request when authentication is off.
pub const ANONYMOUS: &str = "anonymous";

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
    /// Check a file's settings and build them.
    pub fn from_file(f: &SecurityFile) -> Result<Self, String> {
        let l = &f.limits;
        if l.max_twin_id_bytes == 0 || l.max_twin_id_bytes > palisade_core::MAX_TWIN_ID_LEN {
            return Err(format!(
                "limits.max_twin_id_bytes must be 1..={}",
                palisade_core::MAX_TWIN_ID_LEN
            ));
        }
        if l.max_patch_depth == 0 || l.max_patch_depth > palisade_twin::MAX_PATCH_DEPTH {
            return Err(format!(
                "limits.max_patch_depth must be 1..={}",
                palisade_twin::MAX_PATCH_DEPTH
            ));
        }
        if l.max_patch_bytes < 2 {
            return Err("limits.max_patch_bytes must be at least 2 (the patch `{}`)".into());
        }
        if !(l.requests_per_second.is_finite() && l.requests_per_second >= 0.0) {
            return Err("limits.requests_per_second must be a number >= 0".into());
        }
        if l.requests_per_second > 0.0 && l.burst == 0 {
            return Err("limits.burst must be at least 1 with a request rate".into());
        }
        if f.audit_max_records == Some(0) {
            return Err("audit_max_records must be at least 1".into());
        }
        let auth = if f.principals.is_empty() {
            None
        } else {
            Some(Arc::new(Auth::new(&f.roles, &f.principals)?))
        };
        Ok(Self {
            auth,
            limits: f.limits.clone(),
            public_metrics: f.public_metrics,
            audit_max_records: f.audit_max_records,
            state: Arc::default(),
        })
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
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rate))
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
}
