//! The generator's deterministic model of what it publishes: every (pool, worker, rank) stream,
//! its live blocks, and per pool the canonical keys the relay's filter should hold afterwards.
//!
//! Each stored block gets a fresh engine block id (a per-rank counter: lineage only) and a
//! random `tokens_hash` from the seeded generator; its canonical key is the sequence hash chained
//! from the parent's key (`kvrelay_core::model::hashing::SequenceHash`), exactly what the relay's
//! pool ownership inserts into the cuckoo filter. A store continues the rank's previous store
//! (parent = that event's last block) with probability `chain_share`. Above `live_cap` blocks a
//! rank removes its oldest blocks in a `Removed` event carried in the same message as the store
//! (a message holds at most a few events, as a Dynamo publisher batch does).

use std::collections::{BTreeSet, VecDeque};

use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash, SequenceHash};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use rand_core::Rng;
use rustc_hash::FxHashMap;

/// The shape of the stream (validated flags).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Distinct pools (one endpoint and model each).
    pub pools: usize,
    /// Workers registered per pool.
    pub workers_per_pool: usize,
    /// Data-parallel ranks per worker (one publisher each).
    pub ranks: u32,
    /// Blocks per store event.
    pub blocks_per_event: usize,
    /// Share of stores that continue the rank's previous store.
    pub chain_share: f64,
    /// Live blocks held per rank.
    pub live_cap: usize,
    /// Most removed keys kept in the trace per pool before sampling thins them.
    pub removed_keep_max: usize,
}

/// One rank's publisher: identity, cursors and live blocks (oldest first).
#[derive(Debug)]
pub struct RankStream {
    /// Index of the pool.
    pub pool: usize,
    /// The worker's instance id (`worker_id` in events).
    pub worker_id: u64,
    /// The rank.
    pub dp_rank: u32,
    /// The rank's event publisher incarnation.
    pub publisher_id: u64,
    /// Next event id (ids start at 1 per publisher incarnation).
    pub next_event_id: u64,
    /// Next envelope sequence (from 0 per publisher).
    pub next_sequence: u64,
    next_block: u64,
    live: VecDeque<(ExternalBlockHash, SequenceHash)>,
    last_stored: Option<(ExternalBlockHash, SequenceHash)>,
}

impl RankStream {
    /// Blocks the rank holds now.
    #[must_use]
    pub fn live_blocks(&self) -> usize {
        self.live.len()
    }
}

/// Per pool: owner counts of live canonical keys and the (possibly sampled) removed keys.
#[derive(Debug, Default)]
pub struct PoolKeys {
    live: FxHashMap<u64, u32>,
    removed: BTreeSet<u64>,
    /// Removed keys are kept when their top `removed_shift` bits are zero (1 in 2^shift).
    removed_shift: u32,
    /// Every distinct removal (a key that became unowned), sampled or not.
    pub removals: u64,
}

impl PoolKeys {
    fn add(&mut self, key: u64) {
        *self.live.entry(key).or_insert(0) += 1;
        self.removed.remove(&key);
    }

    fn drop_owner(&mut self, key: u64, keep_max: usize) {
        let Some(count) = self.live.get_mut(&key) else { return };
        *count -= 1;
        if *count > 0 {
            return;
        }
        self.live.remove(&key);
        self.removals += 1;
        if sampled(key, self.removed_shift) {
            self.removed.insert(key);
            while self.removed.len() > keep_max && self.removed_shift < 63 {
                self.removed_shift += 1;
                let shift = self.removed_shift;
                self.removed.retain(|&kept| sampled(kept, shift));
            }
        }
    }

    /// The live keys, sorted.
    #[must_use]
    pub fn live_sorted(&self) -> Vec<u64> {
        let mut keys: Vec<u64> = self.live.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// The kept removed keys (not live at the end), sorted.
    #[must_use]
    pub fn removed_sorted(&self) -> Vec<u64> {
        self.removed.iter().copied().filter(|key| !self.live.contains_key(key)).collect()
    }

    /// 1 in 2^shift removed keys is kept.
    #[must_use]
    pub fn removed_shift(&self) -> u32 {
        self.removed_shift
    }
}

fn sampled(key: u64, shift: u32) -> bool {
    shift == 0 || key >> (64 - shift) == 0
}

/// What one step produced: the rank it belongs to and its events (a store, maybe a removal).
#[derive(Debug)]
pub struct Step {
    /// Index into [`Model::ranks`].
    pub rank: usize,
    /// The events, in id order.
    pub events: Vec<RouterEvent>,
    /// Blocks stored by the step.
    pub stored_blocks: usize,
    /// Blocks removed by the step.
    pub removed_blocks: usize,
}

/// Every rank stream and every pool's keys.
#[derive(Debug)]
pub struct Model {
    shape: Shape,
    /// Rank streams, pool-major, then worker, then rank.
    pub ranks: Vec<RankStream>,
    /// Per-pool keys.
    pub pools: Vec<PoolKeys>,
    cursor: usize,
}

/// A uniform draw in `[0, 1)`.
fn unit(rng: &mut impl Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

impl Model {
    /// Build the streams; worker and publisher ids are drawn from `rng`, distinct, non-zero and
    /// 53-bit (JSON-safe, as Dynamo's are).
    pub fn new(shape: Shape, rng: &mut impl Rng) -> Self {
        let mut taken = BTreeSet::new();
        let mut fresh_id = |rng: &mut dyn FnMut() -> u64| loop {
            let id = rng() & ((1 << 53) - 1);
            if id != 0 && taken.insert(id) {
                return id;
            }
        };
        let mut draw = || rng.next_u64();
        let mut ranks = Vec::new();
        for pool in 0..shape.pools {
            for _ in 0..shape.workers_per_pool {
                let worker_id = fresh_id(&mut draw);
                for dp_rank in 0..shape.ranks {
                    ranks.push(RankStream {
                        pool,
                        worker_id,
                        dp_rank,
                        publisher_id: fresh_id(&mut draw),
                        next_event_id: 1,
                        next_sequence: 0,
                        next_block: 1,
                        live: VecDeque::new(),
                        last_stored: None,
                    });
                }
            }
        }
        let pools = (0..shape.pools).map(|_| PoolKeys::default()).collect();
        Model { shape, ranks, pools, cursor: 0 }
    }

    /// The next stored event (round-robin over ranks, interleaving pools) and the removal it
    /// forces, applied to the model.
    pub fn step(&mut self, rng: &mut impl Rng) -> Step {
        // Interleave pools: visit rank streams pool-by-pool in turn.
        let per_pool = self.ranks.len() / self.shape.pools;
        let turn = self.cursor;
        self.cursor = (self.cursor + 1) % self.ranks.len();
        let index = (turn % self.shape.pools) * per_pool + turn / self.shape.pools;
        let shape = self.shape;
        let stream = &mut self.ranks[index];
        let keys = &mut self.pools[stream.pool];

        let chain = stream.last_stored.filter(|_| unit(rng) < shape.chain_share);
        let mut parent_key = chain.map(|(_, key)| key);
        let mut blocks = Vec::with_capacity(shape.blocks_per_event);
        for _ in 0..shape.blocks_per_event {
            let tokens_hash = LocalBlockHash(rng.next_u64());
            let key = match parent_key {
                None => SequenceHash::root(tokens_hash),
                Some(parent) => parent.child(tokens_hash),
            };
            let block_hash = ExternalBlockHash(stream.next_block);
            stream.next_block += 1;
            blocks.push(StoredBlock { block_hash, tokens_hash });
            stream.live.push_back((block_hash, key));
            keys.add(key.0);
            parent_key = Some(key);
        }
        stream.last_stored = stream.live.back().copied();
        let mut events = vec![RouterEvent {
            worker_id: stream.worker_id,
            storage_tier: StorageTier::Device,
            residency_domain: None,
            event: KvCacheEvent {
                event_id: stream.next_event_id,
                dp_rank: stream.dp_rank,
                data: KvCacheEventData::Stored(StoreData {
                    parent_hash: chain.map(|(external, _)| external),
                    start_position: None,
                    blocks,
                }),
            },
        }];
        stream.next_event_id += 1;

        let excess = stream.live.len().saturating_sub(shape.live_cap);
        if excess > 0 {
            let mut removed = Vec::with_capacity(excess);
            for (external, key) in stream.live.drain(..excess) {
                removed.push(external);
                keys.drop_owner(key.0, shape.removed_keep_max);
            }
            events.push(RouterEvent {
                worker_id: stream.worker_id,
                storage_tier: StorageTier::Device,
                residency_domain: None,
                event: KvCacheEvent {
                    event_id: stream.next_event_id,
                    dp_rank: stream.dp_rank,
                    data: KvCacheEventData::Removed(RemoveData { block_hashes: removed }),
                },
            });
            stream.next_event_id += 1;
        }
        Step { rank: index, events, stored_blocks: shape.blocks_per_event, removed_blocks: excess }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::rng::rng_from_seed;

    fn shape(chain_share: f64) -> Shape {
        Shape {
            pools: 2,
            workers_per_pool: 2,
            ranks: 2,
            blocks_per_event: 3,
            chain_share,
            live_cap: 7,
            removed_keep_max: 1_000_000,
        }
    }

    #[test]
    fn live_sets_stay_at_the_cap_and_removals_are_oldest_first() {
        let mut rng = rng_from_seed(1);
        let mut model = Model::new(shape(0.5), &mut rng);
        for _ in 0..400 {
            model.step(&mut rng);
        }
        for stream in &model.ranks {
            assert_eq!(stream.live_blocks(), 7);
            assert_eq!(stream.next_block, 1 + 50 * 3);
        }
        for pool in &model.pools {
            assert_eq!(pool.live_sorted().len(), 4 * 7);
            assert_eq!(pool.removals, 4 * (150 - 7));
        }
    }

    #[test]
    fn chained_stores_name_the_previous_last_block_and_chain_its_key() {
        let mut rng = rng_from_seed(2);
        let mut model = Model::new(shape(1.0), &mut rng);
        let first = model.step(&mut rng);
        let stride = model.ranks.len();
        for _ in 1..stride {
            model.step(&mut rng);
        }
        let second = model.step(&mut rng);
        assert_eq!(first.rank, second.rank);
        let KvCacheEventData::Stored(store) = &second.events[0].event.data else {
            panic!("a store");
        };
        assert_eq!(store.parent_hash, Some(ExternalBlockHash(3)));
        assert_eq!(second.events[0].event.event_id, 2);
    }

    #[test]
    fn the_same_seed_gives_the_same_stream() {
        let run = |seed| {
            let mut rng = rng_from_seed(seed);
            let mut model = Model::new(shape(0.3), &mut rng);
            for _ in 0..100 {
                model.step(&mut rng);
            }
            model.pools.iter().map(PoolKeys::live_sorted).collect::<Vec<_>>()
        };
        assert_eq!(run(9), run(9));
        assert_ne!(run(9), run(10));
    }

    #[test]
    fn removed_keys_are_sampled_down_to_the_bound() {
        let mut rng = rng_from_seed(3);
        let mut model = Model::new(Shape { removed_keep_max: 50, ..shape(0.0) }, &mut rng);
        for _ in 0..2_000 {
            model.step(&mut rng);
        }
        let pool = &model.pools[0];
        assert!(pool.removed_sorted().len() <= 50);
        assert!(pool.removed_shift() > 0);
        assert!(pool.removals > 1_000);
    }
}
