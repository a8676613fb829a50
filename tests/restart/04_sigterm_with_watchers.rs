//! SIGTERM must stop the store even while clients follow change streams.
//! Graceful shutdown waits for open responses, and an SSE stream never ends
//! by itself: the streams must end when shutdown starts, or `palisade serve`
//! hangs until every watcher disconnects.

use std::time::{Duration, Instant};

use crate::support::ServeProcess;

#[tokio::test]
async fn sigterm_ends_open_change_streams_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServeProcess::start(dir.path(), &[]);
    let c = server.client();
    let mut twin_watch = c
        .http
        .get(format!("{}/v1/twins/w/watch?after=0", c.base))
        .send()
        .await
        .unwrap();
    let mut part_watch = c
        .http
        .get(format!("{}/v1/partitions/0/watch", c.base))
        .send()
        .await
        .unwrap();
    assert_eq!(twin_watch.status(), 200);
    assert_eq!(part_watch.status(), 200);
    server.signal("TERM");
    let started = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "palisade serve still running 20 s after SIGTERM with watchers open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit status {status}");
    // The streams were ended by the server, not cut mid-event.
    assert!(tokio::time::timeout(Duration::from_secs(5), async {
        while twin_watch.chunk().await.ok().flatten().is_some() {}
        while part_watch.chunk().await.ok().flatten().is_some() {}
    })
    .await
    .is_ok());
}

/// A SIGTERM sent the moment the ready line is read must still be a clean
/// shutdown (exit 0, the store closed), never the signal's default action.
/// The handler used to be installed by a spawned task that could run after
/// the line was printed: 4 of 30 such starts (python, info logging) were killed outright on an idle
/// machine (CI's faults/08 probe hit it under load). Not deterministic: a
/// regression shows as some of the 100 starts failing.
#[test]
fn a_sigterm_right_after_the_ready_line_is_a_clean_shutdown() {
    for _ in 0..100 {
        let dir = tempfile::tempdir().unwrap();
        // SIGTERM at once, then "palisade serve exited with signal: 15" if
        // the handler was not there yet.
        ServeProcess::start(dir.path(), &[]).terminate();
    }
}
