//! The pool registry: which endpoint holds which pool generation, the layout generation
//! counter, and the catalog of published generations (relay-facts §2.5, §8.5, §9.5).
//!
//! A pool generation goes through three registry steps, and the registry enforces their order:
//!
//! 1. [`PoolRegistry::attach`] reserves the pool for an endpoint and allocates the next layout
//!    generation, giving the [`ProducerIdentity`] the new pool is built for;
//! 2. [`PoolRegistry::publish`] upserts the generation's descriptor into the catalog once the
//!    pool machine runs (and later refreshes its metadata in place);
//! 3. [`PoolRegistry::withdraw`] removes it from the catalog, and only then
//!    [`PoolRegistry::release`] drops the reservation (after the pool was torn down).
//!
//! Invariants:
//! - layout generations come from one registry-wide counter starting at 1; every attach takes
//!   the next value, so no producer identity is ever reused within a relay incarnation;
//! - every producer carries `producer_incarnation = relay_incarnation` and the registry's CKF
//!   format, validated once at construction;
//! - an endpoint holds at most one pool generation and a pool is held by at most one endpoint
//!   (held = reserved, whether or not published);
//! - every published generation is held: the catalog is a subset of the reservations, and a
//!   published generation cannot be released (withdrawal comes first).

use std::collections::BTreeMap;

use thiserror::Error;

use super::catalog::{Catalog, CatalogChange, CatalogError, PoolDescriptor};
use crate::filter::ckf::{CkfFormat, CkfFormatError};
use crate::model::identity::{
    DcId, EndpointPath, IndexerDomainId, PoolId, ProducerIdentity, ProducerIdentityError,
};

/// Why the registry refused a step. A refused step changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RegistryError {
    /// The CKF format every producer would carry is not executable.
    #[error("registry CKF format is not executable: {0}")]
    Format(#[source] CkfFormatError),
    /// The pool is held by an endpoint (another one, or the same one under a generation that
    /// must be released first).
    #[error("pool {pool_id} is held by endpoint {holder}")]
    PoolHeld {
        /// The contested pool.
        pool_id: PoolId,
        /// The endpoint holding it.
        holder: EndpointPath,
    },
    /// The endpoint already holds a pool generation.
    #[error("endpoint {endpoint} already holds pool {pool_id}")]
    EndpointHoldsPool {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The pool it holds.
        pool_id: PoolId,
    },
    /// The layout generation counter reached `u64::MAX`.
    #[error("layout generations are exhausted")]
    LayoutGenerationsExhausted,
    /// The producer identity could not be built.
    #[error("invalid producer identity: {0}")]
    Producer(#[source] ProducerIdentityError),
    /// The named generation is not held (or is held by another endpoint or producer).
    #[error("pool {pool_id} layout generation {layout_generation} is not held")]
    NotHeld {
        /// The pool.
        pool_id: PoolId,
        /// The generation named.
        layout_generation: u64,
    },
    /// The generation is still in the catalog; withdraw it before releasing it.
    #[error("pool {pool_id} layout generation {layout_generation} is still published")]
    StillPublished {
        /// The pool.
        pool_id: PoolId,
        /// The generation named.
        layout_generation: u64,
    },
    /// A generation the host holds as active was missing from the catalog (an internal
    /// invariant failure; the host re-publishes it and reports unhealthy).
    #[error("pool {pool_id} layout generation {layout_generation} is active but was not published")]
    ActiveNotPublished {
        /// The pool.
        pool_id: PoolId,
        /// The generation.
        layout_generation: u64,
    },
    /// The catalog refused the change (boxed: it carries a pool id and an endpoint path).
    #[error(transparent)]
    Catalog(Box<CatalogError>),
}

impl From<CatalogError> for RegistryError {
    fn from(error: CatalogError) -> Self {
        RegistryError::Catalog(Box::new(error))
    }
}

/// One held pool generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldPool {
    /// The endpoint holding it.
    pub endpoint: EndpointPath,
    /// The generation's producer.
    pub producer: ProducerIdentity,
}

/// Reservations, generation counter and catalog. See the module docs for the invariants.
#[derive(Debug, Clone)]
pub struct PoolRegistry {
    producer_incarnation: u64,
    dc_id: DcId,
    format: CkfFormat,
    /// The next layout generation to hand out; starts at 1.
    layout_generation_next: u64,
    held: BTreeMap<PoolId, HeldPool>,
    /// Reverse index of `held`, always its exact inverse.
    holders: BTreeMap<EndpointPath, PoolId>,
    catalog: Catalog,
}

impl PoolRegistry {
    /// An empty registry for one relay incarnation in data center `dc_id`; every producer it
    /// allocates uses `format`, which must be executable.
    pub fn new(
        producer_incarnation: u64,
        dc_id: DcId,
        format: CkfFormat,
    ) -> Result<Self, RegistryError> {
        format.validate().map_err(RegistryError::Format)?;
        Ok(PoolRegistry {
            producer_incarnation,
            dc_id,
            format,
            layout_generation_next: 1,
            held: BTreeMap::new(),
            holders: BTreeMap::new(),
            catalog: Catalog::new(),
        })
    }

    /// The pool an endpoint with indexer domain `domain` publishes in this data center.
    #[must_use]
    pub fn pool_id(&self, domain: IndexerDomainId) -> PoolId {
        PoolId { indexer_domain: domain, dc_id: self.dc_id }
    }

    /// The data center this registry publishes for.
    #[must_use]
    pub fn dc_id(&self) -> DcId {
        self.dc_id
    }

    /// The filter format of every producer this registry allocates.
    #[must_use]
    pub fn format(&self) -> CkfFormat {
        self.format
    }

    /// The catalog of published generations.
    #[must_use]
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The generation holding `pool_id`, if any.
    #[must_use]
    pub fn holder(&self, pool_id: &PoolId) -> Option<&HeldPool> {
        self.held.get(pool_id)
    }

    /// The generation `endpoint` holds, if any.
    #[must_use]
    pub fn held_by(&self, endpoint: &EndpointPath) -> Option<&HeldPool> {
        self.holders.get(endpoint).and_then(|pool_id| self.held.get(pool_id))
    }

    /// Number of pools reserved (held by an endpoint).
    #[must_use]
    pub fn held_count(&self) -> usize {
        debug_assert_eq!(self.held.len(), self.holders.len());
        self.held.len()
    }

    /// Number of layout generations allocated so far.
    #[must_use]
    pub fn layout_generations_allocated(&self) -> u64 {
        self.layout_generation_next - 1
    }

    /// Reserve the pool of `domain` for `endpoint` and allocate its next layout generation.
    ///
    /// Refused if the pool is held by any endpoint or the endpoint already holds a pool; a
    /// refused attach allocates no generation.
    pub fn attach(
        &mut self,
        endpoint: &EndpointPath,
        domain: IndexerDomainId,
    ) -> Result<ProducerIdentity, RegistryError> {
        let pool_id = self.pool_id(domain);
        if let Some(held) = self.held.get(&pool_id) {
            return Err(RegistryError::PoolHeld { pool_id, holder: held.endpoint.clone() });
        }
        if let Some(held) = self.holders.get(endpoint) {
            return Err(RegistryError::EndpointHoldsPool {
                endpoint: endpoint.clone(),
                pool_id: *held,
            });
        }
        if self.layout_generation_next == u64::MAX {
            return Err(RegistryError::LayoutGenerationsExhausted);
        }
        let producer = ProducerIdentity::new(
            pool_id,
            self.producer_incarnation,
            self.layout_generation_next,
            self.format,
        )
        .map_err(RegistryError::Producer)?;
        self.layout_generation_next += 1;
        self.held.insert(pool_id, HeldPool { endpoint: endpoint.clone(), producer });
        self.holders.insert(endpoint.clone(), pool_id);
        debug_assert_eq!(self.held.len(), self.holders.len());
        Ok(producer)
    }

    /// Publish a held generation's descriptor: attach it to the catalog, or refresh its
    /// metadata in place (same producer).
    ///
    /// Refused unless `descriptor` names exactly the producer its endpoint holds.
    pub fn publish(&mut self, descriptor: PoolDescriptor) -> Result<CatalogChange, RegistryError> {
        let pool_id = descriptor.pool_id();
        let is_held = self.held.get(&pool_id).is_some_and(|held| {
            held.endpoint == descriptor.serving_endpoint && held.producer == descriptor.producer
        });
        if !is_held {
            return Err(RegistryError::NotHeld {
                pool_id,
                layout_generation: descriptor.layout_generation(),
            });
        }
        Ok(self.catalog.upsert(descriptor)?)
    }

    /// Withdraw a published generation from the catalog; returns the new catalog revision.
    pub fn withdraw(
        &mut self,
        pool_id: PoolId,
        layout_generation: u64,
    ) -> Result<u64, RegistryError> {
        let (_, revision) = self.catalog.withdraw(pool_id, layout_generation)?;
        Ok(revision)
    }

    /// Drop the reservation of a generation that is no longer published.
    pub fn release(
        &mut self,
        pool_id: PoolId,
        layout_generation: u64,
    ) -> Result<(), RegistryError> {
        let is_held = self
            .held
            .get(&pool_id)
            .is_some_and(|held| held.producer.layout_generation() == layout_generation);
        if !is_held {
            return Err(RegistryError::NotHeld { pool_id, layout_generation });
        }
        if self
            .catalog
            .descriptor(&pool_id)
            .is_some_and(|published| published.layout_generation() == layout_generation)
        {
            return Err(RegistryError::StillPublished { pool_id, layout_generation });
        }
        if let Some(held) = self.held.remove(&pool_id) {
            self.holders.remove(&held.endpoint);
        }
        debug_assert_eq!(self.held.len(), self.holders.len());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::discovery::{QuerySemantics, WorkerRole};
    use crate::model::hashing::HashFormat;
    use crate::model::identity::{CacheSemanticsId, IdentitySource, RoutingScopeId};

    fn endpoint(path: &str) -> EndpointPath {
        path.parse().unwrap()
    }

    fn domain(tag: u8) -> IndexerDomainId {
        IndexerDomainId {
            cache_semantics: CacheSemanticsId {
                digest: [tag; 16],
                source: IdentitySource::DefaultDerived,
            },
            routing_scope: RoutingScopeId {
                digest: [tag; 16],
                source: IdentitySource::DefaultDerived,
            },
        }
    }

    fn registry() -> PoolRegistry {
        PoolRegistry::new(0x1234, DcId(7), CkfFormat::for_expected_blocks(1024).unwrap()).unwrap()
    }

    fn descriptor(path: &str, producer: ProducerIdentity) -> PoolDescriptor {
        PoolDescriptor {
            producer,
            serving_endpoint: endpoint(path),
            registrations: Vec::new(),
            query_semantics: QuerySemantics {
                kv_block_size: 16,
                hash_format: HashFormat::StandardV1,
            },
            pool_roles: BTreeSet::from([WorkerRole::Decode]),
        }
    }

    #[test]
    fn attach_allocates_consecutive_generations_and_never_reuses_one() {
        let mut registry = registry();
        let a = registry.attach(&endpoint("ns/a/x"), domain(1)).unwrap();
        let b = registry.attach(&endpoint("ns/b/x"), domain(2)).unwrap();
        assert_eq!((a.layout_generation(), b.layout_generation()), (1, 2));
        assert_eq!(a.producer_incarnation(), 0x1234);
        assert_eq!(a.pool_id(), PoolId { indexer_domain: domain(1), dc_id: DcId(7) });

        registry.release(a.pool_id(), 1).unwrap();
        let again = registry.attach(&endpoint("ns/a/x"), domain(1)).unwrap();
        assert_eq!(again.layout_generation(), 3, "a re-attach never reuses a generation");
        assert_eq!(registry.layout_generations_allocated(), 3);
    }

    #[test]
    fn attach_refuses_a_held_pool_or_a_second_pool_per_endpoint() {
        let mut registry = registry();
        let _ = registry.attach(&endpoint("ns/a/x"), domain(1)).unwrap();
        assert_eq!(
            registry.attach(&endpoint("ns/b/x"), domain(1)),
            Err(RegistryError::PoolHeld {
                pool_id: registry.pool_id(domain(1)),
                holder: endpoint("ns/a/x")
            })
        );
        assert_eq!(
            registry.attach(&endpoint("ns/a/x"), domain(2)),
            Err(RegistryError::EndpointHoldsPool {
                endpoint: endpoint("ns/a/x"),
                pool_id: registry.pool_id(domain(1)),
            })
        );
        assert_eq!(registry.layout_generations_allocated(), 1, "refusals allocate nothing");
    }

    #[test]
    fn published_generation_must_be_withdrawn_before_release() {
        let mut registry = registry();
        let producer = registry.attach(&endpoint("ns/a/x"), domain(1)).unwrap();
        let pool_id = producer.pool_id();
        assert_eq!(
            registry.publish(descriptor("ns/a/x", producer)),
            Ok(CatalogChange::Attached { revision: 1 })
        );
        assert_eq!(
            registry.release(pool_id, 1),
            Err(RegistryError::StillPublished { pool_id, layout_generation: 1 })
        );
        assert_eq!(registry.withdraw(pool_id, 1), Ok(2));
        assert_eq!(registry.release(pool_id, 1), Ok(()));
        assert_eq!(registry.held_by(&endpoint("ns/a/x")), None);
        assert_eq!(
            registry.release(pool_id, 1),
            Err(RegistryError::NotHeld { pool_id, layout_generation: 1 })
        );
    }

    #[test]
    fn only_the_held_producer_can_be_published() {
        let mut registry = registry();
        let producer = registry.attach(&endpoint("ns/a/x"), domain(1)).unwrap();
        // Same producer from another endpoint, or an unallocated generation: refused.
        assert!(matches!(
            registry.publish(descriptor("ns/b/x", producer)),
            Err(RegistryError::NotHeld { .. })
        ));
        let forged =
            ProducerIdentity::new(producer.pool_id(), 0x1234, 9, producer.format()).unwrap();
        assert!(matches!(
            registry.publish(descriptor("ns/a/x", forged)),
            Err(RegistryError::NotHeld { layout_generation: 9, .. })
        ));
        assert_eq!(registry.catalog().revision(), 0);
    }

    #[test]
    fn non_executable_format_is_refused_up_front() {
        let format = CkfFormat::v1(1, 1000);
        assert_eq!(
            PoolRegistry::new(1, DcId(1), format).err(),
            Some(RegistryError::Format(CkfFormatError::BucketCount(1000)))
        );
    }
}
