//! The audit log: an append-only record of lease grants, renewals and
//! releases and of refused requests (stale, forbidden, limited), with the
//! principal, scope, token and time of each; and the owner of every token
//! granted while authentication is on.
//!
//! Both live in their own sled trees (`audit`, `token_owners`), never in a
//! partition tree. Their writes go through the store's commit path like
//! every other write (the write-ahead log, then sled), so a record is
//! durable once a round carrying it is synced: [`AuditLog::flush`] waits for
//! that, [`AuditLog::bind_token`] and [`AuditLog::bind_lease`] too. The record layout
//! is documented byte by byte in `docs/on-disk-format.md` ("Audit log").
//!
//! Records are numbered by a counter that only grows; the oldest are pruned
//! past a configured cap (default [`DEFAULT_AUDIT_MAX_RECORDS`]), so a flood of
//! refused requests cannot fill the disk. Nothing else ever changes or
//! removes a record.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use palisade_core::FencingToken;
use tracing::warn;

use crate::commit::{StorageFailure, Trees};
use crate::ingest::now_ms;
use crate::wal::TreeId;
use crate::writer::{Command, RawWrite};

/// Records kept by default; the oldest are pruned past this.
pub const DEFAULT_AUDIT_MAX_RECORDS: u64 = 1_000_000;
/// Version byte of the record layout.
const RECORD_VERSION: u8 = 1;
/// Longest string field kept (principal, scope, detail), in bytes.
const MAX_FIELD: usize = 1024;

/// What was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AuditAction {
    /// Acquire a lease.
    Grant = 1,
    Renew = 2,
    Release = 3,
    /// Append events (audited when refused only).
    Write = 4,
    /// Read twins or partitions (audited when refused only).
    Read = 5,
    /// Admin endpoints (audited when refused only).
    Admin = 6,
}

/// How it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AuditOutcome {
    /// Done.
    Ok = 0,
    /// Refused: the token is below the fence (a stale writer).
    Stale = 1,
    /// Refused: the principal may not do this (no grant, another
    /// principal's lease or token).
    Forbidden = 2,
    /// Refused by a limit (rate, live leases, sizes).
    Limited = 3,
    /// Refused: no or an unknown bearer token.
    Unauthenticated = 4,
    /// Refused for another reason (lease held, expired, unknown ...).
    Refused = 5,
}

impl AuditAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::Grant => "grant",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Write => "write",
            Self::Read => "read",
            Self::Admin => "admin",
        }
    }

    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Grant,
            2 => Self::Renew,
            3 => Self::Release,
            4 => Self::Write,
            5 => Self::Read,
            6 => Self::Admin,
            _ => return None,
        })
    }
}

impl AuditOutcome {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Stale => "stale",
            Self::Forbidden => "forbidden",
            Self::Limited => "limited",
            Self::Unauthenticated => "unauthenticated",
            Self::Refused => "refused",
        }
    }

    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Ok,
            1 => Self::Stale,
            2 => Self::Forbidden,
            3 => Self::Limited,
            4 => Self::Unauthenticated,
            5 => Self::Refused,
            _ => return None,
        })
    }
}

/// One audit record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// Position in the log (assigned on append; increasing, never reused).
    pub seq: u64,
    /// Wall-clock milliseconds since 1970 when it was recorded.
    pub at_ms: u64,
    pub action: AuditAction,
    pub outcome: AuditOutcome,
    /// The authenticated principal (`anonymous` with authentication off,
    /// empty if the request carried no valid key).
    pub principal: String,
    /// The lease scope or resource (`twin/pump-7`, `partition/3`,
    /// `admin/audit`), empty if unknown.
    pub scope: String,
    /// The fencing token involved (0: none).
    pub token: u64,
    /// The lease involved (0: none).
    pub lease_id: u128,
    /// Stable error name or short note (`stale_token`, `rate_limited`, ...).
    pub detail: String,
}

/// Errors of the audit trees.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log storage: {0}")]
    Storage(#[from] sled::Error),
    #[error(transparent)]
    Failed(#[from] crate::StorageFailure),
    #[error("audit record {seq} is damaged")]
    Damaged { seq: u64 },
    /// The lease authority shared by the nodes could not say who owns a
    /// token or lease.
    #[error("owners from the lease authority: {0}")]
    Authority(#[from] palisade_lease::RemoteError),
}

/// The audit log and the token-owner table.
#[derive(Debug)]
pub struct AuditLog {
    records: sled::Tree,
    owners: sled::Tree,
    /// The store's sequencer, which stages every write into a commit round.
    tx: mpsc::Sender<Command>,
    next: AtomicU64,
    /// The oldest seq kept (records below it were pruned): with `next`, the
    /// record count without scanning the tree (`Tree::len` is a full scan).
    first: AtomicU64,
    max_records: AtomicU64,
    /// Serialises pruning; appends do not wait for it.
    prune: Mutex<()>,
    /// Counters by (action, outcome) for `/metrics`, since start.
    counts: Mutex<BTreeMap<(AuditAction, AuditOutcome), u64>>,
}

fn truncated(s: &str) -> &str {
    if s.len() <= MAX_FIELD {
        return s;
    }
    let mut end = MAX_FIELD;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl AuditRecord {
    /// The value bytes (see `docs/on-disk-format.md`).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(40 + self.principal.len() + self.scope.len());
        v.push(RECORD_VERSION);
        v.extend_from_slice(&self.at_ms.to_be_bytes());
        v.push(self.action as u8);
        v.push(self.outcome as u8);
        v.extend_from_slice(&self.token.to_be_bytes());
        v.extend_from_slice(&self.lease_id.to_be_bytes());
        for s in [&self.principal, &self.scope, &self.detail] {
            let s = truncated(s);
            // At most MAX_FIELD (1024) bytes: fits in a u16.
            v.extend_from_slice(&(s.len() as u16).to_be_bytes());
            v.extend_from_slice(s.as_bytes());
        }
        v
    }

    /// Decode the value stored under `seq`.
    pub fn decode(seq: u64, v: &[u8]) -> Option<Self> {
        let take = |at: usize, n: usize| v.get(at..at.checked_add(n)?);
        if *v.first()? != RECORD_VERSION {
            return None;
        }
        let at_ms = u64::from_be_bytes(take(1, 8)?.try_into().ok()?);
        let action = AuditAction::from_byte(*v.get(9)?)?;
        let outcome = AuditOutcome::from_byte(*v.get(10)?)?;
        let token = u64::from_be_bytes(take(11, 8)?.try_into().ok()?);
        let lease_id = u128::from_be_bytes(take(19, 16)?.try_into().ok()?);
        let mut at = 35;
        let mut strings = Vec::with_capacity(3);
        for _ in 0..3 {
            let len = u16::from_be_bytes(take(at, 2)?.try_into().ok()?) as usize;
            let s = std::str::from_utf8(take(at + 2, len)?).ok()?;
            strings.push(s.to_owned());
            at += 2 + len;
        }
        if at != v.len() {
            return None;
        }
        let detail = strings.pop()?;
        let scope = strings.pop()?;
        let principal = strings.pop()?;
        Some(Self {
            seq,
            at_ms,
            action,
            outcome,
            principal,
            scope,
            token,
            lease_id,
            detail,
        })
    }
}

impl AuditLog {
    /// Open the `audit` and `token_owners` trees; writes go to `tx`.
    pub(crate) fn open(trees: &Trees, tx: mpsc::Sender<Command>) -> Result<Self, sled::Error> {
        let records = trees.audit.clone();
        let owners = trees.token_owners.clone();
        let next = match records.last()? {
            Some((k, _)) => <[u8; 8]>::try_from(k.as_ref())
                .map(u64::from_be_bytes)
                .unwrap_or(0)
                .saturating_add(1),
            None => 1,
        };
        let first = match records.first()? {
            Some((k, _)) => <[u8; 8]>::try_from(k.as_ref())
                .map(u64::from_be_bytes)
                .unwrap_or(next),
            None => next,
        };
        Ok(Self {
            records,
            owners,
            tx,
            next: AtomicU64::new(next),
            first: AtomicU64::new(first),
            max_records: AtomicU64::new(DEFAULT_AUDIT_MAX_RECORDS),
            prune: Mutex::new(()),
            counts: Mutex::new(BTreeMap::new()),
        })
    }

    /// Keep at most `n` records (at least 1); the oldest are pruned past it.
    pub fn set_max_records(&self, n: u64) {
        self.max_records.store(n.max(1), Ordering::Relaxed);
    }

    /// Append a record (its `seq` and, if 0, `at_ms` are filled in) and
    /// return its seq. Not flushed: see [`AuditLog::flush`]. A storage
    /// failure is logged, not returned: a refusal must not turn into a
    /// success because its audit record could not be written, and a grant
    /// that is already on disk is not undone by it either.
    pub fn record(&self, mut r: AuditRecord) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::SeqCst);
        r.seq = seq;
        if r.at_ms == 0 {
            r.at_ms = now_ms();
        }
        self.write(
            vec![RawWrite {
                tree: TreeId::AUDIT,
                key: seq.to_be_bytes().to_vec(),
                value: Some(r.encode()),
            }],
            None,
        );
        *self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((r.action, r.outcome))
            .or_insert(0) += 1;
        self.prune_past_cap(seq);
        seq
    }

    fn prune_past_cap(&self, last: u64) {
        let cap = self.max_records.load(Ordering::Relaxed);
        let first = self.first.load(Ordering::SeqCst);
        if last.saturating_sub(first) < cap {
            return;
        }
        let Ok(_g) = self.prune.try_lock() else {
            return;
        };
        let keep_from = last.saturating_sub(cap - 1);
        // By key range, not by what sled holds yet: records of rounds still
        // being synced are pruned too.
        let removes = (first..keep_from)
            .map(|seq| RawWrite {
                tree: TreeId::AUDIT,
                key: seq.to_be_bytes().to_vec(),
                value: None,
            })
            .collect();
        self.write(removes, None);
        self.first.fetch_max(keep_from, Ordering::SeqCst);
    }

    /// Stage writes in the next commit round; `reply` answers once durable.
    fn write(
        &self,
        writes: Vec<RawWrite>,
        reply: Option<tokio::sync::oneshot::Sender<Result<(), StorageFailure>>>,
    ) {
        if self.tx.send(Command::Write { writes, reply }).is_err() {
            warn!("audit record lost: the store is shutting down");
        }
    }

    /// Stage writes and wait until they are durable.
    async fn write_durably(&self, writes: Vec<RawWrite>) -> Result<(), AuditError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.write(writes, Some(reply));
        match rx.await {
            Ok(r) => Ok(r?),
            Err(_) => Err(AuditError::Failed(StorageFailure::new(
                "closed",
                std::io::ErrorKind::BrokenPipe,
                "the store is shutting down".into(),
            ))),
        }
    }

    /// Make every record so far durable.
    pub async fn flush(&self) -> Result<(), AuditError> {
        self.write_durably(Vec::new()).await
    }

    /// Records with a seq above `after`, oldest first: every record written
    /// before the call (they become readable once their round is durable,
    /// which this waits for).
    pub async fn list(&self, after: u64, limit: usize) -> Result<Vec<AuditRecord>, AuditError> {
        self.flush().await?;
        let mut out = Vec::new();
        for kv in self.records.range(after.saturating_add(1).to_be_bytes()..) {
            if out.len() >= limit {
                break;
            }
            let (k, v) = kv?;
            let seq = <[u8; 8]>::try_from(k.as_ref())
                .map(u64::from_be_bytes)
                .unwrap_or(0);
            out.push(AuditRecord::decode(seq, &v).ok_or(AuditError::Damaged { seq })?);
        }
        Ok(out)
    }

    /// Bind `token` to the principal that was granted it, durably (flushed
    /// before returning, so the token never reaches its holder unbound).
    pub async fn bind_token(&self, token: FencingToken, principal: &str) -> Result<(), AuditError> {
        self.write_durably(vec![token_owner_write(token, principal)])
            .await
    }

    /// Bind lease `id` to the principal that was granted it, durably, like
    /// [`AuditLog::bind_token`] (16-byte keys, beside the 8-byte token keys).
    /// Renewals and releases are checked against this, whichever lease
    /// backend holds the lease.
    pub async fn bind_lease(&self, id: u128, principal: &str) -> Result<(), AuditError> {
        self.write_durably(vec![lease_owner_write(id, principal)])
            .await
    }

    /// The principal lease `id` was granted to, if granted with
    /// authentication on.
    pub fn lease_owner(&self, id: u128) -> Result<Option<String>, AuditError> {
        Ok(self
            .owners
            .get(id.to_be_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// The principal `token` was granted to, if it was granted while
    /// authentication was on.
    pub fn token_owner(&self, token: FencingToken) -> Result<Option<String>, AuditError> {
        Ok(self
            .owners
            .get(token.0.to_be_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Prometheus text for the audit counters.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::from(
            "# HELP palisade_audit_records_total Audit records written since start, by action and outcome.\n\
             # TYPE palisade_audit_records_total counter\n",
        );
        let counts = self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for ((a, o), n) in counts.iter() {
            let _ = writeln!(
                out,
                "palisade_audit_records_total{{action=\"{}\",outcome=\"{}\"}} {n}",
                a.name(),
                o.name()
            );
        }
        out
    }
}

/// The `token_owners` entry binding `token` to `principal` (8-byte key).
pub(crate) fn token_owner_write(token: FencingToken, principal: &str) -> RawWrite {
    RawWrite {
        tree: TreeId::TOKEN_OWNERS,
        key: token.0.to_be_bytes().to_vec(),
        value: Some(principal.as_bytes().to_vec()),
    }
}

/// The `token_owners` entry binding lease `id` to `principal` (16-byte key).
pub(crate) fn lease_owner_write(id: u128, principal: &str) -> RawWrite {
    RawWrite {
        tree: TreeId::TOKEN_OWNERS,
        key: id.to_be_bytes().to_vec(),
        value: Some(principal.as_bytes().to_vec()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Issue 13: ownership is bound inside the store's grant, in the round
    /// that writes the lease and raises the fence, so no lease or token of
    /// an owned grant is ever seen unbound; a grant without an owner
    /// (authentication off) binds nothing.
    #[tokio::test]
    async fn an_owned_grant_binds_its_token_and_lease_to_the_owner() {
        let dir = tempfile::tempdir().unwrap();
        let owned = {
            let store = crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap();
            let req = |twin: &str| palisade_lease::AcquireRequest {
                scope: palisade_core::Scope::Twin(palisade_core::TwinId::new(twin).unwrap()),
                holder: "worker-a".into(),
                ttl_ms: 10_000,
                purpose: Default::default(),
            };
            let owned = store
                .acquire_for(req("pump-1"), Some("worker-a"))
                .await
                .unwrap();
            let log = store.audit();
            assert_eq!(
                log.token_owner(owned.token).unwrap().as_deref(),
                Some("worker-a")
            );
            assert_eq!(
                log.lease_owner(owned.id.0).unwrap().as_deref(),
                Some("worker-a")
            );
            let anonymous = store.acquire(req("pump-2")).await.unwrap();
            assert_eq!(log.token_owner(anonymous.token).unwrap(), None);
            assert_eq!(log.lease_owner(anonymous.id.0).unwrap(), None);
            store.close().await;
            owned
        };
        // Durable with the grant: still bound after a reopen.
        let store = crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap();
        let log = store.audit();
        assert_eq!(
            log.token_owner(owned.token).unwrap().as_deref(),
            Some("worker-a")
        );
        assert_eq!(
            log.lease_owner(owned.id.0).unwrap().as_deref(),
            Some("worker-a")
        );
        store.close().await;
    }

    fn rec(principal: &str) -> AuditRecord {
        AuditRecord {
            seq: 0,
            at_ms: 1_700_000_000_000,
            action: AuditAction::Grant,
            outcome: AuditOutcome::Ok,
            principal: principal.into(),
            scope: "twin/pump-7".into(),
            token: 42,
            lease_id: 0xfeed,
            detail: String::new(),
        }
    }

    #[test]
    fn records_round_trip_and_layout_is_as_documented() {
        let r = rec("worker-a");
        let bytes = r.encode();
        assert_eq!(bytes[0], 1);
        assert_eq!(&bytes[1..9], &1_700_000_000_000u64.to_be_bytes());
        assert_eq!(bytes[9], 1);
        assert_eq!(bytes[10], 0);
        assert_eq!(&bytes[11..19], &42u64.to_be_bytes());
        assert_eq!(&bytes[19..35], &0xfeedu128.to_be_bytes());
        assert_eq!(&bytes[35..37], &8u16.to_be_bytes());
        assert_eq!(&bytes[37..45], b"worker-a");
        assert_eq!(AuditRecord::decode(0, &bytes), Some(r));
        // Truncated or trailing bytes are damage, not a record.
        assert_eq!(AuditRecord::decode(0, &bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(AuditRecord::decode(0, &longer), None);
    }

    #[tokio::test]
    async fn seqs_grow_across_reopen_and_the_cap_prunes_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap();
            let log = store.audit();
            log.set_max_records(3);
            for i in 0..5 {
                log.record(rec(&format!("p{i}")));
            }
            let all = log.list(0, 100).await.unwrap();
            let names: Vec<_> = all.iter().map(|r| r.principal.as_str()).collect();
            assert_eq!(names, ["p2", "p3", "p4"]);
            assert_eq!(all[0].seq, 3);
            store.close().await;
        }
        let store = crate::Store::open(dir.path(), crate::StoreConfig::default()).unwrap();
        assert_eq!(store.audit().record(rec("again")), 6);
        assert_eq!(store.audit().list(5, 100).await.unwrap().len(), 1);
        store.close().await;
    }
}
