//! The pool driver: one pool's [`PoolMachine`] (ownership, publisher, cadence and publication
//! points, all decided in `kvrelay_core::pool`) together with where its effects go.
//!
//! A driver is not a task. The node owns every pool's driver and calls it from its own loop:
//! event batches, rank replacements and resets as the control plane's commands reach them, the
//! machine's timer beside the plane's, and the [`PoolRequest`]s that publication hubs and the
//! operations surface send through a [`PoolHandle`]. So a pool's writes, its timer firings and
//! its subscriptions are steps of one sequential loop, in the order that loop takes them.
//!
//! Bounds and behaviour at the bound:
//! - requests queue in one channel of [`PoolConfig::mailbox_capacity`] per node; senders wait;
//! - deltas go to a broadcast of [`PoolConfig::delta_broadcast_capacity`]; a receiver that falls
//!   further behind sees `Lagged` and must take a new barrier snapshot;
//! - the pool's exact ownership state allocates at most [`PoolConfig::exact_state_bytes_max`]
//!   (by default derived from the pool's filter); a write that would pass it is refused by the
//!   core and reported as a resource failure of its rank.
//!
//! The driver decides nothing: it pairs held subscriptions with their reply channels, takes
//! barrier snapshots when the machine asks for one (a copy of the filter's words; encoding them
//! runs in the hub, off the node's loop), and hands faults and publication points to their
//! sinks. Dropping a driver without [`PoolDriver::shutdown`] is a fence: the unpublished tail is
//! discarded and the broadcast closes.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use super::mode::{PublicationMode, PublicationSink};
use kvrelay_core::model::identity::{LaneLease, PoolId};
use kvrelay_core::model::kv_events::{RouterEvent, SourceKey};
use kvrelay_core::pool::{
    CadenceConfig, Delta, DeltaOutlet, HoldId, PUBLICATION_DELAY_MS, PUBLICATION_THRESHOLD_EVENTS,
    PoolDigest, PoolEffect, PoolFault, PoolMachine, PoolOwnership, PoolStats, PublicationRole,
    PublicationScript, PublishError, Snapshot, SubscribeStep,
};
use kvrelay_core::sources::{RankDump, RankFence};

/// Bounds and cadence of every pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolConfig {
    /// Pool requests (subscriptions, lease retirements, stats, digests) queued before senders
    /// wait.
    pub mailbox_capacity: usize,
    /// Read by nothing. Recorded configurations are positional (MessagePack arrays), so the
    /// slot stays where pool actors once kept their block-weighted admission bound; a node's
    /// pending writes are bounded by its input queue's bytes instead.
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

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            mailbox_capacity: 256,
            pending_block_permits: 65_536,
            publication_threshold_events: PUBLICATION_THRESHOLD_EVENTS,
            publication_delay: Duration::from_millis(PUBLICATION_DELAY_MS),
            delta_broadcast_capacity: 64,
            exact_state_bytes_max: None,
        }
    }
}

/// Where a driver reports faults. Implementations must not block.
pub trait FaultSink: Send + Sync + Debug + 'static {
    /// Record one fault of an event batch or a reset the pool could not apply (the rank's
    /// tracker and the host's fault coalescing both hear of it).
    fn report(&self, fault: PoolFault);

    /// Record one rank a replacement left unreplaced (its state is unchanged; only the rank's
    /// tracker hears of it, and recovers the rank again).
    fn refused(&self, fault: PoolFault);
}

/// The pool generation is no longer driven (stopped, fenced, or its node ended).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("pool generation has stopped")]
pub struct PoolGone;

/// Why a subscription barrier failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SubscribeError {
    /// The generation has stopped.
    #[error(transparent)]
    Gone(#[from] PoolGone),
    /// The publisher refused (sequence exhausted, allocation, tail delivery).
    #[error(transparent)]
    Publish(#[from] PublishError),
}

/// A barrier snapshot together with the deltas that follow it.
#[derive(Debug)]
pub struct Subscription {
    /// The filter at the barrier, sequence `S`.
    pub snapshot: Snapshot,
    /// Deltas from `S → S + 1` on.
    pub deltas: broadcast::Receiver<Arc<Delta>>,
}

/// Events of one rank written under one fence: what one input's step asks of the pool.
pub type ApplySegment = (RankFence, Vec<RouterEvent>);

/// One pool generation: its pool and layout generation.
pub type GenerationKey = (PoolId, u64);

type SubscriptionReply = oneshot::Sender<Result<Subscription, SubscribeError>>;

/// What a [`PoolHandle`] asks of a pool generation.
#[derive(Debug)]
pub enum PoolAsk {
    /// A barrier snapshot under `lease` and the deltas after it.
    Subscribe {
        /// The lease to install.
        lease: LaneLease,
        /// Where the subscription goes.
        reply: SubscriptionReply,
    },
    /// Retire `lease` if it is still the current one.
    RetireLease {
        /// The lease.
        lease: LaneLease,
    },
    /// Publish pending changes now; answers the last published sequence.
    Flush {
        /// Where the answer goes.
        reply: oneshot::Sender<Result<u64, PublishError>>,
    },
    /// Current counters.
    Stats {
        /// Where the answer goes.
        reply: oneshot::Sender<PoolStats>,
    },
    /// The logical state in digest form.
    Digest {
        /// Where the answer goes.
        reply: oneshot::Sender<PoolDigest>,
    },
}

/// A request to one pool generation; whoever drives it (the node) answers it between steps. A
/// request for a generation that is not driven is dropped, which its sender sees as
/// [`PoolGone`].
#[derive(Debug)]
pub struct PoolRequest {
    /// The generation asked.
    pub key: GenerationKey,
    /// What is asked.
    pub ask: PoolAsk,
}

/// Where requests to pools go. Cloning shares the queue.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    key: GenerationKey,
    requests: mpsc::Sender<PoolRequest>,
}

impl PoolHandle {
    /// A handle for `key` whose requests go to `requests`.
    #[must_use]
    pub fn new(key: GenerationKey, requests: mpsc::Sender<PoolRequest>) -> Self {
        PoolHandle { key, requests }
    }

    /// The generation this handle asks.
    #[must_use]
    pub fn key(&self) -> GenerationKey {
        self.key
    }

    async fn ask<T>(&self, ask: impl FnOnce(oneshot::Sender<T>) -> PoolAsk) -> Result<T, PoolGone> {
        let (reply, answer) = oneshot::channel();
        self.send(ask(reply)).await?;
        answer.await.map_err(|_| PoolGone)
    }

    async fn send(&self, ask: PoolAsk) -> Result<(), PoolGone> {
        self.requests.send(PoolRequest { key: self.key, ask }).await.map_err(|_| PoolGone)
    }

    /// Take a barrier snapshot under `lease` and receive the deltas that follow it.
    pub async fn subscribe(&self, lease: LaneLease) -> Result<Subscription, SubscribeError> {
        self.ask(|reply| PoolAsk::Subscribe { lease, reply }).await?
    }

    /// Retire `lease` if it is still the current one.
    pub async fn retire_lease(&self, lease: LaneLease) -> Result<(), PoolGone> {
        self.send(PoolAsk::RetireLease { lease }).await
    }

    /// Publish pending changes now; returns the last published sequence.
    pub async fn flush(&self) -> Result<Result<u64, PublishError>, PoolGone> {
        self.ask(|reply| PoolAsk::Flush { reply }).await
    }

    /// Current counters.
    pub async fn stats(&self) -> Result<PoolStats, PoolGone> {
        self.ask(|reply| PoolAsk::Stats { reply }).await
    }

    /// The pool's logical state in digest form, after every write its driver was given before
    /// this request.
    pub async fn digest(&self) -> Result<PoolDigest, PoolGone> {
        self.ask(|reply| PoolAsk::Digest { reply }).await
    }
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

/// One pool generation's machine and the sinks of its effects.
///
/// Invariant: every id in `held` is a subscription the machine holds (the machine is told of
/// each reply that closes, [`PoolDriver::prune_held`]).
#[derive(Debug)]
pub struct PoolDriver {
    machine: PoolMachine,
    outlet: BroadcastOutlet,
    sink: Option<Arc<dyn PublicationSink>>,
    faults: Arc<dyn FaultSink>,
    /// Reply channels of the subscriptions the machine holds.
    held: BTreeMap<HoldId, SubscriptionReply>,
    /// Script mismatches already logged.
    mismatches: u64,
}

impl PoolDriver {
    /// A driver owning `pool`; its publisher starts at sequence 0 with no lease. Its machine's
    /// clock counts from `origin` (the caller passes the same origin to every call's `now`).
    pub fn new(
        mut pool: PoolOwnership,
        config: &PoolConfig,
        faults: Arc<dyn FaultSink>,
        mode: PublicationMode,
        origin: Instant,
    ) -> Self {
        if let Some(bytes_max) = config.exact_state_bytes_max
            && let Err(refused) = pool.set_exact_state_bytes_max(bytes_max)
        {
            tracing::warn!(%refused, "the pool keeps its exact-state byte budget");
        }
        let (deltas, _) = broadcast::channel(config.delta_broadcast_capacity.max(1));
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
        PoolDriver {
            machine: PoolMachine::new(pool, cadence, role),
            outlet: BroadcastOutlet(deltas),
            sink,
            faults,
            held: BTreeMap::new(),
            mismatches: 0,
        }
    }

    /// When [`PoolDriver::handle_timeout`] is next due, on the machine's clock.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.machine.poll_timeout()
    }

    /// Fire whatever of the machine's timers is due at `now`.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.machine.handle_timeout(now, &mut self.outlet);
        self.carry_out();
    }

    /// Apply event batches in order, each as its own machine input (so the cadence and the
    /// journal's script positions see what separate inputs would have shown them).
    pub fn apply(&mut self, segments: &[ApplySegment], now: Duration) {
        for (fence, events) in segments {
            self.machine.apply(*fence, events, now, &mut self.outlet);
        }
        self.carry_out();
    }

    /// Replace the dumps' ranks at once ([`PoolMachine::replace_ranks`]); each rank left
    /// unreplaced goes to the [`FaultSink::refused`].
    pub fn replace_ranks(&mut self, dumps: Vec<RankDump>) {
        for fault in self.machine.replace_ranks(dumps, &mut self.outlet) {
            self.faults.refused(fault);
        }
        self.carry_out();
    }

    /// Drop every block of one rank, under its new `fence`.
    pub fn reset_rank(&mut self, source: SourceKey, fence: RankFence) {
        self.machine.reset_rank(source, fence, &mut self.outlet);
        self.carry_out();
    }

    /// Answer one request.
    pub fn serve(&mut self, ask: PoolAsk) {
        match ask {
            PoolAsk::Subscribe { lease, reply } => {
                match self.machine.subscribe(lease, &mut self.outlet) {
                    SubscribeStep::Held(hold) => {
                        self.held.insert(hold, reply);
                    }
                    SubscribeStep::Barrier => self.barrier(lease, reply),
                }
            }
            PoolAsk::RetireLease { lease } => self.machine.retire_lease(lease),
            PoolAsk::Flush { reply } => {
                let _ = reply.send(self.machine.flush(&mut self.outlet));
            }
            PoolAsk::Stats { reply } => {
                let _ = reply.send(self.machine.stats());
            }
            PoolAsk::Digest { reply } => {
                let _ = reply.send(self.digest());
            }
        }
        self.carry_out();
        if !self.held.is_empty() {
            self.prune_held();
        }
    }

    /// The logical state in digest form (a deterministic input of the machine: a journal
    /// checkpoint).
    pub fn digest(&mut self) -> PoolDigest {
        let digest = self.machine.digest(&mut self.outlet);
        self.carry_out();
        digest
    }

    /// Current counters.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        self.machine.stats()
    }

    /// Graceful stop: publish the tail, retire the lease; the broadcast closes as the driver
    /// drops.
    pub fn shutdown(mut self) {
        self.machine.shutdown(&mut self.outlet);
        self.carry_out();
    }

    /// Every invariant of the machine (O(state)).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.machine.check_invariants()
    }

    /// The machine's O(1) invariants ([`PoolMachine::check_cadence`]).
    pub fn check_cadence(&self) -> Result<(), String> {
        self.machine.check_cadence()
    }

    /// A free subscription's barrier: the snapshot and a receiver subscribed before anything
    /// else can publish, so its first delta is exactly `S → S + 1`.
    fn barrier(&mut self, lease: LaneLease, reply: SubscriptionReply) {
        match self.machine.barrier(lease, &mut self.outlet) {
            Ok(snapshot) => {
                let subscription = Subscription { snapshot, deltas: self.outlet.0.subscribe() };
                if let Err(Ok(dropped)) = reply.send(Ok(subscription)) {
                    self.machine.retire_lease(dropped.snapshot.lease);
                }
            }
            Err(error) => {
                let _ = reply.send(Err(error.into()));
            }
        }
    }

    /// Carry out every queued effect of the machine; a released subscription takes its barrier
    /// here, after the effects queued before it.
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
                PoolEffect::Release { hold, lease } => {
                    if let Some(reply) = self.held.remove(&hold) {
                        self.barrier(lease, reply);
                    }
                }
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
