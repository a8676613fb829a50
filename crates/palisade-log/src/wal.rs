//! The store's write-ahead log: what makes an acknowledgement durable.
//!
//! sled 0.34's `flush` is `pwrite` + `sync_file_range`, which neither flushes
//! the device's write cache nor makes a file's new size durable, and values
//! over ~128 KiB go to blob files it never syncs (spacejam/sled #1452,
//! #1351). So the store does not rely on it for acknowledgements. Every
//! commit round is first appended here and `fdatasync`ed; only then is it
//! applied to sled and acknowledged. sled is a materialisation of the synced
//! log: a checkpoint flushes it and `fsync`s every one of its files, after
//! which the segments it covers are deleted. On open, every round still in
//! the log is applied again (decision 0015, `docs/on-disk-format.md`).
//!
//! Re-applying is safe because a round is *physical*: full values to put
//! and keys to remove, per tree, in order. Applying rounds `a..=b` over a
//! sled state that already holds some prefix of them gives the state after
//! `b`, whatever that prefix was.
//!
//! Layout of the `wal/` folder (byte by byte in `docs/on-disk-format.md`):
//! segment files named by the number of their first round (20 decimal
//! digits, `.wal`), each a 16-byte header then records:
//!
//! ```text
//! segment header: "PALWAL01" (8 bytes) | first round (u64 BE)
//! record:         payload length (u32 BE) | CRC-32 of round ++ payload (u32 BE)
//!                 | round (u64 BE) | payload
//! payload:        op*, op = tree (u32 BE) | kind (u8: 0 remove, 1 put)
//!                 | key length (u32 BE) | key | [value length (u32 BE) | value]
//! ```
//!
//! The log ends at the first record that is short, fails its CRC or does not
//! carry the next round number: a torn tail of rounds that were never
//! acknowledged (a round is acknowledged only after it and every round
//! before it were synced).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// First bytes of every segment: format name and version.
pub(crate) const SEGMENT_MAGIC: &[u8; 8] = b"PALWAL01";
const SEGMENT_HEADER_LEN: usize = 16;
const RECORD_HEADER_LEN: usize = 16;
/// Largest payload a record may claim; a longer length is damage, not a
/// record (rounds are capped far below this).
const MAX_PAYLOAD: u32 = 1 << 30;

/// Op kinds in a payload.
const OP_REMOVE: u8 = 0;
const OP_PUT: u8 = 1;

/// Which sled tree an op writes. Partition trees are numbered by their
/// partition; the store's other trees sit at the top of the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TreeId(pub u32);

impl TreeId {
    pub const META: TreeId = TreeId(0xFFFF_0000);
    pub const LEASES: TreeId = TreeId(0xFFFF_0001);
    pub const AUDIT: TreeId = TreeId(0xFFFF_0002);
    pub const TOKEN_OWNERS: TreeId = TreeId(0xFFFF_0003);
    pub const CLUSTER: TreeId = TreeId(0xFFFF_0004);
    /// Kafka sources: offsets, dead letters, forward chains (layout 3).
    pub const INGEST: TreeId = TreeId(0xFFFF_0005);
    /// The refusal journal (layout 4, `refusals.rs`).
    pub const REFUSALS: TreeId = TreeId(0xFFFF_0006);
    /// The fenced outbox (layout 5, `outbox.rs`).
    pub const OUTBOX: TreeId = TreeId(0xFFFF_0007);

    pub fn partition(p: u32) -> TreeId {
        TreeId(p)
    }
}

/// The ops of one commit round, encoded as the WAL payload as they are
/// staged, so the bytes written to the log are the bytes applied to sled.
#[derive(Debug, Default)]
pub(crate) struct Ops {
    buf: Vec<u8>,
    count: usize,
}

impl Ops {
    pub fn put(&mut self, tree: TreeId, key: &[u8], value: &[u8]) {
        self.header(tree, OP_PUT, key);
        self.buf.extend_from_slice(&len32(value).to_be_bytes());
        self.buf.extend_from_slice(value);
    }

    pub fn remove(&mut self, tree: TreeId, key: &[u8]) {
        self.header(tree, OP_REMOVE, key);
    }

    fn header(&mut self, tree: TreeId, kind: u8, key: &[u8]) {
        self.buf.extend_from_slice(&tree.0.to_be_bytes());
        self.buf.push(kind);
        self.buf.extend_from_slice(&len32(key).to_be_bytes());
        self.buf.extend_from_slice(key);
        self.count += 1;
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Encoded size in bytes.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn payload(&self) -> &[u8] {
        &self.buf
    }
}

/// Keys and values are bounded far below 4 GiB (bodies, twin ids and
/// states are capped), so the cast cannot truncate in practice; a value
/// that large would fail its decode on replay rather than corrupt others.
fn len32(b: &[u8]) -> u32 {
    u32::try_from(b.len()).unwrap_or(u32::MAX)
}

/// One op of a payload, borrowed from it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Op<'a> {
    Put {
        tree: TreeId,
        key: &'a [u8],
        value: &'a [u8],
    },
    Remove {
        tree: TreeId,
        key: &'a [u8],
    },
}

/// The ops of a payload, in order; `Err` at the first malformed one (only
/// possible if the payload passed its CRC yet was written by a different
/// format: treated as damage).
pub(crate) fn decode_ops(mut p: &[u8]) -> impl Iterator<Item = Result<Op<'_>, WalDamage>> {
    std::iter::from_fn(move || {
        if p.is_empty() {
            return None;
        }
        let r = (|| {
            let tree = TreeId(take_u32(&mut p)?);
            let kind = *take(&mut p, 1)?.first()?;
            let klen = take_u32(&mut p)? as usize;
            let key = take(&mut p, klen)?;
            match kind {
                OP_PUT => {
                    let vlen = take_u32(&mut p)? as usize;
                    let value = take(&mut p, vlen)?;
                    Some(Op::Put { tree, key, value })
                }
                OP_REMOVE => Some(Op::Remove { tree, key }),
                _ => None,
            }
        })();
        match r {
            Some(op) => Some(Ok(op)),
            None => {
                p = &[];
                Some(Err(WalDamage::BadOp))
            }
        }
    })
}

fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if p.len() < n {
        return None;
    }
    let (head, rest) = p.split_at(n);
    *p = rest;
    Some(head)
}

fn take_u32(p: &mut &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(take(p, 4)?.try_into().ok()?))
}

/// A payload op that does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WalDamage {
    #[error("a log record holds a malformed op")]
    BadOp,
}

/// Frame one round as a record.
pub(crate) fn encode_record(round: u64, payload: &[u8], out: &mut Vec<u8>) {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&round.to_be_bytes());
    crc.update(payload);
    out.extend_from_slice(&len32(payload).to_be_bytes());
    out.extend_from_slice(&crc.finalize().to_be_bytes());
    out.extend_from_slice(&round.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Why a log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("write-ahead log segment {path} is not a Palisade log segment (bad header)")]
    BadSegment { path: PathBuf },
    #[error("write-ahead log segment {path} starts at round {found}, but the segment before it ended at round {previous}: a segment is missing")]
    Gap {
        path: PathBuf,
        previous: u64,
        found: u64,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A segment file of the log.
#[derive(Debug)]
pub(crate) struct Segment {
    pub path: PathBuf,
    pub first_round: u64,
    pub file: Arc<File>,
}

/// What recovery found in the log folder.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    /// Every complete round, in order: (round, payload).
    pub rounds: Vec<(u64, Vec<u8>)>,
    /// Segment files present (all of them are obsolete once the recovered
    /// rounds are applied and checkpointed).
    pub segments: Vec<PathBuf>,
    /// Bytes after the last complete record of the last segment read (a
    /// torn tail, never acknowledged).
    pub torn_bytes: u64,
}

fn segment_name(first_round: u64) -> String {
    format!("{first_round:020}.wal")
}

/// Segment files in `dir`, by first round.
fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, WalError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io_err(dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".wal")) else {
            continue;
        };
        if let Ok(first) = stem.parse::<u64>() {
            out.push((first, entry.path()));
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Read every complete round in `dir`. Stops at the first torn or damaged
/// record; segments after it hold only rounds that were never acknowledged.
pub(crate) fn recover(dir: &Path) -> Result<Recovered, WalError> {
    let mut rec = Recovered::default();
    let mut expected: Option<u64> = None;
    let mut ended = false;
    for (first, path) in list_segments(dir)? {
        rec.segments.push(path.clone());
        if ended {
            continue;
        }
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(io_err(&path))?;
        if bytes.len() < SEGMENT_HEADER_LEN {
            // Created but its header never made it: nothing in it was synced.
            ended = true;
            continue;
        }
        if &bytes[..8] != SEGMENT_MAGIC
            || u64::from_be_bytes(bytes[8..16].try_into().unwrap_or_default()) != first
        {
            return Err(WalError::BadSegment { path });
        }
        if bytes.len() == SEGMENT_HEADER_LEN {
            // A segment that never got a round (created just before a
            // crash, or left by a failed rotation): nothing to read, and no
            // gap either.
            continue;
        }
        if let Some(e) = expected {
            if first != e {
                return Err(WalError::Gap {
                    path,
                    previous: e - 1,
                    found: first,
                });
            }
        }
        let mut next = first;
        let mut at = SEGMENT_HEADER_LEN;
        while let Some((payload, used)) = read_record(&bytes[at..], next) {
            rec.rounds.push((next, payload.to_vec()));
            at += used;
            next += 1;
        }
        expected = Some(next);
        if at < bytes.len() {
            rec.torn_bytes = (bytes.len() - at) as u64;
            ended = true;
        }
    }
    Ok(rec)
}

/// The record at the start of `b` if it is complete, intact and carries
/// round `round`: its payload and its length in bytes.
fn read_record(b: &[u8], round: u64) -> Option<(&[u8], usize)> {
    let header = b.get(..RECORD_HEADER_LEN)?;
    let len = u32::from_be_bytes(header[0..4].try_into().ok()?);
    if len > MAX_PAYLOAD {
        return None;
    }
    let crc = u32::from_be_bytes(header[4..8].try_into().ok()?);
    let r = u64::from_be_bytes(header[8..16].try_into().ok()?);
    if r != round {
        return None;
    }
    let payload = b.get(RECORD_HEADER_LEN..RECORD_HEADER_LEN + len as usize)?;
    let mut h = crc32fast::Hasher::new();
    h.update(&header[8..16]);
    h.update(payload);
    (h.finalize() == crc).then_some((payload, RECORD_HEADER_LEN + len as usize))
}

/// The log's appending side: the current segment and the ones not yet
/// covered by a checkpoint. Used by the committer (appends, rotation) and
/// the checkpointer (deleting covered segments), behind a mutex.
#[derive(Debug)]
pub(crate) struct Wal {
    dir: PathBuf,
    /// Closed segments still needed, oldest first.
    closed: Vec<Segment>,
    current: Segment,
    /// Bytes in the current segment.
    len: u64,
    /// Start a new segment once the current one is this large.
    segment_bytes: u64,
    /// The next round to append.
    next_round: u64,
}

impl Wal {
    /// Start a log in `dir` whose first round will be `next_round` (the
    /// folder must hold no segments: recovery deletes them once applied).
    pub fn create(dir: &Path, next_round: u64, segment_bytes: u64) -> Result<Self, WalError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let current = new_segment(dir, next_round)?;
        Ok(Self {
            dir: dir.to_owned(),
            closed: Vec::new(),
            current,
            len: SEGMENT_HEADER_LEN as u64,
            segment_bytes,
            next_round,
        })
    }

    pub fn next_round(&self) -> u64 {
        self.next_round
    }

    /// Append framed records (rounds `next_round..`, `rounds` of them) to
    /// the current segment, starting a new segment first if it is full.
    /// Returns the segment file, to be synced before the rounds count as
    /// durable. Not synced here.
    pub fn append(&mut self, records: &[u8], rounds: u64) -> Result<Arc<File>, WalError> {
        // A segment holds at least one round, however small the limit.
        if self.len >= self.segment_bytes && self.next_round > self.current.first_round {
            match new_segment(&self.dir, self.next_round) {
                Ok(next) => {
                    let old = std::mem::replace(&mut self.current, next);
                    self.closed.push(old);
                    self.len = SEGMENT_HEADER_LEN as u64;
                }
                // Out of file descriptors, say: nothing is lost by going on
                // in the current segment; the next append tries again. A
                // half-created segment holds no round and is skipped (and
                // deleted) by recovery.
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start a new write-ahead log segment; appending to the current one");
                    let _ = std::fs::remove_file(self.dir.join(segment_name(self.next_round)));
                }
            }
        }
        let path = self.current.path.clone();
        (&*self.current.file)
            .write_all(records)
            .map_err(io_err(&path))?;
        self.len += records.len() as u64;
        self.next_round += rounds;
        Ok(self.current.file.clone())
    }

    /// Delete the closed segments whose every round is at or below
    /// `through` (sled holds them durably after a checkpoint), oldest first
    /// so that what remains is always contiguous.
    pub fn remove_through(&mut self, through: u64) -> Result<usize, WalError> {
        let mut removed = 0;
        while self.closed.len() > removed {
            let last_round = self
                .closed
                .get(removed + 1)
                .map_or(self.current.first_round, |s| s.first_round)
                - 1;
            if last_round > through {
                break;
            }
            let path = &self.closed[removed].path;
            std::fs::remove_file(path).map_err(io_err(path))?;
            removed += 1;
        }
        self.closed.drain(..removed);
        Ok(removed)
    }

    /// After a last checkpoint covering every round appended: delete every
    /// segment, the current one too (the log is not written again), so the
    /// next open has nothing to replay.
    pub fn remove_all(&mut self) -> Result<(), WalError> {
        self.remove_through(u64::MAX)?;
        std::fs::remove_file(&self.current.path).map_err(io_err(&self.current.path))?;
        sync_dir(&self.dir)
    }

    /// Segment files in use (closed ones not yet deleted, and the current).
    #[cfg(test)]
    pub fn segments(&self) -> usize {
        self.closed.len() + 1
    }
}

/// Create segment `first_round`, write its header, and make the file and
/// its directory entry durable before any round goes into it.
fn new_segment(dir: &Path, first_round: u64) -> Result<Segment, WalError> {
    let path = dir.join(segment_name(first_round));
    let mut file = OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(&path)
        .map_err(io_err(&path))?;
    let mut header = [0u8; SEGMENT_HEADER_LEN];
    header[..8].copy_from_slice(SEGMENT_MAGIC);
    header[8..].copy_from_slice(&first_round.to_be_bytes());
    file.write_all(&header)
        .and_then(|()| file.sync_all())
        .map_err(io_err(&path))?;
    sync_dir(dir)?;
    Ok(Segment {
        path,
        first_round,
        file: Arc::new(file),
    })
}

/// `fsync` a directory, so the entries created or removed in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// Delete segment files (after their rounds were applied and checkpointed).
pub(crate) fn remove_files(dir: &Path, paths: &[PathBuf]) -> Result<(), WalError> {
    for p in paths {
        std::fs::remove_file(p).map_err(io_err(p))?;
    }
    if !paths.is_empty() {
        sync_dir(dir)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ops(n: u8) -> Ops {
        let mut o = Ops::default();
        o.put(TreeId::partition(3), &[n], b"value");
        o.remove(TreeId::META, b"gone");
        o
    }

    #[test]
    fn ops_round_trip_and_layout_is_as_documented() {
        let o = ops(7);
        assert_eq!(o.len(), 2);
        let want: Vec<u8> = [
            &3u32.to_be_bytes()[..],
            &[1],
            &1u32.to_be_bytes(),
            &[7],
            &5u32.to_be_bytes(),
            b"value",
            &0xFFFF_0000u32.to_be_bytes(),
            &[0],
            &4u32.to_be_bytes(),
            b"gone",
        ]
        .concat();
        assert_eq!(o.payload(), &want[..]);
        let decoded: Vec<_> = decode_ops(o.payload()).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            decoded,
            [
                Op::Put {
                    tree: TreeId(3),
                    key: &[7],
                    value: b"value"
                },
                Op::Remove {
                    tree: TreeId::META,
                    key: b"gone"
                }
            ]
        );
        // A truncated payload is damage, reported once.
        let cut = &o.payload()[..o.payload().len() - 1];
        let r: Vec<_> = decode_ops(cut).collect();
        assert_eq!(r.len(), 2);
        assert!(r[1].is_err());
    }

    #[test]
    fn rounds_survive_reopen_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let wal_dir = dir.path().join("wal");
        let mut wal = Wal::create(&wal_dir, 1, 1 << 20).unwrap();
        let mut buf = Vec::new();
        for r in 1..=3u64 {
            encode_record(r, ops(r as u8).payload(), &mut buf);
        }
        wal.append(&buf, 3).unwrap().sync_data().unwrap();
        // A torn fourth record: header and half a payload.
        let mut torn = Vec::new();
        encode_record(4, ops(4).payload(), &mut torn);
        let f = wal.append(&torn[..torn.len() / 2], 0).unwrap();
        f.sync_data().unwrap();
        drop(wal);
        let rec = recover(&wal_dir).unwrap();
        let rounds: Vec<u64> = rec.rounds.iter().map(|(r, _)| *r).collect();
        assert_eq!(rounds, [1, 2, 3]);
        assert_eq!(rec.rounds[1].1, ops(2).payload());
        assert_eq!(rec.torn_bytes, (torn.len() / 2) as u64);
        assert_eq!(rec.segments.len(), 1);
    }

    #[test]
    fn a_flipped_byte_ends_the_log_there() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = Wal::create(dir.path(), 10, 1 << 20).unwrap();
        let mut buf = Vec::new();
        for r in 10..=12u64 {
            encode_record(r, ops(r as u8).payload(), &mut buf);
        }
        let one = buf.len() / 3;
        buf[one + RECORD_HEADER_LEN + 2] ^= 0xff; // inside round 11's payload
        wal.append(&buf, 3).unwrap();
        let rec = recover(dir.path()).unwrap();
        assert_eq!(rec.rounds.len(), 1);
        assert_eq!(rec.rounds[0].0, 10);
    }

    #[test]
    fn segments_rotate_and_covered_ones_are_removed_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        // Tiny segments: every append after the first starts a new one.
        let mut wal = Wal::create(dir.path(), 1, 1).unwrap();
        for r in 1..=4u64 {
            let mut buf = Vec::new();
            encode_record(r, ops(r as u8).payload(), &mut buf);
            wal.append(&buf, 1).unwrap();
        }
        assert_eq!(wal.segments(), 4);
        let rec = recover(dir.path()).unwrap();
        assert_eq!(rec.rounds.len(), 4);
        // Rounds 1..=2 checkpointed: their segments go, the rest stays.
        assert_eq!(wal.remove_through(2).unwrap(), 2);
        let rec = recover(dir.path()).unwrap();
        let rounds: Vec<u64> = rec.rounds.iter().map(|(r, _)| *r).collect();
        assert_eq!(rounds, [3, 4]);
        // The current segment is never removed.
        assert_eq!(wal.remove_through(100).unwrap(), 1);
        assert_eq!(wal.segments(), 1);
    }

    #[test]
    fn a_missing_segment_is_an_error_not_a_silent_gap() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = Wal::create(dir.path(), 1, 1).unwrap();
        for r in 1..=3u64 {
            let mut buf = Vec::new();
            encode_record(r, ops(1).payload(), &mut buf);
            wal.append(&buf, 1).unwrap();
        }
        drop(wal);
        std::fs::remove_file(dir.path().join(segment_name(2))).unwrap();
        assert!(matches!(recover(dir.path()), Err(WalError::Gap { .. })));
    }
}
