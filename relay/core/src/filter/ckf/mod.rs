//! The producer's cuckoo filter (CKF) of canonical sequence hashes (relay-facts §4.1–4.3).
//!
//! Layout: `bucket_count` buckets (a power of two, 2..=2^24), each one `u64` word holding four
//! 16-bit fingerprint slots, slot `i` at bits `[16i, 16i+16)`; a zero slot is empty. A hash maps
//! to a fingerprint and two candidate buckets ([`Probe`]); membership is the fingerprint in any
//! slot of either. The filter also tracks which bucket words changed since they were last
//! published, so a publication carries only buckets whose word really differs.

mod addressing;
mod filter;
mod format;

pub use addressing::{Addressing, Probe, word_contains};
pub use filter::{CapacityExhausted, CkfAllocationError, CuckooFilter, FingerprintMissing};
pub use format::{
    BUCKET_COUNT_MAX, CkfFormat, CkfFormatError, DEFAULT_SEED, EXPECTED_UNIQUE_BLOCKS_MAX,
    FINGERPRINT_BITS, FORMAT_VERSION, MAX_KICKS_DEFAULT, MAX_KICKS_LIMIT, SLOTS_PER_BUCKET,
    bucket_count_for_expected_blocks,
};

/// The absolute value of one bucket word: the unit of every published change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BucketImage {
    /// Bucket index, `< bucket_count`.
    pub bucket: u32,
    /// The bucket's whole word after the change (zero when the bucket emptied).
    pub word: u64,
}
