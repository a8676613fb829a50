//! Writes flow while a backup streams, and the backup is the store as of
//! its pause: an event acknowledged while the backup's stream is held open
//! (not read) by its client is not in the backup, every earlier one is.

use palisade::core::{partition_for, TwinId};
use palisade::log::backup::{frame, FolderWriter, FrameReader};
use serde_json::{json, Value};

use crate::support::{token_of, ServeProcess};
use crate::{history, restore};

/// Events written before the backup (about 40 MB): far more than the
/// server's queue and the socket buffers hold, so the server is still
/// copying partition 0 while the test writes.
const BATCHES: usize = 100;
const PER_BATCH: usize = 100;
const PAD: usize = 4000;

/// A twin id of partition `p` (of 16), starting with `prefix`.
fn twin_in(prefix: &str, p: u32) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| partition_for(&TwinId::new(t.as_str()).unwrap(), 16).0 == p)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_are_acknowledged_while_the_backup_streams_and_are_not_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let proc = ServeProcess::start(&dir.path().join("store"), &[]);
    let c = proc.client();
    // The bulk in partition 0, copied first; the live twin in partition 15,
    // copied last: its events are copied after the test's write.
    let bulk = twin_in("bulk", 0);
    let live = twin_in("live", 15);
    let token = token_of(&c.acquire(&format!("twin/{bulk}"), "bulk", 600_000).await);
    let filler = "x".repeat(PAD);
    for b in 0..BATCHES {
        let events: Vec<Value> = (0..PER_BATCH)
            .map(|i| json!({"type": "t", "event_id": format!("b{b}-{i}"), "patch": {"i": i, "pad": filler}}))
            .collect();
        let r = c.append(&bulk, token, &Value::Array(events)).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    let writer = token_of(&c.acquire(&format!("twin/{live}"), "live", 600_000).await);
    assert_eq!(
        c.put(&live, writer, "before", json!({"n": 1})).await.status,
        201
    );

    // Start the backup and read only its first bytes: the pause is over by
    // the time any data arrives (data is sent only after writes resume).
    let http = reqwest::Client::new();
    let mut resp = http
        .post(format!("{}/v1/admin/backup", c.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut frames = FrameReader::default();
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    frames.push(&first);

    // The stream is held open and unread: writes and grants still go on.
    let r = c.put(&live, writer, "during", json!({"n": 2})).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let during_seq = r.body["seqs"][0].as_u64().unwrap();
    let later = c.acquire("twin/later", "later", 60_000).await;
    assert!(token_of(&later) > writer);

    // Now read the rest into a backup folder.
    let backup = dir.path().join("backup");
    let mut folder = FolderWriter::create(&backup).unwrap();
    let mut manifest = None;
    let mut complete = false;
    while !complete {
        while let Some((kind, body)) = frames.next_frame() {
            match kind {
                frame::DATA => folder.data(&body).unwrap(),
                frame::MANIFEST => {
                    manifest = Some(body);
                    complete = true;
                }
                frame::ERROR => panic!("backup failed: {}", String::from_utf8_lossy(&body)),
                _ => {}
            }
        }
        if !complete {
            let chunk = resp
                .chunk()
                .await
                .unwrap()
                .expect("the stream ended before its manifest");
            frames.push(&chunk);
        }
    }
    let (info, _) = folder.finish(&manifest.unwrap()).unwrap();
    eprintln!(
        "backup of {} events, writes held {} us",
        info.heads.iter().sum::<u64>(),
        info.pause_us
    );
    assert!(
        info.heads[15] < during_seq,
        "the backup's head {} includes the event written after its pause ({during_seq})",
        info.heads[15]
    );

    let restored_dir = dir.path().join("restored");
    restore(&backup, &restored_dir, &[]).json();
    // Straight from the restored sled: no event batch, history entry or
    // snapshot of partition 15 past the backup's head (reads stop at the
    // twin's version, so they would not show one).
    {
        let db = sled::Config::new().path(&restored_dir).open().unwrap();
        let tree = db.open_tree("partition/00015").unwrap();
        for kind in [0x01u8, 0x03, 0x05] {
            for kv in tree.scan_prefix([kind]) {
                let (k, _) = kv.unwrap();
                let seq = u64::from_be_bytes(k[k.len() - 8..].try_into().unwrap());
                assert!(
                    seq <= info.heads[15],
                    "key kind {kind:#x} at seq {seq} past the backup's head {}",
                    info.heads[15]
                );
            }
        }
    }
    let restored = ServeProcess::start(&restored_dir, &[]);
    let r = restored.client();
    let live: Vec<String> = history(&r, &live)
        .await
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(live, ["before"]);
    assert_eq!(history(&r, &bulk).await.len(), BATCHES * PER_BATCH);
    assert_eq!(
        r.twin(&bulk).await.body["state"],
        c.twin(&bulk).await.body["state"]
    );
    restored.terminate();
    proc.terminate();
}
