//! Publication points: what moves a pool's publication that its deterministic inputs do not
//! determine, so a journal can record it and a replay can perform it at the same point.
//!
//! A pool's *deterministic* inputs are the ones its node sends as a function of the node's
//! inputs and timer firings (the journal records both, and a replay feeds both): event batches,
//! rank replacements and resets (counted in [`ScriptPosition::commands`]), checkpoint digests
//! (counted in [`ScriptPosition::digests`]) and the publication timer's publications (counted
//! in [`ScriptPosition::timers`]). What else moves the publisher comes from its subscribers — a
//! flush, a subscriber's barrier, a lease retirement, a delta nobody received — at a point
//! between two of those inputs that the subscribers decide. A [`PublicationRole::Reported`] machine emits each as a [`PublicationPoint`]; a
//! [`PublicationRole::Scripted`] machine performs the recorded points after the same inputs
//! instead (and holds its own subscribers), so its published sequence follows the recording.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::identity::LaneLease;

/// Where in a pool's deterministic input stream a point lies: after this many commands,
/// digests and timer publications (the three only grow).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScriptPosition {
    /// Event batches, rank replacements and rank resets processed.
    pub commands: u64,
    /// Digests answered.
    pub digests: u64,
    /// Publications of the publication timer (journal format 6 on; absent before, read as 0).
    /// Counted so a point the recording reached right after a timer publication, with no
    /// command between, is performed after it in a replay too.
    #[serde(default)]
    pub timers: u64,
}

impl ScriptPosition {
    /// Whether `self` has been reached at `now` (every count at least as large).
    #[must_use]
    pub fn reached_at(&self, now: ScriptPosition) -> bool {
        self.commands <= now.commands && self.digests <= now.digests && self.timers <= now.timers
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
    /// A flush's publication of the pending writes, whatever its outcome (journal formats
    /// before 6 also recorded the delay timer's publications so; this build refuses to replay
    /// them).
    Publish,
    /// A barrier snapshot under this lease (publishes the pending tail, installs the lease).
    Barrier(LeaseRecord),
    /// This lease was retired.
    RetireLease(LeaseRecord),
    /// The delta with this ordinal (counting every delta the pool offered, from 0) found no
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

/// The recorded points of one pool generation, to perform in replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationScript {
    /// The points in recorded order (delivery failures included).
    pub points: Vec<PublicationPoint>,
    /// When the recording ends, on the machine's clock: from then on it runs free (timer and
    /// barriers on demand).
    pub until: Duration,
}

/// How a pool machine decides when to publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PublicationRole {
    /// Production: the threshold, the delay timer, a barrier per subscription.
    #[default]
    Free,
    /// As [`PublicationRole::Free`], and every point is emitted as an effect.
    Reported,
    /// Replay: the script's points are performed after the same inputs, and a subscriber is
    /// answered only at a published state (see [`super::PoolMachine`]).
    Scripted(PublicationScript),
}

/// A scripted machine's progress through its script.
#[derive(Debug)]
pub(super) struct ScriptState {
    /// Points not yet performed (delivery failures excluded).
    pub(super) pending: VecDeque<PublicationPoint>,
    /// Ordinals of the deltas that must fail delivery.
    pub(super) failures: BTreeSet<u64>,
    /// When the machine turns free.
    pub(super) until: Duration,
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
        ScriptState { pending, failures, until: script.until }
    }

    /// The next point if it has been reached at `now`.
    pub(super) fn next_due(&mut self, now: ScriptPosition) -> Option<PublicationPoint> {
        if self.pending.front()?.position.reached_at(now) { self.pending.pop_front() } else { None }
    }
}
