//! The twin state: a last-writer-wins map from JSON paths to patch ops.
//!
//! Events reach a twin in whatever order Kafka redelivers them, so the state
//! must be a function of the *set* of events, not of their arrival order.
//! Sequential merge patch is not: `{"a":5}` then `{"a":{}}` gives `{"a":{}}`,
//! the other way round `{"a":5}`. So each patch is broken into ops at leaf
//! paths and every path keeps only facts combined with `max`, which is
//! commutative, associative and idempotent:
//!
//! - the op with the greatest `(hlc, op)` at the path (the LWW winner), and
//! - `cleared`: the greatest HLC of any `Set`/`Delete` at the path, even one
//!   that lost to a later `EnsureObject`, because those ops wiped everything
//!   below the path at that moment and `EnsureObject` does not bring it back.
//!
//! A fact is *shadowed* when a strict ancestor's `cleared` says it was wiped:
//! an op below with a smaller HLC, or a `cleared` below that is not greater.
//! Shadowed facts can never matter again (`cleared` only grows), so they are
//! dropped as soon as they are seen. Dropping them eagerly also makes the map
//! canonical, the same for every arrival order, which is what lets
//! `TwinState` derive `PartialEq` and encode to the same bytes on every
//! replica. Materializing replays the surviving ops in `(hlc, op)` order,
//! which reproduces sequential merge patch for events applied in HLC order.

use std::collections::BTreeMap;
use std::ops::Bound;

use bincode::{Decode, Encode};
use palisade_core::Hlc;
use serde_json::{Map, Value};

use crate::patch::{self, Op, PatchError, MAX_PATCH_DEPTH};

type Path = Vec<String>;

#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
struct Entry {
    hlc: Hlc,
    op: Op,
    /// Only kept while no ancestor's `cleared` is at least as large; beyond
    /// that it could never shadow anything its ancestor does not.
    cleared: Option<Hlc>,
}

impl Entry {
    /// The order in which materialization replays ops. The path breaks ties
    /// between equal-HLC ops of different events so replay stays
    /// deterministic even then.
    fn replay_key<'a>(&'a self, path: &'a [String]) -> (Hlc, &'a Op, &'a [String]) {
        (self.hlc, &self.op, path)
    }
}

/// A twin's state: the result of applying a set of HLC-stamped JSON merge
/// patches (RFC 7396), independent of the order they were applied in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Encode, Decode)]
pub struct TwinState {
    /// A `BTreeMap` so the encoding is deterministic, and so a path's
    /// descendants sit in one contiguous range right after it.
    entries: BTreeMap<Path, Entry>,
}

impl TwinState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply one event's merge patch stamped with `hlc`.
    ///
    /// A refused patch leaves the state untouched.
    pub fn apply(&mut self, patch: &Map<String, Value>, hlc: Hlc) -> Result<(), PatchError> {
        Self::validate(patch)?;
        for (path, op) in patch::decompose(patch) {
            let cleared = op.clears().then_some(hlc);
            self.insert(&path, hlc, op, cleared);
        }
        Ok(())
    }

    /// Check a patch without applying it (the store validates before it
    /// appends, so a stored event always applies).
    pub fn validate(patch: &Map<String, Value>) -> Result<(), PatchError> {
        patch::validate(patch)
    }

    /// Merge all entries of another state, as if its events had been applied
    /// here too. Commutative, associative and idempotent.
    pub fn merge(&mut self, other: &TwinState) {
        for (path, entry) in &other.entries {
            self.insert(path, entry.hlc, entry.op.clone(), entry.cleared);
        }
    }

    /// The materialized JSON object.
    pub fn to_json(&self) -> Value {
        let mut root = Map::new();
        for (path, entry) in self.replay_order() {
            write(&mut root, path, &entry.op);
        }
        Value::Object(root)
    }

    /// For each leaf visible in [`to_json`](Self::to_json) that an op wrote
    /// (a scalar, an array or an object made by `{}`), its JSON Pointer
    /// (RFC 6901) and the HLC of the event that wrote it.
    ///
    /// Objects that exist only because something was written below them are
    /// not listed; their members are.
    pub fn field_hlcs(&self) -> BTreeMap<String, Hlc> {
        let order = self.replay_order();
        let rank: BTreeMap<&[String], usize> = order
            .iter()
            .enumerate()
            .map(|(i, (path, _))| (path.as_slice(), i))
            .collect();
        let mut out = BTreeMap::new();
        for (i, (path, entry)) in order.iter().enumerate() {
            // Only a later Set/Delete above can hide a leaf: a later `{}`
            // above finds an object already there (this op made it one) and
            // keeps its members.
            let wiped_from_above = (0..path.len()).any(|n| {
                rank.get(&path[..n])
                    .is_some_and(|&r| r > i && order.get(r).is_some_and(|(_, e)| e.op.clears()))
            });
            let visible = match entry.op {
                Op::Delete => false,
                Op::EnsureObject => !wiped_from_above,
                // A later op below a scalar replaces it with an object on its
                // way down.
                Op::Set(_) => {
                    !wiped_from_above
                        && !rank
                            .range::<[String], _>((
                                Bound::Excluded(path.as_slice()),
                                Bound::Unbounded,
                            ))
                            .take_while(|(below, _)| below.starts_with(path))
                            .any(|(_, &r)| r > i)
                }
            };
            if visible {
                out.insert(pointer(path), entry.hlc);
            }
        }
        out
    }

    /// Greatest HLC of any entry (including tombstones), `None` if empty.
    ///
    /// Shadowed ops that were dropped had smaller HLCs than the op that
    /// shadowed them, so this is also the greatest HLC of every event that
    /// changed anything. A patch `{}` records nothing, so its HLC is not seen.
    pub fn max_hlc(&self) -> Option<Hlc> {
        self.entries.values().map(|e| e.hlc).max()
    }

    /// No entries at all. A state holding only tombstones is not empty, even
    /// though it materializes to `{}`.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Add the facts "op at `path` with `hlc`" and "`path` was cleared at
    /// `cleared`", keeping the map canonical.
    fn insert(&mut self, path: &[String], hlc: Hlc, op: Op, cleared: Option<Hlc>) {
        let shadow = self.shadow(path);
        if shadow.is_some_and(|s| s > hlc) {
            // Also drops `cleared`: it is never above the op's own HLC.
            return;
        }
        let cleared = cleared.filter(|c| shadow.is_none_or(|s| *c > s));
        let raised = match self.entries.get_mut(path) {
            None => {
                self.entries
                    .insert(path.to_vec(), Entry { hlc, op, cleared });
                cleared
            }
            Some(entry) => {
                if (hlc, &op) > (entry.hlc, &entry.op) {
                    entry.hlc = hlc;
                    entry.op = op;
                }
                if cleared > entry.cleared {
                    entry.cleared = cleared;
                    cleared
                } else {
                    None
                }
            }
        };
        if let Some(c) = raised {
            self.shadow_below(path, c);
        }
    }

    /// Drop what a clear at `path` with HLC `c` shadows below it.
    fn shadow_below(&mut self, path: &[String], c: Hlc) {
        let mut dead = Vec::new();
        let below = self
            .entries
            .range_mut::<[String], _>((Bound::Excluded(path), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(path));
        for (k, entry) in below {
            if entry.hlc < c {
                dead.push(k.clone());
            } else if entry.cleared.is_some_and(|own| own <= c) {
                entry.cleared = None;
            }
        }
        for k in dead {
            self.entries.remove(&k);
        }
    }

    /// The greatest `cleared` of any strict ancestor of `path`.
    fn shadow(&self, path: &[String]) -> Option<Hlc> {
        (0..path.len())
            .filter_map(|n| self.entries.get(&path[..n]))
            .filter_map(|e| e.cleared)
            .max()
    }

    /// Entries that are not shadowed, in replay order. `insert` never keeps
    /// shadowed entries, but this does not rely on it, so a state decoded
    /// from bytes written by another version still materializes correctly.
    fn replay_order(&self) -> Vec<(&Path, &Entry)> {
        let mut live: Vec<(&Path, &Entry)> = self
            .entries
            .iter()
            .filter(|(path, entry)| self.shadow(path).is_none_or(|s| s <= entry.hlc))
            .collect();
        live.sort_by(|(pa, a), (pb, b)| a.replay_key(pa).cmp(&b.replay_key(pb)));
        live
    }
}

/// Apply one op to the materialized document, the way merge patch would:
/// every op first makes its ancestors objects (merge patch replaces a
/// non-object target with `{}` before recursing into it; this includes a
/// `null` member, which is why `{"a":{"b":null}}` leaves `{"a":{}}`).
fn write(root: &mut Map<String, Value>, path: &[String], op: &Op) {
    // Paths longer than a valid patch can make only come from damaged bytes;
    // skipping them keeps the output shallow enough to drop and serialize.
    if path.len() > MAX_PATCH_DEPTH {
        return;
    }
    let Some((leaf, parents)) = path.split_last() else {
        return;
    };
    let value = match op {
        // Text we wrote always parses; damaged text is skipped, not a panic.
        Op::Set(text) => match serde_json::from_str::<Value>(text) {
            Ok(v) => Some(v),
            Err(_) => return,
        },
        Op::Delete | Op::EnsureObject => None,
    };
    let Some(parent) = parent_object(root, parents) else {
        return;
    };
    match op {
        Op::Set(_) => {
            if let Some(v) = value {
                parent.insert(leaf.clone(), v);
            }
        }
        Op::Delete => {
            parent.remove(leaf);
        }
        Op::EnsureObject => {
            let slot = parent
                .entry(leaf.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            if !slot.is_object() {
                *slot = Value::Object(Map::new());
            }
        }
    }
}

/// Walk down `keys`, creating objects and replacing non-objects with `{}`.
/// Always `Some`; the `Option` only avoids an unreachable panic path.
fn parent_object<'a>(
    mut map: &'a mut Map<String, Value>,
    keys: &[String],
) -> Option<&'a mut Map<String, Value>> {
    for key in keys {
        let slot = map
            .entry(key.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if !slot.is_object() {
            *slot = Value::Object(Map::new());
        }
        map = slot.as_object_mut()?;
    }
    Some(map)
}

/// RFC 6901 JSON Pointer for `path`.
fn pointer(path: &[String]) -> String {
    let mut out = String::new();
    for key in path {
        out.push('/');
        out.push_str(&key.replace('~', "~0").replace('/', "~1"));
    }
    out
}

#[cfg(test)]
mod tests;
