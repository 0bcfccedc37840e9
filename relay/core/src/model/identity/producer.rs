//! Producer and relay identity (relay-facts §2.5–2.6).
//!
//! A [`PoolId`] names *what* is published; a [`ProducerIdentity`] names *one publication* of it:
//! the relay incarnation that produces it, the layout generation the registry allocated when the
//! pool was (re)materialized, and the frozen CKF format. Any change in any of these means a
//! consumer's filter replica no longer matches, so the whole tuple — the frozen v1
//! [`ProducerKey`] — fences CKF subscriptions. Descriptor metadata (endpoint, registrations,
//! roles, query semantics) deliberately stays out of it.

use thiserror::Error;

use super::digest::{POOL_IDENTITY_VERSION, PoolId};
use crate::filter::ckf::{CkfFormat, CkfFormatError};

/// Why a producer identity is not valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ProducerIdentityError {
    /// Layout generations start at 1; zero never names an attached pool.
    #[error("layout generation must be positive")]
    ZeroLayoutGeneration,
    /// The CKF format is not the one executable v1 shape.
    #[error("producer CKF format is not executable: {0}")]
    Format(#[source] CkfFormatError),
}

/// One publication of one pool: the frozen subscription key of a CKF stream.
///
/// Invariants (checked by [`ProducerIdentity::new`], the only constructor):
/// `layout_generation >= 1` and `format` passes [`CkfFormat::validate`].
/// Equality covers every dimension of the v1 [`ProducerKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProducerIdentity {
    pool_id: PoolId,
    producer_incarnation: u64,
    layout_generation: u64,
    format: CkfFormat,
}

impl ProducerIdentity {
    /// Validate and build. `producer_incarnation` is the relay's incarnation;
    /// `layout_generation` comes from the registry's counter (starts at 1).
    pub fn new(
        pool_id: PoolId,
        producer_incarnation: u64,
        layout_generation: u64,
        format: CkfFormat,
    ) -> Result<Self, ProducerIdentityError> {
        if layout_generation == 0 {
            return Err(ProducerIdentityError::ZeroLayoutGeneration);
        }
        format.validate().map_err(ProducerIdentityError::Format)?;
        Ok(ProducerIdentity { pool_id, producer_incarnation, layout_generation, format })
    }

    /// The pool this producer publishes.
    #[must_use]
    pub fn pool_id(&self) -> PoolId {
        self.pool_id
    }

    /// The incarnation of the relay that produces this publication.
    #[must_use]
    pub fn producer_incarnation(&self) -> u64 {
        self.producer_incarnation
    }

    /// The registry's generation for this attachment of the pool (at least 1).
    #[must_use]
    pub fn layout_generation(&self) -> u64 {
        self.layout_generation
    }

    /// The filter's frozen, executable format.
    #[must_use]
    pub fn format(&self) -> CkfFormat {
        self.format
    }

    /// The frozen v1 equality key of this producer.
    #[must_use]
    pub fn key(&self) -> ProducerKey {
        ProducerKey::from(self)
    }

    /// The publication lease that the pool's stream is held under: the producer's
    /// incarnation as consumer instance, lane 0, and the layout generation as epoch.
    #[must_use]
    pub fn publication_lease(&self) -> LaneLease {
        LaneLease {
            consumer_instance: self.producer_incarnation,
            physical_lane: 0,
            assignment_epoch: self.layout_generation,
        }
    }
}

/// The frozen v1 producer equality key: all thirteen dimensions that decide whether a consumer's
/// filter replica still belongs to the current producer.
///
/// `identity_version`; cache-semantics digest and source; routing-scope digest and source;
/// `dc_id`; `producer_incarnation`; `layout_generation`; and the five CKF format fields. Values
/// may come off the wire unvalidated, so unlike [`ProducerIdentity`] nothing here is checked:
/// the key only compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProducerKey {
    /// `KvPoolId.identity_version`; [`POOL_IDENTITY_VERSION`] for every in-process producer.
    pub identity_version: u32,
    /// Indexer domain (both digests and both sources) and data center.
    pub pool_id: PoolId,
    /// The producing relay's incarnation.
    pub producer_incarnation: u64,
    /// The registry's attachment generation.
    pub layout_generation: u64,
    /// The filter's format, all five fields.
    pub ckf_format: CkfFormat,
}

impl From<&ProducerIdentity> for ProducerKey {
    fn from(identity: &ProducerIdentity) -> Self {
        // Exhaustive destructuring: a new identity field fails to compile here until someone
        // decides whether it belongs to the frozen key (under v1 it cannot).
        let ProducerIdentity { pool_id, producer_incarnation, layout_generation, format } =
            *identity;
        ProducerKey {
            identity_version: POOL_IDENTITY_VERSION,
            pool_id,
            producer_incarnation,
            layout_generation,
            ckf_format: format,
        }
    }
}

/// The lease a publication stream is held under; deltas under a retired lease are rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LaneLease {
    /// Who holds the lane; for a relay publication, the producer incarnation.
    pub consumer_instance: u64,
    /// The lane within the holder; a relay publication uses lane 0.
    pub physical_lane: u32,
    /// Epoch of the assignment; for a relay publication, the layout generation.
    pub assignment_epoch: u64,
}

/// The relay process as seen by every response: runtime instance plus per-start incarnation.
///
/// `drt_instance_id` can stay equal across an in-process restart; `relay_incarnation` is drawn
/// fresh for every start and becomes every producer's `producer_incarnation`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct RelayIdentity {
    /// The distributed runtime's connection id.
    pub drt_instance_id: u64,
    /// This start's incarnation (top bit always clear).
    pub relay_incarnation: u64,
}

impl RelayIdentity {
    /// The identity of a fresh start on runtime instance `drt_instance_id`.
    #[must_use]
    pub fn start<R: rand_core::Rng + ?Sized>(drt_instance_id: u64, rng: &mut R) -> Self {
        RelayIdentity { drt_instance_id, relay_incarnation: new_relay_incarnation(rng) }
    }
}

/// Mask applied to a drawn relay incarnation: the value also fits a non-negative i64.
pub const RELAY_INCARNATION_MASK: u64 = 0x7FFF_FFFF_FFFF_FFFF;

/// Draw a fresh relay incarnation from the injected generator (63 random bits).
#[must_use]
pub fn new_relay_incarnation<R: rand_core::Rng + ?Sized>(rng: &mut R) -> u64 {
    rng.next_u64() & RELAY_INCARNATION_MASK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::ckf::{DEFAULT_SEED, FINGERPRINT_BITS, FORMAT_VERSION, SLOTS_PER_BUCKET};
    use crate::model::identity::{
        CacheSemanticsId, DcId, IdentitySource, IndexerDomainId, RoutingScopeId,
    };
    use crate::rng::rng_from_seed;

    fn pool() -> PoolId {
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: CacheSemanticsId {
                    digest: [0x11; 16],
                    source: IdentitySource::DefaultDerived,
                },
                routing_scope: RoutingScopeId {
                    digest: [0x22; 16],
                    source: IdentitySource::DefaultDerived,
                },
            },
            dc_id: DcId(0x04f1_10c9_8b1b_fc48),
        }
    }

    fn producer() -> ProducerIdentity {
        ProducerIdentity::new(pool(), 7, 3, CkfFormat::v1(DEFAULT_SEED, 1 << 19)).unwrap()
    }

    /// Changes exactly one dimension of a key.
    type Mutation = fn(&mut ProducerKey);

    #[test]
    fn producer_key_fences_every_v1_identity_dimension() {
        let base = producer().key();
        assert_eq!(base.identity_version, POOL_IDENTITY_VERSION);
        let mutations: [(&str, Mutation); 13] = [
            ("identity_version", |key| key.identity_version = 2),
            ("cache_semantics.digest", |key| {
                key.pool_id.indexer_domain.cache_semantics.digest[15] ^= 1;
            }),
            ("cache_semantics.source", |key| {
                key.pool_id.indexer_domain.cache_semantics.source = IdentitySource::Explicit;
            }),
            ("routing_scope.digest", |key| {
                key.pool_id.indexer_domain.routing_scope.digest[0] ^= 0x80;
            }),
            ("routing_scope.source", |key| {
                key.pool_id.indexer_domain.routing_scope.source = IdentitySource::Explicit;
            }),
            ("dc_id", |key| key.pool_id.dc_id = DcId(key.pool_id.dc_id.0 ^ 1)),
            ("producer_incarnation", |key| key.producer_incarnation += 1),
            ("layout_generation", |key| key.layout_generation += 1),
            ("ckf_format.format_version", |key| key.ckf_format.format_version += 1),
            ("ckf_format.seed", |key| key.ckf_format.seed ^= 1),
            ("ckf_format.bucket_count", |key| key.ckf_format.bucket_count *= 2),
            ("ckf_format.fingerprint_bits", |key| key.ckf_format.fingerprint_bits = 8),
            ("ckf_format.slots_per_bucket", |key| key.ckf_format.slots_per_bucket = 2),
        ];
        for (dimension, mutate) in mutations {
            let mut changed = base;
            mutate(&mut changed);
            assert_ne!(changed, base, "{dimension} must take part in the producer key");
            // Where the mutation is still an executable identity, the identity itself fences it.
            if changed.identity_version == POOL_IDENTITY_VERSION
                && let Ok(identity) = ProducerIdentity::new(
                    changed.pool_id,
                    changed.producer_incarnation,
                    changed.layout_generation,
                    changed.ckf_format,
                )
            {
                assert_ne!(identity, producer(), "{dimension} must take part in identity");
                assert_eq!(identity.key(), changed);
            }
        }
        // Unchanged values compare equal.
        assert_eq!(producer().key(), base);
        assert_eq!(producer(), producer());
    }

    #[test]
    fn zero_layout_generation_is_rejected() {
        let format = CkfFormat::v1(DEFAULT_SEED, 1024);
        assert_eq!(
            ProducerIdentity::new(pool(), 7, 0, format),
            Err(ProducerIdentityError::ZeroLayoutGeneration)
        );
        assert!(ProducerIdentity::new(pool(), 7, 1, format).is_ok());
        assert!(ProducerIdentity::new(pool(), 0, u64::MAX, format).is_ok());
    }

    #[test]
    fn non_executable_ckf_format_is_rejected() {
        let good = CkfFormat::v1(DEFAULT_SEED, 1024);
        let cases = [
            (
                CkfFormat { format_version: FORMAT_VERSION + 1, ..good },
                CkfFormatError::FormatVersion(2),
            ),
            (
                CkfFormat { fingerprint_bits: FINGERPRINT_BITS / 2, ..good },
                CkfFormatError::FingerprintBits(8),
            ),
            (
                CkfFormat { slots_per_bucket: SLOTS_PER_BUCKET + 1, ..good },
                CkfFormatError::SlotsPerBucket(5),
            ),
            (CkfFormat { bucket_count: 1000, ..good }, CkfFormatError::BucketCount(1000)),
        ];
        for (format, error) in cases {
            assert_eq!(
                ProducerIdentity::new(pool(), 7, 1, format),
                Err(ProducerIdentityError::Format(error))
            );
        }
    }

    #[test]
    fn publication_lease_is_derived_from_incarnation_and_generation() {
        let identity = producer();
        assert_eq!(
            identity.publication_lease(),
            LaneLease { consumer_instance: 7, physical_lane: 0, assignment_epoch: 3 }
        );
        assert_eq!(identity.pool_id(), pool());
        assert_eq!(identity.producer_incarnation(), 7);
        assert_eq!(identity.layout_generation(), 3);
        assert_eq!(identity.format(), CkfFormat::v1(DEFAULT_SEED, 1 << 19));
    }

    #[test]
    fn relay_incarnation_is_seeded_and_clears_the_top_bit() {
        let mut first = rng_from_seed(42);
        let mut second = rng_from_seed(42);
        let drawn: Vec<u64> = (0..64).map(|_| new_relay_incarnation(&mut first)).collect();
        let again: Vec<u64> = (0..64).map(|_| new_relay_incarnation(&mut second)).collect();
        assert_eq!(drawn, again);
        assert!(drawn.iter().all(|incarnation| incarnation >> 63 == 0));
        assert!(drawn.windows(2).any(|pair| pair[0] != pair[1]));
    }

    #[test]
    fn repeated_relay_start_keeps_drt_identity_and_draws_a_new_incarnation() {
        let mut rng = rng_from_seed(9);
        let first = RelayIdentity::start(0xabc, &mut rng);
        let second = RelayIdentity::start(0xabc, &mut rng);
        assert_eq!(first.drt_instance_id, second.drt_instance_id);
        assert_ne!(first.relay_incarnation, second.relay_incarnation);
        assert_ne!(first, second);
    }
}
