use std::time::Instant;

use bincode::{Decode, Encode};
use palisade_core::codec::{self, CodecError};
use palisade_core::{FencingToken, LeaseId, Scope};

use crate::table::{AcquireRequest, Grant, Lease, LeaseError, LeaseTable, Millis};

/// Key of the token counter: the last token handed out, u64 big-endian.
const COUNTER_KEY: &[u8] = &[0x00];
/// Prefix of lease records: `0x01 ++ lease_id (u128 big-endian)`.
const LEASE_PREFIX: u8 = 0x01;
/// Prefix of the token index: `0x02 ++ token (u64 big-endian)` -> scope.
/// Kept forever (one small record per grant) so that a refused write can be
/// told which scope its token was granted on.
const TOKEN_PREFIX: u8 = 0x02;

/// What is persisted of a lease: everything but its monotonic expiry.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
struct LeaseRecord {
    id: LeaseId,
    scope: Scope,
    holder: String,
    token: FencingToken,
    ttl_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("lease storage failed: {0}")]
    Storage(#[from] sled::Error),
    #[error("lease storage holds a damaged record under key {key:02x?}: {source}")]
    Damaged { key: Vec<u8>, source: CodecError },
}

/// The durable lease authority: a [`LeaseTable`] whose every grant is on disk
/// (token counter and lease record in one atomic, flushed batch) before it is
/// returned. Not thread-safe by itself: callers serialize access (the log's
/// store keeps it behind a mutex; leases are rare next to appends).
#[derive(Debug)]
pub struct LeaseAuthority {
    tree: sled::Tree,
    table: LeaseTable,
    /// Origin of the monotonic [`Millis`] this authority passes to the table.
    origin: Instant,
}

impl LeaseAuthority {
    /// Open the authority stored in `tree`, restoring every persisted lease
    /// with a full TTL from now.
    pub fn open(tree: sled::Tree) -> Result<Self, AuthorityError> {
        let origin = Instant::now();
        let last = match tree.get(COUNTER_KEY)? {
            Some(v) => FencingToken(decode_u64(&v).ok_or_else(|| AuthorityError::Damaged {
                key: COUNTER_KEY.to_vec(),
                source: CodecError::Empty,
            })?),
            None => FencingToken(0),
        };
        let mut leases = Vec::new();
        for kv in tree.scan_prefix([LEASE_PREFIX]) {
            let (k, v) = kv?;
            let rec: LeaseRecord = codec::decode(&v).map_err(|source| AuthorityError::Damaged {
                key: k.to_vec(),
                source,
            })?;
            leases.push(Lease {
                id: rec.id,
                scope: rec.scope,
                holder: rec.holder,
                token: rec.token,
                ttl_ms: rec.ttl_ms,
                expires_at: 0,
            });
        }
        let table = LeaseTable::restore(last, leases, Millis(0));
        Ok(Self {
            tree,
            table,
            origin,
        })
    }

    /// Monotonic now, in the table's time base.
    pub fn now(&self) -> Millis {
        Millis(
            self.origin
                .elapsed()
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

    /// Grant a lease and make it durable before returning it.
    pub fn acquire(&mut self, req: AcquireRequest, id: LeaseId) -> Result<Grant, AuthorityError> {
        let now = self.now();
        let before = self.table.clone();
        let grant = self.table.acquire(req, id, now)?;
        let mut batch = sled::Batch::default();
        batch.insert(COUNTER_KEY, &grant.lease.token.0.to_be_bytes());
        batch.insert(
            lease_key(grant.lease.id).to_vec(),
            codec::encode(&record(&grant.lease)),
        );
        if let Some(old) = grant.replaced {
            batch.remove(lease_key(old).to_vec());
        }
        batch.insert(
            token_key(grant.lease.token).to_vec(),
            codec::encode(&grant.lease.scope),
        );
        if let Err(e) = self.persist(batch) {
            // Undo the grant but keep the counter where it went: the batch
            // may have reached the disk, and a token must never be reused.
            let token = grant.lease.token;
            self.table = before;
            self.table =
                LeaseTable::restore(token, self.table.leases().cloned().collect::<Vec<_>>(), now);
            return Err(e);
        }
        Ok(grant)
    }

    /// Extend a live lease. Nothing to persist: expiry is not stored.
    pub fn renew(&mut self, id: LeaseId) -> Result<Lease, AuthorityError> {
        let now = self.now();
        Ok(self.table.renew(id, now)?)
    }

    /// Release a live lease and delete its record.
    pub fn release(&mut self, id: LeaseId) -> Result<Lease, AuthorityError> {
        let now = self.now();
        let lease = self.table.release(id, now)?;
        let mut batch = sled::Batch::default();
        batch.remove(lease_key(id).to_vec());
        // If this fails the record stays and a restart restores the lease
        // for one TTL: conservative, never unsafe.
        self.persist(batch)?;
        Ok(lease)
    }

    /// Retire expired leases and delete their records.
    pub fn sweep(&mut self) -> Result<Vec<Lease>, AuthorityError> {
        let now = self.now();
        let gone = self.table.expire(now);
        if !gone.is_empty() {
            let mut batch = sled::Batch::default();
            for l in &gone {
                batch.remove(lease_key(l.id).to_vec());
            }
            self.persist(batch)?;
        }
        Ok(gone)
    }

    /// The scope a token was granted on, if this authority issued it.
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

    fn persist(&self, batch: sled::Batch) -> Result<(), AuthorityError> {
        self.tree.apply_batch(batch)?;
        self.tree.flush()?;
        Ok(())
    }
}

fn lease_key(id: LeaseId) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = LEASE_PREFIX;
    k[1..].copy_from_slice(&id.0.to_be_bytes());
    k
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
        }
    }

    #[test]
    fn counter_and_leases_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (t1, t2);
        {
            let db = sled::open(dir.path()).unwrap();
            let mut auth = LeaseAuthority::open(db.open_tree("leases").unwrap()).unwrap();
            t1 = auth
                .acquire(req("twin/a", "A", 60_000), LeaseId(1))
                .unwrap()
                .lease
                .token;
            t2 = auth
                .acquire(req("twin/b", "B", 60_000), LeaseId(2))
                .unwrap()
                .lease
                .token;
            auth.release(LeaseId(2)).unwrap();
        }
        let db = sled::open(dir.path()).unwrap();
        let mut auth = LeaseAuthority::open(db.open_tree("leases").unwrap()).unwrap();
        assert_eq!(auth.last_token(), t2);
        // A's lease was live: the scope is not granted to someone else...
        assert!(matches!(
            auth.acquire(req("twin/a", "C", 1000), LeaseId(3)),
            Err(AuthorityError::Lease(LeaseError::Held { .. }))
        ));
        // ...but A can renew it by id, and B's released scope is free.
        assert_eq!(auth.renew(LeaseId(1)).unwrap().token, t1);
        let t3 = auth
            .acquire(req("twin/b", "C", 1000), LeaseId(4))
            .unwrap()
            .lease
            .token;
        assert!(t3 > t2);
    }
}
