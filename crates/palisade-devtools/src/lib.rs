//! Tools for trying Palisade out and for its tests, never for production:
//! [`dev_kafka`] (`palisade dev-kafka`: librdkafka's mock cluster served on
//! loopback) and [`fault_writer`] (the `palisade-fault-writer` binary of the
//! fault-injection suite, `tests/faults`).

pub mod dev_kafka;
pub mod fault_writer;

pub use dev_kafka::DevKafkaConfig;
