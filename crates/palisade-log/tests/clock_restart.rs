//! The store's HLC must not go backwards across a restart. A writer may send
//! an HLC up to the allowed drift ahead of the store's clock; if the store
//! restarted with a fresh clock, the next event it stamps could be ordered
//! before that one and lose to it in the twin's last-writer-wins state,
//! although it was acknowledged later. The partition meta keeps the greatest
//! HLC and the clock is moved past it on open.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use palisade_core::{Clock, Hlc, NewEvent, Scope, TwinId};
use palisade_lease::AcquireRequest;
use palisade_log::{AsOf, Store, StoreConfig};

fn event(id: &str, v: &str, hlc: Option<Hlc>) -> NewEvent {
    NewEvent {
        event_id: id.into(),
        event_type: "set".into(),
        patch: serde_json::json!({ "m": v }).as_object().cloned().unwrap(),
        hlc,
    }
}

#[tokio::test]
async fn events_stamped_after_a_restart_order_after_earlier_ones() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || StoreConfig {
        partitions: Some(1),
        max_drift: Duration::from_millis(2000),
        ..StoreConfig::default()
    };
    let twin = TwinId::new("clocked").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let lease = store
        .acquire(AcquireRequest {
            scope: Scope::Twin(twin.clone()),
            holder: "w".into(),
            ttl_ms: 60_000,
            purpose: Default::default(),
        })
        .await
        .unwrap();
    // A writer whose clock runs 1.5 s ahead (within the 2 s drift allowed).
    let now = Clock::new(Duration::from_millis(2000)).now();
    let ahead = Hlc {
        time: now.time + (3u64 << 31),
        id: [7; 16],
    };
    store
        .append(
            twin.clone(),
            lease.token,
            vec![event("e1", "first", Some(ahead))],
            None,
        )
        .await
        .unwrap();
    store.close().await;
    drop(store);

    let store = Store::open(dir.path(), cfg()).unwrap();
    store
        .append(
            twin.clone(),
            lease.token,
            vec![event("e2", "second", None)],
            None,
        )
        .await
        .unwrap();
    let view = store.twin(&twin, AsOf::Latest).unwrap().unwrap();
    assert_eq!(
        view.state["m"], "second",
        "the later acknowledged write wins"
    );
    let events = store.twin_events(&twin, 0, 10).unwrap();
    assert!(
        events[1].hlc > events[0].hlc,
        "{:?} then {:?}",
        events[0].hlc,
        events[1].hlc
    );
    store.close().await;
}
