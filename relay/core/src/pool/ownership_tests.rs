//! Unit tests of the exact ownership state, after the reference's named cases (relay-facts §14).

use std::collections::BTreeMap;

use super::*;
use crate::filter::ckf::{DEFAULT_SEED, MAX_KICKS_DEFAULT};
use crate::model::hashing::{LocalBlockHash, block_hash_seed, local_block_hash};
use crate::model::kv_events::{
    KvCacheEvent, RemoveData, ResidencyDomain, StorageTier, StoredBlock,
};
use crate::rng::rng_from_seed;

const A: SourceKey = SourceKey { worker_id: 1, dp_rank: 0 };
const A1: SourceKey = SourceKey { worker_id: 1, dp_rank: 1 };
const B: SourceKey = SourceKey { worker_id: 2, dp_rank: 0 };

fn pool(bucket_count: u64) -> PoolOwnership {
    PoolOwnership::new(
        CkfFormat::v1(DEFAULT_SEED, bucket_count),
        MAX_KICKS_DEFAULT,
        rng_from_seed(1),
    )
    .unwrap()
}

fn event(source: SourceKey, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: source.worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id: 1, dp_rank: source.dp_rank, data },
    }
}

/// A store of `(external id, tokens hash)` blocks continuing `parent`.
fn stored(source: SourceKey, parent: Option<u64>, blocks: &[(u64, u64)]) -> RouterEvent {
    event(
        source,
        KvCacheEventData::Stored(StoreData {
            parent_hash: parent.map(ExternalBlockHash),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|&(external, tokens)| StoredBlock {
                    block_hash: ExternalBlockHash(external),
                    tokens_hash: LocalBlockHash(tokens),
                })
                .collect(),
        }),
    )
}

fn removed(source: SourceKey, externals: &[u64]) -> RouterEvent {
    event(
        source,
        KvCacheEventData::Removed(RemoveData {
            block_hashes: externals.iter().map(|&e| ExternalBlockHash(e)).collect(),
        }),
    )
}

fn cleared(source: SourceKey) -> RouterEvent {
    event(source, KvCacheEventData::Cleared)
}

fn root(tokens: u64) -> SequenceHash {
    SequenceHash::root(LocalBlockHash(tokens))
}

fn chain(tokens: &[u64]) -> Vec<SequenceHash> {
    let locals: Vec<LocalBlockHash> = tokens.iter().map(|&t| LocalBlockHash(t)).collect();
    crate::model::hashing::sequence_hashes(&locals)
}

fn owners(pool: &PoolOwnership, canonical: SequenceHash) -> u32 {
    pool.owner_state(canonical).map_or(0, |state| state.owners)
}

fn apply(pool: &mut PoolOwnership, event: &RouterEvent) -> ApplyOutcome {
    let outcome = pool.apply_event(event).expect("event applies");
    pool.check_invariants().expect("invariants hold");
    outcome
}

#[test]
fn shared_ownership_keeps_a_block_until_its_last_owner_leaves() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(10, 7)]));
    apply(&mut p, &stored(B, None, &[(99, 7)]));
    assert_eq!(owners(&p, root(7)), 2);
    assert_eq!(p.filter().occupied_slots(), 1, "one fingerprint per canonical hash");
    apply(&mut p, &removed(A, &[10]));
    assert!(p.filter().contains(7));
    apply(&mut p, &removed(B, &[99]));
    assert_eq!(p.owner_state(root(7)), None);
    assert!(p.filter().is_empty());
}

#[test]
fn captured_vllm_and_sglang_ids_map_to_the_same_dynamo_root() {
    let mut p = pool(524_288);
    let tokens_hash = 3_727_940_790_060_946_254;
    apply(&mut p, &stored(A, None, &[(5_151_625_331_053_002_286, tokens_hash)]));
    apply(&mut p, &stored(B, None, &[(16_481_235_979_017_058_908, tokens_hash)]));
    assert_eq!(
        p.owner_state(SequenceHash(3_727_940_790_060_946_254)),
        Some(OwnerState { owners: 2, resident: true })
    );
    // Probe of this hash: fingerprint 0x3239 in bucket 23503 (relay-facts Appendix A).
    assert_eq!(p.filter().words()[23_503], 0x3239);
}

#[test]
fn root_and_batched_chain_use_canonical_token_hashes_not_external_ids() {
    let mut batched = pool(256);
    apply(&mut batched, &stored(A, None, &[(1, 11), (2, 22), (3, 33)]));
    let mut parented = pool(256);
    apply(&mut parented, &stored(B, None, &[(900, 11)]));
    apply(&mut parented, &stored(B, Some(900), &[(901, 22)]));
    apply(&mut parented, &stored(B, Some(901), &[(902, 33)]));
    let expected: Vec<SequenceHash> = chain(&[11, 22, 33]);
    let hashes =
        |p: &PoolOwnership| p.owned_blocks().into_iter().map(|(h, _)| h).collect::<Vec<_>>();
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(hashes(&batched), sorted);
    assert_eq!(hashes(&parented), sorted);
    for hash in expected {
        assert!(batched.filter().contains(hash.0));
    }
}

#[test]
fn clearing_a_rank_leaves_sibling_ranks_and_other_workers() {
    let mut p = pool(256);
    apply(&mut p, &stored(A, None, &[(1, 100), (2, 200)]));
    apply(&mut p, &stored(A1, None, &[(1, 100)]));
    apply(&mut p, &stored(B, None, &[(5, 300)]));
    apply(&mut p, &cleared(A));
    assert_eq!(owners(&p, root(100)), 1);
    assert_eq!(p.owner_state(chain(&[100, 200])[1]), None);
    assert_eq!(owners(&p, root(300)), 1);
    assert_eq!(p.sources().collect::<Vec<_>>(), vec![(A1, 1), (B, 1)]);
}

#[test]
fn clear_removes_all_same_source_aliases_of_one_canonical_hash() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    apply(&mut p, &stored(A, None, &[(2, 7)]));
    assert_eq!(owners(&p, root(7)), 2);
    apply(&mut p, &cleared(A));
    assert!(p.filter().is_empty());
    assert_eq!(p.owned_block_count(), 0);
}

#[test]
fn non_device_events_are_ignored_and_unknown_removals_counted() {
    let mut p = pool(64);
    let mut host = stored(A, None, &[(1, 7)]);
    host.storage_tier = StorageTier::HostPinned;
    assert_eq!(apply(&mut p, &host), ApplyOutcome::default());
    assert_eq!(p.owned_block_count(), 0);
    let outcome = apply(&mut p, &removed(A, &[1, 2]));
    assert_eq!(outcome, ApplyOutcome { applied: true, capacity_omissions: 0, unknown_removals: 2 });
    assert_eq!(p.counters().unknown_removals, 2);
    assert_eq!(p.counters().events_ignored, 1);
}

#[test]
fn cache_owner_clear_is_ignored() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    let mut clear = cleared(A);
    clear.residency_domain = Some(ResidencyDomain::CacheOwner);
    assert!(!apply(&mut p, &clear).applied);
    assert_eq!(owners(&p, root(7)), 1);
}

#[test]
fn unknown_residency_fails_closed() {
    let mut p = pool(64);
    let mut store = stored(A, None, &[(1, 7)]);
    store.residency_domain = Some(ResidencyDomain::Unsupported("tier9".into()));
    assert_eq!(p.apply_event(&store), Err(ApplyError::UnsupportedResidencyDomain("tier9".into())));
    assert_eq!(p.owned_block_count(), 0);
    assert_eq!(p.counters().events_rejected, 1);
}

#[test]
fn unknown_parent_rejects_the_store() {
    let mut p = pool(64);
    assert_eq!(
        p.apply_event(&stored(A, Some(42), &[(1, 7)])),
        Err(ApplyError::ParentBlockNotFound(42))
    );
    // A parent stored by another source does not count.
    apply(&mut p, &stored(B, None, &[(42, 5)]));
    assert_eq!(
        p.apply_event(&stored(A, Some(42), &[(1, 7)])),
        Err(ApplyError::ParentBlockNotFound(42))
    );
    assert_eq!(p.owned_block_count(), 1);
}

#[test]
fn positional_root_must_start_at_zero() {
    let mut p = pool(64);
    let mut store = stored(A, None, &[(1, 7)]);
    if let KvCacheEventData::Stored(data) = &mut store.event.data {
        data.start_position = Some(3);
    }
    assert_eq!(
        p.apply_event(&store),
        Err(ApplyError::InvalidBlockSequence(SequenceFault::RootNotAtStart(3)))
    );
    if let KvCacheEventData::Stored(data) = &mut store.event.data {
        data.start_position = Some(0);
    }
    apply(&mut p, &store);
}

#[test]
fn valid_sibling_before_conflicting_remap_commits_nothing() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    let words = p.filter().words().to_vec();
    // Block 5 is new and valid; block 1 would be remapped to a different canonical hash.
    let conflict = stored(A, None, &[(5, 9), (1, 8)]);
    assert_eq!(
        p.apply_event(&conflict),
        Err(ApplyError::InvalidBlockSequence(SequenceFault::ConflictingRemap { external: 1 }))
    );
    assert_eq!(p.filter().words(), &words[..]);
    assert_eq!(p.owned_block_count(), 1);
    assert_eq!(p.owner_state(root(9)), None);
    p.check_invariants().unwrap();
}

#[test]
fn conflicting_remap_inside_one_batch_is_rejected() {
    let mut p = pool(64);
    let conflict = stored(A, None, &[(1, 7), (1, 8)]);
    assert!(matches!(p.apply_event(&conflict), Err(ApplyError::InvalidBlockSequence(_))));
    assert_eq!(p.owned_block_count(), 0);
}

#[test]
fn lora_salted_block_removal_uses_external_lineage_only() {
    let mut p = pool(256);
    let salted = local_block_hash(&[1, 2, 3, 4], &[], block_hash_seed(Some("adapter-a"), None));
    assert_eq!(salted.0, 11_381_080_598_872_079_209);
    apply(&mut p, &stored(A, None, &[(77, salted.0)]));
    assert!(p.filter().contains(salted.0));
    apply(&mut p, &removed(A, &[77]));
    assert!(p.filter().is_empty());
}

/// A filter of two buckets holds eight fingerprints; fill it from one source.
fn saturated_pool() -> PoolOwnership {
    let mut p = pool(2);
    let blocks: Vec<(u64, u64)> = (0..8).map(|i| (1000 + i, 5000 + i)).collect();
    let outcome = apply(&mut p, &stored(B, None, &blocks));
    assert_eq!(outcome.capacity_omissions, 0);
    p
}

#[test]
fn capacity_failure_keeps_successful_blocks_and_exact_filter_state_consistent() {
    let mut p = saturated_pool();
    let outcome = apply(&mut p, &stored(A, None, &[(1, 7), (2, 8)]));
    assert_eq!(outcome.capacity_omissions, 2);
    assert_eq!(p.counters().events_applied, 2);
    assert_eq!(p.owner_state(root(7)), Some(OwnerState { owners: 1, resident: false }));
    assert_eq!(p.omitted_block_count(), 2);
    assert_eq!(p.counters().capacity_omissions, 2);
    // Removing an omitted block resolves through lineage and touches no fingerprint.
    let words = p.filter().words().to_vec();
    apply(&mut p, &removed(A, &[1]));
    assert_eq!(p.filter().words(), &words[..]);
    assert_eq!(p.omitted_block_count(), 1);
}

#[test]
fn omitted_owner_keeps_lineage_and_later_owner_retries_admission() {
    let mut p = saturated_pool();
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    assert!(!p.owner_state(root(7)).unwrap().resident);
    apply(&mut p, &removed(B, &[1000, 1001]));
    // A new owner from another source makes a full insertion attempt.
    let outcome = apply(&mut p, &stored(A1, None, &[(9, 7)]));
    assert_eq!(outcome.capacity_omissions, 0);
    assert_eq!(p.owner_state(root(7)), Some(OwnerState { owners: 2, resident: true }));
    assert_eq!(p.omitted_block_count(), 0);
}

#[test]
fn repeated_store_readmits_an_omitted_block_once_its_home_bucket_frees() {
    let mut p = saturated_pool();
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    apply(&mut p, &removed(B, &[1000, 1001, 1002, 1003, 1004]));
    let outcome = apply(&mut p, &stored(A, None, &[(1, 7)]));
    assert_eq!(outcome.capacity_omissions, 0);
    assert_eq!(p.owner_state(root(7)), Some(OwnerState { owners: 1, resident: true }));
}

#[test]
fn repeated_store_of_a_saturated_block_reports_no_new_capacity_omission() {
    let mut p = saturated_pool();
    assert_eq!(apply(&mut p, &stored(A, None, &[(1, 7)])).capacity_omissions, 1);
    assert_eq!(apply(&mut p, &stored(A, None, &[(1, 7)])).capacity_omissions, 0);
    assert_eq!(p.counters().capacity_omissions, 1);
    assert_eq!(owners(&p, root(7)), 1);
}

#[test]
fn omitted_parent_still_canonicalizes_child_and_removes_by_external_id() {
    let mut p = saturated_pool();
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    apply(&mut p, &removed(B, &[1000, 1001, 1002, 1003]));
    apply(&mut p, &stored(A, Some(1), &[(2, 8)]));
    let child = chain(&[7, 8])[1];
    assert_eq!(p.owner_state(child), Some(OwnerState { owners: 1, resident: true }));
    apply(&mut p, &removed(A, &[2, 1]));
    assert_eq!(p.owned_block_count(), 4);
}

#[test]
fn representation_collision_remains_present_until_both_owners_are_removed() {
    // Find two canonical hashes with the same fingerprint and home bucket in a 2-bucket filter.
    let p = pool(2);
    let addressing = *p.filter().addressing();
    let mut seen = BTreeMap::new();
    let (first, second) = (1u64..)
        .find_map(|hash| {
            let probe = addressing.probe(hash);
            seen.insert((probe.fingerprint, probe.bucket_a), hash).map(|earlier| (earlier, hash))
        })
        .unwrap();
    let mut p = p;
    apply(&mut p, &stored(A, None, &[(1, first)]));
    apply(&mut p, &stored(A, None, &[(2, second)]));
    assert_eq!(p.filter().occupied_slots(), 2, "two physical copies");
    apply(&mut p, &removed(A, &[1]));
    assert!(p.filter().contains(second));
    apply(&mut p, &removed(A, &[2]));
    assert!(p.filter().is_empty());
}

#[test]
fn owner_overflow_is_a_typed_error() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    // Drive the count near the limit through the replacement path, which adds owners in bulk.
    p.owners.add_owners(7, OWNERS_MAX - 2);
    // The limit itself may be reached.
    assert!(p.apply_event(&stored(A1, None, &[(3, 7)])).is_ok());
    assert_eq!(owners(&p, root(7)), OWNERS_MAX);
    assert_eq!(
        p.apply_event(&stored(B, None, &[(2, 7)])),
        Err(ApplyError::OwnershipDegreeOverflow(7))
    );
    assert_eq!(owners(&p, root(7)), OWNERS_MAX);
}

#[test]
fn failure_dispositions_follow_the_reference_table() {
    use FailureDisposition::*;
    assert_eq!(ApplyError::AllocationFailed.disposition(), ReportResourceFailure);
    assert_eq!(
        ApplyError::ExactStateBudgetExceeded { needed_bytes: 2, bytes_max: 1 }.disposition(),
        ReportResourceFailure
    );
    assert_eq!(ApplyError::ParentBlockNotFound(1).disposition(), RejectSource);
    assert_eq!(ApplyError::OwnershipDegreeOverflow(1).disposition(), RejectSource);
    assert_eq!(
        ApplyError::InvalidBlockSequence(SequenceFault::NotAStore).disposition(),
        RejectSource
    );
    assert_eq!(
        ApplyError::IndexerInvariantViolation { canonical: 1 }.disposition(),
        FenceAndRebuildProducer
    );
}

fn replacement_key() -> TableKey {
    TableKey::from_rng(&rng_from_seed(9))
}

fn replacement(events: &[RouterEvent]) -> RankReplacement {
    let mut replacement = RankReplacement::new(replacement_key());
    for event in events {
        replacement.push_event(event).expect("dump event accepted");
    }
    replacement
}

#[test]
fn recovery_rebuild_has_logical_parity_with_live_application() {
    let events = [
        stored(A, None, &[(1, 11), (2, 22)]),
        stored(A, Some(2), &[(3, 33)]),
        stored(A, None, &[(4, 44)]),
    ];
    let mut live = pool(256);
    for e in &events {
        apply(&mut live, e);
    }
    let mut recovered = pool(256);
    apply(&mut recovered, &stored(A, None, &[(50, 99)])); // stale content of the rank
    recovered.replace_ranks(BTreeMap::from([(A, replacement(&events))])).unwrap();
    recovered.check_invariants().unwrap();
    assert_eq!(recovered.owned_blocks(), live.owned_blocks());
    // Lineage was rebuilt too: removal by engine id works.
    apply(&mut recovered, &removed(A, &[3]));
    assert_eq!(recovered.owned_block_count(), 3);
}

#[test]
fn dump_rejects_child_before_parent_and_non_stores() {
    let mut r = RankReplacement::new(replacement_key());
    assert_eq!(
        r.push_event(&stored(A, Some(1), &[(2, 22)])),
        Err(ApplyError::ParentBlockNotFound(1))
    );
    assert_eq!(
        r.push_event(&cleared(A)),
        Err(ApplyError::InvalidBlockSequence(SequenceFault::NotAStore))
    );
    let mut positional = stored(A, None, &[(2, 22)]);
    if let KvCacheEventData::Stored(data) = &mut positional.event.data {
        data.start_position = Some(1);
    }
    assert!(matches!(r.push_event(&positional), Err(ApplyError::InvalidBlockSequence(_))));
    let mut host = stored(A, None, &[(2, 22)]);
    host.storage_tier = StorageTier::Disk;
    r.push_event(&host).unwrap();
    assert_eq!(r.block_count(), 0);
}

#[test]
fn replacing_one_shared_owner_publishes_nothing() {
    let mut p = pool(256);
    apply(&mut p, &stored(A, None, &[(1, 11), (2, 22)]));
    apply(&mut p, &stored(B, None, &[(8, 11)]));
    let _ = p.take_publication();
    p.replace_ranks(BTreeMap::from([(A, replacement(&[stored(A, None, &[(1, 11), (2, 22)])]))]))
        .unwrap();
    assert!(p.take_publication().is_empty());
    // Replacing B's share with nothing keeps the block, owned by A.
    p.replace_ranks(BTreeMap::from([(B, RankReplacement::new(replacement_key()))])).unwrap();
    assert!(p.take_publication().is_empty());
    assert_eq!(owners(&p, root(11)), 1);
    p.check_invariants().unwrap();
}

/// A replacement that only adds owners to owned blocks grows no owner table: a budget of
/// exactly the bytes after the swap admits it, one byte less refuses it.
#[test]
fn a_replacement_that_shares_owned_blocks_fits_a_budget_of_its_exact_bytes() {
    let build = |budget: Option<usize>| {
        let mut p = pool(256);
        apply(&mut p, &new_chain(B, 1, 64));
        if let Some(budget) = budget {
            p.set_exact_state_bytes_max(budget).unwrap();
        }
        let before = p.exact_state_bytes();
        let shared = replacement(&[new_chain(A, 1, 64)]);
        let lineage = shared.lineage_bytes();
        let result = p.replace_ranks(BTreeMap::from([(A, shared)]));
        if result.is_ok() {
            assert_eq!(p.exact_state_bytes(), before + lineage, "the owner table did not grow");
        }
        (result, p)
    };
    let (unbounded, p) = build(None);
    assert!(unbounded.is_ok());
    let exact = p.exact_state_bytes();
    assert_eq!(p.owned_block_count(), 64);
    let (fits, p) = build(Some(exact));
    assert_eq!(fits, unbounded);
    assert_eq!(p.exact_state_bytes(), exact);
    let (refused, _) = build(Some(exact - 1));
    assert!(matches!(refused, Err(ApplyError::ExactStateBudgetExceeded { .. })), "{refused:?}");

    // Replacing a rank's lineage with an equal one at the same budget frees what it adds.
    let (_, mut p) = build(Some(exact));
    let again = replacement(&[new_chain(B, 1, 64)]);
    assert_eq!(p.replace_ranks(BTreeMap::from([(B, again)])), Ok(0));
    assert_eq!(p.exact_state_bytes(), exact);
    p.check_invariants().unwrap();
}

/// A block omitted before a replacement that keeps it is not a new omission.
#[test]
fn a_replacement_reports_only_new_capacity_omissions() {
    let mut p = saturated_pool();
    assert_eq!(apply(&mut p, &stored(A, None, &[(1, 7)])).capacity_omissions, 1);
    let same = replacement(&[stored(A, None, &[(1, 7)])]);
    assert_eq!(p.replace_ranks(BTreeMap::from([(A, same)])), Ok(0));
    assert_eq!(p.omitted_block_count(), 1);
    p.check_invariants().unwrap();
}

/// A replacement may bring a block's owners to the limit exactly, not past it.
#[test]
fn a_replacement_may_reach_the_owner_limit_exactly() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    p.owners.add_owners(7, OWNERS_MAX - 2);
    let one_more =
        |source| BTreeMap::from([(source, replacement(&[stored(source, None, &[(5, 7)])]))]);
    assert!(p.replace_ranks(one_more(A1)).is_ok());
    assert_eq!(owners(&p, root(7)), OWNERS_MAX);
    assert_eq!(p.replace_ranks(one_more(B)), Err(ApplyError::OwnershipDegreeOverflow(7)));
    assert_eq!(owners(&p, root(7)), OWNERS_MAX);
}

#[test]
fn replacement_diff_includes_pending_window_and_suppresses_returning_change() {
    let mut p = pool(256);
    let mut mirror = vec![0u64; 256];
    apply(&mut p, &stored(A, None, &[(1, 11)]));
    for image in p.take_publication() {
        mirror[image.bucket as usize] = image.word;
    }
    // Pending: 22 added, then the replacement drops 11 and adds 33.
    apply(&mut p, &stored(A, None, &[(2, 22)]));
    p.replace_ranks(BTreeMap::from([(A, replacement(&[stored(A, None, &[(3, 33)])]))])).unwrap();
    for image in p.take_publication() {
        mirror[image.bucket as usize] = image.word;
    }
    assert_eq!(mirror, p.filter().words());
    // A pending store that the replacement undoes publishes nothing.
    apply(&mut p, &stored(A, None, &[(4, 44)]));
    p.replace_ranks(BTreeMap::from([(A, replacement(&[stored(A, None, &[(3, 33)])]))])).unwrap();
    assert!(p.take_publication().is_empty());
}

#[test]
fn batched_rank_replacement_replaces_several_ranks_at_once() {
    let mut p = pool(256);
    apply(&mut p, &stored(A, None, &[(1, 11)]));
    apply(&mut p, &stored(A1, None, &[(1, 12)]));
    apply(&mut p, &stored(B, None, &[(1, 13)]));
    p.replace_ranks(BTreeMap::from([
        (A, replacement(&[stored(A, None, &[(5, 21)])])),
        (A1, RankReplacement::new(replacement_key())),
    ]))
    .unwrap();
    p.check_invariants().unwrap();
    let owned: Vec<SequenceHash> = p.owned_blocks().into_iter().map(|(h, _)| h).collect();
    let mut expected = vec![root(21), root(13)];
    expected.sort();
    assert_eq!(owned, expected);
}

#[test]
fn saturated_replacement_counts_omissions_and_stays_consistent() {
    let mut p = saturated_pool();
    let omissions = p
        .replace_ranks(BTreeMap::from([(A, replacement(&[stored(A, None, &[(1, 7), (2, 8)])]))]))
        .unwrap();
    assert_eq!(omissions, 2);
    assert_eq!(p.counters().capacity_omissions, 2);
    p.check_invariants().unwrap();
    // Freeing B's rank readmits the omitted blocks of A during the next replacement.
    p.replace_ranks(BTreeMap::from([(B, RankReplacement::new(replacement_key()))])).unwrap();
    assert_eq!(p.omitted_block_count(), 0);
    p.check_invariants().unwrap();
}

/// Room freed by a replacement admits the omitted blocks of other ranks, and only those: a
/// resident block of an untouched rank is not inserted a second time.
#[test]
fn a_replacement_readmits_only_omitted_blocks() {
    let mut p = pool(2);
    let blocks: Vec<(u64, u64)> = (0..7).map(|i| (1000 + i, 5000 + i)).collect();
    assert_eq!(apply(&mut p, &stored(B, None, &blocks)).capacity_omissions, 0);
    assert_eq!(apply(&mut p, &stored(A1, None, &[(1, 6000)])).capacity_omissions, 0);
    assert_eq!(apply(&mut p, &stored(A, None, &[(2, 7), (3, 8)])).capacity_omissions, 2);
    assert_eq!((p.filter().occupied_slots(), p.omitted_block_count()), (8, 2));
    p.replace_ranks(BTreeMap::from([(B, RankReplacement::new(replacement_key()))])).unwrap();
    assert_eq!((p.filter().occupied_slots(), p.omitted_block_count()), (3, 0));
    p.check_invariants().unwrap();
}

#[test]
fn replacement_failure_leaves_state_untouched() {
    let mut p = pool(64);
    apply(&mut p, &stored(A, None, &[(1, 7)]));
    p.owners.add_owners(9, OWNERS_MAX);
    let before = p.owned_blocks();
    let words = p.filter().words().to_vec();
    let result = p.replace_ranks(BTreeMap::from([(A, replacement(&[stored(A, None, &[(1, 9)])]))]));
    assert_eq!(result, Err(ApplyError::OwnershipDegreeOverflow(9)));
    assert_eq!(p.owned_blocks(), before);
    assert_eq!(p.filter().words(), &words[..]);
    assert_eq!(p.sources().collect::<Vec<_>>(), vec![(A, 1)]);
}

/// The sorted, summed net changes equal a map built one mapping at a time: two ranks sharing a
/// chain, one cut to its first half and one replaced by nothing, and a third rank whose
/// replacement keeps its blocks (a zero change, still listed) and adds five.
#[test]
fn net_changes_equal_a_map_of_the_replaced_and_replacing_mappings() {
    let mut p = pool(256);
    apply(&mut p, &new_chain(A, 1, 40));
    apply(&mut p, &new_chain(B, 1, 40));
    apply(&mut p, &new_chain(A1, 100, 10));
    let replacements = BTreeMap::from([
        (A, replacement(&[new_chain(A, 1, 20)])),
        (A1, replacement(&[new_chain(A1, 100, 15)])),
        (B, RankReplacement::new(replacement_key())),
    ]);
    let mut expected: BTreeMap<u64, i64> = BTreeMap::new();
    for (source, replacement) in &replacements {
        for (_, canonical) in p.sources.get(source).into_iter().flat_map(LineageTable::iter) {
            *expected.entry(canonical).or_default() -= 1;
        }
        for (_, canonical) in replacement.lineage.iter() {
            *expected.entry(canonical).or_default() += 1;
        }
    }
    let net = p.net_changes(&replacements).unwrap();
    assert_eq!(net, expected.into_iter().collect::<Vec<_>>());
    let count = |change: i64| net.iter().filter(|entry| entry.1 == change).count();
    assert_eq!([count(-2), count(-1), count(0), count(1)], [20, 20, 10, 5]);
    assert!(net.iter().all(|&(canonical, _)| mentions(&net, canonical)));
    assert!(!mentions(&net, root(424_242).0));
}

#[test]
fn removing_ranks_and_workers() {
    let mut p = pool(256);
    apply(&mut p, &stored(A, None, &[(1, 11)]));
    apply(&mut p, &stored(A1, None, &[(1, 12)]));
    apply(&mut p, &stored(B, None, &[(1, 13)]));
    p.remove_rank(A1).unwrap();
    assert_eq!(p.owned_block_count(), 2);
    p.remove_worker(1).unwrap();
    assert_eq!(p.owned_blocks().into_iter().map(|(h, _)| h).collect::<Vec<_>>(), vec![root(13)]);
    p.remove_worker(2).unwrap();
    assert!(p.filter().is_empty());
    p.check_invariants().unwrap();
}

/// Rank A holds 100 blocks (one chain), 40 of them shared with rank B, in a filter too small
/// for all of them (some are owned without residency).
fn shared_and_omitted_pool() -> PoolOwnership {
    let mut p = pool(16);
    apply(&mut p, &new_chain(A, 1, 100));
    apply(&mut p, &new_chain(B, 31, 40));
    assert!(p.omitted_block_count() > 0, "some blocks are owned without a fingerprint");
    p
}

#[test]
fn batched_releases_leave_the_state_that_one_at_a_time_releases_leave() {
    // One removal of every block (past several release chunks, with unknown ids among them)
    // against the same removals one event at a time.
    let mut batched = shared_and_omitted_pool();
    let mut single = shared_and_omitted_pool();
    let mut externals: Vec<u64> = (1..=100).collect();
    externals.splice(50..50, [5_000, 5_001, 7]);
    let outcome = apply(&mut batched, &removed(A, &externals));
    let mut unknown = 0;
    for &external in &externals {
        unknown += apply(&mut single, &removed(A, &[external])).unknown_removals;
    }
    assert_eq!(outcome.unknown_removals, 3, "two ids never stored, one removed twice");
    assert_eq!(unknown, 3);
    assert_eq!(observable(&batched), observable(&single));
    assert_eq!(batched.omitted_block_count(), single.omitted_block_count());
    assert_eq!(batched.owned_block_count(), 40, "B's share stays");

    // A clear of the rank, a rank removal and a replacement by nothing all release the same way.
    let mut cleared_pool = shared_and_omitted_pool();
    apply(&mut cleared_pool, &cleared(A));
    let mut removed_rank = shared_and_omitted_pool();
    removed_rank.remove_rank(A).unwrap();
    removed_rank.check_invariants().unwrap();
    assert_eq!(observable(&cleared_pool), observable(&single));
    assert_eq!(observable(&removed_rank), observable(&single));
}

#[test]
fn a_release_without_an_owner_is_a_violation_and_the_others_still_go() {
    let mut p = shared_and_omitted_pool();
    let mut reference = shared_and_omitted_pool();
    reference.remove_rank(A).unwrap();
    // Corrupt the state: A's lineage maps a resident hash only A owns, whose owner entry is gone.
    let orphan = p
        .sources
        .get(&A)
        .unwrap()
        .iter()
        .map(|(_, canonical)| canonical)
        .find(|&canonical| {
            p.owners.get(canonical) == Some(OwnerState { owners: 1, resident: true })
        })
        .unwrap();
    assert!(p.owners.remove_owners(orphan, 1).is_some());
    assert_eq!(p.remove_rank(A), Err(ApplyError::IndexerInvariantViolation { canonical: orphan }));
    // Every other block of the rank was released: B's share stays, the orphan's fingerprint
    // is the only one left behind.
    assert_eq!(p.owned_blocks(), reference.owned_blocks());
    assert!(p.filter().contains(orphan));
    assert_eq!(p.filter().occupied_slots(), reference.filter().occupied_slots() + 1);
}

// ---- the byte budget ----------------------------------------------------------------------------

/// `count` new blocks of `source` in one root chain, numbered from `first`.
fn new_chain(source: SourceKey, first: u64, count: u64) -> RouterEvent {
    let blocks: Vec<(u64, u64)> =
        (first..first + count).map(|i| (i, i.wrapping_mul(7919))).collect();
    stored(source, None, &blocks)
}

/// What a refused change must leave as it was.
#[derive(Debug, PartialEq, Eq)]
struct Observable {
    owned: Vec<(SequenceHash, OwnerState)>,
    words: Vec<u64>,
    exact_state_bytes: usize,
    sources: Vec<(SourceKey, usize)>,
}

fn observable(p: &PoolOwnership) -> Observable {
    Observable {
        owned: p.owned_blocks(),
        words: p.filter().words().to_vec(),
        exact_state_bytes: p.exact_state_bytes(),
        sources: p.sources().collect(),
    }
}

/// Store chains of four new blocks from `source` until the budget refuses one; returns the
/// refusal and how many stores were applied before it.
fn store_until_refused(p: &mut PoolOwnership, source: SourceKey, first: u64) -> (ApplyError, u64) {
    for applied in 0..10_000 {
        let before = observable(p);
        match p.apply_event(&new_chain(source, first + applied * 4, 4)) {
            Ok(_) => {
                p.check_invariants().expect("invariants hold");
                assert!(p.exact_state_bytes() <= p.exact_state_bytes_max());
            }
            Err(error) => {
                assert_eq!(observable(p), before, "a refused store changes nothing");
                return (error, applied);
            }
        }
    }
    panic!("the budget never refused a store");
}

#[test]
fn the_default_budget_follows_the_filter_slots_above_a_floor() {
    let default_sizing = CkfFormat::for_expected_blocks(1 << 20).unwrap();
    assert_eq!(default_sizing.bucket_count, 524_288);
    assert_eq!(exact_state_bytes_max_default(&default_sizing), 576 << 20);
    let largest = CkfFormat::v1(DEFAULT_SEED, 1 << 24);
    assert_eq!(exact_state_bytes_max_default(&largest), 18 << 30);
    let tiny = CkfFormat::v1(DEFAULT_SEED, 2);
    assert_eq!(exact_state_bytes_max_default(&tiny), EXACT_STATE_BYTES_MIN);
    assert_eq!(pool(2).exact_state_bytes_max(), EXACT_STATE_BYTES_MIN, "new pools take it");
}

#[test]
fn the_byte_budget_refuses_growth_whole_and_keeps_the_state_consistent() {
    const BUDGET: usize = 4096;
    let mut p = pool(256);
    p.set_exact_state_bytes_max(BUDGET).unwrap();
    let (refusal, applied) = store_until_refused(&mut p, A, 100);
    let ApplyError::ExactStateBudgetExceeded { needed_bytes, bytes_max } = refusal else {
        panic!("refused with {refusal:?}");
    };
    assert_eq!(bytes_max, BUDGET);
    assert!(needed_bytes > BUDGET, "{needed_bytes} bytes would have fitted");
    assert!(applied >= 16, "the budget held {applied} stores of four blocks");
    assert_eq!(p.owned_block_count() as u64, applied * 4);
    assert!(p.exact_state_bytes() > BUDGET / 2, "the tables grew up to the bound");
    assert_eq!(p.counters().budget_refusals, 1);
    assert_eq!(p.counters().events_rejected, 1);
    assert_eq!(refusal.disposition(), FailureDisposition::ReportResourceFailure);

    // At the bound: blocks already held are re-offered and removed as usual.
    let held = p.exact_state_bytes();
    apply(&mut p, &new_chain(A, 100, 4));
    apply(&mut p, &removed(A, &[100, 101]));
    assert_eq!(p.owned_block_count() as u64, applied * 4 - 2);
    assert_eq!(p.exact_state_bytes(), held, "tables keep what they reserved");
    // Another rank needs a lineage of its own, which the budget has no room for either.
    let (refusal, applied_b) = store_until_refused(&mut p, B, 1_000_000);
    assert!(matches!(refusal, ApplyError::ExactStateBudgetExceeded { .. }));
    assert!(applied_b < applied, "the second rank gets only what the first left");
    // Clearing the first rank releases its lineage, and the pool takes stores again.
    apply(&mut p, &cleared(A));
    assert!(p.exact_state_bytes() < held);
    apply(&mut p, &new_chain(B, 2_000_000, 4));
    assert_eq!(p.counters().budget_refusals, 2);
    p.check_invariants().unwrap();
}

#[test]
fn a_replacement_past_the_budget_is_refused_and_the_state_untouched() {
    let mut p = pool(256);
    apply(&mut p, &new_chain(A, 1, 4));
    apply(&mut p, &new_chain(B, 100, 4));
    p.set_exact_state_bytes_max(2048).unwrap();
    let before = observable(&p);
    // An unbounded replacement of 256 blocks: its lineage alone is over the budget.
    let big = replacement(&[new_chain(A, 1_000, 256)]);
    assert!(big.lineage_bytes() > 2048);
    let result = p.replace_ranks(BTreeMap::from([(A, big)]));
    assert!(
        matches!(result, Err(ApplyError::ExactStateBudgetExceeded { bytes_max: 2048, .. })),
        "{result:?}"
    );
    assert_eq!(observable(&p), before);
    assert_eq!(p.counters().budget_refusals, 1);
    p.check_invariants().unwrap();
    // A replacement that fits is installed, and its bytes replace the old lineage's.
    p.replace_ranks(BTreeMap::from([(A, replacement(&[new_chain(A, 50, 2)]))])).unwrap();
    assert_eq!(p.owned_block_count(), 6);
    p.check_invariants().unwrap();
}

#[test]
fn a_bounded_replacement_refuses_the_dump_event_that_would_pass_its_bound() {
    let mut r = RankReplacement::with_bytes_max(replacement_key(), 1024);
    r.push_event(&new_chain(A, 1, 8)).unwrap();
    let bytes = r.lineage_bytes();
    assert!(bytes > 0 && bytes <= 1024);
    let refusal = r.push_event(&new_chain(A, 100, 64)).unwrap_err();
    assert!(
        matches!(refusal, ApplyError::ExactStateBudgetExceeded { needed_bytes, bytes_max: 1024 } if needed_bytes > 1024),
        "{refusal:?}"
    );
    assert_eq!((r.block_count(), r.lineage_bytes()), (8, bytes), "nothing was added");
}

/// The bound is inclusive: a dump event that needs exactly the bound's bytes is accepted.
#[test]
fn a_replacement_may_fill_its_bound_exactly() {
    let mut unbounded = RankReplacement::new(replacement_key());
    unbounded.push_event(&new_chain(A, 1, 8)).unwrap();
    let exact = unbounded.lineage_bytes();
    let mut bounded = RankReplacement::with_bytes_max(replacement_key(), exact);
    assert_eq!(bounded.push_event(&new_chain(A, 1, 8)), Ok(()));
    assert_eq!((bounded.block_count(), bounded.lineage_bytes()), (8, exact));
    let mut short = RankReplacement::with_bytes_max(replacement_key(), exact - 1);
    assert!(matches!(
        short.push_event(&new_chain(A, 1, 8)),
        Err(ApplyError::ExactStateBudgetExceeded { needed_bytes, .. }) if needed_bytes == exact
    ));
}

/// The pool's budget is inclusive too: a store that needs exactly the budget is applied.
#[test]
fn a_pool_may_fill_its_budget_exactly() {
    let mut unbounded = pool(256);
    apply(&mut unbounded, &new_chain(A, 1, 64));
    let exact = unbounded.exact_state_bytes();
    let mut bounded = pool(256);
    bounded.set_exact_state_bytes_max(exact).unwrap();
    apply(&mut bounded, &new_chain(A, 1, 64));
    assert_eq!(bounded.exact_state_bytes(), exact);
    let mut short = pool(256);
    short.set_exact_state_bytes_max(exact - 1).unwrap();
    assert!(matches!(
        short.apply_event(&new_chain(A, 1, 64)),
        Err(ApplyError::ExactStateBudgetExceeded { needed_bytes, .. }) if needed_bytes == exact
    ));
}

#[test]
fn a_budget_below_the_bytes_held_is_refused() {
    let mut p = pool(256);
    apply(&mut p, &new_chain(A, 1, 64));
    let held = p.exact_state_bytes();
    assert!(held > 0);
    assert_eq!(
        p.set_exact_state_bytes_max(held - 1),
        Err(BudgetBelowHeld { held_bytes: held, bytes_max: held - 1 })
    );
    assert_eq!(p.exact_state_bytes_max(), exact_state_bytes_max_default(p.filter().format()));
    p.set_exact_state_bytes_max(held).unwrap();
    assert_eq!(p.exact_state_bytes_max(), held);
    p.check_invariants().unwrap();
}

#[test]
fn check_invariants_names_each_broken_relation() {
    let mut sound = pool(256);
    apply(&mut sound, &stored(A, None, &[(1, 7), (2, 8)]));
    apply(&mut sound, &stored(B, None, &[(5, 7)]));
    let seven = root(7).0;
    type Corruption = fn(&mut PoolOwnership, u64);
    let cases: [(Corruption, &str); 7] = [
        (|p, _| drop(p.sources.insert(A1, LineageTable::new(p.table_key))), "empty lineage"),
        (
            |p, _| {
                p.owners.add_owners(0xDEAD, 1);
            },
            "mapped hashes",
        ),
        (
            |p, canonical| {
                p.owners.add_owners(canonical, 1);
            },
            "owner count",
        ),
        (|p, canonical| p.filter.remove(canonical).unwrap(), "not in the filter"),
        (|p, _| p.omitted_owned += 1, "omitted hashes"),
        (|p, _| p.held_bytes += 1, "tables allocate"),
        (|p, _| p.exact_state_bytes_max = p.held_bytes - 1, "over its budget"),
    ];
    for (corrupt, relation) in cases {
        let mut broken = sound.clone();
        corrupt(&mut broken, seven);
        let violation = broken.check_invariants().unwrap_err();
        assert!(violation.contains(relation), "{relation:?}: {violation}");
    }
    sound.check_invariants().unwrap();
}

/// A pool past the gradual-growth threshold: every store and removal keeps the invariants while
/// its tables drain (the owner counts span both tables), the held bytes count both tables, and
/// they fall when a drained table is freed.
#[test]
fn a_large_pool_grows_its_tables_gradually_and_keeps_its_invariants() {
    let mut p = pool(1 << 16);
    let mut drained_frees = 0;
    let mut was_draining = false;
    let mut seen_draining = 0;
    let mut next = 0u64;
    // Canonical hash of each external id: a store's four blocks form one chain.
    let mut canonical = Vec::new();
    while next < 160_000 {
        let blocks: Vec<(u64, u64)> = (0..4).map(|i| (next + i, next + i)).collect();
        canonical.extend(chain(&[next, next + 1, next + 2, next + 3]));
        next += 4;
        p.apply_event(&stored(A, None, &blocks)).unwrap();
        if next.is_multiple_of(8) {
            // Share a block with another source and drop it again: owner counts cross tables.
            p.apply_event(&stored(B, None, &[(next, next - 8)])).unwrap();
            p.apply_event(&removed(B, &[next])).unwrap();
        }
        let draining = p.owners.table_is_draining();
        if draining {
            seen_draining += 1;
            if seen_draining % 2_000 == 1 {
                p.check_invariants().unwrap();
            }
        }
        if was_draining && !draining {
            drained_frees += 1;
            p.check_invariants().unwrap();
        }
        was_draining = draining;
    }
    assert!(drained_frees >= 1, "the owner table never finished a gradual growth");
    p.check_invariants().unwrap();
    for id in 0..next {
        assert_eq!(owners(&p, canonical[id as usize]), 1, "stored block {id}");
    }
    for removed_id in (0..next).step_by(3) {
        p.apply_event(&removed(A, &[removed_id])).unwrap();
    }
    p.check_invariants().unwrap();
    assert_eq!(p.exact_state_bytes(), p.allocated_bytes());
    for id in 0..next {
        let expected = u32::from(id % 3 != 0);
        assert_eq!(owners(&p, canonical[id as usize]), expected, "block {id}");
    }
    p.remove_rank(A).unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.owned_block_count(), 0);
}

#[test]
fn the_kept_store_plan_holds_room_for_ordinary_stores_only() {
    let mut pool = pool(1 << 12);
    apply(&mut pool, &stored(A, None, &[(1, 11), (2, 12), (3, 13), (4, 14)]));
    let kept = pool.plan.new_mappings.capacity();
    assert!(kept >= 4, "an ordinary store's room is kept: {kept}");
    assert!(pool.plan.new_mappings.is_empty(), "the kept plan holds no entry between stores");
    apply(&mut pool, &stored(A, Some(4), &[(5, 15), (6, 16), (7, 17), (8, 18)]));
    assert_eq!(pool.plan.new_mappings.capacity(), kept, "the next store reuses it");

    let long: Vec<(u64, u64)> = (100..100 + 4 * STORE_PLAN_KEPT_ENTRIES_MAX as u64)
        .map(|external| (external, external + 1_000))
        .collect();
    apply(&mut pool, &stored(B, None, &long));
    assert_eq!(owners(&pool, chain(&[1_100])[0]), 1, "the long store was applied");
    assert!(
        pool.plan.new_mappings.capacity() <= STORE_PLAN_KEPT_ENTRIES_MAX,
        "a long store's room is not kept"
    );
}
