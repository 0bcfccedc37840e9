//! KV event sources of a serving endpoint: who publishes each rank's KV events, and how the
//! relay keeps each rank's state exact (dc-inputs §3, relay-facts §9.4 and §9.6).
//!
//! Two sans-IO pieces, driven by the host shell:
//!
//! - [`KvSourceMembership`] projects base runtime configs, the live worker set and the
//!   advertised publisher incarnations ([`AdvertTable`]) into a [`SourceView`]: the expected
//!   `(worker_id, dp_rank)` ranks, the resolved KV-state endpoint, each rank's source status and
//!   its lifecycle generation (the cold-reset fence of a source epoch).
//! - [`SourceTracker`] consumes views, live event batches and recovery answers and emits
//!   [`SourceCommand`]s (reset, batched replace, apply, request / cancel recovery) that the shell
//!   carries out against the pool ownership state and the request plane. Its per-rank
//!   [`RankCursor`] detects gaps; recovery uses the worker query of [`RecoveryRequest`] /
//!   [`RecoveryResponse`].
//!
//! Invariants kept by the module:
//! - only a rank's active incarnation ever writes the rank; activating an incarnation is always
//!   preceded by a cold reset of the rank, and ambiguity withholds the rank's KV;
//! - nothing here reads a clock or draws randomness on its own: time comes in as `now`, jitter
//!   from an injected [`RelayRng`](crate::rng::RelayRng);
//! - every queue, map and retry is bounded, with the behaviour at the bound documented where
//!   the bound is defined; bad input is counted or diagnosed, never a panic.

mod commands;
mod cursor;
mod live_buffer;
mod membership;
mod protocol;
mod recovery;

#[cfg(test)]
mod tests;

pub use commands::{RankDump, RankFence, RecoveryCall, ResetReason, SourceCommand, SourceInput};
pub use cursor::{CursorObservation, EVENT_ID_EXHAUSTED, RankCursor};
pub use membership::{
    ADVERTS_MAX, AdvertChange, AdvertTable, AdvertTableError, DATA_PARALLEL_SIZE_MAX,
    EXPECTED_RANKS_MAX, KvSourceMembership, KvStateEndpointResolution, MembershipDiagnostic,
    RankSourceStatus, RankView, SourceAmbiguity, SourceView,
};
pub use protocol::{
    RecoveryFailure, RecoveryQueryKind, RecoveryRequest, RecoveryRequestId, RecoveryResponse,
    TreeDumpScope,
};
pub use recovery::{
    LIVE_BUFFER_BYTES_MAX, LIVE_BUFFER_EVENTS_MAX, RECOVERY_ATTEMPT_TIMEOUT, RECOVERY_ATTEMPTS_MAX,
    RECOVERY_BACKOFF_INITIAL, RECOVERY_BACKOFF_MAX, RECOVERY_FETCHES_IN_FLIGHT_MAX,
    RECOVERY_REBUILD_BATCH_AGE_MAX, RECOVERY_REBUILD_BATCH_WINDOW, RECOVERY_START_JITTER_MAX,
    RankMode, RankReport, SOURCE_FAULT_RECOVERIES_MAX, SourceConfigError, SourceCounters,
    SourceTracker, SourceTrackerConfig,
};
