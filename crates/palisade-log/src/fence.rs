//! The fence: the one place where a write is admitted or refused by its
//! token, and where grants and admitted writes raise the marks (invariant 2
//! of `docs/architecture.md`). Pure functions of the marks and the token; the
//! partition state machine (`writer.rs`) calls them for HTTP appends, Kafka
//! records, lease grants (embedded and remote) and cluster owner markers
//! alike, and stages what they return in the same commit round as the data
//! they admit.
//!
//! A write with token `t` on twin `k` of partition `p` is admitted iff
//! `t >= fence(k)` and `t >= fence(p)`: `>=`, because a holder writes many
//! times under one grant. Tokens come from one counter, so this reads: a
//! write is refused iff a grant covering its twin, issued after the writer's
//! own, has been seen. Marks only ever rise.
//!
//! In cluster mode a second, independent mark orders the partition's owners:
//! records produced by a node under owner token `o` are admitted iff
//! `o >= owner_fence(p)`.

use palisade_core::FencingToken;

/// The marks a write to one twin is checked against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fences {
    /// fence(k): the highest token accepted for the twin or granted on a
    /// twin-scoped lease for it.
    pub twin: u64,
    /// fence(p): the highest token granted on a partition-scoped lease for
    /// the twin's partition or accepted from such a lease's holder.
    pub partition: u64,
}

/// A refused token and the mark it is below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    pub token: FencingToken,
    pub fence: FencingToken,
}

/// What a grant or an admitted write covers, so which marks it raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// A twin-scoped lease (or a write under one): fence(k) only.
    Twin,
    /// A partition-scoped lease (or a write under one): fence(p), and for a
    /// write also fence(k) of the twin written.
    Partition,
}

impl Fences {
    /// The mark a token must reach: the greater of the two.
    pub fn mark(self) -> u64 {
        self.twin.max(self.partition)
    }
}

/// Admit a write under `token`, or say which mark it is below.
pub fn admit(fences: Fences, token: FencingToken) -> Result<(), Stale> {
    let mark = fences.mark();
    if token.0 < mark {
        Err(Stale {
            token,
            fence: FencingToken(mark),
        })
    } else {
        Ok(())
    }
}

/// The marks after a write under `token` was admitted: fence(k) rises to
/// it, and fence(p) too for a partition-scoped token. Never lowers a mark.
pub fn raise_by_write(fences: Fences, token: FencingToken, reach: Reach) -> Fences {
    Fences {
        twin: fences.twin.max(token.0),
        partition: match reach {
            Reach::Partition => fences.partition.max(token.0),
            Reach::Twin => fences.partition,
        },
    }
}

/// A mark after a grant of `token` on the scope it guards: it rises to the
/// token at once (before the new holder's first write), so a paused former
/// holder is refused as soon as the grant is durable. Never lowers it.
pub fn raise_by_grant(mark: u64, token: FencingToken) -> u64 {
    mark.max(token.0)
}

/// Cluster mode: admit a record produced under owner token `owner`.
pub fn admit_owner(owner_fence: u64, owner: u64) -> Result<(), Stale> {
    if owner < owner_fence {
        Err(Stale {
            token: FencingToken(owner),
            fence: FencingToken(owner_fence),
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_tokens_are_admitted_lower_ones_refused() {
        let f = Fences {
            twin: 5,
            partition: 3,
        };
        assert!(admit(f, FencingToken(5)).is_ok());
        assert!(admit(f, FencingToken(9)).is_ok());
        assert_eq!(
            admit(f, FencingToken(4)),
            Err(Stale {
                token: FencingToken(4),
                fence: FencingToken(5)
            })
        );
        // The partition mark counts as much as the twin's.
        let f = Fences {
            twin: 1,
            partition: 7,
        };
        assert_eq!(
            admit(f, FencingToken(6)).unwrap_err().fence,
            FencingToken(7)
        );
    }

    #[test]
    fn a_twin_token_does_not_raise_the_partition_mark() {
        let f = raise_by_write(Fences::default(), FencingToken(4), Reach::Twin);
        assert_eq!(
            f,
            Fences {
                twin: 4,
                partition: 0
            }
        );
        let f = raise_by_write(f, FencingToken(6), Reach::Partition);
        assert_eq!(
            f,
            Fences {
                twin: 6,
                partition: 6
            }
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// A grant on the twin (`true`) or its partition.
        Grant(bool),
        /// A write by the holder of the grant with this index (mod grants).
        Write(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            any::<bool>().prop_map(Step::Grant),
            any::<usize>().prop_map(Step::Write)
        ]
    }

    proptest! {
        /// Against the model of invariant 2: tokens come from one counter; a
        /// write is refused iff a grant covering its twin issued after the
        /// writer's own has been seen. Marks never go down.
        #[test]
        fn matches_the_model(steps in proptest::collection::vec(step(), 1..60)) {
            let mut fences = Fences::default();
            let mut grants: Vec<(u64, Reach)> = Vec::new();
            let mut counter = 0;
            for s in steps {
                let before = fences;
                match s {
                    Step::Grant(twin) => {
                        counter += 1;
                        let reach = if twin { Reach::Twin } else { Reach::Partition };
                        match reach {
                            Reach::Twin => fences.twin = raise_by_grant(fences.twin, FencingToken(counter)),
                            Reach::Partition => fences.partition = raise_by_grant(fences.partition, FencingToken(counter)),
                        }
                        grants.push((counter, reach));
                    }
                    Step::Write(i) if !grants.is_empty() => {
                        let (token, reach) = grants[i % grants.len()];
                        // Every grant covers the one twin here, so "a later
                        // grant was seen" is "the counter moved past token".
                        let later_seen = grants.iter().any(|(t, _)| *t > token);
                        let r = admit(fences, FencingToken(token));
                        prop_assert_eq!(r.is_err(), later_seen);
                        if r.is_ok() {
                            fences = raise_by_write(fences, FencingToken(token), reach);
                        }
                    }
                    Step::Write(_) => {}
                }
                prop_assert!(fences.twin >= before.twin && fences.partition >= before.partition);
            }
        }

        #[test]
        fn owner_marks_admit_at_or_above(fence in 0u64..100, owner in 0u64..100) {
            prop_assert_eq!(admit_owner(fence, owner).is_ok(), owner >= fence);
        }
    }
}
