//! What the shell keeps of a pool generation beside its machine: the handle requests reach it
//! through, the broadcast its deltas go to, and the [`PoolLink`] that pairs held subscriptions
//! with their reply channels and hands publication points to the journal. The machine itself
//! (ownership, publisher, cadence, publication points) is in `kvrelay_core::pool`; the node's
//! machines live in its `kvrelay_core::relay::Relay`, a standalone pool's in its own task.
//!
//! Bounds and behaviour at the bound:
//! - requests queue in one channel of [`PoolConfig::mailbox_capacity`] per node; senders wait;
//! - deltas go to a broadcast of [`PoolConfig::delta_broadcast_capacity`]; a receiver that falls
//!   further behind sees `Lagged` and must take a new barrier snapshot;
//! - the pool's exact ownership state allocates at most [`PoolConfig::exact_state_bytes_max`]
//!   (by default derived from the pool's filter); a write that would pass it is refused by the
//!   core and reported as a resource failure of its rank.
//!
//! The link decides nothing: it pairs held subscriptions with their reply channels, takes
//! barrier snapshots when the machine asks for one (a copy of the filter's words; encoding them
//! runs in the hub, off the loop that drives the machine), and hands publication points to
//! their sink. Dropping a generation's outlet closes its broadcast; dropping its link ends its
//! held subscriptions ([`PoolGone`]).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use super::mode::{PublicationMode, PublicationSink};
use kvrelay_core::model::identity::LaneLease;
use kvrelay_core::pool::{
    CadenceConfig, Delta, DeltaOutlet, HoldId, PUBLICATION_DELAY_MS, PUBLICATION_THRESHOLD_EVENTS,
    PoolDigest, PoolEffect, PoolMachine, PoolOwnership, PoolStats, PublicationPoint,
    PublicationRole, PublicationScript, PublishError, Snapshot, SubscribeStep,
};

/// Bounds and cadence of every pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolConfig {
    /// Pool requests (subscriptions, lease retirements, stats, digests) queued before senders
    /// wait.
    pub mailbox_capacity: usize,
    /// Read by nothing. Recorded configurations are positional (MessagePack arrays), so the
    /// slot stays where pool machines once kept their block-weighted admission bound; a node's
    /// pending writes are bounded by its input queue's bytes instead.
    pub pending_block_permits: u32,
    /// Applied events that force a publication.
    pub publication_threshold_events: u32,
    /// Delay after the first pending event before publishing.
    pub publication_delay: Duration,
    /// Deltas buffered for the publication hub.
    pub delta_broadcast_capacity: usize,
    /// Most bytes the exact ownership state of one pool may allocate; `None` derives it from
    /// the pool's filter ([`kvrelay_core::pool::exact_state_bytes_max_default`]: 288 bytes per
    /// slot, at least 64 MiB). Last, with a default, so configurations recorded before it
    /// existed still decode (to `None`).
    #[serde(default)]
    pub exact_state_bytes_max: Option<usize>,
    /// Wait for publication deadlines on a real-time timer to the nanosecond
    /// ([`crate::runtime::TimerKind::Precise`]), so the delay ends when it is due rather than on
    /// the next whole millisecond after it; used only where the node's clock follows real time.
    /// It honours the configured delay exactly, so a pool publishes more often than on tokio's
    /// timer (which stretches a 1 ms delay to 1–2 ms). Last, with a default (`false`), so
    /// configurations recorded before it existed still decode.
    #[serde(default)]
    pub precise_timer: bool,
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
            precise_timer: false,
        }
    }
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

pub use kvrelay_core::relay::{ApplySegment, GenerationKey};

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

    /// The pool's logical state in digest form, after every write its pool was given before
    /// this request.
    pub async fn digest(&self) -> Result<PoolDigest, PoolGone> {
        self.ask(|reply| PoolAsk::Digest { reply }).await
    }
}

/// The broadcast a generation's hub streams receive deltas from: the machine's outlet.
#[derive(Debug)]
pub struct BroadcastOutlet(broadcast::Sender<Arc<Delta>>);

impl BroadcastOutlet {
    /// A broadcast buffering `capacity` deltas (at least one).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        BroadcastOutlet(broadcast::channel(capacity.max(1)).0)
    }

    fn subscribe(&self) -> broadcast::Receiver<Arc<Delta>> {
        self.0.subscribe()
    }
}

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

/// A machine for `pool` under `config`, publishing as `mode` says, and the link that carries
/// its subscriptions and points out. The machine's clock counts from `origin`.
pub fn pool_machine(
    mut pool: PoolOwnership,
    config: &PoolConfig,
    mode: PublicationMode,
    origin: Instant,
) -> (PoolMachine, PoolLink) {
    if let Some(bytes_max) = config.exact_state_bytes_max
        && let Err(refused) = pool.set_exact_state_bytes_max(bytes_max)
    {
        tracing::warn!(%refused, "the pool keeps its exact-state byte budget");
    }
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
    let link = PoolLink { sink, held: BTreeMap::new(), mismatches: 0 };
    (PoolMachine::new(pool, cadence, role), link)
}

/// The reply side of one pool generation (see the module doc).
///
/// Invariant: every id in `held` is a subscription the machine holds (the machine is told of
/// each reply that closes, [`PoolLink::settle`]).
#[derive(Debug)]
pub struct PoolLink {
    sink: Option<Arc<dyn PublicationSink>>,
    /// Reply channels of the subscriptions the machine holds.
    held: BTreeMap<HoldId, SubscriptionReply>,
    /// Script mismatches already logged.
    mismatches: u64,
}

impl PoolLink {
    /// Answer one request with the generation's machine and outlet. What the machine queues
    /// meanwhile is left for the caller to drain.
    pub fn serve(&mut self, ask: PoolAsk, machine: &mut PoolMachine, outlet: &mut BroadcastOutlet) {
        match ask {
            PoolAsk::Subscribe { lease, reply } => match machine.subscribe(lease, outlet) {
                SubscribeStep::Held(hold) => {
                    self.held.insert(hold, reply);
                }
                SubscribeStep::Barrier => barrier(machine, outlet, lease, reply),
            },
            PoolAsk::RetireLease { lease } => machine.retire_lease(lease),
            PoolAsk::Flush { reply } => {
                let _ = reply.send(machine.flush(outlet));
            }
            PoolAsk::Stats { reply } => {
                let _ = reply.send(machine.stats());
            }
            PoolAsk::Digest { reply } => {
                let _ = reply.send(machine.digest(outlet));
            }
        }
    }

    /// Record a publication point (reporting machines only).
    pub fn point(&self, point: PublicationPoint) {
        if let Some(sink) = &self.sink {
            sink.point(point);
        }
    }

    /// Carry out one effect of the machine other than a fault (faults go to whoever composes
    /// the machine with the control plane). A released subscription takes its barrier here,
    /// after the effects queued before it.
    pub fn carry(
        &mut self,
        effect: PoolEffect,
        machine: &mut PoolMachine,
        outlet: &mut BroadcastOutlet,
    ) {
        match effect {
            PoolEffect::Fault(fault) => {
                debug_assert!(false, "a pool fault reached the link: {fault:?}");
            }
            PoolEffect::Point(point) => self.point(point),
            PoolEffect::Answer { hold, snapshot } => {
                if let Some(reply) = self.held.remove(&hold) {
                    let _ = reply.send(Ok(Subscription { snapshot, deltas: outlet.subscribe() }));
                }
            }
            PoolEffect::Release { hold, lease } => {
                if let Some(reply) = self.held.remove(&hold) {
                    barrier(machine, outlet, lease, reply);
                }
            }
        }
    }

    /// After a step: log new script mismatches, and tell the machine about held subscriptions
    /// whose subscriber went away.
    pub fn settle(&mut self, machine: &mut PoolMachine) {
        let mismatches = machine.script_mismatches();
        if mismatches > self.mismatches {
            self.mismatches = mismatches;
            tracing::debug!(mismatches, "scripted publication point left the recorded sequence");
        }
        if !self.held.is_empty() {
            self.held.retain(|hold, reply| {
                let live = !reply.is_closed();
                if !live {
                    machine.forget_hold(*hold);
                }
                live
            });
        }
    }

    /// Every invariant of the link (held replies are holds of a scripted machine).
    pub fn check_invariants(&self, machine: &PoolMachine) -> Result<(), String> {
        if !self.held.is_empty() && !machine.is_scripted() {
            return Err(format!("{} subscriptions held by a free machine", self.held.len()));
        }
        Ok(())
    }
}

/// A free subscription's barrier: the snapshot and a receiver subscribed before anything else
/// can publish, so its first delta is exactly `S → S + 1`.
fn barrier(
    machine: &mut PoolMachine,
    outlet: &mut BroadcastOutlet,
    lease: LaneLease,
    reply: SubscriptionReply,
) {
    match machine.barrier(lease, outlet) {
        Ok(snapshot) => {
            let subscription = Subscription { snapshot, deltas: outlet.subscribe() };
            if let Err(Ok(dropped)) = reply.send(Ok(subscription)) {
                machine.retire_lease(dropped.snapshot.lease);
            }
        }
        Err(error) => {
            let _ = reply.send(Err(error.into()));
        }
    }
}
