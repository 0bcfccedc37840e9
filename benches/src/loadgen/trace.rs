//! The generator's trace: what it published, enough to check a relay afterwards.
//!
//! One JSON document. Per pool: its serving endpoint and model, the final live set of canonical
//! block keys (the sequence hashes the relay's pool filter inserts, as decimal u64) and the
//! removed keys that are not live at the end. Removed keys are kept in full up to a bound
//! (`--trace-removed-max` per pool); above it only keys whose top `removed_sample_shift` bits are
//! zero are kept (a deterministic 1-in-2^shift sample), and `removals` still counts them all. The
//! document costs about 21 bytes per live or kept removed key (up to 20 digits and a comma), so a
//! trace stays bounded by `pools × workers × ranks × live_cap` plus the removed bound.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Bumped when the document's meaning changes.
pub const TRACE_VERSION: u32 = 1;

/// The whole trace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Trace {
    /// [`TRACE_VERSION`].
    pub version: u32,
    /// The flags of the run (as given), for the record.
    pub config: serde_json::Value,
    /// Run-wide counters.
    pub counters: Counters,
    /// One entry per pool.
    pub pools: Vec<PoolTrace>,
}

/// Counters of one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Counters {
    /// Stored events published.
    pub stored_events: u64,
    /// Removed events published.
    pub removed_events: u64,
    /// Blocks stored.
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// `kv-events` messages published.
    pub event_messages: u64,
    /// `kv_metrics` messages published.
    pub load_messages: u64,
    /// Bytes of every published message (envelopes).
    pub bytes_published: u64,
    /// Publishes the NATS client refused.
    pub publish_errors: u64,
    /// Stored events not sent because the generator fell further behind than its catch-up bound.
    pub skipped_events: u64,
    /// Seconds spent publishing (from the first event to the final flush).
    pub elapsed_secs: f64,
    /// `stored_events / elapsed_secs`.
    pub achieved_rate: f64,
}

/// One pool's expected filter contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolTrace {
    /// `namespace/component/endpoint`.
    pub endpoint: String,
    /// The model its cards serve.
    pub model: String,
    /// Canonical keys live at the end, sorted.
    pub live: Vec<u64>,
    /// Removed keys kept (none live at the end), sorted.
    pub removed: Vec<u64>,
    /// Every removal, kept or not.
    pub removals: u64,
    /// 1 in 2^shift removals is kept in `removed`.
    pub removed_sample_shift: u32,
}

impl Trace {
    /// Write atomically: a temporary file beside `path`, then a rename.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_vec(self).context("encoding the trace")?;
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(".partial");
        std::fs::write(&temporary, text)
            .with_context(|| format!("writing {}", Path::new(&temporary).display()))?;
        std::fs::rename(&temporary, path)
            .with_context(|| format!("renaming the trace to {}", path.display()))
    }

    /// Read and check a trace.
    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read(path).with_context(|| format!("reading the trace {}", path.display()))?;
        let trace: Trace = serde_json::from_slice(&text)
            .with_context(|| format!("parsing the trace {}", path.display()))?;
        anyhow::ensure!(
            trace.version == TRACE_VERSION,
            "trace {} has version {}, this build reads {TRACE_VERSION}",
            path.display(),
            trace.version
        );
        Ok(trace)
    }
}
