//! The HTTP shell of the operations surface: routing only (see the module docs of `ops`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::warn;

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

/// Connections the operations listener serves at once; more are closed at once.
pub const OPS_CONNECTIONS_MAX: usize = 32;
/// A request's headers (or, on an idle connection, the next request's) must arrive within
/// this, or the connection is closed: a slow or silent client cannot hold a slot longer.
pub const OPS_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a failed accept.
pub const OPS_ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// After shutdown, connections still open this much later are dropped.
pub const OPS_DRAIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Serve the operations endpoints on `listener` until `shutdown` resolves, then drain the open
/// connections for at most [`OPS_DRAIN_TIMEOUT`]. HTTP/1 with at most
/// [`OPS_CONNECTIONS_MAX`] connections and the [`OPS_HEADER_READ_TIMEOUT`] header deadline.
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
    let slots = Arc::new(Semaphore::new(OPS_CONNECTIONS_MAX));
    let stop = CancellationToken::new();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let io = match accepted {
            Ok((io, _)) => io,
            Err(error) => {
                warn!(%error, "operations accept failed");
                tokio::time::sleep(OPS_ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            drop(io);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(OPS_HEADER_READ_TIMEOUT);
            let connection = builder.serve_connection(TokioIo::new(io), service);
            tokio::pin!(connection);
            tokio::select! {
                biased;
                _ = connection.as_mut() => return,
                () = stop.cancelled() => connection.as_mut().graceful_shutdown(),
            }
            let _ = connection.await;
        });
    }
    stop.cancel();
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(OPS_DRAIN_TIMEOUT, drained).await.is_err() {
        warn!("operations connections still open after the drain timeout; dropped");
        connections.abort_all();
    }
    Ok(())
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
