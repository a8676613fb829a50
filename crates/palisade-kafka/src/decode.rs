//! Turning a Kafka record into an append, or into the reason it cannot be
//! one. Pure: no client, no store, so it is unit-tested and fuzzed directly.
//!
//! The wire contract (`docs/kafka.md`): key = twin id (UTF-8); exactly one
//! header `fencing-token` = decimal ASCII token; optional header `hlc` (uhlc
//! text); header `content-type` = `application/x-protobuf` (default,
//! `palisade.v1.TwinEvent`) or `application/json` (the HTTP body: one event
//! or an array). The record may be in any partition of the topic (the store
//! routes it by key) unless the ingester runs in strict mode.

use palisade_core::effect::Effect;
use palisade_core::json::parse_events_with_effects;
use palisade_core::{partition_for, FencingToken, Hlc, NewEvent, TwinId};
use prost::Message;

use crate::proto::TwinEvent;

/// Header carrying the writer's fencing token, decimal ASCII.
pub const TOKEN_HEADER: &str = "fencing-token";
/// Optional header with the writer's HLC for events that carry none.
pub const HLC_HEADER: &str = "hlc";
pub const CONTENT_TYPE_HEADER: &str = "content-type";
pub const PROTOBUF: &str = "application/x-protobuf";
pub const JSON: &str = "application/json";

/// The parts of a record the decoder looks at.
#[derive(Debug, Clone, Copy)]
pub struct RawRecord<'a> {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub headers: &'a [(&'a str, Option<&'a [u8]>)],
}

/// A decoded record: events for one twin under one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub twin: TwinId,
    pub token: FencingToken,
    pub events: Vec<NewEvent>,
    /// Each event's effects (the fenced outbox), aligned with `events`;
    /// empty unless decoded by [`decode_with_effects`].
    pub effects: Vec<Vec<Effect>>,
}

/// Why a record cannot be applied. `reason` is a stable name (the dead
/// letter's `reason`), `detail` says what exactly is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct Refusal {
    pub reason: &'static str,
    pub detail: String,
}

fn refuse(reason: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        detail: detail.into(),
    }
}

fn header<'a>(raw: &RawRecord<'a>, name: &str) -> Option<Option<&'a [u8]>> {
    // The last occurrence wins, as in Kafka Streams' `lastHeader`.
    raw.headers
        .iter()
        .rev()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| *v)
}

/// Strict mode's rule: a record must be in its twin's murmur2 partition.
pub fn check_partition(twin: &TwinId, partition: i32, partitions: u32) -> Result<(), Refusal> {
    let expected = partition_for(twin, partitions);
    if i64::from(expected.0) == i64::from(partition) {
        return Ok(());
    }
    Err(refuse(
        "wrong_partition",
        format!(
            "twin {twin:?} belongs to partition {expected} (murmur2, as Kafka's Java client) but the record is in partition {partition}; strict partitioning is on (--kafka-strict-partitioning): produce with partitioner=murmur2_random, or turn it off to have records routed by key"
        ),
    ))
}

/// Decode a record. Records larger than `max_value_bytes` are refused
/// before any parsing. With `strict_partitions` (strict mode: a topic of
/// that many partitions, each feeding the store partition of the same
/// number), a record outside its twin's murmur2 partition is refused
/// (`wrong_partition`); without it, a record may arrive in any partition.
pub fn decode(
    raw: &RawRecord<'_>,
    strict_partitions: Option<u32>,
    max_value_bytes: usize,
) -> Result<Decoded, Refusal> {
    decode_inner(raw, strict_partitions, max_value_bytes, false)
}

/// [`decode`], keeping the effects a JSON record's events declare (`bad_effects`
/// if malformed). Only for the records cluster nodes produce for HTTP
/// appends (`palisade-owner-token`): a worker's record with effects is
/// refused (`docs/outbox.md`).
pub fn decode_with_effects(
    raw: &RawRecord<'_>,
    strict_partitions: Option<u32>,
    max_value_bytes: usize,
) -> Result<Decoded, Refusal> {
    decode_inner(raw, strict_partitions, max_value_bytes, true)
}

fn decode_inner(
    raw: &RawRecord<'_>,
    strict_partitions: Option<u32>,
    max_value_bytes: usize,
    with_effects: bool,
) -> Result<Decoded, Refusal> {
    let key = raw.key.filter(|k| !k.is_empty()).ok_or_else(|| {
        refuse(
            "missing_key",
            "the record has no key; the key must be the twin id",
        )
    })?;
    let key =
        std::str::from_utf8(key).map_err(|_| refuse("bad_key", "the record key is not UTF-8"))?;
    let twin = TwinId::new(key).map_err(|e| refuse("bad_key", e.to_string()))?;
    if let Some(partitions) = strict_partitions {
        check_partition(&twin, raw.partition, partitions)?;
    }
    let tokens = raw
        .headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(TOKEN_HEADER))
        .count();
    if tokens > 1 {
        // Which one the writer meant is a guess either way (HTTP refuses
        // two Fencing-Token headers too); a producer bug, not a stale write.
        return Err(refuse(
            "bad_token",
            format!("the record has {tokens} fencing-token headers; exactly one is allowed"),
        ));
    }
    let token = match header(raw, TOKEN_HEADER) {
        None | Some(None) => return Err(refuse("missing_token", "no fencing-token header")),
        Some(Some(v)) => {
            let text = std::str::from_utf8(v)
                .map_err(|_| refuse("bad_token", "fencing-token is not ASCII"))?
                .trim();
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(refuse(
                    "bad_token",
                    format!("fencing-token must be a non-negative decimal number, got {text:?}"),
                ));
            }
            FencingToken(text.parse().map_err(|_| {
                refuse(
                    "bad_token",
                    format!("fencing-token {text} does not fit in 64 bits"),
                )
            })?)
        }
    };
    let header_hlc = match header(raw, HLC_HEADER) {
        None | Some(None) => None,
        Some(Some(v)) => Some(
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<Hlc>().ok())
                .ok_or_else(|| {
                    refuse("bad_hlc", "the hlc header is not `<ntp64 time>/<hex id>`")
                })?,
        ),
    };
    let value = raw
        .value
        .ok_or_else(|| refuse("missing_value", "the record has no value"))?;
    if value.len() > max_value_bytes {
        return Err(refuse(
            "too_large",
            format!(
                "value is {} bytes; the limit is {max_value_bytes}",
                value.len()
            ),
        ));
    }
    // Events without an id get one from the record's position, so a
    // redelivered record dedupes even if its offset was not stored.
    let (p, o) = (raw.partition, raw.offset);
    let default_id = |i: usize| format!("kafka-{p}-{o}-{i}");
    let content_type = match header(raw, CONTENT_TYPE_HEADER) {
        None | Some(None) => PROTOBUF,
        Some(Some(v)) => std::str::from_utf8(v)
            .map_err(|_| refuse("bad_content_type", "content-type is not ASCII"))?
            .trim(),
    };
    let mut effects = Vec::new();
    let mut events = if content_type.eq_ignore_ascii_case(PROTOBUF) {
        let ev = TwinEvent::decode(value)
            .map_err(|e| refuse("bad_value", format!("not a palisade.v1.TwinEvent: {e}")))?;
        let patch = match serde_json::from_str::<serde_json::Value>(&ev.patch_json) {
            Ok(serde_json::Value::Object(m)) => m,
            Ok(_) => {
                return Err(refuse(
                    "bad_patch",
                    "patch_json must be a JSON object (a merge patch)",
                ))
            }
            Err(e) => return Err(refuse("bad_patch", format!("patch_json is not JSON: {e}"))),
        };
        let hlc = if ev.hlc.is_empty() {
            None
        } else {
            Some(
                ev.hlc
                    .parse::<Hlc>()
                    .map_err(|e| refuse("bad_hlc", e.to_string()))?,
            )
        };
        vec![NewEvent {
            event_id: if ev.event_id.is_empty() {
                default_id(0)
            } else {
                ev.event_id
            },
            event_type: ev.r#type,
            patch,
            hlc,
        }]
    } else if content_type.eq_ignore_ascii_case(JSON)
        || content_type
            .to_ascii_lowercase()
            .starts_with("application/json;")
    {
        let (events, declared) =
            parse_events_with_effects(value, default_id).map_err(|e| Refusal {
                reason: e.kind,
                detail: e.message,
            })?;
        if declared.iter().any(|e| !e.is_empty()) {
            if !with_effects {
                return Err(refuse(
                    "bad_effects",
                    "effects are accepted by the HTTP append only (docs/outbox.md)",
                ));
            }
            effects = declared;
        }
        events
    } else {
        return Err(refuse(
            "bad_content_type",
            format!("content-type {content_type:?} is not {PROTOBUF} or {JSON}"),
        ));
    };
    if let Some(h) = header_hlc {
        for e in events.iter_mut().filter(|e| e.hlc.is_none()) {
            e.hlc = Some(h);
        }
    }
    Ok(Decoded {
        twin,
        token,
        events,
        effects,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u32 = 4;

    fn key_in(p: i32) -> String {
        (0..)
            .map(|i| format!("twin-{i}"))
            .find(|k| partition_for(&TwinId::new(k.clone()).unwrap(), N).0 as i32 == p)
            .unwrap()
    }

    fn proto(patch: &str) -> Vec<u8> {
        TwinEvent {
            event_id: "e1".into(),
            r#type: "set".into(),
            patch_json: patch.into(),
            hlc: String::new(),
        }
        .encode_to_vec()
    }

    fn raw<'a>(
        key: Option<&'a [u8]>,
        value: Option<&'a [u8]>,
        headers: &'a [(&'a str, Option<&'a [u8]>)],
    ) -> RawRecord<'a> {
        RawRecord {
            partition: 1,
            offset: 7,
            key,
            value,
            headers,
        }
    }

    #[test]
    fn protobuf_and_json_records_decode() {
        let k = key_in(1);
        let v = proto(r#"{"rpm":5}"#);
        let h = [("fencing-token", Some(&b"34"[..]))];
        let d = decode(&raw(Some(k.as_bytes()), Some(&v), &h), Some(N), 1 << 20).unwrap();
        assert_eq!(d.token, FencingToken(34));
        assert_eq!(d.events[0].event_id, "e1");
        assert_eq!(d.events[0].patch["rpm"], 5);

        let j = br#"[{"type":"a","patch":{"x":1}},{"type":"b","patch":{}}]"#;
        let h = [
            ("fencing-token", Some(&b" 9 "[..])),
            ("content-type", Some(&b"application/json"[..])),
            ("hlc", Some(&b"100/1"[..])),
        ];
        let d = decode(&raw(Some(k.as_bytes()), Some(j), &h), Some(N), 1 << 20).unwrap();
        assert_eq!(d.events.len(), 2);
        assert_eq!(
            d.events[1].event_id, "kafka-1-7-1",
            "ids derive from the record position"
        );
        assert_eq!(d.events[0].hlc, Some("100/1".parse().unwrap()));
    }

    #[test]
    fn every_refusal_names_its_reason() {
        let k = key_in(1);
        let other = key_in(2);
        let v = proto(r#"{"a":1}"#);
        let tok = [("fencing-token", Some(&b"3"[..]))];
        let reason =
            |key: Option<&[u8]>, value: Option<&[u8]>, headers: &[(&str, Option<&[u8]>)]| {
                decode(&raw(key, value, headers), Some(N), 64)
                    .unwrap_err()
                    .reason
            };
        assert_eq!(reason(None, Some(&v), &tok), "missing_key");
        assert_eq!(reason(Some(b""), Some(&v), &tok), "missing_key");
        assert_eq!(reason(Some(&[0xff]), Some(&v), &tok), "bad_key");
        assert_eq!(
            reason(Some(other.as_bytes()), Some(&v), &tok),
            "wrong_partition"
        );
        for two in [
            [
                ("fencing-token", Some(&b"3"[..])),
                ("fencing-token", Some(&b"3"[..])),
            ],
            [
                ("fencing-token", Some(&b"3"[..])),
                ("Fencing-Token", Some(&b"4"[..])),
            ],
            [("fencing-token", None), ("fencing-token", Some(&b"4"[..]))],
        ] {
            let r = decode(&raw(Some(k.as_bytes()), Some(&v), &two), Some(N), 64).unwrap_err();
            assert_eq!(r.reason, "bad_token");
            assert!(r.detail.contains("2 fencing-token headers"), "{}", r.detail);
        }
        assert_eq!(reason(Some(k.as_bytes()), Some(&v), &[]), "missing_token");
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&v), &[("fencing-token", None)]),
            "missing_token"
        );
        for bad in [&b"abc"[..], b"-1", b"", b"18446744073709551616", b"1.5"] {
            assert_eq!(
                reason(
                    Some(k.as_bytes()),
                    Some(&v),
                    &[("fencing-token", Some(bad))]
                ),
                "bad_token"
            );
        }
        assert_eq!(reason(Some(k.as_bytes()), None, &tok), "missing_value");
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&[0u8; 65]), &tok),
            "too_large"
        );
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&[0xff, 0xff, 0xff]), &tok),
            "bad_value"
        );
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&proto("[1]")), &tok),
            "bad_patch"
        );
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&proto("{")), &tok),
            "bad_patch"
        );
        let ct = [
            ("fencing-token", Some(&b"3"[..])),
            ("content-type", Some(&b"text/plain"[..])),
        ];
        assert_eq!(
            reason(Some(k.as_bytes()), Some(&v), &ct),
            "bad_content_type"
        );
        let js = [
            ("fencing-token", Some(&b"3"[..])),
            ("content-type", Some(&b"application/json"[..])),
        ];
        assert_eq!(reason(Some(k.as_bytes()), Some(b"{nope"), &js), "bad_json");
        let hl = [
            ("fencing-token", Some(&b"3"[..])),
            ("hlc", Some(&b"soon"[..])),
        ];
        assert_eq!(reason(Some(k.as_bytes()), Some(&v), &hl), "bad_hlc");
    }

    #[test]
    fn effects_are_kept_only_when_asked_for() {
        let k = key_in(1);
        let j = br#"[{"type":"a","patch":{},"effects":[{"kind":"webhook","url":"http://h/x","body":1}]},{"type":"b","patch":{}}]"#;
        let h = [
            ("fencing-token", Some(&b"9"[..])),
            ("content-type", Some(&b"application/json"[..])),
        ];
        let r = raw(Some(k.as_bytes()), Some(j), &h);
        assert_eq!(
            decode(&r, Some(N), 1 << 20).unwrap_err().reason,
            "bad_effects"
        );
        let d = decode_with_effects(&r, Some(N), 1 << 20).unwrap();
        assert_eq!(d.effects.len(), 2);
        assert_eq!(d.effects[0][0].url, "http://h/x");
        assert!(d.effects[1].is_empty());
        let plain = br#"{"type":"a","patch":{}}"#;
        let r = raw(Some(k.as_bytes()), Some(plain), &h);
        assert!(decode_with_effects(&r, Some(N), 1 << 20)
            .unwrap()
            .effects
            .is_empty());
    }

    #[test]
    fn without_strict_mode_any_partition_is_accepted() {
        let other = key_in(2);
        let v = proto(r#"{"a":1}"#);
        let tok = [("fencing-token", Some(&b"3"[..]))];
        // In partition 1, its murmur2 partition is 2: routed by key.
        let d = decode(&raw(Some(other.as_bytes()), Some(&v), &tok), None, 1 << 20).unwrap();
        assert_eq!(d.twin.as_str(), other);
        let far = RawRecord {
            partition: 977,
            ..raw(Some(other.as_bytes()), Some(&v), &tok)
        };
        assert!(decode(&far, None, 1 << 20).is_ok(), "any partition number");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_records_never_panic(
            key in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..40)),
            value in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..200)),
            token in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..24)),
            json in proptest::bool::ANY,
        ) {
            let mut headers: Vec<(&str, Option<&[u8]>)> = vec![("fencing-token", token.as_deref())];
            if json {
                headers.push(("content-type", Some(b"application/json")));
            }
            let _ = decode(&RawRecord { partition: 0, offset: 0, key: key.as_deref(), value: value.as_deref(), headers: &headers }, Some(N), 1 << 20);
        }
    }
}
