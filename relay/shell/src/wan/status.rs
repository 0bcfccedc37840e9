//! A [`RelayStatus`] as the `tonic::Status` the contract sends: the reason's gRPC code, the
//! message, and the reason's exact enum name in the `kv-relay-error-reason` trailer.

use kvrelay_core::wire::RelayStatus;
use kvrelay_proto::ERROR_REASON_METADATA_KEY;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// The `tonic::Status` of a relay error (the reason travels as trailing metadata).
#[must_use]
pub fn into_status(status: RelayStatus) -> tonic::Status {
    let mut metadata = MetadataMap::new();
    // The key is a constant lowercase ASCII token and the value a generated enum name, so both
    // always parse; the fallible forms keep this path free of panics regardless.
    if let Ok(key) = MetadataKey::from_bytes(ERROR_REASON_METADATA_KEY.as_bytes()) {
        metadata.insert(key, MetadataValue::from_static(status.reason.wire_name()));
    }
    let code = tonic::Code::from_i32(status.code() as i32);
    tonic::Status::with_metadata(code, status.message, metadata)
}

#[cfg(test)]
mod tests {
    use kvrelay_consumer::policy::reason_from_status;
    use kvrelay_core::wire::RelayErrorReason;
    use tonic::Code;

    use super::*;

    #[test]
    fn every_reason_round_trips_through_a_tonic_status() {
        for reason in RelayErrorReason::ALL {
            let status = into_status(RelayStatus::new(reason, "details"));
            assert_eq!(status.code() as i32, reason.code() as i32);
            assert_eq!(status.message(), "details");
            let trailer = status.metadata().get(ERROR_REASON_METADATA_KEY).unwrap();
            assert_eq!(trailer.to_str().unwrap(), reason.wire_name());
            assert_eq!(reason_from_status(&status), Some(reason));
        }
        assert_eq!(ERROR_REASON_METADATA_KEY, "kv-relay-error-reason");
    }

    #[test]
    fn error_reason_is_ignored_when_absent_unknown_unspecified_or_inconsistent() {
        let with_trailer = |code, value: &'static str| {
            let mut metadata = MetadataMap::new();
            metadata.insert(ERROR_REASON_METADATA_KEY, MetadataValue::from_static(value));
            tonic::Status::with_metadata(code, "x", metadata)
        };
        assert_eq!(reason_from_status(&tonic::Status::unavailable("socket closed")), None);
        for name in
            ["RELAY_ERROR_REASON_UNSPECIFIED", "RELAY_ERROR_REASON_FUTURE", "producer_changed"]
        {
            assert_eq!(reason_from_status(&with_trailer(Code::FailedPrecondition, name)), None);
        }
        // A reason whose contract code is not the status code was not produced by a relay as is.
        let rewritten = with_trailer(Code::Internal, "RELAY_ERROR_REASON_PRODUCER_CHANGED");
        assert_eq!(reason_from_status(&rewritten), None);
        let kept = with_trailer(Code::FailedPrecondition, "RELAY_ERROR_REASON_PRODUCER_CHANGED");
        assert_eq!(reason_from_status(&kept), Some(RelayErrorReason::ProducerChanged));
    }
}
