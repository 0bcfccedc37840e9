//! CKF format identity and sizing (relay-facts §4.1, §2.1 `DcCkfFormatIdentity`).

use thiserror::Error;

/// The only CKF format version v1 knows.
pub const FORMAT_VERSION: u32 = 1;
/// Fingerprint width in bits.
pub const FINGERPRINT_BITS: u32 = 16;
/// Fingerprint slots per bucket word.
pub const SLOTS_PER_BUCKET: u32 = 4;
/// The relay's filter seed.
pub const DEFAULT_SEED: u64 = 0x5DEE_CE66_D1B5_4A33;
/// Largest bucket count CBI1 can carry.
pub const BUCKET_COUNT_MAX: u64 = 1 << 24;
/// Largest `--expected-unique-blocks` whose sizing stays within [`BUCKET_COUNT_MAX`].
pub const EXPECTED_UNIQUE_BLOCKS_MAX: u64 = 53_687_091;
/// Default bound on cuckoo kicks per insertion.
pub const MAX_KICKS_DEFAULT: u32 = 500;
/// Largest accepted bound on cuckoo kicks.
pub const MAX_KICKS_LIMIT: u32 = 4096;

/// The frozen shape of a pool's filter, as carried in `ProducerIdentity` and every CBI1 header.
///
/// Values may come off the wire, so a `CkfFormat` is not necessarily executable: call
/// [`CkfFormat::validate`] before building or decoding against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CkfFormat {
    /// Must be [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Seed of the addressing hashes.
    pub seed: u64,
    /// Number of buckets: a power of two in `2..=2^24`.
    pub bucket_count: u64,
    /// Must be [`FINGERPRINT_BITS`].
    pub fingerprint_bits: u32,
    /// Must be [`SLOTS_PER_BUCKET`].
    pub slots_per_bucket: u32,
}

/// Why a [`CkfFormat`] or a sizing request is not executable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum CkfFormatError {
    /// The format version is not 1.
    #[error("unsupported CKF format version {0}")]
    FormatVersion(u32),
    /// The fingerprint width is not 16 bits.
    #[error("unsupported fingerprint width {0} bits")]
    FingerprintBits(u32),
    /// The slot count is not 4.
    #[error("unsupported slots per bucket {0}")]
    SlotsPerBucket(u32),
    /// The bucket count is not a power of two in `2..=2^24`.
    #[error("bucket count {0} is not a power of two in 2..=16777216")]
    BucketCount(u64),
    /// `expected_unique_blocks` is zero.
    #[error("expected unique blocks must be positive")]
    ZeroExpectedBlocks,
    /// `expected_unique_blocks` sizes a filter larger than CBI1 can carry.
    #[error("expected unique blocks {0} exceeds the CBI1 limit of 53687091")]
    ExpectedBlocksTooLarge(u64),
}

impl CkfFormat {
    /// The v1 format with the given seed and bucket count (not yet validated).
    #[must_use]
    pub fn v1(seed: u64, bucket_count: u64) -> Self {
        CkfFormat {
            format_version: FORMAT_VERSION,
            seed,
            bucket_count,
            fingerprint_bits: FINGERPRINT_BITS,
            slots_per_bucket: SLOTS_PER_BUCKET,
        }
    }

    /// The relay's format for `expected_unique_blocks`: default seed, standard sizing.
    pub fn for_expected_blocks(expected_unique_blocks: u64) -> Result<Self, CkfFormatError> {
        Ok(Self::v1(DEFAULT_SEED, bucket_count_for_expected_blocks(expected_unique_blocks)?))
    }

    /// Bytes of a filter of this format: every slot holds one fingerprint.
    #[must_use]
    pub fn filter_bytes(&self) -> u64 {
        let slot_bytes = u64::from(self.fingerprint_bits.div_ceil(8));
        self.bucket_count
            .saturating_mul(u64::from(self.slots_per_bucket))
            .saturating_mul(slot_bytes)
    }

    /// Accept only the one executable shape: version 1, 16-bit fingerprints, 4 slots, and a
    /// power-of-two bucket count in `2..=2^24`.
    pub fn validate(&self) -> Result<(), CkfFormatError> {
        if self.format_version != FORMAT_VERSION {
            return Err(CkfFormatError::FormatVersion(self.format_version));
        }
        if self.fingerprint_bits != FINGERPRINT_BITS {
            return Err(CkfFormatError::FingerprintBits(self.fingerprint_bits));
        }
        if self.slots_per_bucket != SLOTS_PER_BUCKET {
            return Err(CkfFormatError::SlotsPerBucket(self.slots_per_bucket));
        }
        if self.bucket_count < 2
            || self.bucket_count > BUCKET_COUNT_MAX
            || !self.bucket_count.is_power_of_two()
        {
            return Err(CkfFormatError::BucketCount(self.bucket_count));
        }
        Ok(())
    }
}

/// `next_power_of_two(max(2, floor((5n + 15) / 16)))`: about 0.8 load over four slots.
pub fn bucket_count_for_expected_blocks(
    expected_unique_blocks: u64,
) -> Result<u64, CkfFormatError> {
    if expected_unique_blocks == 0 {
        return Err(CkfFormatError::ZeroExpectedBlocks);
    }
    if expected_unique_blocks > EXPECTED_UNIQUE_BLOCKS_MAX {
        return Err(CkfFormatError::ExpectedBlocksTooLarge(expected_unique_blocks));
    }
    let minimum = (5 * expected_unique_blocks).div_ceil(16).max(2);
    Ok(minimum.next_power_of_two())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizing_matches_reference_table() {
        for (n, buckets) in
            [(1, 2), (32, 16), (1024, 512), (1_048_576, 524_288), (53_687_091, 16_777_216)]
        {
            assert_eq!(bucket_count_for_expected_blocks(n), Ok(buckets), "n = {n}");
        }
        assert_eq!(
            bucket_count_for_expected_blocks(53_687_092),
            Err(CkfFormatError::ExpectedBlocksTooLarge(53_687_092))
        );
        assert_eq!(bucket_count_for_expected_blocks(0), Err(CkfFormatError::ZeroExpectedBlocks));
    }

    #[test]
    fn ckf_format_accepts_only_the_executable_cbi1_shape() {
        assert_eq!(CkfFormat::v1(DEFAULT_SEED, 524_288).validate(), Ok(()));
        assert_eq!(CkfFormat::v1(1, 2).validate(), Ok(()));
        assert_eq!(CkfFormat::v1(1, BUCKET_COUNT_MAX).validate(), Ok(()));
        for bad in [0, 1, 3, 1000, BUCKET_COUNT_MAX * 2] {
            assert_eq!(CkfFormat::v1(1, bad).validate(), Err(CkfFormatError::BucketCount(bad)));
        }
        let good = CkfFormat::v1(1, 8);
        let cases = [
            (CkfFormat { format_version: 2, ..good }, CkfFormatError::FormatVersion(2)),
            (CkfFormat { fingerprint_bits: 8, ..good }, CkfFormatError::FingerprintBits(8)),
            (CkfFormat { slots_per_bucket: 2, ..good }, CkfFormatError::SlotsPerBucket(2)),
        ];
        for (format, error) in cases {
            assert_eq!(format.validate(), Err(error));
        }
    }
}
