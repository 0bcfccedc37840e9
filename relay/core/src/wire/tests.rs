//! Behaviour of the wire boundary (relay-facts §3, §14 "Identity / wire").
//!
//! Domain values are built the way the relay builds them (derived indexer domains, the `dc-a`
//! data center, `ProducerIdentity::new`), encoded, pushed through real protobuf bytes, decoded
//! and validated. Fail-closed cases mutate one field of a valid message at a time, so each
//! case names exactly one fault.

use std::collections::BTreeSet;
use std::num::NonZeroU64;

use bytes::Bytes;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::{CONTRACT_MARKER, PROTOCOL_VERSION};
use prost::Message;

use super::*;
use crate::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use crate::filter::cbi1::FrameEncoder;
use crate::filter::ckf::{BucketImage, CkfFormat, DEFAULT_SEED};
use crate::filter::{FilterFrame, FilterReplica, ReplicaProgress};
use crate::host::{Catalog, PoolDescriptor};
use crate::load::{LoadWindows, PoolLoadSnapshot};
use crate::model::hashing::HashFormat;
use crate::model::identity::{
    DcId, EndpointPath, IdentitySource, PoolId, ProducerIdentity, RelayIdentity,
    resolve_indexer_domain, stable_dc_id,
};
use crate::readiness::ReadinessState;
use crate::readiness::topology::{AdapterReadiness, TopologyEntry, TopologyKey, TopologyMember};

// ---- domain fixtures -------------------------------------------------------------------------

/// The live relay's identity from dynamo-live §5.
const RELAY: RelayIdentity = RelayIdentity {
    drt_instance_id: 12_830_424_316_928_007_812,
    relay_incarnation: 6_007_861_584_902_211_933,
};

fn endpoint(path: &str) -> EndpointPath {
    path.parse().unwrap()
}

/// The pool a card with `source_path` served at `path` publishes in `dc-a`.
fn pool(source_path: &str, path: &str) -> PoolId {
    PoolId {
        indexer_domain: resolve_indexer_domain(
            source_path,
            16,
            HashFormat::StandardV1,
            &endpoint(path),
            None,
        )
        .unwrap(),
        dc_id: stable_dc_id("dc-a").unwrap(),
    }
}

fn producer_with(pool_id: PoolId, layout_generation: u64, bucket_count: u64) -> ProducerIdentity {
    ProducerIdentity::new(
        pool_id,
        RELAY.relay_incarnation,
        layout_generation,
        CkfFormat::v1(DEFAULT_SEED, bucket_count),
    )
    .unwrap()
}

fn producer(pool_id: PoolId, layout_generation: u64) -> ProducerIdentity {
    producer_with(pool_id, layout_generation, 524_288)
}

fn base_registration(model: &str, aliases: &[&str]) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: model.to_owned(),
        target: ModelTarget::Base { base_model: model.to_owned() },
        aliases: aliases.iter().map(|alias| (*alias).to_owned()).collect(),
    }
}

fn lora_registration(adapter: &str, base_model: &str) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: adapter.to_owned(),
        target: ModelTarget::Lora {
            base_model: base_model.to_owned(),
            adapter: adapter.to_owned(),
        },
        aliases: BTreeSet::new(),
    }
}

fn roles(roles: &[WorkerRole]) -> BTreeSet<WorkerRole> {
    roles.iter().copied().collect()
}

/// An aggregated tiny-llm pool at `path`.
fn aggregated_descriptor(path: &str, layout_generation: u64) -> PoolDescriptor {
    PoolDescriptor {
        producer: producer(pool("meta/tiny-llm", path), layout_generation),
        serving_endpoint: endpoint(path),
        registrations: vec![base_registration("tiny-llm", &[])],
        query_semantics: QuerySemantics { kv_block_size: 16, hash_format: HashFormat::StandardV1 },
        pool_roles: roles(&[WorkerRole::Aggregated]),
    }
}

/// The live LoRA worker's pool: two adapters and an aliased base, Eagle hashing.
fn lora_descriptor(path: &str, layout_generation: u64) -> PoolDescriptor {
    PoolDescriptor {
        producer: producer(pool("meta/base-llm", path), layout_generation),
        serving_endpoint: endpoint(path),
        registrations: vec![
            lora_registration("adapter-a", "base-llm"),
            lora_registration("adapter-b", "base-llm"),
            base_registration("base-llm", &["base-alias"]),
        ],
        query_semantics: QuerySemantics { kv_block_size: 32, hash_format: HashFormat::EagleV1 },
        pool_roles: roles(&[WorkerRole::Prefill, WorkerRole::Decode]),
    }
}

fn member(path: &str, member_roles: &[WorkerRole], pool_id: Option<PoolId>) -> TopologyMember {
    TopologyMember { endpoint: endpoint(path), roles: roles(member_roles), pool_id }
}

/// A ready P/D entry in `dynamo` with both members linked to pools.
fn disaggregated_entry() -> TopologyEntry {
    TopologyEntry {
        namespace: "dynamo".to_owned(),
        canonical_model_id: "tiny-llm".to_owned(),
        state: ReadinessState::Ready,
        present_roles: roles(&[WorkerRole::Prefill, WorkerRole::Decode]),
        missing_roles: BTreeSet::new(),
        members: vec![
            member(
                "dynamo/backend/generate",
                &[WorkerRole::Decode],
                Some(pool("meta/tiny-llm", "dynamo/backend/generate")),
            ),
            member(
                "dynamo/prefill/generate",
                &[WorkerRole::Prefill],
                Some(pool("meta/tiny-llm", "dynamo/prefill/generate")),
            ),
        ],
        duplicate_role_endpoints: roles(&[WorkerRole::Prefill]),
        legacy_fallback_active: false,
        adapters: Vec::new(),
    }
}

/// A LoRA entry with adapters, one unavailable for lack of a decode worker.
fn lora_entry() -> TopologyEntry {
    TopologyEntry {
        namespace: "loras".to_owned(),
        canonical_model_id: "base-llm".to_owned(),
        state: ReadinessState::Ready,
        present_roles: roles(&[WorkerRole::Aggregated]),
        missing_roles: BTreeSet::new(),
        members: vec![member("loras/backend/generate", &[WorkerRole::Aggregated], None)],
        duplicate_role_endpoints: BTreeSet::new(),
        legacy_fallback_active: false,
        adapters: vec![
            AdapterReadiness {
                canonical_model_id: "adapter-a".to_owned(),
                state: ReadinessState::Ready,
                missing_roles: BTreeSet::new(),
            },
            AdapterReadiness {
                canonical_model_id: "adapter-b".to_owned(),
                state: ReadinessState::Unavailable,
                missing_roles: roles(&[WorkerRole::Decode]),
            },
        ],
    }
}

/// A legacy entry that is not yet authoritative.
fn unknown_entry() -> TopologyEntry {
    TopologyEntry {
        namespace: "legacy".to_owned(),
        canonical_model_id: "old-model".to_owned(),
        state: ReadinessState::Unknown,
        present_roles: BTreeSet::new(),
        missing_roles: BTreeSet::new(),
        members: vec![member("legacy/worker/generate", &[WorkerRole::Legacy], None)],
        duplicate_role_endpoints: BTreeSet::new(),
        legacy_fallback_active: true,
        adapters: Vec::new(),
    }
}

/// Encode to protobuf bytes and decode again: what a peer actually receives.
fn over_the_wire<M: Message + Default>(message: &M) -> M {
    M::decode(message.encode_to_vec().as_slice()).unwrap()
}

fn catalog_message(descriptors: &[PoolDescriptor], revision: u64) -> proto::KvPoolCatalogUpdate {
    encode::catalog_update(
        &RELAY,
        &crate::host::CatalogSnapshot { revision, pools: descriptors.to_vec() },
    )
}

fn wire_producer() -> proto::ProducerIdentity {
    encode::producer(&producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 1))
}

fn cache_semantics(producer: &mut proto::ProducerIdentity) -> &mut proto::DigestIdentity {
    producer
        .pool_id
        .as_mut()
        .unwrap()
        .indexer_domain
        .as_mut()
        .unwrap()
        .cache_semantics
        .as_mut()
        .unwrap()
}

// ---- round trips -----------------------------------------------------------------------------

#[test]
fn catalog_round_trips_through_the_wire() {
    let mut catalog = Catalog::new();
    let _ = catalog.upsert(aggregated_descriptor("dynamo/backend/generate", 1)).unwrap();
    let _ = catalog.upsert(lora_descriptor("loras/backend/generate", 2)).unwrap();
    let snapshot = catalog.snapshot();

    let message = over_the_wire(&encode::catalog_update(&RELAY, &snapshot));
    assert_eq!(message.protocol_version, PROTOCOL_VERSION);
    assert_eq!(message.contract_marker, CONTRACT_MARKER);
    assert_eq!(message.revision, 2);

    let update = validate_catalog_update(&message).unwrap();
    assert_eq!(update.relay, RELAY);
    assert_eq!(update.revision, snapshot.revision);
    assert_eq!(update.pools, snapshot.pools);
    assert!(update.quarantined.is_empty());

    // The empty catalog still carries its (empty) snapshot.
    let empty = over_the_wire(&encode::catalog_update(&RELAY, &Catalog::new().snapshot()));
    assert_eq!(empty.snapshot, Some(proto::KvPoolCatalogSnapshot { pools: Vec::new() }));
    let update = validate_catalog_update(&empty).unwrap();
    assert_eq!((update.revision, update.pools.len()), (0, 0));
}

#[test]
fn live_catalog_sample_validates_to_the_derived_pool() {
    // The descriptor a live Dynamo 1.6.1 relay published for one aggregated worker
    // (dynamo-live §5), written out field by field.
    let live = proto::KvPoolDescriptor {
        producer: Some(proto::ProducerIdentity {
            pool_id: Some(proto::KvPoolId {
                identity_version: 1,
                indexer_domain: Some(proto::IndexerDomainId {
                    cache_semantics: Some(proto::DigestIdentity {
                        // "ORO1+NwYbVH0FO9aPLMWuw=="
                        digest: hex("3913b5f8dc186d51f414ef5a3cb316bb"),
                        source: proto::IdentitySource::DefaultDerived as i32,
                    }),
                    routing_scope: Some(proto::DigestIdentity {
                        // "v5kLl6DQIwLJfJKoy8URiA=="
                        digest: hex("bf990b97a0d02302c97c92a8cbc51188"),
                        source: proto::IdentitySource::DefaultDerived as i32,
                    }),
                }),
                dc_id: 356_084_303_347_317_832,
            }),
            producer_incarnation: 5_396_511_224_053_863_660,
            layout_generation: 1,
            ckf_format: Some(proto::CkfFormat {
                format_version: 1,
                seed: 6_768_574_230_984_739_379,
                bucket_count: 524_288,
                fingerprint_bits: 16,
                slots_per_bucket: 4,
            }),
        }),
        serving_endpoint: Some(proto::DynamoEndpointId {
            namespace: "dynamo".to_owned(),
            component: "backend".to_owned(),
            endpoint: "generate".to_owned(),
        }),
        registrations: vec![proto::ModelRegistration {
            canonical_model_id: "tiny-llm".to_owned(),
            target: Some(proto::ModelTarget {
                target: Some(proto::model_target::Target::Base(proto::BaseModelTarget {
                    base_model: "tiny-llm".to_owned(),
                })),
            }),
            aliases: Vec::new(),
        }],
        query_semantics: Some(proto::KvQuerySemantics {
            kv_block_size: 16,
            hash_format: proto::KvQueryHashFormat::DynamoStandardV1 as i32,
        }),
        pool_roles: vec![proto::WorkerRole::Aggregated as i32],
    };
    let path = endpoint("dynamo/backend/generate");
    let derived = PoolDescriptor {
        producer: ProducerIdentity::new(
            PoolId {
                indexer_domain: resolve_indexer_domain(
                    "/tmp/dynlive/models/tiny-llm",
                    16,
                    HashFormat::StandardV1,
                    &path,
                    None,
                )
                .unwrap(),
                dc_id: stable_dc_id("dc-a").unwrap(),
            },
            5_396_511_224_053_863_660,
            1,
            CkfFormat::v1(DEFAULT_SEED, 524_288),
        )
        .unwrap(),
        serving_endpoint: path,
        registrations: vec![base_registration("tiny-llm", &[])],
        query_semantics: QuerySemantics { kv_block_size: 16, hash_format: HashFormat::StandardV1 },
        pool_roles: roles(&[WorkerRole::Aggregated]),
    };
    assert_eq!(validate_descriptor(&live), Ok(derived.clone()));
    assert_eq!(encode::descriptor(&derived), live, "we encode exactly what the live relay sent");
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).unwrap())
        .collect()
}

#[test]
fn readiness_round_trips_through_the_wire() {
    let entries = vec![disaggregated_entry(), unknown_entry(), lora_entry()];
    let message = over_the_wire(&encode::readiness_update(&RELAY, 7, &entries));
    assert_eq!(
        (message.protocol_version, message.contract_marker, message.revision),
        (PROTOCOL_VERSION, CONTRACT_MARKER, 7)
    );
    // UNKNOWN is the zero value: it travels as an absent field and still decodes as a state.
    assert_eq!(message.entries[1].state, 0);
    let update = validate_readiness_update(&message).unwrap();
    assert_eq!(update.relay, RELAY);
    assert_eq!(update.revision, 7);
    assert_eq!(update.entries, entries);
    assert!(update.quarantined.is_empty());
}

#[test]
fn load_window_round_trips_through_the_wire() {
    let first = producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 1);
    let second = producer(pool("meta/tiny-llm", "dynamo/prefill/generate"), 2);
    let complete = PoolLoadSnapshot {
        kv_expected_ranks: 2,
        kv_capacity_ranks: 2,
        kv_observed_ranks: 2,
        kv_used_blocks: Some(76),
        total_kv_blocks: Some(32_768),
        degraded: false,
    };
    let partial = PoolLoadSnapshot {
        kv_expected_ranks: 1,
        kv_capacity_ranks: 0,
        kv_observed_ranks: 0,
        kv_used_blocks: None,
        total_kv_blocks: None,
        degraded: true,
    };
    let mut windows =
        LoadWindows::new(NonZeroU64::new(1000).unwrap(), 1_796_038_251_716, []).unwrap();
    let window =
        windows.tick(1_796_038_252_716, [(second, partial), (first, complete)]).unwrap().clone();

    let message = over_the_wire(&encode::load_update(&RELAY, &window));
    assert_eq!(
        (message.window_sequence, message.observed_ms, message.window_ms),
        (1, 1_796_038_252_716, 1000)
    );
    // Incomplete coverage: the sums travel as 0 and are read back as unknown.
    let partial_wire = message.pools.iter().find(|entry| entry.kv_expected_ranks == 1).unwrap();
    assert_eq!((partial_wire.kv_used_blocks, partial_wire.total_kv_blocks), (0, 0));

    let update = validate_load_update(&message).unwrap();
    assert_eq!(update.relay, RELAY);
    assert_eq!(update.window_sequence, 1);
    let expected: Vec<PoolLoad> = window
        .pools
        .iter()
        .map(|entry| PoolLoad {
            producer: entry.pool,
            kv_used_blocks: entry.load.kv_used_blocks,
            total_kv_blocks: entry.load.total_kv_blocks,
            kv_observed_ranks: entry.load.kv_observed_ranks,
            kv_expected_ranks: entry.load.kv_expected_ranks,
        })
        .collect();
    assert_eq!(update.pools, expected);
    assert!(update.pools.iter().any(PoolLoad::is_complete));
    assert!(!update.pools.iter().all(PoolLoad::is_complete));
}

#[test]
fn filter_envelopes_round_trip_into_a_replica() {
    let pool_id = pool("meta/tiny-llm", "dynamo/backend/generate");
    let producer = producer_with(pool_id, 3, 16);
    let format = producer.format();
    let frames = FrameEncoder::new(format, pool_id.dc_id.0).unwrap();
    let mut words = vec![0u64; 16];
    words[5] = 0x0000_0000_0000_4f32;
    let chunks = frames.encode_snapshot(14, &words).unwrap();
    assert_eq!(chunks.len(), 1);
    let delta = frames
        .encode_delta(14, 15, &[BucketImage { bucket: 3, word: 0x0000_0000_1234_0000 }])
        .unwrap();

    let envelopes = FilterEncoder::new(&RELAY, &producer);
    let messages = [
        envelopes.snapshot_chunk(14, 1_000_001, Bytes::from(chunks[0].clone())),
        envelopes.delta(14, 15, 1_000_002, Bytes::from(delta.clone())),
        envelopes.heartbeat(15, 1_000_003),
    ];
    let kinds: Vec<i32> = messages.iter().map(|message| message.kind).collect();
    assert_eq!(
        kinds,
        [
            proto::FilterUpdateKind::SnapshotChunk as i32,
            proto::FilterUpdateKind::Delta as i32,
            proto::FilterUpdateKind::Heartbeat as i32
        ]
    );
    assert!(messages[2].payload.is_empty());

    let mut guard = FilterStreamGuard::new(producer);
    let mut replica = FilterReplica::new(format, pool_id.dc_id.0).unwrap();
    let mut progress = Vec::new();
    for (message, send_ts_us) in messages.iter().zip([1_000_001, 1_000_002, 1_000_003]) {
        let received = over_the_wire(message);
        let envelope = guard.check(&received).unwrap();
        assert_eq!(envelope.relay, RELAY);
        assert_eq!(envelope.producer, producer);
        assert_eq!(envelope.send_ts_us, send_ts_us);
        progress.push(replica.accept(envelope.frame).unwrap());
    }
    assert_eq!(
        progress,
        [
            ReplicaProgress::Installed { sequence: 14 },
            ReplicaProgress::Applied { sequence: 15 },
            ReplicaProgress::Confirmed
        ]
    );
    let replicated = replica.words().unwrap();
    assert_eq!((replicated[3], replicated[5]), (0x0000_0000_1234_0000, 0x4f32));

    // The payload reaches the envelope byte for byte.
    let received = over_the_wire(&messages[1]);
    let envelope = validate_filter_update(&received).unwrap();
    assert_eq!(
        envelope.frame,
        FilterFrame::Delta { base_sequence: 14, sequence: 15, payload: &delta }
    );
}

#[test]
fn every_response_carries_version_relay_and_marker() {
    let info = encode::relay_info(&RELAY);
    assert_eq!(validate_relay_info(&over_the_wire(&info)), Ok(RELAY));
    // Field 127 (fixed32) closes the message: fd 07 then "1RVK" little-endian.
    assert!(info.encode_to_vec().ends_with(&[0xfd, 0x07, 0x31, 0x52, 0x56, 0x4b]));

    let stamps = [
        {
            let message = catalog_message(&[], 0);
            (message.protocol_version, message.relay, message.contract_marker)
        },
        {
            let message = encode::readiness_update(&RELAY, 1, &[]);
            (message.protocol_version, message.relay, message.contract_marker)
        },
        {
            let windows = LoadWindows::<ProducerIdentity>::new(NonZeroU64::MIN, 0, []).unwrap();
            let message = encode::load_update(&RELAY, windows.current());
            (message.protocol_version, message.relay, message.contract_marker)
        },
        {
            let producer = producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 1);
            let message = FilterEncoder::new(&RELAY, &producer).heartbeat(0, 0);
            (message.protocol_version, message.relay, message.contract_marker)
        },
    ];
    for stamp in stamps {
        assert_eq!(stamp, (1, Some(encode::relay_identity(&RELAY)), 0x4B56_5231));
    }
}

// ---- §14 identity / wire ---------------------------------------------------------------------

/// A future v1 producer identity with an additive field.
#[derive(Clone, PartialEq, Message)]
struct FutureProducerIdentity {
    #[prost(message, optional, tag = "1")]
    pool_id: Option<proto::KvPoolId>,
    #[prost(fixed64, tag = "2")]
    producer_incarnation: u64,
    #[prost(uint64, tag = "3")]
    layout_generation: u64,
    #[prost(message, optional, tag = "4")]
    ckf_format: Option<proto::CkfFormat>,
    #[prost(string, tag = "9")]
    placement_hint: String,
}

/// A future v1 descriptor with an additive field and a future producer.
#[derive(Clone, PartialEq, Message)]
struct FutureDescriptor {
    #[prost(message, optional, tag = "1")]
    producer: Option<FutureProducerIdentity>,
    #[prost(message, optional, tag = "2")]
    serving_endpoint: Option<proto::DynamoEndpointId>,
    #[prost(message, repeated, tag = "3")]
    registrations: Vec<proto::ModelRegistration>,
    #[prost(message, optional, tag = "4")]
    query_semantics: Option<proto::KvQuerySemantics>,
    #[prost(int32, repeated, tag = "5")]
    pool_roles: Vec<i32>,
    #[prost(uint32, tag = "6")]
    priority: u32,
}

fn future_descriptor(current: &proto::KvPoolDescriptor, hint: &str, priority: u32) -> Vec<u8> {
    let producer = current.producer.clone().unwrap();
    FutureDescriptor {
        producer: Some(FutureProducerIdentity {
            pool_id: producer.pool_id,
            producer_incarnation: producer.producer_incarnation,
            layout_generation: producer.layout_generation,
            ckf_format: producer.ckf_format,
            placement_hint: hint.to_owned(),
        }),
        serving_endpoint: current.serving_endpoint.clone(),
        registrations: current.registrations.clone(),
        query_semantics: current.query_semantics,
        pool_roles: current.pool_roles.clone(),
        priority,
    }
    .encode_to_vec()
}

#[test]
fn additive_v1_fields_work_in_both_directions_without_entering_identity() {
    let domain = aggregated_descriptor("dynamo/backend/generate", 1);
    let current = encode::descriptor(&domain);

    // A newer writer, an older reader: the additive fields are skipped, nothing else changes.
    let newer = future_descriptor(&current, "rack-7", 3);
    let read = proto::KvPoolDescriptor::decode(newer.as_slice()).unwrap();
    assert_eq!(validate_descriptor(&read), Ok(domain.clone()));

    // An older writer, a newer reader: the additive fields read as absent (their defaults).
    let read = FutureDescriptor::decode(current.encode_to_vec().as_slice()).unwrap();
    assert_eq!((read.priority, read.producer.as_ref().unwrap().placement_hint.as_str()), (0, ""));
    assert_eq!(read.pool_roles, current.pool_roles);
    assert_eq!(read.registrations, current.registrations);

    // Additive fields never enter the producer key: two values of the hint name one producer.
    let one = proto::KvPoolDescriptor::decode(future_descriptor(&current, "a", 1).as_slice());
    let other = proto::KvPoolDescriptor::decode(future_descriptor(&current, "b", 2).as_slice());
    let one = validate_descriptor(&one.unwrap()).unwrap();
    let other = validate_descriptor(&other.unwrap()).unwrap();
    assert_eq!(one.producer.key(), other.producer.key());

    // A consumer sees a republished catalog with new additive values as no change at all, and
    // a metadata change as a refresh under the same producer (no resubscription).
    let mut view = CatalogView::new();
    let _ = view.apply(&catalog_message(std::slice::from_ref(&domain), 1)).unwrap();
    let mut republished = catalog_message(std::slice::from_ref(&domain), 1).encode_to_vec();
    // Append an unknown top-level field 50 (varint 9) to the whole update as well.
    republished.extend_from_slice(&[0x90, 0x03, 0x09]);
    let republished = proto::KvPoolCatalogUpdate::decode(republished.as_slice()).unwrap();
    assert!(view.apply(&republished).unwrap().is_empty());
    let mut aliased = domain.clone();
    aliased.registrations[0].aliases.insert("tiny".to_owned());
    let changes = view.apply(&catalog_message(&[aliased], 2)).unwrap();
    assert_eq!(changes.refreshed, vec![domain.pool_id()]);
    assert_eq!(changes.to_subscribe().count() + changes.to_unsubscribe().count(), 0);
}

#[test]
fn unknown_semantics_are_distinguished_from_malformed_known_values() {
    // The future oneof alternative: ModelTarget field 3, an empty message (bytes 1a 00).
    let future_target = proto::ModelTarget::decode([0x1a, 0x00].as_slice()).unwrap();
    assert_eq!(future_target.target, None, "an unknown alternative decodes as an unset oneof");
    let error = validate_model_target(&future_target).unwrap_err();
    assert_eq!(error, WireError::UnsetModelTarget);
    assert!(error.is_unsupported());

    type ProducerMutation = fn(&mut proto::ProducerIdentity);
    let producer_cases: [(&str, ProducerMutation, bool); 17] = [
        ("identity_version 2", |p| p.pool_id.as_mut().unwrap().identity_version = 2, true),
        ("identity_version 0", |p| p.pool_id.as_mut().unwrap().identity_version = 0, false),
        ("unknown source", |p| cache_semantics(p).source = 3, true),
        ("unspecified source", |p| cache_semantics(p).source = 0, false),
        ("short digest", |p| cache_semantics(p).digest.truncate(15), false),
        (
            "unknown source before digest length",
            |p| {
                cache_semantics(p).source = 9;
                cache_semantics(p).digest.clear();
            },
            true,
        ),
        ("missing domain", |p| p.pool_id.as_mut().unwrap().indexer_domain = None, false),
        ("missing pool id", |p| p.pool_id = None, false),
        ("layout generation 0", |p| p.layout_generation = 0, false),
        ("format version 2", |p| p.ckf_format.as_mut().unwrap().format_version = 2, true),
        ("format version 0", |p| p.ckf_format.as_mut().unwrap().format_version = 0, false),
        ("fingerprint bits 8", |p| p.ckf_format.as_mut().unwrap().fingerprint_bits = 8, true),
        ("slots 0", |p| p.ckf_format.as_mut().unwrap().slots_per_bucket = 0, false),
        ("bucket count 2^25", |p| p.ckf_format.as_mut().unwrap().bucket_count = 1 << 25, true),
        ("bucket count u64::MAX", |p| p.ckf_format.as_mut().unwrap().bucket_count = u64::MAX, true),
        ("bucket count 3", |p| p.ckf_format.as_mut().unwrap().bucket_count = 3, false),
        ("missing format", |p| p.ckf_format = None, false),
    ];
    for (case, mutate, unsupported) in producer_cases {
        let mut wire = wire_producer();
        mutate(&mut wire);
        let error = validate_producer(&wire).unwrap_err();
        assert_eq!(error.is_unsupported(), unsupported, "{case}: {error}");
        assert!(!error.is_contract_mismatch(), "{case}");
    }

    let semantics = |hash_format| proto::KvQuerySemantics { kv_block_size: 16, hash_format };
    assert!(validate_query_semantics(&semantics(3)).unwrap_err().is_unsupported());
    assert!(!validate_query_semantics(&semantics(0)).unwrap_err().is_unsupported());

    let mut descriptor = encode::descriptor(&aggregated_descriptor("dynamo/backend/generate", 1));
    for (pool_roles, unsupported) in
        [(vec![4, 9], true), (vec![0, 9], true), (vec![0, 4], false), (vec![4, 4], false)]
    {
        descriptor.pool_roles = pool_roles.clone();
        let error = validate_descriptor(&descriptor).unwrap_err();
        assert_eq!(error.is_unsupported(), unsupported, "{pool_roles:?}: {error}");
    }

    let mut entry = encode::topology_entry(&disaggregated_entry());
    entry.state = 3;
    assert!(validate_topology_entry(&entry).unwrap_err().is_unsupported());
    entry.state = ReadinessState::Unknown.wire_value();
    assert!(validate_topology_entry(&entry).is_ok(), "UNKNOWN (0) is a valid state");
}

#[test]
fn topology_validation_is_fail_closed_for_members_roles_and_namespaces() {
    type EntryMutation = fn(&mut proto::TopologyEntry);
    let cases: [(&str, EntryMutation, WireError); 20] = [
        ("no members", |e| e.members.clear(), WireError::Empty { field: "members" }),
        (
            "member in another namespace",
            |e| e.members[1].endpoint.as_mut().unwrap().namespace = "other".to_owned(),
            WireError::MemberNamespace { member: "other".to_owned(), entry: "dynamo".to_owned() },
        ),
        (
            "member without roles",
            |e| e.members[0].roles.clear(),
            WireError::Empty { field: "members.roles" },
        ),
        (
            "member role unspecified",
            |e| e.members[0].roles = vec![2, 0],
            WireError::Unspecified { field: "members.roles" },
        ),
        (
            "member role unknown",
            |e| e.members[0].roles = vec![6],
            WireError::UnknownEnum { field: "members.roles", value: 6 },
        ),
        (
            "member without endpoint",
            |e| e.members[0].endpoint = None,
            WireError::Missing { field: "members.endpoint" },
        ),
        (
            "member endpoint padded",
            |e| e.members[0].endpoint.as_mut().unwrap().component = "backend ".to_owned(),
            WireError::InvalidText {
                field: "endpoint.component",
                reason: TextError::SurroundingWhitespace,
            },
        ),
        (
            "member endpoint with a separator",
            |e| e.members[0].endpoint.as_mut().unwrap().component = "a/b".to_owned(),
            WireError::Endpoint(crate::model::identity::EndpointPathError::SeparatorInSegment(
                crate::model::identity::EndpointSegment::Component,
            )),
        ),
        (
            "member listed twice",
            |e| e.members[1] = e.members[0].clone(),
            WireError::Duplicate {
                field: "members.endpoint",
                value: "dynamo/backend/generate".to_owned(),
            },
        ),
        (
            "member pool id malformed",
            |e| {
                let pool = e.members[0].pool_id.as_mut().unwrap();
                pool.indexer_domain.as_mut().unwrap().routing_scope.as_mut().unwrap().digest =
                    vec![1, 2, 3];
            },
            WireError::DigestLength {
                field: "pool_id.indexer_domain.routing_scope.digest",
                length: 3,
            },
        ),
        (
            "member pool id from a future identity version",
            |e| e.members[0].pool_id.as_mut().unwrap().identity_version = 2,
            WireError::IdentityVersion { found: 2 },
        ),
        (
            "duplicate roles may only name PREFILL or DECODE",
            |e| e.duplicate_role_endpoints = vec![1, 3],
            WireError::RoleNotAllowed {
                field: "duplicate_role_endpoints",
                role: WorkerRole::Encode,
            },
        ),
        (
            "aggregated is not a duplicable role either",
            |e| e.duplicate_role_endpoints = vec![4],
            WireError::RoleNotAllowed {
                field: "duplicate_role_endpoints",
                role: WorkerRole::Aggregated,
            },
        ),
        (
            "duplicate roles repeated",
            |e| e.duplicate_role_endpoints = vec![1, 1],
            WireError::Duplicate {
                field: "duplicate_role_endpoints",
                value: "WORKER_ROLE_PREFILL".to_owned(),
            },
        ),
        (
            "present role repeated",
            |e| e.present_roles = vec![1, 2, 2],
            WireError::Duplicate { field: "present_roles", value: "WORKER_ROLE_DECODE".to_owned() },
        ),
        (
            "missing role unspecified",
            |e| e.missing_roles = vec![0],
            WireError::Unspecified { field: "missing_roles" },
        ),
        ("unknown state", |e| e.state = 3, WireError::UnknownEnum { field: "state", value: 3 }),
        (
            "namespace padded",
            |e| e.namespace = " dynamo".to_owned(),
            WireError::InvalidText { field: "namespace", reason: TextError::SurroundingWhitespace },
        ),
        (
            "adapter listed twice",
            |e| {
                e.adapters = vec![
                    proto::AdapterReadiness {
                        canonical_model_id: "adapter-a".to_owned(),
                        state: 2,
                        missing_roles: Vec::new(),
                    };
                    2
                ];
            },
            WireError::Duplicate {
                field: "adapters.canonical_model_id",
                value: "adapter-a".to_owned(),
            },
        ),
        (
            "adapter with an unknown state",
            |e| {
                e.adapters = vec![proto::AdapterReadiness {
                    canonical_model_id: "adapter-a".to_owned(),
                    state: 5,
                    missing_roles: Vec::new(),
                }];
            },
            WireError::UnknownEnum { field: "adapters.state", value: 5 },
        ),
    ];
    let valid = encode::topology_entry(&disaggregated_entry());
    assert_eq!(validate_topology_entry(&valid), Ok(disaggregated_entry()));
    for (case, mutate, expected) in cases {
        let mut entry = valid.clone();
        mutate(&mut entry);
        assert_eq!(validate_topology_entry(&entry), Err(expected), "{case}");
    }

    // Members are unique by tuple: components with dots do not collapse into one member even
    // where a dotted join of the tuples would be equal ("ns.a.b.c").
    let mut dotted = valid.clone();
    dotted.namespace = "ns".to_owned();
    dotted.members = vec![
        encode::topology_member(&member("ns/a.b/c", &[WorkerRole::Prefill], None)),
        encode::topology_member(&member("ns/a/b.c", &[WorkerRole::Decode], None)),
    ];
    let entry = validate_topology_entry(&dotted).unwrap();
    assert_eq!(entry.members.len(), 2);

    // At the plane level: a quarantined entry keeps its key; an unreadable key or a repeated
    // key fails the whole update.
    let mut update = encode::readiness_update(&RELAY, 3, &[disaggregated_entry(), lora_entry()]);
    update.entries[1].members[0].roles = vec![7];
    let validated = validate_readiness_update(&update).unwrap();
    assert_eq!(validated.entries, vec![disaggregated_entry()]);
    assert_eq!(validated.quarantined.len(), 1);
    assert_eq!(validated.quarantined[0].key, lora_entry().key());
    assert!(validated.quarantined[0].error.is_unsupported());

    update.entries[1].canonical_model_id = String::new();
    assert!(matches!(
        validate_readiness_update(&update),
        Err(PlaneError::Unidentifiable { index: 1, .. })
    ));
    update.entries[1] = update.entries[0].clone();
    assert!(matches!(
        validate_readiness_update(&update),
        Err(PlaneError::DuplicateKey { index: 1, .. })
    ));
}

#[test]
fn registration_rejects_missing_target_and_duplicate_alias() {
    let valid = encode::registration(&base_registration("base-llm", &["base-alias", "llm"]));
    assert_eq!(
        validate_registration(&valid),
        Ok(base_registration("base-llm", &["base-alias", "llm"]))
    );
    let lora = encode::registration(&lora_registration("adapter-a", "base-llm"));
    assert_eq!(validate_registration(&lora), Ok(lora_registration("adapter-a", "base-llm")));

    type RegistrationMutation = fn(&mut proto::ModelRegistration);
    let cases: [(&str, RegistrationMutation, WireError); 8] = [
        (
            "target missing",
            |r| r.target = None,
            WireError::Missing { field: "registration.target" },
        ),
        (
            "target oneof unset",
            |r| r.target = Some(proto::ModelTarget { target: None }),
            WireError::UnsetModelTarget,
        ),
        (
            "alias repeated",
            |r| r.aliases.push("llm".to_owned()),
            WireError::Duplicate { field: "registration.aliases", value: "llm".to_owned() },
        ),
        (
            "alias equal to the canonical id",
            |r| r.aliases.push("base-llm".to_owned()),
            WireError::Duplicate { field: "registration.aliases", value: "base-llm".to_owned() },
        ),
        (
            "alias empty",
            |r| r.aliases.push(String::new()),
            WireError::InvalidText { field: "registration.aliases", reason: TextError::Empty },
        ),
        (
            "canonical id padded",
            |r| r.canonical_model_id = "base-llm\n".to_owned(),
            WireError::InvalidText {
                field: "registration.canonical_model_id",
                reason: TextError::SurroundingWhitespace,
            },
        ),
        (
            "base model empty",
            |r| {
                r.target = Some(proto::ModelTarget {
                    target: Some(proto::model_target::Target::Base(proto::BaseModelTarget {
                        base_model: String::new(),
                    })),
                });
            },
            WireError::InvalidText { field: "target.base.base_model", reason: TextError::Empty },
        ),
        (
            "adapter padded",
            |r| {
                r.target = Some(proto::ModelTarget {
                    target: Some(proto::model_target::Target::Lora(proto::LoraModelTarget {
                        base_model: "base-llm".to_owned(),
                        adapter: " adapter-a".to_owned(),
                    })),
                });
            },
            WireError::InvalidText {
                field: "target.lora.adapter",
                reason: TextError::SurroundingWhitespace,
            },
        ),
    ];
    for (case, mutate, expected) in cases {
        let mut registration = valid.clone();
        mutate(&mut registration);
        let error = validate_registration(&registration).unwrap_err();
        assert_eq!(error, expected, "{case}");
        assert_eq!(error.is_unsupported(), expected == WireError::UnsetModelTarget, "{case}");
    }

    // One canonical id registered twice in a descriptor is ambiguous.
    let mut descriptor = encode::descriptor(&lora_descriptor("loras/backend/generate", 1));
    descriptor.registrations.push(descriptor.registrations[0].clone());
    assert_eq!(
        validate_descriptor(&descriptor),
        Err(WireError::Duplicate {
            field: "registrations.canonical_model_id",
            value: "adapter-a".to_owned(),
        })
    );
}

#[test]
fn query_semantics_fail_closed_for_missing_zero_and_unknown_values() {
    let eagle = proto::KvQuerySemantics {
        kv_block_size: 32,
        hash_format: proto::KvQueryHashFormat::DynamoEagleV1 as i32,
    };
    assert_eq!(
        validate_query_semantics(&eagle),
        Ok(QuerySemantics { kv_block_size: 32, hash_format: HashFormat::EagleV1 })
    );
    let cases = [
        (
            proto::KvQuerySemantics { kv_block_size: 0, ..eagle },
            WireError::Zero { field: "query_semantics.kv_block_size" },
        ),
        (
            proto::KvQuerySemantics { hash_format: 0, ..eagle },
            WireError::Unspecified { field: "query_semantics.hash_format" },
        ),
        (
            proto::KvQuerySemantics { hash_format: 3, ..eagle },
            WireError::UnknownEnum { field: "query_semantics.hash_format", value: 3 },
        ),
        (
            proto::KvQuerySemantics { hash_format: -1, ..eagle },
            WireError::UnknownEnum { field: "query_semantics.hash_format", value: -1 },
        ),
        // A message with neither field set reads as block size 0.
        (
            proto::KvQuerySemantics::default(),
            WireError::Zero { field: "query_semantics.kv_block_size" },
        ),
    ];
    for (semantics, expected) in cases {
        assert_eq!(validate_query_semantics(&semantics), Err(expected));
    }
    let mut descriptor = encode::descriptor(&aggregated_descriptor("dynamo/backend/generate", 1));
    descriptor.query_semantics = None;
    assert_eq!(
        validate_descriptor(&descriptor),
        Err(WireError::Missing { field: "query_semantics" })
    );
}

#[test]
fn producer_key_fences_every_v1_identity_dimension() {
    let base = validate_producer(&wire_producer()).unwrap().key();
    type Mutation = fn(&mut proto::ProducerIdentity);
    let mutations: [(&str, Mutation); 13] = [
        ("identity_version", |p| p.pool_id.as_mut().unwrap().identity_version += 1),
        ("cache_semantics.digest", |p| cache_semantics(p).digest[0] ^= 1),
        ("cache_semantics.source", |p| cache_semantics(p).source = 2),
        ("routing_scope.digest", |p| {
            let domain = p.pool_id.as_mut().unwrap().indexer_domain.as_mut().unwrap();
            domain.routing_scope.as_mut().unwrap().digest[15] ^= 0x80;
        }),
        ("routing_scope.source", |p| {
            let domain = p.pool_id.as_mut().unwrap().indexer_domain.as_mut().unwrap();
            domain.routing_scope.as_mut().unwrap().source = 2;
        }),
        ("dc_id", |p| p.pool_id.as_mut().unwrap().dc_id += 1),
        ("producer_incarnation", |p| p.producer_incarnation += 1),
        ("layout_generation", |p| p.layout_generation += 1),
        ("format_version", |p| p.ckf_format.as_mut().unwrap().format_version += 1),
        ("seed", |p| p.ckf_format.as_mut().unwrap().seed ^= 1),
        ("bucket_count", |p| p.ckf_format.as_mut().unwrap().bucket_count *= 2),
        ("fingerprint_bits", |p| p.ckf_format.as_mut().unwrap().fingerprint_bits = 8),
        ("slots_per_bucket", |p| p.ckf_format.as_mut().unwrap().slots_per_bucket = 2),
    ];
    for (dimension, mutate) in mutations {
        let mut wire = wire_producer();
        mutate(&mut wire);
        // Either the mutated identity is rejected (an unsupported version or shape), or it
        // validates to a different key: never to the same one.
        if let Ok(identity) = validate_producer(&wire) {
            assert_ne!(identity.key(), base, "{dimension} must take part in the key");
        }
    }
    assert_eq!(validate_producer(&wire_producer()).unwrap().key(), base);
}

#[test]
fn ckf_format_accepts_only_the_executable_cbi1_shape() {
    let good = encode::ckf_format(&CkfFormat::v1(DEFAULT_SEED, 524_288));
    assert_eq!(validate_ckf_format(&good), Ok(CkfFormat::v1(DEFAULT_SEED, 524_288)));
    for bucket_count in [2, 1 << 24] {
        assert!(validate_ckf_format(&proto::CkfFormat { bucket_count, ..good }).is_ok());
    }
    let cases = [
        (
            proto::CkfFormat { format_version: 2, ..good },
            WireError::UnsupportedCkfFormat { field: "format_version", value: 2 },
        ),
        (
            proto::CkfFormat { format_version: 0, ..good },
            WireError::Zero { field: "ckf_format.format_version" },
        ),
        // A future version is unsupported even when its other fields would be malformed in v1.
        (
            proto::CkfFormat { format_version: 2, bucket_count: 0, ..good },
            WireError::UnsupportedCkfFormat { field: "format_version", value: 2 },
        ),
        (proto::CkfFormat { seed: 0, ..good }, WireError::Zero { field: "ckf_format.seed" }),
        (
            proto::CkfFormat { bucket_count: 0, ..good },
            WireError::Zero { field: "ckf_format.bucket_count" },
        ),
        (
            proto::CkfFormat { fingerprint_bits: 0, ..good },
            WireError::Zero { field: "ckf_format.fingerprint_bits" },
        ),
        (
            proto::CkfFormat { fingerprint_bits: 32, ..good },
            WireError::UnsupportedCkfFormat { field: "fingerprint_bits", value: 32 },
        ),
        (
            proto::CkfFormat { slots_per_bucket: 8, ..good },
            WireError::UnsupportedCkfFormat { field: "slots_per_bucket", value: 8 },
        ),
        (
            proto::CkfFormat { bucket_count: 1 << 25, ..good },
            WireError::BucketCountTooLarge { bucket_count: 1 << 25 },
        ),
        (
            proto::CkfFormat { bucket_count: 1, ..good },
            WireError::BucketCountShape { bucket_count: 1 },
        ),
        (
            proto::CkfFormat { bucket_count: 1000, ..good },
            WireError::BucketCountShape { bucket_count: 1000 },
        ),
    ];
    for (format, expected) in cases {
        assert_eq!(validate_ckf_format(&format), Err(expected));
    }
}

// ---- catalog descriptors -----------------------------------------------------------------------

#[test]
fn descriptor_fails_closed_for_missing_fields_and_bad_roles() {
    let valid = encode::descriptor(&lora_descriptor("loras/backend/generate", 1));
    type DescriptorMutation = fn(&mut proto::KvPoolDescriptor);
    let cases: [(&str, DescriptorMutation, WireError); 6] = [
        ("no producer", |d| d.producer = None, WireError::Missing { field: "producer" }),
        (
            "no endpoint",
            |d| d.serving_endpoint = None,
            WireError::Missing { field: "serving_endpoint" },
        ),
        (
            "empty endpoint segment",
            |d| d.serving_endpoint.as_mut().unwrap().endpoint.clear(),
            WireError::InvalidText { field: "endpoint.endpoint", reason: TextError::Empty },
        ),
        ("no pool roles", |d| d.pool_roles.clear(), WireError::Empty { field: "pool_roles" }),
        (
            "pool role unspecified",
            |d| d.pool_roles.push(0),
            WireError::Unspecified { field: "pool_roles" },
        ),
        (
            "pool role repeated",
            |d| d.pool_roles.push(1),
            WireError::Duplicate { field: "pool_roles", value: "WORKER_ROLE_PREFILL".to_owned() },
        ),
    ];
    for (case, mutate, expected) in cases {
        let mut descriptor = valid.clone();
        mutate(&mut descriptor);
        assert_eq!(validate_descriptor(&descriptor), Err(expected), "{case}");
    }
    // Registrations may be empty on the wire; that is the relay's choice, not a fault.
    let mut bare = valid.clone();
    bare.registrations.clear();
    assert!(validate_descriptor(&bare).is_ok());
}

#[test]
fn future_model_target_alternative_quarantines_only_its_pool() {
    // ModelRegistration { canonical_model_id: "tiny-llm", target: <1a 00> }: field 1 (0a), then
    // field 2 (12) holding ModelTarget bytes 1a 00 — oneof alternative 3 with an empty message.
    let mut bytes = vec![0x0a, 0x08];
    bytes.extend_from_slice(b"tiny-llm");
    bytes.extend_from_slice(&[0x12, 0x02, 0x1a, 0x00]);
    let registration = proto::ModelRegistration::decode(bytes.as_slice()).unwrap();
    assert_eq!(registration.target, Some(proto::ModelTarget { target: None }));

    let usable = aggregated_descriptor("dynamo/backend/generate", 1);
    let future = aggregated_descriptor("dynamo/prefill/generate", 2);
    let mut message = catalog_message(&[usable.clone(), future.clone()], 5);
    let snapshot = message.snapshot.as_mut().unwrap();
    let index = snapshot
        .pools
        .iter()
        .position(|pool| pool.serving_endpoint == Some(encode::endpoint(&future.serving_endpoint)))
        .unwrap();
    snapshot.pools[index].registrations = vec![registration];

    let update = validate_catalog_update(&over_the_wire(&message)).unwrap();
    assert_eq!(update.pools, vec![usable.clone()]);
    assert_eq!(
        update.quarantined,
        vec![Quarantined {
            key: PoolRef::Known(future.pool_id()),
            error: WireError::UnsetModelTarget
        }]
    );
}

// ---- consumer views ----------------------------------------------------------------------------

#[test]
fn catalog_view_reports_producer_change_withdrawal_and_quarantine() {
    let a1 = aggregated_descriptor("dynamo/a/generate", 1);
    let b2 = aggregated_descriptor("dynamo/b/generate", 2);
    let c3 = aggregated_descriptor("dynamo/c/generate", 3);
    let mut view = CatalogView::new();
    assert_eq!(view.revision(), None);

    let changes = view.apply(&catalog_message(&[a1.clone(), b2.clone(), c3.clone()], 3)).unwrap();
    let mut added = vec![a1.producer, b2.producer, c3.producer];
    added.sort_by_key(ProducerIdentity::pool_id);
    assert_eq!(changes.added, added);
    assert_eq!((view.relay(), view.revision()), (Some(RELAY), Some(3)));

    // The same snapshot again (a heartbeat) changes nothing.
    assert!(
        view.apply(&catalog_message(&[a1.clone(), b2.clone(), c3.clone()], 3)).unwrap().is_empty()
    );

    // A new generation of a, new metadata for b, c withdrawn.
    let a4 = aggregated_descriptor("dynamo/a/generate", 4);
    let mut b2_aliased = b2.clone();
    b2_aliased.registrations[0].aliases.insert("tiny".to_owned());
    let changes = view.apply(&catalog_message(&[a4.clone(), b2_aliased.clone()], 6)).unwrap();
    assert_eq!(
        changes,
        CatalogChanges {
            added: Vec::new(),
            producer_changed: vec![ProducerChange { previous: a1.producer, current: a4.producer }],
            refreshed: vec![b2.pool_id()],
            withdrawn: vec![c3.producer],
            quarantined: Vec::new(),
        }
    );
    assert_eq!(changes.to_unsubscribe().copied().collect::<Vec<_>>(), [c3.producer, a1.producer]);
    assert_eq!(changes.to_subscribe().copied().collect::<Vec<_>>(), [a4.producer]);

    // b turns unsupported (a future model target) and an unrecognized pool (identity version
    // 2) appears: b's state is dropped, the unrecognized pool is kept apart, a is untouched.
    let mut message = catalog_message(&[a4.clone(), b2_aliased.clone()], 7);
    let mut future_pool = encode::descriptor(&aggregated_descriptor("dynamo/d/generate", 5));
    future_pool.producer.as_mut().unwrap().pool_id.as_mut().unwrap().identity_version = 2;
    let snapshot = message.snapshot.as_mut().unwrap();
    for pool in &mut snapshot.pools {
        if pool.serving_endpoint == Some(encode::endpoint(&b2.serving_endpoint)) {
            pool.registrations[0].target = Some(proto::ModelTarget { target: None });
        }
    }
    snapshot.pools.push(future_pool.clone());
    let changes = view.apply(&message).unwrap();
    assert_eq!(changes.quarantined, vec![b2.producer]);
    assert!(changes.added.is_empty() && changes.withdrawn.is_empty());
    assert_eq!(view.descriptors().cloned().collect::<Vec<_>>(), vec![a4.clone()]);
    let quarantined: Vec<&PoolRef> = view.quarantined().map(|(key, _)| key).collect();
    assert_eq!(quarantined.len(), 2);
    assert!(quarantined.contains(&&PoolRef::Known(b2.pool_id())));
    assert!(quarantined.iter().any(|key| matches!(key, PoolRef::Unrecognized(_))));

    // b recovers: it is a new subscription (its old state was dropped, not kept as fallback).
    let changes = view.apply(&catalog_message(&[a4.clone(), b2_aliased.clone()], 8)).unwrap();
    assert_eq!(changes.added, vec![b2.producer]);
    assert_eq!(view.quarantined().count(), 0);

    // A pool listed twice invalidates the whole plane.
    let mut duplicated = catalog_message(&[a4.clone(), b2_aliased.clone()], 9);
    let snapshot = duplicated.snapshot.as_mut().unwrap();
    snapshot.pools.push(snapshot.pools[0].clone());
    let invalidated = view.apply(&duplicated).unwrap_err();
    assert!(matches!(invalidated.error, PlaneError::DuplicateKey { index: 2, .. }));
    let mut dropped = invalidated.withdrawn.clone();
    dropped.sort();
    let mut expected = vec![a4.producer, b2.producer];
    expected.sort();
    assert_eq!(dropped, expected);
    assert_eq!((view.descriptors().count(), view.revision()), (0, None));

    // The next valid snapshot rebuilds the view from scratch.
    let changes = view.apply(&catalog_message(std::slice::from_ref(&a4), 10)).unwrap();
    assert_eq!(changes.added, vec![a4.producer]);

    // An unidentifiable descriptor (malformed pool id) also invalidates the plane.
    let mut unidentifiable = catalog_message(std::slice::from_ref(&a4), 11);
    cache_semantics(unidentifiable.snapshot.as_mut().unwrap().pools[0].producer.as_mut().unwrap())
        .digest
        .truncate(4);
    let invalidated = view.apply(&unidentifiable).unwrap_err();
    assert!(matches!(invalidated.error, PlaneError::Unidentifiable { index: 0, .. }));
    assert_eq!(invalidated.withdrawn, vec![a4.producer]);

    // So does an envelope without a snapshot.
    let mut empty = catalog_message(&[], 12);
    empty.snapshot = None;
    assert_eq!(
        view.apply(&empty).unwrap_err().error,
        PlaneError::Envelope(WireError::Missing { field: "snapshot" })
    );
}

#[test]
fn readiness_view_quarantines_unknown_states_and_replaces_on_every_snapshot() {
    let mut view = ReadinessView::new();
    let entries = [disaggregated_entry(), lora_entry()];
    let changes = view.apply(&encode::readiness_update(&RELAY, 4, &entries)).unwrap();
    assert_eq!(changes.added, vec![disaggregated_entry().key(), lora_entry().key()]);
    assert!(matches!(view.lookup("dynamo", "tiny-llm"), ReadinessLookup::Entry(entry)
        if entry.state == ReadinessState::Ready));

    // The heartbeat repeats the revision: no change.
    assert!(view.apply(&encode::readiness_update(&RELAY, 4, &entries)).unwrap().is_empty());

    // A future state quarantines the entry: never READY, not authoritatively unavailable.
    let mut update = encode::readiness_update(&RELAY, 5, &entries);
    update.entries[0].state = 3;
    let changes = view.apply(&update).unwrap();
    assert_eq!(changes.quarantined, vec![disaggregated_entry().key()]);
    assert!(matches!(view.lookup("dynamo", "tiny-llm"), ReadinessLookup::Quarantined(error)
        if error.is_unsupported()));
    assert!(matches!(view.lookup("loras", "base-llm"), ReadinessLookup::Entry(_)));

    // A complete snapshot replaces the view: the lora entry is gone, the quarantined entry is
    // usable again.
    let changes =
        view.apply(&encode::readiness_update(&RELAY, 6, &[disaggregated_entry()])).unwrap();
    assert_eq!(changes.added, vec![disaggregated_entry().key()]);
    assert_eq!(changes.removed, vec![lora_entry().key()]);
    assert_eq!(view.lookup("loras", "base-llm"), ReadinessLookup::Absent);

    // An envelope from another contract empties the view.
    let mut skewed = encode::readiness_update(&RELAY, 7, &[disaggregated_entry()]);
    skewed.protocol_version = 2;
    let error = view.apply(&skewed).unwrap_err();
    assert!(error.is_contract_mismatch());
    assert_eq!(view.lookup("dynamo", "tiny-llm"), ReadinessLookup::Absent);
    assert_eq!(view.revision(), None);
}

#[test]
fn load_view_moves_forward_only_and_quarantines_bad_entries() {
    let first = producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 1);
    let second = producer(pool("meta/tiny-llm", "dynamo/prefill/generate"), 2);
    let window = |relay: &RelayIdentity, window_sequence| {
        let load = PoolLoadSnapshot {
            kv_expected_ranks: 1,
            kv_capacity_ranks: 1,
            kv_observed_ranks: 1,
            kv_used_blocks: Some(600),
            total_kv_blocks: Some(16_384),
            degraded: false,
        };
        let mut message = encode::load_update(
            relay,
            LoadWindows::new(NonZeroU64::new(1000).unwrap(), 5, [(first, load), (second, load)])
                .unwrap()
                .current(),
        );
        message.window_sequence = window_sequence;
        message
    };

    let mut view = LoadView::new();
    assert_eq!(view.apply(&window(&RELAY, 76)), Ok(LoadOutcome::Replaced { window_sequence: 76 }));
    assert_eq!(view.load(&first).map(|load| load.kv_used_blocks), Some(Some(600)));
    assert_eq!(
        view.apply(&window(&RELAY, 76)),
        Ok(LoadOutcome::Stale { window_sequence: 76, current: 76 })
    );
    assert_eq!(
        view.apply(&window(&RELAY, 70)),
        Ok(LoadOutcome::Stale { window_sequence: 70, current: 76 })
    );
    // A restarted relay starts again from 0.
    let restarted = RelayIdentity { relay_incarnation: 42, ..RELAY };
    assert_eq!(
        view.apply(&window(&restarted, 0)),
        Ok(LoadOutcome::Replaced { window_sequence: 0 })
    );
    assert_eq!(view.window_sequence(), Some(0));

    // An entry claiming more observed than expected ranks is quarantined; the other stays.
    let mut bad = window(&restarted, 1);
    bad.pools[1].kv_observed_ranks = 2;
    assert_eq!(view.apply(&bad), Ok(LoadOutcome::Replaced { window_sequence: 1 }));
    assert!(view.load(&first).is_some());
    assert_eq!(view.load(&second), None);
    assert!(view.is_quarantined(&PoolRef::Known(second.pool_id())));

    // A producer listed twice, or an entry without producer, invalidates the whole window.
    let mut duplicated = window(&restarted, 2);
    duplicated.pools[1] = duplicated.pools[0].clone();
    assert!(matches!(view.apply(&duplicated), Err(PlaneError::DuplicateKey { index: 1, .. })));
    assert_eq!(view.window_sequence(), None);
    let mut anonymous = window(&restarted, 3);
    anonymous.pools[0].producer = None;
    assert!(matches!(view.apply(&anonymous), Err(PlaneError::Unidentifiable { index: 0, .. })));
}

#[test]
fn load_entries_read_unset_sums_as_unknown_never_as_zero() {
    let producer = Some(wire_producer());
    let entry = |used, total, observed, expected| proto::KvPoolLoadEntry {
        producer: producer.clone(),
        kv_used_blocks: used,
        total_kv_blocks: total,
        kv_observed_ranks: observed,
        kv_expected_ranks: expected,
    };
    let partial = validate_load_entry(&entry(5, 0, 0, 1)).unwrap();
    assert_eq!((partial.kv_used_blocks, partial.total_kv_blocks), (None, None));
    assert!(!partial.is_complete());
    let idle = validate_load_entry(&entry(0, 16_384, 2, 2)).unwrap();
    assert_eq!((idle.kv_used_blocks, idle.total_kv_blocks), (Some(0), Some(16_384)));
    let no_ranks = validate_load_entry(&entry(0, 0, 0, 0)).unwrap();
    assert_eq!(no_ranks.kv_used_blocks, None);
    assert_eq!(
        validate_load_entry(&entry(1, 1, 3, 2)),
        Err(WireError::RankCoverage { observed: 3, expected: 2 })
    );
}

#[test]
fn filter_stream_rejects_drift_and_frames_of_the_wrong_shape() {
    let subscribed = producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 1);
    let successor = producer(pool("meta/tiny-llm", "dynamo/backend/generate"), 2);
    let frames = FilterEncoder::new(&RELAY, &subscribed);

    let mut guard = FilterStreamGuard::new(subscribed);
    assert!(guard.check(&frames.heartbeat(9, 0)).is_ok());
    assert!(matches!(
        guard.check(&FilterEncoder::new(&RELAY, &successor).heartbeat(9, 0)),
        Err(FilterStreamFault::ProducerDrift { .. })
    ));
    let other_relay = RelayIdentity { drt_instance_id: 1, ..RELAY };
    assert_eq!(
        guard.check(&FilterEncoder::new(&other_relay, &subscribed).heartbeat(9, 0)),
        Err(FilterStreamFault::RelayDrift { expected: RELAY, found: other_relay })
    );

    let payload = Bytes::from_static(b"CBI1");
    let mut heartbeat_with_bytes = frames.heartbeat(9, 0);
    heartbeat_with_bytes.payload = frames.delta(4, 5, 0, payload.clone()).payload;
    let mut unspecified = frames.heartbeat(9, 0);
    unspecified.kind = 0;
    let mut future_kind = frames.heartbeat(9, 0);
    future_kind.kind = 4;
    let cases = [
        (
            frames.delta(4, 6, 0, payload.clone()),
            WireError::SequenceRelation { kind: "delta", base_sequence: 4, sequence: 6 },
        ),
        (
            frames.delta(u64::MAX, 0, 0, payload.clone()),
            WireError::SequenceRelation { kind: "delta", base_sequence: u64::MAX, sequence: 0 },
        ),
        (
            frames.delta(4, 5, 0, Bytes::new()),
            WireError::Payload { kind: "delta", expectation: "needs a CBI1 payload" },
        ),
        (
            frames.snapshot_chunk(4, 0, Bytes::new()),
            WireError::Payload { kind: "snapshot chunk", expectation: "needs a CBI1 payload" },
        ),
        (
            heartbeat_with_bytes,
            WireError::Payload { kind: "heartbeat", expectation: "must carry no payload" },
        ),
        (unspecified, WireError::Unspecified { field: "kind" }),
        (future_kind, WireError::UnknownEnum { field: "kind", value: 4 }),
    ];
    for (message, expected) in cases {
        assert_eq!(validate_filter_update(&message).map(|envelope| envelope.frame), Err(expected));
    }
    let mut snapshot = frames.snapshot_chunk(4, 0, payload);
    snapshot.base_sequence = 3;
    assert!(matches!(
        validate_filter_update(&snapshot),
        Err(WireError::SequenceRelation { kind: "snapshot chunk", .. })
    ));
}

// ---- server side: request checks and error reasons ---------------------------------------------

#[test]
fn every_error_reason_maps_to_its_grpc_code_and_trailer_name() {
    let table = [
        (
            RelayErrorReason::ContractMismatch,
            StatusCode::FailedPrecondition,
            1,
            "RELAY_ERROR_REASON_CONTRACT_MISMATCH",
        ),
        (
            RelayErrorReason::InvalidRequest,
            StatusCode::InvalidArgument,
            2,
            "RELAY_ERROR_REASON_INVALID_REQUEST",
        ),
        (
            RelayErrorReason::UnsupportedFeature,
            StatusCode::FailedPrecondition,
            3,
            "RELAY_ERROR_REASON_UNSUPPORTED_FEATURE",
        ),
        (
            RelayErrorReason::PoolNotFound,
            StatusCode::NotFound,
            4,
            "RELAY_ERROR_REASON_POOL_NOT_FOUND",
        ),
        (
            RelayErrorReason::ProducerChanged,
            StatusCode::FailedPrecondition,
            5,
            "RELAY_ERROR_REASON_PRODUCER_CHANGED",
        ),
        (
            RelayErrorReason::ResourceLimit,
            StatusCode::ResourceExhausted,
            6,
            "RELAY_ERROR_REASON_RESOURCE_LIMIT",
        ),
        (
            RelayErrorReason::SubscriberLagged,
            StatusCode::ResourceExhausted,
            7,
            "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED",
        ),
        (
            RelayErrorReason::SnapshotProgressTimeout,
            StatusCode::ResourceExhausted,
            8,
            "RELAY_ERROR_REASON_SNAPSHOT_PROGRESS_TIMEOUT",
        ),
        (
            RelayErrorReason::PublicationUnavailable,
            StatusCode::Unavailable,
            9,
            "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE",
        ),
        (
            RelayErrorReason::InvalidPublication,
            StatusCode::FailedPrecondition,
            10,
            "RELAY_ERROR_REASON_INVALID_PUBLICATION",
        ),
        (RelayErrorReason::Internal, StatusCode::Internal, 11, "RELAY_ERROR_REASON_INTERNAL"),
    ];
    assert_eq!(table.map(|row| row.0), RelayErrorReason::ALL);
    for (reason, code, value, name) in table {
        assert_eq!(reason.code(), code, "{name}");
        assert_eq!(reason.to_proto() as i32, value, "{name}");
        assert_eq!(reason.wire_name(), name);
        assert_eq!(RelayErrorReason::from_wire_name(name), Some(reason));
        assert_eq!(RelayErrorReason::from_proto(reason.to_proto()), Some(reason));
    }
    assert_eq!(RelayErrorReason::from_proto(proto::RelayErrorReason::Unspecified), None);
}

#[test]
fn error_reason_is_trusted_only_with_its_contract_code() {
    let failed = StatusCode::FailedPrecondition as i32;
    assert_eq!(RelayErrorReason::from_trailer(StatusCode::Unavailable as i32, None), None);
    for name in ["RELAY_ERROR_REASON_UNSPECIFIED", "RELAY_ERROR_REASON_FUTURE", "producer_changed"]
    {
        assert_eq!(RelayErrorReason::from_trailer(failed, Some(name)), None);
    }
    // A reason whose contract code is not the status code was not produced by a relay as is.
    let producer_changed = Some("RELAY_ERROR_REASON_PRODUCER_CHANGED");
    assert_eq!(RelayErrorReason::from_trailer(StatusCode::Internal as i32, producer_changed), None);
    assert_eq!(
        RelayErrorReason::from_trailer(failed, producer_changed),
        Some(RelayErrorReason::ProducerChanged)
    );
}

fn expect_invalid_request(result: Result<SubscriberId, RelayStatus>, message: &str) {
    let error = result.unwrap_err();
    assert_eq!((error.reason, error.message.as_str()), (RelayErrorReason::InvalidRequest, message));
    assert_eq!(error.code(), StatusCode::InvalidArgument);
}

#[test]
fn subscriber_id_is_bounded_in_bytes_and_never_truncated() {
    expect_invalid_request(SubscriberId::parse(""), "subscriber_id must not be empty");

    let exactly = "a".repeat(128);
    assert_eq!(SubscriberId::parse(&exactly).unwrap().as_str(), exactly);
    expect_invalid_request(
        SubscriberId::parse(&"a".repeat(129)),
        "subscriber_id exceeds 128 bytes",
    );

    // The bound is in bytes: a two-byte character that ends at byte 128 fits, one that ends at
    // byte 129 does not (even though the id has only 128 characters), and nothing is cut.
    let fits = format!("{}é", "a".repeat(126));
    assert_eq!(fits.len(), 128);
    assert_eq!(SubscriberId::parse(&fits).unwrap().as_str(), fits);
    let over = format!("{}é", "a".repeat(127));
    assert_eq!((over.len(), over.chars().count()), (129, 128));
    expect_invalid_request(SubscriberId::parse(&over), "subscriber_id exceeds 128 bytes");

    for control in ["router\n1", "\u{0}", "tab\there", "del\u{7f}", "c1\u{85}"] {
        expect_invalid_request(
            SubscriberId::parse(control),
            "subscriber_id must not contain control characters",
        );
    }
    for fine in ["router-eu-west/7", "ルーター", " spaced id "] {
        assert_eq!(SubscriberId::parse(fine).unwrap().to_string(), fine);
    }
}

#[test]
fn wrong_contract_markers_are_rejected_before_anything_else() {
    for marker in [0, 0x4B56_5232] {
        let results = [
            validate_relay_info_request(&proto::RelayInfoRequest { contract_marker: marker }),
            validate_catalog_request(&proto::WatchKvPoolCatalogRequest {
                subscriber_id: String::new(),
                contract_marker: marker,
            })
            .map(drop),
            validate_readiness_request(&proto::SubscribeServingReadinessRequest {
                subscriber_id: "\n".to_owned(),
                contract_marker: marker,
            })
            .map(drop),
            validate_load_request(&proto::SubscribeKvPoolLoadRequest {
                subscriber_id: "x".repeat(500),
                contract_marker: marker,
            })
            .map(drop),
            validate_pool_request(&proto::SubscribeKvPoolRequest {
                subscriber_id: String::new(),
                expected_producer: None,
                contract_marker: marker,
            })
            .map(drop),
        ];
        for result in results {
            let status = result.unwrap_err();
            assert_eq!(status.code(), StatusCode::FailedPrecondition);
            assert_eq!(status.message, "unsupported Relay v1 wire contract");
            assert_eq!(status.reason, RelayErrorReason::ContractMismatch);
        }
        // A consumer rejects the same markers on responses, before reading anything else.
        let mut info = encode::relay_info(&RELAY);
        info.contract_marker = marker;
        info.relay = None;
        let error = validate_relay_info(&info).unwrap_err();
        assert_eq!(error, WireError::ContractMarker { found: marker });
        assert!(error.is_contract_mismatch() && !error.is_unsupported());
    }
    assert_eq!(check_request_marker(CONTRACT_MARKER), Ok(()));
    assert_eq!(
        check_envelope(CONTRACT_MARKER, 0, None),
        Err(WireError::ProtocolVersion { found: 0 })
    );
    assert_eq!(
        check_envelope(CONTRACT_MARKER, 1, None),
        Err(WireError::Missing { field: "relay" })
    );
}

#[test]
fn pool_subscription_errors_cross_the_status_boundary() {
    let request = |expected_producer| proto::SubscribeKvPoolRequest {
        subscriber_id: "router-1".to_owned(),
        expected_producer,
        contract_marker: CONTRACT_MARKER,
    };
    let accepted = validate_pool_request(&request(Some(wire_producer()))).unwrap();
    assert_eq!(accepted.subscriber_id.as_str(), "router-1");
    assert_eq!(accepted.expected_producer, validate_producer(&wire_producer()).unwrap());

    type Mutation = fn(&mut proto::ProducerIdentity);
    let cases: [(&str, Mutation, StatusCode, RelayErrorReason); 7] = [
        (
            "identity_version + 1",
            |p| p.pool_id.as_mut().unwrap().identity_version += 1,
            StatusCode::FailedPrecondition,
            RelayErrorReason::UnsupportedFeature,
        ),
        (
            "layout_generation 0",
            |p| p.layout_generation = 0,
            StatusCode::InvalidArgument,
            RelayErrorReason::InvalidRequest,
        ),
        (
            "pool_id missing",
            |p| p.pool_id = None,
            StatusCode::InvalidArgument,
            RelayErrorReason::InvalidRequest,
        ),
        (
            "unknown identity source",
            |p| cache_semantics(p).source = 7,
            StatusCode::FailedPrecondition,
            RelayErrorReason::UnsupportedFeature,
        ),
        (
            "bucket count too large",
            |p| p.ckf_format.as_mut().unwrap().bucket_count = 1 << 30,
            StatusCode::FailedPrecondition,
            RelayErrorReason::UnsupportedFeature,
        ),
        (
            "bucket count not a power of two",
            |p| p.ckf_format.as_mut().unwrap().bucket_count = 3,
            StatusCode::InvalidArgument,
            RelayErrorReason::InvalidRequest,
        ),
        (
            "unspecified identity source",
            |p| cache_semantics(p).source = 0,
            StatusCode::InvalidArgument,
            RelayErrorReason::InvalidRequest,
        ),
    ];
    for (case, mutate, code, reason) in cases {
        let mut producer = wire_producer();
        mutate(&mut producer);
        let status = validate_pool_request(&request(Some(producer))).unwrap_err();
        assert_eq!(status.code(), code, "{case}");
        assert_eq!(status.reason, reason, "{case}");
    }
    let missing = validate_pool_request(&request(None)).unwrap_err();
    assert_eq!(missing, RelayStatus::invalid_request("expected_producer is required"));
    // The subscriber id is checked before the producer.
    let mut anonymous = request(None);
    anonymous.subscriber_id.clear();
    assert_eq!(
        validate_pool_request(&anonymous).unwrap_err().message,
        "subscriber_id must not be empty"
    );
}

#[test]
fn identity_sources_round_trip_and_unrecognized_pools_render_their_wire_key() {
    let mut pool_id = pool("meta/tiny-llm", "dynamo/backend/generate");
    pool_id.indexer_domain.routing_scope.source = IdentitySource::Explicit;
    pool_id.dc_id = DcId(7);
    assert_eq!(validate_pool_id(&over_the_wire(&encode::pool_id(&pool_id))), Ok(pool_id));

    let mut future = encode::pool_id(&pool_id);
    future.identity_version = 2;
    let key = WirePoolKey::of(&future);
    assert_eq!(key.as_bytes(), future.encode_to_vec());
    assert!(PoolRef::Unrecognized(key).to_string().starts_with("wire:0802"));
    assert_eq!(PoolRef::Known(pool_id).to_string(), pool_id.to_string());
}

#[test]
fn readiness_keys_collect_as_expected() {
    // Keys compare by (namespace, model), the order the views report changes in.
    let mut keys = vec![lora_entry().key(), disaggregated_entry().key(), unknown_entry().key()];
    keys.sort();
    assert_eq!(
        keys,
        vec![
            TopologyKey {
                namespace: "dynamo".to_owned(),
                canonical_model_id: "tiny-llm".to_owned()
            },
            TopologyKey {
                namespace: "legacy".to_owned(),
                canonical_model_id: "old-model".to_owned()
            },
            TopologyKey {
                namespace: "loras".to_owned(),
                canonical_model_id: "base-llm".to_owned()
            },
        ]
    );
}

// ---- robustness ----------------------------------------------------------------------------------

mod robustness {
    use proptest::prelude::*;

    use super::*;

    /// Decode `bytes` as every message type and run every validator and view on whatever
    /// decodes. The property is simply that nothing panics.
    fn exercise(bytes: &[u8]) {
        if let Ok(message) = proto::KvPoolCatalogUpdate::decode(bytes) {
            let _ = validate_catalog_update(&message);
            let _ = CatalogView::new().apply(&message);
        }
        if let Ok(message) = proto::ServingReadinessUpdate::decode(bytes) {
            let _ = validate_readiness_update(&message);
            let _ = ReadinessView::new().apply(&message);
        }
        if let Ok(message) = proto::KvPoolLoadUpdate::decode(bytes) {
            let _ = validate_load_update(&message);
            let _ = LoadView::new().apply(&message);
        }
        if let Ok(message) = proto::FilterUpdate::decode(bytes) {
            let _ = validate_filter_update(&message);
        }
        if let Ok(message) = proto::SubscribeKvPoolRequest::decode(bytes) {
            let _ = validate_pool_request(&message).map(|_| ());
        }
        if let Ok(message) = proto::KvPoolDescriptor::decode(bytes) {
            let _ = validate_descriptor(&message);
        }
        if let Ok(message) = proto::TopologyEntry::decode(bytes) {
            let _ = validate_topology_entry(&message);
        }
    }

    fn valid_messages() -> Vec<Vec<u8>> {
        vec![
            catalog_message(
                &[aggregated_descriptor("dynamo/backend/generate", 1), lora_descriptor("l/b/g", 2)],
                3,
            )
            .encode_to_vec(),
            encode::readiness_update(&RELAY, 2, &[disaggregated_entry(), lora_entry()])
                .encode_to_vec(),
            encode::topology_entry(&lora_entry()).encode_to_vec(),
        ]
    }

    proptest! {
        #[test]
        fn validators_never_panic_on_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            exercise(&bytes);
        }

        #[test]
        fn validators_never_panic_on_corrupted_valid_messages(
            which in 0usize..3,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        ) {
            let mut bytes = valid_messages().swap_remove(which);
            for (at, value) in flips {
                let index = at % bytes.len();
                bytes[index] = value;
            }
            exercise(&bytes);
        }
    }
}
