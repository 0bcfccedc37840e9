//! The simulated DC planes, served by the `planes` turmoil host to the relay host over turmoil
//! TCP, so a relay↔planes partition or stall is a real turmoil partition or hold.
//!
//! - **Discovery** ([`store`], [`records`]): the planes host keeps the DC's registrations as
//!   the key/value JSON documents a Dynamo worker writes (model cards, endpoint instances, KV
//!   event sources), each under its worker's lease, with a revision and a bounded watch
//!   history. A lease whose owner stops its keep-alives expires after [`LEASE_TTL`] and takes
//!   its keys with it. The relay host lists, then watches from its revision, feeding the
//!   production [`RecordDiffer`](kvrelay::discovery_plane::RecordDiffer); after a broken
//!   connection it resumes from the last applied revision, or relists when that was compacted.
//! - **Event plane** ([`publisher`], [`Planes::apply`]): `kv-events` batches and `kv_metrics` reports are
//!   encoded by the production encoders into the envelope bytes a worker publishes, pass the
//!   scripted noise (loss, duplication, reordering) and are forwarded to the subscribed relay
//!   connection, where the production decoders read them. Messages published while no relay is
//!   subscribed are lost, as on a NATS subject nobody subscribes to.
//! - **Request plane**: recovery queries travel to the planes host, which answers them from the
//!   simulated workers.
//!
//! The wire protocol is in [`frame`], the planes host's connections in [`server`], the relay
//! host's side in [`client`], the workers' side in [`publisher`]: host `dc` sends what the
//! workers publish (registrations, event-plane messages; the scripted faults' too) to the planes
//! host over its own turmoil TCP connection, one frame per tick. Lease keep-alives and their
//! expiry act on the planes host's state in process.

pub mod client;
pub mod frame;
pub mod publisher;
pub mod records;
pub mod server;
pub mod store;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvrelay_core::inputs::{
    DcInput, InputError, KV_EVENTS_TOPIC, decode_kv_events_message, decode_kv_metrics_message,
};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::rng::RelayRng;
use rand_core::Rng;
use serde::Serialize;
use tokio::sync::Notify;

use crate::scenario::{Fault, Noise, PartitionMode};
use frame::{EventMessage, Item, Publication, ToRelay};
use records::Registration;
use store::{Resume, Store};

/// The planes host's name on turmoil's network.
pub const PLANES_HOST: &str = "planes";
/// The port the planes host serves all three planes on.
pub const PLANES_PORT: u16 = 7100;
/// How long a discovery lease lives without keep-alives (Dynamo's etcd leases live 10 s; the
/// simulation scales it down so an expiry settles within a scenario's fault window).
pub const LEASE_TTL: Duration = Duration::from_secs(1);

/// What the planes did to messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PlaneCounters {
    /// Items (watch changes, event messages) handed to the relay's connection.
    pub delivered: u64,
    /// Event messages lost to noise.
    pub lost: u64,
    /// Event messages delivered twice.
    pub duplicated: u64,
    /// Event messages held back behind a later one.
    pub reordered: u64,
    /// Event messages written while the relay↔planes link dropped everything.
    pub partition_dropped: u64,
    /// Event messages that reached the planes host while no relay was subscribed.
    pub unattached: u64,
    /// Facts the encoders refused (counted by the publisher).
    pub encode_errors: u64,
    /// `Stored` KV events published, before any fault (counted by the publisher).
    pub stored_events: u64,
    /// `Removed` KV events (evictions) published, before any fault (counted by the publisher).
    pub removed_events: u64,
}

/// The subscribed relay connection and what waits to be written to it.
#[derive(Debug)]
struct Subscriber {
    connection: u64,
    outbox: Vec<Item>,
    notify: Arc<Notify>,
}

/// The planes host's state, shared by the workers (publishers) and the host's connections.
#[derive(Debug)]
pub struct Planes {
    store: Store,
    subscriber: Option<Subscriber>,
    link: Option<PartitionMode>,
    noise: Noise,
    held: Option<EventMessage>,
    rng: RelayRng,
    next_connection: u64,
    /// Server restarts so far: a relay connection accepted before the latest one is closed.
    epoch: u64,
    /// What happened so far.
    pub counters: PlaneCounters,
}

impl Planes {
    /// Empty planes; `rng` draws the noise.
    #[must_use]
    pub fn new(rng: RelayRng) -> Self {
        Planes {
            store: Store::default(),
            subscriber: None,
            link: None,
            noise: Noise::default(),
            held: None,
            rng,
            next_connection: 0,
            epoch: 0,
            counters: PlaneCounters::default(),
        }
    }

    /// The discovery store's revision.
    #[must_use]
    pub fn revision(&self) -> u64 {
        self.store.revision()
    }

    /// Server restarts so far.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The servers restart: every relay connection accepted before drops (the subscription
    /// with it: what is published until the relay subscribes again is lost), and with
    /// `compact` the discovery store forgets its watch history. Keys and leases persist.
    pub fn restart(&mut self, compact: bool) {
        self.epoch += 1;
        self.subscriber = None;
        self.held = None;
        if compact {
            self.store.compact();
        }
    }

    /// A fresh connection id.
    pub fn connection_id(&mut self) -> u64 {
        self.next_connection += 1;
        self.next_connection
    }

    /// Connection `connection` subscribes after discovery revision `after` (`None`: list). It
    /// replaces any earlier subscriber (one relay per DC). Returns the first frame to write and
    /// the notification that more items wait.
    pub fn subscribe(&mut self, connection: u64, after: Option<u64>) -> (ToRelay, Arc<Notify>) {
        let first = match after.map(|revision| self.store.since(revision)) {
            Some(Resume::Changes(changes)) => {
                self.counters.delivered += changes.len() as u64;
                ToRelay::Batch(changes.into_iter().map(Item::Change).collect())
            }
            None | Some(Resume::Compacted) => ToRelay::Listing {
                revision: self.store.revision(),
                entries: self
                    .store
                    .listing()
                    .into_iter()
                    .map(|(key, value)| (key, serde_bytes::ByteBuf::from(value)))
                    .collect(),
            },
        };
        let notify = Arc::new(Notify::new());
        self.subscriber =
            Some(Subscriber { connection, outbox: Vec::new(), notify: Arc::clone(&notify) });
        self.held = None;
        (first, notify)
    }

    /// What waits for `connection`, if it is still the subscriber.
    pub fn take_outbox(&mut self, connection: u64) -> Option<Vec<Item>> {
        self.subscriber
            .as_mut()
            .filter(|subscriber| subscriber.connection == connection)
            .map(|subscriber| std::mem::take(&mut subscriber.outbox))
    }

    /// Connection `connection` is gone.
    pub fn detach(&mut self, connection: u64) {
        if self.subscriber.as_ref().is_some_and(|s| s.connection == connection) {
            self.subscriber = None;
        }
    }

    /// What the relay↔planes link does now (for the counters only: the planes host writes
    /// regardless, and turmoil drops or holds).
    pub fn set_link(&mut self, link: Option<PartitionMode>) {
        self.link = link;
    }

    /// Whether the relay↔planes link is cut or stalled.
    #[must_use]
    pub fn partitioned(&self) -> bool {
        self.link.is_some()
    }

    /// Set the event-plane noise.
    pub fn set_noise(&mut self, noise: Noise) {
        self.noise = noise;
        if noise.is_quiet()
            && let Some(held) = self.held.take()
        {
            self.send(Item::Event(held));
        }
    }

    /// The workers' registrations are now `desired`: write the differences (at `now_ms`).
    pub fn register(&mut self, desired: &BTreeMap<String, Registration>, now_ms: u64) {
        for change in self.store.sync(desired, now_ms, LEASE_TTL) {
            self.send(Item::Change(change));
        }
    }

    /// Lease `lease` may be written under again after it expired (its owner registers anew).
    pub fn grant(&mut self, lease: u64) {
        self.store.grant(lease);
    }

    /// Lease `lease`'s owner stops (`false`) or resumes (`true`) its keep-alives.
    pub fn set_keepalive(&mut self, lease: u64, alive: bool) {
        self.store.set_keepalive(lease, alive);
    }

    /// Run the leases at `now_ms`: returns the leases that expired (their keys are gone).
    pub fn tick(&mut self, now_ms: u64) -> Vec<u64> {
        let (expired, changes) = self.store.tick(now_ms, LEASE_TTL);
        for change in changes {
            self.send(Item::Change(change));
        }
        expired
    }

    /// Apply what the workers published, in order: registrations written to the store (at
    /// `now_ms`), event-plane messages forwarded.
    pub fn apply(&mut self, publications: Vec<Publication>, now_ms: u64) {
        for publication in publications {
            match publication {
                Publication::Register(entries) => {
                    let desired = entries
                        .into_iter()
                        .map(|(key, value, lease)| {
                            (key, Registration { value: value.into_vec(), lease })
                        })
                        .collect();
                    self.register(&desired, now_ms);
                }
                Publication::Events(messages) => {
                    for message in messages {
                        self.route(message);
                    }
                }
            }
        }
    }

    fn chance(&mut self, probability: f64) -> bool {
        probability > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < probability
    }

    fn route(&mut self, message: EventMessage) {
        if self.subscriber.is_none() {
            self.counters.unattached += 1;
            return;
        }
        if self.chance(self.noise.loss) {
            self.counters.lost += 1;
            return;
        }
        if self.chance(self.noise.duplicate) {
            self.counters.duplicated += 1;
            self.send(Item::Event(message.clone()));
        }
        if self.held.is_none() && self.chance(self.noise.reorder) {
            self.counters.reordered += 1;
            self.held = Some(message);
            return;
        }
        self.send(Item::Event(message));
        if let Some(held) = self.held.take() {
            self.send(Item::Event(held));
        }
    }

    fn send(&mut self, item: Item) {
        let Some(subscriber) = self.subscriber.as_mut() else {
            if matches!(item, Item::Event(_)) {
                self.counters.unattached += 1;
            }
            return;
        };
        match (&item, self.link) {
            (Item::Event(_), Some(PartitionMode::Drop)) => self.counters.partition_dropped += 1,
            _ => self.counters.delivered += 1,
        }
        subscriber.outbox.push(item);
        subscriber.notify.notify_one();
    }
}

/// What the planes did, with what the workers' publisher counted.
#[must_use]
pub fn counters(planes: &Mutex<Planes>, publisher: &Mutex<publisher::Publisher>) -> PlaneCounters {
    let publisher = publisher.lock().unwrap_or_else(PoisonError::into_inner);
    PlaneCounters {
        stored_events: publisher.stored_events,
        removed_events: publisher.removed_events,
        encode_errors: publisher.encode_errors,
        ..planes.lock().unwrap_or_else(PoisonError::into_inner).counters
    }
}

/// Whether `fact` travels on the event plane (everything else is discovery).
#[must_use]
pub fn is_event_plane(fact: &DcInput) -> bool {
    matches!(fact, DcInput::KvEvents(_) | DcInput::Load { .. })
}

/// Apply a DC-plane fault between host `relay` and the planes host: `dc-partition` cuts
/// (turmoil partition) or stalls (turmoil hold) the link, `dc-repair` restores it,
/// `event-noise` sets the noise, `event-plane-restart` and `discovery-restart` restart the
/// planes host's servers ([`Planes::restart`]). Returns whether `fault` was one of these.
pub fn apply_fault(planes: &Mutex<Planes>, relay: &str, fault: &Fault) -> bool {
    let mut planes = planes.lock().unwrap_or_else(PoisonError::into_inner);
    match fault {
        Fault::DcPartition { mode } => {
            match mode {
                PartitionMode::Drop => turmoil::partition(relay, PLANES_HOST),
                PartitionMode::Stall => turmoil::hold(relay, PLANES_HOST),
            }
            planes.set_link(Some(*mode));
        }
        Fault::DcRepair => {
            turmoil::repair(relay, PLANES_HOST);
            turmoil::release(relay, PLANES_HOST);
            planes.set_link(None);
        }
        Fault::EventNoise(noise) => planes.set_noise(*noise),
        Fault::EventPlaneRestart => planes.restart(false),
        Fault::DiscoveryRestart => planes.restart(true),
        _ => return false,
    }
    true
}

/// Decode one event-plane message with the relay's decoders.
///
/// # Errors
/// What the decoders refuse (an unparseable endpoint included).
pub fn decode_event(message: &EventMessage) -> Result<DcInput, InputError> {
    let endpoint: EndpointPath = message.endpoint.parse().map_err(|_| {
        InputError::InvalidField { field: "subject", reason: "not an endpoint path" }
    })?;
    if message.topic == KV_EVENTS_TOPIC {
        decode_kv_events_message(endpoint, &message.bytes).map(DcInput::KvEvents)
    } else {
        decode_kv_metrics_message(&message.bytes)
            .map(|observation| DcInput::Load { endpoint, observation })
    }
}
