//! Coalescing of one endpoint's pending pool faults (relay-facts §9.6, §4.5).
//!
//! A pool reports faults it cannot handle itself: a source that broke the protocol, a
//! rank whose state could not be allocated, or a producer whose exact state and filter
//! disagree. The host works through source faults one recovery call at a time, and while a call
//! is in flight more faults arrive. [`PendingPoolFaults`] holds them in a bounded set:
//!
//! - one entry per source `(worker_id, dp_rank)`, at most [`PENDING_SOURCE_FAULTS_MAX`];
//! - a fault for a source already pending coalesces: a newer source epoch replaces the entry
//!   (whatever its action), the same epoch keeps the stronger action (`RejectSource` beats
//!   `ReportResourceFailure`), an older epoch is stale and dropped;
//! - capacity omissions are not faults to act on and are ignored;
//! - a `FenceAndRebuildProducer` fault, or a distinct source fault that would exceed the bound,
//!   installs one producer-fence trigger. The trigger supersedes every source fault: pending
//!   ones are cleared, and new ones are ignored while it is installed, because rebuilding the
//!   producer in a new generation recovers every source anyway.
//!
//! Source faults are handed out oldest first (by first arrival; coalescing keeps a fault's
//! place), which is deterministic and keeps one noisy source from starving the others.

use std::collections::BTreeMap;

use crate::model::kv_events::SourceKey;
use crate::pool::FailureDisposition;

/// Most distinct sources with a pending fault per endpoint; one more fences the producer.
pub const PENDING_SOURCE_FAULTS_MAX: usize = 16;

/// What a pool asks the host to do about a failed event (the §4.5 actions a pool reports).
///
/// The declaration order is the strength order of the source-level actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolFaultAction {
    /// The filter had no room for a block; the mapping is kept without residency. Nothing to do.
    ContinueCapacityOmission,
    /// A resource (memory) failure on a rank: recover that rank.
    ReportResourceFailure,
    /// The source broke the protocol: reject it (the rank is then recovered).
    RejectSource,
    /// The producer's exact state is inconsistent: fence it and rebuild in a new generation.
    FenceAndRebuildProducer,
}

impl From<FailureDisposition> for PoolFaultAction {
    fn from(disposition: FailureDisposition) -> Self {
        match disposition {
            FailureDisposition::ReportResourceFailure => PoolFaultAction::ReportResourceFailure,
            FailureDisposition::RejectSource => PoolFaultAction::RejectSource,
            FailureDisposition::FenceAndRebuildProducer => PoolFaultAction::FenceAndRebuildProducer,
        }
    }
}

/// One fault a pool reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolFaultReport {
    /// The source whose event failed.
    pub source: SourceKey,
    /// The source epoch the event belonged to (higher = newer incarnation of the source).
    pub source_epoch: u64,
    /// What the pool asks for.
    pub action: PoolFaultAction,
}

/// A rank-level action the host asks the recovery client to take.
///
/// Ordered by strength: `RejectSource` beats `ReportResourceFailure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SourceFaultAction {
    /// `handle_target_fault(worker, rank, epoch)`: recover the rank after a resource failure.
    ReportResourceFailure,
    /// `reject_source(worker, rank, epoch)`: reject the source's current incarnation.
    RejectSource,
}

/// One coalesced source fault, ready for a recovery call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceFault {
    /// The faulty source.
    pub source: SourceKey,
    /// The newest epoch a fault was reported for.
    pub source_epoch: u64,
    /// The strongest action reported for that epoch.
    pub action: SourceFaultAction,
}

/// Why the producer must be fenced and rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerFenceCause {
    /// A pool reported `FenceAndRebuildProducer` for this fault.
    InvariantViolation {
        /// The source whose event exposed the inconsistency.
        source: SourceKey,
        /// Its epoch.
        source_epoch: u64,
    },
    /// More than [`PENDING_SOURCE_FAULTS_MAX`] distinct sources had pending faults.
    SourceFaultOverflow,
}

/// What [`PendingPoolFaults::push`] did with a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAdmission {
    /// A capacity omission: nothing to act on.
    IgnoredCapacityOmission,
    /// Older than the epoch already pending for its source.
    IgnoredStale,
    /// A producer fence is installed; it covers this source.
    IgnoredSuperseded,
    /// A new pending source fault.
    Queued,
    /// Merged into the source's pending fault (which may now carry a newer epoch or a stronger
    /// action).
    Coalesced,
    /// A producer fence is now installed (every pending source fault was cleared).
    ProducerFenceInstalled(ProducerFenceCause),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    /// Arrival order of the source's first pending fault.
    arrival: u64,
    source_epoch: u64,
    action: SourceFaultAction,
}

/// The bounded set of one endpoint's pending pool faults. See the module docs.
///
/// Invariants: at most [`PENDING_SOURCE_FAULTS_MAX`] pending source faults; no source fault is
/// pending while a producer fence is installed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingPoolFaults {
    sources: BTreeMap<SourceKey, Pending>,
    producer_fence: Option<ProducerFenceCause>,
    arrival_next: u64,
}

impl PendingPoolFaults {
    /// No pending faults.
    #[must_use]
    pub fn new() -> Self {
        PendingPoolFaults::default()
    }

    /// Admit one reported fault.
    pub fn push(&mut self, fault: PoolFaultReport) -> FaultAdmission {
        let action = match fault.action {
            PoolFaultAction::ContinueCapacityOmission => {
                return FaultAdmission::IgnoredCapacityOmission;
            }
            PoolFaultAction::FenceAndRebuildProducer => {
                if self.producer_fence.is_some() {
                    return FaultAdmission::IgnoredSuperseded;
                }
                return self.install_fence(ProducerFenceCause::InvariantViolation {
                    source: fault.source,
                    source_epoch: fault.source_epoch,
                });
            }
            PoolFaultAction::ReportResourceFailure => SourceFaultAction::ReportResourceFailure,
            PoolFaultAction::RejectSource => SourceFaultAction::RejectSource,
        };
        if self.producer_fence.is_some() {
            return FaultAdmission::IgnoredSuperseded;
        }
        if let Some(pending) = self.sources.get_mut(&fault.source) {
            if fault.source_epoch < pending.source_epoch {
                return FaultAdmission::IgnoredStale;
            }
            if fault.source_epoch > pending.source_epoch {
                pending.source_epoch = fault.source_epoch;
                pending.action = action;
            } else {
                pending.action = pending.action.max(action);
            }
            return FaultAdmission::Coalesced;
        }
        if self.sources.len() >= PENDING_SOURCE_FAULTS_MAX {
            return self.install_fence(ProducerFenceCause::SourceFaultOverflow);
        }
        let arrival = self.arrival_next;
        self.arrival_next = self.arrival_next.saturating_add(1);
        self.sources
            .insert(fault.source, Pending { arrival, source_epoch: fault.source_epoch, action });
        debug_assert!(self.sources.len() <= PENDING_SOURCE_FAULTS_MAX);
        FaultAdmission::Queued
    }

    /// The installed producer-fence trigger, if any.
    #[must_use]
    pub fn producer_fence(&self) -> Option<ProducerFenceCause> {
        self.producer_fence
    }

    /// Take the producer-fence trigger (the host is about to fence the producer), leaving the
    /// set empty.
    pub fn take_producer_fence(&mut self) -> Option<ProducerFenceCause> {
        self.producer_fence.take()
    }

    /// Take the oldest pending source fault. None while a producer fence is installed.
    pub fn pop_source_fault(&mut self) -> Option<SourceFault> {
        if self.producer_fence.is_some() {
            return None;
        }
        let (&source, _) = self.sources.iter().min_by_key(|(_, pending)| pending.arrival)?;
        let pending = self.sources.remove(&source)?;
        Some(SourceFault { source, source_epoch: pending.source_epoch, action: pending.action })
    }

    /// Number of pending source faults.
    #[must_use]
    pub fn source_fault_count(&self) -> usize {
        self.sources.len()
    }

    /// True if nothing is pending.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty() && self.producer_fence.is_none()
    }

    /// Forget everything (the producer generation these faults belonged to is gone).
    pub fn clear(&mut self) {
        self.sources.clear();
        self.producer_fence = None;
    }

    fn install_fence(&mut self, cause: ProducerFenceCause) -> FaultAdmission {
        self.sources.clear();
        self.producer_fence = Some(cause);
        FaultAdmission::ProducerFenceInstalled(cause)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(worker_id: u64, dp_rank: u32) -> SourceKey {
        SourceKey { worker_id, dp_rank }
    }

    fn fault(worker_id: u64, source_epoch: u64, action: PoolFaultAction) -> PoolFaultReport {
        PoolFaultReport { source: source(worker_id, 0), source_epoch, action }
    }

    fn drain(faults: &mut PendingPoolFaults) -> Vec<SourceFault> {
        std::iter::from_fn(|| faults.pop_source_fault()).collect()
    }

    #[test]
    fn newer_source_epoch_wins_even_with_a_weaker_action() {
        let mut faults = PendingPoolFaults::new();
        assert_eq!(faults.push(fault(1, 4, PoolFaultAction::RejectSource)), FaultAdmission::Queued);
        assert_eq!(
            faults.push(fault(1, 5, PoolFaultAction::ReportResourceFailure)),
            FaultAdmission::Coalesced
        );
        // An older epoch is stale, however strong.
        assert_eq!(
            faults.push(fault(1, 3, PoolFaultAction::RejectSource)),
            FaultAdmission::IgnoredStale
        );
        assert_eq!(
            drain(&mut faults),
            vec![SourceFault {
                source: source(1, 0),
                source_epoch: 5,
                action: SourceFaultAction::ReportResourceFailure,
            }]
        );
    }

    #[test]
    fn empty_means_no_source_fault_and_no_fence_and_clear_forgets_both() {
        let mut faults = PendingPoolFaults::new();
        assert!(faults.is_empty());
        let _ = faults.push(fault(1, 2, PoolFaultAction::RejectSource));
        assert!(!faults.is_empty(), "a pending source fault");
        faults.clear();
        assert!(faults.is_empty());
        assert_eq!(faults.pop_source_fault(), None);
        let _ = faults.push(fault(1, 2, PoolFaultAction::FenceAndRebuildProducer));
        assert_eq!(faults.source_fault_count(), 0);
        assert!(!faults.is_empty(), "an installed producer fence");
        faults.clear();
        assert!(faults.is_empty());
        assert_eq!(faults.producer_fence(), None);
    }

    #[test]
    fn same_epoch_keeps_the_stronger_action() {
        let mut faults = PendingPoolFaults::new();
        let _ = faults.push(fault(1, 2, PoolFaultAction::ReportResourceFailure));
        let _ = faults.push(fault(1, 2, PoolFaultAction::RejectSource));
        let _ = faults.push(fault(1, 2, PoolFaultAction::ReportResourceFailure));
        assert_eq!(faults.source_fault_count(), 1);
        assert_eq!(
            drain(&mut faults),
            vec![SourceFault {
                source: source(1, 0),
                source_epoch: 2,
                action: SourceFaultAction::RejectSource,
            }]
        );
    }

    #[test]
    fn capacity_omissions_are_ignored() {
        let mut faults = PendingPoolFaults::new();
        assert_eq!(
            faults.push(fault(1, 1, PoolFaultAction::ContinueCapacityOmission)),
            FaultAdmission::IgnoredCapacityOmission
        );
        assert!(faults.is_empty());
    }

    #[test]
    fn producer_fence_supersedes_and_clears_pending_source_faults() {
        let mut faults = PendingPoolFaults::new();
        let _ = faults.push(fault(1, 1, PoolFaultAction::RejectSource));
        let _ = faults.push(fault(2, 1, PoolFaultAction::ReportResourceFailure));
        let cause =
            ProducerFenceCause::InvariantViolation { source: source(3, 0), source_epoch: 7 };
        assert_eq!(
            faults.push(fault(3, 7, PoolFaultAction::FenceAndRebuildProducer)),
            FaultAdmission::ProducerFenceInstalled(cause)
        );
        assert_eq!(faults.source_fault_count(), 0);
        // Later source faults and fences are covered by the installed trigger.
        assert_eq!(
            faults.push(fault(4, 1, PoolFaultAction::RejectSource)),
            FaultAdmission::IgnoredSuperseded
        );
        assert_eq!(
            faults.push(fault(5, 1, PoolFaultAction::FenceAndRebuildProducer)),
            FaultAdmission::IgnoredSuperseded
        );
        assert_eq!(faults.pop_source_fault(), None);
        assert_eq!(faults.take_producer_fence(), Some(cause));
        assert!(faults.is_empty());
    }

    #[test]
    fn overflowing_sixteen_sources_installs_a_producer_fence() {
        let mut faults = PendingPoolFaults::new();
        for worker_id in 0..PENDING_SOURCE_FAULTS_MAX as u64 {
            assert_eq!(
                faults.push(fault(worker_id, 1, PoolFaultAction::ReportResourceFailure)),
                FaultAdmission::Queued
            );
        }
        // Faults for sources already pending coalesce and do not count toward the bound.
        assert_eq!(
            faults.push(fault(0, 2, PoolFaultAction::RejectSource)),
            FaultAdmission::Coalesced
        );
        assert_eq!(faults.source_fault_count(), PENDING_SOURCE_FAULTS_MAX);
        assert_eq!(faults.producer_fence(), None);
        // The seventeenth distinct source fences the producer.
        assert_eq!(
            faults.push(fault(99, 1, PoolFaultAction::ReportResourceFailure)),
            FaultAdmission::ProducerFenceInstalled(ProducerFenceCause::SourceFaultOverflow)
        );
        assert_eq!(faults.source_fault_count(), 0);
        assert_eq!(faults.producer_fence(), Some(ProducerFenceCause::SourceFaultOverflow));
    }

    #[test]
    fn source_faults_are_handed_out_oldest_first() {
        let mut faults = PendingPoolFaults::new();
        for worker_id in [7, 3, 5] {
            let _ = faults.push(fault(worker_id, 1, PoolFaultAction::ReportResourceFailure));
        }
        // Coalescing keeps the original place in line.
        let _ = faults.push(fault(7, 2, PoolFaultAction::RejectSource));
        let order: Vec<u64> =
            drain(&mut faults).iter().map(|fault| fault.source.worker_id).collect();
        assert_eq!(order, vec![7, 3, 5]);
    }

    #[test]
    fn dispositions_map_to_actions() {
        assert_eq!(
            PoolFaultAction::from(FailureDisposition::ReportResourceFailure),
            PoolFaultAction::ReportResourceFailure
        );
        assert_eq!(
            PoolFaultAction::from(FailureDisposition::RejectSource),
            PoolFaultAction::RejectSource
        );
        assert_eq!(
            PoolFaultAction::from(FailureDisposition::FenceAndRebuildProducer),
            PoolFaultAction::FenceAndRebuildProducer
        );
        assert!(SourceFaultAction::RejectSource > SourceFaultAction::ReportResourceFailure);
    }
}
