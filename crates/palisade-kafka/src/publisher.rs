use std::time::Duration;

use palisade_core::{partition_for, Clock, FencingToken, NewEvent, TwinId};
use prost::Message;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::decode::{CONTENT_TYPE_HEADER, HLC_HEADER, PROTOBUF, TOKEN_HEADER};
use crate::proto::TwinEvent;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("kafka client error: {0}")]
    Kafka(#[from] KafkaError),
}

/// Publishes twin events for workers: key = twin id, Kafka's murmur2
/// partitioner (so the record lands in the partition Palisade computes),
/// `fencing-token` and `hlc` headers, protobuf value. Events without an HLC
/// are stamped with the publisher's own hybrid logical clock.
pub struct Publisher {
    producer: FutureProducer,
    topic: String,
    partitions: Option<u32>,
    clock: Clock,
    /// Principal name and signing key: set, each record carries the
    /// `palisade-principal` and `palisade-signature` headers (`sign.rs`).
    signer: Option<(String, [u8; 32])>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// `settings` are extra librdkafka producer settings (TLS, SASL, linger).
    pub fn new(
        brokers: &str,
        topic: &str,
        settings: &[(String, String)],
    ) -> Result<Self, PublishError> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", brokers)
            .set("partitioner", "murmur2_random")
            .set("acks", "all")
            .set("enable.idempotence", "true");
        for (k, v) in settings {
            cc.set(k, v);
        }
        Ok(Self {
            producer: cc.create()?,
            topic: topic.to_owned(),
            partitions: None,
            clock: Clock::new(Duration::from_secs(3600)),
            signer: None,
        })
    }

    /// Sign every record as `principal` with its API key, for a store with
    /// authentication on (see docs/security.md, "Kafka").
    #[must_use]
    pub fn with_signing(mut self, principal: &str, api_key: &str) -> Self {
        self.signer = Some((principal.to_owned(), crate::sign::signing_key(api_key)));
        self
    }

    /// Pin the partition explicitly (computed with murmur2 over `partitions`)
    /// instead of relying on the client's partitioner setting.
    #[must_use]
    pub fn with_partitions(mut self, partitions: u32) -> Self {
        self.partitions = Some(partitions);
        self
    }

    /// Publish one event under `token`; returns (partition, offset) once the
    /// broker acknowledged it.
    pub async fn publish(
        &self,
        twin: &TwinId,
        token: FencingToken,
        event: &NewEvent,
    ) -> Result<(i32, i64), PublishError> {
        let hlc = event.hlc.unwrap_or_else(|| self.clock.now());
        let value = TwinEvent {
            event_id: event.event_id.clone(),
            r#type: event.event_type.clone(),
            patch_json: serde_json::Value::Object(event.patch.clone()).to_string(),
            hlc: hlc.to_string(),
        }
        .encode_to_vec();
        self.send(twin, token, &value, PROTOBUF).await
    }

    /// Publish a raw value with the given content type (e.g. the JSON body
    /// the HTTP API takes, `application/json`).
    pub async fn send(
        &self,
        twin: &TwinId,
        token: FencingToken,
        value: &[u8],
        content_type: &str,
    ) -> Result<(i32, i64), PublishError> {
        let token = token.0.to_string();
        let hlc = self.clock.now().to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: TOKEN_HEADER,
                value: Some(token.as_bytes()),
            })
            .insert(Header {
                key: HLC_HEADER,
                value: Some(hlc.as_bytes()),
            })
            .insert(Header {
                key: CONTENT_TYPE_HEADER,
                value: Some(content_type.as_bytes()),
            });
        let headers = match &self.signer {
            None => headers,
            Some((principal, key)) => {
                let sig = crate::sign::sign(
                    key,
                    principal,
                    &crate::sign::Signed {
                        twin: twin.as_str().as_bytes(),
                        token: token.as_bytes(),
                        content_type: content_type.as_bytes(),
                        hlc: hlc.as_bytes(),
                        value,
                        if_match: None,
                    },
                );
                headers
                    .insert(Header {
                        key: crate::sign::PRINCIPAL_HEADER,
                        value: Some(principal.as_bytes()),
                    })
                    .insert(Header {
                        key: crate::sign::SIGNATURE_HEADER,
                        value: Some(sig.as_bytes()),
                    })
            }
        };
        let mut rec = FutureRecord::to(&self.topic)
            .key(twin.as_str())
            .payload(value)
            .headers(headers);
        if let Some(n) = self.partitions {
            rec = rec.partition(i32::try_from(partition_for(twin, n).0).unwrap_or(0));
        }
        let delivered = self
            .producer
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)?;
        Ok((delivered.partition, delivered.offset))
    }
}
