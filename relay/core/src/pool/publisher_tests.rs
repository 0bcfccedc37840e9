//! Unit tests of the publisher, after the reference's named cases (relay-facts §14).

use super::*;
use crate::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use crate::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use crate::rng::rng_from_seed;

fn lease(epoch: u64) -> LaneLease {
    LaneLease { consumer_instance: 7, physical_lane: 0, assignment_epoch: epoch }
}

fn pool() -> PoolOwnership {
    PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 64), MAX_KICKS_DEFAULT, rng_from_seed(3))
        .unwrap()
}

fn event(data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: 1,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id: 1, dp_rank: 0, data },
    }
}

fn store(pool: &mut PoolOwnership, external: u64, tokens: u64) {
    let data = KvCacheEventData::Stored(StoreData {
        parent_hash: None,
        start_position: None,
        blocks: vec![StoredBlock {
            block_hash: ExternalBlockHash(external),
            tokens_hash: LocalBlockHash(tokens),
        }],
    });
    pool.apply_event(&event(data)).unwrap();
}

fn remove(pool: &mut PoolOwnership, external: u64) {
    let data =
        KvCacheEventData::Removed(RemoveData { block_hashes: vec![ExternalBlockHash(external)] });
    pool.apply_event(&event(data)).unwrap();
}

/// A sink that keeps every delta.
fn collect(into: &mut Vec<Delta>) -> impl FnMut(Delta) -> Result<(), Delta> + '_ {
    move |delta| {
        into.push(delta);
        Ok(())
    }
}

fn refuse(delta: Delta) -> Result<(), Delta> {
    Err(delta)
}

#[test]
fn publisher_owns_checked_sequence_and_snapshot_continuation() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    let snapshot =
        publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    assert_eq!(snapshot.sequence, 0);
    let mut mirror = snapshot.words.clone();
    for round in 0..5u64 {
        store(&mut p, round, 100 + round);
        let outcome = publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
        assert_eq!(outcome, PublishOutcome::Published { sequence: round + 1 });
    }
    for (index, delta) in deltas.iter().enumerate() {
        assert_eq!(delta.base_sequence, index as u64);
        assert_eq!(delta.sequence, index as u64 + 1);
        assert_eq!(delta.lease, lease(1));
        for image in &delta.images {
            mirror[image.bucket as usize] = image.word;
        }
    }
    assert_eq!(mirror, p.filter().words());
    assert_eq!(publisher.exact_drain_marker(), Some((lease(1), 5)));
}

#[test]
fn final_remove_is_an_absolute_zero_image_not_an_empty_reset() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
    remove(&mut p, 1);
    publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
    let bucket = deltas[0].images[0].bucket;
    assert_eq!(deltas[1].images, vec![BucketImage { bucket, word: 0 }]);
}

#[test]
fn writes_that_cancel_out_publish_nothing_and_keep_the_sequence() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    remove(&mut p, 1);
    assert_eq!(
        publisher.publish(&mut p, &mut collect(&mut deltas)),
        Ok(PublishOutcome::NothingChanged)
    );
    assert!(deltas.is_empty());
    assert_eq!(publisher.last_sequence(), 0);
}

#[test]
fn without_a_lease_nothing_is_materialised_and_the_sequence_stands_still() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    store(&mut p, 1, 7);
    assert_eq!(
        publisher.publish(&mut p, &mut collect(&mut deltas)),
        Ok(PublishOutcome::NoSubscriber { sequence: 0 })
    );
    assert!(!p.has_unpublished_writes());
    // A lease taken after idle eviction still starts at the unadvanced sequence.
    let snapshot =
        publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    assert!(publisher.retire_lease(lease(1)));
    store(&mut p, 2, 8);
    publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
    let again =
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut collect(&mut deltas)).unwrap();
    assert_eq!((snapshot.sequence, again.sequence), (0, 0));
    assert!(deltas.is_empty());
    assert_eq!(again.words, p.filter().words());
}

#[test]
fn retiring_a_stale_lease_does_nothing() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    publisher.snapshot_after_barrier(&mut p, lease(2), &mut refuse).unwrap();
    assert!(!publisher.retire_lease(lease(1)));
    assert_eq!(publisher.lease(), Some(lease(2)));
}

#[test]
fn delivery_uncertainty_does_not_advance_and_recovers_with_new_lease_snapshot() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    assert_eq!(publisher.publish(&mut p, &mut refuse), Err(PublishError::DeliveryFailed));
    assert_eq!(publisher.last_sequence(), 0);
    assert_eq!(publisher.fence_reason(), Some(FenceReason::DeliveryUncertain));
    store(&mut p, 2, 8);
    assert_eq!(
        publisher.publish(&mut p, &mut collect(&mut deltas)),
        Err(PublishError::Fenced(FenceReason::DeliveryUncertain))
    );
    let snapshot =
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut collect(&mut deltas)).unwrap();
    assert_eq!(snapshot.sequence, 0);
    assert_eq!(snapshot.words, p.filter().words());
    assert!(deltas.is_empty(), "the uncertain tail is folded into the snapshot");
    store(&mut p, 3, 9);
    publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
    assert_eq!((deltas[0].base_sequence, deltas[0].lease), (0, lease(2)));
}

#[test]
fn replacement_snapshot_emits_healthy_old_lease_tail_before_recording_sequence() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    let snapshot =
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut collect(&mut deltas)).unwrap();
    assert_eq!(deltas.len(), 1);
    assert_eq!((deltas[0].lease, deltas[0].sequence), (lease(1), 1));
    assert_eq!(snapshot.sequence, 1);
    assert_eq!(snapshot.lease, lease(2));
}

#[test]
fn failed_old_lease_tail_requires_retry_then_snapshot_covers_it() {
    let mut p = pool();
    let mut publisher = Publisher::new();
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    assert_eq!(
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut refuse),
        Err(PublishError::DeliveryFailed)
    );
    assert_eq!(publisher.lease(), Some(lease(1)));
    let snapshot =
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut collect(&mut deltas)).unwrap();
    assert_eq!(snapshot.sequence, 0);
    assert!(p.filter().contains(7));
    assert_eq!(snapshot.words, p.filter().words());
    assert!(deltas.is_empty());
}

#[test]
fn checked_rollover_fences_without_enqueueing() {
    let mut p = pool();
    let mut publisher = Publisher::starting_at(u64::MAX - 1);
    let mut deltas = Vec::new();
    publisher.snapshot_after_barrier(&mut p, lease(1), &mut collect(&mut deltas)).unwrap();
    store(&mut p, 1, 7);
    publisher.publish(&mut p, &mut collect(&mut deltas)).unwrap();
    assert_eq!(publisher.last_sequence(), u64::MAX);
    // Unfenced at the last sequence, a barrier is refused all the same.
    assert_eq!(publisher.fence_reason(), None);
    assert_eq!(
        publisher.snapshot_after_barrier(&mut p, lease(3), &mut collect(&mut deltas)),
        Err(PublishError::SequenceExhausted)
    );
    store(&mut p, 2, 8);
    assert_eq!(
        publisher.publish(&mut p, &mut collect(&mut deltas)),
        Err(PublishError::SequenceExhausted)
    );
    assert_eq!(deltas.len(), 1);
    assert_eq!(publisher.fence_reason(), Some(FenceReason::SequenceExhausted));
    assert_eq!(
        publisher.snapshot_after_barrier(&mut p, lease(2), &mut collect(&mut deltas)),
        Err(PublishError::SequenceExhausted)
    );
}

#[test]
fn cadence_is_due_at_the_threshold() {
    let mut cadence = PublicationCadence::new(3);
    assert!(!cadence.record_event());
    assert!(!cadence.record_event());
    assert!(cadence.record_event());
    cadence.reset();
    assert!(!cadence.record_event());
    assert_eq!(PublicationCadence::default(), PublicationCadence::new(16));
}
