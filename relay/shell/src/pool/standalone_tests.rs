//! Tests of a pool machine and its link, through a standalone pool on tokio's paused clock.

use std::sync::Mutex;

use super::*;
use std::time::Duration;

use crate::pool::PublicationSink;
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::{DcId, LaneLease, PoolId, resolve_indexer_domain};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::pool::{
    ApplyError, FenceReason, PublicationPoint, PublicationStep, ScriptPosition,
};
use kvrelay_core::pool::{Delta, PoolDigest, PoolFault, PublishError, Snapshot};
use kvrelay_core::rng::rng_from_seed;
use tokio::sync::broadcast;

#[derive(Debug, Default)]
struct RecordedFaults(Mutex<Vec<PoolFault>>, Mutex<Vec<PoolFault>>);

impl FaultSink for RecordedFaults {
    fn report(&self, fault: PoolFault) {
        self.0.lock().expect("not poisoned").push(fault);
    }

    fn refused(&self, fault: PoolFault) {
        self.1.lock().expect("not poisoned").push(fault);
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

fn start(config: PoolConfig) -> (StandalonePool, JoinHandle<StandaloneExit>, Arc<RecordedFaults>) {
    let pool =
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
            .expect("pool");
    let faults = Arc::new(RecordedFaults::default());
    let (handle, task) =
        spawn_standalone_pool(key(), pool, config, faults.clone(), PublicationMode::Free);
    (handle, task, faults)
}

fn key() -> GenerationKey {
    let endpoint = "ns/backend/generate".parse().expect("a valid endpoint");
    let indexer_domain =
        resolve_indexer_domain("model", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
    (PoolId { indexer_domain, dc_id: DcId(1) }, 1)
}

#[tokio::test(start_paused = true)]
async fn a_batch_is_cut_at_the_threshold_or_after_the_delay() {
    let (actor, _task, _) = start(PoolConfig::default());
    let mut subscription = actor.subscribe(lease(1)).await.unwrap();
    assert_eq!(subscription.snapshot.sequence, 0);
    actor.apply(RankFence(1), (1..=16).map(|i| store(i, None)).collect()).await.unwrap();
    let delta = subscription.deltas.recv().await.unwrap();
    assert_eq!((delta.base_sequence, delta.sequence), (0, 1));
    assert_eq!(delta.images.len(), 16.min(delta.images.len()));
    actor.apply(RankFence(1), vec![store(100, None)]).await.unwrap();
    actor.stats().await.unwrap(); // the apply has been processed
    assert!(subscription.deltas.try_recv().is_err(), "one event waits for the delay");
    tokio::time::sleep(Duration::from_millis(2)).await;
    let delta = subscription.deltas.recv().await.unwrap();
    assert_eq!((delta.base_sequence, delta.sequence), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn the_first_delta_after_a_barrier_continues_the_snapshot_sequence() {
    let (actor, _task, _) = start(PoolConfig::default());
    let mut first = actor.subscribe(lease(1)).await.unwrap();
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    assert_eq!(actor.flush().await.unwrap(), Ok(1));
    actor.apply(RankFence(1), vec![store(2, None)]).await.unwrap();
    // The pending tail is published under the old lease before the new snapshot is cut.
    let mut second = actor.subscribe(lease(2)).await.unwrap();
    assert_eq!(second.snapshot.sequence, 2);
    assert_eq!(first.deltas.recv().await.unwrap().sequence, 1);
    let tail = first.deltas.recv().await.unwrap();
    assert_eq!((tail.sequence, tail.lease), (2, lease(1)));
    actor.apply(RankFence(1), vec![store(3, None)]).await.unwrap();
    actor.flush().await.unwrap().unwrap();
    let next = second.deltas.recv().await.unwrap();
    assert_eq!((next.base_sequence, next.sequence, next.lease), (2, 3, lease(2)));
    let mut mirror = second.snapshot.words.clone();
    for image in &next.images {
        mirror[image.bucket as usize] = image.word;
    }
    let stats = actor.stats().await.unwrap();
    assert_eq!(stats.resident_blocks, 3);
    assert_eq!(
        mirror
            .iter()
            .map(|w| (0..4).filter(|s| (w >> (16 * s)) & 0xFFFF != 0).count() as u64)
            .sum::<u64>(),
        3
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_lease_the_sequence_does_not_advance() {
    let (actor, _task, _) = start(PoolConfig::default());
    actor.apply(RankFence(1), (1..=40).map(|i| store(i, None)).collect()).await.unwrap();
    assert_eq!(actor.flush().await.unwrap(), Ok(0));
    let subscription = actor.subscribe(lease(1)).await.unwrap();
    assert_eq!(subscription.snapshot.sequence, 0);
    assert_eq!(actor.stats().await.unwrap().resident_blocks, 40);
}

#[tokio::test(start_paused = true)]
async fn fencing_discards_the_unpublished_tail() {
    let (actor, task, _) = start(PoolConfig::default());
    let mut subscription = actor.subscribe(lease(1)).await.unwrap();
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    actor.stats().await.unwrap();
    actor.fence();
    assert_eq!(task.await.unwrap(), StandaloneExit::Fenced);
    assert!(matches!(subscription.deltas.recv().await, Err(broadcast::error::RecvError::Closed)));
    assert_eq!(actor.flush().await, Err(PoolGone));
}

#[tokio::test(start_paused = true)]
async fn graceful_shutdown_publishes_the_tail_then_retires_the_lease() {
    let (actor, task, _) = start(PoolConfig::default());
    let mut subscription = actor.subscribe(lease(1)).await.unwrap();
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    actor.shutdown().await.unwrap();
    assert_eq!(task.await.unwrap(), StandaloneExit::Graceful);
    assert_eq!(subscription.deltas.recv().await.unwrap().sequence, 1);
}

#[tokio::test(start_paused = true)]
async fn rejected_events_are_reported_and_later_ones_still_apply() {
    let (actor, _task, faults) = start(PoolConfig::default());
    actor.apply(RankFence(1), vec![store(2, Some(99)), store(3, None)]).await.unwrap();
    let stats = actor.stats().await.unwrap();
    assert_eq!(stats.owned_blocks, 1);
    let faults = faults.0.lock().unwrap().clone();
    assert_eq!(faults.len(), 1);
    assert_eq!(faults[0].error, ApplyError::ParentBlockNotFound(99));
    assert_eq!(faults[0].event_id, 2);
}

#[tokio::test(start_paused = true)]
async fn a_delta_nobody_receives_fences_delivery_until_a_new_barrier() {
    let (actor, _task, _) = start(PoolConfig::default());
    let subscription = actor.subscribe(lease(1)).await.unwrap();
    drop(subscription);
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    assert_eq!(actor.flush().await.unwrap(), Err(PublishError::DeliveryFailed));
    assert_eq!(actor.stats().await.unwrap().fence, Some(FenceReason::DeliveryUncertain));
    let again = actor.subscribe(lease(2)).await.unwrap();
    assert_eq!(again.snapshot.sequence, 0, "the uncertain tail is folded into the snapshot");
    assert_eq!(actor.stats().await.unwrap().fence, None);
}

#[tokio::test(start_paused = true)]
async fn replace_and_reset_rank_publish_at_once() {
    let (actor, _task, faults) = start(PoolConfig::default());
    let mut subscription = actor.subscribe(lease(1)).await.unwrap();
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    actor.flush().await.unwrap().unwrap();
    actor.reset_rank(SourceKey { worker_id: 1, dp_rank: 0 }, RankFence(2)).await.unwrap();
    let add = subscription.deltas.recv().await.unwrap();
    let remove = subscription.deltas.recv().await.unwrap();
    assert_eq!((add.sequence, remove.sequence), (1, 2));
    assert!(remove.images.iter().all(|image| image.word == 0));
    let source = SourceKey { worker_id: 1, dp_rank: 0 };
    let dump =
        RankDump { source, fence: RankFence(3), events: vec![store(7, None)], last_event_id: 7 };
    actor.replace_ranks(vec![dump]).await.unwrap();
    assert_eq!(subscription.deltas.recv().await.unwrap().sequence, 3);
    assert_eq!(*faults.1.lock().unwrap(), Vec::new(), "the dump was taken");
    // A store and a reset inside one batch cancel out: nothing is published.
    actor.apply(RankFence(1), vec![store(9, None)]).await.unwrap();
    actor.reset_rank(SourceKey { worker_id: 1, dp_rank: 0 }, RankFence(2)).await.unwrap();
    assert_eq!(
        subscription.deltas.recv().await.unwrap().sequence,
        4,
        "only the replaced block goes"
    );
    assert!(subscription.deltas.try_recv().is_err());
}

#[tokio::test(start_paused = true)]
async fn a_dump_that_does_not_build_is_refused_to_the_sink_and_the_rank_keeps_its_blocks() {
    let (actor, _task, faults) = start(PoolConfig::default());
    let source = SourceKey { worker_id: 1, dp_rank: 0 };
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    // Block 8's parent was never stored: the dump does not build.
    let dump = RankDump {
        source,
        fence: RankFence(3),
        events: vec![store(7, None), store(8, Some(999))],
        last_event_id: 8,
    };
    actor.replace_ranks(vec![dump]).await.unwrap();
    let digest = actor.digest().await.unwrap();
    assert_eq!(digest.owned_blocks, 1, "the rank keeps what it had");
    let refused = faults.1.lock().unwrap().clone();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!((refused[0].source, refused[0].fence), (source, RankFence(3)));
    assert!(faults.0.lock().unwrap().is_empty(), "a refusal is not a pool fault");
}

#[tokio::test(start_paused = true)]
async fn the_digest_follows_the_commands_queued_before_it() {
    let (actor, _task, _) = start(PoolConfig::default());
    let empty = actor.digest().await.unwrap();
    assert_eq!(empty.owned_blocks, 0);
    actor.apply(RankFence(1), (1..=5).map(|i| store(i, None)).collect()).await.unwrap();
    let stored = actor.digest().await.unwrap();
    assert_eq!(stored.owned_blocks, 5);
    assert_ne!(stored.canonical_digest, empty.canonical_digest);
    assert_ne!(stored.filter_digest, empty.filter_digest);
    actor.reset_rank(SourceKey { worker_id: 1, dp_rank: 0 }, RankFence(2)).await.unwrap();
    let cleared = actor.digest().await.unwrap();
    assert_eq!(cleared.owned_blocks, 0);
    assert_eq!(
        (cleared.canonical_digest, cleared.filter_digest),
        (empty.canonical_digest, empty.filter_digest)
    );
}

#[derive(Debug, Default)]
struct RecordedPoints(Mutex<Vec<PublicationPoint>>);

impl PublicationSink for RecordedPoints {
    fn point(&self, point: PublicationPoint) {
        self.0.lock().expect("not poisoned").push(point);
    }
}

fn start_with(mode: PublicationMode) -> (StandalonePool, JoinHandle<StandaloneExit>) {
    let pool =
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
            .expect("pool");
    let faults = Arc::new(RecordedFaults::default());
    spawn_standalone_pool(key(), pool, PoolConfig::default(), faults, mode)
}

fn at(commands: u64, digests: u64) -> ScriptPosition {
    ScriptPosition { commands, digests, timers: 0 }
}

fn point(position: ScriptPosition, step: PublicationStep, sequence: u64) -> PublicationPoint {
    PublicationPoint { position, step, sequence }
}

fn scripted(points: Vec<PublicationPoint>, after: Duration) -> PublicationMode {
    PublicationMode::Scripted { points, until: Instant::now() + after }
}

/// The deterministic commands both runs below send: events and digests, nothing else.
async fn deterministic_commands(actor: &StandalonePool, sleep: bool) -> Vec<PoolDigest> {
    let mut digests = Vec::new();
    let pause = || async move {
        if sleep {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    pause().await;
    actor.apply(RankFence(1), (10..26).map(|i| store(i, None)).collect()).await.unwrap();
    actor.apply(RankFence(1), vec![store(2, None)]).await.unwrap();
    digests.push(actor.digest().await.unwrap());
    pause().await;
    digests.push(actor.digest().await.unwrap());
    pause().await;
    actor.apply(RankFence(1), vec![store(3, None)]).await.unwrap();
    pause().await;
    digests.push(actor.digest().await.unwrap());
    digests
}

#[tokio::test(start_paused = true)]
async fn a_scripted_actor_publishes_exactly_at_the_recorded_points() {
    let recorded = Arc::new(RecordedPoints::default());
    let (actor, _task) = start_with(PublicationMode::Reported(recorded.clone()));
    let subscription = actor.subscribe(lease(1)).await.unwrap();
    let mut digests = Vec::new();
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await; // the timer publishes: 1
    actor.apply(RankFence(1), (10..26).map(|i| store(i, None)).collect()).await.unwrap(); // threshold: 2
    actor.apply(RankFence(1), vec![store(2, None)]).await.unwrap();
    digests.push(actor.digest().await.unwrap());
    tokio::time::sleep(Duration::from_millis(2)).await; // the timer publishes: 3
    digests.push(actor.digest().await.unwrap());
    actor.retire_lease(lease(1)).await.unwrap();
    actor.apply(RankFence(1), vec![store(3, None)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await; // no lease: nothing numbered
    digests.push(actor.digest().await.unwrap());
    drop(subscription);
    let points = recorded.0.lock().unwrap().clone();
    assert_eq!(
        points,
        vec![
            point(at(0, 0), PublicationStep::Barrier(lease(1).into()), 0),
            point(
                ScriptPosition { commands: 3, digests: 2, timers: 2 },
                PublicationStep::RetireLease(lease(1).into()),
                3
            ),
        ],
        "the timer's publications are no points (its firings are inputs), only counted"
    );
    let sequences = |digests: &[PoolDigest]| digests.iter().map(|d| d.sequence).collect::<Vec<_>>();
    assert_eq!(sequences(&digests), vec![2, 3, 3]);

    // The replay sends the same commands and lets the same timers fire (the pauses), with no
    // subscriber: with the script's points it reproduces every digest, sequence included.
    let (replay, _task) = start_with(scripted(points.clone(), Duration::from_secs(3600)));
    assert_eq!(deterministic_commands(&replay, true).await, digests);
    // Without the firings the replay leaves the recording: the threshold publishes the first
    // store with the next sixteen.
    let (hurried, _task) = start_with(scripted(points, Duration::from_secs(3600)));
    let hurried = deterministic_commands(&hurried, false).await;
    assert_eq!(sequences(&hurried), vec![1, 1, 1], "{hurried:?}");
    // A free pool without the consumer's lease never numbers anything.
    let (free, _task) = start_with(PublicationMode::Free);
    let free_digests = deterministic_commands(&free, true).await;
    assert!(free_digests.iter().all(|d| d.sequence == 0));
}

#[tokio::test(start_paused = true)]
async fn a_recorded_failed_delivery_fences_the_replay_at_the_same_delta() {
    let recorded = Arc::new(RecordedPoints::default());
    let (actor, _task) = start_with(PublicationMode::Reported(recorded.clone()));
    drop(actor.subscribe(lease(1)).await.unwrap());
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    assert_eq!(actor.flush().await.unwrap(), Err(PublishError::DeliveryFailed));
    let points = recorded.0.lock().unwrap().clone();
    assert_eq!(
        points,
        vec![
            point(at(0, 0), PublicationStep::Barrier(lease(1).into()), 0),
            point(at(1, 0), PublicationStep::DeliveryFailed(0), 0),
            point(at(1, 0), PublicationStep::Publish, 0),
        ]
    );
    let (replay, _task) = start_with(scripted(points, Duration::from_secs(3600)));
    replay.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    let stats = replay.stats().await.unwrap();
    assert_eq!((stats.fence, stats.sequence), (Some(FenceReason::DeliveryUncertain), 0));
}

fn mirror_of(snapshot: &Snapshot, deltas: &[Arc<Delta>]) -> Vec<u64> {
    let mut words = snapshot.words.clone();
    for delta in deltas {
        for image in &delta.images {
            words[image.bucket as usize] = image.word;
        }
    }
    words
}

#[tokio::test(start_paused = true)]
async fn a_replay_subscriber_waits_for_a_published_state_and_adds_no_publication() {
    // The recording's flushes, after the first write and after the first digest.
    let script = vec![
        point(at(0, 0), PublicationStep::Barrier(lease(1).into()), 0),
        point(at(1, 0), PublicationStep::Publish, 1),
        point(at(2, 1), PublicationStep::Publish, 2),
    ];
    let (actor, _task) = start_with(scripted(script, Duration::from_secs(1)));
    let other_lease = crate::runtime::spawn({
        let actor = actor.clone();
        async move { actor.subscribe(lease(2)).await }
    });
    actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap(); // then the script publishes 1
    actor.apply(RankFence(1), vec![store(2, None)]).await.unwrap(); // pending until after the next digest
    let waiting = crate::runtime::spawn({
        let actor = actor.clone();
        async move { actor.subscribe(lease(1)).await }
    });
    assert_eq!(actor.digest().await.unwrap().sequence, 1);
    tokio::task::yield_now().await;
    assert!(!other_lease.is_finished(), "a lease the recording never held is not installed");
    let mut subscription = waiting.await.unwrap().unwrap();
    assert_eq!(subscription.snapshot.sequence, 2, "answered at the next recorded publication");
    assert_eq!(actor.digest().await.unwrap().sequence, 2);
    // A write after the last recorded point is published when its timer fires (a firing is an
    // input, as in the recording), to the subscriber under the recorded lease...
    actor.apply(RankFence(1), vec![store(3, None)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(actor.stats().await.unwrap().sequence, 3);
    let tail = subscription.deltas.recv().await.unwrap();
    assert_eq!((tail.base_sequence, tail.sequence, tail.lease), (2, 3, lease(1)));
    assert!(!other_lease.is_finished(), "still not installed while the script runs");
    // ...and once the script ends the pool runs free: the held subscription of another lease
    // gets its barrier, at the state the first subscriber holds.
    let other = other_lease.await.unwrap().unwrap();
    assert_eq!(mirror_of(&subscription.snapshot, &[tail]), other.snapshot.words);
    assert_eq!(actor.stats().await.unwrap().resident_blocks, 3);
}

#[test]
fn a_configuration_recorded_before_the_exact_state_budget_decodes_to_the_derived_default() {
    /// `PoolConfig` as journals recorded it before `exact_state_bytes_max` existed.
    #[derive(serde::Serialize)]
    struct Recorded {
        mailbox_capacity: usize,
        pending_block_permits: u32,
        publication_threshold_events: u32,
        publication_delay: Duration,
        delta_broadcast_capacity: usize,
    }
    let current = PoolConfig::default();
    let recorded = Recorded {
        mailbox_capacity: current.mailbox_capacity,
        pending_block_permits: current.pending_block_permits,
        publication_threshold_events: current.publication_threshold_events,
        publication_delay: current.publication_delay,
        delta_broadcast_capacity: current.delta_broadcast_capacity,
    };
    let bytes = rmp_serde::to_vec(&recorded).unwrap();
    let decoded: PoolConfig = rmp_serde::from_slice(&bytes).unwrap();
    assert_eq!(decoded, current);
    assert_eq!(decoded.exact_state_bytes_max, None);
    let bounded = PoolConfig { exact_state_bytes_max: Some(1 << 20), ..current };
    let round_trip: PoolConfig =
        rmp_serde::from_slice(&rmp_serde::to_vec(&bounded).unwrap()).unwrap();
    assert_eq!(round_trip, bounded, "a recorded budget replays as recorded");
}

#[tokio::test(start_paused = true)]
async fn the_configured_exact_state_budget_reaches_the_pool_and_refusals_are_faults() {
    let config = PoolConfig { exact_state_bytes_max: Some(2048), ..PoolConfig::default() };
    let (actor, _task, faults) = start(config);
    let stats = actor.stats().await.unwrap();
    assert_eq!((stats.exact_state_bytes, stats.exact_state_bytes_max), (0, 2048));
    // One root block per event: the tables grow until the next growth would pass 2 KiB.
    actor.apply(RankFence(1), (1..=200).map(|i| store(i, None)).collect()).await.unwrap();
    let stats = actor.stats().await.unwrap();
    assert!(stats.exact_state_bytes <= 2048, "{stats:?}");
    assert!(stats.owned_blocks > 16 && stats.owned_blocks < 200, "{stats:?}");
    let refused = 200 - stats.owned_blocks as u64;
    assert_eq!(stats.counters.budget_refusals, refused);
    let faults = faults.0.lock().unwrap().clone();
    assert_eq!(faults.len() as u64, refused, "every refusal is reported");
    assert!(faults.iter().all(|fault| matches!(
        fault.error,
        ApplyError::ExactStateBudgetExceeded { bytes_max: 2048, .. }
    )));
}
