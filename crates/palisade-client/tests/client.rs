//! The client against a real store served over real HTTP on a loopback port.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use palisade_client::{
    Client, ClientError, Event, EventStream, LeaseOptions, StoredEvent, WatchFrom,
};
use palisade_http::HttpConfig;
use palisade_log::{Store, StoreConfig};
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::time::{sleep, timeout, Instant};

/// A store in a temporary folder, served by the real router on 127.0.0.1:0.
struct Server {
    base: String,
    store: Arc<Store>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path(), StoreConfig::default()).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(palisade_http::run(
            listener,
            store.clone(),
            HttpConfig::default(),
            async {
                let _ = rx.await;
            },
        ));
        Self {
            base,
            store,
            stop: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    fn client(&self) -> Client {
        Client::new(&self.base).unwrap()
    }

    /// Stop serving (the port closes), then close the store.
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
        self.store.close().await;
    }
}

const LONG: Duration = Duration::from_secs(30);

fn ev(n: u64) -> Event {
    Event::new("update", json!({ "n": n }))
}

#[tokio::test]
async fn acquire_append_read_round_trip() {
    let srv = Server::start().await;
    let c = srv.client();
    let grant = c.acquire("twin/pump-1", "worker-a", LONG).await.unwrap();
    assert_eq!(grant.scope, "twin/pump-1");
    assert_eq!(grant.holder, "worker-a");
    assert_eq!(grant.ttl_ms, 30_000);
    assert_eq!(grant.lease_id.len(), 32);
    assert!(grant.token > 0);

    assert_eq!(c.twin("pump-1").await.unwrap(), None);
    let done = c
        .append(
            "pump-1",
            grant.token,
            &[
                Event::new("set", json!({ "rpm": 1200, "site": { "hall": 3 } })).with_id("e-1"),
                Event::new("set", json!({ "rpm": 1300 })),
            ],
        )
        .await
        .unwrap();
    assert_eq!(done.seqs.len(), 2);
    assert!(done.seqs[0] < done.seqs[1]);
    assert_eq!(done.duplicates, 0);
    assert_eq!(done.fence, grant.token);
    assert_eq!(done.version, done.seqs[1]);

    let twin = c.twin("pump-1").await.unwrap().unwrap();
    assert_eq!(twin.twin_id, "pump-1");
    assert_eq!(twin.partition, done.partition);
    assert_eq!(twin.version, done.version);
    assert_eq!(twin.fence, grant.token);
    assert_eq!(twin.state, json!({ "rpm": 1300, "site": { "hall": 3 } }));
    assert!(twin.hlc.contains_key("/rpm"), "{:?}", twin.hlc);

    let events = c.events("pump-1", 0, 10).await.unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].seq, done.seqs[0]);
    assert_eq!(events[0].event_id, "e-1");
    assert_eq!(events[0].event_type, "set");
    assert_eq!(
        events[0].patch,
        json!({ "rpm": 1200, "site": { "hall": 3 } })
    );
    assert_eq!(events[0].writer, "worker-a");
    assert_eq!(events[0].token, grant.token);
    assert!(
        !events[1].event_id.is_empty(),
        "the store names id-less events"
    );
    // Paging: after the first seq, only the second; limit caps the page.
    let rest = c.events("pump-1", events[0].seq, 10).await.unwrap();
    assert_eq!(rest, events[1..]);
    assert_eq!(c.events("pump-1", 0, 1).await.unwrap(), events[..1]);

    // Twin ids that need URL encoding.
    let odd = "hall 3/pump #7?";
    let g = c.acquire(&format!("twin/{odd}"), "w", LONG).await.unwrap();
    c.append(odd, g.token, &[ev(1)]).await.unwrap();
    assert_eq!(c.twin(odd).await.unwrap().unwrap().twin_id, odd);
    assert_eq!(c.events(odd, 0, 10).await.unwrap()[0].twin_id, odd);
    srv.stop().await;
}

#[tokio::test]
async fn stale_token_is_a_typed_error_after_a_takeover() {
    let srv = Server::start().await;
    let c = srv.client();
    let a = c
        .acquire("twin/t1", "a", Duration::from_millis(200))
        .await
        .unwrap();
    c.append("t1", a.token, &[ev(1)]).await.unwrap();
    sleep(Duration::from_millis(300)).await;
    let b = c.acquire("twin/t1", "b", LONG).await.unwrap();
    assert!(b.token > a.token);
    // The fence is raised at the grant, before b writes anything.
    match c.append("t1", a.token, &[ev(2)]).await {
        Err(ClientError::Stale { token, fence }) => {
            assert_eq!((token, fence), (a.token, b.token));
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    c.append("t1", b.token, &[ev(3)]).await.unwrap();
    // The refused write changed nothing.
    let events = c.events("t1", 0, 10).await.unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[1].writer, "b");
    srv.stop().await;
}

#[tokio::test]
async fn lease_held_renew_and_release() {
    let srv = Server::start().await;
    let c = srv.client();
    let a = c.acquire("twin/t2", "a", LONG).await.unwrap();
    match c.acquire("twin/t2", "b", LONG).await {
        Err(ClientError::LeaseHeld {
            holder,
            expires_in_ms,
        }) => {
            assert_eq!(holder, "a");
            assert!(expires_in_ms > 0 && expires_in_ms <= 30_000);
        }
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    let renewed = c.renew(&a.lease_id).await.unwrap();
    assert_eq!(renewed.token, a.token);
    assert_eq!(renewed.lease_id, a.lease_id);
    c.release(&a.lease_id).await.unwrap();
    // Released: the scope is free at once, and the old lease is gone.
    c.acquire("twin/t2", "b", LONG).await.unwrap();
    for r in [
        c.renew(&a.lease_id).await.map(drop),
        c.release(&a.lease_id).await,
    ] {
        assert!(
            matches!(&r, Err(ClientError::LeaseGone { reason }) if reason == "lease_released"),
            "{r:?}"
        );
    }
    let unknown = "0123456789abcdef0123456789abcdef";
    assert!(matches!(
        c.renew(unknown).await,
        Err(ClientError::LeaseGone { reason }) if reason == "lease_not_found"
    ));
    // Other refusals keep the server's error name.
    match c.acquire("nonsense", "a", LONG).await {
        Err(ClientError::Api { status, error, .. }) => {
            assert_eq!((status, error.as_str()), (400, "bad_scope"))
        }
        other => panic!("{other:?}"),
    }
    srv.stop().await;
}

#[tokio::test]
async fn append_if_match_checks_the_version() {
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/t3", "a", LONG).await.unwrap();
    let first = c.append("t3", g.token, &[ev(1)]).await.unwrap();
    match c
        .append_if_match("t3", g.token, first.version + 1, &[ev(2)])
        .await
    {
        Err(e @ ClientError::Api { .. }) => {
            assert_eq!(e.status(), Some(412));
            assert_eq!(e.error_name(), Some("version_mismatch"));
        }
        other => panic!("expected 412, got {other:?}"),
    }
    let second = c
        .append_if_match("t3", g.token, first.version, &[ev(2)])
        .await
        .unwrap();
    assert!(second.version > first.version);
    srv.stop().await;
}

#[tokio::test]
async fn resent_batch_with_event_ids_is_acknowledged_as_duplicates() {
    // The property the append retry relies on.
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/t4", "a", LONG).await.unwrap();
    let batch: Vec<Event> = (0..3).map(|n| ev(n).with_id(format!("id-{n}"))).collect();
    let first = c.append("t4", g.token, &batch).await.unwrap();
    assert_eq!(first.duplicates, 0);
    let again = c.append("t4", g.token, &batch).await.unwrap();
    assert_eq!(again.duplicates, 3);
    assert_eq!(again.seqs, first.seqs);
    assert_eq!(again.version, first.version);
    // Partly new: only the new one is appended.
    let mixed = [batch[2].clone(), ev(9).with_id("id-9")];
    let m = c.append("t4", g.token, &mixed).await.unwrap();
    assert_eq!(m.duplicates, 1);
    assert_eq!(m.seqs[0], first.seqs[2]);
    assert_eq!(c.events("t4", 0, 100).await.unwrap().len(), 4);
    srv.stop().await;
}

/// A "server" that reads each request and hangs up without answering: the
/// request may have landed, the client cannot know. Counts connections.
async fn hang_up_server() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            drop(sock);
        }
    });
    (base, hits)
}

#[tokio::test]
async fn append_retries_transport_errors_only_when_every_event_has_an_id() {
    let (base, hits) = hang_up_server().await;
    let c = Client::new(&base).unwrap();
    let with_ids = [ev(1).with_id("a"), ev(2).with_id("b")];
    let r = c.append("t", 1, &with_ids).await;
    assert!(matches!(r, Err(ClientError::Transport(_))), "{r:?}");
    assert_eq!(hits.swap(0, Ordering::SeqCst), 3, "idempotent: 3 attempts");

    let one_without = [ev(1).with_id("a"), ev(2)];
    let r = c.append("t", 1, &one_without).await;
    assert!(matches!(r, Err(ClientError::Transport(_))), "{r:?}");
    assert_eq!(
        hits.swap(0, Ordering::SeqCst),
        1,
        "not idempotent: no retry"
    );

    // append_if_match never retries (the version check precedes the dedupe).
    let r = c.append_if_match("t", 1, 0, &with_ids).await;
    assert!(matches!(r, Err(ClientError::Transport(_))), "{r:?}");
    assert_eq!(hits.swap(0, Ordering::SeqCst), 1);
}

#[tokio::test]
async fn no_retry_on_an_http_refusal() {
    let srv = Server::start().await;
    let c = srv.client();
    // Token 999 was never issued: a 403 comes back once, not retried.
    let r = c.append("t5", 999, &[ev(1).with_id("x")]).await;
    match r {
        Err(ClientError::Api { status, error, .. }) => {
            assert_eq!((status, error.as_str()), (403, "token_not_issued"));
        }
        other => panic!("{other:?}"),
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_guard_keeps_a_lease_alive_past_its_ttl() {
    let srv = Server::start().await;
    let c = srv.client();
    let ttl = Duration::from_millis(300);
    let guard = c
        .lease("twin/g1", "a", ttl, LeaseOptions::default())
        .await
        .unwrap();
    assert_eq!(guard.scope(), "twin/g1");
    assert_eq!(guard.holder(), "a");
    sleep(Duration::from_secs(1)).await;
    assert!(!guard.is_lost());
    match c.acquire("twin/g1", "b", ttl).await {
        Err(ClientError::LeaseHeld { holder, .. }) => assert_eq!(holder, "a"),
        other => panic!("expected LeaseHeld after 1 s of a 300 ms lease, got {other:?}"),
    }
    let done = guard.append("g1", &[ev(1)]).await.unwrap();
    assert_eq!(done.fence, guard.token());
    // Released: the scope is free at once.
    guard.release().await.unwrap();
    c.acquire("twin/g1", "b", ttl).await.unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_when_the_lease_is_released_from_outside() {
    let srv = Server::start().await;
    let c = srv.client();
    let ttl = Duration::from_millis(300);
    let guard = c
        .lease("twin/g2", "a", ttl, LeaseOptions::default())
        .await
        .unwrap();
    let mut watch = guard.lost_watch();
    assert!(!*watch.borrow());
    c.release(guard.id()).await.unwrap();
    timeout(ttl, guard.lost())
        .await
        .expect("lost() within the ttl after the lease was released");
    assert!(guard.is_lost());
    guard.lost().await; // again: resolves at once
    timeout(Duration::from_millis(10), watch.wait_for(|l| *l))
        .await
        .unwrap()
        .unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_when_the_lease_is_superseded_and_the_old_token_is_fenced() {
    let srv = Server::start().await;
    let c = srv.client();
    let ttl = Duration::from_millis(300);
    let guard = c
        .lease("twin/g3", "a", ttl, LeaseOptions::default())
        .await
        .unwrap();
    // The same holder acquiring again supersedes the guard's lease.
    let newer = c.acquire("twin/g3", "a", LONG).await.unwrap();
    timeout(ttl, guard.lost())
        .await
        .expect("lost() within the ttl after the lease was superseded");
    match guard.append("g3", &[ev(1)]).await {
        Err(ClientError::Stale { token, fence }) => {
            assert_eq!((token, fence), (guard.token(), newer.token));
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_within_the_ttl_when_the_server_goes_away() {
    let srv = Server::start().await;
    let c = srv.client();
    let ttl = Duration::from_millis(400);
    let guard = c
        .lease("twin/g4", "a", ttl, LeaseOptions::default())
        .await
        .unwrap();
    sleep(Duration::from_millis(500)).await;
    assert!(!guard.is_lost(), "renewed while the server was up");
    let stopped = Instant::now();
    srv.stop().await;
    // Renewals now fail to connect; the guard retries, then gives up when
    // the ttl since its last successful renewal has passed.
    timeout(ttl + Duration::from_millis(300), guard.lost())
        .await
        .expect("lost() within about the ttl after the server went away");
    let took = stopped.elapsed();
    assert!(took <= ttl + Duration::from_millis(300), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_guard_stops_renewing_without_releasing() {
    let srv = Server::start().await;
    let c = srv.client();
    let ttl = Duration::from_millis(300);
    let guard = c
        .lease(
            "twin/g5",
            "a",
            ttl,
            LeaseOptions {
                renew_every: Some(Duration::from_millis(50)),
                ..LeaseOptions::default()
            },
        )
        .await
        .unwrap();
    let watch = guard.lost_watch();
    let id = guard.id().to_owned();
    drop(guard);
    assert!(
        *watch.borrow(),
        "watchers learn that nobody renews any more"
    );
    // Not released: still held until the ttl runs out.
    assert!(matches!(
        c.acquire("twin/g5", "b", ttl).await,
        Err(ClientError::LeaseHeld { .. })
    ));
    sleep(ttl + Duration::from_millis(100)).await;
    assert!(matches!(
        c.renew(&id).await,
        Err(ClientError::LeaseGone { reason }) if reason == "lease_expired"
    ));
    c.acquire("twin/g5", "b", ttl).await.unwrap();
    srv.stop().await;
}

#[tokio::test]
async fn twin_at_seq_and_at_hlc_return_the_older_state() {
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/tt", "a", LONG).await.unwrap();
    let mut seqs = Vec::new();
    for (rpm, extra) in [
        (1, json!({"site": "a"})),
        (2, json!({})),
        (3, json!({"site": null})),
    ] {
        let mut patch = extra;
        patch["rpm"] = json!(rpm);
        let done = c
            .append("tt", g.token, &[Event::new("set", patch)])
            .await
            .unwrap();
        seqs.push(done.seqs[0]);
    }
    let now = c.twin("tt").await.unwrap().unwrap();
    assert_eq!(now.state, json!({ "rpm": 3 }));
    assert_eq!(now.version, seqs[2]);

    let first = c.twin_at_seq("tt", seqs[0]).await.unwrap().unwrap();
    assert_eq!(first.state, json!({ "rpm": 1, "site": "a" }));
    assert_eq!(first.version, seqs[0]);
    assert_eq!(first.fence, g.token, "the fence is always the current one");
    let second = c.twin_at_seq("tt", seqs[1]).await.unwrap().unwrap();
    assert_eq!(second.state, json!({ "rpm": 2, "site": "a" }));
    assert_eq!(second.version, seqs[1]);
    // Before its first event the twin did not exist.
    assert_eq!(c.twin_at_seq("tt", seqs[0] - 1).await.unwrap(), None);

    // By HLC: each stored event's HLC gives the state it produced.
    let events = c.events("tt", 0, 10).await.unwrap();
    for (ev, want) in events.iter().zip([
        json!({ "rpm": 1, "site": "a" }),
        json!({ "rpm": 2, "site": "a" }),
        json!({ "rpm": 3 }),
    ]) {
        let at = c.twin_at_hlc("tt", &ev.hlc).await.unwrap().unwrap();
        assert_eq!(at.state, want, "at_hlc={}", ev.hlc);
        assert_eq!(at.version, ev.seq);
    }
    // An HLC before any event: nothing yet; text that is no HLC: 400.
    assert_eq!(c.twin_at_hlc("tt", "1/1").await.unwrap(), None);
    match c.twin_at_hlc("tt", "yesterday").await {
        Err(ClientError::Api { status, error, .. }) => {
            assert_eq!((status, error.as_str()), (400, "bad_hlc"))
        }
        other => panic!("{other:?}"),
    }
    // Time travel needs URL-encoded twin ids too.
    let odd = "a/b c?";
    let g2 = c.acquire(&format!("twin/{odd}"), "a", LONG).await.unwrap();
    let d = c.append(odd, g2.token, &[ev(1)]).await.unwrap();
    c.append(odd, g2.token, &[ev(2)]).await.unwrap();
    let then = c.twin_at_seq(odd, d.seqs[0]).await.unwrap().unwrap();
    assert_eq!(
        (then.twin_id.as_str(), then.state.clone()),
        (odd, json!({ "n": 1 }))
    );
    srv.stop().await;
}

#[tokio::test]
async fn shadow_delta_is_returned_now_and_at_a_past_seq() {
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/thermo", "a", LONG).await.unwrap();
    let first = c
        .append(
            "thermo",
            g.token,
            &[Event::new(
                "shadow",
                json!({
                    "desired": { "temp": 21, "mode": "eco", "fan": { "speed": 2, "on": true } },
                    "reported": { "temp": 19, "mode": "eco", "fan": { "speed": 2 } }
                }),
            )],
        )
        .await
        .unwrap();
    let want = json!({ "temp": 21, "fan": { "on": true } });
    let t = c.twin("thermo").await.unwrap().unwrap();
    assert_eq!(t.delta, Some(want.clone()));
    // The device catches up: nothing differs any more.
    c.append(
        "thermo",
        g.token,
        &[Event::new(
            "report",
            json!({ "reported": { "temp": 21, "fan": { "on": true } } }),
        )],
    )
    .await
    .unwrap();
    assert_eq!(c.twin("thermo").await.unwrap().unwrap().delta, None);
    // The delta as it was.
    let then = c
        .twin_at_seq("thermo", first.version)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(then.delta, Some(want));
    // Not a shadow document: no delta.
    let g2 = c.acquire("twin/plain", "a", LONG).await.unwrap();
    c.append("plain", g2.token, &[ev(1)]).await.unwrap();
    assert_eq!(c.twin("plain").await.unwrap().unwrap().delta, None);
    srv.stop().await;
}

#[tokio::test]
async fn partitions_list_fence_head_and_owner() {
    let srv = Server::start().await;
    let c = srv.client();
    let empty = c.partitions().await.unwrap();
    assert_eq!(empty.last_token, 0);
    assert_eq!(empty.partitions.len(), srv.store.partitions() as usize);
    for (i, p) in empty.partitions.iter().enumerate() {
        assert_eq!(p.partition as usize, i);
        assert_eq!((p.fence, p.head, p.owner.clone()), (0, 0, None));
    }

    let tw = c.acquire("twin/pp", "a", LONG).await.unwrap();
    let done = c.append("pp", tw.token, &[ev(1), ev(2)]).await.unwrap();
    let p = done.partition;
    let owner = c
        .acquire(&format!("partition/{p}"), "owner-b", LONG)
        .await
        .unwrap();
    let list = c.partitions().await.unwrap();
    assert_eq!(list.last_token, owner.token);
    let info = &list.partitions[p as usize];
    assert_eq!(info.partition, p);
    assert_eq!(info.head, done.seqs[1]);
    assert_eq!(info.fence, owner.token);
    let o = info.owner.clone().expect("a live partition lease");
    assert_eq!(
        (o.lease_id.as_str(), o.scope.as_str(), o.holder.as_str()),
        (owner.lease_id.as_str(), owner.scope.as_str(), "owner-b")
    );
    assert_eq!((o.token, o.ttl_ms), (owner.token, 30_000));
    assert!(o.expires_in_ms > 0 && o.expires_in_ms <= 30_000);
    // The other partitions are untouched.
    for other in list.partitions.iter().filter(|i| i.partition != p) {
        assert_eq!((other.head, other.owner.clone()), (0, None));
    }
    // Released: no owner any more.
    c.release(&owner.lease_id).await.unwrap();
    assert_eq!(
        c.partitions().await.unwrap().partitions[p as usize].owner,
        None
    );
    srv.stop().await;
}

/// The next `n` events of `s`, failing on an error or after `LONG`.
async fn take(s: &mut EventStream, n: usize) -> Vec<StoredEvent> {
    let mut out = Vec::new();
    while out.len() < n {
        match timeout(LONG, s.next()).await {
            Ok(Some(Ok(ev))) => out.push(ev),
            other => panic!("after {} of {n} events: {other:?}", out.len()),
        }
    }
    out
}

/// Nothing more arrives on `s` for a while.
async fn quiet(s: &mut EventStream) {
    if let Ok(item) = timeout(Duration::from_millis(300), s.next()).await {
        panic!("expected nothing more, got {item:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_twin_streams_appends_in_order_and_resumes_without_gap_or_duplicate() {
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/w1", "a", LONG).await.unwrap();
    let other = c.acquire("twin/w2", "a", LONG).await.unwrap();
    // Before the stream opens: not in a stream that starts now.
    c.append("w1", g.token, &[ev(0)]).await.unwrap();

    let mut live = c.watch_twin("w1", WatchFrom::Now).await.unwrap();
    assert_eq!(live.last_event_id(), None);
    assert_eq!(live.resume_from(), WatchFrom::Now);
    c.append("w1", g.token, &[ev(1), ev(2)]).await.unwrap();
    c.append("w2", other.token, &[ev(99)]).await.unwrap(); // another twin
    c.append("w1", g.token, &[ev(3)]).await.unwrap();
    let got = take(&mut live, 3).await;
    let stored = c.events("w1", 0, 100).await.unwrap();
    assert_eq!(got, stored[1..], "the appended events, in order, as stored");
    quiet(&mut live).await;
    assert_eq!(live.last_event_id(), Some(stored[3].seq));

    // Resume after the second streamed event: the third, then new ones.
    let mut resumed = c
        .watch_twin("w1", WatchFrom::After(got[1].seq))
        .await
        .unwrap();
    c.append("w1", g.token, &[ev(4)]).await.unwrap();
    let again = take(&mut resumed, 2).await;
    let stored = c.events("w1", 0, 100).await.unwrap();
    assert_eq!(again, stored[3..5]);
    quiet(&mut resumed).await;
    // The first stream saw the new one too, and resuming from where it
    // stands gives nothing already seen.
    assert_eq!(take(&mut live, 1).await, stored[4..5]);
    let from = live.resume_from();
    assert_eq!(from, WatchFrom::After(stored[4].seq));
    drop(live);
    c.append("w1", g.token, &[ev(5)]).await.unwrap();
    let mut next = c.watch_twin("w1", from).await.unwrap();
    let stored = c.events("w1", 0, 100).await.unwrap();
    assert_eq!(take(&mut next, 1).await, stored[5..6]);
    quiet(&mut next).await;

    // After(0): the whole history first.
    let mut all = c.watch_twin("w1", WatchFrom::After(0)).await.unwrap();
    assert_eq!(take(&mut all, stored.len()).await, stored);
    quiet(&mut all).await;

    // The server shutting down ends the stream.
    srv.stop().await;
    match timeout(LONG, next.next()).await {
        Ok(None | Some(Err(ClientError::Transport(_)))) => {}
        other => panic!("expected the stream to end, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_partition_streams_every_twin_of_the_partition() {
    let srv = Server::start().await;
    let c = srv.client();
    let g = c.acquire("twin/pw", "a", LONG).await.unwrap();
    let done = c.append("pw", g.token, &[ev(1), ev(2)]).await.unwrap();
    let p = done.partition;
    // Find a second twin in the same partition.
    let mut mate = None;
    for n in 0..1000 {
        let id = format!("mate-{n}");
        let gm = c.acquire(&format!("twin/{id}"), "a", LONG).await.unwrap();
        let d = c.append(&id, gm.token, &[ev(10)]).await.unwrap();
        if d.partition == p {
            mate = Some((id, gm.token));
            break;
        }
    }
    let (mate, mate_token) = mate.expect("a twin in the same partition");
    let mut s = c.watch_partition(p, WatchFrom::After(0)).await.unwrap();
    let mut stored = c.events("pw", 0, 100).await.unwrap();
    stored.extend(c.events(&mate, 0, 100).await.unwrap());
    let got = take(&mut s, 3).await;
    assert_eq!(got, stored);
    c.append(&mate, mate_token, &[ev(11)]).await.unwrap();
    c.append("pw", g.token, &[ev(3)]).await.unwrap();
    let live = take(&mut s, 2).await;
    assert_eq!(
        live.iter().map(|e| e.twin_id.as_str()).collect::<Vec<_>>(),
        [mate.as_str(), "pw"]
    );
    assert!(live[0].seq < live[1].seq && got[2].seq < live[0].seq);
    quiet(&mut s).await;
    // Resume mid-way: exactly what followed.
    let mut r = c
        .watch_partition(p, WatchFrom::After(got[1].seq))
        .await
        .unwrap();
    let rest = take(&mut r, 3).await;
    assert_eq!(rest, [&got[2..], &live[..]].concat());
    quiet(&mut r).await;

    match c.watch_partition(9999, WatchFrom::Now).await {
        Err(ClientError::Api { status, error, .. }) => {
            assert_eq!((status, error.as_str()), (404, "unknown_partition"))
        }
        other => panic!("{other:?}"),
    }
    srv.stop().await;
}
