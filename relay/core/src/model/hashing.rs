//! Dynamo's block and sequence hashes (dc-inputs §2.4–2.5, relay-facts §6).
//!
//! Three hash kinds exist and never mix: the engine's opaque [`ExternalBlockHash`] (lineage only),
//! the position-independent [`LocalBlockHash`] of one block's tokens (salt and multimodal data
//! folded in), and the canonical [`SequenceHash`] chained from local hashes. Only sequence hashes
//! enter the cuckoo filter, so every engine and every DC agree on them.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

/// Seed of every unsalted block hash and of the sequence chain.
pub const XXH3_SEED: u64 = 1337;

/// Engine-specific, sequence-aware block id; meaningful only inside one `(worker, dp_rank)` stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExternalBlockHash(pub u64);

/// Hash of one block's tokens (plus salt and multimodal hashes); independent of position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LocalBlockHash(pub u64);

/// Canonical rolling prefix hash: what the cuckoo filter stores and what consumers probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SequenceHash(pub u64);

impl SequenceHash {
    /// The sequence hash of a first block is its local hash.
    #[must_use]
    pub fn root(block: LocalBlockHash) -> Self {
        SequenceHash(block.0)
    }

    /// The sequence hash of the block that follows `self`.
    #[must_use]
    pub fn child(self, block: LocalBlockHash) -> Self {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.0.to_le_bytes());
        bytes[8..].copy_from_slice(&block.0.to_le_bytes());
        SequenceHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
    }
}

/// How a pool's blocks are cut from a token sequence (the hash format of its query semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HashFormat {
    /// Consecutive `block_size`-token windows.
    StandardV1,
    /// Windows of `block_size + 1` tokens with stride `block_size`.
    EagleV1,
}

impl HashFormat {
    /// The value mixed into cache-semantics identity (`event_hash_format`).
    #[must_use]
    pub fn identity_version(self) -> u16 {
        match self {
            HashFormat::StandardV1 => 1,
            HashFormat::EagleV1 => 2,
        }
    }
}

/// The seed for every block hash of a request: 1337, salted by LoRA name and cache namespace.
///
/// Empty strings count as absent. The chain seed is never salted.
#[must_use]
pub fn block_hash_seed(lora_name: Option<&str>, cache_namespace: Option<&str>) -> u64 {
    let mut seed = XXH3_SEED;
    if let Some(lora) = lora_name.filter(|name| !name.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(namespace) = cache_namespace.filter(|name| !name.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(namespace.as_bytes(), 1));
    }
    seed
}

/// Bytes hashed in one call; longer material streams through a buffer of this size. Both paths
/// give the same digest (XXH3 is defined over the byte string, not over how it is fed).
const HASH_BUFFER_BYTES: usize = 1024;

/// Hash one block: its tokens as u32 little-endian, then its multimodal hashes sorted ascending
/// as u64 little-endian, all under `seed`.
#[must_use]
pub fn local_block_hash(tokens: &[u32], mm_hashes: &[u64], seed: u64) -> LocalBlockHash {
    let mut sorted_mm = mm_hashes.to_vec();
    sorted_mm.sort_unstable();
    let mut buffer = [0u8; HASH_BUFFER_BYTES];
    if tokens.len() * 4 + sorted_mm.len() * 8 <= HASH_BUFFER_BYTES {
        let mut filled = 0;
        for token in tokens {
            buffer[filled..filled + 4].copy_from_slice(&token.to_le_bytes());
            filled += 4;
        }
        for mm in &sorted_mm {
            buffer[filled..filled + 8].copy_from_slice(&mm.to_le_bytes());
            filled += 8;
        }
        return LocalBlockHash(xxh3_64_with_seed(&buffer[..filled], seed));
    }
    let mut hasher = Xxh3::with_seed(seed);
    for chunk in tokens.chunks(HASH_BUFFER_BYTES / 4) {
        for (slot, token) in buffer.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        hasher.update(&buffer[..chunk.len() * 4]);
    }
    for chunk in sorted_mm.chunks(HASH_BUFFER_BYTES / 8) {
        for (slot, mm) in buffer.chunks_exact_mut(8).zip(chunk) {
            slot.copy_from_slice(&mm.to_le_bytes());
        }
        hasher.update(&buffer[..chunk.len() * 8]);
    }
    LocalBlockHash(hasher.digest())
}

/// The local hashes of every complete block of `tokens` (a trailing partial block is not hashed).
///
/// `block_size == 0` yields no blocks.
#[must_use]
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    format: HashFormat,
    seed: u64,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let window = match format {
        HashFormat::StandardV1 => block_size,
        HashFormat::EagleV1 => block_size + 1,
    };
    let count = match format {
        HashFormat::StandardV1 => tokens.len() / block_size,
        HashFormat::EagleV1 => tokens.len().saturating_sub(1) / block_size,
    };
    (0..count)
        .map(|index| {
            let start = index * block_size;
            local_block_hash(&tokens[start..start + window], &[], seed)
        })
        .collect()
}

/// Chain local block hashes into canonical sequence hashes.
#[must_use]
pub fn sequence_hashes(blocks: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut previous: Option<SequenceHash> = None;
    for &block in blocks {
        let next = match previous {
            None => SequenceHash::root(block),
            Some(parent) => parent.child(block),
        };
        out.push(next);
        previous = Some(next);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unsalted(tokens: &[u32]) -> u64 {
        local_block_hash(tokens, &[], XXH3_SEED).0
    }

    #[test]
    fn block_hashes_match_dynamo_vectors() {
        assert_eq!(unsalted(&[1, 2, 3, 4]), 14643705804678351452);
        assert_eq!(unsalted(&[5, 6, 7, 8]), 16777012769546811212);
        assert_eq!(unsalted(&[9, 10, 11, 12]), 483935686894639516);
    }

    #[test]
    fn sequence_chain_matches_dynamo_vectors() {
        let tokens: Vec<u32> = (1..=12).collect();
        let blocks = local_block_hashes(&tokens, 4, HashFormat::StandardV1, XXH3_SEED);
        let chain = sequence_hashes(&blocks);
        assert_eq!(chain[0].0, 14643705804678351452);
        assert_eq!(chain[1].0, 4945711292740353085);
        assert_eq!(chain[2].0, 12583592247330656132);
    }

    #[test]
    fn computed_example_for_tokens_zero_to_seven() {
        let tokens: Vec<u32> = (0..8).collect();
        let blocks = local_block_hashes(&tokens, 4, HashFormat::StandardV1, XXH3_SEED);
        assert_eq!(
            blocks,
            [LocalBlockHash(0x7ee2cbedc694ab46), LocalBlockHash(0xa8416cfd935bdb13)]
        );
        let chain = sequence_hashes(&blocks);
        assert_eq!(chain, [SequenceHash(0x7ee2cbedc694ab46), SequenceHash(0x83fb702f20e2ad65)]);
    }

    #[test]
    fn lora_salt_changes_the_seed_and_empty_names_are_absent() {
        let seed = block_hash_seed(Some("adapter-a"), None);
        assert_eq!(seed, 8842669519798868182);
        assert_eq!(local_block_hash(&[1, 2, 3, 4], &[], seed).0, 11381080598872079209);
        assert_eq!(block_hash_seed(Some(""), Some("")), XXH3_SEED);
        assert_eq!(block_hash_seed(None, None), XXH3_SEED);
        assert_ne!(block_hash_seed(None, Some("tenant")), XXH3_SEED);
        assert_ne!(block_hash_seed(Some("a"), Some("t")), block_hash_seed(Some("a"), None));
    }

    #[test]
    fn multimodal_hashes_are_appended_sorted() {
        let a = local_block_hash(&[1, 2], &[9, 3], XXH3_SEED);
        let b = local_block_hash(&[1, 2], &[3, 9], XXH3_SEED);
        assert_eq!(a, b);
        let mut bytes = Vec::new();
        for t in [1u32, 2] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        for m in [3u64, 9] {
            bytes.extend_from_slice(&m.to_le_bytes());
        }
        assert_eq!(a.0, xxh3_64_with_seed(&bytes, XXH3_SEED));
        assert_ne!(a, local_block_hash(&[1, 2], &[], XXH3_SEED));
    }

    #[test]
    fn eagle_windows_overlap_by_one_token() {
        let tokens: Vec<u32> = (0..9).collect();
        let blocks = local_block_hashes(&tokens, 4, HashFormat::EagleV1, XXH3_SEED);
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0], local_block_hash(&[0, 1, 2, 3, 4], &[], XXH3_SEED));
        assert_eq!(blocks[1], local_block_hash(&[4, 5, 6, 7, 8], &[], XXH3_SEED));
        // Eight tokens hold only one Eagle window of five.
        assert_eq!(local_block_hashes(&tokens[..8], 4, HashFormat::EagleV1, XXH3_SEED).len(), 1);
        assert!(local_block_hashes(&[], 4, HashFormat::EagleV1, XXH3_SEED).is_empty());
    }

    #[test]
    fn partial_blocks_and_zero_block_size_hash_nothing() {
        assert_eq!(local_block_hashes(&[1, 2, 3, 4, 5], 4, HashFormat::StandardV1, 1337).len(), 1);
        assert!(local_block_hashes(&[1, 2, 3], 0, HashFormat::StandardV1, 1337).is_empty());
    }

    #[test]
    fn long_blocks_stream_to_the_same_digest_as_one_call() {
        let tokens: Vec<u32> = (0..1000u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let mm = [9u64, 3, 7];
        let mut bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        bytes.extend([3u64, 7, 9].iter().flat_map(|m| m.to_le_bytes()));
        let expected = xxh3_64_with_seed(&bytes, XXH3_SEED);
        assert_eq!(local_block_hash(&tokens, &mm, XXH3_SEED).0, expected);
        // Exactly at the one-call bound and one token past it.
        for len in [256, 257] {
            let bytes: Vec<u8> = tokens[..len].iter().flat_map(|t| t.to_le_bytes()).collect();
            let expected = xxh3_64_with_seed(&bytes, XXH3_SEED);
            assert_eq!(local_block_hash(&tokens[..len], &[], XXH3_SEED).0, expected);
        }
    }
}
