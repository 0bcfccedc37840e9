//! A filter's bucket words as a publication hub mirrors them: in pages allocated only where a
//! bucket holds a fingerprint while few do, dense once many do.
//!
//! A hub keeps one mirror per published pool, beside the pool's own filter. A pool sized for a
//! million blocks has 524,288 buckets (4 MiB of words) however few blocks it holds, and most
//! pools of a deployment hold few. Sparse, a mirror is a page index (4 bytes per
//! [`PAGE_WORDS`] buckets) and the pages that hold a non-zero word; reading or writing a word is
//! two array accesses, with no hashing (bucket indices come from the DC's block hashes, so no
//! structure here may depend on their distribution).
//!
//! Invariants: in a sparse mirror every index entry is [`NO_PAGE`] or a distinct page that is
//! not free and holds a non-zero word; every free page is all zero; at most
//! [`MirrorWords::pages_max`] pages are allocated (allocating one more makes the mirror dense,
//! for good). A dense mirror holds exactly `bucket_count` words. Either way
//! [`MirrorWords::get`] of every bucket is the filter's word.

/// Buckets per page of a sparse mirror (a 128-byte page).
pub const PAGE_WORDS: usize = 16;

/// An index entry with no page: every word of its buckets is zero.
const NO_PAGE: u32 = u32::MAX;

type Page = [u64; PAGE_WORDS];

/// Most pages a sparse mirror of `bucket_count` buckets allocates: while pages and index
/// together take at most about half the dense words' bytes (and the index can name them).
fn pages_max(bucket_count: usize) -> usize {
    (bucket_count / PAGE_WORDS / 2).min(NO_PAGE as usize)
}

/// Bucket words of one filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorWords {
    bucket_count: usize,
    repr: Repr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Repr {
    Sparse { index: Vec<u32>, pages: Vec<Page>, free: Vec<u32> },
    Dense(Vec<u64>),
}

impl MirrorWords {
    /// Mirror `words` (one per bucket), sparse if few pages would hold a non-zero word.
    #[must_use]
    pub fn from_dense(words: Vec<u64>) -> Self {
        let bucket_count = words.len();
        let filled_pages =
            words.chunks(PAGE_WORDS).filter(|page| page.iter().any(|word| *word != 0)).count();
        if filled_pages > pages_max(bucket_count) {
            return MirrorWords { bucket_count, repr: Repr::Dense(words) };
        }
        let mut mirror = MirrorWords {
            bucket_count,
            repr: Repr::Sparse {
                index: vec![NO_PAGE; bucket_count.div_ceil(PAGE_WORDS)],
                pages: Vec::with_capacity(filled_pages),
                free: Vec::new(),
            },
        };
        for (bucket, word) in words.iter().enumerate().filter(|(_, word)| **word != 0) {
            mirror.set(bucket, *word);
        }
        mirror
    }

    /// Most pages this mirror allocates while sparse ([`pages_max`]).
    #[must_use]
    pub fn pages_max(&self) -> usize {
        pages_max(self.bucket_count)
    }

    /// Buckets mirrored.
    #[must_use]
    pub fn bucket_count(&self) -> usize {
        self.bucket_count
    }

    /// Whether the words are kept sparse.
    #[must_use]
    pub fn is_sparse(&self) -> bool {
        matches!(self.repr, Repr::Sparse { .. })
    }

    /// The word of `bucket`, `None` past the last bucket.
    #[must_use]
    pub fn get(&self, bucket: usize) -> Option<u64> {
        if bucket >= self.bucket_count {
            return None;
        }
        Some(match &self.repr {
            Repr::Sparse { index, pages, .. } => match index[bucket / PAGE_WORDS] {
                NO_PAGE => 0,
                page => pages[page as usize][bucket % PAGE_WORDS],
            },
            Repr::Dense(words) => words[bucket],
        })
    }

    /// Set the word of `bucket`; `false` (and nothing changed) past the last bucket.
    pub fn set(&mut self, bucket: usize, word: u64) -> bool {
        if bucket >= self.bucket_count {
            return false;
        }
        let pages_max = self.pages_max();
        let (slot, offset) = (bucket / PAGE_WORDS, bucket % PAGE_WORDS);
        match &mut self.repr {
            Repr::Dense(words) => words[bucket] = word,
            Repr::Sparse { index, pages, free } => match index[slot] {
                NO_PAGE if word == 0 => {}
                NO_PAGE => {
                    if pages.len() - free.len() >= pages_max {
                        let mut words = self.to_dense();
                        words[bucket] = word;
                        self.repr = Repr::Dense(words);
                        return true;
                    }
                    let page = match free.pop() {
                        Some(page) => page,
                        None => {
                            pages.push([0; PAGE_WORDS]);
                            // `pages_max` keeps the count within the index's range.
                            u32::try_from(pages.len() - 1).expect("at most pages_max pages")
                        }
                    };
                    pages[page as usize][offset] = word;
                    index[slot] = page;
                }
                page => {
                    let words = &mut pages[page as usize];
                    words[offset] = word;
                    if word == 0 && words.iter().all(|word| *word == 0) {
                        index[slot] = NO_PAGE;
                        free.push(page);
                    }
                }
            },
        }
        true
    }

    /// Every bucket's word, in bucket order.
    #[must_use]
    pub fn to_dense(&self) -> Vec<u64> {
        match &self.repr {
            Repr::Dense(words) => words.clone(),
            Repr::Sparse { index, pages, .. } => {
                let mut words = vec![0; self.bucket_count];
                for (chunk, &page) in words.chunks_mut(PAGE_WORDS).zip(index) {
                    if page != NO_PAGE {
                        chunk.copy_from_slice(&pages[page as usize][..chunk.len()]);
                    }
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
            Repr::Sparse { .. } => None,
        }
    }

    /// Check the invariants of the module doc.
    pub fn check_invariants(&self) -> Result<(), String> {
        let (index, pages, free) = match &self.repr {
            Repr::Dense(words) if words.len() != self.bucket_count => {
                return Err(format!(
                    "dense mirror of {} words for {} buckets",
                    words.len(),
                    self.bucket_count
                ));
            }
            Repr::Dense(_) => return Ok(()),
            Repr::Sparse { index, pages, free } => (index, pages, free),
        };
        if index.len() != self.bucket_count.div_ceil(PAGE_WORDS) {
            return Err(format!(
                "index of {} pages for {} buckets",
                index.len(),
                self.bucket_count
            ));
        }
        if pages.len() - free.len() > self.pages_max() {
            return Err(format!("{} pages in use past the bound", pages.len() - free.len()));
        }
        let mut owner = vec![false; pages.len()];
        for &page in free {
            let Some(seen) = owner.get_mut(page as usize) else {
                return Err(format!("free page {page} does not exist"));
            };
            if *seen || pages[page as usize].iter().any(|word| *word != 0) {
                return Err(format!("free page {page} is listed twice or holds a word"));
            }
            *seen = true;
        }
        for (slot, &page) in index.iter().enumerate().filter(|(_, page)| **page != NO_PAGE) {
            let Some(seen) = owner.get_mut(page as usize) else {
                return Err(format!("index slot {slot} names page {page}, which does not exist"));
            };
            if *seen || pages[page as usize].iter().all(|word| *word == 0) {
                return Err(format!("index slot {slot} names page {page}: shared, free or empty"));
            }
            *seen = true;
        }
        Ok(())
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
        // 1,000 buckets: the last page is partial.
        let dense = words(1000, &[(0, 1), (511, 0xabcd), (999, u64::MAX)]);
        let mirror = MirrorWords::from_dense(dense.clone());
        assert!(mirror.is_sparse());
        assert_eq!(mirror.bucket_count(), 1000);
        assert_eq!(mirror.to_dense(), dense);
        assert_eq!(mirror.get(511), Some(0xabcd));
        assert_eq!(mirror.get(512), Some(0));
        assert_eq!(mirror.get(1000), None, "past the last bucket");
        mirror.check_invariants().unwrap();
    }

    #[test]
    fn an_emptied_page_is_freed_and_reused() {
        let mut mirror = MirrorWords::from_dense(vec![0; 1024]);
        assert!(mirror.set(7, 0x7));
        assert!(mirror.set(8, 0x8));
        assert!(mirror.set(7, 0));
        assert!(mirror.set(8, 0), "the page is empty now");
        let Repr::Sparse { index, free, .. } = &mirror.repr else { panic!("sparse") };
        assert_eq!((index[0], free.as_slice()), (NO_PAGE, &[0][..]));
        assert!(mirror.set(1000, 0x9), "another page takes the freed one");
        assert!(!mirror.set(1024, 1), "past the end");
        let Repr::Sparse { pages, free, .. } = &mirror.repr else { panic!("sparse") };
        assert_eq!((pages.len(), free.len()), (1, 0));
        assert_eq!(mirror.to_dense(), words(1024, &[(1000, 0x9)]));
        mirror.check_invariants().unwrap();
    }

    #[test]
    fn a_mirror_turns_dense_past_its_bound_and_keeps_every_word() {
        let mut mirror = MirrorWords::from_dense(vec![0; 1024]);
        let bound = mirror.pages_max();
        assert_eq!(bound, 32);
        for page in 0..bound {
            mirror.set(page * PAGE_WORDS, page as u64 + 1);
        }
        assert!(mirror.is_sparse(), "at the bound");
        mirror.check_invariants().unwrap();
        mirror.set(bound * PAGE_WORDS + 3, 0xfeed);
        assert!(!mirror.is_sparse(), "past it");
        assert_eq!(mirror.as_dense().map(<[u64]>::len), Some(1024));
        let mut expected = vec![0; 1024];
        for page in 0..bound {
            expected[page * PAGE_WORDS] = page as u64 + 1;
        }
        expected[bound * PAGE_WORDS + 3] = 0xfeed;
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
    fn random_writes_read_back_like_a_dense_array() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut mirror = MirrorWords::from_dense(vec![0; 4096]);
        let mut truth = vec![0u64; 4096];
        for step in 0..20_000 {
            let bucket = (next() % 4096) as usize;
            let word = if next() % 3 == 0 { 0 } else { next() };
            mirror.set(bucket, word);
            truth[bucket] = word;
            if step % 997 == 0 {
                mirror.check_invariants().unwrap();
                assert_eq!(mirror.to_dense(), truth);
            }
        }
        assert_eq!(mirror.to_dense(), truth);
    }

    #[test]
    fn the_invariant_check_names_a_broken_mirror() {
        let mut empty_page = MirrorWords::from_dense(words(64, &[(3, 1)]));
        if let Repr::Sparse { pages, .. } = &mut empty_page.repr {
            pages[0][3] = 0;
        }
        assert!(empty_page.check_invariants().unwrap_err().contains("names page 0"));
        let mut dirty_free = MirrorWords::from_dense(vec![0; 64]);
        if let Repr::Sparse { pages, free, .. } = &mut dirty_free.repr {
            pages.push([1; PAGE_WORDS]);
            free.push(0);
        }
        assert!(dirty_free.check_invariants().unwrap_err().contains("free page 0"));
        let short = MirrorWords { bucket_count: 64, repr: Repr::Dense(vec![0; 63]) };
        assert!(short.check_invariants().unwrap_err().contains("63 words"));
    }
}
