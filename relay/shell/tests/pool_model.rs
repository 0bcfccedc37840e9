//! Property tests of the pool ownership state against a naive model.
//!
//! Random interleavings of stores, removals, clears, rank replacements, publications and barrier
//! snapshots over several sources and a deliberately small filter. After every step:
//! - the pool accepts exactly the events the model accepts;
//! - owner counts equal the model's mapping counts, and every owned hash is in the filter unless
//!   it is recorded as a capacity omission (`check_invariants`);
//! - a mirror built from the last snapshot plus every published delta equals the live words,
//!   and every delta and snapshot round-trips through CBI1.
//!
//! At the end, clearing every source leaves every word zero.

use std::collections::BTreeMap;

use kvrelay_core::filter::cbi1;
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash, SequenceHash};
use kvrelay_core::model::identity::LaneLease;
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, SourceKey, StorageTier, StoreData,
    StoredBlock,
};
use kvrelay_core::pool::{Delta, PoolOwnership, Publisher, RankReplacement};
use kvrelay_core::rng::rng_from_seed;
use proptest::prelude::*;

const SOURCES: [SourceKey; 4] = [
    SourceKey { worker_id: 1, dp_rank: 0 },
    SourceKey { worker_id: 1, dp_rank: 1 },
    SourceKey { worker_id: 2, dp_rank: 0 },
    SourceKey { worker_id: 3, dp_rank: 0 },
];
const DC_ID: u64 = 0x04f1_10c9_8b1b_fc48;

#[derive(Debug, Clone)]
struct Store {
    parent: Option<u64>,
    blocks: Vec<(u64, u64)>,
}

#[derive(Debug, Clone)]
enum Op {
    Store(usize, Store),
    Remove(usize, Vec<u64>),
    Clear(usize),
    Replace(Vec<(usize, Vec<Store>)>),
    Publish,
    Snapshot,
}

fn store_strategy() -> impl Strategy<Value = Store> {
    (prop::option::weighted(0.4, 0u64..24), prop::collection::vec((0u64..24, 0u64..12), 0..5))
        .prop_map(|(parent, blocks)| Store { parent, blocks })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..SOURCES.len(), store_strategy()).prop_map(|(s, store)| Op::Store(s, store)),
        4 => (0..SOURCES.len(), prop::collection::vec(0u64..24, 1..4))
            .prop_map(|(s, externals)| Op::Remove(s, externals)),
        1 => (0..SOURCES.len()).prop_map(Op::Clear),
        1 => prop::collection::vec(
                (0..SOURCES.len(), prop::collection::vec(store_strategy(), 0..4)), 1..3)
            .prop_map(Op::Replace),
        2 => Just(Op::Publish),
        1 => Just(Op::Snapshot),
    ]
}

fn router_event(source: SourceKey, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: source.worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id: 1, dp_rank: source.dp_rank, data },
    }
}

fn store_event(source: SourceKey, store: &Store) -> RouterEvent {
    router_event(
        source,
        KvCacheEventData::Stored(StoreData {
            parent_hash: store.parent.map(ExternalBlockHash),
            start_position: None,
            blocks: store
                .blocks
                .iter()
                .map(|&(external, tokens)| StoredBlock {
                    block_hash: ExternalBlockHash(external),
                    tokens_hash: LocalBlockHash(tokens),
                })
                .collect(),
        }),
    )
}

/// The naive model: per source, engine id → canonical hash.
type Lineage = BTreeMap<u64, u64>;

/// Apply a store to a lineage the obvious way; `false` (and no change) when it must be rejected.
fn model_store(lineage: &mut Lineage, store: &Store) -> bool {
    if store.blocks.is_empty() {
        return true;
    }
    let mut previous = match store.parent {
        Some(parent) => match lineage.get(&parent) {
            Some(&canonical) => Some(SequenceHash(canonical)),
            None => return false,
        },
        None => None,
    };
    let mut staged = lineage.clone();
    for &(external, tokens) in &store.blocks {
        let canonical = match previous {
            None => SequenceHash::root(LocalBlockHash(tokens)),
            Some(parent) => parent.child(LocalBlockHash(tokens)),
        };
        previous = Some(canonical);
        match staged.get(&external) {
            Some(&mapped) if mapped != canonical.0 => return false,
            Some(_) => {}
            None => {
                staged.insert(external, canonical.0);
            }
        }
    }
    *lineage = staged;
    true
}

fn model_counts(model: &BTreeMap<usize, Lineage>) -> BTreeMap<u64, u32> {
    let mut counts = BTreeMap::new();
    for lineage in model.values() {
        for &canonical in lineage.values() {
            *counts.entry(canonical).or_default() += 1;
        }
    }
    counts
}

struct Harness {
    pool: PoolOwnership,
    publisher: Publisher,
    format: CkfFormat,
    mirror: Vec<u64>,
    lease_epoch: u64,
}

impl Harness {
    fn lease(&self) -> LaneLease {
        LaneLease { consumer_instance: 9, physical_lane: 0, assignment_epoch: self.lease_epoch }
    }

    /// Apply a delta to the mirror after a CBI1 round trip.
    fn receive(mirror: &mut [u64], format: &CkfFormat, delta: &Delta) {
        let encoder = cbi1::FrameEncoder::new(*format, DC_ID).expect("valid format");
        let frame = encoder
            .encode_delta(delta.base_sequence, delta.sequence, &delta.images)
            .expect("delta encodes");
        let decoded = cbi1::decode_for_pool(&frame, format, DC_ID).expect("delta decodes");
        assert_eq!(decoded.header().epoch, delta.sequence);
        let cbi1::Frame::Delta(body) = decoded else { panic!("not a delta") };
        assert_eq!(body.base_epoch(), delta.base_sequence);
        let images: Vec<_> = body.images().collect();
        assert_eq!(images, delta.images);
        for image in images {
            mirror[image.bucket as usize] = image.word;
        }
    }

    fn publish(&mut self) {
        let mut deltas = Vec::new();
        let _ = self.publisher.publish(&mut self.pool, &mut |d| {
            deltas.push(d);
            Ok(())
        });
        for delta in &deltas {
            Self::receive(&mut self.mirror, &self.format, delta);
        }
    }

    fn snapshot(&mut self) {
        self.lease_epoch += 1;
        let lease = self.lease();
        let mut deltas = Vec::new();
        let snapshot = self
            .publisher
            .snapshot_after_barrier(&mut self.pool, lease, &mut |d| {
                deltas.push(d);
                Ok(())
            })
            .expect("snapshot");
        for delta in &deltas {
            Self::receive(&mut self.mirror, &self.format, delta);
        }
        assert_eq!(self.mirror, snapshot.words, "tail deltas bring the old mirror to the cut");
        let encoder = cbi1::FrameEncoder::new(self.format, DC_ID).expect("valid format");
        let mut assembler = cbi1::SnapshotAssembler::new();
        let mut assembled = None;
        for chunk in encoder.encode_snapshot(snapshot.sequence, &snapshot.words).expect("encodes") {
            let decoded = cbi1::decode_for_pool(&chunk, &self.format, DC_ID).expect("decodes");
            let cbi1::Frame::SnapshotChunk(chunk) = decoded else { panic!("not a chunk") };
            assembled = assembler.accept(&chunk).expect("chunk assembles");
        }
        let assembled = assembled.expect("snapshot complete");
        assert_eq!(assembled.epoch(), snapshot.sequence);
        assert_eq!(assembled.words(), &snapshot.words[..]);
        self.mirror = assembled.into_words();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_the_naive_model(
        ops in prop::collection::vec(op_strategy(), 1..80),
        seed in any::<u64>(),
        bucket_count in prop::sample::select(vec![2u64, 4, 8, 64]),
    ) {
        // Two to eight buckets (8 to 32 slots) are small enough that capacity omissions happen.
        let format = CkfFormat::v1(DEFAULT_SEED, bucket_count);
        let mut h = Harness {
            pool: PoolOwnership::new(format, 32, rng_from_seed(seed)).unwrap(),
            publisher: Publisher::new(),
            format,
            mirror: vec![0; bucket_count as usize],
            lease_epoch: 0,
        };
        h.snapshot();
        let mut model: BTreeMap<usize, Lineage> = BTreeMap::new();
        for op in &ops {
            match op {
                Op::Store(s, store) => {
                    let mut lineage = model.get(s).cloned().unwrap_or_default();
                    let accepted = model_store(&mut lineage, store);
                    let result = h.pool.apply_event(&store_event(SOURCES[*s], store));
                    prop_assert_eq!(result.is_ok(), accepted, "store {:?}: {:?}", store, result);
                    if accepted {
                        model.insert(*s, lineage);
                    }
                }
                Op::Remove(s, externals) => {
                    let data = KvCacheEventData::Removed(RemoveData {
                        block_hashes: externals.iter().map(|&e| ExternalBlockHash(e)).collect(),
                    });
                    let outcome = h.pool.apply_event(&router_event(SOURCES[*s], data)).unwrap();
                    let lineage = model.entry(*s).or_default();
                    let unknown = externals.iter().filter(|e| lineage.remove(e).is_none()).count();
                    prop_assert_eq!(outcome.unknown_removals as usize, unknown);
                }
                Op::Clear(s) => {
                    h.pool.apply_event(&router_event(SOURCES[*s], KvCacheEventData::Cleared)).unwrap();
                    model.remove(s);
                }
                Op::Replace(ranks) => {
                    let mut replacements = BTreeMap::new();
                    let mut rebuilt = BTreeMap::new();
                    for (s, dump) in ranks {
                        let mut replacement = RankReplacement::new(h.pool.table_key());
                        let mut lineage = Lineage::new();
                        for store in dump {
                            let accepted = model_store(&mut lineage, store);
                            let pushed = replacement.push_event(&store_event(SOURCES[*s], store));
                            prop_assert_eq!(pushed.is_ok(), accepted);
                        }
                        replacements.insert(SOURCES[*s], replacement);
                        rebuilt.insert(*s, lineage);
                    }
                    h.pool.replace_ranks(replacements).unwrap();
                    model.extend(rebuilt);
                }
                Op::Publish => h.publish(),
                Op::Snapshot => h.snapshot(),
            }
            h.pool.check_invariants().map_err(TestCaseError::fail)?;
            let counts: BTreeMap<u64, u32> = h
                .pool
                .owned_blocks()
                .into_iter()
                .map(|(canonical, state)| (canonical.0, state.owners))
                .collect();
            prop_assert_eq!(&counts, &model_counts(&model));
        }
        h.publish();
        prop_assert_eq!(&h.mirror[..], h.pool.filter().words());
        for source in SOURCES {
            h.pool.apply_event(&router_event(source, KvCacheEventData::Cleared)).unwrap();
        }
        prop_assert!(h.pool.filter().words().iter().all(|&word| word == 0));
        prop_assert_eq!(h.pool.owned_block_count(), 0);
        prop_assert_eq!(h.pool.omitted_block_count(), 0);
        h.publish();
        prop_assert!(h.mirror.iter().all(|&word| word == 0));
    }
}
