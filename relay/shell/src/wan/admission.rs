//! Admission of the streams outside the relay service: `grpc.health.v1.Health/Watch` and the
//! reflection streams each have their own limit, applied as a layer over every route.
//!
//! A stream past its limit is refused at once with RESOURCE_EXHAUSTED / RESOURCE_LIMIT (the
//! same answer the relay's own streams give) and counted; an admitted stream holds its slot
//! until its response body is dropped (the stream ended or was reset). `Check` and every relay
//! method pass through untouched.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http_body_util::BodyExt;
use kvrelay_core::wire::{RelayErrorReason, RelayStatus};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;

use super::counters::{WanCounters, bump_counter, drop_gauge};
use super::status::into_status;
use crate::config::ListenerLimits;

/// The health `Watch` method path.
pub const HEALTH_WATCH_PATH: &str = "/grpc.health.v1.Health/Watch";
/// Reflection method paths (v1 and v1alpha).
pub const REFLECTION_PATHS: [&str; 2] = [
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The limits, shared by every connection.
#[derive(Debug, Clone)]
pub(crate) struct StreamAdmission {
    health: Arc<Semaphore>,
    reflection: Arc<Semaphore>,
    counters: Arc<WanCounters>,
}

impl StreamAdmission {
    pub(crate) fn new(limits: &ListenerLimits, counters: Arc<WanCounters>) -> Self {
        StreamAdmission {
            health: Arc::new(Semaphore::new(limits.max_health_watch_streams)),
            reflection: Arc::new(Semaphore::new(limits.max_reflection_streams)),
            counters,
        }
    }
}

impl<S> tower::Layer<S> for StreamAdmission {
    type Service = Admitted<S>;

    fn layer(&self, inner: S) -> Admitted<S> {
        Admitted { inner, admission: self.clone() }
    }
}

/// A service whose health watch and reflection streams pass [`StreamAdmission`].
#[derive(Debug, Clone)]
pub(crate) struct Admitted<S> {
    inner: S,
    admission: StreamAdmission,
}

/// An admitted stream's slot and open-stream gauge, released on drop.
struct Slot {
    _permit: OwnedSemaphorePermit,
    counters: Arc<WanCounters>,
    open: fn(&WanCounters) -> &AtomicU64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        drop_gauge((self.open)(&self.counters));
    }
}

fn health_open(counters: &WanCounters) -> &AtomicU64 {
    &counters.listener.health_watch_open
}

fn reflection_open(counters: &WanCounters) -> &AtomicU64 {
    &counters.listener.reflection_open
}

impl<S, B> tower::Service<http::Request<B>> for Admitted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        type Open = fn(&WanCounters) -> &AtomicU64;
        let limited: Option<(&Arc<Semaphore>, &str, Open)> = if path == HEALTH_WATCH_PATH {
            Some((&self.admission.health, "health watch", health_open))
        } else if REFLECTION_PATHS.contains(&path) {
            Some((&self.admission.reflection, "reflection", reflection_open))
        } else {
            None
        };
        let Some((semaphore, what, open)) = limited else {
            return Box::pin(self.inner.call(request));
        };
        let counters = Arc::clone(&self.admission.counters);
        let Ok(permit) = Arc::clone(semaphore).try_acquire_owned() else {
            let rejected = if what == "reflection" {
                &counters.listener.reflection_rejected
            } else {
                &counters.listener.health_watch_rejected
            };
            bump_counter(rejected);
            let status = into_status(RelayStatus::new(
                RelayErrorReason::ResourceLimit,
                format!("Relay {what} stream limit reached"),
            ));
            return Box::pin(futures::future::ready(Ok(status.into_http::<Body>())));
        };
        open(&counters).fetch_add(1, Ordering::Relaxed);
        let slot = Slot { _permit: permit, counters, open };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(move |body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &slot;
                    frame
                }))
            }))
        })
    }
}
