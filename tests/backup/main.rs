//! `palisade backup` and `palisade restore` (issue 17) against the real
//! binary: a `palisade serve` process under write load, a backup taken over
//! HTTP, a restore into a new folder and `palisade serve` on it. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_backup_under_load.rs"]
mod backup_under_load;

#[path = "02_point_in_time.rs"]
mod point_in_time;

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;
use support::Client;

/// One finished `palisade` run.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    #[track_caller]
    pub fn json(&self) -> Value {
        assert_eq!(self.code, 0, "palisade failed: {self:?}");
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }
}

/// Run `palisade ARGS` to completion (no `PALISADE_*` from the caller).
pub fn palisade(args: &[&str]) -> Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_palisade"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PALISADE_") {
            c.env_remove(k);
        }
    }
    let out = c
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("spawn palisade");
    Run {
        code: out.status.code().expect("palisade was killed by a signal"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// `palisade restore --from FROM --data TO --json [extra]`.
pub fn restore(from: &Path, to: &Path, extra: &[&str]) -> Run {
    let mut args = vec![
        "restore",
        "--from",
        from.to_str().unwrap(),
        "--data",
        to.to_str().unwrap(),
        "--json",
    ];
    args.extend(extra);
    palisade(&args)
}

/// Every stored event of a twin, oldest first (paged).
pub async fn history(c: &Client, twin: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after = 0u64;
    loop {
        let r = c
            .get(&format!("/v1/twins/{twin}/events?limit=1000&after={after}"))
            .await;
        assert_eq!(r.status, 200, "history of {twin}: {:?}", r.body);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return all;
        }
        after = page.last().unwrap()["seq"].as_u64().unwrap();
        let full = page.len() == 1000;
        all.extend(page);
        if !full {
            return all;
        }
    }
}

/// `(fences, heads, last_token)` from `GET /v1/partitions`.
pub async fn partitions(c: &Client) -> (Vec<u64>, Vec<u64>, u64) {
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let list = r.body["partitions"].as_array().unwrap();
    (
        list.iter().map(|p| p["fence"].as_u64().unwrap()).collect(),
        list.iter().map(|p| p["head"].as_u64().unwrap()).collect(),
        r.body["last_token"].as_u64().unwrap(),
    )
}
