//! `churn`: partition leases change hands under load, and the log is checked
//! for stale writes afterwards.
//!
//! Each partition has a chain of holders. A holder acquires `partition/<p>`
//! with a short TTL, never renews it (as if paused) and writes continuously.
//! One TTL after its grant the next holder acquires the partition (retrying
//! while the lease is still live) and starts writing; the replaced holder
//! keeps writing with its old token for one more TTL, then stops.
//!
//! Checks (any failure fails the bench):
//! - client side: no request *sent* after a later grant of its partition was
//!   acknowledged was accepted with the older token;
//! - log side (`GET /v1/partitions/{p}/events`): the tokens of each
//!   partition's events never go down in sequence order, and every
//!   acknowledged event is in the log at its seq under its token.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use tokio::sync::watch;

use super::load::{self, Events, Rng};
use super::stats::Case;
use super::target::Twins;

#[derive(Debug, Clone)]
struct Grant {
    partition: u32,
    token: u64,
    acked: Instant,
}

#[derive(Debug, Clone)]
struct Ack {
    partition: u32,
    token: u64,
    sent: Instant,
    seqs: Vec<u64>,
}

/// What a holder's writers are told.
#[derive(Debug, Clone, Copy)]
enum Signal {
    Holding,
    /// The next holder's grant was acknowledged at this instant.
    ReplacedAt(Instant),
    /// The run is over.
    Stop,
}

#[derive(Debug, Default)]
struct Counts {
    requests: u64,
    accepted: u64,
    events: u64,
    stale: u64,
    /// Requests sent after the sender had been replaced (a later grant acked).
    after_replacement: u64,
    after_replacement_stale: u64,
    errors: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct Shared {
    grants: Mutex<Vec<Grant>>,
    acks: Mutex<Vec<Ack>>,
    counts: Mutex<Counts>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Settings of one churn run.
#[derive(Debug, Clone)]
pub struct Churn {
    pub base: String,
    pub partitions: u32,
    pub batch: usize,
    pub duration: Duration,
    pub ttl: Duration,
    pub loops_per_holder: usize,
}

/// Run the churn load, then check the log. Returns the case and the list of
/// violations (empty when the store held).
pub async fn run(
    http: &reqwest::Client,
    cfg: &Churn,
    twins: &Twins,
    events: &Events,
) -> anyhow::Result<(Case, Vec<String>)> {
    let shared = Arc::new(Shared::default());
    let mut by_partition: Vec<Vec<String>> = vec![Vec::new(); cfg.partitions as usize];
    for (i, p) in twins.partition.iter().enumerate() {
        by_partition[*p as usize].push(twins.ids[i].clone());
    }
    // Only this run's events are checked: the log may hold older ones.
    let heads = partition_heads(http, &cfg.base).await?;
    let started = Instant::now();
    let end = started + cfg.duration;
    let bar = load::progress(
        "churn: leases changing hands",
        load::Window::Duration(cfg.duration),
    );
    let mut chains = tokio::task::JoinSet::new();
    let mut chain_count = 0u64;
    for (p, mine) in by_partition.into_iter().enumerate() {
        if mine.is_empty() {
            continue;
        }
        chain_count += 1;
        let (http, cfg, events, shared) =
            (http.clone(), cfg.clone(), events.clone(), shared.clone());
        let p = u32::try_from(p)?;
        chains.spawn(
            async move { chain(&http, &cfg, p, Arc::new(mine), &events, &shared, end).await },
        );
    }
    let ticker = {
        let bar = bar.clone();
        tokio::spawn(async move {
            loop {
                bar.set_position(u64::try_from(started.elapsed().as_millis()).unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut chain_err = None;
    while let Some(r) = chains.join_next().await {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => chain_err = Some(e),
            Err(e) => chain_err = Some(anyhow::anyhow!("a churn task panicked: {e}")),
        }
    }
    ticker.abort();
    bar.finish_and_clear();
    if let Some(e) = chain_err {
        return Err(e.context("churn load failed"));
    }
    let elapsed = started.elapsed();

    let grants = lock(&shared.grants).clone();
    let acks = lock(&shared.acks).clone();
    let mut violations = client_side_violations(&grants, &acks);
    let (log_events, log_violations) =
        check_log(http, &cfg.base, cfg.partitions, &heads, &acks).await?;
    violations.extend(log_violations);

    let c = lock(&shared.counts);
    let mut case = Case::new("churn/palisade");
    let f = |n: u64| -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let v = n as f64;
        v
    };
    case.set("requests", f(c.requests));
    case.set("accepted_requests", f(c.accepted));
    case.set("accepted_events", f(c.events));
    case.set("events_per_s", f(c.events) / elapsed.as_secs_f64());
    case.set("stale_rejections", f(c.stale));
    case.set("stale_rejection_rate", f(c.stale) / f(c.requests.max(1)));
    case.set("requests_after_replacement", f(c.after_replacement));
    case.set(
        "stale_rate_after_replacement",
        if c.after_replacement == 0 {
            f64::NAN
        } else {
            f(c.after_replacement_stale) / f(c.after_replacement)
        },
    );
    case.set(
        "handovers",
        f((grants.len() as u64).saturating_sub(chain_count)),
    );
    case.set("grants", f(grants.len() as u64));
    case.set("log_events_checked", f(log_events));
    case.set("violations", f(violations.len() as u64));
    case.set("ttl_ms", cfg.ttl.as_secs_f64() * 1000.0);
    case.note("errors", json!(c.errors));
    case.note(
        "violations",
        json!(violations.iter().take(20).collect::<Vec<_>>()),
    );
    let unexpected: u64 = c.errors.values().sum();
    if unexpected > 0 {
        violations.push(format!(
            "{unexpected} churn requests failed for reasons other than a stale token: {:?}",
            c.errors
        ));
    }
    if log_events != c.events {
        violations.push(format!(
            "the log holds {log_events} events but {} were acknowledged",
            c.events
        ));
    }
    Ok((case, violations))
}

/// One partition's chain of holders.
async fn chain(
    http: &reqwest::Client,
    cfg: &Churn,
    p: u32,
    twins: Arc<Vec<String>>,
    events: &Events,
    shared: &Arc<Shared>,
    end: Instant,
) -> anyhow::Result<()> {
    let client = palisade_client::Client::with_http_client(&cfg.base, http.clone())?;
    let scope = format!("partition/{p}");
    let mut writers = tokio::task::JoinSet::new();
    let mut previous: Option<watch::Sender<Signal>> = None;
    let mut last_lease = None;
    let mut generation = 0u32;
    while Instant::now() < end {
        let holder = format!("churn-{}-p{p}-g{generation}", events.nonce);
        let grant = loop {
            match client.acquire(&scope, &holder, cfg.ttl).await {
                Ok(g) => break Some(g),
                Err(palisade_client::ClientError::LeaseHeld { expires_in_ms, .. }) => {
                    if Instant::now() >= end {
                        break None;
                    }
                    tokio::time::sleep(Duration::from_millis(expires_in_ms.clamp(1, 50))).await;
                }
                Err(e) => return Err(anyhow::Error::from(e).context(format!("acquire {scope}"))),
            }
        };
        let Some(grant) = grant else { break };
        let acked = Instant::now();
        lock(&shared.grants).push(Grant {
            partition: p,
            token: grant.token,
            acked,
        });
        if let Some(prev) = previous.take() {
            let _ = prev.send(Signal::ReplacedAt(acked));
        }
        let (tx, rx) = watch::channel(Signal::Holding);
        previous = Some(tx);
        for l in 0..cfg.loops_per_holder {
            let (http, cfg, events, shared, twins, rx) = (
                http.clone(),
                cfg.clone(),
                events.clone(),
                shared.clone(),
                twins.clone(),
                rx.clone(),
            );
            let prefix = load::unique_prefix(&format!("c{p}g{generation}l{l}-"));
            let token = grant.token;
            writers.spawn(async move {
                holder_loop(
                    &http, &cfg, p, token, &twins, &events, &shared, rx, &prefix, end,
                )
                .await;
            });
        }
        last_lease = Some(grant.lease_id.clone());
        generation += 1;
        // The lease is never renewed: the next holder can take over once it lapses.
        tokio::time::sleep(cfg.ttl).await;
    }
    if let Some(prev) = previous.take() {
        // The run is over: the last holder (never replaced) stops.
        let _ = prev.send(Signal::Stop);
    }
    while writers.join_next().await.is_some() {}
    if let Some(id) = last_lease {
        let _ = client.release(&id).await;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn holder_loop(
    http: &reqwest::Client,
    cfg: &Churn,
    p: u32,
    token: u64,
    twins: &[String],
    events: &Events,
    shared: &Shared,
    signal: watch::Receiver<Signal>,
    prefix: &str,
    end: Instant,
) {
    let mut rng = Rng::new();
    let mut body = String::new();
    let mut counter = 0u64;
    loop {
        let now = Instant::now();
        let stop = match *signal.borrow() {
            Signal::Holding => false,
            // After its replacement the old holder keeps writing for one more TTL.
            Signal::ReplacedAt(t) => now >= t + cfg.ttl,
            Signal::Stop => true,
        };
        if stop || now >= end + cfg.ttl * 4 {
            break;
        }
        let twin = &twins[rng.below(twins.len())];
        events.body(&mut body, prefix, &mut counter, cfg.batch);
        let sent = Instant::now();
        let r = http
            .post(format!("{}/v1/twins/{twin}/events", cfg.base))
            .header("fencing-token", token.to_string())
            .header("content-type", "application/json")
            .body(std::mem::take(&mut body))
            .send()
            .await;
        let outcome = match r {
            Err(_) => Err("transport".to_owned()),
            Ok(resp) => {
                let status = resp.status().as_u16();
                match resp.bytes().await {
                    Err(_) => Err("transport".to_owned()),
                    Ok(b) => {
                        let v: serde_json::Value =
                            serde_json::from_slice(&b).unwrap_or(serde_json::Value::Null);
                        if status == 201 {
                            Ok(v["seqs"]
                                .as_array()
                                .map(|a| {
                                    a.iter()
                                        .filter_map(serde_json::Value::as_u64)
                                        .collect::<Vec<u64>>()
                                })
                                .unwrap_or_default())
                        } else {
                            Err(format!("{status} {}", v["error"].as_str().unwrap_or("")))
                        }
                    }
                }
            }
        };
        let was_replaced = matches!(*signal.borrow(), Signal::ReplacedAt(t) if t <= sent);
        let mut c = lock(&shared.counts);
        c.requests += 1;
        if was_replaced {
            c.after_replacement += 1;
        }
        match outcome {
            Ok(seqs) => {
                c.accepted += 1;
                c.events += seqs.len() as u64;
                drop(c);
                lock(&shared.acks).push(Ack {
                    partition: p,
                    token,
                    sent,
                    seqs,
                });
            }
            Err(e) if e == "409 stale_token" => {
                c.stale += 1;
                if was_replaced {
                    c.after_replacement_stale += 1;
                }
            }
            Err(e) => *c.errors.entry(e).or_default() += 1,
        }
    }
}

/// Accepted writes sent after a later grant of their partition was acknowledged.
fn client_side_violations(grants: &[Grant], acks: &[Ack]) -> Vec<String> {
    let mut out = Vec::new();
    for a in acks {
        if let Some(g) = grants
            .iter()
            .find(|g| g.partition == a.partition && g.token > a.token && g.acked <= a.sent)
        {
            out.push(format!(
                "partition {}: a write with token {} sent after token {} was granted was accepted (seqs {:?})",
                a.partition, a.token, g.token, a.seqs
            ));
        }
    }
    out
}

/// Read every partition's log and check it (see [`check_partition`]).
/// Each partition's head (last seq) now, from `GET /v1/partitions`.
async fn partition_heads(http: &reqwest::Client, base: &str) -> anyhow::Result<Vec<u64>> {
    let v: serde_json::Value = http
        .get(format!("{base}/v1/partitions"))
        .send()
        .await
        .context("GET /v1/partitions")?
        .error_for_status()
        .context("GET /v1/partitions")?
        .json()
        .await
        .context("GET /v1/partitions: bad body")?;
    let list = v["partitions"]
        .as_array()
        .context("GET /v1/partitions: no list")?;
    Ok(list
        .iter()
        .map(|p| p["head"].as_u64().unwrap_or(0))
        .collect())
}

async fn check_log(
    http: &reqwest::Client,
    base: &str,
    partitions: u32,
    heads: &[u64],
    acks: &[Ack],
) -> anyhow::Result<(u64, Vec<String>)> {
    let mut acked: HashMap<(u32, u64), u64> = HashMap::new();
    for a in acks {
        for s in &a.seqs {
            acked.insert((a.partition, *s), a.token);
        }
    }
    let mut violations = Vec::new();
    let mut total = 0u64;
    for p in 0..partitions {
        let mut log: Vec<(u64, u64)> = Vec::new();
        let mut after = heads.get(p as usize).copied().unwrap_or(0);
        loop {
            let v: serde_json::Value = http
                .get(format!(
                    "{base}/v1/partitions/{p}/events?after={after}&limit=1000"
                ))
                .send()
                .await
                .with_context(|| format!("GET partition {p} events"))?
                .error_for_status()
                .with_context(|| format!("GET partition {p} events"))?
                .json()
                .await
                .with_context(|| format!("partition {p} events: bad body"))?;
            let page = v["events"].as_array().cloned().unwrap_or_default();
            if page.is_empty() {
                break;
            }
            for e in &page {
                let (Some(seq), Some(token)) = (e["seq"].as_u64(), e["token"].as_u64()) else {
                    violations.push(format!("partition {p}: an event without seq or token: {e}"));
                    continue;
                };
                log.push((seq, token));
                after = seq;
            }
        }
        total += log.len() as u64;
        violations.extend(check_partition(p, &log, &mut acked));
    }
    for ((p, seq), t) in acked.iter().take(10) {
        violations.push(format!(
            "partition {p}: acknowledged seq {seq} (token {t}) is missing from the log"
        ));
    }
    Ok((total, violations))
}

/// One partition's log, `(seq, token)` in seq order: tokens must never go
/// down, and each acknowledged seq (removed from `acked` as it is found) must
/// carry the token it was acknowledged for.
fn check_partition(
    p: u32,
    log: &[(u64, u64)],
    acked: &mut HashMap<(u32, u64), u64>,
) -> Vec<String> {
    let mut violations = Vec::new();
    let mut max_token = 0u64;
    for &(seq, token) in log {
        if token < max_token {
            violations.push(format!(
                "partition {p}: seq {seq} has token {token} after an event with token {max_token} (a stale write was accepted)"
            ));
        }
        max_token = max_token.max(token);
        if let Some(t) = acked.remove(&(p, seq)) {
            if t != token {
                violations.push(format!(
                    "partition {p}: seq {seq} was acknowledged for token {t} but the log has {token}"
                ));
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_sent_after_a_later_grant_is_a_violation() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(10);
        let grants = vec![
            Grant {
                partition: 0,
                token: 1,
                acked: t0,
            },
            Grant {
                partition: 0,
                token: 2,
                acked: t1,
            },
        ];
        let ok = Ack {
            partition: 0,
            token: 1,
            sent: t0,
            seqs: vec![1],
        };
        let other_partition = Ack {
            partition: 1,
            token: 1,
            sent: t1 + Duration::from_millis(1),
            seqs: vec![1],
        };
        assert!(client_side_violations(&grants, &[ok.clone(), other_partition]).is_empty());
        let stale = Ack {
            sent: t1 + Duration::from_millis(1),
            ..ok
        };
        assert_eq!(client_side_violations(&grants, &[stale]).len(), 1);
    }

    #[test]
    fn the_log_check_finds_a_token_going_down() {
        let mut acked = HashMap::from([((0, 1), 3), ((0, 2), 5), ((0, 3), 5)]);
        assert!(check_partition(0, &[(1, 3), (2, 5), (3, 5)], &mut acked).is_empty());
        assert!(acked.is_empty());
        let mut acked = HashMap::new();
        let v = check_partition(0, &[(1, 3), (2, 5), (3, 4)], &mut acked);
        assert_eq!(v.len(), 1, "{v:?}");
        let mut acked = HashMap::from([((0, 1), 4)]);
        assert_eq!(check_partition(0, &[(1, 3)], &mut acked).len(), 1);
    }
}
