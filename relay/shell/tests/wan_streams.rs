//! Pool stream bounds over real loopback TCP through the gRPC API: a subscriber that stops
//! reading is ended with RESOURCE_EXHAUSTED / SUBSCRIBER_LAGGED while a fast one on the same
//! pool keeps every delta, and an idle hub evicted under the initialized-hub limit comes back
//! as a fresh snapshot of the same producer generation followed by contiguous deltas.

mod support;

use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::pool::StandalonePool;
use kvrelay::wan::{LimitScope, StreamType};
use kvrelay_consumer::endpoint;
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::sources::RankFence;
use kvrelay_core::wire::{FilterStreamGuard, RelayErrorReason, encode};
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use support::{
    ENDPOINT, LoopbackRelay, MAX_MESSAGE_BYTES, occupied_slots, pool_request, producer, remove,
    store, store_run,
};
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

/// Every wait is bounded; a healthy run needs a small fraction of this.
const PATIENCE: Duration = Duration::from_secs(20);

/// A raw pool stream and the replica it builds, checked frame by frame.
struct Follower {
    stream: Streaming<proto::FilterUpdate>,
    guard: FilterStreamGuard,
    replica: FilterReplica,
}

impl Follower {
    /// Subscribe to `producer` and install its complete snapshot.
    async fn open(client: &mut KvEventRelayClient<Channel>, producer: &ProducerIdentity) -> Self {
        let stream =
            client.subscribe_kv_pool(pool_request(producer, "t")).await.unwrap().into_inner();
        Self::snapshot(stream, producer).await
    }

    async fn snapshot(stream: Streaming<proto::FilterUpdate>, producer: &ProducerIdentity) -> Self {
        let mut follower = Follower {
            stream,
            guard: FilterStreamGuard::new(*producer),
            replica: FilterReplica::new(producer.format(), producer.pool_id().dc_id.0).unwrap(),
        };
        while follower.replica.sequence().is_none() {
            let update = follower.next().await.expect("the snapshot arrives");
            assert_eq!(update.kind, proto::FilterUpdateKind::SnapshotChunk as i32);
        }
        follower
    }

    /// The next chunk or delta, applied to the replica (heartbeats are skipped), or the status
    /// that ended the stream.
    async fn next(&mut self) -> Result<proto::FilterUpdate, Status> {
        loop {
            let update = tokio::time::timeout(PATIENCE, self.stream.message())
                .await
                .expect("the stream moves")?
                .expect("a pool stream never ends cleanly");
            if update.kind == proto::FilterUpdateKind::Heartbeat as i32 {
                continue;
            }
            self.replica.accept(self.guard.check(&update).unwrap().frame).unwrap();
            return Ok(update);
        }
    }

    /// Take deltas until the replica is at `sequence`; each must extend the last by one.
    async fn follow_to(&mut self, sequence: u64) {
        while self.replica.sequence() != Some(sequence) {
            let before = self.replica.sequence().unwrap();
            let delta = self.next().await.unwrap();
            assert_eq!(
                (delta.kind, delta.base_sequence, delta.sequence),
                (proto::FilterUpdateKind::Delta as i32, before, before + 1)
            );
        }
    }
}

/// Apply `events` and publish them; the sequence the actor is at afterwards.
async fn publish(
    actor: &StandalonePool,
    events: Vec<kvrelay_core::model::kv_events::RouterEvent>,
) -> u64 {
    actor.apply(RankFence(1), events).await.unwrap();
    actor.flush().await.unwrap().unwrap()
}

fn reason(status: &Status) -> (Code, Option<RelayErrorReason>) {
    (status.code(), kvrelay_consumer::policy::reason_from_status(status))
}

/// Blocks stored per round of the lag test; a round's delta carries up to twice as many images
/// (these stores and the removal of an older round), about 1.6 KB of CBI1.
const BLOCKS_PER_ROUND: u64 = 64;
/// Rounds a block stays resident.
const RESIDENT_ROUNDS: u64 = 32;

/// Round `round`'s events: store a fresh run, remove the run stored `RESIDENT_ROUNDS` earlier.
fn round_events(round: u64) -> Vec<kvrelay_core::model::kv_events::RouterEvent> {
    let run = |round: u64| round * BLOCKS_PER_ROUND + 1..(round + 1) * BLOCKS_PER_ROUND + 1;
    let mut events = vec![store_run(run(round))];
    if let Some(old) = round.checked_sub(RESIDENT_ROUNDS) {
        events.push(remove(run(old)));
    }
    events
}

#[tokio::test]
async fn slow_subscriber_is_lagged_while_a_fast_one_receives_every_delta() {
    // A small queue bound; the slow client's HTTP/2 stream window is small too, so the bytes
    // the transport can absorb for a reader that stopped are bounded well below what is sent.
    let tuning = WanTuning { publication_queue_frames: 4, ..WanTuning::default() };
    let relay = LoopbackRelay::start(tuning).await;
    let pool = producer(ENDPOINT, 1, 8192);
    let actor = relay.activate(pool, 7);
    let mut fast_client = relay.client().await;
    let slow_channel = endpoint(&relay.address.to_string())
        .unwrap()
        .initial_stream_window_size(Some(16 << 10))
        .connect()
        .await
        .unwrap();
    let mut slow_client =
        KvEventRelayClient::new(slow_channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut fast = Follower::open(&mut fast_client, &pool).await;
    let mut slow = Follower::open(&mut slow_client, &pool).await;
    assert_eq!((fast.replica.sequence(), slow.replica.sequence()), (Some(0), Some(0)));

    // About 500 KB of deltas while the slow subscriber reads nothing (it can hold ~40 KB).
    let mut round = 0;
    let mut sequence = 0;
    while round < 300 {
        sequence = publish(&actor, round_events(round)).await;
        fast.follow_to(sequence).await;
        round += 1;
    }
    assert!(sequence >= 300, "every round published at least one delta");

    // The slow subscriber finds what was buffered for it, contiguous, then the lag.
    let lagged = loop {
        let before = slow.replica.sequence().unwrap();
        match slow.next().await {
            Ok(delta) => assert_eq!((delta.base_sequence, delta.sequence), (before, before + 1)),
            Err(status) => break status,
        }
    };
    assert_eq!(
        reason(&lagged),
        (Code::ResourceExhausted, Some(RelayErrorReason::SubscriberLagged))
    );
    let stats = relay.service.stats();
    assert_eq!(stats.subscriber_lagged[StreamType::Pool as usize], 1);
    assert_eq!(stats.terminal_publication_failures, 0, "lag is not a publication failure");
    let slow_reached = slow.replica.sequence().unwrap();
    assert!(
        (4..sequence).contains(&slow_reached),
        "the slow subscriber got its queued frames ({slow_reached}) and lost the rest of {sequence}"
    );

    // The fast subscriber is unaffected: it keeps following and ends equal to the relay.
    while round < 350 {
        sequence = publish(&actor, round_events(round)).await;
        fast.follow_to(sequence).await;
        round += 1;
    }
    let oracle = Follower::open(&mut fast_client, &pool).await;
    assert_eq!(oracle.replica.sequence(), Some(sequence));
    assert_eq!(fast.replica.words(), oracle.replica.words());
    assert_eq!(occupied_slots(&fast.replica), RESIDENT_ROUNDS * BLOCKS_PER_ROUND);
}

/// Subscribe, retrying while the relay has not yet noticed that an earlier stream closed (its
/// hub is not idle until then).
async fn subscribe_when_admitted(
    client: &mut KvEventRelayClient<Channel>,
    producer: &ProducerIdentity,
) -> Follower {
    for _ in 0..250 {
        match client.subscribe_kv_pool(pool_request(producer, "t")).await {
            Ok(stream) => return Follower::snapshot(stream.into_inner(), producer).await,
            Err(status) => {
                assert_eq!(
                    reason(&status),
                    (Code::ResourceExhausted, Some(RelayErrorReason::ResourceLimit))
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    panic!("no idle hub was evicted for the subscription");
}

#[tokio::test]
async fn evicted_idle_hub_resnapshots_at_the_same_generation_then_continues() {
    let tuning = WanTuning { max_initialized_pool_hubs: 1, ..WanTuning::default() };
    let relay = LoopbackRelay::start(tuning).await;
    let a = producer("dynamo/a/generate", 1, 1024);
    let b = producer("dynamo/b/generate", 1, 1024);
    let actor_a = relay.activate(a, 1);
    let _actor_b = relay.activate(b, 2);
    let mut client = relay.client().await;

    let mut first = Follower::open(&mut client, &a).await;
    assert_eq!(publish(&actor_a, vec![store(1, None), store(2, Some(1))]).await, 1);
    first.follow_to(1).await;
    assert_eq!(relay.publications.initialized_hubs(), 1);

    // A's hub has a subscriber, so it is not idle: no hub for B.
    let refused = client.subscribe_kv_pool(pool_request(&b, "t")).await.unwrap_err();
    assert_eq!(reason(&refused), (Code::ResourceExhausted, Some(RelayErrorReason::ResourceLimit)));
    let hub_refusals = |relay: &LoopbackRelay| {
        relay.service.stats().subscriber_limit_rejected[StreamType::Pool as usize]
            [LimitScope::InitializedHub as usize]
    };
    assert_eq!(hub_refusals(&relay), 1);
    let hubs = relay.publications.hub_counts();
    assert_eq!((hubs.initialized, hubs.ready, hubs.idle), (1, 1, 0));

    // Once A's only stream closes, B's first subscriber evicts A's idle hub.
    drop(first);
    let on_b = subscribe_when_admitted(&mut client, &b).await;
    assert_eq!(on_b.replica.sequence(), Some(0));
    assert_eq!(relay.publications.initialized_hubs(), 1);

    // The evicted hub retired A's lease: A keeps its state but publishes nothing.
    let retired = tokio::time::timeout(PATIENCE, async {
        while actor_a.stats().await.unwrap().lease.is_some() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(retired.is_ok(), "eviction retires the publication lease");
    assert_eq!(publish(&actor_a, vec![store(3, Some(2)), store(4, None)]).await, 1);
    assert_eq!(actor_a.stats().await.unwrap().resident_blocks, 4);

    // The generation was never withdrawn: a new subscriber (evicting B's idle hub) gets a fresh
    // snapshot of the same producer at the sequence A stopped at, with every resident block.
    drop(on_b);
    let mut again = subscribe_when_admitted(&mut client, &a).await;
    assert_eq!(again.replica.sequence(), Some(1));
    assert_eq!(occupied_slots(&again.replica), 4);
    assert_eq!(relay.publications.producer(&a.pool_id()), Some(a));
    for (external, expected) in [(5, 2), (6, 3)] {
        assert_eq!(publish(&actor_a, vec![store(external, None)]).await, expected);
        let delta = again.next().await.unwrap();
        assert_eq!(delta.producer, Some(encode::producer(&a)));
        assert_eq!(
            (delta.kind, delta.base_sequence, delta.sequence),
            (proto::FilterUpdateKind::Delta as i32, expected - 1, expected)
        );
    }
    assert_eq!(occupied_slots(&again.replica), 6);
}
