//! Pool counters summed over a node's pools (the operations surface's pool gauges).

use kvrelay_core::pool::{OwnershipCounters, PoolStats};

/// Sums of [`PoolStats`] over several pools (the operations surface's pool gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolTotals {
    /// Pools that answered.
    pub pools: u64,
    /// Distinct owned canonical hashes.
    pub owned_blocks: u64,
    /// Occupied filter slots.
    pub resident_blocks: u64,
    /// Bytes the pools' exact ownership states allocate.
    pub exact_state_bytes: u64,
    /// The pools' exact-state byte budgets, summed.
    pub exact_state_bytes_max: u64,
    /// The least room left under its budget of any pool (`None` without a pool): 0 means a
    /// pool is refusing growth.
    pub exact_state_headroom_bytes_min: Option<u64>,
    /// Ownership counters, summed.
    pub counters: OwnershipCounters,
}

impl PoolTotals {
    /// Add one pool's reading.
    pub fn add(&mut self, stats: &PoolStats) {
        let counters = &mut self.counters;
        self.pools += 1;
        self.owned_blocks += stats.owned_blocks as u64;
        self.resident_blocks += stats.resident_blocks;
        self.exact_state_bytes += stats.exact_state_bytes as u64;
        self.exact_state_bytes_max += stats.exact_state_bytes_max as u64;
        let headroom = stats.exact_state_bytes_max.saturating_sub(stats.exact_state_bytes) as u64;
        self.exact_state_headroom_bytes_min =
            Some(self.exact_state_headroom_bytes_min.map_or(headroom, |min| min.min(headroom)));
        counters.events_applied += stats.counters.events_applied;
        counters.events_ignored += stats.counters.events_ignored;
        counters.events_rejected += stats.counters.events_rejected;
        counters.capacity_omissions += stats.counters.capacity_omissions;
        counters.unknown_removals += stats.counters.unknown_removals;
        counters.budget_refusals += stats.counters.budget_refusals;
    }
}
