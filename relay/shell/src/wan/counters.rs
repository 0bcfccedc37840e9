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
    /// Streams ended because the client did not take a frame within the send deadline, by
    /// [`StreamType`] (also counted as lagged or as a snapshot progress timeout).
    pub slow_consumer_ended: [u64; 4],
    /// Connections closed because a slow consumer's final status could not be delivered.
    pub slow_consumer_connections_closed: u64,
    /// Listener-level counters.
    pub listener: ListenerStats,
}

/// Counters and gauges of the connection layer and the health/reflection admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerStats {
    /// Connections open now.
    pub connections_open: u64,
    /// Connections accepted and closed at once because the connection limit was reached.
    pub connections_refused: u64,
    /// Failed `accept` calls (each followed by the back-off).
    pub accept_errors: u64,
    /// Connections closed for not sending the HTTP/2 preface within the handshake timeout.
    pub handshake_timeouts: u64,
    /// Connections closed by the shutdown deadline while still open.
    pub connections_aborted_at_shutdown: u64,
    /// Health `Watch` streams open now.
    pub health_watch_open: u64,
    /// Health `Watch` streams refused at the limit.
    pub health_watch_rejected: u64,
    /// Reflection streams open now.
    pub reflection_open: u64,
    /// Reflection streams refused at the limit.
    pub reflection_rejected: u64,
}

/// The live counters behind [`WanStats`].
#[derive(Debug, Default)]
pub(crate) struct WanCounters {
    lagged: [AtomicU64; 4],
    limit_rejected: [[AtomicU64; 3]; 4],
    pool_heartbeats: AtomicU64,
    load_updates: AtomicU64,
    terminal_publication_failures: AtomicU64,
    slow_consumer_ended: [AtomicU64; 4],
    slow_consumer_connections_closed: AtomicU64,
    pub(crate) listener: ListenerCounters,
}

/// The live counters behind [`ListenerStats`].
#[derive(Debug, Default)]
pub(crate) struct ListenerCounters {
    pub(crate) connections_open: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) accept_errors: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) connections_aborted_at_shutdown: AtomicU64,
    pub(crate) health_watch_open: AtomicU64,
    pub(crate) health_watch_rejected: AtomicU64,
    pub(crate) reflection_open: AtomicU64,
    pub(crate) reflection_rejected: AtomicU64,
}

/// Add one to `counter`.
pub(crate) fn bump_counter(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Take one from the gauge `counter` (never below zero).
pub(crate) fn drop_gauge(counter: &AtomicU64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
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

    pub(crate) fn slow_consumer(&self, stream: StreamType) {
        bump(&self.slow_consumer_ended[stream as usize]);
    }

    pub(crate) fn slow_consumer_connection_closed(&self) {
        bump(&self.slow_consumer_connections_closed);
    }

    pub(crate) fn snapshot(&self) -> WanStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let l = &self.listener;
        WanStats {
            subscriber_lagged: self.lagged.each_ref().map(read),
            subscriber_limit_rejected: self
                .limit_rejected
                .each_ref()
                .map(|scopes| scopes.each_ref().map(read)),
            pool_heartbeats: read(&self.pool_heartbeats),
            load_updates: read(&self.load_updates),
            terminal_publication_failures: read(&self.terminal_publication_failures),
            slow_consumer_ended: self.slow_consumer_ended.each_ref().map(read),
            slow_consumer_connections_closed: read(&self.slow_consumer_connections_closed),
            listener: ListenerStats {
                connections_open: read(&l.connections_open),
                connections_refused: read(&l.connections_refused),
                accept_errors: read(&l.accept_errors),
                handshake_timeouts: read(&l.handshake_timeouts),
                connections_aborted_at_shutdown: read(&l.connections_aborted_at_shutdown),
                health_watch_open: read(&l.health_watch_open),
                health_watch_rejected: read(&l.health_watch_rejected),
                reflection_open: read(&l.reflection_open),
                reflection_rejected: read(&l.reflection_rejected),
            },
        }
    }
}
