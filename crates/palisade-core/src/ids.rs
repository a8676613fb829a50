use std::fmt;
use std::str::FromStr;

use bincode::{Decode, Encode};

/// Longest twin id accepted, in bytes. Twin ids are part of every key of the
/// twin's records, so they are bounded to keep keys small.
pub const MAX_TWIN_ID_LEN: usize = 256;

/// Why a twin id, scope or lease id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("twin id is empty")]
    EmptyTwinId,
    #[error("twin id is {len} bytes long; the limit is {max} bytes")]
    TwinIdTooLong { len: usize, max: usize },
    #[error("twin id contains a control character at byte {at}")]
    TwinIdControlChar { at: usize },
    /// The refused input is kept as an [`excerpt`]: it is echoed to
    /// clients and logs, and may be as long as a request body.
    #[error("scope {0} is not `partition/<number>` or `twin/<id>`")]
    BadScope(String),
    /// As for `BadScope`, an excerpt of the input.
    #[error("lease id {0} is not 32 hexadecimal characters")]
    BadLeaseId(String),
}

/// Longest part of a refused input that an error repeats, in characters.
pub const EXCERPT_CHARS: usize = 40;

/// `s` quoted for an error message, cut to its first [`EXCERPT_CHARS`]
/// characters (with its full length) so that a client sending a huge value
/// does not get it back, nor fill a log with it (issue 18).
pub fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
    }
}

/// The id of a twin: non-empty UTF-8 of at most [`MAX_TWIN_ID_LEN`] bytes
/// without control characters (so ids are safe to print in logs and headers).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Encode, Decode)]
pub struct TwinId(String);

impl TwinId {
    pub fn new(id: impl Into<String>) -> Result<Self, IdError> {
        let id = id.into();
        if id.is_empty() {
            return Err(IdError::EmptyTwinId);
        }
        if id.len() > MAX_TWIN_ID_LEN {
            return Err(IdError::TwinIdTooLong {
                len: id.len(),
                max: MAX_TWIN_ID_LEN,
            });
        }
        if let Some((at, _)) = id.char_indices().find(|(_, c)| c.is_control()) {
            return Err(IdError::TwinIdControlChar { at });
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for TwinId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for TwinId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for TwinId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A partition of the log: `murmur2(twin_id) mod N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Encode, Decode)]
pub struct PartitionId(pub u32);

impl From<u32> for PartitionId {
    fn from(p: u32) -> Self {
        Self(p)
    }
}

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A fencing token: the value of the store's one durable counter at a lease
/// grant. Tokens never repeat and never go backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Encode, Decode)]
pub struct FencingToken(pub u64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// What a lease covers: a whole partition (single-writer partition) or one
/// twin (an entity lock).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Encode, Decode)]
pub enum Scope {
    Partition(PartitionId),
    Twin(TwinId),
}

impl Scope {
    /// Whether a token granted on this scope may write `twin`, which lives in
    /// `twin_partition`.
    pub fn covers(&self, twin: &TwinId, twin_partition: PartitionId) -> bool {
        match self {
            Scope::Partition(p) => *p == twin_partition,
            Scope::Twin(t) => t == twin,
        }
    }

    /// The partition whose writer enforces this scope's fence.
    pub fn partition(&self, partitions: u32) -> PartitionId {
        match self {
            Scope::Partition(p) => *p,
            Scope::Twin(t) => crate::partition_for(t, partitions),
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Partition(p) => write!(f, "partition/{p}"),
            Scope::Twin(t) => write!(f, "twin/{t}"),
        }
    }
}

impl FromStr for Scope {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("partition/") {
            // Digits only: `u32::from_str` would also take a leading `+`.
            if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
                if let Ok(p) = p.parse::<u32>() {
                    return Ok(Scope::Partition(PartitionId(p)));
                }
            }
            return Err(IdError::BadScope(excerpt(s)));
        }
        if let Some(t) = s.strip_prefix("twin/") {
            return TwinId::new(t)
                .map(Scope::Twin)
                .map_err(|_| IdError::BadScope(excerpt(s)));
        }
        Err(IdError::BadScope(excerpt(s)))
    }
}

/// A lease's id: 128 random bits, shown as 32 lowercase hex characters.
/// Renewals and releases name a lease by this id only.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Encode, Decode)]
pub struct LeaseId(pub u128);

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({self})")
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for LeaseId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(IdError::BadLeaseId(excerpt(s)));
        }
        u128::from_str_radix(s, 16)
            .map(LeaseId)
            .map_err(|_| IdError::BadLeaseId(excerpt(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twin_ids_are_bounded_and_printable() {
        assert_eq!(TwinId::new(""), Err(IdError::EmptyTwinId));
        assert!(matches!(
            TwinId::new("x".repeat(MAX_TWIN_ID_LEN + 1)),
            Err(IdError::TwinIdTooLong { .. })
        ));
        assert!(TwinId::new("x".repeat(MAX_TWIN_ID_LEN)).is_ok());
        assert_eq!(
            TwinId::new("a\0b"),
            Err(IdError::TwinIdControlChar { at: 1 })
        );
        assert!(TwinId::new("pump-7/ü").is_ok());
    }

    #[test]
    fn scopes_round_trip_and_refuse_junk() {
        for s in ["partition/0", "partition/15", "twin/device-7", "twin/a/b"] {
            assert_eq!(s.parse::<Scope>().unwrap().to_string(), s);
        }
        for s in [
            "partition/",
            "partition/-1",
            "partition/+1",
            "partition/x",
            "twin/",
            "lock/x",
            "",
        ] {
            assert!(s.parse::<Scope>().is_err(), "{s} should be refused");
        }
    }

    /// Issue 18: `bad_lease_id` echoed a whole 10 KB path segment.
    #[test]
    fn refused_ids_are_echoed_as_short_excerpts() {
        let long = "z".repeat(10_000);
        let e = long.parse::<LeaseId>().unwrap_err().to_string();
        assert!(e.len() < 120, "{e}");
        assert!(
            e.contains(&"z".repeat(EXCERPT_CHARS)) && e.contains("10000 bytes"),
            "{e}"
        );
        let e = format!("twin/{}\0", "é".repeat(5000))
            .parse::<Scope>()
            .unwrap_err()
            .to_string();
        assert!(e.len() < 160, "{e}");
        // Short input is shown whole, quoted, control characters escaped.
        assert_eq!(
            "a\u{1}".parse::<LeaseId>().unwrap_err().to_string(),
            "lease id \"a\\u{1}\" is not 32 hexadecimal characters"
        );
    }

    #[test]
    fn lease_ids_round_trip() {
        let id = LeaseId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(id.to_string().parse::<LeaseId>().unwrap(), id);
        assert!("xyz".parse::<LeaseId>().is_err());
        assert!("+0000000000000000000000000000001"
            .parse::<LeaseId>()
            .is_err());
    }
}
