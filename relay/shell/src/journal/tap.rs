//! The hook at the node's input boundary.

use std::fmt::Debug;
use std::time::Duration;

use tokio::time::Instant;

use super::checkpoint::Checkpoint;
use crate::node::{StartPoint, StartTiming};
use crate::pool::PublicationMode;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::PoolId;

/// What the node tells a journal tap. Times are the node's monotonic time (since
/// [`NodeTap::node_started`]'s origin), the same `now` the control plane is given.
///
/// Every method is called from the node's task and must not block or wait: a tap that cannot
/// keep up drops (and counts) rather than slowing the relay.
pub trait NodeTap: Send + Sync + Debug + 'static {
    /// The node started; its monotonic time counts from `origin`.
    fn node_started(&self, origin: Instant);

    /// The node took `input` off its queue and is about to handle it.
    fn input(&self, at: Duration, input: &DcInput);

    /// Whether to take a checkpoint after the step of input number `inputs_handled`, taken at
    /// `at` (the time [`NodeTap::input`] was given). Must be a function of those two only, so
    /// a checkpoint follows the same input at the same time in every replay.
    fn checkpoint_due(&self, at: Duration, inputs_handled: u64) -> bool;

    /// The checkpoint the node took because [`NodeTap::checkpoint_due`] said so, with the same
    /// `at`.
    fn checkpoint(&self, at: Duration, checkpoint: Checkpoint);

    /// How the pool `(pool_id, layout_generation)`, about to start, publishes: reported to
    /// a recorder, scripted from a journal, or free (the default).
    fn publication_mode(&self, pool_id: &PoolId, layout_generation: u64) -> PublicationMode {
        let _ = (pool_id, layout_generation);
        PublicationMode::Free
    }

    /// When the node applies the start of `(pool_id, layout_generation)`, issued at `issued`:
    /// free, or at the point a recording applied it. Required (like [`NodeTap::pool_started`])
    /// so a tap that wraps another cannot silently drop it.
    fn start_timing(
        &self,
        pool_id: &PoolId,
        layout_generation: u64,
        issued: StartPoint,
    ) -> StartTiming;

    /// The node applied the start of `(pool_id, layout_generation)` at `point` (time `at`):
    /// its pool runs (`started`) or its allocation failed.
    fn pool_started(
        &self,
        at: Duration,
        pool_id: &PoolId,
        layout_generation: u64,
        point: StartPoint,
        started: bool,
    );
}
