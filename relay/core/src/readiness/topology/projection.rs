//! The pure topology projection: memberships + availability + pool links → entries
//! (relay-facts §10.2, §10.3).
//!
//! Every call recomputes all entries from the *current* inputs; nothing is remembered between
//! calls. That is what makes a departed endpoint a fact rather than an unknown: once its
//! membership is gone, it is simply no longer a member, and whatever the remaining members need
//! from it is missing (a PD entry whose decode endpoint left is UNAVAILABLE with DECODE
//! missing). The entry is UNKNOWN only while a *current* member lacks an authoritative listing.
//!
//! Steps, per `(namespace, canonical base model)`:
//! 1. members: every endpoint without a ServingTopology conflict that registers the base model
//!    (ServingBinding conflicts already removed only their binding from the registrations;
//!    PoolMaterialization conflicts keep the endpoint in the topology, without a pool link);
//! 2. units: per member endpoint, its workers grouped by `(worker type, needs, model type)`,
//!    each group counting the workers present in the endpoint's availability;
//! 3. state: UNKNOWN unless every member is authoritative, else the shared evaluator's verdict,
//!    turned UNAVAILABLE under the strict ambiguity policy when a PREFILL / DECODE role is
//!    declared by more than one member endpoint;
//! 4. adapters: per adapter of the base model, the same unit construction restricted to the
//!    workers advertising it, evaluated and composed with the base state by the shared
//!    adapter evaluator (which keeps ENCODE out of adapter membership).

use std::collections::{BTreeMap, BTreeSet};

use super::availability::AvailabilityStore;
use super::entry::{AdapterReadiness, TopologyEntry, TopologyKey, TopologyMember};
use super::links::PoolLinks;
use crate::discovery::{ConflictScope, EndpointMembership, WorkerRole};
use crate::inputs::{ModelTypeFlags, WorkerType};
use crate::model::identity::EndpointPath;
use crate::readiness::{
    AmbiguityPolicy, Evaluation, ReadinessState, ReadinessUnit, evaluate, evaluate_adapter,
};

/// Roles reported in `duplicate_role_endpoints` when more than one member endpoint declares
/// them. AGGREGATED duplicates are legal scale-out; ENCODE is outside the v1 wire field.
const DUPLICABLE_ROLES: [WorkerRole; 2] = [WorkerRole::Prefill, WorkerRole::Decode];

/// One member endpoint of a group, with its availability.
struct Participant<'a> {
    membership: &'a EndpointMembership,
    /// `None` until the endpoint's owning slot has an authoritative listing.
    live_workers: Option<&'a BTreeSet<u64>>,
}

/// Project the topology entries, sorted and unique by `(namespace, canonical model)`.
///
/// `policy` decides whether duplicated roles gate readiness: with [`AmbiguityPolicy::Report`]
/// `duplicate_role_endpoints` is only reported; with [`AmbiguityPolicy::Unavailable`] an entry
/// that reports any duplicated role is UNAVAILABLE (UNKNOWN stays UNKNOWN). The gate is on the
/// reported fact only, so an UNAVAILABLE entry is always explained by its own fields: either a
/// role is missing, or (strict policy) a role is duplicated.
#[must_use]
pub fn project_topology(
    memberships: &BTreeMap<EndpointPath, EndpointMembership>,
    availability: &AvailabilityStore,
    links: &PoolLinks,
    policy: AmbiguityPolicy,
) -> Vec<TopologyEntry> {
    let mut groups: BTreeMap<TopologyKey, Vec<Participant<'_>>> = BTreeMap::new();
    for membership in memberships.values() {
        if removed_from_topology(membership) {
            continue;
        }
        let live_workers = availability.live_workers(&membership.endpoint);
        for base_model in membership.base_models() {
            let key = TopologyKey {
                namespace: membership.endpoint.namespace().to_owned(),
                canonical_model_id: base_model.to_owned(),
            };
            groups.entry(key).or_default().push(Participant { membership, live_workers });
        }
    }

    let entries: Vec<TopologyEntry> = groups
        .into_iter()
        .map(|(key, participants)| project_entry(key, &participants, links, policy))
        .collect();
    debug_assert!(entries.iter().all(TopologyEntry::is_well_formed));
    debug_assert!(entries.windows(2).all(|pair| pair[0].key() < pair[1].key()));
    entries
}

/// Whether a ServingTopology conflict removes the endpoint from the readiness topology.
fn removed_from_topology(membership: &EndpointMembership) -> bool {
    membership.conflicts.iter().any(|conflict| conflict.scope == ConflictScope::ServingTopology)
}

fn project_entry(
    key: TopologyKey,
    participants: &[Participant<'_>],
    links: &PoolLinks,
    policy: AmbiguityPolicy,
) -> TopologyEntry {
    let authoritative = participants.iter().all(|participant| participant.live_workers.is_some());
    let units: Vec<ReadinessUnit> =
        participants.iter().flat_map(|participant| units_of(participant, |_| true)).collect();
    let evaluation = evaluate(&units);
    let duplicate_role_endpoints = duplicate_declared_roles(participants);
    let state = base_state(authoritative, &evaluation, &duplicate_role_endpoints, policy);
    let (present_roles, missing_roles) = if state == ReadinessState::Unknown {
        (BTreeSet::new(), BTreeSet::new())
    } else {
        (roles_of(&evaluation.present), roles_of(&evaluation.missing))
    };

    let mut members: Vec<(String, TopologyMember)> = participants
        .iter()
        .map(|participant| {
            let endpoint = &participant.membership.endpoint;
            let member = TopologyMember {
                endpoint: endpoint.clone(),
                roles: participant.membership.roles.clone(),
                pool_id: links.link(endpoint, &key.canonical_model_id),
            };
            (endpoint.to_string(), member)
        })
        .collect();
    members.sort_by(|left, right| left.0.cmp(&right.0));

    let adapters = project_adapters(&key, participants, state, &evaluation);
    TopologyEntry {
        namespace: key.namespace,
        canonical_model_id: key.canonical_model_id,
        state,
        present_roles,
        missing_roles,
        members: members.into_iter().map(|(_, member)| member).collect(),
        duplicate_role_endpoints,
        legacy_fallback_active: evaluation.legacy_fallback,
        adapters,
    }
}

/// The base entry's state under `policy`.
///
/// The evaluator's own ambiguity (roles with more than one *live unit*, ENCODE included, and
/// same-role units split by surface within one endpoint) is deliberately not the gate: the
/// relay's fact is the *declared* PREFILL / DECODE duplication across endpoints (which is what
/// disables DC-local P/D rendezvous, live or not), and only what the entry reports may make it
/// UNAVAILABLE without a missing role.
fn base_state(
    authoritative: bool,
    evaluation: &Evaluation,
    duplicate_role_endpoints: &BTreeSet<WorkerRole>,
    policy: AmbiguityPolicy,
) -> ReadinessState {
    let state = ReadinessState::of_base(authoritative, evaluation, AmbiguityPolicy::Report);
    match policy {
        AmbiguityPolicy::Unavailable
            if state == ReadinessState::Ready && !duplicate_role_endpoints.is_empty() =>
        {
            ReadinessState::Unavailable
        }
        AmbiguityPolicy::Report | AmbiguityPolicy::Unavailable => state,
    }
}

/// PREFILL / DECODE roles declared by more than one member endpoint, live or not.
fn duplicate_declared_roles(participants: &[Participant<'_>]) -> BTreeSet<WorkerRole> {
    DUPLICABLE_ROLES
        .into_iter()
        .filter(|role| {
            participants
                .iter()
                .filter(|participant| participant.membership.roles.contains(role))
                .nth(1)
                .is_some()
        })
        .collect()
}

/// Readiness units of one member endpoint over the workers `include` selects: one unit per
/// `(worker type, needs, model type)`, counting the selected workers that are live.
///
/// A non-authoritative endpoint's units all count zero live workers; its entry is UNKNOWN
/// anyway, and its declared roles still shape `missing` for the record.
fn units_of(participant: &Participant<'_>, include: impl Fn(u64) -> bool) -> Vec<ReadinessUnit> {
    type UnitShape<'s> = (Option<WorkerType>, &'s [Vec<WorkerType>], ModelTypeFlags);
    let mut live_counts: BTreeMap<UnitShape<'_>, u32> = BTreeMap::new();
    for (&worker_id, topology) in &participant.membership.worker_topology {
        if !include(worker_id) {
            continue;
        }
        let shape = (topology.worker_type, topology.needs.as_slice(), topology.model_type);
        let live_count = live_counts.entry(shape).or_insert(0);
        if participant.live_workers.is_some_and(|live| live.contains(&worker_id)) {
            *live_count = live_count.saturating_add(1);
        }
    }
    live_counts
        .into_iter()
        .map(|((worker_type, needs, _model_type), live_count)| ReadinessUnit {
            worker_type,
            live_count,
            needs: needs.to_vec(),
        })
        .collect()
}

/// The base model's adapters, sorted by served name.
fn project_adapters(
    key: &TopologyKey,
    participants: &[Participant<'_>],
    base_state: ReadinessState,
    base: &Evaluation,
) -> Vec<AdapterReadiness> {
    let mut adapter_units: BTreeMap<&str, Vec<ReadinessUnit>> = BTreeMap::new();
    for participant in participants {
        for (served_model, adapter) in &participant.membership.adapters {
            if adapter.base_model != key.canonical_model_id {
                continue;
            }
            let units = units_of(participant, |worker_id| adapter.workers.contains_key(&worker_id));
            adapter_units.entry(served_model.as_str()).or_default().extend(units);
        }
    }
    adapter_units
        .into_iter()
        .map(|(served_model, units)| {
            // The duplicate gate already acted on the base state, which the adapter inherits;
            // like the base, the adapter is not gated on the evaluator's live-unit ambiguity.
            let adapter = evaluate_adapter(base_state, base, &units, AmbiguityPolicy::Report);
            AdapterReadiness {
                canonical_model_id: served_model.to_owned(),
                state: adapter.state,
                missing_roles: roles_of(&adapter.missing),
            }
        })
        .collect()
}

fn roles_of(worker_types: &BTreeSet<WorkerType>) -> BTreeSet<WorkerRole> {
    worker_types
        .iter()
        .map(|&worker_type| WorkerRole::from_worker_type(Some(worker_type)))
        .collect()
}
