//! The latest durable record of recently written twins, served to readers
//! from memory. Only the commit path's apply thread puts records here, after
//! their round is synced and applied to sled, so a read never shows what a
//! crash could take back; a miss reads sled, which holds the same durable
//! data. Readers never insert (a read racing a newer write could otherwise
//! put an older record back).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use palisade_core::{PartitionId, TwinId};

use crate::records::TwinRecord;

/// Shards, so readers of different partitions do not share a lock.
const SHARDS: usize = 64;

#[derive(Debug)]
pub(crate) struct ReadCache {
    shards: Vec<RwLock<HashMap<TwinId, Arc<TwinRecord>>>>,
    /// Records kept per shard; past it a quarter of the shard is dropped
    /// (any quarter: a dropped twin is read from sled next time).
    per_shard: usize,
}

impl ReadCache {
    /// A cache of about `capacity` twins (0: none kept).
    pub fn new(capacity: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS),
        }
    }

    fn shard(&self, p: PartitionId, twin: &TwinId) -> &RwLock<HashMap<TwinId, Arc<TwinRecord>>> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        p.0.hash(&mut h);
        twin.hash(&mut h);
        // SHARDS is a power of two far below usize::MAX.
        #[allow(clippy::cast_possible_truncation)]
        let i = (h.finish() as usize) % SHARDS;
        &self.shards[i]
    }

    pub fn get(&self, p: PartitionId, twin: &TwinId) -> Option<Arc<TwinRecord>> {
        self.shard(p, twin)
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(twin)
            .cloned()
    }

    /// Forget every record (a partition's keys were replaced underneath,
    /// `handoff.rs`): the next reads go to sled.
    pub fn clear(&self) {
        for s in &self.shards {
            s.write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clear();
        }
    }

    pub fn put(&self, p: PartitionId, twin: TwinId, rec: Arc<TwinRecord>) {
        if self.per_shard == 0 {
            return;
        }
        let mut shard = self
            .shard(p, &twin)
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if shard.len() >= self.per_shard && !shard.contains_key(&twin) {
            let drop_n = (self.per_shard / 4).max(1);
            let victims: Vec<TwinId> = shard.keys().take(drop_n).cloned().collect();
            for v in victims {
                shard.remove(&v);
            }
        }
        shard.insert(twin, rec);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_latest_and_stays_bounded() {
        let c = ReadCache::new(SHARDS * 4);
        let p = PartitionId(0);
        for i in 0..10_000u64 {
            let rec = TwinRecord {
                version: i,
                ..TwinRecord::default()
            };
            c.put(
                p,
                TwinId::new(format!("t{}", i % 1000)).unwrap(),
                Arc::new(rec),
            );
        }
        let total: usize = c.shards.iter().map(|s| s.read().unwrap().len()).sum();
        assert!(total <= SHARDS * 4, "{total}");
        // Whatever is cached is the latest put for its twin.
        for i in 0..1000u64 {
            if let Some(r) = c.get(p, &TwinId::new(format!("t{i}")).unwrap()) {
                assert_eq!(r.version % 1000, i);
                assert!(r.version >= 9000);
            }
        }
        assert!(ReadCache::new(0)
            .get(p, &TwinId::new("x").unwrap())
            .is_none());
    }
}
