//! The identifier value types: digest identities, the data-center id and the pool id.
//!
//! These are plain values. They are produced by the derivation in `derivation.rs` (or decoded off
//! the wire) and compared, ordered and rendered everywhere else. Rendering is fixed-width
//! lowercase hex so that identifiers line up in logs and sort the same as text and as values.

use std::fmt;

use thiserror::Error;

/// Version of the pool identity composition carried as `KvPoolId.identity_version` on the wire.
///
/// v1 knows exactly one composition (this module's), so in-process [`PoolId`]s do not store it;
/// the wire boundary adds it and rejects any other value.
pub const POOL_IDENTITY_VERSION: u32 = 1;

/// Where the material of a digest identity came from.
///
/// Part of identity: a default-derived digest and an explicit digest are different identities
/// even if their bytes were equal (which the distinct derivation tags make practically impossible
/// anyway). The wire's `IDENTITY_SOURCE_UNSPECIFIED` has no in-process counterpart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IdentitySource {
    /// Derived from the card's defaults (model source path, or the serving endpoint triple).
    DefaultDerived,
    /// Derived from an operator-supplied explicit identity map.
    Explicit,
}

/// Why a wire `IdentitySource` value is not a usable source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IdentitySourceError {
    /// `IDENTITY_SOURCE_UNSPECIFIED` (0): the sender did not say, so the identity is incomplete.
    #[error("identity source is unspecified")]
    Unspecified,
    /// A value v1 does not define; new sources are not automatically compatible.
    #[error("unknown identity source {0}")]
    Unknown(i32),
}

impl IdentitySource {
    /// Wire value of `IDENTITY_SOURCE_DEFAULT_DERIVED`.
    pub const WIRE_DEFAULT_DERIVED: i32 = 1;
    /// Wire value of `IDENTITY_SOURCE_EXPLICIT`.
    pub const WIRE_EXPLICIT: i32 = 2;

    /// The `dynamo.kvrelay.v1.IdentitySource` enum value.
    #[must_use]
    pub const fn wire_value(self) -> i32 {
        match self {
            IdentitySource::DefaultDerived => Self::WIRE_DEFAULT_DERIVED,
            IdentitySource::Explicit => Self::WIRE_EXPLICIT,
        }
    }
}

impl From<IdentitySource> for i32 {
    fn from(source: IdentitySource) -> i32 {
        source.wire_value()
    }
}

impl TryFrom<i32> for IdentitySource {
    type Error = IdentitySourceError;

    /// Accept only the two defined sources; `UNSPECIFIED` and unknown values fail closed.
    fn try_from(value: i32) -> Result<Self, Self::Error> {
        match value {
            0 => Err(IdentitySourceError::Unspecified),
            Self::WIRE_DEFAULT_DERIVED => Ok(IdentitySource::DefaultDerived),
            Self::WIRE_EXPLICIT => Ok(IdentitySource::Explicit),
            other => Err(IdentitySourceError::Unknown(other)),
        }
    }
}

/// Write bytes as lowercase hex, two digits per byte.
fn write_hex(formatter: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for byte in bytes {
        write!(formatter, "{byte:02x}")?;
    }
    Ok(())
}

/// What the hashes in a pool's filter mean: model source, KV block size and hash format.
///
/// Equality and order cover both the digest and the source. Displayed as 32 lowercase hex
/// digits of the digest (the source is not rendered).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CacheSemanticsId {
    /// First 16 bytes of BLAKE3 over the canonical cache-semantics material.
    pub digest: [u8; 16],
    /// Whether the material came from defaults or from an explicit map.
    pub source: IdentitySource,
}

impl fmt::Display for CacheSemanticsId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(formatter, &self.digest)
    }
}

impl fmt::Debug for CacheSemanticsId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "CacheSemanticsId({self}, {:?})", self.source)
    }
}

/// Where a pool's cached prefixes can be served: by default the serving endpoint triple.
///
/// Equality and order cover both the digest and the source. Displayed as 32 lowercase hex
/// digits of the digest (the source is not rendered).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoutingScopeId {
    /// First 16 bytes of BLAKE3 over the canonical routing-scope material.
    pub digest: [u8; 16],
    /// Whether the material came from defaults or from an explicit map.
    pub source: IdentitySource,
}

impl fmt::Display for RoutingScopeId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(formatter, &self.digest)
    }
}

impl fmt::Debug for RoutingScopeId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "RoutingScopeId({self}, {:?})", self.source)
    }
}

/// The KV-indexer domain: two filters are comparable only if their domains are equal.
///
/// Displayed as `"<cache semantics>:<routing scope>"` (65 characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IndexerDomainId {
    /// What the filter's hashes mean.
    pub cache_semantics: CacheSemanticsId,
    /// Where the cached prefixes can be served.
    pub routing_scope: RoutingScopeId,
}

impl IndexerDomainId {
    /// True if either half was derived from defaults rather than explicit material.
    #[must_use]
    pub fn relies_on_defaults(&self) -> bool {
        self.cache_semantics.source == IdentitySource::DefaultDerived
            || self.routing_scope.source == IdentitySource::DefaultDerived
    }
}

impl fmt::Display for IndexerDomainId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}:{}", self.cache_semantics, self.routing_scope)
    }
}

/// The data-center dimension of a [`PoolId`], derived from the operator's `--dc-id` string by
/// [`stable_dc_id`].
///
/// Stable across restarts as long as the string is; never derived from endpoint identity, and
/// meaningful only as part of a `PoolId`. Displayed as 16 lowercase hex digits, zero padded.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct DcId(pub u64);

impl fmt::Display for DcId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{:016x}", self.0)
    }
}

impl fmt::Debug for DcId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "DcId({self})")
    }
}

/// Why a `--dc-id` string cannot name a data center.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum DcIdError {
    /// The string is empty.
    #[error("dc id must not be empty")]
    Empty,
    /// The string starts or ends with whitespace (likely a configuration slip that would silently
    /// derive a different id).
    #[error("dc id must not have leading or trailing whitespace")]
    SurroundingWhitespace,
    /// The string is too long for its u32 length frame.
    #[error("dc id of {bytes} bytes exceeds the u32 length frame")]
    TooLong {
        /// Length of the rejected string in bytes.
        bytes: usize,
    },
}

/// Domain-separation tag of the data-center id derivation.
const DC_ID_TAG: &[u8] = b"dynamo/indexer-dc/v1";

/// Derive the [`DcId`] of an operator's `--dc-id` string.
///
/// `DcId = u64le(first 8 bytes of BLAKE3("dynamo/indexer-dc/v1" || u32le(len) || utf8))`.
/// The string must be non-empty and carry no leading or trailing whitespace.
pub fn stable_dc_id(dc_name: &str) -> Result<DcId, DcIdError> {
    if dc_name.is_empty() {
        return Err(DcIdError::Empty);
    }
    if dc_name.trim() != dc_name {
        return Err(DcIdError::SurroundingWhitespace);
    }
    let length =
        u32::try_from(dc_name.len()).map_err(|_| DcIdError::TooLong { bytes: dc_name.len() })?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(DC_ID_TAG);
    hasher.update(&length.to_le_bytes());
    hasher.update(dc_name.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    Ok(DcId(u64::from_le_bytes(first)))
}

/// One indexer domain in one data center: the unit the relay publishes a filter for.
///
/// Ordered by domain, then data center (the catalog's order). Displayed as
/// `"<domain>/<dc>"`. Two live endpoints that derive the same `PoolId` are fenced, never merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PoolId {
    /// What the filter means and where it can be served.
    pub indexer_domain: IndexerDomainId,
    /// Which data center holds the cache.
    pub dc_id: DcId,
}

impl fmt::Display for PoolId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}/{}", self.indexer_domain, self.dc_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_dc_id_has_a_frozen_golden_vector() {
        assert_eq!(stable_dc_id("dc-a"), Ok(DcId(0x04f1_10c9_8b1b_fc48)));
        // The live relay printed the same id in decimal on the wire.
        assert_eq!(0x04f1_10c9_8b1b_fc48_u64, 356_084_303_347_317_832);
        assert_ne!(stable_dc_id("dc-b"), stable_dc_id("dc-a"));
    }

    #[test]
    fn dc_id_rejects_empty_and_padded_names() {
        assert_eq!(stable_dc_id(""), Err(DcIdError::Empty));
        for padded in [" dc-a", "dc-a ", "\tdc-a", "dc-a\n", " ", "\u{a0}dc-a"] {
            assert_eq!(stable_dc_id(padded), Err(DcIdError::SurroundingWhitespace), "{padded:?}");
        }
        // Inner whitespace is part of the name, not a slip.
        assert!(stable_dc_id("dc a").is_ok());
    }

    #[test]
    fn identity_source_wire_values_round_trip_and_fail_closed() {
        for source in [IdentitySource::DefaultDerived, IdentitySource::Explicit] {
            assert_eq!(IdentitySource::try_from(i32::from(source)), Ok(source));
        }
        assert_eq!(IdentitySource::DefaultDerived.wire_value(), 1);
        assert_eq!(IdentitySource::Explicit.wire_value(), 2);
        assert_eq!(IdentitySource::try_from(0), Err(IdentitySourceError::Unspecified));
        for unknown in [3, -1, i32::MAX, i32::MIN] {
            assert_eq!(
                IdentitySource::try_from(unknown),
                Err(IdentitySourceError::Unknown(unknown))
            );
        }
    }

    #[test]
    fn identifiers_render_fixed_width_hex() {
        let mut digest = [0u8; 16];
        digest[15] = 0x0a;
        let cache = CacheSemanticsId { digest, source: IdentitySource::DefaultDerived };
        let routing = RoutingScopeId { digest: [0xff; 16], source: IdentitySource::Explicit };
        assert_eq!(cache.to_string(), "0000000000000000000000000000000a");
        assert_eq!(routing.to_string(), "ffffffffffffffffffffffffffffffff");
        let domain = IndexerDomainId { cache_semantics: cache, routing_scope: routing };
        assert_eq!(
            domain.to_string(),
            "0000000000000000000000000000000a:ffffffffffffffffffffffffffffffff"
        );
        assert_eq!(DcId(0).to_string(), "0000000000000000");
        assert_eq!(DcId(0xab).to_string(), "00000000000000ab");
        assert_eq!(DcId(u64::MAX).to_string(), "ffffffffffffffff");
        assert_eq!(DcId(0x04f1_10c9_8b1b_fc48).to_string(), "04f110c98b1bfc48");
        let pool = PoolId { indexer_domain: domain, dc_id: DcId(0x1) };
        assert_eq!(
            pool.to_string(),
            "0000000000000000000000000000000a:ffffffffffffffffffffffffffffffff/0000000000000001"
        );
        assert_eq!(pool.to_string().len(), 32 + 1 + 32 + 1 + 16);
        assert_eq!(format!("{:?}", DcId(0xab)), "DcId(00000000000000ab)");
    }

    #[test]
    fn pool_ids_order_by_domain_then_data_center() {
        let domain = |byte| IndexerDomainId {
            cache_semantics: CacheSemanticsId {
                digest: [byte; 16],
                source: IdentitySource::Explicit,
            },
            routing_scope: RoutingScopeId { digest: [0; 16], source: IdentitySource::Explicit },
        };
        let pool = |byte, dc| PoolId { indexer_domain: domain(byte), dc_id: DcId(dc) };
        let mut pools = vec![pool(2, 0), pool(1, 9), pool(1, 3)];
        pools.sort();
        assert_eq!(pools, [pool(1, 3), pool(1, 9), pool(2, 0)]);
    }

    #[test]
    fn relies_on_defaults_when_either_half_is_default_derived() {
        let cache = |source| CacheSemanticsId { digest: [1; 16], source };
        let routing = |source| RoutingScopeId { digest: [2; 16], source };
        let domain =
            |c, r| IndexerDomainId { cache_semantics: cache(c), routing_scope: routing(r) };
        use IdentitySource::{DefaultDerived, Explicit};
        assert!(domain(DefaultDerived, DefaultDerived).relies_on_defaults());
        assert!(domain(DefaultDerived, Explicit).relies_on_defaults());
        assert!(domain(Explicit, DefaultDerived).relies_on_defaults());
        assert!(!domain(Explicit, Explicit).relies_on_defaults());
    }
}
