//! The reference article's scenario 1 (Figure 1) with a real pause: writer
//! A is SIGSTOPped mid-stream for longer than its lease, writer B takes the
//! lease and writes, A is SIGCONTed and carries on writing under its old
//! token. Every write of A after B's grant must be refused (409), none may
//! appear after B's first event, and B's state must stand.

use std::time::Duration;

use serde_json::json;

use crate::support::ServeProcess;
use crate::{
    acked, assert_superseded, rounds, signal, twin_version, Superseded, Writer, WriterArgs,
};

const TTL_MS: u64 = 300;
/// Refused attempts A makes after SIGCONT before it stops by itself.
const A_STALE: u64 = 5;
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_lease_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServeProcess::start(&dir.path().join("data"), &[]);
    let c = store.client();
    let rounds = rounds();
    for round in 0..rounds {
        let twin = format!("pause-{round}");
        let a = Writer::start_acked(
            WriterArgs {
                ttl_ms: TTL_MS,
                interval_ms: 20,
                count: 1_000_000,
                max_stale: Some(A_STALE),
                ..WriterArgs::new(&store.base, &twin, "A")
            },
            dir.path().join(format!("a-{round}.acks")),
            3,
        )
        .await;

        signal(a.pid(), "STOP");
        // A can neither write nor renew: let its lease run out.
        tokio::time::sleep(Duration::from_millis(2 * TTL_MS)).await;
        // Whatever A had in flight has been answered by now; A can add
        // nothing more until it is continued.
        let (cut, _) = twin_version(&c, &twin).await.expect("A wrote");
        let a_lines_before = a.lines().len();

        let b = Writer::start_acked(
            WriterArgs {
                ttl_ms: 10_000,
                interval_ms: 20,
                count: 15,
                start_at: 1_000_000,
                ..WriterArgs::new(&store.base, &twin, "B")
            },
            dir.path().join(format!("b-{round}.acks")),
            1,
        )
        .await;
        signal(a.pid(), "CONT");

        let (a_token, a_lease, b_token) = (a.token, a.lease_id.clone(), b.token);
        let (a_lines, a_exited) = a.finish_after(a_lines_before, A_STALE as usize).await;
        let b_lines = b.finish(WAIT).await;

        // Scenario 6: A's lease cannot be renewed by its id any more (and
        // renewing it must not extend B's). It is `lease_superseded`, or
        // `lease_expired` when the store's expiry sweep retired it before
        // B's grant.
        let r = c
            .post_json(&format!("/v1/leases/{a_lease}/renew"), &json!({}))
            .await;
        assert_eq!(r.status, 410, "round {round}: {:?}", r.body);
        assert!(
            r.body["error"] == "lease_superseded" || r.body["error"] == "lease_expired",
            "round {round}: {:?}",
            r.body
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
            "pause round {round}: A token {a_token} acked {} before SIGSTOP, {} refused after SIGCONT; B token {b_token} acked {}",
            acked(&a_lines).len(),
            A_STALE,
            acked(&b_lines).len()
        );
    }
    store.terminate();
}
