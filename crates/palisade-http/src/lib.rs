//! Palisade's HTTP API (axum, JSON, under `/v1`).
//!
//! [`router`] builds the routes over a [`Store`](palisade_log::Store);
//! [`run`] serves them on a listener until a shutdown future completes
//! (mini-redis style, so tests bind port 0 and stop the server at will).
//! Errors become status codes in one place, `error.rs`. The contract is
//! documented in `docs/http-api.md`; its OpenAPI 3 description is generated
//! from the handlers (`openapi.rs`) and served at `/v1/openapi.json`.

mod audit_api;
mod backup_api;
mod caller;
pub mod cluster;
mod conn;
mod error;
mod openapi;
mod routes;
mod security;
pub mod tls;
mod views;
mod watch;
mod wire;

use std::future::Future;
use std::sync::Arc;

use palisade_log::Store;
use tokio::net::TcpListener;

pub use conn::ConnectionLimits;
pub use error::ApiError;
/// The authorization policy (`palisade-auth`), under its old path for code
/// that names `palisade_http::auth`.
pub use palisade_auth as auth;
pub use routes::router;
pub use security::{Limits, Security, SecurityFile, ANONYMOUS};
pub use wire::{EventOut, LeaseOut};

/// Limits of the HTTP layer.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Largest request body accepted, in bytes (413 past it).
    pub max_body_bytes: usize,
    /// Most events in one append request.
    pub max_batch_events: usize,
    /// Most events one history page returns.
    pub max_page: usize,
    /// Authentication (off by default), limits and audit settings.
    pub security: Security,
    /// Cluster mode: redirect requests for twins owned by other nodes
    /// (`cluster.rs`); `None` on a single node.
    pub cluster: Option<Arc<dyn cluster::ClusterRouting>>,
    /// Connection cap, per-address budget and timeouts (`conn.rs`).
    pub connections: ConnectionLimits,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_batch_events: 1000,
            max_page: 1000,
            security: Security::default(),
            cluster: None,
            connections: ConnectionLimits::default(),
        }
    }
}

/// Serve the API on `listener` until `shutdown` completes, then finish the
/// requests in flight. The caller closes the store afterwards.
pub async fn run(
    listener: TcpListener,
    store: Arc<Store>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, None, store, config, shutdown).await
}

/// [`run`] over HTTPS: each connection's TLS handshake with `acceptor`
/// (see [`tls::acceptor`]) comes first, bounded by the header timeout.
pub async fn run_tls(
    listener: TcpListener,
    acceptor: tls::TlsAcceptor,
    store: Arc<Store>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, Some(acceptor), store, config, shutdown).await
}

async fn serve_on(
    listener: TcpListener,
    tls: Option<tls::TlsAcceptor>,
    store: Arc<Store>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (closing_tx, closing) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        // Ends the change streams and the accept loop; connections in
        // flight then finish (`conn.rs`).
        let _ = closing_tx.send(true);
    });
    let cluster = config.cluster.clone();
    let limits = config.connections.clone();
    let partitions = store.partitions();
    let mut app = routes::router_closing(store.clone(), config, closing.clone());
    if let Some(routing) = cluster {
        app = cluster::layer(app, routing, partitions);
    }
    conn::serve(listener, tls, app, store, limits, closing).await
}
