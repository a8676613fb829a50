//! SIGKILL `palisade serve` while three writer processes append to three
//! twins (twin-scoped leases), at a random moment; restart it on the same
//! folder. Every append a writer recorded as acknowledged must be stored
//! exactly once with its seq and token; no fence and no token counter may
//! go down; tokens refused before the crash must be refused after it.
//! Several rounds on the same folder, each killed at a new random point
//! (the seed is printed; `PALISADE_FAULT_SEED` replays it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use crate::support::{lease_id_of, token_of, Client, ServeProcess};
use crate::{acked, attempts, history, partitions, rounds, twin_version, Line, Writer, WriterArgs};

const WRITERS: usize = 3;
/// Event numbers of round r start at r * ROUND_SPAN.
const ROUND_SPAN: u64 = 1_000_000;
const WAIT: Duration = Duration::from_secs(30);

/// xorshift64*: enough randomness for kill points, no dependency.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn seed() -> u64 {
    if let Ok(s) = std::env::var("PALISADE_FAULT_SEED") {
        return s.parse().expect("PALISADE_FAULT_SEED is a u64");
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    // Never zero (xorshift would stay at zero).
    (u64::try_from(nanos & u128::from(u64::MAX)).unwrap() ^ u64::from(std::process::id())) | 1
}

/// What one twin must show after every restart.
#[derive(Default)]
struct TwinExpect {
    /// The writers' acks files, one per round.
    acks: Vec<PathBuf>,
    /// The writer's token per round.
    writer_tokens: Vec<u64>,
    /// `event_id -> (token, seq)` of the test's own acknowledged probes.
    probes: BTreeMap<String, (u64, u64)>,
    /// Tokens refused (409) before a crash.
    stale: Vec<u64>,
    /// The twin's fence before the last crash.
    fence: u64,
}

#[derive(Default)]
struct Expect {
    twins: Vec<TwinExpect>,
    partition_fences: Vec<(u64, u64)>,
    last_token: u64,
}

fn twin(k: usize) -> String {
    format!("crash-{k}")
}

fn holder(k: usize) -> String {
    format!("w{k}")
}

/// Counts for the round's summary line.
#[derive(Default, Debug)]
struct Seen {
    acked: usize,
    stored_unacked: usize,
}

async fn check(c: &Client, exp: &Expect, round: usize) -> Seen {
    let mut seen = Seen::default();
    for (k, te) in exp.twins.iter().enumerate() {
        let (twin, holder) = (twin(k), holder(k));
        let ctx = format!("after crash {round}, twin {twin}");
        let events = history(c, &twin).await;
        let mut by_id = BTreeMap::new();
        let mut last_seq = 0;
        for e in &events {
            let id = e["event_id"].as_str().unwrap().to_owned();
            let seq = e["seq"].as_u64().unwrap();
            let token = e["token"].as_u64().unwrap();
            assert!(seq > last_seq, "{ctx}: seqs out of order at {e}");
            last_seq = seq;
            assert!(
                by_id.insert(id.clone(), (token, seq)).is_none(),
                "{ctx}: {id} stored twice"
            );
            // Nothing but the writers' and the probes' events, each under
            // the token it was sent with.
            if let Some(i) = id.strip_prefix(&format!("{holder}-")) {
                let r = usize::try_from(i.parse::<u64>().unwrap() / ROUND_SPAN).unwrap();
                assert_eq!(
                    Some(&token),
                    te.writer_tokens.get(r),
                    "{ctx}: {e} not under its writer's token"
                );
            } else {
                assert_eq!(
                    te.probes.get(&id).map(|p| p.0),
                    Some(token),
                    "{ctx}: unexpected event {e}"
                );
            }
        }
        for (id, want) in &te.probes {
            assert_eq!(by_id.get(id), Some(want), "{ctx}: probe {id}");
        }
        let mut acked_ids = BTreeSet::new();
        for file in &te.acks {
            for (i, token, seq) in acked(&crate::read_acks(file)) {
                let id = format!("{holder}-{i}");
                assert_eq!(
                    by_id.get(&id),
                    Some(&(token, seq)),
                    "{ctx}: acknowledged {id} (token {token}, seq {seq}) lost or changed"
                );
                acked_ids.insert(id);
            }
        }
        seen.acked += acked_ids.len();
        seen.stored_unacked += by_id.len() - acked_ids.len() - te.probes.len();

        let (_, fence) = twin_version(c, &twin).await.expect("twin exists");
        assert!(
            fence >= te.fence,
            "{ctx}: fence went down from {} to {fence}",
            te.fence
        );
        for &t in &te.stale {
            let r = c
                .put(&twin, t, &format!("stale-{round}-{t}"), json!({"stale": t}))
                .await;
            assert_eq!(
                r.status, 409,
                "{ctx}: stale token {t} accepted: {:?}",
                r.body
            );
            assert_eq!(r.body["error"], "stale_token");
        }
    }
    let (parts, last) = partitions(c).await;
    assert!(
        last >= exp.last_token,
        "after crash {round}: token counter went down from {} to {last}",
        exp.last_token
    );
    for (before, now) in exp.partition_fences.iter().zip(&parts) {
        assert_eq!(before.0, now.0);
        assert!(
            now.1 >= before.1,
            "after crash {round}: partition fence down: {before:?} -> {now:?}"
        );
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_nothing_acknowledged() {
    let seed = seed();
    println!("crash: seed {seed} (replay with PALISADE_FAULT_SEED={seed})");
    let mut rng = XorShift(seed);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut exp = Expect {
        twins: (0..WRITERS).map(|_| TwinExpect::default()).collect(),
        ..Expect::default()
    };
    let rounds = rounds();
    for round in 0..rounds {
        let store = ServeProcess::start(&data, &[]);
        let c = store.client();
        if round > 0 {
            let seen = check(&c, &exp, round - 1).await;
            println!("crash round {}: after restart {seen:?}", round - 1);
        }

        // A probe event per twin under a lease that the writer (same holder)
        // then supersedes: its token becomes stale before the crash.
        let mut probe_tokens = Vec::new();
        for (k, te) in exp.twins.iter_mut().enumerate() {
            let t = token_of(
                &c.acquire(&format!("twin/{}", twin(k)), &holder(k), 60_000)
                    .await,
            );
            assert!(t > exp.last_token, "token {t} not above {}", exp.last_token);
            exp.last_token = t;
            let id = format!("probe-{round}");
            let r = c.put(&twin(k), t, &id, json!({"probe": round})).await;
            assert_eq!(r.status, 201, "{:?}", r.body);
            te.probes
                .insert(id, (t, r.body["seqs"][0].as_u64().unwrap()));
            probe_tokens.push(t);
        }
        let mut writers = Vec::new();
        for (k, te) in exp.twins.iter_mut().enumerate() {
            let acks = dir.path().join(format!("{}-{round}.acks", holder(k)));
            let w = Writer::start(
                WriterArgs {
                    ttl_ms: 2_000,
                    interval_ms: 0,
                    count: ROUND_SPAN,
                    start_at: round as u64 * ROUND_SPAN,
                    max_errors: Some(1),
                    ..WriterArgs::new(&store.base, &twin(k), &holder(k))
                },
                acks.clone(),
            )
            .await;
            assert!(w.token > exp.last_token);
            exp.last_token = w.token;
            te.acks.push(acks);
            te.writer_tokens.push(w.token);
            writers.push(w);
        }
        for (k, te) in exp.twins.iter_mut().enumerate() {
            let t = probe_tokens[k];
            let r = c
                .put(&twin(k), t, &format!("stale-{round}"), json!({}))
                .await;
            assert_eq!(r.status, 409, "round {round}: {:?}", r.body);
            te.stale.push(t);
            te.fence = te.writer_tokens[round];
        }
        // The round's last grant is released at once: only the durable
        // token counter remembers it (no lease record is left behind).
        let scratch = c
            .acquire(&format!("twin/crash-scratch-{round}"), "s", 60_000)
            .await;
        let r = c
            .delete(&format!("/v1/leases/{}", lease_id_of(&scratch)))
            .await;
        assert_eq!(r.status, 204, "{:?}", r.body);
        assert!(token_of(&scratch) > exp.last_token);
        exp.last_token = token_of(&scratch);
        let (parts, last) = partitions(&c).await;
        assert_eq!(last, exp.last_token);
        exp.partition_fences = parts;

        let kill_after = Duration::from_millis(50 + rng.next() % 1000);
        tokio::time::sleep(kill_after).await;
        store.kill();
        let mut line = format!("crash round {round}: SIGKILL after {kill_after:?};");
        for w in writers {
            let h = w.holder.clone();
            let lines = w.finish(WAIT).await;
            let all = attempts(&lines);
            let errs = all.iter().filter(|l| matches!(l, Line::Err { .. })).count();
            assert!(
                all.iter().all(|l| !matches!(l, Line::Stale { .. })),
                "round {round}: writer {h} refused: {lines:?}"
            );
            line += &format!(" {h} acked {} then {errs} error;", acked(&all).len());
        }
        println!("{line}");
    }
    let store = ServeProcess::start(&data, &[]);
    let seen = check(&store.client(), &exp, rounds - 1).await;
    println!("crash round {}: after restart {seen:?}", rounds - 1);
    store.terminate();
}
