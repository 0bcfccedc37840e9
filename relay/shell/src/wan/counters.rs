//! Counters of the WAN service (relay-facts §13): lagged subscribers, refused admissions,
//! heartbeats, load updates and terminal publication failures. Monotonic; read as a
//! [`WanStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

/// The four stream types, in the order every per-stream array uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamType {
    /// `WatchKvPoolCatalog`.
    Catalog = 0,
    /// `SubscribeKvPool`.
    Pool = 1,
    /// `SubscribeServingReadiness`.
    Readiness = 2,
    /// `SubscribeKvPoolLoad`.
    Load = 3,
}

impl StreamType {
    /// Every stream type, in array order.
    pub const ALL: [StreamType; 4] =
        [StreamType::Catalog, StreamType::Pool, StreamType::Readiness, StreamType::Load];

    /// The `stream` label value.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            StreamType::Catalog => "catalog",
            StreamType::Pool => "pool",
            StreamType::Readiness => "readiness",
            StreamType::Load => "load",
        }
    }
}

/// Which admission limit refused a stream (the `scope` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitScope {
    /// The per-stream-type total.
    Total = 0,
    /// Subscribers of one pool.
    PerPool = 1,
    /// Initialized publication hubs (no idle hub could be evicted).
    InitializedHub = 2,
}

impl LimitScope {
    /// Every scope, in array order.
    pub const ALL: [LimitScope; 3] =
        [LimitScope::Total, LimitScope::PerPool, LimitScope::InitializedHub];

    /// The `scope` label value.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            LimitScope::Total => "total",
            LimitScope::PerPool => "per_pool",
            LimitScope::InitializedHub => "initialized_hub",
        }
    }
}

/// A point-in-time reading of the WAN counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WanStats {
    /// Streams ended as SUBSCRIBER_LAGGED, by [`StreamType`].
    pub subscriber_lagged: [u64; 4],
    /// Streams refused as RESOURCE_LIMIT, by [`StreamType`] then [`LimitScope`].
    pub subscriber_limit_rejected: [[u64; 3]; 4],
    /// Pool heartbeats sent.
    pub pool_heartbeats: u64,
    /// Load windows sent to subscribers.
    pub load_updates: u64,
    /// Pool streams ended by a terminal publication failure (fence, invalid publication,
    /// snapshot progress timeout, internal error); lag and shutdown are not failures.
    pub terminal_publication_failures: u64,
}

/// The live counters behind [`WanStats`].
#[derive(Debug, Default)]
pub(crate) struct WanCounters {
    lagged: [AtomicU64; 4],
    limit_rejected: [[AtomicU64; 3]; 4],
    pool_heartbeats: AtomicU64,
    load_updates: AtomicU64,
    terminal_publication_failures: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl WanCounters {
    pub(crate) fn lagged(&self, stream: StreamType) {
        bump(&self.lagged[stream as usize]);
    }

    pub(crate) fn limit_rejected(&self, stream: StreamType, scope: LimitScope) {
        bump(&self.limit_rejected[stream as usize][scope as usize]);
    }

    pub(crate) fn pool_heartbeat(&self) {
        bump(&self.pool_heartbeats);
    }

    pub(crate) fn load_update(&self) {
        bump(&self.load_updates);
    }

    pub(crate) fn terminal_publication_failure(&self) {
        bump(&self.terminal_publication_failures);
    }

    pub(crate) fn snapshot(&self) -> WanStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        WanStats {
            subscriber_lagged: self.lagged.each_ref().map(read),
            subscriber_limit_rejected: self
                .limit_rejected
                .each_ref()
                .map(|scopes| scopes.each_ref().map(read)),
            pool_heartbeats: read(&self.pool_heartbeats),
            load_updates: read(&self.load_updates),
            terminal_publication_failures: read(&self.terminal_publication_failures),
        }
    }
}
