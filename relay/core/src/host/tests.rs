//! Behaviour of the endpoint host over real discovery projections, after the reference's named
//! host cases (relay-facts §9.5, §9.6, §8.5, §14 "Discovery / host / topology / load").
//!
//! A [`Harness`] keeps a discovery view, the per-endpoint KV source facts and a clock, feeds
//! them to the host, and records every catalog snapshot the shell would have published, so a
//! test can assert both on command order and on what catalog watchers could ever observe.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::slots::SlotCorruption;
use super::*;
use crate::discovery::{
    CardChange, DiscoveryScope, DiscoveryView, EndpointMembership, ModelTarget, WorkerRole,
};
use crate::inputs::{
    CardInstanceId, ModelCard, ModelInput, ModelTypeFlags, RuntimeConfig, WorkerType,
};
use crate::model::identity::{
    DcId, EndpointPath, ExplicitIdentityMap, IndexerIdentitySpec, PoolId, ProducerIdentity,
    RelayIdentity, stable_dc_id,
};
use crate::model::kv_events::SourceKey;
use crate::rng::rng_from_seed;

const BACKEND: &str = "prod/backend/generate";
const PREFILL: &str = "prod/prefill/generate";
const ENCODE: &str = "prod/encoder/generate";

fn endpoint(path: &str) -> EndpointPath {
    path.parse().unwrap()
}

fn card_id(path: &str, worker_id: u64) -> CardInstanceId {
    CardInstanceId { endpoint: endpoint(path), instance_id: worker_id, model_suffix: None }
}

/// A base card serving `name` with 16-token blocks.
fn card(name: &str, worker_type: WorkerType) -> ModelCard {
    ModelCard {
        display_name: name.to_owned(),
        aliases: Vec::new(),
        source_path: Some(name.to_owned()),
        model_type: ModelTypeFlags(ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS),
        model_input: Some(ModelInput::Tokens),
        kv_cache_block_size: 16,
        worker_type: Some(worker_type),
        needs: Vec::new(),
        lora: None,
        indexer_identity: None,
        runtime_config: RuntimeConfig::default(),
    }
}

fn aggregated(name: &str) -> ModelCard {
    card(name, WorkerType::Aggregated)
}

/// A card whose cache semantics and routing scope are both explicit: two endpoints with the
/// same `pool` label derive the same pool id, and a model swap keeps the domain.
fn explicit(name: &str, pool: &str) -> ModelCard {
    ModelCard {
        indexer_identity: Some(IndexerIdentitySpec {
            semantics: Some(ExplicitIdentityMap::try_from_pairs([("cache", "shared")]).unwrap()),
            routing_scope: Some(ExplicitIdentityMap::try_from_pairs([("pool", pool)]).unwrap()),
        }),
        ..aggregated(name)
    }
}

fn dc_id() -> DcId {
    stable_dc_id("dc-a").unwrap()
}

fn relay() -> RelayIdentity {
    RelayIdentity { drt_instance_id: 0xd7, relay_incarnation: 0x77 }
}

fn config(relay: RelayIdentity) -> HostConfig {
    HostConfig::for_expected_blocks(relay, dc_id(), 1024).unwrap()
}

/// The discovery view, KV source facts and clock around one host.
struct Harness {
    host: EndpointHost,
    view: DiscoveryView,
    sources: BTreeMap<EndpointPath, SourceBinding>,
    now: Duration,
    /// Every catalog snapshot a `PublishCatalog` made visible, in order.
    published: Vec<CatalogSnapshot>,
}

impl Harness {
    fn new() -> Self {
        Harness::with_relay(relay())
    }

    fn with_relay(relay: RelayIdentity) -> Self {
        Harness {
            host: EndpointHost::new(config(relay)).unwrap(),
            view: DiscoveryView::new(DiscoveryScope::watch_all(Vec::new()).unwrap()),
            sources: BTreeMap::new(),
            now: Duration::ZERO,
            published: Vec::new(),
        }
    }

    fn upsert(&mut self, id: CardInstanceId, card: ModelCard) {
        let _ = self.view.apply(CardChange::Upserted { id, card: Box::new(card) });
    }

    fn remove(&mut self, id: CardInstanceId) {
        let _ = self.view.apply(CardChange::Removed { id });
    }

    /// The endpoint's ranks publish KV events, with their KV state at `kv_state`.
    fn source_at(&mut self, path: &str, kv_state: &str) {
        self.sources.insert(
            endpoint(path),
            SourceBinding {
                resolved_kv_state_endpoint: Some(endpoint(kv_state)),
                any_active_rank: true,
            },
        );
    }

    fn source_up(&mut self, path: &str) {
        self.source_at(path, path);
    }

    fn source_down(&mut self, path: &str) {
        self.sources.remove(&endpoint(path));
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    fn record(&mut self, commands: Vec<HostCommand>) -> Vec<HostCommand> {
        if let Err(violation) = self.host.check_invariants() {
            panic!("host invariant broken: {violation}");
        }
        for command in &commands {
            if let HostCommand::PublishCatalog { revision } = command {
                let snapshot = self.host.catalog_snapshot();
                assert!(*revision <= snapshot.revision);
                self.published.push(snapshot);
            }
        }
        commands
    }

    fn reconcile(&mut self) -> Vec<HostCommand> {
        let commands = self.host.reconcile(self.view.memberships(), &self.sources, self.now);
        self.record(commands)
    }

    fn timeout(&mut self) -> Vec<HostCommand> {
        let commands = self.host.handle_timeout(self.now);
        self.record(commands)
    }

    fn succeed(&mut self, path: &str, layout_generation: u64) -> Vec<HostCommand> {
        let commands = self.host.start_succeeded(&endpoint(path), layout_generation, self.now);
        self.record(commands)
    }

    fn fail(&mut self, path: &str, layout_generation: u64) -> Vec<HostCommand> {
        let commands = self.host.start_failed(&endpoint(path), layout_generation, self.now);
        self.record(commands)
    }

    /// Reconcile and report every resulting start as successful; returns all commands.
    fn settle(&mut self) -> Vec<HostCommand> {
        let commands = self.reconcile();
        self.succeed_all(commands)
    }

    /// Report every `StartPool` in `commands` (and in what follows) as successful.
    fn succeed_all(&mut self, commands: Vec<HostCommand>) -> Vec<HostCommand> {
        let mut all = Vec::new();
        let mut queue = commands;
        while !queue.is_empty() {
            let mut next = Vec::new();
            for command in &queue {
                if let HostCommand::StartPool { endpoint, producer, .. } = command {
                    let path = endpoint.to_string();
                    next.extend(self.succeed(&path, producer.layout_generation()));
                }
            }
            all.extend(queue);
            queue = next;
        }
        all
    }

    fn membership(&self, path: &str) -> &EndpointMembership {
        self.view.membership(&endpoint(path)).unwrap()
    }

    fn pool_id(&self, path: &str) -> PoolId {
        PoolId { indexer_domain: self.membership(path).domain.unwrap(), dc_id: dc_id() }
    }

    fn lifecycle(&self, path: &str) -> SlotLifecycle {
        self.host.slot(&endpoint(path)).unwrap().lifecycle
    }

    fn active_producer(&self, path: &str) -> ProducerIdentity {
        let pool_id = self.host.catalog().pool_of(&endpoint(path)).unwrap();
        self.host.catalog().descriptor(&pool_id).unwrap().producer
    }

    fn catalog_endpoints(&self) -> Vec<String> {
        self.host.catalog().descriptors().map(|d| d.serving_endpoint.to_string()).collect()
    }
}

fn start_generations(commands: &[HostCommand]) -> Vec<u64> {
    commands
        .iter()
        .filter_map(|command| match command {
            HostCommand::StartPool { producer, .. } => Some(producer.layout_generation()),
            _ => None,
        })
        .collect()
}

/// The command kinds in order, for asserting the protocol shape.
fn kinds(commands: &[HostCommand]) -> Vec<&'static str> {
    commands
        .iter()
        .map(|command| match command {
            HostCommand::WithdrawPool { .. } => "withdraw",
            HostCommand::PublishCatalog { .. } => "publish",
            HostCommand::StopPool { mode: StopMode::Graceful, .. } => "stop",
            HostCommand::StopPool { mode: StopMode::Fence, .. } => "stop-fence",
            HostCommand::ReleasePool { .. } => "release",
            HostCommand::StartPool { .. } => "start",
            HostCommand::RecoverSource { .. } => "recover",
        })
        .collect()
}

// ---- materialization gate ------------------------------------------------------------------

#[test]
fn encode_pool_materializes_only_after_an_active_kv_source_appears() {
    let mut harness = Harness::new();
    harness.upsert(card_id(ENCODE, 1), card("vision-encoder", WorkerType::Encode));
    assert!(harness.membership(ENCODE).is_materializable());

    // A materializable endpoint without a KV source: a topology member, never a pool.
    assert!(harness.reconcile().is_empty());
    assert_eq!(harness.lifecycle(ENCODE), SlotLifecycle::Discovered);
    assert_eq!(harness.host.catalog().revision(), 0);

    // Ranks that exist but are not active, or an unresolved KV-state mapping, are no source.
    harness.sources.insert(
        endpoint(ENCODE),
        SourceBinding {
            resolved_kv_state_endpoint: Some(endpoint(ENCODE)),
            any_active_rank: false,
        },
    );
    assert!(harness.reconcile().is_empty());
    harness.sources.insert(
        endpoint(ENCODE),
        SourceBinding { resolved_kv_state_endpoint: None, any_active_rank: true },
    );
    assert!(harness.reconcile().is_empty());
    assert!(harness.host.catalog().is_empty());

    harness.source_up(ENCODE);
    let commands = harness.reconcile();
    assert_eq!(kinds(&commands), ["start"]);
    // Starting is not published: the catalog only names running producers.
    assert_eq!(harness.lifecycle(ENCODE), SlotLifecycle::Starting);
    assert!(harness.host.catalog().is_empty());

    let commands = harness.succeed(ENCODE, 1);
    assert_eq!(commands, [HostCommand::PublishCatalog { revision: 1 }]);
    assert_eq!(harness.lifecycle(ENCODE), SlotLifecycle::Active);
    let descriptor = harness.host.catalog().descriptors().next().unwrap().clone();
    assert_eq!(descriptor.serving_endpoint, endpoint(ENCODE));
    assert_eq!(descriptor.pool_roles, BTreeSet::from([WorkerRole::Encode]));
    assert_eq!(descriptor.layout_generation(), 1);
}

#[test]
fn endpoint_slot_materializes_and_dematerializes_with_its_kv_source() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Active);
    let first = harness.active_producer(BACKEND);
    let slot_incarnation = harness.host.slot(&endpoint(BACKEND)).unwrap().slot_incarnation;

    harness.source_down(BACKEND);
    let commands = harness.reconcile();
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop", "release"]);
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Discovered);
    assert!(harness.host.catalog().is_empty());
    assert_eq!(harness.host.catalog().revision(), 2);

    // The source returns: same slot, new generation.
    harness.source_up(BACKEND);
    let commands = harness.settle();
    assert_eq!(start_generations(&commands), [2]);
    let second = harness.active_producer(BACKEND);
    assert_eq!(second.pool_id(), first.pool_id());
    assert_ne!(second.key(), first.key());
    assert_eq!(harness.host.slot(&endpoint(BACKEND)).unwrap().slot_incarnation, slot_incarnation);
    assert_eq!(harness.host.catalog().revision(), 3);
}

#[test]
fn pool_is_withdrawn_before_teardown() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let pool_id = harness.pool_id(BACKEND);

    harness.remove(card_id(BACKEND, 1));
    let commands = harness.reconcile();
    assert_eq!(
        commands,
        [
            HostCommand::WithdrawPool {
                pool_id,
                layout_generation: 1,
                reason: RetireReason::EndpointRemoved,
            },
            HostCommand::PublishCatalog { revision: 2 },
            HostCommand::StopPool {
                endpoint: endpoint(BACKEND),
                pool_id,
                layout_generation: 1,
                mode: StopMode::Graceful,
            },
            HostCommand::ReleasePool { endpoint: endpoint(BACKEND), pool_id, layout_generation: 1 },
        ]
    );
    // The withdrawal was already in the catalog when it was published, and the slot is gone.
    assert!(harness.published.last().unwrap().pools.is_empty());
    assert_eq!(harness.host.slot(&endpoint(BACKEND)), None);
    assert_eq!(harness.host.registry().held_by(&endpoint(BACKEND)), None);
}

#[test]
fn binding_change_never_publishes_new_model_with_old_producer() {
    let mut harness = Harness::new();
    // Explicit cache semantics: the model swap keeps the indexer domain, the pool id and the
    // KV-state endpoint, which is the hardest case for "never under the old producer".
    harness.upsert(card_id(BACKEND, 1), explicit("model-a", "backend"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let old = harness.active_producer(BACKEND);

    harness.upsert(card_id(BACKEND, 1), explicit("model-b", "backend"));
    assert_eq!(harness.pool_id(BACKEND), old.pool_id());
    let commands = harness.reconcile();
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop", "release", "start"]);
    assert_eq!(start_generations(&commands), [2]);
    let _ = harness.succeed_all(commands);

    // Default identity: the model is part of the domain, so the pool id changes too.
    harness.upsert(card_id(BACKEND, 1), aggregated("model-c"));
    let _ = harness.settle();

    // KV-state endpoint moves: same model, same pool id, new generation.
    let before = harness.active_producer(BACKEND);
    harness.source_at(BACKEND, "prod/backend/kv_state");
    let commands = harness.settle();
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop", "release", "start", "publish"]);
    let after = harness.active_producer(BACKEND);
    assert_eq!(after.pool_id(), before.pool_id());
    assert_eq!(after.layout_generation(), 4);
    assert!(matches!(
        &commands[4],
        HostCommand::StartPool { kv_state_endpoint, .. }
            if *kv_state_endpoint == endpoint("prod/backend/kv_state")
    ));

    // Over every snapshot a watcher could have seen, each producer served one base model.
    let mut models_by_producer: BTreeMap<ProducerIdentity, BTreeSet<String>> = BTreeMap::new();
    for snapshot in &harness.published {
        for pool in &snapshot.pools {
            for registration in &pool.registrations {
                models_by_producer
                    .entry(pool.producer)
                    .or_default()
                    .insert(registration.target.base_model().to_owned());
            }
        }
    }
    assert_eq!(models_by_producer.len(), 4);
    assert!(models_by_producer.values().all(|models| models.len() == 1), "{models_by_producer:?}");
}

#[test]
fn start_that_raced_with_a_binding_change_is_stopped_unpublished() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("model-a"));
    harness.source_up(BACKEND);
    assert_eq!(start_generations(&harness.reconcile()), [1]);

    // The model changes while generation 1 is starting: nothing starts twice.
    harness.upsert(card_id(BACKEND, 1), aggregated("model-b"));
    assert!(harness.reconcile().is_empty());

    let commands = harness.succeed(BACKEND, 1);
    assert_eq!(kinds(&commands), ["stop", "release", "start"]);
    assert_eq!(start_generations(&commands), [2]);
    assert_eq!(harness.host.catalog().revision(), 0, "generation 1 was never published");

    let _ = harness.succeed_all(commands);
    let descriptor = harness.host.catalog().descriptors().next().unwrap();
    assert_eq!(descriptor.layout_generation(), 2);
    assert_eq!(descriptor.registrations[0].canonical_model_id, "model-b");
    assert_eq!(harness.host.catalog().revision(), 1);
}

#[test]
fn alias_and_context_change_refreshes_the_active_pool_catalog() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let producer = harness.active_producer(BACKEND);
    let revision = harness.host.catalog().revision();

    let mut changed = aggregated("tiny-llm");
    changed.aliases = vec!["tiny".to_owned()];
    changed.runtime_config.context_length = Some(8192);
    harness.upsert(card_id(BACKEND, 1), changed.clone());
    let commands = harness.reconcile();
    assert_eq!(commands, [HostCommand::PublishCatalog { revision: revision + 1 }]);
    assert_eq!(harness.active_producer(BACKEND), producer, "same producer, refreshed in place");
    let descriptor = harness.host.catalog().descriptors().next().unwrap();
    assert_eq!(descriptor.registrations[0].aliases, BTreeSet::from(["tiny".to_owned()]));

    // A context change alone touches nothing in the descriptor: no new revision.
    changed.runtime_config.context_length = Some(4096);
    harness.upsert(card_id(BACKEND, 1), changed);
    assert!(harness.reconcile().is_empty());

    // A second worker with another role is metadata too.
    harness.upsert(card_id(BACKEND, 2), card("tiny-llm", WorkerType::Decode));
    let commands = harness.reconcile();
    assert_eq!(commands, [HostCommand::PublishCatalog { revision: revision + 2 }]);
    assert_eq!(harness.active_producer(BACKEND), producer);
    let roles = &harness.host.catalog().descriptors().next().unwrap().pool_roles;
    assert_eq!(*roles, BTreeSet::from([WorkerRole::Decode, WorkerRole::Aggregated]));
}

// ---- generations and identity --------------------------------------------------------------

#[test]
fn layout_generations_are_registry_wide_and_start_at_1() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), card("tiny-llm", WorkerType::Decode));
    harness.upsert(card_id(PREFILL, 2), card("tiny-llm", WorkerType::Prefill));
    harness.source_up(BACKEND);
    harness.source_up(PREFILL);
    let commands = harness.settle();
    // Endpoint order: prod/backend before prod/prefill.
    assert_eq!(start_generations(&commands), [1, 2]);
    assert_eq!(harness.active_producer(BACKEND).layout_generation(), 1);
    assert_eq!(harness.active_producer(PREFILL).layout_generation(), 2);
    // Distinct endpoints are distinct pools (the default routing scope is the endpoint).
    assert_ne!(harness.pool_id(BACKEND), harness.pool_id(PREFILL));
    assert_eq!(harness.host.catalog().len(), 2);
    assert_eq!(harness.catalog_endpoints().len(), 2);

    harness.source_down(PREFILL);
    let _ = harness.settle();
    harness.source_up(PREFILL);
    let commands = harness.settle();
    assert_eq!(start_generations(&commands), [3]);
    assert_eq!(harness.host.registry().layout_generations_allocated(), 3);
    for producer in [harness.active_producer(BACKEND), harness.active_producer(PREFILL)] {
        assert_eq!(producer.producer_incarnation(), relay().relay_incarnation);
    }
}

#[test]
fn reappearing_endpoint_gets_a_new_generation() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let first = harness.active_producer(BACKEND);
    let first_slot = harness.host.slot(&endpoint(BACKEND)).unwrap().slot_incarnation;
    assert_eq!(first_slot, 1);

    harness.remove(card_id(BACKEND, 1));
    let _ = harness.settle();
    assert_eq!(harness.host.slot(&endpoint(BACKEND)), None);

    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    let _ = harness.settle();
    let second = harness.active_producer(BACKEND);
    assert_eq!(second.pool_id(), first.pool_id());
    assert_eq!(second.layout_generation(), 2);
    assert_eq!(harness.host.slot(&endpoint(BACKEND)).unwrap().slot_incarnation, 2);
}

#[test]
fn relay_restart_separates_drt_id_and_incarnation() {
    let mut rng = rng_from_seed(7);
    let first_start = RelayIdentity::start(0xd7, &mut rng);
    let second_start = RelayIdentity::start(0xd7, &mut rng);
    let mut producers = Vec::new();
    for relay in [first_start, second_start] {
        let mut harness = Harness::with_relay(relay);
        harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
        harness.source_up(BACKEND);
        let _ = harness.settle();
        assert_eq!(harness.host.relay(), relay);
        producers.push(harness.active_producer(BACKEND));
    }
    assert_eq!(first_start.drt_instance_id, second_start.drt_instance_id);
    assert_ne!(first_start.relay_incarnation, second_start.relay_incarnation);
    // Both starts count generations from 1 for the same pool; only the incarnation tells the
    // producers apart, and it does.
    let [before, after] = [producers[0], producers[1]];
    assert_eq!(before.pool_id(), after.pool_id());
    assert_eq!((before.layout_generation(), after.layout_generation()), (1, 1));
    assert_eq!(before.producer_incarnation(), first_start.relay_incarnation);
    assert_eq!(after.producer_incarnation(), second_start.relay_incarnation);
    assert_ne!(before.key(), after.key());
}

// ---- duplicate owners and health -----------------------------------------------------------

#[test]
fn duplicate_pool_owners_are_all_fenced_and_make_health_unhealthy() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), explicit("tiny-llm", "shared"));
    harness.upsert(card_id(PREFILL, 2), explicit("tiny-llm", "shared"));
    harness.source_up(BACKEND);
    harness.source_up(PREFILL);
    assert!(harness.settle().is_empty(), "neither claimant wins");
    for path in [BACKEND, PREFILL] {
        let slot = harness.host.slot(&endpoint(path)).unwrap();
        assert_eq!(slot.lifecycle, SlotLifecycle::Fenced);
        assert_eq!(slot.fence, Some(SlotFence::PoolConflict));
    }
    let health = harness.host.health();
    assert!(!health.healthy);
    assert_eq!(
        (health.endpoint_count, health.active_endpoint_count, health.fenced_endpoint_count),
        (2, 0, 2)
    );
    assert!(harness.host.catalog().is_empty());

    // One claimant leaves: the other materializes and health recovers.
    harness.remove(card_id(PREFILL, 2));
    let commands = harness.settle();
    assert_eq!(kinds(&commands), ["start", "publish"]);
    let health = harness.host.health();
    assert!(health.healthy);
    assert_eq!((health.endpoint_count, health.active_endpoint_count), (1, 1));
}

#[test]
fn host_fences_duplicate_claims_even_without_a_discovery_conflict() {
    // Memberships from anywhere other than a discovery view may lack the conflict; the host
    // still refuses to pick an owner.
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), explicit("tiny-llm", "backend"));
    let mut memberships = BTreeMap::new();
    for path in [BACKEND, PREFILL] {
        let mut membership = harness.membership(BACKEND).clone();
        membership.endpoint = endpoint(path);
        memberships.insert(endpoint(path), membership);
        harness.source_up(path);
    }
    let commands = harness.host.reconcile(&memberships, &harness.sources, Duration::ZERO);
    assert!(commands.is_empty());
    for path in [BACKEND, PREFILL] {
        let slot = harness.host.slot(&endpoint(path)).unwrap();
        assert_eq!(slot.fence, Some(SlotFence::DuplicatePoolOwner));
    }
    assert_eq!(harness.host.health().fenced_endpoint_count, 2);
}

#[test]
fn fenced_membership_without_kv_source_is_lightweight_not_unhealthy() {
    let mut harness = Harness::new();
    // Standard and Eagle workers on one endpoint: two domains, a pool-fencing conflict.
    let mut eagle = aggregated("tiny-llm");
    eagle.runtime_config.enable_eagle = true;
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.upsert(card_id(BACKEND, 2), eagle);
    assert!(harness.membership(BACKEND).has_pool_materialization_conflict());
    assert!(harness.reconcile().is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Lightweight);
    assert!(harness.host.health().healthy);

    // With an active KV source the conflict suppresses a real pool: fenced.
    harness.source_up(BACKEND);
    assert!(harness.reconcile().is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Fenced);
    assert!(!harness.host.health().healthy);
}

#[test]
fn active_pool_that_becomes_conflicted_is_withdrawn() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();

    let mut eagle = aggregated("tiny-llm");
    eagle.runtime_config.enable_eagle = true;
    harness.upsert(card_id(BACKEND, 2), eagle);
    let commands = harness.reconcile();
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop", "release"]);
    assert!(matches!(
        commands[0],
        HostCommand::WithdrawPool { reason: RetireReason::Dematerialized, .. }
    ));
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Fenced);
}

// ---- failures, fences and faults -----------------------------------------------------------

#[test]
fn start_failure_retries_with_backoff() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    assert_eq!(start_generations(&harness.reconcile()), [1]);

    let mut expected_delays_ms = Vec::new();
    let mut generation = 1;
    for _ in 0..8 {
        let commands = harness.fail(BACKEND, generation);
        assert_eq!(kinds(&commands), ["release"], "a failed start has no pool to stop");
        let slot = harness.host.slot(&endpoint(BACKEND)).unwrap();
        assert_eq!(
            (slot.lifecycle, slot.fence),
            (SlotLifecycle::Fenced, Some(SlotFence::StartFailed))
        );
        assert!(!harness.host.health().healthy);
        let due = harness.host.poll_timeout().unwrap();
        expected_delays_ms.push((due - harness.now).as_millis());

        // Neither a reconcile nor a timeout before the retry is due starts anything.
        harness.advance(due - harness.now - Duration::from_millis(1));
        assert!(harness.reconcile().is_empty());
        assert!(harness.timeout().is_empty());
        harness.advance(Duration::from_millis(1));
        let commands = harness.timeout();
        generation += 1;
        assert_eq!(start_generations(&commands), [generation]);
        assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Starting);
        assert_eq!(harness.host.poll_timeout(), None);
    }
    assert_eq!(expected_delays_ms, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    assert!(harness.host.catalog().is_empty());

    let commands = harness.succeed(BACKEND, generation);
    assert_eq!(kinds(&commands), ["publish"]);
    assert!(harness.host.health().healthy);
}

#[test]
fn fenced_generation_is_withdrawn_and_replaced_by_a_new_generation() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let pool_id = harness.pool_id(BACKEND);

    // A stale generation's failure changes nothing.
    assert!(harness.host.fence_generation(pool_id, 7, harness.now).is_empty());

    harness.advance(Duration::from_secs(60));
    let commands = harness.host.fence_generation(pool_id, 1, harness.now);
    let commands = harness.record(commands);
    assert_eq!(
        commands,
        [
            HostCommand::WithdrawPool {
                pool_id,
                layout_generation: 1,
                reason: RetireReason::PublicationFailed,
            },
            HostCommand::PublishCatalog { revision: 2 },
            HostCommand::StopPool {
                endpoint: endpoint(BACKEND),
                pool_id,
                layout_generation: 1,
                mode: StopMode::Fence,
            },
            HostCommand::ReleasePool { endpoint: endpoint(BACKEND), pool_id, layout_generation: 1 },
        ]
    );
    let slot = harness.host.slot(&endpoint(BACKEND)).unwrap();
    assert_eq!(
        (slot.lifecycle, slot.fence),
        (SlotLifecycle::Fenced, Some(SlotFence::GenerationFenced))
    );
    // The generation had been stable, so this is the first failure of a new run.
    assert_eq!(harness.host.poll_timeout(), Some(harness.now + RETRY_BACKOFF_MIN));

    harness.advance(RETRY_BACKOFF_MIN);
    let commands = harness.settle();
    assert_eq!(kinds(&commands), ["start", "publish"]);
    assert_eq!(harness.active_producer(BACKEND).layout_generation(), 2);
    // The fence of generation 1 cannot touch generation 2.
    assert!(harness.host.fence_generation(pool_id, 1, harness.now).is_empty());
}

#[test]
fn host_invariants_fire_on_each_broken_relation() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.upsert(card_id(PREFILL, 2), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    assert_eq!(harness.host.check_invariants(), Ok(()));

    for (how, relation) in [
        (SlotCorruption::ForgetGeneration, "reserves a pool it does not hold"),
        (SlotCorruption::RecoveryWithoutGeneration, "host recovery in flight"),
        (SlotCorruption::UnallocatedIncarnation, "reused or unallocated"),
        (SlotCorruption::ReusedIncarnation, "reused or unallocated"),
        (SlotCorruption::CataloguedWhileStarting, "is not its slot's active generation"),
    ] {
        let mut broken = harness.host.clone();
        broken.corrupt_slot_for_test(&endpoint(BACKEND), how);
        let violation = broken.check_invariants().unwrap_err();
        assert!(violation.contains(relation), "{how:?}: {violation}");
    }
}

#[test]
fn fenced_target_disposition_withdraws() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let pool_id = harness.pool_id(BACKEND);
    let source = SourceKey { worker_id: 1, dp_rank: 0 };
    // An outcome when no recovery was asked for is ignored.
    let unasked = harness.host.source_recovery_finished(
        &endpoint(BACKEND),
        1,
        TargetDisposition::Fenced,
        harness.now,
    );
    assert!(unasked.is_empty(), "{unasked:?}");
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Active);

    let fault =
        PoolFaultReport { source, source_epoch: 3, action: PoolFaultAction::ReportResourceFailure };
    let commands = harness.host.report_pool_fault(&endpoint(BACKEND), 1, fault, harness.now);
    assert_eq!(
        commands,
        [HostCommand::RecoverSource {
            endpoint: endpoint(BACKEND),
            pool_id,
            layout_generation: 1,
            fault: SourceFault {
                source,
                source_epoch: 3,
                action: SourceFaultAction::ReportResourceFailure,
            },
        }]
    );

    let commands = harness.host.source_recovery_finished(
        &endpoint(BACKEND),
        1,
        TargetDisposition::Fenced,
        harness.now,
    );
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop-fence", "release"]);
    assert!(matches!(
        commands[0],
        HostCommand::WithdrawPool { reason: RetireReason::TargetFenced, layout_generation: 1, .. }
    ));
    assert!(harness.host.catalog().is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Fenced);
}

#[test]
fn source_faults_are_recovered_one_call_at_a_time() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let backend = endpoint(BACKEND);
    let fault = |worker_id, source_epoch, action| PoolFaultReport {
        source: SourceKey { worker_id, dp_rank: 0 },
        source_epoch,
        action,
    };

    let first = harness.host.report_pool_fault(
        &backend,
        1,
        fault(1, 1, PoolFaultAction::ReportResourceFailure),
        harness.now,
    );
    assert_eq!(kinds(&first), ["recover"]);
    // While that call is in flight, faults queue and coalesce.
    for reported in [
        fault(2, 1, PoolFaultAction::ReportResourceFailure),
        fault(2, 1, PoolFaultAction::RejectSource),
        fault(3, 1, PoolFaultAction::ContinueCapacityOmission),
    ] {
        assert!(harness.host.report_pool_fault(&backend, 1, reported, harness.now).is_empty());
    }
    // Faults of another generation are not this pool's business.
    let stale = fault(4, 1, PoolFaultAction::FenceAndRebuildProducer);
    assert!(harness.host.report_pool_fault(&backend, 9, stale, harness.now).is_empty());
    assert_eq!(harness.host.slot(&backend).unwrap().pending_source_faults, 1);

    let next = harness.host.source_recovery_finished(
        &backend,
        1,
        TargetDisposition::Recovered,
        harness.now,
    );
    assert!(matches!(
        next.as_slice(),
        [HostCommand::RecoverSource {
            fault: SourceFault {
                source: SourceKey { worker_id: 2, dp_rank: 0 },
                action: SourceFaultAction::RejectSource,
                ..
            },
            ..
        }]
    ));
    let done = harness.host.source_recovery_finished(
        &backend,
        1,
        TargetDisposition::Recovered,
        harness.now,
    );
    assert!(done.is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Active);
}

#[test]
fn producer_fence_interrupts_inflight_fault_recovery() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let backend = endpoint(BACKEND);
    let source = SourceKey { worker_id: 1, dp_rank: 0 };

    let resource =
        PoolFaultReport { source, source_epoch: 1, action: PoolFaultAction::ReportResourceFailure };
    assert_eq!(
        kinds(&harness.host.report_pool_fault(&backend, 1, resource, harness.now)),
        ["recover"]
    );

    let fence = PoolFaultReport {
        source,
        source_epoch: 1,
        action: PoolFaultAction::FenceAndRebuildProducer,
    };
    let commands = harness.host.report_pool_fault(&backend, 1, fence, harness.now);
    assert_eq!(kinds(&commands), ["withdraw", "publish", "stop-fence", "release"]);
    assert!(matches!(
        commands[0],
        HostCommand::WithdrawPool {
            reason: RetireReason::ProducerFence(ProducerFenceCause::InvariantViolation { .. }),
            ..
        }
    ));
    // The interrupted call's late answer belongs to a gone generation.
    let late =
        harness.host.source_recovery_finished(&backend, 1, TargetDisposition::Fenced, harness.now);
    assert!(late.is_empty());

    harness.advance(RETRY_BACKOFF_MIN);
    let commands = harness.settle();
    assert_eq!(start_generations(&commands), [2]);
    assert_eq!(harness.host.slot(&backend).unwrap().pending_source_faults, 0);
}

#[test]
fn overflowing_pending_source_faults_fences_the_producer() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let backend = endpoint(BACKEND);
    let mut all = Vec::new();
    // One fault goes into flight, sixteen more fill the pending set, the next one overflows.
    for worker_id in 0..=(PENDING_SOURCE_FAULTS_MAX as u64 + 1) {
        let fault = PoolFaultReport {
            source: SourceKey { worker_id, dp_rank: 0 },
            source_epoch: 1,
            action: PoolFaultAction::RejectSource,
        };
        all.extend(harness.host.report_pool_fault(&backend, 1, fault, harness.now));
    }
    assert_eq!(kinds(&all), ["recover", "withdraw", "publish", "stop-fence", "release"]);
    assert!(matches!(
        all[1],
        HostCommand::WithdrawPool {
            reason: RetireReason::ProducerFence(ProducerFenceCause::SourceFaultOverflow),
            ..
        }
    ));
}

#[test]
fn repeated_fences_back_off_until_a_generation_stays_up() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let pool_id = harness.pool_id(BACKEND);

    // Each generation fails right after it starts: the delay grows.
    let mut delays_ms = Vec::new();
    for generation in 1..=3 {
        let _ = harness.host.fence_generation(pool_id, generation, harness.now);
        let due = harness.host.poll_timeout().unwrap();
        delays_ms.push((due - harness.now).as_millis());
        harness.now = due;
        let commands = harness.timeout();
        let _ = harness.succeed_all(commands);
    }
    assert_eq!(delays_ms, [100, 200, 400]);

    // Generation 4 stays up past the backoff cap, so its fence starts a new run.
    harness.advance(RETRY_BACKOFF_MAX);
    let _ = harness.host.fence_generation(pool_id, 4, harness.now);
    assert_eq!(harness.host.poll_timeout(), Some(harness.now + RETRY_BACKOFF_MIN));
}

// ---- shutdown ------------------------------------------------------------------------------

#[test]
fn shutdown_withdraws_every_pool_before_stopping_any() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), card("tiny-llm", WorkerType::Decode));
    harness.upsert(card_id(PREFILL, 2), card("tiny-llm", WorkerType::Prefill));
    harness.upsert(card_id(ENCODE, 3), card("tiny-llm", WorkerType::Encode));
    harness.source_up(BACKEND);
    harness.source_up(PREFILL);
    let _ = harness.settle();
    // A third pool is still starting when shutdown begins.
    harness.source_up(ENCODE);
    assert_eq!(start_generations(&harness.reconcile()), [3]);

    let commands = harness.host.begin_shutdown(harness.now);
    let commands = harness.record(commands);
    assert_eq!(
        kinds(&commands),
        ["withdraw", "withdraw", "publish", "stop", "stop", "release", "release"]
    );
    assert!(harness.host.catalog().is_empty());
    assert!(!harness.host.is_drained());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Draining);
    assert!(!harness.host.health().healthy);

    // Nothing starts again; the starting generation is stopped unpublished when it reports.
    assert!(harness.reconcile().is_empty());

    assert_eq!(harness.host.poll_timeout(), None);
    let commands = harness.succeed(ENCODE, 3);
    assert_eq!(kinds(&commands), ["stop", "release"]);
    assert!(harness.host.is_drained());
    assert_eq!(harness.host.catalog().revision(), 4);
}

/// A start report is about one generation: reports for a retired one, or a second report for
/// the current one, change nothing.
#[test]
fn a_start_report_for_another_generation_is_ignored() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("model-a"));
    harness.source_up(BACKEND);
    let first = start_generations(&harness.reconcile())[0];
    harness.source_down(BACKEND);
    let _ = harness.reconcile();
    // The unpublished generation goes when it reports; then the returning source starts anew.
    assert_eq!(kinds(&harness.succeed(BACKEND, first)), ["stop", "release"]);
    harness.source_up(BACKEND);
    let second = start_generations(&harness.reconcile())[0];
    assert_ne!(first, second);
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Starting);
    assert!(harness.succeed(BACKEND, first).is_empty());
    assert!(harness.fail(BACKEND, first).is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Starting);
    assert!(harness.catalog_endpoints().is_empty());

    assert_eq!(kinds(&harness.succeed(BACKEND, second)), ["publish"]);
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Active);
    assert!(harness.succeed(BACKEND, second).is_empty());
    assert!(harness.fail(BACKEND, second).is_empty());
    assert_eq!(harness.lifecycle(BACKEND), SlotLifecycle::Active);
}

/// A pool still held by the generation of the endpoint that served it before makes the new
/// endpoint wait as discovered (not fenced, not refused by the budget) until it is released.
#[test]
fn an_endpoint_waits_for_the_pool_another_endpoint_still_holds() {
    const MOVED: &str = "prod/moved/generate";
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), explicit("model-a", "shared"));
    harness.source_up(BACKEND);
    let first = start_generations(&harness.reconcile())[0];
    harness.remove(card_id(BACKEND, 1));
    harness.upsert(card_id(MOVED, 2), explicit("model-a", "shared"));
    harness.source_up(MOVED);
    assert!(start_generations(&harness.reconcile()).is_empty());
    let held = harness.host.slot(&endpoint(BACKEND)).unwrap().producer.map(|p| p.pool_id());
    assert_eq!(held, Some(harness.pool_id(MOVED)), "the same pool");
    let waiting = harness.host.slot(&endpoint(MOVED)).unwrap();
    assert_eq!((waiting.lifecycle, waiting.fence), (SlotLifecycle::Discovered, None));
    assert_eq!(harness.host.slots().len(), 2);

    let commands = harness.succeed(BACKEND, first);
    assert_eq!(kinds(&commands), ["stop", "release", "start"]);
    assert_eq!(harness.lifecycle(MOVED), SlotLifecycle::Starting);
}

/// A retry is armed only while its slot still wants a pool and holds none.
#[test]
fn a_retry_is_no_timer_once_the_slot_stops_wanting_a_pool() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("model-a"));
    harness.source_up(BACKEND);
    let first = start_generations(&harness.reconcile())[0];
    let _ = harness.fail(BACKEND, first);
    assert_eq!(harness.host.poll_timeout(), Some(harness.now + RETRY_BACKOFF_MIN));
    harness.source_down(BACKEND);
    let _ = harness.reconcile();
    assert_eq!(harness.host.poll_timeout(), None);
}

// ---- protocol invariants over a longer story ------------------------------------------------

#[test]
fn every_start_is_released_once_and_only_sourced_endpoints_are_ever_published() {
    let mut harness = Harness::new();
    let mut log = Vec::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("model-a"));
    harness.upsert(card_id(ENCODE, 2), card("model-a", WorkerType::Encode));
    harness.source_up(BACKEND);
    log.extend(harness.settle());
    harness.upsert(card_id(BACKEND, 1), aggregated("model-b"));
    log.extend(harness.settle());
    let start = harness.reconcile(); // nothing pending
    log.extend(start);
    harness.source_down(BACKEND);
    log.extend(harness.settle());
    harness.source_up(BACKEND);
    let commands = harness.reconcile();
    let generation = start_generations(&commands)[0];
    log.extend(commands);
    log.extend(harness.fail(BACKEND, generation));
    harness.advance(RETRY_BACKOFF_MIN);
    let commands = harness.timeout();
    log.extend(harness.succeed_all(commands));
    harness.remove(card_id(BACKEND, 1));
    log.extend(harness.settle());
    let commands = harness.host.begin_shutdown(harness.now);
    log.extend(harness.record(commands));

    let mut started = BTreeSet::new();
    let mut released = BTreeSet::new();
    for command in &log {
        match command {
            HostCommand::StartPool { producer, .. } => {
                assert!(started.insert(producer.layout_generation()), "generation reused");
            }
            HostCommand::ReleasePool { layout_generation, .. } => {
                assert!(started.contains(layout_generation));
                assert!(released.insert(*layout_generation), "released twice");
            }
            _ => {}
        }
    }
    assert_eq!(started, released);
    // The encode endpoint never had a KV source and never appeared in any snapshot.
    assert!(
        harness
            .published
            .iter()
            .flat_map(|snapshot| &snapshot.pools)
            .all(|pool| pool.serving_endpoint == endpoint(BACKEND))
    );
    // Catalog revisions only ever grow.
    assert!(harness.published.windows(2).all(|pair| pair[0].revision < pair[1].revision));
}

#[test]
fn catalog_snapshot_serializes_for_snapshot_tests() {
    let mut harness = Harness::new();
    harness.upsert(card_id(BACKEND, 1), aggregated("tiny-llm"));
    harness.source_up(BACKEND);
    let _ = harness.settle();
    let rendered = serde_json::to_value(harness.host.catalog_snapshot()).unwrap();
    assert_eq!(rendered["revision"], 1);
    let pool = &rendered["pools"][0];
    assert_eq!(pool["serving_endpoint"], BACKEND);
    assert_eq!(pool["producer"]["layout_generation"], 1);
    assert_eq!(pool["producer"]["producer_incarnation"], "0000000000000077");
    assert_eq!(pool["producer"]["pool_id"]["dc_id"], "04f110c98b1bfc48");
    assert_eq!(pool["pool_roles"], serde_json::json!(["AGGREGATED"]));
    assert!(matches!(
        harness.host.catalog().descriptors().next().unwrap().registrations[0].target,
        ModelTarget::Base { .. }
    ));
    let health = serde_json::to_value(harness.host.health()).unwrap();
    assert_eq!(health["active_endpoint_count"], 1);
}

// ---- pool budget ---------------------------------------------------------------------------

#[test]
fn pools_beyond_the_filter_budget_wait_without_making_the_host_unhealthy() {
    let mut config = config(relay());
    config.pool_filter_bytes_max = 2 * config.pool_filter_bytes() + 1;
    let mut harness = Harness::new();
    harness.host = EndpointHost::new(config).unwrap();
    let paths = ["prod/a/generate", "prod/b/generate", "prod/c/generate"];
    for (index, path) in paths.iter().enumerate() {
        harness.upsert(card_id(path, index as u64 + 1), aggregated(&format!("model-{index}")));
        harness.source_up(path);
    }
    let commands = harness.settle();
    assert_eq!(start_generations(&commands).len(), 2, "{:?}", kinds(&commands));
    let mut published = harness.catalog_endpoints();
    published.sort();
    assert_eq!(published, paths[..2]);
    let waiting = harness.host.slot(&endpoint(paths[2])).unwrap();
    assert_eq!(
        (waiting.lifecycle, waiting.fence),
        (SlotLifecycle::Fenced, Some(SlotFence::PoolBudget))
    );
    let health = harness.host.health();
    assert!(health.healthy, "{health:?}");
    assert_eq!((health.budget_refused_endpoint_count, health.fenced_endpoint_count), (1, 0));
    assert_eq!(health.pools_max, 2);

    // Once a pool is withdrawn and released, the waiting endpoint gets the budget.
    harness.source_down(paths[0]);
    let commands = harness.settle();
    assert!(kinds(&commands).contains(&"release"), "{:?}", kinds(&commands));
    let mut published = harness.catalog_endpoints();
    published.sort();
    assert_eq!(published, paths[1..]);
    assert_eq!(harness.lifecycle(paths[2]), SlotLifecycle::Active);
    assert_eq!(harness.host.health().budget_refused_endpoint_count, 0);
}
