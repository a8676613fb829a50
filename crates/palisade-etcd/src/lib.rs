//! Palisade's lease authority over etcd (the v3 API, through `etcd-client`).
//!
//! - A lease is an etcd lease. Its TTL is whole seconds: a requested
//!   `ttl_ms` is rounded **up** to the next second, and etcd may raise it
//!   further to its own minimum (1.5 × the election timeout, 2 s with the
//!   defaults). The lease returned says the TTL actually granted.
//! - The scope is taken by creating the lock key `<prefix>lock/<scope>`
//!   attached to that lease, in a transaction that succeeds only if the key
//!   does not exist. The **fencing token is the key's create revision**: etcd
//!   revisions come from its Raft log, so they only grow, across every key,
//!   every node and every restart of the cluster.
//! - Renewal and release go by lease id only (the etcd lease id, shown as the
//!   usual 32-hex-digit lease id). The lock key disappears with its lease
//!   (expiry or revoke), so the scope is free again.
//! - Every grant also writes `<prefix>token/<token, 20 digits>` -> scope
//!   (no lease, kept): any node can tell the scope of a token it did not
//!   grant.
//!
//! Safety never depends on these TTLs: the store's fence refuses a paused
//! holder's writes once a later grant is registered, exactly as with the
//! embedded authority.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use etcd_client::{LeaseTimeToLiveOptions, TxnOpResponse};
use palisade_core::{BoxFuture, FencingToken, LeaseId, Purpose, Scope};
use palisade_lease::{AcquireRequest, Lease, LeaseError, Millis, RemoteAuthority, RemoteError};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

mod owner;

/// How many ended leases are remembered, to tell a late renewal "released"
/// or "superseded" rather than "expired".
const RETIRED_MEMORY: usize = 4096;

/// Settings of the etcd authority (`--etcd-endpoints`, `--etcd-prefix`).
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `http://host:port` of one or more etcd members.
    pub endpoints: Vec<String>,
    /// Prefix of every key Palisade writes, so clusters can share an etcd.
    pub prefix: String,
    /// Timeout of each request (and of connecting).
    pub timeout: Duration,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: "/palisade/".into(),
            timeout: Duration::from_secs(5),
        }
    }
}

/// What the lock key holds besides its create revision (the token).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LockValue {
    holder: String,
    scope: String,
    /// The TTL granted, in ms (a multiple of 1000).
    ttl_ms: u64,
    /// What the lease is for (decision 0028); absent in keys written before
    /// purposes existed, which were all for correctness.
    #[serde(default)]
    purpose: Purpose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retired {
    Released,
}

/// What this process knows of leases without asking etcd: the ones it
/// granted or renewed (for listings and expiry estimates) and the ones it
/// ended (to name the reason to a late renewal).
#[derive(Debug, Default)]
struct Local {
    live: HashMap<LeaseId, Lease>,
    retired: HashMap<LeaseId, Retired>,
    order: VecDeque<LeaseId>,
    /// Token owners read or written here (they never change once written).
    token_owners: HashMap<FencingToken, String>,
}

/// Token owners remembered without asking etcd again (then forgotten all
/// at once: a cache, not the record).
const TOKEN_OWNERS_REMEMBERED: usize = 65_536;

impl Local {
    fn retire(&mut self, id: LeaseId, why: Retired) {
        self.live.remove(&id);
        if self.retired.insert(id, why).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > RETIRED_MEMORY {
            if let Some(old) = self.order.pop_front() {
                self.retired.remove(&old);
            }
        }
    }
}

/// The etcd lease authority. Cheap to share (`Arc`); every call clones the
/// client (one gRPC channel underneath).
#[derive(Clone)]
pub struct EtcdAuthority {
    client: Client,
    cfg: EtcdConfig,
    origin: Instant,
    local: Arc<Mutex<Local>>,
}

impl std::fmt::Debug for EtcdAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuthority")
            .field("endpoints", &self.cfg.endpoints)
            .field("prefix", &self.cfg.prefix)
            .finish_non_exhaustive()
    }
}

/// Why the authority could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no etcd endpoints given")]
    NoEndpoints,
    #[error("cannot reach etcd at {endpoints}: {source}")]
    Unreachable {
        endpoints: String,
        source: etcd_client::Error,
    },
}

impl EtcdAuthority {
    /// Connect and check that etcd answers (one read).
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, ConnectError> {
        if cfg.endpoints.is_empty() {
            return Err(ConnectError::NoEndpoints);
        }
        let unreachable = |source| ConnectError::Unreachable {
            endpoints: cfg.endpoints.join(","),
            source,
        };
        let opts = ConnectOptions::new()
            .with_timeout(cfg.timeout)
            .with_connect_timeout(cfg.timeout);
        let mut client = Client::connect(&cfg.endpoints, Some(opts))
            .await
            .map_err(unreachable)?;
        client
            .get(format!("{}probe", cfg.prefix), None)
            .await
            .map_err(unreachable)?;
        Ok(Self {
            client,
            cfg,
            origin: Instant::now(),
            local: Arc::new(Mutex::new(Local::default())),
        })
    }

    /// The create revision of `scope`'s lock key (its holder's fencing
    /// token), read straight from etcd: `None` if no one holds it.
    pub async fn lock_revision(&self, scope: &Scope) -> Result<Option<FencingToken>, RemoteError> {
        let got = self
            .client
            .clone()
            .get(self.lock_key(scope), None)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        Ok(got
            .kvs()
            .first()
            .and_then(|kv| u64::try_from(kv.create_revision()).ok())
            .map(FencingToken))
    }

    pub fn prefix(&self) -> &str {
        &self.cfg.prefix
    }

    /// The lock key of a scope.
    pub fn lock_key(&self, scope: &Scope) -> String {
        format!("{}lock/{scope}", self.cfg.prefix)
    }

    fn token_key(&self, token: FencingToken) -> String {
        format!("{}token/{:020}", self.cfg.prefix, token.0)
    }

    /// The principal a token was granted to (permanent, like the token key).
    fn token_owner_key(&self, token: FencingToken) -> String {
        format!("{}owner/token/{:020}", self.cfg.prefix, token.0)
    }

    /// The principal a live lease was granted to (attached to the lease:
    /// gone with it).
    fn lease_owner_key(&self, etcd_id: i64) -> String {
        format!("{}owner/lease/{etcd_id}", self.cfg.prefix)
    }

    fn remember_owner(&self, token: FencingToken, owner: &str) {
        let mut l = self.local();
        if l.token_owners.len() >= TOKEN_OWNERS_REMEMBERED {
            l.token_owners.clear();
        }
        l.token_owners.insert(token, owner.to_owned());
    }

    async fn do_token_owner(&self, token: FencingToken) -> Result<Option<String>, RemoteError> {
        if let Some(o) = self.local().token_owners.get(&token) {
            return Ok(Some(o.clone()));
        }
        let got = self
            .client
            .clone()
            .get(self.token_owner_key(token), None)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        let owner = got
            .kvs()
            .first()
            .and_then(|kv| std::str::from_utf8(kv.value()).ok().map(str::to_owned));
        if let Some(o) = &owner {
            self.remember_owner(token, o);
        }
        Ok(owner)
    }

    async fn do_lease_owner(&self, id: LeaseId) -> Result<Option<String>, RemoteError> {
        let Ok(etcd_id) = i64::try_from(id.0) else {
            return Ok(None);
        };
        let got = self
            .client
            .clone()
            .get(self.lease_owner_key(etcd_id), None)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        Ok(got
            .kvs()
            .first()
            .and_then(|kv| std::str::from_utf8(kv.value()).ok().map(str::to_owned)))
    }

    /// Record `owner` for a grant just made (token and lease), before the
    /// grant leaves this process.
    async fn bind_owner(
        &self,
        token: FencingToken,
        etcd_id: i64,
        owner: &str,
    ) -> Result<(), etcd_client::Error> {
        let txn = Txn::new().and_then([
            TxnOp::put(self.token_owner_key(token), owner, None),
            TxnOp::put(
                self.lease_owner_key(etcd_id),
                owner,
                Some(PutOptions::new().with_lease(etcd_id)),
            ),
        ]);
        self.client.clone().txn(txn).await?;
        self.remember_owner(token, owner);
        Ok(())
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now_ms(&self) -> Millis {
        Millis(
            self.origin
                .elapsed()
                .as_millis()
                .try_into()
                .unwrap_or(u64::MAX),
        )
    }

    fn unavailable(e: &etcd_client::Error) -> RemoteError {
        RemoteError::Unavailable {
            authority: "etcd",
            detail: e.to_string(),
        }
    }

    async fn do_acquire(
        &self,
        req: AcquireRequest,
        owner: Option<String>,
    ) -> Result<Lease, RemoteError> {
        req.validate()?;
        let mut c = self.client.clone();
        let ttl_s = i64::try_from(req.ttl_ms.div_ceil(1000).max(1)).unwrap_or(i64::MAX);
        let granted = c
            .lease_grant(ttl_s, None)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        let etcd_id = granted.id();
        let ttl_ms = u64::try_from(granted.ttl())
            .unwrap_or(0)
            .saturating_mul(1000);
        let key = self.lock_key(&req.scope);
        let value = serde_json::to_vec(&LockValue {
            holder: req.holder.clone(),
            scope: req.scope.to_string(),
            ttl_ms,
            purpose: req.purpose,
        })
        .map_err(|e| RemoteError::Unavailable {
            authority: "etcd",
            detail: e.to_string(),
        })?;
        // At most two rounds: the second after revoking the same holder's
        // earlier lease (a holder re-acquiring gets a new token, as with
        // the embedded authority).
        for round in 0..2 {
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(
                        key.clone(),
                        value.clone(),
                        Some(PutOptions::new().with_lease(etcd_id)),
                    ),
                    TxnOp::get(key.clone(), None),
                ])
                .or_else([TxnOp::get(key.clone(), None)]);
            let resp = match c.txn(txn).await {
                Ok(r) => r,
                Err(e) => {
                    self.revoke_quietly(etcd_id).await;
                    return Err(Self::unavailable(&e));
                }
            };
            let kv = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                _ => None,
            });
            let Some(kv) = kv else {
                // The key vanished between the compare and the read (the
                // holder's lease ended): try again.
                continue;
            };
            if resp.succeeded() {
                let token = FencingToken(u64::try_from(kv.create_revision()).unwrap_or(0));
                if let Err(e) = c
                    .put(self.token_key(token), req.scope.to_string(), None)
                    .await
                {
                    // The grant stands; only other nodes' scope lookups for
                    // error messages miss it.
                    warn!(token = token.0, error = %e, "could not record the token's scope in etcd");
                }
                if let Some(o) = &owner {
                    if let Err(e) = self.bind_owner(token, etcd_id, o).await {
                        // An owned token without its owner recorded would
                        // be refused everywhere: nobody gets it.
                        self.revoke_quietly(etcd_id).await;
                        return Err(Self::unavailable(&e));
                    }
                }
                let lease = Lease {
                    id: LeaseId(u128::from(etcd_id.cast_unsigned())),
                    scope: req.scope,
                    holder: req.holder,
                    token,
                    ttl_ms,
                    purpose: req.purpose,
                    expires_at: self.now_ms().0.saturating_add(ttl_ms),
                };
                debug!(scope = %lease.scope, token = token.0, lease = %lease.id, "etcd grant");
                self.local().live.insert(lease.id, lease.clone());
                return Ok(lease);
            }
            let cur: Option<LockValue> = serde_json::from_slice(kv.value()).ok();
            let cur_holder = cur.as_ref().map(|v| v.holder.clone()).unwrap_or_default();
            if cur_holder == req.holder && round == 0 {
                // Supersede the holder's own earlier lease (kept in `live`
                // so that its late renewal is told "superseded").
                self.revoke_quietly(kv.lease()).await;
                continue;
            }
            let left_s = c
                .lease_time_to_live(kv.lease(), None)
                .await
                .map(|r| r.ttl())
                .unwrap_or(0);
            self.revoke_quietly(etcd_id).await;
            return Err(LeaseError::Held {
                scope: req.scope,
                holder: cur_holder,
                token: FencingToken(u64::try_from(kv.create_revision()).unwrap_or(0)),
                expires_in_ms: u64::try_from(left_s).unwrap_or(0).saturating_mul(1000),
            }
            .into());
        }
        self.revoke_quietly(etcd_id).await;
        Err(RemoteError::Unavailable {
            authority: "etcd",
            detail: format!("the lock key of {} kept changing; retry", req.scope),
        })
    }

    async fn revoke_quietly(&self, etcd_id: i64) {
        if let Err(e) = self.client.clone().lease_revoke(etcd_id).await {
            debug!(lease = etcd_id, error = %e, "revoke failed (it expires on its own)");
        }
    }

    /// The lease behind `id` as etcd sees it now, with its remaining TTL in
    /// seconds; `Err` names why it is not live.
    async fn live_lease(&self, id: LeaseId) -> Result<(Lease, i64), RemoteError> {
        let Ok(etcd_id) = i64::try_from(id.0) else {
            return Err(LeaseError::Unknown(id).into());
        };
        let mut c = self.client.clone();
        let ttl = c
            .lease_time_to_live(etcd_id, Some(LeaseTimeToLiveOptions::new().with_keys()))
            .await
            .map_err(|e| Self::unavailable(&e))?;
        if ttl.ttl() <= 0 {
            return Err(self.ended(id).await);
        }
        let lock_prefix = format!("{}lock/", self.cfg.prefix);
        let Some(key) = ttl
            .keys()
            .iter()
            .find(|k| k.starts_with(lock_prefix.as_bytes()))
            .cloned()
        else {
            return Err(self.ended(id).await);
        };
        let got = c.get(key, None).await.map_err(|e| Self::unavailable(&e))?;
        let Some(kv) = got.kvs().first() else {
            return Err(self.ended(id).await);
        };
        let v: LockValue =
            serde_json::from_slice(kv.value()).map_err(|e| RemoteError::Unavailable {
                authority: "etcd",
                detail: format!("damaged lock key value: {e}"),
            })?;
        let scope: Scope = v.scope.parse().map_err(|e| RemoteError::Unavailable {
            authority: "etcd",
            detail: format!("damaged lock key scope: {e}"),
        })?;
        let lease = Lease {
            id,
            scope,
            holder: v.holder,
            token: FencingToken(u64::try_from(kv.create_revision()).unwrap_or(0)),
            ttl_ms: v.ttl_ms,
            purpose: v.purpose,
            expires_at: 0,
        };
        Ok((lease, ttl.ttl()))
    }

    /// Why lease `id` is no longer live: released here, superseded (its
    /// scope was granted again), or expired.
    async fn ended(&self, id: LeaseId) -> RemoteError {
        let known = {
            let mut l = self.local();
            if l.retired.get(&id) == Some(&Retired::Released) {
                return LeaseError::Released(id).into();
            }
            l.live.remove(&id)
        };
        let Some(old) = known else {
            // Granted by another node, or long ago: etcd forgets ended leases.
            return LeaseError::Expired(id).into();
        };
        let now = self
            .client
            .clone()
            .get(self.lock_key(&old.scope), None)
            .await
            .ok()
            .and_then(|g| g.kvs().first().map(etcd_client::KeyValue::create_revision))
            .and_then(|r| u64::try_from(r).ok());
        match now {
            Some(by) if by > old.token.0 => LeaseError::Superseded {
                lease_id: id,
                by_token: FencingToken(by),
            }
            .into(),
            _ => LeaseError::Expired(id).into(),
        }
    }

    async fn do_renew(&self, id: LeaseId) -> Result<Lease, RemoteError> {
        let (mut lease, _) = self.live_lease(id).await?;
        let etcd_id = i64::try_from(id.0).map_err(|_| LeaseError::Unknown(id))?;
        let (mut keeper, mut stream) = self
            .client
            .clone()
            .lease_keep_alive(etcd_id)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        keeper
            .keep_alive()
            .await
            .map_err(|e| Self::unavailable(&e))?;
        let resp = stream.message().await.map_err(|e| Self::unavailable(&e))?;
        let ttl_s = resp.map_or(0, |r| r.ttl());
        if ttl_s <= 0 {
            return Err(self.ended(id).await);
        }
        lease.ttl_ms = u64::try_from(ttl_s).unwrap_or(0).saturating_mul(1000);
        lease.expires_at = self.now_ms().0.saturating_add(lease.ttl_ms);
        self.local().live.insert(id, lease.clone());
        Ok(lease)
    }

    async fn do_release(&self, id: LeaseId) -> Result<Lease, RemoteError> {
        let (lease, left_s) = self.live_lease(id).await?;
        let etcd_id = i64::try_from(id.0).map_err(|_| LeaseError::Unknown(id))?;
        self.client
            .clone()
            .lease_revoke(etcd_id)
            .await
            .map_err(|e| Self::unavailable(&e))?;
        self.local().retire(id, Retired::Released);
        Ok(Lease {
            expires_at: self
                .now_ms()
                .0
                .saturating_add(u64::try_from(left_s).unwrap_or(0).saturating_mul(1000)),
            ..lease
        })
    }

    async fn do_scope_of_token(&self, token: FencingToken) -> Option<Scope> {
        let got = self
            .client
            .clone()
            .get(self.token_key(token), None)
            .await
            .ok()?;
        let kv = got.kvs().first()?;
        std::str::from_utf8(kv.value()).ok()?.parse().ok()
    }
}

impl RemoteAuthority for EtcdAuthority {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn acquire(&self, req: AcquireRequest) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.do_acquire(req, None))
    }

    fn acquire_for(
        &self,
        req: AcquireRequest,
        owner: Option<String>,
    ) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.do_acquire(req, owner))
    }

    fn token_owner(
        &self,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        Box::pin(self.do_token_owner(token))
    }

    fn lease_owner(&self, id: LeaseId) -> BoxFuture<'_, Result<Option<String>, RemoteError>> {
        Box::pin(self.do_lease_owner(id))
    }

    fn renew(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.do_renew(id))
    }

    fn release(&self, id: LeaseId) -> BoxFuture<'_, Result<Lease, RemoteError>> {
        Box::pin(self.do_release(id))
    }

    fn scope_of_token(&self, token: FencingToken) -> BoxFuture<'_, Option<Scope>> {
        Box::pin(self.do_scope_of_token(token))
    }

    fn holder_of(&self, scope: &Scope) -> Option<Lease> {
        let now = self.now_ms();
        self.local()
            .live
            .values()
            .find(|l| &l.scope == scope && l.expires_in_ms(now) > 0)
            .cloned()
    }

    fn lease(&self, id: LeaseId) -> Option<Lease> {
        self.local().live.get(&id).cloned()
    }

    fn live_leases_of(&self, holder: &str) -> usize {
        let now = self.now_ms();
        self.local()
            .live
            .values()
            .filter(|l| l.holder == holder && l.expires_in_ms(now) > 0)
            .count()
    }

    fn now(&self) -> Millis {
        self.now_ms()
    }
}
