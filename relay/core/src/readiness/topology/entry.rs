//! The published readiness values: [`TopologyEntry`], [`TopologyMember`], [`AdapterReadiness`]
//! (relay-facts §3.3), in wire field order.
//!
//! These are domain values, not protobuf messages: the WAN layer maps them onto
//! `dynamo.kvrelay.v1`. They serialize (serde) for snapshot tests and diagnostics; endpoint
//! paths and pool ids render through their `Display` forms, roles and states by their wire enum
//! names without prefix. The rendering holds no random or wall-clock values.

use std::collections::BTreeSet;

use serde::{Serialize, Serializer};

use crate::discovery::WorkerRole;
use crate::model::identity::{EndpointPath, PoolId};
use crate::readiness::ReadinessState;

/// The key of one topology entry: a namespace and a canonical base model served in it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TopologyKey {
    /// The Dynamo namespace.
    pub namespace: String,
    /// The canonical base model.
    pub canonical_model_id: String,
}

/// One serving endpoint participating in a topology entry.
///
/// Invariants (as produced by the projection): `endpoint`'s namespace is the entry's; `roles`
/// is non-empty; `pool_id` is present only when the catalog links exactly one pool to this
/// endpoint for the entry's base model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyMember {
    /// The serving endpoint.
    pub endpoint: EndpointPath,
    /// The roles its workers declare (whether or not they are live), in wire order.
    pub roles: BTreeSet<WorkerRole>,
    /// The pool publishing this endpoint's KV for the entry's base model, if linked.
    pub pool_id: Option<PoolId>,
}

impl Serialize for TopologyMember {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Repr<'a> {
            endpoint: String,
            roles: &'a BTreeSet<WorkerRole>,
            pool_id: Option<String>,
        }
        Repr {
            endpoint: self.endpoint.to_string(),
            roles: &self.roles,
            pool_id: self.pool_id.as_ref().map(ToString::to_string),
        }
        .serialize(serializer)
    }
}

/// The readiness of one LoRA adapter over an entry's base model.
///
/// Invariants: `missing_roles` is empty when `state` is UNKNOWN; `state` is UNKNOWN or
/// UNAVAILABLE whenever the base entry's state is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterReadiness {
    /// The adapter's request-facing (served) model name.
    pub canonical_model_id: String,
    /// The adapter's state, composed with the base entry's.
    pub state: ReadinessState,
    /// Roles the adapter lacks, together with the base entry's missing roles, in wire order.
    pub missing_roles: BTreeSet<WorkerRole>,
}

/// The serving readiness of one canonical base model in one namespace.
///
/// Invariants (as produced by the projection, matching the wire validation of §3.4):
/// - `members` is non-empty, sorted by the endpoint's `namespace/component/endpoint` text,
///   unique, and every member's namespace is `namespace`;
/// - `present_roles` and `missing_roles` are empty when `state` is UNKNOWN, and
///   `missing_roles` is empty when `legacy_fallback_active`;
/// - `duplicate_role_endpoints` holds only PREFILL and DECODE;
/// - `adapters` are sorted and unique by `canonical_model_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopologyEntry {
    /// The Dynamo namespace.
    pub namespace: String,
    /// The canonical base model.
    pub canonical_model_id: String,
    /// UNKNOWN until every member has authoritative availability; then READY or UNAVAILABLE.
    pub state: ReadinessState,
    /// Typed roles with a live worker, in wire order.
    pub present_roles: BTreeSet<WorkerRole>,
    /// Roles declared but dead, or needed by a live unit and absent, in wire order.
    pub missing_roles: BTreeSet<WorkerRole>,
    /// The participating endpoints.
    pub members: Vec<TopologyMember>,
    /// PREFILL / DECODE roles declared by more than one member endpoint.
    pub duplicate_role_endpoints: BTreeSet<WorkerRole>,
    /// Some member declares a legacy (untyped) worker: strict role gating is bypassed.
    pub legacy_fallback_active: bool,
    /// The base model's LoRA adapters, sorted by id.
    pub adapters: Vec<AdapterReadiness>,
}

impl TopologyEntry {
    /// The entry's key.
    #[must_use]
    pub fn key(&self) -> TopologyKey {
        TopologyKey {
            namespace: self.namespace.clone(),
            canonical_model_id: self.canonical_model_id.clone(),
        }
    }

    /// The member for `endpoint`, if it participates.
    #[must_use]
    pub fn member(&self, endpoint: &EndpointPath) -> Option<&TopologyMember> {
        self.members.iter().find(|member| member.endpoint == *endpoint)
    }

    /// The adapter named `canonical_model_id`, if the entry lists it.
    #[must_use]
    pub fn adapter(&self, canonical_model_id: &str) -> Option<&AdapterReadiness> {
        self.adapters.iter().find(|adapter| adapter.canonical_model_id == canonical_model_id)
    }

    /// Whether the entry keeps the invariants listed on the type (the wire's validation rules
    /// for an entry the relay produces). Used as a postcondition of the projection.
    #[must_use]
    pub fn is_well_formed(&self) -> bool {
        let unknown = self.state == ReadinessState::Unknown;
        let roles_valid = |roles: &BTreeSet<WorkerRole>| !roles.contains(&WorkerRole::Unspecified);
        let members_sorted = self
            .members
            .windows(2)
            .all(|pair| pair[0].endpoint.to_string() < pair[1].endpoint.to_string());
        let adapters_sorted = self
            .adapters
            .windows(2)
            .all(|pair| pair[0].canonical_model_id < pair[1].canonical_model_id);
        !self.members.is_empty()
            && members_sorted
            && self.members.iter().all(|member| {
                member.endpoint.namespace() == self.namespace
                    && !member.roles.is_empty()
                    && roles_valid(&member.roles)
            })
            && (!unknown || (self.present_roles.is_empty() && self.missing_roles.is_empty()))
            && (!self.legacy_fallback_active || self.missing_roles.is_empty())
            && roles_valid(&self.present_roles)
            && roles_valid(&self.missing_roles)
            && self
                .duplicate_role_endpoints
                .iter()
                .all(|role| matches!(role, WorkerRole::Prefill | WorkerRole::Decode))
            && adapters_sorted
            && self.adapters.iter().all(|adapter| {
                roles_valid(&adapter.missing_roles)
                    && (adapter.state != ReadinessState::Unknown
                        || adapter.missing_roles.is_empty())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(path: &str, roles: &[WorkerRole]) -> TopologyMember {
        TopologyMember {
            endpoint: path.parse().expect("an endpoint path"),
            roles: roles.iter().copied().collect(),
            pool_id: None,
        }
    }

    fn adapter(id: &str, state: ReadinessState, missing: &[WorkerRole]) -> AdapterReadiness {
        AdapterReadiness {
            canonical_model_id: id.to_owned(),
            state,
            missing_roles: missing.iter().copied().collect(),
        }
    }

    /// A ready prefill/decode entry with one adapter: every rule holds.
    fn sound() -> TopologyEntry {
        TopologyEntry {
            namespace: "prod".to_owned(),
            canonical_model_id: "model".to_owned(),
            state: ReadinessState::Ready,
            present_roles: [WorkerRole::Prefill, WorkerRole::Decode].into_iter().collect(),
            missing_roles: BTreeSet::new(),
            members: vec![
                member("prod/decode/generate", &[WorkerRole::Decode]),
                member("prod/prefill/generate", &[WorkerRole::Prefill]),
            ],
            duplicate_role_endpoints: [WorkerRole::Decode].into_iter().collect(),
            legacy_fallback_active: false,
            adapters: vec![
                adapter("lora-a", ReadinessState::Ready, &[]),
                adapter("lora-b", ReadinessState::Unavailable, &[WorkerRole::Prefill]),
            ],
        }
    }

    /// Each rule of the type doc, broken alone, makes the entry ill-formed.
    #[test]
    fn each_broken_rule_is_seen() {
        assert!(sound().is_well_formed());
        type Break = fn(&mut TopologyEntry);
        let cases: [(&str, Break); 14] = [
            ("no member", |e| e.members.clear()),
            ("members out of order", |e| e.members.reverse()),
            ("a repeated member", |e| e.members[1] = e.members[0].clone()),
            ("a member of another namespace", |e| {
                e.members[0] = member("test/decode/generate", &[WorkerRole::Decode]);
            }),
            ("a member without roles", |e| e.members[0].roles.clear()),
            ("a member of an unspecified role", |e| {
                e.members[0].roles.insert(WorkerRole::Unspecified);
            }),
            ("unknown with present roles", |e| e.state = ReadinessState::Unknown),
            ("unknown with missing roles", |e| {
                e.state = ReadinessState::Unknown;
                e.present_roles.clear();
                e.missing_roles.insert(WorkerRole::Decode);
            }),
            ("legacy fallback with missing roles", |e| {
                e.legacy_fallback_active = true;
                e.missing_roles.insert(WorkerRole::Encode);
            }),
            ("an unspecified missing role", |e| {
                e.missing_roles.insert(WorkerRole::Unspecified);
            }),
            ("a duplicate aggregated role", |e| {
                e.duplicate_role_endpoints.insert(WorkerRole::Aggregated);
            }),
            ("a repeated adapter", |e| e.adapters[1] = e.adapters[0].clone()),
            ("an adapter missing an unspecified role", |e| {
                e.adapters[1].missing_roles.insert(WorkerRole::Unspecified);
            }),
            ("an unknown adapter with missing roles", |e| {
                e.adapters[1].state = ReadinessState::Unknown;
            }),
        ];
        for (rule, break_it) in cases {
            let mut entry = sound();
            break_it(&mut entry);
            assert!(!entry.is_well_formed(), "{rule}");
        }
        // An unknown entry with no roles and an unknown adapter with none missing are sound.
        let mut unknown = sound();
        unknown.state = ReadinessState::Unknown;
        unknown.present_roles.clear();
        unknown.adapters[1] = adapter("lora-b", ReadinessState::Unknown, &[]);
        assert!(unknown.is_well_formed());
        let mut unspecified_present = sound();
        unspecified_present.present_roles.insert(WorkerRole::Unspecified);
        assert!(!unspecified_present.is_well_formed());
    }
}
