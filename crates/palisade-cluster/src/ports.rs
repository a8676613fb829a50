//! The small traits the runtime carries the machine's actions out through.
//! One implementation each in production (etcd in `palisade-etcd`, Kafka in
//! `palisade-kafka`, the system clock here); tests may fake them.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use palisade_core::{BoxFuture, FencingToken};

use crate::{ClusterError, OwnerLeaseId};

/// What taking a partition's owner lease came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// This node holds it now: `token` is the owner key's create revision,
    /// `ttl` the TTL etcd granted.
    Taken {
        token: FencingToken,
        lease: OwnerLeaseId,
        ttl: Duration,
    },
    /// Another node holds it (it releases on its revoke, or its lease
    /// expires).
    HeldElsewhere,
}

/// The partition-owner leases (etcd: `<prefix>owner/<p>`, create-if-absent
/// on a short etcd lease).
pub trait OwnerLeases: Send + Sync + Debug {
    /// Take p's owner lease, on a lease of `ttl` (etcd may grant more),
    /// with `value` (who owns it and where it is reached) as the owner
    /// key's value, if no one holds it.
    fn take(
        &self,
        partition: u32,
        value: Vec<u8>,
        ttl: Duration,
    ) -> BoxFuture<'_, Result<Taken, ClusterError>>;
    /// Open a keep-alive channel on an owner lease.
    fn keep_alive(
        &self,
        lease: OwnerLeaseId,
    ) -> BoxFuture<'_, Result<Box<dyn KeepAlive>, ClusterError>>;
    /// Give an owner lease up (its key goes with it).
    fn revoke(&self, lease: OwnerLeaseId) -> BoxFuture<'_, Result<(), ClusterError>>;
    /// The value of p's owner key, if anyone holds it.
    fn owner(&self, partition: u32) -> BoxFuture<'_, Result<Option<Vec<u8>>, ClusterError>>;
}

/// One owner lease's keep-alive channel.
pub trait KeepAlive: Send {
    /// Renew once; the TTL granted from now. An error (or a lease etcd no
    /// longer knows) means the lease is lost.
    fn renew(&mut self) -> BoxFuture<'_, Result<Duration, ClusterError>>;
}

/// The partitioned log (Kafka): produce one record to one partition,
/// acknowledged by every in-sync replica.
pub trait RecordLog: Send + Sync + Debug {
    /// Produce and wait for the acknowledgement; the record's offset.
    fn produce(
        &self,
        partition: u32,
        key: Option<Vec<u8>>,
        value: Vec<u8>,
        headers: Vec<(&'static str, String)>,
    ) -> BoxFuture<'_, Result<u64, ClusterError>>;
}

/// Where the machine's `now` comes from.
pub trait Clock: Send + Sync + Debug {
    fn now(&self) -> Instant;
}

/// The monotonic system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
