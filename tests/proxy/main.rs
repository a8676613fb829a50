//! `palisade proxy` end to end: real `palisade proxy` (and `palisade
//! serve`) processes, a real upstream HTTP server of the test's own that
//! records every request that reached it, real workers (shell + curl child
//! processes) paused with real signals. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_pause.rs"]
mod pause;

#[path = "02_order.rs"]
mod order;

#[path = "03_upstream_failures.rs"]
mod upstream_failures;

#[path = "04_restart.rs"]
mod restart;

#[path = "05_bad_input.rs"]
mod bad_input;

#[path = "06_auth_tls.rs"]
mod auth_tls;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The scope rule every test proxy runs with.
pub const SCOPE: &str = "/api/parts/{twin}";

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Seen {
    /// The `token` field the test put in the body (the upstream never sees
    /// the token itself: the proxy strips it).
    pub fn token(&self) -> u64 {
        self.body["token"].as_u64().expect("body has a token")
    }
}

/// The upstream: an axum server on 127.0.0.1:0 that knows nothing of
/// tokens. It records each request at the moment it "applies" it. Paths
/// ending in `/slow` wait until [`Upstream::release_slow`]; paths ending
/// in `/fail` answer 500; paths ending in `/jitter` wait a random few
/// milliseconds before applying (so requests in flight together would
/// apply out of order). It tracks how many requests per twin it handles
/// at once.
#[derive(Clone)]
pub struct Upstream {
    pub url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// `true` once `/slow` requests may go on (a flag, so a request that
    /// arrives after the release does not wait either).
    slow: Arc<watch::Sender<bool>>,
    in_flight: Arc<Mutex<(usize, usize)>>,
}

/// The upstream's listener over TLS: each accepted connection's handshake
/// first (a failed one is dropped).
struct TlsListener {
    tcp: TcpListener,
    tls: palisade::http::tls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(s) = self.tls.accept(stream).await {
                return (s, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

impl Upstream {
    pub async fn start() -> Self {
        Self::serve(None).await
    }

    /// The same upstream over HTTPS with this certificate and key.
    pub async fn start_tls(cert: &Path, key: &Path) -> Self {
        Self::serve(Some(palisade::http::tls::acceptor(cert, key).unwrap())).await
    }

    async fn serve(tls: Option<palisade::http::tls::TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let up = Self {
            url,
            seen: Arc::default(),
            slow: Arc::new(watch::Sender::new(false)),
            in_flight: Arc::default(),
        };
        let state = up.clone();
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let s = state.clone();
                async move { s.handle(method, uri, headers, body).await }
            },
        );
        match tls {
            None => tokio::spawn(async move { axum::serve(listener, app).await.unwrap() }),
            Some(tls) => tokio::spawn(async move {
                let l = TlsListener { tcp: listener, tls };
                axum::serve(l, app).await.unwrap();
            }),
        };
        up
    }

    async fn handle(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Bytes,
    ) -> (StatusCode, String) {
        {
            let mut f = self.in_flight.lock().unwrap();
            f.0 += 1;
            f.1 = f.1.max(f.0);
        }
        let path = uri.path().to_owned();
        if path.ends_with("/slow") {
            let _ = self.slow.subscribe().wait_for(|go| *go).await;
        }
        if path.ends_with("/jitter") {
            let ms = uuid::Uuid::new_v4().as_bytes()[0] % 8;
            tokio::time::sleep(Duration::from_millis(u64::from(ms))).await;
        }
        self.seen.lock().unwrap().push(Seen {
            method: method.to_string(),
            path: path.clone(),
            headers,
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        });
        self.in_flight.lock().unwrap().0 -= 1;
        if path.ends_with("/fail") {
            return (StatusCode::INTERNAL_SERVER_ERROR, "{\"oops\":1}".into());
        }
        (StatusCode::OK, "{\"ok\":true}".into())
    }

    /// Every request applied so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Most requests the upstream handled at once.
    pub fn max_in_flight(&self) -> usize {
        self.in_flight.lock().unwrap().1
    }

    /// Let every request waiting in a `/slow` path go on.
    pub fn release_slow(&self) {
        self.slow.send_replace(true);
    }
}

/// A real `palisade proxy` process.
pub struct ProxyProcess {
    pub child: Child,
    /// The proxy's base URL.
    pub url: String,
    /// Embedded mode with --store-listen: the store's own API.
    pub store: Option<String>,
}

impl ProxyProcess {
    /// Embedded store in `data`, its API served too.
    pub fn embedded(data: &Path, upstream: &str, extra: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_palisade"));
        cmd.arg("proxy")
            .arg("--data")
            .arg(data)
            .args(["--store-listen", "127.0.0.1:0"]);
        Self::spawn(cmd, upstream, extra)
    }

    /// Admissions through a running `palisade serve`.
    pub fn remote(store_url: &str, upstream: &str, extra: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_palisade"));
        cmd.arg("proxy").args(["--store-url", store_url]);
        Self::spawn(cmd, upstream, extra)
    }

    fn spawn(mut cmd: Command, upstream: &str, extra: &[&str]) -> Self {
        let child = cmd
            .args(["--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(["--scope-path", SCOPE])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn palisade proxy");
        Self::from_child(child)
    }

    /// Wait for a spawned proxy (stdout piped) to print its ready line(s).
    pub fn from_child(mut child: Child) -> Self {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut store = None;
        loop {
            let mut line = String::new();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "palisade proxy exited before its ready line"
            );
            if let Some(u) = line.trim().strip_prefix("palisade store listening on ") {
                store = Some(u.to_owned());
            } else if let Some(u) = line.trim().strip_prefix("palisade proxy listening on ") {
                return Self {
                    child,
                    url: u.to_owned(),
                    store,
                };
            } else {
                panic!("unexpected line from palisade proxy: {line:?}");
            }
        }
    }

    pub fn store(&self) -> support::Client {
        support::Client::new(
            self.store
                .as_deref()
                .expect("embedded proxy with a store API"),
        )
    }

    /// SIGKILL: a crash.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A request through the proxy: PUT `{proxy}/api/parts/{twin}{suffix}`
/// with `Fencing-Token: token` (if any), `X-Request-Id` (if any) and a
/// JSON body naming the token, so the upstream's record shows whose it was.
pub async fn put(
    proxy: &str,
    twin: &str,
    suffix: &str,
    token: Option<&str>,
    request_id: Option<&str>,
    body: &Value,
) -> support::Resp {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut req = http
        .put(format!("{proxy}/api/parts/{twin}{suffix}"))
        .json(body);
    if let Some(t) = token {
        req = req.header("fencing-token", t);
    }
    if let Some(r) = request_id {
        req = req.header("x-request-id", r);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let bytes = r.bytes().await.unwrap();
    support::Resp {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        headers,
    }
}

/// Take a twin lease, waiting (polling) while another holder's lease is live.
pub async fn acquire_when_free(
    store: &support::Client,
    twin: &str,
    holder: &str,
    ttl_ms: u64,
) -> Value {
    loop {
        let r = store
            .try_acquire(&format!("twin/{twin}"), holder, ttl_ms)
            .await;
        match r.status {
            201 => return r.body,
            409 => tokio::time::sleep(Duration::from_millis(20)).await,
            s => panic!("acquire twin/{twin} by {holder}: {s} {:?}", r.body),
        }
    }
}

/// A's lease `a` goes (released here; expiry is the same) and `worker-b`
/// takes `scope` over: B's token.
pub async fn hand_over(store: &support::Client, a: &Value, scope: &str) -> u64 {
    let r = store
        .delete(&format!("/v1/leases/{}", support::lease_id_of(a)))
        .await;
    assert_eq!(r.status, 204, "{:?}", r.body);
    support::token_of(&store.acquire(scope, "worker-b", 60_000).await)
}

/// The proxy's counter line `name` (with labels) from `/metrics`, or 0.
pub async fn metric(proxy: &str, line: &str) -> u64 {
    let text = reqwest::get(format!("{proxy}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}
