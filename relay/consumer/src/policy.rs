//! What the consumer does when one of its streams ends (relay-facts §3.5, §3.9), as a pure table.
//!
//! Every stream end is classified into a [`StreamEnd`]; [`reaction`] maps it, per [`Plane`], onto
//! one [`Reaction`]. The async shell only carries the reaction out. The table:
//!
//! | end | catalog / readiness / load | filter (one pool) |
//! | --- | --- | --- |
//! | CONTRACT_MISMATCH, or a response that is not v1 | halt the consumer | halt the consumer |
//! | INVALID_REQUEST / INVALID_ARGUMENT | stop this plane (nothing to fix by retrying) | await a new producer |
//! | UNSUPPORTED_FEATURE | stop this plane | await a new producer (pool quarantined) |
//! | POOL_NOT_FOUND, PRODUCER_CHANGED, bare NOT_FOUND / FAILED_PRECONDITION | retry with backoff (bare FAILED_PRECONDITION: stop) | await the catalog |
//! | INVALID_PUBLICATION | retry with backoff | await a new producer (fenced generation) |
//! | SUBSCRIBER_LAGGED | reopen from scratch | reopen from scratch |
//! | UNIMPLEMENTED | stop this plane | await a new producer |
//! | anything else (RESOURCE_LIMIT, SNAPSHOT_PROGRESS_TIMEOUT, PUBLICATION_UNAVAILABLE, INTERNAL, transport errors, clean end of stream, idle timeout, a frame the replica or stream guard rejected) | retry with backoff | retry with backoff |
//!
//! "Await the catalog" waits for the next catalog message (the catalog stream is the refresh)
//! or the backoff ceiling, whichever comes first, and then reopens if the catalog still
//! advertises the producer. "Await a new producer" never retries the same producer: the task
//! parks until the catalog replaces or withdraws it.

use std::fmt;

use tonic::Code;

use kvrelay_core::wire::RelayErrorReason;

/// One of the consumer's independent planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Plane {
    /// `WatchKvPoolCatalog`.
    Catalog,
    /// `SubscribeKvPool` (one stream per pool).
    Filter,
    /// `SubscribeServingReadiness`.
    Readiness,
    /// `SubscribeKvPoolLoad`.
    Load,
}

impl Plane {
    /// Lowercase name for diagnostics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Plane::Catalog => "catalog",
            Plane::Filter => "filter",
            Plane::Readiness => "readiness",
            Plane::Load => "load",
        }
    }
}

impl fmt::Display for Plane {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// Why a stream ended (or why a message on it was rejected), as counted in the consumer's
/// fault counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// The relay answered with a status carrying a trusted reason.
    Reason(RelayErrorReason),
    /// A status without a trusted reason: the gRPC code number (transport errors land here).
    Code(i32),
    /// The stream ended cleanly, which the contract never does on purpose.
    StreamEnded,
    /// Nothing arrived within the plane's idle timeout.
    IdleTimeout,
    /// A response was not the v1 contract (marker or protocol version).
    ContractMismatch,
    /// A catalog, readiness or load message failed validation; the plane's view was emptied.
    InvalidMessage,
    /// A filter frame failed its envelope checks or named another producer or relay.
    StreamGuard,
    /// The filter replica rejected a frame (CBI1, sequence or assembly fault).
    Replica,
}

impl fmt::Display for FaultKind {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::Reason(reason) => formatter.write_str(reason.wire_name()),
            FaultKind::Code(code) => write!(formatter, "{:?}", Code::from_i32(*code)),
            FaultKind::StreamEnded => formatter.write_str("stream-ended"),
            FaultKind::IdleTimeout => formatter.write_str("idle-timeout"),
            FaultKind::ContractMismatch => formatter.write_str("contract-mismatch"),
            FaultKind::InvalidMessage => formatter.write_str("invalid-message"),
            FaultKind::StreamGuard => formatter.write_str("stream-guard"),
            FaultKind::Replica => formatter.write_str("replica"),
        }
    }
}

/// How a stream ended, as far as the reaction is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// A fault ended the stream (or prevented it from opening).
    Fault(FaultKind),
    /// The pool task found its producer superseded in the consumer's own catalog view (the
    /// catalog task is already stopping it); not a fault.
    Superseded,
}

/// The relay error reason a received status carries, if it can be trusted (see
/// [`RelayErrorReason::from_trailer`]).
#[must_use]
pub fn reason_from_status(status: &tonic::Status) -> Option<RelayErrorReason> {
    let trailer = status.metadata().get(kvrelay_proto::ERROR_REASON_METADATA_KEY);
    RelayErrorReason::from_trailer(
        status.code() as i32,
        trailer.and_then(|value| value.to_str().ok()),
    )
}

impl StreamEnd {
    /// The end of a stream that failed with `status`: its reason if trusted, else its code.
    #[must_use]
    pub fn from_status(status: &tonic::Status) -> Self {
        let kind = match reason_from_status(status) {
            Some(reason) => FaultKind::Reason(reason),
            None => FaultKind::Code(status.code() as i32),
        };
        StreamEnd::Fault(kind)
    }

    /// The fault to count, if any.
    #[must_use]
    pub fn fault(self) -> Option<FaultKind> {
        match self {
            StreamEnd::Fault(kind) => Some(kind),
            StreamEnd::Superseded => None,
        }
    }
}

/// What to do after a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaction {
    /// Sleep the next backoff delay, then reopen.
    Retry,
    /// Reset the backoff ladder, sleep its first delay, then reopen from a full snapshot.
    Reopen,
    /// Filter only: wait for the next catalog message (or the backoff ceiling), then reopen.
    AwaitCatalog,
    /// Filter only: never retry this producer; wait until the catalog replaces or withdraws it.
    AwaitNewProducer,
    /// Stop this plane: retrying cannot help (the consumer keeps its other planes).
    StopPlane,
    /// Stop the whole consumer: the relay does not speak this contract.
    Halt,
}

/// The reaction of `plane` to `end`; see the module table.
#[must_use]
pub fn reaction(plane: Plane, end: StreamEnd) -> Reaction {
    let filter = plane == Plane::Filter;
    // What a plane does with a fault that only a new producer (or an upgrade) can cure.
    let hopeless = if filter { Reaction::AwaitNewProducer } else { Reaction::StopPlane };
    let kind = match end {
        StreamEnd::Superseded => return Reaction::AwaitNewProducer,
        StreamEnd::Fault(kind) => kind,
    };
    match kind {
        FaultKind::ContractMismatch | FaultKind::Reason(RelayErrorReason::ContractMismatch) => {
            Reaction::Halt
        }
        FaultKind::Reason(RelayErrorReason::InvalidRequest)
        | FaultKind::Reason(RelayErrorReason::UnsupportedFeature) => hopeless,
        FaultKind::Reason(RelayErrorReason::PoolNotFound)
        | FaultKind::Reason(RelayErrorReason::ProducerChanged)
            if filter =>
        {
            Reaction::AwaitCatalog
        }
        FaultKind::Reason(RelayErrorReason::InvalidPublication) if filter => {
            Reaction::AwaitNewProducer
        }
        FaultKind::Reason(RelayErrorReason::SubscriberLagged) => Reaction::Reopen,
        FaultKind::Code(code) => match Code::from_i32(code) {
            Code::InvalidArgument | Code::Unimplemented => hopeless,
            // Without a reason FAILED_PRECONDITION may be skew or a stale producer: a pool
            // waits for the catalog, a plane without a producer has nothing to refresh.
            Code::FailedPrecondition if filter => Reaction::AwaitCatalog,
            Code::FailedPrecondition => Reaction::StopPlane,
            Code::NotFound if filter => Reaction::AwaitCatalog,
            _ => Reaction::Retry,
        },
        _ => Reaction::Retry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(reason: RelayErrorReason) -> StreamEnd {
        StreamEnd::Fault(FaultKind::Reason(reason))
    }

    #[test]
    fn contract_mismatch_halts_every_plane() {
        for plane in [Plane::Catalog, Plane::Filter, Plane::Readiness, Plane::Load] {
            assert_eq!(reaction(plane, reason(RelayErrorReason::ContractMismatch)), Reaction::Halt);
            assert_eq!(
                reaction(plane, StreamEnd::Fault(FaultKind::ContractMismatch)),
                Reaction::Halt
            );
        }
    }

    #[test]
    fn pool_reasons_follow_the_contract_table() {
        let table = [
            (RelayErrorReason::InvalidRequest, Reaction::AwaitNewProducer),
            (RelayErrorReason::UnsupportedFeature, Reaction::AwaitNewProducer),
            (RelayErrorReason::PoolNotFound, Reaction::AwaitCatalog),
            (RelayErrorReason::ProducerChanged, Reaction::AwaitCatalog),
            (RelayErrorReason::ResourceLimit, Reaction::Retry),
            (RelayErrorReason::SubscriberLagged, Reaction::Reopen),
            (RelayErrorReason::SnapshotProgressTimeout, Reaction::Retry),
            (RelayErrorReason::PublicationUnavailable, Reaction::Retry),
            (RelayErrorReason::InvalidPublication, Reaction::AwaitNewProducer),
            (RelayErrorReason::Internal, Reaction::Retry),
        ];
        for (relay_reason, expected) in table {
            assert_eq!(reaction(Plane::Filter, reason(relay_reason)), expected, "{relay_reason:?}");
        }
    }

    #[test]
    fn planes_without_a_producer_retry_or_stop() {
        for plane in [Plane::Catalog, Plane::Readiness, Plane::Load] {
            assert_eq!(reaction(plane, reason(RelayErrorReason::ResourceLimit)), Reaction::Retry);
            assert_eq!(
                reaction(plane, reason(RelayErrorReason::SubscriberLagged)),
                Reaction::Reopen
            );
            assert_eq!(
                reaction(plane, reason(RelayErrorReason::InvalidRequest)),
                Reaction::StopPlane
            );
            assert_eq!(
                reaction(plane, reason(RelayErrorReason::PublicationUnavailable)),
                Reaction::Retry
            );
            assert_eq!(reaction(plane, StreamEnd::Fault(FaultKind::StreamEnded)), Reaction::Retry);
            assert_eq!(
                reaction(plane, StreamEnd::Fault(FaultKind::InvalidMessage)),
                Reaction::Retry
            );
        }
    }

    #[test]
    fn bare_codes_decide_when_no_reason_is_trusted() {
        let code = |code: Code| StreamEnd::Fault(FaultKind::Code(code as i32));
        assert_eq!(reaction(Plane::Filter, code(Code::Unavailable)), Reaction::Retry);
        assert_eq!(reaction(Plane::Filter, code(Code::NotFound)), Reaction::AwaitCatalog);
        assert_eq!(reaction(Plane::Filter, code(Code::FailedPrecondition)), Reaction::AwaitCatalog);
        assert_eq!(reaction(Plane::Catalog, code(Code::FailedPrecondition)), Reaction::StopPlane);
        assert_eq!(reaction(Plane::Load, code(Code::Unimplemented)), Reaction::StopPlane);
        assert_eq!(reaction(Plane::Readiness, code(Code::ResourceExhausted)), Reaction::Retry);
        assert_eq!(reaction(Plane::Catalog, code(Code::Unknown)), Reaction::Retry);
    }

    #[test]
    fn a_status_without_a_trusted_reason_is_counted_by_code() {
        let status = tonic::Status::unavailable("socket closed");
        assert_eq!(
            StreamEnd::from_status(&status),
            StreamEnd::Fault(FaultKind::Code(Code::Unavailable as i32))
        );
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert(
            kvrelay_proto::ERROR_REASON_METADATA_KEY,
            tonic::metadata::MetadataValue::from_static("RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"),
        );
        let relay = tonic::Status::with_metadata(Code::ResourceExhausted, "lagged", metadata);
        assert_eq!(StreamEnd::from_status(&relay), reason(RelayErrorReason::SubscriberLagged));
        assert_eq!(StreamEnd::Superseded.fault(), None);
        assert_eq!(reaction(Plane::Filter, StreamEnd::Superseded), Reaction::AwaitNewProducer);
    }
}
