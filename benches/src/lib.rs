//! Shared workloads and filter adapters for the kvrelay criterion benchmarks.
//!
//! The bench files under `benches/` measure kvrelay's cuckoo filter (CKF) side by side with peer
//! filters under one workload. This crate holds what they share:
//!
//! - **Keys** ([`KeySet`], [`lookup_queries`]): a SplitMix64 stream over a fixed seed, never the
//!   OS RNG or the clock, so every run measures the very same keys. Present and absent keys are
//!   disjoint by construction.
//! - **Filters** ([`BenchFilter`]): one adapter per filter ([`Kvrelay`], [`Cuckoofilter`],
//!   [`Qfilter`]). Each is sized for the key count so that all of them hold the keys in the same
//!   number of slots, i.e. at the same load factor (see [`BenchFilter::slot_count`]).
//! - **Run mode** ([`is_bench_mode`], [`key_counts`]): `cargo bench` measures at
//!   [`BENCH_KEY_COUNTS`]; `cargo test --all-targets` runs each benchmark once at the small
//!   [`TEST_KEY_COUNTS`], so the test build checks the benches without a multi-minute setup.

pub mod ingest;
pub mod loopback;

use kvrelay_core::filter::ckf::{
    CkfFormat, CuckooFilter, MAX_KICKS_DEFAULT, SLOTS_PER_BUCKET, bucket_count_for_expected_blocks,
};
use kvrelay_core::rng::rng_from_seed;

/// Key counts measured by `cargo bench`: 1M and 10M keys.
pub const BENCH_KEY_COUNTS: [usize; 2] = [1_000_000, 10_000_000];
/// Key counts used when the benches run once as tests (`cargo test --all-targets`).
pub const TEST_KEY_COUNTS: [usize; 2] = [1_000, 10_000];
/// Most lookups timed per iteration: large filters are probed with this many queries.
pub const LOOKUP_QUERIES_MAX: usize = 1 << 20;
/// Seed of the keys every bench uses.
pub const KEY_SEED: u64 = 0x6b76_7265_6c61_7921;
/// Seed of kvrelay's kick-choice generator in the benches.
pub const KICK_SEED: u64 = 7;
/// Weyl increment of SplitMix64 (odd, so `index * GAMMA` never repeats over 2^64 indices).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Whether this process is a measuring `cargo bench` run rather than a once-through test run.
///
/// Mirrors criterion's own choice: cargo passes `--bench` to bench targets under `cargo bench`
/// and nothing under `cargo test`; `--bench --test` also means "run once as a test".
#[must_use]
pub fn is_bench_mode() -> bool {
    let (mut bench, mut test) = (false, false);
    for argument in std::env::args() {
        match argument.as_str() {
            "--bench" => bench = true,
            "--test" => test = true,
            _ => {}
        }
    }
    bench && !test
}

/// The key counts to run: [`BENCH_KEY_COUNTS`] when measuring, else [`TEST_KEY_COUNTS`].
#[must_use]
pub fn key_counts() -> [usize; 2] {
    if is_bench_mode() { BENCH_KEY_COUNTS } else { TEST_KEY_COUNTS }
}

/// A short label for a key count: `1M`, `10M`, `1k`, or the plain number.
#[must_use]
pub fn count_label(key_count: usize) -> String {
    match key_count {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// The SplitMix64 output function: a bijection on `u64` with full avalanche.
#[must_use]
#[inline]
pub fn mix64(value: u64) -> u64 {
    let mut z = value;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator: the benches' only source of randomness (seeded, reproducible).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting at `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// A uniform index in `0..bound` (Lemire's multiply-shift; the bias is below 2^-40 for the
    /// bounds used here).
    ///
    /// # Panics
    /// If `bound` is zero.
    pub fn below(&mut self, bound: usize) -> usize {
        assert!(bound > 0, "empty range");
        ((u128::from(self.next_u64()) * bound as u128) >> 64) as usize
    }
}

/// Shuffle `items` in place (Fisher–Yates) with a generator seeded by `seed`.
pub fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut rng = SplitMix64::new(seed);
    for last in (1..items.len()).rev() {
        items.swap(last, rng.below(last + 1));
    }
}

/// The keys of one workload: `present` are inserted, `absent` never are.
///
/// Key `i` of the stream is `mix64(seed + i * GAMMA)`; the first `key_count` keys are present and
/// the next `key_count` absent. Since `i -> seed + i * GAMMA` and [`mix64`] are bijections, all
/// `2 * key_count` keys are distinct: an absent key is never a duplicate of a present one.
#[derive(Debug, Clone)]
pub struct KeySet {
    /// Keys to insert, in insertion order.
    pub present: Vec<u64>,
    /// Keys never inserted, disjoint from `present`.
    pub absent: Vec<u64>,
}

impl KeySet {
    /// `key_count` present and `key_count` absent keys from the stream seeded by `seed`.
    #[must_use]
    pub fn new(key_count: usize, seed: u64) -> Self {
        let key = |index: usize| mix64(seed.wrapping_add((index as u64).wrapping_mul(GAMMA)));
        KeySet {
            present: (0..key_count).map(key).collect(),
            absent: (key_count..2 * key_count).map(key).collect(),
        }
    }
}

/// `query_count` lookups, half present and half absent keys, in a seeded random order.
///
/// Present queries are drawn uniformly (with replacement) from all of `keys.present`, not just its
/// start: early insertions sit in their home bucket more often than late ones, which went in
/// after kicks, so a prefix would flatter the filters. The order is shuffled so a branch
/// predictor cannot learn which queries hit.
///
/// # Panics
/// If `keys.present` or `keys.absent` is empty.
#[must_use]
pub fn lookup_queries(keys: &KeySet, query_count: usize, seed: u64) -> Vec<u64> {
    let mut rng = SplitMix64::new(seed);
    let mut queries = Vec::with_capacity(query_count);
    for index in 0..query_count {
        let pool = if index % 2 == 0 { &keys.present } else { &keys.absent };
        queries.push(pool[rng.below(pool.len())]);
    }
    shuffle(&mut queries, rng.next_u64());
    queries
}

/// The number of lookups timed per iteration for a filter of `key_count` keys.
#[must_use]
pub fn lookup_query_count(key_count: usize) -> usize {
    key_count.min(LOOKUP_QUERIES_MAX)
}

/// The operations a benchmark times, over one filter implementation.
///
/// Every adapter is built for a key count so that it has the same slot count as kvrelay's own
/// sizing ([`CkfFormat::for_expected_blocks`]), hence the same load after the keys are in.
pub trait BenchFilter: Sized {
    /// The criterion function id of this filter.
    const NAME: &'static str;

    /// An empty filter sized for `key_count` keys, its memory already written once so the
    /// timed region pays no first-touch page faults.
    fn with_key_count(key_count: usize) -> Self;

    /// Add one copy of `key`; whether it went in.
    fn insert(&mut self, key: u64) -> bool;

    /// Whether `key` may be present (false positives possible, no false negatives).
    fn contains(&self, key: u64) -> bool;

    /// Remove one copy of `key`; whether a copy was found.
    fn remove(&mut self, key: u64) -> bool;

    /// Insert the keys of one batch (one store's blocks); how many went in. A filter without a
    /// batch path inserts them one by one.
    fn insert_batch(&mut self, keys: &[u64]) -> usize {
        keys.iter().filter(|&&key| self.insert(key)).count()
    }

    /// Remove the keys of one batch (one removal's blocks); how many were found.
    fn remove_batch(&mut self, keys: &[u64]) -> usize {
        keys.iter().filter(|&&key| self.remove(key)).count()
    }

    /// An independent copy of the filter (setup of the removal benchmark).
    #[must_use]
    fn duplicate(&self) -> Self;

    /// Fingerprint slots in the table.
    fn slot_count(&self) -> u64;

    /// A filter sized for `keys.len()` holding every key of `keys`.
    ///
    /// # Panics
    /// If an insertion fails: the benchmark would then measure a different workload.
    #[must_use]
    fn prefilled(keys: &[u64]) -> Self {
        let mut filter = Self::with_key_count(keys.len());
        for &key in keys {
            assert!(filter.insert(key), "{}: insertion failed while prefilling", Self::NAME);
        }
        filter
    }
}

/// kvrelay's producer filter, built exactly as the relay builds it.
///
/// Its insertions and removals also record each changed bucket for the next publication (the
/// relay's filter always does); the peers have no such duty. The benchmarks never publish: a
/// removal after the prefill finds its bucket already recorded by the insertion, as a bucket
/// changed twice between two of the relay's publications would be.
#[derive(Debug, Clone)]
pub struct Kvrelay(pub CuckooFilter);

impl BenchFilter for Kvrelay {
    const NAME: &'static str = "kvrelay";

    fn with_key_count(key_count: usize) -> Self {
        let format =
            CkfFormat::for_expected_blocks(key_count as u64).expect("key count within CBI1 limits");
        Kvrelay(
            CuckooFilter::new(format, MAX_KICKS_DEFAULT, rng_from_seed(KICK_SEED))
                .expect("valid filter"),
        )
    }

    #[inline]
    fn insert(&mut self, key: u64) -> bool {
        self.0.insert(key).is_ok()
    }

    #[inline]
    fn contains(&self, key: u64) -> bool {
        self.0.contains(key)
    }

    #[inline]
    fn remove(&mut self, key: u64) -> bool {
        self.0.remove(key).is_ok()
    }

    /// The relay's path for one store: the batch's buckets are loaded first
    /// ([`CuckooFilter::warm`]), so their cache misses overlap, then each key is inserted.
    fn insert_batch(&mut self, keys: &[u64]) -> usize {
        self.0.warm(keys.iter().copied());
        keys.iter().filter(|&&key| self.0.insert(key).is_ok()).count()
    }

    fn remove_batch(&mut self, keys: &[u64]) -> usize {
        self.0.warm(keys.iter().copied());
        keys.iter().filter(|&&key| self.0.remove(key).is_ok()).count()
    }

    fn duplicate(&self) -> Self {
        self.clone()
    }

    fn slot_count(&self) -> u64 {
        self.0.format().bucket_count * u64::from(SLOTS_PER_BUCKET)
    }
}

/// The hasher given to the `cuckoofilter` crate: rustc's `FxHasher`, the fastest
/// `Hasher + Default` for a `u64` key (one multiply per `write_u64`). Measured with this crate's
/// workload at 1M keys (insert / lookup, ns per op, one noisy 2-core run): std `DefaultHasher`
/// (SipHash-1-3) 31 / 30, `fnv` 18 / 23, `ahash` (fixed keys) 14 / 15, `FxHasher` 13 / 14.
pub type CuckoofilterHasher = rustc_hash::FxHasher;

/// `cuckoofilter::CuckooFilter` (4 slots of 8-bit fingerprints per bucket) with
/// [`CuckoofilterHasher`].
pub struct Cuckoofilter {
    filter: cuckoofilter::CuckooFilter<CuckoofilterHasher>,
    slot_count: u64,
}

impl Cuckoofilter {
    /// The crate's capacity argument rounds up to a power of two and divides by its 4 slots a
    /// bucket; passing kvrelay's slot count gives it exactly kvrelay's bucket count.
    fn capacity_for(key_count: usize) -> u64 {
        let bucket_count = bucket_count_for_expected_blocks(key_count as u64)
            .expect("key count within CBI1 limits");
        bucket_count * u64::from(SLOTS_PER_BUCKET)
    }
}

impl BenchFilter for Cuckoofilter {
    const NAME: &'static str = "cuckoofilter";

    fn with_key_count(key_count: usize) -> Self {
        let slot_count = Self::capacity_for(key_count);
        Cuckoofilter {
            filter: cuckoofilter::CuckooFilter::with_capacity(slot_count as usize),
            slot_count,
        }
    }

    #[inline]
    fn insert(&mut self, key: u64) -> bool {
        self.filter.add(&key).is_ok()
    }

    #[inline]
    fn contains(&self, key: u64) -> bool {
        self.filter.contains(&key)
    }

    #[inline]
    fn remove(&mut self, key: u64) -> bool {
        self.filter.delete(&key)
    }

    /// The crate's filter is not `Clone`: copy it through its export format.
    fn duplicate(&self) -> Self {
        Cuckoofilter { filter: self.filter.export().into(), slot_count: self.slot_count }
    }

    fn slot_count(&self) -> u64 {
        self.slot_count
    }
}

/// Target false-positive rate of the quotient filter: 2^-13 gives it 13-bit remainders, hence
/// about `load * 2^-13` false positives, the same as kvrelay's 8 probed 16-bit slots
/// (`8 * load / 2^16`).
pub const QFILTER_FP_RATE: f64 = 1.0 / 8192.0;

/// `qfilter::Filter`, a rank-select quotient filter (insert, lookup and remove of duplicates,
/// like a cuckoo filter), with the crate's default fixed-seed hasher.
#[derive(Clone)]
pub struct Qfilter(pub qfilter::Filter<Box<[u8]>, qfilter::StableBuildHasher>);

impl BenchFilter for Qfilter {
    const NAME: &'static str = "qfilter";

    /// `Filter::new(n, ..)` takes the smallest power-of-two slot count whose 95 % holds `n`, which
    /// for the benchmark sizes equals kvrelay's slot count (checked by a test).
    fn with_key_count(key_count: usize) -> Self {
        let mut filter =
            qfilter::Filter::new(key_count as u64, QFILTER_FP_RATE).expect("valid qfilter size");
        // The table comes from a zeroed allocation whose pages are mapped on first write; write
        // it once here so insertions are not charged the page faults.
        filter.clear();
        Qfilter(filter)
    }

    #[inline]
    fn insert(&mut self, key: u64) -> bool {
        self.0.insert_duplicated(key).is_ok()
    }

    #[inline]
    fn contains(&self, key: u64) -> bool {
        self.0.contains(key)
    }

    #[inline]
    fn remove(&mut self, key: u64) -> bool {
        self.0.remove(key)
    }

    fn duplicate(&self) -> Self {
        self.clone()
    }

    /// Recovered from the capacity, which the crate sets to `ceil(0.95 * slots)` for a
    /// power-of-two slot count of at least 64.
    fn slot_count(&self) -> u64 {
        let mut slots = 64_u64;
        while (slots * 19).div_ceil(20) < self.0.capacity() {
            slots *= 2;
        }
        slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_and_absent_keys_are_disjoint_and_reproducible() {
        let keys = KeySet::new(10_000, KEY_SEED);
        let mut all: Vec<u64> = keys.present.iter().chain(&keys.absent).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 20_000);
        assert_eq!(KeySet::new(10_000, KEY_SEED).present, keys.present);
    }

    #[test]
    fn lookup_queries_are_half_present_in_mixed_order() {
        let keys = KeySet::new(4_096, KEY_SEED);
        let queries = lookup_queries(&keys, 4_096, 3);
        let mut present = keys.present.clone();
        present.sort_unstable();
        let hits: Vec<bool> = queries.iter().map(|q| present.binary_search(q).is_ok()).collect();
        assert_eq!(hits.iter().filter(|&&hit| hit).count(), 2_048);
        // Not the alternating pattern they were drawn in.
        assert!(hits.chunks(2).any(|pair| pair[0] == pair[1]));
    }

    #[test]
    fn every_filter_has_kvrelays_slot_count_at_the_benchmark_sizes() {
        for key_count in BENCH_KEY_COUNTS.into_iter().chain(TEST_KEY_COUNTS) {
            let slots = Kvrelay::with_key_count(key_count).slot_count();
            assert_eq!(Cuckoofilter::with_key_count(key_count).slot_count(), slots);
            assert_eq!(Qfilter::with_key_count(key_count).slot_count(), slots, "n = {key_count}");
        }
    }

    #[test]
    fn every_filter_finds_its_keys_and_forgets_removed_ones() {
        fn check<F: BenchFilter>(keys: &KeySet) {
            let mut filter = F::prefilled(&keys.present);
            assert!(keys.present.iter().all(|&key| filter.contains(key)), "{}", F::NAME);
            let false_positives = keys.absent.iter().filter(|&&key| filter.contains(key)).count();
            assert!(false_positives < keys.absent.len() / 10, "{}", F::NAME);
            let mut copy = filter.duplicate();
            for &key in &keys.present {
                assert!(filter.remove(key), "{}", F::NAME);
            }
            assert!(keys.present.iter().all(|&key| copy.contains(key)), "{}", F::NAME);
            assert!(copy.remove(keys.present[0]));
        }
        let keys = KeySet::new(5_000, KEY_SEED);
        check::<Kvrelay>(&keys);
        check::<Cuckoofilter>(&keys);
        check::<Qfilter>(&keys);
    }

    #[test]
    fn count_labels_are_short() {
        assert_eq!(count_label(1_000_000), "1M");
        assert_eq!(count_label(10_000_000), "10M");
        assert_eq!(count_label(1_000), "1k");
        assert_eq!(count_label(1_234), "1234");
    }
}
