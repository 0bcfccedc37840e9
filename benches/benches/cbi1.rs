//! CBI1 encode and decode of a full default-size snapshot (524,288 buckets, one 4 MiB chunk).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_benches::SplitMix64;
use kvrelay_core::filter::cbi1::{self, FrameEncoder, SnapshotAssembler};
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED};

const BUCKETS: u64 = 524_288;

fn snapshot(c: &mut Criterion) {
    let format = CkfFormat::v1(DEFAULT_SEED, BUCKETS);
    let mut rng = SplitMix64::new(3);
    let words: Vec<u64> = (0..BUCKETS).map(|_| rng.next_u64()).collect();
    let encoder = FrameEncoder::new(format, 0x04f1_10c9_8b1b_fc48).expect("format");
    let frames = encoder.encode_snapshot(1, &words).expect("encodes");
    let bytes: usize = frames.iter().map(Vec::len).sum();

    let mut group = c.benchmark_group("cbi1_snapshot_524288");
    group.throughput(Throughput::Bytes(bytes as u64));
    let mut buffer = Vec::with_capacity(bytes);
    group.bench_function("encode", |b| {
        b.iter(|| {
            buffer.clear();
            let snapshot = encoder.snapshot(1, &words[..]).expect("snapshot");
            for index in 0..snapshot.chunk_count() {
                snapshot.encode_chunk_into(index, &mut buffer).expect("chunk");
            }
            black_box(buffer.len())
        });
    });
    group.bench_function("decode_and_assemble", |b| {
        b.iter(|| {
            let mut assembler = SnapshotAssembler::new();
            let mut done = None;
            for frame in &frames {
                let cbi1::Frame::SnapshotChunk(chunk) =
                    cbi1::decode_for_pool(frame, &format, 0x04f1_10c9_8b1b_fc48).expect("decodes")
                else {
                    unreachable!("snapshot frames only")
                };
                done = assembler.accept(&chunk).expect("assembles");
            }
            black_box(done.expect("complete").words().len())
        });
    });
    group.finish();
}

criterion_group!(benches, snapshot);
criterion_main!(benches);
