//! `palisade serve --config FILE` and `palisade config check`: precedence
//! flag > environment > file > default; unknown keys and bad values refused.

use std::path::{Path, PathBuf};

use crate::support::ServeProcess;
use crate::{palisade, run, run_with, Run};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn partition_count(url: &str) -> usize {
    run(url, &["partitions", "--json"]).ok().json()["partitions"]
        .as_array()
        .unwrap()
        .len()
}

#[test]
fn the_file_sets_what_no_flag_sets() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "p.toml",
        "partitions = 4\nmax_batch_events = 2\n",
    );
    let cfg = cfg.to_str().unwrap();

    // The file's partition count creates the store.
    let data = dir.path().join("from-file");
    let server = ServeProcess::start(&data, &["--config", cfg]);
    assert_eq!(partition_count(&server.base), 4);
    // ...and its other keys apply too: batches above 2 events are refused.
    let url = server.base.as_str();
    let (_, token) = crate::acquire(url, "twin/b", "h");
    let body = r#"[{"type":"t","patch":{}},{"type":"t","patch":{}},{"type":"t","patch":{}}]"#;
    let r = run_with(
        &mut palisade(),
        &[
            "append",
            "--twin",
            "b",
            "--token",
            &token.to_string(),
            "-f",
            "-",
            "--json",
            "--url",
            url,
        ],
        Some(body),
    );
    assert_eq!(r.code, 1, "{r:?}");
    assert_eq!(r.json()["error"], "batch_too_large");
    server.terminate();

    // A flag beats the file (a fresh store: the count is fixed at creation).
    let data = dir.path().join("from-flag");
    let server = ServeProcess::start(&data, &["--config", cfg, "--partitions", "8"]);
    assert_eq!(partition_count(&server.base), 8);
    server.terminate();

    // PALISADE_CONFIG names the file too.
    let data = dir.path().join("from-env");
    let server = crate::try_serve(
        palisade().env("PALISADE_CONFIG", cfg),
        &data,
        "127.0.0.1:0",
        &[],
    )
    .expect("serve with PALISADE_CONFIG");
    assert_eq!(partition_count(&server.base), 4);
    server.terminate();
}

fn check(cmd: &mut std::process::Command, cfg: &Path, json: bool) -> Run {
    let mut args = vec!["config", "check", "--config", cfg.to_str().unwrap()];
    if json {
        args.push("--json");
    }
    run_with(cmd, &args, None)
}

#[test]
fn config_check_prints_the_effective_settings_and_their_sources() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "p.toml",
        "partitions = 4\nmax_drift_ms = 700\nlisten = \"127.0.0.1:7171\"\n\n[kafka_settings]\n\"socket.keepalive.enable\" = \"true\"\n",
    );
    let r = check(palisade().env("PALISADE_MAX_DRIFT_MS", "900"), &cfg, true).ok();
    let s = &r.json()["settings"];
    assert_eq!(s["partitions"]["value"], 4);
    assert_eq!(s["partitions"]["source"], "file");
    // The environment beats the file.
    assert_eq!(s["max_drift_ms"]["value"], 900);
    assert_eq!(s["max_drift_ms"]["source"], "env");
    assert_eq!(s["listen"]["value"], "127.0.0.1:7171");
    assert_eq!(s["snapshot_every"]["value"], 64);
    assert_eq!(s["snapshot_every"]["source"], "default");
    assert_eq!(s["kafka_brokers"]["value"], serde_json::Value::Null);
    assert_eq!(
        s["kafka_settings"]["value"]["socket.keepalive.enable"],
        "true"
    );

    // For people: the settings as TOML, with where each comes from.
    let r = check(palisade().env("PALISADE_MAX_DRIFT_MS", "900"), &cfg, false).ok();
    assert!(r.stdout.lines().next().unwrap().ends_with(": OK"), "{r:?}");
    let line = |key: &str| {
        r.stdout
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no {key} line: {r:?}"))
            .to_owned()
    };
    assert!(line("partitions").ends_with("# file"), "{r:?}");
    assert!(line("max_drift_ms").contains("900"), "{r:?}");
    assert!(
        line("max_drift_ms").ends_with("# env PALISADE_MAX_DRIFT_MS"),
        "{r:?}"
    );
    assert!(line("cache_mb").ends_with("# default"), "{r:?}");

    // The shipped example checks clean.
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("palisade.example.toml");
    check(&mut palisade(), &example, false).ok();
}

#[test]
fn config_check_refuses_unknown_keys_and_bad_values() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("partitions = 4\nmax_drfit_ms = 10\n", "max_drfit_ms"),
        ("partitions = 0\n", "partitions"),
        ("partitions = \"four\"\n", "partitions"),
        ("listen = \"localhost\"\n", "listen"),
        ("max_batch_events = 0\n", "max-batch-events"),
        ("partitions = 4\npartitions = 5\n", "partitions"),
        (
            "[kafka_settings]\nsecurity.protocol = \"ssl\"\n",
            "kafka_settings",
        ),
        ("this is not toml\n", "TOML"),
    ];
    for (i, (text, named)) in cases.into_iter().enumerate() {
        let cfg = write(dir.path(), &format!("bad-{i}.toml"), text);
        let r = check(&mut palisade(), &cfg, false);
        assert_eq!(r.code, 1, "{text:?}: {r:?}");
        assert!(
            r.stderr.contains(named),
            "{text:?} should name {named:?}: {r:?}"
        );
        let r = check(&mut palisade(), &cfg, true);
        assert_eq!(r.code, 1, "{text:?}: {r:?}");
        assert_eq!(r.json()["error"], "invalid_config", "{text:?}: {r:?}");
    }
    let r = check(&mut palisade(), &dir.path().join("missing.toml"), false);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("missing.toml"), "{r:?}");

    // `palisade serve` refuses the same file and does not start.
    let cfg = write(
        dir.path(),
        "serve-bad.toml",
        "partitions = 4\ncolour = \"red\"\n",
    );
    let data = dir.path().join("never");
    let r = run_with(
        &mut palisade(),
        &[
            "serve",
            "--config",
            cfg.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        None,
    );
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.stderr.contains("colour"), "{r:?}");
    assert!(r.stdout.is_empty() && !data.exists(), "{r:?}");
}
