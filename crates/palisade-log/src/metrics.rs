//! Counters and histograms of the store, rendered as Prometheus text.
//!
//! Hand-rolled on atomics (about a hundred lines) rather than a metrics
//! crate: the set is small and fixed, and the hot path is one relaxed add.
//! See docs/decisions/0004-metrics.md.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the flush-latency histogram buckets.
const FLUSH_BUCKETS: [f64; 12] = [
    0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// Upper bounds of the batch-size histogram (requests per sync).
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0];
/// Upper bounds (seconds) of the acknowledged-append latency histogram.
const ACK_BUCKETS: [f64; 14] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Upper bounds (seconds) of the lease renewal-gap histogram.
const GAP_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3_600.0,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in micro-units, so it fits an integer atomic.
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if v <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        // Values are seconds or counts, far below u64::MAX micro-units.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        self.sum_micros.fetch_add((v * 1e6) as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Relaxed));
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// The store's metrics. Cheap to update from any thread.
#[derive(Debug)]
pub struct Metrics {
    pub(crate) append_requests: AtomicU64,
    pub(crate) events_appended: AtomicU64,
    pub(crate) events_deduplicated: AtomicU64,
    pub(crate) lease_grants: AtomicU64,
    pub(crate) lease_renewals: AtomicU64,
    pub(crate) lease_releases: AtomicU64,
    pub(crate) lease_expiries: AtomicU64,
    rejections: Mutex<BTreeMap<&'static str, u64>>,
    lease_refusals: Mutex<BTreeMap<&'static str, u64>>,
    lease_purposes: Mutex<BTreeMap<&'static str, u64>>,
    flush_seconds: Histogram,
    batch_requests: Histogram,
    ack_seconds: Histogram,
    checkpoint_seconds: Histogram,
    lease_gap_seconds: Histogram,
    lease_answer_seconds: Histogram,
    lease_ttl_below_advice: AtomicU64,
    segments_removed: AtomicU64,
    /// Metrics of other layers (the Kafka ingester): name -> family.
    extra: Mutex<BTreeMap<&'static str, Family>>,
}

#[derive(Debug)]
struct Family {
    help: &'static str,
    kind: &'static str,
    /// Rendered label set (`{a="b"}` or empty) -> value.
    values: BTreeMap<String, f64>,
}

fn label_text(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}=\"{}\"",
                v.replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n")
            )
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            append_requests: AtomicU64::new(0),
            events_appended: AtomicU64::new(0),
            events_deduplicated: AtomicU64::new(0),
            lease_grants: AtomicU64::new(0),
            lease_renewals: AtomicU64::new(0),
            lease_releases: AtomicU64::new(0),
            lease_expiries: AtomicU64::new(0),
            rejections: Mutex::new(BTreeMap::new()),
            lease_refusals: Mutex::new(BTreeMap::new()),
            lease_purposes: Mutex::new(BTreeMap::new()),
            flush_seconds: Histogram::new(&FLUSH_BUCKETS),
            batch_requests: Histogram::new(&BATCH_BUCKETS),
            ack_seconds: Histogram::new(&ACK_BUCKETS),
            checkpoint_seconds: Histogram::new(&FLUSH_BUCKETS),
            lease_gap_seconds: Histogram::new(&GAP_BUCKETS),
            lease_answer_seconds: Histogram::new(&ACK_BUCKETS),
            lease_ttl_below_advice: AtomicU64::new(0),
            segments_removed: AtomicU64::new(0),
            extra: Mutex::new(BTreeMap::new()),
        }
    }
}

fn bump(map: &Mutex<BTreeMap<&'static str, u64>>, reason: &'static str) {
    if let Ok(mut m) = map.lock() {
        *m.entry(reason).or_default() += 1;
    }
}

impl Metrics {
    pub(crate) fn rejected(&self, reason: &'static str) {
        bump(&self.rejections, reason);
    }

    pub(crate) fn lease_refused(&self, reason: &'static str) {
        bump(&self.lease_refusals, reason);
    }

    /// A lease granted for `purpose` (decision 0028).
    pub(crate) fn lease_granted_for(&self, purpose: palisade_core::Purpose) {
        bump(&self.lease_purposes, purpose.as_str());
    }

    /// A grant answered `took` after the store received it.
    pub(crate) fn lease_answered(&self, took: Duration) {
        self.lease_answer_seconds.observe(took.as_secs_f64());
    }

    /// A renewal (or a late one, for an expired lease) answered in `took`,
    /// `gap_ms` after the lease's previous grant or renewal.
    pub(crate) fn lease_renewed(&self, gap_ms: Option<u64>, took: Duration) {
        if let Some(g) = gap_ms {
            #[allow(clippy::cast_precision_loss)]
            self.lease_gap_seconds.observe(g as f64 / 1_000.0);
        }
        self.lease_answer_seconds.observe(took.as_secs_f64());
    }

    /// A lease granted or renewed with a TTL below its scope's advice.
    pub(crate) fn lease_ttl_below_advice(&self) {
        self.lease_ttl_below_advice.fetch_add(1, Relaxed);
    }

    /// One write + `fdatasync` of the log, acknowledging `requests`.
    pub(crate) fn flushed(&self, took: Duration, requests: usize) {
        self.flush_seconds.observe(took.as_secs_f64());
        #[allow(clippy::cast_precision_loss)]
        self.batch_requests.observe(requests as f64);
    }

    /// An append acknowledged `took` after the store received it.
    pub(crate) fn acknowledged(&self, took: Duration) {
        self.ack_seconds.observe(took.as_secs_f64());
    }

    /// An effect recorded in the outbox with its admitted event.
    pub(crate) fn outbox_recorded(&self) {
        self.add(
            "palisade_outbox_recorded_total",
            "Effects recorded in the fenced outbox with their admitted events (counted when staged; a round that then fails to sync stops the store).",
            &[],
            1,
        );
    }

    /// A checkpoint (sled flushed and synced) that removed `segments`.
    pub(crate) fn checkpointed(&self, took: Duration, segments: u64) {
        self.checkpoint_seconds.observe(took.as_secs_f64());
        self.segments_removed.fetch_add(segments, Relaxed);
    }

    /// Count of appends refused for `reason` (see `AppendError::reason`).
    pub fn rejections(&self, reason: &str) -> u64 {
        self.rejections
            .lock()
            .map(|m| m.get(reason).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Add `n` to a counter of another layer (created on first use).
    pub fn add(&self, name: &'static str, help: &'static str, labels: &[(&str, &str)], n: u64) {
        self.update(name, help, "counter", labels, |v| *v += n as f64);
    }

    /// Set a gauge of another layer (created on first use).
    pub fn set_gauge(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        self.update(name, help, "gauge", labels, |v| *v = value);
    }

    /// Read back a counter or gauge of another layer (0 if never set).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.extra
            .lock()
            .ok()
            .and_then(|m| {
                m.get(name)
                    .and_then(|f| f.values.get(&label_text(labels)).copied())
            })
            .unwrap_or(0.0)
    }

    fn update(
        &self,
        name: &'static str,
        help: &'static str,
        kind: &'static str,
        labels: &[(&str, &str)],
        f: impl FnOnce(&mut f64),
    ) {
        if let Ok(mut m) = self.extra.lock() {
            let fam = m.entry(name).or_insert_with(|| Family {
                help,
                kind,
                values: BTreeMap::new(),
            });
            f(fam.values.entry(label_text(labels)).or_insert(0.0));
        }
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let counters: [(&str, &str, &AtomicU64); 8] = [
            (
                "palisade_append_requests_total",
                "Append requests acknowledged (durable).",
                &self.append_requests,
            ),
            (
                "palisade_events_appended_total",
                "Events appended to the log.",
                &self.events_appended,
            ),
            (
                "palisade_events_deduplicated_total",
                "Events acknowledged again by event id without a new append.",
                &self.events_deduplicated,
            ),
            (
                "palisade_lease_grants_total",
                "Leases granted.",
                &self.lease_grants,
            ),
            (
                "palisade_lease_renewals_total",
                "Leases renewed.",
                &self.lease_renewals,
            ),
            (
                "palisade_lease_releases_total",
                "Leases released.",
                &self.lease_releases,
            ),
            (
                "palisade_lease_expiries_total",
                "Expired leases swept.",
                &self.lease_expiries,
            ),
            (
                "palisade_lease_ttl_below_advice_total",
                "Leases granted or renewed with a TTL below what their scope's measured renewal gaps call for (GET /v1/leases/advice).",
                &self.lease_ttl_below_advice,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        for (name, help, label, map) in [
            (
                "palisade_append_rejections_total",
                "Append requests refused, by reason.",
                "reason",
                &self.rejections,
            ),
            (
                "palisade_lease_refusals_total",
                "Lease requests refused, by reason.",
                "reason",
                &self.lease_refusals,
            ),
            (
                "palisade_lease_grants_by_purpose_total",
                "Leases granted, by purpose (correctness or efficiency).",
                "purpose",
                &self.lease_purposes,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            if let Ok(m) = map.lock() {
                for (value, n) in m.iter() {
                    let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {n}");
                }
            }
        }
        if let Ok(m) = self.extra.lock() {
            for (name, fam) in m.iter() {
                let _ = writeln!(
                    out,
                    "# HELP {name} {}\n# TYPE {name} {}",
                    fam.help, fam.kind
                );
                for (labels, v) in &fam.values {
                    let _ = writeln!(out, "{name}{labels} {v}");
                }
            }
        }
        self.flush_seconds.render(
            &mut out,
            "palisade_flush_seconds",
            "Time to write and fdatasync one group of commit rounds to the write-ahead log (one sync for every partition).",
        );
        self.batch_requests.render(
            &mut out,
            "palisade_flush_batch_requests",
            "Requests acknowledged by one write-ahead log sync.",
        );
        self.ack_seconds.render(
            &mut out,
            "palisade_append_ack_seconds",
            "Time from an append request reaching the store to its acknowledgement (durable).",
        );
        self.checkpoint_seconds.render(
            &mut out,
            "palisade_checkpoint_seconds",
            "Time to make sled durable (flush, fsync of its files) and trim the write-ahead log.",
        );
        self.lease_gap_seconds.render(
            &mut out,
            "palisade_lease_renewal_gap_seconds",
            "Time between a lease's consecutive grant or renewal and its next renewal, as the store saw it (late renewals of expired leases included).",
        );
        self.lease_answer_seconds.render(
            &mut out,
            "palisade_lease_answer_seconds",
            "Time for the store to answer a lease grant or renewal (durable).",
        );
        let _ = writeln!(
            out,
            "# HELP palisade_wal_segments_removed_total Write-ahead log segments deleted after a checkpoint.\n# TYPE palisade_wal_segments_removed_total counter\npalisade_wal_segments_removed_total {}",
            self.segments_removed.load(Relaxed)
        );
        out
    }
}
