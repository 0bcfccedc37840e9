//! One point-in-time reading of everything the operations endpoints report. The HTTP shell
//! gathers it from the running relay's handles; the renderers ([`super::metrics`],
//! [`super::health`]) are pure functions of it.

use std::net::SocketAddr;

use serde::Serialize;

use crate::discovery_plane::DiscoveryStats;
use crate::event_plane::EventPlaneStats;
use crate::journal::RecorderStats;
use crate::node::{InputQueueStats, NodeStatus};
use crate::pool::PoolTotals;
use crate::publication::HubCounts;
use crate::request_plane::RequestPlaneStats;
use crate::serve::SourcesReport;
use crate::wan::{OpenStreams, WanStats, WanTlsStats};

/// Serving topology entries by readiness state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TopologyCounts {
    /// Entries in state UNKNOWN.
    pub unknown: usize,
    /// Entries in state UNAVAILABLE.
    pub unavailable: usize,
    /// Entries in state READY.
    pub ready: usize,
}

/// The WAN listener's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WanSnapshot {
    /// The bound address.
    pub bound_address: SocketAddr,
    /// The listener is accepting connections.
    pub serving: bool,
    /// Why the listener stopped, if it failed.
    pub last_error: Option<String>,
    /// Open streams per stream type.
    pub open_streams: OpenStreams,
    /// The service's counters.
    pub stats: WanStats,
    /// The TLS listener's counters (`None`: plaintext).
    pub tls: Option<WanTlsStats>,
}

/// The `--sources-file` state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcesSnapshot {
    /// The `/engine/state` view.
    pub report: SourcesReport,
    /// The guard variable's value, if set.
    pub connection_revision: Option<String>,
    /// Selections applied.
    pub reloads: u64,
    /// Refused reads (a refusal repeated by every poll counts once).
    pub refusals: u64,
}

/// The input journal (`--record`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordingSnapshot {
    /// The recorder started (false: it could not, and the relay serves without recording).
    pub active: bool,
    /// Its counters (zero when it did not start).
    pub stats: RecorderStats,
}

/// Everything the operations endpoints report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpsSnapshot {
    /// Shutdown has begun (SIGTERM / Ctrl-C).
    pub shutting_down: bool,
    /// The node's status.
    pub node: NodeStatus,
    /// The node's input queue (bytes queued against its budget).
    pub input_queue: InputQueueStats,
    /// The WAN listener, if `--bind` is set.
    pub wan: Option<WanSnapshot>,
    /// Pools in the published catalog.
    pub catalog_pool_count: usize,
    /// Serving topology entries by state.
    pub topology: TopologyCounts,
    /// Publication hubs by state.
    pub hubs: HubCounts,
    /// Ownership totals over the active pools (refreshed every second).
    pub pools: PoolTotals,
    /// The discovery transport's counters.
    pub discovery: DiscoveryStats,
    /// The event plane's name (`nats` or `zmq`).
    pub event_plane: &'static str,
    /// The event plane's counters.
    pub events: EventPlaneStats,
    /// The recovery client's counters.
    pub recovery: RequestPlaneStats,
    /// The sources file, in file mode.
    pub sources: Option<SourcesSnapshot>,
    /// The input journal, with `--record`.
    pub recording: Option<RecordingSnapshot>,
    /// `POD_UID`, if set.
    pub pod_uid: Option<String>,
    /// Distinct namespaces with a registered model in the serving topology (the discovery-mode
    /// source count).
    pub discovered_namespaces: usize,
}
