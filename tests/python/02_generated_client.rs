//! The OpenAPI document generates a working client: openapi-python-client
//! generates a Python package from the `/v1/openapi.json` a real `palisade
//! serve` serves (`--fail-on-warning`: a schema or operation the generator
//! has to skip fails the test), and `generated_client.py` uses it to import
//! every module, acquire, append, read, see `lease_held`, and, after a
//! release and a grant to another holder, a `409 stale_token` parsed into
//! its model. The store's own history is then checked, so the script cannot
//! pass without having talked to it.

use serde_json::json;

use crate::support::ServeProcess;
use crate::{python_with, repo, run_python};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_python_client_when_installed() {
    let Some(python) = python_with(&["openapi_python_client", "httpx", "attrs"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let s = ServeProcess::start(&dir.path().join("data"), &[]);
    let c = s.client();

    // The document exactly as served.
    let r = c
        .http
        .get(format!("{}/v1/openapi.json", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let spec = dir.path().join("openapi.json");
    std::fs::write(&spec, r.bytes().await.unwrap()).unwrap();

    // No post hooks: the default ones run ruff from PATH, which is no part
    // of what is tested (the generated code must import as it is).
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "post_hooks: []\n").unwrap();
    let gen = dir.path().join("gen");
    std::fs::create_dir(&gen).unwrap();
    let package = "palisade_client";
    let out = run_python(
        &python,
        &[
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            spec.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--meta",
            "none",
            "--fail-on-warning",
            "--output-path",
            gen.join(package).to_str().unwrap(),
        ],
        &[],
    );
    eprintln!("openapi-python-client: {}", out.trim());

    let twin = "gen-client-pump";
    let script = repo().join("tests/python/generated_client.py");
    let out = run_python(
        &python,
        &[script.to_str().unwrap(), &s.base, package, twin],
        &[("PYTHONPATH", &gen)],
    );
    eprintln!("{out}");
    for step in [
        "ok imported",
        "ok acquired",
        "ok appended",
        "ok lease_held",
        "ok stale_token",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(step)),
            "no {step:?} in:\n{out}"
        );
    }

    // What the store has: both holders' events, not the stale one.
    let r = c.get(&format!("/v1/twins/{twin}/events")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let ids: Vec<&str> = r.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["gen-a-1", "gen-b-1"]);
    assert_eq!(
        c.twin(twin).await.body["state"],
        json!({ "rpm": 900, "door": { "open": false } })
    );
    let r = c.get("/v1/rejections").await;
    let stale: Vec<_> = r.body["rejections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["twin_id"] == twin && r["reason"] == "stale_token")
        .collect();
    assert_eq!(stale.len(), 1, "{:?}", r.body);
    s.terminate();
}
