//! The one error type of cluster mode's runtime seams.

/// Why a cluster-mode operation failed. The source (an etcd or Kafka
/// error) is kept: this crate cannot name those types, so it is boxed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd did not answer or refused a request on an owner lease.
    #[error("etcd owner lease: {op}: {source}")]
    OwnerLease {
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// etcd no longer knows the owner lease (it expired there).
    #[error("owner lease {0:x} is gone in etcd (expired)")]
    LeaseGone(i64),
    /// etcd answered something that cannot be (a transaction without the
    /// key it just wrote).
    #[error("etcd owner lease: {0}")]
    Inconsistent(&'static str),
    /// A record (an owner marker, an append, a grant) was not produced to
    /// Kafka; nothing is known to be in the log.
    #[error("could not produce to Kafka partition {partition}: {source}")]
    Produce {
        partition: u32,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A value to write could not be encoded.
    #[error("encoding {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}
