//! Who wrote a Kafka record, when authentication is on.
//!
//! Kafka does not tell a consumer which authenticated client produced a
//! record (the broker's SASL/mTLS identity stays on the broker), so the
//! principal travels in the record: header `palisade-principal` (its name)
//! and header `palisade-signature`, the hex HMAC-SHA256 of the record's
//! [`signed_bytes`] under the principal's signing key, which is the SHA-256
//! of its API key ([`signing_key`]; the same value the security file
//! stores). The ingester's [`RecordAuth`] checks the signature, the
//! principal's `write` grant and that the fencing token was granted to that
//! principal; a record that fails is dead-lettered, never applied.
//!
//! What this proves and what it does not is in `docs/security.md` ("Kafka").

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use rdkafka::message::BorrowedMessage;
use sha2::{Digest, Sha256};

use crate::decode::{Decoded, RawRecord, Refusal, CONTENT_TYPE_HEADER, HLC_HEADER, TOKEN_HEADER};
use crate::IngestConfig;
use palisade_log::IngestRecord;

/// Header naming the principal that signed the record.
pub const PRINCIPAL_HEADER: &str = "palisade-principal";
/// Header with the hex HMAC-SHA256 of [`signed_bytes`].
pub const SIGNATURE_HEADER: &str = "palisade-signature";
/// Domain separation: a signature over anything else never verifies here.
const CONTEXT: &[u8] = b"palisade-kafka-record-v1";

/// Checks that a decoded record may be applied (set in
/// [`IngestConfig::auth`] when authentication is on).
pub trait RecordAuth: Send + Sync + fmt::Debug {
    /// `Err` dead-letters the record with the refusal's reason.
    fn check(&self, raw: &RawRecord<'_>, decoded: &Decoded) -> Result<(), Refusal>;
}

/// The signing key of the principal whose API key is `api_key`.
pub fn signing_key(api_key: &str) -> [u8; 32] {
    let mut k = [0u8; 32];
    k.copy_from_slice(Sha256::digest(api_key.as_bytes()).as_slice());
    k
}

fn header<'a>(raw: &RawRecord<'a>, name: &str) -> Option<&'a [u8]> {
    raw.headers
        .iter()
        .rev()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .and_then(|(_, v)| *v)
}

/// The parts of a record a signature covers, besides the principal.
#[derive(Debug, Clone, Copy, Default)]
pub struct Signed<'a> {
    /// The record's key.
    pub twin: &'a [u8],
    /// The `fencing-token` header.
    pub token: &'a [u8],
    /// The `content-type` header.
    pub content_type: &'a [u8],
    /// The `hlc` header.
    pub hlc: &'a [u8],
    pub value: &'a [u8],
    /// The `palisade-if-match` header a cluster node puts on an HTTP
    /// append with `If-Match`: covered when the record has it (so it can be
    /// neither stripped nor added), left out when it has none (so every
    /// other record signs as before).
    pub if_match: Option<&'a [u8]>,
}

/// What is signed: a context string, then the principal, the key (twin
/// id), the `fencing-token`, `content-type` and `hlc` headers and the value,
/// each as a big-endian u32 length and its bytes (absent = empty), then,
/// only if the record has one, the `palisade-if-match` header the same way.
/// The partition and offset are not signed: the producer does not choose
/// them.
pub fn signed_bytes(principal: &[u8], parts: &Signed<'_>) -> Vec<u8> {
    let fields = [
        CONTEXT,
        principal,
        parts.twin,
        parts.token,
        parts.content_type,
        parts.hlc,
        parts.value,
    ];
    let mut out = Vec::with_capacity(fields.iter().map(|p| p.len() + 4).sum::<usize>() + 24);
    for p in fields.into_iter().chain(parts.if_match) {
        out.extend_from_slice(&u32::try_from(p.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn mac(key: &[u8; 32]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    <Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

/// The signature header's value for these record parts.
pub fn sign(key: &[u8; 32], principal: &str, parts: &Signed<'_>) -> String {
    let mut m = mac(key);
    m.update(&signed_bytes(principal.as_bytes(), parts));
    m.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn refuse(reason: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        detail: detail.into(),
    }
}

/// The principal a record claims, unverified (`unauthenticated` if none).
pub fn claimed_principal<'a>(raw: &RawRecord<'a>) -> Result<&'a str, Refusal> {
    let p = header(raw, PRINCIPAL_HEADER).ok_or_else(|| {
        refuse(
            "unauthenticated",
            "authentication is on: the record needs palisade-principal and palisade-signature headers",
        )
    })?;
    std::str::from_utf8(p).map_err(|_| refuse("unauthenticated", "palisade-principal is not UTF-8"))
}

/// Check the record's signature under `key` (constant-time comparison).
pub fn verify(raw: &RawRecord<'_>, principal: &str, key: &[u8; 32]) -> Result<(), Refusal> {
    let sig = header(raw, SIGNATURE_HEADER).ok_or_else(|| {
        refuse(
            "unauthenticated",
            "the record has no palisade-signature header",
        )
    })?;
    let sig = std::str::from_utf8(sig)
        .ok()
        .filter(|s| s.len() == 64)
        .and_then(|s| {
            (0..32)
                .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()
        })
        .ok_or_else(|| {
            refuse(
                "unauthenticated",
                "palisade-signature must be 64 hex characters",
            )
        })?;
    let mut m = mac(key);
    m.update(&signed_bytes(
        principal.as_bytes(),
        &Signed {
            twin: raw.key.unwrap_or_default(),
            token: header(raw, TOKEN_HEADER).unwrap_or_default(),
            content_type: header(raw, CONTENT_TYPE_HEADER).unwrap_or_default(),
            hlc: header(raw, HLC_HEADER).unwrap_or_default(),
            value: raw.value.unwrap_or_default(),
            if_match: header(raw, crate::cluster::IF_MATCH_HEADER),
        },
    ));
    m.verify_slice(&sig).map_err(|_| {
        refuse(
            "unauthenticated",
            format!("the signature does not match the record for principal {principal:?}"),
        )
    })
}

/// Apply `cfg.auth` to a record `to_record` turned into an append: a
/// refused one becomes a dead letter instead.
pub(crate) fn check_record(
    record: IngestRecord,
    msg: &BorrowedMessage<'_>,
    cfg: &IngestConfig,
) -> IngestRecord {
    let Some(auth) = &cfg.auth else {
        return record;
    };
    let IngestRecord::Append {
        twin,
        token,
        events,
        if_match,
        effects,
    } = record
    else {
        return record;
    };
    let headers = crate::message::headers_of(msg);
    let raw = crate::message::raw_of(msg, &headers);
    let decoded = Decoded {
        twin,
        token,
        events,
        effects,
    };
    match auth.check(&raw, &decoded) {
        Ok(()) => IngestRecord::Append {
            twin: decoded.twin,
            token: decoded.token,
            events: decoded.events,
            if_match,
            effects: decoded.effects,
        },
        Err(refusal) => crate::message::dead_letter(msg, &headers, refusal),
    }
}

/// [`check_record`] for a record this node decides in cluster mode: an
/// append, or a forwarded copy's append (signed over the same bytes: the
/// copy carries the original's key, headers and value).
pub(crate) fn check_decided(
    record: IngestRecord,
    msg: &BorrowedMessage<'_>,
    cfg: &IngestConfig,
) -> IngestRecord {
    match record {
        IngestRecord::Relayed { origin, record } => match check_record(*record, msg, cfg) {
            dead @ IngestRecord::Dead(_) => dead,
            inner => IngestRecord::Relayed {
                origin,
                record: Box::new(inner),
            },
        },
        other => check_record(other, msg, cfg),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn raw<'a>(headers: &'a [(&'a str, Option<&'a [u8]>)], value: &'a [u8]) -> RawRecord<'a> {
        RawRecord {
            partition: 0,
            offset: 0,
            key: Some(b"pump-7"),
            value: Some(value),
            headers,
        }
    }

    #[test]
    fn a_signed_record_verifies_and_any_change_breaks_it() {
        let key = signing_key("psk_secret");
        let parts = Signed {
            twin: b"pump-7",
            token: b"12",
            content_type: b"application/json",
            value: b"{}",
            ..Signed::default()
        };
        let sig = sign(&key, "worker-a", &parts);
        let h =
            |p: &'static str, s: &str, t: &'static [u8]| -> Vec<(&'static str, Option<Vec<u8>>)> {
                vec![
                    (TOKEN_HEADER, Some(t.to_vec())),
                    (CONTENT_TYPE_HEADER, Some(b"application/json".to_vec())),
                    (PRINCIPAL_HEADER, Some(p.as_bytes().to_vec())),
                    (SIGNATURE_HEADER, Some(s.as_bytes().to_vec())),
                ]
            };
        let check =
            |hs: &[(&str, Option<Vec<u8>>)], value: &[u8], principal: &str, key: &[u8; 32]| {
                let hs: Vec<(&str, Option<&[u8]>)> =
                    hs.iter().map(|(k, v)| (*k, v.as_deref())).collect();
                verify(&raw(&hs, value), principal, key)
            };
        assert!(check(&h("worker-a", &sig, b"12"), b"{}", "worker-a", &key).is_ok());
        // Another token, value, principal or key: refused.
        assert!(check(&h("worker-a", &sig, b"13"), b"{}", "worker-a", &key).is_err());
        assert!(check(&h("worker-a", &sig, b"12"), b"{ }", "worker-a", &key).is_err());
        assert!(check(&h("worker-b", &sig, b"12"), b"{}", "worker-b", &key).is_err());
        assert!(check(
            &h("worker-a", &sig, b"12"),
            b"{}",
            "worker-a",
            &signing_key("other")
        )
        .is_err());
        let e = check(&h("worker-a", "zz", b"12"), b"{}", "worker-a", &key).unwrap_err();
        assert_eq!(e.reason, "unauthenticated");
        // A palisade-if-match header added to a record signed without it:
        // refused. Signed with it: verifies, and stripping it is refused.
        let with_if_match = |sig: &str, v: Option<&'static [u8]>| {
            let mut hs = h("worker-a", sig, b"12");
            if let Some(v) = v {
                hs.push((crate::cluster::IF_MATCH_HEADER, Some(v.to_vec())));
            }
            check(&hs, b"{}", "worker-a", &key)
        };
        assert!(with_if_match(&sig, Some(b"3")).is_err());
        let sig3 = sign(
            &key,
            "worker-a",
            &Signed {
                if_match: Some(b"3"),
                ..parts
            },
        );
        assert!(with_if_match(&sig3, Some(b"3")).is_ok());
        assert!(with_if_match(&sig3, None).is_err());
        assert!(with_if_match(&sig3, Some(b"4")).is_err());
    }

    #[test]
    fn fields_cannot_slide_into_each_other() {
        let twin = |t: &'static [u8]| Signed {
            twin: t,
            ..Signed::default()
        };
        assert_ne!(
            signed_bytes(b"ab", &twin(b"c")),
            signed_bytes(b"a", &twin(b"bc"))
        );
        // No if-match and an empty one differ.
        assert_ne!(
            signed_bytes(b"a", &Signed::default()),
            signed_bytes(
                b"a",
                &Signed {
                    if_match: Some(b""),
                    ..Signed::default()
                }
            )
        );
    }
}
