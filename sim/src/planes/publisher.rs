//! The workers' side of the planes: what the simulated DC publishes, encoded as a Dynamo worker
//! would (discovery registrations as JSON documents, `kv-events` and `kv_metrics` as envelope
//! bytes by the production encoders), queued in order until host `dc` sends it to the planes
//! host in one `Publish` frame per tick.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use bytes::BytesMut;
use futures::SinkExt;
use tokio_util::codec::{FramedWrite, LengthDelimitedCodec};
use turmoil::net::TcpStream;

use kvrelay_core::inputs::{
    DcInput, EventEnvelope, InputError, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, encode_active_load,
    encode_event_envelope, encode_kv_events_payload,
};
use kvrelay_core::model::kv_events::KvCacheEventData;

use super::client::CONNECT_TIMEOUT;
use super::frame::{EventMessage, Publication, ToPlanes};
use super::records::Registration;
use super::{PLANES_HOST, PLANES_PORT};

/// Queued publications and the publisher-side counts.
#[derive(Debug, Default)]
pub struct Publisher {
    queued: Vec<Publication>,
    load_sequence: u64,
    /// `Stored` KV events published (before any fault).
    pub stored_events: u64,
    /// `Removed` KV events published (evictions; before any fault).
    pub removed_events: u64,
    /// Facts the encoders refused.
    pub encode_errors: u64,
}

impl Publisher {
    /// Queue the workers' complete registrations (the planes host writes the differences).
    pub fn register(&mut self, registrations: BTreeMap<String, Registration>) {
        let entries = registrations
            .into_iter()
            .map(|(key, r)| (key, serde_bytes::ByteBuf::from(r.value), r.lease))
            .collect();
        self.queued.push(Publication::Register(entries));
    }

    /// Queue the event-plane facts among `facts`, encoded to their wire bytes (other facts are
    /// ignored: discovery travels as registrations).
    pub fn publish(&mut self, facts: Vec<DcInput>) {
        let mut messages = Vec::new();
        for fact in facts {
            match self.encode(fact) {
                Ok(Some(message)) => messages.push(message),
                Ok(None) => {}
                Err(_) => self.encode_errors += 1,
            }
        }
        if messages.is_empty() {
            return;
        }
        if let Some(Publication::Events(last)) = self.queued.last_mut() {
            last.extend(messages);
        } else {
            self.queued.push(Publication::Events(messages));
        }
    }

    /// Everything queued, as one frame (`None` when nothing is).
    pub fn take(&mut self) -> Option<ToPlanes> {
        (!self.queued.is_empty()).then(|| ToPlanes::Publish(std::mem::take(&mut self.queued)))
    }

    fn encode(&mut self, fact: DcInput) -> Result<Option<EventMessage>, InputError> {
        match fact {
            DcInput::KvEvents(batch) => {
                for event in &batch.events {
                    match event.event.data {
                        KvCacheEventData::Stored(_) => self.stored_events += 1,
                        KvCacheEventData::Removed(_) => self.removed_events += 1,
                        KvCacheEventData::Cleared => {}
                    }
                }
                let payload = encode_kv_events_payload(&batch.events)?;
                let bytes = encode_event_envelope(&EventEnvelope {
                    publisher_id: batch.publisher_id,
                    sequence: batch.sequence,
                    published_at_ms: batch.published_at_ms,
                    topic: KV_EVENTS_TOPIC,
                    payload: &payload,
                })?;
                Ok(Some(EventMessage {
                    endpoint: batch.endpoint.to_string(),
                    topic: KV_EVENTS_TOPIC.to_owned(),
                    bytes,
                }))
            }
            DcInput::Load { endpoint, observation } => {
                let payload = encode_active_load(&observation)?;
                self.load_sequence += 1;
                let bytes = encode_event_envelope(&EventEnvelope {
                    publisher_id: observation.source.worker_id,
                    sequence: self.load_sequence,
                    published_at_ms: 0,
                    topic: KV_METRICS_TOPIC,
                    payload: &payload,
                })?;
                Ok(Some(EventMessage {
                    endpoint: endpoint.to_string(),
                    topic: KV_METRICS_TOPIC.to_owned(),
                    bytes,
                }))
            }
            _ => Ok(None),
        }
    }
}

/// Host `dc`'s connection to the planes host.
#[derive(Debug, Default)]
pub struct Link {
    writer: Option<FramedWrite<TcpStream, LengthDelimitedCodec>>,
    buffer: BytesMut,
    /// Frames that could not be sent (no connection; the link never faults in scenarios).
    pub lost_frames: u64,
}

impl Link {
    /// Send everything `publisher` queued as one frame, connecting first if needed.
    pub async fn flush(&mut self, publisher: &Mutex<Publisher>) {
        let frame = publisher.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(frame) = frame else { return };
        let Ok(body) = super::frame::encode_with(&frame, &mut self.buffer) else { return };
        if self.writer.is_none() {
            let connect = TcpStream::connect((PLANES_HOST, PLANES_PORT));
            match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
                Ok(Ok(stream)) => {
                    self.writer = Some(FramedWrite::new(stream, super::frame::codec()));
                }
                _ => {
                    self.lost_frames += 1;
                    return;
                }
            }
        }
        if let Some(writer) = self.writer.as_mut()
            && writer.send(body).await.is_err()
        {
            self.writer = None;
            self.lost_frames += 1;
        }
    }
}
