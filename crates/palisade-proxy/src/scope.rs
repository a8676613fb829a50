//! Which twin a request is about: the scope rule (pure, no I/O).
//!
//! A rule is either a path pattern such as `/api/parts/{twin}` (the
//! pattern's segments must match the request path's first segments, one of
//! them being `{twin}`; the path may go on past the pattern, so
//! `/api/parts/{twin}` also covers `/api/parts/p-7/revisions/3`) or a
//! header name such as `Palisade-Twin` whose value is the twin id.

use axum::http::HeaderMap;
use palisade_core::TwinId;

/// How a request names its twin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeRule {
    /// Segments of a path pattern; exactly one is [`Segment::Twin`].
    Path(Vec<Segment>),
    /// A header (name lower-cased) that carries the twin id.
    Header(String),
}

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    /// `{twin}`: captures the twin id.
    Twin,
    /// `*`: any one segment.
    Any,
}

/// Why a request names no twin (answered `400 unknown_scope`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoScope(pub String);

impl ScopeRule {
    /// Parse a path pattern: starts with `/`, segments separated by `/`,
    /// exactly one `{twin}`, `*` for any one segment.
    pub fn path(pattern: &str) -> Result<Self, String> {
        let rest = pattern
            .strip_prefix('/')
            .ok_or_else(|| format!("scope path pattern {pattern:?} must start with '/'"))?;
        let segments: Vec<Segment> = rest
            .split('/')
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "{twin}" => Segment::Twin,
                "*" => Segment::Any,
                lit => Segment::Literal(lit.to_owned()),
            })
            .collect();
        let twins = segments.iter().filter(|s| **s == Segment::Twin).count();
        if twins != 1 {
            return Err(format!(
                "scope path pattern {pattern:?} must hold exactly one {{twin}} segment, found {twins}"
            ));
        }
        if let Some(Segment::Literal(l)) = segments
            .iter()
            .find(|s| matches!(s, Segment::Literal(l) if l.contains(['{', '}'])))
        {
            return Err(format!(
                "scope path pattern {pattern:?}: segment {l:?} is neither a literal, `*` nor `{{twin}}`"
            ));
        }
        Ok(Self::Path(segments))
    }

    /// A header rule; the name must be a valid HTTP header name.
    pub fn header(name: &str) -> Result<Self, String> {
        axum::http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("scope header {name:?} is not a valid header name"))?;
        Ok(Self::Header(name.to_ascii_lowercase()))
    }

    /// The twin a request with this path and these headers is about.
    pub fn twin_of(&self, path: &str, headers: &HeaderMap) -> Result<TwinId, NoScope> {
        let raw = match self {
            Self::Path(pattern) => {
                let mut parts = path.trim_start_matches('/').split('/');
                let mut twin = None;
                for seg in pattern {
                    let Some(got) = parts.next().filter(|p| !p.is_empty()) else {
                        return Err(NoScope(format!(
                            "path {path:?} does not match the scope pattern {}",
                            self.describe()
                        )));
                    };
                    match seg {
                        Segment::Literal(l) if l != got => {
                            return Err(NoScope(format!(
                                "path {path:?} does not match the scope pattern {}",
                                self.describe()
                            )))
                        }
                        Segment::Twin => twin = Some(percent_decode(got)?),
                        _ => {}
                    }
                }
                twin.unwrap_or_default()
            }
            Self::Header(name) => {
                let mut all = headers.get_all(name.as_str()).iter();
                let v = all.next().ok_or_else(|| {
                    NoScope(format!("the {name} header (the request's twin) is missing"))
                })?;
                if all.next().is_some() {
                    return Err(NoScope(format!("give exactly one {name} header")));
                }
                v.to_str()
                    .map_err(|_| NoScope(format!("the {name} header is not visible ASCII")))?
                    .trim()
                    .to_owned()
            }
        };
        TwinId::new(raw.clone()).map_err(|e| NoScope(format!("twin id {raw:?}: {e}")))
    }

    /// The rule as given, for messages.
    pub fn describe(&self) -> String {
        match self {
            Self::Header(h) => format!("header {h}"),
            Self::Path(segs) => {
                let mut s = String::new();
                for seg in segs {
                    s.push('/');
                    match seg {
                        Segment::Literal(l) => s.push_str(l),
                        Segment::Twin => s.push_str("{twin}"),
                        Segment::Any => s.push('*'),
                    }
                }
                s
            }
        }
    }
}

/// `%XX` escapes of a path segment decoded (twin ids are UTF-8).
fn percent_decode(seg: &str) -> Result<String, NoScope> {
    let bytes = seg.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| NoScope(format!("bad percent escape in path segment {seg:?}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| NoScope(format!("path segment {seg:?} is not UTF-8")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn twin(rule: &ScopeRule, path: &str, headers: &HeaderMap) -> Result<String, NoScope> {
        rule.twin_of(path, headers).map(|t| t.as_str().to_owned())
    }

    #[test]
    fn path_patterns_capture_the_twin() {
        let r = ScopeRule::path("/api/parts/{twin}").unwrap();
        let h = HeaderMap::new();
        assert_eq!(twin(&r, "/api/parts/p-7", &h).unwrap(), "p-7");
        assert_eq!(twin(&r, "/api/parts/p-7/revisions/3", &h).unwrap(), "p-7");
        assert_eq!(twin(&r, "/api/parts/p%207", &h).unwrap(), "p 7");
        assert!(twin(&r, "/api/parts", &h).is_err());
        assert!(twin(&r, "/api/parts/", &h).is_err());
        assert!(twin(&r, "/api/other/p-7", &h).is_err());
        assert!(twin(&r, "/api/parts/p%zz", &h).is_err());
        let any = ScopeRule::path("/v2/*/{twin}").unwrap();
        assert_eq!(twin(&any, "/v2/devices/d-1", &h).unwrap(), "d-1");
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(ScopeRule::path("api/{twin}").is_err());
        assert!(ScopeRule::path("/api/parts").is_err());
        assert!(ScopeRule::path("/{twin}/{twin}").is_err());
        assert!(ScopeRule::path("/api/{part}").is_err());
        assert!(ScopeRule::header("bad header").is_err());
    }

    #[test]
    fn header_rule_takes_exactly_one_header() {
        let r = ScopeRule::header("Palisade-Twin").unwrap();
        let mut h = HeaderMap::new();
        assert!(twin(&r, "/x", &h).is_err());
        h.insert("palisade-twin", "pump-7".parse().unwrap());
        assert_eq!(twin(&r, "/x", &h).unwrap(), "pump-7");
        h.append("palisade-twin", "pump-8".parse().unwrap());
        assert!(twin(&r, "/x", &h).is_err());
    }
}
