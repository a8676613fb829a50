//! The recording webhook receiver of the outbox tests (`tests/outbox`,
//! `tests/cluster/11_outbox.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// One POST as the receiver saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub key: String,
    pub token: String,
    pub body: Value,
    pub headers: HeaderMap,
}

/// The webhook receiver: an axum server on 127.0.0.1:0 recording every
/// request with its headers, before it answers. Paths:
/// `/ok/...` answers 200; `/flaky/<k>/...` answers 500 to its first `k`
/// requests, then 200; `/down/...` always 500; `/hold/<n>/...` answers 200
/// to its first `n` requests and holds every later one unanswered until
/// [`Receiver::release`].
#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    counts: Arc<Mutex<HashMap<String, usize>>>,
    released: Arc<watch::Sender<bool>>,
}

impl Receiver {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        Self::serve(url, listener)
    }

    /// The same receiver over HTTPS (rustls), with this certificate chain
    /// and key (DER), at `https://127.0.0.1:<port>`.
    pub async fn start_https(cert: Vec<u8>, key: Vec<u8>) -> Self {
        use tokio_rustls::rustls;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.into()],
                rustls::pki_types::PrivateKeyDer::try_from(key).unwrap(),
            )
            .unwrap();
        let tls = TlsListener {
            tcp: listener,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        };
        Self::serve(url, tls)
    }

    fn serve<L: axum::serve::Listener>(url: String, listener: L) -> Self
    where
        L::Addr: std::fmt::Debug,
    {
        let r = Self {
            url,
            seen: Arc::default(),
            counts: Arc::default(),
            released: Arc::new(watch::Sender::new(false)),
        };
        let state = r.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let s = state.clone();
            async move { s.handle(uri, headers, body).await }
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        r
    }

    async fn handle(&self, uri: Uri, headers: HeaderMap, body: Bytes) -> StatusCode {
        let path = uri.path().to_owned();
        let h = |n: &str| {
            headers
                .get(n)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        self.seen.lock().unwrap().push(Seen {
            path: path.clone(),
            key: h("idempotency-key"),
            token: h("fencing-token"),
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            headers: headers.clone(),
        });
        let n = {
            let mut c = self.counts.lock().unwrap();
            let n = c.entry(path.clone()).or_default();
            *n += 1;
            *n
        };
        let parts: Vec<&str> = path.split('/').collect();
        let arg = || parts.get(2).and_then(|k| k.parse::<usize>().ok()).unwrap();
        match parts.get(1).copied() {
            Some("ok") => StatusCode::OK,
            Some("flaky") if n <= arg() => StatusCode::INTERNAL_SERVER_ERROR,
            Some("flaky") => StatusCode::OK,
            Some("hold") if n <= arg() => StatusCode::OK,
            Some("hold") => {
                let _ = self.released.subscribe().wait_for(|r| *r).await;
                StatusCode::OK
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn release(&self) {
        self.released.send_replace(true);
    }

    /// Wait until `f` holds for what the receiver saw (panics after 60 s:
    /// a liveness bound, not a speed check).
    pub async fn wait_for(&self, what: &str, f: impl Fn(&[Seen]) -> bool) -> Vec<Seen> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let seen = self.seen();
            if f(&seen) {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "receiver: never {what}; saw {seen:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A TLS listener for axum: accepts TCP, then the handshake (a failed
/// handshake, such as a client that does not trust the certificate, is
/// dropped and the next connection accepted).
struct TlsListener {
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
