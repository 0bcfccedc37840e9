//! Per-rank cursors and recovery for one serving endpoint (dc-inputs §3.4, relay-facts §9.6).
//!
//! [`SourceTracker`] is a sans-IO state machine: it takes membership views, live event batches,
//! recovery answers and pool failures, with the current monotonic time, and returns
//! [`SourceCommand`]s; it asks to be woken at [`SourceTracker::poll_timeout`] and is then driven
//! by [`SourceTracker::handle_timeout`]. It never touches a clock, a socket or the pool.
//!
//! Per active rank it keeps the active incarnation (the rank's source epoch), a cursor over the
//! incarnation's event ids, a mode (recoverable, live-only, degraded, fenced) and a recovery
//! phase (idle, scheduled, in flight, awaiting replacement). The rules:
//!
//! - Activating an incarnation (a new lifecycle generation in the view) cold-resets the rank; a
//!   recoverable rank then asks for a tree dump after 0–3 ms of jitter and buffers live events.
//! - Events of any incarnation other than the rank's active one are dropped and counted, as are
//!   events whose payload names another rank than the advertisement.
//! - A live event is applied when it continues the cursor. While recovery is under way it is
//!   buffered (at most [`LIVE_BUFFER_EVENTS_MAX`]). A gap makes a recoverable rank reset and ask
//!   for a fresh dump; a live-only rank resets and carries on (degraded).
//! - A rank-scoped `Cleared` with a new id resets the rank, abandons recovery and moves the
//!   cursor to its id: the state after it is known exactly (empty).
//! - A tree dump waits in the replacement batch, then replaces the rank and the buffer drains
//!   in id order; a hole left in the buffer asks for the missing range.
//! - Failed or timed-out attempts retry with doubling backoff, at most
//!   [`RECOVERY_ATTEMPTS_MAX`] requests per episode; other failures, and exhaustion, degrade the
//!   rank to live-only: a degraded reset, then the buffered events are applied.
//!
//! Bounds (each with its behaviour at the bound):
//! - ranks: at most the view's expected ranks, never more than [`EXPECTED_RANKS_MAX`] (a view
//!   with more is cut at the bound, in rank order);
//! - live buffer per rank: [`LIVE_BUFFER_EVENTS_MAX`] events and [`LIVE_BUFFER_BYTES_MAX`] bytes
//!   (weighed by [`RouterEvent::weight_bytes`], before the event is held); on overflow the batch holding the
//!   rank's dump is released early if there is one, otherwise the buffer (and the event) are
//!   dropped, the rank is reset and a fresh tree dump is requested as the next attempt of the
//!   same episode (so overflows count against the attempt bound);
//! - requests per recovery episode: [`RECOVERY_ATTEMPTS_MAX`], then degraded;
//! - recovery calls in flight per endpoint: [`RECOVERY_FETCHES_IN_FLIGHT_MAX`]; further due
//!   requests wait in (due time, rank) order;
//! - fault-triggered re-recoveries per activation: [`SOURCE_FAULT_RECOVERIES_MAX`], then degraded;
//! - pending replacements: at most one dump per rank, released when the initial wave completes
//!   or its deadline passes, later after a [`RECOVERY_REBUILD_BATCH_WINDOW`] quiet window or at
//!   the latest [`RECOVERY_REBUILD_BATCH_AGE_MAX`] after the first pending dump. The size of
//!   one dump is bounded by the request-plane decoder, not here (a dump is the worker's whole
//!   local indexer).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand_core::Rng;
use thiserror::Error;

use super::commands::{RankDump, RankFence, RecoveryCall, ResetReason, SourceCommand, SourceInput};
use super::cursor::{CursorObservation, EVENT_ID_EXHAUSTED, RankCursor};
use super::live_buffer::LiveBuffer;
use super::membership::{EXPECTED_RANKS_MAX, RankView, SourceView};
use super::protocol::{RecoveryRequest, RecoveryRequestId, RecoveryResponse, TreeDumpScope};
use crate::inputs::{KvEventBatch, RecoveryTarget};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::{KvCacheEventData, Residency, RouterEvent, SourceKey};
use crate::pool::FailureDisposition;
use crate::rng::RelayRng;

/// Live events buffered per rank while its recovery is under way (the worker's ring buffer has
/// the same size).
pub const LIVE_BUFFER_EVENTS_MAX: usize = 1024;
/// Bytes of live events buffered per rank while its recovery is under way ([`RouterEvent::weight_bytes`]):
/// a worker may put up to 1Mi blocks in one event, so the event bound alone would let one rank
/// hold gigabytes. 64 MiB is about 4Mi stored blocks, far above a healthy rank's traffic during
/// a recovery of a few seconds.
pub const LIVE_BUFFER_BYTES_MAX: usize = 64 << 20;
/// Recovery requests per episode (first attempt included) before the rank degrades.
pub const RECOVERY_ATTEMPTS_MAX: u32 = 8;
/// Backoff before the first retry; it doubles per retry.
pub const RECOVERY_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
/// Largest backoff between two attempts.
pub const RECOVERY_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long one attempt may take (`DYN_RELAY_RECOVERY_ATTEMPT_TIMEOUT_MS`); also the initial
/// wave's deadline.
pub const RECOVERY_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound of the random delay before an activation's tree dump.
pub const RECOVERY_START_JITTER_MAX: Duration = Duration::from_millis(3);
/// Recovery calls outstanding at once per endpoint (recovery fetch concurrency).
pub const RECOVERY_FETCHES_IN_FLIGHT_MAX: usize = 16;
/// Quiet window that closes a batch of later (non-initial) replacements.
pub const RECOVERY_REBUILD_BATCH_WINDOW: Duration = Duration::from_millis(5);
/// Longest a later replacement waits in a batch, however busy (this relay's bound; the
/// reference names only the quiet window).
pub const RECOVERY_REBUILD_BATCH_AGE_MAX: Duration = Duration::from_millis(100);
/// Fault-triggered re-recoveries per activation before the rank degrades.
pub const SOURCE_FAULT_RECOVERIES_MAX: u32 = 8;

/// Tunables of a [`SourceTracker`]; [`Default`] gives the reference values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceTrackerConfig {
    /// See [`RECOVERY_ATTEMPT_TIMEOUT`].
    pub recovery_attempt_timeout: Duration,
    /// See [`RECOVERY_ATTEMPTS_MAX`].
    pub recovery_attempts_max: u32,
    /// See [`RECOVERY_BACKOFF_INITIAL`].
    pub recovery_backoff_initial: Duration,
    /// See [`RECOVERY_BACKOFF_MAX`].
    pub recovery_backoff_max: Duration,
    /// See [`RECOVERY_START_JITTER_MAX`].
    pub recovery_start_jitter_max: Duration,
    /// See [`RECOVERY_FETCHES_IN_FLIGHT_MAX`].
    pub recovery_fetches_in_flight_max: usize,
    /// See [`LIVE_BUFFER_EVENTS_MAX`].
    pub live_buffer_events_max: usize,
    /// See [`RECOVERY_REBUILD_BATCH_WINDOW`].
    pub rebuild_batch_window: Duration,
    /// See [`RECOVERY_REBUILD_BATCH_AGE_MAX`].
    pub rebuild_batch_age_max: Duration,
    /// See [`SOURCE_FAULT_RECOVERIES_MAX`].
    pub source_fault_recoveries_max: u32,
    /// See [`LIVE_BUFFER_BYTES_MAX`]. Last, and defaulted: the journal encodes this struct as a
    /// sequence, so journals written before it existed replay with the default.
    #[serde(default = "live_buffer_bytes_max_default")]
    pub live_buffer_bytes_max: usize,
}

impl Default for SourceTrackerConfig {
    fn default() -> Self {
        SourceTrackerConfig {
            recovery_attempt_timeout: RECOVERY_ATTEMPT_TIMEOUT,
            recovery_attempts_max: RECOVERY_ATTEMPTS_MAX,
            recovery_backoff_initial: RECOVERY_BACKOFF_INITIAL,
            recovery_backoff_max: RECOVERY_BACKOFF_MAX,
            recovery_start_jitter_max: RECOVERY_START_JITTER_MAX,
            recovery_fetches_in_flight_max: RECOVERY_FETCHES_IN_FLIGHT_MAX,
            live_buffer_events_max: LIVE_BUFFER_EVENTS_MAX,
            live_buffer_bytes_max: LIVE_BUFFER_BYTES_MAX,
            rebuild_batch_window: RECOVERY_REBUILD_BATCH_WINDOW,
            rebuild_batch_age_max: RECOVERY_REBUILD_BATCH_AGE_MAX,
            source_fault_recoveries_max: SOURCE_FAULT_RECOVERIES_MAX,
        }
    }
}

fn live_buffer_bytes_max_default() -> usize {
    LIVE_BUFFER_BYTES_MAX
}

/// A [`SourceTrackerConfig`] that cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SourceConfigError {
    /// A count or duration that must be positive is zero.
    #[error("{field} must be positive")]
    NotPositive {
        /// The field.
        field: &'static str,
    },
    /// The initial backoff exceeds the largest backoff.
    #[error("recovery_backoff_initial exceeds recovery_backoff_max")]
    BackoffOrder,
}

impl SourceTrackerConfig {
    /// Check that every bound is usable.
    pub fn validate(&self) -> Result<(), SourceConfigError> {
        let positive = [
            ("recovery_attempt_timeout", !self.recovery_attempt_timeout.is_zero()),
            ("recovery_attempts_max", self.recovery_attempts_max > 0),
            ("recovery_fetches_in_flight_max", self.recovery_fetches_in_flight_max > 0),
            ("live_buffer_events_max", self.live_buffer_events_max > 0),
            ("live_buffer_bytes_max", self.live_buffer_bytes_max > 0),
            ("rebuild_batch_age_max", !self.rebuild_batch_age_max.is_zero()),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, ok)| !ok) {
            return Err(SourceConfigError::NotPositive { field });
        }
        if self.recovery_backoff_initial > self.recovery_backoff_max {
            return Err(SourceConfigError::BackoffOrder);
        }
        Ok(())
    }
}

/// How a rank's events are handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankMode {
    /// The source answers recovery queries: the rank's state is kept exact.
    Recoverable,
    /// The source has no recovery target: best-effort live events.
    LiveOnly,
    /// Recovery failed: live-only until a `Cleared` or a new activation.
    Degraded,
    /// The source's recovery answers claimed another rank: every event is dropped and the rank's
    /// KV withheld until a new activation.
    Fenced,
}

/// What a recovery call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecoveryKind {
    TreeDump,
    Range { start: u64, end: Option<u64> },
}

/// Where a rank's recovery stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RecoveryPhase {
    /// No recovery under way; the buffer is empty.
    Idle,
    /// A request is due at `at` (waits for a fetch slot once due).
    Scheduled { kind: RecoveryKind, at: Duration },
    /// A request is outstanding until `deadline`.
    InFlight { kind: RecoveryKind, request_id: RecoveryRequestId, deadline: Duration },
    /// A tree dump arrived and waits in the replacement batch.
    AwaitingReplace { events: Vec<RouterEvent>, last_event_id: u64 },
}

impl RecoveryPhase {
    /// Whether an answer is still to come (what the initial wave waits for).
    fn is_outstanding(&self) -> bool {
        matches!(self, RecoveryPhase::Scheduled { .. } | RecoveryPhase::InFlight { .. })
    }
}

/// A snapshot of one active rank, for diagnostics and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// The active incarnation.
    pub publisher_id: u64,
    /// The lifecycle generation it was activated under.
    pub lifecycle_generation: u64,
    /// The fence of the rank's current pool state.
    pub fence: RankFence,
    /// The cursor.
    pub cursor: RankCursor,
    /// The mode.
    pub mode: RankMode,
    /// A recovery is scheduled, in flight or waiting for its replacement.
    pub recovering: bool,
    /// Live events waiting in the buffer.
    pub buffered_events: usize,
    /// Requests made in the current recovery episode.
    pub attempts: u32,
}

/// Running totals of a tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SourceCounters {
    /// Live events offered in event batches (every one ends in exactly one of the applied or
    /// dropped counters, in [`SourceCounters::rank_clears`], or in a buffer).
    pub events_received: u64,
    /// Events handed out in `ApplyEvents`.
    pub events_applied: u64,
    /// Of [`SourceCounters::events_applied`], those of range answers rather than live batches.
    pub range_events_applied: u64,
    /// Live rank-scoped `Cleared` events past the cursor (each resets its rank).
    pub rank_clears: u64,
    /// Live events put in a buffer.
    pub events_buffered: u64,
    /// Events from an incarnation that is not the active source of any rank.
    pub events_dropped_inactive_publisher: u64,
    /// Events published under another scope than the resolved KV-state endpoint.
    pub events_dropped_wrong_scope: u64,
    /// Events whose payload `worker_id`/`dp_rank` disagree with the advertisement.
    pub events_dropped_mismatched_rank: u64,
    /// Events already covered by the cursor.
    pub events_dropped_stale: u64,
    /// Events of a fenced rank.
    pub events_dropped_fenced: u64,
    /// Live events carrying [`EVENT_ID_EXHAUSTED`] (each fences its rank instead of freezing
    /// the cursor).
    pub events_dropped_id_exhausted: u64,
    /// Buffered events (and the overflowing one) thrown away at a buffer overflow.
    pub events_dropped_overflow: u64,
    /// Buffered events of a rank that stopped being tracked during its recovery.
    pub events_dropped_retired: u64,
    /// Buffer overflows.
    pub buffer_overflows: u64,
    /// Of [`SourceCounters::buffer_overflows`], those where the byte bound was reached first.
    pub buffer_byte_overflows: u64,
    /// Recovery requests sent.
    pub recovery_requests: u64,
    /// Attempts retried after a failure or timeout.
    pub recovery_retries: u64,
    /// Attempts that timed out.
    pub recovery_timeouts: u64,
    /// Answers that were not authoritative for the request (retried).
    pub recovery_answers_non_authoritative: u64,
    /// Answers for calls that were no longer outstanding.
    pub recovery_answers_stale: u64,
    /// Ranks degraded to live-only.
    pub ranks_degraded: u64,
    /// Ranks fenced.
    pub ranks_fenced: u64,
    /// `ResetRank` commands issued.
    pub rank_resets: u64,
    /// Ranks replaced by dumps.
    pub ranks_replaced: u64,
    /// `ReplaceRanks` commands issued.
    pub replace_batches: u64,
    /// Pool failures acted upon.
    pub faults_handled: u64,
    /// Pool failures of live-only or degraded ranks (counted only: best effort goes on).
    pub faults_ignored: u64,
    /// Pool failures about a fence that no longer exists.
    pub faults_stale: u64,
    /// Producer-level failures (the host retires the pool; nothing to do per rank).
    pub faults_producer: u64,
    /// Activations refused because the publisher id was already active for another rank.
    pub publisher_collisions: u64,
}

impl SourceCounters {
    /// Live events that reached an end: applied from a live batch, dropped for a reason, or a
    /// rank clear (the buffered ones are the rest of [`SourceCounters::events_received`]).
    #[must_use]
    pub fn live_events_accounted(&self) -> u64 {
        let dropped = [
            self.events_dropped_inactive_publisher,
            self.events_dropped_wrong_scope,
            self.events_dropped_mismatched_rank,
            self.events_dropped_stale,
            self.events_dropped_fenced,
            self.events_dropped_id_exhausted,
            self.events_dropped_overflow,
            self.events_dropped_retired,
        ];
        let live_applied = self.events_applied.saturating_sub(self.range_events_applied);
        dropped.iter().fold(live_applied.saturating_add(self.rank_clears), |sum, count| {
            sum.saturating_add(*count)
        })
    }
}

/// State of one rank with an active source.
#[derive(Debug, Clone)]
struct RankState {
    publisher_id: u64,
    lifecycle_generation: u64,
    target: Option<RecoveryTarget>,
    fence: RankFence,
    cursor: RankCursor,
    mode: RankMode,
    phase: RecoveryPhase,
    /// Requests made in the current recovery episode.
    attempts: u32,
    /// Live events held while recovery is under way; never more than the configured maxima.
    buffer: LiveBuffer,
    /// Fault-triggered re-recoveries since activation.
    fault_recoveries: u32,
}

/// The ranks whose first tree dumps are replaced together (relay-facts §9.6).
#[derive(Debug, Clone)]
struct InitialWave {
    /// Wave ranks that may still be waiting for an answer (pruned lazily).
    members: BTreeSet<SourceKey>,
    /// When the wave is released whatever is outstanding.
    deadline: Duration,
}

/// Completed tree dumps waiting to be replaced together.
#[derive(Debug, Clone, Default)]
struct ReplacementBatch {
    /// Ranks in `AwaitingReplace`.
    pending: BTreeSet<SourceKey>,
    first_added_at: Option<Duration>,
    last_added_at: Option<Duration>,
    /// The initial wave, while it lasts.
    wave: Option<InitialWave>,
    /// Whether the initial wave was formed (it is formed once, at the first activation).
    wave_formed: bool,
    /// A wave member left the outstanding phases since the last pruning.
    wave_dirty: bool,
}

/// Output accumulator that coalesces consecutive applies to the same rank state.
#[derive(Debug, Default)]
struct Commands(Vec<SourceCommand>);

impl Commands {
    fn push(&mut self, command: SourceCommand) {
        self.0.push(command);
    }

    fn apply(&mut self, source: SourceKey, fence: RankFence, event: RouterEvent) {
        if let Some(SourceCommand::ApplyEvents { source: last_source, fence: last_fence, events }) =
            self.0.last_mut()
            && *last_source == source
            && *last_fence == fence
        {
            events.push(event);
            return;
        }
        self.0.push(SourceCommand::ApplyEvents { source, fence, events: vec![event] });
    }
}

/// Whether an event clears its whole rank as the pool sees it (a primary-residency `Cleared`).
fn is_rank_clear(event: &RouterEvent) -> bool {
    matches!(event.event.data, KvCacheEventData::Cleared)
        && event.residency() == Ok(Residency::Primary)
}

/// The KV event sources, cursors and recoveries of one serving endpoint.
///
/// Invariants (checked by [`SourceTracker::check_invariants`]):
/// - every active rank's publisher id maps back to it, and no other publisher id is active;
/// - the timer indexes, the in-flight map and the pending batch mirror the ranks' phases
///   exactly, and at most `recovery_fetches_in_flight_max` calls are in flight;
/// - every live event received is accounted for: applied (live), dropped with its reason, a
///   rank clear, or held in a buffer ([`SourceCounters::events_received`]);
/// - a rank's buffer is non-empty only while its recovery is under way, never exceeds
///   `live_buffer_events_max` events nor `live_buffer_bytes_max` bytes (its weight is the sum of
///   its events' [`RouterEvent::weight_bytes`]), and only recoverable ranks buffer.
#[derive(Debug, Clone)]
pub struct SourceTracker {
    config: SourceTrackerConfig,
    kv_state_endpoint: Option<EndpointPath>,
    ranks: BTreeMap<SourceKey, RankState>,
    /// Active incarnation -> its rank.
    publishers: BTreeMap<u64, SourceKey>,
    /// Outstanding calls -> their rank.
    in_flight: BTreeMap<RecoveryRequestId, SourceKey>,
    /// Scheduled requests by due time.
    scheduled: BTreeSet<(Duration, SourceKey)>,
    /// In-flight deadlines.
    deadlines: BTreeSet<(Duration, SourceKey)>,
    batch: ReplacementBatch,
    request_id_last: u64,
    fence_last: u64,
    now_last: Duration,
    counters: SourceCounters,
}

impl SourceTracker {
    /// A tracker with no ranks.
    pub fn new(config: SourceTrackerConfig) -> Result<Self, SourceConfigError> {
        config.validate()?;
        Ok(SourceTracker {
            config,
            kv_state_endpoint: None,
            ranks: BTreeMap::new(),
            publishers: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            scheduled: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            batch: ReplacementBatch::default(),
            request_id_last: 0,
            fence_last: 0,
            now_last: Duration::ZERO,
            counters: SourceCounters::default(),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &SourceTrackerConfig {
        &self.config
    }

    /// Running totals.
    #[must_use]
    pub fn counters(&self) -> &SourceCounters {
        &self.counters
    }

    /// The state of one active rank.
    #[must_use]
    pub fn rank(&self, source: SourceKey) -> Option<RankReport> {
        self.ranks.get(&source).map(|state| RankReport {
            publisher_id: state.publisher_id,
            lifecycle_generation: state.lifecycle_generation,
            fence: state.fence,
            cursor: state.cursor,
            mode: state.mode,
            recovering: state.phase != RecoveryPhase::Idle,
            buffered_events: state.buffer.len(),
            attempts: state.attempts,
        })
    }

    /// The ranks that currently have an active source, in order.
    pub fn active_ranks(&self) -> impl Iterator<Item = SourceKey> + '_ {
        self.ranks.keys().copied()
    }

    /// Recovery calls outstanding.
    #[must_use]
    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether the initial wave is still collecting tree dumps.
    #[must_use]
    pub fn initial_wave_open(&self) -> bool {
        self.batch.wave.is_some()
    }

    /// Take one input at `now` (monotonic; an earlier value than already seen is treated as the
    /// latest seen). `rng` supplies the activation jitter.
    #[must_use]
    pub fn handle(
        &mut self,
        input: SourceInput,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<SourceCommand> {
        let now = self.advance_clock(now);
        let mut out = Commands::default();
        match input {
            SourceInput::View(view) => self.on_view(&view, now, rng, &mut out),
            SourceInput::Events(batch) => self.on_events(batch, now, &mut out),
            SourceInput::RecoveryAnswered { request_id, response } => {
                self.on_answer(request_id, response, now, &mut out);
            }
            SourceInput::RecoveryUnreachable { request_id, failure: _ } => {
                self.on_unreachable(request_id, now, &mut out);
            }
            SourceInput::ApplyFailed { source, fence, disposition } => {
                self.on_apply_failed(source, fence, disposition, now, &mut out);
            }
        }
        self.settle(now, &mut out);
        out.0
    }

    /// When the tracker next wants [`SourceTracker::handle_timeout`]: the earliest attempt
    /// deadline, due request (when a fetch slot is free) or batch release.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        let mut next = self.deadlines.first().map(|(deadline, _)| *deadline);
        if self.in_flight.len() < self.config.recovery_fetches_in_flight_max
            && let Some((at, _)) = self.scheduled.first()
        {
            next = Some(next.map_or(*at, |current| current.min(*at)));
        }
        if let Some(release) = self.batch_release_at() {
            next = Some(next.map_or(release, |current| current.min(release)));
        }
        next
    }

    /// Run every timer due at `now`: attempt timeouts, due requests, batch releases.
    #[must_use]
    pub fn handle_timeout(&mut self, now: Duration) -> Vec<SourceCommand> {
        let now = self.advance_clock(now);
        let mut out = Commands::default();
        let expired: Vec<SourceKey> = self
            .deadlines
            .iter()
            .take_while(|(deadline, _)| *deadline <= now)
            .map(|(_, source)| *source)
            .collect();
        for source in expired {
            self.on_attempt_timeout(source, now, &mut out);
        }
        self.settle(now, &mut out);
        out.0
    }

    /// Verify the invariants of the type doc (tests and debugging: O(state)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut scheduled = BTreeSet::new();
        let mut deadlines = BTreeSet::new();
        let mut in_flight = BTreeMap::new();
        let mut pending = BTreeSet::new();
        for (&source, state) in &self.ranks {
            if self.publishers.get(&state.publisher_id) != Some(&source) {
                return Err(format!(
                    "publisher {:#x} does not map to {source:?}",
                    state.publisher_id
                ));
            }
            match &state.phase {
                RecoveryPhase::Idle => {}
                RecoveryPhase::Scheduled { at, .. } => {
                    scheduled.insert((*at, source));
                }
                RecoveryPhase::InFlight { request_id, deadline, .. } => {
                    deadlines.insert((*deadline, source));
                    in_flight.insert(*request_id, source);
                }
                RecoveryPhase::AwaitingReplace { .. } => {
                    pending.insert(source);
                }
            }
            if !state.buffer.is_empty() && state.phase == RecoveryPhase::Idle {
                return Err(format!("{source:?} buffers events without a recovery"));
            }
            if state.buffer.len() > self.config.live_buffer_events_max {
                return Err(format!("{source:?} buffers {} events", state.buffer.len()));
            }
            if state.buffer.bytes() > self.config.live_buffer_bytes_max {
                return Err(format!("{source:?} buffers {} bytes", state.buffer.bytes()));
            }
            if !state.buffer.weighs_what_it_holds() {
                return Err(format!("{source:?}'s buffer weight is not its events' sum"));
            }
            if state.mode != RankMode::Recoverable
                && (state.phase != RecoveryPhase::Idle || !state.buffer.is_empty())
            {
                return Err(format!("{source:?} in mode {:?} is recovering", state.mode));
            }
        }
        if self.publishers.len() != self.ranks.len() {
            return Err("publisher index has entries without a rank".into());
        }
        let buffered: u64 = self.ranks.values().map(|state| state.buffer.len() as u64).sum();
        let accounted = self.counters.live_events_accounted() + buffered;
        if accounted != self.counters.events_received {
            return Err(format!(
                "{} live events received, {accounted} accounted for ({buffered} buffered)",
                self.counters.events_received
            ));
        }
        if scheduled != self.scheduled || deadlines != self.deadlines {
            return Err("timer indexes disagree with rank phases".into());
        }
        if in_flight != self.in_flight || pending != self.batch.pending {
            return Err("in-flight map or pending batch disagrees with rank phases".into());
        }
        if self.in_flight.len() > self.config.recovery_fetches_in_flight_max {
            return Err(format!("{} calls in flight", self.in_flight.len()));
        }
        Ok(())
    }

    // ---- inputs ------------------------------------------------------------------------------

    fn on_view(
        &mut self,
        view: &SourceView,
        now: Duration,
        rng: &mut RelayRng,
        out: &mut Commands,
    ) {
        let scope = view.resolved_kv_state_endpoint().cloned();
        if scope != self.kv_state_endpoint {
            // Every active source belonged to the old scope.
            let active: Vec<SourceKey> = self.ranks.keys().copied().collect();
            for source in active {
                let reason = if view.ranks.contains_key(&source) {
                    ResetReason::SourceWithheld
                } else {
                    ResetReason::RankRemoved
                };
                self.retire(source, Some(reason), out);
            }
            self.kv_state_endpoint = scope;
        }
        let gone: Vec<SourceKey> =
            self.ranks.keys().filter(|source| !view.ranks.contains_key(source)).copied().collect();
        for source in gone {
            self.retire(source, Some(ResetReason::RankRemoved), out);
        }
        // Deactivate first, so that a publisher id moving between ranks in one view is free
        // before it is activated again.
        let mut reactivating = BTreeSet::new();
        for (&source, rank_view) in &view.ranks {
            let Some(state) = self.ranks.get(&source) else {
                continue;
            };
            if rank_view.status.active_publisher().is_none() {
                self.retire(source, Some(ResetReason::SourceWithheld), out);
            } else if state.lifecycle_generation != rank_view.lifecycle_generation {
                // The activation below issues the cold reset.
                self.retire(source, None, out);
                reactivating.insert(source);
            }
        }
        // A view from `KvSourceMembership` never exceeds the bound; a hand-made one is cut there.
        for (&source, rank_view) in view.ranks.iter().take(EXPECTED_RANKS_MAX) {
            let Some(publisher_id) = rank_view.status.active_publisher() else {
                continue;
            };
            if self.ranks.contains_key(&source) {
                continue;
            }
            if self.publishers.get(&publisher_id).is_some_and(|other| *other != source) {
                // Cannot come from `KvSourceMembership` (a publisher id naming two ranks is a
                // descriptor conflict); a rank that held KV is still reset.
                self.counters.publisher_collisions += 1;
                if reactivating.contains(&source) {
                    self.reset_retired(source, ResetReason::SourceWithheld, out);
                }
                continue;
            }
            self.activate(source, publisher_id, rank_view, now, rng, out);
        }
        if !self.batch.wave_formed && !self.ranks.is_empty() {
            self.batch.wave_formed = true;
            let members: BTreeSet<SourceKey> = self
                .ranks
                .iter()
                .filter(|(_, state)| state.phase.is_outstanding())
                .map(|(source, _)| *source)
                .collect();
            if !members.is_empty() {
                let deadline = now.saturating_add(self.config.recovery_attempt_timeout);
                self.batch.wave = Some(InitialWave { members, deadline });
            }
        }
    }

    fn on_events(&mut self, batch: KvEventBatch, now: Duration, out: &mut Commands) {
        let count = batch.events.len() as u64;
        self.counters.events_received += count;
        let Some(&source) = self.publishers.get(&batch.publisher_id) else {
            self.counters.events_dropped_inactive_publisher += count;
            return;
        };
        if self.kv_state_endpoint.as_ref() != Some(&batch.endpoint) {
            self.counters.events_dropped_wrong_scope += count;
            return;
        }
        for event in batch.events {
            if event.source() != source {
                self.counters.events_dropped_mismatched_rank += 1;
                continue;
            }
            self.on_live_event(source, event, now, out);
        }
    }

    fn on_answer(
        &mut self,
        request_id: RecoveryRequestId,
        response: RecoveryResponse,
        now: Duration,
        out: &mut Commands,
    ) {
        let Some((source, kind)) = self.outstanding(request_id) else {
            self.counters.recovery_answers_stale += 1;
            return;
        };
        // The call is answered: leave the in-flight phase without a cancel.
        self.set_phase(source, RecoveryPhase::Idle, now);
        match response {
            RecoveryResponse::TreeDump { events, last_event_id, reset_scope } => {
                if reset_scope != TreeDumpScope::Rank {
                    self.counters.recovery_answers_non_authoritative += 1;
                    self.retry(source, kind, now, out);
                } else if last_event_id == EVENT_ID_EXHAUSTED
                    || events.iter().any(|event| event.source() != source)
                {
                    self.fence_rank(source, now, out);
                } else {
                    self.set_phase(
                        source,
                        RecoveryPhase::AwaitingReplace { events, last_event_id },
                        now,
                    );
                }
            }
            RecoveryResponse::Events { events, last_event_id } => {
                if kind == RecoveryKind::TreeDump {
                    // Only a dump can rebuild a rank that has no known position.
                    self.counters.recovery_answers_non_authoritative += 1;
                    self.retry(source, kind, now, out);
                } else if last_event_id == EVENT_ID_EXHAUSTED
                    || events.iter().any(|event| {
                        event.source() != source || event.event.event_id == EVENT_ID_EXHAUSTED
                    })
                {
                    self.fence_rank(source, now, out);
                } else {
                    self.apply_recovered(source, events, out);
                    self.drain(source, now, out);
                }
            }
            RecoveryResponse::TreeDumpFailed { .. } => self.retry(source, kind, now, out),
            RecoveryResponse::TooNew { .. }
            | RecoveryResponse::InvalidRange { .. }
            | RecoveryResponse::Error(_) => {
                self.degrade(source, ResetReason::RecoveryFailed, now, out);
            }
        }
    }

    fn on_unreachable(&mut self, request_id: RecoveryRequestId, now: Duration, out: &mut Commands) {
        let Some((source, kind)) = self.outstanding(request_id) else {
            self.counters.recovery_answers_stale += 1;
            return;
        };
        self.set_phase(source, RecoveryPhase::Idle, now);
        self.retry(source, kind, now, out);
    }

    /// The rank and kind of call `request_id` while it is outstanding; `None` once it was
    /// answered, cancelled or never sent. `in_flight` lists exactly the ranks' current calls
    /// (a relation of [`Self::check_invariants`]), so a listed request is its rank's call.
    fn outstanding(&self, request_id: RecoveryRequestId) -> Option<(SourceKey, RecoveryKind)> {
        let source = *self.in_flight.get(&request_id)?;
        let kind = match self.ranks.get(&source).map(|state| &state.phase) {
            Some(RecoveryPhase::InFlight { kind, request_id: current, .. })
                if *current == request_id =>
            {
                Some(*kind)
            }
            _ => None,
        };
        debug_assert!(kind.is_some(), "in-flight {request_id:?} is not the call of {source:?}");
        kind.map(|kind| (source, kind))
    }

    fn on_attempt_timeout(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        let Some(RecoveryPhase::InFlight { kind, .. }) =
            self.ranks.get(&source).map(|state| state.phase.clone())
        else {
            return;
        };
        self.counters.recovery_timeouts += 1;
        self.cancel_recovery(source, now, out);
        self.retry(source, kind, now, out);
    }

    fn on_apply_failed(
        &mut self,
        source: SourceKey,
        fence: RankFence,
        disposition: FailureDisposition,
        now: Duration,
        out: &mut Commands,
    ) {
        let Some(state) = self.ranks.get_mut(&source) else {
            self.counters.faults_stale += 1;
            return;
        };
        if state.fence != fence {
            self.counters.faults_stale += 1;
            return;
        }
        match disposition {
            FailureDisposition::FenceAndRebuildProducer => self.counters.faults_producer += 1,
            FailureDisposition::ReportResourceFailure | FailureDisposition::RejectSource => {
                match state.mode {
                    RankMode::Recoverable => {
                        self.counters.faults_handled += 1;
                        if state.fault_recoveries >= self.config.source_fault_recoveries_max {
                            self.degrade(source, ResetReason::SourceFault, now, out);
                            return;
                        }
                        state.fault_recoveries += 1;
                        state.attempts = 0;
                        self.cancel_recovery(source, now, out);
                        self.reset(source, ResetReason::SourceFault, false, out);
                        self.continue_episode(source, RecoveryKind::TreeDump, now, out);
                    }
                    RankMode::LiveOnly | RankMode::Degraded => self.counters.faults_ignored += 1,
                    RankMode::Fenced => self.counters.faults_stale += 1,
                }
            }
        }
    }

    // ---- live events -------------------------------------------------------------------------

    fn on_live_event(
        &mut self,
        source: SourceKey,
        event: RouterEvent,
        now: Duration,
        out: &mut Commands,
    ) {
        let Some(state) = self.ranks.get(&source) else {
            return;
        };
        let event_id = event.event.event_id;
        if state.mode == RankMode::Fenced {
            self.counters.events_dropped_fenced += 1;
            return;
        }
        if event_id == EVENT_ID_EXHAUSTED {
            self.counters.events_dropped_id_exhausted += 1;
            self.fence_rank(source, now, out);
            return;
        }
        if is_rank_clear(&event) {
            if state.cursor.covers(event_id) {
                self.counters.events_dropped_stale += 1;
            } else {
                self.counters.rank_clears += 1;
                self.on_rank_clear(source, event_id, now, out);
            }
            return;
        }
        let observation = state.cursor.observe(event_id);
        if observation == CursorObservation::Stale {
            self.counters.events_dropped_stale += 1;
            return;
        }
        if state.phase != RecoveryPhase::Idle {
            self.buffer_event(source, event, now, out);
            return;
        }
        match (state.mode, observation) {
            (RankMode::Recoverable, CursorObservation::Contiguous) => {
                self.apply(source, event, out)
            }
            (RankMode::Recoverable, CursorObservation::Initial) => {
                self.push_buffer(source, event);
                self.start_episode(source, now, out);
            }
            (RankMode::Recoverable, CursorObservation::Gap { .. }) => {
                self.reset(source, ResetReason::Gap, false, out);
                self.push_buffer(source, event);
                self.start_episode(source, now, out);
            }
            (RankMode::LiveOnly | RankMode::Degraded, _) => {
                self.apply_live_only(source, event, out);
            }
            // Stale and fenced were handled above.
            (_, CursorObservation::Stale) | (RankMode::Fenced, _) => {}
        }
    }

    /// A rank-scoped `Cleared` past the cursor: the state is known exactly (empty) at its id.
    fn on_rank_clear(
        &mut self,
        source: SourceKey,
        event_id: u64,
        now: Duration,
        out: &mut Commands,
    ) {
        self.cancel_recovery(source, now, out);
        self.reset(source, ResetReason::Cleared, false, out);
        if let Some(state) = self.ranks.get_mut(&source) {
            state.cursor = RankCursor::Live(event_id);
            state.attempts = 0;
            if state.mode == RankMode::Degraded {
                state.mode = RankMode::Recoverable;
            }
        }
        // The buffered events at or before the clear are stale against the new cursor: the
        // drain drops and counts them.
        self.drain(source, now, out);
    }

    /// Apply one event in live-only fashion: a gap resets the rank (degraded) first.
    fn apply_live_only(&mut self, source: SourceKey, event: RouterEvent, out: &mut Commands) {
        let Some(state) = self.ranks.get(&source) else {
            return;
        };
        match state.cursor.observe(event.event.event_id) {
            CursorObservation::Stale => self.counters.events_dropped_stale += 1,
            CursorObservation::Gap { .. } => {
                self.reset(source, ResetReason::Gap, true, out);
                self.apply(source, event, out);
            }
            CursorObservation::Initial | CursorObservation::Contiguous => {
                self.apply(source, event, out);
            }
        }
    }

    /// Hold a live event while recovery is under way, handling overflow.
    fn buffer_event(
        &mut self,
        source: SourceKey,
        event: RouterEvent,
        now: Duration,
        out: &mut Commands,
    ) {
        let Some(state) = self.ranks.get(&source) else {
            return;
        };
        let fits_bytes = state.buffer.bytes().saturating_add(event.weight_bytes())
            <= self.config.live_buffer_bytes_max;
        if state.buffer.len() < self.config.live_buffer_events_max && fits_bytes {
            self.push_buffer(source, event);
            return;
        }
        if !fits_bytes {
            self.counters.buffer_byte_overflows += 1;
        }
        self.counters.buffer_overflows += 1;
        if matches!(state.phase, RecoveryPhase::AwaitingReplace { .. }) {
            // The dump is here: release the batch now rather than lose it, then judge the event
            // against the replaced state. After the release the rank is idle or asks for a
            // range, never awaiting replacement again, so this recursion is one level deep.
            self.release_batch(now, out);
            self.on_live_event(source, event, now, out);
            return;
        }
        let dropped = state.buffer.len() as u64 + 1;
        self.counters.events_dropped_overflow += dropped;
        self.cancel_recovery(source, now, out);
        if let Some(state) = self.ranks.get_mut(&source) {
            state.buffer.clear();
        }
        self.reset(source, ResetReason::BufferOverflow, false, out);
        self.continue_episode(source, RecoveryKind::TreeDump, now, out);
    }

    fn push_buffer(&mut self, source: SourceKey, event: RouterEvent) {
        if let Some(state) = self.ranks.get_mut(&source) {
            debug_assert!(state.buffer.len() < self.config.live_buffer_events_max);
            state.buffer.push(event);
            debug_assert!(state.buffer.bytes() <= self.config.live_buffer_bytes_max);
            self.counters.events_buffered += 1;
        }
    }

    /// Emit one event for the rank's current state and advance the cursor.
    fn apply(&mut self, source: SourceKey, event: RouterEvent, out: &mut Commands) {
        let Some(state) = self.ranks.get_mut(&source) else {
            return;
        };
        state.cursor = RankCursor::Live(event.event.event_id);
        self.counters.events_applied += 1;
        out.apply(source, state.fence, event);
    }

    // ---- recovery ----------------------------------------------------------------------------

    /// Begin a new recovery episode with an immediate tree dump.
    fn start_episode(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        if let Some(state) = self.ranks.get_mut(&source) {
            state.attempts = 0;
        }
        self.continue_episode(source, RecoveryKind::TreeDump, now, out);
    }

    /// Ask for `kind` now as the next request of the current episode, or degrade if the episode
    /// has used all its attempts.
    fn continue_episode(
        &mut self,
        source: SourceKey,
        kind: RecoveryKind,
        now: Duration,
        out: &mut Commands,
    ) {
        let Some(state) = self.ranks.get(&source) else {
            return;
        };
        if state.attempts >= self.config.recovery_attempts_max {
            self.degrade(source, ResetReason::RecoveryFailed, now, out);
        } else {
            self.set_phase(source, RecoveryPhase::Scheduled { kind, at: now }, now);
        }
    }

    /// Retry `kind` after the backoff for the attempts made so far, or degrade if exhausted.
    fn retry(&mut self, source: SourceKey, kind: RecoveryKind, now: Duration, out: &mut Commands) {
        let Some(state) = self.ranks.get(&source) else {
            return;
        };
        if state.attempts >= self.config.recovery_attempts_max {
            self.degrade(source, ResetReason::RecoveryFailed, now, out);
            return;
        }
        self.counters.recovery_retries += 1;
        let at = now.saturating_add(self.backoff(state.attempts));
        self.set_phase(source, RecoveryPhase::Scheduled { kind, at }, now);
    }

    /// Backoff after `attempts` failed attempts: initial · 2^(attempts−1), capped.
    fn backoff(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.config
            .recovery_backoff_initial
            .saturating_mul(1u32 << doublings)
            .min(self.config.recovery_backoff_max)
    }

    /// Send the rank's scheduled request.
    fn issue(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        let Some(state) = self.ranks.get_mut(&source) else {
            return;
        };
        let RecoveryPhase::Scheduled { kind, .. } = state.phase else {
            return;
        };
        let Some(target) = state.target.clone() else {
            // Only recoverable ranks schedule recovery; a missing target cannot be asked.
            self.degrade(source, ResetReason::RecoveryFailed, now, out);
            return;
        };
        state.attempts += 1;
        let attempt = state.attempts;
        let publisher_id = state.publisher_id;
        self.request_id_last += 1;
        let request_id = RecoveryRequestId(self.request_id_last);
        let deadline = now.saturating_add(self.config.recovery_attempt_timeout);
        let request = match kind {
            RecoveryKind::TreeDump => RecoveryRequest::tree_dump(source),
            RecoveryKind::Range { start, end } => RecoveryRequest::range(source, start, end),
        };
        self.set_phase(source, RecoveryPhase::InFlight { kind, request_id, deadline }, now);
        self.counters.recovery_requests += 1;
        out.push(SourceCommand::RequestRecovery(RecoveryCall {
            request_id,
            source,
            publisher_id,
            target,
            request,
            attempt,
            deadline,
        }));
    }

    /// Apply a range answer over the cursor: covered events are skipped, a rank-scoped `Cleared`
    /// resets, and the first gap ends the application (a later range asks again).
    fn apply_recovered(
        &mut self,
        source: SourceKey,
        mut events: Vec<RouterEvent>,
        out: &mut Commands,
    ) {
        events.sort_by_key(|event| event.event.event_id);
        for event in events {
            let Some(state) = self.ranks.get_mut(&source) else {
                return;
            };
            let event_id = event.event.event_id;
            if is_rank_clear(&event) {
                if !state.cursor.covers(event_id) {
                    self.reset(source, ResetReason::Cleared, false, out);
                    if let Some(state) = self.ranks.get_mut(&source) {
                        state.cursor = RankCursor::Live(event_id);
                    }
                }
                continue;
            }
            match state.cursor.observe(event_id) {
                CursorObservation::Stale => {}
                CursorObservation::Initial | CursorObservation::Contiguous => {
                    self.apply(source, event, out);
                    self.counters.range_events_applied += 1;
                }
                CursorObservation::Gap { .. } => return,
            }
        }
    }

    /// Apply buffered events in id order over the current cursor; a hole asks for the missing
    /// range (and keeps the rest buffered), otherwise the episode ends.
    fn drain(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        let Some(state) = self.ranks.get_mut(&source) else {
            return;
        };
        let mut buffered = state.buffer.take();
        buffered.sort_by_key(|event| event.event.event_id);
        let mut events = buffered.into_iter();
        while let Some(event) = events.next() {
            let Some(state) = self.ranks.get_mut(&source) else {
                return;
            };
            match state.cursor.observe(event.event.event_id) {
                CursorObservation::Stale => self.counters.events_dropped_stale += 1,
                CursorObservation::Gap { missing_from, missing_to } => {
                    state.buffer = std::iter::once(event).chain(events).collect();
                    let kind = RecoveryKind::Range { start: missing_from, end: Some(missing_to) };
                    self.continue_episode(source, kind, now, out);
                    return;
                }
                CursorObservation::Initial | CursorObservation::Contiguous => {
                    self.apply(source, event, out);
                }
            }
        }
        if let Some(state) = self.ranks.get_mut(&source) {
            state.attempts = 0;
        }
    }

    /// Give up on exact state: a degraded reset, then the buffered events, live-only.
    fn degrade(
        &mut self,
        source: SourceKey,
        reason: ResetReason,
        now: Duration,
        out: &mut Commands,
    ) {
        self.cancel_recovery(source, now, out);
        self.reset(source, reason, true, out);
        let Some(state) = self.ranks.get_mut(&source) else {
            return;
        };
        if state.mode == RankMode::Recoverable {
            state.mode = RankMode::Degraded;
        }
        state.attempts = 0;
        let mut buffered = state.buffer.take();
        self.counters.ranks_degraded += 1;
        buffered.sort_by_key(|event| event.event.event_id);
        for event in buffered {
            self.apply_live_only(source, event, out);
        }
    }

    /// The rank's source broke a rule it cannot recover from within its incarnation (a recovery
    /// answer claimed another rank, or its event ids reached [`EVENT_ID_EXHAUSTED`]): reset the
    /// rank and drop everything from its source until a new activation.
    fn fence_rank(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        self.cancel_recovery(source, now, out);
        if let Some(state) = self.ranks.get_mut(&source) {
            self.counters.events_dropped_fenced += state.buffer.len() as u64;
            state.buffer.clear();
            state.mode = RankMode::Fenced;
        }
        self.counters.ranks_fenced += 1;
        self.reset(source, ResetReason::Fenced, false, out);
    }

    /// Leave any recovery phase; an outstanding call is cancelled, a pending dump dropped.
    fn cancel_recovery(&mut self, source: SourceKey, now: Duration, out: &mut Commands) {
        if let Some(RecoveryPhase::InFlight { request_id, .. }) =
            self.set_phase(source, RecoveryPhase::Idle, now)
        {
            out.push(SourceCommand::CancelRecovery { request_id, source });
        }
    }

    // ---- membership --------------------------------------------------------------------------

    fn activate(
        &mut self,
        source: SourceKey,
        publisher_id: u64,
        rank_view: &RankView,
        now: Duration,
        rng: &mut RelayRng,
        out: &mut Commands,
    ) {
        debug_assert!(!self.publishers.contains_key(&publisher_id));
        let target = rank_view.status.recovery_target().cloned();
        let mode = if target.is_some() { RankMode::Recoverable } else { RankMode::LiveOnly };
        self.ranks.insert(
            source,
            RankState {
                publisher_id,
                lifecycle_generation: rank_view.lifecycle_generation,
                target,
                fence: RankFence(0),
                cursor: RankCursor::Initial,
                mode,
                phase: RecoveryPhase::Idle,
                attempts: 0,
                buffer: LiveBuffer::default(),
                fault_recoveries: 0,
            },
        );
        self.publishers.insert(publisher_id, source);
        self.reset(source, ResetReason::Activated, false, out);
        if mode == RankMode::Recoverable {
            let jitter = self.jitter(rng);
            let at = now.saturating_add(jitter);
            let kind = RecoveryKind::TreeDump;
            self.set_phase(source, RecoveryPhase::Scheduled { kind, at }, now);
        }
    }

    /// A uniform delay in `0..=recovery_start_jitter_max`, at microsecond resolution.
    fn jitter(&self, rng: &mut RelayRng) -> Duration {
        let max_us = u64::try_from(self.config.recovery_start_jitter_max.as_micros()).unwrap_or(0);
        if max_us == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(rng.next_u64() % (max_us + 1))
    }

    /// Forget an active rank: cancel its recovery and, with a reason, reset it.
    fn retire(&mut self, source: SourceKey, reason: Option<ResetReason>, out: &mut Commands) {
        let now = self.now_last;
        self.cancel_recovery(source, now, out);
        if let Some(reason) = reason {
            self.reset(source, reason, false, out);
        }
        if let Some(state) = self.ranks.remove(&source) {
            self.counters.events_dropped_retired += state.buffer.len() as u64;
            if self.publishers.get(&state.publisher_id) == Some(&source) {
                self.publishers.remove(&state.publisher_id);
            }
        }
        if let Some(wave) = &mut self.batch.wave
            && wave.members.remove(&source)
        {
            self.batch.wave_dirty = true;
        }
    }

    /// Reset a rank that is no longer tracked (its fence is not kept: any later failure report
    /// about it is stale).
    fn reset_retired(&mut self, source: SourceKey, reason: ResetReason, out: &mut Commands) {
        self.fence_last += 1;
        self.counters.rank_resets += 1;
        let fence = RankFence(self.fence_last);
        out.push(SourceCommand::ResetRank { source, fence, degraded: false, reason });
    }

    /// Reset the rank in the pool under a fresh fence; the cursor loses its position.
    fn reset(
        &mut self,
        source: SourceKey,
        reason: ResetReason,
        degraded: bool,
        out: &mut Commands,
    ) {
        let Some(state) = self.ranks.get_mut(&source) else {
            return;
        };
        self.fence_last += 1;
        state.fence = RankFence(self.fence_last);
        state.cursor = RankCursor::Initial;
        self.counters.rank_resets += 1;
        out.push(SourceCommand::ResetRank { source, fence: state.fence, degraded, reason });
    }

    // ---- phases, batches, timers -------------------------------------------------------------

    /// Move a rank to `phase`, keeping every index in step; returns the old phase.
    fn set_phase(
        &mut self,
        source: SourceKey,
        phase: RecoveryPhase,
        now: Duration,
    ) -> Option<RecoveryPhase> {
        let state = self.ranks.get_mut(&source)?;
        let old = std::mem::replace(&mut state.phase, phase);
        match &old {
            RecoveryPhase::Idle => {}
            RecoveryPhase::Scheduled { at, .. } => {
                self.scheduled.remove(&(*at, source));
            }
            RecoveryPhase::InFlight { request_id, deadline, .. } => {
                self.deadlines.remove(&(*deadline, source));
                self.in_flight.remove(request_id);
            }
            RecoveryPhase::AwaitingReplace { .. } => {
                self.batch.pending.remove(&source);
                if self.batch.pending.is_empty() {
                    self.batch.first_added_at = None;
                    self.batch.last_added_at = None;
                }
            }
        }
        match &state.phase {
            RecoveryPhase::Idle => {}
            RecoveryPhase::Scheduled { at, .. } => {
                self.scheduled.insert((*at, source));
            }
            RecoveryPhase::InFlight { request_id, deadline, .. } => {
                self.deadlines.insert((*deadline, source));
                self.in_flight.insert(*request_id, source);
            }
            RecoveryPhase::AwaitingReplace { .. } => {
                self.batch.pending.insert(source);
                self.batch.first_added_at.get_or_insert(now);
                self.batch.last_added_at = Some(now);
            }
        }
        if !state.phase.is_outstanding()
            && self.batch.wave.as_ref().is_some_and(|wave| wave.members.contains(&source))
        {
            self.batch.wave_dirty = true;
        }
        Some(old)
    }

    /// After every input: release a due batch, then send due requests while slots are free.
    fn settle(&mut self, now: Duration, out: &mut Commands) {
        self.release_batch_if_due(now, out);
        while self.in_flight.len() < self.config.recovery_fetches_in_flight_max {
            let Some(&(at, source)) = self.scheduled.first() else {
                break;
            };
            if at > now {
                break;
            }
            self.issue(source, now, out);
            // `issue` always leaves the scheduled phase; should the index ever disagree, drop
            // the entry rather than spin on it.
            if self.scheduled.remove(&(at, source)) {
                debug_assert!(false, "scheduled entry of {source:?} survived issue");
            }
        }
    }

    /// When the pending batch is released if nothing else happens.
    fn batch_release_at(&self) -> Option<Duration> {
        if let Some(wave) = &self.batch.wave {
            return Some(wave.deadline);
        }
        let first = self.batch.first_added_at?;
        let last = self.batch.last_added_at?;
        Some(
            last.saturating_add(self.config.rebuild_batch_window)
                .min(first.saturating_add(self.config.rebuild_batch_age_max)),
        )
    }

    fn release_batch_if_due(&mut self, now: Duration, out: &mut Commands) {
        if self.batch.wave_dirty {
            self.batch.wave_dirty = false;
            if let Some(wave) = &mut self.batch.wave {
                let ranks = &self.ranks;
                wave.members.retain(|source| {
                    ranks.get(source).is_some_and(|state| state.phase.is_outstanding())
                });
            }
        }
        if let Some(wave) = &self.batch.wave {
            if !wave.members.is_empty() && now < wave.deadline {
                return;
            }
            self.batch.wave = None;
            self.release_batch(now, out);
            return;
        }
        if self.batch_release_at().is_some_and(|at| at <= now) {
            self.release_batch(now, out);
        }
    }

    /// Replace every pending rank in one transactional command, then drain each rank.
    fn release_batch(&mut self, now: Duration, out: &mut Commands) {
        let pending: Vec<SourceKey> = self.batch.pending.iter().copied().collect();
        let mut dumps = Vec::with_capacity(pending.len());
        for &source in &pending {
            let Some(RecoveryPhase::AwaitingReplace { events, last_event_id }) =
                self.set_phase(source, RecoveryPhase::Idle, now)
            else {
                continue;
            };
            let Some(state) = self.ranks.get_mut(&source) else {
                continue;
            };
            self.fence_last += 1;
            state.fence = RankFence(self.fence_last);
            state.cursor = RankCursor::Live(last_event_id);
            dumps.push(RankDump { source, fence: state.fence, events, last_event_id });
        }
        if dumps.is_empty() {
            return;
        }
        self.counters.ranks_replaced += dumps.len() as u64;
        self.counters.replace_batches += 1;
        out.push(SourceCommand::ReplaceRanks { ranks: dumps });
        for source in pending {
            self.drain(source, now, out);
        }
    }

    fn advance_clock(&mut self, now: Duration) -> Duration {
        self.now_last = self.now_last.max(now);
        self.now_last
    }
}

#[cfg(test)]
#[path = "recovery_tests.rs"]
mod recovery_tests;
