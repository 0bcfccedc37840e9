//! Bytes of exact ownership state per resident block, for one and for four owners per block.
//!
//! Run: `cargo run --release -p kvrelay-benches --bin footprint`.

use kvrelay_benches::SplitMix64;
use kvrelay_core::filter::ckf::{CkfFormat, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::pool::PoolOwnership;
use kvrelay_core::rng::rng_from_seed;

/// Store `blocks` distinct root blocks, each owned by `owners` workers.
fn footprint(blocks: usize, owners: u64) -> (usize, usize) {
    let format = CkfFormat::for_expected_blocks(blocks as u64).expect("sizing");
    let mut pool = PoolOwnership::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).expect("pool");
    let mut rng = SplitMix64::new(11);
    let tokens: Vec<u64> = (0..blocks).map(|_| rng.next_u64()).collect();
    for worker_id in 1..=owners {
        for chunk in tokens.chunks(64) {
            let blocks = chunk
                .iter()
                .map(|&t| StoredBlock {
                    block_hash: ExternalBlockHash(t ^ worker_id),
                    tokens_hash: LocalBlockHash(t),
                })
                .collect();
            let event = RouterEvent {
                worker_id,
                storage_tier: StorageTier::Device,
                residency_domain: None,
                event: KvCacheEvent {
                    event_id: 1,
                    dp_rank: 0,
                    data: KvCacheEventData::Stored(StoreData {
                        parent_hash: None,
                        start_position: None,
                        blocks,
                    }),
                },
            };
            let _ = pool.apply_event(&event);
        }
    }
    (pool.exact_state_bytes(), pool.owned_block_count())
}

fn main() {
    println!("{:>10} {:>7} {:>14} {:>12}", "blocks", "owners", "exact bytes", "B/block");
    for blocks in [100_000usize, 500_000, 1 << 20, 2_000_000] {
        for owners in [1u64, 4] {
            let (bytes, resident) = footprint(blocks, owners);
            println!(
                "{blocks:>10} {owners:>7} {bytes:>14} {:>12.1}",
                bytes as f64 / resident as f64
            );
        }
    }
}
