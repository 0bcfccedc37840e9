//! Scenario tests of source membership and per-rank recovery: each drives the membership
//! projection and the tracker with a list of inputs and asserts on the commands, with no
//! runtime. Time is a plain `Duration` the test advances; jitter comes from a seeded generator.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand_core::Rng;

use super::*;
use crate::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::inputs::{
    KvEventBatch, KvEventSourceAdvert, RecoveryTarget, RequestPlaneTransport, RuntimeConfig,
};
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, SourceKey, StorageTier, StoreData, StoredBlock,
};
use crate::pool::{FailureDisposition, PoolOwnership, RankReplacement};
use crate::rng::{RelayRng, rng_from_seed};

// ---- fixtures ------------------------------------------------------------------------------

pub(super) const R0: SourceKey = SourceKey { worker_id: 1, dp_rank: 0 };
pub(super) const R1: SourceKey = SourceKey { worker_id: 1, dp_rank: 1 };
const R2: SourceKey = SourceKey { worker_id: 1, dp_rank: 2 };
pub(super) const P1: u64 = 0xA1;
pub(super) const P2: u64 = 0xB2;

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn serving() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").unwrap()
}

fn other_endpoint() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "kv_state").unwrap()
}

pub(super) fn config(start: u32, size: u32, local_indexer: bool) -> RuntimeConfig {
    RuntimeConfig {
        data_parallel_start_rank: start,
        data_parallel_size: size,
        enable_local_indexer: local_indexer,
        ..RuntimeConfig::default()
    }
}

fn target(publisher_id: u64) -> RecoveryTarget {
    RecoveryTarget {
        endpoint: EndpointPath::new(
            "dynamo",
            "backend",
            format!("worker_kv_query_source_{publisher_id:x}"),
        )
        .unwrap(),
        instance_id: 1,
        transport: RequestPlaneTransport::Tcp(format!("127.0.0.1:4000/{publisher_id:x}")),
    }
}

pub(super) fn advert(
    source: SourceKey,
    publisher_id: u64,
    recoverable: bool,
) -> KvEventSourceAdvert {
    KvEventSourceAdvert {
        kv_state_endpoint: serving(),
        source,
        publisher_id,
        recovery_target: recoverable.then(|| target(publisher_id)),
    }
}

fn event(source: SourceKey, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: source.worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank: source.dp_rank, data },
    }
}

/// A store of one root block whose engine id is `block`.
pub(super) fn stored(source: SourceKey, event_id: u64, block: u64) -> RouterEvent {
    stored_child(source, event_id, None, block)
}

fn stored_child(source: SourceKey, event_id: u64, parent: Option<u64>, block: u64) -> RouterEvent {
    event(
        source,
        event_id,
        KvCacheEventData::Stored(StoreData {
            parent_hash: parent.map(ExternalBlockHash),
            start_position: None,
            blocks: vec![StoredBlock {
                block_hash: ExternalBlockHash(block),
                tokens_hash: LocalBlockHash(block.wrapping_mul(0x9E37_79B9) ^ 0x55),
            }],
        }),
    )
}

fn cleared(source: SourceKey, event_id: u64) -> RouterEvent {
    event(source, event_id, KvCacheEventData::Cleared)
}

pub(super) fn live(source: SourceKey, ids: impl IntoIterator<Item = u64>) -> Vec<RouterEvent> {
    ids.into_iter().map(|id| stored(source, id, id.wrapping_add(1000))).collect()
}

pub(super) fn dump(events: Vec<RouterEvent>, last_event_id: u64) -> RecoveryResponse {
    RecoveryResponse::TreeDump { events, last_event_id, reset_scope: TreeDumpScope::Rank }
}

fn dump_failed() -> RecoveryResponse {
    RecoveryResponse::TreeDumpFailed { last_event_id: None, message: "busy".into() }
}

// ---- command views -------------------------------------------------------------------------

pub(super) fn requests(commands: &[SourceCommand]) -> Vec<RecoveryCall> {
    commands
        .iter()
        .filter_map(|command| match command {
            SourceCommand::RequestRecovery(call) => Some(call.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn resets(commands: &[SourceCommand]) -> Vec<(SourceKey, bool, ResetReason)> {
    commands
        .iter()
        .filter_map(|command| match command {
            SourceCommand::ResetRank { source, degraded, reason, .. } => {
                Some((*source, *degraded, *reason))
            }
            _ => None,
        })
        .collect()
}

pub(super) fn applied(commands: &[SourceCommand]) -> Vec<(SourceKey, Vec<u64>)> {
    commands
        .iter()
        .filter_map(|command| match command {
            SourceCommand::ApplyEvents { source, events, .. } => {
                Some((*source, events.iter().map(|e| e.event.event_id).collect()))
            }
            _ => None,
        })
        .collect()
}

fn replaced(commands: &[SourceCommand]) -> Vec<Vec<(SourceKey, u64)>> {
    commands
        .iter()
        .filter_map(|command| match command {
            SourceCommand::ReplaceRanks { ranks } => {
                Some(ranks.iter().map(|dump| (dump.source, dump.last_event_id)).collect())
            }
            _ => None,
        })
        .collect()
}

fn cancels(commands: &[SourceCommand]) -> Vec<RecoveryRequestId> {
    commands
        .iter()
        .filter_map(|command| match command {
            SourceCommand::CancelRecovery { request_id, .. } => Some(*request_id),
            _ => None,
        })
        .collect()
}

/// The request for `source` among `calls`.
fn call_for(calls: &[RecoveryCall], source: SourceKey) -> RecoveryCall {
    calls.iter().find(|call| call.source == source).cloned().expect("a request for the rank")
}

/// The single request in `commands`.
fn only_request(commands: &[SourceCommand]) -> RecoveryCall {
    let calls = requests(commands);
    assert_eq!(calls.len(), 1, "expected one request in {commands:#?}");
    calls.into_iter().next().unwrap()
}

// ---- harness -------------------------------------------------------------------------------

/// Membership facts plus the two state machines, driven like the host shell would.
pub(super) struct Harness {
    membership: KvSourceMembership,
    pub(super) tracker: SourceTracker,
    rng: RelayRng,
    now: Duration,
    configs: BTreeMap<u64, RuntimeConfig>,
    live_workers: BTreeSet<u64>,
    adverts: AdvertTable,
}

impl Harness {
    pub(super) fn new() -> Self {
        Self::with_config(SourceTrackerConfig::default())
    }

    fn with_config(config: SourceTrackerConfig) -> Self {
        Harness {
            membership: KvSourceMembership::new(serving()),
            tracker: SourceTracker::new(config).unwrap(),
            rng: rng_from_seed(7),
            now: Duration::ZERO,
            configs: BTreeMap::new(),
            live_workers: BTreeSet::new(),
            adverts: AdvertTable::new(),
        }
    }

    pub(super) fn add_worker(&mut self, worker_id: u64, config: RuntimeConfig) {
        self.configs.insert(worker_id, config);
        self.live_workers.insert(worker_id);
    }

    fn remove_worker(&mut self, worker_id: u64) {
        self.configs.remove(&worker_id);
        self.live_workers.remove(&worker_id);
        let gone: Vec<(EndpointPath, u64)> = self
            .adverts
            .iter()
            .filter(|advert| advert.source.worker_id == worker_id)
            .map(|advert| (advert.kv_state_endpoint.clone(), advert.publisher_id))
            .collect();
        for (scope, publisher_id) in gone {
            self.adverts.withdraw(&scope, publisher_id);
        }
    }

    pub(super) fn advertise(&mut self, advert: KvEventSourceAdvert) {
        self.adverts.advertise(advert).unwrap();
    }

    pub(super) fn withdraw(&mut self, publisher_id: u64) {
        self.adverts.withdraw(&serving(), publisher_id);
    }

    pub(super) fn view(&mut self) -> SourceView {
        self.membership.project(&self.configs, &self.live_workers, self.adverts.iter())
    }

    pub(super) fn handle(&mut self, input: SourceInput) -> Vec<SourceCommand> {
        let commands = self.tracker.handle(input, self.now, &mut self.rng);
        self.tracker.check_invariants().unwrap();
        commands
    }

    pub(super) fn reconcile(&mut self) -> Vec<SourceCommand> {
        let view = self.view();
        self.handle(SourceInput::View(view))
    }

    /// Reconcile, then let the activation jitter pass.
    pub(super) fn reconcile_and_settle(&mut self) -> Vec<SourceCommand> {
        let mut commands = self.reconcile();
        commands.extend(self.advance(RECOVERY_START_JITTER_MAX));
        commands
    }

    pub(super) fn events(
        &mut self,
        publisher_id: u64,
        events: Vec<RouterEvent>,
    ) -> Vec<SourceCommand> {
        self.handle(SourceInput::Events(KvEventBatch {
            endpoint: serving(),
            publisher_id,
            sequence: 0,
            published_at_ms: 0,
            events,
        }))
    }

    pub(super) fn answer(
        &mut self,
        call: &RecoveryCall,
        response: RecoveryResponse,
    ) -> Vec<SourceCommand> {
        self.handle(SourceInput::RecoveryAnswered { request_id: call.request_id, response })
    }

    fn advance(&mut self, by: Duration) -> Vec<SourceCommand> {
        self.now += by;
        let commands = self.tracker.handle_timeout(self.now);
        self.tracker.check_invariants().unwrap();
        commands
    }

    /// Jump to the tracker's next timer and run it.
    fn next_timer(&mut self) -> Vec<SourceCommand> {
        let at = self.tracker.poll_timeout().expect("a timer is armed");
        assert!(at >= self.now, "timer {at:?} is in the past of {:?}", self.now);
        let by = at - self.now;
        self.advance(by)
    }

    fn rank(&self, source: SourceKey) -> RankReport {
        self.tracker.rank(source).expect("rank is active")
    }

    /// Worker 1 with one recoverable rank advertised by `P1`, recovered from an empty dump.
    pub(super) fn recovered_single_rank() -> Self {
        let mut harness = Harness::new();
        harness.add_worker(1, config(0, 1, true));
        harness.advertise(advert(R0, P1, true));
        let commands = harness.reconcile_and_settle();
        let call = only_request(&commands);
        let commands = harness.answer(&call, dump(vec![], 0));
        assert_eq!(replaced(&commands), vec![vec![(R0, 0)]]);
        assert_eq!(harness.rank(R0).cursor, RankCursor::Live(0));
        harness
    }

    /// Worker 1 with one live-only rank advertised by `P1`.
    pub(super) fn live_only_single_rank() -> Self {
        let mut harness = Harness::new();
        harness.add_worker(1, config(0, 1, false));
        harness.advertise(advert(R0, P1, false));
        let commands = harness.reconcile_and_settle();
        assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
        assert!(requests(&commands).is_empty());
        assert_eq!(harness.rank(R0).mode, RankMode::LiveOnly);
        harness
    }
}

// ---- membership ----------------------------------------------------------------------------

#[test]
fn expected_ranks_follow_runtime_configs() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 2, true));
    harness.add_worker(2, config(4, 1, false));
    harness.add_worker(3, config(0, 0, true)); // invalid: size 0
    harness.add_worker(4, config(0, DATA_PARALLEL_SIZE_MAX + 1, true)); // invalid: too large
    harness.add_worker(5, config(u32::MAX, 2, true)); // invalid: ranks beyond u32
    harness.add_worker(6, config(0, DATA_PARALLEL_SIZE_MAX, true)); // the largest valid size
    harness.add_worker(10, config(u32::MAX - 1, 2, false)); // valid: the last rank is u32::MAX
    harness.configs.insert(7, config(0, 1, true)); // a base card without a live instance
    harness.live_workers.insert(8); // a live instance without a base card
    harness.advertise(advert(SourceKey { worker_id: 9, dp_rank: 0 }, 0x99, true)); // source-only

    let view = harness.view();
    let worker_ranks = |worker_id: u64| -> Vec<u32> {
        view.ranks.keys().filter(|key| key.worker_id == worker_id).map(|key| key.dp_rank).collect()
    };
    assert_eq!(worker_ranks(1), vec![0, 1]);
    assert_eq!(worker_ranks(2), vec![4]);
    for worker_id in [3, 4, 5, 7, 8, 9] {
        assert!(worker_ranks(worker_id).is_empty(), "worker {worker_id} has no expected ranks");
    }
    assert_eq!(worker_ranks(6).len(), DATA_PARALLEL_SIZE_MAX as usize);
    assert_eq!(worker_ranks(10), vec![u32::MAX - 1, u32::MAX]);
    assert_eq!(view.ranks.len(), 5 + DATA_PARALLEL_SIZE_MAX as usize);
    assert!(view.ranks[&R0].recovery_expected);
    assert!(!view.ranks[&SourceKey { worker_id: 2, dp_rank: 4 }].recovery_expected);
    assert!(view.ranks.values().all(|rank| rank.status == RankSourceStatus::Missing));
    assert_eq!(view.ranks[&R0].lifecycle_generation, 0);
    assert_eq!(view.kv_state_endpoint, KvStateEndpointResolution::Resolved(serving()));
    assert!(!view.has_active_source(), "a source-only advert never materialises anything");
    assert_eq!(
        view.diagnostics,
        vec![
            MembershipDiagnostic::InvalidDataParallelSize { worker_id: 3, data_parallel_size: 0 },
            MembershipDiagnostic::InvalidDataParallelSize {
                worker_id: 4,
                data_parallel_size: DATA_PARALLEL_SIZE_MAX + 1,
            },
            MembershipDiagnostic::DataParallelRangeOverflow {
                worker_id: 5,
                start_rank: u32::MAX,
                data_parallel_size: 2,
            },
            MembershipDiagnostic::UnexpectedSource {
                rank: SourceKey { worker_id: 9, dp_rank: 0 },
                publisher_id: 0x99,
            },
        ]
    );

    // Shrinking a worker's DP size drops its ranks; the tracker never saw them active.
    harness.add_worker(1, config(0, 1, true));
    let view = harness.view();
    assert!(view.ranks.contains_key(&R0) && !view.ranks.contains_key(&R1));
}

#[test]
fn expected_ranks_are_bounded_per_endpoint() {
    let mut harness = Harness::new();
    let workers = (EXPECTED_RANKS_MAX / DATA_PARALLEL_SIZE_MAX as usize) as u64;
    for worker_id in 1..=workers + 1 {
        harness.add_worker(worker_id, config(0, DATA_PARALLEL_SIZE_MAX, false));
    }
    let view = harness.view();
    assert_eq!(view.ranks.len(), EXPECTED_RANKS_MAX);
    assert_eq!(
        view.diagnostics,
        vec![MembershipDiagnostic::ExpectedRanksLimit { worker_id: workers + 1 }]
    );
}

#[test]
fn rank_status_follows_the_advertisements() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 3, true));
    harness.advertise(advert(R0, P1, true));
    harness.advertise(advert(R1, P2, false));
    let view = harness.view();
    assert_eq!(
        view.ranks[&R0].status,
        RankSourceStatus::ActiveRecoverable { publisher_id: P1, recovery_target: target(P1) }
    );
    assert_eq!(view.ranks[&R1].status, RankSourceStatus::ActiveLiveOnly { publisher_id: P2 });
    assert_eq!(view.ranks[&R2].status, RankSourceStatus::Missing);
    assert!(view.has_active_source());
    // The worker runs a local indexer but P2 offers no recovery: diagnosed, live-only.
    assert_eq!(
        view.diagnostics,
        vec![MembershipDiagnostic::RecoveryTargetMissing { rank: R1, publisher_id: P2 }]
    );
    // Projecting the same facts again keeps every generation.
    let again = harness.view();
    assert_eq!(again.ranks, view.ranks);
    assert_ne!(view.ranks[&R0].lifecycle_generation, view.ranks[&R1].lifecycle_generation);
}

#[test]
fn conflicting_descriptor_makes_the_rank_ambiguous_until_withdrawn() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 2, true));
    harness.advertise(advert(R0, P1, true));
    // The same publisher id claims a second rank: both descriptors are kept.
    assert_eq!(harness.adverts.advertise(advert(R1, P1, true)), Ok(AdvertChange::Conflicting));
    assert_eq!(harness.adverts.advertise(advert(R1, P1, true)), Ok(AdvertChange::Unchanged));
    let view = harness.view();
    for rank in [R0, R1] {
        assert_eq!(
            view.ranks[&rank].status,
            RankSourceStatus::Ambiguous(SourceAmbiguity::ConflictingDescriptor {
                publisher_id: P1
            })
        );
    }
    assert!(!view.has_active_source());
    // Withdrawal is fenced by publisher id and scope: another scope's withdrawal removes nothing.
    assert_eq!(harness.adverts.withdraw(&other_endpoint(), P1), 0);
    assert!(!harness.adverts.is_empty());
    assert_eq!(harness.adverts.len(), 2);
    assert_eq!(harness.adverts.withdraw(&serving(), P1), 2);
    assert!(harness.adverts.is_empty());
}

#[test]
fn removal_is_publisher_specific() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    harness.advertise(advert(R0, P2, true));
    assert_eq!(harness.adverts.len(), 2);
    harness.withdraw(0xDEAD); // unknown: nothing happens
    assert_eq!(harness.adverts.len(), 2);
    harness.withdraw(P1);
    let view = harness.view();
    assert_eq!(view.ranks[&R0].status.active_publisher(), Some(P2));
}

#[test]
fn ambiguous_kv_state_endpoint_materialises_nothing() {
    let mut harness = Harness::live_only_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1]))), vec![(R0, vec![1])]);

    // A second worker maps its KV state to another endpoint: the mapping is ambiguous.
    harness.add_worker(
        2,
        RuntimeConfig { kv_state_endpoint: Some(other_endpoint()), ..config(0, 1, true) },
    );
    harness.advertise(advert(SourceKey { worker_id: 2, dp_rank: 0 }, P2, true));
    let view = harness.view();
    assert_eq!(
        view.kv_state_endpoint,
        KvStateEndpointResolution::Ambiguous([serving(), other_endpoint()].into_iter().collect())
    );
    assert!(
        view.ranks.values().all(
            |rank| rank.status == RankSourceStatus::Ambiguous(SourceAmbiguity::EndpointMapping)
        )
    );
    assert_eq!(view.ranks.len(), 2);
    assert!(!view.has_active_source());
    assert!(view.resolved_kv_state_endpoint().is_none());
    assert!(matches!(
        view.diagnostics.as_slice(),
        [MembershipDiagnostic::AmbiguousKvStateEndpoint { .. }]
    ));

    let commands = harness.handle(SourceInput::View(view));
    assert_eq!(commands.len(), 1);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::SourceWithheld)]);
    assert_eq!(harness.tracker.active_ranks().count(), 0);
    assert!(harness.events(P1, live(R0, [2])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_inactive_publisher, 1);

    // A fresh tracker that first sees the ambiguous mapping does nothing at all.
    let mut fresh = Harness::new();
    fresh.configs = harness.configs.clone();
    fresh.live_workers = harness.live_workers.clone();
    fresh.adverts = harness.adverts.clone();
    assert!(fresh.reconcile_and_settle().is_empty());
    assert_eq!(fresh.tracker.poll_timeout(), None);
}

// ---- source epochs -------------------------------------------------------------------------

#[test]
fn stale_incarnation_events_are_dropped() {
    let mut harness = Harness::live_only_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1, 2]))), vec![(R0, vec![1, 2])]);

    // P1 stops, P2 takes over the rank.
    harness.withdraw(P1);
    harness.advertise(advert(R0, P2, false));
    let commands = harness.reconcile();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);

    // Late events of P1 are dropped and counted, whatever their ids.
    assert!(harness.events(P1, live(R0, [3, 4])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_inactive_publisher, 2);
    // Never-seen incarnations too.
    assert!(harness.events(0x5555, live(R0, [1])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_inactive_publisher, 3);
    // P2's stream starts at 1 on a cold rank.
    assert_eq!(applied(&harness.events(P2, live(R0, [1]))), vec![(R0, vec![1])]);
    assert_eq!(harness.rank(R0).publisher_id, P2);
}

#[test]
fn new_incarnation_cold_resets_and_recovers() {
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1, 2, 3]))), vec![(R0, vec![1, 2, 3])]);
    let generation_before = harness.rank(R0).lifecycle_generation;
    let fence_before = harness.rank(R0).fence;

    harness.withdraw(P1);
    harness.advertise(advert(R0, P2, true));
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
    let call = only_request(&commands);
    assert_eq!(call.publisher_id, P2);
    assert_eq!(call.target, target(P2));
    assert_eq!(call.request, RecoveryRequest::tree_dump(R0));
    assert_eq!(call.attempt, 1);
    // Sent after the activation jitter, due one attempt timeout later.
    let activated_at = harness.now - RECOVERY_START_JITTER_MAX;
    assert!(call.deadline >= activated_at + RECOVERY_ATTEMPT_TIMEOUT);
    assert!(call.deadline <= harness.now + RECOVERY_ATTEMPT_TIMEOUT);
    let report = harness.rank(R0);
    assert!(report.lifecycle_generation > generation_before);
    assert!(report.fence > fence_before);
    assert_eq!(report.cursor, RankCursor::Initial);

    // Live events of the new incarnation wait for its dump.
    assert!(harness.events(P2, live(R0, [1, 2])).is_empty());
    assert!(harness.answer(&call, dump(vec![stored(R0, 0, 7)], 1)).is_empty());
    // Not the initial wave: the replacement waits for a quiet window.
    assert!(harness.advance(RECOVERY_REBUILD_BATCH_WINDOW - ms(1)).is_empty());
    let commands = harness.advance(ms(1));
    assert_eq!(replaced(&commands), vec![vec![(R0, 1)]]);
    assert_eq!(applied(&commands), vec![(R0, vec![2])]);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(2));
    assert_eq!(harness.tracker.counters().events_dropped_stale, 1);
}

#[test]
fn overlapping_incarnations_withhold_kv_until_one_remains() {
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1]))), vec![(R0, vec![1])]);

    // P2 appears before P1 is gone.
    harness.advertise(advert(R0, P2, true));
    let view = harness.view();
    assert_eq!(
        view.ranks[&R0].status,
        RankSourceStatus::Ambiguous(SourceAmbiguity::Incarnations {
            publisher_ids: [P1, P2].into_iter().collect()
        })
    );
    let commands = harness.handle(SourceInput::View(view));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::SourceWithheld)]);
    assert!(harness.tracker.rank(R0).is_none());

    // While ambiguous, both incarnations are dropped.
    assert!(harness.events(P1, live(R0, [2])).is_empty());
    assert!(harness.events(P2, live(R0, [1])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_inactive_publisher, 2);
    assert!(harness.advance(ms(100)).is_empty());

    // P1 goes: P2 is activated with a cold reset and a tree dump.
    harness.withdraw(P1);
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
    let call = only_request(&commands);
    assert_eq!((call.publisher_id, call.request.is_tree_dump()), (P2, true));
}

#[test]
fn same_incarnation_returning_after_ambiguity_is_cold_reset_again() {
    let mut harness = Harness::recovered_single_rank();
    let generation = harness.rank(R0).lifecycle_generation;
    harness.advertise(advert(R0, P2, true));
    harness.reconcile();
    harness.withdraw(P2);
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
    assert_eq!(only_request(&commands).publisher_id, P1);
    assert!(harness.rank(R0).lifecycle_generation > generation);
}

#[test]
fn publisher_id_moving_to_another_rank_is_a_new_activation() {
    // The old descriptor is withdrawn before the new one appears, so there is no conflict; the
    // rank with the higher key releases the id before the lower one takes it in the same view.
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 2, false));
    harness.advertise(advert(R1, P1, false));
    harness.reconcile();
    harness.withdraw(P1);
    harness.advertise(advert(R0, P1, false));
    let commands = harness.reconcile();
    assert_eq!(
        resets(&commands),
        vec![(R1, false, ResetReason::SourceWithheld), (R0, false, ResetReason::Activated)]
    );
    assert_eq!(harness.tracker.active_ranks().collect::<Vec<_>>(), vec![R0]);
    assert_eq!(harness.tracker.counters().publisher_collisions, 0);
}

#[test]
fn worker_restart_with_a_new_worker_id_resets_the_old_rank_and_recovers_the_new() {
    // etcd: a new lease gives a new worker id; the old worker's facts all disappear.
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1, 2]))), vec![(R0, vec![1, 2])]);
    harness.remove_worker(1);
    let commands = harness.reconcile();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::RankRemoved)]);
    assert_eq!(harness.tracker.active_ranks().count(), 0);

    let new_rank = SourceKey { worker_id: 2, dp_rank: 0 };
    harness.add_worker(2, config(0, 1, true));
    harness.advertise(advert(new_rank, P2, true));
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(new_rank, false, ResetReason::Activated)]);
    let call = only_request(&commands);
    assert_eq!((call.source, call.publisher_id), (new_rank, P2));
    assert!(harness.events(P1, live(R0, [3])).is_empty(), "the old incarnation is gone");
    // A fresh engine dumps nothing; its ids start at 1.
    assert!(harness.events(P2, live(new_rank, [1])).is_empty());
    harness.answer(&call, dump(vec![], 0));
    let commands = harness.advance(RECOVERY_REBUILD_BATCH_WINDOW);
    assert_eq!(replaced(&commands), vec![vec![(new_rank, 0)]]);
    assert_eq!(applied(&commands), vec![(new_rank, vec![1])]);
}

#[test]
fn worker_restart_with_the_same_worker_id_and_a_new_publisher_fences_the_old_one() {
    // Kubernetes: the pod comes back under the same worker id with a new publisher id, and the
    // two advertisements overlap for a while.
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1, 2]))), vec![(R0, vec![1, 2])]);
    harness.advertise(advert(R0, P2, true));
    let commands = harness.reconcile();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::SourceWithheld)]);
    // Serving goes on; the new engine already publishes, the old one says goodbye.
    assert!(harness.events(P2, live(R0, [1, 2])).is_empty());
    assert!(harness.events(P1, live(R0, [3])).is_empty());

    harness.withdraw(P1);
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
    let call = only_request(&commands);
    assert_eq!((call.source, call.publisher_id, call.request.is_tree_dump()), (R0, P2, true));
    assert!(harness.events(P2, live(R0, [3])).is_empty());
    harness.answer(&call, dump(vec![stored(R0, 0, 1), stored(R0, 1, 2)], 2));
    let commands = harness.advance(RECOVERY_REBUILD_BATCH_WINDOW);
    assert_eq!(replaced(&commands), vec![vec![(R0, 2)]]);
    assert_eq!(applied(&commands), vec![(R0, vec![3])]);
    assert_eq!(harness.tracker.counters().events_dropped_inactive_publisher, 3);
}

// ---- live events ---------------------------------------------------------------------------

#[test]
fn mismatched_payload_rank_is_dropped() {
    let mut harness = Harness::live_only_single_rank();
    let foreign_rank = stored(R1, 1, 5);
    let foreign_worker = stored(SourceKey { worker_id: 2, dp_rank: 0 }, 1, 6);
    let commands = harness.events(P1, vec![foreign_rank, stored(R0, 1, 7), foreign_worker]);
    assert_eq!(applied(&commands), vec![(R0, vec![1])]);
    assert_eq!(harness.tracker.counters().events_dropped_mismatched_rank, 2);

    // A batch under another scope is dropped whole.
    let commands = harness.handle(SourceInput::Events(KvEventBatch {
        endpoint: other_endpoint(),
        publisher_id: P1,
        sequence: 1,
        published_at_ms: 0,
        events: live(R0, [2]),
    }));
    assert!(commands.is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_wrong_scope, 1);
}

#[test]
fn recovery_events_claiming_another_rank_fence_the_rank() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    assert!(harness.events(P1, live(R0, [1])).is_empty());
    // The dump claims a block of rank 1: the rank is reset and fenced.
    let commands = harness.answer(&call, dump(vec![stored(R0, 0, 1), stored(R1, 1, 2)], 1));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Fenced)]);
    assert!(replaced(&commands).is_empty());
    assert_eq!(harness.rank(R0).mode, RankMode::Fenced);
    assert!(harness.events(P1, live(R0, [2])).is_empty());
    assert!(harness.events(P1, vec![cleared(R0, 3)]).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_fenced, 3);
    assert_eq!(harness.tracker.poll_timeout(), None);

    // A new incarnation lifts the fence.
    harness.withdraw(P1);
    harness.advertise(advert(R0, P2, true));
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Activated)]);
    assert_eq!(only_request(&commands).publisher_id, P2);
    assert_eq!(harness.rank(R0).mode, RankMode::Recoverable);
}

#[test]
fn gap_on_recoverable_rank_requests_a_fresh_dump() {
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, 1..=5))), vec![(R0, vec![1, 2, 3, 4, 5])]);

    let commands = harness.events(P1, live(R0, [8]));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Gap)]);
    assert!(applied(&commands).is_empty());
    let call = only_request(&commands);
    assert_eq!(call.request, RecoveryRequest::tree_dump(R0));
    assert_eq!(harness.rank(R0).buffered_events, 1);

    assert!(harness.answer(&call, dump(vec![stored(R0, 0, 1)], 8)).is_empty());
    let commands = harness.advance(RECOVERY_REBUILD_BATCH_WINDOW);
    assert_eq!(replaced(&commands), vec![vec![(R0, 8)]]);
    assert!(applied(&commands).is_empty(), "event 8 is covered by the dump");
    assert_eq!(applied(&harness.events(P1, live(R0, [9]))), vec![(R0, vec![9])]);
    assert!(!harness.rank(R0).recovering);
}

#[test]
fn gap_on_live_only_rank_resets_and_continues_degraded() {
    let mut harness = Harness::live_only_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1, 2]))), vec![(R0, vec![1, 2])]);
    let commands = harness.events(P1, live(R0, [5, 6]));
    assert_eq!(resets(&commands), vec![(R0, true, ResetReason::Gap)]);
    assert_eq!(applied(&commands), vec![(R0, vec![5, 6])]);
    // The apply follows the reset and carries the new fence.
    let SourceCommand::ResetRank { fence, .. } = &commands[0] else { panic!("{commands:?}") };
    let SourceCommand::ApplyEvents { fence: apply_fence, .. } = &commands[1] else {
        panic!("{commands:?}")
    };
    assert_eq!(fence, apply_fence);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(6));
    assert_eq!(harness.tracker.poll_timeout(), None, "live-only ranks never recover");
    // Duplicates are stale.
    assert!(harness.events(P1, live(R0, [6])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_stale, 1);
}

#[test]
fn cleared_resets_the_rank_and_advances_the_cursor() {
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, 1..=3))), vec![(R0, vec![1, 2, 3])]);
    let commands = harness.events(P1, vec![cleared(R0, 4), stored(R0, 5, 9)]);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Cleared)]);
    assert_eq!(applied(&commands), vec![(R0, vec![5])]);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(5));
    // An old Cleared is stale.
    assert!(harness.events(P1, vec![cleared(R0, 4)]).is_empty());

    // A Cleared during recovery abandons it: the state is known exactly at its id.
    let commands = harness.events(P1, live(R0, [9]));
    let call = only_request(&commands);
    assert!(harness.events(P1, live(R0, [10])).is_empty());
    let stale_before = harness.tracker.counters().events_dropped_stale;
    let commands = harness.events(P1, vec![cleared(R0, 11), stored(R0, 12, 3)]);
    assert_eq!(cancels(&commands), vec![call.request_id]);
    // The buffered 9 and 10 are superseded by the clear: dropped as stale, never applied.
    assert_eq!(harness.tracker.counters().events_dropped_stale, stale_before + 2);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Cleared)]);
    assert_eq!(applied(&commands), vec![(R0, vec![12])]);
    let report = harness.rank(R0);
    assert_eq!(
        (report.cursor, report.recovering, report.buffered_events),
        (RankCursor::Live(12), false, 0)
    );
    // The late answer of the abandoned call is ignored.
    assert!(harness.answer(&call, dump(vec![], 10)).is_empty());
    assert_eq!(harness.tracker.counters().recovery_answers_stale, 1);

    // On a live-only rank a Cleared resets too (and is not degraded).
    let mut live_only = Harness::live_only_single_rank();
    live_only.events(P1, live(R0, [1]));
    let commands = live_only.events(P1, vec![cleared(R0, 2)]);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Cleared)]);
    assert_eq!(live_only.rank(R0).cursor, RankCursor::Live(2));
}

// ---- recovery ------------------------------------------------------------------------------

#[test]
fn buffered_events_drain_in_order_after_dump() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    // Live events arrive before the dump (one duplicated, one already in the dump).
    assert!(harness.events(P1, live(R0, [2, 3, 4])).is_empty());
    assert!(harness.events(P1, live(R0, [4, 5])).is_empty());
    assert_eq!(harness.rank(R0).buffered_events, 5);

    let commands = harness.answer(&call, dump(vec![stored(R0, 0, 1), stored(R0, 1, 2)], 2));
    // Sole member of the initial wave: released at once, then the buffer drains.
    assert!(matches!(commands[0], SourceCommand::ReplaceRanks { .. }));
    assert_eq!(replaced(&commands), vec![vec![(R0, 2)]]);
    assert_eq!(applied(&commands), vec![(R0, vec![3, 4, 5])]);
    assert_eq!(commands.len(), 2);
    let SourceCommand::ReplaceRanks { ranks } = &commands[0] else { unreachable!() };
    let SourceCommand::ApplyEvents { fence, .. } = &commands[1] else { unreachable!() };
    assert_eq!(ranks[0].fence, *fence);
    assert_eq!(ranks[0].events.len(), 2);
    assert_eq!(harness.tracker.counters().events_dropped_stale, 2);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(5));
}

#[test]
fn remaining_hole_triggers_range_recovery() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    assert!(harness.events(P1, live(R0, [6, 7])).is_empty());
    let commands = harness.answer(&call, dump(vec![], 3));
    assert_eq!(replaced(&commands), vec![vec![(R0, 3)]]);
    assert!(applied(&commands).is_empty());
    let range = only_request(&commands);
    assert_eq!(range.request, RecoveryRequest::range(R0, 4, Some(5)));
    assert_eq!(range.attempt, 2, "the range is the next request of the same episode");
    // More live events keep buffering.
    assert!(harness.events(P1, live(R0, [8])).is_empty());

    let response = RecoveryResponse::Events { events: live(R0, [4, 5]), last_event_id: 8 };
    let commands = harness.answer(&range, response);
    assert_eq!(applied(&commands), vec![(R0, vec![4, 5, 6, 7, 8])]);
    let report = harness.rank(R0);
    assert_eq!(
        (report.cursor, report.recovering, report.attempts),
        (RankCursor::Live(8), false, 0)
    );
}

#[test]
fn range_answer_with_a_cleared_skips_the_omitted_events() {
    let mut harness = Harness::recovered_single_rank();
    harness.events(P1, live(R0, [1]));
    let call = only_request(&harness.events(P1, live(R0, [5])));
    let commands = harness.answer(&call, dump(vec![], 1));
    let commands = [commands, harness.advance(RECOVERY_REBUILD_BATCH_WINDOW)].concat();
    let range = only_request(&commands);
    assert_eq!(range.request, RecoveryRequest::range(R0, 2, Some(4)));
    // The worker's ring buffer omits events before its latest Cleared.
    let response = RecoveryResponse::Events {
        events: vec![cleared(R0, 3), stored(R0, 4, 44)],
        last_event_id: 5,
    };
    let commands = harness.answer(&range, response);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Cleared)]);
    assert_eq!(applied(&commands), vec![(R0, vec![4, 5])]);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(5));
}

#[test]
fn the_last_event_id_fences_a_recoverable_rank_instead_of_freezing_its_cursor() {
    let mut harness = Harness::recovered_single_rank();
    assert_eq!(applied(&harness.events(P1, live(R0, [1]))), vec![(R0, vec![1])]);
    // A jump to the last id would leave a cursor no later id could pass: fenced, not applied.
    let commands = harness.events(P1, live(R0, [EVENT_ID_EXHAUSTED]));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Fenced)]);
    assert!(applied(&commands).is_empty() && requests(&commands).is_empty());
    assert_eq!(harness.rank(R0).mode, RankMode::Fenced);
    assert_ne!(harness.rank(R0).cursor, RankCursor::Live(EVENT_ID_EXHAUSTED));
    assert_eq!(harness.tracker.counters().events_dropped_id_exhausted, 1);
    assert_eq!(harness.tracker.counters().ranks_fenced, 1);
    assert!(harness.events(P1, live(R0, [2])).is_empty());
    assert_eq!(harness.tracker.counters().events_dropped_fenced, 1);

    // The next incarnation starts over and is served again.
    harness.withdraw(P1);
    harness.advertise(advert(R0, P2, true));
    let call = only_request(&harness.reconcile_and_settle());
    assert_eq!(call.publisher_id, P2);
    harness.answer(&call, dump(vec![], 0));
    harness.advance(RECOVERY_REBUILD_BATCH_WINDOW);
    assert_eq!(applied(&harness.events(P2, live(R0, [1]))), vec![(R0, vec![1])]);
    assert_eq!(harness.rank(R0).mode, RankMode::Recoverable);
}

#[test]
fn ids_up_to_one_below_the_last_apply_and_the_last_fences_a_live_only_rank() {
    let mut harness = Harness::live_only_single_rank();
    let near = EVENT_ID_EXHAUSTED - 2;
    assert_eq!(applied(&harness.events(P1, live(R0, [near]))), vec![(R0, vec![near])]);
    assert_eq!(applied(&harness.events(P1, live(R0, [near + 1]))), vec![(R0, vec![near + 1])]);
    assert_eq!(harness.rank(R0).cursor, RankCursor::Live(EVENT_ID_EXHAUSTED - 1));
    let commands = harness.events(P1, vec![cleared(R0, EVENT_ID_EXHAUSTED)]);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Fenced)]);
    assert_eq!(harness.rank(R0).mode, RankMode::Fenced);
    assert_eq!(harness.tracker.counters().events_dropped_id_exhausted, 1);
}

#[test]
fn recovery_answers_reaching_the_last_id_fence_the_rank() {
    // A dump whose live position is the last id.
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    let commands = harness.answer(&call, dump(vec![stored(R0, 0, 1)], EVENT_ID_EXHAUSTED));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Fenced)]);
    assert!(replaced(&harness.advance(RECOVERY_REBUILD_BATCH_WINDOW)).is_empty());
    assert_eq!(harness.rank(R0).mode, RankMode::Fenced);

    // A range answer carrying the last id, or naming it as the newest.
    for response in [
        RecoveryResponse::Events { events: live(R0, [2, EVENT_ID_EXHAUSTED]), last_event_id: 3 },
        RecoveryResponse::Events { events: live(R0, [2]), last_event_id: EVENT_ID_EXHAUSTED },
    ] {
        let mut harness = Harness::recovered_single_rank();
        harness.events(P1, live(R0, [1]));
        let call = only_request(&harness.events(P1, live(R0, [5])));
        let commands = harness.answer(&call, dump(vec![], 1));
        let commands = [commands, harness.advance(RECOVERY_REBUILD_BATCH_WINDOW)].concat();
        let range = only_request(&commands);
        let commands = harness.answer(&range, response);
        assert_eq!(resets(&commands), vec![(R0, false, ResetReason::Fenced)]);
        assert!(applied(&commands).is_empty());
        assert_eq!(harness.rank(R0).mode, RankMode::Fenced);
    }
}

#[test]
fn tree_dump_failure_retries_with_backoff_then_degrades() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let mut call = only_request(&harness.reconcile_and_settle());
    assert!(harness.events(P1, live(R0, [1, 2])).is_empty());

    let mut backoffs = Vec::new();
    for attempt in 1..RECOVERY_ATTEMPTS_MAX {
        assert_eq!(call.attempt, attempt);
        assert!(harness.answer(&call, dump_failed()).is_empty());
        let failed_at = harness.now;
        let commands = harness.next_timer();
        backoffs.push(harness.now - failed_at);
        call = only_request(&commands);
        assert!(call.request.is_tree_dump());
    }
    assert_eq!(backoffs, [200, 400, 800, 1600, 3200, 5000, 5000].map(ms).to_vec());
    assert_eq!(call.attempt, RECOVERY_ATTEMPTS_MAX);

    // The last attempt fails too: degraded reset, then the buffered events, live-only.
    let commands = harness.answer(&call, dump_failed());
    assert_eq!(resets(&commands), vec![(R0, true, ResetReason::RecoveryFailed)]);
    assert_eq!(applied(&commands), vec![(R0, vec![1, 2])]);
    assert_eq!(harness.rank(R0).mode, RankMode::Degraded);
    assert_eq!(harness.tracker.counters().ranks_degraded, 1);
    assert_eq!(harness.tracker.counters().recovery_retries, u64::from(RECOVERY_ATTEMPTS_MAX - 1));
    assert_eq!(harness.tracker.poll_timeout(), None);
    // Degraded ranks carry on live-only: a gap resets (degraded) instead of recovering.
    let commands = harness.events(P1, live(R0, [3, 7]));
    assert_eq!(resets(&commands), vec![(R0, true, ResetReason::Gap)]);
    assert_eq!(applied(&commands), vec![(R0, vec![3]), (R0, vec![7])]);
    // A Cleared re-establishes exact state, and recovery with it.
    harness.events(P1, vec![cleared(R0, 8)]);
    assert_eq!(harness.rank(R0).mode, RankMode::Recoverable);
}

#[test]
fn attempt_timeout_cancels_and_retries() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    // The initial wave's deadline (30 s after activation) may come first; nothing happens then.
    assert!(harness.tracker.poll_timeout() <= Some(call.deadline));
    harness.now = call.deadline - ms(1);
    assert!(harness.advance(ms(0)).is_empty());
    let commands = harness.advance(ms(1));
    assert_eq!(cancels(&commands), vec![call.request_id]);
    assert!(requests(&commands).is_empty());
    let retry = only_request(&harness.next_timer());
    assert_eq!(retry.attempt, 2);
    assert_eq!(harness.tracker.counters().recovery_timeouts, 1);
    // An unreachable target retries the same way.
    harness.handle(SourceInput::RecoveryUnreachable {
        request_id: retry.request_id,
        failure: RecoveryFailure::Refused("Server overloaded".into()),
    });
    assert_eq!(only_request(&harness.next_timer()).attempt, 3);
}

#[test]
fn other_recovery_failures_degrade_at_once() {
    for response in [
        RecoveryResponse::Error("boom".into()),
        RecoveryResponse::TooNew {
            requested_start: 4,
            requested_end: Some(5),
            newest_available: 2,
        },
        RecoveryResponse::InvalidRange { start_id: 4, end_id: Some(5) },
    ] {
        let mut harness = Harness::new();
        harness.add_worker(1, config(0, 1, true));
        harness.advertise(advert(R0, P1, true));
        let call = only_request(&harness.reconcile_and_settle());
        harness.events(P1, live(R0, [4]));
        let commands = harness.answer(&call, response);
        assert_eq!(resets(&commands), vec![(R0, true, ResetReason::RecoveryFailed)]);
        assert_eq!(applied(&commands), vec![(R0, vec![4])]);
        assert_eq!(harness.rank(R0).mode, RankMode::Degraded);
    }
}

#[test]
fn non_authoritative_answers_are_retried() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    let partial = RecoveryResponse::TreeDump {
        events: vec![],
        last_event_id: 3,
        reset_scope: TreeDumpScope::Other("state_agent".into()),
    };
    assert!(harness.answer(&call, partial).is_empty());
    let call = only_request(&harness.next_timer());
    // A range answer cannot rebuild a rank without a position.
    let range = RecoveryResponse::Events { events: live(R0, [1]), last_event_id: 1 };
    assert!(harness.answer(&call, range).is_empty());
    assert_eq!(only_request(&harness.next_timer()).attempt, 3);
    assert_eq!(harness.tracker.counters().recovery_answers_non_authoritative, 2);
}

#[test]
fn buffer_overflow_drops_the_buffer_resets_and_requests_a_fresh_dump() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = only_request(&harness.reconcile_and_settle());
    let limit = LIVE_BUFFER_EVENTS_MAX as u64;
    assert!(harness.events(P1, live(R0, 1..=limit)).is_empty());
    assert_eq!(harness.rank(R0).buffered_events, LIVE_BUFFER_EVENTS_MAX);

    let commands = harness.events(P1, live(R0, [limit + 1]));
    assert_eq!(cancels(&commands), vec![call.request_id]);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::BufferOverflow)]);
    let fresh = only_request(&commands);
    assert!(fresh.request.is_tree_dump());
    assert_eq!(fresh.attempt, 2, "an overflow spends an attempt of the episode");
    assert_eq!(harness.rank(R0).buffered_events, 0);
    let counters = *harness.tracker.counters();
    assert_eq!((counters.buffer_overflows, counters.events_dropped_overflow), (1, limit + 1));

    // The fresh dump covers everything dropped.
    let commands = harness.answer(&fresh, dump(vec![], limit + 1));
    assert_eq!(replaced(&commands), vec![vec![(R0, limit + 1)]]);
    assert_eq!(applied(&harness.events(P1, live(R0, [limit + 2]))), vec![(R0, vec![limit + 2])]);
}

/// A live store of `blocks` blocks: one event the size of a hostile worker's.
fn heavy(source: SourceKey, event_id: u64, blocks: u64) -> RouterEvent {
    let mut event = stored(source, event_id, event_id.wrapping_add(1000));
    if let KvCacheEventData::Stored(store) = &mut event.event.data {
        let template = store.blocks[0];
        store.blocks = (0..blocks)
            .map(|i| StoredBlock {
                block_hash: ExternalBlockHash(template.block_hash.0.wrapping_add(i << 20)),
                ..template
            })
            .collect();
    }
    event
}

#[test]
fn the_live_buffer_is_bounded_in_bytes_before_an_event_is_held() {
    // Room for two 4,096-block events, not three: the event bound (1024) is never near.
    let per_event = heavy(R0, 1, 4096).weight_bytes();
    let config = SourceTrackerConfig {
        live_buffer_bytes_max: 2 * per_event + per_event / 2,
        ..SourceTrackerConfig::default()
    };
    let mut harness = Harness::with_config(config);
    harness.add_worker(1, self::config(0, 2, true));
    harness.advertise(advert(R0, P1, true));
    harness.advertise(advert(R1, P2, true));
    let calls = requests(&harness.reconcile_and_settle());
    let first = call_for(&calls, R0);
    assert!(harness.events(P1, vec![heavy(R0, 1, 4096), heavy(R0, 2, 4096)]).is_empty());
    assert_eq!(harness.rank(R0).buffered_events, 2);
    // The third would pass the bound: the buffer goes, the rank resets and asks for a fresh dump.
    let commands = harness.events(P1, vec![heavy(R0, 3, 4096)]);
    assert_eq!(cancels(&commands), vec![first.request_id]);
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::BufferOverflow)]);
    assert!(only_request(&commands).request.is_tree_dump());
    assert_eq!(harness.rank(R0).buffered_events, 0);
    let counters = *harness.tracker.counters();
    assert_eq!(
        (
            counters.buffer_overflows,
            counters.buffer_byte_overflows,
            counters.events_dropped_overflow
        ),
        (1, 1, 3)
    );
    // The other rank still buffers small events as before.
    assert!(harness.events(P2, live(R1, 1..=8)).is_empty());
    assert_eq!(harness.rank(R1).buffered_events, 8);
    harness.tracker.check_invariants().expect("invariants hold");
}

#[test]
fn every_bound_of_the_tracker_config_is_validated() {
    let base = SourceTrackerConfig::default();
    assert_eq!(base.validate(), Ok(()));
    // The smallest usable value of each bound is accepted; zero is refused by name.
    let tiny = Duration::from_nanos(1);
    let smallest = SourceTrackerConfig {
        recovery_attempt_timeout: tiny,
        recovery_attempts_max: 1,
        recovery_fetches_in_flight_max: 1,
        live_buffer_events_max: 1,
        live_buffer_bytes_max: 1,
        rebuild_batch_age_max: tiny,
        recovery_backoff_initial: base.recovery_backoff_max,
        ..base
    };
    assert_eq!(smallest.validate(), Ok(()), "equal backoffs are in order");
    let zeroed: [(&str, SourceTrackerConfig); 6] = [
        (
            "recovery_attempt_timeout",
            SourceTrackerConfig { recovery_attempt_timeout: Duration::ZERO, ..smallest },
        ),
        ("recovery_attempts_max", SourceTrackerConfig { recovery_attempts_max: 0, ..smallest }),
        (
            "recovery_fetches_in_flight_max",
            SourceTrackerConfig { recovery_fetches_in_flight_max: 0, ..smallest },
        ),
        ("live_buffer_events_max", SourceTrackerConfig { live_buffer_events_max: 0, ..smallest }),
        ("live_buffer_bytes_max", SourceTrackerConfig { live_buffer_bytes_max: 0, ..smallest }),
        (
            "rebuild_batch_age_max",
            SourceTrackerConfig { rebuild_batch_age_max: Duration::ZERO, ..smallest },
        ),
    ];
    for (field, config) in zeroed {
        assert_eq!(config.validate(), Err(SourceConfigError::NotPositive { field }));
    }
    let reversed =
        SourceTrackerConfig { recovery_backoff_initial: base.recovery_backoff_max + tiny, ..base };
    assert_eq!(reversed.validate(), Err(SourceConfigError::BackoffOrder));
}

#[test]
fn buffer_overflow_with_a_dump_in_hand_releases_the_batch_early() {
    let config =
        SourceTrackerConfig { live_buffer_events_max: 4, ..SourceTrackerConfig::default() };
    let mut harness = Harness::with_config(config);
    harness.add_worker(1, self::config(0, 2, true));
    harness.advertise(advert(R0, P1, true));
    harness.advertise(advert(R1, P2, true));
    let calls = requests(&harness.reconcile_and_settle());
    assert_eq!(calls.len(), 2);
    // Rank 0 has its dump but waits for rank 1 (initial wave).
    assert!(harness.answer(&call_for(&calls, R0), dump(vec![], 0)).is_empty());
    assert!(harness.events(P1, live(R0, 1..=4)).is_empty());
    let commands = harness.events(P1, live(R0, [5]));
    assert_eq!(replaced(&commands), vec![vec![(R0, 0)]]);
    assert_eq!(applied(&commands), vec![(R0, vec![1, 2, 3, 4, 5])]);
    // The wave stays open for rank 1, which is then replaced on its own.
    assert!(harness.tracker.initial_wave_open());
    let commands = harness.answer(&call_for(&calls, R1), dump(vec![], 0));
    assert_eq!(replaced(&commands), vec![vec![(R1, 0)]]);
    assert!(!harness.tracker.initial_wave_open());
}

#[test]
fn buffer_overflows_count_against_the_attempt_bound() {
    let config =
        SourceTrackerConfig { live_buffer_events_max: 2, ..SourceTrackerConfig::default() };
    let mut harness = Harness::with_config(config);
    harness.add_worker(1, self::config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    harness.reconcile_and_settle();
    let mut next_id = 1;
    let mut degraded = false;
    for _ in 0..RECOVERY_ATTEMPTS_MAX {
        let commands = harness.events(P1, live(R0, next_id..next_id + 3));
        next_id += 3;
        if resets(&commands).contains(&(R0, true, ResetReason::RecoveryFailed)) {
            degraded = true;
            break;
        }
    }
    assert!(degraded);
    assert_eq!(harness.rank(R0).mode, RankMode::Degraded);
}

#[test]
fn initial_wave_batches_replacements() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 3, true));
    for (rank, publisher) in [(R0, 0xA0), (R1, 0xA1), (R2, 0xA2)] {
        harness.advertise(advert(rank, publisher, true));
    }
    let commands = harness.reconcile_and_settle();
    assert_eq!(resets(&commands).len(), 3);
    let calls = requests(&commands);
    assert_eq!(calls.iter().map(|call| call.source).collect::<BTreeSet<_>>(), [R0, R1, R2].into());
    assert!(harness.tracker.initial_wave_open());

    assert!(harness.answer(&call_for(&calls, R2), dump(vec![stored(R2, 0, 3)], 9)).is_empty());
    assert!(harness.events(0xA0, live(R0, [1])).is_empty());
    assert!(harness.answer(&call_for(&calls, R0), dump(vec![], 0)).is_empty());
    // The last member of the wave answers: one transactional replacement of all three.
    let commands = harness.answer(&call_for(&calls, R1), dump(vec![stored(R1, 0, 2)], 4));
    assert_eq!(replaced(&commands), vec![vec![(R0, 0), (R1, 4), (R2, 9)]]);
    assert_eq!(applied(&commands), vec![(R0, vec![1])]);
    assert!(!harness.tracker.initial_wave_open());
    let counters = harness.tracker.counters();
    assert_eq!((counters.replace_batches, counters.ranks_replaced), (1, 3));
}

#[test]
fn initial_wave_is_released_at_its_deadline() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 2, true));
    harness.advertise(advert(R0, 0xA0, true));
    harness.advertise(advert(R1, 0xA1, true));
    let calls = requests(&harness.reconcile_and_settle());
    assert!(harness.answer(&call_for(&calls, R0), dump(vec![], 5)).is_empty());
    // Rank 1 never answers: the wave waits until the attempt timeout after its start.
    assert_eq!(harness.tracker.poll_timeout(), Some(RECOVERY_ATTEMPT_TIMEOUT));
    let commands = harness.next_timer();
    assert_eq!(replaced(&commands), vec![vec![(R0, 5)]]);
    assert!(!harness.tracker.initial_wave_open());
    // Rank 1's attempt times out and is retried; its dump is a later replacement.
    let mut commands = Vec::new();
    while requests(&commands).is_empty() {
        commands = harness.next_timer();
    }
    let retry = only_request(&commands);
    assert_eq!(retry.attempt, 2);
    assert!(harness.answer(&retry, dump(vec![], 0)).is_empty());
    let commands = harness.next_timer();
    assert_eq!(replaced(&commands), vec![vec![(R1, 0)]]);
}

#[test]
fn later_replacements_batch_after_a_quiet_window() {
    let mut harness = Harness::recovered_single_rank();
    // Two more ranks appear after the initial wave.
    harness.add_worker(1, config(0, 3, true));
    harness.advertise(advert(R1, 0xC1, true));
    harness.advertise(advert(R2, 0xC2, true));
    let calls = requests(&harness.reconcile_and_settle());
    assert_eq!(calls.len(), 2);
    assert!(harness.answer(&call_for(&calls, R1), dump(vec![], 1)).is_empty());
    // Each new dump restarts the quiet window.
    assert!(harness.advance(ms(4)).is_empty());
    assert!(harness.answer(&call_for(&calls, R2), dump(vec![], 2)).is_empty());
    assert!(harness.advance(ms(4)).is_empty());
    let commands = harness.advance(ms(1));
    assert_eq!(replaced(&commands), vec![vec![(R1, 1), (R2, 2)]]);
}

#[test]
fn recovery_fetches_in_flight_are_bounded() {
    let mut harness = Harness::new();
    let ranks = RECOVERY_FETCHES_IN_FLIGHT_MAX as u32 + 4;
    harness.add_worker(1, config(0, ranks, true));
    for dp_rank in 0..ranks {
        harness.advertise(advert(
            SourceKey { worker_id: 1, dp_rank },
            0x100 + u64::from(dp_rank),
            true,
        ));
    }
    let calls = requests(&harness.reconcile_and_settle());
    assert_eq!(calls.len(), RECOVERY_FETCHES_IN_FLIGHT_MAX);
    assert_eq!(harness.tracker.in_flight_count(), RECOVERY_FETCHES_IN_FLIGHT_MAX);
    // The due requests wait for a slot, not a timer: the next timer is a call's deadline.
    let next = harness.tracker.poll_timeout().expect("the calls' deadlines are armed");
    assert!(next > harness.now, "a due request waiting for a slot is not a timer: {next:?}");
    // Each answer frees a slot for the next due rank.
    let commands = harness.answer(&calls[0], dump(vec![], 0));
    assert_eq!(requests(&commands).len(), 1);
    assert_eq!(harness.tracker.in_flight_count(), RECOVERY_FETCHES_IN_FLIGHT_MAX);
}

#[test]
fn pool_failures_rerecover_only_for_the_current_fence() {
    let mut harness = Harness::recovered_single_rank();
    let commands = harness.events(P1, live(R0, [1]));
    let SourceCommand::ApplyEvents { fence, .. } = commands[0] else { panic!("{commands:?}") };
    let fault = |fence| SourceInput::ApplyFailed {
        source: R0,
        fence,
        disposition: FailureDisposition::RejectSource,
    };
    let commands = harness.handle(fault(fence));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::SourceFault)]);
    assert!(only_request(&commands).request.is_tree_dump());
    // A second report about the same (now replaced) state is stale.
    assert!(harness.handle(fault(fence)).is_empty());
    assert_eq!(harness.tracker.counters().faults_stale, 1);
    // Producer-level failures are the host's business.
    let current = harness.rank(R0).fence;
    let producer = SourceInput::ApplyFailed {
        source: R0,
        fence: current,
        disposition: FailureDisposition::FenceAndRebuildProducer,
    };
    assert!(harness.handle(producer).is_empty());
    assert_eq!(harness.tracker.counters().faults_producer, 1);
}

#[test]
fn repeated_pool_failures_degrade_the_rank() {
    let mut harness = Harness::recovered_single_rank();
    let mut degraded = false;
    for _ in 0..=SOURCE_FAULT_RECOVERIES_MAX {
        let fence = harness.rank(R0).fence;
        let commands = harness.handle(SourceInput::ApplyFailed {
            source: R0,
            fence,
            disposition: FailureDisposition::ReportResourceFailure,
        });
        if resets(&commands).contains(&(R0, true, ResetReason::SourceFault)) {
            degraded = true;
        }
    }
    assert!(degraded);
    assert_eq!(harness.rank(R0).mode, RankMode::Degraded);
}

#[test]
fn config_rejects_unusable_bounds() {
    let bad = SourceTrackerConfig { live_buffer_events_max: 0, ..SourceTrackerConfig::default() };
    assert_eq!(
        SourceTracker::new(bad).err(),
        Some(SourceConfigError::NotPositive { field: "live_buffer_events_max" })
    );
    let bad = SourceTrackerConfig {
        recovery_backoff_initial: ms(10_000),
        ..SourceTrackerConfig::default()
    };
    assert_eq!(SourceTracker::new(bad).err(), Some(SourceConfigError::BackoffOrder));
}

// ---- against the pool ----------------------------------------------------------------------

/// Carry the tracker's commands out against a real pool, as the shell will.
fn execute(pool: &mut PoolOwnership, commands: &[SourceCommand]) {
    for command in commands {
        match command {
            SourceCommand::ResetRank { source, .. } => pool.remove_rank(*source).unwrap(),
            SourceCommand::ReplaceRanks { ranks } => {
                let mut replacements = BTreeMap::new();
                for dump in ranks {
                    let mut replacement = RankReplacement::new(pool.table_key());
                    for event in &dump.events {
                        replacement.push_event(event).unwrap();
                    }
                    replacements.insert(dump.source, replacement);
                }
                pool.replace_ranks(replacements).unwrap();
            }
            SourceCommand::ApplyEvents { events, .. } => {
                for event in events {
                    pool.apply_event(event).unwrap();
                }
            }
            SourceCommand::RequestRecovery(_) | SourceCommand::CancelRecovery { .. } => {}
        }
    }
}

fn rank_blocks(pool: &PoolOwnership, source: SourceKey) -> usize {
    pool.sources().find(|(key, _)| *key == source).map_or(0, |(_, blocks)| blocks)
}

#[test]
fn commands_line_up_with_pool_ownership() {
    let mut pool =
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(1))
            .unwrap();
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let commands = harness.reconcile_and_settle();
    execute(&mut pool, &commands);
    let call = only_request(&commands);
    // A live child of a dumped block arrives before the dump.
    execute(&mut pool, &harness.events(P1, vec![stored_child(R0, 3, Some(11), 12)]));
    let tree = vec![stored(R0, 0, 10), stored_child(R0, 1, Some(10), 11)];
    execute(&mut pool, &harness.answer(&call, dump(tree, 2)));
    assert_eq!(rank_blocks(&pool, R0), 3);
    execute(&mut pool, &harness.events(P1, vec![cleared(R0, 4)]));
    assert_eq!(rank_blocks(&pool, R0), 0);
    execute(&mut pool, &harness.events(P1, vec![stored(R0, 5, 20)]));
    assert_eq!(rank_blocks(&pool, R0), 1);
    // The worker leaves: its rank is removed.
    harness.remove_worker(1);
    execute(&mut pool, &harness.reconcile());
    assert_eq!(pool.owned_block_count(), 0);
    pool.check_invariants().unwrap();
}

// ---- robustness ----------------------------------------------------------------------------

/// Random inputs (membership churn, events with random ids, random answers and failures, time
/// jumps) never panic and never break the tracker's invariants.
#[test]
fn random_inputs_keep_invariants() {
    for seed in 0..64 {
        let mut dice = rng_from_seed(1000 + seed);
        let config =
            SourceTrackerConfig { live_buffer_events_max: 8, ..SourceTrackerConfig::default() };
        let mut harness = Harness::with_config(config);
        let mut calls: Vec<RecoveryCall> = Vec::new();
        for _ in 0..300 {
            let roll = dice.next_u32() % 100;
            let worker_id = 1 + u64::from(dice.next_u32() % 3);
            let dp_rank = dice.next_u32() % 2;
            let rank = SourceKey { worker_id, dp_rank };
            let publisher_id = 1 + u64::from(dice.next_u32() % 8);
            let commands = match roll {
                0..=5 => {
                    let size = dice.next_u32() % 3;
                    harness.add_worker(
                        worker_id,
                        config_with(size, dice.next_u32().is_multiple_of(2)),
                    );
                    harness.reconcile()
                }
                6..=8 => {
                    harness.remove_worker(worker_id);
                    harness.reconcile()
                }
                9..=16 => {
                    let _ = harness.adverts.advertise(advert(
                        rank,
                        publisher_id,
                        !dice.next_u32().is_multiple_of(3),
                    ));
                    harness.reconcile()
                }
                17..=21 => {
                    harness.withdraw(publisher_id);
                    harness.reconcile()
                }
                22..=60 => {
                    let count = dice.next_u32() % 5;
                    let events = (0..count)
                        .map(|_| {
                            let id = u64::from(dice.next_u32() % 40);
                            let source = if dice.next_u32().is_multiple_of(10) { R1 } else { rank };
                            if dice.next_u32().is_multiple_of(15) {
                                cleared(source, id)
                            } else {
                                stored(source, id, id)
                            }
                        })
                        .collect();
                    harness.events(publisher_id, events)
                }
                61..=80 if !calls.is_empty() => {
                    let call = calls.remove(dice.next_u32() as usize % calls.len());
                    let last = u64::from(dice.next_u32() % 40);
                    let response = match dice.next_u32() % 6 {
                        0 | 1 => dump(vec![stored(call.source, 0, 1)], last),
                        2 => RecoveryResponse::Events {
                            events: live(call.source, last..last + 3),
                            last_event_id: last + 2,
                        },
                        3 => dump_failed(),
                        4 => RecoveryResponse::Error("x".into()),
                        _ => dump(vec![stored(R2, 0, 1)], last),
                    };
                    harness.answer(&call, response)
                }
                81..=85 => {
                    let fence =
                        harness.tracker.rank(rank).map_or(RankFence(0), |report| report.fence);
                    harness.handle(SourceInput::ApplyFailed {
                        source: rank,
                        fence,
                        disposition: FailureDisposition::RejectSource,
                    })
                }
                _ => harness.advance(ms(u64::from(dice.next_u32() % 3000))),
            };
            calls.extend(requests(&commands));
            for command in &commands {
                if let SourceCommand::ReplaceRanks { ranks } = command {
                    let sources: BTreeSet<SourceKey> =
                        ranks.iter().map(|dump| dump.source).collect();
                    assert_eq!(sources.len(), ranks.len(), "seed {seed}: one dump per rank");
                }
            }
        }
    }
}

fn config_with(size: u32, local_indexer: bool) -> RuntimeConfig {
    config(0, size, local_indexer)
}
