//! Cluster mode's producer (docs/decisions/0012-cluster-mode.md): owner
//! markers, grants and HTTP appends, each produced to one partition with
//! `acks=all` and idempotence, as `palisade_cluster::RecordLog`.

use std::time::Duration;

use palisade_cluster::{ClusterError, RecordLog};
use palisade_core::BoxFuture;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::cluster::producer_settings;
use crate::KafkaIngestError;

/// A node's producer to the cluster's topic.
pub struct KafkaLog {
    producer: FutureProducer,
    topic: String,
}

impl std::fmt::Debug for KafkaLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaLog")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaLog {
    /// A producer to `topic` on `brokers`, with the consumer's client
    /// `settings` less those librdkafka's producer warns about (TLS and
    /// SASL settings apply to both).
    pub fn new(
        brokers: &str,
        topic: &str,
        settings: &[(String, String)],
    ) -> Result<Self, KafkaIngestError> {
        let mut pc = ClientConfig::new();
        pc.set("bootstrap.servers", brokers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "10000")
            // Every HTTP append waits for its record's acknowledgement, so
            // librdkafka's 5 ms of lingering is 5 ms on every append; under
            // load records still batch while a request is in flight
            // (decision 0037, docs/scaling.md). `--kafka-setting
            // linger.ms=N` overrides it.
            .set("linger.ms", "0");
        for (k, v) in producer_settings(settings) {
            pc.set(k, v);
        }
        Ok(Self {
            producer: pc.create()?,
            topic: topic.to_owned(),
        })
    }

    async fn send(
        &self,
        partition: u32,
        key: Option<Vec<u8>>,
        value: Vec<u8>,
        headers: Vec<(&'static str, String)>,
    ) -> Result<u64, ClusterError> {
        let failed = |source: Box<dyn std::error::Error + Send + Sync>| ClusterError::Produce {
            partition,
            source,
        };
        let mut h = OwnedHeaders::new();
        for (k, v) in &headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let p = i32::try_from(partition).map_err(|e| failed(Box::new(e)))?;
        let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic)
            .partition(p)
            .payload(value.as_slice())
            .headers(h);
        if let Some(k) = &key {
            rec = rec.key(k.as_slice());
        }
        match self.producer.send(rec, Duration::from_secs(10)).await {
            Ok(d) => u64::try_from(d.offset).map_err(|e| failed(Box::new(e))),
            Err((e, _)) => Err(failed(Box::new(e))),
        }
    }
}

impl RecordLog for KafkaLog {
    fn produce(
        &self,
        partition: u32,
        key: Option<Vec<u8>>,
        value: Vec<u8>,
        headers: Vec<(&'static str, String)>,
    ) -> BoxFuture<'_, Result<u64, ClusterError>> {
        Box::pin(self.send(partition, key, value, headers))
    }
}
