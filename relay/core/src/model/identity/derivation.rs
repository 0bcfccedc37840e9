//! Derivation of an [`IndexerDomainId`] from a card and its serving endpoint (relay-facts §2.2).
//!
//! Each half of the domain is the first 16 bytes of BLAKE3 over canonical material:
//!
//! ```text
//! framed(x) = u32le(len(x)) || x            count(n) = u32le(n)
//! cache semantics = framed(tag) || selected || u32le(kv_block_size) || u16le(hash format version)
//! routing scope   = framed(tag) || selected
//! selected        = count(entries) || (framed(key) || framed(value)) per entry in key order
//!                   when an explicit map is given, else
//!                   count(defaults) || framed(default) per default
//! ```
//!
//! The tag names the dimension and whether the material is default or explicit, so the two
//! sources never alias. Length framing keeps adjacent inputs apart (`["ab","c"]` and
//! `["a","bc"]` differ). Block size and hash format are appended outside the selectable part, so
//! explicit material can never make two query spaces look alike. These bytes are frozen for v1.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use thiserror::Error;

use super::digest::{CacheSemanticsId, IdentitySource, IndexerDomainId, RoutingScopeId};
use super::explicit::{ExplicitIdentityMap, IndexerIdentitySpec};
use crate::model::hashing::HashFormat;

const CACHE_SEMANTICS_DEFAULT_TAG: &str = "dynamo/indexer-cache-semantics/default/v1";
const CACHE_SEMANTICS_EXPLICIT_TAG: &str = "dynamo/indexer-cache-semantics/explicit/v1";
const ROUTING_SCOPE_DEFAULT_TAG: &str = "dynamo/indexer-routing-scope/default/v1";
const ROUTING_SCOPE_EXPLICIT_TAG: &str = "dynamo/indexer-routing-scope/explicit/v1";

/// Why no indexer domain can be derived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IdentityError {
    /// The card's KV block size is zero: no query over its blocks could ever be formed.
    #[error("kv block size is zero")]
    ZeroBlockSize,
    /// An identity input does not fit its u32 length frame.
    #[error("identity input of {bytes} bytes exceeds the u32 length frame")]
    InputTooLong {
        /// Length of the rejected input in bytes.
        bytes: usize,
    },
}

/// Which inputs feed the selectable part of a canonical material.
enum Selection<'a> {
    /// The dimension's default inputs, in their fixed order.
    Defaults(&'a [&'a str]),
    /// An operator's explicit map, in key order.
    Explicit(&'a ExplicitIdentityMap),
}

/// Canonical identity material under construction: a byte string with length-framed fields.
struct Material {
    bytes: Vec<u8>,
}

impl Material {
    /// Start with the framed tag.
    fn tagged(tag: &str) -> Result<Self, IdentityError> {
        let mut material = Material { bytes: Vec::with_capacity(128) };
        material.framed(tag)?;
        Ok(material)
    }

    fn u32_le(&mut self, value: u32) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    fn u16_le(&mut self, value: u16) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    /// Append `u32le(len) || bytes`.
    fn framed(&mut self, text: &str) -> Result<(), IdentityError> {
        let length = frame_length(text.len())?;
        self.u32_le(length);
        self.bytes.extend_from_slice(text.as_bytes());
        Ok(())
    }

    /// Append the count and the framed inputs of `selection`.
    fn selected(&mut self, selection: &Selection<'_>) -> Result<(), IdentityError> {
        match selection {
            Selection::Defaults(defaults) => {
                self.u32_le(frame_length(defaults.len())?);
                for default in defaults.iter() {
                    self.framed(default)?;
                }
            }
            Selection::Explicit(map) => {
                self.u32_le(frame_length(map.len())?);
                for (key, value) in map.iter() {
                    self.framed(key)?;
                    self.framed(value)?;
                }
            }
        }
        Ok(())
    }
}

/// First 16 bytes of BLAKE3 over canonical material.
fn digest_16(material: &[u8]) -> [u8; 16] {
    let hash = blake3::hash(material);
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&hash.as_bytes()[..16]);
    digest
}

fn frame_length(length: usize) -> Result<u32, IdentityError> {
    u32::try_from(length).map_err(|_| IdentityError::InputTooLong { bytes: length })
}

fn source_of(selection: &Selection<'_>) -> IdentitySource {
    match selection {
        Selection::Defaults(_) => IdentitySource::DefaultDerived,
        Selection::Explicit(_) => IdentitySource::Explicit,
    }
}

/// Canonical cache-semantics material: the exact bytes that are hashed.
fn cache_semantics_material(
    selection: &Selection<'_>,
    kv_block_size: u32,
    format: HashFormat,
) -> Result<Vec<u8>, IdentityError> {
    let tag = match selection {
        Selection::Defaults(_) => CACHE_SEMANTICS_DEFAULT_TAG,
        Selection::Explicit(_) => CACHE_SEMANTICS_EXPLICIT_TAG,
    };
    let mut material = Material::tagged(tag)?;
    material.selected(selection)?;
    material.u32_le(kv_block_size);
    material.u16_le(format.identity_version());
    Ok(material.bytes)
}

/// Canonical routing-scope material: the exact bytes that are hashed.
fn routing_scope_material(selection: &Selection<'_>) -> Result<Vec<u8>, IdentityError> {
    let tag = match selection {
        Selection::Defaults(_) => ROUTING_SCOPE_DEFAULT_TAG,
        Selection::Explicit(_) => ROUTING_SCOPE_EXPLICIT_TAG,
    };
    let mut material = Material::tagged(tag)?;
    material.selected(selection)?;
    Ok(material.bytes)
}

/// Derive cache semantics from the card's model source path, or from `explicit` material that
/// replaces it. Block size and hash format always take part.
///
/// Fails with [`IdentityError::ZeroBlockSize`] for a zero block size, so no cache-semantics
/// identity exists for a query space that cannot be queried.
pub fn cache_semantics_id(
    source_path: &str,
    explicit: Option<&ExplicitIdentityMap>,
    kv_block_size: u32,
    format: HashFormat,
) -> Result<CacheSemanticsId, IdentityError> {
    if kv_block_size == 0 {
        return Err(IdentityError::ZeroBlockSize);
    }
    let defaults = [source_path];
    let selection = match explicit {
        Some(map) => Selection::Explicit(map),
        None => Selection::Defaults(&defaults),
    };
    let material = cache_semantics_material(&selection, kv_block_size, format)?;
    Ok(CacheSemanticsId { digest: digest_16(&material), source: source_of(&selection) })
}

/// Derive routing scope from the serving endpoint triple, or from `explicit` material that
/// replaces it.
pub fn routing_scope_id(
    endpoint: &EndpointPath,
    explicit: Option<&ExplicitIdentityMap>,
) -> Result<RoutingScopeId, IdentityError> {
    let defaults = [endpoint.namespace(), endpoint.component(), endpoint.endpoint()];
    let selection = match explicit {
        Some(map) => Selection::Explicit(map),
        None => Selection::Defaults(&defaults),
    };
    let material = routing_scope_material(&selection)?;
    Ok(RoutingScopeId { digest: digest_16(&material), source: source_of(&selection) })
}

/// Resolve the indexer domain of a card served at `endpoint`.
///
/// `source_path` is the card's model source (for LoRA cards, the base model path),
/// `kv_block_size` and `format` its query semantics, `spec` its optional `indexer_identity`.
/// A zero block size is rejected before anything is hashed.
pub fn resolve_indexer_domain(
    source_path: &str,
    kv_block_size: u32,
    format: HashFormat,
    endpoint: &EndpointPath,
    spec: Option<&IndexerIdentitySpec>,
) -> Result<IndexerDomainId, IdentityError> {
    if kv_block_size == 0 {
        return Err(IdentityError::ZeroBlockSize);
    }
    let explicit_semantics = spec.and_then(|spec| spec.semantics.as_ref());
    let explicit_routing = spec.and_then(|spec| spec.routing_scope.as_ref());
    Ok(IndexerDomainId {
        cache_semantics: cache_semantics_id(
            source_path,
            explicit_semantics,
            kv_block_size,
            format,
        )?,
        routing_scope: routing_scope_id(endpoint, explicit_routing)?,
    })
}

/// One of the three segments of an [`EndpointPath`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointSegment {
    /// The Dynamo namespace.
    Namespace,
    /// The component within the namespace.
    Component,
    /// The endpoint name within the component.
    Endpoint,
}

impl fmt::Display for EndpointSegment {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            EndpointSegment::Namespace => "namespace",
            EndpointSegment::Component => "component",
            EndpointSegment::Endpoint => "endpoint",
        })
    }
}

/// Why a string or triple is not an endpoint path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum EndpointPathError {
    /// The path does not have exactly three `/`-separated segments.
    #[error("endpoint path has {segments} segments, expected namespace/component/endpoint")]
    SegmentCount {
        /// How many segments the path has.
        segments: usize,
    },
    /// A segment is empty.
    #[error("endpoint path {0} is empty")]
    EmptySegment(EndpointSegment),
    /// A segment contains `/`, so the path would not render back to the same triple.
    #[error("endpoint path {0} contains '/'")]
    SeparatorInSegment(EndpointSegment),
}

/// A Dynamo serving endpoint `namespace/component/endpoint`: the default routing-scope input.
///
/// Invariant: every segment is non-empty and free of `/`, so [`Display`](fmt::Display) and
/// [`FromStr`] round-trip exactly. The segments are shared: a clone copies three pointers, so
/// every input of an endpoint can carry its path without allocating.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointPath {
    namespace: Arc<str>,
    component: Arc<str>,
    endpoint: Arc<str>,
}

impl EndpointPath {
    /// Bytes of the three segments' texts. Clones share them, so charging every holder this
    /// much (as input weights do) is an upper bound.
    #[must_use]
    pub fn text_bytes(&self) -> usize {
        self.namespace.len() + self.component.len() + self.endpoint.len()
    }

    /// Build from the three segments, validating each.
    pub fn new(
        namespace: impl Into<String>,
        component: impl Into<String>,
        endpoint: impl Into<String>,
    ) -> Result<Self, EndpointPathError> {
        let (namespace, component, endpoint) =
            (namespace.into(), component.into(), endpoint.into());
        for (segment, text) in [
            (EndpointSegment::Namespace, &namespace),
            (EndpointSegment::Component, &component),
            (EndpointSegment::Endpoint, &endpoint),
        ] {
            if text.is_empty() {
                return Err(EndpointPathError::EmptySegment(segment));
            }
            if text.contains('/') {
                return Err(EndpointPathError::SeparatorInSegment(segment));
            }
        }
        Ok(EndpointPath {
            namespace: namespace.into(),
            component: component.into(),
            endpoint: endpoint.into(),
        })
    }

    /// The Dynamo namespace.
    #[must_use]
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The component within the namespace.
    #[must_use]
    pub fn component(&self) -> &str {
        &self.component
    }

    /// The endpoint name within the component.
    #[must_use]
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl FromStr for EndpointPath {
    type Err = EndpointPathError;

    /// Parse `"namespace/component/endpoint"`: exactly three non-empty segments.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let segments = text.split('/').count();
        let mut parts = text.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(namespace), Some(component), Some(endpoint), None) => {
                EndpointPath::new(namespace, component, endpoint)
            }
            _ => Err(EndpointPathError::SegmentCount { segments }),
        }
    }
}

impl fmt::Display for EndpointPath {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}/{}/{}", self.namespace, self.component, self.endpoint)
    }
}

/// Serialized as its `namespace/component/endpoint` text, so a deserialized path is validated.
impl serde::Serialize for EndpointPath {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for EndpointPath {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::hashing::HashFormat::{EagleV1, StandardV1};

    fn endpoint(path: &str) -> EndpointPath {
        path.parse().unwrap()
    }

    fn explicit(pairs: &[(&str, &str)]) -> ExplicitIdentityMap {
        ExplicitIdentityMap::try_from_pairs(pairs.iter().copied()).unwrap()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    #[test]
    fn relay_derivation_has_frozen_golden_vectors() {
        let domain = resolve_indexer_domain(
            "meta/llama",
            512,
            StandardV1,
            &endpoint("prod/router/generate"),
            None,
        )
        .unwrap();
        assert_eq!(domain.cache_semantics.to_string(), "7d31eb9019357572470605f4a8be687e");
        assert_eq!(domain.routing_scope.to_string(), "18270d3ba03effaec8d167ba02c7752d");
        assert_eq!(domain.cache_semantics.source, IdentitySource::DefaultDerived);
        assert_eq!(domain.routing_scope.source, IdentitySource::DefaultDerived);
        assert!(domain.relies_on_defaults());
        assert_eq!(
            domain.to_string(),
            "7d31eb9019357572470605f4a8be687e:18270d3ba03effaec8d167ba02c7752d"
        );
    }

    #[test]
    fn live_relay_catalog_domain_reproduces() {
        // From a live relay's catalog (digests printed in base64 there): card source_path
        // "/tmp/dynlive/models/tiny-llm", block size 16, standard hashing, served at
        // dynamo/backend/generate.
        let domain = resolve_indexer_domain(
            "/tmp/dynlive/models/tiny-llm",
            16,
            StandardV1,
            &endpoint("dynamo/backend/generate"),
            None,
        )
        .unwrap();
        // "ORO1+NwYbVH0FO9aPLMWuw=="
        assert_eq!(domain.cache_semantics.to_string(), "3913b5f8dc186d51f414ef5a3cb316bb");
        // "v5kLl6DQIwLJfJKoy8URiA=="
        assert_eq!(domain.routing_scope.to_string(), "bf990b97a0d02302c97c92a8cbc51188");
    }

    #[test]
    fn canonical_material_has_the_frozen_byte_layout() {
        let defaults = ["ab"];
        let bytes = cache_semantics_material(&Selection::Defaults(&defaults), 16, EagleV1).unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(&(CACHE_SEMANTICS_DEFAULT_TAG.len() as u32).to_le_bytes());
        expected.extend_from_slice(CACHE_SEMANTICS_DEFAULT_TAG.as_bytes());
        expected.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, b'a', b'b', 16, 0, 0, 0, 2, 0]);
        assert_eq!(hex(&bytes), hex(&expected));

        let map = explicit(&[("z", "1"), ("a", "22")]);
        let bytes = routing_scope_material(&Selection::Explicit(&map)).unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(&(ROUTING_SCOPE_EXPLICIT_TAG.len() as u32).to_le_bytes());
        expected.extend_from_slice(ROUTING_SCOPE_EXPLICIT_TAG.as_bytes());
        expected.extend_from_slice(&[2, 0, 0, 0]);
        expected.extend_from_slice(&[1, 0, 0, 0, b'a', 2, 0, 0, 0, b'2', b'2']);
        expected.extend_from_slice(&[1, 0, 0, 0, b'z', 1, 0, 0, 0, b'1']);
        assert_eq!(hex(&bytes), hex(&expected));
    }

    #[test]
    fn explicit_dimensions_replace_different_defaults() {
        // Two cards that differ in model source and endpoint but declare the same explicit
        // material derive the same domain (and would then be fenced as a PoolId collision).
        let semantics = explicit(&[("model", "llama-70b")]);
        let scope = explicit(&[("scope", "shared")]);
        let spec = IndexerIdentitySpec {
            semantics: Some(semantics.clone()),
            routing_scope: Some(scope.clone()),
        };
        let a =
            resolve_indexer_domain("meta/llama", 16, StandardV1, &endpoint("a/b/c"), Some(&spec))
                .unwrap();
        let b = resolve_indexer_domain(
            "/models/llama",
            16,
            StandardV1,
            &endpoint("x/y/z"),
            Some(&spec),
        )
        .unwrap();
        assert_eq!(a, b);
        assert!(!a.relies_on_defaults());
        assert_eq!(a.cache_semantics.source, IdentitySource::Explicit);
        assert_eq!(a.routing_scope.source, IdentitySource::Explicit);

        // Replacing only one dimension keeps the other tied to its defaults.
        let only_semantics =
            IndexerIdentitySpec { semantics: Some(semantics), routing_scope: None };
        let a =
            resolve_indexer_domain("p", 16, StandardV1, &endpoint("a/b/c"), Some(&only_semantics))
                .unwrap();
        let b =
            resolve_indexer_domain("q", 16, StandardV1, &endpoint("x/y/z"), Some(&only_semantics))
                .unwrap();
        assert_eq!(a.cache_semantics, b.cache_semantics);
        assert_ne!(a.routing_scope, b.routing_scope);
        assert!(a.relies_on_defaults());
        let only_scope = IndexerIdentitySpec { semantics: None, routing_scope: Some(scope) };
        let a = resolve_indexer_domain("p", 16, StandardV1, &endpoint("a/b/c"), Some(&only_scope))
            .unwrap();
        let b = resolve_indexer_domain("q", 16, StandardV1, &endpoint("x/y/z"), Some(&only_scope))
            .unwrap();
        assert_ne!(a.cache_semantics, b.cache_semantics);
        assert_eq!(a.routing_scope, b.routing_scope);

        // An empty spec is the same as none.
        let empty = IndexerIdentitySpec::default();
        assert_eq!(
            resolve_indexer_domain("p", 16, StandardV1, &endpoint("a/b/c"), Some(&empty)),
            resolve_indexer_domain("p", 16, StandardV1, &endpoint("a/b/c"), None),
        );
    }

    #[test]
    fn default_and_explicit_sources_never_alias() {
        // Explicit material whose single value equals the default input still differs: another
        // tag is hashed and the source differs.
        let same_text = explicit(&[("source_path", "meta/llama")]);
        let default = cache_semantics_id("meta/llama", None, 16, StandardV1).unwrap();
        let explicit_id =
            cache_semantics_id("meta/llama", Some(&same_text), 16, StandardV1).unwrap();
        assert_ne!(default.digest, explicit_id.digest);
        assert_ne!(default, explicit_id);

        let path = endpoint("prod/router/generate");
        let default = routing_scope_id(&path, None).unwrap();
        let map =
            explicit(&[("component", "router"), ("endpoint", "generate"), ("namespace", "prod")]);
        let explicit_id = routing_scope_id(&path, Some(&map)).unwrap();
        assert_ne!(default.digest, explicit_id.digest);

        // Equality covers the source even for an identical digest.
        let relabeled = RoutingScopeId { source: IdentitySource::Explicit, ..default };
        assert_ne!(relabeled, default);
    }

    #[test]
    fn mandatory_semantics_cannot_be_replaced_by_explicit_material() {
        let map = explicit(&[("model", "m"), ("kv_block_size", "16"), ("hash_format", "1")]);
        let base = cache_semantics_id("ignored", Some(&map), 16, StandardV1).unwrap();
        assert_ne!(base, cache_semantics_id("ignored", Some(&map), 32, StandardV1).unwrap());
        assert_ne!(base, cache_semantics_id("ignored", Some(&map), 16, EagleV1).unwrap());
        // The source path is what explicit material replaces.
        assert_eq!(base, cache_semantics_id("other", Some(&map), 16, StandardV1).unwrap());
        assert_eq!(
            cache_semantics_id("ignored", Some(&map), 0, StandardV1),
            Err(IdentityError::ZeroBlockSize)
        );
    }

    #[test]
    fn eagle_is_a_distinct_cache_semantics_pipeline() {
        let path = endpoint("prod/router/generate");
        let standard = resolve_indexer_domain("meta/llama", 512, StandardV1, &path, None).unwrap();
        let eagle = resolve_indexer_domain("meta/llama", 512, EagleV1, &path, None).unwrap();
        assert_ne!(standard.cache_semantics, eagle.cache_semantics);
        assert_eq!(standard.routing_scope, eagle.routing_scope);
        assert_ne!(standard, eagle);
    }

    #[test]
    fn block_size_separates_cache_semantics() {
        let a = cache_semantics_id("m", None, 16, StandardV1).unwrap();
        let b = cache_semantics_id("m", None, 32, StandardV1).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn zero_block_size_cannot_form_a_queryable_domain() {
        let path = endpoint("prod/router/generate");
        for format in [StandardV1, EagleV1] {
            assert_eq!(
                resolve_indexer_domain("meta/llama", 0, format, &path, None),
                Err(IdentityError::ZeroBlockSize)
            );
            let spec = IndexerIdentitySpec {
                semantics: Some(explicit(&[("model", "m")])),
                routing_scope: Some(explicit(&[("scope", "s")])),
            };
            assert_eq!(
                resolve_indexer_domain("meta/llama", 0, format, &path, Some(&spec)),
                Err(IdentityError::ZeroBlockSize)
            );
        }
        assert!(resolve_indexer_domain("meta/llama", 1, StandardV1, &path, None).is_ok());
        assert!(resolve_indexer_domain("meta/llama", u32::MAX, StandardV1, &path, None).is_ok());
    }

    #[test]
    fn explicit_material_replaces_defaults_and_is_order_independent() {
        let forward = explicit(&[("a", "1"), ("b", "2"), ("c", "3")]);
        let backward = explicit(&[("c", "3"), ("b", "2"), ("a", "1")]);
        assert_eq!(forward, backward);
        let path_one = endpoint("n1/c1/e1");
        let path_two = endpoint("n2/c2/e2");
        assert_eq!(
            routing_scope_id(&path_one, Some(&forward)),
            routing_scope_id(&path_two, Some(&backward))
        );
        assert_eq!(
            cache_semantics_id("one", Some(&forward), 8, StandardV1),
            cache_semantics_id("two", Some(&backward), 8, StandardV1)
        );
        assert_ne!(
            routing_scope_id(&path_one, Some(&forward)).unwrap(),
            routing_scope_id(&path_one, None).unwrap()
        );
        // Keys and values both matter.
        let other_value = explicit(&[("a", "1"), ("b", "2"), ("c", "4")]);
        let other_key = explicit(&[("a", "1"), ("b", "2"), ("d", "3")]);
        let base = routing_scope_id(&path_one, Some(&forward)).unwrap();
        assert_ne!(base, routing_scope_id(&path_one, Some(&other_value)).unwrap());
        assert_ne!(base, routing_scope_id(&path_one, Some(&other_key)).unwrap());
    }

    #[test]
    fn length_framing_distinguishes_adjacent_inputs() {
        let ab_c = ["ab", "c"];
        let a_bc = ["a", "bc"];
        assert_ne!(
            routing_scope_material(&Selection::Defaults(&ab_c)).unwrap(),
            routing_scope_material(&Selection::Defaults(&a_bc)).unwrap()
        );
        assert_ne!(
            routing_scope_id(&endpoint("ab/c/e"), None).unwrap(),
            routing_scope_id(&endpoint("a/bc/e"), None).unwrap()
        );
        // Explicit keys and values are framed too.
        assert_ne!(
            routing_scope_id(&path_for_framing(), Some(&explicit(&[("ab", "c")]))).unwrap(),
            routing_scope_id(&path_for_framing(), Some(&explicit(&[("a", "bc")]))).unwrap()
        );
        // The count keeps a split input apart from an unsplit one.
        assert_ne!(
            routing_scope_material(&Selection::Defaults(&["a", ""])).unwrap(),
            routing_scope_material(&Selection::Defaults(&["a"])).unwrap()
        );
    }

    fn path_for_framing() -> EndpointPath {
        endpoint("n/c/e")
    }

    #[test]
    fn endpoint_paths_need_exactly_three_nonempty_segments() {
        let path = endpoint("prod/router/generate");
        assert_eq!(
            (path.namespace(), path.component(), path.endpoint()),
            ("prod", "router", "generate")
        );
        assert_eq!(path.to_string(), "prod/router/generate");
        let cases = [
            ("", EndpointPathError::SegmentCount { segments: 1 }),
            ("prod", EndpointPathError::SegmentCount { segments: 1 }),
            ("prod/router", EndpointPathError::SegmentCount { segments: 2 }),
            ("a/b/c/d", EndpointPathError::SegmentCount { segments: 4 }),
            ("/router/generate", EndpointPathError::EmptySegment(EndpointSegment::Namespace)),
            ("prod//generate", EndpointPathError::EmptySegment(EndpointSegment::Component)),
            ("prod/router/", EndpointPathError::EmptySegment(EndpointSegment::Endpoint)),
            ("//", EndpointPathError::EmptySegment(EndpointSegment::Namespace)),
        ];
        for (text, error) in cases {
            assert_eq!(text.parse::<EndpointPath>(), Err(error), "{text:?}");
        }
        assert_eq!(
            EndpointPath::new("a", "b/c", "d"),
            Err(EndpointPathError::SeparatorInSegment(EndpointSegment::Component))
        );
        assert_eq!(EndpointPath::new("a", "b", "c"), Ok(endpoint("a/b/c")));
    }
}
