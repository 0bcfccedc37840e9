//! The pool actor: the async shell that owns one pool's ownership state and publisher.
//!
//! One task per pool applies commands in order. Bounds and behaviour at the bound:
//! - the mailbox holds [`ActorConfig::mailbox_capacity`] commands; senders wait (backpressure,
//!   never drops);
//! - event batches additionally take block-weighted permits from a pool of
//!   [`ActorConfig::pending_block_permits`] before admission, so a flood of large stores waits
//!   before it queues;
//! - deltas go to a broadcast of [`ActorConfig::delta_broadcast_capacity`]; a receiver that falls
//!   further behind sees `Lagged` and must take a new barrier snapshot.
//!
//! Publication cadence: a batch is cut after `publication_threshold_events` applied events, or
//! `publication_delay` after the first pending one, or on `flush`; never inside a command.
//! Shutdown is graceful (publish the tail, retire the lease) unless the actor is fenced, which
//! discards the unpublished tail.
//!
//! Journaling ([`PublicationMode`], `pool::script`): a reported actor tells its sink every
//! publication point its commands do not determine (timer, flush, barrier, lease retirement,
//! failed delivery). A scripted actor (replay) has no timer and performs the recorded points
//! after the same deterministic commands until the script's end, then runs free. While
//! scripted, a subscription never moves the publisher: it is answered once the publisher holds
//! its lease with nothing unpublished (so the snapshot is exactly the state at the last published
//! sequence and the next delta continues it), and held until then; a retirement from a
//! subscriber is ignored (the recording's retirements are in the script).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::script::{
    PublicationMode, PublicationPoint, PublicationSink, PublicationStep, ScriptPosition,
    ScriptState,
};
use crate::runtime::{BlockingExecutor, run_blocking};
use kvrelay_core::model::identity::LaneLease;
use kvrelay_core::model::kv_events::{RouterEvent, SourceKey};
use kvrelay_core::pool::{ApplyError, OwnershipCounters, PoolOwnership, RankReplacement, TableKey};
use kvrelay_core::pool::{
    Delta, FenceReason, PUBLICATION_DELAY_MS, PUBLICATION_THRESHOLD_EVENTS, PublicationCadence,
    PublishError, PublishOutcome, Publisher, Snapshot,
};

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
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            mailbox_capacity: 256,
            pending_block_permits: 65_536,
            publication_threshold_events: PUBLICATION_THRESHOLD_EVENTS,
            publication_delay: Duration::from_millis(PUBLICATION_DELAY_MS),
            delta_broadcast_capacity: 64,
        }
    }
}

/// A fault the actor reports to its host (capacity omissions and unknown removals are counted,
/// not reported).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorFault {
    /// The rank whose event failed.
    pub source: SourceKey,
    /// The failed event's id.
    pub event_id: u64,
    /// What went wrong; its disposition says what the host should do.
    pub error: ApplyError,
}

/// Where the actor reports faults. Implementations must not block.
pub trait FaultSink: Send + Sync + Debug + 'static {
    /// Record one fault.
    fn report(&self, fault: ActorFault);
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

/// Sums of [`ActorStats`] over several pools (the operations surface's pool gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolTotals {
    /// Pools whose actor answered.
    pub pools: u64,
    /// Distinct owned canonical hashes.
    pub owned_blocks: u64,
    /// Occupied filter slots.
    pub resident_blocks: u64,
    /// Ownership counters, summed.
    pub counters: OwnershipCounters,
}

impl PoolTotals {
    /// Add one pool's reading.
    pub fn add(&mut self, stats: &ActorStats) {
        let counters = &mut self.counters;
        self.pools += 1;
        self.owned_blocks += stats.owned_blocks as u64;
        self.resident_blocks += stats.resident_blocks;
        counters.events_applied += stats.counters.events_applied;
        counters.events_ignored += stats.counters.events_ignored;
        counters.events_rejected += stats.counters.events_rejected;
        counters.capacity_omissions += stats.counters.capacity_omissions;
        counters.unknown_removals += stats.counters.unknown_removals;
    }
}

/// Point-in-time counters of an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActorStats {
    /// Ownership counters.
    pub counters: OwnershipCounters,
    /// Distinct owned canonical hashes.
    pub owned_blocks: usize,
    /// Occupied filter slots.
    pub resident_blocks: u64,
    /// Last published sequence.
    pub sequence: u64,
    /// Current lease.
    pub lease: Option<LaneLease>,
    /// Fence reason, if fenced.
    pub fence: Option<FenceReason>,
}

/// A pool's logical state in digest form (journal checkpoints compare these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDigest {
    /// Distinct owned canonical hashes (the exact-block count).
    pub owned_blocks: u64,
    /// xxh3 of the owned canonical hashes in ascending order (little-endian `u64`s).
    pub canonical_digest: u64,
    /// xxh3 of the filter's words in order (little-endian `u64`s).
    pub filter_digest: u64,
    /// Last published sequence.
    pub sequence: u64,
}

enum Command {
    Apply {
        events: Vec<RouterEvent>,
        _permit: OwnedSemaphorePermit,
    },
    ReplaceRanks {
        replacements: BTreeMap<SourceKey, RankReplacement>,
        reply: oneshot::Sender<Result<u32, ApplyError>>,
    },
    ResetRank {
        source: SourceKey,
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
        reply: oneshot::Sender<ActorStats>,
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
    table_key: TableKey,
}

/// The actor's journaling role (see [`PublicationMode`]).
#[derive(Debug)]
enum Journal {
    Free,
    Reported(Arc<dyn PublicationSink>),
    Scripted(ScriptState),
}

/// A subscription held by a scripted actor until it can be answered.
type Held = (LaneLease, oneshot::Sender<Result<Subscription, SubscribeError>>);

struct ActorCore {
    pool: PoolOwnership,
    publisher: Publisher,
    cadence: PublicationCadence,
    deltas: broadcast::Sender<Arc<Delta>>,
    /// Deltas offered to the broadcast so far (delivered or not).
    offered: u64,
    /// Deterministic commands processed so far.
    position: ScriptPosition,
    journal: Journal,
    /// The lease a scripted actor handed to its subscribers.
    served: Option<LaneLease>,
}

/// Hand `delta` to the broadcast. A scripted actor fails exactly the recorded ordinals (and
/// ignores a missing receiver); otherwise a missing receiver fails it, reported when reporting.
fn offer(
    deltas: &broadcast::Sender<Arc<Delta>>,
    offered: &mut u64,
    journal: &Journal,
    position: ScriptPosition,
    delta: Delta,
) -> Result<(), Delta> {
    let ordinal = *offered;
    *offered += 1;
    if let Journal::Scripted(script) = journal {
        if script.failures.contains(&ordinal) {
            return Err(delta);
        }
        let _ = deltas.send(Arc::new(delta));
        return Ok(());
    }
    let sequence = delta.base_sequence;
    deltas.send(Arc::new(delta)).map(|_| ()).map_err(|returned| {
        if let Journal::Reported(sink) = journal {
            let step = PublicationStep::DeliveryFailed(ordinal);
            sink.point(PublicationPoint { position, step, sequence });
        }
        unwrap_delta(returned.0)
    })
}

impl ActorCore {
    fn publish(&mut self) -> Result<PublishOutcome, PublishError> {
        self.cadence.reset();
        let ActorCore { pool, publisher, deltas, offered, journal, position, .. } = self;
        publisher.publish(pool, &mut |delta| offer(deltas, offered, journal, *position, delta))
    }

    /// Publish the pending tail and install `lease` (the publisher's barrier).
    fn barrier(&mut self, lease: LaneLease) -> Result<Snapshot, PublishError> {
        self.cadence.reset();
        let ActorCore { pool, publisher, deltas, offered, journal, position, .. } = self;
        publisher.snapshot_after_barrier(pool, lease, &mut |delta| {
            offer(deltas, offered, journal, *position, delta)
        })
    }

    /// Report `step` if reporting.
    fn report(&self, step: PublicationStep) {
        if let Journal::Reported(sink) = &self.journal {
            let sequence = self.publisher.last_sequence();
            sink.point(PublicationPoint { position: self.position, step, sequence });
        }
    }

    fn is_scripted(&self) -> bool {
        matches!(self.journal, Journal::Scripted(_))
    }

    fn script_until(&self) -> Option<Instant> {
        match &self.journal {
            Journal::Scripted(script) => Some(script.until),
            _ => None,
        }
    }

    /// Perform every scripted point reached, then answer the held subscriptions that can be.
    fn advance(&mut self, held: &mut Vec<Held>) {
        loop {
            let Journal::Scripted(script) = &mut self.journal else { return };
            let Some(point) = script.next_due(self.position) else { break };
            match point.step {
                PublicationStep::Publish => {
                    let _ = self.publish();
                }
                PublicationStep::Barrier(lease) => {
                    let _ = self.barrier(lease.into());
                }
                PublicationStep::RetireLease(lease) => {
                    let lease = LaneLease::from(lease);
                    // Taking the lease from a live subscriber would leave it stale: keep it (the
                    // sequence then leaves the recording, and the checkpoint says so).
                    if self.served != Some(lease) || self.deltas.receiver_count() == 0 {
                        self.publisher.retire_lease(lease);
                    }
                }
                PublicationStep::DeliveryFailed(_) => {}
            }
            let replayed = self.publisher.last_sequence();
            if replayed != point.sequence {
                if let Journal::Scripted(script) = &mut self.journal {
                    script.mismatches += 1;
                }
                tracing::debug!(
                    ?point,
                    replayed,
                    "scripted publication point left the recorded sequence"
                );
            }
        }
        self.answer_held(held);
    }

    /// Answer each held subscription whose lease the publisher holds, unfenced, with nothing
    /// unpublished: the snapshot is the state at the last published sequence.
    fn answer_held(&mut self, held: &mut Vec<Held>) {
        if held.is_empty() {
            return;
        }
        let ready = self.publisher.fence_reason().is_none() && !self.pool.has_unpublished_writes();
        let current = self.publisher.lease();
        let mut waiting = Vec::new();
        for (lease, reply) in held.drain(..) {
            if reply.is_closed() {
                continue;
            }
            if !(ready && current == Some(lease)) {
                waiting.push((lease, reply));
                continue;
            }
            let snapshot = Snapshot {
                lease,
                sequence: self.publisher.last_sequence(),
                words: self.pool.filter().words().to_vec(),
            };
            self.served = Some(lease);
            let _ = reply.send(Ok(Subscription { snapshot, deltas: self.deltas.subscribe() }));
        }
        *held = waiting;
    }

    fn stats(&self) -> ActorStats {
        ActorStats {
            counters: *self.pool.counters(),
            owned_blocks: self.pool.owned_block_count(),
            resident_blocks: self.pool.filter().occupied_slots(),
            sequence: self.publisher.last_sequence(),
            lease: self.publisher.lease(),
            fence: self.publisher.fence_reason(),
        }
    }
}

impl ActorCore {
    fn digest(&self) -> PoolDigest {
        let blocks = self.pool.owned_blocks();
        PoolDigest {
            owned_blocks: blocks.len() as u64,
            canonical_digest: digest_u64s(blocks.iter().map(|(hash, _)| hash.0)),
            filter_digest: digest_u64s(self.pool.filter().words().iter().copied()),
            sequence: self.publisher.last_sequence(),
        }
    }
}

/// The digest [`PoolDigest::filter_digest`] takes of a filter's words, for comparing a copy of
/// them (a consumer's replica) with the pool's own.
#[must_use]
pub fn filter_words_digest(words: &[u64]) -> u64 {
    digest_u64s(words.iter().copied())
}

/// xxh3-64 of `values` as consecutive little-endian bytes, fed to the hasher in 4 KiB chunks.
fn digest_u64s(values: impl Iterator<Item = u64>) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut chunk = [0u8; 4096];
    let mut len = 0;
    for value in values {
        chunk[len..len + 8].copy_from_slice(&value.to_le_bytes());
        len += 8;
        if len == chunk.len() {
            hasher.update(&chunk);
            len = 0;
        }
    }
    hasher.update(&chunk[..len]);
    hasher.digest()
}

fn unwrap_delta(delta: Arc<Delta>) -> Delta {
    Arc::try_unwrap(delta).unwrap_or_else(|shared| (*shared).clone())
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
    pool: PoolOwnership,
    config: ActorConfig,
    executor: Arc<dyn BlockingExecutor>,
    faults: Arc<dyn FaultSink>,
    mode: PublicationMode,
) -> (PoolActorHandle, JoinHandle<ActorExit>) {
    let (commands, mailbox) = mpsc::channel(config.mailbox_capacity.max(1));
    let permits_max = config.pending_block_permits.max(1);
    let permits = Arc::new(Semaphore::new(permits_max as usize));
    let fence = CancellationToken::new();
    let table_key = pool.table_key();
    let (deltas, _) = broadcast::channel(config.delta_broadcast_capacity.max(1));
    let core = ActorCore {
        pool,
        publisher: Publisher::new(),
        cadence: PublicationCadence::new(config.publication_threshold_events),
        deltas,
        offered: 0,
        position: ScriptPosition::default(),
        journal: match mode {
            PublicationMode::Free => Journal::Free,
            PublicationMode::Reported(sink) => Journal::Reported(sink),
            PublicationMode::Scripted(script) => Journal::Scripted(ScriptState::new(script)),
        },
        served: None,
    };
    let task = crate::runtime::spawn(run(core, mailbox, config, executor, faults, fence.clone()));
    (PoolActorHandle { commands, permits, permits_max, fence, table_key }, task)
}

async fn run(
    mut core: ActorCore,
    mut mailbox: mpsc::Receiver<Command>,
    config: ActorConfig,
    executor: Arc<dyn BlockingExecutor>,
    faults: Arc<dyn FaultSink>,
    fence: CancellationToken,
) -> ActorExit {
    let mut deadline: Option<Instant> = None;
    let mut held: Vec<Held> = Vec::new();
    core.advance(&mut held);
    loop {
        let script_until = core.script_until();
        let command = tokio::select! {
            biased;
            () = fence.cancelled() => return ActorExit::Fenced,
            () = sleep_until(deadline), if deadline.is_some() => {
                deadline = None;
                let _ = core.publish();
                core.report(PublicationStep::Publish);
                continue;
            }
            () = sleep_until(script_until), if script_until.is_some() => {
                core.journal = Journal::Free;
                if core.pool.has_unpublished_writes() {
                    deadline = Some(Instant::now() + config.publication_delay);
                }
                for (lease, reply) in std::mem::take(&mut held) {
                    let Some(returned) = subscribe(core, lease, reply, executor.as_ref()).await
                    else {
                        return ActorExit::Fenced;
                    };
                    core = returned;
                }
                continue;
            }
            command = mailbox.recv() => command,
        };
        let Some(command) = command else {
            let _ = core.publish();
            return ActorExit::Abandoned;
        };
        let scripted = core.is_scripted();
        match command {
            Command::Apply { events, _permit } => {
                let mut due = false;
                for event in &events {
                    match core.pool.apply_event(event) {
                        Ok(outcome) if outcome.applied => due |= core.cadence.record_event(),
                        Ok(_) => {}
                        Err(error) => {
                            faults.report(ActorFault {
                                source: event.source(),
                                event_id: event.event.event_id,
                                error,
                            });
                            due |= core.cadence.record_event();
                        }
                    }
                }
                if due {
                    deadline = None;
                    let _ = core.publish();
                } else if !scripted && deadline.is_none() && core.pool.has_unpublished_writes() {
                    deadline = Some(Instant::now() + config.publication_delay);
                }
                core.position.commands += 1;
            }
            Command::ReplaceRanks { replacements, reply } => {
                let result = core.pool.replace_ranks(replacements);
                deadline = None;
                let _ = core.publish();
                let _ = reply.send(result);
                core.position.commands += 1;
            }
            Command::ResetRank { source } => {
                if let Err(error) = core.pool.remove_rank(source) {
                    faults.report(ActorFault { source, event_id: 0, error });
                }
                deadline = None;
                let _ = core.publish();
                core.position.commands += 1;
            }
            Command::Flush { reply } if scripted => {
                let _ = reply.send(Ok(core.publisher.last_sequence()));
            }
            Command::Flush { reply } => {
                deadline = None;
                let result = core.publish().map(|_| core.publisher.last_sequence());
                core.report(PublicationStep::Publish);
                let _ = reply.send(result);
            }
            Command::Subscribe { lease, reply } if scripted => held.push((lease, reply)),
            Command::Subscribe { lease, reply } => {
                deadline = None;
                let Some(returned) = subscribe(core, lease, reply, executor.as_ref()).await else {
                    return ActorExit::Fenced;
                };
                core = returned;
            }
            Command::RetireLease { .. } if scripted => {}
            Command::RetireLease { lease } => {
                core.publisher.retire_lease(lease);
                core.report(PublicationStep::RetireLease(lease.into()));
            }
            Command::Stats { reply } => {
                let _ = reply.send(core.stats());
            }
            Command::Digest { reply } => {
                let _ = reply.send(core.digest());
                core.position.digests += 1;
            }
            Command::Shutdown => {
                let _ = core.publish();
                if let Some(lease) = core.publisher.lease() {
                    core.publisher.retire_lease(lease);
                }
                return ActorExit::Graceful;
            }
        }
        if scripted {
            core.advance(&mut held);
        }
    }
}

/// A subscription's barrier; `None` when the snapshot job died (the actor must stop).
async fn subscribe(
    core: ActorCore,
    lease: LaneLease,
    reply: oneshot::Sender<Result<Subscription, SubscribeError>>,
    executor: &dyn BlockingExecutor,
) -> Option<ActorCore> {
    let (returned, result) = barrier_snapshot(core, lease, executor).await;
    let Some(mut core) = returned else {
        let _ = reply.send(Err(SubscribeError::SnapshotJob));
        return None;
    };
    core.report(PublicationStep::Barrier(lease.into()));
    match result {
        Ok(snapshot) => {
            // Subscribe before the next command mutates anything: the first delta this
            // receiver sees is exactly S → S + 1.
            let subscription = Subscription { snapshot, deltas: core.deltas.subscribe() };
            if let Err(Ok(dropped)) = reply.send(Ok(subscription)) {
                core.publisher.retire_lease(dropped.snapshot.lease);
                core.report(PublicationStep::RetireLease(dropped.snapshot.lease.into()));
            }
        }
        Err(error) => {
            let _ = reply.send(Err(error));
        }
    }
    Some(core)
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Take the barrier snapshot through the executor seam: the state moves to the job and back.
async fn barrier_snapshot(
    core: ActorCore,
    lease: LaneLease,
    executor: &dyn BlockingExecutor,
) -> (Option<ActorCore>, Result<Snapshot, SubscribeError>) {
    let job = run_blocking(executor, move || {
        let mut core = core;
        let result = core.barrier(lease);
        (core, result)
    })
    .await;
    match job {
        Ok((core, result)) => (Some(core), result.map_err(SubscribeError::from)),
        Err(_) => (None, Err(SubscribeError::SnapshotJob)),
    }
}

impl PoolActorHandle {
    /// The key the pool's tables hash under; rank replacements for it are built with it.
    #[must_use]
    pub fn table_key(&self) -> TableKey {
        self.table_key
    }

    async fn send(&self, command: Command) -> Result<(), ActorGone> {
        self.commands.send(command).await.map_err(|_| ActorGone)
    }

    /// Queue a batch of events from one publisher, after taking block-weighted permits.
    pub async fn apply(&self, events: Vec<RouterEvent>) -> Result<(), ActorGone> {
        let blocks: usize = events.iter().map(event_weight).sum();
        let weight = u32::try_from(blocks).unwrap_or(u32::MAX).clamp(1, self.permits_max);
        let permit =
            Arc::clone(&self.permits).acquire_many_owned(weight).await.map_err(|_| ActorGone)?;
        self.send(Command::Apply { events, _permit: permit }).await
    }

    /// Replace several ranks at once; returns the capacity omissions.
    pub async fn replace_ranks(
        &self,
        replacements: BTreeMap<SourceKey, RankReplacement>,
    ) -> Result<Result<u32, ApplyError>, ActorGone> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::ReplaceRanks { replacements, reply }).await?;
        answer.await.map_err(|_| ActorGone)
    }

    /// Drop every block of one rank.
    pub async fn reset_rank(&self, source: SourceKey) -> Result<(), ActorGone> {
        self.send(Command::ResetRank { source }).await
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
    pub async fn stats(&self) -> Result<ActorStats, ActorGone> {
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
