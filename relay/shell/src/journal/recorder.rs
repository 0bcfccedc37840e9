//! The recorder: a [`NodeTap`], a recovery-transport wrapper and the pool actors' publication
//! sinks that queue records, and a writer task that drains the queue into segment files.
//!
//! Serving never waits for the disk: taps `try_send` into a bounded queue of
//! [`RecorderConfig::queue_capacity`] records (memory is bounded by that many records) and a
//! full queue drops the record, counted in [`RecorderStats::records_dropped`]. The writer task
//! takes batches off the queue (gathered for up to [`BATCH_DELAY`]) and writes them through the
//! blocking-executor seam; a write
//! error is logged (the first and then every [`ERROR_LOG_EVERY`]th), counted, and loses the
//! rest of its batch and what the writer had buffered; the segment is cut back to its whole
//! frames and closed (see [`segments`](super::segments)), and the next batch starts a new
//! segment. Every loss is written as a [`Record::Gap`] before the next record that makes it to
//! disk, so a segment after a failure starts with one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::checkpoint::{Checkpoint, CheckpointSchedule};
use super::format::{JournalHeader, Record, Stamp};
use super::segments::{FileSystem, SegmentIo, SegmentLimits, SegmentWriter, WriteTally};
use super::tap::NodeTap;
use crate::node::{NodeConfig, RecoveryTransport};
use crate::pool::{PublicationMode, PublicationSink};
use crate::runtime::{BlockingExecutor, WallClock, run_blocking};
use kvrelay_core::inputs::{DcInput, RecoveryTarget};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::pool::PublicationPoint;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};

/// Write errors between two log lines.
pub const ERROR_LOG_EVERY: u64 = 1024;

/// Records written per blocking job at most.
const BATCH_RECORDS_MAX: usize = 512;

/// How long the writer lets records gather after the first one before writing them: one
/// blocking job per batch rather than per record keeps thread hand-offs off the hot path.
pub const BATCH_DELAY: Duration = Duration::from_millis(20);

/// How recording runs (`serve --record DIR --record-max-bytes N --record-max-age S`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecorderConfig {
    /// The directory of this recording's segments (created; must hold no journal yet).
    pub dir: PathBuf,
    /// Rotation and retention.
    pub limits: SegmentLimits,
    /// Records queued before new ones are dropped.
    pub queue_capacity: usize,
    /// Checkpoint after this many inputs...
    pub checkpoint_every_inputs: u64,
    /// ...or after this long with at least one input.
    pub checkpoint_interval: Duration,
    /// The record root whose earlier recordings share [`SegmentLimits::max_total_bytes`] with
    /// this one (oldest deleted first, at start and while running); `None` bounds this
    /// recording alone.
    pub retention_root: Option<PathBuf>,
}

impl RecorderConfig {
    /// A configuration keeping at most `max_total_bytes` in `dir`, rotating segments at a
    /// sixteenth of that (at most 64 MiB) or after `max_segment_age`; 8192 queued records;
    /// a checkpoint every 10,000 inputs or 10 s. When `dir` is named like a
    /// [`recording_dir`], its parent is the [`retention_root`](Self::retention_root): the bound
    /// covers every recording there, so restarts do not each add a budget.
    #[must_use]
    pub fn new(dir: PathBuf, max_total_bytes: u64, max_segment_age: Duration) -> Self {
        let retention_root = dir
            .file_name()
            .and_then(|name| name.to_str())
            .filter(|name| is_recording_dir_name(name))
            .and(dir.parent())
            .map(std::path::Path::to_path_buf);
        RecorderConfig {
            retention_root,
            dir,
            limits: SegmentLimits {
                max_segment_bytes: (max_total_bytes / 16).clamp(4096, 64 * 1024 * 1024),
                max_segment_age,
                max_total_bytes,
            },
            queue_capacity: 8192,
            checkpoint_every_inputs: 10_000,
            checkpoint_interval: Duration::from_secs(10),
        }
    }
}

/// The directory one `serve` start records into under `root`: named after the wall-clock start
/// (ms since the epoch) and the relay incarnation, so a restart never mixes two recordings and
/// a listing sorts them by start time.
#[must_use]
pub fn recording_dir(
    root: &std::path::Path,
    wall_origin_us: u64,
    relay_incarnation: u64,
) -> PathBuf {
    root.join(format!("{:013}-{relay_incarnation:016x}", wall_origin_us / 1000))
}

/// Whether `name` is a directory name [`recording_dir`] makes: 13 decimal digits, `-`, 16
/// lower-case hex digits.
#[must_use]
pub fn is_recording_dir_name(name: &str) -> bool {
    let Some((start, incarnation)) = name.split_once('-') else { return false };
    start.len() == 13
        && start.bytes().all(|byte| byte.is_ascii_digit())
        && incarnation.len() == 16
        && incarnation.bytes().all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
}

/// The recorder's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecorderStats {
    /// Records accepted into the queue.
    pub records_queued: u64,
    /// Records dropped (queue full, write failure, unencodable).
    pub records_dropped: u64,
    /// Records on disk (gap markers included).
    pub records_written: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Write errors.
    pub write_errors: u64,
    /// Segments deleted by retention.
    pub segments_deleted: u64,
}

/// A queued record and the queue's drop count when it was queued.
#[derive(Debug)]
struct Queued {
    record: Record,
    dropped_before: u64,
}

#[derive(Debug, Default)]
struct Counters {
    queued: AtomicU64,
    /// Dropped at the queue.
    queue_dropped: AtomicU64,
    /// Dropped anywhere (queue, write failures, unencodable).
    dropped: AtomicU64,
    written: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    deleted: AtomicU64,
}

#[derive(Debug)]
struct Shared {
    queue: mpsc::Sender<Queued>,
    origin: OnceLock<Instant>,
    clock: Arc<dyn WallClock>,
    schedule: Mutex<CheckpointSchedule>,
    counters: Counters,
}

impl Shared {
    fn stamp(&self, at: Duration) -> Stamp {
        Stamp {
            mono_ns: u64::try_from(at.as_nanos()).unwrap_or(u64::MAX),
            wall_us: self.clock.now_unix_us(),
        }
    }

    fn since_origin(&self) -> Duration {
        self.origin.get().map_or(Duration::ZERO, |origin| Instant::now().duration_since(*origin))
    }

    fn enqueue(&self, record: Record) {
        let dropped_before = self.counters.queue_dropped.load(Ordering::Relaxed);
        if self.queue.try_send(Queued { record, dropped_before }).is_ok() {
            self.counters.queued.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The recorder's node tap.
#[derive(Debug)]
struct RecorderTap(Arc<Shared>);

impl NodeTap for RecorderTap {
    fn node_started(&self, origin: Instant) {
        let _ = self.0.origin.set(origin);
    }

    fn input(&self, at: Duration, input: &DcInput) {
        self.0.enqueue(Record::Input { at: self.0.stamp(at), input: input.clone() });
    }

    fn checkpoint_due(&self, at: Duration, inputs_handled: u64) -> bool {
        self.0
            .schedule
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .due(at, inputs_handled)
    }

    fn checkpoint(&self, at: Duration, checkpoint: Checkpoint) {
        self.0.enqueue(Record::Checkpoint { at: self.0.stamp(at), checkpoint });
    }

    fn publication_mode(&self, pool_id: &PoolId, layout_generation: u64) -> PublicationMode {
        PublicationMode::Reported(Arc::new(PoolRecorder {
            shared: Arc::clone(&self.0),
            pool: pool_id.to_string(),
            layout_generation,
        }))
    }
}

/// Records one pool actor's publication points (queued like every record: never waits).
#[derive(Debug)]
struct PoolRecorder {
    shared: Arc<Shared>,
    pool: String,
    layout_generation: u64,
}

impl PublicationSink for PoolRecorder {
    fn point(&self, point: PublicationPoint) {
        let at = self.shared.stamp(self.shared.since_origin());
        self.shared.enqueue(Record::Publication {
            at,
            pool: self.pool.clone(),
            layout_generation: self.layout_generation,
            point,
        });
    }
}

/// Wraps a recovery transport and records every answer (or transport failure) when it
/// arrives. A query the node abandons (its timeout fired first) records nothing.
#[derive(Debug)]
struct RecordingRecovery {
    inner: Arc<dyn RecoveryTransport>,
    shared: Arc<Shared>,
}

impl RecoveryTransport for RecordingRecovery {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        let query = self.inner.query(target.clone(), request, timeout);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let outcome = query.await;
            let at = shared.stamp(shared.since_origin());
            shared.enqueue(Record::Recovery { at, target, request, outcome: outcome.clone() });
            outcome
        })
    }
}

/// A running recorder.
#[derive(Debug)]
pub struct Recorder {
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// Start recording for a node about to start with `node`: creates `config.dir`, writes the
/// header's fields from `node` (configuration, DC, incarnation, seed) and the wall clock, and
/// spawns the writer task. Hand [`Recorder::tap`] and [`Recorder::recovery`] to
/// [`start_node_with_tap`](crate::node::start_node_with_tap).
pub fn start_recorder(
    config: &RecorderConfig,
    node: &NodeConfig,
    clock: Arc<dyn WallClock>,
    executor: Arc<dyn BlockingExecutor>,
) -> std::io::Result<Recorder> {
    start_recorder_with_io(config, node, clock, executor, Box::new(FileSystem))
}

/// [`start_recorder`], writing segments through `io`.
pub(crate) fn start_recorder_with_io(
    config: &RecorderConfig,
    node: &NodeConfig,
    clock: Arc<dyn WallClock>,
    executor: Arc<dyn BlockingExecutor>,
    io: Box<dyn SegmentIo>,
) -> std::io::Result<Recorder> {
    let schedule =
        CheckpointSchedule::new(config.checkpoint_every_inputs, config.checkpoint_interval);
    let header = JournalHeader {
        kvrelay_version: env!("CARGO_PKG_VERSION").to_owned(),
        config: format!("{node:?}"),
        node: Box::new(node.clone()),
        dc_id: node.control.dc_id.0,
        relay_incarnation: node.control.relay.relay_incarnation,
        rng_seed: node.rng_seed,
        wall_origin_us: clock.now_unix_us(),
        checkpoint_every_inputs: schedule.every_inputs(),
        checkpoint_interval_ns: u64::try_from(schedule.interval().as_nanos()).unwrap_or(u64::MAX),
        segment: 0,
    };
    let mut writer = SegmentWriter::create_with_io(&config.dir, header, config.limits, io)?;
    if let Some(root) = &config.retention_root {
        writer.retain_with_prior_recordings(root)?;
    }
    let (queue, records) = mpsc::channel(config.queue_capacity.max(1));
    let shared = Arc::new(Shared {
        queue,
        origin: OnceLock::new(),
        clock,
        schedule: Mutex::new(schedule),
        counters: Counters::default(),
    });
    // Earlier recordings deleted at start count like later deletions.
    shared.counters.deleted.store(writer.tally().segments_deleted, Ordering::Relaxed);
    let stop = CancellationToken::new();
    let task = crate::runtime::spawn(write_loop(
        writer,
        records,
        Arc::clone(&shared),
        executor,
        stop.clone(),
    ));
    Ok(Recorder { shared, stop, task })
}

impl Recorder {
    /// The tap for the node.
    #[must_use]
    pub fn tap(&self) -> Arc<dyn NodeTap> {
        Arc::new(RecorderTap(Arc::clone(&self.shared)))
    }

    /// `inner`, with every answer recorded.
    #[must_use]
    pub fn recovery(&self, inner: Arc<dyn RecoveryTransport>) -> Arc<dyn RecoveryTransport> {
        Arc::new(RecordingRecovery { inner, shared: Arc::clone(&self.shared) })
    }

    /// The counters now.
    #[must_use]
    pub fn stats(&self) -> RecorderStats {
        Recorder::stats_of(&self.shared)
    }

    /// A handle reading the counters, usable after [`Recorder::finish`] took the recorder.
    #[must_use]
    pub fn probe(&self) -> RecorderProbe {
        RecorderProbe(Arc::clone(&self.shared))
    }

    fn stats_of(shared: &Shared) -> RecorderStats {
        let counters = &shared.counters;
        RecorderStats {
            records_queued: counters.queued.load(Ordering::Relaxed),
            records_dropped: counters.dropped.load(Ordering::Relaxed),
            records_written: counters.written.load(Ordering::Relaxed),
            bytes_written: counters.bytes.load(Ordering::Relaxed),
            write_errors: counters.errors.load(Ordering::Relaxed),
            segments_deleted: counters.deleted.load(Ordering::Relaxed),
        }
    }

    /// Write what is queued, sync the open segment and stop. Call after the node stopped.
    pub async fn finish(self) -> RecorderStats {
        self.stop.cancel();
        let Recorder { shared, task, .. } = self;
        let _ = task.await;
        Recorder::stats_of(&shared)
    }
}

/// Reads a recorder's counters (for `/metrics`); cheap to clone.
#[derive(Debug, Clone)]
pub struct RecorderProbe(Arc<Shared>);

impl RecorderProbe {
    /// The counters now.
    #[must_use]
    pub fn stats(&self) -> RecorderStats {
        Recorder::stats_of(&self.0)
    }
}

/// Losses not yet written as a gap record.
#[derive(Debug, Clone, Copy, Default)]
struct GapState {
    /// Queue drops already covered by a gap record.
    reported_queue_drops: u64,
    /// Records lost by the writer since the last gap record.
    write_losses: u64,
    /// Stamp of the last record written.
    last_at: Option<Stamp>,
    /// The writer's [`WriteTally::records_lost`] already counted.
    writer_records_lost: u64,
    /// The writer's [`WriteTally::gap_losses_lost`] already counted.
    writer_gap_losses_lost: u64,
}

async fn write_loop(
    mut writer: SegmentWriter,
    mut records: mpsc::Receiver<Queued>,
    shared: Arc<Shared>,
    executor: Arc<dyn BlockingExecutor>,
    stop: CancellationToken,
) {
    let mut gaps = GapState::default();
    loop {
        let first = tokio::select! {
            biased;
            record = records.recv() => record,
            () = stop.cancelled() => None,
        };
        let mut finishing = first.is_none();
        if !finishing && records.len() < BATCH_RECORDS_MAX {
            tokio::select! {
                biased;
                () = stop.cancelled() => finishing = true,
                () = tokio::time::sleep(BATCH_DELAY) => {}
            }
        }
        let mut batch: Vec<Queued> = first.into_iter().collect();
        while finishing || batch.len() < BATCH_RECORDS_MAX {
            match records.try_recv() {
                Ok(record) => batch.push(record),
                Err(_) => break,
            }
        }
        let job_shared = Arc::clone(&shared);
        let job = run_blocking(executor.as_ref(), move || {
            let gaps = write_batch(&mut writer, batch, &job_shared, gaps, finishing);
            (writer, gaps)
        })
        .await;
        match job {
            Ok((returned, state)) => {
                writer = returned;
                gaps = state;
            }
            Err(error) => {
                shared.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(%error, "journal writer job died: recording stopped");
                return;
            }
        }
        if finishing {
            return;
        }
    }
}

/// Append `batch`, each record preceded by a gap record if losses happened before it; when
/// `finishing`, a last gap record covers the losses after the last record, and the segment is
/// synced. A failed write or sync loses the rest of the batch; what the writer had buffered
/// and lost with its segment is added to the losses the next gap record reports.
fn write_batch(
    writer: &mut SegmentWriter,
    batch: Vec<Queued>,
    shared: &Shared,
    mut gaps: GapState,
    finishing: bool,
) -> GapState {
    let before = writer.tally();
    let mut failed = false;
    for Queued { record, dropped_before } in batch {
        if failed {
            gaps.write_losses += 1;
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let lost = dropped_before.saturating_sub(gaps.reported_queue_drops) + gaps.write_losses;
        let at = record.stamp();
        let result = match at {
            Some(at) if lost > 0 => writer.append(&Record::Gap { at, lost }).map(|()| {
                gaps.reported_queue_drops = gaps.reported_queue_drops.max(dropped_before);
                gaps.write_losses = 0;
            }),
            _ => Ok(()),
        }
        .and_then(|()| writer.append(&record));
        match result {
            Ok(()) => gaps.last_at = at.or(gaps.last_at),
            Err(error) => {
                failed = error.kind() != std::io::ErrorKind::InvalidData;
                gaps.write_losses += 1;
                shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                note_write_error(shared, writer, &error, &mut gaps);
            }
        }
    }
    if finishing {
        // A failed sync leaves a new segment to try once more: the losses then get their gap.
        for _ in 0..2 {
            write_final_gap(writer, shared, &mut gaps);
            match writer.flush(true) {
                Ok(()) => break,
                Err(error) => note_write_error(shared, writer, &error, &mut gaps),
            }
        }
    } else if let Err(error) = writer.flush(false) {
        note_write_error(shared, writer, &error, &mut gaps);
    }
    add_tally(&shared.counters, before, writer.tally());
    gaps
}

/// A last gap record for the losses after the last record written.
fn write_final_gap(writer: &mut SegmentWriter, shared: &Shared, gaps: &mut GapState) {
    let queue_drops = shared.counters.queue_dropped.load(Ordering::Relaxed);
    let lost = queue_drops.saturating_sub(gaps.reported_queue_drops) + gaps.write_losses;
    if let (Some(at), true) = (gaps.last_at, lost > 0)
        && writer.append(&Record::Gap { at, lost }).is_ok()
    {
        gaps.reported_queue_drops = queue_drops;
        gaps.write_losses = 0;
    }
}

/// Count (and every [`ERROR_LOG_EVERY`]th time log) a write error, and take over the losses
/// of the segment it closed: records it had buffered (dropped, a gap's worth each) and the
/// losses of gap records it had buffered (reported again by the next gap).
fn note_write_error(
    shared: &Shared,
    writer: &SegmentWriter,
    error: &std::io::Error,
    gaps: &mut GapState,
) {
    let tally = writer.tally();
    let records = tally.records_lost - gaps.writer_records_lost;
    let reported = tally.gap_losses_lost - gaps.writer_gap_losses_lost;
    gaps.writer_records_lost = tally.records_lost;
    gaps.writer_gap_losses_lost = tally.gap_losses_lost;
    gaps.write_losses += records + reported;
    shared.counters.dropped.fetch_add(records, Ordering::Relaxed);
    let errors = shared.counters.errors.fetch_add(1, Ordering::Relaxed);
    if errors.is_multiple_of(ERROR_LOG_EVERY) {
        tracing::warn!(%error, dir = %writer.dir().display(), errors = errors + 1, lost = records, "journal write failed; recording degraded");
    }
}

fn add_tally(counters: &Counters, before: WriteTally, after: WriteTally) {
    counters.written.fetch_add(after.records - before.records, Ordering::Relaxed);
    counters.bytes.fetch_add(after.bytes - before.bytes, Ordering::Relaxed);
    counters.deleted.fetch_add(after.segments_deleted - before.segments_deleted, Ordering::Relaxed);
}
