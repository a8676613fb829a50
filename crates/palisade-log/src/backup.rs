//! Online backup of a running store and offline restore from it
//! (`palisade backup`, `palisade restore`; byte layout in `docs/backup.md`,
//! decision 0029).
//!
//! **Backup.** [`Store::backup`] sends the sequencer a pause command: the
//! sequencer closes its open round and a round holding only an
//! acknowledgement, and once the committer has synced and applied both
//! (rounds are applied in order), sled holds exactly what was decided, at a
//! round boundary. While the sequencer waits, the backup reads every
//! partition's head and the keys that change in place (store metadata, the
//! lease authority's records and token counter, token owners, cluster owner
//! fences, Kafka source offsets and dead letters, the outbox's effects and
//! their delivery states, and per partition its
//! meta, twin records and token grants) into memory, notes the audit log's
//! and the refusal journal's last keys, and lets the sequencer go on. Then,
//! while writes flow, it copies the append-only keys up to the noted points:
//! event batches and history entries with a first seq at or below the head,
//! snapshots at or below it, audit records and refusals at or below the
//! noted keys. Nothing below those points changes after the pause except
//! the pruning of the oldest audit records and refusals (past their caps),
//! so the copy is the store as of the pause, minus at most what was pruned
//! meanwhile.
//!
//! The bytes go out as frames (`kind:u8 ++ len:u32 BE ++ bytes`, see
//! [`frame`]): the data file's content in chunks, progress, and at the end
//! the manifest (with the data file's length and SHA-256) or an error.
//!
//! **Restore.** [`restore`] checks the manifest and the data file's length
//! and SHA-256 before it creates anything, refuses a folder that is not
//! empty, writes every record into a new sled database, then applies the
//! token rule: the lease records are dropped, the token counter becomes the
//! backup's highest token plus a jump, and every fence (each partition's,
//! each twin's) is raised to the new counter, so no token issued before the
//! restore is accepted anywhere and none is ever issued again. With an etcd
//! authority the counter is etcd's revision, which the restore cannot read:
//! the operator passes it (`fence_at`) and the fences are raised to it.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use palisade_core::codec;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::keys;
use crate::records::{PartitionMeta, TwinRecord};
use crate::store::Store;
use crate::wal::TreeId;
use crate::writer::{Command, MAX_PAUSE};
use crate::StorageFailure;

/// The data file in a backup folder.
pub const DATA_FILE: &str = "data.pbk";
/// The manifest in a backup folder (written last).
pub const MANIFEST_FILE: &str = "manifest.json";
/// First bytes of the data file.
pub const DATA_MAGIC: &[u8; 8] = b"PALBAK01";
/// The backup format version (`palisade_backup` in the manifest).
pub const BACKUP_FORMAT: u64 = 1;
/// The tree id of the data file's first record: the backup's facts.
pub const INFO_TREE: u32 = 0xFFFF_FFFF;
/// The default distance between the backup's token counter and the
/// restored one.
pub const DEFAULT_TOKEN_JUMP: u64 = 1_000_000;
/// Data frames are cut at this size.
const CHUNK: usize = 256 << 10;
/// A progress frame every this many copied events (and at the end).
const PROGRESS_EVERY: u64 = 20_000;
/// A record's key or value is at most this long (sled values are bounded
/// by the store far below it): a larger length is damage.
const MAX_FIELD: u32 = 1 << 30;

/// Kinds of the frames a backup is streamed in.
pub mod frame {
    /// Bytes to append to the data file.
    pub const DATA: u8 = 1;
    /// The manifest (JSON); the last frame of a complete backup.
    pub const MANIFEST: u8 = 2;
    /// The backup failed on the server: a UTF-8 message; the last frame.
    pub const ERROR: u8 = 3;
    /// Progress: events copied, events in the backup (`u64` BE each).
    pub const PROGRESS: u8 = 4;
}

/// What went wrong in a backup or a restore.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error(transparent)]
    Storage(StorageFailure),
    #[error("the store is shutting down")]
    Closed,
    #[error("the backup held writes for {0:?}, longer than the sequencer waits (60 s); writes went on meanwhile, so the copy would not be one point in time: not taken")]
    PauseTooLong(Duration),
    #[error("the backup is damaged or incomplete: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Refused(String),
    #[error("the receiver went away")]
    Gone,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackupError {
    let what = what.into();
    move |source| BackupError::Io { what, source }
}

/// The facts of a backup, written as the data file's first record and
/// repeated in the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub layout: u8,
    pub partitions: u32,
    /// Each partition's head (latest seq) at the pause.
    pub heads: Vec<u64>,
    /// The embedded authority's token counter at the pause.
    pub last_token: u64,
    /// `embedded` or `etcd`.
    pub lease_backend: String,
    pub taken_at_ms: u64,
    /// The last audit record's seq at the pause (0: none).
    pub audit_through: u64,
    /// Per partition, the last refusal journal seq at the pause (0: none).
    pub refusals_through: Vec<u64>,
    /// How long writes were held, in microseconds.
    pub pause_us: u64,
}

impl Info {
    pub fn to_json(&self) -> Value {
        json!({
            "layout": self.layout,
            "partitions": self.partitions,
            "heads": self.heads,
            "last_token": self.last_token,
            "lease_backend": self.lease_backend,
            "taken_at_ms": self.taken_at_ms,
            "audit_through": self.audit_through,
            "refusals_through": self.refusals_through,
            "pause_us": self.pause_us,
        })
    }

    pub fn from_json(v: &Value) -> Result<Self, BackupError> {
        let bad = |f: &str| BackupError::Corrupt(format!("info: `{f}` missing or not valid"));
        let u = |f: &str| v[f].as_u64().ok_or_else(|| bad(f));
        let list = |f: &str| -> Result<Vec<u64>, BackupError> {
            v[f].as_array()
                .ok_or_else(|| bad(f))?
                .iter()
                .map(|x| x.as_u64().ok_or_else(|| bad(f)))
                .collect()
        };
        let info = Self {
            layout: u8::try_from(u("layout")?).map_err(|_| bad("layout"))?,
            partitions: u32::try_from(u("partitions")?).map_err(|_| bad("partitions"))?,
            heads: list("heads")?,
            last_token: u("last_token")?,
            lease_backend: v["lease_backend"]
                .as_str()
                .ok_or_else(|| bad("lease_backend"))?
                .to_owned(),
            taken_at_ms: u("taken_at_ms")?,
            audit_through: u("audit_through")?,
            refusals_through: list("refusals_through")?,
            pause_us: u("pause_us")?,
        };
        let n = info.partitions as usize;
        if n == 0 || info.heads.len() != n || info.refusals_through.len() != n {
            return Err(bad("partitions"));
        }
        Ok(info)
    }
}

/// What a finished backup reports (also in its manifest).
#[derive(Debug, Clone)]
pub struct BackupSummary {
    pub info: Info,
    pub records: u64,
    pub data_bytes: u64,
    pub pause: Duration,
}

/// Encodes records into data frames and hashes them.
struct DataOut<'a> {
    out: &'a mut dyn FnMut(u8, &[u8]) -> std::io::Result<()>,
    buf: Vec<u8>,
    hash: Sha256,
    bytes: u64,
    records: u64,
}

impl DataOut<'_> {
    fn raw(&mut self, b: &[u8]) -> Result<(), BackupError> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    fn record(&mut self, tree: u32, key: &[u8], value: &[u8]) -> Result<(), BackupError> {
        let mut r = Vec::with_capacity(13 + key.len() + value.len());
        encode_record(&mut r, tree, key, value);
        self.records += 1;
        self.raw(&r)
    }

    fn flush(&mut self) -> Result<(), BackupError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.hash.update(&self.buf);
        self.bytes += self.buf.len() as u64;
        (self.out)(frame::DATA, &self.buf).map_err(|_| BackupError::Gone)?;
        self.buf.clear();
        Ok(())
    }

    fn progress(&mut self, done: u64, total: u64) -> Result<(), BackupError> {
        let mut p = [0u8; 16];
        p[..8].copy_from_slice(&done.to_be_bytes());
        p[8..].copy_from_slice(&total.to_be_bytes());
        (self.out)(frame::PROGRESS, &p).map_err(|_| BackupError::Gone)
    }
}

/// `tree:u32 BE ++ 1 ++ key_len:u32 BE ++ key ++ value_len:u32 BE ++ value`,
/// the write-ahead log's put op.
fn encode_record(r: &mut Vec<u8>, tree: u32, key: &[u8], value: &[u8]) {
    r.extend_from_slice(&tree.to_be_bytes());
    r.push(1);
    r.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_be_bytes());
    r.extend_from_slice(key);
    r.extend_from_slice(&u32::try_from(value.len()).unwrap_or(u32::MAX).to_be_bytes());
    r.extend_from_slice(value);
}

/// Encode one frame.
pub fn encode_frame(kind: u8, bytes: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + bytes.len());
    f.push(kind);
    f.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    f.extend_from_slice(bytes);
    f
}

/// Splits a byte stream into frames, whatever the chunking.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame, if the bytes pushed hold one.
    pub fn next_frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let len = u32::from_be_bytes(self.buf.get(1..5)?.try_into().ok()?) as usize;
        if self.buf.len() < 5 + len {
            return None;
        }
        let kind = self.buf[0];
        let body = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Some((kind, body))
    }

    /// Bytes received that do not make a whole frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

fn last_u64_key(k: &[u8]) -> Option<u64> {
    let start = k.len().checked_sub(8)?;
    Some(u64::from_be_bytes(k[start..].try_into().ok()?))
}

fn now_ms() -> u64 {
    crate::ingest::now_ms()
}

/// The keys copied while writes are held.
struct Paused {
    info: Info,
    /// Encoded records.
    records: Vec<u8>,
    count: u64,
}

impl Store {
    /// Take a backup of the running store, sending it as frames to `out`
    /// (`frame::DATA`, `frame::PROGRESS`, then `frame::MANIFEST`; the
    /// caller sends `frame::ERROR` on an error). Blocking: run it off the
    /// async runtime. Writes are held only while the mutable keys are read
    /// into memory (reported as `pause`).
    pub fn backup(
        &self,
        out: &mut dyn FnMut(u8, &[u8]) -> std::io::Result<()>,
    ) -> Result<BackupSummary, BackupError> {
        // A partition loaded from a partition snapshot whose older history
        // is still being written (cluster mode, handoff.rs): a copy now
        // would miss it.
        if let Some(p) = (0..self.partitions).find(|p| !self.history_complete(*p)) {
            return Err(BackupError::Refused(format!(
                "partition {p}'s history is still being written from a partition snapshot; take the backup once it is (palisade_partition_snapshot_backfill_seconds appears when it is done)"
            )));
        }
        let (paused_tx, paused_rx) = mpsc::channel();
        let (resume_tx, resume_rx) = mpsc::channel();
        self.send(Command::Pause {
            paused: paused_tx,
            resume: resume_rx,
        })
        .map_err(|_| BackupError::Closed)?;
        match paused_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(f)) => return Err(BackupError::Storage(f)),
            Err(_) => return Err(BackupError::Closed),
        }
        let started = Instant::now();
        let copied = self.copy_paused();
        // Writes go on from here, whatever the copy's outcome.
        drop(resume_tx);
        let pause = started.elapsed();
        let mut paused = copied?;
        if pause >= MAX_PAUSE {
            return Err(BackupError::PauseTooLong(pause));
        }
        paused.info.pause_us = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX);
        tracing::info!(
            pause_us = paused.info.pause_us,
            partitions = self.partitions,
            events = paused.info.heads.iter().sum::<u64>(),
            "backup: writes resumed; copying the append-only keys"
        );

        let mut d = DataOut {
            out,
            buf: Vec::with_capacity(CHUNK * 2),
            hash: Sha256::new(),
            bytes: 0,
            records: 0,
        };
        d.raw(DATA_MAGIC)?;
        let info_text = paused.info.to_json().to_string();
        d.record(INFO_TREE, b"info", info_text.as_bytes())?;
        d.raw(&paused.records)?;
        d.records += paused.count;
        drop(paused.records);

        let total: u64 = paused.info.heads.iter().sum();
        let mut done_before = 0u64;
        let mut last_progress = 0u64;
        d.progress(0, total)?;
        for (p, tree) in self.trees.partitions.iter().enumerate() {
            let id = u32::try_from(p).unwrap_or(u32::MAX);
            let head = paused.info.heads[p];
            // Event batches: first seq <= head (a batch is never extended).
            let mut hi = vec![keys::EVENT];
            hi.extend_from_slice(&head.to_be_bytes());
            for kv in tree.range(vec![keys::EVENT]..=hi) {
                let (k, v) = kv?;
                d.record(id, &k, &v)?;
                let at = done_before + last_u64_key(&k).unwrap_or(0);
                if at >= last_progress + PROGRESS_EVERY {
                    last_progress = at;
                    d.flush()?;
                    d.progress(at, total)?;
                }
            }
            // History entries and snapshots: their seq (the key's last 8
            // bytes) at or below the head.
            for kind in [keys::HISTORY, keys::SNAPSHOT] {
                for kv in tree.scan_prefix([kind]) {
                    let (k, v) = kv?;
                    if last_u64_key(&k).is_some_and(|s| s <= head) {
                        d.record(id, &k, &v)?;
                    }
                }
            }
            done_before += head;
        }
        if paused.info.audit_through > 0 {
            for kv in self
                .trees
                .audit
                .range(..=paused.info.audit_through.to_be_bytes())
            {
                let (k, v) = kv?;
                d.record(TreeId::AUDIT.0, &k, &v)?;
            }
        }
        for (p, through) in paused.info.refusals_through.iter().enumerate() {
            let p = u32::try_from(p).unwrap_or(u32::MAX);
            if *through > 0 {
                let range = crate::refusals::key(p, 0)..=crate::refusals::key(p, *through);
                for kv in self.trees.refusals.range(range) {
                    let (k, v) = kv?;
                    d.record(TreeId::REFUSALS.0, &k, &v)?;
                }
            }
        }
        d.flush()?;
        d.progress(total, total)?;
        let sha = hex(&d.hash.clone().finalize());
        let manifest = json!({
            "palisade_backup": BACKUP_FORMAT,
            "data_file": DATA_FILE,
            "data_bytes": d.bytes,
            "data_sha256": sha,
            "records": d.records,
            "info": paused.info.to_json(),
        });
        let text = serde_json::to_string_pretty(&manifest).unwrap_or_default() + "\n";
        (d.out)(frame::MANIFEST, text.as_bytes()).map_err(|_| BackupError::Gone)?;
        tracing::info!(
            bytes = d.bytes,
            records = d.records,
            pause_us = paused.info.pause_us,
            "backup sent"
        );
        Ok(BackupSummary {
            records: d.records,
            data_bytes: d.bytes,
            info: paused.info,
            pause,
        })
    }

    /// Read, with writes held, every key that changes in place.
    fn copy_paused(&self) -> Result<Paused, BackupError> {
        let t = &self.trees;
        let mut records = Vec::new();
        let mut count = 0u64;
        let mut put = |tree: u32, k: &[u8], v: &[u8]| {
            encode_record(&mut records, tree, k, v);
            count += 1;
        };
        for (id, tree) in [
            (TreeId::META, &t.meta),
            (TreeId::LEASES, &t.leases),
            (TreeId::TOKEN_OWNERS, &t.token_owners),
            (TreeId::CLUSTER, &t.cluster),
            (TreeId::INGEST, &t.ingest),
            // Delivery states change in place (the fenced outbox): read
            // with writes held, like the keys above.
            (TreeId::OUTBOX, &t.outbox),
        ] {
            for kv in tree.iter() {
                let (k, v) = kv?;
                put(id.0, &k, &v);
            }
        }
        let mut heads = Vec::with_capacity(t.partitions.len());
        for (p, tree) in t.partitions.iter().enumerate() {
            let id = u32::try_from(p).unwrap_or(u32::MAX);
            let mut head = 0;
            if let Some(v) = tree.get(keys::META_KEY)? {
                let m: PartitionMeta = codec::decode(&v).map_err(|e| {
                    BackupError::Corrupt(format!("partition {p}: its meta does not decode: {e}"))
                })?;
                head = m.head;
                put(id, &keys::META_KEY, &v);
            }
            heads.push(head);
            for kind in [keys::TWIN, keys::GRANT] {
                for kv in tree.scan_prefix([kind]) {
                    let (k, v) = kv?;
                    put(id, &k, &v);
                }
            }
        }
        let audit_through = t
            .audit
            .last()?
            .and_then(|(k, _)| last_u64_key(&k))
            .unwrap_or(0);
        let mut refusals_through = Vec::with_capacity(t.partitions.len());
        for p in 0..self.partitions {
            let range = crate::refusals::key(p, 0)..=crate::refusals::key(p, u64::MAX);
            let last = t.refusals.range(range).next_back().transpose()?;
            refusals_through.push(last.and_then(|(k, _)| last_u64_key(&k)).unwrap_or(0));
        }
        let last_token = t
            .leases
            .get([0x00])?
            .and_then(|v| keys::ingest::u64_value(&v))
            .unwrap_or(0);
        let lease_backend = match t.meta.get(crate::cluster::LEASE_BACKEND_KEY)? {
            Some(v) => String::from_utf8_lossy(&v).into_owned(),
            None => "embedded".to_owned(),
        };
        Ok(Paused {
            info: Info {
                layout: keys::LAYOUT_VERSION,
                partitions: self.partitions,
                heads,
                last_token,
                lease_backend,
                taken_at_ms: now_ms(),
                audit_through,
                refusals_through,
                pause_us: 0,
            },
            records,
            count,
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// How a restore treats tokens (decision 0029, `docs/backup.md`).
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Embedded authority: the restored counter is the backup's highest
    /// token plus this (at least 1).
    pub token_jump: u64,
    /// etcd authority: etcd's current revision, read by the operator; every
    /// fence is raised to it. Required for a store whose tokens come from
    /// etcd, refused for an embedded one.
    pub fence_at: Option<u64>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self {
            token_jump: DEFAULT_TOKEN_JUMP,
            fence_at: None,
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone)]
pub struct RestoreSummary {
    pub info: Info,
    pub records: u64,
    /// Every fence of the restored store is at least this, and (embedded)
    /// its token counter is this.
    pub fence: u64,
    /// The highest token the backup shows was issued.
    pub highest_token_seen: u64,
    /// Lease records dropped.
    pub leases_dropped: u64,
}

/// The manifest of a backup folder, checked: format, data length and hash.
/// Returns the parsed manifest's info and expected data length.
fn read_manifest(from: &Path) -> Result<(Value, u64, String), BackupError> {
    let path = from.join(MANIFEST_FILE);
    let text = std::fs::read(&path).map_err(io(format!(
        "cannot read {} (a backup folder holds {MANIFEST_FILE} and {DATA_FILE}; a backup without its manifest did not finish)",
        path.display()
    )))?;
    let m: Value = serde_json::from_slice(&text)
        .map_err(|e| BackupError::Corrupt(format!("{MANIFEST_FILE} is not JSON: {e}")))?;
    if m["palisade_backup"].as_u64() != Some(BACKUP_FORMAT) {
        return Err(BackupError::Refused(format!(
            "{MANIFEST_FILE}: palisade_backup is {}, this build reads format {BACKUP_FORMAT}",
            m["palisade_backup"]
        )));
    }
    let bytes = m["data_bytes"]
        .as_u64()
        .ok_or_else(|| BackupError::Corrupt("manifest: no data_bytes".into()))?;
    let sha = m["data_sha256"]
        .as_str()
        .filter(|s| s.len() == 64)
        .ok_or_else(|| BackupError::Corrupt("manifest: no data_sha256".into()))?
        .to_owned();
    Ok((m, bytes, sha))
}

/// Check a backup folder without restoring it: the manifest, the data
/// file's length and SHA-256, and that its records parse. Returns its info.
pub fn verify(from: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Info, BackupError> {
    let (m, bytes, sha) = read_manifest(from)?;
    let data = from.join(DATA_FILE);
    let len = std::fs::metadata(&data)
        .map_err(io(format!("cannot read {}", data.display())))?
        .len();
    if len != bytes {
        return Err(BackupError::Corrupt(format!(
            "{DATA_FILE} holds {len} bytes, the manifest says {bytes} (truncated or appended to)"
        )));
    }
    let mut f =
        BufReader::new(File::open(&data).map_err(io(format!("cannot open {}", data.display())))?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(io(format!("cannot read {}", data.display())))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done, bytes);
    }
    let got = hex(&h.finalize());
    if got != sha {
        return Err(BackupError::Corrupt(format!(
            "{DATA_FILE}'s SHA-256 is {got}, the manifest says {sha}"
        )));
    }
    let info = Info::from_json(&m["info"])?;
    Ok(info)
}

/// One record: tree, key, value.
type Record = (u32, Vec<u8>, Vec<u8>);

/// Reads the records of a data file.
struct Records<R: Read> {
    r: R,
    read: u64,
}

impl<R: Read> Records<R> {
    fn exact(&mut self, n: usize) -> Result<Vec<u8>, BackupError> {
        let mut b = vec![0u8; n];
        self.r.read_exact(&mut b).map_err(|e| {
            BackupError::Corrupt(format!("a record is cut short at byte {}: {e}", self.read))
        })?;
        self.read += n as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, BackupError> {
        let b = self.exact(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The next record, or `None` at the end of the file.
    fn next_record(&mut self) -> Result<Option<Record>, BackupError> {
        let mut first = [0u8; 1];
        match self.r.read(&mut first) {
            Ok(0) => return Ok(None),
            Ok(_) => self.read += 1,
            Err(e) => return Err(BackupError::Corrupt(format!("read: {e}"))),
        }
        let rest = self.exact(3)?;
        let tree = u32::from_be_bytes([first[0], rest[0], rest[1], rest[2]]);
        let at = self.read - 4;
        let kind = self.exact(1)?[0];
        if kind != 1 {
            return Err(BackupError::Corrupt(format!(
                "record at byte {at}: kind {kind}, not 1 (put)"
            )));
        }
        let klen = self.u32()?;
        if klen > MAX_FIELD {
            return Err(BackupError::Corrupt(format!(
                "record at byte {at}: key length {klen}"
            )));
        }
        let key = self.exact(klen as usize)?;
        let vlen = self.u32()?;
        if vlen > MAX_FIELD {
            return Err(BackupError::Corrupt(format!(
                "record at byte {at}: value length {vlen}"
            )));
        }
        let value = self.exact(vlen as usize)?;
        Ok(Some((tree, key, value)))
    }
}

/// The sled tree name of a record's tree id, if the backup's store has it.
fn tree_name(id: u32, partitions: u32) -> Option<String> {
    Some(match TreeId(id) {
        TreeId::META => "meta".into(),
        TreeId::LEASES => "leases".into(),
        TreeId::AUDIT => "audit".into(),
        TreeId::TOKEN_OWNERS => "token_owners".into(),
        TreeId::CLUSTER => crate::cluster::CLUSTER_TREE.into(),
        TreeId::INGEST => "ingest".into(),
        TreeId::REFUSALS => "refusals".into(),
        TreeId::OUTBOX => "outbox".into(),
        TreeId(p) if p < partitions => format!("partition/{p:05}"),
        _ => return None,
    })
}

/// Lease authority keys (`docs/on-disk-format.md`, `leases`).
const LEASE_COUNTER: u8 = 0x00;
const LEASE_RECORD: u8 = 0x01;
const LEASE_DEADLINE: u8 = 0x03;

/// Build a store folder at `to` from the backup in `from`: offline (no
/// store may be running on `to`). Refuses a damaged backup before creating
/// anything, and a `to` that exists and is not an empty folder. `progress`
/// gets (bytes done, bytes total) over the check and the load.
pub fn restore(
    from: &Path,
    to: &Path,
    opts: &RestoreOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RestoreSummary, BackupError> {
    if to.exists() {
        let empty = std::fs::read_dir(to)
            .map_err(io(format!(
                "{} exists and is not a readable folder",
                to.display()
            )))?
            .next()
            .is_none();
        if !empty {
            return Err(BackupError::Refused(format!(
                "{} is not empty: a restore only creates a new store (choose a new or empty folder)",
                to.display()
            )));
        }
    }
    let (_, bytes, _) = read_manifest(from)?;
    let total = bytes.saturating_mul(2);
    let info = verify(from, &mut |d, _| progress(d, total))?;
    if info.layout != keys::LAYOUT_VERSION {
        return Err(BackupError::Refused(format!(
            "the backup is of store layout {}, this build restores layout {}",
            info.layout,
            keys::LAYOUT_VERSION
        )));
    }
    let etcd = info.lease_backend == "etcd";
    match (etcd, opts.fence_at) {
        (true, None) => {
            return Err(BackupError::Refused(
                "the backed-up store's tokens come from etcd: pass --fence-at with etcd's current \
                 revision (`etcdctl endpoint status -w json`, header.revision); every fence is \
                 raised to it so no token issued before the restore is accepted"
                    .into(),
            ))
        }
        (false, Some(_)) => return Err(BackupError::Refused(
            "--fence-at is for stores whose tokens come from etcd; this backup's come from the \
                 embedded authority (use --token-jump)"
                .into(),
        )),
        _ => {}
    }
    if !etcd && opts.token_jump == 0 {
        return Err(BackupError::Refused(
            "--token-jump must be at least 1".into(),
        ));
    }

    // Pass 1 over the records, before anything is created: they parse,
    // the first is the info and equals the manifest's, every tree exists.
    let data = from.join(DATA_FILE);
    let open = || -> Result<Records<BufReader<File>>, BackupError> {
        let mut r = BufReader::with_capacity(
            1 << 20,
            File::open(&data).map_err(io(format!("cannot open {}", data.display())))?,
        );
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)
            .map_err(|_| BackupError::Corrupt(format!("{DATA_FILE} is shorter than its header")))?;
        if &magic != DATA_MAGIC {
            return Err(BackupError::Corrupt(format!(
                "{DATA_FILE} does not start with PALBAK01"
            )));
        }
        Ok(Records { r, read: 8 })
    };
    let mut highest = info.last_token;
    {
        let mut recs = open()?;
        match recs.next_record()? {
            Some((INFO_TREE, k, v)) if k == b"info" => {
                let in_data: Value = serde_json::from_slice(&v)
                    .map_err(|e| BackupError::Corrupt(format!("the info record: {e}")))?;
                if Info::from_json(&in_data)? != info {
                    return Err(BackupError::Corrupt(
                        "the manifest's info differs from the data file's".into(),
                    ));
                }
            }
            _ => {
                return Err(BackupError::Corrupt(
                    "the data file does not start with its info record".into(),
                ))
            }
        }
        while let Some((tree, k, v)) = recs.next_record()? {
            if tree_name(tree, info.partitions).is_none() {
                return Err(BackupError::Corrupt(format!(
                    "a record names tree {tree:#x}, which a {}-partition store does not have",
                    info.partitions
                )));
            }
            // Grants name their token: every one was issued.
            if tree < info.partitions && k.first() == Some(&keys::GRANT) {
                highest = highest.max(last_u64_key(&k).unwrap_or(0));
            }
            if tree == TreeId::LEASES.0 && k.first() == Some(&LEASE_COUNTER) {
                highest = highest.max(keys::ingest::u64_value(&v).unwrap_or(0));
            }
        }
    }
    let fence = match opts.fence_at {
        Some(f) => {
            if f < highest {
                return Err(BackupError::Refused(format!(
                    "--fence-at {f} is below token {highest}, which the backup shows was issued: \
                     etcd's revision only grows, so this is not etcd's current revision"
                )));
            }
            f
        }
        None => highest.checked_add(opts.token_jump).ok_or_else(|| {
            BackupError::Refused("--token-jump overflows the token counter".into())
        })?,
    };

    std::fs::create_dir_all(to).map_err(io(format!("cannot create {}", to.display())))?;
    let db = sled::Config::new().path(to).flush_every_ms(None).open()?;
    let mut trees = std::collections::HashMap::new();
    let mut format = None;
    let mut records = 0u64;
    let mut leases_dropped = 0u64;
    let mut recs = open()?;
    let _info = recs.next_record()?;
    let mut last_progress = 0u64;
    while let Some((tree, k, v)) = recs.next_record()? {
        records += 1;
        if recs.read >= last_progress + (4 << 20) {
            last_progress = recs.read;
            progress(bytes + recs.read, total);
        }
        if tree == TreeId::META.0 && k == b"format" {
            format = Some(v);
            continue;
        }
        if tree == TreeId::LEASES.0 {
            match k.first() {
                Some(&LEASE_RECORD) => {
                    leases_dropped += 1;
                    continue;
                }
                Some(&LEASE_DEADLINE) => continue,
                Some(&LEASE_COUNTER) if !etcd => continue,
                _ => {}
            }
        }
        let t = match trees.entry(tree) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let name = tree_name(tree, info.partitions).unwrap_or_default();
                e.insert(db.open_tree(name)?)
            }
        };
        t.insert(k, v)?;
    }
    let Some(format) = format else {
        return Err(BackupError::Corrupt(
            "the backup holds no meta/format".into(),
        ));
    };
    // The token rule.
    if !etcd {
        db.open_tree("leases")?
            .insert([LEASE_COUNTER], &fence.to_be_bytes()[..])?;
    }
    for p in 0..info.partitions {
        let tree = db.open_tree(format!("partition/{p:05}"))?;
        let mut meta: PartitionMeta = match tree.get(keys::META_KEY)? {
            Some(v) => codec::decode(&v)
                .map_err(|e| BackupError::Corrupt(format!("partition {p} meta: {e}")))?,
            None => PartitionMeta::default(),
        };
        meta.fence = meta.fence.max(fence);
        tree.insert(keys::META_KEY, codec::encode(&meta))?;
        let mut raised = Vec::new();
        for kv in tree.scan_prefix([keys::TWIN]) {
            let (k, v) = kv?;
            let mut rec: TwinRecord = codec::decode(&v)
                .map_err(|e| BackupError::Corrupt(format!("partition {p} twin record: {e}")))?;
            if rec.fence < fence {
                rec.fence = fence;
                raised.push((k, codec::encode(&rec)));
            }
        }
        for (k, v) in raised {
            tree.insert(k, v)?;
        }
    }
    db.flush()?;
    // The format key goes last: it marks the store as created.
    db.open_tree("meta")?.insert(b"format", format)?;
    db.flush()?;
    crate::commit::sync_sled_files(to, &std::sync::Mutex::default())
        .map_err(io(format!("cannot sync {}", to.display())))?;
    drop(trees);
    drop(db);
    if let Some(parent) = to.parent().filter(|p| !p.as_os_str().is_empty()) {
        File::open(parent)
            .and_then(|f| f.sync_all())
            .map_err(io(format!("cannot sync {}", parent.display())))?;
    }
    progress(total, total);
    Ok(RestoreSummary {
        info,
        records,
        fence,
        highest_token_seen: highest,
        leases_dropped,
    })
}

/// Writes a backup folder from frames: the data file as it comes, hashed,
/// and, on the manifest frame, checks the length and hash, syncs the data
/// file, writes the manifest, syncs it and the folder.
pub struct FolderWriter {
    dir: PathBuf,
    data: BufWriter<File>,
    hash: Sha256,
    bytes: u64,
}

impl std::fmt::Debug for FolderWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FolderWriter")
            .field("dir", &self.dir)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl FolderWriter {
    /// Create `dir` (it must not exist or be empty) and its data file.
    pub fn create(dir: &Path) -> Result<Self, BackupError> {
        if dir.exists()
            && std::fs::read_dir(dir)
                .map_err(io(format!("{} is not a readable folder", dir.display())))?
                .next()
                .is_some()
        {
            return Err(BackupError::Refused(format!(
                "{} is not empty: a backup goes into a new or empty folder",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
        let path = dir.join(DATA_FILE);
        let data = File::create(&path).map_err(io(format!("cannot create {}", path.display())))?;
        Ok(Self {
            dir: dir.to_owned(),
            data: BufWriter::with_capacity(1 << 20, data),
            hash: Sha256::new(),
            bytes: 0,
        })
    }

    pub fn data(&mut self, b: &[u8]) -> Result<(), BackupError> {
        self.hash.update(b);
        self.bytes += b.len() as u64;
        self.data.write_all(b).map_err(io(format!(
            "cannot write {}",
            self.dir.join(DATA_FILE).display()
        )))
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Check the manifest against what was received, then make both files
    /// and the folder durable. Returns the backup's info.
    pub fn finish(self, manifest: &[u8]) -> Result<(Info, Value), BackupError> {
        let m: Value = serde_json::from_slice(manifest)
            .map_err(|e| BackupError::Corrupt(format!("the manifest is not JSON: {e}")))?;
        let sha = hex(&self.hash.clone().finalize());
        if m["data_bytes"].as_u64() != Some(self.bytes) || m["data_sha256"].as_str() != Some(&sha) {
            return Err(BackupError::Corrupt(format!(
                "received {} bytes with SHA-256 {sha}; the manifest says {} bytes, {}",
                self.bytes, m["data_bytes"], m["data_sha256"]
            )));
        }
        let info = Info::from_json(&m["info"])?;
        let data_path = self.dir.join(DATA_FILE);
        let f = self.data.into_inner().map_err(|e| BackupError::Io {
            what: format!("cannot write {}", data_path.display()),
            source: e.into_error(),
        })?;
        f.sync_all()
            .map_err(io(format!("cannot sync {}", data_path.display())))?;
        let mpath = self.dir.join(MANIFEST_FILE);
        let mut mf =
            File::create(&mpath).map_err(io(format!("cannot create {}", mpath.display())))?;
        mf.write_all(manifest)
            .and_then(|()| mf.sync_all())
            .map_err(io(format!("cannot write {}", mpath.display())))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(format!("cannot sync {}", self.dir.display())))?;
        if let Some(parent) = self.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = File::open(parent).and_then(|d| d.sync_all());
        }
        Ok((info, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_whatever_the_chunking() {
        let mut all = encode_frame(frame::DATA, b"abc");
        all.extend(encode_frame(frame::MANIFEST, b"{}"));
        for cut in 0..all.len() {
            let mut r = FrameReader::default();
            r.push(&all[..cut]);
            let mut got = Vec::new();
            while let Some(f) = r.next_frame() {
                got.push(f);
            }
            r.push(&all[cut..]);
            while let Some(f) = r.next_frame() {
                got.push(f);
            }
            assert_eq!(
                got,
                vec![
                    (frame::DATA, b"abc".to_vec()),
                    (frame::MANIFEST, b"{}".to_vec())
                ]
            );
            assert_eq!(r.pending(), 0);
        }
    }

    /// A backup folder of a one-partition store with `records` after the
    /// info record, written as `palisade backup` writes it.
    fn write_backup(dir: &Path, info: &Info, records: &[(u32, Vec<u8>, Vec<u8>)]) {
        let mut data = DATA_MAGIC.to_vec();
        encode_record(
            &mut data,
            INFO_TREE,
            b"info",
            info.to_json().to_string().as_bytes(),
        );
        for (t, k, v) in records {
            encode_record(&mut data, *t, k, v);
        }
        let manifest = json!({
            "palisade_backup": BACKUP_FORMAT,
            "data_file": DATA_FILE,
            "data_bytes": data.len(),
            "data_sha256": hex(&Sha256::digest(&data)),
            "records": records.len() + 1,
            "info": info.to_json(),
        });
        let mut w = FolderWriter::create(dir).unwrap();
        w.data(&data).unwrap();
        w.finish(manifest.to_string().as_bytes()).unwrap();
    }

    /// A backup of a store whose tokens come from etcd: partition fence 40,
    /// a twin fenced at 41 and the grant of token 41.
    fn etcd_backup(dir: &Path) {
        let info = Info {
            layout: keys::LAYOUT_VERSION,
            partitions: 1,
            heads: vec![0],
            last_token: 0,
            lease_backend: "etcd".into(),
            taken_at_ms: 1,
            audit_through: 0,
            refusals_through: vec![0],
            pause_us: 1,
        };
        let meta = PartitionMeta {
            fence: 40,
            head: 0,
            max_hlc: None,
        };
        let twin = TwinRecord {
            fence: 41,
            ..TwinRecord::default()
        };
        let mut grant = vec![keys::GRANT];
        grant.extend_from_slice(&41u64.to_be_bytes());
        write_backup(
            dir,
            &info,
            &[
                (
                    TreeId::META.0,
                    b"format".to_vec(),
                    vec![keys::LAYOUT_VERSION],
                ),
                (
                    TreeId::META.0,
                    b"partitions".to_vec(),
                    1u32.to_be_bytes().to_vec(),
                ),
                (TreeId::META.0, b"lease_backend".to_vec(), b"etcd".to_vec()),
                (0, keys::META_KEY.to_vec(), codec::encode(&meta)),
                (0, grant, vec![1]),
                (0, vec![keys::TWIN, 0, 1, b'a'], codec::encode(&twin)),
            ],
        );
    }

    #[test]
    fn an_etcd_backup_needs_fence_at_and_gets_every_fence_raised_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("b");
        etcd_backup(&from);
        let to = dir.path().join("r");
        let opts = |fence_at| RestoreOptions {
            token_jump: DEFAULT_TOKEN_JUMP,
            fence_at,
        };
        let e = restore(&from, &to, &opts(None), &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("--fence-at"), "{e}");
        // Below a token the backup shows was issued (the grant of 41).
        let e = restore(&from, &to, &opts(Some(40)), &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("below token 41"), "{e}");
        assert!(!to.exists());
        let done = restore(&from, &to, &opts(Some(500)), &mut |_, _| {}).unwrap();
        assert_eq!(done.fence, 500);
        // The restore's own sled handle is dropped, but sled's pool may hold
        // the db file's lock a moment longer (seen in CI as "could not
        // acquire lock"): open it as `Store::open` does, waiting for it.
        let Ok(db) = crate::store::open_sled(&to, 1 << 20) else {
            panic!("the restored store could not be opened");
        };
        let p = db.open_tree("partition/00000").unwrap();
        let meta: PartitionMeta = codec::decode(&p.get(keys::META_KEY).unwrap().unwrap()).unwrap();
        assert_eq!(meta.fence, 500);
        let twin: TwinRecord =
            codec::decode(&p.get([keys::TWIN, 0, 1, b'a']).unwrap().unwrap()).unwrap();
        assert_eq!(twin.fence, 500);
        // etcd's counter is not the store's: the embedded one is left alone.
        assert!(db
            .open_tree("leases")
            .unwrap()
            .get([LEASE_COUNTER])
            .unwrap()
            .is_none());
        assert_eq!(
            db.open_tree("meta")
                .unwrap()
                .get(b"lease_backend")
                .unwrap()
                .as_deref(),
            Some(&b"etcd"[..])
        );
    }

    #[test]
    fn a_record_is_the_wal_put_op() {
        let mut r = Vec::new();
        encode_record(&mut r, 2, b"k", b"vv");
        assert_eq!(r, [0, 0, 0, 2, 1, 0, 0, 0, 1, b'k', 0, 0, 0, 2, b'v', b'v']);
        let mut recs = Records { r: &r[..], read: 0 };
        assert_eq!(
            recs.next_record().unwrap(),
            Some((2, b"k".to_vec(), b"vv".to_vec()))
        );
        assert_eq!(recs.next_record().unwrap(), None);
        let mut cut = Records {
            r: &r[..r.len() - 1],
            read: 0,
        };
        assert!(matches!(cut.next_record(), Err(BackupError::Corrupt(_))));
    }
}
