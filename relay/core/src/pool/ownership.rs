//! Exact block ownership of one pool and the filter it drives (relay-facts §4.4).
//!
//! Per source `(worker_id, dp_rank)`, a lineage maps the engine's block ids to canonical sequence
//! hashes; across sources, an owner table counts mappings per canonical hash and records whether
//! its fingerprint is in the filter. Invariants, checked by [`PoolOwnership::check_invariants`]:
//!
//! - every canonical hash's owner count equals the number of lineage mappings to it;
//! - a canonical hash is resident iff it has exactly one fingerprint in the filter on its behalf,
//!   so a resident hash is always found by the filter;
//! - an owned hash that is not resident was a capacity omission and is counted as one;
//! - with no owners at all, every filter word is zero;
//! - the bytes the lineage and owner tables hold (their allocations) are what
//!   [`PoolOwnership::exact_state_bytes`] says, and at most the pool's byte budget
//!   ([`PoolOwnership::exact_state_bytes_max`]).
//!
//! Stores are atomic: a store either commits every new mapping or none (capacity omissions are
//! not failures: the mapping is committed without residency). Removals and clears of unknown
//! blocks are counted no-ops, never deletions by fingerprint.
//!
//! The byte budget bounds what the DC's workers can make a pool hold: every growth of a table is
//! weighed before it allocates, and a store or rank replacement that would take the exact state
//! past the budget is refused whole with [`ApplyError::ExactStateBudgetExceeded`] (a resource
//! failure: the rank is recovered, and a rank that keeps failing is degraded by its tracker).
//! Tables do not shrink when entries leave, so the held bytes fall only when a rank's lineage is
//! dropped; what was once reserved stays within the budget and is reused.

use std::collections::BTreeMap;

use thiserror::Error;

use super::tables::{LineageTable, OWNERS_MAX, OwnerState, OwnerTable, TableKey};
use crate::filter::ckf::{BucketImage, CkfAllocationError, CkfFormat, CuckooFilter};
use crate::model::hashing::{ExternalBlockHash, SequenceHash};
use crate::model::kv_events::{KvCacheEventData, Residency, RouterEvent, SourceKey, StoreData};
use crate::rng::RelayRng;

/// Why an event was rejected. Except for [`ApplyError::IndexerInvariantViolation`], nothing was
/// changed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ApplyError {
    /// The event names a residency domain this relay does not know.
    #[error("unsupported residency domain {0:?}")]
    UnsupportedResidencyDomain(String),
    /// A store continues a parent block the source never stored (or already removed).
    #[error("parent block {0:#x} not found for this source")]
    ParentBlockNotFound(u64),
    /// The store contradicts the source's lineage or its own positions.
    #[error("invalid block sequence: {0}")]
    InvalidBlockSequence(SequenceFault),
    /// A canonical hash would exceed the owner-count limit.
    #[error("owner count of canonical hash {0:#x} would exceed {OWNERS_MAX}")]
    OwnershipDegreeOverflow(u64),
    /// Memory for the new mappings could not be reserved.
    #[error("could not reserve memory for the new mappings")]
    AllocationFailed,
    /// The new mappings would take the pool's exact state past its byte budget.
    #[error("the exact state would hold {needed_bytes} bytes, over its budget of {bytes_max}")]
    ExactStateBudgetExceeded {
        /// What the lineage and owner tables would hold after growing for the change (an upper
        /// bound; `usize::MAX` when not representable).
        needed_bytes: usize,
        /// The pool's budget.
        bytes_max: usize,
    },
    /// The exact state and the filter disagree: a resident hash had no fingerprint.
    #[error("resident canonical hash {canonical:#x} has no fingerprint in the filter")]
    IndexerInvariantViolation {
        /// The canonical hash whose fingerprint was missing.
        canonical: u64,
    },
}

/// How a store contradicted the rules of block sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SequenceFault {
    /// An engine block id already maps to a different canonical hash.
    #[error("block {external:#x} already maps to another canonical hash")]
    ConflictingRemap {
        /// The engine block id.
        external: u64,
    },
    /// A chain without a parent must start at position 0.
    #[error("chain without parent starts at position {0}")]
    RootNotAtStart(u32),
    /// A recovery dump may only contain stores.
    #[error("recovery dumps contain only stores")]
    NotAStore,
}

/// What the relay does about a failed event (relay-facts §4.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureDisposition {
    /// Report a resource failure; the rank is recovered.
    ReportResourceFailure,
    /// The source broke the protocol: reject it (the rank is recovered).
    RejectSource,
    /// The producer's state is inconsistent: fence it and rebuild in a new generation.
    FenceAndRebuildProducer,
}

impl ApplyError {
    /// The disposition for this failure.
    #[must_use]
    pub fn disposition(&self) -> FailureDisposition {
        match self {
            ApplyError::AllocationFailed | ApplyError::ExactStateBudgetExceeded { .. } => {
                FailureDisposition::ReportResourceFailure
            }
            ApplyError::IndexerInvariantViolation { .. } => {
                FailureDisposition::FenceAndRebuildProducer
            }
            ApplyError::UnsupportedResidencyDomain(_)
            | ApplyError::ParentBlockNotFound(_)
            | ApplyError::InvalidBlockSequence(_)
            | ApplyError::OwnershipDegreeOverflow(_) => FailureDisposition::RejectSource,
        }
    }
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyOutcome {
    /// False when the event was valid but not for the primary residency, and was ignored.
    pub applied: bool,
    /// Newly owned blocks that could not be placed in the filter.
    pub capacity_omissions: u32,
    /// Removed engine block ids this source never stored.
    pub unknown_removals: u32,
}

/// Running totals over the life of the state (carried across rank replacements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OwnershipCounters {
    /// Events applied.
    pub events_applied: u64,
    /// Valid events ignored because they were not for the primary residency.
    pub events_ignored: u64,
    /// Events rejected with an error.
    pub events_rejected: u64,
    /// Blocks owned without residency because the filter had no room.
    pub capacity_omissions: u64,
    /// Removals of engine block ids the source never stored.
    pub unknown_removals: u64,
    /// Events, rank dumps and rank replacements refused because the exact state would have
    /// passed its byte budget ([`ApplyError::ExactStateBudgetExceeded`]).
    pub budget_refusals: u64,
}

/// Bytes of exact state a pool may hold per slot of its filter, by default.
///
/// A block owned by one rank costs one lineage entry (16 bytes) and one owner entry (12 bytes),
/// plus a control byte each: 30 bytes with the tables 7/8 full, and up to 24/7 of that, 103
/// bytes, while a large table grows (the full old table and its empty successor of twice the
/// buckets are both held until the entries have moved). A block owned by four ranks costs
/// 4 × 17 + 13 = 81 bytes, up to 278. So 288 bytes per slot hold, even at the worst load, every
/// slot's block owned by four ranks, or 2.8 singly owned blocks per slot (the filter can place at
/// most one block per slot; the rest are capacity omissions). The footprint benchmark measures
/// 39–63 bytes per resident block with one owner, 106–170 with four.
pub const EXACT_STATE_BYTES_PER_SLOT: usize = 288;

/// The least default byte budget of a pool's exact state: about 650,000 singly owned blocks at
/// the worst load (103 bytes each), so a filter sized too small for its pool degrades into
/// capacity omissions, as designed, long before its exact state is refused.
pub const EXACT_STATE_BYTES_MIN: usize = 64 << 20;

/// The default byte budget of the exact state of a pool whose filter has `format`'s slots:
/// [`EXACT_STATE_BYTES_PER_SLOT`] per slot, at least [`EXACT_STATE_BYTES_MIN`]. At the relay's
/// default sizing (1,048,576 expected blocks: 524,288 buckets of 4 slots) that is 576 MiB; at
/// the largest (2^24 buckets) 18 GiB.
#[must_use]
pub fn exact_state_bytes_max_default(format: &CkfFormat) -> usize {
    let slots = format.bucket_count.saturating_mul(u64::from(format.slots_per_bucket));
    let bytes = slots.saturating_mul(EXACT_STATE_BYTES_PER_SLOT as u64);
    usize::try_from(bytes).unwrap_or(usize::MAX).max(EXACT_STATE_BYTES_MIN)
}

/// A byte budget below what the exact state already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("the exact state holds {held_bytes} bytes, more than a budget of {bytes_max}")]
pub struct BudgetBelowHeld {
    /// Bytes the exact state holds.
    pub held_bytes: usize,
    /// The budget refused.
    pub bytes_max: usize,
}

/// A replay-ordered rebuild of one rank's lineage, validated as it is built.
///
/// It holds only the lineage table, which never allocates more than its byte bound.
/// Installation does not depend on the order the mappings were added in: only the net change
/// per canonical hash, taken in hash order, touches the owner table and the filter.
#[derive(Debug, Clone)]
pub struct RankReplacement {
    lineage: LineageTable,
    /// Most bytes the lineage table may allocate.
    bytes_max: usize,
}

impl RankReplacement {
    /// An empty replacement (replacing a rank with it removes the rank's blocks), hashing its
    /// dump's block ids under `key` (the pool's [`PoolOwnership::table_key`]), with no byte bound
    /// of its own (installing it is still weighed against the pool's budget).
    #[must_use]
    pub fn new(key: TableKey) -> Self {
        Self::with_bytes_max(key, usize::MAX)
    }

    /// [`RankReplacement::new`] whose lineage table may allocate at most `bytes_max` bytes: a
    /// dump event that would grow it further is refused with
    /// [`ApplyError::ExactStateBudgetExceeded`].
    #[must_use]
    pub fn with_bytes_max(key: TableKey, bytes_max: usize) -> Self {
        RankReplacement { lineage: LineageTable::new(key), bytes_max }
    }

    /// Add one event of a replay-ordered dump: only primary stores are accepted, parents must
    /// precede children. Non-primary events are ignored. On error nothing is added.
    pub fn push_event(&mut self, event: &RouterEvent) -> Result<(), ApplyError> {
        match event.residency() {
            Err(unsupported) => return Err(ApplyError::UnsupportedResidencyDomain(unsupported.0)),
            Ok(Residency::NonPrimary) => return Ok(()),
            Ok(Residency::Primary) => {}
        }
        let KvCacheEventData::Stored(store) = &event.event.data else {
            return Err(ApplyError::InvalidBlockSequence(SequenceFault::NotAStore));
        };
        let mut plan = StorePlan::default();
        plan_store(&self.lineage, store, &mut plan)?;
        let needed_bytes =
            self.lineage.bytes_after_reserve(plan.new_mappings.len()).unwrap_or(usize::MAX);
        if needed_bytes > self.bytes_max {
            return Err(ApplyError::ExactStateBudgetExceeded {
                needed_bytes,
                bytes_max: self.bytes_max,
            });
        }
        if !self.lineage.try_reserve(plan.new_mappings.len()) {
            return Err(ApplyError::AllocationFailed);
        }
        for &(external, canonical) in &plan.new_mappings {
            self.lineage.insert_new(external, canonical);
        }
        Ok(())
    }

    /// Number of blocks in the replacement.
    #[must_use]
    pub fn block_count(&self) -> usize {
        self.lineage.len()
    }

    /// Bytes its lineage table allocates (what installing it adds to the pool's exact state).
    #[must_use]
    pub fn lineage_bytes(&self) -> usize {
        self.lineage.allocation_bytes()
    }
}

/// Chains longer than this find duplicate engine ids through a table instead of a scan.
const BATCH_INDEX_MIN_BLOCKS: usize = 16;

/// Blocks released per step of [`PoolOwnership::release_owners`], and table entries warmed ahead
/// of their lookups at a time: enough independent cache misses in flight to overlap, few enough
/// that a chunk's entries stay in cache until used.
const RELEASE_CHUNK: usize = 32;

/// Most entries a kept [`StorePlan`] keeps room for between stores: a pool reuses one plan, so
/// a steady stream of ordinary stores allocates nothing, and one very long store does not keep
/// its room for good.
const STORE_PLAN_KEPT_ENTRIES_MAX: usize = 256;

/// The validated effect of one store on a lineage, computed before anything is committed.
#[derive(Debug, Clone, Default)]
struct StorePlan {
    /// New `(external, canonical)` mappings in chain order.
    new_mappings: Vec<(u64, u64)>,
    /// Canonical hashes of blocks the source already had (re-offers), not among the new ones.
    reoffers: Vec<u64>,
}

impl StorePlan {
    /// Empty the plan, keeping room for at most [`STORE_PLAN_KEPT_ENTRIES_MAX`] entries in each
    /// list.
    fn recycle(&mut self) {
        self.new_mappings.clear();
        self.reoffers.clear();
        if self.new_mappings.capacity() > STORE_PLAN_KEPT_ENTRIES_MAX {
            self.new_mappings = Vec::new();
        }
        if self.reoffers.capacity() > STORE_PLAN_KEPT_ENTRIES_MAX {
            self.reoffers = Vec::new();
        }
    }
}

/// Check a store against a lineage and compute its canonical hashes into `plan`, which is
/// empty (a new plan, or one [`StorePlan::recycle`]d); changes nothing else.
fn plan_store(
    lineage: &LineageTable,
    store: &StoreData,
    plan: &mut StorePlan,
) -> Result<(), ApplyError> {
    debug_assert!(plan.new_mappings.is_empty() && plan.reoffers.is_empty(), "a used plan");
    if store.blocks.is_empty() {
        return Ok(());
    }
    // The lookups below do not depend on one another: their cache misses overlap here, a chunk
    // ahead of the loop at a time (a long store warmed at once would evict its first entries).
    let externals = |from: usize| {
        store.blocks[from..].iter().take(RELEASE_CHUNK).map(|block| block.block_hash.0)
    };
    lineage.warm(store.parent_hash.map(|hash| hash.0).into_iter().chain(externals(0)));
    let mut previous = match (store.parent_hash, store.start_position) {
        (Some(ExternalBlockHash(parent)), _) => {
            Some(SequenceHash(lineage.get(parent).ok_or(ApplyError::ParentBlockNotFound(parent))?))
        }
        (None, Some(position)) if position != 0 => {
            return Err(ApplyError::InvalidBlockSequence(SequenceFault::RootNotAtStart(position)));
        }
        (None, _) => None,
    };
    plan.new_mappings.reserve(store.blocks.len());
    // Long chains index their own new mappings so duplicate ids stay O(1) to find.
    let mut batch =
        (store.blocks.len() > BATCH_INDEX_MIN_BLOCKS).then(|| LineageTable::new(lineage.key()));
    for (index, block) in store.blocks.iter().enumerate() {
        if index > 0 && index.is_multiple_of(RELEASE_CHUNK) {
            lineage.warm(externals(index));
        }
        let canonical = match previous {
            None => SequenceHash::root(block.tokens_hash),
            Some(parent) => parent.child(block.tokens_hash),
        };
        previous = Some(canonical);
        let external = block.block_hash.0;
        let existing = lineage.get(external).or_else(|| match &batch {
            Some(batch) => batch.get(external),
            None => plan.new_mappings.iter().find(|(known, _)| *known == external).map(|m| m.1),
        });
        match existing {
            Some(mapped) if mapped != canonical.0 => {
                return Err(ApplyError::InvalidBlockSequence(SequenceFault::ConflictingRemap {
                    external,
                }));
            }
            Some(_) => plan.reoffers.push(canonical.0),
            None => {
                plan.new_mappings.push((external, canonical.0));
                if let Some(batch) = &mut batch {
                    batch.insert_new(external, canonical.0);
                }
            }
        }
    }
    if !plan.reoffers.is_empty() && !plan.new_mappings.is_empty() {
        let mut new: Vec<u64> = plan.new_mappings.iter().map(|&(_, canonical)| canonical).collect();
        new.sort_unstable();
        plan.reoffers.retain(|canonical| new.binary_search(canonical).is_err());
    }
    Ok(())
}

/// Exact ownership of one pool plus its cuckoo filter.
#[derive(Debug, Clone)]
pub struct PoolOwnership {
    filter: CuckooFilter,
    sources: BTreeMap<SourceKey, LineageTable>,
    owners: OwnerTable,
    /// The key every table of this pool hashes under.
    table_key: TableKey,
    /// Owned canonical hashes without residency.
    omitted_owned: u64,
    counters: OwnershipCounters,
    /// Bytes the owner table and every lineage table allocate, kept as they change.
    held_bytes: usize,
    /// Most bytes the tables may allocate; growth past it is refused before it allocates.
    exact_state_bytes_max: usize,
    /// The plan of the store being applied, kept between stores for its room.
    plan: StorePlan,
}

impl PoolOwnership {
    /// An empty pool with a filter of `format` and the default byte budget for it
    /// ([`exact_state_bytes_max_default`]); `rng` supplies cuckoo kick choices and, on a stream
    /// of its own, the pool's [`TableKey`].
    pub fn new(
        format: CkfFormat,
        max_kicks: u32,
        rng: RelayRng,
    ) -> Result<Self, CkfAllocationError> {
        let table_key = TableKey::from_rng(&rng);
        Ok(PoolOwnership {
            filter: CuckooFilter::new(format, max_kicks, rng)?,
            sources: BTreeMap::new(),
            owners: OwnerTable::new(table_key),
            table_key,
            omitted_owned: 0,
            counters: OwnershipCounters::default(),
            held_bytes: 0,
            exact_state_bytes_max: exact_state_bytes_max_default(&format),
            plan: StorePlan::default(),
        })
    }

    /// Give the exact state a byte budget of `bytes_max`. Refused, keeping the current budget,
    /// when the tables already hold more.
    pub fn set_exact_state_bytes_max(&mut self, bytes_max: usize) -> Result<(), BudgetBelowHeld> {
        if self.held_bytes > bytes_max {
            return Err(BudgetBelowHeld { held_bytes: self.held_bytes, bytes_max });
        }
        self.exact_state_bytes_max = bytes_max;
        Ok(())
    }

    /// Most bytes the exact state's tables may allocate.
    #[must_use]
    pub fn exact_state_bytes_max(&self) -> usize {
        self.exact_state_bytes_max
    }

    /// The secret key of this pool's tables, for building its [`RankReplacement`]s.
    #[must_use]
    pub fn table_key(&self) -> TableKey {
        self.table_key
    }

    /// The pool's filter.
    #[must_use]
    pub fn filter(&self) -> &CuckooFilter {
        &self.filter
    }

    /// Running totals.
    #[must_use]
    pub fn counters(&self) -> &OwnershipCounters {
        &self.counters
    }

    /// Owner state of a canonical hash, `None` when unowned.
    #[must_use]
    pub fn owner_state(&self, canonical: SequenceHash) -> Option<OwnerState> {
        self.owners.get(canonical.0)
    }

    /// Number of distinct owned canonical hashes.
    #[must_use]
    pub fn owned_block_count(&self) -> usize {
        self.owners.len()
    }

    /// Owned canonical hashes that are not resident (capacity omissions still owned).
    #[must_use]
    pub fn omitted_block_count(&self) -> u64 {
        self.omitted_owned
    }

    /// Every owned canonical hash with its state, sorted by hash.
    #[must_use]
    pub fn owned_blocks(&self) -> Vec<(SequenceHash, OwnerState)> {
        let mut blocks: Vec<_> =
            self.owners.iter().map(|(canonical, state)| (SequenceHash(canonical), state)).collect();
        blocks.sort_unstable_by_key(|(canonical, _)| *canonical);
        blocks
    }

    /// The sources that own at least one block, in order.
    pub fn sources(&self) -> impl Iterator<Item = (SourceKey, usize)> + '_ {
        self.sources.iter().map(|(key, lineage)| (*key, lineage.len()))
    }

    /// Bytes allocated by the exact state (lineage and owner tables; not the filter), at most
    /// [`PoolOwnership::exact_state_bytes_max`].
    #[must_use]
    pub fn exact_state_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The tables' allocations, summed afresh (O(sources)).
    fn allocated_bytes(&self) -> usize {
        self.owners.allocation_bytes()
            + self.sources.values().map(LineageTable::allocation_bytes).sum::<usize>()
    }

    /// Free the owner table's and `source`'s drained tables; their bytes leave the held bytes.
    fn settle(&mut self, source: Option<SourceKey>) {
        self.held_bytes -= self.owners.settle();
        if let Some(lineage) = source.and_then(|source| self.sources.get_mut(&source)) {
            self.held_bytes -= lineage.settle();
        }
    }

    /// A refusal of a change that would hold `needed_bytes`, if that is over the budget.
    fn over_budget(&self, needed_bytes: Option<usize>) -> Result<(), ApplyError> {
        let needed_bytes = needed_bytes.unwrap_or(usize::MAX);
        if needed_bytes > self.exact_state_bytes_max {
            return Err(ApplyError::ExactStateBudgetExceeded {
                needed_bytes,
                bytes_max: self.exact_state_bytes_max,
            });
        }
        Ok(())
    }

    /// Count a rank dump the pool machine refused to build for the budget.
    pub(super) fn count_budget_refusal(&mut self) {
        self.counters.budget_refusals += 1;
    }

    /// Whether any bucket was written since the last publication.
    #[must_use]
    pub fn has_unpublished_writes(&self) -> bool {
        self.filter.has_unpublished_writes()
    }

    /// Images of the buckets that differ from their last published words; resets the baseline.
    pub fn take_publication(&mut self) -> Vec<BucketImage> {
        self.filter.take_publication()
    }

    /// Make the current words the publication baseline without building images.
    pub fn discard_publication(&mut self) {
        self.filter.discard_publication();
    }

    /// Apply one event. On error the state is unchanged, except that a removal meeting an
    /// invariant violation still processes its other blocks.
    pub fn apply_event(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        let result = self.apply_event_inner(event);
        self.settle(Some(event.source()));
        match &result {
            Ok(outcome) if outcome.applied => {
                self.counters.events_applied += 1;
                self.counters.capacity_omissions += u64::from(outcome.capacity_omissions);
                self.counters.unknown_removals += u64::from(outcome.unknown_removals);
            }
            Ok(_) => self.counters.events_ignored += 1,
            Err(error) => {
                self.counters.events_rejected += 1;
                if matches!(error, ApplyError::ExactStateBudgetExceeded { .. }) {
                    self.counters.budget_refusals += 1;
                }
            }
        }
        result
    }

    fn apply_event_inner(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        match event.residency() {
            Err(unsupported) => return Err(ApplyError::UnsupportedResidencyDomain(unsupported.0)),
            Ok(Residency::NonPrimary) => return Ok(ApplyOutcome::default()),
            Ok(Residency::Primary) => {}
        }
        let source = event.source();
        let mut outcome = ApplyOutcome { applied: true, ..ApplyOutcome::default() };
        match &event.event.data {
            KvCacheEventData::Stored(store) => {
                outcome.capacity_omissions = self.store(source, store)?;
            }
            KvCacheEventData::Removed(remove) => {
                let mut first_error = None;
                for externals in remove.block_hashes.chunks(RELEASE_CHUNK) {
                    let mut released = [0u64; RELEASE_CHUNK];
                    let mut count = 0;
                    if let Some(lineage) = self.sources.get_mut(&source) {
                        lineage.warm(externals.iter().map(|external| external.0));
                        for external in externals {
                            if let Some(canonical) = lineage.remove(external.0) {
                                released[count] = canonical;
                                count += 1;
                            }
                        }
                    }
                    outcome.unknown_removals += (externals.len() - count) as u32;
                    let released = released[..count].iter().map(|&canonical| (canonical, 1));
                    if let Err(error) = self.release_owners(released) {
                        first_error.get_or_insert(error);
                    }
                }
                self.drop_source_if_empty(source);
                if let Some(error) = first_error {
                    return Err(error);
                }
            }
            KvCacheEventData::Cleared => self.clear_source(source)?,
        }
        Ok(outcome)
    }

    /// Commit a store; returns the number of capacity omissions.
    fn store(&mut self, source: SourceKey, store: &StoreData) -> Result<u32, ApplyError> {
        let mut plan = std::mem::take(&mut self.plan);
        let result = self.store_planned(source, store, &mut plan);
        plan.recycle();
        self.plan = plan;
        result
    }

    /// [`Self::store`] with the pool's kept plan taken out of it.
    fn store_planned(
        &mut self,
        source: SourceKey,
        store: &StoreData,
        plan: &mut StorePlan,
    ) -> Result<u32, ApplyError> {
        let empty = LineageTable::new(self.table_key);
        let lineage = self.sources.get(&source).unwrap_or(&empty);
        plan_store(lineage, store, plan)?;
        if plan.new_mappings.is_empty() && plan.reoffers.is_empty() {
            return Ok(0);
        }
        // The filter words of the new blocks load while the owner table is read below, a chunk
        // of owner entries warmed ahead at a time.
        self.filter.warm(plan.new_mappings.iter().map(|&(_, canonical)| canonical));
        for chunk in plan.new_mappings.chunks(RELEASE_CHUNK) {
            self.owners.warm(chunk.iter().map(|&(_, canonical)| canonical));
            for &(_, canonical) in chunk {
                let owners = self.owners.get(canonical).map_or(0, |state| state.owners);
                if owners.saturating_add(plan.new_mappings.len() as u32) > OWNERS_MAX {
                    return Err(ApplyError::OwnershipDegreeOverflow(canonical));
                }
            }
        }
        let additional = plan.new_mappings.len();
        self.reserve_mappings(source, additional)?;
        let key = self.table_key;
        let lineage = self.sources.entry(source).or_insert_with(|| LineageTable::new(key));
        // Commit: nothing below can fail except physical placement, which is not an error.
        let mut omissions = 0u32;
        let mut omitted_now: Vec<u64> = Vec::new();
        for &(external, canonical) in &plan.new_mappings {
            lineage.insert_new(external, canonical);
            let state = self.owners.add_owners(canonical, 1);
            if state.resident || omitted_now.contains(&canonical) {
                continue;
            }
            if self.filter.insert(canonical).is_ok() {
                self.owners.mark_resident(canonical);
                if state.owners > 1 {
                    self.omitted_owned -= 1;
                }
            } else {
                omissions += 1;
                omitted_now.push(canonical);
                if state.owners == 1 {
                    self.omitted_owned += 1;
                }
            }
        }
        for &canonical in &plan.reoffers {
            if let Some(state) = self.owners.get(canonical)
                && !state.resident
                && self.filter.insert_without_relocation(canonical)
            {
                self.owners.mark_resident(canonical);
                self.omitted_owned -= 1;
            }
        }
        Ok(omissions)
    }

    /// Make room for `additional` new mappings of `source` in its lineage and the owner table,
    /// within the byte budget: weighed first, then reserved. A source without a lineage gets one
    /// only when there is something to reserve (and keeps none when reserving fails).
    fn reserve_mappings(&mut self, source: SourceKey, additional: usize) -> Result<(), ApplyError> {
        if additional == 0 {
            return Ok(());
        }
        let owners_bytes = self.owners.allocation_bytes();
        let (lineage_bytes, lineage_after) = match self.sources.get(&source) {
            Some(lineage) => (lineage.allocation_bytes(), lineage.bytes_after_reserve(additional)),
            None => (0, LineageTable::new(self.table_key).bytes_after_reserve(additional)),
        };
        let others = self.held_bytes - owners_bytes - lineage_bytes;
        let needed = self
            .owners
            .bytes_after_reserve(additional)
            .zip(lineage_after)
            .and_then(|(owners, lineage)| others.checked_add(owners)?.checked_add(lineage));
        self.over_budget(needed)?;
        // A reservation that fails may still have finished a gradual growth: count either way.
        let reserved = self.owners.try_reserve(additional);
        self.held_bytes = self.held_bytes - owners_bytes + self.owners.allocation_bytes();
        if !reserved {
            return Err(ApplyError::AllocationFailed);
        }
        let key = self.table_key;
        let lineage = self.sources.entry(source).or_insert_with(|| LineageTable::new(key));
        let reserved = lineage.try_reserve(additional);
        self.held_bytes = self.held_bytes - lineage_bytes + lineage.allocation_bytes();
        if !reserved {
            self.drop_source_if_empty(source);
            return Err(ApplyError::AllocationFailed);
        }
        debug_assert!(self.held_bytes <= self.exact_state_bytes_max, "growth was weighed short");
        Ok(())
    }

    /// Drop `count` owners of each canonical hash, in order; a fingerprint goes when its last
    /// resident owner does. Batched by [`RELEASE_CHUNK`]: a chunk's owner entries are loaded
    /// together and updated, then the fingerprints that lost their last owner are removed in the
    /// same order, their buckets loaded together ([`CuckooFilter::warm`]), so the cache misses
    /// of a chunk overlap. The owner table and the filter are disjoint and each sees its
    /// operations in the same order, so the state after each chunk is the one releasing its
    /// hashes one at a time leaves. Returns the first invariant violation met (a hash without
    /// an owner entry, or a resident one without a fingerprint); every other release still
    /// happens.
    fn release_owners(
        &mut self,
        releases: impl IntoIterator<Item = (u64, u32)>,
    ) -> Result<(), ApplyError> {
        let mut releases = releases.into_iter();
        let mut first_error = None;
        loop {
            let mut chunk = [(0u64, 0u32); RELEASE_CHUNK];
            let mut taken = 0;
            for release in releases.by_ref().take(RELEASE_CHUNK) {
                chunk[taken] = release;
                taken += 1;
            }
            if taken == 0 {
                break;
            }
            let chunk = &chunk[..taken];
            self.owners.warm(chunk.iter().map(|&(canonical, _)| canonical));
            let mut gone = [0u64; RELEASE_CHUNK];
            let mut gone_count = 0;
            for &(canonical, count) in chunk {
                match self.owners.remove_owners(canonical, count) {
                    None => {
                        first_error
                            .get_or_insert(ApplyError::IndexerInvariantViolation { canonical });
                    }
                    Some(after) if after.owners > 0 => {}
                    Some(after) if after.resident => {
                        gone[gone_count] = canonical;
                        gone_count += 1;
                    }
                    Some(_) => self.omitted_owned -= 1,
                }
            }
            let gone = &gone[..gone_count];
            self.filter.warm(gone.iter().copied());
            for &canonical in gone {
                if self.filter.remove(canonical).is_err() {
                    first_error.get_or_insert(ApplyError::IndexerInvariantViolation { canonical });
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn drop_source_if_empty(&mut self, source: SourceKey) {
        if self.sources.get(&source).is_some_and(LineageTable::is_empty) {
            self.take_source(source);
        }
    }

    /// Remove a source's lineage from the state (its bytes leave the held bytes).
    fn take_source(&mut self, source: SourceKey) -> Option<LineageTable> {
        let lineage = self.sources.remove(&source)?;
        self.held_bytes -= lineage.allocation_bytes();
        Some(lineage)
    }

    /// Remove every mapping of one source; other sources' shares of the same hashes remain.
    fn clear_source(&mut self, source: SourceKey) -> Result<(), ApplyError> {
        let Some(lineage) = self.take_source(source) else { return Ok(()) };
        self.release_owners(lineage.iter().map(|(_, canonical)| (canonical, 1)))
    }

    /// Remove every block of one rank.
    pub fn remove_rank(&mut self, source: SourceKey) -> Result<(), ApplyError> {
        let result = self.clear_source(source);
        self.settle(None);
        result
    }

    /// Remove every block of every rank of a worker.
    pub fn remove_worker(&mut self, worker_id: u64) -> Result<(), ApplyError> {
        let ranks: Vec<SourceKey> =
            self.sources.keys().filter(|key| key.worker_id == worker_id).copied().collect();
        let mut first_error = None;
        for source in ranks {
            if let Err(error) = self.clear_source(source) {
                first_error.get_or_insert(error);
            }
        }
        self.settle(None);
        first_error.map_or(Ok(()), Err)
    }

    /// The net owner change per canonical hash that swapping in `replacements` makes: one
    /// entry per hash any replaced or replacing lineage maps to (a zero change included),
    /// sorted by hash. A sorted vector rather than a map: a multi-million-block rank is summed
    /// by one sort instead of millions of tree insertions.
    fn net_changes(
        &self,
        replacements: &BTreeMap<SourceKey, RankReplacement>,
    ) -> Result<Vec<(u64, i64)>, ApplyError> {
        let mappings = replacements.iter().fold(0usize, |total, (source, replacement)| {
            let old = self.sources.get(source).map_or(0, LineageTable::len);
            total.saturating_add(old).saturating_add(replacement.lineage.len())
        });
        let mut changes: Vec<(u64, i64)> = Vec::new();
        changes.try_reserve_exact(mappings).map_err(|_| ApplyError::AllocationFailed)?;
        for (source, replacement) in replacements {
            if let Some(old) = self.sources.get(source) {
                changes.extend(old.iter().map(|(_, canonical)| (canonical, -1)));
            }
            changes.extend(replacement.lineage.iter().map(|(_, canonical)| (canonical, 1)));
        }
        changes.sort_unstable_by_key(|&(canonical, _)| canonical);
        changes.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
            }
            same
        });
        Ok(changes)
    }

    /// Replace the lineage of several ranks at once with rebuilt ones (recovery).
    ///
    /// Transactional: every check and allocation happens before the first change, so an error
    /// leaves the state untouched. Only the net change per canonical hash touches the filter:
    /// hashes whose last owner goes are removed first, then newly owned hashes are inserted, so a
    /// rank replaced by the same content publishes nothing. Owned hashes left without residency
    /// by earlier capacity omissions get another full insertion attempt afterwards. Returns the
    /// number of capacity omissions.
    pub fn replace_ranks(
        &mut self,
        replacements: BTreeMap<SourceKey, RankReplacement>,
    ) -> Result<u32, ApplyError> {
        let net = self.net_changes(&replacements)?;
        let mut newly_owned = 0usize;
        for &(canonical, change) in &net {
            let owners = i64::from(self.owners.get(canonical).map_or(0, |state| state.owners));
            if owners + change > i64::from(OWNERS_MAX) {
                return Err(ApplyError::OwnershipDegreeOverflow(canonical));
            }
            if owners + change < 0 {
                return Err(ApplyError::IndexerInvariantViolation { canonical });
            }
            if owners == 0 && change > 0 {
                newly_owned += 1;
            }
        }
        // The state after the swap: every replaced lineage out, every non-empty replacement
        // in, the owner table grown for the newly owned hashes.
        let owners_bytes = self.owners.allocation_bytes();
        let mut others = self.held_bytes - owners_bytes;
        let mut installed = 0usize;
        for (source, replacement) in &replacements {
            others -= self.sources.get(source).map_or(0, LineageTable::allocation_bytes);
            if !replacement.lineage.is_empty() {
                installed = installed.saturating_add(replacement.lineage.allocation_bytes());
            }
        }
        let needed = self
            .owners
            .bytes_after_reserve(newly_owned)
            .and_then(|owners| others.checked_add(owners)?.checked_add(installed));
        if let Err(refused) = self.over_budget(needed) {
            self.counters.budget_refusals += 1;
            return Err(refused);
        }
        let reserved = self.owners.try_reserve(newly_owned);
        self.held_bytes = self.held_bytes - owners_bytes + self.owners.allocation_bytes();
        if !reserved {
            return Err(ApplyError::AllocationFailed);
        }
        // Commit.
        for (source, replacement) in replacements {
            self.take_source(source);
            if !replacement.lineage.is_empty() {
                self.held_bytes += replacement.lineage.allocation_bytes();
                self.sources.insert(source, replacement.lineage);
            }
        }
        debug_assert!(self.held_bytes <= self.exact_state_bytes_max, "growth was weighed short");
        let released = net.iter().filter(|(_, change)| *change < 0);
        let first_error = self
            .release_owners(
                released.map(|&(canonical, change)| (canonical, change.unsigned_abs() as u32)),
            )
            .err();
        let mut omissions = 0u32;
        for &(canonical, change) in net.iter().filter(|(_, change)| *change > 0) {
            let state = self.owners.add_owners(canonical, change as u32);
            if state.owners == change as u32 {
                self.omitted_owned += 1;
            }
            if !state.resident && !self.admit(canonical) {
                omissions += 1;
            }
        }
        if self.omitted_owned > 0 {
            let waiting: Vec<u64> = self
                .owners
                .iter()
                .filter(|(canonical, state)| !state.resident && !mentions(&net, *canonical))
                .map(|(canonical, _)| canonical)
                .collect();
            for canonical in waiting {
                self.admit(canonical);
            }
        }
        self.counters.capacity_omissions += u64::from(omissions);
        self.settle(None);
        first_error.map_or(Ok(omissions), Err)
    }

    /// Try a full insertion of an owned, non-resident canonical hash.
    fn admit(&mut self, canonical: u64) -> bool {
        if self.filter.insert(canonical).is_err() {
            return false;
        }
        self.owners.mark_resident(canonical);
        self.omitted_owned -= 1;
        true
    }

    /// Verify every invariant of the module doc against the whole state (tests and debugging:
    /// O(state)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut mapped: BTreeMap<u64, u32> = BTreeMap::new();
        self.owners.check().map_err(|error| format!("owner table: {error}"))?;
        for (source, lineage) in &self.sources {
            if lineage.is_empty() {
                return Err("an empty lineage is kept".into());
            }
            lineage.check().map_err(|error| format!("lineage of {source:?}: {error}"))?;
            for (_, canonical) in lineage.iter() {
                *mapped.entry(canonical).or_default() += 1;
            }
        }
        if mapped.len() != self.owners.len() {
            return Err(format!(
                "{} mapped hashes, {} owner entries",
                mapped.len(),
                self.owners.len()
            ));
        }
        let mut resident = 0u64;
        let mut omitted = 0u64;
        for (canonical, state) in self.owners.iter() {
            if mapped.get(&canonical) != Some(&state.owners) {
                return Err(format!("owner count of {canonical:#x} is {}", state.owners));
            }
            if state.resident {
                resident += 1;
                if !self.filter.contains(canonical) {
                    return Err(format!("resident {canonical:#x} not in the filter"));
                }
            } else {
                omitted += 1;
            }
        }
        if omitted != self.omitted_owned {
            return Err(format!("{omitted} omitted hashes, counter says {}", self.omitted_owned));
        }
        if resident != self.filter.occupied_slots() {
            return Err(format!(
                "{resident} resident hashes, {} occupied slots",
                self.filter.occupied_slots()
            ));
        }
        let allocated = self.allocated_bytes();
        if allocated != self.held_bytes {
            return Err(format!(
                "the tables allocate {allocated} bytes, {} counted",
                self.held_bytes
            ));
        }
        if self.held_bytes > self.exact_state_bytes_max {
            return Err(format!(
                "the exact state holds {} bytes, over its budget of {}",
                self.held_bytes, self.exact_state_bytes_max
            ));
        }
        Ok(())
    }
}

/// Whether a sorted net-change list names `canonical`.
fn mentions(net: &[(u64, i64)], canonical: u64) -> bool {
    net.binary_search_by_key(&canonical, |&(hash, _)| hash).is_ok()
}

#[cfg(test)]
#[path = "ownership_tests.rs"]
mod tests;
