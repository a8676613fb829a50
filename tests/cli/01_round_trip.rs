//! lease → append → get → events, in `--json` and for people; env vars as flags.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::ServeProcess;
use crate::{acquire, palisade, run, run_with, Running};

const WAIT: Duration = Duration::from_secs(15);

#[test]
fn lease_append_get_events_round_trip_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();

    let lease = run(
        url,
        &[
            "lease",
            "acquire",
            "--scope",
            "twin/pump-7",
            "--holder",
            "cli-a",
            "--ttl-ms",
            "60000",
            "--json",
        ],
    )
    .ok()
    .json();
    assert_eq!(lease["scope"], "twin/pump-7");
    assert_eq!(lease["holder"], "cli-a");
    assert_eq!(lease["ttl_ms"], 60000);
    let token = lease["token"].as_u64().unwrap();
    let lease_id = lease["lease_id"].as_str().unwrap().to_owned();
    assert_eq!(lease_id.len(), 32, "{lease}");

    // One event from flags.
    let first = run(
        url,
        &[
            "append",
            "--twin",
            "pump-7",
            "--token",
            &token.to_string(),
            "--type",
            "telemetry",
            "--patch",
            r#"{"rpm":1200,"door":{"open":false}}"#,
            "--event-id",
            "e1",
            "--json",
        ],
    )
    .ok()
    .json();
    assert_eq!(first["duplicates"], 0);
    assert_eq!(first["version"], 1);
    let seq1 = first["seqs"][0].as_u64().unwrap();

    // Two more from stdin, in the HTTP API's body shape.
    let body = r#"[{"type":"telemetry","patch":{"rpm":1300},"event_id":"e2"},
                   {"type":"door","patch":{"door":{"open":true}},"event_id":"e3"}]"#;
    let batch = run_with(
        &mut palisade(),
        &[
            "append",
            "--twin",
            "pump-7",
            "--token",
            &token.to_string(),
            "--file",
            "-",
            "--json",
            "--url",
            url,
        ],
        Some(body),
    )
    .ok()
    .json();
    assert_eq!(batch["seqs"].as_array().unwrap().len(), 2);
    assert_eq!(batch["version"], 3);
    assert_eq!(batch["partition"], first["partition"]);

    // A retried event id is acknowledged, not stored twice.
    let again = crate::append(url, "pump-7", token, "e1", r#"{"rpm":1}"#);
    assert_eq!(again["duplicates"], 1);
    assert_eq!(again["seqs"][0].as_u64(), Some(seq1));

    let twin = run(url, &["get", "--twin", "pump-7", "--json"]).ok().json();
    assert_eq!(twin["state"], json!({"rpm": 1300, "door": {"open": true}}));
    assert_eq!(twin["version"], 3);
    assert_eq!(twin["fence"].as_u64(), Some(token));
    assert_eq!(twin["twin_id"], "pump-7");

    // Time travel: the state after the first event only.
    let then = run(
        url,
        &[
            "get",
            "--twin",
            "pump-7",
            "--at-seq",
            &seq1.to_string(),
            "--json",
        ],
    )
    .ok()
    .json();
    assert_eq!(then["state"], json!({"rpm": 1200, "door": {"open": false}}));

    // Events: one JSON line each, oldest first.
    let events = run(url, &["events", "--twin", "pump-7", "--json"])
        .ok()
        .json_lines();
    let ids: Vec<&str> = events
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["e1", "e2", "e3"]);
    assert!(events
        .iter()
        .all(|e| e["token"].as_u64() == Some(token) && e["writer"] == "cli-a"));
    assert_eq!(events[1]["type"], "telemetry");
    let page = run(
        url,
        &[
            "events",
            "--twin",
            "pump-7",
            "--after",
            &seq1.to_string(),
            "--limit",
            "1",
            "--json",
        ],
    )
    .ok()
    .json_lines();
    assert_eq!(page.len(), 1);
    assert_eq!(page[0]["event_id"], "e2");

    // Renew keeps the token; release frees the scope; the released lease is gone.
    let renewed = run(url, &["lease", "renew", &lease_id, "--json"])
        .ok()
        .json();
    assert_eq!(renewed["token"].as_u64(), Some(token));
    let released = run(url, &["lease", "release", &lease_id, "--json"])
        .ok()
        .json();
    assert_eq!(released["released"], lease_id.as_str());
    let gone = run(url, &["lease", "renew", &lease_id, "--json"]);
    assert_eq!(gone.code, 1, "{gone:?}");
    assert_eq!(gone.json()["error"], "lease_released");

    let parts = run(url, &["partitions", "--json"]).ok().json();
    assert_eq!(parts["partitions"].as_array().unwrap().len(), 16);
    assert_eq!(parts["last_token"].as_u64(), Some(token));
    server.terminate();
}

#[test]
fn every_setting_can_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (_, token) = acquire(url, "twin/env-1", "env-writer");
    let r = run_with(
        palisade()
            .env("PALISADE_URL", url)
            .env("PALISADE_TWIN", "env-1")
            .env("PALISADE_FENCING_TOKEN", token.to_string())
            .env("PALISADE_EVENT_TYPE", "from-env")
            .env("PALISADE_PATCH", r#"{"source":"env"}"#)
            .env("PALISADE_JSON", "true"),
        &["append"],
        None,
    )
    .ok();
    assert_eq!(r.json()["version"], 1);
    let events = run_with(
        palisade()
            .env("PALISADE_URL", url)
            .env("PALISADE_JSON", "1"),
        &["events", "--twin", "env-1"],
        None,
    )
    .ok()
    .json_lines();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["type"], "from-env");
    assert_eq!(events[0]["patch"], json!({"source": "env"}));

    // A flag beats an exported variable of its alternative: with
    // PALISADE_PATCH and PALISADE_EVENT_TYPE set, `--file` is used...
    let r = run_with(
        palisade()
            .env("PALISADE_URL", url)
            .env("PALISADE_FENCING_TOKEN", token.to_string())
            .env("PALISADE_EVENT_TYPE", "from-env")
            .env("PALISADE_PATCH", r#"{"source":"env"}"#),
        &["append", "--twin", "env-1", "--file", "-", "--json"],
        Some(r#"{"type":"from-file","patch":{"source":"file"},"event_id":"f1"}"#),
    )
    .ok();
    assert_eq!(r.json()["version"], 2);
    // ...and PALISADE_TWIN (set for `append`) does not stop `tail --partition`.
    let partition = r.json()["partition"].to_string();
    let tail = Running::spawn(
        palisade()
            .env("PALISADE_URL", url)
            .env("PALISADE_TWIN", "some-other-twin"),
        &["tail", "--partition", &partition, "--after", "0", "--json"],
    );
    let types: Vec<Value> = (0..2)
        .map(|_| serde_json::from_str::<Value>(&tail.next_line(WAIT)).unwrap()["type"].clone())
        .collect();
    assert_eq!(types, ["from-env", "from-file"]);
    drop(tail);
    server.terminate();
}

#[test]
fn human_output_is_short_lines_and_tables() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let r = run(
        url,
        &[
            "lease",
            "acquire",
            "--scope",
            "partition/2",
            "--holder",
            "ops",
        ],
    )
    .ok();
    assert!(
        r.stdout.starts_with("acquired lease ") && r.stdout.contains("token 1"),
        "{r:?}"
    );
    assert_eq!(r.stdout.lines().count(), 1, "{r:?}");

    let (_, token) = acquire(url, "twin/h-1", "ops");
    let r = run(
        url,
        &[
            "append",
            "--twin",
            "h-1",
            "--token",
            &token.to_string(),
            "--patch",
            r#"{"t":21.5}"#,
        ],
    )
    .ok();
    assert!(
        r.stdout.starts_with("appended 1 event to h-1: partition "),
        "{r:?}"
    );

    let r = run(url, &["get", "--twin", "h-1"]).ok();
    let first = r.stdout.lines().next().unwrap();
    assert!(
        first.starts_with("twin h-1  partition ") && first.contains("version 1"),
        "{r:?}"
    );
    assert!(
        r.stdout.contains("\"t\": 21.5"),
        "state pretty-printed: {r:?}"
    );

    let r = run(url, &["events", "--twin", "h-1"]).ok();
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{r:?}");
    assert!(
        lines[0].starts_with("SEQ") && lines[0].ends_with("PATCH"),
        "{r:?}"
    );
    assert!(lines[1].ends_with(r#"{"t":21.5}"#), "{r:?}");

    let r = run(url, &["partitions"]).ok();
    assert!(
        r.stdout.lines().next().unwrap().starts_with("PARTITION"),
        "{r:?}"
    );
    // Partition 2's owner is shown.
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("2 ") && l.contains("ops (token 1")),
        "{r:?}"
    );
    assert_eq!(r.stdout.lines().count(), 16 + 2, "{r:?}");
    server.terminate();
}
