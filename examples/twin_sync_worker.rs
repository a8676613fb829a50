//! An IoT twin-sync worker: takes a twin-scoped lease per device and
//! publishes telemetry for each to Kafka, stamped with its own HLC, for as
//! long as it holds the leases. Run two at once and pause one (Ctrl-Z, then
//! `fg` after the TTL): its late telemetry is dropped by the store.
//!
//! ```text
//! palisade dev-kafka --topic twin-events:16
//! palisade serve --kafka-brokers ADDR
//! cargo run --example twin_sync_worker -- --brokers ADDR --devices 3 --rounds 20
//! ```

use std::time::Duration;

use clap::Parser;
use palisade::core::{FencingToken, NewEvent, TwinId};
use palisade_client::{Client, ClientError, LeaseOptions};
use palisade_kafka::Publisher;
use serde_json::json;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, env = "PALISADE_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    #[arg(long, env = "PALISADE_KAFKA_BROKERS")]
    brokers: String,
    #[arg(long, default_value = "twin-events")]
    topic: String,
    #[arg(long, default_value_t = 16)]
    partitions: u32,
    #[arg(long, default_value_t = 3)]
    devices: usize,
    #[arg(long, default_value_t = 10)]
    rounds: u32,
    /// Lease TTL in milliseconds.
    #[arg(long, default_value_t = 3000)]
    ttl_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = Client::new(&args.url)?;
    let holder = format!("twin-sync-{}", std::process::id());
    let publisher =
        Publisher::new(&args.brokers, &args.topic, &[])?.with_partitions(args.partitions);
    let mut leases = Vec::new();
    for d in 0..args.devices {
        let twin = TwinId::new(format!("pump-{d}"))?;
        match client
            .lease(
                &format!("twin/{twin}"),
                &holder,
                Duration::from_millis(args.ttl_ms),
                LeaseOptions::default(),
            )
            .await
        {
            Ok(l) => {
                println!("{holder} syncs {twin} with token {}", l.token());
                leases.push((twin, l));
            }
            Err(ClientError::LeaseHeld { holder, .. }) => {
                println!("{twin} is synced by {holder}; skipping")
            }
            Err(e) => return Err(e.into()),
        }
    }
    for round in 0..args.rounds {
        for (twin, lease) in &leases {
            if lease.is_lost() {
                println!("lost the lease on {twin}; not publishing for it any more");
                continue;
            }
            let event = NewEvent {
                event_id: format!("{holder}-{twin}-{round}"),
                event_type: "telemetry".into(),
                patch: json!({ "rpm": 1000 + round * 10, "temp_c": 40 + round % 5, "synced_by": holder })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                hlc: None,
            };
            publisher
                .publish(twin, FencingToken(lease.token()), &event)
                .await?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (twin, _) in &leases {
        if let Some(s) = client.twin(twin.as_str()).await? {
            println!("{twin}: {} (version {})", s.state, s.version);
        }
    }
    for (_, lease) in leases {
        let _ = lease.release().await;
    }
    Ok(())
}
