//! The hook at the node's input boundary.

use std::fmt::Debug;
use std::time::Duration;

use tokio::time::Instant;

use super::checkpoint::Checkpoint;
use crate::inputs::DcInput;

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

    /// Whether to take a checkpoint now, after `inputs_handled` inputs and the commands of the
    /// step just finished. Must be a function of the step sequence and `at` only.
    fn checkpoint_due(&self, at: Duration, inputs_handled: u64) -> bool;

    /// The checkpoint the node took because [`NodeTap::checkpoint_due`] said so.
    fn checkpoint(&self, at: Duration, checkpoint: Checkpoint);
}
