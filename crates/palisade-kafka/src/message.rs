//! What every consume loop (single node, cluster node, signed records) does
//! with one Kafka message: list its headers, hand it to the decoder, and turn
//! a refusal into a dead letter that keeps a copy of the record.

use palisade_log::{DeadLetter, IngestRecord};
use rdkafka::message::{BorrowedMessage, Headers, Message};

use crate::decode::{decode, RawRecord, Refusal};

/// A message's headers as the decoder reads them.
pub(crate) type HeaderList<'m> = Vec<(&'m str, Option<&'m [u8]>)>;

pub(crate) fn headers_of<'m>(msg: &'m BorrowedMessage<'_>) -> HeaderList<'m> {
    msg.headers()
        .map(|h| {
            (0..h.count())
                .map(|i| h.get(i))
                .map(|h| (h.key, h.value))
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn raw_of<'m>(
    msg: &'m BorrowedMessage<'_>,
    headers: &'m HeaderList<'m>,
) -> RawRecord<'m> {
    RawRecord {
        partition: msg.partition(),
        offset: msg.offset(),
        key: msg.key(),
        value: msg.payload(),
        headers,
    }
}

/// Decode `msg` into an append, or a dead letter saying why not
/// (`strict_partitions`: see [`decode`]).
pub(crate) fn to_record(
    msg: &BorrowedMessage<'_>,
    strict_partitions: Option<u32>,
    max_value_bytes: usize,
) -> IngestRecord {
    let headers = headers_of(msg);
    match decode(&raw_of(msg, &headers), strict_partitions, max_value_bytes) {
        Ok(d) => IngestRecord::Append {
            twin: d.twin,
            token: d.token,
            events: d.events,
            effects: d.effects,
            if_match: None,
        },
        Err(refusal) => dead_letter(msg, &headers, refusal),
    }
}

/// [`to_record`] keeping the effects of a JSON record's events: for the
/// records cluster nodes produce for HTTP appends (the fenced outbox in
/// cluster mode, `docs/outbox.md`).
pub(crate) fn to_record_with_effects(
    msg: &BorrowedMessage<'_>,
    strict_partitions: Option<u32>,
    max_value_bytes: usize,
) -> IngestRecord {
    let headers = headers_of(msg);
    match crate::decode::decode_with_effects(
        &raw_of(msg, &headers),
        strict_partitions,
        max_value_bytes,
    ) {
        Ok(d) => IngestRecord::Append {
            twin: d.twin,
            token: d.token,
            events: d.events,
            effects: d.effects,
            if_match: None,
        },
        Err(refusal) => dead_letter(msg, &headers, refusal),
    }
}

/// [`to_record`] for a copy of a record read elsewhere: decoded as if it
/// were at `partition` and `offset` (event ids default from there), without
/// strict partitioning (the copy is in its twin's partition by design).
pub(crate) fn to_record_as(
    msg: &BorrowedMessage<'_>,
    partition: i32,
    offset: i64,
    max_value_bytes: usize,
) -> IngestRecord {
    let headers = headers_of(msg);
    let raw = RawRecord {
        partition,
        offset,
        ..raw_of(msg, &headers)
    };
    match decode(&raw, None, max_value_bytes) {
        Ok(d) => IngestRecord::Append {
            twin: d.twin,
            token: d.token,
            events: d.events,
            effects: d.effects,
            if_match: None,
        },
        Err(refusal) => dead_letter(msg, &headers, refusal),
    }
}

/// A dead letter for `msg`: where it was, why it was refused, its headers
/// and (the start of) its value.
pub(crate) fn dead_letter(
    msg: &BorrowedMessage<'_>,
    headers: &HeaderList<'_>,
    refusal: Refusal,
) -> IngestRecord {
    IngestRecord::Dead(DeadLetter {
        partition: u32::try_from(msg.partition()).unwrap_or(0),
        offset: u64::try_from(msg.offset()).unwrap_or(0),
        key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        reason: refusal.reason.to_owned(),
        detail: refusal.detail,
        headers: headers
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    v.map(|v| String::from_utf8_lossy(v).into_owned())
                        .unwrap_or_default(),
                )
            })
            .collect(),
        value: msg
            .payload()
            .map(|v| v[..v.len().min(palisade_log::DEAD_LETTER_VALUE_BYTES)].to_vec())
            .unwrap_or_default(),
        value_len: msg.payload().map_or(0, |v| v.len() as u64),
        at_ms: 0,
    })
}
