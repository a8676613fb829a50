//! `DELETE /v1/outbox/{partition}/{seq}/{index}`: an operator removes a dead
//! effect (one that failed every try) once dealt with. Only dead effects: a
//! delivered or pending one is refused (409) and kept; an unknown one is a
//! 404; bad numbers a 400; the removal (here through the SDK's
//! `Client::outbox_remove_dead`) is durable (gone after a restart) and
//! nothing is delivered again because of it.

use serde_json::json;

use crate::support::{token_of, ServeProcess};
use crate::{hook, outbox, settled, Receiver, FAST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_dead_effects_can_be_removed_and_the_removal_is_durable() {
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    let t = token_of(&c.acquire("twin/valve-4", "w", 60_000).await);
    let batch = json!([
        {"type": "t", "patch": {}, "event_id": "ok", "effects": [hook(&format!("{}/ok/x", rx.url), json!(1))]},
        {"type": "t", "patch": {}, "event_id": "dead", "effects": [hook(&format!("{}/down/x", rx.url), json!(2))]},
    ]);
    assert_eq!(c.append("valve-4", t, &batch).await.status, 201);
    let all = settled(&c, 2).await;
    let at = |e: &serde_json::Value| {
        format!("/v1/outbox/{}/{}/{}", e["partition"], e["seq"], e["index"])
    };
    let (ok, dead) = (&all[0], &all[1]);
    assert_eq!(
        (ok["state"].as_str(), dead["state"].as_str()),
        (Some("delivered"), Some("dead"))
    );

    let r = c.delete(&at(ok)).await;
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (409, Some("outbox_effect_not_dead")),
        "{:?}",
        r.body
    );
    // The CLI says the same (`palisade outbox --remove-dead P/SEQ/INDEX`).
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["outbox", "--url", &server.base, "--remove-dead"])
        .arg(format!("{}/{}/{}", ok["partition"], ok["seq"], ok["index"]))
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&cli.stdout),
        String::from_utf8_lossy(&cli.stderr)
    );
    assert!(
        !cli.status.success() && said.contains("outbox_effect_not_dead"),
        "{said}"
    );
    for bad in ["1/2", "1/2/3/4", "a/1/0", "0/1/70000"] {
        let cli = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
            .args(["outbox", "--url", &server.base, "--remove-dead", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&cli.stderr);
        assert!(
            !cli.status.success() && err.contains("PARTITION/SEQ/INDEX"),
            "{bad}: {err}"
        );
    }
    let p = dead["partition"].as_u64().unwrap();
    let r = c.delete(&format!("/v1/outbox/{p}/999999/0")).await;
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (404, Some("outbox_effect_not_found")),
        "{:?}",
        r.body
    );
    for bad in [
        "/v1/outbox/x/1/0",
        "/v1/outbox/0/1/70000",
        "/v1/outbox/0/-1/0",
    ] {
        let r = c.delete(bad).await;
        assert_eq!(
            (r.status, r.body["error"].as_str()),
            (400, Some("bad_query")),
            "{bad}: {:?}",
            r.body
        );
    }
    assert_eq!(
        outbox(&c, "").await,
        all,
        "a refused removal changed nothing"
    );

    // Through the SDK (`Client::outbox_remove_dead`).
    let sdk = palisade_client::Client::new(&server.base).unwrap();
    let n = |k: &str| dead[k].as_u64().unwrap();
    sdk.outbox_remove_dead(
        u32::try_from(n("partition")).unwrap(),
        n("seq"),
        u16::try_from(n("index")).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(outbox(&c, "").await, vec![ok.clone()]);
    let r = c.delete(&at(dead)).await;
    assert_eq!(r.status, 404, "removed once");
    let seen = rx.seen().len();
    server.terminate();

    let server = ServeProcess::start(dir.path(), FAST);
    let c = server.client();
    assert_eq!(
        outbox(&c, "").await,
        vec![ok.clone()],
        "the removal is durable"
    );
    // The dead effect is not tried again (nor the delivered one).
    assert_eq!(
        c.append(
            "valve-4",
            t,
            &json!({"type": "t", "patch": {}, "event_id": "after",
        "effects": [hook(&format!("{}/ok/after", rx.url), json!(3))]})
        )
        .await
        .status,
        201
    );
    rx.wait_for("after", |s| s.iter().any(|x| x.key == "after:0"))
        .await;
    assert_eq!(rx.seen().len(), seen + 1);
    server.terminate();
}
