//! Counters shared by an event-plane transport and whoever reports on it.
//!
//! A transport updates one [`EventPlaneStats`] behind a mutex held only for the update; readers
//! take a [`snapshot`](EventPlaneCounters::snapshot). Counts saturate instead of wrapping; the
//! NATS queue figures are set, not counted.

use std::sync::{Arc, Mutex, MutexGuard};

use super::zmtp::{ZmtpError, ZmtpErrorKind};
use kvrelay_core::inputs::{InputCounters, InputError};

/// What one event-plane transport has seen so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventPlaneStats {
    /// Decode results: accepted messages, and rejected ones per error kind.
    pub decode: InputCounters,
    /// Facts handed to the sink.
    pub delivered: u64,
    /// ZMQ messages whose envelope names another publisher than the channel they arrived on
    /// (e.g. a restarted worker re-using the port of a channel record that has not expired yet).
    pub publisher_mismatches: u64,
    /// Connections established (the first one and every reconnection).
    pub connects: u64,
    /// Connection losses noticed.
    pub disconnects: u64,
    /// Connection attempts that failed or timed out.
    pub connect_failures: u64,
    /// Errors reading from an established connection.
    pub receive_errors: u64,
    /// Event channel records ignored (not ZMQ, or a topic the relay does not consume).
    pub channels_ignored: u64,
    /// Event channel records refused because the channel table was full.
    pub channels_refused: u64,
    /// Messages dropped by the client library itself (NATS slow-consumer notices: a
    /// subscription's queue was full).
    pub client_drops: u64,
    /// NATS: the byte budget of one subscription's queue inside the client (a figure).
    pub subscription_bytes_max: u64,
    /// NATS: the messages one subscription's queue holds, derived from the byte budget and
    /// [`server_max_payload_bytes`](Self::server_max_payload_bytes) (a figure; 0 until the
    /// first client has connected).
    pub subscription_capacity: u64,
    /// NATS: the server's advertised `max_payload` the capacity is derived from (a figure).
    pub server_max_payload_bytes: u64,
    /// NATS: subscriptions, each with its own queue (a figure).
    pub subscriptions: u64,
    /// NATS clients replaced by one whose capacity is derived from the server's `max_payload`.
    pub client_rebuilds: u64,
    /// NATS: the most bytes of decoded inputs the plane has held while the node's queue was
    /// full (its backlog, bounded by `subscription_bytes_max` plus one input).
    pub backlog_bytes_peak: u64,
    /// NATS: messages dropped because the plane's backlog held its byte budget.
    pub backlog_drops: u64,
    /// ZMTP sessions ended by a protocol violation of the peer, per kind (each also counts as
    /// a disconnect or a failed connection attempt).
    pub zmtp_errors: ZmtpErrorCounts,
}

/// ZMTP protocol violations per [`ZmtpErrorKind`]; counts saturate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ZmtpErrorCounts {
    counts: [u64; ZmtpErrorKind::ALL.len()],
}

impl ZmtpErrorCounts {
    /// Count one violation.
    pub fn record(&mut self, error: &ZmtpError) {
        increment(&mut self.counts[error.kind().index()]);
    }

    /// Violations of `kind` so far.
    #[must_use]
    pub fn get(&self, kind: ZmtpErrorKind) -> u64 {
        self.counts[kind.index()]
    }

    /// Violations of every kind so far (saturating).
    #[must_use]
    pub fn total(&self) -> u64 {
        self.counts.iter().fold(0u64, |total, count| total.saturating_add(*count))
    }
}

/// A shared, cloneable handle to one transport's [`EventPlaneStats`].
#[derive(Debug, Clone, Default)]
pub struct EventPlaneCounters {
    inner: Arc<Mutex<EventPlaneStats>>,
}

impl EventPlaneCounters {
    /// Counters at zero.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of the current counts.
    #[must_use]
    pub fn snapshot(&self) -> EventPlaneStats {
        self.lock().clone()
    }

    /// Count one decode result.
    pub(crate) fn record<T>(&self, result: &Result<T, InputError>) {
        self.lock().decode.record(result);
    }

    /// Apply `update` to the counts.
    pub(crate) fn bump(&self, update: impl FnOnce(&mut EventPlaneStats)) {
        update(&mut self.lock());
    }

    fn lock(&self) -> MutexGuard<'_, EventPlaneStats> {
        // A panic while holding this lock cannot leave the counts inconsistent beyond one
        // increment, so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `counter + 1`, saturating.
pub(crate) fn increment(counter: &mut u64) {
    *counter = counter.saturating_add(1);
}
