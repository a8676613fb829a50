use std::sync::Arc;
use std::time::Duration;

use bincode::{Decode, Encode};
use palisade_core::codec::{self, CodecError};
use palisade_core::{FencingToken, LeaseId, Purpose, Scope};

use crate::clock::Clock;
use crate::table::{AcquireRequest, Grant, Lease, LeaseError, LeaseTable, Millis};

/// Key of the token counter: the last token handed out, u64 big-endian.
const COUNTER_KEY: &[u8] = &[0x00];
/// Prefix of lease records: `0x01 ++ lease_id (u128 big-endian)`.
const LEASE_PREFIX: u8 = 0x01;
/// Prefix of the token index: `0x02 ++ token (u64 big-endian)` -> scope.
/// Kept forever (one small record per grant) so that a refused write can be
/// told which scope its token was granted on.
const TOKEN_PREFIX: u8 = 0x02;
/// Prefix of lease deadlines: `0x03 ++ lease_id` -> wall-clock ms (u64 BE)
/// at which the lease expires, rewritten by every renewal. Read only on
/// open, so that a lease that had expired before a restart stays expired
/// after it; while running, expiry is monotonic (`Instant`).
const DEADLINE_PREFIX: u8 = 0x03;
/// `0x04 ++ lease_id` -> one byte, `0x01`: the lease is for efficiency
/// (decision 0028). Written only for such leases (absent = correctness),
/// so a store written before purposes existed reads unchanged.
const PURPOSE_PREFIX: u8 = 0x04;
/// The value of a purpose key.
const EFFICIENCY: u8 = 0x01;

/// What is persisted of a lease: everything but its monotonic expiry.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
struct LeaseRecord {
    id: LeaseId,
    scope: Scope,
    holder: String,
    token: FencingToken,
    ttl_ms: u64,
}

/// Changes to make durable in the leases tree, in order: `(key, Some(value))`
/// puts, `(key, None)` removes. The authority decides; the store writes them
/// in the same commit round as what depends on them, and answers only once
/// they are synced.
pub type LeaseWrites = Vec<(Vec<u8>, Option<Vec<u8>>)>;

#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("lease storage failed: {0}")]
    Storage(#[from] sled::Error),
    #[error("lease storage holds a damaged record under key {key:02x?}: {source}")]
    Damaged { key: Vec<u8>, source: CodecError },
}

/// The durable lease authority: a [`LeaseTable`] whose every decision comes
/// with the writes that make it durable ([`LeaseWrites`]: token counter,
/// lease record, token index, deadline). Not thread-safe by itself: callers
/// serialize access (the log's store decides leases on its one sequencer
/// thread, which orders the counter's writes as it orders the grants).
///
/// Time comes from its [`Clock`]: expiry is decided on the monotonic reading
/// (as [`Millis`] from the authority's start). The wall-clock reading is
/// only *stored*, as each lease's deadline, and only read back on open
/// (a restart loses every `Instant`): a lease past its deadline then stays
/// expired, any other one gets what was left of its TTL (never more than
/// the TTL, whatever the wall clock did).
#[derive(Debug)]
pub struct LeaseAuthority {
    tree: sled::Tree,
    table: LeaseTable,
    clock: Arc<dyn Clock>,
    /// The clock's monotonic reading at open: the origin of the [`Millis`]
    /// this authority passes to the table.
    origin: Duration,
}

impl LeaseAuthority {
    /// Open the authority stored in `tree`, running on `clock`. Each persisted lease is restored with the rest of its TTL as of
    /// its stored deadline: none if that passed (it stays expired until it is
    /// swept or its scope granted again), at most its full TTL. A lease
    /// without a deadline (written by an older version) gets its full TTL.
    pub fn open(tree: sled::Tree, clock: Arc<dyn Clock>) -> Result<Self, AuthorityError> {
        let origin = clock.elapsed();
        let wall_ms = clock.wall_ms();
        let damaged = |key: &[u8]| AuthorityError::Damaged {
            key: key.to_vec(),
            source: CodecError::Empty,
        };
        let last = match tree.get(COUNTER_KEY)? {
            Some(v) => FencingToken(decode_u64(&v).ok_or_else(|| damaged(COUNTER_KEY))?),
            None => FencingToken(0),
        };
        let mut leases = Vec::new();
        for kv in tree.scan_prefix([LEASE_PREFIX]) {
            let (k, v) = kv?;
            let rec: LeaseRecord = codec::decode(&v).map_err(|source| AuthorityError::Damaged {
                key: k.to_vec(),
                source,
            })?;
            let dkey = deadline_key(rec.id);
            let left_ms = match tree.get(dkey)? {
                Some(d) => decode_u64(&d)
                    .ok_or_else(|| damaged(&dkey))?
                    .saturating_sub(wall_ms)
                    .min(rec.ttl_ms),
                None => rec.ttl_ms,
            };
            let pkey = purpose_key(rec.id);
            let purpose = match tree.get(pkey)?.as_deref() {
                None => Purpose::Correctness,
                Some([EFFICIENCY]) => Purpose::Efficiency,
                Some(_) => return Err(damaged(&pkey)),
            };
            leases.push((
                Lease {
                    id: rec.id,
                    scope: rec.scope,
                    holder: rec.holder,
                    token: rec.token,
                    ttl_ms: rec.ttl_ms,
                    purpose,
                    expires_at: 0,
                },
                left_ms,
            ));
        }
        let table = LeaseTable::restore_with_remaining(last, leases, Millis(0));
        Ok(Self {
            tree,
            table,
            clock,
            origin,
        })
    }

    /// Monotonic now, in the table's time base.
    pub fn now(&self) -> Millis {
        Millis(
            self.clock
                .elapsed()
                .saturating_sub(self.origin)
                .as_millis()
                .try_into()
                .unwrap_or(u64::MAX),
        )
    }

    pub fn table(&self) -> &LeaseTable {
        &self.table
    }

    pub fn last_token(&self) -> FencingToken {
        self.table.last_token()
    }

    /// Grant a lease; the writes make it durable (counter, record, token
    /// index, deadline, and the removal of a lease it superseded).
    pub fn acquire(
        &mut self,
        req: AcquireRequest,
        id: LeaseId,
    ) -> Result<(Grant, LeaseWrites), AuthorityError> {
        let (now, wall_ms) = (self.now(), self.clock.wall_ms());
        let grant = self.table.acquire(req, id, now)?;
        let l = &grant.lease;
        let mut w: LeaseWrites = vec![
            (COUNTER_KEY.to_vec(), Some(l.token.0.to_be_bytes().to_vec())),
            (lease_key(l.id).to_vec(), Some(codec::encode(&record(l)))),
            (token_key(l.token).to_vec(), Some(codec::encode(&l.scope))),
            deadline_write(l, wall_ms),
        ];
        if let Some(old) = grant.replaced {
            w.extend(removal(old));
        }
        if l.purpose == Purpose::Efficiency {
            w.push((purpose_key(l.id).to_vec(), Some(vec![EFFICIENCY])));
        }
        Ok((grant, w))
    }

    /// Extend a live lease; the write moves its stored deadline.
    pub fn renew(&mut self, id: LeaseId) -> Result<(Lease, LeaseWrites), AuthorityError> {
        let (now, wall_ms) = (self.now(), self.clock.wall_ms());
        let lease = self.table.renew(id, now)?;
        let w = vec![deadline_write(&lease, wall_ms)];
        Ok((lease, w))
    }

    /// Release a live lease; the writes delete its record.
    pub fn release(&mut self, id: LeaseId) -> Result<(Lease, LeaseWrites), AuthorityError> {
        let now = self.now();
        let lease = self.table.release(id, now)?;
        // Until these are durable a restart restores the lease for what was
        // left of its TTL: conservative, never unsafe.
        Ok((lease, removal(id)))
    }

    /// Retire expired leases; the writes delete their records.
    pub fn sweep(&mut self) -> (Vec<Lease>, LeaseWrites) {
        let now = self.now();
        let gone = self.table.expire(now);
        let w = gone.iter().flat_map(|l| removal(l.id)).collect();
        (gone, w)
    }

    /// The scope a token was granted on, if this authority issued it (and
    /// its grant is durable).
    pub fn scope_of_token(&self, token: FencingToken) -> Option<Scope> {
        let v = self.tree.get(token_key(token)).ok()??;
        codec::decode(&v).ok()
    }

    pub fn get(&self, id: LeaseId) -> Option<&Lease> {
        self.table.get(id)
    }

    pub fn holder_of(&self, scope: &Scope) -> Option<&Lease> {
        self.table.holder_of(scope, self.now())
    }
}

fn lease_key(id: LeaseId) -> [u8; 17] {
    prefixed_id(LEASE_PREFIX, id)
}

fn deadline_key(id: LeaseId) -> [u8; 17] {
    prefixed_id(DEADLINE_PREFIX, id)
}

fn purpose_key(id: LeaseId) -> [u8; 17] {
    prefixed_id(PURPOSE_PREFIX, id)
}

fn prefixed_id(prefix: u8, id: LeaseId) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = prefix;
    k[1..].copy_from_slice(&id.0.to_be_bytes());
    k
}

/// The stored deadline of `lease`, renewed or granted at `wall_ms`.
fn deadline_write(lease: &Lease, wall_ms: u64) -> (Vec<u8>, Option<Vec<u8>>) {
    (
        deadline_key(lease.id).to_vec(),
        Some(wall_ms.saturating_add(lease.ttl_ms).to_be_bytes().to_vec()),
    )
}

fn removal(id: LeaseId) -> LeaseWrites {
    vec![
        (lease_key(id).to_vec(), None),
        (deadline_key(id).to_vec(), None),
        (purpose_key(id).to_vec(), None),
    ]
}

fn token_key(token: FencingToken) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = TOKEN_PREFIX;
    k[1..].copy_from_slice(&token.0.to_be_bytes());
    k
}

fn record(l: &Lease) -> LeaseRecord {
    LeaseRecord {
        id: l.id,
        scope: l.scope.clone(),
        holder: l.holder.clone(),
        token: l.token,
        ttl_ms: l.ttl_ms,
    }
}

fn decode_u64(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn req(scope: &str, holder: &str, ttl_ms: u64) -> AcquireRequest {
        AcquireRequest {
            scope: scope.parse().unwrap(),
            holder: holder.into(),
            ttl_ms,
            purpose: Default::default(),
        }
    }

    /// What the store does with the writes: apply them (it syncs them first).
    fn apply(tree: &sled::Tree, w: LeaseWrites) {
        for (k, v) in w {
            match v {
                Some(v) => tree.insert(k, v).unwrap(),
                None => tree.remove(k).unwrap(),
            };
        }
    }

    const T0: u64 = 1_700_000_000_000;

    /// A clock whose wall reading starts at `wall_ms`.
    fn at(wall_ms: u64) -> Arc<crate::ManualClock> {
        Arc::new(crate::ManualClock::at(wall_ms))
    }

    /// Decision 0028: an efficiency lease keeps its purpose across a
    /// restart through its own key; a correctness lease writes none (so a
    /// store from before purposes reads unchanged), and removing a lease
    /// removes its purpose.
    #[test]
    fn purpose_survives_reopen_and_goes_with_the_lease() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree("leases").unwrap();
        let (eff, cor);
        {
            let mut auth = LeaseAuthority::open(tree.clone(), at(T0)).unwrap();
            let (g, w) = auth
                .acquire(
                    AcquireRequest {
                        purpose: Purpose::Efficiency,
                        ..req("twin/a", "A", 60_000)
                    },
                    LeaseId(1),
                )
                .unwrap();
            assert_eq!(g.lease.purpose, Purpose::Efficiency);
            apply(&tree, w);
            eff = g.lease.id;
            let (g, w) = auth
                .acquire(req("twin/b", "B", 60_000), LeaseId(2))
                .unwrap();
            assert_eq!(g.lease.purpose, Purpose::Correctness);
            apply(&tree, w);
            cor = g.lease.id;
        }
        assert_eq!(tree.scan_prefix([PURPOSE_PREFIX]).count(), 1);
        let mut auth = LeaseAuthority::open(tree.clone(), at(T0 + 1_000)).unwrap();
        assert_eq!(auth.get(eff).unwrap().purpose, Purpose::Efficiency);
        assert_eq!(auth.get(cor).unwrap().purpose, Purpose::Correctness);
        let (_, w) = auth.release(eff).unwrap();
        apply(&tree, w);
        assert_eq!(tree.scan_prefix([PURPOSE_PREFIX]).count(), 0);
        // A damaged purpose byte is refused, not read as either purpose.
        tree.insert(purpose_key(cor), &[7u8][..]).unwrap();
        assert!(matches!(
            LeaseAuthority::open(tree, at(T0)),
            Err(AuthorityError::Damaged { .. })
        ));
    }

    #[test]
    fn counter_and_leases_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree("leases").unwrap();
        let (t1, t2);
        {
            let mut auth = LeaseAuthority::open(tree.clone(), at(T0)).unwrap();
            let (g, w) = auth
                .acquire(req("twin/a", "A", 60_000), LeaseId(1))
                .unwrap();
            apply(&tree, w);
            t1 = g.lease.token;
            let (g, w) = auth
                .acquire(req("twin/b", "B", 60_000), LeaseId(2))
                .unwrap();
            apply(&tree, w);
            t2 = g.lease.token;
            let (_, w) = auth.release(LeaseId(2)).unwrap();
            apply(&tree, w);
        }
        let mut auth = LeaseAuthority::open(tree.clone(), at(T0 + 1_000)).unwrap();
        assert_eq!(auth.last_token(), t2);
        // A's lease was live: the scope is not granted to someone else...
        assert!(matches!(
            auth.acquire(req("twin/a", "C", 1000), LeaseId(3)),
            Err(AuthorityError::Lease(LeaseError::Held { .. }))
        ));
        // ...for what was left of its TTL, not a fresh one...
        let left = auth.get(LeaseId(1)).unwrap().expires_in_ms(auth.now());
        assert_eq!(left, 59_000);
        // ...A can renew it by id, and B's released scope is free.
        assert_eq!(auth.renew(LeaseId(1)).unwrap().0.token, t1);
        let (g, _) = auth.acquire(req("twin/b", "C", 1000), LeaseId(4)).unwrap();
        assert!(g.lease.token > t2);
    }

    /// Issue 18: a lease that expired before a restart must not come back
    /// after it (renew refused, scope free for another holder).
    #[test]
    fn a_lease_expired_before_a_restart_stays_expired() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree("leases").unwrap();
        let clock = at(T0);
        let mut auth = LeaseAuthority::open(tree.clone(), clock.clone()).unwrap();
        let (_, w) = auth.acquire(req("twin/a", "A", 200), LeaseId(1)).unwrap();
        apply(&tree, w);
        let (_, w) = auth
            .acquire(req("twin/k", "K", 10_000), LeaseId(2))
            .unwrap();
        apply(&tree, w);
        // K renews at T0 + 5 s: its deadline moves to T0 + 15 s.
        clock.advance(Duration::from_secs(5));
        let (_, w) = auth.renew(LeaseId(2)).unwrap();
        apply(&tree, w);
        drop(auth);
        // Restart at T0 + 5.5 s: A's 200 ms were long over.
        let mut auth = LeaseAuthority::open(tree.clone(), at(T0 + 5_500)).unwrap();
        assert!(matches!(
            auth.renew(LeaseId(1)),
            Err(AuthorityError::Lease(LeaseError::Expired(_)))
        ));
        assert!(auth.acquire(req("twin/a", "B", 1000), LeaseId(3)).is_ok());
        // K is live, with what was left of its deadline.
        let k = auth.get(LeaseId(2)).unwrap();
        assert_eq!(k.expires_in_ms(auth.now()), 9_500);
        // A wall clock far behind the deadlines never grants more than the TTL.
        drop(auth);
        let auth = LeaseAuthority::open(tree, at(T0 - 3_600_000)).unwrap();
        assert_eq!(
            auth.get(LeaseId(2)).unwrap().expires_in_ms(auth.now()),
            10_000
        );
    }

    /// Expiry follows the injected clock: no sleeping past a TTL.
    #[test]
    fn a_lease_expires_when_its_clock_passes_the_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree("leases").unwrap();
        let clock = at(T0);
        let mut auth = LeaseAuthority::open(tree, clock.clone()).unwrap();
        let (a, _) = auth.acquire(req("twin/x", "A", 200), LeaseId(1)).unwrap();
        clock.advance(Duration::from_millis(199));
        assert!(auth.acquire(req("twin/x", "B", 200), LeaseId(2)).is_err());
        clock.advance(Duration::from_millis(1));
        let (b, _) = auth.acquire(req("twin/x", "B", 200), LeaseId(2)).unwrap();
        assert!(b.lease.token > a.lease.token);
    }
}
