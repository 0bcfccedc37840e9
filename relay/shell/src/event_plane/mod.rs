//! Production event-plane transports: the NATS and ZMQ subscribers that carry Dynamo's
//! `kv-events` and `kv_metrics` messages into the relay (dc-inputs §2.1, §6; dynamo-live §9.2;
//! dynamo-planes-wire §B).
//!
//! Both transports are thin shells around the shared decoders of [`kvrelay_core::inputs`]: they receive
//! bytes, name the endpoint the bytes were published on (from the NATS subject, or from the ZMQ
//! event channel's scope), decode with [`decode_kv_event_batch`](kvrelay_core::inputs::decode_kv_event_batch)
//! / [`decode_load_observation`](kvrelay_core::inputs::decode_load_observation), and send the resulting
//! [`DcInput`](kvrelay_core::inputs::DcInput) into one bounded `tokio::sync::mpsc` sink.
//!
//! Invariants kept by both transports:
//!
//! - **Backpressure, not loss, at the sink.** Sending into the sink awaits free capacity, so a
//!   slow relay slows the subscriber down; loss only happens upstream, where each transport has
//!   its own stated bound (the NATS client's per-subscription queue, bounded in messages and
//!   bytes; the ZMQ publisher's high-water mark). Both are detectable downstream as `sequence`
//!   gaps.
//! - **No panic on any input.** Every message that cannot become a fact is counted in
//!   [`EventPlaneStats`] under its [`InputErrorKind`](kvrelay_core::inputs::InputErrorKind) and dropped.
//! - **Bounded before allocation.** The ZMQ transport speaks ZMTP itself ([`ZmtpSubDecoder`])
//!   so that every size a publisher declares is checked against the relay's limits before any
//!   memory is set aside for it.
//! - **Bounded retries.** Reconnection waits grow exponentially to a stated maximum and never
//!   spin; every wait also watches the cancellation token.
//! - **Prompt shutdown.** Every `tokio::select!` lists the cancellation token first (`biased;`),
//!   so cancelling stops a transport at its next await point, including a blocked sink send.

mod backlog;
mod counters;
mod nats;
mod nats_auth;
mod zmq;
mod zmtp;

use thiserror::Error;

pub use backlog::ENTRY_BYTES as BACKLOG_ENTRY_BYTES;
pub use counters::{EventPlaneCounters, EventPlaneStats, ZmtpErrorCounts};
pub use nats::{
    DEFAULT_NATS_SERVER, NATS_MAX_PAYLOAD_DEFAULT, NATS_RECONNECT_DELAY_MAX,
    NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT, NATS_SUBSCRIPTION_CAPACITY_DEFAULT,
    NATS_SUBSCRIPTION_CAPACITY_MIN, NatsEventPlaneConfig, NatsNamespaces,
    nats_subscription_capacity, nats_wildcard_subject, run_nats_event_plane,
};
pub use nats_auth::{
    NATS_AUTH_CREDENTIALS_FILE, NATS_AUTH_NKEY, NATS_AUTH_PASSWORD, NATS_AUTH_TOKEN,
    NATS_AUTH_USERNAME, NATS_SECURITY_FILE_BYTES_MAX, NATS_TLS_CA_CERT_PATH,
    NATS_TLS_CLIENT_CERT_PATH, NATS_TLS_CLIENT_KEY_PATH, NATS_TLS_INSECURE, NatsAuth, NatsSecurity,
    NatsSecurityError, NatsTls, Secret,
};
pub use zmq::{
    ChannelChange, ZMQ_CHANNELS_MAX, ZMQ_CONNECT_TIMEOUT_DEFAULT, ZMQ_RECONNECT_BACKOFF_INITIAL,
    ZMQ_RECONNECT_BACKOFF_MAX, ZmqEventPlaneConfig, run_zmq_event_plane,
};
pub use zmtp::{
    ZMTP_COMMAND_BYTES_MAX, ZMTP_FRAME_BYTES_MAX, ZMTP_GREETING_BYTES, ZMTP_MESSAGE_BYTES_MAX,
    ZMTP_MESSAGE_FRAMES_MAX, ZmtpError, ZmtpErrorKind, ZmtpEvent, ZmtpLimits, ZmtpSubDecoder,
    encode_command, encode_greeting, encode_message_frame, encode_pong, encode_ready,
    encode_subscribe,
};

/// Why an event-plane transport stopped or could not start.
#[derive(Debug, Error)]
pub enum EventPlaneError {
    /// A watched namespace cannot be turned into a subject segment.
    #[error("namespace {namespace:?} cannot be watched: {reason}")]
    InvalidNamespace {
        /// The namespace as configured.
        namespace: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration is inconsistent (e.g. a zero capacity).
    #[error("invalid event-plane configuration: {0}")]
    InvalidConfig(&'static str),
    /// The NATS client could not be created.
    #[error("cannot connect to NATS at {server}: {detail}")]
    NatsConnect {
        /// The server URL.
        server: String,
        /// The client's error.
        detail: String,
    },
    /// A NATS subscription could not be made.
    #[error("cannot subscribe to {subject}: {detail}")]
    NatsSubscribe {
        /// The subject.
        subject: String,
        /// The client's error.
        detail: String,
    },
    /// The NATS client closed every subscription (the client shut down for good).
    #[error("the NATS client closed its subscriptions")]
    SubscriptionsClosed,
    /// The NATS security settings cannot be applied.
    #[error("NATS security: {0}")]
    NatsSecurity(#[from] NatsSecurityError),
    /// The server refused the credentials or the TLS handshake failed before the first
    /// connection succeeded.
    #[error("NATS at {server} refused the connection: {reason} (check NATS_AUTH_* and NATS_TLS_*)")]
    NatsRefused {
        /// The server URL.
        server: String,
        /// The client's reason.
        reason: String,
    },
    /// The relay dropped the receiving end of the sink.
    #[error("the relay's input sink is closed")]
    SinkClosed,
}
