//! TTL advice from measured tails (the reference article's checklist: "set
//! the TTL from measured pause and latency tails, not from a guess").
//!
//! [`RenewalTails`] keeps, per scope and holder, the gaps between a lease's
//! consecutive renewals as the authority saw them and the time the store
//! took to answer each grant or renewal, and derives a recommended TTL from
//! their tails ([`Advice`]). Pure like [`LeaseTable`](crate::LeaseTable):
//! time and latencies are arguments; the store feeds it and serves
//! `GET /v1/leases/advice`. Decision: `docs/decisions/0026-ttl-advice.md`.
//!
//! The rule. A worker renews every `ttl / 3` (the SDK's default). The
//! median gap between its renewals is that period; what the tail adds on top
//! is what paused it (GC, throttling, a slow network):
//! `pause_tail = tail(gap) - median(gap)`. With TTL `T`, a renewal is due after `T/3` and arrives
//! after at most `T/3 + pause_tail + latency_tail`; asking that this stays
//! within two thirds of `T` (a keep-alive margin of 1.5x) gives `T >= 3 *
//! (pause_tail + latency_tail)`. The tail is the p99 once there are 100
//! gaps, the maximum before; no TTL is recommended before
//! [`MIN_SAMPLES`] gaps, and never one under [`ADVICE_FLOOR_MS`]. A lease is
//! flagged (and the store warns) only when its TTL is below what the tails
//! themselves call for, not merely below the floor.

use std::collections::{HashMap, VecDeque};

use palisade_core::{LeaseId, Scope};

use crate::table::{Lease, Millis, MAX_TTL_MS};

/// Samples kept per scope and holder (the newest).
pub const SAMPLES_PER_KEY: usize = 512;
/// Scope-and-holder pairs tracked; past it the least recently seen is dropped.
pub const MAX_KEYS: usize = 4096;
/// Gaps needed before a TTL is recommended.
pub const MIN_SAMPLES: usize = 20;
/// Gaps from which the tail is the p99 rather than the maximum.
pub const P99_SAMPLES: usize = 100;
/// The smallest TTL ever recommended: a steady worker on a quiet machine
/// would otherwise be told to run on a TTL no real network keeps.
pub const ADVICE_FLOOR_MS: u64 = 1_000;

/// p50, tail (p99, or the maximum below [`P99_SAMPLES`]) and maximum of a
/// set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Tails {
    pub p50_ms: f64,
    pub tail_ms: f64,
    pub max_ms: f64,
}

/// What the store recommends for one scope (or one holder on it).
#[derive(Debug, Clone, PartialEq)]
pub struct Advice {
    /// Renewal gaps measured (the basis of the recommendation).
    pub gaps: usize,
    /// Gaps between consecutive renewals of one lease, including a renewal
    /// that came too late (its lease had expired).
    pub gap: Tails,
    /// Time the store took to answer grants and renewals (its own sync
    /// included; the network to the worker is in the gaps).
    pub latency: Tails,
    /// `tail(gap) - p50(gap)`: what pauses added on top of the renewal period.
    pub pause_tail_ms: f64,
    /// `3 * (pause_tail + answer tail)` rounded up to 100 ms: the shortest
    /// TTL the measured tails allow. `None` until [`MIN_SAMPLES`] gaps.
    pub tail_ttl_ms: Option<u64>,
    /// [`Advice::tail_ttl_ms`], at least [`ADVICE_FLOOR_MS`]. `None` until
    /// [`MIN_SAMPLES`] gaps were measured.
    pub recommended_ttl_ms: Option<u64>,
    /// A third of the recommended TTL.
    pub recommended_renew_every_ms: Option<u64>,
    /// Renewals that arrived after their lease had expired.
    pub late_renewals: u64,
}

impl Advice {
    /// Whether a lease with `ttl_ms` is below what the measured tails allow
    /// ([`Advice::tail_ttl_ms`], not the floor): a pause as long as the tail
    /// may expire it while its holder is healthy. Known once there are
    /// [`MIN_SAMPLES`] gaps.
    pub fn ttl_below(&self, ttl_ms: u64) -> bool {
        self.tail_ttl_ms.is_some_and(|r| ttl_ms < r)
    }
}

#[derive(Debug, Default)]
struct Key {
    /// The holder's current lease on the scope, and when it was last
    /// granted or renewed.
    lease: Option<LeaseId>,
    last_seen: Option<Millis>,
    touched: Millis,
    gaps_ms: VecDeque<u64>,
    latencies_us: VecDeque<u64>,
    late: u64,
    /// When the TTL warning for this holder's lease was last logged.
    warned_at: Option<Millis>,
}

/// At most one logged TTL warning per scope and holder in this long (the
/// metric counts every one).
pub const WARN_EVERY_MS: u64 = 60_000;

/// What [`RenewalTails::check_ttl`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum TtlCheck {
    /// The TTL is at least the measured tail (or there is no tail yet).
    Fine,
    /// The TTL is below the tail: count it; `log` once per
    /// [`WARN_EVERY_MS`] per scope and holder.
    Below { advice: Advice, log: bool },
}

fn push(ring: &mut VecDeque<u64>, v: u64) {
    if ring.len() == SAMPLES_PER_KEY {
        ring.pop_front();
    }
    ring.push_back(v);
}

/// Renewal gaps and answer latencies per scope and holder, bounded.
#[derive(Debug, Default)]
pub struct RenewalTails {
    keys: HashMap<(Scope, String), Key>,
}

impl RenewalTails {
    fn key(&mut self, scope: &Scope, holder: &str, now: Millis) -> &mut Key {
        let k = (scope.clone(), holder.to_owned());
        if !self.keys.contains_key(&k) && self.keys.len() >= MAX_KEYS {
            if let Some(oldest) = self
                .keys
                .iter()
                .min_by_key(|(_, v)| v.touched)
                .map(|(k, _)| k.clone())
            {
                self.keys.remove(&oldest);
            }
        }
        let entry = self.keys.entry(k).or_default();
        entry.touched = now;
        entry
    }

    /// `lease` was granted at `now`, answered in `latency_us`. Starts a new
    /// gap series: the time since the holder's previous lease is not a
    /// renewal gap.
    pub fn granted(&mut self, lease: &Lease, now: Millis, latency_us: u64) {
        let k = self.key(&lease.scope, &lease.holder, now);
        k.lease = Some(lease.id);
        k.last_seen = Some(now);
        push(&mut k.latencies_us, latency_us);
    }

    /// `lease` was renewed at `now`. Returns the gap it closed, in ms.
    pub fn renewed(&mut self, lease: &Lease, now: Millis, latency_us: u64) -> Option<u64> {
        let k = self.key(&lease.scope, &lease.holder, now);
        let gap = (k.lease == Some(lease.id))
            .then_some(k.last_seen)
            .flatten()
            .map(|t| now.0.saturating_sub(t.0));
        if let Some(g) = gap {
            push(&mut k.gaps_ms, g);
        }
        k.lease = Some(lease.id);
        k.last_seen = Some(now);
        push(&mut k.latencies_us, latency_us);
        gap
    }

    /// A renewal of lease `id` arrived at `now` after the lease had
    /// expired: the gap that lost it is the tail that matters most. Ends
    /// the series. Found by id, so it counts even once the authority has
    /// forgotten the lease.
    pub fn renewed_late(&mut self, id: LeaseId, now: Millis) -> Option<u64> {
        let k = self.keys.values_mut().find(|k| k.lease == Some(id))?;
        k.lease = None;
        k.touched = now;
        k.late += 1;
        let gap = k.last_seen.take().map(|t| now.0.saturating_sub(t.0));
        if let Some(g) = gap {
            push(&mut k.gaps_ms, g);
        }
        gap
    }

    /// Is `lease`'s TTL below what its scope's tails call for, at `now`
    /// (just granted or renewed)? A warning is due once per
    /// [`WARN_EVERY_MS`] per scope and holder, so a fleet renewing every
    /// second does not flood the log.
    pub fn check_ttl(&mut self, lease: &Lease, now: Millis) -> TtlCheck {
        let advice = self.advice(&lease.scope, None);
        if !advice.ttl_below(lease.ttl_ms) {
            return TtlCheck::Fine;
        }
        let k = self.key(&lease.scope, &lease.holder, now);
        let log = k
            .warned_at
            .is_none_or(|t| now.0.saturating_sub(t.0) >= WARN_EVERY_MS);
        if log {
            k.warned_at = Some(now);
        }
        TtlCheck::Below { advice, log }
    }

    /// The advice for `scope`, from every holder's samples on it, or only
    /// `holder`'s.
    pub fn advice(&self, scope: &Scope, holder: Option<&str>) -> Advice {
        let mut gaps = Vec::new();
        let mut latencies = Vec::new();
        let mut late = 0;
        for ((s, h), k) in &self.keys {
            if s != scope || holder.is_some_and(|want| want != h) {
                continue;
            }
            gaps.extend(k.gaps_ms.iter().copied());
            latencies.extend(k.latencies_us.iter().copied());
            late += k.late;
        }
        advise(gaps, latencies, late)
    }
}

/// The rule of the module docs over raw samples (gaps in ms, latencies in µs).
fn advise(mut gaps_ms: Vec<u64>, mut latencies_us: Vec<u64>, late_renewals: u64) -> Advice {
    let gap = tails(&mut gaps_ms, 1.0);
    let latency = tails(&mut latencies_us, 1_000.0);
    let pause_tail_ms = (gap.tail_ms - gap.p50_ms).max(0.0);
    let tail_ttl_ms = (gaps_ms.len() >= MIN_SAMPLES).then(|| {
        let raw = 3.0 * (pause_tail_ms + latency.tail_ms);
        // Whole 100 ms, up; at most what a grant accepts.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let ms = ((raw / 100.0).ceil() as u64).saturating_mul(100);
        ms.min(MAX_TTL_MS)
    });
    let recommended_ttl_ms = tail_ttl_ms.map(|t| t.max(ADVICE_FLOOR_MS));
    Advice {
        gaps: gaps_ms.len(),
        gap,
        latency,
        pause_tail_ms,
        tail_ttl_ms,
        recommended_ttl_ms,
        recommended_renew_every_ms: recommended_ttl_ms.map(|t| t / 3),
        late_renewals,
    }
}

/// Nearest-rank quantiles of `v` (sorted in place), scaled by `1/per_ms`.
fn tails(v: &mut [u64], per_ms: f64) -> Tails {
    if v.is_empty() {
        return Tails::default();
    }
    v.sort_unstable();
    let rank = |q: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    };
    let tail_q = if v.len() >= P99_SAMPLES { 0.99 } else { 1.0 };
    #[allow(clippy::cast_precision_loss)]
    let ms = |x: u64| x as f64 / per_ms;
    Tails {
        p50_ms: ms(rank(0.5)),
        tail_ms: ms(rank(tail_q)),
        max_ms: ms(v[v.len() - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> Scope {
        "twin/pump-7".parse().unwrap()
    }

    fn lease(id: u128, holder: &str) -> Lease {
        Lease {
            id: LeaseId(id),
            scope: scope(),
            holder: holder.into(),
            token: palisade_core::FencingToken(1),
            ttl_ms: 10_000,
            purpose: Default::default(),
            expires_at: 0,
        }
    }

    /// A holder renewing every `period` ms, with `pauses` added to some gaps.
    fn steady(t: &mut RenewalTails, holder: &str, period: u64, n: usize, pauses: &[(usize, u64)]) {
        let l = lease(holder.len() as u128, holder);
        let mut now = 0;
        t.granted(&l, Millis(now), 2_000);
        for i in 0..n {
            now += period + pauses.iter().find(|(at, _)| *at == i).map_or(0, |p| p.1);
            t.renewed(&l, Millis(now), 2_000);
        }
    }

    #[test]
    fn no_recommendation_before_enough_gaps() {
        let mut t = RenewalTails::default();
        steady(&mut t, "a", 3_000, MIN_SAMPLES - 1, &[]);
        let a = t.advice(&scope(), None);
        assert_eq!(a.gaps, MIN_SAMPLES - 1);
        assert_eq!(a.recommended_ttl_ms, None);
        assert!(!a.ttl_below(1));
    }

    #[test]
    fn a_pause_tail_sets_the_ttl_at_three_times_pause_plus_latency() {
        let mut t = RenewalTails::default();
        // 40 renewals every 3 s, one of them 5 s late (a GC pause).
        steady(&mut t, "a", 3_000, 40, &[(17, 5_000)]);
        let a = t.advice(&scope(), None);
        assert_eq!(a.gap.p50_ms, 3_000.0);
        assert_eq!(a.gap.tail_ms, 8_000.0); // under 100 gaps: the maximum
        assert_eq!(a.pause_tail_ms, 5_000.0);
        assert_eq!(a.latency.tail_ms, 2.0);
        // 3 * (5000 + 2) = 15006 -> 15100.
        assert_eq!(a.tail_ttl_ms, Some(15_100));
        assert_eq!(a.recommended_ttl_ms, Some(15_100));
        assert_eq!(a.recommended_renew_every_ms, Some(5_033));
        assert!(a.ttl_below(10_000));
        assert!(!a.ttl_below(15_100));
    }

    #[test]
    fn from_a_hundred_gaps_the_tail_is_the_p99_not_one_outlier() {
        let mut t = RenewalTails::default();
        steady(&mut t, "a", 1_000, 300, &[(150, 60_000)]);
        let a = t.advice(&scope(), None);
        assert_eq!(a.gap.max_ms, 61_000.0);
        assert_eq!(a.gap.tail_ms, 1_000.0);
        // 3 * (0 + 2 ms) -> 100 ms; recommended no lower than the floor.
        assert_eq!(a.tail_ttl_ms, Some(100));
        assert_eq!(a.recommended_ttl_ms, Some(ADVICE_FLOOR_MS));
        // A 300 ms lease is below the floor but not below the tails: no
        // warning for a steady worker.
        assert!(!a.ttl_below(300));
        assert!(a.ttl_below(99));
    }

    #[test]
    fn a_late_renewal_counts_as_a_gap_and_a_new_grant_starts_a_new_series() {
        let mut t = RenewalTails::default();
        let (first, second) = (lease(1, "a"), lease(2, "a"));
        t.granted(&first, Millis(0), 1_000);
        assert_eq!(t.renewed(&first, Millis(1_000), 1_000), Some(1_000));
        assert_eq!(t.renewed_late(first.id, Millis(9_000)), Some(8_000));
        // Only once: the series ended.
        assert_eq!(t.renewed_late(first.id, Millis(9_500)), None);
        // The next grant, long after: no gap from the old lease.
        t.granted(&second, Millis(100_000), 1_000);
        assert_eq!(t.renewed(&second, Millis(101_000), 1_000), Some(1_000));
        let a = t.advice(&scope(), Some("a"));
        assert_eq!(a.gaps, 3);
        assert_eq!(a.late_renewals, 1);
        assert_eq!(a.gap.max_ms, 8_000.0);
    }

    #[test]
    fn holders_are_kept_apart_and_merged_per_scope() {
        let mut t = RenewalTails::default();
        steady(&mut t, "a", 1_000, 30, &[]);
        steady(&mut t, "b", 1_000, 30, &[(3, 4_000)]);
        assert_eq!(t.advice(&scope(), Some("a")).gap.max_ms, 1_000.0);
        assert_eq!(t.advice(&scope(), Some("b")).gap.max_ms, 5_000.0);
        let both = t.advice(&scope(), None);
        assert_eq!(both.gaps, 60);
        assert_eq!(both.gap.max_ms, 5_000.0);
        let other: Scope = "twin/other".parse().unwrap();
        assert_eq!(t.advice(&other, None).gaps, 0);
    }

    #[test]
    fn a_short_ttl_is_counted_every_time_and_logged_once_a_minute() {
        let mut t = RenewalTails::default();
        // Renewals every 100 ms with one 2 s pause: the tail TTL is ~6 s.
        steady(&mut t, "a", 100, 40, &[(20, 2_000)]);
        let mut short = lease(1, "a");
        short.ttl_ms = 1_000;
        let at = |ms: u64| Millis(1_000_000 + ms);
        assert!(matches!(
            t.check_ttl(&short, at(0)),
            TtlCheck::Below { log: true, .. }
        ));
        assert!(matches!(
            t.check_ttl(&short, at(WARN_EVERY_MS - 1)),
            TtlCheck::Below { log: false, .. }
        ));
        assert!(matches!(
            t.check_ttl(&short, at(WARN_EVERY_MS)),
            TtlCheck::Below { log: true, .. }
        ));
        let mut long = short.clone();
        long.ttl_ms = 60_000;
        assert_eq!(t.check_ttl(&long, at(WARN_EVERY_MS + 1)), TtlCheck::Fine);
    }

    #[test]
    fn memory_is_bounded_in_samples_and_keys() {
        let mut t = RenewalTails::default();
        steady(&mut t, "a", 10, SAMPLES_PER_KEY + 50, &[]);
        assert_eq!(t.advice(&scope(), None).gaps, SAMPLES_PER_KEY);
        for i in 0..MAX_KEYS + 10 {
            let l = lease(1_000 + i as u128, &format!("h{i}"));
            t.granted(&l, Millis(1_000_000 + i as u64), 1);
        }
        assert_eq!(t.keys.len(), MAX_KEYS);
        // The least recently seen went first: "a" (seen at ~5 s) is gone.
        assert_eq!(t.advice(&scope(), Some("a")).gaps, 0);
    }
}
