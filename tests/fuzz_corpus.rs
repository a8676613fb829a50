//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) through the
//! fuzz targets' bodies on stable, as regression tests: every input must
//! run without a panic. The bodies are `fuzz/src/lib.rs`, shared with the
//! cargo-fuzz binaries (`fuzz/README.md`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
}

/// Run every corpus file of `target` through `f`; report every file that
/// panics (not only the first). Returns which seeds were accepted.
fn replay(target: &str, f: fn(&[u8]) -> bool) -> Vec<String> {
    let mut failed = Vec::new();
    let mut accepted = Vec::new();
    let files = corpus(target);
    for path in &files {
        let data = std::fs::read(path).unwrap();
        match std::panic::catch_unwind(|| f(&data)) {
            Ok(true) => accepted.push(path.file_name().unwrap().to_string_lossy().into_owned()),
            Ok(false) => {}
            Err(_) => failed.push(path.display().to_string()),
        }
    }
    assert!(failed.is_empty(), "{target}: panicked on {failed:#?}");
    println!(
        "{target}: {} inputs, {} accepted",
        files.len(),
        accepted.len()
    );
    accepted
}

/// The seeds reach both sides of each decoder: the valid ones are accepted
/// (so the harness's input layout is right), the broken ones refused.
fn check_seeds(accepted: &[String], valid: &[&str], invalid: &[&str]) {
    for s in valid {
        assert!(
            accepted.iter().any(|a| a == &format!("seed-{s}")),
            "seed-{s} refused"
        );
    }
    for s in invalid {
        assert!(
            !accepted.iter().any(|a| a == &format!("seed-{s}")),
            "seed-{s} accepted"
        );
    }
}

#[test]
fn codec_event() {
    let ok = replay("codec_event", targets::codec_event);
    check_seeds(
        &ok,
        &["golden", "u64-max-seq"],
        &[
            "empty",
            "version-9",
            "truncated",
            "trailing",
            "huge-length",
            "bad-utf8",
        ],
    );
}

#[test]
fn http_events_json() {
    let ok = replay("http_events_json", targets::http_events_json);
    check_seeds(
        &ok,
        &["one", "full", "batch", "deep", "big-numbers", "unicode"],
        &[
            "empty-batch",
            "bad-json",
            "patch-not-object",
            "bad-hlc",
            "extra-field",
            "wrong-type",
            "non-utf8",
        ],
    );
}

#[test]
fn kafka_record() {
    let ok = replay("kafka_record", targets::kafka_record);
    check_seeds(
        &ok,
        &[
            "proto",
            "proto-hlc",
            "json",
            "json-batch",
            "one-partition",
            "any-partition",
        ],
        &[
            "no-key",
            "no-value",
            "wrong-partition",
            "two-tokens",
            "two-same-tokens",
            "no-token",
            "null-token",
            "negative-token",
            "overflow-token",
            "bad-hlc",
            "bad-content-type",
            "too-large",
            "bad-proto",
            "bad-patch",
            "bad-key-utf8",
        ],
    );
}
