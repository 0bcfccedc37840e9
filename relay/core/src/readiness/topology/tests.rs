//! Behaviour of the topology projection and publisher, after the reference's deployment shapes
//! and named cases (relay-facts §10.2–§10.4, §14).
//!
//! Memberships come from a real [`DiscoveryView`] fed with cards; a small harness plays the
//! host: it gives each endpoint a slot incarnation when its membership appears, re-claims with
//! the same slot on membership updates, releases on removal, and builds pool links from the
//! pools discovery says each materializable endpoint would publish.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::discovery::{
    CardChange, DiscoveryScope, DiscoveryView, MembershipChanges, WorkerRole, pool_claims, slugify,
};
use crate::inputs::{CardInstanceId, LoraInfo, ModelCard, ModelInput, ModelTypeFlags, WorkerType};
use crate::model::identity::{DcId, EndpointPath, PoolId, stable_dc_id};
use crate::readiness::{AmbiguityPolicy, ReadinessState};

use ReadinessState::{Ready, Unavailable, Unknown};
use WorkerType::{Aggregated, Decode, Encode, Prefill};

const MODEL: &str = "meta/llama-3";
const CHAT_AND_COMPLETIONS: ModelTypeFlags =
    ModelTypeFlags(ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS);
const EPD_ENCODE_NEEDS: &[&[WorkerType]] = &[&[Prefill, Decode], &[Aggregated]];

const AGGREGATED_PATH: &str = "prod/backend/generate";
const PREFILL_PATH: &str = "prod/prefill/generate";
const DECODE_PATH: &str = "prod/backend/generate";
const ENCODE_PATH: &str = "prod/encoder/generate";

// ---- cards -------------------------------------------------------------------------------

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

/// A base card for `name` with the given role and needs.
fn typed(name: &str, worker_type: WorkerType, needs: &[&[WorkerType]]) -> ModelCard {
    ModelCard {
        display_name: name.to_owned(),
        aliases: Vec::new(),
        source_path: Some(name.to_owned()),
        model_type: CHAT_AND_COMPLETIONS,
        model_input: Some(ModelInput::Tokens),
        kv_cache_block_size: 16,
        worker_type: Some(worker_type),
        needs: needs.iter().map(|alternative| alternative.to_vec()).collect(),
        lora: None,
        indexer_identity: None,
        runtime_config: Default::default(),
    }
}

fn aggregated(name: &str) -> ModelCard {
    typed(name, Aggregated, &[])
}

/// A card without a worker type (and without the legacy prefill marker).
fn legacy(name: &str) -> ModelCard {
    ModelCard { worker_type: None, ..aggregated(name) }
}

/// An adapter card served as `served` (runtime LoRA name alike) over `MODEL`.
fn adapter(served: &str) -> ModelCard {
    ModelCard {
        source_path: Some(MODEL.to_owned()),
        lora: Some(LoraInfo { name: served.to_owned(), max_gpu_lora_count: Some(4) }),
        ..aggregated(served)
    }
}

fn roles(items: &[WorkerRole]) -> BTreeSet<WorkerRole> {
    items.iter().copied().collect()
}

// ---- the harness -------------------------------------------------------------------------

/// A simulated DC seen by the relay: discovery, the host's slots and availability, the
/// catalog's links, and the published topology.
struct Relay {
    view: DiscoveryView,
    slots: BTreeMap<EndpointPath, SlotIncarnation>,
    slot_next: u64,
    availability: AvailabilityStore,
    links: PoolLinks,
    topology: TopologyState,
}

impl Relay {
    fn new(policy: AmbiguityPolicy) -> Self {
        Relay {
            view: DiscoveryView::new(DiscoveryScope::watch_all(Vec::new()).unwrap()),
            slots: BTreeMap::new(),
            slot_next: 1,
            availability: AvailabilityStore::new(),
            links: PoolLinks::new(),
            topology: TopologyState::new(policy),
        }
    }

    fn reporting() -> Self {
        Self::new(AmbiguityPolicy::Report)
    }

    /// Apply a card change and play the host's slot bookkeeping for the affected endpoints.
    fn apply(&mut self, change: CardChange) -> MembershipChanges {
        let changes = self.view.apply(change);
        for path in &changes.upserted {
            let slot = match self.slots.get(path) {
                Some(slot) => *slot,
                None => {
                    let slot = SlotIncarnation(self.slot_next);
                    self.slot_next += 1;
                    self.slots.insert(path.clone(), slot);
                    slot
                }
            };
            let _ = self.availability.claim(path, slot);
        }
        for path in &changes.removed {
            if let Some(slot) = self.slots.remove(path) {
                assert_eq!(self.availability.release(path, slot), ReleaseOutcome::Released);
            }
        }
        changes
    }

    fn add(&mut self, id: CardInstanceId, card: ModelCard) {
        let _ = self.apply(CardChange::Upserted { id, card: Box::new(card) });
    }

    fn remove(&mut self, id: CardInstanceId) {
        let _ = self.apply(CardChange::Removed { id });
    }

    fn slot(&self, path: &str) -> SlotIncarnation {
        self.slots[&endpoint(path)]
    }

    /// The endpoint's current slot lists these live workers.
    fn live(&mut self, path: &str, workers: &[u64]) -> ReplaceOutcome {
        let slot = self.slot(path);
        self.availability.replace(&endpoint(path), slot, Some(workers.iter().copied().collect()))
    }

    /// The catalog links every materializable endpoint's pool, except those in `unlinked`.
    fn link_all_except(&mut self, unlinked: &[&str]) {
        let unlinked: BTreeSet<EndpointPath> = unlinked.iter().map(|path| endpoint(path)).collect();
        let mut claims = Vec::new();
        for (pool_id, endpoints) in pool_claims(self.view.memberships(), dc()) {
            for path in endpoints.into_iter().filter(|path| !unlinked.contains(path)) {
                for base_model in self.view.memberships()[&path].base_models() {
                    claims.push((path.clone(), base_model.to_owned(), pool_id));
                }
            }
        }
        self.links = PoolLinks::from_claims(claims);
    }

    fn link_all(&mut self) {
        self.link_all_except(&[]);
    }

    /// The pool discovery says `path` would publish.
    fn pool_of(&self, path: &str) -> PoolId {
        PoolId {
            indexer_domain: self.view.membership(&endpoint(path)).unwrap().domain.unwrap(),
            dc_id: dc(),
        }
    }

    fn recompute(&mut self) -> TopologyOutcome {
        self.topology.recompute(self.view.memberships(), &self.availability, &self.links)
    }

    /// Recompute and return the entry for `model` in `prod`.
    fn entry(&mut self, model: &str) -> TopologyEntry {
        let _ = self.recompute();
        self.topology.entry("prod", model).unwrap_or_else(|| panic!("no entry for {model}")).clone()
    }
}

fn dc() -> DcId {
    stable_dc_id("dc-a").unwrap()
}

/// Prefill on `PREFILL_PATH` (worker 1, needs decode), decode on `DECODE_PATH` (worker 2).
fn pd_relay() -> Relay {
    let mut relay = Relay::reporting();
    relay.add(base_id(PREFILL_PATH, 1), typed(MODEL, Prefill, &[&[Decode]]));
    relay.add(base_id(DECODE_PATH, 2), typed(MODEL, Decode, &[]));
    relay.link_all();
    relay
}

/// `pd_relay` plus an encoder on `ENCODE_PATH` (worker 3) needing P+D or aggregated.
fn epd_relay() -> Relay {
    let mut relay = pd_relay();
    relay.add(base_id(ENCODE_PATH, 3), typed(MODEL, Encode, EPD_ENCODE_NEEDS));
    relay
}

fn member_pools(entry: &TopologyEntry) -> Vec<(String, Option<PoolId>)> {
    entry.members.iter().map(|member| (member.endpoint.to_string(), member.pool_id)).collect()
}

// ---- deployment shapes -------------------------------------------------------------------

#[test]
fn aggregated_endpoint_is_one_ready_entry() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    relay.add(base_id(AGGREGATED_PATH, 2), aggregated(MODEL));
    relay.link_all();
    let _ = relay.live(AGGREGATED_PATH, &[1, 2]);

    let entry = relay.entry(MODEL);
    let expected = TopologyEntry {
        namespace: "prod".to_owned(),
        canonical_model_id: MODEL.to_owned(),
        state: Ready,
        present_roles: roles(&[WorkerRole::Aggregated]),
        missing_roles: BTreeSet::new(),
        members: vec![TopologyMember {
            endpoint: endpoint(AGGREGATED_PATH),
            roles: roles(&[WorkerRole::Aggregated]),
            pool_id: Some(relay.pool_of(AGGREGATED_PATH)),
        }],
        duplicate_role_endpoints: BTreeSet::new(),
        legacy_fallback_active: false,
        adapters: Vec::new(),
    };
    assert_eq!(entry, expected);
    assert_eq!(relay.topology.entries().len(), 1);
}

#[test]
fn multiple_aggregated_models_in_one_namespace_are_independent_entries() {
    let mut relay = Relay::reporting();
    relay.add(base_id("prod/a/generate", 1), aggregated("model/a"));
    relay.add(base_id("prod/b/generate", 2), aggregated("model/b"));
    relay.add(base_id("staging/a/generate", 3), aggregated("model/a"));
    relay.link_all();
    let _ = relay.live("prod/a/generate", &[1]);
    let _ = relay.live("prod/b/generate", &[]);
    let _ = relay.live("staging/a/generate", &[3]);
    let _ = relay.recompute();

    let keys: Vec<(String, String)> = relay
        .topology
        .entries()
        .iter()
        .map(|entry| (entry.namespace.clone(), entry.canonical_model_id.clone()))
        .collect();
    let expected_keys: Vec<(String, String)> =
        [("prod", "model/a"), ("prod", "model/b"), ("staging", "model/a")]
            .into_iter()
            .map(|(namespace, model)| (namespace.to_owned(), model.to_owned()))
            .collect();
    assert_eq!(keys, expected_keys);

    let a = relay.entry("model/a");
    assert_eq!(a.state, Ready);
    assert_eq!(
        member_pools(&a),
        vec![("prod/a/generate".into(), Some(relay.pool_of("prod/a/generate")))]
    );
    let b = relay.entry("model/b");
    assert_eq!(b.state, Unavailable);
    assert_eq!(b.missing_roles, roles(&[WorkerRole::Aggregated]));
    assert!(b.present_roles.is_empty());
    let staging = relay.topology.entry("staging", "model/a").unwrap();
    assert_eq!(staging.state, Ready);
    assert_eq!(staging.members.len(), 1);
}

#[test]
fn pd_ready_with_both_roles_present() {
    let mut relay = pd_relay();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2]);

    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Prefill, WorkerRole::Decode]));
    assert!(entry.missing_roles.is_empty());
    assert!(entry.duplicate_role_endpoints.is_empty());
    // Two endpoints, two distinct pools, one entry; members sorted by endpoint.
    let (prefill_pool, decode_pool) = (relay.pool_of(PREFILL_PATH), relay.pool_of(DECODE_PATH));
    assert_ne!(prefill_pool, decode_pool);
    assert_eq!(
        member_pools(&entry),
        vec![(DECODE_PATH.into(), Some(decode_pool)), (PREFILL_PATH.into(), Some(prefill_pool))]
    );
    assert_eq!(entry.members[0].roles, roles(&[WorkerRole::Decode]));
    assert_eq!(entry.members[1].roles, roles(&[WorkerRole::Prefill]));
}

#[test]
fn pd_with_decode_dead_is_unavailable_while_pools_stay_linked() {
    let mut relay = pd_relay();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[]);

    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Prefill]));
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Decode]));
    assert!(entry.members.iter().all(|member| member.pool_id.is_some()));
    assert_eq!(entry.members.len(), 2);

    // And the other way round.
    let _ = relay.live(PREFILL_PATH, &[]);
    let _ = relay.live(DECODE_PATH, &[2]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Prefill]));
    assert!(entry.members.iter().all(|member| member.pool_id.is_some()));
}

#[test]
fn pd_with_decode_endpoint_gone_is_unavailable_not_unknown() {
    let mut relay = pd_relay();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2]);
    assert_eq!(relay.entry(MODEL).state, Ready);
    let revision = relay.topology.revision();

    relay.remove(base_id(DECODE_PATH, 2));
    assert_eq!(relay.availability.owner(&endpoint(DECODE_PATH)), None);
    let entry = relay.entry(MODEL);
    assert!(relay.topology.revision() > revision);
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Prefill]));
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Decode]));
    assert_eq!(
        member_pools(&entry),
        vec![(PREFILL_PATH.into(), Some(relay.pool_of(PREFILL_PATH)))]
    );
}

#[test]
fn epd_encode_member_has_no_pool_link_until_it_has_one() {
    let mut relay = epd_relay();
    relay.link_all_except(&[ENCODE_PATH]);
    for (path, worker) in [(PREFILL_PATH, 1), (DECODE_PATH, 2), (ENCODE_PATH, 3)] {
        let _ = relay.live(path, &[worker]);
    }
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    assert_eq!(
        entry.present_roles,
        roles(&[WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Encode])
    );
    assert_eq!(
        member_pools(&entry),
        vec![
            (DECODE_PATH.into(), Some(relay.pool_of(DECODE_PATH))),
            (ENCODE_PATH.into(), None),
            (PREFILL_PATH.into(), Some(relay.pool_of(PREFILL_PATH))),
        ]
    );
    let revision = relay.topology.revision();

    // The encoder advertises an active KV source: the catalog now lists its pool.
    relay.link_all();
    let entry = relay.entry(MODEL);
    assert_eq!(relay.topology.revision(), revision + 1);
    assert_eq!(
        entry.member(&endpoint(ENCODE_PATH)).unwrap().pool_id,
        Some(relay.pool_of(ENCODE_PATH))
    );
}

#[test]
fn epd_encode_down_reports_missing_encode() {
    let mut relay = epd_relay();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2]);
    let _ = relay.live(ENCODE_PATH, &[]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Prefill, WorkerRole::Decode]));
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Encode]));
    assert_eq!(entry.member(&endpoint(ENCODE_PATH)).unwrap().roles, roles(&[WorkerRole::Encode]));
}

#[test]
fn legacy_only_and_mixed_are_ready_iff_any_live_with_fallback_flag() {
    // (name, legacy live workers, typed decode live workers (None: no typed endpoint), state)
    type Case = (&'static str, &'static [u64], Option<&'static [u64]>, ReadinessState);
    let cases: &[Case] = &[
        ("legacy only, live", &[1], None, Ready),
        ("legacy only, dead", &[], None, Unavailable),
        ("mixed, only the typed worker live", &[], Some(&[2]), Ready),
        ("mixed, only the legacy worker live", &[1], Some(&[]), Ready),
        ("mixed, all dead", &[], Some(&[]), Unavailable),
    ];
    for &(name, legacy_live, typed_live, state) in cases {
        let mut relay = Relay::reporting();
        relay.add(base_id("prod/legacy/generate", 1), legacy(MODEL));
        if typed_live.is_some() {
            // A decode that needs a prefill nobody provides: strict gating would fail it.
            relay.add(base_id(DECODE_PATH, 2), typed(MODEL, Decode, &[&[Prefill]]));
        }
        let _ = relay.live("prod/legacy/generate", legacy_live);
        if let Some(typed_live) = typed_live {
            let _ = relay.live(DECODE_PATH, typed_live);
        }
        let entry = relay.entry(MODEL);
        assert_eq!(entry.state, state, "{name}");
        assert!(entry.legacy_fallback_active, "{name}");
        assert!(entry.missing_roles.is_empty(), "{name}");
        assert!(
            entry
                .member(&endpoint("prod/legacy/generate"))
                .is_some_and(|member| member.roles == roles(&[WorkerRole::Legacy])),
            "{name}"
        );
    }
}

#[test]
fn unknown_until_every_member_is_authoritative() {
    let mut relay = pd_relay();
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unknown);
    assert!(entry.present_roles.is_empty() && entry.missing_roles.is_empty());
    // Members and their declared roles are known before availability is.
    assert_eq!(entry.members.len(), 2);

    let _ = relay.live(PREFILL_PATH, &[1]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unknown);
    assert!(entry.present_roles.is_empty() && entry.missing_roles.is_empty());

    let _ = relay.live(DECODE_PATH, &[2]);
    assert_eq!(relay.entry(MODEL).state, Ready);

    // A failed watch makes its endpoint non-authoritative again.
    let slot = relay.slot(DECODE_PATH);
    assert!(relay.availability.replace(&endpoint(DECODE_PATH), slot, None).changed());
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unknown);
    assert!(entry.present_roles.is_empty() && entry.missing_roles.is_empty());
}

#[test]
fn repeated_identical_availability_does_not_bump_revision() {
    let mut relay = Relay::reporting();
    assert_eq!(relay.topology.revision(), TOPOLOGY_REVISION_INITIAL);
    assert_eq!(relay.recompute(), TopologyOutcome::Unchanged { revision: 1 });

    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    assert_eq!(relay.recompute(), TopologyOutcome::Published { revision: 2 });
    assert_eq!(relay.live(AGGREGATED_PATH, &[1]), ReplaceOutcome::Changed);
    assert_eq!(relay.recompute(), TopologyOutcome::Published { revision: 3 });

    assert_eq!(relay.live(AGGREGATED_PATH, &[1]), ReplaceOutcome::Unchanged);
    assert_eq!(relay.recompute(), TopologyOutcome::Unchanged { revision: 3 });
    // A listing change that no unit sees (an instance without a card) changes no entry either.
    assert_eq!(relay.live(AGGREGATED_PATH, &[1, 99]), ReplaceOutcome::Changed);
    assert_eq!(relay.recompute(), TopologyOutcome::Unchanged { revision: 3 });
    assert_eq!(relay.topology.snapshot().revision, 3);
}

// ---- duplicates and policy ---------------------------------------------------------------

/// Two prefill and two decode endpoints for `MODEL`, plus two aggregated endpoints for
/// `model/agg`; everything live except the second prefill (3) and decode (4) workers, so the
/// duplicates are declared but no role has two live units.
fn duplicated_relay(policy: AmbiguityPolicy) -> Relay {
    let mut relay = Relay::new(policy);
    relay.add(base_id("prod/prefill-a/generate", 1), typed(MODEL, Prefill, &[&[Decode]]));
    relay.add(base_id("prod/prefill-b/generate", 3), typed(MODEL, Prefill, &[&[Decode]]));
    relay.add(base_id("prod/decode-a/generate", 2), typed(MODEL, Decode, &[]));
    relay.add(base_id("prod/decode-b/generate", 4), typed(MODEL, Decode, &[]));
    relay.add(base_id("prod/agg-a/generate", 5), aggregated("model/agg"));
    relay.add(base_id("prod/agg-b/generate", 6), aggregated("model/agg"));
    relay.link_all();
    for (path, live) in [
        ("prod/prefill-a/generate", &[1][..]),
        ("prod/prefill-b/generate", &[][..]),
        ("prod/decode-a/generate", &[2][..]),
        ("prod/decode-b/generate", &[][..]),
        ("prod/agg-a/generate", &[5][..]),
        ("prod/agg-b/generate", &[6][..]),
    ] {
        let _ = relay.live(path, live);
    }
    relay
}

#[test]
fn duplicate_pd_endpoints_report_each_duplicated_role() {
    let mut relay = duplicated_relay(AmbiguityPolicy::Report);
    let entry = relay.entry(MODEL);
    // Declared duplicates are reported, dead second endpoints included; the state stays as the
    // roles dictate.
    assert_eq!(entry.duplicate_role_endpoints, roles(&[WorkerRole::Prefill, WorkerRole::Decode]));
    assert_eq!(entry.state, Ready);
    assert_eq!(entry.members.len(), 4);
    assert!(entry.members.iter().all(|member| member.pool_id.is_some()));

    // Aggregated scale-out is never a duplicate.
    let aggregated = relay.entry("model/agg");
    assert!(aggregated.duplicate_role_endpoints.is_empty());
    assert_eq!(aggregated.state, Ready);
}

#[test]
fn strict_policy_makes_duplicate_pd_endpoints_unavailable() {
    let mut relay = duplicated_relay(AmbiguityPolicy::Unavailable);
    assert_eq!(relay.topology.policy(), AmbiguityPolicy::Unavailable);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.duplicate_role_endpoints, roles(&[WorkerRole::Prefill, WorkerRole::Decode]));
    assert_eq!(entry.state, Unavailable);
    // Nothing is missing: the state is the policy's, the roles are all there.
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Prefill, WorkerRole::Decode]));
    assert!(entry.missing_roles.is_empty());

    assert_eq!(relay.entry("model/agg").state, Ready);

    // Live duplicates too.
    let _ = relay.live("prod/prefill-b/generate", &[3]);
    let _ = relay.live("prod/decode-b/generate", &[4]);
    assert_eq!(relay.entry(MODEL).state, Unavailable);

    // Once the duplicates leave, the entry is ready under the strict policy too.
    relay.remove(base_id("prod/prefill-b/generate", 3));
    relay.remove(base_id("prod/decode-b/generate", 4));
    let entry = relay.entry(MODEL);
    assert!(entry.duplicate_role_endpoints.is_empty());
    assert_eq!(entry.state, Ready);
}

// ---- availability fencing ----------------------------------------------------------------

#[test]
fn retired_slot_cannot_overwrite_readded_endpoint_availability() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    let retired = relay.slot(AGGREGATED_PATH);
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    assert_eq!(relay.entry(MODEL).state, Ready);

    // The endpoint leaves (its slot retires) and comes back under a new slot.
    relay.remove(base_id(AGGREGATED_PATH, 1));
    let _ = relay.recompute();
    assert!(relay.topology.entries().is_empty());
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    let current = relay.slot(AGGREGATED_PATH);
    assert_ne!(current, retired);
    assert_eq!(relay.entry(MODEL).state, Unknown);

    // The retired slot's watch delivers late: fenced, the entry stays UNKNOWN.
    let path = endpoint(AGGREGATED_PATH);
    assert_eq!(
        relay.availability.replace(&path, retired, Some([1].into_iter().collect())),
        ReplaceOutcome::Fenced { owner: Some(current) }
    );
    assert_eq!(
        relay.availability.release(&path, retired),
        ReleaseOutcome::Fenced { owner: Some(current) }
    );
    assert_eq!(relay.entry(MODEL).state, Unknown);

    // The current slot's listing is authoritative.
    assert_eq!(relay.live(AGGREGATED_PATH, &[]), ReplaceOutcome::Changed);
    assert_eq!(relay.entry(MODEL).state, Unavailable);
}

#[test]
fn membership_update_keeps_availability_owned_by_the_same_slot() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    let slot = relay.slot(AGGREGATED_PATH);
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    assert_eq!(relay.entry(MODEL).state, Ready);
    let generation = relay.view.membership(&endpoint(AGGREGATED_PATH)).unwrap().generation;

    // A second worker's card changes the membership; the host keeps the slot and re-claims.
    relay.add(base_id(AGGREGATED_PATH, 2), aggregated(MODEL));
    assert!(relay.view.membership(&endpoint(AGGREGATED_PATH)).unwrap().generation > generation);
    assert_eq!(relay.slot(AGGREGATED_PATH), slot);
    assert_eq!(
        relay.availability.claim(&endpoint(AGGREGATED_PATH), slot),
        ClaimOutcome::AlreadyOwned
    );
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready, "availability survives the membership update");
    assert_eq!(entry.present_roles, roles(&[WorkerRole::Aggregated]));
}

// ---- pool links --------------------------------------------------------------------------

#[test]
fn in_place_model_swap_never_links_the_previous_generations_pool() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated("model/old"));
    relay.link_all();
    let old_pool = relay.pool_of(AGGREGATED_PATH);
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    assert_eq!(relay.entry("model/old").members[0].pool_id, Some(old_pool));

    // The worker swaps its model in place; the catalog still lists the old generation's pool.
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated("model/new"));
    let new_pool = relay.pool_of(AGGREGATED_PATH);
    assert_ne!(new_pool, old_pool);
    let entry = relay.entry("model/new");
    assert_eq!(entry.state, Ready, "the same slot keeps its availability");
    assert_eq!(entry.members[0].pool_id, None);
    assert!(relay.topology.entry("prod", "model/old").is_none());

    // The catalog catches up.
    relay.link_all();
    assert_eq!(relay.entry("model/new").members[0].pool_id, Some(new_pool));
}

#[test]
fn duplicate_endpoint_catalog_links_fail_closed() {
    let mut relay = pd_relay();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2]);
    let prefill_pool = relay.pool_of(PREFILL_PATH);
    let decode_pool = relay.pool_of(DECODE_PATH);
    let other_dc_pool = PoolId { dc_id: stable_dc_id("dc-b").unwrap(), ..decode_pool };
    let claim = |path: &str, pool: PoolId| (endpoint(path), MODEL.to_owned(), pool);

    // Two descriptors claim the decode endpoint for one base model: neither links, not even
    // after a third claim, and the prefill link is unaffected.
    relay.links = PoolLinks::from_claims([
        claim(DECODE_PATH, decode_pool),
        claim(PREFILL_PATH, prefill_pool),
        claim(DECODE_PATH, other_dc_pool),
        claim(DECODE_PATH, decode_pool),
    ]);
    assert_eq!(relay.links.link(&endpoint(DECODE_PATH), MODEL), None);
    assert!(relay.links.ambiguous().contains(&(endpoint(DECODE_PATH), MODEL.to_owned())));
    let prefill_endpoint = endpoint(PREFILL_PATH);
    assert_eq!(
        relay.links.iter().collect::<Vec<_>>(),
        vec![(&prefill_endpoint, MODEL, prefill_pool)],
        "only the unambiguous link is listed"
    );
    let entry = relay.entry(MODEL);
    assert_eq!(
        member_pools(&entry),
        vec![(DECODE_PATH.into(), None), (PREFILL_PATH.into(), Some(prefill_pool))]
    );
    assert_eq!(entry.state, Ready, "a missing link does not change readiness");

    // Even two identical claims are two descriptors.
    let twice =
        PoolLinks::from_claims([claim(DECODE_PATH, decode_pool), claim(DECODE_PATH, decode_pool)]);
    assert_eq!(twice.link(&endpoint(DECODE_PATH), MODEL), None);
    assert_eq!(twice.iter().count(), 0);
}

// ---- conflicts ---------------------------------------------------------------------------

#[test]
fn fenced_membership_does_not_contribute_to_topology() {
    let mut relay = pd_relay();
    // The decode endpoint also serves a second base model: a ServingTopology conflict.
    relay.add(base_id(DECODE_PATH, 4), typed("other/model", Decode, &[]));
    relay.link_all();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2, 4]);

    let entry = relay.entry(MODEL);
    assert_eq!(
        member_pools(&entry),
        vec![(PREFILL_PATH.into(), Some(relay.pool_of(PREFILL_PATH)))]
    );
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Decode]));
    assert!(relay.topology.entry("prod", "other/model").is_none());
    assert_eq!(relay.topology.entries().len(), 1);
}

#[test]
fn pool_fenced_endpoint_stays_in_topology_without_a_link() {
    // A zero block size leaves no queryable domain (no pool), but the endpoint still serves.
    let mut relay = Relay::reporting();
    relay.add(
        base_id(AGGREGATED_PATH, 1),
        ModelCard { kv_cache_block_size: 0, ..aggregated(MODEL) },
    );
    relay.link_all();
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    assert_eq!(member_pools(&entry), vec![(AGGREGATED_PATH.into(), None)]);
}

// ---- adapters ----------------------------------------------------------------------------

#[test]
fn lora_adapters_are_nested_under_the_base_entry_with_state() {
    let mut relay = Relay::reporting();
    for worker in [1, 2] {
        relay.add(base_id(AGGREGATED_PATH, worker), aggregated(MODEL));
    }
    relay.add(adapter_id(AGGREGATED_PATH, 1, "adapter-a"), adapter("adapter-a"));
    relay.add(adapter_id(AGGREGATED_PATH, 2, "adapter-a"), adapter("adapter-a"));
    relay.add(adapter_id(AGGREGATED_PATH, 2, "adapter-b"), adapter("adapter-b"));
    relay.link_all();

    let adapter_states =
        |entry: &TopologyEntry| -> Vec<(String, ReadinessState, BTreeSet<WorkerRole>)> {
            entry
                .adapters
                .iter()
                .map(|adapter| {
                    (
                        adapter.canonical_model_id.clone(),
                        adapter.state,
                        adapter.missing_roles.clone(),
                    )
                })
                .collect()
        };

    let entry = relay.entry(MODEL);
    assert_eq!(
        adapter_states(&entry),
        vec![("adapter-a".into(), Unknown, roles(&[])), ("adapter-b".into(), Unknown, roles(&[]))]
    );

    let _ = relay.live(AGGREGATED_PATH, &[1, 2]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    assert_eq!(
        adapter_states(&entry),
        vec![("adapter-a".into(), Ready, roles(&[])), ("adapter-b".into(), Ready, roles(&[]))]
    );
    // Adapters never make top-level entries.
    assert_eq!(relay.topology.entries().len(), 1);

    // The only worker with adapter-b dies: the base stays ready, adapter-b does not.
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    assert_eq!(
        adapter_states(&entry),
        vec![
            ("adapter-a".into(), Ready, roles(&[])),
            ("adapter-b".into(), Unavailable, roles(&[WorkerRole::Aggregated])),
        ]
    );

    // Everything dies: the base's UNAVAILABLE passes through with its missing roles.
    let _ = relay.live(AGGREGATED_PATH, &[]);
    let entry = relay.entry(MODEL);
    assert_eq!(
        adapter_states(&entry),
        vec![
            ("adapter-a".into(), Unavailable, roles(&[WorkerRole::Aggregated])),
            ("adapter-b".into(), Unavailable, roles(&[WorkerRole::Aggregated])),
        ]
    );
}

#[test]
fn epd_lora_excludes_encode_from_adapter_membership_but_not_base_readiness() {
    let mut relay = epd_relay();
    // A second encoder worker (4) without the adapter; encoder worker 3 advertises it.
    relay.add(base_id(ENCODE_PATH, 4), typed(MODEL, Encode, EPD_ENCODE_NEEDS));
    for (path, worker) in [(PREFILL_PATH, 1), (DECODE_PATH, 2), (ENCODE_PATH, 3)] {
        relay.add(adapter_id(path, worker, "sql"), adapter("sql"));
    }
    relay.link_all();
    let _ = relay.live(PREFILL_PATH, &[1]);
    let _ = relay.live(DECODE_PATH, &[2]);

    // Only the encoder without the adapter is live: the base has its encoder, and the adapter
    // does not need an encoder that advertises it.
    let _ = relay.live(ENCODE_PATH, &[4]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    let sql = entry.adapter("sql").unwrap();
    assert_eq!((sql.state, sql.missing_roles.clone()), (Ready, roles(&[])));

    // No encoder live: the base misses ENCODE and the adapter inherits it.
    let _ = relay.live(ENCODE_PATH, &[]);
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Unavailable);
    assert_eq!(entry.missing_roles, roles(&[WorkerRole::Encode]));
    let sql = entry.adapter("sql").unwrap();
    assert_eq!((sql.state, sql.missing_roles.clone()), (Unavailable, roles(&[WorkerRole::Encode])));

    // Encoders back, but the adapter's decode worker is gone: the adapter misses DECODE only.
    let _ = relay.live(ENCODE_PATH, &[3, 4]);
    relay.remove(adapter_id(DECODE_PATH, 2, "sql"));
    let entry = relay.entry(MODEL);
    assert_eq!(entry.state, Ready);
    let sql = entry.adapter("sql").unwrap();
    assert_eq!((sql.state, sql.missing_roles.clone()), (Unavailable, roles(&[WorkerRole::Decode])));
}

// ---- publisher ---------------------------------------------------------------------------

#[test]
fn clear_publishes_empty_entries_and_stops() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    assert_eq!(relay.recompute(), TopologyOutcome::Published { revision: 2 });
    assert!(!relay.topology.is_stopped());

    assert_eq!(relay.topology.clear(), TopologyOutcome::Published { revision: 3 });
    assert!(relay.topology.entries().is_empty());
    assert!(relay.topology.is_stopped());
    // A late input after the terminal stop changes nothing.
    assert_eq!(relay.recompute(), TopologyOutcome::Stopped);
    assert_eq!(relay.topology.clear(), TopologyOutcome::Stopped);
    assert_eq!(relay.topology.snapshot(), TopologySnapshot { revision: 3, entries: Vec::new() });
}

#[test]
fn clearing_an_empty_topology_keeps_its_revision() {
    let mut topology = TopologyState::new(AmbiguityPolicy::Report);
    assert_eq!(topology.clear(), TopologyOutcome::Unchanged { revision: 1 });
    assert!(topology.is_stopped());
}

// ---- ordering and rendering --------------------------------------------------------------

#[test]
fn members_are_sorted_by_endpoint_text() {
    // Tuple order would put "backend" before "backend-prefill"; the text order is the reverse.
    let mut relay = Relay::reporting();
    relay.add(base_id("prod/backend/generate", 1), typed(MODEL, Decode, &[]));
    relay.add(base_id("prod/backend-prefill/generate", 2), typed(MODEL, Prefill, &[&[Decode]]));
    let entry = relay.entry(MODEL);
    let order: Vec<String> =
        entry.members.iter().map(|member| member.endpoint.to_string()).collect();
    assert_eq!(order, vec!["prod/backend-prefill/generate", "prod/backend/generate"]);
}

#[test]
fn surfaces_split_units_but_not_endpoints() {
    // Two live decode workers on one endpoint serving different surfaces are distinct readiness
    // units, but one endpoint: no duplicate role is reported, and even the strict policy keeps
    // the entry READY (it gates on reported duplicates only).
    for policy in [AmbiguityPolicy::Report, AmbiguityPolicy::Unavailable] {
        let mut relay = pd_relay();
        relay.topology = TopologyState::new(policy);
        relay.add(
            base_id(DECODE_PATH, 5),
            ModelCard {
                model_type: ModelTypeFlags(ModelTypeFlags::COMPLETIONS),
                ..typed(MODEL, Decode, &[])
            },
        );
        let _ = relay.live(PREFILL_PATH, &[1]);
        let _ = relay.live(DECODE_PATH, &[2, 5]);
        let entry = relay.entry(MODEL);
        assert_eq!(entry.state, Ready, "{policy:?}");
        assert!(entry.duplicate_role_endpoints.is_empty(), "{policy:?}");
    }
}

#[test]
fn entry_serializes_in_wire_field_order() {
    let mut relay = Relay::reporting();
    relay.add(base_id(AGGREGATED_PATH, 1), aggregated(MODEL));
    relay.add(adapter_id(AGGREGATED_PATH, 1, "sql"), adapter("sql"));
    relay.link_all();
    let _ = relay.live(AGGREGATED_PATH, &[1]);
    let entry = relay.entry(MODEL);
    let json = serde_json::to_string(&entry).unwrap();
    let pool = relay.pool_of(AGGREGATED_PATH);
    let expected = format!(
        concat!(
            r#"{{"namespace":"prod","canonical_model_id":"{model}","state":"READY","#,
            r#""present_roles":["AGGREGATED"],"missing_roles":[],"#,
            r#""members":[{{"endpoint":"{endpoint}","roles":["AGGREGATED"],"pool_id":"{pool}"}}],"#,
            r#""duplicate_role_endpoints":[],"legacy_fallback_active":false,"#,
            r#""adapters":[{{"canonical_model_id":"sql","state":"READY","missing_roles":[]}}]}}"#
        ),
        model = MODEL,
        endpoint = AGGREGATED_PATH,
        pool = pool,
    );
    assert_eq!(json, expected);
}
