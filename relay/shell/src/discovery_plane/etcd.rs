//! The etcd discovery backend (`DYN_DISCOVERY_BACKEND=etcd`, `ETCD_ENDPOINTS`).
//!
//! Dynamo stores its discovery records as logical keys under `v1/` (dc-inputs §1.3), each
//! attached to the owning process's lease, so a dead process's keys vanish when its lease
//! expires. The loop (relay-facts §9.1):
//!
//! 1. connect (endpoints are tried in turn, one per attempt);
//! 2. if no listing is current, list `v1/` at one revision `R` and apply it as a relist;
//! 3. watch `v1/` from the last applied revision + 1: after a reconnect nothing is missed and
//!    nothing is relisted; if that revision was compacted, relist (step 2) and watch again;
//! 4. every `reconcile_interval` (30 s) relist on the same connection while the watch stays
//!    open; watch events at or below the relisted revision are then skipped, since the listing
//!    already holds their effect;
//! 5. on any error (connect, call, broken stream, canceled watch) wait the backoff (100 ms
//!    doubling to 5 s; reset once a watch is established) and go back to 1.
//!
//! Invariant: `applied_revision` is the highest revision whose effects the differ holds; every
//! event above it is applied exactly once and in order, every event at or below it is skipped.

use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::etcd_client::{
    EtcdClient, EtcdConnectOptions, EtcdError, WatchBatch, WatchEvent, endpoint_uri,
};
use super::records::{KeyForm, ListingEntry, ListingMode, RecordDiffer};
use super::{
    Backoff, DISCOVERY_RECORDS_MAX, Delivery, DiscoveryOutput, DiscoveryPlaneError, DiscoverySink,
    DiscoveryStats, sleep_or_cancel,
};
use kvrelay_core::discovery::DiscoveryScope;

/// The key prefix of Dynamo's discovery records.
const DISCOVERY_PREFIX: &str = "v1/";

/// Configuration of the etcd backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdDiscoveryConfig {
    /// Client URLs (`http://host:port` or `host:port`), tried in turn; never empty.
    pub endpoints: Vec<String>,
    /// Connection, timeout and keepalive settings.
    pub connect: EtcdConnectOptions,
    /// First delay after a failure (default 100 ms), doubling per failure.
    pub reconnect_backoff_initial: Duration,
    /// Longest delay after failures (default 5 s).
    pub reconnect_backoff_max: Duration,
    /// Time between reconciliation relists (default 30 s).
    pub reconcile_interval: Duration,
    /// Keys per listing call (default 512).
    pub range_page_keys: i64,
}

impl EtcdDiscoveryConfig {
    /// The defaults for `endpoints`.
    #[must_use]
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdDiscoveryConfig {
            endpoints,
            connect: EtcdConnectOptions::default(),
            reconnect_backoff_initial: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            reconcile_interval: Duration::from_secs(30),
            range_page_keys: 512,
        }
    }

    /// Check the values are usable: at least one plaintext endpoint, positive durations.
    pub fn validate(&self) -> Result<(), DiscoveryPlaneError> {
        let invalid = |field, reason| Err(DiscoveryPlaneError::InvalidConfig { field, reason });
        if self.endpoints.is_empty() {
            return invalid("endpoints", "must name at least one etcd endpoint");
        }
        for endpoint in &self.endpoints {
            endpoint_uri(endpoint, self.connect.security.tls.is_some()).map_err(|reason| {
                DiscoveryPlaneError::InvalidEtcdEndpoint { endpoint: endpoint.clone(), reason }
            })?;
        }
        let connect = &self.connect;
        if connect.connect_timeout.is_zero()
            || connect.request_timeout.is_zero()
            || connect.keepalive_interval.is_zero()
            || connect.keepalive_timeout.is_zero()
        {
            return invalid("connect", "timeouts and keepalive must be positive");
        }
        if connect.message_bytes_max == 0 {
            return invalid("connect.message_bytes_max", "must be positive");
        }
        if self.reconnect_backoff_initial.is_zero()
            || self.reconnect_backoff_max < self.reconnect_backoff_initial
        {
            return invalid("reconnect_backoff", "must be positive with initial <= max");
        }
        if self.reconcile_interval.is_zero() {
            return invalid("reconcile_interval", "must be positive");
        }
        if self.range_page_keys <= 0 {
            return invalid("range_page_keys", "must be positive");
        }
        Ok(())
    }
}

/// How one session (connection) ended.
enum SessionEnd {
    Cancelled,
    Failed(EtcdError),
}

/// The state that survives reconnects.
struct EtcdWatcher {
    config: EtcdDiscoveryConfig,
    differ: RecordDiffer,
    stats: DiscoveryStats,
    /// Highest revision whose effects the differ holds (0: nothing listed yet).
    applied_revision: i64,
    /// Events at or below this revision are covered by the last listing.
    listed_revision: i64,
    /// A listing must precede the next watch (start, or the watch revision was compacted).
    relist_needed: bool,
}

impl EtcdWatcher {
    fn fail(&mut self, error: &EtcdError) {
        self.stats.transport_errors = self.stats.transport_errors.saturating_add(1);
        self.stats.last_error = Some(error.to_string());
    }

    /// List the prefix and apply it as a relist.
    async fn relist(&mut self, client: &mut EtcdClient) -> Result<Vec<DiscoveryOutput>, EtcdError> {
        let snapshot = client
            .range_prefix(
                DISCOVERY_PREFIX.as_bytes(),
                self.config.range_page_keys,
                DISCOVERY_RECORDS_MAX,
            )
            .await?;
        let mut entries = Vec::with_capacity(snapshot.kvs.len());
        let mut skipped = 0usize;
        for (key, value) in snapshot.kvs {
            match String::from_utf8(key) {
                Ok(key) => entries.push(ListingEntry::bytes(key, value)),
                Err(_) => skipped += 1,
            }
        }
        if skipped > 0 {
            debug!(skipped, "ignoring etcd keys that are not UTF-8");
        }
        let outputs = self.differ.apply_listing(entries, ListingMode::Relist);
        // A linearizable listing is never older than an event already received; `max` keeps
        // the resume point monotonic all the same.
        self.applied_revision = self.applied_revision.max(snapshot.revision);
        self.listed_revision = snapshot.revision;
        self.relist_needed = false;
        self.stats.listings = self.stats.listings.saturating_add(1);
        self.stats.revision = snapshot.revision;
        self.stats.records = self.differ.counters().clone();
        debug!(revision = snapshot.revision, "etcd discovery listed");
        Ok(outputs)
    }

    /// Apply one watch batch's events in order.
    fn apply_events(&mut self, events: Vec<WatchEvent>) -> Vec<DiscoveryOutput> {
        let mut outputs = Vec::new();
        for event in events {
            let revision = event.mod_revision();
            if revision <= self.listed_revision {
                continue;
            }
            outputs.extend(match event {
                WatchEvent::Put { key, value, .. } => match String::from_utf8(key) {
                    Ok(key) => self.differ.apply_put(&key, value),
                    Err(_) => Vec::new(),
                },
                WatchEvent::Delete { key, .. } => match String::from_utf8(key) {
                    Ok(key) => self.differ.apply_delete(&key),
                    Err(_) => Vec::new(),
                },
            });
            self.applied_revision = self.applied_revision.max(revision);
            self.stats.watch_events = self.stats.watch_events.saturating_add(1);
        }
        self.stats.revision = self.applied_revision;
        self.stats.records = self.differ.counters().clone();
        outputs
    }

    /// Deliver outputs; `Some(end)` if the session must end.
    async fn deliver(
        &self,
        sink: &DiscoverySink,
        outputs: Vec<DiscoveryOutput>,
        cancel: &CancellationToken,
    ) -> Result<Option<SessionEnd>, DiscoveryPlaneError> {
        let delivery = sink.deliver(outputs, cancel).await?;
        sink.publish_stats(&self.stats);
        Ok((delivery == Delivery::Cancelled).then_some(SessionEnd::Cancelled))
    }

    /// One connection's life: (re)list if needed, watch, reconcile, until an error.
    async fn session(
        &mut self,
        client: &mut EtcdClient,
        sink: &DiscoverySink,
        backoff: &mut Backoff,
        cancel: &CancellationToken,
    ) -> Result<SessionEnd, DiscoveryPlaneError> {
        let prefix = DISCOVERY_PREFIX.as_bytes();
        let mut namespaces = sink.namespaces.clone();
        loop {
            if let Some(limit) = sink.namespace_limit_change(self.differ.namespace_limit()) {
                info!(namespaces = ?limit, "etcd discovery scope narrowed; relisting");
                self.differ.set_namespace_limit(limit);
                self.relist_needed = true;
            }
            if self.relist_needed {
                let outputs = match self.relist(client).await {
                    Ok(outputs) => outputs,
                    Err(error) => return Ok(SessionEnd::Failed(error)),
                };
                if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                    return Ok(end);
                }
            }
            let start_revision = self.applied_revision + 1;
            let mut watch = match client.watch_prefix(prefix, start_revision).await {
                Ok(watch) => watch,
                Err(error) => return Ok(SessionEnd::Failed(error)),
            };
            backoff.reset();
            info!(endpoint = client.endpoint(), start_revision, "etcd discovery watching");
            let period = self.config.reconcile_interval;
            let mut reconcile = tokio::time::interval_at(Instant::now() + period, period);
            reconcile.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                let outputs = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(SessionEnd::Cancelled),
                    () = DiscoverySink::namespace_limit_changed(&mut namespaces) => break,
                    _ = reconcile.tick() => match self.relist(client).await {
                        Ok(outputs) => outputs,
                        Err(error) => return Ok(SessionEnd::Failed(error)),
                    },
                    batch = watch.next() => match batch {
                        Ok(WatchBatch::Events(events)) => self.apply_events(events),
                        Ok(WatchBatch::Progress { revision }) => {
                            self.applied_revision = self.applied_revision.max(revision);
                            self.stats.revision = self.applied_revision;
                            Vec::new()
                        }
                        Ok(WatchBatch::Compacted { compact_revision }) => {
                            warn!(
                                start_revision = self.applied_revision + 1,
                                compact_revision,
                                "etcd compacted past the watch revision; relisting"
                            );
                            self.stats.compactions = self.stats.compactions.saturating_add(1);
                            self.relist_needed = true;
                            break;
                        }
                        Err(error) => return Ok(SessionEnd::Failed(error)),
                    },
                };
                if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                    return Ok(end);
                }
            }
        }
    }
}

/// Run the etcd backend until `cancel` fires (`Ok(())`) or the sink closes
/// ([`DiscoveryPlaneError::SinkClosed`]). Fails at once only on an invalid configuration;
/// connection and protocol errors are retried forever with backoff.
pub async fn run_etcd_discovery(
    config: EtcdDiscoveryConfig,
    scope: DiscoveryScope,
    sink: DiscoverySink,
    cancel: CancellationToken,
) -> Result<(), DiscoveryPlaneError> {
    config.validate()?;
    let mut backoff = Backoff::new(config.reconnect_backoff_initial, config.reconnect_backoff_max);
    let endpoints = config.endpoints.clone();
    let mut watcher = EtcdWatcher {
        config,
        differ: RecordDiffer::new(scope, KeyForm::Logical),
        stats: DiscoveryStats::default(),
        applied_revision: 0,
        listed_revision: 0,
        relist_needed: true,
    };
    let mut sessions = 0u64;
    for endpoint in endpoints.iter().cycle() {
        let connected = tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(()),
            connected = EtcdClient::connect(endpoint, &watcher.config.connect) => connected,
        };
        let error = match connected {
            Ok(mut client) => {
                if sessions > 0 {
                    watcher.stats.reconnects = watcher.stats.reconnects.saturating_add(1);
                }
                sessions += 1;
                match watcher.session(&mut client, &sink, &mut backoff, &cancel).await? {
                    SessionEnd::Cancelled => return Ok(()),
                    SessionEnd::Failed(error) => error,
                }
            }
            Err(error) => error,
        };
        watcher.fail(&error);
        sink.publish_stats(&watcher.stats);
        let delay = backoff.next_delay();
        warn!(%error, retry_in = ?delay, "etcd discovery interrupted");
        if sleep_or_cancel(delay, &cancel).await {
            return Ok(());
        }
    }
    // `cycle` over a validated, non-empty list never ends.
    Err(DiscoveryPlaneError::InvalidConfig {
        field: "endpoints",
        reason: "must name at least one etcd endpoint",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_is_validated() {
        let valid = EtcdDiscoveryConfig::new(vec!["127.0.0.1:2379".into()]);
        assert!(valid.validate().is_ok());
        assert!(matches!(
            EtcdDiscoveryConfig::new(Vec::new()).validate(),
            Err(DiscoveryPlaneError::InvalidConfig { field: "endpoints", .. })
        ));
        assert!(matches!(
            EtcdDiscoveryConfig::new(vec!["https://127.0.0.1:2379".into()]).validate(),
            Err(DiscoveryPlaneError::InvalidEtcdEndpoint { .. })
        ));
        let zero_reconcile =
            EtcdDiscoveryConfig { reconcile_interval: Duration::ZERO, ..valid.clone() };
        assert!(zero_reconcile.validate().is_err());
        let bad_page = EtcdDiscoveryConfig { range_page_keys: 0, ..valid };
        assert!(bad_page.validate().is_err());
    }
}
