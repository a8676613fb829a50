//! The JSON form of events that writers send, over HTTP and as Kafka record
//! values (`content-type: application/json`): one event object or an array.
//!
//! `{"type": "...", "patch": {...}, "hlc": "<ntp64>/<hex id>"?, "event_id": "..."?,
//! "effects": [...]?}` (effects: HTTP only, see [`crate::effect`]).

use serde::Deserialize;

use crate::effect::Effect;
use crate::{Hlc, NewEvent};

// `expecting`: serde's messages would otherwise name this Rust type
// ("expected struct EventJson"), which means nothing to a client.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an event object {\"type\", \"patch\", \"hlc\"?, \"event_id\"?, \"effects\"?}"
)]
struct EventJson {
    #[serde(rename = "type")]
    event_type: String,
    patch: serde_json::Value,
    #[serde(default)]
    hlc: Option<String>,
    #[serde(default)]
    event_id: Option<String>,
    /// Side effects (the fenced outbox); checked by [`crate::effect`].
    #[serde(default)]
    effects: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "an event object or an array of event objects")]
enum EventsJson {
    One(EventJson),
    Many(Vec<EventJson>),
}

/// Why a JSON body is not a valid event or batch. `kind` is a stable name
/// (`bad_json`, `bad_patch`, `bad_hlc`, `bad_event`, `no_events`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct JsonEventError {
    pub kind: &'static str,
    pub message: String,
}

fn err(kind: &'static str, message: impl Into<String>) -> JsonEventError {
    JsonEventError {
        kind,
        message: message.into(),
    }
}

/// Parse a body into events. Events without an `event_id` get one from
/// `default_id(index)` (random for HTTP, derived from the record position for
/// Kafka so that a redelivered record dedupes). Effects are refused
/// (`bad_effects`): only the HTTP append takes them
/// ([`parse_events_with_effects`]).
pub fn parse_events(
    bytes: &[u8],
    default_id: impl FnMut(usize) -> String,
) -> Result<Vec<NewEvent>, JsonEventError> {
    let (events, effects) = parse_events_with_effects(bytes, default_id)?;
    if effects.iter().any(|e| !e.is_empty()) {
        return Err(err(
            "bad_effects",
            "effects are accepted by the HTTP append only (docs/outbox.md)",
        ));
    }
    Ok(events)
}

/// [`parse_events`], keeping each event's effects (empty if it declares
/// none), in the events' order. A bad `effects` value is `bad_effects`.
pub fn parse_events_with_effects(
    bytes: &[u8],
    mut default_id: impl FnMut(usize) -> String,
) -> Result<(Vec<NewEvent>, Vec<Vec<Effect>>), JsonEventError> {
    let events = match serde_json::from_slice::<EventsJson>(bytes) {
        Ok(EventsJson::One(e)) => vec![e],
        Ok(EventsJson::Many(v)) => v,
        Err(_) => {
            // Untagged enums lose the precise message; re-parse as the shape
            // the sender most likely meant to report what is wrong with it.
            let v: serde_json::Value = serde_json::from_slice(bytes)
                .map_err(|e| err("bad_json", format!("body is not valid JSON: {e}")))?;
            let detail = match v {
                serde_json::Value::Array(_) => {
                    serde_json::from_slice::<Vec<EventJson>>(bytes).err()
                }
                _ => serde_json::from_slice::<EventJson>(bytes).err(),
            };
            return Err(err(
                "bad_json",
                detail.map_or_else(
                    || "body must be an event object or an array of them".to_owned(),
                    |e| format!("not an event: {e}"),
                ),
            ));
        }
    };
    if events.is_empty() {
        return Err(err("no_events", "the batch is empty"));
    }
    let mut effects = Vec::with_capacity(events.len());
    let events = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let serde_json::Value::Object(patch) = e.patch else {
                return Err(err(
                    "bad_patch",
                    format!("event {i}: patch must be a JSON object (a merge patch)"),
                ));
            };
            let hlc = match e.hlc {
                Some(h) => Some(
                    h.parse::<Hlc>()
                        .map_err(|x| err("bad_hlc", format!("event {i}: {x}")))?,
                ),
                None => None,
            };
            let event_id = e.event_id.unwrap_or_else(|| default_id(i));
            crate::check_event_fields(&event_id, &e.event_type)
                .map_err(|x| err("bad_event", format!("event {i}: {x}")))?;
            effects.push(match &e.effects {
                None => Vec::new(),
                Some(v) => {
                    crate::effect::parse_effects(i, v).map_err(|x| err("bad_effects", x.0))?
                }
            });
            Ok(NewEvent {
                event_id,
                event_type: e.event_type,
                patch,
                hlc,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((events, effects))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(i: usize) -> String {
        format!("id{i}")
    }

    #[test]
    fn one_or_many() {
        let one = parse_events(br#"{"type":"t","patch":{"a":1}}"#, ids).unwrap();
        assert_eq!(one[0].event_id, "id0");
        let many = parse_events(
            br#"[{"type":"t","patch":{}},{"type":"u","patch":{"b":null},"event_id":"x"}]"#,
            ids,
        )
        .unwrap();
        assert_eq!(many.len(), 2);
        assert_eq!(many[1].event_id, "x");
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let kind = |b: &[u8]| parse_events(b, ids).unwrap_err().kind;
        assert_eq!(kind(b"{"), "bad_json");
        assert_eq!(kind(b"[]"), "no_events");
        assert_eq!(kind(br#"{"type":"t","patch":5}"#), "bad_patch");
        assert_eq!(kind(br#"{"type":"t","patch":{},"hlc":"x"}"#), "bad_hlc");
        assert_eq!(kind(br#"{"type":"t","patch":{},"extra":1}"#), "bad_json");
        let e = parse_events(br#"{"type":5,"patch":{}}"#, ids).unwrap_err();
        assert!(e.message.contains("invalid type"), "{e}");
        assert_eq!(kind(&[0xff, 0xfe]), "bad_json");
        assert_eq!(kind(br#"{"type":"a\u0000b","patch":{}}"#), "bad_event");
        assert_eq!(
            kind(br#"[{"type":"t","patch":{}},{"type":"t","patch":{},"event_id":"\n"}]"#),
            "bad_event"
        );
    }

    /// Effects: kept per event (aligned with the events) by the HTTP parse,
    /// refused by the plain one (Kafka records), `bad_effects` when bad.
    #[test]
    fn effects_are_parsed_beside_their_events_or_refused() {
        let body = br#"[{"type":"t","patch":{}},
            {"type":"t","patch":{},"effects":[{"kind":"webhook","url":"http://h/x","body":[1]}]}]"#;
        let (events, effects) = parse_events_with_effects(body, ids).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(effects.len(), 2);
        assert!(effects[0].is_empty());
        assert_eq!(effects[1][0].url, "http://h/x");
        assert_eq!(effects[1][0].body, "[1]");
        assert_eq!(parse_events(body, ids).unwrap_err().kind, "bad_effects");
        // An empty list is no effect at all: the plain parse takes it.
        let none = br#"{"type":"t","patch":{},"effects":[]}"#;
        assert_eq!(parse_events(none, ids).unwrap().len(), 1);
        let bad = br#"{"type":"t","patch":{},"effects":{"kind":"webhook"}}"#;
        let e = parse_events_with_effects(bad, ids).unwrap_err();
        assert_eq!(e.kind, "bad_effects");
        assert!(
            e.message.contains("event 0: effects must be an array"),
            "{e}"
        );
    }

    /// Issue 18: messages named the Rust type (`expected struct EventJson`).
    #[test]
    fn messages_name_no_rust_type() {
        for body in [
            &b"5"[..],
            b"\"x\"",
            b"[5]",
            b"[[]]",
            b"null",
            br#"{"type":"t"}"#,
            br#"[{"type":"t","patch":{}}, 7]"#,
        ] {
            let e = parse_events(body, ids).unwrap_err();
            assert_eq!(e.kind, "bad_json");
            assert!(
                !e.message.contains("EventJson") && !e.message.contains("struct"),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
        let e = parse_events(b"[5]", ids).unwrap_err();
        assert!(
            e.message.contains("expected an event object"),
            "{}",
            e.message
        );
    }
}
