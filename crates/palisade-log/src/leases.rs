//! The store's lease operations, dispatched in one place to the backend the
//! store was opened with ([`LeaseBackend`], `StoreConfig::leases`): the
//! embedded authority on the sequencer, or an authority outside the store
//! (etcd, cluster mode) whose grants are then registered with the partition
//! writers (docs/decisions/0025-lease-backend-at-open.md).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use palisade_core::{FencingToken, LeaseId, Scope};
use palisade_lease::{
    AcquireRequest, Advice, AuthorityError, Lease, LeaseAuthority, LeaseError, Millis,
    RemoteAuthority, RemoteError, RenewalTails, TtlCheck,
};
use tokio::sync::oneshot;
use tracing::{instrument, warn};

use crate::error::LeaseOpError;
use crate::writer::Command;
use crate::AuditError;
use crate::Store;

/// Where a store's leases come from, chosen when it opens and kept for its
/// life. A store keeps the backend its first token came from: opening it
/// with another is refused ([`crate::BackendError::Mismatch`]).
#[derive(Debug, Clone, Default)]
pub enum LeaseBackend {
    /// The store's own authority: grants decided on the sequencer, written
    /// in the same synced round as the fence they raise.
    #[default]
    Embedded,
    /// An authority outside the store (etcd, `palisade-etcd`; cluster mode's
    /// etcd-through-Kafka). Each grant is registered with the partition
    /// writer that enforces it, unless the authority does that itself.
    Remote(Arc<dyn RemoteAuthority>),
}

impl LeaseBackend {
    /// The name recorded in the store's meta tree (`lease_backend`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::Remote(r) => r.name(),
        }
    }
}

impl Store {
    pub(crate) fn authority(&self) -> MutexGuard<'_, LeaseAuthority> {
        // A panic while holding the lock cannot leave the table half-updated
        // in a way that matters for safety (the fence lives in the log), so a
        // poisoned lock is taken over rather than propagated.
        self.authority
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The remote authority, if the store was opened with one.
    fn remote(&self) -> Option<&dyn RemoteAuthority> {
        match &self.leases {
            LeaseBackend::Embedded => None,
            LeaseBackend::Remote(r) => Some(r.as_ref()),
        }
    }

    /// The lease with this id, if the authority still holds it (live, or
    /// expired but not yet swept).
    pub fn lease(&self, id: LeaseId) -> Option<Lease> {
        match self.remote() {
            Some(remote) => remote.lease(id),
            None => self.authority().get(id).cloned(),
        }
    }

    /// How many live leases `holder` holds.
    pub fn live_leases_of(&self, holder: &str) -> usize {
        match self.remote() {
            Some(remote) => remote.live_leases_of(holder),
            None => {
                let auth = self.authority();
                let now = auth.now();
                auth.table()
                    .leases()
                    .filter(|l| l.holder == holder && l.expires_in_ms(now) > 0)
                    .count()
            }
        }
    }

    /// Acquire a lease: the authority decides and persists the grant, then the
    /// partition writer that enforces the scope raises its fence. The lease is
    /// returned only after both are durable, so a paused former holder is
    /// refused even before the new holder's first write.
    pub async fn acquire(&self, req: AcquireRequest) -> Result<Lease, LeaseOpError> {
        self.acquire_for(req, None).await
    }

    /// [`Store::acquire`] for a principal (authentication on): the token
    /// and the lease id are bound to `owner` inside the grant, so appends,
    /// renewals and releases by anyone else are refused. With the embedded
    /// authority the binding is written in the grant's own round; with a
    /// remote one it is made durable before the lease is returned.
    #[instrument(skip_all, fields(scope = %req.scope, holder = %req.holder))]
    pub async fn acquire_for(
        &self,
        req: AcquireRequest,
        owner: Option<&str>,
    ) -> Result<Lease, LeaseOpError> {
        if let Scope::Partition(p) = &req.scope {
            if p.0 >= self.partitions {
                self.metrics().lease_refused("unknown_partition");
                return Err(LeaseOpError::UnknownPartition {
                    scope: req.scope.clone(),
                    partition: *p,
                    partitions: self.partitions,
                });
            }
        }
        let started = std::time::Instant::now();
        let lease = match self.remote() {
            Some(remote) => self.remote_acquire(remote, req, owner).await,
            None => {
                // The embedded authority decides on the sequencer, which
                // writes the lease records and raises the scope's fence in
                // one round.
                let id = LeaseId(uuid::Uuid::new_v4().as_u128());
                let (reply, rx) = oneshot::channel();
                self.send(Command::Acquire {
                    req,
                    id,
                    owner: owner.map(str::to_owned),
                    reply,
                })
                .map_err(|_| LeaseOpError::Closed)?;
                rx.await.map_err(|_| LeaseOpError::Closed)?
            }
        }?;
        let latency = started.elapsed();
        let now = self.lease_now();
        let check = {
            let mut tails = self.tails();
            tails.granted(&lease, now, micros(latency));
            tails.check_ttl(&lease, now)
        };
        self.metrics().lease_answered(latency);
        self.metrics().lease_granted_for(lease.purpose);
        self.check_ttl(check, &lease);
        Ok(lease)
    }

    /// Extend a live lease by its TTL (by lease id only); durable (its new
    /// deadline is stored) before the reply.
    pub async fn renew(&self, id: LeaseId) -> Result<Lease, LeaseOpError> {
        let started = std::time::Instant::now();
        let renewed = self.renew_on_backend(id).await;
        let latency = started.elapsed();
        let now = self.lease_now();
        match &renewed {
            Ok(lease) => {
                // One lock for the sample and the check.
                let (gap, check) = {
                    let mut tails = self.tails();
                    let gap = tails.renewed(lease, now, micros(latency));
                    (gap, tails.check_ttl(lease, now))
                };
                self.metrics().lease_renewed(gap, latency);
                self.check_ttl(check, lease);
            }
            // Late: the lease expired (and perhaps its scope was granted
            // again) before this renewal came. The gap that lost it counts.
            Err(LeaseOpError::Lease(LeaseError::Expired(_) | LeaseError::Superseded { .. })) => {
                let gap = self.tails().renewed_late(id, now);
                self.metrics().lease_renewed(gap, latency);
            }
            _ => {}
        }
        renewed
    }

    /// The TTL advice for `scope` (every holder's renewals on it, or only
    /// `holder`'s): `GET /v1/leases/advice`, docs/decisions/0026-ttl-advice.md.
    pub fn lease_advice(&self, scope: &Scope, holder: Option<&str>) -> Advice {
        self.tails().advice(scope, holder)
    }

    fn tails(&self) -> MutexGuard<'_, RenewalTails> {
        // Samples only: a panic mid-update loses nothing that matters.
        self.renewal_tails
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Warn (log and metric) when a lease was granted or renewed with a TTL
    /// below what its scope's measured tails call for.
    fn check_ttl(&self, check: TtlCheck, lease: &Lease) {
        let TtlCheck::Below { advice, log } = check else {
            return;
        };
        self.metrics().lease_ttl_below_advice();
        if log {
            warn!(
                scope = %lease.scope,
                holder = %lease.holder,
                ttl_ms = lease.ttl_ms,
                tail_ttl_ms = advice.tail_ttl_ms,
                pause_tail_ms = advice.pause_tail_ms,
                "lease TTL is below what this scope's measured renewal gaps call for: a pause as long as the tail may expire it (GET /v1/leases/advice; logged once a minute per scope and holder, counted in palisade_lease_ttl_below_advice_total)"
            );
        }
    }

    async fn renew_on_backend(&self, id: LeaseId) -> Result<Lease, LeaseOpError> {
        match self.remote() {
            Some(remote) => {
                let lease = remote.renew(id).await.map_err(|e| self.remote_failure(e))?;
                self.metrics()
                    .lease_renewals
                    .fetch_add(1, Ordering::Relaxed);
                Ok(lease)
            }
            None => {
                let (reply, rx) = oneshot::channel();
                self.send(Command::Renew { id, reply })
                    .map_err(|_| LeaseOpError::Closed)?;
                rx.await.map_err(|_| LeaseOpError::Closed)?
            }
        }
    }

    pub async fn release(&self, id: LeaseId) -> Result<Lease, LeaseOpError> {
        match self.remote() {
            Some(remote) => {
                let lease = remote
                    .release(id)
                    .await
                    .map_err(|e| self.remote_failure(e))?;
                self.metrics()
                    .lease_releases
                    .fetch_add(1, Ordering::Relaxed);
                Ok(lease)
            }
            None => {
                let (reply, rx) = oneshot::channel();
                self.send(Command::Release { id, reply })
                    .map_err(|_| LeaseOpError::Closed)?;
                rx.await.map_err(|_| LeaseOpError::Closed)?
            }
        }
    }

    /// Retire expired leases (and delete their records). The server calls
    /// this periodically; expiry itself needs no sweep to take effect.
    pub async fn sweep_leases(&self) -> Result<usize, LeaseOpError> {
        if self.remote().is_some() {
            // The remote authority expires its own leases.
            return Ok(0);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Sweep { reply })
            .map_err(|_| LeaseOpError::Closed)?;
        rx.await.map_err(|_| LeaseOpError::Closed)?
    }

    /// Monotonic now of the lease backend, in the time base of its leases'
    /// `expires_at`.
    fn lease_now(&self) -> Millis {
        match self.remote() {
            Some(remote) => remote.now(),
            None => self.authority().now(),
        }
    }

    /// Milliseconds until `lease` expires, by the authority's monotonic clock.
    pub fn lease_expires_in(&self, lease: &Lease) -> u64 {
        lease.expires_in_ms(self.lease_now())
    }

    /// The live lease on `scope`, if any.
    pub fn lease_holder(&self, scope: &Scope) -> Option<Lease> {
        match self.remote() {
            Some(remote) => remote.holder_of(scope),
            None => self.authority().holder_of(scope).cloned(),
        }
    }

    /// The scope `token` was granted on, if the backend issued it: tells a
    /// token that was never issued from one issued for another scope.
    pub(crate) async fn scope_of_token(&self, token: FencingToken) -> Option<Scope> {
        match self.remote() {
            Some(remote) => remote.scope_of_token(token).await,
            None => (token.0 != 0 && token <= self.last_token())
                .then(|| self.authority().scope_of_token(token))
                .flatten(),
        }
    }

    pub(crate) fn lease_failure(&self, e: AuthorityError) -> LeaseOpError {
        crate::writer::lease_failure(self.metrics(), e)
    }

    async fn remote_acquire(
        &self,
        remote: &dyn RemoteAuthority,
        req: AcquireRequest,
        owner: Option<&str>,
    ) -> Result<Lease, LeaseOpError> {
        let before = self.last_token();
        let lease = remote
            .acquire_for(req, owner.map(str::to_owned))
            .await
            .map_err(|e| self.remote_failure(e))?;
        if lease.token <= before {
            // Only after a store was moved to a fresh authority; the fence
            // refuses such tokens (never regress), so say why.
            warn!(token = lease.token.0, last = before.0, authority = remote.name(), "the authority granted a token at or below one this store has seen; writes with it will be refused as stale");
        }
        if let Some(o) = owner {
            self.bind_owner(&lease, o).await?;
        }
        if !remote.registers_grants() {
            self.register_grant(lease.token, lease.scope.clone(), lease.holder.clone())
                .await
                .inspect_err(|e| {
                    // The authority granted it but the fence is not raised:
                    // nobody got the token, so nobody can write with it. The
                    // scope stays taken until the lease expires.
                    warn!(error = %e, "fence raise failed after a grant");
                })?;
        }
        self.metrics().lease_grants.fetch_add(1, Ordering::Relaxed);
        Ok(lease)
    }

    /// The principal `token` was granted to: this store's record of it,
    /// else the lease authority's (shared by every node in cluster mode,
    /// `RemoteAuthority::acquire_for`). `None`: granted with authentication
    /// off, or never.
    pub async fn token_owner(&self, token: FencingToken) -> Result<Option<String>, AuditError> {
        if let Some(o) = self.audit().token_owner(token)? {
            return Ok(Some(o));
        }
        match self.remote() {
            Some(r) => Ok(r.token_owner(token).await?),
            None => Ok(None),
        }
    }

    /// The principal lease `id` was granted to, as [`Self::token_owner`].
    pub async fn lease_owner(&self, id: LeaseId) -> Result<Option<String>, AuditError> {
        if let Some(o) = self.audit().lease_owner(id.0)? {
            return Ok(Some(o));
        }
        match self.remote() {
            Some(r) => Ok(r.lease_owner(id).await?),
            None => Ok(None),
        }
    }

    /// Copy `token`'s owner from the lease authority into this store's
    /// record, durably, if it has one there. Cluster mode calls it when it
    /// applies a grant record: the record comes before any write with its
    /// token in the partition's log, and the Kafka path's check reads this
    /// store's record, so a token granted through another node is checked
    /// the same way here, and on every node that replays the log.
    pub async fn learn_token_owner(&self, token: FencingToken) -> Result<(), AuditError> {
        if self.audit().token_owner(token)?.is_some() {
            return Ok(());
        }
        if let Some(r) = self.remote() {
            if let Some(owner) = r.token_owner(token).await? {
                self.audit().bind_token(token, &owner).await?;
            }
        }
        Ok(())
    }

    /// A remote grant's owner, durably, before the lease leaves the store.
    async fn bind_owner(&self, lease: &Lease, owner: &str) -> Result<(), LeaseOpError> {
        let audit = self.audit();
        let bound = match audit.bind_token(lease.token, owner).await {
            Ok(()) => audit.bind_lease(lease.id.0, owner).await,
            Err(e) => Err(e),
        };
        bound.map_err(|e| match e {
            crate::AuditError::Failed(f) => LeaseOpError::StorageFailed(f),
            other => LeaseOpError::Storage(format!("token owners: {other}")),
        })
    }

    fn remote_failure(&self, e: RemoteError) -> LeaseOpError {
        match e {
            RemoteError::Lease(l) => self.lease_failure(AuthorityError::Lease(l)),
            RemoteError::Unavailable { .. } => {
                self.metrics().lease_refused("unavailable");
                LeaseOpError::Unavailable(e.to_string())
            }
        }
    }
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
