//! `palisade serve`: open the store, serve HTTP, sweep expired leases, and
//! on SIGTERM or Ctrl-C finish requests in flight and flush everything.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use palisade_log::Store;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::config::ServeConfig;

/// How often expired leases are swept from the table and disk.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let mode = config.validate()?;
    // Before anything opens files: idle clients must not be what runs the
    // store out of descriptors (fd_limit.rs).
    let fd_limit = crate::fd_limit::raise();
    // Security file, TLS and the bind policy (security.rs): checked
    // before anything is created, so a refused start changes nothing.
    let security = crate::security::prepare(&config)?;
    // The outbox's trust roots too: a bad --outbox-ca-file stops the start
    // before anything is created.
    let dispatch = config.dispatch_config()?;
    std::fs::create_dir_all(&config.data)
        .with_context(|| format!("cannot create data folder {}", config.data.display()))?;
    // The lease authority of the mode, chosen before the store opens: the
    // store refuses one its tokens did not come from. In cluster mode
    // (cluster.rs) leases, appends and reads go through the node.
    let authority = crate::cluster::authority(&mode).await?;
    let store = Arc::new(Store::open(
        &config.data,
        palisade_log::StoreConfig {
            leases: authority.backend(),
            ..config.store_config()
        },
    )?);
    let node = crate::cluster::start(
        &store,
        authority,
        &mode,
        &config,
        security.http.auth.clone(),
    )
    .await?;
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    if let Some(n) = &node {
        n.set_listen_addr(security.scheme(), addr);
        n.join(config.security.as_deref(), config.cluster_security_change)
            .await?;
    }
    let sweeper = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                if let Err(e) = store.sweep_leases().await {
                    warn!(error = %e, "lease sweep failed");
                }
            }
        })
    };
    // One shutdown signal for the HTTP server and the Kafka ingester.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let ingester = config.ingest_config().map(|cfg| {
        let cfg = security.kafka(cfg, &store);
        info!(brokers = %cfg.brokers, topic = %cfg.topic, group = %cfg.group, "kafka ingestion on");
        let (store, stop_tx) = (store.clone(), stop_tx.clone());
        let stop = stopped(stop_rx.clone());
        let node = node.clone();
        tokio::spawn(async move {
            let r = match node {
                Some(n) => palisade_kafka::cluster::ClusterIngester::run(store, cfg, n, stop).await,
                None => palisade_kafka::Ingester::run(store, cfg, stop).await,
            };
            if r.is_err() {
                // A misconfiguration (e.g. partition counts differ): stop the
                // whole server rather than run without ingestion.
                let _ = stop_tx.send(true);
            }
            r
        })
    });
    // The outbox dispatcher (outbox.rs): every partition on one node; in
    // cluster mode only the partitions this node serves, each try's outcome
    // published on the partition's log (decision 0035).
    let gate: Arc<dyn crate::outbox::Dispatch> = match &node {
        Some(n) => n.clone(),
        None => Arc::new(crate::outbox::Local(store.clone())),
    };
    let dispatcher = {
        let keep = dispatch.keep_delivered;
        let tasks = crate::outbox::start(&store, gate, dispatch, stop_rx.clone())?;
        let gauge = tokio::spawn(crate::outbox::housekeeping(
            store.clone(),
            keep,
            std::time::Duration::from_secs(10),
        ));
        (tasks, gauge)
    };
    // Installed here, before the ready line below: a SIGTERM sent as soon
    // as that line is read must stop the server cleanly, not kill it (the
    // signal's default action) because a task had not yet registered.
    let signal = shutdown_signal();
    tokio::spawn(async move {
        signal.await;
        let _ = stop_tx.send(true);
    });
    let mut http = config.http_config();
    http.connections.max_connections = crate::fd_limit::fit_connections(
        http.connections.max_connections,
        &fd_limit,
        crate::fd_limit::open_now(),
    );
    http.connections.max_connections_per_ip = http
        .connections
        .max_connections_per_ip
        .min(http.connections.max_connections);
    info!(%addr, data = %config.data.display(), partitions = store.partitions(),
        max_connections = http.connections.max_connections, "palisade is ready");
    // Scripts and tests read this line to learn the address (port 0 picks one).
    println!("palisade listening on {}://{addr}", security.scheme());
    security.announce(addr);
    security
        .run(
            listener,
            store.clone(),
            palisade_http::HttpConfig {
                cluster: node
                    .clone()
                    .map(|n| n as Arc<dyn palisade_http::cluster::ClusterRouting>),
                ..http
            },
            stopped(stop_rx),
        )
        .await?;
    sweeper.abort();
    {
        let (tasks, gauge) = dispatcher;
        gauge.abort();
        // They end on the stop signal (a try in flight is abandoned and
        // stays pending).
        for t in tasks {
            let _ = t.await;
        }
    }
    let ingest_result = match ingester {
        Some(task) => task
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r.map_err(anyhow::Error::from)),
        None => Ok(()),
    };
    if let Some(n) = &node {
        n.leave().await;
    }
    info!("shutting down: flushing partitions");
    store.close().await;
    ingest_result.context("kafka ingestion failed")
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT). The handlers are installed when
/// this is called, not when the future is first polled: from then on the
/// signals no longer end the process by their default action.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, Signal, SignalKind};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        let wait = |s: Option<Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        async move {
            tokio::select! {
                () = wait(term) => {},
                () = wait(int) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
