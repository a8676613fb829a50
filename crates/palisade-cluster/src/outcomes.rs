//! What became of recent records, for HTTP appends waiting on the record
//! they produced (decision 0012: a `201` only once the node's own ingester
//! applied it).

use std::collections::{HashMap, VecDeque};

/// Outcomes by (partition, offset), the oldest forgotten past a bound.
#[derive(Debug, Clone)]
pub struct Outcomes<V> {
    by_offset: HashMap<(u32, u64), V>,
    /// Insertion order, for eviction.
    order: VecDeque<(u32, u64)>,
    keep: usize,
}

impl<V: Clone> Outcomes<V> {
    /// Remember at most `keep` outcomes.
    pub fn new(keep: usize) -> Self {
        Self {
            by_offset: HashMap::new(),
            order: VecDeque::new(),
            keep,
        }
    }

    pub fn get(&self, partition: u32, offset: u64) -> Option<V> {
        self.by_offset.get(&(partition, offset)).cloned()
    }

    /// Remember the outcome of the record at `offset`. A `replay` (the
    /// consumer restarted and saw the record again: "already applied")
    /// keeps the first, real outcome if one is remembered.
    pub fn record(&mut self, partition: u32, offset: u64, outcome: V, replay: bool) {
        let k = (partition, offset);
        if replay && self.by_offset.contains_key(&k) {
            return;
        }
        if self.by_offset.insert(k, outcome).is_none() {
            self.order.push_back(k);
        }
        while self.order.len() > self.keep {
            if let Some(old) = self.order.pop_front() {
                self.by_offset.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_keeps_the_real_outcome_and_the_oldest_are_forgotten() {
        let mut o = Outcomes::new(2);
        o.record(0, 1, "applied", false);
        o.record(0, 1, "already applied", true);
        assert_eq!(o.get(0, 1), Some("applied"));
        // A replay of an offset never seen is all there is to say.
        o.record(1, 1, "already applied", true);
        assert_eq!(o.get(1, 1), Some("already applied"));
        o.record(0, 2, "dropped", false);
        assert_eq!(o.get(0, 1), None);
        assert_eq!(o.get(1, 1), Some("already applied"));
        assert_eq!(o.get(0, 2), Some("dropped"));
    }
}
