//! `palisade-fault-writer`: a test tool of the fault-injection suite
//! (`tests/faults`), not part of the store. Its binary is a one-line
//! `[[bin]]` of the root package (`src/bin/palisade-fault-writer.rs`), so
//! Cargo builds it with the tests, which find it through
//! `CARGO_BIN_EXE_palisade-fault-writer`.
//!
//! It takes a lease with the SDK's renewing guard (`palisade_client::Lease`),
//! then appends a numbered stream of events under the lease's token, one at a
//! time, and records the store's answer to each attempt in the acks file,
//! fsynced before the next attempt:
//!
//! ```text
//! ACK <i> <token> <seq>       201: event i is stored at partition seq <seq>
//! STALE <i> <token> <fence>   409 stale_token: a later lease covers the twin
//! ERR <i> <what>              anything else (status and error name, or transport)
//! LOST <i>                    the guard saw the lease lost before attempt i (info only)
//! ```
//!
//! Event i is `{"type":"tick","patch":{"n":i,"by":holder},"event_id":"<holder>-<i>"}`.
//! Stdout: `TOKEN <t>` (first line), `LEASE <lease id>`, and at the end
//! `DONE acked=.. stale=.. errors=..`. A refusal does not stop it: a writer
//! woken from SIGSTOP keeps trying, so each late write is on record as
//! refused. It never renews a lost lease (the guard stops by itself) and
//! never takes a new one.
//!
//! ```text
//! palisade-fault-writer --url http://127.0.0.1:7070 --scope twin/dev-1 --twin dev-1 \
//!     --holder A --ttl-ms 300 --count 1000 --interval-ms 20 --acks /tmp/a.acks
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use palisade_client::{Client, ClientError, Event, LeaseOptions};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "palisade-fault-writer",
    about = "Test tool: append a numbered event stream under a renewed lease, recording every acknowledgement (fsynced)"
)]
struct Args {
    /// The store the events are appended to.
    #[arg(long)]
    url: String,
    /// The store the lease is acquired and renewed on (default: --url).
    /// Lets a test delay the appends only (through a proxy) while the lease
    /// stays renewed.
    #[arg(long)]
    lease_url: Option<String>,
    /// Lease scope: `twin/<id>` or `partition/<p>`.
    #[arg(long)]
    scope: String,
    /// The twin the events are appended to.
    #[arg(long)]
    twin: String,
    /// Lease holder; also the prefix of every event id.
    #[arg(long)]
    holder: String,
    #[arg(long, default_value_t = 1000)]
    ttl_ms: u64,
    /// How many events to attempt.
    #[arg(long, default_value_t = 100)]
    count: u64,
    /// Pause between two attempts.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// The acknowledgement file (appended to, one fsynced line per attempt).
    #[arg(long)]
    acks: PathBuf,
    /// Number of the first event.
    #[arg(long, default_value_t = 0)]
    start_at: u64,
    /// Stop (exit 0) after this many refusals.
    #[arg(long)]
    max_stale: Option<u64>,
    /// Stop (exit 0) after this many other errors.
    #[arg(long)]
    max_errors: Option<u64>,
    /// Keep retrying the acquisition this long while another holder's lease is live.
    #[arg(long, default_value_t = 10_000)]
    acquire_timeout_ms: u64,
    /// Publish to Kafka instead of appending over HTTP (the lease still comes
    /// from `--url`); each broker acknowledgement is recorded as
    /// `SENT <i> <token> <partition> <offset>`.
    #[arg(long)]
    kafka_brokers: Option<String>,
    #[arg(long, default_value = "twin-events")]
    kafka_topic: String,
    /// Partition count of the topic (= the store's), for murmur2 placement.
    #[arg(long, default_value_t = 16)]
    partitions: u32,
    /// Extra producer setting KEY=VALUE (repeatable).
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
}

/// Append `line` to the acks file and make it durable before returning.
fn record(file: &mut File, line: &str) -> anyhow::Result<()> {
    // One write call per line: a writer killed mid-way leaves at most a
    // partial last line, which readers ignore.
    file.write_all(format!("{line}\n").as_bytes())
        .context("write acks file")?;
    file.sync_data().context("fsync acks file")?;
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The `palisade-fault-writer` binary: parses its command line and runs.
#[tokio::main(flavor = "current_thread")]
pub async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let data = Client::new(&args.url)?;
    let leases = match &args.lease_url {
        Some(u) => Client::new(u)?,
        None => data.clone(),
    };
    let mut acks = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.acks)
        .with_context(|| format!("open {}", args.acks.display()))?;

    let ttl = Duration::from_millis(args.ttl_ms);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(args.acquire_timeout_ms);
    let lease = loop {
        match leases
            .lease(&args.scope, &args.holder, ttl, LeaseOptions::default())
            .await
        {
            Err(ClientError::LeaseHeld { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            other => break other.with_context(|| format!("acquire {}", args.scope))?,
        }
    };
    let token = lease.token();
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "TOKEN {token}")?;
        writeln!(out, "LEASE {}", lease.id())?;
        out.flush()?;
    }

    let publisher = match &args.kafka_brokers {
        Some(brokers) => {
            let settings: Vec<(String, String)> = args
                .kafka_settings
                .iter()
                .filter_map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                })
                .collect();
            Some(
                palisade_kafka::Publisher::new(brokers, &args.kafka_topic, &settings)?
                    .with_partitions(args.partitions),
            )
        }
        None => None,
    };
    let twin_id = palisade_core::TwinId::new(args.twin.clone())?;

    let (mut acked, mut stale, mut errors) = (0u64, 0u64, 0u64);
    let mut lost_noted = false;
    for i in args.start_at..args.start_at.saturating_add(args.count) {
        if !lost_noted && lease.is_lost() {
            lost_noted = true;
            record(&mut acks, &format!("LOST {i}"))?;
        }
        if let Some(publisher) = &publisher {
            let event = palisade_core::NewEvent {
                event_id: format!("{}-{i}", args.holder),
                event_type: "tick".into(),
                patch: json!({ "n": i, "by": args.holder })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                hlc: None,
            };
            let line = match publisher
                .publish(&twin_id, palisade_core::FencingToken(token), &event)
                .await
            {
                Ok((p, o)) => {
                    acked += 1;
                    format!("SENT {i} {token} {p} {o}")
                }
                Err(e) => {
                    errors += 1;
                    format!("ERR {i} kafka {}", one_line(&e.to_string()))
                }
            };
            record(&mut acks, &line)?;
            if args.max_errors.is_some_and(|m| errors >= m) {
                break;
            }
            if args.interval_ms > 0 {
                tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
            }
            continue;
        }
        let event = Event::new("tick", json!({ "n": i, "by": args.holder }))
            .with_id(format!("{}-{i}", args.holder));
        let line = match data.append(&args.twin, token, &[event]).await {
            Ok(a) => {
                acked += 1;
                let seq = a.seqs.first().context("201 without a seq")?;
                format!("ACK {i} {token} {seq}")
            }
            Err(ClientError::Stale { token, fence }) => {
                stale += 1;
                format!("STALE {i} {token} {fence}")
            }
            Err(e) => {
                errors += 1;
                let status = e
                    .status()
                    .map_or_else(|| "transport".to_owned(), |s| s.to_string());
                format!("ERR {i} {status} {}", one_line(&e.to_string()))
            }
        };
        record(&mut acks, &line)?;
        if args.max_stale.is_some_and(|m| stale >= m)
            || args.max_errors.is_some_and(|m| errors >= m)
        {
            break;
        }
        if args.interval_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
        }
    }
    println!("DONE acked={acked} stale={stale} errors={errors}");
    // Dropping the guard stops renewing; the lease lapses after its TTL.
    drop(lease);
    Ok(())
}
