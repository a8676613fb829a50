//! The fault-injection suite: real `palisade serve` processes, real writer
//! processes (`palisade-fault-writer`), real signals. See README.md for what
//! each file guards against and how to run many rounds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_pause_http.rs"]
mod pause_http;

#[path = "02_network_delay.rs"]
mod network_delay;

#[path = "03_crash_store.rs"]
mod crash_store;

#[path = "04_clock.rs"]
mod clock;

#[path = "05_pause_kafka.rs"]
mod pause_kafka;

#[path = "06_syscalls.rs"]
mod syscalls;

#[path = "07_full_disk.rs"]
mod full_disk;

#[path = "08_connections.rs"]
mod connections;

#[path = "../kafka/broker.rs"]
#[allow(dead_code)]
mod broker;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::Client;

/// Rounds of each repeated scenario: `PALISADE_FAULT_ROUNDS` (default 3).
pub fn rounds() -> usize {
    std::env::var("PALISADE_FAULT_ROUNDS")
        .ok()
        .map(|v| {
            v.parse()
                .ok()
                .filter(|n| *n >= 1)
                .unwrap_or_else(|| panic!("PALISADE_FAULT_ROUNDS={v:?} is not a number >= 1"))
        })
        .unwrap_or(3)
}

/// `kill -<sig> <pid>`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// Poll `cond` every 5 ms until it holds; panic with `what` after `timeout`.
pub async fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut cond: F) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One line of a writer's acks file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    Ack {
        i: u64,
        token: u64,
        seq: u64,
    },
    Stale {
        i: u64,
        token: u64,
        fence: u64,
    },
    Err {
        i: u64,
        what: String,
    },
    Lost {
        i: u64,
    },
    /// Kafka mode: the broker acknowledged record i at (partition, offset).
    Sent {
        i: u64,
        token: u64,
        partition: u64,
        offset: u64,
    },
}

/// The complete lines of an acks file (a partial last line is ignored: the
/// writer was killed while writing it, so it was never fsynced as a whole).
pub fn read_acks(path: &Path) -> Vec<Line> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => "",
    };
    complete
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let n = |k: usize| -> u64 {
                f.get(k)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or_else(|| panic!("bad acks line {l:?}"))
            };
            match f[0] {
                "ACK" => Line::Ack {
                    i: n(1),
                    token: n(2),
                    seq: n(3),
                },
                "STALE" => Line::Stale {
                    i: n(1),
                    token: n(2),
                    fence: n(3),
                },
                "ERR" => Line::Err {
                    i: n(1),
                    what: f[2..].join(" "),
                },
                "LOST" => Line::Lost { i: n(1) },
                "SENT" => Line::Sent {
                    i: n(1),
                    token: n(2),
                    partition: n(3),
                    offset: n(4),
                },
                _ => panic!("bad acks line {l:?}"),
            }
        })
        .collect()
}

/// The attempts of an acks file (every line but `LOST`).
pub fn attempts(lines: &[Line]) -> Vec<Line> {
    lines
        .iter()
        .filter(|l| !matches!(l, Line::Lost { .. }))
        .cloned()
        .collect()
}

/// `(i, token, seq)` of every ACK line.
pub fn acked(lines: &[Line]) -> Vec<(u64, u64, u64)> {
    lines
        .iter()
        .filter_map(|l| match *l {
            Line::Ack { i, token, seq } => Some((i, token, seq)),
            _ => None,
        })
        .collect()
}

/// A running `palisade-fault-writer` process.
pub struct Writer {
    pub child: Child,
    pub holder: String,
    pub token: u64,
    pub lease_id: String,
    pub acks: PathBuf,
    stdout: BufReader<ChildStdout>,
}

/// Kafka mode of a writer: brokers, topic, partition count, producer settings.
pub type KafkaArgs = (String, String, u32, Vec<(String, String)>);

/// What to start a writer with.
#[derive(Clone)]
pub struct WriterArgs {
    pub url: String,
    pub lease_url: Option<String>,
    pub twin: String,
    pub scope: String,
    pub holder: String,
    pub ttl_ms: u64,
    pub count: u64,
    pub interval_ms: u64,
    pub start_at: u64,
    pub max_stale: Option<u64>,
    pub max_errors: Option<u64>,
    /// Publish to Kafka instead of appending over HTTP.
    pub kafka: Option<KafkaArgs>,
}

impl WriterArgs {
    /// A twin-scoped writer on `url`: 1000 events, 20 ms apart, TTL 1 s.
    pub fn new(url: &str, twin: &str, holder: &str) -> Self {
        Self {
            url: url.to_owned(),
            lease_url: None,
            twin: twin.to_owned(),
            scope: format!("twin/{twin}"),
            holder: holder.to_owned(),
            ttl_ms: 1000,
            count: 1000,
            interval_ms: 20,
            start_at: 0,
            max_stale: None,
            max_errors: None,
            kafka: None,
        }
    }
}

impl Writer {
    /// [`start`](Self::start), then wait (up to 30 s) until the writer has
    /// `n` acknowledged appends.
    pub async fn start_acked(args: WriterArgs, acks: PathBuf, n: usize) -> Self {
        let what = format!("{}'s first {n} acknowledgement(s)", args.holder);
        let w = Self::start(args, acks).await;
        wait_until(&what, Duration::from_secs(30), || {
            acked(&w.lines()).len() >= n
        })
        .await;
        w
    }

    /// Spawn the writer and wait (off the async runtime) for its `TOKEN`
    /// and `LEASE` lines: once this returns, its lease is granted.
    pub async fn start(args: WriterArgs, acks: PathBuf) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_palisade-fault-writer"));
        cmd.args(["--url", &args.url])
            .args(["--scope", &args.scope])
            .args(["--twin", &args.twin])
            .args(["--holder", &args.holder])
            .args(["--ttl-ms", &args.ttl_ms.to_string()])
            .args(["--count", &args.count.to_string()])
            .args(["--interval-ms", &args.interval_ms.to_string()])
            .args(["--start-at", &args.start_at.to_string()])
            .arg("--acks")
            .arg(&acks);
        if let Some(u) = &args.lease_url {
            cmd.args(["--lease-url", u]);
        }
        if let Some(m) = args.max_stale {
            cmd.args(["--max-stale", &m.to_string()]);
        }
        if let Some(m) = args.max_errors {
            cmd.args(["--max-errors", &m.to_string()]);
        }
        if let Some((brokers, topic, partitions, settings)) = &args.kafka {
            cmd.args(["--kafka-brokers", brokers, "--kafka-topic", topic])
                .args(["--partitions", &partitions.to_string()]);
            for (k, v) in settings {
                cmd.args(["--kafka-setting", &format!("{k}={v}")]);
            }
        }
        let mut child = cmd
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn palisade-fault-writer");
        let stdout = child.stdout.take().unwrap();
        let holder = args.holder.clone();
        let (stdout, token, lease_id) = tokio::task::spawn_blocking(move || {
            let mut r = BufReader::new(stdout);
            let mut read = |prefix: &str| {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                line.trim()
                    .strip_prefix(prefix)
                    .unwrap_or_else(|| panic!("writer {holder}: expected {prefix:?}, got {line:?}"))
                    .to_owned()
            };
            let token: u64 = read("TOKEN ").parse().unwrap();
            let lease = read("LEASE ");
            (r, token, lease)
        })
        .await
        .unwrap();
        Self {
            child,
            holder: args.holder,
            token,
            lease_id,
            acks,
            stdout,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn lines(&self) -> Vec<Line> {
        read_acks(&self.acks)
    }

    /// Wait for the writer to exit by itself; it must exit 0 and print `DONE`.
    pub async fn finish(mut self, timeout: Duration) -> Vec<Line> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "writer {} exited {status}", self.holder);
                break;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                panic!("writer {} did not finish within {timeout:?}", self.holder);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        assert!(
            rest.contains("DONE "),
            "writer {}: no DONE line in {rest:?}",
            self.holder
        );
        self.lines()
    }

    /// Wait until the writer made `n` attempts after its first `from` lines,
    /// then give it a moment to exit by itself (a writer with `--max-stale n`
    /// does, once refused n times). If it does not, it is killed: the
    /// caller's assertions on the lines then say what went wrong. Returns
    /// the lines and whether the writer exited by itself.
    pub async fn finish_after(mut self, from: usize, n: usize) -> (Vec<Line>, bool) {
        wait_until(
            &format!("{n} attempts of writer {} after line {from}", self.holder),
            Duration::from_secs(30),
            || {
                let lines = self.lines();
                attempts(&lines[from.min(lines.len())..]).len() >= n
            },
        )
        .await;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            if self.child.try_wait().unwrap().is_some() {
                return (self.finish(Duration::ZERO).await, true);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        (self.lines(), false)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped process.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every stored event of a twin, oldest first (all pages).
pub async fn history(c: &Client, twin: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = 0u64;
    loop {
        let r = c
            .get(&format!("/v1/twins/{twin}/events?after={after}&limit=1000"))
            .await;
        assert_eq!(r.status, 200, "history of {twin}: {:?}", r.body);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = page.last().unwrap()["seq"].as_u64().unwrap();
        out.extend(page);
    }
}

/// The twin's `(version, fence)`; `None` if it has no events.
pub async fn twin_version(c: &Client, twin: &str) -> Option<(u64, u64)> {
    let r = c.twin(twin).await;
    match r.status {
        200 => Some((
            r.body["version"].as_u64().unwrap(),
            r.body["fence"].as_u64().unwrap(),
        )),
        404 => None,
        s => panic!("GET twin {twin}: {s} {:?}", r.body),
    }
}

/// `(partition, fence)` of every partition, and the last token issued.
pub async fn partitions(c: &Client) -> (Vec<(u64, u64)>, u64) {
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let list = r.body["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["partition"].as_u64().unwrap(),
                p["fence"].as_u64().unwrap(),
            )
        })
        .collect();
    (list, r.body["last_token"].as_u64().unwrap())
}

/// A paused (or delayed) writer A was superseded by writer B. `cut` is the
/// twin's version taken while A could not reach the store and before B was
/// started: every event of A the store accepted has a seq at or below it.
/// `a_lines_before` is how many lines A had written when it was resumed
/// (its in-flight request, if any, may still be acknowledged after that).
pub struct Superseded<'a> {
    pub c: &'a Client,
    pub twin: &'a str,
    pub a: (&'a str, u64, &'a [Line]),
    pub b: (&'a str, u64, &'a [Line]),
    pub cut: u64,
    pub a_lines_before: usize,
    /// Least number of refused attempts A must have made after resuming.
    pub min_stale: usize,
    pub round: usize,
}

/// The assertions of the reference article's scenarios 1 and 3 (lease lost).
pub async fn assert_superseded(s: Superseded<'_>) {
    let Superseded {
        c,
        twin,
        round,
        cut,
        ..
    } = s;
    let (a_name, a_token, a_lines) = s.a;
    let (b_name, b_token, b_lines) = s.b;
    let ctx = format!("round {round}, twin {twin}, A={a_name}/{a_token}, B={b_name}/{b_token}");
    assert!(b_token > a_token, "{ctx}: tokens not increasing");

    let a_attempts = attempts(a_lines);
    let b_attempts = attempts(b_lines);
    for l in a_attempts.iter().chain(&b_attempts) {
        assert!(
            !matches!(l, Line::Err { .. }),
            "{ctx}: unexpected error {l:?}"
        );
    }
    // B was never refused and wrote something.
    let b_acks = acked(&b_attempts);
    assert!(!b_acks.is_empty(), "{ctx}: B acknowledged nothing");
    assert_eq!(
        b_acks.len(),
        b_attempts.len(),
        "{ctx}: B refused: {b_lines:?}"
    );

    // Every attempt of A after it resumed was refused, except at most the
    // one in flight when it was paused, which the store had already
    // accepted before B existed (its seq is at or below the cut).
    let after = attempts(&a_lines[s.a_lines_before.min(a_lines.len())..]);
    let mut stale = 0;
    for (k, l) in after.iter().enumerate() {
        match *l {
            Line::Stale { token, fence, .. } => {
                assert_eq!(token, a_token, "{ctx}");
                assert!(fence >= b_token, "{ctx}: refused with fence {fence}");
                stale += 1;
            }
            Line::Ack { seq, .. } => assert!(
                k == 0 && seq <= cut,
                "{ctx}: A's write acknowledged after it resumed: {l:?} (cut {cut}); A: {a_lines:?}"
            ),
            _ => unreachable!(),
        }
    }
    assert!(
        stale >= s.min_stale,
        "{ctx}: only {stale} refused attempts after resuming: {a_lines:?}"
    );
    // Once refused, always refused.
    if let Some(first) = a_attempts
        .iter()
        .position(|l| matches!(l, Line::Stale { .. }))
    {
        assert!(
            a_attempts[first..]
                .iter()
                .all(|l| matches!(l, Line::Stale { .. })),
            "{ctx}: A acknowledged after a refusal: {a_lines:?}"
        );
    }

    // The store's side: history.
    let events = history(c, twin).await;
    let mut ids = BTreeMap::new();
    for e in &events {
        let id = e["event_id"].as_str().unwrap().to_owned();
        assert!(
            ids.insert(id.clone(), e.clone()).is_none(),
            "{ctx}: duplicate {id}"
        );
    }
    let b_first = events
        .iter()
        .find(|e| e["token"] == b_token)
        .unwrap_or_else(|| panic!("{ctx}: no event of B in the history"))["seq"]
        .as_u64()
        .unwrap();
    assert!(b_first > cut, "{ctx}: B's first seq {b_first} <= cut {cut}");
    for e in &events {
        let seq = e["seq"].as_u64().unwrap();
        if e["token"] == a_token {
            assert!(
                seq <= cut && seq < b_first,
                "{ctx}: A's event {e} stored after B's grant (cut {cut}, B's first seq {b_first})"
            );
        }
        if seq >= b_first {
            assert_eq!(
                e["token"], b_token,
                "{ctx}: an event after B's first is not B's: {e}"
            );
        }
    }
    // Every acknowledgement is in the history, and nothing else of A's or B's.
    for (name, token, acks) in [
        (a_name, a_token, acked(&a_attempts)),
        (b_name, b_token, b_acks.clone()),
    ] {
        let stored: Vec<&Value> = events.iter().filter(|e| e["token"] == token).collect();
        assert_eq!(
            stored.len(),
            acks.len(),
            "{ctx}: {name} has {} acks but {} stored events",
            acks.len(),
            stored.len()
        );
        for (i, t, seq) in acks {
            assert_eq!(t, token, "{ctx}");
            let e = ids
                .get(&format!("{name}-{i}"))
                .unwrap_or_else(|| panic!("{ctx}: acknowledged {name}-{i} is not stored"));
            assert_eq!(e["seq"], seq, "{ctx}: {e}");
            assert_eq!(e["token"], token, "{ctx}: {e}");
        }
    }

    // Final state is B's last write; the fence is B's token.
    let last_b = b_acks.last().unwrap().0;
    let t = c.twin(twin).await;
    assert_eq!(t.status, 200, "{ctx}: {:?}", t.body);
    assert_eq!(t.body["state"]["by"], b_name, "{ctx}: {:?}", t.body);
    assert_eq!(t.body["state"]["n"], last_b, "{ctx}: {:?}", t.body);
    assert_eq!(t.body["fence"], b_token, "{ctx}: {:?}", t.body);
}
