//! The recorder: a [`NodeTap`], a recovery-transport wrapper and the pools' publication
//! sinks that queue records, and a writer task that drains the queue into segment files.
//!
//! Serving never waits for the disk: taps `try_send` into a queue bounded twice, by
//! [`RecorderConfig::queue_bytes_max`] bytes and [`RecorderConfig::queue_capacity`] records.
//! Each record is weighed before it is queued ([`record_weight_bytes`]: an input by
//! [`DcInput::weight_bytes`], a checkpoint, recovery answer or publication point by the heap
//! bytes it holds) and its bytes are held from then until the writer task has appended it
//! (or lost it). A record that does not fit either bound is dropped, counted in
//! [`RecorderStats::records_dropped`] (and, for the byte bound, in
//! [`RecorderStats::records_dropped_queue_bytes`]), and the next record written is preceded by a
//! [`Record::Gap`] counting it. The records queued (each weight includes its queue slot) thus
//! weigh at most `queue_bytes_max` together, however large any one of them is.
//!
//! The writer task takes batches off the queue (gathered for up to [`BATCH_DELAY`]) and writes
//! them through the blocking-executor seam; a write error is logged (the first and then every [`ERROR_LOG_EVERY`]th), counted, and loses the
//! rest of its batch and what the writer had buffered; the segment is cut back to its whole
//! frames and closed (see [`segments`](super::segments)), and the next batch starts a new
//! segment. Every loss is written as a [`Record::Gap`] before the next record that makes it to
//! disk, so a segment after a failure starts with one.

use std::mem::size_of;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::checkpoint::{Checkpoint, CheckpointSchedule, PoolCheckpoint};
use super::format::{JournalHeader, Record, RecoveryOutcome, Stamp};
use super::segments::{FileSystem, SegmentIo, SegmentLimits, SegmentWriter, WriteTally};
use super::tap::NodeTap;
use crate::node::{NodeConfig, RecoveryTransport, StartPoint, StartTiming};
use crate::pool::{PublicationMode, PublicationSink};
use crate::runtime::{BlockingExecutor, WallClock, run_blocking};
use kvrelay_core::inputs::{DcInput, RecoveryTarget};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::model::kv_events::RouterEvent;
use kvrelay_core::pool::PublicationPoint;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// Write errors between two log lines.
pub const ERROR_LOG_EVERY: u64 = 1024;

/// Records written per blocking job at most.
const BATCH_RECORDS_MAX: usize = 512;

/// How long the writer lets records gather after the first one before writing them: one
/// blocking job per batch rather than per record keeps thread hand-offs off the hot path.
pub const BATCH_DELAY: Duration = Duration::from_millis(20);

/// Default of [`RecorderConfig::queue_bytes_max`]: 256 MiB, more than the largest recovery
/// answer the request plane accepts weighs once decoded (128 MiB of MessagePack, about 108 MiB
/// at 16 bytes per stored block), so every legal record fits alone and a replay never finds a
/// gap where a large tree dump was; or about sixteen of the largest KV events (a million blocks
/// weigh about 16 MiB).
pub const QUEUE_BYTES_MAX_DEFAULT: usize = 256 << 20;

/// How recording runs (`serve --record DIR --record-max-bytes N --record-max-age S`).
///
/// Not serialized and not journaled: a journal's header records the node's configuration, not
/// the recorder's, so fields added here never affect reading older journals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecorderConfig {
    /// The directory of this recording's segments (created; must hold no journal yet).
    pub dir: PathBuf,
    /// Rotation and retention.
    pub limits: SegmentLimits,
    /// Records queued before new ones are dropped.
    pub queue_capacity: usize,
    /// Bytes of records queued (by [`record_weight_bytes`]) before new ones are dropped; default
    /// [`QUEUE_BYTES_MAX_DEFAULT`]. A record heavier than this alone is always dropped.
    pub queue_bytes_max: usize,
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
    /// sixteenth of that (at most 64 MiB) or after `max_segment_age`; at most 8192 queued
    /// records of at most [`QUEUE_BYTES_MAX_DEFAULT`] bytes together; a checkpoint every 10,000
    /// inputs or 10 s. When `dir` is named like a [`recording_dir`], its parent is the
    /// [`retention_root`](Self::retention_root): the bound covers every recording there, so
    /// restarts do not each add a budget.
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
            queue_bytes_max: QUEUE_BYTES_MAX_DEFAULT,
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
    /// Of [`records_dropped`](Self::records_dropped), those dropped because the queue's byte
    /// budget ([`RecorderConfig::queue_bytes_max`]) could not hold them.
    pub records_dropped_queue_bytes: u64,
    /// Bytes of the records queued now (weighed by [`record_weight_bytes`]), at most
    /// [`RecorderConfig::queue_bytes_max`].
    pub queue_bytes: u64,
    /// The queue's byte budget ([`RecorderConfig::queue_bytes_max`]).
    pub queue_bytes_max: u64,
    /// Records on disk (gap markers included).
    pub records_written: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Write errors.
    pub write_errors: u64,
    /// Segments deleted by retention.
    pub segments_deleted: u64,
}

/// A queued record, the queue's drop count when it was queued, and the bytes it holds of the
/// queue's byte budget until the writer has appended (or lost) it.
#[derive(Debug)]
struct Queued {
    record: Record,
    dropped_before: u64,
    weight_bytes: usize,
}

/// Bytes a queued record is taken to hold: its queue slot plus the heap bytes of its contents.
///
/// An input weighs [`DcInput::weight_bytes`] (its KV events by their blocks; this counts the
/// input value's own size twice, a small over-estimate). A checkpoint, a recovery answer and a
/// publication point weigh the heap their texts and lists hold (texts and lists by capacity; a
/// recovery answer's events as [`RouterEvent::weight_bytes`] weighs them). These are in-memory
/// weights, not encoded sizes: encoding on the tap's caller (the node's own task) would cost as
/// much as the write the queue exists to keep off that task.
#[must_use]
pub fn record_weight_bytes(record: &Record) -> usize {
    let heap = match record {
        Record::Header(_) | Record::Gap { .. } | Record::Timer { .. } => 0,
        Record::Input { input, .. } => input.weight_bytes(),
        Record::Checkpoint { checkpoint, .. } => checkpoint_heap_bytes(checkpoint),
        Record::Recovery { outcome, .. } => outcome_heap_bytes(outcome),
        Record::Publication { pool, .. } | Record::PoolStart { pool, .. } => pool.capacity(),
    };
    size_of::<Queued>().saturating_add(heap)
}

fn checkpoint_heap_bytes(checkpoint: &Checkpoint) -> usize {
    let texts = |texts: &Vec<String>| {
        texts.iter().fold(texts.capacity().saturating_mul(size_of::<String>()), |total, text| {
            total.saturating_add(text.capacity())
        })
    };
    let pools = checkpoint.pools.iter().fold(
        checkpoint.pools.capacity().saturating_mul(size_of::<PoolCheckpoint>()),
        |total, pool| total.saturating_add(pool.pool.capacity()),
    );
    texts(&checkpoint.catalog).saturating_add(texts(&checkpoint.readiness)).saturating_add(pools)
}

fn outcome_heap_bytes(outcome: &RecoveryOutcome) -> usize {
    let events = |events: &Vec<RouterEvent>| {
        events.iter().map(RouterEvent::weight_bytes).fold(0, usize::saturating_add)
    };
    match outcome {
        Ok(RecoveryResponse::Events { events: listed, .. }) => events(listed),
        Ok(RecoveryResponse::TreeDump { events: dumped, reset_scope, .. }) => {
            let scope = match reset_scope {
                TreeDumpScope::Rank => 0,
                TreeDumpScope::Other(name) => name.capacity(),
            };
            events(dumped).saturating_add(scope)
        }
        Ok(
            RecoveryResponse::TreeDumpFailed { message: text, .. } | RecoveryResponse::Error(text),
        ) => text.capacity(),
        Ok(RecoveryResponse::TooNew { .. } | RecoveryResponse::InvalidRange { .. }) => 0,
        Err(
            RecoveryFailure::Unreachable(text)
            | RecoveryFailure::Refused(text)
            | RecoveryFailure::InvalidAnswer(text)
            | RecoveryFailure::NotSent(text),
        ) => text.capacity(),
        Err(RecoveryFailure::NoTransport | RecoveryFailure::TimedOut) => 0,
    }
}

#[derive(Debug, Default)]
struct Counters {
    queued: AtomicU64,
    /// Dropped at the queue.
    queue_dropped: AtomicU64,
    /// Dropped at the queue because its byte budget was full (counted in `queue_dropped` too).
    queue_bytes_dropped: AtomicU64,
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
    /// Bytes of the records queued and not yet appended by the writer; at most
    /// `queue_bytes_max`.
    queue_bytes: AtomicUsize,
    queue_bytes_max: usize,
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

    /// Queue `record` if both bounds have room for it; otherwise drop and count it (the writer
    /// writes the loss as a gap before the next record it appends).
    fn enqueue(&self, record: Record) {
        let dropped_before = self.counters.queue_dropped.load(Ordering::Relaxed);
        let weight_bytes = record_weight_bytes(&record);
        let reserved = self
            .queue_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                queued.checked_add(weight_bytes).filter(|total| *total <= self.queue_bytes_max)
            })
            .is_ok();
        if !reserved {
            self.counters.queue_bytes_dropped.fetch_add(1, Ordering::Relaxed);
            self.count_queue_drop();
            return;
        }
        if self.queue.try_send(Queued { record, dropped_before, weight_bytes }).is_ok() {
            self.counters.queued.fetch_add(1, Ordering::Relaxed);
        } else {
            self.release_queue_bytes(weight_bytes);
            self.count_queue_drop();
        }
    }

    fn count_queue_drop(&self) {
        self.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
        self.counters.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Return a record's bytes to the queue's budget: it was appended, lost, or not queued.
    fn release_queue_bytes(&self, weight_bytes: usize) {
        let before = self.queue_bytes.fetch_sub(weight_bytes, Ordering::AcqRel);
        debug_assert!(before >= weight_bytes, "released more queue bytes than were reserved");
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

    fn timer_fired(&self, at: Duration, inputs_handled: u64) {
        self.0.enqueue(Record::Timer { at: self.0.stamp(at), inputs_handled });
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

    fn start_timing(
        &self,
        _pool_id: &PoolId,
        _layout_generation: u64,
        _issued: StartPoint,
    ) -> StartTiming {
        StartTiming::Free
    }

    fn pool_started(
        &self,
        at: Duration,
        pool_id: &PoolId,
        layout_generation: u64,
        point: StartPoint,
        started: bool,
    ) {
        self.0.enqueue(Record::PoolStart {
            at: self.0.stamp(at),
            pool: pool_id.to_string(),
            layout_generation,
            point,
            started,
        });
    }
}

/// Records one pool's publication points (queued like every record: never waits).
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
        queue_bytes: AtomicUsize::new(0),
        queue_bytes_max: config.queue_bytes_max,
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
            records_dropped_queue_bytes: counters.queue_bytes_dropped.load(Ordering::Relaxed),
            queue_bytes: u64::try_from(shared.queue_bytes.load(Ordering::Relaxed))
                .unwrap_or(u64::MAX),
            queue_bytes_max: u64::try_from(shared.queue_bytes_max).unwrap_or(u64::MAX),
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
    for Queued { record, dropped_before, weight_bytes } in batch {
        if failed {
            shared.release_queue_bytes(weight_bytes);
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
        // Appended (now in the writer's buffer, bounded by the segment limits) or lost: the
        // record leaves the queue's byte budget.
        drop(record);
        shared.release_queue_bytes(weight_bytes);
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
