//! Numbering publication batches under a lease (relay-facts §7.1–7.2), sans-IO.
//!
//! The publisher owns the pool's publication sequence. Invariants:
//! - the sequence advances by exactly one per delta actually handed to the sink, and only while a
//!   lease is held; without a lease nothing is materialised and the sequence stands still;
//! - a delta is never empty: a batch is cut only when some bucket word really changed;
//! - once fenced, nothing is published until a barrier snapshot installs a new lease; a fence
//!   for sequence exhaustion is permanent (the producer needs a new generation);
//! - a barrier snapshot has sequence `S` equal to the last published delta, so the first delta
//!   after it is exactly `S → S + 1`.

use thiserror::Error;

use super::ownership::PoolOwnership;
use crate::filter::ckf::BucketImage;
use crate::model::identity::LaneLease;

/// Default number of applied events that forces a publication.
pub const PUBLICATION_THRESHOLD_EVENTS: u32 = 16;
/// Default delay after the first pending event before a publication.
pub const PUBLICATION_DELAY_MS: u64 = 1;

/// Why a publisher stopped publishing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceReason {
    /// The sequence reached `u64::MAX`.
    SequenceExhausted,
    /// A delta could not be handed over; whether a consumer saw it is unknown.
    DeliveryUncertain,
    /// The lease holder stopped making progress.
    LeaseStalled,
}

/// A publication batch: absolute images of every bucket that changed, `base → sequence`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// The lease it was published under.
    pub lease: LaneLease,
    /// Sequence the consumer must be at.
    pub base_sequence: u64,
    /// `base_sequence + 1`.
    pub sequence: u64,
    /// Changed buckets, sorted, never empty.
    pub images: Vec<BucketImage>,
}

/// A full copy of the filter at a publication barrier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The lease installed by the barrier.
    pub lease: LaneLease,
    /// The last published sequence; the next delta has base `sequence`.
    pub sequence: u64,
    /// Every bucket word.
    pub words: Vec<u64>,
}

/// What a publication attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishOutcome {
    /// A delta with this sequence went to the sink.
    Published {
        /// The delta's sequence.
        sequence: u64,
    },
    /// Some buckets were written but every one returned to its published word.
    NothingChanged,
    /// No lease is held: nothing was materialised and the sequence did not advance.
    NoSubscriber {
        /// The unchanged last sequence.
        sequence: u64,
    },
}

/// Why a publication or a barrier snapshot failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PublishError {
    /// The publisher is fenced.
    #[error("publisher is fenced: {0:?}")]
    Fenced(FenceReason),
    /// The sink refused the delta; the publisher is now fenced for uncertain delivery.
    #[error("the delta could not be delivered")]
    DeliveryFailed,
    /// The sequence cannot advance; the producer needs a new generation.
    #[error("publication sequence exhausted")]
    SequenceExhausted,
    /// The snapshot copy could not be allocated; nothing changed.
    #[error("could not allocate the snapshot copy")]
    AllocationFailed,
}

/// The publication state of one producer generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Publisher {
    lease: Option<LaneLease>,
    last_sequence: u64,
    fence: Option<FenceReason>,
}

impl Publisher {
    /// A publisher at sequence 0 with no lease.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A publisher resuming at `last_sequence` (tests of the exhaustion path).
    #[must_use]
    pub fn starting_at(last_sequence: u64) -> Self {
        Publisher { lease: None, last_sequence, fence: None }
    }

    /// The last published sequence.
    #[must_use]
    pub fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// The lease currently held.
    #[must_use]
    pub fn lease(&self) -> Option<LaneLease> {
        self.lease
    }

    /// Why the publisher is fenced, if it is.
    #[must_use]
    pub fn fence_reason(&self) -> Option<FenceReason> {
        self.fence
    }

    /// Drop the lease if it is the current one; returns whether it was.
    pub fn retire_lease(&mut self, lease: LaneLease) -> bool {
        if self.lease == Some(lease) {
            self.lease = None;
            return true;
        }
        false
    }

    /// `(lease, sequence)` a consumer that has drained every delta must have reached.
    #[must_use]
    pub fn exact_drain_marker(&self) -> Option<(LaneLease, u64)> {
        self.lease.map(|lease| (lease, self.last_sequence))
    }

    /// Cut a batch from the pool's unpublished writes and hand it to `sink`.
    ///
    /// `sink` returns the delta back when it cannot take it; the publisher is then fenced for
    /// uncertain delivery and the sequence does not advance.
    pub fn publish(
        &mut self,
        pool: &mut PoolOwnership,
        sink: &mut impl FnMut(Delta) -> Result<(), Delta>,
    ) -> Result<PublishOutcome, PublishError> {
        if let Some(reason) = self.fence {
            return Err(PublishError::Fenced(reason));
        }
        let Some(lease) = self.lease else {
            pool.discard_publication();
            return Ok(PublishOutcome::NoSubscriber { sequence: self.last_sequence });
        };
        let images = pool.take_publication();
        if images.is_empty() {
            return Ok(PublishOutcome::NothingChanged);
        }
        let Some(sequence) = self.last_sequence.checked_add(1) else {
            self.fence = Some(FenceReason::SequenceExhausted);
            return Err(PublishError::SequenceExhausted);
        };
        let delta = Delta { lease, base_sequence: self.last_sequence, sequence, images };
        if sink(delta).is_err() {
            self.fence = Some(FenceReason::DeliveryUncertain);
            return Err(PublishError::DeliveryFailed);
        }
        self.last_sequence = sequence;
        Ok(PublishOutcome::Published { sequence })
    }

    /// Copy the filter at a barrier and install `new_lease`.
    ///
    /// Unpublished writes are first published under the old lease when the publisher is healthy
    /// (an error propagates and the caller may retry; the retried snapshot then covers them);
    /// when fenced they are folded into the snapshot. The copy is allocated before anything is
    /// drained, so an allocation failure changes nothing.
    pub fn snapshot_after_barrier(
        &mut self,
        pool: &mut PoolOwnership,
        new_lease: LaneLease,
        sink: &mut impl FnMut(Delta) -> Result<(), Delta>,
    ) -> Result<Snapshot, PublishError> {
        // Also when not fenced: a snapshot at the last sequence could never be followed.
        if self.last_sequence == u64::MAX {
            return Err(PublishError::SequenceExhausted);
        }
        let source = pool.filter().words();
        let mut words = Vec::new();
        if words.try_reserve_exact(source.len()).is_err() {
            return Err(PublishError::AllocationFailed);
        }
        words.extend_from_slice(source);
        if self.fence.is_none() {
            self.publish(pool, sink)?;
        } else {
            pool.discard_publication();
        }
        self.lease = Some(new_lease);
        self.fence = None;
        Ok(Snapshot { lease: new_lease, sequence: self.last_sequence, words })
    }
}

/// Counts applied events toward the publication threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublicationCadence {
    threshold_events: u32,
    pending_events: u32,
}

impl PublicationCadence {
    /// A cadence that is due after `threshold_events` events (at least 1).
    #[must_use]
    pub fn new(threshold_events: u32) -> Self {
        PublicationCadence { threshold_events: threshold_events.max(1), pending_events: 0 }
    }

    /// Count one applied event; returns whether a publication is due now.
    pub fn record_event(&mut self) -> bool {
        self.pending_events = self.pending_events.saturating_add(1);
        self.pending_events >= self.threshold_events
    }

    /// A publication happened: nothing is pending.
    pub fn reset(&mut self) {
        self.pending_events = 0;
    }
}

impl Default for PublicationCadence {
    fn default() -> Self {
        Self::new(PUBLICATION_THRESHOLD_EVENTS)
    }
}

#[cfg(test)]
#[path = "publisher_tests.rs"]
mod tests;
