//! Publication tests: real pool machines (standalone), real hubs, paused tokio time.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::pool::{FaultSink, PoolConfig, PublicationMode, StandalonePool, spawn_standalone_pool};
use crate::runtime::InlineExecutor;
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::filter::{FilterFrame, FilterReplica};
use kvrelay_core::model::hashing::{ExternalBlockHash, HashFormat, LocalBlockHash};
use kvrelay_core::model::identity::{
    DcId, EndpointPath, PoolId, ProducerIdentity, resolve_indexer_domain,
};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::pool::{PoolFault, PoolOwnership};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::RankFence;

#[derive(Debug)]
struct IgnoreFaults;

impl FaultSink for IgnoreFaults {
    fn report(&self, _fault: PoolFault) {}

    fn refused(&self, _fault: PoolFault) {}
}

fn producer(endpoint: &str, buckets: u64, generation: u64) -> ProducerIdentity {
    let endpoint: EndpointPath = endpoint.parse().unwrap();
    let domain =
        resolve_indexer_domain("model", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: DcId(7) };
    ProducerIdentity::new(pool_id, 42, generation, CkfFormat::v1(DEFAULT_SEED, buckets)).unwrap()
}

fn standalone(identity: &ProducerIdentity) -> StandalonePool {
    let pool = PoolOwnership::new(identity.format(), MAX_KICKS_DEFAULT, rng_from_seed(5)).unwrap();
    let key = (identity.pool_id(), identity.layout_generation());
    let faults = Arc::new(IgnoreFaults);
    spawn_standalone_pool(key, pool, PoolConfig::default(), faults, PublicationMode::Free).0
}

fn store(external: u64) -> RouterEvent {
    RouterEvent {
        worker_id: 1,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: external,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(external),
                    tokens_hash: LocalBlockHash(external.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                }],
            }),
        },
    }
}

/// Store one block and publish it as one delta.
async fn publish_one(standalone: &StandalonePool, external: u64) {
    standalone.apply(RankFence(1), vec![store(external)]).await.unwrap();
    standalone.flush().await.unwrap().unwrap();
}

fn publications(config: HubConfig) -> PoolPublications {
    PoolPublications::new(config, Arc::new(InlineExecutor))
}

async fn frame(stream: &mut PoolStream) -> Arc<HubFrame> {
    let StreamItem::Frame(frame) = stream.next().await.unwrap();
    frame
}

#[tokio::test(start_paused = true)]
async fn first_subscriber_gets_the_snapshot_then_contiguous_deltas() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    let publications = publications(HubConfig::default());
    publications.activate(identity, standalone.handle().clone());
    publish_one(&standalone, 1).await; // no lease yet: the sequence stays at 0
    let mut stream = publications.subscribe(&identity).await.unwrap();
    let chunk = frame(&mut stream).await;
    assert_eq!((chunk.kind, chunk.base_sequence, chunk.sequence), (FrameKind::SnapshotChunk, 0, 0));
    assert!(stream.snapshot_complete());
    publish_one(&standalone, 2).await;
    let delta = frame(&mut stream).await;
    assert_eq!((delta.kind, delta.base_sequence, delta.sequence), (FrameKind::Delta, 0, 1));
    // A later subscriber starts from the current sequence.
    let mut later = publications.subscribe(&identity).await.unwrap();
    assert_eq!(frame(&mut later).await.sequence, 1);
    publish_one(&standalone, 3).await;
    let shared_early = frame(&mut stream).await;
    let shared_late = frame(&mut later).await;
    assert!(Arc::ptr_eq(&shared_early, &shared_late), "one frame instance fans out");
    assert_eq!((shared_late.base_sequence, shared_late.sequence), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn slow_subscriber_is_dropped_as_lagged_while_a_fast_one_continues() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    let publications =
        publications(HubConfig { subscriber_queue_frames: 2, ..HubConfig::default() });
    publications.activate(identity, standalone.handle().clone());
    let mut fast = publications.subscribe(&identity).await.unwrap();
    let mut slow = publications.subscribe(&identity).await.unwrap();
    frame(&mut fast).await;
    frame(&mut slow).await;
    for external in 1..=4 {
        publish_one(&standalone, external).await;
        assert_eq!(frame(&mut fast).await.sequence, external);
    }
    assert_eq!(frame(&mut slow).await.sequence, 1);
    assert_eq!(frame(&mut slow).await.sequence, 2);
    assert_eq!(slow.next().await, Err(PublicationError::SubscriberLagged));
    publish_one(&standalone, 5).await;
    assert_eq!(frame(&mut fast).await.sequence, 5);
}

#[tokio::test(start_paused = true)]
async fn byte_budget_lags_a_subscriber_before_its_frame_capacity() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    // One small delta fits (48 + 12 + 12 + 256 bytes); a second does not.
    let publications =
        publications(HubConfig { subscriber_queue_bytes: 400, ..HubConfig::default() });
    publications.activate(identity, standalone.handle().clone());
    let mut stream = publications.subscribe(&identity).await.unwrap();
    frame(&mut stream).await;
    publish_one(&standalone, 1).await;
    publish_one(&standalone, 2).await;
    assert_eq!(frame(&mut stream).await.sequence, 1);
    assert_eq!(stream.next().await, Err(PublicationError::SubscriberLagged));
}

#[tokio::test(start_paused = true)]
async fn subscriber_limit_is_enforced_per_pool() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let publications =
        publications(HubConfig { subscribers_per_pool_max: 1, ..HubConfig::default() });
    publications.activate(identity, standalone(&identity).handle().clone());
    let first = publications.subscribe(&identity).await.unwrap();
    assert_eq!(
        publications.subscribe(&identity).await.err(),
        Some(PublicationError::SubscriberLimit)
    );
    drop(first);
    assert!(publications.subscribe(&identity).await.is_ok(), "a closed subscriber frees its place");
}

#[tokio::test(start_paused = true)]
async fn idle_hub_is_evicted_and_its_pool_resnapshots_at_the_same_generation() {
    let a = producer("ns/a/generate", 1024, 1);
    let b = producer("ns/b/generate", 1024, 2);
    let actor_a = standalone(&a);
    let publications = publications(HubConfig { initialized_hubs_max: 1, ..HubConfig::default() });
    publications.activate(a, actor_a.handle().clone());
    publications.activate(b, standalone(&b).handle().clone());
    let mut stream_a = publications.subscribe(&a).await.unwrap();
    frame(&mut stream_a).await;
    publish_one(&actor_a, 1).await;
    assert_eq!(frame(&mut stream_a).await.sequence, 1);
    // While A has a subscriber, B cannot get a hub.
    assert_eq!(publications.subscribe(&b).await.err(), Some(PublicationError::InitializedHubLimit));
    drop(stream_a);
    let _stream_b = publications.subscribe(&b).await.unwrap();
    assert_eq!(publications.initialized_hubs(), 1);
    tokio::task::yield_now().await; // the evicted hub retires its lease
    publish_one(&actor_a, 2).await; // no lease: not published, sequence stays 1
    assert_eq!(actor_a.stats().await.unwrap().sequence, 1);
    drop(_stream_b);
    let mut again = publications.subscribe(&a).await.unwrap();
    let chunk = frame(&mut again).await;
    assert_eq!(chunk.sequence, 1, "same generation, sequence did not advance without a lease");
}

#[tokio::test(start_paused = true)]
async fn oversized_delta_resnapshots_and_closes_subscribers() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    let publications = publications(HubConfig { max_delta_images: 2, ..HubConfig::default() });
    publications.activate(identity, standalone.handle().clone());
    let mut stream = publications.subscribe(&identity).await.unwrap();
    frame(&mut stream).await;
    standalone.apply(RankFence(1), (1..=8).map(store).collect()).await.unwrap();
    standalone.flush().await.unwrap().unwrap();
    assert_eq!(stream.next().await, Err(PublicationError::Unavailable));
    let mut fresh = publications.subscribe(&identity).await.unwrap();
    assert_eq!(frame(&mut fresh).await.sequence, 1, "the new mirror includes the big publication");
}

#[tokio::test(start_paused = true)]
async fn stalled_snapshot_bootstrap_times_out_without_fencing() {
    let identity = producer("ns/backend/generate", 1 << 20, 1); // two chunks
    let publications = publications(HubConfig::default());
    publications.activate(identity, standalone(&identity).handle().clone());
    let mut stream = publications.subscribe(&identity).await.unwrap();
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(frame(&mut stream).await.kind, FrameKind::SnapshotChunk);
    assert_eq!(stream.next().await, Err(PublicationError::SnapshotProgressTimeout));
    assert!(publications.fence_requests().take().is_empty());
    let mut fresh = publications.subscribe(&identity).await.unwrap();
    frame(&mut fresh).await;
    frame(&mut fresh).await;
    assert!(fresh.snapshot_complete());
}

#[tokio::test(start_paused = true)]
async fn retired_generation_ends_streams_and_rejects_stale_subscribers() {
    let old = producer("ns/backend/generate", 1024, 1);
    let publications = publications(HubConfig::default());
    publications.activate(old, standalone(&old).handle().clone());
    let mut stream = publications.subscribe(&old).await.unwrap();
    frame(&mut stream).await;
    publications.retire(old.pool_id(), 1).await;
    assert_eq!(stream.next().await, Err(PublicationError::Unavailable));
    assert_eq!(publications.subscribe(&old).await.err(), Some(PublicationError::NotFound));
    let new = producer("ns/backend/generate", 1024, 2);
    publications.activate(new, standalone(&new).handle().clone());
    assert_eq!(publications.subscribe(&old).await.err(), Some(PublicationError::ProducerChanged));
    let mut current = publications.subscribe(&new).await.unwrap();
    assert_eq!(frame(&mut current).await.sequence, 0, "a new generation starts at sequence 0");
}

#[tokio::test(start_paused = true)]
async fn actor_death_fails_the_hub_and_requests_a_fence() {
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    let publications = publications(HubConfig::default());
    publications.activate(identity, standalone.handle().clone());
    let mut stream = publications.subscribe(&identity).await.unwrap();
    frame(&mut stream).await;
    standalone.fence();
    assert_eq!(stream.next().await, Err(PublicationError::Unavailable));
    assert_eq!(publications.fence_requests().take(), vec![(identity.pool_id(), 1)]);
}

/// Holds every blocking job until the test runs it, so jobs in flight can be counted.
#[derive(Default)]
struct ParkedExecutor {
    jobs: std::sync::Mutex<Vec<Box<dyn FnOnce() + Send + 'static>>>,
}

impl std::fmt::Debug for ParkedExecutor {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("ParkedExecutor").field("parked", &self.parked()).finish()
    }
}

impl crate::runtime::BlockingExecutor for ParkedExecutor {
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
        self.jobs.lock().unwrap().push(job);
    }
}

impl ParkedExecutor {
    fn parked(&self) -> usize {
        self.jobs.lock().unwrap().len()
    }

    fn run_one(&self) {
        let job = self.jobs.lock().unwrap().remove(0);
        job();
    }

    /// Drop the oldest job unrun, as a pool thread does when the job panics.
    fn kill_one(&self) {
        drop(self.jobs.lock().unwrap().remove(0));
    }
}

async fn settle() {
    for _ in 0..32 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_encoder_that_dies_fails_the_hub_and_requests_a_fence() {
    let executor = Arc::new(ParkedExecutor::default());
    let publications = PoolPublications::new(
        HubConfig { encoding_concurrency: 1, ..HubConfig::default() },
        Arc::clone(&executor) as Arc<dyn crate::runtime::BlockingExecutor>,
    );
    let identity = producer("ns/backend/generate", 1024, 1);
    let standalone = standalone(&identity);
    publications.activate(identity, standalone.handle().clone());
    let mut dying = publications.subscribe(&identity).await.unwrap();
    let mut bystander = publications.subscribe(&identity).await.unwrap();
    settle().await;
    assert_eq!(executor.parked(), 1, "one chunk encoding at a time");
    executor.kill_one();
    assert_eq!(dying.next().await, Err(PublicationError::Internal));
    assert_eq!(
        publications.fence_requests().take(),
        vec![(identity.pool_id(), 1)],
        "a generation whose snapshot cannot be encoded is fenced, not retried forever"
    );
    // The whole generation stopped: the other subscriber gets its snapshot, then the end of
    // the generation instead of deltas.
    settle().await;
    while executor.parked() > 0 {
        executor.run_one();
        settle().await;
    }
    assert_eq!(frame(&mut bystander).await.kind, FrameKind::SnapshotChunk);
    publish_one(&standalone, 9).await;
    assert_eq!(bystander.next().await, Err(PublicationError::Internal));
}

/// Three pools' snapshots requested at once: `encoding_concurrency` chunks are encoding at any
/// time, the next one starts only when one finishes, and every subscriber gets its snapshot.
async fn encodes_in_flight(encoding_concurrency: usize) -> Vec<usize> {
    let executor = Arc::new(ParkedExecutor::default());
    let publications = PoolPublications::new(
        HubConfig { encoding_concurrency, ..HubConfig::default() },
        Arc::clone(&executor) as Arc<dyn crate::runtime::BlockingExecutor>,
    );
    let mut streams = Vec::new();
    for (index, endpoint) in ["a/b/c", "d/e/f", "g/h/i"].into_iter().enumerate() {
        let identity = producer(endpoint, 1024, index as u64 + 1);
        publications.activate(identity, standalone(&identity).handle().clone());
        streams.push(publications.subscribe(&identity).await.unwrap());
    }
    let mut in_flight = Vec::new();
    settle().await;
    while executor.parked() > 0 {
        in_flight.push(executor.parked());
        executor.run_one();
        settle().await;
    }
    for stream in &mut streams {
        assert_eq!(frame(stream).await.kind, FrameKind::SnapshotChunk);
        assert!(stream.snapshot_complete());
    }
    in_flight
}

#[tokio::test(start_paused = true)]
async fn snapshot_encodes_are_bounded_by_the_encoding_concurrency() {
    assert_eq!(encodes_in_flight(1).await, vec![1, 1, 1], "one encode at a time");
    assert_eq!(encodes_in_flight(2).await, vec![2, 2, 1]);
    assert_eq!(encodes_in_flight(3).await, vec![3, 2, 1], "no bound below the demand");
}

#[test]
fn a_configuration_recorded_before_the_encoder_bound_decodes_to_the_default() {
    /// `HubConfig` as journals recorded it before `encoding_concurrency` existed.
    #[derive(serde::Serialize)]
    struct Recorded {
        subscriber_queue_frames: usize,
        subscriber_queue_bytes: usize,
        subscribers_per_pool_max: usize,
        initialized_hubs_max: usize,
        max_delta_images: usize,
        snapshot_progress_timeout: Duration,
    }
    let current = HubConfig::default();
    let recorded = Recorded {
        subscriber_queue_frames: current.subscriber_queue_frames,
        subscriber_queue_bytes: current.subscriber_queue_bytes,
        subscribers_per_pool_max: current.subscribers_per_pool_max,
        initialized_hubs_max: current.initialized_hubs_max,
        max_delta_images: current.max_delta_images,
        snapshot_progress_timeout: current.snapshot_progress_timeout,
    };
    let bytes = rmp_serde::to_vec(&recorded).unwrap();
    let decoded: HubConfig = rmp_serde::from_slice(&bytes).unwrap();
    assert_eq!(decoded, current);
    let bounded = HubConfig { encoding_concurrency: 1, ..current };
    assert_ne!(decoded, bounded, "a recording with another bound is refused");
}

/// Feed `frame` to `replica` as a consumer does.
fn accept(replica: &mut FilterReplica, frame: &HubFrame) {
    let payload = &frame.payload[..];
    let filter_frame = match frame.kind {
        FrameKind::SnapshotChunk => FilterFrame::SnapshotChunk {
            base_sequence: frame.base_sequence,
            sequence: frame.sequence,
            payload,
        },
        FrameKind::Delta => FilterFrame::Delta {
            base_sequence: frame.base_sequence,
            sequence: frame.sequence,
            payload,
        },
    };
    replica.accept(filter_frame).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_sparse_mirror_serves_the_same_filter_as_it_fills_and_turns_dense() {
    let identity = producer("ns/backend/generate", 64, 1);
    let standalone = standalone(&identity);
    let publications = publications(HubConfig::default());
    publications.activate(identity, standalone.handle().clone());
    let mut follower = publications.subscribe(&identity).await.unwrap();
    let mut followed = FilterReplica::new(identity.format(), 7).unwrap();
    accept(&mut followed, &*frame(&mut follower).await);
    let hub = Arc::clone(follower.hub());
    assert!(hub.mirror_is_sparse(), "an empty pool is mirrored sparse");
    let mut saw_sparse_with_words = false;
    for external in 1..=120 {
        publish_one(&standalone, external).await;
        accept(&mut followed, &*frame(&mut follower).await);
        // A new subscriber's snapshot, from the mirror as it is now, equals the followed filter.
        let mut late = publications.subscribe(&identity).await.unwrap();
        let mut joined = FilterReplica::new(identity.format(), 7).unwrap();
        accept(&mut joined, &*frame(&mut late).await);
        assert_eq!(joined.words(), followed.words(), "after block {external}");
        saw_sparse_with_words |= hub.mirror_is_sparse();
    }
    assert!(saw_sparse_with_words, "the mirror was sparse while it held words");
    assert!(!hub.mirror_is_sparse(), "120 blocks in 64 buckets turn it dense");
}
