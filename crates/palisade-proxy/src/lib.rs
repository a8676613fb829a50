//! `palisade proxy`: a fencing reverse proxy in front of an HTTP API that
//! knows nothing of tokens (a PLM REST API, a device gateway).
//!
//! Each request names its twin by the scope rule (`scope.rs`: a path
//! pattern or a header) and carries `Fencing-Token`. Under the twin's lock
//! (`locks.rs`), the proxy asks the store to admit a fenced append of an
//! admission record (`admit.rs`, decision 0027); only if the store admits
//! it is the request forwarded, without its token and with an
//! `Idempotency-Key` derived from twin, token and the caller's request id.
//! The lock is held until the upstream answered or the upstream timeout
//! fired, so requests of one twin reach the upstream one at a time and in
//! admission order, which is token order. See `docs/proxy.md`.

mod admit;
mod locks;
mod metrics;
mod scope;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use palisade_core::{FencingToken, TwinId};
use palisade_http::Security;
use palisade_log::{Store, StoreConfig};
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{info, warn};

pub use admit::{Admitter, ADMITTED_TYPE, PATCH_KEY};
pub use locks::TwinLocks;
pub use metrics::ProxyMetrics;
pub use scope::ScopeRule;

use admit::{error_response, Admission};

/// `palisade proxy`'s settings.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// Address the proxy listens on.
    #[arg(long, env = "PALISADE_PROXY_LISTEN", default_value = "127.0.0.1:7080")]
    pub listen: String,
    /// Base URL of the API behind the proxy (http or https), e.g.
    /// `https://plm.internal:8443`; a request's path and query are appended.
    #[arg(long, env = "PALISADE_PROXY_UPSTREAM")]
    pub upstream: String,
    /// Embedded store: open this data folder in this process (no other
    /// process may hold it). Exactly one of --data and --store-url.
    #[arg(
        long,
        env = "PALISADE_PROXY_DATA",
        conflicts_with = "store_url",
        required_unless_present = "store_url"
    )]
    pub data: Option<PathBuf>,
    /// Remote store: the URL of a running `palisade serve` (http or
    /// https); admissions go through its HTTP API.
    #[arg(long, env = "PALISADE_PROXY_STORE_URL")]
    pub store_url: Option<String>,
    /// With --data: the store's security file (principals, roles, limits;
    /// docs/security.md), as `palisade serve --security` takes it. The
    /// admission then needs the caller's key (`Palisade-Authorization`) and
    /// a token granted to that principal, and --store-listen serves the
    /// store's API with the same principals.
    #[arg(long, env = "PALISADE_PROXY_SECURITY", requires = "data")]
    pub security: Option<PathBuf>,
    /// PEM file of the root certificate(s) trusted for an https --upstream
    /// (the proxy trusts no built-in roots).
    #[arg(long, env = "PALISADE_PROXY_UPSTREAM_CA_FILE")]
    pub upstream_ca_file: Option<PathBuf>,
    /// PEM file of the root certificate(s) trusted for an https
    /// --store-url.
    #[arg(long, env = "PALISADE_PROXY_STORE_CA_FILE", requires = "store_url")]
    pub store_ca_file: Option<PathBuf>,
    /// With --data: also serve the embedded store's own API (leases, reads)
    /// on this address, so workers can take their leases from it. Loopback
    /// only, unless --security turns authentication on and TLS is on (the
    /// same --tls-cert/--tls-key) or --insecure is given.
    #[arg(long, env = "PALISADE_PROXY_STORE_LISTEN", requires = "data")]
    pub store_listen: Option<String>,
    /// Scope rule: a path pattern naming the twin, e.g.
    /// `/api/parts/{twin}` (`*` matches any one segment; the path may go
    /// on past the pattern). Exactly one of --scope-path and --scope-header.
    #[arg(
        long,
        env = "PALISADE_PROXY_SCOPE_PATH",
        conflicts_with = "scope_header",
        required_unless_present = "scope_header"
    )]
    pub scope_path: Option<String>,
    /// Scope rule: the header whose value is the twin id, e.g. `Palisade-Twin`.
    #[arg(long, env = "PALISADE_PROXY_SCOPE_HEADER")]
    pub scope_header: Option<String>,
    /// How long the upstream has to answer a forwarded request (whole
    /// response); past it the proxy answers 504 and releases the twin.
    #[arg(
        long,
        env = "PALISADE_PROXY_UPSTREAM_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub upstream_timeout_ms: u64,
    /// Largest request body accepted, in bytes (413 past it).
    #[arg(long, env = "PALISADE_PROXY_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(long, env = "PALISADE_PROXY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "PALISADE_PROXY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Allow listening on a non-loopback address without TLS.
    #[arg(long, env = "PALISADE_PROXY_INSECURE")]
    pub insecure: bool,
}

/// The header carrying the caller's store API key in remote mode (sent to
/// the store as `Authorization` for the admission, never upstream).
pub const STORE_AUTH_HEADER: &str = "palisade-authorization";

/// Everything a request needs, shared by the connections.
#[derive(Debug)]
struct Proxy {
    rule: ScopeRule,
    admitter: Admitter,
    /// Upstream base URL without a trailing slash.
    upstream: String,
    http: reqwest::Client,
    timeout: Duration,
    max_body: usize,
    locks: Arc<TwinLocks>,
    metrics: ProxyMetrics,
}

/// Run the proxy until `shutdown` completes. Prints
/// `palisade store listening on URL` (embedded with --store-listen) and
/// then `palisade proxy listening on URL` on stdout once ready.
pub async fn run(
    args: ProxyArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let rule = match (&args.scope_path, &args.scope_header) {
        (Some(p), None) => ScopeRule::path(p).map_err(anyhow::Error::msg)?,
        (None, Some(h)) => ScopeRule::header(h).map_err(anyhow::Error::msg)?,
        _ => bail!("give exactly one of --scope-path and --scope-header"),
    };
    let upstream = http_base(&args.upstream, "--upstream")?;
    let listen: SocketAddr = args
        .listen
        .parse()
        .with_context(|| format!("--listen {:?} is not an address:port", args.listen))?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => Some(palisade_http::tls::acceptor(c, k)?),
        _ => None,
    };
    if !listen.ip().is_loopback() && tls.is_none() && !args.insecure {
        bail!(
            "--listen {listen} is not a loopback address and TLS is off: \
             give --tls-cert and --tls-key, or --insecure to serve plain HTTP to the network"
        );
    }
    if args.upstream_timeout_ms == 0 {
        bail!("--upstream-timeout-ms must be at least 1");
    }
    let security = match &args.security {
        Some(path) => Security::load(path).map_err(anyhow::Error::msg)?,
        None => Security::default(),
    };
    let store_listen: Option<SocketAddr> = match &args.store_listen {
        Some(a) => {
            let addr: SocketAddr = a
                .parse()
                .with_context(|| format!("--store-listen {a:?} is not an address:port"))?;
            if !addr.ip().is_loopback() && !args.insecure {
                if !security.auth_enabled() {
                    bail!(
                        "--store-listen {addr}: without authentication the embedded store's API \
                         is served on loopback only; give --security FILE with principals"
                    );
                }
                if tls.is_none() {
                    bail!(
                        "--store-listen {addr}: API keys would cross the network in clear text; \
                         give --tls-cert and --tls-key (or --insecure)"
                    );
                }
            }
            Some(addr)
        }
        None => None,
    };
    let (closing_tx, closing) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = closing_tx.send(true);
    });

    let mut store: Option<Arc<Store>> = None;
    let mut store_task = None;
    let admitter = match (&args.data, &args.store_url) {
        (Some(dir), None) => {
            let s = Arc::new(
                Store::open(dir, StoreConfig::default())
                    .with_context(|| format!("cannot open the store in {}", dir.display()))?,
            );
            let config = palisade_http::HttpConfig {
                security,
                ..palisade_http::HttpConfig::default()
            };
            if let Some(addr) = store_listen {
                let l = TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on --store-listen {addr}"))?;
                let local = l.local_addr()?;
                let scheme = if tls.is_some() { "https" } else { "http" };
                println!("palisade store listening on {scheme}://{local}");
                let (store, config, stop) = (s.clone(), config.clone(), closed(closing.clone()));
                store_task = Some(match &tls {
                    Some(acceptor) => tokio::spawn(palisade_http::run_tls(
                        l,
                        acceptor.clone(),
                        store,
                        config,
                        stop,
                    )),
                    None => tokio::spawn(palisade_http::run(l, store, config, stop)),
                });
            }
            store = Some(s.clone());
            Admitter::Embedded(palisade_http::router(s, config))
        }
        (None, Some(url)) => Admitter::Remote {
            http: client(args.store_ca_file.as_deref(), "--store-ca-file")?
                .connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(30))
                .build()?,
            base: http_base(url, "--store-url")?,
        },
        _ => bail!("give exactly one of --data and --store-url"),
    };
    let proxy = Arc::new(Proxy {
        rule,
        admitter,
        upstream,
        http: client(args.upstream_ca_file.as_deref(), "--upstream-ca-file")?
            // The caller sees the upstream's redirects; the proxy does not
            // follow them to somewhere its scope rule never saw.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(3))
            .build()?,
        timeout: Duration::from_millis(args.upstream_timeout_ms),
        max_body: args.max_body_bytes,
        locks: Arc::new(TwinLocks::default()),
        metrics: ProxyMetrics::default(),
    });
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    info!(listen = %local, upstream = %proxy.upstream, rule = %proxy.rule.describe(), "proxy started");
    println!("palisade proxy listening on {scheme}://{local}");
    serve(listener, tls, proxy.clone(), closing).await;
    if let Some(t) = store_task {
        let _ = t.await;
    }
    if let Some(s) = store {
        s.close().await;
    }
    Ok(())
}

/// A URL of an HTTP(S) server, checked, without a trailing slash.
fn http_base(url: &str, flag: &str) -> anyhow::Result<String> {
    let parsed =
        reqwest::Url::parse(url).with_context(|| format!("{flag} {url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        bail!("{flag} {url:?}: only http:// and https:// are supported");
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        bail!("{flag} {url:?} must not have a query or fragment");
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// A client builder trusting the roots in `ca_file` (PEM) for HTTPS; with
/// none, HTTPS servers cannot be verified and are refused.
fn client(ca_file: Option<&Path>, flag: &str) -> anyhow::Result<reqwest::ClientBuilder> {
    let mut b = reqwest::Client::builder();
    if let Some(path) = ca_file {
        let pem = std::fs::read(path).with_context(|| format!("{flag} {}", path.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{flag} {}", path.display()))?;
        if certs.is_empty() {
            bail!("{flag} {}: no PEM certificate in it", path.display());
        }
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    Ok(b)
}

async fn closed(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|c| *c).await;
}

/// Accept connections until closing, then let those in flight finish
/// (bounded by the upstream timeout and a little more).
async fn serve(
    listener: TcpListener,
    tls: Option<palisade_http::tls::TlsAcceptor>,
    proxy: Arc<Proxy>,
    closing: watch::Receiver<bool>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let for_conns = closing.clone();
    loop {
        tokio::select! {
            () = closed(closing.clone()) => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of file descriptors and the like: try again shortly.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let (proxy, tls, closing) = (proxy.clone(), tls.clone(), for_conns.clone());
                conns.spawn(async move {
                    match tls {
                        Some(acceptor) => {
                            let hs = tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await;
                            if let Ok(Ok(s)) = hs {
                                drive(TokioIo::new(s), proxy, closing).await;
                            }
                        }
                        None => drive(TokioIo::new(stream), proxy, closing).await,
                    }
                });
            }
        }
        while conns.try_join_next().is_some() {}
    }
    let drain = proxy.timeout + Duration::from_secs(2);
    let _ = tokio::time::timeout(drain, async { while conns.join_next().await.is_some() {} }).await;
}

/// How long a client has for its TLS handshake and its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

async fn drive<I>(io: I, proxy: Arc<Proxy>, closing: watch::Receiver<bool>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let proxy = proxy.clone();
        async move { Ok::<_, Infallible>(proxy.handle(req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = closed(closing) => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// Headers never forwarded upstream: hop-by-hop ones, the token, the
/// caller's store key, and the caller's idempotency key (replaced by the
/// derived one).
const NOT_FORWARDED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "fencing-token",
    STORE_AUTH_HEADER,
    "idempotency-key",
];

/// Headers of the upstream's answer not passed back (hop-by-hop; the
/// length is set again from the body).
const NOT_RETURNED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

impl Proxy {
    async fn handle(&self, req: Request<Incoming>) -> Response {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_owned();
        if path == "/metrics" && parts.method == axum::http::Method::GET {
            return (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                self.metrics.render(),
            )
                .into_response();
        }
        let path_q = parts
            .uri
            .path_and_query()
            .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
        let method = parts.method.clone();
        // Bad input: refused before anything is locked, admitted or sent.
        let twin = match self.rule.twin_of(&path, &parts.headers) {
            Ok(t) => t,
            Err(scope::NoScope(m)) => {
                return self.refuse(
                    &method,
                    &path,
                    None,
                    None,
                    "unknown_scope",
                    bad_request("unknown_scope", &m),
                );
            }
        };
        let token = match fencing_token(&parts.headers) {
            Ok(t) => t,
            Err((name, m)) => {
                return self.refuse(
                    &method,
                    &path,
                    Some(&twin),
                    None,
                    name,
                    bad_request(name, &m),
                );
            }
        };
        let body = match axum::body::to_bytes(Body::new(body), self.max_body).await {
            Ok(b) => b,
            Err(e) => {
                // http-body-util's limit error, seen through axum's wrapper.
                let (status, name, message) = if format!("{e:?}").contains("LengthLimitError") {
                    (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "body_too_large",
                        format!("the request body is over {} bytes", self.max_body),
                    )
                } else {
                    (
                        StatusCode::BAD_REQUEST,
                        "bad_body",
                        format!("the request body could not be read: {e}"),
                    )
                };
                let r = error_response(status, name, &message, serde_json::Value::Null);
                return self.refuse(&method, &path, Some(&twin), Some(token), name, r);
            }
        };
        let request_id = request_id(&parts.headers);
        let key = idempotency_key(&twin, token, &request_id);
        let digest = hex(&Sha256::digest(&body));

        // From here to the upstream's answer, this twin's other requests wait.
        let waiting = self.metrics.waiting();
        let guard = self.locks.lock(twin.as_str()).await;
        drop(waiting);
        let admission = Admission {
            twin: &twin,
            token,
            key: &key,
            method: method.as_str(),
            path: &path,
            body_sha256: &digest,
            request_id: &request_id,
            authorization: parts.headers.get(STORE_AUTH_HEADER),
        };
        match self.admitter.admit(&admission).await {
            Ok(a) => self.metrics.admitted(a.duplicate),
            Err(r) => {
                drop(guard);
                return self.refuse(
                    &method,
                    &path,
                    Some(&twin),
                    Some(token),
                    &r.reason,
                    *r.response,
                );
            }
        }
        let (mut resp, failed) = self
            .forward(
                &parts.method,
                &path_q,
                &parts.headers,
                body,
                &twin,
                token,
                &key,
            )
            .await;
        if let Some((kind, status)) = failed {
            // Still under the twin's lock: the record follows the admission.
            if let Err(r) = self.admitter.record_failure(&admission, kind, status).await {
                warn!(
                    twin = twin.as_str(),
                    token = token.0,
                    key,
                    reason = r.reason,
                    "the upstream failure could not be recorded in the twin's history"
                );
            }
        }
        drop(guard);
        if let Ok(v) = HeaderValue::from_str(&key) {
            resp.headers_mut().insert("idempotency-key", v);
        }
        resp
    }

    /// Count, log and answer a request that is not forwarded.
    fn refuse(
        &self,
        method: &axum::http::Method,
        path: &str,
        twin: Option<&TwinId>,
        token: Option<FencingToken>,
        reason: &str,
        response: Response,
    ) -> Response {
        self.metrics.refused(reason);
        warn!(
            %method,
            path,
            twin = twin.map(TwinId::as_str),
            token = token.map(|t| t.0),
            reason,
            status = response.status().as_u16(),
            "proxy refused a request; not forwarded"
        );
        response
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &self,
        method: &axum::http::Method,
        path_q: &str,
        headers: &HeaderMap,
        body: Bytes,
        twin: &TwinId,
        token: FencingToken,
        key: &str,
    ) -> (Response, Option<(&'static str, Option<u16>)>) {
        let url = format!("{}{path_q}", self.upstream);
        let named_by_connection: Vec<String> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|s| s.trim().to_ascii_lowercase())
            .collect();
        let mut rb = self.http.request(method.clone(), &url);
        for (name, value) in headers {
            let n = name.as_str();
            if !NOT_FORWARDED.contains(&n) && !named_by_connection.iter().any(|c| c == n) {
                rb = rb.header(name, value);
            }
        }
        rb = rb.header("idempotency-key", key).body(body);
        let call = async {
            let r = rb.send().await?;
            let status = r.status();
            let headers = r.headers().clone();
            let bytes = r.bytes().await?;
            Ok::<_, reqwest::Error>((status, headers, bytes))
        };
        let details = json!({ "idempotency_key": key, "twin": twin.as_str(), "token": token.0 });
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => {
                self.metrics.upstream_failed("timeout");
                warn!(
                    twin = twin.as_str(),
                    token = token.0,
                    key,
                    url,
                    "upstream timed out"
                );
                let r = error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    &format!(
                        "the upstream did not answer within {} ms; the request may or may not have \
                         reached it: retry with the same request id (same Idempotency-Key)",
                        self.timeout.as_millis()
                    ),
                    details,
                );
                (r, Some(("timeout", None)))
            }
            Ok(Err(e)) => {
                self.metrics.upstream_failed("connect");
                warn!(twin = twin.as_str(), token = token.0, key, url, error = %e, "upstream failed");
                let r = error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    &format!("the upstream could not be reached or cut the answer off: {e}"),
                    details,
                );
                (r, Some(("connect", None)))
            }
            Ok(Ok((status, _, _))) if status.is_server_error() => {
                self.metrics.upstream_failed("status");
                warn!(
                    twin = twin.as_str(),
                    token = token.0,
                    key,
                    url,
                    status = status.as_u16(),
                    "upstream answered 5xx"
                );
                let mut d = details;
                d["upstream_status"] = json!(status.as_u16());
                let r = error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_failed",
                    &format!("the upstream answered {status}"),
                    d,
                );
                (r, Some(("status", Some(status.as_u16()))))
            }
            Ok(Ok((status, up_headers, bytes))) => {
                self.metrics.forwarded();
                let mut resp = (status, bytes).into_response();
                let h = resp.headers_mut();
                for (name, value) in &up_headers {
                    if !NOT_RETURNED.contains(&name.as_str()) {
                        h.append(name.clone(), value.clone());
                    }
                }
                (resp, None)
            }
        }
    }
}

fn bad_request(name: &str, message: &str) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        name,
        message,
        serde_json::Value::Null,
    )
}

/// The `Fencing-Token` header, parsed as the store parses it (the same
/// error names: `missing_token`, `bad_token`).
fn fencing_token(headers: &HeaderMap) -> Result<FencingToken, (&'static str, String)> {
    let mut all = headers.get_all("fencing-token").iter();
    let raw = all.next().ok_or((
        "missing_token",
        "the Fencing-Token header is required: the token of your lease".to_owned(),
    ))?;
    if all.next().is_some() {
        return Err(("bad_token", "give exactly one Fencing-Token header".into()));
    }
    let text = raw
        .to_str()
        .map_err(|_| {
            (
                "bad_token",
                "Fencing-Token must be a decimal number".to_owned(),
            )
        })?
        .trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err((
            "bad_token",
            format!("Fencing-Token must be a non-negative decimal number, got {text:?}"),
        ));
    }
    text.parse::<u64>().map(FencingToken).map_err(|_| {
        (
            "bad_token",
            format!("Fencing-Token {text} does not fit in 64 bits"),
        )
    })
}

/// The caller's request id: its `Idempotency-Key`, else its
/// `X-Request-Id`, else a fresh one (a request that names none is never
/// taken for a retry of another).
fn request_id(headers: &HeaderMap) -> String {
    for name in [
        HeaderName::from_static("idempotency-key"),
        HeaderName::from_static("x-request-id"),
    ] {
        if let Some(v) = headers
            .get(&name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
        {
            return v.to_owned();
        }
    }
    uuid::Uuid::new_v4().to_string()
}

/// `pxy-` and 40 hex digits of SHA-256(twin, token, request id): the same
/// request retried gets the same key (the store dedupes its admission, the
/// upstream its effect); another twin, token or request never does.
pub fn idempotency_key(twin: &TwinId, token: FencingToken, request_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(twin.as_str().as_bytes());
    h.update([0]);
    h.update(token.0.to_string().as_bytes());
    h.update([0]);
    h.update(request_id.as_bytes());
    let d = h.finalize();
    format!("pxy-{}", hex(&d[..20]))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keys_differ_by_twin_token_and_request() {
        let a = TwinId::new("a").unwrap();
        let b = TwinId::new("b").unwrap();
        let k = idempotency_key(&a, FencingToken(3), "r1");
        assert_eq!(k, idempotency_key(&a, FencingToken(3), "r1"));
        assert_ne!(k, idempotency_key(&b, FencingToken(3), "r1"));
        assert_ne!(k, idempotency_key(&a, FencingToken(4), "r1"));
        assert_ne!(k, idempotency_key(&a, FencingToken(3), "r2"));
        assert_eq!(k.len(), 44);
    }

    #[test]
    fn tokens_parse_like_the_store() {
        let mut h = HeaderMap::new();
        assert_eq!(fencing_token(&h).unwrap_err().0, "missing_token");
        h.insert("fencing-token", "abc".parse().unwrap());
        assert_eq!(fencing_token(&h).unwrap_err().0, "bad_token");
        h.insert("fencing-token", "-1".parse().unwrap());
        assert_eq!(fencing_token(&h).unwrap_err().0, "bad_token");
        h.insert("fencing-token", " 12 ".parse().unwrap());
        assert_eq!(fencing_token(&h).unwrap(), FencingToken(12));
        h.append("fencing-token", "13".parse().unwrap());
        assert_eq!(fencing_token(&h).unwrap_err().0, "bad_token");
    }
}
