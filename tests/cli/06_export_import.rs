//! Issue 17, export and replay: `palisade export` writes a store's events as
//! NDJSON and `palisade import` rebuilds another store from them. Guards
//! against: a rebuilt twin whose state or version differs from the
//! original's, or whose history differs in events, order or HLCs (events
//! out of HLC order, several twins per partition, a target with another
//! partition count); an import run twice storing
//! anything twice; a damaged export (bad line, bad HLC, a repeated event)
//! sending anything before it is refused; a partition or twin export that
//! holds other partitions' or twins' events.

use std::path::Path;

use serde_json::{json, Value};

use crate::support::ServeProcess;
use crate::{acquire, palisade, run, run_with};

/// Twins, events per twin: some events carry an HLC older than the twin's
/// previous one (a late writer), so arrival order and state order differ.
const TWINS: usize = 12;
const EVENTS: usize = 25;

/// `palisade get --twin T --json`.
fn get(url: &str, twin: &str) -> Value {
    run(url, &["get", "--twin", twin, "--json"]).ok().json()
}

fn heads(url: &str) -> u64 {
    run(url, &["partitions", "--json"]).ok().json()["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["head"].as_u64().unwrap())
        .sum()
}

/// Fill a store: each twin gets EVENTS events under its own lease, with
/// explicit HLCs going back in time every third event.
fn fill(url: &str) {
    let base_ntp: u64 = 0x6000_0000_0000_0000;
    for t in 0..TWINS {
        let twin = format!("pump-{t}");
        let (_, token) = acquire(url, &format!("twin/{twin}"), &format!("w{t}"));
        let body: Vec<Value> = (0..EVENTS)
            .map(|i| {
                // Every third event is stamped before its predecessor, and
                // the last one before all of them.
                let tick = match i {
                    _ if i == EVENTS - 1 => 0,
                    _ if i % 3 == 2 => i as u64 - 2,
                    _ => i as u64 + 1,
                };
                json!({
                    "type": "update",
                    "event_id": format!("e-{t}-{i}"),
                    "hlc": format!("{}/{:x}", base_ntp + (tick << 20), 0xa0 + t),
                    "patch": {"rpm": i, "last": format!("{t}-{i}"), "k": {"n": i % 4}}
                })
            })
            .collect();
        run_with(
            &mut palisade(),
            &[
                "append",
                "--url",
                url,
                "--twin",
                &twin,
                "--token",
                &token.to_string(),
                "--file",
                "-",
            ],
            Some(&Value::Array(body).to_string()),
        )
        .ok();
    }
}

/// A twin's state and its history as (event id, HLC, patch), in order. (Its
/// version is a partition sequence number: another store numbers it otherwise.)
fn twin(url: &str, t: usize) -> (Value, Vec<Value>) {
    let v = get(url, &format!("pump-{t}"));
    let history = run(
        url,
        &[
            "events",
            "--twin",
            &format!("pump-{t}"),
            "--limit",
            "1000",
            "--json",
        ],
    )
    .ok()
    .json_lines()
    .into_iter()
    .map(|e| json!([e["event_id"], e["hlc"], e["patch"]]))
    .collect();
    (v["state"].clone(), history)
}

fn export(url: &str, to: &Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["export", "--to", to.to_str().unwrap()];
    args.extend(extra);
    run(url, &args).ok();
    std::fs::read_to_string(to)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn an_imported_export_rebuilds_every_twin() {
    let dir = tempfile::tempdir().unwrap();
    let src = ServeProcess::start(&dir.path().join("src"), &[]);
    fill(&src.base);
    let file = dir.path().join("all.ndjson");
    let lines = export(&src.base, &file, &[]);
    assert_eq!(lines[0]["palisade_export"], 1, "{}", lines[0]);
    assert_eq!(lines[0]["scope"], "store");
    assert_eq!(lines.len() - 1, TWINS * EVENTS);

    // A target with another partition count: twins land elsewhere.
    let dst = ServeProcess::start(&dir.path().join("dst"), &["--partitions", "4"]);
    let r = run(
        &dst.base,
        &["import", "--from", file.to_str().unwrap(), "--batch", "7"],
    )
    .ok();
    assert!(
        r.stdout
            .contains(&format!("imported {} events", TWINS * EVENTS)),
        "{r:?}"
    );
    for t in 0..TWINS {
        let (want, wh) = twin(&src.base, t);
        let (got, gh) = twin(&dst.base, t);
        assert_eq!(got, want, "pump-{t}");
        assert_eq!(gh.len(), EVENTS, "pump-{t}");
        assert_eq!(gh, wh, "pump-{t}: history");
        // The HLC order, not arrival, decided: the state is not simply the last event's.
        assert_ne!(
            got["last"],
            json!(format!("{t}-{}", EVENTS - 1)),
            "pump-{t}: {got}"
        );
    }

    // Run again: every event is already there, nothing is stored twice.
    let before = heads(&dst.base);
    let r = run(&dst.base, &["import", "--from", file.to_str().unwrap()]).ok();
    assert!(r.stdout.contains("imported 0 events"), "{r:?}");
    assert!(
        r.stdout
            .contains(&format!("({} already stored)", TWINS * EVENTS)),
        "{r:?}"
    );
    assert_eq!(heads(&dst.base), before);
    for t in 0..TWINS {
        assert_eq!(
            twin(&dst.base, t),
            twin(&src.base, t),
            "pump-{t} after a re-import"
        );
    }

    // One partition, one twin: nothing else.
    let p = get(&src.base, "pump-3")["partition"].as_u64().unwrap();
    let part = export(
        &src.base,
        &dir.path().join("p.ndjson"),
        &["--partition", &p.to_string()],
    );
    assert!(
        part.len() > EVENTS,
        "pump-3's partition holds its events: {}",
        part.len()
    );
    for e in &part[1..] {
        let t = &e["twin_id"];
        let tp = get(&src.base, t.as_str().unwrap())["partition"].clone();
        assert_eq!(tp, json!(p), "{e}");
    }
    let one = export(
        &src.base,
        &dir.path().join("t.ndjson"),
        &["--twin", "pump-3"],
    );
    assert_eq!(one.len() - 1, EVENTS);
    assert!(one[1..].iter().all(|e| e["twin_id"] == "pump-3"));
}

#[test]
fn a_damaged_export_is_refused_before_anything_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let src = ServeProcess::start(&dir.path().join("src"), &[]);
    fill(&src.base);
    let file = dir.path().join("all.ndjson");
    export(&src.base, &file, &[]);
    let text = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let dst = ServeProcess::start(&dir.path().join("dst"), &[]);
    let last = lines.len();
    let cases: Vec<(String, String)> = vec![
        // The last line is damaged: everything before it must not be sent either.
        (
            format!("{}\n{{\"seq\": 1", lines.join("\n")),
            format!(":{}: not an event", last + 1),
        ),
        (
            format!(
                "{}\n{}",
                lines.join("\n"),
                lines[last - 1].replace("\"hlc\":\"", "\"hlc\":\"x")
            ),
            "is not <ntp64>/<hex id>".into(),
        ),
        (
            format!("{}\n{}", lines.join("\n"), lines[1]),
            "appears twice".into(),
        ),
        (
            lines[1..].join("\n"),
            ":1: not a palisade export header".into(),
        ),
        (String::new(), "empty file".into()),
    ];
    for (i, (content, want)) in cases.into_iter().enumerate() {
        let bad = dir.path().join(format!("bad-{i}.ndjson"));
        std::fs::write(&bad, content).unwrap();
        let r = run_with(
            &mut palisade(),
            &[
                "import",
                "--url",
                &dst.base,
                "--from",
                bad.to_str().unwrap(),
            ],
            None,
        );
        assert_eq!(r.code, 2, "case {i}: {r:?}");
        assert!(r.stderr.contains(&want), "case {i}: {want:?} not in {r:?}");
        assert_eq!(heads(&dst.base), 0, "case {i}: something was stored");
    }
}
