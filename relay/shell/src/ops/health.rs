//! Health, readiness and engine state of an [`OpsSnapshot`]. Pure.
//!
//! - **Healthy** (relay-facts §13): not shutting down, the node healthy (no host error, no
//!   fenced endpoint, no control-plane invariant failure), and the WAN listener — when there is
//!   one — serving without error. `/health` answers 200 when healthy, else 503.
//! - **Ready**: healthy, and the inputs are live: the discovery transport applied a complete
//!   listing, the NATS event plane is connected (ZMQ connects per advertised channel, so it has
//!   no single connection to wait for), and in `--sources-file` mode a valid file was applied.
//!   `/ready` answers 200 when ready, else 503 with the reasons.
//! - **Engine state**: the `GET /engine/state` document Dynamo's relay serves: `podUID`
//!   (`POD_UID`), `mode` (`"from-file"` with `--sources-file`, else `"discovery"`), the
//!   connection revision, readiness and the `sources` object; beyond Dynamo's fields, the soft
//!   discovery errors holding now (`softDiscoveryErrors`: a bounded list of `{kind, key,
//!   reason}`, and `softDiscoveryErrorCount`).
//! - **Sources** (in both `/health` and `/engine/state`, the same object): in file mode the
//!   sources file's report (see `serve::sources_file`); in discovery mode both revisions and
//!   the error are `null` and `count` is the number of namespaces with a registered model.

use serde::Serialize;

use kvrelay_core::discovery::SoftDiscoveryError;

use super::snapshot::OpsSnapshot;
use crate::serve::SourcesReport;

/// The `/health` document (the field names of Dynamo's `KvDcRelayHealth`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HealthReport {
    /// `"healthy"` or `"unhealthy"`.
    pub status: &'static str,
    /// See the module docs.
    pub healthy: bool,
    /// Shutdown has begun.
    pub shutting_down: bool,
    /// The host's or control plane's last invariant failure.
    pub host_last_error: Option<String>,
    /// Endpoint slots.
    pub endpoint_count: usize,
    /// Slots with a published generation.
    pub active_endpoint_count: usize,
    /// Fenced slots.
    pub fenced_endpoint_count: usize,
    /// A WAN listener is configured.
    pub wan_enabled: bool,
    /// The WAN listener is serving.
    pub wan_serving: bool,
    /// The WAN listener's address.
    pub wan_bound_address: Option<String>,
    /// Why the WAN listener stopped.
    pub wan_last_error: Option<String>,
    /// The namespace sources, as `/engine/state` reports them.
    pub sources: SourcesReport,
}

/// The `/ready` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadinessReport {
    /// See the module docs.
    pub ready: bool,
    /// Why the relay is not ready (empty when ready).
    pub reasons: Vec<&'static str>,
}

/// The `/engine/state` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineState {
    /// `POD_UID`, or `null`.
    #[serde(rename = "podUID")]
    pub pod_uid: Option<String>,
    /// `"from-file"` with `--sources-file`, else `"discovery"`.
    pub mode: &'static str,
    /// The guard variable's value.
    pub connection_revision: Option<String>,
    /// Readiness as `/ready` reports it.
    pub ready: bool,
    /// The namespace sources (see the module docs).
    pub sources: SourcesReport,
    /// Soft discovery errors holding now: at most
    /// [`SOFT_ERRORS_LISTED`](crate::discovery_plane::SOFT_ERRORS_LISTED) of them, in
    /// `(kind, key)` order.
    pub soft_discovery_errors: Vec<SoftDiscoveryError>,
    /// How many soft discovery errors hold now, listed or not.
    pub soft_discovery_error_count: u64,
}

/// Health of `snapshot`.
#[must_use]
pub fn health(snapshot: &OpsSnapshot) -> HealthReport {
    let control = snapshot.node.control.as_ref();
    let host = control.map(|health| &health.host);
    let wan_failed =
        snapshot.wan.as_ref().is_some_and(|wan| !wan.serving || wan.last_error.is_some());
    let healthy =
        !snapshot.shutting_down && snapshot.node.healthy && !snapshot.node.stopped && !wan_failed;
    HealthReport {
        status: if healthy { "healthy" } else { "unhealthy" },
        healthy,
        shutting_down: snapshot.shutting_down,
        host_last_error: control.and_then(|health| {
            health.host.host_last_error.clone().or_else(|| health.control_last_error.clone())
        }),
        endpoint_count: host.map_or(0, |host| host.endpoint_count),
        active_endpoint_count: host.map_or(0, |host| host.active_endpoint_count),
        fenced_endpoint_count: host.map_or(0, |host| host.fenced_endpoint_count),
        wan_enabled: snapshot.wan.is_some(),
        wan_serving: snapshot.wan.as_ref().is_some_and(|wan| wan.serving),
        wan_bound_address: snapshot.wan.as_ref().map(|wan| wan.bound_address.to_string()),
        wan_last_error: snapshot.wan.as_ref().and_then(|wan| wan.last_error.clone()),
        sources: sources(snapshot),
    }
}

/// The `sources` object of `/health` and `/engine/state`.
#[must_use]
pub fn sources(snapshot: &OpsSnapshot) -> SourcesReport {
    match &snapshot.sources {
        Some(file) => file.report.clone(),
        None => SourcesReport { count: snapshot.discovered_namespaces, ..SourcesReport::default() },
    }
}

/// Readiness of `snapshot`.
#[must_use]
pub fn readiness(snapshot: &OpsSnapshot) -> ReadinessReport {
    let mut reasons = Vec::new();
    if snapshot.shutting_down {
        reasons.push("shutting down");
    }
    if !health(snapshot).healthy {
        reasons.push("unhealthy");
    }
    if snapshot.discovery.listings == 0 {
        reasons.push("discovery has not completed a listing");
    }
    if snapshot.event_plane == "nats" && snapshot.events.connects <= snapshot.events.disconnects {
        reasons.push("event plane not connected");
    }
    if let Some(sources) = &snapshot.sources
        && sources.report.applied_revision.is_none()
    {
        reasons.push("no valid sources file applied");
    }
    ReadinessReport { ready: reasons.is_empty(), reasons }
}

/// Engine state of `snapshot`.
#[must_use]
pub fn engine_state(snapshot: &OpsSnapshot) -> EngineState {
    EngineState {
        pod_uid: snapshot.pod_uid.clone(),
        mode: if snapshot.sources.is_some() { "from-file" } else { "discovery" },
        connection_revision: snapshot.sources.as_ref().and_then(|s| s.connection_revision.clone()),
        ready: readiness(snapshot).ready,
        sources: sources(snapshot),
        soft_discovery_errors: snapshot.discovery.soft_errors.listed.clone(),
        soft_discovery_error_count: snapshot.discovery.soft_errors.current_total,
    }
}
