//! The consumer's per-plane views (relay-facts §3.4 scope of action, §3.6, §3.9), sans-IO.
//!
//! A WAN consumer keeps catalog, pool filters, readiness and load as independent state
//! machines. The views here take decoded messages and return what changed; the async consumer
//! only moves messages in and acts on the changes (open or drop filter subscriptions). They
//! never read a clock.
//!
//! Rules kept here:
//! - every catalog, readiness and load message is complete: a valid one replaces the previous
//!   view, even when some of its entries are quarantined, and no previous state is ever kept as
//!   a fallback for a quarantined entry;
//! - an invalid envelope, an unidentifiable entry or a repeated key invalidates the whole view
//!   of that plane (it stays empty until the next valid message);
//! - a pool absent from the catalog is withdrawn; a new producer for a known pool means its
//!   replica must be dropped and resubscribed with the new key; metadata changes under the
//!   same producer never restart a subscription;
//! - a quarantined readiness entry is never READY; a quarantined pool has no usable state;
//! - load windows move forward only: a window with a sequence at or below the current one from
//!   the same relay incarnation is stale and ignored;
//! - a filter stream accepts only frames whose relay and producer identities match the ones it
//!   was opened with.
//!
//! Bounds: each view holds at most the entries of the last message it accepted.

use std::collections::BTreeMap;

use kvrelay_proto::v1 as proto;
use thiserror::Error;

use super::errors::{PlaneError, WireError};
use super::validate::{
    FilterEnvelope, PoolLoad, PoolRef, Quarantined, validate_catalog_update,
    validate_filter_update, validate_load_update, validate_readiness_update,
};
use crate::host::PoolDescriptor;
use crate::model::identity::{PoolId, ProducerIdentity, RelayIdentity};
use crate::readiness::topology::{TopologyEntry, TopologyKey};

// ---- catalog --------------------------------------------------------------------------------

/// A pool whose producer generation changed between two catalog messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerChange {
    /// The producer whose replica must be dropped.
    pub previous: ProducerIdentity,
    /// The producer to subscribe to instead.
    pub current: ProducerIdentity,
}

/// What one accepted catalog message changed. Every list is in pool-id order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "catalog changes decide which filter subscriptions to open and drop"]
pub struct CatalogChanges {
    /// Pools that became usable (new, or previously quarantined): subscribe.
    pub added: Vec<ProducerIdentity>,
    /// Pools with a new producer: drop the old replica, subscribe to the new key.
    pub producer_changed: Vec<ProducerChange>,
    /// Pools whose descriptor metadata changed under the same producer: keep the replica.
    pub refreshed: Vec<PoolId>,
    /// Usable pools that are no longer in the catalog: drop their filter and load state.
    pub withdrawn: Vec<ProducerIdentity>,
    /// Usable pools that are now quarantined: drop their filter and load state.
    pub quarantined: Vec<ProducerIdentity>,
}

impl CatalogChanges {
    /// True if nothing changed (a repeated snapshot or heartbeat).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.producer_changed.is_empty()
            && self.refreshed.is_empty()
            && self.withdrawn.is_empty()
            && self.quarantined.is_empty()
    }

    /// Producers whose replicas must be dropped (withdrawn, quarantined, or superseded).
    pub fn to_unsubscribe(&self) -> impl Iterator<Item = &ProducerIdentity> {
        self.withdrawn
            .iter()
            .chain(&self.quarantined)
            .chain(self.producer_changed.iter().map(|change| &change.previous))
    }

    /// Producers to open a filter subscription for (added, or the new key of a changed pool).
    pub fn to_subscribe(&self) -> impl Iterator<Item = &ProducerIdentity> {
        self.added.iter().chain(self.producer_changed.iter().map(|change| &change.current))
    }
}

/// The whole catalog view was invalidated; every usable pool was dropped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("catalog plane invalidated: {error}")]
pub struct CatalogInvalidated {
    /// Why.
    #[source]
    pub error: PlaneError,
    /// The producers that were usable before: drop their filter and load state.
    pub withdrawn: Vec<ProducerIdentity>,
}

/// The consumer's view of one relay's catalog. See the module docs for the rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogView {
    relay: Option<RelayIdentity>,
    revision: Option<u64>,
    pools: BTreeMap<PoolId, PoolDescriptor>,
    quarantined: BTreeMap<PoolRef, WireError>,
}

impl CatalogView {
    /// An empty view that has seen no message.
    #[must_use]
    pub fn new() -> Self {
        CatalogView::default()
    }

    /// Apply one catalog message. A valid message replaces the view and reports what changed;
    /// an invalid one empties the view and reports the dropped producers.
    pub fn apply(
        &mut self,
        update: &proto::KvPoolCatalogUpdate,
    ) -> Result<CatalogChanges, CatalogInvalidated> {
        match validate_catalog_update(update) {
            Ok(update) => {
                let mut pools = BTreeMap::new();
                for descriptor in update.pools {
                    // Validation guarantees unique pool ids.
                    pools.insert(descriptor.pool_id(), descriptor);
                }
                let quarantined: BTreeMap<PoolRef, WireError> = update
                    .quarantined
                    .into_iter()
                    .map(|Quarantined { key, error }| (key, error))
                    .collect();
                let changes = self.diff(&pools, &quarantined);
                self.relay = Some(update.relay);
                self.revision = Some(update.revision);
                self.pools = pools;
                self.quarantined = quarantined;
                Ok(changes)
            }
            Err(error) => Err(CatalogInvalidated { error, withdrawn: self.invalidate() }),
        }
    }

    /// What replacing the current pools with `pools` / `quarantined` changes.
    fn diff(
        &self,
        pools: &BTreeMap<PoolId, PoolDescriptor>,
        quarantined: &BTreeMap<PoolRef, WireError>,
    ) -> CatalogChanges {
        let mut changes = CatalogChanges::default();
        for (pool_id, descriptor) in pools {
            match self.pools.get(pool_id) {
                None => changes.added.push(descriptor.producer),
                Some(previous) if previous.producer != descriptor.producer => {
                    changes.producer_changed.push(ProducerChange {
                        previous: previous.producer,
                        current: descriptor.producer,
                    });
                }
                Some(previous) if previous != descriptor => changes.refreshed.push(*pool_id),
                Some(_) => {}
            }
        }
        for (pool_id, previous) in &self.pools {
            if pools.contains_key(pool_id) {
                continue;
            }
            if quarantined.contains_key(&PoolRef::Known(*pool_id)) {
                changes.quarantined.push(previous.producer);
            } else {
                changes.withdrawn.push(previous.producer);
            }
        }
        changes
    }

    /// Drop the whole view (an invalid message, a stream error, an unexpected end of stream);
    /// returns the producers that were usable.
    pub fn invalidate(&mut self) -> Vec<ProducerIdentity> {
        let withdrawn = self.pools.values().map(|descriptor| descriptor.producer).collect();
        *self = CatalogView::default();
        withdrawn
    }

    /// The relay of the current view, once a valid message arrived.
    #[must_use]
    pub fn relay(&self) -> Option<RelayIdentity> {
        self.relay
    }

    /// The revision of the current view, once a valid message arrived.
    #[must_use]
    pub fn revision(&self) -> Option<u64> {
        self.revision
    }

    /// The usable descriptor of `pool_id`.
    #[must_use]
    pub fn descriptor(&self, pool_id: &PoolId) -> Option<&PoolDescriptor> {
        self.pools.get(pool_id)
    }

    /// Usable descriptors in pool-id order.
    pub fn descriptors(&self) -> impl Iterator<Item = &PoolDescriptor> {
        self.pools.values()
    }

    /// Quarantined pools of the current view, with the reason.
    pub fn quarantined(&self) -> impl Iterator<Item = (&PoolRef, &WireError)> {
        self.quarantined.iter()
    }
}

// ---- readiness ------------------------------------------------------------------------------

/// What one accepted readiness message changed. Every list is in key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "readiness changes must reach the routing view"]
pub struct ReadinessChanges {
    /// Keys with a usable entry now, and none before.
    pub added: Vec<TopologyKey>,
    /// Keys whose usable entry changed.
    pub changed: Vec<TopologyKey>,
    /// Keys absent from the message (usable or quarantined before).
    pub removed: Vec<TopologyKey>,
    /// Keys that are quarantined now and were usable (or absent) before.
    pub quarantined: Vec<TopologyKey>,
}

impl ReadinessChanges {
    /// True if nothing changed (a heartbeat, or a repeat).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.changed.is_empty()
            && self.removed.is_empty()
            && self.quarantined.is_empty()
    }
}

/// What the view knows about one `(namespace, canonical model)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadinessLookup<'a> {
    /// A usable entry (its state may be READY, UNAVAILABLE or UNKNOWN).
    Entry(&'a TopologyEntry),
    /// The entry is quarantined: neither ready nor authoritatively unavailable.
    Quarantined(&'a WireError),
    /// The relay publishes no entry for it (or the view is empty).
    Absent,
}

/// The consumer's view of one relay's serving readiness.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadinessView {
    relay: Option<RelayIdentity>,
    revision: Option<u64>,
    entries: BTreeMap<TopologyKey, TopologyEntry>,
    quarantined: BTreeMap<TopologyKey, WireError>,
}

impl ReadinessView {
    /// An empty view that has seen no message.
    #[must_use]
    pub fn new() -> Self {
        ReadinessView::default()
    }

    /// Apply one readiness message (snapshot or heartbeat). A valid message replaces the view;
    /// an invalid one empties it.
    pub fn apply(
        &mut self,
        update: &proto::ServingReadinessUpdate,
    ) -> Result<ReadinessChanges, PlaneError> {
        let update = validate_readiness_update(update).inspect_err(|_| self.invalidate())?;
        let entries: BTreeMap<TopologyKey, TopologyEntry> =
            update.entries.into_iter().map(|entry| (entry.key(), entry)).collect();
        let quarantined: BTreeMap<TopologyKey, WireError> =
            update.quarantined.into_iter().map(|Quarantined { key, error }| (key, error)).collect();
        let mut changes = ReadinessChanges::default();
        for (key, entry) in &entries {
            match self.entries.get(key) {
                None => changes.added.push(key.clone()),
                Some(previous) if previous != entry => changes.changed.push(key.clone()),
                Some(_) => {}
            }
        }
        for key in quarantined.keys() {
            if !self.quarantined.contains_key(key) {
                changes.quarantined.push(key.clone());
            }
        }
        for key in self.entries.keys().chain(self.quarantined.keys()) {
            if !entries.contains_key(key) && !quarantined.contains_key(key) {
                changes.removed.push(key.clone());
            }
        }
        changes.removed.sort();
        changes.removed.dedup();
        self.relay = Some(update.relay);
        self.revision = Some(update.revision);
        self.entries = entries;
        self.quarantined = quarantined;
        Ok(changes)
    }

    /// Drop the whole view (stream error or end; the next snapshot rebuilds it).
    pub fn invalidate(&mut self) {
        *self = ReadinessView::default();
    }

    /// The relay of the current view.
    #[must_use]
    pub fn relay(&self) -> Option<RelayIdentity> {
        self.relay
    }

    /// The revision of the current view.
    #[must_use]
    pub fn revision(&self) -> Option<u64> {
        self.revision
    }

    /// What the view knows about `canonical_model_id` in `namespace`.
    #[must_use]
    pub fn lookup(&self, namespace: &str, canonical_model_id: &str) -> ReadinessLookup<'_> {
        let key = TopologyKey {
            namespace: namespace.to_owned(),
            canonical_model_id: canonical_model_id.to_owned(),
        };
        if let Some(entry) = self.entries.get(&key) {
            return ReadinessLookup::Entry(entry);
        }
        match self.quarantined.get(&key) {
            Some(error) => ReadinessLookup::Quarantined(error),
            None => ReadinessLookup::Absent,
        }
    }

    /// Usable entries in key order.
    pub fn entries(&self) -> impl Iterator<Item = &TopologyEntry> {
        self.entries.values()
    }
}

// ---- load -----------------------------------------------------------------------------------

/// What applying a load window did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum LoadOutcome {
    /// The window replaced the view.
    Replaced {
        /// Its sequence.
        window_sequence: u64,
    },
    /// The window is not newer than the current one from the same relay; ignored.
    Stale {
        /// Its sequence.
        window_sequence: u64,
        /// The current sequence.
        current: u64,
    },
}

/// The consumer's view of one relay's pool load: the last complete window. Load gaps never
/// touch filter state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadView {
    relay: Option<RelayIdentity>,
    window_sequence: Option<u64>,
    observed_ms: u64,
    window_ms: u64,
    pools: BTreeMap<ProducerIdentity, PoolLoad>,
    quarantined: BTreeMap<PoolRef, WireError>,
}

impl LoadView {
    /// An empty view that has seen no window.
    #[must_use]
    pub fn new() -> Self {
        LoadView::default()
    }

    /// Apply one load window. A valid, newer window replaces the view; an invalid one empties
    /// it; a stale one changes nothing.
    pub fn apply(&mut self, update: &proto::KvPoolLoadUpdate) -> Result<LoadOutcome, PlaneError> {
        let update = validate_load_update(update).inspect_err(|_| self.invalidate())?;
        if self.relay == Some(update.relay)
            && let Some(current) = self.window_sequence
            && update.window_sequence <= current
        {
            return Ok(LoadOutcome::Stale { window_sequence: update.window_sequence, current });
        }
        self.relay = Some(update.relay);
        self.window_sequence = Some(update.window_sequence);
        self.observed_ms = update.observed_ms;
        self.window_ms = update.window_ms;
        self.pools = update.pools.into_iter().map(|load| (load.producer, load)).collect();
        self.quarantined =
            update.quarantined.into_iter().map(|Quarantined { key, error }| (key, error)).collect();
        Ok(LoadOutcome::Replaced { window_sequence: update.window_sequence })
    }

    /// Drop the whole view (stream error or end; the next window rebuilds it).
    pub fn invalidate(&mut self) {
        *self = LoadView::default();
    }

    /// The sequence of the current window.
    #[must_use]
    pub fn window_sequence(&self) -> Option<u64> {
        self.window_sequence
    }

    /// The producer's wall clock when the current window was cut (diagnostic only).
    #[must_use]
    pub fn observed_ms(&self) -> u64 {
        self.observed_ms
    }

    /// The relay's window interval.
    #[must_use]
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// The load of exactly `producer` (the generation the catalog currently advertises).
    #[must_use]
    pub fn load(&self, producer: &ProducerIdentity) -> Option<&PoolLoad> {
        self.pools.get(producer)
    }

    /// Whether the current window quarantined an entry of `pool`.
    #[must_use]
    pub fn is_quarantined(&self, pool: &PoolRef) -> bool {
        self.quarantined.contains_key(pool)
    }
}

// ---- filter stream --------------------------------------------------------------------------

/// Why a pool stream's frame cannot be applied; the replica must be dropped and the stream
/// closed (other pools are unaffected).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FilterStreamFault {
    /// The envelope failed validation.
    #[error("invalid filter update: {0}")]
    Wire(#[from] WireError),
    /// The frame names another producer than the one subscribed to.
    #[error("frame producer differs from the subscribed producer")]
    ProducerDrift {
        /// The subscribed producer.
        expected: Box<ProducerIdentity>,
        /// The producer in the frame.
        found: Box<ProducerIdentity>,
    },
    /// The frame comes from another relay than the stream's first frame.
    #[error("frame relay {found:?} differs from stream relay {expected:?}")]
    RelayDrift {
        /// The stream's relay.
        expected: RelayIdentity,
        /// The frame's relay.
        found: RelayIdentity,
    },
}

/// Guards one `SubscribeKvPool` stream: every frame must validate and name the subscribed
/// producer and the relay of the stream's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterStreamGuard {
    expected: ProducerIdentity,
    relay: Option<RelayIdentity>,
}

impl FilterStreamGuard {
    /// A guard for a stream opened with `expected_producer`.
    #[must_use]
    pub fn new(expected_producer: ProducerIdentity) -> Self {
        FilterStreamGuard { expected: expected_producer, relay: None }
    }

    /// The subscribed producer.
    #[must_use]
    pub fn expected_producer(&self) -> &ProducerIdentity {
        &self.expected
    }

    /// Check one frame; on success its [`crate::filter::FilterFrame`] goes to the replica.
    pub fn check<'a>(
        &mut self,
        update: &'a proto::FilterUpdate,
    ) -> Result<FilterEnvelope<'a>, FilterStreamFault> {
        let envelope = validate_filter_update(update)?;
        if envelope.producer != self.expected {
            return Err(FilterStreamFault::ProducerDrift {
                expected: Box::new(self.expected),
                found: Box::new(envelope.producer),
            });
        }
        match self.relay {
            Some(relay) if relay != envelope.relay => {
                return Err(FilterStreamFault::RelayDrift {
                    expected: relay,
                    found: envelope.relay,
                });
            }
            Some(_) => {}
            None => self.relay = Some(envelope.relay),
        }
        Ok(envelope)
    }
}
