//! The OpenAPI document at `/v1/openapi.json`, fetched from a served store:
//! it parses, it is OpenAPI 3, it describes every route the router serves
//! (and nothing it does not), and its references resolve. Also the router's
//! own answers (unknown path, wrong method, undecodable path) are JSON.
//! Conformance of the responses to the document is schemathesis' job
//! (`scripts/api-fuzz`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;

use palisade_http::HttpConfig;
use palisade_log::{Store, StoreConfig};
use serde_json::Value;
use tokio::net::TcpListener;

/// Every route of `palisade_http::router`: method, path template, and a
/// concrete request that reaches the handler without side effects.
const ROUTES: &[(&str, &str, &str)] = &[
    ("get", "/", "/"),
    ("get", "/healthz", "/healthz"),
    ("get", "/metrics", "/metrics"),
    ("get", "/v1/openapi.json", "/v1/openapi.json"),
    ("post", "/v1/leases", "/v1/leases"),
    ("get", "/v1/leases/advice", "/v1/leases/advice?scope=twin/t"),
    ("post", "/v1/leases/{lease_id}/renew", "/v1/leases/x/renew"),
    ("delete", "/v1/leases/{lease_id}", "/v1/leases/x"),
    ("get", "/v1/twins/{twin_id}", "/v1/twins/t"),
    ("post", "/v1/twins/{twin_id}/events", "/v1/twins/t/events"),
    ("get", "/v1/twins/{twin_id}/events", "/v1/twins/t/events"),
    // The watches stream forever; a bad query makes them answer at once.
    (
        "get",
        "/v1/twins/{twin_id}/watch",
        "/v1/twins/t/watch?after=x",
    ),
    ("get", "/v1/partitions", "/v1/partitions"),
    (
        "get",
        "/v1/partitions/{partition}/events",
        "/v1/partitions/0/events",
    ),
    (
        "get",
        "/v1/partitions/{partition}/watch",
        "/v1/partitions/0/watch?after=x",
    ),
    ("get", "/v1/rejections", "/v1/rejections"),
    (
        "get",
        "/v1/twins/{twin_id}/refusals",
        "/v1/twins/t/refusals",
    ),
    (
        "get",
        "/v1/partitions/{partition}/refusals",
        "/v1/partitions/0/refusals",
    ),
    ("get", "/v1/dead-letters", "/v1/dead-letters"),
    ("get", "/v1/outbox", "/v1/outbox"),
    (
        "delete",
        "/v1/outbox/{partition}/{seq}/{index}",
        "/v1/outbox/0/1/0",
    ),
    ("get", "/v1/audit", "/v1/audit"),
    ("get", "/v1/cluster/audit", "/v1/cluster/audit"),
    ("post", "/v1/admin/backup", "/v1/admin/backup"),
];

struct Served {
    base: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn serve() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), StoreConfig::default()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(palisade_http::run(
        listener,
        store,
        HttpConfig::default(),
        std::future::pending(),
    ));
    Served {
        base,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

async fn document(s: &Served) -> Value {
    let r = s
        .http
        .get(format!("{}/v1/openapi.json", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    serde_json::from_slice(&r.bytes().await.unwrap()).expect("the document is JSON")
}

#[tokio::test]
async fn document_is_openapi_3_and_lists_every_route() {
    let s = serve().await;
    let doc = document(&s).await;
    let version = doc["openapi"]
        .as_str()
        .expect("an `openapi` version string");
    assert!(version.starts_with("3."), "openapi: {version}");
    assert!(doc["info"]["title"].is_string());
    let paths = doc["paths"].as_object().expect("paths");

    let want: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p, _)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    let documented: BTreeSet<(String, String)> = paths
        .iter()
        .flat_map(|(p, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .filter(|k| ["get", "post", "put", "patch", "delete"].contains(&k.as_str()))
                .map(move |m| (m.clone(), p.clone()))
        })
        .collect();
    let missing: Vec<_> = want.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "routes missing from the document: {missing:?}"
    );
    let extra: Vec<_> = documented.difference(&want).collect();
    assert!(extra.is_empty(), "documented but not served: {extra:?}");

    for (method, path, _) in ROUTES {
        let op = &paths[*path][*method];
        let responses = op["responses"].as_object().unwrap();
        assert!(!responses.is_empty(), "{method} {path}: no responses");
        // Every path parameter of the template is declared.
        for name in path.split('/').filter_map(|seg| seg.strip_prefix('{')) {
            let name = name.trim_end_matches('}');
            let declared = op["parameters"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["name"] == name && p["in"] == "path"));
            assert!(
                declared,
                "{method} {path}: path parameter {name} not declared"
            );
        }
        // Every error is described as JSON with a schema.
        for (status, resp) in responses {
            if status.starts_with('4') || status.starts_with('5') {
                assert!(
                    resp["content"]["application/json"]["schema"].is_object(),
                    "{method} {path} {status}: no JSON error schema"
                );
            }
        }
    }
    assert!(paths["/"]["get"]["responses"]["200"]["content"]["text/html"].is_object());
    assert!(paths["/metrics"]["get"]["responses"]["200"]["content"]["text/plain"].is_object());
    for watch in [
        "/v1/twins/{twin_id}/watch",
        "/v1/partitions/{partition}/watch",
    ] {
        assert!(
            paths[watch]["get"]["responses"]["200"]["content"]["text/event-stream"].is_object(),
            "{watch}"
        );
    }
    let append = &paths["/v1/twins/{twin_id}/events"]["post"];
    let headers: BTreeSet<&str> = append["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["in"] == "header")
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(headers, BTreeSet::from(["Fencing-Token", "If-Match"]));
    let body = &append["requestBody"]["content"]["application/json"]["schema"];
    assert_eq!(body["$ref"], "#/components/schemas/EventsIn");
    assert_eq!(
        doc["components"]["schemas"]["EventsIn"]["oneOf"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "the event body is one event or an array of them"
    );

    // Every `$ref` points at a schema that exists.
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("unexpected $ref {r}"));
        assert!(schemas.contains_key(name), "dangling $ref {r}");
    }
}

fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get("$ref") {
                out.push(r.clone());
            }
            m.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

/// The listed routes are the router's: each reaches a handler (neither the
/// `no_such_route` fallback nor a 405).
#[tokio::test]
async fn every_listed_route_is_served() {
    let s = serve().await;
    for (method, template, concrete) in ROUTES {
        let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let r = s
            .http
            .request(m, format!("{}{concrete}", s.base))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
        assert!(
            status != 405 && body["error"] != "no_such_route",
            "{method} {template} ({concrete}) is not served: {status} {body}"
        );
    }
}

/// What the router answers by itself is JSON with an `error` too.
#[tokio::test]
async fn router_answers_are_json() {
    let s = serve().await;
    let check = |status: u16, error: &'static str| {
        move |r: (u16, Option<String>, Value)| {
            assert_eq!(r.0, status, "{:?}", r.2);
            assert_eq!(r.1.as_deref(), Some("application/json"));
            assert_eq!(r.2["error"], error, "{:?}", r.2);
            assert!(r.2["message"].is_string());
        }
    };
    let get = |method: reqwest::Method, path: &'static str| {
        let req = s.http.request(method, format!("{}{path}", s.base));
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let ct = r
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_owned());
            let allow = r.headers().get("allow").cloned();
            let body = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
            ((status, ct, body), allow)
        }
    };
    let (r, _) = get(reqwest::Method::GET, "/nope").await;
    check(404, "no_such_route")(r);
    let (r, allow) = get(reqwest::Method::PUT, "/v1/leases").await;
    check(405, "method_not_allowed")(r);
    assert_eq!(allow.unwrap(), "POST");
    let (r, allow) = get(reqwest::Method::DELETE, "/v1/twins/t").await;
    check(405, "method_not_allowed")(r);
    assert_eq!(allow.unwrap(), "GET,HEAD");
    // A path segment that does not decode to UTF-8.
    let (r, _) = get(reqwest::Method::GET, "/v1/twins/%FF").await;
    check(400, "bad_twin_id")(r);
    let (r, _) = get(reqwest::Method::GET, "/v1/twins/%FF/events").await;
    check(400, "bad_twin_id")(r);
    let (r, _) = get(reqwest::Method::POST, "/v1/leases/%FF/renew").await;
    check(400, "bad_lease_id")(r);
    let (r, _) = get(reqwest::Method::GET, "/v1/partitions/%FF/events").await;
    check(400, "bad_partition")(r);
}
