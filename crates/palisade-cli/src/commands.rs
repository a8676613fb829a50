//! `lease`, `append`, `get`, `events`, `refusals`, `partitions`: one request each.
//!
//! Leases, appends and event pages go through `palisade-client`; `get`
//! (time travel, `delta`) and `partitions` are not in the SDK, so they are
//! plain GETs whose JSON is printed as the store sent it.

use std::path::Path;
use std::time::Duration;

use clap::ArgMatches;
use palisade_client::{Appended, Client, Event, LeaseGrant, StoredEvent};
use reqwest::Url;
use serde_json::{json, Value};

use super::{out, pick, AcquireArgs, AppendArgs, Conn, EventsArgs, Failure, GetArgs};
use super::{AdviceArgs, LeaseIdArgs, OutboxArgs, PartitionsArgs, Pick, RefusalsArgs, Table};

/// The SDK client and a plain HTTP client sharing its connection pool.
pub(crate) struct Session {
    pub client: Client,
    pub http: reqwest::Client,
    pub url: String,
}

impl Session {
    pub(crate) fn new(conn: &Conn) -> Result<Self, Failure> {
        let http = crate::http_builder(conn.api_key.as_deref(), conn.ca_cert.as_deref())
            .map_err(Failure::Usage)?
            .connect_timeout(palisade_client::CONNECT_TIMEOUT)
            .timeout(palisade_client::REQUEST_TIMEOUT)
            .build()
            .map_err(|e| Failure::Unexpected(format!("cannot build an HTTP client: {e}")))?;
        let client = Client::with_http_client(&conn.url, http.clone())
            .map_err(|e| Failure::client(e, &conn.url))?;
        Ok(Self {
            client,
            http,
            url: conn.url.clone(),
        })
    }

    pub(crate) fn fail(&self, e: palisade_client::ClientError) -> Failure {
        Failure::client(e, &self.url)
    }

    /// The URL of `segments` under the base URL, each percent-encoded.
    pub(crate) fn url(&self, segments: &[&str]) -> Result<Url, Failure> {
        let mut url = self.client.base_url().clone();
        url.path_segments_mut()
            .map_err(|()| Failure::Usage(format!("--url {}: cannot be a base", self.url)))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// GET a JSON document; a non-2xx answer is a refusal.
    pub(crate) async fn get_json(&self, url: Url) -> Result<Value, Failure> {
        let resp = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| Failure::transport(&e, &self.url))?;
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| Failure::transport(&e, &self.url))?;
        if !status.is_success() {
            return Err(Failure::refused(status.as_u16(), &body));
        }
        serde_json::from_slice(&body)
            .map_err(|e| Failure::Unexpected(format!("unexpected answer from {}: {e}", self.url)))
    }
}

fn json_line(v: &impl serde::Serialize) -> Result<(), Failure> {
    let s = serde_json::to_string(v)
        .map_err(|e| Failure::Unexpected(format!("cannot encode JSON: {e}")))?;
    out(s)
}

fn print_grant(g: &LeaseGrant, verb: &str, json: bool) -> Result<(), Failure> {
    if json {
        return json_line(g);
    }
    out(format!(
        "{verb} lease {}  scope {}  holder {}  token {}  ttl {} ms  purpose {}",
        g.lease_id, g.scope, g.holder, g.token, g.ttl_ms, g.purpose
    ))
}

pub(crate) async fn acquire(a: AcquireArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    // clap admits only the two names.
    let purpose = a
        .purpose
        .parse()
        .map_err(|e: palisade_core::PurposeError| Failure::Usage(e.to_string()))?;
    let grant = s
        .client
        .acquire_with_purpose(
            &a.scope,
            &a.holder,
            Duration::from_millis(a.ttl_ms),
            purpose,
        )
        .await
        .map_err(|e| s.fail(e))?;
    print_grant(&grant, "acquired", a.conn.json)
}

pub(crate) async fn renew(a: LeaseIdArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let grant = s.client.renew(&a.lease_id).await.map_err(|e| s.fail(e))?;
    print_grant(&grant, "renewed", a.conn.json)
}

pub(crate) async fn release(a: LeaseIdArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    s.client.release(&a.lease_id).await.map_err(|e| s.fail(e))?;
    if a.conn.json {
        return json_line(&json!({ "released": a.lease_id }));
    }
    out(format!("released lease {}", a.lease_id))
}

pub(crate) async fn advice(a: AdviceArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let advice = s
        .client
        .lease_advice(&a.scope, a.holder.as_deref())
        .await
        .map_err(|e| s.fail(e))?;
    if a.conn.json {
        return json_line(&advice);
    }
    let who = a.holder.as_deref().unwrap_or("every holder");
    let mut lines = vec![format!(
        "{} ({who}): {} renewal gaps, p50 {:.0} ms, tail {:.0} ms, max {:.0} ms; answer tail {:.1} ms; {} late renewals",
        advice.scope,
        advice.gaps,
        advice.renewal_gap.p50_ms,
        advice.renewal_gap.tail_ms,
        advice.renewal_gap.max_ms,
        advice.answer_latency.tail_ms,
        advice.late_renewals,
    )];
    lines.push(
        match (advice.recommended_ttl_ms, advice.recommended_renew_every_ms) {
            (Some(ttl), Some(every)) => format!(
                "recommended ttl {ttl} ms, renew every {every} ms (pause tail {:.0} ms)",
                advice.pause_tail_ms
            ),
            _ => "no recommendation yet: too few renewal gaps measured".to_owned(),
        },
    );
    if let Some(c) = &advice.current {
        lines.push(format!(
            "live lease: holder {} ttl {} ms{}",
            c.holder,
            c.ttl_ms,
            if c.ttl_below_tail {
                "  BELOW what the measured tails allow"
            } else {
                ""
            }
        ));
    }
    out(lines.join("\n"))
}

/// The fields of one event in an append body (as `docs/http-api.md`).
const EVENT_FIELDS: [&str; 4] = ["type", "patch", "event_id", "hlc"];

/// Events from an HTTP-style body: one event object or an array of them.
/// Unknown fields are refused here (the SDK's `Event` would drop them).
fn parse_body(text: &str, what: &str) -> Result<Vec<Event>, Failure> {
    let usage = |m: String| Failure::Usage(format!("{what}: {m}"));
    let v: Value = serde_json::from_str(text).map_err(|e| usage(format!("not JSON: {e}")))?;
    let items = match v {
        Value::Array(items) => items,
        one @ Value::Object(_) => vec![one],
        _ => return Err(usage("expected an event object or an array of them".into())),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(m) = &item else {
                return Err(usage(format!("event {i} is not an object")));
            };
            if let Some(k) = m.keys().find(|k| !EVENT_FIELDS.contains(&k.as_str())) {
                return Err(usage(format!(
                    "event {i}: unknown field {k:?} (expected type, patch, event_id, hlc)"
                )));
            }
            serde_json::from_value(item).map_err(|e| usage(format!("event {i}: {e}")))
        })
        .collect()
}

fn read_body(file: &Path) -> Result<Vec<Event>, Failure> {
    let (text, what) = if file == Path::new("-") {
        let text = std::io::read_to_string(std::io::stdin())
            .map_err(|e| Failure::Usage(format!("cannot read stdin: {e}")))?;
        (text, "stdin".to_owned())
    } else {
        let what = file.display().to_string();
        let text = std::fs::read_to_string(file)
            .map_err(|e| Failure::Usage(format!("cannot read {what}: {e}")))?;
        (text, what)
    };
    parse_body(&text, &what)
}

fn events_of(a: &AppendArgs, m: &ArgMatches) -> Result<Vec<Event>, Failure> {
    let side = pick(
        m,
        &["file"],
        &["patch", "event_type", "event_id"],
        "--file cannot be combined with --patch, --type or --event-id (its events carry them)",
    )?;
    if let (Pick::First, Some(file)) = (side, &a.file) {
        return read_body(file);
    }
    let Some(patch) = &a.patch else {
        return Err(Failure::Usage("give --patch JSON or --file FILE".into()));
    };
    let patch: Value = serde_json::from_str(patch)
        .map_err(|e| Failure::Usage(format!("--patch is not JSON: {e}")))?;
    if !patch.is_object() {
        return Err(Failure::Usage(
            "--patch must be a JSON object (a merge patch)".into(),
        ));
    }
    let id = a
        .event_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    Ok(vec![Event::new(a.event_type.clone(), patch).with_id(id)])
}

pub(crate) async fn append(a: AppendArgs, m: &ArgMatches) -> Result<(), Failure> {
    let events = events_of(&a, m)?;
    let s = Session::new(&a.conn)?;
    let result = match a.if_match {
        Some(v) => s.client.append_if_match(&a.twin, a.token, v, &events).await,
        None => s.client.append(&a.twin, a.token, &events).await,
    };
    let done = result.map_err(|e| s.fail(e))?;
    if a.conn.json {
        return json_line(&done);
    }
    out(describe_append(&a.twin, &done))
}

fn describe_append(twin: &str, a: &Appended) -> String {
    let n = a.seqs.len();
    let seqs = match (a.seqs.first(), a.seqs.last()) {
        (Some(f), Some(l)) if n > 1 => format!("seqs {f}..{l}"),
        (Some(f), _) => format!("seq {f}"),
        _ => "no seqs".to_owned(),
    };
    let dup = match a.duplicates {
        0 => String::new(),
        d => format!(" ({d} already stored, not appended again)"),
    };
    format!(
        "appended {n} event{} to {twin}: partition {}, {seqs}, version {}, fence {}{dup}",
        if n == 1 { "" } else { "s" },
        a.partition,
        a.version,
        a.fence
    )
}

pub(crate) async fn get(mut a: GetArgs, m: &ArgMatches) -> Result<(), Failure> {
    match pick(
        m,
        &["at_seq"],
        &["at_hlc"],
        "give --at-seq or --at-hlc, not both",
    )? {
        Pick::First => a.at_hlc = None,
        Pick::Second => a.at_seq = None,
        Pick::Neither => {}
    }
    let s = Session::new(&a.conn)?;
    let mut url = s.url(&["v1", "twins", &a.twin])?;
    if let Some(seq) = a.at_seq {
        url.query_pairs_mut()
            .append_pair("at_seq", &seq.to_string());
    }
    if let Some(h) = &a.at_hlc {
        url.query_pairs_mut().append_pair("at_hlc", h);
    }
    let doc = s.get_json(url).await?;
    if a.conn.json {
        return json_line(&doc);
    }
    let num = |k: &str| doc.get(k).map_or_else(String::new, Value::to_string);
    let at = match (a.at_seq, &a.at_hlc) {
        (Some(seq), _) => format!("  (as of seq {seq})"),
        (_, Some(h)) => format!("  (as of hlc {h})"),
        _ => String::new(),
    };
    out(format!(
        "twin {}  partition {}  version {}  fence {}{at}",
        a.twin,
        num("partition"),
        num("version"),
        num("fence")
    ))?;
    out(pretty(doc.get("state").unwrap_or(&Value::Null)))?;
    match doc.get("delta") {
        Some(d) if !d.is_null() => out(format!("delta: {}", compact(d))),
        _ => Ok(()),
    }
}

pub(crate) async fn events(a: EventsArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let page = s
        .client
        .events(&a.twin, a.after, a.limit)
        .await
        .map_err(|e| s.fail(e))?;
    if a.conn.json {
        for e in &page {
            json_line(e)?;
        }
        return Ok(());
    }
    if page.is_empty() {
        return out(format!("no events of {} after seq {}", a.twin, a.after));
    }
    let mut t = Table::new(["SEQ", "TYPE", "EVENT_ID", "TOKEN", "WRITER", "PATCH"]);
    for e in &page {
        t.row(event_row(e));
    }
    t.print()?;
    if page.len() >= a.limit {
        if let Some(last) = page.last() {
            eprintln!("(more may follow: --after {})", last.seq);
        }
    }
    Ok(())
}

/// `palisade refusals`: the twin's or partition's refusal journal.
pub(crate) async fn refusals(a: RefusalsArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let (list, what) = match (&a.twin, a.partition) {
        (Some(twin), _) => (
            s.client.twin_refusals(twin, a.limit).await,
            format!("twin {twin}"),
        ),
        (None, Some(p)) => (
            s.client.partition_refusals(p, a.limit).await,
            format!("partition {p}"),
        ),
        // clap requires one of the two.
        (None, None) => return Ok(()),
    };
    let list = list.map_err(|e| s.fail(e))?;
    if a.conn.json {
        for r in &list {
            json_line(r)?;
        }
        return Ok(());
    }
    if list.is_empty() {
        return out(format!("no refused writes of {what}"));
    }
    let mut t = Table::new([
        "AT_MS", "TWIN", "SOURCE", "REASON", "TOKEN", "FENCE", "HOLDER", "EVENTS", "DIGEST",
    ]);
    for r in &list {
        t.row([
            r.at_ms.to_string(),
            r.twin_id.clone(),
            match (r.source_partition, r.offset) {
                (Some(p), Some(o)) => format!("{}@{p}/{o}", r.source),
                _ => r.source.clone(),
            },
            r.reason.clone(),
            r.token.to_string(),
            r.fence.map_or_else(|| "-".to_owned(), |f| f.to_string()),
            r.principal
                .clone()
                .or_else(|| r.holder.clone())
                .unwrap_or_else(|| "-".to_owned()),
            r.event_ids.join(","),
            r.digest.get(..12).unwrap_or_default().to_owned(),
        ]);
    }
    t.print()
}

/// `palisade outbox`: effects of admitted events and their delivery states.
pub(crate) async fn outbox(a: OutboxArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    if let Some((p, seq, index)) = a.remove_dead {
        s.client
            .outbox_remove_dead(p, seq, index)
            .await
            .map_err(|e| s.fail(e))?;
        return out(format!("removed the dead effect {p}/{seq}/{index}"));
    }
    let list = s
        .client
        .outbox(a.state.as_deref(), a.limit)
        .await
        .map_err(|e| s.fail(e))?;
    if a.conn.json {
        for e in &list {
            json_line(e)?;
        }
        return Ok(());
    }
    if list.is_empty() {
        return out("no effects");
    }
    let mut t = Table::new([
        "PARTITION",
        "SEQ",
        "KEY",
        "TWIN",
        "TOKEN",
        "STATE",
        "TRIES",
        "URL",
        "LAST_ERROR",
    ]);
    for e in &list {
        t.row([
            e.partition.to_string(),
            e.seq.to_string(),
            e.idempotency_key.clone(),
            e.twin_id.clone(),
            e.token.to_string(),
            e.state.clone(),
            e.attempts.to_string(),
            e.url.clone(),
            e.last_error.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    t.print()
}

fn event_row(e: &StoredEvent) -> [String; 6] {
    [
        e.seq.to_string(),
        e.event_type.clone(),
        e.event_id.clone(),
        e.token.to_string(),
        e.writer.clone(),
        compact(&e.patch),
    ]
}

/// One line for `tail`: the event's seq, twin, type, patch and writer.
pub(crate) fn tail_line(e: &StoredEvent) -> String {
    format!(
        "{}  {}  {}  {}  (token {}, {})",
        e.seq,
        e.twin_id,
        e.event_type,
        compact(&e.patch),
        e.token,
        e.writer
    )
}

pub(crate) async fn partitions(a: PartitionsArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let doc = s.get_json(s.url(&["v1", "partitions"])?).await?;
    if a.conn.json {
        return json_line(&doc);
    }
    let mut t = Table::new(["PARTITION", "HEAD", "FENCE", "OWNER"]);
    for p in doc
        .get("partitions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let field = |k: &str| p.get(k).map_or_else(String::new, Value::to_string);
        let owner = match p.get("owner") {
            Some(o) if !o.is_null() => format!(
                "{} (token {}, {} ms left)",
                o.get("holder").and_then(Value::as_str).unwrap_or("?"),
                o.get("token").map_or_else(String::new, Value::to_string),
                o.get("expires_in_ms")
                    .map_or_else(String::new, Value::to_string)
            ),
            _ => "-".to_owned(),
        };
        t.row([field("partition"), field("head"), field("fence"), owner]);
    }
    t.print()?;
    out(format!(
        "last token: {}",
        doc.get("last_token")
            .map_or_else(String::new, Value::to_string)
    ))
}

pub(crate) fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_as_the_http_api_takes_them() {
        let one = parse_body(r#"{"type":"t","patch":{"a":1},"event_id":"e1"}"#, "f").unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].event_id.as_deref(), Some("e1"));
        let two = parse_body(
            r#"[{"type":"t","patch":{}},{"type":"u","patch":{"b":2},"hlc":"1/a"}]"#,
            "f",
        )
        .unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[1].hlc.as_deref(), Some("1/a"));
        for bad in [
            "nope",
            "3",
            "[3]",
            r#"{"type":"t","patch":{},"event-id":"x"}"#,
            r#"{"patch":{}}"#,
        ] {
            assert!(
                matches!(parse_body(bad, "f"), Err(Failure::Usage(_))),
                "{bad}"
            );
        }
        match parse_body(r#"{"type":"t","patch":{},"eventid":"x"}"#, "f") {
            Err(Failure::Usage(m)) => assert!(m.contains("\"eventid\""), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn append_lines() {
        let a = Appended {
            partition: 3,
            seqs: vec![7, 8],
            duplicates: 1,
            fence: 5,
            version: 2,
        };
        assert_eq!(
            describe_append("pump", &a),
            "appended 2 events to pump: partition 3, seqs 7..8, version 2, fence 5 (1 already stored, not appended again)"
        );
    }
}
