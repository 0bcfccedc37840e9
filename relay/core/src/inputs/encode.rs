//! Encoders of the event-plane wire formats: the inverse of the decoders in `event_plane`.
//!
//! Simulated publishers use these so that the simulation carries the very bytes a Dynamo 1.6.1
//! worker writes (named MessagePack fields, in the captured field order, `nil` written for absent
//! optional fields as Dynamo does); the production decoders then run unchanged on them. Each
//! encoder enforces the decoder's limits, so it never produces a message the decoder rejects.

use serde::Serialize;

use super::errors::InputError;
use super::event_plane::{EventEnvelope, ZMQ_EVENT_FRAME_HEADER_BYTES, ZMQ_EVENT_FRAME_VERSION};
use super::facts::LoadObservation;
use super::limits::{
    BLOCKS_PER_EVENT_MAX, BLOCKS_PER_MESSAGE_MAX, EVENT_ENVELOPE_BYTES_MAX, EVENTS_PER_MESSAGE_MAX,
    SEGMENT_BYTES_MAX,
};
use super::wire::{check_segment, check_size};
use crate::model::kv_events::{KvCacheEventData, ResidencyDomain, RouterEvent, StorageTier};

/// Encode an envelope (a NATS message body; the body of a ZMQ event frame).
pub fn encode_event_envelope(envelope: &EventEnvelope<'_>) -> Result<Vec<u8>, InputError> {
    check_segment(envelope.topic, "envelope topic")?;
    let bytes = named(
        &OutEnvelope {
            publisher_id: envelope.publisher_id,
            sequence: envelope.sequence,
            published_at: envelope.published_at_ms,
            topic: envelope.topic,
            payload: envelope.payload,
        },
        "event envelope",
    )?;
    check_size(bytes.len(), EVENT_ENVELOPE_BYTES_MAX, "event envelope")?;
    Ok(bytes)
}

/// Wrap an encoded envelope into a ZMQ event frame: version `0x01`, u32 big-endian length.
pub fn encode_zmq_event_frame(envelope: &[u8]) -> Result<Vec<u8>, InputError> {
    check_size(envelope.len(), EVENT_ENVELOPE_BYTES_MAX, "event envelope")?;
    let length = u32::try_from(envelope.len()).map_err(|_| InputError::TooLarge {
        what: "event envelope",
        bytes: envelope.len(),
        max: EVENT_ENVELOPE_BYTES_MAX,
    })?;
    let mut frame = Vec::with_capacity(ZMQ_EVENT_FRAME_HEADER_BYTES + envelope.len());
    frame.push(ZMQ_EVENT_FRAME_VERSION);
    frame.extend_from_slice(&length.to_be_bytes());
    frame.extend_from_slice(envelope);
    Ok(frame)
}

/// Encode a `kv-events` payload: the list of `RouterEvent` maps.
pub fn encode_kv_events_payload(events: &[RouterEvent]) -> Result<Vec<u8>, InputError> {
    if events.len() > EVENTS_PER_MESSAGE_MAX {
        return Err(InputError::TooMany {
            what: "events in one message",
            count: events.len(),
            max: EVENTS_PER_MESSAGE_MAX,
        });
    }
    let mut total_blocks = 0usize;
    let mut out = Vec::with_capacity(events.len());
    for event in events {
        let data = match &event.event.data {
            KvCacheEventData::Stored(stored) => OutEventData::Stored(OutStored {
                parent_hash: stored.parent_hash.map(|hash| hash.0),
                start_position: stored.start_position,
                blocks: stored
                    .blocks
                    .iter()
                    .map(|block| OutBlock {
                        block_hash: block.block_hash.0,
                        tokens_hash: block.tokens_hash.0,
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            KvCacheEventData::Removed(removed) => OutEventData::Removed(OutRemoved {
                block_hashes: removed.block_hashes.iter().map(|hash| hash.0).collect(),
            }),
            KvCacheEventData::Cleared => OutEventData::Cleared,
        };
        let blocks = match &data {
            OutEventData::Stored(stored) => stored.blocks.len(),
            OutEventData::Removed(removed) => removed.block_hashes.len(),
            OutEventData::Cleared => 0,
        };
        if blocks > BLOCKS_PER_EVENT_MAX {
            return Err(InputError::TooMany {
                what: "blocks in one event",
                count: blocks,
                max: BLOCKS_PER_EVENT_MAX,
            });
        }
        total_blocks += blocks;
        if total_blocks > BLOCKS_PER_MESSAGE_MAX {
            return Err(InputError::TooMany {
                what: "blocks in one message",
                count: total_blocks,
                max: BLOCKS_PER_MESSAGE_MAX,
            });
        }
        let residency_domain = match &event.residency_domain {
            None => None,
            Some(ResidencyDomain::Worker) => Some("worker"),
            Some(ResidencyDomain::CacheOwner) => Some("cache_owner"),
            Some(ResidencyDomain::Unsupported(name)) => {
                check_size(name.len(), SEGMENT_BYTES_MAX, "residency_domain")?;
                Some(name.as_str())
            }
        };
        out.push(OutRouterEvent {
            worker_id: event.worker_id,
            storage_tier: storage_tier_name(event.storage_tier),
            residency_domain,
            event: OutKvCacheEvent {
                event_id: event.event.event_id,
                data,
                dp_rank: event.event.dp_rank,
            },
        });
    }
    let bytes = named(&out, "kv-events payload")?;
    check_size(bytes.len(), EVENT_ENVELOPE_BYTES_MAX, "kv-events payload")?;
    Ok(bytes)
}

/// Encode a `kv_metrics` payload (`ActiveLoad`); absent fields are written as `nil`.
pub fn encode_active_load(observation: &LoadObservation) -> Result<Vec<u8>, InputError> {
    named(
        &OutActiveLoad {
            worker_id: observation.source.worker_id,
            dp_rank: observation.source.dp_rank,
            active_decode_blocks: observation.active_decode_blocks,
            active_prefill_tokens: observation.active_prefill_tokens,
            kv_used_blocks: observation.kv_used_blocks,
        },
        "kv_metrics payload",
    )
}

/// The wire name of a storage tier.
#[must_use]
pub fn storage_tier_name(tier: StorageTier) -> &'static str {
    match tier {
        StorageTier::Device => "device",
        StorageTier::HostPinned => "host_pinned",
        StorageTier::Disk => "disk",
        StorageTier::External => "external",
    }
}

/// MessagePack with named fields. Writing into a `Vec` fails only for a length beyond `u32`,
/// which the callers' limits already exclude.
fn named(value: &impl Serialize, what: &'static str) -> Result<Vec<u8>, InputError> {
    rmp_serde::to_vec_named(value)
        .map_err(|error| InputError::MessagePack { what, detail: error.to_string() })
}

#[derive(Serialize)]
struct OutEnvelope<'a> {
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    topic: &'a str,
    #[serde(with = "serde_bytes")]
    payload: &'a [u8],
}

#[derive(Serialize)]
struct OutRouterEvent<'a> {
    worker_id: u64,
    storage_tier: &'static str,
    /// Omitted for legacy events, as Dynamo omits it.
    #[serde(skip_serializing_if = "Option::is_none")]
    residency_domain: Option<&'a str>,
    event: OutKvCacheEvent,
}

#[derive(Serialize)]
struct OutKvCacheEvent {
    event_id: u64,
    data: OutEventData,
    dp_rank: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum OutEventData {
    Stored(OutStored),
    Removed(OutRemoved),
    Cleared,
}

#[derive(Serialize)]
struct OutStored {
    parent_hash: Option<u64>,
    start_position: Option<u32>,
    blocks: Vec<OutBlock>,
}

#[derive(Serialize)]
struct OutBlock {
    block_hash: u64,
    tokens_hash: u64,
    /// Always `nil`: multimodal data is already folded into `tokens_hash`.
    mm_extra_info: Option<()>,
}

#[derive(Serialize)]
struct OutRemoved {
    block_hashes: Vec<u64>,
}

#[derive(Serialize)]
struct OutActiveLoad {
    worker_id: u64,
    dp_rank: u32,
    active_decode_blocks: Option<u64>,
    active_prefill_tokens: Option<u64>,
    kv_used_blocks: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::event_plane::{
        decode_active_load, decode_event_envelope, decode_kv_events_message,
        decode_kv_events_payload, zmq_event_frame_envelope,
    };
    use crate::inputs::test_fixtures::{
        CAPTURED_LOAD_PAYLOAD, CAPTURED_PAYLOAD, captured_envelope,
    };
    use crate::model::identity::EndpointPath;
    use crate::model::kv_events::{KvCacheEvent, StoreData, StoredBlock};

    #[test]
    fn re_encoding_the_captured_message_reproduces_its_bytes() {
        let captured = captured_envelope();
        let envelope = decode_event_envelope(&captured).unwrap();
        let events = decode_kv_events_payload(envelope.payload).unwrap();
        assert_eq!(encode_kv_events_payload(&events).unwrap(), CAPTURED_PAYLOAD.concat());
        assert_eq!(encode_event_envelope(&envelope).unwrap(), captured);
        let frame = encode_zmq_event_frame(&captured).unwrap();
        assert_eq!(zmq_event_frame_envelope(&frame), Ok(&captured[..]));
        let load = decode_active_load(&CAPTURED_LOAD_PAYLOAD.concat()).unwrap();
        assert_eq!(encode_active_load(&load).unwrap(), CAPTURED_LOAD_PAYLOAD.concat());
    }

    #[test]
    fn encoded_messages_decode_to_the_same_batch() {
        let events = vec![RouterEvent {
            worker_id: 3,
            storage_tier: StorageTier::HostPinned,
            residency_domain: None,
            event: KvCacheEvent {
                event_id: 9,
                dp_rank: 2,
                data: KvCacheEventData::Stored(StoreData {
                    parent_hash: None,
                    start_position: Some(16),
                    blocks: vec![StoredBlock {
                        block_hash: crate::model::hashing::ExternalBlockHash(1),
                        tokens_hash: crate::model::hashing::LocalBlockHash(2),
                    }],
                }),
            },
        }];
        let payload = encode_kv_events_payload(&events).unwrap();
        let envelope = EventEnvelope {
            publisher_id: 5,
            sequence: 6,
            published_at_ms: 7,
            topic: "kv-events",
            payload: &payload,
        };
        let endpoint = EndpointPath::new("a", "b", "c").unwrap();
        let batch =
            decode_kv_events_message(endpoint, &encode_event_envelope(&envelope).unwrap()).unwrap();
        assert_eq!(batch.events, events);
        assert_eq!((batch.publisher_id, batch.sequence, batch.published_at_ms), (5, 6, 7));
    }

    #[test]
    fn encoders_refuse_what_the_decoders_would_reject() {
        let cleared = RouterEvent {
            worker_id: 1,
            storage_tier: StorageTier::Device,
            residency_domain: None,
            event: KvCacheEvent { event_id: 1, dp_rank: 0, data: KvCacheEventData::Cleared },
        };
        let too_many = vec![cleared.clone(); EVENTS_PER_MESSAGE_MAX + 1];
        assert!(matches!(
            encode_kv_events_payload(&too_many),
            Err(InputError::TooMany { what: "events in one message", .. })
        ));
        let mut long_domain = cleared;
        long_domain.residency_domain =
            Some(ResidencyDomain::Unsupported("d".repeat(SEGMENT_BYTES_MAX + 1)));
        assert!(matches!(
            encode_kv_events_payload(&[long_domain]),
            Err(InputError::TooLarge { what: "residency_domain", .. })
        ));
        let long_topic = "t".repeat(SEGMENT_BYTES_MAX + 1);
        let envelope = EventEnvelope {
            publisher_id: 1,
            sequence: 0,
            published_at_ms: 0,
            topic: &long_topic,
            payload: &[],
        };
        assert!(matches!(
            encode_event_envelope(&envelope),
            Err(InputError::TooLarge { what: "envelope topic", .. })
        ));
    }
}
