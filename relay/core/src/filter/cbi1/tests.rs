//! Behaviour of the CBI1 encoder, decoder and snapshot assembler (relay-facts §5, Appendix A).
//!
//! Frames for the rejection tests are built byte by byte by [`RawFrame`], independently of the
//! encoder, so a shared misunderstanding cannot make both sides agree.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::filter::ckf::{BUCKET_COUNT_MAX, BucketImage, CkfFormat, CkfFormatError, DEFAULT_SEED};

const DC_ID: u64 = 0x0123_4567_89ab_cdef;

fn format(bucket_count: u64) -> CkfFormat {
    CkfFormat::v1(DEFAULT_SEED, bucket_count)
}

fn encoder(bucket_count: u64) -> FrameEncoder {
    FrameEncoder::new(format(bucket_count), DC_ID).expect("valid format")
}

fn image(bucket: u32, word: u64) -> BucketImage {
    BucketImage { bucket, word }
}

/// Deterministic, well-mixed words (SplitMix64), with every seventh bucket empty.
fn lane_words(bucket_count: usize, seed: u64) -> Vec<u64> {
    let mut state = seed;
    (0..bucket_count)
        .map(|bucket| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut mixed = state;
            mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            if bucket % 7 == 0 { 0 } else { mixed ^ (mixed >> 31) }
        })
        .collect()
}

fn expect_delta<'a>(frame: Result<Frame<'a>, DecodeError>) -> Delta<'a> {
    match frame {
        Ok(Frame::Delta(delta)) => delta,
        other => panic!("expected a delta, got {other:?}"),
    }
}

fn expect_chunk<'a>(frame: Result<Frame<'a>, DecodeError>) -> SnapshotChunk<'a> {
    match frame {
        Ok(Frame::SnapshotChunk(chunk)) => chunk,
        other => panic!("expected a snapshot chunk, got {other:?}"),
    }
}

/// A frame spelled out field by field; `bytes()` computes the true body checksum.
#[derive(Debug, Clone)]
struct RawFrame {
    magic: [u8; 4],
    wire_version: u16,
    flags: u16,
    fingerprint_bits: u8,
    slots_per_bucket: u8,
    format_version: u16,
    seed: u64,
    bucket_count: u64,
    dc_id: u64,
    epoch: u64,
    body: Vec<u8>,
}

impl RawFrame {
    fn new(flags: u16, bucket_count: u64, epoch: u64, body: Vec<u8>) -> Self {
        RawFrame {
            magic: *b"CBI1",
            wire_version: 1,
            flags,
            fingerprint_bits: 16,
            slots_per_bucket: 4,
            format_version: 1,
            seed: DEFAULT_SEED,
            bucket_count,
            dc_id: DC_ID,
            epoch,
            body,
        }
    }

    fn delta(bucket_count: u64, base_epoch: u64, images: &[(u32, u64)]) -> Self {
        Self::new(2, bucket_count, base_epoch + 1, delta_body(base_epoch, images.len(), images))
    }

    fn chunk(
        bucket_count: u64,
        epoch: u64,
        chunk_index: u32,
        chunk_count: u32,
        bucket_offset: u64,
        words: &[u64],
    ) -> Self {
        Self::new(
            1,
            bucket_count,
            epoch,
            chunk_body(chunk_index, chunk_count, bucket_offset, words),
        )
    }

    fn bytes(&self) -> Vec<u8> {
        let mut frame = Vec::new();
        frame.extend_from_slice(&self.magic);
        frame.extend_from_slice(&self.wire_version.to_le_bytes());
        frame.extend_from_slice(&self.flags.to_le_bytes());
        frame.push(self.fingerprint_bits);
        frame.push(self.slots_per_bucket);
        frame.extend_from_slice(&self.format_version.to_le_bytes());
        frame.extend_from_slice(&self.seed.to_le_bytes());
        frame.extend_from_slice(&self.bucket_count.to_le_bytes());
        frame.extend_from_slice(&self.dc_id.to_le_bytes());
        frame.extend_from_slice(&self.epoch.to_le_bytes());
        let checksum = xxhash_rust::xxh3::xxh3_64(&self.body) as u32;
        frame.extend_from_slice(&checksum.to_le_bytes());
        frame.extend_from_slice(&self.body);
        frame
    }
}

/// A delta body whose claimed `image_count` may disagree with the images written.
fn delta_body(base_epoch: u64, image_count: usize, images: &[(u32, u64)]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&base_epoch.to_le_bytes());
    body.extend_from_slice(&(image_count as u32).to_le_bytes());
    for (bucket, word) in images {
        body.extend_from_slice(&bucket.to_le_bytes());
        body.extend_from_slice(&word.to_le_bytes());
    }
    body
}

fn chunk_body(chunk_index: u32, chunk_count: u32, bucket_offset: u64, words: &[u64]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&chunk_index.to_le_bytes());
    body.extend_from_slice(&chunk_count.to_le_bytes());
    body.extend_from_slice(&bucket_offset.to_le_bytes());
    for word in words {
        body.extend_from_slice(&word.to_le_bytes());
    }
    body
}

/// Recompute the checksum of a (possibly mutated) frame so later checks are reached.
fn reseal(frame: &mut [u8]) {
    if frame.len() >= HEADER_BYTES {
        let checksum = body_checksum(&frame[HEADER_BYTES..]);
        frame[CHECKSUM_OFFSET..HEADER_BYTES].copy_from_slice(&checksum.to_le_bytes());
    }
}

/// What any successfully decoded frame must satisfy, whatever bytes it came from.
fn assert_decoded_frame_is_bounded(frame: &[u8], decoded: &Frame<'_>, expected: &CkfFormat) {
    let header = decoded.header();
    assert_eq!(header.format, *expected);
    assert!(frame.len() <= MAX_FRAME_BYTES);
    match decoded {
        Frame::Delta(delta) => {
            assert_eq!(HEADER_BYTES + 12 + 12 * delta.image_count(), frame.len());
            assert!(delta.image_count() <= MAX_DELTA_IMAGES);
            assert!(delta.images().all(|image| u64::from(image.bucket) < expected.bucket_count));
        }
        Frame::SnapshotChunk(chunk) => {
            assert!(chunk.chunk_index() < chunk.chunk_count());
            assert!(chunk.word_count() <= SNAPSHOT_CHUNK_BUCKETS);
            assert!(chunk.bucket_offset() + chunk.word_count() as u64 <= expected.bucket_count);
            assert_eq!(chunk.words().len(), chunk.word_count());
        }
    }
}

#[test]
fn readme_word_bytes_pack_four_slots_least_significant_first() {
    let slots: [u64; 4] = [0x1234, 0, 0xabcd, 1];
    let word = slots.iter().enumerate().fold(0, |word, (slot, value)| word | value << (16 * slot));
    assert_eq!(word, 0x0001_abcd_0000_1234);

    let frames = encoder(2).encode_snapshot(0, &[word, 0]).expect("encodes");
    assert_eq!(frames.len(), 1);
    let words_at = HEADER_BYTES + CHUNK_PREFIX_BYTES;
    assert_eq!(frames[0][words_at..words_at + 8], [0x34, 0x12, 0x00, 0x00, 0xcd, 0xab, 0x01, 0x00]);

    let chunk = expect_chunk(decode(&frames[0], &format(2)));
    let decoded: Vec<u64> = chunk.words().collect();
    assert_eq!(decoded, [word, 0]);
    let decoded_slots: Vec<u64> = (0..4).map(|slot| decoded[0] >> (16 * slot) & 0xffff).collect();
    assert_eq!(decoded_slots, slots);
}

#[test]
fn empty_delta_with_base_zero_carries_the_golden_checksum() {
    let body = [0u8; 12]; // base_epoch u64le(0) || image_count u32le(0)
    assert_eq!(body_checksum(&body), 0x69c2_a4f0);

    // The same frame spelled out byte by byte, with the golden value as the carried checksum.
    let mut frame = Vec::new();
    frame.extend_from_slice(b"CBI1");
    frame.extend_from_slice(&[0x01, 0x00, 0x02, 0x00, 16, 4, 0x01, 0x00]);
    frame.extend_from_slice(&DEFAULT_SEED.to_le_bytes());
    frame.extend_from_slice(&8u64.to_le_bytes());
    frame.extend_from_slice(&DC_ID.to_le_bytes());
    frame.extend_from_slice(&1u64.to_le_bytes());
    frame.extend_from_slice(&[0xf0, 0xa4, 0xc2, 0x69]);
    frame.extend_from_slice(&body);
    assert_eq!(frame.len(), HEADER_BYTES + 12);

    let delta = expect_delta(decode(&frame, &format(8)));
    assert_eq!(delta.header().body_checksum, 0x69c2_a4f0);
    assert_eq!((delta.base_epoch(), delta.header().epoch, delta.image_count()), (0, 1, 0));

    // The wire admits an empty delta; this producer never writes one.
    assert_eq!(encoder(8).encode_delta(0, 1, &[]), Err(EncodeError::EmptyDelta));
}

#[test]
fn delta_round_trips_absolute_images() {
    let bucket_count = 1 << 10;
    // A final removal travels as an absolute zero image, not as a reset.
    let images = [image(0, 0x0001_abcd_0000_1234), image(17, 0), image(1023, u64::MAX)];
    let encoder = encoder(bucket_count);
    let frame = encoder.encode_delta(41, 42, &images).expect("encodes");
    assert_eq!(frame.len(), HEADER_BYTES + 12 + 12 * images.len());

    let delta = expect_delta(decode(&frame, &format(bucket_count)));
    let header = delta.header();
    assert_eq!(header.kind, FrameKind::Delta);
    assert_eq!(header.format, format(bucket_count));
    assert_eq!((header.dc_id, header.epoch, delta.base_epoch()), (DC_ID, 42, 41));
    assert_eq!(delta.images().collect::<Vec<_>>(), images);

    // Appending into a reused buffer writes the same bytes after what was there.
    let mut buffer = b"previous frame".to_vec();
    let frame_bytes = encoder.encode_delta_into(41, 42, &images, &mut buffer).expect("encodes");
    assert_eq!(frame_bytes, frame.len());
    assert_eq!(&buffer[..14], b"previous frame");
    assert_eq!(&buffer[14..], &frame[..]);

    // Byte-exact against the layout spelled out by hand.
    let by_hand = RawFrame::delta(
        bucket_count,
        41,
        &images.iter().map(|image| (image.bucket, image.word)).collect::<Vec<_>>(),
    );
    assert_eq!(frame, by_hand.bytes());
}

#[test]
fn encoder_bounds_delta_and_snapshot_input() {
    assert_eq!(
        FrameEncoder::new(format(3), DC_ID),
        Err(EncodeError::InvalidFormat(CkfFormatError::BucketCount(3)))
    );
    assert_eq!(
        FrameEncoder::new(CkfFormat { slots_per_bucket: 2, ..format(8) }, DC_ID),
        Err(EncodeError::InvalidFormat(CkfFormatError::SlotsPerBucket(2)))
    );

    let encoder = encoder(8);
    let one = [image(3, 1)];
    let cases: [(u64, u64, Vec<BucketImage>, EncodeError); 8] = [
        (0, 1, vec![], EncodeError::EmptyDelta),
        (5, 7, one.to_vec(), EncodeError::DeltaNotContiguous { base_epoch: 5, epoch: 7 }),
        (5, 5, one.to_vec(), EncodeError::DeltaNotContiguous { base_epoch: 5, epoch: 5 }),
        (
            u64::MAX,
            0,
            one.to_vec(),
            EncodeError::DeltaNotContiguous { base_epoch: u64::MAX, epoch: 0 },
        ),
        (
            0,
            1,
            vec![image(1, 1), image(8, 1)],
            EncodeError::BucketOutOfRange { image_index: 1, bucket: 8, bucket_count: 8 },
        ),
        (
            0,
            1,
            vec![image(1, 1), image(u32::MAX, 1)],
            EncodeError::BucketOutOfRange { image_index: 1, bucket: u32::MAX, bucket_count: 8 },
        ),
        (
            0,
            1,
            vec![image(1, 1), image(2, 1), image(2, 5)],
            EncodeError::ImagesNotAscending { image_index: 2, previous_bucket: 2, bucket: 2 },
        ),
        (
            0,
            1,
            vec![image(4, 1), image(3, 1)],
            EncodeError::ImagesNotAscending { image_index: 1, previous_bucket: 4, bucket: 3 },
        ),
    ];
    for (base_epoch, epoch, images, error) in cases {
        let mut buffer = vec![0xee; 3];
        assert_eq!(
            encoder.encode_delta_into(base_epoch, epoch, &images, &mut buffer),
            Err(error.clone())
        );
        assert_eq!(buffer, [0xee; 3], "a failed encode leaves the buffer untouched: {error}");
    }

    // One image past the frame limit is refused before anything else is looked at.
    let too_many = vec![image(0, 1); MAX_DELTA_IMAGES + 1];
    assert_eq!(
        encoder.encode_delta(7, 9, &too_many),
        Err(EncodeError::TooManyDeltaImages { image_count: MAX_DELTA_IMAGES + 1 })
    );

    assert_eq!(
        encoder.snapshot(0, &[0u64; 7][..]).map(|_| ()),
        Err(EncodeError::SnapshotWordCount { word_count: 7, bucket_count: 8 })
    );
    assert_eq!(
        encoder.snapshot(0, vec![0u64; 9]).map(|_| ()),
        Err(EncodeError::SnapshotWordCount { word_count: 9, bucket_count: 8 })
    );
    let snapshot = encoder.snapshot(0, [0u64; 8]).expect("one word per bucket");
    assert_eq!(
        snapshot.encode_chunk(1),
        Err(EncodeError::ChunkIndexOutOfRange { chunk_index: 1, chunk_count: 1 })
    );
    let mut buffer = vec![1, 2];
    assert!(snapshot.encode_chunk_into(u32::MAX, &mut buffer).is_err());
    assert_eq!(buffer, [1, 2]);
}

#[test]
fn decoder_bounds_frames_before_allocating_images() {
    let expected = format(8);

    // Claimed counts are judged against the frame itself, never used to size anything.
    let claims_u32_max = RawFrame::new(2, 8, 1, delta_body(0, u32::MAX as usize, &[])).bytes();
    assert_eq!(
        decode(&claims_u32_max, &expected),
        Err(DecodeError::TooManyDeltaImages { image_count: u32::MAX })
    );
    let claims_the_maximum =
        RawFrame::new(2, 8, 1, delta_body(0, MAX_DELTA_IMAGES, &[(1, 1)])).bytes();
    assert_eq!(
        decode(&claims_the_maximum, &expected),
        Err(DecodeError::DeltaBodyLength { image_count: MAX_DELTA_IMAGES as u32, body_bytes: 24 })
    );
    // An offset that would overflow when the words are added is a range error, not a panic.
    let overflowing = RawFrame::chunk(8, 0, 0, 1, u64::MAX - 1, &[1, 2, 3]).bytes();
    assert_eq!(
        decode(&overflowing, &expected),
        Err(DecodeError::ChunkOutOfRange {
            bucket_offset: u64::MAX - 1,
            word_count: 3,
            bucket_count: 8
        })
    );
    // An oversized frame is refused on its length alone: not even its body is hashed.
    let oversized = vec![0u8; MAX_FRAME_BYTES + 1];
    assert_eq!(
        decode(&oversized, &expected),
        Err(DecodeError::FrameTooLarge { frame_bytes: MAX_FRAME_BYTES + 1 })
    );

    // Accepted frames are views: images and words are read in place from the input bytes.
    let delta_frame = encoder(8).encode_delta(0, 1, &[image(2, 9), image(5, 0)]).expect("encodes");
    let delta = expect_delta(decode(&delta_frame, &expected));
    let frame_range = delta_frame.as_ptr_range();
    assert!(frame_range.contains(&delta.image_bytes().as_ptr()));
    assert_eq!(delta.image_bytes().len(), 24);

    let chunk_frame = any_chunk_frame(8);
    let chunk = expect_chunk(decode(&chunk_frame, &expected));
    assert!(chunk_frame.as_ptr_range().contains(&chunk.word_bytes().as_ptr()));
    assert_eq!(chunk.word_bytes().len(), 64);
}

/// A single-chunk snapshot of distinct words, for tests that need any valid chunk.
fn any_chunk_frame(bucket_count: u64) -> Vec<u8> {
    let words: Vec<u64> = (1..=bucket_count).collect();
    encoder(bucket_count).snapshot(3, words).expect("valid").encode_chunk(0).expect("chunk 0")
}

#[test]
fn malformed_corrupt_and_drifted_frames_fail_closed() {
    let bucket_count = 8;
    let expected = format(bucket_count);
    let delta = RawFrame::delta(bucket_count, 4, &[(1, 10), (7, 0)]);
    let chunk = RawFrame::chunk(bucket_count, 4, 0, 1, 0, &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert!(decode(&delta.bytes(), &expected).is_ok());
    assert!(decode(&chunk.bytes(), &expected).is_ok());

    let with = |base: &RawFrame, change: &dyn Fn(&mut RawFrame)| {
        let mut frame = base.clone();
        change(&mut frame);
        frame.bytes()
    };
    let mut corrupt_body = delta.bytes();
    corrupt_body[HEADER_BYTES + 13] ^= 0x40;
    let carried = u32::from_le_bytes(corrupt_body[44..48].try_into().expect("4 bytes"));
    let computed = body_checksum(&corrupt_body[HEADER_BYTES..]);
    let mut short_magic = delta.bytes();
    short_magic.truncate(47);
    short_magic[0] = b'X';
    let mut oversized_bad_magic = vec![0u8; MAX_FRAME_BYTES + 1];
    oversized_bad_magic[..4].copy_from_slice(b"XXXX");
    let mut drifted_without_reseal = delta.bytes();
    drifted_without_reseal[12] ^= 1; // seed drift, checksum still matches the body
    let mut body_and_version_broken = corrupt_body.clone();
    body_and_version_broken[4] = 9;

    let cases: Vec<(&str, Vec<u8>, DecodeError)> = vec![
        // 1. length
        ("empty", vec![], DecodeError::Truncated { frame_bytes: 0 }),
        (
            "one short of a header",
            delta.bytes()[..47].to_vec(),
            DecodeError::Truncated { frame_bytes: 47 },
        ),
        (
            "one past the limit",
            vec![0; MAX_FRAME_BYTES + 1],
            DecodeError::FrameTooLarge { frame_bytes: MAX_FRAME_BYTES + 1 },
        ),
        // 2. magic
        (
            "magic",
            with(&delta, &|frame| frame.magic = *b"CBI2"),
            DecodeError::BadMagic { magic: *b"CBI2" },
        ),
        // 3. wire version
        (
            "wire version",
            with(&delta, &|frame| frame.wire_version = 2),
            DecodeError::UnsupportedWireVersion { wire_version: 2 },
        ),
        // 4. checksum
        ("corrupt body", corrupt_body.clone(), DecodeError::ChecksumMismatch { carried, computed }),
        // 5. format drift
        (
            "format version",
            with(&delta, &|frame| frame.format_version = 2),
            DecodeError::FormatVersionMismatch { expected: 1, found: 2 },
        ),
        (
            "fingerprint bits",
            with(&delta, &|frame| frame.fingerprint_bits = 8),
            DecodeError::FingerprintBitsMismatch { expected: 16, found: 8 },
        ),
        (
            "slots per bucket",
            with(&delta, &|frame| frame.slots_per_bucket = 8),
            DecodeError::SlotsPerBucketMismatch { expected: 4, found: 8 },
        ),
        (
            "seed",
            with(&delta, &|frame| frame.seed = 7),
            DecodeError::SeedMismatch { expected: DEFAULT_SEED, found: 7 },
        ),
        (
            "bucket count",
            with(&delta, &|frame| frame.bucket_count = 16),
            DecodeError::BucketCountMismatch { expected: 8, found: 16 },
        ),
        // 6. flags
        ("flags 0", with(&delta, &|frame| frame.flags = 0), DecodeError::UnknownFlags { flags: 0 }),
        ("flags 3", with(&delta, &|frame| frame.flags = 3), DecodeError::UnknownFlags { flags: 3 }),
        // delta body
        (
            "delta prefix cut",
            with(&delta, &|frame| frame.body.truncate(11)),
            DecodeError::DeltaBodyTruncated { body_bytes: 11 },
        ),
        (
            "delta count past the limit",
            with(&delta, &|frame| frame.body = delta_body(4, MAX_DELTA_IMAGES + 1, &[(1, 1)])),
            DecodeError::TooManyDeltaImages { image_count: MAX_DELTA_IMAGES as u32 + 1 },
        ),
        (
            "delta missing an image",
            with(&delta, &|frame| frame.body = delta_body(4, 3, &[(1, 1), (2, 2)])),
            DecodeError::DeltaBodyLength { image_count: 3, body_bytes: 36 },
        ),
        (
            "delta trailing byte",
            with(&delta, &|frame| frame.body.push(0)),
            DecodeError::DeltaBodyLength { image_count: 2, body_bytes: 37 },
        ),
        (
            "delta bucket past the filter",
            with(&delta, &|frame| frame.body = delta_body(4, 2, &[(1, 1), (8, 2)])),
            DecodeError::DeltaBucketOutOfRange { image_index: 1, bucket: 8, bucket_count: 8 },
        ),
        // snapshot chunk body
        (
            "chunk prefix cut",
            with(&chunk, &|frame| frame.body.truncate(15)),
            DecodeError::ChunkBodyTruncated { body_bytes: 15 },
        ),
        (
            "chunk count zero",
            with(&chunk, &|frame| frame.body = chunk_body(0, 0, 0, &[1; 8])),
            DecodeError::ZeroChunkCount,
        ),
        (
            "chunk index at the count",
            with(&chunk, &|frame| frame.body = chunk_body(2, 2, 0, &[1; 8])),
            DecodeError::ChunkIndexOutOfRange { chunk_index: 2, chunk_count: 2 },
        ),
        (
            "chunk words unaligned",
            with(&chunk, &|frame| {
                frame.body.pop();
            }),
            DecodeError::ChunkWordsUnaligned { word_bytes: 63 },
        ),
        (
            "chunk past the last bucket",
            with(&chunk, &|frame| frame.body = chunk_body(0, 1, 1, &[1; 8])),
            DecodeError::ChunkOutOfRange { bucket_offset: 1, word_count: 8, bucket_count: 8 },
        ),
        // `TooManyChunkWords` cannot be reached: more than 524,288 words make the frame longer
        // than MAX_FRAME_BYTES, which is refused first (see the size-limit test).

        // An earlier check wins when two are broken.
        ("truncated before magic", short_magic, DecodeError::Truncated { frame_bytes: 47 }),
        (
            "too large before magic",
            oversized_bad_magic,
            DecodeError::FrameTooLarge { frame_bytes: MAX_FRAME_BYTES + 1 },
        ),
        (
            "magic before version",
            with(&delta, &|frame| {
                frame.magic = *b"XBI1";
                frame.wire_version = 0;
            }),
            DecodeError::BadMagic { magic: *b"XBI1" },
        ),
        (
            "version before checksum",
            body_and_version_broken,
            DecodeError::UnsupportedWireVersion { wire_version: 9 },
        ),
        (
            "checksum before format",
            {
                let mut frame = corrupt_body.clone();
                frame[8] = 8; // fingerprint bits, header-only: the body is still corrupt
                frame
            },
            DecodeError::ChecksumMismatch { carried, computed },
        ),
        (
            "format version before seed",
            with(&delta, &|frame| {
                frame.format_version = 3;
                frame.seed = 1;
            }),
            DecodeError::FormatVersionMismatch { expected: 1, found: 3 },
        ),
        (
            "seed before bucket count",
            with(&delta, &|frame| {
                frame.seed = 1;
                frame.bucket_count = 4;
            }),
            DecodeError::SeedMismatch { expected: DEFAULT_SEED, found: 1 },
        ),
        (
            "header-only seed drift",
            drifted_without_reseal,
            DecodeError::SeedMismatch { expected: DEFAULT_SEED, found: DEFAULT_SEED ^ 1 },
        ),
        (
            "bucket count before flags",
            with(&delta, &|frame| {
                frame.bucket_count = 4;
                frame.flags = 9;
            }),
            DecodeError::BucketCountMismatch { expected: 8, found: 4 },
        ),
        (
            "flags before body",
            with(&delta, &|frame| {
                frame.flags = 4;
                frame.body.clear();
            }),
            DecodeError::UnknownFlags { flags: 4 },
        ),
        (
            "image limit before body length",
            with(&delta, &|frame| frame.body = delta_body(4, u32::MAX as usize, &[(9, 9)])),
            DecodeError::TooManyDeltaImages { image_count: u32::MAX },
        ),
        (
            "body length before buckets",
            with(&delta, &|frame| {
                frame.body = delta_body(4, 2, &[(9, 9), (10, 10)]);
                frame.body.push(0);
            }),
            DecodeError::DeltaBodyLength { image_count: 2, body_bytes: 37 },
        ),
        (
            "zero chunk count before alignment",
            with(&chunk, &|frame| {
                frame.body = chunk_body(0, 0, 9, &[1]);
                frame.body.push(0);
            }),
            DecodeError::ZeroChunkCount,
        ),
        (
            "chunk index before alignment",
            with(&chunk, &|frame| {
                frame.body = chunk_body(5, 1, 9, &[1]);
                frame.body.push(0);
            }),
            DecodeError::ChunkIndexOutOfRange { chunk_index: 5, chunk_count: 1 },
        ),
        (
            "alignment before range",
            with(&chunk, &|frame| {
                frame.body = chunk_body(0, 1, 9, &[1]);
                frame.body.push(0);
            }),
            DecodeError::ChunkWordsUnaligned { word_bytes: 9 },
        ),
    ];
    for (name, frame, error) in cases {
        assert_eq!(decode(&frame, &expected), Err(error), "{name}");
    }

    // The expected format itself must be executable, whatever the frame.
    assert_eq!(
        decode(&delta.bytes(), &format(3)),
        Err(DecodeError::ExpectedFormat(CkfFormatError::BucketCount(3)))
    );
}

#[test]
fn consumers_reject_valid_frames_from_another_dc() {
    let frame = encoder(8).encode_delta(0, 1, &[image(1, 1)]).expect("encodes");
    assert!(decode_for_pool(&frame, &format(8), DC_ID).is_ok());
    assert_eq!(
        decode_for_pool(&frame, &format(8), 7),
        Err(DecodeError::DcIdMismatch { expected: 7, found: DC_ID })
    );
    let decoded = decode(&frame, &format(8)).expect("valid");
    assert_eq!(decoded.header().ensure_dc_id(DC_ID), Ok(()));

    // The frame's own defects are still reported first.
    let mut corrupt = frame.clone();
    corrupt[HEADER_BYTES] ^= 1;
    assert!(matches!(
        decode_for_pool(&corrupt, &format(8), 7),
        Err(DecodeError::ChecksumMismatch { .. })
    ));
}

#[test]
fn snapshot_chunks_rebuild_exact_lane_and_reject_reordering() {
    let bucket_count = 1u64 << 20;
    let expected = format(bucket_count);
    let words = lane_words(bucket_count as usize, 11);
    let encoder = encoder(bucket_count);
    let frames = encoder.encode_snapshot(9, &words).expect("encodes");
    assert_eq!(frames.len(), 2);
    for (chunk_index, frame) in frames.iter().enumerate() {
        assert_eq!(frame.len(), MAX_FRAME_BYTES);
        let chunk = expect_chunk(decode(frame, &expected));
        assert_eq!(chunk.header().epoch, 9);
        assert_eq!((chunk.chunk_index(), chunk.chunk_count()), (chunk_index as u32, 2));
        assert_eq!(chunk.bucket_offset(), chunk_index as u64 * SNAPSHOT_CHUNK_BUCKETS as u64);
        assert_eq!(chunk.word_count(), SNAPSHOT_CHUNK_BUCKETS);
    }
    let (first, second) =
        (expect_chunk(decode(&frames[0], &expected)), expect_chunk(decode(&frames[1], &expected)));

    // In order: the exact lane, and only once the last chunk is in.
    let mut assembler = SnapshotAssembler::new();
    assert_eq!(assembler.accept(&first), Ok(None));
    assert!(assembler.is_assembling());
    let snapshot = assembler.accept(&second).expect("in order").expect("complete");
    assert!(!assembler.is_assembling());
    assert_eq!((snapshot.epoch(), snapshot.format()), (9, &expected));
    assert_eq!(snapshot.words(), &words[..]);
    let nonzero: Vec<BucketImage> = words
        .iter()
        .enumerate()
        .filter(|(_, word)| **word != 0)
        .map(|(bucket, &word)| image(bucket as u32, word))
        .collect();
    assert_eq!(snapshot.nonzero_images().collect::<Vec<_>>(), nonzero);
    assert_eq!(snapshot.into_words(), words);

    // Reordered: a later chunk cannot start a snapshot.
    let not_started =
        AssemblyError::ChunkSequence(ChunkSequenceError::NotStarted { chunk_index: 1 });
    assert_eq!(assembler.accept(&second), Err(not_started.clone()));
    // Duplicated chunk 0 restarts the assembly; the snapshot still completes exactly.
    assert_eq!(assembler.accept(&first), Ok(None));
    assert_eq!(assembler.accept(&first), Ok(None));
    let snapshot = assembler.accept(&second).expect("in order").expect("complete");
    assert_eq!(snapshot.words(), &words[..]);
    // Duplicated last chunk: the snapshot is over, nothing to continue.
    assert_eq!(assembler.accept(&second), Err(not_started.clone()));

    // Mixed epochs: chunk 1 of the next snapshot does not finish this one, and nothing leaks.
    let next_frames = encoder.snapshot(10, &words[..]).expect("valid").collect::<Vec<_>>();
    let next_second = expect_chunk(decode(&next_frames[1], &expected));
    assert_eq!(assembler.accept(&first), Ok(None));
    assert_eq!(
        assembler.accept(&next_second),
        Err(AssemblyError::ChunkSequence(ChunkSequenceError::Epoch { expected: 9, found: 10 }))
    );
    assert!(!assembler.is_assembling(), "a broken sequence abandons the assembly");
    assert_eq!(assembler.accept(&second), Err(not_started));
}

#[test]
fn snapshot_assembly_rejects_skips_gaps_and_partial_coverage() {
    // The wire allows any chunking that covers the filter; four chunks of two words here.
    let expected = format(8);
    let frames: Vec<Vec<u8>> = (0..4u32)
        .map(|index| {
            let offset = u64::from(index) * 2;
            RawFrame::chunk(8, 5, index, 4, offset, &[offset + 1, offset + 2]).bytes()
        })
        .collect();
    let chunks: Vec<SnapshotChunk<'_>> =
        frames.iter().map(|frame| expect_chunk(decode(frame, &expected))).collect();
    let sequence_error = |error| Err(AssemblyError::ChunkSequence(error));

    let mut assembler = SnapshotAssembler::new();
    for chunk in &chunks[..3] {
        assert_eq!(assembler.accept(chunk), Ok(None));
    }
    let snapshot = assembler.accept(&chunks[3]).expect("in order").expect("complete");
    assert_eq!(snapshot.words(), &[1, 2, 3, 4, 5, 6, 7, 8]);

    // Skipped.
    assert_eq!(assembler.accept(&chunks[0]), Ok(None));
    assert_eq!(
        assembler.accept(&chunks[2]),
        sequence_error(ChunkSequenceError::ChunkIndex { expected: 1, found: 2 })
    );
    // Duplicated in the middle.
    assembler.accept(&chunks[0]).expect("restart");
    assembler.accept(&chunks[1]).expect("next");
    assert_eq!(
        assembler.accept(&chunks[1]),
        sequence_error(ChunkSequenceError::ChunkIndex { expected: 2, found: 1 })
    );

    let odd_chunk = |raw: RawFrame, format: &CkfFormat| {
        let bytes = raw.bytes();
        let mut assembler = SnapshotAssembler::new();
        assembler.accept(&chunks[0]).expect("chunk 0 starts");
        let result = assembler.accept(&expect_chunk(decode(&bytes, format)));
        assert!(!assembler.is_assembling());
        result
    };
    assert_eq!(
        odd_chunk(RawFrame::chunk(8, 5, 1, 5, 2, &[3, 4]), &expected),
        sequence_error(ChunkSequenceError::ChunkCount { expected: 4, found: 5 })
    );
    assert_eq!(
        odd_chunk(RawFrame::chunk(8, 5, 1, 4, 3, &[3, 4]), &expected),
        sequence_error(ChunkSequenceError::BucketOffset { expected: 2, found: 3 })
    );
    assert_eq!(
        odd_chunk(RawFrame::chunk(16, 5, 1, 4, 2, &[3, 4]), &format(16)),
        sequence_error(ChunkSequenceError::BucketCount { expected: 8, found: 16 })
    );

    // Chunk 0 must start at bucket 0.
    let late_start = RawFrame::chunk(8, 5, 0, 4, 2, &[3, 4]).bytes();
    assert_eq!(
        SnapshotAssembler::new().accept(&expect_chunk(decode(&late_start, &expected))),
        sequence_error(ChunkSequenceError::BucketOffset { expected: 0, found: 2 })
    );

    // The last chunk arrives in sequence but the buckets are not all covered.
    let halves: Vec<Vec<u8>> = (0..2u32)
        .map(|index| RawFrame::chunk(8, 5, index, 2, u64::from(index) * 2, &[1, 2]).bytes())
        .collect();
    let mut assembler = SnapshotAssembler::new();
    assert_eq!(assembler.accept(&expect_chunk(decode(&halves[0], &expected))), Ok(None));
    assert_eq!(
        assembler.accept(&expect_chunk(decode(&halves[1], &expected))),
        Err(AssemblyError::IncompleteCoverage { covered_buckets: 4, bucket_count: 8 })
    );
    assert!(!assembler.is_assembling());
    let empty_single = RawFrame::chunk(8, 5, 0, 1, 0, &[]).bytes();
    assert_eq!(
        assembler.accept(&expect_chunk(decode(&empty_single, &expected))),
        Err(AssemblyError::IncompleteCoverage { covered_buckets: 0, bucket_count: 8 })
    );

    // An explicit reset abandons a partial snapshot.
    assembler.accept(&chunks[0]).expect("chunk 0 starts");
    assembler.reset();
    assert!(matches!(
        assembler.accept(&chunks[1]),
        Err(AssemblyError::ChunkSequence(ChunkSequenceError::NotStarted { chunk_index: 1 }))
    ));
}

#[test]
fn frame_size_limits_hold_at_the_bound_and_one_past() {
    assert_eq!((MAX_FRAME_BYTES, MAX_DELTA_IMAGES), (4_194_368, 349_525));
    assert_eq!(snapshot_chunk_count(2), 1);
    assert_eq!(snapshot_chunk_count(SNAPSHOT_CHUNK_BUCKETS as u64), 1);
    assert_eq!(snapshot_chunk_count(SNAPSHOT_CHUNK_BUCKETS as u64 + 1), 2);
    assert_eq!(snapshot_chunk_count(BUCKET_COUNT_MAX), 32);

    // A full chunk is exactly the largest frame, and decodes.
    let bucket_count = SNAPSHOT_CHUNK_BUCKETS as u64;
    let expected = format(bucket_count);
    let words = lane_words(SNAPSHOT_CHUNK_BUCKETS, 3);
    let snapshot = encoder(bucket_count).snapshot(0, &words[..]).expect("valid");
    assert_eq!(snapshot.chunk_frame_bytes(0), Ok(MAX_FRAME_BYTES));
    let full_chunk = snapshot.encode_chunk(0).expect("encodes");
    assert_eq!(full_chunk.len(), 4_194_368);
    assert_eq!(expect_chunk(decode(&full_chunk, &expected)).word_count(), SNAPSHOT_CHUNK_BUCKETS);
    // One more word is one frame too many.
    let mut one_word_more = full_chunk.clone();
    one_word_more.extend_from_slice(&[0; 8]);
    reseal(&mut one_word_more);
    assert_eq!(
        decode(&one_word_more, &expected),
        Err(DecodeError::FrameTooLarge { frame_bytes: MAX_FRAME_BYTES + 8 })
    );

    // The largest delta fits; one more image does not.
    let images: Vec<BucketImage> =
        (0..MAX_DELTA_IMAGES as u32).map(|bucket| image(bucket, u64::from(bucket) | 1)).collect();
    let encoder = encoder(bucket_count);
    let largest = encoder.encode_delta(0, 1, &images).expect("at the bound");
    assert_eq!(largest.len(), HEADER_BYTES + 12 + 12 * MAX_DELTA_IMAGES);
    assert!(largest.len() <= MAX_FRAME_BYTES);
    let delta = expect_delta(decode(&largest, &expected));
    assert_eq!(delta.image_count(), MAX_DELTA_IMAGES);
    assert!(delta.images().eq(images.iter().copied()));

    let mut one_image_more = images.clone();
    one_image_more.push(image(MAX_DELTA_IMAGES as u32, 1));
    assert_eq!(
        encoder.encode_delta(0, 1, &one_image_more),
        Err(EncodeError::TooManyDeltaImages { image_count: MAX_DELTA_IMAGES + 1 })
    );
    // On the wire, that many images no longer fit the frame limit.
    let pairs: Vec<(u32, u64)> = one_image_more.iter().map(|i| (i.bucket, i.word)).collect();
    let oversized_delta = RawFrame::delta(bucket_count, 0, &pairs).bytes();
    assert_eq!(
        decode(&oversized_delta, &expected),
        Err(DecodeError::FrameTooLarge { frame_bytes: MAX_FRAME_BYTES + 4 })
    );
}

#[test]
fn snapshot_encoder_yields_chunks_lazily_into_reused_buffers() {
    let bucket_count = 1u64 << 21;
    let words: Arc<[u64]> = lane_words(bucket_count as usize, 5).into();
    let encoder = encoder(bucket_count);
    let mut snapshot = encoder.snapshot(77, Arc::clone(&words)).expect("valid");
    assert_eq!((snapshot.epoch(), snapshot.chunk_count(), snapshot.len()), (77, 4, 4));

    // Chunks on demand, in any order, appended to one buffer.
    let mut buffer = Vec::new();
    let mut ends = Vec::new();
    for chunk_index in [2, 0] {
        let frame_bytes = snapshot.encode_chunk_into(chunk_index, &mut buffer).expect("encodes");
        assert_eq!(Ok(frame_bytes), snapshot.chunk_frame_bytes(chunk_index));
        ends.push(buffer.len());
    }
    assert_eq!(&buffer[..ends[0]], &snapshot.encode_chunk(2).expect("encodes")[..]);
    assert_eq!(&buffer[ends[0]..ends[1]], &snapshot.encode_chunk(0).expect("encodes")[..]);

    // As an iterator: one frame at a time, in chunk order, then the words come back.
    let first = snapshot.next().expect("chunk 0");
    assert_eq!(snapshot.len(), 3);
    let rest: Vec<Vec<u8>> = snapshot.by_ref().collect();
    assert_eq!(rest.len(), 3);
    assert_eq!(snapshot.next(), None);
    assert!(Arc::ptr_eq(&snapshot.into_words(), &words));

    let mut assembler = SnapshotAssembler::new();
    let mut assembled = None;
    for frame in std::iter::once(&first).chain(&rest) {
        assembled =
            assembler.accept(&expect_chunk(decode(frame, &format(bucket_count)))).expect("ok");
    }
    assert_eq!(assembled.expect("complete").words(), &words[..]);
}

/// A random valid frame: a delta or a single-chunk snapshot over a small filter.
fn valid_frame() -> impl Strategy<Value = (u64, Vec<u8>)> {
    let delta =
        (1u32..=8, any::<u64>(), prop::collection::btree_map(any::<u32>(), any::<u64>(), 1..20))
            .prop_map(|(log2, base, images)| {
                let bucket_count = 1u64 << log2;
                let images: BTreeMap<u32, u64> = images
                    .into_iter()
                    .map(|(bucket, word)| (bucket % bucket_count as u32, word))
                    .collect();
                let images: Vec<BucketImage> =
                    images.into_iter().map(|(bucket, word)| image(bucket, word)).collect();
                let base = base.min(u64::MAX - 1);
                (
                    bucket_count,
                    encoder(bucket_count).encode_delta(base, base + 1, &images).expect("valid"),
                )
            });
    let snapshot = (1u32..=8, any::<u64>(), any::<u64>()).prop_map(|(log2, epoch, seed)| {
        let bucket_count = 1u64 << log2;
        let words = lane_words(bucket_count as usize, seed);
        let frame = encoder(bucket_count).snapshot(epoch, words).expect("valid").encode_chunk(0);
        (bucket_count, frame.expect("encodes"))
    });
    prop_oneof![delta, snapshot]
}

proptest! {
    #[test]
    fn decoder_never_panics_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..200),
        log2 in 1u32..=24,
    ) {
        let expected = format(1 << log2);
        if let Ok(decoded) = decode(&bytes, &expected) {
            assert_decoded_frame_is_bounded(&bytes, &decoded, &expected);
        }
    }

    #[test]
    fn decoder_never_panics_on_arbitrary_bodies_behind_a_sealed_header(
        flags in prop_oneof![Just(1u16), Just(2u16), any::<u16>()],
        body in prop::collection::vec(any::<u8>(), 0..200),
        log2 in 1u32..=6,
    ) {
        let bucket_count = 1u64 << log2;
        let expected = format(bucket_count);
        let frame = RawFrame::new(flags, bucket_count, 1, body).bytes();
        if let Ok(decoded) = decode(&frame, &expected) {
            assert_decoded_frame_is_bounded(&frame, &decoded, &expected);
        }
    }

    #[test]
    fn decoder_never_panics_on_mutated_valid_frames(
        (bucket_count, frame) in valid_frame(),
        mutations in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..8),
        truncate_to in prop::option::of(any::<prop::sample::Index>()),
        sealed in any::<bool>(),
    ) {
        let expected = format(bucket_count);
        let mut frame = frame;
        for (position, flip) in mutations {
            let at = position.index(frame.len());
            frame[at] ^= flip;
        }
        if let Some(length) = truncate_to {
            frame.truncate(length.index(frame.len() + 1));
        }
        if sealed {
            reseal(&mut frame);
        }
        if let Ok(decoded) = decode(&frame, &expected) {
            assert_decoded_frame_is_bounded(&frame, &decoded, &expected);
        }
    }

    #[test]
    fn random_deltas_round_trip(
        log2 in 1u32..=16,
        base_epoch in 0..u64::MAX,
        dc_id in any::<u64>(),
        images in prop::collection::btree_map(any::<u32>(), any::<u64>(), 1..200),
    ) {
        let bucket_count = 1u64 << log2;
        let images: BTreeMap<u32, u64> =
            images.into_iter().map(|(bucket, word)| (bucket % bucket_count as u32, word)).collect();
        let images: Vec<BucketImage> =
            images.into_iter().map(|(bucket, word)| image(bucket, word)).collect();
        let encoder = FrameEncoder::new(format(bucket_count), dc_id).expect("valid");
        let frame = encoder.encode_delta(base_epoch, base_epoch + 1, &images).expect("valid");
        let delta = expect_delta(decode_for_pool(&frame, &format(bucket_count), dc_id));
        prop_assert_eq!(delta.base_epoch(), base_epoch);
        prop_assert_eq!(delta.header().epoch, base_epoch + 1);
        prop_assert_eq!(delta.images().collect::<Vec<_>>(), images);
    }

    #[test]
    fn random_snapshots_round_trip(
        log2 in 1u32..=12,
        epoch in any::<u64>(),
        seed in any::<u64>(),
        sparse in any::<bool>(),
    ) {
        let bucket_count = 1u64 << log2;
        let mut words = lane_words(bucket_count as usize, seed);
        if sparse {
            words.iter_mut().enumerate().for_each(|(bucket, word)| *word &= (bucket % 5 == 0) as u64 * u64::MAX);
        }
        let expected = format(bucket_count);
        let frames = encoder(bucket_count).encode_snapshot(epoch, &words).expect("valid");
        prop_assert_eq!(frames.len(), 1);
        let mut assembler = SnapshotAssembler::new();
        let snapshot = assembler
            .accept(&expect_chunk(decode(&frames[0], &expected)))
            .expect("in order")
            .expect("one chunk completes a small snapshot");
        prop_assert_eq!(snapshot.epoch(), epoch);
        prop_assert_eq!(snapshot.words(), &words[..]);
    }
}
