//! The pool catalog: every active pool's descriptor, under one revision counter
//! (relay-facts §3.3, §3.6).
//!
//! The catalog is what `WatchKvPoolCatalog` streams: a complete snapshot after every change, no
//! tombstones (a pool missing from the next snapshot is withdrawn). It holds only pools whose
//! pool machine runs and whose generation is publishable; withdrawal is the authoritative signal that a
//! generation is gone, so it always happens before the pool is torn down (the host orders that).
//!
//! Invariants:
//! - one serving endpoint has at most one active pool, and one [`PoolId`] at most one endpoint;
//!   an upsert that would break either is refused with a typed [`CatalogError`] and changes
//!   nothing;
//! - an active pool's producer never changes in place: a new generation of a pool is a
//!   withdrawal followed by a new upsert, so a consumer can never see new metadata (a new model)
//!   under the old producer by way of a producer swap;
//! - the revision is 0 for the empty catalog and grows by exactly 1 for every change (attach,
//!   metadata refresh, withdrawal); an upsert that changes nothing leaves it alone;
//! - descriptors iterate in [`PoolId`] order, so snapshots are canonical.
//!
//! Bound: one entry per active pool, which is at most one per discovered serving endpoint.

use std::collections::{BTreeMap, BTreeSet};

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use thiserror::Error;

use crate::discovery::{ModelRegistration, QuerySemantics, WorkerRole};
use crate::model::identity::{
    EndpointPath, IdentitySource, POOL_IDENTITY_VERSION, PoolId, ProducerIdentity,
};

/// One active pool as consumers see it (`KvPoolDescriptor`).
///
/// Only `producer` is identity: every other field is metadata that may be refreshed in place
/// under the same producer without restarting a CKF subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolDescriptor {
    /// The publication consumers subscribe to; its pool id keys the catalog.
    pub producer: ProducerIdentity,
    /// The Dynamo endpoint that serves the pool's cached prefixes.
    pub serving_endpoint: EndpointPath,
    /// Request-facing bindings, sorted by `(canonical_model_id, target)`.
    pub registrations: Vec<ModelRegistration>,
    /// Block size and hash format a consumer must hash prompts with.
    pub query_semantics: QuerySemantics,
    /// Roles of the endpoint's workers, in wire order.
    pub pool_roles: BTreeSet<WorkerRole>,
}

impl PoolDescriptor {
    /// The pool this descriptor publishes.
    #[must_use]
    pub fn pool_id(&self) -> PoolId {
        self.producer.pool_id()
    }

    /// The producer's layout generation.
    #[must_use]
    pub fn layout_generation(&self) -> u64 {
        self.producer.layout_generation()
    }
}

/// Why the catalog refused a change. A refused change changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CatalogError {
    /// The pool is already active for another serving endpoint (two endpoints claiming one pool
    /// are fenced upstream, never merged).
    #[error("pool {pool_id} is already active for endpoint {owner}")]
    PoolOwnedByOtherEndpoint {
        /// The contested pool.
        pool_id: PoolId,
        /// The endpoint it is active for.
        owner: EndpointPath,
    },
    /// The endpoint already has another active pool.
    #[error("endpoint {endpoint} already has active pool {active}")]
    EndpointHasOtherPool {
        /// The endpoint.
        endpoint: EndpointPath,
        /// Its active pool.
        active: PoolId,
    },
    /// The pool is active under another producer; a new generation must withdraw the old one
    /// first.
    #[error(
        "pool {pool_id} is active under layout generation {active_layout_generation}, \
         not {offered_layout_generation} (or the producer differs otherwise)"
    )]
    ProducerMismatch {
        /// The pool.
        pool_id: PoolId,
        /// Layout generation of the active producer.
        active_layout_generation: u64,
        /// Layout generation of the refused producer.
        offered_layout_generation: u64,
    },
    /// No generation of the pool is active.
    #[error("pool {pool_id} is not active")]
    PoolNotActive {
        /// The pool.
        pool_id: PoolId,
    },
}

/// What an accepted upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a changed catalog must be published"]
pub enum CatalogChange {
    /// A new pool became active; the catalog is now at `revision`.
    Attached {
        /// The new catalog revision.
        revision: u64,
    },
    /// An active pool's metadata changed under the same producer; the catalog is now at
    /// `revision`.
    Refreshed {
        /// The new catalog revision.
        revision: u64,
    },
    /// The descriptor was already active exactly as offered; the revision did not move.
    Unchanged,
}

impl CatalogChange {
    /// The new revision, if the catalog changed.
    #[must_use]
    pub fn revision(self) -> Option<u64> {
        match self {
            CatalogChange::Attached { revision } | CatalogChange::Refreshed { revision } => {
                Some(revision)
            }
            CatalogChange::Unchanged => None,
        }
    }
}

/// The set of active pools with its revision. See the module docs for the invariants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    revision: u64,
    pools: BTreeMap<PoolId, PoolDescriptor>,
    /// Reverse index: the active pool of each endpoint. Always the exact inverse of `pools`.
    endpoints: BTreeMap<EndpointPath, PoolId>,
}

impl Catalog {
    /// The empty catalog at revision 0.
    #[must_use]
    pub fn new() -> Self {
        Catalog::default()
    }

    /// The current revision: 0 when nothing ever changed.
    #[must_use]
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Number of active pools.
    #[must_use]
    pub fn len(&self) -> usize {
        self.pools.len()
    }

    /// True if no pool is active.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    /// The active descriptor of `pool_id`.
    #[must_use]
    pub fn descriptor(&self, pool_id: &PoolId) -> Option<&PoolDescriptor> {
        self.pools.get(pool_id)
    }

    /// The active pool of `endpoint`.
    #[must_use]
    pub fn pool_of(&self, endpoint: &EndpointPath) -> Option<PoolId> {
        self.endpoints.get(endpoint).copied()
    }

    /// Active descriptors in [`PoolId`] order.
    pub fn descriptors(&self) -> impl Iterator<Item = &PoolDescriptor> {
        self.pools.values()
    }

    /// Make `descriptor` active: attach a new pool, or refresh the metadata of the same
    /// producer in place.
    ///
    /// Refused (nothing changes) if the pool is active for another endpoint, the endpoint has
    /// another active pool, or the pool is active under a different producer.
    pub fn upsert(&mut self, descriptor: PoolDescriptor) -> Result<CatalogChange, CatalogError> {
        let pool_id = descriptor.pool_id();
        if let Some(active) = self.pools.get(&pool_id) {
            if active.serving_endpoint != descriptor.serving_endpoint {
                return Err(CatalogError::PoolOwnedByOtherEndpoint {
                    pool_id,
                    owner: active.serving_endpoint.clone(),
                });
            }
            if active.producer != descriptor.producer {
                return Err(CatalogError::ProducerMismatch {
                    pool_id,
                    active_layout_generation: active.layout_generation(),
                    offered_layout_generation: descriptor.layout_generation(),
                });
            }
            if *active == descriptor {
                return Ok(CatalogChange::Unchanged);
            }
            self.pools.insert(pool_id, descriptor);
            return Ok(CatalogChange::Refreshed { revision: self.advance() });
        }
        if let Some(active) = self.endpoints.get(&descriptor.serving_endpoint) {
            return Err(CatalogError::EndpointHasOtherPool {
                endpoint: descriptor.serving_endpoint.clone(),
                active: *active,
            });
        }
        self.endpoints.insert(descriptor.serving_endpoint.clone(), pool_id);
        self.pools.insert(pool_id, descriptor);
        debug_assert_eq!(self.pools.len(), self.endpoints.len());
        Ok(CatalogChange::Attached { revision: self.advance() })
    }

    /// Withdraw the active generation `layout_generation` of `pool_id`; returns the removed
    /// descriptor and the new revision.
    ///
    /// Refused if the pool is not active, or is active under another generation (a stale
    /// withdrawal must not remove its successor).
    pub fn withdraw(
        &mut self,
        pool_id: PoolId,
        layout_generation: u64,
    ) -> Result<(PoolDescriptor, u64), CatalogError> {
        let Some(active) = self.pools.get(&pool_id) else {
            return Err(CatalogError::PoolNotActive { pool_id });
        };
        if active.layout_generation() != layout_generation {
            return Err(CatalogError::ProducerMismatch {
                pool_id,
                active_layout_generation: active.layout_generation(),
                offered_layout_generation: layout_generation,
            });
        }
        let Some(removed) = self.pools.remove(&pool_id) else {
            return Err(CatalogError::PoolNotActive { pool_id });
        };
        self.endpoints.remove(&removed.serving_endpoint);
        debug_assert_eq!(self.pools.len(), self.endpoints.len());
        Ok((removed, self.advance()))
    }

    /// The complete catalog as the catalog stream publishes it.
    #[must_use]
    pub fn snapshot(&self) -> CatalogSnapshot {
        CatalogSnapshot { revision: self.revision, pools: self.pools.values().cloned().collect() }
    }

    /// Count one change. A u64 advanced once per change cannot be exhausted at any real rate;
    /// it saturates rather than wrap so a revision never goes backwards.
    fn advance(&mut self) -> u64 {
        self.revision = self.revision.saturating_add(1);
        self.revision
    }
}

/// The complete catalog at one revision (`KvPoolCatalogUpdate` without the envelope).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CatalogSnapshot {
    /// Catalog revision (0 = empty catalog that never changed).
    pub revision: u64,
    /// Active pools in [`PoolId`] order.
    pub pools: Vec<PoolDescriptor>,
}

// ---- rendering -----------------------------------------------------------------------------
//
// Identity types carry no serde implementation, so descriptors render through borrowed mirrors:
// digests and 64-bit identifiers as fixed-width lowercase hex, generations and sizes as numbers.
// The rendering is for snapshots and diagnostics, not a wire format.

fn source_name(source: IdentitySource) -> &'static str {
    match source {
        IdentitySource::DefaultDerived => "default_derived",
        IdentitySource::Explicit => "explicit",
    }
}

/// Renders a [`PoolId`] with both digests, their sources and the data center.
struct PoolIdRepr<'a>(&'a PoolId);

impl Serialize for PoolIdRepr<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let domain = &self.0.indexer_domain;
        let mut state = serializer.serialize_struct("PoolId", 6)?;
        state.serialize_field("identity_version", &POOL_IDENTITY_VERSION)?;
        state.serialize_field("cache_semantics", &domain.cache_semantics.to_string())?;
        state.serialize_field(
            "cache_semantics_source",
            source_name(domain.cache_semantics.source),
        )?;
        state.serialize_field("routing_scope", &domain.routing_scope.to_string())?;
        state.serialize_field("routing_scope_source", source_name(domain.routing_scope.source))?;
        state.serialize_field("dc_id", &self.0.dc_id.to_string())?;
        state.end()
    }
}

/// Renders a [`ProducerIdentity`]: pool, incarnation (hex), generation, and CKF format.
struct ProducerRepr<'a>(&'a ProducerIdentity);

impl Serialize for ProducerRepr<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct FormatRepr {
            format_version: u32,
            seed: String,
            bucket_count: u64,
            fingerprint_bits: u32,
            slots_per_bucket: u32,
        }
        let producer = self.0;
        let format = producer.format();
        let mut state = serializer.serialize_struct("ProducerIdentity", 4)?;
        state.serialize_field("pool_id", &PoolIdRepr(&producer.pool_id()))?;
        state.serialize_field(
            "producer_incarnation",
            &format!("{:016x}", producer.producer_incarnation()),
        )?;
        state.serialize_field("layout_generation", &producer.layout_generation())?;
        state.serialize_field(
            "ckf_format",
            &FormatRepr {
                format_version: format.format_version,
                seed: format!("{:016x}", format.seed),
                bucket_count: format.bucket_count,
                fingerprint_bits: format.fingerprint_bits,
                slots_per_bucket: format.slots_per_bucket,
            },
        )?;
        state.end()
    }
}

impl Serialize for PoolDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut state = serializer.serialize_struct("PoolDescriptor", 5)?;
        state.serialize_field("producer", &ProducerRepr(&self.producer))?;
        state.serialize_field("serving_endpoint", &self.serving_endpoint.to_string())?;
        state.serialize_field("registrations", &self.registrations)?;
        state.serialize_field("query_semantics", &self.query_semantics)?;
        state.serialize_field("pool_roles", &self.pool_roles)?;
        state.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::ModelTarget;
    use crate::filter::ckf::CkfFormat;
    use crate::model::hashing::HashFormat;
    use crate::model::identity::{CacheSemanticsId, DcId, IndexerDomainId, RoutingScopeId};

    fn endpoint(path: &str) -> EndpointPath {
        path.parse().unwrap()
    }

    fn pool(tag: u8) -> PoolId {
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: CacheSemanticsId {
                    digest: [tag; 16],
                    source: IdentitySource::DefaultDerived,
                },
                routing_scope: RoutingScopeId {
                    digest: [tag.wrapping_add(1); 16],
                    source: IdentitySource::Explicit,
                },
            },
            dc_id: DcId(0x04f1_10c9_8b1b_fc48),
        }
    }

    fn descriptor(path: &str, pool_id: PoolId, layout_generation: u64) -> PoolDescriptor {
        let format = CkfFormat::for_expected_blocks(1024).unwrap();
        PoolDescriptor {
            producer: ProducerIdentity::new(pool_id, 0xabc, layout_generation, format).unwrap(),
            serving_endpoint: endpoint(path),
            registrations: vec![ModelRegistration {
                canonical_model_id: "tiny-llm".to_owned(),
                target: ModelTarget::Base { base_model: "tiny-llm".to_owned() },
                aliases: BTreeSet::new(),
            }],
            query_semantics: QuerySemantics {
                kv_block_size: 16,
                hash_format: HashFormat::StandardV1,
            },
            pool_roles: [WorkerRole::Aggregated].into_iter().collect(),
        }
    }

    #[test]
    fn catalog_revision_starts_at_0_and_counts_every_change() {
        let mut catalog = Catalog::new();
        assert_eq!(catalog.revision(), 0);
        assert!(catalog.is_empty());
        assert_eq!(catalog.snapshot(), CatalogSnapshot { revision: 0, pools: Vec::new() });

        let first = descriptor("ns/a/generate", pool(1), 1);
        assert_eq!(catalog.upsert(first.clone()), Ok(CatalogChange::Attached { revision: 1 }));
        assert!(!catalog.is_empty());
        // The same descriptor again is not a change.
        assert_eq!(catalog.upsert(first.clone()).map(CatalogChange::revision), Ok(None));
        assert_eq!(catalog.revision(), 1);

        let mut aliased = first.clone();
        aliased.registrations[0].aliases.insert("tiny".to_owned());
        assert_eq!(catalog.upsert(aliased), Ok(CatalogChange::Refreshed { revision: 2 }));
        assert_eq!(CatalogChange::Refreshed { revision: 2 }.revision(), Some(2));
        assert_eq!(CatalogChange::Attached { revision: 7 }.revision(), Some(7));

        let second = descriptor("ns/b/generate", pool(2), 2);
        assert_eq!(catalog.upsert(second), Ok(CatalogChange::Attached { revision: 3 }));

        let (removed, revision) = catalog.withdraw(pool(1), 1).unwrap();
        assert_eq!(removed.serving_endpoint, endpoint("ns/a/generate"));
        assert_eq!(revision, 4);
        assert_eq!(catalog.pool_of(&endpoint("ns/a/generate")), None);
        assert_eq!(catalog.len(), 1);
    }

    #[test]
    fn one_endpoint_has_at_most_one_pool_and_one_pool_at_most_one_endpoint() {
        let mut catalog = Catalog::new();
        let _ = catalog.upsert(descriptor("ns/a/generate", pool(1), 1)).unwrap();
        let before = catalog.clone();

        assert_eq!(
            catalog.upsert(descriptor("ns/b/generate", pool(1), 2)),
            Err(CatalogError::PoolOwnedByOtherEndpoint {
                pool_id: pool(1),
                owner: endpoint("ns/a/generate"),
            })
        );
        assert_eq!(
            catalog.upsert(descriptor("ns/a/generate", pool(2), 2)),
            Err(CatalogError::EndpointHasOtherPool {
                endpoint: endpoint("ns/a/generate"),
                active: pool(1),
            })
        );
        // A new generation never replaces the active one in place.
        assert_eq!(
            catalog.upsert(descriptor("ns/a/generate", pool(1), 2)),
            Err(CatalogError::ProducerMismatch {
                pool_id: pool(1),
                active_layout_generation: 1,
                offered_layout_generation: 2,
            })
        );
        assert_eq!(catalog, before, "refused changes change nothing");
    }

    #[test]
    fn stale_withdrawal_never_removes_the_successor_generation() {
        let mut catalog = Catalog::new();
        let _ = catalog.upsert(descriptor("ns/a/generate", pool(1), 3)).unwrap();
        assert_eq!(
            catalog.withdraw(pool(1), 2),
            Err(CatalogError::ProducerMismatch {
                pool_id: pool(1),
                active_layout_generation: 3,
                offered_layout_generation: 2,
            })
        );
        assert_eq!(
            catalog.withdraw(pool(2), 3),
            Err(CatalogError::PoolNotActive { pool_id: pool(2) })
        );
        assert_eq!(catalog.revision(), 1);
    }

    #[test]
    fn descriptors_iterate_in_pool_id_order() {
        let mut catalog = Catalog::new();
        for (path, tag, generation) in [("ns/c/x", 9, 1), ("ns/a/x", 5, 2), ("ns/b/x", 7, 3)] {
            let _ = catalog.upsert(descriptor(path, pool(tag), generation)).unwrap();
        }
        let order: Vec<PoolId> = catalog.descriptors().map(PoolDescriptor::pool_id).collect();
        assert_eq!(order, vec![pool(5), pool(7), pool(9)]);
        let snapshot: Vec<PoolId> =
            catalog.snapshot().pools.iter().map(PoolDescriptor::pool_id).collect();
        assert_eq!(snapshot, order);
    }

    #[test]
    fn snapshot_renders_identities_as_fixed_width_hex() {
        let mut catalog = Catalog::new();
        let _ = catalog.upsert(descriptor("ns/a/generate", pool(1), 1)).unwrap();
        let rendered = serde_json::to_value(catalog.snapshot()).unwrap();
        let expected = serde_json::json!({
            "revision": 1,
            "pools": [{
                "producer": {
                    "pool_id": {
                        "identity_version": 1,
                        "cache_semantics": "01".repeat(16),
                        "cache_semantics_source": "default_derived",
                        "routing_scope": "02".repeat(16),
                        "routing_scope_source": "explicit",
                        "dc_id": "04f110c98b1bfc48",
                    },
                    "producer_incarnation": "0000000000000abc",
                    "layout_generation": 1,
                    "ckf_format": {
                        "format_version": 1,
                        "seed": "5deece66d1b54a33",
                        "bucket_count": 512,
                        "fingerprint_bits": 16,
                        "slots_per_bucket": 4,
                    },
                },
                "serving_endpoint": "ns/a/generate",
                "registrations": [{
                    "canonical_model_id": "tiny-llm",
                    "target": {"base": {"base_model": "tiny-llm"}},
                    "aliases": [],
                }],
                "query_semantics": {"kv_block_size": 16, "hash_format": "DYNAMO_STANDARD_V1"},
                "pool_roles": ["AGGREGATED"],
            }],
        });
        assert_eq!(rendered, expected);
    }
}
