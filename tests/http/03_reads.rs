//! Reads over HTTP: twin state and its ETag, time travel by seq and by HLC,
//! history paging, partitions, health, metrics, and HLC (not arrival) order.

use std::time::Duration;

use palisade::core::Clock;
use serde_json::{json, Value};

use crate::support::{token_of, Client};
use crate::{assert_error, history, partition_of, send, start, start_clocked, twin_in};

async fn get_ok(c: &Client, path: &str) -> Value {
    let r = c.get(path).await;
    assert_eq!(r.status, 200, "GET {path}: {:?}", r.body);
    r.body
}

fn stale_rejections(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("palisade_append_rejections_total{reason=\"stale_token\"} "))
        .map_or(0, |n| n.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twin_read_shape_etag_and_not_found() {
    let (_dir, server, c) = start().await;
    let twin = "reader-1";
    let t = token_of(&c.acquire("twin/reader-1", "A", 60_000).await);
    let r = c
        .put(
            twin,
            t,
            "e-1",
            json!({"owner": "A", "temp": {"c": 21}, "tags": [1, 2]}),
        )
        .await;
    assert_eq!(r.status, 201);
    let seq = r.body["seqs"][0].as_u64().unwrap();

    let r = c.twin(twin).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let b = &r.body;
    assert_eq!(b["twin_id"], twin);
    assert_eq!(b["partition"], partition_of(twin));
    assert_eq!(b["version"], seq);
    assert_eq!(b["fence"], t);
    assert_eq!(
        b["state"],
        json!({"owner": "A", "temp": {"c": 21}, "tags": [1, 2]})
    );
    let hlc = b["hlc"].as_object().unwrap();
    let keys: Vec<&str> = hlc.keys().map(String::as_str).collect();
    assert_eq!(keys, ["/owner", "/tags", "/temp/c"]);
    let events = history(&c, twin).await;
    for v in hlc.values() {
        assert_eq!(v, &events[0]["hlc"], "field HLC is the event's HLC");
        assert!(v.as_str().unwrap().parse::<palisade::core::Hlc>().is_ok());
    }
    let etag = r.headers["etag"].to_str().unwrap().to_owned();
    assert_eq!(etag, format!("\"{seq}\""));

    // Conditional read.
    let url = format!("{}/v1/twins/{twin}", c.base);
    let r = send(c.http.get(&url).header("if-none-match", &etag)).await;
    assert_eq!(r.status, 304);
    // RFC 9110 15.4.5: the 304 carries the ETag a 200 would.
    assert_eq!(r.headers["etag"].to_str().unwrap(), etag);
    let r = send(c.http.get(&url).header("if-none-match", "\"999\"")).await;
    assert_eq!(r.status, 200);
    // A weak tag, a list that includes it, and `*` match too (RFC 9110).
    for v in [
        format!("W/{etag}"),
        format!("\"1000\", {etag}"),
        "*".to_owned(),
    ] {
        let r = send(c.http.get(&url).header("if-none-match", v.as_str())).await;
        assert_eq!(r.status, 304, "If-None-Match: {v}");
    }
    // After a write the old ETag no longer matches.
    c.put(twin, t, "e-2", json!({"owner": "B"})).await;
    let r = send(c.http.get(&url).header("if-none-match", &etag)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["state"]["owner"], "B");

    assert_error(&c.twin("nobody").await, 404, "twin_not_found");
    // A twin that was only leased, never written, has no state either.
    c.acquire("twin/leased-only", "A", 60_000).await;
    assert_error(&c.twin("leased-only").await, 404, "twin_not_found");

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_travel_by_seq_and_by_hlc() {
    let (_dir, server, c) = start().await;
    let twin = "tt-1";
    let t = token_of(&c.acquire("twin/tt-1", "A", 60_000).await);
    let patches = [
        json!({"owner": "A", "n": 1}),
        json!({"n": 2, "extra": true}),
        json!({"owner": "C", "extra": null}),
    ];
    let expected = [
        json!({"owner": "A", "n": 1}),
        json!({"owner": "A", "n": 2, "extra": true}),
        json!({"owner": "C", "n": 2}),
    ];
    let mut seqs = Vec::new();
    for (i, p) in patches.iter().enumerate() {
        let r = c.put(twin, t, &format!("e-{i}"), p.clone()).await;
        assert_eq!(r.status, 201);
        seqs.push(r.body["seqs"][0].as_u64().unwrap());
    }
    // Another twin in the same partition interleaves sequence numbers.
    let other = twin_in(partition_of(twin), "tt-other");
    let to = token_of(&c.acquire(&format!("twin/{other}"), "B", 60_000).await);
    c.put(&other, to, "o-1", json!({"x": 1})).await;

    for (seq, want) in seqs.iter().zip(&expected) {
        let b = get_ok(&c, &format!("/v1/twins/{twin}?at_seq={seq}")).await;
        assert_eq!(&b["state"], want, "at_seq={seq}");
        assert_eq!(b["version"], *seq);
    }
    // Before the first event there is no twin; past the last, the latest.
    let r = c
        .get(&format!("/v1/twins/{twin}?at_seq={}", seqs[0] - 1))
        .await;
    assert_error(&r, 404, "twin_not_found");
    let b = get_ok(&c, &format!("/v1/twins/{twin}?at_seq=999999")).await;
    assert_eq!(b["state"], expected[2]);

    let events = history(&c, twin).await;
    assert_eq!(events.len(), 3);
    for (e, want) in events.iter().zip(&expected) {
        let hlc = e["hlc"].as_str().unwrap();
        let b = get_ok(&c, &format!("/v1/twins/{twin}?at_hlc={hlc}")).await;
        assert_eq!(&b["state"], want, "at_hlc={hlc}");
        assert_eq!(b["version"], e["seq"]);
    }

    // Time travel does not answer 304 to the latest ETag.
    let url = format!("{}/v1/twins/{twin}?at_seq={}", c.base, seqs[0]);
    let r = send(
        c.http
            .get(&url)
            .header("if-none-match", format!("\"{}\"", seqs[2])),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["state"], expected[0]);
    // ...but to its own (issue 18): `?at_seq=` and `?at_hlc=` are resources
    // of their own (RFC 9110 13.1.2), and the 304 carries the ETag.
    let own = r.headers["etag"].to_str().unwrap().to_owned();
    assert_eq!(own, format!("\"{}\"", seqs[0]));
    let r = send(c.http.get(&url).header("if-none-match", &own)).await;
    assert_eq!(r.status, 304, "{:?}", r.body);
    assert_eq!(r.headers["etag"].to_str().unwrap(), own);
    let hlc = events[0]["hlc"].as_str().unwrap();
    let r = send(
        c.http
            .get(format!("{}/v1/twins/{twin}?at_hlc={hlc}", c.base))
            .header("if-none-match", format!("W/{own}")),
    )
    .await;
    assert_eq!(r.status, 304, "at_hlc with its own weak ETag: {:?}", r.body);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_with_after_and_limit() {
    let (_dir, server, c) = start().await;
    let twin = "pages";
    let t = token_of(&c.acquire("twin/pages", "A", 60_000).await);
    for i in 0..5 {
        assert_eq!(
            c.put(twin, t, &format!("e-{i}"), json!({"i": i}))
                .await
                .status,
            201
        );
    }
    let mut after = 0;
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let b = get_ok(
            &c,
            &format!("/v1/twins/{twin}/events?after={after}&limit=2"),
        )
        .await;
        let events = b["events"].as_array().unwrap();
        if events.is_empty() {
            assert_eq!(b["next_after"], Value::Null);
            break;
        }
        assert!(events.len() <= 2);
        pages += 1;
        for e in events {
            assert!(e["seq"].as_u64().unwrap() > after);
            assert_eq!(e["twin_id"], twin);
            assert_eq!(e["writer"], "A");
            assert_eq!(e["token"], t);
            assert_eq!(e["type"], "update");
            seen.push(e["event_id"].as_str().unwrap().to_owned());
        }
        assert_eq!(b["next_after"], events.last().unwrap()["seq"]);
        after = b["next_after"].as_u64().unwrap();
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, ["e-0", "e-1", "e-2", "e-3", "e-4"]);
    // A twin without events has an empty history, not an error.
    let b = get_ok(&c, "/v1/twins/never/events").await;
    assert_eq!(b["events"], json!([]));

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_list_and_partition_tail() {
    let (_dir, server, c) = start().await;
    let p = 4;
    let (t1, t2) = (twin_in(p, "pt-a"), twin_in(p, "pt-b"));

    let b = get_ok(&c, "/v1/partitions").await;
    let list = b["partitions"].as_array().unwrap();
    assert_eq!(list.len(), 16);
    for (i, e) in list.iter().enumerate() {
        assert_eq!(e["partition"], i);
        assert_eq!(e["fence"], 0);
        assert_eq!(e["head"], 0);
        assert_eq!(e["owner"], Value::Null);
    }

    let tp = token_of(&c.acquire(&format!("partition/{p}"), "P", 60_000).await);
    let s1 = c.put(&t1, tp, "e-1", json!({"a": 1})).await.body["seqs"][0]
        .as_u64()
        .unwrap();
    let s2 = c.put(&t2, tp, "e-1", json!({"b": 1})).await.body["seqs"][0]
        .as_u64()
        .unwrap();
    let s3 = c.put(&t1, tp, "e-2", json!({"a": 2})).await.body["seqs"][0]
        .as_u64()
        .unwrap();
    assert!(s1 < s2 && s2 < s3);

    let b = get_ok(&c, "/v1/partitions").await;
    assert_eq!(b["last_token"], tp);
    for e in b["partitions"].as_array().unwrap() {
        if e["partition"] == p {
            assert_eq!(e["fence"], tp);
            assert_eq!(e["head"], s3);
            assert_eq!(e["owner"]["holder"], "P");
            assert_eq!(e["owner"]["token"], tp);
            assert_eq!(e["owner"]["scope"], format!("partition/{p}"));
            assert!(e["owner"]["expires_in_ms"].as_u64().unwrap() <= 60_000);
        } else {
            assert_eq!(e["head"], 0);
            assert_eq!(e["owner"], Value::Null);
        }
    }

    let b = get_ok(&c, &format!("/v1/partitions/{p}/events?after=0")).await;
    let seqs: Vec<u64> = b["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [s1, s2, s3]);
    assert_eq!(b["next_after"], s3);
    let b = get_ok(&c, &format!("/v1/partitions/{p}/events?after={s1}&limit=1")).await;
    assert_eq!(b["events"][0]["seq"], s2);
    assert_eq!(b["events"][0]["twin_id"], t2.as_str());
    assert_eq!(b["events"].as_array().unwrap().len(), 1);
    let b = get_ok(&c, &format!("/v1/partitions/{p}/events?after={s3}")).await;
    assert_eq!(b["events"], json!([]));
    let b = get_ok(&c, "/v1/partitions/0/events").await;
    assert_eq!(b["events"], json!([]));

    assert_error(
        &c.get("/v1/partitions/99/events").await,
        404,
        "unknown_partition",
    );
    assert_error(
        &c.get("/v1/partitions/16/events").await,
        404,
        "unknown_partition",
    );

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_stale_rejection_metric() {
    let (_dir, server, c, clock) = start_clocked().await;
    let r = c.get("/healthz").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "ok");

    let metrics = |c: Client| async move {
        let r = c
            .http
            .get(format!("{}/metrics", c.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    };
    let before = stale_rejections(&metrics(c.clone()).await);

    let a = token_of(&c.acquire("twin/m", "A", 200).await);
    clock.advance(Duration::from_millis(260));
    let b = token_of(&c.acquire("twin/m", "B", 60_000).await);
    assert_eq!(c.put("m", b, "b-1", json!({"v": 1})).await.status, 201);
    assert_eq!(c.put("m", a, "a-1", json!({"v": 0})).await.status, 409);
    assert_eq!(c.put("m", a, "a-2", json!({"v": 0})).await.status, 409);

    let text = metrics(c.clone()).await;
    assert_eq!(stale_rejections(&text), before + 2, "{text}");
    assert!(text.contains("palisade_append_requests_total 1"), "{text}");

    server.stop().await;
}

/// State order is the HLC, not arrival: the later HLC wins even if it arrives first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_hlc_wins_regardless_of_arrival() {
    let (_dir, server, c) = start().await;
    let twin = "hlc-1";
    let t = token_of(&c.acquire("twin/hlc-1", "A", 60_000).await);
    let clock = Clock::new(Duration::from_millis(500));
    let (early, late) = (clock.now().to_string(), clock.now().to_string());

    let ev = |mode: &str, hlc: &str, id: &str| json!({"type": "set", "patch": {"mode": mode}, "hlc": hlc, "event_id": id});
    let r = c.append(twin, t, &ev("late", &late, "late")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = c.append(twin, t, &ev("early", &early, "early")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);

    let b = c.twin(twin).await.body;
    assert_eq!(b["state"], json!({"mode": "late"}));
    assert_eq!(b["hlc"]["/mode"], late.as_str());

    // History is in arrival order, with the HLCs as sent.
    let events = history(&c, twin).await;
    assert_eq!(events[0]["hlc"], late.as_str());
    assert_eq!(events[1]["hlc"], early.as_str());
    // As of the early HLC only the early event counts, although it arrived last.
    let b = get_ok(&c, &format!("/v1/twins/{twin}?at_hlc={early}")).await;
    assert_eq!(b["state"], json!({"mode": "early"}));
    let b = get_ok(&c, &format!("/v1/twins/{twin}?at_hlc={late}")).await;
    assert_eq!(b["state"], json!({"mode": "late"}));

    // An event without an HLC is stamped by the store after both.
    assert_eq!(
        c.put(twin, t, "now", json!({"mode": "now"})).await.status,
        201
    );
    assert_eq!(c.twin(twin).await.body["state"], json!({"mode": "now"}));

    server.stop().await;
}
