//! `palisade bench`: load benchmarks of the store over HTTP, each Palisade
//! figure beside its baseline measured in the same run (docs/benchmarks.md).
//!
//! Scenarios: `append` (vs raw sled, a do-nothing axum handler and the
//! PostgreSQL fencing recipe), `read` (GET under concurrent appends vs the
//! do-nothing handler), `ingest` (the Kafka ingester vs raw rdkafka consume),
//! `churn` (lease handovers under load, then a check of the log for stale
//! writes), `scaling` (partitions x twins, recovery time vs log size), `all`.
//!
//! Output: one `BENCH <scenario> key=value ...` line per scenario on stdout,
//! a JSON result file, SVG plots. Exit status non-zero if any request failed
//! unexpectedly or the churn check found a stale write.

mod churn;
pub mod config;
mod kafka;
mod load;
mod plot;
mod postgres;
mod raw_sled;
mod scenarios;
mod stats;
mod target;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use serde_json::{json, Value};

pub use config::{BenchConfig, BenchScenario};
use load::{Events, Window};
use plot::{Chart, Series};
use stats::{Case, Summary};

/// Settings of a bench run, resolved from the flags (defaults, `--quick`).
#[derive(Debug, Clone)]
pub struct Plan {
    pub scenario: BenchScenario,
    pub url: Option<String>,
    pub writers: usize,
    pub partitions: u32,
    pub twins: u64,
    pub event_bytes: usize,
    pub batch: usize,
    pub warmup: Duration,
    pub window: Window,
    pub repeat: usize,
    pub out: PathBuf,
    pub plot_dir: PathBuf,
    pub quick: bool,
    pub kafka_brokers: Option<String>,
    pub ingest_records: u64,
    pub postgres: PgMode,
    pub data_dir: Option<PathBuf>,
    pub churn_duration: Duration,
    pub churn_ttl: Duration,
    pub scaling_partitions: Vec<u32>,
    pub scaling_twins: Vec<u64>,
    pub recovery_sizes: Vec<u64>,
    /// Extra connection counts of the single-event append case.
    pub single_connections: Vec<usize>,
}

/// `--postgres`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgMode {
    Off,
    Auto,
    Url(String),
}

impl Plan {
    pub fn from_config(cfg: &BenchConfig, started: SystemTime) -> anyhow::Result<Self> {
        if !(1..=4096).contains(&cfg.writers) {
            bail!("--writers must be 1..=4096, got {}", cfg.writers);
        }
        if cfg.partitions == 0 || cfg.partitions > palisade_log::MAX_PARTITIONS {
            bail!(
                "--partitions must be 1..={}, got {}",
                palisade_log::MAX_PARTITIONS,
                cfg.partitions
            );
        }
        if !(1..=10_000_000).contains(&cfg.twins) {
            bail!("--twins must be 1..=10000000, got {}", cfg.twins);
        }
        if !(9..=(1 << 20)).contains(&cfg.event_bytes) {
            bail!("--event-bytes must be 9..=1048576, got {}", cfg.event_bytes);
        }
        if !(1..=100_000).contains(&cfg.batch) {
            bail!("--batch must be 1..=100000, got {}", cfg.batch);
        }
        if !(1..=20).contains(&cfg.repeat) {
            bail!("--repeat must be 1..=20, got {}", cfg.repeat);
        }
        let quick = cfg.quick;
        let secs = cfg.duration_secs.unwrap_or(if quick { 0.6 } else { 5.0 });
        if !(secs > 0.0 && secs <= 86_400.0) {
            bail!("--duration-secs must be above 0 and at most 86400, got {secs}");
        }
        let window = match cfg.requests {
            Some(0) => bail!("--requests must be at least 1"),
            Some(n) => Window::Requests(n),
            None => Window::Duration(Duration::from_secs_f64(secs)),
        };
        let warmup = Duration::from_secs_f64(if quick { 0.2 } else { (secs / 5.0).min(1.0) });
        let postgres = match cfg.postgres.trim() {
            "off" | "none" | "" => PgMode::Off,
            "auto" => PgMode::Auto,
            url => PgMode::Url(url.to_owned()),
        };
        let (stamp, _) = utc(started);
        let scenario_name = scenario_name(cfg.scenario);
        let out = cfg.out.clone().unwrap_or_else(|| {
            PathBuf::from(format!("bench-results/{scenario_name}-{stamp}.json"))
        });
        let plot_dir = cfg.plot_dir.clone().unwrap_or_else(|| {
            let stem = out
                .file_stem()
                .map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
            out.with_file_name(format!("{stem}-plots"))
        });
        if let Some(c) = cfg
            .single_connections
            .iter()
            .find(|c| !(1..=4096).contains(*c))
        {
            bail!("--single-connections must each be 1..=4096, got {c}");
        }
        let mut scaling_twins = vec![1_000, 100_000];
        if cfg.million_twins {
            scaling_twins.push(1_000_000);
        }
        Ok(Self {
            scenario: cfg.scenario,
            url: cfg.url.clone(),
            writers: cfg.writers,
            partitions: cfg.partitions,
            twins: cfg.twins,
            event_bytes: cfg.event_bytes,
            batch: cfg.batch,
            warmup,
            window,
            repeat: cfg.repeat,
            out,
            plot_dir,
            quick,
            kafka_brokers: cfg.kafka_brokers.clone(),
            ingest_records: cfg
                .ingest_records
                .unwrap_or(if quick { 20_000 } else { 200_000 })
                .max(1),
            postgres,
            data_dir: cfg.data_dir.clone(),
            churn_duration: Duration::from_secs_f64(if quick {
                2.5
            } else {
                (secs * 2.0).max(5.0)
            }),
            churn_ttl: Duration::from_millis(if quick { 150 } else { 300 }),
            scaling_partitions: vec![1, 4, 16, 64],
            scaling_twins,
            single_connections: cfg.single_connections.clone(),
            recovery_sizes: if quick {
                vec![1_000, 10_000]
            } else {
                vec![10_000, 100_000, 1_000_000]
            },
        })
    }

    fn to_json(&self) -> Value {
        json!({
            "url": self.url,
            "writers": self.writers,
            "partitions": self.partitions,
            "twins": self.twins,
            "event_bytes": self.event_bytes,
            "batch": self.batch,
            "warmup_s": self.warmup.as_secs_f64(),
            "window": match self.window {
                Window::Duration(d) => json!({"seconds": d.as_secs_f64()}),
                Window::Requests(n) => json!({"requests": n}),
            },
            "repeat": self.repeat,
            "quick": self.quick,
            "kafka_brokers": self.kafka_brokers,
            "ingest_records": self.ingest_records,
            "postgres": format!("{:?}", self.postgres),
            "churn_duration_s": self.churn_duration.as_secs_f64(),
            "churn_ttl_ms": self.churn_ttl.as_millis(),
            "scaling_partitions": self.scaling_partitions,
            "scaling_twins": self.scaling_twins,
            "recovery_sizes": self.recovery_sizes,
            "single_connections": self.single_connections,
        })
    }
}

fn scenario_name(s: BenchScenario) -> &'static str {
    match s {
        BenchScenario::Append => "append",
        BenchScenario::Read => "read",
        BenchScenario::Ingest => "ingest",
        BenchScenario::Churn => "churn",
        BenchScenario::Scaling => "scaling",
        BenchScenario::All => "all",
    }
}

/// The PostgreSQL baseline's server, started on first use.
#[derive(Debug)]
enum PgState {
    Skip,
    Url(String),
    Server(postgres::PgServer),
}

/// What the scenarios share.
#[derive(Debug)]
pub struct Ctx {
    pub plan: Plan,
    pub rt: target::ServerRuntime,
    pub http: reqwest::Client,
    pub events: Events,
    pg: tokio::sync::OnceCell<PgState>,
    broker: tokio::sync::OnceCell<kafka::Broker>,
    notices: Mutex<Vec<String>>,
    pg_notes: Mutex<Option<Value>>,
}

impl Ctx {
    fn notice(&self, text: String) {
        eprintln!("bench: NOTICE: {text}");
        self.notices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(text);
    }

    /// The PostgreSQL baseline's connection string with fresh tables for
    /// `twins`, or `None` when the baseline is off or not installed.
    pub async fn postgres_conn(&self, twins: &target::Twins) -> anyhow::Result<Option<String>> {
        let state = self
            .pg
            .get_or_try_init(|| async {
                match &self.plan.postgres {
                    PgMode::Off => {
                        self.notice("the PostgreSQL baseline is off (--postgres off)".into());
                        anyhow::Ok(PgState::Skip)
                    }
                    PgMode::Url(u) => Ok(PgState::Url(u.clone())),
                    PgMode::Auto => match postgres::find_bin_dir() {
                        None => {
                            self.notice("PostgreSQL is not installed (no initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin): skipping ONLY the PostgreSQL baseline; install it with `apt-get install -y postgresql` to measure it".into());
                            Ok(PgState::Skip)
                        }
                        Some(bin) => {
                            eprintln!("bench: starting a throwaway PostgreSQL from {}", bin.display());
                            let base = self.plan.data_dir.clone();
                            let server = tokio::task::spawn_blocking(move || {
                                postgres::PgServer::start(&bin, base.as_deref())
                            })
                            .await
                            .context("postgres start task")?
                            .context("PostgreSQL is installed but the throwaway server did not start")?;
                            Ok(PgState::Server(server))
                        }
                    },
                }
            })
            .await?;
        let conn = match state {
            PgState::Skip => return Ok(None),
            PgState::Url(u) => u.clone(),
            PgState::Server(s) => s.conn.clone(),
        };
        let mut notes = postgres::prepare(&conn, twins).await?;
        if let PgState::Server(s) = state {
            notes["server"] = json!(format!("throwaway ({}), started by the bench", s.version));
        }
        *self
            .pg_notes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(notes);
        Ok(Some(conn))
    }

    /// The Kafka broker, started (mock) or named (`--kafka-brokers`) on first use.
    pub async fn broker(&self) -> anyhow::Result<&kafka::Broker> {
        self.broker
            .get_or_try_init(|| async {
                match &self.plan.kafka_brokers {
                    Some(b) => anyhow::Ok(kafka::Broker::External(b.clone())),
                    None => {
                        let m = tokio::task::spawn_blocking(kafka::MockKafka::start)
                            .await
                            .context("mock kafka start task")??;
                        eprintln!("bench: mock Kafka cluster on {}", m.bootstrap);
                        Ok(kafka::Broker::Mock(m))
                    }
                }
            })
            .await
    }
}

/// `palisade bench`.
pub async fn run(cfg: BenchConfig) -> anyhow::Result<()> {
    let started_at = SystemTime::now();
    let started = Instant::now();
    let plan = Plan::from_config(&cfg, started_at)?;
    let load_before = stats::loadavg();
    eprintln!(
        "bench: load average {load_before}; {} core(s); results -> {}",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        plan.out.display()
    );
    let ctx = Ctx {
        events: Events::new(plan.event_bytes),
        rt: target::ServerRuntime::new()?,
        http: target::http_client()?,
        plan,
        pg: tokio::sync::OnceCell::new(),
        broker: tokio::sync::OnceCell::new(),
        notices: Mutex::new(Vec::new()),
        pg_notes: Mutex::new(None),
    };
    if let Some(url) = &ctx.plan.url {
        ctx.notice(format!(
            "loading the running store at {url}; --partitions is ignored (the store has its own count)"
        ));
    }
    let scenarios = match ctx.plan.scenario {
        BenchScenario::All => vec![
            BenchScenario::Append,
            BenchScenario::Read,
            BenchScenario::Ingest,
            BenchScenario::Churn,
            BenchScenario::Scaling,
        ],
        s => vec![s],
    };
    let mut failures: Vec<String> = Vec::new();
    let mut results: BTreeMap<&'static str, (BTreeMap<String, f64>, Vec<Summary>)> =
        BTreeMap::new();
    let mut order = Vec::new();
    for s in scenarios {
        let name = scenario_name(s);
        let mut runs: Vec<Case> = Vec::new();
        let mut scenario_failures = Vec::new();
        let mut error = None;
        for r in 0..ctx.plan.repeat {
            if ctx.plan.repeat > 1 {
                eprintln!("bench: {name} run {}/{}", r + 1, ctx.plan.repeat);
            }
            let out = match s {
                BenchScenario::Append => scenarios::append(&ctx).await,
                BenchScenario::Read => scenarios::read(&ctx).await,
                BenchScenario::Ingest => scenarios::ingest(&ctx, r).await,
                BenchScenario::Churn => scenarios::churn(&ctx).await,
                BenchScenario::Scaling => scenarios::scaling(&ctx).await,
                BenchScenario::All => Ok(scenarios::RunOut::default()),
            };
            match out {
                Ok(o) => {
                    runs.extend(o.cases);
                    scenario_failures.extend(o.failures);
                }
                Err(e) => {
                    error = Some(format!("{e:#}"));
                    break;
                }
            }
        }
        let summaries = summarize(runs);
        let headline = headline(s, &summaries);
        let ok = error.is_none() && scenario_failures.is_empty();
        let mut line = format!("BENCH {name}");
        for (k, v) in &headline {
            let _ = write!(line, " {k}={}", fmt_num(*v));
        }
        if let Some(e) = &error {
            let _ = write!(line, " error={:?}", e);
        }
        let _ = write!(line, " ok={}", u8::from(ok));
        println!("{line}");
        for f in &scenario_failures {
            eprintln!("bench: FAILED: {f}");
        }
        if let Some(e) = error {
            eprintln!("bench: {name} failed: {e}");
            failures.push(format!("{name}: {e}"));
        }
        failures.extend(scenario_failures);
        order.push(name);
        results.insert(name, (headline, summaries));
    }
    let load_after = stats::loadavg();
    let plots = write_plots(&ctx.plan.plot_dir, &results)?;
    let report = json!({
        "tool": "palisade bench",
        "version": env!("CARGO_PKG_VERSION"),
        "scenario": scenario_name(ctx.plan.scenario),
        "started_at": utc(started_at).1,
        "wall_seconds": stats::round(started.elapsed().as_secs_f64()),
        "machine": machine(&load_before, &load_after),
        "settings": ctx.plan.to_json(),
        "notices": *ctx.notices.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        "postgres": *ctx.pg_notes.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        "failures": failures,
        "plots": plots.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "scenarios": order.iter().map(|n| {
            let (headline, sums) = &results[n];
            ((*n).to_owned(), json!({
                "summary": stats::finite_map(headline),
                "cases": sums.iter().map(|s| (s.name.clone(), s.to_json())).collect::<serde_json::Map<_, _>>(),
            }))
        }).collect::<serde_json::Map<_, _>>(),
    });
    if let Some(dir) = ctx.plan.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&ctx.plan.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("cannot write {}", ctx.plan.out.display()))?;
    eprintln!(
        "bench: wrote {} and {} plot(s) in {}; {:.1} s; load average {load_before} -> {load_after}",
        ctx.plan.out.display(),
        plots.len(),
        ctx.plan.plot_dir.display(),
        started.elapsed().as_secs_f64()
    );
    // Servers, PostgreSQL and the mock broker stop here. librdkafka closes
    // its clients in the background: give them a moment before the mock
    // broker goes, or they log "all brokers down" on the way out.
    if ctx.broker.initialized() {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(ctx);
    if !failures.is_empty() {
        bail!("{} failure(s): {}", failures.len(), failures.join("; "));
    }
    Ok(())
}

/// Group the cases of all runs by name, in first-seen order.
fn summarize(runs: Vec<Case>) -> Vec<Summary> {
    let mut names: Vec<String> = Vec::new();
    let mut groups: BTreeMap<String, Vec<Case>> = BTreeMap::new();
    for c in runs {
        if !groups.contains_key(&c.name) {
            names.push(c.name.clone());
        }
        groups.entry(c.name.clone()).or_default().push(c);
    }
    names
        .into_iter()
        .filter_map(|n| {
            let cases = groups.remove(&n)?;
            let primary = [
                "events_per_s",
                "reads_per_s",
                "records_per_s",
                "open_to_first_read_ms",
            ]
            .into_iter()
            .find(|k| cases.iter().any(|c| c.metrics.contains_key(*k)))
            .unwrap_or("events_per_s");
            Some(Summary::of(cases, primary))
        })
        .collect()
}

fn find<'a>(sums: &'a [Summary], name: &str) -> Option<&'a Summary> {
    sums.iter().find(|s| s.name == name)
}

/// The scenario's summary line (medians).
fn headline(s: BenchScenario, sums: &[Summary]) -> BTreeMap<String, f64> {
    let mut h = BTreeMap::new();
    let mut put = |k: &str, v: Option<f64>| {
        h.insert(k.to_owned(), v.unwrap_or(f64::NAN));
    };
    match s {
        BenchScenario::Append => {
            // The batched case is the headline; the single-event one follows.
            let batched = sums
                .iter()
                .filter(|x| x.name.ends_with("/palisade"))
                .max_by_key(|x| batch_of(&x.name));
            let single = find(sums, "append/batch=1/palisade");
            if let Some(b) = batched {
                put("batch", Some(batch_of(&b.name) as f64));
                for k in [
                    "events_per_s",
                    "requests_per_s",
                    "p50_ms",
                    "p99_ms",
                    "p999_ms",
                    "events_per_flush",
                    "requests_per_flush",
                    "ratio_vs_raw_sled",
                    "ratio_vs_http_null",
                    "ratio_vs_postgres",
                    "ratio_vs_store_direct",
                ] {
                    put(k, b.get(k));
                }
            }
            if let Some(one) = single {
                for k in [
                    "events_per_s",
                    "p99_ms",
                    "ratio_vs_raw_sled",
                    "ratio_vs_http_null",
                    "ratio_vs_postgres",
                ] {
                    put(&format!("single_{k}"), one.get(k));
                }
            }
            for x in sums.iter().filter(|x| {
                x.name.starts_with("append/batch=1/conns=") && x.name.ends_with("/palisade")
            }) {
                let conns = x
                    .name
                    .split('/')
                    .find_map(|p| p.strip_prefix("conns="))
                    .unwrap_or("?");
                for k in [
                    "events_per_s",
                    "p99_ms",
                    "ratio_vs_raw_sled",
                    "ratio_vs_http_null",
                    "ratio_vs_postgres",
                ] {
                    put(&format!("single_c{conns}_{k}"), x.get(k));
                }
            }
        }
        BenchScenario::Read => {
            if let Some(r) = find(sums, "read/palisade") {
                for k in [
                    "reads_per_s",
                    "p50_ms",
                    "p99_ms",
                    "p999_ms",
                    "ratio_vs_http_null",
                    "concurrent_append_events_per_s",
                ] {
                    put(k, r.get(k));
                }
            }
            if let Some(r) = find(sums, "read/idle/palisade") {
                for k in ["reads_per_s", "p99_ms", "ratio_vs_http_null"] {
                    put(&format!("idle_{k}"), r.get(k));
                }
            }
            if let Some(r) = find(sums, "read/half_load/palisade") {
                for k in ["reads_per_s", "p50_ms", "p99_ms", "append_p99_ms"] {
                    put(&format!("half_load_{k}"), r.get(k));
                }
            }
        }
        BenchScenario::Ingest => {
            let p = find(sums, "ingest/palisade");
            let r = find(sums, "ingest/raw_consume");
            put("records_per_s", p.and_then(|x| x.get("records_per_s")));
            put("raw_records_per_s", r.and_then(|x| x.get("records_per_s")));
            put(
                "ratio_vs_raw_consume",
                p.and_then(|x| x.get("ratio_vs_raw_consume")),
            );
            put(
                "seconds_to_first_record",
                p.and_then(|x| x.get("seconds_to_first_record")),
            );
            put("max_lag_records", p.and_then(|x| x.get("max_lag_records")));
            let d = find(sums, "ingest/palisade_librdkafka_default");
            put(
                "librdkafka_default_records_per_s",
                d.and_then(|x| x.get("records_per_s")),
            );
            put(
                "librdkafka_default_ratio_vs_murmur2",
                d.and_then(|x| x.get("ratio_vs_murmur2")),
            );
        }
        BenchScenario::Churn => {
            if let Some(c) = find(sums, "churn/palisade") {
                for k in [
                    "events_per_s",
                    "handovers",
                    "stale_rejection_rate",
                    "stale_rate_after_replacement",
                    "log_events_checked",
                ] {
                    put(k, c.get(k));
                }
                let worst = c
                    .runs
                    .iter()
                    .filter_map(|r| r.get("violations"))
                    .fold(0.0, f64::max);
                put("violations", Some(worst));
            }
        }
        BenchScenario::Scaling => {
            let pal: Vec<&Summary> = sums
                .iter()
                .filter(|x| x.name.starts_with("scaling/") && x.name.ends_with("/palisade"))
                .collect();
            let eps: Vec<f64> = pal.iter().filter_map(|x| x.get("events_per_s")).collect();
            let cpu: Vec<f64> = pal
                .iter()
                .filter_map(|x| x.get("cpu_us_per_event"))
                .collect();
            let min = eps.iter().copied().reduce(f64::min);
            let max = eps.iter().copied().reduce(f64::max);
            put("min_events_per_s", min);
            put("max_events_per_s", max);
            put("min_over_max", min.zip(max).map(|(a, b)| a / b));
            put("min_cpu_us_per_event", cpu.iter().copied().reduce(f64::min));
            put("max_cpu_us_per_event", cpu.iter().copied().reduce(f64::max));
            if let Some(r) = sums
                .iter()
                .filter(|x| x.name.starts_with("recovery/"))
                .max_by(|a, b| {
                    a.get("events")
                        .unwrap_or(0.0)
                        .total_cmp(&b.get("events").unwrap_or(0.0))
                })
            {
                put("recovery_events", r.get("events"));
                put("recovery_ms", r.get("open_to_first_read_ms"));
            }
        }
        BenchScenario::All => {}
    }
    h
}

fn batch_of(name: &str) -> usize {
    name.split('/')
        .find_map(|p| p.strip_prefix("batch="))
        .and_then(|b| b.parse().ok())
        .unwrap_or(0)
}

fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "na".into();
    }
    let r = stats::round(v);
    if r.abs() >= 1000.0 || r.fract() == 0.0 {
        format!("{r:.0}")
    } else {
        let s = format!("{r:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// Write the plots of the scenarios that ran; returns their paths.
fn write_plots(
    dir: &Path,
    results: &BTreeMap<&'static str, (BTreeMap<String, f64>, Vec<Summary>)>,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut charts: Vec<(&str, Chart)> = Vec::new();
    let cdf_chart = |title: &str, sums: Vec<&Summary>| Chart {
        title: title.into(),
        subtitle:
            "fraction of requests completed within a latency (HDR histogram, all runs merged)"
                .into(),
        x_label: "latency (ms, log scale)".into(),
        y_label: "fraction of requests".into(),
        x_log: true,
        series: sums
            .iter()
            .filter_map(|s| {
                Some(Series::new(
                    s.name.clone(),
                    s.latency.as_ref()?.cdf(),
                    false,
                ))
            })
            .collect(),
        ..Chart::default()
    };
    if let Some((_, sums)) = results.get("append") {
        let max_batch = sums.iter().map(|s| batch_of(&s.name)).max().unwrap_or(1);
        let mut pick: Vec<&Summary> = sums
            .iter()
            .filter(|s| batch_of(&s.name) == max_batch)
            .collect();
        if max_batch > 1 {
            pick.extend(find(sums, "append/batch=1/palisade"));
        }
        charts.push((
            "latency-cdf",
            cdf_chart("Append latency: Palisade vs baselines", pick),
        ));
    }
    if let Some((_, sums)) = results.get("read") {
        charts.push((
            "read-latency-cdf",
            cdf_chart(
                "GET twin latency under concurrent appends",
                sums.iter().collect(),
            ),
        ));
    }
    if let Some((_, sums)) = results.get("ingest") {
        let series = sums
            .iter()
            .map(|s| Series::new(s.name.clone(), s.series.clone(), false))
            .collect();
        charts.push((
            "ingest-vs-raw",
            Chart {
                title: "Kafka ingest vs raw consume of the same records".into(),
                subtitle: "records done against seconds since the first record (median run)".into(),
                x_label: "seconds since the first record".into(),
                y_label: "records".into(),
                series,
                ..Chart::default()
            },
        ));
    }
    if let Some((_, sums)) = results.get("scaling") {
        let mut by_twins: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
        let mut cpu_by_twins: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
        let mut raw = Vec::new();
        let mut recovery = Vec::new();
        let mut parts = Vec::new();
        for s in sums {
            let p = s.get("partitions");
            if s.name.ends_with("/raw_sled") {
                if let (Some(p), Some(e)) = (p, s.get("events_per_s")) {
                    raw.push((p, e));
                    parts.push(p);
                }
            } else if s.name.ends_with("/palisade") {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let t = s.get("twins").unwrap_or(0.0) as u64;
                if let (Some(p), Some(e)) = (p, s.get("events_per_s")) {
                    by_twins.entry(t).or_default().push((p, e));
                }
                if let (Some(p), Some(c)) = (p, s.get("cpu_us_per_event")) {
                    cpu_by_twins.entry(t).or_default().push((p, c));
                }
            } else if s.name.starts_with("recovery/") {
                if let (Some(n), Some(ms)) = (s.get("events"), s.get("open_to_first_read_ms")) {
                    recovery.push((n, ms));
                }
            }
        }
        parts.sort_by(f64::total_cmp);
        parts.dedup();
        let mut series: Vec<Series> = by_twins
            .iter()
            .map(|(t, pts)| {
                Series::new(
                    format!("Palisade, {} twins", plot::label(*t as f64)),
                    pts.clone(),
                    true,
                )
            })
            .collect();
        series.push(Series::new("raw sled (no fencing, no HTTP)", raw, true));
        charts.push((
            "throughput-vs-partitions",
            Chart {
                title: "Append throughput vs partitions (batched, over HTTP)".into(),
                subtitle:
                    "events/s, median of runs; raw sled = batch insert + flush of the same events"
                        .into(),
                x_label: "partitions (log scale)".into(),
                y_label: "events/s".into(),
                x_log: true,
                x_ticks: Some(parts.clone()),
                series,
                ..Chart::default()
            },
        ));
        charts.push((
            "cpu-per-event-vs-partitions",
            Chart {
                title: "CPU per appended event vs partitions".into(),
                subtitle: "process CPU (client + server, in-process) / events, median of runs"
                    .into(),
                x_label: "partitions (log scale)".into(),
                y_label: "CPU µs per event".into(),
                x_log: true,
                x_ticks: Some(parts),
                series: cpu_by_twins
                    .iter()
                    .map(|(t, pts)| {
                        Series::new(
                            format!("{} twins", plot::label(*t as f64)),
                            pts.clone(),
                            true,
                        )
                    })
                    .collect(),
                ..Chart::default()
            },
        ));
        if !recovery.is_empty() {
            charts.push((
                "recovery-vs-log-size",
                Chart {
                    title: "Restart: Store::open to first successful read".into(),
                    subtitle: "a closed store reopened, against the events in its log".into(),
                    x_label: "events in the log (log scale)".into(),
                    y_label: "ms".into(),
                    x_log: true,
                    series: vec![Series::new("open + first read", recovery, true)],
                    ..Chart::default()
                },
            ));
        }
    }
    let mut written = Vec::new();
    if charts.is_empty() {
        return Ok(written);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (name, chart) in charts {
        let path = dir.join(format!("{name}.svg"));
        std::fs::write(&path, chart.svg())
            .with_context(|| format!("cannot write {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn machine(load_before: &str, load_after: &str) -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    let mem = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_owned())
        .unwrap_or_default();
    json!({
        "nproc": std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        "cpu_model": model,
        "mem_total_kb": mem,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    })
}

/// (`20260520T122300Z`, `2026-05-20T12:23:00Z`) for a time.
fn utc(t: SystemTime) -> (String, String) {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    (
        format!("{y:04}{mo:02}{d:02}T{h:02}{m:02}{s:02}Z"),
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_779_279_780);
        assert_eq!(utc(t).1, "2026-05-20T12:23:00Z");
        assert_eq!(utc(SystemTime::UNIX_EPOCH).0, "19700101T000000Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(utc(leap).1, "2000-02-29T00:00:00Z");
    }

    #[test]
    fn numbers_for_the_summary_line() {
        assert_eq!(fmt_num(123_456.7), "123500");
        assert_eq!(fmt_num(0.456_78), "0.4568");
        assert_eq!(fmt_num(f64::NAN), "na");
        assert_eq!(fmt_num(12.0), "12");
        assert_eq!(batch_of("append/batch=100/palisade"), 100);
    }

    #[test]
    fn headline_of_append() {
        let mut pal = Case::new("append/batch=100/palisade");
        pal.set("events_per_s", 1000.0);
        pal.set("ratio_vs_raw_sled", 0.5);
        let mut one = Case::new("append/batch=1/palisade");
        one.set("events_per_s", 10.0);
        let sums = summarize(vec![pal.clone(), one, pal]);
        let h = headline(BenchScenario::Append, &sums);
        assert_eq!(h["events_per_s"], 1000.0);
        assert_eq!(h["single_events_per_s"], 10.0);
        assert_eq!(h["batch"], 100.0);
        assert!(h["ratio_vs_postgres"].is_nan());
    }
}
