//! The pool actor: the task that drives one pool's [`PoolMachine`] (ownership, publisher,
//! cadence and publication points, all decided in `kvrelay_core::pool`) and carries its effects
//! out.
//!
//! One task per pool feeds commands in order. Bounds and behaviour at the bound:
//! - the mailbox holds [`ActorConfig::mailbox_capacity`] commands; senders wait (backpressure,
//!   never drops);
//! - event batches additionally take block-weighted permits from a pool of
//!   [`ActorConfig::pending_block_permits`] before admission, so a flood of large stores waits
//!   before it queues;
//! - deltas go to a broadcast of [`ActorConfig::delta_broadcast_capacity`]; a receiver that falls
//!   further behind sees `Lagged` and must take a new barrier snapshot;
//! - the pool's exact ownership state allocates at most [`ActorConfig::exact_state_bytes_max`]
//!   (by default derived from the pool's filter); a write that would pass it is refused by the
//!   core and reported as a resource failure of its rank.
//!
//! The task holds no decision of its own: it sleeps until the machine's `poll_timeout`, runs
//! barrier snapshots on the blocking executor (the machine moves to the job and back, so nothing
//! else touches it meanwhile), pairs held subscriptions with their reply channels, and hands
//! faults and publication points to their sinks. Shutdown is graceful (publish the tail, retire
//! the lease) unless the actor is fenced, which discards the unpublished tail.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::mode::{PublicationMode, PublicationSink};
use crate::runtime::{BlockingExecutor, run_blocking};
use kvrelay_core::model::identity::LaneLease;
use kvrelay_core::model::kv_events::{RouterEvent, SourceKey};
use kvrelay_core::pool::{
    CadenceConfig, Delta, DeltaOutlet, HoldId, OwnershipCounters, PUBLICATION_DELAY_MS,
    PUBLICATION_THRESHOLD_EVENTS, PoolDigest, PoolEffect, PoolFault, PoolMachine, PoolOwnership,
    PoolStats, PublicationRole, PublicationScript, PublishError, Snapshot, SubscribeStep,
};
use kvrelay_core::sources::{RankDump, RankFence};

/// Bounds and cadence of one pool actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ActorConfig {
    /// Commands queued before senders wait.
    pub mailbox_capacity: usize,
    /// Block-weighted admission permits (each batch takes `max(1, blocks)`, capped here).
    pub pending_block_permits: u32,
    /// Applied events that force a publication.
    pub publication_threshold_events: u32,
    /// Delay after the first pending event before publishing.
    pub publication_delay: Duration,
    /// Deltas buffered for the publication hub.
    pub delta_broadcast_capacity: usize,
    /// Most bytes the exact ownership state of one pool may allocate; `None` derives it from
    /// the pool's filter ([`kvrelay_core::pool::exact_state_bytes_max_default`]: 256 bytes per
    /// slot, at least 64 MiB). Last, with a default, so configurations recorded before it
    /// existed still decode (to `None`).
    #[serde(default)]
    pub exact_state_bytes_max: Option<usize>,
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            mailbox_capacity: 256,
            pending_block_permits: 65_536,
            publication_threshold_events: PUBLICATION_THRESHOLD_EVENTS,
            publication_delay: Duration::from_millis(PUBLICATION_DELAY_MS),
            delta_broadcast_capacity: 64,
            exact_state_bytes_max: None,
        }
    }
}

/// Where the actor reports faults. Implementations must not block.
pub trait FaultSink: Send + Sync + Debug + 'static {
    /// Record one fault of an event batch or a reset the actor could not apply (the rank's
    /// tracker and the host's fault coalescing both hear of it).
    fn report(&self, fault: PoolFault);

    /// Record one rank a replacement left unreplaced (its state is unchanged; only the rank's
    /// tracker hears of it, and recovers the rank again).
    fn refused(&self, fault: PoolFault);
}

/// The actor task has stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("pool actor has stopped")]
pub struct ActorGone;

/// Why a subscription barrier failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SubscribeError {
    /// The actor has stopped.
    #[error(transparent)]
    Gone(#[from] ActorGone),
    /// The publisher refused (sequence exhausted, allocation, tail delivery).
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// The snapshot job died.
    #[error("snapshot job failed")]
    SnapshotJob,
}

/// A barrier snapshot together with the deltas that follow it.
#[derive(Debug)]
pub struct Subscription {
    /// The filter at the barrier, sequence `S`.
    pub snapshot: Snapshot,
    /// Deltas from `S → S + 1` on.
    pub deltas: broadcast::Receiver<Arc<Delta>>,
}

/// Sums of [`PoolStats`] over several pools (the operations surface's pool gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolTotals {
    /// Pools whose actor answered.
    pub pools: u64,
    /// Distinct owned canonical hashes.
    pub owned_blocks: u64,
    /// Occupied filter slots.
    pub resident_blocks: u64,
    /// Bytes the pools' exact ownership states allocate.
    pub exact_state_bytes: u64,
    /// The pools' exact-state byte budgets, summed.
    pub exact_state_bytes_max: u64,
    /// The least room left under its budget of any pool (`None` without a pool): 0 means a
    /// pool is refusing growth.
    pub exact_state_headroom_bytes_min: Option<u64>,
    /// Ownership counters, summed.
    pub counters: OwnershipCounters,
}

impl PoolTotals {
    /// Add one pool's reading.
    pub fn add(&mut self, stats: &PoolStats) {
        let counters = &mut self.counters;
        self.pools += 1;
        self.owned_blocks += stats.owned_blocks as u64;
        self.resident_blocks += stats.resident_blocks;
        self.exact_state_bytes += stats.exact_state_bytes as u64;
        self.exact_state_bytes_max += stats.exact_state_bytes_max as u64;
        let headroom = stats.exact_state_bytes_max.saturating_sub(stats.exact_state_bytes) as u64;
        self.exact_state_headroom_bytes_min =
            Some(self.exact_state_headroom_bytes_min.map_or(headroom, |min| min.min(headroom)));
        counters.events_applied += stats.counters.events_applied;
        counters.events_ignored += stats.counters.events_ignored;
        counters.events_rejected += stats.counters.events_rejected;
        counters.capacity_omissions += stats.counters.capacity_omissions;
        counters.unknown_removals += stats.counters.unknown_removals;
        counters.budget_refusals += stats.counters.budget_refusals;
    }
}

/// Events of one rank written under one fence: what one input's step asks of the pool.
pub type ApplySegment = (RankFence, Vec<RouterEvent>);

enum Command {
    /// Segments applied in order, each as its own machine input (so the cadence and the
    /// journal's script positions see what separate commands would have shown them).
    Apply {
        segments: Vec<ApplySegment>,
        _permit: OwnedSemaphorePermit,
    },
    ReplaceRanks {
        dumps: Vec<RankDump>,
    },
    ResetRank {
        source: SourceKey,
        fence: RankFence,
    },
    Flush {
        reply: oneshot::Sender<Result<u64, PublishError>>,
    },
    Subscribe {
        lease: LaneLease,
        reply: oneshot::Sender<Result<Subscription, SubscribeError>>,
    },
    RetireLease {
        lease: LaneLease,
    },
    Stats {
        reply: oneshot::Sender<PoolStats>,
    },
    Digest {
        reply: oneshot::Sender<PoolDigest>,
    },
    Shutdown,
}

/// How the actor ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActorExit {
    /// Graceful shutdown published the tail and retired the lease.
    Graceful,
    /// Fenced: the unpublished tail was discarded.
    Fenced,
    /// Every handle was dropped.
    Abandoned,
}

/// A handle to a running pool actor. Cloning shares the same actor.
#[derive(Debug, Clone)]
pub struct PoolActorHandle {
    commands: mpsc::Sender<Command>,
    permits: Arc<Semaphore>,
    permits_max: u32,
    fence: CancellationToken,
}

/// The broadcast the hub's streams receive deltas from.
#[derive(Debug)]
struct BroadcastOutlet(broadcast::Sender<Arc<Delta>>);

impl DeltaOutlet for BroadcastOutlet {
    fn offer(&mut self, delta: Delta) -> Result<(), Delta> {
        self.0.send(Arc::new(delta)).map(|_| ()).map_err(|returned| unwrap_delta(returned.0))
    }

    fn has_receivers(&self) -> bool {
        self.0.receiver_count() > 0
    }
}

fn unwrap_delta(delta: Arc<Delta>) -> Delta {
    Arc::try_unwrap(delta).unwrap_or_else(|shared| (*shared).clone())
}

type SubscriptionReply = oneshot::Sender<Result<Subscription, SubscribeError>>;

/// The task's state: the machine and where its effects go.
struct Actor {
    machine: PoolMachine,
    outlet: BroadcastOutlet,
    /// The machine's clock counts from here.
    origin: Instant,
    sink: Option<Arc<dyn PublicationSink>>,
    faults: Arc<dyn FaultSink>,
    /// Reply channels of the subscriptions the machine holds.
    held: BTreeMap<HoldId, SubscriptionReply>,
    /// Held subscriptions the machine released to a barrier, in order.
    released: VecDeque<(HoldId, LaneLease)>,
    /// Script mismatches already logged.
    mismatches: u64,
}

impl Actor {
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }

    /// Carry out every queued effect of the machine.
    fn carry_out(&mut self) {
        while let Some(effect) = self.machine.poll_effect() {
            match effect {
                PoolEffect::Fault(fault) => self.faults.report(fault),
                PoolEffect::Point(point) => {
                    if let Some(sink) = &self.sink {
                        sink.point(point);
                    }
                }
                PoolEffect::Answer { hold, snapshot } => {
                    if let Some(reply) = self.held.remove(&hold) {
                        let deltas = self.outlet.0.subscribe();
                        let _ = reply.send(Ok(Subscription { snapshot, deltas }));
                    }
                }
                PoolEffect::Release { hold, lease } => self.released.push_back((hold, lease)),
            }
        }
        let mismatches = self.machine.script_mismatches();
        if mismatches > self.mismatches {
            self.mismatches = mismatches;
            tracing::debug!(mismatches, "scripted publication point left the recorded sequence");
        }
    }

    /// Tell the machine about held subscriptions whose subscriber went away.
    fn prune_held(&mut self) {
        let machine = &mut self.machine;
        self.held.retain(|hold, reply| {
            let live = !reply.is_closed();
            if !live {
                machine.forget_hold(*hold);
            }
            live
        });
    }
}

/// Start an actor owning `pool`; its publisher starts at sequence 0 with no lease.
pub fn spawn_pool_actor(
    pool: PoolOwnership,
    config: ActorConfig,
    executor: Arc<dyn BlockingExecutor>,
    faults: Arc<dyn FaultSink>,
) -> (PoolActorHandle, JoinHandle<ActorExit>) {
    spawn_pool_actor_with(pool, config, executor, faults, PublicationMode::Free)
}

/// [`spawn_pool_actor`] in a journaling [`PublicationMode`].
pub fn spawn_pool_actor_with(
    mut pool: PoolOwnership,
    config: ActorConfig,
    executor: Arc<dyn BlockingExecutor>,
    faults: Arc<dyn FaultSink>,
    mode: PublicationMode,
) -> (PoolActorHandle, JoinHandle<ActorExit>) {
    if let Some(bytes_max) = config.exact_state_bytes_max
        && let Err(refused) = pool.set_exact_state_bytes_max(bytes_max)
    {
        tracing::warn!(%refused, "the pool keeps its exact-state byte budget");
    }
    let (commands, mailbox) = mpsc::channel(config.mailbox_capacity.max(1));
    let permits_max = config.pending_block_permits.max(1);
    let permits = Arc::new(Semaphore::new(permits_max as usize));
    let fence = CancellationToken::new();
    let (deltas, _) = broadcast::channel(config.delta_broadcast_capacity.max(1));
    let origin = Instant::now();
    let (role, sink) = match mode {
        PublicationMode::Free => (PublicationRole::Free, None),
        PublicationMode::Reported(sink) => (PublicationRole::Reported, Some(sink)),
        PublicationMode::Scripted { points, until } => {
            let until = until.saturating_duration_since(origin);
            (PublicationRole::Scripted(PublicationScript { points, until }), None)
        }
    };
    let cadence = CadenceConfig {
        threshold_events: config.publication_threshold_events,
        delay: config.publication_delay,
    };
    let actor = Actor {
        machine: PoolMachine::new(pool, cadence, role),
        outlet: BroadcastOutlet(deltas),
        origin,
        sink,
        faults,
        held: BTreeMap::new(),
        released: VecDeque::new(),
        mismatches: 0,
    };
    let task = crate::runtime::spawn(run(actor, mailbox, executor, fence.clone()));
    (PoolActorHandle { commands, permits, permits_max, fence }, task)
}

async fn run(
    mut actor: Actor,
    mut mailbox: mpsc::Receiver<Command>,
    executor: Arc<dyn BlockingExecutor>,
    fence: CancellationToken,
) -> ActorExit {
    loop {
        while let Some((hold, lease)) = actor.released.pop_front() {
            let Some(reply) = actor.held.remove(&hold) else { continue };
            let Some(returned) = subscribe(actor, lease, reply, executor.as_ref()).await else {
                return ActorExit::Fenced;
            };
            actor = returned;
        }
        if !actor.held.is_empty() {
            actor.prune_held();
        }
        let timeout = actor.machine.poll_timeout().map(|at| actor.origin + at);
        let command = tokio::select! {
            biased;
            () = fence.cancelled() => return ActorExit::Fenced,
            () = sleep_until(timeout), if timeout.is_some() => {
                let now = actor.now();
                actor.machine.handle_timeout(now, &mut actor.outlet);
                actor.carry_out();
                continue;
            }
            command = mailbox.recv() => command,
        };
        let Some(command) = command else {
            actor.machine.abandon(&mut actor.outlet);
            actor.carry_out();
            return ActorExit::Abandoned;
        };
        let now = actor.now();
        let Actor { machine, outlet, .. } = &mut actor;
        match command {
            Command::Apply { segments, _permit } => {
                for (fence, events) in &segments {
                    machine.apply(*fence, events, now, outlet);
                }
            }
            Command::ReplaceRanks { dumps } => {
                for fault in machine.replace_ranks(dumps, outlet) {
                    actor.faults.refused(fault);
                }
            }
            Command::ResetRank { source, fence } => machine.reset_rank(source, fence, outlet),
            Command::Flush { reply } => {
                let _ = reply.send(machine.flush(outlet));
            }
            Command::Subscribe { lease, reply } => match machine.subscribe(lease, outlet) {
                SubscribeStep::Held(hold) => {
                    actor.held.insert(hold, reply);
                }
                SubscribeStep::Barrier => {
                    let Some(returned) = subscribe(actor, lease, reply, executor.as_ref()).await
                    else {
                        return ActorExit::Fenced;
                    };
                    actor = returned;
                }
            },
            Command::RetireLease { lease } => machine.retire_lease(lease),
            Command::Stats { reply } => {
                let _ = reply.send(machine.stats());
            }
            Command::Digest { reply } => {
                let _ = reply.send(machine.digest(outlet));
            }
            Command::Shutdown => {
                machine.shutdown(outlet);
                actor.carry_out();
                return ActorExit::Graceful;
            }
        }
        actor.carry_out();
    }
}

/// A free subscription's barrier, through the executor; `None` when the snapshot job died (the
/// actor must stop).
async fn subscribe(
    actor: Actor,
    lease: LaneLease,
    reply: SubscriptionReply,
    executor: &dyn BlockingExecutor,
) -> Option<Actor> {
    let job = run_blocking(executor, move || {
        let mut actor = actor;
        let result = actor.machine.barrier(lease, &mut actor.outlet);
        (actor, result)
    })
    .await;
    let Ok((mut actor, result)) = job else {
        let _ = reply.send(Err(SubscribeError::SnapshotJob));
        return None;
    };
    actor.carry_out();
    match result {
        Ok(snapshot) => {
            // Subscribe before the next command mutates anything: the first delta this
            // receiver sees is exactly S → S + 1.
            let subscription = Subscription { snapshot, deltas: actor.outlet.0.subscribe() };
            if let Err(Ok(dropped)) = reply.send(Ok(subscription)) {
                actor.machine.retire_lease(dropped.snapshot.lease);
                actor.carry_out();
            }
        }
        Err(error) => {
            let _ = reply.send(Err(error.into()));
        }
    }
    Some(actor)
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl PoolActorHandle {
    async fn send(&self, command: Command) -> Result<(), ActorGone> {
        self.commands.send(command).await.map_err(|_| ActorGone)
    }

    /// Queue a batch of events from one publisher, written under `fence`, after taking
    /// block-weighted permits.
    pub async fn apply(&self, fence: RankFence, events: Vec<RouterEvent>) -> Result<(), ActorGone> {
        self.apply_segments(vec![(fence, events)]).await
    }

    /// Queue several inputs' event batches as one command, applied in order exactly as that
    /// many [`apply`](Self::apply) calls would be; the permits weigh all their blocks (an
    /// admission heavier than the whole pool of permits takes all of them).
    pub async fn apply_segments(&self, segments: Vec<ApplySegment>) -> Result<(), ActorGone> {
        let blocks: usize = segments.iter().flat_map(|(_, events)| events).map(event_weight).sum();
        let weight = u32::try_from(blocks).unwrap_or(u32::MAX).clamp(1, self.permits_max);
        let permit =
            Arc::clone(&self.permits).acquire_many_owned(weight).await.map_err(|_| ActorGone)?;
        self.send(Command::Apply { segments, _permit: permit }).await
    }

    /// Replace the dumps' ranks at once ([`PoolMachine::replace_ranks`]); returns once the
    /// command is queued. Each rank left unreplaced goes to the [`FaultSink::refused`].
    pub async fn replace_ranks(&self, dumps: Vec<RankDump>) -> Result<(), ActorGone> {
        self.send(Command::ReplaceRanks { dumps }).await
    }

    /// Drop every block of one rank, under its new `fence`.
    pub async fn reset_rank(&self, source: SourceKey, fence: RankFence) -> Result<(), ActorGone> {
        self.send(Command::ResetRank { source, fence }).await
    }

    /// Publish pending changes now; returns the last published sequence.
    pub async fn flush(&self) -> Result<Result<u64, PublishError>, ActorGone> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Flush { reply }).await?;
        answer.await.map_err(|_| ActorGone)
    }

    /// Take a barrier snapshot under `lease` and receive the deltas that follow it.
    pub async fn subscribe(&self, lease: LaneLease) -> Result<Subscription, SubscribeError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Subscribe { lease, reply }).await?;
        answer.await.map_err(|_| SubscribeError::Gone(ActorGone))?
    }

    /// Retire `lease` if it is still the current one.
    pub async fn retire_lease(&self, lease: LaneLease) -> Result<(), ActorGone> {
        self.send(Command::RetireLease { lease }).await
    }

    /// Current counters.
    pub async fn stats(&self) -> Result<PoolStats, ActorGone> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Stats { reply }).await?;
        answer.await.map_err(|_| ActorGone)
    }

    /// The pool's logical state in digest form, after every command queued before this one.
    pub async fn digest(&self) -> Result<PoolDigest, ActorGone> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Digest { reply }).await?;
        answer.await.map_err(|_| ActorGone)
    }

    /// Graceful stop: publish the tail, retire the lease, end the task.
    pub async fn shutdown(&self) -> Result<(), ActorGone> {
        self.send(Command::Shutdown).await
    }

    /// Fence: stop at once and discard the unpublished tail.
    pub fn fence(&self) {
        self.fence.cancel();
    }
}

fn event_weight(event: &RouterEvent) -> usize {
    use kvrelay_core::model::kv_events::KvCacheEventData;
    match &event.event.data {
        KvCacheEventData::Stored(store) => store.blocks.len().max(1),
        KvCacheEventData::Removed(remove) => remove.block_hashes.len().max(1),
        KvCacheEventData::Cleared => 1,
    }
}

#[cfg(test)]
#[path = "actor_tests.rs"]
mod tests;
