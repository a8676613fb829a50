//! Clock trouble. A writer whose HLC is too far ahead of the store's clock
//! is refused with `422 clock_drift` (how far ahead, and the bound) and
//! nothing changes; the bound is `--max-drift-ms`; a refused HLC does not
//! drag the store's clock forward. Lease expiry reads no wall clock.
//! What cannot be tested here (a jump of the machine's wall clock) is in
//! README.md: this suite never changes the system clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::history;
use crate::support::{token_of, Client, ServeProcess};

/// The HLC text (`<ntp64>/<hex id>`) of the wall clock shifted by `ms`.
fn hlc_at(offset_ms: i64) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let d = if offset_ms >= 0 {
        now + Duration::from_millis(offset_ms.unsigned_abs())
    } else {
        now - Duration::from_millis(offset_ms.unsigned_abs())
    };
    // NTP64 as uhlc uses it: Unix seconds in the high 32 bits, fraction below.
    let frac = (u64::from(d.subsec_nanos()) << 32) / 1_000_000_000;
    format!("{}/1", (d.as_secs() << 32) | frac)
}

fn hlc_millis(hlc: &str) -> u64 {
    let t: u64 = hlc.split_once('/').unwrap().0.parse().unwrap();
    (t >> 32) * 1000 + (((t & 0xFFFF_FFFF) * 1000) >> 32)
}

fn event(id: &str, n: u64, hlc: Option<String>) -> Value {
    let mut e = json!({"type": "tick", "patch": {"n": n}, "event_id": id});
    if let Some(h) = hlc {
        e["hlc"] = json!(h);
    }
    e
}

/// State, version, fence and history of a twin: what a refusal must not change.
async fn snapshot(c: &Client, twin: &str) -> (Value, Vec<Value>) {
    let t = c.twin(twin).await;
    assert_eq!(t.status, 200, "{:?}", t.body);
    (t.body, history(c, twin).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hlc_far_ahead_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(dir.path(), &[]);
    let c = store.client();
    let twin = "clock-ahead";
    let token = token_of(&c.acquire(&format!("twin/{twin}"), "w", 60_000).await);
    let r = c
        .append(twin, token, &event("e0", 0, Some(hlc_at(0))))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let before = snapshot(&c, twin).await;

    // 60 s ahead: one event, then a batch whose second event is ahead.
    let ahead = hlc_at(60_000);
    for body in [
        event("e1", 1, Some(ahead.clone())),
        json!([
            event("e2", 2, Some(hlc_at(0))),
            event("e3", 3, Some(ahead.clone()))
        ]),
    ] {
        let r = c.append(twin, token, &body).await;
        assert_eq!(r.status, 422, "{:?}", r.body);
        assert_eq!(r.body["error"], "clock_drift", "{:?}", r.body);
        assert_eq!(r.body["hlc"], ahead.as_str(), "{:?}", r.body);
        assert_eq!(r.body["max_drift_ms"], 500, "{:?}", r.body);
        let ahead_ms = r.body["ahead_ms"].as_u64().unwrap();
        assert!(
            (55_000..=60_000).contains(&ahead_ms),
            "ahead_ms {ahead_ms}: {:?}",
            r.body
        );
        assert!(r.body["message"].as_str().unwrap().contains("ahead"));
        assert_eq!(
            snapshot(&c, twin).await,
            before,
            "a refused append changed the twin"
        );
    }

    // The refused HLC did not drag the store's clock forward: an event the
    // store stamps now is stamped near the real time, not 60 s ahead.
    let r = c.append(twin, token, &event("e4", 4, None)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let events = history(&c, twin).await;
    let stamped = hlc_millis(events.last().unwrap()["hlc"].as_str().unwrap());
    assert!(
        stamped + 30_000 < hlc_millis(&ahead),
        "the store's clock jumped to the refused HLC: {stamped} vs {}",
        hlc_millis(&ahead)
    );
    store.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_bound_is_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(dir.path(), &["--max-drift-ms", "100"]);
    let c = store.client();
    let twin = "clock-bound";
    let token = token_of(&c.acquire(&format!("twin/{twin}"), "w", 60_000).await);
    let r = c.append(twin, token, &event("e0", 0, None)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let before = snapshot(&c, twin).await;

    let r = c
        .append(twin, token, &event("e1", 1, Some(hlc_at(1_000))))
        .await;
    assert_eq!(r.status, 422, "1 s ahead with a 100 ms bound: {:?}", r.body);
    assert_eq!(r.body["error"], "clock_drift");
    assert_eq!(r.body["max_drift_ms"], 100);
    let ahead_ms = r.body["ahead_ms"].as_u64().unwrap();
    assert!((500..=1_000).contains(&ahead_ms), "{:?}", r.body);
    assert_eq!(snapshot(&c, twin).await, before);

    // Within the bound, and behind the store's clock: accepted.
    for (id, offset) in [("e2", 50), ("e3", -3_600_000)] {
        let r = c
            .append(twin, token, &event(id, 2, Some(hlc_at(offset))))
            .await;
        assert_eq!(r.status, 201, "{offset} ms: {:?}", r.body);
    }
    store.terminate();
}

/// Lease expiry is measured on the monotonic clock only: the lease code
/// reads no clock at all (its time is the injected `palisade_lease::Clock`,
/// whose monotonic reading decides expiry; the wall reading is only stored as
/// deadlines, for restarts), so a wall-clock jump cannot shorten or extend a
/// lease. (A source check: the one thing about a wall-clock jump this
/// machine lets us verify without changing the shared system clock.)
#[test]
fn lease_expiry_reads_no_wall_clock() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/palisade-lease/src");
    let mut files = 0;
    let mut stack = vec![src];
    while let Some(p) = stack.pop() {
        for entry in std::fs::read_dir(&p).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files += 1;
                let text = std::fs::read_to_string(&path).unwrap();
                for needle in [
                    "SystemTime",
                    "UNIX_EPOCH",
                    "chrono",
                    "uhlc",
                    "Hlc",
                    "Instant::now",
                ] {
                    assert!(
                        !text.contains(needle),
                        "{} mentions {needle}: the lease code must read no clock but the injected one",
                        path.display()
                    );
                }
            }
        }
    }
    assert!(files > 0);
}

/// libfaketime, if installed (`apt-get install libfaketime`), or
/// `PALISADE_LIBFAKETIME=/path/to/libfaketime.so.1`.
fn libfaketime() -> Option<std::path::PathBuf> {
    let candidates = std::env::var_os("PALISADE_LIBFAKETIME")
        .map(std::path::PathBuf::from)
        .into_iter()
        .chain(
            [
                "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                "/usr/lib/faketime/libfaketime.so.1",
                "/usr/lib64/faketime/libfaketime.so.1",
                "/usr/local/lib/faketime/libfaketime.so.1",
            ]
            .map(std::path::PathBuf::from),
        );
    candidates.into_iter().find(|p| p.exists())
}

/// `palisade serve` whose wall clock (and only its: the system clock is
/// untouched) is offset by what `offset_file` says, re-read on every clock
/// call; its monotonic clock is the real one.
fn serve_with_fake_wall_clock(
    lib: &std::path::Path,
    data: &std::path::Path,
    offset_file: &std::path::Path,
) -> ServeProcess {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("serve")
        .arg("--data")
        .arg(data)
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "error")
        .env("LD_PRELOAD", lib)
        .env("FAKETIME_TIMESTAMP_FILE", offset_file)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("DONT_FAKE_MONOTONIC", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn palisade serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("palisade listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    ServeProcess { child, base }
}

/// The store's wall clock jumps an hour forward, then two hours back,
/// while a lease is held: the lease neither expires early nor lives on
/// past its TTL, a stale token stays refused, and the HLC never goes back.
/// Needs libfaketime (LD_PRELOAD into the store process only); without it
/// the test says so and passes (`PALISADE_REQUIRE_FAKETIME=1` makes it fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_wall_clock_jumps_do_not_move_leases() {
    const TTL_MS: u64 = 1_000;
    let Some(lib) = libfaketime() else {
        assert!(
            std::env::var_os("PALISADE_REQUIRE_FAKETIME").is_none(),
            "libfaketime not found"
        );
        eprintln!("SKIPPED store_wall_clock_jumps_do_not_move_leases: libfaketime not installed");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let offset = dir.path().join("faketime");
    std::fs::write(&offset, "+0\n").unwrap();
    let store = serve_with_fake_wall_clock(&lib, &dir.path().join("data"), &offset);
    let c = store.client();
    let twin = "clock-jump";
    let scope = format!("twin/{twin}");
    let stamped = |events: &[Value]| hlc_millis(events.last().unwrap()["hlc"].as_str().unwrap());
    let real_ms = || {
        u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap()
    };

    let lease = c.acquire(&scope, "A", TTL_MS).await;
    let (a_token, a_lease) = (token_of(&lease), crate::support::lease_id_of(&lease));
    let r = c.append(twin, a_token, &event("e0", 0, None)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    // One hour forward: the store's clock moved (its HLC shows it), the
    // lease did not expire.
    std::fs::write(&offset, "+1h\n").unwrap();
    let r = c.append(twin, a_token, &event("e1", 1, None)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let forward = stamped(&history(&c, twin).await);
    assert!(
        forward > real_ms() + 3_000_000,
        "libfaketime did not move the store's wall clock ({forward} vs {})",
        real_ms()
    );
    let r = c.try_acquire(&scope, "B", TTL_MS).await;
    assert_eq!(
        r.status, 409,
        "a forward jump expired the lease: {:?}",
        r.body
    );
    let r = c
        .post_json(&format!("/v1/leases/{a_lease}/renew"), &json!({}))
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let renewed = std::time::Instant::now();

    // Two hours back: the HLC does not go back, the lease is still A's ...
    std::fs::write(&offset, "-1h\n").unwrap();
    let r = c.append(twin, a_token, &event("e2", 2, None)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let events = history(&c, twin).await;
    let ntp = |e: &Value| -> u64 {
        let h = e["hlc"].as_str().unwrap();
        h.split_once('/').unwrap().0.parse().unwrap()
    };
    assert!(
        ntp(&events[2]) > ntp(&events[1]),
        "the HLC went back with the wall clock: {events:#?}"
    );
    let r = c.try_acquire(&scope, "B", TTL_MS).await;
    assert_eq!(r.status, 409, "{:?}", r.body);

    // ... and expires one TTL after its last renewal, not an hour later.
    tokio::time::sleep(Duration::from_millis(TTL_MS + 200).saturating_sub(renewed.elapsed())).await;
    let b = c.try_acquire(&scope, "B", 10_000).await;
    assert_eq!(
        b.status, 201,
        "a backward jump kept the lease alive: {:?}",
        b.body
    );
    let r = c.append(twin, a_token, &event("e3", 3, None)).await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.body["error"], "stale_token");
    let r = c
        .append(twin, token_of(&b.body), &event("e4", 4, None))
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    store.terminate();
}
