//! Hash → fingerprint and candidate buckets (relay-facts §4.2). Shared by producer and consumer.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::format::CkfFormat;

/// Mixed into the seed of the alternate-bucket hash.
const ALTERNATE_SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Where a canonical hash lives: its fingerprint and its two candidate buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// Never zero.
    pub fingerprint: u16,
    /// The home bucket.
    pub bucket_a: u32,
    /// `alternate(bucket_a, fingerprint)`; always different from `bucket_a`.
    pub bucket_b: u32,
}

/// The addressing function of one filter format.
///
/// Invariant: `mask == bucket_count - 1` for a validated power-of-two bucket count, so every
/// bucket index it returns fits in `u32` (bucket counts are at most 2^24).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addressing {
    seed: u64,
    alternate_seed: u64,
    mask: u64,
}

impl Addressing {
    /// Addressing for a format; the caller has validated it.
    #[must_use]
    pub fn new(format: &CkfFormat) -> Self {
        debug_assert!(format.validate().is_ok(), "addressing needs a validated format");
        Addressing {
            seed: format.seed,
            alternate_seed: format.seed ^ ALTERNATE_SEED_MIX,
            mask: format.bucket_count.wrapping_sub(1),
        }
    }

    /// Fingerprint and candidate buckets of a canonical sequence hash.
    #[must_use]
    #[inline]
    pub fn probe(&self, hash: u64) -> Probe {
        let (fingerprint, bucket_a) = self.home(hash);
        Probe { fingerprint, bucket_a, bucket_b: self.alternate(bucket_a, fingerprint) }
    }

    /// Fingerprint and home bucket only: the [`Probe`] without its alternate bucket, for callers
    /// that look at the home bucket first and need the alternate only when it does not settle.
    #[must_use]
    #[inline]
    pub(crate) fn home(&self, hash: u64) -> (u16, u32) {
        let mixed = xxh3_64_with_seed(&hash.to_le_bytes(), self.seed);
        let fingerprint = match mixed as u16 {
            0 => 1,
            fp => fp,
        };
        (fingerprint, ((mixed >> 16) & self.mask) as u32)
    }

    /// The other candidate bucket of `fingerprint` when it sits in `bucket`. An involution.
    #[must_use]
    #[inline]
    pub fn alternate(&self, bucket: u32, fingerprint: u16) -> u32 {
        let delta =
            match xxh3_64_with_seed(&fingerprint.to_le_bytes(), self.alternate_seed) & self.mask {
                0 => 1,
                d => d,
            };
        bucket ^ delta as u32
    }
}

/// The fingerprint in `slot` (0..4) of a bucket word.
#[must_use]
#[inline]
pub(crate) fn slot_of(word: u64, slot: usize) -> u16 {
    (word >> (16 * slot)) as u16
}

/// `word` with `slot` set to `fingerprint`.
#[must_use]
#[inline]
pub(crate) fn with_slot(word: u64, slot: usize, fingerprint: u16) -> u64 {
    let shift = 16 * slot;
    (word & !(0xFFFF_u64 << shift)) | (u64::from(fingerprint) << shift)
}

/// `1` in the lowest bit of every 16-bit slot lane.
const LANES_LOW_BIT: u64 = 0x0001_0001_0001_0001;
/// `1` in the highest bit of every 16-bit slot lane.
const LANES_HIGH_BIT: u64 = 0x8000_8000_8000_8000;

/// SWAR zero test of the four 16-bit lanes: nonzero iff some lane of `word` is zero, and then
/// its lowest set bit is the high bit of the lowest zero lane. (Higher flags may be spurious:
/// a borrow only propagates upwards, so the lowest one is always exact.)
#[must_use]
#[inline]
fn zero_lanes(word: u64) -> u64 {
    word.wrapping_sub(LANES_LOW_BIT) & !word & LANES_HIGH_BIT
}

/// Index of the lowest lane flagged by [`zero_lanes`].
#[must_use]
#[inline]
fn lowest_lane(flags: u64) -> Option<usize> {
    if flags == 0 { None } else { Some(flags.trailing_zeros() as usize / 16) }
}

/// `fingerprint` copied into all four lanes.
#[must_use]
#[inline]
fn broadcast(fingerprint: u16) -> u64 {
    u64::from(fingerprint).wrapping_mul(LANES_LOW_BIT)
}

/// Index of the first empty slot of a word.
#[must_use]
#[inline]
pub(crate) fn first_empty_slot(word: u64) -> Option<usize> {
    lowest_lane(zero_lanes(word))
}

/// Index of the first slot holding `fingerprint`.
#[must_use]
#[inline]
pub(crate) fn find_slot(word: u64, fingerprint: u16) -> Option<usize> {
    lowest_lane(zero_lanes(word ^ broadcast(fingerprint)))
}

/// Whether a word holds `fingerprint` in any slot.
#[must_use]
#[inline]
pub fn word_contains(word: u64, fingerprint: u16) -> bool {
    zero_lanes(word ^ broadcast(fingerprint)) != 0
}

#[cfg(test)]
mod tests {
    use super::super::format::DEFAULT_SEED;
    use super::*;

    #[test]
    fn probes_match_the_computed_self_check_table() {
        let addressing = Addressing::new(&CkfFormat::v1(DEFAULT_SEED, 524_288));
        let cases = [
            (0x0123_4567_89ab_cdef_u64, 0x7d61, 236_423, 195_253),
            (0x0000_0000_0000_0001, 0xbabf, 129_663, 522_653),
            (3_727_940_790_060_946_254, 0x3239, 23_503, 491_158),
        ];
        for (hash, fingerprint, bucket_a, bucket_b) in cases {
            assert_eq!(addressing.probe(hash), Probe { fingerprint, bucket_a, bucket_b });
        }
    }

    #[test]
    fn alternate_is_an_involution_and_never_the_same_bucket() {
        let addressing = Addressing::new(&CkfFormat::v1(DEFAULT_SEED, 2));
        for hash in 0..2000u64 {
            let probe = addressing.probe(hash);
            assert_ne!(probe.bucket_a, probe.bucket_b);
            assert_eq!(addressing.alternate(probe.bucket_b, probe.fingerprint), probe.bucket_a);
            assert_ne!(probe.fingerprint, 0);
        }
    }

    #[test]
    fn slots_are_packed_least_significant_first() {
        // README example: bytes 34 12 00 00 cd ab 01 00 = slots [0x1234, 0, 0xabcd, 1].
        let word = u64::from_le_bytes([0x34, 0x12, 0x00, 0x00, 0xcd, 0xab, 0x01, 0x00]);
        assert_eq!([0, 1, 2, 3].map(|slot| slot_of(word, slot)), [0x1234, 0, 0xabcd, 1]);
        assert_eq!(first_empty_slot(word), Some(1));
        assert_eq!(with_slot(word, 1, 7), word | (7 << 16));
        assert_eq!(find_slot(word, 0xabcd), Some(2));
    }

    #[test]
    fn lane_matching_agrees_with_a_slot_by_slot_scan() {
        let naive_find =
            |word: u64, fingerprint: u16| (0..4).find(|&slot| slot_of(word, slot) == fingerprint);
        // Words built from a few lane values, so zeros, matches, borrows (0x0001, 0x8000,
        // 0xffff) and their neighbours all occur in every arrangement.
        let lanes = [0x0000, 0x0001, 0x0002, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff, 0x1234];
        let mut words = Vec::new();
        for a in lanes {
            for b in lanes {
                for c in lanes {
                    for d in lanes {
                        words.push(u64::from_le_bytes(
                            [a, b, c, d].map(u16::to_le_bytes).concat().try_into().unwrap(),
                        ));
                    }
                }
            }
        }
        let mut state = 0x1234_5678_u64;
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            words.push(state);
        }
        for &word in &words {
            assert_eq!(first_empty_slot(word), naive_find(word, 0), "{word:#018x}");
            for fingerprint in lanes.into_iter().chain([slot_of(word, 3), slot_of(word, 1)]) {
                assert_eq!(find_slot(word, fingerprint), naive_find(word, fingerprint));
                assert_eq!(
                    word_contains(word, fingerprint),
                    naive_find(word, fingerprint).is_some()
                );
            }
        }
    }
}
