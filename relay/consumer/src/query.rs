//! Longest-prefix queries against the consumer's pool replicas (relay-facts §6.2), pure.
//!
//! A router asks: for these prompt tokens and this request-facing model name, how many leading
//! KV blocks does each remote pool (probably) hold? Per pool:
//!
//! 1. resolve the name against the pool's registrations: a canonical model id or an alias
//!    selects that registration's target;
//! 2. hash the tokens with that pool's query semantics — its block size and its window shape
//!    (standard: consecutive `block_size` windows; Eagle: `block_size + 1` windows with stride
//!    `block_size`) — seeding block hashes with the LoRA salt of a LoRA target's canonical
//!    adapter name (never the alias or served name) and with no salt for a base target;
//! 3. probe the pool's filter replica for the longest prefix of the sequence hashes.
//!
//! Invariants: a pool whose registrations do not resolve the name is not answered; a pool whose
//! registrations resolve it to two different targets is not answered either (the catalog is
//! ambiguous and the consumer never guesses); a pool without an installed replica is answered
//! with `replica_ready == false` and zero matched blocks; a prefix stops at the first block the
//! filter does not hold (later hits never count). Filters are lossy: a match may be a false
//! positive, a miss never is. The cache-namespace salt is not part of the catalog, so queries
//! hash without one.

use std::collections::BTreeMap;

use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics};
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::host::PoolDescriptor;
use kvrelay_core::model::hashing::{
    SequenceHash, block_hash_seed, local_block_hashes, sequence_hashes,
};
use kvrelay_core::model::identity::{EndpointPath, PoolId, ProducerIdentity};

/// One pool as the query sees it: its catalog descriptor and, once installed, its replica.
#[derive(Debug, Clone, Copy)]
pub struct QueryPool<'a> {
    /// The pool's current catalog descriptor.
    pub descriptor: &'a PoolDescriptor,
    /// The pool's replica, if a complete snapshot was installed for the descriptor's producer.
    pub replica: Option<&'a FilterReplica>,
}

/// How a request-facing name resolves against one pool's registrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution<'a> {
    /// No registration has the name as canonical id or alias.
    Unresolved,
    /// Every registration that has the name agrees on this one (the first in catalog order).
    Resolved(&'a ModelRegistration),
    /// Two registrations with the name name different targets.
    Ambiguous,
}

/// Resolve `model` against `descriptor`'s registrations (exact, case-sensitive match of the
/// canonical id or an alias).
#[must_use]
pub fn resolve<'a>(descriptor: &'a PoolDescriptor, model: &str) -> Resolution<'a> {
    let mut matching = descriptor.registrations.iter().filter(|registration| {
        registration.canonical_model_id == model || registration.aliases.contains(model)
    });
    let Some(first) = matching.next() else {
        return Resolution::Unresolved;
    };
    if matching.any(|other| other.target != first.target) {
        return Resolution::Ambiguous;
    }
    Resolution::Resolved(first)
}

/// The LoRA salt name of a target: the canonical adapter name for a LoRA target, none for a
/// base target.
#[must_use]
pub fn lora_salt(target: &ModelTarget) -> Option<&str> {
    match target {
        ModelTarget::Base { .. } => None,
        ModelTarget::Lora { adapter, .. } => Some(adapter.as_str()),
    }
}

/// The canonical sequence hashes of `tokens` under `semantics`, salted for `target`. Only
/// complete blocks are hashed; a block size that does not fit `usize` hashes nothing.
#[must_use]
pub fn query_hashes(
    tokens: &[u32],
    semantics: &QuerySemantics,
    target: &ModelTarget,
) -> Vec<SequenceHash> {
    let Ok(block_size) = usize::try_from(semantics.kv_block_size) else {
        return Vec::new();
    };
    let seed = block_hash_seed(lora_salt(target), None);
    sequence_hashes(&local_block_hashes(tokens, block_size, semantics.hash_format, seed))
}

/// One pool's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryAnswer {
    /// The pool's producer (the generation the replica belongs to).
    pub producer: ProducerIdentity,
    /// The serving endpoint to route to.
    pub endpoint: EndpointPath,
    /// The canonical id of the registration the name resolved to.
    pub canonical_model_id: String,
    /// The LoRA salt the tokens were hashed with (`None` for a base target).
    pub lora_adapter: Option<String>,
    /// The semantics the tokens were hashed with.
    pub query_semantics: QuerySemantics,
    /// Leading blocks the filter (probably) holds; `0` when no replica is installed.
    pub matched_blocks: usize,
    /// Complete blocks of the query under this pool's semantics.
    pub total_blocks: usize,
    /// Whether a complete replica answered (otherwise `matched_blocks` means nothing).
    pub replica_ready: bool,
}

impl QueryAnswer {
    /// The pool the answer is about.
    #[must_use]
    pub fn pool_id(&self) -> PoolId {
        self.producer.pool_id()
    }
}

/// Answer `tokens` for `model` against every pool, best first: most matched blocks, then pools
/// with a ready replica, then pool id and producer order (so equal answers sort the same way on
/// every run). Pools that do not resolve the name unambiguously are left out.
#[must_use]
pub fn answer<'a>(
    pools: impl IntoIterator<Item = QueryPool<'a>>,
    tokens: &[u32],
    model: &str,
) -> Vec<QueryAnswer> {
    // Pools sharing semantics and salt share one hash chain.
    let mut chains: BTreeMap<(QuerySemantics, Option<&str>), Vec<SequenceHash>> = BTreeMap::new();
    let mut answers = Vec::new();
    for pool in pools {
        let Resolution::Resolved(registration) = resolve(pool.descriptor, model) else {
            continue;
        };
        let semantics = pool.descriptor.query_semantics;
        let salt = lora_salt(&registration.target);
        let hashes = chains
            .entry((semantics, salt))
            .or_insert_with(|| query_hashes(tokens, &semantics, &registration.target));
        let matched = pool.replica.and_then(|replica| replica.longest_prefix(hashes));
        answers.push(QueryAnswer {
            producer: pool.descriptor.producer,
            endpoint: pool.descriptor.serving_endpoint.clone(),
            canonical_model_id: registration.canonical_model_id.clone(),
            lora_adapter: salt.map(str::to_owned),
            query_semantics: semantics,
            matched_blocks: matched.unwrap_or(0),
            total_blocks: hashes.len(),
            replica_ready: matched.is_some(),
        });
        debug_assert!(matched.is_none_or(|blocks| blocks <= hashes.len()));
    }
    answers.sort_by(|a, b| {
        b.matched_blocks
            .cmp(&a.matched_blocks)
            .then(b.replica_ready.cmp(&a.replica_ready))
            .then(a.producer.cmp(&b.producer))
    });
    answers
}

#[cfg(test)]
#[path = "query_tests.rs"]
mod tests;
