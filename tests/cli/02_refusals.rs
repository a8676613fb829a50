//! Refusals (exit 1, the store's error name and message), usage errors
//! (exit 2) and an unreachable store (exit 3).

use crate::support::ServeProcess;
use crate::{acquire, append, run};

#[test]
fn a_stale_token_is_refused_with_exit_1_and_the_error_name() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (lease_a, token_a) = acquire(url, "twin/valve-1", "writer-a");
    append(url, "valve-1", token_a, "a1", r#"{"open":true}"#);
    // A is paused; its lease ends and B takes the twin.
    run(url, &["lease", "release", &lease_a]).ok();
    let (_, token_b) = acquire(url, "twin/valve-1", "writer-b");
    assert!(token_b > token_a);
    append(url, "valve-1", token_b, "b1", r#"{"open":false}"#);

    // A wakes up and writes with its old token: refused, in JSON...
    let args = [
        "append",
        "--twin",
        "valve-1",
        "--token",
        &token_a.to_string(),
        "--patch",
        r#"{"open":true}"#,
    ];
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let r = run(url, &json_args);
    assert_eq!(r.code, 1, "{r:?}");
    let e = r.json();
    assert_eq!(e["error"], "stale_token");
    assert_eq!(e["status"], 409);
    assert_eq!(e["token"].as_u64(), Some(token_a));
    assert_eq!(e["fence"].as_u64(), Some(token_b));
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    // ...and for people, on stderr.
    let r = run(url, &args);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stdout.is_empty(), "{r:?}");
    assert!(
        r.stderr.contains("stale_token") && r.stderr.contains("HTTP 409"),
        "{r:?}"
    );
    // Nothing changed.
    let twin = run(url, &["get", "--twin", "valve-1", "--json"])
        .ok()
        .json();
    assert_eq!(twin["state"]["open"], false);
    assert_eq!(twin["version"], 2);

    // Issue 14: both refusals are in the journal, newest first, with the
    // token, the fence it hit and the holder; `--partition` lists them too.
    let lines = run(url, &["refusals", "--twin", "valve-1", "--json"])
        .ok()
        .json_lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        assert_eq!(l["reason"], "stale_token");
        assert_eq!(l["token"].as_u64(), Some(token_a));
        assert_eq!(l["fence"].as_u64(), Some(token_b));
        assert_eq!(l["holder"], "writer-a");
    }
    assert!(lines[0]["seq"].as_u64() > lines[1]["seq"].as_u64());
    let p = lines[0]["partition"].as_u64().unwrap().to_string();
    let r = run(url, &["refusals", "--partition", &p]).ok();
    assert!(
        r.stdout.contains("stale_token") && r.stdout.contains("writer-a"),
        "{r:?}"
    );
    let r = run(url, &["refusals", "--twin", "no-such-twin"]).ok();
    assert!(
        r.stdout.contains("no refused writes of twin no-such-twin"),
        "{r:?}"
    );
    // One of --twin and --partition, not both, not neither: usage errors.
    assert_eq!(run(url, &["refusals"]).code, 2);
    assert_eq!(
        run(url, &["refusals", "--twin", "a", "--partition", "1"]).code,
        2
    );
    server.terminate();
}

#[test]
fn other_refusals_carry_the_store_error_name() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (_, token) = acquire(url, "twin/r-1", "holder-a");
    append(url, "r-1", token, "x1", r#"{"x":1}"#);
    let cases: [(&[&str], &str); 5] = [
        (
            &[
                "lease", "acquire", "--scope", "twin/r-1", "--holder", "holder-b",
            ],
            "lease_held",
        ),
        (
            &[
                "append",
                "--twin",
                "r-1",
                "--token",
                &token.to_string(),
                "--patch",
                "{}",
                "--if-match",
                "7",
            ],
            "version_mismatch",
        ),
        (&["get", "--twin", "nobody"], "twin_not_found"),
        (
            &["lease", "acquire", "--scope", "shelf/1", "--holder", "h"],
            "bad_scope",
        ),
        (&["tail", "--partition", "99"], "unknown_partition"),
    ];
    for (args, error) in cases {
        let mut with_json = args.to_vec();
        with_json.push("--json");
        let r = run(url, &with_json);
        assert_eq!(r.code, 1, "{args:?}: {r:?}");
        assert_eq!(r.json()["error"], error, "{args:?}: {r:?}");
        let r = run(url, args);
        assert_eq!(r.code, 1, "{args:?}: {r:?}");
        assert!(r.stderr.contains(error), "{args:?}: {r:?}");
    }
    // If-Match with the right version is accepted.
    let ok = run(
        url,
        &[
            "append",
            "--twin",
            "r-1",
            "--token",
            &token.to_string(),
            "--patch",
            r#"{"x":2}"#,
            "--if-match",
            "1",
            "--json",
        ],
    )
    .ok()
    .json();
    assert_eq!(ok["version"], 2);
    server.terminate();
}

#[test]
fn usage_errors_exit_2_before_sending_anything() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (_, token) = acquire(url, "twin/u-1", "u");
    let t = token.to_string();
    let cases: [&[&str]; 9] = [
        &[
            "append", "--twin", "u-1", "--token", &t, "--patch", "not json",
        ],
        &["append", "--twin", "u-1", "--token", &t, "--patch", "[1,2]"],
        &["append", "--twin", "u-1", "--patch", "{}"], // no token (clap)
        &[
            "append",
            "--twin",
            "u-1",
            "--token",
            "minus-one",
            "--patch",
            "{}",
        ],
        &[
            "append",
            "--twin",
            "u-1",
            "--token",
            &t,
            "--file",
            "/nonexistent/events.json",
        ],
        &["get", "--twin", "u-1", "--at-seq", "1", "--at-hlc", "1/a"],
        &["tail", "--twin", "u-1", "--partition", "1"],
        &["tail"],
        &["events", "--twin", "u-1", "--limit", "0"],
    ];
    for args in cases {
        let r = run(url, args);
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(!r.stderr.is_empty(), "{args:?}: {r:?}");
    }
    // A misspelt field in a --file body is named, not silently dropped.
    let r = crate::run_with(
        &mut crate::palisade(),
        &[
            "append", "--twin", "u-1", "--token", &t, "--file", "-", "--url", url,
        ],
        Some(r#"{"type":"t","patch":{},"eventid":"x"}"#),
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("eventid"), "{r:?}");
    // None of it reached the store.
    let r = run(url, &["get", "--twin", "u-1", "--json"]);
    assert_eq!(r.json()["error"], "twin_not_found", "{r:?}");
    server.terminate();
}

#[test]
fn an_unreachable_store_exits_3() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    for args in [
        &["partitions", "--json"][..],
        &["get", "--twin", "x", "--json"],
        &[
            "append", "--twin", "x", "--token", "1", "--patch", "{}", "--json",
        ],
        &["tail", "--twin", "x", "--json"],
    ] {
        let r = run(&url, args);
        assert_eq!(r.code, 3, "{args:?}: {r:?}");
        assert_eq!(r.json()["error"], "unreachable", "{args:?}: {r:?}");
    }
    let r = run(&url, &["partitions"]);
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains("cannot reach the store"), "{r:?}");
}
