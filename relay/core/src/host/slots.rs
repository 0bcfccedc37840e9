//! The endpoint host: one slot per serving endpoint that materializes, refreshes and retires
//! its pool, as a sans-IO state machine (relay-facts §9.5, §9.6, §8.5).
//!
//! The async shell feeds values in and executes the [`HostCommand`]s that come out, **in the
//! order given, each finished before the next starts** (in particular a `StopPool` completes
//! before the following `ReleasePool` or `StartPool`). Inputs:
//!
//! - [`EndpointHost::reconcile`]: the current discovery memberships and, per serving endpoint,
//!   the KV source facts the host needs ([`SourceBinding`]);
//! - [`EndpointHost::start_succeeded`] / [`EndpointHost::start_failed`]: the outcome of a
//!   `StartPool` (every `StartPool` gets exactly one of the two);
//! - [`EndpointHost::fence_generation`]: a terminal publication failure of a generation;
//! - [`EndpointHost::report_pool_fault`] / [`EndpointHost::source_recovery_finished`]: pool
//!   faults and the outcome of the rank-level recovery calls the host asked for;
//! - [`EndpointHost::handle_timeout`] when [`EndpointHost::poll_timeout`] is due, and
//!   [`EndpointHost::begin_shutdown`].
//!
//! Time is a `Duration` since an origin the shell chooses; the host never reads a clock.
//!
//! Invariants:
//! - **materialization gate**: an endpoint gets a pool only while its membership is
//!   materializable, no other endpoint claims the same pool, its KV-state endpoint resolves, and
//!   at least one expected rank has an active KV source. No KV source, no descriptor (no phantom
//!   pools);
//! - **withdraw before teardown**: a published generation is withdrawn from the catalog and the
//!   catalog published before its pool is stopped, and the pool is stopped before the
//!   registry releases it. Every `StartPool` is matched by exactly one `ReleasePool`; a
//!   `StopPool` precedes it iff the start succeeded;
//! - **no new model under an old producer**: a binding change (pool id, KV-state endpoint or
//!   base model) retires the generation and attaches a new one; only metadata (registrations,
//!   aliases, roles) is refreshed in place under the same producer;
//! - a start that raced with a binding change is stopped when its outcome arrives, never
//!   published;
//! - failed starts and fenced generations retry after a backoff of 100 ms doubling to 5 s;
//! - commands come out in a deterministic order (endpoint order within each phase).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use super::catalog::{Catalog, CatalogChange, CatalogSnapshot, PoolDescriptor};
use super::faults::{
    FaultAdmission, PendingPoolFaults, PoolFaultReport, ProducerFenceCause, SourceFault,
};
use super::pools::{PoolRegistry, RegistryError};
use crate::discovery::{
    EndpointMembership, ModelRegistration, QuerySemantics, WorkerRole, pool_claims,
};
use crate::filter::ckf::{CkfFormat, CkfFormatError};
use crate::model::identity::{
    DcId, EndpointPath, IndexerDomainId, PoolId, ProducerIdentity, RelayIdentity,
};

/// First retry delay after a failed start or a fenced generation.
pub const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Largest retry delay; also how long a generation must stay active to reset the failure count.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The retry delay after `consecutive_failures` failures (at least 1): 100 ms doubling to 5 s.
#[must_use]
pub fn retry_backoff(consecutive_failures: u32) -> Duration {
    let doublings = consecutive_failures.saturating_sub(1).min(16);
    RETRY_BACKOFF_MIN.saturating_mul(1 << doublings).min(RETRY_BACKOFF_MAX)
}

/// What the host needs to know about one serving endpoint's KV event sources.
///
/// KV source membership lives in its own module; the host takes only this summary (per
/// relay-facts §9.4): where the endpoint's KV state is published, and whether any expected rank
/// has an active (recoverable or live-only) source.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SourceBinding {
    /// The effective KV-state endpoint over all active base runtime configs; `None` when the
    /// mapping is ambiguous or unknown (then no pool is materialized).
    pub resolved_kv_state_endpoint: Option<EndpointPath>,
    /// True if at least one expected rank has exactly one active source incarnation.
    pub any_active_rank: bool,
}

/// Where an endpoint slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotLifecycle {
    /// The endpoint cannot back a pool (no domain, no registration, or a pool-fencing conflict
    /// without any active KV source): a topology member only.
    Lightweight,
    /// The endpoint could back a pool and waits: for an active KV source, or for another
    /// endpoint to release the pool.
    Discovered,
    /// A generation was attached and its pool is being started.
    Starting,
    /// A generation is published in the catalog.
    Active,
    /// The endpoint would publish but must not: a pool-fencing conflict, or a failed start /
    /// fenced generation waiting for its retry.
    Fenced,
    /// The host is shutting down; nothing starts again.
    Draining,
}

/// Why a slot is fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotFence {
    /// The membership carries a pool-fencing conflict (PoolMaterialization or ServingTopology).
    PoolConflict,
    /// Another endpoint claims the same pool id; all claimants are fenced.
    DuplicatePoolOwner,
    /// The last start failed; a retry is scheduled.
    StartFailed,
    /// The last generation was fenced; a retry is scheduled.
    GenerationFenced,
    /// The filters of the pools already held fill [`HostConfig::pool_filter_bytes_max`]; the
    /// slot attaches once a pool is released.
    PoolBudget,
}

/// Why a generation is retired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireReason {
    /// The endpoint left discovery.
    EndpointRemoved,
    /// The endpoint no longer materializes a pool (KV source gone, or membership no longer
    /// materializable).
    Dematerialized,
    /// The pool id, KV-state endpoint or base model changed; a new generation follows.
    BindingChanged,
    /// A terminal publication failure fenced the generation ([`EndpointHost::fence_generation`]).
    PublicationFailed,
    /// The pool's faults installed a producer-fence trigger.
    ProducerFence(ProducerFenceCause),
    /// A rank-level recovery call answered that the target is fenced.
    TargetFenced,
    /// The host is shutting down.
    Shutdown,
}

impl RetireReason {
    /// How the pool is stopped: fences skip the graceful drain.
    #[must_use]
    pub fn stop_mode(self) -> StopMode {
        match self {
            RetireReason::PublicationFailed
            | RetireReason::ProducerFence(_)
            | RetireReason::TargetFenced => StopMode::Fence,
            RetireReason::EndpointRemoved
            | RetireReason::Dematerialized
            | RetireReason::BindingChanged
            | RetireReason::Shutdown => StopMode::Graceful,
        }
    }

    fn is_fence(self) -> bool {
        self.stop_mode() == StopMode::Fence
    }
}

/// How a pool is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Flush and end publication streams normally.
    Graceful,
    /// The generation is not trustworthy: end its streams without publishing anything more.
    Fence,
}

/// What a rank-level recovery call answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetDisposition {
    /// The rank was recovered (or the source rejected); the pool stays active.
    Recovered,
    /// The recovery client fenced the target: retire the pool as fenced.
    Fenced,
}

/// A command for the shell. Execute in order, each finished before the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostCommand {
    /// The generation left the catalog (already applied to [`EndpointHost::catalog`]); the
    /// following `PublishCatalog` makes it visible. Cancel the generation's publication hub.
    WithdrawPool {
        /// The pool.
        pool_id: PoolId,
        /// The withdrawn generation.
        layout_generation: u64,
        /// Why.
        reason: RetireReason,
    },
    /// Publish the catalog snapshot at `revision` to catalog watchers.
    PublishCatalog {
        /// The catalog revision to publish ([`EndpointHost::catalog_snapshot`]).
        revision: u64,
    },
    /// Stop the generation's pool, recovery subscriber and load collector, and cancel any
    /// recovery call in flight for it.
    StopPool {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The pool.
        pool_id: PoolId,
        /// The generation.
        layout_generation: u64,
        /// How.
        mode: StopMode,
    },
    /// Drop everything still kept for the generation (hub slot, load entry); the registry
    /// already released it.
    ReleasePool {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The pool.
        pool_id: PoolId,
        /// The generation.
        layout_generation: u64,
    },
    /// Build the generation's CKF state and pool machine, start recovery and load collection, then
    /// report [`EndpointHost::start_succeeded`] or [`EndpointHost::start_failed`].
    StartPool {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The slot incarnation that owns the generation's availability writes.
        slot_incarnation: u64,
        /// The new generation's producer.
        producer: ProducerIdentity,
        /// Where the generation's KV sources are published and recovered from.
        kv_state_endpoint: EndpointPath,
    },
    /// Call the recovery client for one source, then report
    /// [`EndpointHost::source_recovery_finished`]. At most one per endpoint is in flight.
    RecoverSource {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The pool.
        pool_id: PoolId,
        /// The generation the fault belongs to.
        layout_generation: u64,
        /// The coalesced fault and the action to take.
        fault: SourceFault,
    },
}

/// Relay-level settings of a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostConfig {
    /// This relay start; its incarnation is every producer's incarnation.
    pub relay: RelayIdentity,
    /// The data center every pool id carries.
    pub dc_id: DcId,
    /// The CKF format of every producer.
    pub ckf_format: CkfFormat,
    /// Most bytes the filters of all held pools may take together: each pool preallocates
    /// its whole filter, so this bounds what discovery records can make the relay allocate.
    /// A pool that would exceed it is not started ([`SlotFence::PoolBudget`]).
    pub pool_filter_bytes_max: u64,
}

/// [`HostConfig::pool_filter_bytes_max`] unless the operator sets one: 2,048 pools at the
/// default sizing (4 MiB filters for 1,048,576 expected blocks), 64 at the largest (128 MiB).
pub const POOL_FILTER_BYTES_MAX_DEFAULT: u64 = 8 << 30;

impl HostConfig {
    /// The configuration with the relay's CKF format for `expected_unique_blocks`.
    pub fn for_expected_blocks(
        relay: RelayIdentity,
        dc_id: DcId,
        expected_unique_blocks: u64,
    ) -> Result<Self, CkfFormatError> {
        Ok(HostConfig {
            relay,
            dc_id,
            ckf_format: CkfFormat::for_expected_blocks(expected_unique_blocks)?,
            pool_filter_bytes_max: POOL_FILTER_BYTES_MAX_DEFAULT,
        })
    }

    /// Bytes of one pool's filter under [`HostConfig::ckf_format`].
    #[must_use]
    pub fn pool_filter_bytes(&self) -> u64 {
        self.ckf_format.filter_bytes()
    }

    /// How many pools fit [`HostConfig::pool_filter_bytes_max`].
    #[must_use]
    pub fn pools_max(&self) -> u64 {
        self.pool_filter_bytes_max / self.pool_filter_bytes().max(1)
    }
}

/// A diagnostic view of one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotStatus {
    /// The endpoint.
    pub endpoint: EndpointPath,
    /// Host-wide slot number, from 1; a reappearing endpoint gets a new one.
    pub slot_incarnation: u64,
    /// Where the slot is in its life.
    pub lifecycle: SlotLifecycle,
    /// Why it is fenced, when `lifecycle` is `Fenced`.
    pub fence: Option<SlotFence>,
    /// The generation held (starting or active).
    pub producer: Option<ProducerIdentity>,
    /// Failed starts and fenced generations since the last stable generation.
    pub consecutive_failures: u32,
    /// When the next attach may be attempted, if a retry is scheduled.
    pub retry_at: Option<Duration>,
    /// Coalesced source faults waiting for a recovery call.
    pub pending_source_faults: usize,
}

/// The host's health summary (relay-facts §13, host part).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostHealth {
    /// Not shutting down, no host error, no fenced endpoint.
    pub healthy: bool,
    /// [`EndpointHost::begin_shutdown`] was called.
    pub shutting_down: bool,
    /// The last internal invariant failure, if any (a bug; it keeps the host unhealthy).
    pub host_last_error: Option<String>,
    /// Endpoint slots.
    pub endpoint_count: usize,
    /// Slots with a published generation.
    pub active_endpoint_count: usize,
    /// Slots that want a pool but wait for the pool budget ([`SlotFence::PoolBudget`]).
    pub budget_refused_endpoint_count: usize,
    /// Pools the filter budget admits at once.
    pub pools_max: u64,
    /// Fenced slots.
    pub fenced_endpoint_count: usize,
}

// ---- slot state ----------------------------------------------------------------------------

/// What makes two generations interchangeable: if any of this changes, the old producer must
/// not publish the new state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolBinding {
    domain: IndexerDomainId,
    kv_state_endpoint: EndpointPath,
    /// Canonical base models. With explicit cache-semantics identity a model swap can keep the
    /// domain; it still gets a new generation.
    base_models: BTreeSet<String>,
}

/// Descriptor fields refreshed in place.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolMetadata {
    registrations: Vec<ModelRegistration>,
    query_semantics: QuerySemantics,
    pool_roles: BTreeSet<WorkerRole>,
}

/// What the latest reconcile wants for an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Desire {
    Lightweight,
    AwaitingSource,
    Fenced(SlotFence),
    Pool { binding: PoolBinding, metadata: PoolMetadata },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Active { since: Duration },
}

#[derive(Debug, Clone)]
struct HeldGeneration {
    producer: ProducerIdentity,
    binding: PoolBinding,
    phase: Phase,
}

#[derive(Debug, Clone)]
struct Slot {
    slot_incarnation: u64,
    /// False once the endpoint left discovery; the slot goes once it holds nothing.
    in_discovery: bool,
    desire: Desire,
    held: Option<HeldGeneration>,
    /// A fence to apply to the held active generation at the next convergence.
    fence_requested: Option<RetireReason>,
    consecutive_failures: u32,
    retry_at: Option<Duration>,
    last_failure: Option<SlotFence>,
    /// The last attach pass wanted a pool here and found the pool budget full.
    budget_refused: bool,
    faults: PendingPoolFaults,
    recovery_in_flight: bool,
}

impl Slot {
    fn new(slot_incarnation: u64) -> Self {
        Slot {
            slot_incarnation,
            in_discovery: true,
            desire: Desire::Lightweight,
            held: None,
            fence_requested: None,
            consecutive_failures: 0,
            retry_at: None,
            last_failure: None,
            budget_refused: false,
            faults: PendingPoolFaults::new(),
            recovery_in_flight: false,
        }
    }

    fn active_generation(&self, layout_generation: u64) -> bool {
        self.held.as_ref().is_some_and(|held| {
            matches!(held.phase, Phase::Active { .. })
                && held.producer.layout_generation() == layout_generation
        })
    }

    fn starting_generation(&self, layout_generation: u64) -> bool {
        self.held.as_ref().is_some_and(|held| {
            held.phase == Phase::Starting && held.producer.layout_generation() == layout_generation
        })
    }

    /// Why the held generation must go, judged against the current desire.
    fn retire_reason(&self, shutting_down: bool) -> Option<RetireReason> {
        let held = self.held.as_ref()?;
        if let Some(reason) = self.fence_requested {
            return Some(reason);
        }
        if shutting_down {
            return Some(RetireReason::Shutdown);
        }
        if !self.in_discovery {
            return Some(RetireReason::EndpointRemoved);
        }
        match &self.desire {
            Desire::Pool { binding, .. } if *binding == held.binding => None,
            Desire::Pool { .. } => Some(RetireReason::BindingChanged),
            Desire::Lightweight | Desire::AwaitingSource | Desire::Fenced(_) => {
                Some(RetireReason::Dematerialized)
            }
        }
    }

    /// Record one failure (a failed start or a fenced generation) and schedule the retry.
    fn record_failure(&mut self, cause: SlotFence, now: Duration) {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.retry_at = Some(now.saturating_add(retry_backoff(self.consecutive_failures)));
        self.last_failure = Some(cause);
    }

    fn lifecycle(&self, shutting_down: bool) -> (SlotLifecycle, Option<SlotFence>) {
        if shutting_down {
            return (SlotLifecycle::Draining, None);
        }
        match self.held.as_ref().map(|held| held.phase) {
            Some(Phase::Starting) => return (SlotLifecycle::Starting, None),
            Some(Phase::Active { .. }) => return (SlotLifecycle::Active, None),
            None => {}
        }
        match &self.desire {
            Desire::Lightweight => (SlotLifecycle::Lightweight, None),
            Desire::AwaitingSource => (SlotLifecycle::Discovered, None),
            Desire::Fenced(cause) => (SlotLifecycle::Fenced, Some(*cause)),
            Desire::Pool { .. } if self.retry_at.is_some() => {
                (SlotLifecycle::Fenced, self.last_failure)
            }
            Desire::Pool { .. } if self.budget_refused => {
                (SlotLifecycle::Fenced, Some(SlotFence::PoolBudget))
            }
            Desire::Pool { .. } => (SlotLifecycle::Discovered, None),
        }
    }
}

/// Ways to break [`EndpointHost::check_invariants`] (tests only).
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(super) enum SlotCorruption {
    /// The slot forgets its generation; the registry still reserves it.
    ForgetGeneration,
    /// The slot holds nothing (nor does the registry) yet claims a host recovery.
    RecoveryWithoutGeneration,
    /// The slot's incarnation was never allocated.
    UnallocatedIncarnation,
    /// The slot takes another slot's incarnation.
    ReusedIncarnation,
    /// The slot's catalogued generation goes back to starting.
    CataloguedWhileStarting,
}

/// What one endpoint wants, from its membership and KV source facts (`desired_binding`).
fn desire_of(
    membership: &EndpointMembership,
    source: Option<&SourceBinding>,
    duplicate_owner: bool,
) -> Desire {
    let source_active = source.is_some_and(|source| source.any_active_rank);
    let fence = if duplicate_owner {
        Some(SlotFence::DuplicatePoolOwner)
    } else if membership.has_pool_materialization_conflict() {
        Some(SlotFence::PoolConflict)
    } else {
        None
    };
    if let Some(cause) = fence {
        // A fenced endpoint without any KV source would not publish anyway.
        return if source_active { Desire::Fenced(cause) } else { Desire::Lightweight };
    }
    let (Some(domain), Some(query_semantics)) = (membership.domain, membership.query_semantics)
    else {
        return Desire::Lightweight;
    };
    if !membership.is_materializable() {
        return Desire::Lightweight;
    }
    let kv_state_endpoint = match source {
        Some(SourceBinding {
            resolved_kv_state_endpoint: Some(endpoint),
            any_active_rank: true,
        }) => endpoint.clone(),
        _ => return Desire::AwaitingSource,
    };
    Desire::Pool {
        binding: PoolBinding {
            domain,
            kv_state_endpoint,
            base_models: membership.base_models().into_iter().map(str::to_owned).collect(),
        },
        metadata: PoolMetadata {
            registrations: membership.registrations.clone(),
            query_semantics,
            pool_roles: membership.roles.clone(),
        },
    }
}

// ---- the host ------------------------------------------------------------------------------

/// One slot per serving endpoint over a [`PoolRegistry`]. See the module docs.
///
/// Bound: one slot per endpoint in the latest reconcile plus endpoints that left but still hold
/// a starting generation; per slot at most one generation, one recovery call in flight and
/// [`super::PENDING_SOURCE_FAULTS_MAX`] pending source faults.
#[derive(Debug, Clone)]
pub struct EndpointHost {
    relay: RelayIdentity,
    /// Pools the filter budget admits at once (at least one).
    pools_max: u64,
    registry: PoolRegistry,
    slots: BTreeMap<EndpointPath, Slot>,
    /// The next slot incarnation; starts at 1.
    slot_incarnation_next: u64,
    shutting_down: bool,
    last_error: Option<RegistryError>,
}

impl EndpointHost {
    /// A host with no endpoints and an empty catalog at revision 0.
    pub fn new(config: HostConfig) -> Result<Self, RegistryError> {
        Ok(EndpointHost {
            relay: config.relay,
            pools_max: config.pools_max().max(1),
            registry: PoolRegistry::new(
                config.relay.relay_incarnation,
                config.dc_id,
                config.ckf_format,
            )?,
            slots: BTreeMap::new(),
            slot_incarnation_next: 1,
            shutting_down: false,
            last_error: None,
        })
    }

    /// The relay this host publishes for.
    #[must_use]
    pub fn relay(&self) -> RelayIdentity {
        self.relay
    }

    /// The registry (reservations, generation counter, catalog).
    #[must_use]
    pub fn registry(&self) -> &PoolRegistry {
        &self.registry
    }

    /// The catalog of published generations.
    #[must_use]
    pub fn catalog(&self) -> &Catalog {
        self.registry.catalog()
    }

    /// The complete current catalog.
    #[must_use]
    pub fn catalog_snapshot(&self) -> CatalogSnapshot {
        self.registry.catalog().snapshot()
    }

    /// The status of `endpoint`'s slot.
    #[must_use]
    pub fn slot(&self, endpoint: &EndpointPath) -> Option<SlotStatus> {
        self.slots.get(endpoint).map(|slot| self.status(endpoint, slot))
    }

    /// Every slot's status, in endpoint order.
    #[must_use]
    pub fn slots(&self) -> Vec<SlotStatus> {
        self.slots.iter().map(|(endpoint, slot)| self.status(endpoint, slot)).collect()
    }

    /// The health summary.
    #[must_use]
    pub fn health(&self) -> HostHealth {
        let mut active_endpoint_count = 0;
        let mut fenced_endpoint_count = 0;
        for slot in self.slots.values() {
            match slot.lifecycle(self.shutting_down) {
                (SlotLifecycle::Active, _) => active_endpoint_count += 1,
                // Waiting for the pool budget is a capacity condition of this relay, not a
                // fault of the endpoint: it is reported apart and leaves the host healthy, so
                // records that ask for more pools than fit cannot make the relay unready.
                (SlotLifecycle::Fenced, Some(SlotFence::PoolBudget)) => {}
                (SlotLifecycle::Fenced, _) => fenced_endpoint_count += 1,
                _ => {}
            }
        }
        let budget_refused_endpoint_count =
            self.slots.values().filter(|slot| slot.budget_refused).count();
        HostHealth {
            healthy: !self.shutting_down && self.last_error.is_none() && fenced_endpoint_count == 0,
            budget_refused_endpoint_count,
            pools_max: self.pools_max,
            shutting_down: self.shutting_down,
            host_last_error: self.last_error.as_ref().map(ToString::to_string),
            endpoint_count: self.slots.len(),
            active_endpoint_count,
            fenced_endpoint_count,
        }
    }

    /// True once shutdown was requested and every generation was released.
    #[must_use]
    pub fn is_drained(&self) -> bool {
        self.shutting_down && self.slots.values().all(|slot| slot.held.is_none())
    }

    /// Verify the relations between the slots, the pool registry and the catalog
    /// (O(slots + pools)): every held generation is reserved in the registry under its slot's
    /// endpoint and nothing else is; the catalog names only generations whose slot holds them
    /// as active; slot incarnations are unique and already allocated; a host recovery is in
    /// flight only for an active generation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut incarnations = BTreeSet::new();
        let mut held = 0usize;
        for (endpoint, slot) in &self.slots {
            if slot.slot_incarnation >= self.slot_incarnation_next
                || !incarnations.insert(slot.slot_incarnation)
            {
                return Err(format!(
                    "{endpoint}: slot incarnation {} is reused or unallocated",
                    slot.slot_incarnation
                ));
            }
            let reserved = self.registry.held_by(endpoint);
            match &slot.held {
                Some(generation) => {
                    held += 1;
                    if reserved.map(|pool| pool.producer) != Some(generation.producer) {
                        return Err(format!(
                            "{endpoint}: holds generation {} that the registry does not reserve",
                            generation.producer.layout_generation()
                        ));
                    }
                }
                None if reserved.is_some() => {
                    return Err(format!(
                        "{endpoint}: the registry reserves a pool it does not hold"
                    ));
                }
                None => {}
            }
            let active =
                slot.held.as_ref().is_some_and(|held| matches!(held.phase, Phase::Active { .. }));
            if slot.recovery_in_flight && !active {
                return Err(format!(
                    "{endpoint}: host recovery in flight without an active generation"
                ));
            }
        }
        let registry = &self.registry;
        if registry.held_count() != held {
            return Err(format!(
                "the registry reserves {} pools but slots hold {held}",
                registry.held_count()
            ));
        }
        for descriptor in registry.catalog().descriptors() {
            let endpoint = &descriptor.serving_endpoint;
            let published =
                self.slots.get(endpoint).and_then(|slot| slot.held.as_ref()).is_some_and(|held| {
                    held.producer == descriptor.producer
                        && matches!(held.phase, Phase::Active { .. })
                });
            if !published {
                return Err(format!(
                    "{endpoint}: cataloged generation {} is not its slot's active generation",
                    descriptor.layout_generation()
                ));
            }
        }
        Ok(())
    }

    /// Break one relation [`EndpointHost::check_invariants`] states on the slot of `endpoint`,
    /// so tests can show the check fires.
    #[cfg(test)]
    pub(super) fn corrupt_slot_for_test(&mut self, endpoint: &EndpointPath, how: SlotCorruption) {
        let other_incarnation = self
            .slots
            .iter()
            .find(|(path, _)| *path != endpoint)
            .map(|(_, slot)| slot.slot_incarnation);
        let unallocated = self.slot_incarnation_next;
        let slot = self.slots.get_mut(endpoint).expect("a slot to corrupt");
        match how {
            SlotCorruption::ForgetGeneration => slot.held = None,
            SlotCorruption::RecoveryWithoutGeneration => {
                self.registry = PoolRegistry::new(
                    self.relay.relay_incarnation,
                    self.registry.dc_id(),
                    self.registry.format(),
                )
                .expect("the format was valid");
                slot.held = None;
                slot.recovery_in_flight = true;
            }
            SlotCorruption::UnallocatedIncarnation => slot.slot_incarnation = unallocated,
            SlotCorruption::ReusedIncarnation => {
                slot.slot_incarnation = other_incarnation.expect("another slot");
            }
            SlotCorruption::CataloguedWhileStarting => {
                slot.held.as_mut().expect("a held generation").phase = Phase::Starting;
            }
        }
    }

    /// When [`EndpointHost::handle_timeout`] should next be called: the earliest scheduled retry
    /// of a slot that still wants a pool.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.shutting_down {
            return None;
        }
        self.slots
            .values()
            .filter(|slot| slot.held.is_none() && matches!(slot.desire, Desire::Pool { .. }))
            .filter_map(|slot| slot.retry_at)
            .min()
    }

    /// Apply due retries.
    #[must_use = "commands must be executed in order"]
    pub fn handle_timeout(&mut self, now: Duration) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        self.converge(now, &mut commands);
        commands
    }

    /// Take the current discovery memberships and KV source facts (keyed by serving endpoint)
    /// and move every slot toward them.
    #[must_use = "commands must be executed in order"]
    pub fn reconcile(
        &mut self,
        memberships: &BTreeMap<EndpointPath, EndpointMembership>,
        sources: &BTreeMap<EndpointPath, SourceBinding>,
        now: Duration,
    ) -> Vec<HostCommand> {
        // The discovery view already fences endpoints sharing a pool id; checking again here
        // keeps "one owner per pool" true whatever produced the memberships.
        let duplicate_owners: BTreeSet<EndpointPath> =
            pool_claims(memberships, self.registry.dc_id())
                .into_values()
                .filter(|claimants| claimants.len() > 1)
                .flatten()
                .collect();
        for (endpoint, membership) in memberships {
            let desire =
                desire_of(membership, sources.get(endpoint), duplicate_owners.contains(endpoint));
            let slot = match self.slots.get_mut(endpoint) {
                Some(slot) => slot,
                None => {
                    let slot_incarnation = self.slot_incarnation_next;
                    self.slot_incarnation_next = self.slot_incarnation_next.saturating_add(1);
                    self.slots.entry(endpoint.clone()).or_insert(Slot::new(slot_incarnation))
                }
            };
            slot.in_discovery = true;
            slot.desire = desire;
        }
        for (endpoint, slot) in &mut self.slots {
            if !memberships.contains_key(endpoint) {
                slot.in_discovery = false;
                slot.desire = Desire::Lightweight;
            }
        }
        let mut commands = Vec::new();
        self.converge(now, &mut commands);
        commands
    }

    /// The shell started the pool of `layout_generation` for `endpoint`. Publishes it, unless
    /// the binding changed meanwhile (then it is stopped unpublished and the current binding
    /// attached). Reports for any other generation are ignored.
    #[must_use = "commands must be executed in order"]
    pub fn start_succeeded(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        now: Duration,
    ) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        let shutting_down = self.shutting_down;
        let Some(slot) = self.slots.get_mut(endpoint) else {
            return commands;
        };
        if !slot.starting_generation(layout_generation) {
            return commands;
        }
        let Some(held) = slot.held.as_mut() else {
            return commands;
        };
        held.phase = Phase::Active { since: now };
        let producer = held.producer;
        match slot.retire_reason(shutting_down) {
            None => {
                if let Desire::Pool { metadata, .. } = &slot.desire {
                    let descriptor = descriptor(endpoint, producer, metadata);
                    match self.registry.publish(descriptor) {
                        Ok(change) => {
                            if let Some(revision) = change.revision() {
                                commands.push(HostCommand::PublishCatalog { revision });
                            }
                        }
                        Err(error) => self.last_error = Some(error),
                    }
                }
            }
            Some(reason) => {
                // Never published: no withdrawal, only teardown and release.
                slot.held = None;
                slot.faults.clear();
                slot.recovery_in_flight = false;
                commands.push(HostCommand::StopPool {
                    endpoint: endpoint.clone(),
                    pool_id: producer.pool_id(),
                    layout_generation,
                    mode: reason.stop_mode(),
                });
                self.release(endpoint, &producer, &mut commands);
            }
        }
        self.converge(now, &mut commands);
        commands
    }

    /// The shell could not start `layout_generation` for `endpoint` (nothing of it runs). The
    /// generation is released and the slot fenced until its retry is due.
    #[must_use = "commands must be executed in order"]
    pub fn start_failed(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        now: Duration,
    ) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        let Some(slot) = self.slots.get_mut(endpoint) else {
            return commands;
        };
        if !slot.starting_generation(layout_generation) {
            return commands;
        }
        let Some(held) = slot.held.take() else {
            return commands;
        };
        slot.record_failure(SlotFence::StartFailed, now);
        self.release(endpoint, &held.producer, &mut commands);
        self.converge(now, &mut commands);
        commands
    }

    /// A terminal publication failure of `pool_id`'s `layout_generation`: withdraw it, stop
    /// its pool as fenced, and attach a new generation once the retry is due. Stale
    /// generations are ignored.
    #[must_use = "commands must be executed in order"]
    pub fn fence_generation(
        &mut self,
        pool_id: PoolId,
        layout_generation: u64,
        now: Duration,
    ) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        let Some(endpoint) = self.registry.holder(&pool_id).map(|held| held.endpoint.clone())
        else {
            return commands;
        };
        if let Some(slot) = self.slots.get_mut(&endpoint)
            && slot.active_generation(layout_generation)
        {
            slot.fence_requested = Some(RetireReason::PublicationFailed);
            self.converge(now, &mut commands);
        }
        commands
    }

    /// A pool fault of `endpoint`'s active `layout_generation`. Source faults are coalesced
    /// and handed to the recovery client one at a time; a producer-fence trigger retires the
    /// generation as fenced. Faults of other generations are ignored.
    #[must_use = "commands must be executed in order"]
    pub fn report_pool_fault(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        fault: PoolFaultReport,
        now: Duration,
    ) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        let Some(slot) = self.slots.get_mut(endpoint) else {
            return commands;
        };
        if !slot.active_generation(layout_generation) {
            return commands;
        }
        if let FaultAdmission::ProducerFenceInstalled(_) = slot.faults.push(fault)
            && let Some(cause) = slot.faults.take_producer_fence()
        {
            slot.fence_requested = Some(RetireReason::ProducerFence(cause));
            self.converge(now, &mut commands);
            return commands;
        }
        Self::dispatch_recovery(endpoint, slot, &mut commands);
        commands
    }

    /// The recovery call the host asked for (`RecoverSource`) finished. A fenced target
    /// retires the generation as fenced; otherwise the next pending fault is dispatched.
    /// Outcomes for other generations (e.g. after a producer fence) are ignored.
    #[must_use = "commands must be executed in order"]
    pub fn source_recovery_finished(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        disposition: TargetDisposition,
        now: Duration,
    ) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        let Some(slot) = self.slots.get_mut(endpoint) else {
            return commands;
        };
        if !slot.active_generation(layout_generation) || !slot.recovery_in_flight {
            return commands;
        }
        slot.recovery_in_flight = false;
        match disposition {
            TargetDisposition::Fenced => {
                slot.fence_requested = Some(RetireReason::TargetFenced);
                self.converge(now, &mut commands);
            }
            TargetDisposition::Recovered => Self::dispatch_recovery(endpoint, slot, &mut commands),
        }
        commands
    }

    /// Withdraw and stop every generation; nothing starts afterwards. Starting generations are
    /// stopped when their outcome arrives.
    #[must_use = "commands must be executed in order"]
    pub fn begin_shutdown(&mut self, now: Duration) -> Vec<HostCommand> {
        self.shutting_down = true;
        let mut commands = Vec::new();
        self.converge(now, &mut commands);
        commands
    }

    // ---- internals -------------------------------------------------------------------------

    fn status(&self, endpoint: &EndpointPath, slot: &Slot) -> SlotStatus {
        let (lifecycle, fence) = slot.lifecycle(self.shutting_down);
        SlotStatus {
            endpoint: endpoint.clone(),
            slot_incarnation: slot.slot_incarnation,
            lifecycle,
            fence,
            producer: slot.held.as_ref().map(|held| held.producer),
            consecutive_failures: slot.consecutive_failures,
            retry_at: slot.retry_at,
            pending_source_faults: slot.faults.source_fault_count(),
        }
    }

    fn dispatch_recovery(
        endpoint: &EndpointPath,
        slot: &mut Slot,
        commands: &mut Vec<HostCommand>,
    ) {
        if slot.recovery_in_flight {
            return;
        }
        let Some(held) = slot.held.as_ref() else {
            return;
        };
        let producer = held.producer;
        if let Some(fault) = slot.faults.pop_source_fault() {
            slot.recovery_in_flight = true;
            commands.push(HostCommand::RecoverSource {
                endpoint: endpoint.clone(),
                pool_id: producer.pool_id(),
                layout_generation: producer.layout_generation(),
                fault,
            });
        }
    }

    fn release(
        &mut self,
        endpoint: &EndpointPath,
        producer: &ProducerIdentity,
        commands: &mut Vec<HostCommand>,
    ) {
        if let Err(error) = self.registry.release(producer.pool_id(), producer.layout_generation())
        {
            self.last_error = Some(error);
        }
        commands.push(HostCommand::ReleasePool {
            endpoint: endpoint.clone(),
            pool_id: producer.pool_id(),
            layout_generation: producer.layout_generation(),
        });
    }

    /// Move every slot toward its desire, in three phases whose order is the protocol:
    /// catalog changes (withdrawals and in-place refreshes) and one publication; then pool
    /// teardown and registry release of the withdrawn generations; then new attaches.
    fn converge(&mut self, now: Duration, commands: &mut Vec<HostCommand>) {
        let shutting_down = self.shutting_down;
        let mut retired: Vec<(EndpointPath, ProducerIdentity, StopMode)> = Vec::new();
        let mut published_revision = None;

        // Phase 1: catalog changes.
        for (endpoint, slot) in &mut self.slots {
            let Some(held) = slot.held.as_ref() else {
                continue;
            };
            let Phase::Active { since } = held.phase else {
                continue; // a starting generation is judged when its outcome arrives
            };
            let producer = held.producer;
            match slot.retire_reason(shutting_down) {
                Some(reason) => {
                    match self.registry.withdraw(producer.pool_id(), producer.layout_generation()) {
                        Ok(revision) => published_revision = Some(revision),
                        Err(error) => self.last_error = Some(error),
                    }
                    commands.push(HostCommand::WithdrawPool {
                        pool_id: producer.pool_id(),
                        layout_generation: producer.layout_generation(),
                        reason,
                    });
                    // A generation that stayed up long enough ends the run of failures.
                    if now.saturating_sub(since) >= RETRY_BACKOFF_MAX {
                        slot.consecutive_failures = 0;
                    }
                    if reason.is_fence() {
                        slot.record_failure(SlotFence::GenerationFenced, now);
                    }
                    slot.fence_requested = None;
                    slot.held = None;
                    slot.faults.clear();
                    slot.recovery_in_flight = false;
                    retired.push((endpoint.clone(), producer, reason.stop_mode()));
                }
                None => {
                    let Desire::Pool { metadata, .. } = &slot.desire else {
                        continue;
                    };
                    match self.registry.publish(descriptor(endpoint, producer, metadata)) {
                        Ok(CatalogChange::Refreshed { revision }) => {
                            published_revision = Some(revision);
                        }
                        Ok(CatalogChange::Unchanged) => {}
                        Ok(CatalogChange::Attached { revision }) => {
                            // An active generation is always published; re-adding it means the
                            // catalog lost it somewhere.
                            published_revision = Some(revision);
                            self.last_error = Some(RegistryError::ActiveNotPublished {
                                pool_id: producer.pool_id(),
                                layout_generation: producer.layout_generation(),
                            });
                        }
                        Err(error) => self.last_error = Some(error),
                    }
                }
            }
        }
        if let Some(revision) = published_revision {
            commands.push(HostCommand::PublishCatalog { revision });
        }

        // Phase 2: teardown, then registry removal, of what was withdrawn.
        for (endpoint, producer, mode) in &retired {
            commands.push(HostCommand::StopPool {
                endpoint: endpoint.clone(),
                pool_id: producer.pool_id(),
                layout_generation: producer.layout_generation(),
                mode: *mode,
            });
        }
        for (endpoint, producer, _) in &retired {
            self.release(endpoint, producer, commands);
        }

        // Phase 3: attach where a pool is wanted and none is held.
        if !shutting_down {
            let pools_max = self.pools_max;
            for (endpoint, slot) in &mut self.slots {
                slot.budget_refused = false;
                if slot.retry_at.is_some_and(|retry_at| retry_at <= now) {
                    slot.retry_at = None;
                }
                if slot.held.is_some() || slot.retry_at.is_some() || !slot.in_discovery {
                    continue;
                }
                let Desire::Pool { binding, .. } = &slot.desire else {
                    continue;
                };
                // Generations still retiring hold their filters until released, so they count.
                if self.registry.held_count() as u64 >= pools_max {
                    slot.budget_refused = true;
                    continue;
                }
                match self.registry.attach(endpoint, binding.domain) {
                    Ok(producer) => {
                        slot.held = Some(HeldGeneration {
                            producer,
                            binding: binding.clone(),
                            phase: Phase::Starting,
                        });
                        commands.push(HostCommand::StartPool {
                            endpoint: endpoint.clone(),
                            slot_incarnation: slot.slot_incarnation,
                            producer,
                            kv_state_endpoint: binding.kv_state_endpoint.clone(),
                        });
                    }
                    // Another endpoint still holds the pool (it is retiring or starting under
                    // an older membership); this slot attaches once it is released.
                    Err(RegistryError::PoolHeld { .. }) => {}
                    Err(error) => self.last_error = Some(error),
                }
            }
        }

        // Endpoints that left discovery go once they hold nothing.
        self.slots.retain(|_, slot| slot.in_discovery || slot.held.is_some());
    }
}

fn descriptor(
    endpoint: &EndpointPath,
    producer: ProducerIdentity,
    metadata: &PoolMetadata,
) -> PoolDescriptor {
    PoolDescriptor {
        producer,
        serving_endpoint: endpoint.clone(),
        registrations: metadata.registrations.clone(),
        query_semantics: metadata.query_semantics,
        pool_roles: metadata.pool_roles.clone(),
    }
}
