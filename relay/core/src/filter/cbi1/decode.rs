//! Reading CBI1 frames (relay-facts §5.5).
//!
//! [`decode`] judges a frame in the reference order, so the first broken property decides the
//! error: length, magic, wire version, checksum, format, flags, then the body of the kind the
//! flags name. Every count and offset in the body is bounded against the frame length and the
//! expected format before it is trusted, and nothing is allocated: a decoded [`Frame`] borrows
//! the input and reads images and words from it on demand.

use thiserror::Error;

use super::header::{ByteReader, RawHeader};
use super::{
    CHUNK_PREFIX_BYTES, DELTA_IMAGE_BYTES, DELTA_PREFIX_BYTES, FrameKind, HEADER_BYTES, Header,
    MAGIC, MAX_DELTA_IMAGES, MAX_FRAME_BYTES, SNAPSHOT_CHUNK_BUCKETS, WIRE_VERSION, WORD_BYTES,
    body_checksum,
};
use crate::filter::ckf::{BucketImage, CkfFormat, CkfFormatError};

/// Why a frame was rejected. Variants are listed in the order the decoder checks them.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The expected format itself is not executable, so no frame can match it (a caller bug).
    #[error("expected CKF format is invalid: {0}")]
    ExpectedFormat(CkfFormatError),
    /// Shorter than a header.
    #[error("frame of {frame_bytes} bytes is shorter than the 48-byte header")]
    Truncated {
        /// Length of the frame.
        frame_bytes: usize,
    },
    /// Longer than [`MAX_FRAME_BYTES`].
    #[error("frame of {frame_bytes} bytes exceeds the limit of {MAX_FRAME_BYTES}")]
    FrameTooLarge {
        /// Length of the frame.
        frame_bytes: usize,
    },
    /// The first four bytes are not `CBI1`.
    #[error("bad magic {magic:02x?}")]
    BadMagic {
        /// The bytes found.
        magic: [u8; 4],
    },
    /// A wire version other than 1.
    #[error("unsupported CBI1 wire version {wire_version}")]
    UnsupportedWireVersion {
        /// The version found.
        wire_version: u16,
    },
    /// The body does not hash to the carried checksum.
    #[error("body checksum {computed:#010x} does not match carried {carried:#010x}")]
    ChecksumMismatch {
        /// The checksum in the header.
        carried: u32,
        /// The checksum of the body as received.
        computed: u32,
    },
    /// The CKF format version differs from the expected format.
    #[error("format version {found} does not match expected {expected}")]
    FormatVersionMismatch {
        /// The expected format's version.
        expected: u32,
        /// The header's version.
        found: u16,
    },
    /// The fingerprint width differs from the expected format.
    #[error("fingerprint width {found} does not match expected {expected}")]
    FingerprintBitsMismatch {
        /// The expected width.
        expected: u32,
        /// The header's width.
        found: u8,
    },
    /// The slots per bucket differ from the expected format.
    #[error("slots per bucket {found} does not match expected {expected}")]
    SlotsPerBucketMismatch {
        /// The expected slot count.
        expected: u32,
        /// The header's slot count.
        found: u8,
    },
    /// The filter seed differs from the expected format.
    #[error("seed {found:#018x} does not match expected {expected:#018x}")]
    SeedMismatch {
        /// The expected seed.
        expected: u64,
        /// The header's seed.
        found: u64,
    },
    /// The bucket count differs from the expected format.
    #[error("bucket count {found} does not match expected {expected}")]
    BucketCountMismatch {
        /// The expected bucket count.
        expected: u64,
        /// The header's bucket count.
        found: u64,
    },
    /// `flags` names neither a snapshot chunk nor a delta.
    #[error("unknown frame flags {flags}")]
    UnknownFlags {
        /// The flags found.
        flags: u16,
    },
    /// A delta body shorter than its 12-byte prefix.
    #[error("delta body of {body_bytes} bytes is shorter than its 12-byte prefix")]
    DeltaBodyTruncated {
        /// Length of the body.
        body_bytes: usize,
    },
    /// A delta claiming more images than any frame can carry.
    #[error("delta claims {image_count} images, more than the limit of {MAX_DELTA_IMAGES}")]
    TooManyDeltaImages {
        /// The claimed count.
        image_count: u32,
    },
    /// A delta body whose length is not `12 + 12 * image_count`.
    #[error("delta of {image_count} images has a body of {body_bytes} bytes")]
    DeltaBodyLength {
        /// The claimed count.
        image_count: u32,
        /// Length of the body.
        body_bytes: usize,
    },
    /// A delta image naming a bucket outside the filter.
    #[error("delta image {image_index}: bucket {bucket} is outside 0..{bucket_count}")]
    DeltaBucketOutOfRange {
        /// Position of the image in the frame.
        image_index: usize,
        /// The offending bucket.
        bucket: u32,
        /// The filter's bucket count.
        bucket_count: u64,
    },
    /// A snapshot chunk body shorter than its 16-byte prefix.
    #[error("snapshot chunk body of {body_bytes} bytes is shorter than its 16-byte prefix")]
    ChunkBodyTruncated {
        /// Length of the body.
        body_bytes: usize,
    },
    /// A snapshot chunk claiming its snapshot has no chunks.
    #[error("snapshot chunk claims a chunk count of zero")]
    ZeroChunkCount,
    /// A snapshot chunk index past its chunk count.
    #[error("snapshot chunk index {chunk_index} is outside 0..{chunk_count}")]
    ChunkIndexOutOfRange {
        /// The chunk's index.
        chunk_index: u32,
        /// The claimed chunk count.
        chunk_count: u32,
    },
    /// Snapshot chunk words that are not a whole number of 8-byte words.
    #[error("snapshot chunk carries {word_bytes} word bytes, not a multiple of 8")]
    ChunkWordsUnaligned {
        /// Bytes after the chunk prefix.
        word_bytes: usize,
    },
    /// More words than one chunk may carry (unreachable past the frame length limit, checked
    /// anyway so the bound does not rest on arithmetic elsewhere).
    #[error("snapshot chunk carries {word_count} words, more than {SNAPSHOT_CHUNK_BUCKETS}")]
    TooManyChunkWords {
        /// Words in the chunk.
        word_count: usize,
    },
    /// A snapshot chunk whose words run past the last bucket.
    #[error(
        "snapshot chunk at bucket {bucket_offset} with {word_count} words overruns {bucket_count} buckets"
    )]
    ChunkOutOfRange {
        /// The chunk's first bucket.
        bucket_offset: u64,
        /// Words in the chunk.
        word_count: usize,
        /// The filter's bucket count.
        bucket_count: u64,
    },
    /// A valid frame from another DC than the consumer's pool.
    #[error("frame from DC {found:#018x}, expected DC {expected:#018x}")]
    DcIdMismatch {
        /// The pool's DC id.
        expected: u64,
        /// The header's DC id.
        found: u64,
    },
}

/// One validated frame, borrowing the bytes it was decoded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A chunk of a snapshot.
    SnapshotChunk(SnapshotChunk<'a>),
    /// A delta.
    Delta(Delta<'a>),
}

impl<'a> Frame<'a> {
    /// The frame's validated header.
    #[must_use]
    pub fn header(&self) -> &Header {
        match self {
            Frame::SnapshotChunk(chunk) => chunk.header(),
            Frame::Delta(delta) => delta.header(),
        }
    }
}

/// A validated snapshot chunk: `chunk_index < chunk_count`, and its words cover buckets
/// `bucket_offset..bucket_offset + word_count` within the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotChunk<'a> {
    header: Header,
    chunk_index: u32,
    chunk_count: u32,
    bucket_offset: u64,
    word_bytes: &'a [u8],
}

impl<'a> SnapshotChunk<'a> {
    /// The frame's validated header; its epoch is the snapshot's publication sequence.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Position of this chunk in its snapshot.
    #[must_use]
    pub fn chunk_index(&self) -> u32 {
        self.chunk_index
    }

    /// Chunks in the snapshot, as this chunk claims.
    #[must_use]
    pub fn chunk_count(&self) -> u32 {
        self.chunk_count
    }

    /// The first bucket this chunk covers.
    #[must_use]
    pub fn bucket_offset(&self) -> u64 {
        self.bucket_offset
    }

    /// Number of bucket words in this chunk.
    #[must_use]
    pub fn word_count(&self) -> usize {
        self.word_bytes.len() / WORD_BYTES
    }

    /// The bucket words, in bucket order from [`Self::bucket_offset`].
    pub fn words(&self) -> impl ExactSizeIterator<Item = u64> + use<'a> {
        let (words, _) = self.word_bytes.as_chunks::<WORD_BYTES>();
        words.iter().map(|bytes| u64::from_le_bytes(*bytes))
    }

    /// The raw little-endian word bytes, borrowed from the frame.
    #[must_use]
    pub fn word_bytes(&self) -> &'a [u8] {
        self.word_bytes
    }
}

/// A validated delta: `image_count <= MAX_DELTA_IMAGES` and every image's bucket is inside the
/// filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta<'a> {
    header: Header,
    base_epoch: u64,
    image_bytes: &'a [u8],
}

impl<'a> Delta<'a> {
    /// The frame's validated header; its epoch is the sequence this delta moves to.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The sequence this delta applies on top of.
    #[must_use]
    pub fn base_epoch(&self) -> u64 {
        self.base_epoch
    }

    /// Number of images.
    #[must_use]
    pub fn image_count(&self) -> usize {
        self.image_bytes.len() / DELTA_IMAGE_BYTES
    }

    /// The absolute bucket images, in frame order.
    pub fn images(&self) -> impl ExactSizeIterator<Item = BucketImage> + use<'a> {
        let (images, _) = self.image_bytes.as_chunks::<DELTA_IMAGE_BYTES>();
        images.iter().map(|image| read_image(*image))
    }

    /// The raw image bytes (`bucket u32 | word u64` each), borrowed from the frame.
    #[must_use]
    pub fn image_bytes(&self) -> &'a [u8] {
        self.image_bytes
    }
}

impl Header {
    /// Accept the frame only if it comes from the pool's DC (what consumers check after
    /// [`decode`]).
    pub fn ensure_dc_id(&self, expected_dc_id: u64) -> Result<(), DecodeError> {
        if self.dc_id != expected_dc_id {
            return Err(DecodeError::DcIdMismatch { expected: expected_dc_id, found: self.dc_id });
        }
        Ok(())
    }
}

/// Decode `frame` as one of the expected pool's frames: [`decode`], then the header's DC id must
/// be `expected_dc_id`.
pub fn decode_for_pool<'a>(
    frame: &'a [u8],
    expected_format: &CkfFormat,
    expected_dc_id: u64,
) -> Result<Frame<'a>, DecodeError> {
    let decoded = decode(frame, expected_format)?;
    decoded.header().ensure_dc_id(expected_dc_id)?;
    Ok(decoded)
}

/// Validate `frame` against the `expected` format (from the pool catalog) and return views of
/// its header and body. Never panics and never allocates, whatever the bytes.
///
/// Checks, in order: 48 bytes ≤ length ≤ [`MAX_FRAME_BYTES`]; magic; wire version; body
/// checksum; format version, fingerprint width, slots, seed and bucket count equal to
/// `expected`; flags; then the body of the kind the flags name (see [`DecodeError`]). The DC id
/// is not judged here; see [`decode_for_pool`].
pub fn decode<'a>(frame: &'a [u8], expected: &CkfFormat) -> Result<Frame<'a>, DecodeError> {
    expected.validate().map_err(DecodeError::ExpectedFormat)?;

    let frame_bytes = frame.len();
    if frame_bytes < HEADER_BYTES {
        return Err(DecodeError::Truncated { frame_bytes });
    }
    if frame_bytes > MAX_FRAME_BYTES {
        return Err(DecodeError::FrameTooLarge { frame_bytes });
    }
    let raw = RawHeader::read(frame).ok_or(DecodeError::Truncated { frame_bytes })?;
    let body = frame.get(HEADER_BYTES..).ok_or(DecodeError::Truncated { frame_bytes })?;

    if raw.magic != MAGIC {
        return Err(DecodeError::BadMagic { magic: raw.magic });
    }
    if raw.wire_version != WIRE_VERSION {
        return Err(DecodeError::UnsupportedWireVersion { wire_version: raw.wire_version });
    }
    let computed = body_checksum(body);
    if computed != raw.body_checksum {
        return Err(DecodeError::ChecksumMismatch { carried: raw.body_checksum, computed });
    }
    check_format(&raw, expected)?;
    let kind =
        FrameKind::from_flags(raw.flags).ok_or(DecodeError::UnknownFlags { flags: raw.flags })?;

    let header = Header {
        kind,
        format: *expected,
        dc_id: raw.dc_id,
        epoch: raw.epoch,
        body_checksum: raw.body_checksum,
    };
    match kind {
        FrameKind::Delta => decode_delta(header, body).map(Frame::Delta),
        FrameKind::SnapshotChunk => decode_chunk(header, body).map(Frame::SnapshotChunk),
    }
}

fn check_format(raw: &RawHeader, expected: &CkfFormat) -> Result<(), DecodeError> {
    if u32::from(raw.format_version) != expected.format_version {
        return Err(DecodeError::FormatVersionMismatch {
            expected: expected.format_version,
            found: raw.format_version,
        });
    }
    if u32::from(raw.fingerprint_bits) != expected.fingerprint_bits {
        return Err(DecodeError::FingerprintBitsMismatch {
            expected: expected.fingerprint_bits,
            found: raw.fingerprint_bits,
        });
    }
    if u32::from(raw.slots_per_bucket) != expected.slots_per_bucket {
        return Err(DecodeError::SlotsPerBucketMismatch {
            expected: expected.slots_per_bucket,
            found: raw.slots_per_bucket,
        });
    }
    if raw.seed != expected.seed {
        return Err(DecodeError::SeedMismatch { expected: expected.seed, found: raw.seed });
    }
    if raw.bucket_count != expected.bucket_count {
        return Err(DecodeError::BucketCountMismatch {
            expected: expected.bucket_count,
            found: raw.bucket_count,
        });
    }
    Ok(())
}

fn decode_delta(header: Header, body: &[u8]) -> Result<Delta<'_>, DecodeError> {
    let body_bytes = body.len();
    let mut reader = ByteReader::new(body);
    let (Some(base_epoch), Some(image_count)) = (reader.u64(), reader.u32()) else {
        return Err(DecodeError::DeltaBodyTruncated { body_bytes });
    };
    if image_count as usize > MAX_DELTA_IMAGES {
        return Err(DecodeError::TooManyDeltaImages { image_count });
    }
    // Bounded above, so the product cannot overflow.
    if body_bytes != DELTA_PREFIX_BYTES + image_count as usize * DELTA_IMAGE_BYTES {
        return Err(DecodeError::DeltaBodyLength { image_count, body_bytes });
    }
    let image_bytes = reader.rest();
    let bucket_count = header.format.bucket_count;
    let (images, _) = image_bytes.as_chunks::<DELTA_IMAGE_BYTES>();
    for (image_index, image) in images.iter().enumerate() {
        let BucketImage { bucket, .. } = read_image(*image);
        if u64::from(bucket) >= bucket_count {
            return Err(DecodeError::DeltaBucketOutOfRange { image_index, bucket, bucket_count });
        }
    }
    Ok(Delta { header, base_epoch, image_bytes })
}

fn decode_chunk(header: Header, body: &[u8]) -> Result<SnapshotChunk<'_>, DecodeError> {
    let body_bytes = body.len();
    let mut reader = ByteReader::new(body);
    let (Some(chunk_index), Some(chunk_count), Some(bucket_offset)) =
        (reader.u32(), reader.u32(), reader.u64())
    else {
        return Err(DecodeError::ChunkBodyTruncated { body_bytes });
    };
    debug_assert_eq!(body_bytes - reader.rest().len(), CHUNK_PREFIX_BYTES);
    if chunk_count == 0 {
        return Err(DecodeError::ZeroChunkCount);
    }
    if chunk_index >= chunk_count {
        return Err(DecodeError::ChunkIndexOutOfRange { chunk_index, chunk_count });
    }
    let word_bytes = reader.rest();
    if !word_bytes.len().is_multiple_of(WORD_BYTES) {
        return Err(DecodeError::ChunkWordsUnaligned { word_bytes: word_bytes.len() });
    }
    let word_count = word_bytes.len() / WORD_BYTES;
    if word_count > SNAPSHOT_CHUNK_BUCKETS {
        return Err(DecodeError::TooManyChunkWords { word_count });
    }
    let bucket_count = header.format.bucket_count;
    let covered_end = bucket_offset.checked_add(word_count as u64);
    if covered_end.is_none_or(|end| end > bucket_count) {
        return Err(DecodeError::ChunkOutOfRange { bucket_offset, word_count, bucket_count });
    }
    Ok(SnapshotChunk { header, chunk_index, chunk_count, bucket_offset, word_bytes })
}

/// One 12-byte image: `bucket u32 | word u64`, little-endian.
fn read_image(image: [u8; DELTA_IMAGE_BYTES]) -> BucketImage {
    let [b0, b1, b2, b3, w0, w1, w2, w3, w4, w5, w6, w7] = image;
    BucketImage {
        bucket: u32::from_le_bytes([b0, b1, b2, b3]),
        word: u64::from_le_bytes([w0, w1, w2, w3, w4, w5, w6, w7]),
    }
}
