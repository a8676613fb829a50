//! The ownership state machine: per partition, Kafka's assignment, the
//! owner lease this node holds, its local deadline and whether its own
//! owner marker has been applied. `(state, event, now) -> actions`; no
//! I/O, no clock of its own, no sleep.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use palisade_core::FencingToken;

/// An etcd lease id of a partition-owner lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerLeaseId(pub i64);

/// A partition-owner lease held by this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owned {
    /// The owner key's create revision: fences a former owner's late writes.
    pub token: FencingToken,
    pub lease: OwnerLeaseId,
    /// Local, conservative end of the lease: the *send* time of the last
    /// successful keep-alive (or of the take) plus the TTL. Past it the
    /// node stops at once, without asking anyone (a paused node wakes up
    /// past it).
    pub deadline: Instant,
    /// Its owner marker is in the log: records may be applied under it.
    pub marked: bool,
}

impl Owned {
    fn live(&self, now: Instant) -> bool {
        now < self.deadline
    }
}

/// Why the node stopped applying and serving a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Revoked,
    /// The local deadline passed (a pause, or keep-alives too slow).
    Expired,
    /// A keep-alive failed (the lease expired in etcd, or etcd is
    /// unreachable).
    KeepAliveFailed,
    /// The owner marker could not be produced.
    MarkerFailed,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Revoked => "revoked by Kafka",
            Self::Expired => "owner lease past its local deadline",
            Self::KeepAliveFailed => "keep-alive failed (lease expired or etcd unreachable)",
            Self::MarkerFailed => "owner marker not produced",
        }
    }
}

/// What happened to a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Kafka assigned it to this node.
    Assigned,
    /// Kafka revoked it.
    Revoked,
    /// The ingester wants to apply a record of it (take the lease if
    /// none is held or being taken).
    Wanted,
    /// A [`Action::TakeLease`] succeeded; `sent` is when the take was
    /// started (the deadline counts from it).
    LeaseTaken {
        token: FencingToken,
        lease: OwnerLeaseId,
        sent: Instant,
        ttl: Duration,
    },
    /// A [`Action::TakeLease`] did not get the lease (held elsewhere, or
    /// etcd failed).
    TakeFailed,
    /// The owner marker with this token is in the log.
    MarkerProduced { token: FencingToken },
    /// The owner marker with this token could not be produced.
    MarkerFailed { token: FencingToken },
    /// A keep-alive sent at `sent` was answered with `ttl`.
    KeepAliveOk {
        lease: OwnerLeaseId,
        sent: Instant,
        ttl: Duration,
    },
    /// A keep-alive failed.
    KeepAliveFailed { lease: OwnerLeaseId },
    /// This node's ingester applied an owner marker (`mine`: written by
    /// this node).
    MarkerApplied { token: FencingToken, mine: bool },
    /// Time passed.
    Tick,
}

/// What the runtime must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Take the partition's owner lease; report [`Event::LeaseTaken`] or
    /// [`Event::TakeFailed`].
    TakeLease,
    /// Produce the owner marker; report [`Event::MarkerProduced`] or
    /// [`Event::MarkerFailed`].
    ProduceMarker {
        token: FencingToken,
    },
    /// Renew the lease every TTL/3; report each answer.
    StartKeepAlive {
        lease: OwnerLeaseId,
    },
    StopKeepAlive {
        lease: OwnerLeaseId,
    },
    /// Give the lease up (best effort: it expires anyway).
    RevokeLease {
        lease: OwnerLeaseId,
    },
    /// The node stopped applying and serving the partition (already so in
    /// the state; for the log).
    StopServing {
        token: FencingToken,
        why: StopReason,
    },
    /// Caught up: the node serves the partition from now on (for the log).
    StartServing {
        token: FencingToken,
    },
}

/// Whether the ingester may apply a record of the partition now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Kafka does not assign it here.
    NotAssigned,
    /// Yes, under this owner token.
    Owned(FencingToken),
    /// Not yet: the lease is being taken, its marker produced, or another
    /// node holds it.
    Wait,
}

#[derive(Debug, Default, Clone, Copy)]
struct Part {
    assigned: bool,
    /// A [`Action::TakeLease`] is out: no second one until it reports.
    taking: bool,
    owned: Option<Owned>,
    /// Caught up: this node's own owner marker has been applied, so every
    /// record before its takeover is in its store.
    serving: bool,
    /// The highest owner token this node ever took for the partition: a
    /// lower one reported later is refused (tokens never go down).
    highest: Option<FencingToken>,
}

/// Every partition's ownership state on this node.
#[derive(Debug, Default, Clone)]
pub struct Machine {
    parts: HashMap<u32, Part>,
}

impl Machine {
    /// Apply `event` to partition `p` at `now`; the actions to carry out,
    /// in order.
    pub fn handle(&mut self, p: u32, event: Event, now: Instant) -> Vec<Action> {
        let s = self.parts.entry(p).or_default();
        // Whatever the event, a lease past its deadline is gone first.
        let mut out = expire(s, now);
        match event {
            Event::Assigned => {
                s.assigned = true;
                want(s, &mut out);
            }
            Event::Revoked => {
                s.assigned = false;
                drop_owned(s, StopReason::Revoked, &mut out);
            }
            Event::Wanted => want(s, &mut out),
            Event::LeaseTaken {
                token,
                lease,
                sent,
                ttl,
            } => {
                s.taking = false;
                let lower = s.highest.is_some_and(|h| token <= h);
                if !s.assigned || s.owned.is_some() || lower {
                    // Revoked meanwhile (no marker for a partition not
                    // assigned), or a token that would go down.
                    out.push(Action::RevokeLease { lease });
                } else {
                    s.highest = Some(token);
                    s.serving = false;
                    s.owned = Some(Owned {
                        token,
                        lease,
                        deadline: sent + ttl,
                        marked: false,
                    });
                    // Keep-alives from now: producing the marker may take
                    // longer than the TTL.
                    out.push(Action::StartKeepAlive { lease });
                    out.push(Action::ProduceMarker { token });
                }
            }
            Event::TakeFailed => s.taking = false,
            Event::MarkerProduced { token } => {
                if let Some(o) = s.owned.as_mut().filter(|o| o.token == token) {
                    o.marked = true;
                }
            }
            Event::MarkerFailed { token } => {
                if s.owned.is_some_and(|o| o.token == token) {
                    drop_owned(s, StopReason::MarkerFailed, &mut out);
                }
            }
            Event::KeepAliveOk { lease, sent, ttl } => {
                if let Some(o) = s.owned.as_mut().filter(|o| o.lease == lease) {
                    // Only a live lease is extended (an expired one was
                    // dropped above): the send time, not the answer's.
                    o.deadline = sent + ttl;
                    if !o.live(now) {
                        drop_owned(s, StopReason::Expired, &mut out);
                    }
                }
            }
            Event::KeepAliveFailed { lease } => {
                if s.owned.is_some_and(|o| o.lease == lease) {
                    drop_owned(s, StopReason::KeepAliveFailed, &mut out);
                }
            }
            Event::MarkerApplied { token, mine } => {
                if let Some(o) = s.owned {
                    // A marker cannot be applied before it is known to be
                    // in the log; one that is would be another's, replayed.
                    if mine && o.token == token && o.marked && !s.serving {
                        s.serving = true;
                        out.push(Action::StartServing { token });
                    }
                }
            }
            Event::Tick => {}
        }
        out
    }

    /// Whether the ingester may apply a record of `p` at `now`.
    pub fn gate(&self, p: u32, now: Instant) -> Gate {
        let s = self.part(p);
        if !s.assigned {
            return Gate::NotAssigned;
        }
        match s.owned {
            Some(o) if o.marked && o.live(now) => Gate::Owned(o.token),
            _ => Gate::Wait,
        }
    }

    /// The lease `p` is served under at `now`: live by the local deadline
    /// and this node's own marker applied.
    pub fn serving(&self, p: u32, now: Instant) -> Option<Owned> {
        let s = self.part(p);
        s.owned.filter(|o| s.serving && o.live(now))
    }

    /// The owner lease of `p` if it is live at `now` (served or still
    /// catching up).
    pub fn live(&self, p: u32, now: Instant) -> Option<Owned> {
        self.part(p).owned.filter(|o| o.live(now))
    }

    fn part(&self, p: u32) -> Part {
        self.parts.get(&p).copied().unwrap_or_default()
    }
}

fn expire(s: &mut Part, now: Instant) -> Vec<Action> {
    let mut out = Vec::new();
    if s.owned.is_some_and(|o| !o.live(now)) {
        drop_owned(s, StopReason::Expired, &mut out);
    }
    out
}

fn want(s: &mut Part, out: &mut Vec<Action>) {
    if s.assigned && s.owned.is_none() && !s.taking {
        s.taking = true;
        out.push(Action::TakeLease);
    }
}

fn drop_owned(s: &mut Part, why: StopReason, out: &mut Vec<Action>) {
    s.serving = false;
    if let Some(o) = s.owned.take() {
        out.push(Action::StopServing {
            token: o.token,
            why,
        });
        out.push(Action::StopKeepAlive { lease: o.lease });
        out.push(Action::RevokeLease { lease: o.lease });
    }
}

#[cfg(test)]
mod tests;
