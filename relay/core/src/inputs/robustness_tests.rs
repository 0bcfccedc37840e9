//! Property tests of the wire decoders: no input, however malformed, makes them panic, and the
//! key and subject encodings round-trip.
//!
//! Arbitrary bytes mostly stop at the first byte, so the properties also mutate the real-shaped
//! samples (overwrite bytes, truncate, append), which drives the decoders deep into valid-looking
//! input.

use proptest::collection::vec;
use proptest::prelude::*;

use super::discovery_key::{DiscoveryKey, EventRecordKey};
use super::test_fixtures::{
    ADAPTER_CARD_JSON, AGGREGATED_CARD_JSON, CAPTURED_LOAD_PAYLOAD, CAPTURED_PAYLOAD,
    ENDPOINT_RECORD_JSON, EVENT_CHANNEL_NATS_JSON, EVENT_CHANNEL_ZMQ_JSON,
    EVENT_SOURCE_LIVE_ONLY_JSON, EVENT_SOURCE_RECOVERABLE_JSON, captured_envelope,
    model_record_json,
};
use super::wire::msgpack_value_len;
use super::*;
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, ResidencyDomain, RouterEvent, StorageTier,
    StoreData, StoredBlock,
};

/// Run every JSON decoder on `bytes`; only the absence of a panic is checked.
fn decode_all_json(bytes: &[u8]) {
    let _ = decode_discovery_record(bytes);
    let _ = decode_card_json(bytes);
}

/// Run every MessagePack decoder on `bytes`, whole and split into ZMQ frames.
fn decode_all_msgpack(bytes: &[u8], split: usize) {
    let _ = decode_event_envelope(bytes);
    let _ = decode_kv_events_payload(bytes);
    let _ = decode_active_load(bytes);
    let _ = zmq_event_frame_envelope(bytes);
    let endpoint = EndpointPath::new("dynamo", "backend", "generate").unwrap();
    let _ = decode_kv_events_message(endpoint, bytes);
    let _ = decode_kv_metrics_message(bytes);
    let split = split.min(bytes.len());
    let (head, tail) = bytes.split_at(split);
    let _ = decode_zmq_event_message(&[b"kv-events", head, &[0; 8], tail]);
    let _ = msgpack_value_len(bytes);
}

/// `sample` with bytes overwritten, then cut to `keep` bytes, then `extra` appended.
fn mutate(sample: &[u8], edits: &[(usize, u8)], keep: usize, extra: &[u8]) -> Vec<u8> {
    let mut bytes = sample.to_vec();
    for (index, byte) in edits {
        if !bytes.is_empty() {
            let at = index % bytes.len();
            bytes[at] = *byte;
        }
    }
    bytes.truncate(keep);
    bytes.extend_from_slice(extra);
    bytes
}

fn json_samples() -> Vec<Vec<u8>> {
    [
        ENDPOINT_RECORD_JSON.to_owned(),
        model_record_json(AGGREGATED_CARD_JSON, None),
        model_record_json(ADAPTER_CARD_JSON, Some("ad-1")),
        EVENT_SOURCE_LIVE_ONLY_JSON.to_owned(),
        EVENT_SOURCE_RECOVERABLE_JSON.to_owned(),
        EVENT_CHANNEL_NATS_JSON.to_owned(),
        EVENT_CHANNEL_ZMQ_JSON.to_owned(),
        AGGREGATED_CARD_JSON.to_owned(),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect()
}

fn msgpack_samples() -> Vec<Vec<u8>> {
    vec![captured_envelope(), CAPTURED_PAYLOAD.concat(), CAPTURED_LOAD_PAYLOAD.concat()]
}

/// A segment that is valid in an [`EndpointPath`]: non-empty, no `/`.
fn segment() -> impl Strategy<Value = String> {
    "[^/]{1,12}"
}

/// Any JSON value (bounded depth and width), for the MessagePack walker.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_filter("finite", |value| value.is_finite())
            .prop_map(serde_json::Value::from),
        ".{0,40}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 64, 20, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..20).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(".{0,8}", inner, 0..20)
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Any event the relay can represent, with small block lists.
fn router_event() -> impl Strategy<Value = RouterEvent> {
    let tier = prop_oneof![
        Just(StorageTier::Device),
        Just(StorageTier::HostPinned),
        Just(StorageTier::Disk),
        Just(StorageTier::External),
    ];
    let domain = proptest::option::of(prop_oneof![
        Just(ResidencyDomain::Worker),
        Just(ResidencyDomain::CacheOwner),
        "[a-z_]{0,12}"
            .prop_filter("not a known domain", |name| name != "worker" && name != "cache_owner")
            .prop_map(ResidencyDomain::Unsupported),
    ]);
    let block = (any::<u64>(), any::<u64>()).prop_map(|(block_hash, tokens_hash)| StoredBlock {
        block_hash: ExternalBlockHash(block_hash),
        tokens_hash: LocalBlockHash(tokens_hash),
    });
    let data = prop_oneof![
        (proptest::option::of(any::<u64>()), proptest::option::of(any::<u32>()), vec(block, 0..6))
            .prop_map(|(parent, start_position, blocks)| {
                KvCacheEventData::Stored(StoreData {
                    parent_hash: parent.map(ExternalBlockHash),
                    start_position,
                    blocks,
                })
            }),
        vec(any::<u64>(), 0..6).prop_map(|hashes| {
            KvCacheEventData::Removed(RemoveData {
                block_hashes: hashes.into_iter().map(ExternalBlockHash).collect(),
            })
        }),
        Just(KvCacheEventData::Cleared),
    ];
    (any::<u64>(), tier, domain, any::<u64>(), any::<u32>(), data).prop_map(
        |(worker_id, storage_tier, residency_domain, event_id, dp_rank, data)| RouterEvent {
            worker_id,
            storage_tier,
            residency_domain,
            event: KvCacheEvent { event_id, dp_rank, data },
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn json_decoders_never_panic_on_arbitrary_bytes(bytes in vec(any::<u8>(), 0..512)) {
        decode_all_json(&bytes);
    }

    #[test]
    fn json_decoders_never_panic_on_mutated_samples(
        sample in 0usize..8,
        edits in vec((any::<usize>(), any::<u8>()), 0..4),
        keep in any::<usize>(),
        extra in vec(any::<u8>(), 0..4),
    ) {
        let samples = json_samples();
        decode_all_json(&mutate(&samples[sample], &edits, keep, &extra));
    }

    #[test]
    fn msgpack_decoders_never_panic_on_arbitrary_bytes(
        bytes in vec(any::<u8>(), 0..512),
        split in any::<usize>(),
    ) {
        decode_all_msgpack(&bytes, split);
    }

    #[test]
    fn msgpack_decoders_never_panic_on_mutated_captures(
        sample in 0usize..3,
        edits in vec((any::<usize>(), any::<u8>()), 0..4),
        keep in any::<usize>(),
        extra in vec(any::<u8>(), 0..4),
        split in any::<usize>(),
    ) {
        let samples = msgpack_samples();
        decode_all_msgpack(&mutate(&samples[sample], &edits, keep, &extra), split);
    }

    #[test]
    fn text_parsers_never_panic(text in ".{0,200}", segments in vec("[a-z%./_-]{0,6}", 0..12)) {
        for candidate in [text.clone(), segments.join("."), segments.join("/"), format!("v1/{}", segments.join("/"))] {
            let _ = parse_event_subject(&candidate);
            let _ = DiscoveryKey::parse_key_path(&candidate);
            let _ = DiscoveryKey::parse_file_path(&candidate);
            let _ = parse_model_type(&candidate);
        }
    }

    #[test]
    fn event_subjects_round_trip(
        namespace in segment(), component in segment(), endpoint in segment(), topic in ".{1,12}",
    ) {
        let path = EndpointPath::new(namespace, component, endpoint).unwrap();
        let subject = event_subject(&path, &topic);
        prop_assert_eq!(parse_event_subject(&subject), Ok(EventSubject { endpoint: path, topic }));
    }

    #[test]
    fn discovery_keys_round_trip_as_key_paths_and_file_paths(
        namespace in segment(),
        component in segment(),
        endpoint in segment(),
        topic in ".{1,12}",
        id in any::<u64>(),
        suffix in proptest::option::of("[a-z0-9_-]{1,12}"),
        kind in 0usize..4,
    ) {
        let endpoint = EndpointPath::new(namespace, component, endpoint).unwrap();
        let event_key = EventRecordKey { scope: endpoint.clone(), topic, publisher_id: id };
        let key = match kind {
            0 => DiscoveryKey::Instance { endpoint, instance_id: id },
            1 => DiscoveryKey::Model(CardInstanceId { endpoint, instance_id: id, model_suffix: suffix }),
            2 => DiscoveryKey::EventChannel(event_key),
            _ => DiscoveryKey::EventSource(event_key),
        };
        prop_assert_eq!(DiscoveryKey::parse_key_path(&key.key_path()), Ok(key.clone()));
        prop_assert_eq!(DiscoveryKey::parse_file_path(&key.file_path()), Ok(key));
    }

    #[test]
    fn msgpack_walker_measures_exactly_one_value(
        value in json_value(),
        extra in vec(any::<u8>(), 0..8),
    ) {
        let encoded = rmp_serde::to_vec_named(&value).unwrap();
        prop_assert_eq!(msgpack_value_len(&encoded), Some(encoded.len()));
        let followed = [encoded.clone(), extra].concat();
        prop_assert_eq!(msgpack_value_len(&followed), Some(encoded.len()));
        prop_assert_eq!(msgpack_value_len(&encoded[..encoded.len() - 1]), None);
    }

    #[test]
    fn encoded_kv_events_decode_to_the_same_events(
        events in vec(router_event(), 0..8),
        publisher_id in any::<u64>(),
        sequence in any::<u64>(),
        published_at_ms in any::<u64>(),
    ) {
        let payload = encode_kv_events_payload(&events).unwrap();
        prop_assert_eq!(decode_kv_events_payload(&payload), Ok(events.clone()));
        let envelope = EventEnvelope { publisher_id, sequence, published_at_ms, topic: KV_EVENTS_TOPIC, payload: &payload };
        let frame = encode_zmq_event_frame(&encode_event_envelope(&envelope).unwrap()).unwrap();
        let publisher = publisher_id.to_be_bytes();
        let sequence_bytes = sequence.to_be_bytes();
        let frames: [&[u8]; 4] = [KV_EVENTS_TOPIC.as_bytes(), &publisher, &sequence_bytes, &frame];
        prop_assert_eq!(decode_zmq_event_message(&frames), Ok(envelope));
    }

    #[test]
    fn encoded_load_reports_decode_to_the_same_observation(
        worker_id in any::<u64>(),
        dp_rank in any::<u32>(),
        counts in (proptest::option::of(any::<u64>()), proptest::option::of(any::<u64>()), proptest::option::of(any::<u64>())),
    ) {
        let observation = LoadObservation {
            source: crate::model::kv_events::SourceKey { worker_id, dp_rank },
            kv_used_blocks: counts.0,
            active_decode_blocks: counts.1,
            active_prefill_tokens: counts.2,
        };
        prop_assert_eq!(decode_active_load(&encode_active_load(&observation).unwrap()), Ok(observation));
    }
}

#[test]
fn longest_segments_fully_escaped_still_round_trip() {
    use crate::inputs::limits::SEGMENT_BYTES_MAX;
    // 'é' is two UTF-8 bytes, each escaped as `%XX`: the worst case of every encoding.
    let longest = "é".repeat(SEGMENT_BYTES_MAX / 2);
    let endpoint = EndpointPath::new(longest.clone(), longest.clone(), longest.clone()).unwrap();
    let subject = event_subject(&endpoint, &longest);
    assert_eq!(
        parse_event_subject(&subject),
        Ok(EventSubject { endpoint: endpoint.clone(), topic: longest.clone() })
    );
    let key = DiscoveryKey::EventSource(EventRecordKey {
        scope: endpoint,
        topic: longest,
        publisher_id: u64::MAX,
    });
    assert_eq!(DiscoveryKey::parse_key_path(&key.key_path()), Ok(key.clone()));
    assert_eq!(DiscoveryKey::parse_file_path(&key.file_path()), Ok(key));
}
