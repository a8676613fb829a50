//! A crash (SIGKILL right after the last acknowledgement) loses no
//! acknowledged event, duplicates none, and lowers no fence or counter.
//! Several rounds on the same folder, each adding events.

use std::collections::BTreeMap;

use palisade::core::{partition_for, TwinId};
use serde_json::json;

use crate::support::{lease_id_of, token_of, Client, ServeProcess};
use crate::{history, partitions};

const ROUNDS: usize = 5;

/// Written under a lease on its partition; the others under twin leases.
const PART_SCOPED: &str = "crash-c";

fn partition_of(twin: &str) -> u32 {
    partition_for(&TwinId::new(twin).unwrap(), 16).0
}

fn scope_of(twin: &str) -> String {
    if twin == PART_SCOPED {
        format!("partition/{}", partition_of(twin))
    } else {
        format!("twin/{twin}")
    }
}

/// Two twin-scoped twins outside PART_SCOPED's partition (a partition grant
/// would fence them, which is tested elsewhere), and PART_SCOPED.
fn twins() -> Vec<String> {
    let p = partition_of(PART_SCOPED);
    let mut out: Vec<String> = (0..)
        .map(|i| format!("crash-t{i}"))
        .filter(|t| partition_of(t) != p)
        .take(2)
        .collect();
    out.push(PART_SCOPED.to_owned());
    out
}

/// What must hold after every restart.
#[derive(Default)]
struct Expected {
    /// Acknowledged event ids per twin, in order.
    events: BTreeMap<String, Vec<String>>,
    /// Tokens used per twin, one per round.
    tokens: BTreeMap<String, Vec<u64>>,
    fences: Vec<(u64, u64, u64)>,
    last_token: u64,
}

async fn check(c: &Client, exp: &Expected, round: usize) {
    for (twin, ids) in &exp.events {
        let events = history(c, twin).await;
        let got: Vec<&str> = events
            .iter()
            .map(|e| e["event_id"].as_str().unwrap())
            .collect();
        assert_eq!(got, *ids, "round {round}: history of {twin}");
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "round {round}: {seqs:?}"
        );
        let t = c.twin(twin).await;
        assert_eq!(t.status, 200, "round {round}: {:?}", t.body);
        assert_eq!(t.body["version"], *seqs.last().unwrap());
    }
    let (parts, last) = partitions(c).await;
    assert!(
        last >= exp.last_token,
        "round {round}: counter went from {} to {last}",
        exp.last_token
    );
    for (now, before) in parts.iter().zip(&exp.fences) {
        assert_eq!(now.0, before.0);
        assert!(
            now.1 >= before.1,
            "round {round}: fence of partition {} went down: {before:?} -> {now:?}",
            now.0
        );
        assert!(
            now.2 >= before.2,
            "round {round}: head of partition {} went down: {before:?} -> {now:?}",
            now.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_lose_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let twins = twins();
    let mut exp = Expected::default();

    for round in 0..ROUNDS {
        let proc = ServeProcess::start(dir.path(), &[]);
        let c = proc.client();
        check(&c, &exp, round).await;

        for twin in &twins {
            let used = exp.tokens.get(twin).cloned().unwrap_or_default();
            // The last round's token is still the fence: it writes no new
            // event, but a retry of its last event is deduplicated.
            if let Some(&prev) = used.last() {
                let last_id = exp.events[twin].last().unwrap().clone();
                let r = c.put(twin, prev, &last_id, json!({"retry": true})).await;
                assert_eq!(r.status, 201, "round {round}: {:?}", r.body);
                assert_eq!(r.body["duplicates"], 1, "round {round}: {:?}", r.body);
            }
            // Older tokens are refused.
            if used.len() >= 2 {
                let old = used[used.len() - 2];
                let r = c
                    .put(twin, old, &format!("stale-{round}"), json!({"stale": true}))
                    .await;
                assert_eq!(r.status, 409, "round {round}: {:?}", r.body);
            }
            // The same holder acquires anew (its restored lease is live).
            let t = token_of(
                &c.acquire(&scope_of(twin), &format!("writer-{twin}"), 60_000)
                    .await,
            );
            assert!(
                t > exp.last_token,
                "round {round}: token {t} not above {}",
                exp.last_token
            );
            exp.last_token = t;
            if let Some(&prev) = used.last() {
                let r = c
                    .put(
                        twin,
                        prev,
                        &format!("stale-{round}"),
                        json!({"stale": true}),
                    )
                    .await;
                assert_eq!(r.status, 409, "round {round}: {:?}", r.body);
            }
            exp.tokens.entry(twin.clone()).or_default().push(t);
        }

        // The last grant of the round is released at once: only the durable
        // counter remembers its token.
        let scratch = c
            .acquire(&format!("twin/scratch-{round}"), "S", 60_000)
            .await;
        let r = c
            .delete(&format!("/v1/leases/{}", lease_id_of(&scratch)))
            .await;
        assert_eq!(r.status, 204, "{:?}", r.body);
        assert!(token_of(&scratch) > exp.last_token);
        exp.last_token = token_of(&scratch);

        // Write concurrently (group commits), singles and a batch per twin.
        let mut tasks = Vec::new();
        for twin in &twins {
            let c = c.clone();
            let twin = twin.clone();
            let t = *exp.tokens[&twin].last().unwrap();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..4 {
                    let id = format!("r{round}-{twin}-{i}");
                    let r = c.put(&twin, t, &id, json!({"round": round, "i": i})).await;
                    assert_eq!(r.status, 201, "{id}: {:?}", r.body);
                    acked.push(id);
                }
                let batch: Vec<_> = (4..7)
                    .map(|i| json!({"type": "u", "patch": {"i": i}, "event_id": format!("r{round}-{twin}-{i}")}))
                    .collect();
                let r = c.append(&twin, t, &json!(batch)).await;
                assert_eq!(r.status, 201, "batch: {:?}", r.body);
                assert_eq!(r.body["duplicates"], 0);
                acked.extend((4..7).map(|i| format!("r{round}-{twin}-{i}")));
                (twin, acked)
            }));
        }
        for task in tasks {
            let (twin, acked) = task.await.unwrap();
            exp.events.entry(twin).or_default().extend(acked);
        }
        // Everything above is acknowledged, hence durable: remember the
        // fences and heads (a read flushes nothing), then crash.
        let (parts, last) = partitions(&c).await;
        assert_eq!(last, exp.last_token);
        exp.fences = parts;
        proc.kill();
    }

    let proc = ServeProcess::start(dir.path(), &[]);
    let c = proc.client();
    check(&c, &exp, ROUNDS).await;
    for twin in &twins {
        assert_eq!(exp.events[twin].len(), ROUNDS * 7);
    }
    proc.terminate();
}
