//! One pool's filter replica on the consumer side (relay-facts §3.6, §3.9, §5.5).
//!
//! States: assembling a snapshot, then ready at a sequence. Invariants:
//! - no word is readable until a whole snapshot has been validated and installed;
//! - once ready, only a delta with `base == sequence` and `sequence == base + 1` changes the
//!   words, and a heartbeat must name the current sequence;
//! - any fault leaves the replica invalid: it answers no query and accepts no frame until it is
//!   rebuilt from a fresh subscription (the fault never spreads to other pools).

use thiserror::Error;

use crate::filter::cbi1::{self, AssemblyError, DecodeError, SnapshotAssembler};
use crate::filter::ckf::{Addressing, CkfFormat, Probe, word_contains};
use crate::model::hashing::SequenceHash;

/// Hashes of a prefix query probed together by [`FilterReplica::longest_prefix`]: a chunk's
/// prefetches are all in flight before its first bucket is read.
pub const PREFIX_PROBE_CHUNK: usize = 16;

/// One frame of a pool stream, as the transport hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterFrame<'a> {
    /// A CBI1 snapshot chunk; `base_sequence == sequence == S` for every chunk.
    SnapshotChunk {
        /// Envelope base sequence.
        base_sequence: u64,
        /// Envelope sequence.
        sequence: u64,
        /// The CBI1 frame.
        payload: &'a [u8],
    },
    /// A CBI1 delta `base_sequence → sequence`.
    Delta {
        /// Envelope base sequence.
        base_sequence: u64,
        /// Envelope sequence.
        sequence: u64,
        /// The CBI1 frame.
        payload: &'a [u8],
    },
    /// A keep-alive naming the current sequence.
    Heartbeat {
        /// Envelope base sequence.
        base_sequence: u64,
        /// Envelope sequence.
        sequence: u64,
    },
}

/// Why a replica was invalidated.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReplicaFault {
    /// The CBI1 frame failed validation.
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    /// Snapshot chunks did not assemble.
    #[error("snapshot assembly failed: {0}")]
    Assembly(#[from] AssemblyError),
    /// Envelope and CBI1 header disagree on kind or sequence.
    #[error("envelope and payload disagree: {0}")]
    EnvelopeMismatch(&'static str),
    /// A delta or heartbeat arrived before the snapshot completed.
    #[error("{0} before the snapshot completed")]
    NotReady(&'static str),
    /// A snapshot chunk arrived while ready.
    #[error("snapshot chunk while ready")]
    SnapshotWhileReady,
    /// A delta's base is not the replica's sequence.
    #[error("delta base {base} does not follow sequence {current}")]
    NonContiguous {
        /// The replica's sequence.
        current: u64,
        /// The delta's base.
        base: u64,
    },
    /// A delta carried no image (the producer never sends one).
    #[error("empty delta")]
    EmptyDelta,
    /// A delta named one bucket twice.
    #[error("bucket {0} appears twice in one delta")]
    DuplicateImage(u32),
    /// A heartbeat named another sequence.
    #[error("heartbeat at {heartbeat} while at {current}")]
    HeartbeatMismatch {
        /// The replica's sequence.
        current: u64,
        /// The heartbeat's sequence.
        heartbeat: u64,
    },
    /// The replica was already invalid.
    #[error("replica is invalid")]
    Invalid,
}

/// What accepting a frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaProgress {
    /// A chunk was accepted; the snapshot is not complete yet.
    Assembling,
    /// The snapshot completed; the replica is ready at this sequence.
    Installed {
        /// The snapshot sequence.
        sequence: u64,
    },
    /// A delta was applied.
    Applied {
        /// The new sequence.
        sequence: u64,
    },
    /// A heartbeat confirmed the sequence.
    Confirmed,
}

#[derive(Debug)]
enum State {
    Assembling(SnapshotAssembler),
    /// `touched` has one bit per bucket, all clear between deltas: a delta marks the buckets it
    /// writes to find a duplicate image before it writes any word.
    Ready {
        words: Vec<u64>,
        sequence: u64,
        touched: Vec<u64>,
    },
    Invalid,
}

/// A consumer's copy of one producer generation's filter.
#[derive(Debug)]
pub struct FilterReplica {
    format: CkfFormat,
    addressing: Addressing,
    dc_id: u64,
    state: State,
}

impl FilterReplica {
    /// A replica expecting a snapshot of `format` from the pool of `dc_id`. The format must be
    /// valid (it comes from a validated catalog descriptor).
    pub fn new(format: CkfFormat, dc_id: u64) -> Result<Self, crate::filter::ckf::CkfFormatError> {
        format.validate()?;
        Ok(FilterReplica {
            addressing: Addressing::new(&format),
            format,
            dc_id,
            state: State::Assembling(SnapshotAssembler::new()),
        })
    }

    /// The sequence the replica is at, once ready.
    #[must_use]
    pub fn sequence(&self) -> Option<u64> {
        match self.state {
            State::Ready { sequence, .. } => Some(sequence),
            _ => None,
        }
    }

    /// The words, once ready.
    #[must_use]
    pub fn words(&self) -> Option<&[u64]> {
        match &self.state {
            State::Ready { words, .. } => Some(words),
            _ => None,
        }
    }

    /// Whether a fault invalidated the replica.
    #[must_use]
    pub fn is_invalid(&self) -> bool {
        matches!(self.state, State::Invalid)
    }

    /// Accept one frame; any error invalidates the replica.
    pub fn accept(&mut self, frame: FilterFrame<'_>) -> Result<ReplicaProgress, ReplicaFault> {
        let result = self.accept_inner(frame);
        if result.is_err() {
            self.state = State::Invalid;
        }
        result
    }

    fn accept_inner(&mut self, frame: FilterFrame<'_>) -> Result<ReplicaProgress, ReplicaFault> {
        match frame {
            FilterFrame::SnapshotChunk { base_sequence, sequence, payload } => {
                let State::Assembling(assembler) = &mut self.state else {
                    return Err(match self.state {
                        State::Invalid => ReplicaFault::Invalid,
                        _ => ReplicaFault::SnapshotWhileReady,
                    });
                };
                if base_sequence != sequence {
                    return Err(ReplicaFault::EnvelopeMismatch(
                        "snapshot chunk with base != sequence",
                    ));
                }
                let cbi1::Frame::SnapshotChunk(chunk) =
                    cbi1::decode_for_pool(payload, &self.format, self.dc_id)?
                else {
                    return Err(ReplicaFault::EnvelopeMismatch("snapshot envelope holds a delta"));
                };
                if chunk.header().epoch != sequence {
                    return Err(ReplicaFault::EnvelopeMismatch(
                        "chunk epoch differs from sequence",
                    ));
                }
                match assembler.accept(&chunk)? {
                    None => Ok(ReplicaProgress::Assembling),
                    Some(snapshot) => {
                        let sequence = snapshot.epoch();
                        let words = snapshot.into_words();
                        let touched = vec![0; words.len().div_ceil(64)];
                        self.state = State::Ready { words, sequence, touched };
                        Ok(ReplicaProgress::Installed { sequence })
                    }
                }
            }
            FilterFrame::Delta { base_sequence, sequence, payload } => {
                let State::Ready { words, sequence: current, touched } = &mut self.state else {
                    return Err(self.not_ready("delta"));
                };
                if base_sequence != *current {
                    return Err(ReplicaFault::NonContiguous {
                        current: *current,
                        base: base_sequence,
                    });
                }
                if current.checked_add(1) != Some(sequence) {
                    return Err(ReplicaFault::EnvelopeMismatch("delta sequence is not base + 1"));
                }
                let cbi1::Frame::Delta(delta) =
                    cbi1::decode_for_pool(payload, &self.format, self.dc_id)?
                else {
                    return Err(ReplicaFault::EnvelopeMismatch("delta envelope holds a chunk"));
                };
                if delta.base_epoch() != base_sequence || delta.header().epoch != sequence {
                    return Err(ReplicaFault::EnvelopeMismatch(
                        "delta epochs differ from envelope",
                    ));
                }
                if delta.image_count() == 0 {
                    return Err(ReplicaFault::EmptyDelta);
                }
                // Validate every image before writing any, so a fault leaves no half-applied delta
                // (the replica is discarded anyway, but readers never see a torn state).
                // (A fault leaves `touched` dirty, but it also invalidates the replica.)
                for image in delta.images() {
                    let (index, bit) = (image.bucket as usize / 64, 1u64 << (image.bucket % 64));
                    if touched[index] & bit != 0 {
                        return Err(ReplicaFault::DuplicateImage(image.bucket));
                    }
                    touched[index] |= bit;
                }
                for image in delta.images() {
                    words[image.bucket as usize] = image.word;
                    touched[image.bucket as usize / 64] = 0;
                }
                *current = sequence;
                Ok(ReplicaProgress::Applied { sequence })
            }
            FilterFrame::Heartbeat { base_sequence, sequence } => {
                let State::Ready { sequence: current, .. } = &self.state else {
                    return Err(self.not_ready("heartbeat"));
                };
                if base_sequence != *current || sequence != *current {
                    return Err(ReplicaFault::HeartbeatMismatch {
                        current: *current,
                        heartbeat: sequence,
                    });
                }
                Ok(ReplicaProgress::Confirmed)
            }
        }
    }

    fn not_ready(&self, what: &'static str) -> ReplicaFault {
        match self.state {
            State::Invalid => ReplicaFault::Invalid,
            _ => ReplicaFault::NotReady(what),
        }
    }

    /// Whether the filter may hold `hash` (false positives possible); `None` until ready.
    #[must_use]
    pub fn contains(&self, hash: SequenceHash) -> Option<bool> {
        let words = self.words()?;
        Some(holds(words, self.addressing.probe(hash.0)))
    }

    /// Number of leading hashes the filter may hold: the longest matching prefix in blocks.
    /// `None` until ready.
    ///
    /// The hashes are probed [`PREFIX_PROBE_CHUNK`] at a time: the home bucket of every hash of
    /// a chunk is prefetched before the first is read, so that a large replica's cache misses
    /// overlap instead of following one another (the alternate bucket is read only when the
    /// home bucket lacks the fingerprint; prefetching it too cost more than it saved). The
    /// answer is the one probing each hash in turn gives.
    #[must_use]
    pub fn longest_prefix(&self, hashes: &[SequenceHash]) -> Option<usize> {
        let words = self.words()?;
        let mut matched = 0;
        for chunk in hashes.chunks(PREFIX_PROBE_CHUNK) {
            // Placeholders past the chunk's length are never read.
            let mut probes =
                [Probe { fingerprint: 1, bucket_a: 0, bucket_b: 1 }; PREFIX_PROBE_CHUNK];
            for (probe, hash) in probes.iter_mut().zip(chunk) {
                *probe = self.addressing.probe(hash.0);
                kvrelay_prefetch::prefetch(words, probe.bucket_a as usize);
            }
            for &probe in &probes[..chunk.len()] {
                if !holds(words, probe) {
                    return Some(matched);
                }
                matched += 1;
            }
        }
        Some(matched)
    }
}

/// Whether either candidate bucket of `probe` in `words` holds its fingerprint.
#[inline]
fn holds(words: &[u64], probe: Probe) -> bool {
    word_contains(words[probe.bucket_a as usize], probe.fingerprint)
        || word_contains(words[probe.bucket_b as usize], probe.fingerprint)
}

#[cfg(test)]
#[path = "replica_tests.rs"]
mod tests;
