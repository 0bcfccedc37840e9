//! The endpoint host: which serving endpoints publish a pool, under which producer generation,
//! and the catalog consumers watch (relay-facts §2.5, §3.3, §3.6, §8.5, §9.5, §9.6).
//!
//! Discovery says what each endpoint serves; KV source membership says whether it publishes KV
//! events. This module decides, per endpoint, whether a pool exists, and keeps the catalog
//! honest about it. It is sans-IO: values in, [`HostCommand`]s out; the async shell starts and
//! stops pool machines, calls the recovery client and streams the catalog.
//!
//! - [`Catalog`]: the active [`PoolDescriptor`]s under a revision counter (0 when empty, +1 per
//!   change), one pool per endpoint and one endpoint per pool;
//! - [`PoolRegistry`]: pool reservations, the registry-wide layout generation counter (from 1)
//!   and the catalog, enforcing attach → publish → withdraw → release;
//! - [`EndpointHost`]: one slot per endpoint with its [`SlotLifecycle`] and slot incarnation;
//!   materializes a pool behind the `desired_binding` gate, refreshes metadata in place,
//!   retires withdraw-first, retries failed starts and fenced generations with backoff;
//! - [`PendingPoolFaults`]: per-endpoint coalescing of pool faults into at most 16 source
//!   faults or one producer-fence trigger.
//!
//! The invariants are stated on each type; the ones that matter most to consumers are that no
//! endpoint without an active KV source is ever in the catalog, that a generation is withdrawn
//! before its pool stops, and that a producer identity is never reused or given new serving
//! bindings.

mod catalog;
mod faults;
mod pools;
mod slots;

#[cfg(test)]
mod tests;

pub use catalog::{Catalog, CatalogChange, CatalogError, CatalogSnapshot, PoolDescriptor};
pub use faults::{
    FaultAdmission, PENDING_SOURCE_FAULTS_MAX, PendingPoolFaults, PoolFaultAction, PoolFaultReport,
    ProducerFenceCause, SourceFault, SourceFaultAction,
};
pub use pools::{HeldPool, PoolRegistry, RegistryError};
pub use slots::{
    EndpointHost, HostCommand, HostConfig, HostHealth, POOL_FILTER_BYTES_MAX_DEFAULT,
    RETRY_BACKOFF_MAX, RETRY_BACKOFF_MIN, RetireReason, SlotFence, SlotLifecycle, SlotStatus,
    SourceBinding, StopMode, TargetDisposition, retry_backoff,
};
