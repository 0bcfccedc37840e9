//! Structure-aware: a sequence of pool-stream frames into a consumer's `FilterReplica`
//! (snapshot assembly across chunks, deltas, heartbeats) and lookups on it.
//!
//! Frames are either raw bytes or built from fuzzed fields with a correct checksum, so the
//! sequencing and assembly rules are reached, not just the integrity checks.
#![no_main]

use arbitrary::Arbitrary;
use kvrelay_core::filter::cbi1::{CHUNK_PREFIX_BYTES, HEADER_BYTES, MAGIC, WIRE_VERSION};
use kvrelay_core::filter::{FilterFrame, FilterReplica};
use kvrelay_core::model::hashing::SequenceHash;
use kvrelay_fuzz::{DC_ID, FORMATS, fix_cbi1_checksum};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Body {
    Raw(Vec<u8>),
    /// A snapshot chunk: index, count, bucket offset, and `words` words (repeating `pattern`).
    Chunk {
        index: u32,
        count: u32,
        offset: u64,
        words: u16,
        pattern: Vec<u64>,
    },
    /// A delta from `base_epoch` with images `(bucket, word)`.
    Delta {
        base_epoch: u64,
        images: Vec<(u32, u64)>,
        extra_count: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Built {
    flags: u8,
    dc_id_other: bool,
    epoch: u64,
    body: Body,
    corrupt_checksum: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Chunk { base_sequence: u64, sequence: u64, frame: Built },
    Delta { base_sequence: u64, sequence: u64, frame: Built },
    Heartbeat { base_sequence: u64, sequence: u64 },
    Contains(u64),
    Prefix(Vec<u64>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    format: u8,
    ops: Vec<Op>,
}

fn build(format: &kvrelay_core::filter::ckf::CkfFormat, built: &Built) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER_BYTES + CHUNK_PREFIX_BYTES);
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    frame.extend_from_slice(&u16::from(built.flags % 4).to_le_bytes());
    frame.push(format.fingerprint_bits as u8);
    frame.push(format.slots_per_bucket as u8);
    frame.extend_from_slice(&(format.format_version as u16).to_le_bytes());
    frame.extend_from_slice(&format.seed.to_le_bytes());
    frame.extend_from_slice(&format.bucket_count.to_le_bytes());
    frame.extend_from_slice(&(if built.dc_id_other { DC_ID + 1 } else { DC_ID }).to_le_bytes());
    frame.extend_from_slice(&built.epoch.to_le_bytes());
    frame.extend_from_slice(&[0; 4]);
    match &built.body {
        Body::Raw(bytes) => frame.extend_from_slice(bytes),
        Body::Chunk { index, count, offset, words, pattern } => {
            frame.extend_from_slice(&index.to_le_bytes());
            frame.extend_from_slice(&count.to_le_bytes());
            frame.extend_from_slice(&offset.to_le_bytes());
            // `words` words repeating `pattern`, written by doubling (a per-word loop here was
            // most of each execution's time under the coverage instrumentation).
            let start = frame.len();
            let total = usize::from(*words) * 8;
            if pattern.is_empty() {
                frame.resize(start + total, 0);
            } else {
                for value in pattern.iter().take(usize::from(*words)) {
                    frame.extend_from_slice(&value.to_le_bytes());
                }
                while frame.len() < start + total {
                    let have = frame.len() - start;
                    frame.extend_from_within(start..start + have.min(start + total - frame.len()));
                }
            }
        }
        Body::Delta { base_epoch, images, extra_count } => {
            frame.extend_from_slice(&base_epoch.to_le_bytes());
            let count = images.len() as u32 + u32::from(*extra_count % 3);
            frame.extend_from_slice(&count.to_le_bytes());
            for (bucket, word) in images {
                frame.extend_from_slice(&bucket.to_le_bytes());
                frame.extend_from_slice(&word.to_le_bytes());
            }
        }
    }
    fix_cbi1_checksum(&mut frame);
    if built.corrupt_checksum {
        frame[kvrelay_core::filter::cbi1::CHECKSUM_OFFSET] ^= 1;
    }
    frame
}

fuzz_target!(|input: Input| {
    let format = FORMATS[usize::from(input.format) % FORMATS.len()];
    let mut replica = FilterReplica::new(format, DC_ID).expect("the fuzz formats are valid");
    for op in input.ops.iter().take(64) {
        match op {
            Op::Chunk { base_sequence, sequence, frame } => {
                let payload = build(&format, frame);
                let frame = FilterFrame::SnapshotChunk {
                    base_sequence: *base_sequence,
                    sequence: *sequence,
                    payload: &payload,
                };
                let _ = replica.accept(frame);
            }
            Op::Delta { base_sequence, sequence, frame } => {
                let payload = build(&format, frame);
                let frame = FilterFrame::Delta {
                    base_sequence: *base_sequence,
                    sequence: *sequence,
                    payload: &payload,
                };
                let _ = replica.accept(frame);
            }
            Op::Heartbeat { base_sequence, sequence } => {
                let _ = replica.accept(FilterFrame::Heartbeat {
                    base_sequence: *base_sequence,
                    sequence: *sequence,
                });
            }
            Op::Contains(hash) => {
                let _ = replica.contains(SequenceHash(*hash));
            }
            Op::Prefix(hashes) => {
                let hashes: Vec<_> =
                    hashes.iter().take(64).map(|hash| SequenceHash(*hash)).collect();
                if let Some(prefix) = replica.longest_prefix(&hashes) {
                    assert!(prefix <= hashes.len());
                }
            }
        }
        if let Some(words) = replica.words() {
            assert_eq!(words.len() as u64, format.bucket_count);
        }
    }
});
