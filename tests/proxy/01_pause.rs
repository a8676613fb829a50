//! The article's pause scenario through the proxy: a worker process takes
//! a lease, is paused (SIGSTOP) past it, a successor takes the lease and
//! writes through the proxy, the worker resumes (SIGCONT) and sends its
//! request. The upstream must never see the stale request and the worker
//! must get `409 stale_token`. Embedded store and remote store alike.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};

use serde_json::json;

use super::support::{token_of, Client, ServeProcess};
use super::{acquire_when_free, put, ProxyProcess, Upstream};

/// A worker: takes a 300 ms lease on twin/part-1 from the store, prints
/// its token, waits for a line on stdin, then PUTs through the proxy and
/// prints the answer and its status.
const WORKER: &str = r#"
set -e
lease=$(curl -sf -XPOST "$STORE/v1/leases" -H 'content-type: application/json' \
  -d '{"scope":"twin/part-1","holder":"worker-a","ttl_ms":300}')
token=$(printf '%s' "$lease" | sed -E 's/.*"token":([0-9]+).*/\1/')
echo "TOKEN $token"
read go
curl -s -w '\nSTATUS %{http_code}\n' -XPUT "$PROXY/api/parts/part-1" \
  -H "Fencing-Token: $token" -H 'X-Request-Id: worker-a-1' \
  -H 'content-type: application/json' -d "{\"rev\":\"A\",\"token\":$token}"
"#;

fn kill(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

async fn pause_scenario(proxy: &ProxyProcess, store: &Client, upstream: &Upstream) {
    let mut worker = Command::new("sh")
        .args(["-c", WORKER])
        .env("STORE", &store.base)
        .env("PROXY", &proxy.url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the worker (sh, curl)");
    let mut out = BufReader::new(worker.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let stale: u64 = line
        .trim()
        .strip_prefix("TOKEN ")
        .unwrap_or_else(|| panic!("worker said {line:?}"))
        .parse()
        .unwrap();

    // The worker holds the lease and is about to write: pause it there.
    kill("STOP", worker.id());
    // Its "go" waits in the pipe; it reads it only once resumed.
    worker.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();

    // The lease expires while the worker is stopped; a successor takes it
    // and writes through the proxy.
    let lease = acquire_when_free(store, "part-1", "worker-b", 10_000).await;
    let fresh = token_of(&lease);
    assert!(fresh > stale);
    let r = put(
        &proxy.url,
        "part-1",
        "",
        Some(&fresh.to_string()),
        Some("worker-b-1"),
        &json!({"rev": "B", "token": fresh}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);

    // The worker wakes up and sends its request under the old token.
    kill("CONT", worker.id());
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(worker.wait().unwrap().success());
    assert!(
        rest.contains("STATUS 409"),
        "the stale worker must get 409, got {rest:?}"
    );
    let body: serde_json::Value = serde_json::from_str(rest.lines().next().unwrap()).unwrap();
    assert_eq!(body["error"], "stale_token", "{body}");
    assert_eq!(body["token"], stale);
    assert_eq!(body["fence"], fresh);

    // The upstream saw the successor's request only, without its token and
    // with the derived idempotency key.
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "upstream saw {seen:?}");
    assert_eq!(seen[0].body["rev"], "B");
    assert_eq!(seen[0].method, "PUT");
    assert!(seen[0].headers.get("fencing-token").is_none());
    let key = seen[0].headers["idempotency-key"].to_str().unwrap();
    assert!(key.starts_with("pxy-"), "{key}");
    assert_eq!(r.headers["idempotency-key"].to_str().unwrap(), key);

    // The admission is in the twin's history, by the successor, under its
    // token; the stale attempt is in the refusal journal.
    let events = store.get("/v1/twins/part-1/events").await;
    let list = events.body["events"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{:?}", events.body);
    assert_eq!(list[0]["type"], "palisade.proxy.admitted");
    assert_eq!(list[0]["event_id"], key);
    assert_eq!(list[0]["token"], fresh);
    let record = &list[0]["patch"]["palisade_proxy"];
    assert_eq!(record["method"], "PUT", "{record}");
    assert_eq!(record["path"], "/api/parts/part-1");
    assert_eq!(record["request_id"], "worker-b-1");
    assert_eq!(record["idempotency_key"], key);
    assert_eq!(record["body_sha256"].as_str().map(str::len), Some(64));
    let refusals = store.get("/v1/twins/part-1/refusals").await;
    let refused = refusals.body["refusals"].as_array().unwrap();
    assert!(
        refused.iter().any(|r| r["token"] == stale),
        "{:?}",
        refusals.body
    );
    assert_eq!(
        super::metric(
            &proxy.url,
            "palisade_proxy_refused_total{reason=\"stale_token\"}"
        )
        .await,
        1
    );
    assert_eq!(
        super::metric(&proxy.url, "palisade_proxy_admitted_total").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_worker_never_reaches_the_upstream_embedded() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::embedded(dir.path(), &upstream.url, &[]);
    let store = proxy.store();
    pause_scenario(&proxy, &store, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_worker_never_reaches_the_upstream_remote() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let serve = ServeProcess::start(dir.path(), &[]);
    let proxy = ProxyProcess::remote(&serve.base, &upstream.url, &[]);
    pause_scenario(&proxy, &serve.client(), &upstream).await;
}
