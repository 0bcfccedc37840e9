//! The node task.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand_core::Rng;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::batch::{may_take_another, yields_after};
use super::input_queue::{
    INPUT_QUEUE_BYTES_MAX_DEFAULT, InputCharge, InputReceiver, InputSender, input_queue,
};
use super::recovery::{RecoveryCalls, RecoveryTransport};
use super::starts::{
    CKF_ALLOCATION_CONCURRENCY, DoneReceiver, Due, PendingStart, PoolStarts, Ready, StartPoint,
    StartTiming,
};
use super::wakeups::{SLOW_WAKEUP, WakeupStats};
use crate::config::WanTuning;
use crate::journal::{NodeTap, TimerPlan, capture_checkpoint};
use crate::pool::{
    BroadcastOutlet, GenerationKey, PoolConfig, PoolHandle, PoolLink, PoolRequest, PublicationMode,
    pool_machine,
};
use crate::publication::{HubConfig, PoolPublications};
use crate::runtime::{BlockingExecutor, DeadlineTimer, TimerKind, WallClock};
use crate::wan::{RelayService, WanPublisher, WanViews, wan_channels};
use kvrelay_core::control::{
    ControlCommand, ControlConfig, ControlError, ControlPlane, ShellReport,
};
use kvrelay_core::host::HostCommand;
use kvrelay_core::model::identity::{EndpointPath, PoolId, RelayIdentity};
use kvrelay_core::pool::{PoolEffect, PoolOwnership};
use kvrelay_core::relay::{Relay, RelayEffect};
use kvrelay_core::rng::{RelayRng, rng_from_seed};
use kvrelay_core::sources::{RecoveryFailure, SourceCommand};
use kvrelay_core::wire::encode;

/// How a node runs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeConfig {
    /// The control plane's configuration (relay identity, DC, scope, sizing, policies).
    pub control: ControlConfig,
    /// Pool bounds and cadence.
    pub pool: PoolConfig,
    /// Publication bounds.
    pub hub: HubConfig,
    /// Cuckoo kick bound of every pool.
    pub max_kicks: u32,
    /// Seed of the node's generator (kick choices, jitter).
    pub rng_seed: u64,
    /// Load window length.
    pub load_window: Duration,
    /// DC inputs buffered before senders wait.
    pub input_queue_capacity: usize,
    /// Load windows buffered per load stream.
    pub load_fanout_capacity: usize,
    /// Bytes of DC inputs queued (and in their step) before senders wait (see
    /// [`super::input_queue`]). Last, with a default, so configurations recorded before it
    /// existed still decode.
    #[serde(default = "default_input_queue_bytes_max")]
    pub input_queue_bytes_max: usize,
}

fn default_input_queue_bytes_max() -> usize {
    INPUT_QUEUE_BYTES_MAX_DEFAULT
}

/// What a node reports about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// The control plane's health.
    pub healthy: bool,
    /// Catalog revision.
    pub catalog_revision: u64,
    /// Readiness revision.
    pub topology_revision: u64,
    /// Pools in the catalog.
    pub active_pools: usize,
    /// Pool starts issued whose allocation outcome is not yet applied.
    pub pools_starting: usize,
    /// DC inputs handled.
    pub inputs_handled: u64,
    /// Batches those inputs were taken in (one wake-up of the node each).
    pub input_batches: u64,
    /// The node's wake-ups: the longest, and how many were slow ([`super::wakeups`]).
    pub wakeups: WakeupStats,
    /// The node stopped.
    pub stopped: bool,
    /// The control plane's full health summary and input counters (`None` before the first
    /// step), for the operations endpoints.
    pub control: Option<kvrelay_core::control::ControlHealth>,
}

/// A running node.
#[derive(Debug)]
pub struct NodeHandle {
    /// Where DC facts go in.
    pub inputs: InputSender,
    /// What the WAN service serves.
    pub views: WanViews,
    /// The pools' publications (for the WAN service).
    pub publications: Arc<PoolPublications>,
    /// The node's status, updated after every step.
    pub status: watch::Receiver<NodeStatus>,
    /// The relay identity.
    pub relay: RelayIdentity,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl NodeHandle {
    /// The WAN service serving this node's catalog, readiness, load and pools.
    #[must_use]
    pub fn relay_service(&self, clock: Arc<dyn WallClock>, tuning: WanTuning) -> RelayService {
        RelayService::new(
            self.relay,
            self.views.clone(),
            Arc::clone(&self.publications),
            clock,
            tuning,
        )
    }

    /// Withdraw every pool, stop every pool generation, and end the task.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

struct Node {
    /// The control plane and every running pool machine.
    relay: Relay<BroadcastOutlet>,
    /// The reply side of every running generation (held subscriptions, the journal's points):
    /// after every carry-out, exactly the generations the relay runs.
    links: BTreeMap<GenerationKey, PoolLink>,
    /// Generations stopped during this carry-out, whose links go once their last points are out.
    stopped_links: Vec<GenerationKey>,
    relay_id: RelayIdentity,
    rng: RelayRng,
    origin: Instant,
    config: NodeConfig,
    /// Where pool handles send their requests.
    pool_requests: mpsc::Sender<PoolRequest>,
    /// Generations withdrawn by the effects being carried out whose streams are still open:
    /// they end right after the catalog update that withdraws them is published.
    withdrawn: Vec<(PoolId, u64)>,
    recoveries: RecoveryCalls,
    /// Pool starts issued and not yet applied; their allocations run off this task.
    starts: PoolStarts,
    /// The point of the step being executed: where a start issued now was issued.
    point: StartPoint,
    /// Charges of the inputs whose writes the relay holds for the batch's end.
    charges: Vec<InputCharge>,
    /// Batches of inputs taken so far.
    input_batches: u64,
    /// How long the wake-ups so far kept the loop.
    wakeups: WakeupStats,
    reports: mpsc::Sender<ShellReport>,
    publications: Arc<PoolPublications>,
    wan: WanPublisher,
    recovery: Arc<dyn RecoveryTransport>,
    clock: Arc<dyn WallClock>,
    status: watch::Sender<NodeStatus>,
    tap: Option<Arc<dyn NodeTap>>,
    /// While a journal drives the node's time (a replay's recorded inputs and timer firings):
    /// the recorded time of the last one replayed, which is the node's time until the next.
    /// Never ahead of the node's clock (the replay waited for it).
    replayed_now: Option<Duration>,
    /// The latest time the node gave: its time never goes back, even where a replay moves
    /// from its clock back to recorded stamps.
    given: Cell<Duration>,
}

/// Reports buffered from recovery calls.
const REPORT_QUEUE_CAPACITY: usize = 4096;

/// Start a node. The returned handle's `views` and `publications` feed a
/// [`RelayService`](crate::wan::RelayService).
pub fn start_node(
    config: NodeConfig,
    executor: Arc<dyn BlockingExecutor>,
    clock: Arc<dyn WallClock>,
    recovery: Arc<dyn RecoveryTransport>,
) -> Result<NodeHandle, ControlError> {
    start_node_with_tap(config, executor, clock, recovery, None)
}

/// [`start_node`] with a journal tap at the input boundary: the tap sees every input as the
/// node takes it, is asked after every input's step whether to take a checkpoint (with that
/// input's time, so the decision is a function of the input stream), and gives each pool
/// its publication mode.
pub fn start_node_with_tap(
    config: NodeConfig,
    executor: Arc<dyn BlockingExecutor>,
    clock: Arc<dyn WallClock>,
    recovery: Arc<dyn RecoveryTransport>,
    tap: Option<Arc<dyn NodeTap>>,
) -> Result<NodeHandle, ControlError> {
    let plane = ControlPlane::new(config.control.clone())?;
    let relay_id = plane.relay();
    let (inputs, inputs_rx) =
        input_queue(config.input_queue_capacity, config.input_queue_bytes_max);
    let (reports, reports_rx) = mpsc::channel(REPORT_QUEUE_CAPACITY);
    let (wan, views) = wan_channels(&relay_id, config.load_fanout_capacity);
    let publications = Arc::new(PoolPublications::new(config.hub, Arc::clone(&executor)));
    let (starts, allocations) = PoolStarts::new(Arc::clone(&executor), CKF_ALLOCATION_CONCURRENCY);
    let (pool_requests, pool_requests_rx) = mpsc::channel(config.pool.mailbox_capacity.max(1));
    let (status, status_rx) = watch::channel(NodeStatus::default());
    let shutdown = CancellationToken::new();
    let origin = Instant::now();
    if let Some(tap) = &tap {
        tap.node_started(origin);
    }
    // A journal that drives the node's time does so from its start.
    let drives_time = tap.as_ref().is_some_and(|tap| tap.timer_plan(0) != TimerPlan::Own);
    let replayed_now = drives_time.then_some(Duration::ZERO);
    let node = Node {
        relay: Relay::new(plane),
        links: BTreeMap::new(),
        stopped_links: Vec::new(),
        relay_id,
        rng: rng_from_seed(config.rng_seed),
        origin,
        config,
        pool_requests,
        withdrawn: Vec::new(),
        recoveries: RecoveryCalls::default(),
        starts,
        point: StartPoint { inputs_handled: 0, between_steps: true },
        charges: Vec::new(),
        input_batches: 0,
        wakeups: WakeupStats::default(),
        reports,
        publications: Arc::clone(&publications),
        wan,
        recovery,
        clock,
        status,
        tap,
        replayed_now,
        given: Cell::new(Duration::ZERO),
    };
    let task = crate::runtime::spawn(node.run(
        inputs_rx,
        reports_rx,
        pool_requests_rx,
        allocations,
        shutdown.clone(),
    ));
    Ok(NodeHandle {
        inputs,
        views,
        publications,
        status: status_rx,
        relay: relay_id,
        shutdown,
        task,
    })
}

impl Node {
    /// The node's time: its clock since `origin`, or the replayed time while a journal drives
    /// it; never before a time it gave already.
    fn now(&self) -> Duration {
        let now = self
            .replayed_now
            .unwrap_or_else(|| Instant::now().saturating_duration_since(self.origin))
            .max(self.given.get());
        self.given.set(now);
        now
    }

    /// Where the next timer firing comes from (the node's own timer without a tap).
    fn timer_plan(&self, inputs_handled: u64) -> TimerPlan {
        self.tap.as_ref().map_or(TimerPlan::Own, |tap| tap.timer_plan(inputs_handled))
    }

    /// When to wake for the relay's timers under `plan`, and the recorded time to fire them at.
    fn timer_wake(&self, plan: TimerPlan) -> (Option<Instant>, Option<Duration>) {
        let own = self.relay.poll_timeout();
        match plan {
            TimerPlan::Own => (own.map(|at| self.origin + at), None),
            TimerPlan::OwnFrom(from) => (own.map(|at| self.origin + at.max(from)), None),
            TimerPlan::Recorded(at) => (Some(self.origin + at), Some(at)),
            TimerPlan::AfterInputs => (None, None),
        }
    }

    /// The time to give the relay for input number `inputs_handled`: the recorded stamp when a
    /// journal drives the node's time, else the node's clock.
    fn input_now(&mut self, inputs_handled: u64) -> Duration {
        self.replayed_now = self.tap.as_ref().and_then(|tap| tap.input_time(inputs_handled));
        self.now()
    }

    async fn run(
        mut self,
        mut inputs: InputReceiver,
        mut reports: mpsc::Receiver<ShellReport>,
        mut pool_requests: mpsc::Receiver<PoolRequest>,
        mut allocations: DoneReceiver,
        shutdown: CancellationToken,
    ) {
        let window = self.config.load_window.max(Duration::from_millis(1));
        let mut load_ticks = tokio::time::interval_at(self.origin + window, window);
        load_ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let fences = self.publications.fence_requests().clone();
        let precise = self.config.pool.precise_timer && self.clock.follows_real_time();
        let mut timer =
            DeadlineTimer::new(if precise { TimerKind::Precise } else { TimerKind::Tokio });
        let mut inputs_handled = 0u64;
        'run: loop {
            let plan = self.timer_plan(inputs_handled);
            let (wake, recorded_firing) = self.timer_wake(plan);
            // Every branch but an input's hands its work to the relay at once; the effects are
            // carried out below. Each notes when it woke, for the wake-up's duration.
            let woke;
            let woken = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(report) = reports.recv() => {
                    woke = (self.now(), "shell report");
                    self.relay.report(report, woke.0, &mut self.rng);
                    None
                }
                () = fences.notified() => {
                    woke = (self.now(), "fence requests");
                    for (pool_id, layout_generation) in fences.take() {
                        let report = ShellReport::GenerationFenced { pool_id, layout_generation };
                        self.relay.report(report, self.now(), &mut self.rng);
                    }
                    None
                }
                Some(done) = allocations.recv(), if self.starts.in_flight() > 0 => {
                    woke = (self.now(), "filter allocation");
                    self.starts.completed(done);
                    None
                }
                () = timer.sleep_until(wake), if wake.is_some() => {
                    // A recorded firing's time; the node's own timer fires on its clock (past
                    // a replayed window's end, every recorded time is behind it).
                    self.replayed_now = recorded_firing;
                    woke = (self.now(), "timer");
                    // A firing is an input like the others: the journal records it.
                    if let Some(tap) = &self.tap {
                        tap.timer_fired(woke.0, inputs_handled);
                    }
                    self.relay.handle_timeout(woke.0, &mut self.rng);
                    None
                }
                Some(request) = pool_requests.recv() => {
                    woke = (self.now(), "pool request");
                    self.serve(request);
                    None
                }
                _ = load_ticks.tick() => {
                    woke = (self.now(), "load window");
                    self.publish_load();
                    None
                }
                input = inputs.recv() => match input {
                    Some(queued) => {
                        woke = (self.now(), "inputs");
                        Some(queued)
                    }
                    None => break,
                },
            };
            let mut taken = 0;
            match woken {
                None => {
                    if !self.step(None, inputs_handled, &mut allocations, &shutdown).await {
                        break;
                    }
                }
                Some(queued) => {
                    self.input_batches += 1;
                    // A batch: every input queued now, up to the bound, each in its own step;
                    // other work that became due ends it early.
                    let mut next = Some(queued);
                    while let Some(queued) = next.take() {
                        let (input, charge) = queued.into_parts();
                        inputs_handled += 1;
                        taken += 1;
                        // One reading: the journal's stamp is the time the relay is given.
                        let now = self.input_now(inputs_handled);
                        if let Some(tap) = &self.tap {
                            tap.input(now, &input);
                        }
                        self.relay.handle(input, now, &mut self.rng);
                        self.charges.push(charge);
                        let stepped =
                            self.step(Some(now), inputs_handled, &mut allocations, &shutdown).await;
                        if !stepped {
                            break 'run;
                        }
                        // The plane's deadlines end a batch, and so does a recorded firing
                        // after this input; the pools' publication timers wait for its end (the
                        // writes they would publish are held until then, and a batch is bounded).
                        let timer_due = self
                            .relay
                            .plane_timeout()
                            .is_some_and(|at| at <= self.now())
                            || matches!(self.timer_plan(inputs_handled), TimerPlan::Recorded(_));
                        let held = self.relay.held_blocks();
                        if may_take_another(taken, held, !reports.is_empty(), timer_due) {
                            next = inputs.try_recv();
                        }
                    }
                }
            }
            let cut = yields_after(taken, self.relay.held_blocks());
            self.flush_applies().await;
            // The wake-up's work is done: a yield below lets others run, it does not hold them.
            self.record_wakeup(woke, taken);
            if cut {
                // The batch ended at a bound with inputs still queued: let the transports'
                // readers and the hubs (which take this batch's deltas) run before the next.
                tokio::task::yield_now().await;
            }
            self.debug_check();
            self.publish_status(inputs_handled, false);
        }
        self.relay.begin_shutdown(self.now(), &mut self.rng);
        self.charges.clear();
        self.carry_out().await;
        self.recoveries.abort_all();
        drop(self.relay.stop_all());
        self.stopped_links.extend(self.links.keys().copied());
        self.carry_out().await;
        self.publish_status(inputs_handled, true);
    }

    /// In debug builds, after every wake-up: the relay core's invariants hold, and so do the
    /// links'.
    fn debug_check(&mut self) {
        if !cfg!(debug_assertions) {
            return;
        }
        if let Err(error) = self.relay.check_invariants() {
            panic!("relay invariant failed: {error}");
        }
        if !self.links.keys().eq(self.relay.running()) {
            panic!(
                "the links are not the running generations: links {:?}, running {:?}",
                self.links.keys().collect::<Vec<_>>(),
                self.relay.running().collect::<Vec<_>>()
            );
        }
        let (now, rng) = (self.now(), &mut self.rng);
        for (key, link) in &self.links {
            let checked =
                self.relay.with_pool(key, now, rng, |machine, _| link.check_invariants(machine));
            if let Some(Err(error)) = checked {
                panic!("pool link invariant failed: {error}");
            }
        }
    }

    /// Answer one pool request; one for a generation not running is dropped (its sender sees
    /// [`crate::pool::PoolGone`]).
    fn serve(&mut self, request: PoolRequest) {
        let PoolRequest { key, ask } = request;
        let now = self.now();
        let Some(link) = self.links.get_mut(&key) else { return };
        self.relay.with_pool(&key, now, &mut self.rng, |machine, outlet| {
            link.serve(ask, machine, outlet);
            link.settle(machine);
        });
    }

    /// One step: carry out what the relay was just given (an input taken at `input_at`, or
    /// other work), then the starts due within it, the input's checkpoint and the starts due
    /// after it. `false`: shutdown was requested while waiting for a start.
    async fn step(
        &mut self,
        input_at: Option<Duration>,
        inputs_handled: u64,
        allocations: &mut DoneReceiver,
        shutdown: &CancellationToken,
    ) -> bool {
        // Within an input's step (before its checkpoint), or between two inputs' steps.
        let point = StartPoint { inputs_handled, between_steps: input_at.is_none() };
        self.point = point;
        self.carry_out().await;
        if !self.apply_starts(point, allocations, shutdown).await {
            return false;
        }
        if let Some(at) = input_at {
            self.checkpoint_if_due(at, inputs_handled).await;
            // Starts due after this step, before the next input is taken.
            let after = StartPoint { inputs_handled, between_steps: true };
            return self.apply_starts(after, allocations, shutdown).await;
        }
        true
    }

    /// Hand every held pool write to its pool and release the bytes of the inputs that carried
    /// them.
    async fn flush_applies(&mut self) {
        if self.relay.held_blocks() == 0 && self.charges.is_empty() {
            return;
        }
        self.relay.flush(self.now(), &mut self.rng);
        self.charges.clear();
        self.carry_out().await;
    }

    /// Apply every start due at `point` (see [`super::starts`]), in issue order, carrying out
    /// what each outcome produces; a replay waits here for an allocation its recording applied
    /// at or before `point`. `false`: shutdown was requested while waiting.
    async fn apply_starts(
        &mut self,
        point: StartPoint,
        allocations: &mut DoneReceiver,
        shutdown: &CancellationToken,
    ) -> bool {
        loop {
            while let Ok(done) = allocations.try_recv() {
                self.starts.completed(done);
            }
            match self.starts.next_due(point) {
                Due::Apply(ready) => {
                    self.point = point;
                    self.finish_start(*ready, point);
                    self.carry_out().await;
                }
                Due::Wait => {
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return false,
                        Some(done) = allocations.recv() => self.starts.completed(done),
                    }
                }
                Due::Idle => return true,
            }
        }
    }

    /// Commit a start (the relay runs its pool; the control plane catalogs it) or roll it back
    /// (the host releases the generation and retries).
    fn finish_start(&mut self, ready: Ready, point: StartPoint) {
        let now = self.now();
        let Ready { start: PendingStart { endpoint, producer, .. }, outcome } = ready;
        let generation = producer.layout_generation();
        if let Some(tap) = &self.tap {
            tap.pool_started(now, &producer.pool_id(), generation, point, outcome.is_ok());
        }
        let pool = match outcome {
            Ok(pool) => pool,
            Err(error) => {
                tracing::warn!(%endpoint, generation, %error, "pool start failed");
                self.relay.start_failed(&endpoint, generation, now, &mut self.rng);
                return;
            }
        };
        let key = (producer.pool_id(), generation);
        let mode = self.tap.as_ref().map_or(PublicationMode::Free, |tap| {
            tap.publication_mode(&producer.pool_id(), generation)
        });
        let (machine, link) = pool_machine(pool, &self.config.pool, mode, self.origin);
        let outlet = BroadcastOutlet::new(self.config.pool.delta_broadcast_capacity);
        // Its effects are carried out after this: the link and the hub are in place by then.
        if self.relay.start_succeeded(&endpoint, key, machine, outlet, now, &mut self.rng) {
            self.links.insert(key, link);
            let handle = PoolHandle::new(key, self.pool_requests.clone());
            self.publications.activate(producer, handle);
        } else {
            tracing::debug!(%endpoint, generation, "a pool start finished after it was given up");
        }
    }

    /// Carry out every effect the relay has queued, in order; then end the streams of every
    /// generation withdrawn from the published catalog, and forget the links of generations no
    /// longer running.
    async fn carry_out(&mut self) {
        while let Some(effect) = self.relay.poll_effect() {
            match effect {
                RelayEffect::Command(command) => match *command {
                    ControlCommand::Host(command) => self.execute_host(command).await,
                    ControlCommand::Source { endpoint, pool_id, layout_generation, command } => {
                        self.execute_recovery(endpoint, pool_id, layout_generation, command);
                    }
                    ControlCommand::PublishTopology { .. } => {
                        debug_assert!(false, "the relay publishes a topology as a snapshot");
                    }
                },
                RelayEffect::Catalog(snapshot) => {
                    self.wan.publish_catalog(encode::catalog_update(&self.relay_id, &snapshot));
                    self.retire_withdrawn().await;
                }
                RelayEffect::Topology(snapshot) => {
                    self.wan.publish_readiness(encode::readiness_update(
                        &self.relay_id,
                        snapshot.revision,
                        &snapshot.entries,
                    ));
                }
                RelayEffect::Pool { key, effect } => self.carry_pool(key, effect),
            }
        }
        self.retire_withdrawn().await;
        // Stopped generations' last points went out above; now their links go.
        for key in std::mem::take(&mut self.stopped_links) {
            self.links.remove(&key);
        }
    }

    /// One pool's point or subscription answer. A point of a stopped generation still reaches
    /// its journal; an answer for one is dropped with its link.
    fn carry_pool(&mut self, key: GenerationKey, effect: PoolEffect) {
        let now = self.now();
        let Some(link) = self.links.get_mut(&key) else { return };
        if let PoolEffect::Point(point) = effect {
            link.point(point);
            return;
        }
        self.relay.with_pool(&key, now, &mut self.rng, |machine, outlet| {
            link.carry(effect, machine, outlet);
            link.settle(machine);
        });
    }

    /// End the streams of every generation withdrawn from the published catalog.
    async fn retire_withdrawn(&mut self) {
        for (pool_id, layout_generation) in std::mem::take(&mut self.withdrawn) {
            self.publications.retire(pool_id, layout_generation).await;
        }
    }

    async fn execute_host(&mut self, command: HostCommand) {
        match command {
            HostCommand::StartPool { endpoint, producer, .. } => {
                let format = producer.format();
                let max_kicks = self.config.max_kicks;
                let seed = self.rng.next_u64();
                let timing = self.tap.as_ref().map_or(StartTiming::Free, |tap| {
                    tap.start_timing(&producer.pool_id(), producer.layout_generation(), self.point)
                });
                self.starts.issue(
                    endpoint,
                    producer,
                    timing,
                    Box::new(move || PoolOwnership::new(format, max_kicks, rng_from_seed(seed))),
                );
            }
            HostCommand::WithdrawPool { pool_id, layout_generation, .. } => {
                // Its streams end once the catalog that withdraws it is out.
                self.withdrawn.push((pool_id, layout_generation));
            }
            HostCommand::StopPool { pool_id, layout_generation, mode, .. } => {
                // A withdrawal is always followed by its catalog; should one not be, the
                // streams still end before their pool stops.
                self.retire_withdrawn().await;
                let key = (pool_id, layout_generation);
                if self.relay.stop_pool(&key, mode).is_some() {
                    self.stopped_links.push(key);
                }
            }
            HostCommand::ReleasePool { pool_id, layout_generation, .. } => {
                self.publications.retire(pool_id, layout_generation).await;
                let key = (pool_id, layout_generation);
                if self.relay.release_pool(&key).is_some() {
                    self.stopped_links.push(key);
                }
            }
            HostCommand::PublishCatalog { .. } | HostCommand::RecoverSource { .. } => {
                debug_assert!(false, "the relay carries out {command:?} itself");
            }
        }
    }

    /// A recovery call of a pool's tracker: query the worker off the loop and report the
    /// answer (or the failure), or cancel a call in flight.
    fn execute_recovery(
        &mut self,
        endpoint: EndpointPath,
        pool_id: PoolId,
        layout_generation: u64,
        command: SourceCommand,
    ) {
        match command {
            SourceCommand::RequestRecovery(call) => {
                let now = self.now();
                let timeout = call.deadline.saturating_sub(now).max(Duration::from_millis(1));
                // The call's deadline on the node's clock (a replay's time may trail its clock).
                let deadline =
                    (self.origin + call.deadline).max(Instant::now() + Duration::from_millis(1));
                let query = self.recovery.query(call.target.clone(), call.request, timeout);
                let reports = self.reports.clone();
                let request_id = call.request_id;
                let task = crate::runtime::spawn(async move {
                    let report = match tokio::time::timeout_at(deadline, query).await {
                        Ok(Ok(response)) => ShellReport::RecoveryAnswered {
                            endpoint,
                            layout_generation,
                            request_id,
                            response,
                        },
                        Ok(Err(failure)) => ShellReport::RecoveryUnreachable {
                            endpoint,
                            layout_generation,
                            request_id,
                            failure,
                        },
                        Err(_) => ShellReport::RecoveryUnreachable {
                            endpoint,
                            layout_generation,
                            request_id,
                            failure: RecoveryFailure::TimedOut,
                        },
                    };
                    let _ = reports.send(report).await;
                });
                self.recoveries.insert(pool_id, layout_generation, request_id, task.abort_handle());
            }
            SourceCommand::CancelRecovery { request_id, .. } => {
                self.recoveries.cancel(pool_id, layout_generation, request_id);
            }
            command => debug_assert!(false, "the relay executes {command:?} itself"),
        }
    }

    /// After the step of the input taken at `at`: a checkpoint if the tap says one is due,
    /// stamped `at` (the state it captures is the one after that step).
    async fn checkpoint_if_due(&mut self, at: Duration, inputs_handled: u64) {
        let Some(tap) = self.tap.clone() else { return };
        if tap.checkpoint_due(at, inputs_handled) {
            // The checkpoint reads the pools: the relay applies every held write first.
            let now = self.now();
            let checkpoint =
                capture_checkpoint(&mut self.relay, now, &mut self.rng, inputs_handled);
            tap.checkpoint(at, checkpoint);
            self.carry_out().await;
        }
    }

    fn publish_load(&mut self) {
        if let Ok(window) = self.relay.load_window(self.clock.now_unix_ms()) {
            self.wan.publish_load(encode::load_update(&self.relay_id, &window));
        }
    }

    /// Count the wake-up that began at `woke.0` for `woke.1` and ends now; log a slow one (the
    /// 1st, 2nd, 4th, ... of them) with what woke it and the batch it took.
    fn record_wakeup(&mut self, woke: (Duration, &'static str), inputs: usize) {
        let took = self.now().saturating_sub(woke.0);
        if self.wakeups.record(took) {
            tracing::warn!(
                took_ms = took.as_millis() as u64,
                woken_by = woke.1,
                inputs,
                slow_wakeups = self.wakeups.slow,
                "one wake-up kept the node's loop for longer than {SLOW_WAKEUP:?}: the transports' \
                 readers waited meanwhile, and an event plane's buffer may have run out \
                 (kvrelay_node_slow_wakeups_total, kvrelay_event_plane_client_drops_total)"
            );
        }
    }

    /// Runs after every input: reads counts and revisions, never copies the catalog or topology.
    fn publish_status(&self, inputs_handled: u64, stopped: bool) {
        let plane = self.relay.plane();
        let health = plane.health();
        let status = NodeStatus {
            healthy: health.healthy,
            catalog_revision: health.catalog_revision,
            topology_revision: health.topology_revision,
            active_pools: plane.catalog_len(),
            pools_starting: self.starts.pending(),
            inputs_handled,
            input_batches: self.input_batches,
            wakeups: self.wakeups,
            stopped,
            control: Some(health),
        };
        let refused = |status: &NodeStatus| {
            status.control.as_ref().map_or(0, |control| control.host.budget_refused_endpoint_count)
        };
        let (before, after) = (refused(&self.status.borrow()), refused(&status));
        if after > before {
            let pools_max = status.control.as_ref().map_or(0, |control| control.host.pools_max);
            tracing::warn!(
                waiting = after,
                pools_max,
                "pool filter budget full (DYN_RELAY_POOL_FILTER_BYTES_MAX): endpoints wait for a \
                 pool to be released"
            );
        } else if after == 0 && before > 0 {
            tracing::info!("every endpoint that wants a pool has one again");
        }
        self.status.send_if_modified(|current| {
            let changed = *current != status;
            *current = status;
            changed
        });
    }
}
