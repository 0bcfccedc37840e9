//! The planes protocol between the relay host and the planes host: one TCP connection carries
//! the three DC planes.
//!
//! Framing: every frame is a 4-byte big-endian length followed by that many bytes of
//! MessagePack (a [`ToPlanes`] or [`ToRelay`] value, externally tagged). Frames above
//! [`FRAME_BYTES_MAX`] are refused before allocation (the connection is then dropped).
//!
//! | relay → planes | planes → relay |
//! | --- | --- |
//! | `Subscribe { after }`: list (`after = None`) or watch from a revision, and receive events | `Listing { revision, entries }` or `Changes` from `after`, then everything live |
//! | | `Batch(items)`: one tick's watch changes and event-plane messages, in publication order |
//! | `Query { id, target, request }`: a recovery query | `Answer { id, result }` |
//! | `Ping` (a liveness probe on a fresh connection) | `Pong`; `Heartbeat` every 100 ms of silence |
//! | `Publish(publications)` (from host `dc`: registrations and event messages, in order) | |
//!
//! Discovery values are the JSON documents of [`super::records`]; event-plane messages are the
//! envelope bytes a Dynamo worker publishes; a recovery answer is the call-home response stream
//! a worker writes (prologue, item, end marker, sentinel as two-part messages, the item in
//! MessagePack; [`kvrelay::request_plane::answer`]), read on the relay host by the relay's own
//! frame decoders. The query travels as the typed [`RecoveryRequest`]: the relay only encodes
//! requests, so there is no production decoder for the simulated worker to run.

use bytes::{BufMut, Bytes, BytesMut};
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::sources::RecoveryRequest;
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use super::store::Change;

/// Largest frame either side accepts.
pub const FRAME_BYTES_MAX: usize = 16 << 20;

/// The codec of both directions.
#[must_use]
pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
        .max_frame_length(FRAME_BYTES_MAX)
        .new_codec()
}

/// A frame from the relay host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToPlanes {
    /// Start discovery (list, or watch after a revision) and the event subscription.
    Subscribe {
        /// The last revision the relay applied; `None` asks for a listing.
        after: Option<u64>,
    },
    /// A recovery query for a worker.
    Query {
        /// Chosen by the relay; echoed in the answer.
        id: u64,
        /// The worker's advertised recovery target.
        target: RecoveryTarget,
        /// The request.
        request: RecoveryRequest,
    },
    /// Is this connection alive?
    Ping,
    /// What the workers published since the last frame, in order (from host `dc`; no answer).
    Publish(Vec<Publication>),
}

/// One thing the workers published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Publication {
    /// Every registration of the live processes: `(key, JSON document, lease)`.
    Register(Vec<(String, serde_bytes::ByteBuf, u64)>),
    /// Event-plane messages.
    Events(Vec<EventMessage>),
}

/// One event-plane message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventMessage {
    /// The subject's endpoint (`ns/component/endpoint`).
    pub endpoint: String,
    /// `kv-events` or `kv_metrics`.
    pub topic: String,
    /// The envelope bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// One item of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Item {
    /// A discovery watch change.
    Change(Change),
    /// An event-plane message.
    Event(EventMessage),
}

/// A frame from the planes host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToRelay {
    /// A complete listing at `revision`.
    Listing {
        /// The store's revision.
        revision: u64,
        /// Every key and value.
        entries: Vec<(String, serde_bytes::ByteBuf)>,
    },
    /// Published items, in order.
    Batch(Vec<Item>),
    /// The answer to query `id`.
    Answer {
        /// The query's id.
        id: u64,
        /// The worker's response stream as (header, body) parts, or why there is none.
        result: Result<Vec<(serde_bytes::ByteBuf, serde_bytes::ByteBuf)>, String>,
    },
    /// The answer to a ping.
    Pong,
    /// Nothing happened for a while; the connection lives.
    Heartbeat,
}

/// Encode a frame body (the codec adds the length prefix).
///
/// # Errors
/// When MessagePack refuses the value (it never does for these types).
pub fn encode<T: Serialize>(frame: &T) -> Result<Bytes, rmp_serde::encode::Error> {
    encode_with(frame, &mut BytesMut::new())
}

/// [`encode`] into `buffer`'s allocation, which the next call reuses once the returned body is
/// dropped (frames of a busy DC are tens of KiB; growing a fresh buffer for each cost page
/// faults).
///
/// # Errors
/// When MessagePack refuses the value (it never does for these types).
pub fn encode_with<T: Serialize>(
    frame: &T,
    buffer: &mut BytesMut,
) -> Result<Bytes, rmp_serde::encode::Error> {
    buffer.clear();
    rmp_serde::encode::write(&mut (&mut *buffer).writer(), frame)?;
    Ok(buffer.split().freeze())
}

/// Decode a frame body.
///
/// # Errors
/// Malformed bytes.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, rmp_serde::decode::Error> {
    rmp_serde::from_slice(body)
}

#[cfg(test)]
mod tests {
    use tokio_util::codec::{Decoder, Encoder};

    use super::*;

    #[test]
    fn frames_round_trip_through_the_length_prefixed_codec() {
        let frame = ToRelay::Batch(vec![
            Item::Change(Change {
                revision: 3,
                key: "v1/mdc/a".into(),
                value: Some(b"{}".to_vec()),
            }),
            Item::Change(Change { revision: 4, key: "v1/mdc/b".into(), value: None }),
            Item::Event(EventMessage {
                endpoint: "a/b/c".into(),
                topic: "kv-events".into(),
                bytes: vec![1, 2, 3],
            }),
        ]);
        let mut wire = BytesMut::new();
        codec().encode(encode(&frame).unwrap(), &mut wire).unwrap();
        assert_eq!(&wire[..4], &u32::try_from(wire.len() - 4).unwrap().to_be_bytes());
        let body = codec().decode(&mut wire).unwrap().unwrap();
        assert_eq!(decode::<ToRelay>(&body).unwrap(), frame);
        assert!(decode::<ToRelay>(&[0xc1]).is_err());
    }

    #[test]
    fn an_oversized_length_is_refused_before_allocation() {
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&u32::try_from(FRAME_BYTES_MAX + 1).unwrap().to_be_bytes());
        assert!(codec().decode(&mut wire).is_err());
    }
}
