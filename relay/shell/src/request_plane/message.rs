//! The messages inside request-plane frames (dynamo-planes-wire §A.3–§A.6), without I/O.
//!
//! Codecs are mixed on purpose, as Dynamo 1.6.1 mixes them: request headers, the request
//! control message (and the JSON text inside its `connection_info.info`), the call-home
//! handshake, the prologue and the sentinel are always JSON; the request body and the response
//! item wrappers use the request's `payload_codec` (MessagePack with named fields by default).
//!
//! Response decoding is tolerant where Dynamo's schema moves (maps by key in any order, any
//! integer width, `nil` for every optional field, unknown keys ignored, hashes that arrive as
//! signed integers reinterpreted bitwise) and strict where a silent misread would corrupt state:
//! an unknown response variant is reported as such, never guessed.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::RecoveryError;
use kvrelay_core::model::kv_events::{KvCacheEvent, KvCacheEventData, RouterEvent};
use kvrelay_core::sources::{RecoveryQueryKind, RecoveryRequest, RecoveryResponse, TreeDumpScope};

/// Deepest MessagePack nesting accepted in a response item (real items nest about 10 levels).
const RESPONSE_DEPTH_MAX: usize = 32;

/// Longest text kept from a worker (error messages, unknown variant names), in bytes.
pub const WORKER_TEXT_BYTES_MAX: usize = 4096;

/// The body codec of a request (`payload_codec`), which the response wrappers follow too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum PayloadCodec {
    /// MessagePack with named fields: Dynamo 1.6.1's default.
    #[default]
    MsgPack,
    /// JSON.
    Json,
}

impl PayloadCodec {
    /// The codec an instance advertises as `request_plane_codec`. Like Dynamo, anything other
    /// than `json` (including nothing) means MessagePack.
    #[must_use]
    pub fn from_advertised(advertised: Option<&str>) -> Self {
        match advertised {
            Some(codec) if codec.eq_ignore_ascii_case("json") => PayloadCodec::Json,
            _ => PayloadCodec::MsgPack,
        }
    }

    /// The wire name put into `payload_codec`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            PayloadCodec::MsgPack => "msgpack",
            PayloadCodec::Json => "json",
        }
    }
}

/// Request headers: Dynamo's worker requires none, the relay mirrors its `request-id` and
/// `x-endpoint-path` (it leaves out the optional wall-clock `x-frontend-send-ts-ns`).
#[derive(Serialize)]
struct RequestHeaders<'a> {
    #[serde(rename = "request-id")]
    request_id: &'a str,
    #[serde(rename = "x-endpoint-path")]
    endpoint_path: &'a str,
}

/// The request control message (always JSON), in the captured key order.
#[derive(Serialize)]
struct ControlMessage<'a> {
    id: &'a str,
    request_type: &'static str,
    response_type: &'static str,
    payload_codec: &'static str,
    connection_info: ConnectionInfo,
}

#[derive(Serialize)]
struct ConnectionInfo {
    transport: &'static str,
    /// JSON text of [`CallHomeInfo`] (a string holding JSON, as the worker expects).
    info: String,
}

/// Where and how the worker calls home.
#[derive(Serialize)]
struct CallHomeInfo<'a> {
    address: &'a str,
    subject: &'a str,
    context: &'a str,
    stream_type: &'static str,
}

/// `WorkerKvQueryRequest`, named fields in the captured order.
#[derive(Serialize)]
struct WireRequest {
    worker_id: u64,
    dp_rank: u32,
    start_event_id: Option<u64>,
    end_event_id: Option<u64>,
    supports_tree_dump_failed: bool,
    kind: &'static str,
}

/// The identifiers of one query: the request id (also the call-home `context`) and the
/// call-home `subject` that routes the worker's connection back to the waiting query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryIds {
    /// Request id (UUID text).
    pub request_id: String,
    /// Call-home subject (UUID text).
    pub subject: String,
}

/// The request headers block (JSON).
pub fn encode_request_headers(ids: &QueryIds, endpoint_path: &str) -> Vec<u8> {
    json_bytes(&RequestHeaders { request_id: &ids.request_id, endpoint_path })
}

/// The request control message (JSON) naming `response_address` as the call-home listener.
pub fn encode_control_message(
    ids: &QueryIds,
    codec: PayloadCodec,
    response_address: &str,
) -> Vec<u8> {
    let info = CallHomeInfo {
        address: response_address,
        subject: &ids.subject,
        context: &ids.request_id,
        stream_type: "response",
    };
    json_bytes(&ControlMessage {
        id: &ids.request_id,
        request_type: "single_in",
        response_type: "many_out",
        payload_codec: codec.name(),
        connection_info: ConnectionInfo {
            transport: "tcp_server",
            info: String::from_utf8_lossy(&json_bytes(&info)).into_owned(),
        },
    })
}

/// The request body (`WorkerKvQueryRequest`) in `codec`.
pub fn encode_request_body(
    codec: PayloadCodec,
    request: &RecoveryRequest,
) -> Result<Vec<u8>, RecoveryError> {
    let kind = match request.kind {
        RecoveryQueryKind::Recovery => "recovery",
    };
    let wire = WireRequest {
        worker_id: request.worker_id,
        dp_rank: request.dp_rank,
        start_event_id: request.start_event_id,
        end_event_id: request.end_event_id,
        supports_tree_dump_failed: request.supports_tree_dump_failed,
        kind,
    };
    match codec {
        PayloadCodec::MsgPack => {
            rmp_serde::to_vec_named(&wire).map_err(|error| RecoveryError::Encode(error.to_string()))
        }
        PayloadCodec::Json => Ok(json_bytes(&wire)),
    }
}

/// Serialize plain structs of strings and integers to JSON; that cannot fail.
fn json_bytes(value: &impl Serialize) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// The call-home handshake header: `{"subject":..,"stream_type":"response"}`.
#[derive(Deserialize)]
struct Handshake {
    subject: String,
    #[serde(default)]
    stream_type: Option<String>,
}

/// The subject of a call-home handshake header.
pub fn decode_handshake(header: &[u8]) -> Result<String, RecoveryError> {
    let handshake: Handshake = serde_json::from_slice(header)
        .map_err(|error| RecoveryError::Protocol(format!("call-home handshake: {error}")))?;
    if let Some(stream_type) = handshake.stream_type
        && stream_type != "response"
    {
        return Err(RecoveryError::Protocol(format!(
            "call-home stream_type {:?}",
            cut(&stream_type)
        )));
    }
    Ok(handshake.subject)
}

/// A control frame of the response stream (a header-only two-part message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlFrame {
    /// `{"error": null}`: the stream starts.
    PrologueOk,
    /// `{"error": <text>}`: the worker could not start the stream.
    PrologueFailed(String),
    /// `"sentinel"`: transport end of stream.
    Sentinel,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WireControl {
    Word(String),
    Prologue {
        #[serde(default)]
        error: Option<serde_json::Value>,
    },
}

/// Classify a header-only frame of the response stream.
pub fn decode_control_frame(header: &[u8]) -> Result<ControlFrame, RecoveryError> {
    let control: WireControl = serde_json::from_slice(header)
        .map_err(|error| RecoveryError::Protocol(format!("response control frame: {error}")))?;
    match control {
        WireControl::Word(word) if word == "sentinel" => Ok(ControlFrame::Sentinel),
        WireControl::Word(word) => {
            Err(RecoveryError::Protocol(format!("unexpected control frame {:?}", cut(&word))))
        }
        WireControl::Prologue { error: None | Some(serde_json::Value::Null) } => {
            Ok(ControlFrame::PrologueOk)
        }
        WireControl::Prologue { error: Some(serde_json::Value::String(text)) } => {
            Ok(ControlFrame::PrologueFailed(cut(&text)))
        }
        WireControl::Prologue { error: Some(other) } => {
            Ok(ControlFrame::PrologueFailed(cut(&other.to_string())))
        }
    }
}

/// One decoded item frame of the response stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemFrame {
    /// The answer carried by the frame, if any.
    pub answer: Option<RecoveryResponse>,
    /// Whether the frame ends the logical stream.
    pub complete_final: bool,
}

#[derive(Deserialize)]
struct WireItem {
    #[serde(default)]
    data: Option<WireAnswer>,
    #[serde(default)]
    complete_final: bool,
}

/// Decode an item frame body (`{"data": <answer>, "complete_final": bool}`) in `codec`, and map
/// its answer to the domain for `request`.
pub fn decode_item_frame(
    codec: PayloadCodec,
    body: &[u8],
    request: &RecoveryRequest,
) -> Result<ItemFrame, RecoveryError> {
    let wire: WireItem = match codec {
        PayloadCodec::MsgPack => {
            let mut deserializer = rmp_serde::Deserializer::from_read_ref(body);
            deserializer.set_max_depth(RESPONSE_DEPTH_MAX);
            WireItem::deserialize(&mut deserializer)
                .map_err(|error| RecoveryError::Decode(cut(&error.to_string())))?
        }
        PayloadCodec::Json => serde_json::from_slice(body)
            .map_err(|error| RecoveryError::Decode(cut(&error.to_string())))?,
    };
    let answer = wire.data.map(|answer| answer.into_response(request)).transpose()?;
    Ok(ItemFrame { answer, complete_final: wire.complete_final })
}

/// `text` cut to [`WORKER_TEXT_BYTES_MAX`] bytes on a character boundary.
pub(crate) fn cut(text: &str) -> String {
    if text.len() <= WORKER_TEXT_BYTES_MAX {
        return text.to_owned();
    }
    let mut end = WORKER_TEXT_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// `WorkerKvQueryResponse`: an externally tagged enum with PascalCase variant names.
enum WireAnswer {
    TreeDump(WireTreeDump),
    Events(WireEvents),
    TooNew(WireTooNew),
    InvalidRange(WireInvalidRange),
    Error(String),
    TreeDumpFailed(WireTreeDumpFailed),
    /// A bare string instead of a variant map, e.g. `Server overloaded: ...`.
    Text(String),
    /// A variant this relay does not speak (`Status`, `StateAgentRecovery`, future ones).
    Unsupported(String),
}

impl<'de> Deserialize<'de> for WireAnswer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(AnswerVisitor)
    }
}

struct AnswerVisitor;

impl<'de> Visitor<'de> for AnswerVisitor {
    type Value = WireAnswer;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a WorkerKvQueryResponse variant map")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<WireAnswer, E> {
        Ok(WireAnswer::Text(cut(text)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireAnswer, A::Error> {
        let Some(variant) = map.next_key::<String>()? else {
            return Err(de::Error::custom("empty response variant map"));
        };
        let answer = match variant.as_str() {
            "TreeDump" => WireAnswer::TreeDump(map.next_value()?),
            "Events" => WireAnswer::Events(map.next_value()?),
            "TooNew" => WireAnswer::TooNew(map.next_value()?),
            "InvalidRange" => WireAnswer::InvalidRange(map.next_value()?),
            "Error" => WireAnswer::Error(cut(&map.next_value::<String>()?)),
            "TreeDumpFailed" => WireAnswer::TreeDumpFailed(map.next_value()?),
            other => {
                map.next_value::<IgnoredAny>()?;
                WireAnswer::Unsupported(cut(other))
            }
        };
        if map.next_key::<IgnoredAny>()?.is_some() {
            return Err(de::Error::custom("response variant map has more than one key"));
        }
        Ok(answer)
    }
}

#[derive(Deserialize)]
struct WireTreeDump {
    events: Vec<WireRouterEvent>,
    last_event_id: u64,
    #[serde(default)]
    reset_scope: Option<String>,
}

#[derive(Deserialize)]
struct WireEvents {
    events: Vec<WireRouterEvent>,
    last_event_id: u64,
}

#[derive(Deserialize)]
struct WireTooNew {
    #[serde(default)]
    requested_start: Option<u64>,
    #[serde(default)]
    requested_end: Option<u64>,
    newest_available: u64,
}

#[derive(Deserialize)]
struct WireInvalidRange {
    start_id: u64,
    #[serde(default)]
    end_id: Option<u64>,
}

#[derive(Deserialize)]
struct WireTreeDumpFailed {
    #[serde(default)]
    last_event_id: Option<u64>,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
struct WireRouterEvent {
    worker_id: u64,
    #[serde(default)]
    storage_tier: Option<String>,
    #[serde(default)]
    residency_domain: Option<String>,
    event: WireKvCacheEvent,
}

#[derive(Deserialize)]
struct WireKvCacheEvent {
    event_id: u64,
    data: WireEventData,
    #[serde(default)]
    dp_rank: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireEventData {
    Stored(WireStored),
    Removed(WireRemoved),
    Cleared,
}

#[derive(Deserialize)]
struct WireStored {
    #[serde(default)]
    parent_hash: Option<Hash64>,
    #[serde(default)]
    start_position: Option<u64>,
    blocks: Vec<WireBlock>,
}

#[derive(Deserialize)]
struct WireBlock {
    block_hash: Hash64,
    tokens_hash: Hash64,
}

#[derive(Deserialize)]
struct WireRemoved {
    block_hashes: Vec<Hash64>,
}

/// A 64-bit hash that may arrive as a signed integer; reinterpreted bitwise.
struct Hash64(u64);

impl<'de> Deserialize<'de> for Hash64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = Hash64;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a 64-bit integer hash")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Hash64, E> {
                Ok(Hash64(value))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Hash64, E> {
                Ok(Hash64(u64::from_ne_bytes(value.to_ne_bytes())))
            }
        }
        deserializer.deserialize_any(HashVisitor)
    }
}

impl WireAnswer {
    fn into_response(self, request: &RecoveryRequest) -> Result<RecoveryResponse, RecoveryError> {
        Ok(match self {
            WireAnswer::TreeDump(dump) => RecoveryResponse::TreeDump {
                events: convert_events(dump.events)?,
                last_event_id: dump.last_event_id,
                // "all": the dump is the rank's complete state (absent on older workers).
                reset_scope: match dump.reset_scope.as_deref() {
                    None | Some("all") => TreeDumpScope::Rank,
                    Some(other) => TreeDumpScope::Other(cut(other)),
                },
            },
            WireAnswer::Events(events) => RecoveryResponse::Events {
                events: convert_events(events.events)?,
                last_event_id: events.last_event_id,
            },
            WireAnswer::TooNew(too_new) => RecoveryResponse::TooNew {
                requested_start: too_new
                    .requested_start
                    .or(request.start_event_id)
                    .unwrap_or_default(),
                requested_end: too_new.requested_end,
                newest_available: too_new.newest_available,
            },
            WireAnswer::InvalidRange(range) => {
                RecoveryResponse::InvalidRange { start_id: range.start_id, end_id: range.end_id }
            }
            WireAnswer::Error(message) => RecoveryResponse::Error(message),
            WireAnswer::TreeDumpFailed(failed) => RecoveryResponse::TreeDumpFailed {
                last_event_id: failed.last_event_id,
                message: cut(failed.message.as_deref().unwrap_or_default()),
            },
            WireAnswer::Text(text) => return Err(RecoveryError::Rejected { message: text }),
            WireAnswer::Unsupported(variant) => {
                return Err(RecoveryError::UnsupportedResponse(variant));
            }
        })
    }
}

fn convert_events(events: Vec<WireRouterEvent>) -> Result<Vec<RouterEvent>, RecoveryError> {
    events.into_iter().map(WireRouterEvent::into_router_event).collect()
}

impl WireRouterEvent {
    fn into_router_event(self) -> Result<RouterEvent, RecoveryError> {
        let storage_tier =
            kvrelay_core::model::kv_events::storage_tier_from_wire(self.storage_tier.as_deref())
                .ok_or_else(|| {
                    RecoveryError::Decode(format!(
                        "unknown storage tier {:?}",
                        cut(self.storage_tier.as_deref().unwrap_or_default())
                    ))
                })?;
        let residency_domain = self
            .residency_domain
            .as_deref()
            .map(|name| kvrelay_core::model::kv_events::residency_domain_from_wire(&cut(name)));
        let data = match self.event.data {
            WireEventData::Stored(stored) => kvrelay_core::model::kv_events::stored_from_wire(
                stored.parent_hash.map(|hash| hash.0),
                stored.start_position,
                stored.blocks.into_iter().map(|block| (block.block_hash.0, block.tokens_hash.0)),
            )
            .map_err(|error| RecoveryError::Decode(error.to_string()))?,
            WireEventData::Removed(removed) => kvrelay_core::model::kv_events::removed_from_wire(
                removed.block_hashes.into_iter().map(|hash| hash.0),
            ),
            WireEventData::Cleared => KvCacheEventData::Cleared,
        };
        Ok(RouterEvent {
            worker_id: self.worker_id,
            storage_tier,
            residency_domain,
            event: KvCacheEvent {
                event_id: self.event.event_id,
                dp_rank: self.event.dp_rank.unwrap_or(0),
                data,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_core::model::hashing::ExternalBlockHash;
    use kvrelay_core::model::kv_events::RemoveData;
    use serde_json::json;

    use super::*;
    use kvrelay_core::model::kv_events::SourceKey;

    const SMALL_INSTANCE: u64 = 15_884_517_127_758_876_217;

    fn dump_request() -> RecoveryRequest {
        RecoveryRequest::tree_dump(SourceKey { worker_id: SMALL_INSTANCE, dp_rank: 0 })
    }

    fn item(value: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    #[test]
    fn request_body_matches_the_captured_bytes() {
        // dynamo-planes-wire §A.9: the 100-byte msgpack body of the captured tree-dump request.
        let captured: Vec<u8> = [
            &b"\x86"[..],
            b"\xa9worker_id\xcf\xdc\x71\x24\x2a\xfc\xad\x0e\x39",
            b"\xa7dp_rank\x00",
            b"\xaestart_event_id\xc0",
            b"\xacend_event_id\xc0",
            b"\xb9supports_tree_dump_failed\xc3",
            b"\xa4kind\xa8recovery",
        ]
        .concat();
        assert_eq!(captured.len(), 100);
        let body = encode_request_body(PayloadCodec::MsgPack, &dump_request()).unwrap();
        assert_eq!(body, captured);
    }

    #[test]
    fn json_request_body_names_every_field() {
        let request = RecoveryRequest::range(SourceKey { worker_id: 5, dp_rank: 2 }, 7, None);
        let body = encode_request_body(PayloadCodec::Json, &request).unwrap();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"worker_id":5,"dp_rank":2,"start_event_id":7,"end_event_id":null,"supports_tree_dump_failed":true,"kind":"recovery"}"#
        );
    }

    #[test]
    fn control_message_has_the_captured_layout() {
        let ids = QueryIds {
            request_id: "4613f99e-c2e3-41b0-b730-09e1e80418b9".into(),
            subject: "8e7ea47f-816a-460c-a7a6-40e56ae26c1c".into(),
        };
        let control = encode_control_message(&ids, PayloadCodec::MsgPack, "127.0.0.1:46067");
        let expected = concat!(
            r#"{"id":"4613f99e-c2e3-41b0-b730-09e1e80418b9","request_type":"single_in","#,
            r#""response_type":"many_out","payload_codec":"msgpack","connection_info":"#,
            r#"{"transport":"tcp_server","info":"{\"address\":\"127.0.0.1:46067\","#,
            r#"\"subject\":\"8e7ea47f-816a-460c-a7a6-40e56ae26c1c\","#,
            r#"\"context\":\"4613f99e-c2e3-41b0-b730-09e1e80418b9\",\"stream_type\":\"response\"}"}}"#
        );
        assert_eq!(String::from_utf8(control).unwrap(), expected);
        // The captured two-part header_len of this control message.
        assert_eq!(expected.len(), 348);
    }

    #[test]
    fn handshake_and_control_frames_are_classified() {
        let subject = "8e7ea47f-816a-460c-a7a6-40e56ae26c1c";
        let handshake = format!(r#"{{"subject":"{subject}","stream_type":"response"}}"#);
        assert_eq!(handshake.len(), 75);
        assert_eq!(decode_handshake(handshake.as_bytes()).unwrap(), subject);
        assert!(decode_handshake(br#"{"subject":"x","stream_type":"request"}"#).is_err());
        assert!(decode_handshake(b"not json").is_err());

        assert_eq!(decode_control_frame(br#"{"error":null}"#).unwrap(), ControlFrame::PrologueOk);
        assert_eq!(
            decode_control_frame(br#"{"error":"no engine","typed_error":{"k":1}}"#).unwrap(),
            ControlFrame::PrologueFailed("no engine".into())
        );
        assert_eq!(decode_control_frame(br#""sentinel""#).unwrap(), ControlFrame::Sentinel);
        assert!(decode_control_frame(br#""kill""#).is_err());
        assert!(decode_control_frame(b"\xff").is_err());
    }

    #[test]
    fn every_observed_answer_variant_maps_to_the_domain() {
        let request = RecoveryRequest::range(SourceKey { worker_id: 1, dp_rank: 0 }, 100, None);
        let decode = |value| decode_item_frame(PayloadCodec::MsgPack, &item(&value), &request);
        let too_new = decode(json!({"data": {"TooNew": {"requested_start": 100,
            "requested_end": 50, "newest_available": 50}}, "complete_final": false}));
        assert_eq!(
            too_new.unwrap().answer,
            Some(RecoveryResponse::TooNew {
                requested_start: 100,
                requested_end: Some(50),
                newest_available: 50
            })
        );
        let invalid = decode(json!({"data": {"InvalidRange": {"start_id": 9, "end_id": 3}}}));
        assert_eq!(
            invalid.unwrap().answer,
            Some(RecoveryResponse::InvalidRange { start_id: 9, end_id: Some(3) })
        );
        let error =
            decode(json!({"data": {"Error": "WorkerKvQueryEngine::generate worker_id mismatch"}}));
        assert_eq!(
            error.unwrap().answer,
            Some(RecoveryResponse::Error(
                "WorkerKvQueryEngine::generate worker_id mismatch".into()
            ))
        );
        let failed =
            decode(json!({"data": {"TreeDumpFailed": {"last_event_id": 4, "message": "busy"}}}));
        assert_eq!(
            failed.unwrap().answer,
            Some(RecoveryResponse::TreeDumpFailed {
                last_event_id: Some(4),
                message: "busy".into()
            })
        );
        let events = decode(json!({"data": {"Events": {"events": [
            {"worker_id": 1, "event": {"event_id": 100, "dp_rank": 0,
             "data": {"removed": {"block_hashes": [-1, 5]}}}},
            {"worker_id": 1, "event": {"event_id": 101, "data": "cleared"}}],
            "last_event_id": 101}}, "complete_final": false}))
        .unwrap();
        let Some(RecoveryResponse::Events { events, last_event_id: 101 }) = events.answer else {
            panic!("not events");
        };
        assert_eq!(
            events[0].event.data,
            KvCacheEventData::Removed(RemoveData {
                block_hashes: vec![ExternalBlockHash(u64::MAX), ExternalBlockHash(5)]
            })
        );
        assert_eq!(events[1].event.data, KvCacheEventData::Cleared);
        let done = decode(json!({"complete_final": true})).unwrap();
        assert_eq!(done, ItemFrame { answer: None, complete_final: true });
    }

    #[test]
    fn unknown_variants_and_bare_texts_are_errors_not_guesses() {
        let request = dump_request();
        let decode = |value| decode_item_frame(PayloadCodec::MsgPack, &item(&value), &request);
        assert_eq!(
            decode(json!({"data": {"Status": {"identity": 1}}})),
            Err(RecoveryError::UnsupportedResponse("Status".into()))
        );
        assert_eq!(
            decode(json!({"data": "Server overloaded: worker at capacity"})),
            Err(RecoveryError::Rejected {
                message: "Server overloaded: worker at capacity".into()
            })
        );
        assert!(matches!(
            decode(json!({"data": {"Events": {"events": [], "last_event_id": 1}, "Error": "x"}})),
            Err(RecoveryError::Decode(_))
        ));
        assert!(matches!(
            decode_item_frame(PayloadCodec::MsgPack, b"\xc1", &request),
            Err(RecoveryError::Decode(_))
        ));
    }

    #[test]
    fn json_items_decode_like_msgpack_items() {
        let value = json!({"data": {"TreeDump": {"events": [
            {"worker_id": SMALL_INSTANCE, "storage_tier": "device", "residency_domain": "worker",
             "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {"parent_hash": null,
               "start_position": null, "blocks": [{"block_hash": 1, "tokens_hash": 2,
               "mm_extra_info": null}]}}}}],
            "last_event_id": 20000, "reset_scope": "all"}}, "complete_final": false});
        let request = dump_request();
        let from_json =
            decode_item_frame(PayloadCodec::Json, &serde_json::to_vec(&value).unwrap(), &request)
                .unwrap();
        let from_msgpack =
            decode_item_frame(PayloadCodec::MsgPack, &item(&value), &request).unwrap();
        assert_eq!(from_json, from_msgpack);
        let Some(RecoveryResponse::TreeDump { events, last_event_id: 20000, reset_scope }) =
            from_json.answer
        else {
            panic!("not a tree dump");
        };
        assert_eq!(reset_scope, TreeDumpScope::Rank);
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn codec_names_follow_dynamo() {
        assert_eq!(PayloadCodec::from_advertised(Some("json")), PayloadCodec::Json);
        assert_eq!(PayloadCodec::from_advertised(Some("msgpack")), PayloadCodec::MsgPack);
        assert_eq!(PayloadCodec::from_advertised(Some("bogus")), PayloadCodec::MsgPack);
        assert_eq!(PayloadCodec::from_advertised(None), PayloadCodec::MsgPack);
        assert_eq!(PayloadCodec::Json.name(), "json");
    }
}
