//! Authentication in cluster mode (issue 16): three real `palisade serve
//! --cluster-node --security FILE --tls-cert --tls-key` processes with the
//! same principals and certificate, a real broker and a real etcd. Token and lease owners are recorded in etcd
//! with the grant, and each append travels through Kafka signed as its
//! principal, so:
//!
//! - the cluster-wide view of partitions through one node asks the others
//!   over HTTPS with the caller's key: every partition served, none
//!   unreachable;
//! - a token granted through node 0 writes through every node, with its
//!   principal's key (the client follows the `307` to the owner itself,
//!   keeping its key: reqwest drops `Authorization` on a cross-port
//!   redirect);
//! - the same token with another principal's key is `403 token_not_yours`
//!   on every node, and without a key `401`; neither is stored;
//! - the Rust SDK (`Client::with_api_key`) follows the redirect keeping its
//!   key;
//! - a lease granted through node 0 is renewed through node 2 by its
//!   principal, and is `403 lease_not_yours` for another;
//! - a record produced straight to Kafka is applied only if signed by the
//!   token's owner (`token_not_yours` dead letter otherwise);
//! - `/v1/cluster/audit` through one node reads every node's audit log
//!   (node 0's grant, the owner's refusals);
//! - a fresh node replaying the topic alone reaches the same state and
//!   version, so the owners it learns from etcd while replaying the grant
//!   records decide as the cluster did.

use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::{json, Value};

use crate::broker::{broker, PARTITIONS};
use crate::etcd::Etcd;
use crate::three_nodes::{Cluster, Node, STEP};

const ROLES: &str = r#"
[roles.part-worker]
grants = [
  { actions = ["lease", "write", "read"], scopes = ["twin/part-*"] },
]
[roles.ops]
grants = [
  { actions = ["admin", "read"], scopes = ["admin/*", "twin/*"] },
]
"#;

/// The principals of these tests: worker-a and worker-b (part workers),
/// ops (admin); their keys by name.
type Keys = std::collections::HashMap<String, String>;

fn security_file(dir: &std::path::Path) -> (std::path::PathBuf, Keys) {
    crate::support::security_file(
        dir,
        ROLES,
        &[
            ("worker-a", "part-worker"),
            ("worker-b", "part-worker"),
            ("ops", "ops"),
        ],
    )
}

/// The nodes' certificate (PEM): every node serves HTTPS with it.
static ROOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Redirects not followed (by hand, keeping the key); the nodes'
/// certificate trusted.
fn client_builder() -> reqwest::ClientBuilder {
    let mut b = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none());
    if let Some(pem) = ROOT.get() {
        b = b.add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap());
    }
    b
}

fn client() -> reqwest::Client {
    client_builder().build().unwrap()
}

/// One request through `base`, following up to three `307`s by hand with
/// the same method, headers (the key included) and body; a `503` (a
/// partition not served yet, a rebalance) or a node that does not answer
/// is retried until [`STEP`].
async fn call(
    method: &str,
    base: &str,
    path: &str,
    key: Option<&str>,
    token: Option<u64>,
    body: Option<&Value>,
) -> (u16, Value) {
    call_if_match(method, base, path, key, token, body, None).await
}

/// [`call`] with an `If-Match: "<version>"` header.
async fn call_if_match(
    method: &str,
    base: &str,
    path: &str,
    key: Option<&str>,
    token: Option<u64>,
    body: Option<&Value>,
    if_match: Option<u64>,
) -> (u16, Value) {
    let c = client();
    let started = Instant::now();
    loop {
        let mut url = format!("{base}{path}");
        let mut hops = 0;
        let (status, text) = loop {
            let mut req = c.request(method.parse().unwrap(), &url);
            if let Some(k) = key {
                req = req.bearer_auth(k);
            }
            if let Some(t) = token {
                req = req.header("fencing-token", t.to_string());
            }
            if let Some(v) = if_match {
                req = req.header("if-match", format!("\"{v}\""));
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            // A redirect to a node just stopped (its owner lease not yet
            // expired) cannot connect: like a 503, tried again.
            let Ok(r) = req.send().await else {
                break (503, String::new());
            };
            let status = r.status().as_u16();
            if status == 307 && hops < 3 {
                hops += 1;
                url = r.headers()["location"].to_str().unwrap().to_owned();
                continue;
            }
            break (status, r.text().await.unwrap_or_default());
        };
        if status != 503 || started.elapsed() > STEP {
            return (status, serde_json::from_str(&text).unwrap_or(Value::Null));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn lease(base: &str, key: &str, scope: &str) -> Value {
    let (status, body) = call(
        "POST",
        base,
        "/v1/leases",
        Some(key),
        None,
        Some(&json!({"scope": scope, "ttl_ms": 3_600_000})),
    )
    .await;
    assert_eq!(status, 201, "lease on {scope}: {body}");
    body
}

fn event(id: &str, n: u64) -> Value {
    json!({"type": "set", "event_id": id, "patch": {"n": n}})
}

/// Produce one event for `twin` straight to its partition, signed as
/// `principal` with `key`.
async fn produce_signed(topic: &str, twin: &str, token: u64, principal: &str, key: &str, id: &str) {
    let value = json!({"type": "set", "event_id": id, "patch": {"kafka": id}}).to_string();
    let token_text = token.to_string();
    let json = "application/json";
    let signature = palisade_kafka::sign::sign(
        &palisade_kafka::sign::signing_key(key),
        principal,
        &palisade_kafka::sign::Signed {
            twin: twin.as_bytes(),
            token: token_text.as_bytes(),
            content_type: json.as_bytes(),
            value: value.as_bytes(),
            ..Default::default()
        },
    );
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "fencing-token",
            value: Some(token_text.as_str()),
        })
        .insert(Header {
            key: "content-type",
            value: Some(json),
        })
        .insert(Header {
            key: palisade_kafka::sign::PRINCIPAL_HEADER,
            value: Some(principal),
        })
        .insert(Header {
            key: palisade_kafka::sign::SIGNATURE_HEADER,
            value: Some(signature.as_str()),
        });
    let partition = i32::try_from(
        palisade::core::partition_for(&palisade::core::TwinId::new(twin).unwrap(), PARTITIONS).0,
    )
    .unwrap();
    broker()
        .raw_producer()
        .send(
            FutureRecord::to(topic)
                .partition(partition)
                .key(twin)
                .payload(&value)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
}

/// The twin's event ids through `base` (as ops), once `want` of them are there.
async fn event_ids(base: &str, ops: &str, twin: &str, want: usize) -> Vec<String> {
    let started = Instant::now();
    loop {
        let (status, body) = call(
            "GET",
            base,
            &format!("/v1/twins/{twin}/events?limit=1000"),
            Some(ops),
            None,
            None,
        )
        .await;
        let ids: Vec<String> = if status == 200 {
            body["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["event_id"].as_str().unwrap().to_owned())
                .collect()
        } else {
            Vec::new()
        };
        if ids.len() >= want || started.elapsed() > STEP {
            return ids;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn principals_tokens_and_leases_are_checked_alike_on_every_node() {
    let Some(etcd) =
        Etcd::start("principals_tokens_and_leases_are_checked_alike_on_every_node").await
    else {
        return;
    };
    let cluster = Cluster::on(&etcd, "clusterauth");
    let topic = cluster.topic.clone();
    let dir = tempfile::tempdir().unwrap();
    let (security, keys) = security_file(dir.path());
    let cert = crate::support::mint_cert(dir.path());
    ROOT.set(cert.cert_pem.clone()).unwrap();
    let sec = [
        "--security",
        security.to_str().unwrap(),
        "--tls-cert",
        cert.cert.to_str().unwrap(),
        "--tls-key",
        cert.key.to_str().unwrap(),
    ];
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| cluster.start_with(&format!("n{i}"), dir.path(), &sec))
        .collect();
    assert!(nodes.iter().all(|n| n.base.starts_with("https://")));

    // A node whose security file differs from the running nodes' refuses
    // to start, naming the node it differs from.
    let other_dir = dir.path().join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let (other_security, _) = security_file(&other_dir);
    let mut other = sec.to_vec();
    other[1] = other_security.to_str().unwrap();
    match cluster.try_start_with("n-other", dir.path(), &other) {
        Ok(_) => panic!("a node with another security file started"),
        Err(log) => assert!(
            log.contains("needs the same --security file") && log.contains("node n"),
            "{log}"
        ),
    }
    // Told it is a rolling change of the file, it starts (and warns). Its
    // clean stop takes its member record out of etcd at once.
    other.push("--cluster-security-change");
    let mut changing = cluster.start_with("n-other", dir.path(), &other);
    changing.terminate();

    // The cluster-wide view, through any node, asks the others with the
    // caller's key over HTTPS: every partition served, none unreachable.
    let started = Instant::now();
    loop {
        let (status, body) = call(
            "GET",
            &nodes[0].base,
            "/v1/partitions",
            Some(&keys["ops"]),
            None,
            None,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let states: Vec<&str> = body["partitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["cluster"]["status"].as_str().unwrap_or("?"))
            .collect();
        if states.iter().all(|s| *s == "serving") {
            break;
        }
        assert!(
            started.elapsed() < STEP && !states.contains(&"unreachable"),
            "partitions through n0: {body}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // worker-a's lease on part-1, granted through node 0.
    let la = lease(&nodes[0].base, &keys["worker-a"], "twin/part-1").await;
    let (token_a, lease_a) = (
        la["token"].as_u64().unwrap(),
        la["lease_id"].as_str().unwrap().to_owned(),
    );

    // Its token writes through every node, with its key.
    let mut version = 0;
    for (i, n) in nodes.iter().enumerate() {
        let id = format!("a-http-{i}");
        let (status, body) = call(
            "POST",
            &n.base,
            "/v1/twins/part-1/events",
            Some(&keys["worker-a"]),
            Some(token_a),
            Some(&event(&id, i as u64)),
        )
        .await;
        assert_eq!(status, 201, "worker-a through {}: {body}", n.id);
        version = body["version"].as_u64().unwrap();
    }
    // If-Match travels signed (palisade-if-match is in the signature): the
    // applying node verifies it, and decides on the version.
    let (status, body) = call_if_match(
        "POST",
        &nodes[2].base,
        "/v1/twins/part-1/events",
        Some(&keys["worker-a"]),
        Some(token_a),
        Some(&event("a-if-match", 7)),
        Some(version),
    )
    .await;
    assert_eq!(status, 201, "If-Match with the current version: {body}");
    let (status, body) = call_if_match(
        "POST",
        &nodes[1].base,
        "/v1/twins/part-1/events",
        Some(&keys["worker-a"]),
        Some(token_a),
        Some(&event("a-if-match-stale", 8)),
        Some(version),
    )
    .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (412, Some("version_mismatch")),
        "{body}"
    );
    // Another principal's key with it, or no key: refused on every node.
    for n in &nodes {
        let (status, body) = call(
            "POST",
            &n.base,
            "/v1/twins/part-1/events",
            Some(&keys["worker-b"]),
            Some(token_a),
            Some(&event("b-stolen", 99)),
        )
        .await;
        assert_eq!(
            (status, body["error"].as_str()),
            (403, Some("token_not_yours")),
            "worker-b with worker-a's token through {}: {body}",
            n.id
        );
        let (status, body) = call(
            "POST",
            &n.base,
            "/v1/twins/part-1/events",
            None,
            Some(token_a),
            Some(&event("anon", 98)),
        )
        .await;
        assert_eq!(status, 401, "no key through {}: {body}", n.id);
    }

    // The SDK follows the redirect itself, keeping its key (reqwest's own
    // redirects would drop it: 401 at the owner).
    let sdk = palisade_client::Client::with_http_client(&nodes[2].base, client())
        .unwrap()
        .with_api_key(&keys["worker-a"])
        .unwrap();
    let started = Instant::now();
    let done = loop {
        let ev = palisade_client::Event::new("set", json!({"n": 7})).with_id("a-sdk");
        match sdk.append("part-1", token_a, &[ev]).await {
            Err(e) if e.status() == Some(503) && started.elapsed() < STEP => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            other => break other,
        }
    };
    assert!(
        done.is_ok(),
        "the SDK through n2 with worker-a's key: {done:?}"
    );
    let nokey = palisade_client::Client::with_http_client(&nodes[2].base, client()).unwrap();
    let refused = nokey
        .append(
            "part-1",
            token_a,
            &[palisade_client::Event::new("set", json!({}))],
        )
        .await;
    assert_eq!(refused.err().and_then(|e| e.status()), Some(401));

    // The lease granted through node 0 is renewed through node 2 by its
    // principal, and is not worker-b's to renew or release anywhere.
    let renew = format!("/v1/leases/{lease_a}/renew");
    let (status, body) = call(
        "POST",
        &nodes[2].base,
        &renew,
        Some(&keys["worker-a"]),
        None,
        None,
    )
    .await;
    assert_eq!(status, 200, "worker-a renews through n2: {body}");
    for n in &nodes {
        let (status, body) =
            call("POST", &n.base, &renew, Some(&keys["worker-b"]), None, None).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (403, Some("lease_not_yours")),
            "worker-b renews worker-a's lease through {}: {body}",
            n.id
        );
    }

    // worker-b's own lease, through node 1, writes through node 2.
    let lb = lease(&nodes[1].base, &keys["worker-b"], "twin/part-2").await;
    let token_b = lb["token"].as_u64().unwrap();
    let (status, body) = call(
        "POST",
        &nodes[2].base,
        "/v1/twins/part-2/events",
        Some(&keys["worker-b"]),
        Some(token_b),
        Some(&event("b-own", 1)),
    )
    .await;
    assert_eq!(status, 201, "worker-b's own token: {body}");

    // Straight to Kafka: only the token's owner's signature is applied.
    produce_signed(
        &topic,
        "part-1",
        token_a,
        "worker-b",
        &keys["worker-b"],
        "k-b-stolen",
    )
    .await;
    produce_signed(
        &topic,
        "part-1",
        token_a,
        "worker-a",
        &keys["worker-a"],
        "k-a-own",
    )
    .await;
    let ids = event_ids(&nodes[0].base, &keys["ops"], "part-1", 6).await;
    assert_eq!(
        ids,
        [
            "a-http-0",
            "a-http-1",
            "a-http-2",
            "a-if-match",
            "a-sdk",
            "k-a-own"
        ],
        "part-1's history"
    );
    let seen = states(&nodes[1].base, &keys["ops"]).await;

    // A member that owns no partition: n3 joins the cluster's etcd
    // registry but consumes as another group, so every owner lease it
    // wants is held by n0..n2.
    let mut idle = Cluster {
        group: format!("{topic}-idle"),
        ..cluster.clone()
    }
    .start_with("n3", dir.path(), &sec);

    // Every node's audit log through one node, with the caller's key: the
    // grant audited by node 0 and the stolen-token refusals audited by
    // part-1's owner are both there, and n3, which owns nothing, answers too.
    let (status, _) = call("GET", &nodes[2].base, "/v1/cluster/audit", None, None, None).await;
    assert_eq!(status, 401);
    let (status, body) = call(
        "GET",
        &nodes[2].base,
        "/v1/cluster/audit?limit=1000",
        Some(&keys["ops"]),
        None,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let sections = body["nodes"].as_array().unwrap();
    let mut names: Vec<&str> = sections
        .iter()
        .map(|n| n["node"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["n0", "n1", "n2", "n3"], "{body}");
    assert!(sections.iter().all(|n| n["status"] == "ok"), "{body}");
    idle.kill();
    let has = |node: &str, f: &dyn Fn(&Value) -> bool| {
        sections
            .iter()
            .filter(|n| node.is_empty() || n["node"] == node)
            .flat_map(|n| n["records"].as_array().unwrap())
            .any(f)
    };
    assert!(
        has("n0", &|r| r["action"] == "grant"
            && r["principal"] == "worker-a"
            && r["scope"] == "twin/part-1"),
        "worker-a's grant through n0: {body}"
    );
    assert!(
        has("", &|r| r["action"] == "write"
            && r["principal"] == "worker-b"
            && r["detail"] == "token_not_yours"),
        "worker-b's refused writes: {body}"
    );

    // A fresh node replaying the topic alone decides the same.
    for n in &mut nodes {
        n.terminate();
    }
    let solo = Cluster {
        group: format!("{topic}-solo"),
        ..cluster
    }
    .start_with("solo", dir.path(), &sec);
    let ids = event_ids(&solo.base, &keys["ops"], "part-1", 6).await;
    assert_eq!(
        ids,
        [
            "a-http-0",
            "a-http-1",
            "a-http-2",
            "a-if-match",
            "a-sdk",
            "k-a-own"
        ]
    );
    assert_eq!(
        states(&solo.base, &keys["ops"]).await,
        seen,
        "a node replaying the log disagrees on state and version"
    );
}

/// (state, version) of part-1 and part-2 through `base`, as ops.
async fn states(base: &str, ops: &str) -> Vec<(Value, Value)> {
    let mut out = Vec::new();
    for t in ["part-1", "part-2"] {
        let (status, body) = call(
            "GET",
            base,
            &format!("/v1/twins/{t}"),
            Some(ops),
            None,
            None,
        )
        .await;
        assert_eq!(status, 200, "{t}: {body}");
        out.push((body["state"].clone(), body["version"].clone()));
    }
    out
}
