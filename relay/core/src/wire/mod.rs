//! The `dynamo.kvrelay.v1` wire boundary: domain values ↔ generated protobuf messages
//! (relay-facts §3), pure and sans-IO.
//!
//! Everything that crosses the WAN passes through here, in both directions:
//!
//! - [`encode`]: domain → proto for every response the relay sends (relay info, catalog,
//!   readiness, load windows, filter envelopes), each stamped with `protocol_version = 1`, the
//!   relay identity and `contract_marker = 0x4B565231`;
//! - [`validate`](mod@validate): proto → domain, fail-closed, with a typed [`WireError`] that tells
//!   *unsupported* (unknown semantics: quarantine) from *malformed* (a value v1 rules out) and
//!   from a *contract* mismatch (not v1 at all);
//! - [`request`](mod@request): the server's request checks (marker first, then `subscriber_id`,
//!   then the expected producer), answering with a [`RelayStatus`];
//! - [`status`](mod@status): [`RelayErrorReason`] ↔ gRPC code and the `kv-relay-error-reason`
//!   trailer;
//! - [`views`](mod@views): the consumer's catalog, readiness and load state machines and the
//!   filter stream guard, which take decoded messages and return what changed.
//!
//! Invariants kept here:
//! - encoding is total and never reorders: the domain layers' canonical orders reach the wire
//!   unchanged, and validating an encoded value gives back the same domain value;
//! - nothing is accepted by default: a missing field, an UNSPECIFIED value or an unknown value
//!   is an error, never a fallback (an unset `ModelTarget` is never read as a base target, an
//!   unknown readiness state never as READY);
//! - descriptor metadata, additive fields and unknown fields never enter producer identity;
//! - no input makes any function here panic.

pub mod encode;
mod errors;
pub mod request;
pub mod status;
pub mod validate;
pub mod views;

#[cfg(test)]
mod tests;

pub use encode::FilterEncoder;
pub use errors::{PlaneError, TextError, WireError, WireErrorKind};
pub use request::{
    PoolSubscription, SUBSCRIBER_ID_BYTES_MAX, SubscriberId, check_request_marker,
    validate_catalog_request, validate_load_request, validate_pool_request,
    validate_readiness_request, validate_relay_info_request,
};
pub use status::{CONTRACT_MISMATCH_MESSAGE, RelayErrorReason, RelayStatus, StatusCode};
pub use validate::{
    CatalogUpdate, FilterEnvelope, LoadUpdate, PoolLoad, PoolRef, Quarantined, ReadinessUpdate,
    WirePoolKey, check_envelope, topology_key, validate_adapter, validate_catalog_update,
    validate_ckf_format, validate_descriptor, validate_endpoint, validate_filter_update,
    validate_load_entry, validate_load_update, validate_model_target, validate_pool_id,
    validate_producer, validate_query_semantics, validate_readiness_update, validate_registration,
    validate_relay_info, validate_topology_entry,
};
pub use views::{
    CatalogChanges, CatalogInvalidated, CatalogView, FilterStreamFault, FilterStreamGuard,
    LoadOutcome, LoadView, ProducerChange, ReadinessChanges, ReadinessLookup, ReadinessView,
};
