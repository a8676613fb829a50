//! `palisade publish`: one event to Kafka, for scripts and trying things out.

use anyhow::{bail, Context};
use clap::Args;
use palisade_core::{FencingToken, NewEvent, TwinId};
use palisade_kafka::Publisher;

/// `palisade publish`: one event to the twin-events topic, with the same
/// headers and partitioning a worker's publisher uses.
#[derive(Debug, Clone, Args)]
pub struct PublishConfig {
    /// Kafka bootstrap servers.
    #[arg(long, env = "PALISADE_KAFKA_BROKERS")]
    pub brokers: String,
    #[arg(long, env = "PALISADE_KAFKA_TOPIC", default_value = "twin-events")]
    pub topic: String,
    /// Partition count of the topic (= the store's): the record goes to
    /// `murmur2(twin) mod N`, as Palisade computes it.
    #[arg(long, env = "PALISADE_PARTITIONS", default_value_t = 16)]
    pub partitions: u32,
    /// The twin id (the record key).
    #[arg(long)]
    pub twin: String,
    /// Your lease's fencing token.
    #[arg(long, env = "PALISADE_FENCING_TOKEN")]
    pub token: u64,
    /// Event type.
    #[arg(long = "type", default_value = "update")]
    pub event_type: String,
    /// The JSON merge patch (an object).
    #[arg(long)]
    pub patch: String,
    /// Idempotency key (default: random).
    #[arg(long)]
    pub event_id: Option<String>,
    /// Sign the record as this principal (a store with authentication on
    /// applies only signed records; see docs/security.md). Needs --api-key.
    #[arg(long, env = "PALISADE_PRINCIPAL", requires = "api_key")]
    pub principal: Option<String>,
    /// The principal's API key (signs the record; never sent).
    #[arg(
        long,
        env = "PALISADE_API_KEY",
        hide_env_values = true,
        requires = "principal"
    )]
    pub api_key: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn publish(cfg: PublishConfig) -> anyhow::Result<()> {
    let twin = TwinId::new(cfg.twin.clone()).context("bad --twin")?;
    let patch = match serde_json::from_str::<serde_json::Value>(&cfg.patch)
        .context("--patch is not JSON")?
    {
        serde_json::Value::Object(m) => m,
        _ => bail!("--patch must be a JSON object (a merge patch)"),
    };
    if cfg.partitions == 0 {
        bail!("--partitions must be at least 1");
    }
    let event = NewEvent {
        event_id: cfg
            .event_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()),
        event_type: cfg.event_type.clone(),
        patch,
        hlc: None,
    };
    let mut publisher =
        Publisher::new(&cfg.brokers, &cfg.topic, &[])?.with_partitions(cfg.partitions);
    if let (Some(principal), Some(key)) = (&cfg.principal, &cfg.api_key) {
        publisher = publisher.with_signing(principal, key);
    }
    let (partition, offset) = publisher
        .publish(&twin, FencingToken(cfg.token), &event)
        .await?;
    if cfg.json {
        println!(
            "{}",
            serde_json::json!({ "topic": cfg.topic, "partition": partition, "offset": offset, "event_id": event.event_id })
        );
    } else {
        println!(
            "published {} to {}/{partition} at offset {offset}",
            event.event_id, cfg.topic
        );
    }
    Ok(())
}
