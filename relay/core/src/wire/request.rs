//! Server-side request validation (relay-facts §3.1, §3.2, §3.5).
//!
//! Every request is checked in one order before the service touches any state: the contract
//! marker first (a wrong one is `CONTRACT_MISMATCH`, whatever else is wrong), then the
//! `subscriber_id`, then the request's own fields. Each check returns a [`RelayStatus`] whose
//! reason fixes the gRPC code.

use std::fmt;

use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;

use super::status::RelayStatus;
use super::validate::validate_producer;
use crate::model::identity::ProducerIdentity;

/// Longest accepted `subscriber_id`, in bytes (not characters).
pub const SUBSCRIBER_ID_BYTES_MAX: usize = 128;

/// Reject a request whose contract marker is not KVR1.
pub fn check_request_marker(contract_marker: u32) -> Result<(), RelayStatus> {
    if contract_marker == CONTRACT_MARKER { Ok(()) } else { Err(RelayStatus::contract_mismatch()) }
}

/// A stream's `subscriber_id`: a diagnostic label (not authentication, not a resume token;
/// reusing one neither replaces another stream nor bypasses a limit).
///
/// Invariant: non-empty, at most [`SUBSCRIBER_ID_BYTES_MAX`] bytes, no control characters,
/// exactly as the client sent it (never truncated).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SubscriberId(String);

impl SubscriberId {
    /// Validate a client-supplied id. Violations are `INVALID_REQUEST`; the message never
    /// echoes the id.
    pub fn parse(id: &str) -> Result<Self, RelayStatus> {
        if id.is_empty() {
            return Err(RelayStatus::invalid_request("subscriber_id must not be empty"));
        }
        if id.len() > SUBSCRIBER_ID_BYTES_MAX {
            return Err(RelayStatus::invalid_request(format!(
                "subscriber_id exceeds {SUBSCRIBER_ID_BYTES_MAX} bytes"
            )));
        }
        if id.chars().any(char::is_control) {
            return Err(RelayStatus::invalid_request(
                "subscriber_id must not contain control characters",
            ));
        }
        Ok(SubscriberId(id.to_owned()))
    }

    /// The id as sent.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SubscriberId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// Validate a `GetRelayInfo` request (the marker is all it carries).
pub fn validate_relay_info_request(request: &proto::RelayInfoRequest) -> Result<(), RelayStatus> {
    check_request_marker(request.contract_marker)
}

/// Validate a `WatchKvPoolCatalog` request.
pub fn validate_catalog_request(
    request: &proto::WatchKvPoolCatalogRequest,
) -> Result<SubscriberId, RelayStatus> {
    check_request_marker(request.contract_marker)?;
    SubscriberId::parse(&request.subscriber_id)
}

/// Validate a `SubscribeServingReadiness` request.
pub fn validate_readiness_request(
    request: &proto::SubscribeServingReadinessRequest,
) -> Result<SubscriberId, RelayStatus> {
    check_request_marker(request.contract_marker)?;
    SubscriberId::parse(&request.subscriber_id)
}

/// Validate a `SubscribeKvPoolLoad` request.
pub fn validate_load_request(
    request: &proto::SubscribeKvPoolLoadRequest,
) -> Result<SubscriberId, RelayStatus> {
    check_request_marker(request.contract_marker)?;
    SubscriberId::parse(&request.subscriber_id)
}

/// A validated `SubscribeKvPool` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSubscription {
    /// The client's diagnostic label.
    pub subscriber_id: SubscriberId,
    /// The exact producer generation the client wants (taken from the catalog).
    pub expected_producer: ProducerIdentity,
}

/// Validate a `SubscribeKvPool` request: marker, subscriber id, then `expected_producer`.
///
/// A missing producer (or pool id inside it) is `INVALID_REQUEST`; a producer that fails
/// validation is `UNSUPPORTED_FEATURE` when the failure is an unsupported value (a future
/// identity version, an unknown identity source, a non-executable CKF shape) and
/// `INVALID_REQUEST` otherwise (for example `layout_generation == 0`). Whether the producer is
/// the active one is the registry's question (`POOL_NOT_FOUND`, `PRODUCER_CHANGED`).
pub fn validate_pool_request(
    request: &proto::SubscribeKvPoolRequest,
) -> Result<PoolSubscription, RelayStatus> {
    check_request_marker(request.contract_marker)?;
    let subscriber_id = SubscriberId::parse(&request.subscriber_id)?;
    let producer = request
        .expected_producer
        .as_ref()
        .ok_or_else(|| RelayStatus::invalid_request("expected_producer is required"))?;
    let expected_producer = validate_producer(producer).map_err(|error| {
        if error.is_unsupported() {
            RelayStatus::unsupported_feature(format!("expected_producer is not supported: {error}"))
        } else {
            RelayStatus::invalid_request(format!("expected_producer is invalid: {error}"))
        }
    })?;
    Ok(PoolSubscription { subscriber_id, expected_producer })
}
