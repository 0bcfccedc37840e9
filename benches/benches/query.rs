//! Consumer prefix-query cost per block: `consumer::query::answer` (name resolution, hashing of
//! the prompt under the pool's semantics, longest-prefix probe of the replica), and its two
//! parts alone — hashing (`query_hashes`) and probing (`FilterReplica::longest_prefix`).
//!
//! The replica is installed from a real CBI1 snapshot of a filter sized for 65,536 blocks and
//! filled to half of that with unrelated blocks plus the prompt's own blocks; the prompt is a
//! full hit, so every block is hashed and probed. Throughput is in blocks (16 tokens each).
//!
//! `consumer_query_cold/replica_<blocks>`: prefix probes of a replica sized for 4M blocks (16K under
//! `cargo test`) and holding 16,384 prompts of 128 blocks, a different prompt each iteration, so
//! that the buckets come from memory as a router's do: `longest_prefix` beside the same answer
//! probed one hash after the other.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_benches::SplitMix64;
use kvrelay_consumer::QueryPool;
use kvrelay_consumer::query::{answer, query_hashes};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use kvrelay_core::filter::cbi1::FrameEncoder;
use kvrelay_core::filter::ckf::{CkfFormat, CuckooFilter, MAX_KICKS_DEFAULT};
use kvrelay_core::filter::{FilterFrame, FilterReplica};
use kvrelay_core::host::PoolDescriptor;
use kvrelay_core::model::hashing::{HashFormat, SequenceHash};
use kvrelay_core::model::identity::{EndpointPath, PoolId, ProducerIdentity};
use kvrelay_core::model::identity::{resolve_indexer_domain, stable_dc_id};
use kvrelay_core::rng::rng_from_seed;

const EXPECTED_BLOCKS: u64 = 65_536;
const BLOCK_TOKENS: u32 = 16;
const MODEL: &str = "bench-llm";

fn descriptor(format: CkfFormat) -> PoolDescriptor {
    let semantics =
        QuerySemantics { kv_block_size: BLOCK_TOKENS, hash_format: HashFormat::StandardV1 };
    let endpoint: EndpointPath = "bench/backend/generate".parse().expect("a valid endpoint");
    let domain =
        resolve_indexer_domain(MODEL, BLOCK_TOKENS, semantics.hash_format, &endpoint, None)
            .expect("a valid domain");
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("bench").expect("a dc") };
    PoolDescriptor {
        producer: ProducerIdentity::new(pool_id, 1, 1, format).expect("a valid producer"),
        serving_endpoint: endpoint,
        registrations: vec![ModelRegistration {
            canonical_model_id: MODEL.into(),
            target: ModelTarget::Base { base_model: MODEL.into() },
            aliases: BTreeSet::new(),
        }],
        query_semantics: semantics,
        pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
    }
}

/// A replica holding `tokens`' blocks and `EXPECTED_BLOCKS / 2` unrelated ones.
fn replica_holding(descriptor: &PoolDescriptor, tokens: &[u32]) -> FilterReplica {
    let format = descriptor.producer.format();
    let mut filter =
        CuckooFilter::new(format, MAX_KICKS_DEFAULT, rng_from_seed(3)).expect("filter");
    let mut rng = SplitMix64::new(11);
    for _ in 0..EXPECTED_BLOCKS / 2 {
        filter.insert(rng.next_u64()).expect("half load fits");
    }
    let target = &descriptor.registrations[0].target;
    for hash in query_hashes(tokens, &descriptor.query_semantics, target) {
        filter.insert(hash.0).expect("the prompt fits");
    }
    installed(&filter, descriptor.producer.pool_id().dc_id.0)
}

/// A consumer replica of `filter`, installed from a CBI1 snapshot of its words.
fn installed(filter: &CuckooFilter, dc_id: u64) -> FilterReplica {
    let format = *filter.format();
    let chunks = FrameEncoder::new(format, dc_id)
        .expect("an encoder")
        .encode_snapshot(1, filter.words())
        .expect("a snapshot");
    let mut replica = FilterReplica::new(format, dc_id).expect("a replica");
    for payload in &chunks {
        replica
            .accept(FilterFrame::SnapshotChunk { base_sequence: 1, sequence: 1, payload })
            .expect("a valid snapshot");
    }
    replica
}

fn query(c: &mut Criterion) {
    let lengths: &[usize] = if kvrelay_benches::is_bench_mode() { &[16, 128, 1024] } else { &[16] };
    let format = CkfFormat::for_expected_blocks(EXPECTED_BLOCKS).expect("a valid sizing");
    let descriptor = descriptor(format);
    let target = &descriptor.registrations[0].target;
    let mut group = c.benchmark_group("consumer_query");
    group.sample_size(20).measurement_time(Duration::from_secs(3));
    for &blocks in lengths {
        let mut rng = SplitMix64::new(blocks as u64);
        let tokens: Vec<u32> =
            (0..blocks * BLOCK_TOKENS as usize).map(|_| (rng.next_u64() % 32_000) as u32).collect();
        let replica = replica_holding(&descriptor, &tokens);
        let hashes = query_hashes(&tokens, &descriptor.query_semantics, target);
        assert_eq!(replica.longest_prefix(&hashes), Some(blocks), "the prompt is a full hit");
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_function(format!("answer/{blocks}_blocks"), |b| {
            let pool = QueryPool { descriptor: &descriptor, replica: Some(&replica) };
            b.iter(|| answer([pool], black_box(&tokens), MODEL));
        });
        group.bench_function(format!("hash/{blocks}_blocks"), |b| {
            b.iter(|| query_hashes(black_box(&tokens), &descriptor.query_semantics, target));
        });
        group.bench_function(format!("probe/{blocks}_blocks"), |b| {
            b.iter(|| replica.longest_prefix(black_box(&hashes)));
        });
    }
    group.finish();
}

/// A replica sized for `expected_blocks` holding `prompts` prompts of `blocks` random hashes
/// each (and nothing else), and those prompts.
fn cold_replica(
    expected_blocks: u64,
    prompts: usize,
    blocks: usize,
) -> (FilterReplica, Vec<Vec<SequenceHash>>) {
    let format = CkfFormat::for_expected_blocks(expected_blocks).expect("a valid sizing");
    let mut filter =
        CuckooFilter::new(format, MAX_KICKS_DEFAULT, rng_from_seed(5)).expect("filter");
    let mut rng = SplitMix64::new(17);
    let prompts: Vec<Vec<SequenceHash>> =
        (0..prompts).map(|_| (0..blocks).map(|_| SequenceHash(rng.next_u64())).collect()).collect();
    for hash in prompts.iter().flatten() {
        filter.insert(hash.0).expect("the prompts fit");
    }
    (installed(&filter, 7), prompts)
}

/// Prefix probes of a large replica whose buckets are not in cache: each iteration probes the
/// next of many full-hit prompts, so their buckets were last read thousands of prompts ago.
/// `longest_prefix` (the relay's path, prefetching a chunk's buckets first) beside the same
/// answer probed one hash after the other.
fn query_cold(c: &mut Criterion) {
    let (expected_blocks, prompts) =
        if kvrelay_benches::is_bench_mode() { (1u64 << 22, 16_384) } else { (1 << 14, 64) };
    let blocks = 128;
    let (replica, prompts) = cold_replica(expected_blocks, prompts, blocks);
    let one_by_one = |hashes: &[SequenceHash]| {
        hashes.iter().take_while(|&&hash| replica.contains(hash) == Some(true)).count()
    };
    for prompt in &prompts {
        assert_eq!(replica.longest_prefix(prompt), Some(blocks), "a full hit");
        assert_eq!(one_by_one(prompt), blocks, "a full hit");
    }
    let mut group = c.benchmark_group(format!("consumer_query_cold/replica_{expected_blocks}"));
    group.sample_size(20).measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Elements(blocks as u64));
    let mut next = 0;
    group.bench_function(format!("longest_prefix/{blocks}_blocks"), |b| {
        b.iter(|| {
            next = (next + 1) % prompts.len();
            replica.longest_prefix(black_box(&prompts[next]))
        });
    });
    group.bench_function(format!("one_by_one/{blocks}_blocks"), |b| {
        b.iter(|| {
            next = (next + 1) % prompts.len();
            one_by_one(black_box(&prompts[next]))
        });
    });
    group.finish();
}

criterion_group!(benches, query, query_cold);
criterion_main!(benches);
