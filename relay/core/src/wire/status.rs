//! Application error reasons and their gRPC status form (relay-facts §3.5).
//!
//! A relay error crosses the gRPC boundary as a plain gRPC status (not `google.rpc.Status`)
//! whose code follows the contract table, with the machine-readable reason in the ASCII trailing
//! metadata key `kv-relay-error-reason` as the exact enum name (for example
//! `RELAY_ERROR_REASON_PRODUCER_CHANGED`). Nothing about errors travels in the data streams, and
//! message text is not stable: clients act on the reason, or on the code alone when the reason
//! is absent, unknown or UNSPECIFIED.

use kvrelay_proto::v1 as proto;
use thiserror::Error;

/// The gRPC status codes the contract pairs with its reasons, with gRPC's numeric values (the
/// shell turns them into its transport's code type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(i32)]
pub enum StatusCode {
    /// `INVALID_ARGUMENT` (3).
    InvalidArgument = 3,
    /// `NOT_FOUND` (5).
    NotFound = 5,
    /// `RESOURCE_EXHAUSTED` (8).
    ResourceExhausted = 8,
    /// `FAILED_PRECONDITION` (9).
    FailedPrecondition = 9,
    /// `INTERNAL` (13).
    Internal = 13,
    /// `UNAVAILABLE` (14).
    Unavailable = 14,
}

/// A machine-readable reason for a failed RPC (`dynamo.kvrelay.v1.RelayErrorReason` without its
/// UNSPECIFIED value, which a relay never sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RelayErrorReason {
    /// The request is not the v1 contract (marker). Client: stop retrying; use a compatible
    /// major.
    ContractMismatch,
    /// The request is malformed. Client: fix the request.
    InvalidRequest,
    /// The request names something this relay does not support. Client: quarantine the pool;
    /// upgrade.
    UnsupportedFeature,
    /// No active pool matches. Client: refresh the catalog; subscribe only to advertised
    /// producers.
    PoolNotFound,
    /// The pool is active under another producer. Client: drop the old replica, refresh the
    /// catalog, subscribe to the current key.
    ProducerChanged,
    /// An admission limit was reached. Client: retry with bounded exponential backoff and
    /// jitter.
    ResourceLimit,
    /// The subscriber fell behind its bounded queue. Client: invalidate this stream's state;
    /// reopen from a full snapshot or window.
    SubscriberLagged,
    /// The subscriber stopped draining a snapshot. Client: discard the incomplete assembly;
    /// reopen with backoff.
    SnapshotProgressTimeout,
    /// The publication went away (retired, stopped). Client: invalidate; refresh the catalog
    /// for pool streams; reconnect with backoff.
    PublicationUnavailable,
    /// The producer generation was fenced. Client: invalidate the replica; refresh the
    /// catalog; do not retry the same generation.
    InvalidPublication,
    /// A relay bug. Client: invalidate; refresh; retry with backoff.
    Internal,
}

impl RelayErrorReason {
    /// Every reason, in wire value order.
    pub const ALL: [RelayErrorReason; 11] = [
        RelayErrorReason::ContractMismatch,
        RelayErrorReason::InvalidRequest,
        RelayErrorReason::UnsupportedFeature,
        RelayErrorReason::PoolNotFound,
        RelayErrorReason::ProducerChanged,
        RelayErrorReason::ResourceLimit,
        RelayErrorReason::SubscriberLagged,
        RelayErrorReason::SnapshotProgressTimeout,
        RelayErrorReason::PublicationUnavailable,
        RelayErrorReason::InvalidPublication,
        RelayErrorReason::Internal,
    ];

    /// The gRPC status code the contract pairs with this reason.
    #[must_use]
    pub fn code(self) -> StatusCode {
        match self {
            RelayErrorReason::ContractMismatch
            | RelayErrorReason::UnsupportedFeature
            | RelayErrorReason::ProducerChanged
            | RelayErrorReason::InvalidPublication => StatusCode::FailedPrecondition,
            RelayErrorReason::InvalidRequest => StatusCode::InvalidArgument,
            RelayErrorReason::PoolNotFound => StatusCode::NotFound,
            RelayErrorReason::ResourceLimit
            | RelayErrorReason::SubscriberLagged
            | RelayErrorReason::SnapshotProgressTimeout => StatusCode::ResourceExhausted,
            RelayErrorReason::PublicationUnavailable => StatusCode::Unavailable,
            RelayErrorReason::Internal => StatusCode::Internal,
        }
    }

    /// The generated protobuf enum value.
    #[must_use]
    pub fn to_proto(self) -> proto::RelayErrorReason {
        match self {
            RelayErrorReason::ContractMismatch => proto::RelayErrorReason::ContractMismatch,
            RelayErrorReason::InvalidRequest => proto::RelayErrorReason::InvalidRequest,
            RelayErrorReason::UnsupportedFeature => proto::RelayErrorReason::UnsupportedFeature,
            RelayErrorReason::PoolNotFound => proto::RelayErrorReason::PoolNotFound,
            RelayErrorReason::ProducerChanged => proto::RelayErrorReason::ProducerChanged,
            RelayErrorReason::ResourceLimit => proto::RelayErrorReason::ResourceLimit,
            RelayErrorReason::SubscriberLagged => proto::RelayErrorReason::SubscriberLagged,
            RelayErrorReason::SnapshotProgressTimeout => {
                proto::RelayErrorReason::SnapshotProgressTimeout
            }
            RelayErrorReason::PublicationUnavailable => {
                proto::RelayErrorReason::PublicationUnavailable
            }
            RelayErrorReason::InvalidPublication => proto::RelayErrorReason::InvalidPublication,
            RelayErrorReason::Internal => proto::RelayErrorReason::Internal,
        }
    }

    /// The reason for a protobuf enum value; `None` for UNSPECIFIED.
    #[must_use]
    pub fn from_proto(reason: proto::RelayErrorReason) -> Option<Self> {
        RelayErrorReason::ALL.into_iter().find(|candidate| candidate.to_proto() == reason)
    }

    /// The exact enum name carried in the trailer, e.g. `RELAY_ERROR_REASON_PRODUCER_CHANGED`.
    #[must_use]
    pub fn wire_name(self) -> &'static str {
        self.to_proto().as_str_name()
    }

    /// The reason named by a trailer value; `None` for UNSPECIFIED and unknown names.
    #[must_use]
    pub fn from_wire_name(name: &str) -> Option<Self> {
        proto::RelayErrorReason::from_str_name(name).and_then(RelayErrorReason::from_proto)
    }

    /// The reason carried by a received status, if it can be trusted: `code` is the status's
    /// gRPC code and `trailer` its `kv-relay-error-reason` value, if any.
    ///
    /// `None` when the trailer is absent, UNSPECIFIED or unknown — or when it names a reason
    /// whose contract code differs from the status code (something between the relay and the
    /// client rewrote the status). In every `None` case the client acts on the status code
    /// alone.
    #[must_use]
    pub fn from_trailer(code: i32, trailer: Option<&str>) -> Option<Self> {
        let reason = RelayErrorReason::from_wire_name(trailer?)?;
        (reason.code() as i32 == code).then_some(reason)
    }
}

/// A relay error ready to leave the service: a reason and a human-readable message.
///
/// The message is diagnostic only (not stable); it never echoes unbounded client input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{}: {message}", reason.wire_name())]
#[must_use = "a relay error must be returned to the client"]
pub struct RelayStatus {
    /// The machine-readable reason (decides the gRPC code).
    pub reason: RelayErrorReason,
    /// The status message.
    pub message: String,
}

/// Message of every contract-marker rejection (as the live relay words it).
pub const CONTRACT_MISMATCH_MESSAGE: &str = "unsupported Relay v1 wire contract";

impl RelayStatus {
    /// An error with `reason` and `message`.
    pub fn new(reason: RelayErrorReason, message: impl Into<String>) -> Self {
        RelayStatus { reason, message: message.into() }
    }

    /// The rejection of a request whose contract marker is not KVR1.
    pub fn contract_mismatch() -> Self {
        RelayStatus::new(RelayErrorReason::ContractMismatch, CONTRACT_MISMATCH_MESSAGE)
    }

    /// A malformed request.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        RelayStatus::new(RelayErrorReason::InvalidRequest, message)
    }

    /// A request naming something this relay does not support.
    pub fn unsupported_feature(message: impl Into<String>) -> Self {
        RelayStatus::new(RelayErrorReason::UnsupportedFeature, message)
    }

    /// The gRPC code of this error.
    #[must_use]
    pub fn code(&self) -> StatusCode {
        self.reason.code()
    }
}
