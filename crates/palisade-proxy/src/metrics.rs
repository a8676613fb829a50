//! The proxy's counters, served as Prometheus text at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct ProxyMetrics {
    /// Requests admitted by the store (retries included).
    admitted: AtomicU64,
    /// Admitted requests whose idempotency key was admitted before.
    retried: AtomicU64,
    /// Requests refused before forwarding, by error name.
    refused: Mutex<BTreeMap<String, u64>>,
    /// Requests waiting for their twin's lock now (another request of the
    /// twin is being admitted or forwarded).
    waiting: AtomicU64,
    /// Admitted requests the upstream answered (any status).
    forwarded: AtomicU64,
    /// Admitted requests whose upstream failed: `timeout`, `connect`
    /// (no answer) or `status` (a 5xx answer).
    upstream_failed: Mutex<BTreeMap<&'static str, u64>>,
}

impl ProxyMetrics {
    pub fn admitted(&self, duplicate: bool) {
        self.admitted.fetch_add(1, Ordering::Relaxed);
        if duplicate {
            self.retried.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn refused(&self, reason: &str) {
        // A label value: a remote store's error name, kept to [a-z0-9_].
        let reason: String = reason
            .chars()
            .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .take(64)
            .collect();
        *self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(reason)
            .or_default() += 1;
    }

    /// A request waits for its twin's lock until the returned value is
    /// dropped (also if the caller goes away while it waits).
    pub fn waiting(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(self)
    }

    pub fn forwarded(&self) {
        self.forwarded.fetch_add(1, Ordering::Relaxed);
    }

    pub fn upstream_failed(&self, kind: &'static str) {
        *self
            .upstream_failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(kind)
            .or_default() += 1;
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_admitted_total Requests admitted by the store's fence (retries included).\n\
             # TYPE palisade_proxy_admitted_total counter\n\
             palisade_proxy_admitted_total {}",
            self.admitted.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_retried_total Admitted requests whose idempotency key was admitted before.\n\
             # TYPE palisade_proxy_retried_total counter\n\
             palisade_proxy_retried_total {}",
            self.retried.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_forwarded_total Admitted requests the upstream answered.\n\
             # TYPE palisade_proxy_forwarded_total counter\n\
             palisade_proxy_forwarded_total {}",
            self.forwarded.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_waiting Requests waiting for their twin's lock (another request of the twin is in flight).\n\
             # TYPE palisade_proxy_waiting gauge\n\
             palisade_proxy_waiting {}",
            self.waiting.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_refused_total Requests refused and not forwarded, by error name.\n\
             # TYPE palisade_proxy_refused_total counter"
        );
        for (reason, n) in self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(s, "palisade_proxy_refused_total{{reason=\"{reason}\"}} {n}");
        }
        let _ = writeln!(
            s,
            "# HELP palisade_proxy_upstream_failed_total Admitted requests whose upstream timed out, could not be reached or answered 5xx.\n\
             # TYPE palisade_proxy_upstream_failed_total counter"
        );
        for (kind, n) in self
            .upstream_failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                s,
                "palisade_proxy_upstream_failed_total{{kind=\"{kind}\"}} {n}"
            );
        }
        s
    }
}

/// One request counted in `palisade_proxy_waiting` while it lives.
#[derive(Debug)]
pub struct Waiting<'a>(&'a ProxyMetrics);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}
