//! The partition count is fixed when a store is created: reopening with
//! another count is refused (a twin's partition depends on it), reopening
//! without the flag uses the stored count.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use palisade::core::{partition_for, TwinId};
use serde_json::json;

use crate::support::{token_of, ServeProcess};

/// Run `palisade serve` on `data` with `extra` flags, expecting it to exit on
/// its own; returns (success, stdout, stderr). Kills it if it keeps running.
fn run_to_exit(data: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("serve")
        .arg("--data")
        .arg(data)
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("palisade serve {extra:?} kept running; it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.success(), out, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_count_cannot_change() {
    let dir = tempfile::tempdir().unwrap();
    let twin = "counted";
    let p8 = partition_for(&TwinId::new(twin).unwrap(), 8).0;

    let proc = ServeProcess::start(dir.path(), &["--partitions", "8"]);
    let c = proc.client();
    assert_eq!(
        c.get("/v1/partitions").await.body["partitions"]
            .as_array()
            .unwrap()
            .len(),
        8
    );
    let t = token_of(&c.acquire(&format!("partition/{p8}"), "P", 60_000).await);
    assert_eq!(c.put(twin, t, "e-1", json!({"v": 1})).await.status, 201);
    let r = c.try_acquire("partition/8", "P", 1000).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.body["error"], "unknown_partition");
    proc.terminate();

    let (ok, out, err) = run_to_exit(dir.path(), &["--partitions", "16"]);
    assert!(!ok, "started with --partitions 16 on an 8-partition store");
    assert!(!out.contains("listening"), "stdout: {out}");
    assert!(
        err.contains("8 partitions") && err.contains("16"),
        "stderr does not explain the partition count: {err}"
    );

    // Without the flag the stored count is used, and the data is intact.
    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.body["partitions"].as_array().unwrap().len(), 8);
    let r = c.twin(twin).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["partition"], p8);
    assert_eq!(r.body["state"], json!({"v": 1}));
    // The same count, given explicitly, is fine too.
    proc.terminate();
    let proc = ServeProcess::start(dir.path(), &["--partitions", "8"]);
    assert_eq!(proc.client().twin(twin).await.status, 200);
    proc.terminate();

    // Out-of-range counts are refused before anything is opened.
    let (ok, _, err) = run_to_exit(dir.path(), &["--partitions", "0"]);
    assert!(!ok);
    assert!(err.contains("--partitions"), "stderr: {err}");
}
