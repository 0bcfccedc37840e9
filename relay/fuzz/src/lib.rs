//! Shared pieces of the fuzz targets: the CKF formats frames are checked against, and checksum
//! fix-ups that let mutated frames past their integrity checks into the parsers behind them.

use kvrelay_core::filter::ckf::CkfFormat;

/// Formats the CBI1 targets decode against (small enough for a whole filter per input, and one
/// with two snapshot chunks).
pub const FORMATS: [CkfFormat; 3] = [
    CkfFormat {
        format_version: 1,
        seed: 1,
        bucket_count: 64,
        fingerprint_bits: 16,
        slots_per_bucket: 4,
    },
    CkfFormat {
        format_version: 1,
        seed: 7,
        bucket_count: 2,
        fingerprint_bits: 16,
        slots_per_bucket: 4,
    },
    CkfFormat {
        format_version: 1,
        seed: 1,
        bucket_count: 1 << 20,
        fingerprint_bits: 16,
        slots_per_bucket: 4,
    },
];

/// The DC id of every seed frame.
pub const DC_ID: u64 = 7;

/// Rewrite a CBI1 frame's body checksum (low 32 bits of XXH3-64 of the body) to match its body.
pub fn fix_cbi1_checksum(frame: &mut [u8]) {
    let (header, body) = frame.split_at_mut(kvrelay_core::filter::cbi1::HEADER_BYTES.min(frame.len()));
    if header.len() < kvrelay_core::filter::cbi1::HEADER_BYTES {
        return;
    }
    let checksum = xxhash_rust::xxh3::xxh3_64(body) as u32;
    let at = kvrelay_core::filter::cbi1::CHECKSUM_OFFSET;
    header[at..at + 4].copy_from_slice(&checksum.to_le_bytes());
}

/// Rewrite every journal frame's checksum (after the 8-byte segment preamble: `u32 LE length`,
/// `u64 LE XXH3-64 of the payload`, payload) as far as the lengths fit in `file`.
pub fn fix_journal_checksums(file: &mut [u8]) {
    let mut at = kvrelay::journal::format::SEGMENT_PREAMBLE_BYTES;
    let header_bytes = kvrelay::journal::format::FRAME_HEADER_BYTES;
    while at + header_bytes <= file.len() {
        let len = u32::from_le_bytes([file[at], file[at + 1], file[at + 2], file[at + 3]]) as usize;
        let Some(end) = (at + header_bytes).checked_add(len).filter(|end| *end <= file.len())
        else {
            return;
        };
        let checksum = xxhash_rust::xxh3::xxh3_64(&file[at + header_bytes..end]);
        file[at + 4..at + header_bytes].copy_from_slice(&checksum.to_le_bytes());
        at = end;
    }
}
