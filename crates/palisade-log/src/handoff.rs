//! Partition snapshots, which bound a cluster handoff
//! (`docs/decisions/0038-partition-snapshots.md`; byte layout in
//! `docs/on-disk-format.md`, "Partition snapshots").
//!
//! In cluster mode a node that gains partition p rebuilds p's state from
//! p's Kafka log. Without a snapshot it replays the log from where its own
//! copy stopped, or from the beginning: a handoff then lasts as long as the
//! log is long. With snapshots, the owner of p writes from time to time
//! every key of p's state as of one source offset into a file in a folder
//! every node reaches ([`Store::write_partition_snapshot`]); a node that
//! gains p loads the newest one ahead of its own copy
//! ([`Store::load_partition_snapshot`]) and replays only the records after
//! its offset.
//!
//! **What a snapshot holds.** Everything applying p's log up to the offset
//! wrote, all of it keyed by p: p's tree (meta, twin records, token grants,
//! event batches, history, twin snapshots), p's owner fence, what the
//! `ingest` tree keeps for source partition p (its offset, dead letters,
//! forward chains from p, relay marks at p), p's outbox entries and refusal
//! journal, and the owners of the tokens p's grants hold. Every node that
//! applies the same log prefix decides the same (decision 0012), so a
//! snapshot written by any node, even a former owner, is the state at its
//! offset.
//!
//! **Writing** holds the sequencer (as a backup does, `backup.rs`) only
//! while the keys that change in place are read; the append-only ones
//! (event batches, history, twin snapshots at or below the head) are copied
//! after. The file is written under a temporary name, synced, renamed, and
//! its folder synced.
//!
//! **Loading** is checked before anything is touched (SHA-256, format,
//! partition count, topic, keys of p only). Then a marker naming p is made
//! durable through the commit path; p's keys are cleared and the
//! snapshot's written straight into sled (nothing else writes p meanwhile:
//! its consumer is paused); the sequencer loads p's state again; a
//! checkpoint makes it durable and trims the write-ahead log of every round
//! before it; the marker is removed. A store opened with a marker left (a
//! crash mid-load) clears p's keys instead: p is then rebuilt from the log,
//! or from a snapshot again.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use palisade_core::{codec, PartitionId};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::batch::DEDUPE_GENERATION;
use crate::commit::{StorageFailure, Trees};
use crate::keys;
use crate::records::PartitionMeta;
use crate::store::Store;
use crate::wal::{Ops, TreeId};
use crate::writer::{Command, RawWrite};

/// First bytes of a partition snapshot file.
pub const SNAPSHOT_MAGIC: &[u8; 8] = b"PALPSN01";
/// The snapshot format version (`format` in its header).
pub const SNAPSHOT_FORMAT: u64 = 1;
/// File name extension of a finished snapshot.
pub const SNAPSHOT_EXT: &str = "psnap";
/// Snapshots kept per partition by the writer (the newest ones).
pub const SNAPSHOTS_KEPT: usize = 2;
/// `meta` key of an unfinished load: `snapshot-loading/ ++ partition:u32
/// BE` -> the topic.
const LOADING_PREFIX: &[u8] = b"snapshot-loading/";
/// `meta` key of a load whose history backfill has not ended:
/// `snapshot-backfill/ ++ partition:u32 BE` -> the topic.
const BACKFILL_PREFIX: &[u8] = b"snapshot-backfill/";
/// The history backfill checks whether the store is closing every this many records.
const LOAD_BATCH: usize = 16_384;
/// A header is at most this long (it is a few hundred bytes).
const MAX_HEADER: u32 = 1 << 20;

/// Why a snapshot could not be written or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot file {path}: {detail}")]
    Io { path: String, detail: String },
    #[error("snapshot file {path} is damaged: {detail}")]
    Corrupt { path: String, detail: String },
    #[error("snapshot file {path} does not fit this store: {detail}")]
    Mismatch { path: String, detail: String },
    #[error("reading the store: {0}")]
    Read(#[from] sled::Error),
    #[error(transparent)]
    Storage(#[from] StorageFailure),
    #[error("the store is closed")]
    Closed,
}

/// A snapshot's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub format: u64,
    /// The store layout its keys are in (`keys::LAYOUT_VERSION`).
    pub layout: u64,
    /// The store's partition count.
    pub partitions: u32,
    pub partition: u32,
    /// The Kafka topic whose partition `partition` it covers.
    pub topic: String,
    /// The last offset of the source partition it covers: a node that
    /// loads it resumes at `offset + 1`.
    pub offset: u64,
    /// The partition's head (last event sequence number) at `offset`.
    pub head: u64,
    pub taken_at_ms: u64,
}

impl SnapshotInfo {
    fn to_json(&self) -> Value {
        json!({
            "format": self.format,
            "layout": self.layout,
            "partitions": self.partitions,
            "partition": self.partition,
            "topic": self.topic,
            "offset": self.offset,
            "head": self.head,
            "taken_at_ms": self.taken_at_ms,
        })
    }

    fn from_json(v: &Value) -> Option<Self> {
        let n = |k: &str| v.get(k).and_then(Value::as_u64);
        Some(Self {
            format: n("format")?,
            layout: n("layout")?,
            partitions: u32::try_from(n("partitions")?).ok()?,
            partition: u32::try_from(n("partition")?).ok()?,
            topic: v.get("topic")?.as_str()?.to_owned(),
            offset: n("offset")?,
            head: n("head")?,
            taken_at_ms: n("taken_at_ms")?,
        })
    }
}

/// What a write or a load did.
#[derive(Debug, Clone)]
pub struct SnapshotSummary {
    pub info: SnapshotInfo,
    pub path: PathBuf,
    /// Keys written (or loaded).
    pub records: u64,
    pub bytes: u64,
    /// How long the sequencer was held (writing only).
    pub pause: std::time::Duration,
    pub took: std::time::Duration,
}

/// The folder of partition `p`'s snapshots of `topic` under `dir`.
pub fn partition_dir(dir: &Path, topic: &str, p: u32) -> PathBuf {
    dir.join(topic).join(format!("p{p:05}"))
}

/// The newest finished snapshot of partition `p` of `topic` in `dir`, by
/// the offset in its name (`{offset:020}.psnap`), with that offset.
pub fn latest(dir: &Path, topic: &str, p: u32) -> std::io::Result<Option<(PathBuf, u64)>> {
    Ok(list(&partition_dir(dir, topic, p))?.pop())
}

/// Finished snapshots in a partition's folder, oldest first.
fn list(folder: &Path) -> std::io::Result<Vec<(PathBuf, u64)>> {
    let entries = match std::fs::read_dir(folder) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut found = Vec::new();
    for entry in entries {
        let path = entry?.path();
        let offset = path
            .extension()
            .filter(|x| *x == SNAPSHOT_EXT)
            .and_then(|_| path.file_stem())
            .and_then(|s| s.to_str())
            .and_then(|s| s.parse::<u64>().ok());
        if let Some(o) = offset {
            found.push((path, o));
        }
    }
    found.sort_by_key(|(_, o)| *o);
    Ok(found)
}

fn now_ms() -> u64 {
    crate::ingest::now_ms()
}

/// Keys of partition `p` outside its tree: (tree, key prefix). The
/// `ingest` tree's offset key is exact, the others are prefixes.
fn outside_prefixes(topic: &str, p: u32) -> Vec<(TreeId, Vec<u8>)> {
    let pair_prefix = |kind| {
        let mut k = keys::ingest::pair(kind, topic, p, 0);
        k.truncate(k.len() - 4);
        k
    };
    let mut dead = vec![keys::ingest::DEAD_LETTER];
    dead.extend_from_slice(&p.to_be_bytes());
    vec![
        (TreeId::CLUSTER, p.to_be_bytes().to_vec()),
        (TreeId::INGEST, keys::ingest::offset(topic, p)),
        (TreeId::INGEST, pair_prefix(keys::ingest::CHAIN)),
        (TreeId::INGEST, pair_prefix(keys::ingest::RELAY)),
        (TreeId::INGEST, dead),
        (TreeId::OUTBOX, p.to_be_bytes().to_vec()),
        (TreeId::REFUSALS, p.to_be_bytes().to_vec()),
    ]
}

/// Whether a key of a snapshot of partition `p` belongs to it, given the
/// partition's [`outside_prefixes`] and the tokens of its grants.
fn belongs(
    tree: TreeId,
    key: &[u8],
    p: u32,
    outside: &[(TreeId, Vec<u8>)],
    grants: &[u64],
) -> bool {
    if tree == TreeId::partition(p) {
        return true;
    }
    if tree == TreeId::TOKEN_OWNERS {
        return <[u8; 8]>::try_from(key).is_ok_and(|t| grants.contains(&u64::from_be_bytes(t)));
    }
    outside
        .iter()
        .any(|(t, prefix)| *t == tree && key.starts_with(prefix))
}

/// Remove every key of partition `p` (token owners stay: they are facts
/// about tokens, the same on every node).
fn clear(trees: &Trees, topic: &str, p: u32) -> Result<(), sled::Error> {
    let Some(tree) = trees.partitions.get(p as usize) else {
        return Ok(());
    };
    tree.clear()?;
    for (id, prefix) in outside_prefixes(topic, p) {
        let Some(t) = trees.by_id(id) else { continue };
        for k in t.scan_prefix(&prefix).keys() {
            t.remove(k?)?;
        }
    }
    Ok(())
}

fn marker_key(prefix: &[u8], p: u32) -> Vec<u8> {
    let mut k = prefix.to_vec();
    k.extend_from_slice(&p.to_be_bytes());
    k
}

/// On open, after the log's replay: a load that did not finish left its
/// marker; clear that partition's keys (it is rebuilt from its log, or a
/// snapshot, when next assigned) and remove the marker, durably.
pub(crate) fn finish_unfinished(
    db: &sled::Db,
    path: &Path,
    trees: &Trees,
) -> Result<usize, sled::Error> {
    let mut cleared = 0;
    let markers = trees
        .meta
        .scan_prefix(LOADING_PREFIX)
        .chain(trees.meta.scan_prefix(BACKFILL_PREFIX));
    for kv in markers {
        let (k, v) = kv?;
        // The partition: the key's last 4 bytes.
        let Some(p) = k
            .len()
            .checked_sub(4)
            .and_then(|i| k.get(i..))
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
        else {
            continue;
        };
        let topic = String::from_utf8_lossy(&v).into_owned();
        tracing::warn!(
            partition = p,
            topic,
            "a partition snapshot's load (or its history backfill) did not finish: the partition's keys are cleared; it is rebuilt when next assigned"
        );
        clear(trees, &topic, p)?;
        trees.meta.remove(&k)?;
        cleared += 1;
    }
    if cleared > 0 {
        db.flush()?;
        crate::commit::sync_sled_files(path, &std::sync::Mutex::default())?;
    }
    Ok(cleared)
}

/// Hashes and counts what goes through it.
struct Hashing<W: Write> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// One put op, as the write-ahead log encodes it.
fn put(out: &mut impl Write, tree: TreeId, key: &[u8], value: &[u8]) -> std::io::Result<()> {
    let mut ops = Ops::default();
    ops.put(tree, key, value);
    out.write_all(ops.payload())
}

impl Store {
    /// Write a snapshot of partition `p` (fed by partition `p` of `topic`)
    /// into `dir` and delete that partition's older ones past
    /// [`SNAPSHOTS_KEPT`]. `Ok(None)`: the partition has handled no record
    /// of `topic` yet, or the newest snapshot already covers its offset.
    /// Blocking: run it off the async runtime.
    pub fn write_partition_snapshot(
        &self,
        p: u32,
        topic: &str,
        dir: &Path,
    ) -> Result<Option<SnapshotSummary>, SnapshotError> {
        let started = Instant::now();
        let folder = partition_dir(dir, topic, p);
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |e: std::io::Error| SnapshotError::Io {
                path,
                detail: e.to_string(),
            }
        };
        let Some(tree) = self.trees.partitions.get(p as usize) else {
            return Err(SnapshotError::Mismatch {
                path: folder.display().to_string(),
                detail: format!(
                    "partition {p} does not exist; the store has {}",
                    self.partitions
                ),
            });
        };
        if !self.history_complete(p) {
            // Its older history is still being written from a snapshot.
            return Ok(None);
        }
        let newest = latest(dir, topic, p).map_err(io(&folder))?;
        // The keys that change in place, with writes held.
        let (paused_tx, paused_rx) = mpsc::channel();
        let (resume_tx, resume_rx) = mpsc::channel::<()>();
        self.send(Command::Pause {
            paused: paused_tx,
            resume: resume_rx,
        })
        .map_err(|_| SnapshotError::Closed)?;
        match paused_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(f)) => return Err(f.into()),
            Err(_) => return Err(SnapshotError::Closed),
        }
        let held = Instant::now();
        let copied = self.copy_in_place(p, topic, newest.map(|(_, o)| o));
        drop(resume_tx);
        let pause = held.elapsed();
        let Some((info, mutable, grants_n)) = copied? else {
            return Ok(None);
        };
        std::fs::create_dir_all(&folder).map_err(io(&folder))?;
        let name = format!("{:020}.{SNAPSHOT_EXT}", info.offset);
        let tmp = folder.join(format!(".{name}.{}-{}.tmp", std::process::id(), now_ms()));
        let write = || -> std::io::Result<(u64, u64)> {
            let file = File::create(&tmp)?;
            let mut out = Hashing {
                inner: BufWriter::with_capacity(1 << 20, file),
                hash: Sha256::new(),
                bytes: 0,
            };
            out.write_all(SNAPSHOT_MAGIC)?;
            let mut header = info.to_json();
            header["state_records"] = json!(grants_n);
            let header = header.to_string();
            let len = u32::try_from(header.len()).unwrap_or(u32::MAX);
            out.write_all(&len.to_be_bytes())?;
            out.write_all(header.as_bytes())?;
            out.write_all(&mutable)?;
            let mut records = grants_n;
            // Append-only keys at or below the head: event batches (by
            // their first seq, newest first: a load writes the ones the
            // dedupe window needs before the partition resumes, the rest
            // after), history entries and twin snapshots (by the seq their
            // key ends with).
            let id = TreeId::partition(p);
            for kv in tree.range(keys::event(0)..=keys::event(info.head)).rev() {
                let (k, v) = kv.map_err(std::io::Error::other)?;
                put(&mut out, id, &k, &v)?;
                records += 1;
            }
            for kind in [keys::HISTORY, keys::SNAPSHOT] {
                for kv in tree.scan_prefix([kind]) {
                    let (k, v) = kv.map_err(std::io::Error::other)?;
                    if keys::trailing_seq(&k).is_some_and(|s| s <= info.head) {
                        put(&mut out, id, &k, &v)?;
                        records += 1;
                    }
                }
            }
            let digest = out.hash.clone().finalize();
            let bytes = out.bytes + 32;
            let mut file = out.inner.into_inner().map_err(|e| e.into_error())?;
            file.write_all(&digest)?;
            file.sync_all()?;
            Ok((records, bytes))
        };
        let (records, bytes) = match write() {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io(&tmp)(e));
            }
        };
        let path = folder.join(&name);
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        File::open(&folder)
            .and_then(|d| d.sync_all())
            .map_err(io(&folder))?;
        // Older ones past the kept count (a reader holding one open still
        // reads it: the file goes once it is closed).
        if let Ok(all) = list(&folder) {
            let surplus = all.len().saturating_sub(SNAPSHOTS_KEPT);
            for (old, _) in all.into_iter().take(surplus) {
                let _ = std::fs::remove_file(old);
            }
        }
        let took = started.elapsed();
        self.metrics().add(
            "palisade_partition_snapshots_written_total",
            "Partition snapshots written (cluster mode, --snapshot-dir).",
            &[],
            1,
        );
        tracing::info!(
            partition = p,
            offset = info.offset,
            head = info.head,
            records,
            bytes,
            pause_us = pause.as_micros() as u64,
            took_ms = took.as_millis() as u64,
            path = %path.display(),
            "partition snapshot written"
        );
        Ok(Some(SnapshotSummary {
            info,
            path,
            records,
            bytes,
            pause,
            took,
        }))
    }

    /// With writes held: the header and the encoded keys of `p` that change
    /// in place, and how many; `None` if there is nothing new to write.
    fn copy_in_place(
        &self,
        p: u32,
        topic: &str,
        newest: Option<u64>,
    ) -> Result<Option<(SnapshotInfo, Vec<u8>, u64)>, SnapshotError> {
        let t = &self.trees;
        let Some(offset) = t
            .ingest
            .get(keys::ingest::offset(topic, p))?
            .and_then(|v| keys::ingest::u64_value(&v))
        else {
            return Ok(None);
        };
        if newest.is_some_and(|n| n >= offset) {
            return Ok(None);
        }
        let tree = &t.partitions[p as usize];
        let mut ops = Ops::default();
        let mut n = 0u64;
        let id = TreeId::partition(p);
        let mut head = 0;
        if let Some(v) = tree.get(keys::META_KEY)? {
            let m: PartitionMeta = codec::decode(&v).map_err(|e| SnapshotError::Corrupt {
                path: format!("partition {p}"),
                detail: format!("its meta does not decode: {e}"),
            })?;
            head = m.head;
            ops.put(id, &keys::META_KEY, &v);
            n += 1;
        }
        let mut tokens = Vec::new();
        for kind in [keys::TWIN, keys::GRANT] {
            for kv in tree.scan_prefix([kind]) {
                let (k, v) = kv?;
                if kind == keys::GRANT {
                    tokens.extend(keys::seq_of_event_key(&k));
                }
                ops.put(id, &k, &v);
                n += 1;
            }
        }
        for (tree_id, prefix) in outside_prefixes(topic, p) {
            let Some(tree) = t.by_id(tree_id) else {
                continue;
            };
            for kv in tree.scan_prefix(&prefix) {
                let (k, v) = kv?;
                ops.put(tree_id, &k, &v);
                n += 1;
            }
        }
        for token in tokens {
            if let Some(v) = t.token_owners.get(token.to_be_bytes())? {
                ops.put(TreeId::TOKEN_OWNERS, &token.to_be_bytes(), &v);
                n += 1;
            }
        }
        let info = SnapshotInfo {
            format: SNAPSHOT_FORMAT,
            layout: u64::from(keys::LAYOUT_VERSION),
            partitions: self.partitions,
            partition: p,
            topic: topic.to_owned(),
            offset,
            head,
            taken_at_ms: now_ms(),
        };
        Ok(Some((info, ops.payload().to_vec(), n)))
    }

    /// Replace partition `info.partition`'s state by the snapshot in
    /// `path` (of `topic`). Returns once the partition can be applied and
    /// served: its state (twin records, fences, grants, offsets, outbox,
    /// refusals) and the event batches its dedupe window needs are in sled,
    /// durably. The rest of its history (older event batches, history
    /// entries, twin snapshots) is written by a background thread after;
    /// until it is, reads that need it are refused
    /// ([`crate::ReadError::HistoryLoading`]) and no snapshot of the
    /// partition is written. The caller makes sure nothing applies the
    /// partition while this runs (cluster mode: its consumer is paused, and
    /// it is not served).
    pub async fn load_partition_snapshot(
        self: &std::sync::Arc<Self>,
        path: &Path,
        topic: &str,
    ) -> Result<SnapshotSummary, SnapshotError> {
        let started = Instant::now();
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|e| SnapshotError::Io {
            path: shown.clone(),
            detail: e.to_string(),
        })?;
        // One open file for the whole load (a newer snapshot may replace
        // and delete this one meanwhile). Its clones share one position:
        // the phases below use it one after the other, each seeking first.
        let clone = |f: &File| {
            f.try_clone().map_err(|e| SnapshotError::Io {
                path: shown.clone(),
                detail: e.to_string(),
            })
        };
        let info = {
            let (f, shown, topic, partitions) = (
                clone(&file)?,
                shown.clone(),
                topic.to_owned(),
                self.partitions,
            );
            tokio::task::spawn_blocking(move || verify_file(f, &shown, &topic, partitions))
                .await
                .map_err(|_| SnapshotError::Closed)??
        };
        let p = info.info.partition;
        if self.backfill[p as usize].load(Ordering::Acquire) != 0 {
            return Err(SnapshotError::Mismatch {
                path: shown,
                detail: format!(
                    "partition {p} is still writing the history of an earlier snapshot"
                ),
            });
        }
        self.write_raw(vec![RawWrite {
            tree: TreeId::META,
            key: marker_key(LOADING_PREFIX, p),
            value: Some(topic.as_bytes().to_vec()),
        }])
        .await?;
        // Every round before the marker is applied: p's keys are replaced
        // under no one.
        let (records, rest) = {
            let store = self.clone();
            let (f, topic, state) = (clone(&file)?, topic.to_owned(), info.state_records);
            tokio::task::spawn_blocking(move || store.replace_state(f, &topic, p, state))
                .await
                .map_err(|_| SnapshotError::Closed)??
        };
        // History at or below the snapshot's head may be missing until the
        // backfill ends.
        let backfilling = rest.is_some() && info.info.head > 0;
        if backfilling {
            self.backfill[p as usize].store(info.info.head, Ordering::Release);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reload {
            partition: PartitionId(p),
            cluster: self.trees.cluster.clone(),
            ingest: self.trees.ingest.clone(),
            reply,
        })
        .map_err(|_| SnapshotError::Closed)?;
        rx.await.map_err(|_| SnapshotError::Closed)??;
        self.checkpoint_now().await?;
        // The load is done; the backfill's marker replaces it (a restart
        // before the backfill ends clears the partition, as a cut load does).
        let mut writes = vec![RawWrite {
            tree: TreeId::META,
            key: marker_key(LOADING_PREFIX, p),
            value: None,
        }];
        if backfilling {
            writes.push(RawWrite {
                tree: TreeId::META,
                key: marker_key(BACKFILL_PREFIX, p),
                value: Some(topic.as_bytes().to_vec()),
            });
        }
        self.write_raw(writes).await?;
        if let (true, Some(from)) = (backfilling, rest) {
            let store = self.clone();
            let f = clone(&file)?;
            let handle = std::thread::Builder::new()
                .name(format!("palisade-backfill-{p}"))
                .spawn(move || store.backfill_history(f, p, from))
                .map_err(|e| SnapshotError::Io {
                    path: shown.clone(),
                    detail: format!("cannot start the history backfill: {e}"),
                })?;
            self.backfills
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(handle);
        }
        let took = started.elapsed();
        let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
        self.metrics().add(
            "palisade_partition_snapshots_loaded_total",
            "Partition snapshots loaded by a node that gained the partition (cluster mode).",
            &[],
            1,
        );
        self.metrics().set_gauge(
            "palisade_partition_snapshot_load_seconds",
            "How long the last partition snapshot load took until the partition could be served, per partition (its older history is written after, in the background).",
            &[("partition", &p.to_string())],
            took.as_secs_f64(),
        );
        tracing::info!(
            partition = p,
            offset = info.info.offset,
            head = info.info.head,
            records,
            bytes,
            took_ms = took.as_millis() as u64,
            backfilling,
            "partition snapshot loaded"
        );
        Ok(SnapshotSummary {
            info: info.info,
            path: path.to_owned(),
            records,
            bytes,
            pause: std::time::Duration::ZERO,
            took,
        })
    }

    /// Whether partition `p`'s history is all there (no snapshot backfill
    /// running).
    pub fn history_complete(&self, p: u32) -> bool {
        self.backfill
            .get(p as usize)
            .is_none_or(|b| b.load(Ordering::Acquire) == 0)
    }

    /// Refuse a read that needs partition `p`'s history at or below `seq`
    /// while a backfill is writing it.
    pub(crate) fn history_ready(&self, p: PartitionId, seq: u64) -> Result<(), crate::ReadError> {
        let through = self
            .backfill
            .get(p.0 as usize)
            .map_or(0, |b| b.load(Ordering::Acquire));
        if through != 0 && seq <= through {
            return Err(crate::ReadError::HistoryLoading {
                partition: p.0,
                through,
            });
        }
        Ok(())
    }

    /// A checkpoint now: sled durable, the write-ahead log trimmed of every
    /// round applied so far.
    async fn checkpoint_now(&self) -> Result<(), SnapshotError> {
        let checkpointer = self
            .committer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(crate::commit::Committer::checkpointer)
            .ok_or(SnapshotError::Closed)?;
        tokio::task::spawn_blocking(move || checkpointer.checkpoint())
            .await
            .map_err(|_| SnapshotError::Closed)?
            .map_err(SnapshotError::Storage)
    }

    async fn write_raw(&self, writes: Vec<RawWrite>) -> Result<(), SnapshotError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Write {
            writes,
            reply: Some(reply),
        })
        .map_err(|_| SnapshotError::Closed)?;
        Ok(rx.await.map_err(|_| SnapshotError::Closed)??)
    }

    fn storage_failure(&self, p: u32, detail: String) -> SnapshotError {
        let f = StorageFailure::new(
            "snapshot load",
            std::io::ErrorKind::Other,
            format!("partition {p}: {detail}"),
        );
        SnapshotError::Storage(self.commit.health.fail(f, self.metrics()))
    }

    /// Clear partition `p`'s keys and write, straight into sled, the
    /// snapshot's state records and then its newest event batches, until
    /// they hold the partition's last [`DEDUPE_GENERATION`] events (its
    /// dedupe window). Returns the records written and where in the file
    /// the rest of the history starts (`None`: nothing is left). A sled
    /// error stops the store (fail-stop): the partition is half written,
    /// and only the marker (cleared on open) repairs it.
    fn replace_state(
        &self,
        file: File,
        topic: &str,
        p: u32,
        state_records: u64,
    ) -> Result<(u64, Option<u64>), SnapshotError> {
        clear(&self.trees, topic, p).map_err(|e| self.storage_failure(p, e.to_string()))?;
        let mut r = RecordReader::open(file).map_err(|e| self.read_failure(p, e))?;
        let mut written = 0u64;
        let mut events = 0usize;
        while let Some((tree, key, value)) = r.next().map_err(|e| self.read_failure(p, e))? {
            let state = written < state_records;
            if !state {
                // History: event batches come first, newest first.
                if key.first() != Some(&keys::EVENT) || events >= DEDUPE_GENERATION {
                    return Ok((written, Some(r.position_of_last())));
                }
                let b: crate::batch::EventBatch = codec::decode(&value)
                    .map_err(|e| self.read_failure(p, ReadFailure::Corrupt(e.to_string())))?;
                events += b.events.len();
            }
            put_record(&self.trees, tree, key, value)
                .map_err(|e| self.storage_failure(p, e.to_string()))?;
            written += 1;
        }
        Ok((written, None))
    }

    fn read_failure(&self, p: u32, e: ReadFailure) -> SnapshotError {
        // The file was checked whole before anything was changed: one that
        // no longer reads back was changed or cut since.
        self.storage_failure(
            p,
            format!(
                "the snapshot file changed while it was loaded: {}",
                e.text()
            ),
        )
    }

    /// The background part of a load: the rest of the snapshot's history
    /// from `from` (a byte position in the file), then a checkpoint, then
    /// the marker goes and the partition's history reads are open. Stops
    /// (leaving the marker, so the next open clears the partition) if the
    /// store closes or a write fails.
    fn backfill_history(self: std::sync::Arc<Self>, file: File, p: u32, from: u64) {
        let started = Instant::now();
        let run = || -> Result<u64, String> {
            let mut r = RecordReader::open_at(file, from).map_err(|e| e.text())?;
            let mut n = 0u64;
            while let Some((tree, key, value)) = r.next().map_err(|e| e.text())? {
                if tree != TreeId::partition(p) {
                    return Err(format!("a history record of tree {:#x}", tree.0));
                }
                put_record(&self.trees, tree, key, value).map_err(|e| e.to_string())?;
                n += 1;
                if n.is_multiple_of(LOAD_BATCH as u64) && self.closing.load(Ordering::Acquire) {
                    return Err("the store is closing".into());
                }
            }
            Ok(n)
        };
        let n = match run() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(partition = p, error = %e, "partition snapshot: the history backfill stopped; the partition's history before the snapshot is incomplete until the store restarts (which clears the partition, rebuilt when next assigned)");
                return;
            }
        };
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
            return;
        };
        let finished = rt.block_on(async {
            self.checkpoint_now().await?;
            self.write_raw(vec![RawWrite {
                tree: TreeId::META,
                key: marker_key(BACKFILL_PREFIX, p),
                value: None,
            }])
            .await
        });
        match finished {
            Ok(()) => {
                self.backfill[p as usize].store(0, Ordering::Release);
                let took = started.elapsed();
                self.metrics().set_gauge(
                    "palisade_partition_snapshot_backfill_seconds",
                    "How long the last history backfill after a partition snapshot load took, per partition.",
                    &[("partition", &p.to_string())],
                    took.as_secs_f64(),
                );
                tracing::info!(
                    partition = p,
                    records = n,
                    took_ms = took.as_millis() as u64,
                    "partition snapshot: history backfilled; the partition's whole history is readable"
                );
            }
            Err(e) => {
                tracing::warn!(partition = p, error = %e, "partition snapshot: history written but not made durable; the next open clears the partition")
            }
        }
    }
}

/// Write one record straight into sled (a plain insert: sled's batches
/// take its transaction path, measured slower for this).
fn put_record(
    trees: &Trees,
    tree: TreeId,
    key: Vec<u8>,
    value: Vec<u8>,
) -> Result<(), sled::Error> {
    if let Some(t) = trees.by_id(tree) {
        t.insert(key, value)?;
    }
    Ok(())
}

enum ReadFailure {
    Io(String),
    Corrupt(String),
}

impl ReadFailure {
    fn text(&self) -> String {
        match self {
            Self::Io(d) | Self::Corrupt(d) => d.clone(),
        }
    }
}

/// The header of the file, after its magic, and the header's end.
fn read_header(r: &mut impl Read) -> Result<(SnapshotInfo, u64, u64), ReadFailure> {
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .map_err(|e| ReadFailure::Io(e.to_string()))?;
    if &magic != SNAPSHOT_MAGIC {
        return Err(ReadFailure::Corrupt(
            "not a partition snapshot (bad magic)".into(),
        ));
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .map_err(|e| ReadFailure::Io(e.to_string()))?;
    let len = u32::from_be_bytes(len);
    if len > MAX_HEADER {
        return Err(ReadFailure::Corrupt(format!("header of {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    r.read_exact(&mut header)
        .map_err(|e| ReadFailure::Io(e.to_string()))?;
    let v = serde_json::from_slice::<Value>(&header).ok();
    let info = v
        .as_ref()
        .and_then(SnapshotInfo::from_json)
        .ok_or_else(|| ReadFailure::Corrupt("its header is not a snapshot header".into()))?;
    let state_records = v
        .as_ref()
        .and_then(|v| v.get("state_records")?.as_u64())
        .ok_or_else(|| ReadFailure::Corrupt("its header has no state_records".into()))?;
    Ok((info, state_records, 12 + u64::from(len)))
}

/// Reads a snapshot's records one by one, from the first or from a given
/// position, up to the digest.
struct RecordReader {
    r: BufReader<File>,
    /// The header, and how many state records lead the file.
    info: SnapshotInfo,
    state_records: u64,
    /// Where the next record starts.
    at: u64,
    /// Where the last one read started.
    last: u64,
    end: u64,
}

impl RecordReader {
    fn open(file: File) -> Result<Self, ReadFailure> {
        Self::open_at(file, 0)
    }

    /// At byte `from` (0: the first record).
    fn open_at(mut file: File, from: u64) -> Result<Self, ReadFailure> {
        use std::io::Seek;
        let total = file
            .metadata()
            .map_err(|e| ReadFailure::Io(e.to_string()))?
            .len();
        file.seek(std::io::SeekFrom::Start(0))
            .map_err(|e| ReadFailure::Io(e.to_string()))?;
        let mut r = BufReader::with_capacity(1 << 20, file);
        let (info, state_records, start) = read_header(&mut r)?;
        let end = total
            .checked_sub(32)
            .filter(|e| *e >= start)
            .ok_or_else(|| ReadFailure::Corrupt("shorter than its header and digest".into()))?;
        let at = from.max(start);
        r.seek(std::io::SeekFrom::Start(at))
            .map_err(|e| ReadFailure::Io(e.to_string()))?;
        Ok(Self {
            r,
            info,
            state_records,
            at,
            last: at,
            end,
        })
    }

    fn position_of_last(&self) -> u64 {
        self.last
    }

    #[allow(clippy::type_complexity)]
    fn next(&mut self) -> Result<Option<(TreeId, Vec<u8>, Vec<u8>)>, ReadFailure> {
        if self.at >= self.end {
            return Ok(None);
        }
        let cut = || ReadFailure::Corrupt("a record is cut".into());
        let io = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                cut()
            } else {
                ReadFailure::Io(e.to_string())
            }
        };
        let mut head = [0u8; 9];
        self.r.read_exact(&mut head).map_err(io)?;
        let tree = TreeId(u32::from_be_bytes([head[0], head[1], head[2], head[3]]));
        if head[4] != 1 {
            return Err(ReadFailure::Corrupt("a record is not a put".into()));
        }
        let klen = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
        let left = self.end - self.at;
        if u64::from(klen) + 13 > left {
            return Err(cut());
        }
        let mut key = vec![0u8; klen as usize];
        self.r.read_exact(&mut key).map_err(io)?;
        let mut vlen = [0u8; 4];
        self.r.read_exact(&mut vlen).map_err(io)?;
        let vlen = u32::from_be_bytes(vlen);
        let n = 13 + u64::from(klen) + u64::from(vlen);
        if n > left {
            return Err(cut());
        }
        let mut value = vec![0u8; vlen as usize];
        self.r.read_exact(&mut value).map_err(io)?;
        self.last = self.at;
        self.at += n;
        Ok(Some((tree, key, value)))
    }
}

/// A checked snapshot: its header and how many state records lead it.
struct Checked {
    info: SnapshotInfo,
    state_records: u64,
}

/// Check the snapshot at `path` before anything is changed: its digest,
/// its header against the store (`partitions`) and `topic`, and that every
/// key of its state belongs to its partition (the history's are checked as
/// they are written).
pub fn verify(path: &Path, topic: &str, partitions: u32) -> Result<SnapshotInfo, SnapshotError> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|e| SnapshotError::Io {
        path: shown.clone(),
        detail: e.to_string(),
    })?;
    verify_file(file, &shown, topic, partitions).map(|c| c.info)
}

fn verify_file(
    mut file: File,
    shown: &str,
    topic: &str,
    partitions: u32,
) -> Result<Checked, SnapshotError> {
    let io = |detail: String| SnapshotError::Io {
        path: shown.to_owned(),
        detail,
    };
    let corrupt = |detail: String| SnapshotError::Corrupt {
        path: shown.to_owned(),
        detail,
    };
    let mismatch = |detail: String| SnapshotError::Mismatch {
        path: shown.to_owned(),
        detail,
    };
    let failure = |e: ReadFailure| match e {
        ReadFailure::Io(d) => io(d),
        ReadFailure::Corrupt(d) => corrupt(d),
    };
    // The digest first: SHA-256 of everything before the last 32 bytes.
    let total = file.metadata().map_err(|e| io(e.to_string()))?.len();
    let body = total
        .checked_sub(32)
        .ok_or_else(|| corrupt("shorter than its digest".into()))?;
    let mut hash = Sha256::new();
    let mut left = body;
    let mut chunk = vec![0u8; 1 << 20];
    while left > 0 {
        let want = usize::try_from(left.min(chunk.len() as u64)).unwrap_or(chunk.len());
        file.read_exact(&mut chunk[..want])
            .map_err(|e| io(e.to_string()))?;
        hash.update(&chunk[..want]);
        left -= want as u64;
    }
    let mut digest = [0u8; 32];
    file.read_exact(&mut digest)
        .map_err(|e| io(e.to_string()))?;
    if hash.finalize().as_slice() != digest {
        return Err(corrupt(
            "its SHA-256 does not match (cut or changed)".into(),
        ));
    }
    let mut records = RecordReader::open(file).map_err(failure)?;
    let (info, state_records) = (records.info.clone(), records.state_records);
    if info.format != SNAPSHOT_FORMAT {
        return Err(mismatch(format!(
            "format {} (this build reads {SNAPSHOT_FORMAT})",
            info.format
        )));
    }
    if info.layout != u64::from(keys::LAYOUT_VERSION) {
        return Err(mismatch(format!(
            "store layout {} (this store is {})",
            info.layout,
            keys::LAYOUT_VERSION
        )));
    }
    if info.partitions != partitions || info.partition >= partitions {
        return Err(mismatch(format!(
            "partition {} of {} (this store has {partitions})",
            info.partition, info.partitions
        )));
    }
    if info.topic != topic {
        return Err(mismatch(format!(
            "topic {:?} (this node consumes {topic:?})",
            info.topic
        )));
    }
    // Every state key is one of the partition's: grants first (token
    // owners belong only if the partition holds their grant).
    let mut grants = Vec::new();
    let p = info.partition;
    let outside = outside_prefixes(topic, p);
    for _ in 0..state_records {
        let Some((tree, key, _)) = records.next().map_err(failure)? else {
            return Err(corrupt(format!(
                "it has fewer than the {state_records} state records its header says"
            )));
        };
        if tree == TreeId::partition(p) && key.first() == Some(&keys::GRANT) {
            grants.extend(keys::seq_of_event_key(&key));
        }
        if !belongs(tree, &key, p, &outside, &grants) {
            return Err(corrupt(format!(
                "a key of tree {:#x} does not belong to partition {p}",
                tree.0
            )));
        }
    }
    Ok(Checked {
        info,
        state_records,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{IngestOutcome, IngestRecord, Source, StoreConfig};
    use palisade_core::{partition_for, FencingToken, NewEvent, Scope, TwinId};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_load_cut_short_clears_its_partition_on_open_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = || StoreConfig {
            partitions: Some(2),
            ..StoreConfig::default()
        };
        let twin_in = |p: u32| {
            (0..100)
                .map(|i| TwinId::new(format!("t{i}")).unwrap())
                .find(|t| partition_for(t, 2).0 == p)
                .unwrap()
        };
        {
            let store = Store::open(dir.path(), cfg()).unwrap();
            for p in 0..2 {
                let twin = twin_in(p);
                store
                    .register_grant(FencingToken(7), Scope::Twin(twin.clone()), "w".into())
                    .await
                    .unwrap();
                let rec = IngestRecord::Append {
                    twin,
                    token: FencingToken(7),
                    events: vec![NewEvent {
                        event_id: "e".into(),
                        event_type: "t".into(),
                        patch: serde_json::Map::new(),
                        hlc: None,
                    }],
                    if_match: None,
                    effects: Vec::new(),
                };
                let o = store
                    .enqueue_ingest(&Source::new("tw", p), 0, rec)
                    .await
                    .unwrap()
                    .await
                    .unwrap()
                    .unwrap();
                assert!(matches!(o, IngestOutcome::Applied(_)), "{o:?}");
            }
            store.close().await;
        }
        // What a load leaves if the process dies before it finishes.
        {
            let Ok(db) = crate::store::open_sled(dir.path(), 1 << 20) else {
                panic!("sled does not open");
            };
            db.open_tree("meta")
                .unwrap()
                .insert(marker_key(LOADING_PREFIX, 1), &b"tw"[..])
                .unwrap();
            db.flush().unwrap();
        }
        let store = Store::open(dir.path(), cfg()).unwrap();
        assert_eq!(store.source_offset(&Source::new("tw", 1)).unwrap(), None);
        assert_eq!(store.partition_infos().unwrap()[1].head, 0);
        assert!(store
            .twin(&twin_in(1), crate::AsOf::Latest)
            .unwrap()
            .is_none());
        // Partition 0 is untouched, and the marker is gone.
        assert!(store.history_complete(1));
        assert_eq!(store.source_offset(&Source::new("tw", 0)).unwrap(), Some(0));
        assert_eq!(store.partition_infos().unwrap()[0].head, 1);
        assert!(store
            .trees
            .meta
            .get(marker_key(LOADING_PREFIX, 1))
            .unwrap()
            .is_none());
        store.close().await;
    }

    #[tokio::test]
    async fn while_a_backfill_writes_history_only_current_state_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            dir.path(),
            StoreConfig {
                partitions: Some(1),
                ..StoreConfig::default()
            },
        )
        .unwrap();
        let twin = TwinId::new("t").unwrap();
        store
            .register_grant(FencingToken(3), Scope::Twin(twin.clone()), "w".into())
            .await
            .unwrap();
        for i in 0..3 {
            let mut patch = serde_json::Map::new();
            patch.insert("i".into(), i.into());
            store
                .append(
                    twin.clone(),
                    FencingToken(3),
                    vec![NewEvent {
                        event_id: format!("e{i}"),
                        event_type: "t".into(),
                        patch,
                        hlc: None,
                    }],
                    None,
                )
                .await
                .unwrap();
        }
        // As a load leaves it: history through seq 2 not written yet.
        store.backfill[0].store(2, Ordering::Release);
        let loading = |r| matches!(r, Err(crate::ReadError::HistoryLoading { through: 2, .. }));
        assert!(loading(store.twin_events(&twin, 0, 10).map(drop)));
        assert!(loading(store.twin_events(&twin, 1, 10).map(drop)));
        assert!(loading(
            store.partition_events(PartitionId(0), 0, 10).map(drop)
        ));
        assert!(loading(store.twin(&twin, crate::AsOf::Seq(1)).map(drop)));
        // After the snapshot's head, and the current state: served.
        assert_eq!(store.twin_events(&twin, 2, 10).unwrap().len(), 1);
        assert_eq!(
            store
                .twin(&twin, crate::AsOf::Latest)
                .unwrap()
                .unwrap()
                .version,
            3
        );
        assert!(store
            .write_partition_snapshot(0, "tw", dir.path())
            .unwrap()
            .is_none());
        // Nor a backup: it would miss the history not written yet.
        let backup = store.backup(&mut |_, _| Ok(()));
        assert!(
            matches!(backup, Err(crate::backup::BackupError::Refused(_))),
            "{backup:?}"
        );
        store.backfill[0].store(0, Ordering::Release);
        assert_eq!(store.twin_events(&twin, 0, 10).unwrap().len(), 3);
        store.close().await;
    }
}
