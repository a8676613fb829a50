//! `palisade serve` as a real process: without authentication it serves
//! loopback only and says so; a non-loopback address without
//! authentication (or with it but without TLS) is refused before anything
//! is created; with principals and TLS it serves HTTPS and checks keys.
//! Never serves on a non-loopback address: the 0.0.0.0 cases only check
//! the refusal (port 0).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use crate::support::ServeProcess;
use crate::{fresh_keys, https_client, mint_cert, security_toml};

fn palisade() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_palisade"));
    c.env("RUST_LOG", "warn")
        .env_remove("PALISADE_SECURITY")
        .env_remove("PALISADE_INSECURE")
        .env_remove("PALISADE_LISTEN");
    c
}

/// Run `palisade serve ARGS` expecting it to refuse: its stderr.
fn refused(args: &[&str]) -> String {
    let out = palisade()
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "palisade serve {args:?} started; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        out.stdout.is_empty(),
        "it printed an address: {:?}",
        out.stdout
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_non_loopback_bind_without_auth_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let d = data.to_str().unwrap();
    let err = refused(&["--data", d, "--listen", "0.0.0.0:0"]);
    assert!(err.contains("refusing to listen on 0.0.0.0:0"), "{err}");
    assert!(
        err.contains("authentication is off") && err.contains("--insecure"),
        "{err}"
    );
    assert!(!data.exists(), "the refused start created the data folder");

    // IPv6 unspecified too.
    let err = refused(&["--data", d, "--listen", "[::]:0"]);
    assert!(err.contains("refusing to listen"), "{err}");

    // With principals but no TLS: keys would travel in clear text.
    let keys = fresh_keys();
    let sec = dir.path().join("security.toml");
    std::fs::write(&sec, security_toml(&keys, "")).unwrap();
    let err = refused(&[
        "--data",
        d,
        "--listen",
        "0.0.0.0:0",
        "--security",
        sec.to_str().unwrap(),
    ]);
    assert!(err.contains("without TLS"), "{err}");
    assert!(!data.exists());

    // Half a TLS configuration, and a broken security file, are named.
    let cert = mint_cert(dir.path());
    let err = refused(&["--data", d, "--tls-cert", cert.cert.to_str().unwrap()]);
    assert!(
        err.contains("--tls-cert and --tls-key go together"),
        "{err}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[principals]]\nname = \"a\"\nkey_sha256 = \"00\"\nroles = []\n",
    )
    .unwrap();
    let err = refused(&["--data", d, "--security", bad.to_str().unwrap()]);
    assert!(err.contains("64 hex characters"), "{err}");
    std::fs::write(&bad, "[limits]\nmax_patch_dept = 3\n").unwrap();
    let err = refused(&["--data", d, "--security", bad.to_str().unwrap()]);
    assert!(err.contains("max_patch_dept"), "{err}");
    // `palisade config check` finds the same problem without starting.
    let cfg = dir.path().join("palisade.toml");
    std::fs::write(&cfg, format!("security = {:?}\n", bad.to_str().unwrap())).unwrap();
    let out = palisade()
        .args(["config", "check", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("max_patch_dept"), "{said}");
    assert!(!data.exists());
}

#[test]
fn without_auth_it_serves_loopback_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = palisade()
        .arg("serve")
        .args(["--data", dir.path().join("data").to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("palisade listening on http://127.0.0.1:"),
        "{line:?}"
    );
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    err.read_line(&mut said).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        said.contains("authentication is off; listening on loopback only"),
        "{said:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_principals_and_tls_a_real_process_serves_https_and_checks_keys() {
    let dir = tempfile::tempdir().unwrap();
    let keys = fresh_keys();
    let sec = dir.path().join("security.toml");
    std::fs::write(&sec, security_toml(&keys, "")).unwrap();
    let cert = mint_cert(dir.path());
    let server = ServeProcess::start(
        &dir.path().join("data"),
        &[
            "--security",
            sec.to_str().unwrap(),
            "--tls-cert",
            cert.cert.to_str().unwrap(),
            "--tls-key",
            cert.key.to_str().unwrap(),
        ],
    );
    assert!(
        server.base.starts_with("https://127.0.0.1:"),
        "{}",
        server.base
    );
    let http = https_client(&cert.cert_pem);
    let body = json!({"scope": "twin/device-1", "holder": "x", "ttl_ms": 10_000});
    let r = http
        .post(format!("{}/v1/leases", server.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{}/v1/leases", server.base))
        .bearer_auth(&keys["worker-a"])
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["holder"], "worker-a");
    // The CLI, with --api-key and --ca-cert: the holder is the principal.
    let cli = |key: Option<&str>, scope: &str| {
        let mut c = palisade();
        c.args(["lease", "acquire", "--json", "--holder", "someone-else"])
            .args(["--scope", scope, "--url", &server.base])
            .args(["--ca-cert", cert.cert.to_str().unwrap()])
            .env_remove("PALISADE_API_KEY");
        if let Some(k) = key {
            c.args(["--api-key", k]);
        }
        c.output().unwrap()
    };
    let out = cli(Some(&keys["worker-b"]), "twin/device-2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["holder"], "worker-b", "{v}");
    let out = cli(None, "twin/device-3");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("unauthenticated"));
    // Plain HTTP to the HTTPS port gets no API.
    let plain = reqwest::Client::new()
        .get(format!(
            "{}/healthz",
            server.base.replace("https://", "http://")
        ))
        .send()
        .await;
    assert!(plain.map_or(true, |r| !r.status().is_success()));
    server.terminate();
}

#[test]
fn mint_key_prints_a_key_and_its_hash() {
    let out = palisade()
        .args(["auth", "mint-key", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let key = v["key"].as_str().unwrap();
    assert_eq!(v["key_sha256"], palisade::http::auth::hash_key(key));
    // And `hash-key` agrees.
    let mut child = palisade()
        .args(["auth", "hash-key"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    writeln!(child.stdin.take().unwrap(), "{key}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), v["key_sha256"]);
}
