//! The `palisade` binary's client commands and config file, end to end: the
//! real binary (`CARGO_BIN_EXE_palisade`) against a real `palisade serve`
//! process on a loopback port. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_round_trip.rs"]
mod round_trip;

#[path = "02_refusals.rs"]
mod refusals;

#[path = "03_tail.rs"]
mod tail;

#[path = "04_config_file.rs"]
mod config_file;

#[path = "05_bad_settings.rs"]
mod bad_settings;

#[path = "06_export_import.rs"]
mod export_import;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// `palisade` with no `PALISADE_*` variables from the caller's environment
/// (CI exports some), quiet logs.
pub fn palisade() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_palisade"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PALISADE_") {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "warn");
    c
}

/// One finished run: exit code and output.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// stdout as one JSON document.
    #[track_caller]
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {self:?}"))
    }

    /// stdout as JSON lines.
    #[track_caller]
    pub fn json_lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?} in {self:?}"))
            })
            .collect()
    }

    /// Assert success and return self.
    #[track_caller]
    pub fn ok(self) -> Self {
        assert_eq!(self.code, 0, "palisade failed: {self:?}");
        self
    }
}

/// Run `palisade ARGS` (with `stdin` as its input) to completion.
pub fn run_with(cmd: &mut Command, args: &[&str], stdin: Option<&str>) -> Run {
    let mut child = cmd
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn palisade");
    {
        let mut input = child.stdin.take().unwrap();
        if let Some(s) = stdin {
            input.write_all(s.as_bytes()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().expect("palisade was killed by a signal"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// `palisade ARGS --url URL`.
pub fn run(url: &str, args: &[&str]) -> Run {
    let mut all = args.to_vec();
    all.extend(["--url", url]);
    run_with(&mut palisade(), &all, None)
}

/// A `palisade` process left running (e.g. `tail`), its stdout and stderr
/// read line by line in the background. Killed on drop.
pub struct Running {
    pub child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
}

fn lines_of(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Running {
    pub fn spawn(cmd: &mut Command, args: &[&str]) -> Self {
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn palisade");
        let stdout = lines_of(child.stdout.take().unwrap());
        let stderr = lines_of(child.stderr.take().unwrap());
        Self {
            child,
            stdout,
            stderr,
        }
    }

    /// The next stdout line, waiting at most `within`.
    #[track_caller]
    pub fn next_line(&self, within: Duration) -> String {
        self.stdout
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no stdout line within {within:?}: {e}"))
    }

    /// Any stdout line that arrives within `within`.
    pub fn maybe_line(&self, within: Duration) -> Option<String> {
        self.stdout.recv_timeout(within).ok()
    }

    /// Wait until a stderr line contains `needle`; returns it.
    #[track_caller]
    pub fn wait_stderr(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(e) => panic!("no stderr line with {needle:?} within {within:?}: {e}"),
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `palisade serve --data DATA --listen LISTEN EXTRA...` run from `cmd`
/// (e.g. with variables set); `None` if it exits without its ready line.
pub fn try_serve(
    cmd: &mut Command,
    data: &Path,
    listen: &str,
    extra: &[&str],
) -> Option<support::ServeProcess> {
    let mut child = cmd
        .arg("serve")
        .arg("--data")
        .arg(data)
        .args(["--listen", listen])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn palisade serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    match line.trim().strip_prefix("palisade listening on ") {
        Some(base) => Some(support::ServeProcess {
            child,
            base: base.to_owned(),
        }),
        None => {
            let _ = child.wait();
            None
        }
    }
}

/// Take a lease with the CLI; returns (lease_id, token).
pub fn acquire(url: &str, scope: &str, holder: &str) -> (String, u64) {
    let v = run(
        url,
        &[
            "lease", "acquire", "--scope", scope, "--holder", holder, "--ttl-ms", "60000", "--json",
        ],
    )
    .ok()
    .json();
    (
        v["lease_id"].as_str().unwrap().to_owned(),
        v["token"].as_u64().unwrap(),
    )
}

/// Append one event with the CLI; returns the response document.
pub fn append(url: &str, twin: &str, token: u64, event_id: &str, patch: &str) -> Value {
    run(
        url,
        &[
            "append",
            "--twin",
            twin,
            "--token",
            &token.to_string(),
            "--event-id",
            event_id,
            "--patch",
            patch,
            "--json",
        ],
    )
    .ok()
    .json()
}
