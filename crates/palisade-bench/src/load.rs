//! The HTTP load generator: writer and reader loops, a warm-up, a measured
//! window (a duration or a request count), HDR latencies, a progress bar.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::stats::{process_cpu, Latency};

/// Phases of a load run (it starts in the warm-up, 0).
pub const MEASURE: u8 = 1;
pub const DONE: u8 = 2;

/// How long a measured window lasts.
#[derive(Debug, Clone, Copy)]
pub enum Window {
    Duration(Duration),
    /// Until this many requests (of the primary kind) completed in the window.
    Requests(u64),
}

/// The events the bench writes: every event carries the same patch of
/// `event_bytes` bytes (compact JSON) and a unique id.
#[derive(Debug, Clone)]
pub struct Events {
    pub patch: String,
    /// Makes event ids unique across bench runs against one store.
    pub nonce: String,
}

impl Events {
    pub fn new(event_bytes: usize) -> Self {
        Self {
            patch: patch_of_size(event_bytes),
            nonce: format!("{:08x}", rand_u64() as u32),
        }
    }

    /// Append the JSON body of `n` events to `out`; ids `<prefix>-<counter>`.
    pub fn body(&self, out: &mut String, prefix: &str, counter: &mut u64, n: usize) {
        use std::fmt::Write as _;
        out.clear();
        if n > 1 {
            out.push('[');
        }
        for i in 0..n {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                "{{\"type\":\"telemetry\",\"event_id\":\"{}-{prefix}-{counter}\",\"patch\":{}}}",
                self.nonce, self.patch
            );
            *counter += 1;
        }
        if n > 1 {
            out.push(']');
        }
    }
}

/// A prefix for event ids that no other loop of this process uses (ids are
/// `<nonce>-<prefix>-<counter>`; a repeated id would be deduplicated).
pub fn unique_prefix(tag: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{tag}{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A patch object whose compact JSON is exactly `bytes` long (at least 9).
pub fn patch_of_size(bytes: usize) -> String {
    let base = "{\"temp\":21.5,\"rpm\":1200,\"status\":\"running\",\"note\":\"\"}";
    if bytes >= base.len() {
        let pad = "x".repeat(bytes - base.len());
        format!("{{\"temp\":21.5,\"rpm\":1200,\"status\":\"running\",\"note\":\"{pad}\"}}")
    } else {
        let small = "{\"n\":\"\"}";
        let pad = "x".repeat(bytes.saturating_sub(small.len()));
        format!("{{\"n\":\"{pad}\"}}")
    }
}

/// A cheap non-cryptographic random number (xorshift seeded per call site).
pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// xorshift64*: picks twins without a shared lock.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new() -> Self {
        Self(rand_u64() | 1)
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // n is at most a few million, far below 2^32.
        ((r >> 32) as usize) % n.max(1)
    }
}

impl Default for Rng {
    fn default() -> Self {
        Self::new()
    }
}

/// What one loop does.
#[derive(Debug, Clone)]
pub enum Op {
    /// `POST /v1/twins/{id}/events` with `batch` events and the twin's token.
    Append { batch: usize },
    /// `GET /v1/twins/{id}`.
    Read,
}

/// One concurrent request loop.
#[derive(Debug, Clone)]
pub struct Loop {
    pub base: String,
    pub op: Op,
    /// (twin id, fencing token) pairs to pick from uniformly.
    pub twins: Arc<Vec<(String, u64)>>,
    pub name: String,
    /// Start a request at most this often (a paced loop, for latency at a
    /// given rate); `None`: back to back.
    pub pace: Option<Duration>,
}

/// Results of one kind of request in the measured window.
#[derive(Debug, Clone, Default)]
pub struct OpStats {
    pub requests: u64,
    pub events: u64,
    pub latency: Latency,
    /// Refusals and failures by `<status> <error>` (or `transport`).
    pub errors: BTreeMap<String, u64>,
}

impl OpStats {
    fn merge(&mut self, o: &OpStats) {
        self.requests += o.requests;
        self.events += o.events;
        self.latency.merge(&o.latency);
        for (k, v) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// Results of a load run.
#[derive(Debug, Clone, Default)]
pub struct LoadResult {
    pub append: OpStats,
    pub read: OpStats,
    /// Length of the measured window.
    pub elapsed: Duration,
    /// Process CPU time used in the window (client and in-process servers).
    pub cpu: Option<Duration>,
}

/// A shared phase flag plus a measured-request counter.
#[derive(Debug, Default)]
pub struct Phase {
    pub phase: AtomicU8,
    pub measured: AtomicU64,
}

impl Phase {
    pub fn get(&self) -> u8 {
        self.phase.load(Ordering::Acquire)
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal), plus a
/// plain line per case so logs show progress too.
pub fn progress(label: &str, window: Window) -> ProgressBar {
    let (len, template) = match window {
        Window::Duration(d) => (
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            "{prefix:>42} [{bar:30}] {elapsed:>3} {msg}",
        ),
        Window::Requests(n) => (n, "{prefix:>42} [{bar:30}] {pos}/{len} {msg}"),
    };
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_owned());
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("bench: {label} ...");
    }
    bar
}

/// Run the warm-up and the measured window, driving `phase` and the bar.
/// `count` gives the primary count (requests or events) for the live rate.
/// Returns the measured window's length and CPU time.
pub async fn drive(
    phase: &Phase,
    warmup: Duration,
    window: Window,
    bar: &ProgressBar,
    count: impl Fn() -> u64,
    on_start: impl std::future::Future<Output = ()>,
) -> (Duration, Option<Duration>) {
    tokio::time::sleep(warmup).await;
    on_start.await;
    let cpu0 = process_cpu();
    let t0 = Instant::now();
    let c0 = count();
    phase.phase.store(MEASURE, Ordering::Release);
    let tick = Duration::from_millis(100);
    loop {
        let el = t0.elapsed();
        let n = count().saturating_sub(c0);
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / el.as_secs_f64().max(1e-3);
        bar.set_message(format!("{:>9}/s", super::plot::label(rate)));
        match window {
            Window::Duration(d) => {
                bar.set_position(u64::try_from(el.as_millis()).unwrap_or(u64::MAX));
                if el >= d {
                    break;
                }
                tokio::time::sleep(tick.min(d - el)).await;
            }
            Window::Requests(target) => {
                let m = phase.measured.load(Ordering::Relaxed);
                bar.set_position(m);
                if m >= target {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    phase.phase.store(DONE, Ordering::Release);
    let elapsed = t0.elapsed();
    let cpu = match (cpu0, process_cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    bar.finish_and_clear();
    (elapsed, cpu)
}

/// Run `loops` concurrently: warm-up, then the measured window.
/// `on_start` runs right before the window opens (e.g. a metrics scrape).
pub async fn run(
    http: &reqwest::Client,
    events: &Events,
    loops: Vec<Loop>,
    warmup: Duration,
    window: Window,
    label: &str,
    on_start: impl std::future::Future<Output = ()>,
) -> anyhow::Result<LoadResult> {
    let phase = Arc::new(Phase::default());
    let live = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let primary_is_append = loops.iter().any(|l| matches!(l.op, Op::Append { .. }));
    for l in loops {
        let (http, events, phase, live) =
            (http.clone(), events.clone(), phase.clone(), live.clone());
        let counts_for_window = matches!(l.op, Op::Append { .. }) == primary_is_append;
        tasks.spawn(
            async move { one_loop(&http, &events, &l, &phase, &live, counts_for_window).await },
        );
    }
    let bar = progress(label, window);
    let (elapsed, cpu) = drive(
        &phase,
        warmup,
        window,
        &bar,
        || live.load(Ordering::Relaxed),
        on_start,
    )
    .await;
    let mut out = LoadResult {
        elapsed,
        cpu,
        ..LoadResult::default()
    };
    while let Some(r) = tasks.join_next().await {
        let (is_append, stats) = r.context("a load task panicked")?;
        if is_append {
            out.append.merge(&stats);
        } else {
            out.read.merge(&stats);
        }
    }
    Ok(out)
}

async fn one_loop(
    http: &reqwest::Client,
    events: &Events,
    l: &Loop,
    phase: &Phase,
    live: &AtomicU64,
    counts_for_window: bool,
) -> (bool, OpStats) {
    let mut stats = OpStats::default();
    let mut rng = Rng::new();
    let mut body = String::new();
    let mut counter = 0u64;
    let prefix = unique_prefix(&l.name);
    let is_append = matches!(l.op, Op::Append { .. });
    if l.twins.is_empty() {
        return (is_append, stats);
    }
    let mut next_start = Instant::now();
    while phase.get() != DONE {
        if let Some(pace) = l.pace {
            // A fixed timeline: a late request does not push the next ones
            // back, so the loop keeps its rate while it can.
            let now = Instant::now();
            if next_start > now {
                tokio::time::sleep(next_start - now).await;
            }
            next_start = next_start.max(now) + pace;
        }
        let (twin, token) = &l.twins[rng.below(l.twins.len())];
        let started = Instant::now();
        let (ok, n, err) = match l.op {
            Op::Append { batch } => {
                events.body(&mut body, &prefix, &mut counter, batch);
                let r = http
                    .post(format!("{}/v1/twins/{twin}/events", l.base))
                    .header("fencing-token", token.to_string())
                    .header("content-type", "application/json")
                    .body(std::mem::take(&mut body))
                    .send()
                    .await;
                finish(r, 201)
                    .await
                    .map_or_else(|e| (false, 0, Some(e)), |()| (true, batch as u64, None))
            }
            Op::Read => {
                let r = http.get(format!("{}/v1/twins/{twin}", l.base)).send().await;
                finish(r, 200)
                    .await
                    .map_or_else(|e| (false, 0, Some(e)), |()| (true, 1, None))
            }
        };
        let took = started.elapsed();
        if phase.get() == MEASURE {
            if ok {
                stats.requests += 1;
                stats.events += n;
                stats.latency.record(took);
                if counts_for_window {
                    phase.measured.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Some(e) = err {
                *stats.errors.entry(e).or_default() += 1;
            }
            if counts_for_window {
                live.fetch_add(n, Ordering::Relaxed);
            }
        } else if let Some(e) = err {
            // Errors outside the window still count: the run is not healthy.
            *stats.errors.entry(format!("{e} (warm-up)")).or_default() += 1;
        }
    }
    (is_append, stats)
}

/// Read the whole response; `Err("<status> <error>")` unless it is `want`.
pub async fn finish(r: Result<reqwest::Response, reqwest::Error>, want: u16) -> Result<(), String> {
    let resp = r.map_err(|e| {
        tracing::debug!(error = %e, "request failed");
        "transport".to_owned()
    })?;
    let status = resp.status().as_u16();
    let body = resp.bytes().await.map_err(|_| "transport".to_owned())?;
    if status == want {
        return Ok(());
    }
    let name = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Err(format!("{status} {name}").trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_have_the_asked_size() {
        for n in [9, 20, 52, 100, 1000] {
            let p = patch_of_size(n);
            assert_eq!(p.len(), n, "{p}");
            let v: serde_json::Value = serde_json::from_str(&p).unwrap();
            assert!(v.is_object());
        }
    }

    #[test]
    fn bodies_are_json_with_unique_ids() {
        let e = Events::new(100);
        let mut s = String::new();
        let mut c = 0;
        e.body(&mut s, "w1", &mut c, 3);
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        let ids: Vec<&str> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids.len(), 3);
        assert_ne!(ids[0], ids[1]);
        e.body(&mut s, "w1", &mut c, 1);
        assert!(serde_json::from_str::<serde_json::Value>(&s)
            .unwrap()
            .is_object());
        assert_eq!(c, 4);
    }

    #[test]
    fn rng_stays_in_range() {
        let mut r = Rng::new();
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
