//! The outbox dispatcher (`docs/outbox.md`, decision 0030): delivers the
//! effects the store recorded with admitted events.
//!
//! One task per partition, sequential: it reads the partition's pending
//! entries in key order (seq, then effect index) from sled, which holds
//! only what is durable, up to the partition's durable head, and delivers
//! each before the next, so effects go out in order per partition (and so
//! per twin). A webhook is an HTTP POST of the effect's body with
//! `Idempotency-Key: <event_id>:<index>` and `Fencing-Token: <the event's
//! token>`; a 2xx answer confirms it. The confirmation (state `delivered`)
//! is made durable through the store's commit path before the next effect
//! is tried, so a restart never repeats a confirmed delivery; a delivery
//! whose confirmation was not yet durable when the store died is repeated,
//! with the same idempotency key. A failed try is recorded durably too
//! (`attempts`, `last_error`), then retried after a wait that doubles from
//! `backoff` up to `backoff_max`; after `max_attempts` failed tries the
//! effect is `dead`, with its last error, and the partition moves on.
//!
//! Cluster mode (`docs/decisions/0035-outbox-in-cluster-mode.md`): a
//! partition's task works only while its node serves the partition
//! ([`Dispatch::may_dispatch`]), checks again before each try, abandons a
//! try in flight the moment ownership goes, and records each outcome as a
//! `palisade-control: outbox` record of the partition's Kafka log (applied
//! by every node, so a new owner does not repeat what was confirmed).

use std::sync::Arc;
use std::time::Duration;

use palisade_core::effect::EffectKind;
use palisade_core::{BoxFuture, PartitionId};
use palisade_log::{DeliveryState, OutboxEntry, Store};
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// Who may deliver a partition's effects, and how a try's outcome is made
/// durable: the store itself on one node ([`Local`]), the partition's log
/// in cluster mode (`cluster::Node`).
pub trait Dispatch: Send + Sync + 'static {
    /// Whether this node may deliver partition `p`'s effects now.
    fn may_dispatch(&self, partition: u32) -> bool;
    /// Bumped whenever ownership may have changed (`None`: never changes).
    fn ownership_changes(&self) -> Option<watch::Receiver<u64>>;
    /// Make `entry`'s new state durable; an error if it could not be (the
    /// dispatcher then stops working on the partition for a while).
    fn record<'a>(&'a self, entry: &'a OutboxEntry) -> BoxFuture<'a, Result<(), String>>;
}

/// One node: it dispatches every partition, and records outcomes through
/// the store's commit path.
#[derive(Debug)]
pub struct Local(pub Arc<Store>);

impl Dispatch for Local {
    fn may_dispatch(&self, _partition: u32) -> bool {
        true
    }

    fn ownership_changes(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    fn record<'a>(&'a self, entry: &'a OutboxEntry) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { self.0.outbox_update(entry).await.map_err(|f| f.to_string()) })
    }
}

/// Dispatcher settings (`palisade serve --outbox-*`).
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    pub max_attempts: u32,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub timeout: Duration,
    /// Delivered entries kept per partition (the newest); older ones are
    /// pruned after each drain and every housekeeping round.
    pub keep_delivered: usize,
    /// The roots trusted for `https://` effects ([`trust_roots`]).
    pub roots: Vec<reqwest::Certificate>,
    /// The brokers and client settings `kafka` effects are produced with
    /// (`--kafka-brokers`, `--kafka-setting`); `None`: such effects fail
    /// (and end dead) with an error saying so.
    pub kafka: Option<(String, Vec<(String, String)>)>,
}

/// The producer of `kafka` effects: `acks=all` and idempotence, the
/// client settings a producer takes.
fn effect_producer(
    brokers: &str,
    settings: &[(String, String)],
    timeout: Duration,
) -> anyhow::Result<rdkafka::producer::FutureProducer> {
    use anyhow::Context;
    let mut pc = rdkafka::config::ClientConfig::new();
    pc.set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set(
            "message.timeout.ms",
            timeout.as_millis().clamp(1_000, 300_000).to_string(),
        );
    for (k, v) in palisade_kafka::cluster::producer_settings(settings) {
        pc.set(k, v);
    }
    pc.create().context("the producer of kafka effects")
}

/// The certificate authorities in the PEM file `path` (`--outbox-ca-file`),
/// the only roots the dispatcher trusts for `https://` effects; none
/// without it (decision 0036: no system roots). An unreadable file, one
/// without a certificate, or a certificate rustls refuses is an error.
pub fn trust_roots(path: Option<&std::path::Path>) -> anyhow::Result<Vec<reqwest::Certificate>> {
    use anyhow::Context;
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let roots = crate::security::pem_roots(path, "--outbox-ca-file")?;
    // rustls checks each root when the client is built: refuse it now.
    client(&roots, Duration::from_secs(1))
        .with_context(|| format!("--outbox-ca-file {}", path.display()))?;
    Ok(roots)
}

/// The dispatcher's HTTP client: no redirects, a timeout per try, and only
/// `roots` trusted for HTTPS.
fn client(roots: &[reqwest::Certificate], timeout: Duration) -> reqwest::Result<reqwest::Client> {
    let mut b = reqwest::Client::builder()
        .timeout(timeout)
        // A receiver's redirect is its answer, not a new place to post to.
        .redirect(reqwest::redirect::Policy::none())
        .tls_built_in_root_certs(false);
    for r in roots {
        b = b.add_root_certificate(r.clone());
    }
    b.build()
}

/// Entries read per scan of a partition.
const BATCH: usize = 64;
/// A partition with nothing to do looks again after this (or when its
/// durable head moves, whichever comes first).
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Cluster mode: how often ownership is looked at again without a change
/// event (an owner lease runs out by the clock, without one).
const OWNERSHIP_POLL: Duration = Duration::from_millis(200);
/// Longest error text kept with an entry.
const MAX_ERROR: usize = 512;

/// Start one dispatching task per partition; they end once `stop` turns
/// true (a delivery in flight is abandoned: it is still pending, so the
/// next start delivers it again, with the same key).
pub fn start(
    store: &Arc<Store>,
    gate: Arc<dyn Dispatch>,
    config: DispatchConfig,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let client = client(&config.roots, config.timeout)?;
    let kafka = match &config.kafka {
        Some((brokers, settings)) => Some(effect_producer(brokers, settings, config.timeout)?),
        None => None,
    };
    info!(
        partitions = store.partitions(),
        max_attempts = config.max_attempts,
        "outbox dispatcher started"
    );
    let config = Arc::new(config);
    Ok((0..store.partitions())
        .map(|p| {
            let d = Dispatcher {
                store: store.clone(),
                gate: gate.clone(),
                client: client.clone(),
                kafka: kafka.clone(),
                config: config.clone(),
                partition: PartitionId(p),
            };
            let mut stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = d.run() => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            })
        })
        .collect())
}

struct Dispatcher {
    store: Arc<Store>,
    gate: Arc<dyn Dispatch>,
    client: reqwest::Client,
    /// For `kafka` effects (`None` without `--kafka-brokers`).
    kafka: Option<rdkafka::producer::FutureProducer>,
    config: Arc<DispatchConfig>,
    partition: PartitionId,
}

impl Dispatcher {
    async fn run(self) {
        let Some(mut head) = self.store.watch_head(self.partition) else {
            return;
        };
        loop {
            // Cluster mode: wait until this node serves the partition.
            if !self.may_dispatch() {
                self.ownership_changed().await;
                continue;
            }
            // Everything at or before the cursor is delivered or dead:
            // entries are only ever added at higher seqs (a new event's),
            // so each scan starts after it instead of at the partition's
            // first entry. Reset on every new tenure (cluster mode: the
            // partition may have been rebuilt in between).
            let mut cursor = None;
            while self.may_dispatch() {
                let found = self.drain(&mut cursor).await;
                if let Some(f) = self.store.failure() {
                    // Fail-stop: no delivery state can be recorded any more, so
                    // every further try would be repeated after the restart.
                    warn!(partition = %self.partition, error = %f,
                        "outbox: the store stopped after a storage failure; this partition's dispatcher stops until the restart");
                    return;
                }
                if !found {
                    // Woken by a durable head change (new events, maybe with
                    // effects), an ownership change, or the idle poll.
                    tokio::select! {
                        _ = tokio::time::timeout(IDLE_POLL, head.changed()) => {}
                        () = self.lost() => {}
                    }
                }
            }
        }
    }

    fn may_dispatch(&self) -> bool {
        self.gate.may_dispatch(self.partition.0)
    }

    /// Returns after an ownership change, or a short poll (cluster mode);
    /// never on one node.
    async fn ownership_changed(&self) {
        match self.gate.ownership_changes() {
            Some(mut changes) => {
                if tokio::time::timeout(OWNERSHIP_POLL, changes.changed())
                    .await
                    .is_ok_and(|r| r.is_err())
                {
                    // The node is gone: no change will come.
                    tokio::time::sleep(OWNERSHIP_POLL).await;
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Resolves once this node may no longer dispatch the partition.
    async fn lost(&self) {
        while self.may_dispatch() {
            self.ownership_changed().await;
        }
    }

    /// Deliver every pending entry durable now; whether any was found.
    async fn drain(&self, cursor: &mut Option<(u64, u16)>) -> bool {
        let mut found = false;
        loop {
            let (store, p, after) = (self.store.clone(), self.partition, *cursor);
            let batch = tokio::task::spawn_blocking(move || store.outbox_pending(p, after, BATCH))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            let batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    warn!(partition = %self.partition, error = %e, "outbox: cannot read pending effects");
                    tokio::time::sleep(IDLE_POLL).await;
                    return found;
                }
            };
            if batch.is_empty() {
                if found {
                    prune(&self.store, self.partition, self.config.keep_delivered).await;
                }
                return found;
            }
            found = true;
            for entry in batch {
                let at = (entry.seq, entry.index);
                if self.deliver(entry).await {
                    *cursor = Some(at);
                } else {
                    // The store cannot record states any more (stopped or
                    // failed): stop here; what is left stays pending.
                    tokio::time::sleep(IDLE_POLL).await;
                    return found;
                }
            }
        }
    }

    /// Try `entry` until it is delivered or dead, recording each outcome
    /// durably. False if an outcome could not be recorded, or (cluster
    /// mode) the node no longer serves the partition: the entry stays
    /// pending for whoever dispatches the partition next.
    async fn deliver(&self, mut entry: OutboxEntry) -> bool {
        loop {
            // Checked again before every try: only the current owner
            // delivers.
            if !self.may_dispatch() {
                return false;
            }
            // The entry as durable now: in cluster mode an outcome record of
            // a former owner may have settled it since it was read.
            match self
                .store
                .outbox_get(self.partition, entry.seq, entry.index)
            {
                Ok(Some(now)) if now.state != DeliveryState::Pending => return true,
                Ok(Some(now)) => entry = now,
                Ok(None) | Err(_) => {}
            }
            // A try in flight is abandoned the moment ownership goes (it
            // stays pending; the next owner delivers it, same key).
            let outcome = tokio::select! {
                r = self.send(&entry) => r,
                () = self.lost() => return false,
            };
            entry.attempts = entry.attempts.saturating_add(1);
            entry.updated_at_ms = now_ms();
            match outcome {
                Ok(()) => {
                    entry.state = DeliveryState::Delivered;
                    entry.last_error = None;
                }
                Err(e) => {
                    entry.last_error = Some(truncate(e));
                    if entry.attempts >= self.config.max_attempts {
                        entry.state = DeliveryState::Dead;
                    }
                }
            }
            if let Err(e) = self.gate.record(&entry).await {
                warn!(partition = %self.partition, key = %entry.idempotency_key(), error = %e,
                    "outbox: a delivery state could not be made durable");
                return false;
            }
            let metrics = self.store.metrics();
            match entry.state {
                DeliveryState::Delivered => {
                    metrics.add(
                        "palisade_outbox_delivered_total",
                        "Effects delivered (the receiver answered 2xx), confirmation durable.",
                        &[],
                        1,
                    );
                    debug!(key = %entry.idempotency_key(), "outbox: delivered");
                    return true;
                }
                DeliveryState::Dead => {
                    metrics.add(
                        "palisade_outbox_failed_total",
                        "Failed delivery tries of outbox effects.",
                        &[],
                        1,
                    );
                    metrics.add(
                        "palisade_outbox_dead_total",
                        "Effects moved to the dead list after their last try failed.",
                        &[],
                        1,
                    );
                    warn!(key = %entry.idempotency_key(), attempts = entry.attempts,
                        error = entry.last_error.as_deref().unwrap_or(""), "outbox: effect dead");
                    return true;
                }
                DeliveryState::Pending => {
                    metrics.add(
                        "palisade_outbox_failed_total",
                        "Failed delivery tries of outbox effects.",
                        &[],
                        1,
                    );
                    tokio::time::sleep(backoff(&self.config, entry.attempts)).await;
                }
            }
        }
    }

    /// One try: a webhook's POST, or a kafka effect's record.
    async fn send(&self, entry: &OutboxEntry) -> Result<(), String> {
        match entry.effect.kind {
            EffectKind::Webhook => self.post(entry).await,
            EffectKind::Kafka => self.produce(entry).await,
        }
    }

    /// A kafka effect: a record of its body to its topic (kept in `url`),
    /// keyed by the twin id, with the same `Idempotency-Key` and
    /// `Fencing-Token` headers as a webhook's POST; delivered once the
    /// brokers acknowledged it (`acks=all`).
    async fn produce(&self, entry: &OutboxEntry) -> Result<(), String> {
        use rdkafka::message::{Header, OwnedHeaders};
        let Some(producer) = &self.kafka else {
            return Err(
                "no Kafka brokers configured: kafka effects need palisade serve --kafka-brokers"
                    .into(),
            );
        };
        let e = &entry.effect;
        let key = entry.idempotency_key();
        let token = entry.token.to_string();
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            })
            .insert(Header {
                key: "idempotency-key",
                value: Some(key.as_str()),
            })
            .insert(Header {
                key: "fencing-token",
                value: Some(token.as_str()),
            });
        for (name, value) in &e.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        let record = rdkafka::producer::FutureRecord::to(&e.url)
            .key(entry.twin.as_bytes())
            .payload(e.body.as_bytes())
            .headers(headers);
        producer
            .send(record, self.config.timeout)
            .await
            .map(|_| ())
            .map_err(|(err, _)| format!("topic {}: {err}", e.url))
    }

    async fn post(&self, entry: &OutboxEntry) -> Result<(), String> {
        let e = &entry.effect;
        let mut req = self
            .client
            .post(&e.url)
            .header("Content-Type", "application/json")
            .header("Idempotency-Key", entry.idempotency_key())
            .header("Fencing-Token", entry.token.to_string());
        for (name, value) in &e.headers {
            req = req.header(name.as_str(), value.as_str());
        }
        let resp = req
            .body(e.body.clone())
            .send()
            .await
            .map_err(|x| chain(&x))?;
        let status = resp.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the receiver answered {status}"))
        }
    }
}

/// The wait after the `attempts`-th failed try: `backoff * 2^(attempts-1)`,
/// at most `backoff_max`.
fn backoff(config: &DispatchConfig, attempts: u32) -> Duration {
    let shift = attempts.saturating_sub(1).min(30);
    config
        .backoff
        .saturating_mul(1 << shift)
        .min(config.backoff_max)
}

/// An error and its sources (reqwest's own text leaves out the cause, such
/// as the certificate a TLS handshake refused).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        source = c.source();
    }
    s
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR {
        let mut end = MAX_ERROR;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Remove `p`'s delivered entries but the newest `keep`, counting them in
/// `palisade_outbox_pruned_total`.
async fn prune(store: &Arc<Store>, p: PartitionId, keep: usize) {
    match store.outbox_prune(p, keep).await {
        Ok(0) => {}
        Ok(n) => {
            store.metrics().add(
                "palisade_outbox_pruned_total",
                "Delivered outbox entries removed past --outbox-keep-delivered.",
                &[],
                u64::try_from(n).unwrap_or(u64::MAX),
            );
            debug!(partition = %p, removed = n, "outbox: delivered entries pruned");
        }
        Err(e) => warn!(partition = %p, error = %e, "outbox: pruning failed"),
    }
}

/// Every `every`: prune every partition's delivered entries down to
/// `keep` (also those of partitions a cluster node does not serve), then
/// count the entries per state into `palisade_outbox_pending` and
/// `palisade_outbox_dead` (one scan of the outbox, whose delivered entries
/// the pruning bounds).
pub async fn housekeeping(store: Arc<Store>, keep: usize, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        for p in 0..store.partitions() {
            prune(&store, PartitionId(p), keep).await;
        }
        let s = store.clone();
        if let Ok(Ok(c)) = tokio::task::spawn_blocking(move || s.outbox_counts()).await {
            #[allow(clippy::cast_precision_loss)]
            {
                store.metrics().set_gauge(
                    "palisade_outbox_pending",
                    "Effects recorded and not yet delivered or dead (counted every 10 s).",
                    &[],
                    c.pending as f64,
                );
                store.metrics().set_gauge(
                    "palisade_outbox_dead",
                    "Effects on the dead list (counted every 10 s).",
                    &[],
                    c.dead as f64,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_its_base_up_to_its_cap() {
        let config = DispatchConfig {
            max_attempts: 8,
            backoff: Duration::from_millis(100),
            backoff_max: Duration::from_millis(1_000),
            timeout: Duration::from_secs(1),
            keep_delivered: 10,
            roots: Vec::new(),
            kafka: None,
        };
        let wait = |n| backoff(&config, n).as_millis();
        assert_eq!(
            [1, 2, 3, 4, 5, 40].map(wait),
            [100, 200, 400, 800, 1_000, 1_000]
        );
    }

    #[test]
    fn long_errors_are_cut_on_a_char_boundary() {
        let e = truncate("é".repeat(MAX_ERROR));
        assert!(e.len() <= MAX_ERROR && e.len() >= MAX_ERROR - 1);
        assert_eq!(truncate("short".into()), "short");
    }
}
