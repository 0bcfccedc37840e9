//! The node's batches: the inputs it takes in one wake-up, and the pool writes it holds back
//! until the batch (or a command that must follow them) ends, so each pool is given its writes
//! once per batch rather than once per input.
//!
//! Invariants:
//! - a held write is applied before any other command reaches any pool, before a checkpoint
//!   reads the pools, and before the node waits for its next wake-up ([`PendingApplies`] is
//!   empty at every one of those points), so each pool sees its commands in the order the
//!   control plane issued them;
//! - within a generation the segments keep their issue order; across generations the order is
//!   the generations' (deterministic, never the order of a hash);
//! - the bytes of an input stay charged to the input queue until its writes have been handed to
//!   their pools ([`PendingApplies::hold_charge`]).

use std::collections::BTreeMap;

use super::input_queue::InputCharge;
use crate::pool::{ApplySegment, GenerationKey};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::model::kv_events::RouterEvent;
use kvrelay_core::sources::RankFence;

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

/// Pool writes held back within a batch, by generation.
#[derive(Debug, Default)]
pub struct PendingApplies {
    writes: BTreeMap<GenerationKey, Vec<ApplySegment>>,
    /// Charges of the inputs whose writes are held.
    charges: Vec<InputCharge>,
    /// Blocks the held writes carry (an event without blocks weighs one).
    blocks: usize,
}

impl PendingApplies {
    /// Hold one input's events for generation `(pool_id, layout_generation)`.
    pub fn push(
        &mut self,
        pool_id: PoolId,
        layout_generation: u64,
        fence: RankFence,
        events: Vec<RouterEvent>,
    ) {
        self.blocks += events.iter().map(event_weight).sum::<usize>();
        self.writes.entry((pool_id, layout_generation)).or_default().push((fence, events));
    }

    /// Blocks the held writes carry.
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Keep an input's bytes charged until the held writes are sent.
    pub fn hold_charge(&mut self, charge: InputCharge) {
        self.charges.push(charge);
    }

    /// Nothing held (charges included).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.charges.is_empty()
    }

    /// Take every held write, in generation order, and the charges to drop once they are sent.
    pub fn take(&mut self) -> (BTreeMap<GenerationKey, Vec<ApplySegment>>, Vec<InputCharge>) {
        self.blocks = 0;
        (std::mem::take(&mut self.writes), std::mem::take(&mut self.charges))
    }
}

/// The blocks one event writes (at least one: a removal of nothing or a clear still costs).
fn event_weight(event: &RouterEvent) -> usize {
    use kvrelay_core::model::kv_events::KvCacheEventData;
    match &event.event.data {
        KvCacheEventData::Stored(store) => store.blocks.len().max(1),
        KvCacheEventData::Removed(remove) => remove.block_hashes.len().max(1),
        KvCacheEventData::Cleared => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::model::hashing::HashFormat;
    use kvrelay_core::model::identity::{DcId, EndpointPath, resolve_indexer_domain};

    fn pool(model: &str) -> PoolId {
        let endpoint: EndpointPath = "ns/backend/generate".parse().unwrap();
        let indexer_domain =
            resolve_indexer_domain(model, 16, HashFormat::StandardV1, &endpoint, None).unwrap();
        PoolId { indexer_domain, dc_id: DcId(1) }
    }

    fn events(n: usize) -> Vec<RouterEvent> {
        use kvrelay_core::model::kv_events::{KvCacheEvent, KvCacheEventData, StorageTier};
        (0..n)
            .map(|i| RouterEvent {
                worker_id: 1,
                event: KvCacheEvent {
                    event_id: i as u64,
                    data: KvCacheEventData::Cleared,
                    dp_rank: 0,
                },
                storage_tier: StorageTier::Device,
                residency_domain: None,
            })
            .collect()
    }

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
    fn writes_come_out_per_generation_in_issue_order_and_the_holder_empties() {
        let (a, b) = (pool("a"), pool("b"));
        let (first, second) = if a < b { (a, b) } else { (b, a) };
        let mut pending = PendingApplies::default();
        assert!(pending.is_empty());
        pending.push(second, 1, RankFence(1), events(2));
        pending.push(first, 3, RankFence(1), events(1));
        pending.push(second, 1, RankFence(2), events(3));
        pending.push(first, 2, RankFence(5), events(1));
        assert!(!pending.is_empty());
        assert_eq!(pending.blocks(), 7, "a clear weighs one block");
        let (writes, charges) = pending.take();
        assert_eq!(pending.blocks(), 0);
        assert!(charges.is_empty());
        let keys: Vec<_> = writes.keys().copied().collect();
        assert_eq!(keys, vec![(first, 2), (first, 3), (second, 1)], "generation order");
        let fences: Vec<_> =
            writes[&(second, 1)].iter().map(|(fence, events)| (*fence, events.len())).collect();
        assert_eq!(fences, vec![(RankFence(1), 2), (RankFence(2), 3)], "issue order kept");
        assert!(pending.is_empty());
    }
}
