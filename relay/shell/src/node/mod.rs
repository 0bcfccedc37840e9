//! The running relay: one task drives the sans-IO [`ControlPlane`](kvrelay_core::control::ControlPlane)
//! and every pool generation's [`PoolMachine`](kvrelay_core::pool::PoolMachine) (through
//! [`NodePools`]), and carries out their effects — publication hubs, recovery calls, and the WAN
//! publisher. Its tasks, like every task of the shell, start at [`crate::runtime::spawn`].
//!
//! Order: inputs, shell reports, fence requests, pool requests (subscriptions, lease
//! retirements, counters), allocation completions and timers (the plane's and every pool's) are
//! handled one at a time; the commands each produces run to completion, in order, before the
//! next is taken (the control plane's protocol). Inputs come in batches: one wake-up takes every
//! input queued, up to [`batch::BATCH_INPUTS_MAX`], each in its own step, and ends early when a
//! shell report waits or the control plane's timer is due (a pool's publication timer waits for
//! the batch's end: the writes it would publish are held until then). Within a batch the pool
//! writes are held and each pool is given them at once when the batch ends, or earlier, before
//! any command that reaches a pool or a publication and before a checkpoint ([`batch`] has the
//! invariants); the pool applies them as separate inputs, so publication cadence and journal
//! positions are as if unbatched. A batch also ends at [`batch::BATCH_BLOCKS_MAX`] held blocks,
//! and then yields: applying runs on this loop. In debug builds every pool's invariants are
//! checked after every wake-up. A pool start's filter is allocated off the loop, at most
//! [`CKF_ALLOCATION_CONCURRENCY`] at once, and its outcome applied at a recorded point of the
//! step sequence ([`starts`](self::starts) has the two phases). Queues: DC inputs wait in a queue
//! bounded in items and in bytes (senders wait; [`input_queue`]; an input stays charged until
//! its writes reach their pool), shell reports in another; pool faults that find the report
//! queue full fence their generation instead of being lost. A withdrawn generation's streams end
//! only after the catalog update that withdraws it has been handed to the WAN publisher
//! (withdraw, then drain).

mod batch;
mod input_queue;
mod pools;
mod recovery;
mod run;
mod starts;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) use input_queue::kv_batch;
pub use input_queue::{
    INPUT_QUEUE_BYTES_MAX_DEFAULT, INPUT_QUEUE_BYTES_MAX_LIMIT, InputCharge, InputPermit,
    InputQueueClosed, InputQueueStats, InputReceiver, InputSender, QueuedInput, input_queue,
};
pub(crate) use pools::NodePools;
pub use recovery::{NoRecovery, RecoveryTransport};
pub use run::{NodeConfig, NodeHandle, NodeStatus, start_node, start_node_with_tap};
pub use starts::{CKF_ALLOCATION_CONCURRENCY, StartPoint, StartTiming};
