//! Kafka ingestion for Palisade.
//!
//! - [`decode`]: a record (key = twin id, `fencing-token` header, protobuf or
//!   JSON value) becomes an append or a [`Refusal`] with a stable reason.
//! - [`Ingester`]: a consumer group member. Each assigned Kafka partition's
//!   records are handed to the store in order, and each is applied to its
//!   twin's partition whichever Kafka partition it is in (any producer
//!   partitioner, any partition count; strict mode keeps partition p ->
//!   partition p); every record's offset is stored in the same commit round
//!   as its outcome (applied, dropped as stale, or dead-lettered), and
//!   consumption resumes from the stored offsets on start and on every
//!   assignment. Each record is applied exactly once.
//! - [`cluster::ClusterIngester`]: the same in cluster mode, where a record
//!   outside its twin's partition is forwarded there through Kafka.
//! - [`KafkaLog`]: cluster mode's producer (owner markers, grants, HTTP
//!   appends), behind `palisade_cluster::RecordLog`.
//! - [`Publisher`]: the producer side for workers: murmur2 partitioning,
//!   token and HLC headers, protobuf values.
//!
//! The wire contract is in `docs/kafka.md` and `proto/palisade/v1/event.proto`.

pub mod cluster;
pub mod decode;
mod ingester;
mod message;
mod publisher;
mod record_log;
pub mod sign;
mod snapshots;

/// Types generated from `proto/palisade/v1/event.proto`.
#[allow(clippy::all, missing_debug_implementations)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/palisade.v1.rs"));
}

pub use decode::{decode, Decoded, RawRecord, Refusal};
pub use ingester::{IngestConfig, Ingester, KafkaIngestError, SnapshotSettings};
pub use publisher::{PublishError, Publisher};
pub use record_log::KafkaLog;
pub use sign::RecordAuth;
