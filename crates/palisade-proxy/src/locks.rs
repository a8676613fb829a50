//! One lock per twin: requests of one twin are admitted and forwarded one
//! at a time, so a request admitted and then delayed inside the proxy
//! cannot overtake a newer holder's (whose admission comes after it and
//! raises the fence). Entries are removed when nobody holds or waits for
//! them, so the map stays as small as the twins in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

#[derive(Debug, Default)]
pub struct TwinLocks {
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Held while one request of a twin is admitted and forwarded.
#[derive(Debug)]
pub struct TwinGuard {
    locks: Arc<TwinLocks>,
    twin: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl TwinLocks {
    /// Wait for the twin's lock (FIFO: tokio's mutex is fair).
    pub async fn lock(self: &Arc<Self>, twin: &str) -> TwinGuard {
        let m = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(twin.to_owned())
            .or_default()
            .clone();
        TwinGuard {
            locks: self.clone(),
            twin: twin.to_owned(),
            guard: Some(m.lock_owned().await),
        }
    }

    /// Twins with a lock entry (held or waited for).
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for TwinGuard {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self
            .locks
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Only the map holds it now: nobody waits (a waiter cloned the Arc
        // under this map lock before waiting).
        if map
            .get(&self.twin)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            map.remove(&self.twin);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_at_a_time_per_twin_and_cleaned_up() {
        let locks = Arc::new(TwinLocks::default());
        let a = locks.lock("a").await;
        // Another twin is not blocked.
        let b = locks.lock("b").await;
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { drop(locks.lock("a").await) })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        waiter.await.ok();
        drop(b);
        assert!(locks.is_empty());
    }
}
