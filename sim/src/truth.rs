//! Truth oracles: each long-lived consumer's replicas against the workload model's exact state
//! (the blocks the simulated workers hold), never against the relay's own state.
//!
//! - **no-stale-blocks** (after quiescence): every block the truth model knows is not held by a
//!   listed worker of a pool — every block some listed worker held at a sample and no listed
//!   worker holds now, and [`NEVER_STORED_PROBES`] hashes drawn from the seed that no worker
//!   ever held — is probed in the consumer's replica; the present ones must stay within
//!   [`false_positive_allowance`] of the probes at the replica's occupancy;
//! - **bounded-staleness** (during the run, sampled at the consumer observer's cadence): while
//!   the DC and WAN links of a pool are healthy ([`Health`]), a block held continuously for
//!   longer than [`STALENESS_BOUND_MS`] is present in every subscribed replica, and the blocks
//!   removed longer than the bound ago are absent but for the false-positive allowance;
//! - **registrations-equal-truth**: each catalogued pool's registrations (models, adapters and
//!   their aliases) equal the ones its listed workers' cards declare ([`registrations::truth_registrations`]).
//!
//! # The false-positive bound
//!
//! A CKF v1 bucket holds [`SLOTS_PER_BUCKET`] = 4 fingerprints of [`FINGERPRINT_BITS`] = 16
//! bits, never zero, and a probe looks at 2 candidate buckets. For a hash independent of the
//! filter's contents, each of the 2·4 slots it compares against is occupied with probability
//! at most the occupancy fraction `α` (occupied slots / all slots) and, when occupied, holds
//! its fingerprint with probability 1/(2^16 − 1). By the union bound one probe is a false
//! positive with probability `p ≤ 2·4·α / (2^16 − 1)` ([`false_positive_rate`]). A removed
//! block is such a hash once its fingerprint is gone (another block sharing its fingerprint and
//! a bucket is exactly the collision counted). Over `n` probes the false positives are at most a
//! sum of `n` Bernoulli(p) trials, mean `μ = n·p`; the Chernoff bound
//! `P(X ≥ k) ≤ e^(−μ)·(e·μ/k)^k` (for `k > μ`) gives the allowance: the largest count whose
//! excess has probability above [`FALSE_POSITIVE_CONFIDENCE`] = 10⁻⁹ per check
//! ([`false_positive_allowance`]). At the suite's occupancies (α below 0.1) `p` is about
//! 1.2·10⁻⁵, so a few thousand probes allow 4–5 present blocks (Chernoff is loose for a tiny
//! mean), and a relay that keeps removed blocks shows hundreds.

use std::collections::BTreeMap;

use kvrelay_core::filter::ckf::{
    Addressing, FINGERPRINT_BITS, Probe, SLOTS_PER_BUCKET, word_contains,
};
use kvrelay_core::sources::{RECOVERY_ATTEMPT_TIMEOUT, RECOVERY_BACKOFF_MAX};

use crate::Check;
use crate::oracles::verdict;
use crate::scenario::{Fault, ScriptedFault};
use crate::settled::{CONVERGENCE_BOUND_MS, RECONNECT_MARGIN_MS};

pub mod registrations;

/// How long (simulated ms) a block may be held, or gone, before every healthy subscribed replica
/// must show it. A block a worker stores or evicts at a DC tick reaches the planes host in the
/// DC's next frame, the relay in the planes host's next frame (one per tick of the planes
/// link), the pool publishes it one turmoil step later and the consumer applies the delta one
/// WAN crossing after that: a few 5 ms steps plus at most two 50 ms DC ticks. The truth is
/// sampled every [`TRUTH_SAMPLE_MS`]. One second leaves a margin of several times that path;
/// the check's detail reports the slowest lag seen.
pub const STALENESS_BOUND_MS: u64 = 1_000;

/// Simulated ms between two truth samples (the consumer observer runs every 20 ms; the truth
/// and the bounded-staleness probes, most of the simulator's own cost, every third run of it).
/// A block's `since` is the first sample that shows it held, so it is late by less than one
/// interval, which only loosens the bound by that much; a wrong streak is seen from
/// [`TRANSIENT_MS`] on once it spans four samples.
pub const TRUTH_SAMPLE_MS: u64 = 60;

/// How long after its removal is due (or after the links turned healthy again, for a removal
/// made while they were not) a block is probed for absence during the run. A relay that never
/// applies a removal keeps the block present through this whole window, so the in-run check
/// sees it; one that brings a block back later is caught by `no-stale-blocks`, which probes
/// every block ever removed once the run is quiet. Without the horizon every sample would probe
/// every removal of the run so far, a cost that grows with the run's square.
pub const ABSENCE_HORIZON_MS: u64 = 10_000;

/// Per-check probability that honest false positives exceed [`false_positive_allowance`].
pub const FALSE_POSITIVE_CONFIDENCE: f64 = 1e-9;

/// Hashes no worker ever held probed per pool by no-stale-blocks, drawn from the seed.
pub const NEVER_STORED_PROBES: usize = 4096;

/// After a fault window touching a consumer's connection ends (a WAN partition or hold, a
/// relay restart), how long (simulated ms) its pools stay outside the bounded-staleness check:
/// [`CONVERGENCE_BOUND_MS`], the suite's bound for a consumer to notice a dead connection
/// (HTTP/2 keepalive), reconnect, resubscribe and recover.
pub const WAN_RECOVERY_MARGIN_MS: u64 = CONVERGENCE_BOUND_MS;

/// After a fault window on the DC side ends (a DC-plane partition, event noise, an overlap, a
/// planes-host restart), how long its pools stay outside the check: a recovery query in flight
/// on a planes connection the fault cut is answered by nobody, and the relay retries it only
/// after its attempt timeout ([`RECOVERY_ATTEMPT_TIMEOUT`], 30 s) and a backoff (at most
/// [`RECOVERY_BACKOFF_MAX`], 5 s); [`RECONNECT_MARGIN_MS`] covers the DC-plane probe, the
/// relist and the recovery itself (the consumers' connections are untouched).
pub const DC_RECOVERY_MARGIN_MS: u64 =
    (RECOVERY_ATTEMPT_TIMEOUT.as_secs() + RECOVERY_BACKOFF_MAX.as_secs()) * 1000
        + RECONNECT_MARGIN_MS;

/// Upper bound of one probe's false-positive probability with `occupied` of `slots` filter
/// slots in use (see the module doc): `2·4·α / (2^16 − 1)`.
#[must_use]
pub fn false_positive_rate(occupied: u64, slots: u64) -> f64 {
    if slots == 0 {
        return 0.0;
    }
    let alpha = (occupied as f64 / slots as f64).min(1.0);
    f64::from(2 * SLOTS_PER_BUCKET) * alpha / ((1u64 << FINGERPRINT_BITS) - 1) as f64
}

/// The most false positives `probes` probes at rate `rate` may honestly show: the largest `k`
/// such that the Chernoff bound of `P(X ≥ k + 1)` still exceeds [`FALSE_POSITIVE_CONFIDENCE`]
/// (0 when `rate` is 0).
#[must_use]
pub fn false_positive_allowance(probes: u64, rate: f64) -> u64 {
    let mean = probes as f64 * rate;
    if mean <= 0.0 {
        return 0;
    }
    let ln_delta = FALSE_POSITIVE_CONFIDENCE.ln();
    // The bound holds for k > μ; below it nothing is excluded.
    let mut k = mean.floor() as u64 + 1;
    while k <= probes {
        let kf = k as f64;
        let ln_tail = -mean + kf * (1.0 + mean.ln() - kf.ln());
        if ln_tail <= ln_delta {
            return k - 1;
        }
        k += 1;
    }
    probes
}

/// Occupied slots of a replica's bucket words (a slot is occupied when its fingerprint is not
/// zero).
#[must_use]
pub fn occupied_slots(words: &[u64]) -> u64 {
    let lanes = u64::from(SLOTS_PER_BUCKET);
    words
        .iter()
        .map(|word| (0..lanes).filter(|lane| (word >> (lane * 16)) & 0xffff != 0).count() as u64)
        .sum()
}

/// Whether the replica `words` holds the fingerprint of `probe` in one of its buckets.
#[must_use]
pub fn contains(words: &[u64], probe: &Probe) -> bool {
    let holds = |bucket: u32| {
        words.get(bucket as usize).is_some_and(|word| word_contains(*word, probe.fingerprint))
    };
    holds(probe.bucket_a) || holds(probe.bucket_b)
}

/// One tracked block of a pool: its hash, since when it is held (or when it went) and its
/// probe under the tracker's addressing.
#[derive(Debug, Clone, Copy)]
struct Entry {
    hash: u64,
    at_ms: u64,
    probe: Probe,
}

/// The exact state of one pool as the truth model showed it at every sample: which blocks its
/// listed workers hold and since when, and which they held once and no longer do.
///
/// A block's `since` is the earliest time one of its current holders (a rank's publisher
/// incarnation) has held it continuously: when a worker leaves, the blocks another rank also
/// holds count from when that rank got them, since the relay learns of that copy only from that
/// rank's events.
#[derive(Debug, Clone, Default)]
pub struct PoolTruth {
    addressing: Option<Addressing>,
    /// Held by a listed worker of the pool (overlapping ranks excluded), by hash.
    held: Vec<Entry>,
    /// Held at an earlier sample, held by none now: each block's place in `removals`, by hash.
    removed: BTreeMap<u64, usize>,
    /// Every removal in time order (samples' times only grow); an entry held again since is
    /// marked stale rather than taken out, so the log is append-only and a time range of it is
    /// found by a binary search.
    removals: Vec<Removal>,
    /// Held by ranks of an overlapping incarnation (neither required nor forbidden), sorted.
    unknown: Vec<u64>,
}

/// One removal of [`PoolTruth::removals`].
#[derive(Debug, Clone, Copy)]
struct Removal {
    entry: Entry,
    /// Still removed (not held again since).
    current: bool,
}

fn probe_with(addressing: Option<&Addressing>, hash: u64) -> Probe {
    addressing.map_or(Probe { fingerprint: 0, bucket_a: 0, bucket_b: 0 }, |a| a.probe(hash))
}

impl PoolTruth {
    /// Note the pool's held blocks at `now`: `held` as `(hash, since)` and `unknown`, both
    /// sorted by hash and deduplicated.
    pub fn update(&mut self, now: u64, held: &[(u64, u64)], unknown: Vec<u64>) {
        let addressing = self.addressing;
        let mut next_held = Vec::with_capacity(held.len());
        let mut old = std::mem::take(&mut self.held).into_iter().peekable();
        // One walk of the two sorted lists: a block held before and not now is removed at
        // `now`; a block held now and not before is no longer removed (if it was). The removed
        // set changes by what changed, never rebuilt, so a long run's removals cost nothing
        // per update.
        for &(hash, since) in held {
            while let Some(entry) = old.next_if(|entry| entry.hash < hash) {
                self.note_removed(Entry { at_ms: now, ..entry });
            }
            let probe = match old.next_if(|entry| entry.hash == hash) {
                Some(entry) => entry.probe,
                None => match self.removed.remove(&hash) {
                    Some(index) => {
                        let removal = &mut self.removals[index];
                        removal.current = false;
                        removal.entry.probe
                    }
                    None => probe_with(addressing.as_ref(), hash),
                },
            };
            next_held.push(Entry { hash, at_ms: since, probe });
        }
        for entry in old {
            self.note_removed(Entry { at_ms: now, ..entry });
        }
        self.held = next_held;
        self.unknown = unknown;
    }

    /// `entry` (held until now) is removed at its `at_ms`.
    fn note_removed(&mut self, entry: Entry) {
        // Held and removed are disjoint, so the block has no earlier removal to replace.
        debug_assert!(!self.removed.contains_key(&entry.hash));
        debug_assert!(self.removals.last().is_none_or(|last| last.entry.at_ms <= entry.at_ms));
        self.removed.insert(entry.hash, self.removals.len());
        self.removals.push(Removal { entry, current: true });
    }

    /// Re-probe every tracked block when `addressing` is not the one the probes were made with.
    pub fn address(&mut self, addressing: Addressing) {
        if self.addressing == Some(addressing) {
            return;
        }
        let removals = self.removals.iter_mut().map(|removal| &mut removal.entry);
        for entry in self.held.iter_mut().chain(removals) {
            entry.probe = addressing.probe(entry.hash);
        }
        self.addressing = Some(addressing);
    }

    /// Whether `hash` is held now (or by an overlapping rank).
    #[must_use]
    pub fn holds(&self, hash: u64) -> bool {
        self.held.binary_search_by_key(&hash, |entry| entry.hash).is_ok()
            || self.unknown.binary_search(&hash).is_ok()
    }

    /// Whether some of the pool's blocks are held by ranks of an overlapping incarnation.
    #[must_use]
    pub fn has_unknown(&self) -> bool {
        !self.unknown.is_empty()
    }

    /// Blocks held now.
    #[must_use]
    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// The blocks removed and due for absence at `due` whose absence is checked now (not held
    /// by an overlapping rank), in removal order: those removed in `(due - ABSENCE_HORIZON_MS,
    /// due]`, and, for the first [`ABSENCE_HORIZON_MS`] after the links turned healthy at
    /// `healthy_since`, every one removed before that, so a removal made while the check was
    /// suspended by a fault is checked once it resumes, for as long as a recent one.
    fn removed_recently(&self, due: u64, healthy_since: u64) -> impl Iterator<Item = &Entry> + '_ {
        let horizon = due.saturating_sub(ABSENCE_HORIZON_MS);
        let start = if healthy_since > horizon {
            0
        } else {
            self.removals.partition_point(|removal| removal.entry.at_ms <= horizon)
        };
        self.removals[start..]
            .iter()
            .take_while(move |removal| removal.entry.at_ms <= due)
            .filter(|removal| removal.current)
            .map(|removal| &removal.entry)
            .filter(|entry| self.unknown.binary_search(&entry.hash).is_err())
    }
}

/// When the links of each consumer and pool were outside a fault window, from the script.
///
/// A window touches every consumer's links for a DC-plane partition (to its repair), event
/// noise (to the noise being turned off), a relay restart and a planes-host restart (instants);
/// one consumer's for
/// a WAN partition, hold or bandwidth limit on it (to its repair, release or lift: a consumer
/// behind a link slower than its pools' publications lags by design, and the relay ends its
/// streams as lagging); one pool's for an overlapping
/// incarnation of one of its workers (to the overlap's end). A window never closed lasts to the
/// end of the run.
/// Worker restarts, crashes, lease expiries, cache clears, adapter churn and clock skew change
/// the truth, not a link: the relay must follow them within the bound. A window extends
/// [`WAN_RECOVERY_MARGIN_MS`] (WAN faults, relay restarts) or [`DC_RECOVERY_MARGIN_MS`] (the
/// rest) past its end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    /// Windows touching every link.
    all: Vec<(u64, u64)>,
    /// Windows touching one consumer's WAN link, by consumer index.
    consumers: Vec<Vec<(u64, u64)>>,
    /// Windows touching one pool, by serving endpoint.
    pools: BTreeMap<String, Vec<(u64, u64)>>,
}

impl Health {
    /// The windows of `script` for `consumers` consumers, worker `i` serving `endpoints[i]`.
    #[must_use]
    pub fn of_script(script: &[ScriptedFault], consumers: usize, endpoints: &[String]) -> Self {
        let mut health = Health { consumers: vec![Vec::new(); consumers], ..Health::default() };
        let dc_close = |start: &mut Option<u64>, at: u64, windows: &mut Vec<(u64, u64)>| {
            if let Some(from) = start.take() {
                windows.push((from, at.saturating_add(DC_RECOVERY_MARGIN_MS)));
            }
        };
        let wan_close = |start: &mut Option<u64>, at: u64, windows: &mut Vec<(u64, u64)>| {
            if let Some(from) = start.take() {
                windows.push((from, at.saturating_add(WAN_RECOVERY_MARGIN_MS)));
            }
        };
        let mut dc: Option<u64> = None;
        let mut noise: Option<u64> = None;
        // Per consumer: a WAN partition, a hold and a bandwidth limit, each open since.
        let mut wan: Vec<[Option<u64>; 3]> = vec![[None, None, None]; consumers];
        let mut overlap: BTreeMap<usize, u64> = BTreeMap::new();
        for ScriptedFault { at_ms, fault } in script {
            let at = *at_ms;
            match fault {
                Fault::DcPartition { .. } => {
                    dc.get_or_insert(at);
                }
                Fault::DcRepair => dc_close(&mut dc, at, &mut health.all),
                Fault::EventNoise(noise_now) if noise_now.is_quiet() => {
                    dc_close(&mut noise, at, &mut health.all);
                }
                Fault::EventNoise(_) => {
                    noise.get_or_insert(at);
                }
                Fault::RelayRestart => wan_close(&mut Some(at), at, &mut health.all),
                Fault::EventPlaneRestart | Fault::DiscoveryRestart => {
                    dc_close(&mut Some(at), at, &mut health.all);
                }
                Fault::WanPartition { consumer }
                | Fault::WanRepair { consumer }
                | Fault::WanHold { consumer }
                | Fault::WanRelease { consumer }
                | Fault::ConsumerBandwidth { consumer, .. }
                | Fault::ConsumerBandwidthLift { consumer } => {
                    let kind = match fault {
                        Fault::WanPartition { .. } | Fault::WanRepair { .. } => 0,
                        Fault::WanHold { .. } | Fault::WanRelease { .. } => 1,
                        _ => 2,
                    };
                    let opens = matches!(
                        fault,
                        Fault::WanPartition { .. }
                            | Fault::WanHold { .. }
                            | Fault::ConsumerBandwidth { .. }
                    );
                    let target = consumer.unwrap_or(crate::scenario::ConsumerTarget::One(0));
                    for index in target.indices(consumers) {
                        let Some(slots) = wan.get_mut(index) else { continue };
                        if opens {
                            slots[kind].get_or_insert(at);
                        } else {
                            wan_close(&mut slots[kind], at, &mut health.consumers[index]);
                        }
                    }
                }
                Fault::BeginOverlap { worker } => {
                    overlap.entry(*worker).or_insert(at);
                }
                Fault::EndOverlap { worker } => {
                    if let (Some(from), Some(endpoint)) =
                        (overlap.remove(worker), endpoints.get(*worker))
                    {
                        let window = (from, at.saturating_add(DC_RECOVERY_MARGIN_MS));
                        health.pools.entry(endpoint.clone()).or_default().push(window);
                    }
                }
                _ => {}
            }
        }
        for start in [dc, noise].into_iter().flatten() {
            health.all.push((start, u64::MAX));
        }
        for (index, slots) in wan.iter().enumerate() {
            for start in slots.iter().flatten() {
                health.consumers[index].push((*start, u64::MAX));
            }
        }
        for (worker, from) in overlap {
            if let Some(endpoint) = endpoints.get(worker) {
                health.pools.entry(endpoint.clone()).or_default().push((from, u64::MAX));
            }
        }
        health
    }

    /// Since when consumer `consumer`'s links to the pool of `endpoint` have been healthy at
    /// `now` (0: since the start), or `None` while a window touching them is open.
    #[must_use]
    pub fn healthy_since(&self, now: u64, consumer: usize, endpoint: &str) -> Option<u64> {
        let windows = self
            .all
            .iter()
            .chain(self.consumers.get(consumer).into_iter().flatten())
            .chain(self.pools.get(endpoint).into_iter().flatten());
        let mut since = 0;
        for &(from, until) in windows {
            if from <= now && now < until {
                return None;
            }
            if until <= now {
                since = since.max(until);
            }
        }
        Some(since)
    }
}

/// How long (simulated ms) a due block may stay wrong (absent though held, present though
/// removed) in a replica before it counts: a rank can store and evict a block (or evict and
/// store it again) within one 50 ms DC tick, between two truth samples, and the relay then
/// shows the intermediate state until the pair's second event is published, one planes frame
/// later. A relay that never applies an event keeps the block wrong for good.
pub const TRANSIENT_MS: u64 = 200;

/// What the bounded-staleness samples found, over the whole run.
#[derive(Debug, Clone, Default)]
pub struct Staleness {
    /// Samples of a (consumer, pool) pair with healthy links.
    pub samples: u64,
    /// Held blocks probed for presence.
    pub presence_probes: u64,
    /// Removed blocks probed for absence.
    pub absence_probes: u64,
    /// The oldest age (ms past the later of its `since` and the links' health) of a held block
    /// found absent, the lag the bound must cover.
    pub slowest_ms: u64,
    violations: Violations,
    /// Per consumer and pool, the due blocks wrong at the last sample and since when.
    streaks: BTreeMap<(String, String), Streaks>,
}

/// The wrong blocks of one replica: absent though held, present though removed, by hash, with
/// the first sample of their current streak.
#[derive(Debug, Clone, Default)]
struct Streaks {
    absent: BTreeMap<u64, u64>,
    present: BTreeMap<u64, u64>,
}

/// Keep the streaks of `wrong` (hashes wrong now), starting new ones at `now`; returns how many
/// have lasted [`TRANSIENT_MS`] and the longest.
fn extend_streaks(streaks: &mut BTreeMap<u64, u64>, wrong: &[u64], now: u64) -> (u64, u64) {
    let next: BTreeMap<u64, u64> =
        wrong.iter().map(|hash| (*hash, streaks.get(hash).copied().unwrap_or(now))).collect();
    *streaks = next;
    let lasting = streaks.values().filter(|first| now - **first >= TRANSIENT_MS);
    lasting.fold((0, 0), |(count, longest), first| (count + 1, longest.max(now - first)))
}

/// Violations kept in full; the rest are counted.
const VIOLATIONS_KEPT: usize = 4;

/// An in-run check's violations: the first [`VIOLATIONS_KEPT`] in full, all of them counted.
#[derive(Debug, Clone, Default)]
pub(crate) struct Violations {
    kept: Vec<String>,
    count: u64,
}

impl Violations {
    /// Count one violation, described by `text` while fewer than [`VIOLATIONS_KEPT`] are kept.
    pub(crate) fn push(&mut self, text: impl FnOnce() -> String) {
        self.count += 1;
        if self.kept.len() < VIOLATIONS_KEPT {
            self.kept.push(text());
        }
    }

    /// The check `name`: passed with `fine` without violations, else the count and the first.
    pub(crate) fn check(&self, name: &'static str, fine: String) -> Check {
        let mut check = verdict(name, &self.kept, fine);
        if !check.passed {
            check.detail = format!("{} violation(s), first: {}", self.count, self.kept[0]);
        }
        check
    }
}

/// When and where an in-run sample was taken: one consumer's view of one pool.
#[derive(Debug, Clone, Copy)]
pub struct SampleAt<'a> {
    /// Simulated ms.
    pub now: u64,
    /// The consumer's host.
    pub consumer: &'a str,
    /// The pool's serving endpoint.
    pub endpoint: &'a str,
    /// Since when the consumer's links to the pool have been healthy.
    pub healthy_since: u64,
}

/// One sample of one consumer's replica of one pool.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// When and where.
    pub at: SampleAt<'a>,
    /// The replica's words (`None`: no replica installed).
    pub words: Option<&'a [u64]>,
    /// Whether held blocks must be present (not with expected capacity omissions).
    pub presence: bool,
}

impl Staleness {
    /// Judge one sample against `truth` (whose probes follow the replica's addressing): a held
    /// block due for presence ([`STALENESS_BOUND_MS`] past the later of its `since` and the
    /// links' health) absent for [`TRANSIENT_MS`], or more removed blocks due for absence
    /// present for that long than the false-positive allowance of the due probes, is a
    /// violation.
    pub fn observe(&mut self, truth: &PoolTruth, sample: Sample<'_>) {
        let Sample { at: SampleAt { now, consumer, endpoint, healthy_since }, words, presence } =
            sample;
        let streaks = self.streaks.entry((consumer.to_owned(), endpoint.to_owned())).or_default();
        let Some(due) = now.checked_sub(STALENESS_BOUND_MS).filter(|due| healthy_since <= *due)
        else {
            *streaks = Streaks::default();
            return;
        };
        self.samples += 1;
        let found = |entry: &Entry| words.is_some_and(|words| contains(words, &entry.probe));
        let mut absent = Vec::new();
        if presence {
            // One probe per held block: an absent one counts for the slowest lag, and against
            // the bound once it is due.
            for entry in &truth.held {
                let due_now = entry.at_ms <= due;
                self.presence_probes += u64::from(due_now);
                if found(entry) {
                    continue;
                }
                let age = now.saturating_sub(entry.at_ms.max(healthy_since));
                self.slowest_ms = self.slowest_ms.max(age);
                if due_now {
                    absent.push(entry.hash);
                }
            }
        }
        let (lasting, longest) = extend_streaks(&mut streaks.absent, &absent, now);
        let mut probes = 0u64;
        let mut present = Vec::new();
        if let Some(words) = words {
            for entry in truth.removed_recently(due, healthy_since) {
                probes += 1;
                if contains(words, &entry.probe) {
                    present.push(entry.hash);
                }
            }
        }
        self.absence_probes += probes;
        let (stale, stale_longest) = extend_streaks(&mut streaks.present, &present, now);
        if lasting > 0 {
            self.violations.push(|| {
                format!(
                    "{consumer} at {now} ms: {lasting} blocks of {endpoint} held past the bound \
                     are absent (for {longest} ms)"
                )
            });
        }
        if stale > 0 {
            let words = words.unwrap_or_default();
            let rate = false_positive_rate(occupied_slots(words), words.len() as u64 * 4);
            let allowance = false_positive_allowance(probes, rate);
            if stale > allowance {
                self.violations.push(|| {
                    format!(
                        "{consumer} at {now} ms: {stale} of {probes} blocks of {endpoint} removed \
                         past the bound are present (for {stale_longest} ms; false-positive \
                         allowance {allowance})"
                    )
                });
            }
        }
    }

    /// The bounded-staleness check over every sample.
    #[must_use]
    pub fn check(&self) -> Check {
        let fine = format!(
            "{} healthy samples: {} held blocks present, {} removed blocks absent (but for \
             false positives) within {STALENESS_BOUND_MS} ms; slowest lag {} ms",
            self.samples, self.presence_probes, self.absence_probes, self.slowest_ms
        );
        self.violations.check("bounded-staleness", fine)
    }
}

/// One pool's stale-block probes in one consumer's replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleProbed {
    /// Serving endpoint.
    pub endpoint: String,
    /// Hashes probed that no listed worker holds (removed ones and never-stored ones).
    pub probes: u64,
    /// How many of them the replica contains.
    pub present: u64,
    /// Occupied slots of the replica.
    pub occupied: u64,
    /// All slots of the replica.
    pub slots: u64,
}

/// Probe every removed block `truth` knows and every `never_stored` hash (none of them held)
/// in `words`.
#[must_use]
pub fn probe_stale(
    endpoint: &str,
    truth: &PoolTruth,
    addressing: &Addressing,
    never_stored: &[u64],
    words: &[u64],
) -> StaleProbed {
    let mut probes = 0u64;
    let mut present = 0u64;
    let removed = truth.removed.keys().copied();
    for hash in removed.chain(never_stored.iter().copied()) {
        if truth.holds(hash) {
            continue;
        }
        probes += 1;
        present += u64::from(contains(words, &addressing.probe(hash)));
    }
    StaleProbed {
        endpoint: endpoint.to_owned(),
        probes,
        present,
        occupied: occupied_slots(words),
        slots: words.len() as u64 * u64::from(SLOTS_PER_BUCKET),
    }
}

/// No pool's replica holds more blocks that no listed worker holds than the false-positive
/// allowance of its probes at its occupancy.
#[must_use]
pub fn no_stale_blocks(pools: &[StaleProbed]) -> Check {
    let mut violations = Vec::new();
    let (mut probes, mut present, mut allowed) = (0u64, 0u64, 0u64);
    for pool in pools {
        let allowance =
            false_positive_allowance(pool.probes, false_positive_rate(pool.occupied, pool.slots));
        probes += pool.probes;
        present += pool.present;
        allowed += allowance;
        if pool.present > allowance {
            violations.push(format!(
                "{}: {} of {} blocks no listed worker holds are present (allowance {allowance} \
                 at {} of {} slots)",
                pool.endpoint, pool.present, pool.probes, pool.occupied, pool.slots
            ));
        }
    }
    let fine = format!(
        "{probes} removed or never-stored blocks probed, {present} present (allowance {allowed})"
    );
    verdict("no-stale-blocks", &violations, fine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::filter::ckf::CkfFormat;

    fn addressing() -> Addressing {
        Addressing::new(&CkfFormat::v1(kvrelay_core::filter::ckf::DEFAULT_SEED, 1024))
    }

    /// A replica of 1024 buckets holding `hashes`, each in its home bucket's first free slot.
    fn replica(hashes: &[u64]) -> Vec<u64> {
        let addressing = addressing();
        let mut words = vec![0u64; 1024];
        for &hash in hashes {
            let probe = addressing.probe(hash);
            let word = &mut words[probe.bucket_a as usize];
            let lane = (0..4).find(|lane| (*word >> (lane * 16)) & 0xffff == 0).unwrap();
            *word |= u64::from(probe.fingerprint) << (lane * 16);
        }
        words
    }

    fn truth_of(steps: &[(u64, &[u64])]) -> PoolTruth {
        let mut truth = PoolTruth::default();
        truth.address(addressing());
        let mut since: BTreeMap<u64, u64> = BTreeMap::new();
        for (now, held) in steps {
            since.retain(|hash, _| held.contains(hash));
            let held: Vec<(u64, u64)> =
                held.iter().map(|hash| (*hash, *since.entry(*hash).or_insert(*now))).collect();
            let mut held = held;
            held.sort_unstable();
            truth.update(*now, &held, Vec::new());
        }
        truth
    }

    #[test]
    fn the_allowance_grows_with_probes_and_occupancy() {
        assert_eq!(false_positive_allowance(10_000, 0.0), 0);
        let rate = false_positive_rate(400, 4096);
        assert!((rate - 8.0 * (400.0 / 4096.0) / 65_535.0).abs() < 1e-12);
        let few = false_positive_allowance(1_000, rate);
        let many = false_positive_allowance(1_000_000, rate);
        // Chernoff is loose for a tiny mean: 4 at μ ≈ 0.012 (the exact binomial tail gives 3).
        assert_eq!(few, 4);
        assert!(many > few && many < 100, "{many}");
        // A mean of 1 allows single digits at 10^-9, never a hundred.
        let one = false_positive_allowance(1_000, 0.001);
        assert!((5..=20).contains(&one), "{one}");
    }

    #[test]
    fn removed_blocks_left_in_a_replica_are_stale() {
        let held: Vec<u64> = (1..=200).collect();
        let later: Vec<u64> = (101..=200).collect();
        let truth = truth_of(&[(0, &held), (500, &later)]);
        assert_eq!(truth.held_count(), 100);
        let never: Vec<u64> = (1_000_000..1_004_096).collect();
        // The relay dropped the removed blocks: nothing stale.
        let clean = replica(&later);
        let probed = probe_stale("e", &truth, &addressing(), &never, &clean);
        assert_eq!(probed.probes, 100 + 4096);
        let check = no_stale_blocks(&[probed]);
        assert!(check.passed, "{}", check.detail);
        // A relay that ignored the removals keeps all 200.
        let kept = replica(&held);
        let check = no_stale_blocks(&[probe_stale("e", &truth, &addressing(), &never, &kept)]);
        assert!(!check.passed);
        assert!(check.detail.contains("100 of 4196"), "{}", check.detail);
    }

    #[test]
    fn staleness_requires_presence_and_absence_after_the_bound() {
        let held: Vec<u64> = (1..=50).collect();
        let later: Vec<u64> = (26..=60).collect();
        let truth = truth_of(&[(0, &held), (2_000, &later)]);
        // Samples of one replica from `from` on, every 20 ms for `for_ms`.
        let samples = |from: u64, for_ms: u64, words: &[u64]| {
            let mut staleness = Staleness::default();
            let words = words.to_vec();
            for now in (from..=from + for_ms).step_by(20) {
                let sample = Sample {
                    at: SampleAt { now, consumer: "c", endpoint: "e", healthy_since: 0 },
                    words: Some(&words),
                    presence: true,
                };
                staleness.observe(&truth, sample);
            }
            staleness.check()
        };
        let due = 2_000 + STALENESS_BOUND_MS;
        // Before the bound the replica may lag: still the old state.
        assert!(samples(due - 400, 380, &replica(&held)).passed);
        // Past it the new blocks must be there and the removed ones gone.
        assert!(samples(due, 2 * TRANSIENT_MS, &replica(&later)).passed);
        // A wrong state shorter than the transient allowance is no violation, a longer one is.
        assert!(samples(due, TRANSIENT_MS - 20, &replica(&held)).passed);
        let lagging = samples(due, TRANSIENT_MS, &replica(&held));
        assert!(!lagging.passed);
        assert!(
            lagging.detail.contains("10 blocks of e held past the bound"),
            "{}",
            lagging.detail
        );
        let mut both: Vec<u64> = held.clone();
        both.extend(51..=60);
        let stale = samples(due, TRANSIENT_MS, &replica(&both));
        assert!(!stale.passed);
        assert!(stale.detail.contains("25 of 25"), "{}", stale.detail);
    }

    #[test]
    fn in_run_absence_probes_cover_the_horizon_and_blocks_held_again_leave_the_removed() {
        let held: Vec<u64> = (1..=50).collect();
        let later: Vec<u64> = (26..=50).collect();
        // 1..=25 removed at 2 s; 10 of them held again at 5 s.
        let mut again = later.clone();
        again.extend(1..=10);
        let truth = truth_of(&[(0, &held), (2_000, &later), (5_000, &again)]);
        let stale_for = |now: u64, healthy_since: u64| {
            let mut staleness = Staleness::default();
            let words = replica(&held);
            for now in (now..=now + 2 * TRANSIENT_MS).step_by(20) {
                let sample = Sample {
                    at: SampleAt { now, consumer: "c", endpoint: "e", healthy_since },
                    words: Some(&words),
                    presence: true,
                };
                staleness.observe(&truth, sample);
            }
            staleness
        };
        // Within the horizon the 15 blocks still removed are probed (the 10 held again are
        // not removed any more) and, left in the replica, fail the check.
        let within = stale_for(2_000 + STALENESS_BOUND_MS + 1_000, 0);
        assert!(!within.check().passed);
        assert!(within.check().detail.contains("15 of 15"), "{}", within.check().detail);
        // Past it they are left to no-stale-blocks at quiescence, which still sees all 15.
        let past_due = 2_000 + STALENESS_BOUND_MS + ABSENCE_HORIZON_MS;
        let past = stale_for(past_due, 0);
        assert_eq!(past.absence_probes, 0);
        assert!(past.check().passed, "{}", past.check().detail);
        // Unless the links were unhealthy until lately: removals made while the check was
        // suspended are checked once it resumes.
        let resumed = stale_for(past_due, past_due - STALENESS_BOUND_MS - 500);
        assert!(!resumed.check().passed);
        assert!(resumed.check().detail.contains("15 of 15"), "{}", resumed.check().detail);
        let never: Vec<u64> = Vec::new();
        let probed = probe_stale("e", &truth, &addressing(), &never, &replica(&held));
        assert_eq!((probed.probes, probed.present), (15, 15));
    }

    #[test]
    fn an_unhealthy_link_suspends_the_staleness_check() {
        let truth = truth_of(&[(0, &[1, 2, 3])]);
        let mut staleness = Staleness::default();
        // Healthy only since 1500 ms: at 2000 ms the blocks are not yet due.
        staleness.observe(
            &truth,
            Sample {
                at: SampleAt { now: 2_000, consumer: "c", endpoint: "e", healthy_since: 1_500 },
                words: None,
                presence: true,
            },
        );
        assert!(staleness.check().passed);
        let script = crate::scenario::Scenario::parse(
            "run_ms = 9000\n[topology]\npreset = \"demo\"\n[[faults]]\nat_ms = 100\naction = \
             \"wan-partition\"\nconsumer = \"b\"\n[[faults]]\nat_ms = 300\naction = \
             \"wan-repair\"\nconsumer = \"b\"\n[[faults]]\nat_ms = 500\naction = \
             \"dc-partition\"\nmode = \"drop\"\n[expect]\npools = 0\nreadiness = {}\n",
            "t",
        )
        .unwrap()
        .script(0, 5);
        let health = Health::of_script(&script, 2, &[]);
        assert_eq!(health.healthy_since(50, 1, "e"), Some(0));
        assert_eq!(health.healthy_since(200, 1, "e"), None);
        assert_eq!(health.healthy_since(200, 0, "e"), Some(0));
        assert_eq!(health.healthy_since(400, 1, "e"), None, "within the recovery margin");
        // The DC partition is never repaired: unhealthy for everyone from 500 ms on.
        assert_eq!(health.healthy_since(600, 0, "e"), None);
    }

    #[test]
    fn a_bandwidth_limit_suspends_the_check_for_its_consumer_until_the_margin_after_the_lift() {
        let script = crate::scenario::Scenario::parse(
            "run_ms = 9000\n[topology]\npreset = \"demo\"\n[[faults]]\nat_ms = 100\naction = \
             \"consumer-bandwidth\"\nconsumer = \"b\"\nbytes_per_s = 2048\n[[faults]]\nat_ms = \
             300\naction = \"consumer-bandwidth-lift\"\nconsumer = \"b\"\n[expect]\npools = 0\n\
             readiness = {}\n",
            "t",
        )
        .unwrap()
        .script(0, 5);
        let health = Health::of_script(&script, 2, &[]);
        assert_eq!(health.healthy_since(50, 1, "e"), Some(0));
        assert_eq!(health.healthy_since(200, 1, "e"), None);
        assert_eq!(health.healthy_since(200, 0, "e"), Some(0), "the other consumer's link is fine");
        let healed = 300 + WAN_RECOVERY_MARGIN_MS;
        assert_eq!(health.healthy_since(healed - 1, 1, "e"), None, "within the recovery margin");
        assert_eq!(health.healthy_since(healed, 1, "e"), Some(healed));
    }
}
