//! The WAN service: `dynamo.kvrelay.v1.KvEventRelay` over tonic (relay-facts §3).
//!
//! The host publishes complete catalog, readiness and load updates through a [`WanPublisher`];
//! every stream reads the latest value and follows changes, so a slow client never holds the
//! host back. Pool streams come from the publication hubs. Each stream type has its own
//! admission limit (RESOURCE_EXHAUSTED / RESOURCE_LIMIT past it); every stream ends with a
//! `kv-relay-error-reason` trailer when it ends for a reason the client must act on.

mod channels;
mod counters;
mod health;
mod server;
mod service;
pub mod status;

pub use channels::{WanPublisher, WanViews, wan_channels};
pub use counters::{LimitScope, StreamType, WanStats};
pub use health::{HealthService, ReadinessProbe, WATCH_POLL_INTERVAL, WatchStream};
pub use server::{ServeError, serve, serve_with_health};
pub use service::{OpenStreams, RelayService};
