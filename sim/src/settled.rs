//! Oracles over the final state, as pure functions of what the checker gathered, and the
//! convergence timing they are judged against.
//!
//! - **catalog truth**: the catalog the relay must publish is the set of `(endpoint, pool)`
//!   pairs of the listed KV-publishing workers whose identity is unambiguous: an endpoint whose
//!   workers resolve to more than one indexer domain, and a domain claimed by more than one
//!   endpoint, are fenced and have no pool ([`truth_catalog`]);
//! - **converges-within-bound**: each long-lived consumer's catalog (pools and replica status),
//!   readiness and load reached their final state within [`CONVERGENCE_BOUND_MS`] of the last
//!   fault; load, which follows traffic, within the bound of the later of the last fault and
//!   traffic stopping ([`Settling`], [`converges_within_bound`]).
//!
//! Also, on what the checker gathered: no phantom pools, load equal to the truth occupancy, no
//! false negatives (bounded by capacity omissions), and how each consumer followed.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_consumer::client::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use kvrelay_consumer::{ConsumerCounters, ConsumerSnapshot, FaultKind, FilterStatus};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{DcId, PoolId, ProducerIdentity, resolve_indexer_domain};
use kvrelay_core::readiness::topology::TopologyEntry;
use kvrelay_core::wire::RelayErrorReason;
use kvrelay_dc::SimulatedDc;
use serde::Serialize;

use crate::Check;
use crate::oracles::verdict;
use crate::scenario::ConsumerExpectation;

/// How long after the last fault (simulated ms) every long-lived consumer's catalog, readiness
/// and load must have reached their final state (load: after the later of the last fault and
/// traffic stopping). A WAN partition drops segments without closing the connection, so a
/// consumer may learn its connection died only from HTTP/2 keepalive — a ping interval plus
/// its timeout after the partition began, which may be after the repair — and then reconnects
/// with backoff and resubscribes; [`RECONNECT_MARGIN_MS`] covers the reconnect, a lease's TTL,
/// a DC-plane probe and relist, and recovery queries timing out and retrying.
pub const CONVERGENCE_BOUND_MS: u64 =
    (KEEPALIVE_INTERVAL.as_secs() + KEEPALIVE_TIMEOUT.as_secs()) * 1000 + RECONNECT_MARGIN_MS;

/// The part of [`CONVERGENCE_BOUND_MS`] beyond dead-connection detection.
pub const RECONNECT_MARGIN_MS: u64 = 10_000;

/// A catalogued pool as the oracles compare it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PoolKey {
    /// Serving endpoint.
    pub endpoint: String,
    /// Pool id (`domain/dc`).
    pub pool: String,
}

impl PoolKey {
    /// The key of `pool_id` served at `endpoint`.
    #[must_use]
    pub fn new(endpoint: impl std::fmt::Display, pool_id: &PoolId) -> Self {
        PoolKey { endpoint: endpoint.to_string(), pool: pool_id.to_string() }
    }

    /// The keys of every pool in `snapshot`'s catalog.
    #[must_use]
    pub fn of_snapshot(snapshot: &ConsumerSnapshot) -> Vec<PoolKey> {
        snapshot
            .pools
            .iter()
            .map(|pool| PoolKey::new(&pool.descriptor.serving_endpoint, &pool.producer.pool_id()))
            .collect()
    }
}

/// The pools the truth model says the relay must catalog: every listed KV-publishing worker's
/// `(endpoint, pool)` from its card's identity inputs, leaving out endpoints that resolve to
/// several domains and domains that several endpoints claim (both are fenced).
#[must_use]
pub fn truth_catalog(dc: &SimulatedDc, dc_id: DcId) -> BTreeSet<PoolKey> {
    let mut domains: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut endpoints: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for worker in dc.listed_workers().filter(|worker| worker.spec().publishes_kv) {
        let card = worker.card();
        let format = if card.runtime_config.enable_eagle {
            HashFormat::EagleV1
        } else {
            HashFormat::StandardV1
        };
        let endpoint = &worker.spec().endpoint;
        let Ok(domain) = resolve_indexer_domain(
            card.source_path.as_deref().unwrap_or(&card.display_name),
            card.kv_cache_block_size,
            format,
            endpoint,
            card.indexer_identity.as_ref(),
        ) else {
            continue;
        };
        let pool = PoolId { indexer_domain: domain, dc_id }.to_string();
        domains.entry(endpoint.to_string()).or_default().insert(pool.clone());
        endpoints.entry(pool).or_default().insert(endpoint.to_string());
    }
    domains
        .into_iter()
        .filter_map(|(endpoint, pools)| {
            let [pool] = <[String; 1]>::try_from(pools.into_iter().collect::<Vec<_>>()).ok()?;
            (endpoints[&pool].len() == 1).then_some(PoolKey { endpoint, pool })
        })
        .collect()
}

/// A value and the simulated ms at which it last changed.
type Since<T> = Option<(T, u64)>;

/// When each part of one consumer's view last changed (simulated ms), fed every observation.
#[derive(Debug, Clone, Default)]
pub struct Settling {
    catalog: Since<Vec<(ProducerIdentity, FilterStatus)>>,
    readiness: Since<Vec<TopologyEntry>>,
    load: Since<Vec<(ProducerIdentity, Option<u64>, u32)>>,
}

fn changed<T: PartialEq>(slot: &mut Since<T>, value: T, ms: u64) {
    if slot.as_ref().is_none_or(|(last, _)| *last != value) {
        *slot = Some((value, ms));
    }
}

impl Settling {
    /// Note the consumer's view at `ms`.
    pub fn observe(&mut self, ms: u64, snapshot: &ConsumerSnapshot) {
        // The producer names the pool (its id derives from the endpoint's routing scope).
        let catalog = snapshot.pools.iter().map(|pool| (pool.producer, pool.status)).collect();
        changed(&mut self.catalog, catalog, ms);
        if self.readiness.as_ref().is_none_or(|(last, _)| *last != snapshot.readiness) {
            changed(&mut self.readiness, snapshot.readiness.clone(), ms);
        }
        let load = snapshot
            .load
            .iter()
            .map(|load| (load.producer, load.kv_used_blocks, load.kv_observed_ranks))
            .collect();
        changed(&mut self.load, load, ms);
    }

    /// When the catalog, readiness and load last changed (0 for a part never observed).
    #[must_use]
    pub fn last_changes(&self) -> [u64; 3] {
        [
            self.catalog.as_ref().map_or(0, |(_, ms)| *ms),
            self.readiness.as_ref().map_or(0, |(_, ms)| *ms),
            self.load.as_ref().map_or(0, |(_, ms)| *ms),
        ]
    }
}

/// When a run's consumers reached their final state, against its last fault.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Convergence {
    /// The last fault applied (0 without faults).
    pub last_fault_ms: u64,
    /// When traffic stopped.
    pub traffic_off_ms: u64,
    /// The latest last change of any long-lived consumer's catalog (pools and replica status).
    pub catalog_ms: u64,
    /// The latest last change of any long-lived consumer's readiness.
    pub readiness_ms: u64,
    /// The latest last change of any long-lived consumer's load.
    pub load_ms: u64,
}

impl Convergence {
    /// From the last fault, traffic-off and every consumer's [`Settling`].
    #[must_use]
    pub fn of(last_fault_ms: u64, traffic_off_ms: u64, settlings: &[Settling]) -> Self {
        let latest = |part: usize| {
            settlings.iter().map(|settling| settling.last_changes()[part]).max().unwrap_or(0)
        };
        Convergence {
            last_fault_ms,
            traffic_off_ms,
            catalog_ms: latest(0),
            readiness_ms: latest(1),
            load_ms: latest(2),
        }
    }

    /// Milliseconds from the last fault to the later of catalog and readiness convergence.
    #[must_use]
    pub fn after_last_fault_ms(&self) -> u64 {
        self.catalog_ms.max(self.readiness_ms).saturating_sub(self.last_fault_ms)
    }

    /// One line: each part's time and its distance from its reference.
    #[must_use]
    pub fn describe(&self) -> String {
        let load_from = self.last_fault_ms.max(self.traffic_off_ms);
        format!(
            "last fault {} ms: catalog {} ms (+{}), readiness {} ms (+{}); load {} ms (+{} after \
             the later of last fault and traffic-off {} ms)",
            self.last_fault_ms,
            self.catalog_ms,
            self.catalog_ms.saturating_sub(self.last_fault_ms),
            self.readiness_ms,
            self.readiness_ms.saturating_sub(self.last_fault_ms),
            self.load_ms,
            self.load_ms.saturating_sub(load_from),
            self.traffic_off_ms
        )
    }
}

/// Catalog and readiness reached their final state within [`CONVERGENCE_BOUND_MS`] of the
/// last fault, load within it of the later of the last fault and traffic-off.
#[must_use]
pub fn converges_within_bound(convergence: &Convergence) -> Check {
    let fault_bound = convergence.last_fault_ms + CONVERGENCE_BOUND_MS;
    let load_bound =
        convergence.last_fault_ms.max(convergence.traffic_off_ms) + CONVERGENCE_BOUND_MS;
    let passed = convergence.catalog_ms <= fault_bound
        && convergence.readiness_ms <= fault_bound
        && convergence.load_ms <= load_bound;
    Check {
        name: "converges-within-bound",
        passed,
        detail: format!("{}; bound {CONVERGENCE_BOUND_MS} ms", convergence.describe()),
    }
}

/// Every catalogued pool is one the truth model says exists.
#[must_use]
pub fn no_phantom_pools(truth: &BTreeSet<PoolKey>, catalog: &[PoolKey]) -> Check {
    let phantoms: Vec<String> = catalog
        .iter()
        .filter(|key| !truth.contains(key))
        .map(|key| format!("{} ({}) is not in the truth model", key.endpoint, key.pool))
        .collect();
    let fine = format!("{} pools, each with a listed publisher of its identity", catalog.len());
    verdict("no-phantom-pools", &phantoms, fine)
}

/// One catalogued pool's load at a consumer against the truth model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSeen {
    /// Serving endpoint.
    pub endpoint: String,
    /// Blocks the truth model says the pool's listed workers hold.
    pub truth: u64,
    /// The consumer's `kv_used_blocks` for the pool (`None`: incomplete or absent).
    pub used: Option<u64>,
}

/// Every catalogued pool's load is complete and equals the truth model's occupancy.
#[must_use]
pub fn load_converges(pools: &[LoadSeen]) -> Check {
    let wrong: Vec<String> = pools
        .iter()
        .filter(|pool| pool.used != Some(pool.truth))
        .map(|pool| format!("{}: {:?} used, truth {}", pool.endpoint, pool.used, pool.truth))
        .collect();
    let fine = format!("{} pools report their truth occupancy", pools.len());
    verdict("load-converges", &wrong, fine)
}

/// The consumer's streams to `pools` expected pools went as `expectation` says.
#[must_use]
pub fn consumer_followed(
    expectation: ConsumerExpectation,
    pools: usize,
    relay_lag_ends: u64,
    counters: &ConsumerCounters,
) -> Check {
    let pools = pools as u64;
    let passed = match expectation {
        ConsumerExpectation::Any => true,
        ConsumerExpectation::Resubscribed => {
            counters.subscriptions > pools && counters.installs > pools
        }
        ConsumerExpectation::KeptStreams => {
            counters.subscriptions == pools && counters.replicas_dropped == 0
        }
        // The consumer reads a lagging end's status only when its link delivers it before the
        // relay closes the connection (a slow link often does not): the relay's own count of
        // the streams it ended for lag counts too.
        ConsumerExpectation::Lagged => {
            (lagged_ends(counters) > 0 || relay_lag_ends > 0)
                && counters.subscriptions > pools
                && counters.installs > pools
        }
    };
    Check {
        name: "consumer-followed",
        passed,
        detail: format!(
            "expected {expectation:?}: {} subscriptions, {} installs, {} replicas dropped, {} \
             streams ended as lagging (relay: {relay_lag_ends})",
            counters.subscriptions,
            counters.installs,
            counters.replicas_dropped,
            lagged_ends(counters)
        ),
    }
}

/// Streams the relay ended as a lagging subscriber, on every plane.
fn lagged_ends(counters: &ConsumerCounters) -> u64 {
    let lagged = FaultKind::Reason(RelayErrorReason::SubscriberLagged);
    counters.faults.iter().filter(|((_, kind), _)| *kind == lagged).map(|(_, count)| count).sum()
}

/// One catalogued pool's truth blocks probed in a consumer's replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probed {
    /// Serving endpoint.
    pub endpoint: String,
    /// Distinct canonical blocks the truth model says the pool's listed workers hold (a block
    /// cached by several ranks counts once: the pool's filter holds it once).
    pub cached: usize,
    /// How many of them the replica does not contain (`None`: no replica).
    pub absent: Option<usize>,
    /// Fingerprint slots of the pool's filter format (buckets × 4), full or not.
    pub slots: u64,
}

/// The load factor a CKF v1 filter (4-slot buckets, up to 500 relocations per insertion) reaches
/// before its first failed insertion, with margin: insertions into 4-way cuckoo tables first
/// fail near 95 % occupancy.
pub const CAPACITY_LOAD_FLOOR: f64 = 0.9;

/// No truth block is absent from a replica, except with `capacity` omissions: then the filter
/// holds at least [`CAPACITY_LOAD_FLOOR`] of its slots before it omits anything, so at most the
/// truth's distinct blocks beyond that many may be absent, and some must be (the scenario
/// promised the filter overflows). The bound comes from the truth and the filter's format, not
/// from the replica's own occupancy.
#[must_use]
pub fn no_false_negatives(pools: &[Probed], capacity: bool) -> Check {
    let mut cached_total = 0usize;
    let mut omitted_total = 0usize;
    let mut missing = Vec::new();
    for pool in pools {
        cached_total += pool.cached;
        let Some(absent) = pool.absent else {
            missing.push(format!("{}: no replica", pool.endpoint));
            continue;
        };
        let allowed = if capacity {
            let fillable = (pool.slots as f64 * CAPACITY_LOAD_FLOOR).floor() as usize;
            pool.cached.saturating_sub(fillable)
        } else {
            0
        };
        omitted_total += absent.min(allowed);
        if absent > allowed {
            missing.push(format!(
                "{}: {absent} of {} missing (allowed {allowed})",
                pool.endpoint, pool.cached
            ));
        }
    }
    let passed = missing.is_empty() && (cached_total > 0 || pools.is_empty());
    let passed = passed && (!capacity || omitted_total > 0);
    Check {
        name: "no-false-negatives",
        passed,
        detail: if missing.is_empty() {
            format!(
                "{cached_total} distinct cached blocks: {omitted_total} capacity omissions, the \
                 rest present"
            )
        } else {
            missing.join(", ")
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(endpoint: &str, pool: &str) -> PoolKey {
        PoolKey { endpoint: endpoint.into(), pool: pool.into() }
    }

    /// The truth catalog of a DC of `workers` (TOML `[[topology.workers]]` tables), by endpoint.
    fn truth_endpoints(workers: &str) -> Vec<String> {
        let text = format!(
            "run_ms = 1000\n[topology]\n{workers}\n[expect]\npools = 0\nreadiness = {{}}\n"
        );
        let scenario = crate::scenario::Scenario::parse(&text, "t").unwrap();
        let mut rng = kvrelay_core::rng::rng_from_seed(1);
        let dc = SimulatedDc::start(&scenario.deployment().unwrap(), scenario.traffic(), &mut rng);
        let dc_id = kvrelay_core::model::identity::stable_dc_id("t").unwrap();
        truth_catalog(&dc, dc_id).into_iter().map(|key| key.endpoint).collect()
    }

    fn worker(endpoint: &str, extra: &str) -> String {
        format!("[[topology.workers]]\nendpoint = \"{endpoint}\"\nmodel = \"m\"\n{extra}\n")
    }

    #[test]
    fn the_truth_catalog_fences_ambiguous_identities() {
        let plain = worker("a/b/c", "replicas = 2") + &worker("d/e/f", "");
        assert_eq!(truth_endpoints(&plain), ["a/b/c", "d/e/f"]);
        // Eagle and standard workers on one endpoint: two domains, the endpoint is fenced.
        let mixed = worker("a/b/c", "") + &worker("a/b/c", "eagle = true") + &worker("d/e/f", "");
        assert_eq!(truth_endpoints(&mixed), ["d/e/f"]);
        // Two endpoints claiming one routing pool: both fenced.
        let shared = worker("a/b/c", "routing_pool = \"p\"")
            + &worker("d/e/f", "routing_pool = \"p\"")
            + &worker("g/h/i", "");
        assert_eq!(truth_endpoints(&shared), ["g/h/i"]);
        // An encode worker publishes no KV.
        assert!(truth_endpoints(&worker("a/b/c", "role = \"encode\"")).is_empty());
    }

    #[test]
    fn a_catalogued_pool_outside_the_truth_is_a_phantom() {
        let truth: BTreeSet<PoolKey> = [key("a/b/c", "p1"), key("d/e/f", "p2")].into();
        assert!(no_phantom_pools(&truth, &[key("a/b/c", "p1")]).passed);
        assert!(no_phantom_pools(&truth, &[]).passed);
        // An unknown endpoint, and a known endpoint under another identity.
        assert!(!no_phantom_pools(&truth, &[key("x/y/z", "p3")]).passed);
        let wrong_identity = no_phantom_pools(&truth, &[key("a/b/c", "p1"), key("a/b/c", "p9")]);
        assert!(!wrong_identity.passed);
        assert!(wrong_identity.detail.contains("p9"), "{}", wrong_identity.detail);
    }

    #[test]
    fn load_must_be_complete_and_equal_the_truth() {
        let seen = |used| vec![LoadSeen { endpoint: "a/b/c".into(), truth: 40, used }];
        assert!(load_converges(&seen(Some(40))).passed);
        assert!(!load_converges(&seen(Some(39))).passed);
        assert!(!load_converges(&seen(None)).passed);
    }

    #[test]
    fn consumer_expectations_are_judged_on_the_counters() {
        let counters = |subscriptions, installs, replicas_dropped| ConsumerCounters {
            subscriptions,
            installs,
            replicas_dropped,
            ..ConsumerCounters::default()
        };
        let kept = ConsumerExpectation::KeptStreams;
        let resubscribed = ConsumerExpectation::Resubscribed;
        assert!(consumer_followed(kept, 2, 0, &counters(2, 2, 0)).passed);
        assert!(!consumer_followed(kept, 2, 0, &counters(3, 3, 0)).passed);
        assert!(!consumer_followed(kept, 2, 0, &counters(2, 2, 1)).passed);
        assert!(consumer_followed(resubscribed, 2, 0, &counters(3, 3, 1)).passed);
        assert!(!consumer_followed(resubscribed, 2, 0, &counters(2, 2, 0)).passed);
        assert!(consumer_followed(ConsumerExpectation::Any, 2, 0, &counters(0, 0, 0)).passed);
        // Lagged: resubscribed is not enough, the relay must have ended a stream as lagging.
        let lagged = ConsumerExpectation::Lagged;
        let mut ended = counters(3, 3, 1);
        assert!(!consumer_followed(lagged, 2, 0, &ended).passed);
        let plane = kvrelay_consumer::Plane::Filter;
        ended.faults.insert((plane, FaultKind::Reason(RelayErrorReason::SubscriberLagged)), 1);
        let check = consumer_followed(lagged, 2, 0, &ended);
        assert!(check.passed && check.detail.contains("1 streams ended as lagging"), "{check:?}");
        // A lagging end the consumer never came back from is no lagged follow.
        let mut stuck = counters(2, 2, 1);
        stuck.faults = ended.faults.clone();
        assert!(!consumer_followed(lagged, 2, 0, &stuck).passed);
        // The relay's count stands in for a status the consumer never read.
        let unread = counters(3, 3, 1);
        assert!(consumer_followed(lagged, 2, 1, &unread).passed);
        assert!(!consumer_followed(lagged, 2, 1, &counters(2, 2, 0)).passed);
    }

    fn probed(cached: usize, absent: Option<usize>, slots: u64) -> Vec<Probed> {
        vec![Probed { endpoint: "a/b/c".into(), cached, absent, slots }]
    }

    #[test]
    fn an_absent_block_is_a_false_negative_without_capacity_omissions() {
        assert!(no_false_negatives(&probed(100, Some(0), 100), false).passed);
        assert!(!no_false_negatives(&probed(100, Some(1), 100), false).passed);
        assert!(!no_false_negatives(&probed(100, None, 0), false).passed);
        // Nothing cached in a catalogued pool: the oracle saw no traffic, which is no pass.
        assert!(!no_false_negatives(&probed(0, Some(0), 0), false).passed);
    }

    #[test]
    fn capacity_omissions_are_bounded_by_the_filter_format_and_must_occur() {
        // 2,000 distinct cached blocks, 1,000 slots: the filter holds at least 900 before it
        // omits, so up to 1,100 may be absent.
        assert!(no_false_negatives(&probed(2000, Some(1100), 1000), true).passed);
        assert!(no_false_negatives(&probed(2000, Some(10), 1000), true).passed);
        let beyond = no_false_negatives(&probed(2000, Some(1101), 1000), true);
        assert!(!beyond.passed);
        assert!(beyond.detail.contains("1101 of 2000 missing (allowed 1100)"), "{}", beyond.detail);
        // A filter large enough for every block may omit none.
        assert!(!no_false_negatives(&probed(800, Some(1), 1000), true).passed);
        // The scenario promised an overflowing filter: no omission at all fails.
        assert!(!no_false_negatives(&probed(2000, Some(0), 1000), true).passed);
    }

    #[test]
    fn convergence_is_bounded_from_the_last_fault_and_load_from_traffic_off() {
        let convergence = Convergence {
            last_fault_ms: 6000,
            traffic_off_ms: 12_000,
            catalog_ms: 6000 + CONVERGENCE_BOUND_MS,
            readiness_ms: 6100,
            load_ms: 12_000 + CONVERGENCE_BOUND_MS,
        };
        assert!(converges_within_bound(&convergence).passed);
        let late_catalog = Convergence { catalog_ms: convergence.catalog_ms + 1, ..convergence };
        assert!(!converges_within_bound(&late_catalog).passed);
        let late_readiness =
            Convergence { readiness_ms: 6001 + CONVERGENCE_BOUND_MS, ..convergence };
        assert!(!converges_within_bound(&late_readiness).passed);
        let late_load = Convergence { load_ms: convergence.load_ms + 1, ..convergence };
        assert!(!converges_within_bound(&late_load).passed);
    }

    #[test]
    fn the_latest_consumer_decides_each_part() {
        let mut early = Settling::default();
        let mut late = Settling::default();
        let note = |settling: &mut Settling, ms| {
            changed(&mut settling.catalog, Vec::new(), ms);
            changed(&mut settling.readiness, Vec::new(), ms);
            changed(&mut settling.load, Vec::new(), ms);
        };
        note(&mut early, 100);
        note(&mut early, 200);
        note(&mut late, 300);
        assert_eq!(early.last_changes(), [100; 3], "an unchanged view keeps its time");
        early.load = Some((Vec::new(), 350));
        assert_eq!(early.last_changes(), [100, 100, 350]);
        let mut slot = None;
        for (value, ms) in [(1, 10), (1, 20), (2, 30), (2, 40)] {
            changed(&mut slot, value, ms);
        }
        assert_eq!(slot, Some((2, 30)), "a change restarts the time, a repeat does not");
        let convergence = Convergence::of(50, 400, &[early, late]);
        assert_eq!((convergence.catalog_ms, convergence.load_ms), (300, 350));
        assert_eq!(convergence.after_last_fault_ms(), 250);
    }
}
