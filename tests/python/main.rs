//! Other languages (issue 17), end to end: the Python worker example
//! (`examples/python/worker.py`) against a real `palisade serve` and the
//! Kafka suite's broker, and a client generated from the served
//! `/v1/openapi.json` by openapi-python-client. See README.md.
//!
//! A Python package missing is a loud `SKIPPED` on a developer's machine,
//! and a failure with `CI` or `PALISADE_REQUIRE_PYTHON` set (`.ci/run`
//! installs them), hence the `_when_installed` names.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

// Shared with tests/kafka; this binary uses only part of it.
#[allow(dead_code)]
#[path = "../kafka/broker.rs"]
mod broker;

#[path = "01_worker.rs"]
mod worker;

#[path = "02_generated_client.rs"]
mod generated_client;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The repository root (examples, proto and the test scripts are read from it).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// Whether a missing Python package must fail the test instead of skipping it.
fn required() -> bool {
    env_set("CI") || env_set("PALISADE_REQUIRE_PYTHON")
}

/// The pip command that installs what these tests need (the versions .ci/run pins).
pub const PIP_INSTALL: &str = "  python3 -m venv ~/.cache/palisade/venv
  ~/.cache/palisade/venv/bin/pip install confluent-kafka \\
      openapi-python-client==0.29.1 protobuf==7.36.2 grpcio-tools==1.85.1
  (or set PALISADE_PYTHON to a python that has them)";

/// The first of `$PALISADE_PYTHON`, `python3` and
/// `~/.cache/palisade/venv/bin/python3` that imports every module of
/// `modules`; `None` (after a loud SKIPPED, or a panic when required) if
/// none does.
pub fn python_with(modules: &[&str]) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("PALISADE_PYTHON") {
        candidates.push(p.into());
    }
    candidates.push("python3".into());
    let home = PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()));
    candidates.push(home.join(".cache/palisade/venv/bin/python3"));
    let probe = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let found = candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", &probe])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        let msg = format!(
            "no python with {} (tried $PALISADE_PYTHON, python3, ~/.cache/palisade/venv). Install:\n{PIP_INSTALL}",
            modules.join(", ")
        );
        assert!(
            !required(),
            "CI or PALISADE_REQUIRE_PYTHON is set, so the Python test must run: {msg}"
        );
        eprintln!("\n******** SKIPPED: {msg}\n******** (this fails when CI is set)\n");
    }
    found
}

/// Run `python args...` to completion; panic with its output unless it succeeds.
pub fn run_python(python: &Path, args: &[&str], envs: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new(python);
    cmd.args(args).env("PYTHONDONTWRITEBYTECODE", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}):\n{stdout}{}",
        python.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A Python program running in the background whose stdout lines are
/// collected as they come (the worker prints one line per step).
pub struct PyProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl PyProcess {
    pub fn spawn(python: &Path, args: &[String], envs: &[(&str, &Path)]) -> Self {
        let mut cmd = Command::new(python);
        cmd.args(args)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            // Lines as they are printed, not when a buffer fills.
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn python");
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        Self {
            child,
            lines,
            reader: Some(reader),
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Poll the collected lines until `f` finds what it wants, or panic after `timeout`.
    pub fn wait_for<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut(&[String]) -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            let lines = self.lines();
            if let Some(v) = f(&lines) {
                return v;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                // Lines printed just before the exit may still be in the pipe.
                if let Some(h) = self.reader.take() {
                    h.join().unwrap();
                }
                let lines = self.lines();
                if let Some(v) = f(&lines) {
                    return v;
                }
                panic!(
                    "the program exited ({status}) before {what}:\n{}",
                    lines.join("\n")
                );
            }
            assert!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}:\n{}",
                lines.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait for the exit (killing the program after `timeout`, and panicking).
    pub fn wait(&mut self, timeout: Duration) -> (ExitStatus, Vec<String>) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                if let Some(h) = self.reader.take() {
                    h.join().unwrap();
                }
                return (status, self.lines());
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "still running after {timeout:?}; killed. Output:\n{}",
                    self.lines().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` from a worker line such as `delivered event_id=a-3-0 partition=1 offset=4`.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}
