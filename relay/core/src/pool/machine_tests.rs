//! Tests of the pool machine: cadence and its timer, publication points, scripted replay, and
//! the invariant audit firing on a bad state.

use super::*;
use crate::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, StorageTier, StoreData, StoredBlock,
};
use crate::pool::{LeaseRecord, PublicationScript};
use crate::rng::rng_from_seed;
use crate::sources::RankDump;

const MS: Duration = Duration::from_millis(1);
const FENCE: RankFence = RankFence(3);

/// Collects every delta; refuses them all while `closed`.
#[derive(Debug, Default)]
struct Outlet {
    deltas: Vec<Delta>,
    closed: bool,
}

impl DeltaOutlet for Outlet {
    fn offer(&mut self, delta: Delta) -> Result<(), Delta> {
        if self.closed {
            return Err(delta);
        }
        self.deltas.push(delta);
        Ok(())
    }

    fn has_receivers(&self) -> bool {
        !self.closed
    }
}

fn lease(epoch: u64) -> LaneLease {
    LaneLease { consumer_instance: 1, physical_lane: 0, assignment_epoch: epoch }
}

fn store(external: u64, parent: Option<u64>) -> RouterEvent {
    RouterEvent {
        worker_id: 1,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: external,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: parent.map(ExternalBlockHash),
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(external),
                    tokens_hash: LocalBlockHash(external.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                }],
            }),
        },
    }
}

fn machine(role: PublicationRole) -> PoolMachine {
    let pool =
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
            .expect("pool");
    let cadence = CadenceConfig { threshold_events: 16, delay: MS };
    PoolMachine::new(pool, cadence, role)
}

fn effects(machine: &mut PoolMachine) -> Vec<PoolEffect> {
    std::iter::from_fn(|| machine.poll_effect()).collect()
}

fn recorded_points(machine: &mut PoolMachine) -> Vec<PublicationPoint> {
    effects(machine)
        .into_iter()
        .filter_map(|effect| match effect {
            PoolEffect::Point(point) => Some(point),
            _ => None,
        })
        .collect()
}

fn points(machine: &mut PoolMachine) -> Vec<PublicationStep> {
    recorded_points(machine).into_iter().map(|point| point.step).collect()
}

fn subscribed(machine: &mut PoolMachine, epoch: u64, outlet: &mut Outlet) -> Snapshot {
    assert_eq!(machine.subscribe(lease(epoch), outlet), SubscribeStep::Barrier);
    machine.barrier(lease(epoch), outlet).expect("barrier")
}

#[test]
fn the_timer_publishes_one_delay_after_the_first_pending_event() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    assert_eq!(subscribed(&mut pool, 1, &mut outlet).sequence, 0);
    assert_eq!(pool.poll_timeout(), None);
    pool.apply(FENCE, &[store(1, None)], 10 * MS, &mut outlet);
    assert_eq!(pool.poll_timeout(), Some(11 * MS));
    // A second event does not push the deadline back.
    pool.apply(FENCE, &[store(2, None)], 10 * MS + MS / 2, &mut outlet);
    assert_eq!(pool.poll_timeout(), Some(11 * MS));
    pool.handle_timeout(10 * MS + MS / 2, &mut outlet);
    assert!(outlet.deltas.is_empty(), "nothing before the deadline");
    pool.handle_timeout(11 * MS, &mut outlet);
    assert_eq!(outlet.deltas.len(), 1);
    assert_eq!((outlet.deltas[0].base_sequence, outlet.deltas[0].sequence), (0, 1));
    assert_eq!(outlet.deltas[0].images.len(), 2.min(outlet.deltas[0].images.len()));
    assert_eq!(pool.poll_timeout(), None, "the timer is disarmed by the publication");
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn the_threshold_cuts_a_batch_inside_the_input_without_the_timer() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    let events: Vec<RouterEvent> = (1..=16).map(|i| store(i, None)).collect();
    pool.apply(FENCE, &events, Duration::ZERO, &mut outlet);
    assert_eq!(outlet.deltas.len(), 1);
    assert_eq!(pool.poll_timeout(), None);
    // Failed events count toward the threshold too, and are reported.
    let failing: Vec<RouterEvent> = (100..116).map(|i| store(i, Some(9_999))).collect();
    pool.apply(FENCE, &failing, Duration::ZERO, &mut outlet);
    let faults: Vec<PoolFault> = effects(&mut pool)
        .into_iter()
        .filter_map(|effect| match effect {
            PoolEffect::Fault(fault) => Some(fault),
            _ => None,
        })
        .collect();
    assert_eq!(faults.len(), 16);
    assert_eq!(faults[0].error, ApplyError::ParentBlockNotFound(9_999));
    assert_eq!(faults[0].event_id, 100);
    assert!(faults.iter().all(|fault| fault.fence == FENCE), "a fault names its command's fence");
    assert_eq!(pool.poll_timeout(), None, "nothing unpublished: no timer");
}

#[test]
fn a_reporting_machine_emits_every_point_its_inputs_do_not_determine() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Reported);
    subscribed(&mut pool, 1, &mut outlet);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    pool.handle_timeout(MS, &mut outlet);
    assert_eq!(outlet.deltas.len(), 1, "the timer published");
    pool.apply(FENCE, &[store(2, None)], MS, &mut outlet);
    assert_eq!(pool.flush(&mut outlet), Ok(2));
    pool.retire_lease(lease(1));
    assert_eq!(
        points(&mut pool),
        [
            PublicationStep::Barrier(LeaseRecord(1, 0, 1)),
            // The timer's publication is no point: the journal records the firing itself.
            PublicationStep::Publish,
            PublicationStep::RetireLease(LeaseRecord(1, 0, 1)),
        ]
    );
    // A delta nobody takes is a point of its own, with its ordinal, and fences delivery.
    subscribed(&mut pool, 2, &mut outlet);
    outlet.closed = true;
    pool.apply(FENCE, &[store(3, None)], MS, &mut outlet);
    assert_eq!(pool.flush(&mut outlet), Err(PublishError::DeliveryFailed));
    assert_eq!(pool.stats().fence, Some(FenceReason::DeliveryUncertain));
    let steps = points(&mut pool);
    assert_eq!(steps[1], PublicationStep::DeliveryFailed(2));
    // The free machine emits none of them.
    let mut free = machine(PublicationRole::Free);
    subscribed(&mut free, 1, &mut outlet);
    assert!(points(&mut free).is_empty());
}

#[test]
fn a_scripted_machine_replays_the_recorded_points_and_holds_subscribers_until_they_fit() {
    let at = |commands| ScriptPosition { commands, ..ScriptPosition::default() };
    let point =
        |commands, step, sequence| PublicationPoint { position: at(commands), step, sequence };
    let script = PublicationScript {
        points: vec![
            point(0, PublicationStep::Barrier(LeaseRecord(1, 0, 1)), 0),
            point(2, PublicationStep::Publish, 1),
        ],
        until: 100 * MS,
    };
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Scripted(script));
    assert!(pool.is_scripted());
    let SubscribeStep::Held(hold) = pool.subscribe(lease(1), &mut outlet) else {
        panic!("a scripted machine holds subscriptions");
    };
    // The recorded barrier is at position 0: performed at once, and the holder answered.
    let answered = effects(&mut pool);
    assert_eq!(answered.len(), 1);
    let PoolEffect::Answer { hold: answered_hold, snapshot } = &answered[0] else {
        panic!("answered: {answered:?}");
    };
    assert_eq!((*answered_hold, snapshot.sequence, snapshot.lease), (hold, 0, lease(1)));
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    // The timer is armed as in production: its firings are replayed as inputs.
    assert_eq!(pool.poll_timeout(), Some(MS), "the publication timer, before the script's end");
    assert!(outlet.deltas.is_empty());
    pool.apply(FENCE, &[store(2, None)], Duration::ZERO, &mut outlet);
    assert_eq!(outlet.deltas.len(), 1, "the recorded flush after the second batch");
    assert_eq!(pool.script_mismatches(), 0);
    assert_eq!(pool.poll_timeout(), Some(100 * MS), "published: only the script's end is left");
    // A flush does not publish while scripted, and a subscriber under another lease waits.
    pool.apply(FENCE, &[store(3, None)], 2 * MS, &mut outlet);
    assert_eq!(pool.flush(&mut outlet), Ok(1));
    let SubscribeStep::Held(waiting) = pool.subscribe(lease(2), &mut outlet) else {
        panic!("held");
    };
    assert!(effects(&mut pool).is_empty());
    // A timer firing publishes the tail while scripted, and answers nobody under another lease.
    pool.handle_timeout(3 * MS, &mut outlet);
    assert_eq!(outlet.deltas.len(), 2);
    assert!(effects(&mut pool).is_empty());
    assert_eq!(pool.poll_timeout(), Some(100 * MS));
    // At the script's end the machine runs free: the held one is released.
    pool.apply(FENCE, &[store(4, None)], 99 * MS, &mut outlet);
    pool.handle_timeout(100 * MS, &mut outlet);
    assert!(!pool.is_scripted());
    assert_eq!(effects(&mut pool), [PoolEffect::Release { hold: waiting, lease: lease(2) }]);
    assert_eq!(outlet.deltas.len(), 3, "the tail's timer was due too");
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn a_scripted_machine_answers_a_held_subscriber_once_its_timer_published_the_tail() {
    let script = PublicationScript {
        points: vec![PublicationPoint {
            position: ScriptPosition::default(),
            step: PublicationStep::Barrier(LeaseRecord(1, 0, 1)),
            sequence: 0,
        }],
        until: 100 * MS,
    };
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Scripted(script));
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    // Unpublished writes: a subscriber under the recorded lease is held, not answered.
    let SubscribeStep::Held(hold) = pool.subscribe(lease(1), &mut outlet) else {
        panic!("held");
    };
    assert!(effects(&mut pool).is_empty());
    pool.handle_timeout(MS, &mut outlet);
    let answered = effects(&mut pool);
    let [PoolEffect::Answer { hold: answered_hold, snapshot }] = answered.as_slice() else {
        panic!("answered once the timer published: {answered:?}");
    };
    assert_eq!((*answered_hold, snapshot.sequence), (hold, 1));
}

#[test]
fn a_point_recorded_right_after_a_timer_publication_is_replayed_after_it() {
    // Recording: a barrier, one write, the timer publishes it (sequence 1), the subscriber
    // leaves — no command between the publication and the retirement.
    let mut outlet = Outlet::default();
    let mut recording = machine(PublicationRole::Reported);
    subscribed(&mut recording, 1, &mut outlet);
    recording.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    recording.handle_timeout(MS, &mut outlet);
    recording.retire_lease(lease(1));
    let points = recorded_points(&mut recording);
    let retirement = points.last().expect("points");
    assert_eq!(retirement.step, PublicationStep::RetireLease(LeaseRecord(1, 0, 1)));
    assert_eq!(retirement.position, ScriptPosition { commands: 1, digests: 0, timers: 1 });
    assert_eq!(recording.stats().sequence, 1);

    // Replay: the same write and the same firing, no subscriber. The retirement waits for the
    // timer's publication, which is numbered under the recorded lease as it was.
    let script = PublicationScript { points, until: 100 * MS };
    let mut replay = machine(PublicationRole::Scripted(script));
    replay.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    assert_eq!(replay.stats().lease, Some(lease(1)), "not retired before the firing");
    replay.handle_timeout(MS, &mut outlet);
    assert_eq!((replay.stats().sequence, replay.stats().lease), (1, None));
    assert_eq!(replay.script_mismatches(), 0);
}

#[test]
fn a_replay_that_leaves_the_recorded_sequence_is_counted() {
    let script = PublicationScript {
        points: vec![PublicationPoint {
            position: ScriptPosition { commands: 1, ..ScriptPosition::default() },
            step: PublicationStep::Publish,
            sequence: 7,
        }],
        until: MS,
    };
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Scripted(script));
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    assert_eq!(pool.script_mismatches(), 1, "no lease: the sequence stays 0, not the recorded 7");
}

#[test]
fn the_invariant_audit_fires_on_a_bad_state() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    pool.check_invariants().expect("a new machine is sound");
    // An armed timer with nothing to publish.
    pool.deadline = Some(MS);
    assert!(pool.check_invariants().unwrap_err().contains("nothing to publish"));
    pool.deadline = None;
    // A free machine holding a subscription.
    pool.held.insert(0, lease(1));
    pool.next_hold = 1;
    assert!(pool.check_invariants().unwrap_err().contains("holds 1 subscriptions"));
    pool.held.clear();
    // A held subscription whose id was never issued.
    let script = PublicationScript { points: Vec::new(), until: 10 * MS };
    let mut scripted = machine(PublicationRole::Scripted(script));
    scripted.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    scripted.check_invariants().expect("a scripted machine arms its timer like a free one");
    scripted.held.insert(3, lease(1));
    assert!(scripted.check_invariants().unwrap_err().contains("never issued"));
}

#[test]
fn shutdown_publishes_the_tail_and_retires_the_lease() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    pool.shutdown(&mut outlet);
    assert_eq!(outlet.deltas.len(), 1);
    assert_eq!(pool.stats().lease, None);
    let digest = pool.digest(&mut outlet);
    assert_eq!((digest.owned_blocks, digest.sequence), (1, 1));
    assert_eq!(digest.filter_digest, filter_words_digest(pool.pool().filter().words()));
}

#[test]
fn chunked_digest_equals_the_one_shot_hash_of_the_bytes() {
    let values: Vec<u64> = (0..1500u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|value| value.to_le_bytes()).collect();
    assert_eq!(digest_u64s(values.iter().copied()), xxhash_rust::xxh3::xxh3_64(&bytes));
    assert_eq!(digest_u64s(std::iter::empty()), xxhash_rust::xxh3::xxh3_64(&[]));
}

fn rank(worker_id: u64) -> SourceKey {
    SourceKey { worker_id, dp_rank: 0 }
}

fn dump(worker_id: u64, fence: u64, events: Vec<RouterEvent>) -> RankDump {
    let events = events.into_iter().map(|event| RouterEvent { worker_id, ..event }).collect();
    RankDump { source: rank(worker_id), fence: RankFence(fence), events, last_event_id: 0 }
}

#[test]
fn a_dump_that_does_not_build_is_refused_with_its_fence_and_the_others_are_replaced() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    let good = dump(1, 7, vec![store(1, None), store(2, Some(1))]);
    let orphan = dump(2, 8, vec![store(5, None), store(6, Some(99))]);
    let refused = pool.replace_ranks(vec![good, orphan], &mut outlet);
    assert_eq!(
        refused,
        vec![PoolFault {
            source: rank(2),
            fence: RankFence(8),
            event_id: 6,
            error: ApplyError::ParentBlockNotFound(99),
        }]
    );
    assert_eq!(pool.stats().owned_blocks, 2, "only the dump that built was replaced");
    assert_eq!(outlet.deltas.len(), 1, "a replacement publishes at once");
    assert!(effects(&mut pool).is_empty(), "a refused dump is answered, not reported");
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn dumps_share_the_byte_budget_and_the_one_that_does_not_fit_is_refused() {
    let mut outlet = Outlet::default();
    let mut owned =
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
            .expect("pool");
    // Room for one rank of 100 blocks (a 128-bucket lineage and owner table), not for two.
    owned.set_exact_state_bytes_max(4000).unwrap();
    let cadence = CadenceConfig { threshold_events: 16, delay: MS };
    let mut pool = PoolMachine::new(owned, cadence, PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    let chain = |first: u64| -> Vec<RouterEvent> {
        (first..first + 100).map(|i| store(i, (i > first).then(|| i - 1))).collect()
    };
    let refused =
        pool.replace_ranks(vec![dump(1, 7, chain(1)), dump(2, 8, chain(1001))], &mut outlet);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!((refused[0].source, refused[0].fence), (rank(2), RankFence(8)));
    assert!(
        matches!(
            refused[0].error,
            ApplyError::ExactStateBudgetExceeded { needed_bytes, bytes_max: 4000 } if needed_bytes > 4000
        ),
        "{:?}",
        refused[0].error
    );
    let stats = pool.stats();
    assert_eq!(stats.owned_blocks, 100, "the dump that fitted was installed");
    assert_eq!(stats.counters.budget_refusals, 1);
    assert_eq!(stats.exact_state_bytes_max, 4000);
    assert!(stats.exact_state_bytes > 2000 && stats.exact_state_bytes <= 4000);
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn only_applied_and_failed_events_count_toward_the_threshold() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    // 15 stores and one valid event of another tier (ignored): below the threshold of 16.
    let mut events: Vec<RouterEvent> = (1..=15).map(|i| store(i, None)).collect();
    let mut host_tier = store(16, None);
    host_tier.storage_tier = StorageTier::HostPinned;
    events.push(host_tier);
    pool.apply(FENCE, &events, Duration::ZERO, &mut outlet);
    assert!(outlet.deltas.is_empty(), "an ignored event does not count");
    assert_eq!(pool.poll_timeout(), Some(MS));
    pool.handle_timeout(MS, &mut outlet);
    assert_eq!(outlet.deltas.len(), 1);
    // Eight stores, then eight failing events complete it: published at once, no timer.
    let mut mixed: Vec<RouterEvent> = (20..28).map(|i| store(i, None)).collect();
    mixed.extend((100..108).map(|i| store(i, Some(9_999))));
    pool.apply(FENCE, &mixed, MS, &mut outlet);
    assert_eq!(outlet.deltas.len(), 2, "the failures completed the threshold");
    assert_eq!(pool.poll_timeout(), None);
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn a_rank_reset_drops_its_blocks_and_publishes_at_once() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    pool.apply(FENCE, &[store(1, None), store(2, Some(1))], Duration::ZERO, &mut outlet);
    assert_eq!(pool.flush(&mut outlet), Ok(1));
    assert_eq!((pool.stats().owned_blocks, pool.stats().resident_blocks), (2, 2));
    pool.reset_rank(SourceKey { worker_id: 1, dp_rank: 0 }, RankFence(4), &mut outlet);
    assert_eq!((pool.stats().owned_blocks, pool.stats().resident_blocks), (0, 0));
    assert_eq!(outlet.deltas.len(), 2, "the reset is published without waiting");
    assert_eq!(pool.stats().sequence, 2);
    assert_eq!(pool.poll_timeout(), None);
    pool.check_invariants().expect("invariants hold");
}

#[test]
fn an_abandoned_machine_publishes_its_tail() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Free);
    subscribed(&mut pool, 1, &mut outlet);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    assert!(outlet.deltas.is_empty());
    pool.abandon(&mut outlet);
    assert_eq!(outlet.deltas.len(), 1);
    assert_eq!(pool.stats().lease, Some(lease(1)), "abandoning keeps the lease");
}

#[test]
fn held_subscriptions_get_distinct_ids_and_a_forgotten_one_is_not_released() {
    let script = PublicationScript { points: Vec::new(), until: 100 * MS };
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Scripted(script));
    let held = |step| match step {
        SubscribeStep::Held(hold) => hold,
        SubscribeStep::Barrier => panic!("a scripted machine holds subscriptions"),
    };
    let first = held(pool.subscribe(lease(1), &mut outlet));
    let second = held(pool.subscribe(lease(2), &mut outlet));
    let third = held(pool.subscribe(lease(3), &mut outlet));
    assert!(first != second && second != third && first != third);
    pool.check_invariants().expect("held subscriptions of a scripted machine are sound");
    pool.forget_hold(second);
    pool.handle_timeout(100 * MS, &mut outlet);
    assert_eq!(
        effects(&mut pool),
        [
            PoolEffect::Release { hold: first, lease: lease(1) },
            PoolEffect::Release { hold: third, lease: lease(3) },
        ]
    );
}

#[test]
fn publication_points_count_the_digests_taken_before_them() {
    let mut outlet = Outlet::default();
    let mut pool = machine(PublicationRole::Reported);
    subscribed(&mut pool, 1, &mut outlet);
    let _ = effects(&mut pool);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    let _ = pool.digest(&mut outlet);
    let _ = pool.digest(&mut outlet);
    assert_eq!(pool.flush(&mut outlet), Ok(1));
    let positions: Vec<ScriptPosition> = effects(&mut pool)
        .into_iter()
        .filter_map(|effect| match effect {
            PoolEffect::Point(point) => Some(point.position),
            _ => None,
        })
        .collect();
    assert_eq!(positions.len(), 1);
    assert_eq!(positions[0].digests, 2);
}

fn scripted(points: Vec<(u64, PublicationStep, u64)>) -> PoolMachine {
    let points = points
        .into_iter()
        .map(|(commands, step, sequence)| PublicationPoint {
            position: ScriptPosition { commands, ..ScriptPosition::default() },
            step,
            sequence,
        })
        .collect();
    machine(PublicationRole::Scripted(PublicationScript { points, until: 100 * MS }))
}

/// A recorded retirement keeps the lease only while a live subscriber is served under it.
#[test]
fn a_scripted_retirement_spares_the_lease_of_a_live_subscriber_only() {
    for receivers in [true, false] {
        let mut outlet = Outlet::default();
        let mut pool = scripted(vec![
            (0, PublicationStep::Barrier(LeaseRecord(1, 0, 1)), 0),
            (1, PublicationStep::RetireLease(LeaseRecord(1, 0, 1)), 0),
        ]);
        let _ = pool.subscribe(lease(1), &mut outlet);
        assert!(matches!(effects(&mut pool)[..], [PoolEffect::Answer { .. }]));
        outlet.closed = !receivers;
        pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
        let kept = if receivers { Some(lease(1)) } else { None };
        assert_eq!(pool.stats().lease, kept, "receivers: {receivers}");
    }
    // Nobody was served under the lease: the retirement is performed.
    let mut outlet = Outlet::default();
    let mut pool = scripted(vec![
        (0, PublicationStep::Barrier(LeaseRecord(1, 0, 1)), 0),
        (1, PublicationStep::RetireLease(LeaseRecord(1, 0, 1)), 0),
    ]);
    let _ = pool.subscribe(lease(2), &mut outlet);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    assert_eq!(pool.stats().lease, None);
}

/// A held subscription is answered only when nothing is unpublished: its snapshot is the state
/// at the last published sequence.
#[test]
fn a_held_subscription_waits_for_unpublished_writes() {
    let mut outlet = Outlet::default();
    let mut pool = scripted(vec![
        (0, PublicationStep::Barrier(LeaseRecord(1, 0, 1)), 0),
        (2, PublicationStep::Publish, 1),
    ]);
    let _ = pool.subscribe(lease(1), &mut outlet);
    let _ = effects(&mut pool);
    pool.apply(FENCE, &[store(1, None)], Duration::ZERO, &mut outlet);
    let SubscribeStep::Held(hold) = pool.subscribe(lease(1), &mut outlet) else {
        panic!("held");
    };
    assert!(effects(&mut pool).is_empty(), "a write is unpublished");
    pool.apply(FENCE, &[store(2, None)], Duration::ZERO, &mut outlet);
    let answered = effects(&mut pool);
    let [PoolEffect::Answer { hold: answered_hold, snapshot }] = &answered[..] else {
        panic!("answered: {answered:?}");
    };
    assert_eq!((*answered_hold, snapshot.sequence), (hold, 1));
}
