//! [`SourceTracker::check_invariants`] against broken states: each relation of the type doc is
//! broken alone on a tracker with recoveries under way, and the check must name it; the states
//! at each bound must pass. Also the tracker's defensive paths that only a hand-made view reaches.

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;
use crate::pool::FailureDisposition;
use crate::rng::rng_from_seed;
use crate::sources::RecoveryFailure;
use crate::sources::membership::RankSourceStatus;
use crate::sources::tests::{
    Harness, P1, P2, R0, R1, advert, applied, config, dump, live, requests, resets,
};

/// One worker's two recoverable ranks, `R0` under `P1` and `R1` under `P2`, not yet reconciled.
fn two_ranks() -> Harness {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 2, true));
    harness.advertise(advert(R0, P1, true));
    harness.advertise(advert(R1, P2, true));
    harness
}

/// Two recoverable ranks with their first tree dumps in flight; `R0` buffers two live events.
fn recovering() -> SourceTracker {
    let mut harness = two_ranks();
    let _ = harness.reconcile_and_settle();
    assert!(harness.events(P1, live(R0, [2, 3])).is_empty());
    let tracker = harness.tracker;
    assert_eq!(tracker.counters().events_buffered, 2);
    assert_eq!(tracker.in_flight_count(), 2);
    assert_eq!(tracker.counters().recovery_requests, 2);
    assert_eq!(tracker.rank(R0).map(|rank| rank.buffered_events), Some(2));
    tracker.check_invariants().expect("the unbroken state holds");
    tracker
}

/// The check's verdict on a copy of `tracker` changed by `change`.
fn check_after(
    tracker: &SourceTracker,
    change: impl FnOnce(&mut SourceTracker),
) -> Result<(), String> {
    let mut copy = tracker.clone();
    change(&mut copy);
    copy.check_invariants()
}

fn assert_names(verdict: Result<(), String>, relation: &str) {
    match verdict {
        Err(error) => assert!(error.contains(relation), "{error:?} does not name {relation:?}"),
        Ok(()) => panic!("the check missed a broken {relation:?}"),
    }
}

fn state(tracker: &mut SourceTracker, source: SourceKey) -> &mut RankState {
    tracker.ranks.get_mut(&source).expect("rank is active")
}

#[test]
fn each_broken_relation_is_named() {
    let tracker = recovering();
    assert_names(
        check_after(&tracker, |t| {
            t.publishers.insert(P1, R1);
        }),
        "does not map",
    );
    assert_names(
        check_after(&tracker, |t| {
            t.publishers.insert(0xDEAD, R0);
        }),
        "entries without a rank",
    );
    assert_names(
        check_after(&tracker, |t| state(t, R0).phase = RecoveryPhase::Idle),
        "without a recovery",
    );
    // A live-only rank must not recover, even with nothing buffered (R1 buffers nothing).
    assert_names(
        check_after(&tracker, |t| state(t, R1).mode = RankMode::LiveOnly),
        "is recovering",
    );
    assert_names(check_after(&tracker, |t| t.deadlines.clear()), "timer indexes");
    assert_names(
        check_after(&tracker, |t| {
            t.scheduled.insert((Duration::ZERO, R1));
        }),
        "timer indexes",
    );
    assert_names(check_after(&tracker, |t| t.in_flight.clear()), "in-flight map");
    assert_names(check_after(&tracker, |t| t.counters.events_received += 1), "accounted for");
    assert_names(check_after(&tracker, |t| t.counters.events_dropped_stale += 1), "accounted for");
    assert_names(
        check_after(&tracker, |t| {
            t.batch.pending.insert(R1);
        }),
        "pending batch",
    );
}

#[test]
fn each_bound_holds_at_its_value_and_fails_past_it() {
    let tracker = recovering();
    let buffered = tracker.ranks[&R0].buffer.len();
    let weight = tracker.ranks[&R0].buffer.bytes();
    assert_eq!(check_after(&tracker, |t| t.config.live_buffer_events_max = buffered), Ok(()));
    assert_names(
        check_after(&tracker, |t| t.config.live_buffer_events_max = buffered - 1),
        &format!("buffers {buffered} events"),
    );
    assert_eq!(check_after(&tracker, |t| t.config.live_buffer_bytes_max = weight), Ok(()));
    assert_names(
        check_after(&tracker, |t| t.config.live_buffer_bytes_max = weight - 1),
        &format!("buffers {weight} bytes"),
    );
    assert_eq!(check_after(&tracker, |t| t.config.recovery_fetches_in_flight_max = 2), Ok(()));
    assert_names(
        check_after(&tracker, |t| t.config.recovery_fetches_in_flight_max = 1),
        "2 calls in flight",
    );
}

/// `KvSourceMembership` never lets one publisher id name two ranks; a view that does is refused
/// for the second rank and counted, and the first keeps its recovery.
#[test]
fn a_publisher_id_claimed_by_a_second_rank_is_a_collision() {
    let mut harness = two_ranks();
    let mut view = harness.view();
    let first = view.ranks[&R0].status.clone();
    assert!(matches!(first, RankSourceStatus::ActiveRecoverable { publisher_id: P1, .. }));
    view.ranks.get_mut(&R1).expect("R1 is expected").status = first;

    let mut tracker = harness.tracker;
    let mut rng = rng_from_seed(3);
    let _ = tracker.handle(SourceInput::View(view.clone()), Duration::ZERO, &mut rng);
    tracker.check_invariants().expect("a collision leaves the state consistent");
    assert_eq!(tracker.counters().publisher_collisions, 1);
    assert_eq!(tracker.rank(R0).map(|rank| rank.publisher_id), Some(P1));
    assert_eq!(tracker.rank(R1), None);

    // R1 active under its own publisher, then reactivated under R0's: it is retired and reset.
    view.ranks.get_mut(&R1).expect("R1 is expected").status =
        RankSourceStatus::ActiveLiveOnly { publisher_id: P2 };
    let _ = tracker.handle(SourceInput::View(view.clone()), Duration::ZERO, &mut rng);
    assert_eq!(tracker.rank(R1).map(|rank| rank.publisher_id), Some(P2));
    let resets_before = tracker.counters().rank_resets;
    let newest =
        [R0, R1].into_iter().filter_map(|source| tracker.rank(source)).map(|r| r.fence).max();
    let rank = view.ranks.get_mut(&R1).expect("R1 is expected");
    rank.status = RankSourceStatus::ActiveLiveOnly { publisher_id: P1 };
    rank.lifecycle_generation += 1;
    let commands = tracker.handle(SourceInput::View(view), Duration::ZERO, &mut rng);
    tracker.check_invariants().expect("a retired collision leaves the state consistent");
    let reset = commands.iter().find_map(|command| match command {
        SourceCommand::ResetRank { source: R1, reason, degraded, fence } => {
            Some((*reason, *degraded, *fence))
        }
        _ => None,
    });
    let Some((reason, degraded, fence)) = reset else { panic!("no reset of R1 in {commands:?}") };
    assert_eq!((reason, degraded), (ResetReason::SourceWithheld, false));
    assert!(Some(fence) > newest, "the retired reset's {fence:?} is not newer than {newest:?}");
    assert_eq!(tracker.rank(R1), None);
    assert_eq!(tracker.counters().publisher_collisions, 2);
    assert_eq!(tracker.counters().rank_resets, resets_before + 1);
}

/// The start jitter is uniform over `0..=max`: both ends of a 1 µs range occur.
#[test]
fn the_start_jitter_reaches_both_ends_of_its_range() {
    let config = SourceTrackerConfig {
        recovery_start_jitter_max: Duration::from_micros(1),
        ..SourceTrackerConfig::default()
    };
    let tracker = SourceTracker::new(config).unwrap();
    let mut rng = rng_from_seed(11);
    let draws: BTreeSet<Duration> = (0..64).map(|_| tracker.jitter(&mut rng)).collect();
    assert_eq!(draws, BTreeSet::from([Duration::ZERO, Duration::from_micros(1)]));
    let none = SourceTracker::new(SourceTrackerConfig {
        recovery_start_jitter_max: Duration::ZERO,
        ..SourceTrackerConfig::default()
    })
    .unwrap();
    assert_eq!(none.jitter(&mut rng), Duration::ZERO);
}

#[test]
fn the_tracker_keeps_its_config() {
    let config = SourceTrackerConfig {
        live_buffer_events_max: 3,
        live_buffer_bytes_max: 4096,
        ..SourceTrackerConfig::default()
    };
    assert_eq!(SourceTracker::new(config).map(|tracker| *tracker.config()), Ok(config));
}

/// Configurations recorded before the byte bound existed decode with its default.
#[test]
fn a_config_without_the_byte_bound_decodes_with_its_default() {
    let mut fields = serde_json::to_value(SourceTrackerConfig::default()).unwrap();
    let removed = fields.as_object_mut().unwrap().remove("live_buffer_bytes_max");
    assert_eq!(removed, Some(serde_json::json!(LIVE_BUFFER_BYTES_MAX)));
    let decoded: SourceTrackerConfig = serde_json::from_value(fields).unwrap();
    assert_eq!(decoded.live_buffer_bytes_max, LIVE_BUFFER_BYTES_MAX);
}

/// A rank retired while its recovery is under way drops its buffer, counted.
#[test]
fn a_retired_rank_counts_its_buffered_events() {
    let mut harness = two_ranks();
    let _ = harness.reconcile_and_settle();
    assert!(harness.events(P1, live(R0, [2, 3, 4])).is_empty());
    harness.withdraw(P1);
    let _ = harness.reconcile();
    let counters = *harness.tracker.counters();
    assert_eq!(harness.tracker.rank(R0), None);
    assert_eq!((counters.events_received, counters.events_dropped_retired), (3, 3));
    assert_eq!(counters.live_events_accounted(), 3);
}

/// An answer or a failure for a call that is no longer outstanding changes nothing and is
/// counted stale, whichever input carries it.
#[test]
fn a_call_no_longer_outstanding_is_answered_stale() {
    let mut harness = two_ranks();
    let call = requests(&harness.reconcile_and_settle()).remove(0);
    let _ = harness.answer(&call, dump(vec![], 0));
    assert_eq!(harness.tracker.in_flight_count(), 1, "the answered call left the in-flight map");
    assert_eq!(harness.tracker.counters().recovery_answers_stale, 0);
    assert!(harness.answer(&call, dump(vec![], 0)).is_empty());
    assert_eq!(harness.tracker.counters().recovery_answers_stale, 1);
    let failure = RecoveryFailure::Refused("gone".into());
    let unreachable = SourceInput::RecoveryUnreachable { request_id: call.request_id, failure };
    assert!(harness.handle(unreachable).is_empty());
    assert_eq!(harness.tracker.counters().recovery_answers_stale, 2);
}

/// A pool failure report is counted by what it finds: handled for a recoverable rank under its
/// current fence, ignored for a live-only rank, stale for a rank the tracker does not hold or
/// has fenced.
#[test]
fn pool_failure_reports_are_counted_by_the_rank_they_find() {
    let fault = |source, fence| SourceInput::ApplyFailed {
        source,
        fence,
        disposition: FailureDisposition::RejectSource,
    };
    let mut recoverable = Harness::recovered_single_rank();
    let fence = recoverable.tracker.rank(R0).expect("rank is active").fence;
    let commands = recoverable.handle(fault(R0, fence));
    assert_eq!(resets(&commands), vec![(R0, false, ResetReason::SourceFault)]);
    let counters = *recoverable.tracker.counters();
    assert_eq!((counters.faults_handled, counters.faults_stale), (1, 0));
    assert!(recoverable.handle(fault(R1, fence)).is_empty(), "R1 is not tracked");
    assert_eq!(recoverable.tracker.counters().faults_stale, 1);

    // A fenced rank waits for a new incarnation: a report under its fence is stale too.
    let events = live(R0, [EVENT_ID_EXHAUSTED]);
    assert!(!recoverable.events(P1, events).is_empty());
    let fenced = recoverable.tracker.rank(R0).expect("rank is active");
    assert_eq!(fenced.mode, RankMode::Fenced);
    assert!(recoverable.handle(fault(R0, fenced.fence)).is_empty());
    let counters = *recoverable.tracker.counters();
    assert_eq!((counters.faults_stale, counters.faults_handled), (2, 1));

    let mut live_only = Harness::live_only_single_rank();
    let fence = live_only.tracker.rank(R0).expect("rank is active").fence;
    assert!(live_only.handle(fault(R0, fence)).is_empty());
    let counters = *live_only.tracker.counters();
    assert_eq!((counters.faults_ignored, counters.faults_handled), (1, 0));
}

/// A live-only rank drops a repeated event id, counted, and keeps its position; its only reset
/// so far is its activation.
#[test]
fn a_live_only_rank_drops_a_repeated_event_counted() {
    let mut harness = Harness::live_only_single_rank();
    assert_eq!(harness.tracker.counters().rank_resets, 1);
    assert!(!harness.events(P1, live(R0, [1, 2])).is_empty());
    assert!(harness.events(P1, live(R0, [2])).is_empty());
    let counters = *harness.tracker.counters();
    assert_eq!((counters.events_dropped_stale, counters.rank_resets), (1, 1));
    assert_eq!(harness.tracker.rank(R0).map(|rank| rank.cursor), Some(RankCursor::Live(2)));
}

/// A rank that gives up recovery applies its buffer live-only, in id order: an event delivered
/// twice while buffered is applied once and its copy dropped stale, counted.
#[test]
fn a_degraded_rank_drops_a_buffered_duplicate_counted() {
    let mut harness = Harness::new();
    harness.add_worker(1, config(0, 1, true));
    harness.advertise(advert(R0, P1, true));
    let call = requests(&harness.reconcile_and_settle()).remove(0);
    assert!(harness.events(P1, live(R0, [3, 2, 3])).is_empty(), "buffered while recovering");
    let commands = harness.answer(&call, RecoveryResponse::Error("boom".into()));
    assert_eq!(resets(&commands), vec![(R0, true, ResetReason::RecoveryFailed)]);
    let applied: Vec<u64> = applied(&commands).into_iter().flat_map(|(_, ids)| ids).collect();
    assert_eq!(applied, vec![2, 3]);
    assert_eq!(harness.tracker.counters().events_dropped_stale, 1);
}
