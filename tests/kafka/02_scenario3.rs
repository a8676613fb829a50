//! The reference article's scenario 3 over Kafka: writer A (token 120) pauses,
//! its lease expires, B takes over (token 131) and publishes; A's delayed
//! records arrive after B's and must be dropped, B's state stands. And the
//! variant where nobody took over: A's late records are applied (fencing is by
//! token, not by lease liveness).

use std::time::Duration;

use serde_json::json;

use crate::broker::TestTopic;
use crate::support::{lease_id_of, token_of, Client};
use crate::{
    event_ids, eventually, history, kafka_rejections, publish, publisher, serve, wait_handled,
};

const TWIN: &str = "pump-7";

/// Draw tokens on unrelated twins until the last one issued is `last`.
async fn burn_tokens_until(c: &Client, last: u64) {
    let mut i = 0;
    loop {
        let r = c.get("/v1/partitions").await;
        let now = r.body["last_token"].as_u64().unwrap();
        assert!(now <= last, "already past token {last}: {now}");
        if now == last {
            return;
        }
        c.acquire(&format!("twin/burn-{i}"), "burner", 600_000)
            .await;
        i += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_records_of_a_superseded_writer_are_dropped() {
    let t = TestTopic::new("scenario3");
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &t, &[]);
    let c = s.client();
    let p = publisher(&t.topic);

    // A gets token 120 with a short lease and writes once.
    burn_tokens_until(&c, 119).await;
    let a = c.acquire(&format!("twin/{TWIN}"), "A", 300).await;
    let ta = token_of(&a);
    assert_eq!(ta, 120);
    let a1 = publish(&p, TWIN, ta, "a-1", json!({ "owner": "A", "n": 1 })).await;
    wait_handled(&c, 1, Duration::from_secs(60)).await;

    // A pauses; its lease expires; B takes over with 131.
    burn_tokens_until(&c, 130).await;
    let b = eventually(
        "A's lease to expire so B can take over",
        Duration::from_secs(10),
        || async {
            let r = c.try_acquire(&format!("twin/{TWIN}"), "B", 600_000).await;
            if r.status == 201 {
                Ok(r.body)
            } else {
                Err(format!("{} {}", r.status, r.body))
            }
        },
    )
    .await;
    let tb = token_of(&b);
    assert!(tb > ta);
    let mut b_sent = Vec::new();
    for n in 1..=3 {
        b_sent.push(
            publish(
                &p,
                TWIN,
                tb,
                &format!("b-{n}"),
                json!({ "owner": "B", "n": n }),
            )
            .await,
        );
    }
    // A wakes up and its delayed records reach Kafka after B's.
    let mut a_late = Vec::new();
    for n in 2..=4 {
        a_late.push(
            publish(
                &p,
                TWIN,
                ta,
                &format!("a-{n}"),
                json!({ "owner": "A", "n": n, "late": true }),
            )
            .await,
        );
    }
    assert!(a_late.iter().all(|a| a.offset > b_sent[2].offset));

    let o = wait_handled(&c, 7, Duration::from_secs(60)).await;
    assert_eq!(o["applied"], 4, "{o:?}");
    assert_eq!(o["dropped_stale"], 3, "{o:?}");
    assert_eq!(o["dead_lettered"], 0, "{o:?}");

    let rej = kafka_rejections(&c).await;
    assert_eq!(rej.len(), 3, "{rej:?}");
    for (r, a) in rej.iter().zip(&a_late) {
        assert_eq!(r["reason"], "stale_token", "{r}");
        assert_eq!(r["twin_id"], TWIN);
        assert_eq!(r["token"], ta);
        assert_eq!(r["offset"], a.offset);
        assert_eq!(r["partition"], a.partition);
    }

    let events = history(&c, TWIN).await;
    assert_eq!(event_ids(&events), ["a-1", "b-1", "b-2", "b-3"]);
    assert_eq!(events[0]["token"], ta);
    assert!(events[1..]
        .iter()
        .all(|e| e["token"] == tb && e["writer"] == "B"));
    let view = c.twin(TWIN).await;
    assert_eq!(view.status, 200);
    assert_eq!(view.body["state"], json!({ "owner": "B", "n": 3 }));
    assert_eq!(view.body["fence"], tb);
    assert_eq!(a1.offset, 0);
    s.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_records_of_a_writer_never_taken_over_are_applied() {
    let t = TestTopic::new("scenario3-alone");
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &t, &[]);
    let c = s.client();
    let p = publisher(&t.topic);

    let a = c.acquire(&format!("twin/{TWIN}"), "A", 200).await;
    let ta = token_of(&a);
    publish(&p, TWIN, ta, "a-1", json!({ "owner": "A", "n": 1 })).await;
    wait_handled(&c, 1, Duration::from_secs(60)).await;

    // A's lease lapses (200 ms; the first record alone took longer) and
    // nobody takes over. One renewal probe: it must find the lease expired.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = c
        .post_json(&format!("/v1/leases/{}/renew", lease_id_of(&a)), &json!({}))
        .await;
    assert_eq!(r.status, 410, "A's lease must have expired: {:?}", r.body);

    for n in 2..=4 {
        publish(
            &p,
            TWIN,
            ta,
            &format!("a-{n}"),
            json!({ "owner": "A", "n": n }),
        )
        .await;
    }
    let o = wait_handled(&c, 4, Duration::from_secs(60)).await;
    assert_eq!(o["applied"], 4, "{o:?}");
    assert_eq!(o["dropped_stale"], 0, "{o:?}");
    assert!(kafka_rejections(&c).await.is_empty());
    let events = history(&c, TWIN).await;
    assert_eq!(event_ids(&events), ["a-1", "a-2", "a-3", "a-4"]);
    let view = c.twin(TWIN).await;
    assert_eq!(view.body["state"], json!({ "owner": "A", "n": 4 }));
    assert_eq!(view.body["fence"], ta);
    s.terminate();
}
