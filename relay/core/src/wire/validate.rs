//! Proto → domain, fail-closed (relay-facts §3.4).
//!
//! Every function takes a decoded message and either returns the domain value it denotes or a
//! typed [`WireError`]; nothing is defaulted, guessed or repaired. Check order follows two
//! rules, so the unsupported-vs-malformed answer is deterministic:
//!
//! - fields are checked in field-number order;
//! - inside one value, whatever decides how the rest is read comes first: a pool id's identity
//!   version before its digests, a digest's source before its length, a CKF format's version
//!   before its other fields, and an unknown role anywhere in a role list before a zero or a
//!   duplicate in it. A value whose meaning is unknown is unsupported even if it would also be
//!   malformed under v1.
//!
//! Whole updates (catalog, readiness, load) are validated per entry: an entry whose key can be
//! read but whose content fails becomes a [`Quarantined`] record, while an invalid envelope, an
//! unreadable key or a repeated key fails the whole update with a [`PlaneError`].
//!
//! Bounds: nothing here allocates more than the decoded message already holds; message size is
//! bounded by the transport's decoding limit.

use std::collections::BTreeSet;
use std::fmt;

use kvrelay_proto::v1 as proto;
use kvrelay_proto::{CONTRACT_MARKER, PROTOCOL_VERSION};
use prost::Message;

use super::errors::{PlaneError, TextError, WireError};
use crate::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use crate::filter::FilterFrame;
use crate::filter::ckf::{
    BUCKET_COUNT_MAX, CkfFormat, FINGERPRINT_BITS, FORMAT_VERSION, SLOTS_PER_BUCKET,
};
use crate::host::PoolDescriptor;
use crate::model::hashing::HashFormat;
use crate::model::identity::{
    CacheSemanticsId, DcId, EndpointPath, IdentitySource, IndexerDomainId, POOL_IDENTITY_VERSION,
    PoolId, ProducerIdentity, RelayIdentity, RoutingScopeId,
};
use crate::readiness::ReadinessState;
use crate::readiness::topology::{AdapterReadiness, TopologyEntry, TopologyKey, TopologyMember};

/// Length of every identity digest.
const DIGEST_BYTES: usize = 16;

// ---- envelope -------------------------------------------------------------------------------

/// The checks a consumer applies to every response before anything else: the contract marker,
/// then the protocol version, then the presence of the relay identity.
pub fn check_envelope(
    contract_marker: u32,
    protocol_version: u32,
    relay: Option<&proto::RelayIdentity>,
) -> Result<RelayIdentity, WireError> {
    if contract_marker != CONTRACT_MARKER {
        return Err(WireError::ContractMarker { found: contract_marker });
    }
    if protocol_version != PROTOCOL_VERSION {
        return Err(WireError::ProtocolVersion { found: protocol_version });
    }
    let relay = relay.ok_or(WireError::Missing { field: "relay" })?;
    Ok(RelayIdentity {
        drt_instance_id: relay.drt_instance_id,
        relay_incarnation: relay.relay_incarnation,
    })
}

/// A `GetRelayInfo` response: its envelope is all it carries.
pub fn validate_relay_info(info: &proto::RelayInfo) -> Result<RelayIdentity, WireError> {
    check_envelope(info.contract_marker, info.protocol_version, info.relay.as_ref())
}

// ---- scalar helpers -------------------------------------------------------------------------

/// Valid text: non-empty, no leading or trailing whitespace.
fn check_text(field: &'static str, value: &str) -> Result<(), WireError> {
    if value.is_empty() {
        return Err(WireError::InvalidText { field, reason: TextError::Empty });
    }
    if value.trim() != value {
        return Err(WireError::InvalidText { field, reason: TextError::SurroundingWhitespace });
    }
    Ok(())
}

/// The wire enum name of a role, for error messages.
fn role_name(role: WorkerRole) -> &'static str {
    proto::WorkerRole::try_from(role.wire_value())
        .map(|role| role.as_str_name())
        .unwrap_or("WORKER_ROLE_UNSPECIFIED")
}

/// A set of roles: no unknown value (unsupported, checked first), no UNSPECIFIED, no duplicate.
/// Empty is allowed here; callers that require a role say so.
fn role_set(field: &'static str, values: &[i32]) -> Result<BTreeSet<WorkerRole>, WireError> {
    if let Some(&value) = values.iter().find(|&&value| WorkerRole::try_from(value).is_err()) {
        return Err(WireError::UnknownEnum { field, value });
    }
    let mut roles = BTreeSet::new();
    for &value in values {
        let role =
            WorkerRole::try_from(value).map_err(|_| WireError::UnknownEnum { field, value })?;
        if role == WorkerRole::Unspecified {
            return Err(WireError::Unspecified { field });
        }
        if !roles.insert(role) {
            return Err(WireError::Duplicate { field, value: role_name(role).to_owned() });
        }
    }
    Ok(roles)
}

/// A role set that must hold at least one role.
fn non_empty_role_set(
    field: &'static str,
    values: &[i32],
) -> Result<BTreeSet<WorkerRole>, WireError> {
    let roles = role_set(field, values)?;
    if roles.is_empty() {
        return Err(WireError::Empty { field });
    }
    Ok(roles)
}

/// A readiness state: UNKNOWN (0) is a valid state; values beyond READY are unsupported.
fn readiness_state(field: &'static str, value: i32) -> Result<ReadinessState, WireError> {
    ReadinessState::from_wire_value(value).ok_or(WireError::UnknownEnum { field, value })
}

// ---- identity -------------------------------------------------------------------------------

/// Which half of an indexer domain a digest belongs to (for field names).
#[derive(Clone, Copy)]
enum DigestHalf {
    CacheSemantics,
    RoutingScope,
}

impl DigestHalf {
    fn field(self) -> &'static str {
        match self {
            DigestHalf::CacheSemantics => "pool_id.indexer_domain.cache_semantics",
            DigestHalf::RoutingScope => "pool_id.indexer_domain.routing_scope",
        }
    }

    fn digest_field(self) -> &'static str {
        match self {
            DigestHalf::CacheSemantics => "pool_id.indexer_domain.cache_semantics.digest",
            DigestHalf::RoutingScope => "pool_id.indexer_domain.routing_scope.digest",
        }
    }

    fn source_field(self) -> &'static str {
        match self {
            DigestHalf::CacheSemantics => "pool_id.indexer_domain.cache_semantics.source",
            DigestHalf::RoutingScope => "pool_id.indexer_domain.routing_scope.source",
        }
    }
}

/// One digest identity. The source decides how the digest is read, so it is checked first.
fn digest_identity(
    half: DigestHalf,
    identity: Option<&proto::DigestIdentity>,
) -> Result<([u8; DIGEST_BYTES], IdentitySource), WireError> {
    let identity = identity.ok_or(WireError::Missing { field: half.field() })?;
    let source = match identity.source {
        0 => return Err(WireError::Unspecified { field: half.source_field() }),
        value if value == proto::IdentitySource::DefaultDerived as i32 => {
            IdentitySource::DefaultDerived
        }
        value if value == proto::IdentitySource::Explicit as i32 => IdentitySource::Explicit,
        value => return Err(WireError::UnknownEnum { field: half.source_field(), value }),
    };
    let digest = <[u8; DIGEST_BYTES]>::try_from(identity.digest.as_slice()).map_err(|_| {
        WireError::DigestLength { field: half.digest_field(), length: identity.digest.len() }
    })?;
    Ok((digest, source))
}

/// A pool id: identity version 1, both digests present with 16 bytes and a known source.
pub fn validate_pool_id(pool: &proto::KvPoolId) -> Result<PoolId, WireError> {
    match pool.identity_version {
        0 => return Err(WireError::Zero { field: "pool_id.identity_version" }),
        POOL_IDENTITY_VERSION => {}
        found => return Err(WireError::IdentityVersion { found }),
    }
    let domain = pool
        .indexer_domain
        .as_ref()
        .ok_or(WireError::Missing { field: "pool_id.indexer_domain" })?;
    let (cache_digest, cache_source) =
        digest_identity(DigestHalf::CacheSemantics, domain.cache_semantics.as_ref())?;
    let (routing_digest, routing_source) =
        digest_identity(DigestHalf::RoutingScope, domain.routing_scope.as_ref())?;
    Ok(PoolId {
        indexer_domain: IndexerDomainId {
            cache_semantics: CacheSemanticsId { digest: cache_digest, source: cache_source },
            routing_scope: RoutingScopeId { digest: routing_digest, source: routing_source },
        },
        dc_id: DcId(pool.dc_id),
    })
}

/// A CKF format: the one executable v1 shape.
///
/// Order: `format_version` (0 malformed, other than 1 unsupported); then every other field
/// must be nonzero (proto3 cannot tell zero from unset, so a zero seed is malformed too); then
/// 16-bit fingerprints and 4 slots (else unsupported); then the bucket count must fit `usize`
/// and be at most 2^24 (else unsupported) and be a power of two of at least 2 (else malformed).
pub fn validate_ckf_format(format: &proto::CkfFormat) -> Result<CkfFormat, WireError> {
    match format.format_version {
        0 => return Err(WireError::Zero { field: "ckf_format.format_version" }),
        FORMAT_VERSION => {}
        value => {
            return Err(WireError::UnsupportedCkfFormat { field: "format_version", value });
        }
    }
    if format.seed == 0 {
        return Err(WireError::Zero { field: "ckf_format.seed" });
    }
    if format.bucket_count == 0 {
        return Err(WireError::Zero { field: "ckf_format.bucket_count" });
    }
    if format.fingerprint_bits == 0 {
        return Err(WireError::Zero { field: "ckf_format.fingerprint_bits" });
    }
    if format.slots_per_bucket == 0 {
        return Err(WireError::Zero { field: "ckf_format.slots_per_bucket" });
    }
    if format.fingerprint_bits != FINGERPRINT_BITS {
        return Err(WireError::UnsupportedCkfFormat {
            field: "fingerprint_bits",
            value: format.fingerprint_bits,
        });
    }
    if format.slots_per_bucket != SLOTS_PER_BUCKET {
        return Err(WireError::UnsupportedCkfFormat {
            field: "slots_per_bucket",
            value: format.slots_per_bucket,
        });
    }
    let bucket_count = format.bucket_count;
    if usize::try_from(bucket_count).is_err() {
        return Err(WireError::BucketCountOverflow { bucket_count });
    }
    if bucket_count > BUCKET_COUNT_MAX {
        return Err(WireError::BucketCountTooLarge { bucket_count });
    }
    if bucket_count < 2 || !bucket_count.is_power_of_two() {
        return Err(WireError::BucketCountShape { bucket_count });
    }
    let validated = CkfFormat {
        format_version: format.format_version,
        seed: format.seed,
        bucket_count,
        fingerprint_bits: format.fingerprint_bits,
        slots_per_bucket: format.slots_per_bucket,
    };
    debug_assert_eq!(validated.validate(), Ok(()), "the wire checks imply the domain checks");
    Ok(validated)
}

/// A producer identity: valid pool id, `layout_generation != 0`, valid CKF format.
pub fn validate_producer(
    producer: &proto::ProducerIdentity,
) -> Result<ProducerIdentity, WireError> {
    let pool = producer.pool_id.as_ref().ok_or(WireError::Missing { field: "pool_id" })?;
    let pool_id = validate_pool_id(pool)?;
    if producer.layout_generation == 0 {
        return Err(WireError::Zero { field: "layout_generation" });
    }
    let format = producer.ckf_format.as_ref().ok_or(WireError::Missing { field: "ckf_format" })?;
    let format = validate_ckf_format(format)?;
    ProducerIdentity::new(
        pool_id,
        producer.producer_incarnation,
        producer.layout_generation,
        format,
    )
    .map_err(WireError::Producer)
}

// ---- catalog --------------------------------------------------------------------------------

/// An endpoint triple: every segment valid text (and free of `/`, which no endpoint path can
/// hold).
pub fn validate_endpoint(endpoint: &proto::DynamoEndpointId) -> Result<EndpointPath, WireError> {
    check_text("endpoint.namespace", &endpoint.namespace)?;
    check_text("endpoint.component", &endpoint.component)?;
    check_text("endpoint.endpoint", &endpoint.endpoint)?;
    EndpointPath::new(
        endpoint.namespace.as_str(),
        endpoint.component.as_str(),
        endpoint.endpoint.as_str(),
    )
    .map_err(WireError::Endpoint)
}

/// A model target. An unset oneof — the sender chose an alternative this build does not know,
/// or none — is unsupported; it is never read as a base target.
pub fn validate_model_target(target: &proto::ModelTarget) -> Result<ModelTarget, WireError> {
    match &target.target {
        None => Err(WireError::UnsetModelTarget),
        Some(proto::model_target::Target::Base(base)) => {
            check_text("target.base.base_model", &base.base_model)?;
            Ok(ModelTarget::Base { base_model: base.base_model.clone() })
        }
        Some(proto::model_target::Target::Lora(lora)) => {
            check_text("target.lora.base_model", &lora.base_model)?;
            check_text("target.lora.adapter", &lora.adapter)?;
            Ok(ModelTarget::Lora {
                base_model: lora.base_model.clone(),
                adapter: lora.adapter.clone(),
            })
        }
    }
}

/// A model registration: canonical id valid text; target present (missing → malformed) with
/// its oneof set (unset → unsupported); aliases valid text, unique, and none equal to the
/// canonical id.
pub fn validate_registration(
    registration: &proto::ModelRegistration,
) -> Result<ModelRegistration, WireError> {
    check_text("registration.canonical_model_id", &registration.canonical_model_id)?;
    let target =
        registration.target.as_ref().ok_or(WireError::Missing { field: "registration.target" })?;
    let target = validate_model_target(target)?;
    let mut aliases = BTreeSet::new();
    for alias in &registration.aliases {
        check_text("registration.aliases", alias)?;
        if *alias == registration.canonical_model_id || !aliases.insert(alias.clone()) {
            return Err(WireError::Duplicate {
                field: "registration.aliases",
                value: alias.clone(),
            });
        }
    }
    Ok(ModelRegistration {
        canonical_model_id: registration.canonical_model_id.clone(),
        target,
        aliases,
    })
}

/// Query semantics: `kv_block_size > 0`; hash format known and not UNSPECIFIED.
pub fn validate_query_semantics(
    semantics: &proto::KvQuerySemantics,
) -> Result<QuerySemantics, WireError> {
    if semantics.kv_block_size == 0 {
        return Err(WireError::Zero { field: "query_semantics.kv_block_size" });
    }
    let field = "query_semantics.hash_format";
    let hash_format = match proto::KvQueryHashFormat::try_from(semantics.hash_format) {
        Ok(proto::KvQueryHashFormat::DynamoStandardV1) => HashFormat::StandardV1,
        Ok(proto::KvQueryHashFormat::DynamoEagleV1) => HashFormat::EagleV1,
        Ok(proto::KvQueryHashFormat::Unspecified) => {
            return Err(WireError::Unspecified { field });
        }
        Err(_) => return Err(WireError::UnknownEnum { field, value: semantics.hash_format }),
    };
    Ok(QuerySemantics { kv_block_size: semantics.kv_block_size, hash_format })
}

/// A catalog descriptor: producer, endpoint and query semantics present and valid; every
/// registration valid and no canonical id registered twice; pool roles a non-empty valid set.
pub fn validate_descriptor(
    descriptor: &proto::KvPoolDescriptor,
) -> Result<PoolDescriptor, WireError> {
    let producer = descriptor.producer.as_ref().ok_or(WireError::Missing { field: "producer" })?;
    let producer = validate_producer(producer)?;
    let endpoint = descriptor
        .serving_endpoint
        .as_ref()
        .ok_or(WireError::Missing { field: "serving_endpoint" })?;
    let serving_endpoint = validate_endpoint(endpoint)?;
    let mut canonical_ids = BTreeSet::new();
    let mut registrations = Vec::with_capacity(descriptor.registrations.len());
    for registration in &descriptor.registrations {
        let registration = validate_registration(registration)?;
        if !canonical_ids.insert(registration.canonical_model_id.clone()) {
            return Err(WireError::Duplicate {
                field: "registrations.canonical_model_id",
                value: registration.canonical_model_id,
            });
        }
        registrations.push(registration);
    }
    let semantics = descriptor
        .query_semantics
        .as_ref()
        .ok_or(WireError::Missing { field: "query_semantics" })?;
    let query_semantics = validate_query_semantics(semantics)?;
    let pool_roles = non_empty_role_set("pool_roles", &descriptor.pool_roles)?;
    Ok(PoolDescriptor { producer, serving_endpoint, registrations, query_semantics, pool_roles })
}

// ---- readiness ------------------------------------------------------------------------------

/// An adapter's readiness: canonical id valid text, state known, missing roles a valid set.
pub fn validate_adapter(adapter: &proto::AdapterReadiness) -> Result<AdapterReadiness, WireError> {
    check_text("adapters.canonical_model_id", &adapter.canonical_model_id)?;
    let state = readiness_state("adapters.state", adapter.state)?;
    let missing_roles = role_set("adapters.missing_roles", &adapter.missing_roles)?;
    Ok(AdapterReadiness {
        canonical_model_id: adapter.canonical_model_id.clone(),
        state,
        missing_roles,
    })
}

/// A topology member of an entry in `entry_namespace`: endpoint valid and in the entry's
/// namespace, roles a non-empty valid set, optional pool id valid.
fn validate_member(
    member: &proto::TopologyMember,
    entry_namespace: &str,
) -> Result<TopologyMember, WireError> {
    let endpoint =
        member.endpoint.as_ref().ok_or(WireError::Missing { field: "members.endpoint" })?;
    let endpoint = validate_endpoint(endpoint)?;
    if endpoint.namespace() != entry_namespace {
        return Err(WireError::MemberNamespace {
            member: endpoint.namespace().to_owned(),
            entry: entry_namespace.to_owned(),
        });
    }
    let roles = non_empty_role_set("members.roles", &member.roles)?;
    let pool_id = member.pool_id.as_ref().map(validate_pool_id).transpose()?;
    Ok(TopologyMember { endpoint, roles, pool_id })
}

/// The key of a readiness entry; an entry whose key is not valid text cannot be identified.
pub fn topology_key(entry: &proto::TopologyEntry) -> Result<TopologyKey, WireError> {
    check_text("namespace", &entry.namespace)?;
    check_text("canonical_model_id", &entry.canonical_model_id)?;
    Ok(TopologyKey {
        namespace: entry.namespace.clone(),
        canonical_model_id: entry.canonical_model_id.clone(),
    })
}

/// A readiness entry (every rule of §3.4):
///
/// - namespace and model valid text; state a known value (UNKNOWN is valid);
/// - present and missing roles valid sets (no unknown, no UNSPECIFIED, no duplicate);
/// - at least one member; each member valid, in the entry's namespace, with a non-empty valid
///   role set and an optional valid pool id; members unique by their
///   `(namespace, component, endpoint)` tuple (never by a joined string, so dots inside a
///   component cannot make two members collide or two collisions look distinct);
/// - `duplicate_role_endpoints` a valid set holding only PREFILL and DECODE;
/// - adapters unique by id, each with a known state and a valid missing-role set.
///
/// Members and adapters keep their wire order.
pub fn validate_topology_entry(entry: &proto::TopologyEntry) -> Result<TopologyEntry, WireError> {
    let key = topology_key(entry)?;
    let state = readiness_state("state", entry.state)?;
    let present_roles = role_set("present_roles", &entry.present_roles)?;
    let missing_roles = role_set("missing_roles", &entry.missing_roles)?;
    if entry.members.is_empty() {
        return Err(WireError::Empty { field: "members" });
    }
    let mut member_endpoints = BTreeSet::new();
    let mut members = Vec::with_capacity(entry.members.len());
    for member in &entry.members {
        let member = validate_member(member, &key.namespace)?;
        if !member_endpoints.insert(member.endpoint.clone()) {
            return Err(WireError::Duplicate {
                field: "members.endpoint",
                value: member.endpoint.to_string(),
            });
        }
        members.push(member);
    }
    let duplicate_role_endpoints =
        role_set("duplicate_role_endpoints", &entry.duplicate_role_endpoints)?;
    if let Some(&role) = duplicate_role_endpoints
        .iter()
        .find(|role| !matches!(role, WorkerRole::Prefill | WorkerRole::Decode))
    {
        return Err(WireError::RoleNotAllowed { field: "duplicate_role_endpoints", role });
    }
    let mut adapter_ids = BTreeSet::new();
    let mut adapters = Vec::with_capacity(entry.adapters.len());
    for adapter in &entry.adapters {
        let adapter = validate_adapter(adapter)?;
        if !adapter_ids.insert(adapter.canonical_model_id.clone()) {
            return Err(WireError::Duplicate {
                field: "adapters.canonical_model_id",
                value: adapter.canonical_model_id,
            });
        }
        adapters.push(adapter);
    }
    Ok(TopologyEntry {
        namespace: key.namespace,
        canonical_model_id: key.canonical_model_id,
        state,
        present_roles,
        missing_roles,
        members,
        duplicate_role_endpoints,
        legacy_fallback_active: entry.legacy_fallback_active,
        adapters,
    })
}

// ---- load -----------------------------------------------------------------------------------

/// One pool's load as a consumer reads it: unset sums are `None`, never zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLoad {
    /// The producer generation the load belongs to.
    pub producer: ProducerIdentity,
    /// Occupied blocks; present only when every expected rank reported
    /// (`kv_observed_ranks == kv_expected_ranks > 0`), whatever number the field carried.
    pub kv_used_blocks: Option<u64>,
    /// Capacity; `None` when the field is 0 (unknown capacity, never zero capacity).
    pub total_kv_blocks: Option<u64>,
    /// Expected ranks that reported.
    pub kv_observed_ranks: u32,
    /// Ranks the pool's workers declare.
    pub kv_expected_ranks: u32,
}

impl PoolLoad {
    /// Whether every expected rank reported (and there is at least one).
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.kv_expected_ranks > 0 && self.kv_observed_ranks == self.kv_expected_ranks
    }
}

/// A load entry: producer present and valid; observed ranks never exceed expected ranks.
pub fn validate_load_entry(entry: &proto::KvPoolLoadEntry) -> Result<PoolLoad, WireError> {
    let producer = entry.producer.as_ref().ok_or(WireError::Missing { field: "producer" })?;
    let producer = validate_producer(producer)?;
    if entry.kv_observed_ranks > entry.kv_expected_ranks {
        return Err(WireError::RankCoverage {
            observed: entry.kv_observed_ranks,
            expected: entry.kv_expected_ranks,
        });
    }
    let complete =
        entry.kv_expected_ranks > 0 && entry.kv_observed_ranks == entry.kv_expected_ranks;
    Ok(PoolLoad {
        producer,
        kv_used_blocks: complete.then_some(entry.kv_used_blocks),
        total_kv_blocks: (entry.total_kv_blocks != 0).then_some(entry.total_kv_blocks),
        kv_observed_ranks: entry.kv_observed_ranks,
        kv_expected_ranks: entry.kv_expected_ranks,
    })
}

// ---- keys and quarantine --------------------------------------------------------------------

/// The canonical encoding of a `KvPoolId` this build cannot interpret (an unknown identity
/// version or source): comparable, so such a pool can be quarantined and checked for
/// duplicates without being understood.
///
/// prost writes known fields in field order and drops unknown ones, so equal field values give
/// equal keys.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WirePoolKey(Vec<u8>);

impl WirePoolKey {
    /// The key of `pool`.
    #[must_use]
    pub fn of(pool: &proto::KvPoolId) -> Self {
        WirePoolKey(pool.encode_to_vec())
    }

    /// The encoded bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Display for WirePoolKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("wire:")?;
        for byte in &self.0 {
            write!(formatter, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// The identity of a catalog or load entry as far as it can be read.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolRef {
    /// A valid v1 pool id.
    Known(PoolId),
    /// A well-formed pool id this build does not understand (unknown version or source).
    Unrecognized(WirePoolKey),
}

impl fmt::Display for PoolRef {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolRef::Known(pool_id) => write!(formatter, "{pool_id}"),
            PoolRef::Unrecognized(key) => write!(formatter, "{key}"),
        }
    }
}

/// Read the identity of an entry from its (optional) pool id: a valid id is known, an
/// unsupported one is unrecognized but still a trustworthy key, a missing or malformed one
/// cannot be identified.
fn pool_ref(pool: Option<&proto::KvPoolId>, field: &'static str) -> Result<PoolRef, WireError> {
    let pool = pool.ok_or(WireError::Missing { field })?;
    match validate_pool_id(pool) {
        Ok(pool_id) => Ok(PoolRef::Known(pool_id)),
        Err(error) if error.is_unsupported() => Ok(PoolRef::Unrecognized(WirePoolKey::of(pool))),
        Err(error) => Err(error),
    }
}

/// The identity of a producer identity's pool (see [`pool_ref`]).
fn producer_pool_ref(producer: Option<&proto::ProducerIdentity>) -> Result<PoolRef, WireError> {
    let producer = producer.ok_or(WireError::Missing { field: "producer" })?;
    pool_ref(producer.pool_id.as_ref(), "producer.pool_id")
}

/// An entry whose key is trustworthy but whose content failed validation: the consumer keeps
/// no state for it (never the previous state as a fallback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined<K> {
    /// The entry's key.
    pub key: K,
    /// Why it was quarantined.
    pub error: WireError,
}

// ---- whole updates --------------------------------------------------------------------------

/// A validated catalog message: the usable pools and the quarantined ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogUpdate {
    /// The relay that sent it.
    pub relay: RelayIdentity,
    /// The catalog revision.
    pub revision: u64,
    /// Valid descriptors, in wire order; pool ids are unique.
    pub pools: Vec<PoolDescriptor>,
    /// Descriptors with a readable pool key that failed validation.
    pub quarantined: Vec<Quarantined<PoolRef>>,
}

/// Validate a catalog message. The plane fails on an invalid envelope, a missing snapshot, a
/// descriptor whose pool id cannot be read, or a pool id listed twice.
pub fn validate_catalog_update(
    update: &proto::KvPoolCatalogUpdate,
) -> Result<CatalogUpdate, PlaneError> {
    let relay =
        check_envelope(update.contract_marker, update.protocol_version, update.relay.as_ref())
            .map_err(PlaneError::Envelope)?;
    let snapshot = update
        .snapshot
        .as_ref()
        .ok_or(PlaneError::Envelope(WireError::Missing { field: "snapshot" }))?;
    let mut keys = BTreeSet::new();
    let mut pools = Vec::with_capacity(snapshot.pools.len());
    let mut quarantined = Vec::new();
    for (index, descriptor) in snapshot.pools.iter().enumerate() {
        let key = producer_pool_ref(descriptor.producer.as_ref())
            .map_err(|error| PlaneError::Unidentifiable { index, error })?;
        if !keys.insert(key.clone()) {
            return Err(PlaneError::DuplicateKey { index, key: key.to_string() });
        }
        match validate_descriptor(descriptor) {
            Ok(descriptor) => pools.push(descriptor),
            Err(error) => quarantined.push(Quarantined { key, error }),
        }
    }
    Ok(CatalogUpdate { relay, revision: update.revision, pools, quarantined })
}

/// A validated readiness message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadinessUpdate {
    /// The relay that sent it.
    pub relay: RelayIdentity,
    /// The topology revision (a heartbeat repeats it).
    pub revision: u64,
    /// Valid entries, in wire order; keys are unique.
    pub entries: Vec<TopologyEntry>,
    /// Entries with a readable key that failed validation (including unknown states and roles):
    /// never to be read as READY.
    pub quarantined: Vec<Quarantined<TopologyKey>>,
}

/// Validate a readiness message. The plane fails on an invalid envelope, an entry whose
/// `(namespace, canonical_model_id)` is not valid text, or a key listed twice.
pub fn validate_readiness_update(
    update: &proto::ServingReadinessUpdate,
) -> Result<ReadinessUpdate, PlaneError> {
    let relay =
        check_envelope(update.contract_marker, update.protocol_version, update.relay.as_ref())
            .map_err(PlaneError::Envelope)?;
    let mut keys = BTreeSet::new();
    let mut entries = Vec::with_capacity(update.entries.len());
    let mut quarantined = Vec::new();
    for (index, entry) in update.entries.iter().enumerate() {
        let key =
            topology_key(entry).map_err(|error| PlaneError::Unidentifiable { index, error })?;
        if !keys.insert(key.clone()) {
            return Err(PlaneError::DuplicateKey {
                index,
                key: format!("{}/{}", key.namespace, key.canonical_model_id),
            });
        }
        match validate_topology_entry(entry) {
            Ok(entry) => entries.push(entry),
            Err(error) => quarantined.push(Quarantined { key, error }),
        }
    }
    Ok(ReadinessUpdate { relay, revision: update.revision, entries, quarantined })
}

/// A validated load window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadUpdate {
    /// The relay that sent it.
    pub relay: RelayIdentity,
    /// Window number (strictly increasing per relay incarnation).
    pub window_sequence: u64,
    /// Producer wall clock at window build, unix ms (use local receive time for freshness).
    pub observed_ms: u64,
    /// The window interval.
    pub window_ms: u64,
    /// Valid entries, in wire order; producers are unique.
    pub pools: Vec<PoolLoad>,
    /// Entries with a readable pool key that failed validation.
    pub quarantined: Vec<Quarantined<PoolRef>>,
}

/// Validate a load window. The plane fails on an invalid envelope, an entry whose pool id
/// cannot be read, or one producer listed twice (entries are keyed by producer, so two
/// generations of one pool may share a window).
pub fn validate_load_update(update: &proto::KvPoolLoadUpdate) -> Result<LoadUpdate, PlaneError> {
    let relay =
        check_envelope(update.contract_marker, update.protocol_version, update.relay.as_ref())
            .map_err(PlaneError::Envelope)?;
    let mut producers = BTreeSet::new();
    let mut pools = Vec::with_capacity(update.pools.len());
    let mut quarantined = Vec::new();
    for (index, entry) in update.pools.iter().enumerate() {
        let key = producer_pool_ref(entry.producer.as_ref())
            .map_err(|error| PlaneError::Unidentifiable { index, error })?;
        // The producer is present (the key was read from it); its canonical encoding names it
        // whether or not it validates.
        let producer_bytes =
            entry.producer.as_ref().map(Message::encode_to_vec).unwrap_or_default();
        if !producers.insert(producer_bytes) {
            return Err(PlaneError::DuplicateKey { index, key: key.to_string() });
        }
        match validate_load_entry(entry) {
            Ok(load) => pools.push(load),
            Err(error) => quarantined.push(Quarantined { key, error }),
        }
    }
    Ok(LoadUpdate {
        relay,
        window_sequence: update.window_sequence,
        observed_ms: update.observed_ms,
        window_ms: update.window_ms,
        pools,
        quarantined,
    })
}

// ---- filter stream --------------------------------------------------------------------------

/// A validated `FilterUpdate`: the envelope's identities and the frame for the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilterEnvelope<'a> {
    /// The relay that sent it.
    pub relay: RelayIdentity,
    /// The producer generation it belongs to.
    pub producer: ProducerIdentity,
    /// Producer wall clock at send, µs (diagnostic; freshness uses local time).
    pub send_ts_us: u64,
    /// The frame, borrowing the payload.
    pub frame: FilterFrame<'a>,
}

/// Validate a `FilterUpdate` envelope: contract, relay, producer, a known kind, and the
/// sequence/payload shape of that kind (snapshot chunk: `base == sequence`, payload present;
/// delta: `sequence == base + 1`, payload present; heartbeat: `base == sequence`, no payload).
/// The CBI1 payload itself is checked by the replica against the catalog's format.
///
/// An unknown nonzero kind is unsupported (no new mandatory frame kinds exist in v1); either
/// way only this pool's replica is invalidated.
pub fn validate_filter_update(
    update: &proto::FilterUpdate,
) -> Result<FilterEnvelope<'_>, WireError> {
    let relay =
        check_envelope(update.contract_marker, update.protocol_version, update.relay.as_ref())?;
    let producer = update.producer.as_ref().ok_or(WireError::Missing { field: "producer" })?;
    let producer = validate_producer(producer)?;
    let base_sequence = update.base_sequence;
    let sequence = update.sequence;
    let payload: &[u8] = &update.payload[..];
    let relation = |kind| WireError::SequenceRelation { kind, base_sequence, sequence };
    let frame = match proto::FilterUpdateKind::try_from(update.kind) {
        Ok(proto::FilterUpdateKind::SnapshotChunk) => {
            let kind = "snapshot chunk";
            if base_sequence != sequence {
                return Err(relation(kind));
            }
            if payload.is_empty() {
                return Err(WireError::Payload { kind, expectation: "needs a CBI1 payload" });
            }
            FilterFrame::SnapshotChunk { base_sequence, sequence, payload }
        }
        Ok(proto::FilterUpdateKind::Delta) => {
            let kind = "delta";
            if base_sequence.checked_add(1) != Some(sequence) {
                return Err(relation(kind));
            }
            if payload.is_empty() {
                return Err(WireError::Payload { kind, expectation: "needs a CBI1 payload" });
            }
            FilterFrame::Delta { base_sequence, sequence, payload }
        }
        Ok(proto::FilterUpdateKind::Heartbeat) => {
            let kind = "heartbeat";
            if base_sequence != sequence {
                return Err(relation(kind));
            }
            if !payload.is_empty() {
                return Err(WireError::Payload { kind, expectation: "must carry no payload" });
            }
            FilterFrame::Heartbeat { base_sequence, sequence }
        }
        Ok(proto::FilterUpdateKind::Unspecified) => {
            return Err(WireError::Unspecified { field: "kind" });
        }
        Err(_) => return Err(WireError::UnknownEnum { field: "kind", value: update.kind }),
    };
    Ok(FilterEnvelope { relay, producer, send_ts_us: update.send_ts_us, frame })
}
