//! Device-shadow documents: `desired` and `reported` sections with a computed
//! `delta` that shrinks as the device reports what was desired.

use serde_json::{json, Value};

use crate::start;
use crate::support::token_of;

#[tokio::test]
async fn delta_follows_desired_minus_reported() {
    let (_dir, server, c) = start().await;
    let t = token_of(&c.acquire("twin/thermo-1", "ctl", 60_000).await);
    c.put(
        "thermo-1",
        t,
        "d1",
        json!({ "desired": { "temp": 21, "fan": "auto" } }),
    )
    .await;
    assert_eq!(
        c.twin("thermo-1").await.body["delta"],
        json!({ "temp": 21, "fan": "auto" })
    );
    c.put(
        "thermo-1",
        t,
        "r1",
        json!({ "reported": { "temp": 19, "fan": "auto" } }),
    )
    .await;
    assert_eq!(
        c.twin("thermo-1").await.body["delta"],
        json!({ "temp": 21 })
    );
    c.put("thermo-1", t, "r2", json!({ "reported": { "temp": 21 } }))
        .await;
    assert_eq!(c.twin("thermo-1").await.body["delta"], Value::Null);
    c.put(
        "plain",
        token_of(&c.acquire("twin/plain", "x", 60_000).await),
        "p",
        json!({ "a": 1 }),
    )
    .await;
    assert_eq!(c.twin("plain").await.body["delta"], Value::Null);
    server.stop().await;
}
