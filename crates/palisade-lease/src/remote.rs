//! The seam between the store and a lease authority that lives outside it
//! (etcd, `palisade-etcd`). The embedded [`LeaseAuthority`](crate::LeaseAuthority)
//! stays the default; a store opened with a [`RemoteAuthority`]
//! (`palisade_log::LeaseBackend::Remote`) asks it instead for every grant,
//! renewal and release, and still registers each grant with the
//! partition writer that enforces it (fence raised at once, token checked for
//! scope and never-regress exactly as for embedded tokens).

use std::fmt::Debug;

use palisade_core::{BoxFuture, FencingToken, LeaseId, Scope};

use crate::table::{AcquireRequest, Lease, LeaseError, Millis};

/// Why a remote authority refused or failed a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    /// The authority decided: the same refusals as the embedded table.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The authority could not be reached or did not answer; nothing is
    /// known to have been granted.
    #[error("lease authority {authority} unavailable: {detail}")]
    Unavailable {
        authority: &'static str,
        detail: String,
    },
}

/// A lease authority outside the store. Tokens it hands out must be
/// monotonic across every grant it ever makes (etcd: the lock key's create
/// revision); the store relies on nothing else.
pub trait RemoteAuthority: Send + Sync + Debug {
    /// Short name for logs and `/partitions` (`"etcd"`).
    fn name(&self) -> &'static str;

    /// Grant `req.scope` to `req.holder` unless another holder has it. The
    /// returned lease's `ttl_ms` is the TTL actually granted (it may be
    /// rounded up) and its `expires_at` is in this authority's [`Millis`].
    fn acquire(&self, req: AcquireRequest) -> BoxFuture<'_, Result<Lease, RemoteError>>;

    /// [`Self::acquire`] for principal `owner` (authentication on): an
    /// authority shared by several processes records the owner of the
    /// token and of the lease with the grant, before it returns, so that
    /// every process checks ownership the same way ([`Self::token_owner`],
    /// [`Self::lease_owner`]). The default records nothing (the store keeps
    /// owners itself).
    fn acquire_for(
        &self,
        req: AcquireRequest,
        owner: Option<String>,
    ) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        let _ = owner;
        self.acquire(req)
    }

    /// The principal `token` was granted to, as recorded by
    /// [`Self::acquire_for`] in any process (`None`: not recorded here).
    fn token_owner(
        &self,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        let _ = token;
        Box::pin(std::future::ready(Ok(None)))
    }

    /// The principal lease `id` was granted to, while it is live, as
    /// recorded by [`Self::acquire_for`] in any process.
    fn lease_owner(&self, id: LeaseId) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        let _ = id;
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Extend a live lease by its TTL, by lease id only.
    fn renew(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>>;

    /// Give a live lease up, by lease id only.
    fn release(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>>;

    /// The scope a token was granted on, if this authority issued it.
    fn scope_of_token(&self, token: FencingToken) -> BoxFuture<'_, Option<Scope>>;

    /// The live lease on `scope` as far as this process knows (leases it
    /// granted or renewed), without a round trip: used by listings only.
    fn holder_of(&self, scope: &Scope) -> Option<Lease>;

    /// The lease with this id as far as this process knows (granted or
    /// renewed here and not ended), without a round trip: the security
    /// guard's scope check on renew/release.
    fn lease(&self, id: LeaseId) -> Option<Lease>;

    /// How many live leases `holder` holds among those this process knows
    /// (granted or renewed here): the per-principal lease limit.
    fn live_leases_of(&self, holder: &str) -> usize;

    /// Monotonic now in the time base of the leases' `expires_at`.
    fn now(&self) -> Millis;

    /// True if this authority gets each grant to the partition writers
    /// itself (cluster mode: through the partition's Kafka log, in log
    /// order); the store then does not register it locally.
    fn registers_grants(&self) -> bool {
        false
    }
}
