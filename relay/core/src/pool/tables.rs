//! Compact hash tables of the exact ownership state.
//!
//! The keys are engine block ids and canonical sequence hashes, both chosen by the DC's workers,
//! so the tables hash them under a secret [`TableKey`]: without one a publisher could pick ids
//! that share one probe sequence and make every operation linear. The key comes from the pool's
//! seeded RNG, so a run with the same seed and history lays the tables out, and iterates them,
//! in the same order. Entries are packed to keep the exact state small: a lineage entry is
//! 16 bytes and an owner entry 12 bytes. Both tables are [`GrowingTable`]s: a large one grows
//! without a pause, and every growth is weighed before it allocates.

use rand_core::{Rng, SeedableRng};

use super::growing::{GrowingTable, Keyed};
use crate::rng::RelayRng;

/// The ChaCha stream the table key is drawn from, apart from the stream of the filter's kick
/// choices so that keying the tables leaves the filter's placement unchanged.
const TABLE_KEY_STREAM: u64 = 0x7461_626c_652d_6b65;

/// The secret key of one pool's table hash: a keyed folded multiply (the construction of
/// well-known fast keyed hashes), one 128-bit multiply per lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableKey {
    xor: u64,
    /// Odd, so the multiply is a bijection before folding.
    multiplier: u64,
}

impl TableKey {
    /// Draw a key from a pool's generator, on a stream of its own (`rng` is not advanced).
    #[must_use]
    pub fn from_rng(rng: &RelayRng) -> Self {
        let mut keys = RelayRng::from_seed(rng.get_seed());
        keys.set_stream(TABLE_KEY_STREAM);
        TableKey { xor: keys.next_u64(), multiplier: keys.next_u64() | 1 }
    }

    /// Spread a 64-bit key over a table: folded 128-bit multiply of the keyed input.
    #[inline]
    pub(super) fn spread(self, key: u64) -> u64 {
        let product = u128::from(key ^ self.xor) * u128::from(self.multiplier);
        (product as u64) ^ ((product >> 64) as u64)
    }
}

/// One source's engine vocabulary: external block id → canonical sequence hash.
#[derive(Debug, Clone)]
pub(crate) struct LineageTable {
    table: GrowingTable<(u64, u64)>,
}

/// A lineage entry `(external, canonical)` is found by its external id.
impl Keyed for (u64, u64) {
    #[inline]
    fn key(&self) -> u64 {
        self.0
    }
}

impl LineageTable {
    pub(crate) fn new(key: TableKey) -> Self {
        LineageTable { table: GrowingTable::new(key) }
    }

    pub(crate) fn key(&self) -> TableKey {
        self.table.key()
    }

    #[inline]
    pub(crate) fn get(&self, external: u64) -> Option<u64> {
        self.table.get(external).map(|entry| entry.1)
    }

    /// Bring the entries of `externals` into cache ([`GrowingTable::warm`]).
    #[inline]
    pub(crate) fn warm(&self, externals: impl IntoIterator<Item = u64>) {
        self.table.warm(externals);
    }

    /// Insert a mapping the caller has checked is absent.
    #[inline]
    pub(crate) fn insert_new(&mut self, external: u64, canonical: u64) {
        self.table.insert_new((external, canonical));
    }

    #[inline]
    pub(crate) fn remove(&mut self, external: u64) -> Option<u64> {
        self.table.remove(external).map(|entry| entry.1)
    }

    pub(crate) fn try_reserve(&mut self, additional: usize) -> bool {
        self.table.try_reserve(additional)
    }

    /// The allocation after [`LineageTable::try_reserve`] of `additional` would succeed, at
    /// least what it would be; `None` when it could not be represented.
    pub(crate) fn bytes_after_reserve(&self, additional: usize) -> Option<usize> {
        self.table.bytes_after_reserve(additional)
    }

    /// Free a fully drained table; returns the bytes freed.
    pub(crate) fn settle(&mut self) -> usize {
        self.table.settle()
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// `(external, canonical)` pairs in table order (deterministic for a given history).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.table.iter().copied()
    }

    pub(crate) fn allocation_bytes(&self) -> usize {
        self.table.allocation_bytes()
    }

    /// The growing table's invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.table.check()
    }
}

const RESIDENT_BIT: u32 = 1 << 31;

/// Most owners one canonical hash can have (the top bit of the count word marks residency).
pub const OWNERS_MAX: u32 = RESIDENT_BIT - 1;

/// A canonical hash, its owner count and whether its fingerprint is in the filter.
///
/// Packed to 12 bytes; fields are only ever read and written by value.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct OwnerEntry {
    canonical: u64,
    /// Owner count in the low 31 bits, [`RESIDENT_BIT`] when resident.
    state: u32,
}

impl Keyed for OwnerEntry {
    #[inline]
    fn key(&self) -> u64 {
        self.canonical
    }
}

/// What the owner table knows about one canonical hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerState {
    /// Number of `(source, external id)` mappings to this canonical hash; at least 1.
    pub owners: u32,
    /// Whether the canonical hash has a fingerprint in the filter.
    pub resident: bool,
}

impl OwnerEntry {
    fn owner_state(self) -> OwnerState {
        let state = self.state;
        OwnerState { owners: state & OWNERS_MAX, resident: state & RESIDENT_BIT != 0 }
    }
}

/// Canonical hash → owner count and residency. Absent means no owner.
#[derive(Debug, Clone)]
pub(crate) struct OwnerTable {
    table: GrowingTable<OwnerEntry>,
}

impl OwnerTable {
    pub(crate) fn new(key: TableKey) -> Self {
        OwnerTable { table: GrowingTable::new(key) }
    }

    #[inline]
    pub(crate) fn get(&self, canonical: u64) -> Option<OwnerState> {
        self.table.get(canonical).map(|entry| entry.owner_state())
    }

    /// Bring the entries of `canonicals` into cache ([`GrowingTable::warm`]).
    #[inline]
    pub(crate) fn warm(&self, canonicals: impl IntoIterator<Item = u64>) {
        self.table.warm(canonicals);
    }

    /// Add `added` owners (the caller checked the sum stays within [`OWNERS_MAX`]); returns the
    /// state after the addition.
    ///
    /// Allocates only to insert a new canonical hash, and not at all when room for it was
    /// reserved: an owner added to a hash already present never grows the table (hashbrown's
    /// `entry` would reserve room for one more entry before looking, growing a full table for
    /// a hash it holds, past what the caller weighed).
    #[inline]
    pub(crate) fn add_owners(&mut self, canonical: u64, added: u32) -> OwnerState {
        if let Some(entry) = self.table.get_mut(canonical) {
            let state = entry.state;
            debug_assert!((state & OWNERS_MAX) + added <= OWNERS_MAX);
            entry.state = state + added;
            return entry.owner_state();
        }
        debug_assert!(added <= OWNERS_MAX);
        let entry = OwnerEntry { canonical, state: added };
        self.table.insert_new(entry);
        entry.owner_state()
    }

    /// Remove `removed` owners, at most as many as there are; returns the state after removal
    /// (owners 0 means the entry is gone), or `None` if the canonical hash had no owner.
    pub(crate) fn remove_owners(&mut self, canonical: u64, removed: u32) -> Option<OwnerState> {
        let before = self
            .table
            .update(canonical, |entry| {
                let state = entry.owner_state();
                let owners = state.owners.saturating_sub(removed);
                entry.state = owners | if state.resident { RESIDENT_BIT } else { 0 };
                owners > 0
            })?
            .owner_state();
        Some(OwnerState {
            owners: before.owners.saturating_sub(removed),
            resident: before.resident,
        })
    }

    /// Record that an owned canonical hash is resident (idempotent). A hash stays resident until
    /// its last owner leaves: the entry, and its residency, go with it.
    #[inline]
    pub(crate) fn mark_resident(&mut self, canonical: u64) {
        if let Some(entry) = self.table.get_mut(canonical) {
            entry.state |= RESIDENT_BIT;
        }
    }

    pub(crate) fn try_reserve(&mut self, additional: usize) -> bool {
        self.table.try_reserve(additional)
    }

    /// The allocation after [`OwnerTable::try_reserve`] of `additional` would succeed, at least
    /// what it would be; `None` when it could not be represented.
    pub(crate) fn bytes_after_reserve(&self, additional: usize) -> Option<usize> {
        self.table.bytes_after_reserve(additional)
    }

    /// Free a fully drained table; returns the bytes freed.
    pub(crate) fn settle(&mut self) -> usize {
        self.table.settle()
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// `(canonical, state)` in table order (deterministic for a given history).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, OwnerState)> + '_ {
        self.table.iter().map(|entry| (entry.canonical, entry.owner_state()))
    }

    pub(crate) fn allocation_bytes(&self) -> usize {
        self.table.allocation_bytes()
    }

    /// The growing table's invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.table.check()
    }

    /// Whether a gradual growth is under way.
    #[cfg(test)]
    pub(crate) fn table_is_draining(&self) -> bool {
        self.table.is_draining()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::rng_from_seed;

    fn test_key() -> TableKey {
        TableKey::from_rng(&rng_from_seed(1))
    }

    #[test]
    fn the_key_follows_the_seed_and_leaves_the_generator_alone() {
        let rng = rng_from_seed(7);
        assert_eq!(TableKey::from_rng(&rng), TableKey::from_rng(&rng_from_seed(7)));
        assert_ne!(TableKey::from_rng(&rng), TableKey::from_rng(&rng_from_seed(8)));
        let mut drawn = rng.clone();
        let _ = TableKey::from_rng(&drawn);
        assert_eq!(drawn.next_u64(), rng_from_seed(7).next_u64());
    }

    /// The multiplier is odd for every seed, so the keyed multiply is a bijection.
    #[test]
    fn every_key_multiplies_by_an_odd_number() {
        for seed in 0..256 {
            assert_eq!(TableKey::from_rng(&rng_from_seed(seed)).multiplier & 1, 1, "seed {seed}");
        }
    }

    /// Ids chosen to share one bucket under a known key spread out under another: an attacker
    /// who does not know the pool's key cannot aim its block ids at one probe sequence.
    #[test]
    fn ids_aimed_at_one_bucket_under_one_key_scatter_under_another() {
        const BUCKET_BITS: u64 = 0xFFF;
        let known = TableKey::from_rng(&rng_from_seed(1));
        let secret = TableKey::from_rng(&rng_from_seed(2));
        let aimed: Vec<u64> =
            (0u64..).filter(|id| known.spread(*id) & BUCKET_BITS == 0).take(64).collect();
        let buckets: std::collections::BTreeSet<u64> =
            aimed.iter().map(|id| secret.spread(*id) & BUCKET_BITS).collect();
        assert!(buckets.len() > 56, "64 aimed ids fell into {} buckets", buckets.len());
    }

    #[test]
    fn owner_entries_are_twelve_bytes() {
        assert_eq!(std::mem::size_of::<OwnerEntry>(), 12);
    }

    #[test]
    fn owner_counts_and_residency_are_independent() {
        let mut owners = OwnerTable::new(test_key());
        assert_eq!(owners.add_owners(7, 1), OwnerState { owners: 1, resident: false });
        owners.mark_resident(7);
        owners.mark_resident(7);
        assert_eq!(owners.get(7), Some(OwnerState { owners: 1, resident: true }));
        assert_eq!(owners.add_owners(7, 2), OwnerState { owners: 3, resident: true });
        assert_eq!(owners.remove_owners(7, 1), Some(OwnerState { owners: 2, resident: true }));
        assert_eq!(owners.remove_owners(7, 5), Some(OwnerState { owners: 0, resident: true }));
        assert_eq!(owners.get(7), None);
        assert_eq!(owners.remove_owners(7, 1), None);
        assert_eq!(
            owners.add_owners(8, OWNERS_MAX),
            OwnerState { owners: OWNERS_MAX, resident: false }
        );
    }

    /// Whether hashbrown uses 16-byte control groups here, where the weighed growth is exact.
    const WIDE_GROUPS: bool =
        cfg!(all(any(target_arch = "x86", target_arch = "x86_64"), target_feature = "sse2"));

    fn assert_weighed(table: &str, step: usize, weighed: usize, allocated: usize) {
        assert!(
            allocated <= weighed,
            "{table} step {step}: {allocated} allocated, {weighed} weighed"
        );
        if WIDE_GROUPS {
            assert_eq!(allocated, weighed, "{table} step {step}");
        }
    }

    /// Reservations of every size, with removals between them leaving deleted entries behind:
    /// the weighed allocation is what hashbrown then allocates (never less on any backend).
    #[test]
    fn growth_is_weighed_before_it_allocates() {
        let mut rng = rng_from_seed(3);
        let mut lineage = LineageTable::new(test_key());
        let mut owners = OwnerTable::new(test_key());
        let mut live: Vec<u64> = Vec::new();
        let mut next = 0u64;
        let mut grew = 0;
        for step in 0..2_000 {
            let additional = match rng.next_u32() % 8 {
                0 => 0,
                1 => (rng.next_u32() % 2_048) as usize,
                _ => (rng.next_u32() % 48) as usize,
            };
            let before = lineage.allocation_bytes();
            let weighed = lineage.bytes_after_reserve(additional).expect("representable");
            assert!(lineage.try_reserve(additional));
            assert_weighed("lineage", step, weighed, lineage.allocation_bytes());
            grew += usize::from(lineage.allocation_bytes() != before);
            let weighed = owners.bytes_after_reserve(additional).expect("representable");
            assert!(owners.try_reserve(additional));
            assert_weighed("owners", step, weighed, owners.allocation_bytes());
            for _ in 0..additional {
                next += 1;
                lineage.insert_new(next, next);
                owners.add_owners(next, 1);
                live.push(next);
            }
            // Remove up to half of a step's worth, from anywhere: deleted entries stay behind.
            for _ in 0..(rng.next_u32() % 40) {
                if live.is_empty() {
                    break;
                }
                let gone = live.swap_remove((rng.next_u32() as usize) % live.len());
                assert_eq!(lineage.remove(gone), Some(gone));
                assert!(owners.remove_owners(gone, 1).is_some());
            }
        }
        assert!(grew >= 10, "the tables grew {grew} times");
        // A full table: adding owners to hashes it holds allocates nothing.
        let mut full = OwnerTable::new(test_key());
        assert!(full.try_reserve(7));
        let (bytes, capacity) = (full.allocation_bytes(), full.table.live_capacity());
        for canonical in 1..=capacity as u64 {
            full.add_owners(canonical, 1);
        }
        for canonical in 1..=capacity as u64 {
            assert_eq!(full.add_owners(canonical, 2), OwnerState { owners: 3, resident: false });
        }
        assert_eq!(full.allocation_bytes(), bytes, "an owner added to a held hash grew the table");
        assert!(lineage.allocation_bytes() > 1 << 20, "the tables reached a realistic size");
    }

    /// Every first reservation of a small table (the fixed bucket counts below 16 and their
    /// capacities) is weighed exactly.
    #[test]
    fn small_tables_are_weighed_exactly() {
        for additional in 1..=64 {
            let mut lineage = LineageTable::new(test_key());
            assert!(lineage.is_empty());
            let weighed = lineage.bytes_after_reserve(additional).expect("representable");
            assert!(lineage.try_reserve(additional));
            assert_weighed("small lineage", additional, weighed, lineage.allocation_bytes());
            let mut owners = OwnerTable::new(test_key());
            let weighed = owners.bytes_after_reserve(additional).expect("representable");
            assert!(owners.try_reserve(additional));
            assert_weighed("small owners", additional, weighed, owners.allocation_bytes());
        }
    }

    /// A table whose room was taken by deleted entries rehashes in place when the reservation
    /// fits in half its capacity, and grows when it needs one item more: both weighed exactly.
    #[test]
    fn a_reservation_into_deleted_room_is_weighed_at_the_half_capacity_edge() {
        for first in [20, 100, 400] {
            for over_half in [0, 1] {
                let mut lineage = LineageTable::new(test_key());
                assert!(lineage.try_reserve(first));
                let full = lineage.table.live_capacity();
                for id in 0..full as u64 {
                    lineage.insert_new(id, id);
                }
                assert!(!lineage.is_empty());
                for id in 4..full as u64 {
                    assert_eq!(lineage.remove(id), Some(id));
                }
                let bytes = lineage.allocation_bytes();
                let additional = full / 2 - lineage.len() + over_half;
                let weighed = lineage.bytes_after_reserve(additional).expect("representable");
                assert_eq!(weighed == bytes, over_half == 0, "table of {full}, +{over_half}");
                assert!(lineage.try_reserve(additional));
                assert_weighed("rehashed lineage", full, weighed, lineage.allocation_bytes());
            }
        }
    }

    #[test]
    fn an_impossible_reservation_weighs_as_unrepresentable() {
        let lineage = LineageTable::new(test_key());
        assert_eq!(lineage.bytes_after_reserve(usize::MAX / 2), None);
        assert_eq!(lineage.bytes_after_reserve(0), Some(0), "an empty table allocates nothing");
    }

    #[test]
    fn lineage_maps_external_ids() {
        let mut lineage = LineageTable::new(test_key());
        lineage.insert_new(1, 100);
        lineage.insert_new(2, 200);
        assert_eq!(lineage.get(1), Some(100));
        assert_eq!(lineage.remove(1), Some(100));
        assert_eq!(lineage.remove(1), None);
        assert_eq!(lineage.len(), 1);
    }
}
