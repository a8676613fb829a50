//! Connections: the accept loop, the connection cap and per-address budget,
//! and the header, body, idle and write-stall timeouts.
//!
//! Everything here happens before authentication, so it is what stands
//! between any client that can reach the port and the process's file
//! descriptors. axum's own `serve` has none of it (a client that sends half
//! its headers keeps its socket forever), so the connections are driven
//! with hyper's HTTP/1 server directly:
//!
//! - **cap**: at most [`ConnectionLimits::max_connections`] open, and
//!   [`ConnectionLimits::max_connections_per_ip`] from one address; past
//!   either, the connection is answered `503 too_many_connections` (or
//!   `too_many_connections_from_address`) with `Connection: close`, by a
//!   small bounded set of refusal tasks (past those, it is just closed).
//! - **timeouts**, per connection, by a watchdog that follows its phase:
//!   a new connection (after its TLS handshake, itself bounded by the header
//!   timeout) must deliver a request's headers within `header_timeout`;
//!   between requests a keep-alive connection may stay silent for
//!   `idle_timeout`, after which the next request's headers again get
//!   `header_timeout` from their first byte; a request body must be complete
//!   within `body_timeout` of its headers (else `408 body_timeout`); and a
//!   response the client stops reading (a full socket buffer) may stall for
//!   `idle_timeout`. A request being handled has no deadline here: a
//!   change stream (SSE) lives as long as its client reads it.
//! - **accept errors** (out of file descriptors and the like) back off, from
//!   10 ms doubling to 1 s, and are logged once per burst (which ends after
//!   5 s without a failure), not per retry.
//!
//! Metrics (`/metrics`): `palisade_http_connections_open`,
//! `palisade_http_connections_max`, `palisade_http_connections_refused_total{reason}`,
//! `palisade_http_timeouts_total{phase}`, `palisade_http_accept_errors_total`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use palisade_log::Store;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tower_service::Service;
use tracing::{debug, info, warn};

use crate::error::ApiError;
use crate::tls::TlsAcceptor;
use crate::wire::ErrorName;

/// Limits on client connections (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once (counted from `accept`, TLS handshakes
    /// included). `palisade serve` lowers it to fit the open-file limit.
    pub max_connections: usize,
    /// Most connections open at once from one IP address.
    pub max_connections_per_ip: usize,
    /// Time to send a request's headers: from the connection's start (after
    /// the TLS handshake, which gets as long again) or from the first byte
    /// of a later request on a keep-alive connection.
    pub header_timeout: Duration,
    /// Time to send a request's body, from the end of its headers.
    pub body_timeout: Duration,
    /// Silence allowed between requests on a keep-alive connection; also how
    /// long a response may wait for a client that stopped reading it.
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_ip: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Connections refused at once (each answered with a 503 by its own task,
/// which holds a socket for at most [`REFUSAL_TIME`]); past this many, a
/// refused connection is closed without an answer, so refusing can never
/// use up the file descriptors the cap protects.
const MAX_REFUSING: usize = 8;
/// The longest a refused connection is kept: to read its request and send
/// the 503 (and the TLS handshake first over HTTPS).
const REFUSAL_TIME: Duration = Duration::from_secs(2);
/// Back-off after a failed `accept`: first delay and ceiling.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// A burst of accept failures ends after this long without one.
const BURST_QUIET: Duration = Duration::from_secs(5);
/// Refusals are logged at most this often (with a count), not one line each.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Why a connection was refused (the `reason` label and the error name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Total,
    PerIp,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Self::Total => "max_connections",
            Self::PerIp => "max_connections_per_ip",
        }
    }
}

/// Which deadline closed a connection (the `phase` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    TlsHandshake,
    Header,
    Body,
    Idle,
    Write,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Self::TlsHandshake => "tls_handshake",
            Self::Header => "header",
            Self::Body => "body",
            Self::Idle => "idle",
            Self::Write => "write",
        }
    }
}

/// State shared by the accept loop and every connection task.
struct Shared {
    limits: ConnectionLimits,
    store: Arc<Store>,
    open: AtomicUsize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    refusing: AtomicUsize,
    /// When refusals were last logged, and how many since.
    refusal_log: Mutex<(Option<std::time::Instant>, u64)>,
}

impl Shared {
    fn timeout(&self, phase: Phase, addr: SocketAddr) {
        debug!(%addr, phase = phase.label(), "connection closed: timeout");
        self.store.metrics().add(
            "palisade_http_timeouts_total",
            "Connections closed (or requests answered 408) because a client was too slow, by phase.",
            &[("phase", phase.label())],
            1,
        );
    }

    fn gauge_open(&self, n: usize) {
        #[allow(clippy::cast_precision_loss)]
        self.store.metrics().set_gauge(
            "palisade_http_connections_open",
            "Client connections open (TLS handshakes included).",
            &[],
            n as f64,
        );
    }

    /// Take a connection slot for `ip`, or say why not.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Refusal> {
        let ip = ip.to_canonical();
        // The total is checked under the per-address lock too, so the two
        // counts never disagree about a connection being admitted.
        let mut per_ip = self.per_ip.lock().map_err(|_| Refusal::Total)?;
        if self.open.load(Ordering::Relaxed) >= self.limits.max_connections {
            return Err(Refusal::Total);
        }
        let n = per_ip.entry(ip).or_insert(0);
        if *n >= self.limits.max_connections_per_ip {
            return Err(Refusal::PerIp);
        }
        *n += 1;
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        drop(per_ip);
        self.gauge_open(open);
        Ok(Slot {
            shared: self.clone(),
            ip,
        })
    }

    fn log_refusal(&self, why: Refusal, addr: SocketAddr) {
        let Ok(mut log) = self.refusal_log.lock() else {
            return;
        };
        log.1 += 1;
        let now = std::time::Instant::now();
        if log
            .0
            .is_none_or(|at| now.duration_since(at) >= REFUSAL_LOG_EVERY)
        {
            warn!(
                %addr,
                reason = why.label(),
                refused = log.1,
                open = self.open.load(Ordering::Relaxed),
                max_connections = self.limits.max_connections,
                max_connections_per_ip = self.limits.max_connections_per_ip,
                "refusing connections (logged at most every 10 s; `refused` counts since the last line)"
            );
            *log = (Some(now), 0);
        }
    }
}

/// One admitted connection; dropping it frees the slot.
struct Slot {
    shared: Arc<Shared>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut per_ip) = self.shared.per_ip.lock() {
            if let Some(n) = per_ip.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    per_ip.remove(&self.ip);
                }
            }
        }
        let open = self.shared.open.fetch_sub(1, Ordering::Relaxed) - 1;
        self.shared.gauge_open(open);
    }
}

/// Serve `app` on `listener` (over TLS with `tls`) until `closing` turns
/// true, then finish the connections in flight (idle ones close at once,
/// change streams end on `closing`).
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    store: Arc<Store>,
    limits: ConnectionLimits,
    mut closing: watch::Receiver<bool>,
) -> io::Result<()> {
    #[allow(clippy::cast_precision_loss)]
    store.metrics().set_gauge(
        "palisade_http_connections_max",
        "The cap on open client connections (after fitting it to the open-file limit).",
        &[],
        limits.max_connections as f64,
    );
    let shared = Arc::new(Shared {
        limits,
        store,
        open: AtomicUsize::new(0),
        per_ip: Mutex::new(HashMap::new()),
        refusing: AtomicUsize::new(0),
        refusal_log: Mutex::new((None, 0)),
    });
    shared.gauge_open(0);
    // Every connection task holds a receiver; `closed()` on the sender
    // resolves once all of them have ended (graceful shutdown waits on it).
    let (alive_tx, alive_rx) = watch::channel(());
    let mut burst: Option<Burst> = None;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = closing.wait_for(|c| *c) => break,
        };
        match accepted {
            Ok((tcp, addr)) => {
                if let Some(b) = &mut burst {
                    // Descriptors were freed: retry at full speed next time,
                    // but the burst only ends after a quiet spell, so
                    // alternating failures are not logged one by one.
                    b.delay = ACCEPT_BACKOFF_FIRST;
                    if b.last.elapsed() >= BURST_QUIET {
                        info!(
                            failures = b.failures,
                            lasted_ms = b.last.duration_since(b.started).as_millis(),
                            open = shared.open.load(Ordering::Relaxed),
                            "accepting connections again"
                        );
                        burst = None;
                    }
                }
                // Small JSON answers: no Nagle delay.
                let _ = tcp.set_nodelay(true);
                match shared.admit(addr.ip()) {
                    Ok(slot) => {
                        let conn = Conn {
                            shared: shared.clone(),
                            app: app.clone(),
                            addr,
                            closing: closing.clone(),
                        };
                        let (tls, alive) = (tls.clone(), alive_rx.clone());
                        tokio::spawn(async move {
                            conn.run(tcp, tls).await;
                            drop((slot, alive));
                        });
                    }
                    Err(why) => refuse(&shared, tcp, addr, tls.clone(), why),
                }
            }
            // Errors of one connection that died before it was accepted.
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                shared.store.metrics().add(
                    "palisade_http_accept_errors_total",
                    "Failed accepts (e.g. out of file descriptors), each followed by a back-off.",
                    &[],
                    1,
                );
                let b = burst.get_or_insert_with(|| {
                    warn!(
                        error = %e,
                        open = shared.open.load(Ordering::Relaxed),
                        "accept failed; backing off until it works again (logged once per burst)"
                    );
                    Burst {
                        started: Instant::now(),
                        last: Instant::now(),
                        failures: 0,
                        delay: ACCEPT_BACKOFF_FIRST,
                    }
                });
                b.failures += 1;
                b.last = Instant::now();
                let delay = b.delay;
                b.delay = (b.delay * 2).min(ACCEPT_BACKOFF_MAX);
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = closing.wait_for(|c| *c) => break,
                }
            }
        }
    }
    // Stop accepting first (the port is free for a restart at once), then
    // wait for the connections in flight.
    drop(listener);
    drop(alive_rx);
    alive_tx.closed().await;
    Ok(())
}

/// A run of failed accepts, logged once when it starts and once when it
/// ends (the first accept after [`BURST_QUIET`] without a failure).
struct Burst {
    started: Instant,
    /// The latest failure.
    last: Instant,
    failures: u64,
    /// The next back-off.
    delay: Duration,
}

/// Errors that concern one connection only (retry at once, as hyper-util does).
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Answer a connection past the cap with a 503 and close it.
///
/// Over plain HTTP the answer is written at once, without waiting for the
/// request (a fresh socket's buffer always takes it; HTTP clients read it as
/// the answer to the request they send); a refusal task then reads and
/// discards what the client sends until it closes, so the close is a FIN,
/// not a reset that could destroy the answer in flight. Over HTTPS a
/// refusal task does the handshake, reads the request and answers it. At
/// most [`MAX_REFUSING`] such tasks exist; past them a plain connection
/// still gets its answer written, a TLS one is just closed.
fn refuse(
    shared: &Arc<Shared>,
    tcp: TcpStream,
    addr: SocketAddr,
    tls: Option<TlsAcceptor>,
    why: Refusal,
) {
    shared.store.metrics().add(
        "palisade_http_connections_refused_total",
        "Client connections refused at the connection cap, by reason.",
        &[("reason", why.label())],
        1,
    );
    shared.log_refusal(why, addr);
    let (max, per_ip) = (
        shared.limits.max_connections,
        shared.limits.max_connections_per_ip,
    );
    if tls.is_none() {
        let _ = tcp.try_write(&refusal_bytes(why, max, per_ip));
    }
    if shared.refusing.fetch_add(1, Ordering::Relaxed) >= MAX_REFUSING {
        shared.refusing.fetch_sub(1, Ordering::Relaxed);
        return; // dropping `tcp` closes it
    }
    let shared = shared.clone();
    tokio::spawn(async move {
        let answer = async move {
            match tls {
                None => linger(tcp).await,
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(tcp).await {
                        answer_refusal(stream, why, max, per_ip).await;
                    }
                }
            }
        };
        let _ = tokio::time::timeout(REFUSAL_TIME, answer).await;
        shared.refusing.fetch_sub(1, Ordering::Relaxed);
    });
}

/// Half-close a refused connection and discard what the client still
/// sends, until it closes too.
async fn linger(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut sink = [0u8; 1024];
    while let Ok(n) = tcp.read(&mut sink).await {
        if n == 0 {
            break;
        }
    }
}

/// The refusal as raw HTTP/1.1 bytes (the same JSON as [`refusal_response`]).
fn refusal_bytes(why: Refusal, max: usize, per_ip: usize) -> Vec<u8> {
    let (error, message) = refusal_text(why, max, per_ip);
    let body = serde_json::json!({ "error": error, "message": message }).to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn refusal_text(why: Refusal, max: usize, per_ip: usize) -> (&'static str, String) {
    match why {
        Refusal::Total => (
            ErrorName::TooManyConnections.as_str(),
            format!(
                "the server has {max} connections open, its limit (--max-connections); retry later"
            ),
        ),
        Refusal::PerIp => (
            ErrorName::TooManyConnectionsFromAddress.as_str(),
            format!(
                "your address has {per_ip} connections open, the limit per address \
                 (--max-connections-per-ip); close one or retry later"
            ),
        ),
    }
}

/// Read the request's head and answer it with the refusal, then close.
async fn answer_refusal<IO>(io: IO, why: Refusal, max: usize, per_ip: usize)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
        std::future::ready(Ok::<_, Infallible>(refusal_response(why, max, per_ip)))
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

fn refusal_response(why: Refusal, max: usize, per_ip: usize) -> Response<Body> {
    let (error, message) = refusal_text(why, max, per_ip);
    let err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error, message);
    let mut resp = err.into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// One admitted connection.
struct Conn {
    shared: Arc<Shared>,
    app: Router,
    addr: SocketAddr,
    closing: watch::Receiver<bool>,
}

impl Conn {
    async fn run(self, tcp: TcpStream, tls: Option<TlsAcceptor>) {
        let Some(acceptor) = tls else {
            return self.http(tcp).await;
        };
        // The handshake is bounded like a request's head: a client that
        // connects and says nothing must not hold a socket.
        let limit = self.shared.limits.header_timeout;
        match tokio::time::timeout(limit, acceptor.accept(tcp)).await {
            Ok(Ok(stream)) => self.http(stream).await,
            Ok(Err(e)) => debug!(addr = %self.addr, error = %e, "TLS handshake failed"),
            Err(_) => self.shared.timeout(Phase::TlsHandshake, self.addr),
        }
    }

    /// Serve HTTP/1.1 on `io` until the client closes, a deadline passes or
    /// the server shuts down.
    async fn http<IO>(mut self, io: IO)
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let state = Arc::new(ConnState::new());
        let io = TokioIo::new(Watched {
            io,
            state: state.clone(),
        });
        let svc = ConnService {
            app: self.app.clone(),
            state: state.clone(),
            shared: self.shared.clone(),
            addr: self.addr,
        };
        // hyper's own header timeout would run from the end of one response
        // to the next request's end of headers, which is our idle *and*
        // header timeout in one; the watchdog below keeps them apart.
        let conn = hyper::server::conn::http1::Builder::new()
            .header_read_timeout(None)
            .serve_connection(io, svc);
        tokio::pin!(conn);
        let watchdog = watchdog(state, self.shared.limits.clone());
        tokio::pin!(watchdog);
        let mut draining = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        debug!(addr = %self.addr, error = %e, "connection ended with an error");
                    }
                    return;
                }
                phase = &mut watchdog => {
                    // Dropping the connection closes the socket.
                    self.shared.timeout(phase, self.addr);
                    return;
                }
                _ = self.closing.wait_for(|c| *c), if !draining => {
                    // Idle: closes now; mid-request: after its response.
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
        }
    }
}

const HEAD: u8 = 0;
const BUSY: u8 = 1;
const IDLE: u8 = 2;
const NOT_BLOCKED: u64 = u64::MAX;

/// Where a connection is, for its watchdog: waiting for a request's head
/// (`HEAD`), handling a request until its response is written (`BUSY`), or
/// between requests (`IDLE`). Times are milliseconds since `epoch`.
struct ConnState {
    epoch: Instant,
    phase: AtomicU8,
    since_ms: AtomicU64,
    /// Requests whose response has not been written yet.
    busy: AtomicUsize,
    /// Since when a write has been waiting for the client to read.
    write_blocked_ms: AtomicU64,
}

impl ConnState {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            // A new connection is expected to send a request at once.
            phase: AtomicU8::new(HEAD),
            since_ms: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            write_blocked_ms: AtomicU64::new(NOT_BLOCKED),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn set_phase(&self, phase: u8) {
        self.since_ms.store(self.now_ms(), Ordering::Relaxed);
        self.phase.store(phase, Ordering::Relaxed);
    }

    /// Bytes arrived: between requests, that starts the next one's head.
    /// (Bytes of a pipelined request read while another is handled are
    /// not told apart from its body; that request's head then gets the
    /// idle timeout instead of the header timeout: still bounded.)
    fn on_read(&self) {
        if self.phase.load(Ordering::Relaxed) == IDLE {
            self.set_phase(HEAD);
        }
    }

    fn begin_request(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.set_phase(BUSY);
    }

    fn end_request(&self) {
        if self.busy.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.set_phase(IDLE);
        }
    }

    fn write_pending(&self) {
        if self.write_blocked_ms.load(Ordering::Relaxed) == NOT_BLOCKED {
            self.write_blocked_ms
                .store(self.now_ms(), Ordering::Relaxed);
        }
    }

    fn write_done(&self) {
        self.write_blocked_ms.store(NOT_BLOCKED, Ordering::Relaxed);
    }

    /// The next deadline and the phase it belongs to.
    fn deadline(&self, l: &ConnectionLimits) -> Option<(Instant, Phase)> {
        let at = |ms: u64, d: Duration| self.epoch + Duration::from_millis(ms) + d;
        let since = self.since_ms.load(Ordering::Relaxed);
        let phase = match self.phase.load(Ordering::Relaxed) {
            HEAD => Some((at(since, l.header_timeout), Phase::Header)),
            IDLE => Some((at(since, l.idle_timeout), Phase::Idle)),
            _ => None,
        };
        let blocked = self.write_blocked_ms.load(Ordering::Relaxed);
        let write = (blocked != NOT_BLOCKED).then(|| (at(blocked, l.idle_timeout), Phase::Write));
        match (phase, write) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// Resolves with the phase whose deadline passed.
///
/// It is not woken by the connection's phase changes (that was two task
/// wake-ups per request on the hot path): it looks at the state at least
/// every `min(header, idle)` timeout instead. That is never late: a phase
/// or a stalled write that starts at `s` has its deadline at `s` plus one
/// of those timeouts or more, and the next look, at most one step after
/// `s`, sees it and sleeps until exactly then.
async fn watchdog(state: Arc<ConnState>, limits: ConnectionLimits) -> Phase {
    let step = limits.header_timeout.min(limits.idle_timeout);
    loop {
        let now = Instant::now();
        let wake = match state.deadline(&limits) {
            Some((at, phase)) if at <= now => return phase,
            Some((at, _)) => at.min(now + step),
            None => now + step,
        };
        tokio::time::sleep_until(wake).await;
    }
}

/// The connection's socket, telling [`ConnState`] about reads and stalled writes.
struct Watched<IO> {
    io: IO,
    state: Arc<ConnState>,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.state.on_read();
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> Watched<IO> {
    fn track<T>(&self, r: Poll<T>) -> Poll<T> {
        if r.is_pending() {
            self.state.write_pending();
        } else {
            self.state.write_done();
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.track(r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.track(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_flush(cx);
        this.track(r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The router as one connection's hyper service: marks the connection busy
/// from a request's head to the end of its response, and bounds the time
/// its body may take.
#[derive(Clone)]
struct ConnService {
    app: Router,
    state: Arc<ConnState>,
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let busy = Busy::start(self.state.clone());
        let arrived = Arc::new(AtomicBool::new(req.body().is_end_stream()));
        let req = req.map(|inner| {
            Body::new(Timed {
                inner,
                arrived: arrived.clone(),
            })
        });
        // Router is always ready (its poll_ready is `Ready(Ok)`).
        let fut = self.app.clone().call(req);
        let (limit, shared, addr) = (
            self.shared.limits.body_timeout,
            self.shared.clone(),
            self.addr,
        );
        Box::pin(async move {
            tokio::pin!(fut);
            let deadline = tokio::time::sleep(limit);
            tokio::pin!(deadline);
            let resp = loop {
                tokio::select! {
                    biased;
                    r = &mut fut => break r.unwrap_or_else(|never| match never {}),
                    () = &mut deadline, if !arrived.load(Ordering::Relaxed) => {
                        // The handler may have taken the last bytes in
                        // this very poll: then it is working, not waiting.
                        if arrived.load(Ordering::Relaxed) {
                            continue;
                        }
                        // Still waiting for the body, so nothing was
                        // decided: dropping the handler changes nothing.
                        shared.timeout(Phase::Body, addr);
                        break body_timeout_response(limit);
                    }
                }
            };
            Ok(resp.map(|inner| Tracked { inner, _busy: busy }))
        })
    }
}

fn body_timeout_response(limit: Duration) -> Response<Body> {
    let mut resp = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        ErrorName::BodyTimeout,
        format!(
            "the request body did not arrive within {} ms of its headers (--body-timeout-ms)",
            limit.as_millis()
        ),
    )
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// A request in progress on a connection; the connection is idle again
/// when the last one ends (its response fully written, or dropped).
struct Busy(Arc<ConnState>);

impl Busy {
    fn start(state: Arc<ConnState>) -> Self {
        state.begin_request();
        Self(state)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.end_request();
    }
}

/// A response body that ends its request's [`Busy`] when hyper drops it
/// (after its last byte is written, or with the connection).
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that says when it has fully arrived (or was dropped by
/// its handler, which then no longer waits for it).
struct Timed {
    inner: Incoming,
    arrived: Arc<AtomicBool>,
}

impl HttpBody for Timed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        let done = match &r {
            Poll::Ready(None | Some(Err(_))) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            Poll::Pending => false,
        };
        if done {
            this.arrived.store(true, Ordering::Relaxed);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        self.arrived.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            ..ConnectionLimits::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_follows_the_phase() {
        let s = ConnState::new();
        let l = limits();
        let (at, phase) = s.deadline(&l).unwrap();
        assert_eq!(
            (at - s.epoch, phase),
            (Duration::from_secs(1), Phase::Header)
        );
        s.begin_request();
        assert!(
            s.deadline(&l).is_none(),
            "a request in progress has no deadline"
        );
        s.write_pending();
        assert_eq!(s.deadline(&l).unwrap().1, Phase::Write);
        s.write_done();
        tokio::time::advance(Duration::from_secs(2)).await;
        s.end_request();
        let (at, phase) = s.deadline(&l).unwrap();
        assert_eq!((at - s.epoch, phase), (Duration::from_secs(7), Phase::Idle));
        tokio::time::advance(Duration::from_secs(1)).await;
        s.on_read();
        let (at, phase) = s.deadline(&l).unwrap();
        assert_eq!(
            (at - s.epoch, phase),
            (Duration::from_secs(4), Phase::Header)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_watchdog_fires_only_after_a_silent_deadline() {
        let s = Arc::new(ConnState::new());
        let l = limits();
        let dog = tokio::spawn(watchdog(s.clone(), l));
        tokio::time::sleep(Duration::from_millis(500)).await;
        s.begin_request();
        // Busy for far longer than any timeout: nothing fires.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!dog.is_finished());
        s.end_request();
        tokio::time::sleep(Duration::from_millis(4900)).await;
        assert!(!dog.is_finished());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(dog.await.unwrap(), Phase::Idle);
    }
}
