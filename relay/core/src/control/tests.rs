//! Behaviour of the composed control plane: a worker coming up and leaving, sources arriving
//! late, events and load routed to the right pool, recovery answers passed through, retries and
//! shutdown.
//!
//! A [`Shell`] plays the async host: it records every command, answers `StartPool` with success
//! (or failure, when told), and checks the plane's invariants after every call.

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;
use crate::discovery::DiscoveryScope;
use crate::host::{HostCommand, RetireReason, SlotLifecycle};
use crate::inputs::{
    CardInstanceId, DcInput, EndpointInstances, KvEventBatch, KvEventSourceAdvert, LoadObservation,
    ModelCard, ModelInput, ModelTypeFlags, RecoveryTarget, RequestPlaneTransport, RuntimeConfig,
    WorkerType,
};
use crate::model::hashing::HashFormat;
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::identity::{EndpointPath, RelayIdentity, resolve_indexer_domain, stable_dc_id};
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, SourceKey, StorageTier, StoreData, StoredBlock,
};
use crate::pool::{ApplyError, PoolFault};
use crate::readiness::ReadinessState;
use crate::rng::{RelayRng, rng_from_seed};
use crate::sources::{
    RECOVERY_ATTEMPTS_MAX, RankFence, RecoveryRequestId, RecoveryResponse, ResetReason,
    SourceCommand, SourceTracker, TreeDumpScope,
};

pub(crate) const BACKEND: &str = "dynamo/backend/generate";
const PREFILL: &str = "dynamo/prefill/generate";
pub(crate) const MODEL: &str = "tiny-llm";
pub(crate) const WORKER: u64 = 0xc068_c014_57d2_3c43;
const PREFILL_WORKER: u64 = 0x51;
pub(crate) const PUBLISHER: u64 = 0x1a_0878_c30c_67ae;
const PREFILL_PUBLISHER: u64 = 0x52;

pub(crate) fn endpoint(path: &str) -> EndpointPath {
    path.parse().unwrap()
}

pub(crate) fn card(worker_type: WorkerType, needs: Vec<Vec<WorkerType>>) -> ModelCard {
    ModelCard {
        display_name: MODEL.to_owned(),
        aliases: Vec::new(),
        source_path: Some("/tmp/dynlive/models/tiny-llm".to_owned()),
        model_type: ModelTypeFlags(ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS),
        model_input: Some(ModelInput::Tokens),
        kv_cache_block_size: 16,
        worker_type: Some(worker_type),
        needs,
        lora: None,
        indexer_identity: None,
        runtime_config: RuntimeConfig {
            total_kv_blocks: Some(16_384),
            enable_local_indexer: false,
            ..RuntimeConfig::default()
        },
    }
}

pub(crate) fn card_input(path: &str, worker_id: u64, card: ModelCard) -> DcInput {
    DcInput::CardUpserted {
        id: CardInstanceId { endpoint: endpoint(path), instance_id: worker_id, model_suffix: None },
        card: Box::new(card),
    }
}

pub(crate) fn instances(path: &str, workers: &[u64]) -> DcInput {
    DcInput::Instances(EndpointInstances {
        endpoint: endpoint(path),
        live_workers: Some(workers.iter().copied().collect()),
    })
}

pub(crate) fn advert(path: &str, worker_id: u64, publisher_id: u64, recoverable: bool) -> DcInput {
    let recovery_target = recoverable.then(|| RecoveryTarget {
        endpoint: endpoint(&format!("dynamo/backend/worker_kv_query_source_{publisher_id:x}")),
        instance_id: worker_id,
        transport: RequestPlaneTransport::Tcp("127.0.0.1:39685/x".to_owned()),
    });
    DcInput::SourceAdvertised(KvEventSourceAdvert {
        kv_state_endpoint: endpoint(path),
        source: SourceKey { worker_id, dp_rank: 0 },
        publisher_id,
        recovery_target,
    })
}

fn cleared(worker_id: u64, event_id: u64) -> RouterEvent {
    RouterEvent {
        worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: 0, data: KvCacheEventData::Cleared },
    }
}

pub(crate) fn stored(worker_id: u64, event_id: u64, block: u64) -> RouterEvent {
    RouterEvent {
        worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(block),
                    tokens_hash: LocalBlockHash(block ^ 0x5555),
                }],
            }),
        },
    }
}

pub(crate) fn events(path: &str, publisher_id: u64, events: Vec<RouterEvent>) -> DcInput {
    DcInput::KvEvents(KvEventBatch {
        endpoint: endpoint(path),
        publisher_id,
        sequence: 0,
        published_at_ms: 1_796_038_252_716,
        events,
    })
}

fn load(path: &str, worker_id: u64, used: Option<u64>) -> DcInput {
    DcInput::Load {
        endpoint: endpoint(path),
        observation: LoadObservation {
            source: SourceKey { worker_id, dp_rank: 0 },
            kv_used_blocks: used,
            active_decode_blocks: None,
            active_prefill_tokens: None,
        },
    }
}

pub(crate) fn relay() -> RelayIdentity {
    RelayIdentity::start(0x1111, &mut rng_from_seed(7))
}

/// The async host, played synchronously.
struct Shell {
    plane: ControlPlane,
    rng: RelayRng,
    now: Duration,
    /// Every command, in execution order.
    log: Vec<ControlCommand>,
    /// Answer `StartPool` with a failure instead of a success.
    fail_starts: bool,
}

impl Shell {
    fn new() -> Self {
        Shell::with_config(ControlConfig::new(
            relay(),
            stable_dc_id("dc-a").unwrap(),
            DiscoveryScope::watch_all(Vec::new()).unwrap(),
        ))
    }

    fn with_config(config: ControlConfig) -> Self {
        Shell {
            plane: ControlPlane::new(config).unwrap(),
            rng: rng_from_seed(11),
            now: Duration::ZERO,
            log: Vec::new(),
            fail_starts: false,
        }
    }

    /// Feed one input and carry out everything it causes; returns the commands it caused.
    fn input(&mut self, input: DcInput) -> Vec<ControlCommand> {
        let commands = self.plane.handle(input, self.now, &mut self.rng);
        self.execute(commands)
    }

    fn timeout(&mut self) -> Vec<ControlCommand> {
        let commands = self.plane.handle_timeout(self.now, &mut self.rng);
        self.execute(commands)
    }

    fn execute(&mut self, commands: Vec<ControlCommand>) -> Vec<ControlCommand> {
        let mut executed = Vec::new();
        let mut queue = std::collections::VecDeque::from(commands);
        while let Some(command) = queue.pop_front() {
            self.plane.check_invariants().unwrap();
            let follow_up = match &command {
                ControlCommand::Host(HostCommand::StartPool { endpoint, producer, .. }) => {
                    let generation = producer.layout_generation();
                    if self.fail_starts {
                        self.plane.start_failed(endpoint, generation, self.now, &mut self.rng)
                    } else {
                        self.plane.start_succeeded(endpoint, generation, self.now, &mut self.rng)
                    }
                }
                _ => Vec::new(),
            };
            executed.push(command.clone());
            self.log.push(command);
            // Outcomes are reported after the command finished, so their commands follow
            // everything already queued by the same call.
            queue.extend(follow_up);
        }
        self.plane.check_invariants().unwrap();
        executed
    }

    /// An aggregated worker at `BACKEND` with a live-only source, fully up.
    fn aggregated_up(&mut self) -> Vec<ControlCommand> {
        let mut commands = self.input(instances(BACKEND, &[WORKER]));
        commands.extend(self.input(card_input(
            BACKEND,
            WORKER,
            card(WorkerType::Aggregated, vec![]),
        )));
        commands.extend(self.input(advert(BACKEND, WORKER, PUBLISHER, false)));
        commands
    }

    fn producer(&self, path: &str) -> crate::model::identity::ProducerIdentity {
        self.plane.active_producer(&endpoint(path)).expect("active pool")
    }
}

fn position(commands: &[ControlCommand], wanted: impl Fn(&ControlCommand) -> bool) -> usize {
    commands.iter().position(wanted).expect("command present")
}

fn is_host(command: &ControlCommand, wanted: fn(&HostCommand) -> bool) -> bool {
    matches!(command, ControlCommand::Host(host) if wanted(host))
}

#[test]
fn aggregated_worker_comes_up_published_ready_and_tracked() {
    let mut shell = Shell::new();
    let commands = shell.aggregated_up();

    // The advert opened the gate: start, then (on success) publish catalog revision 1.
    let start = position(&commands, |c| is_host(c, |h| matches!(h, HostCommand::StartPool { .. })));
    let publish = position(&commands, |c| {
        is_host(c, |h| matches!(h, HostCommand::PublishCatalog { revision: 1 }))
    });
    assert!(start < publish);

    let catalog = shell.plane.catalog_snapshot();
    assert_eq!(catalog.revision, 1);
    assert_eq!(catalog.pools.len(), 1);
    let descriptor = &catalog.pools[0];
    assert_eq!(descriptor.serving_endpoint, endpoint(BACKEND));
    assert_eq!(descriptor.layout_generation(), 1);
    assert_eq!(descriptor.producer.producer_incarnation(), relay().relay_incarnation);
    let domain = resolve_indexer_domain(
        "/tmp/dynlive/models/tiny-llm",
        16,
        HashFormat::StandardV1,
        &endpoint(BACKEND),
        None,
    )
    .unwrap();
    assert_eq!(descriptor.pool_id().indexer_domain, domain);
    assert_eq!(descriptor.producer.format().bucket_count, 524_288);

    // The topology was published READY with the pool linked.
    let topology = shell.plane.topology_snapshot();
    let entry = &topology.entries[0];
    assert_eq!(entry.state, ReadinessState::Ready);
    assert_eq!(entry.members[0].pool_id, Some(descriptor.pool_id()));
    let last_topology = commands.iter().rev().find_map(|c| match c {
        ControlCommand::PublishTopology { revision } => Some(*revision),
        _ => None,
    });
    assert_eq!(last_topology, Some(topology.revision));

    // The tracker cold-reset the live-only rank when the generation became active.
    let reset = position(&commands, |c| {
        matches!(
            c,
            ControlCommand::Source {
                layout_generation: 1,
                command: SourceCommand::ResetRank { reason: ResetReason::Activated, .. },
                ..
            }
        )
    });
    assert!(publish < reset);

    // Events of the active incarnation reach the pool as ApplyEvents for generation 1.
    let applied = shell.input(events(BACKEND, PUBLISHER, vec![cleared(WORKER, 1)]));
    assert!(matches!(
        applied.as_slice(),
        [ControlCommand::Source {
            layout_generation: 1,
            command: SourceCommand::ResetRank { reason: ResetReason::Cleared, .. },
            ..
        }]
    ));
    assert_eq!(shell.plane.counters().kv_batches_routed, 1);
    assert!(shell.plane.health().healthy);
}

#[test]
fn worker_leaving_withdraws_before_it_stops_and_turns_unavailable() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let producer = shell.producer(BACKEND);

    let commands = shell.input(instances(BACKEND, &[]));
    let withdraw = position(&commands, |c| {
        is_host(c, |h| {
            matches!(h, HostCommand::WithdrawPool { reason: RetireReason::Dematerialized, .. })
        })
    });
    let publish = position(&commands, |c| {
        is_host(c, |h| matches!(h, HostCommand::PublishCatalog { revision: 2 }))
    });
    let stop = position(&commands, |c| is_host(c, |h| matches!(h, HostCommand::StopPool { .. })));
    let release =
        position(&commands, |c| is_host(c, |h| matches!(h, HostCommand::ReleasePool { .. })));
    assert!(withdraw < publish && publish < stop && stop < release);
    // No source command names the retired generation after its pool stopped.
    assert!(commands[stop..].iter().all(|c| !matches!(
        c,
        ControlCommand::Source { layout_generation, .. } if *layout_generation == producer.layout_generation()
    )));
    assert!(shell.plane.catalog_snapshot().pools.is_empty());
    assert!(shell.plane.active_producer(&endpoint(BACKEND)).is_none());
    assert!(shell.plane.load_window(1_000).unwrap().pools.is_empty());

    let entry = shell.plane.topology_snapshot().entries[0].clone();
    assert_eq!(entry.state, ReadinessState::Unavailable);
    assert_eq!(entry.members[0].pool_id, None);

    // Events of the departed worker are not routed anywhere.
    let commands = shell.input(events(BACKEND, PUBLISHER, vec![cleared(WORKER, 2)]));
    assert!(commands.is_empty());
    assert_eq!(shell.plane.counters().kv_batches_unrouted, 1);
}

#[test]
fn a_source_advert_after_the_card_materializes_the_pool() {
    let mut shell = Shell::new();
    shell.input(card_input(BACKEND, WORKER, card(WorkerType::Aggregated, vec![])));
    let commands = shell.input(instances(BACKEND, &[WORKER]));
    // Serving is ready, but without a KV source there is no pool (no phantom pools).
    assert!(!commands.iter().any(|c| matches!(c, ControlCommand::Host(_))));
    assert!(shell.plane.catalog_snapshot().pools.is_empty());
    let entry = shell.plane.topology_snapshot().entries[0].clone();
    assert_eq!(entry.state, ReadinessState::Ready);
    assert_eq!(entry.members[0].pool_id, None);
    assert_eq!(
        shell.plane.host().slot(&endpoint(BACKEND)).unwrap().lifecycle,
        SlotLifecycle::Discovered
    );

    let commands = shell.input(advert(BACKEND, WORKER, PUBLISHER, false));
    assert!(commands.iter().any(|c| is_host(c, |h| matches!(h, HostCommand::StartPool { .. }))));
    assert_eq!(shell.plane.catalog_snapshot().revision, 1);
    let entry = shell.plane.topology_snapshot().entries[0].clone();
    assert_eq!(entry.members[0].pool_id, Some(shell.producer(BACKEND).pool_id()));
    // A repeated advertisement changes nothing.
    assert!(shell.input(advert(BACKEND, WORKER, PUBLISHER, false)).is_empty());
    assert_eq!(shell.plane.counters().adverts_repeated, 1);
}

/// A worker publishes a rank's occupancy only when it changes, so a report that comes before
/// discovery shows the worker must not be lost: the latest one is recorded once the pool
/// expects the rank. A report kept longer than the age bound is not.
#[test]
fn a_load_report_before_discovery_is_recorded_once_its_rank_is_expected() {
    let mut shell = Shell::new();
    shell.input(load(PREFILL, PREFILL_WORKER, Some(600)));
    shell.input(load(PREFILL, PREFILL_WORKER, Some(640)));
    // A router report carries no occupancy: nothing to keep.
    shell.input(load(BACKEND, WORKER, None));
    // The decode worker's report comes long before its pool exists.
    shell.input(load(BACKEND, WORKER, Some(7)));
    assert_eq!(shell.plane.counters().load_reports_unrouted, 4);
    shell.now += super::early_loads::EARLY_LOAD_AGE_MAX;

    shell.input(instances(PREFILL, &[PREFILL_WORKER]));
    shell.input(card_input(
        PREFILL,
        PREFILL_WORKER,
        card(WorkerType::Prefill, vec![vec![WorkerType::Decode]]),
    ));
    shell.input(advert(PREFILL, PREFILL_WORKER, PREFILL_PUBLISHER, false));
    let prefill = shell.plane.pool_load(&endpoint(PREFILL)).unwrap();
    assert_eq!((prefill.kv_observed_ranks, prefill.kv_used_blocks), (1, Some(640)));

    shell.now += Duration::from_millis(1);
    shell.input(instances(BACKEND, &[WORKER]));
    shell.input(card_input(
        BACKEND,
        WORKER,
        card(WorkerType::Decode, vec![vec![WorkerType::Prefill]]),
    ));
    shell.input(advert(BACKEND, WORKER, PUBLISHER, false));
    let decode = shell.plane.pool_load(&endpoint(BACKEND)).unwrap();
    assert_eq!((decode.kv_observed_ranks, decode.kv_used_blocks), (0, None), "too old");
    let counters = *shell.plane.counters();
    assert_eq!(counters.early_load_reports_recorded, 1);
    assert_eq!(counters.load_reports_recorded, 0, "counted once, when it arrived");
    shell.plane.check_invariants().unwrap();
}

#[test]
fn a_report_for_a_rank_not_yet_in_its_pool_is_recorded_when_the_rank_joins_unless_interrupted() {
    const JOINING: u64 = 0x53;
    const LATE: u64 = 0x54;
    let prefill_card = || card(WorkerType::Prefill, vec![vec![WorkerType::Decode]]);
    let mut shell = Shell::new();
    shell.input(instances(PREFILL, &[PREFILL_WORKER]));
    shell.input(card_input(PREFILL, PREFILL_WORKER, prefill_card()));
    shell.input(advert(PREFILL, PREFILL_WORKER, PREFILL_PUBLISHER, false));
    shell.input(load(PREFILL, PREFILL_WORKER, Some(600)));
    // The pool exists; a worker it does not expect yet reports its only occupancy.
    shell.input(load(PREFILL, JOINING, Some(30)));
    assert_eq!(shell.plane.counters().load_reports_unknown_rank, 1);
    shell.now += Duration::from_millis(1);
    shell.input(instances(PREFILL, &[PREFILL_WORKER, JOINING]));
    shell.input(card_input(PREFILL, JOINING, prefill_card()));
    let pool = shell.plane.pool_load(&endpoint(PREFILL)).unwrap();
    assert_eq!((pool.kv_observed_ranks, pool.kv_used_blocks), (2, Some(630)), "{pool:?}");
    assert_eq!(shell.plane.counters().early_load_reports_recorded, 1);

    // Another one reports, then the pool's kv_metrics stream is interrupted: what came before
    // the gap proves nothing, and is not recorded when the worker joins.
    shell.input(load(PREFILL, LATE, Some(40)));
    let layout_generation = shell.producer(PREFILL).layout_generation();
    let interrupted =
        ShellReport::LoadStreamInterrupted { endpoint: endpoint(PREFILL), layout_generation };
    let commands = shell.plane.report(interrupted, shell.now, &mut shell.rng);
    shell.execute(commands);
    shell.input(instances(PREFILL, &[PREFILL_WORKER, JOINING, LATE]));
    shell.input(card_input(PREFILL, LATE, prefill_card()));
    let pool = shell.plane.pool_load(&endpoint(PREFILL)).unwrap();
    assert_eq!((pool.kv_observed_ranks, pool.kv_used_blocks), (0, None), "{pool:?}");
    let counters = *shell.plane.counters();
    assert_eq!((counters.early_load_reports_recorded, counters.load_streams_interrupted), (1, 1));
    shell.plane.check_invariants().unwrap();
}

#[test]
fn load_is_routed_to_the_pool_of_its_serving_endpoint() {
    let mut shell = Shell::new();
    shell.input(instances(BACKEND, &[WORKER]));
    shell.input(instances(PREFILL, &[PREFILL_WORKER]));
    shell.input(card_input(
        BACKEND,
        WORKER,
        card(WorkerType::Decode, vec![vec![WorkerType::Prefill]]),
    ));
    shell.input(card_input(
        PREFILL,
        PREFILL_WORKER,
        card(WorkerType::Prefill, vec![vec![WorkerType::Decode]]),
    ));
    shell.input(advert(BACKEND, WORKER, PUBLISHER, false));
    shell.input(advert(PREFILL, PREFILL_WORKER, PREFILL_PUBLISHER, false));
    assert_eq!(shell.plane.catalog_snapshot().pools.len(), 2);

    shell.input(load(PREFILL, PREFILL_WORKER, Some(600)));
    // The decode worker's id reported on the prefill subject is not a prefill rank.
    shell.input(load(PREFILL, WORKER, Some(5)));
    // A router report carries no occupancy.
    shell.input(load(BACKEND, WORKER, None));
    shell.input(load("dynamo/other/generate", WORKER, Some(1)));

    let prefill = shell.plane.pool_load(&endpoint(PREFILL)).unwrap();
    assert_eq!((prefill.kv_used_blocks, prefill.total_kv_blocks), (Some(600), Some(16_384)));
    let decode = shell.plane.pool_load(&endpoint(BACKEND)).unwrap();
    assert_eq!((decode.kv_observed_ranks, decode.kv_used_blocks), (0, None));
    let counters = *shell.plane.counters();
    assert_eq!(counters.load_reports_recorded, 1);
    assert_eq!(counters.load_reports_unknown_rank, 1);
    assert_eq!(counters.load_reports_advisory, 1);
    assert_eq!(counters.load_reports_unrouted, 1);

    let window = shell.plane.load_window(1_796_038_252_716).unwrap();
    assert_eq!(window.window_sequence, 1);
    assert_eq!(window.pools.len(), 2);
    let producers: BTreeSet<_> = window.pools.iter().map(|entry| entry.pool).collect();
    assert!(producers.contains(&shell.producer(PREFILL)));
    assert!(producers.contains(&shell.producer(BACKEND)));

    // The topology entry is READY with two members, each linked to its own pool.
    let entry = shell.plane.topology_snapshot().entries[0].clone();
    assert_eq!(entry.state, ReadinessState::Ready);
    assert!(entry.members.iter().all(|member| member.pool_id.is_some()));
    assert_ne!(entry.members[0].pool_id, entry.members[1].pool_id);
}

#[test]
fn events_published_under_another_scope_are_not_routed() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let commands = shell.input(events(PREFILL, PUBLISHER, vec![cleared(WORKER, 1)]));
    assert!(commands.is_empty());
    assert_eq!(shell.plane.counters().kv_batches_unrouted, 1);
}

#[test]
fn recovery_queries_and_answers_pass_through_the_pool_tracker() {
    let mut shell = Shell::new();
    shell.input(instances(BACKEND, &[WORKER]));
    let mut config = card(WorkerType::Aggregated, vec![]);
    config.runtime_config.enable_local_indexer = true;
    shell.input(card_input(BACKEND, WORKER, config));
    shell.input(advert(BACKEND, WORKER, PUBLISHER, true));
    let generation = shell.producer(BACKEND).layout_generation();

    // The tree dump is requested after the activation jitter.
    let due = shell.plane.poll_timeout().expect("recovery scheduled");
    shell.now = due;
    let commands = shell.timeout();
    let Some(ControlCommand::Source { command: SourceCommand::RequestRecovery(call), .. }) =
        commands.iter().find(|c| {
            matches!(c, ControlCommand::Source { command: SourceCommand::RequestRecovery(_), .. })
        })
    else {
        panic!("no recovery request in {commands:?}");
    };
    let request_id = call.request_id;

    // A stale generation's answer is ignored and counted.
    let stale = shell.plane.recovery_answered(
        &endpoint(BACKEND),
        generation + 7,
        request_id,
        RecoveryResponse::Error("late".to_owned()),
        shell.now,
        &mut shell.rng,
    );
    assert!(stale.is_empty());
    assert_eq!(shell.plane.counters().shell_reports_stale, 1);

    // The answer completes the initial wave: the rank is replaced.
    let answer = RecoveryResponse::TreeDump {
        events: Vec::new(),
        last_event_id: 4,
        reset_scope: TreeDumpScope::Rank,
    };
    let commands = shell.plane.recovery_answered(
        &endpoint(BACKEND),
        generation,
        request_id,
        answer,
        shell.now,
        &mut shell.rng,
    );
    let mut commands = shell.execute(commands);
    if commands.is_empty() {
        shell.now = shell.plane.poll_timeout().expect("batch release");
        commands = shell.timeout();
    }
    assert!(commands.iter().any(|c| matches!(
        c,
        ControlCommand::Source { command: SourceCommand::ReplaceRanks { ranks }, .. } if ranks.len() == 1
    )));
}

#[test]
fn a_failed_start_is_retried_after_the_backoff() {
    let mut shell = Shell::new();
    shell.fail_starts = true;
    shell.aggregated_up();
    assert!(shell.plane.catalog_snapshot().pools.is_empty());
    assert!(!shell.plane.health().healthy);

    shell.fail_starts = false;
    let due = shell.plane.poll_timeout().expect("retry scheduled");
    assert_eq!(due, Duration::from_millis(100));
    shell.now = due;
    let commands = shell.timeout();
    assert!(commands.iter().any(|c| is_host(c, |h| matches!(h, HostCommand::StartPool { .. }))));
    // The retry is a new generation; the failed one was never published.
    assert_eq!(shell.producer(BACKEND).layout_generation(), 2);
    assert_eq!(shell.plane.catalog_snapshot().revision, 1);
    assert!(shell.plane.health().healthy);
}

#[test]
fn an_alias_change_refreshes_the_descriptor_under_the_same_producer() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let before = shell.producer(BACKEND);
    let mut aliased = card(WorkerType::Aggregated, vec![]);
    aliased.aliases = vec!["tiny".to_owned()];
    let commands = shell.input(card_input(BACKEND, WORKER, aliased));
    assert!(commands.iter().all(|c| !is_host(c, |h| matches!(h, HostCommand::StopPool { .. }))));
    assert_eq!(shell.producer(BACKEND), before);
    let catalog = shell.plane.catalog_snapshot();
    assert_eq!(catalog.revision, 2);
    assert!(catalog.pools[0].registrations[0].aliases.contains("tiny"));
}

#[test]
fn shutdown_withdraws_every_pool_and_publishes_an_empty_topology() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let revision = shell.plane.topology_snapshot().revision;
    let commands = shell.plane.begin_shutdown(shell.now, &mut shell.rng);
    let commands = shell.execute(commands);
    assert!(commands.iter().any(|c| is_host(c, |h| matches!(
        h,
        HostCommand::WithdrawPool { reason: RetireReason::Shutdown, .. }
    ))));
    assert_eq!(commands.last(), Some(&ControlCommand::PublishTopology { revision: revision + 1 }));
    assert!(shell.plane.topology_snapshot().entries.is_empty());
    // Late inputs change nothing published.
    shell.input(instances(BACKEND, &[WORKER, 9]));
    assert!(shell.plane.topology_snapshot().entries.is_empty());
    assert!(shell.plane.catalog_snapshot().pools.is_empty());
}

#[test]
fn instance_listings_of_departed_endpoints_are_pruned() {
    let mut shell = Shell::new();
    // Endpoints that come and go without a card leave nothing behind.
    const DEPARTED: usize = 2_000;
    for index in 0..DEPARTED {
        let path = format!("dynamo/transient/gen{index}");
        shell.input(instances(&path, &[WORKER]));
        shell.input(instances(&path, &[]));
    }
    assert_eq!(shell.plane.instance_listings(), 0);
    assert_eq!(shell.plane.counters().instance_listings_pruned, DEPARTED as u64);
    // A failed listing of a departed endpoint is not held either.
    shell.input(DcInput::Instances(EndpointInstances {
        endpoint: endpoint("dynamo/transient/gen0"),
        live_workers: None,
    }));
    assert_eq!(shell.plane.instance_listings(), 0);

    // A card-served endpoint keeps its authoritative empty listing: it reads UNAVAILABLE, not
    // UNKNOWN, and is pruned only once its card goes too.
    shell.aggregated_up();
    shell.input(instances(BACKEND, &[]));
    assert_eq!(shell.plane.instance_listings(), 1);
    assert_eq!(shell.plane.topology_snapshot().entries[0].state, ReadinessState::Unavailable);
    let id =
        CardInstanceId { endpoint: endpoint(BACKEND), instance_id: WORKER, model_suffix: None };
    shell.input(DcInput::CardRemoved { id });
    assert_eq!(shell.plane.instance_listings(), 0);
    assert_eq!(shell.plane.counters().instance_listings_pruned, DEPARTED as u64 + 1);
}

#[test]
fn ignored_inputs_are_counted() {
    let mut shell = Shell::new();
    let unknown =
        CardInstanceId { endpoint: endpoint(BACKEND), instance_id: 1, model_suffix: None };
    assert!(shell.input(DcInput::CardRemoved { id: unknown }).is_empty());
    shell.input(DcInput::SourceWithdrawn { kv_state_endpoint: endpoint(BACKEND), publisher_id: 3 });
    shell.input(instances(BACKEND, &[WORKER]));
    shell.input(instances(BACKEND, &[WORKER]));
    let start = shell.plane.start_succeeded(&endpoint(BACKEND), 1, shell.now, &mut shell.rng);
    assert!(start.is_empty());
    let counters = *shell.plane.counters();
    assert_eq!(counters.card_inputs_without_effect, 1);
    assert_eq!(counters.withdrawals_unknown, 1);
    assert_eq!(counters.instance_listings_unchanged, 1);
    assert_eq!(counters.shell_reports_stale, 1);
    assert_eq!(counters.inputs, 4);
}

#[test]
fn events_published_under_a_mapped_kv_state_endpoint_reach_every_pool_mapped_to_it() {
    const KV_STATE: &str = "dynamo/kvstate/generate";
    let mut shell = Shell::new();
    for (path, worker, publisher, worker_type, needs) in [
        (BACKEND, WORKER, PUBLISHER, WorkerType::Decode, WorkerType::Prefill),
        (PREFILL, PREFILL_WORKER, PREFILL_PUBLISHER, WorkerType::Prefill, WorkerType::Decode),
    ] {
        let mut mapped = card(worker_type, vec![vec![needs]]);
        mapped.runtime_config.kv_state_endpoint = Some(endpoint(KV_STATE));
        shell.input(instances(path, &[worker]));
        shell.input(card_input(path, worker, mapped));
        // The advertisement is scoped to the KV-state endpoint, not the serving endpoint.
        shell.input(advert(KV_STATE, worker, publisher, false));
    }
    assert_eq!(shell.plane.catalog_snapshot().pools.len(), 2);

    // A batch scoped to the serving endpoint is not where these workers publish.
    assert!(shell.input(events(BACKEND, PUBLISHER, vec![cleared(WORKER, 1)])).is_empty());
    assert_eq!(shell.plane.counters().kv_batches_unrouted, 1);

    // A batch under the KV-state endpoint reaches both trackers; only the pool whose rank the
    // publisher is active for acts on it.
    let commands =
        shell.input(events(KV_STATE, PREFILL_PUBLISHER, vec![cleared(PREFILL_WORKER, 1)]));
    let acted: Vec<&EndpointPath> = commands
        .iter()
        .filter_map(|c| match c {
            ControlCommand::Source { endpoint, .. } => Some(endpoint),
            _ => None,
        })
        .collect();
    assert_eq!(acted, [&endpoint(PREFILL)]);
    let backend = shell.plane.tracker(&endpoint(BACKEND)).unwrap().counters();
    assert_eq!(backend.events_dropped_inactive_publisher, 1);
}

/// Inputs drawn from a small vocabulary (3 endpoints, 3 workers, 2 models, every card shape,
/// overlapping publishers, mappings, failures), with the shell answering at random: no input
/// sequence may panic or break an invariant, and the same seed gives the same commands.
#[test]
fn random_input_sequences_keep_every_invariant_and_are_deterministic() {
    let mut log = Vec::new();
    for seed in 0..24 {
        let first = random_run(seed);
        assert_eq!(first, random_run(seed), "seed {seed} is not deterministic");
        log.extend(first);
    }
    // The vocabulary reaches every interesting path: pools start, publish and retire, ranks
    // recover and apply events, and the topology moves.
    for needle in [
        "StartPool",
        "PublishCatalog",
        "WithdrawPool",
        "StopPool",
        "RequestRecovery",
        "ReplaceRanks",
        "ApplyEvents",
        "ResetRank",
        "PublishTopology",
    ] {
        let count = log.iter().filter(|line| line.contains(needle)).count();
        assert!(count > 0, "no {needle} in any run");
    }
}

fn random_run(seed: u64) -> Vec<String> {
    use rand_core::Rng;

    const PATHS: [&str; 3] = [BACKEND, PREFILL, "dynamo/encode/generate"];
    const WORKERS: [u64; 3] = [WORKER, PREFILL_WORKER, 0x77];
    let mut draw = rng_from_seed(seed ^ 0xd1ce);
    let mut pick = |bound: u64| draw.next_u64() % bound;
    let mut shell = Shell::with_config(ControlConfig::new(
        relay(),
        stable_dc_id("dc-a").unwrap(),
        DiscoveryScope::watch_all(Vec::new()).unwrap(),
    ));
    let mut pending_recoveries = Vec::new();

    for _ in 0..160 {
        let path = PATHS[pick(3) as usize];
        let worker = WORKERS[pick(3) as usize];
        let publisher = 0x100 + pick(4);
        shell.fail_starts = pick(5) == 0;
        let input = match pick(12) {
            0..=2 => {
                let worker_type = [
                    WorkerType::Aggregated,
                    WorkerType::Aggregated,
                    WorkerType::Prefill,
                    WorkerType::Decode,
                    WorkerType::Encode,
                ][pick(5) as usize];
                let mut random = card(worker_type, vec![vec![WorkerType::Decode]]);
                if pick(4) == 0 {
                    random.display_name = "other-llm".to_owned();
                }
                if pick(8) == 0 {
                    random.kv_cache_block_size = 0;
                }
                random.runtime_config.enable_eagle = pick(10) == 0;
                random.runtime_config.data_parallel_size = [1, 1, 2, 0][pick(4) as usize];
                random.runtime_config.enable_local_indexer = pick(2) == 0;
                if pick(8) == 0 {
                    random.worker_type = None;
                }
                if pick(10) == 0 {
                    random.runtime_config.kv_state_endpoint =
                        Some(endpoint(PATHS[pick(3) as usize]));
                }
                card_input(path, worker, random)
            }
            3 => DcInput::CardRemoved {
                id: CardInstanceId {
                    endpoint: endpoint(path),
                    instance_id: worker,
                    model_suffix: None,
                },
            },
            4 => {
                let live: Vec<u64> = WORKERS.iter().copied().filter(|_| pick(4) != 0).collect();
                if pick(6) == 0 {
                    // A failed watch.
                    DcInput::Instances(EndpointInstances {
                        endpoint: endpoint(path),
                        live_workers: None,
                    })
                } else {
                    instances(path, &live)
                }
            }
            5 => {
                let mut offered = advert(path, worker, publisher, pick(2) == 0);
                if let DcInput::SourceAdvertised(advert) = &mut offered {
                    advert.source.dp_rank = pick(2) as u32;
                }
                offered
            }
            6 => DcInput::SourceWithdrawn {
                kv_state_endpoint: endpoint(path),
                publisher_id: publisher,
            },
            7 | 8 => {
                let event_id = 1 + pick(6);
                let event = if pick(4) == 0 {
                    cleared(worker, event_id)
                } else {
                    stored(worker, event_id, pick(64))
                };
                events(path, publisher, vec![event])
            }
            9 => load(path, worker, (pick(3) != 0).then(|| pick(1_000))),
            _ => {
                shell.now += Duration::from_millis(pick(400));
                let commands = shell.timeout();
                collect_recoveries(&commands, &mut pending_recoveries);
                continue;
            }
        };
        let commands = shell.input(input);
        collect_recoveries(&commands, &mut pending_recoveries);
        if !pending_recoveries.is_empty() && pick(2) == 0 {
            let (path, generation, request_id) = pending_recoveries.remove(0);
            let response = match pick(4) {
                0 | 1 => RecoveryResponse::TreeDump {
                    events: Vec::new(),
                    last_event_id: pick(5),
                    reset_scope: TreeDumpScope::Rank,
                },
                2 => RecoveryResponse::Error("unavailable".to_owned()),
                _ => RecoveryResponse::TreeDumpFailed {
                    last_event_id: None,
                    message: "busy".to_owned(),
                },
            };
            let commands = shell.plane.recovery_answered(
                &path,
                generation,
                request_id,
                response,
                shell.now,
                &mut shell.rng,
            );
            let commands = shell.execute(commands);
            collect_recoveries(&commands, &mut pending_recoveries);
        }
        assert_eq!(shell.plane.health().control_last_error, None, "seed {seed}");
    }
    let commands = shell.plane.begin_shutdown(shell.now, &mut shell.rng);
    shell.execute(commands);
    assert!(shell.plane.catalog_snapshot().pools.is_empty());
    shell.log.iter().map(|command| format!("{command:?}")).collect()
}

fn collect_recoveries(
    commands: &[ControlCommand],
    pending: &mut Vec<(EndpointPath, u64, crate::sources::RecoveryRequestId)>,
) {
    for command in commands {
        if let ControlCommand::Source {
            endpoint,
            layout_generation,
            command: SourceCommand::RequestRecovery(call),
            ..
        } = command
        {
            pending.push((endpoint.clone(), *layout_generation, call.request_id));
        }
    }
}

#[test]
fn a_failed_instance_watch_is_unknown_for_readiness_but_keeps_the_pool() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let producer = shell.producer(BACKEND);
    let commands = shell.input(DcInput::Instances(EndpointInstances {
        endpoint: endpoint(BACKEND),
        live_workers: None,
    }));
    // Only the topology moves: no withdrawal, no source command.
    assert!(matches!(commands.as_slice(), [ControlCommand::PublishTopology { .. }]));
    assert_eq!(shell.plane.topology_snapshot().entries[0].state, ReadinessState::Unknown);
    assert_eq!(shell.producer(BACKEND), producer);

    // The watch recovers with the same workers: READY again under the same producer.
    let commands = shell.input(instances(BACKEND, &[WORKER]));
    assert!(matches!(commands.as_slice(), [ControlCommand::PublishTopology { .. }]));
    assert_eq!(shell.plane.topology_snapshot().entries[0].state, ReadinessState::Ready);
    assert_eq!(shell.producer(BACKEND), producer);
}

/// A recoverable aggregated worker, fully up with its rank recovered exactly; returns the
/// generation.
fn recovered_aggregated_up(shell: &mut Shell) -> u64 {
    shell.input(instances(BACKEND, &[WORKER]));
    let mut config = card(WorkerType::Aggregated, vec![]);
    config.runtime_config.enable_local_indexer = true;
    shell.input(card_input(BACKEND, WORKER, config));
    shell.input(advert(BACKEND, WORKER, PUBLISHER, true));
    let generation = shell.producer(BACKEND).layout_generation();
    let request_id = next_recovery_request(shell);
    answer_tree_dump(shell, generation, request_id);
    let rank = shell.plane.tracker(&endpoint(BACKEND)).unwrap().rank(source()).unwrap();
    assert!(!rank.recovering, "the initial wave replaced the rank");
    generation
}

fn source() -> SourceKey {
    SourceKey { worker_id: WORKER, dp_rank: 0 }
}

/// Run timers until the tracker asks for a recovery; returns the request id.
fn next_recovery_request(shell: &mut Shell) -> RecoveryRequestId {
    for _ in 0..16 {
        shell.now = shell.plane.poll_timeout().expect("a recovery timer");
        let commands = shell.timeout();
        if let Some(request_id) = commands.iter().find_map(|command| match command {
            ControlCommand::Source { command: SourceCommand::RequestRecovery(call), .. } => {
                Some(call.request_id)
            }
            _ => None,
        }) {
            return request_id;
        }
    }
    panic!("no recovery request");
}

fn answer_tree_dump(shell: &mut Shell, generation: u64, request_id: RecoveryRequestId) {
    let answer = RecoveryResponse::TreeDump {
        events: Vec::new(),
        last_event_id: 4,
        reset_scope: TreeDumpScope::Rank,
    };
    let commands = shell.plane.recovery_answered(
        &endpoint(BACKEND),
        generation,
        request_id,
        answer,
        shell.now,
        &mut shell.rng,
    );
    shell.execute(commands);
    // Later replacements wait for the batch window.
    while shell.plane.tracker(&endpoint(BACKEND)).unwrap().rank(source()).unwrap().recovering {
        shell.now = shell.plane.poll_timeout().expect("batch release");
        shell.timeout();
    }
}

/// What the shell reports when the pool refuses an event of `source` with a resource failure,
/// written under `fence`.
fn report_pool_fault(shell: &mut Shell, generation: u64, fence: RankFence) -> Vec<ControlCommand> {
    let fault =
        PoolFault { source: source(), fence, event_id: 9, error: ApplyError::AllocationFailed };
    let report = ShellReport::PoolFault {
        endpoint: endpoint(BACKEND),
        layout_generation: generation,
        fault,
    };
    let commands = shell.plane.report(report, shell.now, &mut shell.rng);
    shell.execute(commands)
}

/// [`report_pool_fault`] under the rank's current fence.
fn report_resource_failure(shell: &mut Shell, generation: u64) -> Vec<ControlCommand> {
    let fence = shell.plane.tracker(&endpoint(BACKEND)).unwrap().rank(source()).unwrap().fence;
    report_pool_fault(shell, generation, fence)
}

#[test]
fn a_pool_fault_under_an_older_fence_than_the_ranks_is_stale() {
    let mut shell = Shell::new();
    let generation = recovered_aggregated_up(&mut shell);
    fn tracker(shell: &Shell) -> &SourceTracker {
        shell.plane.tracker(&endpoint(BACKEND)).unwrap()
    }
    let before = tracker(&shell).rank(source()).unwrap();
    let stale_before = tracker(&shell).counters().faults_stale;
    assert!(before.fence.0 > 1, "the rank was reset and replaced since its first fence");

    let _ = report_pool_fault(&mut shell, generation, RankFence(before.fence.0 - 1));
    let after = tracker(&shell).rank(source()).unwrap();
    assert_eq!(tracker(&shell).counters().faults_stale, stale_before + 1);
    assert_eq!(after.fence, before.fence, "a stale fault resets nothing");
    assert!(!after.recovering, "a stale fault starts no recovery");

    let _ = report_resource_failure(&mut shell, generation);
    let current = tracker(&shell).rank(source()).unwrap();
    assert!(current.fence > before.fence, "a fault under the current fence resets the rank");
    assert!(current.recovering);
}

#[test]
fn a_host_recovery_call_is_answered_once_the_rank_is_recovered() {
    let mut shell = Shell::new();
    let generation = recovered_aggregated_up(&mut shell);

    let commands = report_resource_failure(&mut shell, generation);
    assert!(
        !commands.iter().any(|c| is_host(c, |h| matches!(h, HostCommand::RecoverSource { .. }))),
        "the plane answers the host's recovery call itself"
    );
    assert!(shell.plane.host_recovery_in_flight(&endpoint(BACKEND)));
    let rank = shell.plane.tracker(&endpoint(BACKEND)).unwrap().rank(source()).unwrap();
    assert!(rank.recovering, "the fault reset the rank and scheduled its recovery");

    let request_id = next_recovery_request(&mut shell);
    assert!(shell.plane.host_recovery_in_flight(&endpoint(BACKEND)), "waits for the answer");
    answer_tree_dump(&mut shell, generation, request_id);
    assert!(!shell.plane.host_recovery_in_flight(&endpoint(BACKEND)));
    assert_eq!(shell.producer(BACKEND).layout_generation(), generation, "the pool stays");
    assert!(
        !shell.log.iter().any(|c| is_host(c, |h| matches!(h, HostCommand::WithdrawPool { .. })))
    );
}

#[test]
fn a_recovery_that_fails_for_good_fences_the_generation_and_a_new_one_is_published() {
    let mut shell = Shell::new();
    let generation = recovered_aggregated_up(&mut shell);
    report_resource_failure(&mut shell, generation);

    // Every attempt fails in transport: the rank degrades after the attempt bound.
    for _ in 0..RECOVERY_ATTEMPTS_MAX {
        if !shell.plane.host_recovery_in_flight(&endpoint(BACKEND)) {
            break;
        }
        let request_id = next_recovery_request(&mut shell);
        let report = ShellReport::RecoveryUnreachable {
            endpoint: endpoint(BACKEND),
            layout_generation: generation,
            request_id,
            failure: crate::sources::RecoveryFailure::Unreachable("connection refused".to_owned()),
        };
        let commands = shell.plane.report(report, shell.now, &mut shell.rng);
        shell.execute(commands);
    }
    assert!(!shell.plane.host_recovery_in_flight(&endpoint(BACKEND)));
    let withdrawn = shell.log.iter().any(|c| {
        is_host(c, |h| matches!(h, HostCommand::WithdrawPool { .. }))
            && matches!(c, ControlCommand::Host(HostCommand::WithdrawPool { layout_generation, .. }) if *layout_generation == generation)
    });
    assert!(withdrawn, "the fenced generation left the catalog");

    // After the host's retry backoff a new generation is published.
    for _ in 0..8 {
        if shell.plane.active_producer(&endpoint(BACKEND)).is_some() {
            break;
        }
        shell.now = shell.plane.poll_timeout().expect("a retry is scheduled");
        shell.timeout();
    }
    assert!(shell.producer(BACKEND).layout_generation() > generation);
}

#[test]
fn a_fault_on_a_live_only_rank_is_answered_at_once() {
    let mut shell = Shell::new();
    shell.aggregated_up();
    let generation = shell.producer(BACKEND).layout_generation();
    report_resource_failure(&mut shell, generation);
    assert!(!shell.plane.host_recovery_in_flight(&endpoint(BACKEND)));
    assert_eq!(shell.producer(BACKEND).layout_generation(), generation);
}
