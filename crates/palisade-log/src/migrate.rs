//! Layout 2 -> 3, on open (`docs/on-disk-format.md`, "Changing the
//! format"): a layout-2 partition tree p held the offset of Kafka partition
//! p (`0x08`) and its dead letters (`0x09 ++ offset`), because Kafka
//! partition p fed only store partition p. Layout 3 keeps both in the
//! `ingest` tree by source partition. The migration moves them there; the
//! topic of the old offsets was never recorded, so they are kept as
//! "legacy" offsets that the first ingester to start claims for its topic
//! (`Store::claim_legacy_offsets`).
//!
//! Crash-safe without the write-ahead log (it runs after the log's replay,
//! before the store's threads start), by ordering and idempotence:
//! 1. copy every old key to its new place, make sled durable;
//! 2. remove the old keys, set `meta/format` to 3, make sled durable.
//!
//! A crash in 1 leaves layout 2 and the old keys: the next open copies
//! again (the same values). A crash in 2 leaves layout 2 with some old keys
//! removed, whose copies are durable since 1: the next open copies what is
//! left and finishes. Old keys still present under layout 3 (if sled kept
//! the format write but not a removal) are redundant and removed on every
//! open ([`sweep`]).

use std::path::Path;
use std::sync::Mutex;

use palisade_core::codec;
use tracing::info;

use crate::commit::Trees;
use crate::error::OpenError;
use crate::keys::{self, ingest};

fn sled_err(path: &Path) -> impl Fn(sled::Error) -> OpenError + '_ {
    move |source| OpenError::Sled {
        path: path.display().to_string(),
        source,
    }
}

/// sled's flush, then `fsync` of every file of the folder.
fn durable(db: &sled::Db, path: &Path) -> Result<(), OpenError> {
    db.flush().map_err(sled_err(path))?;
    crate::commit::sync_sled_files(path, &Mutex::default())
        .map_err(|e| sled_err(path)(sled::Error::Io(e)))
}

/// The layout-2 keys of one partition tree: the offset's value (if any) and
/// the dead letters as (offset, value).
type Legacy = (Option<sled::IVec>, Vec<(u64, sled::IVec)>);

fn legacy_keys(tree: &sled::Tree, path: &Path) -> Result<Legacy, OpenError> {
    let damaged = |k: &[u8]| OpenError::Damaged {
        tree: String::from_utf8_lossy(&tree.name()).into_owned(),
        key: k.to_vec(),
        source: codec::CodecError::Empty,
    };
    let offset = tree
        .get(keys::LEGACY_SOURCE_OFFSET)
        .map_err(sled_err(path))?;
    if let Some(v) = &offset {
        ingest::u64_value(v).ok_or_else(|| damaged(&keys::LEGACY_SOURCE_OFFSET))?;
    }
    let mut dead = Vec::new();
    for kv in tree.scan_prefix([keys::LEGACY_DEAD_LETTER]) {
        let (k, v) = kv.map_err(sled_err(path))?;
        let o = k
            .get(1..)
            .and_then(ingest::u64_value)
            .ok_or_else(|| damaged(&k))?;
        dead.push((o, v));
    }
    Ok((offset, dead))
}

/// Migrate a layout-2 store to layout 3 (see the module doc), and so to
/// layout 5: its `refusals` and `outbox` trees are simply empty. Returns how
/// many keys were moved.
pub(crate) fn from_layout_2(
    db: &sled::Db,
    path: &Path,
    trees: &Trees,
    format_key: &[u8],
) -> Result<usize, OpenError> {
    let mut moved = 0;
    for (p, tree) in trees.partitions.iter().enumerate() {
        let p = u32::try_from(p).unwrap_or(u32::MAX);
        let (offset, dead) = legacy_keys(tree, path)?;
        if let Some(v) = offset {
            trees
                .ingest
                .insert(ingest::legacy_offset(p), v)
                .map_err(sled_err(path))?;
            moved += 1;
        }
        for (o, v) in dead {
            trees
                .ingest
                .insert(ingest::dead_letter(p, o), v)
                .map_err(sled_err(path))?;
            moved += 1;
        }
    }
    durable(db, path)?;
    sweep(trees, path)?;
    trees
        .meta
        .insert(format_key, &[keys::LAYOUT_VERSION][..])
        .map_err(sled_err(path))?;
    durable(db, path)?;
    info!(
        path = %path.display(),
        moved,
        "migrated the store from layout 2 to layout 5 (Kafka offsets and dead letters by source partition; an empty refusal journal and outbox)"
    );
    Ok(moved)
}

/// Layout 3 or 4 -> 5: the `refusals` tree (layout 4) and the `outbox`
/// tree (layout 5) are new and start empty, so the store only needs
/// marking. Old keys of layout 2 are swept first, as on every open. A crash
/// before the mark is durable leaves the old layout, which the next open
/// marks again.
pub(crate) fn mark(
    db: &sled::Db,
    path: &Path,
    trees: &Trees,
    format_key: &[u8],
    from: u8,
) -> Result<(), OpenError> {
    sweep(trees, path)?;
    trees
        .meta
        .insert(format_key, &[keys::LAYOUT_VERSION][..])
        .map_err(sled_err(path))?;
    durable(db, path)?;
    info!(path = %path.display(), from, to = keys::LAYOUT_VERSION, "migrated the store by marking it (new empty trees: refusal journal from 4, outbox from 5)");
    Ok(())
}

/// Remove layout-2 keys whose copies are in the `ingest` tree.
pub(crate) fn sweep(trees: &Trees, path: &Path) -> Result<(), OpenError> {
    for tree in &trees.partitions {
        tree.remove(keys::LEGACY_SOURCE_OFFSET)
            .map_err(sled_err(path))?;
        let old: Vec<sled::IVec> = tree
            .scan_prefix([keys::LEGACY_DEAD_LETTER])
            .keys()
            .collect::<Result<_, _>>()
            .map_err(sled_err(path))?;
        for k in old {
            tree.remove(k).map_err(sled_err(path))?;
        }
    }
    Ok(())
}
