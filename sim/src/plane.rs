//! The DC planes between the simulated workers and the relay.
//!
//! Event-plane facts (`kv-events` batches and `kv_metrics` reports) travel as the bytes a
//! Dynamo worker publishes — encoded by the production encoders, decoded on the relay host by
//! the production decoders — so loss, duplication and reordering act on real messages.
//! Discovery facts travel typed and in order (an etcd watch is ordered and resumes from its
//! revision). A DC-plane partition queues discovery and drops or queues events; recovery
//! queries fail while it lasts. Messages published while no relay is attached are lost, as on a
//! NATS subject nobody subscribes to.

use std::collections::VecDeque;

use kvrelay::identity::EndpointPath;
use kvrelay::inputs::{
    DcInput, EventEnvelope, InputError, KV_EVENTS_TOPIC, KV_METRICS_TOPIC,
    decode_kv_events_message, decode_kv_metrics_message, encode_active_load, encode_event_envelope,
    encode_kv_events_payload,
};
use kvrelay::kv_events::KvCacheEventData;
use kvrelay::rng::RelayRng;
use rand_core::Rng;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::scenario::{Noise, PartitionMode};

/// One message on its way into the relay.
#[derive(Debug, Clone, PartialEq)]
pub enum PlaneMessage {
    /// A discovery fact.
    Discovery(DcInput),
    /// An event-plane message body on `endpoint`'s subject for `topic`.
    Event {
        /// The subject's endpoint.
        endpoint: EndpointPath,
        /// `kv-events` or `kv_metrics`.
        topic: &'static str,
        /// The envelope bytes.
        bytes: Vec<u8>,
    },
}

impl PlaneMessage {
    /// Decode an event-plane message with the relay's decoders (discovery passes through).
    pub fn decode(self) -> Result<DcInput, InputError> {
        match self {
            PlaneMessage::Discovery(fact) => Ok(fact),
            PlaneMessage::Event { endpoint, topic, bytes } if topic == KV_EVENTS_TOPIC => {
                decode_kv_events_message(endpoint, &bytes).map(DcInput::KvEvents)
            }
            PlaneMessage::Event { endpoint, bytes, .. } => decode_kv_metrics_message(&bytes)
                .map(|observation| DcInput::Load { endpoint, observation }),
        }
    }
}

/// What the planes did to messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PlaneCounters {
    /// Messages handed to the relay.
    pub delivered: u64,
    /// Event messages lost to noise.
    pub lost: u64,
    /// Event messages delivered twice.
    pub duplicated: u64,
    /// Event messages held back behind a later one.
    pub reordered: u64,
    /// Event messages dropped by a partition.
    pub partition_dropped: u64,
    /// Messages published while no relay was attached.
    pub unattached: u64,
    /// Facts the encoders refused.
    pub encode_errors: u64,
    /// `Stored` KV events published (before any fault).
    pub stored_events: u64,
}

/// The planes' state, shared by the DC driver (publisher) and the relay host (subscriber).
#[derive(Debug)]
pub struct DcPlane {
    relay: Option<mpsc::UnboundedSender<PlaneMessage>>,
    partition: Option<PartitionMode>,
    queued: VecDeque<PlaneMessage>,
    noise: Noise,
    held: Option<PlaneMessage>,
    rng: RelayRng,
    load_sequence: u64,
    /// What happened so far.
    pub counters: PlaneCounters,
}

impl DcPlane {
    /// Planes with no relay attached; `rng` draws the noise.
    #[must_use]
    pub fn new(rng: RelayRng) -> Self {
        DcPlane {
            relay: None,
            partition: None,
            queued: VecDeque::new(),
            noise: Noise::default(),
            held: None,
            rng,
            load_sequence: 0,
            counters: PlaneCounters::default(),
        }
    }

    /// A (re)booted relay subscribes: it first receives `listing` (the discovery listing), then
    /// whatever is published from now on. Messages queued for a previous subscription are
    /// dropped; during a partition the listing itself waits for the repair.
    pub fn attach(&mut self, listing: Vec<DcInput>) -> mpsc::UnboundedReceiver<PlaneMessage> {
        let (sender, receiver) = mpsc::unbounded_channel();
        self.relay = Some(sender);
        self.held = None;
        self.queued.clear();
        for fact in listing {
            self.route(PlaneMessage::Discovery(fact));
        }
        receiver
    }

    /// Whether the relay is cut off from its DC planes.
    #[must_use]
    pub fn partitioned(&self) -> bool {
        self.partition.is_some()
    }

    /// Start a partition.
    pub fn partition(&mut self, mode: PartitionMode) {
        self.partition = Some(mode);
    }

    /// End the partition: queued messages are delivered in order.
    pub fn repair(&mut self) {
        self.partition = None;
        while let Some(message) = self.queued.pop_front() {
            self.send(message);
        }
    }

    /// Set the event-plane noise.
    pub fn set_noise(&mut self, noise: Noise) {
        self.noise = noise;
        if noise.is_quiet()
            && let Some(held) = self.held.take()
        {
            self.send(held);
        }
    }

    /// Publish `facts` as a DC would: events encoded to their wire bytes.
    pub fn publish(&mut self, facts: Vec<DcInput>) {
        for fact in facts {
            match self.encode(fact) {
                Ok(message) => self.route(message),
                Err(_) => self.counters.encode_errors += 1,
            }
        }
    }

    fn encode(&mut self, fact: DcInput) -> Result<PlaneMessage, InputError> {
        match fact {
            DcInput::KvEvents(batch) => {
                self.counters.stored_events += batch
                    .events
                    .iter()
                    .filter(|event| matches!(event.event.data, KvCacheEventData::Stored(_)))
                    .count() as u64;
                let payload = encode_kv_events_payload(&batch.events)?;
                let bytes = encode_event_envelope(&EventEnvelope {
                    publisher_id: batch.publisher_id,
                    sequence: batch.sequence,
                    published_at_ms: batch.published_at_ms,
                    topic: KV_EVENTS_TOPIC,
                    payload: &payload,
                })?;
                Ok(PlaneMessage::Event { endpoint: batch.endpoint, topic: KV_EVENTS_TOPIC, bytes })
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
                Ok(PlaneMessage::Event { endpoint, topic: KV_METRICS_TOPIC, bytes })
            }
            other => Ok(PlaneMessage::Discovery(other)),
        }
    }

    fn chance(&mut self, probability: f64) -> bool {
        probability > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < probability
    }

    fn route(&mut self, message: PlaneMessage) {
        let is_event = matches!(message, PlaneMessage::Event { .. });
        match self.partition {
            Some(PartitionMode::Drop) if is_event => {
                self.counters.partition_dropped += 1;
                return;
            }
            Some(_) => {
                self.queued.push_back(message);
                return;
            }
            None => {}
        }
        if !is_event {
            self.send(message);
            return;
        }
        if self.chance(self.noise.loss) {
            self.counters.lost += 1;
            return;
        }
        if self.chance(self.noise.duplicate) {
            self.counters.duplicated += 1;
            self.send(message.clone());
        }
        if self.held.is_none() && self.chance(self.noise.reorder) {
            self.counters.reordered += 1;
            self.held = Some(message);
            return;
        }
        self.send(message);
        if let Some(held) = self.held.take() {
            self.send(held);
        }
    }

    fn send(&mut self, message: PlaneMessage) {
        let sent = self.relay.as_ref().is_some_and(|relay| relay.send(message).is_ok());
        if sent {
            self.counters.delivered += 1;
        } else {
            self.relay = None;
            self.counters.unattached += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use kvrelay::rng::rng_from_seed;
    use kvrelay::workload::{Deployment, SimulatedDc, TrafficConfig};

    use super::*;

    fn dc() -> (SimulatedDc, RelayRng) {
        let mut rng = rng_from_seed(5);
        (SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng), rng)
    }

    fn drain(receiver: &mut mpsc::UnboundedReceiver<PlaneMessage>) -> Vec<DcInput> {
        let mut out = Vec::new();
        while let Ok(message) = receiver.try_recv() {
            out.push(message.decode().expect("the relay's decoders accept it"));
        }
        out
    }

    #[test]
    fn quiet_planes_deliver_exactly_what_was_published() {
        let (mut dc, mut rng) = dc();
        let mut plane = DcPlane::new(rng_from_seed(1));
        let mut relay = plane.attach(dc.discovery_facts());
        let mut published = dc.discovery_facts();
        let step = dc.step(20, &mut rng);
        published.extend(step.clone());
        published.extend(dc.load_facts());
        plane.publish(step);
        plane.publish(dc.load_facts());
        assert_eq!(drain(&mut relay), published);
    }

    #[test]
    fn noise_loses_duplicates_and_reorders_events_but_never_discovery() {
        let (mut dc, mut rng) = dc();
        let mut plane = DcPlane::new(rng_from_seed(2));
        let mut relay = plane.attach(Vec::new());
        plane.set_noise(Noise { loss: 0.2, duplicate: 0.2, reorder: 0.2 });
        let mut events = 0;
        for _ in 0..50 {
            let step = dc.step(8, &mut rng);
            events += step.len() as u64;
            plane.publish(step);
        }
        plane.publish(dc.discovery_facts());
        plane.set_noise(Noise::default());
        let delivered = drain(&mut relay);
        let c = plane.counters;
        assert!(c.lost > 0 && c.duplicated > 0 && c.reordered > 0, "{c:?}");
        let kv = delivered.iter().filter(|f| matches!(f, DcInput::KvEvents(_))).count() as u64;
        assert_eq!(kv, events - c.lost + c.duplicated);
        assert_eq!(delivered.len() as u64 - kv, dc.discovery_facts().len() as u64);
    }

    #[test]
    fn a_dropping_partition_loses_events_and_queues_discovery() {
        let (mut dc, mut rng) = dc();
        let mut plane = DcPlane::new(rng_from_seed(3));
        let mut relay = plane.attach(Vec::new());
        plane.partition(PartitionMode::Drop);
        plane.publish(dc.step(8, &mut rng));
        plane.publish(dc.restart_worker(0, &mut rng));
        assert!(drain(&mut relay).is_empty());
        plane.repair();
        let delivered = drain(&mut relay);
        assert!(!delivered.is_empty());
        assert!(delivered.iter().all(|f| !matches!(f, DcInput::KvEvents(_))));
        assert!(plane.counters.partition_dropped > 0);
    }
}
