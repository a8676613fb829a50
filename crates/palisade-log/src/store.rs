use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use palisade_core::{codec, Clock, FencingToken, NewEvent, PartitionId, TwinId};
use palisade_lease::LeaseAuthority;
use tokio::sync::oneshot;
use tracing::{info, instrument, warn};

use crate::cache::ReadCache;
use crate::commit::{CommitConfig, CommitHooks, CommitShared, Committer, Health, Trees};
use crate::error::{AppendError, OpenError};
use crate::ingest::{DeadLetter, IngestOutcome, IngestRecord, Rejection, RejectionLog, Source};
use crate::leases::LeaseBackend;
use crate::refusals::{Refusal, RefusalJournal, RefusalSource};
use crate::sources::Sources;
use crate::wal::Wal;
use crate::writer::{AppendReq, Command, Partition, Sequencer, Shared};
use crate::{Appended, Metrics, StorageFailure};

pub const DEFAULT_PARTITIONS: u32 = 16;
/// Upper bound on partitions.
pub const MAX_PARTITIONS: u32 = 1024;

/// Settings of a store. `partitions` only matters when the store is created.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Partition count for a new store; `None` takes the stored count (or
    /// [`DEFAULT_PARTITIONS`] for a new store). Reopening with a different
    /// count is refused.
    pub partitions: Option<u32>,
    /// How far ahead of the store's clock a writer's HLC may be.
    pub max_drift: Duration,
    /// A twin's state is snapshotted every this many of its events, bounding
    /// the replay of a time-travel query.
    pub snapshot_every: u64,
    /// sled page-cache size in bytes.
    pub cache_bytes: u64,
    /// Latest twin records kept in memory for reads (0: read sled every time).
    pub read_cache_twins: usize,
    /// A write-ahead log segment is closed once it holds this many bytes.
    pub wal_segment_bytes: u64,
    /// sled is made durable (checkpoint) at least this often while written...
    pub checkpoint_every: Duration,
    /// ...and whenever this many log bytes were written since the last one.
    pub checkpoint_bytes: u64,
    /// Fault injection into the commit path (tests only).
    pub hooks: Option<Arc<dyn CommitHooks>>,
    /// The time embedded leases run on: the system's clocks, or a
    /// [`palisade_lease::ManualClock`] a test moves past a TTL instead of
    /// sleeping.
    pub lease_clock: Arc<dyn palisade_lease::Clock>,
    /// Where leases come from, for the store's whole life: checked at open
    /// against the backend the store's tokens came from (recorded in its
    /// meta tree), so a store never mixes two authorities' token numbers.
    pub leases: LeaseBackend,
    /// Refused writes kept per partition in the refusal journal; the oldest
    /// are pruned past this (at least 1).
    pub refusals_per_partition: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            partitions: None,
            max_drift: Duration::from_millis(500),
            snapshot_every: 64,
            cache_bytes: 256 << 20,
            read_cache_twins: 65_536,
            wal_segment_bytes: 64 << 20,
            checkpoint_every: Duration::from_secs(1),
            checkpoint_bytes: 64 << 20,
            hooks: None,
            lease_clock: Arc::new(crate::SystemClock::new()),
            leases: LeaseBackend::Embedded,
            refusals_per_partition: crate::refusals::DEFAULT_REFUSALS_PER_PARTITION,
        }
    }
}

/// The store: partitions, their state machines on one sequencer thread, the
/// committer, the lease authority, and the reads.
#[derive(Debug)]
pub struct Store {
    pub(crate) partitions: u32,
    pub(crate) trees: Trees,
    /// The sequencer's queue. Every write of the store goes through it.
    tx: mpsc::Sender<Command>,
    sequencer: Mutex<Option<JoinHandle<()>>>,
    pub(crate) committer: Arc<Mutex<Option<Committer>>>,
    /// Each partition's durable head, updated after every applied round.
    pub(crate) heads: Vec<tokio::sync::watch::Receiver<u64>>,
    pub(crate) authority: Arc<Mutex<LeaseAuthority>>,
    /// The lease backend chosen at open (`StoreConfig::leases`); every
    /// lease operation dispatches on it in leases.rs. When it is remote,
    /// `authority` only keeps the embedded tokens of the store's past.
    pub(crate) leases: LeaseBackend,
    /// Cluster mode: appends go through the partition's Kafka log instead
    /// of straight to the sequencer (set by `route_appends`, cluster.rs).
    pub(crate) append_route: std::sync::OnceLock<Arc<dyn crate::cluster::AppendRoute>>,
    pub(crate) last_token: Arc<AtomicU64>,
    pub(crate) commit: Arc<CommitShared>,
    clock: Arc<Clock>,
    metrics: Arc<Metrics>,
    rejections: Arc<RejectionLog>,
    /// The durable journal of refused writes (`refusals.rs`).
    refusals: Arc<RefusalJournal>,
    /// Renewal gaps and answer latencies per scope and holder, for TTL
    /// advice (`leases.rs`, `palisade_lease::RenewalTails`). In memory:
    /// a restart starts measuring again.
    pub(crate) renewal_tails: Mutex<palisade_lease::RenewalTails>,
    /// Lease and refusal audit trail and token owners (`audit.rs`).
    audit: crate::AuditLog,
    path: PathBuf,
    /// Per partition: 0, or the head of a loaded partition snapshot whose
    /// older history a background thread is still writing (`handoff.rs`):
    /// reads of history at or below it are refused until then.
    pub(crate) backfill: Vec<AtomicU64>,
    /// Those threads (joined by `close`).
    pub(crate) backfills: Mutex<Vec<JoinHandle<()>>>,
    /// `close` began: background writers stop.
    pub(crate) closing: std::sync::atomic::AtomicBool,
}

const FORMAT_KEY: &[u8] = b"format";
/// Tree of everything kept per Kafka source partition (layout 3).
const INGEST_TREE: &str = "ingest";
/// The refusal journal (layout 4, `refusals.rs`).
const REFUSALS_TREE: &str = "refusals";
/// The fenced outbox (layout 5, `outbox.rs`).
const OUTBOX_TREE: &str = "outbox";
const PARTITIONS_KEY: &[u8] = b"partitions";
/// The write-ahead log's folder inside the data folder.
pub(crate) const WAL_DIR: &str = "wal";

impl Store {
    /// Open the store in `path`, creating it if the folder holds none. A
    /// store that was not closed cleanly first replays its write-ahead log
    /// into sled (`commit::recover`).
    pub fn open(path: &Path, config: StoreConfig) -> Result<Self, OpenError> {
        let shown = path.display().to_string();
        let sled_err = |source| OpenError::Sled {
            path: shown.clone(),
            source,
        };
        if let Some(n) = config.partitions {
            if n == 0 || n > MAX_PARTITIONS {
                return Err(OpenError::BadPartitionCount {
                    got: n,
                    max: MAX_PARTITIONS,
                });
            }
        }
        let db = open_sled(path, config.cache_bytes).map_err(|e| match e {
            SledOpen::InUse => OpenError::InUse {
                path: shown.clone(),
                waited_ms: LOCK_WAIT.as_millis() as u64,
            },
            SledOpen::Other(e) => sled_err(e),
        })?;
        let meta = db.open_tree("meta").map_err(sled_err)?;
        // The layout found: this build's, or the one it migrates from once
        // the log is replayed (below).
        let mut found_layout = crate::keys::LAYOUT_VERSION;
        let partitions = match (
            meta.get(PARTITIONS_KEY).map_err(sled_err)?,
            meta.get(FORMAT_KEY).map_err(sled_err)?,
        ) {
            (Some(n), Some(f)) => {
                let found = f.first().copied().unwrap_or(0);
                if found != crate::keys::LAYOUT_VERSION
                    && found != crate::keys::PREVIOUS_LAYOUT_VERSION
                    && found != crate::keys::LAYOUT_3
                    && found != crate::keys::LAYOUT_2
                {
                    return Err(OpenError::Format {
                        path: shown,
                        found,
                        supported: crate::keys::LAYOUT_VERSION,
                    });
                }
                found_layout = found;
                let stored = <[u8; 4]>::try_from(n.as_ref())
                    .map(u32::from_be_bytes)
                    .map_err(|_| OpenError::Damaged {
                        tree: "meta".into(),
                        key: PARTITIONS_KEY.to_vec(),
                        source: codec::CodecError::Empty,
                    })?;
                if let Some(requested) = config.partitions.filter(|r| *r != stored) {
                    return Err(OpenError::PartitionCount {
                        path: shown,
                        stored,
                        requested,
                    });
                }
                stored
            }
            _ => {
                // A new store. The format key goes last: it marks the store
                // as created, once both are durable.
                let n = config.partitions.unwrap_or(DEFAULT_PARTITIONS);
                meta.insert(PARTITIONS_KEY, &n.to_be_bytes()[..])
                    .map_err(sled_err)?;
                meta.insert(FORMAT_KEY, &[crate::keys::LAYOUT_VERSION][..])
                    .map_err(sled_err)?;
                db.flush().map_err(sled_err)?;
                crate::commit::sync_sled_files(path, &Mutex::default()).map_err(|e| {
                    OpenError::Sled {
                        path: shown.clone(),
                        source: sled::Error::Io(e),
                    }
                })?;
                info!(path = %shown, partitions = n, "created a new store");
                n
            }
        };
        let mut partition_trees = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            partition_trees.push(
                db.open_tree(format!("partition/{p:05}"))
                    .map_err(sled_err)?,
            );
        }
        let trees = Trees {
            partitions: partition_trees,
            meta,
            leases: db.open_tree("leases").map_err(sled_err)?,
            audit: db.open_tree("audit").map_err(sled_err)?,
            token_owners: db.open_tree("token_owners").map_err(sled_err)?,
            cluster: db
                .open_tree(crate::cluster::CLUSTER_TREE)
                .map_err(sled_err)?,
            ingest: db.open_tree(INGEST_TREE).map_err(sled_err)?,
            refusals: db.open_tree(REFUSALS_TREE).map_err(sled_err)?,
            outbox: db.open_tree(OUTBOX_TREE).map_err(sled_err)?,
        };
        let wal_dir = path.join(WAL_DIR);
        // The log of a layout-2 store holds layout-2 ops: replay it first.
        let replay_started = Instant::now();
        let (next_round, replayed) = crate::commit::recover(&db, path, &wal_dir, &trees)?;
        let replay_time = replay_started.elapsed();
        if found_layout == crate::keys::LAYOUT_2 {
            crate::migrate::from_layout_2(&db, path, &trees, FORMAT_KEY)?;
        } else if found_layout == crate::keys::PREVIOUS_LAYOUT_VERSION
            || found_layout == crate::keys::LAYOUT_3
        {
            crate::migrate::mark(&db, path, &trees, FORMAT_KEY, found_layout)?;
        } else {
            crate::migrate::sweep(&trees, path)?;
        }
        // A partition snapshot's load cut short: that partition starts
        // empty (handoff.rs).
        crate::handoff::finish_unfinished(&db, path, &trees).map_err(sled_err)?;
        let sources = Sources::load(&trees.ingest)?;

        let authority = LeaseAuthority::open(trees.leases.clone(), config.lease_clock.clone())?;
        // Before anything can be granted: a store keeps the backend its
        // first token came from (cluster.rs).
        crate::cluster::check_backend(
            &db,
            path,
            &trees.meta,
            &config.leases,
            authority.last_token(),
        )?;
        let last_token = Arc::new(AtomicU64::new(authority.last_token().0));
        let authority = Arc::new(Mutex::new(authority));
        let clock = Arc::new(Clock::new(config.max_drift));
        let metrics = Arc::new(Metrics::default());
        // What the start-up replay did (it ends before the store serves, so
        // these are the finished figures, not live progress).
        metrics.set_gauge(
            "palisade_wal_replay_rounds",
            "Write-ahead log rounds replayed into sled when the store opened.",
            &[],
            replayed as f64,
        );
        metrics.set_gauge(
            "palisade_wal_replay_seconds",
            "How long the start-up replay of the write-ahead log took.",
            &[],
            replay_time.as_secs_f64(),
        );
        let rejections = Arc::new(RejectionLog::default());
        let refusals = Arc::new(
            RefusalJournal::open(
                trees.refusals.clone(),
                partitions,
                config.refusals_per_partition,
            )
            .map_err(sled_err)?,
        );
        let commit = Arc::new(CommitShared {
            health: Arc::new(Health::default()),
            metrics: metrics.clone(),
            applied: AtomicU64::new(next_round - 1),
            cache: Arc::new(ReadCache::new(config.read_cache_twins)),
        });
        let shared = Arc::new(Shared {
            clock: clock.clone(),
            metrics: metrics.clone(),
            rejections: rejections.clone(),
            refusals: refusals.clone(),
            snapshot_every: config.snapshot_every.max(1),
            commit: commit.clone(),
            last_token: last_token.clone(),
        });
        let mut parts = Vec::with_capacity(partitions as usize);
        let mut head_txs = Vec::with_capacity(partitions as usize);
        let mut heads = Vec::with_capacity(partitions as usize);
        for (p, tree) in trees.partitions.iter().enumerate() {
            let p = PartitionId(u32::try_from(p).unwrap_or(u32::MAX));
            let (part, head_tx, head_rx) =
                Partition::load(p, tree.clone(), &trees.cluster, shared.clone())?;
            parts.push(part);
            head_txs.push(head_tx);
            heads.push(head_rx);
        }
        let wal = Wal::create(&wal_dir, next_round, config.wal_segment_bytes)?;
        let (committer, sync_tx) = Committer::start(
            wal,
            db.clone(),
            path.to_owned(),
            trees.clone(),
            commit.clone(),
            head_txs,
            CommitConfig {
                checkpoint_every: config.checkpoint_every,
                checkpoint_bytes: config.checkpoint_bytes,
                hooks: config.hooks.clone(),
            },
        )
        .map_err(OpenError::Thread)?;
        let (tx, rx) = mpsc::channel();
        let sequencer = Sequencer::new(
            parts,
            sources,
            authority.clone(),
            shared,
            sync_tx,
            next_round,
            Vec::new(),
        );
        let handle = std::thread::Builder::new()
            .name("palisade-sequencer".into())
            .spawn(move || sequencer.run(&rx))
            .map_err(OpenError::Thread)?;
        let audit = crate::AuditLog::open(&trees, tx.clone()).map_err(sled_err)?;
        Ok(Self {
            partitions,
            trees,
            tx,
            sequencer: Mutex::new(Some(handle)),
            committer: Arc::new(Mutex::new(Some(committer))),
            heads,
            authority,
            leases: config.leases.clone(),
            append_route: std::sync::OnceLock::new(),
            last_token,
            commit,
            clock,
            metrics,
            rejections,
            refusals,
            renewal_tails: Mutex::default(),
            audit,
            path: path.to_owned(),
            backfill: (0..partitions).map(|_| AtomicU64::new(0)).collect(),
            backfills: Mutex::default(),
            closing: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The storage failure that stopped the store from acknowledging writes
    /// (fail-stop), if one happened. Reads keep working; every write is
    /// refused with it until the store is restarted.
    pub fn failure(&self) -> Option<StorageFailure> {
        self.commit.health.failure().cloned()
    }

    /// The data folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Send a command to the sequencer.
    pub(crate) fn send(&self, cmd: Command) -> Result<(), Closed> {
        self.tx.send(cmd).map_err(|_| Closed)
    }

    /// The audit log and token owners (used by the HTTP layer's auth).
    pub fn audit(&self) -> &crate::AuditLog {
        &self.audit
    }

    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// Watch a partition's durable head sequence number (for change
    /// streams): it changes after each flush that appended events. Readers
    /// then read the events after their last seen seq from the log, so a
    /// missed wake-up never loses an event.
    pub fn watch_head(&self, p: PartitionId) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.heads.get(p.0 as usize).cloned()
    }

    pub fn partition_of(&self, twin: &TwinId) -> PartitionId {
        palisade_core::partition_for(twin, self.partitions)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The last fencing token handed out.
    pub fn last_token(&self) -> FencingToken {
        FencingToken(self.last_token.load(Ordering::SeqCst))
    }

    /// Append events to one twin under a fencing token. Accepted iff the
    /// token was granted on a scope covering the twin and
    /// `token >= fence(twin)` and `token >= fence(partition)`; with
    /// `if_match`, also iff the twin's version equals it. All or nothing,
    /// acknowledged once durable.
    pub async fn append(
        &self,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        self.append_with_effects(twin, token, events, Vec::new(), if_match)
            .await
    }

    /// [`Store::append`] with each event's side effects (`effects[i]` for
    /// `events[i]`; an empty `effects` for none): recorded in the outbox in
    /// the same fenced commit as the events, only if the append is
    /// admitted, and only for events that are not duplicates
    /// (`outbox.rs`). In cluster mode they travel with the events in the
    /// partition's Kafka record ([`crate::AppendRoute`]).
    pub async fn append_with_effects(
        &self,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        effects: Vec<Vec<palisade_core::effect::Effect>>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        self.append_for(None, twin, token, events, effects, if_match)
            .await
    }

    /// [`Store::append_with_effects`] by `principal`, whose right to write
    /// the twin with `token` the caller has checked (authentication on;
    /// `None` when it is off). A single node appends as usual; in cluster
    /// mode the record the append travels in is signed as the principal,
    /// so the node that applies it checks the same rules again
    /// (docs/security.md, "Cluster mode").
    #[instrument(skip_all, fields(twin = %twin, token = token.0, partition))]
    pub async fn append_for(
        &self,
        principal: Option<&str>,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        effects: Vec<Vec<palisade_core::effect::Effect>>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        if !effects.is_empty() && effects.len() != events.len() {
            return Err(AppendError::BadEvent(format!(
                "{} effect lists for {} events",
                effects.len(),
                events.len()
            )));
        }
        if let Some(route) = self.append_route.get() {
            return route
                .append(
                    principal.map(str::to_owned),
                    twin,
                    token,
                    events,
                    effects,
                    if_match,
                )
                .await;
        }
        let p = self.partition_of(&twin);
        tracing::Span::current().record("partition", p.0);
        let twin_for_error = twin.clone();
        // Named in the rejection log if the token turns out not to be
        // issued for this partition (refined below, after the reply).
        let event_ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
        // The refusal journal's digest, taken before the events move into
        // the request (only needed if the token is refined below).
        let digest = crate::refusals::payload_digest(&events);
        let event_count = events.len();
        let (reply, rx) = oneshot::channel();
        let started = Instant::now();
        self.send(Command::Append {
            partition: p,
            req: AppendReq {
                twin,
                token,
                events,
                if_match,
                effects,
            },
            reply,
        })
        .map_err(|_| AppendError::Closed)?;
        let outcome = rx.await.map_err(|_| AppendError::Closed)?;
        if outcome.is_ok() {
            self.metrics.acknowledged(started.elapsed());
        }
        match outcome {
            Err(AppendError::NotIssued { token }) => {
                // The writer only knows the token was not granted for its
                // partition: tell "never issued" from "issued elsewhere".
                let e = match self.scope_of_token(token).await {
                    Some(scope) => AppendError::WrongScope {
                        token,
                        scope,
                        twin: twin_for_error.clone(),
                    },
                    // Never issued, or drawn from the counter without its grant
                    // completing (a crash between the two steps of `acquire`).
                    None => AppendError::NotIssued { token },
                };
                self.metrics.rejected(e.reason());
                let mut entry = Refusal::new(
                    p,
                    &twin_for_error,
                    RefusalSource::Http,
                    None,
                    token,
                    &e,
                    None,
                    &[],
                );
                entry.event_ids = event_ids.iter().take(64).cloned().collect();
                entry.event_count = u32::try_from(event_count).unwrap_or(u32::MAX);
                entry.digest = digest;
                self.journal_durably(entry).await;
                self.rejections.push(Rejection {
                    at_ms: crate::ingest::now_ms(),
                    source: "http",
                    partition: p,
                    source_partition: None,
                    offset: None,
                    twin: twin_for_error,
                    token,
                    event_ids,
                    reason: e.reason(),
                    detail: e.to_string(),
                });
                Err(e)
            }
            other => other,
        }
    }

    /// Queue a record of source partition `source` at `offset` and return
    /// the receiver of its outcome. The record is applied to its twin's
    /// partition, whichever source partition it comes from. Records queued
    /// for one source are handled in the order they are queued, so a
    /// consumer can queue a whole fetch and await the outcomes afterwards
    /// (they share group commits). An error from the receiver means the
    /// record was not applied and its offset not stored: the consumer must
    /// stop and resume from the stored offset.
    pub async fn enqueue_ingest(
        &self,
        source: &Source,
        offset: u64,
        record: IngestRecord,
    ) -> Result<oneshot::Receiver<Result<IngestOutcome, AppendError>>, AppendError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Ingest {
            source: source.clone(),
            offset,
            record,
            reply,
        })
        .map_err(|_| AppendError::Closed)?;
        Ok(rx)
    }

    /// Queue many records of one source partition, in offset order, as one
    /// command: the sequencer handles them in order in one group commit and
    /// answers once with every outcome (one channel message and one reply
    /// per fetch instead of per record). If a record fails, the ones after
    /// it in the batch are not applied and the reply is that error.
    pub async fn enqueue_ingest_batch(
        &self,
        source: &Source,
        records: Vec<(u64, IngestRecord)>,
    ) -> Result<oneshot::Receiver<Result<Vec<IngestOutcome>, AppendError>>, AppendError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::IngestBatch {
            source: source.clone(),
            records,
            reply,
        })
        .map_err(|_| AppendError::Closed)?;
        Ok(rx)
    }

    /// The last offset of `source` handled durably (applied, dropped,
    /// dead-lettered or forwarded), if any: where a consumer resumes (at
    /// this plus one).
    pub fn source_offset(&self, source: &Source) -> Result<Option<u64>, crate::ReadError> {
        let k = crate::keys::ingest::offset(&source.topic, source.partition);
        Ok(self
            .trees
            .ingest
            .get(&k)?
            .and_then(|v| crate::keys::ingest::u64_value(&v)))
    }

    /// Cluster mode: for each partition records of `source` were forwarded
    /// to, the origin offset of the last one (durably), where a forwarder
    /// resuming at [`Store::source_offset`] + 1 continues each chain.
    pub fn forward_chains(
        &self,
        source: &Source,
    ) -> Result<std::collections::BTreeMap<u32, u64>, crate::ReadError> {
        use crate::keys::ingest as k;
        let mut prefix = k::pair(k::CHAIN, &source.topic, source.partition, 0);
        prefix.truncate(prefix.len() - 4);
        let mut out = std::collections::BTreeMap::new();
        for kv in self.trees.ingest.scan_prefix(&prefix) {
            let (key, v) = kv?;
            if let (Some((_, ab)), Some(o)) = (k::parse(k::CHAIN, &key, 2), k::u64_value(&v)) {
                out.insert(ab[1], o);
            }
        }
        Ok(out)
    }

    /// Give the Kafka offsets of a store migrated from layout 2 (kept by
    /// partition, their topic never recorded) to `topic`: the consumer of
    /// `topic` then resumes where the old store stopped. Durable before it
    /// returns; a no-op once claimed. Returns how many were claimed.
    pub async fn claim_legacy_offsets(&self, topic: &str) -> Result<usize, AppendError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ClaimLegacy {
            topic: topic.to_owned(),
            reply,
        })
        .map_err(|_| AppendError::Closed)?;
        rx.await.map_err(|_| AppendError::Closed)?
    }

    /// Stored dead letters of one Kafka source partition (or all), oldest
    /// first (by source partition, then offset), with offsets after `after`.
    pub fn dead_letters(
        &self,
        partition: Option<u32>,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, crate::ReadError> {
        use crate::keys::ingest::dead_letter;
        let from = after.map_or(0, |a| a.saturating_add(1));
        let range = match partition {
            Some(p) => dead_letter(p, from)..=dead_letter(p, u64::MAX),
            None => dead_letter(0, 0)..=dead_letter(u32::MAX, u64::MAX),
        };
        let mut out = Vec::new();
        for kv in self.trees.ingest.range(range) {
            if out.len() >= limit {
                break;
            }
            let (k, v) = kv?;
            // Across partitions, `after` applies within each of them.
            let offset = k.get(5..13).and_then(crate::keys::ingest::u64_value);
            if offset.is_some_and(|o| o < from) {
                continue;
            }
            out.push(
                codec::decode(&v).map_err(|source| crate::ReadError::Damaged {
                    key: k.to_vec(),
                    source,
                })?,
            );
        }
        Ok(out)
    }

    /// Recent refused writes (HTTP and stream), newest first.
    pub fn rejections(&self, limit: usize) -> Vec<Rejection> {
        self.rejections.recent(limit)
    }

    /// Stage a refusal journal entry in the next round and wait until it is
    /// durable (the refusal is answered after it). A storage failure is
    /// logged, not returned: the refusal stands either way.
    async fn journal_durably(&self, entry: Refusal) {
        let (reply, rx) = oneshot::channel();
        let writes = self.refusals.stage(entry);
        if self
            .send(Command::Write {
                writes,
                reply: Some(reply),
            })
            .is_err()
        {
            tracing::warn!("refusal journal entry lost: the store is shutting down");
            return;
        }
        if let Ok(Err(f)) = rx.await {
            tracing::warn!(error = %f, "refusal journal entry not durable");
        }
    }

    /// The newest refused writes of `twin` in the durable refusal journal,
    /// newest first (at most `limit`; at most the partition's cap exist).
    /// Entries whose round is not yet durable are not listed.
    pub fn refusals_of_twin(
        &self,
        twin: &TwinId,
        limit: usize,
    ) -> Result<Vec<Refusal>, crate::ReadError> {
        let p = self.partition_of(twin);
        self.refusals.list(p.0, Some(twin), limit)
    }

    /// [`Store::refusals_of_twin`] on tokio's blocking pool (a scan of up
    /// to the partition's cap).
    pub async fn refusals_of_twin_async(
        self: &Arc<Self>,
        twin: &TwinId,
        limit: usize,
    ) -> Result<Vec<Refusal>, crate::ReadError> {
        let (store, twin) = (self.clone(), twin.clone());
        crate::read::off_worker(move || store.refusals_of_twin(&twin, limit)).await
    }

    /// [`Store::refusals_of_partition`] on tokio's blocking pool.
    pub async fn refusals_of_partition_async(
        self: &Arc<Self>,
        p: PartitionId,
        limit: usize,
    ) -> Result<Vec<Refusal>, crate::ReadError> {
        let store = self.clone();
        crate::read::off_worker(move || store.refusals_of_partition(p, limit)).await
    }

    /// The newest refused writes of partition `p`, newest first.
    pub fn refusals_of_partition(
        &self,
        p: PartitionId,
        limit: usize,
    ) -> Result<Vec<Refusal>, crate::ReadError> {
        if p.0 >= self.partitions {
            return Err(crate::ReadError::UnknownPartition {
                partition: p.0,
                partitions: self.partitions,
            });
        }
        self.refusals.list(p.0, None, limit)
    }

    /// Outbox entries (effects of admitted events, `outbox.rs`) in key
    /// order (partition, seq, effect index), optionally of one state only,
    /// at most `limit`. Only durable entries exist in sled. A scan of the
    /// whole outbox in the worst case.
    pub fn outbox_list(
        &self,
        state: Option<crate::outbox::DeliveryState>,
        limit: usize,
    ) -> Result<Vec<crate::outbox::OutboxEntry>, crate::ReadError> {
        let mut out = Vec::new();
        for kv in self.trees.outbox.iter() {
            if out.len() >= limit {
                break;
            }
            let e = decode_outbox(kv?)?;
            if state.is_none_or(|s| s == e.state) {
                out.push(e);
            }
        }
        Ok(out)
    }

    /// How many outbox entries are in `state` (a scan of the whole outbox,
    /// decoding each entry, keeping none).
    pub fn outbox_count(
        &self,
        state: crate::outbox::DeliveryState,
    ) -> Result<usize, crate::ReadError> {
        let mut n = 0;
        for kv in self.trees.outbox.iter() {
            if decode_outbox(kv?)?.state == state {
                n += 1;
            }
        }
        Ok(n)
    }

    /// How many outbox entries are in each state (one scan of the outbox;
    /// delivered entries are bounded by the dispatcher's retention,
    /// `--outbox-keep-delivered` per partition).
    pub fn outbox_counts(&self) -> Result<crate::outbox::OutboxCounts, crate::ReadError> {
        use crate::outbox::DeliveryState;
        let mut c = crate::outbox::OutboxCounts::default();
        for kv in self.trees.outbox.iter() {
            match decode_outbox(kv?)?.state {
                DeliveryState::Pending => c.pending += 1,
                DeliveryState::Delivered => c.delivered += 1,
                DeliveryState::Dead => c.dead += 1,
            }
        }
        Ok(c)
    }

    /// [`Store::outbox_counts`] on tokio's blocking pool.
    pub async fn outbox_counts_async(
        self: &Arc<Self>,
    ) -> Result<crate::outbox::OutboxCounts, crate::ReadError> {
        let store = self.clone();
        crate::read::off_worker(move || store.outbox_counts()).await
    }

    /// [`Store::outbox_list`] on tokio's blocking pool.
    pub async fn outbox_list_async(
        self: &Arc<Self>,
        state: Option<crate::outbox::DeliveryState>,
        limit: usize,
    ) -> Result<Vec<crate::outbox::OutboxEntry>, crate::ReadError> {
        let store = self.clone();
        crate::read::off_worker(move || store.outbox_list(state, limit)).await
    }

    /// Partition `p`'s pending outbox entries after `after` (seq, index),
    /// in order, up to the partition's durable head, at most `limit`. For
    /// the dispatcher.
    pub fn outbox_pending(
        &self,
        p: PartitionId,
        after: Option<(u64, u16)>,
        limit: usize,
    ) -> Result<Vec<crate::outbox::OutboxEntry>, crate::ReadError> {
        use crate::outbox::{key, DeliveryState};
        let head = self.heads.get(p.0 as usize).map_or(0, |h| *h.borrow());
        let hi = key(p.0, head, u16::MAX);
        let mut out = Vec::new();
        let range = match after {
            Some((seq, index)) => (
                std::ops::Bound::Excluded(key(p.0, seq, index)),
                std::ops::Bound::Included(hi),
            ),
            None => (
                std::ops::Bound::Included(key(p.0, 0, 0)),
                std::ops::Bound::Included(hi),
            ),
        };
        for kv in self.trees.outbox.range::<[u8; 14], _>(range) {
            if out.len() >= limit {
                break;
            }
            let e = decode_outbox(kv?)?;
            if e.state == DeliveryState::Pending {
                out.push(e);
            }
        }
        Ok(out)
    }

    /// Store an outbox entry's new delivery state through the commit path
    /// and wait until it is durable: a confirmed delivery recorded here is
    /// never delivered again, even after a crash.
    pub async fn outbox_update(
        &self,
        entry: &crate::outbox::OutboxEntry,
    ) -> Result<(), StorageFailure> {
        let (reply, rx) = oneshot::channel();
        let closed = || {
            StorageFailure::new(
                "closed",
                std::io::ErrorKind::BrokenPipe,
                "the store is shutting down".into(),
            )
        };
        self.send(Command::Write {
            writes: vec![entry.write()],
            reply: Some(reply),
        })
        .map_err(|_| closed())?;
        rx.await.map_err(|_| closed())?
    }

    /// Remove partition `p`'s delivered outbox entries but the newest
    /// `keep` (in key order: the latest events'), through the commit path,
    /// waiting until the removal is durable; how many were removed. Dead
    /// and pending entries are never removed here. A delivered entry is
    /// final (nothing rewrites it: the dispatcher works on pending entries
    /// only, and in cluster mode an outcome for a missing entry is
    /// ignored), so removing it races nothing.
    pub async fn outbox_prune(
        self: &Arc<Self>,
        p: PartitionId,
        keep: usize,
    ) -> Result<usize, StorageFailure> {
        use crate::outbox::{key, DeliveryState};
        let store = self.clone();
        let delivered = crate::read::off_worker(move || {
            let range = key(p.0, 0, 0)..=key(p.0, u64::MAX, u16::MAX);
            let mut keys = Vec::new();
            for kv in store.trees.outbox.range(range) {
                let kv = kv?;
                if decode_outbox(kv.clone())?.state == DeliveryState::Delivered {
                    keys.push(kv.0.to_vec());
                }
            }
            Ok::<_, crate::ReadError>(keys)
        })
        .await
        .map_err(|e| {
            StorageFailure::new(
                "outbox read",
                std::io::ErrorKind::InvalidData,
                e.to_string(),
            )
        })?;
        let surplus = delivered.len().saturating_sub(keep);
        for chunk in delivered[..surplus].chunks(PRUNE_CHUNK) {
            let (reply, rx) = oneshot::channel();
            let writes = chunk
                .iter()
                .map(|k| crate::writer::RawWrite {
                    tree: crate::wal::TreeId::OUTBOX,
                    key: k.clone(),
                    value: None,
                })
                .collect();
            self.send(Command::Write {
                writes,
                reply: Some(reply),
            })
            .map_err(|_| closed_failure())?;
            rx.await.map_err(|_| closed_failure())??;
        }
        Ok(surplus)
    }

    /// Remove a dead outbox effect (an operator has dealt with it); the
    /// entry as it was. On one node through the commit path, once durable;
    /// in cluster mode through the partition's log
    /// ([`crate::AppendRoute::remove_dead_effect`]).
    pub async fn outbox_remove_dead(
        &self,
        p: PartitionId,
        seq: u64,
        index: u16,
    ) -> Result<crate::outbox::OutboxEntry, crate::OutboxRemoveError> {
        if let Some(route) = self.append_route.get() {
            return route.remove_dead_effect(p.0, seq, index).await;
        }
        self.outbox_remove_local(p, seq, index).await
    }

    /// Remove a dead outbox effect from this store through the commit path,
    /// once durable (cluster mode: what applying an `outbox-remove` record
    /// does). Only dead entries: nothing else rewrites them (the dispatcher
    /// works on pending ones, retention on delivered ones; in cluster mode
    /// the consumer applies records one at a time), so this
    /// read-then-remove races nothing.
    pub async fn outbox_remove_local(
        &self,
        p: PartitionId,
        seq: u64,
        index: u16,
    ) -> Result<crate::outbox::OutboxEntry, crate::OutboxRemoveError> {
        use crate::OutboxRemoveError as E;
        let entry = self.outbox_get(p, seq, index)?.ok_or(E::NotFound {
            partition: p.0,
            seq,
            index,
        })?;
        if entry.state != crate::outbox::DeliveryState::Dead {
            return Err(E::NotDead {
                state: entry.state.name(),
            });
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Write {
            writes: vec![crate::writer::RawWrite {
                tree: crate::wal::TreeId::OUTBOX,
                key: entry.key().to_vec(),
                value: None,
            }],
            reply: Some(reply),
        })
        .map_err(|_| closed_failure())?;
        rx.await.map_err(|_| closed_failure())??;
        Ok(entry)
    }

    /// One outbox entry, as durable now.
    pub fn outbox_get(
        &self,
        p: PartitionId,
        seq: u64,
        index: u16,
    ) -> Result<Option<crate::outbox::OutboxEntry>, crate::ReadError> {
        let k = crate::outbox::key(p.0, seq, index);
        match self.trees.outbox.get(k)? {
            Some(v) => decode_outbox((k.to_vec().into(), v)).map(Some),
            None => Ok(None),
        }
    }

    /// Cluster mode: apply a delivery outcome read from the partition's
    /// log (`palisade-control: outbox`) to the entry it names, through the
    /// commit path, and wait until it is durable. Merged by
    /// [`crate::OutboxOutcome::merge_into`] (states only move forward), so
    /// applying the log's outcomes in order gives every node the same
    /// outbox. `Ok(false)`: nothing changed (an older outcome, or no such
    /// entry). The cluster consumer is the only writer of outbox states in
    /// cluster mode, one record at a time, so this read-merge-write does
    /// not race another.
    pub async fn outbox_settle(
        &self,
        outcome: &crate::outbox::OutboxOutcome,
    ) -> Result<bool, StorageFailure> {
        let entry = self
            .outbox_get(PartitionId(outcome.partition), outcome.seq, outcome.index)
            .map_err(|e| {
                StorageFailure::new(
                    "outbox read",
                    std::io::ErrorKind::InvalidData,
                    e.to_string(),
                )
            })?;
        let Some(mut entry) = entry else {
            return Ok(false);
        };
        if !outcome.merge_into(&mut entry) {
            return Ok(false);
        }
        self.outbox_update(&entry).await?;
        Ok(true)
    }

    /// Stop the sequencer after it decides what is queued, let the committer
    /// make it durable and answer it, and take a last checkpoint (so the next
    /// open has no log to replay). Bounded: if the disk does not answer
    /// within `CLOSE_TIMEOUT`, it returns anyway; nothing acknowledged
    /// depends on that checkpoint (the log holds it).
    pub async fn close(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::Release);
        let backfills = std::mem::take(
            &mut *self
                .backfills
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        // They stop within one batch of records.
        let _ = tokio::task::spawn_blocking(move || {
            for h in backfills {
                let _ = h.join();
            }
        })
        .await;
        let _ = self.send(Command::Stop);
        let sequencer = self
            .sequencer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let committer = self.committer.clone();
        let done = tokio::task::spawn_blocking(move || {
            if let Some(h) = sequencer {
                let _ = h.join();
            }
            let c = committer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(mut c) = c {
                c.finish();
            }
        });
        if tokio::time::timeout(CLOSE_TIMEOUT, done).await.is_err() {
            warn!(
                timeout_s = CLOSE_TIMEOUT.as_secs(),
                "closing the store timed out; the next open replays the write-ahead log"
            );
        }
    }
}

/// How long [`Store::open`] waits for sled's lock on its `db` file. A store
/// closed in this process a moment ago may still hold it: sled finishes its
/// last writes and truncations on its own thread pool, whose jobs keep the
/// file open for a while after the last handle is dropped (seen as a failed
/// reopen in CI). Another process holding the folder is refused after it.
const LOCK_WAIT: Duration = Duration::from_secs(2);

pub(crate) enum SledOpen {
    /// sled's lock on the `db` file is held (by another process, or still
    /// by this one's previous handle).
    InUse,
    Other(sled::Error),
}

pub(crate) fn open_sled(path: &Path, cache_bytes: u64) -> Result<sled::Db, SledOpen> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        let r = sled::Config::new()
            .path(path)
            .cache_capacity(cache_bytes)
            // The store makes sled durable itself (checkpoints, commit.rs):
            // sled's own flusher only adds syncs competing with the log's.
            .flush_every_ms(None)
            .open();
        match r {
            Ok(db) => return Ok(db),
            Err(sled::Error::Io(e)) if is_lock_held(&e) => {
                if std::time::Instant::now() >= deadline {
                    return Err(SledOpen::InUse);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(SledOpen::Other(e)),
        }
    }
}

/// sled 0.34 reports a held lock as an `Other` I/O error whose text starts
/// so (`config.rs`, `try_lock`), wrapping the `WouldBlock` of `flock`.
fn is_lock_held(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Other && e.to_string().starts_with("could not acquire lock")
}

/// Delivered outbox entries removed per commit round by
/// [`Store::outbox_prune`].
const PRUNE_CHUNK: usize = 4096;

fn closed_failure() -> StorageFailure {
    StorageFailure::new(
        "closed",
        std::io::ErrorKind::BrokenPipe,
        "the store is shutting down".into(),
    )
}

/// How long [`Store::close`] waits for the last round and checkpoint.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// The sequencer is gone (the store is closed).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Closed;

fn decode_outbox(
    (k, v): (sled::IVec, sled::IVec),
) -> Result<crate::outbox::OutboxEntry, crate::ReadError> {
    codec::decode(&v).map_err(|source| crate::ReadError::Damaged {
        key: k.to_vec(),
        source,
    })
}
