//! Turning one merge patch into independent per-path operations.

use bincode::{Decode, Encode};
use serde_json::{Map, Value};

/// Deepest container nesting a patch may have, counting the patch object
/// itself as level 1 and every nested object or array as one more level.
///
/// Bounding it keeps every recursion over patches and materialized state
/// shallow (no stack overflow on hostile input) and keeps stored leaf values
/// well under serde_json's own parse limit, so they always read back.
pub const MAX_PATCH_DEPTH: usize = 32;

/// Why a patch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    #[error("patch nests deeper than {max} levels")]
    TooDeep { max: usize },
}

/// What one patch does at one path. The derived order is only a tie-break
/// between operations with equal HLCs; any fixed total order would converge.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Encode, Decode)]
pub(crate) enum Op {
    /// Replace the value with a scalar or array, kept as compact JSON text
    /// because bincode cannot carry a self-describing `serde_json::Value`.
    Set(String),
    /// Remove the member; kept as a tombstone so that an older `Set` arriving
    /// late still loses to it.
    Delete,
    /// `{}` in a patch: make the member an object, keeping its members if it
    /// already is one.
    EnsureObject,
}

impl Op {
    /// Whether applying the op discards everything that was below its path.
    /// `EnsureObject` keeps an existing object's members, so it does not.
    pub(crate) fn clears(&self) -> bool {
        matches!(self, Op::Set(_) | Op::Delete)
    }
}

pub(crate) fn validate(patch: &Map<String, Value>) -> Result<(), PatchError> {
    let room = MAX_PATCH_DEPTH - 1;
    if patch.values().all(|v| fits(v, room)) {
        Ok(())
    } else {
        Err(PatchError::TooDeep {
            max: MAX_PATCH_DEPTH,
        })
    }
}

/// `room` is how many container levels may still open at `value`. The
/// recursion stops as soon as it runs out, so its depth is bounded by
/// `MAX_PATCH_DEPTH` whatever the input.
fn fits(value: &Value, room: usize) -> bool {
    match value {
        Value::Object(m) => room > 0 && m.values().all(|v| fits(v, room - 1)),
        Value::Array(a) => room > 0 && a.iter().all(|v| fits(v, room - 1)),
        _ => true,
    }
}

/// The ops of a validated patch. Their paths are prefix-free (a patch value
/// is either a leaf or an object to recurse into, never both), so they
/// commute with each other.
pub(crate) fn decompose(patch: &Map<String, Value>) -> Vec<(Vec<String>, Op)> {
    let mut out = Vec::new();
    walk(patch, &mut Vec::new(), &mut out);
    out
}

fn walk(patch: &Map<String, Value>, path: &mut Vec<String>, out: &mut Vec<(Vec<String>, Op)>) {
    for (key, value) in patch {
        path.push(key.clone());
        match value {
            Value::Null => out.push((path.clone(), Op::Delete)),
            Value::Object(m) if m.is_empty() => out.push((path.clone(), Op::EnsureObject)),
            Value::Object(m) => walk(m, path, out),
            // Arrays are leaves: merge patch replaces them wholesale.
            leaf => out.push((path.clone(), Op::Set(leaf.to_string()))),
        }
        path.pop();
    }
}
