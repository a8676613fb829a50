//! Measurement, not a test of behaviour (ignored by default): acknowledged
//! HTTP appends per second with 1, 2 and 3 cluster nodes on loopback, beside
//! the single-node store (no Kafka, no etcd) measured in the same run.
//! Produces the table in docs/scaling.md:
//!
//! ```sh
//! cargo test --release --test cluster scaling -- --ignored --nocapture
//! PALISADE_SCALING_WRITERS=16,64 PALISADE_SCALING_NODES=3 cargo test --release --test cluster scaling -- --ignored --nocapture
//! ```
//!
//! `PALISADE_SCALING_WRITERS` (default 24) lists the numbers of concurrent
//! writers (HTTP connections), `PALISADE_SCALING_NODES` (default 1,2,3) the
//! cluster sizes, `PALISADE_SCALING_NODE_ARGS` variants of more `palisade
//! serve` arguments for the cluster nodes, each measured in the same run:
//! `NAME=ARGS` separated by `;`, the arguments space-separated (e.g.
//! `linger 5 ms=--kafka-setting linger.ms=5;default=`). For each cluster run the table also gives where an
//! append's time went, from the nodes' `/metrics`
//! (`palisade_cluster_append_stage_microseconds_total`): until the broker
//! acknowledged the record, then until it was applied.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::broker::{broker, unique};
use crate::etcd::Etcd;
use crate::three_nodes::Cluster;

/// Partitions of every measured store: 12 splits evenly over 1, 2 and 3 nodes.
const PARTS: u32 = 12;
/// Concurrent writers, each with its own twin and twin lease, by default.
const WRITERS: usize = 24;
/// Appends per writer in one measurement.
const APPENDS: usize = 60;
/// Measurements per configuration (the table gives medians).
const REPEAT: usize = 3;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The base URL serving `twin`: follows one redirect by hand, retrying
/// while the partition is not served yet.
async fn owner_of(c: &reqwest::Client, base: &str, twin: &str) -> String {
    let started = Instant::now();
    loop {
        if let Ok(r) = c.get(format!("{base}/v1/twins/{twin}")).send().await {
            match r.status().as_u16() {
                200 | 404 => return base.to_owned(),
                307 => {
                    let loc = r.headers()["location"].to_str().unwrap().to_owned();
                    return loc.split("/v1/").next().unwrap().to_owned();
                }
                _ => {}
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "{twin} never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A comma-separated list of numbers from the environment, or `default`.
fn list(var: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(var).map_or_else(
        |_| default.to_vec(),
        |v| v.split(',').map(|x| x.trim().parse().unwrap()).collect(),
    )
}

/// Mean ms per append in the produce and apply stages, over the nodes.
async fn stages(bases: &[String]) -> (f64, f64) {
    let c = client();
    let (mut produce, mut apply, mut n) = (0.0, 0.0, 0.0);
    for b in bases {
        let text = c
            .get(format!("{b}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for line in text.lines() {
            let value = || line.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            if line
                .starts_with("palisade_cluster_append_stage_microseconds_total{stage=\"produce\"}")
            {
                produce += value();
            } else if line
                .starts_with("palisade_cluster_append_stage_microseconds_total{stage=\"apply\"}")
            {
                apply += value();
            } else if line.starts_with("palisade_cluster_appends_total") {
                n += value();
            }
        }
    }
    if n == 0.0 {
        return (0.0, 0.0);
    }
    (produce / n / 1000.0, apply / n / 1000.0)
}

/// `writers` tasks x APPENDS acknowledged appends; returns (appends/s, median ms).
async fn load(bases: &[String], tag: &str, writers: usize) -> (f64, f64) {
    let c = client();
    let mut plans = Vec::new();
    for w in 0..writers {
        let twin = format!("{tag}-w{w}");
        let base = &bases[w % bases.len()];
        let lease: Value = loop {
            let r = c
                .post(format!("{base}/v1/leases"))
                .json(&json!({"scope": format!("twin/{twin}"), "holder": format!("w{w}"), "ttl_ms": 3_600_000}))
                .send()
                .await
                .unwrap();
            if r.status().as_u16() == 201 {
                break r.json().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let owner = owner_of(&c, base, &twin).await;
        plans.push((twin, lease["token"].as_u64().unwrap(), owner));
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (twin, token, owner) in plans {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(APPENDS);
            for i in 0..APPENDS {
                let body = json!({"type": "telemetry", "event_id": format!("e{i}"),
                    "patch": {"rpm": i, "note": "x".repeat(64)}});
                let t = Instant::now();
                loop {
                    let r = c
                        .post(format!("{owner}/v1/twins/{twin}/events"))
                        .header("fencing-token", token.to_string())
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    match r.status().as_u16() {
                        201 => break,
                        503 => tokio::time::sleep(Duration::from_millis(50)).await,
                        s => panic!("append: {s} {}", r.text().await.unwrap_or_default()),
                    }
                }
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let secs = started.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    #[allow(clippy::cast_precision_loss)]
    let rate = (writers * APPENDS) as f64 / secs;
    (rate, all[all.len() / 2])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn single_node(dir: &Path, tag: &str, writers: usize) -> (f64, f64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("serve")
        .arg("--data")
        .arg(dir.join(tag))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--partitions",
            &PARTS.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let base = line
        .trim()
        .strip_prefix("palisade listening on ")
        .unwrap()
        .to_owned();
    let r = load(&[base], tag, writers).await;
    let _ = child.kill();
    let _ = child.wait();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "measurement for docs/scaling.md: cargo test --release --test cluster scaling -- --ignored --nocapture"]
async fn scaling_one_two_three_nodes_beside_a_single_node() {
    let Some(etcd) = Etcd::start("scaling").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let writer_counts = list("PALISADE_SCALING_WRITERS", &[WRITERS]);
    let node_counts = list("PALISADE_SCALING_NODES", &[1, 2, 3]);
    let variants_text = std::env::var("PALISADE_SCALING_NODE_ARGS").unwrap_or_default();
    let variants: Vec<(&str, Vec<&str>)> = if variants_text.trim().is_empty() {
        vec![("", Vec::new())]
    } else {
        variants_text
            .split(';')
            .map(|v| {
                let (name, args) = v.split_once('=').unwrap_or((v, ""));
                (name.trim(), args.split_whitespace().collect())
            })
            .collect()
    };
    let mut rows: Vec<Row> = Vec::new();
    for rep in 0..REPEAT {
        for &writers in &writer_counts {
            let (rate, p50) =
                single_node(dir.path(), &format!("single{rep}w{writers}"), writers).await;
            push(
                &mut rows,
                &format!("single node (embedded leases, no Kafka), {writers} writers"),
                rate,
                p50,
                None,
            );
            for &n in &node_counts {
                for (variant, node_args) in &variants {
                    let topic = unique(&format!("scale{n}w{writers}"));
                    broker().create_topic(&topic, PARTS);
                    let cluster = Arc::new(Cluster {
                        group: format!("{topic}-g"),
                        prefix: format!("/{topic}/"),
                        topic: topic.clone(),
                        etcd: etcd.endpoint.clone(),
                        partitions: PARTS,
                    });
                    let mut nodes: Vec<_> = (0..n)
                        .map(|i| {
                            cluster.start_with(&format!("{topic}-n{i}"), dir.path(), node_args)
                        })
                        .collect();
                    let bases: Vec<String> = nodes.iter().map(|x| x.base.clone()).collect();
                    let (rate, p50) = load(&bases, &topic, writers).await;
                    let stage = stages(&bases).await;
                    let tag = if variant.is_empty() {
                        String::new()
                    } else {
                        format!(" ({variant})")
                    };
                    push(
                        &mut rows,
                        &format!("cluster, {n} node(s), {writers} writers{tag}"),
                        rate,
                        p50,
                        Some(stage),
                    );
                    for x in &mut nodes {
                        x.terminate();
                    }
                }
            }
        }
    }
    let load_avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nSCALING partitions={PARTS} writers={writer_counts:?} appends/writer={APPENDS} repeat={REPEAT} broker={:?} variants={variants:?} loadavg_before={} loadavg_after={}",
        broker().kind,
        load_before.trim(),
        load_avg.trim()
    );
    println!(
        "| configuration | acknowledged appends/s (median) | append latency p50, ms (median) | produce, ms (mean, median of runs) | produce ack to applied, ms (mean, median of runs) |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (name, rates, p50s, stages) in rows {
        let (produce, apply): (Vec<f64>, Vec<f64>) = stages.into_iter().unzip();
        let cell = |v: Vec<f64>| {
            if v.is_empty() {
                "–".to_owned()
            } else {
                format!("{:.1}", median(v))
            }
        };
        println!(
            "| {name} | {:.0} | {:.1} | {} | {} |",
            median(rates),
            median(p50s),
            cell(produce),
            cell(apply)
        );
    }
}

/// A configuration's runs: name, rates, p50s, stage means.
type Row = (String, Vec<f64>, Vec<f64>, Vec<(f64, f64)>);

fn push(rows: &mut Vec<Row>, name: &str, rate: f64, p50: f64, stage: Option<(f64, f64)>) {
    let i = rows.iter().position(|r| r.0 == name).unwrap_or_else(|| {
        rows.push((name.to_owned(), Vec::new(), Vec::new(), Vec::new()));
        rows.len() - 1
    });
    let r = &mut rows[i];
    r.1.push(rate);
    r.2.push(p50);
    r.3.extend(stage);
}
