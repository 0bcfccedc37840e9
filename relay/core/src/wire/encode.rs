//! Domain → proto: the messages the relay sends (relay-facts §3.1–§3.3).
//!
//! Every function here is pure and total: it maps already-valid domain values onto the
//! generated `dynamo.kvrelay.v1` messages, stamping every top-level response with
//! `protocol_version = 1`, the relay identity and `contract_marker = 0x4B565231`. Nothing is
//! validated or reordered: the domain layers already keep their invariants (catalog in pool-id
//! order, roles in wire order, entries sorted), and the output mirrors them field for field, so
//! `validate` of an encoded value gives the value back.
//!
//! # Filter payloads and copies
//!
//! A full snapshot chunk is 4 MiB. The builders take the CBI1 frame as [`Bytes`] and move it
//! into the message without touching its bytes. As long as the generated `payload` field is a
//! `Vec<u8>` (prost's default), a uniquely owned `Bytes` made from a `Vec<u8>` converts back
//! without copying, but a frame shared by several subscribers is copied once per subscriber
//! (and once more when tonic encodes the message into its send buffer). Configuring the
//! generator with `bytes([".dynamo.kvrelay.v1.FilterUpdate.payload"])` makes the field a
//! `Bytes`, after which handing one frame to N subscribers is N reference-count increments; the
//! builders here compile unchanged against either field type.

use bytes::Bytes;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::{CONTRACT_MARKER, PROTOCOL_VERSION};

use crate::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use crate::filter::ckf::CkfFormat;
use crate::host::{CatalogSnapshot, PoolDescriptor};
use crate::load::{LoadWindow, PoolLoadSnapshot};
use crate::model::hashing::HashFormat;
use crate::model::identity::{
    EndpointPath, IdentitySource, POOL_IDENTITY_VERSION, PoolId, ProducerIdentity, RelayIdentity,
};
use crate::readiness::topology::{AdapterReadiness, TopologyEntry, TopologyMember};

/// The relay identity message.
#[must_use]
pub fn relay_identity(relay: &RelayIdentity) -> proto::RelayIdentity {
    proto::RelayIdentity {
        drt_instance_id: relay.drt_instance_id,
        relay_incarnation: relay.relay_incarnation,
    }
}

/// The `GetRelayInfo` response.
#[must_use]
pub fn relay_info(relay: &RelayIdentity) -> proto::RelayInfo {
    proto::RelayInfo {
        protocol_version: PROTOCOL_VERSION,
        relay: Some(relay_identity(relay)),
        contract_marker: CONTRACT_MARKER,
    }
}

/// The wire value of an identity source.
fn identity_source(source: IdentitySource) -> i32 {
    match source {
        IdentitySource::DefaultDerived => proto::IdentitySource::DefaultDerived as i32,
        IdentitySource::Explicit => proto::IdentitySource::Explicit as i32,
    }
}

/// The wire value of a hash format.
#[must_use]
pub fn hash_format(format: HashFormat) -> i32 {
    match format {
        HashFormat::StandardV1 => proto::KvQueryHashFormat::DynamoStandardV1 as i32,
        HashFormat::EagleV1 => proto::KvQueryHashFormat::DynamoEagleV1 as i32,
    }
}

/// The wire value of a worker role.
#[must_use]
pub fn worker_role(role: WorkerRole) -> i32 {
    role.wire_value()
}

/// A role set in wire order (a `BTreeSet<WorkerRole>` iterates in wire value order).
fn roles<'a>(roles: impl IntoIterator<Item = &'a WorkerRole>) -> Vec<i32> {
    roles.into_iter().copied().map(worker_role).collect()
}

/// A pool id, with the v1 identity version added at the wire boundary.
#[must_use]
pub fn pool_id(pool: &PoolId) -> proto::KvPoolId {
    let domain = &pool.indexer_domain;
    proto::KvPoolId {
        identity_version: POOL_IDENTITY_VERSION,
        indexer_domain: Some(proto::IndexerDomainId {
            cache_semantics: Some(proto::DigestIdentity {
                digest: domain.cache_semantics.digest.to_vec(),
                source: identity_source(domain.cache_semantics.source),
            }),
            routing_scope: Some(proto::DigestIdentity {
                digest: domain.routing_scope.digest.to_vec(),
                source: identity_source(domain.routing_scope.source),
            }),
        }),
        dc_id: pool.dc_id.0,
    }
}

/// A CKF format, all five fields.
#[must_use]
pub fn ckf_format(format: &CkfFormat) -> proto::CkfFormat {
    proto::CkfFormat {
        format_version: format.format_version,
        seed: format.seed,
        bucket_count: format.bucket_count,
        fingerprint_bits: format.fingerprint_bits,
        slots_per_bucket: format.slots_per_bucket,
    }
}

/// A producer identity: the frozen v1 subscription key.
#[must_use]
pub fn producer(producer: &ProducerIdentity) -> proto::ProducerIdentity {
    proto::ProducerIdentity {
        pool_id: Some(pool_id(&producer.pool_id())),
        producer_incarnation: producer.producer_incarnation(),
        layout_generation: producer.layout_generation(),
        ckf_format: Some(ckf_format(&producer.format())),
    }
}

/// A serving endpoint triple.
#[must_use]
pub fn endpoint(path: &EndpointPath) -> proto::DynamoEndpointId {
    proto::DynamoEndpointId {
        namespace: path.namespace().to_owned(),
        component: path.component().to_owned(),
        endpoint: path.endpoint().to_owned(),
    }
}

/// A model target: the base model or a LoRA adapter over it.
#[must_use]
pub fn model_target(target: &ModelTarget) -> proto::ModelTarget {
    let target = match target {
        ModelTarget::Base { base_model } => {
            proto::model_target::Target::Base(proto::BaseModelTarget {
                base_model: base_model.clone(),
            })
        }
        ModelTarget::Lora { base_model, adapter } => {
            proto::model_target::Target::Lora(proto::LoraModelTarget {
                base_model: base_model.clone(),
                adapter: adapter.clone(),
            })
        }
    };
    proto::ModelTarget { target: Some(target) }
}

/// A model registration; aliases in sorted order.
#[must_use]
pub fn registration(registration: &ModelRegistration) -> proto::ModelRegistration {
    proto::ModelRegistration {
        canonical_model_id: registration.canonical_model_id.clone(),
        target: Some(model_target(&registration.target)),
        aliases: registration.aliases.iter().cloned().collect(),
    }
}

/// Block size and hash format.
#[must_use]
pub fn query_semantics(semantics: &QuerySemantics) -> proto::KvQuerySemantics {
    proto::KvQuerySemantics {
        kv_block_size: semantics.kv_block_size,
        hash_format: hash_format(semantics.hash_format),
    }
}

/// One catalog entry.
#[must_use]
pub fn descriptor(descriptor: &PoolDescriptor) -> proto::KvPoolDescriptor {
    proto::KvPoolDescriptor {
        producer: Some(producer(&descriptor.producer)),
        serving_endpoint: Some(endpoint(&descriptor.serving_endpoint)),
        registrations: descriptor.registrations.iter().map(registration).collect(),
        query_semantics: Some(query_semantics(&descriptor.query_semantics)),
        pool_roles: roles(&descriptor.pool_roles),
    }
}

/// One `WatchKvPoolCatalog` message: the complete catalog at its revision. The snapshot field
/// is always present, also for the empty catalog.
#[must_use]
pub fn catalog_update(
    relay: &RelayIdentity,
    snapshot: &CatalogSnapshot,
) -> proto::KvPoolCatalogUpdate {
    proto::KvPoolCatalogUpdate {
        protocol_version: PROTOCOL_VERSION,
        relay: Some(relay_identity(relay)),
        revision: snapshot.revision,
        snapshot: Some(proto::KvPoolCatalogSnapshot {
            pools: snapshot.pools.iter().map(descriptor).collect(),
        }),
        contract_marker: CONTRACT_MARKER,
    }
}

/// One topology member.
#[must_use]
pub fn topology_member(member: &TopologyMember) -> proto::TopologyMember {
    proto::TopologyMember {
        endpoint: Some(endpoint(&member.endpoint)),
        roles: roles(&member.roles),
        pool_id: member.pool_id.as_ref().map(pool_id),
    }
}

/// One adapter's readiness.
#[must_use]
pub fn adapter_readiness(adapter: &AdapterReadiness) -> proto::AdapterReadiness {
    proto::AdapterReadiness {
        canonical_model_id: adapter.canonical_model_id.clone(),
        state: adapter.state.wire_value(),
        missing_roles: roles(&adapter.missing_roles),
    }
}

/// One readiness entry.
#[must_use]
pub fn topology_entry(entry: &TopologyEntry) -> proto::TopologyEntry {
    proto::TopologyEntry {
        namespace: entry.namespace.clone(),
        canonical_model_id: entry.canonical_model_id.clone(),
        state: entry.state.wire_value(),
        present_roles: roles(&entry.present_roles),
        missing_roles: roles(&entry.missing_roles),
        members: entry.members.iter().map(topology_member).collect(),
        duplicate_role_endpoints: roles(&entry.duplicate_role_endpoints),
        legacy_fallback_active: entry.legacy_fallback_active,
        adapters: entry.adapters.iter().map(adapter_readiness).collect(),
    }
}

/// One `SubscribeServingReadiness` message: every entry at `revision` (a heartbeat repeats the
/// current revision).
#[must_use]
pub fn readiness_update(
    relay: &RelayIdentity,
    revision: u64,
    entries: &[TopologyEntry],
) -> proto::ServingReadinessUpdate {
    proto::ServingReadinessUpdate {
        protocol_version: PROTOCOL_VERSION,
        relay: Some(relay_identity(relay)),
        revision,
        entries: entries.iter().map(topology_entry).collect(),
        contract_marker: CONTRACT_MARKER,
    }
}

/// One pool's load entry. Unset sums travel as 0 ([`PoolLoadSnapshot::to_wire`]); coverage is
/// read from the rank counts.
#[must_use]
pub fn load_entry(pool: &ProducerIdentity, load: &PoolLoadSnapshot) -> proto::KvPoolLoadEntry {
    let numbers = load.to_wire();
    proto::KvPoolLoadEntry {
        producer: Some(producer(pool)),
        kv_used_blocks: numbers.kv_used_blocks,
        total_kv_blocks: numbers.total_kv_blocks,
        kv_observed_ranks: numbers.kv_observed_ranks,
        kv_expected_ranks: numbers.kv_expected_ranks,
    }
}

/// One `SubscribeKvPoolLoad` message: a complete window, pools in producer order.
#[must_use]
pub fn load_update(
    relay: &RelayIdentity,
    window: &LoadWindow<ProducerIdentity>,
) -> proto::KvPoolLoadUpdate {
    proto::KvPoolLoadUpdate {
        protocol_version: PROTOCOL_VERSION,
        relay: Some(relay_identity(relay)),
        window_sequence: window.window_sequence,
        observed_ms: window.observed_ms,
        window_ms: window.window_ms,
        pools: window.pools.iter().map(|entry| load_entry(&entry.pool, &entry.load)).collect(),
        contract_marker: CONTRACT_MARKER,
    }
}

/// Move a payload into whatever type the generated `payload` field has (`Vec<u8>` or
/// `Bytes`): generic so the conversion compiles, without a redundant-conversion lint, either
/// way.
fn payload_field<T: From<Bytes>>(payload: Bytes) -> T {
    T::from(payload)
}

/// Builds the `FilterUpdate` envelopes of one pool stream: the relay identity and the producer
/// are encoded once and stamped on every frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterEncoder {
    relay: proto::RelayIdentity,
    producer: proto::ProducerIdentity,
}

impl FilterEncoder {
    /// An encoder for the stream of `producer`, served by `relay`.
    #[must_use]
    pub fn new(relay: &RelayIdentity, producer: &ProducerIdentity) -> Self {
        FilterEncoder { relay: relay_identity(relay), producer: self::producer(producer) }
    }

    fn frame(
        &self,
        kind: proto::FilterUpdateKind,
        base_sequence: u64,
        sequence: u64,
        send_ts_us: u64,
        payload: Bytes,
    ) -> proto::FilterUpdate {
        proto::FilterUpdate {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(self.relay),
            producer: Some(self.producer.clone()),
            base_sequence,
            sequence,
            send_ts_us,
            kind: kind as i32,
            payload: payload_field(payload),
            contract_marker: CONTRACT_MARKER,
        }
    }

    /// One snapshot chunk of the snapshot at `sequence` (`base_sequence == sequence`).
    #[must_use]
    pub fn snapshot_chunk(
        &self,
        sequence: u64,
        send_ts_us: u64,
        payload: Bytes,
    ) -> proto::FilterUpdate {
        self.frame(proto::FilterUpdateKind::SnapshotChunk, sequence, sequence, send_ts_us, payload)
    }

    /// One delta `base_sequence → sequence` (the publisher's pair; `sequence` is
    /// `base_sequence + 1`).
    #[must_use]
    pub fn delta(
        &self,
        base_sequence: u64,
        sequence: u64,
        send_ts_us: u64,
        payload: Bytes,
    ) -> proto::FilterUpdate {
        self.frame(proto::FilterUpdateKind::Delta, base_sequence, sequence, send_ts_us, payload)
    }

    /// A heartbeat naming the current `sequence`, with an empty payload.
    #[must_use]
    pub fn heartbeat(&self, sequence: u64, send_ts_us: u64) -> proto::FilterUpdate {
        self.frame(proto::FilterUpdateKind::Heartbeat, sequence, sequence, send_ts_us, Bytes::new())
    }
}
