//! The worker's side of a recovery answer: a [`RecoveryResponse`] written as the call-home
//! response stream a Dynamo worker sends (dynamo-planes-wire §A.5), and that stream read back
//! through the relay's own frame decoders.
//!
//! The relay never writes answers; the simulator's workers do, so every recovery answer in a
//! simulation reaches the node through [`decode_frame`] and [`ResponseStream`], the code the TCP
//! client runs. The stream is four two-part messages: the prologue `{"error":null}` (header
//! only), one item `{"data": <WorkerKvQueryResponse>, "complete_final": false}` (body only, in
//! the payload codec), the end marker `{"complete_final": true}` (body only) and the sentinel
//! `"sentinel"` (header only).

use serde::Serialize;
use serde_json::{Value, json};

use super::RecoveryError;
use super::message::{PayloadCodec, decode_control_frame, decode_item_frame};
use super::stream::{FrameKind, ResponseStream, StreamFrame, classify_frame};
use kvrelay_core::model::kv_events::{KvCacheEventData, ResidencyDomain, RouterEvent, StorageTier};
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// One two-part message of a response stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerMessage {
    /// The header part (JSON control frames).
    pub header: Vec<u8>,
    /// The body part (item frames, in the payload codec).
    pub body: Vec<u8>,
}

/// `response` as the response stream a worker writes in `codec`.
///
/// # Errors
/// When the codec cannot encode the answer (not expected for well-formed responses).
pub fn answer_stream(
    codec: PayloadCodec,
    response: &RecoveryResponse,
) -> Result<Vec<AnswerMessage>, RecoveryError> {
    let control =
        |value: Value| AnswerMessage { header: value.to_string().into_bytes(), body: Vec::new() };
    let item = |value: Value| -> Result<AnswerMessage, RecoveryError> {
        Ok(AnswerMessage { header: Vec::new(), body: encode(codec, &value)? })
    };
    Ok(vec![
        control(json!({ "error": null })),
        item(json!({ "data": wire_answer(response), "complete_final": false }))?,
        item(json!({ "complete_final": true }))?,
        control(json!("sentinel")),
    ])
}

/// Decode one two-part message of a response stream with the relay's decoders.
///
/// # Errors
/// A frame with both parts, or a part its decoder refuses.
pub fn decode_frame(
    codec: PayloadCodec,
    header: &[u8],
    body: &[u8],
    request: &RecoveryRequest,
) -> Result<StreamFrame, RecoveryError> {
    Ok(match classify_frame(header.len() as u64, body.len() as u64)? {
        FrameKind::Control => StreamFrame::Control(decode_control_frame(header)?),
        FrameKind::Item => StreamFrame::Item(decode_item_frame(codec, body, request)?),
    })
}

/// Read a whole response stream to the answer to `request`, enforcing its order.
///
/// # Errors
/// What [`decode_frame`] or [`ResponseStream`] refuse (a failed prologue, frames out of order,
/// a stream without an answer).
pub fn read_answer_stream<'a>(
    codec: PayloadCodec,
    messages: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    request: &RecoveryRequest,
) -> Result<RecoveryResponse, RecoveryError> {
    let mut stream = ResponseStream::new();
    for (header, body) in messages {
        if stream.handle(decode_frame(codec, header, body, request)?)? {
            break;
        }
    }
    stream.finish()
}

fn encode(codec: PayloadCodec, value: &Value) -> Result<Vec<u8>, RecoveryError> {
    match codec {
        PayloadCodec::MsgPack => {
            let mut bytes = Vec::new();
            value
                .serialize(&mut rmp_serde::Serializer::new(&mut bytes).with_struct_map())
                .map_err(|error| RecoveryError::Decode(format!("encoding an answer: {error}")))?;
            Ok(bytes)
        }
        PayloadCodec::Json => Ok(value.to_string().into_bytes()),
    }
}

/// `WorkerKvQueryResponse`: externally tagged, PascalCase variants.
fn wire_answer(response: &RecoveryResponse) -> Value {
    match response {
        RecoveryResponse::Events { events, last_event_id } => json!({ "Events": {
            "events": wire_events(events),
            "last_event_id": last_event_id,
        }}),
        RecoveryResponse::TreeDump { events, last_event_id, reset_scope } => json!({ "TreeDump": {
            "events": wire_events(events),
            "last_event_id": last_event_id,
            "reset_scope": match reset_scope {
                TreeDumpScope::Rank => "all",
                TreeDumpScope::Other(scope) => scope.as_str(),
            },
        }}),
        RecoveryResponse::TreeDumpFailed { last_event_id, message } => json!({ "TreeDumpFailed": {
            "last_event_id": last_event_id,
            "message": message,
        }}),
        RecoveryResponse::TooNew { requested_start, requested_end, newest_available } => {
            json!({ "TooNew": {
                "requested_start": requested_start,
                "requested_end": requested_end,
                "newest_available": newest_available,
            }})
        }
        RecoveryResponse::InvalidRange { start_id, end_id } => {
            json!({ "InvalidRange": { "start_id": start_id, "end_id": end_id } })
        }
        RecoveryResponse::Error(message) => json!({ "Error": message }),
    }
}

fn wire_events(events: &[RouterEvent]) -> Value {
    Value::Array(events.iter().map(wire_event).collect())
}

fn wire_event(event: &RouterEvent) -> Value {
    let tier = match event.storage_tier {
        StorageTier::Device => "device",
        StorageTier::HostPinned => "host_pinned",
        StorageTier::Disk => "disk",
        StorageTier::External => "external",
    };
    let domain = event.residency_domain.as_ref().map(|domain| match domain {
        ResidencyDomain::Worker => "worker",
        ResidencyDomain::CacheOwner => "cache_owner",
        ResidencyDomain::Unsupported(name) => name.as_str(),
    });
    let data = match &event.event.data {
        KvCacheEventData::Stored(stored) => json!({ "stored": {
            "parent_hash": stored.parent_hash.map(|hash| hash.0),
            "start_position": stored.start_position,
            "blocks": stored.blocks.iter().map(|block| json!({
                "block_hash": block.block_hash.0,
                "tokens_hash": block.tokens_hash.0,
            })).collect::<Vec<_>>(),
        }}),
        KvCacheEventData::Removed(removed) => json!({ "removed": {
            "block_hashes": removed.block_hashes.iter().map(|hash| hash.0).collect::<Vec<_>>(),
        }}),
        KvCacheEventData::Cleared => json!("cleared"),
    };
    json!({
        "worker_id": event.worker_id,
        "storage_tier": tier,
        "residency_domain": domain,
        "event": { "event_id": event.event.event_id, "data": data, "dp_rank": event.event.dp_rank },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
    use kvrelay_core::model::kv_events::{
        KvCacheEvent, RemoveData, SourceKey, StoreData, StoredBlock,
    };

    fn event(event_id: u64, data: KvCacheEventData) -> RouterEvent {
        RouterEvent {
            worker_id: u64::MAX - 7,
            storage_tier: StorageTier::Device,
            residency_domain: Some(ResidencyDomain::Worker),
            event: KvCacheEvent { event_id, dp_rank: 1, data },
        }
    }

    fn stored(parent: Option<u64>, hashes: &[(u64, u64)]) -> KvCacheEventData {
        KvCacheEventData::Stored(StoreData {
            parent_hash: parent.map(ExternalBlockHash),
            start_position: parent.map(|_| 3),
            blocks: hashes
                .iter()
                .map(|&(block, tokens)| StoredBlock {
                    block_hash: ExternalBlockHash(block),
                    tokens_hash: LocalBlockHash(tokens),
                })
                .collect(),
        })
    }

    fn responses() -> Vec<RecoveryResponse> {
        let events = vec![
            event(7, stored(None, &[(1, u64::MAX), (2, 0x8000_0000_0000_0000)])),
            event(8, stored(Some(2), &[(3, 33)])),
            event(
                9,
                KvCacheEventData::Removed(RemoveData { block_hashes: vec![ExternalBlockHash(1)] }),
            ),
            event(10, KvCacheEventData::Cleared),
        ];
        let mut legacy = event(11, KvCacheEventData::Cleared);
        legacy.residency_domain = None;
        legacy.storage_tier = StorageTier::HostPinned;
        vec![
            RecoveryResponse::Events { events: events.clone(), last_event_id: 10 },
            RecoveryResponse::Events { events: vec![legacy], last_event_id: 11 },
            RecoveryResponse::TreeDump {
                events,
                last_event_id: 10,
                reset_scope: TreeDumpScope::Rank,
            },
            RecoveryResponse::TreeDump {
                events: Vec::new(),
                last_event_id: 0,
                reset_scope: TreeDumpScope::Other("tier".to_owned()),
            },
            RecoveryResponse::TreeDumpFailed { last_event_id: Some(4), message: "busy".to_owned() },
            RecoveryResponse::TooNew {
                requested_start: 5,
                requested_end: Some(9),
                newest_available: 4,
            },
            RecoveryResponse::InvalidRange { start_id: 9, end_id: None },
            RecoveryResponse::Error("no such rank".to_owned()),
        ]
    }

    #[test]
    fn every_answer_reads_back_through_the_relays_decoders_in_both_codecs() {
        let request = RecoveryRequest::range(SourceKey { worker_id: 1, dp_rank: 1 }, 5, Some(9));
        for codec in [PayloadCodec::MsgPack, PayloadCodec::Json] {
            for response in responses() {
                let stream = answer_stream(codec, &response).unwrap();
                assert_eq!(stream.len(), 4);
                let parts = stream.iter().map(|m| (m.header.as_slice(), m.body.as_slice()));
                let read = read_answer_stream(codec, parts, &request).unwrap();
                assert_eq!(read, response, "{codec:?}");
            }
        }
    }

    #[test]
    fn the_stream_has_the_workers_shape() {
        let response = RecoveryResponse::Error("x".to_owned());
        let stream = answer_stream(PayloadCodec::Json, &response).unwrap();
        assert_eq!(
            stream[0],
            AnswerMessage { header: br#"{"error":null}"#.to_vec(), body: vec![] }
        );
        assert_eq!(stream[1].body, br#"{"complete_final":false,"data":{"Error":"x"}}"#.to_vec());
        assert_eq!(stream[2].body, br#"{"complete_final":true}"#.to_vec());
        assert_eq!(stream[3], AnswerMessage { header: br#""sentinel""#.to_vec(), body: vec![] });
    }

    #[test]
    fn a_stream_cut_before_its_item_or_out_of_order_is_refused() {
        let request = RecoveryRequest::range(SourceKey { worker_id: 1, dp_rank: 0 }, 1, None);
        let stream =
            answer_stream(PayloadCodec::MsgPack, &RecoveryResponse::Error("x".into())).unwrap();
        let parts = |order: &[usize]| -> Vec<(&[u8], &[u8])> {
            order
                .iter()
                .map(|&i| (stream[i].header.as_slice(), stream[i].body.as_slice()))
                .collect()
        };
        assert!(read_answer_stream(PayloadCodec::MsgPack, parts(&[0]), &request).is_err());
        assert!(read_answer_stream(PayloadCodec::MsgPack, parts(&[1, 0, 2, 3]), &request).is_err());
        let both = [(stream[0].header.as_slice(), stream[1].body.as_slice())];
        assert!(read_answer_stream(PayloadCodec::MsgPack, both, &request).is_err());
    }
}
