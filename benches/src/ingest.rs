//! A steady-state KV event workload for ingest benchmarks.
//!
//! Store events carry [`BLOCKS_PER_STORE`] blocks; half of them extend a live chain through
//! `parent_hash`, half start a new chain. Once the live set reaches its target, every store is
//! followed by removals of whole old chains, so the live set stays constant. Everything is
//! generated up front from a seed, so the timed loop only applies events.

use std::collections::VecDeque;

use crate::SplitMix64;
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, SourceKey, StorageTier, StoreData,
    StoredBlock,
};

/// Blocks per stored event.
pub const BLOCKS_PER_STORE: usize = 4;

/// A pre-generated event stream.
#[derive(Debug, Clone)]
pub struct IngestWorkload {
    /// Events that bring the pool to its steady live set.
    pub warmup: Vec<RouterEvent>,
    /// Steady-state events: stores interleaved with removals.
    pub steady: Vec<RouterEvent>,
    /// Blocks stored by `steady`.
    pub steady_stored_blocks: u64,
}

fn event(source: SourceKey, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: source.worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: source.dp_rank, data },
    }
}

/// Generate a workload over `sources` ranks with `live_blocks` blocks alive in steady state and
/// `steady_stores` store events after warm-up.
#[must_use]
pub fn generate(
    seed: u64,
    sources: u32,
    live_blocks: usize,
    steady_stores: usize,
) -> IngestWorkload {
    let mut rng = SplitMix64::new(seed);
    let ranks: Vec<SourceKey> =
        (0..sources).map(|w| SourceKey { worker_id: u64::from(w) + 1, dp_rank: 0 }).collect();
    // Live chains per rank: each chain is its engine block ids, oldest chain first.
    let mut chains: Vec<VecDeque<Vec<u64>>> = vec![VecDeque::new(); ranks.len()];
    let mut live = 0usize;
    let mut next_event_id = vec![1u64; ranks.len()];
    let mut warmup = Vec::new();
    let mut steady = Vec::new();
    let mut steady_stored_blocks = 0u64;
    let mut stores_done = 0usize;
    // Once the live set first exceeds its target every later event is steady, even when a
    // removal took the live set below the target again: warm-up must be a prefix in time, or
    // applying warm-up then steady would reorder stores before their parents.
    let mut in_steady = false;
    while stores_done < steady_stores {
        let rank = rng.below(ranks.len());
        let source = ranks[rank];
        let extend = rng.next_u64() & 1 == 0 && !chains[rank].is_empty();
        let blocks: Vec<StoredBlock> = (0..BLOCKS_PER_STORE)
            .map(|_| StoredBlock {
                block_hash: ExternalBlockHash(rng.next_u64()),
                tokens_hash: LocalBlockHash(rng.next_u64()),
            })
            .collect();
        let ids: Vec<u64> = blocks.iter().map(|b| b.block_hash.0).collect();
        let parent_hash = if extend {
            let pick = rng.below(chains[rank].len());
            let chain = &mut chains[rank][pick];
            let parent = *chain.last().expect("chains are never empty");
            chain.extend_from_slice(&ids);
            Some(ExternalBlockHash(parent))
        } else {
            chains[rank].push_back(ids);
            None
        };
        live += BLOCKS_PER_STORE;
        let store =
            KvCacheEventData::Stored(StoreData { parent_hash, start_position: None, blocks });
        in_steady |= live > live_blocks;
        let out = if in_steady { &mut steady } else { &mut warmup };
        out.push(event(source, next_event_id[rank], store));
        next_event_id[rank] += 1;
        if in_steady {
            steady_stored_blocks += BLOCKS_PER_STORE as u64;
            stores_done += 1;
            while live > live_blocks {
                let victim = rng.below(ranks.len());
                let Some(chain) = chains[victim].pop_front() else { continue };
                live -= chain.len();
                let block_hashes = chain.into_iter().map(ExternalBlockHash).collect();
                let remove = KvCacheEventData::Removed(RemoveData { block_hashes });
                steady.push(event(ranks[victim], next_event_id[victim], remove));
                next_event_id[victim] += 1;
            }
        }
    }
    IngestWorkload { warmup, steady, steady_stored_blocks }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::filter::ckf::{CkfFormat, MAX_KICKS_DEFAULT};
    use kvrelay_core::pool::PoolOwnership;
    use kvrelay_core::rng::rng_from_seed;

    #[test]
    fn warmup_then_steady_applies_without_a_refused_event() {
        let workload = generate(7, 8, 4096, 4096);
        let format = CkfFormat::for_expected_blocks(4096).unwrap();
        let mut pool = PoolOwnership::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).unwrap();
        for event in workload.warmup.iter().chain(&workload.steady) {
            pool.apply_event(event).unwrap();
        }
        assert_eq!(workload.steady_stored_blocks, 4096 * BLOCKS_PER_STORE as u64);
    }
}
