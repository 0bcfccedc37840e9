//! Replay: run a node on a journal's inputs at their recorded times and compare checkpoints.
//!
//! [`replay_journal`] must run on a tokio runtime whose clock is paused (a current-thread
//! runtime built with `start_paused(true)`, or `#[tokio::test(start_paused = true)]`), so the
//! recorded times are reproduced exactly and nothing depends on the host's speed. It starts a
//! node with the configuration the journal was recorded with (checked against the header), feeds
//! every [`Record::Input`] at its recorded monotonic time, answers every recovery query with the
//! recorded outcome at the recorded time (a query with no recorded answer never answers, so the
//! node's own timeout decides, as it did when recording), and takes checkpoints on the same
//! schedule. Pool starts are applied at the points of the step sequence the recording applied
//! them ([`Record::PoolStart`]), the node waiting there for the allocation. Other internal
//! reports (pool faults, fences) are not read from the journal: the node regenerates them.
//! The journal drives the node's time: the relay is given each input at its recorded stamp, and
//! its timers fire exactly where the recording fired them ([`Record::Timer`]: after the same
//! inputs, at the same time), not on the replay's clock; past the last recorded firing the node
//! runs on its own timer again, from the end of the window on. Pools run scripted: each
//! performs its recorded publication points (the ones its subscribers decided) after the same
//! commands until the end of the replayed window. A recording older than format 6 published on
//! its pools' timers as script points, and is refused; a window cut out of a recording carries
//! no firing and replays on the node's own clock and timer, with free pools.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use thiserror::Error;
use tokio::time::Instant;

use super::checkpoint::{Checkpoint, CheckpointDiff, CheckpointSchedule, compare_checkpoints};
use super::format::{FORMAT_VERSION_TIMERS, JournalHeader, Record, RecoveryOutcome, Stamp};
use super::reader::{JournalError, JournalReader};
use super::scripts::RecordedTiming;
use super::tap::{NodeTap, TimerPlan};
use crate::node::{
    NodeConfig, NodeHandle, RecoveryTransport, StartPoint, StartTiming, start_node_with_tap,
};
use crate::pool::PublicationMode;
use crate::runtime::{BlockingExecutor, ManualWallClock, WallClock};
use kvrelay_core::control::ControlError;
use kvrelay_core::inputs::{DcInput, RecoveryTarget};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};

/// What to replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Stop after the inputs recorded at or before this time (the whole journal when `None`).
    pub until: Option<Duration>,
    /// The inputs reach the node by another path than one by one in journal order (the
    /// simulator's DC planes, where faults drop, delay or add inputs): the journal's stamps
    /// and timer firings, which count the recorded inputs, cannot drive the node's time, so it
    /// runs on its own clock and timer (its pools still follow their recorded points).
    pub own_clock: bool,
}

/// The first point where the replay left the recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// Index of the checkpoint (in schedule order).
    pub index: usize,
    /// When the recording took it (`None`: the replay took one the recording did not).
    pub recorded_at: Option<Duration>,
    /// When the replay took it (`None`: the replay never reached it).
    pub replayed_at: Option<Duration>,
    /// The differing entries.
    pub diff: CheckpointDiff,
}

/// What a replay did and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayReport {
    /// The journal's header.
    pub header: JournalHeader,
    /// Inputs fed to the node.
    pub inputs_replayed: u64,
    /// Recorded recovery outcomes available to the replay.
    pub recoveries_recorded: u64,
    /// Recorded checkpoints in the replayed window, all compared.
    pub checkpoints_compared: usize,
    /// The first divergence, if any.
    pub divergence: Option<Divergence>,
    /// Times of recorded gaps (records the recorder lost) in the window.
    pub gaps: Vec<Duration>,
    /// The fault that ended the journal early; nothing after it was replayed.
    pub journal_fault: Option<JournalError>,
    /// The replay's scheduled checkpoints with their times.
    pub checkpoints: Vec<(Duration, Checkpoint)>,
    /// The state after the last replayed input (also taken when no checkpoint was due).
    pub final_state: Option<(Duration, Checkpoint)>,
}

/// Why a replay could not run.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// The journal cannot be opened.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The configuration given is not the one recorded.
    #[error(
        "configuration differs from the recorded one:\nrecorded: {recorded}\ngiven:    {given}"
    )]
    ConfigMismatch {
        /// The header's configuration.
        recorded: String,
        /// The configuration given.
        given: String,
    },
    /// Retention deleted the journal's first segments: the node's start is not in it.
    #[error("the journal starts at segment {first_segment}: its beginning was deleted")]
    StartMissing {
        /// The oldest segment left.
        first_segment: u64,
    },
    /// The node refused the configuration.
    #[error("starting the node: {0}")]
    Start(#[from] ControlError),
    /// A recording in a format that predates recorded timer firings.
    #[error(
        "journal format {version} recorded its pools' timer publications as script points; this \
         build replays recordings of format {FORMAT_VERSION_TIMERS} on, which record the timer \
         firings themselves (a window cut out of it still replays; record again to replay it whole)"
    )]
    TimersNotRecorded {
        /// The journal's format version.
        version: u16,
    },
}

/// How long past the end of the journal the replayed node keeps running before it stops (and
/// before a host serving it takes the report).
pub const END_MARGIN: Duration = Duration::from_millis(1);

type RecoveryKey = (RecoveryTarget, u64, u32, Option<u64>, Option<u64>);

fn recovery_key(target: &RecoveryTarget, request: &RecoveryRequest) -> RecoveryKey {
    (
        target.clone(),
        request.worker_id,
        request.dp_rank,
        request.start_event_id,
        request.end_event_id,
    )
}

/// When the replay takes its checkpoints.
#[derive(Debug)]
enum Schedule {
    /// On the recorded cadence (a recording's journal).
    Cadence(CheckpointSchedule),
    /// After exactly these inputs: a journal with no cadence (a window cut out of a recording)
    /// carries the recorded checkpoints of its window, renumbered to its own inputs.
    After(BTreeSet<u64>),
}

impl Schedule {
    fn due(&mut self, at: Duration, inputs_handled: u64) -> bool {
        match self {
            Schedule::Cadence(schedule) => schedule.due(at, inputs_handled),
            Schedule::After(points) => points.remove(&inputs_handled),
        }
    }
}

#[derive(Debug)]
struct TapState {
    schedule: Schedule,
    final_inputs: u64,
    pending: (bool, bool),
    checkpoints: Vec<(Duration, Checkpoint)>,
    final_state: Option<(Duration, Checkpoint)>,
}

#[derive(Debug)]
struct ReplayShared {
    origin: OnceLock<Instant>,
    state: Mutex<TapState>,
    answers: Mutex<BTreeMap<RecoveryKey, VecDeque<(Duration, RecoveryOutcome)>>>,
    timing: RecordedTiming,
    starts: RecordedStarts,
}

/// Where the recording applied its pool starts.
#[derive(Debug, Default)]
struct RecordedStarts {
    /// `(pool, layout generation)` → the point and whether the pool started.
    points: BTreeMap<(String, u64), (StartPoint, bool)>,
    /// The journal records every start it applied (not a window): a start it has no record of
    /// was still allocating when it ended. In a window a start is applied where it was issued.
    complete: bool,
}

impl RecordedStarts {
    fn timing(&self, pool_id: &PoolId, layout_generation: u64, issued: StartPoint) -> StartTiming {
        match self.points.get(&(pool_id.to_string(), layout_generation)) {
            Some(&(point, started)) => StartTiming::At { point, started: Some(started) },
            None if self.complete => StartTiming::Never,
            None => StartTiming::At { point: issued, started: None },
        }
    }
}

impl ReplayShared {
    fn state(&self) -> std::sync::MutexGuard<'_, TapState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl NodeTap for ReplayShared {
    fn node_started(&self, origin: Instant) {
        let _ = self.origin.set(origin);
    }

    fn input(&self, _at: Duration, _input: &DcInput) {}

    fn input_time(&self, inputs_handled: u64) -> Option<Duration> {
        self.timing.input_time(inputs_handled)
    }

    fn timer_plan(&self, inputs_handled: u64) -> TimerPlan {
        self.timing.timer_plan(inputs_handled)
    }

    fn timer_fired(&self, at: Duration, inputs_handled: u64) {
        self.timing.fired(inputs_handled, at);
    }

    fn checkpoint_due(&self, at: Duration, inputs_handled: u64) -> bool {
        let at = self.timing.input_at(inputs_handled).unwrap_or(at);
        let mut state = self.state();
        let scheduled = state.schedule.due(at, inputs_handled);
        let last = inputs_handled == state.final_inputs && state.final_state.is_none();
        state.pending = (scheduled, last);
        scheduled || last
    }

    fn checkpoint(&self, at: Duration, checkpoint: Checkpoint) {
        let at = self.timing.input_at(checkpoint.inputs_handled).unwrap_or(at);
        let mut state = self.state();
        let (scheduled, last) = std::mem::take(&mut state.pending);
        if last {
            state.final_state = Some((at, checkpoint.clone()));
        }
        if scheduled {
            state.checkpoints.push((at, checkpoint));
        }
    }

    fn publication_mode(&self, pool_id: &PoolId, layout_generation: u64) -> PublicationMode {
        self.timing.mode(self.origin.get().copied(), pool_id, layout_generation)
    }

    fn start_timing(
        &self,
        pool_id: &PoolId,
        layout_generation: u64,
        issued: StartPoint,
    ) -> StartTiming {
        self.starts.timing(pool_id, layout_generation, issued)
    }

    fn pool_started(&self, _: Duration, _: &PoolId, _: u64, _: StartPoint, _: bool) {}
}

#[derive(Debug)]
struct JournalRecovery(Arc<ReplayShared>);

impl RecoveryTransport for JournalRecovery {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        _timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        let answer = self
            .0
            .answers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(&recovery_key(&target, &request))
            .and_then(VecDeque::pop_front);
        let origin = self.0.origin.get().copied();
        Box::pin(async move {
            match (answer, origin) {
                (Some((at, outcome)), Some(origin)) => {
                    tokio::time::sleep_until(origin + at).await;
                    outcome
                }
                _ => std::future::pending().await,
            }
        })
    }
}

/// A journal read for replay: its inputs with their recorded stamps, the recorded recovery
/// answers, checkpoints and gaps, and the tap through which a node replaying it takes its
/// checkpoints on the recorded schedule. [`replay_journal`] is `open`, `start`, feeding every
/// input at `origin + its time` (with the wall clock set to its recorded reading), and `report`;
/// a host that serves the node meanwhile (the simulator) does the same steps itself.
#[derive(Debug)]
pub struct JournalReplay {
    header: JournalHeader,
    inputs: Vec<(Stamp, DcInput)>,
    recorded: Vec<(Duration, Checkpoint)>,
    gaps: Vec<Duration>,
    journal_fault: Option<JournalError>,
    recoveries_recorded: u64,
    end: Duration,
    shared: Arc<ReplayShared>,
}

impl JournalReplay {
    /// Read the journal at `path` (a recording directory or one segment) within `options`.
    pub fn open(path: &Path, options: ReplayOptions) -> Result<Self, ReplayError> {
        let reader = JournalReader::open(path)?;
        let header = reader.header().clone();
        let mut starts = RecordedStarts { points: BTreeMap::new(), complete: !header.is_window() };
        let version = reader.format_version();
        let (records, journal_fault) = reader.read_all();
        if header.segment != 0 {
            return Err(ReplayError::StartMissing { first_segment: header.segment });
        }
        if !header.is_window() && version < FORMAT_VERSION_TIMERS {
            return Err(ReplayError::TimersNotRecorded { version });
        }
        let in_window = |at: Duration| options.until.is_none_or(|until| at <= until);
        let mut inputs = Vec::new();
        let mut recorded = Vec::new();
        let mut gaps = Vec::new();
        let mut answers: BTreeMap<RecoveryKey, VecDeque<(Duration, RecoveryOutcome)>> =
            BTreeMap::new();
        let mut recoveries_recorded = 0u64;
        let mut timing = RecordedTiming::default();
        if !header.is_window() {
            timing.drive_time(!options.own_clock);
        }
        let mut last_at = Duration::ZERO;
        for record in records {
            let Some(at) = record.stamp().filter(|stamp| in_window(stamp.mono())) else {
                continue;
            };
            last_at = last_at.max(at.mono());
            match record {
                Record::Input { input, .. } => inputs.push((at, input)),
                Record::Recovery { target, request, outcome, .. } => {
                    recoveries_recorded += 1;
                    answers
                        .entry(recovery_key(&target, &request))
                        .or_default()
                        .push_back((at.mono(), outcome));
                }
                Record::Checkpoint { checkpoint, .. } => recorded.push((at.mono(), checkpoint)),
                Record::Gap { .. } => gaps.push(at.mono()),
                Record::Publication { pool, layout_generation, point, .. } => {
                    timing.push(pool, layout_generation, point);
                }
                Record::PoolStart { pool, layout_generation, point, started, .. } => {
                    starts.points.insert((pool, layout_generation), (point, started));
                }
                Record::Timer { inputs_handled, .. } => {
                    timing.push_firing(inputs_handled, at.mono());
                }
                Record::Header(_) => {}
            }
        }
        let end = options.until.unwrap_or(last_at);
        timing.end_at(end);
        timing.inputs_at(inputs.iter().map(|(at, _)| at.mono()));
        let schedule = if header.is_window() {
            Schedule::After(recorded.iter().map(|(_, c)| c.inputs_handled).collect())
        } else {
            let interval = Duration::from_nanos(header.checkpoint_interval_ns);
            Schedule::Cadence(CheckpointSchedule::new(header.checkpoint_every_inputs, interval))
        };
        let shared = Arc::new(ReplayShared {
            origin: OnceLock::new(),
            state: Mutex::new(TapState {
                schedule,
                final_inputs: inputs.len() as u64,
                pending: (false, false),
                checkpoints: Vec::new(),
                final_state: None,
            }),
            answers: Mutex::new(answers),
            timing,
            starts,
        });
        Ok(JournalReplay {
            header,
            inputs,
            recorded,
            gaps,
            journal_fault,
            recoveries_recorded,
            end,
            shared,
        })
    }

    /// The journal's header.
    #[must_use]
    pub fn header(&self) -> &JournalHeader {
        &self.header
    }

    /// The inputs in the window, in journal order, with their recorded stamps.
    #[must_use]
    pub fn inputs(&self) -> &[(Stamp, DcInput)] {
        &self.inputs
    }

    /// The end of the window (node time): `until`, or the last record's time.
    #[must_use]
    pub fn end(&self) -> Duration {
        self.end
    }

    /// Start the replaying node: `config` must be the recorded one; its tap takes checkpoints
    /// on the recorded schedule and its recovery transport answers from the journal. Returns the
    /// node and the instant its monotonic time counts from. Call once.
    pub fn start(
        &self,
        config: NodeConfig,
        executor: Arc<dyn BlockingExecutor>,
        clock: Arc<dyn WallClock>,
    ) -> Result<(NodeHandle, Instant), ReplayError> {
        // Compared as data: a field added since the recording decodes to its default.
        if *self.header.node != config {
            return Err(ReplayError::ConfigMismatch {
                recorded: format!("{:?}", self.header.node),
                given: format!("{config:?}"),
            });
        }
        let node = start_node_with_tap(
            config,
            executor,
            clock,
            Arc::new(JournalRecovery(Arc::clone(&self.shared))),
            Some(Arc::clone(&self.shared) as Arc<dyn NodeTap>),
        )?;
        let origin = self.shared.origin.get().copied().unwrap_or_else(Instant::now);
        Ok((node, origin))
    }

    /// What the replay found so far: the checkpoints the node took up to [`Self::end`] compared
    /// with the recorded ones. Taken once the node's time passed the end (or it stopped).
    #[must_use]
    pub fn report(&self) -> ReplayReport {
        let state = self.shared.state();
        let mut replayed = state.checkpoints.clone();
        replayed.retain(|(at, _)| *at <= self.end);
        let divergence = if self.header.is_window() {
            let view = |checkpoints: &[(Duration, Checkpoint)]| -> Vec<(Duration, Checkpoint)> {
                checkpoints.iter().map(|(at, c)| (*at, c.window_view())).collect()
            };
            first_divergence(&view(&self.recorded), &view(&replayed))
        } else {
            first_divergence(&self.recorded, &replayed)
        };
        ReplayReport {
            header: self.header.clone(),
            inputs_replayed: self.inputs.len() as u64,
            recoveries_recorded: self.recoveries_recorded,
            checkpoints_compared: self.recorded.len(),
            divergence,
            gaps: self.gaps.clone(),
            journal_fault: self.journal_fault.clone(),
            checkpoints: replayed,
            final_state: state.final_state.clone(),
        }
    }
}

/// Replay the journal at `path` through a node built from `config` (see the module doc for
/// the runtime this needs).
pub async fn replay_journal(
    path: &Path,
    config: NodeConfig,
    executor: Arc<dyn BlockingExecutor>,
    options: ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let replay = JournalReplay::open(path, options)?;
    let clock = Arc::new(ManualWallClock::new(replay.header.wall_origin_us));
    let (node, origin) =
        replay.start(config, executor, Arc::clone(&clock) as Arc<dyn WallClock>)?;
    let mut status = node.status.clone();
    let inputs_replayed = replay.inputs.len() as u64;
    for (at, input) in &replay.inputs {
        tokio::time::sleep_until(origin + at.mono()).await;
        clock.set_unix_us(at.wall_us);
        if node.inputs.send(input.clone()).await.is_err() {
            break;
        }
    }
    let _ =
        status.wait_for(|status| status.inputs_handled >= inputs_replayed || status.stopped).await;
    // Everything the node does at `end` happens before it stops; what comes later is not
    // compared (the recording may have stopped at `end`).
    tokio::time::sleep_until(origin + replay.end + END_MARGIN).await;
    node.shutdown().await;
    Ok(replay.report())
}

/// The first checkpoint where `replayed` leaves `recorded` (time or content).
#[must_use]
pub fn first_divergence(
    recorded: &[(Duration, Checkpoint)],
    replayed: &[(Duration, Checkpoint)],
) -> Option<Divergence> {
    let empty = Checkpoint::default();
    for index in 0..recorded.len().max(replayed.len()) {
        let left = recorded.get(index);
        let right = replayed.get(index);
        let diff = compare_checkpoints(
            left.map_or(&empty, |(_, checkpoint)| checkpoint),
            right.map_or(&empty, |(_, checkpoint)| checkpoint),
        );
        let times_differ = left.map(|(at, _)| *at) != right.map(|(at, _)| *at);
        if diff.is_some() || times_differ {
            let mut diff = diff.unwrap_or(CheckpointDiff { entries: Vec::new() });
            if times_differ {
                diff.entries.insert(
                    0,
                    format!(
                        "time: recorded {:?} / replayed {:?}",
                        left.map(|(at, _)| *at),
                        right.map(|(at, _)| *at)
                    ),
                );
            }
            return Some(Divergence {
                index,
                recorded_at: left.map(|(at, _)| *at),
                replayed_at: right.map(|(at, _)| *at),
                diff,
            });
        }
    }
    None
}
