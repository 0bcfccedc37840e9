//! The truth oracles' side of a run: the truth model's pools and registrations sampled as the
//! DC changes, every long-lived consumer's replicas and catalog sampled at the observer's
//! cadence for bounded staleness and registrations that follow the truth, and the final
//! no-stale-blocks and registrations checks (see [`crate::truth`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvrelay_consumer::{ConsumerSnapshot, RelayConsumer};
use kvrelay_core::filter::ckf::Addressing;
use kvrelay_core::model::identity::{PoolId, ProducerIdentity};
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_dc::SimulatedDc;
use rand_core::Rng as _;

use crate::settled::{self, PoolKey};
use crate::truth::registrations::{self, RegistrationFollowing, RegistrationSample, TruthSince};
use crate::truth::{self, Health, PoolTruth, Sample, SampleAt, Staleness};
use crate::{Check, World, lock, sim_dc_id, sim_ms};

/// Each listed rank's held blocks with since when it holds them, by `(worker index, rank,
/// publisher incarnation)`.
type Holders = BTreeMap<(usize, usize, u64), Held>;

/// One rank's held blocks at an update: `(hash, since)` sorted by hash, and the rank's newest
/// event id then (the blocks are the same while it is).
#[derive(Debug, Clone)]
struct Held {
    stamp: u64,
    blocks: Vec<(u64, u64)>,
}

/// `hashes` (sorted) as `(hash, since)`: a hash `last` held keeps its since, a new one is held
/// since `now` (one merge walk of the two sorted lists).
fn carry_since(hashes: &[u64], last: Option<&Held>, now: u64) -> Vec<(u64, u64)> {
    let mut old = last.map_or(&[][..], |last| last.blocks.as_slice()).iter().peekable();
    hashes
        .iter()
        .map(|&hash| {
            while old.next_if(|held| held.0 < hash).is_some() {}
            match old.next_if(|held| held.0 == hash) {
                Some(&(_, since)) => (hash, since),
                None => (hash, now),
            }
        })
        .collect()
}

/// A replica's words as last copied, by consumer index and pool.
type Copies = BTreeMap<(usize, PoolId), (ProducerIdentity, u64, Arc<Vec<u64>>)>;

/// The truth model's pools over the run and what the staleness samples found.
#[derive(Debug)]
pub(crate) struct TruthWatch {
    health: Health,
    presence: bool,
    /// The DC version the pools were last updated at.
    version: Option<u64>,
    /// Each KV-publishing endpoint's pool truth.
    pools: BTreeMap<String, PoolTruth>,
    /// Each KV-publishing endpoint's holders at the last update.
    holders: BTreeMap<String, Holders>,
    /// The pools the truth model says are catalogued, at the last update.
    catalog: BTreeSet<PoolKey>,
    /// Each endpoint's truth registrations and since when, at the last update.
    registrations: BTreeMap<String, TruthSince>,
    staleness: Staleness,
    following: RegistrationFollowing,
    copies: Copies,
    /// Set when the final evaluation begins: sampling ends there.
    stopped: bool,
    /// Simulated ms of the last sample.
    last_sample: Option<u64>,
}

impl TruthWatch {
    /// A watch judging links by `health`; held blocks must be present unless `presence` is
    /// off (expected capacity omissions).
    pub(crate) fn new(health: Health, presence: bool) -> Self {
        TruthWatch {
            health,
            presence,
            version: None,
            pools: BTreeMap::new(),
            holders: BTreeMap::new(),
            catalog: BTreeSet::new(),
            registrations: BTreeMap::new(),
            staleness: Staleness::default(),
            following: RegistrationFollowing::default(),
            copies: BTreeMap::new(),
            stopped: false,
            last_sample: None,
        }
    }

    /// End the in-run sampling (the final evaluation begins).
    pub(crate) fn stop(&mut self) {
        self.stopped = true;
    }

    /// Bring every pool's truth to `dc`'s state at `now`, unless `version` was seen already.
    ///
    /// A rank whose publisher incarnation and newest event id are those of the last update
    /// holds the same blocks (the workload model publishes every store, eviction and clear as
    /// an event), so its blocks are reused as they were; a pool none of whose ranks changed
    /// (and with no overlapping rank) keeps its truth as it was, which is what
    /// [`PoolTruth::update`] would compute again.
    fn update(&mut self, now: u64, version: u64, dc: &SimulatedDc) {
        if self.version == Some(version) {
            return;
        }
        self.version = Some(version);
        let mut before = std::mem::take(&mut self.holders);
        // Every listed rank's blocks, each with since when that publisher incarnation holds it.
        let mut sources: BTreeMap<String, Holders> = BTreeMap::new();
        let mut unknown: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut changed: BTreeSet<String> = BTreeSet::new();
        for (index, worker) in dc.workers().iter().enumerate() {
            if !worker.spec().publishes_kv {
                continue;
            }
            let endpoint = worker.spec().endpoint.to_string();
            let pool = sources.entry(endpoint.clone()).or_default();
            let unknown = unknown.entry(endpoint.clone()).or_default();
            if !dc.is_listed(index) {
                continue;
            }
            let mut previous = before.get_mut(&endpoint);
            for (rank_index, rank) in worker.ranks().iter().enumerate() {
                if dc.in_overlap(index) {
                    unknown.extend(rank.canonical_hashes());
                    changed.insert(endpoint.clone());
                    continue;
                }
                let key = (index, rank_index, rank.publisher_id());
                let last = previous.as_mut().and_then(|holders| holders.remove(&key));
                let stamp = rank.newest_event_id();
                let held = match last {
                    Some(last) if last.stamp == stamp => last,
                    last => {
                        changed.insert(endpoint.clone());
                        let mut hashes: Vec<u64> = rank.canonical_hashes().collect();
                        hashes.sort_unstable();
                        Held { stamp, blocks: carry_since(&hashes, last.as_ref(), now) }
                    }
                };
                pool.insert(key, held);
            }
        }
        // A holder of the last update that is gone changes its pool.
        for (endpoint, holders) in &before {
            if !holders.is_empty() {
                changed.insert(endpoint.clone());
            }
        }
        for (endpoint, holders) in &sources {
            let settled = self.pools.get(endpoint).is_some_and(|pool| !pool.has_unknown());
            if settled && !changed.contains(endpoint) {
                continue;
            }
            let mut held: Vec<(u64, u64)> =
                holders.values().flat_map(|held| held.blocks.iter().copied()).collect();
            // By hash, the earliest since first; keep that one. Each holder's blocks are one
            // sorted run, which the stable sort merges.
            held.sort();
            held.dedup_by_key(|held| held.0);
            let mut unknown = unknown.remove(endpoint).unwrap_or_default();
            unknown.sort_unstable();
            unknown.dedup();
            self.pools.entry(endpoint.clone()).or_default().update(now, &held, unknown);
        }
        self.holders = sources;
        self.catalog = settled::truth_catalog(dc, sim_dc_id());
        let next = registrations::truth_registrations(dc);
        self.registrations = registrations::carry_registrations(&self.registrations, next, now);
    }

    /// The words of `consumer`'s replica of `pool` (copied again only when its sequence moved).
    fn words(
        copies: &mut Copies,
        index: usize,
        consumer: &RelayConsumer,
        pool: &kvrelay_consumer::PoolReplicaState,
    ) -> Option<Arc<Vec<u64>>> {
        let pool_id = pool.producer.pool_id();
        let key = (index, pool_id);
        let sequence = pool.sequence?;
        if let Some((producer, seen, words)) = copies.get(&key)
            && *producer == pool.producer
            && *seen == sequence
        {
            return Some(Arc::clone(words));
        }
        let copy = consumer.filter_copy(&key.1)?;
        if copy.producer != pool.producer {
            return None;
        }
        let words = Arc::new(copy.words);
        copies.insert(key, (copy.producer, copy.sequence, Arc::clone(&words)));
        Some(words)
    }

    /// One bounded-staleness and registrations sample of consumer `index` (host `host`) at
    /// `now`.
    fn sample(&mut self, now: u64, index: usize, host: &str, consumer: &RelayConsumer) {
        let snapshot = consumer.snapshot();
        for key in &self.catalog {
            let Some(healthy_since) = self.health.healthy_since(now, index, &key.endpoint) else {
                continue;
            };
            let pool = snapshot.pools.iter().find(|pool| {
                pool.descriptor.serving_endpoint.to_string() == key.endpoint
                    && pool.producer.pool_id().to_string() == key.pool
            });
            // A pool missing from the catalog is bounded-staleness's to report (its held blocks
            // are absent); its registrations are judged once it is listed.
            let at = SampleAt { now, consumer: host, endpoint: &key.endpoint, healthy_since };
            if let Some(pool) = pool {
                self.following.observe(RegistrationSample {
                    at,
                    truth: self.registrations.get(&key.endpoint),
                    seen: &pool.descriptor.registrations,
                });
            }
            let Some(pool_truth) = self.pools.get_mut(&key.endpoint) else { continue };
            let words = pool.and_then(|pool| {
                pool_truth.address(Addressing::new(&pool.producer.format()));
                Self::words(&mut self.copies, index, consumer, pool)
            });
            self.staleness.observe(
                pool_truth,
                Sample { at, words: words.as_deref().map(Vec::as_slice), presence: self.presence },
            );
        }
    }
}

/// Bring the truth model up to date and sample every long-lived consumer (called by the
/// consumer observer at its cadence), from the start through quiescence until the final
/// evaluation begins.
pub(crate) fn sample_truth(world: &World) {
    let mut watch = lock(&world.truth);
    if watch.stopped {
        return;
    }
    let now = sim_ms();
    if watch.last_sample.is_some_and(|last| now < last + truth::TRUTH_SAMPLE_MS) {
        return;
    }
    watch.last_sample = Some(now);
    let version = world.dc_version.load(Ordering::Relaxed);
    world.dc.with(|dc| watch.update(now, version, dc));
    let consumers = lock(&world.consumers).clone();
    for (index, consumer) in consumers.iter().enumerate() {
        if let Some(consumer) = consumer {
            watch.sample(now, index, &crate::scenario::consumer_host(index), consumer);
        }
    }
}

/// The bounded-staleness verdict over every sample so far.
pub(crate) fn bounded_staleness(world: &World) -> Check {
    lock(&world.truth).staleness.check()
}

/// The registrations-follow-truth verdict over every sample so far.
pub(crate) fn registrations_follow_truth(world: &World) -> Check {
    lock(&world.truth).following.check()
}

/// Hashes no worker holds or held, drawn from the seed: the never-stored probes.
fn never_stored(seed: u64, watch: &TruthWatch, endpoint: &str) -> Vec<u64> {
    let mut rng = rng_from_seed(derive_seed(seed, &format!("sim/never-stored/{endpoint}")));
    let pool = watch.pools.get(endpoint);
    (0..truth::NEVER_STORED_PROBES)
        .map(|_| rng.next_u64())
        .filter(|hash| pool.is_none_or(|pool| !pool.holds(*hash)))
        .collect()
}

/// No stale blocks in `consumer`'s replicas of the pools `catalogued` shows (the truth brought
/// up to date first).
pub(crate) fn no_stale_blocks(
    world: &World,
    consumer: &RelayConsumer,
    catalogued: &ConsumerSnapshot,
) -> Check {
    let mut watch = lock(&world.truth);
    let version = world.dc_version.load(Ordering::Relaxed);
    world.dc.with(|dc| watch.update(sim_ms(), version, dc));
    let mut probed = Vec::new();
    for pool in &catalogued.pools {
        let endpoint = pool.descriptor.serving_endpoint.to_string();
        let never = never_stored(world.seed, &watch, &endpoint);
        let addressing = Addressing::new(&pool.producer.format());
        let empty = PoolTruth::default();
        let pool_truth = watch.pools.get(&endpoint).unwrap_or(&empty);
        let Some(copy) = consumer.filter_copy(&pool.producer.pool_id()) else {
            // No replica holds nothing stale; no-false-negatives reports the missing replica.
            continue;
        };
        probed.push(truth::probe_stale(&endpoint, pool_truth, &addressing, &never, &copy.words));
    }
    truth::no_stale_blocks(&probed)
}

/// The registrations `snapshot` shows for each pool against the truth model's.
pub(crate) fn registrations_equal_truth(world: &World, snapshot: &ConsumerSnapshot) -> Check {
    let truth = world.dc.with(|dc| registrations::truth_registrations(dc));
    let seen: Vec<(String, BTreeSet<registrations::RegistrationKey>)> = snapshot
        .pools
        .iter()
        .map(|pool| {
            (
                pool.descriptor.serving_endpoint.to_string(),
                registrations::registration_keys(&pool.descriptor.registrations),
            )
        })
        .collect();
    registrations::registrations_equal_truth(&truth, &seen)
}
