//! `kv-events` payload decoding (`inputs::decode_kv_events_payload`): the counting walk over the
//! MessagePack headers, then the decode into `RouterEvent`s, on the two shapes a relay sees
//! most: one prefill store of 16 blocks, and a full Dynamo batch of 128 events alternating
//! 4-block stores and 4-block removes; and a whole message of one 1-block store, envelope
//! included, as a worker publishes at a low rate. Payloads are written by the relay's own
//! encoder (named maps, as Dynamo's publisher writes them). Throughput is in blocks.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_benches::SplitMix64;
use kvrelay_core::inputs::{
    EventEnvelope, KV_EVENTS_TOPIC, decode_event_envelope, decode_kv_events_payload,
    encode_event_envelope, encode_kv_events_payload,
};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, StorageTier, StoreData, StoredBlock,
};

fn event(event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: 0x1d2c_3b4a_5968_7786,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: 0, data },
    }
}

fn store(rng: &mut SplitMix64, event_id: u64, blocks: usize) -> RouterEvent {
    event(
        event_id,
        KvCacheEventData::Stored(StoreData {
            parent_hash: Some(ExternalBlockHash(rng.next_u64())),
            start_position: None,
            blocks: (0..blocks)
                .map(|_| StoredBlock {
                    block_hash: ExternalBlockHash(rng.next_u64()),
                    tokens_hash: LocalBlockHash(rng.next_u64()),
                })
                .collect(),
        }),
    )
}

fn remove(rng: &mut SplitMix64, event_id: u64, blocks: usize) -> RouterEvent {
    event(
        event_id,
        KvCacheEventData::Removed(RemoveData {
            block_hashes: (0..blocks).map(|_| ExternalBlockHash(rng.next_u64())).collect(),
        }),
    )
}

fn decode(c: &mut Criterion) {
    let mut rng = SplitMix64::new(7);
    let prefill = vec![store(&mut rng, 1, 16)];
    let batch: Vec<RouterEvent> = (0..128u64)
        .map(
            |id| if id % 2 == 0 { store(&mut rng, id + 1, 4) } else { remove(&mut rng, id + 1, 4) },
        )
        .collect();
    let mut group = c.benchmark_group("kv-events decode");
    group.measurement_time(Duration::from_secs(3));
    for (name, events, blocks) in
        [("one 16-block store", &prefill, 16), ("128 events", &batch, 512)]
    {
        let payload = encode_kv_events_payload(events).expect("encodes");
        assert_eq!(decode_kv_events_payload(&payload).as_ref(), Ok(events));
        group.throughput(Throughput::Elements(blocks));
        group.bench_function(name, |b| {
            b.iter(|| decode_kv_events_payload(black_box(&payload)).expect("decodes"));
        });
    }
    let single = encode_kv_events_payload(&[store(&mut rng, 1, 1)]).expect("encodes");
    let message = encode_event_envelope(&EventEnvelope {
        publisher_id: rng.next_u64(),
        sequence: 41,
        published_at_ms: 1_765_000_000_000,
        topic: KV_EVENTS_TOPIC,
        payload: &single,
    })
    .expect("encodes");
    group.throughput(Throughput::Elements(1));
    group.bench_function("message of one 1-block store", |b| {
        b.iter(|| {
            let envelope = decode_event_envelope(black_box(&message)).expect("decodes");
            decode_kv_events_payload(envelope.payload).expect("decodes")
        });
    });
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
