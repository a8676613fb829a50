//! Side effects declared with an event (the fenced outbox, issue 14 part 2,
//! `docs/decisions/0030-fenced-outbox.md`): an append's event may carry
//! `"effects": [{"kind": "webhook", "url": "http://...", "body": <JSON>,
//! "headers"?: {...}}]`, or `{"kind": "kafka", "topic": "...", "body":
//! <JSON>, "headers"?: {...}}` (a record to another topic, keyed by the
//! twin id). The store records them in the same fenced commit as
//! the event, so an effect exists only if its event was admitted, and a
//! dispatcher delivers them after the commit is durable.
//!
//! Bounded: at most [`MAX_EFFECTS_PER_EVENT`] per event, URLs of at most
//! [`MAX_EFFECT_URL_LEN`] bytes (`http` or `https` with a host), at most
//! [`MAX_EFFECT_HEADERS`] headers of plain token names and visible ASCII
//! values. Headers the dispatcher sets itself (`Idempotency-Key`,
//! `Fencing-Token`, `Content-Type`, `Content-Length`, `Host`) cannot be set.

use bincode::{Decode, Encode};

/// Most effects one event may declare.
pub const MAX_EFFECTS_PER_EVENT: usize = 16;
/// Longest effect URL, in bytes.
pub const MAX_EFFECT_URL_LEN: usize = 2048;
/// Most extra headers of one effect.
pub const MAX_EFFECT_HEADERS: usize = 16;
/// Longest header name or value, in bytes.
const MAX_HEADER_LEN: usize = 1024;

/// Headers the dispatcher sets (or the HTTP client does): not settable.
const RESERVED_HEADERS: [&str; 6] = [
    "idempotency-key",
    "fencing-token",
    "content-type",
    "content-length",
    "host",
    "transfer-encoding",
];

/// What kind of effect. A stored kind this build does not know fails to
/// decode rather than being delivered as something else (new kinds go at
/// the end: bincode stores the variant's index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum EffectKind {
    /// An HTTP POST of `body` to `url`.
    Webhook,
    /// A Kafka record of `body` to the topic in `url`, keyed by the twin
    /// id, on the brokers of `palisade serve --kafka-brokers`.
    Kafka,
}

impl EffectKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Webhook => "webhook",
            Self::Kafka => "kafka",
        }
    }
}

/// Longest Kafka topic name (Kafka's own limit).
pub const MAX_TOPIC_LEN: usize = 249;

/// Check a Kafka topic name as Kafka does: 1 to 249 of `A-Z a-z 0-9 . _ -`,
/// not `.` or `..`.
pub fn check_topic(topic: &str) -> Result<(), EffectError> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        return Err(bad(format!(
            "topic must be 1 to {MAX_TOPIC_LEN} characters, got {}",
            topic.len()
        )));
    }
    if topic == "." || topic == ".." {
        return Err(bad("topic cannot be \".\" or \"..\""));
    }
    if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_".contains(&b))
    {
        return Err(bad(format!(
            "topic {topic:?} may only hold A-Z, a-z, 0-9, '.', '_' and '-'"
        )));
    }
    Ok(())
}

/// One effect, as validated and stored.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Effect {
    pub kind: EffectKind,
    pub url: String,
    /// The body as compact JSON text (bincode cannot carry a
    /// `serde_json::Value`; the text keeps the bytes exact).
    pub body: String,
    /// Extra request headers, in the order sent.
    pub headers: Vec<(String, String)>,
}

impl Effect {
    /// The effect in the form an append declares it (`{"kind", "url",
    /// "body", "headers"}`): [`parse_effects`] of it gives it back. Cluster
    /// mode carries effects so in the Kafka record of an HTTP append.
    pub fn to_json(&self) -> serde_json::Value {
        let body = serde_json::from_str::<serde_json::Value>(&self.body)
            .unwrap_or(serde_json::Value::Null);
        let headers: serde_json::Map<String, serde_json::Value> = self
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), serde_json::Value::String(v.clone())))
            .collect();
        // A kafka effect keeps its topic in `url`.
        let target = match self.kind {
            EffectKind::Webhook => "url",
            EffectKind::Kafka => "topic",
        };
        serde_json::json!({
            "kind": self.kind.name(),
            target: self.url,
            "body": body,
            "headers": headers,
        })
    }
}

/// Why an `effects` value is refused (HTTP `400 bad_effects`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EffectError(pub String);

fn bad(msg: impl Into<String>) -> EffectError {
    EffectError(msg.into())
}

/// Check a URL: `http://` or `https://`, a non-empty host, at most
/// [`MAX_EFFECT_URL_LEN`] bytes, visible ASCII only (no spaces, no control
/// characters; non-ASCII must be percent-encoded).
pub fn check_effect_url(url: &str) -> Result<(), EffectError> {
    if url.len() > MAX_EFFECT_URL_LEN {
        return Err(bad(format!(
            "url is {} bytes; the limit is {MAX_EFFECT_URL_LEN}",
            url.len()
        )));
    }
    if !url.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad(
            "url must be visible ASCII (percent-encode anything else)",
        ));
    }
    let lower = url.to_ascii_lowercase();
    let rest = lower
        .strip_prefix("http://")
        .or_else(|| lower.strip_prefix("https://"))
        .ok_or_else(|| bad("url must start with http:// or https://"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or("");
    if host.is_empty() || host.starts_with(':') {
        return Err(bad("url has no host"));
    }
    Ok(())
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Parse and check one event's `effects` value (event `i` of the request,
/// for messages).
pub fn parse_effects(i: usize, v: &serde_json::Value) -> Result<Vec<Effect>, EffectError> {
    let serde_json::Value::Array(list) = v else {
        return Err(bad(format!("event {i}: effects must be an array")));
    };
    if list.len() > MAX_EFFECTS_PER_EVENT {
        return Err(bad(format!(
            "event {i}: {} effects; the limit is {MAX_EFFECTS_PER_EVENT} per event",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(j, e)| parse_effect(e).map_err(|x| bad(format!("event {i}, effect {j}: {}", x.0))))
        .collect()
}

fn parse_effect(v: &serde_json::Value) -> Result<Effect, EffectError> {
    let serde_json::Value::Object(o) = v else {
        return Err(bad(
            "an effect must be an object {\"kind\", \"url\" or \"topic\", \"body\", \"headers\"?}",
        ));
    };
    let kind = match o.get("kind") {
        Some(serde_json::Value::String(k)) if k == "webhook" => EffectKind::Webhook,
        Some(serde_json::Value::String(k)) if k == "kafka" => EffectKind::Kafka,
        Some(serde_json::Value::String(k)) => {
            return Err(bad(format!(
                "unknown kind {k:?}; the known kinds are \"webhook\" and \"kafka\""
            )))
        }
        _ => return Err(bad("kind must be a string (\"webhook\" or \"kafka\")")),
    };
    // Where it goes: a webhook's url, a kafka effect's topic (kept in `url`).
    let target = match kind {
        EffectKind::Webhook => "url",
        EffectKind::Kafka => "topic",
    };
    if let Some(k) = o
        .keys()
        .find(|k| !["kind", target, "body", "headers"].contains(&k.as_str()))
    {
        return Err(bad(format!(
            "unknown field {k:?} for a {} effect",
            kind.name()
        )));
    }
    let url = match o.get(target) {
        Some(serde_json::Value::String(u)) => u.clone(),
        _ => return Err(bad(format!("{target} must be a string"))),
    };
    match kind {
        EffectKind::Webhook => check_effect_url(&url)?,
        EffectKind::Kafka => check_topic(&url)?,
    }
    let body = o
        .get("body")
        .ok_or_else(|| bad("body is missing (any JSON value; null for none)"))?
        .to_string();
    let mut headers = Vec::new();
    match o.get("headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(h)) => {
            if h.len() > MAX_EFFECT_HEADERS {
                return Err(bad(format!(
                    "{} headers; the limit is {MAX_EFFECT_HEADERS}",
                    h.len()
                )));
            }
            for (name, value) in h {
                if !is_token(name) || name.len() > MAX_HEADER_LEN {
                    return Err(bad(format!("header name {name:?} is not a valid token")));
                }
                if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
                    return Err(bad(format!(
                        "header {name:?} is set by the dispatcher and cannot be given"
                    )));
                }
                let serde_json::Value::String(value) = value else {
                    return Err(bad(format!("header {name:?}: the value must be a string")));
                };
                if value.len() > MAX_HEADER_LEN
                    || !value.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
                {
                    return Err(bad(format!(
                        "header {name:?}: the value must be visible ASCII, at most {MAX_HEADER_LEN} bytes"
                    )));
                }
                headers.push((name.clone(), value.clone()));
            }
        }
        Some(_) => return Err(bad("headers must be an object of strings")),
    }
    Ok(Effect {
        kind,
        url,
        body,
        headers,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn urls() {
        assert!(check_effect_url("http://127.0.0.1:8080/hook").is_ok());
        assert!(check_effect_url("HTTPS://example.com").is_ok());
        for u in [
            "ftp://x/y",
            "http://",
            "http:///path",
            "http://:80/",
            "http://a b/",
            "example.com/hook",
            "http://é.com/",
        ] {
            assert!(check_effect_url(u).is_err(), "{u}");
        }
        let long = format!("http://h/{}", "a".repeat(MAX_EFFECT_URL_LEN));
        assert!(check_effect_url(&long).is_err());
    }

    #[test]
    fn effects_are_checked() {
        let ok = json!([{"kind": "webhook", "url": "http://h/x", "body": {"a": 1},
            "headers": {"X-Tenant": "t1"}}]);
        let e = parse_effects(0, &ok).unwrap();
        assert_eq!(e[0].body, r#"{"a":1}"#);
        assert_eq!(e[0].headers, [("X-Tenant".to_owned(), "t1".to_owned())]);
        let one = json!({"kind": "webhook", "url": "http://h/x", "body": null});
        let too_many = serde_json::Value::Array(vec![one.clone(); MAX_EFFECTS_PER_EVENT + 1]);
        let bads = [
            json!({"kind": "webhook"}),
            json!("x"),
            too_many,
            json!([{"kind": "kafka", "url": "http://h", "body": 1}]),
            json!([{"kind": "kafka", "topic": "a b", "body": 1}]),
            json!([{"kind": "kafka", "topic": "..", "body": 1}]),
            json!([{"kind": "kafka", "topic": "", "body": 1}]),
            json!([{"kind": "kafka", "topic": "t", "body": 1, "headers": {"Idempotency-Key": "x"}}]),
            json!([{"kind": "ftp", "url": "http://h", "body": 1}]),
            json!([{"kind": "webhook", "url": "gopher://h", "body": 1}]),
            json!([{"kind": "webhook", "url": "http://h"}]),
            json!([{"kind": "webhook", "url": "http://h", "body": 1, "extra": 2}]),
            json!([{"kind": "webhook", "url": "http://h", "body": 1, "headers": {"Fencing-Token": "9"}}]),
            json!([{"kind": "webhook", "url": "http://h", "body": 1, "headers": {"a b": "9"}}]),
            json!([{"kind": "webhook", "url": "http://h", "body": 1, "headers": {"x": "a\nb"}}]),
        ];
        for b in bads {
            assert!(parse_effects(3, &b).is_err(), "{b}");
        }
        let back = parse_effects(0, &serde_json::Value::Array(vec![e[0].to_json()])).unwrap();
        assert_eq!(back, e, "to_json is what parse_effects reads back");
        let k = parse_effects(
            0,
            &json!([{"kind": "kafka", "topic": "valve-commands.v1", "body": {"open": true}}]),
        )
        .unwrap();
        assert_eq!(
            (k[0].kind, k[0].url.as_str()),
            (EffectKind::Kafka, "valve-commands.v1")
        );
        let back = parse_effects(0, &serde_json::Value::Array(vec![k[0].to_json()])).unwrap();
        assert_eq!(back, k, "a kafka effect reads back with its topic");
        let max = serde_json::Value::Array(vec![one; MAX_EFFECTS_PER_EVENT]);
        assert_eq!(parse_effects(0, &max).unwrap().len(), MAX_EFFECTS_PER_EVENT);
    }
}
