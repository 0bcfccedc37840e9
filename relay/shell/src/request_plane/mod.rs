//! The production request-plane transport: worker recovery queries over Dynamo 1.6.1's TCP
//! request plane (dc-inputs §3.3; dynamo-planes-wire §A).
//!
//! One query uses two TCP connections:
//!
//! 1. the relay's **pooled request connection** to the worker's request-plane server carries the
//!    request frame (endpoint path, JSON headers, a two-part payload of the JSON control message
//!    and the request body) and the worker's ACK;
//! 2. the worker **calls home** on a new connection to the relay's own response listener (named
//!    in the control message's `connection_info`), sends a handshake naming the query's subject,
//!    then the prologue, the answer item, the end marker and the sentinel; the relay closes it.
//!
//! Layers, pure to effectful: [`frame`] (bytes of frames), [`message`] (JSON / MessagePack
//! contents, mapping to [`RecoveryResponse`](kvrelay_core::sources::RecoveryResponse)), [`stream`] (the
//! response stream's order as a sans-IO machine), `answer_budget` (the byte budget answers share,
//! a sans-IO ledger and its rule that cannot deadlock), and the async [`RecoveryClient`].
//!
//! Invariants:
//!
//! - every query is bounded in time by its caller's timeout (a worker that accepts a request it
//!   cannot decode ACKs it and never calls home: only the timeout ends that query);
//! - every buffer is bounded before allocation: control frames by [`CONTROL_FRAME_BYTES_MAX`],
//!   ACK texts by [`ACK_TEXT_BYTES_MAX`], one response stream by
//!   [`RecoveryClientConfig::response_bytes_max`] (default [`RECOVERY_RESPONSE_BYTES_MAX`]), all
//!   answers being read at once together by [`RecoveryClientConfig::answers_bytes_max`] (default
//!   [`RECOVERY_ANSWERS_BYTES_MAX`]; a call waits within its timeout while its next reservation
//!   would leave too little for the answer holding the most, which never waits, so the budget
//!   cannot deadlock), and a large item's buffer grows only as its bytes arrive;
//! - the pending queries, pooled worker connections and concurrent call-home handshakes are
//!   bounded, with a typed error or a closed connection at each bound;
//! - no input panics: malformed bytes become a [`RecoveryError`].

pub mod answer;
mod answer_budget;
mod client;
pub mod frame;
pub mod message;
pub mod stream;

use std::time::Duration;

use thiserror::Error;

pub use client::{
    ACK_GRACE_AFTER_ANSWER, ACK_TEXT_BYTES_MAX, CALL_HOME_HANDSHAKE_TIMEOUT,
    CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX, CONTROL_FRAME_BYTES_MAX, PENDING_QUERIES_MAX, QueryPhase,
    RECOVERY_ANSWERS_BYTES_MAX, RECOVERY_RESPONSE_BYTES_MAX, RecoveryClient, RecoveryClientConfig,
    RequestPlaneStats, WORKER_CONNECTIONS_MAX,
};
pub use message::PayloadCodec;

/// Why a recovery query failed. Every variant is an answer the caller can act on: retry later,
/// retry elsewhere, or give up on recovery for the rank.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecoveryError {
    /// The target's transport is not Dynamo's TCP request plane.
    #[error("recovery target transport {0} is not supported (only tcp)")]
    UnsupportedTransport(String),
    /// The target's `host:port/path` address cannot be used.
    #[error("malformed recovery target address {address:?}: {reason}")]
    InvalidTarget {
        /// The address as advertised.
        address: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The client configuration is inconsistent.
    #[error("invalid request-plane configuration: {0}")]
    InvalidConfig(&'static str),
    /// The response listener could not be bound.
    #[error("cannot bind the response listener on {address}: {detail}")]
    Bind {
        /// The address.
        address: String,
        /// The OS error.
        detail: String,
    },
    /// A request part does not fit its length field or the worker's limit.
    #[error("{what} of {bytes} bytes exceeds {max}")]
    RequestTooLarge {
        /// Which part.
        what: &'static str,
        /// Its size.
        bytes: usize,
        /// The bound.
        max: usize,
    },
    /// The request body could not be encoded.
    #[error("cannot encode the request: {0}")]
    Encode(String),
    /// The worker's request-plane server could not be reached.
    #[error("cannot connect to worker {address}: {detail}")]
    Connect {
        /// `host:port`.
        address: String,
        /// The OS error.
        detail: String,
    },
    /// Reading or writing a connection failed.
    #[error("I/O error on the {connection} connection: {detail}")]
    Io {
        /// `request` or `call-home`.
        connection: &'static str,
        /// The OS error.
        detail: String,
    },
    /// The worker refused the request (a non-empty ACK, or a bare text answer such as
    /// `Server overloaded: ...`).
    #[error("worker refused the request: {message}")]
    Rejected {
        /// The worker's text.
        message: String,
    },
    /// The worker could not start the response stream (prologue with an error).
    #[error("worker failed to start the response stream: {message}")]
    StreamFailed {
        /// The worker's text.
        message: String,
    },
    /// The response stream ended before its logical end.
    #[error("response stream ended after {after}")]
    StreamEnded {
        /// How far it got.
        after: &'static str,
    },
    /// The stream completed without any answer item.
    #[error("response stream completed without an answer")]
    NoAnswer,
    /// The peer broke the framing or ordering rules.
    #[error("request-plane protocol violation: {0}")]
    Protocol(String),
    /// The response stream is larger than the configured bound.
    #[error("response stream exceeds {max} bytes")]
    ResponseTooLarge {
        /// The bound.
        max: usize,
    },
    /// The answer item could not be decoded.
    #[error("cannot decode the answer: {0}")]
    Decode(String),
    /// The answer is a variant this relay does not speak (e.g. `Status`).
    #[error("unsupported answer variant {0}")]
    UnsupportedResponse(String),
    /// The query did not complete within its timeout.
    #[error("query timed out after {timeout:?} while {phase}")]
    Timeout {
        /// The timeout.
        timeout: Duration,
        /// What it was waiting for.
        phase: QueryPhase,
    },
    /// Too many queries are waiting for a call-home at once.
    #[error("too many pending recovery queries")]
    TooManyPending,
    /// Too many workers have pooled connections in use at once.
    #[error("too many worker connections in use")]
    TooManyWorkers,
    /// The blocking decoder died (it panicked on a pool thread).
    #[error("the answer decoder did not complete")]
    DecoderLost,
    /// The client's listener stopped.
    #[error("the recovery client is shut down")]
    Closed,
}

impl From<RecoveryError> for kvrelay_core::sources::RecoveryFailure {
    /// Where in the query the error arose: not sent, unreachable, refused by the worker, an
    /// answer that could not be used, or out of time.
    fn from(error: RecoveryError) -> Self {
        use kvrelay_core::sources::RecoveryFailure as Failure;
        let text = error.to_string();
        match error {
            RecoveryError::UnsupportedTransport(_)
            | RecoveryError::InvalidTarget { .. }
            | RecoveryError::InvalidConfig(_)
            | RecoveryError::Bind { .. }
            | RecoveryError::RequestTooLarge { .. }
            | RecoveryError::Encode(_)
            | RecoveryError::TooManyPending
            | RecoveryError::TooManyWorkers
            | RecoveryError::Closed => Failure::NotSent(text),
            RecoveryError::Connect { .. }
            | RecoveryError::Io { .. }
            | RecoveryError::StreamEnded { .. } => Failure::Unreachable(text),
            RecoveryError::Rejected { message } | RecoveryError::StreamFailed { message } => {
                Failure::Refused(message)
            }
            RecoveryError::NoAnswer
            | RecoveryError::Protocol(_)
            | RecoveryError::ResponseTooLarge { .. }
            | RecoveryError::Decode(_)
            | RecoveryError::UnsupportedResponse(_)
            | RecoveryError::DecoderLost => Failure::InvalidAnswer(text),
            RecoveryError::Timeout { .. } => Failure::TimedOut,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::sources::RecoveryFailure;

    #[test]
    fn each_request_plane_error_names_where_the_query_failed() {
        let cases = [
            (RecoveryError::TooManyPending, "not sent"),
            (RecoveryError::InvalidConfig("x"), "not sent"),
            (
                RecoveryError::Connect { address: "a:1".into(), detail: "refused".into() },
                "unreachable",
            ),
            (RecoveryError::StreamEnded { after: "the prologue" }, "unreachable"),
            (RecoveryError::Rejected { message: "Server overloaded".into() }, "refused"),
            (RecoveryError::StreamFailed { message: "no such rank".into() }, "refused"),
            (RecoveryError::NoAnswer, "invalid answer"),
            (RecoveryError::ResponseTooLarge { max: 8 }, "invalid answer"),
            (
                RecoveryError::Timeout {
                    timeout: Duration::from_secs(1),
                    phase: QueryPhase::AwaitingCallHome,
                },
                "timed out",
            ),
        ];
        for (error, kind) in cases {
            let failure = RecoveryFailure::from(error.clone());
            let named = match &failure {
                RecoveryFailure::NotSent(_) => "not sent",
                RecoveryFailure::Unreachable(_) => "unreachable",
                RecoveryFailure::Refused(_) => "refused",
                RecoveryFailure::InvalidAnswer(_) => "invalid answer",
                RecoveryFailure::TimedOut => "timed out",
                RecoveryFailure::NoTransport => "no transport",
            };
            assert_eq!(named, kind, "{error}");
        }
        assert_eq!(
            RecoveryFailure::from(RecoveryError::Rejected { message: "Server overloaded".into() }),
            RecoveryFailure::Refused("Server overloaded".into()),
            "the worker's own words are kept"
        );
    }
}
