//! The SDK declares effects (`Event::with_effect`) and lists the outbox
//! (`Client::outbox`); `palisade outbox` lists it from the command line.

use std::process::Command;

use palisade_client::{Client, Effect, Event};
use serde_json::{json, Value};

use crate::support::{token_of, ServeProcess};
use crate::{settled, Receiver};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_and_the_cli_declare_and_list_effects() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let c = server.client();
    let t = token_of(&c.acquire("twin/sdk-1", "w", 60_000).await);
    let sdk = Client::new(&server.base).unwrap();
    let ev = Event::new("t", json!({"a": 1}))
        .with_id("s1")
        .with_effect(Effect::webhook(
            format!("{}/ok/sdk", rx.url),
            json!({"x": 1}),
        ));
    sdk.append("sdk-1", t, &[ev]).await.unwrap();
    settled(&c, 1).await;
    let seen = rx.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, "s1:0");
    assert_eq!(seen[0].body, json!({"x": 1}));

    let delivered = sdk.outbox(Some("delivered"), 10).await.unwrap();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].idempotency_key, "s1:0");
    assert_eq!(delivered[0].token, t);
    assert!(sdk.outbox(Some("dead"), 10).await.unwrap().is_empty());

    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args([
            "outbox",
            "--state",
            "delivered",
            "--json",
            "--url",
            &server.base,
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["idempotency_key"], "s1:0");
    assert_eq!(lines[0]["state"], "delivered");
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["outbox", "--url", &server.base])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("s1:0") && text.contains("delivered"),
        "{text}"
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["outbox", "--state", "lost", "--url", &server.base])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    server.terminate();
}
