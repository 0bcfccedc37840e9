//! Serving the relay over any stream of connections (real TCP in production, the simulator's
//! network in tests), with reflection (v1, listing the relay and `grpc.health.v1.Health`) and
//! the standard health service ([`super::health`]).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::Stream;
use kvrelay_proto::v1::kv_event_relay_server::KvEventRelayServer;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::Connected;
use tracing::warn;

use super::admission::StreamAdmission;
use super::frame_hold::HoldLatestFrameLayer;
use super::listener::limited_incoming;

use super::health::{HealthService, ReadinessProbe};
use super::service::RelayService;
use crate::config::WanTuning;

/// The listener failed.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The transport failed.
    #[error("gRPC transport failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// Reflection could not be built from the descriptor set.
    #[error("gRPC reflection setup failed: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Serve `service` on `incoming` until `shutdown` resolves, then end every open stream with
/// UNAVAILABLE and drain the connections. Plaintext HTTP/2 with the configured keepalive and
/// message limits. `grpc.health.v1` reports `""` and the relay service as SERVING until
/// shutdown begins (there is no readiness condition here; `kvrelay serve` uses
/// [`serve_with_health`], which also states the listener's limits).
pub async fn serve<I, IO, IE>(
    service: RelayService,
    incoming: I,
    tuning: &WanTuning,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    I: Stream<Item = Result<IO, IE>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + std::fmt::Display,
{
    let always: ReadinessProbe = std::sync::Arc::new(|| true);
    serve_with_health(service, incoming, tuning, HealthService::new(always), shutdown).await
}

/// HTTP/2 resets of not-yet-accepted streams a connection may have pending (a reset flood
/// past it ends the connection with GOAWAY).
pub const PENDING_ACCEPT_RESETS_MAX: usize = 32;
/// Streams the relay may reset on one connection for the peer's protocol errors before the
/// connection is ended.
pub const LOCAL_ERROR_RESETS_MAX: usize = 256;

/// [`serve`] with `health` (SERVING while its probe holds, NOT_SERVING otherwise and from
/// [`HealthService::begin_shutdown`] on, which the caller may call before `shutdown`
/// resolves; `shutdown` calls it in any case, before any stream is closed).
///
/// The listener runs under `tuning.limits` ([`crate::config::ListenerLimits`]): connections
/// past the cap are closed at once, streams per connection, header lists and request messages
/// are bounded, accept errors are backed off, health `Watch` and reflection streams are
/// admitted under their own limits. When `shutdown` resolves, health turns NOT_SERVING (open
/// `Watch` streams say so and end), every relay stream ends with UNAVAILABLE, and the
/// connections drain; those still open `drain_timeout` later are closed, so this returns
/// within about that bound whatever the clients do.
pub async fn serve_with_health<I, IO, IE>(
    service: RelayService,
    incoming: I,
    tuning: &WanTuning,
    health: HealthService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    I: Stream<Item = Result<IO, IE>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + std::fmt::Display,
{
    let limits = tuning.limits;
    let counters = service.counters();
    let connections = CancellationToken::new();
    let incoming = limited_incoming(incoming, limits, Arc::clone(&counters), connections.clone());
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvrelay_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?
        .max_decoding_message_size(limits.max_request_bytes);
    let streams = service.clone();
    let stopping = health.clone();
    let drain = connections.clone();
    let drain_counters = Arc::clone(&counters);
    let shutdown = async move {
        shutdown.await;
        stopping.begin_shutdown();
        // Open streams never end by themselves: close them so the graceful drain completes.
        streams.close_streams();
        // Clients that read nothing keep their connections: close them after the drain bound.
        crate::runtime::spawn(async move {
            tokio::time::sleep(limits.drain_timeout).await;
            let open = drain_counters.listener.connections_open.load(Ordering::Relaxed);
            if open > 0 {
                drain_counters
                    .listener
                    .connections_aborted_at_shutdown
                    .fetch_add(open, Ordering::Relaxed);
                warn!(open, "WAN drain deadline reached; closing the remaining connections");
            }
            drain.cancel();
        });
    };
    let relay = KvEventRelayServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(tuning.max_message_bytes);
    let health = health.into_server().max_decoding_message_size(limits.max_request_bytes);
    let result = Server::builder()
        .layer(StreamAdmission::new(&limits, counters))
        .layer(HoldLatestFrameLayer)
        .http2_keepalive_interval(Some(tuning.keepalive_interval))
        .http2_keepalive_timeout(Some(tuning.keepalive_timeout))
        .max_concurrent_streams(limits.max_streams_per_connection)
        .http2_max_header_list_size(limits.max_header_list_bytes)
        .http2_max_pending_accept_reset_streams(Some(PENDING_ACCEPT_RESETS_MAX))
        .http2_max_local_error_reset_streams(Some(LOCAL_ERROR_RESETS_MAX))
        .add_service(health)
        .add_service(reflection)
        .add_service(relay)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    // Whatever ended the server, no connection outlives it.
    connections.cancel();
    result?;
    Ok(())
}
