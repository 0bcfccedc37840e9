//! The node's pool generations: one [`PoolDriver`] each, driven from the node's loop.
//!
//! Invariants:
//! - a generation is driven from the moment its start commits until the control plane stops
//!   or releases it; a request or write for any other generation is dropped (a request's sender
//!   sees [`crate::pool::PoolGone`]);
//! - every driver's clock counts from the node's origin, so one `now` serves them all and the
//!   node's timer is the earliest of theirs and the control plane's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::pool::{
    ApplySegment, FaultSink, GenerationKey, PoolConfig, PoolDriver, PoolHandle, PoolRequest,
    PublicationMode,
};
use kvrelay_core::host::StopMode;
use kvrelay_core::model::kv_events::SourceKey;
use kvrelay_core::pool::{PoolDigest, PoolOwnership};
use kvrelay_core::sources::{RankDump, RankFence};

/// The largest pool (in owned blocks) whose ownership tables [`NodePools::check_invariants`]
/// walks.
pub const AUDIT_FULL_BLOCKS_MAX: usize = 4096;

/// Every pool generation the node drives.
#[derive(Debug)]
pub struct NodePools {
    drivers: BTreeMap<GenerationKey, PoolDriver>,
    config: PoolConfig,
    origin: Instant,
    requests: mpsc::Sender<PoolRequest>,
}

impl NodePools {
    /// No pool yet; requests to the pools arrive on the returned receiver.
    pub fn new(config: PoolConfig, origin: Instant) -> (Self, mpsc::Receiver<PoolRequest>) {
        let (requests, receiver) = mpsc::channel(config.mailbox_capacity.max(1));
        (NodePools { drivers: BTreeMap::new(), config, origin, requests }, receiver)
    }

    /// Drive a started generation; returns the handle its publication asks it through. A
    /// generation already driven under `key` is replaced (dropped: fenced).
    pub fn start(
        &mut self,
        key: GenerationKey,
        pool: PoolOwnership,
        faults: Arc<dyn FaultSink>,
        mode: PublicationMode,
    ) -> PoolHandle {
        let driver = PoolDriver::new(pool, &self.config, faults, mode, self.origin);
        let replaced = self.drivers.insert(key, driver);
        debug_assert!(replaced.is_none(), "a generation starts once");
        PoolHandle::new(key, self.requests.clone())
    }

    /// Stop a generation: gracefully (publish the tail, retire the lease) or by fencing it
    /// (the unpublished tail is discarded).
    pub fn stop(&mut self, key: &GenerationKey, mode: StopMode) {
        if let Some(driver) = self.drivers.remove(key) {
            match mode {
                StopMode::Graceful => driver.shutdown(),
                StopMode::Fence => drop(driver),
            }
        }
    }

    /// Forget a generation without publishing anything more.
    pub fn release(&mut self, key: &GenerationKey) {
        self.drivers.remove(key);
    }

    /// Stop every generation gracefully.
    pub fn shutdown_all(&mut self) {
        for (_, driver) in std::mem::take(&mut self.drivers) {
            driver.shutdown();
        }
    }

    /// Apply one generation's held writes, in order.
    pub fn apply(&mut self, key: &GenerationKey, segments: &[ApplySegment], now: Duration) {
        if let Some(driver) = self.drivers.get_mut(key) {
            driver.apply(segments, now);
        }
    }

    /// Replace ranks of one generation.
    pub fn replace_ranks(&mut self, key: &GenerationKey, dumps: Vec<RankDump>) {
        if let Some(driver) = self.drivers.get_mut(key) {
            driver.replace_ranks(dumps);
        }
    }

    /// Reset one rank of one generation.
    pub fn reset_rank(&mut self, key: &GenerationKey, source: SourceKey, fence: RankFence) {
        if let Some(driver) = self.drivers.get_mut(key) {
            driver.reset_rank(source, fence);
        }
    }

    /// Answer a request; one for a generation not driven is dropped.
    pub fn serve(&mut self, request: PoolRequest) {
        if let Some(driver) = self.drivers.get_mut(&request.key) {
            driver.serve(request.ask);
        }
    }

    /// The earliest of the drivers' timers, on the node's clock.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.drivers.values().filter_map(PoolDriver::poll_timeout).min()
    }

    /// Fire every driver timer due at `now`, in generation order.
    pub fn handle_timeout(&mut self, now: Duration) {
        for driver in self.drivers.values_mut() {
            if driver.poll_timeout().is_some_and(|at| at <= now) {
                driver.handle_timeout(now);
            }
        }
    }

    /// Every generation's logical state in digest form, in generation order (a journal
    /// checkpoint: a deterministic input of each machine).
    pub fn digests(&mut self) -> Vec<(GenerationKey, PoolDigest)> {
        self.drivers.iter_mut().map(|(key, driver)| (*key, driver.digest())).collect()
    }

    /// Every driver's invariants: all of them for a pool owning at most
    /// [`AUDIT_FULL_BLOCKS_MAX`] blocks, the O(1) ones for a larger pool (walking its tables after
    /// every wake-up would make a debug build's node too slow to keep up with its inputs). The
    /// first violation, named by its generation.
    pub fn check_invariants(&self) -> Result<(), String> {
        for ((pool_id, generation), driver) in &self.drivers {
            let checked = if driver.stats().owned_blocks <= AUDIT_FULL_BLOCKS_MAX {
                driver.check_invariants()
            } else {
                driver.check_cadence()
            };
            checked.map_err(|error| format!("pool {pool_id} generation {generation}: {error}"))?;
        }
        Ok(())
    }
}
