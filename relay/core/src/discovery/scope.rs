//! Which endpoints a relay watches (relay-facts §9.1).
//!
//! A scope selects namespaces (every namespace, or an explicit list) and optionally narrows them
//! to endpoint prefixes. Prefixes match whole dot-separated segments of
//! `namespace.component.endpoint`, so `production.back` does not match `production.backend`.
//!
//! Invariants of a constructed [`DiscoveryScope`]: exactly one of "watch all" or a non-empty
//! namespace list; every namespace and prefix is non-empty, has no surrounding whitespace and
//! no empty dot segment, and appears once; with explicit namespaces every prefix lies inside
//! one of them (equals a namespace or starts with `namespace.`).

use std::collections::BTreeSet;

use serde::Serialize;
use thiserror::Error;

use crate::model::identity::EndpointPath;

/// Why a discovery configuration is not a usable scope.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScopeError {
    /// Neither `watch_all` nor any namespace: the relay would watch nothing by accident.
    #[error("discovery scope selects nothing: set watch_all or name at least one namespace")]
    NothingSelected,
    /// Both `watch_all` and explicit namespaces: the intent is ambiguous.
    #[error("discovery scope sets both watch_all and explicit namespaces")]
    WatchAllWithNamespaces,
    /// A namespace is the empty string.
    #[error("discovery namespace must not be empty")]
    EmptyNamespace,
    /// A namespace has leading or trailing whitespace.
    #[error("discovery namespace {namespace:?} has surrounding whitespace")]
    NamespaceWhitespace {
        /// The rejected namespace.
        namespace: String,
    },
    /// A namespace appears more than once.
    #[error("discovery namespace {namespace:?} appears more than once")]
    DuplicateNamespace {
        /// The repeated namespace.
        namespace: String,
    },
    /// An endpoint prefix is the empty string.
    #[error("endpoint prefix must not be empty")]
    EmptyPrefix,
    /// An endpoint prefix has leading or trailing whitespace.
    #[error("endpoint prefix {prefix:?} has surrounding whitespace")]
    PrefixWhitespace {
        /// The rejected prefix.
        prefix: String,
    },
    /// An endpoint prefix has an empty dot segment (`a..b`, `a.`, `.a`), so it could never
    /// match a whole segment.
    #[error("endpoint prefix {prefix:?} has an empty segment")]
    PrefixEmptySegment {
        /// The rejected prefix.
        prefix: String,
    },
    /// An endpoint prefix appears more than once.
    #[error("endpoint prefix {prefix:?} appears more than once")]
    DuplicatePrefix {
        /// The repeated prefix.
        prefix: String,
    },
    /// With explicit namespaces, a prefix names an endpoint outside all of them.
    #[error("endpoint prefix {prefix:?} lies outside every watched namespace")]
    PrefixOutsideNamespaces {
        /// The rejected prefix.
        prefix: String,
    },
}

/// Which namespaces a scope watches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NamespaceSelection {
    /// Every namespace (one `AllModels` query).
    All,
    /// These namespaces only (one `NamespacedModels` query each); never empty.
    Namespaces(BTreeSet<String>),
}

/// A discovery-plane card query that realizes a scope.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryQuery {
    /// Every model card in the deployment.
    AllModels,
    /// The model cards of one namespace (filtered server-side).
    NamespacedModels {
        /// The namespace.
        namespace: String,
    },
}

/// The validated set of endpoints a relay watches. See the module docs for its invariants.
/// Deserializing validates like [`DiscoveryScope::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(try_from = "ScopeShape")]
pub struct DiscoveryScope {
    namespaces: NamespaceSelection,
    endpoint_prefixes: BTreeSet<String>,
}

/// The serialized shape of a [`DiscoveryScope`], validated on the way in.
#[derive(serde::Deserialize)]
struct ScopeShape {
    namespaces: NamespaceSelection,
    endpoint_prefixes: BTreeSet<String>,
}

impl TryFrom<ScopeShape> for DiscoveryScope {
    type Error = ScopeError;

    fn try_from(shape: ScopeShape) -> Result<Self, ScopeError> {
        let prefixes = shape.endpoint_prefixes.into_iter().collect();
        match shape.namespaces {
            NamespaceSelection::All => DiscoveryScope::new(Vec::new(), prefixes, true),
            NamespaceSelection::Namespaces(names) => {
                DiscoveryScope::new(names.into_iter().collect(), prefixes, false)
            }
        }
    }
}

impl DiscoveryScope {
    /// Validate the configuration shape `{namespaces, endpoint_prefixes, watch_all}`.
    ///
    /// Order of the inputs does not matter; duplicates are errors rather than silently merged,
    /// because a repeated entry usually means a typo in another one.
    pub fn new(
        namespaces: Vec<String>,
        endpoint_prefixes: Vec<String>,
        watch_all: bool,
    ) -> Result<Self, ScopeError> {
        let selection = match (watch_all, namespaces.is_empty()) {
            (true, false) => return Err(ScopeError::WatchAllWithNamespaces),
            (false, true) => return Err(ScopeError::NothingSelected),
            (true, true) => NamespaceSelection::All,
            (false, false) => {
                let mut unique = BTreeSet::new();
                for namespace in namespaces {
                    if namespace.is_empty() {
                        return Err(ScopeError::EmptyNamespace);
                    }
                    if has_surrounding_whitespace(&namespace) {
                        return Err(ScopeError::NamespaceWhitespace { namespace });
                    }
                    if unique.contains(&namespace) {
                        return Err(ScopeError::DuplicateNamespace { namespace });
                    }
                    unique.insert(namespace);
                }
                NamespaceSelection::Namespaces(unique)
            }
        };
        let mut prefixes = BTreeSet::new();
        for prefix in endpoint_prefixes {
            if prefix.is_empty() {
                return Err(ScopeError::EmptyPrefix);
            }
            if has_surrounding_whitespace(&prefix) {
                return Err(ScopeError::PrefixWhitespace { prefix });
            }
            if prefix.split('.').any(str::is_empty) {
                return Err(ScopeError::PrefixEmptySegment { prefix });
            }
            if let NamespaceSelection::Namespaces(namespaces) = &selection
                && !namespaces.iter().any(|namespace| segment_prefix_matches(&prefix, namespace))
            {
                return Err(ScopeError::PrefixOutsideNamespaces { prefix });
            }
            if prefixes.contains(&prefix) {
                return Err(ScopeError::DuplicatePrefix { prefix });
            }
            prefixes.insert(prefix);
        }
        Ok(DiscoveryScope { namespaces: selection, endpoint_prefixes: prefixes })
    }

    /// Watch every namespace, narrowed by `endpoint_prefixes` (empty = every endpoint).
    pub fn watch_all(endpoint_prefixes: Vec<String>) -> Result<Self, ScopeError> {
        Self::new(Vec::new(), endpoint_prefixes, true)
    }

    /// Watch the named namespaces, narrowed by `endpoint_prefixes` (empty = every endpoint).
    pub fn namespaces(
        namespaces: Vec<String>,
        endpoint_prefixes: Vec<String>,
    ) -> Result<Self, ScopeError> {
        Self::new(namespaces, endpoint_prefixes, false)
    }

    /// The namespaces watched.
    #[must_use]
    pub fn namespace_selection(&self) -> &NamespaceSelection {
        &self.namespaces
    }

    /// The endpoint prefixes, in sorted order; empty means every endpoint.
    #[must_use]
    pub fn endpoint_prefixes(&self) -> &BTreeSet<String> {
        &self.endpoint_prefixes
    }

    /// The discovery queries that list this scope's cards, in a stable order: one
    /// `AllModels` query, or one `NamespacedModels` query per namespace.
    #[must_use]
    pub fn queries(&self) -> Vec<DiscoveryQuery> {
        match &self.namespaces {
            NamespaceSelection::All => vec![DiscoveryQuery::AllModels],
            NamespaceSelection::Namespaces(namespaces) => namespaces
                .iter()
                .map(|namespace| DiscoveryQuery::NamespacedModels { namespace: namespace.clone() })
                .collect(),
        }
    }

    /// Whether cards served at `endpoint` belong to this scope: its namespace is watched and
    /// some prefix matches whole segments of `namespace.component.endpoint` (or there is no
    /// prefix at all).
    #[must_use]
    pub fn includes(&self, endpoint: &EndpointPath) -> bool {
        if let NamespaceSelection::Namespaces(namespaces) = &self.namespaces
            && !namespaces.contains(endpoint.namespace())
        {
            return false;
        }
        if self.endpoint_prefixes.is_empty() {
            return true;
        }
        let dotted =
            format!("{}.{}.{}", endpoint.namespace(), endpoint.component(), endpoint.endpoint());
        self.endpoint_prefixes.iter().any(|prefix| segment_prefix_matches(&dotted, prefix))
    }
}

/// True if `text` equals `prefix` or continues it at a dot boundary.
fn segment_prefix_matches(text: &str, prefix: &str) -> bool {
    match text.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('.'),
        None => false,
    }
}

fn has_surrounding_whitespace(text: &str) -> bool {
    text.trim() != text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|item| (*item).to_owned()).collect()
    }

    fn endpoint(path: &str) -> EndpointPath {
        path.parse().unwrap()
    }

    #[test]
    fn scope_validation_rejects_every_malformed_configuration() {
        let cases: &[(&[&str], &[&str], bool, ScopeError)] = &[
            (&[], &[], false, ScopeError::NothingSelected),
            (&["prod"], &[], true, ScopeError::WatchAllWithNamespaces),
            (&[""], &[], false, ScopeError::EmptyNamespace),
            (&[" prod"], &[], false, ScopeError::NamespaceWhitespace { namespace: " prod".into() }),
            (
                &["prod", "prod"],
                &[],
                false,
                ScopeError::DuplicateNamespace { namespace: "prod".into() },
            ),
            (&[], &[""], true, ScopeError::EmptyPrefix),
            (&[], &["prod.a "], true, ScopeError::PrefixWhitespace { prefix: "prod.a ".into() }),
            (&[], &["prod..a"], true, ScopeError::PrefixEmptySegment { prefix: "prod..a".into() }),
            (&[], &["prod."], true, ScopeError::PrefixEmptySegment { prefix: "prod.".into() }),
            (
                &[],
                &["prod.a", "prod.a"],
                true,
                ScopeError::DuplicatePrefix { prefix: "prod.a".into() },
            ),
            (
                &["prod"],
                &["production.a"],
                false,
                ScopeError::PrefixOutsideNamespaces { prefix: "production.a".into() },
            ),
            (
                &["prod"],
                &["staging"],
                false,
                ScopeError::PrefixOutsideNamespaces { prefix: "staging".into() },
            ),
        ];
        for (namespaces, prefixes, watch_all, expected) in cases {
            let result = DiscoveryScope::new(strings(namespaces), strings(prefixes), *watch_all);
            assert_eq!(
                result.as_ref().err(),
                Some(expected),
                "{namespaces:?} {prefixes:?} {watch_all}"
            );
        }
    }

    #[test]
    fn scope_validation_accepts_prefixes_inside_explicit_namespaces() {
        let scope = DiscoveryScope::namespaces(
            strings(&["prod", "staging"]),
            strings(&["prod", "staging.backend.generate"]),
        )
        .unwrap();
        assert_eq!(
            scope.queries(),
            vec![
                DiscoveryQuery::NamespacedModels { namespace: "prod".into() },
                DiscoveryQuery::NamespacedModels { namespace: "staging".into() },
            ]
        );
        let all = DiscoveryScope::watch_all(strings(&["anything.goes"])).unwrap();
        assert_eq!(all.queries(), vec![DiscoveryQuery::AllModels]);
    }

    #[test]
    fn prefixes_match_whole_segments_only() {
        let cases: &[(&[&str], &str, bool)] = &[
            (&[], "production/backend/generate", true),
            (&["production"], "production/backend/generate", true),
            (&["production.backend"], "production/backend/generate", true),
            (&["production.back"], "production/backend/generate", false),
            (&["production.backend.generate"], "production/backend/generate", true),
            (&["production.backend.gen"], "production/backend/generate", false),
            (&["production.backend.generate.x"], "production/backend/generate", false),
            (&["prod"], "production/backend/generate", false),
            (&["staging", "production.backend"], "production/backend/generate", true),
        ];
        for (prefixes, path, expected) in cases {
            let scope = DiscoveryScope::watch_all(strings(prefixes)).unwrap();
            assert_eq!(scope.includes(&endpoint(path)), *expected, "{prefixes:?} {path}");
        }
    }

    #[test]
    fn explicit_namespaces_exclude_other_namespaces() {
        let scope = DiscoveryScope::namespaces(strings(&["prod"]), Vec::new()).unwrap();
        assert!(scope.includes(&endpoint("prod/backend/generate")));
        assert!(!scope.includes(&endpoint("staging/backend/generate")));
        assert!(!scope.includes(&endpoint("production/backend/generate")));
    }
}
