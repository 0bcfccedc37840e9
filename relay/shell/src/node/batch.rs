//! The node's batches: the inputs it takes in one wake-up. The relay core holds their pool
//! writes until the batch ends (`kvrelay_core::relay::Relay::flush`), so each pool is given its
//! writes once per batch rather than once per input.
//!
//! Invariants: the node flushes the held writes before it waits for its next wake-up, and the
//! bytes of an input stay charged to the input queue until then (its writes have reached their
//! pools).

/// Most inputs the node takes in one batch before it looks at its other work again (reports,
/// fence requests, allocations, timers, the load window).
pub const BATCH_INPUTS_MAX: usize = 64;

/// Most blocks of pool writes a batch holds before it ends. Applying them runs on the node's
/// loop, so the bound is also how long the node keeps the thread from the transports' readers
/// before it lets them run (a flood of wide events would otherwise stall the event plane for
/// the whole batch: 64 events of 20,000 blocks each).
pub const BATCH_BLOCKS_MAX: usize = 65_536;

/// Whether a batch that has taken `taken` inputs holding `held_blocks` blocks of pool writes may
/// take another: below both bounds, with no shell report waiting and no timer due (those go
/// first, so a batch never delays a fault's fence or a deadline by more than the input in its
/// step).
#[must_use]
pub fn may_take_another(
    taken: usize,
    held_blocks: usize,
    report_waiting: bool,
    timer_due: bool,
) -> bool {
    taken < BATCH_INPUTS_MAX && held_blocks < BATCH_BLOCKS_MAX && !report_waiting && !timer_due
}

/// Whether the node lets every other task run before its next wake-up, after a batch that took
/// `taken` inputs and left `held_blocks` blocks of pool writes to apply: when the batch ended at
/// either bound. A batch cut at a bound may leave inputs queued, and taking them in the same turn
/// would keep the thread from the transports' readers and from the publication hubs, whose
/// delta broadcast buffers a few batches' publications, not a queue's worth.
#[must_use]
pub fn yields_after(taken: usize, held_blocks: usize) -> bool {
    taken >= BATCH_INPUTS_MAX || held_blocks >= BATCH_BLOCKS_MAX
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_ends_at_its_bounds_or_when_a_report_or_the_timer_is_due() {
        assert!(may_take_another(1, 0, false, false));
        assert!(may_take_another(BATCH_INPUTS_MAX - 1, BATCH_BLOCKS_MAX - 1, false, false));
        assert!(!may_take_another(BATCH_INPUTS_MAX, 0, false, false), "the input bound");
        assert!(!may_take_another(1, BATCH_BLOCKS_MAX, false, false), "the block bound");
        assert!(!may_take_another(1, 0, true, false), "a waiting report goes first");
        assert!(!may_take_another(1, 0, false, true), "a due timer goes first");
    }

    #[test]
    fn the_node_yields_after_a_batch_cut_at_a_bound_only() {
        assert!(!yields_after(1, 0), "a batch that emptied the queue");
        assert!(!yields_after(BATCH_INPUTS_MAX - 1, BATCH_BLOCKS_MAX - 1));
        assert!(yields_after(BATCH_INPUTS_MAX, 0), "the input bound");
        assert!(yields_after(1, BATCH_BLOCKS_MAX), "the block bound");
    }
}
