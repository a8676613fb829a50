//! The one place that turns values into on-disk bytes and back.
//!
//! Every value is `[FORMAT_VERSION] ++ bincode(standard config)`: little-endian,
//! variable-length integers (see `docs/on-disk-format.md` for the byte layout
//! of each record). bincode 2.0.1 is pinned and unmaintained; keeping it behind
//! this module and a version byte means a move to another encoding is one
//! module and one migration. Keys are not encoded here: they are hand-built
//! big-endian byte strings so that they sort (see `palisade-log`'s `keys`).

use bincode::config::{self, Configuration, Limit, LittleEndian, Varint};
use bincode::{Decode, Encode};

/// The format-version byte that prefixes every encoded value.
pub const FORMAT_VERSION: u8 = 1;

/// Upper bound on one decoded value, so a damaged length prefix cannot make
/// the decoder allocate gigabytes.
pub const MAX_VALUE_BYTES: usize = 64 << 20;

type Config = Configuration<LittleEndian, Varint, Limit<MAX_VALUE_BYTES>>;

const fn cfg() -> Config {
    config::standard().with_limit::<MAX_VALUE_BYTES>()
}

/// Why stored bytes could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty value: no format-version byte")]
    Empty,
    #[error(
        "format version {found} is not supported by this build (it reads version {FORMAT_VERSION})"
    )]
    UnsupportedVersion { found: u8 },
    #[error("damaged value: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    #[error("damaged value: {extra} trailing bytes after the record")]
    TrailingBytes { extra: usize },
}

/// Encode `value` with the version byte in front.
///
/// # Panics
/// Only if bincode refuses a value of our own types (a bug, not an input).
pub fn encode<T: Encode>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(FORMAT_VERSION);
    #[allow(clippy::expect_used)]
    bincode::encode_into_std_write(value, &mut out, cfg()).expect("encoding to a Vec cannot fail");
    out
}

/// Decode a value written by [`encode`]; the whole slice must be consumed.
pub fn decode<T: Decode<()>>(bytes: &[u8]) -> Result<T, CodecError> {
    let (&version, body) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion { found: version });
    }
    let (value, used) = bincode::decode_from_slice(body, cfg())?;
    if used != body.len() {
        return Err(CodecError::TrailingBytes {
            extra: body.len() - used,
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Event, FencingToken, Hlc, TwinId};

    fn sample() -> Event {
        Event {
            seq: 300,
            twin_id: TwinId::new("d7").unwrap(),
            event_id: "e1".into(),
            event_type: "t".into(),
            patch: r#"{"a":1}"#.into(),
            hlc: Hlc {
                time: 1,
                id: [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            },
            writer: "w".into(),
            token: FencingToken(34),
            appended_at_ms: 5,
        }
    }

    /// Golden bytes: if this test fails, the on-disk format changed. Bump
    /// FORMAT_VERSION, write a migration and update docs/on-disk-format.md.
    #[test]
    fn event_golden_bytes() {
        let bytes = encode(&sample());
        let want: Vec<u8> = [
            vec![1],                                    // format version
            vec![251, 44, 1],                           // seq 300: varint marker 251 + u16 LE
            vec![2, b'd', b'7'],                        // twin_id: len 2 + bytes
            vec![2, b'e', b'1'],                        // event_id
            vec![1, b't'],                              // event_type
            [vec![7], br#"{"a":1}"#.to_vec()].concat(), // patch JSON text
            vec![1],                                    // hlc.time varint
            [vec![2], vec![0; 15]].concat(),            // hlc.id: 16 raw bytes
            vec![1, b'w'],                              // writer
            vec![34],                                   // token
            vec![5],                                    // appended_at_ms
        ]
        .concat();
        assert_eq!(bytes, want);
        assert_eq!(decode::<Event>(&bytes).unwrap(), sample());
    }

    #[test]
    fn damaged_values_are_errors_not_panics() {
        let good = encode(&sample());
        assert!(matches!(decode::<Event>(&[]), Err(CodecError::Empty)));
        assert!(matches!(
            decode::<Event>(&[9, 1, 2]),
            Err(CodecError::UnsupportedVersion { found: 9 })
        ));
        for cut in 1..good.len() {
            assert!(decode::<Event>(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            decode::<Event>(&long),
            Err(CodecError::TrailingBytes { extra: 1 })
        ));
        // A huge length prefix must not allocate it.
        let huge = [1u8, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F];
        assert!(decode::<Event>(&huge).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = decode::<Event>(&bytes);
        }
    }
}
