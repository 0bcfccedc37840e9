//! Typed validation errors of the proto → domain direction (relay-facts §3.4).
//!
//! Every check in `validate.rs` fails with one [`WireError`]. Its [`WireErrorKind`] carries the
//! distinction the contract draws between three kinds of fault, because each calls for a
//! different reaction:
//!
//! - **contract**: the message is not `dynamo.kvrelay.v1` at all (marker or protocol version).
//!   Deployment skew: invalidate the whole plane and do not retry without an upgrade.
//! - **unsupported**: a well-formed message names something this build does not understand (an
//!   unknown nonzero enum value, a future pool identity version, a CKF shape other than the
//!   executable one, an unset `ModelTarget` oneof). New enum values and oneof alternatives are
//!   not automatically compatible, so the item is quarantined — never guessed at — and the
//!   server answers `UNSUPPORTED_FEATURE`.
//! - **malformed**: a value v1 itself rules out: a missing field, an unspecified (zero) enum or
//!   number where v1 requires one, a duplicate, bad text. The server answers `INVALID_REQUEST`.
//!
//! [`PlaneError`] is the coarser fault of a whole update: its envelope is invalid, or an entry
//! cannot be identified, or a key repeats. Consumers then drop the entire view of that plane.

use std::fmt;

use thiserror::Error;

use crate::discovery::WorkerRole;
use crate::filter::ckf::CkfFormatError;
use crate::model::identity::{EndpointPathError, ProducerIdentityError};

/// Why a text field is not valid text.
///
/// Valid text (names of models, namespaces, endpoints, aliases) is non-empty and carries no
/// leading or trailing whitespace, so two spellings of one name cannot slip through as two
/// names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextError {
    /// The text is empty (proto3 cannot tell this from "unset").
    Empty,
    /// The text starts or ends with whitespace.
    SurroundingWhitespace,
}

impl fmt::Display for TextError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            TextError::Empty => "is empty",
            TextError::SurroundingWhitespace => "has leading or trailing whitespace",
        })
    }
}

/// The three classes of wire fault; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WireErrorKind {
    /// Not the v1 contract (marker or protocol version): deployment skew.
    Contract,
    /// Well-formed, but names a feature or value this build does not understand.
    Unsupported,
    /// A value that v1 itself rules out.
    Malformed,
}

/// Why a decoded message (or a part of one) is not an acceptable v1 value.
///
/// Field names are paths relative to the message that was validated (for example
/// `pool_id.indexer_domain.cache_semantics.source` inside a producer identity).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// `contract_marker` is not `0x4B565231` ("KVR1").
    #[error("unsupported Relay v1 wire contract: marker {found:#010x}")]
    ContractMarker {
        /// The marker that arrived.
        found: u32,
    },
    /// `protocol_version` is not 1.
    #[error("unsupported Relay protocol version {found}")]
    ProtocolVersion {
        /// The version that arrived.
        found: u32,
    },
    /// A required message field is absent.
    #[error("{field} is missing")]
    Missing {
        /// The absent field.
        field: &'static str,
    },
    /// A required number is zero (proto3's "unset").
    #[error("{field} must not be zero")]
    Zero {
        /// The zero field.
        field: &'static str,
    },
    /// An enum field holds its UNSPECIFIED (0) value where v1 requires a real one.
    #[error("{field} is unspecified")]
    Unspecified {
        /// The enum field.
        field: &'static str,
    },
    /// An enum field holds a nonzero value this build does not know (unsupported).
    #[error("{field} has unknown value {value}")]
    UnknownEnum {
        /// The enum field.
        field: &'static str,
        /// The unknown value.
        value: i32,
    },
    /// `KvPoolId.identity_version` is a nonzero version other than 1 (unsupported).
    #[error("pool identity version {found} is not supported")]
    IdentityVersion {
        /// The version that arrived.
        found: u32,
    },
    /// A digest is not exactly 16 bytes.
    #[error("{field} has {length} bytes, expected 16")]
    DigestLength {
        /// The digest field.
        field: &'static str,
        /// Its length.
        length: usize,
    },
    /// A CKF format field names a shape other than the executable v1 one (unsupported).
    #[error("unsupported CKF format: {field} = {value}")]
    UnsupportedCkfFormat {
        /// The format field.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// The bucket count exceeds what CBI1 can carry (unsupported).
    #[error("bucket count {bucket_count} exceeds 16777216")]
    BucketCountTooLarge {
        /// The bucket count.
        bucket_count: u64,
    },
    /// The bucket count does not fit this platform's `usize` (unsupported).
    #[error("bucket count {bucket_count} does not fit in memory on this platform")]
    BucketCountOverflow {
        /// The bucket count.
        bucket_count: u64,
    },
    /// The bucket count is not a power of two of at least 2 (malformed: v1 addressing cannot
    /// use it).
    #[error("bucket count {bucket_count} is not a power of two of at least 2")]
    BucketCountShape {
        /// The bucket count.
        bucket_count: u64,
    },
    /// A text field is not valid text.
    #[error("{field} {reason}")]
    InvalidText {
        /// The text field.
        field: &'static str,
        /// What is wrong with it.
        reason: TextError,
    },
    /// An endpoint triple cannot form an endpoint path (a segment contains `/`).
    #[error("endpoint is not a valid path: {0}")]
    Endpoint(#[source] EndpointPathError),
    /// `ModelTarget.target` is unset: the sender used an alternative this build does not know
    /// (or none). Unsupported: never fall back to a base target.
    #[error("model target is unset or an unknown alternative")]
    UnsetModelTarget,
    /// A value appears twice where v1 requires uniqueness.
    #[error("{field} repeats {value:?}")]
    Duplicate {
        /// The repeated field.
        field: &'static str,
        /// The repeated value, rendered.
        value: String,
    },
    /// A list that v1 requires to be non-empty is empty.
    #[error("{field} must not be empty")]
    Empty {
        /// The empty list.
        field: &'static str,
    },
    /// A known role appears in a list that does not allow it.
    #[error("{field} must not contain {role:?}")]
    RoleNotAllowed {
        /// The list.
        field: &'static str,
        /// The role.
        role: WorkerRole,
    },
    /// A topology member's namespace differs from its entry's.
    #[error("member namespace {member:?} differs from entry namespace {entry:?}")]
    MemberNamespace {
        /// The member endpoint's namespace.
        member: String,
        /// The entry's namespace.
        entry: String,
    },
    /// A load entry claims more observed ranks than expected ranks.
    #[error("kv_observed_ranks {observed} exceeds kv_expected_ranks {expected}")]
    RankCoverage {
        /// Observed ranks.
        observed: u32,
        /// Expected ranks.
        expected: u32,
    },
    /// A filter update's `base_sequence` and `sequence` do not fit its kind.
    #[error("{kind} with base_sequence {base_sequence} and sequence {sequence}")]
    SequenceRelation {
        /// The frame kind.
        kind: &'static str,
        /// Envelope base sequence.
        base_sequence: u64,
        /// Envelope sequence.
        sequence: u64,
    },
    /// A filter update's payload presence does not fit its kind (a heartbeat with bytes, a
    /// snapshot chunk or delta without).
    #[error("{kind} {expectation}")]
    Payload {
        /// The frame kind.
        kind: &'static str,
        /// What the payload should have been.
        expectation: &'static str,
    },
    /// The validated values still failed the domain's producer constructor. The checks above
    /// run first, so this is not expected; it is kept so that the conversion stays total.
    #[error("producer identity rejected: {0}")]
    Producer(#[source] ProducerIdentityError),
}

impl WireError {
    /// The class of this fault (see [`WireErrorKind`]).
    #[must_use]
    pub fn kind(&self) -> WireErrorKind {
        match self {
            WireError::ContractMarker { .. } | WireError::ProtocolVersion { .. } => {
                WireErrorKind::Contract
            }
            WireError::UnknownEnum { .. }
            | WireError::IdentityVersion { .. }
            | WireError::UnsupportedCkfFormat { .. }
            | WireError::BucketCountTooLarge { .. }
            | WireError::BucketCountOverflow { .. }
            | WireError::UnsetModelTarget => WireErrorKind::Unsupported,
            WireError::Producer(ProducerIdentityError::Format(
                CkfFormatError::FormatVersion(_)
                | CkfFormatError::FingerprintBits(_)
                | CkfFormatError::SlotsPerBucket(_),
            )) => WireErrorKind::Unsupported,
            WireError::Missing { .. }
            | WireError::Zero { .. }
            | WireError::Unspecified { .. }
            | WireError::DigestLength { .. }
            | WireError::BucketCountShape { .. }
            | WireError::InvalidText { .. }
            | WireError::Endpoint(_)
            | WireError::Duplicate { .. }
            | WireError::Empty { .. }
            | WireError::RoleNotAllowed { .. }
            | WireError::MemberNamespace { .. }
            | WireError::RankCoverage { .. }
            | WireError::SequenceRelation { .. }
            | WireError::Payload { .. }
            | WireError::Producer(_) => WireErrorKind::Malformed,
        }
    }

    /// True if the message is well formed but names something this build does not understand:
    /// an unknown identity version, an unknown nonzero hash format, worker role, identity
    /// source, readiness state or frame kind, an unset model target, an unsupported CKF format,
    /// or a bucket count that is too large or does not fit. The item is quarantined (a server
    /// answers `UNSUPPORTED_FEATURE`). Unspecified (0) values, missing fields and duplicates
    /// are malformed, not unsupported.
    #[must_use]
    pub fn is_unsupported(&self) -> bool {
        self.kind() == WireErrorKind::Unsupported
    }

    /// True if the message is not the v1 contract at all (marker or protocol version).
    #[must_use]
    pub fn is_contract_mismatch(&self) -> bool {
        self.kind() == WireErrorKind::Contract
    }
}

/// Why a whole update (catalog, readiness or load) cannot be applied: the consumer drops its
/// entire view of that plane (relay-facts §3.4, last row of the scope-of-action table).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlaneError {
    /// The envelope (marker, protocol version, relay identity, required top-level field) is
    /// invalid.
    #[error("invalid envelope: {0}")]
    Envelope(#[source] WireError),
    /// An entry's key cannot be read, so nothing about it can be trusted or quarantined.
    #[error("entry {index} cannot be identified: {error}")]
    Unidentifiable {
        /// Position of the entry in the update.
        index: usize,
        /// Why its key is unreadable.
        #[source]
        error: WireError,
    },
    /// Two entries share one key.
    #[error("entry {index} repeats key {key}")]
    DuplicateKey {
        /// Position of the second occurrence.
        index: usize,
        /// The repeated key, rendered.
        key: String,
    },
}

impl PlaneError {
    /// True if the update is not the v1 contract: do not retry without an upgrade.
    #[must_use]
    pub fn is_contract_mismatch(&self) -> bool {
        matches!(self, PlaneError::Envelope(error) if error.is_contract_mismatch())
    }
}
