//! One run of each scenario: Palisade's cases and their baselines, back to
//! back, as `Case`s (medians across repeats are taken by the caller).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use palisade_core::{NewEvent, PartitionId, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::AsOf;
use serde_json::json;

use super::load::{self, LoadResult, Loop, Op};
use super::stats::{Case, StoreMetrics};
use super::target::{self, Held, NullServer, StoreServer, Twins};
use super::{kafka, postgres, raw_sled, Ctx};

/// Lease TTL for the load scenarios: far longer than any case.
const LOAD_TTL: Duration = Duration::from_secs(600);

/// What one scenario run produced.
#[derive(Debug, Default)]
pub struct RunOut {
    pub cases: Vec<Case>,
    /// Unexpected errors or safety violations: the bench exits non-zero.
    pub failures: Vec<String>,
}

#[allow(clippy::cast_precision_loss)]
fn f(n: u64) -> f64 {
    n as f64
}

/// Events/s, requests/s, latencies, errors and CPU of a load result's appends.
fn append_case(name: &str, r: &LoadResult) -> Case {
    let mut c = Case::new(name);
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    c.set("events_per_s", f(r.append.events) / secs);
    c.set("requests_per_s", f(r.append.requests) / secs);
    c.set("events", f(r.append.events));
    c.set("requests", f(r.append.requests));
    c.set("seconds", secs);
    c.set("errors", f(r.append.error_count()));
    if let Some(cpu) = r.cpu {
        if r.append.events > 0 {
            c.set(
                "cpu_us_per_event",
                cpu.as_secs_f64() * 1e6 / f(r.append.events),
            );
        }
        c.set("cpu_cores_busy", cpu.as_secs_f64() / secs);
    }
    r.append.latency.put_metrics(&mut c.metrics, "");
    c.latency = Some(r.append.latency.clone());
    if !r.append.errors.is_empty() {
        c.note("errors", json!(r.append.errors));
    }
    c
}

/// Set `key` on `c` to `c[metric] / base[metric]`.
fn ratio(c: &mut Case, key: &str, metric: &str, base: &Case) {
    if let (Some(n), Some(d)) = (c.get(metric), base.get(metric)) {
        if d > 0.0 {
            c.set(key, n / d);
        }
    }
}

/// The store for one run: a fresh in-process store, or `--url`.
async fn store_for_run(ctx: &Ctx, partitions: u32) -> anyhow::Result<StoreServer> {
    match &ctx.plan.url {
        Some(url) => StoreServer::remote(url, &ctx.http).await,
        None => {
            StoreServer::start(
                &ctx.rt.handle(),
                ctx.plan.data_dir.as_deref(),
                partitions,
                ctx.plan.batch,
            )
            .await
        }
    }
}

/// Writer loops over `store` (or over `base`, for the do-nothing server).
fn writer_loops(
    base: &str,
    twins: &Twins,
    per_writer: &[Vec<u32>],
    tokens: &[u64],
    batch: usize,
    name: &str,
) -> Vec<Loop> {
    per_writer
        .iter()
        .map(|mine| Loop {
            base: base.to_owned(),
            op: Op::Append { batch },
            twins: Arc::new(
                mine.iter()
                    .map(|i| {
                        let i = *i as usize;
                        (
                            twins.ids[i].clone(),
                            tokens
                                .get(twins.partition[i] as usize)
                                .copied()
                                .unwrap_or(0),
                        )
                    })
                    .collect(),
            ),
            name: name.to_owned(),
            pace: None,
        })
        .collect()
}

fn tokens_of(held: &[Held], partitions: u32) -> Vec<u64> {
    let mut t = vec![0; partitions as usize];
    for h in held {
        if let Some(slot) = t.get_mut(h.partition as usize) {
            *slot = h.token;
        }
    }
    t
}

/// Run Palisade appends with a `/metrics` scrape around the window.
async fn palisade_append(
    ctx: &Ctx,
    store: &StoreServer,
    loops: Vec<Loop>,
    name: &str,
) -> anyhow::Result<Case> {
    let mut before: Option<StoreMetrics> = None;
    let r = load::run(
        &ctx.http,
        &ctx.events,
        loops,
        ctx.plan.warmup,
        ctx.plan.window,
        name,
        async {
            before = store.metrics(&ctx.http).await.ok();
        },
    )
    .await?;
    let after = store.metrics(&ctx.http).await?;
    let mut c = append_case(name, &r);
    if let Some(before) = before {
        let (m, buckets) = StoreMetrics::flush_delta(&before, &after);
        c.metrics.extend(m);
        c.note("flush_batch_requests_buckets", buckets);
    }
    // Every event id is unique: a deduplicated event means the load was not
    // what it claims (and would flatter the store).
    if c.get("store_events_deduplicated").unwrap_or(0.0) > 0.0 {
        c.set("errors", c.get("errors").unwrap_or(0.0) + 1.0);
        c.note(
            "dedupe",
            json!("the store deduplicated events of this run: event ids collided"),
        );
    }
    Ok(c)
}

/// Diagnostic, not a baseline: the same appends as `palisade`, but calling
/// `Store::append` in-process (no HTTP, no JSON), from the same number of
/// concurrent tasks. Splits Palisade's cost into HTTP and store.
async fn direct_append(
    ctx: &Ctx,
    store: &Arc<palisade_log::Store>,
    twins: &Twins,
    per_writer: &[Vec<u32>],
    tokens: &[u64],
    batch: usize,
    name: &str,
) -> anyhow::Result<Case> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let patch: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&ctx.events.patch).context("bench patch")?;
    let phase = Arc::new(load::Phase::default());
    let live = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for mine in per_writer {
        let mine: Vec<(TwinId, u64)> = mine
            .iter()
            .map(|i| {
                let i = *i as usize;
                Ok((
                    TwinId::new(twins.ids[i].clone())?,
                    tokens[twins.partition[i] as usize],
                ))
            })
            .collect::<anyhow::Result<_>>()?;
        let (store, patch, phase, live) =
            (store.clone(), patch.clone(), phase.clone(), live.clone());
        let prefix = format!("{}-{}", ctx.events.nonce, load::unique_prefix("d"));
        set.spawn(async move {
            let mut stats = load::OpStats::default();
            let mut rng = load::Rng::new();
            let mut counter = 0u64;
            while phase.get() != load::DONE && !mine.is_empty() {
                let (twin, token) = &mine[rng.below(mine.len())];
                let events: Vec<NewEvent> = (0..batch)
                    .map(|_| {
                        counter += 1;
                        NewEvent {
                            event_id: format!("{prefix}-{counter}"),
                            event_type: "telemetry".into(),
                            patch: patch.clone(),
                            hlc: None,
                        }
                    })
                    .collect();
                let started = Instant::now();
                let r = store
                    .append(
                        twin.clone(),
                        palisade_core::FencingToken(*token),
                        events,
                        None,
                    )
                    .await;
                if phase.get() == load::MEASURE {
                    match r {
                        Ok(_) => {
                            stats.requests += 1;
                            stats.events += batch as u64;
                            stats.latency.record(started.elapsed());
                            phase.measured.fetch_add(1, Ordering::Relaxed);
                            live.fetch_add(batch as u64, Ordering::Relaxed);
                        }
                        Err(e) => *stats.errors.entry(e.reason().to_owned()).or_default() += 1,
                    }
                }
            }
            stats
        });
    }
    let bar = load::progress(name, ctx.plan.window);
    let (elapsed, cpu) = load::drive(
        &phase,
        ctx.plan.warmup,
        ctx.plan.window,
        &bar,
        || live.load(Ordering::Relaxed),
        async {},
    )
    .await;
    let mut r = LoadResult {
        elapsed,
        cpu,
        ..LoadResult::default()
    };
    while let Some(s) = set.join_next().await {
        let s = s.context("a direct append task panicked")?;
        r.append.requests += s.requests;
        r.append.events += s.events;
        r.append.latency.merge(&s.latency);
        for (k, v) in s.errors {
            *r.append.errors.entry(k).or_default() += v;
        }
    }
    Ok(append_case(name, &r))
}

/// `append`: single events and batches, each beside raw sled, the do-nothing
/// handler and the PostgreSQL recipe.
pub async fn append(ctx: &Ctx) -> anyhow::Result<RunOut> {
    let plan = &ctx.plan;
    let mut out = RunOut::default();
    let store = store_for_run(ctx, plan.partitions).await?;
    let p = store.partitions;
    let held = target::acquire_partitions(
        &store.url,
        p,
        plan.writers,
        &format!("bench-{}", ctx.events.nonce),
        LOAD_TTL,
    )
    .await?;
    let tokens = tokens_of(&held, p);
    let twins = Twins::new(plan.twins, p)?;
    let null = NullServer::start(&ctx.rt.handle(), axum::body::Bytes::from_static(b"{}"))?;
    let pg_conn = ctx.postgres_conn(&twins).await?;
    // (batch, connections): single events at W, then at each of
    // `--single-connections` (32 and 64 by default), then batches at W.
    let mut configs = vec![(1, plan.writers)];
    for &c in &plan.single_connections {
        if !configs.contains(&(1, c)) {
            configs.push((1, c));
        }
    }
    if plan.batch > 1 {
        configs.push((plan.batch, plan.writers));
    }
    for (batch, conns) in configs {
        let per_writer = twins.per_writer(p, conns);
        // The default connection count keeps its historical case names.
        let prefix = if conns == plan.writers {
            format!("append/batch={batch}")
        } else {
            format!("append/batch={batch}/conns={conns}")
        };
        let loops = writer_loops(&store.url, &twins, &per_writer, &tokens, batch, "w");
        let mut pal = palisade_append(ctx, &store, loops, &format!("{prefix}/palisade")).await?;
        pal.set("connections", conns as f64);
        if let (Some(st), true) = (&store.store, conns == plan.writers) {
            let mut direct = direct_append(
                ctx,
                st,
                &twins,
                &per_writer,
                &tokens,
                batch,
                &format!("{prefix}/store_direct"),
            )
            .await?;
            direct.note(
                "what",
                json!("diagnostic: Store::append in-process, no HTTP; not a baseline"),
            );
            ratio(&mut pal, "ratio_vs_store_direct", "events_per_s", &direct);
            if direct.get("errors").unwrap_or(0.0) > 0.0 {
                out.failures.push(format!(
                    "{prefix}/store_direct: {} appends failed: {}",
                    direct.get("errors").unwrap_or(0.0),
                    direct
                        .notes
                        .get("errors")
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ));
            }
            out.cases.push(direct);
        }
        let raw = raw_sled::run(
            plan.data_dir.as_deref(),
            p,
            conns,
            batch,
            &ctx.events,
            plan.warmup,
            plan.window,
            &format!("{prefix}/raw_sled"),
        )
        .await?;
        let raw = append_case(&format!("{prefix}/raw_sled"), &raw);
        let null_loops = writer_loops(&null.url, &twins, &per_writer, &tokens, batch, "n");
        let nr = load::run(
            &ctx.http,
            &ctx.events,
            null_loops,
            plan.warmup,
            plan.window,
            &format!("{prefix}/http_null"),
            async {},
        )
        .await?;
        let null_case = append_case(&format!("{prefix}/http_null"), &nr);
        ratio(&mut pal, "ratio_vs_raw_sled", "events_per_s", &raw);
        ratio(&mut pal, "ratio_vs_http_null", "events_per_s", &null_case);
        if let Some(conn) = &pg_conn {
            let r = postgres::run(
                conn,
                &twins,
                &per_writer,
                batch,
                &ctx.events,
                plan.warmup,
                plan.window,
                &format!("{prefix}/postgres"),
            )
            .await?;
            let mut pg = append_case(&format!("{prefix}/postgres"), &r);
            pg.note(
                "cpu_scope",
                json!("cpu_* counts the bench process only: PostgreSQL runs in its own processes"),
            );
            ratio(&mut pal, "ratio_vs_postgres", "events_per_s", &pg);
            if r.append.error_count() > 0 {
                out.failures.push(format!(
                    "{prefix}/postgres: {} failed transactions: {:?}",
                    r.append.error_count(),
                    r.append.errors
                ));
            }
            out.cases.push(pg);
        }
        if pal.get("errors").unwrap_or(0.0) > 0.0 {
            out.failures.push(format!(
                "{prefix}/palisade: {} requests failed: {}",
                pal.get("errors").unwrap_or(0.0),
                pal.notes
                    .get("errors")
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ));
        }
        out.cases.push(pal);
        out.cases.push(raw);
        out.cases.push(null_case);
    }
    null.stop().await?;
    target::release_all(&store.url, &held).await;
    store.stop().await?;
    Ok(out)
}

/// Give each of `ids` one event over HTTP, W at a time.
async fn prefill(ctx: &Ctx, base: &str, ids: &[(String, u64)]) -> anyhow::Result<()> {
    let chunk = ids.len().div_ceil(ctx.plan.writers.max(1)).max(1);
    let mut set = tokio::task::JoinSet::new();
    for part in ids.chunks(chunk) {
        let (http, events, base, part) = (
            ctx.http.clone(),
            ctx.events.clone(),
            base.to_owned(),
            part.to_vec(),
        );
        set.spawn(async move {
            let mut body = String::new();
            let mut counter = 0;
            let prefix = load::unique_prefix("prefill");
            for (twin, token) in part {
                events.body(&mut body, &prefix, &mut counter, 1);
                let r = http
                    .post(format!("{base}/v1/twins/{twin}/events"))
                    .header("fencing-token", token.to_string())
                    .header("content-type", "application/json")
                    .body(std::mem::take(&mut body))
                    .send()
                    .await;
                load::finish(r, 201)
                    .await
                    .map_err(|e| anyhow::anyhow!("prefill of {twin} failed: {e}"))?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.context("prefill task panicked")??;
    }
    Ok(())
}

/// Twins the readers read (all of them, up to this many).
const MAX_READ_TWINS: usize = 10_000;

/// `read`: GET twin state, beside a do-nothing handler on the same server
/// runtime answering GETs with a body the size of a real one:
///
/// 1. `read/idle/*`: W readers, nothing else;
/// 2. `read/*`: W readers while W writers append batches;
/// 3. `read/half_load/palisade`: the same loops paced at half the read and
///    append rates case 2 reached, for the latencies of a store at half its
///    measured capacity.
pub async fn read(ctx: &Ctx) -> anyhow::Result<RunOut> {
    let plan = &ctx.plan;
    let mut out = RunOut::default();
    let store = store_for_run(ctx, plan.partitions).await?;
    let p = store.partitions;
    let held = target::acquire_partitions(
        &store.url,
        p,
        plan.writers,
        &format!("bench-{}", ctx.events.nonce),
        LOAD_TTL,
    )
    .await?;
    let tokens = tokens_of(&held, p);
    let twins = Twins::new(plan.twins, p)?;
    let per_writer = twins.per_writer(p, plan.writers);
    let readable: Vec<(String, u64)> = twins
        .ids
        .iter()
        .zip(&twins.partition)
        .take(MAX_READ_TWINS)
        .map(|(id, part)| (id.clone(), tokens[*part as usize]))
        .collect();
    prefill(ctx, &store.url, &readable).await?;
    // The do-nothing server answers GETs with a body the size of a real one.
    let sample = ctx
        .http
        .get(format!("{}/v1/twins/{}", store.url, readable[0].0))
        .send()
        .await?
        .error_for_status()?
        .bytes()
        .await?;
    let null = NullServer::start(&ctx.rt.handle(), sample.clone())?;
    let readable = Arc::new(readable);
    let readers = |base: &str, name: &str, pace: Option<Duration>| -> Vec<Loop> {
        (0..plan.writers)
            .map(|_| Loop {
                base: base.to_owned(),
                op: Op::Read,
                twins: readable.clone(),
                name: format!("{name}r"),
                pace,
            })
            .collect()
    };
    let writers = |base: &str, name: &str, pace: Option<Duration>| -> Vec<Loop> {
        let mut loops = writer_loops(base, &twins, &per_writer, &tokens, plan.batch, name);
        for l in &mut loops {
            l.pace = pace;
        }
        loops
    };
    let store_name = |name: &str| if name.ends_with("palisade") { "w" } else { "n" };
    let mut cases = Vec::new();
    let mut run_case = async |name: &str, loops: Vec<Loop>| -> anyhow::Result<Case> {
        let r = load::run(
            &ctx.http,
            &ctx.events,
            loops,
            plan.warmup,
            plan.window,
            name,
            async {},
        )
        .await?;
        let mut c = Case::new(name);
        let secs = r.elapsed.as_secs_f64().max(1e-9);
        c.set("reads_per_s", f(r.read.requests) / secs);
        c.set("concurrent_append_events_per_s", f(r.append.events) / secs);
        c.set(
            "concurrent_append_requests_per_s",
            f(r.append.requests) / secs,
        );
        c.set("errors", f(r.read.error_count() + r.append.error_count()));
        r.read.latency.put_metrics(&mut c.metrics, "");
        r.append.latency.put_metrics(&mut c.metrics, "append_");
        c.latency = Some(r.read.latency.clone());
        c.set("twin_body_bytes", f(sample.len() as u64));
        if r.read.error_count() + r.append.error_count() > 0 {
            c.note("read_errors", json!(r.read.errors));
            c.note("append_errors", json!(r.append.errors));
            if name.contains("palisade") {
                out.failures.push(format!(
                    "{name}: failed requests: reads {:?}, appends {:?}",
                    r.read.errors, r.append.errors
                ));
            }
        }
        Ok(c)
    };
    // 1. Idle: readers only.
    for (name, base) in [
        ("read/idle/palisade", store.url.clone()),
        ("read/idle/http_null", null.url.clone()),
    ] {
        cases.push(run_case(name, readers(&base, store_name(name), None)).await?);
    }
    // 2. Under the batched write load.
    for (name, base) in [
        ("read/palisade", store.url.clone()),
        ("read/http_null", null.url.clone()),
    ] {
        let mut loops = writers(&base, store_name(name), None);
        loops.extend(readers(&base, store_name(name), None));
        cases.push(run_case(name, loops).await?);
    }
    // 3. Half of what case 2 reached, paced.
    let loaded = &cases[2];
    let pace_for = |per_s: Option<f64>| -> Option<Duration> {
        let half = per_s? / 2.0;
        (half > 0.0).then(|| Duration::from_secs_f64(plan.writers as f64 / half))
    };
    let (read_pace, write_pace) = (
        pace_for(loaded.get("reads_per_s")),
        pace_for(loaded.get("concurrent_append_requests_per_s")),
    );
    if let (Some(rp), Some(wp)) = (read_pace, write_pace) {
        let name = "read/half_load/palisade";
        let mut loops = writers(&store.url, "w", Some(wp));
        loops.extend(readers(&store.url, "w", Some(rp)));
        cases.push(run_case(name, loops).await?);
    }
    if let [idle, idle_null, pal, null_case, ..] = &mut cases[..] {
        ratio(idle, "ratio_vs_http_null", "reads_per_s", idle_null);
        ratio(pal, "ratio_vs_http_null", "reads_per_s", null_case);
    }
    out.cases = cases;
    null.stop().await?;
    target::release_all(&store.url, &held).await;
    store.stop().await?;
    Ok(out)
}

/// `ingest`: pre-load a topic, read it raw, then let the store ingest it;
/// and the same with a topic produced by librdkafka's default partitioner
/// (each into a fresh store; which goes first alternates by run).
pub async fn ingest(ctx: &Ctx, run: usize) -> anyhow::Result<RunOut> {
    if ctx.plan.url.is_some() {
        bail!("ingest needs the in-process store (it runs the store's Kafka ingester itself); drop --url");
    }
    let mut out = RunOut::default();
    let mut order = [
        kafka::Partitioner::Murmur2,
        kafka::Partitioner::LibrdkafkaDefault,
    ];
    if run % 2 == 1 {
        order.reverse();
    }
    let mut murmur2 = None;
    let mut default = None;
    for partitioner in order {
        let (case, raw) = ingest_with(ctx, run, partitioner, &mut out.failures).await?;
        match partitioner {
            kafka::Partitioner::Murmur2 => murmur2 = Some((case, raw)),
            kafka::Partitioner::LibrdkafkaDefault => default = Some(case),
        }
    }
    let (Some((mut pal, raw)), Some(mut dflt)) = (murmur2, default) else {
        bail!("ingest: a case did not run");
    };
    if let Some(raw) = raw {
        ratio(&mut pal, "ratio_vs_raw_consume", "records_per_s", &raw);
        ratio(&mut dflt, "ratio_vs_raw_consume", "records_per_s", &raw);
        ratio(&mut dflt, "ratio_vs_murmur2", "records_per_s", &pal);
        out.cases.push(pal);
        out.cases.push(dflt);
        out.cases.push(raw);
    }
    Ok(out)
}

/// One ingest case: a fresh store, a topic produced with `partitioner`, the
/// store's ingester timed over it; the raw-consume baseline too for
/// murmur2.
async fn ingest_with(
    ctx: &Ctx,
    run: usize,
    partitioner: kafka::Partitioner,
    failures: &mut Vec<String>,
) -> anyhow::Result<(Case, Option<Case>)> {
    let plan = &ctx.plan;
    let broker = ctx.broker().await?;
    let store = store_for_run(ctx, plan.partitions).await?;
    let p = store.partitions;
    let held = target::acquire_partitions(
        &store.url,
        p,
        1,
        &format!("bench-ingest-{}", ctx.events.nonce),
        LOAD_TTL,
    )
    .await?;
    let tokens = tokens_of(&held, p);
    let twins = Twins::new(plan.twins, p)?;
    let (name, suffix) = match partitioner {
        kafka::Partitioner::Murmur2 => ("ingest/palisade", ""),
        kafka::Partitioner::LibrdkafkaDefault => ("ingest/palisade_librdkafka_default", "-crc32"),
    };
    let topic = format!("bench-{}-{run}{suffix}", ctx.events.nonce);
    broker.create_topic(&topic, p).await?;
    let total = plan.ingest_records;
    let pre = kafka::preload(
        broker.bootstrap(),
        &topic,
        p,
        &twins,
        &tokens,
        total,
        &ctx.events,
        partitioner,
    )
    .await?;
    let last = &pre.last;
    let produced: u64 = last
        .values()
        .map(|o| u64::try_from(*o + 1).unwrap_or(0))
        .sum();
    if produced != total {
        bail!("the topic holds {produced} records, {total} were produced (is it new and empty?)");
    }
    let timeout = Duration::from_secs(120) + Duration::from_millis(total / 2);
    let raw = match partitioner {
        kafka::Partitioner::Murmur2 => {
            Some(kafka::raw_consume(broker.bootstrap(), &topic, p, total, timeout).await?)
        }
        kafka::Partitioner::LibrdkafkaDefault => None,
    };
    let store_arc = store.store.clone().context("in-process store")?;
    let before = StoreMetrics::parse(&store_arc.metrics().render());
    let (ing, lag) = kafka::ingest(
        &ctx.rt.handle(),
        &store_arc,
        broker.bootstrap(),
        &topic,
        last,
        total,
        timeout,
    )
    .await?;
    // The ingester counts outcomes just after each flush; give it a moment.
    let mut outcomes = kafka::outcomes(&store_arc);
    let deadline = Instant::now() + Duration::from_secs(5);
    while outcomes.get("applied").copied().unwrap_or(0.0) < f(total) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        outcomes = kafka::outcomes(&store_arc);
    }
    let applied = outcomes.get("applied").copied().unwrap_or(0.0);
    if applied < f(total) {
        failures.push(format!(
            "{name}: {applied} of {total} records applied; outcomes {outcomes:?}"
        ));
    }
    let mut pal = Case::new(name);
    let (flush, buckets) =
        StoreMetrics::flush_delta(&before, &StoreMetrics::parse(&store_arc.metrics().render()));
    // Ingested records are commands of their own (one per record) and are
    // not counted as appended HTTP events: report records per flush.
    if let Some(r) = flush.get("requests_per_flush") {
        pal.set("records_per_flush", *r);
    }
    pal.set("flushes", flush.get("flushes").copied().unwrap_or(0.0));
    pal.note("flush_batch_requests_buckets", buckets);
    pal.set("records_per_s", ing.rate());
    pal.set("records", f(total));
    // Records the store routed to another partition than the one they
    // were read from (0 with murmur2).
    pal.set("records_outside_their_partition", f(pre.foreign));
    pal.set("seconds_first_to_last", ing.elapsed.as_secs_f64());
    pal.set("seconds_to_first_record", ing.to_first.as_secs_f64());
    pal.set(
        "max_lag_records",
        lag.iter().map(|(_, l)| *l).fold(0.0, f64::max),
    );
    pal.note("outcomes", json!(outcomes));
    pal.note("lag_records_over_time", json!(thin(&lag, 50)));
    pal.note("broker", json!(broker.kind()));
    pal.series = ing.series.clone();
    let raw_case = raw.map(|raw| {
        let mut c = Case::new("ingest/raw_consume");
        c.set("records_per_s", raw.rate());
        c.set("records", f(total));
        c.set("seconds_first_to_last", raw.elapsed.as_secs_f64());
        c.set("seconds_to_first_record", raw.to_first.as_secs_f64());
        c.series = raw.series.clone();
        c.set("produce_records_per_s", pre.rate);
        c
    });
    target::release_all(&store.url, &held).await;
    store.stop().await?;
    Ok((pal, raw_case))
}

/// At most `n` points of a series, evenly spread.
fn thin(s: &[(f64, f64)], n: usize) -> Vec<(f64, f64)> {
    if s.len() <= n {
        return s.to_vec();
    }
    let step = s.len().div_ceil(n);
    let mut v: Vec<(f64, f64)> = s.iter().step_by(step).copied().collect();
    if let Some(l) = s.last() {
        v.push(*l);
    }
    v
}

/// `churn`: leases change hands under load; then the log is checked.
pub async fn churn(ctx: &Ctx) -> anyhow::Result<RunOut> {
    let plan = &ctx.plan;
    let store = store_for_run(ctx, plan.partitions).await?;
    let twins = Twins::new(plan.twins, store.partitions)?;
    let cfg = super::churn::Churn {
        base: store.url.clone(),
        partitions: store.partitions,
        batch: plan.batch.min(10),
        duration: plan.churn_duration,
        ttl: plan.churn_ttl,
        loops_per_holder: (plan.writers / store.partitions.max(1) as usize).max(1),
    };
    let (case, violations) = super::churn::run(&ctx.http, &cfg, &twins, &ctx.events).await?;
    store.stop().await?;
    Ok(RunOut {
        cases: vec![case],
        failures: violations
            .into_iter()
            .map(|v| format!("churn: {v}"))
            .collect(),
    })
}

/// `scaling`: the append load across partition and twin counts (each on a
/// fresh store), raw sled at each partition count, then recovery time
/// against log size.
pub async fn scaling(ctx: &Ctx) -> anyhow::Result<RunOut> {
    let plan = &ctx.plan;
    if plan.url.is_some() {
        bail!("scaling needs the in-process store (it creates stores with each partition count and reopens them); drop --url");
    }
    let mut out = RunOut::default();
    for &p in &plan.scaling_partitions {
        let raw = raw_sled::run(
            plan.data_dir.as_deref(),
            p,
            plan.writers,
            plan.batch,
            &ctx.events,
            plan.warmup,
            plan.window,
            &format!("scaling/P={p}/raw_sled"),
        )
        .await?;
        let mut raw_case = append_case(&format!("scaling/P={p}/raw_sled"), &raw);
        raw_case.set("partitions", f(u64::from(p)));
        for &t in &plan.scaling_twins {
            let store = store_for_run(ctx, p).await?;
            let held = target::acquire_partitions(
                &store.url,
                p,
                plan.writers,
                &format!("bench-{}", ctx.events.nonce),
                LOAD_TTL,
            )
            .await?;
            let tokens = tokens_of(&held, p);
            let twins = Twins::new(t, p)?;
            let per_writer = twins.per_writer(p, plan.writers);
            let idle = per_writer.iter().filter(|w| w.is_empty()).count();
            let loops = writer_loops(&store.url, &twins, &per_writer, &tokens, plan.batch, "w");
            let name = format!("scaling/P={p}/T={t}/palisade");
            let mut c = palisade_append(ctx, &store, loops, &name).await?;
            c.set("partitions", f(u64::from(p)));
            c.set("twins", f(t));
            c.set("idle_writers", f(idle as u64));
            ratio(&mut c, "ratio_vs_raw_sled", "events_per_s", &raw_case);
            if c.get("errors").unwrap_or(0.0) > 0.0 {
                out.failures.push(format!(
                    "{name}: {} requests failed: {}",
                    c.get("errors").unwrap_or(0.0),
                    c.notes
                        .get("errors")
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ));
            }
            out.cases.push(c);
            target::release_all(&store.url, &held).await;
            store.stop().await?;
        }
        out.cases.push(raw_case);
    }
    for &n in &plan.recovery_sizes {
        out.cases.push(recovery(ctx, n).await?);
    }
    Ok(out)
}

/// Fill a store with `n` events (directly, not over HTTP), close it, then
/// time `Store::open` and the first successful read.
async fn recovery(ctx: &Ctx, n: u64) -> anyhow::Result<Case> {
    let plan = &ctx.plan;
    let name = format!("recovery/events={n}");
    let dir = target::temp_dir(plan.data_dir.as_deref(), "palisade-bench-recovery-")?;
    let path = dir.path().to_path_buf();
    let p = plan.partitions;
    let twins = Twins::new(plan.twins.min(100_000), p)?;
    let store = target::open_store(path.clone(), Some(p)).await?;
    let fill_started = Instant::now();
    let bar = load::progress(&format!("{name}: filling"), load::Window::Requests(n));
    let patch: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&ctx.events.patch).context("bench patch")?;
    let mut by_partition: Vec<Vec<TwinId>> = vec![Vec::new(); p as usize];
    for (i, part) in twins.partition.iter().enumerate() {
        by_partition[*part as usize].push(TwinId::new(twins.ids[i].clone())?);
    }
    let per_partition = n.div_ceil(u64::from(p));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for (pi, mine) in by_partition.into_iter().enumerate() {
        if mine.is_empty() {
            continue;
        }
        let lease = store
            .acquire(AcquireRequest {
                scope: Scope::Partition(PartitionId(u32::try_from(pi)?)),
                holder: "bench-recovery".into(),
                ttl_ms: 600_000,
                purpose: Default::default(),
            })
            .await
            .context("recovery: acquire")?;
        let (store, patch, done, nonce) = (
            store.clone(),
            patch.clone(),
            done.clone(),
            ctx.events.nonce.clone(),
        );
        set.spawn(async move {
            let mut rng = load::Rng::new();
            let mut written = 0u64;
            while written < per_partition {
                let k = (per_partition - written).min(1000);
                let twin = mine[rng.below(mine.len())].clone();
                let evs: Vec<NewEvent> = (0..k)
                    .map(|i| NewEvent {
                        event_id: format!("{nonce}-r{pi}-{}", written + i),
                        event_type: "telemetry".into(),
                        patch: patch.clone(),
                        hlc: None,
                    })
                    .collect();
                store
                    .append(twin, lease.token, evs, None)
                    .await
                    .context("recovery: fill append")?;
                written += k;
                done.fetch_add(k, std::sync::atomic::Ordering::Relaxed);
            }
            anyhow::Ok(())
        });
    }
    let mut fill_err = None;
    loop {
        tokio::select! {
            r = set.join_next() => match r {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => fill_err = Some(e),
                Some(Err(e)) => fill_err = Some(anyhow::anyhow!("fill task panicked: {e}")),
            },
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                bar.set_position(done.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
    }
    bar.finish_and_clear();
    if let Some(e) = fill_err {
        return Err(e);
    }
    let filled = done.load(std::sync::atomic::Ordering::Relaxed);
    let fill_secs = fill_started.elapsed().as_secs_f64();
    store.close().await;
    drop(store);
    let first = TwinId::new(twins.ids[0].clone())?;
    // The folder's size, then the timed reopen.
    let bytes = dir_size(&path);
    let t0 = Instant::now();
    let reopened = target::open_store(path.clone(), None).await?;
    let opened = t0.elapsed();
    let mut reads = 0u32;
    loop {
        reads += 1;
        match reopened.twin(&first, AsOf::Latest) {
            Ok(Some(_)) => break,
            Ok(None) => {
                // twins[0] may have drawn no events; any twin with events will do.
                let any = twins.ids.iter().take(1000).find_map(|id| {
                    TwinId::new(id.clone())
                        .ok()
                        .and_then(|t| reopened.twin(&t, AsOf::Latest).ok().flatten())
                });
                if any.is_some() {
                    break;
                }
                bail!("{name}: no twin readable after reopening");
            }
            Err(e) => {
                if reads > 1000 {
                    return Err(anyhow::Error::from(e).context("recovery: first read"));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    let ready = t0.elapsed();
    reopened.close().await;
    drop(reopened);
    drop(dir);
    let mut c = Case::new(&name);
    c.set("events", f(filled));
    c.set("disk_bytes", f(bytes));
    c.set("open_ms", opened.as_secs_f64() * 1000.0);
    c.set("open_to_first_read_ms", ready.as_secs_f64() * 1000.0);
    c.set("fill_events_per_s", f(filled) / fill_secs.max(1e-9));
    Ok(c)
}

fn dir_size(p: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.filter_map(Result::ok) {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
