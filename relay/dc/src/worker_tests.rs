//! The simulated worker emits events a real relay pool accepts, with the exact block hashes.

use super::*;
use std::collections::BTreeMap;

use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::{LocalBlockHash, SequenceHash, XXH3_SEED};
use kvrelay_core::pool::{PoolOwnership, RankReplacement};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};

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
        kvrelay_core::model::hashing::local_block_hash(&tokens, &[], XXH3_SEED)
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
    let mut replacement = RankReplacement::new(live.table_key());
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
    let ids =
        |events: Vec<RouterEvent>| events.iter().map(|e| e.event.event_id).collect::<Vec<_>>();
    assert_eq!(ids(w.events_from(0, 2).unwrap()), vec![2, 3, 4, 5]);
    assert_eq!(ids(w.events_from(0, 5).unwrap()), vec![5]);
    assert!(w.events_from(0, 6).is_none(), "nothing newer than the newest");
    assert!(w.events_from(0, 0).is_none(), "ids start at 1");
    assert!(w.events_from(1, 1).is_none(), "no such rank");
    let facts = w.discovery_facts();
    assert!(
        facts
            .iter()
            .any(|f| matches!(f, DcInput::SourceAdvertised(a) if a.recovery_target.is_some()))
    );
}

/// A worker whose rank 0 is at event id `newest`, the last `stores` of them one-block stores
/// (the rest `Cleared`), so the ring's oldest ids are known exactly.
fn worker_at(newest: u64, stores: u64) -> SimWorker {
    let mut w = worker(1 << 20);
    while w.ranks()[0].newest_event_id() < newest - stores {
        let _ = w.clear(0);
    }
    for request in 0..stores {
        let first = u32::try_from(request).unwrap() * 4;
        assert_eq!(w.serve(0, &(first..first + 4).collect::<Vec<u32>>(), None).len(), 1);
    }
    assert_eq!(w.ranks()[0].newest_event_id(), newest);
    w
}

fn range(w: &SimWorker, start: u64, end: Option<u64>) -> RecoveryResponse {
    w.answer_recovery(
        0,
        &RecoveryRequest::range(SourceKey { worker_id: 7, dp_rank: 0 }, start, end),
    )
}

#[test]
fn the_ring_answers_from_its_oldest_kept_id_and_a_tree_dump_before_it() {
    // dynamo-planes-wire §A.6: on a worker at id 20000, start=18977 gave Events and start=18976
    // gave a TreeDump.
    let w = worker_at(20_000, 1_500);
    let RecoveryResponse::Events { events, last_event_id } = range(&w, 18_977, None) else {
        panic!("the oldest kept id is answered from the ring")
    };
    assert_eq!(last_event_id, 20_000);
    assert_eq!(events.len(), EVENT_HISTORY_MAX);
    assert!(events.iter().map(|e| e.event.event_id).eq(18_977..=20_000));
    let RecoveryResponse::TreeDump { events, last_event_id, reset_scope } = range(&w, 18_976, None)
    else {
        panic!("one older than the ring is a tree dump")
    };
    assert_eq!((last_event_id, reset_scope), (20_000, TreeDumpScope::Rank));
    assert_eq!(events.len(), 1_500, "one event per cached block");
    assert!(events.iter().map(|e| e.event.event_id).eq(0..1_500), "synthetic ids from 0");
    assert!(matches!(range(&w, 1, Some(5)), RecoveryResponse::TreeDump { .. }));
}

#[test]
fn ranges_answer_through_the_newest_and_bad_ranges_as_a_worker_does() {
    let w = worker_at(1_200, 1_200);
    // The end only validates: the answer runs through the newest id.
    let RecoveryResponse::Events { events, last_event_id } = range(&w, 1_198, Some(1_198)) else {
        panic!("events")
    };
    assert_eq!(last_event_id, 1_200);
    assert!(events.iter().map(|e| e.event.event_id).eq(1_198..=1_200));
    // Observed: start=100, end=nil on a worker at 50 -> TooNew with the end filled in.
    let at_fifty = worker_at(50, 50);
    assert_eq!(
        range(&at_fifty, 100, None),
        RecoveryResponse::TooNew {
            requested_start: 100,
            requested_end: Some(50),
            newest_available: 50
        }
    );
    assert_eq!(
        range(&at_fifty, 9, Some(3)),
        RecoveryResponse::InvalidRange { start_id: 9, end_id: Some(3) }
    );
    let mut other_rank = RecoveryRequest::tree_dump(SourceKey { worker_id: 7, dp_rank: 1 });
    assert!(matches!(at_fifty.answer_recovery(0, &other_rank), RecoveryResponse::Error(_)));
    other_rank.dp_rank = 0;
    other_rank.worker_id = 8;
    assert!(matches!(at_fifty.answer_recovery(0, &other_rank), RecoveryResponse::Error(_)));
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
    assert!(kvrelay_core::inputs::normalize_legacy_prefill(&mut card));
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
