//! The Kafka path with authentication on: a record is applied only if it
//! is signed by a known principal that may write the twin and was granted
//! the record's fencing token; anything else is dead-lettered (never
//! applied) and audited. Runs on librdkafka's mock cluster in this process.

use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use palisade::core::{FencingToken, NewEvent, TwinId};
use palisade_kafka::{IngestConfig, Ingester, Publisher};
use palisade_server::security::KafkaAuth;
use rdkafka::mocking::MockCluster;
use serde_json::{json, Value};

use crate::{start, token_of};

/// A mock cluster on a thread of its own (it is not `Send`), with one
/// 16-partition topic (the store's count), alive until the binary exits.
fn bootstrap() -> &'static str {
    static BOOT: OnceLock<String> = OnceLock::new();
    BOOT.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let cluster = MockCluster::new(1).unwrap();
            cluster.create_topic("secured-events", 16, 1).unwrap();
            tx.send(cluster.bootstrap_servers()).unwrap();
            loop {
                std::thread::park();
            }
        });
        rx.recv().unwrap()
    })
}

fn event(id: &str, patch: Value) -> NewEvent {
    NewEvent {
        event_id: id.into(),
        event_type: "update".into(),
        patch: patch.as_object().cloned().unwrap(),
        hlc: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_records_of_the_token_owner_are_applied() {
    let s = start("").await;
    let ta = token_of(&s.acquire("worker-a", "twin/device-1").await.body);
    let auth = s.http_security_auth();
    let mut cfg = IngestConfig::new(bootstrap());
    cfg.topic = "secured-events".into();
    cfg.group = "security-test".into();
    cfg.auth = Some(Arc::new(KafkaAuth::new(auth, s.store.clone())));
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let ingester = tokio::spawn(Ingester::run(s.store.clone(), cfg, async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));

    let publisher = |principal: Option<(&str, &str)>| {
        let p = Publisher::new(bootstrap(), "secured-events", &[])
            .unwrap()
            .with_partitions(16);
        match principal {
            Some((name, key)) => p.with_signing(name, key),
            None => p,
        }
    };
    let twin = TwinId::new("device-1").unwrap();
    let t = FencingToken(ta);
    // Refused: unsigned; signed by another principal with a's token; signed
    // in a's name with b's key; signed by a principal without `write`.
    publisher(None)
        .publish(&twin, t, &event("unsigned", json!({"x": 1})))
        .await
        .unwrap();
    publisher(Some(("worker-b", s.key("worker-b"))))
        .publish(&twin, t, &event("stolen", json!({"x": 2})))
        .await
        .unwrap();
    publisher(Some(("worker-a", s.key("worker-b"))))
        .publish(&twin, t, &event("forged", json!({"x": 3})))
        .await
        .unwrap();
    publisher(Some(("reader", s.key("reader"))))
        .publish(&twin, t, &event("reader", json!({"x": 4})))
        .await
        .unwrap();
    // Applied: signed by the token's owner.
    publisher(Some(("worker-a", s.key("worker-a"))))
        .publish(&twin, t, &event("good", json!({"x": 5})))
        .await
        .unwrap();

    // Wait (polling, no timing assumption) until all five are handled.
    let mut dead = Vec::new();
    for _ in 0..600 {
        dead = s.get("reader", "/v1/dead-letters?limit=100").await.body["dead_letters"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let applied = s.get("reader", "/v1/twins/device-1/events").await.body["events"]
            .as_array()
            .map_or(0, Vec::len);
        if dead.len() >= 4 && applied >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reasons: Vec<&str> = dead.iter().map(|d| d["reason"].as_str().unwrap()).collect();
    assert_eq!(
        reasons,
        [
            "unauthenticated",
            "token_not_yours",
            "unauthenticated",
            "forbidden"
        ],
        "{dead:#?}"
    );
    let events = s.get("reader", "/v1/twins/device-1/events").await.body;
    let ids: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["good"]);
    assert_eq!(
        s.get("reader", "/v1/twins/device-1").await.body["state"]["x"],
        5
    );
    // Audited as refused writes.
    let audit = s.get("ops", "/v1/audit?limit=1000").await.body;
    let kafka: Vec<&Value> = audit["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("kafka "))
        })
        .collect();
    assert_eq!(kafka.len(), 4, "{audit:#}");

    let _ = stop_tx.send(true);
    ingester.await.unwrap().unwrap();
    s.stop().await;
}
