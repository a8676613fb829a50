//! `palisade tail`: follow a twin's or a partition's change stream
//! (`GET /v1/{twins/ID|partitions/P}/watch`, Server-Sent Events) and print
//! each event as it arrives.
//!
//! The starting point is resolved once (`--after`, or else the partition's
//! head when tail starts), and every (re)connect sends `Last-Event-ID` = the
//! last sequence number printed, so a dropped connection or a restarted
//! store costs neither a gap nor a duplicate. Events at or below the last
//! printed seq are skipped as a second guard.

use std::time::Duration;

use clap::ArgMatches;
use palisade_client::StoredEvent;
use palisade_core::{partition_for, TwinId};
use serde_json::Value;

use super::commands::{tail_line, Session};
use super::{chain, out, pick, Failure, Pick, TailArgs};

/// The store sends a keep-alive every 15 s; three missed ones mean the
/// connection is dead even if TCP has not noticed.
const IDLE: Duration = Duration::from_secs(45);
/// First wait before reconnecting; doubled up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

enum Source {
    Twin(String),
    Partition(u32),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Self::Twin(t) => format!("twin {t}"),
            Self::Partition(p) => format!("partition {p}"),
        }
    }
}

pub(crate) async fn tail(a: TailArgs, m: &ArgMatches) -> Result<(), Failure> {
    let side = pick(
        m,
        &["twin"],
        &["partition"],
        "give --twin or --partition, not both",
    )?;
    let source = match (side, &a.twin, a.partition) {
        (Pick::First, Some(t), _) => Source::Twin(t.clone()),
        (Pick::Second, _, Some(p)) => Source::Partition(p),
        _ => return Err(Failure::Usage("give --twin ID or --partition P".into())),
    };
    let s = Session::new(&a.conn)?;
    let url = match &source {
        Source::Twin(t) => s.url(&["v1", "twins", t, "watch"])?,
        Source::Partition(p) => s.url(&["v1", "partitions", &p.to_string(), "watch"])?,
    };
    // No overall timeout for the stream, only an idle one.
    let http = crate::http_builder(a.conn.api_key.as_deref(), a.conn.ca_cert.as_deref())
        .map_err(Failure::Usage)?
        .connect_timeout(palisade_client::CONNECT_TIMEOUT)
        .read_timeout(IDLE)
        .build()
        .map_err(|e| Failure::Unexpected(format!("cannot build an HTTP client: {e}")))?;
    let mut last = match a.after {
        Some(n) => Some(n),
        None => head(&s, &source).await?,
    };
    let mut connected = false;
    let mut dropped = false;
    let mut backoff = BACKOFF_MIN;
    loop {
        let mut req = http
            .get(url.clone())
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(l) = last {
            req = req.header("last-event-id", l.to_string());
        }
        let why = match req.send().await {
            Ok(resp) if resp.status().is_success() => {
                let from = last.map_or_else(|| "now".to_owned(), |l| format!("after seq {l}"));
                if !connected {
                    eprintln!(
                        "palisade: following {} {from} (Ctrl-C to stop)",
                        source.describe()
                    );
                } else if dropped {
                    eprintln!("palisade: reconnected; resuming {from}");
                }
                (connected, dropped, backoff) = (true, false, BACKOFF_MIN);
                follow(resp, &mut last, a.conn.json).await?
            }
            Ok(resp) => {
                let status = resp.status().as_u16();
                let body = resp.bytes().await.unwrap_or_default();
                // A refusal (unknown partition, bad twin id) is final; a 5xx
                // after we were connected (a proxy, a restart) is retried.
                if !connected || status < 500 {
                    return Err(Failure::refused(status, &body));
                }
                format!("HTTP {status}")
            }
            Err(e) if !connected => return Err(Failure::transport(&e, &s.url)),
            Err(e) => chain(&e),
        };
        if !dropped {
            let at = last.map_or_else(String::new, |l| format!(" after seq {l}"));
            eprintln!("palisade: stream dropped ({why}); reconnecting to resume{at}");
            dropped = true;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// The head of the partition being followed, so that a reconnect before
/// the first event resumes from when tail started (not from a later head).
async fn head(s: &Session, source: &Source) -> Result<Option<u64>, Failure> {
    let doc = s.get_json(s.url(&["v1", "partitions"])?).await?;
    let parts = doc
        .get("partitions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let Ok(n) = u32::try_from(parts.len()) else {
        return Ok(None);
    };
    if n == 0 {
        return Ok(None);
    }
    let p = match source {
        Source::Partition(p) => *p,
        Source::Twin(t) => {
            let id = TwinId::new(t.clone()).map_err(|e| Failure::Usage(format!("--twin: {e}")))?;
            partition_for(&id, n).0
        }
    };
    Ok(parts
        .iter()
        .find(|x| x.get("partition").and_then(Value::as_u64) == Some(u64::from(p)))
        .and_then(|x| x.get("head").and_then(Value::as_u64)))
}

/// Read one connection's stream until it ends; returns why it ended.
async fn follow(
    mut resp: reqwest::Response,
    last: &mut Option<u64>,
    json: bool,
) -> Result<String, Failure> {
    let mut parser = SseParser::default();
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => {
                for ev in parser.feed(&bytes) {
                    print_event(&ev, last, json)?;
                }
            }
            Ok(None) => return Ok("the store closed it".to_owned()),
            Err(e) => return Ok(chain(&e)),
        }
    }
}

fn print_event(ev: &SseEvent, last: &mut Option<u64>, json: bool) -> Result<(), Failure> {
    if ev.event == "error" {
        eprintln!("palisade: the store reported an error: {}", ev.data);
        return Ok(());
    }
    let id = ev.id.as_deref().and_then(|i| i.trim().parse::<u64>().ok());
    if let (Some(id), Some(l)) = (id, *last) {
        if id <= l {
            return Ok(()); // already printed
        }
    }
    let line = match serde_json::from_str::<Value>(&ev.data) {
        Ok(v) if json => v.to_string(),
        Ok(v) => match serde_json::from_value::<StoredEvent>(v) {
            Ok(e) => tail_line(&e),
            Err(_) => ev.data.clone(),
        },
        Err(_) => ev.data.clone(),
    };
    out(line)?;
    if id.is_some() {
        *last = id;
    }
    Ok(())
}

/// One Server-Sent Event.
#[derive(Debug, PartialEq, Eq)]
struct SseEvent {
    id: Option<String>,
    event: String,
    data: String,
}

/// An incremental `text/event-stream` parser: bytes in (split anywhere,
/// even inside a UTF-8 character), whole events out.
#[derive(Debug, Default)]
struct SseParser {
    buf: Vec<u8>,
    id: Option<String>,
    event: Option<String>,
    data: Option<String>,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let mut raw: Vec<u8> = self.buf.drain(..=pos).collect();
            raw.pop();
            if raw.last() == Some(&b'\r') {
                raw.pop();
            }
            let line = String::from_utf8_lossy(&raw);
            if line.is_empty() {
                // Dispatch; a block without data (a bare id) is no event.
                let (id, event) = (self.id.take(), self.event.take());
                if let Some(data) = self.data.take() {
                    events.push(SseEvent {
                        id,
                        event: event.unwrap_or_else(|| "message".to_owned()),
                        data,
                    });
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment: the store's keep-alive
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (&*line, ""),
            };
            match field {
                "id" => self.id = Some(value.to_owned()),
                "event" => self.event = Some(value.to_owned()),
                "data" => match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => self.data = Some(value.to_owned()),
                },
                _ => {}
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(id: &str, data: &str) -> SseEvent {
        SseEvent {
            id: Some(id.to_owned()),
            event: "event".to_owned(),
            data: data.to_owned(),
        }
    }

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = "id: 1\nevent: event\ndata: {\"t\":\"é\"}\n\n: keep-alive\n\nid: 2\r\nevent: event\r\ndata: {}\r\n\r\n";
        let whole = SseParser::default().feed(stream.as_bytes());
        assert_eq!(whole, [ev("1", "{\"t\":\"é\"}"), ev("2", "{}")]);
        // Every split point, including inside the two-byte 'é'.
        let bytes = stream.as_bytes();
        for cut in 0..bytes.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&bytes[..cut]);
            got.extend(p.feed(&bytes[cut..]));
            assert_eq!(got, whole, "split at {cut}");
        }
    }

    #[test]
    fn multi_line_data_and_defaults() {
        let got = SseParser::default().feed(b"data: a\ndata:b\n\nid: 9\n\n");
        assert_eq!(
            got,
            [SseEvent {
                id: None,
                event: "message".to_owned(),
                data: "a\nb".to_owned()
            }]
        );
        // Nothing until the blank line.
        assert!(SseParser::default().feed(b"id: 1\ndata: x\n").is_empty());
    }

    #[test]
    fn already_printed_events_are_skipped() {
        let mut last = Some(5);
        print_event(&ev("5", "{}"), &mut last, true).unwrap();
        assert_eq!(last, Some(5));
        print_event(&ev("4", "{}"), &mut last, true).unwrap();
        assert_eq!(last, Some(5));
    }
}
