//! The relay as one state machine: the [`ControlPlane`] and every running pool generation's
//! [`PoolMachine`], composed so that the plane's pool commands are carried out here and a pool's
//! faults go straight back to the plane.
//!
//! The shell feeds inputs ([`Relay::handle`], [`Relay::report`], the outcome of a pool start,
//! timer firings, the pools' own requests through [`Relay::with_pool`]) and carries out the
//! [`RelayEffect`]s they leave, drained with [`Relay::poll_effect`] in order: catalog and
//! readiness publications (with the snapshot taken when the plane asked for them), host and
//! recovery commands, and each pool's publication points and subscription answers. A pool's
//! deltas go to the outlet `O` the shell handed over when the generation started, during the
//! call that publishes them.
//!
//! Batching: event writes are held ([`Relay::held_blocks`]) until [`Relay::flush`], or until a
//! command that must follow them reaches any pool or leaves the core; so each pool is given its
//! writes once per batch, and every pool still sees its commands in the order the plane issued
//! them.
//!
//! Invariants ([`Relay::check_invariants`], between calls):
//! - every running pool is the generation its endpoint's slot holds (a pool outlives its slot
//!   only from the plane's `StopPool` / `ReleasePool` until the shell, having ended the
//!   generation's streams, calls [`Relay::stop_pool`] / [`Relay::release_pool`]);
//! - no command is left half-executed: the work queue is empty;
//! - every pool machine's own invariants.

mod held;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

pub use held::ApplySegment;
use held::HeldWrites;

use crate::control::{ControlCommand, ControlPlane, ShellReport};
use crate::host::{CatalogSnapshot, HostCommand, StopMode};
use crate::inputs::DcInput;
use crate::load::{LoadWindow, LoadWindowError};
use crate::model::identity::{EndpointPath, PoolId, ProducerIdentity};
use crate::pool::{DeltaOutlet, PoolDigest, PoolEffect, PoolFault, PoolMachine, PoolStats};
use crate::readiness::topology::TopologySnapshot;
use crate::rng::RelayRng;
use crate::sources::SourceCommand;

/// One pool generation: its pool and layout generation.
pub type GenerationKey = (PoolId, u64);

/// The largest pool (in owned blocks) whose ownership tables [`Relay::check_invariants`] walks;
/// a larger pool has its O(1) invariants checked ([`PoolMachine::check_cadence`]), so a debug
/// build can audit after every wake-up and still keep up with its inputs.
pub const AUDIT_FULL_BLOCKS_MAX: usize = 4096;

/// Something the shell carries out, in the order emitted.
#[derive(Debug)]
pub enum RelayEffect {
    /// A command left to the shell: a host command (pool start, withdrawal, stop, release) or a
    /// recovery call (request or cancel). Never an event write, a rank reset or replacement
    /// (executed here), nor a catalog or topology publication (see the variants below).
    Command(Box<ControlCommand>),
    /// Publish this catalog (as it was when the plane asked for its publication).
    Catalog(CatalogSnapshot),
    /// Publish this readiness topology (as it was when the plane asked for its publication).
    Topology(TopologySnapshot),
    /// A pool's publication point or subscription answer ([`PoolEffect`] other than a fault:
    /// faults never leave the core).
    Pool {
        /// The generation.
        key: GenerationKey,
        /// The effect.
        effect: PoolEffect,
    },
}

/// One running pool generation.
#[derive(Debug)]
struct Running<O> {
    endpoint: EndpointPath,
    machine: PoolMachine,
    outlet: O,
}

/// The control plane and the running pools (see the module doc).
#[derive(Debug)]
pub struct Relay<O> {
    plane: ControlPlane,
    pools: BTreeMap<GenerationKey, Running<O>>,
    held: HeldWrites,
    /// Commands of the call being executed, in issue order.
    work: VecDeque<ControlCommand>,
    effects: VecDeque<RelayEffect>,
    /// Generations whose timer is due, gathered by one `handle_timeout` (kept for its buffer).
    due: Vec<GenerationKey>,
}

impl<O: DeltaOutlet> Relay<O> {
    /// A relay around `plane`, with no pool running.
    #[must_use]
    pub fn new(plane: ControlPlane) -> Self {
        Relay {
            plane,
            pools: BTreeMap::new(),
            held: HeldWrites::default(),
            work: VecDeque::new(),
            effects: VecDeque::new(),
            due: Vec::new(),
        }
    }

    /// The control plane (catalog, topology, health, load and source views).
    #[must_use]
    pub fn plane(&self) -> &ControlPlane {
        &self.plane
    }

    /// Cut the next load window ([`ControlPlane::load_window`]).
    pub fn load_window(
        &mut self,
        observed_ms: u64,
    ) -> Result<LoadWindow<ProducerIdentity>, LoadWindowError> {
        self.plane.load_window(observed_ms)
    }

    // ---- inputs ------------------------------------------------------------------------------

    /// Take one DC fact at `now` ([`ControlPlane::handle`]); its event writes are held until
    /// [`Relay::flush`].
    pub fn handle(&mut self, input: DcInput, now: Duration, rng: &mut RelayRng) {
        let commands = self.plane.handle(input, now, rng);
        self.run(commands, now, rng);
    }

    /// Take one outcome the shell reports ([`ControlPlane::report`]).
    pub fn report(&mut self, report: ShellReport, now: Duration, rng: &mut RelayRng) {
        let commands = self.plane.report(report, now, rng);
        self.run(commands, now, rng);
    }

    /// A pool start committed: `machine` runs generation `key` of `endpoint` from now on and
    /// publishes to `outlet`; the plane catalogs it. A start the plane no longer waits for (its
    /// generation was given up while its filter was allocated) runs nothing: the machine and
    /// outlet are dropped and the plane counts the stale report. Returns whether it runs.
    #[must_use = "the shell serves a generation only if it runs"]
    pub fn start_succeeded(
        &mut self,
        endpoint: &EndpointPath,
        key: GenerationKey,
        machine: PoolMachine,
        outlet: O,
        now: Duration,
        rng: &mut RelayRng,
    ) -> bool {
        let runs = self.plane.is_starting(endpoint, key.1);
        if runs {
            let running = Running { endpoint: endpoint.clone(), machine, outlet };
            let replaced = self.pools.insert(key, running);
            debug_assert!(replaced.is_none(), "a generation starts once");
        }
        let commands = self.plane.start_succeeded(endpoint, key.1, now, rng);
        self.run(commands, now, rng);
        runs
    }

    /// A pool start failed: nothing of the generation runs; the host retries after its backoff.
    pub fn start_failed(
        &mut self,
        endpoint: &EndpointPath,
        layout_generation: u64,
        now: Duration,
        rng: &mut RelayRng,
    ) {
        let commands = self.plane.start_failed(endpoint, layout_generation, now, rng);
        self.run(commands, now, rng);
    }

    /// Withdraw and stop every generation ([`ControlPlane::begin_shutdown`]).
    pub fn begin_shutdown(&mut self, now: Duration, rng: &mut RelayRng) {
        self.apply_held(now, rng);
        let commands = self.plane.begin_shutdown(now, rng);
        self.run(commands, now, rng);
    }

    /// Hand every held write to its pool, one call per generation in generation order; the
    /// faults they raise reach the plane before this returns.
    pub fn flush(&mut self, now: Duration, rng: &mut RelayRng) {
        self.apply_held(now, rng);
        self.run(Vec::new(), now, rng);
    }

    /// Blocks of event writes held for [`Relay::flush`] (an event without blocks weighs one).
    #[must_use]
    pub fn held_blocks(&self) -> usize {
        self.held.blocks()
    }

    // ---- time --------------------------------------------------------------------------------

    /// When [`Relay::handle_timeout`] is next due: the earliest of the plane's and the pools'
    /// timers.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        let pools = self.pools.values().filter_map(|running| running.machine.poll_timeout());
        pools.chain(self.plane.poll_timeout()).min()
    }

    /// When the plane's own next timer is due (host retries, recovery timers).
    #[must_use]
    pub fn plane_timeout(&self) -> Option<Duration> {
        self.plane.poll_timeout()
    }

    /// Fire every timer due at `now`: the pools' first, in generation order (their
    /// publications are outputs of writes already applied), then the plane's.
    pub fn handle_timeout(&mut self, now: Duration, rng: &mut RelayRng) {
        self.apply_held(now, rng);
        let mut due = std::mem::take(&mut self.due);
        due.extend(
            self.pools
                .iter()
                .filter(|(_, running)| running.machine.poll_timeout().is_some_and(|at| at <= now))
                .map(|(key, _)| *key),
        );
        for key in due.drain(..) {
            self.on_pool(&key, now, rng, |machine, outlet| machine.handle_timeout(now, outlet));
        }
        self.due = due;
        let mut commands = Vec::new();
        if self.plane.poll_timeout().is_some_and(|at| at <= now) {
            commands = self.plane.handle_timeout(now, rng);
        }
        self.run(commands, now, rng);
    }

    // ---- pools -------------------------------------------------------------------------------

    /// Run `serve` on a running generation's machine and outlet (a subscription, a barrier, a
    /// lease retirement, a flush, counters); `None` when `key` is not running. Held writes go
    /// first, and what the call raises is carried out like any pool's.
    pub fn with_pool<R>(
        &mut self,
        key: &GenerationKey,
        now: Duration,
        rng: &mut RelayRng,
        serve: impl FnOnce(&mut PoolMachine, &mut O) -> R,
    ) -> Option<R> {
        if !self.pools.contains_key(key) {
            return None;
        }
        self.apply_held(now, rng);
        let answer = self.on_pool(key, now, rng, serve);
        self.run(Vec::new(), now, rng);
        answer
    }

    /// Counters of a running generation.
    #[must_use]
    pub fn pool_stats(&self, key: &GenerationKey) -> Option<PoolStats> {
        self.pools.get(key).map(|running| running.machine.stats())
    }

    /// Running generations, in order.
    pub fn running(&self) -> impl Iterator<Item = &GenerationKey> {
        self.pools.keys()
    }

    /// Stop a generation the plane asked to stop (`StopPool`): gracefully (publish the tail,
    /// retire the lease) or by fencing it (the unpublished tail is discarded). Returns its
    /// outlet; `None` when it was not running.
    pub fn stop_pool(&mut self, key: &GenerationKey, mode: StopMode) -> Option<O> {
        let mut running = self.pools.remove(key)?;
        if mode == StopMode::Graceful {
            running.machine.shutdown(&mut running.outlet);
        }
        // A stopped generation's faults are stale for the plane; its points still go out.
        let _stale = sort_effects(*key, &mut running.machine, &mut self.effects);
        Some(running.outlet)
    }

    /// Forget a generation (`ReleasePool`) without publishing anything more.
    pub fn release_pool(&mut self, key: &GenerationKey) -> Option<O> {
        self.pools.remove(key).map(|running| running.outlet)
    }

    /// Stop every generation still running, gracefully (the end of a shutdown).
    pub fn stop_all(&mut self) -> Vec<O> {
        let keys: Vec<GenerationKey> = self.pools.keys().copied().collect();
        keys.iter().filter_map(|key| self.stop_pool(key, StopMode::Graceful)).collect()
    }

    /// Every running generation's logical state in digest form, in generation order (a journal
    /// checkpoint: a deterministic input of each machine).
    pub fn digests(
        &mut self,
        now: Duration,
        rng: &mut RelayRng,
    ) -> Vec<(GenerationKey, PoolDigest)> {
        self.apply_held(now, rng);
        let keys: Vec<GenerationKey> = self.pools.keys().copied().collect();
        let digests = keys
            .iter()
            .filter_map(|key| {
                let digest =
                    self.on_pool(key, now, rng, |machine, outlet| machine.digest(outlet))?;
                Some((*key, digest))
            })
            .collect();
        self.run(Vec::new(), now, rng);
        digests
    }

    // ---- effects -----------------------------------------------------------------------------

    /// The next effect to carry out.
    pub fn poll_effect(&mut self) -> Option<RelayEffect> {
        self.effects.pop_front()
    }

    // ---- invariants --------------------------------------------------------------------------

    /// The relations of the module doc, and every pool's invariants: all of them for a pool
    /// owning at most [`AUDIT_FULL_BLOCKS_MAX`] blocks, the O(1) ones for a larger pool. The
    /// first violation, named by its generation. Between calls, with no effect pending.
    pub fn check_invariants(&self) -> Result<(), String> {
        if !self.work.is_empty() {
            return Err(format!("{} commands left half-executed", self.work.len()));
        }
        let stopping: Vec<GenerationKey> = self
            .effects
            .iter()
            .filter_map(|effect| match effect {
                RelayEffect::Command(command) => match &**command {
                    ControlCommand::Host(
                        HostCommand::StopPool { pool_id, layout_generation, .. }
                        | HostCommand::ReleasePool { pool_id, layout_generation, .. },
                    ) => Some((*pool_id, *layout_generation)),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        let slots = self.plane.host().slots();
        for (key, running) in &self.pools {
            let held = slots.iter().any(|slot| {
                slot.endpoint == running.endpoint
                    && slot.producer.is_some_and(|producer| {
                        (producer.pool_id(), producer.layout_generation()) == *key
                    })
            });
            if !held && !stopping.contains(key) {
                let (pool_id, generation) = key;
                return Err(format!(
                    "pool {pool_id} generation {generation} runs but no slot of {} holds it",
                    running.endpoint
                ));
            }
            let machine = &running.machine;
            let checked = if machine.stats().owned_blocks <= AUDIT_FULL_BLOCKS_MAX {
                machine.check_invariants()
            } else {
                machine.check_cadence()
            };
            checked.map_err(|error| format!("pool {} generation {}: {error}", key.0, key.1))?;
        }
        Ok(())
    }

    // ---- execution ---------------------------------------------------------------------------

    /// Execute `commands`, then every command they lead to (a pool's faults reach the plane as
    /// they are raised, and what the plane answers joins the queue), in order.
    fn run(&mut self, commands: Vec<ControlCommand>, now: Duration, rng: &mut RelayRng) {
        self.work.extend(commands);
        while let Some(command) = self.work.pop_front() {
            self.execute(command, now, rng);
        }
    }

    fn execute(&mut self, command: ControlCommand, now: Duration, rng: &mut RelayRng) {
        let ControlCommand::Source { endpoint, pool_id, layout_generation, command } = command
        else {
            // Every other command reaches a pool or leaves the core: the held writes go first.
            self.apply_held(now, rng);
            self.leave(command);
            return;
        };
        let key = (pool_id, layout_generation);
        match command {
            SourceCommand::ApplyEvents { fence, events, .. } => {
                // A write for a generation not running (its start failed, or it stopped) is
                // dropped.
                if self.pools.contains_key(&key) {
                    self.held.push(key, now, fence, events);
                }
            }
            SourceCommand::ResetRank { source, fence, .. } => {
                self.apply_held(now, rng);
                self.on_pool(&key, now, rng, |machine, outlet| {
                    machine.reset_rank(source, fence, outlet);
                });
            }
            SourceCommand::ReplaceRanks { ranks } => {
                self.apply_held(now, rng);
                let refused = self
                    .on_pool(&key, now, rng, |machine, outlet| machine.replace_ranks(ranks, outlet))
                    .unwrap_or_default();
                // An unreplaced rank keeps its state: only its tracker hears of it.
                for fault in refused {
                    let report = ShellReport::ApplyFailed {
                        endpoint: endpoint.clone(),
                        layout_generation,
                        fault,
                    };
                    self.work.extend(self.plane.report(report, now, rng));
                }
            }
            command
            @ (SourceCommand::RequestRecovery(_) | SourceCommand::CancelRecovery { .. }) => {
                self.effects.push_back(RelayEffect::Command(Box::new(ControlCommand::Source {
                    endpoint,
                    pool_id,
                    layout_generation,
                    command,
                })));
            }
        }
    }

    /// Hand a command the core does not execute to the shell.
    fn leave(&mut self, command: ControlCommand) {
        let effect = match command {
            ControlCommand::Host(HostCommand::PublishCatalog { .. }) => {
                RelayEffect::Catalog(self.plane.catalog_snapshot())
            }
            ControlCommand::PublishTopology { revision } => {
                let snapshot = self.plane.topology_snapshot();
                debug_assert_eq!(snapshot.revision, revision, "the topology is published as asked");
                RelayEffect::Topology(snapshot)
            }
            ControlCommand::Host(HostCommand::RecoverSource { .. }) => {
                debug_assert!(false, "the control plane answers the host's recovery calls");
                return;
            }
            command => RelayEffect::Command(Box::new(command)),
        };
        self.effects.push_back(effect);
    }

    /// Apply every held write, one call per generation in generation order, each write at the
    /// time of the step that issued it (its pool's publication deadline counts from there);
    /// what the pools raise is reported at `now`.
    fn apply_held(&mut self, now: Duration, rng: &mut RelayRng) {
        if self.held.is_empty() {
            return;
        }
        for (key, segments) in self.held.take() {
            self.on_pool(&key, now, rng, |machine, outlet| {
                for (issued, (fence, events)) in &segments {
                    machine.apply(*fence, events, *issued, outlet);
                }
            });
        }
    }

    /// Run `step` on a running generation, then sort what it raised: faults are reported to the
    /// plane (its commands join the work queue; the caller runs it), everything else goes out.
    fn on_pool<R>(
        &mut self,
        key: &GenerationKey,
        now: Duration,
        rng: &mut RelayRng,
        step: impl FnOnce(&mut PoolMachine, &mut O) -> R,
    ) -> Option<R> {
        let running = self.pools.get_mut(key)?;
        let answer = step(&mut running.machine, &mut running.outlet);
        let faults = sort_effects(*key, &mut running.machine, &mut self.effects);
        if !faults.is_empty() {
            // A fault reaches the rank's tracker and the host's fault coalescing, in one report.
            let endpoint = running.endpoint.clone();
            for fault in faults {
                let layout_generation = key.1;
                let report =
                    ShellReport::PoolFault { endpoint: endpoint.clone(), layout_generation, fault };
                self.work.extend(self.plane.report(report, now, rng));
            }
        }
        Some(answer)
    }
}

/// Drain a machine's effects: faults are returned, everything else goes to `effects`.
fn sort_effects(
    key: GenerationKey,
    machine: &mut PoolMachine,
    effects: &mut VecDeque<RelayEffect>,
) -> Vec<PoolFault> {
    let mut faults = Vec::new();
    while let Some(effect) = machine.poll_effect() {
        match effect {
            PoolEffect::Fault(fault) => faults.push(fault),
            effect => effects.push_back(RelayEffect::Pool { key, effect }),
        }
    }
    faults
}
