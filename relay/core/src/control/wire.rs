//! The plane's published outputs rendered in the shape of the `dynamo.kvrelay.v1` messages
//! (relay-facts §3.3), for snapshot tests, diagnostics and side-by-side comparison with a live
//! relay's output.
//!
//! Each view mirrors one message: same nesting, same field names, enum values by their full
//! protobuf names (`WORKER_ROLE_PREFILL`, `SERVING_READINESS_STATE_READY`, ...), integers as
//! numbers. Two deliberate differences from protobuf's JSON mapping: digests render as 32
//! lowercase hex digits (the form the derivation's golden vectors use) instead of base64, and
//! empty repeated fields and absent optional messages are kept (`[]`, `null`) so a snapshot
//! shows what is missing. The envelope fields every response carries (`protocol_version`,
//! `relay`, `contract_marker`) are left out: they are constant per relay start. The rendering
//! is a function of its input only, with no random or wall-clock value of its own.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use crate::host::{CatalogSnapshot, PoolDescriptor};
use crate::load::{LoadWindow, PoolLoadSnapshot};
use crate::model::hashing::HashFormat;
use crate::model::identity::{
    CacheSemanticsId, EndpointPath, IdentitySource, IndexerDomainId, POOL_IDENTITY_VERSION, PoolId,
    ProducerIdentity, RoutingScopeId,
};
use crate::readiness::ReadinessState;
use crate::readiness::topology::{
    AdapterReadiness, TopologyEntry, TopologyMember, TopologySnapshot,
};

/// The protobuf name of a `WorkerRole` value.
#[must_use]
pub fn worker_role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Unspecified => "WORKER_ROLE_UNSPECIFIED",
        WorkerRole::Prefill => "WORKER_ROLE_PREFILL",
        WorkerRole::Decode => "WORKER_ROLE_DECODE",
        WorkerRole::Encode => "WORKER_ROLE_ENCODE",
        WorkerRole::Aggregated => "WORKER_ROLE_AGGREGATED",
        WorkerRole::Legacy => "WORKER_ROLE_LEGACY",
    }
}

/// The protobuf name of an `IdentitySource` value.
#[must_use]
pub fn identity_source_name(source: IdentitySource) -> &'static str {
    match source {
        IdentitySource::DefaultDerived => "IDENTITY_SOURCE_DEFAULT_DERIVED",
        IdentitySource::Explicit => "IDENTITY_SOURCE_EXPLICIT",
    }
}

/// The protobuf name of a `KvQueryHashFormat` value.
#[must_use]
pub fn hash_format_name(format: HashFormat) -> &'static str {
    match format {
        HashFormat::StandardV1 => "KV_QUERY_HASH_FORMAT_DYNAMO_STANDARD_V1",
        HashFormat::EagleV1 => "KV_QUERY_HASH_FORMAT_DYNAMO_EAGLE_V1",
    }
}

/// The protobuf name of a `ServingReadinessState` value.
#[must_use]
pub fn readiness_state_name(state: ReadinessState) -> &'static str {
    match state {
        ReadinessState::Unknown => "SERVING_READINESS_STATE_UNKNOWN",
        ReadinessState::Unavailable => "SERVING_READINESS_STATE_UNAVAILABLE",
        ReadinessState::Ready => "SERVING_READINESS_STATE_READY",
    }
}

fn role_names(roles: &BTreeSet<WorkerRole>) -> Vec<&'static str> {
    roles.iter().map(|role| worker_role_name(*role)).collect()
}

/// `DigestIdentity`: a 16-byte digest (rendered as hex) and its source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DigestIdentityView {
    /// The digest, 32 lowercase hex digits.
    pub digest: String,
    /// `IDENTITY_SOURCE_*`.
    pub source: &'static str,
}

impl DigestIdentityView {
    fn cache_semantics(id: &CacheSemanticsId) -> Self {
        DigestIdentityView { digest: id.to_string(), source: identity_source_name(id.source) }
    }

    fn routing_scope(id: &RoutingScopeId) -> Self {
        DigestIdentityView { digest: id.to_string(), source: identity_source_name(id.source) }
    }
}

/// `IndexerDomainId`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IndexerDomainIdView {
    /// What the filter's hashes mean.
    pub cache_semantics: DigestIdentityView,
    /// Where the cached prefixes can be served.
    pub routing_scope: DigestIdentityView,
}

impl From<&IndexerDomainId> for IndexerDomainIdView {
    fn from(domain: &IndexerDomainId) -> Self {
        IndexerDomainIdView {
            cache_semantics: DigestIdentityView::cache_semantics(&domain.cache_semantics),
            routing_scope: DigestIdentityView::routing_scope(&domain.routing_scope),
        }
    }
}

/// `KvPoolId`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvPoolIdView {
    /// Always [`POOL_IDENTITY_VERSION`].
    pub identity_version: u32,
    /// The pool's indexer domain.
    pub indexer_domain: IndexerDomainIdView,
    /// The data center, as the `fixed64` number.
    pub dc_id: u64,
}

impl From<&PoolId> for KvPoolIdView {
    fn from(pool_id: &PoolId) -> Self {
        KvPoolIdView {
            identity_version: POOL_IDENTITY_VERSION,
            indexer_domain: IndexerDomainIdView::from(&pool_id.indexer_domain),
            dc_id: pool_id.dc_id.0,
        }
    }
}

/// `CkfFormat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CkfFormatView {
    /// Format version (1).
    pub format_version: u32,
    /// Addressing seed.
    pub seed: u64,
    /// Buckets of the filter.
    pub bucket_count: u64,
    /// Fingerprint width (16).
    pub fingerprint_bits: u32,
    /// Slots per bucket (4).
    pub slots_per_bucket: u32,
}

/// `ProducerIdentity`: the frozen subscription key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProducerIdentityView {
    /// The pool.
    pub pool_id: KvPoolIdView,
    /// The producing relay's incarnation.
    pub producer_incarnation: u64,
    /// The registry's attachment generation (from 1).
    pub layout_generation: u64,
    /// The filter's format.
    pub ckf_format: CkfFormatView,
}

impl From<&ProducerIdentity> for ProducerIdentityView {
    fn from(producer: &ProducerIdentity) -> Self {
        let format = producer.format();
        ProducerIdentityView {
            pool_id: KvPoolIdView::from(&producer.pool_id()),
            producer_incarnation: producer.producer_incarnation(),
            layout_generation: producer.layout_generation(),
            ckf_format: CkfFormatView {
                format_version: format.format_version,
                seed: format.seed,
                bucket_count: format.bucket_count,
                fingerprint_bits: format.fingerprint_bits,
                slots_per_bucket: format.slots_per_bucket,
            },
        }
    }
}

/// `DynamoEndpointId`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DynamoEndpointIdView {
    /// Dynamo namespace.
    pub namespace: String,
    /// Component.
    pub component: String,
    /// Endpoint name.
    pub endpoint: String,
}

impl From<&EndpointPath> for DynamoEndpointIdView {
    fn from(endpoint: &EndpointPath) -> Self {
        DynamoEndpointIdView {
            namespace: endpoint.namespace().to_owned(),
            component: endpoint.component().to_owned(),
            endpoint: endpoint.endpoint().to_owned(),
        }
    }
}

/// `ModelTarget`: the `target` oneof, rendered as `{base: {...}}` or `{lora: {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelTargetView {
    /// `BaseModelTarget`.
    Base {
        /// The base model.
        base_model: String,
    },
    /// `LoraModelTarget`.
    Lora {
        /// The base model.
        base_model: String,
        /// The runtime LoRA name.
        adapter: String,
    },
}

/// `ModelRegistration`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelRegistrationView {
    /// The request-facing model name.
    pub canonical_model_id: String,
    /// What serves it.
    pub target: ModelTargetView,
    /// Extra request-facing names, sorted.
    pub aliases: Vec<String>,
}

impl From<&ModelRegistration> for ModelRegistrationView {
    fn from(registration: &ModelRegistration) -> Self {
        let target = match &registration.target {
            ModelTarget::Base { base_model } => {
                ModelTargetView::Base { base_model: base_model.clone() }
            }
            ModelTarget::Lora { base_model, adapter } => {
                ModelTargetView::Lora { base_model: base_model.clone(), adapter: adapter.clone() }
            }
        };
        ModelRegistrationView {
            canonical_model_id: registration.canonical_model_id.clone(),
            target,
            aliases: registration.aliases.iter().cloned().collect(),
        }
    }
}

/// `KvQuerySemantics`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvQuerySemanticsView {
    /// Tokens per KV block.
    pub kv_block_size: u32,
    /// `KV_QUERY_HASH_FORMAT_*`.
    pub hash_format: &'static str,
}

impl From<&QuerySemantics> for KvQuerySemanticsView {
    fn from(semantics: &QuerySemantics) -> Self {
        KvQuerySemanticsView {
            kv_block_size: semantics.kv_block_size,
            hash_format: hash_format_name(semantics.hash_format),
        }
    }
}

/// `KvPoolDescriptor`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvPoolDescriptorView {
    /// The publication to subscribe to.
    pub producer: ProducerIdentityView,
    /// The endpoint serving the pool's cached prefixes.
    pub serving_endpoint: DynamoEndpointIdView,
    /// Request-facing bindings, sorted.
    pub registrations: Vec<ModelRegistrationView>,
    /// How a consumer must hash prompts.
    pub query_semantics: KvQuerySemanticsView,
    /// `WORKER_ROLE_*`, in wire order.
    pub pool_roles: Vec<&'static str>,
}

impl From<&PoolDescriptor> for KvPoolDescriptorView {
    fn from(descriptor: &PoolDescriptor) -> Self {
        KvPoolDescriptorView {
            producer: ProducerIdentityView::from(&descriptor.producer),
            serving_endpoint: DynamoEndpointIdView::from(&descriptor.serving_endpoint),
            registrations: descriptor.registrations.iter().map(Into::into).collect(),
            query_semantics: KvQuerySemanticsView::from(&descriptor.query_semantics),
            pool_roles: role_names(&descriptor.pool_roles),
        }
    }
}

/// `KvPoolCatalogUpdate` without its envelope: the revision and the snapshot's pools.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvPoolCatalogView {
    /// Catalog revision.
    pub revision: u64,
    /// `KvPoolCatalogSnapshot.pools`, in pool id order.
    pub pools: Vec<KvPoolDescriptorView>,
}

impl From<&CatalogSnapshot> for KvPoolCatalogView {
    fn from(snapshot: &CatalogSnapshot) -> Self {
        KvPoolCatalogView {
            revision: snapshot.revision,
            pools: snapshot.pools.iter().map(Into::into).collect(),
        }
    }
}

/// `TopologyMember`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopologyMemberView {
    /// The member endpoint.
    pub endpoint: DynamoEndpointIdView,
    /// Declared roles, in wire order.
    pub roles: Vec<&'static str>,
    /// The linked pool; `null` when the member has no (unambiguous, cataloged) pool.
    pub pool_id: Option<KvPoolIdView>,
}

impl From<&TopologyMember> for TopologyMemberView {
    fn from(member: &TopologyMember) -> Self {
        TopologyMemberView {
            endpoint: DynamoEndpointIdView::from(&member.endpoint),
            roles: role_names(&member.roles),
            pool_id: member.pool_id.as_ref().map(KvPoolIdView::from),
        }
    }
}

/// `AdapterReadiness`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterReadinessView {
    /// The adapter's served name.
    pub canonical_model_id: String,
    /// `SERVING_READINESS_STATE_*`.
    pub state: &'static str,
    /// Missing roles, in wire order.
    pub missing_roles: Vec<&'static str>,
}

impl From<&AdapterReadiness> for AdapterReadinessView {
    fn from(adapter: &AdapterReadiness) -> Self {
        AdapterReadinessView {
            canonical_model_id: adapter.canonical_model_id.clone(),
            state: readiness_state_name(adapter.state),
            missing_roles: role_names(&adapter.missing_roles),
        }
    }
}

/// `TopologyEntry`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopologyEntryView {
    /// Dynamo namespace.
    pub namespace: String,
    /// Canonical base model.
    pub canonical_model_id: String,
    /// `SERVING_READINESS_STATE_*`.
    pub state: &'static str,
    /// Present roles, in wire order.
    pub present_roles: Vec<&'static str>,
    /// Missing roles, in wire order.
    pub missing_roles: Vec<&'static str>,
    /// Members, sorted by endpoint.
    pub members: Vec<TopologyMemberView>,
    /// PREFILL / DECODE declared by more than one member.
    pub duplicate_role_endpoints: Vec<&'static str>,
    /// Legacy (untyped) workers switched off strict gating.
    pub legacy_fallback_active: bool,
    /// Adapter readiness, sorted by id.
    pub adapters: Vec<AdapterReadinessView>,
}

impl From<&TopologyEntry> for TopologyEntryView {
    fn from(entry: &TopologyEntry) -> Self {
        TopologyEntryView {
            namespace: entry.namespace.clone(),
            canonical_model_id: entry.canonical_model_id.clone(),
            state: readiness_state_name(entry.state),
            present_roles: role_names(&entry.present_roles),
            missing_roles: role_names(&entry.missing_roles),
            members: entry.members.iter().map(Into::into).collect(),
            duplicate_role_endpoints: role_names(&entry.duplicate_role_endpoints),
            legacy_fallback_active: entry.legacy_fallback_active,
            adapters: entry.adapters.iter().map(Into::into).collect(),
        }
    }
}

/// `ServingReadinessUpdate` without its envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServingReadinessView {
    /// Topology revision.
    pub revision: u64,
    /// Entries, sorted by `(namespace, canonical model)`.
    pub entries: Vec<TopologyEntryView>,
}

impl From<&TopologySnapshot> for ServingReadinessView {
    fn from(snapshot: &TopologySnapshot) -> Self {
        ServingReadinessView {
            revision: snapshot.revision,
            entries: snapshot.entries.iter().map(Into::into).collect(),
        }
    }
}

/// `KvPoolLoadEntry`: the producer and the wire numbers (unset sums are `0`; coverage is read
/// from `kv_observed_ranks < kv_expected_ranks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvPoolLoadEntryView {
    /// The pool generation.
    pub producer: ProducerIdentityView,
    /// Occupied blocks; `0` unless every expected rank reported.
    pub kv_used_blocks: u64,
    /// Capacity; `0` unless every expected rank's capacity is known.
    pub total_kv_blocks: u64,
    /// Ranks that reported.
    pub kv_observed_ranks: u32,
    /// Ranks declared by the runtime configs.
    pub kv_expected_ranks: u32,
}

impl KvPoolLoadEntryView {
    /// The entry of `producer` with load `snapshot`.
    #[must_use]
    pub fn new(producer: &ProducerIdentity, snapshot: &PoolLoadSnapshot) -> Self {
        let wire = snapshot.to_wire();
        KvPoolLoadEntryView {
            producer: ProducerIdentityView::from(producer),
            kv_used_blocks: wire.kv_used_blocks,
            total_kv_blocks: wire.total_kv_blocks,
            kv_observed_ranks: wire.kv_observed_ranks,
            kv_expected_ranks: wire.kv_expected_ranks,
        }
    }
}

/// `KvPoolLoadUpdate` without its envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvPoolLoadView {
    /// Window number.
    pub window_sequence: u64,
    /// Wall-clock cut instant, unix ms (as handed in).
    pub observed_ms: u64,
    /// Window interval.
    pub window_ms: u64,
    /// One entry per active pool generation, sorted by producer.
    pub pools: Vec<KvPoolLoadEntryView>,
}

impl From<&LoadWindow<ProducerIdentity>> for KvPoolLoadView {
    fn from(window: &LoadWindow<ProducerIdentity>) -> Self {
        KvPoolLoadView {
            window_sequence: window.window_sequence,
            observed_ms: window.observed_ms,
            window_ms: window.window_ms,
            pools: window
                .pools
                .iter()
                .map(|entry| KvPoolLoadEntryView::new(&entry.pool, &entry.load))
                .collect(),
        }
    }
}
