//! One pool driven by a task of its own, for tests and benches that exercise a pool and its
//! publication without a node. Its machine and [`PoolLink`] are the ones a node runs; only the
//! loop around them differs (a node's pools live in its `kvrelay_core::relay::Relay`, whose
//! faults go straight to the control plane; a standalone pool's go to a [`FaultSink`]).
//!
//! A write returns once it is applied, and requests go before writes, so one caller's writes
//! and requests take effect in the order it made them.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::{
    ApplySegment, BroadcastOutlet, GenerationKey, PoolAsk, PoolConfig, PoolGone, PoolHandle,
    PoolLink, PoolRequest, pool_machine,
};
use super::mode::PublicationMode;
use kvrelay_core::model::kv_events::{RouterEvent, SourceKey};
use kvrelay_core::pool::{PoolEffect, PoolFault, PoolMachine, PoolOwnership};
use kvrelay_core::sources::{RankDump, RankFence};

/// Where a standalone pool reports faults. Implementations must not block.
pub trait FaultSink: Send + Sync + Debug + 'static {
    /// Record one fault of an event batch or a reset the pool could not apply (the rank's
    /// tracker and the host's fault coalescing both hear of it).
    fn report(&self, fault: PoolFault);

    /// Record one rank a replacement left unreplaced (its state is unchanged; only the rank's
    /// tracker hears of it, and recovers the rank again).
    fn refused(&self, fault: PoolFault);
}

/// One pool's machine, outlet and link, with its faults going to a [`FaultSink`].
#[derive(Debug)]
struct Driver {
    machine: PoolMachine,
    outlet: BroadcastOutlet,
    link: PoolLink,
    faults: Arc<dyn FaultSink>,
}

impl Driver {
    fn handle_timeout(&mut self, now: Duration) {
        self.machine.handle_timeout(now, &mut self.outlet);
        self.carry_out();
    }

    fn apply(&mut self, segments: &[ApplySegment], now: Duration) {
        for (fence, events) in segments {
            self.machine.apply(*fence, events, now, &mut self.outlet);
        }
        self.carry_out();
    }

    fn replace_ranks(&mut self, dumps: Vec<RankDump>) {
        for fault in self.machine.replace_ranks(dumps, &mut self.outlet) {
            self.faults.refused(fault);
        }
        self.carry_out();
    }

    fn reset_rank(&mut self, source: SourceKey, fence: RankFence) {
        self.machine.reset_rank(source, fence, &mut self.outlet);
        self.carry_out();
    }

    fn serve(&mut self, ask: PoolAsk) {
        self.link.serve(ask, &mut self.machine, &mut self.outlet);
        self.carry_out();
    }

    fn shutdown(mut self) {
        self.machine.shutdown(&mut self.outlet);
        self.carry_out();
    }

    fn carry_out(&mut self) {
        while let Some(effect) = self.machine.poll_effect() {
            match effect {
                PoolEffect::Fault(fault) => self.faults.report(fault),
                effect => self.link.carry(effect, &mut self.machine, &mut self.outlet),
            }
        }
        self.link.settle(&mut self.machine);
        debug_assert_eq!(self.link.check_invariants(&self.machine), Ok(()));
    }
}

enum Write {
    Apply(Vec<ApplySegment>),
    ReplaceRanks(Vec<RankDump>),
    ResetRank { source: SourceKey, fence: RankFence },
    Shutdown,
}

/// How a standalone pool's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandaloneExit {
    /// Graceful shutdown published the tail and retired the lease.
    Graceful,
    /// Fenced: the unpublished tail was discarded.
    Fenced,
    /// Every handle was dropped.
    Abandoned,
}

/// A handle to a standalone pool. Cloning shares the same pool.
#[derive(Debug, Clone)]
pub struct StandalonePool {
    handle: PoolHandle,
    writes: mpsc::Sender<(Write, oneshot::Sender<()>)>,
    fence: CancellationToken,
}

/// Start a task driving `pool` (publisher at sequence 0, no lease); `key` names it in requests.
pub fn spawn_standalone_pool(
    key: GenerationKey,
    pool: PoolOwnership,
    config: PoolConfig,
    faults: Arc<dyn FaultSink>,
    mode: PublicationMode,
) -> (StandalonePool, JoinHandle<StandaloneExit>) {
    let capacity = config.mailbox_capacity.max(1);
    let (writes, writes_rx) = mpsc::channel::<(Write, oneshot::Sender<()>)>(capacity);
    let (requests, requests_rx) = mpsc::channel(capacity);
    let origin = Instant::now();
    let (machine, link) = pool_machine(pool, &config, mode, origin);
    let outlet = BroadcastOutlet::new(config.delta_broadcast_capacity);
    let driver = Driver { machine, outlet, link, faults };
    let fence = CancellationToken::new();
    let task = crate::runtime::spawn(run(driver, origin, writes_rx, requests_rx, fence.clone()));
    (StandalonePool { handle: PoolHandle::new(key, requests), writes, fence }, task)
}

async fn run(
    mut driver: Driver,
    origin: Instant,
    mut writes: mpsc::Receiver<(Write, oneshot::Sender<()>)>,
    mut requests: mpsc::Receiver<PoolRequest>,
    fence: CancellationToken,
) -> StandaloneExit {
    let now = || Instant::now().saturating_duration_since(origin);
    // Every `StandalonePool` also holds a request sender, so the requests close last: the task
    // lives while any handle (a hub's included) does.
    let mut writes_open = true;
    loop {
        let timeout = driver.machine.poll_timeout().map(|at| origin + at);
        tokio::select! {
            biased;
            () = fence.cancelled() => return StandaloneExit::Fenced,
            () = sleep_until(timeout), if timeout.is_some() => driver.handle_timeout(now()),
            request = requests.recv() => match request {
                Some(request) => driver.serve(request.ask),
                None => {
                    driver.shutdown();
                    return StandaloneExit::Abandoned;
                }
            },
            write = writes.recv(), if writes_open => match write {
                Some((write, done)) => {
                    match write {
                        Write::Apply(segments) => driver.apply(&segments, now()),
                        Write::ReplaceRanks(dumps) => driver.replace_ranks(dumps),
                        Write::ResetRank { source, fence } => driver.reset_rank(source, fence),
                        Write::Shutdown => {
                            driver.shutdown();
                            let _ = done.send(());
                            return StandaloneExit::Graceful;
                        }
                    }
                    let _ = done.send(());
                }
                None => writes_open = false,
            },
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl StandalonePool {
    /// Where requests to this pool go (a hub's handle).
    #[must_use]
    pub fn handle(&self) -> &PoolHandle {
        &self.handle
    }

    async fn write(&self, write: Write) -> Result<(), PoolGone> {
        let (done, applied) = oneshot::channel();
        self.writes.send((write, done)).await.map_err(|_| PoolGone)?;
        applied.await.map_err(|_| PoolGone)
    }

    /// Apply a batch of events from one publisher, written under `fence`.
    pub async fn apply(&self, fence: RankFence, events: Vec<RouterEvent>) -> Result<(), PoolGone> {
        self.write(Write::Apply(vec![(fence, events)])).await
    }

    /// Replace the dumps' ranks at once; each rank left unreplaced goes to the
    /// [`FaultSink::refused`].
    pub async fn replace_ranks(&self, dumps: Vec<RankDump>) -> Result<(), PoolGone> {
        self.write(Write::ReplaceRanks(dumps)).await
    }

    /// Drop every block of one rank, under its new `fence`.
    pub async fn reset_rank(&self, source: SourceKey, fence: RankFence) -> Result<(), PoolGone> {
        self.write(Write::ResetRank { source, fence }).await
    }

    /// Graceful stop: publish the tail, retire the lease, end the task.
    pub async fn shutdown(&self) -> Result<(), PoolGone> {
        self.write(Write::Shutdown).await
    }

    /// Fence: stop at once and discard the unpublished tail.
    pub fn fence(&self) {
        self.fence.cancel();
    }
}

impl std::ops::Deref for StandalonePool {
    type Target = PoolHandle;

    fn deref(&self) -> &PoolHandle {
        &self.handle
    }
}

#[cfg(test)]
#[path = "standalone_tests.rs"]
mod tests;
