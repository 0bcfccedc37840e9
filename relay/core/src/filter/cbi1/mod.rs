//! CBI1 ("Cuckoo Bucket Images v1"): the wire encoding of a pool's cuckoo filter
//! (relay-facts §5).
//!
//! Every frame is a fixed 48-byte [`Header`] followed by a body, all integers little-endian:
//!
//! - a **snapshot chunk** carries up to [`SNAPSHOT_CHUNK_BUCKETS`] dense bucket words; the chunks
//!   of one snapshot share the header epoch (the snapshot's publication sequence) and are
//!   rebuilt into a whole filter by the [`SnapshotAssembler`];
//! - a **delta** carries absolute [`BucketImage`]s that move a consumer from `base_epoch` to the
//!   header epoch.
//!
//! The module is pure (no tasks, clocks or I/O) and split by direction: [`FrameEncoder`] and
//! [`SnapshotEncoder`] write frames, [`decode`] validates one frame in the reference order and
//! hands back borrowed views into it, and [`SnapshotAssembler`] turns a contiguous run of snapshot
//! chunks into one snapshot.
//!
//! Invariants kept here:
//! - no frame, encoded or accepted, is longer than [`MAX_FRAME_BYTES`];
//! - the decoder bounds every count and offset against the frame length and the expected format
//!   before anything is read past the header, and never allocates: a decoded frame borrows its
//!   bytes;
//! - the body checksum is the low 32 bits of XXH3-64 (seed 0) over the bytes after the header;
//! - a snapshot leaves the assembler only whole and validated, never partially.
//!
//! [`BucketImage`]: crate::filter::ckf::BucketImage

mod assemble;
mod decode;
mod encode;
mod header;

#[cfg(test)]
mod tests;

pub use assemble::{AssembledSnapshot, AssemblyError, ChunkSequenceError, SnapshotAssembler};
pub use decode::{DecodeError, Delta, Frame, SnapshotChunk, decode, decode_for_pool};
pub use encode::{EncodeError, FrameEncoder, SnapshotEncoder, snapshot_chunk_count};
pub use header::{FrameKind, Header};

/// The four magic bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"CBI1";
/// The only wire version v1 knows.
pub const WIRE_VERSION: u16 = 1;
/// Header `flags` value of a snapshot chunk.
pub const FLAG_SNAPSHOT_CHUNK: u16 = 1;
/// Header `flags` value of a delta.
pub const FLAG_DELTA: u16 = 2;

/// Length of the fixed header of every frame.
pub const HEADER_BYTES: usize = 48;
/// Offset of the little-endian `body_checksum` inside the header (its last four bytes).
pub const CHECKSUM_OFFSET: usize = 44;
/// Bytes of one bucket word on the wire.
pub const WORD_BYTES: usize = 8;
/// Length of a snapshot chunk body before its words: `chunk_index u32 | chunk_count u32 |
/// bucket_offset u64`.
pub const CHUNK_PREFIX_BYTES: usize = 16;
/// Length of a delta body before its images: `base_epoch u64 | image_count u32`.
pub const DELTA_PREFIX_BYTES: usize = 12;
/// Bytes of one delta image: `bucket u32 | word u64`.
pub const DELTA_IMAGE_BYTES: usize = 12;

/// Most bucket words in one snapshot chunk (512 Ki words, 4 MiB).
pub const SNAPSHOT_CHUNK_BUCKETS: usize = 524_288;
/// Largest frame on the wire: a full snapshot chunk.
pub const MAX_FRAME_BYTES: usize =
    HEADER_BYTES + CHUNK_PREFIX_BYTES + SNAPSHOT_CHUNK_BUCKETS * WORD_BYTES;
/// Most images one delta frame can carry within [`MAX_FRAME_BYTES`]; a larger publication is
/// sent as a snapshot instead.
pub const MAX_DELTA_IMAGES: usize =
    (MAX_FRAME_BYTES - HEADER_BYTES - DELTA_PREFIX_BYTES) / DELTA_IMAGE_BYTES;

const _: () = assert!(MAX_FRAME_BYTES == 4_194_368);
const _: () = assert!(MAX_DELTA_IMAGES == 349_525);
const _: () = assert!(CHECKSUM_OFFSET + 4 == HEADER_BYTES);

/// The body checksum carried in the header: the low 32 bits of XXH3-64 with seed 0 over `body`
/// (the bytes after the header).
#[must_use]
pub fn body_checksum(body: &[u8]) -> u32 {
    // Truncation is the definition: only the low half of the 64-bit hash is carried.
    xxhash_rust::xxh3::xxh3_64(body) as u32
}
