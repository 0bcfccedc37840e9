//! The WAN service: `dynamo.kvrelay.v1.KvEventRelay` over tonic (relay-facts §3).
//!
//! The host publishes complete catalog, readiness and load updates through a [`WanPublisher`];
//! every stream reads the latest value and follows changes, so a slow client never holds the
//! host back. Pool streams come from the publication hubs. Each stream type has its own
//! admission limit (RESOURCE_EXHAUSTED / RESOURCE_LIMIT past it); every stream ends with a
//! `kv-relay-error-reason` trailer when it ends for a reason the client must act on.

mod admission;
mod channels;
mod counters;
mod frame_hold;
mod health;
mod listener;
mod outbound;
mod server;
mod service;
pub mod status;
mod tls;

pub use admission::{HEALTH_WATCH_PATH, REFLECTION_PATHS};
pub use channels::{WanPublisher, WanViews, wan_channels};
pub use counters::{LimitScope, ListenerStats, StreamType, WanStats};
pub use health::{HealthService, ReadinessProbe, WATCH_POLL_INTERVAL, WatchStream};
pub use listener::{ConnectionCloser, LimitedIo};
pub use outbound::SLOW_CONSUMER_GRACE;
pub use server::{
    LOCAL_ERROR_RESETS_MAX, PENDING_ACCEPT_RESETS_MAX, ServeError, serve, serve_with_health,
};
pub use service::{OpenStreams, RelayService};
pub use tls::{
    TLS_CERT_ENV, TLS_CLIENT_CA_ENV, TLS_HANDSHAKE_TIMEOUT, TLS_HANDSHAKES_MAX, TLS_KEY_ENV,
    TLS_RELOAD_INTERVAL_DEFAULT, TLS_RELOAD_INTERVAL_ENV, WanTls, WanTlsError, WanTlsSettings,
    WanTlsStats, WanTlsValues, resolve_wan_tls, tls_incoming, validate_wan_tls,
};
