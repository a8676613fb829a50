//! `palisade export` and `palisade import`: a store's events as NDJSON, and
//! a store rebuilt from them (docs/export.md has the format line by line).
//!
//! Export pages through `GET /v1/partitions/{p}/events` (or one twin's
//! events) up to the heads read when it starts, so each partition's part is
//! a prefix of its log even while writes go on. Import checks the whole file
//! before it sends anything, then appends each twin's events in their
//! exported order under `partition/<q>` leases of the target store (its own
//! partition count), with their event ids and HLCs: the twin states and
//! versions come out equal (state is HLC last-writer-wins), and an import
//! run again (or resumed after a failure) stores nothing twice, since the
//! store acknowledges a known event id without appending it.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use palisade_client::{Event, StoredEvent};
use palisade_core::{partition_for, TwinId};
use serde::{Deserialize, Serialize};

use crate::commands::Session;
use crate::progress::Progress;
use crate::{out, Conn, Failure};

/// Format version of the export's first line.
const FORMAT: u32 = 1;
/// Events per page read from the store (its default cap).
const PAGE: usize = 1000;
/// TTL of the import's partition leases; renewed at a third of it.
const IMPORT_TTL_MS: u64 = 60_000;
/// Largest request body the import builds (the store's default limit is
/// 1 MiB; a single larger event is sent alone and may be refused).
const MAX_BATCH_BYTES: usize = 512 << 10;

#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// Write here (`-`: stdout).
    #[arg(long, env = "PALISADE_EXPORT_TO", value_name = "FILE")]
    pub to: PathBuf,
    /// Only this partition.
    #[arg(long, conflicts_with = "twin")]
    pub partition: Option<u32>,
    /// Only this twin's events.
    #[arg(long)]
    pub twin: Option<String>,
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Debug, Clone, Args)]
pub struct ImportArgs {
    /// An export file (`-`: stdin).
    #[arg(long, env = "PALISADE_IMPORT_FROM", value_name = "FILE")]
    pub from: PathBuf,
    /// Holder name of the import's partition leases (stored as every
    /// imported event's writer).
    #[arg(long, env = "PALISADE_HOLDER", default_value = "palisade-import")]
    pub holder: String,
    /// Most events per append request.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub batch: u64,
    #[command(flatten)]
    pub conn: Conn,
}

/// The first line of an export.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    palisade_export: u32,
    /// The store it was taken from.
    source: String,
    exported_at_ms: u64,
    /// What was exported: `store`, `partition/<p>` or `twin/<id>`.
    scope: String,
    /// The source store's partition count.
    partitions: u32,
    /// Per exported partition, the head the export went up to.
    heads: BTreeMap<u32, u64>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `palisade export --to FILE [--partition P | --twin ID]`.
pub(crate) async fn export(a: ExportArgs) -> Result<(), Failure> {
    let s = Session::new(&a.conn)?;
    let parts = s.get_json(s.url(&["v1", "partitions"])?).await?;
    let heads: BTreeMap<u32, u64> = parts["partitions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((
                u32::try_from(p["partition"].as_u64()?).ok()?,
                p["head"].as_u64()?,
            ))
        })
        .collect();
    let count = u32::try_from(heads.len()).unwrap_or(u32::MAX);
    let (scope, chosen): (String, BTreeMap<u32, u64>) = match (&a.partition, &a.twin) {
        (Some(p), _) => {
            let head = heads.get(p).copied().ok_or_else(|| {
                Failure::Usage(format!("--partition {p}: the store has {count} partitions"))
            })?;
            (format!("partition/{p}"), BTreeMap::from([(*p, head)]))
        }
        (None, Some(t)) => {
            let id = TwinId::new(t).map_err(|e| Failure::Usage(format!("--twin: {e}")))?;
            let p = partition_for(&id, count).0;
            (
                format!("twin/{t}"),
                BTreeMap::from([(p, heads.get(&p).copied().unwrap_or(0))]),
            )
        }
        (None, None) => ("store".to_owned(), heads.clone()),
    };
    let total: u64 = chosen.values().sum();
    let sink: Box<dyn Write> =
        if a.to.as_os_str() == "-" {
            Box::new(std::io::stdout().lock())
        } else {
            Box::new(std::fs::File::create(&a.to).map_err(|e| {
                Failure::Unexpected(format!("cannot create {}: {e}", a.to.display()))
            })?)
        };
    let mut w = BufWriter::new(sink);
    let io = |e: std::io::Error| Failure::Unexpected(format!("cannot write the export: {e}"));
    let header = Header {
        palisade_export: FORMAT,
        source: a.conn.url.clone(),
        exported_at_ms: now_ms(),
        scope: scope.clone(),
        partitions: count,
        heads: chosen.clone(),
    };
    serde_json::to_writer(&mut w, &header).map_err(|e| io(e.into()))?;
    w.write_all(b"\n").map_err(io)?;
    let mut progress = Progress::new("export", "events", total, a.to.as_os_str() != "-");
    let mut written = 0u64;
    for (&p, &head) in &chosen {
        let mut after = 0;
        while after < head {
            let mut url = match &a.twin {
                Some(t) => s.url(&["v1", "twins", t, "events"])?,
                None => s.url(&["v1", "partitions", &p.to_string(), "events"])?,
            };
            url.query_pairs_mut()
                .append_pair("after", &after.to_string())
                .append_pair("limit", &PAGE.to_string());
            let page = s.get_json(url).await?;
            let events: Vec<StoredEvent> = serde_json::from_value(page["events"].clone())
                .map_err(|e| Failure::Unexpected(format!("unexpected events page: {e}")))?;
            let Some(last) = events.last().map(|e| e.seq) else {
                break;
            };
            for e in events.iter().filter(|e| e.seq <= head) {
                serde_json::to_writer(&mut w, e).map_err(|e| io(e.into()))?;
                w.write_all(b"\n").map_err(io)?;
                written += 1;
            }
            // A twin's pages skip the partition's other twins: count those
            // seqs as done for the progress line.
            progress.set(chosen.range(..p).map(|(_, h)| h).sum::<u64>() + last.min(head));
            after = last;
        }
    }
    w.flush().map_err(io)?;
    progress.finish();
    if a.to.as_os_str() != "-" {
        out(format!(
            "exported {written} events ({scope}, {} partitions) to {}",
            chosen.len(),
            a.to.display()
        ))?;
    }
    Ok(())
}

/// One event line, checked.
struct Line {
    twin: String,
    event: Event,
}

/// Read and check the whole export before anything is sent.
fn read_export(from: &PathBuf) -> Result<(Header, Vec<Line>), Failure> {
    let reader: Box<dyn BufRead> = if from.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(std::fs::File::open(from).map_err(
            |e| Failure::Usage(format!("cannot read {}: {e}", from.display())),
        )?))
    };
    let bad = |n: usize, why: String| Failure::Usage(format!("{}:{n}: {why}", from.display()));
    let mut lines = reader.lines();
    let first = lines
        .next()
        .ok_or_else(|| bad(1, "empty file: not a palisade export".into()))?
        .map_err(|e| bad(1, e.to_string()))?;
    let header: Header = serde_json::from_str(&first)
        .map_err(|e| bad(1, format!("not a palisade export header ({e})")))?;
    if header.palisade_export != FORMAT {
        return Err(bad(
            1,
            format!(
                "export format {} (this palisade reads {FORMAT})",
                header.palisade_export
            ),
        ));
    }
    let mut out = Vec::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for (i, line) in lines.enumerate() {
        let n = i + 2;
        let line = line.map_err(|e| bad(n, e.to_string()))?;
        if line.trim().is_empty() {
            continue;
        }
        let e: StoredEvent =
            serde_json::from_str(&line).map_err(|e| bad(n, format!("not an event: {e}")))?;
        TwinId::new(&e.twin_id).map_err(|err| bad(n, format!("twin_id: {err}")))?;
        if !e.patch.is_object() {
            return Err(bad(n, "patch must be a JSON object".into()));
        }
        if e.hlc.parse::<palisade_core::Hlc>().is_err() {
            return Err(bad(n, format!("hlc {:?} is not <ntp64>/<hex id>", e.hlc)));
        }
        if !seen.insert((e.twin_id.clone(), e.event_id.clone())) {
            return Err(bad(
                n,
                format!("event {} of twin {} appears twice", e.event_id, e.twin_id),
            ));
        }
        out.push(Line {
            twin: e.twin_id,
            event: Event::new(e.event_type, e.patch)
                .with_id(e.event_id)
                .with_hlc(e.hlc),
        });
    }
    Ok((header, out))
}

/// A partition lease the import holds.
struct Held {
    lease_id: String,
    token: u64,
    renewed: Instant,
}

/// `palisade import --from FILE`.
pub(crate) async fn import(a: ImportArgs) -> Result<(), Failure> {
    let (header, lines) = read_export(&a.from)?;
    let s = Session::new(&a.conn)?;
    let parts = s.get_json(s.url(&["v1", "partitions"])?).await?;
    let count = parts["partitions"]
        .as_array()
        .map_or(0, Vec::len)
        .try_into()
        .unwrap_or(u32::MAX);
    if count == 0 {
        return Err(Failure::Unexpected("the store lists no partitions".into()));
    }
    let total = lines.len() as u64;
    let mut progress = Progress::new("import", "events", total, true);
    let mut held: BTreeMap<u32, Held> = BTreeMap::new();
    let (mut stored, mut duplicates, mut done) = (0u64, 0u64, 0u64);
    let mut twins: HashSet<&str> = HashSet::new();
    let batch = usize::try_from(a.batch).unwrap_or(1000);
    let mut i = 0;
    let result = async {
        while i < lines.len() {
            // A run of one twin's consecutive events, within the batch limits.
            let twin = lines[i].twin.as_str();
            let mut j = i;
            let mut bytes = 0;
            while j < lines.len() && lines[j].twin == twin && j - i < batch {
                bytes += serde_json::to_vec(&lines[j].event).map_or(0, |v| v.len());
                if j > i && bytes > MAX_BATCH_BYTES {
                    break;
                }
                j += 1;
            }
            let id = TwinId::new(twin).map_err(|e| Failure::Usage(e.to_string()))?;
            let q = partition_for(&id, count).0;
            let token = lease_for(&s, &mut held, q, &a.holder).await?;
            let events: Vec<Event> = lines[i..j].iter().map(|l| l.event.clone()).collect();
            let r = s
                .client
                .append(twin, token, &events)
                .await
                .map_err(|e| s.fail(e))?;
            duplicates += r.duplicates as u64;
            stored += (events.len() - r.duplicates) as u64;
            done += events.len() as u64;
            twins.insert(twin);
            progress.set(done);
            i = j;
        }
        Ok::<(), Failure>(())
    }
    .await;
    for h in held.values() {
        // Best effort: the leases expire anyway.
        let _ = s.client.release(&h.lease_id).await;
    }
    result?;
    progress.finish();
    out(format!(
        "imported {stored} events into {} twins ({duplicates} already stored) from {} ({}, {} partitions) into {} partitions",
        twins.len(),
        a.from.display(),
        header.scope,
        header.partitions,
        count
    ))
}

/// The token of the import's lease on `partition/q`: taken on first use,
/// renewed once a third of its TTL has passed.
async fn lease_for(
    s: &Session,
    held: &mut BTreeMap<u32, Held>,
    q: u32,
    holder: &str,
) -> Result<u64, Failure> {
    let renew_after = Duration::from_millis(IMPORT_TTL_MS / 3);
    if let Some(h) = held.get_mut(&q) {
        if h.renewed.elapsed() >= renew_after {
            let g = s.client.renew(&h.lease_id).await.map_err(|e| s.fail(e))?;
            h.renewed = Instant::now();
            h.token = g.token;
        }
        return Ok(h.token);
    }
    let g = s
        .client
        .acquire(
            &format!("partition/{q}"),
            holder,
            Duration::from_millis(IMPORT_TTL_MS),
        )
        .await
        .map_err(|e| s.fail(e))?;
    held.insert(
        q,
        Held {
            lease_id: g.lease_id.clone(),
            token: g.token,
            renewed: Instant::now(),
        },
    );
    Ok(g.token)
}
