//! Production transports of Dynamo's discovery plane: the file-backed directory
//! (`DYN_DISCOVERY_BACKEND=file`, `DYN_FILE_KV`), etcd (`ETCD_ENDPOINTS`) and Kubernetes
//! (`DYN_DISCOVERY_BACKEND=kubernetes`: `DynamoWorkerMetadata` resources, see [`kubernetes`]).
//!
//! Both transports read the same records (dc-inputs §1.3, dynamo-live §9.1) and hand them to one
//! sans-IO [`RecordDiffer`], which turns them into [`DcInput`] facts for the relay's input
//! boundary and [`ChannelChange`]s for the event-plane transport. The transports only move
//! bytes in and facts out:
//!
//! - [`run_file_discovery`] polls `v1/{instances,mdc,event_channels,event_sources}/` under the
//!   root every second, treats files whose modification time is older than the TTL (10 s) as
//!   gone, and feeds each poll to the differ as one complete listing;
//! - [`run_etcd_discovery`] lists and watches the whole `v1/` prefix when every namespace is
//!   selected, else one query per namespace (its four record prefixes), opened concurrently
//!   and all rebound when any one stream ends; the whole-store watch keeps the last applied
//!   revision and re-watches from it after a reconnect (backoff 100 ms doubling to 5 s),
//!   relists when that revision was compacted, and both relist every 30 s to reconcile
//!   (relay-facts §9.1);
//! - [`run_kube_discovery`] lists and watches the worker-metadata resources and their readiness
//!   in one Kubernetes namespace, relists on `410 Gone` and every 30 s, and feeds the ready
//!   workers' records to the differ as one complete listing of logical keys.
//!
//! The reconciling relist's period is `DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS` (default 30 s);
//! for the file backend it is the period of a poll that reads every file, changed or not. A
//! reconciling relist that finds what was already reported emits nothing; one that finds drift
//! emits exactly the difference.
//!
//! Shared rules:
//!
//! - facts leave through a bounded [`mpsc`] channel ([`DiscoverySink`]); a full channel makes the
//!   transport wait (backpressure), a closed one ends it with
//!   [`DiscoveryPlaneError::SinkClosed`];
//! - a cancelled [`CancellationToken`] ends a transport with `Ok(())` at its next await point;
//! - I/O, connection and protocol errors never end a transport and never panic: they are
//!   counted in [`DiscoveryStats`], logged, and retried after a backoff;
//! - monotonic time is `tokio::time`; the file backend's expiry reads the injected
//!   [`WallClock`];
//! - the relay never writes to the discovery plane (it does not delete expired files either:
//!   Dynamo's own processes do).

mod etcd;
mod etcd_client;
mod etcd_security;
mod file;
mod kube_client;
pub mod kubernetes;
mod records;
mod soft_errors;

#[cfg(test)]
mod records_tests;

use crate::node::InputSender;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::runtime::WallClock;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::InputCounters;

pub use etcd::{
    EtcdDiscoveryConfig, EtcdQueries, NAMESPACE_QUERIES_MAX, namespace_prefixes, run_etcd_discovery,
};
pub use etcd_client::{
    EtcdClient, EtcdConnectOptions, EtcdError, KeyBudget, PrefixSnapshot, WatchBatch, WatchEvent,
    WatchStream, prefix_range_end, proto,
};
pub use etcd_security::{
    ETCD_AUTH_CA, ETCD_AUTH_CLIENT_CERT, ETCD_AUTH_CLIENT_KEY, ETCD_AUTH_PASSWORD,
    ETCD_AUTH_USERNAME, EtcdCredentials, EtcdSecurity, EtcdSecurityError, EtcdTls,
};
pub use file::{FileDiscovery, FileDiscoveryConfig, FileScanError, is_expired, run_file_discovery};
pub use kube_client::{
    KubeApiConfig, KubeClient, KubeError, SERVICE_ACCOUNT_DIR, WatchLine, WatchLines,
};
pub use kubernetes::{ApiAccess, KubeDiscoveryConfig, KubeDiscoveryMode, run_kube_discovery};
pub use records::{
    ChannelChange, DISCOVERY_BUCKETS, DISCOVERY_RECORDS_MAX, DiscoveryOutput, EntryValue, KeyForm,
    ListingEntry, ListingMode, RecordDiffer,
};
pub use soft_errors::{SOFT_ERRORS_LISTED, SOFT_ERRORS_TRACKED, SoftErrorLog, SoftErrorReport};

/// Environment variable naming the discovery backend (Dynamo's; default `etcd`).
pub const DISCOVERY_BACKEND_ENV: &str = "DYN_DISCOVERY_BACKEND";
/// Environment variable naming the file backend's root directory.
pub const FILE_KV_ENV: &str = "DYN_FILE_KV";
/// Environment variable listing etcd client URLs, comma-separated.
pub const ETCD_ENDPOINTS_ENV: &str = "ETCD_ENDPOINTS";
/// etcd's conventional client URL, used when `ETCD_ENDPOINTS` is unset.
pub const ETCD_DEFAULT_ENDPOINT: &str = "http://localhost:2379";

/// Why a discovery transport could not start or had to stop.
#[derive(Debug, Error)]
pub enum DiscoveryPlaneError {
    /// The receiver of facts (or of channel changes) is gone: nobody consumes the transport.
    #[error("the discovery output receiver is gone")]
    SinkClosed,
    /// `DYN_DISCOVERY_BACKEND` names a backend this relay does not speak.
    #[error("discovery backend {name:?} is not supported (supported: file, etcd, kubernetes)")]
    UnsupportedBackend {
        /// The configured name.
        name: String,
    },
    /// A setting the chosen backend needs is missing.
    #[error("{variable} must be set for the {backend} discovery backend")]
    MissingSetting {
        /// The environment variable.
        variable: &'static str,
        /// The backend that needs it.
        backend: &'static str,
    },
    /// An etcd endpoint is not a usable client URL (`http://`, or `https://` with TLS).
    #[error("invalid etcd endpoint {endpoint:?}: {reason}")]
    InvalidEtcdEndpoint {
        /// The endpoint as configured.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A configuration value is out of its range.
    #[error("invalid discovery configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An `ETCD_AUTH_*` setting is unusable.
    #[error("etcd security: {0}")]
    InvalidEtcdSecurity(#[from] EtcdSecurityError),
    /// The Kubernetes API URL, token or CA file is unusable.
    #[error("Kubernetes API: {0}")]
    InvalidKubeApi(String),
}

/// What a transport did so far; published after every step through the optional stats channel
/// of a [`DiscoverySink`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoveryStats {
    /// Records decoded and rejected, each distinct value of a key counted once.
    pub records: InputCounters,
    /// Complete listings applied (file polls, etcd lists).
    pub listings: u64,
    /// etcd watch events applied.
    pub watch_events: u64,
    /// Failed polls, connections or calls (each followed by a backoff).
    pub transport_errors: u64,
    /// Listed entries whose value could not be read (the last good record was kept).
    pub unreadable_entries: u64,
    /// etcd sessions begun after the first one.
    pub reconnects: u64,
    /// etcd watches whose start revision had been compacted, Kubernetes watches or lists whose
    /// resource version expired (`410 Gone`); each forces a relist.
    pub compactions: u64,
    /// Periodic reconciling relists done (etcd, Kubernetes; file: full re-reads).
    pub relists: u64,
    /// Kubernetes objects (or watch lines) skipped as malformed or oversized.
    pub rejected_objects: u64,
    /// etcd: the last revision whose effects were applied (0 before the first listing).
    pub revision: i64,
    /// etcd: watch streams open now (one for the whole store, or one per queried namespace).
    pub watch_streams: u64,
    /// etcd: namespace query sets rebound (every query relisted and rewatched) on a live
    /// connection because one of their streams ended, erred or was compacted.
    pub rebinds: u64,
    /// Soft discovery errors: records left out while the rest stands (orphan adapters,
    /// invalid or ambiguous aliases, unreadable or doubly spelled keys).
    pub soft_errors: SoftErrorReport,
    /// The last transport error, as text.
    pub last_error: Option<String>,
}

/// Where a transport's outputs go: facts (required), event-channel changes and stats (optional;
/// without a receiver they are dropped).
///
/// Both output channels are bounded by their creator; a full channel makes the transport wait.
#[derive(Debug)]
pub struct DiscoverySink {
    facts: InputSender,
    channels: Option<mpsc::Sender<ChannelChange>>,
    stats: Option<watch::Sender<DiscoveryStats>>,
    namespaces: Option<watch::Receiver<NamespaceLimit>>,
}

/// A live narrowing of the scope's namespaces (see [`DiscoverySink::with_namespace_limit`]):
/// `None` leaves the scope alone, `Some(set)` keeps only those namespaces (none when empty).
pub type NamespaceLimit = Option<std::collections::BTreeSet<String>>;

/// Whether a delivery completed or the transport was cancelled while waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    Done,
    Cancelled,
}

impl DiscoverySink {
    /// A sink that sends facts to `facts` and drops channel changes and stats.
    #[must_use]
    pub fn new(facts: InputSender) -> Self {
        DiscoverySink { facts, channels: None, stats: None, namespaces: None }
    }

    /// Also send event-channel changes to `channels`.
    #[must_use]
    pub fn with_channels(mut self, channels: mpsc::Sender<ChannelChange>) -> Self {
        self.channels = Some(channels);
        self
    }

    /// Also publish [`DiscoveryStats`] to `stats` after every step.
    #[must_use]
    pub fn with_stats(mut self, stats: watch::Sender<DiscoveryStats>) -> Self {
        self.stats = Some(stats);
        self
    }

    /// Follow a live namespace narrowing (`--sources-file`): the transport applies every new
    /// value with a complete listing (file: the next poll; etcd: an immediate relist).
    #[must_use]
    pub fn with_namespace_limit(mut self, namespaces: watch::Receiver<NamespaceLimit>) -> Self {
        self.namespaces = Some(namespaces);
        self
    }

    /// The namespace narrowing if it differs from `current`.
    fn namespace_limit_change(
        &self,
        current: Option<&std::collections::BTreeSet<String>>,
    ) -> Option<NamespaceLimit> {
        let wanted = self.namespaces.as_ref()?.borrow();
        (wanted.as_ref() != current).then(|| wanted.clone())
    }

    /// Wait until the namespace narrowing changes (forever without one, or once its sender is
    /// gone).
    async fn namespace_limit_changed(namespaces: &mut Option<watch::Receiver<NamespaceLimit>>) {
        match namespaces {
            Some(receiver) => {
                if receiver.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }

    /// Send `outputs` in order, waiting for room; stop early on cancellation.
    async fn deliver(
        &self,
        outputs: Vec<DiscoveryOutput>,
        cancel: &CancellationToken,
    ) -> Result<Delivery, DiscoveryPlaneError> {
        for output in outputs {
            let sent = match output {
                DiscoveryOutput::Fact(fact) => {
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => return Ok(Delivery::Cancelled),
                        sent = self.facts.send(fact) => sent.is_ok(),
                    }
                }
                DiscoveryOutput::Channel(change) => match &self.channels {
                    None => true,
                    Some(channels) => tokio::select! {
                        biased;
                        () = cancel.cancelled() => return Ok(Delivery::Cancelled),
                        sent = channels.send(change) => sent.is_ok(),
                    },
                },
            };
            if !sent {
                return Err(DiscoveryPlaneError::SinkClosed);
            }
        }
        Ok(Delivery::Done)
    }

    fn publish_stats(&self, stats: &DiscoveryStats) {
        if let Some(sender) = &self.stats {
            sender.send_replace(stats.clone());
        }
    }
}

/// Exponential backoff: `initial`, doubling per failure, capped at `max`; no jitter (the relay
/// reconnects to one data center's own discovery plane, not to a shared fleet service).
#[derive(Debug, Clone)]
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max, next: initial }
    }

    /// The delay before the next attempt; doubles the one after it.
    fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        delay
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Sleep for `delay` unless cancelled first; true if cancelled.
async fn sleep_or_cancel(delay: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

/// Which discovery backend to run, with its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryBackend {
    /// The file-backed directory.
    File(FileDiscoveryConfig),
    /// etcd.
    Etcd(EtcdDiscoveryConfig),
    /// Kubernetes `DynamoWorkerMetadata` resources.
    Kubernetes(KubeDiscoveryConfig),
}

impl DiscoveryBackend {
    /// Set the period of the reconciling relist (`DYN_RELAY_DISCOVERY_RELIST_INTERVAL_MS`):
    /// etcd's and Kubernetes' reconcile interval, the file backend's full re-read.
    pub fn set_relist_interval(&mut self, interval: Duration) {
        match self {
            DiscoveryBackend::File(config) => config.relist_interval = interval,
            DiscoveryBackend::Etcd(config) => config.reconcile_interval = interval,
            DiscoveryBackend::Kubernetes(config) => config.reconcile_interval = interval,
        }
    }

    /// The period of the reconciling relist.
    #[must_use]
    pub fn relist_interval(&self) -> Duration {
        match self {
            DiscoveryBackend::File(config) => config.relist_interval,
            DiscoveryBackend::Etcd(config) => config.reconcile_interval,
            DiscoveryBackend::Kubernetes(config) => config.reconcile_interval,
        }
    }

    /// Read the backend the way Dynamo's runtime does, from the process environment:
    /// `DYN_DISCOVERY_BACKEND` (`etcd` when unset, `file`, `kubernetes`), `DYN_FILE_KV`,
    /// `ETCD_ENDPOINTS`, and the Kubernetes settings of [`KubeDiscoveryConfig::from_lookup`].
    pub fn from_env() -> Result<Self, DiscoveryPlaneError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`DiscoveryBackend::from_env`], with variables read through `lookup`.
    ///
    /// Values are trimmed; the backend name is case-insensitive. `ETCD_ENDPOINTS` defaults to
    /// [`ETCD_DEFAULT_ENDPOINT`]. Other backends (`mem`) are rejected.
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, DiscoveryPlaneError> {
        let setting = |name: &str| {
            lookup(name).map(|value| value.trim().to_owned()).filter(|value| !value.is_empty())
        };
        let backend = setting(DISCOVERY_BACKEND_ENV).unwrap_or_else(|| "etcd".to_owned());
        match backend.to_ascii_lowercase().as_str() {
            "file" => {
                let root = setting(FILE_KV_ENV).ok_or(DiscoveryPlaneError::MissingSetting {
                    variable: FILE_KV_ENV,
                    backend: "file",
                })?;
                Ok(DiscoveryBackend::File(FileDiscoveryConfig::new(root)))
            }
            "etcd" => {
                let endpoints = setting(ETCD_ENDPOINTS_ENV)
                    .unwrap_or_else(|| ETCD_DEFAULT_ENDPOINT.to_owned())
                    .split(',')
                    .map(str::trim)
                    .filter(|endpoint| !endpoint.is_empty())
                    .map(str::to_owned)
                    .collect();
                let mut config = EtcdDiscoveryConfig::new(endpoints);
                config.connect.security = EtcdSecurity::from_lookup(setting)?;
                config.validate()?;
                Ok(DiscoveryBackend::Etcd(config))
            }
            "kubernetes" => {
                Ok(DiscoveryBackend::Kubernetes(KubeDiscoveryConfig::from_env_lookup(setting)?))
            }
            _ => Err(DiscoveryPlaneError::UnsupportedBackend { name: backend }),
        }
    }
}

/// Run the configured backend until `cancel` fires (`Ok(())`) or the sink closes.
///
/// `clock` is the wall clock the file backend measures file ages against; etcd does not need it.
pub async fn run_discovery(
    backend: DiscoveryBackend,
    scope: DiscoveryScope,
    sink: DiscoverySink,
    clock: std::sync::Arc<dyn WallClock>,
    cancel: CancellationToken,
) -> Result<(), DiscoveryPlaneError> {
    match backend {
        DiscoveryBackend::File(config) => {
            run_file_discovery(config, scope, sink, clock, cancel).await
        }
        DiscoveryBackend::Etcd(config) => run_etcd_discovery(config, scope, sink, cancel).await,
        DiscoveryBackend::Kubernetes(config) => {
            run_kube_discovery(config, scope, sink, cancel).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> =
            pairs.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect();
        move |name| pairs.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone())
    }

    #[test]
    fn backend_is_read_from_dynamo_environment_variables() {
        let file = DiscoveryBackend::from_lookup(lookup(&[
            ("DYN_DISCOVERY_BACKEND", "file"),
            ("DYN_FILE_KV", " /tmp/dynlive/kvstore "),
        ]))
        .unwrap();
        assert_eq!(file, DiscoveryBackend::File(FileDiscoveryConfig::new("/tmp/dynlive/kvstore")));

        let etcd = DiscoveryBackend::from_lookup(lookup(&[
            ("DYN_DISCOVERY_BACKEND", "ETCD"),
            ("ETCD_ENDPOINTS", "http://127.0.0.1:2379, 127.0.0.1:2479"),
        ]))
        .unwrap();
        let DiscoveryBackend::Etcd(config) = etcd else { panic!("not etcd") };
        assert_eq!(config.endpoints, vec!["http://127.0.0.1:2379", "127.0.0.1:2479"]);

        let default = DiscoveryBackend::from_lookup(lookup(&[])).unwrap();
        let DiscoveryBackend::Etcd(config) = default else { panic!("not etcd") };
        assert_eq!(config.endpoints, vec![ETCD_DEFAULT_ENDPOINT]);
    }

    #[test]
    fn unusable_backend_settings_are_typed_errors() {
        assert!(matches!(
            DiscoveryBackend::from_lookup(lookup(&[("DYN_DISCOVERY_BACKEND", "file")])),
            Err(DiscoveryPlaneError::MissingSetting { variable: "DYN_FILE_KV", .. })
        ));
        assert!(matches!(
            DiscoveryBackend::from_lookup(lookup(&[("DYN_DISCOVERY_BACKEND", "mem")])),
            Err(DiscoveryPlaneError::UnsupportedBackend { .. })
        ));
        assert!(matches!(
            DiscoveryBackend::from_lookup(lookup(&[("DYN_DISCOVERY_BACKEND", "kubernetes")])),
            Err(DiscoveryPlaneError::MissingSetting { variable: "KUBERNETES_SERVICE_HOST", .. })
        ));
        let kube = DiscoveryBackend::from_lookup(lookup(&[
            ("DYN_DISCOVERY_BACKEND", "kubernetes"),
            ("KVRELAY_KUBE_API_URL", "http://127.0.0.1:8001"),
            ("POD_NAMESPACE", "dynamo"),
        ]))
        .unwrap();
        let DiscoveryBackend::Kubernetes(config) = kube else { panic!("not kubernetes") };
        assert_eq!(
            (config.api.api_url.as_str(), config.namespace.as_str()),
            ("http://127.0.0.1:8001", "dynamo")
        );
        assert!(matches!(
            DiscoveryBackend::from_lookup(lookup(&[("ETCD_ENDPOINTS", "https://127.0.0.1:2379")])),
            Err(DiscoveryPlaneError::InvalidEtcdEndpoint { .. })
        ));
        assert!(matches!(
            DiscoveryBackend::from_lookup(lookup(&[("ETCD_ENDPOINTS", " , ")])),
            Err(DiscoveryPlaneError::InvalidConfig { field: "endpoints", .. })
        ));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let delays: Vec<u128> = (0..8).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }

    #[tokio::test]
    async fn delivery_stops_on_a_closed_receiver_and_on_cancellation() {
        let (facts, receiver) =
            crate::node::input_queue(1, crate::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        let sink = DiscoverySink::new(facts);
        let cancel = CancellationToken::new();
        let fact = || {
            DiscoveryOutput::Fact(kvrelay_core::inputs::DcInput::CardsListed { cards: Vec::new() })
        };
        // The channel holds one fact; the second send waits until cancelled.
        let waiting = sink.deliver(vec![fact(), fact()], &cancel);
        cancel.cancel();
        assert_eq!(waiting.await.unwrap(), Delivery::Cancelled);
        drop(receiver);
        let open = CancellationToken::new();
        assert!(matches!(
            sink.deliver(vec![fact()], &open).await,
            Err(DiscoveryPlaneError::SinkClosed)
        ));
    }
}
