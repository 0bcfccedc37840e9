//! What goes into and comes out of a [`super::SourceTracker`].
//!
//! Inputs are facts (a membership view, an event batch, a recovery answer, a failed pool
//! command); outputs are commands the async shell carries out in order against the pool's
//! [`PoolOwnership`](crate::pool::PoolOwnership) and the request plane:
//!
//! | command | pool / request-plane call |
//! | --- | --- |
//! | [`SourceCommand::ResetRank`] | `PoolOwnership::remove_rank(source)` |
//! | [`SourceCommand::ReplaceRanks`] | one `RankReplacement` per rank (`push_event` for each dump event, in order), then one `PoolOwnership::replace_ranks` |
//! | [`SourceCommand::ApplyEvents`] | `PoolOwnership::apply_event` for each event, in order |
//! | [`SourceCommand::RequestRecovery`] | a `WorkerKvQuery` call to the target, answered with [`SourceInput::RecoveryAnswered`] or [`SourceInput::RecoveryUnreachable`] |
//! | [`SourceCommand::CancelRecovery`] | drop the call; a late answer is ignored anyway |
//!
//! When a pool call fails, the shell reports [`SourceInput::ApplyFailed`] with the fence of the
//! command that failed (for a replacement: leave that rank out of the transactional replace if
//! only its dump failed to build, report it, and replace the others).

use std::time::Duration;

use super::membership::SourceView;
use super::protocol::{RecoveryFailure, RecoveryRequest, RecoveryRequestId, RecoveryResponse};
use crate::inputs::{KvEventBatch, RecoveryTarget};
use crate::model::kv_events::{RouterEvent, SourceKey};
use crate::pool::FailureDisposition;

/// Names one version of a rank's state in the pool: a new fence starts at every reset and every
/// replacement of the rank. Commands that write a rank carry the fence they belong to; a failure
/// reported with an older fence is about state that no longer exists and is ignored.
///
/// Drawn from one counter per tracker; never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankFence(pub u64);

/// Why a rank is reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// A source incarnation was activated: the cold reset before accepting it.
    Activated,
    /// The rank's active source went missing or became ambiguous: its KV is withheld.
    SourceWithheld,
    /// The rank is no longer expected (its worker left): its KV is removed.
    RankRemoved,
    /// A live event skipped ids.
    Gap,
    /// The source emitted a rank-scoped `Cleared`.
    Cleared,
    /// The live-event buffer overflowed during recovery.
    BufferOverflow,
    /// Recovery failed for good: the rank continues live-only.
    RecoveryFailed,
    /// The pool rejected an event or replacement of the rank.
    SourceFault,
    /// The source's recovery answer claimed another rank: the rank is fenced.
    Fenced,
}

/// A tree dump that replaces one rank's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankDump {
    /// The rank.
    pub source: SourceKey,
    /// The fence the replaced state starts.
    pub fence: RankFence,
    /// Replay-ordered store events (parents before children).
    pub events: Vec<RouterEvent>,
    /// The live event id the dump is consistent with (the rank's cursor after replacement).
    pub last_event_id: u64,
}

/// One recovery query to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryCall {
    /// Correlation id; the answer must carry it.
    pub request_id: RecoveryRequestId,
    /// The rank being recovered.
    pub source: SourceKey,
    /// The incarnation whose recovery endpoint is asked.
    pub publisher_id: u64,
    /// Where to send it.
    pub target: RecoveryTarget,
    /// The query.
    pub request: RecoveryRequest,
    /// 1-based attempt number within the rank's current recovery episode.
    pub attempt: u32,
    /// When the tracker gives up on this attempt (it times out by itself; the shell may use it
    /// as the call deadline).
    pub deadline: Duration,
}

/// A command for the shell, to be carried out in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceCommand {
    /// Drop every block of the rank.
    ResetRank {
        /// The rank.
        source: SourceKey,
        /// The fence the (now empty) state starts.
        fence: RankFence,
        /// The rank continues without recovery (best effort) after this reset.
        degraded: bool,
        /// Why.
        reason: ResetReason,
    },
    /// Replace several ranks at once, transactionally (relay-facts §9.6 batching).
    ReplaceRanks {
        /// The ranks, in rank order.
        ranks: Vec<RankDump>,
    },
    /// Apply live or recovered events to one rank, in order.
    ApplyEvents {
        /// The rank.
        source: SourceKey,
        /// The fence of the state they apply to.
        fence: RankFence,
        /// The events, in id order.
        events: Vec<RouterEvent>,
    },
    /// Send a recovery query.
    RequestRecovery(RecoveryCall),
    /// Abandon a recovery query that is still outstanding.
    CancelRecovery {
        /// The abandoned call.
        request_id: RecoveryRequestId,
        /// Its rank.
        source: SourceKey,
    },
}

/// A fact for a [`super::SourceTracker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceInput {
    /// The endpoint's current source membership.
    View(SourceView),
    /// A batch of live events from one publisher.
    Events(KvEventBatch),
    /// A recovery query was answered.
    RecoveryAnswered {
        /// The call.
        request_id: RecoveryRequestId,
        /// The answer.
        response: RecoveryResponse,
    },
    /// A recovery query could not be delivered or its call failed in transport (retried like a
    /// timeout).
    RecoveryUnreachable {
        /// The call.
        request_id: RecoveryRequestId,
        /// What failed.
        failure: RecoveryFailure,
    },
    /// The pool rejected a command for a rank.
    ApplyFailed {
        /// The rank.
        source: SourceKey,
        /// The fence carried by the failed command.
        fence: RankFence,
        /// What the pool says should happen.
        disposition: FailureDisposition,
    },
}
