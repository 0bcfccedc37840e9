//! Tests of the consumer filter replica against frames from the real producer and encoder.

use super::*;
use crate::filter::cbi1::FrameEncoder;
use crate::filter::ckf::{BucketImage, CuckooFilter, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::rng::rng_from_seed;

const DC: u64 = 0x04f1_10c9_8b1b_fc48;

fn format(buckets: u64) -> CkfFormat {
    CkfFormat::v1(DEFAULT_SEED, buckets)
}

fn snapshot_frames(format: CkfFormat, sequence: u64, words: &[u64]) -> Vec<Vec<u8>> {
    FrameEncoder::new(format, DC).unwrap().encode_snapshot(sequence, words).unwrap()
}

fn install(replica: &mut FilterReplica, frames: &[Vec<u8>], sequence: u64) {
    for frame in frames {
        replica
            .accept(FilterFrame::SnapshotChunk {
                base_sequence: sequence,
                sequence,
                payload: frame,
            })
            .unwrap();
    }
}

#[test]
fn filter_is_installed_only_after_the_whole_snapshot() {
    let format = format(1 << 20); // two chunks
    let mut words = vec![0u64; 1 << 20];
    words[5] = 0x1234;
    words[(1 << 20) - 1] = 7;
    let frames = snapshot_frames(format, 9, &words);
    assert_eq!(frames.len(), 2);
    let mut replica = FilterReplica::new(format, DC).unwrap();
    let progress = replica
        .accept(FilterFrame::SnapshotChunk { base_sequence: 9, sequence: 9, payload: &frames[0] })
        .unwrap();
    assert_eq!(progress, ReplicaProgress::Assembling);
    assert_eq!(replica.words(), None);
    assert_eq!(replica.contains(SequenceHash(1)), None);
    let progress = replica
        .accept(FilterFrame::SnapshotChunk { base_sequence: 9, sequence: 9, payload: &frames[1] })
        .unwrap();
    assert_eq!(progress, ReplicaProgress::Installed { sequence: 9 });
    assert_eq!(replica.words().unwrap(), &words[..]);
}

#[test]
fn deltas_apply_only_when_contiguous_and_heartbeats_confirm_the_sequence() {
    let format = format(64);
    let encoder = FrameEncoder::new(format, DC).unwrap();
    let mut replica = FilterReplica::new(format, DC).unwrap();
    install(&mut replica, &snapshot_frames(format, 3, &[0; 64]), 3);
    let delta = encoder.encode_delta(3, 4, &[BucketImage { bucket: 2, word: 9 }]).unwrap();
    assert_eq!(
        replica.accept(FilterFrame::Delta { base_sequence: 3, sequence: 4, payload: &delta }),
        Ok(ReplicaProgress::Applied { sequence: 4 })
    );
    assert_eq!(replica.words().unwrap()[2], 9);
    assert_eq!(
        replica.accept(FilterFrame::Heartbeat { base_sequence: 4, sequence: 4 }),
        Ok(ReplicaProgress::Confirmed)
    );
    // The next delta may write the same buckets again (and its neighbours in the same word).
    let again = [BucketImage { bucket: 2, word: 10 }, BucketImage { bucket: 3, word: 11 }];
    let delta = encoder.encode_delta(4, 5, &again).unwrap();
    assert_eq!(
        replica.accept(FilterFrame::Delta { base_sequence: 4, sequence: 5, payload: &delta }),
        Ok(ReplicaProgress::Applied { sequence: 5 })
    );
    assert_eq!(&replica.words().unwrap()[2..4], &[10, 11]);
    let delta = encoder.encode_delta(5, 6, &[BucketImage { bucket: 3, word: 12 }]).unwrap();
    assert_eq!(
        replica.accept(FilterFrame::Delta { base_sequence: 5, sequence: 6, payload: &delta }),
        Ok(ReplicaProgress::Applied { sequence: 6 })
    );
    let gap = encoder.encode_delta(7, 8, &[BucketImage { bucket: 2, word: 1 }]).unwrap();
    assert_eq!(
        replica.accept(FilterFrame::Delta { base_sequence: 7, sequence: 8, payload: &gap }),
        Err(ReplicaFault::NonContiguous { current: 6, base: 7 })
    );
    assert!(replica.is_invalid());
    assert_eq!(replica.contains(SequenceHash(1)), None);
    assert_eq!(
        replica.accept(FilterFrame::Heartbeat { base_sequence: 6, sequence: 6 }),
        Err(ReplicaFault::Invalid)
    );
}

#[test]
fn lane_faults_invalidate_the_replica() {
    let format = format(64);
    let encoder = FrameEncoder::new(format, DC).unwrap();
    let ready = || {
        let mut replica = FilterReplica::new(format, DC).unwrap();
        install(&mut replica, &snapshot_frames(format, 0, &[0; 64]), 0);
        replica
    };
    let mut snapshot_again = ready();
    let frames = snapshot_frames(format, 0, &[0; 64]);
    assert_eq!(
        snapshot_again.accept(FilterFrame::SnapshotChunk {
            base_sequence: 0,
            sequence: 0,
            payload: &frames[0]
        }),
        Err(ReplicaFault::SnapshotWhileReady)
    );
    let mut heartbeat = ready();
    assert_eq!(
        heartbeat.accept(FilterFrame::Heartbeat { base_sequence: 1, sequence: 1 }),
        Err(ReplicaFault::HeartbeatMismatch { current: 0, heartbeat: 1 })
    );
    // A hand-built empty delta (the encoder refuses to make one).
    let mut empty = ready();
    let mut body = Vec::new();
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    let frame = hand_frame(format, 2, 1, &body);
    assert_eq!(
        empty.accept(FilterFrame::Delta { base_sequence: 0, sequence: 1, payload: &frame }),
        Err(ReplicaFault::EmptyDelta)
    );
    let mut duplicate = ready();
    let mut body = Vec::new();
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&2u32.to_le_bytes());
    for word in [1u64, 2] {
        body.extend_from_slice(&7u32.to_le_bytes());
        body.extend_from_slice(&word.to_le_bytes());
    }
    let frame = hand_frame(format, 2, 1, &body);
    assert_eq!(
        duplicate.accept(FilterFrame::Delta { base_sequence: 0, sequence: 1, payload: &frame }),
        Err(ReplicaFault::DuplicateImage(7))
    );
    let mut wrong_dc = ready();
    let foreign = FrameEncoder::new(format, DC + 1)
        .unwrap()
        .encode_delta(0, 1, &[BucketImage { bucket: 1, word: 1 }])
        .unwrap();
    assert!(matches!(
        wrong_dc.accept(FilterFrame::Delta { base_sequence: 0, sequence: 1, payload: &foreign }),
        Err(ReplicaFault::Decode(_))
    ));
    let mut mismatched = ready();
    let delta = encoder.encode_delta(0, 1, &[BucketImage { bucket: 1, word: 1 }]).unwrap();
    assert!(matches!(
        mismatched.accept(FilterFrame::Delta { base_sequence: 0, sequence: 2, payload: &delta }),
        Err(ReplicaFault::EnvelopeMismatch(_))
    ));
    let mut early = FilterReplica::new(format, DC).unwrap();
    assert_eq!(
        early.accept(FilterFrame::Delta { base_sequence: 0, sequence: 1, payload: &delta }),
        Err(ReplicaFault::NotReady("delta"))
    );
}

/// A CBI1 frame built byte by byte (flags 1 = chunk, 2 = delta).
fn hand_frame(format: CkfFormat, flags: u16, epoch: u64, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(b"CBI1");
    frame.extend_from_slice(&1u16.to_le_bytes());
    frame.extend_from_slice(&flags.to_le_bytes());
    frame.push(16);
    frame.push(4);
    frame.extend_from_slice(&1u16.to_le_bytes());
    frame.extend_from_slice(&format.seed.to_le_bytes());
    frame.extend_from_slice(&format.bucket_count.to_le_bytes());
    frame.extend_from_slice(&DC.to_le_bytes());
    frame.extend_from_slice(&epoch.to_le_bytes());
    let checksum = xxhash_rust::xxh3::xxh3_64(body) as u32;
    frame.extend_from_slice(&checksum.to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

#[test]
fn longest_prefix_stops_at_the_first_missing_block() {
    let format = format(1024);
    let mut filter = CuckooFilter::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).unwrap();
    let chain: Vec<SequenceHash> = (1..=6u64).map(|i| SequenceHash(i * 0x9E37_79B9)).collect();
    for hash in &chain[..4] {
        filter.insert(hash.0).unwrap();
    }
    let mut replica = FilterReplica::new(format, DC).unwrap();
    install(&mut replica, &snapshot_frames(format, 0, filter.words()), 0);
    assert_eq!(replica.longest_prefix(&chain), Some(4));
    assert_eq!(replica.longest_prefix(&chain[4..]), Some(0));
    assert_eq!(replica.longest_prefix(&[]), Some(0));
}

#[test]
fn longest_prefix_in_chunks_answers_what_probing_each_hash_in_turn_does() {
    let format = format(4096);
    let chain: Vec<SequenceHash> = (1..=3 * PREFIX_PROBE_CHUNK as u64 + 5)
        .map(|i| SequenceHash(i * 0x9E37_79B9_7F4A))
        .collect();
    let chunk = PREFIX_PROBE_CHUNK;
    for missing in [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + 2, chain.len()] {
        let mut filter = CuckooFilter::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).unwrap();
        // Every hash but the one at `missing`: the prefix ends there, whatever follows it.
        for (index, hash) in chain.iter().enumerate() {
            if index != missing {
                filter.insert(hash.0).unwrap();
            }
        }
        let mut replica = FilterReplica::new(format, DC).unwrap();
        install(&mut replica, &snapshot_frames(format, 0, filter.words()), 0);
        let one_by_one =
            chain.iter().take_while(|&&hash| replica.contains(hash) == Some(true)).count();
        assert_eq!(one_by_one, missing, "no false positive at this size");
        assert_eq!(replica.longest_prefix(&chain), Some(missing));
        assert_eq!(replica.longest_prefix(&chain[..missing]), Some(missing));
    }
}
