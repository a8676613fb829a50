//! `palisade tail`: live events as they are appended; history with
//! `--after 0`; a store restart under it costs no gap and no duplicate.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::support::ServeProcess;
use crate::{acquire, append, palisade, Running};

const WAIT: Duration = Duration::from_secs(15);

fn event_id(line: &str) -> String {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    v["event_id"].as_str().unwrap().to_owned()
}

#[test]
fn tail_twin_prints_events_appended_after_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (_, token) = acquire(url, "twin/t-1", "w");
    append(url, "t-1", token, "before", r#"{"n":0}"#);

    let tail = Running::spawn(
        palisade().env("PALISADE_URL", url),
        &["tail", "--twin", "t-1", "--json"],
    );
    tail.wait_stderr("following twin t-1", WAIT);
    // Another twin's events are not part of this twin's stream.
    let (_, other) = acquire(url, "twin/t-2", "w");
    append(url, "t-2", other, "elsewhere", r#"{"n":9}"#);
    append(url, "t-1", token, "live-1", r#"{"n":1}"#);
    append(url, "t-1", token, "live-2", r#"{"n":2}"#);
    let first = tail.next_line(WAIT);
    let second = tail.next_line(WAIT);
    assert_eq!([event_id(&first), event_id(&second)], ["live-1", "live-2"]);
    let v: Value = serde_json::from_str(&second).unwrap();
    assert_eq!(v["twin_id"], "t-1");
    assert_eq!(v["patch"]["n"], 2);
    assert_eq!(v["token"].as_u64(), Some(token));
    assert!(tail.maybe_line(Duration::from_millis(300)).is_none());
    drop(tail);
    server.terminate();
}

#[test]
fn tail_partition_after_0_replays_history_then_follows_for_people() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.as_str();
    let (_, token) = acquire(url, "partition/5", "p5");
    // Twins of partition 5 of a 16-partition store.
    let twins: Vec<String> = (0..)
        .map(|i| format!("dev-{i}"))
        .filter(|t| {
            let id = palisade::core::TwinId::new(t.clone()).unwrap();
            palisade::core::partition_for(&id, 16).0 == 5
        })
        .take(2)
        .collect();
    append(url, &twins[0], token, "h1", r#"{"a":1}"#);
    let tail = Running::spawn(
        &mut palisade(),
        &["tail", "--partition", "5", "--after", "0", "--url", url],
    );
    let line = tail.next_line(WAIT);
    assert!(
        line.starts_with("1  ") && line.contains(&twins[0]) && line.contains(r#"{"a":1}"#),
        "{line:?}"
    );
    append(url, &twins[1], token, "h2", r#"{"b":2}"#);
    let line = tail.next_line(WAIT);
    assert!(
        line.starts_with("2  ") && line.contains(&twins[1]) && line.contains("p5"),
        "{line:?}"
    );
    drop(tail);
    server.terminate();
}

/// `palisade serve` on a given address (the restarted store must come back
/// where the tail reconnects), retried while the port is not free yet.
fn serve_at(data: &Path, addr: SocketAddr) -> ServeProcess {
    for _ in 0..50 {
        if let Some(s) = crate::try_serve(&mut palisade(), data, &addr.to_string(), &[]) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("could not serve on {addr} again");
}

#[test]
fn tail_survives_a_store_restart_without_gap_or_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let url = server.base.clone();
    let addr: SocketAddr = url.strip_prefix("http://").unwrap().parse().unwrap();
    let (_, token) = acquire(&url, "twin/r-1", "w");
    append(&url, "r-1", token, "e1", r#"{"n":1}"#);
    let tail = Running::spawn(
        palisade().env("PALISADE_URL", &url),
        &["tail", "--twin", "r-1", "--after", "0", "--json"],
    );
    assert_eq!(event_id(&tail.next_line(WAIT)), "e1");
    append(&url, "r-1", token, "e2", r#"{"n":2}"#);
    assert_eq!(event_id(&tail.next_line(WAIT)), "e2");

    // The store goes away (a crash). While the tail cannot reach it, the
    // store runs elsewhere and takes e3; then it comes back on the same
    // address and takes e4. The tail must resume after e2: e3 is already in
    // the log when it reconnects, so starting at the new head would miss it.
    server.kill();
    tail.wait_stderr("stream dropped", WAIT);
    let elsewhere = ServeProcess::start(dir.path(), &[]);
    let (_, token) = acquire(&elsewhere.base, "twin/r-1", "w");
    append(&elsewhere.base, "r-1", token, "e3", r#"{"n":3}"#);
    elsewhere.terminate();
    let server = serve_at(dir.path(), addr);
    append(&url, "r-1", token, "e4", r#"{"n":4}"#);
    // Resumed after e2: neither e1/e2 again nor a gap.
    assert_eq!(event_id(&tail.next_line(WAIT)), "e3");
    assert_eq!(event_id(&tail.next_line(WAIT)), "e4");
    tail.wait_stderr("reconnected", WAIT);
    assert!(tail.maybe_line(Duration::from_millis(300)).is_none());
    drop(tail);
    server.terminate();
}
