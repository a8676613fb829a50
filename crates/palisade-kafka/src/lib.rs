//! Kafka ingestion for Palisade.
//!
//! - [`decode`]: a record (key = twin id, `fencing-token` header, protobuf or
//!   JSON value) becomes an append or a [`Refusal`] with a stable reason.
//! - [`Ingester`]: a consumer group member. Each assigned Kafka partition p
//!   feeds Palisade partition p's writer in order; every record's offset is
//!   stored in the same atomic batch as its outcome (applied, dropped as
//!   stale, or dead-lettered), and consumption resumes from the stored offset
//!   on start and on every assignment. Each record is applied exactly once.
//! - [`Publisher`]: the producer side for workers: murmur2 partitioning,
//!   token and HLC headers, protobuf values.
//!
//! The wire contract is in `docs/kafka.md` and `proto/palisade/v1/event.proto`.

pub mod cluster;
pub mod decode;
mod ingester;
mod message;
mod publisher;
pub mod sign;

/// Types generated from `proto/palisade/v1/event.proto`.
#[allow(clippy::all, missing_debug_implementations)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/palisade.v1.rs"));
}

pub use decode::{decode, Decoded, RawRecord, Refusal};
pub use ingester::{IngestConfig, Ingester, KafkaIngestError};
pub use publisher::{PublishError, Publisher};
pub use sign::RecordAuth;
