//! One pool driven by a task of its own, for tests and benches that exercise a pool and its
//! publication without a node. It runs the same [`PoolDriver`] the node runs; only the loop
//! around it differs (a node drives every pool from its single loop).
//!
//! A write returns once it is applied, and requests go before writes, so one caller's writes
//! and requests take effect in the order it made them.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::driver::{
    ApplySegment, FaultSink, GenerationKey, PoolConfig, PoolDriver, PoolGone, PoolHandle,
    PoolRequest,
};
use super::mode::PublicationMode;
use kvrelay_core::model::kv_events::{RouterEvent, SourceKey};
use kvrelay_core::pool::PoolOwnership;
use kvrelay_core::sources::{RankDump, RankFence};

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
    let driver = PoolDriver::new(pool, &config, faults, mode, origin);
    let fence = CancellationToken::new();
    let task = crate::runtime::spawn(run(driver, origin, writes_rx, requests_rx, fence.clone()));
    (StandalonePool { handle: PoolHandle::new(key, requests), writes, fence }, task)
}

async fn run(
    mut driver: PoolDriver,
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
        let timeout = driver.poll_timeout().map(|at| origin + at);
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
