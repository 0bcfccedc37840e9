//! The simulated worker emits events a real relay pool accepts, with the exact block hashes.

use super::*;
use std::collections::BTreeMap;

use crate::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::hashing::{LocalBlockHash, SequenceHash, XXH3_SEED};
use crate::pool::{PoolOwnership, RankReplacement};
use crate::rng::rng_from_seed;

fn worker(capacity: usize) -> SimWorker {
    let mut spec = WorkerSpec::aggregated("dynamo/backend/generate".parse().unwrap(), "tiny-llm");
    spec.block_size = 4;
    spec.capacity_blocks_per_rank = capacity;
    SimWorker::start(spec, 7, &mut rng_from_seed(1))
}

fn pool() -> PoolOwnership {
    PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
        .unwrap()
}

#[test]
fn served_prefixes_become_canonical_blocks_in_a_pool() {
    let mut w = worker(64);
    let mut p = pool();
    let tokens: Vec<u32> = (1..=12).collect();
    for event in w.serve(0, &tokens, None) {
        p.apply_event(&event).unwrap();
    }
    // Dynamo's chain for blocks [1..4], [5..8], [9..12].
    for expected in [14643705804678351452u64, 4945711292740353085, 12583592247330656132] {
        assert!(p.owner_state(SequenceHash(expected)).is_some(), "{expected}");
    }
    // A second request sharing the first two blocks stores only its new block, chained.
    let mut shared: Vec<u32> = (1..=8).collect();
    shared.extend([100, 101, 102, 103]);
    let events = w.serve(0, &shared, None);
    assert_eq!(events.len(), 1);
    let KvCacheEventData::Stored(store) = &events[0].event.data else { panic!("a store") };
    assert_eq!(store.blocks.len(), 1);
    assert!(store.parent_hash.is_some());
    assert_eq!(events[0].event.event_id, 2);
    p.apply_event(&events[0]).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn eviction_removes_leaves_and_the_pool_follows() {
    let mut w = worker(6);
    let mut p = pool();
    for start in 0..10u32 {
        let tokens: Vec<u32> = (start * 100..start * 100 + 8).collect();
        for event in w.serve(0, &tokens, None) {
            p.apply_event(&event).unwrap();
        }
    }
    assert!(w.ranks()[0].len() <= 6);
    let pool_hashes: Vec<u64> = p.owned_blocks().into_iter().map(|(h, _)| h.0).collect();
    let mut cached: Vec<u64> = w.ranks()[0].canonical_hashes().collect();
    cached.sort_unstable();
    assert_eq!(pool_hashes, cached, "the pool owns exactly what the worker caches");
}

#[test]
fn lora_requests_are_salted_by_the_adapter_name() {
    let mut w = worker(64);
    let tokens: Vec<u32> = (1..=4).collect();
    let events = w.serve(0, &tokens, Some("adapter-a"));
    let KvCacheEventData::Stored(store) = &events[0].event.data else { panic!("a store") };
    assert_eq!(store.blocks[0].tokens_hash, LocalBlockHash(11_381_080_598_872_079_209));
    let base = w.serve(0, &tokens, None);
    let KvCacheEventData::Stored(store) = &base[0].event.data else { panic!("a store") };
    assert_eq!(
        store.blocks[0].tokens_hash,
        crate::hashing::local_block_hash(&tokens, &[], XXH3_SEED)
    );
}

#[test]
fn tree_dump_rebuilds_the_same_ownership() {
    let mut w = worker(20);
    let mut live = pool();
    for start in 0..8u32 {
        let tokens: Vec<u32> = (0..4).chain(start * 10..start * 10 + 8).collect();
        for event in w.serve(0, &tokens, None) {
            live.apply_event(&event).unwrap();
        }
    }
    let (dump, last) = w.tree_dump(0);
    assert_eq!(last, w.ranks()[0].next_event_id - 1);
    let mut replacement = RankReplacement::new();
    for event in &dump {
        replacement.push_event(event).unwrap();
    }
    let mut recovered = pool();
    recovered
        .replace_ranks([(SourceKey { worker_id: 7, dp_rank: 0 }, replacement)].into())
        .unwrap();
    assert_eq!(recovered.owned_blocks(), live.owned_blocks());
}

#[test]
fn restart_begins_a_new_incarnation_with_event_ids_from_one() {
    let mut w = worker(20);
    let before = w.ranks()[0].publisher_id();
    let _ = w.serve(0, &(0..8).collect::<Vec<u32>>(), None);
    w.restart(8, &mut rng_from_seed(9));
    assert_ne!(w.ranks()[0].publisher_id(), before);
    assert_eq!(w.worker_id(), 8);
    let events = w.serve(0, &(0..8).collect::<Vec<u32>>(), None);
    assert_eq!(events[0].event.event_id, 1);
    assert_eq!(events[0].worker_id, 8);
}

#[test]
fn history_answers_ranges_it_still_holds() {
    let mut w = worker(8);
    for start in 0..5u32 {
        let _ = w.serve(0, &(start * 10..start * 10 + 4).collect::<Vec<u32>>(), None);
    }
    let range = w.event_range(0, 2, 4).unwrap();
    assert_eq!(range.iter().map(|e| e.event.event_id).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert!(w.event_range(0, 3, 99).is_none());
    let facts = w.discovery_facts();
    assert!(
        facts
            .iter()
            .any(|f| matches!(f, DcInput::SourceAdvertised(a) if a.recovery_target.is_some()))
    );
}

#[test]
fn the_lru_index_holds_exactly_the_leaves() {
    let mut w = worker(12);
    let mut rng = rng_from_seed(3);
    for round in 0..200u32 {
        let shared = (round % 5) * 1000;
        let tail = rng.next_u32() % 40;
        let tokens: Vec<u32> = (shared..shared + 8).chain(tail..tail + 8).collect();
        let _ = w.serve(0, &tokens, None);
        let cache = &w.ranks()[0];
        let leaves: BTreeSet<(u64, u64)> = cache
            .blocks
            .values()
            .filter(|block| block.children == 0)
            .map(|block| (block.last_used, block.canonical))
            .collect();
        assert_eq!(cache.leaves, leaves, "round {round}");
        assert!(cache.len() <= 12);
    }
}

#[test]
fn a_legacy_prefill_worker_emits_a_card_the_relay_normalizes_to_prefill() {
    let mut spec = WorkerSpec::aggregated("legacy/prefill/generate".parse().unwrap(), "lp-llm");
    spec.worker_type = None;
    spec.model_type = Some(ModelTypeFlags(ModelTypeFlags::PREFILL));
    let mut card = SimWorker::start(spec, 7, &mut rng_from_seed(1)).card();
    assert_eq!(card.worker_type, None);
    assert_eq!(card.model_type.to_wire_string(), "Prefill");
    assert!(crate::inputs::normalize_legacy_prefill(&mut card));
    assert_eq!(card.worker_type, Some(WorkerType::Prefill));
    assert_eq!(card.needs, vec![vec![WorkerType::Decode]]);
    let plain = WorkerSpec::aggregated("dynamo/backend/generate".parse().unwrap(), "tiny-llm");
    assert_eq!(plain.card_model_type().to_wire_string(), "Chat | Completions");
}

/// The textbook LRU the worker's cache must agree with: every block of a request's chain is
/// touched, and the least recently used leaf goes first.
#[derive(Default)]
struct EagerLru {
    /// canonical -> (parent, last used, children)
    blocks: BTreeMap<u64, (Option<u64>, u64, u32)>,
    clock: u64,
}

impl EagerLru {
    fn serve(&mut self, chain: &[u64], capacity: usize) {
        self.clock += 1;
        let mut parent = None;
        for &canonical in chain {
            if let Some(block) = self.blocks.get_mut(&canonical) {
                block.1 = self.clock;
            } else {
                if let Some(p) = parent {
                    self.blocks.get_mut(&p).unwrap().2 += 1;
                }
                self.blocks.insert(canonical, (parent, self.clock, 0));
            }
            parent = Some(canonical);
        }
        while self.blocks.len() > capacity {
            let (&victim, _) = self
                .blocks
                .iter()
                .filter(|(_, block)| block.2 == 0)
                .min_by_key(|(canonical, block)| (block.1, **canonical))
                .unwrap();
            let (parent, _, _) = self.blocks.remove(&victim).unwrap();
            if let Some(p) = parent {
                self.blocks.get_mut(&p).unwrap().2 -= 1;
            }
        }
    }
}

#[test]
fn the_cache_evicts_exactly_as_an_eager_lru() {
    for capacity in [6, 12, 24] {
        let mut w = worker(capacity);
        let mut reference = EagerLru::default();
        let mut rng = rng_from_seed(capacity as u64);
        for round in 0..3000u32 {
            // Nested prefixes of varied depth with short tails: interior blocks turn into
            // leaves and back, and their recency decides what goes first.
            let family = rng.next_u32() % 6;
            let depth = rng.next_u32() % 6;
            let tail = rng.next_u32() % 4;
            let tokens: Vec<u32> = (0..depth * 4)
                .map(|i| family * 1000 + i)
                .chain((0..(rng.next_u32() % 2) * 4).map(|i| 100_000 + tail * 100 + i))
                .collect();
            let _ = w.serve(0, &tokens, None);
            let locals =
                local_block_hashes(&tokens, 4, HashFormat::StandardV1, block_hash_seed(None, None));
            let chain: Vec<u64> = sequence_hashes(&locals).iter().map(|hash| hash.0).collect();
            reference.serve(&chain, capacity);
            let mut held: Vec<u64> = w.ranks()[0].canonical_hashes().collect();
            held.sort_unstable();
            let expected: Vec<u64> = reference.blocks.keys().copied().collect();
            assert_eq!(held, expected, "capacity {capacity}, round {round}");
        }
    }
}
