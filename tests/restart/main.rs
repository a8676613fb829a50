//! Restarts of the real `palisade serve` binary on the same data folder:
//! clean (SIGTERM), crash (SIGKILL), a changed partition count and lease
//! expiry across restarts. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_clean_restart.rs"]
mod clean_restart;

#[path = "02_crash_restart.rs"]
mod crash_restart;

#[path = "03_partition_count.rs"]
mod partition_count;
#[path = "04_sigterm_with_watchers.rs"]
mod sigterm_with_watchers;

#[path = "05_expired_leases.rs"]
mod expired_leases;

#[path = "06_refusal_journal.rs"]
mod refusal_journal;

use serde_json::Value;
use support::Client;

/// Every stored event of a twin (one page of up to 1000).
pub async fn history(c: &Client, twin: &str) -> Vec<Value> {
    let r = c.get(&format!("/v1/twins/{twin}/events?limit=1000")).await;
    assert_eq!(r.status, 200, "history of {twin}: {:?}", r.body);
    r.body["events"].as_array().unwrap().clone()
}

/// `(partition, fence, head)` of every partition, and the last token issued.
pub async fn partitions(c: &Client) -> (Vec<(u64, u64, u64)>, u64) {
    let r = c.get("/v1/partitions").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let list = r.body["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["partition"].as_u64().unwrap(),
                p["fence"].as_u64().unwrap(),
                p["head"].as_u64().unwrap(),
            )
        })
        .collect();
    (list, r.body["last_token"].as_u64().unwrap())
}
