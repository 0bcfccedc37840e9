//! The consumer's state, sans-IO: one value that the async shell ([`super::client`]) feeds with
//! decoded messages and stream ends, and that answers snapshots and queries.
//!
//! It holds the four independent planes of one relay (relay-facts §3.9): the catalog view, one
//! slot per catalogued pool (descriptor, filter status and — only after a complete, validated
//! snapshot — its replica), the readiness view and the load view. Invariants:
//! - a pool slot exists exactly for each usable pool of the current catalog view, keyed by pool
//!   id and holding that pool's current producer; reconciling after every catalog message
//!   returns which filter subscriptions to stop and which to start;
//! - a replica is installed only from a complete snapshot of the slot's own producer, and a
//!   frame for another producer (a task that the catalog already superseded) never touches the
//!   slot;
//! - a fault on one pool's stream drops that pool's replica only; a catalog, readiness or load
//!   fault never touches a filter replica (load gaps never invalidate CKF state);
//! - load is reported only for producers the catalog currently advertises, so withdrawing a
//!   pool drops its load as well as its replica;
//! - every fault is counted by plane and kind; nothing here panics on any input.
//!
//! Bounds: the state holds at most the entries of the last message accepted on each plane and
//! one replica per catalogued pool.

use std::collections::BTreeMap;

use kvrelay_proto::v1 as proto;

use super::policy::{FaultKind, Plane};
use super::query::{self, QueryAnswer, QueryPool};
use kvrelay_core::filter::cbi1;
use kvrelay_core::filter::ckf::CkfFormat;
use kvrelay_core::filter::{FilterFrame, FilterReplica, ReplicaFault, ReplicaProgress};
use kvrelay_core::host::PoolDescriptor;
use kvrelay_core::model::identity::{PoolId, ProducerIdentity, RelayIdentity};
use kvrelay_core::readiness::topology::TopologyEntry;
use kvrelay_core::wire::{
    CatalogView, LoadOutcome, LoadView, PlaneError, PoolLoad, PoolRef, Quarantined, ReadinessView,
    WireError,
};

/// Fingerprint slots per bucket word.
const SLOTS_PER_WORD: u32 = 4;

/// Occupied (nonzero) 16-bit fingerprint slots of one bucket word.
fn occupied_slots(word: u64) -> u64 {
    (0..SLOTS_PER_WORD).filter(|slot| (word >> (16 * slot)) & 0xFFFF != 0).count() as u64
}

/// A ready replica with its occupied-slot count kept current delta by delta.
#[derive(Debug)]
struct TrackedReplica {
    replica: FilterReplica,
    format: CkfFormat,
    dc_id: u64,
    resident_slots: u64,
}

impl TrackedReplica {
    /// Wrap a replica that just installed its snapshot.
    fn installed(replica: FilterReplica, format: CkfFormat, dc_id: u64) -> Self {
        let resident_slots =
            replica.words().map_or(0, |words| words.iter().copied().map(occupied_slots).sum());
        TrackedReplica { replica, format, dc_id, resident_slots }
    }

    /// Accept one frame, adjusting the slot count by the buckets a delta rewrote.
    fn accept(&mut self, frame: FilterFrame<'_>) -> Result<ReplicaProgress, ReplicaFault> {
        // The buckets a delta touches and their occupancy before it. The replica decodes and
        // validates the frame again and rejects it as a whole; this is only bookkeeping.
        let touched: Vec<(usize, u64)> = match (frame, self.replica.words()) {
            (FilterFrame::Delta { payload, .. }, Some(words)) => {
                match cbi1::decode_for_pool(payload, &self.format, self.dc_id) {
                    Ok(cbi1::Frame::Delta(delta)) => delta
                        .images()
                        .filter_map(|image| {
                            let bucket = image.bucket as usize;
                            words.get(bucket).map(|&word| (bucket, occupied_slots(word)))
                        })
                        .collect(),
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        };
        let progress = self.replica.accept(frame)?;
        if let (ReplicaProgress::Applied { .. }, Some(words)) = (progress, self.replica.words()) {
            // The replica refuses a delta naming a bucket twice, so each bucket counts once.
            for (bucket, before) in touched {
                let after = words.get(bucket).copied().map_or(0, occupied_slots);
                self.resident_slots = self.resident_slots.saturating_sub(before) + after;
            }
        }
        Ok(progress)
    }
}

/// Where one pool's filter subscription stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FilterStatus {
    /// A `SubscribeKvPool` request is in flight.
    Connecting,
    /// The stream is open; the snapshot is not complete yet (no replica).
    Assembling,
    /// A replica is installed and following deltas.
    Ready,
    /// The stream ended; waiting out a backoff delay before reopening.
    Backoff,
    /// The relay named the producer stale or unknown; waiting for the catalog.
    AwaitingCatalog,
    /// This producer will not be retried (fenced, unsupported, or refused); waiting for the
    /// catalog to replace or withdraw it.
    Stopped,
}

impl FilterStatus {
    /// Lowercase name for diagnostics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            FilterStatus::Connecting => "connecting",
            FilterStatus::Assembling => "assembling",
            FilterStatus::Ready => "ready",
            FilterStatus::Backoff => "backoff",
            FilterStatus::AwaitingCatalog => "awaiting-catalog",
            FilterStatus::Stopped => "stopped",
        }
    }
}

/// Where a catalog, readiness or load stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum PlaneStatus {
    /// Not opened yet, or a request is in flight.
    #[default]
    Connecting,
    /// The stream is open.
    Streaming,
    /// The stream ended; waiting out a backoff delay before reopening.
    Backoff,
    /// The plane stopped for good (a fault retrying cannot fix, or the consumer halted).
    Stopped,
}

impl PlaneStatus {
    /// Lowercase name for diagnostics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            PlaneStatus::Connecting => "connecting",
            PlaneStatus::Streaming => "streaming",
            PlaneStatus::Backoff => "backoff",
            PlaneStatus::Stopped => "stopped",
        }
    }
}

/// Monotonic counters of the consumer's life. They only ever grow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerCounters {
    /// `SubscribeKvPool` streams the relay accepted.
    pub subscriptions: u64,
    /// Subscription attempts that followed an earlier attempt for the same producer.
    pub resubscribes: u64,
    /// Complete snapshots installed as replicas.
    pub installs: u64,
    /// Deltas applied to replicas.
    pub deltas_applied: u64,
    /// Filter heartbeats that confirmed a replica's sequence.
    pub heartbeats_confirmed: u64,
    /// Installed replicas dropped (stream fault, producer change, withdrawal, catalog loss).
    pub replicas_dropped: u64,
    /// Catalog messages that named a new producer for a known pool.
    pub producer_changes: u64,
    /// Valid messages applied per plane (filter: frames accepted by a replica).
    pub messages: BTreeMap<Plane, u64>,
    /// Faults per plane and kind.
    pub faults: BTreeMap<(Plane, FaultKind), u64>,
}

impl ConsumerCounters {
    /// Faults of `kind` on `plane`.
    #[must_use]
    pub fn fault_count(&self, plane: Plane, kind: FaultKind) -> u64 {
        self.faults.get(&(plane, kind)).copied().unwrap_or(0)
    }

    /// All faults on `plane`.
    #[must_use]
    pub fn plane_faults(&self, plane: Plane) -> u64 {
        self.faults.iter().filter(|((at, _), _)| *at == plane).map(|(_, count)| count).sum()
    }

    /// Valid messages applied on `plane`.
    #[must_use]
    pub fn message_count(&self, plane: Plane) -> u64 {
        self.messages.get(&plane).copied().unwrap_or(0)
    }

    fn count_fault(&mut self, plane: Plane, kind: FaultKind) {
        let count = self.faults.entry((plane, kind)).or_insert(0);
        *count = count.saturating_add(1);
    }

    fn count_message(&mut self, plane: Plane) {
        let count = self.messages.entry(plane).or_insert(0);
        *count = count.saturating_add(1);
    }
}

/// Why the whole consumer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerHalt {
    /// The plane that saw it first.
    pub plane: Plane,
    /// What it saw.
    pub cause: FaultKind,
}

/// One catalogued pool as the consumer holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolReplicaState {
    /// The producer the catalog advertises (and the replica, if any, belongs to).
    pub producer: ProducerIdentity,
    /// The pool's catalog descriptor.
    pub descriptor: PoolDescriptor,
    /// Where its filter subscription stands.
    pub status: FilterStatus,
    /// The replica's sequence; `None` while no complete snapshot is installed.
    pub sequence: Option<u64>,
    /// Occupied fingerprint slots of the replica; 0 while none is installed.
    pub resident_slots: u64,
}

/// A copy of one installed replica (for oracles that compare it with the relay's filter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterCopy {
    /// The replica's producer.
    pub producer: ProducerIdentity,
    /// The replica's sequence.
    pub sequence: u64,
    /// Every bucket word.
    pub words: Vec<u64>,
}

/// Everything the consumer knows at one instant, in deterministic order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSnapshot {
    /// The relay of the current catalog view.
    pub relay: Option<RelayIdentity>,
    /// The revision of the current catalog view.
    pub catalog_revision: Option<u64>,
    /// Status of the catalog, readiness and load streams.
    pub planes: BTreeMap<Plane, PlaneStatus>,
    /// Catalogued pools in pool-id order.
    pub pools: Vec<PoolReplicaState>,
    /// Catalog entries quarantined by the current view.
    pub quarantined_pools: Vec<Quarantined<PoolRef>>,
    /// The revision of the current readiness view.
    pub readiness_revision: Option<u64>,
    /// Usable readiness entries in key order.
    pub readiness: Vec<TopologyEntry>,
    /// The sequence of the current load window.
    pub load_window: Option<u64>,
    /// Load of the catalogued producers that the current window covers, in pool-id order.
    pub load: Vec<PoolLoad>,
    /// Counters.
    pub counters: ConsumerCounters,
    /// Set once the consumer halted.
    pub halted: Option<ConsumerHalt>,
}

impl ConsumerSnapshot {
    /// The state of `pool_id`, if catalogued.
    #[must_use]
    pub fn pool(&self, pool_id: &PoolId) -> Option<&PoolReplicaState> {
        self.pools.iter().find(|pool| pool.descriptor.pool_id() == *pool_id)
    }

    /// The status of a catalog, readiness or load stream.
    #[must_use]
    pub fn plane(&self, plane: Plane) -> PlaneStatus {
        self.planes.get(&plane).copied().unwrap_or_default()
    }
}

#[derive(Debug)]
struct PoolSlot {
    descriptor: PoolDescriptor,
    status: FilterStatus,
    replica: Option<TrackedReplica>,
}

/// What one catalog message did to the filter subscriptions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "the subscriptions to stop and start must be acted on"]
pub struct CatalogStep {
    /// Producers whose filter subscription must stop (withdrawn, quarantined, superseded).
    pub stop: Vec<ProducerIdentity>,
    /// Producers to subscribe to (new pools and new producers of known pools).
    pub start: Vec<ProducerIdentity>,
    /// The message's fault, if it invalidated the catalog view.
    pub fault: Option<FaultKind>,
}

/// What a filter frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameStep {
    /// Applied, installed or confirmed.
    Accepted,
    /// The slot no longer belongs to this producer; the stream must end quietly.
    Superseded,
    /// The replica rejected the frame; the stream must end and the replica be dropped.
    Rejected,
}

/// The consumer's state for one relay; see the module docs.
#[derive(Debug, Default)]
pub struct ConsumerState {
    catalog: CatalogView,
    pools: BTreeMap<PoolId, PoolSlot>,
    readiness: ReadinessView,
    load: LoadView,
    planes: BTreeMap<Plane, PlaneStatus>,
    counters: ConsumerCounters,
    halted: Option<ConsumerHalt>,
}

/// The fault of a plane message that failed validation.
fn plane_fault(error: &PlaneError) -> FaultKind {
    if error.is_contract_mismatch() {
        FaultKind::ContractMismatch
    } else {
        FaultKind::InvalidMessage
    }
}

impl ConsumerState {
    /// Nothing known yet.
    #[must_use]
    pub fn new() -> Self {
        ConsumerState::default()
    }

    // ---- catalog ----------------------------------------------------------------------------

    /// Apply one catalog message and reconcile the pool slots with the resulting view. An
    /// invalid message empties the view (every pool is withdrawn) and reports its fault.
    pub fn apply_catalog(&mut self, update: &proto::KvPoolCatalogUpdate) -> CatalogStep {
        let fault = match self.catalog.apply(update) {
            Ok(changes) => {
                self.counters.count_message(Plane::Catalog);
                self.counters.producer_changes = self
                    .counters
                    .producer_changes
                    .saturating_add(changes.producer_changed.len() as u64);
                None
            }
            Err(invalidated) => {
                let kind = plane_fault(&invalidated.error);
                self.counters.count_fault(Plane::Catalog, kind);
                Some(kind)
            }
        };
        let (stop, start) = self.reconcile();
        CatalogStep { stop, start, fault }
    }

    /// The catalog stream ended: the view is invalid until the next complete message, so every
    /// pool is withdrawn. `fault` is the fault that ended the stream, unless already counted.
    /// Returns the producers whose subscriptions must stop.
    pub fn catalog_lost(&mut self, fault: Option<FaultKind>) -> Vec<ProducerIdentity> {
        if let Some(kind) = fault {
            self.counters.count_fault(Plane::Catalog, kind);
        }
        let _ = self.catalog.invalidate();
        let (stop, start) = self.reconcile();
        debug_assert!(start.is_empty(), "an empty catalog starts nothing");
        stop
    }

    /// Make the slots match the catalog view: drop slots of pools that left it or changed
    /// producer, refresh metadata in place, open slots for new producers.
    fn reconcile(&mut self) -> (Vec<ProducerIdentity>, Vec<ProducerIdentity>) {
        let desired: BTreeMap<PoolId, &PoolDescriptor> = self
            .catalog
            .descriptors()
            .map(|descriptor| (descriptor.pool_id(), descriptor))
            .collect();
        let mut stop = Vec::new();
        let counters = &mut self.counters;
        self.pools.retain(|pool_id, slot| {
            let current = desired
                .get(pool_id)
                .is_some_and(|descriptor| descriptor.producer == slot.descriptor.producer);
            if !current {
                stop.push(slot.descriptor.producer);
                if slot.replica.is_some() {
                    counters.replicas_dropped = counters.replicas_dropped.saturating_add(1);
                }
            }
            current
        });
        let mut start = Vec::new();
        for (pool_id, descriptor) in desired {
            match self.pools.get_mut(&pool_id) {
                // Same producer: metadata may be refreshed, the replica stays.
                Some(slot) => slot.descriptor = descriptor.clone(),
                None => {
                    start.push(descriptor.producer);
                    self.pools.insert(
                        pool_id,
                        PoolSlot {
                            descriptor: descriptor.clone(),
                            status: FilterStatus::Connecting,
                            replica: None,
                        },
                    );
                }
            }
        }
        debug_assert_eq!(self.pools.len(), self.catalog.descriptors().count());
        (stop, start)
    }

    /// Whether `producer` is still the catalogued producer of its pool.
    #[must_use]
    pub fn is_current(&self, producer: &ProducerIdentity) -> bool {
        self.slot(producer).is_some()
    }

    /// The descriptor of the catalogued producer `producer`, if current.
    #[must_use]
    pub fn descriptor(&self, producer: &ProducerIdentity) -> Option<&PoolDescriptor> {
        self.slot(producer).map(|slot| &slot.descriptor)
    }

    fn slot(&self, producer: &ProducerIdentity) -> Option<&PoolSlot> {
        self.pools.get(&producer.pool_id()).filter(|slot| slot.descriptor.producer == *producer)
    }

    fn slot_mut(&mut self, producer: &ProducerIdentity) -> Option<&mut PoolSlot> {
        self.pools.get_mut(&producer.pool_id()).filter(|slot| slot.descriptor.producer == *producer)
    }

    // ---- filters ----------------------------------------------------------------------------

    /// Set a pool's filter status; `false` if the producer is no longer current.
    pub fn set_filter_status(&mut self, producer: &ProducerIdentity, status: FilterStatus) -> bool {
        match self.slot_mut(producer) {
            Some(slot) => {
                slot.status = status;
                true
            }
            None => false,
        }
    }

    /// Count a subscription attempt that follows an earlier one for the same producer.
    pub fn count_resubscribe(&mut self) {
        self.counters.resubscribes = self.counters.resubscribes.saturating_add(1);
    }

    /// The relay accepted a subscription for `producer`; `false` if it is no longer current.
    pub fn filter_opened(&mut self, producer: &ProducerIdentity) -> bool {
        let opened = self.set_filter_status(producer, FilterStatus::Assembling);
        if opened {
            self.counters.subscriptions = self.counters.subscriptions.saturating_add(1);
        }
        opened
    }

    /// Count a snapshot chunk accepted while assembling (outside the state).
    pub fn count_filter_frame(&mut self) {
        self.counters.count_message(Plane::Filter);
    }

    /// Install a replica that completed its snapshot. Only a ready replica of the current
    /// producer is installed.
    pub fn install(&mut self, producer: &ProducerIdentity, replica: FilterReplica) -> FrameStep {
        if replica.sequence().is_none() {
            return FrameStep::Rejected;
        }
        let format = producer.format();
        let dc_id = producer.pool_id().dc_id.0;
        let Some(slot) = self.slot_mut(producer) else {
            return FrameStep::Superseded;
        };
        slot.replica = Some(TrackedReplica::installed(replica, format, dc_id));
        slot.status = FilterStatus::Ready;
        self.counters.installs = self.counters.installs.saturating_add(1);
        self.counters.count_message(Plane::Filter);
        FrameStep::Accepted
    }

    /// Apply a frame to the installed replica of `producer`.
    pub fn apply_frame(
        &mut self,
        producer: &ProducerIdentity,
        frame: FilterFrame<'_>,
    ) -> FrameStep {
        let Some(slot) = self.slot_mut(producer) else {
            return FrameStep::Superseded;
        };
        let Some(tracked) = slot.replica.as_mut() else {
            // Frames after the snapshot need an installed replica; the stream is out of step.
            return FrameStep::Rejected;
        };
        match tracked.accept(frame) {
            Ok(ReplicaProgress::Applied { .. }) => {
                self.counters.deltas_applied = self.counters.deltas_applied.saturating_add(1);
            }
            Ok(ReplicaProgress::Confirmed) => {
                self.counters.heartbeats_confirmed =
                    self.counters.heartbeats_confirmed.saturating_add(1);
            }
            // A ready replica neither assembles nor installs; the replica already reported
            // any chunk as a fault, so these arms are unreachable in practice.
            Ok(ReplicaProgress::Assembling | ReplicaProgress::Installed { .. }) => {}
            Err(_) => return FrameStep::Rejected,
        }
        self.counters.count_message(Plane::Filter);
        FrameStep::Accepted
    }

    /// A pool's stream ended: drop its replica (if still current), count `fault` (the fault
    /// that ended the stream, unless already counted) and record the status it waits in.
    pub fn filter_ended(
        &mut self,
        producer: &ProducerIdentity,
        fault: Option<FaultKind>,
        next: FilterStatus,
    ) {
        if let Some(kind) = fault {
            self.counters.count_fault(Plane::Filter, kind);
        }
        let Some(slot) = self.slot_mut(producer) else {
            return;
        };
        slot.status = next;
        if slot.replica.take().is_some() {
            self.counters.replicas_dropped = self.counters.replicas_dropped.saturating_add(1);
        }
    }

    // ---- readiness and load -----------------------------------------------------------------

    /// Apply one readiness message (a valid one replaces the view; an invalid one empties it).
    /// Returns the fault of an invalid message.
    pub fn apply_readiness(&mut self, update: &proto::ServingReadinessUpdate) -> Option<FaultKind> {
        match self.readiness.apply(update) {
            Ok(_changes) => {
                self.counters.count_message(Plane::Readiness);
                None
            }
            Err(error) => {
                let kind = plane_fault(&error);
                self.counters.count_fault(Plane::Readiness, kind);
                Some(kind)
            }
        }
    }

    /// The readiness stream ended: the view is empty until the first snapshot after reconnect.
    /// `fault` is the fault that ended the stream, unless already counted.
    pub fn readiness_lost(&mut self, fault: Option<FaultKind>) {
        if let Some(kind) = fault {
            self.counters.count_fault(Plane::Readiness, kind);
        }
        self.readiness.invalidate();
    }

    /// Apply one load window (a newer valid window replaces the view, a stale one is ignored, an
    /// invalid one empties it). Returns the fault of an invalid window.
    pub fn apply_load(&mut self, update: &proto::KvPoolLoadUpdate) -> Option<FaultKind> {
        match self.load.apply(update) {
            Ok(LoadOutcome::Replaced { .. }) => {
                self.counters.count_message(Plane::Load);
                None
            }
            Ok(LoadOutcome::Stale { .. }) => None,
            Err(error) => {
                let kind = plane_fault(&error);
                self.counters.count_fault(Plane::Load, kind);
                Some(kind)
            }
        }
    }

    /// The load stream ended: the view is empty until the next window. Filters are untouched.
    /// `fault` is the fault that ended the stream, unless already counted.
    pub fn load_lost(&mut self, fault: Option<FaultKind>) {
        if let Some(kind) = fault {
            self.counters.count_fault(Plane::Load, kind);
        }
        self.load.invalidate();
    }

    // ---- whole consumer ---------------------------------------------------------------------

    /// Record where a catalog, readiness or load stream stands.
    pub fn set_plane(&mut self, plane: Plane, status: PlaneStatus) {
        self.planes.insert(plane, status);
    }

    /// Count a fault that ended no stream (e.g. a stop decided outside the state).
    pub fn record_fault(&mut self, plane: Plane, kind: FaultKind) {
        self.counters.count_fault(plane, kind);
    }

    /// Halt the consumer; the first cause wins. Returns whether this call halted it.
    pub fn halt(&mut self, plane: Plane, cause: FaultKind) -> bool {
        if self.halted.is_some() {
            return false;
        }
        self.halted = Some(ConsumerHalt { plane, cause });
        for plane in [Plane::Catalog, Plane::Readiness, Plane::Load] {
            self.planes.insert(plane, PlaneStatus::Stopped);
        }
        for slot in self.pools.values_mut() {
            slot.status = FilterStatus::Stopped;
        }
        true
    }

    /// Why the consumer halted, if it did.
    #[must_use]
    pub fn halted(&self) -> Option<ConsumerHalt> {
        self.halted
    }

    /// Everything known, in deterministic order.
    #[must_use]
    pub fn snapshot(&self) -> ConsumerSnapshot {
        let pools = self
            .pools
            .values()
            .map(|slot| PoolReplicaState {
                producer: slot.descriptor.producer,
                descriptor: slot.descriptor.clone(),
                status: slot.status,
                sequence: slot.replica.as_ref().and_then(|tracked| tracked.replica.sequence()),
                resident_slots: slot.replica.as_ref().map_or(0, |tracked| tracked.resident_slots),
            })
            .collect();
        let load = self
            .pools
            .values()
            .filter_map(|slot| self.load.load(&slot.descriptor.producer).cloned())
            .collect();
        ConsumerSnapshot {
            relay: self.catalog.relay(),
            catalog_revision: self.catalog.revision(),
            planes: self.planes.clone(),
            pools,
            quarantined_pools: self
                .catalog
                .quarantined()
                .map(|(key, error): (&PoolRef, &WireError)| Quarantined {
                    key: key.clone(),
                    error: error.clone(),
                })
                .collect(),
            readiness_revision: self.readiness.revision(),
            readiness: self.readiness.entries().cloned().collect(),
            load_window: self.load.window_sequence(),
            load,
            counters: self.counters.clone(),
            halted: self.halted,
        }
    }

    /// Answer a prefix query against every catalogued pool (see [`query::answer`]).
    #[must_use]
    pub fn query(&self, tokens: &[u32], model: &str) -> Vec<QueryAnswer> {
        query::answer(
            self.pools.values().map(|slot| QueryPool {
                descriptor: &slot.descriptor,
                replica: slot.replica.as_ref().map(|tracked| &tracked.replica),
            }),
            tokens,
            model,
        )
    }

    /// A copy of `pool_id`'s installed replica.
    #[must_use]
    pub fn filter_copy(&self, pool_id: &PoolId) -> Option<FilterCopy> {
        let slot = self.pools.get(pool_id)?;
        let replica = &slot.replica.as_ref()?.replica;
        Some(FilterCopy {
            producer: slot.descriptor.producer,
            sequence: replica.sequence()?,
            words: replica.words()?.to_vec(),
        })
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
