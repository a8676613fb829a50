//! A PLM integration worker: takes the single-writer lease of one partition
//! and publishes work-order state changes for the work orders of that
//! partition to Kafka, each record carrying the lease's fencing token.
//! Palisade consumes the topic and applies them; a worker whose lease was
//! taken over while it was paused finds its late records dropped.
//!
//! Against the quickstart setup (three shells):
//! ```text
//! palisade dev-kafka --topic twin-events:16                     # prints bootstrap: ADDR
//! palisade serve --kafka-brokers ADDR
//! cargo run --example plm_worker -- --brokers ADDR --partition 3
//! ```

use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use palisade::core::{partition_for, FencingToken, NewEvent, TwinId};
use palisade_client::{Client, LeaseOptions};
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
    /// The store's (and topic's) partition count.
    #[arg(long, default_value_t = 16)]
    partitions: u32,
    /// The partition this worker owns.
    #[arg(long, default_value_t = 0)]
    partition: u32,
    /// How many work orders to drive.
    #[arg(long, default_value_t = 3)]
    orders: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = Client::new(&args.url)?;
    let holder = format!("plm-worker-{}", std::process::id());
    let scope = format!("partition/{}", args.partition);
    let lease = client
        .lease(
            &scope,
            &holder,
            Duration::from_secs(10),
            LeaseOptions::default(),
        )
        .await?;
    println!("{holder} holds {scope} with token {}", lease.token());

    // Work orders whose id hashes to our partition.
    let orders: Vec<TwinId> = (0..)
        .map(|n| TwinId::new(format!("WO-{n:05}")).expect("valid id"))
        .filter(|t| partition_for(t, args.partitions).0 == args.partition)
        .take(args.orders)
        .collect();
    let publisher =
        Publisher::new(&args.brokers, &args.topic, &[])?.with_partitions(args.partitions);
    for (step, status) in ["RELEASED", "IN_PROGRESS", "DONE"].iter().enumerate() {
        for wo in &orders {
            if lease.is_lost() {
                // An early stop, not the safety net: the store drops our
                // records anyway once another worker holds the partition.
                bail!("lease lost; stopping");
            }
            let event = NewEvent {
                event_id: format!("{wo}-{status}"),
                event_type: "work_order.status".into(),
                patch: json!({ "status": status, "step": step, "worker": holder })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                hlc: None,
            };
            let (p, o) = publisher
                .publish(wo, FencingToken(lease.token()), &event)
                .await?;
            println!("published {wo} -> {status} (partition {p}, offset {o})");
        }
    }

    // Read back what the store applied (ingestion is asynchronous).
    for wo in &orders {
        let mut state = None;
        for _ in 0..60 {
            state = client.twin(wo.as_str()).await?;
            if state.as_ref().is_some_and(|s| s.state["status"] == "DONE") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        match state {
            Some(s) => println!(
                "{wo}: {} (version {}, fence {})",
                s.state, s.version, s.fence
            ),
            None => {
                println!("{wo}: not applied yet (is `palisade serve --kafka-brokers` running?)")
            }
        }
    }
    lease.release().await?;
    Ok(())
}
