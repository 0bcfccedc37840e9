//! The consumer state driven by encoded relay messages, without any network.

use std::collections::BTreeSet;

use super::*;
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use kvrelay_core::filter::cbi1::FrameEncoder;
use kvrelay_core::filter::ckf::{BucketImage, CkfFormat, DEFAULT_SEED};
use kvrelay_core::host::CatalogSnapshot;
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{EndpointPath, resolve_indexer_domain, stable_dc_id};
use kvrelay_core::wire::{RelayErrorReason, encode};

const BUCKETS: u64 = 64;

fn relay() -> RelayIdentity {
    RelayIdentity { drt_instance_id: 1, relay_incarnation: 2 }
}

fn producer(endpoint: &str, generation: u64) -> ProducerIdentity {
    let endpoint: EndpointPath = endpoint.parse().unwrap();
    let domain =
        resolve_indexer_domain("tiny-llm", 4, HashFormat::StandardV1, &endpoint, None).unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("dc-a").unwrap() };
    ProducerIdentity::new(pool_id, 2, generation, CkfFormat::v1(DEFAULT_SEED, BUCKETS)).unwrap()
}

fn descriptor(producer: ProducerIdentity, endpoint: &str) -> PoolDescriptor {
    PoolDescriptor {
        producer,
        serving_endpoint: endpoint.parse().unwrap(),
        registrations: vec![ModelRegistration {
            canonical_model_id: "tiny-llm".into(),
            target: ModelTarget::Base { base_model: "tiny-llm".into() },
            aliases: BTreeSet::new(),
        }],
        query_semantics: QuerySemantics { kv_block_size: 4, hash_format: HashFormat::StandardV1 },
        pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
    }
}

fn catalog(revision: u64, pools: Vec<PoolDescriptor>) -> proto::KvPoolCatalogUpdate {
    encode::catalog_update(&relay(), &CatalogSnapshot { revision, pools })
}

fn encoder(producer: &ProducerIdentity) -> FrameEncoder {
    FrameEncoder::new(producer.format(), producer.pool_id().dc_id.0).unwrap()
}

/// A replica of `producer` installed from a snapshot of `words` at `sequence`.
fn ready_replica(producer: &ProducerIdentity, sequence: u64, words: &[u64]) -> FilterReplica {
    let mut replica = FilterReplica::new(producer.format(), producer.pool_id().dc_id.0).unwrap();
    for frame in encoder(producer).encode_snapshot(sequence, words).unwrap() {
        replica
            .accept(FilterFrame::SnapshotChunk {
                base_sequence: sequence,
                sequence,
                payload: &frame,
            })
            .unwrap();
    }
    replica
}

const A: &str = "dynamo/a/generate";
const B: &str = "dynamo/b/generate";

#[test]
fn catalog_messages_start_and_stop_exactly_the_changed_subscriptions() {
    let mut state = ConsumerState::new();
    let (a1, b1, a2) = (producer(A, 1), producer(B, 2), producer(A, 3));
    let step = state.apply_catalog(&catalog(1, vec![descriptor(a1, A), descriptor(b1, B)]));
    assert_eq!((step.stop, step.fault), (vec![], None));
    assert_eq!(step.start.iter().copied().collect::<BTreeSet<_>>(), BTreeSet::from([a1, b1]));
    // A repeat (heartbeat) changes nothing.
    let repeat = state.apply_catalog(&catalog(1, vec![descriptor(a1, A), descriptor(b1, B)]));
    assert_eq!(repeat, CatalogStep::default());
    // A new producer for pool A: stop a1, start a2; B untouched.
    let change = state.apply_catalog(&catalog(2, vec![descriptor(a2, A), descriptor(b1, B)]));
    assert_eq!((change.stop, change.start), (vec![a1], vec![a2]));
    // B withdrawn.
    let withdrawal = state.apply_catalog(&catalog(3, vec![descriptor(a2, A)]));
    assert_eq!((withdrawal.stop, withdrawal.start), (vec![b1], vec![]));
    let snapshot = state.snapshot();
    assert_eq!(snapshot.catalog_revision, Some(3));
    assert_eq!(snapshot.relay, Some(relay()));
    assert_eq!(snapshot.pools.len(), 1);
    assert_eq!(snapshot.pools[0].producer, a2);
    assert_eq!(snapshot.counters.producer_changes, 1);
}

#[test]
fn metadata_refresh_keeps_the_replica() {
    let mut state = ConsumerState::new();
    let a1 = producer(A, 1);
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A)]));
    assert_eq!(
        state.install(&a1, ready_replica(&a1, 4, &[0; BUCKETS as usize])),
        FrameStep::Accepted
    );
    let mut refreshed = descriptor(a1, A);
    refreshed.registrations[0].aliases.insert("tiny".into());
    let step = state.apply_catalog(&catalog(2, vec![refreshed.clone()]));
    assert_eq!(step, CatalogStep::default());
    let snapshot = state.snapshot();
    assert_eq!(snapshot.pools[0].descriptor, refreshed);
    assert_eq!(snapshot.pools[0].sequence, Some(4));
}

#[test]
fn a_superseded_producer_never_touches_the_new_slot() {
    let mut state = ConsumerState::new();
    let (a1, a2) = (producer(A, 1), producer(A, 2));
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A)]));
    let _ = state.apply_catalog(&catalog(2, vec![descriptor(a2, A)]));
    assert!(!state.is_current(&a1));
    assert_eq!(
        state.install(&a1, ready_replica(&a1, 0, &[0; BUCKETS as usize])),
        FrameStep::Superseded
    );
    assert!(!state.filter_opened(&a1));
    state.filter_ended(&a1, Some(FaultKind::StreamEnded), FilterStatus::Backoff);
    let snapshot = state.snapshot();
    assert_eq!(snapshot.pools[0].producer, a2);
    assert_eq!(snapshot.pools[0].status, FilterStatus::Connecting);
    assert_eq!(snapshot.pools[0].sequence, None);
}

#[test]
fn deltas_keep_the_resident_slot_count_and_a_fault_drops_only_that_replica() {
    let mut state = ConsumerState::new();
    let (a1, b1) = (producer(A, 1), producer(B, 1));
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A), descriptor(b1, B)]));
    let mut words = vec![0u64; BUCKETS as usize];
    words[3] = 0x0001_0002; // two slots
    words[9] = 0x0005_0000_0000_0000; // one slot
    assert_eq!(state.install(&a1, ready_replica(&a1, 10, &words)), FrameStep::Accepted);
    assert_eq!(state.install(&b1, ready_replica(&b1, 0, &words)), FrameStep::Accepted);
    assert_eq!(state.snapshot().pools.iter().map(|p| p.resident_slots).sum::<u64>(), 6);
    let delta = encoder(&a1)
        .encode_delta(
            10,
            11,
            &[BucketImage { bucket: 3, word: 0x0001 }, BucketImage { bucket: 40, word: u64::MAX }],
        )
        .unwrap();
    let step = state
        .apply_frame(&a1, FilterFrame::Delta { base_sequence: 10, sequence: 11, payload: &delta });
    assert_eq!(step, FrameStep::Accepted);
    let pool_a = state.snapshot().pool(&a1.pool_id()).cloned().unwrap();
    assert_eq!((pool_a.sequence, pool_a.resident_slots), (Some(11), 1 + 1 + 4));
    assert_eq!(
        state.apply_frame(&a1, FilterFrame::Heartbeat { base_sequence: 11, sequence: 11 }),
        FrameStep::Accepted
    );
    // A gap is rejected; the shell then ends the stream, which drops A's replica only.
    let gap = encoder(&a1).encode_delta(12, 13, &[BucketImage { bucket: 1, word: 1 }]).unwrap();
    assert_eq!(
        state.apply_frame(
            &a1,
            FilterFrame::Delta { base_sequence: 12, sequence: 13, payload: &gap }
        ),
        FrameStep::Rejected
    );
    assert!(
        state
            .query(&[1, 2, 3, 4], "tiny-llm")
            .iter()
            .all(|answer| { answer.replica_ready == (answer.pool_id() == b1.pool_id()) })
    );
    state.filter_ended(&a1, Some(FaultKind::Replica), FilterStatus::Backoff);
    let snapshot = state.snapshot();
    let pool_a = snapshot.pool(&a1.pool_id()).unwrap();
    assert_eq!((pool_a.sequence, pool_a.status), (None, FilterStatus::Backoff));
    assert_eq!(snapshot.pool(&b1.pool_id()).unwrap().sequence, Some(0));
    assert_eq!(snapshot.counters.fault_count(Plane::Filter, FaultKind::Replica), 1);
    assert_eq!(snapshot.counters.replicas_dropped, 1);
    assert_eq!((snapshot.counters.deltas_applied, snapshot.counters.heartbeats_confirmed), (1, 1));
    assert_eq!(state.filter_copy(&b1.pool_id()).unwrap().words, words);
    assert_eq!(state.filter_copy(&a1.pool_id()), None);
}

#[test]
fn losing_the_catalog_withdraws_every_pool_but_not_readiness_or_load() {
    let mut state = ConsumerState::new();
    let a1 = producer(A, 1);
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A)]));
    let _ = state.install(&a1, ready_replica(&a1, 0, &[0; BUCKETS as usize]));
    assert_eq!(state.apply_readiness(&encode::readiness_update(&relay(), 5, &[])), None);
    let stop = state.catalog_lost(Some(FaultKind::Code(tonic::Code::Unavailable as i32)));
    assert_eq!(stop, vec![a1]);
    let snapshot = state.snapshot();
    assert!(snapshot.pools.is_empty());
    assert_eq!(snapshot.catalog_revision, None);
    assert_eq!(snapshot.readiness_revision, Some(5), "planes are independent");
    assert_eq!(snapshot.counters.replicas_dropped, 1);
}

#[test]
fn an_invalid_catalog_empties_the_view_and_a_foreign_contract_is_named() {
    let mut state = ConsumerState::new();
    let a1 = producer(A, 1);
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A)]));
    let mut foreign = catalog(2, vec![descriptor(a1, A)]);
    foreign.contract_marker = 0x4B56_5232;
    let step = state.apply_catalog(&foreign);
    assert_eq!((step.stop, step.fault), (vec![a1], Some(FaultKind::ContractMismatch)));
    let mut missing_relay = catalog(3, vec![]);
    missing_relay.relay = None;
    assert_eq!(state.apply_catalog(&missing_relay).fault, Some(FaultKind::InvalidMessage));
}

#[test]
fn load_is_reported_only_for_catalogued_producers_and_stale_windows_are_ignored() {
    let mut state = ConsumerState::new();
    let (a1, a2) = (producer(A, 1), producer(A, 2));
    let _ = state.apply_catalog(&catalog(1, vec![descriptor(a1, A)]));
    let window = |sequence: u64, producer: &ProducerIdentity| proto::KvPoolLoadUpdate {
        protocol_version: 1,
        relay: Some(encode::relay_identity(&relay())),
        window_sequence: sequence,
        observed_ms: 1,
        window_ms: 1000,
        pools: vec![proto::KvPoolLoadEntry {
            producer: Some(encode::producer(producer)),
            kv_used_blocks: 600,
            total_kv_blocks: 16384,
            kv_observed_ranks: 1,
            kv_expected_ranks: 1,
        }],
        contract_marker: kvrelay_proto::CONTRACT_MARKER,
    };
    assert_eq!(state.apply_load(&window(4, &a1)), None);
    assert_eq!(state.apply_load(&window(3, &a2)), None, "stale: ignored");
    let snapshot = state.snapshot();
    assert_eq!(snapshot.load_window, Some(4));
    assert_eq!(snapshot.load.len(), 1);
    assert_eq!(snapshot.load[0].kv_used_blocks, Some(600));
    // The catalog moves to a2: a1's load is no longer reported.
    let _ = state.apply_catalog(&catalog(2, vec![descriptor(a2, A)]));
    assert!(state.snapshot().load.is_empty());
    state.load_lost(Some(FaultKind::Reason(RelayErrorReason::SubscriberLagged)));
    assert_eq!(state.snapshot().load_window, None);
    assert_eq!(state.apply_load(&window(1, &a2)), None, "after a reconnect any window replaces");
    assert_eq!(state.snapshot().load.len(), 1);
}

#[test]
fn halting_stops_every_plane_once() {
    let mut state = ConsumerState::new();
    assert!(state.halt(Plane::Readiness, FaultKind::ContractMismatch));
    assert!(!state.halt(Plane::Catalog, FaultKind::StreamEnded));
    let snapshot = state.snapshot();
    assert_eq!(
        snapshot.halted,
        Some(ConsumerHalt { plane: Plane::Readiness, cause: FaultKind::ContractMismatch })
    );
    assert_eq!(snapshot.plane(Plane::Catalog), PlaneStatus::Stopped);
}
