//! Conformance of the WAN service over real loopback TCP: every RPC, every error path the
//! contract names, stream limits, chunked snapshots, heartbeats, and a consumer replica that
//! ends equal to the relay's filter.

mod support;

use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::pool::StandalonePool;
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::RankFence;
use kvrelay_core::wire::{self, RelayErrorReason, encode};
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use support::{
    ENDPOINT, LoopbackRelay, base_descriptor, occupied_slots, pool_request, producer, remove, store,
};
use tonic::Code;
use tonic::transport::Channel;

/// One pool on a loopback relay, its catalog published, and a client.
struct Harness {
    client: KvEventRelayClient<Channel>,
    actor: StandalonePool,
    identity: ProducerIdentity,
    server: LoopbackRelay,
}

async fn harness(tuning: WanTuning, buckets: u64) -> Harness {
    let server = LoopbackRelay::start(tuning).await;
    let identity = producer(ENDPOINT, 1, buckets);
    let actor = server.activate(identity, 3);
    server.publish_catalog(1, vec![base_descriptor(identity, ENDPOINT)]);
    let client = server.client().await;
    Harness { client, actor, identity, server }
}

fn reason(status: &tonic::Status) -> Option<RelayErrorReason> {
    kvrelay_consumer::policy::reason_from_status(status)
}

#[tokio::test]
async fn relay_info_and_catalog_answer_with_the_contract_envelope() {
    let mut h = harness(WanTuning::default(), 1024).await;
    let info = h
        .client
        .get_relay_info(proto::RelayInfoRequest { contract_marker: CONTRACT_MARKER })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.protocol_version, 1);
    assert_eq!(info.contract_marker, 0x4B56_5231);
    assert_eq!(info.relay, Some(encode::relay_identity(&h.server.relay)));
    let mut catalog = h
        .client
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "t".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let first = catalog.message().await.unwrap().unwrap();
    let validated = wire::validate_catalog_update(&first).unwrap();
    assert_eq!(validated.revision, 1);
    assert_eq!(validated.pools.len(), 1);
    assert_eq!(validated.pools[0].producer, h.identity);
    h.server.publish_catalog(2, Vec::new());
    let second = catalog.message().await.unwrap().unwrap();
    assert_eq!(second.revision, 2);
    assert!(second.snapshot.unwrap().pools.is_empty(), "absence from a snapshot is the withdrawal");
}

#[tokio::test]
async fn error_reasons_cross_the_grpc_boundary() {
    let mut h = harness(WanTuning::default(), 1024).await;
    let marker =
        h.client.get_relay_info(proto::RelayInfoRequest { contract_marker: 0 }).await.unwrap_err();
    assert_eq!(
        (marker.code(), reason(&marker)),
        (Code::FailedPrecondition, Some(RelayErrorReason::ContractMismatch))
    );
    let wrong = h
        .client
        .get_relay_info(proto::RelayInfoRequest { contract_marker: 0x4B56_5232 })
        .await
        .unwrap_err();
    assert_eq!(reason(&wrong), Some(RelayErrorReason::ContractMismatch));

    let mut future_version = pool_request(&h.identity, "t");
    future_version.expected_producer.as_mut().unwrap().pool_id.as_mut().unwrap().identity_version =
        2;
    let status = h.client.subscribe_kv_pool(future_version).await.unwrap_err();
    assert_eq!(
        (status.code(), reason(&status)),
        (Code::FailedPrecondition, Some(RelayErrorReason::UnsupportedFeature))
    );

    let mut zero_generation = pool_request(&h.identity, "t");
    zero_generation.expected_producer.as_mut().unwrap().layout_generation = 0;
    let status = h.client.subscribe_kv_pool(zero_generation).await.unwrap_err();
    assert_eq!(
        (status.code(), reason(&status)),
        (Code::InvalidArgument, Some(RelayErrorReason::InvalidRequest))
    );

    let mut unknown_dc = pool_request(&h.identity, "t");
    unknown_dc.expected_producer.as_mut().unwrap().pool_id.as_mut().unwrap().dc_id += 1;
    let status = h.client.subscribe_kv_pool(unknown_dc).await.unwrap_err();
    assert_eq!(
        (status.code(), reason(&status)),
        (Code::NotFound, Some(RelayErrorReason::PoolNotFound))
    );

    let mut stale = pool_request(&h.identity, "t");
    stale.expected_producer.as_mut().unwrap().layout_generation += 1000;
    let status = h.client.subscribe_kv_pool(stale).await.unwrap_err();
    assert_eq!(
        (status.code(), reason(&status)),
        (Code::FailedPrecondition, Some(RelayErrorReason::ProducerChanged))
    );

    for bad_id in [String::new(), "x".repeat(129)] {
        let status =
            h.client.subscribe_kv_pool(pool_request(&h.identity, &bad_id)).await.unwrap_err();
        assert_eq!(
            (status.code(), reason(&status)),
            (Code::InvalidArgument, Some(RelayErrorReason::InvalidRequest))
        );
    }
    let missing = proto::SubscribeKvPoolRequest {
        subscriber_id: "t".into(),
        expected_producer: None,
        contract_marker: CONTRACT_MARKER,
    };
    let status = h.client.subscribe_kv_pool(missing).await.unwrap_err();
    assert_eq!(reason(&status), Some(RelayErrorReason::InvalidRequest));
}

#[tokio::test]
async fn one_stream_past_the_limit_is_refused_and_the_permit_returns_on_close() {
    let tuning = WanTuning { max_readiness_subscribers: 1, ..WanTuning::default() };
    let mut h = harness(tuning, 1024).await;
    let request = || proto::SubscribeServingReadinessRequest {
        subscriber_id: "t".into(),
        contract_marker: CONTRACT_MARKER,
    };
    let mut first = h.client.subscribe_serving_readiness(request()).await.unwrap().into_inner();
    assert_eq!(first.message().await.unwrap().unwrap().revision, 1);
    let refused = h.client.subscribe_serving_readiness(request()).await.unwrap_err();
    assert_eq!(
        (refused.code(), reason(&refused)),
        (Code::ResourceExhausted, Some(RelayErrorReason::ResourceLimit))
    );
    drop(first);
    let mut admitted = None;
    for _ in 0..50 {
        match h.client.subscribe_serving_readiness(request()).await {
            Ok(stream) => {
                admitted = Some(stream.into_inner());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(admitted.is_some(), "closing the first stream released its permit");
}

#[tokio::test]
async fn a_four_chunk_snapshot_then_heartbeats_that_do_not_advance_the_sequence() {
    let tuning =
        WanTuning { pool_heartbeat_interval: Duration::from_millis(150), ..WanTuning::default() };
    let mut h = harness(tuning, 4 * 524_288).await;
    let mut stream =
        h.client.subscribe_kv_pool(pool_request(&h.identity, "t")).await.unwrap().into_inner();
    let mut replica =
        FilterReplica::new(h.identity.format(), h.identity.pool_id().dc_id.0).unwrap();
    let mut guard = wire::FilterStreamGuard::new(h.identity);
    for chunk in 0..4 {
        let update = stream.message().await.unwrap().unwrap();
        assert_eq!(
            update.kind,
            proto::FilterUpdateKind::SnapshotChunk as i32,
            "frame {chunk} is a chunk"
        );
        let frame = guard.check(&update).unwrap();
        replica.accept(frame.frame).unwrap();
    }
    assert_eq!(replica.sequence(), Some(0));
    let beat = stream.message().await.unwrap().unwrap();
    assert_eq!(beat.kind, proto::FilterUpdateKind::Heartbeat as i32);
    assert_eq!((beat.base_sequence, beat.sequence), (0, 0));
    assert!(beat.payload.is_empty());
    h.actor.apply(RankFence(1), vec![store(1, None)]).await.unwrap();
    h.actor.flush().await.unwrap().unwrap();
    let delta = stream.message().await.unwrap().unwrap();
    assert_eq!(
        (delta.kind, delta.base_sequence, delta.sequence),
        (proto::FilterUpdateKind::Delta as i32, 0, 1)
    );
    replica.accept(guard.check(&delta).unwrap().frame).unwrap();
    let beat = stream.message().await.unwrap().unwrap();
    assert_eq!((beat.kind, beat.sequence), (proto::FilterUpdateKind::Heartbeat as i32, 1));
}

#[tokio::test]
async fn after_a_random_workload_the_consumer_replica_equals_the_relay() {
    let mut h = harness(WanTuning::default(), 4096).await;
    let mut stream = h
        .client
        .subscribe_kv_pool(pool_request(&h.identity, "consumer"))
        .await
        .unwrap()
        .into_inner();
    let mut replica =
        FilterReplica::new(h.identity.format(), h.identity.pool_id().dc_id.0).unwrap();
    let mut guard = wire::FilterStreamGuard::new(h.identity);
    let first = stream.message().await.unwrap().unwrap();
    replica.accept(guard.check(&first).unwrap().frame).unwrap();
    let mut rng = rng_from_seed(99);
    let mut live: Vec<u64> = Vec::new();
    for round in 0..200u64 {
        use rand_core::Rng;
        let mut events = Vec::new();
        for i in 0..8u64 {
            let external = round * 100 + i + 1;
            let parent = if rng.next_u32().is_multiple_of(2) { live.last().copied() } else { None };
            events.push(store(external, parent));
            live.push(external);
        }
        if live.len() > 600 {
            let removed: Vec<u64> = live.drain(..8).collect();
            events.push(remove(removed));
        }
        h.actor.apply(RankFence(1), events).await.unwrap();
        let flushed = h.actor.flush().await.unwrap().unwrap();
        while replica.sequence() != Some(flushed) {
            let update = stream.message().await.unwrap().unwrap();
            if update.kind != proto::FilterUpdateKind::Heartbeat as i32 {
                replica.accept(guard.check(&update).unwrap().frame).unwrap();
            }
        }
    }
    let last = h.actor.flush().await.unwrap().unwrap();
    let stats = h.actor.stats().await.unwrap();
    assert!(stats.resident_blocks > 500);
    assert_eq!(
        occupied_slots(&replica),
        stats.resident_blocks,
        "every resident fingerprint reached the replica"
    );
    let mut relay_stream =
        h.client.subscribe_kv_pool(pool_request(&h.identity, "second")).await.unwrap().into_inner();
    let mut fresh = FilterReplica::new(h.identity.format(), h.identity.pool_id().dc_id.0).unwrap();
    let snapshot = relay_stream.message().await.unwrap().unwrap();
    fresh.accept(guard.check(&snapshot).unwrap().frame).unwrap();
    assert_eq!(fresh.sequence(), Some(last));
    assert_eq!(
        fresh.words(),
        replica.words(),
        "a fresh snapshot equals the incrementally built replica"
    );
}

#[tokio::test]
async fn readiness_and_load_follow_updates() {
    let tuning = WanTuning {
        readiness_heartbeat_interval: Duration::from_millis(100),
        ..WanTuning::default()
    };
    let mut h = harness(tuning, 1024).await;
    let mut readiness = h
        .client
        .subscribe_serving_readiness(proto::SubscribeServingReadinessRequest {
            subscriber_id: "t".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(readiness.message().await.unwrap().unwrap().revision, 1);
    // Heartbeat repeats the same revision.
    assert_eq!(readiness.message().await.unwrap().unwrap().revision, 1);
    let mut load = h
        .client
        .subscribe_kv_pool_load(proto::SubscribeKvPoolLoadRequest {
            subscriber_id: "t".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(load.message().await.unwrap().unwrap().window_sequence, 0);
    let window = |sequence: u64| proto::KvPoolLoadUpdate {
        protocol_version: 1,
        relay: Some(encode::relay_identity(&h.server.relay)),
        window_sequence: sequence,
        observed_ms: 1,
        window_ms: 1000,
        pools: vec![proto::KvPoolLoadEntry {
            producer: Some(encode::producer(&h.identity)),
            kv_used_blocks: 600,
            total_kv_blocks: 16384,
            kv_observed_ranks: 1,
            kv_expected_ranks: 1,
        }],
        contract_marker: CONTRACT_MARKER,
    };
    h.server.publisher.publish_load(window(1));
    h.server.publisher.publish_load(window(2));
    let first = load.message().await.unwrap().unwrap();
    assert_eq!(first.window_sequence, 1);
    assert_eq!(first.pools[0].kv_used_blocks, 600);
    assert_eq!(load.message().await.unwrap().unwrap().window_sequence, 2);
}

#[tokio::test]
async fn shutdown_force_closes_open_streams() {
    let Harness { mut client, mut server, .. } = harness(WanTuning::default(), 1024).await;
    let mut catalog = client
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "t".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    catalog.message().await.unwrap().unwrap();
    server.stop();
    let ended =
        tokio::time::timeout(Duration::from_secs(5), catalog.message()).await.expect("stream ends");
    let status = ended.unwrap_err();
    assert_eq!(
        (status.code(), reason(&status)),
        (Code::Unavailable, Some(RelayErrorReason::PublicationUnavailable))
    );
}
