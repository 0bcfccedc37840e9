//! The event plane (dc-inputs §2.1–2.2, §6; dynamo-live §9.2; dynamo-planes-wire §B): subjects,
//! the MessagePack envelope, and its two payloads the relay consumes.
//!
//! - Subjects are `namespace.{ns}.component.{c}.endpoint.{e}.{topic}`, every segment
//!   percent-encoded with only `[A-Za-z0-9_-]` literal, so `.` separates segments unambiguously.
//!   The topic is escaped by the same rule (both real topics, `kv-events` and `kv_metrics`, are
//!   literal under it).
//! - The envelope is a map `{publisher_id, sequence, published_at (unix ms), topic, payload
//!   (bin)}`; NATS carries it as the message body, ZMQ as the fourth frame behind a 5-byte header
//!   (version `0x01`, u32 big-endian length), after topic, publisher and sequence frames.
//! - A `kv-events` payload is a list of `RouterEvent` maps; a `kv_metrics` payload is one
//!   `ActiveLoad` map.
//!
//! Decoding takes maps by field name in any order, ignores unknown fields (`mm_extra_info`,
//! `state_source`, `session_id`, ...), accepts any integer width and `nil` for every optional
//! field, and rejects trailing bytes. `kv-events` payloads must use maps with named fields, which
//! is what every Dynamo transport writes: the counting pass ([`router_events`]) rejects positional (array)
//! structs.
//!
//! Limits before allocation: the envelope is size-checked before parsing and borrows its topic
//! and payload from the input. A `kv-events` payload is read twice ([`router_events`]): a first
//! pass counts events and blocks from the MessagePack headers, and only when every count is
//! within its limit does the second pass build the events.

use serde::Deserialize;

use super::discovery_record::{KV_EVENTS_TOPIC, KV_METRICS_TOPIC};
use super::errors::{InputError, echo};
use super::facts::{KvEventBatch, LoadObservation};
use super::limits::{EVENT_ENVELOPE_BYTES_MAX, EVENT_SUBJECT_BYTES_MAX};
use super::router_events;
use super::wire::{
    MsgpackCursor, check_segment, check_size, endpoint_path, msgpack, msgpack_value_len,
    percent_decode, percent_encode, subject_literal,
};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::{RouterEvent, SourceKey};

/// Version byte of a ZMQ event frame.
pub const ZMQ_EVENT_FRAME_VERSION: u8 = 0x01;
/// Length of a ZMQ event frame's header: version byte and u32 big-endian envelope length.
pub const ZMQ_EVENT_FRAME_HEADER_BYTES: usize = 5;

/// One event-plane message, with its topic and payload borrowed from the input.
///
/// Read by [`decode_event_envelope`] with the MessagePack cursor; serde's derived reader is the
/// reference its tests hold it against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize))]
pub struct EventEnvelope<'a> {
    /// The publishing incarnation.
    pub publisher_id: u64,
    /// Per-publisher message counter from 0.
    pub sequence: u64,
    /// Publisher wall clock, unix milliseconds.
    #[cfg_attr(test, serde(rename = "published_at"))]
    pub published_at_ms: u64,
    /// The topic, e.g. `kv-events`.
    pub topic: &'a str,
    /// The payload, itself MessagePack.
    #[cfg_attr(test, serde(with = "serde_bytes"))]
    pub payload: &'a [u8],
}

/// An endpoint-scoped event subject, parsed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventSubject {
    /// The endpoint the events are scoped to.
    pub endpoint: EndpointPath,
    /// The topic.
    pub topic: String,
}

/// `namespace.{ns}.component.{c}.endpoint.{e}`: the subject prefix of an endpoint's events.
#[must_use]
pub fn event_subject_prefix(endpoint: &EndpointPath) -> String {
    format!(
        "namespace.{}.component.{}.endpoint.{}",
        percent_encode(endpoint.namespace(), subject_literal),
        percent_encode(endpoint.component(), subject_literal),
        percent_encode(endpoint.endpoint(), subject_literal),
    )
}

/// `namespace.{ns}.component.{c}.endpoint.{e}.{topic}`: the subject of one topic of an endpoint.
#[must_use]
pub fn event_subject(endpoint: &EndpointPath, topic: &str) -> String {
    format!("{}.{}", event_subject_prefix(endpoint), percent_encode(topic, subject_literal))
}

/// Parse an endpoint-scoped subject. `%XX` escapes are accepted in either hex case; any other
/// character outside `[A-Za-z0-9_-]` is rejected, as the publisher would have escaped it.
pub fn parse_event_subject(subject: &str) -> Result<EventSubject, InputError> {
    let malformed = |reason| InputError::MalformedSubject { subject: echo(subject), reason };
    if subject.len() > EVENT_SUBJECT_BYTES_MAX {
        return Err(malformed("longer than the subject limit"));
    }
    let mut parts = subject.split('.');
    let mut next = || parts.next();
    let shape = [next(), next(), next(), next(), next(), next(), next(), next()];
    let [
        Some("namespace"),
        Some(namespace),
        Some("component"),
        Some(component),
        Some("endpoint"),
        Some(endpoint),
        Some(topic),
        None,
    ] = shape
    else {
        return Err(malformed("expected namespace.{ns}.component.{c}.endpoint.{e}.{topic}"));
    };
    let decode = |segment: &str| {
        if segment.is_empty() {
            return Err(malformed("empty segment"));
        }
        if !segment.bytes().all(|byte| byte == b'%' || subject_literal(byte)) {
            return Err(malformed("unescaped character outside [A-Za-z0-9_-]"));
        }
        percent_decode(segment).map_err(|error| malformed(error.reason()))
    };
    let endpoint =
        endpoint_path(decode(namespace)?, decode(component)?, decode(endpoint)?, "subject")?;
    Ok(EventSubject { endpoint, topic: decode(topic)? })
}

/// Decode an envelope (a NATS message body, or a ZMQ event frame without its header).
///
/// Rejects input over [`EVENT_ENVELOPE_BYTES_MAX`] before parsing.
pub fn decode_event_envelope(bytes: &[u8]) -> Result<EventEnvelope<'_>, InputError> {
    check_size(bytes.len(), EVENT_ENVELOPE_BYTES_MAX, ENVELOPE)?;
    let length = msgpack_value_len(bytes)
        .ok_or_else(|| envelope_error("truncated, or a reserved marker".into()))?;
    if length < bytes.len() {
        return Err(InputError::TrailingBytes { what: ENVELOPE, count: bytes.len() - length });
    }
    let mut cursor = MsgpackCursor::new(bytes);
    let envelope = if let Some(fields) = cursor.array_len() {
        // serde's derived reader also took the five fields in order, as a list.
        if fields != 5 {
            return Err(envelope_error("expected an envelope of 5 fields".into()));
        }
        EventEnvelope {
            publisher_id: envelope_unsigned(&mut cursor, "publisher_id")?,
            sequence: envelope_unsigned(&mut cursor, "sequence")?,
            published_at_ms: envelope_unsigned(&mut cursor, "published_at")?,
            topic: envelope_topic(&mut cursor)?,
            payload: envelope_payload(&mut cursor)?,
        }
    } else {
        read_envelope_map(&mut cursor)?
    };
    check_segment(envelope.topic, "envelope topic")?;
    Ok(envelope)
}

/// What envelope errors are reported as.
const ENVELOPE: &str = "event envelope";

fn envelope_error(detail: String) -> InputError {
    InputError::MessagePack { what: ENVELOPE, detail }
}

/// The envelope's fields by name, in any order, unknown ones skipped, each at most once (a
/// repeated field is refused before its value is read). Keys must be strings or UTF-8 `bin`;
/// serde's reader also took field indices, which no writer of envelopes uses.
fn read_envelope_map<'a>(cursor: &mut MsgpackCursor<'a>) -> Result<EventEnvelope<'a>, InputError> {
    let entries =
        cursor.map_len().ok_or_else(|| envelope_error("expected an envelope map".into()))?;
    let (mut publisher_id, mut sequence, mut published_at, mut topic, mut payload) =
        (None, None, None, None, None);
    for _ in 0..entries {
        // serde's reader also took a key as UTF-8 `bin`.
        let key = cursor
            .str()
            .or_else(|| cursor.bin())
            .ok_or_else(|| envelope_error("expected a field name".into()))?;
        let taken = match key {
            b"publisher_id" => publisher_id.is_some(),
            b"sequence" => sequence.is_some(),
            b"published_at" => published_at.is_some(),
            b"topic" => topic.is_some(),
            b"payload" => payload.is_some(),
            _ => false,
        };
        if taken {
            let name = String::from_utf8_lossy(key);
            return Err(envelope_error(format!("duplicate field `{name}`")));
        }
        match key {
            b"publisher_id" => publisher_id = Some(envelope_unsigned(cursor, "publisher_id")?),
            b"sequence" => sequence = Some(envelope_unsigned(cursor, "sequence")?),
            b"published_at" => published_at = Some(envelope_unsigned(cursor, "published_at")?),
            b"topic" => topic = Some(envelope_topic(cursor)?),
            b"payload" => payload = Some(envelope_payload(cursor)?),
            _ => cursor.skip().ok_or_else(|| envelope_error("expected a complete value".into()))?,
        }
    }
    let missing = |name: &str| envelope_error(format!("missing field `{name}`"));
    Ok(EventEnvelope {
        publisher_id: publisher_id.ok_or_else(|| missing("publisher_id"))?,
        sequence: sequence.ok_or_else(|| missing("sequence"))?,
        published_at_ms: published_at.ok_or_else(|| missing("published_at"))?,
        topic: topic.ok_or_else(|| missing("topic"))?,
        payload: payload.ok_or_else(|| missing("payload"))?,
    })
}

fn envelope_unsigned(cursor: &mut MsgpackCursor<'_>, name: &str) -> Result<u64, InputError> {
    match cursor.int() {
        Some((value, false)) => Ok(value),
        _ => Err(envelope_error(format!("`{name}`: expected an unsigned integer"))),
    }
}

/// The topic: a UTF-8 string (serde's reader also took it as UTF-8 bytes).
fn envelope_topic<'a>(cursor: &mut MsgpackCursor<'a>) -> Result<&'a str, InputError> {
    let bytes = cursor.str().or_else(|| cursor.bin());
    bytes
        .and_then(|bytes| std::str::from_utf8(bytes).ok())
        .ok_or_else(|| envelope_error("`topic`: expected a UTF-8 string".into()))
}

/// The payload: binary (serde's reader also took a string's bytes).
fn envelope_payload<'a>(cursor: &mut MsgpackCursor<'a>) -> Result<&'a [u8], InputError> {
    let bytes = cursor.bin().or_else(|| cursor.str());
    bytes.ok_or_else(|| envelope_error("`payload`: expected bytes".into()))
}

/// The envelope inside a ZMQ event frame: check the version byte and the length header.
pub fn zmq_event_frame_envelope(frame: &[u8]) -> Result<&[u8], InputError> {
    let malformed = |reason| InputError::MalformedEventFrame { reason };
    let (header, envelope) = frame
        .split_at_checked(ZMQ_EVENT_FRAME_HEADER_BYTES)
        .ok_or_else(|| malformed("event frame shorter than its 5-byte header"))?;
    let [version, length @ ..] = header else {
        return Err(malformed("event frame shorter than its 5-byte header"));
    };
    if *version != ZMQ_EVENT_FRAME_VERSION {
        return Err(malformed("event frame version is not 1"));
    }
    let declared = u32::from_be_bytes([length[0], length[1], length[2], length[3]]);
    if usize::try_from(declared).ok() != Some(envelope.len()) {
        return Err(malformed("event frame length disagrees with its header"));
    }
    Ok(envelope)
}

/// Decode one ZMQ event message: four frames `[topic, publisher_id (u64 BE), sequence (u64 BE),
/// event frame]`, whose routing frames must agree with the envelope.
pub fn decode_zmq_event_message<'a>(frames: &[&'a [u8]]) -> Result<EventEnvelope<'a>, InputError> {
    let malformed = |reason| InputError::MalformedEventFrame { reason };
    let [topic, publisher, sequence, event] = frames else {
        return Err(malformed("expected 4 frames"));
    };
    let publisher: [u8; 8] =
        (*publisher).try_into().map_err(|_| malformed("publisher frame is not 8 bytes"))?;
    let sequence: [u8; 8] =
        (*sequence).try_into().map_err(|_| malformed("sequence frame is not 8 bytes"))?;
    let envelope = decode_event_envelope(zmq_event_frame_envelope(event)?)?;
    if envelope.topic.as_bytes() != *topic {
        return Err(InputError::FrameMismatch { field: "topic" });
    }
    if envelope.publisher_id != u64::from_be_bytes(publisher) {
        return Err(InputError::FrameMismatch { field: "publisher_id" });
    }
    if envelope.sequence != u64::from_be_bytes(sequence) {
        return Err(InputError::FrameMismatch { field: "sequence" });
    }
    Ok(envelope)
}

/// Decode a `kv-events` envelope published on `endpoint` (taken from the subject or the event
/// channel) into a batch.
pub fn decode_kv_event_batch(
    endpoint: EndpointPath,
    envelope: &EventEnvelope<'_>,
) -> Result<KvEventBatch, InputError> {
    expect_topic(envelope, KV_EVENTS_TOPIC)?;
    Ok(KvEventBatch {
        endpoint,
        publisher_id: envelope.publisher_id,
        sequence: envelope.sequence,
        published_at_ms: envelope.published_at_ms,
        events: decode_kv_events_payload(envelope.payload)?,
    })
}

/// Decode a `kv-events` message body (envelope and payload) published on `endpoint`.
pub fn decode_kv_events_message(
    endpoint: EndpointPath,
    bytes: &[u8],
) -> Result<KvEventBatch, InputError> {
    decode_kv_event_batch(endpoint, &decode_event_envelope(bytes)?)
}

/// Decode a `kv-events` payload: a list of `RouterEvent` maps ([`router_events`]).
pub fn decode_kv_events_payload(payload: &[u8]) -> Result<Vec<RouterEvent>, InputError> {
    check_size(payload.len(), EVENT_ENVELOPE_BYTES_MAX, "kv-events payload")?;
    let length = router_events::check_shape(payload)?;
    if length < payload.len() {
        return Err(InputError::TrailingBytes {
            what: "kv-events payload",
            count: payload.len() - length,
        });
    }
    router_events::read_events(payload)
}

/// Decode a `kv_metrics` envelope's `ActiveLoad` payload.
pub fn decode_load_observation(
    envelope: &EventEnvelope<'_>,
) -> Result<LoadObservation, InputError> {
    expect_topic(envelope, KV_METRICS_TOPIC)?;
    decode_active_load(envelope.payload)
}

/// Decode a `kv_metrics` message body (envelope and payload).
pub fn decode_kv_metrics_message(bytes: &[u8]) -> Result<LoadObservation, InputError> {
    decode_load_observation(&decode_event_envelope(bytes)?)
}

/// Decode an `ActiveLoad` payload. Reports without `kv_used_blocks` (from routers) decode too;
/// the load projection treats them as advisory.
pub fn decode_active_load(payload: &[u8]) -> Result<LoadObservation, InputError> {
    check_size(payload.len(), EVENT_ENVELOPE_BYTES_MAX, "kv_metrics payload")?;
    let wire: WireActiveLoad = msgpack(payload, "kv_metrics payload")?;
    Ok(LoadObservation {
        source: SourceKey { worker_id: wire.worker_id, dp_rank: wire.dp_rank.unwrap_or(0) },
        kv_used_blocks: wire.kv_used_blocks,
        active_decode_blocks: wire.active_decode_blocks,
        active_prefill_tokens: wire.active_prefill_tokens,
    })
}

fn expect_topic(envelope: &EventEnvelope<'_>, expected: &'static str) -> Result<(), InputError> {
    if envelope.topic != expected {
        return Err(InputError::UnexpectedTopic { expected, found: echo(envelope.topic) });
    }
    Ok(())
}

#[derive(Deserialize)]
struct WireActiveLoad {
    worker_id: u64,
    #[serde(default)]
    dp_rank: Option<u32>,
    #[serde(default)]
    active_decode_blocks: Option<u64>,
    #[serde(default)]
    active_prefill_tokens: Option<u64>,
    #[serde(default)]
    kv_used_blocks: Option<u64>,
}

#[cfg(test)]
mod tests {
    use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
    use crate::model::kv_events::{
        KvCacheEvent, KvCacheEventData, RemoveData, ResidencyDomain, StorageTier, StoreData,
        StoredBlock,
    };
    use serde::Serialize;
    use serde_json::json;

    use super::*;
    use crate::inputs::limits::{
        BLOCKS_PER_EVENT_MAX, BLOCKS_PER_MESSAGE_MAX, EVENTS_PER_MESSAGE_MAX, SEGMENT_BYTES_MAX,
    };
    use crate::inputs::test_fixtures::{
        BACKEND_INSTANCE, BACKEND_PUBLISHER, CAPTURED_LOAD_PAYLOAD, CAPTURED_PAYLOAD,
        captured_envelope,
    };
    use crate::model::hashing::{XXH3_SEED, local_block_hash};

    fn zmq_frame(envelope: &[u8]) -> Vec<u8> {
        let length = u32::try_from(envelope.len()).unwrap().to_be_bytes();
        [&[ZMQ_EVENT_FRAME_VERSION][..], &length, envelope].concat()
    }

    fn backend() -> EndpointPath {
        EndpointPath::new("dynamo", "backend", "generate").unwrap()
    }

    /// An envelope as Dynamo writes it: named fields, binary payload.
    #[derive(Serialize)]
    struct TestEnvelope<'a> {
        publisher_id: u64,
        sequence: u64,
        published_at: u64,
        topic: &'a str,
        #[serde(with = "serde_bytes")]
        payload: &'a [u8],
    }

    fn named(value: &impl Serialize) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    fn envelope_around(topic: &str, payload: &[u8]) -> Vec<u8> {
        named(&TestEnvelope {
            publisher_id: BACKEND_PUBLISHER,
            sequence: 7,
            published_at: 1_796_040_159_861,
            topic,
            payload,
        })
    }

    fn stored_event(blocks: serde_json::Value) -> serde_json::Value {
        json!({"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"blocks": blocks}}}})
    }

    fn decode_events(events: &serde_json::Value) -> Result<Vec<RouterEvent>, InputError> {
        decode_kv_events_payload(&named(events))
    }

    #[test]
    fn captured_zmq_kv_events_message_decodes_to_its_fields() {
        let payload = CAPTURED_PAYLOAD.concat();
        assert_eq!(payload.len(), 0xc7);
        let envelope_bytes = captured_envelope();
        assert_eq!(envelope_bytes.len(), 0x118);
        let frame = zmq_frame(&envelope_bytes);
        assert_eq!(frame[..5], [0x01, 0x00, 0x00, 0x01, 0x18]);
        let publisher = BACKEND_PUBLISHER.to_be_bytes();
        let sequence = 0u64.to_be_bytes();
        let frames: [&[u8]; 4] = [b"kv-events", &publisher, &sequence, &frame];

        let envelope = decode_zmq_event_message(&frames).unwrap();
        assert_eq!(
            envelope,
            EventEnvelope {
                publisher_id: BACKEND_PUBLISHER,
                sequence: 0,
                published_at_ms: 1_796_040_159_861,
                topic: "kv-events",
                payload: &payload,
            }
        );
        let batch = decode_kv_event_batch(backend(), &envelope).unwrap();
        assert_eq!(batch.endpoint, backend());
        assert_eq!(batch.publisher_id, BACKEND_PUBLISHER);
        assert_eq!(batch.sequence, 0);
        assert_eq!(batch.published_at_ms, 1_796_040_159_861);
        assert_eq!(
            batch.events,
            vec![RouterEvent {
                worker_id: BACKEND_INSTANCE,
                storage_tier: StorageTier::Device,
                residency_domain: Some(ResidencyDomain::Worker),
                event: KvCacheEvent {
                    event_id: 1,
                    dp_rank: 0,
                    data: KvCacheEventData::Stored(StoreData {
                        parent_hash: None,
                        start_position: None,
                        blocks: vec![StoredBlock {
                            block_hash: ExternalBlockHash(0x48db_ac25_2265_b1f5),
                            tokens_hash: LocalBlockHash(0xea06_fc71_a5ee_6e88),
                        }],
                    }),
                },
            }]
        );
    }

    #[test]
    fn captured_envelope_is_also_a_nats_message_body() {
        let batch = decode_kv_events_message(backend(), &captured_envelope()).unwrap();
        assert_eq!(batch.events.len(), 1);
        assert_eq!(batch.events[0].source(), SourceKey { worker_id: BACKEND_INSTANCE, dp_rank: 0 });
    }

    #[test]
    fn captured_kv_metrics_payload_decodes_to_a_load_observation() {
        let payload = CAPTURED_LOAD_PAYLOAD.concat();
        assert_eq!(payload.len(), 90);
        let envelope = envelope_around("kv_metrics", &payload);
        // Same envelope size as the captured 172-byte `kv_metrics` event frame body.
        assert_eq!(envelope.len(), 0xac);
        assert_eq!(
            decode_kv_metrics_message(&envelope),
            Ok(LoadObservation {
                source: SourceKey { worker_id: BACKEND_INSTANCE, dp_rank: 0 },
                kv_used_blocks: Some(3),
                active_decode_blocks: Some(0),
                active_prefill_tokens: None,
            })
        );
    }

    #[test]
    fn router_style_load_reports_decode_without_kv_used_blocks() {
        let payload = named(&json!({"worker_id": 5, "active_decode_blocks": 12,
                                    "active_prefill_tokens": 300, "scheduler_load_scope": "local"}));
        assert_eq!(
            decode_active_load(&payload),
            Ok(LoadObservation {
                source: SourceKey { worker_id: 5, dp_rank: 0 },
                kv_used_blocks: None,
                active_decode_blocks: Some(12),
                active_prefill_tokens: Some(300),
            })
        );
    }

    #[test]
    fn tokens_hash_of_the_live_sample_block_matches_the_hashing_module() {
        let tokens: Vec<u32> = (33..=48).collect();
        let hash = local_block_hash(&tokens, &[], XXH3_SEED);
        assert_eq!(hash, LocalBlockHash(12_129_935_312_930_971_799));
        let events = decode_events(&json!([stored_event(
            json!([{"block_hash": 1, "tokens_hash": 12_129_935_312_930_971_799u64}])
        )]))
        .unwrap();
        let KvCacheEventData::Stored(stored) = &events[0].event.data else { panic!("not stored") };
        assert_eq!(stored.blocks[0].tokens_hash, hash);
    }

    #[test]
    fn stored_removed_and_cleared_events_decode_from_named_maps() {
        let events = decode_events(&json!([
            {"worker_id": 9, "storage_tier": "device", "residency_domain": "worker",
             "event": {"event_id": 10, "dp_rank": 3, "data": {"stored": {
                "parent_hash": 77, "start_position": 32,
                "blocks": [{"block_hash": 78, "tokens_hash": 5,
                            "mm_extra_info": {"mm_objects": [{"mm_hash": 1, "offsets": [[0, 4]]}]}},
                           {"block_hash": 79, "tokens_hash": 6}]}}}},
            {"worker_id": 9, "event": {"event_id": 11, "dp_rank": 3,
             "data": {"removed": {"block_hashes": [78, 79]}}}},
            {"worker_id": 9, "event": {"event_id": 12, "dp_rank": 3, "data": "cleared"}},
            {"worker_id": 9, "event": {"event_id": 13, "dp_rank": 3, "data": {"cleared": null}}},
        ]))
        .unwrap();
        assert_eq!(
            events[0].event,
            KvCacheEvent {
                event_id: 10,
                dp_rank: 3,
                data: KvCacheEventData::Stored(StoreData {
                    parent_hash: Some(ExternalBlockHash(77)),
                    start_position: Some(32),
                    blocks: vec![
                        StoredBlock {
                            block_hash: ExternalBlockHash(78),
                            tokens_hash: LocalBlockHash(5)
                        },
                        StoredBlock {
                            block_hash: ExternalBlockHash(79),
                            tokens_hash: LocalBlockHash(6)
                        },
                    ],
                }),
            }
        );
        assert_eq!(
            events[1].event.data,
            KvCacheEventData::Removed(RemoveData {
                block_hashes: vec![ExternalBlockHash(78), ExternalBlockHash(79)]
            })
        );
        assert_eq!(events[2].event.data, KvCacheEventData::Cleared);
        assert_eq!(events[3].event.data, KvCacheEventData::Cleared);
        assert_eq!(events[3].event.event_id, 13);
    }

    #[test]
    fn legacy_events_default_to_device_tier_rank_zero_and_no_domain() {
        let events = decode_events(&json!([
            {"worker_id": 4, "event": {"event_id": 1, "data": "cleared"}},
            {"worker_id": 4, "storage_tier": null, "residency_domain": null,
             "event": {"event_id": 2, "dp_rank": null, "data": "cleared"}},
        ]))
        .unwrap();
        for event in &events {
            assert_eq!(event.storage_tier, StorageTier::Device);
            assert_eq!(event.residency_domain, None);
            assert_eq!(event.event.dp_rank, 0);
        }
    }

    #[test]
    fn storage_tiers_and_residency_domains_map_to_their_variants() {
        for (tier, expected) in [
            ("device", StorageTier::Device),
            ("host_pinned", StorageTier::HostPinned),
            ("disk", StorageTier::Disk),
            ("external", StorageTier::External),
        ] {
            let events = decode_events(&json!([{"worker_id": 1, "storage_tier": tier,
                "event": {"event_id": 1, "data": "cleared"}}]))
            .unwrap();
            assert_eq!(events[0].storage_tier, expected);
        }
        for (domain, expected) in [
            ("worker", ResidencyDomain::Worker),
            ("cache_owner", ResidencyDomain::CacheOwner),
            ("gpu_pool", ResidencyDomain::Unsupported("gpu_pool".into())),
        ] {
            let events = decode_events(&json!([{"worker_id": 1, "residency_domain": domain,
                "event": {"event_id": 1, "data": "cleared"}}]))
            .unwrap();
            assert_eq!(events[0].residency_domain, Some(expected));
        }
    }

    #[test]
    fn full_range_and_signed_hashes_are_kept_bitwise() {
        let events = decode_events(&json!([
            {"worker_id": u64::MAX, "event": {"event_id": u64::MAX, "data": {"stored": {
                "parent_hash": -2, "blocks": [{"block_hash": -1, "tokens_hash": u64::MAX}]}}}},
            {"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {
                "block_hashes": [i64::MIN, 1u64 << 63]}}}},
        ]))
        .unwrap();
        assert_eq!(events[0].worker_id, u64::MAX);
        assert_eq!(events[0].event.event_id, u64::MAX);
        let KvCacheEventData::Stored(stored) = &events[0].event.data else { panic!("not stored") };
        assert_eq!(stored.parent_hash, Some(ExternalBlockHash(u64::MAX - 1)));
        assert_eq!(stored.blocks[0].block_hash, ExternalBlockHash(u64::MAX));
        assert_eq!(stored.blocks[0].tokens_hash, LocalBlockHash(u64::MAX));
        assert_eq!(
            events[1].event.data,
            KvCacheEventData::Removed(RemoveData {
                block_hashes: vec![ExternalBlockHash(1 << 63), ExternalBlockHash(1 << 63)]
            })
        );
        // Ids other than hashes stay unsigned.
        let negative_worker =
            json!([{"worker_id": -1, "event": {"event_id": 1, "data": "cleared"}}]);
        assert!(matches!(decode_events(&negative_worker), Err(InputError::MessagePack { .. })));
    }

    /// One unsigned field as some writer might encode it: the smallest form, or a wider or signed
    /// marker holding the same value.
    fn encoded_unsigned(value: u64, form: u32) -> Vec<u8> {
        match form % 3 {
            0 => rmp_serde::to_vec(&value).unwrap(),
            1 => [&[0xcf][..], &value.to_be_bytes()].concat(),
            _ => [&[0xd3][..], &value.to_be_bytes()].concat(),
        }
    }

    fn encoded_text(text: &[u8], as_bin: bool) -> Vec<u8> {
        let header = if as_bin { [0xc4, text.len() as u8] } else { [0xd9, text.len() as u8] };
        [&header[..], text].concat()
    }

    /// Random envelopes (fields in any order, unknown fields, a field left out or given twice, the
    /// list form, every integer form) and byte corruptions of them: the cursor reader accepts
    /// exactly what serde's derived reader accepts, with the same fields.
    #[test]
    fn the_envelope_reader_agrees_with_serdes_derived_reader() {
        use rand_core::Rng;
        let mut rng = crate::rng::rng_from_seed(44);
        let (mut accepted, mut rejected) = (0, 0);
        for round in 0..6_000 {
            let mut fields: Vec<(&[u8], Vec<u8>)> = vec![
                (
                    b"publisher_id",
                    encoded_unsigned(rng.next_u64() >> (rng.next_u32() % 64), rng.next_u32()),
                ),
                (b"sequence", encoded_unsigned(u64::from(rng.next_u32() % 300), rng.next_u32())),
                (b"published_at", encoded_unsigned(rng.next_u64(), rng.next_u32())),
                (b"topic", encoded_text(b"kv-events", rng.next_u32().is_multiple_of(5))),
                (b"payload", encoded_text(&[0x90], !rng.next_u32().is_multiple_of(5))),
            ];
            let list = rng.next_u32().is_multiple_of(6);
            if !list {
                for index in (1..fields.len()).rev() {
                    fields.swap(index, rng.next_u32() as usize % (index + 1));
                }
                match rng.next_u32() % 8 {
                    0 => {
                        fields.pop();
                    }
                    1 => fields.push((b"sequence", vec![0x01])),
                    2 | 3 => fields.push((b"extra", vec![0x92, 0xc0, 0xa1, b'x'])),
                    _ => {}
                }
            }
            let mut bytes = vec![if list { 0x90 } else { 0x80 } | fields.len() as u8];
            for (key, value) in &fields {
                if !list {
                    bytes.extend(encoded_text(key, false));
                }
                bytes.extend(value);
            }
            if round % 2 == 1 {
                let at = rng.next_u32() as usize % bytes.len();
                bytes[at] = rng.next_u32() as u8;
            }
            let ours = decode_event_envelope(&bytes);
            let theirs =
                msgpack::<EventEnvelope<'_>>(&bytes, "event envelope").and_then(|envelope| {
                    check_segment(envelope.topic, "envelope topic").map(|()| envelope)
                });
            match (&ours, &theirs) {
                (Ok(ours), Ok(theirs)) => {
                    assert_eq!(ours, theirs, "round {round}: {bytes:02x?}");
                    accepted += 1;
                }
                (Err(_), Err(_)) => rejected += 1,
                _ => panic!("round {round}: ours {ours:?}, serde's {theirs:?}: {bytes:02x?}"),
            }
        }
        assert!(accepted > 1_000 && rejected > 1_000, "{accepted} accepted, {rejected} rejected");
    }

    /// A repeated envelope field is refused before its second value is read; keys may be UTF-8
    /// `bin`, as serde's reader took them.
    #[test]
    fn envelope_keys_may_be_binary_and_a_repeated_one_is_refused_first() {
        let field =
            |key: &[u8], bin: bool, value: &[u8]| [encoded_text(key, bin), value.to_vec()].concat();
        let fields = [
            field(b"publisher_id", true, &[0x02]),
            field(b"sequence", false, &[0x03]),
            field(b"published_at", true, &[0x04]),
            field(b"topic", false, &encoded_text(b"kv-events", false)),
            field(b"payload", true, &encoded_text(&[0x90], true)),
        ];
        let envelope = [vec![0x85], fields.concat()].concat();
        let decoded = decode_event_envelope(&envelope).unwrap();
        assert_eq!(
            (decoded.publisher_id, decoded.topic, decoded.payload),
            (2, "kv-events", &[0x90][..])
        );
        let repeated =
            [vec![0x86], fields.concat(), field(b"sequence", false, &encoded_text(b"x", false))]
                .concat();
        let Err(InputError::MessagePack { detail, .. }) = decode_event_envelope(&repeated) else {
            panic!("accepted a repeated field")
        };
        assert!(detail.contains("duplicate field `sequence`"), "{detail}");
    }

    #[test]
    fn envelope_fields_decode_by_name_in_any_order_with_unknown_keys() {
        let payload = named(&json!([]));
        #[derive(Serialize)]
        struct Shuffled<'a> {
            extra: &'a str,
            #[serde(with = "serde_bytes")]
            payload: &'a [u8],
            topic: &'a str,
            published_at: u64,
            sequence: u64,
            publisher_id: u64,
        }
        let bytes = named(&Shuffled {
            extra: "ignored",
            payload: &payload,
            topic: "kv-events",
            published_at: 3,
            sequence: (1 << 63) + 1,
            publisher_id: 2,
        });
        let batch = decode_kv_events_message(backend(), &bytes).unwrap();
        assert_eq!(
            (batch.publisher_id, batch.sequence, batch.published_at_ms),
            (2, (1 << 63) + 1, 3)
        );
        assert!(batch.events.is_empty());
    }

    #[test]
    fn messages_on_the_wrong_topic_are_rejected() {
        let load = envelope_around("kv_metrics", &CAPTURED_LOAD_PAYLOAD.concat());
        assert_eq!(
            decode_kv_events_message(backend(), &load),
            Err(InputError::UnexpectedTopic { expected: "kv-events", found: "kv_metrics".into() })
        );
        assert_eq!(
            decode_kv_metrics_message(&captured_envelope()),
            Err(InputError::UnexpectedTopic { expected: "kv_metrics", found: "kv-events".into() })
        );
    }

    #[test]
    fn unknown_storage_tiers_and_wide_start_positions_are_rejected() {
        let tier = json!([{"worker_id": 1, "storage_tier": "tape",
            "event": {"event_id": 1, "data": "cleared"}}]);
        assert_eq!(
            decode_events(&tier),
            Err(InputError::UnknownStorageTier { value: "tape".into() })
        );
        let position = json!([{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {
            "start_position": 1u64 << 32, "blocks": []}}}}]);
        assert_eq!(
            decode_events(&position),
            Err(InputError::InvalidField { field: "start_position", reason: "exceeds u32" })
        );
        let domain = json!([{"worker_id": 1, "residency_domain": "d".repeat(SEGMENT_BYTES_MAX + 1),
            "event": {"event_id": 1, "data": "cleared"}}]);
        assert!(matches!(
            decode_events(&domain),
            Err(InputError::TooLarge { what: "residency_domain", .. })
        ));
    }

    #[test]
    fn malformed_or_trailing_message_pack_is_rejected() {
        assert!(matches!(
            decode_event_envelope(&[0x85, 0xac]),
            Err(InputError::MessagePack { what: "event envelope", .. })
        ));
        assert!(matches!(decode_event_envelope(&[]), Err(InputError::MessagePack { .. })));
        let mut trailing = captured_envelope();
        trailing.extend_from_slice(&[0xc0, 0xc0]);
        assert_eq!(
            decode_event_envelope(&trailing),
            Err(InputError::TrailingBytes { what: "event envelope", count: 2 })
        );
        let unknown_variant =
            json!([{"worker_id": 1, "event": {"event_id": 1, "data": "evicted"}}]);
        assert!(matches!(decode_events(&unknown_variant), Err(InputError::MessagePack { .. })));
        let missing = json!([{"worker_id": 1, "event": {"data": "cleared"}}]);
        assert!(matches!(decode_events(&missing), Err(InputError::MessagePack { .. })));
        // Positional (array) structs are not a Dynamo wire form.
        let positional =
            rmp_serde::to_vec(&json!([[1, "device", "worker", [1, "cleared", 0]]])).unwrap();
        assert!(matches!(
            decode_kv_events_payload(&positional),
            Err(InputError::MessagePack { .. })
        ));
        let deep = [vec![0x91; 64], vec![0xc0]].concat();
        assert!(matches!(decode_kv_events_payload(&deep), Err(InputError::MessagePack { .. })));
    }

    #[test]
    fn oversized_envelopes_and_topics_are_rejected_before_decoding() {
        let oversized = vec![0u8; EVENT_ENVELOPE_BYTES_MAX + 1];
        assert_eq!(
            decode_event_envelope(&oversized),
            Err(InputError::TooLarge {
                what: "event envelope",
                bytes: EVENT_ENVELOPE_BYTES_MAX + 1,
                max: EVENT_ENVELOPE_BYTES_MAX
            })
        );
        let long_topic = "t".repeat(SEGMENT_BYTES_MAX + 1);
        assert!(matches!(
            decode_event_envelope(&envelope_around(&long_topic, &[])),
            Err(InputError::TooLarge { what: "envelope topic", .. })
        ));
    }

    /// A MessagePack array header declaring `count` entries (array32).
    fn array32(count: usize) -> Vec<u8> {
        [&[0xdd][..], &u32::try_from(count).unwrap().to_be_bytes()].concat()
    }

    /// One stored event whose `blocks` list holds `count` nil entries: enough for the counting
    /// pass, which never looks inside the entries.
    fn stored_with_nil_blocks(count: usize) -> Vec<u8> {
        let head: &[&[u8]] = &[
            b"\x82\xa9worker_id\x01\xa5event\x82\xa8event_id\x01",
            b"\xa4data\x81\xa6stored\x81\xa6blocks",
        ];
        [head.concat(), array32(count), vec![0xc0; count]].concat()
    }

    #[test]
    fn too_many_events_in_one_message_are_rejected_before_decoding_them() {
        let cleared = named(&json!({"worker_id": 1, "event": {"event_id": 1, "data": "cleared"}}));
        let mut payload = array32(EVENTS_PER_MESSAGE_MAX + 1);
        for _ in 0..=EVENTS_PER_MESSAGE_MAX {
            payload.extend_from_slice(&cleared);
        }
        assert_eq!(
            decode_kv_events_payload(&payload),
            Err(InputError::TooMany {
                what: "events in one message",
                count: EVENTS_PER_MESSAGE_MAX + 1,
                max: EVENTS_PER_MESSAGE_MAX
            })
        );
    }

    #[test]
    fn too_many_blocks_in_one_event_are_rejected_before_decoding_them() {
        let payload = [&[0x91][..], &stored_with_nil_blocks(BLOCKS_PER_EVENT_MAX + 1)].concat();
        assert_eq!(
            decode_kv_events_payload(&payload),
            Err(InputError::TooMany {
                what: "blocks in one event",
                count: BLOCKS_PER_EVENT_MAX + 1,
                max: BLOCKS_PER_EVENT_MAX
            })
        );
    }

    #[test]
    fn the_counting_pass_walks_wide_headers_and_skips_unknown_fields() {
        // 16 extra fields (a map16 record), a 40-byte key (str8), 20 blocks (array16).
        let mut event = serde_json::Map::new();
        for index in 0..16 {
            event.insert(format!("extra_{index}"), json!({"nested": [index, "x", {"y": null}]}));
        }
        event.insert("k".repeat(40), json!("long key"));
        event.insert("worker_id".into(), json!(4));
        let blocks: Vec<_> =
            (0..20).map(|index| json!({"block_hash": index, "tokens_hash": index + 100})).collect();
        event
            .insert("event".into(), json!({"data": {"stored": {"blocks": blocks}}, "event_id": 2}));
        let events = decode_events(&json!([event])).unwrap();
        let KvCacheEventData::Stored(stored) = &events[0].event.data else { panic!("not stored") };
        assert_eq!(stored.blocks.len(), 20);
        assert_eq!(stored.blocks[19].tokens_hash, LocalBlockHash(119));
        let mut trailing = named(&json!([event]));
        trailing.push(0xc0);
        assert_eq!(
            decode_kv_events_payload(&trailing),
            Err(InputError::TrailingBytes { what: "kv-events payload", count: 1 })
        );
        // A data map of two variants is neither form of an event.
        let two = json!([{"worker_id": 1, "event": {"event_id": 1,
            "data": {"removed": {"block_hashes": []}, "cleared": null}}}]);
        assert!(matches!(decode_events(&two), Err(InputError::MessagePack { .. })));
    }

    #[test]
    fn a_block_list_declared_beyond_the_limit_is_rejected_from_its_header() {
        // The header claims more blocks than allowed and no entry follows.
        let payload = [&[0x91][..], &stored_with_nil_blocks(0)[..]].concat();
        let header_only =
            [&payload[..payload.len() - 5], &array32(BLOCKS_PER_EVENT_MAX + 1)[..]].concat();
        assert_eq!(
            decode_kv_events_payload(&header_only),
            Err(InputError::TooMany {
                what: "blocks in one event",
                count: BLOCKS_PER_EVENT_MAX + 1,
                max: BLOCKS_PER_EVENT_MAX
            })
        );
    }

    #[test]
    fn too_many_blocks_in_one_message_are_rejected_before_decoding_them() {
        let event = stored_with_nil_blocks(BLOCKS_PER_EVENT_MAX);
        let count = BLOCKS_PER_MESSAGE_MAX / BLOCKS_PER_EVENT_MAX + 1;
        let payload = [vec![0x90 | u8::try_from(count).unwrap()], event.repeat(count)].concat();
        assert_eq!(
            decode_kv_events_payload(&payload),
            Err(InputError::TooMany {
                what: "blocks in one message",
                count: count * BLOCKS_PER_EVENT_MAX,
                max: BLOCKS_PER_MESSAGE_MAX
            })
        );
    }

    #[test]
    fn malformed_zmq_messages_are_rejected() {
        let frame = zmq_frame(&captured_envelope());
        let publisher = BACKEND_PUBLISHER.to_be_bytes();
        let sequence = 0u64.to_be_bytes();
        let malformed = |reason| Err(InputError::MalformedEventFrame { reason });
        let bad_frame = |reason| Err::<&[u8], _>(InputError::MalformedEventFrame { reason });
        assert_eq!(
            decode_zmq_event_message(&[b"kv-events", &publisher, &sequence]),
            malformed("expected 4 frames")
        );
        assert_eq!(
            decode_zmq_event_message(&[b"kv-events", &publisher[..7], &sequence, &frame]),
            malformed("publisher frame is not 8 bytes")
        );
        assert_eq!(
            decode_zmq_event_message(&[b"kv-events", &publisher, &[0; 9], &frame]),
            malformed("sequence frame is not 8 bytes")
        );
        assert_eq!(
            zmq_event_frame_envelope(&frame[..4]),
            bad_frame("event frame shorter than its 5-byte header")
        );
        let mut version_two = frame.clone();
        version_two[0] = 2;
        assert_eq!(
            zmq_event_frame_envelope(&version_two),
            bad_frame("event frame version is not 1")
        );
        assert_eq!(
            zmq_event_frame_envelope(&frame[..frame.len() - 1]),
            bad_frame("event frame length disagrees with its header")
        );
        let mismatch = |field| Err(InputError::FrameMismatch { field });
        assert_eq!(
            decode_zmq_event_message(&[b"kv_metrics", &publisher, &sequence, &frame]),
            mismatch("topic")
        );
        assert_eq!(
            decode_zmq_event_message(&[b"kv-events", &1u64.to_be_bytes(), &sequence, &frame]),
            mismatch("publisher_id")
        );
        assert_eq!(
            decode_zmq_event_message(&[b"kv-events", &publisher, &1u64.to_be_bytes(), &frame]),
            mismatch("sequence")
        );
    }

    #[test]
    fn subjects_escape_every_character_outside_the_literal_set() {
        assert_eq!(
            event_subject(&backend(), KV_EVENTS_TOPIC),
            "namespace.dynamo.component.backend.endpoint.generate.kv-events"
        );
        let dotted = EndpointPath::new("prod.eu", "back end", "gen_1-a").unwrap();
        let subject = event_subject(&dotted, KV_METRICS_TOPIC);
        assert_eq!(subject, "namespace.prod%2Eeu.component.back%20end.endpoint.gen_1-a.kv_metrics");
        assert_eq!(
            parse_event_subject(&subject),
            Ok(EventSubject { endpoint: dotted, topic: KV_METRICS_TOPIC.into() })
        );
        assert_eq!(
            parse_event_subject("namespace.prod%2eeu.component.b.endpoint.g.kv-events")
                .map(|parsed| parsed.endpoint.namespace().to_owned()),
            Ok("prod.eu".to_owned())
        );
    }

    #[test]
    fn subject_prefix_matches_the_nats_event_channel_sample() {
        assert_eq!(
            event_subject_prefix(&backend()),
            "namespace.dynamo.component.backend.endpoint.generate"
        );
    }

    #[test]
    fn malformed_subjects_are_rejected() {
        for (subject, reason) in [
            (
                "namespace.a.component.b.endpoint.c",
                "expected namespace.{ns}.component.{c}.endpoint.{e}.{topic}",
            ),
            (
                "namespace.a.component.b.endpoint.c.t.u",
                "expected namespace.{ns}.component.{c}.endpoint.{e}.{topic}",
            ),
            (
                "ns.a.component.b.endpoint.c.t",
                "expected namespace.{ns}.component.{c}.endpoint.{e}.{topic}",
            ),
            ("namespace..component.b.endpoint.c.t", "empty segment"),
            ("namespace.a.component.b.endpoint.c.", "empty segment"),
            ("namespace.a b.component.b.endpoint.c.t", "unescaped character outside [A-Za-z0-9_-]"),
            ("namespace.a.component.b.endpoint.c.t%4", "'%' not followed by two hex digits"),
            ("namespace.a.component.b.endpoint.c.%FF", "escaped bytes are not UTF-8"),
        ] {
            assert_eq!(
                parse_event_subject(subject),
                Err(InputError::MalformedSubject { subject: subject.into(), reason }),
                "{subject}"
            );
        }
        assert!(matches!(
            parse_event_subject("namespace.a.component.b%2Fc.endpoint.c.t"),
            Err(InputError::InvalidEndpoint { field: "subject", .. })
        ));
    }
}
