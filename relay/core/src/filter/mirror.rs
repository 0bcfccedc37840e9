//! A filter's bucket words as a publication hub mirrors them: kept sparse while few buckets
//! hold a fingerprint, dense once many do.
//!
//! A hub keeps one mirror per published pool, beside the pool's own filter. A pool sized for a
//! million blocks has 524,288 buckets (4 MiB of words) however few blocks it holds, and most
//! pools of a deployment hold few; sparse, such a mirror costs a map entry per non-zero word.
//!
//! Invariants: a sparse mirror holds no zero word and no bucket at or past `bucket_count`, and
//! at most [`MirrorWords::sparse_words_max`] entries (a write past that makes it dense, for
//! good); a dense mirror holds exactly `bucket_count` words. Either way [`MirrorWords::get`] of
//! every bucket is the filter's word.

use std::collections::BTreeMap;

/// A sparse entry costs about this many bytes (a B-tree node of 4-byte keys and 8-byte values
/// is about two thirds full), against 8 for a dense word.
const SPARSE_ENTRY_BYTES: usize = 24;

/// Bucket words of one filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorWords {
    bucket_count: usize,
    repr: Repr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Repr {
    Sparse(BTreeMap<u32, u64>),
    Dense(Vec<u64>),
}

impl MirrorWords {
    /// Mirror `words` (one per bucket), sparse if few are non-zero.
    #[must_use]
    pub fn from_dense(words: Vec<u64>) -> Self {
        let bucket_count = words.len();
        let nonzero = words.iter().filter(|word| **word != 0).count();
        let sparse_max = Self::sparse_max(bucket_count);
        let repr = match u32::try_from(bucket_count) {
            Ok(_) if nonzero <= sparse_max => Repr::Sparse(
                words
                    .iter()
                    .enumerate()
                    .filter(|(_, word)| **word != 0)
                    .map(|(bucket, word)| (bucket as u32, *word))
                    .collect(),
            ),
            _ => Repr::Dense(words),
        };
        MirrorWords { bucket_count, repr }
    }

    /// Most non-zero words a mirror of `bucket_count` buckets keeps sparse: while the sparse form
    /// takes at most half the dense one's bytes.
    fn sparse_max(bucket_count: usize) -> usize {
        bucket_count * size_of::<u64>() / 2 / SPARSE_ENTRY_BYTES
    }

    /// Most non-zero words this mirror keeps sparse.
    #[must_use]
    pub fn sparse_words_max(&self) -> usize {
        Self::sparse_max(self.bucket_count)
    }

    /// Buckets mirrored.
    #[must_use]
    pub fn bucket_count(&self) -> usize {
        self.bucket_count
    }

    /// Whether the words are kept sparse.
    #[must_use]
    pub fn is_sparse(&self) -> bool {
        matches!(self.repr, Repr::Sparse(_))
    }

    /// The word of `bucket`, `None` past the last bucket.
    #[must_use]
    pub fn get(&self, bucket: usize) -> Option<u64> {
        if bucket >= self.bucket_count {
            return None;
        }
        Some(match &self.repr {
            Repr::Sparse(words) => {
                u32::try_from(bucket).ok().and_then(|key| words.get(&key)).copied().unwrap_or(0)
            }
            Repr::Dense(words) => words[bucket],
        })
    }

    /// Set the word of `bucket`; `false` (and nothing changed) past the last bucket.
    pub fn set(&mut self, bucket: usize, word: u64) -> bool {
        if bucket >= self.bucket_count {
            return false;
        }
        let sparse_max = self.sparse_words_max();
        match &mut self.repr {
            Repr::Dense(words) => words[bucket] = word,
            Repr::Sparse(words) => {
                // `from_dense` keeps a mirror sparse only if every bucket fits a u32.
                let key = u32::try_from(bucket).expect("sparse mirrors index buckets by u32");
                if word == 0 {
                    words.remove(&key);
                } else {
                    words.insert(key, word);
                    if words.len() > sparse_max {
                        self.repr = Repr::Dense(self.to_dense());
                    }
                }
            }
        }
        true
    }

    /// Every bucket's word, in bucket order.
    #[must_use]
    pub fn to_dense(&self) -> Vec<u64> {
        match &self.repr {
            Repr::Dense(words) => words.clone(),
            Repr::Sparse(sparse) => {
                let mut words = vec![0; self.bucket_count];
                for (&bucket, &word) in sparse {
                    words[bucket as usize] = word;
                }
                words
            }
        }
    }

    /// The dense words, if the mirror is dense (to borrow instead of copying).
    #[must_use]
    pub fn as_dense(&self) -> Option<&[u64]> {
        match &self.repr {
            Repr::Dense(words) => Some(words),
            Repr::Sparse(_) => None,
        }
    }

    /// Check the invariants of the module doc.
    pub fn check_invariants(&self) -> Result<(), String> {
        match &self.repr {
            Repr::Dense(words) if words.len() != self.bucket_count => Err(format!(
                "dense mirror of {} words for {} buckets",
                words.len(),
                self.bucket_count
            )),
            Repr::Dense(_) => Ok(()),
            Repr::Sparse(words) => {
                if words.len() > self.sparse_words_max() {
                    return Err(format!("sparse mirror of {} words past its bound", words.len()));
                }
                match words
                    .iter()
                    .find(|(bucket, word)| **word == 0 || **bucket as usize >= self.bucket_count)
                {
                    Some((bucket, word)) => {
                        Err(format!("sparse mirror holds bucket {bucket} word {word:#x}"))
                    }
                    None => Ok(()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(bucket_count: usize, set: &[(usize, u64)]) -> Vec<u64> {
        let mut words = vec![0; bucket_count];
        for &(bucket, word) in set {
            words[bucket] = word;
        }
        words
    }

    #[test]
    fn a_mostly_empty_filter_is_mirrored_sparse_and_reads_back_every_word() {
        let dense = words(1024, &[(0, 1), (511, 0xabcd), (1023, u64::MAX)]);
        let mirror = MirrorWords::from_dense(dense.clone());
        assert!(mirror.is_sparse());
        assert_eq!(mirror.bucket_count(), 1024);
        assert_eq!(mirror.to_dense(), dense);
        assert_eq!(mirror.get(511), Some(0xabcd));
        assert_eq!(mirror.get(512), Some(0));
        assert_eq!(mirror.get(1024), None, "past the last bucket");
        mirror.check_invariants().unwrap();
    }

    #[test]
    fn writes_keep_zero_words_out_and_refuse_buckets_past_the_end() {
        let mut mirror = MirrorWords::from_dense(vec![0; 1024]);
        assert!(mirror.set(7, 0x7));
        assert!(mirror.set(7, 0), "emptying a bucket");
        assert!(mirror.set(9, 0x9));
        assert!(!mirror.set(1024, 1), "past the end");
        assert_eq!(mirror.to_dense(), words(1024, &[(9, 0x9)]));
        assert!(mirror.is_sparse());
        mirror.check_invariants().unwrap();
    }

    #[test]
    fn a_mirror_turns_dense_past_its_bound_and_keeps_every_word() {
        let mut mirror = MirrorWords::from_dense(vec![0; 1024]);
        let bound = mirror.sparse_words_max();
        assert!(bound > 0 && bound < 1024);
        for bucket in 0..bound {
            mirror.set(bucket, bucket as u64 + 1);
        }
        assert!(mirror.is_sparse(), "at the bound");
        mirror.set(bound, 0xfeed);
        assert!(!mirror.is_sparse(), "past it");
        assert_eq!(mirror.as_dense().map(<[u64]>::len), Some(1024));
        let expected: Vec<u64> = (0..1024)
            .map(|bucket| match bucket {
                b if b < bound => b as u64 + 1,
                b if b == bound => 0xfeed,
                _ => 0,
            })
            .collect();
        assert_eq!(mirror.to_dense(), expected);
        mirror.check_invariants().unwrap();
    }

    #[test]
    fn a_full_filter_is_mirrored_dense() {
        let mirror = MirrorWords::from_dense(vec![3; 64]);
        assert!(!mirror.is_sparse());
        assert_eq!(mirror.as_dense(), Some(&[3u64; 64][..]));
    }

    #[test]
    fn the_invariant_check_names_a_broken_mirror() {
        let mut zero = MirrorWords::from_dense(vec![0; 64]);
        if let Repr::Sparse(words) = &mut zero.repr {
            words.insert(3, 0);
        }
        assert!(zero.check_invariants().unwrap_err().contains("bucket 3"));
        let mut past = MirrorWords::from_dense(vec![0; 64]);
        if let Repr::Sparse(words) = &mut past.repr {
            words.insert(64, 1);
        }
        assert!(past.check_invariants().unwrap_err().contains("bucket 64"));
        let short = MirrorWords { bucket_count: 64, repr: Repr::Dense(vec![0; 63]) };
        assert!(short.check_invariants().unwrap_err().contains("63 words"));
    }
}
