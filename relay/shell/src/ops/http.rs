//! The HTTP shell of the operations surface: routing only (see the module docs of `ops`).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use super::health::{engine_state, health, readiness};
use super::metrics::{METRICS_CONTENT_TYPE, render_metrics};
use super::snapshot::OpsSnapshot;

/// Prometheus metrics.
pub const METRICS_PATH: &str = "/metrics";
/// Health (`200` healthy, `503` not).
pub const HEALTH_PATH: &str = "/health";
/// Liveness: `200` while the process serves HTTP.
pub const LIVE_PATH: &str = "/live";
/// Readiness (`200` ready, `503` not).
pub const READY_PATH: &str = "/ready";
/// Dynamo's engine-state document.
pub const ENGINE_STATE_PATH: &str = "/engine/state";
/// Every path the operations listener serves.
pub const OPS_PATHS: [&str; 5] =
    [METRICS_PATH, HEALTH_PATH, LIVE_PATH, READY_PATH, ENGINE_STATE_PATH];

/// Where each request reads the relay's current state from.
pub type SnapshotSource = Arc<dyn Fn() -> OpsSnapshot + Send + Sync>;

/// Serve the operations endpoints on `listener` until `shutdown` resolves.
pub async fn serve_ops(
    listener: TcpListener,
    source: SnapshotSource,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(METRICS_PATH, get(metrics_page))
        .route(HEALTH_PATH, get(health_page))
        .route(LIVE_PATH, get(live_page))
        .route(READY_PATH, get(ready_page))
        .route(ENGINE_STATE_PATH, get(engine_state_page))
        .with_state(source);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response {
    let text = serde_json::to_string(body).unwrap_or_else(|_| "{}".to_owned());
    (status, [(header::CONTENT_TYPE, "application/json")], text).into_response()
}

fn status_for(ok: bool) -> StatusCode {
    if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}

async fn metrics_page(State(source): State<SnapshotSource>) -> Response {
    let text = render_metrics(&source());
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response()
}

async fn health_page(State(source): State<SnapshotSource>) -> Response {
    let report = health(&source());
    json_response(status_for(report.healthy), &report)
}

async fn live_page() -> Response {
    json_response(StatusCode::OK, &serde_json::json!({ "status": "live" }))
}

async fn ready_page(State(source): State<SnapshotSource>) -> Response {
    let report = readiness(&source());
    json_response(status_for(report.ready), &report)
}

async fn engine_state_page(State(source): State<SnapshotSource>) -> Response {
    json_response(StatusCode::OK, &engine_state(&source()))
}
