//! The etcd discovery backend (`DYN_DISCOVERY_BACKEND=etcd`, `ETCD_ENDPOINTS`).
//!
//! Dynamo stores its discovery records as logical keys under `v1/` (dc-inputs §1.3), each
//! attached to the owning process's lease, so a dead process's keys vanish when its lease
//! expires. What the backend queries follows the namespaces in effect (the scope's, narrowed by
//! the `--sources-file` selection):
//!
//! - **every namespace**: one listing and one watch of the whole `v1/` prefix, records filtered
//!   client-side by the scope;
//! - **named namespaces** (at most [`NAMESPACE_QUERIES_MAX`], each of `[A-Za-z0-9_-]`): one
//!   query per namespace, filtered server-side — a listing of its four record prefixes
//!   (`v1/instances/{ns}/`, `v1/mdc/{ns}/`, `v1/event_sources/namespace/{ns}/`,
//!   `v1/event_channels/namespace/{ns}/`) and one watch stream holding one watcher per prefix.
//!   The queries are opened concurrently; every listing of one relist is pinned to one store
//!   revision, so the merged listing is one consistent snapshot. Any other selection (more
//!   namespaces, or names whose keys might be spelled percent-encoded) falls back to the whole
//!   store.
//!
//! The loop (relay-facts §9.1):
//!
//! 1. connect (endpoints are tried in turn, one per attempt);
//! 2. whole store: if no listing is current, list `v1/` at one revision `R` and apply it as a
//!    relist; watch `v1/` from the last applied revision + 1, so after a reconnect nothing is
//!    missed and nothing is relisted; if that revision was compacted, relist and watch again;
//! 3. named namespaces: every (re)binding relists every query at one revision `R` and watches
//!    every query from `R + 1`; when any one stream ends, errs or is compacted, all of them are
//!    dropped and rebound the same way (after the backoff when it erred), so the queries never
//!    drift apart;
//! 4. every `reconcile_interval` (30 s, `DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS`) relist on the
//!    same connection while the watches stay open; a relist that finds the state unchanged
//!    emits nothing, one that finds drift emits exactly the difference. Watch events at or
//!    below the relisted revision are then skipped, since the listing already holds their
//!    effect;
//! 5. on a connection or call error wait the backoff (100 ms doubling to 5 s; reset once a
//!    whole-store watch is established, or once namespace streams stayed open for the longest
//!    backoff) and go back to 1.
//!
//! Invariant: `listed_revision` is the revision of the last listing applied; every event above
//! it is applied exactly once and in order per key, every event at or below it is skipped.
//! Whole store only: `applied_revision` is the highest revision whose effects the differ holds.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::etcd_client::{
    EtcdClient, EtcdConnectOptions, EtcdError, KeyBudget, WatchBatch, WatchEvent, WatchStream,
    endpoint_uri,
};
use super::records::{KeyForm, ListingEntry, ListingMode, RecordDiffer};
use super::{
    Backoff, DISCOVERY_RECORDS_MAX, Delivery, DiscoveryOutput, DiscoveryPlaneError, DiscoverySink,
    DiscoveryStats, NamespaceLimit, sleep_or_cancel,
};
use kvrelay_core::discovery::{DiscoveryScope, NamespaceSelection};

/// The key prefix of Dynamo's discovery records.
const DISCOVERY_PREFIX: &str = "v1/";

/// The most namespaces queried one by one; a larger selection is watched as the whole store
/// (each namespace holds one gRPC stream and four watchers open on the etcd connection).
pub const NAMESPACE_QUERIES_MAX: usize = 256;

/// Listing calls (and watch creations) in flight at once while a namespace set is bound.
const QUERY_CONCURRENCY: usize = 16;

/// What the backend lists and watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdQueries {
    /// The whole `v1/` prefix, one listing and one watch; the scope filters client-side.
    WholeStore,
    /// One query per namespace (the four record prefixes of each), filtered server-side; an
    /// empty set queries nothing.
    Namespaces(BTreeSet<String>),
}

impl EtcdQueries {
    /// The queries for `scope` narrowed by `limit` (see the module docs).
    #[must_use]
    pub fn of(scope: &DiscoveryScope, limit: Option<&BTreeSet<String>>) -> Self {
        let selected: Option<BTreeSet<String>> = match (scope.namespace_selection(), limit) {
            (NamespaceSelection::All, None) => None,
            (NamespaceSelection::All, Some(limit)) => Some(limit.clone()),
            (NamespaceSelection::Namespaces(names), None) => Some(names.clone()),
            (NamespaceSelection::Namespaces(names), Some(limit)) => {
                Some(names.intersection(limit).cloned().collect())
            }
        };
        match selected {
            Some(names)
                if names.len() <= NAMESPACE_QUERIES_MAX
                    && names.iter().all(|name| is_plain_namespace(name)) =>
            {
                EtcdQueries::Namespaces(names)
            }
            _ => EtcdQueries::WholeStore,
        }
    }
}

/// Whether every key of `namespace` starts with the prefixes [`namespace_prefixes`] builds:
/// a non-empty name of `[A-Za-z0-9_-]`, which no percent-encoding of an event key changes and
/// which cannot reach into another namespace's keys.
fn is_plain_namespace(namespace: &str) -> bool {
    !namespace.is_empty()
        && namespace
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

/// The four key prefixes holding `namespace`'s records (dc-inputs §1.3).
#[must_use]
pub fn namespace_prefixes(namespace: &str) -> [String; 4] {
    [
        format!("v1/instances/{namespace}/"),
        format!("v1/mdc/{namespace}/"),
        format!("v1/event_sources/namespace/{namespace}/"),
        format!("v1/event_channels/namespace/{namespace}/"),
    ]
}

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

/// How one binding of a query set ended.
enum Binding {
    /// The namespaces in effect changed: compute the queries again.
    Requery,
    /// The session is over.
    End(SessionEnd),
}

/// The state that survives reconnects.
struct EtcdWatcher {
    config: EtcdDiscoveryConfig,
    scope: DiscoveryScope,
    differ: RecordDiffer,
    stats: DiscoveryStats,
    /// Whole store: highest revision whose effects the differ holds (0: nothing listed yet).
    applied_revision: i64,
    /// Events at or below this revision are covered by the last listing.
    listed_revision: i64,
    /// Whole store: a listing must precede the next watch (start, the watch revision was
    /// compacted, the queries changed).
    relist_needed: bool,
}

impl EtcdWatcher {
    fn fail(&mut self, error: &EtcdError) {
        self.stats.transport_errors = self.stats.transport_errors.saturating_add(1);
        self.stats.last_error = Some(error.to_string());
    }

    /// List the whole prefix and apply it as a listing of `mode`.
    async fn relist(
        &mut self,
        client: &mut EtcdClient,
        mode: ListingMode,
    ) -> Result<Vec<DiscoveryOutput>, EtcdError> {
        let snapshot = client
            .range_prefix(
                DISCOVERY_PREFIX.as_bytes(),
                self.config.range_page_keys,
                DISCOVERY_RECORDS_MAX,
            )
            .await?;
        Ok(self.apply_snapshot(snapshot.kvs, snapshot.revision, mode))
    }

    /// List every query of `namespaces` at one revision, concurrently, and apply the merged
    /// listing as one listing of `mode`.
    async fn relist_namespaces(
        &mut self,
        client: &EtcdClient,
        namespaces: &BTreeSet<String>,
        mode: ListingMode,
    ) -> Result<Vec<DiscoveryOutput>, EtcdError> {
        let revision = client.clone().current_revision().await?;
        let budget = KeyBudget::new(DISCOVERY_RECORDS_MAX);
        let page_keys = self.config.range_page_keys;
        let prefixes: Vec<String> =
            namespaces.iter().flat_map(|namespace| namespace_prefixes(namespace)).collect();
        // The futures are collected first: a lazily mapped iterator inside the stream would make
        // this future's `Send` depend on a closure's higher-ranked lifetimes.
        let mut calls = Vec::with_capacity(prefixes.len());
        for prefix in &prefixes {
            let mut client = client.clone();
            let budget = &budget;
            calls.push(async move {
                client.range_prefix_at(prefix.as_bytes(), revision, page_keys, budget).await
            });
        }
        let listings: Vec<_> =
            futures::stream::iter(calls).buffered(QUERY_CONCURRENCY).try_collect().await?;
        let kvs = listings.into_iter().flat_map(|listing| listing.kvs).collect();
        Ok(self.apply_snapshot(kvs, revision, mode))
    }

    /// Apply a listing read at `revision`.
    fn apply_snapshot(
        &mut self,
        kvs: Vec<(Vec<u8>, Vec<u8>)>,
        revision: i64,
        mode: ListingMode,
    ) -> Vec<DiscoveryOutput> {
        let mut entries = Vec::with_capacity(kvs.len());
        let mut unreadable = Vec::new();
        for (key, value) in kvs {
            match String::from_utf8(key) {
                Ok(key) => entries.push(ListingEntry::bytes(key, value)),
                Err(error) => {
                    unreadable.push(String::from_utf8_lossy(error.as_bytes()).into_owned());
                }
            }
        }
        let outputs = self.differ.apply_listing_with_unreadable(entries, unreadable, mode);
        // A linearizable listing is never older than an event already received; `max` keeps
        // the resume point monotonic all the same.
        self.applied_revision = self.applied_revision.max(revision);
        self.listed_revision = revision;
        self.relist_needed = false;
        self.stats.listings = self.stats.listings.saturating_add(1);
        self.stats.revision = revision;
        self.publish_differ_stats();
        debug!(revision, "etcd discovery listed");
        outputs
    }

    fn publish_differ_stats(&mut self) {
        self.stats.records = self.differ.counters().clone();
        self.stats.soft_errors = self.differ.soft_errors().clone();
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
                    Err(error) => {
                        self.differ.note_unreadable_put(&String::from_utf8_lossy(error.as_bytes()));
                        Vec::new()
                    }
                },
                WatchEvent::Delete { key, .. } => match String::from_utf8(key) {
                    Ok(key) => self.differ.apply_delete(&key),
                    Err(error) => {
                        self.differ
                            .note_unreadable_delete(&String::from_utf8_lossy(error.as_bytes()));
                        Vec::new()
                    }
                },
            });
            self.applied_revision = self.applied_revision.max(revision);
            self.stats.watch_events = self.stats.watch_events.saturating_add(1);
        }
        self.stats.revision = self.applied_revision;
        self.publish_differ_stats();
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

    /// A reconciliation timer whose first tick is one period from now.
    fn reconcile_timer(&self) -> tokio::time::Interval {
        let period = self.config.reconcile_interval;
        let mut reconcile = tokio::time::interval_at(Instant::now() + period, period);
        reconcile.set_missed_tick_behavior(MissedTickBehavior::Delay);
        reconcile
    }

    /// One connection's life: bind the queries in effect, until an error or cancellation.
    async fn session(
        &mut self,
        client: &mut EtcdClient,
        sink: &DiscoverySink,
        backoff: &mut Backoff,
        cancel: &CancellationToken,
    ) -> Result<SessionEnd, DiscoveryPlaneError> {
        let mut limits = sink.namespaces.clone();
        loop {
            if let Some(limit) = sink.namespace_limit_change(self.differ.namespace_limit()) {
                info!(namespaces = ?limit, "etcd discovery namespaces changed; relisting");
                self.differ.set_namespace_limit(limit);
                self.relist_needed = true;
            }
            let queries = EtcdQueries::of(&self.scope, self.differ.namespace_limit());
            let binding = match queries {
                EtcdQueries::WholeStore => {
                    self.watch_whole_store(client, sink, backoff, cancel, &mut limits).await?
                }
                EtcdQueries::Namespaces(namespaces) => {
                    self.watch_namespaces(client, &namespaces, sink, backoff, cancel, &mut limits)
                        .await?
                }
            };
            match binding {
                Binding::Requery => {}
                Binding::End(end) => return Ok(end),
            }
        }
    }

    /// The whole store: (re)list if needed, watch `v1/`, reconcile, until the namespaces
    /// change or the session ends.
    async fn watch_whole_store(
        &mut self,
        client: &mut EtcdClient,
        sink: &DiscoverySink,
        backoff: &mut Backoff,
        cancel: &CancellationToken,
        limits: &mut Option<tokio::sync::watch::Receiver<NamespaceLimit>>,
    ) -> Result<Binding, DiscoveryPlaneError> {
        self.stats.watch_streams = 0;
        loop {
            if self.relist_needed {
                let outputs = match self.relist(client, ListingMode::Relist).await {
                    Ok(outputs) => outputs,
                    Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                };
                if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                    return Ok(Binding::End(end));
                }
            }
            let start_revision = self.applied_revision + 1;
            let mut watch =
                match client.watch_prefix(DISCOVERY_PREFIX.as_bytes(), start_revision).await {
                    Ok(watch) => watch,
                    Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                };
            backoff.reset();
            self.stats.watch_streams = 1;
            // Published now: a quiet store may send nothing for a long time.
            sink.publish_stats(&self.stats);
            info!(endpoint = client.endpoint(), start_revision, "etcd discovery watching");
            let mut reconcile = self.reconcile_timer();
            loop {
                let outputs = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(Binding::End(SessionEnd::Cancelled)),
                    () = DiscoverySink::namespace_limit_changed(limits) => {
                        return Ok(Binding::Requery);
                    }
                    _ = reconcile.tick() => {
                        self.stats.relists = self.stats.relists.saturating_add(1);
                        match self.relist(client, ListingMode::Poll).await {
                            Ok(outputs) => outputs,
                            Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                        }
                    }
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
                        Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                    },
                };
                if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                    return Ok(Binding::End(end));
                }
            }
        }
    }

    /// One query per namespace: relist them all at one revision and watch them all from the
    /// next; rebind them all when any stream ends; reconcile; until the namespaces change or
    /// the session ends.
    async fn watch_namespaces(
        &mut self,
        client: &mut EtcdClient,
        namespaces: &BTreeSet<String>,
        sink: &DiscoverySink,
        backoff: &mut Backoff,
        cancel: &CancellationToken,
        limits: &mut Option<tokio::sync::watch::Receiver<NamespaceLimit>>,
    ) -> Result<Binding, DiscoveryPlaneError> {
        let mut rebinding = false;
        loop {
            self.stats.watch_streams = 0;
            let outputs =
                match self.relist_namespaces(client, namespaces, ListingMode::Relist).await {
                    Ok(outputs) => outputs,
                    Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                };
            if rebinding {
                self.stats.rebinds = self.stats.rebinds.saturating_add(1);
            }
            rebinding = true;
            if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                return Ok(Binding::End(end));
            }
            if namespaces.is_empty() {
                // Nothing to watch: wait for another selection.
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(Binding::End(SessionEnd::Cancelled)),
                    () = DiscoverySink::namespace_limit_changed(limits) => {
                        return Ok(Binding::Requery);
                    }
                }
            }
            let start_revision = self.listed_revision + 1;
            let mut creations = Vec::with_capacity(namespaces.len());
            for namespace in namespaces {
                let mut client = client.clone();
                let namespace = namespace.clone();
                creations.push(async move {
                    let prefixes = namespace_prefixes(&namespace).map(String::into_bytes);
                    let stream = client.watch_prefixes(&prefixes, start_revision).await?;
                    Ok::<_, EtcdError>((namespace, stream))
                });
            }
            let opened: Result<Vec<(String, WatchStream)>, EtcdError> =
                futures::stream::iter(creations).buffered(QUERY_CONCURRENCY).try_collect().await;
            let opened = match opened {
                Ok(opened) => opened,
                Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
            };
            self.stats.watch_streams = u64::try_from(opened.len()).unwrap_or(u64::MAX);
            sink.publish_stats(&self.stats);
            info!(
                endpoint = client.endpoint(),
                namespaces = opened.len(),
                start_revision,
                "etcd discovery watching one query per namespace"
            );
            let established = Instant::now();
            let mut streams =
                futures::stream::select_all(opened.into_iter().map(|(namespace, stream)| {
                    futures::stream::unfold(stream, move |mut stream| {
                        let namespace = namespace.clone();
                        async move {
                            let batch = stream.next().await;
                            Some(((namespace, batch), stream))
                        }
                    })
                    .boxed()
                }));
            let mut reconcile = self.reconcile_timer();
            let ended = loop {
                let outputs = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(Binding::End(SessionEnd::Cancelled)),
                    () = DiscoverySink::namespace_limit_changed(limits) => {
                        return Ok(Binding::Requery);
                    }
                    _ = reconcile.tick() => {
                        self.stats.relists = self.stats.relists.saturating_add(1);
                        match self.relist_namespaces(client, namespaces, ListingMode::Poll).await {
                            Ok(outputs) => outputs,
                            Err(error) => return Ok(Binding::End(SessionEnd::Failed(error))),
                        }
                    }
                    next = streams.next() => match next {
                        Some((_, Ok(WatchBatch::Events(events)))) => self.apply_events(events),
                        Some((_, Ok(WatchBatch::Progress { .. }))) => Vec::new(),
                        Some((namespace, Ok(WatchBatch::Compacted { compact_revision }))) => {
                            warn!(namespace, compact_revision,
                                "etcd compacted past a namespace watch; rebinding every query");
                            self.stats.compactions = self.stats.compactions.saturating_add(1);
                            break None;
                        }
                        Some((namespace, Err(error))) => break Some((namespace, error)),
                        // `select_all` over at least one endless stream never ends.
                        None => break Some((String::new(), EtcdError::WatchEnded)),
                    },
                };
                if let Some(end) = self.deliver(sink, outputs, cancel).await? {
                    return Ok(Binding::End(end));
                }
            };
            drop(streams);
            self.stats.watch_streams = 0;
            if let Some((namespace, error)) = ended {
                // A stream that held for the longest backoff was healthy: start the backoff
                // afresh. Either way wait before rebinding, so a stream that keeps failing
                // cannot make the relay relist in a tight loop.
                if established.elapsed() >= self.config.reconnect_backoff_max {
                    backoff.reset();
                }
                self.fail(&error);
                sink.publish_stats(&self.stats);
                let delay = backoff.next_delay();
                warn!(namespace, %error, retry_in = ?delay,
                    "an etcd namespace watch ended; rebinding every query");
                if sleep_or_cancel(delay, cancel).await {
                    return Ok(Binding::End(SessionEnd::Cancelled));
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
        differ: RecordDiffer::new(scope.clone(), KeyForm::Logical),
        scope,
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
        watcher.stats.watch_streams = 0;
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

    fn names(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|item| (*item).to_owned()).collect()
    }

    #[test]
    fn queries_follow_the_namespaces_in_effect() {
        let all = DiscoveryScope::watch_all(Vec::new()).unwrap();
        let named = DiscoveryScope::namespaces(vec!["a".into(), "b".into()], Vec::new()).unwrap();
        assert_eq!(EtcdQueries::of(&all, None), EtcdQueries::WholeStore);
        assert_eq!(EtcdQueries::of(&named, None), EtcdQueries::Namespaces(names(&["a", "b"])));
        // The sources file narrows either scope; an empty selection queries nothing.
        assert_eq!(
            EtcdQueries::of(&all, Some(&names(&["c"]))),
            EtcdQueries::Namespaces(names(&["c"]))
        );
        assert_eq!(
            EtcdQueries::of(&named, Some(&names(&["b", "c"]))),
            EtcdQueries::Namespaces(names(&["b"]))
        );
        assert_eq!(EtcdQueries::of(&all, Some(&names(&[]))), EtcdQueries::Namespaces(names(&[])));
        // Names whose keys a prefix might not cover, and too many names, watch the whole store.
        for odd in ["a/b", "a.b", "a%2Fb", "ü"] {
            let scope = DiscoveryScope::namespaces(vec![odd.into()], Vec::new()).unwrap();
            assert_eq!(EtcdQueries::of(&scope, None), EtcdQueries::WholeStore, "{odd}");
        }
        let many: Vec<String> =
            (0..=NAMESPACE_QUERIES_MAX).map(|index| format!("ns{index}")).collect();
        let wide = DiscoveryScope::namespaces(many.clone(), Vec::new()).unwrap();
        assert_eq!(EtcdQueries::of(&wide, None), EtcdQueries::WholeStore);
        let fits = DiscoveryScope::namespaces(many[1..].to_vec(), Vec::new()).unwrap();
        assert!(matches!(EtcdQueries::of(&fits, None), EtcdQueries::Namespaces(set)
            if set.len() == NAMESPACE_QUERIES_MAX));
    }

    #[test]
    fn a_namespace_query_covers_exactly_its_four_record_prefixes() {
        let prefixes = namespace_prefixes("prod");
        assert_eq!(
            prefixes,
            [
                "v1/instances/prod/",
                "v1/mdc/prod/",
                "v1/event_sources/namespace/prod/",
                "v1/event_channels/namespace/prod/",
            ]
        );
        // Every record key of the namespace starts with one of them; no key of another
        // namespace (even one the name is a prefix of) does.
        let inside = [
            "v1/instances/prod/backend/generate/1f",
            "v1/mdc/prod/backend/generate/1f/ad-1",
            "v1/event_sources/namespace/prod/component/backend/endpoint/generate/topic/kv-events/2a",
            "v1/event_channels/namespace/prod/component/backend/endpoint/generate/topic/kv-events/2a",
        ];
        let outside = [
            "v1/instances/production/backend/generate/1f",
            "v1/mdc/prod-2/backend/generate/1f",
            "v1/event_sources/namespace/prods/component/backend/endpoint/generate/topic/kv-events/2a",
        ];
        let covered = |key: &str| prefixes.iter().any(|prefix| key.starts_with(prefix.as_str()));
        assert!(inside.iter().all(|key| covered(key)));
        assert!(!outside.iter().any(|key| covered(key)));
    }
}
