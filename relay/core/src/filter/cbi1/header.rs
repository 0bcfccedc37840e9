//! The fixed 48-byte CBI1 header (relay-facts §5.1) and the little-endian byte reader shared by
//! the decoder.
//!
//! | bytes  | field                          |
//! | ------ | ------------------------------ |
//! | 0..4   | magic `CBI1`                   |
//! | 4..6   | wire_version u16 (1)           |
//! | 6..8   | flags u16 (1 chunk, 2 delta)   |
//! | 8      | fingerprint_bits u8 (16)       |
//! | 9      | slots_per_bucket u8 (4)        |
//! | 10..12 | format_version u16 (1)         |
//! | 12..20 | seed u64                       |
//! | 20..28 | bucket_count u64               |
//! | 28..36 | dc_id u64                      |
//! | 36..44 | epoch u64                      |
//! | 44..48 | body_checksum u32              |

use super::{FLAG_DELTA, FLAG_SNAPSHOT_CHUNK, HEADER_BYTES, MAGIC, WIRE_VERSION};
use crate::filter::ckf::CkfFormat;

/// What a frame's body holds, from the header `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrameKind {
    /// One chunk of a snapshot's dense bucket words (`flags` 1).
    SnapshotChunk,
    /// Absolute images of changed buckets (`flags` 2).
    Delta,
}

impl FrameKind {
    /// The header `flags` value of this kind.
    #[must_use]
    pub fn flags(self) -> u16 {
        match self {
            FrameKind::SnapshotChunk => FLAG_SNAPSHOT_CHUNK,
            FrameKind::Delta => FLAG_DELTA,
        }
    }

    /// The kind a header `flags` value names, if any.
    #[must_use]
    pub fn from_flags(flags: u16) -> Option<Self> {
        match flags {
            FLAG_SNAPSHOT_CHUNK => Some(FrameKind::SnapshotChunk),
            FLAG_DELTA => Some(FrameKind::Delta),
            _ => None,
        }
    }
}

/// The validated header of a decoded frame.
///
/// After [`decode`](super::decode) succeeds, `format` equals the expected format the frame was
/// checked against; `dc_id` is the producer's claim, which a consumer compares with its pool
/// (see [`Header::ensure_dc_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// What the body holds.
    pub kind: FrameKind,
    /// The producer filter's format.
    pub format: CkfFormat,
    /// The producer pool's data-center id.
    pub dc_id: u64,
    /// The publication sequence of this frame: the snapshot sequence for every chunk of a
    /// snapshot, the sequence a delta moves to.
    pub epoch: u64,
    /// The carried body checksum (already verified).
    pub body_checksum: u32,
}

/// A header as it sits on the wire, before any field is judged.
#[derive(Debug, Clone, Copy)]
pub(super) struct RawHeader {
    pub magic: [u8; 4],
    pub wire_version: u16,
    pub flags: u16,
    pub fingerprint_bits: u8,
    pub slots_per_bucket: u8,
    pub format_version: u16,
    pub seed: u64,
    pub bucket_count: u64,
    pub dc_id: u64,
    pub epoch: u64,
    pub body_checksum: u32,
}

impl RawHeader {
    /// Read the header fields from the first [`HEADER_BYTES`] of `bytes`; `None` if shorter.
    pub fn read(bytes: &[u8]) -> Option<Self> {
        let mut reader = ByteReader::new(bytes.get(..HEADER_BYTES)?);
        Some(RawHeader {
            magic: reader.array()?,
            wire_version: reader.u16()?,
            flags: reader.u16()?,
            fingerprint_bits: reader.u8()?,
            slots_per_bucket: reader.u8()?,
            format_version: reader.u16()?,
            seed: reader.u64()?,
            bucket_count: reader.u64()?,
            dc_id: reader.u64()?,
            epoch: reader.u64()?,
            body_checksum: reader.u32()?,
        })
    }
}

/// Append a header with a zero checksum to `out`; the caller seals it once the body is written.
///
/// `format` must be valid (so its narrow wire fields fit).
pub(super) fn write_header(
    out: &mut Vec<u8>,
    kind: FrameKind,
    format: &CkfFormat,
    dc_id: u64,
    epoch: u64,
) {
    debug_assert_eq!(format.validate(), Ok(()), "only a valid format is written");
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&kind.flags().to_le_bytes());
    // A valid format has 16-bit fingerprints, 4 slots and version 1: the narrowing is exact.
    out.push(format.fingerprint_bits as u8);
    out.push(format.slots_per_bucket as u8);
    out.extend_from_slice(&(format.format_version as u16).to_le_bytes());
    out.extend_from_slice(&format.seed.to_le_bytes());
    out.extend_from_slice(&format.bucket_count.to_le_bytes());
    out.extend_from_slice(&dc_id.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    debug_assert_eq!(out.len() - start, HEADER_BYTES);
}

/// A forward cursor over little-endian fields; every read is bounds-checked and returns `None`
/// past the end instead of panicking.
pub(super) struct ByteReader<'a> {
    rest: &'a [u8],
}

impl<'a> ByteReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteReader { rest: bytes }
    }

    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*head)
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[byte]| byte)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// Everything not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
}
