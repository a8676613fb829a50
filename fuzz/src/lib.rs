//! The bodies of the fuzz targets, shared by the cargo-fuzz binaries
//! (`fuzz_targets/*.rs`, nightly + libFuzzer) and by the main package's
//! corpus replay test (`tests/fuzz_corpus.rs`, stable), which includes this
//! file with `#[path]` and runs every file of `corpus/<target>/` through it.
//!
//! Each function must not panic on any input; where a decoder accepts an
//! input, it also checks what must then hold (a round trip, the invariants
//! the callers rely on). A panic is a finding. Each returns whether the
//! decoder accepted the input (the replay test checks the seeds do reach
//! the accepting paths).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, dead_code)]

use palisade_core::{codec, json, partition_for, Event, NewEvent, TwinId};
use palisade_kafka::decode::{decode, decode_with_effects, RawRecord};

/// The on-disk codec: `codec::decode::<Event>` on arbitrary bytes. An
/// accepted value re-encodes to bytes that decode to the same value.
pub fn codec_event(data: &[u8]) -> bool {
    let Ok(event) = codec::decode::<Event>(data) else {
        return false;
    };
    let again = codec::encode(&event);
    let back = codec::decode::<Event>(&again).expect("a re-encoded event decodes");
    assert_eq!(back, event, "codec round trip");
    true
}

/// The HTTP append body (also the Kafka JSON value): `json::parse_events`.
/// An accepted body has at least one event, each with an object patch, and
/// writing the events back as JSON parses to the same ids, types and HLCs.
pub fn http_events_json(data: &[u8]) -> bool {
    let Ok(events) = json::parse_events(data, |i| format!("default-{i}")) else {
        return false;
    };
    assert!(!events.is_empty(), "an accepted batch is never empty");
    let wire: Vec<serde_json::Value> = events.iter().map(to_wire).collect();
    // Same shape as far as nesting goes (one event: an object), so a body
    // at serde_json's depth limit stays within it.
    let body = if wire.len() == 1 {
        serde_json::to_vec(&wire[0])
    } else {
        serde_json::to_vec(&wire)
    }
    .expect("serialize events");
    let again = json::parse_events(&body, |i| panic!("event {i} lost its id"))
        .expect("re-encoded events parse");
    assert_eq!(again.len(), events.len());
    for (a, b) in again.iter().zip(&events) {
        assert_eq!(
            (&a.event_id, &a.event_type, a.hlc, a.patch.len()),
            (&b.event_id, &b.event_type, b.hlc, b.patch.len()),
            "JSON round trip"
        );
    }
    true
}

fn to_wire(e: &NewEvent) -> serde_json::Value {
    let mut v = serde_json::json!({
        "type": e.event_type,
        "patch": e.patch,
        "event_id": e.event_id,
    });
    if let Some(h) = e.hlc {
        v["hlc"] = serde_json::Value::String(h.to_string());
    }
    v
}

/// Input bytes, consumed front to back; short input gives short fields.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// A Kafka record built from the input, then `palisade_kafka::decode`.
///
/// Layout (see `README.md`): `flags, partitions-1, partition, offset,
/// max-value, key-len, key, value-len (u16 LE), value`, then headers
/// `name-len, name, has-value, value-len, value` to the end. Flags: bit 0
/// key present, bit 1 value present, bit 2 put the record in its twin's
/// partition (murmur2, as a producer would) instead of the partition byte,
/// bit 3 decode without strict partitioning (any partition is accepted).
pub fn kafka_record(data: &[u8]) -> bool {
    let mut b = Bytes(data);
    let flags = b.byte();
    let partitions = u32::from(b.byte() % 64) + 1;
    let partition_byte = b.byte();
    let offset = i64::from(b.byte());
    let max_value_bytes = match b.byte() {
        0 => 1 << 20,
        m => usize::from(m) * 4,
    };
    let key_len = usize::from(b.byte());
    let key = b.take(key_len);
    let value_len = usize::from(u16::from_le_bytes([b.byte(), b.byte()]));
    let value = b.take(value_len);
    let mut headers: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    while !b.0.is_empty() {
        let name_len = usize::from(b.byte() % 32);
        let name = String::from_utf8_lossy(b.take(name_len)).into_owned();
        let has_value = b.byte() & 1 == 1;
        let len = usize::from(b.byte());
        let v = b.take(len).to_vec();
        headers.push((name, has_value.then_some(v)));
    }
    let twin = std::str::from_utf8(key)
        .ok()
        .and_then(|k| TwinId::new(k).ok());
    let partition = match (&twin, flags & 4 != 0) {
        (Some(t), true) => i32::try_from(partition_for(t, partitions).0).unwrap(),
        _ => i32::from(partition_byte as i8),
    };
    let header_refs: Vec<(&str, Option<&[u8]>)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_deref()))
        .collect();
    let raw = RawRecord {
        partition,
        offset,
        key: (flags & 1 != 0).then_some(key),
        value: (flags & 2 != 0).then_some(value),
        headers: &header_refs,
    };
    // Strict partitioning unless bit 3 is set (records routed by key).
    let strict = (flags & 8 == 0).then_some(partitions);
    // The cluster nodes' decoder (effects kept) agrees with the workers'
    // one: the same record unless effects are declared, which only it
    // accepts (decision 0035).
    let with_effects = decode_with_effects(&raw, strict, max_value_bytes);
    if let Ok(w) = &with_effects {
        assert!(
            w.effects.is_empty() || w.effects.len() == w.events.len(),
            "effects are aligned with events"
        );
    }
    let Ok(d) = decode(&raw, strict, max_value_bytes) else {
        if let Ok(w) = with_effects {
            assert!(
                w.effects.iter().any(|e| !e.is_empty()),
                "only effects make the workers' decoder refuse what the nodes' accepts"
            );
        }
        return false;
    };
    assert_eq!(
        with_effects.as_ref().ok(),
        Some(&d),
        "without effects both decoders agree"
    );
    assert!(!d.events.is_empty(), "a decoded record has events");
    assert_eq!(Some(&d.twin), twin.as_ref(), "the twin is the key");
    if strict.is_some() {
        assert_eq!(
            i64::from(partition_for(&d.twin, partitions).0),
            i64::from(partition),
            "in strict mode a decoded record is in its twin's partition"
        );
    }
    assert!(
        header_refs
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("fencing-token"))
            .count()
            == 1,
        "exactly one fencing-token header"
    );
    assert!(value.len() <= max_value_bytes, "the size limit holds");
    true
}
