//! A keyed hash table whose large growths never pause: the exact state's storage.
//!
//! hashbrown grows a full table by moving every entry into a new allocation in one call (or by
//! rehashing it in place when deleted entries took its room). For the millions of blocks a pool
//! can hold that is a pause of a tenth of a second or more on the relay's single loop, long
//! enough for the event plane's bounded buffer to overflow and a rank to lose events.
//!
//! [`GrowingTable`] grows a small table the same way, but a table of at least
//! [`INCREMENTAL_GROWTH_MIN_BUCKETS`] buckets moves into its new allocation gradually: the new
//! table takes every insertion, the old one is *draining*, and every insertion or removal moves
//! the entries of [`MIGRATION_BUCKETS_PER_STEP`] more of its buckets across. Invariants
//! ([`GrowingTable::check`]):
//!
//! - a key is in at most one of the two tables;
//! - the new table has room for every entry still draining, so a move never allocates;
//! - the draining table's buckets before its cursor are empty.
//!
//! The new table is sized when the growth starts so that the old one is empty long before the
//! new one could fill: growing from `b` buckets leaves room for at least `7b/16` insertions
//! while the old table needs `b / MIGRATION_BUCKETS_PER_STEP` steps. A reservation that would
//! not fit anyway finishes the draining first, in one call.
//!
//! Growth is weighed before it happens ([`GrowingTable::bytes_after_reserve`]): what the
//! table's allocations would be after reserving room for more entries, from its current
//! allocations, capacity and length alone, counting both tables while one drains. The answer
//! is never below what is then allocated (equal on backends with 16-byte control groups), so a
//! caller that checks it against a budget before reserving never passes the budget. Freeing the
//! drained table is left to [`GrowingTable::settle`], so the owner of a byte count sees every
//! change of the allocation.

use hashbrown::HashTable;

use super::tables::TableKey;

/// Tables with at least this many buckets grow gradually; a smaller table is moved in one
/// call, which takes about a millisecond at this size.
pub(crate) const INCREMENTAL_GROWTH_MIN_BUCKETS: usize = 1 << 16;

/// Buckets of the draining table moved per insertion or removal.
pub(crate) const MIGRATION_BUCKETS_PER_STEP: usize = 32;

/// An entry of a keyed table: the 64-bit key it is found by.
pub(crate) trait Keyed: Copy {
    fn key(&self) -> u64;
}

/// Hashbrown's table layout (0.17), mirrored so that growth can be weighed before it allocates.
///
/// A table has a power-of-two number of buckets; it holds at most 7/8 of them (all but one below
/// 8 buckets), and a reservation that does not fit either rehashes in place (when at most half
/// the full capacity would be used: the room was taken by deleted entries) or moves to the
/// smallest bucket count holding `max(len + additional, full capacity + 1)` items. The
/// allocation is the entries, padded to the control bytes' alignment, then one control byte per
/// bucket and one trailing group of control bytes. The tables' tests hold this against the
/// hashbrown the crate builds with.
mod layout {
    /// The widest control group of any hashbrown backend (SSE2 and LSX 16 bytes, NEON and the
    /// portable one 8 or less): both the control bytes' alignment and the trailing group are at
    /// most this, so an allocation weighed with it is never below the real one.
    const GROUP_BYTES_MAX: usize = 16;

    /// Buckets of a table allocated to hold `items` (at least 1); `None` on overflow.
    pub(super) fn buckets_for(items: usize) -> Option<usize> {
        match items {
            0..4 => Some(4),
            4..8 => Some(8),
            _ => (items.checked_mul(8)? / 7).checked_next_power_of_two(),
        }
    }

    /// Items a table of `buckets` buckets holds before it must grow.
    pub(super) fn full_capacity(buckets: usize) -> usize {
        if buckets <= 8 { buckets.saturating_sub(1) } else { buckets / 8 * 7 }
    }

    /// Bytes allocated for `buckets` buckets of `entry_bytes`; `None` on overflow.
    pub(super) fn allocation_bytes(entry_bytes: usize, buckets: usize) -> Option<usize> {
        let entries =
            entry_bytes.checked_mul(buckets)?.checked_next_multiple_of(GROUP_BYTES_MAX)?;
        entries.checked_add(buckets)?.checked_add(GROUP_BYTES_MAX)
    }

    /// The bucket count behind an allocation of `bytes` (0 for none). An allocation of `b`
    /// buckets is `b * (entry_bytes + 1)` plus under `2 * GROUP_BYTES_MAX` bytes of padding and
    /// trailing group, which is less than another `b * (entry_bytes + 1)` for every table that
    /// allocates (at least 4 buckets of at least 8-byte entries), so rounding the quotient down
    /// to a power of two recovers `b` on every backend.
    fn buckets_of(entry_bytes: usize, bytes: usize) -> usize {
        match bytes / (entry_bytes + 1) {
            0 => 0,
            quotient => 1 << quotient.ilog2(),
        }
    }

    /// The allocation of a table of `entry_bytes` entries, now allocating `bytes` with room for
    /// `capacity` entries of which `len` are used, after reserving room for `additional` more
    /// in one call; `None` when the size overflows.
    pub(super) fn bytes_after_reserve(
        entry_bytes: usize,
        bytes: usize,
        capacity: usize,
        len: usize,
        additional: usize,
    ) -> Option<usize> {
        if additional <= capacity.saturating_sub(len) {
            return Some(bytes);
        }
        let items = len.checked_add(additional)?;
        let full = full_capacity(buckets_of(entry_bytes, bytes));
        if bytes > 0 && items <= full / 2 {
            return Some(bytes);
        }
        allocation_bytes(entry_bytes, buckets_for(items.max(full + 1))?)
    }

    /// Items to size a fresh table for, taking over `buckets` buckets holding `items` items
    /// after the reservation: the same size when the room was taken by deleted entries (as an
    /// in-place rehash keeps it), else the size a growth in one call would take.
    pub(super) fn gradual_target(buckets: usize, items: usize) -> usize {
        let full = full_capacity(buckets);
        if items <= full / 2 { full } else { items.max(full + 1) }
    }
}

/// The table being emptied into its successor, and the next of its buckets to move.
#[derive(Debug, Clone)]
struct Draining<E> {
    table: HashTable<E>,
    cursor: usize,
}

/// A hash table of [`Keyed`] entries under a secret [`TableKey`], growing gradually once large
/// (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct GrowingTable<E> {
    key: TableKey,
    /// Takes every insertion.
    live: HashTable<E>,
    /// The previous table while its entries move into `live`.
    draining: Option<Draining<E>>,
}

impl<E: Keyed> GrowingTable<E> {
    pub(crate) fn new(key: TableKey) -> Self {
        GrowingTable { key, live: HashTable::new(), draining: None }
    }

    pub(crate) fn key(&self) -> TableKey {
        self.key
    }

    #[inline]
    fn hash(key: TableKey, entry: &E) -> u64 {
        key.spread(entry.key())
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&E> {
        let hash = self.key.spread(key);
        let found = self.live.find(hash, |entry| entry.key() == key);
        match (found, &self.draining) {
            (Some(entry), _) => Some(entry),
            (None, Some(draining)) => draining.table.find(hash, |entry| entry.key() == key),
            (None, None) => None,
        }
    }

    /// Look `keys` up without using the answers, so that the lookups and updates of those keys
    /// that follow find their control groups and entries in cache. The lookups do not depend
    /// on one another, so their cache misses overlap. Changes nothing.
    #[inline]
    pub(crate) fn warm(&self, keys: impl IntoIterator<Item = u64>) {
        let mut found = 0usize;
        for key in keys {
            found += usize::from(self.get(key).is_some());
        }
        std::hint::black_box(found);
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut E> {
        let hash = self.key.spread(key);
        if let Some(index) = self.live.find_bucket_index(hash, |entry| entry.key() == key) {
            return self.live.get_bucket_mut(index);
        }
        let draining = self.draining.as_mut()?;
        draining.table.find_mut(hash, |entry| entry.key() == key)
    }

    /// Insert an entry whose key the caller has checked is absent, into room it reserved (an
    /// insertion without reserved room grows the live table in one call).
    #[inline]
    pub(crate) fn insert_new(&mut self, entry: E) {
        debug_assert!(self.get(entry.key()).is_none());
        let key = self.key;
        self.live.insert_unique(Self::hash(key, &entry), entry, |entry| Self::hash(key, entry));
        self.migrate_step();
    }

    /// Remove the entry of `key`, if there is one.
    #[inline]
    pub(crate) fn remove(&mut self, key: u64) -> Option<E> {
        let hash = self.key.spread(key);
        let removed = match self.live.find_entry(hash, |entry| entry.key() == key) {
            Ok(occupied) => Some(occupied.remove().0),
            Err(_) => self.draining.as_mut().and_then(|draining| {
                let occupied = draining.table.find_entry(hash, |entry| entry.key() == key).ok()?;
                Some(occupied.remove().0)
            }),
        };
        self.migrate_step();
        removed
    }

    /// Change the entry of `key` in place, removing it when `keep` returns false; returns the
    /// entry as it was before, `None` when there is none.
    #[inline]
    pub(crate) fn update(&mut self, key: u64, keep: impl FnOnce(&mut E) -> bool) -> Option<E> {
        let hash = self.key.spread(key);
        let occupied = match self.live.find_entry(hash, |entry| entry.key() == key) {
            Ok(occupied) => occupied,
            Err(_) => {
                self.draining.as_mut()?.table.find_entry(hash, |entry| entry.key() == key).ok()?
            }
        };
        let mut occupied = occupied;
        let before = *occupied.get();
        if !keep(occupied.get_mut()) {
            occupied.remove();
            self.migrate_step();
        }
        Some(before)
    }

    /// Move the entries of the draining table's next [`MIGRATION_BUCKETS_PER_STEP`] buckets.
    #[inline]
    fn migrate_step(&mut self) {
        if let Some(draining) = &mut self.draining {
            Self::migrate(self.key, &mut self.live, draining, MIGRATION_BUCKETS_PER_STEP);
        }
    }

    fn migrate(key: TableKey, live: &mut HashTable<E>, draining: &mut Draining<E>, buckets: usize) {
        let end = draining.cursor.saturating_add(buckets).min(draining.table.num_buckets());
        for index in draining.cursor..end {
            if let Ok(occupied) = draining.table.get_bucket_entry(index) {
                let entry = occupied.remove().0;
                debug_assert!(live.capacity() > live.len(), "a move found no reserved room");
                live.insert_unique(Self::hash(key, &entry), entry, |entry| Self::hash(key, entry));
            }
        }
        draining.cursor = end;
    }

    /// Move everything still draining, in one call.
    fn finish_draining(&mut self) {
        if let Some(mut draining) = self.draining.take() {
            let rest = draining.table.num_buckets() - draining.cursor;
            Self::migrate(self.key, &mut self.live, &mut draining, rest);
            debug_assert!(draining.table.is_empty());
        }
    }

    /// Free the draining table once it is empty; returns the bytes freed.
    pub(crate) fn settle(&mut self) -> usize {
        match &self.draining {
            Some(draining) if draining.table.is_empty() => {
                let freed = draining.table.allocation_size();
                self.draining = None;
                freed
            }
            _ => 0,
        }
    }

    fn draining_len(&self) -> usize {
        self.draining.as_ref().map_or(0, |draining| draining.table.len())
    }

    /// Insertions the live table takes without allocating, beyond the entries still draining.
    fn room(&self) -> usize {
        (self.live.capacity() - self.live.len()).saturating_sub(self.draining_len())
    }

    /// Whether a reservation of `additional` starts a gradual growth (else it fits, or the live
    /// table is small and grows in one call).
    fn grows_gradually(&self, additional: usize) -> bool {
        additional > self.room()
            && (self.draining.is_some()
                || self.live.num_buckets() >= INCREMENTAL_GROWTH_MIN_BUCKETS)
    }

    /// Make room for `additional` insertions; false when memory could not be reserved (the
    /// entries are all still there).
    pub(crate) fn try_reserve(&mut self, additional: usize) -> bool {
        let key = self.key;
        if !self.grows_gradually(additional) {
            return self.live.try_reserve(additional, |entry| Self::hash(key, entry)).is_ok();
        }
        self.finish_draining();
        let Some(items) = self.live.len().checked_add(additional) else { return false };
        let target = layout::gradual_target(self.live.num_buckets(), items);
        let mut grown = HashTable::new();
        if grown.try_reserve(target, |entry| Self::hash(key, entry)).is_err() {
            return false;
        }
        let old = std::mem::replace(&mut self.live, grown);
        self.draining = Some(Draining { table: old, cursor: 0 });
        debug_assert!(self.room() >= additional);
        true
    }

    /// The allocation after [`GrowingTable::try_reserve`] of `additional` would succeed, at
    /// least what it would be; `None` when it could not be represented.
    pub(crate) fn bytes_after_reserve(&self, additional: usize) -> Option<usize> {
        let entry_bytes = size_of::<E>();
        if !self.grows_gradually(additional) {
            // Room for `additional` beside what drains, or no draining table at all.
            let draining = self.allocation_bytes() - self.live.allocation_size();
            return layout::bytes_after_reserve(
                entry_bytes,
                self.live.allocation_size(),
                self.live.capacity(),
                self.live.len(),
                additional,
            )?
            .checked_add(draining);
        }
        // The draining table is emptied and freed, the live one starts draining into a new one.
        let items = self.len().checked_add(additional)?;
        let target = layout::gradual_target(self.live.num_buckets(), items);
        let grown = layout::allocation_bytes(entry_bytes, layout::buckets_for(target)?)?;
        self.live.allocation_size().checked_add(grown)
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len() + self.draining_len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a gradual growth is under way.
    #[cfg(test)]
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.is_some()
    }

    /// Every entry, in table order (deterministic for a given history).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &E> + '_ {
        self.live.iter().chain(self.draining.iter().flat_map(|draining| draining.table.iter()))
    }

    /// Bytes both tables allocate.
    pub(crate) fn allocation_bytes(&self) -> usize {
        self.live.allocation_size()
            + self.draining.as_ref().map_or(0, |draining| draining.table.allocation_size())
    }

    /// Items the live table takes before it allocates (its capacity).
    #[cfg(test)]
    pub(crate) fn live_capacity(&self) -> usize {
        self.live.capacity()
    }

    /// The invariants of the module doc (O(entries draining)).
    pub(crate) fn check(&self) -> Result<(), String> {
        let Some(draining) = &self.draining else { return Ok(()) };
        if self.live.capacity() - self.live.len() < draining.table.len() {
            return Err(format!(
                "the live table has room for {} entries, {} still draining",
                self.live.capacity() - self.live.len(),
                draining.table.len()
            ));
        }
        for index in 0..draining.cursor.min(draining.table.num_buckets()) {
            if draining.table.get_bucket(index).is_some() {
                return Err(format!("draining bucket {index} is before the cursor but not empty"));
            }
        }
        for entry in draining.table.iter() {
            let key = entry.key();
            if self.live.find(self.key.spread(key), |live| live.key() == key).is_some() {
                return Err(format!("key {key:#x} is in both the live and the draining table"));
            }
        }
        Ok(())
    }

    /// Test access: insert straight into the draining table, bypassing every rule.
    #[cfg(test)]
    pub(crate) fn force_into_draining(&mut self, entry: E) {
        let key = self.key;
        if let Some(draining) = &mut self.draining {
            draining.table.insert_unique(Self::hash(key, &entry), entry, |e| Self::hash(key, e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::rng_from_seed;

    type Table = GrowingTable<(u64, u64)>;

    fn table() -> Table {
        GrowingTable::new(TableKey::from_rng(&rng_from_seed(5)))
    }

    /// Whether hashbrown uses 16-byte control groups here, where the weighed growth is exact.
    const WIDE_GROUPS: bool =
        cfg!(all(any(target_arch = "x86", target_arch = "x86_64"), target_feature = "sse2"));

    /// Reserve like the exact state does: weighed first, then reserved; the weight holds.
    fn reserve(table: &mut Table, additional: usize) {
        let weighed = table.bytes_after_reserve(additional).expect("representable");
        assert!(table.try_reserve(additional));
        let allocated = table.allocation_bytes();
        assert!(allocated <= weighed, "{allocated} allocated, {weighed} weighed");
        if WIDE_GROUPS {
            assert_eq!(allocated, weighed);
        }
    }

    /// Insert `count` new keys from `next` in reserved batches of 4, as stores of 4 blocks do.
    fn insert(table: &mut Table, next: &mut u64, count: usize) {
        for _ in 0..count.div_ceil(4) {
            reserve(table, 4);
            for _ in 0..4 {
                *next += 1;
                table.insert_new((*next, !*next));
            }
        }
    }

    /// Fill a table until a reservation starts a gradual growth; returns the next key.
    fn fill_until_growth(table: &mut Table) -> u64 {
        let mut next = 0;
        while !table.is_draining() {
            insert(table, &mut next, 4);
            assert!(next < 1 << 20, "no gradual growth started");
        }
        next
    }

    #[test]
    fn a_large_table_grows_without_moving_its_entries_at_once() {
        let mut table = table();
        let mut next = 0u64;
        // Below the threshold a growth moves everything in the reserving call.
        insert(&mut table, &mut next, 1_000);
        assert!(!table.is_draining());
        next = 0;
        table = GrowingTable::new(table.key());
        loop {
            let room = table.room();
            reserve(&mut table, 4);
            if table.is_draining() {
                // The reservation that started the growth moved nothing: every entry drains.
                assert!(room < 4);
                assert_eq!(table.live.len(), 0);
                assert_eq!(table.draining_len(), next as usize);
                assert!(table.live.num_buckets() >= 2 * INCREMENTAL_GROWTH_MIN_BUCKETS);
                break;
            }
            for _ in 0..4 {
                next += 1;
                table.insert_new((next, !next));
            }
        }
        let old_buckets = table.draining.as_ref().unwrap().table.num_buckets();
        let old_bytes = table.draining.as_ref().unwrap().table.allocation_size();
        let mut insertions = 0usize;
        while table.draining_len() > 0 {
            let draining = table.draining_len();
            next += 1;
            table.insert_new((next, !next));
            insertions += 1;
            assert!(draining - table.draining_len() <= MIGRATION_BUCKETS_PER_STEP);
            if insertions.is_multiple_of(4) {
                reserve(&mut table, 4);
            }
            if insertions.is_multiple_of(4_096) {
                table.check().unwrap();
                for key in (1..=next).step_by(97) {
                    assert_eq!(table.get(key), Some(&(key, !key)), "key {key} lost");
                }
            }
        }
        assert!(insertions <= old_buckets / MIGRATION_BUCKETS_PER_STEP, "{insertions} steps");
        table.check().unwrap();
        let before = table.allocation_bytes();
        assert_eq!(table.settle(), old_bytes);
        assert_eq!(table.allocation_bytes(), before - old_bytes);
        assert!(!table.is_draining());
        assert_eq!(table.len(), next as usize);
        for key in 1..=next {
            assert_eq!(table.get(key), Some(&(key, !key)), "key {key} lost");
        }
    }

    #[test]
    fn removals_alone_finish_a_growth_and_find_entries_in_either_table() {
        let mut table = table();
        let last = fill_until_growth(&mut table);
        // Entries inserted after the growth started are in the live table, the rest drain.
        let mut next = last;
        insert(&mut table, &mut next, 8);
        assert_eq!(table.remove(last + 1), Some((last + 1, !(last + 1))));
        assert_eq!(table.remove(1), Some((1, !1)));
        assert_eq!(table.remove(1), None);
        assert_eq!(
            table.update(2, |entry| {
                entry.1 = 7;
                true
            }),
            Some((2, !2))
        );
        assert_eq!(table.get(2), Some(&(2, 7)));
        assert_eq!(table.update(2, |_| false), Some((2, 7)));
        assert_eq!(table.get(2), None);
        let mut key = 3;
        while table.is_draining() && table.draining_len() > 0 {
            assert!(key <= next, "the table never finished draining");
            assert!(table.remove(key).is_some());
            key += 1;
        }
        assert!(table.settle() > 0);
        table.check().unwrap();
        assert_eq!(table.len(), (next - key + 1) as usize - 1);
        assert!(table.get(key).is_some() && table.get(key - 1).is_none());
    }

    #[test]
    fn a_reservation_larger_than_the_room_finishes_the_drain_first() {
        let mut table = table();
        let mut next = fill_until_growth(&mut table);
        insert(&mut table, &mut next, 64);
        assert!(table.draining_len() > 0);
        let huge = table.room() + 1;
        reserve(&mut table, huge);
        // The old draining table was emptied and freed; the previous live table drains now.
        table.check().unwrap();
        assert!(table.room() >= huge);
        assert_eq!(table.live.len(), 0);
        for key in 1..=next {
            assert_eq!(table.get(key), Some(&(key, !key)), "key {key} lost");
        }
    }

    /// A growth sizes the new table as a growth in one call would: the same buckets when at
    /// most half the full capacity is used (the room was taken by deleted entries, which an
    /// in-place rehash would reclaim), else the smallest holding one item more than full.
    #[test]
    fn a_gradual_growth_takes_the_size_a_growth_in_one_call_would() {
        let buckets = INCREMENTAL_GROWTH_MIN_BUCKETS;
        let full = buckets / 8 * 7;
        assert_eq!(layout::buckets_for(layout::gradual_target(buckets, full / 2)), Some(buckets));
        assert_eq!(layout::buckets_for(layout::gradual_target(buckets, 1)), Some(buckets));
        assert_eq!(
            layout::buckets_for(layout::gradual_target(buckets, full / 2 + 1)),
            Some(2 * buckets)
        );
        assert_eq!(
            layout::buckets_for(layout::gradual_target(buckets, 3 * full)),
            Some(4 * buckets)
        );
    }

    /// The check fires on a key held twice and on too little room for what drains.
    #[test]
    fn the_check_fires_on_a_key_in_both_tables() {
        let mut table = table();
        let next = fill_until_growth(&mut table);
        table.check().unwrap();
        let mut moved = table.clone();
        moved.insert_new((next + 1, 0));
        moved.force_into_draining((next + 1, 0));
        let error = moved.check().unwrap_err();
        assert!(error.contains("both") || error.contains("before the cursor"), "{error}");
        let mut crowded = table.clone();
        let room = crowded.room();
        for key in 0..=room as u64 {
            crowded.force_into_draining((u64::MAX - key, 0));
        }
        assert!(crowded.check().unwrap_err().contains("room"));
    }
}
