//! Publication points: what a pool actor does to its publication that its commands do not
//! determine, so a journal can record it and a replay can perform it at the same point.
//!
//! An actor's *deterministic* commands are the ones its node sends as a function of the node's
//! inputs: event batches, rank replacements and resets (counted in
//! [`ScriptPosition::commands`]) and checkpoint digests (counted in
//! [`ScriptPosition::digests`]). Everything else that moves the publisher — the publication
//! delay timer, a flush, a subscriber's barrier, a lease retirement, a delta nobody received —
//! happens at a point between two of those commands that timing decides. A
//! [`PublicationMode::Reported`] actor reports each as a [`PublicationPoint`]; a
//! [`PublicationMode::Scripted`] actor has no timer and performs the recorded points after the
//! same commands instead, so its published sequence follows the recording.

use std::collections::{BTreeSet, VecDeque};
use std::fmt::Debug;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use kvrelay_core::model::identity::LaneLease;

/// Where in an actor's deterministic command stream a point lies: after this many commands and
/// digests (the two only grow).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScriptPosition {
    /// Event batches, rank replacements and rank resets processed.
    pub commands: u64,
    /// Digests answered.
    pub digests: u64,
}

impl ScriptPosition {
    /// Whether `self` has been reached at `now` (both counts at least as large).
    #[must_use]
    pub fn reached_at(&self, now: ScriptPosition) -> bool {
        self.commands <= now.commands && self.digests <= now.digests
    }
}

/// A lease in the journal: `(consumer_instance, physical_lane, assignment_epoch)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord(pub u64, pub u32, pub u64);

impl From<LaneLease> for LeaseRecord {
    fn from(lease: LaneLease) -> Self {
        LeaseRecord(lease.consumer_instance, lease.physical_lane, lease.assignment_epoch)
    }
}

impl From<LeaseRecord> for LaneLease {
    fn from(LeaseRecord(consumer_instance, physical_lane, assignment_epoch): LeaseRecord) -> Self {
        LaneLease { consumer_instance, physical_lane, assignment_epoch }
    }
}

/// What happened at a publication point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PublicationStep {
    /// A publication of the pending writes (the delay timer or a flush), whatever its outcome.
    Publish,
    /// A barrier snapshot under this lease (publishes the pending tail, installs the lease).
    Barrier(LeaseRecord),
    /// This lease was retired.
    RetireLease(LeaseRecord),
    /// The delta with this ordinal (counting every delta the actor offered, from 0) found no
    /// receiver; the publisher fenced itself.
    DeliveryFailed(u64),
}

/// One reported step and where it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicationPoint {
    /// After which deterministic commands.
    pub position: ScriptPosition,
    /// What happened.
    pub step: PublicationStep,
    /// The last published sequence after it.
    pub sequence: u64,
}

/// Where a reporting actor sends its points. Called from the actor's task (or its snapshot
/// job); must not block.
pub trait PublicationSink: Send + Sync + Debug + 'static {
    /// Record one point.
    fn point(&self, point: PublicationPoint);
}

/// The recorded points of one actor, to perform in replay.
#[derive(Debug, Clone)]
pub struct PublicationScript {
    /// The points in recorded order (delivery failures included).
    pub points: Vec<PublicationPoint>,
    /// When the recording ends: from then on the actor runs free (timer and barriers on demand).
    pub until: Instant,
}

/// How an actor decides when to publish.
#[derive(Debug, Clone, Default)]
pub enum PublicationMode {
    /// Production: the threshold, the delay timer, a barrier per subscription.
    #[default]
    Free,
    /// As [`PublicationMode::Free`], and every point is reported.
    Reported(Arc<dyn PublicationSink>),
    /// Replay: no timer; the script's points are performed after the same commands, and a
    /// subscriber is answered only at a published state (see the actor's doc).
    Scripted(PublicationScript),
}

/// A scripted actor's progress through its script.
#[derive(Debug)]
pub(super) struct ScriptState {
    /// Points not yet performed (delivery failures excluded).
    pub(super) pending: VecDeque<PublicationPoint>,
    /// Ordinals of the deltas that must fail delivery.
    pub(super) failures: BTreeSet<u64>,
    /// When the actor turns free.
    pub(super) until: Instant,
    /// Points whose replayed sequence differed from the recorded one.
    pub(super) mismatches: u64,
}

impl ScriptState {
    pub(super) fn new(script: PublicationScript) -> Self {
        let mut failures = BTreeSet::new();
        let mut pending = VecDeque::new();
        for point in script.points {
            match point.step {
                PublicationStep::DeliveryFailed(ordinal) => {
                    failures.insert(ordinal);
                }
                _ => pending.push_back(point),
            }
        }
        ScriptState { pending, failures, until: script.until, mismatches: 0 }
    }

    /// The next point if it has been reached at `now`.
    pub(super) fn next_due(&mut self, now: ScriptPosition) -> Option<PublicationPoint> {
        if self.pending.front()?.position.reached_at(now) { self.pending.pop_front() } else { None }
    }
}
