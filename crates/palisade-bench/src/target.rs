//! What the bench loads: an in-process store served over real HTTP (or a
//! running one at `--url`), the do-nothing HTTP server, leases, `/metrics`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::{get, post};
use palisade_core::{partition_for, TwinId};
use palisade_log::{Store, StoreConfig};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::oneshot;

use super::stats::StoreMetrics;

/// The runtime the in-process servers run on: two worker threads, apart from
/// the client's runtime, like a separate server process on the same cores.
#[derive(Debug)]
pub struct ServerRuntime(Option<Runtime>);

impl ServerRuntime {
    pub fn new() -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-server")
            .enable_all()
            .build()
            .context("cannot start the server runtime")?;
        Ok(Self(Some(rt)))
    }

    pub fn handle(&self) -> Handle {
        match &self.0 {
            Some(rt) => rt.handle().clone(),
            // Only `Drop` takes the runtime out.
            None => Handle::current(),
        }
    }
}

impl Drop for ServerRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            // Dropping a runtime inside another runtime's context panics; this does not wait.
            rt.shutdown_background();
        }
    }
}

/// The HTTP client every load generator shares (keep-alive pool, no delay).
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(1024)
        .build()
        .context("cannot build the HTTP client")
}

/// A fresh temporary folder under `base` (or the system's temp folder).
pub fn temp_dir(base: Option<&Path>, prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    let mut b = tempfile::Builder::new();
    b.prefix(prefix);
    match base {
        Some(base) => {
            std::fs::create_dir_all(base)
                .with_context(|| format!("cannot create {}", base.display()))?;
            b.tempdir_in(base)
        }
        None => b.tempdir(),
    }
    .context("cannot create a temporary folder")
}

/// A store to load: in-process (temporary folder, real HTTP on 127.0.0.1:0)
/// or a running one.
#[derive(Debug)]
pub struct StoreServer {
    pub url: String,
    pub partitions: u32,
    /// The in-process store (None for `--url`).
    pub store: Option<Arc<Store>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// Deleted when the server is dropped.
    _dir: Option<tempfile::TempDir>,
}

impl StoreServer {
    /// Open a new store with `partitions` partitions in a temporary folder and
    /// serve it on the server runtime.
    pub async fn start(
        rt: &Handle,
        base: Option<&Path>,
        partitions: u32,
        max_batch: usize,
    ) -> anyhow::Result<Self> {
        let dir = temp_dir(base, "palisade-bench-store-")?;
        let path = dir.path().to_path_buf();
        let store = open_store(path, Some(partitions)).await?;
        let (url, stop, task) = serve(rt, ServeWhat::Store(store.clone(), max_batch))?;
        Ok(Self {
            url,
            partitions,
            store: Some(store),
            stop: Some(stop),
            task: Some(task),
            _dir: Some(dir),
        })
    }

    /// A running store; its partition count comes from `GET /v1/partitions`.
    pub async fn remote(url: &str, http: &reqwest::Client) -> anyhow::Result<Self> {
        let url = url.trim_end_matches('/').to_owned();
        let v: serde_json::Value = http
            .get(format!("{url}/v1/partitions"))
            .send()
            .await
            .with_context(|| format!("cannot reach the store at {url}"))?
            .error_for_status()
            .with_context(|| format!("GET {url}/v1/partitions failed"))?
            .json()
            .await
            .context("GET /v1/partitions: unexpected body")?;
        let n = v["partitions"]
            .as_array()
            .map(Vec::len)
            .context("GET /v1/partitions: no partition list")?;
        Ok(Self {
            url,
            partitions: u32::try_from(n).context("partition count")?,
            store: None,
            stop: None,
            task: None,
            _dir: None,
        })
    }

    pub async fn metrics(&self, http: &reqwest::Client) -> anyhow::Result<StoreMetrics> {
        let text = http
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .context("GET /metrics")?
            .error_for_status()
            .context("GET /metrics")?
            .text()
            .await
            .context("GET /metrics body")?;
        Ok(StoreMetrics::parse(&text))
    }

    /// Stop serving, then close the store (its writers flush) and delete it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(Duration::from_secs(30), task).await {
                Ok(Ok(r)) => r.context("the HTTP server failed")?,
                Ok(Err(e)) => bail!("the HTTP server task failed: {e}"),
                Err(_) => bail!("the HTTP server did not stop within 30 s"),
            }
        }
        if let Some(store) = self.store.take() {
            store.close().await;
        }
        Ok(())
    }
}

/// `Store::open` off the async threads.
pub async fn open_store(path: PathBuf, partitions: Option<u32>) -> anyhow::Result<Arc<Store>> {
    let shown = path.display().to_string();
    let store = tokio::task::spawn_blocking(move || {
        Store::open(
            &path,
            StoreConfig {
                partitions,
                ..StoreConfig::default()
            },
        )
    })
    .await
    .context("store open task")?
    .with_context(|| format!("cannot open a store in {shown}"))?;
    Ok(Arc::new(store))
}

/// What an in-process HTTP server serves.
pub enum ServeWhat {
    Store(Arc<Store>, usize),
    /// The do-nothing server: `POST /v1/twins/{id}/events` reads the body
    /// and answers 201; `GET /v1/twins/{id}` answers 200 with this body.
    Null(Bytes),
}

type Served = (
    String,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
);

/// Serve on 127.0.0.1:0 on the server runtime; returns the base URL.
pub fn serve(rt: &Handle, what: ServeWhat) -> anyhow::Result<Served> {
    let std_listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("cannot listen on 127.0.0.1:0")?;
    std_listener
        .set_nonblocking(true)
        .context("cannot make the listener non-blocking")?;
    let addr = std_listener.local_addr()?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stop_rx.await;
    };
    let task = rt.spawn(async move {
        // Registered with the server runtime's reactor, so it must be made here.
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        match what {
            ServeWhat::Store(store, max_batch) => {
                let cfg = palisade_http::HttpConfig {
                    max_body_bytes: 256 << 20,
                    max_batch_events: max_batch.max(1000),
                    ..palisade_http::HttpConfig::default()
                };
                palisade_http::run(listener, store, cfg, shutdown).await
            }
            ServeWhat::Null(twin_body) => {
                let app =
                    axum::Router::new()
                        .route(
                            "/v1/twins/{twin_id}/events",
                            post(|_body: Bytes| async {
                                (
                                    StatusCode::CREATED,
                                    [("content-type", "application/json")],
                                    "{\"ok\":true}",
                                )
                            }),
                        )
                        .route(
                            "/v1/twins/{twin_id}",
                            get(move || {
                                let b = twin_body.clone();
                                async move {
                                    (StatusCode::OK, [("content-type", "application/json")], b)
                                }
                            }),
                        )
                        .layer(axum::extract::DefaultBodyLimit::max(256 << 20));
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
        }
    });
    Ok((format!("http://{addr}"), stop_tx, task))
}

/// The do-nothing HTTP server (the HTTP-overhead baseline).
#[derive(Debug)]
pub struct NullServer {
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl NullServer {
    pub fn start(rt: &Handle, twin_body: Bytes) -> anyhow::Result<Self> {
        let (url, stop, task) = serve(rt, ServeWhat::Null(twin_body))?;
        Ok(Self {
            url,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            match tokio::time::timeout(Duration::from_secs(30), t).await {
                Ok(Ok(r)) => r.context("the do-nothing server failed")?,
                Ok(Err(e)) => bail!("the do-nothing server task failed: {e}"),
                Err(_) => bail!("the do-nothing server did not stop within 30 s"),
            }
        }
        Ok(())
    }
}

/// A partition-owner lease the bench holds.
#[derive(Debug, Clone)]
pub struct Held {
    pub partition: u32,
    pub token: u64,
    pub lease_id: String,
}

/// Acquire `partition/<p>` for every partition over HTTP; partition p goes to
/// holder `<prefix>-w<p mod writers>`.
pub async fn acquire_partitions(
    base: &str,
    partitions: u32,
    writers: usize,
    prefix: &str,
    ttl: Duration,
) -> anyhow::Result<Vec<Held>> {
    let client = palisade_client::Client::new(base)?;
    let mut out = Vec::with_capacity(partitions as usize);
    for p in 0..partitions {
        let holder = format!("{prefix}-w{}", p as usize % writers.max(1));
        let g = client
            .acquire(&format!("partition/{p}"), &holder, ttl)
            .await
            .with_context(|| format!("cannot acquire partition/{p} as {holder}"))?;
        out.push(Held {
            partition: p,
            token: g.token,
            lease_id: g.lease_id,
        });
    }
    Ok(out)
}

/// Release leases (best effort: a lease that lapsed is fine).
pub async fn release_all(base: &str, held: &[Held]) {
    if let Ok(client) = palisade_client::Client::new(base) {
        for h in held {
            let _ = client.release(&h.lease_id).await;
        }
    }
}

/// The twins of the load: `twin-0000000` .. and each one's partition.
#[derive(Debug, Clone)]
pub struct Twins {
    pub ids: Vec<String>,
    pub partition: Vec<u32>,
}

impl Twins {
    pub fn new(count: u64, partitions: u32) -> anyhow::Result<Self> {
        let started = Instant::now();
        let n = usize::try_from(count).context("--twins")?;
        let mut ids = Vec::with_capacity(n);
        let mut partition = Vec::with_capacity(n);
        for i in 0..count {
            let id = format!("twin-{i:07}");
            let t = TwinId::new(id.clone())?;
            partition.push(partition_for(&t, partitions).0);
            ids.push(id);
        }
        tracing::debug!(count, took = ?started.elapsed(), "twin ids made");
        Ok(Self { ids, partition })
    }

    /// Indices of the twins each writer writes: writer w owns partitions
    /// `p mod W == w` (W <= P), or shares partition `w mod P` (W > P).
    pub fn per_writer(&self, partitions: u32, writers: usize) -> Vec<Vec<u32>> {
        let w = writers.max(1);
        let p = partitions.max(1) as usize;
        let mut by_partition: Vec<Vec<u32>> = vec![Vec::new(); p];
        for (i, part) in self.partition.iter().enumerate() {
            // Twin counts fit u32 (checked by the caller's limits).
            by_partition[*part as usize % p].push(u32::try_from(i).unwrap_or(u32::MAX));
        }
        (0..w)
            .map(|wi| {
                if w <= p {
                    (0..p)
                        .filter(|pi| pi % w == wi)
                        .flat_map(|pi| by_partition[pi].iter().copied())
                        .collect()
                } else {
                    by_partition[wi % p].clone()
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_split_partitions() {
        let t = Twins::new(1000, 8).unwrap();
        let w = t.per_writer(8, 3);
        assert_eq!(w.len(), 3);
        assert_eq!(w.iter().map(Vec::len).sum::<usize>(), 1000);
        for (wi, twins) in w.iter().enumerate() {
            assert!(twins
                .iter()
                .all(|i| t.partition[*i as usize] as usize % 3 == wi));
        }
        // More writers than partitions: writers share.
        let t = Twins::new(1000, 2).unwrap();
        let w = t.per_writer(2, 4);
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], w[2]);
    }
}
