//! Serving the relay over any stream of connections (real TCP in production, the simulator's
//! network in tests), with reflection (v1, listing the relay and `grpc.health.v1.Health`) and
//! the standard health service ([`super::health`]).

use std::future::Future;

use futures::Stream;
use kvrelay_proto::v1::kv_event_relay_server::KvEventRelayServer;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::transport::Server;
use tonic::transport::server::Connected;

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
/// [`serve_with_health`]).
pub async fn serve<I, IO, IE>(
    service: RelayService,
    incoming: I,
    tuning: &WanTuning,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    I: Stream<Item = Result<IO, IE>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let always: ReadinessProbe = std::sync::Arc::new(|| true);
    serve_with_health(service, incoming, tuning, always, shutdown).await
}

/// [`serve`] with health answering from `ready`: SERVING while it holds, NOT_SERVING otherwise
/// and from the moment `shutdown` resolves (before any stream is closed).
pub async fn serve_with_health<I, IO, IE>(
    service: RelayService,
    incoming: I,
    tuning: &WanTuning,
    ready: ReadinessProbe,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    I: Stream<Item = Result<IO, IE>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let health = HealthService::new(ready);
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvrelay_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let streams = service.clone();
    let stopping = health.clone();
    let shutdown = async move {
        shutdown.await;
        stopping.begin_shutdown();
        // Open streams never end by themselves: close them so the graceful drain completes.
        streams.close_streams();
    };
    let relay = KvEventRelayServer::new(service)
        .max_decoding_message_size(tuning.max_message_bytes)
        .max_encoding_message_size(tuning.max_message_bytes);
    Server::builder()
        .http2_keepalive_interval(Some(tuning.keepalive_interval))
        .http2_keepalive_timeout(Some(tuning.keepalive_timeout))
        .add_service(health.into_server())
        .add_service(reflection)
        .add_service(relay)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
