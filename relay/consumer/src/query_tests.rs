//! Query resolution and hashing against replicas built from the real producer filter and CBI1
//! encoder.

use std::collections::BTreeSet;

use super::*;
use kvrelay_core::discovery::WorkerRole;
use kvrelay_core::filter::FilterFrame;
use kvrelay_core::filter::cbi1::FrameEncoder;
use kvrelay_core::filter::ckf::{CkfFormat, CuckooFilter, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::{HashFormat, XXH3_SEED};
use kvrelay_core::model::identity::{resolve_indexer_domain, stable_dc_id};
use kvrelay_core::rng::rng_from_seed;

const BUCKETS: u64 = 1024;

fn format() -> CkfFormat {
    CkfFormat::v1(DEFAULT_SEED, BUCKETS)
}

fn producer(endpoint: &str, semantics: QuerySemantics) -> ProducerIdentity {
    let endpoint: EndpointPath = endpoint.parse().unwrap();
    let domain = resolve_indexer_domain(
        "base-llm",
        semantics.kv_block_size,
        semantics.hash_format,
        &endpoint,
        None,
    )
    .unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("dc-a").unwrap() };
    ProducerIdentity::new(pool_id, 7, 1, format()).unwrap()
}

fn base(canonical: &str, aliases: &[&str]) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: canonical.into(),
        target: ModelTarget::Base { base_model: "base-llm".into() },
        aliases: aliases.iter().map(|alias| (*alias).to_owned()).collect(),
    }
}

fn lora(served: &str, adapter: &str, aliases: &[&str]) -> ModelRegistration {
    ModelRegistration {
        canonical_model_id: served.into(),
        target: ModelTarget::Lora { base_model: "base-llm".into(), adapter: adapter.into() },
        aliases: aliases.iter().map(|alias| (*alias).to_owned()).collect(),
    }
}

fn standard(block_size: u32) -> QuerySemantics {
    QuerySemantics { kv_block_size: block_size, hash_format: HashFormat::StandardV1 }
}

fn eagle(block_size: u32) -> QuerySemantics {
    QuerySemantics { kv_block_size: block_size, hash_format: HashFormat::EagleV1 }
}

fn descriptor(
    endpoint: &str,
    semantics: QuerySemantics,
    registrations: Vec<ModelRegistration>,
) -> PoolDescriptor {
    PoolDescriptor {
        producer: producer(endpoint, semantics),
        serving_endpoint: endpoint.parse().unwrap(),
        registrations,
        query_semantics: semantics,
        pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
    }
}

/// A ready replica whose filter holds exactly `hashes`.
fn replica_holding(hashes: &[SequenceHash]) -> FilterReplica {
    let mut filter = CuckooFilter::new(format(), MAX_KICKS_DEFAULT, rng_from_seed(5)).unwrap();
    for hash in hashes {
        filter.insert(hash.0).unwrap();
    }
    let frames = FrameEncoder::new(format(), stable_dc_id("dc-a").unwrap().0)
        .unwrap()
        .encode_snapshot(3, filter.words())
        .unwrap();
    let mut replica = FilterReplica::new(format(), stable_dc_id("dc-a").unwrap().0).unwrap();
    for frame in &frames {
        replica
            .accept(FilterFrame::SnapshotChunk { base_sequence: 3, sequence: 3, payload: frame })
            .unwrap();
    }
    assert_eq!(replica.sequence(), Some(3));
    replica
}

fn chain(tokens: &[u32], semantics: QuerySemantics, salt: Option<&str>) -> Vec<SequenceHash> {
    let seed = block_hash_seed(salt, None);
    sequence_hashes(&local_block_hashes(
        tokens,
        semantics.kv_block_size as usize,
        semantics.hash_format,
        seed,
    ))
}

fn tokens(count: u32) -> Vec<u32> {
    (100..100 + count).collect()
}

#[test]
fn canonical_id_and_alias_resolve_the_base_target_without_salt() {
    let pool =
        descriptor("dynamo/backend/generate", standard(4), vec![base("base-llm", &["base"])]);
    let prompt = tokens(17); // four complete blocks and one partial token
    let stored = chain(&prompt[..12], standard(4), None);
    let replica = replica_holding(&stored);
    for name in ["base-llm", "base"] {
        let answers =
            answer([QueryPool { descriptor: &pool, replica: Some(&replica) }], &prompt, name);
        assert_eq!(answers.len(), 1, "{name}");
        let only = &answers[0];
        assert_eq!((only.matched_blocks, only.total_blocks), (3, 4), "{name}");
        assert!(only.replica_ready);
        assert_eq!(only.canonical_model_id, "base-llm");
        assert_eq!(only.lora_adapter, None);
        assert_eq!(only.pool_id(), pool.pool_id());
        assert_eq!(only.endpoint.to_string(), "dynamo/backend/generate");
    }
}

#[test]
fn lora_served_name_salts_with_the_canonical_adapter_name() {
    assert_eq!(block_hash_seed(Some("adapter-a"), None), 8842669519798868182);
    let pool = descriptor(
        "loras/backend/generate",
        standard(4),
        vec![base("base-llm", &[]), lora("tenant-lora", "adapter-a", &["lora-alias"])],
    );
    let prompt = tokens(8);
    let salted = chain(&prompt, standard(4), Some("adapter-a"));
    assert_ne!(salted, chain(&prompt, standard(4), None), "the salt changes every block");
    let replica = replica_holding(&salted);
    for name in ["tenant-lora", "lora-alias"] {
        let answers =
            answer([QueryPool { descriptor: &pool, replica: Some(&replica) }], &prompt, name);
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].matched_blocks, answers[0].total_blocks), (2, 2), "{name}");
        assert_eq!(answers[0].lora_adapter.as_deref(), Some("adapter-a"));
        assert_eq!(answers[0].canonical_model_id, "tenant-lora");
    }
    // The base model shares the physical filter but not the hash space.
    let base_answers =
        answer([QueryPool { descriptor: &pool, replica: Some(&replica) }], &prompt, "base-llm");
    assert_eq!(base_answers[0].matched_blocks, 0);
    // Salting with the served name or the alias would miss the adapter's blocks.
    for wrong in ["tenant-lora", "lora-alias"] {
        assert_eq!(replica.longest_prefix(&chain(&prompt, standard(4), Some(wrong))), Some(0));
    }
}

#[test]
fn each_pool_hashes_with_its_own_semantics_including_eagle_windows() {
    let prompt = tokens(13);
    let prefill = descriptor("dynamo/prefill/generate", standard(4), vec![base("base-llm", &[])]);
    let decode = descriptor("dynamo/decode/generate", eagle(4), vec![base("base-llm", &[])]);
    let eagle_chain = chain(&prompt, eagle(4), None);
    let standard_chain = chain(&prompt, standard(4), None);
    // 13 tokens: three standard blocks, and (13 - 1) / 4 = 3 Eagle windows of five tokens.
    assert_eq!((standard_chain.len(), eagle_chain.len()), (3, 3));
    assert_eq!(
        eagle_chain[0],
        SequenceHash::root(kvrelay_core::model::hashing::local_block_hash(
            &prompt[..5],
            &[],
            XXH3_SEED
        ))
    );
    assert_ne!(eagle_chain, standard_chain);
    let prefill_replica = replica_holding(&standard_chain);
    let decode_replica = replica_holding(&eagle_chain[..2]);
    let answers = answer(
        [
            QueryPool { descriptor: &prefill, replica: Some(&prefill_replica) },
            QueryPool { descriptor: &decode, replica: Some(&decode_replica) },
        ],
        &prompt,
        "base-llm",
    );
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0].pool_id(), prefill.pool_id(), "best first");
    assert_eq!((answers[0].matched_blocks, answers[0].total_blocks), (3, 3));
    assert_eq!(answers[1].pool_id(), decode.pool_id());
    assert_eq!((answers[1].matched_blocks, answers[1].total_blocks), (2, 3));
    assert_eq!(answers[1].query_semantics.hash_format, HashFormat::EagleV1);
}

#[test]
fn an_unknown_model_gets_no_answer() {
    let pool = descriptor("dynamo/backend/generate", standard(4), vec![base("base-llm", &["b"])]);
    let replica = replica_holding(&chain(&tokens(8), standard(4), None));
    let pools = [QueryPool { descriptor: &pool, replica: Some(&replica) }];
    assert!(answer(pools, &tokens(8), "other-llm").is_empty());
    assert!(answer(pools, &tokens(8), "Base-LLM").is_empty(), "names match exactly");
    assert!(answer(pools, &tokens(8), "adapter-a").is_empty());
}

#[test]
fn the_prefix_stops_at_the_first_miss() {
    let pool = descriptor("dynamo/backend/generate", standard(4), vec![base("base-llm", &[])]);
    let prompt = tokens(20);
    let full = chain(&prompt, standard(4), None);
    // Blocks 0, 1, 3 and 4 are resident; block 2 is not.
    let resident: Vec<SequenceHash> =
        full.iter().enumerate().filter(|(index, _)| *index != 2).map(|(_, hash)| *hash).collect();
    let replica = replica_holding(&resident);
    let answers =
        answer([QueryPool { descriptor: &pool, replica: Some(&replica) }], &prompt, "base-llm");
    assert_eq!((answers[0].matched_blocks, answers[0].total_blocks), (2, 5));
}

#[test]
fn pools_without_a_replica_answer_not_ready_and_sort_after_ready_ones() {
    let ready = descriptor("dynamo/a/generate", standard(4), vec![base("base-llm", &[])]);
    let missing = descriptor("dynamo/b/generate", standard(4), vec![base("base-llm", &[])]);
    let empty = descriptor("dynamo/c/generate", standard(4), vec![base("base-llm", &[])]);
    let prompt = tokens(8);
    let empty_replica = replica_holding(&[]);
    let answers = answer(
        [
            QueryPool { descriptor: &missing, replica: None },
            QueryPool { descriptor: &empty, replica: Some(&empty_replica) },
            QueryPool {
                descriptor: &ready,
                replica: Some(&replica_holding(&chain(&prompt, standard(4), None))),
            },
        ],
        &prompt,
        "base-llm",
    );
    let order: Vec<(PoolId, usize, bool)> =
        answers.iter().map(|a| (a.pool_id(), a.matched_blocks, a.replica_ready)).collect();
    assert_eq!(
        order,
        [(ready.pool_id(), 2, true), (empty.pool_id(), 0, true), (missing.pool_id(), 0, false)]
    );
}

#[test]
fn ambiguous_registrations_are_never_guessed() {
    let pool = descriptor(
        "dynamo/backend/generate",
        standard(4),
        vec![base("base-llm", &["shared"]), lora("tenant-lora", "adapter-a", &["shared"])],
    );
    assert_eq!(resolve(&pool, "shared"), Resolution::Ambiguous);
    assert!(
        answer([QueryPool { descriptor: &pool, replica: None }], &tokens(8), "shared").is_empty()
    );
    assert!(matches!(resolve(&pool, "tenant-lora"), Resolution::Resolved(_)));
    assert_eq!(resolve(&pool, "nobody"), Resolution::Unresolved);
}

#[test]
fn prompts_shorter_than_a_block_have_no_blocks() {
    let pool = descriptor("dynamo/backend/generate", eagle(4), vec![base("base-llm", &[])]);
    let replica = replica_holding(&[]);
    // Four tokens make a standard block but not an Eagle window of five.
    let answers =
        answer([QueryPool { descriptor: &pool, replica: Some(&replica) }], &tokens(4), "base-llm");
    assert_eq!((answers[0].matched_blocks, answers[0].total_blocks), (0, 0));
    assert!(
        answer([QueryPool { descriptor: &pool, replica: None }], &[], "base-llm")[0].total_blocks
            == 0
    );
}
