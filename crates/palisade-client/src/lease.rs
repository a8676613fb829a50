//! [`Lease`]: a lease kept renewed in the background, with a `lost()` signal.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use palisade_core::Purpose;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::client::Client;
use crate::error::ClientError;
use crate::types::{Appended, Event, LeaseGrant};

/// Shortest renewal period used, whatever is asked (no busy loops).
const MIN_RENEW_EVERY: Duration = Duration::from_millis(10);

/// How a [`Lease`] guard renews.
#[derive(Debug, Clone, Default)]
pub struct LeaseOptions {
    /// Renew this long after the last successful renewal. Default: a third of
    /// the TTL, which leaves two thirds of it for retries. Clamped to at most
    /// half the TTL (and at least 10 ms).
    pub renew_every: Option<Duration>,
    /// What the lease is for; `None` leaves it to the store (correctness).
    pub purpose: Option<Purpose>,
}

/// A lease kept alive by a background task, from
/// [`Client::lease`](crate::Client::lease).
///
/// The task renews every [`LeaseOptions::renew_every`] (default TTL/3). When
/// a renewal fails for a transport reason (or a 5xx), it retries every TTL/10
/// until the time since the last successful renewal *was sent* reaches the
/// TTL. The lease is then marked lost; so it is at once when the store
/// answers `410`/`404` (expired, superseded, released, unknown) or any other
/// 4xx. After that the task stops: a lost lease is never renewed again, take
/// a new one.
///
/// # `lost()` is an optimisation, not the safety mechanism
///
/// [`lost`](Self::lost) lets a *healthy but partitioned* worker notice that
/// it can no longer vouch for its lease and stop early. It is never what
/// keeps two writers apart: a process paused by GC, swapping or `SIGSTOP`
/// cannot run it, and wakes up still believing it holds the lease. What
/// refuses that paused writer is the store's fencing check — every write
/// carries [`token`](Self::token), and the store rejects a token lower than a
/// later grant's with [`ClientError::Stale`]. Do not rely on `lost()` or
/// [`is_lost`](Self::is_lost) checks as safety: they shrink the window, they
/// cannot close it. Handle `Stale` on every write.
///
/// Equally, `is_lost() == false` does not mean the lease is still held: the
/// task may not have had the chance to notice yet.
///
/// # Dropping and releasing
///
/// Dropping the guard stops the renewal task but does **not** release the
/// lease: it lapses after its TTL (a crashed worker looks the same to the
/// store). Call [`release`](Self::release) to free the scope at once. Either
/// way, watchers from [`lost_watch`](Self::lost_watch) then see `true`: nobody
/// is renewing the lease any more.
pub struct Lease {
    client: Client,
    grant: LeaseGrant,
    lost_tx: Arc<watch::Sender<bool>>,
    lost_rx: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("lease_id", &self.grant.lease_id)
            .field("scope", &self.grant.scope)
            .field("holder", &self.grant.holder)
            .field("token", &self.grant.token)
            .field("ttl_ms", &self.grant.ttl_ms)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl Lease {
    pub(crate) async fn acquire(
        client: Client,
        scope: &str,
        holder: &str,
        ttl: Duration,
        opts: LeaseOptions,
    ) -> Result<Self, ClientError> {
        // The TTL is counted from before the request: the store's clock
        // started later, so our deadline is never later than its.
        let sent = Instant::now();
        let grant = client.acquire_for(scope, holder, ttl, opts.purpose).await?;
        let ttl = Duration::from_millis(grant.ttl_ms);
        let every = opts
            .renew_every
            .unwrap_or(ttl / 3)
            .min(ttl / 2)
            .max(MIN_RENEW_EVERY);
        let (tx, rx) = watch::channel(false);
        let tx = Arc::new(tx);
        let task = tokio::spawn(renew_loop(
            client.clone(),
            grant.lease_id.clone(),
            ttl,
            every,
            sent,
            tx.clone(),
        ));
        tracing::debug!(lease = %grant.lease_id, scope = %grant.scope, token = grant.token, ?every, "lease acquired");
        Ok(Self {
            client,
            grant,
            lost_tx: tx,
            lost_rx: rx,
            task,
        })
    }

    /// The fencing token to send with every write made under this lease.
    pub fn token(&self) -> u64 {
        self.grant.token
    }

    /// The lease id.
    pub fn id(&self) -> &str {
        &self.grant.lease_id
    }

    /// `partition/<p>` or `twin/<id>`.
    pub fn scope(&self) -> &str {
        &self.grant.scope
    }

    pub fn holder(&self) -> &str {
        &self.grant.holder
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.grant.ttl_ms)
    }

    /// Resolves the moment a renewal fails for good or the lease is reported
    /// expired/superseded/released (410/404), or the renewal could not
    /// complete before the TTL ran out. Resolves at once if that already
    /// happened; may be awaited any number of times.
    ///
    /// An optimisation for stopping early, not a safety check: see the
    /// [type-level docs](Self).
    pub async fn lost(&self) {
        let mut rx = self.lost_rx.clone();
        // The guard holds a sender, so the channel cannot close under us.
        let _ = rx.wait_for(|lost| *lost).await;
    }

    /// Whether the lease has been marked lost (see [`lost`](Self::lost)).
    pub fn is_lost(&self) -> bool {
        *self.lost_rx.borrow()
    }

    /// A watch that turns `true` when the lease is lost or no longer renewed
    /// (the guard was dropped or released). Hand it to other tasks.
    pub fn lost_watch(&self) -> watch::Receiver<bool> {
        self.lost_rx.clone()
    }

    /// Stop renewing, then release the lease (`DELETE`) so the scope can be
    /// granted at once. `Err(LeaseGone)` if it had already expired or been
    /// superseded.
    pub async fn release(self) -> Result<(), ClientError> {
        self.stop();
        self.client.release(&self.grant.lease_id).await
    }

    /// Append `events` to `twin` under this lease's token (see
    /// [`Client::append`](crate::Client::append) for retries).
    ///
    /// This does not consult [`is_lost`](Self::is_lost): the store decides,
    /// and answers [`ClientError::Stale`] once a later lease covers the twin.
    pub async fn append(&self, twin: &str, events: &[Event]) -> Result<Appended, ClientError> {
        self.client.append(twin, self.grant.token, events).await
    }

    fn stop(&self) {
        self.task.abort();
        self.lost_tx.send_replace(true);
    }
}

impl Drop for Lease {
    /// Stops the renewal task; does not release the lease.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Renew `lease_id` until it is lost (or the task is aborted).
async fn renew_loop(
    client: Client,
    lease_id: String,
    ttl: Duration,
    every: Duration,
    mut last_ok: Instant,
    lost: Arc<watch::Sender<bool>>,
) {
    let retry = (ttl / 10).max(MIN_RENEW_EVERY);
    let mut next = last_ok + every;
    let why = loop {
        tokio::time::sleep_until(next).await;
        let deadline = last_ok + ttl;
        let sent = Instant::now();
        if sent >= deadline {
            break "the TTL ran out before a renewal succeeded".to_owned();
        }
        match tokio::time::timeout_at(deadline, client.renew(&lease_id)).await {
            Err(_) => break "the TTL ran out while a renewal was in flight".to_owned(),
            Ok(Ok(_)) => {
                last_ok = sent;
                next = sent + every;
            }
            Ok(Err(e)) if transient(&e) => {
                tracing::warn!(lease = %lease_id, error = %e, "lease renewal failed; retrying");
                next = (Instant::now() + retry).min(deadline);
            }
            Ok(Err(e)) => break e.to_string(),
        }
    };
    tracing::warn!(lease = %lease_id, reason = %why, "lease lost");
    lost.send_replace(true);
}

/// Renewal failures worth retrying until the TTL runs out.
fn transient(e: &ClientError) -> bool {
    match e {
        ClientError::Transport(_) => true,
        ClientError::Api { status, .. } => *status >= 500,
        _ => false,
    }
}
