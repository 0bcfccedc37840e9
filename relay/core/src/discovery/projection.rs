//! The pure card-set → membership projection (relay-facts §9.3, steps 1–8, and the duplicate
//! pool rule of §9.5).
//!
//! Cards are grouped by serving endpoint and each endpoint is projected on its own (steps 1–6);
//! then request-facing names are checked across **all** endpoints of the view (step 7), so a
//! name that two endpoints bind differently is served by neither; finally each endpoint's
//! surviving claims become registrations (step 8) and endpoints that would publish the same pool
//! are fenced. Membership generations (step 9) are the view's business.
//!
//! The projection is a function of the card *set*: it never depends on the order in which cards
//! arrived or are listed, and it never picks a winner among conflicting facts.

use std::collections::{BTreeMap, BTreeSet};

use super::conflicts::{ConflictReason, ConflictScope, ConflictSubject, MaterializationConflict};
use super::membership::{
    AdapterMembership, EndpointMembership, ModelRegistration, ModelTarget, QuerySemantics,
    WorkerRole, WorkerTopology,
};
use super::soft_errors::{SoftDiscoveryError, SoftErrorKind, card_key};
use crate::inputs::{CardInstanceId, LoraInfo, ModelCard, RuntimeConfig};
use crate::model::hashing::HashFormat;
use crate::model::identity::{DcId, EndpointPath, IndexerDomainId, PoolId, resolve_indexer_domain};

/// Whether `name` can be a request-facing name (model, alias) or runtime LoRA name: non-empty
/// and without surrounding whitespace.
#[must_use]
pub fn is_valid_request_name(name: &str) -> bool {
    !name.is_empty() && name.trim() == name
}

/// Lowercase `name` and map every character outside `[a-z0-9_-]` to `_`: how a LoRA card's
/// model suffix is derived from its runtime LoRA name (dc-inputs §1.4).
///
/// Discovery does not enforce the relation (only "suffix present ⇔ LoRA metadata present");
/// the function exists so that simulated cards carry realistic suffixes.
#[must_use]
pub fn slugify(name: &str) -> String {
    name.chars()
        .map(|character| {
            let lower = character.to_ascii_lowercase();
            if lower.is_ascii_lowercase() || lower.is_ascii_digit() || lower == '_' || lower == '-'
            {
                lower
            } else {
                '_'
            }
        })
        .collect()
}

/// Which pool every materializable membership would publish in data center `dc_id`, and the
/// endpoints claiming it.
///
/// This is the hook for the registry's "one owner per pool" check. A [`DiscoveryView`]
/// already fences endpoints that share a domain (hence a pool id, since `dc_id` is common to
/// the view), so over a view's memberships every returned set has exactly one endpoint.
///
/// [`DiscoveryView`]: super::DiscoveryView
#[must_use]
pub fn pool_claims(
    memberships: &BTreeMap<EndpointPath, EndpointMembership>,
    dc_id: DcId,
) -> BTreeMap<PoolId, BTreeSet<EndpointPath>> {
    let mut claims: BTreeMap<PoolId, BTreeSet<EndpointPath>> = BTreeMap::new();
    for membership in memberships.values() {
        if !membership.is_materializable() {
            continue;
        }
        if let Some(domain) = membership.domain {
            let pool_id = PoolId { indexer_domain: domain, dc_id };
            claims.entry(pool_id).or_default().insert(membership.endpoint.clone());
        }
    }
    claims
}

/// A request-facing binding: a name and what serves it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Binding {
    model: String,
    target: ModelTarget,
}

/// One card's (or one adapter group's) claim on a binding, with its extra names.
#[derive(Debug)]
struct Claim {
    binding: Binding,
    aliases: BTreeSet<String>,
}

/// Everything about one endpoint that does not need the other endpoints.
struct LocalProjection {
    endpoint: EndpointPath,
    domain: Option<(IndexerDomainId, QuerySemantics)>,
    claims: Vec<Claim>,
    adapters: BTreeMap<String, AdapterMembership>,
    runtime_configs: BTreeMap<u64, RuntimeConfig>,
    worker_topology: BTreeMap<u64, WorkerTopology>,
    conflicts: Vec<MaterializationConflict>,
    /// Claims on this endpoint whose aliases are all valid names, with the card they came from
    /// (for naming an alias the whole view finds ambiguous).
    alias_sources: BTreeMap<String, CardInstanceId>,
    soft_errors: Vec<SoftDiscoveryError>,
}

impl LocalProjection {
    fn conflict(&mut self, scope: ConflictScope, subject: ConflictSubject, reason: ConflictReason) {
        self.conflicts.push(MaterializationConflict { scope, subject, reason });
    }
}

/// An adapter card that passed the shape checks.
struct AdapterCard<'a> {
    id: &'a CardInstanceId,
    card: &'a ModelCard,
    lora: &'a LoraInfo,
}

/// Project a card set into one membership per endpoint that has at least one card.
///
/// Cards must already be legacy-normalized (see [`crate::inputs::normalize_legacy_prefill`]).
/// The same card identity may appear more than once (a listing can say so); such duplicates are
/// facts like any other, never deduplicated by picking one. Every membership has generation 0: the view
/// assigns generations.
pub(super) fn project<'a>(
    cards: impl IntoIterator<Item = (&'a CardInstanceId, &'a ModelCard)>,
) -> BTreeMap<EndpointPath, EndpointMembership> {
    project_with_soft_errors(cards).0
}

/// The soft errors of a card set (see [`super::SoftErrorKind`]): orphan adapter cards, invalid
/// aliases and aliases the set makes ambiguous, in sorted order, each once. A function of the
/// card set like the projection itself; it does not need the cards legacy-normalized (the
/// normalization touches no field these errors depend on).
#[must_use]
pub fn card_soft_errors<'a>(
    cards: impl IntoIterator<Item = (&'a CardInstanceId, &'a ModelCard)>,
) -> Vec<SoftDiscoveryError> {
    project_with_soft_errors(cards).1
}

fn project_with_soft_errors<'a>(
    cards: impl IntoIterator<Item = (&'a CardInstanceId, &'a ModelCard)>,
) -> (BTreeMap<EndpointPath, EndpointMembership>, Vec<SoftDiscoveryError>) {
    let mut by_endpoint: BTreeMap<&EndpointPath, Vec<(&CardInstanceId, &ModelCard)>> =
        BTreeMap::new();
    for (id, card) in cards {
        by_endpoint.entry(&id.endpoint).or_default().push((id, card));
    }
    let locals: Vec<LocalProjection> = by_endpoint
        .into_iter()
        .map(|(endpoint, cards)| project_endpoint(endpoint, &cards))
        .collect();
    let ambiguous = ambiguous_names(&locals);
    let mut soft_errors = Vec::new();
    let mut memberships: BTreeMap<EndpointPath, EndpointMembership> = locals
        .into_iter()
        .map(|local| {
            let membership = finalize(local, &ambiguous, &mut soft_errors);
            (membership.endpoint.clone(), membership)
        })
        .collect();
    fence_duplicate_domains(&mut memberships);
    soft_errors.sort();
    soft_errors.dedup();
    (memberships, soft_errors)
}

fn query_semantics_of(card: &ModelCard) -> QuerySemantics {
    let hash_format =
        if card.runtime_config.enable_eagle { HashFormat::EagleV1 } else { HashFormat::StandardV1 };
    QuerySemantics { kv_block_size: card.kv_cache_block_size, hash_format }
}

/// Valid aliases of a base card: invalid names (each a soft error) and the model's own name
/// are dropped.
fn valid_aliases(
    id: &CardInstanceId,
    card: &ModelCard,
    soft_errors: &mut Vec<SoftDiscoveryError>,
) -> BTreeSet<String> {
    let mut valid = BTreeSet::new();
    for alias in &card.aliases {
        if !is_valid_request_name(alias) {
            soft_errors.push(SoftDiscoveryError::new(
                SoftErrorKind::InvalidAlias,
                &card_key(id),
                &format!("alias {alias:?} is empty or has surrounding whitespace"),
            ));
        } else if *alias != card.display_name {
            valid.insert(alias.clone());
        }
    }
    valid
}

/// Steps 1–6 for one endpoint.
fn project_endpoint(
    endpoint: &EndpointPath,
    cards: &[(&CardInstanceId, &ModelCard)],
) -> LocalProjection {
    let mut local = LocalProjection {
        endpoint: endpoint.clone(),
        domain: None,
        claims: Vec::new(),
        adapters: BTreeMap::new(),
        runtime_configs: BTreeMap::new(),
        worker_topology: BTreeMap::new(),
        conflicts: Vec::new(),
        alias_sources: BTreeMap::new(),
        soft_errors: Vec::new(),
    };

    // Step 1: base cards have neither suffix nor LoRA metadata, adapter cards have both.
    let mut base_cards: Vec<(&CardInstanceId, &ModelCard)> = Vec::new();
    let mut adapter_cards: Vec<AdapterCard<'_>> = Vec::new();
    for &(id, card) in cards {
        match (&id.model_suffix, &card.lora) {
            (None, None) => base_cards.push((id, card)),
            (Some(_), Some(lora)) => adapter_cards.push(AdapterCard { id, card, lora }),
            _ => local.conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(id.clone()),
                ConflictReason::LoraIdentityMismatch,
            ),
        }
    }

    // Steps 2–3: the endpoint domain exists only if every base card resolves, all to one domain.
    let mut resolved: BTreeSet<(IndexerDomainId, QuerySemantics)> = BTreeSet::new();
    let mut every_card_resolved = true;
    for &(id, card) in &base_cards {
        let semantics = query_semantics_of(card);
        match resolve_indexer_domain(
            card.source_path(),
            semantics.kv_block_size,
            semantics.hash_format,
            endpoint,
            card.indexer_identity.as_ref(),
        ) {
            Ok(domain) => {
                resolved.insert((domain, semantics));
            }
            Err(error) => {
                every_card_resolved = false;
                local.conflict(
                    ConflictScope::PoolMaterialization,
                    ConflictSubject::Card(id.clone()),
                    ConflictReason::from_identity_error(error),
                );
            }
        }
    }
    if resolved.len() > 1 {
        local.conflict(
            ConflictScope::PoolMaterialization,
            ConflictSubject::Endpoint(endpoint.clone()),
            ConflictReason::MultipleIndexerDomains,
        );
    }
    if every_card_resolved && resolved.len() == 1 {
        local.domain = resolved.pop_first();
    }

    // Step 4: one canonical base model per endpoint.
    let mut base_models: BTreeSet<&str> = BTreeSet::new();
    for &(id, card) in &base_cards {
        if is_valid_request_name(&card.display_name) {
            base_models.insert(&card.display_name);
        } else {
            local.conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(id.clone()),
                ConflictReason::InvalidCanonicalModel,
            );
        }
    }
    if base_models.len() > 1 {
        local.conflict(
            ConflictScope::ServingTopology,
            ConflictSubject::Endpoint(endpoint.clone()),
            ConflictReason::MultipleBaseModels,
        );
    }

    // Step 5: one base card per worker; record its runtime config, unit and base claim.
    let mut base_by_worker: BTreeMap<u64, Vec<(&CardInstanceId, &ModelCard)>> = BTreeMap::new();
    for &(id, card) in &base_cards {
        base_by_worker.entry(id.instance_id).or_default().push((id, card));
    }
    let mut single_base: BTreeMap<u64, &ModelCard> = BTreeMap::new();
    let mut shared_base: BTreeSet<u64> = BTreeSet::new();
    for (worker_id, worker_cards) in base_by_worker {
        let [(id, card)] = worker_cards.as_slice() else {
            shared_base.insert(worker_id);
            local.conflict(
                ConflictScope::ServingTopology,
                ConflictSubject::Worker(worker_id),
                ConflictReason::DuplicateWorkerBaseCards,
            );
            continue;
        };
        single_base.insert(worker_id, *card);
        local.runtime_configs.insert(worker_id, card.runtime_config.clone());
        local.worker_topology.insert(
            worker_id,
            WorkerTopology {
                worker_type: card.worker_type,
                model_type: card.model_type,
                needs: card.needs.clone(),
            },
        );
        let aliases = valid_aliases(id, card, &mut local.soft_errors);
        if is_valid_request_name(&card.display_name) {
            for alias in &aliases {
                local.alias_sources.entry(alias.clone()).or_insert_with(|| (*id).clone());
            }
            local.claims.push(Claim {
                binding: Binding {
                    model: card.display_name.clone(),
                    target: ModelTarget::Base { base_model: card.display_name.clone() },
                },
                aliases,
            });
        }
    }

    // Step 6: adapters bind to their worker's base card.
    project_adapters(&mut local, &adapter_cards, &single_base, &shared_base);
    local
}

/// Per served adapter name: `(base model, runtime LoRA name)` → worker → advertised capacities.
type AdapterGroups =
    BTreeMap<String, BTreeMap<(String, String), BTreeMap<u64, BTreeSet<Option<u32>>>>>;

fn project_adapters(
    local: &mut LocalProjection,
    adapter_cards: &[AdapterCard<'_>],
    single_base: &BTreeMap<u64, &ModelCard>,
    shared_base: &BTreeSet<u64>,
) {
    let mut groups: AdapterGroups = BTreeMap::new();
    for adapter in adapter_cards {
        // Orphan: no (unambiguous) base card on the same worker. A soft error: the adapter is
        // left out, the rest of the endpoint stands.
        let Some(base) = single_base.get(&adapter.id.instance_id) else {
            let reason = if shared_base.contains(&adapter.id.instance_id) {
                "its worker has more than one base card on this endpoint"
            } else {
                "its worker has no base card on this endpoint"
            };
            local.soft_errors.push(SoftDiscoveryError::new(
                SoftErrorKind::OrphanAdapter,
                &card_key(adapter.id),
                reason,
            ));
            continue;
        };
        let mut malformed = false;
        for (valid, reason) in [
            (is_valid_request_name(&base.display_name), ConflictReason::InvalidAdapterBaseModel),
            (
                is_valid_request_name(&adapter.card.display_name),
                ConflictReason::InvalidServedModelName,
            ),
            (is_valid_request_name(&adapter.lora.name), ConflictReason::InvalidRuntimeLoraName),
        ] {
            if !valid {
                malformed = true;
                local.conflict(
                    ConflictScope::ServingBinding,
                    ConflictSubject::Card(adapter.id.clone()),
                    reason,
                );
            }
        }
        if malformed {
            continue;
        }
        groups
            .entry(adapter.card.display_name.clone())
            .or_default()
            .entry((base.display_name.clone(), adapter.lora.name.clone()))
            .or_default()
            .entry(adapter.id.instance_id)
            .or_default()
            .insert(adapter.lora.max_gpu_lora_count);
    }

    for (served_model, resolutions) in groups {
        let mut adapter_workers: Vec<(String, String, BTreeMap<u64, Option<u32>>)> = Vec::new();
        for ((base_model, adapter), workers) in resolutions {
            let mut capacities: BTreeMap<u64, Option<u32>> = BTreeMap::new();
            for (worker_id, advertised) in workers {
                let capacity = match advertised.len() {
                    1 => advertised.first().copied().flatten(),
                    _ => {
                        local.conflict(
                            ConflictScope::PoolMaterialization,
                            ConflictSubject::Worker(worker_id),
                            ConflictReason::ConflictingAdapterCapacity {
                                served_model: served_model.clone(),
                            },
                        );
                        None
                    }
                };
                capacities.insert(worker_id, capacity);
            }
            adapter_workers.push((base_model, adapter, capacities));
        }
        let Some((base_model, adapter, workers)) = adapter_workers.pop() else {
            continue;
        };
        if !adapter_workers.is_empty() {
            local.conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Binding(served_model),
                ConflictReason::ConflictingAdapterResolution,
            );
            continue;
        }
        local.claims.push(Claim {
            binding: Binding {
                model: served_model.clone(),
                target: ModelTarget::Lora {
                    base_model: base_model.clone(),
                    adapter: adapter.clone(),
                },
            },
            aliases: BTreeSet::new(),
        });
        local.adapters.insert(served_model, AdapterMembership { base_model, adapter, workers });
    }
}

/// Step 7: request-facing names (models and aliases) that map to more than one binding anywhere
/// in the view.
fn ambiguous_names(locals: &[LocalProjection]) -> BTreeSet<String> {
    let mut bindings_by_name: BTreeMap<&str, BTreeSet<&Binding>> = BTreeMap::new();
    for claim in locals.iter().flat_map(|local| &local.claims) {
        bindings_by_name.entry(&claim.binding.model).or_default().insert(&claim.binding);
        for alias in &claim.aliases {
            bindings_by_name.entry(alias).or_default().insert(&claim.binding);
        }
    }
    bindings_by_name
        .into_iter()
        .filter(|(_, bindings)| bindings.len() > 1)
        .map(|(name, _)| name.to_owned())
        .collect()
}

/// Steps 7–8 for one endpoint: drop ambiguous claims and aliases, group claims into
/// registrations, keep adapters that kept their registration, derive roles, sort conflicts.
fn finalize(
    local: LocalProjection,
    ambiguous: &BTreeSet<String>,
    soft_errors: &mut Vec<SoftDiscoveryError>,
) -> EndpointMembership {
    let LocalProjection {
        endpoint,
        domain,
        claims,
        mut adapters,
        runtime_configs,
        worker_topology,
        mut conflicts,
        alias_sources,
        soft_errors: local_soft_errors,
    } = local;
    soft_errors.extend(local_soft_errors);

    let mut registered: BTreeMap<Binding, BTreeSet<String>> = BTreeMap::new();
    for claim in claims {
        if ambiguous.contains(&claim.binding.model) {
            conflicts.push(MaterializationConflict {
                scope: ConflictScope::ServingBinding,
                subject: ConflictSubject::Binding(claim.binding.model),
                reason: ConflictReason::AmbiguousRequestName,
            });
            continue;
        }
        let aliases = registered.entry(claim.binding).or_default();
        for alias in claim.aliases {
            if !ambiguous.contains(&alias) {
                aliases.insert(alias);
                continue;
            }
            // An alias that is also some binding's model name makes that model's claim a
            // conflict; an alias that only other aliases share would vanish without a trace.
            if let Some(id) = alias_sources.get(&alias) {
                soft_errors.push(SoftDiscoveryError::new(
                    SoftErrorKind::AmbiguousAlias,
                    &card_key(id),
                    &format!("alias {alias:?} names more than one binding; it is dropped"),
                ));
            }
        }
    }
    adapters.retain(|served_model, adapter| {
        registered.contains_key(&Binding {
            model: served_model.clone(),
            target: ModelTarget::Lora {
                base_model: adapter.base_model.clone(),
                adapter: adapter.adapter.clone(),
            },
        })
    });
    let registrations: Vec<ModelRegistration> = registered
        .into_iter()
        .map(|(binding, aliases)| ModelRegistration {
            canonical_model_id: binding.model,
            target: binding.target,
            aliases,
        })
        .collect();
    let roles = worker_topology
        .values()
        .map(|topology| WorkerRole::from_worker_type(topology.worker_type))
        .collect();
    conflicts.sort();
    conflicts.dedup();

    EndpointMembership {
        endpoint,
        domain: domain.map(|(domain, _)| domain),
        query_semantics: domain.map(|(_, semantics)| semantics),
        registrations,
        adapters,
        roles,
        runtime_configs,
        worker_topology,
        conflicts,
        generation: 0,
    }
}

/// §9.5: endpoints without a pool-fencing conflict that derive the same domain would publish
/// the same pool; all of them are fenced, none wins. Only explicit identity material can make
/// two endpoints derive one domain (the default routing scope is the endpoint itself).
fn fence_duplicate_domains(memberships: &mut BTreeMap<EndpointPath, EndpointMembership>) {
    let mut claimants: BTreeMap<IndexerDomainId, Vec<EndpointPath>> = BTreeMap::new();
    for membership in memberships.values() {
        if let Some(domain) = membership.domain
            && !membership.has_pool_materialization_conflict()
        {
            claimants.entry(domain).or_default().push(membership.endpoint.clone());
        }
    }
    for (domain, endpoints) in claimants {
        if endpoints.len() < 2 {
            continue;
        }
        for endpoint in endpoints {
            if let Some(membership) = memberships.get_mut(&endpoint) {
                membership.conflicts.push(MaterializationConflict {
                    scope: ConflictScope::PoolMaterialization,
                    subject: ConflictSubject::Endpoint(endpoint),
                    reason: ConflictReason::PoolClaimedByMultipleEndpoints { domain },
                });
                membership.conflicts.sort();
                membership.conflicts.dedup();
            }
        }
    }
}
