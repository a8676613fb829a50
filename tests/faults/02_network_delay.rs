//! The reference article's scenario 3: network delay instead of a pause.
//! Writer A talks to the store through a delaying TCP proxy on loopback
//! (part of this test); the proxy holds A's bytes while the test acts.
//!
//! - Lease lost: everything of A (appends and renewals) is held; A's lease
//!   runs out, B acquires directly and writes; the held append then reaches
//!   the store late and must be refused, as every later one; B's state stands.
//! - Lease alive: only A's appends go through the proxy, its renewals go
//!   direct and keep the lease live; one append is held for two TTLs and
//!   must then be accepted. The fence decides, not the clock.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::{token_of, ServeProcess};
use crate::{
    acked, assert_superseded, attempts, history, rounds, twin_version, wait_until, Line,
    Superseded, Writer, WriterArgs,
};

const WAIT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Holds {
    /// Hold every client-to-store chunk while the gate is closed.
    all: AtomicBool,
    /// Hold the next client-to-store chunk (one) until the gate opens.
    one: AtomicBool,
    /// Chunks held so far, and how many of them began an append request.
    held: AtomicUsize,
    held_appends: AtomicUsize,
}

/// A TCP proxy on 127.0.0.1:0 in front of the store that can hold the
/// client-to-store direction. A held connection's later bytes queue behind
/// the held chunk, as on a congested link; the other direction flows.
struct DelayProxy {
    url: String,
    holds: Arc<Holds>,
    gate: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl DelayProxy {
    async fn start(upstream: &str) -> Self {
        let upstream: SocketAddr = upstream.strip_prefix("http://").unwrap().parse().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let holds = Arc::new(Holds::default());
        let (gate, _) = watch::channel(true);
        let (h, g) = (holds.clone(), gate.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (h, gate) = (h.clone(), g.subscribe());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, mut cw) = client.into_split();
                    let (mut sr, sw) = server.into_split();
                    let up = pump_held(cr, sw, &h, gate);
                    let down = tokio::io::copy(&mut sr, &mut cw);
                    let _ = tokio::join!(up, down);
                });
            }
        });
        Self {
            url,
            holds,
            gate,
            task,
        }
    }

    /// Hold all client-to-store traffic until [`release`](Self::release).
    fn hold_all(&self) {
        self.gate.send_replace(false);
        self.holds.all.store(true, SeqCst);
    }

    /// Hold the next client-to-store chunk until [`release`](Self::release).
    fn hold_next(&self) {
        self.gate.send_replace(false);
        self.holds.one.store(true, SeqCst);
    }

    fn release(&self) {
        self.holds.all.store(false, SeqCst);
        self.holds.one.store(false, SeqCst);
        self.gate.send_replace(true);
    }

    fn held_appends(&self) -> usize {
        self.holds.held_appends.load(SeqCst)
    }

    /// Hold traffic (all of it, or only the next chunk) and wait until an
    /// append is caught in the hold.
    async fn hold_an_append(&self, all: bool) {
        let before = self.held_appends();
        if all {
            self.hold_all();
        } else {
            self.hold_next();
        }
        wait_until("an append of A held in the proxy", WAIT, || {
            self.held_appends() > before
        })
        .await;
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.release();
        self.task.abort();
    }
}

async fn pump_held(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    holds: &Holds,
    mut gate: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        if holds.all.load(SeqCst) || holds.one.swap(false, SeqCst) {
            holds.held.fetch_add(1, SeqCst);
            if buf[..n].starts_with(b"POST /v1/twins/") {
                holds.held_appends.fetch_add(1, SeqCst);
            }
            let _ = gate.wait_for(|open| *open).await;
        }
        to.write_all(&buf[..n]).await?;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_write_after_the_lease_is_lost_is_fenced() {
    const TTL_MS: u64 = 1_000;
    const A_STALE: u64 = 5;
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(&dir.path().join("data"), &[]);
    let c = store.client();
    let proxy = DelayProxy::start(&store.base).await;
    for round in 0..rounds() {
        let twin = format!("delay-lost-{round}");
        // Appends and renewals through the proxy.
        let a = Writer::start_acked(
            WriterArgs {
                ttl_ms: TTL_MS,
                interval_ms: 20,
                count: 1_000_000,
                max_stale: Some(A_STALE),
                ..WriterArgs::new(&proxy.url, &twin, "A")
            },
            dir.path().join(format!("lost-a-{round}.acks")),
            3,
        )
        .await;

        proxy.hold_an_append(true).await;
        let held_since = Instant::now();
        // A waits for that append's answer: its earlier answers are recorded.
        let a_lines_before = a.lines().len();
        // The held append was sent under a live lease.
        let r = c.try_acquire(&format!("twin/{twin}"), "probe", 100).await;
        assert_eq!(
            r.status, 409,
            "round {round}: A's lease already gone: {:?}",
            r.body
        );
        let (cut, _) = twin_version(&c, &twin).await.expect("A wrote");

        // B acquires (directly) once A's lease has run out, and writes.
        let b = Writer::start_acked(
            WriterArgs {
                ttl_ms: 10_000,
                interval_ms: 20,
                count: 15,
                start_at: 1_000_000,
                ..WriterArgs::new(&store.base, &twin, "B")
            },
            dir.path().join(format!("lost-b-{round}.acks")),
            1,
        )
        .await;
        // Deliver A's append late: after B wrote, and two TTLs after it was sent.
        let hold = Duration::from_millis(2 * TTL_MS);
        tokio::time::sleep(hold.saturating_sub(held_since.elapsed())).await;
        let delay = held_since.elapsed();
        proxy.release();

        let (a_token, b_token) = (a.token, b.token);
        let (a_lines, a_exited) = a.finish_after(a_lines_before, A_STALE as usize).await;
        let b_lines = b.finish(WAIT).await;
        // The delayed append itself was refused.
        let held = &attempts(&a_lines[a_lines_before..])[0];
        assert!(
            matches!(held, Line::Stale { token, fence, .. } if *token == a_token && *fence >= b_token),
            "round {round}: the delayed append was not refused: {held:?}"
        );
        assert_superseded(Superseded {
            c: &c,
            twin: &twin,
            a: ("A", a_token, &a_lines),
            b: ("B", b_token, &b_lines),
            cut,
            a_lines_before,
            min_stale: A_STALE as usize,
            round,
        })
        .await;
        assert!(
            a_exited,
            "round {round}: A did not stop after {A_STALE} refusals"
        );
        println!(
            "delay round {round}: A token {a_token}: an append held {delay:?} (TTL {TTL_MS} ms), refused on arrival; B token {b_token} acked {}",
            acked(&b_lines).len()
        );
    }
    store.terminate();
}

/// Figure 2's detail: the grant alone fences. A's delayed append reaches the
/// store after B's lease was granted but before B wrote anything: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_write_is_fenced_by_the_grant_alone() {
    const TTL_MS: u64 = 300;
    const A_STALE: u64 = 3;
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(&dir.path().join("data"), &[]);
    let c = store.client();
    let proxy = DelayProxy::start(&store.base).await;
    for round in 0..rounds() {
        let twin = format!("delay-grant-{round}");
        let a = Writer::start_acked(
            WriterArgs {
                ttl_ms: TTL_MS,
                interval_ms: 20,
                count: 1_000_000,
                max_stale: Some(A_STALE),
                ..WriterArgs::new(&proxy.url, &twin, "A")
            },
            dir.path().join(format!("grant-a-{round}.acks")),
            3,
        )
        .await;
        proxy.hold_an_append(true).await;
        let a_lines_before = a.lines().len();
        let (cut, _) = twin_version(&c, &twin).await.expect("A wrote");

        // B takes the lease as soon as A's has run out, and writes nothing yet.
        let start = Instant::now();
        let b_token = loop {
            let r = c.try_acquire(&format!("twin/{twin}"), "B", 10_000).await;
            match r.status {
                201 => break token_of(&r.body),
                409 if start.elapsed() < WAIT => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                _ => panic!("round {round}: acquire by B: {:?}", r.body),
            }
        };
        proxy.release();
        let a_token = a.token;
        let (a_lines, a_exited) = a.finish_after(a_lines_before, A_STALE as usize).await;
        let held = &attempts(&a_lines[a_lines_before..])[0];
        assert!(
            matches!(held, Line::Stale { fence, .. } if *fence == b_token),
            "round {round}: the delayed append was not refused by B's grant: {held:?}"
        );
        assert_eq!(
            twin_version(&c, &twin).await.unwrap().0,
            cut,
            "round {round}"
        );

        // Only now does B write.
        let r = c
            .put(&twin, b_token, "B-0", json!({"n": 0, "by": "B"}))
            .await;
        assert_eq!(r.status, 201, "{:?}", r.body);
        let b_lines = [Line::Ack {
            i: 0,
            token: b_token,
            seq: r.body["seqs"][0].as_u64().unwrap(),
        }];
        assert_superseded(Superseded {
            c: &c,
            twin: &twin,
            a: ("A", a_token, &a_lines),
            b: ("B", b_token, &b_lines),
            cut,
            a_lines_before,
            min_stale: A_STALE as usize,
            round,
        })
        .await;
        assert!(
            a_exited,
            "round {round}: A did not stop after {A_STALE} refusals"
        );
        println!("grant round {round}: A token {a_token}: refused by B's grant ({b_token}) before B wrote");
    }
    store.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_write_under_a_live_lease_is_accepted() {
    const TTL_MS: u64 = 1_000;
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(&dir.path().join("data"), &[]);
    let c = store.client();
    let proxy = DelayProxy::start(&store.base).await;
    for round in 0..rounds() {
        let twin = format!("delay-live-{round}");
        // Appends through the proxy, lease renewals direct.
        let a = Writer::start_acked(
            WriterArgs {
                lease_url: Some(store.base.clone()),
                ttl_ms: TTL_MS,
                interval_ms: 20,
                count: 10,
                ..WriterArgs::new(&proxy.url, &twin, "A")
            },
            dir.path().join(format!("live-a-{round}.acks")),
            3,
        )
        .await;
        proxy.hold_an_append(false).await;
        let a_lines_before = a.lines().len();
        let held_since = Instant::now();
        // Hold it for two TTLs; all along the lease is A's (renewed).
        while held_since.elapsed() < Duration::from_millis(2 * TTL_MS) {
            let r = c.try_acquire(&format!("twin/{twin}"), "B", 100).await;
            assert_eq!(
                r.status, 409,
                "round {round}: A's renewed lease was lost: {:?}",
                r.body
            );
            assert_eq!(r.body["holder"], "A", "{:?}", r.body);
            tokio::time::sleep(Duration::from_millis(TTL_MS / 3)).await;
        }
        let held = held_since.elapsed();
        proxy.release();

        let a_token = a.token;
        let a_lines = a.finish(WAIT).await;
        let all = attempts(&a_lines);
        assert_eq!(all.len(), 10, "round {round}: {a_lines:?}");
        let acks = acked(&all);
        assert_eq!(
            acks.len(),
            all.len(),
            "round {round}: a write under a live lease was refused: {a_lines:?}"
        );
        // The late one is among them, in order.
        assert!(matches!(
            attempts(&a_lines[a_lines_before..])[0],
            Line::Ack { .. }
        ));
        assert!(acks.windows(2).all(|w| w[0].2 < w[1].2), "{acks:?}");
        let events = history(&c, &twin).await;
        let stored: Vec<(u64, u64, u64)> = events
            .iter()
            .map(|e| {
                let id = e["event_id"].as_str().unwrap();
                (
                    id.strip_prefix("A-").unwrap().parse().unwrap(),
                    e["token"].as_u64().unwrap(),
                    e["seq"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(stored, acks, "round {round}");
        let t = c.twin(&twin).await;
        assert_eq!(
            t.body["state"],
            json!({"n": acks.last().unwrap().0, "by": "A"})
        );
        assert_eq!(t.body["fence"], a_token);
        println!(
            "live round {round}: A token {a_token}: an append held {held:?} (TTL {TTL_MS} ms) was accepted"
        );
    }
    store.terminate();
}
