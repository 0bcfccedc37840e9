//! The worker recovery query (dc-inputs §3.3) as domain values.
//!
//! A recoverable publisher incarnation advertises a `recovery_target` on the request plane; the
//! relay asks it either for a full tree dump of its local indexer (no start id) or for a range of
//! its recent events. These types mirror `WorkerKvQueryRequest` / `WorkerKvQueryResponse`
//! without wire details: the request-plane codec maps them to and from bytes, and the shell that
//! carries [`super::SourceCommand::RequestRecovery`] out hands the answer back as a
//! [`RecoveryResponse`].

use crate::model::kv_events::{RouterEvent, SourceKey};
use serde::{Deserialize, Serialize};

/// Correlates one recovery call with its answer. Unique within one
/// [`super::SourceTracker`]; never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RecoveryRequestId(pub u64);

/// What kind of query is sent. Only the legacy recovery kind is used by this relay; the
/// state-agent variants of the wire enum are not modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum RecoveryQueryKind {
    /// Ordinary per-rank recovery (the wire default).
    #[default]
    Recovery,
}

/// One query to a worker's recovery endpoint (`WorkerKvQueryRequest`).
///
/// `start_event_id == None` asks for a tree dump; `Some(start)` asks for the events
/// `start..=end` (open-ended when `end_event_id` is `None`) from the worker's ring buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryRequest {
    /// The rank's worker.
    pub worker_id: u64,
    /// The rank.
    pub dp_rank: u32,
    /// First event id wanted, inclusive; `None` for a tree dump.
    pub start_event_id: Option<u64>,
    /// Last event id wanted, inclusive; `None` for "up to the newest".
    pub end_event_id: Option<u64>,
    /// The relay understands `TreeDumpFailed` answers (always true here).
    pub supports_tree_dump_failed: bool,
    /// The query kind.
    pub kind: RecoveryQueryKind,
}

impl RecoveryRequest {
    /// A tree-dump request for `source`.
    #[must_use]
    pub fn tree_dump(source: SourceKey) -> Self {
        RecoveryRequest {
            worker_id: source.worker_id,
            dp_rank: source.dp_rank,
            start_event_id: None,
            end_event_id: None,
            supports_tree_dump_failed: true,
            kind: RecoveryQueryKind::Recovery,
        }
    }

    /// A range request for `source`, ids `start..=end` (`end == None`: up to the newest).
    #[must_use]
    pub fn range(source: SourceKey, start: u64, end: Option<u64>) -> Self {
        RecoveryRequest {
            start_event_id: Some(start),
            end_event_id: end,
            ..Self::tree_dump(source)
        }
    }

    /// Whether this asks for a full tree dump.
    #[must_use]
    pub fn is_tree_dump(&self) -> bool {
        self.start_event_id.is_none()
    }
}

/// Which state a tree dump claims to describe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TreeDumpScope {
    /// The dump is the complete state of the rank: it may replace the rank wholesale.
    Rank,
    /// A scope this relay does not know. Such a dump is not authoritative for the rank and is
    /// treated like `TreeDumpFailed` (retried).
    Other(String),
}

/// A worker's answer to a [`RecoveryRequest`] (`WorkerKvQueryResponse`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecoveryResponse {
    /// Events from the worker's ring buffer (at most 1024 recent events), with their original
    /// ids. Events before the latest all-domain `Cleared` may be omitted.
    Events {
        /// The events, in id order.
        events: Vec<RouterEvent>,
        /// The newest id the worker had applied when answering.
        last_event_id: u64,
    },
    /// A replay-ordered dump of the worker's local indexer: parents before children, synthetic
    /// ids. The rank's cursor becomes `last_event_id`.
    TreeDump {
        /// Store events rebuilding the rank.
        events: Vec<RouterEvent>,
        /// The live event id the dump is consistent with.
        last_event_id: u64,
        /// What the dump describes.
        reset_scope: TreeDumpScope,
    },
    /// The worker could not produce a dump right now (retryable).
    TreeDumpFailed {
        /// The worker's newest id, if it reported one.
        last_event_id: Option<u64>,
        /// The worker's explanation.
        message: String,
    },
    /// The requested range starts after the newest event the worker has.
    TooNew {
        /// Requested first id.
        requested_start: u64,
        /// Requested last id.
        requested_end: Option<u64>,
        /// The worker's newest id.
        newest_available: u64,
    },
    /// The requested range is malformed or no longer available.
    InvalidRange {
        /// Requested first id.
        start_id: u64,
        /// Requested last id.
        end_id: Option<u64>,
    },
    /// Any other failure.
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_dump_and_range_requests_differ_only_in_their_ids() {
        let source = SourceKey { worker_id: 9, dp_rank: 2 };
        let dump = RecoveryRequest::tree_dump(source);
        assert!(dump.is_tree_dump());
        assert!(dump.supports_tree_dump_failed);
        let range = RecoveryRequest::range(source, 5, Some(8));
        assert!(!range.is_tree_dump());
        assert_eq!((range.worker_id, range.dp_rank), (9, 2));
        assert_eq!((range.start_event_id, range.end_event_id), (Some(5), Some(8)));
    }
}

/// Why a recovery query produced no answer: the failure side of the recovery seam, from every
/// transport (Dynamo's request plane, the simulator's planes, a journal) alike.
///
/// The tracker treats every kind the same way (the attempt failed: retry within the attempt
/// bound, then degrade the rank); the kinds say where it failed, for counters, logs and the
/// journal. Texts are the peer's or the operating system's words, kept as data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RecoveryFailure {
    /// No request plane is configured: recoverable ranks continue live-only.
    #[error("no request plane is configured")]
    NoTransport,
    /// No answer arrived within the call's deadline.
    #[error("no answer within the call's deadline")]
    TimedOut,
    /// The worker could not be reached, or the connection broke before the answer was complete.
    #[error("worker unreachable: {0}")]
    Unreachable(String),
    /// The worker answered with an error (for example `Server unavailable: unknown endpoint`).
    #[error("worker refused: {0}")]
    Refused(String),
    /// The answer broke the request plane's framing, could not be decoded, or exceeded a bound.
    #[error("invalid answer: {0}")]
    InvalidAnswer(String),
    /// The relay did not send the query: a local bound (queries pending, connections in use,
    /// request size) or an unusable recovery target.
    #[error("not sent: {0}")]
    NotSent(String),
}
