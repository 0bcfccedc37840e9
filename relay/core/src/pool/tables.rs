//! Compact hash tables of the exact ownership state.
//!
//! Keys are already hash-like (engine block ids, canonical sequence hashes), so a fixed folded
//! multiply is enough to spread them; it has no random state, so iteration order is the same on
//! every run with the same history. Entries are packed to keep the exact state small: a lineage
//! entry is 16 bytes and an owner entry 12 bytes.

use hashbrown::HashTable;

/// Spread a 64-bit key over the table: folded 128-bit multiply by an odd constant.
#[inline]
fn spread(key: u64) -> u64 {
    let product = u128::from(key) * 0x9E37_79B9_7F4A_7C15_u128;
    (product as u64) ^ ((product >> 64) as u64)
}

/// One source's engine vocabulary: external block id → canonical sequence hash.
#[derive(Debug, Clone, Default)]
pub(crate) struct LineageTable {
    table: HashTable<(u64, u64)>,
}

impl LineageTable {
    #[inline]
    pub(crate) fn get(&self, external: u64) -> Option<u64> {
        self.table.find(spread(external), |entry| entry.0 == external).map(|entry| entry.1)
    }

    /// Insert a mapping the caller has checked is absent.
    #[inline]
    pub(crate) fn insert_new(&mut self, external: u64, canonical: u64) {
        debug_assert!(self.get(external).is_none());
        self.table.insert_unique(spread(external), (external, canonical), |entry| spread(entry.0));
    }

    #[inline]
    pub(crate) fn remove(&mut self, external: u64) -> Option<u64> {
        match self.table.find_entry(spread(external), |entry| entry.0 == external) {
            Ok(occupied) => Some(occupied.remove().0.1),
            Err(_) => None,
        }
    }

    pub(crate) fn try_reserve(&mut self, additional: usize) -> bool {
        self.table.try_reserve(additional, |entry| spread(entry.0)).is_ok()
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
        self.table.allocation_size()
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
#[derive(Debug, Clone, Default)]
pub(crate) struct OwnerTable {
    table: HashTable<OwnerEntry>,
}

impl OwnerTable {
    #[inline]
    pub(crate) fn get(&self, canonical: u64) -> Option<OwnerState> {
        let key = canonical;
        self.table.find(spread(key), |entry| ({ entry.canonical }) == key).map(|e| e.owner_state())
    }

    /// Add `added` owners (the caller checked the sum stays within [`OWNERS_MAX`]); returns the
    /// state after the addition.
    #[inline]
    pub(crate) fn add_owners(&mut self, canonical: u64, added: u32) -> OwnerState {
        let key = canonical;
        let entry = self
            .table
            .entry(
                spread(key),
                |entry| ({ entry.canonical }) == key,
                |entry| spread(entry.canonical),
            )
            .or_insert(OwnerEntry { canonical, state: 0 });
        let entry = entry.into_mut();
        let state = entry.state;
        debug_assert!((state & OWNERS_MAX) + added <= OWNERS_MAX);
        entry.state = state + added;
        entry.owner_state()
    }

    /// Remove `removed` owners, at most as many as there are; returns the state after removal
    /// (owners 0 means the entry is gone), or `None` if the canonical hash had no owner.
    pub(crate) fn remove_owners(&mut self, canonical: u64, removed: u32) -> Option<OwnerState> {
        let key = canonical;
        let mut occupied =
            self.table.find_entry(spread(key), |entry| ({ entry.canonical }) == key).ok()?;
        let before = occupied.get().owner_state();
        let owners = before.owners.saturating_sub(removed);
        if owners == 0 {
            occupied.remove();
            return Some(OwnerState { owners: 0, resident: before.resident });
        }
        let entry = occupied.get_mut();
        entry.state = owners | if before.resident { RESIDENT_BIT } else { 0 };
        Some(OwnerState { owners, resident: before.resident })
    }

    /// Record whether an owned canonical hash is resident.
    #[inline]
    pub(crate) fn set_resident(&mut self, canonical: u64, resident: bool) {
        let key = canonical;
        if let Some(entry) = self.table.find_mut(spread(key), |entry| ({ entry.canonical }) == key)
        {
            let state = entry.state;
            entry.state = if resident { state | RESIDENT_BIT } else { state & OWNERS_MAX };
        }
    }

    pub(crate) fn try_reserve(&mut self, additional: usize) -> bool {
        self.table.try_reserve(additional, |entry| spread(entry.canonical)).is_ok()
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// `(canonical, state)` in table order (deterministic for a given history).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, OwnerState)> + '_ {
        self.table.iter().map(|entry| (entry.canonical, entry.owner_state()))
    }

    pub(crate) fn allocation_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_entries_are_twelve_bytes() {
        assert_eq!(std::mem::size_of::<OwnerEntry>(), 12);
    }

    #[test]
    fn owner_counts_and_residency_are_independent() {
        let mut owners = OwnerTable::default();
        assert_eq!(owners.add_owners(7, 1), OwnerState { owners: 1, resident: false });
        owners.set_resident(7, true);
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

    #[test]
    fn lineage_maps_external_ids() {
        let mut lineage = LineageTable::default();
        lineage.insert_new(1, 100);
        lineage.insert_new(2, 200);
        assert_eq!(lineage.get(1), Some(100));
        assert_eq!(lineage.remove(1), Some(100));
        assert_eq!(lineage.remove(1), None);
        assert_eq!(lineage.len(), 1);
    }
}
