//! The PostgreSQL baseline: the reference article's fencing recipe, one
//! transaction per request with `synchronous_commit=on`:
//!
//! ```sql
//! BEGIN;
//! UPDATE bench_fences SET fence = $token WHERE id = $twin AND fence <= $token;
//! -- (one row updated, else ROLLBACK: a stale token)
//! INSERT INTO bench_events (twin_id, event_id, type, patch, token) ...;  -- the batch
//! COMMIT;
//! ```
//!
//! `auto` starts a throwaway server from Debian's packages (initdb + pg_ctl,
//! as the `postgres` user when run as root) in a temporary folder on
//! 127.0.0.1, and removes it afterwards.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio_postgres::NoTls;

use super::load::{self, Events, LoadResult, OpStats, Phase, Window, DONE, MEASURE};
use super::target::Twins;

/// Where `initdb` and `pg_ctl` are: on PATH, else the newest
/// `/usr/lib/postgresql/<version>/bin`.
pub fn find_bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
    });
    if let Some(d) = on_path {
        return Some(d);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()).then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

/// uid and gid of a user, from /etc/passwd.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let text = std::fs::read_to_string("/etc/passwd").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.first() != Some(&name) {
            return None;
        }
        Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?))
    })
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A throwaway PostgreSQL server; stopped and deleted on drop.
#[derive(Debug)]
pub struct PgServer {
    pub conn: String,
    pub version: String,
    bin: PathBuf,
    data: PathBuf,
    as_postgres: bool,
    _dir: tempfile::TempDir,
}

impl PgServer {
    fn command(bin: &Path, tool: &str, as_postgres: bool) -> Command {
        if as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
            c
        } else {
            Command::new(bin.join(tool))
        }
    }

    fn run(mut c: Command, what: &str) -> anyhow::Result<String> {
        let out = c.output().with_context(|| format!("cannot run {what}"))?;
        if !out.status.success() {
            bail!(
                "{what} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Start one with the binaries in `bin`, in a temporary folder under `base`.
    pub fn start(bin: &Path, base: Option<&Path>) -> anyhow::Result<Self> {
        let dir = super::target::temp_dir(base, "palisade-bench-pg-")?;
        let root = dir.path().to_path_buf();
        if root.to_string_lossy().chars().any(char::is_whitespace) {
            bail!(
                "the PostgreSQL folder {} contains whitespace; pass --data-dir without spaces",
                root.display()
            );
        }
        let as_postgres = running_as_root();
        if as_postgres {
            // PostgreSQL refuses to run as root: hand the folder to `postgres`.
            let (uid, gid) = user_ids("postgres").context(
                "running as root, and there is no `postgres` user to run PostgreSQL as (Debian's postgresql package creates it)",
            )?;
            std::os::unix::fs::chown(&root, Some(uid), Some(gid))
                .with_context(|| format!("cannot chown {} to postgres", root.display()))?;
        }
        let data = root.join("data");
        let mut init = Self::command(bin, "initdb", as_postgres);
        init.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        Self::run(init, "initdb")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("cannot find a free port")?
            .port();
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c synchronous_commit=on -c fsync=on -c max_connections=400 -c shared_buffers=256MB",
            root.display()
        );
        let mut start = Self::command(bin, "pg_ctl", as_postgres);
        start
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(root.join("server.log"))
            .args(["-w", "-t", "60", "-o", &opts, "start"]);
        if let Err(e) = Self::run(start, "pg_ctl start") {
            let log = std::fs::read_to_string(root.join("server.log")).unwrap_or_default();
            bail!("{e}\nserver log:\n{log}");
        }
        let version = Self::run(
            {
                let mut c = Command::new(bin.join("pg_ctl"));
                c.arg("--version");
                c
            },
            "pg_ctl --version",
        )
        .unwrap_or_default()
        .trim()
        .to_owned();
        Ok(Self {
            conn: format!("host=127.0.0.1 port={port} user=postgres dbname=postgres"),
            version,
            bin: bin.to_path_buf(),
            data,
            as_postgres,
            _dir: dir,
        })
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let mut stop = Self::command(&self.bin, "pg_ctl", self.as_postgres);
        stop.arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "-t", "30", "stop"]);
        if let Err(e) = Self::run(stop, "pg_ctl stop") {
            tracing::warn!(error = %e, "could not stop the throwaway PostgreSQL server");
        }
    }
}

async fn connect(conn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL ({conn})"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection ended");
        }
    });
    client
        .batch_execute("SET synchronous_commit = on; SET client_min_messages = warning")
        .await
        .context("SET synchronous_commit")?;
    Ok(client)
}

/// The server's message for a database error, else the client's.
fn pg_error(e: &tokio_postgres::Error) -> String {
    e.as_db_error().map_or_else(
        || e.to_string(),
        |d| format!("{}: {}", d.code().code(), d.message()),
    )
}

const UPDATE_FENCE: &str = "UPDATE bench_fences SET fence = $1 WHERE id = $2 AND fence <= $1";
const INSERT_EVENTS: &str = "INSERT INTO bench_events (twin_id, event_id, type, patch, token) \
     SELECT $1::text, t.i, 'telemetry', t.p::jsonb, $4::int8 FROM unnest($2::text[], $3::text[]) AS t(i, p)";

/// Create the tables and one fence row per twin; returns notes for the report.
pub async fn prepare(conn: &str, twins: &Twins) -> anyhow::Result<Value> {
    let client = connect(conn).await?;
    client
        .batch_execute(
            "DROP TABLE IF EXISTS bench_events; DROP TABLE IF EXISTS bench_fences;
             CREATE TABLE bench_fences (id text PRIMARY KEY, fence bigint NOT NULL);
             CREATE TABLE bench_events (seq bigserial PRIMARY KEY, twin_id text NOT NULL,
                 event_id text NOT NULL, type text NOT NULL, patch jsonb NOT NULL,
                 token bigint NOT NULL, UNIQUE (twin_id, event_id));",
        )
        .await
        .context("cannot create the baseline's tables")?;
    for chunk in twins.ids.chunks(10_000) {
        let ids: Vec<&str> = chunk.iter().map(String::as_str).collect();
        client
            .execute(
                "INSERT INTO bench_fences (id, fence) SELECT unnest($1::text[]), 0",
                &[&ids],
            )
            .await
            .context("cannot insert the fence rows")?;
    }
    let show = |q: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(q, &[])
                .await
                .ok()
                .and_then(|r| r.try_get::<_, String>(0).ok())
                .unwrap_or_default()
        }
    };
    Ok(json!({
        "server_version": show("SELECT version()").await,
        "synchronous_commit": show("SHOW synchronous_commit").await,
        "fsync": show("SHOW fsync").await,
        "wal_sync_method": show("SHOW wal_sync_method").await,
        "recipe": [ "BEGIN", UPDATE_FENCE, INSERT_EVENTS, "COMMIT" ],
    }))
}

/// W connections, each running the recipe in a loop on its writer's twins.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    conn: &str,
    twins: &Twins,
    per_writer: &[Vec<u32>],
    batch: usize,
    events: &Events,
    warmup: Duration,
    window: Window,
    label: &str,
) -> anyhow::Result<LoadResult> {
    let phase = Arc::new(Phase::default());
    let live = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for (w, mine) in per_writer.iter().enumerate() {
        let mut client = connect(conn).await?;
        let upd = client
            .prepare(UPDATE_FENCE)
            .await
            .context("prepare UPDATE")?;
        let ins = client
            .prepare(INSERT_EVENTS)
            .await
            .context("prepare INSERT")?;
        let ids: Vec<String> = mine
            .iter()
            .map(|i| twins.ids[*i as usize].clone())
            .collect();
        let (phase, live, events) = (phase.clone(), live.clone(), events.clone());
        let prefix = load::unique_prefix(&format!("pg{w}-"));
        tasks.spawn(async move {
            let mut stats = OpStats::default();
            let mut rng = load::Rng::new();
            let mut counter = 0u64;
            let token: i64 = 1;
            let patches: Vec<&str> = vec![events.patch.as_str(); batch];
            while phase.get() != DONE && !ids.is_empty() {
                let twin = &ids[rng.below(ids.len())];
                let event_ids: Vec<String> = (0..batch)
                    .map(|_| {
                        counter += 1;
                        format!("{}-{prefix}-{counter}", events.nonce)
                    })
                    .collect();
                let started = Instant::now();
                let r: Result<bool, tokio_postgres::Error> = async {
                    let tx = client.transaction().await?;
                    if tx.execute(&upd, &[&token, twin]).await? != 1 {
                        tx.rollback().await?;
                        return Ok(false);
                    }
                    tx.execute(&ins, &[twin, &event_ids, &patches, &token])
                        .await?;
                    tx.commit().await?;
                    Ok(true)
                }
                .await;
                if phase.get() != MEASURE {
                    if let Err(e) = &r {
                        *stats
                            .errors
                            .entry(format!("postgres (warm-up): {}", pg_error(e)))
                            .or_default() += 1;
                    }
                } else {
                    match r {
                        Ok(true) => {
                            stats.requests += 1;
                            stats.events += batch as u64;
                            stats.latency.record(started.elapsed());
                            phase.measured.fetch_add(1, Ordering::Relaxed);
                            live.fetch_add(batch as u64, Ordering::Relaxed);
                        }
                        Ok(false) => *stats.errors.entry("stale".into()).or_default() += 1,
                        Err(e) => {
                            *stats
                                .errors
                                .entry(format!("postgres: {}", pg_error(&e)))
                                .or_default() += 1
                        }
                    }
                }
                if client.is_closed() {
                    *stats
                        .errors
                        .entry("postgres: connection closed".into())
                        .or_default() += 1;
                    break;
                }
            }
            stats
        });
    }
    let bar = load::progress(label, window);
    let (elapsed, cpu) = load::drive(
        &phase,
        warmup,
        window,
        &bar,
        || live.load(Ordering::Relaxed),
        async {},
    )
    .await;
    let mut out = LoadResult {
        elapsed,
        cpu,
        ..LoadResult::default()
    };
    while let Some(r) = tasks.join_next().await {
        let s = r.context("a postgres task panicked")?;
        out.append.requests += s.requests;
        out.append.events += s.events;
        out.append.latency.merge(&s.latency);
        for (k, v) in s.errors {
            *out.append.errors.entry(k).or_default() += v;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_passwd() {
        assert_eq!(super::user_ids("root"), Some((0, 0)));
        assert_eq!(super::user_ids("no-such-user-here"), None);
    }
}
