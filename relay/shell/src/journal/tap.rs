//! The hook at the node's input boundary.

use std::fmt::Debug;
use std::time::Duration;

use tokio::time::Instant;

use super::checkpoint::Checkpoint;
use crate::node::{StartPoint, StartTiming};
use crate::pool::PublicationMode;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::PoolId;

/// Where a node's timer firings come from: its own timer, or a journal's recorded firings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimerPlan {
    /// The node's own timer at the relay's next deadline (production, a recording, and a
    /// replay of a journal that carries no firings: a window cut out of a recording).
    Own,
    /// The recording fired the relay's timers at this time, with as many inputs handled as
    /// now: fire them at this time, before the next input.
    Recorded(Duration),
    /// The next recorded firing follows more inputs: no firing until then.
    AfterInputs,
    /// Every recorded firing is done: the node's own timer, not before this time (the end of
    /// the replayed window, after which the node runs free).
    OwnFrom(Duration),
}

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

    /// The time to give the relay for input number `inputs_handled` (from 1): the recorded
    /// stamp when a journal drives the node's time, `None` for the node's own clock.
    fn input_time(&self, inputs_handled: u64) -> Option<Duration> {
        let _ = inputs_handled;
        None
    }

    /// Where the node's next timer firing comes from, with `inputs_handled` inputs handled.
    fn timer_plan(&self, inputs_handled: u64) -> TimerPlan {
        let _ = inputs_handled;
        TimerPlan::Own
    }

    /// The node fired the relay's timers at `at` with `inputs_handled` inputs handled: a
    /// recorder journals the firing (it is an input like the others), a replay moves past it.
    /// Required so a tap that wraps another cannot silently drop it.
    fn timer_fired(&self, at: Duration, inputs_handled: u64);

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
