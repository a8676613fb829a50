use std::collections::{HashMap, VecDeque};

use palisade_core::{FencingToken, LeaseId, Purpose, Scope};

/// Monotonic time in milliseconds since an origin the caller picks (the
/// durable shell uses process start). Never a wall clock: a wall-clock jump
/// must not expire or extend a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millis(pub u64);

impl Millis {
    fn plus(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(ms))
    }
}

/// Shortest TTL accepted: shorter leases would expire between a grant and
/// the holder's first renewal on any real network.
pub const MIN_TTL_MS: u64 = 100;
/// Longest TTL accepted (one day): past that a dead holder blocks its scope
/// for longer than any operator would wait.
pub const MAX_TTL_MS: u64 = 86_400_000;
/// Longest holder name, in bytes.
pub const MAX_HOLDER_LEN: usize = 256;

/// How many retired lease ids are remembered, to tell a late renewal
/// "superseded" or "expired" rather than "unknown".
const RETIRED_MEMORY: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireRequest {
    pub scope: Scope,
    pub holder: String,
    pub ttl_ms: u64,
    /// What the lease is for; the default is correctness.
    pub purpose: Purpose,
}

impl AcquireRequest {
    /// The checks every authority (embedded or remote) makes before a grant:
    /// a TTL within bounds and a printable, bounded holder name.
    pub fn validate(&self) -> Result<(), LeaseError> {
        if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&self.ttl_ms) {
            return Err(LeaseError::BadTtl(self.ttl_ms));
        }
        if self.holder.is_empty()
            || self.holder.len() > MAX_HOLDER_LEN
            || self.holder.chars().any(char::is_control)
        {
            return Err(LeaseError::BadHolder);
        }
        Ok(())
    }
}

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    pub scope: Scope,
    pub holder: String,
    pub token: FencingToken,
    pub ttl_ms: u64,
    pub purpose: Purpose,
    /// Monotonic expiry in [`Millis`]. Not meaningful across restarts, so it
    /// is not persisted (see [`LeaseTable::restore`]).
    pub expires_at: u64,
}

impl Lease {
    pub fn expires_in_ms(&self, now: Millis) -> u64 {
        self.expires_at.saturating_sub(now.0)
    }

    fn is_live(&self, now: Millis) -> bool {
        now.0 < self.expires_at
    }
}

/// The outcome of a successful acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub lease: Lease,
    /// The lease this grant replaced on the same scope (expired, or the same
    /// holder's earlier lease), whose record the durable layer deletes.
    pub replaced: Option<LeaseId>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("scope {scope} is held by {holder:?} for another {expires_in_ms} ms")]
    Held {
        scope: Scope,
        holder: String,
        token: FencingToken,
        expires_in_ms: u64,
    },
    #[error("lease {0} expired before this request arrived")]
    Expired(LeaseId),
    #[error("lease {lease_id} was superseded: its scope was granted again with token {by_token}")]
    Superseded {
        lease_id: LeaseId,
        by_token: FencingToken,
    },
    #[error("lease {0} was released")]
    Released(LeaseId),
    #[error("no lease with id {0} is known")]
    Unknown(LeaseId),
    #[error("ttl_ms must be between {MIN_TTL_MS} and {MAX_TTL_MS}, got {0}")]
    BadTtl(u64),
    #[error("holder must be 1 to {MAX_HOLDER_LEN} bytes without control characters")]
    BadHolder,
    #[error("the fencing-token counter is exhausted")]
    TokensExhausted,
    #[error("lease id {0} is already in use")]
    DuplicateId(LeaseId),
}

/// Why a lease id stopped being live, remembered for late requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retired {
    Expired,
    Superseded(FencingToken),
    Released,
}

/// The lease decisions: which lease is live on each scope, and the token
/// counter. Pure: time is an argument, nothing is persisted here.
#[derive(Debug, Clone, Default)]
pub struct LeaseTable {
    /// The last token handed out; the next grant gets `last_token + 1`.
    last_token: u64,
    /// The newest lease of each scope. It may have expired: expiry is only
    /// observed when someone asks, so no timer is needed.
    by_scope: HashMap<Scope, Lease>,
    by_id: HashMap<LeaseId, Scope>,
    /// Recently retired ids (bounded, oldest evicted first).
    retired: HashMap<LeaseId, Retired>,
    retired_order: VecDeque<LeaseId>,
}

impl LeaseTable {
    /// A table whose next grant is `last_token + 1`.
    pub fn new(last_token: FencingToken) -> Self {
        Self {
            last_token: last_token.0,
            ..Self::default()
        }
    }

    /// Rebuild after a restart from persisted leases, each with a full TTL
    /// from `now` (see [`LeaseTable::restore_with_remaining`]).
    pub fn restore(
        last_token: FencingToken,
        leases: impl IntoIterator<Item = Lease>,
        now: Millis,
    ) -> Self {
        Self::restore_with_remaining(
            last_token,
            leases.into_iter().map(|l| {
                let ttl = l.ttl_ms;
                (l, ttl)
            }),
            now,
        )
    }

    /// Rebuild after a restart from persisted leases, each given with the
    /// milliseconds it has left from `now` (monotonic time does not survive a
    /// restart, so the caller works this out from what it stored; at most the
    /// lease's TTL). A lease with 0 left is restored expired: renewals are
    /// refused and its scope is free, until a sweep retires it.
    pub fn restore_with_remaining(
        last_token: FencingToken,
        leases: impl IntoIterator<Item = (Lease, u64)>,
        now: Millis,
    ) -> Self {
        let mut table = Self::new(last_token);
        for (mut lease, left_ms) in leases {
            lease.expires_at = now.plus(left_ms.min(lease.ttl_ms)).0;
            table.last_token = table.last_token.max(lease.token.0);
            table.by_id.insert(lease.id, lease.scope.clone());
            table.by_scope.insert(lease.scope.clone(), lease);
        }
        table
    }

    pub fn last_token(&self) -> FencingToken {
        FencingToken(self.last_token)
    }

    /// Grant `req.scope` to `req.holder` unless another holder's lease on it
    /// is live. A holder re-acquiring its own scope gets a new lease and a
    /// new token (it may have lost its lease id in a crash); its old lease is
    /// superseded.
    pub fn acquire(
        &mut self,
        req: AcquireRequest,
        id: LeaseId,
        now: Millis,
    ) -> Result<Grant, LeaseError> {
        req.validate()?;
        if self.by_id.contains_key(&id) || self.retired.contains_key(&id) {
            return Err(LeaseError::DuplicateId(id));
        }
        if let Some(cur) = self.by_scope.get(&req.scope) {
            if cur.is_live(now) && cur.holder != req.holder {
                return Err(LeaseError::Held {
                    scope: req.scope,
                    holder: cur.holder.clone(),
                    token: cur.token,
                    expires_in_ms: cur.expires_in_ms(now),
                });
            }
        }
        let token = self
            .last_token
            .checked_add(1)
            .ok_or(LeaseError::TokensExhausted)?;
        self.last_token = token;
        let lease = Lease {
            id,
            scope: req.scope.clone(),
            holder: req.holder,
            token: FencingToken(token),
            ttl_ms: req.ttl_ms,
            purpose: req.purpose,
            expires_at: now.plus(req.ttl_ms).0,
        };
        let replaced = self
            .by_scope
            .insert(req.scope.clone(), lease.clone())
            .map(|old| {
                self.by_id.remove(&old.id);
                self.retire(old.id, Retired::Superseded(FencingToken(token)));
                old.id
            });
        self.by_id.insert(id, req.scope);
        Ok(Grant { lease, replaced })
    }

    /// Extend a live lease by its TTL from `now`. Same token: a renewal is not
    /// a new grant. A lease that already expired stays expired even if nobody
    /// took its scope (the reference article's scenario 6: the holder cannot
    /// know whether someone did, so it must acquire anew and get a new token).
    pub fn renew(&mut self, id: LeaseId, now: Millis) -> Result<Lease, LeaseError> {
        let lease = self.live_mut(id, now)?;
        lease.expires_at = now.plus(lease.ttl_ms).0;
        Ok(lease.clone())
    }

    /// Release a live lease so its scope can be granted at once. Only the
    /// lease named by `id` is ever freed.
    pub fn release(&mut self, id: LeaseId, now: Millis) -> Result<Lease, LeaseError> {
        self.live_mut(id, now)?;
        let scope = self.by_id.remove(&id).ok_or(LeaseError::Unknown(id))?;
        let lease = self
            .by_scope
            .remove(&scope)
            .ok_or(LeaseError::Unknown(id))?;
        self.retire(id, Retired::Released);
        Ok(lease)
    }

    /// Retire every lease whose TTL has passed, so that the table (and the
    /// records on disk) do not grow with every twin ever leased. Returns the
    /// retired leases.
    pub fn expire(&mut self, now: Millis) -> Vec<Lease> {
        let dead: Vec<Scope> = self
            .by_scope
            .iter()
            .filter(|(_, l)| !l.is_live(now))
            .map(|(s, _)| s.clone())
            .collect();
        let mut out = Vec::with_capacity(dead.len());
        for scope in dead {
            if let Some(lease) = self.by_scope.remove(&scope) {
                self.by_id.remove(&lease.id);
                self.retire(lease.id, Retired::Expired);
                out.push(lease);
            }
        }
        out
    }

    /// The live lease on `scope`, if any.
    pub fn holder_of(&self, scope: &Scope, now: Millis) -> Option<&Lease> {
        self.by_scope.get(scope).filter(|l| l.is_live(now))
    }

    /// The lease with this id, live or not, while it is the newest on its scope.
    pub fn get(&self, id: LeaseId) -> Option<&Lease> {
        self.by_id.get(&id).and_then(|s| self.by_scope.get(s))
    }

    /// All leases that are the newest on their scope (live or expired but not
    /// yet replaced): what the durable layer keeps on disk.
    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.by_scope.values()
    }

    fn live_mut(&mut self, id: LeaseId, now: Millis) -> Result<&mut Lease, LeaseError> {
        let Some(scope) = self.by_id.get(&id) else {
            return Err(match self.retired.get(&id) {
                Some(Retired::Expired) => LeaseError::Expired(id),
                Some(Retired::Superseded(by_token)) => LeaseError::Superseded {
                    lease_id: id,
                    by_token: *by_token,
                },
                Some(Retired::Released) => LeaseError::Released(id),
                None => LeaseError::Unknown(id),
            });
        };
        let lease = self
            .by_scope
            .get_mut(scope)
            .ok_or(LeaseError::Unknown(id))?;
        if !lease.is_live(now) {
            return Err(LeaseError::Expired(id));
        }
        Ok(lease)
    }

    fn retire(&mut self, id: LeaseId, why: Retired) {
        if self.retired.insert(id, why).is_none() {
            self.retired_order.push_back(id);
        }
        while self.retired_order.len() > RETIRED_MEMORY {
            if let Some(old) = self.retired_order.pop_front() {
                self.retired.remove(&old);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use palisade_core::TwinId;
    use proptest::prelude::*;

    fn req(scope: &str, holder: &str, ttl_ms: u64) -> AcquireRequest {
        AcquireRequest {
            scope: scope.parse().unwrap(),
            holder: holder.into(),
            ttl_ms,
            purpose: Default::default(),
        }
    }

    #[test]
    fn held_scope_is_refused_to_others_until_expiry() {
        let mut t = LeaseTable::default();
        let a = t
            .acquire(req("partition/1", "A", 1000), LeaseId(1), Millis(0))
            .unwrap();
        assert_eq!(a.lease.token, FencingToken(1));
        let err = t
            .acquire(req("partition/1", "B", 1000), LeaseId(2), Millis(999))
            .unwrap_err();
        assert!(
            matches!(
                err,
                LeaseError::Held {
                    expires_in_ms: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        // Another scope is independent but draws from the same counter.
        let c = t
            .acquire(req("twin/x", "B", 1000), LeaseId(3), Millis(10))
            .unwrap();
        assert_eq!(c.lease.token, FencingToken(2));
        let b = t
            .acquire(req("partition/1", "B", 1000), LeaseId(4), Millis(1000))
            .unwrap();
        assert_eq!(b.lease.token, FencingToken(3));
        assert_eq!(b.replaced, Some(LeaseId(1)));
    }

    #[test]
    fn scenario_6_late_renewal_after_regrant_fails() {
        let mut t = LeaseTable::default();
        t.acquire(req("twin/d", "A", 10_000), LeaseId(1), Millis(0))
            .unwrap();
        t.renew(LeaseId(1), Millis(9_000)).unwrap();
        // B is granted at 19.1 s, A's renewal arrives at 19.2 s.
        let b = t
            .acquire(req("twin/d", "B", 10_000), LeaseId(2), Millis(19_100))
            .unwrap();
        assert_eq!(
            t.renew(LeaseId(1), Millis(19_200)),
            Err(LeaseError::Superseded {
                lease_id: LeaseId(1),
                by_token: b.lease.token
            })
        );
        // And B's lease was not extended on A's behalf.
        assert_eq!(t.get(LeaseId(2)).unwrap().expires_at, 29_100);
    }

    #[test]
    fn renewal_after_expiry_fails_even_if_nobody_took_the_scope() {
        let mut t = LeaseTable::default();
        t.acquire(req("twin/d", "A", 1000), LeaseId(1), Millis(0))
            .unwrap();
        assert_eq!(
            t.renew(LeaseId(1), Millis(1000)),
            Err(LeaseError::Expired(LeaseId(1)))
        );
        assert_eq!(
            t.release(LeaseId(1), Millis(1000)),
            Err(LeaseError::Expired(LeaseId(1)))
        );
    }

    #[test]
    fn release_by_stale_id_frees_nothing() {
        let mut t = LeaseTable::default();
        t.acquire(req("twin/d", "A", 1000), LeaseId(1), Millis(0))
            .unwrap();
        t.acquire(req("twin/d", "B", 1000), LeaseId(2), Millis(2000))
            .unwrap();
        assert!(matches!(
            t.release(LeaseId(1), Millis(2001)),
            Err(LeaseError::Superseded { .. })
        ));
        assert_eq!(
            t.holder_of(&"twin/d".parse().unwrap(), Millis(2001))
                .unwrap()
                .holder,
            "B"
        );
        assert_eq!(
            t.release(LeaseId(9), Millis(2001)),
            Err(LeaseError::Unknown(LeaseId(9)))
        );
        t.release(LeaseId(2), Millis(2002)).unwrap();
        assert!(t
            .holder_of(&"twin/d".parse().unwrap(), Millis(2002))
            .is_none());
        assert_eq!(
            t.release(LeaseId(2), Millis(2003)),
            Err(LeaseError::Released(LeaseId(2)))
        );
    }

    #[test]
    fn same_holder_reacquire_supersedes_its_old_lease() {
        let mut t = LeaseTable::default();
        let a1 = t
            .acquire(req("twin/d", "A", 1000), LeaseId(1), Millis(0))
            .unwrap();
        let a2 = t
            .acquire(req("twin/d", "A", 1000), LeaseId(2), Millis(10))
            .unwrap();
        assert!(a2.lease.token > a1.lease.token);
        assert!(matches!(
            t.renew(LeaseId(1), Millis(11)),
            Err(LeaseError::Superseded { .. })
        ));
    }

    #[test]
    fn restore_gives_a_full_ttl_and_never_lowers_the_counter() {
        let mut t = LeaseTable::default();
        let a = t
            .acquire(req("twin/d", "A", 5000), LeaseId(1), Millis(0))
            .unwrap();
        let restored = LeaseTable::restore(FencingToken(0), [a.lease.clone()], Millis(0));
        assert_eq!(restored.last_token(), a.lease.token);
        let mut r = restored;
        assert!(matches!(
            r.acquire(req("twin/d", "B", 5000), LeaseId(2), Millis(4999)),
            Err(LeaseError::Held { .. })
        ));
        r.renew(LeaseId(1), Millis(4999)).unwrap();
        let b = r
            .acquire(req("twin/d", "B", 5000), LeaseId(2), Millis(9999))
            .unwrap();
        assert_eq!(b.lease.token, FencingToken(2));
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut t = LeaseTable::default();
        assert_eq!(
            t.acquire(req("twin/d", "A", 0), LeaseId(1), Millis(0)),
            Err(LeaseError::BadTtl(0))
        );
        assert_eq!(
            t.acquire(req("twin/d", "", 1000), LeaseId(1), Millis(0)),
            Err(LeaseError::BadHolder)
        );
        assert_eq!(
            t.acquire(req("twin/d", "a\nb", 1000), LeaseId(1), Millis(0)),
            Err(LeaseError::BadHolder)
        );
        assert_eq!(t.last_token(), FencingToken(0));
        t.acquire(req("twin/d", "A", 1000), LeaseId(1), Millis(0))
            .unwrap();
        assert_eq!(
            t.acquire(req("twin/e", "A", 1000), LeaseId(1), Millis(0)),
            Err(LeaseError::DuplicateId(LeaseId(1)))
        );
        assert_eq!(t.last_token(), FencingToken(1));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Acquire { scope: u8, holder: u8, ttl: u64 },
        Renew { lease: u8 },
        Release { lease: u8 },
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, 0u8..3, 100u64..2000).prop_map(|(scope, holder, ttl)| Op::Acquire {
                scope,
                holder,
                ttl
            }),
            (0u8..16).prop_map(|lease| Op::Renew { lease }),
            (0u8..16).prop_map(|lease| Op::Release { lease }),
            (0u64..3000).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// Against a model: tokens strictly increase; at any time at most one
        /// live lease per scope; a renewal or release succeeds only for the
        /// newest, live lease of its scope.
        #[test]
        fn table_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
            let scopes = [
                Scope::Partition(0.into()),
                Scope::Partition(1.into()),
                Scope::Twin(TwinId::new("t").unwrap()),
            ];
            let mut t = LeaseTable::default();
            let mut now = Millis(0);
            let mut ids: Vec<LeaseId> = Vec::new();
            // Model: scope index -> (lease id, holder, expires_at)
            let mut model: HashMap<u8, (LeaseId, u8, u64)> = HashMap::new();
            let mut last = 0u64;
            for op in ops {
                match op {
                    Op::Advance(ms) => now = now.plus(ms),
                    Op::Acquire { scope, holder, ttl } => {
                        let id = LeaseId(ids.len() as u128 + 1);
                        let r = t.acquire(AcquireRequest {
                            scope: scopes[scope as usize].clone(),
                            holder: format!("h{holder}"),
                            ttl_ms: ttl,
                            purpose: Default::default(),
                        }, id, now);
                        let blocked = model.get(&scope).is_some_and(|&(_, h, exp)| now.0 < exp && h != holder);
                        prop_assert_eq!(r.is_err(), blocked);
                        if let Ok(g) = r {
                            prop_assert!(g.lease.token.0 > last);
                            last = g.lease.token.0;
                            model.insert(scope, (id, holder, now.0 + ttl));
                            ids.push(id);
                        }
                    }
                    Op::Renew { lease } | Op::Release { lease } if ids.is_empty() => { let _ = lease; }
                    Op::Renew { lease } => {
                        let id = ids[lease as usize % ids.len()];
                        let entry = model.iter().find(|(_, v)| v.0 == id).map(|(k, v)| (*k, *v));
                        let ok = entry.is_some_and(|(_, (_, _, exp))| now.0 < exp);
                        prop_assert_eq!(t.renew(id, now).is_ok(), ok);
                        if ok {
                            let (s, (i, h, _)) = entry.unwrap();
                            let ttl = t.get(id).unwrap().ttl_ms;
                            model.insert(s, (i, h, now.0 + ttl));
                        }
                    }
                    Op::Release { lease } => {
                        let id = ids[lease as usize % ids.len()];
                        let entry = model.iter().find(|(_, v)| v.0 == id).map(|(k, v)| (*k, *v));
                        let ok = entry.is_some_and(|(_, (_, _, exp))| now.0 < exp);
                        prop_assert_eq!(t.release(id, now).is_ok(), ok);
                        if ok {
                            model.remove(&entry.unwrap().0);
                        }
                    }
                }
                for (i, s) in scopes.iter().enumerate() {
                    let live_model = model.get(&(i as u8)).filter(|v| now.0 < v.2).map(|v| v.0);
                    prop_assert_eq!(t.holder_of(s, now).map(|l| l.id), live_model);
                }
            }
        }
    }
}
