//! Twin state for Palisade: a last-writer-wins map over JSON leaf paths,
//! ordered by HLC, that materializes to the twin's JSON document.
//!
//! Each event carries a JSON merge patch (RFC 7396) and an HLC. Applying the
//! same set of events in any order gives the same [`TwinState`] (equal values,
//! identical bytes, identical JSON); applying them in HLC order gives exactly
//! what sequential merge patch would. That lets the store apply late and
//! redelivered events as they come, and combine a snapshot with later events
//! by [`TwinState::merge`].
//!
//! ```
//! use palisade_core::Hlc;
//! use palisade_twin::TwinState;
//! use serde_json::{json, Map, Value};
//!
//! fn patch(v: Value) -> Map<String, Value> {
//!     v.as_object().cloned().unwrap_or_default()
//! }
//! let at = |time| Hlc { time, id: [1; 16] };
//!
//! // The later event arrives first; the earlier one still loses where they overlap.
//! let mut state = TwinState::new();
//! state.apply(&patch(json!({"temp": 21, "door": {"open": true}})), at(2))?;
//! state.apply(&patch(json!({"temp": 19, "fan": "on", "door": null})), at(1))?;
//! assert_eq!(
//!     state.to_json(),
//!     json!({"temp": 21, "fan": "on", "door": {"open": true}})
//! );
//!
//! // The same events in HLC order converge on the same state.
//! let mut in_order = TwinState::new();
//! in_order.apply(&patch(json!({"temp": 19, "fan": "on", "door": null})), at(1))?;
//! in_order.apply(&patch(json!({"temp": 21, "door": {"open": true}})), at(2))?;
//! assert_eq!(in_order, state);
//! assert_eq!(state.field_hlcs()["/door/open"], at(2));
//! # Ok::<(), palisade_twin::PatchError>(())
//! ```

mod patch;
mod shadow;
mod state;

pub use patch::{PatchError, MAX_PATCH_DEPTH};
pub use shadow::delta;
pub use state::TwinState;
