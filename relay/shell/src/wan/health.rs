//! `grpc.health.v1.Health` for the WAN listener, answering from the relay's own readiness.
//!
//! Two service names are known: `""` (the server as a whole) and
//! [`kvrelay_proto::SERVICE_NAME`]; both report the same status, any other name is NOT_FOUND
//! (Check) as the health protocol asks.
//!
//! - While the listener runs, the status is SERVING exactly when the [`ReadinessProbe`] says
//!   ready, NOT_SERVING otherwise. `Check` asks the probe on every call; `Watch` sends the
//!   current status at once and then every change, read every [`WATCH_POLL_INTERVAL`].
//! - From the moment shutdown begins ([`HealthService::begin_shutdown`]) every answer is
//!   NOT_SERVING, and each open `Watch` stream sends NOT_SERVING (if it had not already) and
//!   ends, so the listener's graceful drain is never held open by a health watcher.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// How often an open `Watch` stream re-reads the probe.
pub const WATCH_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Whether the relay is ready to serve (the operations listener's `/ready` condition in
/// `kvrelay serve`; always true where there is no such condition).
pub type ReadinessProbe = Arc<dyn Fn() -> bool + Send + Sync>;

/// The health service of one WAN listener.
#[derive(Clone)]
pub struct HealthService {
    probe: ReadinessProbe,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for HealthService {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("HealthService")
            .field("shutting_down", &self.shutdown.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl HealthService {
    /// A service that answers from `probe` until [`HealthService::begin_shutdown`].
    #[must_use]
    pub fn new(probe: ReadinessProbe) -> Self {
        HealthService { probe, shutdown: CancellationToken::new() }
    }

    /// From now on every answer is NOT_SERVING and every `Watch` stream ends after saying so.
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    /// The status reported now.
    #[must_use]
    pub fn status(&self) -> ServingStatus {
        current(&self.probe, &self.shutdown)
    }

    /// The tonic service to add to a server.
    #[must_use]
    pub fn into_server(self) -> HealthServer<HealthService> {
        HealthServer::new(self)
    }
}

fn current(probe: &ReadinessProbe, shutdown: &CancellationToken) -> ServingStatus {
    if shutdown.is_cancelled() || !probe() {
        ServingStatus::NotServing
    } else {
        ServingStatus::Serving
    }
}

fn known(service: &str) -> bool {
    service.is_empty() || service == kvrelay_proto::SERVICE_NAME
}

fn response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse { status: status as i32 }
}

/// A `Watch` stream's position.
struct WatchState {
    probe: ReadinessProbe,
    shutdown: CancellationToken,
    last: Option<ServingStatus>,
    ended: bool,
}

/// The stream type `Watch` answers with.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

fn watch_stream(probe: ReadinessProbe, shutdown: CancellationToken) -> WatchStream {
    let start = WatchState { probe, shutdown, last: None, ended: false };
    Box::pin(futures::stream::unfold(start, |mut state| async move {
        loop {
            if state.ended {
                return None;
            }
            let stopping = state.shutdown.is_cancelled();
            let status = current(&state.probe, &state.shutdown);
            state.ended = stopping;
            if state.last != Some(status) {
                state.last = Some(status);
                return Some((Ok(response(status)), state));
            }
            if stopping {
                return None;
            }
            tokio::select! {
                biased;
                () = state.shutdown.cancelled() => {}
                () = tokio::time::sleep(WATCH_POLL_INTERVAL) => {}
            }
        }
    }))
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        if !known(&request.get_ref().service) {
            return Err(Status::not_found("service not registered"));
        }
        Ok(Response::new(response(self.status())))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        if !known(&request.get_ref().service) {
            return Err(Status::not_found("service not registered"));
        }
        Ok(Response::new(watch_stream(Arc::clone(&self.probe), self.shutdown.clone())))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use futures::StreamExt;

    use super::*;

    fn probe_of(flag: &Arc<AtomicBool>) -> ReadinessProbe {
        let flag = Arc::clone(flag);
        Arc::new(move || flag.load(Ordering::SeqCst))
    }

    fn request(service: &str) -> Request<HealthCheckRequest> {
        Request::new(HealthCheckRequest { service: service.to_owned() })
    }

    async fn next_status(stream: &mut WatchStream) -> Option<i32> {
        stream.next().await.map(|item| item.unwrap().status)
    }

    #[tokio::test(start_paused = true)]
    async fn check_follows_the_probe_and_says_not_serving_from_shutdown_on() {
        let ready = Arc::new(AtomicBool::new(false));
        let health = HealthService::new(probe_of(&ready));
        for service in ["", kvrelay_proto::SERVICE_NAME] {
            let answer = health.check(request(service)).await.unwrap().into_inner();
            assert_eq!(answer.status, ServingStatus::NotServing as i32, "{service:?}");
        }
        ready.store(true, Ordering::SeqCst);
        let answer = health.check(request("")).await.unwrap().into_inner();
        assert_eq!(answer.status, ServingStatus::Serving as i32);
        health.begin_shutdown();
        let answer = health.check(request(kvrelay_proto::SERVICE_NAME)).await.unwrap();
        assert_eq!(answer.into_inner().status, ServingStatus::NotServing as i32);
        let unknown = health.check(request("other.Service")).await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
    }

    #[tokio::test(start_paused = true)]
    async fn watch_sends_each_change_once_and_ends_at_shutdown() {
        let ready = Arc::new(AtomicBool::new(false));
        let health = HealthService::new(probe_of(&ready));
        let mut stream = health.watch(request("")).await.unwrap().into_inner();
        assert_eq!(next_status(&mut stream).await, Some(ServingStatus::NotServing as i32));
        ready.store(true, Ordering::SeqCst);
        assert_eq!(next_status(&mut stream).await, Some(ServingStatus::Serving as i32));
        ready.store(false, Ordering::SeqCst);
        assert_eq!(next_status(&mut stream).await, Some(ServingStatus::NotServing as i32));
        ready.store(true, Ordering::SeqCst);
        assert_eq!(next_status(&mut stream).await, Some(ServingStatus::Serving as i32));
        health.begin_shutdown();
        assert_eq!(next_status(&mut stream).await, Some(ServingStatus::NotServing as i32));
        assert_eq!(next_status(&mut stream).await, None, "the stream ends after shutdown");
        let unknown = health.watch(request("x")).await.err().unwrap();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
    }
}
