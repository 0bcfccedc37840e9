//! The reference consumer against the real relay service over loopback TCP: it converges to the
//! relay's filter, readiness and load after a workload, follows a producer change, recovers
//! from a lagged subscription, answers prefix queries for base and LoRA names, and halts on a
//! foreign contract.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::pool::StandalonePool;
use kvrelay_consumer::render::snapshot_lines;
use kvrelay_consumer::{
    BackoffPolicy, ConsumerConfig, ConsumerSnapshot, FaultKind, FilterStatus, IdleTimeouts, Plane,
    RelayConsumer, connect,
};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::host::{CatalogSnapshot, PoolDescriptor};
use kvrelay_core::model::hashing::{
    ExternalBlockHash, HashFormat, LocalBlockHash, block_hash_seed, local_block_hashes,
};
use kvrelay_core::model::identity::{PoolId, ProducerIdentity};
use kvrelay_core::model::kv_events::StoredBlock;
use kvrelay_core::readiness::ReadinessState;
use kvrelay_core::readiness::topology::{AdapterReadiness, TopologyEntry, TopologyMember};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::RankFence;
use kvrelay_core::wire::{FilterStreamGuard, RelayErrorReason, encode};
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use rand_core::Rng;
use support::{BLOCK, ENDPOINT, LoopbackRelay, producer, remove, stored};

const BUCKETS: u64 = 4096;
/// Every wait is bounded; a healthy run converges in well under a second.
const CONVERGE: Duration = Duration::from_secs(20);

fn tuning() -> WanTuning {
    WanTuning {
        pool_heartbeat_interval: Duration::from_millis(100),
        readiness_heartbeat_interval: Duration::from_millis(100),
        catalog_heartbeat_interval: Duration::from_millis(100),
        ..WanTuning::default()
    }
}

/// One pool serving the base model (also under the alias `tiny`) and a LoRA adapter whose
/// served name `tiny-lora` differs from its runtime name `adapter-a`.
fn descriptor(producer: ProducerIdentity) -> PoolDescriptor {
    PoolDescriptor {
        producer,
        serving_endpoint: ENDPOINT.parse().unwrap(),
        registrations: vec![
            ModelRegistration {
                canonical_model_id: "tiny-llm".into(),
                target: ModelTarget::Base { base_model: "tiny-llm".into() },
                aliases: BTreeSet::from(["tiny".to_owned()]),
            },
            ModelRegistration {
                canonical_model_id: "tiny-lora".into(),
                target: ModelTarget::Lora {
                    base_model: "tiny-llm".into(),
                    adapter: "adapter-a".into(),
                },
                aliases: BTreeSet::new(),
            },
        ],
        query_semantics: QuerySemantics {
            kv_block_size: BLOCK,
            hash_format: HashFormat::StandardV1,
        },
        pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
    }
}

impl LoopbackRelay {
    fn publish_readiness(&self, revision: u64, pool_id: PoolId) {
        let entry = TopologyEntry {
            namespace: "dynamo".into(),
            canonical_model_id: "tiny-llm".into(),
            state: ReadinessState::Ready,
            present_roles: BTreeSet::from([WorkerRole::Aggregated]),
            missing_roles: BTreeSet::new(),
            members: vec![TopologyMember {
                endpoint: ENDPOINT.parse().unwrap(),
                roles: BTreeSet::from([WorkerRole::Aggregated]),
                pool_id: Some(pool_id),
            }],
            duplicate_role_endpoints: BTreeSet::new(),
            legacy_fallback_active: false,
            adapters: vec![AdapterReadiness {
                canonical_model_id: "tiny-lora".into(),
                state: ReadinessState::Ready,
                missing_roles: BTreeSet::new(),
            }],
        };
        self.publisher.publish_readiness(encode::readiness_update(&self.relay, revision, &[entry]));
    }

    fn publish_load(&self, window_sequence: u64, producer: &ProducerIdentity, used: u64) {
        self.publisher.publish_load(proto::KvPoolLoadUpdate {
            protocol_version: 1,
            relay: Some(encode::relay_identity(&self.relay)),
            window_sequence,
            observed_ms: 1,
            window_ms: 1000,
            pools: vec![proto::KvPoolLoadEntry {
                producer: Some(encode::producer(producer)),
                kv_used_blocks: used,
                total_kv_blocks: 16384,
                kv_observed_ranks: 1,
                kv_expected_ranks: 1,
            }],
            contract_marker: CONTRACT_MARKER,
        });
    }

    /// The relay's filter as a fresh subscriber sees it: its snapshot sequence and words.
    async fn filter(&self, producer: &ProducerIdentity) -> (u64, Vec<u64>) {
        let mut client = self.client().await;
        let request = proto::SubscribeKvPoolRequest {
            subscriber_id: "oracle".into(),
            expected_producer: Some(encode::producer(producer)),
            contract_marker: CONTRACT_MARKER,
        };
        let mut stream = client.subscribe_kv_pool(request).await.unwrap().into_inner();
        let mut replica =
            FilterReplica::new(producer.format(), producer.pool_id().dc_id.0).unwrap();
        let mut guard = FilterStreamGuard::new(*producer);
        while replica.sequence().is_none() {
            let update = stream.message().await.unwrap().unwrap();
            replica.accept(guard.check(&update).unwrap().frame).unwrap();
        }
        (replica.sequence().unwrap(), replica.words().unwrap().to_vec())
    }
}

async fn start_consumer(relay: &LoopbackRelay, seed: u64) -> RelayConsumer {
    let channel = connect(&relay.address.to_string()).await.unwrap();
    let idle = Some(Duration::from_secs(2));
    let config = ConsumerConfig {
        subscriber_id: "consumer-test".into(),
        backoff: BackoffPolicy {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(500),
        },
        idle_timeouts: IdleTimeouts { catalog: idle, filter: idle, readiness: idle, load: idle },
        ..ConsumerConfig::default()
    };
    RelayConsumer::start(channel, config, &mut rng_from_seed(seed)).unwrap()
}

/// Wait (bounded) until `predicate` holds; on timeout, fail with what the consumer knows.
async fn converge(
    consumer: &RelayConsumer,
    what: &str,
    predicate: impl FnMut(&ConsumerSnapshot) -> bool,
) -> ConsumerSnapshot {
    match tokio::time::timeout(CONVERGE, consumer.wait_until(predicate)).await {
        Ok(Ok(snapshot)) => snapshot,
        Ok(Err(stopped)) => panic!("consumer stopped waiting for {what}: {stopped}"),
        Err(_) => panic!(
            "consumer did not converge on {what}:\n{}",
            snapshot_lines(&consumer.snapshot()).join("\n")
        ),
    }
}

fn pool_at(snapshot: &ConsumerSnapshot, producer: &ProducerIdentity, sequence: u64) -> bool {
    snapshot.pool(&producer.pool_id()).is_some_and(|pool| {
        pool.producer == *producer
            && pool.sequence == Some(sequence)
            && pool.status == FilterStatus::Ready
    })
}

fn block(external: u64, tokens_hash: u64) -> StoredBlock {
    StoredBlock {
        block_hash: ExternalBlockHash(external),
        tokens_hash: LocalBlockHash(tokens_hash),
    }
}

/// Rounds of random single-block stores and batched removals, flushed after every round.
/// Returns the last published sequence.
async fn random_workload(actor: &StandalonePool, seed: u64, rounds: u64, base: u64) -> u64 {
    let mut rng = rng_from_seed(seed);
    let mut live: Vec<u64> = Vec::new();
    let mut last = 0;
    for round in 0..rounds {
        let mut events = Vec::new();
        for index in 0..8u64 {
            let external = base + round * 100 + index + 1;
            let parent = if rng.next_u32().is_multiple_of(2) { live.last().copied() } else { None };
            events.push(stored(
                parent,
                vec![block(external, external.wrapping_mul(0x9E37_79B9_7F4A_7C15))],
            ));
            live.push(external);
        }
        if live.len() > 200 {
            events.push(remove(live.drain(..8)));
        }
        actor.apply(RankFence(1), events).await.unwrap();
        last = actor.flush().await.unwrap().unwrap();
    }
    last
}

/// Store the first `blocks` blocks of `tokens` as one chain, hashed for `lora` (the runtime
/// adapter name, as the engine salts them).
async fn store_prompt(
    actor: &StandalonePool,
    tokens: &[u32],
    blocks: usize,
    lora: Option<&str>,
    external_base: u64,
) -> u64 {
    let seed = block_hash_seed(lora, None);
    let local = local_block_hashes(tokens, BLOCK as usize, HashFormat::StandardV1, seed);
    let chain = local[..blocks]
        .iter()
        .enumerate()
        .map(|(index, hash)| block(external_base + index as u64, hash.0))
        .collect();
    actor.apply(RankFence(1), vec![stored(None, chain)]).await.unwrap();
    actor.flush().await.unwrap().unwrap()
}

#[tokio::test]
async fn the_consumer_converges_to_the_relay_and_answers_prefix_queries() {
    let relay = LoopbackRelay::start(tuning()).await;
    let producer = producer(ENDPOINT, 1, BUCKETS);
    let actor = relay.activate(producer, 3);
    relay.publish_catalog(1, vec![descriptor(producer)]);
    relay.publish_readiness(2, producer.pool_id());
    relay.publish_load(1, &producer, 600);
    let consumer = start_consumer(&relay, 11).await;
    let first = converge(&consumer, "the first snapshot, readiness and load", |snapshot| {
        pool_at(snapshot, &producer, 0)
            && snapshot.readiness_revision == Some(2)
            && snapshot.load_window == Some(1)
    })
    .await;
    assert_eq!(first.catalog_revision, Some(1));
    assert_eq!(first.relay, Some(relay.relay));
    assert_eq!(first.readiness[0].adapters[0].canonical_model_id, "tiny-lora");
    assert_eq!(first.load[0].kv_used_blocks, Some(600));
    assert_eq!(first.plane(Plane::Catalog), kvrelay_consumer::PlaneStatus::Streaming);

    // A random workload, then two prompts: three base blocks, and two LoRA blocks of the same
    // tokens salted with the adapter's runtime name.
    random_workload(&actor, 99, 60, 0).await;
    let prompt: Vec<u32> = (0..5 * BLOCK + 3).map(|token| token * 7 + 1).collect();
    store_prompt(&actor, &prompt, 3, None, 1_000_000).await;
    let last = store_prompt(&actor, &prompt, 2, Some("adapter-a"), 2_000_000).await;
    relay.publish_load(2, &producer, 700);
    let converged = converge(&consumer, "the workload", |snapshot| {
        pool_at(snapshot, &producer, last) && snapshot.load_window == Some(2)
    })
    .await;

    let stats = actor.stats().await.unwrap();
    let pool = converged.pool(&producer.pool_id()).unwrap();
    assert_eq!(pool.resident_slots, stats.resident_blocks, "every resident fingerprint arrived");
    let (sequence, words) = relay.filter(&producer).await;
    let copy = consumer.filter_copy(&producer.pool_id()).unwrap();
    assert_eq!((copy.sequence, &copy.words), (sequence, &words), "replica == relay filter");
    assert_eq!(converged.load[0].kv_used_blocks, Some(700));
    assert_eq!(converged.counters.resubscribes, 0);
    assert!(converged.counters.deltas_applied >= 60);

    for name in ["tiny-llm", "tiny"] {
        let answers = consumer.query(&prompt, name);
        assert_eq!(answers.len(), 1, "{name}");
        assert_eq!((answers[0].matched_blocks, answers[0].total_blocks), (3, 5), "{name}");
        assert_eq!(answers[0].lora_adapter, None);
        assert_eq!(answers[0].pool_id(), producer.pool_id());
        assert_eq!(answers[0].endpoint.to_string(), ENDPOINT);
    }
    let lora = consumer.query(&prompt, "tiny-lora");
    assert_eq!((lora[0].matched_blocks, lora[0].total_blocks), (2, 5));
    assert_eq!(lora[0].lora_adapter.as_deref(), Some("adapter-a"));
    assert!(consumer.query(&prompt, "adapter-a").is_empty(), "runtime names are not served names");
    assert!(consumer.query(&prompt, "other-llm").is_empty());
    consumer.shutdown().await;
}

#[tokio::test]
async fn a_producer_change_drops_the_replica_and_resubscribes_to_the_new_generation() {
    let relay = LoopbackRelay::start(tuning()).await;
    let first = producer(ENDPOINT, 1, BUCKETS);
    let actor = relay.activate(first, 3);
    relay.publish_catalog(1, vec![descriptor(first)]);
    relay.publish_load(1, &first, 600);
    let consumer = start_consumer(&relay, 12).await;
    let sequence = random_workload(&actor, 5, 10, 0).await;
    converge(&consumer, "generation 1", |snapshot| {
        pool_at(snapshot, &first, sequence) && !snapshot.load.is_empty()
    })
    .await;

    // The relay re-materializes the pool: generation 1 retires, generation 2 activates, and
    // the catalog names the new producer.
    relay.publications.retire(first.pool_id(), 1).await;
    let second = producer(ENDPOINT, 2, BUCKETS);
    let actor = relay.activate(second, 4);
    relay.publish_catalog(2, vec![descriptor(second)]);
    let changed =
        converge(&consumer, "generation 2", |snapshot| pool_at(snapshot, &second, 0)).await;
    assert_eq!(changed.counters.producer_changes, 1);
    assert!(changed.counters.replicas_dropped >= 1, "the generation 1 replica was dropped");
    assert!(changed.load.is_empty(), "load of a superseded producer is not reported");
    assert_eq!(changed.pools.len(), 1);

    let sequence = random_workload(&actor, 6, 10, 50_000).await;
    let converged = converge(&consumer, "generation 2 workload", |snapshot| {
        pool_at(snapshot, &second, sequence)
    })
    .await;
    let stats = actor.stats().await.unwrap();
    assert_eq!(converged.pool(&second.pool_id()).unwrap().resident_slots, stats.resident_blocks);
    assert_eq!(
        consumer.filter_copy(&second.pool_id()).unwrap().words,
        relay.filter(&second).await.1
    );

    // Withdrawal: the pool leaves the catalog, its replica goes with it.
    relay.publish_catalog(3, Vec::new());
    let withdrawn =
        converge(&consumer, "the withdrawal", |snapshot| snapshot.catalog_revision == Some(3))
            .await;
    assert!(withdrawn.pools.is_empty());
    assert!(consumer.filter_copy(&second.pool_id()).is_none());
    assert!(consumer.query(&[1; 64], "tiny-llm").is_empty());
    consumer.shutdown().await;
}

#[tokio::test]
async fn a_lagged_subscription_is_reopened_from_a_fresh_snapshot() {
    // A per-subscriber budget of 1 KiB holds a few one-block deltas but not one delta of a
    // hundred bucket images, so that delta ends the subscription as lagged, however fast the
    // consumer drains.
    let relay = LoopbackRelay::start(WanTuning { publication_queue_bytes: 1024, ..tuning() }).await;
    let producer = producer(ENDPOINT, 1, BUCKETS);
    let actor = relay.activate(producer, 3);
    relay.publish_catalog(1, vec![descriptor(producer)]);
    let consumer = start_consumer(&relay, 13).await;
    converge(&consumer, "the first snapshot", |snapshot| pool_at(snapshot, &producer, 0)).await;
    let mut sequence = 0;
    for external in 1..=5u64 {
        actor
            .apply(RankFence(1), vec![stored(None, vec![block(external, external * 31)])])
            .await
            .unwrap();
        sequence = actor.flush().await.unwrap().unwrap();
        converge(&consumer, "a small delta", |snapshot| pool_at(snapshot, &producer, sequence))
            .await;
    }
    assert_eq!(sequence, 5);

    let big: Vec<StoredBlock> = (0..100u64)
        .map(|index| block(1000 + index, (index + 1).wrapping_mul(0x5DEE_CE66)))
        .collect();
    actor.apply(RankFence(1), vec![stored(None, big)]).await.unwrap();
    let sequence = actor.flush().await.unwrap().unwrap();
    let recovered = converge(&consumer, "recovery from lag", |snapshot| {
        snapshot
            .counters
            .fault_count(Plane::Filter, FaultKind::Reason(RelayErrorReason::SubscriberLagged))
            >= 1
            && pool_at(snapshot, &producer, sequence)
    })
    .await;
    assert!(recovered.counters.resubscribes >= 1);
    assert!(recovered.counters.installs >= 2, "the replica was rebuilt from a new snapshot");
    let stats = actor.stats().await.unwrap();
    assert_eq!(recovered.pool(&producer.pool_id()).unwrap().resident_slots, stats.resident_blocks);
    assert_eq!(
        consumer.filter_copy(&producer.pool_id()).unwrap().words,
        relay.filter(&producer).await.1
    );
    consumer.shutdown().await;
}

#[tokio::test]
async fn a_catalog_in_a_foreign_contract_halts_the_consumer() {
    let relay = LoopbackRelay::start(tuning()).await;
    let producer = producer(ENDPOINT, 1, BUCKETS);
    let _actor = relay.activate(producer, 3);
    relay.publish_catalog(1, vec![descriptor(producer)]);
    let consumer = start_consumer(&relay, 14).await;
    converge(&consumer, "the first snapshot", |snapshot| pool_at(snapshot, &producer, 0)).await;
    let mut foreign =
        encode::catalog_update(&relay.relay, &CatalogSnapshot { revision: 2, pools: Vec::new() });
    foreign.contract_marker = 0x4B56_5232;
    relay.publisher.publish_catalog(foreign);
    let stopped = tokio::time::timeout(CONVERGE, consumer.wait_until(|_| false))
        .await
        .expect("the consumer halts")
        .expect_err("nothing satisfies the predicate");
    let halt = stopped.halted.expect("halted, not merely stopped");
    assert_eq!((halt.plane, halt.cause), (Plane::Catalog, FaultKind::ContractMismatch));
    let snapshot = consumer.snapshot();
    assert!(snapshot.pools.is_empty(), "the foreign catalog withdrew every pool");
    // Every task ends by itself after a halt.
    tokio::time::timeout(CONVERGE, consumer.shutdown()).await.expect("tasks end");
}
