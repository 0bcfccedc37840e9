//! Behaviour of the discovery view and projection, after the reference's named cases
//! (relay-facts §9.3, §14 "Discovery / host / topology / load").

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::inputs::{
    CardInstanceId, DcInput, LoraInfo, ModelCard, ModelInput, ModelTypeFlags, RuntimeConfig,
    WorkerType,
};
use crate::model::hashing::HashFormat;
use crate::model::identity::{
    EndpointPath, ExplicitIdentityMap, IndexerIdentitySpec, PoolId, stable_dc_id,
};

const MODEL: &str = "meta/llama-3";
const CHAT_AND_COMPLETIONS: ModelTypeFlags =
    ModelTypeFlags(ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS);

fn endpoint(path: &str) -> EndpointPath {
    path.parse().unwrap()
}

fn base_id(path: &str, worker_id: u64) -> CardInstanceId {
    CardInstanceId { endpoint: endpoint(path), instance_id: worker_id, model_suffix: None }
}

fn adapter_id(path: &str, worker_id: u64, lora_name: &str) -> CardInstanceId {
    CardInstanceId {
        endpoint: endpoint(path),
        instance_id: worker_id,
        model_suffix: Some(slugify(lora_name)),
    }
}

/// An aggregated base card serving `name` with 16-token blocks.
fn card(name: &str) -> ModelCard {
    ModelCard {
        display_name: name.to_owned(),
        aliases: Vec::new(),
        source_path: Some(name.to_owned()),
        model_type: CHAT_AND_COMPLETIONS,
        model_input: Some(ModelInput::Tokens),
        kv_cache_block_size: 16,
        worker_type: Some(WorkerType::Aggregated),
        needs: Vec::new(),
        lora: None,
        indexer_identity: None,
        runtime_config: RuntimeConfig::default(),
    }
}

fn typed(name: &str, worker_type: WorkerType, needs: &[&[WorkerType]]) -> ModelCard {
    ModelCard {
        worker_type: Some(worker_type),
        needs: needs.iter().map(|alternative| alternative.to_vec()).collect(),
        ..card(name)
    }
}

/// An adapter card served as `served` with runtime LoRA name `lora_name` over `MODEL`.
fn adapter(served: &str, lora_name: &str, capacity: Option<u32>) -> ModelCard {
    ModelCard {
        source_path: Some(MODEL.to_owned()),
        lora: Some(LoraInfo { name: lora_name.to_owned(), max_gpu_lora_count: capacity }),
        ..card(served)
    }
}

fn scope_all() -> DiscoveryScope {
    DiscoveryScope::watch_all(Vec::new()).unwrap()
}

fn upsert(view: &mut DiscoveryView, id: CardInstanceId, card: ModelCard) -> MembershipChanges {
    view.apply(CardChange::Upserted { id, card: Box::new(card) })
}

fn remove(view: &mut DiscoveryView, id: CardInstanceId) -> MembershipChanges {
    view.apply(CardChange::Removed { id })
}

/// A fresh view holding exactly `cards`.
fn view_of(cards: Vec<(CardInstanceId, ModelCard)>) -> DiscoveryView {
    let mut view = DiscoveryView::new(scope_all());
    let _ = view.apply(CardChange::Listed { cards });
    view
}

fn membership<'a>(view: &'a DiscoveryView, path: &str) -> &'a EndpointMembership {
    view.membership(&endpoint(path)).unwrap_or_else(|| panic!("no membership for {path}"))
}

fn conflict(
    scope: ConflictScope,
    subject: ConflictSubject,
    reason: ConflictReason,
) -> MaterializationConflict {
    MaterializationConflict { scope, subject, reason }
}

fn base_registration(model: &str, aliases: &[&str]) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: model.to_owned(),
        target: ModelTarget::Base { base_model: model.to_owned() },
        aliases: aliases.iter().map(|alias| (*alias).to_owned()).collect(),
    }
}

fn lora_registration(served: &str, base_model: &str, lora_name: &str) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: served.to_owned(),
        target: ModelTarget::Lora {
            base_model: base_model.to_owned(),
            adapter: lora_name.to_owned(),
        },
        aliases: BTreeSet::new(),
    }
}

fn roles(items: &[WorkerRole]) -> BTreeSet<WorkerRole> {
    items.iter().copied().collect()
}

fn changed(paths: &[&str]) -> BTreeSet<EndpointPath> {
    paths.iter().map(|path| endpoint(path)).collect()
}

// ---- generations -------------------------------------------------------------------------

#[test]
fn unchanged_membership_does_not_advance_generation() {
    let mut view = DiscoveryView::new(scope_all());
    let first = upsert(&mut view, base_id("prod/backend/generate", 1), card(MODEL));
    assert_eq!(first.upserted, changed(&["prod/backend/generate"]));
    assert_eq!(membership(&view, "prod/backend/generate").generation, 1);

    // The same card again, an orphan adapter (ignored), a relist of the same set, and a change
    // on another endpoint: none of them changes this membership.
    assert!(upsert(&mut view, base_id("prod/backend/generate", 1), card(MODEL)).is_empty());
    assert!(
        upsert(
            &mut view,
            adapter_id("prod/backend/generate", 9, "sql"),
            adapter("sql", "sql", None)
        )
        .is_empty()
    );
    assert!(
        view.apply(CardChange::Listed {
            cards: vec![
                (adapter_id("prod/backend/generate", 9, "sql"), adapter("sql", "sql", None)),
                (base_id("prod/backend/generate", 1), card(MODEL)),
            ],
        })
        .is_empty()
    );
    let other = upsert(&mut view, base_id("prod/other/generate", 1), card("other/model"));
    assert_eq!(other.upserted, changed(&["prod/other/generate"]));
    assert_eq!(membership(&view, "prod/backend/generate").generation, 1);
    assert_eq!(membership(&view, "prod/other/generate").generation, 2);
}

#[test]
fn changed_membership_takes_the_next_global_generation() {
    let mut view = DiscoveryView::new(scope_all());
    let _ = upsert(&mut view, base_id("prod/a/generate", 1), card("model/a"));
    let _ = upsert(&mut view, base_id("prod/b/generate", 1), card("model/b"));
    let changes = upsert(&mut view, base_id("prod/a/generate", 2), card("model/a"));
    assert_eq!(changes.upserted, changed(&["prod/a/generate"]));
    assert_eq!(membership(&view, "prod/a/generate").generation, 3);
    assert_eq!(membership(&view, "prod/b/generate").generation, 2);
}

#[test]
fn reappearing_endpoint_advances_its_generation() {
    let mut view = DiscoveryView::new(scope_all());
    let _ = upsert(&mut view, base_id("prod/backend/generate", 1), card(MODEL));
    assert_eq!(membership(&view, "prod/backend/generate").generation, 1);

    let gone = remove(&mut view, base_id("prod/backend/generate", 1));
    assert_eq!(gone.removed, changed(&["prod/backend/generate"]));
    assert!(gone.upserted.is_empty());
    assert!(view.membership(&endpoint("prod/backend/generate")).is_none());

    let back = upsert(&mut view, base_id("prod/backend/generate", 1), card(MODEL));
    assert_eq!(back.upserted, changed(&["prod/backend/generate"]));
    assert_eq!(membership(&view, "prod/backend/generate").generation, 2);
}

#[test]
fn removing_an_unknown_card_changes_nothing() {
    let mut view = view_of(vec![(base_id("prod/backend/generate", 1), card(MODEL))]);
    assert!(remove(&mut view, base_id("prod/backend/generate", 2)).is_empty());
    assert_eq!(view.card_count(), 1);
}

// ---- scope -------------------------------------------------------------------------------

#[test]
fn out_of_scope_cards_are_ignored() {
    let scope =
        DiscoveryScope::namespaces(vec!["prod".into()], vec!["prod.backend".into()]).unwrap();
    let mut view = DiscoveryView::new(scope);
    assert!(upsert(&mut view, base_id("staging/backend/generate", 1), card(MODEL)).is_empty());
    assert!(upsert(&mut view, base_id("prod/backendx/generate", 1), card(MODEL)).is_empty());
    let listed = view.apply(CardChange::Listed {
        cards: vec![
            (base_id("prod/backend/generate", 1), card(MODEL)),
            (base_id("prod/frontend/generate", 1), card(MODEL)),
        ],
    });
    assert_eq!(listed.upserted, changed(&["prod/backend/generate"]));
    assert_eq!(view.card_count(), 1);
}

#[test]
fn card_inputs_convert_and_other_inputs_do_not() {
    let id = base_id("prod/backend/generate", 1);
    let input = DcInput::CardRemoved { id: id.clone() };
    assert_eq!(CardChange::from_input(&input), Some(CardChange::Removed { id }));
    let instances = DcInput::Instances(crate::inputs::EndpointInstances {
        endpoint: endpoint("prod/backend/generate"),
        live_workers: None,
    });
    assert_eq!(CardChange::from_input(&instances), None);
}

// ---- domains and materializability -------------------------------------------------------

#[test]
fn aggregated_endpoint_is_materializable() {
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (base_id("prod/backend/generate", 2), card(MODEL)),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert!(member.is_materializable());
    assert_eq!(
        member.query_semantics,
        Some(QuerySemantics { kv_block_size: 16, hash_format: HashFormat::StandardV1 })
    );
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
    assert_eq!(member.roles, roles(&[WorkerRole::Aggregated]));
    assert_eq!(member.runtime_configs.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    assert!(member.conflicts.is_empty());
}

#[test]
fn zero_block_size_is_not_materializable_but_keeps_its_registration_and_worker() {
    let zero = ModelCard { kv_cache_block_size: 0, ..card(MODEL) };
    let view = view_of(vec![(base_id("prod/backend/generate", 1), zero)]);
    let member = membership(&view, "prod/backend/generate");
    assert!(!member.is_materializable());
    assert_eq!(member.domain, None);
    assert_eq!(member.query_semantics, None);
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
    assert!(member.worker_topology.contains_key(&1));
    assert!(member.runtime_configs.contains_key(&1));
    assert_eq!(member.roles, roles(&[WorkerRole::Aggregated]));
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::PoolMaterialization,
            ConflictSubject::Card(base_id("prod/backend/generate", 1)),
            ConflictReason::ZeroBlockSize,
        )]
    );
}

#[test]
fn standard_and_eagle_on_one_endpoint_conflict() {
    let eagle = ModelCard {
        runtime_config: RuntimeConfig { enable_eagle: true, ..RuntimeConfig::default() },
        ..card(MODEL)
    };
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (base_id("prod/backend/generate", 2), eagle),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert!(!member.is_materializable());
    assert_eq!(member.domain, None);
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::PoolMaterialization,
            ConflictSubject::Endpoint(endpoint("prod/backend/generate")),
            ConflictReason::MultipleIndexerDomains,
        )]
    );
    // The binding itself is fine and stays for the topology.
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
}

#[test]
fn eagle_endpoint_publishes_eagle_query_semantics() {
    let eagle = ModelCard {
        runtime_config: RuntimeConfig { enable_eagle: true, ..RuntimeConfig::default() },
        ..card(MODEL)
    };
    let view = view_of(vec![(base_id("prod/backend/generate", 1), eagle)]);
    let member = membership(&view, "prod/backend/generate");
    assert!(member.is_materializable());
    assert_eq!(
        member.query_semantics.map(|semantics| semantics.hash_format),
        Some(HashFormat::EagleV1)
    );
}

#[test]
fn pd_on_distinct_endpoints_materialize_independently_with_distinct_domains() {
    let view = view_of(vec![
        (
            base_id("prod/prefill/generate", 1),
            typed(MODEL, WorkerType::Prefill, &[&[WorkerType::Decode]]),
        ),
        (
            base_id("prod/decode/generate", 2),
            typed(MODEL, WorkerType::Decode, &[&[WorkerType::Prefill]]),
        ),
    ]);
    let prefill = membership(&view, "prod/prefill/generate");
    let decode = membership(&view, "prod/decode/generate");
    assert!(prefill.is_materializable());
    assert!(decode.is_materializable());
    assert!(prefill.domain.is_some() && decode.domain.is_some());
    assert_ne!(prefill.domain, decode.domain);
    // Same cache semantics (same model, block size, format); the routing scope differs.
    assert_eq!(
        prefill.domain.map(|domain| domain.cache_semantics),
        decode.domain.map(|domain| domain.cache_semantics)
    );
    assert_eq!(prefill.roles, roles(&[WorkerRole::Prefill]));
    assert_eq!(decode.roles, roles(&[WorkerRole::Decode]));
    assert_eq!(prefill.registrations, decode.registrations);

    let claims = pool_claims(view.memberships(), stable_dc_id("dc-a").unwrap());
    assert_eq!(claims.len(), 2);
}

#[test]
fn incompatible_domains_conflict_then_heal_when_a_card_leaves() {
    let mut view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (base_id("prod/backend/generate", 2), ModelCard { kv_cache_block_size: 32, ..card(MODEL) }),
    ]);
    let fenced = membership(&view, "prod/backend/generate").clone();
    assert!(!fenced.is_materializable());
    assert!(fenced.has_pool_materialization_conflict());

    let healed = remove(&mut view, base_id("prod/backend/generate", 2));
    assert_eq!(healed.upserted, changed(&["prod/backend/generate"]));
    let member = membership(&view, "prod/backend/generate");
    assert!(member.is_materializable());
    assert!(member.conflicts.is_empty());
    assert!(member.generation > fenced.generation);
}

#[test]
fn different_base_models_on_one_endpoint_are_a_serving_topology_conflict() {
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card("model/a")),
        (base_id("prod/backend/generate", 2), card("model/b")),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert!(!member.is_materializable());
    // The two models also derive two cache semantics, hence two domains.
    assert_eq!(
        member.conflicts,
        vec![
            conflict(
                ConflictScope::PoolMaterialization,
                ConflictSubject::Endpoint(endpoint("prod/backend/generate")),
                ConflictReason::MultipleIndexerDomains,
            ),
            conflict(
                ConflictScope::ServingTopology,
                ConflictSubject::Endpoint(endpoint("prod/backend/generate")),
                ConflictReason::MultipleBaseModels,
            ),
        ]
    );
    assert_eq!(member.base_models(), ["model/a", "model/b"].into_iter().collect());
}

#[test]
fn different_base_models_sharing_explicit_semantics_still_conflict_on_topology() {
    let shared = IndexerIdentitySpec {
        semantics: Some(ExplicitIdentityMap::try_from_pairs([("weights", "shared")]).unwrap()),
        routing_scope: None,
    };
    let with_identity =
        |name: &str| ModelCard { indexer_identity: Some(shared.clone()), ..card(name) };
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), with_identity("model/a")),
        (base_id("prod/backend/generate", 2), with_identity("model/b")),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert!(member.domain.is_some());
    assert!(!member.is_materializable());
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::ServingTopology,
            ConflictSubject::Endpoint(endpoint("prod/backend/generate")),
            ConflictReason::MultipleBaseModels,
        )]
    );
}

#[test]
fn duplicate_pool_owners_are_all_fenced_then_heal() {
    let shared_scope = IndexerIdentitySpec {
        semantics: None,
        routing_scope: Some(ExplicitIdentityMap::try_from_pairs([("pool", "shared")]).unwrap()),
    };
    let explicit = ModelCard { indexer_identity: Some(shared_scope), ..card(MODEL) };
    let mut view = view_of(vec![
        (base_id("prod/a/generate", 1), explicit.clone()),
        (base_id("prod/b/generate", 2), explicit),
    ]);
    let a = membership(&view, "prod/a/generate");
    let b = membership(&view, "prod/b/generate");
    let domain = a.domain.unwrap();
    assert_eq!(b.domain, Some(domain));
    for member in [a, b] {
        assert!(!member.is_materializable());
        assert_eq!(
            member.conflicts,
            vec![conflict(
                ConflictScope::PoolMaterialization,
                ConflictSubject::Endpoint(member.endpoint.clone()),
                ConflictReason::PoolClaimedByMultipleEndpoints { domain },
            )]
        );
    }
    let dc_id = stable_dc_id("dc-a").unwrap();
    assert!(pool_claims(view.memberships(), dc_id).is_empty());

    let _ = remove(&mut view, base_id("prod/b/generate", 2));
    assert!(membership(&view, "prod/a/generate").is_materializable());
    let claims = pool_claims(view.memberships(), dc_id);
    let expected: BTreeMap<PoolId, BTreeSet<EndpointPath>> =
        [(PoolId { indexer_domain: domain, dc_id }, changed(&["prod/a/generate"]))]
            .into_iter()
            .collect();
    assert_eq!(claims, expected);
}

// ---- roles and topology units ------------------------------------------------------------

#[test]
fn encode_role_is_preserved_for_surface_less_and_front_door_cards() {
    let needs: &[&[WorkerType]] =
        &[&[WorkerType::Prefill, WorkerType::Decode], &[WorkerType::Aggregated]];
    let surface_less =
        ModelCard { model_type: ModelTypeFlags(0), ..typed(MODEL, WorkerType::Encode, needs) };
    let front_door = typed(MODEL, WorkerType::Encode, needs);
    let view = view_of(vec![
        (base_id("prod/encoder/generate", 1), surface_less),
        (base_id("prod/frontdoor/generate", 2), front_door),
    ]);
    for (path, model_type) in [
        ("prod/encoder/generate", ModelTypeFlags(0)),
        ("prod/frontdoor/generate", CHAT_AND_COMPLETIONS),
    ] {
        let member = membership(&view, path);
        assert_eq!(member.roles, roles(&[WorkerRole::Encode]), "{path}");
        let unit = member.worker_topology.values().next().unwrap();
        assert_eq!(unit.worker_type, Some(WorkerType::Encode));
        assert_eq!(unit.model_type, model_type);
        assert_eq!(unit.needs.len(), 2);
        assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
        assert!(member.is_materializable());
    }
}

#[test]
fn legacy_prefill_cards_are_normalized() {
    let legacy_prefill = ModelCard {
        worker_type: None,
        model_type: ModelTypeFlags(ModelTypeFlags::PREFILL),
        ..card(MODEL)
    };
    let legacy_prefill_with_needs =
        ModelCard { needs: vec![vec![WorkerType::Aggregated]], ..legacy_prefill.clone() };
    let legacy_decode = ModelCard { worker_type: None, ..card(MODEL) };
    let view = view_of(vec![
        (base_id("prod/prefill/generate", 1), legacy_prefill),
        (base_id("prod/prefill2/generate", 2), legacy_prefill_with_needs),
        (base_id("prod/decode/generate", 3), legacy_decode),
    ]);
    // (endpoint, worker, expected worker type, expected needs, expected role)
    type Case = (&'static str, u64, Option<WorkerType>, Vec<Vec<WorkerType>>, WorkerRole);
    let cases: &[Case] = &[
        (
            "prod/prefill/generate",
            1,
            Some(WorkerType::Prefill),
            vec![vec![WorkerType::Decode]],
            WorkerRole::Prefill,
        ),
        (
            "prod/prefill2/generate",
            2,
            Some(WorkerType::Prefill),
            vec![vec![WorkerType::Aggregated]],
            WorkerRole::Prefill,
        ),
        ("prod/decode/generate", 3, None, Vec::new(), WorkerRole::Legacy),
    ];
    for (path, worker_id, worker_type, needs, role) in cases {
        let member = membership(&view, path);
        let unit = &member.worker_topology[worker_id];
        assert_eq!(unit.worker_type, *worker_type, "{path}");
        assert_eq!(&unit.needs, needs, "{path}");
        assert_eq!(member.roles, roles(&[*role]), "{path}");
    }
}

#[test]
fn duplicate_base_cards_from_one_worker_are_a_serving_topology_conflict() {
    // A listing reporting two different base cards for one worker identity.
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (
            base_id("prod/backend/generate", 1),
            ModelCard { aliases: vec!["x".into()], ..card(MODEL) },
        ),
        (base_id("prod/backend/generate", 2), card(MODEL)),
        (adapter_id("prod/backend/generate", 1, "sql"), adapter("sql", "sql", None)),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::ServingTopology,
            ConflictSubject::Worker(1),
            ConflictReason::DuplicateWorkerBaseCards,
        )]
    );
    assert!(!member.is_materializable());
    assert_eq!(member.runtime_configs.keys().copied().collect::<Vec<_>>(), vec![2]);
    assert_eq!(member.worker_topology.keys().copied().collect::<Vec<_>>(), vec![2]);
    // Worker 2's claim stands; worker 1's adapter has no unambiguous base and is ignored.
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
    assert!(member.adapters.is_empty());
}

// ---- taints ------------------------------------------------------------------------------

#[test]
fn taint_update_reprojects_known_card_only() {
    let mut view = view_of(vec![(base_id("prod/backend/generate", 1), card(MODEL))]);
    let before = membership(&view, "prod/backend/generate").generation;

    let unknown = view.apply(CardChange::TaintsUpdated {
        id: base_id("prod/backend/generate", 7),
        taints_json: Some("[\"gpu-a\"]".into()),
    });
    assert!(unknown.is_empty());
    assert_eq!(view.card_count(), 1);

    let known = view.apply(CardChange::TaintsUpdated {
        id: base_id("prod/backend/generate", 1),
        taints_json: Some("[\"gpu-a\"]".into()),
    });
    assert_eq!(known.upserted, changed(&["prod/backend/generate"]));
    let member = membership(&view, "prod/backend/generate");
    assert!(member.generation > before);
    assert_eq!(member.runtime_configs[&1].taints_json.as_deref(), Some("[\"gpu-a\"]"));

    let repeated = view.apply(CardChange::TaintsUpdated {
        id: base_id("prod/backend/generate", 1),
        taints_json: Some("[\"gpu-a\"]".into()),
    });
    assert!(repeated.is_empty());
}

// ---- aliases and adapters ----------------------------------------------------------------

#[test]
fn base_aliases_are_validated_and_merged_across_workers() {
    let first = ModelCard {
        aliases: vec![
            "llama".into(),
            " padded".into(),
            String::new(),
            MODEL.into(),
            "llama-chat".into(),
        ],
        ..card(MODEL)
    };
    let second = ModelCard { aliases: vec!["llama-3".into(), "llama".into()], ..card(MODEL) };
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), first),
        (base_id("prod/backend/generate", 2), second),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert_eq!(
        member.registrations,
        vec![base_registration(MODEL, &["llama", "llama-3", "llama-chat"])]
    );
    assert!(member.conflicts.is_empty());
}

#[test]
fn adapter_overlay_adds_lora_bindings_over_the_base() {
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (base_id("prod/backend/generate", 2), card(MODEL)),
        (adapter_id("prod/backend/generate", 1, "sql"), adapter("sql", "sql", Some(4))),
        (adapter_id("prod/backend/generate", 2, "sql"), adapter("sql", "sql", None)),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert!(member.is_materializable());
    assert_eq!(
        member.registrations,
        vec![base_registration(MODEL, &[]), lora_registration("sql", MODEL, "sql")]
    );
    let overlay = &member.adapters["sql"];
    assert_eq!(overlay.base_model, MODEL);
    assert_eq!(overlay.adapter, "sql");
    assert_eq!(overlay.workers, [(1, Some(4)), (2, None)].into_iter().collect());
    // Adapter cards add no workers, roles or runtime configs of their own.
    assert_eq!(member.roles, roles(&[WorkerRole::Aggregated]));
    assert_eq!(member.runtime_configs.len(), 2);
}

#[test]
fn served_model_name_and_runtime_lora_name_stay_distinct() {
    let view = view_of(vec![
        (base_id("prod/backend/generate", 1), card(MODEL)),
        (
            adapter_id("prod/backend/generate", 1, "SQL Lora v2"),
            adapter("acme/sql-assistant", "SQL Lora v2", Some(2)),
        ),
    ]);
    let member = membership(&view, "prod/backend/generate");
    assert_eq!(
        member.registrations,
        vec![
            lora_registration("acme/sql-assistant", MODEL, "SQL Lora v2"),
            base_registration(MODEL, &[]),
        ]
    );
    assert_eq!(member.adapters["acme/sql-assistant"].adapter, "SQL Lora v2");
    assert_eq!(member.adapters["acme/sql-assistant"].base_model, MODEL);
}

#[test]
fn malformed_adapter_shape_suppresses_only_its_binding() {
    let path = "prod/backend/generate";
    let suffix_without_lora =
        CardInstanceId { model_suffix: Some("bad".into()), ..base_id(path, 1) };
    let lora_without_suffix = base_id(path, 2);
    let cases: Vec<(CardInstanceId, ModelCard, ConflictReason)> = vec![
        (suffix_without_lora, card("bad"), ConflictReason::LoraIdentityMismatch),
        (lora_without_suffix, adapter("bad2", "bad2", None), ConflictReason::LoraIdentityMismatch),
        (
            adapter_id(path, 1, "empty"),
            adapter("empty", "", None),
            ConflictReason::InvalidRuntimeLoraName,
        ),
        (
            adapter_id(path, 1, "pad"),
            adapter("pad ", "pad", None),
            ConflictReason::InvalidServedModelName,
        ),
    ];
    for (id, malformed, reason) in cases {
        let view = view_of(vec![
            (base_id(path, 1), card(MODEL)),
            (adapter_id(path, 1, "sql"), adapter("sql", "sql", None)),
            (id.clone(), malformed),
        ]);
        let member = membership(&view, path);
        // The malformed card never counts as a base card, so only worker 1's bindings remain.
        assert_eq!(
            member.conflicts,
            vec![conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(id),
                reason.clone()
            )],
            "{reason}"
        );
        assert_eq!(
            member.registrations,
            vec![base_registration(MODEL, &[]), lora_registration("sql", MODEL, "sql")],
            "{reason}"
        );
        assert!(member.is_materializable(), "{reason}");
    }
}

#[test]
fn adapter_over_an_invalid_base_name_is_a_binding_conflict() {
    let path = "prod/backend/generate";
    let view = view_of(vec![
        (base_id(path, 1), card(" padded")),
        (adapter_id(path, 1, "sql"), adapter("sql", "sql", None)),
    ]);
    let member = membership(&view, path);
    assert_eq!(
        member.conflicts,
        vec![
            conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(base_id(path, 1)),
                ConflictReason::InvalidCanonicalModel,
            ),
            conflict(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(adapter_id(path, 1, "sql")),
                ConflictReason::InvalidAdapterBaseModel,
            ),
        ]
    );
    assert!(member.registrations.is_empty());
    assert!(!member.is_materializable());
    // The worker is still a topology unit.
    assert_eq!(member.roles, roles(&[WorkerRole::Aggregated]));
}

#[test]
fn orphan_adapter_is_ignored() {
    let path = "prod/backend/generate";
    let view = view_of(vec![
        (base_id(path, 1), card(MODEL)),
        (adapter_id(path, 9, "sql"), adapter("sql", "sql", None)),
    ]);
    let member = membership(&view, path);
    assert!(member.conflicts.is_empty());
    assert!(member.adapters.is_empty());
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
}

#[test]
fn one_served_adapter_with_two_resolutions_is_suppressed() {
    let path = "prod/backend/generate";
    let view = view_of(vec![
        (base_id(path, 1), card(MODEL)),
        (base_id(path, 2), card(MODEL)),
        (adapter_id(path, 1, "sql-v1"), adapter("sql", "sql-v1", None)),
        (adapter_id(path, 2, "sql-v2"), adapter("sql", "sql-v2", None)),
    ]);
    let member = membership(&view, path);
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::ServingBinding,
            ConflictSubject::Binding("sql".into()),
            ConflictReason::ConflictingAdapterResolution,
        )]
    );
    assert!(member.adapters.is_empty());
    assert_eq!(member.registrations, vec![base_registration(MODEL, &[])]);
    assert!(member.is_materializable());
}

#[test]
fn conflicting_adapter_capacity_on_one_worker_fences_the_pool() {
    let path = "prod/backend/generate";
    let second_suffix =
        CardInstanceId { model_suffix: Some("sql-again".into()), ..base_id(path, 1) };
    let view = view_of(vec![
        (base_id(path, 1), card(MODEL)),
        (adapter_id(path, 1, "sql"), adapter("sql", "sql", Some(2))),
        (second_suffix, adapter("sql", "sql", Some(8))),
    ]);
    let member = membership(&view, path);
    assert_eq!(
        member.conflicts,
        vec![conflict(
            ConflictScope::PoolMaterialization,
            ConflictSubject::Worker(1),
            ConflictReason::ConflictingAdapterCapacity { served_model: "sql".into() },
        )]
    );
    assert!(!member.is_materializable());
    assert_eq!(member.adapters["sql"].workers, [(1, None)].into_iter().collect());
}

// ---- federated name ambiguity ------------------------------------------------------------

#[test]
fn federated_alias_collision_is_omitted_from_every_endpoint() {
    let view = view_of(vec![
        (
            base_id("prod/a/generate", 1),
            ModelCard { aliases: vec!["shared".into(), "only-a".into()], ..card("model/a") },
        ),
        (
            base_id("staging/b/generate", 2),
            ModelCard { aliases: vec!["shared".into()], ..card("model/b") },
        ),
    ]);
    let a = membership(&view, "prod/a/generate");
    let b = membership(&view, "staging/b/generate");
    assert_eq!(a.registrations, vec![base_registration("model/a", &["only-a"])]);
    assert_eq!(b.registrations, vec![base_registration("model/b", &[])]);
    assert!(a.conflicts.is_empty() && b.conflicts.is_empty());
    assert!(a.is_materializable() && b.is_materializable());
}

#[test]
fn same_binding_on_several_endpoints_is_not_ambiguous() {
    let with_alias =
        |worker_type| ModelCard { aliases: vec!["llama".into()], ..typed(MODEL, worker_type, &[]) };
    let view = view_of(vec![
        (base_id("prod/prefill/generate", 1), with_alias(WorkerType::Prefill)),
        (base_id("prod/decode/generate", 2), with_alias(WorkerType::Decode)),
    ]);
    for path in ["prod/prefill/generate", "prod/decode/generate"] {
        assert_eq!(
            membership(&view, path).registrations,
            vec![base_registration(MODEL, &["llama"])]
        );
    }
}

#[test]
fn federated_model_name_collision_drops_both_claims() {
    // "shared" is a base model on one endpoint and a served adapter on another.
    let view = view_of(vec![
        (base_id("prod/a/generate", 1), card("shared")),
        (base_id("prod/b/generate", 2), card(MODEL)),
        (adapter_id("prod/b/generate", 2, "sql"), adapter("shared", "sql", None)),
    ]);
    let ambiguous = conflict(
        ConflictScope::ServingBinding,
        ConflictSubject::Binding("shared".into()),
        ConflictReason::AmbiguousRequestName,
    );
    let a = membership(&view, "prod/a/generate");
    assert!(a.registrations.is_empty());
    assert_eq!(a.conflicts, vec![ambiguous.clone()]);
    assert!(!a.is_materializable());

    let b = membership(&view, "prod/b/generate");
    assert_eq!(b.registrations, vec![base_registration(MODEL, &[])]);
    assert!(b.adapters.is_empty());
    assert_eq!(b.conflicts, vec![ambiguous]);
    assert!(b.is_materializable());
}

#[test]
fn alias_naming_another_model_drops_the_model_and_the_alias() {
    let view = view_of(vec![
        (
            base_id("prod/a/generate", 1),
            ModelCard { aliases: vec!["model/b".into()], ..card("model/a") },
        ),
        (base_id("prod/b/generate", 2), card("model/b")),
    ]);
    assert_eq!(
        membership(&view, "prod/a/generate").registrations,
        vec![base_registration("model/a", &[])]
    );
    let b = membership(&view, "prod/b/generate");
    assert!(b.registrations.is_empty());
    assert_eq!(
        b.conflicts,
        vec![conflict(
            ConflictScope::ServingBinding,
            ConflictSubject::Binding("model/b".into()),
            ConflictReason::AmbiguousRequestName,
        )]
    );
}

#[test]
fn ambiguity_heals_when_the_colliding_endpoint_leaves() {
    let mut view = view_of(vec![
        (
            base_id("prod/a/generate", 1),
            ModelCard { aliases: vec!["shared".into()], ..card("model/a") },
        ),
        (
            base_id("prod/b/generate", 2),
            ModelCard { aliases: vec!["shared".into()], ..card("model/b") },
        ),
    ]);
    let before = membership(&view, "prod/a/generate").generation;
    let changes = remove(&mut view, base_id("prod/b/generate", 2));
    assert_eq!(changes.upserted, changed(&["prod/a/generate"]));
    assert_eq!(changes.removed, changed(&["prod/b/generate"]));
    let a = membership(&view, "prod/a/generate");
    assert_eq!(a.registrations, vec![base_registration("model/a", &["shared"])]);
    assert!(a.generation > before);
}

// ---- determinism and rendering -----------------------------------------------------------

#[test]
fn projection_does_not_depend_on_listing_order() {
    let cards = vec![
        (base_id("prod/a/generate", 1), ModelCard { aliases: vec!["x".into()], ..card("model/a") }),
        (base_id("prod/a/generate", 1), card("model/a")),
        (base_id("prod/a/generate", 2), ModelCard { kv_cache_block_size: 32, ..card("model/a") }),
        (adapter_id("prod/a/generate", 2, "s1"), adapter("sql", "s1", Some(1))),
        (adapter_id("prod/a/generate", 2, "s2"), adapter("sql", "s1", Some(2))),
        (base_id("prod/b/generate", 3), ModelCard { aliases: vec!["x".into()], ..card("model/b") }),
        (base_id("prod/c/generate", 4), card("sql")),
    ];
    let forward = view_of(cards.clone());
    let mut reversed_cards = cards;
    reversed_cards.reverse();
    let reversed = view_of(reversed_cards);
    assert_eq!(forward.memberships(), reversed.memberships());
}

#[test]
fn worker_roles_follow_wire_values_and_order() {
    let all = [
        (WorkerRole::Unspecified, 0),
        (WorkerRole::Prefill, 1),
        (WorkerRole::Decode, 2),
        (WorkerRole::Encode, 3),
        (WorkerRole::Aggregated, 4),
        (WorkerRole::Legacy, 5),
    ];
    for window in all.windows(2) {
        assert!(window[0].0 < window[1].0);
    }
    for (role, value) in all {
        assert_eq!(role.wire_value(), value);
        assert_eq!(WorkerRole::try_from(value), Ok(role));
    }
    assert_eq!(WorkerRole::try_from(6), Err(UnknownWorkerRole(6)));
    assert_eq!(WorkerRole::try_from(-1), Err(UnknownWorkerRole(-1)));
    assert_eq!(WorkerRole::from_worker_type(None), WorkerRole::Legacy);
    assert_eq!(WorkerRole::from_worker_type(Some(WorkerType::Encode)), WorkerRole::Encode);
}

#[test]
fn slugify_maps_lora_names_to_model_suffixes() {
    let cases =
        [("sql", "sql"), ("SQL Lora v2", "sql_lora_v2"), ("a/b.c-d_e", "a_b_c-d_e"), ("é", "_")];
    for (name, suffix) in cases {
        assert_eq!(slugify(name), suffix, "{name}");
    }
}

#[test]
fn membership_renders_stably_for_snapshots() {
    let view = view_of(vec![
        (
            base_id("prod/backend/generate", 1),
            ModelCard { aliases: vec!["llama".into()], ..card(MODEL) },
        ),
        (adapter_id("prod/backend/generate", 1, "sql"), adapter("sql", "sql", Some(4))),
        (base_id("prod/backend/generate", 2), ModelCard { kv_cache_block_size: 0, ..card(MODEL) }),
    ]);
    let rendered = serde_json::to_value(membership(&view, "prod/backend/generate")).unwrap();
    let expected = serde_json::json!({
        "endpoint": "prod/backend/generate",
        "domain": null,
        "query_semantics": null,
        "registrations": [
            {"canonical_model_id": MODEL, "target": {"base": {"base_model": MODEL}}, "aliases": ["llama"]},
            {"canonical_model_id": "sql", "target": {"lora": {"base_model": MODEL, "adapter": "sql"}}, "aliases": []},
        ],
        "adapters": {"sql": {"base_model": MODEL, "adapter": "sql", "workers": {"1": 4}}},
        "roles": ["AGGREGATED"],
        "runtime_configs": {
            "1": {
                "total_kv_blocks": null, "data_parallel_start_rank": 0, "data_parallel_size": 1,
                "enable_local_indexer": true, "kv_state_endpoint": null, "enable_eagle": false,
                "max_num_batched_tokens": null, "context_length": null, "taints_json": null,
            },
            "2": {
                "total_kv_blocks": null, "data_parallel_start_rank": 0, "data_parallel_size": 1,
                "enable_local_indexer": true, "kv_state_endpoint": null, "enable_eagle": false,
                "max_num_batched_tokens": null, "context_length": null, "taints_json": null,
            },
        },
        "worker_topology": {
            "1": {"worker_type": "aggregated", "model_type": ["Chat", "Completions"], "needs": []},
            "2": {"worker_type": "aggregated", "model_type": ["Chat", "Completions"], "needs": []},
        },
        "conflicts": [{
            "scope": "pool_materialization",
            "subject": {"card": {"endpoint": "prod/backend/generate", "instance_id": 2}},
            "reason": "kv block size is zero: no queryable indexer domain",
        }],
        "generation": 1,
    });
    assert_eq!(rendered, expected);

    let materializable = view_of(vec![(base_id("prod/backend/generate", 1), card(MODEL))]);
    let rendered =
        serde_json::to_value(membership(&materializable, "prod/backend/generate")).unwrap();
    assert_eq!(
        rendered["query_semantics"],
        serde_json::json!({"kv_block_size": 16, "hash_format": "DYNAMO_STANDARD_V1"})
    );
    assert_eq!(rendered["domain"]["cache_semantics_source"], "default_derived");
    assert_eq!(rendered["domain"]["routing_scope"].as_str().map(str::len), Some(32));
}

// ---- properties over arbitrary card sets -------------------------------------------------

mod properties {
    use proptest::prelude::*;

    use super::*;

    const PATHS: [&str; 3] = ["prod/a/generate", "prod/b/generate", "staging/a/generate"];
    const NAMES: [&str; 4] = ["m1", "m2", "s1", " bad"];
    const ALIASES: [&str; 5] = ["x1", "x2", "m1", "s1", ""];
    const LORA_NAMES: [&str; 3] = ["l1", "l2", ""];

    fn worker_type_strategy() -> impl Strategy<Value = Option<WorkerType>> {
        prop_oneof![
            Just(None),
            Just(Some(WorkerType::Prefill)),
            Just(Some(WorkerType::Decode)),
            Just(Some(WorkerType::Encode)),
            Just(Some(WorkerType::Aggregated)),
        ]
    }

    /// An arbitrary card and identity: base, adapter, or mismatched shapes, with valid and
    /// invalid names, colliding aliases, zero block sizes, Eagle, legacy prefill markers.
    fn card_strategy() -> impl Strategy<Value = (CardInstanceId, ModelCard)> {
        (
            (
                0..PATHS.len(),
                1u64..4,
                0..NAMES.len(),
                prop::collection::vec(0..ALIASES.len(), 0..3),
            ),
            (prop::sample::select(vec![0u32, 16, 32]), any::<bool>(), worker_type_strategy()),
            (any::<bool>(), any::<bool>(), 0..LORA_NAMES.len(), prop::option::of(1u32..3)),
            any::<bool>(),
        )
            .prop_map(
                |(
                    (path, worker_id, name, aliases),
                    (block_size, eagle, worker_type),
                    (has_suffix, has_lora, lora_name, capacity),
                    legacy_prefill,
                )| {
                    let lora_name = LORA_NAMES[lora_name];
                    let id = CardInstanceId {
                        endpoint: endpoint(PATHS[path]),
                        instance_id: worker_id,
                        model_suffix: has_suffix.then(|| slugify(lora_name)),
                    };
                    let model_type = if legacy_prefill {
                        ModelTypeFlags(ModelTypeFlags::PREFILL)
                    } else {
                        CHAT_AND_COMPLETIONS
                    };
                    let card = ModelCard {
                        aliases: aliases
                            .into_iter()
                            .map(|alias| ALIASES[alias].to_owned())
                            .collect(),
                        kv_cache_block_size: block_size,
                        worker_type,
                        model_type,
                        lora: has_lora.then(|| LoraInfo {
                            name: lora_name.to_owned(),
                            max_gpu_lora_count: capacity,
                        }),
                        runtime_config: RuntimeConfig {
                            enable_eagle: eagle,
                            ..RuntimeConfig::default()
                        },
                        ..card(NAMES[name])
                    };
                    (id, card)
                },
            )
    }

    fn change_strategy() -> impl Strategy<Value = CardChange> {
        prop_oneof![
            4 => card_strategy()
                .prop_map(|(id, card)| CardChange::Upserted { id, card: Box::new(card) }),
            2 => card_strategy().prop_map(|(id, _)| CardChange::Removed { id }),
            1 => (card_strategy(), prop::option::of(Just("[\"t\"]".to_owned())))
                .prop_map(|((id, _), taints_json)| CardChange::TaintsUpdated { id, taints_json }),
            1 => prop::collection::vec(card_strategy(), 0..8)
                .prop_map(|cards| CardChange::Listed { cards }),
        ]
    }

    /// Every invariant a membership documents, plus federated name uniqueness.
    fn check_invariants(view: &DiscoveryView) {
        let mut bindings_by_name: BTreeMap<&str, BTreeSet<(&str, &ModelTarget)>> = BTreeMap::new();
        for (path, member) in view.memberships() {
            assert_eq!(&member.endpoint, path);
            assert!(member.generation >= 1);
            assert_eq!(member.domain.is_some(), member.query_semantics.is_some());
            assert!(member.conflicts.windows(2).all(|pair| pair[0] < pair[1]));
            assert!(member.registrations.windows(2).all(|pair| {
                (&pair[0].canonical_model_id, &pair[0].target)
                    < (&pair[1].canonical_model_id, &pair[1].target)
            }));
            for (served, overlay) in &member.adapters {
                assert!(member.registrations.iter().any(|registration| {
                    registration.canonical_model_id == *served
                        && registration.target
                            == ModelTarget::Lora {
                                base_model: overlay.base_model.clone(),
                                adapter: overlay.adapter.clone(),
                            }
                }));
            }
            let expected_roles: BTreeSet<WorkerRole> = member
                .worker_topology
                .values()
                .map(|unit| WorkerRole::from_worker_type(unit.worker_type))
                .collect();
            assert_eq!(member.roles, expected_roles);
            assert!(member.runtime_configs.keys().eq(member.worker_topology.keys()));
            for registration in &member.registrations {
                assert!(is_valid_request_name(&registration.canonical_model_id));
                let binding = (registration.canonical_model_id.as_str(), &registration.target);
                bindings_by_name.entry(binding.0).or_default().insert(binding);
                for alias in &registration.aliases {
                    assert!(is_valid_request_name(alias));
                    assert_ne!(alias, &registration.canonical_model_id);
                    bindings_by_name.entry(alias).or_default().insert(binding);
                }
            }
        }
        for (name, bindings) in bindings_by_name {
            assert_eq!(bindings.len(), 1, "request-facing name {name:?} is ambiguous");
        }
    }

    fn without_generations(view: &DiscoveryView) -> BTreeMap<EndpointPath, EndpointMembership> {
        view.memberships()
            .iter()
            .map(|(path, member)| {
                (path.clone(), EndpointMembership { generation: 0, ..member.clone() })
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn incremental_changes_match_a_fresh_projection_and_keep_invariants(
            changes in prop::collection::vec(change_strategy(), 1..24),
        ) {
            let mut view = DiscoveryView::new(scope_all());
            let mut generation_max = 0;
            for change in changes {
                let before = view.memberships().clone();
                let reported = view.apply(change);
                check_invariants(&view);
                // The reported changes are exactly the memberships whose generation moved.
                for (path, member) in view.memberships() {
                    let moved = before.get(path).map(|old| old.generation) != Some(member.generation);
                    prop_assert_eq!(moved, reported.upserted.contains(path));
                    if moved {
                        prop_assert!(member.generation > generation_max);
                    }
                }
                for path in before.keys() {
                    prop_assert_eq!(
                        view.membership(path).is_none(),
                        reported.removed.contains(path)
                    );
                }
                generation_max = view
                    .memberships()
                    .values()
                    .map(|member| member.generation)
                    .max()
                    .unwrap_or(0)
                    .max(generation_max);
            }
            // Incremental application agrees with listing the final card set at once.
            let held: Vec<(CardInstanceId, ModelCard)> =
                view.cards().map(|(id, card)| (id.clone(), card.clone())).collect();
            let mut reversed = held.clone();
            reversed.reverse();
            prop_assert_eq!(without_generations(&view), without_generations(&view_of(held)));
            prop_assert_eq!(without_generations(&view), without_generations(&view_of(reversed)));
        }
    }
}

// ---- soft errors ---------------------------------------------------------------------------

fn soft_errors_of(cards: &[(CardInstanceId, ModelCard)]) -> Vec<SoftDiscoveryError> {
    card_soft_errors(cards.iter().map(|(id, card)| (id, card)))
}

#[test]
fn a_clean_card_set_has_no_soft_errors() {
    let path = "prod/backend/generate";
    let cards = vec![
        (
            base_id(path, 1),
            ModelCard { aliases: vec!["llama".into(), MODEL.into()], ..card(MODEL) },
        ),
        (adapter_id(path, 1, "sql"), adapter("sql", "sql", None)),
    ];
    assert!(soft_errors_of(&cards).is_empty());
}

#[test]
fn an_orphan_adapter_is_a_soft_error_and_the_rest_stands() {
    let path = "prod/backend/generate";
    let cards = vec![
        (base_id(path, 1), card(MODEL)),
        (adapter_id(path, 1, "doc"), adapter("doc", "doc", None)),
        // No base card on worker 9.
        (adapter_id(path, 9, "sql"), adapter("sql", "sql", None)),
    ];
    assert_eq!(
        soft_errors_of(&cards),
        vec![SoftDiscoveryError::new(
            SoftErrorKind::OrphanAdapter,
            "prod/backend/generate/9/sql",
            "its worker has no base card on this endpoint",
        )]
    );
    let view = view_of(cards);
    let member = membership(&view, path);
    assert!(member.conflicts.is_empty());
    assert_eq!(member.adapters.keys().collect::<Vec<_>>(), vec!["doc"]);
}

#[test]
fn an_adapter_on_a_worker_with_two_base_cards_is_an_orphan() {
    // A listing may report two distinct cards for one identity.
    let path = "prod/backend/generate";
    let cards = vec![
        (base_id(path, 3), card(MODEL)),
        (base_id(path, 3), ModelCard { aliases: vec!["other".into()], ..card(MODEL) }),
        (adapter_id(path, 3, "doc"), adapter("doc", "doc", None)),
    ];
    assert_eq!(
        soft_errors_of(&cards),
        vec![SoftDiscoveryError::new(
            SoftErrorKind::OrphanAdapter,
            "prod/backend/generate/3/doc",
            "its worker has more than one base card on this endpoint",
        )]
    );
}

#[test]
fn invalid_aliases_are_soft_errors_once_per_card_and_alias() {
    let path = "prod/backend/generate";
    let cards = vec![(
        base_id(path, 1),
        ModelCard {
            aliases: vec!["llama".into(), " padded".into(), String::new(), " padded".into()],
            ..card(MODEL)
        },
    )];
    let errors = soft_errors_of(&cards);
    assert_eq!(
        errors,
        vec![
            SoftDiscoveryError::new(
                SoftErrorKind::InvalidAlias,
                "prod/backend/generate/1",
                "alias \" padded\" is empty or has surrounding whitespace",
            ),
            SoftDiscoveryError::new(
                SoftErrorKind::InvalidAlias,
                "prod/backend/generate/1",
                "alias \"\" is empty or has surrounding whitespace",
            ),
        ]
    );
    // The valid alias is still registered.
    let view = view_of(cards);
    assert_eq!(membership(&view, path).registrations, vec![base_registration(MODEL, &["llama"])]);
}

#[test]
fn an_alias_two_bindings_claim_is_a_soft_error_on_each_endpoint() {
    let cards = vec![
        (
            base_id("prod/a/generate", 1),
            ModelCard { aliases: vec!["shared".into(), "only-a".into()], ..card("model/a") },
        ),
        (
            base_id("staging/b/generate", 2),
            ModelCard { aliases: vec!["shared".into()], ..card("model/b") },
        ),
    ];
    let reason = "alias \"shared\" names more than one binding; it is dropped";
    assert_eq!(
        soft_errors_of(&cards),
        vec![
            SoftDiscoveryError::new(SoftErrorKind::AmbiguousAlias, "prod/a/generate/1", reason),
            SoftDiscoveryError::new(SoftErrorKind::AmbiguousAlias, "staging/b/generate/2", reason),
        ]
    );
    // The same binding claiming one alias from two endpoints is not ambiguous.
    let same = vec![
        (base_id("prod/a/generate", 1), ModelCard { aliases: vec!["x".into()], ..card(MODEL) }),
        (base_id("prod/b/generate", 2), ModelCard { aliases: vec!["x".into()], ..card(MODEL) }),
    ];
    assert!(soft_errors_of(&same).is_empty());
}
