//! Which published pool backs each `(serving endpoint, base model)` pair (relay-facts §10.2,
//! pool links).
//!
//! A topology member carries the pool id of the endpoint's KV pool so that a remote router can
//! look up that pool's filter. The catalog supplies the links as claims, one per descriptor and
//! base model it serves. Links are keyed by endpoint **and** base model: after an in-place model
//! swap the endpoint's entry for the new model must never point at the previous generation's
//! pool, which still serves (and is still cataloged for) the old model until it is withdrawn.
//!
//! Conflicting facts fail closed: when one `(endpoint, base model)` pair is claimed more than
//! once, the pair gets no link at all, whatever the claimed pool ids are. A member without a
//! link is a fact a consumer already handles (an encode endpoint has none until it publishes
//! KV); a wrong link would send it to a filter that answers a different question.
//!
//! Bound: one record per distinct claimed pair.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::identity::{EndpointPath, PoolId};

/// Pool links by `(endpoint, base model)`, built from catalog claims.
///
/// Invariants: a pair is either linked or ambiguous, never both; a pair claimed more than once
/// is ambiguous and stays ambiguous for the life of this value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolLinks {
    /// Linked pools by endpoint, then base model (nested so lookups borrow their keys).
    links: BTreeMap<EndpointPath, BTreeMap<String, PoolId>>,
    ambiguous: BTreeSet<(EndpointPath, String)>,
}

impl PoolLinks {
    /// No links: every member is reported without a pool id.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Build links from `(endpoint, base model, pool id)` claims, in any order.
    ///
    /// A pair claimed once is linked to its pool; a pair claimed more than once is dropped
    /// (fail closed), even when the claims name the same pool.
    #[must_use]
    pub fn from_claims(claims: impl IntoIterator<Item = (EndpointPath, String, PoolId)>) -> Self {
        let mut links = PoolLinks::new();
        for (endpoint, base_model, pool_id) in claims {
            let key = (endpoint, base_model);
            if links.ambiguous.contains(&key) {
                continue;
            }
            let (endpoint, base_model) = key;
            let by_model = links.links.entry(endpoint.clone()).or_default();
            if by_model.remove(&base_model).is_some() {
                if by_model.is_empty() {
                    links.links.remove(&endpoint);
                }
                links.ambiguous.insert((endpoint, base_model));
            } else {
                by_model.insert(base_model, pool_id);
            }
        }
        debug_assert!(links.iter().all(|(endpoint, base_model, _)| {
            !links.ambiguous.contains(&(endpoint.clone(), base_model.to_owned()))
        }));
        links
    }

    /// The pool linked to `endpoint` serving `base_model`, if exactly one claim named it.
    #[must_use]
    pub fn link(&self, endpoint: &EndpointPath, base_model: &str) -> Option<PoolId> {
        self.links.get(endpoint).and_then(|by_model| by_model.get(base_model)).copied()
    }

    /// Every linked `(endpoint, base model, pool)`, ordered by endpoint then base model.
    pub fn iter(&self) -> impl Iterator<Item = (&EndpointPath, &str, PoolId)> {
        self.links.iter().flat_map(|(endpoint, by_model)| {
            by_model
                .iter()
                .map(move |(base_model, pool_id)| (endpoint, base_model.as_str(), *pool_id))
        })
    }

    /// Pairs claimed more than once, hence left without a link.
    #[must_use]
    pub fn ambiguous(&self) -> &BTreeSet<(EndpointPath, String)> {
        &self.ambiguous
    }
}
