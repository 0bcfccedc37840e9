//! The node task.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rand_core::Rng;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::batch::{BATCH_BLOCKS_MAX, PendingApplies, may_take_another};
use super::input_queue::{
    INPUT_QUEUE_BYTES_MAX_DEFAULT, InputReceiver, InputSender, QueuedInput, input_queue,
};
use super::pools::NodePools;
use super::recovery::{RecoveryCalls, RecoveryTransport};
use super::starts::{
    CKF_ALLOCATION_CONCURRENCY, DoneReceiver, Due, PendingStart, PoolStarts, Ready, StartPoint,
    StartTiming,
};
use crate::config::WanTuning;
use crate::journal::{NodeTap, capture_checkpoint};
use crate::pool::{FaultSink, PoolConfig, PoolRequest, PublicationMode};
use crate::publication::{FenceRequests, HubConfig, PoolPublications};
use crate::runtime::{BlockingExecutor, WallClock};
use crate::wan::{RelayService, WanPublisher, WanViews, wan_channels};
use kvrelay_core::control::{
    ControlCommand, ControlConfig, ControlError, ControlPlane, ShellReport,
};
use kvrelay_core::host::HostCommand;
use kvrelay_core::model::identity::{EndpointPath, PoolId, RelayIdentity};
use kvrelay_core::pool::{PoolFault, PoolOwnership};
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

#[derive(Debug)]
struct NodeFaults {
    endpoint: EndpointPath,
    pool_id: PoolId,
    layout_generation: u64,
    reports: mpsc::Sender<ShellReport>,
    fences: FenceRequests,
}

impl NodeFaults {
    fn send(&self, report: ShellReport) {
        if self.reports.try_send(report).is_err() {
            // Losing a fault would leave the exact state unexplained: fence instead.
            self.fences.request(self.pool_id, self.layout_generation);
        }
    }
}

impl FaultSink for NodeFaults {
    fn report(&self, fault: PoolFault) {
        let (endpoint, layout_generation) = (self.endpoint.clone(), self.layout_generation);
        self.send(ShellReport::PoolFault { endpoint, layout_generation, fault });
    }

    fn refused(&self, fault: PoolFault) {
        let (endpoint, layout_generation) = (self.endpoint.clone(), self.layout_generation);
        self.send(ShellReport::ApplyFailed { endpoint, layout_generation, fault });
    }
}

struct Node {
    plane: ControlPlane,
    relay: RelayIdentity,
    rng: RelayRng,
    origin: Instant,
    config: NodeConfig,
    pools: NodePools,
    /// Generations withdrawn by the commands being executed whose streams are still open:
    /// they end right after the catalog update that withdraws them is published.
    withdrawn: Vec<(PoolId, u64)>,
    recoveries: RecoveryCalls,
    /// Pool starts issued and not yet applied; their allocations run off this task.
    starts: PoolStarts,
    /// The point of the step being executed: where a start issued now was issued.
    point: StartPoint,
    /// Pool writes of the current batch not yet applied.
    pending: PendingApplies,
    /// Batches of inputs taken so far.
    input_batches: u64,
    reports: mpsc::Sender<ShellReport>,
    publications: Arc<PoolPublications>,
    wan: WanPublisher,
    recovery: Arc<dyn RecoveryTransport>,
    clock: Arc<dyn WallClock>,
    status: watch::Sender<NodeStatus>,
    tap: Option<Arc<dyn NodeTap>>,
}

/// Reports buffered from pool drivers and recovery calls.
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
    let relay = plane.relay();
    let (inputs, inputs_rx) =
        input_queue(config.input_queue_capacity, config.input_queue_bytes_max);
    let (reports, reports_rx) = mpsc::channel(REPORT_QUEUE_CAPACITY);
    let (wan, views) = wan_channels(&relay, config.load_fanout_capacity);
    let publications = Arc::new(PoolPublications::new(config.hub, Arc::clone(&executor)));
    let (starts, allocations) = PoolStarts::new(Arc::clone(&executor), CKF_ALLOCATION_CONCURRENCY);
    let (status, status_rx) = watch::channel(NodeStatus::default());
    let shutdown = CancellationToken::new();
    let origin = Instant::now();
    if let Some(tap) = &tap {
        tap.node_started(origin);
    }
    let (pools, pool_requests) = NodePools::new(config.pool, origin);
    let node = Node {
        plane,
        relay,
        rng: rng_from_seed(config.rng_seed),
        origin,
        config,
        pools,
        withdrawn: Vec::new(),
        recoveries: RecoveryCalls::default(),
        starts,
        point: StartPoint { inputs_handled: 0, between_steps: true },
        pending: PendingApplies::default(),
        input_batches: 0,
        reports,
        publications: Arc::clone(&publications),
        wan,
        recovery,
        clock,
        status,
        tap,
    };
    let task = crate::runtime::spawn(node.run(
        inputs_rx,
        reports_rx,
        pool_requests,
        allocations,
        shutdown.clone(),
    ));
    Ok(NodeHandle { inputs, views, publications, status: status_rx, relay, shutdown, task })
}

impl Node {
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
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
        let mut inputs_handled = 0u64;
        'run: loop {
            let wake = self.poll_timeout().map(|at| self.origin + at);
            let woken = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(report) = reports.recv() => {
                    Wake::Commands(self.plane.report(report, self.now(), &mut self.rng))
                }
                () = fences.notified() => {
                    let mut commands = Vec::new();
                    for (pool_id, layout_generation) in fences.take() {
                        let report = ShellReport::GenerationFenced { pool_id, layout_generation };
                        commands.extend(self.plane.report(report, self.now(), &mut self.rng));
                    }
                    Wake::Commands(commands)
                }
                Some(done) = allocations.recv(), if self.starts.in_flight() > 0 => {
                    self.starts.completed(done);
                    Wake::Commands(Vec::new())
                }
                () = sleep_until(wake), if wake.is_some() => Wake::Commands(self.handle_timeout()),
                Some(request) = pool_requests.recv() => {
                    self.pools.serve(request);
                    Wake::Commands(Vec::new())
                }
                _ = load_ticks.tick() => {
                    self.publish_load();
                    Wake::Commands(Vec::new())
                }
                input = inputs.recv() => match input {
                    Some(queued) => Wake::Input(queued),
                    None => break,
                },
            };
            match woken {
                Wake::Commands(commands) => {
                    if !self.step(commands, None, inputs_handled, &mut allocations, &shutdown).await
                    {
                        break;
                    }
                }
                Wake::Input(queued) => {
                    self.input_batches += 1;
                    // A batch: every input queued now, up to the bound, each in its own step;
                    // other work that became due ends it early.
                    let mut next = Some(queued);
                    let mut taken = 0;
                    while let Some(queued) = next.take() {
                        let (input, charge) = queued.into_parts();
                        inputs_handled += 1;
                        taken += 1;
                        // One reading: the journal's stamp is the time the plane is given.
                        let now = self.now();
                        if let Some(tap) = &self.tap {
                            tap.input(now, &input);
                        }
                        let commands = self.plane.handle(input, now, &mut self.rng);
                        self.pending.hold_charge(charge);
                        let stepped = self
                            .step(commands, Some(now), inputs_handled, &mut allocations, &shutdown)
                            .await;
                        if !stepped {
                            break 'run;
                        }
                        // The plane's deadlines end a batch; the pools' publication timers
                        // wait for its end (the writes they would publish are held until then,
                        // and a batch is bounded), as they did when pools ran on their own
                        // tasks behind the node's.
                        let timer_due =
                            self.plane.poll_timeout().is_some_and(|at| at <= self.now());
                        let held = self.pending.blocks();
                        if may_take_another(taken, held, !reports.is_empty(), timer_due) {
                            next = inputs.try_recv();
                        }
                    }
                }
            }
            let heavy = self.pending.blocks() >= BATCH_BLOCKS_MAX;
            self.flush_applies();
            if heavy {
                // The batch kept the thread for a block bound's worth of writes: let the
                // transports' readers (and every other task) run before the next wake-up.
                tokio::task::yield_now().await;
            }
            self.debug_check();
            self.publish_status(inputs_handled, false);
        }
        self.flush_applies();
        let commands = self.plane.begin_shutdown(self.now(), &mut self.rng);
        self.execute(commands).await;
        self.recoveries.abort_all();
        self.pools.shutdown_all();
        self.publish_status(inputs_handled, true);
    }

    /// When the node's next timer is due: the control plane's or a pool's, whichever is first.
    fn poll_timeout(&self) -> Option<Duration> {
        match (self.plane.poll_timeout(), self.pools.poll_timeout()) {
            (Some(plane), Some(pools)) => Some(plane.min(pools)),
            (plane, pools) => plane.or(pools),
        }
    }

    /// Fire every timer due now: the pools' first (their publications are outputs of writes
    /// already applied), then the control plane's.
    fn handle_timeout(&mut self) -> Vec<ControlCommand> {
        let now = self.now();
        self.pools.handle_timeout(now);
        if self.plane.poll_timeout().is_some_and(|at| at <= now) {
            return self.plane.handle_timeout(now, &mut self.rng);
        }
        Vec::new()
    }

    /// In debug builds, after every wake-up: the relations between the pools' states hold.
    fn debug_check(&self) {
        if cfg!(debug_assertions)
            && let Err(error) = self.pools.check_invariants()
        {
            panic!("pool invariant failed: {error}");
        }
    }

    /// One step: run `commands` (of the input taken at `input_at`, or of other work), then the
    /// starts due within it, the input's checkpoint and the starts due after it. `false`:
    /// shutdown was requested while waiting for a start.
    async fn step(
        &mut self,
        commands: Vec<ControlCommand>,
        input_at: Option<Duration>,
        inputs_handled: u64,
        allocations: &mut DoneReceiver,
        shutdown: &CancellationToken,
    ) -> bool {
        // Within an input's step (before its checkpoint), or between two inputs' steps.
        let point = StartPoint { inputs_handled, between_steps: input_at.is_none() };
        self.point = point;
        self.execute(commands).await;
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

    /// Apply every held pool write (one call per generation) and release the bytes of the
    /// inputs that carried them. A write for a generation not driven (its start failed, or it
    /// already stopped) is dropped, as it would have been unbatched.
    fn flush_applies(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let (writes, charges) = self.pending.take();
        let now = self.now();
        for (key, segments) in writes {
            self.pools.apply(&key, &segments, now);
        }
        drop(charges);
    }

    /// Apply every start due at `point` (see [`super::starts`]), in issue order, executing the
    /// commands each outcome produces; a replay waits here for an allocation its recording
    /// applied at or before `point`. `false`: shutdown was requested while waiting.
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
                    let commands = self.finish_start(*ready, point);
                    self.execute(commands).await;
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

    /// Commit a start (drive its pool; the control plane catalogs it) or roll it back (the
    /// host releases the generation and retries).
    fn finish_start(&mut self, ready: Ready, point: StartPoint) -> Vec<ControlCommand> {
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
                return self.plane.start_failed(&endpoint, generation, now, &mut self.rng);
            }
        };
        let faults = Arc::new(NodeFaults {
            endpoint: endpoint.clone(),
            pool_id: producer.pool_id(),
            layout_generation: generation,
            reports: self.reports.clone(),
            fences: self.publications.fence_requests().clone(),
        });
        let mode = self.tap.as_ref().map_or(PublicationMode::Free, |tap| {
            tap.publication_mode(&producer.pool_id(), generation)
        });
        let handle = self.pools.start((producer.pool_id(), generation), pool, faults, mode);
        self.publications.activate(producer, handle);
        self.plane.start_succeeded(&endpoint, generation, now, &mut self.rng)
    }

    async fn execute(&mut self, commands: Vec<ControlCommand>) {
        let mut queue: VecDeque<ControlCommand> = commands.into();
        while let Some(command) = queue.pop_front() {
            let follow_up = self.execute_one(command).await;
            queue.extend(follow_up);
        }
        self.retire_withdrawn().await;
    }

    /// End the streams of every generation withdrawn from the published catalog.
    async fn retire_withdrawn(&mut self) {
        for (pool_id, layout_generation) in std::mem::take(&mut self.withdrawn) {
            self.publications.retire(pool_id, layout_generation).await;
        }
    }

    async fn execute_one(&mut self, command: ControlCommand) -> Vec<ControlCommand> {
        if let ControlCommand::Source {
            pool_id,
            layout_generation,
            command: SourceCommand::ApplyEvents { fence, events, .. },
            ..
        } = command
        {
            self.pending.push(pool_id, layout_generation, fence, events);
            return Vec::new();
        }
        if reaches_pools(&command) {
            self.flush_applies();
        }
        match command {
            ControlCommand::Host(command) => self.execute_host(command).await,
            ControlCommand::Source { endpoint, pool_id, layout_generation, command } => {
                self.execute_source(endpoint, pool_id, layout_generation, command).await
            }
            ControlCommand::PublishTopology { revision } => {
                let snapshot = self.plane.topology_snapshot();
                self.wan.publish_readiness(encode::readiness_update(
                    &self.relay,
                    revision,
                    &snapshot.entries,
                ));
                Vec::new()
            }
        }
    }

    async fn execute_host(&mut self, command: HostCommand) -> Vec<ControlCommand> {
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
                Vec::new()
            }
            HostCommand::WithdrawPool { pool_id, layout_generation, .. } => {
                // Its streams end once the catalog that withdraws it is out (below).
                self.withdrawn.push((pool_id, layout_generation));
                Vec::new()
            }
            HostCommand::PublishCatalog { .. } => {
                let snapshot = self.plane.catalog_snapshot();
                self.wan.publish_catalog(encode::catalog_update(&self.relay, &snapshot));
                self.retire_withdrawn().await;
                Vec::new()
            }
            HostCommand::StopActor { pool_id, layout_generation, mode, .. } => {
                // A withdrawal is always followed by its catalog; should one not be, the
                // streams still end before their pool stops.
                self.retire_withdrawn().await;
                self.pools.stop(&(pool_id, layout_generation), mode);
                Vec::new()
            }
            HostCommand::ReleasePool { pool_id, layout_generation, .. } => {
                self.publications.retire(pool_id, layout_generation).await;
                self.pools.release(&(pool_id, layout_generation));
                Vec::new()
            }
            HostCommand::RecoverSource { .. } => {
                debug_assert!(false, "the control plane answers the host's recovery calls");
                Vec::new()
            }
        }
    }

    async fn execute_source(
        &mut self,
        endpoint: EndpointPath,
        pool_id: PoolId,
        layout_generation: u64,
        command: SourceCommand,
    ) -> Vec<ControlCommand> {
        let key = (pool_id, layout_generation);
        let now = self.now();
        match command {
            SourceCommand::ApplyEvents { .. } => {
                debug_assert!(false, "event writes are held for the batch (execute_one)");
                Vec::new()
            }
            SourceCommand::ResetRank { source, fence, .. } => {
                self.pools.reset_rank(&key, source, fence);
                Vec::new()
            }
            SourceCommand::ReplaceRanks { ranks } => {
                // The driver reports each rank it leaves unreplaced (`FaultSink::refused`).
                self.pools.replace_ranks(&key, ranks);
                Vec::new()
            }
            SourceCommand::RequestRecovery(call) => {
                let timeout = call.deadline.saturating_sub(now).max(Duration::from_millis(1));
                let query = self.recovery.query(call.target.clone(), call.request, timeout);
                let reports = self.reports.clone();
                let request_id = call.request_id;
                let task = crate::runtime::spawn(async move {
                    let report = match tokio::time::timeout(timeout, query).await {
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
                Vec::new()
            }
            SourceCommand::CancelRecovery { request_id, .. } => {
                self.recoveries.cancel(pool_id, layout_generation, request_id);
                Vec::new()
            }
        }
    }

    /// After the step of the input taken at `at`: a checkpoint if the tap says one is due,
    /// stamped `at` (the state it captures is the one after that step).
    async fn checkpoint_if_due(&mut self, at: Duration, inputs_handled: u64) {
        let Some(tap) = self.tap.clone() else { return };
        if tap.checkpoint_due(at, inputs_handled) {
            // The checkpoint reads the pools: every write of the steps before it goes first.
            self.flush_applies();
            let checkpoint = capture_checkpoint(&self.plane, &mut self.pools, inputs_handled);
            tap.checkpoint(at, checkpoint);
        }
    }

    fn publish_load(&mut self) {
        if let Ok(window) = self.plane.load_window(self.clock.now_unix_ms()) {
            self.wan.publish_load(encode::load_update(&self.relay, &window));
        }
    }

    /// Runs after every input: reads counts and revisions, never copies the catalog or topology.
    fn publish_status(&self, inputs_handled: u64, stopped: bool) {
        let health = self.plane.health();
        let status = NodeStatus {
            healthy: health.healthy,
            catalog_revision: health.catalog_revision,
            topology_revision: health.topology_revision,
            active_pools: self.plane.catalog_len(),
            pools_starting: self.starts.pending(),
            inputs_handled,
            input_batches: self.input_batches,
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

/// What woke the node.
enum Wake {
    /// Commands of a report, a fence request, a timer or nothing (allocation, load window).
    Commands(Vec<ControlCommand>),
    /// The first input of a batch.
    Input(QueuedInput),
}

/// Whether a command reaches a pool or a publication (so the held writes go first).
fn reaches_pools(command: &ControlCommand) -> bool {
    match command {
        ControlCommand::Host(_) => true,
        ControlCommand::Source { command, .. } => !matches!(
            command,
            SourceCommand::RequestRecovery(_) | SourceCommand::CancelRecovery { .. }
        ),
        ControlCommand::PublishTopology { .. } => false,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_core::model::hashing::HashFormat;
    use kvrelay_core::model::identity::{DcId, resolve_indexer_domain};
    use kvrelay_core::model::kv_events::SourceKey;
    use kvrelay_core::pool::ApplyError;
    use kvrelay_core::sources::RankFence;

    use super::*;

    fn fault(event_id: u64) -> PoolFault {
        PoolFault {
            source: SourceKey { worker_id: 7, dp_rank: 0 },
            fence: RankFence(2),
            event_id,
            error: ApplyError::AllocationFailed,
        }
    }

    #[test]
    fn a_fault_or_refusal_that_finds_the_report_queue_full_fences_its_generation() {
        let (reports, mut queue) = mpsc::channel(1);
        let fences = FenceRequests::default();
        let endpoint: EndpointPath = "ns/backend/generate".parse().unwrap();
        let indexer_domain =
            resolve_indexer_domain("model", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
        let pool_id = PoolId { indexer_domain, dc_id: DcId(9) };
        let faults =
            NodeFaults { endpoint, pool_id, layout_generation: 4, reports, fences: fences.clone() };
        faults.report(fault(1));
        assert!(fences.take().is_empty(), "a fault with room in the queue is reported");
        faults.report(fault(2));
        assert_eq!(fences.take(), vec![(pool_id, 4)], "the lost fault fences instead");
        assert!(matches!(
            queue.try_recv(),
            Ok(ShellReport::PoolFault {
                layout_generation: 4,
                fault: PoolFault { event_id: 1, .. },
                ..
            })
        ));
        // A refused rank replacement reaches the rank's tracker only, under the same rule.
        faults.refused(fault(3));
        assert!(fences.take().is_empty());
        faults.refused(fault(4));
        assert_eq!(fences.take(), vec![(pool_id, 4)]);
        assert!(matches!(
            queue.try_recv(),
            Ok(ShellReport::ApplyFailed {
                layout_generation: 4,
                fault: PoolFault { event_id: 3, .. },
                ..
            })
        ));
    }
}
