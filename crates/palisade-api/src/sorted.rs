//! Bodies whose keys are sorted on the wire.
//!
//! Before the wire types existed the server built some bodies with
//! `json!`, whose objects (a `BTreeMap`: serde_json without
//! `preserve_order`) write their keys sorted. Those bytes are the contract
//! clients have seen, so the fields that were built that way still go out
//! through a `serde_json::Value`, which sorts them again.

use serde::{Serialize, Serializer};

/// Serialize `v` with every object's keys in sorted order.
pub(crate) fn serialize<T: Serialize, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    serde_json::to_value(v)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::{EventOut, EventsPage, LeaseOut, PartitionOut};
    use serde_json::json;

    fn event() -> EventOut {
        EventOut {
            seq: 7,
            twin_id: "t".into(),
            event_id: "e".into(),
            event_type: "set".into(),
            patch: json!({"b": 1, "a": 2}),
            hlc: "1/1".into(),
            writer: "w".into(),
            token: 3,
            appended_at_ms: 9,
        }
    }

    /// The bytes clients have always seen: a page's events with sorted
    /// keys (they were `json!` values), while an event alone (the SSE
    /// `data`) keeps its declared order. Fails if `EventsPage` serializes
    /// its events directly.
    #[test]
    fn pages_keep_their_sorted_keys() {
        let page = EventsPage {
            events: vec![event()],
            next_after: Some(7),
        };
        assert_eq!(
            serde_json::to_string(&page).unwrap(),
            r#"{"events":[{"appended_at_ms":9,"event_id":"e","hlc":"1/1","patch":{"a":2,"b":1},"seq":7,"token":3,"twin_id":"t","type":"set","writer":"w"}],"next_after":7}"#
        );
        assert_eq!(
            serde_json::to_string(&event()).unwrap(),
            r#"{"seq":7,"twin_id":"t","event_id":"e","type":"set","patch":{"a":2,"b":1},"hlc":"1/1","writer":"w","token":3,"appended_at_ms":9}"#
        );
    }

    /// A partition's owner, too, went out as a sorted `json!` value.
    #[test]
    fn partition_owners_keep_their_sorted_keys() {
        let owner = LeaseOut {
            lease_id: "00".into(),
            scope: "partition/1".into(),
            holder: "h".into(),
            token: 4,
            ttl_ms: 1000,
            purpose: palisade_core::Purpose::Efficiency,
            expires_in_ms: 500,
        };
        let p = PartitionOut {
            cluster: None,
            fence: 4,
            head: 2,
            owner: Some(owner),
            partition: 1,
        };
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"fence":4,"head":2,"owner":{"expires_in_ms":500,"holder":"h","lease_id":"00","purpose":"efficiency","scope":"partition/1","token":4,"ttl_ms":1000},"partition":1}"#
        );
        let none = PartitionOut { owner: None, ..p };
        assert_eq!(
            serde_json::to_string(&none).unwrap(),
            r#"{"fence":4,"head":2,"owner":null,"partition":1}"#
        );
    }
}
