//! Comparing two consumer views built by hand.

use std::collections::BTreeSet;

use super::*;
use crate::state::{ConsumerCounters, PoolReplicaState};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics};
use kvrelay_core::filter::ckf::DEFAULT_SEED;
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{
    EndpointPath, ProducerIdentity, RelayIdentity, resolve_indexer_domain, stable_dc_id,
};
use kvrelay_core::readiness::ReadinessState;

const BUCKETS: u64 = 64;

fn producer(endpoint: &str, incarnation: u64, generation: u64) -> ProducerIdentity {
    let endpoint: EndpointPath = endpoint.parse().unwrap();
    let domain =
        resolve_indexer_domain("tiny-llm", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("dc-a").unwrap() };
    ProducerIdentity::new(pool_id, incarnation, generation, CkfFormat::v1(DEFAULT_SEED, BUCKETS))
        .unwrap()
}

fn pool(producer: ProducerIdentity, endpoint: &str, sequence: u64) -> PoolReplicaState {
    PoolReplicaState {
        producer,
        descriptor: PoolDescriptor {
            producer,
            serving_endpoint: endpoint.parse().unwrap(),
            registrations: vec![ModelRegistration {
                canonical_model_id: "tiny-llm".into(),
                target: ModelTarget::Base { base_model: "tiny-llm".into() },
                aliases: BTreeSet::new(),
            }],
            query_semantics: QuerySemantics {
                kv_block_size: 16,
                hash_format: HashFormat::StandardV1,
            },
            pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
        },
        status: FilterStatus::Ready,
        sequence: Some(sequence),
        resident_slots: 0,
    }
}

fn entry(pool_id: PoolId, state: ReadinessState) -> TopologyEntry {
    TopologyEntry {
        namespace: "dynamo".into(),
        canonical_model_id: "tiny-llm".into(),
        state,
        present_roles: BTreeSet::from([WorkerRole::Aggregated]),
        missing_roles: BTreeSet::new(),
        members: vec![TopologyMember {
            endpoint: "dynamo/backend/generate".parse().unwrap(),
            roles: BTreeSet::from([WorkerRole::Aggregated]),
            pool_id: Some(pool_id),
        }],
        duplicate_role_endpoints: BTreeSet::new(),
        legacy_fallback_active: false,
        adapters: Vec::new(),
    }
}

/// One relay's view of one aggregated pool: `incarnation`, `generation`, revisions and
/// sequence are the relay-specific values that must not count as differences.
fn view(incarnation: u64, generation: u64, revision: u64) -> ConsumerSnapshot {
    let producer = producer("dynamo/backend/generate", incarnation, generation);
    ConsumerSnapshot {
        relay: Some(RelayIdentity { drt_instance_id: incarnation, relay_incarnation: incarnation }),
        catalog_revision: Some(revision),
        planes: BTreeMap::new(),
        pools: vec![pool(producer, "dynamo/backend/generate", revision * 10)],
        quarantined_pools: Vec::new(),
        readiness_revision: Some(revision),
        readiness: vec![entry(producer.pool_id(), ReadinessState::Ready)],
        load_window: Some(revision),
        load: vec![PoolLoad {
            producer,
            kv_used_blocks: Some(400),
            total_kv_blocks: Some(16384),
            kv_observed_ranks: 1,
            kv_expected_ranks: 1,
        }],
        counters: ConsumerCounters::default(),
        halted: None,
    }
}

/// Filter words holding `hashes`, each in its home bucket (`alternate == false`) or in its
/// alternate bucket.
fn words_with(hashes: &[(u64, bool)]) -> Vec<u64> {
    let addressing = Addressing::new(&CkfFormat::v1(DEFAULT_SEED, BUCKETS));
    let mut words = vec![0u64; BUCKETS as usize];
    for &(hash, alternate) in hashes {
        let probe = addressing.probe(hash);
        let bucket = if alternate { probe.bucket_b } else { probe.bucket_a } as usize;
        let slot = (0..4).find(|slot| (words[bucket] >> (16 * slot)) & 0xFFFF == 0).unwrap();
        words[bucket] |= u64::from(probe.fingerprint) << (16 * slot);
    }
    words
}

fn filters(snapshot: &ConsumerSnapshot, words: Vec<u64>) -> BTreeMap<PoolId, FilterCopy> {
    let pool = &snapshot.pools[0];
    BTreeMap::from([(
        pool.descriptor.pool_id(),
        FilterCopy { producer: pool.producer, sequence: pool.sequence.unwrap(), words },
    )])
}

fn run(
    left: &ConsumerSnapshot,
    left_words: Vec<u64>,
    right: &ConsumerSnapshot,
    right_words: Vec<u64>,
) -> Comparison {
    let (left_filters, right_filters) = (filters(left, left_words), filters(right, right_words));
    compare(
        Side { snapshot: left, filters: &left_filters },
        Side { snapshot: right, filters: &right_filters },
    )
}

const HASHES: [u64; 3] = [0x1111, 0x2222_3333, 0x4444_5555_6666];

#[test]
fn relay_specific_identities_revisions_and_sequences_do_not_count() {
    let words = words_with(&[(HASHES[0], false), (HASHES[1], false)]);
    let comparison = run(&view(7, 1, 3), words.clone(), &view(9, 4, 12), words);
    assert_eq!(comparison.differences, Vec::new());
    assert!(comparison.matches());
    assert_eq!(comparison.pools, Counts { left: 1, right: 1 });
    assert_eq!(comparison.filters.len(), 1);
    let filter = &comparison.filters[0];
    assert_eq!((filter.left_slots, filter.right_slots), (2, 2));
    assert!(filter.identical_words && filter.same_membership());
}

#[test]
fn the_same_items_in_other_buckets_are_the_same_membership() {
    let left = words_with(&[(HASHES[0], false), (HASHES[1], false), (HASHES[2], true)]);
    let right = words_with(&[(HASHES[0], true), (HASHES[1], false), (HASHES[2], false)]);
    assert_ne!(left, right);
    let comparison = run(&view(1, 1, 1), left, &view(2, 1, 1), right);
    assert!(comparison.matches(), "{:?}", comparison.differences);
    assert!(!comparison.filters[0].identical_words);
    assert!(comparison.filters[0].same_membership());
}

#[test]
fn a_missing_item_is_a_membership_and_slot_difference() {
    let left = words_with(&[(HASHES[0], false), (HASHES[1], false), (HASHES[2], false)]);
    let right = words_with(&[(HASHES[0], true), (HASHES[1], false)]);
    let comparison = run(&view(1, 1, 1), left, &view(2, 1, 1), right);
    let filter = &comparison.filters[0];
    assert_eq!((filter.only_left, filter.only_right), (1, 0));
    let fields: Vec<(&str, &str, &str)> = comparison
        .differences
        .iter()
        .map(|d| (d.field, d.left.as_str(), d.right.as_str()))
        .collect();
    assert_eq!(
        fields,
        [("occupied_slots", "3", "2"), ("membership", "1 items only here", "0 items only here")]
    );
    assert!(comparison.differences.iter().all(|d| d.section == Section::Filter));
    assert_eq!(comparison.differences_in(Section::Filter), 2);
}

#[test]
fn descriptor_readiness_and_load_differences_name_their_field() {
    let left = view(1, 1, 1);
    let mut right = view(2, 1, 1);
    right.pools[0].descriptor.pool_roles = BTreeSet::from([WorkerRole::Prefill]);
    right.readiness[0].state = ReadinessState::Unavailable;
    right.readiness[0].missing_roles = BTreeSet::from([WorkerRole::Decode]);
    right.load[0].kv_used_blocks = None;
    let words = words_with(&[(HASHES[0], false)]);
    let comparison = run(&left, words.clone(), &right, words);
    let found: Vec<(Section, &str, &str, &str)> = comparison
        .differences
        .iter()
        .map(|d| (d.section, d.field, d.left.as_str(), d.right.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            (Section::Catalog, "pool_roles", "[AGGREGATED]", "[PREFILL]"),
            (Section::Readiness, "state", "READY", "UNAVAILABLE"),
            (Section::Readiness, "missing_roles", "[]", "[DECODE]"),
            (Section::Load, "kv_used_blocks", "400", "?"),
        ]
    );
    assert_eq!(comparison.differences[1].key, "dynamo/tiny-llm");
}

#[test]
fn a_pool_on_one_side_only_is_reported_absent_on_the_other() {
    let left = view(1, 1, 1);
    let mut right = view(2, 1, 1);
    right.pools.clear();
    right.load.clear();
    let left_filters = filters(&left, words_with(&[]));
    let comparison = compare(
        Side { snapshot: &left, filters: &left_filters },
        Side { snapshot: &right, filters: &BTreeMap::new() },
    );
    let catalog: Vec<&Difference> =
        comparison.differences.iter().filter(|d| d.section == Section::Catalog).collect();
    assert_eq!(catalog.len(), 1);
    assert_eq!(catalog[0].field, "pool");
    assert_eq!(catalog[0].left, "dynamo/backend/generate [tiny-llm]");
    assert_eq!(catalog[0].right, "absent");
    assert_eq!(comparison.differences_in(Section::Load), 4);
    assert!(comparison.filters.is_empty());
}

#[test]
fn a_replica_installed_on_one_side_only_is_a_filter_difference() {
    let left = view(1, 1, 1);
    let mut right = view(2, 1, 1);
    right.pools[0].status = FilterStatus::Assembling;
    let left_filters = filters(&left, words_with(&[]));
    let comparison = compare(
        Side { snapshot: &left, filters: &left_filters },
        Side { snapshot: &right, filters: &BTreeMap::new() },
    );
    assert_eq!(comparison.differences.len(), 1);
    let difference = &comparison.differences[0];
    assert_eq!((difference.field, difference.left.as_str()), ("replica", "installed"));
    assert_eq!(difference.right, "assembling");
}

#[test]
fn canonical_items_refuse_a_word_count_that_does_not_fit_the_format() {
    let format = CkfFormat::v1(DEFAULT_SEED, BUCKETS);
    assert_eq!(canonical_items(&format, &[0; 63]), None);
    assert_eq!(canonical_items(&CkfFormat::v1(DEFAULT_SEED, 3), &[0; 3]), None);
    let words = words_with(&[(HASHES[0], true)]);
    let items = canonical_items(&format, &words).unwrap();
    let probe = Addressing::new(&format).probe(HASHES[0]);
    assert_eq!(items, [(probe.bucket_a.min(probe.bucket_b), probe.fingerprint)]);
}

/// A pool whose load one side observed on every expected rank and the other on fewer is a
/// coverage gap, not a field difference: strict matching refuses it, matching that accepts the
/// complete side's lead accepts it only for that side. Any other load difference stays a
/// difference.
#[test]
fn a_load_complete_on_one_side_only_is_a_coverage_gap() {
    let mut left = view(1, 1, 1);
    let mut right = view(2, 1, 1);
    for load in [&mut left.load[0], &mut right.load[0]] {
        load.kv_expected_ranks = 2;
        load.kv_observed_ranks = 2;
    }
    left.load[0].kv_observed_ranks = 1;
    left.load[0].kv_used_blocks = None;
    let words = words_with(&[(HASHES[0], false)]);
    let comparison = run(&left, words.clone(), &right, words.clone());
    assert!(comparison.differences.is_empty(), "{:?}", comparison.differences);
    let pool_id = right.pools[0].descriptor.pool_id();
    assert_eq!(
        comparison.coverage_gaps,
        [CoverageGap {
            pool_id,
            complete: Which::Right,
            left_observed: 1,
            right_observed: 2,
            expected: 2
        }]
    );
    assert!(!comparison.matches());
    assert!(comparison.matches_where_more_complete(Which::Right));
    assert!(!comparison.matches_where_more_complete(Which::Left));

    // The other way round: the lead is the left side's.
    let swapped = run(&right, words.clone(), &left, words.clone());
    assert_eq!(swapped.coverage_gaps[0].complete, Which::Left);
    assert!(!swapped.matches_where_more_complete(Which::Right));

    // Different capacities are a difference even with the same coverage shape.
    let mut other = right.clone();
    other.load[0].total_kv_blocks = Some(1);
    let differs = run(&left, words.clone(), &other, words);
    assert!(differs.coverage_gaps.is_empty());
    assert!(!differs.matches_where_more_complete(Which::Right));
    assert_eq!(differs.differences_in(Section::Load), 3);
}
