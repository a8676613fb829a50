use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use palisade_core::{codec, Clock, FencingToken, LeaseId, NewEvent, PartitionId, Scope, TwinId};
use palisade_lease::{AcquireRequest, AuthorityError, Lease, LeaseAuthority, RemoteAuthority};
use tokio::sync::{mpsc, oneshot};
use tracing::{info, instrument, warn};

use crate::error::{AppendError, LeaseOpError, OpenError};
use crate::ingest::{DeadLetter, IngestOutcome, IngestRecord, Rejection, RejectionLog};
use crate::writer::{AppendCmd, AppendReq, Command, Shared, Writer};
use crate::{Appended, Metrics};

pub const DEFAULT_PARTITIONS: u32 = 16;
/// Upper bound on partitions: each has a writer thread.
pub const MAX_PARTITIONS: u32 = 1024;
/// Requests that may wait in one partition's queue before senders wait.
const QUEUE_DEPTH: usize = 4096;

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
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            partitions: None,
            max_drift: Duration::from_millis(500),
            snapshot_every: 64,
            cache_bytes: 256 << 20,
        }
    }
}

/// The store: partitions, their writers, and the lease authority.
#[derive(Debug)]
pub struct Store {
    pub(crate) db: sled::Db,
    pub(crate) partitions: u32,
    pub(crate) trees: Vec<sled::Tree>,
    writers: Vec<mpsc::Sender<Command>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Each partition's durable head, updated after every flush.
    heads: Vec<tokio::sync::watch::Receiver<u64>>,
    pub(crate) authority: Arc<Mutex<LeaseAuthority>>,
    /// A lease authority outside the store (etcd), set once at start-up by
    /// `use_remote_authority` (cluster.rs); when set it replaces `authority`.
    pub(crate) remote: std::sync::OnceLock<Arc<dyn RemoteAuthority>>,
    /// Cluster mode: appends go through the partition's Kafka log instead
    /// of straight to the writer (set by `route_appends`, cluster.rs).
    pub(crate) append_route: std::sync::OnceLock<Arc<dyn crate::cluster::AppendRoute>>,
    pub(crate) last_token: Arc<AtomicU64>,
    clock: Arc<Clock>,
    metrics: Arc<Metrics>,
    rejections: Arc<RejectionLog>,
    /// Lease and refusal audit trail and token owners (`audit.rs`).
    audit: crate::AuditLog,
}

const FORMAT_KEY: &[u8] = b"format";
const PARTITIONS_KEY: &[u8] = b"partitions";

impl Store {
    /// Open the store in `path`, creating it if the folder holds none.
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
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(config.cache_bytes)
            .open()
            .map_err(sled_err)?;
        let meta = db.open_tree("meta").map_err(sled_err)?;
        let partitions = match (
            meta.get(PARTITIONS_KEY).map_err(sled_err)?,
            meta.get(FORMAT_KEY).map_err(sled_err)?,
        ) {
            (Some(n), Some(f)) => {
                let found = f.first().copied().unwrap_or(0);
                if found != crate::keys::LAYOUT_VERSION {
                    return Err(OpenError::Format {
                        path: shown,
                        found,
                        supported: crate::keys::LAYOUT_VERSION,
                    });
                }
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
                let n = config.partitions.unwrap_or(DEFAULT_PARTITIONS);
                let mut b = sled::Batch::default();
                b.insert(FORMAT_KEY, &[crate::keys::LAYOUT_VERSION][..]);
                b.insert(PARTITIONS_KEY, &n.to_be_bytes()[..]);
                meta.apply_batch(b).map_err(sled_err)?;
                meta.flush().map_err(sled_err)?;
                info!(path = %shown, partitions = n, "created a new store");
                n
            }
        };
        let authority = LeaseAuthority::open(db.open_tree("leases").map_err(sled_err)?)?;
        let audit = crate::AuditLog::open(&db).map_err(sled_err)?;
        let last_token = Arc::new(AtomicU64::new(authority.last_token().0));
        let clock = Arc::new(Clock::new(config.max_drift));
        let metrics = Arc::new(Metrics::default());
        let rejections = Arc::new(RejectionLog::default());
        let shared = Arc::new(Shared {
            clock: clock.clone(),
            metrics: metrics.clone(),
            rejections: rejections.clone(),
            snapshot_every: config.snapshot_every.max(1),
        });
        let mut trees = Vec::with_capacity(partitions as usize);
        let mut writers = Vec::with_capacity(partitions as usize);
        let mut threads = Vec::with_capacity(partitions as usize);
        let mut heads = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            let tree = db
                .open_tree(format!("partition/{p:05}"))
                .map_err(sled_err)?;
            let (writer, head) = Writer::load(PartitionId(p), tree.clone(), shared.clone())?;
            heads.push(head);
            let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
            let handle = std::thread::Builder::new()
                .name(format!("palisade-p{p}"))
                .spawn(move || writer.run(rx))
                .map_err(OpenError::Thread)?;
            trees.push(tree);
            writers.push(tx);
            threads.push(handle);
        }
        Ok(Self {
            db,
            partitions,
            trees,
            writers,
            threads: Mutex::new(threads),
            heads,
            authority: Arc::new(Mutex::new(authority)),
            remote: std::sync::OnceLock::new(),
            append_route: std::sync::OnceLock::new(),
            last_token,
            clock,
            metrics,
            rejections,
            audit,
        })
    }

    /// The audit log and token owners (used by the HTTP layer's auth).
    pub fn audit(&self) -> &crate::AuditLog {
        &self.audit
    }

    /// The lease with this id, if the authority still holds it (live, or
    /// expired but not yet swept).
    pub fn lease(&self, id: LeaseId) -> Option<Lease> {
        match self.remote.get() {
            Some(remote) => remote.lease(id),
            None => self.authority().get(id).cloned(),
        }
    }

    /// How many live leases `holder` holds.
    pub fn live_leases_of(&self, holder: &str) -> usize {
        if let Some(remote) = self.remote.get() {
            return remote.live_leases_of(holder);
        }
        let auth = self.authority();
        let now = auth.now();
        auth.table()
            .leases()
            .filter(|l| l.holder == holder && l.expires_in_ms(now) > 0)
            .count()
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

    pub(crate) fn authority(&self) -> MutexGuard<'_, LeaseAuthority> {
        // A panic while holding the lock cannot leave the table half-updated
        // in a way that matters for safety (the fence lives in the log), so a
        // poisoned lock is taken over rather than propagated.
        self.authority
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Acquire a lease: the authority decides and persists the grant, then the
    /// partition writer that enforces the scope raises its fence. The lease is
    /// returned only after both are durable, so a paused former holder is
    /// refused even before the new holder's first write.
    #[instrument(skip_all, fields(scope = %req.scope, holder = %req.holder))]
    pub async fn acquire(&self, req: AcquireRequest) -> Result<Lease, LeaseOpError> {
        if let Scope::Partition(p) = &req.scope {
            if p.0 >= self.partitions {
                self.metrics.lease_refused("unknown_partition");
                return Err(LeaseOpError::UnknownPartition {
                    scope: req.scope.clone(),
                    partition: *p,
                    partitions: self.partitions,
                });
            }
        }
        let lease = if let Some(remote) = self.remote.get() {
            let lease = self.remote_acquire(remote.as_ref(), req).await?;
            if remote.registers_grants() {
                self.metrics.lease_grants.fetch_add(1, Ordering::Relaxed);
                return Ok(lease);
            }
            lease
        } else {
            let id = LeaseId(uuid::Uuid::new_v4().as_u128());
            let auth = self.authority.clone();
            tokio::task::spawn_blocking(move || {
                auth.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .acquire(req, id)
            })
            .await
            .map_err(|e| LeaseOpError::Storage(e.to_string()))?
            .map_err(|e| self.lease_failure(e))?
            .lease
        };
        self.last_token.fetch_max(lease.token.0, Ordering::SeqCst);
        let p = lease.scope.partition(self.partitions);
        let (reply, rx) = oneshot::channel();
        self.writer(p)
            .send(Command::Grant {
                token: lease.token,
                scope: lease.scope.clone(),
                holder: lease.holder.clone(),
                reply,
            })
            .await
            .map_err(|_| LeaseOpError::Closed)?;
        rx.await.map_err(|_| LeaseOpError::Closed)?.map_err(|e| {
            // The grant is on disk but its fence is not: nobody got the
            // token, so nobody can write with it. The scope stays taken
            // until the lease expires.
            warn!(error = %e, "fence raise failed after a grant");
            LeaseOpError::Storage(e)
        })?;
        self.metrics.lease_grants.fetch_add(1, Ordering::Relaxed);
        Ok(lease)
    }

    pub async fn renew(&self, id: LeaseId) -> Result<Lease, LeaseOpError> {
        if let Some(remote) = self.remote.get() {
            return self.remote_renew(remote.as_ref(), id).await;
        }
        let r = self
            .authority()
            .renew(id)
            .map_err(|e| self.lease_failure(e))?;
        self.metrics.lease_renewals.fetch_add(1, Ordering::Relaxed);
        Ok(r)
    }

    pub async fn release(&self, id: LeaseId) -> Result<Lease, LeaseOpError> {
        if let Some(remote) = self.remote.get() {
            return self.remote_release(remote.as_ref(), id).await;
        }
        let auth = self.authority.clone();
        let r = tokio::task::spawn_blocking(move || {
            auth.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .release(id)
        })
        .await
        .map_err(|e| LeaseOpError::Storage(e.to_string()))?
        .map_err(|e| self.lease_failure(e))?;
        self.metrics.lease_releases.fetch_add(1, Ordering::Relaxed);
        Ok(r)
    }

    /// Retire expired leases (and delete their records). The server calls
    /// this periodically; expiry itself needs no sweep to take effect.
    pub async fn sweep_leases(&self) -> Result<usize, LeaseOpError> {
        if self.remote.get().is_some() {
            // The remote authority expires its own leases.
            return Ok(0);
        }
        let auth = self.authority.clone();
        let gone = tokio::task::spawn_blocking(move || {
            auth.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .sweep()
        })
        .await
        .map_err(|e| LeaseOpError::Storage(e.to_string()))?
        .map_err(|e| self.lease_failure(e))?;
        self.metrics
            .lease_expiries
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        Ok(gone.len())
    }

    /// Milliseconds until `lease` expires, by the authority's monotonic clock.
    pub fn lease_expires_in(&self, lease: &Lease) -> u64 {
        if let Some(remote) = self.remote.get() {
            return lease.expires_in_ms(remote.now());
        }
        lease.expires_in_ms(self.authority().now())
    }

    /// The live lease on `scope`, if any.
    pub fn lease_holder(&self, scope: &Scope) -> Option<Lease> {
        if let Some(remote) = self.remote.get() {
            return remote.holder_of(scope);
        }
        self.authority().holder_of(scope).cloned()
    }

    pub(crate) fn lease_failure(&self, e: AuthorityError) -> LeaseOpError {
        match e {
            AuthorityError::Lease(e) => {
                self.metrics.lease_refused(match &e {
                    palisade_lease::LeaseError::Held { .. } => "held",
                    palisade_lease::LeaseError::Expired(_) => "expired",
                    palisade_lease::LeaseError::Superseded { .. } => "superseded",
                    palisade_lease::LeaseError::Released(_) => "released",
                    palisade_lease::LeaseError::Unknown(_) => "unknown",
                    _ => "bad_request",
                });
                LeaseOpError::Lease(e)
            }
            other => LeaseOpError::Storage(other.to_string()),
        }
    }

    pub(crate) fn writer(&self, p: PartitionId) -> &mpsc::Sender<Command> {
        &self.writers[p.0 as usize % self.writers.len()]
    }

    /// Append events to one twin under a fencing token. Accepted iff the
    /// token was granted on a scope covering the twin and
    /// `token >= fence(twin)` and `token >= fence(partition)`; with
    /// `if_match`, also iff the twin's version equals it. All or nothing,
    /// acknowledged once durable.
    #[instrument(skip_all, fields(twin = %twin, token = token.0, partition))]
    pub async fn append(
        &self,
        twin: TwinId,
        token: FencingToken,
        events: Vec<NewEvent>,
        if_match: Option<u64>,
    ) -> Result<Appended, AppendError> {
        if let Some(route) = self.append_route.get() {
            return route.append(twin, token, events, if_match).await;
        }
        let p = self.partition_of(&twin);
        tracing::Span::current().record("partition", p.0);
        let twin_for_error = twin.clone();
        let (reply, rx) = oneshot::channel();
        self.writer(p)
            .send(Command::Append(AppendCmd {
                req: AppendReq {
                    twin,
                    token,
                    events,
                    if_match,
                },
                reply,
            }))
            .await
            .map_err(|_| AppendError::Closed)?;
        match rx.await.map_err(|_| AppendError::Closed)? {
            Err(AppendError::NotIssued { token }) => {
                // The writer only knows the token was not granted for its
                // partition: tell "never issued" from "issued elsewhere".
                let scope = match self.remote.get() {
                    Some(remote) => remote.scope_of_token(token).await,
                    None => (token.0 != 0 && token <= self.last_token())
                        .then(|| self.authority().scope_of_token(token))
                        .flatten(),
                };
                let e = match scope {
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
                self.rejections.push(Rejection {
                    at_ms: crate::ingest::now_ms(),
                    source: "http",
                    partition: p,
                    offset: None,
                    twin: twin_for_error,
                    token,
                    reason: e.reason(),
                    detail: e.to_string(),
                });
                Err(e)
            }
            other => other,
        }
    }

    /// Queue a source record of partition `partition` at `offset` and return
    /// the receiver of its outcome. Records queued for one partition are
    /// handled in the order they are queued, so a consumer can queue a whole
    /// fetch and await the outcomes afterwards (they share group commits).
    /// An error from the receiver means the record was not applied and its
    /// offset not stored: the consumer must stop and resume from the stored
    /// offset.
    pub async fn enqueue_ingest(
        &self,
        partition: PartitionId,
        offset: u64,
        record: IngestRecord,
    ) -> Result<oneshot::Receiver<Result<IngestOutcome, AppendError>>, AppendError> {
        if partition.0 >= self.partitions {
            return Err(AppendError::BadEvent(format!(
                "source partition {partition} does not exist; the store has {} partitions",
                self.partitions
            )));
        }
        let (reply, rx) = oneshot::channel();
        self.writer(partition)
            .send(Command::Ingest {
                offset,
                record,
                reply,
            })
            .await
            .map_err(|_| AppendError::Closed)?;
        Ok(rx)
    }

    /// Queue many source records of one partition, in offset order, as one
    /// command: the writer handles them in order in one group commit and
    /// answers once with every outcome (one channel message and one reply
    /// per fetch instead of per record). If a record fails, the ones after
    /// it in the batch are not applied and the reply is that error.
    pub async fn enqueue_ingest_batch(
        &self,
        partition: PartitionId,
        records: Vec<(u64, IngestRecord)>,
    ) -> Result<oneshot::Receiver<Result<Vec<IngestOutcome>, AppendError>>, AppendError> {
        if partition.0 >= self.partitions {
            return Err(AppendError::BadEvent(format!(
                "source partition {partition} does not exist; the store has {} partitions",
                self.partitions
            )));
        }
        let (reply, rx) = oneshot::channel();
        self.writer(partition)
            .send(Command::IngestBatch { records, reply })
            .await
            .map_err(|_| AppendError::Closed)?;
        Ok(rx)
    }

    /// The last source offset applied to `partition`, if any: where a
    /// consumer resumes (at this plus one).
    pub fn source_offset(&self, partition: PartitionId) -> Result<Option<u64>, crate::ReadError> {
        let tree =
            self.trees
                .get(partition.0 as usize)
                .ok_or(crate::ReadError::UnknownPartition {
                    partition: partition.0,
                    partitions: self.partitions,
                })?;
        Ok(tree
            .get(crate::keys::SOURCE_OFFSET)?
            .and_then(|v| crate::keys::trailing_seq(&v)))
    }

    /// Stored dead letters of one partition (or all), oldest first, with
    /// offsets after `after`.
    pub fn dead_letters(
        &self,
        partition: Option<PartitionId>,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, crate::ReadError> {
        let mut out = Vec::new();
        for (i, tree) in self.trees.iter().enumerate() {
            if partition.is_some_and(|p| p.0 as usize != i) {
                continue;
            }
            let start = crate::keys::dead_letter(after.map_or(0, |a| a.saturating_add(1)));
            for kv in tree.range(start..=crate::keys::dead_letter(u64::MAX)) {
                if out.len() >= limit {
                    return Ok(out);
                }
                let (k, v) = kv?;
                out.push(
                    codec::decode(&v).map_err(|source| crate::ReadError::Damaged {
                        key: k.to_vec(),
                        source,
                    })?,
                );
            }
        }
        Ok(out)
    }

    /// Recent refused writes (HTTP and stream), newest first.
    pub fn rejections(&self, limit: usize) -> Vec<Rejection> {
        self.rejections.recent(limit)
    }

    /// Stop the writers after they commit what is queued, and flush.
    pub async fn close(&self) {
        for w in &self.writers {
            let _ = w.send(Command::Stop).await;
        }
        let handles: Vec<_> = std::mem::take(
            &mut *self
                .threads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let _ = tokio::task::spawn_blocking(move || {
            for h in handles {
                let _ = h.join();
            }
        })
        .await;
        if let Err(e) = self.db.flush_async().await {
            warn!(error = %e, "final flush failed");
        }
    }
}
