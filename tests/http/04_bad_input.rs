//! Bad input gets a clear error and changes nothing (invariant 8): one table of
//! malformed requests against a store that holds a known twin; after each
//! case the store must be unchanged and still serving.

use std::time::Duration;

use palisade::http::HttpConfig;
use palisade::log::StoreConfig;
use reqwest::RequestBuilder;
use serde_json::{json, Value};

use crate::support::{token_of, Client, TestServer};
use crate::{hlc_string, ntp64_in, send};

const TWIN: &str = "known-1";
const MAX_BODY: usize = 64 * 1024;

type Build = Box<dyn Fn(&Client) -> RequestBuilder>;

struct Case {
    name: &'static str,
    build: Build,
    status: u16,
    /// The `error` field; `None` for a success.
    error: Option<&'static str>,
}

fn case(name: &'static str, status: u16, error: &'static str, build: Build) -> Case {
    Case {
        name,
        build,
        status,
        error: Some(error),
    }
}

/// POST raw bytes to a twin's events with an optional Fencing-Token.
fn post_events(c: &Client, twin: &str, token: Option<String>, body: Vec<u8>) -> RequestBuilder {
    let mut req = c
        .http
        .post(format!("{}/v1/twins/{twin}/events", c.base))
        .header("content-type", "application/json")
        .body(body);
    if let Some(t) = token {
        req = req.header("fencing-token", t);
    }
    req
}

/// A case posting `body` to the known twin with the valid token.
fn events_case(
    name: &'static str,
    status: u16,
    error: &'static str,
    token: u64,
    body: impl Into<Vec<u8>>,
) -> Case {
    let body = body.into();
    case(
        name,
        status,
        error,
        Box::new(move |c| post_events(c, TWIN, Some(token.to_string()), body.clone())),
    )
}

fn token_case(name: &'static str, error: &'static str, token: Option<&'static str>) -> Case {
    case(
        name,
        400,
        error,
        Box::new(move |c| {
            post_events(
                c,
                TWIN,
                token.map(str::to_owned),
                br#"{"type":"u","patch":{"x":1}}"#.to_vec(),
            )
        }),
    )
}

fn get_case(name: &'static str, status: u16, error: &'static str, path: &'static str) -> Case {
    case(
        name,
        status,
        error,
        Box::new(move |c| c.http.get(format!("{}{path}", c.base))),
    )
}

fn lease_case(name: &'static str, error: &'static str, body: Value) -> Case {
    case(
        name,
        400,
        error,
        Box::new(move |c| c.http.post(format!("{}/v1/leases", c.base)).json(&body)),
    )
}

fn nested(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!({ "a": v });
    }
    v
}

fn ev(patch: Value) -> Value {
    json!({"type": "u", "patch": patch})
}

fn bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// Everything a client can see of the store.
async fn snapshot(c: &Client) -> (Value, Value, Value) {
    let twin = c.twin(TWIN).await;
    assert_eq!(twin.status, 200);
    let parts = c.get("/v1/partitions").await;
    assert_eq!(parts.status, 200);
    let events = c.get(&format!("/v1/twins/{TWIN}/events?limit=1000")).await;
    assert_eq!(events.status, 200);
    (twin.body, parts.body, events.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start_with(
        dir.path(),
        StoreConfig::default(),
        HttpConfig {
            max_body_bytes: MAX_BODY,
            ..Default::default()
        },
    )
    .await;
    let c = server.client();

    // The known twin, with a twin-scoped lease (so /v1/partitions shows no
    // owner and its body is stable over time).
    let t = token_of(&c.acquire(&format!("twin/{TWIN}"), "A", 600_000).await);
    assert_eq!(
        c.put(TWIN, t, "k-1", json!({"owner": "A", "n": 1}))
            .await
            .status,
        201
    );
    assert_eq!(c.put(TWIN, t, "k-2", json!({"n": 2})).await.status, 201);

    let good = json!({"type": "u", "patch": {"n": 99}, "event_id": "good-1"});
    let big = json!({"type": "u", "patch": {"blob": "x".repeat(100 * 1024)}});
    let too_many: Vec<Value> = (0..1001).map(|_| ev(json!({}))).collect();
    let future = hlc_string(ntp64_in(Duration::from_secs(60)), 0xabc);
    let long_twin = "t".repeat(10 * 1024);
    // The known twin's current version: a weak If-Match naming it must still
    // be refused (strong comparison), so the case cannot pass by mismatch.
    let version = c.twin(TWIN).await.body["version"].as_u64().unwrap();
    let weak = format!("W/\"{version}\"");
    let long_lease_id = "z".repeat(5000);
    let long_scope = format!("twin/{}\u{1}", "s".repeat(40 * 1024));

    let cases = vec![
        events_case(
            "malformed JSON",
            400,
            "bad_json",
            t,
            r#"{"type": "u", "patch": {"#,
        ),
        events_case("not JSON", 400, "bad_json", t, "hello"),
        events_case(
            "type is a number",
            400,
            "bad_json",
            t,
            r#"{"type": 5, "patch": {}}"#,
        ),
        events_case(
            "patch is a string",
            400,
            "bad_patch",
            t,
            r#"{"type": "u", "patch": "x"}"#,
        ),
        events_case(
            "patch is an array",
            400,
            "bad_patch",
            t,
            r#"{"type": "u", "patch": [1]}"#,
        ),
        events_case(
            "patch is null",
            400,
            "bad_patch",
            t,
            r#"{"type": "u", "patch": null}"#,
        ),
        events_case("patch missing", 400, "bad_json", t, r#"{"type": "u"}"#),
        events_case(
            "unknown field",
            400,
            "bad_json",
            t,
            r#"{"type": "u", "patch": {}, "colour": "red"}"#,
        ),
        events_case("body is a number", 400, "bad_json", t, "5"),
        events_case("empty body", 400, "bad_json", t, ""),
        events_case("empty batch", 400, "no_events", t, "[]"),
        events_case(
            "batch: good + patch not an object",
            400,
            "bad_patch",
            t,
            bytes(&json!([good, {"type": "u", "patch": "x"}])),
        ),
        events_case(
            "batch: good + bad event id",
            400,
            "bad_event",
            t,
            bytes(&json!([good, {"type": "u", "patch": {}, "event_id": "e".repeat(200)}])),
        ),
        events_case(
            "batch: good + too deep",
            400,
            "bad_patch",
            t,
            bytes(&json!([good, ev(nested(40))])),
        ),
        events_case(
            "batch: good + future hlc",
            422,
            "clock_drift",
            t,
            bytes(&json!([good, {"type": "u", "patch": {"n": 7}, "hlc": future}])),
        ),
        // Issue 18: the first of two headers used to win.
        case(
            "two Fencing-Token headers",
            400,
            "bad_token",
            Box::new(move |c| {
                post_events(c, TWIN, Some(t.to_string()), bytes(&ev(json!({"x": 1}))))
                    .header("fencing-token", "1")
            }),
        ),
        case(
            "two equal Fencing-Token headers",
            400,
            "bad_token",
            Box::new(move |c| {
                post_events(c, TWIN, Some(t.to_string()), bytes(&ev(json!({"x": 1}))))
                    .header("fencing-token", t.to_string())
            }),
        ),
        events_case(
            "type with NUL",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "a\u{0}b", "patch": {"x": 1}})),
        ),
        events_case(
            "type with an ANSI escape",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "\u{1b}[31mred", "patch": {"x": 1}})),
        ),
        events_case(
            "event_id with a newline",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "u", "patch": {"x": 1}, "event_id": "a\nb"})),
        ),
        events_case(
            "batch: good + event_id with DEL",
            400,
            "bad_event",
            t,
            bytes(&json!([good, {"type": "u", "patch": {}, "event_id": "x\u{7f}"}])),
        ),
        events_case("body is an array of numbers", 400, "bad_json", t, "[5]"),
        events_case("body is null", 400, "bad_json", t, "null"),
        token_case("missing Fencing-Token", "missing_token", None),
        token_case("token abc", "bad_token", Some("abc")),
        token_case("token -1", "bad_token", Some("-1")),
        token_case("token +1", "bad_token", Some("+1")),
        token_case("token empty", "bad_token", Some("")),
        token_case("token 2^64", "bad_token", Some("18446744073709551616")),
        token_case("token 1.5", "bad_token", Some("1.5")),
        events_case("body over the limit", 413, "body_too_large", t, bytes(&big)),
        events_case(
            "batch over the limit",
            413,
            "batch_too_large",
            t,
            bytes(&json!(too_many)),
        ),
        case(
            "twin id of 10 KB",
            400,
            "bad_twin_id",
            Box::new(move |c| {
                post_events(
                    c,
                    &long_twin,
                    Some(t.to_string()),
                    bytes(&ev(json!({"x": 1}))),
                )
            }),
        ),
        case(
            "twin id with a control char",
            400,
            "bad_twin_id",
            Box::new(move |c| {
                post_events(
                    c,
                    "bad%01twin",
                    Some(t.to_string()),
                    bytes(&ev(json!({"x": 1}))),
                )
            }),
        ),
        get_case(
            "GET twin id with a control char",
            400,
            "bad_twin_id",
            "/v1/twins/a%0Ab",
        ),
        events_case(
            "non-UTF-8 body",
            400,
            "bad_json",
            t,
            b"{\"type\": \"u\xff\xfe\", \"patch\": {}}".to_vec(),
        ),
        events_case(
            "raw binary body",
            400,
            "bad_json",
            t,
            vec![0xff, 0xfe, 0x00, 0x80],
        ),
        events_case(
            "bad hlc",
            400,
            "bad_hlc",
            t,
            bytes(&json!({"type": "u", "patch": {}, "hlc": "yesterday"})),
        ),
        events_case(
            "hlc with zero id",
            400,
            "bad_hlc",
            t,
            bytes(&json!({"type": "u", "patch": {}, "hlc": "1/0"})),
        ),
        events_case(
            "hlc 60 s ahead",
            422,
            "clock_drift",
            t,
            bytes(&json!({"type": "u", "patch": {"n": 3}, "hlc": future})),
        ),
        events_case(
            "patch 40 levels deep",
            400,
            "bad_patch",
            t,
            bytes(&ev(nested(40))),
        ),
        events_case(
            "event_id of 200 bytes",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "u", "patch": {}, "event_id": "e".repeat(200)})),
        ),
        events_case(
            "empty event_id",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "u", "patch": {}, "event_id": ""})),
        ),
        events_case(
            "empty type",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "", "patch": {}})),
        ),
        events_case(
            "type of 200 bytes",
            400,
            "bad_event",
            t,
            bytes(&json!({"type": "t".repeat(200), "patch": {}})),
        ),
        case(
            "If-Match abc",
            400,
            "bad_if_match",
            Box::new(move |c| {
                post_events(c, TWIN, Some(t.to_string()), bytes(&ev(json!({"x": 1}))))
                    .header("if-match", "abc")
            }),
        ),
        // RFC 9110 13.1.1: If-Match compares strongly; a weak tag never
        // matches, even one naming the current version.
        case(
            "If-Match weak tag of the current version",
            412,
            "weak_if_match",
            Box::new(move |c| {
                post_events(c, TWIN, Some(t.to_string()), bytes(&ev(json!({"x": 1}))))
                    .header("if-match", weak.as_str())
            }),
        ),
        case(
            "If-Match stale version",
            412,
            "version_mismatch",
            Box::new(move |c| {
                post_events(c, TWIN, Some(t.to_string()), bytes(&ev(json!({"x": 1}))))
                    .header("if-match", "\"0\"")
            }),
        ),
        events_case(
            "token never issued",
            403,
            "token_not_issued",
            t + 1000,
            bytes(&ev(json!({}))),
        ),
        Case {
            name: "duplicate event id",
            build: Box::new(move |c| {
                post_events(
                    c,
                    TWIN,
                    Some(t.to_string()),
                    bytes(&json!({"type": "u", "patch": {"n": 2}, "event_id": "k-2"})),
                )
            }),
            status: 201,
            error: None,
        },
        get_case(
            "unknown partition",
            404,
            "unknown_partition",
            "/v1/partitions/77/events",
        ),
        get_case(
            "partition not a number",
            400,
            "bad_partition",
            "/v1/partitions/x/events",
        ),
        get_case(
            "at_seq=abc",
            400,
            "bad_query",
            "/v1/twins/known-1?at_seq=abc",
        ),
        get_case(
            "at_seq and at_hlc",
            400,
            "bad_query",
            "/v1/twins/known-1?at_seq=1&at_hlc=1/1",
        ),
        get_case("at_hlc junk", 400, "bad_hlc", "/v1/twins/known-1?at_hlc=x"),
        get_case(
            "unknown query parameter",
            400,
            "bad_query",
            "/v1/twins/known-1?colour=red",
        ),
        get_case(
            "limit=-1",
            400,
            "bad_query",
            "/v1/twins/known-1/events?limit=-1",
        ),
        // Issue 18: `limit=0` returned one event.
        get_case(
            "twin events limit=0",
            400,
            "bad_query",
            "/v1/twins/known-1/events?limit=0",
        ),
        get_case(
            "partition events limit=0",
            400,
            "bad_query",
            "/v1/partitions/0/events?limit=0",
        ),
        get_case(
            "rejections limit=0",
            400,
            "bad_query",
            "/v1/rejections?limit=0",
        ),
        get_case(
            "dead letters limit=0",
            400,
            "bad_query",
            "/v1/dead-letters?limit=0",
        ),
        get_case(
            "after=abc",
            400,
            "bad_query",
            "/v1/partitions/0/events?after=abc",
        ),
        get_case("no such route", 404, "no_such_route", "/v1/nothing"),
        lease_case(
            "lease ttl_ms as string",
            "bad_json",
            json!({"scope": "twin/x", "holder": "A", "ttl_ms": "1000"}),
        ),
        lease_case("lease body is a number", "bad_json", json!(5)),
        lease_case("lease body is an array", "bad_json", json!([1, 2])),
        lease_case(
            "lease scope of 40 KB",
            "bad_scope",
            json!({"scope": long_scope, "holder": "A", "ttl_ms": 1000}),
        ),
        case(
            "renew a lease id of 5000 characters",
            400,
            "bad_lease_id",
            Box::new(move |c| {
                c.http
                    .post(format!("{}/v1/leases/{long_lease_id}/renew", c.base))
                    .json(&json!({}))
            }),
        ),
        lease_case(
            "lease partition/-1",
            "bad_scope",
            json!({"scope": "partition/-1", "holder": "A", "ttl_ms": 1000}),
        ),
        lease_case(
            "lease unknown field",
            "bad_json",
            json!({"scope": "twin/x", "holder": "A", "ttl_ms": 1000, "force": true}),
        ),
        lease_case(
            "lease missing holder",
            "bad_json",
            json!({"scope": "twin/x", "ttl_ms": 1000}),
        ),
        case(
            "lease held by another",
            409,
            "lease_held",
            Box::new(|c| {
                c.http
                    .post(format!("{}/v1/leases", c.base))
                    .json(&json!({"scope": format!("twin/{TWIN}"), "holder": "B", "ttl_ms": 1000}))
            }),
        ),
    ];

    let before = snapshot(&c).await;
    assert_eq!(before.0["state"], json!({"owner": "A", "n": 2}));
    for case in &cases {
        let r = send((case.build)(&c)).await;
        assert_eq!(r.status, case.status, "{}: {:?}", case.name, r.body);
        match case.error {
            Some(e) => {
                assert_eq!(r.body["error"], e, "{}: {:?}", case.name, r.body);
                let m = r.body["message"].as_str();
                assert!(m.is_some(), "{}: {:?}", case.name, r.body);
                // Issue 18: messages are for people: no Rust type names
                // (serde's "expected struct LeaseIn"), no echo of a huge
                // input.
                let m = m.unwrap_or_default();
                for internal in ["LeaseIn", "EventJson", "EventsJson", "struct "] {
                    assert!(!m.contains(internal), "{}: {m}", case.name);
                }
                assert!(m.len() < 300, "{}: a {}-byte message", case.name, m.len());
            }
            None => {
                assert_eq!(r.body["duplicates"], 1, "{}: {:?}", case.name, r.body);
            }
        }
        let after = snapshot(&c).await;
        assert_eq!(after, before, "{} changed the store", case.name);
        let h = c.get("/healthz").await;
        assert_eq!(h.status, 200, "not serving after {}", case.name);
    }

    // And the known twin's writer is not blocked: it writes on.
    let r = c.put(TWIN, t, "k-3", json!({"n": 3})).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(
        c.twin(TWIN).await.body["state"],
        json!({"owner": "A", "n": 3})
    );

    server.stop().await;
}
