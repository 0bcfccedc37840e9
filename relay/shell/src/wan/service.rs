//! The `KvEventRelay` implementation: request validation, admission, and the five RPCs.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_server::KvEventRelay;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::channels::WanViews;
use super::counters::{LimitScope, StreamType, WanCounters, WanStats};
use super::listener::ConnectionCloser;
use super::outbound::{SendFailed, Subscriber, outbound};
use super::status::into_status;
use crate::config::WanTuning;
use crate::publication::{FrameKind, PoolPublications, PublicationError, StreamItem};
use crate::runtime::WallClock;
use kvrelay_core::model::identity::RelayIdentity;
use kvrelay_core::wire::encode;
use kvrelay_core::wire::{self, FilterEncoder, RelayErrorReason, RelayStatus};

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[derive(Debug)]
struct Limits {
    catalog: Arc<Semaphore>,
    pools: Arc<Semaphore>,
    readiness: Arc<Semaphore>,
    load: Arc<Semaphore>,
}

/// The relay's gRPC service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RelayService {
    relay: RelayIdentity,
    views: WanViews,
    publications: Arc<PoolPublications>,
    clock: Arc<dyn WallClock>,
    tuning: WanTuning,
    limits: Arc<Limits>,
    counters: Arc<WanCounters>,
    stop: CancellationToken,
}

impl RelayService {
    /// A service answering for `relay` from the host's `views` and the pools' `publications`.
    #[must_use]
    pub fn new(
        relay: RelayIdentity,
        views: WanViews,
        publications: Arc<PoolPublications>,
        clock: Arc<dyn WallClock>,
        tuning: WanTuning,
    ) -> Self {
        let limits = Limits {
            catalog: Arc::new(Semaphore::new(tuning.max_catalog_subscribers)),
            pools: Arc::new(Semaphore::new(tuning.max_pool_streams_total)),
            readiness: Arc::new(Semaphore::new(tuning.max_readiness_subscribers)),
            load: Arc::new(Semaphore::new(tuning.max_load_subscribers)),
        };
        RelayService {
            relay,
            views,
            publications,
            clock,
            tuning,
            limits: Arc::new(limits),
            counters: Arc::default(),
            stop: CancellationToken::new(),
        }
    }

    /// End every open stream with UNAVAILABLE / PUBLICATION_UNAVAILABLE (relay shutdown).
    pub fn close_streams(&self) {
        self.stop.cancel();
    }

    /// The service's counters so far.
    #[must_use]
    pub fn stats(&self) -> WanStats {
        self.counters.snapshot()
    }

    /// The live counters (shared with the listener layers).
    pub(crate) fn counters(&self) -> Arc<WanCounters> {
        Arc::clone(&self.counters)
    }

    /// A subscriber of `stream` type for `request`'s connection, holding `permit`.
    fn subscriber<T, R>(
        &self,
        stream: StreamType,
        permit: OwnedSemaphorePermit,
        request: &Request<R>,
    ) -> (Subscriber<T>, Streamed<T>)
    where
        T: Send + 'static,
    {
        let closer = request.extensions().get::<ConnectionCloser>().cloned();
        let (subscriber, stream) = outbound(stream, permit, closer, Arc::clone(&self.counters));
        (subscriber, Box::pin(stream))
    }

    /// Admit a stream of `stream` type under its total limit, counting a refusal.
    fn admit(&self, stream: StreamType) -> Result<OwnedSemaphorePermit, Status> {
        let (semaphore, what) = match stream {
            StreamType::Catalog => (&self.limits.catalog, "catalog"),
            StreamType::Pool => (&self.limits.pools, "total pool"),
            StreamType::Readiness => (&self.limits.readiness, "readiness"),
            StreamType::Load => (&self.limits.load, "load"),
        };
        Arc::clone(semaphore).try_acquire_owned().map_err(|_| {
            self.counters.limit_rejected(stream, LimitScope::Total);
            into_status(RelayStatus::new(
                RelayErrorReason::ResourceLimit,
                format!("Relay {what} stream limit reached"),
            ))
        })
    }

    /// The status ending or refusing a pool stream for `error`, counted.
    fn pool_status(counters: &WanCounters, error: PublicationError) -> Status {
        match error {
            PublicationError::SubscriberLagged => counters.lagged(StreamType::Pool),
            PublicationError::SubscriberLimit => {
                counters.limit_rejected(StreamType::Pool, LimitScope::PerPool);
            }
            PublicationError::InitializedHubLimit => {
                counters.limit_rejected(StreamType::Pool, LimitScope::InitializedHub);
            }
            PublicationError::Unavailable
            | PublicationError::SnapshotProgressTimeout
            | PublicationError::InvalidPublication
            | PublicationError::Internal => counters.terminal_publication_failure(),
            PublicationError::NotFound | PublicationError::ProducerChanged => {}
        }
        publication_status(error)
    }

    /// Streams admitted and not yet ended, per stream type (each holds one admission permit).
    #[must_use]
    pub fn open_streams(&self) -> OpenStreams {
        let open =
            |semaphore: &Semaphore, max: usize| max.saturating_sub(semaphore.available_permits());
        OpenStreams {
            catalog: open(&self.limits.catalog, self.tuning.max_catalog_subscribers),
            pool: open(&self.limits.pools, self.tuning.max_pool_streams_total),
            readiness: open(&self.limits.readiness, self.tuning.max_readiness_subscribers),
            load: open(&self.limits.load, self.tuning.max_load_subscribers),
        }
    }
}

/// Open WAN streams per type (`kv_dc_relay_subscribers{stream}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenStreams {
    /// `WatchKvPoolCatalog` streams.
    pub catalog: usize,
    /// `SubscribeKvPool` streams, across pools.
    pub pool: usize,
    /// `SubscribeServingReadiness` streams.
    pub readiness: usize,
    /// `SubscribeKvPoolLoad` streams.
    pub load: usize,
}

fn shutting_down() -> Status {
    unavailable("relay is shutting down")
}

/// The status that ends a pool stream or refuses a subscription.
fn publication_status(error: PublicationError) -> Status {
    let reason = match error {
        PublicationError::NotFound => RelayErrorReason::PoolNotFound,
        PublicationError::ProducerChanged => RelayErrorReason::ProducerChanged,
        PublicationError::Unavailable => RelayErrorReason::PublicationUnavailable,
        PublicationError::SubscriberLimit | PublicationError::InitializedHubLimit => {
            RelayErrorReason::ResourceLimit
        }
        PublicationError::SubscriberLagged => RelayErrorReason::SubscriberLagged,
        PublicationError::SnapshotProgressTimeout => RelayErrorReason::SnapshotProgressTimeout,
        PublicationError::InvalidPublication => RelayErrorReason::InvalidPublication,
        PublicationError::Internal => RelayErrorReason::Internal,
    };
    into_status(RelayStatus::new(reason, error.to_string()))
}

fn unavailable(message: &str) -> Status {
    into_status(RelayStatus::new(RelayErrorReason::PublicationUnavailable, message))
}

/// The status ending a slow consumer of `stream` type (counted as lagged).
fn slow_consumer(counters: &WanCounters, stream: StreamType) -> Status {
    counters.lagged(stream);
    into_status(RelayStatus::new(
        RelayErrorReason::SubscriberLagged,
        format!("{} stream: the client took no frame within the send deadline", stream.label()),
    ))
}

/// Follow a watched value: send it now, on every change, and again after `heartbeat` of quiet;
/// each send waits at most `deadline`.
fn follow_watch<T: Clone + Send + Sync + 'static>(
    mut updates: tokio::sync::watch::Receiver<Arc<T>>,
    heartbeat: std::time::Duration,
    deadline: std::time::Duration,
    subscriber: Subscriber<T>,
    stream: StreamType,
    counters: Arc<WanCounters>,
    stop: CancellationToken,
) {
    crate::runtime::spawn(async move {
        loop {
            let current = (**updates.borrow_and_update()).clone();
            match subscriber.send(current, deadline).await {
                Ok(()) => {}
                Err(SendFailed::Gone) => return,
                Err(SendFailed::Slow) => {
                    let status = slow_consumer(&counters, stream);
                    subscriber.end_slow(status).await;
                    return;
                }
            }
            let next_beat = Instant::now() + heartbeat;
            tokio::select! {
                biased;
                () = subscriber.closed() => return,
                () = stop.cancelled() => {
                    subscriber.finish(shutting_down());
                    return;
                }
                changed = updates.changed() => {
                    if changed.is_err() {
                        subscriber.finish(unavailable("relay is shutting down"));
                        return;
                    }
                }
                () = sleep_until(next_beat) => {}
            }
        }
    });
}

#[tonic::async_trait]
impl KvEventRelay for RelayService {
    async fn get_relay_info(
        &self,
        request: Request<proto::RelayInfoRequest>,
    ) -> Result<Response<proto::RelayInfo>, Status> {
        wire::validate_relay_info_request(request.get_ref()).map_err(into_status)?;
        Ok(Response::new(encode::relay_info(&self.relay)))
    }

    type WatchKvPoolCatalogStream = Streamed<proto::KvPoolCatalogUpdate>;

    async fn watch_kv_pool_catalog(
        &self,
        request: Request<proto::WatchKvPoolCatalogRequest>,
    ) -> Result<Response<Self::WatchKvPoolCatalogStream>, Status> {
        wire::validate_catalog_request(request.get_ref()).map_err(into_status)?;
        let permit = self.admit(StreamType::Catalog)?;
        let (subscriber, stream) = self.subscriber(StreamType::Catalog, permit, &request);
        follow_watch(
            self.views.catalog.clone(),
            self.tuning.catalog_heartbeat_interval,
            self.tuning.limits.subscriber_send_timeout,
            subscriber,
            StreamType::Catalog,
            self.counters(),
            self.stop.clone(),
        );
        Ok(Response::new(stream))
    }

    type SubscribeServingReadinessStream = Streamed<proto::ServingReadinessUpdate>;

    async fn subscribe_serving_readiness(
        &self,
        request: Request<proto::SubscribeServingReadinessRequest>,
    ) -> Result<Response<Self::SubscribeServingReadinessStream>, Status> {
        wire::validate_readiness_request(request.get_ref()).map_err(into_status)?;
        let permit = self.admit(StreamType::Readiness)?;
        let (subscriber, stream) = self.subscriber(StreamType::Readiness, permit, &request);
        follow_watch(
            self.views.readiness.clone(),
            self.tuning.readiness_heartbeat_interval,
            self.tuning.limits.subscriber_send_timeout,
            subscriber,
            StreamType::Readiness,
            self.counters(),
            self.stop.clone(),
        );
        Ok(Response::new(stream))
    }

    type SubscribeKvPoolLoadStream = Streamed<proto::KvPoolLoadUpdate>;

    async fn subscribe_kv_pool_load(
        &self,
        request: Request<proto::SubscribeKvPoolLoadRequest>,
    ) -> Result<Response<Self::SubscribeKvPoolLoadStream>, Status> {
        wire::validate_load_request(request.get_ref()).map_err(into_status)?;
        let permit = self.admit(StreamType::Load)?;
        let mut windows = self.views.load.subscribe();
        let current = Arc::clone(&self.views.load_current.borrow());
        let (subscriber, stream) = self.subscriber(StreamType::Load, permit, &request);
        let stop = self.stop.clone();
        let counters = Arc::clone(&self.counters);
        let deadline = self.tuning.limits.subscriber_send_timeout;
        crate::runtime::spawn(async move {
            let mut last = current.window_sequence;
            let mut next = Some((*current).clone());
            loop {
                if let Some(window) = next.take() {
                    match subscriber.send(window, deadline).await {
                        Ok(()) => {}
                        Err(SendFailed::Gone) => return,
                        Err(SendFailed::Slow) => {
                            let status = slow_consumer(&counters, StreamType::Load);
                            subscriber.end_slow(status).await;
                            return;
                        }
                    }
                }
                let received = tokio::select! {
                    biased;
                    () = subscriber.closed() => return,
                    () = stop.cancelled() => {
                        subscriber.finish(shutting_down());
                        return;
                    }
                    received = windows.recv() => received,
                };
                match received {
                    Ok(window) if window.window_sequence <= last => {}
                    Ok(window) => {
                        last = window.window_sequence;
                        counters.load_update();
                        next = Some((*window).clone());
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        counters.lagged(StreamType::Load);
                        subscriber.finish(into_status(RelayStatus::new(
                            RelayErrorReason::SubscriberLagged,
                            "load stream lagged",
                        )));
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        subscriber.finish(unavailable("load publisher stopped"));
                        return;
                    }
                }
            }
        });
        Ok(Response::new(stream))
    }

    type SubscribeKvPoolStream = Streamed<proto::FilterUpdate>;

    async fn subscribe_kv_pool(
        &self,
        request: Request<proto::SubscribeKvPoolRequest>,
    ) -> Result<Response<Self::SubscribeKvPoolStream>, Status> {
        let subscription = wire::validate_pool_request(request.get_ref()).map_err(into_status)?;
        let permit = self.admit(StreamType::Pool)?;
        let mut stream = self
            .publications
            .subscribe(&subscription.expected_producer)
            .await
            .map_err(|error| Self::pool_status(&self.counters, error))?;
        let encoder = FilterEncoder::new(&self.relay, &subscription.expected_producer);
        let clock = Arc::clone(&self.clock);
        let heartbeat = self.tuning.pool_heartbeat_interval;
        let (subscriber, outbound) = self.subscriber(StreamType::Pool, permit, &request);
        let stop = self.stop.clone();
        let counters = Arc::clone(&self.counters);
        let send_timeout = self.tuning.limits.subscriber_send_timeout;
        let snapshot_timeout = self.tuning.snapshot_progress_timeout;
        crate::runtime::spawn(async move {
            let mut next_heartbeat = Instant::now() + heartbeat;
            loop {
                let complete = stream.snapshot_complete();
                let item = tokio::select! {
                    biased;
                    () = subscriber.closed() => return,
                    () = stop.cancelled() => {
                        subscriber.finish(shutting_down());
                        return;
                    }
                    item = stream.next() => item,
                    () = sleep_until(next_heartbeat), if complete => {
                        let beat = encoder.heartbeat(stream.sequence(), clock.now_unix_us());
                        match subscriber.send(beat, send_timeout).await {
                            Ok(()) => {}
                            Err(SendFailed::Gone) => return,
                            Err(SendFailed::Slow) => {
                                let status =
                                    Self::pool_status(&counters, PublicationError::SubscriberLagged);
                                subscriber.end_slow(status).await;
                                return;
                            }
                        }
                        counters.pool_heartbeat();
                        next_heartbeat = Instant::now() + heartbeat;
                        continue;
                    }
                };
                let update = match item {
                    Ok(StreamItem::Frame(frame)) => {
                        let now_us = clock.now_unix_us();
                        match frame.kind {
                            FrameKind::SnapshotChunk => encoder.snapshot_chunk(
                                frame.sequence,
                                now_us,
                                frame.payload.clone(),
                            ),
                            FrameKind::Delta => encoder.delta(
                                frame.base_sequence,
                                frame.sequence,
                                now_us,
                                frame.payload.clone(),
                            ),
                        }
                    }
                    Err(error) => {
                        subscriber.finish(Self::pool_status(&counters, error));
                        return;
                    }
                };
                // A chunk the client does not take is a snapshot progress timeout; a frame
                // after the snapshot is lag.
                let (deadline, slow) = if complete {
                    (send_timeout, PublicationError::SubscriberLagged)
                } else {
                    (snapshot_timeout, PublicationError::SnapshotProgressTimeout)
                };
                match subscriber.send(update, deadline).await {
                    Ok(()) => {}
                    Err(SendFailed::Gone) => return,
                    Err(SendFailed::Slow) => {
                        subscriber.end_slow(Self::pool_status(&counters, slow)).await;
                        return;
                    }
                }
                next_heartbeat = Instant::now() + heartbeat;
            }
        });
        Ok(Response::new(outbound))
    }
}
