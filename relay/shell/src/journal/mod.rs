//! The input journal: recording every external fact the relay sees, and replaying it.
//!
//! The node's input boundary is where the journal taps (DESIGN.md "Inputs: one boundary,
//! several transports"; docs/journal.md has the format and the reasoning). External inputs are
//! recorded: every [`DcInput`](kvrelay_core::inputs::DcInput) as the node takes it, every recovery
//! answer as the transport delivers it, each with the node's monotonic time and the wall clock;
//! plus the seed and configuration in the header. Everything the node's own tasks report back
//! (pool faults, fences, host recovery acknowledgements) is a deterministic function of those
//! and is regenerated on replay, not recorded, except what timing or WAN subscribers decide:
//! the node's firings of the core's timers (`Record::Timer`), which a replay performs after the
//! same inputs at the same times, the pools' publication points that WAN subscribers decide
//! (`Record::Publication`), which a replay's pools perform at the same input counts, and the
//! point of the node's step sequence where each pool start (allocated off the node's loop) was
//! applied (`Record::PoolStart`), where a replay applies it. Periodic [`Checkpoint`]s of the logical
//! state, taken after inputs on their recorded times, let a replay prove it reproduced the
//! recording.
//!
//! - [`format`]: records, frames and segment preambles (pure);
//! - [`segments`]: segment files, rotation, retention and what a failed write leaves
//!   (synchronous I/O);
//! - [`reader`]: records back, with typed faults naming file and offset;
//! - [`recorder`]: the tap and recovery wrapper feeding a bounded queue, and the writer task;
//! - [`replay`]: a node driven by a journal under a paused clock, checkpoints compared.

mod checkpoint;
pub mod format;
pub mod reader;
pub mod recorder;
pub mod replay;
mod scripts;
pub mod segments;
mod tap;

#[cfg(test)]
mod tests;

pub(crate) use checkpoint::capture_checkpoint;
pub use checkpoint::{
    Checkpoint, CheckpointDiff, CheckpointSchedule, NO_CADENCE, PoolCheckpoint, compare_checkpoints,
};
pub use format::{
    FORMAT_VERSION, FORMAT_VERSION_TIMERS, JournalHeader, Record, RecoveryOutcome, Stamp,
};
pub use reader::{JournalError, JournalErrorKind, JournalReader, read_journal};
pub use recorder::{
    QUEUE_BYTES_MAX_DEFAULT, Recorder, RecorderConfig, RecorderProbe, RecorderStats,
    is_recording_dir_name, record_weight_bytes, recording_dir, start_recorder,
};
pub use replay::{
    Divergence, END_MARGIN, JournalReplay, ReplayError, ReplayOptions, ReplayReport, replay_journal,
};
pub use segments::{SegmentLimits, SegmentWriter};
pub use tap::{NodeTap, TimerPlan};
