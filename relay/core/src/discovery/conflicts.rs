//! Materialization conflicts: the facts that keep a card, worker, binding or whole endpoint out
//! of publication (relay-facts §9.3, conflict model).
//!
//! A conflict has a *scope* that says what it blocks and a *subject* that says where it was
//! found:
//!
//! - [`ConflictScope::ServingBinding`] suppresses only the affected request-facing binding;
//! - [`ConflictScope::ServingTopology`] fences the pool and also removes the endpoint from the
//!   readiness topology;
//! - [`ConflictScope::PoolMaterialization`] fences the pool (no CKF publication) but keeps the
//!   endpoint's independently valid bindings in the topology.
//!
//! Conflicts order by scope, then subject, then reason, so a membership's sorted, deduplicated
//! conflict list is canonical.

use std::fmt;

use serde::{Serialize, Serializer};

use super::render;
use crate::inputs::CardInstanceId;
use crate::model::identity::{EndpointPath, IdentityError, IndexerDomainId};

/// What a conflict blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConflictScope {
    /// The endpoint's pool must not be materialized (no CKF publication).
    PoolMaterialization,
    /// One request-facing binding is suppressed; everything else stands.
    ServingBinding,
    /// The endpoint's serving topology is not trustworthy: no pool and no topology membership.
    ServingTopology,
}

/// Where a conflict was found.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConflictSubject {
    /// The serving endpoint as a whole.
    Endpoint(EndpointPath),
    /// One card, by discovery identity.
    Card(CardInstanceId),
    /// One worker (instance id) of the endpoint.
    Worker(u64),
    /// One request-facing model name (the canonical model id of a binding).
    Binding(String),
}

/// Why a conflict exists. Rendered as a human-readable sentence.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConflictReason {
    /// A card has a model suffix without LoRA metadata, or LoRA metadata without a suffix.
    LoraIdentityMismatch,
    /// A base card's KV block size is zero, so no queryable domain exists.
    ZeroBlockSize,
    /// A base card's identity input does not fit its length frame.
    IdentityInputTooLong {
        /// Length of the rejected input in bytes.
        bytes: usize,
    },
    /// The endpoint's base cards resolve to more than one indexer domain (e.g. standard and
    /// Eagle workers on one endpoint).
    MultipleIndexerDomains,
    /// The endpoint's base cards name more than one canonical base model.
    MultipleBaseModels,
    /// A base card's request-facing name is empty or has surrounding whitespace.
    InvalidCanonicalModel,
    /// One worker publishes more than one base card on the endpoint.
    DuplicateWorkerBaseCards,
    /// An adapter's base card has an invalid canonical model name.
    InvalidAdapterBaseModel,
    /// An adapter's request-facing (served) name is empty or has surrounding whitespace.
    InvalidServedModelName,
    /// An adapter's runtime LoRA name is empty or has surrounding whitespace.
    InvalidRuntimeLoraName,
    /// One served adapter name resolves to different `(base model, runtime LoRA name)` pairs on
    /// the endpoint.
    ConflictingAdapterResolution,
    /// One worker publishes different slot capacities for the same served adapter.
    ConflictingAdapterCapacity {
        /// The served adapter name.
        served_model: String,
    },
    /// Across the whole view, the request-facing name maps to more than one binding.
    AmbiguousRequestName,
    /// Another endpoint derives the same indexer domain, hence the same pool id in this DC.
    PoolClaimedByMultipleEndpoints {
        /// The shared domain.
        domain: IndexerDomainId,
    },
}

impl ConflictReason {
    /// The reason a failed domain resolution contributes.
    #[must_use]
    pub fn from_identity_error(error: IdentityError) -> Self {
        match error {
            IdentityError::ZeroBlockSize => ConflictReason::ZeroBlockSize,
            IdentityError::InputTooLong { bytes } => ConflictReason::IdentityInputTooLong { bytes },
        }
    }
}

impl fmt::Display for ConflictReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConflictReason::LoraIdentityMismatch => {
                formatter.write_str("LoRA discovery identity and card metadata disagree")
            }
            ConflictReason::ZeroBlockSize => {
                formatter.write_str("kv block size is zero: no queryable indexer domain")
            }
            ConflictReason::IdentityInputTooLong { bytes } => {
                write!(formatter, "identity input of {bytes} bytes exceeds the u32 length frame")
            }
            ConflictReason::MultipleIndexerDomains => {
                formatter.write_str("endpoint resolves to multiple indexer domains")
            }
            ConflictReason::MultipleBaseModels => {
                formatter.write_str("endpoint serves more than one canonical base model")
            }
            ConflictReason::InvalidCanonicalModel => {
                formatter.write_str("invalid canonical model identity")
            }
            ConflictReason::DuplicateWorkerBaseCards => {
                formatter.write_str("worker publishes more than one base card on the endpoint")
            }
            ConflictReason::InvalidAdapterBaseModel => {
                formatter.write_str("adapter's base card has an invalid canonical model identity")
            }
            ConflictReason::InvalidServedModelName => {
                formatter.write_str("invalid request-facing adapter name")
            }
            ConflictReason::InvalidRuntimeLoraName => {
                formatter.write_str("invalid runtime LoRA name")
            }
            ConflictReason::ConflictingAdapterResolution => formatter
                .write_str("served adapter resolves to conflicting base models or LoRA names"),
            ConflictReason::ConflictingAdapterCapacity { served_model } => write!(
                formatter,
                "worker publishes conflicting LoRA capacities for adapter {served_model:?}"
            ),
            ConflictReason::AmbiguousRequestName => {
                formatter.write_str("request-facing model name resolves to conflicting targets")
            }
            ConflictReason::PoolClaimedByMultipleEndpoints { domain } => write!(
                formatter,
                "pool with indexer domain {domain} is claimed by multiple serving endpoints"
            ),
        }
    }
}

impl Serialize for ConflictReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl Serialize for ConflictSubject {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ConflictSubject::Endpoint(endpoint) => serializer.serialize_newtype_variant(
                "ConflictSubject",
                0,
                "endpoint",
                &render::Displayed(endpoint),
            ),
            ConflictSubject::Card(card) => serializer.serialize_newtype_variant(
                "ConflictSubject",
                1,
                "card",
                &render::CardId(card),
            ),
            ConflictSubject::Worker(worker_id) => {
                serializer.serialize_newtype_variant("ConflictSubject", 2, "worker", worker_id)
            }
            ConflictSubject::Binding(model) => {
                serializer.serialize_newtype_variant("ConflictSubject", 3, "binding", model)
            }
        }
    }
}

/// One conflict: what it blocks, where it was found, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct MaterializationConflict {
    /// What the conflict blocks.
    pub scope: ConflictScope,
    /// Where it was found.
    pub subject: ConflictSubject,
    /// Why.
    pub reason: ConflictReason,
}

impl MaterializationConflict {
    /// Whether this conflict fences the endpoint's pool (PoolMaterialization or ServingTopology).
    #[must_use]
    pub fn blocks_pool(&self) -> bool {
        matches!(self.scope, ConflictScope::PoolMaterialization | ConflictScope::ServingTopology)
    }
}
