//! The KV state a prefix of a journal leaves on each publisher's ranks, as the tree dumps the
//! workers would answer: what a node started on a journal window (a cut incident) must be told
//! before the window's events make sense.
//!
//! [`RankStates`] folds the recorded KV events and recovery answers the way a worker's local
//! indexer holds its blocks: per publisher incarnation and rank, events apply in id order (a
//! later id waits for the ids before it, a covered id is ignored), a rank-scoped tree dump newer
//! than the fold replaces it, `Cleared` empties the rank. Only primary-residency blocks are
//! held (the relay ignores the others). [`RankStates::dump`] renders one rank as a replay-ordered
//! dump: stores of parent-linked blocks (a block continuing the previous store's chain joins
//! it), parents before children, ending at the last id applied.
//!
//! A removed block's descendants stay held (a worker evicts leaves; the relay keeps them too),
//! but a dump cannot name a parent that is gone, so a block whose ancestry is broken is left out
//! of the dump and counted in [`RankDump::orphans`].

use std::collections::{BTreeMap, BTreeSet};

use kvrelay::journal::RecoveryOutcome;
use kvrelay_core::inputs::{DcInput, KvEventSourceAdvert, RecoveryTarget};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, Residency, RouterEvent, SourceKey, StorageTier, StoreData,
    StoredBlock,
};
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// Events held per rank while an earlier id is missing; past it the rank waits for a dump.
const PENDING_EVENTS_MAX: usize = 4096;

/// One held block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    tokens_hash: u64,
    parent: Option<u64>,
    /// Insertion counter: a dump lists blocks in this order (parents first where intact).
    inserted: u64,
}

/// One publisher incarnation's rank.
#[derive(Debug, Clone, Default)]
struct Rank {
    blocks: BTreeMap<u64, Block>,
    last_event_id: u64,
    pending: BTreeMap<u64, KvCacheEventData>,
    inserted: u64,
}

impl Rank {
    fn apply_data(&mut self, data: &KvCacheEventData) {
        match data {
            KvCacheEventData::Stored(store) => {
                let mut parent = store.parent_hash.map(|hash| hash.0);
                for block in &store.blocks {
                    self.inserted += 1;
                    let held =
                        Block { tokens_hash: block.tokens_hash.0, parent, inserted: self.inserted };
                    self.blocks.entry(block.block_hash.0).or_insert(held);
                    parent = Some(block.block_hash.0);
                }
            }
            KvCacheEventData::Removed(removed) => {
                for hash in &removed.block_hashes {
                    self.blocks.remove(&hash.0);
                }
            }
            KvCacheEventData::Cleared => self.blocks.clear(),
        }
    }

    /// Take event `event_id` (ids at or below the last applied are covered).
    fn offer(&mut self, event_id: u64, data: &KvCacheEventData) {
        if event_id <= self.last_event_id {
            return;
        }
        if self.pending.len() < PENDING_EVENTS_MAX || self.pending.contains_key(&event_id) {
            self.pending.insert(event_id, data.clone());
        }
        self.drain();
    }

    fn drain(&mut self) {
        while let Some(entry) = self.pending.first_entry() {
            let id = *entry.key();
            if id <= self.last_event_id {
                entry.remove();
            } else if id == self.last_event_id + 1 {
                let data = entry.remove();
                self.apply_data(&data);
                self.last_event_id = id;
            } else {
                break;
            }
        }
    }

    /// Replace the rank with a dump consistent with `last_event_id` (ignored when not newer).
    fn replace(&mut self, events: &[RouterEvent], last_event_id: u64) {
        if last_event_id < self.last_event_id {
            return;
        }
        self.blocks.clear();
        for event in events {
            if primary(event) {
                self.apply_data(&event.event.data);
            }
        }
        self.last_event_id = last_event_id;
        self.drain();
    }
}

fn primary(event: &RouterEvent) -> bool {
    matches!(event.residency(), Ok(Residency::Primary))
}

/// A rank rendered as a tree dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankDump {
    /// The dump's store events.
    pub events: Vec<RouterEvent>,
    /// The last event id applied.
    pub last_event_id: u64,
    /// Blocks the events store.
    pub blocks: usize,
    /// Held blocks left out because an ancestor is gone.
    pub orphans: usize,
}

/// Append `block` to `events`: to the last store when it continues that store's chain, else as a
/// new store.
fn push_block(events: &mut Vec<RouterEvent>, source: SourceKey, hash: u64, block: &Block) {
    let stored = StoredBlock {
        block_hash: ExternalBlockHash(hash),
        tokens_hash: LocalBlockHash(block.tokens_hash),
    };
    if let Some(KvCacheEventData::Stored(store)) = events.last_mut().map(|e| &mut e.event.data)
        && store.blocks.last().map(|last| last.block_hash.0) == block.parent
        && block.parent.is_some()
    {
        store.blocks.push(stored);
        return;
    }
    let data = KvCacheEventData::Stored(StoreData {
        parent_hash: block.parent.map(ExternalBlockHash),
        start_position: None,
        blocks: vec![stored],
    });
    events.push(RouterEvent {
        worker_id: source.worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id: events.len() as u64, dp_rank: source.dp_rank, data },
    });
}

/// Every publisher incarnation's ranks, keyed by `(publisher_id, source)`.
#[derive(Debug, Clone, Default)]
pub struct RankStates {
    ranks: BTreeMap<(u64, SourceKey), Rank>,
    /// Which incarnation a recovery target answers for, per source (from the adverts seen).
    targets: BTreeMap<(RecoveryTarget, SourceKey), u64>,
}

impl RankStates {
    /// Nothing seen yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Fold one input: KV event batches apply, adverts name their recovery targets.
    pub fn apply_input(&mut self, input: &DcInput) {
        match input {
            DcInput::KvEvents(batch) => {
                for event in batch.events.iter().filter(|event| primary(event)) {
                    self.ranks
                        .entry((batch.publisher_id, event.source()))
                        .or_default()
                        .offer(event.event.event_id, &event.event.data);
                }
            }
            DcInput::SourceAdvertised(advert) => {
                if let Some(target) = &advert.recovery_target {
                    self.targets.insert((target.clone(), advert.source), advert.publisher_id);
                }
            }
            _ => {}
        }
    }

    /// Fold one recorded recovery answer: events apply, a rank-scoped dump replaces the rank.
    pub fn apply_recovery(
        &mut self,
        target: &RecoveryTarget,
        request: &RecoveryRequest,
        outcome: &RecoveryOutcome,
    ) {
        let source = SourceKey { worker_id: request.worker_id, dp_rank: request.dp_rank };
        let Some(&publisher_id) = self.targets.get(&(target.clone(), source)) else { return };
        let rank = self.ranks.entry((publisher_id, source)).or_default();
        match outcome {
            Ok(RecoveryResponse::Events { events, .. }) => {
                for event in
                    events.iter().filter(|event| primary(event) && event.source() == source)
                {
                    rank.offer(event.event.event_id, &event.event.data);
                }
            }
            Ok(RecoveryResponse::TreeDump {
                events,
                last_event_id,
                reset_scope: TreeDumpScope::Rank,
            }) => rank.replace(events, *last_event_id),
            _ => {}
        }
    }

    /// The dump `advert`'s worker would answer for its rank now.
    #[must_use]
    pub fn dump(&self, advert: &KvEventSourceAdvert) -> RankDump {
        let Some(rank) = self.ranks.get(&(advert.publisher_id, advert.source)) else {
            return RankDump::default();
        };
        let mut order: Vec<(&u64, &Block)> = rank.blocks.iter().collect();
        order.sort_by_key(|(_, block)| block.inserted);
        let mut listed = BTreeSet::new();
        let mut events = Vec::with_capacity(order.len());
        let mut orphans = 0;
        for &(&hash, _) in &order {
            // The block's unlisted ancestors, nearest first; `None` when one is missing.
            let mut chain = vec![hash];
            let mut intact = true;
            let mut at = hash;
            while let Some(parent) = rank.blocks.get(&at).and_then(|block| block.parent) {
                if listed.contains(&parent) {
                    break;
                }
                if !rank.blocks.contains_key(&parent) || chain.len() > rank.blocks.len() {
                    intact = false;
                    break;
                }
                chain.push(parent);
                at = parent;
            }
            if !intact {
                orphans += 1;
                continue;
            }
            for &block_hash in chain.iter().rev() {
                if listed.insert(block_hash) {
                    push_block(&mut events, advert.source, block_hash, &rank.blocks[&block_hash]);
                }
            }
        }
        RankDump { events, last_event_id: rank.last_event_id, blocks: listed.len(), orphans }
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_core::inputs::{KvEventBatch, RequestPlaneTransport};
    use kvrelay_core::model::identity::EndpointPath;
    use kvrelay_core::model::kv_events::RemoveData;
    use kvrelay_core::pool::{RankReplacement, TableKey};
    use kvrelay_core::rng::rng_from_seed;

    use super::*;

    const PUBLISHER: u64 = 0xabc;
    const SOURCE: SourceKey = SourceKey { worker_id: 7, dp_rank: 1 };

    fn advert() -> KvEventSourceAdvert {
        let endpoint = EndpointPath::new("dynamo", "backend", "generate").unwrap();
        KvEventSourceAdvert {
            kv_state_endpoint: endpoint.clone(),
            source: SOURCE,
            publisher_id: PUBLISHER,
            recovery_target: Some(RecoveryTarget {
                endpoint,
                instance_id: SOURCE.worker_id,
                transport: RequestPlaneTransport::Tcp("127.0.0.1:1/q".into()),
            }),
        }
    }

    fn event(event_id: u64, data: KvCacheEventData) -> RouterEvent {
        RouterEvent {
            worker_id: SOURCE.worker_id,
            storage_tier: StorageTier::Device,
            residency_domain: None,
            event: KvCacheEvent { event_id, dp_rank: SOURCE.dp_rank, data },
        }
    }

    fn store(event_id: u64, parent: Option<u64>, blocks: &[u64]) -> RouterEvent {
        let blocks = blocks
            .iter()
            .map(|&hash| StoredBlock {
                block_hash: ExternalBlockHash(hash),
                tokens_hash: LocalBlockHash(hash * 10),
            })
            .collect();
        event(
            event_id,
            KvCacheEventData::Stored(StoreData {
                parent_hash: parent.map(ExternalBlockHash),
                start_position: None,
                blocks,
            }),
        )
    }

    fn remove(event_id: u64, hashes: &[u64]) -> RouterEvent {
        let block_hashes = hashes.iter().map(|&hash| ExternalBlockHash(hash)).collect();
        event(event_id, KvCacheEventData::Removed(RemoveData { block_hashes }))
    }

    fn batch(events: Vec<RouterEvent>) -> DcInput {
        DcInput::KvEvents(KvEventBatch {
            endpoint: advert().kv_state_endpoint,
            publisher_id: PUBLISHER,
            sequence: 0,
            published_at_ms: 0,
            events,
        })
    }

    fn held(dump: &RankDump) -> Vec<u64> {
        let mut hashes: Vec<u64> = dump
            .events
            .iter()
            .flat_map(|e| match &e.event.data {
                KvCacheEventData::Stored(store) => store.blocks.iter().map(|b| b.block_hash.0),
                _ => panic!("a dump holds stores only"),
            })
            .collect();
        hashes.sort_unstable();
        hashes
    }

    /// The relay accepts the dump as a rank replacement with every block in it.
    fn accepted(dump: &RankDump) -> usize {
        let key = TableKey::from_rng(&rng_from_seed(0));
        let mut replacement = RankReplacement::new(key);
        for event in &dump.events {
            replacement.push_event(event).unwrap();
        }
        replacement.block_count()
    }

    #[test]
    fn events_apply_in_id_order_and_the_dump_lists_parents_first() {
        let mut states = RankStates::new();
        states.apply_input(&DcInput::SourceAdvertised(advert()));
        states.apply_input(&batch(vec![store(1, None, &[1, 2, 3])]));
        // Event 3 (a child of block 2) comes before event 2 (removing block 3).
        states.apply_input(&batch(vec![store(3, Some(2), &[4])]));
        let waiting = states.dump(&advert());
        assert_eq!((held(&waiting), waiting.last_event_id), (vec![1, 2, 3], 1));
        states.apply_input(&batch(vec![remove(2, &[3]), store(1, None, &[9])]));
        let dump = states.dump(&advert());
        assert_eq!((held(&dump), dump.last_event_id, dump.orphans), (vec![1, 2, 4], 3, 0));
        assert_eq!(dump.blocks, 3);
        assert_eq!(accepted(&dump), 3);
        // Other publishers' and non-primary events do not touch the rank.
        let mut other = batch(vec![store(4, None, &[5])]);
        if let DcInput::KvEvents(batch) = &mut other {
            batch.publisher_id = PUBLISHER + 1;
        }
        states.apply_input(&other);
        let mut host = store(4, None, &[6]);
        host.storage_tier = StorageTier::HostPinned;
        states.apply_input(&batch(vec![host]));
        assert_eq!(held(&states.dump(&advert())), vec![1, 2, 4]);
    }

    #[test]
    fn a_newer_recorded_dump_replaces_the_rank_and_cleared_empties_it() {
        let mut states = RankStates::new();
        let advert = advert();
        let target = advert.recovery_target.clone().unwrap();
        states.apply_input(&DcInput::SourceAdvertised(advert.clone()));
        states.apply_input(&batch(vec![store(1, None, &[1])]));
        // Events 2..=9 were lost; the worker's dump at 9 fills the hole, event 10 follows it.
        states.apply_input(&batch(vec![store(10, Some(21), &[22])]));
        let answer = Ok(RecoveryResponse::TreeDump {
            events: vec![store(0, None, &[20, 21])],
            last_event_id: 9,
            reset_scope: TreeDumpScope::Rank,
        });
        states.apply_recovery(&target, &RecoveryRequest::tree_dump(SOURCE), &answer);
        let dump = states.dump(&advert);
        assert_eq!((held(&dump), dump.last_event_id), (vec![20, 21, 22], 10));
        // An older dump changes nothing.
        let stale = Ok(RecoveryResponse::TreeDump {
            events: Vec::new(),
            last_event_id: 5,
            reset_scope: TreeDumpScope::Rank,
        });
        states.apply_recovery(&target, &RecoveryRequest::tree_dump(SOURCE), &stale);
        assert_eq!(held(&states.dump(&advert)), vec![20, 21, 22]);
        states.apply_input(&batch(vec![event(11, KvCacheEventData::Cleared)]));
        let cleared = states.dump(&advert);
        assert_eq!((cleared.events.len(), cleared.last_event_id), (0, 11));
    }

    #[test]
    fn a_block_whose_ancestor_was_removed_is_left_out_and_counted() {
        let mut states = RankStates::new();
        states.apply_input(&batch(vec![store(1, None, &[1, 2, 3]), remove(2, &[2])]));
        let dump = states.dump(&advert());
        assert_eq!((held(&dump), dump.orphans), (vec![1], 1));
        assert_eq!(accepted(&dump), 1);
    }
}
