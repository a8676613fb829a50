//! A backup taken by `palisade backup` while several writers append over
//! HTTP, restored by `palisade restore` into a new folder, served again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::support::{token_of, ServeProcess};
use crate::{history, palisade, partitions, restore};

const WRITERS: usize = 4;
/// Events per writer at most (the test stops them earlier).
const MAX_EVENTS: usize = 600;

/// One acknowledged event.
#[derive(Debug, Clone)]
struct Ack {
    twin: String,
    event_id: String,
    seq: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_under_load_restores_every_acknowledged_event_and_fences_old_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let proc = ServeProcess::start(&data, &[]);
    let c = proc.client();

    // A holder whose token is issued before the backup, and who wrote.
    let pre = token_of(&c.acquire("twin/pre-holder", "pre", 600_000).await);
    assert_eq!(
        c.put("pre-holder", pre, "pre-1", json!({"v": 1}))
            .await
            .status,
        201
    );
    // A partition-scoped writer too: its partition fence must rise as well.
    let part = token_of(&c.acquire("partition/3", "part", 600_000).await);

    let acks: Arc<Mutex<Vec<Ack>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tokens = vec![pre, part];
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let twin = format!("loaded-{w}");
        let token = token_of(
            &c.acquire(&format!("twin/{twin}"), &format!("w{w}"), 600_000)
                .await,
        );
        tokens.push(token);
        let (c, acks, stop) = (c.clone(), acks.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..MAX_EVENTS {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let id = format!("{twin}-{i}");
                let r = c
                    .put(
                        &twin,
                        token,
                        &id,
                        json!({"i": i, "w": w, "k": {"m": i % 5}}),
                    )
                    .await;
                assert_eq!(r.status, 201, "{id}: {:?}", r.body);
                acks.lock().unwrap().push(Ack {
                    twin: twin.clone(),
                    event_id: id,
                    seq: r.body["seqs"][0].as_u64().unwrap(),
                });
            }
        }));
    }
    // Let the load run, then take the backup in the middle of it.
    while acks.lock().unwrap().len() < 200 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let before: Vec<Ack> = acks.lock().unwrap().clone();
    let (fences_before, _, last_before) = partitions(&c).await;
    let backup_dir = dir.path().join("backup");
    let (url, to) = (c.base.clone(), backup_dir.clone());
    let run = tokio::task::spawn_blocking(move || {
        palisade(&[
            "backup",
            "--to",
            to.to_str().unwrap(),
            "--url",
            &url,
            "--json",
        ])
    })
    .await
    .unwrap();
    let during = acks.lock().unwrap().len() - before.len();
    let summary = run.json();
    eprintln!("backup: {summary}; {during} appends acknowledged while `palisade backup` ran");
    assert!(backup_dir.join("manifest.json").is_file());
    assert!(backup_dir.join("data.pbk").is_file());
    let backup_heads: Vec<u64> = summary["heads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert!(summary["last_token"].as_u64().unwrap() >= last_before);

    // After the backup: a new holder (its token is unknown to the backup).
    let post = token_of(&c.acquire("twin/post-holder", "post", 600_000).await);
    assert_eq!(
        c.put("post-holder", post, "post-1", json!({"v": 2}))
            .await
            .status,
        201
    );
    tokens.push(post);
    // More grants after the backup, so the original's counter moves on.
    for i in 0..5 {
        tokens.push(token_of(
            &c.acquire(&format!("twin/extra-{i}"), "x", 1_000).await,
        ));
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    let max_token = *tokens.iter().max().unwrap();
    let (_, _, last_after) = partitions(&c).await;
    assert_eq!(last_after, max_token);

    // A damaged backup (one byte flipped in the middle of the data file) is
    // refused, and nothing is created.
    let damaged = dir.path().join("damaged");
    std::fs::create_dir(&damaged).unwrap();
    for f in ["manifest.json", "data.pbk"] {
        std::fs::copy(backup_dir.join(f), damaged.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(damaged.join("data.pbk")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(damaged.join("data.pbk"), &bytes).unwrap();
    let target = dir.path().join("from-damaged");
    let r = restore(&damaged, &target, &[]);
    assert_ne!(r.code, 0, "a damaged backup was restored: {r:?}");
    assert!(r.stdout.contains("SHA-256"), "{r:?}");
    assert!(
        !target.exists(),
        "a refused restore created {}",
        target.display()
    );
    // A truncated one too.
    std::fs::write(damaged.join("data.pbk"), &bytes[..mid]).unwrap();
    let r = restore(&damaged, &target, &[]);
    assert_ne!(r.code, 0, "a truncated backup was restored: {r:?}");
    assert!(r.stdout.contains("truncated"), "{r:?}");
    assert!(!target.exists());

    // A folder that is not empty is refused and left as it was.
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("keep.txt"), b"mine").unwrap();
    let r = restore(&backup_dir, &busy, &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stdout.contains("not empty"), "{r:?}");
    assert_eq!(std::fs::read(busy.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(&busy).unwrap().count(), 1);

    // --fence-at is for etcd-backed stores only (this one is embedded).
    let r = restore(
        &backup_dir,
        &dir.path().join("fence-at"),
        &["--fence-at", "99"],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stdout.contains("etcd"), "{r:?}");
    assert!(!dir.path().join("fence-at").exists());

    // The restore.
    let restored_dir = dir.path().join("restored");
    let done = restore(&backup_dir, &restored_dir, &[]).json();
    eprintln!("restore: {done}");
    let fence = done["fence"].as_u64().unwrap();
    let restored = ServeProcess::start(&restored_dir, &[]);
    let r = restored.client();

    // Every event acknowledged before the backup started is there, with
    // the same seq.
    let mut histories: HashMap<String, Vec<Value>> = HashMap::new();
    for a in &before {
        if !histories.contains_key(&a.twin) {
            histories.insert(a.twin.clone(), history(&r, &a.twin).await);
        }
        let h = &histories[&a.twin];
        let found = h.iter().find(|e| e["event_id"] == a.event_id.as_str());
        let Some(e) = found else {
            panic!(
                "{} (seq {}) acknowledged before the backup is missing",
                a.event_id, a.seq
            );
        };
        assert_eq!(e["seq"].as_u64().unwrap(), a.seq, "{}", a.event_id);
    }
    // Nothing after the backup's heads; each twin equals the original's
    // state at the same seq, event for event.
    let (fences, heads, last) = partitions(&r).await;
    assert_eq!(heads, backup_heads);
    for w in 0..WRITERS {
        let twin = format!("loaded-{w}");
        let h = history(&r, &twin).await;
        let orig = history(&c, &twin).await;
        assert!(!h.is_empty());
        assert_eq!(
            h[..],
            orig[..h.len()],
            "{twin}: the restored history is not a prefix of the original's"
        );
        let version = h.last().unwrap()["seq"].as_u64().unwrap();
        let now = r.twin(&twin).await.body;
        let then = c
            .get(&format!("/v1/twins/{twin}?at_seq={version}"))
            .await
            .body;
        assert_eq!(now["state"], then["state"], "{twin}");
        assert_eq!(now["version"], then["version"], "{twin}");
    }
    assert_eq!(history(&r, "pre-holder").await.len(), 1);
    assert!(history(&r, "post-holder").await.is_empty());

    // Tokens and fences never go down: every fence is at the restored
    // counter, above every token ever seen, before and after the backup.
    assert_eq!(last, fence);
    assert!(fence > max_token, "fence {fence} <= token {max_token}");
    for (p, (f, old)) in fences.iter().zip(&fences_before).enumerate() {
        assert!(f >= old, "partition {p}'s fence went down");
        assert_eq!(*f, fence, "partition {p}");
    }
    let fresh = token_of(&r.acquire("twin/loaded-0", "new", 60_000).await);
    assert!(fresh > max_token && fresh > fence, "new token {fresh}");
    assert_eq!(
        r.put("loaded-0", fresh, "after-restore", json!({"v": 3}))
            .await
            .status,
        201
    );

    // Holders of tokens issued before the restore are refused: a
    // pre-backup token (its grant is in the backup) as stale, a
    // post-backup one (the restored store never saw it) as not issued.
    let resp = r.put("pre-holder", pre, "pre-2", json!({"v": 9})).await;
    assert_eq!(resp.status, 409, "{:?}", resp.body);
    assert_eq!(resp.body["error"], "stale_token");
    let resp = r
        .put("loaded-1", tokens[3], "old-writer", json!({"v": 9}))
        .await;
    assert_eq!(resp.status, 409, "{:?}", resp.body);
    assert_eq!(resp.body["error"], "stale_token");
    let partition_twin = (0..)
        .map(|i| format!("p3-{i}"))
        .find(|t| {
            palisade::core::partition_for(&palisade::core::TwinId::new(t.as_str()).unwrap(), 16).0
                == 3
        })
        .unwrap();
    let resp = r
        .put(&partition_twin, part, "part-1", json!({"v": 9}))
        .await;
    assert_eq!(resp.status, 409, "{:?}", resp.body);
    assert_eq!(resp.body["error"], "stale_token");
    let resp = r.put("post-holder", post, "post-2", json!({"v": 9})).await;
    assert_eq!(resp.status, 403, "{:?}", resp.body);
    assert_eq!(resp.body["error"], "token_not_issued");
    // Leases were dropped: the scope of a live pre-backup lease is free.
    let again = token_of(&r.acquire("twin/pre-holder", "someone", 60_000).await);
    assert!(again > fence);
    restored.terminate();
    proc.terminate();
}
