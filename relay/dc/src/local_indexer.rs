//! A simulated worker's local indexer answering recovery queries as a Dynamo 1.6.1 worker does
//! (dynamo-planes-wire §A.6, dc-inputs §3.3).
//!
//! Each publisher incarnation serves its own recovery endpoint, so a query reaches one rank of
//! one process. The answer, in the order the worker decides it:
//! - a request naming another worker id or rank: `Error`;
//! - no start id: a `TreeDump` of the rank (replay order, synthetic ids from 0, `last_event_id`
//!   the newest live id);
//! - a start after the newest id: `TooNew`, a missing end filled with the newest id;
//! - an end before the start: `InvalidRange`;
//! - a start the ring of the last [`EVENT_HISTORY_MAX`](super::worker::EVENT_HISTORY_MAX)
//!   events still holds: `Events` from the start **through the newest** (the end only
//!   validates), `last_event_id` the newest;
//! - a start older than the ring (or an empty ring): a `TreeDump`, as for no start.

use super::worker::SimWorker;
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// The request plane's rejection of a query for an endpoint no live process serves: the ACK text
/// a worker sends for a path it does not know (dynamo-planes-wire §A.8).
#[must_use]
pub(super) fn unknown_endpoint(target: &RecoveryTarget) -> String {
    format!("Server unavailable: unknown endpoint {:x}/{}", target.instance_id, target.endpoint)
}

impl SimWorker {
    /// Answer `request` arriving at the recovery endpoint of `rank`.
    #[must_use]
    pub fn answer_recovery(&self, rank: u32, request: &RecoveryRequest) -> RecoveryResponse {
        if request.worker_id != self.worker_id() || request.dp_rank != rank {
            return RecoveryResponse::Error(format!(
                "query for worker {:x} rank {} reached worker {:x} rank {rank}",
                request.worker_id,
                request.dp_rank,
                self.worker_id(),
            ));
        }
        let Some(cache) = self.ranks().get(rank as usize) else {
            return RecoveryResponse::Error(format!("no rank {rank}"));
        };
        let newest = cache.newest_event_id();
        let Some(start) = request.start_event_id else { return self.dump(rank) };
        let end = request.end_event_id.unwrap_or(newest);
        if start > newest {
            return RecoveryResponse::TooNew {
                requested_start: start,
                requested_end: Some(end),
                newest_available: newest,
            };
        }
        if end < start {
            return RecoveryResponse::InvalidRange { start_id: start, end_id: Some(end) };
        }
        match self.events_from(rank, start) {
            Some(events) => RecoveryResponse::Events { events, last_event_id: newest },
            None => self.dump(rank),
        }
    }

    fn dump(&self, rank: u32) -> RecoveryResponse {
        let (events, last_event_id) = self.tree_dump(rank);
        RecoveryResponse::TreeDump { events, last_event_id, reset_scope: TreeDumpScope::Rank }
    }
}
