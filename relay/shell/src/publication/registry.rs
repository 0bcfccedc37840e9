//! The publication side of every active pool generation: lazy hub creation, initialized-hub
//! admission with idle eviction, retirement, and fence requests for the host.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::hub::Hub;
use super::stream::PoolStream;
use super::{HubConfig, PublicationError};
use crate::pool::{PoolHandle, PoolTotals};
use crate::runtime::BlockingExecutor;
use kvrelay_core::model::identity::{PoolId, ProducerIdentity};
use kvrelay_core::pool::{PoolDigest, PoolStats};

/// Generations whose publication failed and that the host must fence.
#[derive(Debug, Clone, Default)]
pub struct FenceRequests {
    pending: Arc<Mutex<BTreeSet<(PoolId, u64)>>>,
    notify: Arc<Notify>,
}

impl FenceRequests {
    /// Ask for `(pool, layout_generation)` to be fenced (idempotent).
    pub fn request(&self, pool_id: PoolId, layout_generation: u64) {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((pool_id, layout_generation));
        self.notify.notify_one();
    }

    /// Take every pending request, in order.
    pub fn take(&self) -> Vec<(PoolId, u64)> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
            .into_iter()
            .collect()
    }

    /// Wait until a request may be pending.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}

#[derive(Debug)]
enum HubSlot {
    Vacant,
    Ready { hub: Arc<Hub>, _permit: OwnedSemaphorePermit },
}

#[derive(Debug)]
struct PoolEntry {
    identity: ProducerIdentity,
    pool: PoolHandle,
    slot: tokio::sync::Mutex<HubSlot>,
    retired: CancellationToken,
}

/// Publication hubs by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubCounts {
    /// Pools whose hub a subscription is building or attaching to right now.
    pub requested: usize,
    /// Hubs holding a mirror (each holds one of the initialized-hub permits).
    pub initialized: usize,
    /// Running hubs that accept subscribers.
    pub ready: usize,
    /// Ready hubs with no open subscriber: the ones eviction may take.
    pub idle: usize,
}

/// Publication of every active pool generation.
#[derive(Debug)]
pub struct PoolPublications {
    config: HubConfig,
    executor: Arc<dyn BlockingExecutor>,
    hub_permits: Arc<Semaphore>,
    encode_permits: Arc<Semaphore>,
    pools: Mutex<BTreeMap<PoolId, Arc<PoolEntry>>>,
    fences: FenceRequests,
}

impl PoolPublications {
    /// No pool yet.
    #[must_use]
    pub fn new(config: HubConfig, executor: Arc<dyn BlockingExecutor>) -> Self {
        PoolPublications {
            hub_permits: Arc::new(Semaphore::new(config.initialized_hubs_max.max(1))),
            encode_permits: Arc::new(Semaphore::new(config.encoding_concurrency.max(1))),
            config,
            executor,
            pools: Mutex::new(BTreeMap::new()),
            fences: FenceRequests::default(),
        }
    }

    /// Where failed generations are reported.
    #[must_use]
    pub fn fence_requests(&self) -> &FenceRequests {
        &self.fences
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, BTreeMap<PoolId, Arc<PoolEntry>>> {
        self.pools.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Make a started generation subscribable. A previous generation of the same pool must have
    /// been retired first; if not, it is replaced and its hub stopped.
    pub fn activate(&self, identity: ProducerIdentity, pool: PoolHandle) {
        let entry = Arc::new(PoolEntry {
            identity,
            pool,
            slot: tokio::sync::Mutex::new(HubSlot::Vacant),
            retired: CancellationToken::new(),
        });
        if let Some(previous) = self.pools().insert(identity.pool_id(), entry) {
            previous.retired.cancel();
        }
    }

    /// Retire a generation: no new subscriber is admitted and the current ones end as
    /// unavailable. The hub retires its lease on the way out.
    pub async fn retire(&self, pool_id: PoolId, layout_generation: u64) {
        let entry = {
            let mut pools = self.pools();
            match pools.get(&pool_id) {
                Some(entry) if entry.identity.layout_generation() == layout_generation => {
                    pools.remove(&pool_id)
                }
                _ => None,
            }
        };
        let Some(entry) = entry else { return };
        entry.retired.cancel();
        let mut slot = entry.slot.lock().await;
        if let HubSlot::Ready { hub, .. } = std::mem::replace(&mut *slot, HubSlot::Vacant) {
            hub.stop(PublicationError::Unavailable);
        }
    }

    /// The current producer of a pool.
    #[must_use]
    pub fn producer(&self, pool_id: &PoolId) -> Option<ProducerIdentity> {
        self.pools().get(pool_id).map(|entry| entry.identity)
    }

    /// The current generation of a pool and its logical state in digest form (filter words and
    /// published sequence), after every write the node applied before; `None` when the pool
    /// has no generation or it has stopped.
    pub async fn digest(&self, pool_id: &PoolId) -> Option<(ProducerIdentity, PoolDigest)> {
        let (identity, pool) = {
            let pools = self.pools();
            let entry = pools.get(pool_id)?;
            (entry.identity, entry.pool.clone())
        };
        pool.digest().await.ok().map(|digest| (identity, digest))
    }

    /// The current generation of a pool and its counters, after every write the node
    /// applied before; `None` when the pool has no generation or it has stopped.
    pub async fn stats(&self, pool_id: &PoolId) -> Option<(ProducerIdentity, PoolStats)> {
        let (identity, pool) = {
            let pools = self.pools();
            let entry = pools.get(pool_id)?;
            (entry.identity, entry.pool.clone())
        };
        pool.stats().await.ok().map(|stats| (identity, stats))
    }

    /// Number of hubs holding a mirror.
    #[must_use]
    pub fn initialized_hubs(&self) -> usize {
        self.config.initialized_hubs_max.max(1) - self.hub_permits.available_permits()
    }

    /// Publication hubs by state (`kv_dc_relay_*_publication_hub_count`). A slot being
    /// worked on by a subscription (building its hub or attaching to it) counts as requested.
    #[must_use]
    pub fn hub_counts(&self) -> HubCounts {
        let entries: Vec<Arc<PoolEntry>> = self.pools().values().cloned().collect();
        let mut counts = HubCounts { initialized: self.initialized_hubs(), ..HubCounts::default() };
        for entry in entries {
            let Ok(slot) = entry.slot.try_lock() else {
                counts.requested += 1;
                continue;
            };
            if let HubSlot::Ready { hub, .. } = &*slot
                && !hub.is_stopped()
            {
                counts.ready += 1;
                if hub.is_idle() {
                    counts.idle += 1;
                }
            }
        }
        counts
    }

    /// Ownership totals over the active pool generations; a pool that has stopped is skipped.
    pub async fn pool_totals(&self) -> PoolTotals {
        let handles: Vec<PoolHandle> =
            self.pools().values().map(|entry| entry.pool.clone()).collect();
        let mut totals = PoolTotals::default();
        for pool in handles {
            if let Ok(stats) = pool.stats().await {
                totals.add(&stats);
            }
        }
        totals
    }

    /// Subscribe to exactly `expected`: its snapshot, then its deltas.
    pub async fn subscribe(
        &self,
        expected: &ProducerIdentity,
    ) -> Result<PoolStream, PublicationError> {
        let pool_id = expected.pool_id();
        let entry = self.pools().get(&pool_id).cloned().ok_or(PublicationError::NotFound)?;
        if entry.identity != *expected {
            return Err(PublicationError::ProducerChanged);
        }
        let mut slot = tokio::select! {
            biased;
            () = entry.retired.cancelled() => return Err(PublicationError::Unavailable),
            slot = entry.slot.lock() => slot,
        };
        if let HubSlot::Ready { hub, .. } = &*slot
            && !hub.is_stopped()
        {
            return PoolStream::open(
                Arc::clone(hub),
                Arc::clone(&self.executor),
                Arc::clone(&self.encode_permits),
            );
        }
        *slot = HubSlot::Vacant;
        let permit = self.acquire_hub_permit(&pool_id)?;
        let lease = entry.identity.publication_lease();
        let subscription = tokio::select! {
            biased;
            () = entry.retired.cancelled() => return Err(PublicationError::Unavailable),
            subscription = entry.pool.subscribe(lease) => subscription,
        }
        .map_err(|_| PublicationError::Unavailable)?;
        let fences = self.fences.clone();
        let generation = entry.identity.layout_generation();
        let on_failure: Arc<dyn Fn() + Send + Sync> =
            Arc::new(move || fences.request(pool_id, generation));
        let hub = match Hub::start(
            entry.identity,
            self.config,
            subscription,
            entry.pool.clone(),
            on_failure,
        ) {
            Ok(hub) => hub,
            Err(error) => {
                self.fences.request(pool_id, generation);
                return Err(error);
            }
        };
        *slot = HubSlot::Ready { hub: Arc::clone(&hub), _permit: permit };
        drop(slot);
        if entry.retired.is_cancelled() {
            hub.stop(PublicationError::Unavailable);
            return Err(PublicationError::Unavailable);
        }
        PoolStream::open(hub, Arc::clone(&self.executor), Arc::clone(&self.encode_permits))
    }

    /// A permit for a new hub, evicting an idle hub of another pool when none is free.
    fn acquire_hub_permit(
        &self,
        requester: &PoolId,
    ) -> Result<OwnedSemaphorePermit, PublicationError> {
        if let Ok(permit) = Arc::clone(&self.hub_permits).try_acquire_owned() {
            return Ok(permit);
        }
        let candidates: Vec<Arc<PoolEntry>> = self
            .pools()
            .iter()
            .filter(|(pool_id, _)| *pool_id != requester)
            .map(|(_, entry)| Arc::clone(entry))
            .collect();
        for candidate in candidates {
            // A slot that is locked is admitting or retiring: not idle.
            let Ok(mut slot) = candidate.slot.try_lock() else { continue };
            let idle = matches!(&*slot, HubSlot::Ready { hub, .. } if hub.is_idle());
            if !idle {
                continue;
            }
            if let HubSlot::Ready { hub, .. } = std::mem::replace(&mut *slot, HubSlot::Vacant) {
                hub.stop(PublicationError::Unavailable);
            }
            drop(slot);
            if let Ok(permit) = Arc::clone(&self.hub_permits).try_acquire_owned() {
                return Ok(permit);
            }
        }
        Err(PublicationError::InitializedHubLimit)
    }
}
