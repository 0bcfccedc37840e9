//! The operations surface of `kvrelay serve`: Prometheus `/metrics`, `/health`, `/live`,
//! `/ready` and `/engine/state` over plain HTTP/1.1 on a port of its own (loopback by default,
//! `--ops-bind` / `DYN_RELAY_OPS_BIND`).
//!
//! The HTTP shell ([`serve_ops`]) only routes: each request takes one [`OpsSnapshot`] from the
//! running relay and hands it to a pure renderer ([`render_metrics`], [`health`],
//! [`readiness`], [`engine_state`]), which the unit tests check without a socket.

mod health;
mod http;
mod metrics;
mod snapshot;

#[cfg(test)]
mod dashboard_tests;
#[cfg(test)]
mod tests;

pub use health::{
    EngineState, HealthReport, ReadinessReport, engine_state, health, readiness, sources,
};
pub use http::{
    ENGINE_STATE_PATH, HEALTH_PATH, LIVE_PATH, METRICS_PATH, OPS_PATHS, READY_PATH, SnapshotSource,
    serve_ops,
};
pub use metrics::{METRICS_CONTENT_TYPE, render_metrics};
pub use snapshot::{OpsSnapshot, RecordingSnapshot, SourcesSnapshot, TopologyCounts, WanSnapshot};
