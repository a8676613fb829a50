#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

const TTL: Duration = Duration::from_secs(3);
const P: u32 = 4;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Assigned, taken with `token`/`lease` at `t0`, marker produced and
/// applied: serving.
fn serving_at(m: &mut Machine, t0: Instant, token: u64, lease: i64) -> Owned {
    m.handle(P, Event::Assigned, t0);
    let (token, lease) = (FencingToken(token), OwnerLeaseId(lease));
    m.handle(
        P,
        Event::LeaseTaken {
            token,
            lease,
            sent: t0,
            ttl: TTL,
        },
        t0,
    );
    m.handle(P, Event::MarkerProduced { token }, t0);
    m.handle(P, Event::MarkerApplied { token, mine: true }, t0);
    m.serving(P, t0).unwrap()
}

#[test]
fn assignment_takes_the_lease_once_and_the_marker_follows() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    assert_eq!(m.gate(P, t0), Gate::NotAssigned);
    assert_eq!(m.handle(P, Event::Assigned, t0), vec![Action::TakeLease]);
    // A second want while the take is out asks for nothing.
    assert_eq!(m.handle(P, Event::Wanted, t0), vec![]);
    assert_eq!(m.gate(P, t0), Gate::Wait);
    let (token, lease) = (FencingToken(9), OwnerLeaseId(3));
    let a = m.handle(
        P,
        Event::LeaseTaken {
            token,
            lease,
            sent: t0,
            ttl: TTL,
        },
        t0 + ms(10),
    );
    assert_eq!(
        a,
        vec![
            Action::StartKeepAlive { lease },
            Action::ProduceMarker { token }
        ]
    );
    // Owned but its marker not in the log: nothing applied, nothing served.
    assert_eq!(m.gate(P, t0), Gate::Wait);
    m.handle(P, Event::MarkerProduced { token }, t0);
    assert_eq!(m.gate(P, t0), Gate::Owned(token));
    assert!(m.serving(P, t0).is_none());
    // Another node's marker, or an older one of ours, does not catch us up.
    m.handle(P, Event::MarkerApplied { token, mine: false }, t0);
    m.handle(
        P,
        Event::MarkerApplied {
            token: FencingToken(8),
            mine: true,
        },
        t0,
    );
    assert!(m.serving(P, t0).is_none());
    assert_eq!(
        m.handle(P, Event::MarkerApplied { token, mine: true }, t0),
        vec![Action::StartServing { token }]
    );
    assert_eq!(m.serving(P, t0).map(|o| o.token), Some(token));
}

#[test]
fn the_deadline_counts_from_the_keep_alive_send_time() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    let o = serving_at(&mut m, t0, 5, 1);
    // Sent at 1 s, answered at 1.9 s: live until 4 s, not 4.9 s.
    m.handle(
        P,
        Event::KeepAliveOk {
            lease: o.lease,
            sent: t0 + ms(1000),
            ttl: TTL,
        },
        t0 + ms(1900),
    );
    assert!(m.serving(P, t0 + ms(3999)).is_some());
    assert!(m.serving(P, t0 + ms(4000)).is_none());
    assert_eq!(m.gate(P, t0 + ms(4000)), Gate::Wait);
    // The next event drops it and takes it anew.
    let a = m.handle(P, Event::Tick, t0 + ms(4000));
    assert_eq!(
        a,
        vec![
            Action::StopServing {
                token: o.token,
                why: StopReason::Expired
            },
            Action::StopKeepAlive { lease: o.lease },
            Action::RevokeLease { lease: o.lease },
        ]
    );
    assert_eq!(
        m.handle(P, Event::Wanted, t0 + ms(4000)),
        vec![Action::TakeLease]
    );
}

#[test]
fn a_keep_alive_answered_after_the_deadline_does_not_revive_the_lease() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    let o = serving_at(&mut m, t0, 5, 1);
    // A pause: the answer to a keep-alive sent at 2.5 s arrives at 3.5 s.
    let a = m.handle(
        P,
        Event::KeepAliveOk {
            lease: o.lease,
            sent: t0 + ms(2500),
            ttl: TTL,
        },
        t0 + ms(3500),
    );
    assert!(a.contains(&Action::StopServing {
        token: o.token,
        why: StopReason::Expired
    }));
    assert!(m.live(P, t0 + ms(3500)).is_none());
}

#[test]
fn a_revoke_stops_at_once_and_a_late_take_is_given_back() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    let o = serving_at(&mut m, t0, 5, 1);
    let a = m.handle(P, Event::Revoked, t0 + ms(1));
    assert!(a.contains(&Action::RevokeLease { lease: o.lease }));
    assert!(m.serving(P, t0 + ms(1)).is_none());
    assert_eq!(m.gate(P, t0 + ms(1)), Gate::NotAssigned);
    // Assigned, revoked while the take is out: the lease taken is given
    // back and no marker is produced.
    m.handle(P, Event::Assigned, t0 + ms(2));
    m.handle(P, Event::Revoked, t0 + ms(3));
    let lease = OwnerLeaseId(2);
    let a = m.handle(
        P,
        Event::LeaseTaken {
            token: FencingToken(6),
            lease,
            sent: t0 + ms(2),
            ttl: TTL,
        },
        t0 + ms(4),
    );
    assert_eq!(a, vec![Action::RevokeLease { lease }]);
}

#[test]
fn a_lower_owner_token_is_refused() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    let o = serving_at(&mut m, t0, 10, 1);
    m.handle(P, Event::KeepAliveFailed { lease: o.lease }, t0);
    assert_eq!(m.handle(P, Event::Wanted, t0), vec![Action::TakeLease]);
    let lease = OwnerLeaseId(2);
    let a = m.handle(
        P,
        Event::LeaseTaken {
            token: FencingToken(10),
            lease,
            sent: t0,
            ttl: TTL,
        },
        t0,
    );
    assert_eq!(a, vec![Action::RevokeLease { lease }]);
    assert!(m.live(P, t0).is_none());
}

#[test]
fn a_failed_marker_or_keep_alive_gives_the_lease_up() {
    let mut m = Machine::default();
    let t0 = Instant::now();
    m.handle(P, Event::Assigned, t0);
    let (token, lease) = (FencingToken(3), OwnerLeaseId(1));
    m.handle(
        P,
        Event::LeaseTaken {
            token,
            lease,
            sent: t0,
            ttl: TTL,
        },
        t0,
    );
    let a = m.handle(P, Event::MarkerFailed { token }, t0);
    assert!(a.contains(&Action::RevokeLease { lease }));
    assert_eq!(m.gate(P, t0), Gate::Wait);
    // A keep-alive failure of a lease no longer held changes nothing.
    assert_eq!(m.handle(P, Event::KeepAliveFailed { lease }, t0), vec![]);
}

// ---------------------------------------------------------------------------
// Properties: random events in random order against a model of what the
// runtime has been told.
// ---------------------------------------------------------------------------

/// An event, resolved against the machine's state when it is applied (so
/// that keep-alives and markers name the current lease or a stale one).
#[derive(Debug, Clone)]
enum Op {
    Assigned,
    Revoked,
    Wanted,
    /// A take answered: token = the next etcd revision, or (`lower`) one
    /// below the last.
    Taken {
        lower: bool,
        back_ms: u64,
    },
    TakeFailed,
    MarkerProduced {
        current: bool,
    },
    MarkerFailed {
        current: bool,
    },
    KeepAliveOk {
        current: bool,
        back_ms: u64,
        ttl_ms: u64,
    },
    KeepAliveFailed {
        current: bool,
    },
    MarkerApplied {
        current: bool,
        mine: bool,
    },
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Assigned),
        1 => Just(Op::Revoked),
        2 => Just(Op::Wanted),
        3 => (any::<bool>(), 0u64..1500).prop_map(|(l, b)| Op::Taken { lower: l && b % 4 == 0, back_ms: b }),
        1 => Just(Op::TakeFailed),
        3 => any::<bool>().prop_map(|c| Op::MarkerProduced { current: c }),
        1 => any::<bool>().prop_map(|c| Op::MarkerFailed { current: c }),
        4 => (any::<bool>(), 0u64..1500, 0u64..4000)
            .prop_map(|(c, b, t)| Op::KeepAliveOk { current: c, back_ms: b, ttl_ms: t }),
        1 => any::<bool>().prop_map(|c| Op::KeepAliveFailed { current: c }),
        3 => (any::<bool>(), any::<bool>()).prop_map(|(c, m)| Op::MarkerApplied { current: c, mine: m }),
        2 => Just(Op::Tick),
    ]
}

/// What the runtime has told the machine, kept independently of it.
#[derive(Debug, Default)]
struct Model {
    assigned: bool,
    /// Per lease: send time + TTL of the last successful take or keep-alive.
    deadline: HashMap<i64, Instant>,
    /// Leases reported failed, or given back.
    dead: HashSet<i64>,
    /// Owner tokens whose own marker was applied.
    applied: HashSet<u64>,
    next_token: u64,
    next_lease: i64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn ownership_invariants_hold_under_any_event_order(
        steps in proptest::collection::vec((op(), 0u64..1200), 1..120)
    ) {
        let mut m = Machine::default();
        let mut model = Model { next_token: 100, next_lease: 1, ..Model::default() };
        let t0 = Instant::now();
        let mut now = t0;
        let mut taken: Vec<u64> = Vec::new();
        let mut last_owned: Option<Owned> = None;
        for (op, advance) in steps {
            now += ms(advance);
            let current = m.live(P, now).or(m.parts.get(&P).and_then(|s| s.owned));
            let stale_lease = OwnerLeaseId(0);
            let stale_token = FencingToken(1);
            let lease_of = |c: bool| if c { current.map_or(stale_lease, |o| o.lease) } else { stale_lease };
            let token_of = |c: bool| if c { current.map_or(stale_token, |o| o.token) } else { stale_token };
            let was_assigned = model.assigned;
            let event = match op {
                Op::Assigned => { model.assigned = true; Event::Assigned }
                Op::Revoked => { model.assigned = false; Event::Revoked }
                Op::Wanted => Event::Wanted,
                Op::Taken { lower, back_ms } => {
                    let token = if lower { model.next_token.saturating_sub(5) } else { model.next_token += 1; model.next_token };
                    let lease = model.next_lease;
                    model.next_lease += 1;
                    let sent = now.checked_sub(ms(back_ms)).unwrap_or(now);
                    model.deadline.insert(lease, sent + TTL);
                    Event::LeaseTaken { token: FencingToken(token), lease: OwnerLeaseId(lease), sent, ttl: TTL }
                }
                Op::TakeFailed => Event::TakeFailed,
                Op::MarkerProduced { current } => Event::MarkerProduced { token: token_of(current) },
                Op::MarkerFailed { current } => Event::MarkerFailed { token: token_of(current) },
                Op::KeepAliveOk { current, back_ms, ttl_ms } => {
                    let lease = lease_of(current);
                    let sent = now.checked_sub(ms(back_ms)).unwrap_or(now);
                    // A keep-alive answered after the lease's own deadline
                    // cannot extend it.
                    if model.deadline.get(&lease.0).is_some_and(|d| now < *d) {
                        model.deadline.insert(lease.0, sent + ms(ttl_ms));
                    }
                    Event::KeepAliveOk { lease, sent, ttl: ms(ttl_ms) }
                }
                Op::KeepAliveFailed { current } => {
                    let lease = lease_of(current);
                    model.dead.insert(lease.0);
                    Event::KeepAliveFailed { lease }
                }
                Op::MarkerApplied { current, mine } => {
                    let token = token_of(current);
                    if mine { model.applied.insert(token.0); }
                    Event::MarkerApplied { token, mine }
                }
                Op::Tick => Event::Tick,
            };
            let actions = m.handle(P, event, now);
            for a in &actions {
                match a {
                    // No marker for a partition not assigned.
                    Action::ProduceMarker { .. } => prop_assert!(was_assigned && model.assigned),
                    Action::RevokeLease { lease } => { model.dead.insert(lease.0); }
                    _ => {}
                }
            }
            // Served only while assigned, live by the send-time deadline,
            // not failed, and with this node's own marker applied.
            if let Some(o) = m.serving(P, now) {
                prop_assert!(model.assigned);
                prop_assert!(now < model.deadline[&o.lease.0], "served past its deadline");
                prop_assert!(!model.dead.contains(&o.lease.0));
                prop_assert!(model.applied.contains(&o.token.0));
                prop_assert!(o.marked);
            }
            // A revoke, or an expired deadline, stops serving at once.
            if matches!(op, Op::Revoked) {
                prop_assert!(m.serving(P, now).is_none());
                prop_assert_eq!(m.gate(P, now), Gate::NotAssigned);
            }
            if let Gate::Owned(t) = m.gate(P, now) {
                let o = m.live(P, now).unwrap();
                prop_assert_eq!(o.token, t);
                prop_assert!(now < model.deadline[&o.lease.0]);
            }
            // Owner tokens taken by this node never go down.
            if let Some(o) = m.parts.get(&P).and_then(|s| s.owned) {
                if last_owned.map(|l| l.lease) != Some(o.lease) {
                    if let Some(&prev) = taken.last() {
                        prop_assert!(o.token.0 > prev, "owner token went down: {} after {}", o.token.0, prev);
                    }
                    taken.push(o.token.0);
                }
            }
            last_owned = m.parts.get(&P).and_then(|s| s.owned);
        }
    }
}
