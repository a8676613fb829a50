//! Device-shadow view of a twin document: a state with `desired` and
//! `reported` sections gets a computed `delta`, the desired fields whose
//! value differs from (or is missing in) the reported section.

use serde_json::{Map, Value};

/// The delta of a twin's state, if its state has a `desired` object:
/// every leaf of `desired` whose value is not equal to the same path in
/// `reported`. Nested objects are compared member by member; arrays and
/// scalars as whole values. `None` when there is no `desired` section or
/// nothing differs.
pub fn delta(state: &Value) -> Option<Value> {
    let desired = state.get("desired")?.as_object()?;
    let reported = state.get("reported").and_then(Value::as_object);
    diff(desired, reported).map(Value::Object)
}

fn diff(
    desired: &Map<String, Value>,
    reported: Option<&Map<String, Value>>,
) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    for (k, want) in desired {
        let have = reported.and_then(|r| r.get(k));
        match (want, have) {
            (Value::Object(w), Some(Value::Object(h))) => {
                if let Some(d) = diff(w, Some(h)) {
                    out.insert(k.clone(), Value::Object(d));
                }
            }
            (Value::Object(w), _) => {
                if let Some(d) = diff(w, None) {
                    out.insert(k.clone(), Value::Object(d));
                }
            }
            (w, Some(h)) if w == h => {}
            (w, _) => {
                out.insert(k.clone(), w.clone());
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn delta_lists_desired_fields_not_yet_reported() {
        let s = json!({
            "desired": { "fan": "on", "setpoint": { "temp": 21, "mode": "eco" }, "zones": [1, 2] },
            "reported": { "fan": "on", "setpoint": { "temp": 19, "mode": "eco" }, "zones": [1] },
        });
        assert_eq!(
            delta(&s),
            Some(json!({ "setpoint": { "temp": 21 }, "zones": [1, 2] }))
        );
    }

    #[test]
    fn no_delta_when_in_sync_or_no_desired_section() {
        assert_eq!(
            delta(&json!({ "desired": { "a": 1 }, "reported": { "a": 1, "b": 2 } })),
            None
        );
        assert_eq!(delta(&json!({ "reported": { "a": 1 } })), None);
        assert_eq!(delta(&json!({ "desired": 5 })), None);
        assert_eq!(
            delta(&json!({ "desired": { "a": { "b": 1 } } })),
            Some(json!({ "a": { "b": 1 } }))
        );
        assert_eq!(
            delta(&json!({ "desired": { "a": { "b": 1 } }, "reported": { "a": 3 } })),
            Some(json!({ "a": { "b": 1 } }))
        );
    }
}
