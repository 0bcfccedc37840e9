//! Snapshots of what the relay publishes for each deployment shape and conflict case: the pool
//! catalog, the serving-readiness entries and one load window, in the shape of the
//! `dynamo.kvrelay.v1` messages (relay-facts §3.3, §9–§11; dc-inputs §7–§8).
//!
//! Every case drives a real [`ControlPlane`] with the inputs a Dynamo 1.6.1 deployment produces:
//! discovery records typed after the live captures (dynamo-live §9.1) and decoded by the relay's
//! own decoders, instance listings, and `kv_metrics` reports. A small shell answers every
//! `StartPool` with success. The relay identity is fixed (runtime instance `0x1111`, incarnation
//! drawn from a seeded generator), the data center is `stable_dc_id("dc-a")`, and the load
//! window is cut at a fixed wall-clock instant, so every value in a snapshot is derived and
//! reproducible. Snapshots live in the repository's top-level `snapshots/` directory.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kvrelay_core::control::wire::{KvPoolCatalogView, KvPoolLoadView, ServingReadinessView};
use kvrelay_core::control::{ControlCommand, ControlConfig, ControlPlane};
use kvrelay_core::discovery::{DiscoveryScope, MaterializationConflict};
use kvrelay_core::host::{HostCommand, SlotFence, SlotLifecycle};
use kvrelay_core::inputs::{
    DcInput, DiscoveryRecord, EndpointInstances, LoadObservation, decode_discovery_record,
};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{
    EndpointPath, ProducerIdentity, RelayIdentity, resolve_indexer_domain, stable_dc_id,
};
use kvrelay_core::model::kv_events::SourceKey;
use kvrelay_core::readiness::ReadinessState;
use kvrelay_core::rng::{RelayRng, derive_seed, rng_from_seed};
use serde::Serialize;
use serde_json::{Value, json};

/// The scenario seed every generator of these cases derives from.
const SEED: u64 = 0x5eed_0001;
/// The relay's runtime instance id.
const DRT_INSTANCE_ID: u64 = 0x1111;
/// Wall-clock instant of the load window (the one in the live capture).
const OBSERVED_MS: u64 = 1_796_038_252_716;

const BACKEND: &str = "dynamo/backend/generate";
const PREFILL: &str = "dynamo/prefill/generate";
const ENCODE: &str = "dynamo/encode/generate";
const OTHER: &str = "dynamo/other/generate";
const LORAS: &str = "loras/backend/generate";

/// Instance ids: the first is the aggregated worker of the live capture.
const WORKER_A: u64 = 13_864_542_646_465_346_627;
const WORKER_B: u64 = 0x7a3c_5e11_0b2d_4f01;
const WORKER_C: u64 = 0x41d2_9c07_e6a8_1b33;
/// Publisher incarnations: the first is the live capture's.
const PUBLISHER_A: u64 = 7_327_664_155_944_878;
const PUBLISHER_B: u64 = 0x2f61_0c4e_9d13_77a5;
const PUBLISHER_C: u64 = 0x5c83_f1a6_2e49_b70d;

// ---- inputs, typed after the live captures --------------------------------------------------

fn path(endpoint: &str) -> EndpointPath {
    endpoint.parse().expect("endpoint path")
}

fn endpoint_json(endpoint: &str) -> Value {
    let path = path(endpoint);
    json!({"namespace": path.namespace(), "component": path.component(), "name": path.endpoint()})
}

/// The `card_json` of a base card as vLLM registers it (dynamo-live §9.1), aggregated.
fn card(model: &str) -> Value {
    json!({
        "display_name": model,
        "slug": model,
        "source_path": format!("/tmp/dynlive/models/{model}"),
        "kv_cache_block_size": 16,
        "context_length": 8192,
        "model_type": "Chat | Completions",
        "model_input": "Tokens",
        "worker_type": "aggregated",
        "needs": [],
        "runtime_config": {
            "total_kv_blocks": 16384,
            "max_num_seqs": 256,
            "max_num_batched_tokens": 8192,
            "data_parallel_start_rank": 0,
            "data_parallel_size": 1,
            "enable_local_indexer": false,
            "kv_event_publishing_enabled": true,
            "enable_eagle": false
        },
        "migration_limit": 0
    })
}

/// A base card with a role and needs (dc-inputs §7).
fn typed_card(model: &str, worker_type: &str, needs: Value, model_type: &str) -> Value {
    let mut card = card(model);
    card["worker_type"] = json!(worker_type);
    card["needs"] = needs;
    card["model_type"] = json!(model_type);
    card
}

/// A legacy card: no `worker_type`.
fn legacy_card(model: &str) -> Value {
    let mut card = card(model);
    card.as_object_mut().expect("card object").remove("worker_type");
    card
}

/// An adapter card on a base worker (dc-inputs §1.4): base source path, minimal runtime
/// config without capacity.
fn adapter_card(adapter: &str, base_model: &str) -> Value {
    json!({
        "display_name": adapter,
        "slug": adapter,
        "source_path": format!("/tmp/dynlive/models/{base_model}"),
        "kv_cache_block_size": 16,
        "context_length": 8192,
        "model_type": "Chat | Completions",
        "model_input": "Tokens",
        "worker_type": "aggregated",
        "needs": [],
        "lora": {"name": adapter, "max_gpu_lora_count": 4},
        "runtime_config": {
            "data_parallel_start_rank": 0,
            "data_parallel_size": 1,
            "context_length": 8192,
            "kv_event_publishing_enabled": true
        },
        "user_data": {"lora_adapter": true, "lora_id": 1}
    })
}

/// A `v1/mdc/...` Model record, decoded by the relay's discovery decoder.
fn model(endpoint: &str, instance_id: u64, suffix: Option<&str>, card: Value) -> DcInput {
    let path = path(endpoint);
    let mut record = json!({
        "type": "Model",
        "namespace": path.namespace(),
        "component": path.component(),
        "endpoint": path.endpoint(),
        "instance_id": instance_id,
        "card_json": card
    });
    if let Some(suffix) = suffix {
        record["model_suffix"] = json!(suffix);
    }
    match decode_discovery_record(record.to_string().as_bytes()).expect("model record") {
        DiscoveryRecord::Model(model) => {
            DcInput::CardUpserted { id: model.id, card: Box::new(model.card) }
        }
        other => panic!("not a model record: {other:?}"),
    }
}

/// A `v1/event_sources/...` record of a live-only publisher (no local indexer), decoded.
fn event_source(endpoint: &str, worker_id: u64, dp_rank: u32, publisher_id: u64) -> DcInput {
    let record = json!({
        "type": "EventSource",
        "scope": {"kind": "endpoint", "endpoint": endpoint_json(endpoint)},
        "topic": "kv-events",
        "publisher_id": publisher_id,
        "metadata": {
            "kv_state_endpoint": endpoint_json(endpoint),
            "worker": {"worker_id": worker_id, "dp_rank": dp_rank},
            "publisher_id": publisher_id
        }
    });
    match decode_discovery_record(record.to_string().as_bytes()).expect("event source record") {
        DiscoveryRecord::EventSource(source) => {
            DcInput::SourceAdvertised(source.advert.expect("kv-events advertisement"))
        }
        other => panic!("not an event source record: {other:?}"),
    }
}

/// A worker's `kv_metrics` report (`ActiveLoad`).
fn kv_metrics(endpoint: &str, worker_id: u64, dp_rank: u32, kv_used_blocks: u64) -> DcInput {
    DcInput::Load {
        endpoint: path(endpoint),
        observation: LoadObservation {
            source: SourceKey { worker_id, dp_rank },
            kv_used_blocks: Some(kv_used_blocks),
            active_decode_blocks: Some(0),
            active_prefill_tokens: Some(0),
        },
    }
}

// ---- the data center around one relay -------------------------------------------------------

/// One relay, its shell, and the instance listings the endpoint watches would deliver.
struct Dc {
    plane: ControlPlane,
    rng: RelayRng,
    now: Duration,
    live: BTreeMap<String, BTreeSet<u64>>,
}

impl Dc {
    fn new() -> Self {
        let relay = RelayIdentity::start(
            DRT_INSTANCE_ID,
            &mut rng_from_seed(derive_seed(SEED, "relay-incarnation")),
        );
        let config = ControlConfig::new(
            relay,
            stable_dc_id("dc-a").expect("dc id"),
            DiscoveryScope::watch_all(Vec::new()).expect("scope"),
        );
        Dc {
            plane: ControlPlane::new(config).expect("control plane"),
            rng: rng_from_seed(derive_seed(SEED, "control")),
            now: Duration::ZERO,
            live: BTreeMap::new(),
        }
    }

    /// Feed one input, one millisecond after the previous, and carry out what it causes.
    fn input(&mut self, input: DcInput) {
        self.now += Duration::from_millis(1);
        let commands = self.plane.handle(input, self.now, &mut self.rng);
        self.execute(commands);
    }

    /// The shell: every pool starts successfully; source commands and publications need no
    /// answer here.
    fn execute(&mut self, commands: Vec<ControlCommand>) {
        let mut queue = VecDeque::from(commands);
        while let Some(command) = queue.pop_front() {
            if let ControlCommand::Host(HostCommand::StartPool { endpoint, producer, .. }) =
                &command
            {
                queue.extend(self.plane.start_succeeded(
                    endpoint,
                    producer.layout_generation(),
                    self.now,
                    &mut self.rng,
                ));
            }
        }
        self.plane.check_invariants().expect("control plane invariants");
    }

    fn listing(&mut self, endpoint: &str) {
        let live_workers = self.live.get(endpoint).cloned().unwrap_or_default();
        self.input(DcInput::Instances(EndpointInstances {
            endpoint: path(endpoint),
            live_workers: Some(live_workers),
        }));
    }

    /// A worker process starting, in the order a Dynamo worker emits (dc-inputs §8): its
    /// endpoint instance, its base card, then one event source per DP rank it publishes.
    fn worker(&mut self, endpoint: &str, instance_id: u64, card: Value, publishers: &[u64]) {
        self.live.entry(endpoint.to_owned()).or_default().insert(instance_id);
        self.listing(endpoint);
        self.input(model(endpoint, instance_id, None, card));
        for (dp_rank, publisher_id) in (0u32..).zip(publishers) {
            self.input(event_source(endpoint, instance_id, dp_rank, *publisher_id));
        }
    }

    /// The endpoint watch no longer lists the worker (the process died; its records linger).
    fn instance_gone(&mut self, endpoint: &str, instance_id: u64) {
        if let Some(live) = self.live.get_mut(endpoint) {
            live.remove(&instance_id);
        }
        self.listing(endpoint);
    }

    fn producer(&self, endpoint: &str) -> ProducerIdentity {
        self.plane.active_producer(&path(endpoint)).expect("active pool")
    }

    /// Everything a WAN consumer could observe now, plus the host's view of each endpoint.
    fn published(&mut self) -> Published {
        let window = self.plane.load_window(OBSERVED_MS).expect("load window");
        let health = self.plane.health();
        Published {
            catalog: KvPoolCatalogView::from(&self.plane.catalog_snapshot()),
            readiness: ServingReadinessView::from(&self.plane.topology_snapshot()),
            load: KvPoolLoadView::from(&window),
            slots: self
                .plane
                .host()
                .slots()
                .into_iter()
                .map(|slot| SlotView {
                    endpoint: slot.endpoint.to_string(),
                    lifecycle: slot.lifecycle,
                    fence: slot.fence,
                })
                .collect(),
            conflicts: self
                .plane
                .discovery()
                .memberships()
                .values()
                .filter(|membership| !membership.conflicts.is_empty())
                .map(|membership| EndpointConflicts {
                    endpoint: membership.endpoint.to_string(),
                    conflicts: membership.conflicts.clone(),
                })
                .collect(),
            healthy: health.healthy,
        }
    }
}

#[derive(Debug, Serialize)]
struct SlotView {
    endpoint: String,
    lifecycle: SlotLifecycle,
    fence: Option<SlotFence>,
}

#[derive(Debug, Serialize)]
struct EndpointConflicts {
    endpoint: String,
    conflicts: Vec<MaterializationConflict>,
}

/// One snapshot: the three published streams, then why each endpoint is (not) published: the
/// host's slots, the discovery conflicts and the plane's health.
#[derive(Debug, Serialize)]
struct Published {
    catalog: KvPoolCatalogView,
    readiness: ServingReadinessView,
    load: KvPoolLoadView,
    slots: Vec<SlotView>,
    conflicts: Vec<EndpointConflicts>,
    healthy: bool,
}

fn snapshot(name: &str, description: &str, published: &Published) {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../../../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.set_sort_maps(true);
    settings.set_omit_expression(true);
    settings.set_description(description);
    settings.bind(|| insta::assert_yaml_snapshot!(name, published));
}

fn entry<'a>(
    published: &'a Published,
    model: &str,
) -> &'a kvrelay_core::control::wire::TopologyEntryView {
    published
        .readiness
        .entries
        .iter()
        .find(|entry| entry.canonical_model_id == model)
        .expect("topology entry")
}

fn state(state: ReadinessState) -> &'static str {
    kvrelay_core::control::wire::readiness_state_name(state)
}

// ---- deployment shapes ---------------------------------------------------------------------

/// P/D: decode at `backend`, prefill at `prefill`, both publishing KV and reporting load.
fn pd_ready(dc: &mut Dc) {
    dc.worker(
        PREFILL,
        WORKER_B,
        typed_card("tiny-llm", "prefill", json!([["decode"]]), "Prefill"),
        &[PUBLISHER_B],
    );
    dc.worker(
        BACKEND,
        WORKER_A,
        typed_card("tiny-llm", "decode", json!([["prefill"]]), "Chat | Completions"),
        &[PUBLISHER_A],
    );
    dc.input(kv_metrics(PREFILL, WORKER_B, 0, 120));
    dc.input(kv_metrics(BACKEND, WORKER_A, 0, 600));
}

#[test]
fn aggregated() {
    let mut dc = Dc::new();
    dc.worker(BACKEND, WORKER_A, card("tiny-llm"), &[PUBLISHER_A]);
    dc.input(kv_metrics(BACKEND, WORKER_A, 0, 600));
    let published = dc.published();

    // The pool's identity is the derivation for the card's source path and endpoint; it matches
    // what the live relay published for the same card (dynamo-live §5, base64 there).
    let domain = resolve_indexer_domain(
        "/tmp/dynlive/models/tiny-llm",
        16,
        HashFormat::StandardV1,
        &path(BACKEND),
        None,
    )
    .expect("domain");
    let pool = &published.catalog.pools[0];
    let domain_view = &pool.producer.pool_id.indexer_domain;
    assert_eq!(domain_view.cache_semantics.digest, domain.cache_semantics.to_string());
    assert_eq!(domain_view.cache_semantics.digest, "3913b5f8dc186d51f414ef5a3cb316bb");
    assert_eq!(domain_view.routing_scope.digest, "bf990b97a0d02302c97c92a8cbc51188");
    assert_eq!(pool.producer.pool_id.dc_id, 0x04f1_10c9_8b1b_fc48);
    assert_eq!(pool.producer.producer_incarnation, dc.plane.relay().relay_incarnation);
    assert_eq!(pool.producer.layout_generation, 1);
    assert_eq!(pool.producer.ckf_format.bucket_count, 524_288);
    assert_eq!(pool.producer.ckf_format.fingerprint_bits, 16);
    assert_eq!(published.catalog.revision, 1);
    assert_eq!(entry(&published, "tiny-llm").state, state(ReadinessState::Ready));
    let load = &published.load.pools[0];
    assert_eq!((load.kv_used_blocks, load.total_kv_blocks), (600, 16_384));

    snapshot(
        "aggregated",
        "one aggregated worker at dynamo/backend/generate with a live-only KV source and one \
         kv_metrics report: one pool [AGGREGATED], READY, load 600/16384 over 1/1 ranks",
        &published,
    );
}

#[test]
fn pd_ready_has_two_pools_and_one_ready_entry() {
    let mut dc = Dc::new();
    pd_ready(&mut dc);
    let published = dc.published();

    assert_eq!(published.catalog.pools.len(), 2);
    let ready = entry(&published, "tiny-llm");
    assert_eq!(ready.state, state(ReadinessState::Ready));
    assert_eq!(ready.present_roles, ["WORKER_ROLE_PREFILL", "WORKER_ROLE_DECODE"]);
    assert!(ready.members.iter().all(|member| member.pool_id.is_some()));
    // Same model and block size: equal cache semantics; distinct endpoints: distinct scopes.
    let [first, second] = [&published.catalog.pools[0], &published.catalog.pools[1]];
    let domains = [&first.producer.pool_id.indexer_domain, &second.producer.pool_id.indexer_domain];
    assert_eq!(domains[0].cache_semantics, domains[1].cache_semantics);
    assert_ne!(domains[0].routing_scope, domains[1].routing_scope);

    snapshot(
        "pd_ready",
        "prefill at dynamo/prefill/generate and decode at dynamo/backend/generate, each with a \
         KV source: two pools, one READY entry with present [PREFILL, DECODE], both members linked",
        &published,
    );
}

#[test]
fn pd_decode_instance_gone() {
    let mut dc = Dc::new();
    pd_ready(&mut dc);
    dc.instance_gone(BACKEND, WORKER_A);
    let published = dc.published();

    assert_eq!(published.catalog.pools.len(), 1);
    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Unavailable));
    assert_eq!(entry.missing_roles, ["WORKER_ROLE_DECODE"]);

    snapshot(
        "pd_decode_instance_gone",
        "P/D after the decode instance left the endpoint watch while its card and source \
         advertisement linger: the decode pool is withdrawn (no live worker, so no expected rank \
         with an active source), the decode endpoint stays a member without a pool, and the \
         entry is UNAVAILABLE with missing [DECODE]",
        &published,
    );
}

#[test]
fn pd_decode_unregistered() {
    let mut dc = Dc::new();
    pd_ready(&mut dc);
    dc.instance_gone(BACKEND, WORKER_A);
    dc.input(DcInput::CardRemoved {
        id: kvrelay_core::inputs::CardInstanceId {
            endpoint: path(BACKEND),
            instance_id: WORKER_A,
            model_suffix: None,
        },
    });
    dc.input(DcInput::SourceWithdrawn {
        kv_state_endpoint: path(BACKEND),
        publisher_id: PUBLISHER_A,
    });
    let published = dc.published();

    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Unavailable));
    assert_eq!(entry.present_roles, ["WORKER_ROLE_PREFILL"]);
    assert_eq!(entry.missing_roles, ["WORKER_ROLE_DECODE"]);
    assert_eq!(entry.members.len(), 1);

    snapshot(
        "pd_decode_unregistered",
        "P/D after the decode worker unregistered (instance, card and source gone): only the \
         prefill pool is published and the entry is UNAVAILABLE with present [PREFILL], missing \
         [DECODE], prefill the only member",
        &published,
    );
}

/// EPD: an encode worker (no KV publisher) in front of a P/D pair.
fn epd(dc: &mut Dc) {
    pd_ready(dc);
    dc.worker(
        ENCODE,
        WORKER_C,
        typed_card("tiny-llm", "encode", json!([["prefill", "decode"], ["aggregated"]]), ""),
        &[],
    );
}

#[test]
fn epd_encode_member_without_pool() {
    let mut dc = Dc::new();
    epd(&mut dc);
    let published = dc.published();

    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Ready));
    let encode = entry
        .members
        .iter()
        .find(|member| member.endpoint.component == "encode")
        .expect("encode member");
    assert_eq!(encode.pool_id, None);
    assert_eq!(published.catalog.pools.len(), 2);

    snapshot(
        "epd_encode_member_without_pool",
        "EPD: encode at dynamo/encode/generate needs [[PREFILL, DECODE], [AGGREGATED]] and never \
         advertises a KV source: it is a topology member without a pool and never in the \
         catalog; the entry is READY with present [PREFILL, DECODE, ENCODE]",
        &published,
    );
}

#[test]
fn epd_encode_dead() {
    let mut dc = Dc::new();
    epd(&mut dc);
    dc.instance_gone(ENCODE, WORKER_C);
    let published = dc.published();

    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Unavailable));
    assert_eq!(entry.missing_roles, ["WORKER_ROLE_ENCODE"]);

    snapshot(
        "epd_encode_dead",
        "EPD after the encode instance left: the P/D pools stay published, the entry is \
         UNAVAILABLE with missing [ENCODE]",
        &published,
    );
}

#[test]
fn lora_aliases_and_adapters() {
    let mut dc = Dc::new();
    let mut base = card("base-llm");
    base["aliases"] = json!(["base-alias"]);
    dc.worker(LORAS, WORKER_A, base, &[PUBLISHER_A]);
    for adapter in ["adapter-a", "adapter-b"] {
        dc.input(model(LORAS, WORKER_A, Some(adapter), adapter_card(adapter, "base-llm")));
    }
    let published = dc.published();

    let pool = &published.catalog.pools[0];
    let ids: Vec<&str> = pool.registrations.iter().map(|r| r.canonical_model_id.as_str()).collect();
    assert_eq!(ids, ["adapter-a", "adapter-b", "base-llm"]);
    assert_eq!(pool.registrations[2].aliases, ["base-alias"]);
    let entry = entry(&published, "base-llm");
    assert_eq!(entry.adapters.len(), 2);
    assert!(entry.adapters.iter().all(|a| a.state == state(ReadinessState::Ready)));

    snapshot(
        "lora_aliases_and_adapters",
        "one aggregated worker in namespace loras serving base-llm (alias base-alias) and LoRA \
         adapters adapter-a and adapter-b: one pool with three registrations sorted by id, one \
         READY entry with both adapters READY",
        &published,
    );
}

#[test]
fn federated_alias_collision() {
    let mut dc = Dc::new();
    let mut model_a = card("model-a");
    model_a["aliases"] = json!(["shared", "alias-a"]);
    let mut model_b = card("model-b");
    model_b["aliases"] = json!(["shared"]);
    dc.worker(BACKEND, WORKER_A, model_a, &[PUBLISHER_A]);
    dc.worker(OTHER, WORKER_B, model_b, &[PUBLISHER_B]);
    let published = dc.published();

    let aliases: Vec<&Vec<String>> = published
        .catalog
        .pools
        .iter()
        .flat_map(|pool| pool.registrations.iter().map(|r| &r.aliases))
        .collect();
    assert!(aliases.iter().all(|aliases| !aliases.contains(&"shared".to_owned())));
    assert!(aliases.iter().any(|aliases| aliases.contains(&"alias-a".to_owned())));

    snapshot(
        "federated_alias_collision",
        "model-a (aliases shared, alias-a) and model-b (alias shared) on two endpoints: the \
         ambiguous alias shared is omitted from both pools, alias-a is kept; both pools and \
         both entries are published",
        &published,
    );
}

#[test]
fn legacy_only() {
    let mut dc = Dc::new();
    dc.worker(BACKEND, WORKER_A, legacy_card("tiny-llm"), &[PUBLISHER_A]);
    let published = dc.published();

    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Ready));
    assert!(entry.legacy_fallback_active);
    assert!(entry.missing_roles.is_empty());

    snapshot(
        "legacy_only",
        "one worker whose card has no worker_type: pool role [LEGACY], READY with \
         legacy_fallback_active and nothing missing",
        &published,
    );
}

#[test]
fn mixed_legacy_and_typed() {
    let mut dc = Dc::new();
    dc.worker(
        PREFILL,
        WORKER_B,
        typed_card("tiny-llm", "prefill", json!([["decode"]]), "Prefill"),
        &[PUBLISHER_B],
    );
    dc.worker(BACKEND, WORKER_A, legacy_card("tiny-llm"), &[PUBLISHER_A]);
    let published = dc.published();

    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.state, state(ReadinessState::Ready));
    assert!(entry.legacy_fallback_active);
    assert!(entry.missing_roles.is_empty());

    snapshot(
        "mixed_legacy_and_typed",
        "a typed prefill worker (needing decode) beside a legacy worker for the same model: \
         strict gating is off, so the entry is READY with legacy_fallback_active and nothing \
         missing although no decode exists; two pools",
        &published,
    );
}

#[test]
fn standard_and_eagle_on_one_endpoint() {
    let mut dc = Dc::new();
    let mut eagle = card("tiny-llm");
    eagle["runtime_config"]["enable_eagle"] = json!(true);
    dc.worker(BACKEND, WORKER_A, card("tiny-llm"), &[PUBLISHER_A]);
    dc.worker(BACKEND, WORKER_B, eagle, &[PUBLISHER_B]);
    let published = dc.published();

    assert!(published.catalog.pools.is_empty());
    assert!(!published.healthy);
    assert_eq!(entry(&published, "tiny-llm").state, state(ReadinessState::Ready));

    snapshot(
        "standard_and_eagle_on_one_endpoint",
        "a standard and an Eagle worker on one endpoint resolve to two indexer domains: the \
         endpoint is fenced (no pool, unhealthy) but stays a READY topology member without a pool",
        &published,
    );
}

#[test]
fn two_base_models_on_one_endpoint() {
    let mut dc = Dc::new();
    dc.worker(BACKEND, WORKER_A, card("model-a"), &[PUBLISHER_A]);
    dc.worker(BACKEND, WORKER_B, card("model-b"), &[PUBLISHER_B]);
    let published = dc.published();

    assert!(published.catalog.pools.is_empty());
    assert!(published.readiness.entries.is_empty());

    snapshot(
        "two_base_models_on_one_endpoint",
        "two workers on one endpoint serving different base models: a serving-topology \
         conflict fences the endpoint (no pool, unhealthy) and removes it from the topology",
        &published,
    );
}

#[test]
fn two_endpoints_claiming_one_pool_id() {
    let mut dc = Dc::new();
    let explicit = |model: &str| {
        let mut card = card(model);
        card["indexer_identity"] = json!({
            "semantics": {"model": "tiny-llm", "revision": "r1"},
            "routing_scope": {"pool": "shared-pool"}
        });
        card
    };
    dc.worker(BACKEND, WORKER_A, explicit("tiny-llm"), &[PUBLISHER_A]);
    dc.worker(OTHER, WORKER_B, explicit("tiny-llm"), &[PUBLISHER_B]);
    let published = dc.published();

    assert!(published.catalog.pools.is_empty());
    let entry = entry(&published, "tiny-llm");
    assert_eq!(entry.members.len(), 2);
    assert!(entry.members.iter().all(|member| member.pool_id.is_none()));
    assert!(published.slots.iter().all(|slot| slot.lifecycle == SlotLifecycle::Fenced));

    snapshot(
        "two_endpoints_claiming_one_pool_id",
        "two endpoints with the same explicit indexer identity derive one PoolId: both are \
         fenced (never merged, no pool, unhealthy) and stay READY topology members without a pool",
        &published,
    );
}

#[test]
fn zero_block_size() {
    let mut dc = Dc::new();
    let mut zero = card("tiny-llm");
    zero["kv_cache_block_size"] = json!(0);
    dc.worker(BACKEND, WORKER_A, zero, &[PUBLISHER_A]);
    let published = dc.published();

    assert!(published.catalog.pools.is_empty());
    assert_eq!(entry(&published, "tiny-llm").state, state(ReadinessState::Ready));

    snapshot(
        "zero_block_size",
        "a card with kv_cache_block_size 0 has no queryable domain: no pool is materialized \
         (the slot is fenced because a KV source is active), but the endpoint stays in the \
         topology with its registration and worker",
        &published,
    );
}

/// One worker owning DP ranks 0 and 1, one publisher per rank, `total_kv_blocks` per rank.
fn dp2(dc: &mut Dc, total_kv_blocks: u64) {
    let mut card = card("tiny-llm");
    card["runtime_config"]["data_parallel_size"] = json!(2);
    card["runtime_config"]["total_kv_blocks"] = json!(total_kv_blocks);
    dc.worker(BACKEND, WORKER_A, card, &[PUBLISHER_A, PUBLISHER_C]);
}

#[test]
fn dp2_coverage_complete() {
    let mut dc = Dc::new();
    dp2(&mut dc, 16_384);
    dc.input(kv_metrics(BACKEND, WORKER_A, 0, 40));
    dc.input(kv_metrics(BACKEND, WORKER_A, 1, 36));
    let published = dc.published();

    let load = &published.load.pools[0];
    assert_eq!(
        (load.kv_used_blocks, load.total_kv_blocks, load.kv_observed_ranks, load.kv_expected_ranks),
        (76, 32_768, 2, 2)
    );

    snapshot(
        "dp2_coverage_complete",
        "one worker with data_parallel_size 2 (16384 blocks per rank), both ranks reporting: \
         used 76 = 40 + 36, total 32768, observed 2 of expected 2",
        &published,
    );
}

#[test]
fn dp2_coverage_partial() {
    let mut dc = Dc::new();
    dp2(&mut dc, 16_384);
    dc.input(kv_metrics(BACKEND, WORKER_A, 0, 40));
    let published = dc.published();

    let load = &published.load.pools[0];
    assert_eq!(
        (load.kv_used_blocks, load.total_kv_blocks, load.kv_observed_ranks, load.kv_expected_ranks),
        (0, 32_768, 1, 2)
    );

    snapshot(
        "dp2_coverage_partial",
        "DP=2 with only rank 0 reporting: kv_used_blocks unset (0 on the wire), never a partial \
         sum; observed 1 of expected 2 tells the consumer coverage is incomplete",
        &published,
    );
}

#[test]
fn ray_dp_zero_capacity() {
    let mut dc = Dc::new();
    dp2(&mut dc, 0);
    dc.input(kv_metrics(BACKEND, WORKER_A, 0, 40));
    dc.input(kv_metrics(BACKEND, WORKER_A, 1, 36));
    let published = dc.published();

    let load = &published.load.pools[0];
    assert_eq!((load.kv_used_blocks, load.total_kv_blocks), (76, 0));

    snapshot(
        "ray_dp_zero_capacity",
        "DP=2 under vLLM's Ray backend advertises total_kv_blocks 0, the unknown-capacity \
         sentinel: occupancy is complete (76 over 2 of 2 ranks) but total_kv_blocks stays 0 \
         (unknown, never zero capacity)",
        &published,
    );
}

#[test]
fn alias_change_keeps_the_producer() {
    let mut dc = Dc::new();
    dc.worker(BACKEND, WORKER_A, card("tiny-llm"), &[PUBLISHER_A]);
    let before = dc.producer(BACKEND);
    let mut aliased = card("tiny-llm");
    aliased["aliases"] = json!(["tiny"]);
    dc.input(model(BACKEND, WORKER_A, None, aliased));
    let published = dc.published();

    assert_eq!(dc.producer(BACKEND), before);
    assert_eq!(published.catalog.revision, 2);
    assert_eq!(published.catalog.pools[0].registrations[0].aliases, ["tiny"]);

    snapshot(
        "alias_change_keeps_the_producer",
        "an aggregated pool whose card gained the alias tiny: the descriptor is refreshed in \
         place under the same producer (layout generation 1) at catalog revision 2",
        &published,
    );
}
