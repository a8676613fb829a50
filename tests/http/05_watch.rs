//! Change streams (SSE): one event per append, `id` = seq, resumable with
//! `Last-Event-ID` with no gap and no duplicate across a reconnect.

use std::time::Duration;

use serde_json::json;

use crate::start;
use crate::support::token_of;

/// Reads SSE `id:` lines from a streaming response until `n` ids arrived.
async fn read_ids(resp: &mut reqwest::Response, buf: &mut String, n: usize) -> Vec<u64> {
    let mut ids = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ids.len() < n {
        while let Some(pos) = buf.find('\n') {
            let line: String = buf.drain(..=pos).collect();
            if let Some(id) = line.trim_end().strip_prefix("id: ") {
                ids.push(id.parse().unwrap());
            }
        }
        if ids.len() >= n {
            break;
        }
        let chunk = tokio::time::timeout_at(deadline, resp.chunk())
            .await
            .expect("stream stalled")
            .unwrap()
            .expect("stream ended");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    ids
}

#[tokio::test]
async fn twin_watch_streams_every_event_and_resumes_without_gaps_or_duplicates() {
    let (_dir, server, c) = start().await;
    let token = token_of(&c.acquire("twin/w-1", "A", 60_000).await);
    for i in 1..=3 {
        assert_eq!(
            c.put("w-1", token, &format!("e{i}"), json!({ "n": i }))
                .await
                .status,
            201
        );
    }
    let mut resp = c
        .http
        .get(format!("{}/v1/twins/w-1/watch?after=0", c.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut buf = String::new();
    assert_eq!(read_ids(&mut resp, &mut buf, 3).await, [1, 2, 3]);
    // Live: appends after the stream opened arrive too.
    for i in 4..=5 {
        c.put("w-1", token, &format!("e{i}"), json!({ "n": i }))
            .await;
    }
    assert_eq!(read_ids(&mut resp, &mut buf, 2).await, [4, 5]);
    drop(resp);

    // Disconnected; two more appends; reconnect from the last id seen.
    for i in 6..=7 {
        c.put("w-1", token, &format!("e{i}"), json!({ "n": i }))
            .await;
    }
    let mut resp = c
        .http
        .get(format!("{}/v1/twins/w-1/watch", c.base))
        .header("Last-Event-ID", "5")
        .send()
        .await
        .unwrap();
    let mut buf = String::new();
    assert_eq!(read_ids(&mut resp, &mut buf, 2).await, [6, 7]);
    c.put("w-1", token, "e8", json!({ "n": 8 })).await;
    assert_eq!(read_ids(&mut resp, &mut buf, 1).await, [8]);
    drop(resp);
    server.stop().await;
}

#[tokio::test]
async fn partition_watch_only_carries_its_partition_and_refuses_bad_input() {
    let (_dir, server, c) = start().await;
    let lease = c.acquire("partition/3", "P", 60_000).await;
    let twin = crate::twin_in(3, "pw");
    let mut resp = c
        .http
        .get(format!("{}/v1/partitions/3/watch", c.base))
        .send()
        .await
        .unwrap();
    c.put(&twin, token_of(&lease), "p1", json!({ "x": 1 }))
        .await;
    let mut buf = String::new();
    assert_eq!(read_ids(&mut resp, &mut buf, 1).await, [1]);
    drop(resp);
    assert_eq!(c.get("/v1/partitions/99/watch").await.status, 404);
    assert_eq!(c.get("/v1/twins/x/watch?after=abc").await.status, 400);
    let r = c
        .http
        .get(format!("{}/v1/twins/x/watch", c.base))
        .header("Last-Event-ID", "nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    server.stop().await;
}
