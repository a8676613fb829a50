//! Records with interleaved stale tokens for many keys: exactly the stale ones
//! are dropped (rejection log and metrics), the rest are applied in order,
//! per key and per partition.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use crate::broker::{TestTopic, PARTITIONS};
use crate::{
    event_ids, history, kafka_rejections, metric_sum, metrics_text, partition_events, publish,
    publisher, release, serve, twin_token, twins_in, wait_handled, Sent,
};

/// Records per twin.
const PER_TWIN: usize = 12;

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        usize::try_from(x >> 33).unwrap() % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_stale_records_are_dropped_and_the_rest_applied_in_order() {
    let t = TestTopic::new("stale");
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &t, &[]);
    let c = s.client();

    // 8 twins, 2 per partition. Twin i gets 2 or 3 leases one after the
    // other (each released before the next), so it has 1 or 2 stale tokens
    // and a current one. Grants go twin by twin: later twins' *stale* tokens
    // are numerically above earlier twins' *current* ones, so a fence that
    // is not per key (e.g. a global maximum) fails this test.
    let twins: Vec<String> = (0..PARTITIONS)
        .flat_map(|p| twins_in("stale", p, 2))
        .collect();
    let mut tokens: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (i, twin) in twins.iter().enumerate() {
        let generations = 2 + i % 2;
        for g in 0..generations {
            let (token, lease) = twin_token(&c, twin, &format!("w{g}-{twin}")).await;
            if g + 1 < generations {
                release(&c, &lease).await;
            }
            tokens.entry(twin.clone()).or_default().push(token);
        }
    }
    let all: Vec<u64> = tokens.values().flatten().copied().collect();
    assert!(
        tokens.values().any(|ts| ts[0] > tokens[&twins[0]][1]),
        "some stale token must exceed another twin's current one: {all:?}"
    );

    // After all grants: a stream shuffled across twins, in order per twin,
    // each record under a random one of its twin's tokens.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut queues: BTreeMap<&str, Vec<(usize, u64)>> = twins
        .iter()
        .map(|tw| {
            let ts = &tokens[tw];
            let recs = (0..PER_TWIN)
                .map(|j| (j, ts[rng.below(ts.len())]))
                .collect::<Vec<_>>();
            (tw.as_str(), recs)
        })
        .collect();
    // Every twin gets at least one stale and one current record.
    for (tw, q) in &mut queues {
        let ts = &tokens[*tw];
        q[0].1 = ts[0];
        q[PER_TWIN - 1].1 = *ts.last().unwrap();
    }
    let p = publisher(&t.topic);
    let mut sent: Vec<Sent> = Vec::new();
    let mut cursor: BTreeMap<&str, usize> = twins.iter().map(|t| (t.as_str(), 0)).collect();
    while sent.len() < twins.len() * PER_TWIN {
        let open: Vec<&str> = cursor
            .iter()
            .filter(|(_, i)| **i < PER_TWIN)
            .map(|(t, _)| *t)
            .collect();
        let twin = open[rng.below(open.len())];
        let i = cursor[twin];
        let (j, token) = queues[twin][i];
        *cursor.get_mut(twin).unwrap() += 1;
        let id = format!("{twin}-{j}-t{token}");
        sent.push(publish(&p, twin, token, &id, json!({ "j": j, "token": token })).await);
    }
    let current = |s: &Sent| s.token == *tokens[&s.twin].last().unwrap();
    let stale: Vec<&Sent> = sent.iter().filter(|s| !current(s)).collect();
    let applied: Vec<&Sent> = sent.iter().filter(|s| current(s)).collect();
    assert!(!stale.is_empty() && !applied.is_empty());

    let o = wait_handled(&c, sent.len() as u64, std::time::Duration::from_secs(60)).await;
    assert_eq!(o["dropped_stale"], stale.len() as u64, "{o:?}");
    assert_eq!(o["applied"], applied.len() as u64, "{o:?}");
    assert_eq!(o["dead_lettered"], 0, "{o:?}");
    assert_eq!(o["already_applied"], 0, "{o:?}");
    let text = metrics_text(&c).await;
    #[allow(clippy::cast_precision_loss)]
    let expected = stale.len() as f64;
    assert_eq!(
        metric_sum(
            &text,
            "palisade_append_rejections_total",
            &[("reason", "stale_token")]
        ),
        expected,
        "every dropped record counts as a stale_token rejection"
    );

    // The rejection log names exactly the stale records.
    let rejections = kafka_rejections(&c).await;
    let got: BTreeSet<(u64, u64, String, u64)> = rejections
        .iter()
        .map(|r| {
            assert_eq!(r["reason"], "stale_token", "{r}");
            (
                r["partition"].as_u64().unwrap(),
                r["offset"]
                    .as_u64()
                    .expect("a kafka rejection has an offset"),
                r["twin_id"].as_str().unwrap().to_owned(),
                r["token"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: BTreeSet<(u64, u64, String, u64)> = stale
        .iter()
        .map(|s| (u64::from(s.partition), s.offset, s.twin.clone(), s.token))
        .collect();
    assert_eq!(got, want, "rejections must be exactly the stale records");
    assert_eq!(rejections.len(), stale.len(), "each stale record once");

    // Issue 14: the durable refusal journal names them too, per twin, with
    // source kafka, the record's place, the token and the fence it hit.
    for twin in &twins {
        let r = c
            .get(&format!("/v1/twins/{twin}/refusals?limit=1000"))
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        let list = r.body["refusals"].as_array().unwrap();
        let current = *tokens[twin].last().unwrap();
        let got: BTreeSet<(u64, u64, u64)> = list
            .iter()
            .map(|r| {
                assert_eq!(r["source"], "kafka", "{r}");
                assert_eq!(r["reason"], "stale_token", "{r}");
                assert_eq!(r["fence"], current, "{r}");
                (
                    r["source_partition"].as_u64().unwrap(),
                    r["offset"].as_u64().unwrap(),
                    r["token"].as_u64().unwrap(),
                )
            })
            .collect();
        let want: BTreeSet<(u64, u64, u64)> = stale
            .iter()
            .filter(|s| &s.twin == twin)
            .map(|s| (u64::from(s.partition), s.offset, s.token))
            .collect();
        assert_eq!(got, want, "refusal journal of {twin}");
        assert_eq!(list.len(), want.len(), "each stale record of {twin} once");
        let offsets: Vec<u64> = list.iter().map(|r| r["offset"].as_u64().unwrap()).collect();
        assert!(
            offsets.windows(2).all(|w| w[0] > w[1]),
            "newest first: {offsets:?}"
        );
    }

    // Per key: the current-token records, in produce order, nothing else.
    for twin in &twins {
        let want: Vec<String> = applied
            .iter()
            .filter(|s| &s.twin == twin)
            .map(|s| s.event_id.clone())
            .collect();
        let events = history(&c, twin).await;
        assert_eq!(event_ids(&events), want, "history of {twin}");
        let current = *tokens[twin].last().unwrap();
        assert!(events.iter().all(|e| e["token"] == current), "{events:?}");
        let view = c.twin(twin).await;
        assert_eq!(view.status, 200, "{:?}", view.body);
        assert_eq!(view.body["fence"], current);
        let last = applied.iter().rev().find(|s| &s.twin == twin).unwrap();
        assert_eq!(view.body["state"]["token"], current);
        assert_eq!(
            view.body["state"]["j"].as_u64().unwrap(),
            last.event_id
                .split('-')
                .nth(2)
                .unwrap()
                .parse::<u64>()
                .unwrap(),
            "the last current-token record's patch wins"
        );
    }

    // Per partition: gapless increasing seqs, the applied records in offset order.
    for part in 0..PARTITIONS {
        let events = partition_events(&c, part).await;
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        let mut want: Vec<&&Sent> = applied.iter().filter(|s| s.partition == part).collect();
        want.sort_by_key(|s| s.offset);
        let want: Vec<String> = want.iter().map(|s| s.event_id.clone()).collect();
        assert_eq!(event_ids(&events), want, "partition {part}");
    }
    s.terminate();
}
