//! Pool KV occupancy with honest rank coverage (relay-facts §11, dc-inputs §6), sans-IO.
//!
//! Each materialized pool keeps one [`PoolLoadState`]. Its *expected ranks* come from the
//! runtime configs of the pool's workers (`[start, start + size)` per worker); workers report
//! occupancy per rank on the endpoint's `kv_metrics` subject, and the state keeps the latest
//! `kv_used_blocks` of every expected rank. A [`PoolLoadSnapshot`] sums those values only when
//! the coverage is complete, because neither incomplete coverage nor unknown capacity may ever
//! read as low load. [`LoadWindows`] numbers the periodic windows that carry every pool's
//! snapshot to WAN subscribers.
//!
//! Invariants kept here:
//! - the observed ranks and the ranks with known capacity are subsets of the expected ranks;
//! - a rank's capacity is either unknown or a nonzero block count (`0` is the "unknown" sentinel
//!   of vLLM's Ray DP backend and is normalized to unknown on entry);
//! - a capacity update is validated completely before anything changes: it either replaces the
//!   expected ranks or leaves the state untouched;
//! - only worker reports (`kv_used_blocks` present) count as observations: router scheduler
//!   reports carry no publisher identity and are advisory;
//! - sums saturate at `u64::MAX` instead of wrapping, and that saturated value is what crosses the
//!   wire;
//! - the latest value is kept per rank without a timestamp: full coverage does not prove
//!   freshness.
//!
//! Nothing here reads a clock: the window publisher hands in `observed_ms`.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use serde::Serialize;
use thiserror::Error;

use crate::inputs::{LoadObservation, RuntimeConfig};
use crate::model::kv_events::SourceKey;

/// Largest `data_parallel_size` a worker may declare; larger (or zero) sizes reject the update.
pub const DATA_PARALLEL_SIZE_MAX: u32 = 4096;

/// Largest number of expected ranks in one pool: the wire counts ranks in a `uint32`.
pub const POOL_RANKS_MAX: u64 = u32::MAX as u64;

/// Why a capacity update was rejected. A rejected update changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum CapacityError {
    /// A worker declared a DP size outside `1..=DATA_PARALLEL_SIZE_MAX`.
    #[error(
        "worker {worker_id:#x} declares data_parallel_size {data_parallel_size}, \
         outside 1..={DATA_PARALLEL_SIZE_MAX}"
    )]
    DataParallelSizeOutOfRange {
        /// The worker.
        worker_id: u64,
        /// Its declared size.
        data_parallel_size: u32,
    },
    /// A worker's rank range does not fit in a `u32` rank number.
    #[error(
        "worker {worker_id:#x} declares ranks {data_parallel_start_rank}..+{data_parallel_size}, \
         beyond the u32 rank space"
    )]
    RankRangeOverflow {
        /// The worker.
        worker_id: u64,
        /// Its first rank.
        data_parallel_start_rank: u32,
        /// Its declared size.
        data_parallel_size: u32,
    },
    /// The same worker appeared twice in one update.
    #[error("worker {worker_id:#x} appears more than once in the capacity update")]
    DuplicateWorker {
        /// The worker.
        worker_id: u64,
    },
    /// The pool would expect more ranks than the wire can count.
    #[error("the pool would expect {expected_ranks} ranks, more than {POOL_RANKS_MAX}")]
    TooManyRanks {
        /// The total the update declared.
        expected_ranks: u64,
    },
}

/// What an accepted capacity update did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[must_use]
pub struct CapacityUpdate {
    /// Expected ranks after the update.
    pub expected_ranks: u32,
    /// Observations carried over (rank still expected, capacity unchanged).
    pub observations_kept: u32,
    /// Observations discarded (rank departed or its capacity changed).
    pub observations_dropped: u32,
}

/// What became of one load report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[must_use]
pub enum ObserveOutcome {
    /// The rank's latest `kv_used_blocks` is now the reported value.
    Recorded,
    /// The report carried no `kv_used_blocks` (a router scheduler report): accepted, ignored.
    Advisory,
    /// The rank is not expected in this pool: ignored.
    UnknownRank,
}

/// One expected rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RankLoad {
    /// Blocks of KV capacity; `None` when unknown (absent or the `0` sentinel).
    capacity_blocks: Option<NonZeroU64>,
    /// Latest reported occupied blocks; `None` until the rank reports.
    used_blocks: Option<u64>,
}

/// A validated worker rank range, before any state changes.
struct WorkerRanks {
    worker_id: u64,
    start_rank: u32,
    /// Inclusive; `start_rank <= last_rank` and `last_rank - start_rank < DATA_PARALLEL_SIZE_MAX`.
    last_rank: u32,
    capacity_blocks: Option<NonZeroU64>,
}

/// The KV load of one pool: expected ranks, their capacity and their latest occupancy.
///
/// A new (or [`cleared`](Self::clear)) state expects no rank: its snapshot is degraded with every
/// value unset, which is also the state an invalid capacity yields at attach.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolLoadState {
    ranks: BTreeMap<SourceKey, RankLoad>,
}

impl PoolLoadState {
    /// The empty, degraded state: no expected rank.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The state of a pool being attached (materialized).
    ///
    /// An invalid capacity must not block materialization: the pool then starts from the empty
    /// (degraded) state and the rejection is returned for the caller to report.
    #[must_use]
    pub fn attach<'a>(
        workers: impl IntoIterator<Item = (u64, &'a RuntimeConfig)>,
    ) -> (Self, Option<CapacityError>) {
        let mut state = Self::new();
        match state.set_capacity(workers) {
            Ok(_) => (state, None),
            Err(error) => (Self::new(), Some(error)),
        }
    }

    /// Replace the expected ranks from the runtime config of every worker of the pool.
    ///
    /// Each worker `w` contributes ranks `(w, start)..(w, start + size)` with the per-rank
    /// capacity `total_kv_blocks` (absent or `0` = unknown). Adapter cards carry no capacity and
    /// must not be passed here; the caller hands in one base runtime config per worker.
    ///
    /// The whole update is validated first; on error nothing changes. On success an observation
    /// survives only if its rank is still expected with the same capacity.
    pub fn set_capacity<'a>(
        &mut self,
        workers: impl IntoIterator<Item = (u64, &'a RuntimeConfig)>,
    ) -> Result<CapacityUpdate, CapacityError> {
        let validated = validate_workers(workers, POOL_RANKS_MAX)?;

        let mut ranks = BTreeMap::new();
        let mut observations_kept: u32 = 0;
        for worker in &validated {
            for dp_rank in worker.start_rank..=worker.last_rank {
                let key = SourceKey { worker_id: worker.worker_id, dp_rank };
                let used_blocks = match self.ranks.get(&key) {
                    Some(old) if old.capacity_blocks == worker.capacity_blocks => old.used_blocks,
                    _ => None,
                };
                if used_blocks.is_some() {
                    observations_kept = observations_kept.saturating_add(1);
                }
                ranks
                    .insert(key, RankLoad { capacity_blocks: worker.capacity_blocks, used_blocks });
            }
        }

        let observed_before = count_u32(self.ranks.values().filter(|r| r.used_blocks.is_some()));
        debug_assert!(observations_kept <= observed_before);
        self.ranks = ranks;
        Ok(CapacityUpdate {
            expected_ranks: count_u32(self.ranks.values()),
            observations_kept,
            observations_dropped: observed_before.saturating_sub(observations_kept),
        })
    }

    /// Drop the expected ranks and every observation: the empty, degraded state. Used when a
    /// capacity refresh fails, so consumers see degraded coverage rather than stale totals.
    pub fn clear(&mut self) {
        self.ranks.clear();
    }

    /// Apply one `kv_metrics` report.
    ///
    /// The rank is checked first: a report for a rank this pool does not expect is ignored
    /// whatever it carries. A report without `kv_used_blocks` is advisory and changes nothing.
    pub fn observe(&mut self, observation: &LoadObservation) -> ObserveOutcome {
        let Some(rank) = self.ranks.get_mut(&observation.source) else {
            return ObserveOutcome::UnknownRank;
        };
        match observation.kv_used_blocks {
            None => ObserveOutcome::Advisory,
            Some(used_blocks) => {
                rank.used_blocks = Some(used_blocks);
                ObserveOutcome::Recorded
            }
        }
    }

    /// Forget every observation but keep the expected ranks and their capacity. Called when the
    /// pool's `kv_metrics` stream errors or closes: after a gap, old values prove nothing.
    pub fn clear_observations(&mut self) {
        for rank in self.ranks.values_mut() {
            rank.used_blocks = None;
        }
    }

    /// Whether `source` is one of the expected ranks.
    #[must_use]
    pub fn expects(&self, source: SourceKey) -> bool {
        self.ranks.contains_key(&source)
    }

    /// The expected ranks, in order.
    pub fn expected_ranks(&self) -> impl Iterator<Item = SourceKey> + '_ {
        self.ranks.keys().copied()
    }

    /// The pool's load as published: coverage counts and the sums that coverage allows.
    #[must_use]
    pub fn snapshot(&self) -> PoolLoadSnapshot {
        let mut capacity_ranks: u32 = 0;
        let mut observed_ranks: u32 = 0;
        let mut used_sum: u64 = 0;
        let mut capacity_sum: u64 = 0;
        for rank in self.ranks.values() {
            if let Some(capacity) = rank.capacity_blocks {
                capacity_ranks = capacity_ranks.saturating_add(1);
                capacity_sum = capacity_sum.saturating_add(capacity.get());
            }
            if let Some(used) = rank.used_blocks {
                observed_ranks = observed_ranks.saturating_add(1);
                used_sum = used_sum.saturating_add(used);
            }
        }
        let expected_ranks = count_u32(self.ranks.values());
        let complete = |covered: u32| expected_ranks > 0 && covered == expected_ranks;
        let snapshot = PoolLoadSnapshot {
            kv_expected_ranks: expected_ranks,
            kv_capacity_ranks: capacity_ranks,
            kv_observed_ranks: observed_ranks,
            kv_used_blocks: complete(observed_ranks).then_some(used_sum),
            total_kv_blocks: complete(capacity_ranks).then_some(capacity_sum),
            degraded: !(complete(observed_ranks) && complete(capacity_ranks)),
        };
        debug_assert!(snapshot.kv_observed_ranks <= snapshot.kv_expected_ranks);
        debug_assert!(snapshot.kv_capacity_ranks <= snapshot.kv_expected_ranks);
        snapshot
    }
}

/// Validate every worker of a capacity update before any state changes; the pool may expect at
/// most `ranks_max` ranks ([`POOL_RANKS_MAX`] outside tests).
fn validate_workers<'a>(
    workers: impl IntoIterator<Item = (u64, &'a RuntimeConfig)>,
    ranks_max: u64,
) -> Result<Vec<WorkerRanks>, CapacityError> {
    let mut by_worker: BTreeMap<u64, WorkerRanks> = BTreeMap::new();
    let mut expected_ranks: u64 = 0;
    for (worker_id, config) in workers {
        let start_rank = config.data_parallel_start_rank;
        let size = config.data_parallel_size;
        if !(1..=DATA_PARALLEL_SIZE_MAX).contains(&size) {
            return Err(CapacityError::DataParallelSizeOutOfRange {
                worker_id,
                data_parallel_size: size,
            });
        }
        // `size >= 1`, so the last rank is `start + size - 1`.
        let last_rank =
            start_rank.checked_add(size - 1).ok_or(CapacityError::RankRangeOverflow {
                worker_id,
                data_parallel_start_rank: start_rank,
                data_parallel_size: size,
            })?;
        expected_ranks = expected_ranks.saturating_add(u64::from(size));
        if expected_ranks > ranks_max {
            return Err(CapacityError::TooManyRanks { expected_ranks });
        }
        let capacity_blocks = config.total_kv_blocks.and_then(NonZeroU64::new);
        let ranks = WorkerRanks { worker_id, start_rank, last_rank, capacity_blocks };
        if by_worker.insert(worker_id, ranks).is_some() {
            return Err(CapacityError::DuplicateWorker { worker_id });
        }
    }
    Ok(by_worker.into_values().collect())
}

/// Count items into a `u32`, saturating (pools hold at most [`POOL_RANKS_MAX`] ranks).
fn count_u32<T>(items: impl Iterator<Item = T>) -> u32 {
    u32::try_from(items.count()).unwrap_or(u32::MAX)
}

/// One pool's published load.
///
/// Invariants: `kv_observed_ranks <= kv_expected_ranks`, `kv_capacity_ranks <= kv_expected_ranks`;
/// `kv_used_blocks` is set iff `kv_observed_ranks == kv_expected_ranks > 0`; `total_kv_blocks` is
/// set iff `kv_capacity_ranks == kv_expected_ranks > 0`; `degraded` iff either sum is unset. Sums
/// saturate at `u64::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolLoadSnapshot {
    /// Ranks declared by the pool's runtime configs.
    pub kv_expected_ranks: u32,
    /// Expected ranks whose capacity is known and nonzero.
    pub kv_capacity_ranks: u32,
    /// Expected ranks that reported `kv_used_blocks`.
    pub kv_observed_ranks: u32,
    /// Occupied blocks over every expected rank; unset unless every rank reported.
    pub kv_used_blocks: Option<u64>,
    /// Capacity over every expected rank; unset unless every rank's capacity is known.
    pub total_kv_blocks: Option<u64>,
    /// Coverage is incomplete: no expected rank, a rank not reported, or a capacity unknown.
    pub degraded: bool,
}

impl PoolLoadSnapshot {
    /// The numeric fields of the wire `KvPoolLoadEntry` (fields 2–5).
    ///
    /// Unset sums become `0`; consumers must read coverage from
    /// `kv_observed_ranks < kv_expected_ranks` and a `0` total as unknown capacity, never as zero
    /// load. A saturated sum is forwarded as `u64::MAX`.
    #[must_use]
    pub fn to_wire(&self) -> PoolLoadWire {
        PoolLoadWire {
            kv_used_blocks: self.kv_used_blocks.unwrap_or(0),
            total_kv_blocks: self.total_kv_blocks.unwrap_or(0),
            kv_observed_ranks: self.kv_observed_ranks,
            kv_expected_ranks: self.kv_expected_ranks,
        }
    }
}

/// The wire numbers of one `KvPoolLoadEntry`, without the producer identity (field 1), which
/// the publication layer adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PoolLoadWire {
    /// Field 2; `0` when unset.
    pub kv_used_blocks: u64,
    /// Field 3; `0` when unset (unknown capacity).
    pub total_kv_blocks: u64,
    /// Field 4.
    pub kv_observed_ranks: u32,
    /// Field 5.
    pub kv_expected_ranks: u32,
}

/// One pool's entry in a load window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoadWindowEntry<P> {
    /// The pool's key (the producer identity in the relay; anything ordered in tests).
    pub pool: P,
    /// Its load when the window was cut.
    pub load: PoolLoadSnapshot,
}

/// One complete load window: every active pool generation's snapshot at one instant.
///
/// Invariant: `pools` is sorted by key with no key twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoadWindow<P> {
    /// Window number: 0 for the initial window, then strictly increasing by one.
    pub window_sequence: u64,
    /// Wall-clock instant the window was cut, unix ms (handed in by the caller).
    pub observed_ms: u64,
    /// The configured window interval.
    pub window_ms: u64,
    /// The pools, sorted by key.
    pub pools: Vec<LoadWindowEntry<P>>,
}

/// Why a window could not be cut. The current window is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum LoadWindowError {
    /// `window_sequence` reached `u64::MAX`.
    #[error("load window sequence exhausted")]
    SequenceExhausted,
    /// The same pool key appeared twice among the snapshots.
    #[error("a pool appears twice in one load window")]
    DuplicatePool,
}

/// Numbers load windows: the initial current window is `0`, every cut is the previous plus one.
///
/// The caller drives the interval (first tick one window after start; missed ticks delayed) and
/// hands in the wall-clock `observed_ms`; this type never reads a clock and does not require
/// `observed_ms` to increase (a wall clock may step back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadWindows<P> {
    window_ms: u64,
    current: LoadWindow<P>,
}

impl<P: Ord> LoadWindows<P> {
    /// Start with window `0` built from the pools known at start.
    pub fn new(
        window_ms: NonZeroU64,
        observed_ms: u64,
        pools: impl IntoIterator<Item = (P, PoolLoadSnapshot)>,
    ) -> Result<Self, LoadWindowError> {
        let pools = sorted_entries(pools)?;
        let window_ms = window_ms.get();
        Ok(LoadWindows {
            window_ms,
            current: LoadWindow { window_sequence: 0, observed_ms, window_ms, pools },
        })
    }

    /// The window a new subscriber receives immediately.
    #[must_use]
    pub fn current(&self) -> &LoadWindow<P> {
        &self.current
    }

    /// Cut the next window from the pools' current snapshots; it becomes the current window.
    pub fn tick(
        &mut self,
        observed_ms: u64,
        pools: impl IntoIterator<Item = (P, PoolLoadSnapshot)>,
    ) -> Result<&LoadWindow<P>, LoadWindowError> {
        let window_sequence = self
            .current
            .window_sequence
            .checked_add(1)
            .ok_or(LoadWindowError::SequenceExhausted)?;
        let pools = sorted_entries(pools)?;
        self.current =
            LoadWindow { window_sequence, observed_ms, window_ms: self.window_ms, pools };
        Ok(&self.current)
    }
}

/// Sort window entries by key, rejecting a key given twice.
fn sorted_entries<P: Ord>(
    pools: impl IntoIterator<Item = (P, PoolLoadSnapshot)>,
) -> Result<Vec<LoadWindowEntry<P>>, LoadWindowError> {
    let mut by_pool = BTreeMap::new();
    for (pool, load) in pools {
        if by_pool.insert(pool, load).is_some() {
            return Err(LoadWindowError::DuplicatePool);
        }
    }
    Ok(by_pool.into_iter().map(|(pool, load)| LoadWindowEntry { pool, load }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(start: u32, size: u32, total_kv_blocks: Option<u64>) -> RuntimeConfig {
        RuntimeConfig {
            total_kv_blocks,
            data_parallel_start_rank: start,
            data_parallel_size: size,
            ..RuntimeConfig::default()
        }
    }

    fn rank(worker_id: u64, dp_rank: u32) -> SourceKey {
        SourceKey { worker_id, dp_rank }
    }

    fn kv(worker_id: u64, dp_rank: u32, used: u64) -> LoadObservation {
        LoadObservation {
            source: rank(worker_id, dp_rank),
            kv_used_blocks: Some(used),
            active_decode_blocks: None,
            active_prefill_tokens: None,
        }
    }

    fn router(worker_id: u64, dp_rank: u32) -> LoadObservation {
        LoadObservation {
            source: rank(worker_id, dp_rank),
            kv_used_blocks: None,
            active_decode_blocks: Some(40),
            active_prefill_tokens: Some(900),
        }
    }

    /// A pool from `(worker_id, config)` pairs that must be valid.
    fn pool(workers: &[(u64, RuntimeConfig)]) -> PoolLoadState {
        let (state, error) = PoolLoadState::attach(workers.iter().map(|(w, c)| (*w, c)));
        assert_eq!(error, None);
        state
    }

    fn observe_all(state: &mut PoolLoadState, reports: &[LoadObservation]) {
        for report in reports {
            assert_eq!(state.observe(report), ObserveOutcome::Recorded, "{report:?}");
        }
    }

    /// A pool may expect exactly its rank bound; one rank more is refused.
    #[test]
    fn the_rank_bound_is_inclusive() {
        let (two, three) = (config(0, 2, None), config(0, 3, None));
        let at_bound = [(1, &two), (2, &three)];
        assert_eq!(validate_workers(at_bound, 5).map(|ranks| ranks.len()), Ok(2));
        let over = [(1, &three), (2, &three)];
        assert_eq!(
            validate_workers(over, 5).map(|ranks| ranks.len()),
            Err(CapacityError::TooManyRanks { expected_ranks: 6 })
        );
    }

    /// The real bound, [`POOL_RANKS_MAX`], at scale: 2^20 workers of the largest data-parallel
    /// size reach it (one shared config: validation keeps ~40 B a worker). Skipped by the
    /// mutation runs (`.cargo/mutants.toml`) for its cost; the test above covers the comparison.
    #[test]
    fn the_real_rank_bound_admits_exactly_pool_ranks_max() {
        let widest = config(0, DATA_PARALLEL_SIZE_MAX, None);
        let one_short = config(0, DATA_PARALLEL_SIZE_MAX - 1, None);
        let workers = u64::from(u32::MAX / DATA_PARALLEL_SIZE_MAX) + 1; // 2^20
        assert_eq!(workers * u64::from(DATA_PARALLEL_SIZE_MAX), POOL_RANKS_MAX + 1);
        let at_bound = (0..workers).map(|w| (w, if w == 0 { &one_short } else { &widest }));
        let validated = validate_workers(at_bound, POOL_RANKS_MAX);
        assert_eq!(validated.map(|ranks| ranks.len()), Ok(1 << 20));
        let over = (0..workers).map(|w| (w, &widest));
        assert_eq!(
            validate_workers(over, POOL_RANKS_MAX).map(|ranks| ranks.len()),
            Err(CapacityError::TooManyRanks { expected_ranks: POOL_RANKS_MAX + 1 })
        );
    }

    #[test]
    fn kv_only_coverage() {
        let mut state = pool(&[(1, config(0, 2, Some(100)))]);
        observe_all(&mut state, &[kv(1, 0, 10)]);
        // A router report for the other rank carries no occupancy: it covers nothing.
        assert_eq!(state.observe(&router(1, 1)), ObserveOutcome::Advisory);
        let partial = state.snapshot();
        assert_eq!(
            partial,
            PoolLoadSnapshot {
                kv_expected_ranks: 2,
                kv_capacity_ranks: 2,
                kv_observed_ranks: 1,
                kv_used_blocks: None,
                total_kv_blocks: Some(200),
                degraded: true,
            }
        );
        observe_all(&mut state, &[kv(1, 1, 30)]);
        assert_eq!(
            state.snapshot(),
            PoolLoadSnapshot {
                kv_expected_ranks: 2,
                kv_capacity_ranks: 2,
                kv_observed_ranks: 2,
                kv_used_blocks: Some(40),
                total_kv_blocks: Some(200),
                degraded: false,
            }
        );
    }

    #[test]
    fn ray_dp_zero_capacity_is_unknown() {
        let mut state = pool(&[(1, config(0, 2, Some(0))), (2, config(0, 1, Some(50)))]);
        observe_all(&mut state, &[kv(1, 0, 1), kv(1, 1, 2), kv(2, 0, 3)]);
        let snapshot = state.snapshot();
        assert_eq!(snapshot.kv_expected_ranks, 3);
        assert_eq!(snapshot.kv_capacity_ranks, 1);
        assert_eq!(snapshot.kv_observed_ranks, 3);
        assert_eq!(snapshot.kv_used_blocks, Some(6));
        assert_eq!(snapshot.total_kv_blocks, None, "zero capacity must not sum to a total");
        assert!(snapshot.degraded);
        assert_eq!(snapshot.to_wire().total_kv_blocks, 0);

        // An absent capacity is unknown in the same way.
        let absent = pool(&[(1, config(0, 1, None))]).snapshot();
        assert_eq!((absent.kv_capacity_ranks, absent.total_kv_blocks), (0, None));
    }

    #[test]
    fn oversized_dp_rejected() {
        let mut state = pool(&[(1, config(0, 1, Some(10)))]);
        observe_all(&mut state, &[kv(1, 0, 4)]);
        let before = state.clone();

        for size in [0, DATA_PARALLEL_SIZE_MAX + 1, u32::MAX] {
            let bad = config(0, size, Some(10));
            let error = state.set_capacity([(1, &config(0, 1, Some(10))), (2, &bad)]).unwrap_err();
            assert_eq!(
                error,
                CapacityError::DataParallelSizeOutOfRange {
                    worker_id: 2,
                    data_parallel_size: size
                }
            );
            assert_eq!(state, before, "a rejected update leaves the state untouched");
        }

        // The bound itself is accepted.
        let largest = config(0, DATA_PARALLEL_SIZE_MAX, Some(10));
        let update = state.set_capacity([(1, &largest)]).unwrap();
        assert_eq!(update.expected_ranks, DATA_PARALLEL_SIZE_MAX);

        // At attach an invalid capacity yields the empty, degraded state instead of failing.
        let oversized = config(0, DATA_PARALLEL_SIZE_MAX + 1, Some(10));
        let (attached, error) = PoolLoadState::attach([(7, &oversized)]);
        assert!(matches!(error, Some(CapacityError::DataParallelSizeOutOfRange { .. })));
        assert_eq!(attached, PoolLoadState::new());
        let empty = attached.snapshot();
        assert_eq!(empty.kv_expected_ranks, 0);
        assert!(empty.degraded);
        assert_eq!(empty.to_wire(), PoolLoadWire::default());
    }

    #[test]
    fn rank_ranges_beyond_u32_and_duplicate_workers_rejected() {
        let mut state = PoolLoadState::new();
        let overflow = config(u32::MAX, 2, Some(1));
        assert_eq!(
            state.set_capacity([(3, &overflow)]),
            Err(CapacityError::RankRangeOverflow {
                worker_id: 3,
                data_parallel_start_rank: u32::MAX,
                data_parallel_size: 2,
            })
        );
        // The very last rank number is still usable.
        let last = config(u32::MAX, 1, Some(1));
        assert!(state.set_capacity([(3, &last)]).is_ok());
        assert!(state.expects(rank(3, u32::MAX)));

        let one = config(0, 1, Some(1));
        assert_eq!(
            state.set_capacity([(4, &one), (4, &one)]),
            Err(CapacityError::DuplicateWorker { worker_id: 4 })
        );
        assert!(state.expects(rank(3, u32::MAX)), "rejected update changed nothing");
    }

    #[test]
    fn expected_ranks_follow_start_and_size() {
        let state = pool(&[(9, config(4, 3, Some(1))), (2, config(0, 1, Some(1)))]);
        let ranks: Vec<_> = state.expected_ranks().collect();
        assert_eq!(ranks, vec![rank(2, 0), rank(9, 4), rank(9, 5), rank(9, 6)]);
        assert!(state.expects(rank(9, 5)));
        for outside in [rank(9, 3), rank(9, 7), rank(2, 1), rank(5, 0)] {
            assert!(!state.expects(outside), "{outside:?} is not an expected rank");
        }
    }

    #[test]
    fn partial_reports_keep_latest_values() {
        let mut state = pool(&[(1, config(0, 3, Some(100)))]);
        observe_all(&mut state, &[kv(1, 0, 5), kv(1, 1, 6), kv(1, 0, 7)]);
        let partial = state.snapshot();
        assert_eq!(partial.kv_observed_ranks, 2);
        assert_eq!(partial.kv_used_blocks, None, "a partial sum would read as lower load");
        assert_eq!(partial.to_wire().kv_used_blocks, 0);

        observe_all(&mut state, &[kv(1, 2, 8)]);
        assert_eq!(state.snapshot().kv_used_blocks, Some(7 + 6 + 8));
        observe_all(&mut state, &[kv(1, 1, 0)]);
        assert_eq!(state.snapshot().kv_used_blocks, Some(7 + 8), "latest value, even zero");
    }

    #[test]
    fn unknown_ranks_ignored() {
        let mut state = pool(&[(1, config(2, 2, Some(10)))]);
        observe_all(&mut state, &[kv(1, 2, 1), kv(1, 3, 1)]);
        let before = state.snapshot();
        for report in [kv(1, 0, 99), kv(1, 4, 99), kv(2, 2, 99), router(5, 0)] {
            assert_eq!(state.observe(&report), ObserveOutcome::UnknownRank, "{report:?}");
        }
        assert_eq!(state.snapshot(), before);
        assert_eq!(state.observe(&kv(9, 0, 1)), ObserveOutcome::UnknownRank);
        assert_eq!(PoolLoadState::new().observe(&kv(1, 2, 1)), ObserveOutcome::UnknownRank);
    }

    #[test]
    fn disconnect_clears_observations() {
        let mut state = pool(&[(1, config(0, 2, Some(10)))]);
        observe_all(&mut state, &[kv(1, 0, 3), kv(1, 1, 4)]);
        assert!(!state.snapshot().degraded);

        state.clear_observations();
        let cleared = state.snapshot();
        assert_eq!(cleared.kv_observed_ranks, 0);
        assert_eq!(cleared.kv_used_blocks, None);
        assert_eq!(cleared.total_kv_blocks, Some(20), "capacity survives a stream loss");
        assert!(cleared.degraded);

        // A failed capacity refresh clears everything.
        state.clear();
        assert_eq!(state.snapshot().kv_expected_ranks, 0);
        assert!(state.snapshot().degraded);
    }

    #[test]
    fn capacity_change_drops_departed_ranks() {
        let mut state = pool(&[(1, config(0, 2, Some(10))), (2, config(0, 1, Some(10)))]);
        observe_all(&mut state, &[kv(1, 0, 1), kv(1, 1, 2), kv(2, 0, 3)]);

        // Worker 2 leaves, worker 1 shrinks to one rank, worker 3 joins.
        let shrunk = config(0, 1, Some(10));
        let joined = config(0, 1, Some(10));
        let update = state.set_capacity([(1, &shrunk), (3, &joined)]).unwrap();
        assert_eq!(
            update,
            CapacityUpdate { expected_ranks: 2, observations_kept: 1, observations_dropped: 2 }
        );
        assert_eq!(state.observe(&kv(2, 0, 3)), ObserveOutcome::UnknownRank);
        let snapshot = state.snapshot();
        assert_eq!((snapshot.kv_expected_ranks, snapshot.kv_observed_ranks), (2, 1));

        // A rank whose capacity changed loses its observation; an unchanged one keeps it.
        observe_all(&mut state, &[kv(3, 0, 5)]);
        let grown = config(0, 1, Some(20));
        let update = state.set_capacity([(1, &shrunk), (3, &grown)]).unwrap();
        assert_eq!(update.observations_kept, 1);
        assert_eq!(update.observations_dropped, 1);
        let snapshot = state.snapshot();
        assert_eq!(snapshot.kv_observed_ranks, 1);
        assert_eq!(snapshot.total_kv_blocks, Some(30));

        // `0` and absent are the same unknown capacity: switching between them is no change.
        let mut state = pool(&[(1, config(0, 1, Some(0)))]);
        observe_all(&mut state, &[kv(1, 0, 5)]);
        let update = state.set_capacity([(1, &config(0, 1, None))]).unwrap();
        assert_eq!(update.observations_kept, 1);
    }

    #[test]
    fn saturated_sums_forwarded_unchanged() {
        let huge = config(0, 2, Some(u64::MAX));
        let mut state = pool(&[(1, huge)]);
        observe_all(&mut state, &[kv(1, 0, u64::MAX - 1), kv(1, 1, 2)]);
        let snapshot = state.snapshot();
        assert_eq!(snapshot.kv_used_blocks, Some(u64::MAX));
        assert_eq!(snapshot.total_kv_blocks, Some(u64::MAX));
        assert!(!snapshot.degraded);
        assert_eq!(
            snapshot.to_wire(),
            PoolLoadWire {
                kv_used_blocks: u64::MAX,
                total_kv_blocks: u64::MAX,
                kv_observed_ranks: 2,
                kv_expected_ranks: 2,
            }
        );
    }

    #[test]
    fn advisory_reports_ignored() {
        let mut state = pool(&[(1, config(0, 1, Some(10)))]);
        assert_eq!(state.observe(&router(1, 0)), ObserveOutcome::Advisory);
        assert_eq!(state.snapshot().kv_observed_ranks, 0);
        observe_all(&mut state, &[kv(1, 0, 6)]);
        assert_eq!(state.observe(&router(1, 0)), ObserveOutcome::Advisory);
        assert_eq!(state.snapshot().kv_used_blocks, Some(6), "advisory report overwrote a value");
    }

    #[test]
    fn empty_pool_is_degraded_and_reads_as_zero_on_the_wire() {
        let snapshot = PoolLoadState::new().snapshot();
        assert_eq!(
            snapshot,
            PoolLoadSnapshot {
                kv_expected_ranks: 0,
                kv_capacity_ranks: 0,
                kv_observed_ranks: 0,
                kv_used_blocks: None,
                total_kv_blocks: None,
                degraded: true,
            }
        );
        assert_eq!(snapshot.to_wire(), PoolLoadWire::default());
    }

    fn window_ms() -> NonZeroU64 {
        NonZeroU64::new(1_000).unwrap()
    }

    #[test]
    fn window_sequence_starts_at_zero_and_increases_by_one() {
        let load = pool(&[(1, config(0, 1, Some(10)))]).snapshot();
        let mut windows = LoadWindows::new(window_ms(), 5_000, [(7_u64, load)]).unwrap();
        let initial = windows.current();
        assert_eq!(
            (initial.window_sequence, initial.observed_ms, initial.window_ms),
            (0, 5_000, 1_000)
        );
        assert_eq!(initial.pools, vec![LoadWindowEntry { pool: 7, load }]);

        for (expected, observed_ms) in [(1, 6_000), (2, 7_000), (3, 6_500)] {
            let window = windows.tick(observed_ms, [(7, load)]).unwrap();
            assert_eq!(window.window_sequence, expected);
            assert_eq!(window.observed_ms, observed_ms, "observed_ms is the caller's stamp");
            assert_eq!(window.window_ms, 1_000);
        }
        assert_eq!(windows.current().window_sequence, 3);
    }

    #[test]
    fn window_carries_every_pool_sorted_once() {
        let a = pool(&[(1, config(0, 1, Some(10)))]).snapshot();
        let b = PoolLoadState::new().snapshot();
        let mut windows = LoadWindows::new(window_ms(), 0, std::iter::empty()).unwrap();
        assert!(windows.current().pools.is_empty());

        let window = windows.tick(1, [(9_u64, a), (3, b)]).unwrap();
        let keys: Vec<_> = window.pools.iter().map(|entry| entry.pool).collect();
        assert_eq!(keys, vec![3, 9]);

        // A pool that went away is simply absent from the next window.
        assert_eq!(windows.tick(2, [(9, a)]).unwrap().pools.len(), 1);

        assert_eq!(windows.tick(3, [(9, a), (9, b)]), Err(LoadWindowError::DuplicatePool));
        assert_eq!(windows.current().window_sequence, 2, "a failed cut changes nothing");
    }

    #[test]
    fn window_sequence_exhaustion_is_an_error() {
        let mut windows = LoadWindows::<u64>::new(window_ms(), 0, std::iter::empty()).unwrap();
        windows.current.window_sequence = u64::MAX - 1;
        assert_eq!(windows.tick(1, std::iter::empty()).unwrap().window_sequence, u64::MAX);
        assert_eq!(windows.tick(2, std::iter::empty()), Err(LoadWindowError::SequenceExhausted));
        assert_eq!(windows.current().observed_ms, 1);
    }
}
