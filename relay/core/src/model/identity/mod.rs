//! Identity of pools, producers and relays (relay-facts §2).
//!
//! A consumer in another data center must be able to tell, from identifiers alone, whether two
//! cuckoo filters answer the same question. This module derives and carries those identifiers:
//!
//! - [`IndexerDomainId`]: *what* a filter's hashes mean (cache semantics: model source, block size,
//!   hash format) and *where* the cached prefixes can be served (routing scope: the serving
//!   endpoint). Both halves are 16-byte BLAKE3 digests of canonical, length-framed material, tagged
//!   with whether the material was derived from defaults or supplied explicitly.
//! - [`DcId`]: the data-center dimension, derived from the operator's stable `--dc-id` string.
//! - [`PoolId`]: one indexer domain in one data center; the unit of publication.
//! - [`ProducerIdentity`]: one concrete publication of a pool (relay incarnation, layout
//!   generation, CKF format); its [`ProducerKey`] is the frozen v1 equality key that fences CKF
//!   subscriptions across restarts and re-materializations.
//! - [`RelayIdentity`]: the relay process itself.
//!
//! Invariants kept here:
//! - The derivation bytes are frozen by the v1 contract and pinned by golden vectors; identity
//!   composition cannot change under `dynamo.kvrelay.v1`.
//! - Digest identities compare digest **and** source, and default and explicit material hash
//!   under different tags, so the two never alias.
//! - Explicit material replaces the default inputs of its dimension, but block size and hash
//!   format are always part of cache semantics.
//! - Everything is pure and total: inputs are validated into typed errors, nothing panics, and
//!   the only randomness (the relay incarnation) comes from an injected generator.

mod derivation;
mod digest;
mod explicit;
mod producer;

pub use derivation::{
    EndpointPath, EndpointPathError, EndpointSegment, IdentityError, cache_semantics_id,
    resolve_indexer_domain, routing_scope_id,
};
pub use digest::{
    CacheSemanticsId, DcId, DcIdError, IdentitySource, IdentitySourceError, IndexerDomainId,
    POOL_IDENTITY_VERSION, PoolId, RoutingScopeId, stable_dc_id,
};
pub use explicit::{
    EXPLICIT_IDENTITY_ENTRIES_MAX, EXPLICIT_IDENTITY_KEY_BYTES_MAX,
    EXPLICIT_IDENTITY_VALUE_BYTES_MAX, ExplicitIdentityMap, ExplicitIdentityMapError,
    IndexerIdentitySpec,
};
pub use producer::{
    LaneLease, ProducerIdentity, ProducerIdentityError, ProducerKey, RELAY_INCARNATION_MASK,
    RelayIdentity, new_relay_incarnation,
};
