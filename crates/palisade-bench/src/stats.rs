//! Measurements: latency histograms (HDR), one measured case, medians across
//! repeats, process CPU time, and the store's `/metrics` text.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{json, Value};

/// Highest latency recorded, in microseconds (longer ones are clamped).
const MAX_LATENCY_US: u64 = 120_000_000;

/// A latency histogram in microseconds, 3 significant digits.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

impl Latency {
    pub fn new() -> Self {
        Self(
            Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
                .expect("constant bounds are valid (1 <= low, high >= 2 * low, 3 digits)"),
        )
    }

    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.0.saturating_record(us.clamp(1, MAX_LATENCY_US));
    }

    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides, so `add` cannot fail; clamp if it did.
        if self.0.add(&other.0).is_err() {
            for v in other.0.iter_recorded() {
                let _ = self.0.record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    /// Latency at quantile `q`, in milliseconds.
    pub fn ms_at(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        us_to_ms(self.0.value_at_quantile(q))
    }

    /// p50, p99, p999, max and mean, in milliseconds, as metrics.
    pub fn put_metrics(&self, m: &mut BTreeMap<String, f64>, prefix: &str) {
        if self.0.is_empty() {
            return;
        }
        m.insert(format!("{prefix}p50_ms"), self.ms_at(0.5));
        m.insert(format!("{prefix}p99_ms"), self.ms_at(0.99));
        m.insert(format!("{prefix}p999_ms"), self.ms_at(0.999));
        m.insert(format!("{prefix}max_ms"), us_to_ms(self.0.max()));
        m.insert(format!("{prefix}mean_ms"), self.0.mean() / 1000.0);
    }

    /// Points of the CDF: (latency ms, fraction of requests at or below it).
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        if self.0.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<(f64, f64)> = Vec::new();
        let qs = (0..=100)
            .map(|i| f64::from(i) / 100.0)
            .chain([0.995, 0.999, 0.9995, 0.9999, 1.0]);
        let mut qs: Vec<f64> = qs.collect();
        qs.sort_by(f64::total_cmp);
        for q in qs {
            out.push((us_to_ms(self.0.value_at_quantile(q)), q));
        }
        out
    }
}

#[allow(clippy::cast_precision_loss)]
fn us_to_ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// One measured case of one run (e.g. `append/batch=100/palisade`).
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub name: String,
    /// Numeric results; medians are taken per key across repeats.
    pub metrics: BTreeMap<String, f64>,
    /// Anything else worth keeping (error counts by reason, settings).
    pub notes: BTreeMap<String, Value>,
    pub latency: Option<Latency>,
    /// A time series (x, y), e.g. records consumed against seconds.
    pub series: Vec<(f64, f64)>,
}

impl Case {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    pub fn set(&mut self, key: &str, v: f64) {
        self.metrics.insert(key.to_owned(), v);
    }

    pub fn get(&self, key: &str) -> Option<f64> {
        self.metrics.get(key).copied().filter(|v| v.is_finite())
    }

    pub fn note(&mut self, key: &str, v: Value) {
        self.notes.insert(key.to_owned(), v);
    }

    pub fn to_json(&self) -> Value {
        json!({
            "metrics": finite_map(&self.metrics),
            "notes": self.notes,
        })
    }
}

/// Metrics as a JSON object, NaN and infinities as null.
pub fn finite_map(m: &BTreeMap<String, f64>) -> Value {
    Value::Object(
        m.iter()
            .map(|(k, v)| {
                let v = serde_json::Number::from_f64(round(*v)).map_or(Value::Null, Value::Number);
                (k.clone(), v)
            })
            .collect(),
    )
}

/// Keep 4 significant digits for the report (the noise is far above that).
pub fn round(v: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    let mag = v.abs().log10().floor();
    let scale = 10f64.powf(3.0 - mag);
    (v * scale).round() / scale
}

/// Median of the finite values (mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The same case across repeats: per-metric medians, merged latency.
#[derive(Debug, Clone)]
pub struct Summary {
    pub name: String,
    pub median: BTreeMap<String, f64>,
    pub latency: Option<Latency>,
    /// The series of the run whose primary metric is the median one.
    pub series: Vec<(f64, f64)>,
    pub runs: Vec<Case>,
}

impl Summary {
    /// `primary` picks the run whose series is kept (the median run).
    pub fn of(runs: Vec<Case>, primary: &str) -> Self {
        let name = runs.first().map(|c| c.name.clone()).unwrap_or_default();
        let mut keys: Vec<&String> = runs.iter().flat_map(|c| c.metrics.keys()).collect();
        keys.sort();
        keys.dedup();
        let median_map: BTreeMap<String, f64> = keys
            .iter()
            .map(|k| {
                let vals: Vec<f64> = runs
                    .iter()
                    .filter_map(|c| c.metrics.get(*k))
                    .copied()
                    .collect();
                ((*k).clone(), median(&vals))
            })
            .collect();
        let mut latency: Option<Latency> = None;
        for c in &runs {
            if let Some(l) = &c.latency {
                match latency.as_mut() {
                    Some(acc) => acc.merge(l),
                    None => latency = Some(l.clone()),
                }
            }
        }
        let target = median_map.get(primary).copied().unwrap_or(f64::NAN);
        let series = runs
            .iter()
            .min_by(|a, b| {
                let da = (a.get(primary).unwrap_or(f64::INFINITY) - target).abs();
                let db = (b.get(primary).unwrap_or(f64::INFINITY) - target).abs();
                da.total_cmp(&db)
            })
            .map(|c| c.series.clone())
            .unwrap_or_default();
        Self {
            name,
            median: median_map,
            latency,
            series,
            runs,
        }
    }

    pub fn get(&self, key: &str) -> Option<f64> {
        self.median.get(key).copied().filter(|v| v.is_finite())
    }

    pub fn to_json(&self) -> Value {
        json!({
            "median": finite_map(&self.median),
            "runs": self.runs.iter().map(Case::to_json).collect::<Vec<_>>(),
        })
    }
}

/// CPU time (user + system) this process has used so far, from
/// `/proc/self/stat`; `None` where that is not available.
pub fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line; `rest` starts at field 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// `/proc/loadavg`, for the report.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The store's Prometheus text, reduced to what the bench reads.
#[derive(Debug, Clone, Default)]
pub struct StoreMetrics {
    /// name{labels} -> value
    values: BTreeMap<String, f64>,
}

impl StoreMetrics {
    pub fn parse(text: &str) -> Self {
        let mut values = BTreeMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            if let Some((k, v)) = line.rsplit_once(' ') {
                if let Ok(v) = v.trim().parse::<f64>() {
                    values.insert(k.trim().to_owned(), v);
                }
            }
        }
        Self { values }
    }

    pub fn get(&self, key: &str) -> f64 {
        self.values.get(key).copied().unwrap_or(0.0)
    }

    /// Sum over every label set of `name`.
    pub fn sum(&self, name: &str, label_filter: &str) -> f64 {
        self.values
            .iter()
            .filter(|(k, _)| {
                (k.as_str() == name || k.starts_with(&format!("{name}{{")))
                    && k.contains(label_filter)
            })
            .map(|(_, v)| *v)
            .sum()
    }

    /// Flush statistics between two scrapes: flushes, requests per flush,
    /// events per flush, and the requests-per-flush histogram's bucket deltas.
    pub fn flush_delta(before: &Self, after: &Self) -> (BTreeMap<String, f64>, Value) {
        let d = |k: &str| after.get(k) - before.get(k);
        let flushes = d("palisade_flush_batch_requests_count");
        let requests = d("palisade_flush_batch_requests_sum");
        let events = d("palisade_events_appended_total");
        let appends = d("palisade_append_requests_total");
        let mut m = BTreeMap::new();
        m.insert("flushes".into(), flushes);
        if flushes > 0.0 {
            m.insert("requests_per_flush".into(), requests / flushes);
            m.insert("events_per_flush".into(), events / flushes);
        }
        m.insert("store_append_requests".into(), appends);
        m.insert("store_events_appended".into(), events);
        m.insert(
            "store_events_deduplicated".into(),
            d("palisade_events_deduplicated_total"),
        );
        // Cumulative bucket counts (Prometheus `le`), as deltas.
        let mut buckets = serde_json::Map::new();
        for (k, v) in &after.values {
            if let Some(le) = k
                .strip_prefix("palisade_flush_batch_requests_bucket{le=\"")
                .and_then(|r| r.strip_suffix("\"}"))
            {
                buckets.insert(format!("le_{le}"), json!(v - before.get(k)));
            }
        }
        (m, Value::Object(buckets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
    }

    #[test]
    fn latency_quantiles() {
        let mut l = Latency::new();
        for ms in 1..=100u64 {
            l.record(Duration::from_millis(ms));
        }
        assert!((l.ms_at(0.5) - 50.0).abs() < 0.1);
        assert!((l.ms_at(0.99) - 99.0).abs() < 0.1);
        let cdf = l.cdf();
        assert!(cdf.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        let mut m = Latency::new();
        m.merge(&l);
        assert_eq!(m.0.len(), 100);
    }

    #[test]
    fn metrics_text() {
        let a = StoreMetrics::parse(
            "# HELP x\npalisade_flush_batch_requests_bucket{le=\"1\"} 2\npalisade_flush_batch_requests_sum 3\npalisade_flush_batch_requests_count 2\npalisade_events_appended_total 30\npalisade_kafka_records_total{outcome=\"applied\",partition=\"0\"} 5\npalisade_kafka_records_total{outcome=\"applied\",partition=\"1\"} 6\n",
        );
        let b = StoreMetrics::parse(
            "palisade_flush_batch_requests_bucket{le=\"1\"} 4\npalisade_flush_batch_requests_sum 13\npalisade_flush_batch_requests_count 6\npalisade_events_appended_total 230\n",
        );
        let (m, buckets) = StoreMetrics::flush_delta(&a, &b);
        assert_eq!(m["flushes"], 4.0);
        assert_eq!(m["requests_per_flush"], 2.5);
        assert_eq!(m["events_per_flush"], 50.0);
        assert_eq!(buckets["le_1"], 2.0);
        assert_eq!(
            a.sum("palisade_kafka_records_total", "outcome=\"applied\""),
            11.0
        );
    }

    #[test]
    fn cpu_and_rounding() {
        assert!(process_cpu().is_some());
        assert_eq!(round(123_456.0), 123_500.0);
        assert_eq!(round(0.012_345), 0.012_35);
    }
}
