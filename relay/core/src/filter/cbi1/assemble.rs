//! Rebuilding one whole snapshot from its decoded chunks (relay-facts §5.5, snapshot assembly).
//!
//! Chunk 0 starts (or restarts) an assembly and fixes its epoch, chunk count and bucket count.
//! Each later chunk must be the next index of that same snapshot and start at the next uncovered
//! bucket; anything else abandons the assembly with a [`ChunkSequenceError`]. After the last
//! chunk the covered buckets must be exactly the filter. Only then does the snapshot leave the
//! assembler, so a consumer never sees a partial filter.

use thiserror::Error;

use super::SnapshotChunk;
use crate::filter::ckf::{BUCKET_COUNT_MAX, BucketImage, CkfFormat};

/// How a chunk broke the sequence of the snapshot being assembled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChunkSequenceError {
    /// A chunk other than 0 arrived with no snapshot being assembled.
    #[error("chunk {chunk_index} arrived with no snapshot started")]
    NotStarted {
        /// The chunk's index.
        chunk_index: u32,
    },
    /// Not the next chunk (reordered, duplicated or skipped).
    #[error("expected chunk {expected}, got chunk {found}")]
    ChunkIndex {
        /// The next chunk index.
        expected: u32,
        /// The chunk's index.
        found: u32,
    },
    /// The chunk claims a different chunk count than chunk 0.
    #[error("chunk count {found} differs from the snapshot's {expected}")]
    ChunkCount {
        /// Chunk 0's count.
        expected: u32,
        /// The chunk's count.
        found: u32,
    },
    /// The chunk belongs to another snapshot epoch.
    #[error("chunk epoch {found} differs from the snapshot's {expected}")]
    Epoch {
        /// Chunk 0's epoch.
        expected: u64,
        /// The chunk's epoch.
        found: u64,
    },
    /// The chunk describes a filter of another size.
    #[error("chunk bucket count {found} differs from the snapshot's {expected}")]
    BucketCount {
        /// Chunk 0's bucket count.
        expected: u64,
        /// The chunk's bucket count.
        found: u64,
    },
    /// The chunk does not start at the next uncovered bucket.
    #[error("chunk starts at bucket {found}, expected bucket {expected}")]
    BucketOffset {
        /// The next uncovered bucket.
        expected: u64,
        /// The chunk's first bucket.
        found: u64,
    },
}

/// Why a snapshot could not be assembled. The assembly in progress is abandoned in every case.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AssemblyError {
    /// A chunk out of sequence.
    #[error("snapshot chunk out of sequence: {0}")]
    ChunkSequence(#[from] ChunkSequenceError),
    /// The last chunk arrived but the chunks did not cover every bucket.
    #[error("snapshot ended after covering {covered_buckets} of {bucket_count} buckets")]
    IncompleteCoverage {
        /// Buckets the chunks covered.
        covered_buckets: u64,
        /// The filter's bucket count.
        bucket_count: u64,
    },
    /// The words of the whole filter could not be reserved.
    #[error("could not reserve {bucket_count} bucket words for a snapshot")]
    Allocation {
        /// The filter's bucket count.
        bucket_count: u64,
    },
}

/// A complete, validated snapshot: one word per bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssembledSnapshot {
    epoch: u64,
    format: CkfFormat,
    words: Vec<u64>,
}

impl AssembledSnapshot {
    /// The snapshot's publication sequence.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The producer filter's format (the chunks' validated header format).
    #[must_use]
    pub fn format(&self) -> &CkfFormat {
        &self.format
    }

    /// Every bucket word, bucket 0 first; `words().len() == format().bucket_count`.
    #[must_use]
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Take the bucket words.
    #[must_use]
    pub fn into_words(self) -> Vec<u64> {
        self.words
    }

    /// The images of every nonzero bucket, ascending by bucket.
    pub fn nonzero_images(&self) -> impl Iterator<Item = BucketImage> + '_ {
        // A valid format has at most 2^24 buckets, so every index fits a u32.
        self.words
            .iter()
            .enumerate()
            .filter(|(_, word)| **word != 0)
            .map(|(bucket, &word)| BucketImage { bucket: bucket as u32, word })
    }
}

/// Feeds decoded snapshot chunks in order and yields the snapshot once it is complete.
///
/// Holds at most one assembly; its word vector is reserved once, at chunk 0, for exactly the
/// validated bucket count (at most 2^24 words).
#[derive(Debug, Default)]
pub struct SnapshotAssembler {
    assembly: Option<Assembly>,
}

/// The snapshot being assembled. Invariant: `words.len()` is the next uncovered bucket and
/// never exceeds `bucket_count` (the words' reserved capacity).
#[derive(Debug)]
struct Assembly {
    epoch: u64,
    format: CkfFormat,
    chunk_count: u32,
    chunk_index_next: u32,
    words: Vec<u64>,
}

impl SnapshotAssembler {
    /// An assembler with nothing in progress.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a snapshot is partly assembled.
    #[must_use]
    pub fn is_assembling(&self) -> bool {
        self.assembly.is_some()
    }

    /// Abandon any assembly in progress (for example when the stream restarts).
    pub fn reset(&mut self) {
        self.assembly = None;
    }

    /// Add the next chunk. Returns the snapshot when `chunk` completes it, `None` while more
    /// chunks are due. On error the assembly is abandoned; the next snapshot starts at chunk 0.
    pub fn accept(
        &mut self,
        chunk: &SnapshotChunk<'_>,
    ) -> Result<Option<AssembledSnapshot>, AssemblyError> {
        let mut assembly = if chunk.chunk_index() == 0 {
            // Release the abandoned words before reserving new ones.
            self.assembly = None;
            Assembly::start(chunk)?
        } else {
            let assembly = self
                .assembly
                .take()
                .ok_or(ChunkSequenceError::NotStarted { chunk_index: chunk.chunk_index() })?;
            assembly.check_next(chunk)?;
            assembly
        };

        assembly.words.extend(chunk.words());
        assembly.chunk_index_next += 1;
        debug_assert!(assembly.words.len() as u64 <= assembly.format.bucket_count);
        if assembly.chunk_index_next < assembly.chunk_count {
            self.assembly = Some(assembly);
            return Ok(None);
        }
        assembly.finish().map(Some)
    }
}

impl Assembly {
    /// Begin an assembly with chunk 0, which must start at bucket 0.
    fn start(chunk: &SnapshotChunk<'_>) -> Result<Self, AssemblyError> {
        debug_assert_eq!(chunk.chunk_index(), 0);
        if chunk.bucket_offset() != 0 {
            return Err(ChunkSequenceError::BucketOffset {
                expected: 0,
                found: chunk.bucket_offset(),
            }
            .into());
        }
        let format = chunk.header().format;
        let bucket_count = format.bucket_count;
        // Decoded chunks carry a validated format; the bound is what makes the reservation safe.
        assert!(bucket_count <= BUCKET_COUNT_MAX, "decoded chunks carry a valid bucket count");
        let mut words = Vec::new();
        words
            .try_reserve_exact(bucket_count as usize)
            .map_err(|_| AssemblyError::Allocation { bucket_count })?;
        Ok(Assembly {
            epoch: chunk.header().epoch,
            format,
            chunk_count: chunk.chunk_count(),
            chunk_index_next: 0,
            words,
        })
    }

    /// Whether `chunk` is the next chunk of this snapshot.
    fn check_next(&self, chunk: &SnapshotChunk<'_>) -> Result<(), ChunkSequenceError> {
        let header = chunk.header();
        if chunk.chunk_index() != self.chunk_index_next {
            return Err(ChunkSequenceError::ChunkIndex {
                expected: self.chunk_index_next,
                found: chunk.chunk_index(),
            });
        }
        if chunk.chunk_count() != self.chunk_count {
            return Err(ChunkSequenceError::ChunkCount {
                expected: self.chunk_count,
                found: chunk.chunk_count(),
            });
        }
        if header.epoch != self.epoch {
            return Err(ChunkSequenceError::Epoch { expected: self.epoch, found: header.epoch });
        }
        if header.format.bucket_count != self.format.bucket_count {
            return Err(ChunkSequenceError::BucketCount {
                expected: self.format.bucket_count,
                found: header.format.bucket_count,
            });
        }
        let bucket_next = self.words.len() as u64;
        if chunk.bucket_offset() != bucket_next {
            return Err(ChunkSequenceError::BucketOffset {
                expected: bucket_next,
                found: chunk.bucket_offset(),
            });
        }
        Ok(())
    }

    /// After the last chunk: the snapshot, if the chunks covered every bucket.
    fn finish(self) -> Result<AssembledSnapshot, AssemblyError> {
        let covered_buckets = self.words.len() as u64;
        if covered_buckets != self.format.bucket_count {
            return Err(AssemblyError::IncompleteCoverage {
                covered_buckets,
                bucket_count: self.format.bucket_count,
            });
        }
        Ok(AssembledSnapshot { epoch: self.epoch, format: self.format, words: self.words })
    }
}
