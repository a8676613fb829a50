//! `palisade publish`: one event to Kafka, for scripts and trying things out.

use anyhow::{bail, Context};
use palisade_core::{FencingToken, NewEvent, TwinId};
use palisade_kafka::Publisher;

use crate::config::PublishConfig;

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
