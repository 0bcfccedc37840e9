//! The node's batches: the inputs it takes in one wake-up, and the pool writes it holds back
//! until the batch (or a command that must follow them) ends, so each pool actor receives one
//! command per batch rather than one per input.
//!
//! Invariants:
//! - a held write is sent before any other command reaches any actor, before a checkpoint reads
//!   the actors, and before the node waits for its next wake-up ([`PendingApplies`] is empty at
//!   every one of those points), so each actor sees its commands in the order the control plane
//!   issued them;
//! - within a generation the segments keep their issue order; across generations the order is
//!   the generations' (deterministic, never the order of a hash);
//! - the bytes of an input stay charged to the input queue until its writes have been handed to
//!   their actors ([`PendingApplies::hold_charge`]).

use std::collections::BTreeMap;

use super::input_queue::InputCharge;
use crate::pool::ApplySegment;
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::model::kv_events::RouterEvent;
use kvrelay_core::sources::RankFence;

/// Most inputs the node takes in one batch before it looks at its other work again (reports,
/// fence requests, allocations, timers, the load window).
pub const BATCH_INPUTS_MAX: usize = 64;

/// Whether a batch that has taken `taken` inputs may take another: below the bound, with no
/// shell report waiting and the control plane's timer not due (those go first, so a batch never
/// delays a fault's fence or a deadline by more than the input in its step).
#[must_use]
pub fn may_take_another(taken: usize, report_waiting: bool, timer_due: bool) -> bool {
    taken < BATCH_INPUTS_MAX && !report_waiting && !timer_due
}

/// A pool generation: its pool and layout generation.
pub type Generation = (PoolId, u64);

/// Pool writes held back within a batch, by generation.
#[derive(Debug, Default)]
pub struct PendingApplies {
    writes: BTreeMap<Generation, Vec<ApplySegment>>,
    /// Charges of the inputs whose writes are held.
    charges: Vec<InputCharge>,
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
        self.writes.entry((pool_id, layout_generation)).or_default().push((fence, events));
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
    pub fn take(&mut self) -> (BTreeMap<Generation, Vec<ApplySegment>>, Vec<InputCharge>) {
        (std::mem::take(&mut self.writes), std::mem::take(&mut self.charges))
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
    fn a_batch_ends_at_its_bound_or_when_a_report_or_the_timer_is_due() {
        assert!(may_take_another(1, false, false));
        assert!(may_take_another(BATCH_INPUTS_MAX - 1, false, false));
        assert!(!may_take_another(BATCH_INPUTS_MAX, false, false), "the bound");
        assert!(!may_take_another(1, true, false), "a waiting report goes first");
        assert!(!may_take_another(1, false, true), "a due timer goes first");
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
        let (writes, charges) = pending.take();
        assert!(charges.is_empty());
        let keys: Vec<_> = writes.keys().copied().collect();
        assert_eq!(keys, vec![(first, 2), (first, 3), (second, 1)], "generation order");
        let fences: Vec<_> =
            writes[&(second, 1)].iter().map(|(fence, events)| (*fence, events.len())).collect();
        assert_eq!(fences, vec![(RankFence(1), 2), (RankFence(2), 3)], "issue order kept");
        assert!(pending.is_empty());
    }
}
