//! The mutable producer filter: insertion with bounded kicks and full rollback, removal, and the
//! publication baseline (which buckets changed since they were last published).

use rand_core::Rng;
use thiserror::Error;

use super::BucketImage;
use super::addressing::{
    Addressing, Probe, find_slot, first_empty_slot, slot_of, with_slot, word_contains,
};
use super::format::{CkfFormat, CkfFormatError, MAX_KICKS_LIMIT};
use crate::rng::{RelayRng, rng_from_seed};

/// Insertion gave up after `max_kicks` relocations; the filter is exactly as before the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("cuckoo filter capacity exhausted after bounded relocation")]
pub struct CapacityExhausted;

/// Removal found no slot holding the hash's fingerprint in either candidate bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("fingerprint {fingerprint:#06x} not found in bucket {bucket_a} or {bucket_b}")]
pub struct FingerprintMissing {
    /// The fingerprint looked for.
    pub fingerprint: u16,
    /// First candidate bucket.
    pub bucket_a: u32,
    /// Second candidate bucket.
    pub bucket_b: u32,
}

/// Building a filter failed before anything was allocated or while reserving memory.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CkfAllocationError {
    /// The format is not executable.
    #[error(transparent)]
    Format(#[from] CkfFormatError),
    /// `max_kicks` is outside `1..=4096`.
    #[error("max kicks {0} outside 1..=4096")]
    MaxKicks(u32),
    /// The bucket words could not be reserved.
    #[error("could not reserve {bucket_count} bucket words")]
    OutOfMemory {
        /// Buckets requested.
        bucket_count: u64,
    },
}

/// A cuckoo filter of 16-bit fingerprints, four slots per `u64` bucket word.
///
/// Invariants:
/// - `words.len() == format.bucket_count`, and `occupied_slots` equals the number of nonzero
///   slots across all words;
/// - `dirty` logs exactly the buckets written since the last publication, each with the word it
///   had when last published (the publication baseline);
/// - a failed insertion leaves words, occupancy and the baseline untouched.
#[derive(Debug, Clone)]
pub struct CuckooFilter {
    format: CkfFormat,
    addressing: Addressing,
    words: Vec<u64>,
    occupied_slots: u64,
    max_kicks: u32,
    rng: RelayRng,
    dirty: DirtyLog,
    /// Scratch log of `(bucket, previous word)` for the insertion in progress.
    undo: Vec<(u32, u64)>,
}

impl CuckooFilter {
    /// An empty filter. `rng` supplies the kick choices.
    pub fn new(
        format: CkfFormat,
        max_kicks: u32,
        rng: RelayRng,
    ) -> Result<Self, CkfAllocationError> {
        format.validate()?;
        if !(1..=MAX_KICKS_LIMIT).contains(&max_kicks) {
            return Err(CkfAllocationError::MaxKicks(max_kicks));
        }
        let bucket_count = format.bucket_count;
        let words = zeroed_vec(bucket_count as usize)
            .ok_or(CkfAllocationError::OutOfMemory { bucket_count })?;
        let dirty_flags = zeroed_vec((bucket_count as usize).div_ceil(64))
            .ok_or(CkfAllocationError::OutOfMemory { bucket_count })?;
        let dirty = DirtyLog {
            flags: dirty_flags,
            from_empty: Vec::new(),
            from_empty_count: 0,
            from_word: Vec::new(),
            from_word_count: 0,
        };
        Ok(CuckooFilter {
            addressing: Addressing::new(&format),
            format,
            words,
            occupied_slots: 0,
            max_kicks,
            rng,
            dirty,
            undo: Vec::with_capacity(2 * max_kicks as usize + 2),
        })
    }

    /// An empty filter of the same format and kick bound, with a generator forked from this one.
    pub fn empty_like(&mut self) -> Result<Self, CkfAllocationError> {
        let fork = rng_from_seed(self.rng.next_u64());
        Self::new(self.format, self.max_kicks, fork)
    }

    /// The filter's format.
    #[must_use]
    pub fn format(&self) -> &CkfFormat {
        &self.format
    }

    /// The filter's addressing function.
    #[must_use]
    pub fn addressing(&self) -> &Addressing {
        &self.addressing
    }

    /// All bucket words, bucket 0 first.
    #[must_use]
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Number of occupied fingerprint slots.
    #[must_use]
    pub fn occupied_slots(&self) -> u64 {
        self.occupied_slots
    }

    /// Whether every word is zero.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.occupied_slots == 0
    }

    /// Whether `hash`'s fingerprint is in either candidate bucket (false positives possible).
    #[must_use]
    #[inline]
    pub fn contains(&self, hash: u64) -> bool {
        let probe = self.addressing.probe(hash);
        // Both words are loaded and tested without a branch on the first: a hit-or-miss branch
        // on a cache-missing load is unpredictable, and a mispredict would discard the
        // overlapping loads of the caller's next lookups.
        let word_a = self.words[probe.bucket_a as usize];
        let word_b = self.words[probe.bucket_b as usize];
        word_contains(word_a, probe.fingerprint) | word_contains(word_b, probe.fingerprint)
    }

    /// Start loading the home bucket word of every hash of `hashes` (one store's or removal's
    /// blocks), so that the inserts, removals and lookups of those hashes that follow find their
    /// words in cache: software prefetches, whose cache misses overlap and which retire at once
    /// ([`kvrelay_prefetch`]). Changes nothing.
    #[inline]
    pub fn warm(&self, hashes: impl IntoIterator<Item = u64>) {
        for hash in hashes {
            let (_, bucket) = self.addressing.home(hash);
            kvrelay_prefetch::prefetch(&self.words, bucket as usize);
        }
    }

    /// Insert one fingerprint for `hash`, relocating up to `max_kicks` others if both candidate
    /// buckets are full. On failure every relocation is rolled back.
    #[inline]
    pub fn insert(&mut self, hash: u64) -> Result<(), CapacityExhausted> {
        // The common case, inlined into the caller: the home bucket has an empty slot. The
        // alternate bucket is computed only when it does not.
        let (fingerprint, bucket_a) = self.addressing.home(hash);
        let word_a = self.words[bucket_a as usize];
        if let Some(slot) = first_empty_slot(word_a) {
            self.fill_empty_slot(bucket_a, word_a, slot, fingerprint);
            return Ok(());
        }
        let bucket_b = self.addressing.alternate(bucket_a, fingerprint);
        self.insert_away_from_home(Probe { fingerprint, bucket_a, bucket_b })
    }

    /// [`Self::insert`] once the home bucket is known to be full: the alternate bucket, then
    /// bounded kicks.
    #[inline(never)]
    fn insert_away_from_home(&mut self, probe: Probe) -> Result<(), CapacityExhausted> {
        let word_b = self.words[probe.bucket_b as usize];
        if let Some(slot) = first_empty_slot(word_b) {
            self.fill_empty_slot(probe.bucket_b, word_b, slot, probe.fingerprint);
            return Ok(());
        }
        self.undo.clear();
        let mut bucket = if self.rng.next_u32() & 1 == 0 { probe.bucket_a } else { probe.bucket_b };
        let mut fingerprint = probe.fingerprint;
        for _ in 0..self.max_kicks {
            let slot = (self.rng.next_u32() & 3) as usize;
            let word = self.words[bucket as usize];
            self.undo.push((bucket, word));
            let evicted = slot_of(word, slot);
            self.words[bucket as usize] = with_slot(word, slot, fingerprint);
            fingerprint = evicted;
            bucket = self.addressing.alternate(bucket, fingerprint);
            let word = self.words[bucket as usize];
            if let Some(empty) = first_empty_slot(word) {
                self.undo.push((bucket, word));
                self.words[bucket as usize] = with_slot(word, empty, fingerprint);
                self.occupied_slots += 1;
                for index in 0..self.undo.len() {
                    let (changed, previous) = self.undo[index];
                    self.mark_dirty(changed, previous);
                }
                return Ok(());
            }
        }
        while let Some((changed, previous)) = self.undo.pop() {
            self.words[changed as usize] = previous;
        }
        Err(CapacityExhausted)
    }

    /// Insert only into an empty slot of a candidate bucket, never relocating (re-offers).
    /// Returns whether the fingerprint was placed.
    pub fn insert_without_relocation(&mut self, hash: u64) -> bool {
        let probe = self.addressing.probe(hash);
        for bucket in [probe.bucket_a, probe.bucket_b] {
            let word = self.words[bucket as usize];
            if let Some(slot) = first_empty_slot(word) {
                self.fill_empty_slot(bucket, word, slot, probe.fingerprint);
                return true;
            }
        }
        false
    }

    /// Write `fingerprint` into `slot`, empty in `word`, the current word of `bucket`.
    #[inline]
    fn fill_empty_slot(&mut self, bucket: u32, word: u64, slot: usize, fingerprint: u16) {
        debug_assert_eq!(slot_of(word, slot), 0, "slot {slot} of bucket {bucket} is occupied");
        self.words[bucket as usize] = word | (u64::from(fingerprint) << (16 * slot));
        self.occupied_slots += 1;
        self.mark_dirty(bucket, word);
    }

    /// Remove one fingerprint of `hash`: the first matching slot of the home bucket, else of the
    /// alternate bucket.
    #[inline]
    pub fn remove(&mut self, hash: u64) -> Result<(), FingerprintMissing> {
        let (fingerprint, bucket_a) = self.addressing.home(hash);
        let word_a = self.words[bucket_a as usize];
        if let Some(slot) = find_slot(word_a, fingerprint) {
            self.clear_slot(bucket_a, word_a, slot);
            return Ok(());
        }
        let bucket_b = self.addressing.alternate(bucket_a, fingerprint);
        self.remove_away_from_home(Probe { fingerprint, bucket_a, bucket_b })
    }

    /// [`Self::remove`] once the home bucket is known not to hold the fingerprint.
    #[inline(never)]
    fn remove_away_from_home(&mut self, probe: Probe) -> Result<(), FingerprintMissing> {
        let word_b = self.words[probe.bucket_b as usize];
        if let Some(slot) = find_slot(word_b, probe.fingerprint) {
            self.clear_slot(probe.bucket_b, word_b, slot);
            return Ok(());
        }
        Err(FingerprintMissing {
            fingerprint: probe.fingerprint,
            bucket_a: probe.bucket_a,
            bucket_b: probe.bucket_b,
        })
    }

    /// Empty `slot`, occupied in `word`, the current word of `bucket`.
    #[inline]
    fn clear_slot(&mut self, bucket: u32, word: u64, slot: usize) {
        self.words[bucket as usize] = with_slot(word, slot, 0);
        self.occupied_slots -= 1;
        self.mark_dirty(bucket, word);
    }

    #[inline]
    fn mark_dirty(&mut self, bucket: u32, published_word: u64) {
        self.dirty.mark(bucket, published_word);
    }

    /// Whether any bucket was written since the last publication (it may have returned to its
    /// published value, in which case [`Self::take_publication`] yields nothing for it).
    #[must_use]
    pub fn has_unpublished_writes(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// The buckets whose word differs from its last published value, sorted by bucket, and
    /// the current words become the new publication baseline.
    pub fn take_publication(&mut self) -> Vec<BucketImage> {
        let mut images = self.dirty.drain_changed(&self.words);
        images.sort_unstable_by_key(|image| image.bucket);
        images
    }

    /// Make the current words the publication baseline without building any images (nobody
    /// holds a lease, so nothing is materialised).
    pub fn discard_publication(&mut self) {
        self.dirty.discard();
    }

    /// Adopt `rebuilt`'s words (same format) while keeping this filter's publication baseline, so
    /// the next publication carries exactly the buckets whose word differs from what was last
    /// published, including changes still pending from before the swap.
    ///
    /// # Panics
    /// If the formats differ (a caller bug: a rebuild always uses [`Self::empty_like`]).
    pub fn adopt_rebuilt(&mut self, rebuilt: CuckooFilter) {
        assert_eq!(self.format, rebuilt.format, "a rebuilt filter keeps its format");
        for index in 0..self.words.len() {
            let old = self.words[index];
            if old != rebuilt.words[index] {
                self.mark_dirty(index as u32, old);
            }
        }
        self.words = rebuilt.words;
        self.occupied_slots = rebuilt.occupied_slots;
        self.rng = rebuilt.rng;
    }
}

/// The buckets written since the last publication, each with its published word.
///
/// Invariants: a bucket is logged exactly when its bit is set in `flags`, exactly once:
/// in `from_empty[..from_empty_count]` if its published word was zero, else in
/// `from_word[..from_word_count]` with that word. Entries past the counts are scratch.
///
/// Two choices keep recording cheap while a table fills (a fresh or rebuilt filter):
/// - every mark writes its entry just past both logs and counts it only where it belongs, so
///   there is no branch on "already dirty?", a coin flip at that point;
/// - buckets that were empty when published, nearly all of them during a fill, go to a log of
///   4-byte bucket indices, a quarter of the memory (and first-touch page faults) of
///   `(bucket, word)` entries.
///
/// Bound: a bucket is logged at most once, and a log only doubles when full, so each log holds
/// at most `max(16, 2 * bucket_count)` entries.
#[derive(Debug, Clone)]
struct DirtyLog {
    /// One bit per bucket: set while the bucket is logged.
    flags: Vec<u64>,
    from_empty: Vec<u32>,
    from_empty_count: usize,
    from_word: Vec<(u32, u64)>,
    from_word_count: usize,
}

impl DirtyLog {
    /// Log `bucket`, whose word was `published_word`, unless it is logged already.
    #[inline]
    fn mark(&mut self, bucket: u32, published_word: u64) {
        let flag = &mut self.flags[bucket as usize / 64];
        let bit = 1u64 << (bucket % 64);
        let newly_dirty = *flag & bit == 0;
        *flag |= bit;
        let was_empty = published_word == 0;
        write_past_end(&mut self.from_empty, self.from_empty_count, bucket);
        write_past_end(&mut self.from_word, self.from_word_count, (bucket, published_word));
        self.from_empty_count += usize::from(newly_dirty & was_empty);
        self.from_word_count += usize::from(newly_dirty & !was_empty);
    }

    fn is_empty(&self) -> bool {
        self.from_empty_count == 0 && self.from_word_count == 0
    }

    /// Forget every logged bucket: the current words become the published ones.
    fn discard(&mut self) {
        let from_empty = self.from_empty[..self.from_empty_count].iter().copied();
        let from_word = self.from_word[..self.from_word_count].iter().map(|&(bucket, _)| bucket);
        for bucket in from_empty.chain(from_word) {
            self.flags[bucket as usize / 64] = 0;
        }
        self.from_empty_count = 0;
        self.from_word_count = 0;
    }

    /// Images of the logged buckets whose word in `words` differs from the published one
    /// (unsorted), emptying the log.
    fn drain_changed(&mut self, words: &[u64]) -> Vec<BucketImage> {
        let mut images = Vec::with_capacity(self.from_empty_count + self.from_word_count);
        let from_empty = self.from_empty[..self.from_empty_count].iter().map(|&b| (b, 0));
        let from_word = self.from_word[..self.from_word_count].iter().copied();
        for (bucket, published_word) in from_empty.chain(from_word) {
            self.flags[bucket as usize / 64] = 0;
            let word = words[bucket as usize];
            if word != published_word {
                images.push(BucketImage { bucket, word });
            }
        }
        self.from_empty_count = 0;
        self.from_word_count = 0;
        images
    }
}

/// Write `entry` at `log[count]`, doubling the log (at least 16 entries) if it is full.
#[inline]
fn write_past_end<T: Copy + Default>(log: &mut Vec<T>, count: usize, entry: T) {
    match log.get_mut(count) {
        Some(slot) => *slot = entry,
        None => grow_and_write(log, count, entry),
    }
}

/// The rare full case of [`write_past_end`].
#[cold]
#[inline(never)]
fn grow_and_write<T: Copy + Default>(log: &mut Vec<T>, count: usize, entry: T) {
    let room = (2 * log.len()).max(16);
    log.resize(room, T::default());
    log[count] = entry;
}

/// A zeroed vector of `len` words, or `None` if the memory cannot be reserved.
fn zeroed_vec(len: usize) -> Option<Vec<u64>> {
    let mut words = Vec::new();
    words.try_reserve_exact(len).ok()?;
    words.resize(len, 0);
    Some(words)
}

#[cfg(test)]
mod tests {
    use super::super::format::{DEFAULT_SEED, MAX_KICKS_DEFAULT};
    use super::*;

    fn filter(bucket_count: u64, seed: u64) -> CuckooFilter {
        CuckooFilter::new(
            CkfFormat::v1(DEFAULT_SEED, bucket_count),
            MAX_KICKS_DEFAULT,
            rng_from_seed(seed),
        )
        .expect("valid filter")
    }

    #[test]
    fn inserted_hashes_are_found_and_removed() {
        let mut f = filter(1024, 1);
        for hash in 0..2000u64 {
            f.insert(hash).expect("room");
        }
        assert_eq!(f.occupied_slots(), 2000);
        for hash in 0..2000u64 {
            assert!(f.contains(hash), "hash {hash}");
        }
        for hash in 0..2000u64 {
            f.remove(hash).expect("present");
        }
        assert!(f.is_empty());
        assert!(f.words().iter().all(|&w| w == 0));
    }

    #[test]
    fn warming_changes_nothing_and_the_warmed_inserts_match_cold_ones() {
        let (mut warmed, mut cold) = (filter(1024, 3), filter(1024, 3));
        for store in (0..3000u64).collect::<Vec<_>>().chunks(16) {
            let before = (warmed.words().to_vec(), warmed.occupied_slots());
            warmed.warm(store.iter().copied());
            assert_eq!((warmed.words().to_vec(), warmed.occupied_slots()), before);
            for &hash in store {
                assert_eq!(warmed.insert(hash).is_ok(), cold.insert(hash).is_ok());
            }
        }
        assert_eq!(warmed.words(), cold.words());
        assert_eq!(warmed.take_publication(), cold.take_publication());
    }

    #[test]
    fn first_empty_slot_of_the_home_bucket_is_used_first() {
        let mut f = filter(524_288, 1);
        f.insert(0x0123_4567_89ab_cdef).unwrap();
        assert_eq!(f.words()[236_423], 0x7d61);
        f.insert(0x0123_4567_89ab_cdef).unwrap();
        assert_eq!(f.words()[236_423], 0x7d61_7d61);
    }

    #[test]
    fn full_filter_reports_capacity_exhaustion_and_rolls_back_every_kick() {
        let mut f = filter(2, 9);
        for hash in 0..8u64 {
            f.insert(hash).expect("eight slots");
        }
        let before = f.words().to_vec();
        let published_before = f.clone().take_publication();
        for hash in 100..120u64 {
            assert_eq!(f.insert(hash), Err(CapacityExhausted));
            assert_eq!(f.words(), &before[..]);
        }
        assert_eq!(f.occupied_slots(), 8);
        assert_eq!(f.take_publication(), published_before);
    }

    #[test]
    fn relocation_free_insert_only_uses_home_buckets() {
        let mut f = filter(2, 3);
        for hash in 0..8u64 {
            assert!(f.insert_without_relocation(hash));
        }
        assert!(!f.insert_without_relocation(8));
        f.remove(0).unwrap();
        assert!(f.insert_without_relocation(8));
    }

    #[test]
    fn removing_a_missing_fingerprint_is_an_error_and_changes_nothing() {
        let mut f = filter(64, 1);
        f.insert(5).unwrap();
        let before = f.words().to_vec();
        let probe = f.addressing().probe(6);
        assert_eq!(
            f.remove(6),
            Err(FingerprintMissing {
                fingerprint: probe.fingerprint,
                bucket_a: probe.bucket_a,
                bucket_b: probe.bucket_b
            })
        );
        assert_eq!(f.words(), &before[..]);
    }

    #[test]
    fn publication_suppresses_buckets_that_returned_to_their_published_word() {
        let mut f = filter(64, 1);
        f.insert(5).unwrap();
        let first = f.take_publication();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].word, f.words()[first[0].bucket as usize]);
        f.insert(6).unwrap();
        f.remove(6).unwrap();
        assert!(f.has_unpublished_writes());
        assert!(f.take_publication().is_empty());
        f.remove(5).unwrap();
        // A final removal is an absolute zero image.
        assert_eq!(f.take_publication(), vec![BucketImage { bucket: first[0].bucket, word: 0 }]);
    }

    #[test]
    fn publication_images_rebuild_the_words() {
        let mut f = filter(256, 4);
        let mut mirror = vec![0u64; 256];
        for round in 0..20u64 {
            for hash in round * 50..round * 50 + 40 {
                let _ = f.insert(hash);
            }
            for hash in round * 50..round * 50 + 20 {
                let _ = f.remove(hash);
            }
            for image in f.take_publication() {
                mirror[image.bucket as usize] = image.word;
            }
            assert_eq!(mirror, f.words());
        }
    }

    #[test]
    fn adopting_a_rebuild_publishes_the_difference_from_the_published_words() {
        let mut f = filter(64, 1);
        for hash in 0..10 {
            f.insert(hash).unwrap();
        }
        let mut mirror = vec![0u64; 64];
        for image in f.take_publication() {
            mirror[image.bucket as usize] = image.word;
        }
        f.insert(10).unwrap(); // pending, unpublished
        let mut rebuilt = f.empty_like().unwrap();
        for hash in 5..12 {
            rebuilt.insert(hash).unwrap();
        }
        f.adopt_rebuilt(rebuilt);
        for image in f.take_publication() {
            mirror[image.bucket as usize] = image.word;
        }
        assert_eq!(mirror, f.words());
        for hash in 5..12 {
            assert!(f.contains(hash));
        }
        assert_eq!(f.occupied_slots(), 7);
    }

    #[test]
    fn invalid_configuration_is_rejected() {
        let rng = rng_from_seed(1);
        assert_eq!(
            CuckooFilter::new(CkfFormat::v1(1, 3), 500, rng.clone()).unwrap_err(),
            CkfAllocationError::Format(CkfFormatError::BucketCount(3))
        );
        assert_eq!(
            CuckooFilter::new(CkfFormat::v1(1, 4), 0, rng.clone()).unwrap_err(),
            CkfAllocationError::MaxKicks(0)
        );
        assert_eq!(
            CuckooFilter::new(CkfFormat::v1(1, 4), 4097, rng).unwrap_err(),
            CkfAllocationError::MaxKicks(4097)
        );
    }

    /// The insertion and removal of relay-facts §4.3, written slot by slot with no shortcuts:
    /// the reference the optimised filter must match word for word.
    struct SpecFilter {
        addressing: Addressing,
        words: Vec<u64>,
        max_kicks: u32,
        rng: RelayRng,
    }

    impl SpecFilter {
        fn new(bucket_count: u64, max_kicks: u32, rng_seed: u64) -> Self {
            SpecFilter {
                addressing: Addressing::new(&CkfFormat::v1(DEFAULT_SEED, bucket_count)),
                words: vec![0; bucket_count as usize],
                max_kicks,
                rng: rng_from_seed(rng_seed),
            }
        }

        fn empty_slot(word: u64) -> Option<usize> {
            (0..4).find(|&slot| slot_of(word, slot) == 0)
        }

        fn insert(&mut self, hash: u64) -> bool {
            let probe = self.addressing.probe(hash);
            for bucket in [probe.bucket_a, probe.bucket_b] {
                let word = self.words[bucket as usize];
                if let Some(slot) = Self::empty_slot(word) {
                    self.words[bucket as usize] = with_slot(word, slot, probe.fingerprint);
                    return true;
                }
            }
            let before = self.words.clone();
            let mut bucket =
                if self.rng.next_u32() & 1 == 0 { probe.bucket_a } else { probe.bucket_b };
            let mut fingerprint = probe.fingerprint;
            for _ in 0..self.max_kicks {
                let slot = (self.rng.next_u32() & 3) as usize;
                let word = self.words[bucket as usize];
                self.words[bucket as usize] = with_slot(word, slot, fingerprint);
                fingerprint = slot_of(word, slot);
                bucket = self.addressing.alternate(bucket, fingerprint);
                let word = self.words[bucket as usize];
                if let Some(empty) = Self::empty_slot(word) {
                    self.words[bucket as usize] = with_slot(word, empty, fingerprint);
                    return true;
                }
            }
            self.words = before;
            false
        }

        fn remove(&mut self, hash: u64) -> bool {
            let probe = self.addressing.probe(hash);
            for bucket in [probe.bucket_a, probe.bucket_b] {
                let word = self.words[bucket as usize];
                if let Some(slot) = (0..4).find(|&slot| slot_of(word, slot) == probe.fingerprint) {
                    self.words[bucket as usize] = with_slot(word, slot, 0);
                    return true;
                }
            }
            false
        }

        fn contains(&self, hash: u64) -> bool {
            let probe = self.addressing.probe(hash);
            [probe.bucket_a, probe.bucket_b].into_iter().any(|bucket| {
                (0..4).any(|slot| slot_of(self.words[bucket as usize], slot) == probe.fingerprint)
            })
        }
    }

    #[test]
    fn filter_matches_the_slot_by_slot_specification_word_for_word() {
        for (bucket_count, max_kicks, rng_seed) in [(2, 500, 1), (16, 20, 2), (64, 500, 3)] {
            let mut f = filter_with_kicks(bucket_count, max_kicks, rng_seed);
            let mut spec = SpecFilter::new(bucket_count, max_kicks, rng_seed);
            let mut ops = rng_from_seed(rng_seed ^ 0xface);
            let slots = 4 * bucket_count;
            let mut mirror = vec![0u64; bucket_count as usize];
            for step in 0..20 * slots {
                // Mostly insertions, so the table runs full and kicks and rollbacks happen;
                // hashes come from a small range, so duplicates and removals of absent ones too.
                let hash = u64::from(ops.next_u32()) % (2 * slots);
                if ops.next_u32().is_multiple_of(3) {
                    assert_eq!(f.remove(hash).is_ok(), spec.remove(hash), "step {step}");
                } else {
                    assert_eq!(f.insert(hash).is_ok(), spec.insert(hash), "step {step}");
                }
                assert_eq!(f.words(), &spec.words[..], "step {step}");
                let occupied: u32 = spec
                    .words
                    .iter()
                    .map(|&w| (0..4).filter(|&slot| slot_of(w, slot) != 0).count() as u32)
                    .sum();
                assert_eq!(f.occupied_slots(), u64::from(occupied), "step {step}");
                if step % 7 == 6 {
                    // Publications carry exactly the buckets that now differ from the mirror
                    // (the last published words), in bucket order.
                    let images = f.take_publication();
                    let changed: Vec<u32> = (0..bucket_count as u32)
                        .filter(|&b| mirror[b as usize] != spec.words[b as usize])
                        .collect();
                    let buckets: Vec<u32> = images.iter().map(|image| image.bucket).collect();
                    assert_eq!(buckets, changed, "step {step}");
                    for image in images {
                        mirror[image.bucket as usize] = image.word;
                    }
                    assert!(!f.has_unpublished_writes());
                }
            }
            for image in f.take_publication() {
                mirror[image.bucket as usize] = image.word;
            }
            assert_eq!(mirror, spec.words);
            for hash in 0..4 * slots {
                assert_eq!(f.contains(hash), spec.contains(hash), "hash {hash}");
            }
        }
    }

    fn filter_with_kicks(bucket_count: u64, max_kicks: u32, seed: u64) -> CuckooFilter {
        CuckooFilter::new(CkfFormat::v1(DEFAULT_SEED, bucket_count), max_kicks, rng_from_seed(seed))
            .expect("valid filter")
    }
}
