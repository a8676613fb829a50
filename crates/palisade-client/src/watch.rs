//! Change streams: [`EventStream`] over the store's Server-Sent Events
//! (`GET /v1/twins/{id}/watch`, `GET /v1/partitions/{p}/watch`), with a small
//! SSE parser of its own.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::stream::{self, Stream};

use crate::error::ClientError;
use crate::types::StoredEvent;

/// A change stream ends with [`ClientError::Stream`] (`idle_timeout`) when
/// nothing arrives for this long: the store sends a keep-alive every 15 s,
/// so this is three missed keep-alives. Also bounds the wait for the
/// stream's response headers.
pub const WATCH_IDLE_TIMEOUT: Duration = Duration::from_secs(45);

/// Where a change stream starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WatchFrom {
    /// At the current head: only events appended from now on.
    #[default]
    Now,
    /// Right after the event with this partition seq, sent as
    /// `Last-Event-ID`: no gap and no duplicate when resuming from
    /// [`EventStream::last_event_id`]. `After(0)` replays the whole history
    /// first.
    After(u64),
}

/// A live stream of stored events, oldest first, from
/// [`Client::watch_twin`](crate::Client::watch_twin) or
/// [`Client::watch_partition`](crate::Client::watch_partition).
///
/// Items are `Ok(event)`, or `Err` for:
/// - [`ClientError::Stream`] `storage` / `bad_event`: reported, the stream
///   goes on;
/// - [`ClientError::Stream`] `idle_timeout` or [`ClientError::Transport`]
///   (the connection broke): the last item, the stream then ends.
///
/// The stream also ends (`None`) when the server closes it (shutdown). It
/// never reconnects by itself: to resume, open a new one with
/// `WatchFrom::After(stream.last_event_id()?)`.
pub struct EventStream {
    inner: Pin<Box<dyn Stream<Item = Result<StoredEvent, ClientError>> + Send>>,
    last: Option<u64>,
    start: WatchFrom,
}

impl fmt::Debug for EventStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventStream")
            .field("start", &self.start)
            .field("last_event_id", &self.last)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    pub(crate) fn new(resp: reqwest::Response, start: WatchFrom) -> Self {
        let state = State {
            resp: Some(resp),
            parser: SseParser::default(),
            ready: VecDeque::new(),
        };
        let inner = stream::unfold(state, |mut s| async move {
            loop {
                if let Some(item) = s.ready.pop_front() {
                    return Some((item, s));
                }
                let resp = s.resp.as_mut()?;
                match tokio::time::timeout(WATCH_IDLE_TIMEOUT, resp.chunk()).await {
                    Err(_) => {
                        s.resp = None;
                        let msg = format!("nothing received for {WATCH_IDLE_TIMEOUT:?}");
                        return Some((Err(stream_error("idle_timeout", msg)), s));
                    }
                    Ok(Err(e)) => {
                        s.resp = None;
                        return Some((Err(ClientError::Transport(e)), s));
                    }
                    Ok(Ok(None)) => return None, // closed by the server
                    Ok(Ok(Some(chunk))) => {
                        for msg in s.parser.push(&chunk) {
                            s.ready.push_back(decode(msg));
                        }
                    }
                }
            }
        });
        Self {
            inner: Box::pin(inner),
            last: None,
            start,
        }
    }

    /// The partition seq of the last event this stream yielded; `None`
    /// before the first. Resume with `WatchFrom::After(id)` to continue with
    /// the next event, none missed and none repeated.
    pub fn last_event_id(&self) -> Option<u64> {
        self.last
    }

    /// Where to start a new stream that continues this one: after its last
    /// event, or where this one started if it yielded none.
    pub fn resume_from(&self) -> WatchFrom {
        self.last.map_or(self.start, WatchFrom::After)
    }
}

impl Stream for EventStream {
    type Item = Result<StoredEvent, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let next = this.inner.as_mut().poll_next(cx);
        if let Poll::Ready(Some(Ok(ev))) = &next {
            this.last = Some(ev.seq);
        }
        next
    }
}

struct State {
    /// `None` once the connection failed: the stream ends after the error.
    resp: Option<reqwest::Response>,
    parser: SseParser,
    ready: VecDeque<Result<StoredEvent, ClientError>>,
}

fn stream_error(error: &str, message: String) -> ClientError {
    ClientError::Stream {
        error: error.to_owned(),
        message,
    }
}

/// An SSE message as the store sends them: `event: event` with an event's
/// JSON, or `event: error` with `{"error", "message"}`.
fn decode(msg: SseMessage) -> Result<StoredEvent, ClientError> {
    match msg.event.as_str() {
        "event" | "message" => serde_json::from_str(&msg.data).map_err(|e| {
            stream_error(
                "bad_event",
                format!("event id {:?}: {e}", msg.id.unwrap_or_default()),
            )
        }),
        "error" => Err(
            match serde_json::from_str::<palisade_api::ErrorBody>(&msg.data) {
                Ok(body) => ClientError::Stream {
                    error: body.error,
                    message: body.message,
                },
                // Not the store's error body: the frame's text is all there is.
                Err(_) => stream_error("stream_error", msg.data),
            },
        ),
        other => Err(stream_error(
            "bad_event",
            format!("unexpected SSE event type {other:?}"),
        )),
    }
}

/// One dispatched Server-Sent Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseMessage {
    /// The last event id at dispatch (it carries over to later events).
    pub id: Option<String>,
    /// `message` unless an `event:` field named it.
    pub event: String,
    /// The `data:` lines joined by `\n`.
    pub data: String,
}

/// An incremental parser of `text/event-stream` (the WHATWG rules, minus
/// `retry`): feed it chunks as they arrive, cut anywhere.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    /// Bytes of a line not yet terminated.
    buf: Vec<u8>,
    /// The previous chunk ended in `\r`: a `\n` opening this one belongs to it.
    after_cr: bool,
    /// The BOM check is done (only the stream's first bytes may carry one).
    started: bool,
    data: Option<String>,
    event: Option<String>,
    last_id: Option<String>,
}

impl SseParser {
    /// The events completed by `chunk`.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Vec<SseMessage> {
        let mut out = Vec::new();
        let mut rest = chunk;
        if self.after_cr {
            self.after_cr = false;
            if let Some(r) = rest.strip_prefix(b"\n") {
                rest = r;
            }
        }
        while let Some(i) = rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            self.buf.extend_from_slice(&rest[..i]);
            if rest[i] == b'\r' {
                match rest.get(i + 1) {
                    Some(b'\n') => rest = &rest[i + 2..],
                    Some(_) => rest = &rest[i + 1..],
                    None => {
                        self.after_cr = true;
                        rest = &[];
                    }
                }
            } else {
                rest = &rest[i + 1..];
            }
            let line = std::mem::take(&mut self.buf);
            if let Some(msg) = self.line(&line) {
                out.push(msg);
            }
        }
        self.buf.extend_from_slice(rest);
        out
    }

    fn line(&mut self, line: &[u8]) -> Option<SseMessage> {
        let mut line = String::from_utf8_lossy(line).into_owned();
        if !self.started {
            self.started = true;
            if let Some(l) = line.strip_prefix('\u{feff}') {
                line = l.to_owned();
            }
        }
        if line.is_empty() {
            return self.dispatch();
        }
        if line.starts_with(':') {
            return None; // a comment (keep-alive)
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_str(), ""),
        };
        match field {
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            "event" => self.event = Some(value.to_owned()),
            "id" if !value.contains('\0') => self.last_id = Some(value.to_owned()),
            _ => {} // `retry` and unknown fields are ignored
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseMessage> {
        let event = self.event.take();
        let data = self.data.take()?;
        Some(SseMessage {
            id: self.last_id.clone(),
            event: event
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "message".to_owned()),
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: Option<&str>, event: &str, data: &str) -> SseMessage {
        SseMessage {
            id: id.map(str::to_owned),
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    const SAMPLE: &[u8] = b"\xEF\xBB\xBF: keep-alive\n\nid: 3\nevent: event\ndata: {\"a\":1}\n\n:\r\ndata:x\r\ndata: y\r\n\r\nevent: error\ndata: e\rid: 9\r\r";

    fn expected() -> Vec<SseMessage> {
        vec![
            msg(Some("3"), "event", "{\"a\":1}"),
            msg(Some("3"), "message", "x\ny"),
            msg(Some("9"), "error", "e"),
        ]
    }

    #[test]
    fn parses_events_comments_and_line_endings() {
        let mut p = SseParser::default();
        assert_eq!(p.push(SAMPLE), expected());
        // The stream ended in `\r`: a `\n` next completes that line ending,
        // it is not another (empty) line.
        assert_eq!(p.push(b"\n"), vec![]);
        assert_eq!(p.push(b"data: z\n\n"), vec![msg(Some("9"), "message", "z")]);
    }

    #[test]
    fn chunks_may_be_cut_anywhere() {
        for cut in 0..=SAMPLE.len() {
            let mut p = SseParser::default();
            let mut got = p.push(&SAMPLE[..cut]);
            got.extend(p.push(&SAMPLE[cut..]));
            got.extend(p.push(b"x"));
            assert_eq!(got, expected(), "cut at {cut}");
        }
        // Byte by byte.
        let mut p = SseParser::default();
        let mut got = Vec::new();
        for b in SAMPLE {
            got.extend(p.push(&[*b]));
        }
        got.extend(p.push(b"\n"));
        assert_eq!(got, expected());
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_and_the_id_carries_over() {
        let mut p = SseParser::default();
        let got = p.push(b"id: 5\nevent: event\n\ndata: d\n\nid\ndata:\ndata\n\n");
        assert_eq!(
            got,
            vec![
                msg(Some("5"), "message", "d"),
                msg(Some(""), "message", "\n")
            ]
        );
    }

    #[test]
    fn decodes_store_messages() {
        let ev = r#"{"seq":7,"twin_id":"t","event_id":"e","type":"set","patch":{},"hlc":"1/1","writer":"w","token":2,"appended_at_ms":0}"#;
        let got = decode(msg(Some("7"), "event", ev)).unwrap();
        assert_eq!((got.seq, got.twin_id.as_str()), (7, "t"));
        match decode(msg(
            None,
            "error",
            r#"{"error":"storage","message":"disk"}"#,
        )) {
            Err(ClientError::Stream { error, message }) => {
                assert_eq!((error.as_str(), message.as_str()), ("storage", "disk"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode(msg(Some("1"), "event", "{")),
            Err(ClientError::Stream { error, .. }) if error == "bad_event"
        ));
    }
}
