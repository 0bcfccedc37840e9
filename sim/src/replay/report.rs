//! The replay's report as text, and a bare replay under a paused clock.
//!
//! [`render`] turns a [`ReplayReport`] into the lines `kvrelay-sim replay` prints (pure, so tests
//! check it without a process); [`verdict`] says whether the recording was reproduced;
//! [`replay_paused`] runs the node alone on a current-thread runtime with a paused clock (no
//! WAN, no faults), which `cut` uses to read the state at a window's end.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvrelay::journal::{Checkpoint, JournalReader, ReplayOptions, ReplayReport, replay_journal};
use kvrelay::runtime::InlineExecutor;
use kvrelay_core::wire::LoadUpdate;

/// Replay the journal at `path` (a recording directory or one segment) up to `until` (the whole
/// journal when `None`), on a current-thread tokio runtime with a paused clock.
/// A journal that cannot be opened (its error names the file and byte offset) or replayed is
/// an error; a fault later in the journal ends the replay there and is in the report.
pub fn replay_paused(path: &Path, until: Option<Duration>) -> anyhow::Result<ReplayReport> {
    let node = (*JournalReader::open(path)?.header().node).clone();
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build()?;
    let options = ReplayOptions { until, own_clock: false };
    Ok(runtime.block_on(replay_journal(path, node, Arc::new(InlineExecutor), options))?)
}

/// Whether the replay reproduced the recording: no divergence and no journal fault.
#[must_use]
pub fn verdict(report: &ReplayReport) -> bool {
    report.divergence.is_none() && report.journal_fault.is_none()
}

fn seconds(at: Option<Duration>) -> String {
    at.map_or_else(|| "never".to_owned(), |at| format!("{:.6} s", at.as_secs_f64()))
}

/// The lines `kvrelay-sim replay` prints for `report`: the header, one progress line per
/// reproduced checkpoint, gaps, a journal fault, the verdict (the first divergence with its
/// differing entries, or the count reproduced); with `dump_state`, the state after the last
/// replayed input follows (catalog, readiness, per-pool ownership).
#[must_use]
pub fn render(report: &ReplayReport, dump_state: bool) -> String {
    let mut out = String::new();
    let header = &report.header;
    let cadence = if header.is_window() {
        "a cut window: its recorded checkpoints, revisions, filter digests and sequences not \
         compared"
            .to_owned()
    } else {
        format!(
            "checkpoint every {} inputs or {:.3} s",
            header.checkpoint_every_inputs,
            Duration::from_nanos(header.checkpoint_interval_ns).as_secs_f64()
        )
    };
    let _ = writeln!(
        out,
        "journal: kvrelay {}, dc {:016x}, incarnation {:016x}, seed {:#x}, {cadence}",
        header.kvrelay_version, header.dc_id, header.relay_incarnation, header.rng_seed,
    );
    let _ = writeln!(
        out,
        "replayed {} inputs, {} recorded recovery answers, {} checkpoints compared",
        report.inputs_replayed, report.recoveries_recorded, report.checkpoints_compared
    );
    let reproduced = report
        .divergence
        .as_ref()
        .map_or(report.checkpoints_compared, |divergence| divergence.index);
    for (index, (at, checkpoint)) in report.checkpoints.iter().take(reproduced).enumerate() {
        let _ = writeln!(
            out,
            "checkpoint {index} at {}: {} inputs, {} pools, reproduced",
            seconds(Some(*at)),
            checkpoint.inputs_handled,
            checkpoint.pools.len()
        );
    }
    for gap in &report.gaps {
        let _ = writeln!(
            out,
            "gap: the recorder lost records at {} (a replay across it is not expected to match)",
            seconds(Some(*gap))
        );
    }
    if let Some(fault) = &report.journal_fault {
        let _ = writeln!(out, "journal error: {fault} (nothing after it was replayed)");
    }
    match &report.divergence {
        Some(divergence) => {
            let _ = writeln!(
                out,
                "DIVERGED at checkpoint {}: recorded at {}, replayed at {}",
                divergence.index,
                seconds(divergence.recorded_at),
                seconds(divergence.replayed_at)
            );
            for entry in &divergence.diff.entries {
                let _ = writeln!(out, "  {entry}");
            }
        }
        None => {
            let _ = writeln!(out, "{} checkpoints reproduced", report.checkpoints_compared);
        }
    }
    if dump_state {
        match &report.final_state {
            Some((at, state)) => dump(&mut out, *at, state),
            None => {
                let _ = writeln!(out, "state: none (no input replayed)");
            }
        }
    }
    out
}

fn dump(out: &mut String, at: Duration, state: &Checkpoint) {
    let _ = writeln!(out, "state at {} after {} inputs:", seconds(Some(at)), state.inputs_handled);
    let _ = writeln!(
        out,
        "catalog (revision {}, {} pools):",
        state.catalog_revision,
        state.catalog.len()
    );
    for descriptor in &state.catalog {
        let _ = writeln!(out, "  {descriptor}");
    }
    let _ = writeln!(
        out,
        "readiness (revision {}, {} entries):",
        state.readiness_revision,
        state.readiness.len()
    );
    for entry in &state.readiness {
        let _ = writeln!(out, "  {entry}");
    }
    let _ = writeln!(out, "pools ({} active generations):", state.pools.len());
    for pool in &state.pools {
        let _ = writeln!(
            out,
            "  {} generation {}: {} exact blocks, canonical digest {:016x}, filter digest {:016x}, sequence {}",
            pool.pool,
            pool.layout_generation,
            pool.exact_blocks,
            pool.canonical_digest,
            pool.filter_digest,
            pool.sequence
        );
    }
}

/// The load window the relay published at the end: per pool, occupancy and rank coverage.
pub fn dump_load(out: &mut String, load: Option<&LoadUpdate>) {
    let Some(load) = load else {
        let _ = writeln!(out, "load: none published");
        return;
    };
    let _ = writeln!(
        out,
        "load (window {}, {} ms, observed at {} ms, {} pools):",
        load.window_sequence,
        load.window_ms,
        load.observed_ms,
        load.pools.len()
    );
    let blocks = |value: Option<u64>| value.map_or_else(|| "unknown".to_owned(), |v| v.to_string());
    for pool in &load.pools {
        let _ = writeln!(
            out,
            "  {} incarnation {:016x} generation {}: {} of {} blocks used, {}/{} ranks reported",
            pool.producer.pool_id(),
            pool.producer.producer_incarnation(),
            pool.producer.layout_generation(),
            blocks(pool.kv_used_blocks),
            blocks(pool.total_kv_blocks),
            pool.kv_observed_ranks,
            pool.kv_expected_ranks
        );
    }
}
