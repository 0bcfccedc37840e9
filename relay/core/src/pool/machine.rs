//! One pool as a sans-IO state machine: exact ownership, the publisher, the publication cadence
//! and its timer, the journal's publication points and the subscriptions a replay holds.
//!
//! The shell feeds inputs (event batches, rank replacements and resets, flushes, subscriptions,
//! lease retirements, digests, timer firings) and carries out what they produce: deltas go to a
//! [`DeltaOutlet`] during the call, everything else is queued as a [`PoolEffect`] and drained
//! with [`PoolMachine::poll_effect`]. Time enters as `now`, a [`Duration`] on a clock of the
//! caller's choosing that never goes back; [`PoolMachine::poll_timeout`] says when to call
//! [`PoolMachine::handle_timeout`].
//!
//! Publication cadence: a batch is cut after the threshold of applied (or failed) events, or
//! `delay` after the first pending one, or on a flush, a barrier, a rank replacement or reset;
//! never inside an input.
//!
//! Invariants ([`PoolMachine::check_invariants`]):
//! - an armed publication timer means unpublished writes exist;
//! - only a scripted machine holds subscriptions, and every held one has a distinct id;
//! - the ownership state's own invariants ([`PoolOwnership::check_invariants`]).
//!
//! Journaling ([`PublicationRole`]): a reporting machine emits every publication point its
//! inputs do not determine (flush, barrier, lease retirement, failed delivery). Its timer is not
//! one of them: a timer firing is an input (the journal records the node's firings, and a replay
//! fires them at the recorded times), so every role arms and fires the timer alike. A scripted
//! machine performs the recorded points after the same deterministic inputs until the script's
//! end, then runs free. While scripted, a subscription never moves the
//! publisher: it is answered once the publisher holds its lease with nothing unpublished (so the
//! snapshot is exactly the state at the last published sequence and the next delta continues
//! it), and held until then; a retirement from a subscriber is ignored (the recording's
//! retirements are in the script).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::ownership::{ApplyError, OwnershipCounters, PoolOwnership, RankReplacement};
use super::publisher::{
    Delta, FenceReason, PublicationCadence, PublishError, PublishOutcome, Publisher, Snapshot,
};
use super::script::{
    PublicationPoint, PublicationRole, PublicationStep, ScriptPosition, ScriptState,
};
use crate::model::identity::LaneLease;
use crate::model::kv_events::{RouterEvent, SourceKey};
use crate::sources::{RankDump, RankFence};

/// Where a machine hands its deltas, in order, during the call that publishes them.
pub trait DeltaOutlet {
    /// Hand one delta to the subscribers; `Err(delta)` when nobody could take it (the
    /// publisher then fences itself: whether a consumer saw it is unknown).
    fn offer(&mut self, delta: Delta) -> Result<(), Delta>;
    /// Whether any subscriber is listening.
    fn has_receivers(&self) -> bool;
}

/// The cadence of one pool's publication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CadenceConfig {
    /// Applied events that force a publication (at least 1).
    pub threshold_events: u32,
    /// Delay after the first pending event before publishing.
    pub delay: Duration,
}

/// A subscription a scripted machine holds until it can be answered.
pub type HoldId = u64;

/// What a subscription input asks of the shell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscribeStep {
    /// Take a barrier now with [`PoolMachine::barrier`] (it may run off the shell's loop: the
    /// machine is not touched in between).
    Barrier,
    /// Held under this id; answered later by a [`PoolEffect::Answer`] or
    /// [`PoolEffect::Release`].
    Held(HoldId),
}

/// A rank's write failed (capacity omissions and unknown removals are counted, not reported).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFault {
    /// The rank whose write failed.
    pub source: SourceKey,
    /// The fence the failed command carried. The rank's tracker ignores a fault whose fence is
    /// older than the rank's current one: it is about state a later reset already replaced.
    pub fence: RankFence,
    /// The failed event's id (0 for a rank reset).
    pub event_id: u64,
    /// What went wrong; its disposition says what the host should do.
    pub error: ApplyError,
}

/// Something the shell must carry out, in the order emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEffect {
    /// Report a fault to the host.
    Fault(PoolFault),
    /// Record a publication point in the journal (reporting machines only).
    Point(PublicationPoint),
    /// Answer a held subscription with this snapshot; its deltas start at the next one
    /// published, so the shell subscribes it before feeding the machine again.
    Answer {
        /// The held subscription.
        hold: HoldId,
        /// The state at the last published sequence.
        snapshot: Snapshot,
    },
    /// The script ended: serve a held subscription as a free one ([`PoolMachine::barrier`]).
    Release {
        /// The held subscription.
        hold: HoldId,
        /// Its lease.
        lease: LaneLease,
    },
}

/// Point-in-time counters of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Ownership counters.
    pub counters: OwnershipCounters,
    /// Distinct owned canonical hashes.
    pub owned_blocks: usize,
    /// Occupied filter slots.
    pub resident_blocks: u64,
    /// Last published sequence.
    pub sequence: u64,
    /// Current lease.
    pub lease: Option<LaneLease>,
    /// Fence reason, if fenced.
    pub fence: Option<FenceReason>,
    /// Bytes the exact state's tables allocate.
    pub exact_state_bytes: usize,
    /// The exact state's byte budget.
    pub exact_state_bytes_max: usize,
}

/// A pool's logical state in digest form (journal checkpoints compare these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDigest {
    /// Distinct owned canonical hashes (the exact-block count).
    pub owned_blocks: u64,
    /// xxh3 of the owned canonical hashes in ascending order (little-endian `u64`s).
    pub canonical_digest: u64,
    /// xxh3 of the filter's words in order (little-endian `u64`s).
    pub filter_digest: u64,
    /// Last published sequence.
    pub sequence: u64,
}

#[derive(Debug)]
enum Role {
    Free,
    Reported,
    Scripted(ScriptState),
}

/// One pool's ownership, publisher and publication cadence (see the module doc).
#[derive(Debug)]
pub struct PoolMachine {
    pool: PoolOwnership,
    publisher: Publisher,
    cadence: PublicationCadence,
    delay: Duration,
    /// When the pending writes publish unless something publishes them first.
    deadline: Option<Duration>,
    /// Deltas offered to the outlet so far (delivered or not).
    offered: u64,
    /// Deterministic inputs processed so far.
    position: ScriptPosition,
    role: Role,
    /// The lease a scripted machine handed to its subscribers.
    served: Option<LaneLease>,
    /// Subscriptions a scripted machine holds, by id.
    held: BTreeMap<HoldId, LaneLease>,
    next_hold: HoldId,
    /// Scripted points after which the replayed sequence differed from the recorded one.
    script_mismatches: u64,
    effects: VecDeque<PoolEffect>,
}

impl PoolMachine {
    /// A machine owning `pool`; its publisher starts at sequence 0 with no lease.
    #[must_use]
    pub fn new(pool: PoolOwnership, cadence: CadenceConfig, role: PublicationRole) -> Self {
        PoolMachine {
            pool,
            publisher: Publisher::new(),
            cadence: PublicationCadence::new(cadence.threshold_events),
            delay: cadence.delay,
            deadline: None,
            offered: 0,
            position: ScriptPosition::default(),
            role: match role {
                PublicationRole::Free => Role::Free,
                PublicationRole::Reported => Role::Reported,
                PublicationRole::Scripted(script) => Role::Scripted(ScriptState::new(script)),
            },
            served: None,
            held: BTreeMap::new(),
            next_hold: 0,
            script_mismatches: 0,
            effects: VecDeque::new(),
        }
    }

    /// The ownership state.
    #[must_use]
    pub fn pool(&self) -> &PoolOwnership {
        &self.pool
    }

    /// Whether the machine follows a script (replay).
    #[must_use]
    pub fn is_scripted(&self) -> bool {
        matches!(self.role, Role::Scripted(_))
    }

    /// Scripted points after which the replayed sequence left the recorded one (the checkpoint
    /// digests that follow say where the state diverged).
    #[must_use]
    pub fn script_mismatches(&self) -> u64 {
        self.script_mismatches
    }

    /// The next effect to carry out.
    pub fn poll_effect(&mut self) -> Option<PoolEffect> {
        self.effects.pop_front()
    }

    /// When [`PoolMachine::handle_timeout`] is next due: the publication timer, or the end of
    /// the script.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        let script_end = match &self.role {
            Role::Scripted(script) => Some(script.until),
            _ => None,
        };
        match (self.deadline, script_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Fire whatever is due at `now`: the publication timer publishes the pending writes (not a
    /// point: the firing itself is the journal's input); the end of the script turns the
    /// machine free and releases every held subscription ([`PoolEffect::Release`]).
    pub fn handle_timeout(&mut self, now: Duration, outlet: &mut impl DeltaOutlet) {
        if self.deadline.is_some_and(|deadline| deadline <= now) {
            self.deadline = None;
            let _ = self.publish(outlet);
            self.position.timers += 1;
            // The points recorded right after this publication, and the held subscriptions
            // answerable at the state it published.
            self.catch_up(outlet);
        }
        if let Role::Scripted(script) = &self.role
            && script.until <= now
        {
            self.role = Role::Free;
            for (hold, lease) in std::mem::take(&mut self.held) {
                self.effects.push_back(PoolEffect::Release { hold, lease });
            }
        }
        self.debug_check();
    }

    /// Apply a batch of events from one publisher, written under `fence`, in order. A failed
    /// event is reported as a [`PoolEffect::Fault`] and counts toward the threshold like an
    /// applied one.
    pub fn apply(
        &mut self,
        fence: RankFence,
        events: &[RouterEvent],
        now: Duration,
        outlet: &mut impl DeltaOutlet,
    ) {
        self.catch_up(outlet);
        let mut due = false;
        for event in events {
            match self.pool.apply_event(event) {
                Ok(outcome) if outcome.applied => due |= self.cadence.record_event(),
                Ok(_) => {}
                Err(error) => {
                    let (source, event_id) = (event.source(), event.event.event_id);
                    self.effects.push_back(PoolEffect::Fault(PoolFault {
                        source,
                        fence,
                        event_id,
                        error,
                    }));
                    due |= self.cadence.record_event();
                }
            }
        }
        if due {
            self.deadline = None;
            let _ = self.publish(outlet);
        } else if self.deadline.is_none() && self.pool.has_unpublished_writes() {
            self.deadline = Some(now + self.delay);
        }
        self.deterministic_step(outlet);
    }

    /// Replace the ranks of `dumps` with their tree dumps and publish. A rank whose dump does
    /// not build (an event out of replay order, an unknown parent, a lineage that would pass the
    /// byte budget) keeps its state; when the pool cannot take the built replacements, no rank
    /// is replaced. Returns a fault for every rank left unreplaced, with its dump's fence: the
    /// dumps that did not build in dump order, then the replacements the pool could not take in
    /// rank order.
    ///
    /// The replacements are built beside the live state, and together their lineages may take
    /// at most the pool's byte budget (more could never be installed): while a rebuild runs, the
    /// pool's tables take at most twice the budget.
    pub fn replace_ranks(
        &mut self,
        dumps: Vec<RankDump>,
        outlet: &mut impl DeltaOutlet,
    ) -> Vec<PoolFault> {
        self.catch_up(outlet);
        let mut refused = Vec::new();
        let mut replacements = BTreeMap::new();
        let mut fences = BTreeMap::new();
        let mut built_bytes = 0usize;
        for dump in dumps {
            let bytes_max = self.pool.exact_state_bytes_max().saturating_sub(built_bytes);
            let mut replacement = RankReplacement::with_bytes_max(self.pool.table_key(), bytes_max);
            let built = dump.events.iter().try_for_each(|event| {
                replacement.push_event(event).map_err(|error| (event.event.event_id, error))
            });
            match built {
                Ok(()) => {
                    built_bytes += replacement.lineage_bytes();
                    fences.insert(dump.source, dump.fence);
                    replacements.insert(dump.source, replacement);
                }
                Err((event_id, mut error)) => {
                    if let ApplyError::ExactStateBudgetExceeded { needed_bytes, bytes_max } =
                        &mut error
                    {
                        // Say it in the pool's terms: with the replacements built before it.
                        *needed_bytes = needed_bytes.saturating_add(built_bytes);
                        *bytes_max = self.pool.exact_state_bytes_max();
                        self.pool.count_budget_refusal();
                    }
                    refused.push(PoolFault {
                        source: dump.source,
                        fence: dump.fence,
                        event_id,
                        error,
                    });
                }
            }
        }
        if let Err(error) = self.pool.replace_ranks(replacements) {
            refused.extend(fences.into_iter().map(|(source, fence)| PoolFault {
                source,
                fence,
                event_id: 0,
                error: error.clone(),
            }));
        }
        self.deadline = None;
        let _ = self.publish(outlet);
        self.deterministic_step(outlet);
        refused
    }

    /// Drop every block of one rank, under its new `fence`, and publish.
    pub fn reset_rank(
        &mut self,
        source: SourceKey,
        fence: RankFence,
        outlet: &mut impl DeltaOutlet,
    ) {
        self.catch_up(outlet);
        if let Err(error) = self.pool.remove_rank(source) {
            let fault = PoolFault { source, fence, event_id: 0, error };
            self.effects.push_back(PoolEffect::Fault(fault));
        }
        self.deadline = None;
        let _ = self.publish(outlet);
        self.deterministic_step(outlet);
    }

    /// Publish pending changes now; returns the last published sequence. A scripted machine
    /// publishes only at its script's points and answers its current sequence.
    pub fn flush(&mut self, outlet: &mut impl DeltaOutlet) -> Result<u64, PublishError> {
        if self.is_scripted() {
            let sequence = self.publisher.last_sequence();
            self.advance(outlet);
            return Ok(sequence);
        }
        self.deadline = None;
        let result = self.publish(outlet).map(|_| self.publisher.last_sequence());
        self.report(PublicationStep::Publish);
        self.debug_check();
        result
    }

    /// A subscriber asks for a barrier under `lease`: free, it is taken now
    /// ([`SubscribeStep::Barrier`]); scripted, it is held until the script reaches a state it
    /// can be answered at.
    pub fn subscribe(&mut self, lease: LaneLease, outlet: &mut impl DeltaOutlet) -> SubscribeStep {
        if self.is_scripted() {
            let hold = self.next_hold;
            self.next_hold += 1;
            self.held.insert(hold, lease);
            self.advance(outlet);
            return SubscribeStep::Held(hold);
        }
        SubscribeStep::Barrier
    }

    /// A held subscription's subscriber went away before it was answered.
    pub fn forget_hold(&mut self, hold: HoldId) {
        self.held.remove(&hold);
    }

    /// Publish the pending tail and install `lease` (the publisher's barrier); the snapshot is
    /// the state at the returned sequence. Reported as a point whatever its outcome.
    pub fn barrier(
        &mut self,
        lease: LaneLease,
        outlet: &mut impl DeltaOutlet,
    ) -> Result<Snapshot, PublishError> {
        let result = self.take_barrier(lease, outlet);
        self.report(PublicationStep::Barrier(lease.into()));
        self.debug_check();
        result
    }

    /// Retire `lease` if it is still the current one (a subscriber left). A scripted machine
    /// ignores it: the recording's retirements are in its script.
    pub fn retire_lease(&mut self, lease: LaneLease) {
        if self.is_scripted() {
            return;
        }
        self.publisher.retire_lease(lease);
        self.report(PublicationStep::RetireLease(lease.into()));
    }

    /// Current counters.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            counters: *self.pool.counters(),
            owned_blocks: self.pool.owned_block_count(),
            resident_blocks: self.pool.filter().occupied_slots(),
            sequence: self.publisher.last_sequence(),
            lease: self.publisher.lease(),
            fence: self.publisher.fence_reason(),
            exact_state_bytes: self.pool.exact_state_bytes(),
            exact_state_bytes_max: self.pool.exact_state_bytes_max(),
        }
    }

    /// The logical state in digest form; a deterministic input (a journal checkpoint).
    pub fn digest(&mut self, outlet: &mut impl DeltaOutlet) -> PoolDigest {
        self.catch_up(outlet);
        let blocks = self.pool.owned_blocks();
        let digest = PoolDigest {
            owned_blocks: blocks.len() as u64,
            canonical_digest: digest_u64s(blocks.iter().map(|(hash, _)| hash.0)),
            filter_digest: digest_u64s(self.pool.filter().words().iter().copied()),
            sequence: self.publisher.last_sequence(),
        };
        self.position.digests += 1;
        self.catch_up(outlet);
        digest
    }

    /// Graceful stop: publish the tail and retire the lease.
    pub fn shutdown(&mut self, outlet: &mut impl DeltaOutlet) {
        let _ = self.publish(outlet);
        if let Some(lease) = self.publisher.lease() {
            self.publisher.retire_lease(lease);
        }
    }

    /// Every handle is gone: publish the tail for whoever still listens.
    pub fn abandon(&mut self, outlet: &mut impl DeltaOutlet) {
        let _ = self.publish(outlet);
    }

    /// Verify every invariant of the module doc (O(state): the ownership tables are walked).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_cadence()?;
        self.pool.check_invariants()
    }

    /// The O(1) part of the invariants (the cadence and the held subscriptions; the ownership
    /// tables are not walked).
    pub fn check_cadence(&self) -> Result<(), String> {
        if self.deadline.is_some() && !self.pool.has_unpublished_writes() {
            return Err("the publication timer is armed with nothing to publish".into());
        }
        if !self.is_scripted() && !self.held.is_empty() {
            return Err(format!("a free machine holds {} subscriptions", self.held.len()));
        }
        if self.held.keys().next_back().is_some_and(|last| *last >= self.next_hold) {
            return Err("a held subscription's id was never issued".into());
        }
        Ok(())
    }

    fn debug_check(&self) {
        debug_assert_eq!(self.check_cadence(), Ok(()));
    }

    fn publish(&mut self, outlet: &mut impl DeltaOutlet) -> Result<PublishOutcome, PublishError> {
        self.cadence.reset();
        let PoolMachine { pool, publisher, role, offered, effects, position, .. } = self;
        publisher
            .publish(pool, &mut |delta| offer(outlet, role, offered, effects, *position, delta))
    }

    /// The publisher's barrier under `lease`: everything pending is published, so the timer is
    /// disarmed.
    fn take_barrier(
        &mut self,
        lease: LaneLease,
        outlet: &mut impl DeltaOutlet,
    ) -> Result<Snapshot, PublishError> {
        self.deadline = None;
        self.cadence.reset();
        let PoolMachine { pool, publisher, role, offered, effects, position, .. } = self;
        publisher.snapshot_after_barrier(pool, lease, &mut |delta| {
            offer(outlet, role, offered, effects, *position, delta)
        })
    }

    /// Emit `step` as a point if reporting.
    fn report(&mut self, step: PublicationStep) {
        if matches!(self.role, Role::Reported) {
            let (position, sequence) = (self.position, self.publisher.last_sequence());
            self.effects.push_back(PoolEffect::Point(PublicationPoint {
                position,
                step,
                sequence,
            }));
        }
    }

    /// Before a deterministic input: perform the points already reached (those recorded before
    /// the first input are due as soon as the machine sees any).
    fn catch_up(&mut self, outlet: &mut impl DeltaOutlet) {
        if self.is_scripted() {
            self.advance(outlet);
        }
    }

    /// A deterministic input (batch, replacement, reset) was processed.
    fn deterministic_step(&mut self, outlet: &mut impl DeltaOutlet) {
        self.position.commands += 1;
        self.catch_up(outlet);
        self.debug_check();
    }

    /// Perform every scripted point reached, then answer the held subscriptions that can be.
    fn advance(&mut self, outlet: &mut impl DeltaOutlet) {
        loop {
            let Role::Scripted(script) = &mut self.role else { return };
            let Some(point) = script.next_due(self.position) else { break };
            match point.step {
                PublicationStep::Publish => {
                    self.deadline = None;
                    let _ = self.publish(outlet);
                }
                PublicationStep::Barrier(lease) => {
                    let _ = self.take_barrier(lease.into(), outlet);
                }
                PublicationStep::RetireLease(lease) => {
                    let lease = LaneLease::from(lease);
                    // Taking the lease from a live subscriber would leave it stale: keep it (the
                    // sequence then leaves the recording, and the checkpoint says so).
                    if self.served != Some(lease) || !outlet.has_receivers() {
                        self.publisher.retire_lease(lease);
                    }
                }
                PublicationStep::DeliveryFailed(_) => {}
            }
            if self.publisher.last_sequence() != point.sequence {
                self.script_mismatches += 1;
            }
        }
        self.answer_held();
    }

    /// Answer each held subscription whose lease the publisher holds, unfenced, with nothing
    /// unpublished: the snapshot is the state at the last published sequence.
    fn answer_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let ready = self.publisher.fence_reason().is_none() && !self.pool.has_unpublished_writes();
        let Some(current) = self.publisher.lease().filter(|_| ready) else { return };
        let answered: Vec<HoldId> =
            self.held.iter().filter(|(_, lease)| **lease == current).map(|(id, _)| *id).collect();
        for hold in answered {
            self.held.remove(&hold);
            let snapshot = Snapshot {
                lease: current,
                sequence: self.publisher.last_sequence(),
                words: self.pool.filter().words().to_vec(),
            };
            self.served = Some(current);
            self.effects.push_back(PoolEffect::Answer { hold, snapshot });
        }
    }
}

/// Hand `delta` to the outlet. A scripted machine fails exactly the recorded ordinals (and
/// ignores a missing receiver); otherwise a missing receiver fails it, reported when reporting.
fn offer(
    outlet: &mut impl DeltaOutlet,
    role: &Role,
    offered: &mut u64,
    effects: &mut VecDeque<PoolEffect>,
    position: ScriptPosition,
    delta: Delta,
) -> Result<(), Delta> {
    let ordinal = *offered;
    *offered += 1;
    if let Role::Scripted(script) = role {
        if script.failures.contains(&ordinal) {
            return Err(delta);
        }
        let _ = outlet.offer(delta);
        return Ok(());
    }
    let sequence = delta.base_sequence;
    outlet.offer(delta).inspect_err(|_| {
        if matches!(role, Role::Reported) {
            let step = PublicationStep::DeliveryFailed(ordinal);
            effects.push_back(PoolEffect::Point(PublicationPoint { position, step, sequence }));
        }
    })
}

/// The digest [`PoolDigest::filter_digest`] takes of a filter's words, for comparing a copy of
/// them (a consumer's replica) with the pool's own.
#[must_use]
pub fn filter_words_digest(words: &[u64]) -> u64 {
    digest_u64s(words.iter().copied())
}

/// xxh3-64 of `values` as consecutive little-endian bytes, fed to the hasher in 4 KiB chunks.
fn digest_u64s(values: impl Iterator<Item = u64>) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut chunk = [0u8; 4096];
    let mut len = 0;
    for value in values {
        chunk[len..len + 8].copy_from_slice(&value.to_le_bytes());
        len += 8;
        if len == chunk.len() {
            hasher.update(&chunk);
            len = 0;
        }
    }
    hasher.update(&chunk[..len]);
    hasher.digest()
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
