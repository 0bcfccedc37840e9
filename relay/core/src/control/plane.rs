//! [`ControlPlane`]: discovery, KV source membership, the endpoint host, per-pool recovery and
//! load, availability and topology, composed as one sans-IO state machine.
//!
//! # Protocol
//!
//! The async host calls, each with the current monotonic `now` (a `Duration` since an origin it
//! chooses) and the relay's seeded generator:
//!
//! - [`ControlPlane::handle`] for every [`DcInput`];
//! - [`ControlPlane::report`] (or the [`ControlPlane::start_succeeded`] /
//!   [`ControlPlane::start_failed`] / [`ControlPlane::recovery_answered`] shortcuts) for every
//!   outcome of a command it carried out;
//! - [`ControlPlane::handle_timeout`] once [`ControlPlane::poll_timeout`] is due;
//! - [`ControlPlane::load_window`] on every load window tick, with the wall-clock `observed_ms`;
//! - [`ControlPlane::begin_shutdown`] once.
//!
//! Every call returns [`ControlCommand`]s to execute **in the order given, each finished before
//! the next starts**:
//!
//! | command | the shell |
//! | --- | --- |
//! | [`ControlCommand::Host`] | carries out the [`HostCommand`] as documented there (withdraw, publish the catalog snapshot, stop a pool, release, start a pool and report the outcome); the host's `RecoverSource` never reaches the shell: the plane answers it from the pool's tracker (below) |
//! | [`ControlCommand::Source`] | applies the [`SourceCommand`] to the pool of `(pool_id, layout_generation)` or sends the recovery query, and reports answers and failures back with that endpoint and generation |
//! | [`ControlCommand::PublishTopology`] | publishes [`ControlPlane::topology_snapshot`] at that revision |
//!
//! Within one call the host's commands come first, in the host's order (withdrawals and catalog
//! publication, then teardown and release, then starts), then source commands in endpoint order,
//! then at most one topology publication; [`ControlPlane::handle_timeout`] appends the trackers'
//! timer commands last.
//!
//! A generation's tracker starts when its start succeeded and it entered the catalog: KV event
//! batches arriving while it is still starting reach no tracker (counted as unrouted). Its
//! ranks are cold-reset at activation anyway, and recoverable ranks are rebuilt from a tree dump.
//!
//! # Host recovery calls
//!
//! A pool fault reaches the rank's tracker (`ApplyFailed`), which resets and recovers the rank,
//! and the host's fault coalescing (`PoolFaultReport`), which asks for one `RecoverSource` at a time
//! per endpoint. The plane answers that call itself, when the rank's recovery settles: the rank
//! is exact again, left, or came back under a new incarnation → `Recovered`; its recovery failed
//! for good (degraded after the attempt bound, or fenced for answering as another rank) →
//! `Fenced`, and the host retires the generation as fenced and starts a new one. A rank that
//! was not recoverable when the call was made has nothing to recover: `Recovered` at once.
//!
//! # Invariants
//!
//! The structural part is checked after every call that changes structure, and in debug
//! builds (tests, the simulator) all of [`ControlPlane::check_invariants`] — trackers and host
//! included — after every step; a violation is a bug, recorded in
//! [`ControlHealth::control_last_error`] (the plane reports unhealthy) instead of a panic.
//!
//! - The catalog never names a pool whose start has not succeeded: every descriptor belongs to a
//!   generation the host holds as active.
//! - A pool's tracker and load entry exist iff its generation is in the catalog, so source
//!   commands only ever name published generations, and every load window has exactly one entry
//!   per cataloged producer. A generation leaves the catalog (withdrawal) before its pool is
//!   stopped; its tracker is dropped at that moment, so no source command names a generation
//!   after its `StopPool`.
//! - KV event batches reach exactly the trackers whose pool's KV-state endpoint is the batch's
//!   endpoint scope; load reports reach the pool of the serving endpoint they were published on.
//! - Availability is written only under the host's current slot incarnation of the endpoint; a
//!   new slot starts from the endpoint's latest instance listing (the listing its own watch
//!   would deliver first).
//! - Topology members link only pools in the catalog; the topology revision moves only when the
//!   entries change, and the plane emits exactly one `PublishTopology` per move.
//!
//! # Bounds
//!
//! Memberships and source views: one per endpoint with in-scope cards. Instance listings: at
//! most [`INSTANCE_LISTINGS_MAX`] endpoints (a listing for a further endpoint is refused and
//! counted). Advertisements: the [`AdvertTable`] bound. Trackers and load states: one per active
//! pool. Each input re-projects source membership over every advertisement
//! (O(endpoints · advertisements)) only when cards, instances or advertisements changed; KV
//! event batches and load reports touch only the pools they are routed to.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::config::{ControlConfig, ControlError, INSTANCE_LISTINGS_MAX};
use super::early_loads::EarlyLoads;
use super::protocol::{ControlCommand, ControlCounters, ControlHealth, ShellReport};
use crate::discovery::{CardChange, DiscoveryView, ModelTarget};
use crate::host::{
    CatalogSnapshot, EndpointHost, HostCommand, HostConfig, PoolFaultAction, PoolFaultReport,
    SlotLifecycle, SourceBinding, TargetDisposition,
};
use crate::inputs::{
    DcInput, EndpointInstances, KvEventBatch, KvEventSourceAdvert, LoadObservation, RuntimeConfig,
};
use crate::load::{
    LoadWindow, LoadWindowError, LoadWindows, ObserveOutcome, PoolLoadSnapshot, PoolLoadState,
};
use crate::model::identity::{EndpointPath, ProducerIdentity, RelayIdentity};
use crate::model::kv_events::SourceKey;
use crate::pool::PoolFault;
use crate::readiness::topology::{
    AvailabilityStore, ClaimOutcome, PoolLinks, SlotIncarnation, TopologyOutcome, TopologySnapshot,
    TopologyState,
};
use crate::rng::RelayRng;
use crate::sources::{
    AdvertChange, AdvertTable, KvSourceMembership, RankMode, RecoveryRequestId, RecoveryResponse,
    SourceCommand, SourceInput, SourceTracker, SourceView,
};

/// The KV source membership of one serving endpoint and its latest view.
#[derive(Debug, Clone)]
struct EndpointSources {
    membership: KvSourceMembership,
    view: SourceView,
}

/// One cataloged pool generation with its recovery and load state.
#[derive(Debug, Clone)]
struct ActivePool {
    producer: ProducerIdentity,
    /// Where the generation's KV events are published (its binding when it was started).
    kv_state_endpoint: EndpointPath,
    tracker: SourceTracker,
    /// The view last handed to the tracker; `None` before the first.
    view_fed: Option<SourceView>,
    load: PoolLoadState,
    /// The runtime configs the load's capacity was last set from.
    capacity_configs: BTreeMap<u64, RuntimeConfig>,
}

/// What the endpoint watch last said about one endpoint.
///
/// A failed watch (`None` listing) makes the endpoint non-authoritative for readiness (UNKNOWN)
/// but leaves the last known live set in force for KV source membership: not knowing is not a
/// departure, and dematerializing every pool on a transient watch error would churn producer
/// generations for nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct InstanceListing {
    /// The latest listing succeeded.
    authoritative: bool,
    /// The last successfully listed live workers (empty before the first listing).
    live_workers: BTreeSet<u64>,
}

impl InstanceListing {
    /// What the availability store holds for this listing.
    fn availability(&self) -> Option<BTreeSet<u64>> {
        self.authoritative.then(|| self.live_workers.clone())
    }
}

/// A generation between `StartPool` and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StartingGeneration {
    layout_generation: u64,
    kv_state_endpoint: EndpointPath,
}

/// What an input changed, deciding which projections are re-run.
#[derive(Debug, Clone, Copy, Default)]
struct Dirty {
    /// Discovery memberships changed.
    memberships: bool,
    /// Instance listings of a discovered endpoint or advertisements changed.
    sources: bool,
    /// Availability changed.
    availability: bool,
}

/// The composition of the relay's sans-IO cores. See the module docs for the protocol and the
/// invariants.
#[derive(Debug, Clone)]
pub struct ControlPlane {
    relay: RelayIdentity,
    view: DiscoveryView,
    /// Instance listings per endpoint.
    instances: BTreeMap<EndpointPath, InstanceListing>,
    adverts: AdvertTable,
    /// Per discovered serving endpoint: its KV source membership; same keys as the memberships.
    sources: BTreeMap<EndpointPath, EndpointSources>,
    host: EndpointHost,
    /// Generations started and not yet published or released, by endpoint.
    starting: BTreeMap<EndpointPath, StartingGeneration>,
    /// Cataloged generations by serving endpoint; exactly the catalog.
    pools: BTreeMap<EndpointPath, ActivePool>,
    /// KV-state endpoint → serving endpoints of the active pools publishing under it.
    kv_routes: BTreeMap<EndpointPath, BTreeSet<EndpointPath>>,
    /// A fresh tracker with the validated configuration, cloned for every new pool.
    tracker_template: SourceTracker,
    availability: AvailabilityStore,
    /// The slot incarnation each discovered endpoint's availability is claimed under.
    availability_owners: BTreeMap<EndpointPath, SlotIncarnation>,
    topology: TopologyState,
    load_windows: LoadWindows<ProducerIdentity>,
    /// The catalog revision the topology was last computed against.
    catalog_revision_seen: u64,
    counters: ControlCounters,
    last_error: Option<String>,
    now_last: Duration,
    /// The host's `RecoverSource` call in flight per endpoint (the host makes at most one).
    host_recoveries: BTreeMap<EndpointPath, HostRecovery>,
    /// Worker load reports that came before their pool expected the rank.
    early_loads: EarlyLoads,
}

/// A host `RecoverSource` call the plane answers from the pool's tracker once the rank's
/// recovery settles (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HostRecovery {
    layout_generation: u64,
    source: SourceKey,
    /// The rank was recoverable when the call was made: its recovery is what the call waits for.
    watched: bool,
}

impl ControlPlane {
    /// A plane with no cards, an empty catalog (revision 0) and an empty topology (revision 1).
    pub fn new(config: ControlConfig) -> Result<Self, ControlError> {
        let ControlConfig {
            relay,
            dc_id,
            expected_unique_blocks,
            scope,
            ambiguity_policy,
            source_tracker,
            load_window_ms,
            pool_filter_bytes_max,
        } = config;
        let host_config = HostConfig {
            pool_filter_bytes_max,
            ..HostConfig::for_expected_blocks(relay, dc_id, expected_unique_blocks)
                .map_err(ControlError::CkfFormat)?
        };
        let host = EndpointHost::new(host_config)
            .map_err(|error| ControlError::Registry(Box::new(error)))?;
        let tracker_template =
            SourceTracker::new(source_tracker).map_err(ControlError::SourceTracker)?;
        let load_windows = LoadWindows::new(load_window_ms, 0, std::iter::empty())
            .map_err(ControlError::LoadWindow)?;
        Ok(ControlPlane {
            relay,
            view: DiscoveryView::new(scope),
            instances: BTreeMap::new(),
            adverts: AdvertTable::new(),
            sources: BTreeMap::new(),
            host,
            starting: BTreeMap::new(),
            pools: BTreeMap::new(),
            kv_routes: BTreeMap::new(),
            tracker_template,
            availability: AvailabilityStore::new(),
            availability_owners: BTreeMap::new(),
            topology: TopologyState::new(ambiguity_policy),
            load_windows,
            catalog_revision_seen: 0,
            counters: ControlCounters::default(),
            last_error: None,
            now_last: Duration::ZERO,
            host_recoveries: BTreeMap::new(),
            early_loads: EarlyLoads::default(),
        })
    }

    // ---- inputs --------------------------------------------------------------------------

    /// Take one DC fact at `now` and return the commands it causes. `rng` supplies the
    /// recovery jitter of newly activated ranks. Never panics; inputs that change nothing or
    /// cannot be routed are counted in [`ControlPlane::counters`].
    #[must_use = "commands must be executed in order"]
    pub fn handle(
        &mut self,
        input: DcInput,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let now = self.advance_clock(now);
        self.counters.inputs = self.counters.inputs.saturating_add(1);
        let mut out = Vec::new();
        let dirty = match input {
            DcInput::CardUpserted { id, card } => self.on_cards(CardChange::Upserted { id, card }),
            DcInput::CardRemoved { id } => self.on_cards(CardChange::Removed { id }),
            DcInput::CardTaintsUpdated { id, taints_json } => {
                self.on_cards(CardChange::TaintsUpdated { id, taints_json })
            }
            DcInput::CardsListed { cards } => self.on_cards(CardChange::Listed { cards }),
            DcInput::Instances(listing) => self.on_instances(listing),
            DcInput::SourceAdvertised(advert) => self.on_advertised(advert),
            DcInput::SourceWithdrawn { kv_state_endpoint, publisher_id } => {
                self.on_withdrawn(&kv_state_endpoint, publisher_id)
            }
            // Events and load reports change no membership, catalog or availability: they only
            // reach the pools they are routed to.
            DcInput::KvEvents(batch) => {
                self.route_events(batch, now, rng, &mut out);
                self.audit();
                return out;
            }
            DcInput::Load { endpoint, observation } => {
                self.route_load(&endpoint, &observation, now);
                self.audit();
                return out;
            }
        };
        self.settle(dirty, Vec::new(), now, rng, &mut out);
        self.audit();
        out
    }

    /// Take one outcome the shell reports and return the commands it causes.
    #[must_use = "commands must be executed in order"]
    pub fn report(
        &mut self,
        report: ShellReport,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let now = self.advance_clock(now);
        let mut out = Vec::new();
        let mut host_commands = Vec::new();
        match report {
            ShellReport::PoolFault { endpoint, layout_generation, fault } => {
                return self.pool_fault(endpoint, layout_generation, fault, now, rng);
            }
            ShellReport::StartSucceeded { endpoint, layout_generation } => {
                self.count_unless(self.is_starting(&endpoint, layout_generation));
                host_commands = self.host.start_succeeded(&endpoint, layout_generation, now);
            }
            ShellReport::StartFailed { endpoint, layout_generation } => {
                self.count_unless(self.is_starting(&endpoint, layout_generation));
                host_commands = self.host.start_failed(&endpoint, layout_generation, now);
            }
            ShellReport::RecoveryAnswered { endpoint, layout_generation, request_id, response } => {
                let input = SourceInput::RecoveryAnswered { request_id, response };
                self.deliver_to_tracker(&endpoint, layout_generation, input, now, rng, &mut out);
            }
            ShellReport::RecoveryUnreachable {
                endpoint,
                layout_generation,
                request_id,
                failure,
            } => {
                let input = SourceInput::RecoveryUnreachable { request_id, failure };
                self.deliver_to_tracker(&endpoint, layout_generation, input, now, rng, &mut out);
            }
            ShellReport::ApplyFailed { endpoint, layout_generation, fault } => {
                let input = SourceInput::ApplyFailed {
                    source: fault.source,
                    fence: fault.fence,
                    disposition: fault.error.disposition(),
                };
                self.deliver_to_tracker(&endpoint, layout_generation, input, now, rng, &mut out);
            }
            ShellReport::PoolFaultReport { endpoint, layout_generation, fault } => {
                self.count_unless(self.is_active(&endpoint, layout_generation));
                host_commands =
                    self.host.report_pool_fault(&endpoint, layout_generation, fault, now);
            }
            ShellReport::GenerationFenced { pool_id, layout_generation } => {
                let active = self.pools.values().any(|pool| {
                    pool.producer.pool_id() == pool_id
                        && pool.producer.layout_generation() == layout_generation
                });
                self.count_unless(active);
                host_commands = self.host.fence_generation(pool_id, layout_generation, now);
            }
            ShellReport::LoadStreamInterrupted { endpoint, layout_generation } => {
                match self.pools.get_mut(&endpoint) {
                    Some(pool) if pool.producer.layout_generation() == layout_generation => {
                        pool.load.clear_observations();
                        self.early_loads.forget(&endpoint);
                        self.counters.load_streams_interrupted =
                            self.counters.load_streams_interrupted.saturating_add(1);
                    }
                    _ => self.count_unless(false),
                }
            }
        }
        self.settle(Dirty::default(), host_commands, now, rng, &mut out);
        self.audit();
        out
    }

    /// A pool fault, as its two reports in order: the rank's tracker, then the host's fault
    /// coalescing with the fault's fence as the source epoch.
    fn pool_fault(
        &mut self,
        endpoint: EndpointPath,
        layout_generation: u64,
        fault: PoolFault,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let coalesced = PoolFaultReport {
            source: fault.source,
            source_epoch: fault.fence.0,
            action: PoolFaultAction::from(fault.error.disposition()),
        };
        let failed =
            ShellReport::ApplyFailed { endpoint: endpoint.clone(), layout_generation, fault };
        let mut out = self.report(failed, now, rng);
        let report = ShellReport::PoolFaultReport { endpoint, layout_generation, fault: coalesced };
        out.extend(self.report(report, now, rng));
        out
    }

    /// Shortcut for [`ShellReport::StartSucceeded`]: the generation's pool runs. The host
    /// publishes it (unless its binding changed meanwhile), and its tracker starts from the
    /// endpoint's current source view (cold reset and recovery of every active rank).
    #[must_use = "commands must be executed in order"]
    pub fn start_succeeded(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let report = ShellReport::StartSucceeded { endpoint: endpoint.clone(), layout_generation };
        self.report(report, now, rng)
    }

    /// Shortcut for [`ShellReport::StartFailed`]: the host releases the generation and retries
    /// after its backoff (see [`ControlPlane::poll_timeout`]).
    #[must_use = "commands must be executed in order"]
    pub fn start_failed(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let report = ShellReport::StartFailed { endpoint: endpoint.clone(), layout_generation };
        self.report(report, now, rng)
    }

    /// Shortcut for [`ShellReport::RecoveryAnswered`].
    #[must_use = "commands must be executed in order"]
    pub fn recovery_answered(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        request_id: RecoveryRequestId,
        response: RecoveryResponse,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<ControlCommand> {
        let report = ShellReport::RecoveryAnswered {
            endpoint: endpoint.clone(),
            layout_generation,
            request_id,
            response,
        };
        self.report(report, now, rng)
    }

    /// When [`ControlPlane::handle_timeout`] should next be called: the earliest host retry or
    /// tracker timer.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.pools
            .values()
            .filter_map(|pool| pool.tracker.poll_timeout())
            .chain(self.host.poll_timeout())
            .min()
    }

    /// Run every timer due at `now`: host retries (new starts), then each pool's recovery
    /// timers, in endpoint order.
    #[must_use = "commands must be executed in order"]
    pub fn handle_timeout(&mut self, now: Duration, rng: &mut RelayRng) -> Vec<ControlCommand> {
        let now = self.advance_clock(now);
        let mut out = Vec::new();
        let host_commands = self.host.handle_timeout(now);
        self.settle(Dirty::default(), host_commands, now, rng, &mut out);
        for (endpoint, pool) in &mut self.pools {
            let commands = pool.tracker.handle_timeout(now);
            push_tagged(endpoint, pool.producer, commands, &mut out);
        }
        // A released replacement or an exhausted attempt may have settled a host recovery.
        let resolved = self.resolve_host_recoveries(now);
        if !resolved.is_empty() {
            self.settle(Dirty::default(), resolved, now, rng, &mut out);
        }
        self.audit();
        out
    }

    /// Withdraw and stop every generation and publish an empty topology; nothing starts again
    /// and later recomputes of the topology are refused.
    #[must_use = "commands must be executed in order"]
    pub fn begin_shutdown(&mut self, now: Duration, rng: &mut RelayRng) -> Vec<ControlCommand> {
        let now = self.advance_clock(now);
        let mut out = Vec::new();
        let host_commands = self.host.begin_shutdown(now);
        // Cleared first, so the settle below cannot publish an intermediate topology (the
        // recompute is refused once stopped); the empty one is published last, as always.
        let cleared = self.topology.clear();
        self.settle(Dirty::default(), host_commands, now, rng, &mut out);
        if let TopologyOutcome::Published { revision } = cleared {
            out.push(ControlCommand::PublishTopology { revision });
        }
        self.audit();
        out
    }

    /// Cut the next load window at wall-clock `observed_ms`: one entry per cataloged producer,
    /// sorted by producer. Window numbers start at 1 (window 0 is the empty window at start).
    pub fn load_window(
        &mut self,
        observed_ms: u64,
    ) -> Result<LoadWindow<ProducerIdentity>, LoadWindowError> {
        let pools = self.pools.values().map(|pool| (pool.producer, pool.load.snapshot()));
        self.load_windows.tick(observed_ms, pools).cloned()
    }

    // ---- outputs and diagnostics ---------------------------------------------------------

    /// The relay this plane publishes for.
    #[must_use]
    pub fn relay(&self) -> RelayIdentity {
        self.relay
    }

    /// The complete current catalog (what `PublishCatalog` makes visible).
    #[must_use]
    pub fn catalog_snapshot(&self) -> CatalogSnapshot {
        self.host.catalog_snapshot()
    }

    /// Number of pools in the catalog (without copying it).
    #[must_use]
    pub fn catalog_len(&self) -> usize {
        self.host.catalog().len()
    }

    /// The current topology entries and revision (what `PublishTopology` makes visible).
    #[must_use]
    pub fn topology_snapshot(&self) -> TopologySnapshot {
        self.topology.snapshot()
    }

    /// The window last cut by [`ControlPlane::load_window`] (window 0 before the first tick),
    /// for a new load subscriber.
    #[must_use]
    pub fn current_load_window(&self) -> &LoadWindow<ProducerIdentity> {
        self.load_windows.current()
    }

    /// The health summary.
    #[must_use]
    pub fn health(&self) -> ControlHealth {
        let host = self.host.health();
        ControlHealth {
            healthy: host.healthy && self.last_error.is_none(),
            host,
            control_last_error: self.last_error.clone(),
            catalog_revision: self.host.catalog().revision(),
            topology_revision: self.topology.revision(),
            pool_count: self.pools.len(),
            degraded_load_coverage_pool_count: self
                .pools
                .values()
                .filter(|pool| pool.load.snapshot().degraded)
                .count(),
            counters: self.counters,
        }
    }

    /// Endpoints whose latest instance listing is held (at most
    /// [`INSTANCE_LISTINGS_MAX`]).
    #[must_use]
    pub fn instance_listings(&self) -> usize {
        self.instances.len()
    }

    /// Input counters.
    #[must_use]
    pub fn counters(&self) -> &ControlCounters {
        &self.counters
    }

    /// The discovery view (cards and memberships).
    #[must_use]
    pub fn discovery(&self) -> &DiscoveryView {
        &self.view
    }

    /// The endpoint host (slots, registry, catalog).
    #[must_use]
    pub fn host(&self) -> &EndpointHost {
        &self.host
    }

    /// The availability store the topology reads.
    #[must_use]
    pub fn availability(&self) -> &AvailabilityStore {
        &self.availability
    }

    /// The latest KV source view of a discovered serving endpoint.
    #[must_use]
    pub fn source_view(&self, endpoint: &EndpointPath) -> Option<&SourceView> {
        self.sources.get(endpoint).map(|sources| &sources.view)
    }

    /// The producer of `endpoint`'s active (cataloged) pool.
    #[must_use]
    pub fn active_producer(&self, endpoint: &EndpointPath) -> Option<ProducerIdentity> {
        self.pools.get(endpoint).map(|pool| pool.producer)
    }

    /// Whether the host's recovery call for `endpoint` is waiting for its rank's recovery.
    #[must_use]
    pub fn host_recovery_in_flight(&self, endpoint: &EndpointPath) -> bool {
        self.host_recoveries.contains_key(endpoint)
    }

    /// The source tracker of `endpoint`'s active pool.
    #[must_use]
    pub fn tracker(&self, endpoint: &EndpointPath) -> Option<&SourceTracker> {
        self.pools.get(endpoint).map(|pool| &pool.tracker)
    }

    /// The current load of `endpoint`'s active pool.
    #[must_use]
    pub fn pool_load(&self, endpoint: &EndpointPath) -> Option<PoolLoadSnapshot> {
        self.pools.get(endpoint).map(|pool| pool.load.snapshot())
    }

    /// Verify the invariants of the module docs, including every tracker's own (O(state); the
    /// plane runs the structural part after every structural change, tests run all of it).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_structure()?;
        let memberships = self.view.memberships();
        if let Some(endpoint) = self.instances.iter().find_map(|(endpoint, listing)| {
            (listing.live_workers.is_empty() && !memberships.contains_key(endpoint))
                .then_some(endpoint)
        }) {
            return Err(format!("{endpoint} keeps an empty instance listing without a card"));
        }
        self.host.check_invariants().map_err(|error| format!("host: {error}"))?;
        for (endpoint, pool) in &self.pools {
            pool.tracker.check_invariants().map_err(|error| format!("{endpoint}: {error}"))?;
        }
        self.early_loads.check_invariants().map_err(|error| format!("early loads: {error}"))
    }

    // ---- input handlers ------------------------------------------------------------------

    fn on_cards(&mut self, change: CardChange) -> Dirty {
        let changes = self.view.apply(change);
        if changes.is_empty() {
            self.counters.card_inputs_without_effect =
                self.counters.card_inputs_without_effect.saturating_add(1);
            return Dirty::default();
        }
        Dirty { memberships: true, sources: true, availability: false }
    }

    fn on_instances(&mut self, listing: EndpointInstances) -> Dirty {
        let EndpointInstances { endpoint, live_workers } = listing;
        let held = self.instances.get(&endpoint);
        let undiscovered = self.view.membership(&endpoint).is_none();
        let listed_empty = match &live_workers {
            Some(live_workers) => live_workers.is_empty(),
            None => held.is_none_or(|held| held.live_workers.is_empty()),
        };
        if undiscovered && listed_empty {
            // An empty listing of an endpoint no card serves holds nothing a fresh relay would:
            // it goes, so departed endpoints never fill the listing table.
            if self.instances.remove(&endpoint).is_some() {
                self.counters.instance_listings_pruned =
                    self.counters.instance_listings_pruned.saturating_add(1);
            }
            return Dirty::default();
        }
        if held.is_none() && self.instances.len() >= INSTANCE_LISTINGS_MAX {
            self.counters.instance_listings_refused =
                self.counters.instance_listings_refused.saturating_add(1);
            return Dirty::default();
        }
        let previous = held.cloned().unwrap_or_default();
        let next = match live_workers {
            Some(live_workers) => InstanceListing { authoritative: true, live_workers },
            None => InstanceListing { authoritative: false, ..previous.clone() },
        };
        if held == Some(&next) {
            self.counters.instance_listings_unchanged =
                self.counters.instance_listings_unchanged.saturating_add(1);
            return Dirty::default();
        }
        let mut dirty = Dirty {
            memberships: false,
            sources: next.live_workers != previous.live_workers
                && self.view.membership(&endpoint).is_some(),
            availability: false,
        };
        if let Some(owner) = self.availability_owners.get(&endpoint) {
            dirty.availability =
                self.availability.replace(&endpoint, *owner, next.availability()).changed();
        }
        self.instances.insert(endpoint, next);
        dirty
    }

    fn on_advertised(&mut self, advert: KvEventSourceAdvert) -> Dirty {
        let counters = &mut self.counters;
        let changed = match self.adverts.advertise(advert) {
            Ok(AdvertChange::Added) => {
                counters.adverts_added = counters.adverts_added.saturating_add(1);
                true
            }
            Ok(AdvertChange::Conflicting) => {
                counters.adverts_conflicting = counters.adverts_conflicting.saturating_add(1);
                true
            }
            Ok(AdvertChange::Unchanged) => {
                counters.adverts_repeated = counters.adverts_repeated.saturating_add(1);
                false
            }
            Err(_) => {
                counters.adverts_refused = counters.adverts_refused.saturating_add(1);
                false
            }
        };
        Dirty { memberships: false, sources: changed, availability: false }
    }

    fn on_withdrawn(&mut self, kv_state_endpoint: &EndpointPath, publisher_id: u64) -> Dirty {
        let removed = self.adverts.withdraw(kv_state_endpoint, publisher_id);
        if removed == 0 {
            self.counters.withdrawals_unknown = self.counters.withdrawals_unknown.saturating_add(1);
        }
        Dirty { memberships: false, sources: removed > 0, availability: false }
    }

    /// Hand a batch to every active pool publishing under its endpoint scope; the last one
    /// takes the batch, earlier ones a copy.
    fn route_events(
        &mut self,
        batch: KvEventBatch,
        now: Duration,
        rng: &mut RelayRng,
        out: &mut Vec<ControlCommand>,
    ) {
        let Some(serving) = self.kv_routes.get(&batch.endpoint) else {
            self.counters.kv_batches_unrouted = self.counters.kv_batches_unrouted.saturating_add(1);
            return;
        };
        let serving: Vec<EndpointPath> = serving.iter().cloned().collect();
        self.counters.kv_batches_routed = self.counters.kv_batches_routed.saturating_add(1);
        let mut batch = Some(batch);
        let mut targets = serving.into_iter().peekable();
        while let Some(endpoint) = targets.next() {
            let input = if targets.peek().is_some() { batch.clone() } else { batch.take() };
            let (Some(input), Some(pool)) = (input, self.pools.get_mut(&endpoint)) else {
                continue;
            };
            let commands = pool.tracker.handle(SourceInput::Events(input), now, rng);
            push_tagged(&endpoint, pool.producer, commands, out);
        }
    }

    fn route_load(
        &mut self,
        endpoint: &EndpointPath,
        observation: &LoadObservation,
        now: Duration,
    ) {
        let outcome = self.pools.get_mut(endpoint).map(|pool| pool.load.observe(observation));
        let counters = &mut self.counters;
        let counter = match outcome {
            Some(ObserveOutcome::Recorded) => &mut counters.load_reports_recorded,
            Some(ObserveOutcome::Advisory) => &mut counters.load_reports_advisory,
            Some(ObserveOutcome::UnknownRank) => &mut counters.load_reports_unknown_rank,
            None => &mut counters.load_reports_unrouted,
        };
        *counter = counter.saturating_add(1);
        if matches!(outcome, None | Some(ObserveOutcome::UnknownRank)) {
            self.keep_early(endpoint, observation, now);
        }
    }

    /// Keep a worker report whose rank no pool expects yet, for when one does.
    fn keep_early(
        &mut self,
        endpoint: &EndpointPath,
        observation: &LoadObservation,
        now: Duration,
    ) {
        let Some(used_blocks) = observation.kv_used_blocks else { return };
        let forgotten = self.early_loads.keep(endpoint, observation.source, used_blocks, now);
        self.counters.early_load_reports_forgotten =
            self.counters.early_load_reports_forgotten.saturating_add(forgotten);
    }

    /// Hand a shell report to the tracker of `endpoint`'s active generation `layout_generation`.
    fn deliver_to_tracker(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        input: SourceInput,
        now: Duration,
        rng: &mut RelayRng,
        out: &mut Vec<ControlCommand>,
    ) {
        match self.pools.get_mut(endpoint) {
            Some(pool) if pool.producer.layout_generation() == layout_generation => {
                let commands = pool.tracker.handle(input, now, rng);
                push_tagged(endpoint, pool.producer, commands, out);
            }
            _ => self.count_unless(false),
        }
    }

    // ---- composition ---------------------------------------------------------------------

    /// End of a step. Debug builds (tests and the simulator) verify every invariant, the
    /// trackers' and the host's included, after every step; release builds rely on the
    /// structural check [`ControlPlane::settle`] runs. The first violation is kept in
    /// [`ControlHealth::control_last_error`] and makes the plane unhealthy; it never panics.
    fn audit(&mut self) {
        if cfg!(debug_assertions)
            && self.last_error.is_none()
            && let Err(error) = self.check_invariants()
        {
            self.last_error = Some(error);
        }
    }

    /// Bring every derived state in line after an input: source views, host, pools, trackers,
    /// availability, load capacity and topology, in that order.
    fn settle(
        &mut self,
        dirty: Dirty,
        mut host_commands: Vec<HostCommand>,
        now: Duration,
        rng: &mut RelayRng,
        out: &mut Vec<ControlCommand>,
    ) {
        if dirty.memberships || dirty.sources {
            let views_changed = self.reproject_sources();
            if dirty.memberships || views_changed {
                let bindings = self.source_bindings();
                host_commands.extend(self.host.reconcile(self.view.memberships(), &bindings, now));
            }
        }
        host_commands.extend(self.resolve_host_recoveries(now));
        self.absorb_host_commands(host_commands, out);
        self.sync_pools();
        let availability_changed = self.sync_availability() | dirty.availability;
        self.feed_views(now, rng, out);
        // A fed view may have replaced or removed a rank a host recovery waits for.
        let resolved = self.resolve_host_recoveries(now);
        if !resolved.is_empty() {
            self.absorb_host_commands(resolved, out);
            self.sync_pools();
            self.feed_views(now, rng, out);
        }
        self.refresh_capacities(now);

        let catalog_revision = self.host.catalog().revision();
        if dirty.memberships
            || availability_changed
            || catalog_revision != self.catalog_revision_seen
        {
            self.catalog_revision_seen = catalog_revision;
            self.publish_topology(out);
        }
        if let Err(error) = self.check_structure() {
            self.last_error = Some(error);
        }
    }

    /// Re-project every discovered endpoint's KV source membership; returns whether any view
    /// changed. Memberships of endpoints that left discovery are dropped (a returning endpoint
    /// starts a fresh membership, and its new pool generation a fresh tracker).
    fn reproject_sources(&mut self) -> bool {
        let memberships = self.view.memberships();
        let before = self.sources.len();
        self.sources.retain(|endpoint, _| memberships.contains_key(endpoint));
        let listings = self.instances.len();
        self.instances.retain(|endpoint, listing| {
            !listing.live_workers.is_empty() || memberships.contains_key(endpoint)
        });
        let pruned = (listings - self.instances.len()) as u64;
        self.counters.instance_listings_pruned =
            self.counters.instance_listings_pruned.saturating_add(pruned);
        let mut changed = self.sources.len() != before;
        let no_workers = BTreeSet::new();
        for (endpoint, membership) in memberships {
            let live_workers =
                self.instances.get(endpoint).map_or(&no_workers, |listing| &listing.live_workers);
            match self.sources.get_mut(endpoint) {
                Some(sources) => {
                    let view = sources.membership.project(
                        &membership.runtime_configs,
                        live_workers,
                        self.adverts.iter(),
                    );
                    if view != sources.view {
                        sources.view = view;
                        changed = true;
                    }
                }
                None => {
                    let mut source_membership = KvSourceMembership::new(endpoint.clone());
                    let view = source_membership.project(
                        &membership.runtime_configs,
                        live_workers,
                        self.adverts.iter(),
                    );
                    self.sources.insert(
                        endpoint.clone(),
                        EndpointSources { membership: source_membership, view },
                    );
                    changed = true;
                }
            }
        }
        changed
    }

    /// The host's summary of every discovered endpoint's KV sources.
    fn source_bindings(&self) -> BTreeMap<EndpointPath, SourceBinding> {
        self.sources
            .iter()
            .map(|(endpoint, sources)| {
                let binding = SourceBinding {
                    resolved_kv_state_endpoint: sources.view.resolved_kv_state_endpoint().cloned(),
                    any_active_rank: sources.view.has_active_source(),
                };
                (endpoint.clone(), binding)
            })
            .collect()
    }

    /// Pass host commands through, remembering which generations are starting.
    fn absorb_host_commands(&mut self, commands: Vec<HostCommand>, out: &mut Vec<ControlCommand>) {
        for command in commands {
            match &command {
                HostCommand::StartPool { endpoint, producer, kv_state_endpoint, .. } => {
                    self.starting.insert(
                        endpoint.clone(),
                        StartingGeneration {
                            layout_generation: producer.layout_generation(),
                            kv_state_endpoint: kv_state_endpoint.clone(),
                        },
                    );
                }
                HostCommand::ReleasePool { endpoint, layout_generation, .. } => {
                    if self
                        .starting
                        .get(endpoint)
                        .is_some_and(|start| start.layout_generation == *layout_generation)
                    {
                        self.starting.remove(endpoint);
                    }
                }
                HostCommand::RecoverSource { endpoint, layout_generation, fault, .. } => {
                    let watched = self.pools.get(endpoint).is_some_and(|pool| {
                        pool.producer.layout_generation() == *layout_generation
                            && pool
                                .tracker
                                .rank(fault.source)
                                .is_some_and(|rank| rank.mode == RankMode::Recoverable)
                    });
                    let recovery = HostRecovery {
                        layout_generation: *layout_generation,
                        source: fault.source,
                        watched,
                    };
                    let previous = self.host_recoveries.insert(endpoint.clone(), recovery);
                    debug_assert!(
                        previous.is_none_or(|previous| previous.layout_generation
                            != *layout_generation),
                        "the host makes one recovery call per endpoint at a time"
                    );
                    // Answered by the plane (resolve_host_recoveries), never by the shell.
                    continue;
                }
                HostCommand::WithdrawPool { .. }
                | HostCommand::PublishCatalog { .. }
                | HostCommand::StopPool { .. } => {}
            }
            out.push(ControlCommand::Host(command));
        }
    }

    /// Answer every host recovery call whose rank's recovery has settled, in endpoint order;
    /// returns the host's commands. Calls of generations that are no longer active are dropped
    /// (the host ignores their outcome anyway).
    fn resolve_host_recoveries(&mut self, now: Duration) -> Vec<HostCommand> {
        let mut commands = Vec::new();
        if self.host_recoveries.is_empty() {
            return commands;
        }
        let mut settled = Vec::new();
        for (endpoint, recovery) in &self.host_recoveries {
            let pool = self
                .pools
                .get(endpoint)
                .filter(|pool| pool.producer.layout_generation() == recovery.layout_generation);
            let Some(pool) = pool else {
                settled.push((endpoint.clone(), None));
                continue;
            };
            if let Some(disposition) = host_recovery_outcome(&pool.tracker, recovery) {
                settled.push((endpoint.clone(), Some((recovery.layout_generation, disposition))));
            }
        }
        for (endpoint, outcome) in settled {
            self.host_recoveries.remove(&endpoint);
            if let Some((layout_generation, disposition)) = outcome {
                commands.extend(self.host.source_recovery_finished(
                    &endpoint,
                    layout_generation,
                    disposition,
                    now,
                ));
            }
        }
        commands
    }

    /// Make the active pools exactly the catalog: drop generations that left it (their
    /// withdrawal is already among the commands), add generations that entered it.
    fn sync_pools(&mut self) {
        let catalog: BTreeMap<EndpointPath, ProducerIdentity> = self
            .host
            .catalog()
            .descriptors()
            .map(|descriptor| (descriptor.serving_endpoint.clone(), descriptor.producer))
            .collect();
        let retired: Vec<EndpointPath> = self
            .pools
            .iter()
            .filter(|(endpoint, pool)| catalog.get(*endpoint) != Some(&pool.producer))
            .map(|(endpoint, _)| endpoint.clone())
            .collect();
        for endpoint in retired {
            if let Some(pool) = self.pools.remove(&endpoint) {
                self.unroute(&pool.kv_state_endpoint, &endpoint);
            }
        }
        for (endpoint, producer) in catalog {
            if self.pools.contains_key(&endpoint) {
                continue;
            }
            let pool = self.new_pool(&endpoint, producer);
            self.kv_routes
                .entry(pool.kv_state_endpoint.clone())
                .or_default()
                .insert(endpoint.clone());
            self.pools.insert(endpoint, pool);
        }
    }

    /// The state of a generation that just entered the catalog.
    fn new_pool(&mut self, endpoint: &EndpointPath, producer: ProducerIdentity) -> ActivePool {
        let started = self
            .starting
            .remove(endpoint)
            .filter(|start| start.layout_generation == producer.layout_generation());
        let kv_state_endpoint = match started {
            Some(start) => start.kv_state_endpoint,
            // Only reachable if the host published a generation it never started (its own
            // invariant failure): fall back to the endpoint's current resolution.
            None => self
                .sources
                .get(endpoint)
                .and_then(|sources| sources.view.resolved_kv_state_endpoint().cloned())
                .unwrap_or_else(|| endpoint.clone()),
        };
        let capacity_configs = self
            .view
            .membership(endpoint)
            .map(|membership| membership.runtime_configs.clone())
            .unwrap_or_default();
        let (load, rejected) = PoolLoadState::attach(
            capacity_configs.iter().map(|(worker, config)| (*worker, config)),
        );
        if rejected.is_some() {
            self.counters.capacity_updates_rejected =
                self.counters.capacity_updates_rejected.saturating_add(1);
        }
        ActivePool {
            producer,
            kv_state_endpoint,
            tracker: self.tracker_template.clone(),
            view_fed: None,
            load,
            capacity_configs,
        }
    }

    fn unroute(&mut self, kv_state_endpoint: &EndpointPath, serving: &EndpointPath) {
        if let Some(routes) = self.kv_routes.get_mut(kv_state_endpoint) {
            routes.remove(serving);
            if routes.is_empty() {
                self.kv_routes.remove(kv_state_endpoint);
            }
        }
    }

    /// Claim every discovered endpoint's availability under its host slot incarnation (a new
    /// owner starts from the endpoint's latest listing) and release endpoints that left
    /// discovery or changed slot. Returns whether availability changed.
    fn sync_availability(&mut self) -> bool {
        let mut changed = false;
        let owners: Vec<(EndpointPath, SlotIncarnation)> = self
            .availability_owners
            .iter()
            .map(|(endpoint, owner)| (endpoint.clone(), *owner))
            .collect();
        for (endpoint, owner) in owners {
            let current = self.slot_incarnation(&endpoint);
            if self.view.membership(&endpoint).is_none() || current != Some(owner) {
                let _ = self.availability.release(&endpoint, owner);
                self.availability_owners.remove(&endpoint);
                changed = true;
            }
        }
        let endpoints: Vec<EndpointPath> = self.view.memberships().keys().cloned().collect();
        for endpoint in endpoints {
            let Some(slot) = self.slot_incarnation(&endpoint) else {
                continue;
            };
            if let ClaimOutcome::Claimed { .. } = self.availability.claim(&endpoint, slot) {
                let listing = self.instances.get(&endpoint).and_then(InstanceListing::availability);
                let _ = self.availability.replace(&endpoint, slot, listing);
                self.availability_owners.insert(endpoint, slot);
                changed = true;
            }
        }
        changed
    }

    fn slot_incarnation(&self, endpoint: &EndpointPath) -> Option<SlotIncarnation> {
        self.host.slot(endpoint).map(|slot| SlotIncarnation(slot.slot_incarnation))
    }

    /// Hand each active pool's tracker the endpoint's view if it changed since the last one.
    fn feed_views(&mut self, now: Duration, rng: &mut RelayRng, out: &mut Vec<ControlCommand>) {
        for (endpoint, pool) in &mut self.pools {
            let Some(sources) = self.sources.get(endpoint) else {
                continue;
            };
            if pool.view_fed.as_ref() == Some(&sources.view) {
                continue;
            }
            pool.view_fed = Some(sources.view.clone());
            let commands = pool.tracker.handle(SourceInput::View(sources.view.clone()), now, rng);
            push_tagged(endpoint, pool.producer, commands, out);
        }
    }

    /// Re-derive each active pool's expected ranks and capacity when its runtime configs
    /// changed (a rejected update leaves the load empty, degraded, never stale), and record the
    /// early reports of the ranks it now expects.
    fn refresh_capacities(&mut self, now: Duration) {
        for (endpoint, pool) in &mut self.pools {
            if let Some(membership) = self.view.membership(endpoint)
                && pool.capacity_configs != membership.runtime_configs
            {
                let workers =
                    membership.runtime_configs.iter().map(|(worker, config)| (*worker, config));
                if pool.load.set_capacity(workers).is_err() {
                    pool.load.clear();
                    self.counters.capacity_updates_rejected =
                        self.counters.capacity_updates_rejected.saturating_add(1);
                }
                pool.capacity_configs.clone_from(&membership.runtime_configs);
            }
            if self.early_loads.is_empty() {
                continue;
            }
            // Reports that came before the pool expected their rank (a new pool, or a rank
            // that just joined it).
            let early =
                self.early_loads.take_expected(endpoint, now, |rank| pool.load.expects(rank));
            for (source, used_blocks) in early {
                let observation = LoadObservation {
                    source,
                    kv_used_blocks: Some(used_blocks),
                    active_decode_blocks: None,
                    active_prefill_tokens: None,
                };
                if matches!(pool.load.observe(&observation), ObserveOutcome::Recorded) {
                    self.counters.early_load_reports_recorded =
                        self.counters.early_load_reports_recorded.saturating_add(1);
                }
            }
        }
    }

    /// Recompute the topology against the catalog's pool links; emit a publication when the
    /// revision moved.
    fn publish_topology(&mut self, out: &mut Vec<ControlCommand>) {
        let links = catalog_links(&self.host);
        if let TopologyOutcome::Published { revision } =
            self.topology.recompute(self.view.memberships(), &self.availability, &links)
        {
            out.push(ControlCommand::PublishTopology { revision });
        }
    }

    // ---- bookkeeping ---------------------------------------------------------------------

    /// `now` never goes backwards: an earlier value is treated as the latest seen.
    fn advance_clock(&mut self, now: Duration) -> Duration {
        self.now_last = self.now_last.max(now);
        self.now_last
    }

    /// Whether `layout_generation` of `endpoint` is a start the plane waits for (its outcome
    /// is not yet reported, and nothing gave it up meanwhile).
    #[must_use]
    pub fn is_starting(&self, endpoint: &EndpointPath, layout_generation: u64) -> bool {
        self.starting
            .get(endpoint)
            .is_some_and(|start| start.layout_generation == layout_generation)
    }

    fn is_active(&self, endpoint: &EndpointPath, layout_generation: u64) -> bool {
        self.pools
            .get(endpoint)
            .is_some_and(|pool| pool.producer.layout_generation() == layout_generation)
    }

    /// Count a stale shell report unless `current`.
    fn count_unless(&mut self, current: bool) {
        if !current {
            self.counters.shell_reports_stale = self.counters.shell_reports_stale.saturating_add(1);
        }
    }

    /// The structural invariants (cheap: O(pools + endpoints + topology)).
    fn check_structure(&self) -> Result<(), String> {
        let catalog = self.host.catalog();
        if catalog.len() != self.pools.len() {
            return Err(format!(
                "{} cataloged pools but {} active pool states",
                catalog.len(),
                self.pools.len()
            ));
        }
        for descriptor in catalog.descriptors() {
            let endpoint = &descriptor.serving_endpoint;
            if self.pools.get(endpoint).map(|pool| pool.producer) != Some(descriptor.producer) {
                return Err(format!("cataloged pool of {endpoint} has no matching pool state"));
            }
            let slot = self.host.slot(endpoint);
            let active = slot.as_ref().is_some_and(|slot| {
                slot.producer == Some(descriptor.producer)
                    && matches!(slot.lifecycle, SlotLifecycle::Active | SlotLifecycle::Draining)
            });
            if !active {
                return Err(format!("{endpoint} is cataloged without an active generation"));
            }
        }
        let mut routes: BTreeMap<EndpointPath, BTreeSet<EndpointPath>> = BTreeMap::new();
        for (endpoint, pool) in &self.pools {
            routes.entry(pool.kv_state_endpoint.clone()).or_default().insert(endpoint.clone());
        }
        if routes != self.kv_routes {
            return Err("KV event routes disagree with the active pools".to_owned());
        }
        let memberships = self.view.memberships();
        if !self.sources.keys().eq(memberships.keys()) {
            return Err("source memberships disagree with discovery".to_owned());
        }
        if !self.availability_owners.keys().all(|endpoint| memberships.contains_key(endpoint)) {
            return Err("availability is owned for an undiscovered endpoint".to_owned());
        }
        for (endpoint, owner) in &self.availability_owners {
            if self.availability.owner(endpoint) != Some(*owner)
                || self.slot_incarnation(endpoint) != Some(*owner)
            {
                return Err(format!("{endpoint}: availability owner is not its host slot"));
            }
        }
        for entry in self.topology.entries() {
            for member in &entry.members {
                if let Some(pool_id) = member.pool_id
                    && catalog.descriptor(&pool_id).is_none()
                {
                    return Err(format!("topology links {pool_id}, which is not cataloged"));
                }
            }
        }
        Ok(())
    }
}

/// Tag a tracker's commands with the pool generation they are for.
/// The outcome of a host recovery call once the rank's recovery has settled; `None` while it is
/// under way.
fn host_recovery_outcome(
    tracker: &SourceTracker,
    recovery: &HostRecovery,
) -> Option<TargetDisposition> {
    if !recovery.watched {
        return Some(TargetDisposition::Recovered);
    }
    let Some(rank) = tracker.rank(recovery.source) else {
        // The rank left: its blocks went with it.
        return Some(TargetDisposition::Recovered);
    };
    if rank.recovering {
        return None;
    }
    Some(match rank.mode {
        RankMode::Recoverable | RankMode::LiveOnly => TargetDisposition::Recovered,
        RankMode::Degraded | RankMode::Fenced => TargetDisposition::Fenced,
    })
}

fn push_tagged(
    endpoint: &EndpointPath,
    producer: ProducerIdentity,
    commands: Vec<SourceCommand>,
    out: &mut Vec<ControlCommand>,
) {
    out.extend(commands.into_iter().map(|command| ControlCommand::Source {
        endpoint: endpoint.clone(),
        pool_id: producer.pool_id(),
        layout_generation: producer.layout_generation(),
        command,
    }));
}

/// Pool links from the catalog: one claim per descriptor and base model it registers.
fn catalog_links(host: &EndpointHost) -> PoolLinks {
    PoolLinks::from_claims(host.catalog().descriptors().flat_map(|descriptor| {
        descriptor.registrations.iter().filter_map(move |registration| match &registration.target {
            ModelTarget::Base { base_model } => Some((
                descriptor.serving_endpoint.clone(),
                base_model.clone(),
                descriptor.pool_id(),
            )),
            ModelTarget::Lora { .. } => None,
        })
    }))
}
