//! What a lease is for (the reference article's first checklist item:
//! "decide whether the lock is for efficiency or for correctness").

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// What a lease promises its holder. Both kinds carry a fencing token and
/// both raise the scope's fence at grant: the store never weakens the check
/// for one kind. The purpose says what the worker relies on, so the store,
/// its operators and its audit log can tell the two apart
/// (docs/decisions/0028-lease-purpose.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Purpose {
    /// Two holders writing at once would corrupt data: every write under
    /// the lease carries its token, and the store refuses a stale one. The
    /// default.
    #[default]
    Correctness,
    /// Two holders at once would only duplicate work (the lease keeps
    /// workers from doing the same job twice, usually). A write under it is
    /// still fenced by the store; side effects outside the store are not.
    Efficiency,
}

impl Purpose {
    /// Every purpose, in the order shown in metrics.
    pub const ALL: [Purpose; 2] = [Purpose::Correctness, Purpose::Efficiency];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Correctness => "correctness",
            Self::Efficiency => "efficiency",
        }
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `purpose` was neither `correctness` nor `efficiency`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("purpose must be \"correctness\" or \"efficiency\"")]
pub struct PurposeError;

impl FromStr for Purpose {
    type Err = PurposeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or(PurposeError)
    }
}

/// By hand, so a bad value is refused in the API's words (what is allowed),
/// whatever JSON type it has.
impl<'de> Deserialize<'de> for Purpose {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl Visitor<'_> for Name {
            type Value = Purpose;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("purpose \"correctness\" or \"efficiency\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Purpose, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(Name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused() {
        for p in Purpose::ALL {
            assert_eq!(p.as_str().parse::<Purpose>(), Ok(p));
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
        }
        assert_eq!(Purpose::default(), Purpose::Correctness);
        assert!("Correctness".parse::<Purpose>().is_err());
        assert!("".parse::<Purpose>().is_err());
        for bad in ["\"Efficiency\"", "1", "{}"] {
            let e = serde_json::from_str::<Purpose>(bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("\"correctness\" or \"efficiency\""),
                "{bad}: {e}"
            );
        }
        assert_eq!(
            serde_json::from_str::<Purpose>("\"efficiency\"").unwrap(),
            Purpose::Efficiency
        );
    }
}
