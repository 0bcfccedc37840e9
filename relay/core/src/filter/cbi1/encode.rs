//! Writing CBI1 frames (relay-facts §5.2–5.4).
//!
//! Input is checked completely before a byte is written, so a failed encode leaves the caller's
//! buffer untouched. Each frame is written into a buffer reserved to its exact final size: words
//! are converted to little-endian bytes in one pass and the checksum is computed once, over the
//! finished body, then patched into the header.

use thiserror::Error;

use super::header::write_header;
use super::{
    CHECKSUM_OFFSET, CHUNK_PREFIX_BYTES, DELTA_IMAGE_BYTES, DELTA_PREFIX_BYTES, FrameKind,
    HEADER_BYTES, MAX_DELTA_IMAGES, MAX_FRAME_BYTES, SNAPSHOT_CHUNK_BUCKETS, WORD_BYTES,
    body_checksum,
};
use crate::filter::ckf::{BucketImage, CkfFormat, CkfFormatError};

/// Why a frame could not be encoded. Every case is a caller bug or a publication that must take
/// another path (an oversized delta becomes a snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// The producer's format is not the executable CBI1 shape.
    #[error("invalid CKF format: {0}")]
    InvalidFormat(#[from] CkfFormatError),
    /// A delta with no images: the producer publishes only buckets whose word changed, and
    /// consumers treat an empty delta as a fault.
    #[error("a delta must carry at least one image")]
    EmptyDelta,
    /// More images than one frame can carry; publish a snapshot instead.
    #[error("delta of {image_count} images exceeds the CBI1 limit of {MAX_DELTA_IMAGES}")]
    TooManyDeltaImages {
        /// Images offered.
        image_count: usize,
    },
    /// The delta's epoch is not `base_epoch + 1` (including a base with no successor).
    #[error("delta epoch {epoch} does not follow base epoch {base_epoch}")]
    DeltaNotContiguous {
        /// The epoch the delta starts from.
        base_epoch: u64,
        /// The epoch the delta claims to reach.
        epoch: u64,
    },
    /// An image names a bucket outside the filter.
    #[error("image {image_index}: bucket {bucket} is outside 0..{bucket_count}")]
    BucketOutOfRange {
        /// Position of the image in the input.
        image_index: usize,
        /// The offending bucket.
        bucket: u32,
        /// The filter's bucket count.
        bucket_count: u64,
    },
    /// Images are not strictly ascending by bucket (which also rules out duplicates).
    #[error("image {image_index}: bucket {bucket} does not follow bucket {previous_bucket}")]
    ImagesNotAscending {
        /// Position of the image in the input.
        image_index: usize,
        /// Bucket of the image before it.
        previous_bucket: u32,
        /// Its own bucket.
        bucket: u32,
    },
    /// A snapshot must carry exactly one word per bucket.
    #[error("snapshot has {word_count} words for {bucket_count} buckets")]
    SnapshotWordCount {
        /// Words offered.
        word_count: usize,
        /// The filter's bucket count.
        bucket_count: u64,
    },
    /// A snapshot chunk index past the last chunk.
    #[error("chunk {chunk_index} is outside 0..{chunk_count}")]
    ChunkIndexOutOfRange {
        /// The requested chunk.
        chunk_index: u32,
        /// Chunks in this snapshot.
        chunk_count: u32,
    },
}

/// Number of snapshot chunks for `bucket_count` buckets: `ceil(bucket_count / 524288)`
/// (1 to 32 for a valid format).
#[must_use]
pub fn snapshot_chunk_count(bucket_count: u64) -> u32 {
    let chunk_count = bucket_count.div_ceil(SNAPSHOT_CHUNK_BUCKETS as u64);
    u32::try_from(chunk_count).unwrap_or(u32::MAX)
}

/// Writes the frames of one producer pool: its validated format and its DC id go into every
/// header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameEncoder {
    format: CkfFormat,
    dc_id: u64,
}

impl FrameEncoder {
    /// An encoder for a pool with `format` and `dc_id`; the format must be valid.
    pub fn new(format: CkfFormat, dc_id: u64) -> Result<Self, EncodeError> {
        format.validate()?;
        Ok(FrameEncoder { format, dc_id })
    }

    /// The format written into every header.
    #[must_use]
    pub fn format(&self) -> &CkfFormat {
        &self.format
    }

    /// The DC id written into every header.
    #[must_use]
    pub fn dc_id(&self) -> u64 {
        self.dc_id
    }

    /// Encode the delta that moves a consumer from `base_epoch` to `epoch` (which must be
    /// `base_epoch + 1`). `images` are absolute bucket words, strictly ascending by bucket, at
    /// least one and at most [`MAX_DELTA_IMAGES`].
    pub fn encode_delta(
        &self,
        base_epoch: u64,
        epoch: u64,
        images: &[BucketImage],
    ) -> Result<Vec<u8>, EncodeError> {
        let mut frame = Vec::new();
        self.encode_delta_into(base_epoch, epoch, images, &mut frame)?;
        Ok(frame)
    }

    /// Like [`Self::encode_delta`], appending the frame to `out` (reusing its capacity); returns
    /// the frame's length. On error `out` is unchanged.
    pub fn encode_delta_into(
        &self,
        base_epoch: u64,
        epoch: u64,
        images: &[BucketImage],
        out: &mut Vec<u8>,
    ) -> Result<usize, EncodeError> {
        self.check_delta(base_epoch, epoch, images)?;
        let frame_bytes = HEADER_BYTES + DELTA_PREFIX_BYTES + images.len() * DELTA_IMAGE_BYTES;
        assert!(frame_bytes <= MAX_FRAME_BYTES, "a bounded delta fits one frame");

        out.reserve(frame_bytes);
        let start = out.len();
        write_header(out, FrameKind::Delta, &self.format, self.dc_id, epoch);
        out.extend_from_slice(&base_epoch.to_le_bytes());
        // Bounded by MAX_DELTA_IMAGES above, so the count fits a u32.
        out.extend_from_slice(&(images.len() as u32).to_le_bytes());
        let images_start = out.len();
        out.resize(images_start + images.len() * DELTA_IMAGE_BYTES, 0);
        let (slots, _) = out[images_start..].as_chunks_mut::<DELTA_IMAGE_BYTES>();
        for (slot, image) in slots.iter_mut().zip(images) {
            let (bucket, word) = slot.split_at_mut(4);
            bucket.copy_from_slice(&image.bucket.to_le_bytes());
            word.copy_from_slice(&image.word.to_le_bytes());
        }
        seal(out, start);
        debug_assert_eq!(out.len() - start, frame_bytes);
        Ok(frame_bytes)
    }

    /// Prepare the snapshot of `words` (one per bucket, bucket 0 first) at publication sequence
    /// `epoch`. Nothing is encoded yet: the returned encoder writes one chunk at a time.
    ///
    /// `words` may be borrowed (`&[u64]`) or owned (`Vec<u64>`, `Arc<[u64]>`) so the encoder can
    /// move to whichever thread does the encoding.
    pub fn snapshot<W: AsRef<[u64]>>(
        &self,
        epoch: u64,
        words: W,
    ) -> Result<SnapshotEncoder<W>, EncodeError> {
        let word_count = words.as_ref().len();
        if word_count as u64 != self.format.bucket_count {
            return Err(EncodeError::SnapshotWordCount {
                word_count,
                bucket_count: self.format.bucket_count,
            });
        }
        Ok(SnapshotEncoder {
            encoder: *self,
            epoch,
            words,
            chunk_count: snapshot_chunk_count(self.format.bucket_count),
            chunk_index_next: 0,
        })
    }

    /// Encode every chunk of the snapshot of `words` at once (see [`Self::snapshot`]).
    pub fn encode_snapshot(&self, epoch: u64, words: &[u64]) -> Result<Vec<Vec<u8>>, EncodeError> {
        Ok(self.snapshot(epoch, words)?.collect())
    }

    fn check_delta(
        &self,
        base_epoch: u64,
        epoch: u64,
        images: &[BucketImage],
    ) -> Result<(), EncodeError> {
        if images.is_empty() {
            return Err(EncodeError::EmptyDelta);
        }
        if images.len() > MAX_DELTA_IMAGES {
            return Err(EncodeError::TooManyDeltaImages { image_count: images.len() });
        }
        if base_epoch.checked_add(1) != Some(epoch) {
            return Err(EncodeError::DeltaNotContiguous { base_epoch, epoch });
        }
        let bucket_count = self.format.bucket_count;
        let mut previous_bucket = None;
        for (image_index, image) in images.iter().enumerate() {
            if u64::from(image.bucket) >= bucket_count {
                return Err(EncodeError::BucketOutOfRange {
                    image_index,
                    bucket: image.bucket,
                    bucket_count,
                });
            }
            if let Some(previous_bucket) = previous_bucket
                && image.bucket <= previous_bucket
            {
                return Err(EncodeError::ImagesNotAscending {
                    image_index,
                    previous_bucket,
                    bucket: image.bucket,
                });
            }
            previous_bucket = Some(image.bucket);
        }
        Ok(())
    }
}

/// Writes the chunks of one snapshot, lazily: as an iterator of frames in chunk order, or one
/// chosen chunk at a time.
///
/// Chunk `i` covers buckets `[i * 524288, min(bucket_count, (i + 1) * 524288))`; every chunk
/// carries the snapshot's epoch in its header.
#[derive(Debug, Clone)]
pub struct SnapshotEncoder<W> {
    encoder: FrameEncoder,
    epoch: u64,
    words: W,
    chunk_count: u32,
    chunk_index_next: u32,
}

impl<W: AsRef<[u64]>> SnapshotEncoder<W> {
    /// The snapshot's publication sequence, carried by every chunk.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Chunks in this snapshot: `ceil(bucket_count / 524288)`.
    #[must_use]
    pub fn chunk_count(&self) -> u32 {
        self.chunk_count
    }

    /// Length of chunk `chunk_index`'s frame, at most [`MAX_FRAME_BYTES`].
    pub fn chunk_frame_bytes(&self, chunk_index: u32) -> Result<usize, EncodeError> {
        let (first_bucket, last_bucket) = self.chunk_buckets(chunk_index)?;
        Ok(HEADER_BYTES + CHUNK_PREFIX_BYTES + (last_bucket - first_bucket) * WORD_BYTES)
    }

    /// Encode chunk `chunk_index` into a new frame.
    pub fn encode_chunk(&self, chunk_index: u32) -> Result<Vec<u8>, EncodeError> {
        let mut frame = Vec::new();
        self.encode_chunk_into(chunk_index, &mut frame)?;
        Ok(frame)
    }

    /// Encode chunk `chunk_index`, appending the frame to `out` (reusing its capacity); returns
    /// the frame's length. On error `out` is unchanged.
    pub fn encode_chunk_into(
        &self,
        chunk_index: u32,
        out: &mut Vec<u8>,
    ) -> Result<usize, EncodeError> {
        let (first_bucket, last_bucket) = self.chunk_buckets(chunk_index)?;
        let words = &self.words.as_ref()[first_bucket..last_bucket];
        let frame_bytes = HEADER_BYTES + CHUNK_PREFIX_BYTES + words.len() * WORD_BYTES;
        assert!(frame_bytes <= MAX_FRAME_BYTES, "a chunk fits one frame");

        out.reserve(frame_bytes);
        let start = out.len();
        let format = &self.encoder.format;
        write_header(out, FrameKind::SnapshotChunk, format, self.encoder.dc_id, self.epoch);
        out.extend_from_slice(&chunk_index.to_le_bytes());
        out.extend_from_slice(&self.chunk_count.to_le_bytes());
        out.extend_from_slice(&(first_bucket as u64).to_le_bytes());
        let words_start = out.len();
        out.resize(words_start + words.len() * WORD_BYTES, 0);
        let (slots, _) = out[words_start..].as_chunks_mut::<WORD_BYTES>();
        for (slot, word) in slots.iter_mut().zip(words) {
            *slot = word.to_le_bytes();
        }
        seal(out, start);
        debug_assert_eq!(out.len() - start, frame_bytes);
        Ok(frame_bytes)
    }

    /// Give back the words (for example to release a shared snapshot).
    pub fn into_words(self) -> W {
        self.words
    }

    /// The bucket range `[first, last)` of chunk `chunk_index`.
    fn chunk_buckets(&self, chunk_index: u32) -> Result<(usize, usize), EncodeError> {
        if chunk_index >= self.chunk_count {
            return Err(EncodeError::ChunkIndexOutOfRange {
                chunk_index,
                chunk_count: self.chunk_count,
            });
        }
        let bucket_count = self.words.as_ref().len();
        let first_bucket = chunk_index as usize * SNAPSHOT_CHUNK_BUCKETS;
        let last_bucket = bucket_count.min(first_bucket + SNAPSHOT_CHUNK_BUCKETS);
        debug_assert!(first_bucket < last_bucket, "every chunk carries at least one word");
        Ok((first_bucket, last_bucket))
    }
}

impl<W: AsRef<[u64]>> Iterator for SnapshotEncoder<W> {
    type Item = Vec<u8>;

    /// The next chunk's frame, in chunk order.
    fn next(&mut self) -> Option<Vec<u8>> {
        let frame = self.encode_chunk(self.chunk_index_next).ok()?;
        self.chunk_index_next += 1;
        Some(frame)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let remaining = (self.chunk_count - self.chunk_index_next) as usize;
        (remaining, Some(remaining))
    }
}

impl<W: AsRef<[u64]>> ExactSizeIterator for SnapshotEncoder<W> {}

/// Patch the checksum of the frame starting at `start` (whose body is complete) into its header.
fn seal(out: &mut [u8], start: usize) {
    let (header, body) = out[start..].split_at_mut(HEADER_BYTES);
    header[CHECKSUM_OFFSET..].copy_from_slice(&body_checksum(body).to_le_bytes());
}
