//! The running relay: one task drives the sans-IO [`Relay`](kvrelay_core::relay::Relay) (the
//! control plane and every running pool generation's machine, composed in the core) and carries
//! out its effects — pool starts, publication hubs, recovery calls, the journal's publication
//! points and the WAN publisher. Its tasks, like every task of the shell, start at
//! [`crate::runtime::spawn`].
//!
//! Order: inputs, shell reports (recovery answers), fence requests, pool requests
//! (subscriptions, lease retirements, counters), allocation completions and timers (the plane's
//! and every pool's, one deadline from the relay) are handed to the relay one at a time, and the
//! effects each leaves are carried out to completion, in order, before the next is taken. Inputs
//! come in batches: one wake-up takes every input queued, up to [`batch::BATCH_INPUTS_MAX`],
//! each in its own step, and ends early when a shell report waits, the control plane's timer
//! is due, or (in a replay) a recorded timer firing follows the input just taken (a pool's
//! publication timer waits for the batch's end: the writes it would publish are held until
//! then, and each is applied at the time of the step that issued it). The relay holds a batch's pool writes and gives each pool its writes at once
//! when the batch ends (or earlier, before any command that reaches a pool or leaves the core,
//! and before a checkpoint); the pool applies them as separate inputs, so publication cadence
//! and journal positions are as if unbatched. A batch also ends at [`batch::BATCH_BLOCKS_MAX`]
//! held blocks, and then yields: applying runs on this loop. A pool's faults reach the control
//! plane inside the relay, in the call that raised them. In debug builds the relay's invariants
//! (and every pool link's) are checked after every wake-up. A pool start's filter is allocated
//! off the loop, at most [`CKF_ALLOCATION_CONCURRENCY`] at once, and its outcome applied at a
//! recorded point of the step sequence ([`starts`](self::starts) has the two phases). Queues: DC
//! inputs wait in a queue bounded in items and in bytes (senders wait; [`input_queue`]; an input
//! stays charged until its writes reach their pool), recovery answers in another. A withdrawn
//! generation's streams end only after the catalog update that withdraws it has been handed to
//! the WAN publisher (withdraw, then drain), and its pool stops only after its streams ended.

mod batch;
mod input_queue;
mod recovery;
mod run;
mod starts;
#[cfg(test)]
mod tests;
mod wakeups;

#[cfg(test)]
pub(crate) use input_queue::kv_batch;
pub use input_queue::{
    INPUT_QUEUE_BYTES_MAX_DEFAULT, INPUT_QUEUE_BYTES_MAX_LIMIT, InputCharge, InputPermit,
    InputQueueClosed, InputQueueStats, InputReceiver, InputSender, QueuedInput, input_queue,
};
pub use recovery::{NoRecovery, RecoveryTransport};
pub use run::{NodeConfig, NodeHandle, NodeStatus, start_node, start_node_with_tap};
pub use starts::{CKF_ALLOCATION_CONCURRENCY, StartPoint, StartTiming};
pub use wakeups::{SLOW_WAKEUP, WakeupStats};
