//! What discovery knows about one serving endpoint: its [`EndpointMembership`].
//!
//! A membership is the projection of every in-scope card served at one endpoint: the indexer
//! domain its pool would publish under, the request-facing bindings it serves, its workers'
//! roles, runtime configs and readiness units, LoRA adapters, and every conflict found on the
//! way. Later layers consume it: the host materializes a pool only for a materializable
//! membership, the registry puts its registrations and roles into the catalog, and the topology
//! projection reads its base registrations, roles, worker units and adapters.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use thiserror::Error;

use super::conflicts::MaterializationConflict;
use super::render;
use crate::inputs::{ModelTypeFlags, RuntimeConfig, WorkerType};
use crate::model::hashing::HashFormat;
use crate::model::identity::{EndpointPath, IndexerDomainId};

/// A worker's role as published on the wire (`dynamo.kvrelay.v1.WorkerRole`).
///
/// The declaration order is the wire value order and the canonical sort order of role lists:
/// `UNSPECIFIED < PREFILL < DECODE < ENCODE < AGGREGATED < LEGACY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum WorkerRole {
    /// `WORKER_ROLE_UNSPECIFIED` (0): never produced by discovery.
    Unspecified,
    /// `WORKER_ROLE_PREFILL` (1).
    Prefill,
    /// `WORKER_ROLE_DECODE` (2).
    Decode,
    /// `WORKER_ROLE_ENCODE` (3).
    Encode,
    /// `WORKER_ROLE_AGGREGATED` (4).
    Aggregated,
    /// `WORKER_ROLE_LEGACY` (5): a card without a worker type.
    Legacy,
}

/// A wire value that is not a `WorkerRole` this build knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("unknown worker role {0}")]
pub struct UnknownWorkerRole(pub i32);

impl WorkerRole {
    /// The role of a worker with this card worker type; `None` (a legacy card) is `Legacy`.
    #[must_use]
    pub fn from_worker_type(worker_type: Option<WorkerType>) -> Self {
        match worker_type {
            Some(WorkerType::Prefill) => WorkerRole::Prefill,
            Some(WorkerType::Decode) => WorkerRole::Decode,
            Some(WorkerType::Encode) => WorkerRole::Encode,
            Some(WorkerType::Aggregated) => WorkerRole::Aggregated,
            None => WorkerRole::Legacy,
        }
    }

    /// The wire enum value.
    #[must_use]
    pub const fn wire_value(self) -> i32 {
        match self {
            WorkerRole::Unspecified => 0,
            WorkerRole::Prefill => 1,
            WorkerRole::Decode => 2,
            WorkerRole::Encode => 3,
            WorkerRole::Aggregated => 4,
            WorkerRole::Legacy => 5,
        }
    }
}

impl From<WorkerRole> for i32 {
    fn from(role: WorkerRole) -> i32 {
        role.wire_value()
    }
}

impl TryFrom<i32> for WorkerRole {
    type Error = UnknownWorkerRole;

    /// Map a wire value; values outside 0..=5 are unknown. `UNSPECIFIED` maps to
    /// [`WorkerRole::Unspecified`]: rejecting it is the wire validator's decision.
    fn try_from(value: i32) -> Result<Self, Self::Error> {
        match value {
            0 => Ok(WorkerRole::Unspecified),
            1 => Ok(WorkerRole::Prefill),
            2 => Ok(WorkerRole::Decode),
            3 => Ok(WorkerRole::Encode),
            4 => Ok(WorkerRole::Aggregated),
            5 => Ok(WorkerRole::Legacy),
            other => Err(UnknownWorkerRole(other)),
        }
    }
}

/// What a request-facing model name is served by: the base model, or an adapter on top of it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelTarget {
    /// The base model itself.
    Base {
        /// Canonical name of the base model.
        base_model: String,
    },
    /// A LoRA adapter over a base model.
    Lora {
        /// Canonical name of the base model.
        base_model: String,
        /// Runtime LoRA name: the salt of the adapter's block hashes.
        adapter: String,
    },
}

impl ModelTarget {
    /// The base model this target runs on.
    #[must_use]
    pub fn base_model(&self) -> &str {
        match self {
            ModelTarget::Base { base_model } | ModelTarget::Lora { base_model, .. } => base_model,
        }
    }
}

/// One request-facing binding of an endpoint: a canonical name, its target, and extra names.
///
/// Invariants: `canonical_model_id` is non-empty without surrounding whitespace; no alias
/// equals it, every alias is itself valid, and no alias (nor the canonical name) resolves to a
/// different binding anywhere in the discovery view.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ModelRegistration {
    /// The request-facing model name.
    pub canonical_model_id: String,
    /// What serves it.
    pub target: ModelTarget,
    /// Extra request-facing names, sorted and unique.
    pub aliases: BTreeSet<String>,
}

/// The query semantics a pool's hashes follow: block size and hash format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct QuerySemantics {
    /// Tokens per KV block; never zero in a membership.
    pub kv_block_size: u32,
    /// How blocks are cut from a token sequence.
    #[serde(serialize_with = "render::hash_format")]
    pub hash_format: HashFormat,
}

/// One served LoRA adapter of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct AdapterMembership {
    /// Canonical name of the base model the adapter runs on.
    pub base_model: String,
    /// Runtime LoRA name.
    pub adapter: String,
    /// Workers advertising the adapter, with their advertised adapter slot capacity (`None`
    /// when not advertised, or when the worker advertised conflicting capacities).
    pub workers: BTreeMap<u64, Option<u32>>,
}

/// One worker's readiness unit identity: role, served surfaces and peer needs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct WorkerTopology {
    /// Processing stage; `None` for a legacy card (legacy prefill cards are normalized first).
    #[serde(serialize_with = "render::worker_type")]
    pub worker_type: Option<WorkerType>,
    /// Served surfaces: same-role workers serving different surfaces are distinct units.
    #[serde(serialize_with = "render::model_type")]
    pub model_type: ModelTypeFlags,
    /// Peer roles needed, as an OR of AND-sets, as the card declares them.
    #[serde(serialize_with = "render::needs")]
    pub needs: Vec<Vec<WorkerType>>,
}

/// The projection of one endpoint's cards. See the module docs.
///
/// Invariants:
/// - `domain` and `query_semantics` are both present or both absent; present only if every base
///   card resolved and all resolved to one domain.
/// - `registrations` are sorted by `(canonical_model_id, target)` with one entry per binding.
/// - every `adapters` key has a `Lora` registration with the same base model and adapter.
/// - `roles` covers exactly the workers in `worker_topology`; `runtime_configs` and
///   `worker_topology` have the same keys (workers with exactly one base card).
/// - `conflicts` are sorted and unique.
/// - `generation` is assigned by the discovery view: it changes exactly when some other field
///   changes, or when the endpoint reappears after it disappeared; it is never 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointMembership {
    /// The serving endpoint.
    #[serde(serialize_with = "render::endpoint")]
    pub endpoint: EndpointPath,
    /// The single indexer domain of the endpoint's base cards, if there is exactly one.
    #[serde(serialize_with = "render::domain")]
    pub domain: Option<IndexerDomainId>,
    /// Block size and hash format behind `domain`.
    pub query_semantics: Option<QuerySemantics>,
    /// Request-facing bindings that survived every conflict.
    pub registrations: Vec<ModelRegistration>,
    /// Served adapters by request-facing name.
    pub adapters: BTreeMap<String, AdapterMembership>,
    /// Roles of the endpoint's workers.
    pub roles: BTreeSet<WorkerRole>,
    /// Runtime config of each worker's base card.
    #[serde(serialize_with = "render::runtime_configs")]
    pub runtime_configs: BTreeMap<u64, RuntimeConfig>,
    /// Readiness unit identity of each worker.
    pub worker_topology: BTreeMap<u64, WorkerTopology>,
    /// Every conflict found, sorted and unique.
    pub conflicts: Vec<MaterializationConflict>,
    /// Membership generation (see the invariants above).
    pub generation: u64,
}

impl EndpointMembership {
    /// Whether some conflict fences the endpoint's pool (PoolMaterialization or
    /// ServingTopology).
    #[must_use]
    pub fn has_pool_materialization_conflict(&self) -> bool {
        self.conflicts.iter().any(MaterializationConflict::blocks_pool)
    }

    /// Whether the endpoint may back a pool: it has a domain, at least one registration, and
    /// no conflict that fences the pool.
    #[must_use]
    pub fn is_materializable(&self) -> bool {
        self.domain.is_some()
            && !self.registrations.is_empty()
            && !self.has_pool_materialization_conflict()
    }

    /// Canonical names of the base models registered with a `Base` target, sorted.
    #[must_use]
    pub fn base_models(&self) -> BTreeSet<&str> {
        self.registrations
            .iter()
            .filter_map(|registration| match &registration.target {
                ModelTarget::Base { base_model } => Some(base_model.as_str()),
                ModelTarget::Lora { .. } => None,
            })
            .collect()
    }

    /// Equality of everything except `generation`.
    ///
    /// Destructures exhaustively so that a new field cannot be forgotten here.
    pub(super) fn same_projection(&self, other: &EndpointMembership) -> bool {
        let EndpointMembership {
            endpoint,
            domain,
            query_semantics,
            registrations,
            adapters,
            roles,
            runtime_configs,
            worker_topology,
            conflicts,
            generation: _,
        } = self;
        *endpoint == other.endpoint
            && *domain == other.domain
            && *query_semantics == other.query_semantics
            && *registrations == other.registrations
            && *adapters == other.adapters
            && *roles == other.roles
            && *runtime_configs == other.runtime_configs
            && *worker_topology == other.worker_topology
            && *conflicts == other.conflicts
    }
}
