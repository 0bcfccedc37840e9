//! The mutable producer filter: insertion with bounded kicks and full rollback, removal, and the
//! publication baseline (which buckets changed since they were last published).

use rand_core::Rng;
use thiserror::Error;

use super::BucketImage;
use super::addressing::{Addressing, Probe, find_slot, first_empty_slot, slot_of, with_slot};
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
/// - a bucket is in `dirty` exactly when its bit is set in `dirty_flags`, and its recorded word
///   is the value it had when last published (the publication baseline);
/// - a failed insertion leaves words, occupancy and the baseline untouched.
#[derive(Debug, Clone)]
pub struct CuckooFilter {
    format: CkfFormat,
    addressing: Addressing,
    words: Vec<u64>,
    occupied_slots: u64,
    max_kicks: u32,
    rng: RelayRng,
    dirty_flags: Vec<u64>,
    dirty: Vec<(u32, u64)>,
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
        Ok(CuckooFilter {
            addressing: Addressing::new(&format),
            format,
            words,
            occupied_slots: 0,
            max_kicks,
            rng,
            dirty_flags,
            dirty: Vec::new(),
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
        find_slot(self.words[probe.bucket_a as usize], probe.fingerprint).is_some()
            || find_slot(self.words[probe.bucket_b as usize], probe.fingerprint).is_some()
    }

    /// Insert one fingerprint for `hash`, relocating up to `max_kicks` others if both candidate
    /// buckets are full. On failure every relocation is rolled back.
    pub fn insert(&mut self, hash: u64) -> Result<(), CapacityExhausted> {
        let probe = self.addressing.probe(hash);
        if self.insert_at_home(probe) {
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
        self.insert_at_home(probe)
    }

    fn insert_at_home(&mut self, probe: Probe) -> bool {
        for bucket in [probe.bucket_a, probe.bucket_b] {
            let word = self.words[bucket as usize];
            if let Some(slot) = first_empty_slot(word) {
                self.words[bucket as usize] = with_slot(word, slot, probe.fingerprint);
                self.occupied_slots += 1;
                self.mark_dirty(bucket, word);
                return true;
            }
        }
        false
    }

    /// Remove one fingerprint of `hash`: the first matching slot of the home bucket, else of the
    /// alternate bucket.
    pub fn remove(&mut self, hash: u64) -> Result<(), FingerprintMissing> {
        let probe = self.addressing.probe(hash);
        for bucket in [probe.bucket_a, probe.bucket_b] {
            let word = self.words[bucket as usize];
            if let Some(slot) = find_slot(word, probe.fingerprint) {
                self.words[bucket as usize] = with_slot(word, slot, 0);
                self.occupied_slots -= 1;
                self.mark_dirty(bucket, word);
                return Ok(());
            }
        }
        Err(FingerprintMissing {
            fingerprint: probe.fingerprint,
            bucket_a: probe.bucket_a,
            bucket_b: probe.bucket_b,
        })
    }

    #[inline]
    fn mark_dirty(&mut self, bucket: u32, published_word: u64) {
        let flag = &mut self.dirty_flags[bucket as usize / 64];
        let bit = 1u64 << (bucket % 64);
        if *flag & bit == 0 {
            *flag |= bit;
            self.dirty.push((bucket, published_word));
        }
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
        let mut images = Vec::with_capacity(self.dirty.len());
        for &(bucket, published_word) in &self.dirty {
            self.dirty_flags[bucket as usize / 64] = 0;
            let word = self.words[bucket as usize];
            if word != published_word {
                images.push(BucketImage { bucket, word });
            }
        }
        self.dirty.clear();
        images.sort_unstable_by_key(|image| image.bucket);
        images
    }

    /// Make the current words the publication baseline without building any images (nobody
    /// holds a lease, so nothing is materialised).
    pub fn discard_publication(&mut self) {
        for &(bucket, _) in &self.dirty {
            self.dirty_flags[bucket as usize / 64] = 0;
        }
        self.dirty.clear();
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
}
