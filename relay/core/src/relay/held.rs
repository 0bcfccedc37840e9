//! Pool writes held back within a batch, so each pool is given its writes once per batch rather
//! than once per input. Each write keeps the time of the step that issued it, and is applied at
//! that time: a pool's publication deadline counts from its first pending write, whatever the
//! batch it travelled in (so a replay that batches differently arms the same deadlines).
//!
//! Invariants:
//! - within a generation the segments keep their issue order; across generations the order is
//!   the generations' (deterministic, never the order of a hash);
//! - [`HeldWrites::blocks`] is the weight of exactly the segments held.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::model::kv_events::{KvCacheEventData, RouterEvent};
use crate::sources::RankFence;

use super::GenerationKey;

/// Events of one rank written under one fence: what one input's step asks of a pool.
pub type ApplySegment = (RankFence, Vec<RouterEvent>);

/// One held write and the time of the step that issued it.
pub type HeldSegment = (Duration, ApplySegment);

/// Held writes, by generation.
#[derive(Debug, Default)]
pub struct HeldWrites {
    writes: BTreeMap<GenerationKey, Vec<HeldSegment>>,
    /// Blocks the held writes carry (an event without blocks weighs one).
    blocks: usize,
}

impl HeldWrites {
    /// Hold one command's events for generation `key`, issued at `at`.
    pub fn push(
        &mut self,
        key: GenerationKey,
        at: Duration,
        fence: RankFence,
        events: Vec<RouterEvent>,
    ) {
        self.blocks += events.iter().map(event_weight).sum::<usize>();
        self.writes.entry(key).or_default().push((at, (fence, events)));
    }

    /// Blocks the held writes carry.
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Nothing held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Take every held write, in generation order.
    pub fn take(&mut self) -> BTreeMap<GenerationKey, Vec<HeldSegment>> {
        self.blocks = 0;
        std::mem::take(&mut self.writes)
    }
}

/// The blocks one event writes (at least one: a removal of nothing or a clear still costs).
fn event_weight(event: &RouterEvent) -> usize {
    match &event.event.data {
        KvCacheEventData::Stored(store) => store.blocks.len().max(1),
        KvCacheEventData::Removed(remove) => remove.block_hashes.len().max(1),
        KvCacheEventData::Cleared => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::hashing::HashFormat;
    use crate::model::identity::{DcId, EndpointPath, PoolId, resolve_indexer_domain};
    use crate::model::kv_events::{KvCacheEvent, StorageTier};

    fn pool(model: &str) -> PoolId {
        let endpoint: EndpointPath = "ns/backend/generate".parse().unwrap();
        let indexer_domain =
            resolve_indexer_domain(model, 16, HashFormat::StandardV1, &endpoint, None).unwrap();
        PoolId { indexer_domain, dc_id: DcId(1) }
    }

    fn clears(n: usize) -> Vec<RouterEvent> {
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
    fn writes_come_out_per_generation_in_issue_order_and_the_holder_empties() {
        let (a, b) = (pool("a"), pool("b"));
        let (first, second) = if a < b { (a, b) } else { (b, a) };
        let mut held = HeldWrites::default();
        assert!(held.is_empty());
        let ms = Duration::from_millis;
        held.push((second, 1), ms(1), RankFence(1), clears(2));
        held.push((first, 3), ms(1), RankFence(1), clears(1));
        held.push((second, 1), ms(2), RankFence(2), clears(3));
        held.push((first, 2), ms(3), RankFence(5), clears(1));
        assert!(!held.is_empty());
        assert_eq!(held.blocks(), 7, "a clear weighs one block");
        let writes = held.take();
        assert_eq!(held.blocks(), 0);
        assert!(held.is_empty());
        let keys: Vec<_> = writes.keys().copied().collect();
        assert_eq!(keys, vec![(first, 2), (first, 3), (second, 1)], "generation order");
        let fences: Vec<_> = writes[&(second, 1)]
            .iter()
            .map(|(at, (fence, events))| (*at, *fence, events.len()))
            .collect();
        assert_eq!(
            fences,
            vec![(ms(1), RankFence(1), 2), (ms(2), RankFence(2), 3)],
            "issue order and issue times kept"
        );
    }
}
