//! The deterministic simulator of kvrelay.
//!
//! One turmoil simulation per (seed, scenario file). Hosts:
//!
//! - `relay` runs a relay node (production code through its seams: turmoil time, a simulated
//!   wall clock with optional skew, seeded RNG, the inline executor) and serves the WAN
//!   contract on a turmoil listener. Its factory rebuilds every piece of state, so a scripted
//!   `relay-restart` (a turmoil bounce) boots a new incarnation that relists discovery and
//!   recovers every rank from the workers.
//! - `dc` drives the simulated DC ([`SimulatedDc`], the model `kvrelay demo` uses too): traffic
//!   every tick, sent with the workers' registrations to host `planes` over turmoil TCP, one
//!   frame per tick.
//! - `planes` serves the simulated DC planes ([`planes`]) to the relay host over turmoil TCP:
//!   discovery as the JSON records a Dynamo worker writes, under leases, listed and watched by
//!   revision and read by the production record differ; `kv-events` and `kv_metrics` as the
//!   envelope bytes the production decoders read; recovery queries answered by the workers. A
//!   DC-plane partition is a turmoil partition (drop) or hold (stall) between `relay` and
//!   `planes`.
//! - `consumer-a`, `consumer-b`, ... (`[topology] consumers`, default 2) each run the reference
//!   [`RelayConsumer`] over turmoil's network; WAN faults target one of them (or all).
//! - `checker` plays the scenario's fault script at its simulated times, records the truth
//!   model, observes every consumer, then stops traffic, lets the system quiesce and evaluates
//!   the oracles over every consumer (see [`oracles`] for the trace oracles and [`Sim::run`] for the final ones).
//!
//! [`replay`] runs a recorded journal's node on the same kind of relay host, fed the journaled
//! inputs instead of the DC, with faults layered on; [`incident`] turns a journal window into a
//! suite entry. [`Sim::record`] journals a run's relay boots as `kvrelay serve --record` does.
//!
//! Everything random derives from the one seed, so the trace digest is a function of seed and
//! scenario file. Run `cargo run --profile test -p kvrelay-sim -- run scenarios/steady.toml --seed 0` (the test profile reuses the build `cargo test` made).

pub mod incident;
pub mod net;
mod observed;
pub mod oracles;
pub mod planes;
pub mod replay;
pub mod scenario;
pub mod settled;
pub mod shrink;
pub mod timeline;
pub mod trace;
pub mod truth;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use kvrelay::config::WanTuning;
use kvrelay::demo::SharedDc;
use kvrelay::node::{NodeConfig, NodeHandle, RecoveryTransport, start_node_with_tap};
use kvrelay::pool::PoolConfig;
use kvrelay::publication::{HubConfig, PoolPublications};
use kvrelay::runtime::{InlineExecutor, WallClock};
use kvrelay::wan::{WanViews, serve};
use kvrelay_consumer::{ConsumerConfig, ConsumerSnapshot, FilterStatus, RelayConsumer};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::filter::ckf::{Addressing, word_contains};
use kvrelay_core::inputs::{DcInput, WorkerType, normalize_legacy_prefill};
use kvrelay_core::model::identity::{DcId, PoolId, ProducerIdentity, RelayIdentity, stable_dc_id};
use kvrelay_core::pool::{PoolDigest, filter_words_digest};
use kvrelay_core::rng::{RelayRng, derive_seed, rng_from_seed};
use kvrelay_core::wire::{validate_catalog_update, validate_readiness_update};
use kvrelay_dc::SimulatedDc;
use serde::Serialize;
use tokio::sync::watch;

use crate::observed::TruthWatch;
use crate::planes::client::PlanesClient;
use crate::planes::publisher::{Link, Publisher};
use crate::planes::{PLANES_HOST, Planes};
use crate::scenario::{ConsumerTarget, Expect, Fault, Scenario, ScriptedFault};
use crate::settled::{Convergence, LoadSeen, PoolKey, Probed, Settling};
use crate::trace::{ConsumerTrace, EntryTrace, ProducerTrace, Stamped, Trace, TraceEvent};

/// The relay host's name on turmoil's network.
pub const RELAY_HOST: &str = "relay";
/// The DC driver's host.
pub const DC_HOST: &str = "dc";
/// The first long-lived consumer host's name (see [`scenario::consumer_host`]).
pub const CONSUMER_HOST: &str = "consumer-a";
/// The host that plays the scenario and evaluates the oracles.
pub const CHECKER_HOST: &str = "checker";
/// The WAN port of the relay.
pub const RELAY_PORT: u16 = 7000;
/// Simulated wall-clock start: 2026-01-01T00:00:00Z.
pub const EPOCH_UNIX_SECONDS: u64 = 1_767_225_600;
/// Upper bound of simulated time per run.
pub const SIMULATION_DURATION: Duration = Duration::from_secs(900);
/// turmoil's step: every host runs once per step, a message crosses a link in whole steps, and a
/// timer fires at the first step at or after its deadline (the relay's 1 ms publication delay
/// takes one step; scripted fault times round up to a step). Scenario timers are tens of ms and
/// up; 1 ms steps spent most of a quiet run entering the six hosts' runtimes.
pub const TICK: Duration = Duration::from_millis(5);
/// Segments a simulated TCP socket buffers (turmoil's default is 64). A fleet's first recovery
/// wave puts hundreds of queries on the planes link at once while hundreds of answers come
/// back; with 64 both sides could block on writes until the link was given up. Production
/// sockets buffer far more.
pub const TCP_CAPACITY: usize = 4096;

/// How long traffic stays off before the oracles look.
const QUIESCENCE: Duration = Duration::from_secs(3);
/// How long the oracles wait (simulated time) for catalog, readiness, replicas, blocks and load
/// to converge after quiescence, each; how soon they must have converged after the last fault
/// is [`settled::CONVERGENCE_BOUND_MS`].
const CONVERGENCE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the observers sample the relay and the consumer.
const RELAY_SAMPLE: Duration = Duration::from_millis(5);
const CONSUMER_SAMPLE: Duration = Duration::from_millis(20);
/// How often the planes host runs its leases.
const LEASE_TICK: Duration = Duration::from_millis(50);
/// How long (wall-clock) a consumer's HTTP/2 connection remembers streams it reset: longer than
/// any run, so h2's real-time expiry never decides how a late frame is treated.
const H2_RESET_MEMORY: Duration = Duration::from_secs(24 * 3600);

/// Step `sim` until its clients are done (or it fails: the error), bouncing the relay host
/// whenever `bounce` asks.
fn step_to_end(sim: &mut turmoil::Sim<'_>, bounce: &net::Bounce) -> Option<String> {
    loop {
        if bounce.take() {
            sim.bounce(RELAY_HOST);
        }
        match sim.step() {
            Ok(true) => return None,
            Ok(false) => {}
            Err(error) => return Some(error.to_string()),
        }
    }
}

/// A run's determinism witness: its trace's digest and the final state's, combined.
fn run_digest(trace: &[Stamped], final_digest: &str) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(trace::digest(trace).as_bytes());
    hasher.update(final_digest.as_bytes());
    hasher.finalize().to_hex()[..16].to_owned()
}

/// Simulated milliseconds since the start of the current simulation (0 outside one).
#[must_use]
pub fn sim_ms() -> u64 {
    let elapsed = turmoil::sim_elapsed().unwrap_or_default();
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

/// A wall clock reading turmoil's simulated time since the builder's fixed epoch, shifted by a
/// scriptable skew.
#[derive(Debug, Clone, Default)]
pub struct SimWallClock {
    skew_ms: Arc<AtomicI64>,
}

impl WallClock for SimWallClock {
    fn now_unix_us(&self) -> u64 {
        let since_epoch = turmoil::since_epoch().unwrap_or(Duration::from_secs(EPOCH_UNIX_SECONDS));
        let now = i128::try_from(since_epoch.as_micros()).unwrap_or(i128::MAX);
        let skewed = now + i128::from(self.skew_ms.load(Ordering::Relaxed)) * 1000;
        u64::try_from(skewed.max(0)).unwrap_or(u64::MAX)
    }
}

/// The result of one oracle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The oracle's name.
    pub name: &'static str,
    /// Whether it held.
    pub passed: bool,
    /// What it saw.
    pub detail: String,
}

/// One catalogued pool as the final view shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FinalPool {
    /// Serving endpoint.
    pub endpoint: String,
    /// Roles of the endpoint's workers.
    pub roles: Vec<String>,
    /// Canonical model ids registered.
    pub models: Vec<String>,
    /// Filter status at the first long-lived consumer.
    pub status: &'static str,
}

/// The final catalog, readiness and a compact trace summary (what the snapshots hold).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct FinalView {
    /// Pools in the first long-lived consumer's catalog.
    pub catalog: Vec<FinalPool>,
    /// Its readiness entries.
    pub readiness: Vec<EntryTrace>,
    /// Trace events by kind.
    pub trace_counts: BTreeMap<String, usize>,
    /// Every fault applied, in order, as `ms action`.
    pub faults: Vec<String>,
    /// Relay boots.
    pub relay_boots: u64,
    /// When the long-lived consumers' catalog, readiness and load reached their final state.
    pub convergence: Convergence,
}

/// What one simulated run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The run's seed.
    pub seed: u64,
    /// The scenario's name.
    pub scenario: String,
    /// The scenario's file.
    pub file: String,
    /// Every oracle's result, in evaluation order.
    pub checks: Vec<Check>,
    /// Digest of the trace and the final replicas: the determinism witness.
    pub digest: String,
    /// The recorded trace.
    pub trace: Vec<Stamped>,
    /// The final view.
    pub view: FinalView,
    /// The simulation itself failed (a host errored or the run exceeded its duration).
    pub error: Option<String>,
    /// Simulated time the run took.
    pub simulated: Duration,
}

impl Outcome {
    /// Every oracle held and the simulation completed.
    #[must_use]
    pub fn passed(&self) -> bool {
        all_passed(&self.checks, self.error.as_deref())
    }

    /// The one command that reproduces this run.
    #[must_use]
    pub fn reproduce_command(&self) -> String {
        format!("cargo run --profile test -p kvrelay-sim -- run {} --seed {}", self.file, self.seed)
    }

    /// The first failing oracle (or the simulation error), one line.
    #[must_use]
    pub fn failure(&self) -> Option<String> {
        first_failure(&self.checks, self.error.as_deref())
    }

    /// A human-readable report.
    #[must_use]
    pub fn render(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(text, "scenario {} seed {}", self.scenario, self.seed);
        render_checks(&mut text, &self.checks, self.error.as_deref());
        let _ = writeln!(text, "  converged: {}", self.view.convergence.describe());
        let _ = writeln!(text, "  digest {} ({} trace events)", self.digest, self.trace.len());
        if !self.passed() {
            let _ = writeln!(text, "  reproduce: {}", self.reproduce_command());
        }
        text
    }
}

/// Every check held and the simulation completed (`error` is `None`).
fn all_passed(checks: &[Check], error: Option<&str>) -> bool {
    error.is_none() && !checks.is_empty() && checks.iter().all(|c| c.passed)
}

/// The simulation error or the first failing check, one line.
fn first_failure(checks: &[Check], error: Option<&str>) -> Option<String> {
    if let Some(error) = error {
        return Some(format!("simulation: {error}"));
    }
    checks.iter().find(|c| !c.passed).map(|c| format!("{}: {}", c.name, c.detail))
}

/// One line per check, then the simulation error if any.
fn render_checks(text: &mut String, checks: &[Check], error: Option<&str>) {
    for check in checks {
        let verdict = if check.passed { "ok  " } else { "FAIL" };
        let _ = writeln!(text, "  {verdict} {}: {}", check.name, check.detail);
    }
    if let Some(error) = error {
        let _ = writeln!(text, "  FAIL simulation: {error}");
    }
}

/// The oracles' checks, the final-state digest and the final view.
type Verdict = (Vec<Check>, String, FinalView);

/// State shared between the hosts (turmoil runs every host on one OS thread).
#[derive(Clone)]
struct World {
    seed: u64,
    scenario: Arc<Scenario>,
    script: Arc<Vec<ScriptedFault>>,
    dc: SharedDc,
    plane: Arc<Mutex<Planes>>,
    publisher: Arc<Mutex<Publisher>>,
    skew_ms: Arc<AtomicI64>,
    boots: Arc<AtomicU64>,
    bounce: net::Bounce,
    traffic_off: Arc<AtomicBool>,
    decode_errors: Arc<AtomicU64>,
    /// The long-lived consumers by index, each once its host started it.
    consumers: Arc<Mutex<Vec<Option<Arc<RelayConsumer>>>>>,
    /// Each long-lived consumer's link bandwidth, by index (unlimited unless a fault sets it).
    bandwidth: Arc<Vec<net::Bandwidth>>,
    /// Streams each relay boot ended for lag (sampled every relay sample).
    slow_ends: SlowEnds,
    /// When each long-lived consumer's view last changed, by index.
    settling: Arc<Mutex<Vec<Settling>>>,
    /// The current relay boot's publications (the pools' own filters).
    publications: Arc<Mutex<Option<Arc<PoolPublications>>>>,
    /// Bumped whenever the DC's state may have changed (a tick, a fault, a lease expiry).
    dc_version: Arc<AtomicU64>,
    /// The truth oracles' view of every pool and the in-run staleness samples.
    truth: Arc<Mutex<TruthWatch>>,
    trace: Trace,
    done: watch::Sender<bool>,
    result: Arc<Mutex<Option<Verdict>>>,
    record: Option<PathBuf>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One simulation: a seeded turmoil builder.
pub struct Sim {
    seed: u64,
    builder: turmoil::Builder,
    record: Option<PathBuf>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim").field("seed", &self.seed).finish_non_exhaustive()
    }
}

impl Sim {
    /// A simulation whose every random choice derives from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        let mut builder = turmoil::Builder::new();
        builder
            .rng_seed(seed)
            .epoch(UNIX_EPOCH + Duration::from_secs(EPOCH_UNIX_SECONDS))
            .simulation_duration(SIMULATION_DURATION)
            .tick_duration(TICK)
            .tcp_capacity(TCP_CAPACITY);
        Sim { seed, builder, record: None }
    }

    /// Journal every relay boot's inputs under `root` (one recording directory per boot, named
    /// as `kvrelay serve --record` names them), a checkpoint every second of inputs.
    #[must_use]
    pub fn record(mut self, root: PathBuf) -> Self {
        self.record = Some(root);
        self
    }

    /// Play `scenario` to the end and evaluate the oracles: the trace oracles of [`oracles`],
    /// then on the final state
    ///
    /// - **catalog-and-readiness-converge**: every long-lived consumer and a fresh one hold
    ///   exactly the truth model's catalog ([`settled::truth_catalog`]), the expected pool count
    ///   (every replica ready) and exactly the expected readiness;
    /// - **replica-equals-relay**: every replica of every long-lived consumer has the producer,
    ///   sequence and filter words of the relay's own pool (read from its pools);
    /// - **no-false-negatives**: every canonical block the truth model says a pool's listed
    ///   workers hold is in every long-lived consumer's replica (with expected capacity
    ///   omissions: at most the distinct blocks beyond what the filter's format must hold);
    /// - **load-converges**: at every long-lived consumer, every catalogued pool's load is
    ///   complete and sums the truth model's occupancy of its listed workers (workers report
    ///   once more when traffic stops);
    /// - **converges-within-bound**: the consumers' catalog and readiness settled within
    ///   [`settled::CONVERGENCE_BOUND_MS`] of the last fault, their load within it of the later
    ///   of the last fault and traffic-off;
    /// - **no-stale-blocks**, **bounded-staleness**, **registrations-equal-truth** and
    ///   **registrations-follow-truth**: the replicas and registrations against the workload
    ///   model's exact state, after quiescence and during the run (see [`truth`]);
    /// - **no-phantom-pools**: every catalogued `(endpoint, pool id)` is in the truth catalog;
    /// - **consumer-followed**: the scenario's expectation of each consumer's streams.
    #[must_use]
    pub fn run(self, scenario: &Scenario) -> Outcome {
        let file = scenario.file();
        let deployment = match scenario.deployment() {
            Ok(deployment) => deployment,
            Err(error) => return failed(self.seed, scenario, file, error),
        };
        let mut dc_rng = rng_from_seed(derive_seed(self.seed, "sim/dc"));
        let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
            &deployment,
            scenario.traffic(),
            &mut dc_rng,
        ))));
        let (done, _) = watch::channel(false);
        let script = Arc::new(scenario.script(self.seed, deployment.workers.len()));
        let world = World {
            seed: self.seed,
            scenario: Arc::new(scenario.clone()),
            script: Arc::clone(&script),
            dc,
            plane: Arc::new(Mutex::new(Planes::new(rng_from_seed(derive_seed(
                self.seed,
                "sim/plane",
            ))))),
            publisher: Arc::default(),
            skew_ms: Arc::default(),
            boots: Arc::default(),
            bounce: net::Bounce::default(),
            traffic_off: Arc::default(),
            decode_errors: Arc::default(),
            consumers: Arc::new(Mutex::new(vec![None; scenario.topology.consumers])),
            bandwidth: Arc::new(
                (0..scenario.topology.consumers).map(|_| net::Bandwidth::default()).collect(),
            ),
            slow_ends: Arc::default(),
            settling: Arc::new(Mutex::new(vec![Settling::default(); scenario.topology.consumers])),
            publications: Arc::default(),
            dc_version: Arc::default(),
            truth: Arc::new(Mutex::new(TruthWatch::new(
                truth::Health::of_script(
                    &script,
                    scenario.topology.consumers,
                    &deployment
                        .workers
                        .iter()
                        .map(|worker| worker.endpoint.to_string())
                        .collect::<Vec<_>>(),
                ),
                !scenario.expect.capacity_omissions,
            ))),
            trace: Trace::default(),
            done,
            result: Arc::default(),
            record: self.record.clone(),
        };
        let mut sim = self.builder.build();
        let relay_world = world.clone();
        sim.host(RELAY_HOST, move || run_relay(relay_world.clone()));
        register(&world);
        sim.host(PLANES_HOST, {
            let world = world.clone();
            move || run_planes(world.clone())
        });
        sim.client(DC_HOST, run_dc(world.clone(), dc_rng));
        for index in 0..scenario.topology.consumers {
            sim.client(scenario::consumer_host(index), run_consumer_host(world.clone(), index));
        }
        sim.client(CHECKER_HOST, run_checker(world.clone()));
        let error = step_to_end(&mut sim, &world.bounce);
        let simulated = sim.elapsed();
        let (checks, final_digest, mut view) = lock(&world.result).take().unwrap_or_default();
        let trace = world.trace.events();
        view.trace_counts =
            trace::counts(&trace).into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        let digest = run_digest(&trace, &final_digest);
        Outcome {
            seed: self.seed,
            scenario: scenario.name.clone(),
            file,
            checks,
            digest,
            trace,
            view,
            error,
            simulated,
        }
    }
}

fn failed(seed: u64, scenario: &Scenario, file: String, error: String) -> Outcome {
    Outcome {
        seed,
        scenario: scenario.name.clone(),
        file,
        checks: Vec::new(),
        digest: String::new(),
        trace: Vec::new(),
        view: FinalView::default(),
        error: Some(error),
        simulated: Duration::ZERO,
    }
}

type HostResult = Result<(), Box<dyn std::error::Error>>;

/// The simulated DC's id.
fn sim_dc_id() -> DcId {
    stable_dc_id("sim-dc").expect("valid name")
}

/// The publication bounds the WAN admission limits name (the rest at their defaults).
fn hub_config(tuning: &WanTuning) -> HubConfig {
    HubConfig {
        initialized_hubs_max: tuning.max_initialized_pool_hubs,
        subscribers_per_pool_max: tuning.max_subscribers_per_pool,
        ..HubConfig::default()
    }
}

/// The production WAN admission limits, with the scenario's `[relay]` overrides.
fn wan_tuning(bounds: scenario::RelayBounds) -> WanTuning {
    let defaults = WanTuning::default();
    WanTuning {
        max_initialized_pool_hubs: bounds
            .max_initialized_pool_hubs
            .unwrap_or(defaults.max_initialized_pool_hubs),
        max_subscribers_per_pool: bounds
            .max_subscribers_per_pool
            .unwrap_or(defaults.max_subscribers_per_pool),
        max_pool_streams_total: bounds
            .max_pool_streams_total
            .unwrap_or(defaults.max_pool_streams_total),
        max_catalog_subscribers: bounds
            .max_catalog_subscribers
            .unwrap_or(defaults.max_catalog_subscribers),
        max_readiness_subscribers: bounds
            .max_readiness_subscribers
            .unwrap_or(defaults.max_readiness_subscribers),
        max_load_subscribers: bounds.max_load_subscribers.unwrap_or(defaults.max_load_subscribers),
        ..defaults
    }
}

fn node_config(seed: u64, boot: u64, scenario: &Scenario) -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(seed, &format!("sim/relay/{boot}")));
    let relay = RelayIdentity::start(0x051d_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let mut control = ControlConfig::new(relay, sim_dc_id(), scope);
    control.expected_unique_blocks = scenario.workload.expected_unique_blocks;
    NodeConfig {
        control,
        pool: PoolConfig::default(),
        hub: hub_config(&wan_tuning(scenario.relay)),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(seed, &format!("sim/node/{boot}")),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
        input_queue_bytes_max: kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    }
}

/// The relay host: node, DC-plane ingest, observer and WAN service. Rebuilt from nothing on
/// every boot.
async fn run_relay(world: World) -> HostResult {
    let boot = world.boots.fetch_add(1, Ordering::Relaxed);
    let clock: Arc<dyn WallClock> = Arc::new(SimWallClock { skew_ms: world.skew_ms.clone() });
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let (planes_client, recovery) = PlanesClient::new(scope, Arc::clone(&world.decode_errors));
    let recovery: Arc<dyn RecoveryTransport> = Arc::new(recovery);
    let config = node_config(world.seed, boot, &world.scenario);
    let recorder = match &world.record {
        Some(root) => Some(start_sim_recorder(root, &config, &clock)?),
        None => None,
    };
    let (recovery, tap) = match &recorder {
        Some(recorder) => (recorder.recovery(recovery), Some(recorder.tap())),
        None => (recovery, None),
    };
    let node =
        start_node_with_tap(config, Arc::new(InlineExecutor), Arc::clone(&clock), recovery, tap)?;
    world.trace.record(TraceEvent::RelayBoot { boot, incarnation: node.relay.relay_incarnation });
    *lock(&world.publications) = Some(Arc::clone(&node.publications));
    // On the host's LocalSet: a bounce drops it after every runtime task, in a fixed order, so
    // the segments its socket sends when dropped draw turmoil's latencies deterministically
    // (runtime tasks are dropped in an order that depends on process-wide task ids).
    #[allow(clippy::disallowed_methods, reason = "a !Send host task on the LocalSet (see above)")]
    drop(tokio::task::spawn_local(planes_client.run(node.inputs.clone())));
    let tuning = wan_tuning(world.scenario.relay);
    let slow = Some((Arc::clone(&world.slow_ends), boot));
    serve_node(world.trace.clone(), boot, node, clock, tuning, world.bounce.crashing(), slow).await
}

/// Per relay boot, the streams its WAN service ended as lagging or slow subscribers.
type SlowEnds = Arc<Mutex<BTreeMap<u64, u64>>>;

/// Streams the relay's WAN service ended for lag: its publication queue overflowed, or a send
/// waited past the deadline (each counted once).
fn lag_ends(stats: &kvrelay::wan::WanStats) -> u64 {
    let lagged: u64 = stats.subscriber_lagged.iter().sum();
    let slow: u64 = stats.slow_consumer_ended.iter().sum();
    lagged.max(slow)
}

/// Observe boot `boot`'s `node` into `trace` and serve its WAN contract on the relay port.
async fn serve_node(
    trace: Trace,
    boot: u64,
    node: NodeHandle,
    clock: Arc<dyn WallClock>,
    tuning: WanTuning,
    crashing: net::Crashing,
    slow: Option<(SlowEnds, u64)>,
) -> HostResult {
    crashing.clear();
    let service = node.relay_service(clock, tuning);
    let lag = slow.map(|(slow, boot)| (service.clone(), slow, boot));
    kvrelay::runtime::spawn(observe_relay(
        trace,
        boot,
        node.views.clone(),
        Arc::clone(&node.publications),
        node.status.clone(),
        lag,
    ));
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", RELAY_PORT)).await?;
    serve(service, Box::pin(net::incoming(listener, crashing)), &tuning, std::future::pending())
        .await?;
    node.shutdown().await;
    Ok(())
}

/// What `status` shows that no run may show: an invariant failure of the control plane or the
/// endpoint host, or `healthy == false` with neither a fenced endpoint nor a shutdown behind it.
fn node_fault(status: &kvrelay::node::NodeStatus) -> Option<String> {
    let control = status.control.as_ref()?;
    if let Some(error) = &control.control_last_error {
        return Some(format!("control invariant failed: {error}"));
    }
    if let Some(error) = &control.host.host_last_error {
        return Some(format!("host invariant failed: {error}"));
    }
    let healthy = status.healthy && control.healthy;
    let explained = control.host.fenced_endpoint_count > 0 || control.host.shutting_down;
    (!healthy && !explained).then(|| "unhealthy without a fenced endpoint or a shutdown".to_owned())
}

/// A recorder journaling one relay boot under `root`, as `kvrelay serve --record` does.
fn start_sim_recorder(
    root: &std::path::Path,
    config: &NodeConfig,
    clock: &Arc<dyn WallClock>,
) -> std::io::Result<kvrelay::journal::Recorder> {
    let dir = kvrelay::journal::recording_dir(
        root,
        clock.now_unix_us(),
        config.control.relay.relay_incarnation,
    );
    let mut recording =
        kvrelay::journal::RecorderConfig::new(dir, 256 << 20, Duration::from_secs(3600));
    recording.checkpoint_every_inputs = 1000;
    recording.checkpoint_interval = Duration::from_secs(1);
    kvrelay::journal::start_recorder(
        &recording,
        config,
        Arc::clone(clock),
        Arc::new(InlineExecutor),
    )
}

/// Record every catalog and readiness the relay publishes (an invalid one as such), any
/// catalogued producer whose live publication went away while it was still catalogued, and a
/// node fault when one starts or changes ([`node_fault`] of the status, read every turmoil
/// step: the sample period is one step); with `lag`, also the streams the boot's WAN service
/// ended for lag, into its slot.
async fn observe_relay(
    trace: Trace,
    boot: u64,
    views: WanViews,
    publications: Arc<PoolPublications>,
    status: watch::Receiver<kvrelay::node::NodeStatus>,
    lag: Option<(kvrelay::wan::RelayService, SlowEnds, u64)>,
) {
    let mut last_fault: Option<String> = None;
    let mut last_catalog = None;
    let mut last_readiness = None;
    let mut catalogued: Vec<(String, ProducerIdentity)> = Vec::new();
    let mut live: BTreeSet<ProducerIdentity> = BTreeSet::new();
    loop {
        let catalog = views.current_catalog();
        if last_catalog.as_ref().is_none_or(|last| !Arc::ptr_eq(last, &catalog)) {
            match validate_catalog_update(&catalog) {
                Err(error) => trace.record(TraceEvent::InvalidUpdate {
                    boot,
                    plane: "catalog",
                    error: error.to_string(),
                }),
                Ok(update) => {
                    catalogued = update
                        .pools
                        .iter()
                        .map(|d| (d.serving_endpoint.to_string(), d.producer))
                        .collect();
                    live.retain(|p| catalogued.iter().any(|(_, c)| c == p));
                    trace.record(TraceEvent::RelayCatalog {
                        boot,
                        revision: update.revision,
                        pools: update.pools.iter().map(ProducerTrace::of).collect(),
                    });
                }
            }
            last_catalog = Some(catalog);
        }
        let readiness = views.current_readiness();
        if last_readiness.as_ref().is_none_or(|last| !Arc::ptr_eq(last, &readiness)) {
            match validate_readiness_update(&readiness) {
                Err(error) => trace.record(TraceEvent::InvalidUpdate {
                    boot,
                    plane: "readiness",
                    error: error.to_string(),
                }),
                Ok(update) => trace.record(TraceEvent::RelayReadiness {
                    boot,
                    revision: update.revision,
                    entries: update.entries.iter().map(EntryTrace::of).collect(),
                }),
            }
            last_readiness = Some(readiness);
        }
        for (endpoint, producer) in &catalogued {
            if publications.producer(&producer.pool_id()) == Some(*producer) {
                live.insert(*producer);
            } else if live.remove(producer) {
                trace.record(TraceEvent::TeardownBeforeWithdrawal {
                    boot,
                    producer: ProducerTrace::new(endpoint.clone(), producer),
                });
            }
        }
        let fault = node_fault(&status.borrow());
        if fault != last_fault {
            if let Some(detail) = &fault {
                trace.record(TraceEvent::NodeFault { boot, detail: detail.clone() });
            }
            last_fault = fault;
        }
        if let Some((service, slow, boot)) = &lag {
            lock(slow).insert(*boot, lag_ends(&service.stats()));
        }
        tokio::time::sleep(RELAY_SAMPLE).await;
    }
}

/// The DC driver: traffic every tick (and stale events from overlapping incarnations),
/// occupancy reports every few ticks, until the checker stops traffic.
async fn run_dc(world: World, mut rng: RelayRng) -> HostResult {
    let workload = world.scenario.workload.clone();
    let mut ticks = tokio::time::interval(Duration::from_millis(workload.tick_ms));
    let mut tick_count = 0u64;
    let mut link = Link::default();
    loop {
        ticks.tick().await;
        if world.traffic_off.load(Ordering::Relaxed) {
            // Workers report occupancy on change: once more after their last request.
            let facts = world.dc.with(|dc| dc.load_facts());
            publish(&world, facts);
            link.flush(&world.publisher).await;
            return Ok(());
        }
        tick_count += 1;
        let facts = world.dc.with(|dc| {
            let mut facts = dc.step(workload.requests_per_tick, &mut rng);
            facts.extend(dc.ghost_step(1, &mut rng));
            if tick_count.is_multiple_of(workload.load_every_ticks) {
                facts.extend(dc.load_facts());
            }
            facts
        });
        world.dc_version.fetch_add(1, Ordering::Relaxed);
        publish(&world, facts);
        link.flush(&world.publisher).await;
    }
}

/// Queue what the workers did for host `dc` to send to the planes host: their registrations
/// (when `facts` change discovery), then their event-plane messages.
fn publish(world: &World, facts: Vec<DcInput>) {
    let discovery = facts.iter().any(|fact| !planes::is_event_plane(fact));
    let registrations = discovery
        .then(|| planes::records::registrations(&world.dc.with(|dc| dc.discovery_facts())));
    let mut publisher = lock(&world.publisher);
    if let Some(registrations) = registrations {
        publisher.register(registrations);
    }
    publisher.publish(facts);
}

/// Write the workers' registrations straight into the planes host's store (before the run, and
/// on the planes host itself when a lease expired).
fn register(world: &World) {
    let registrations = planes::records::registrations(&world.dc.with(|dc| dc.discovery_facts()));
    lock(&world.plane).register(&registrations, sim_ms());
}

/// The planes host: serves the relay host, and runs the discovery leases. A worker whose lease
/// expired leaves the truth model's listing at that moment (the process lives on).
async fn run_planes(world: World) -> HostResult {
    kvrelay::runtime::spawn(planes::server::serve(
        Arc::clone(&world.plane),
        Arc::new(world.dc.clone()),
    ));
    let mut ticks = tokio::time::interval(LEASE_TICK);
    loop {
        ticks.tick().await;
        let expired = lock(&world.plane).tick(sim_ms());
        for lease in expired {
            world.dc.with(|dc| {
                let index = (0..dc.workers().len()).find(|index| {
                    dc.is_listed(*index) && dc.workers()[*index].worker_id() == lease
                });
                index.map(|index| dc.expire_lease(index))
            });
            world.dc_version.fetch_add(1, Ordering::Relaxed);
            register(&world);
            record_truth(&world);
        }
    }
}

/// A reference consumer on `host` following the relay host, its generator derived from `seed`;
/// with `bandwidth`, behind a link paced to it.
fn consumer_for(
    seed: u64,
    host: &str,
    bandwidth: Option<(net::Bandwidth, Option<u32>)>,
) -> Result<RelayConsumer, HostResultError> {
    // h2 remembers a locally reset stream for a span of real (wall-clock) time, 1 s by default,
    // and treats late frames for it differently once forgotten: a wall-clock leak into the
    // simulation that made runs under load diverge. Remembering resets far longer than any run
    // keeps the outcome a function of the seed (the count-based limit still applies).
    let endpoint = kvrelay_consumer::endpoint(&format!("http://{RELAY_HOST}:{RELAY_PORT}"))?
        .http2_reset_stream_duration(H2_RESET_MEMORY);
    let channel = match bandwidth {
        Some((bandwidth, window)) => endpoint
            .initial_stream_window_size(window)
            .initial_connection_window_size(window)
            .connect_with_connector_lazy(net::limited_connector(RELAY_HOST, RELAY_PORT, bandwidth)),
        None => endpoint.connect_with_connector_lazy(net::connector(RELAY_HOST, RELAY_PORT)),
    };
    let config =
        ConsumerConfig { subscriber_id: format!("sim-{host}"), ..ConsumerConfig::default() };
    let mut rng = rng_from_seed(derive_seed(seed, host));
    Ok(RelayConsumer::start(channel, config, &mut rng)?)
}

type HostResultError = Box<dyn std::error::Error>;

/// Long-lived consumer `index`: follows the relay until the checker is done.
async fn run_consumer_host(world: World, index: usize) -> HostResult {
    let host = scenario::consumer_host(index);
    let window = world.scenario.topology.consumer_window_bytes;
    let bandwidth = world.bandwidth.get(index).map(|bandwidth| (bandwidth.clone(), window));
    hold_consumer(
        world.seed,
        &host,
        index,
        Arc::clone(&world.consumers),
        world.done.subscribe(),
        bandwidth,
    )
    .await
}

/// Consumers shared between the hosts that run them and the hosts that watch them.
type ConsumerSlots = Arc<Mutex<Vec<Option<Arc<RelayConsumer>>>>>;

/// Run a consumer on `host` in `slots[index]` until `done`.
async fn hold_consumer(
    seed: u64,
    host: &str,
    index: usize,
    slots: ConsumerSlots,
    mut done: watch::Receiver<bool>,
    bandwidth: Option<(net::Bandwidth, Option<u32>)>,
) -> HostResult {
    let consumer = Arc::new(consumer_for(seed, host, bandwidth)?);
    if let Some(slot) = lock(&slots).get_mut(index) {
        *slot = Some(Arc::clone(&consumer));
    }
    let _ = done.wait_for(|done| *done).await;
    consumer.shutdown().await;
    Ok(())
}

/// Per base model: some listed worker serves it and every listed typed worker's needs are met
/// (a listed legacy worker switches strict gating off). Roles and needs are read from each
/// worker's card after the relay's legacy-prefill normalization, so a legacy prefill card
/// counts as a prefill worker needing decode.
fn truth(dc: &SimulatedDc) -> BTreeMap<String, bool> {
    let mut roles: BTreeMap<String, BTreeSet<WorkerType>> = BTreeMap::new();
    let mut legacy: BTreeSet<String> = BTreeSet::new();
    let mut listed: Vec<(String, Vec<Vec<WorkerType>>)> = Vec::new();
    for worker in dc.listed_workers() {
        let mut card = worker.card();
        normalize_legacy_prefill(&mut card);
        let model = worker.spec().model.clone();
        match card.worker_type {
            Some(role) => {
                roles.entry(model.clone()).or_default().insert(role);
            }
            None => {
                legacy.insert(model.clone());
                roles.entry(model.clone()).or_default();
            }
        }
        listed.push((model, card.needs));
    }
    let models: BTreeSet<String> = dc.workers().iter().map(|w| w.spec().model.clone()).collect();
    models
        .into_iter()
        .map(|model| {
            let servable = match roles.get(&model) {
                None => false,
                Some(_) if legacy.contains(&model) => true,
                Some(present) => listed.iter().filter(|(m, _)| *m == model).all(|(_, needs)| {
                    needs.is_empty()
                        || needs.iter().any(|alt| alt.iter().all(|r| present.contains(r)))
                }),
            };
            (model, servable)
        })
        .collect()
}

fn record_truth(world: &World) {
    let servable = world.dc.with(|dc| truth(dc));
    let visible = !lock(&world.plane).partitioned();
    world.trace.record(TraceEvent::Truth { visible, servable });
}

/// Apply one fault of the script.
fn apply(world: &World, fault: &Fault, rng: &mut RelayRng) {
    let dc = &world.dc;
    let facts = match fault {
        Fault::RestartWorker { worker, same_id } => {
            dc.with(|dc| dc.start_worker(*worker, *same_id, rng))
        }
        Fault::CrashWorker { worker } => dc.with(|dc| dc.crash_worker(*worker)),
        Fault::StartWorker { worker, same_id } => {
            dc.with(|dc| dc.start_worker(*worker, *same_id, rng))
        }
        Fault::ExpireLease { worker } => {
            // The process stops its keep-alives; the planes host expires the lease a TTL later.
            if let Some(lease) = listed_worker_id(world, *worker) {
                lock(&world.plane).set_keepalive(lease, false);
            }
            Vec::new()
        }
        Fault::RenewLease { worker } => match listed_worker_id(world, *worker) {
            Some(lease) => {
                lock(&world.plane).set_keepalive(lease, true);
                Vec::new()
            }
            None => dc.with(|dc| dc.renew_lease(*worker)),
        },
        Fault::BeginOverlap { worker } => dc.with(|dc| dc.begin_overlap(*worker, rng)),
        Fault::EndOverlap { worker } => dc.with(|dc| dc.end_overlap(*worker)),
        Fault::LoadAdapter { worker, adapter } => dc.with(|dc| dc.load_adapter(*worker, adapter)),
        Fault::UnloadAdapter { worker, adapter } => {
            dc.with(|dc| dc.unload_adapter(*worker, adapter))
        }
        Fault::ClearRank { worker, rank } => dc.with(|dc| dc.clear_rank(*worker, *rank)),
        Fault::WanPartition { consumer } => {
            wan_links(world, *consumer, |host| turmoil::partition(RELAY_HOST, host))
        }
        Fault::WanRepair { consumer } => {
            wan_links(world, *consumer, |host| turmoil::repair(RELAY_HOST, host))
        }
        Fault::WanHold { consumer } => {
            wan_links(world, *consumer, |host| turmoil::hold(RELAY_HOST, host))
        }
        Fault::WanRelease { consumer } => {
            wan_links(world, *consumer, |host| turmoil::release(RELAY_HOST, host))
        }
        Fault::ConsumerBandwidth { consumer, bytes_per_s } => {
            limit_links(world, *consumer, *bytes_per_s);
            Vec::new()
        }
        Fault::ConsumerBandwidthLift { consumer } => {
            limit_links(world, *consumer, 0);
            Vec::new()
        }
        Fault::DcPartition { .. }
        | Fault::DcRepair
        | Fault::EventNoise(_)
        | Fault::EventPlaneRestart
        | Fault::DiscoveryRestart => {
            planes::apply_fault(&world.plane, RELAY_HOST, fault);
            Vec::new()
        }
        Fault::RelayRestart => {
            world.bounce.request();
            Vec::new()
        }
        Fault::ClockSkew { ms } => {
            world.skew_ms.store(*ms, Ordering::Relaxed);
            Vec::new()
        }
    };
    // A worker that (re)registers holds its lease anew, even one the planes host expired.
    if let Fault::RestartWorker { worker, .. }
    | Fault::StartWorker { worker, .. }
    | Fault::RenewLease { worker } = fault
        && let Some(lease) = listed_worker_id(world, *worker)
    {
        lock(&world.plane).grant(lease);
    }
    world.dc_version.fetch_add(1, Ordering::Relaxed);
    publish(world, facts);
}

/// The worker id of worker `index` if it is listed.
fn listed_worker_id(world: &World, index: usize) -> Option<u64> {
    world.dc.with(|dc| dc.is_listed(index).then(|| dc.workers()[index].worker_id()))
}

/// Act on the WAN link between the relay and each consumer `target` names (the first when
/// none); no DC facts.
fn wan_links(
    world: &World,
    target: Option<ConsumerTarget>,
    mut act: impl FnMut(&str),
) -> Vec<DcInput> {
    let target = target.unwrap_or(ConsumerTarget::One(0));
    for index in target.indices(world.scenario.topology.consumers) {
        act(&scenario::consumer_host(index));
    }
    Vec::new()
}

/// Pace the links of each consumer `target` names (the first when none) to `bytes_per_s`
/// (0: unlimited).
fn limit_links(world: &World, target: Option<ConsumerTarget>, bytes_per_s: u64) {
    let target = target.unwrap_or(ConsumerTarget::One(0));
    for index in target.indices(world.scenario.topology.consumers) {
        if let Some(bandwidth) = world.bandwidth.get(index) {
            bandwidth.set(bytes_per_s);
        }
    }
}

/// Record each long-lived consumer's view whenever it changes.
async fn observe_consumers(world: World) {
    let hosts: Vec<String> =
        (0..world.scenario.topology.consumers).map(scenario::consumer_host).collect();
    let truth = world.clone();
    follow_consumers_settling(
        world.trace.clone(),
        hosts,
        Arc::clone(&world.consumers),
        world.done.subscribe(),
        Some(Arc::clone(&world.settling)),
        move || observed::sample_truth(&truth),
    )
    .await;
}

/// Record the view of each consumer in `slots` (on the host of the same index) whenever it
/// changes, until `done`.
async fn follow_consumers(
    trace: Trace,
    hosts: Vec<String>,
    slots: ConsumerSlots,
    done: watch::Receiver<bool>,
) {
    follow_consumers_settling(trace, hosts, slots, done, None, || {}).await;
}

/// [`follow_consumers`], also noting each view in `settling` (by the same index) and calling
/// `each` once per sample.
async fn follow_consumers_settling(
    trace: Trace,
    hosts: Vec<String>,
    slots: ConsumerSlots,
    mut done: watch::Receiver<bool>,
    settling: Option<Arc<Mutex<Vec<Settling>>>>,
    mut each: impl FnMut(),
) {
    let mut last: Vec<Option<(ConsumerSnapshot, ConsumerTrace)>> = vec![None; hosts.len()];
    loop {
        let consumers = lock(&slots).clone();
        for (index, ((consumer, host), last)) in
            consumers.iter().zip(&hosts).zip(&mut last).enumerate()
        {
            let Some(consumer) = consumer else { continue };
            let snapshot = consumer.snapshot();
            if let Some(settling) = &settling
                && let Some(settling) = lock(settling).get_mut(index)
            {
                settling.observe(sim_ms(), &snapshot);
            }
            if last
                .as_ref()
                .is_some_and(|(shown, _)| ConsumerTrace::shows_the_same(shown, &snapshot))
            {
                continue;
            }
            let view = ConsumerTrace::of(host, &snapshot);
            if last.as_ref().map(|(_, view)| view) != Some(&view) {
                trace.record(TraceEvent::Consumer(view.clone()));
            }
            *last = Some((snapshot, view));
        }
        each();
        tokio::select! {
            biased;
            _ = done.wait_for(|done| *done) => return,
            () = tokio::time::sleep(CONSUMER_SAMPLE) => {}
        }
    }
}

/// Play the script, stop traffic, quiesce, evaluate the oracles, publish the result.
async fn run_checker(world: World) -> HostResult {
    let start = tokio::time::Instant::now();
    let mut rng = rng_from_seed(derive_seed(world.seed, "sim/checker"));
    record_truth(&world);
    kvrelay::runtime::spawn(observe_consumers(world.clone()));
    for scripted in world.script.iter() {
        tokio::time::sleep_until(start + Duration::from_millis(scripted.at_ms)).await;
        apply(&world, &scripted.fault, &mut rng);
        world.trace.record(TraceEvent::Fault { fault: scripted.fault.clone() });
        record_truth(&world);
    }
    tokio::time::sleep_until(start + scenario::run_duration(&world.scenario)).await;
    world.traffic_off.store(true, Ordering::Relaxed);
    let planes = planes::counters(&world.plane, &world.publisher);
    world.trace.record(TraceEvent::TrafficOff { planes });
    tokio::time::sleep(QUIESCENCE).await;
    lock(&world.truth).stop();
    let result = evaluate(&world).await;
    *lock(&world.result) = Some(result);
    world.done.send_replace(true);
    Ok(())
}

/// The consumer's snapshot holds exactly the pools the truth model says exist (`truth`), as
/// many as the scenario expects, each replica ready, and exactly the expected readiness.
fn converged(snapshot: &ConsumerSnapshot, scenario: &Scenario, truth: &BTreeSet<PoolKey>) -> bool {
    meets(snapshot, &scenario.expect)
        && PoolKey::of_snapshot(snapshot).into_iter().collect::<BTreeSet<_>>() == *truth
}

/// The snapshot has `expect`'s pool count (each replica ready) and exactly its readiness.
fn meets(snapshot: &ConsumerSnapshot, expect: &Expect) -> bool {
    let readiness: BTreeMap<&str, _> = snapshot
        .readiness
        .iter()
        .map(|entry| (entry.canonical_model_id.as_str(), entry.state))
        .collect();
    let named = expect.readiness.iter().all(|(model, state)| {
        readiness.get(model.as_str()).is_some_and(|seen| *seen == state.state())
    });
    let others: Vec<_> = readiness
        .iter()
        .filter(|(model, _)| !expect.readiness.contains_key(**model))
        .map(|(_, state)| *state)
        .collect();
    let others_expected = match expect.other_models {
        None => others.is_empty(),
        Some(other) => {
            others.len() == other.count && others.iter().all(|state| *state == other.state.state())
        }
    };
    snapshot.pools.len() == expect.pools
        && snapshot.pools.iter().all(|pool| pool.status == FilterStatus::Ready)
        && named
        && others_expected
}

fn describe(snapshot: &ConsumerSnapshot) -> String {
    let pools: Vec<String> = snapshot
        .pools
        .iter()
        .map(|pool| format!("{}={}", pool.descriptor.serving_endpoint, pool.status.name()))
        .collect();
    let readiness: Vec<String> = snapshot
        .readiness
        .iter()
        .map(|e| format!("{}={}", e.canonical_model_id, trace::state_name(e.state)))
        .collect();
    format!(
        "{} pools [{}], readiness [{}], halted {:?}",
        snapshot.pools.len(),
        pools.join(", "),
        readiness.join(", "),
        snapshot.halted
    )
}

async fn wait_converged(
    consumer: &RelayConsumer,
    scenario: &Scenario,
    truth: &BTreeSet<PoolKey>,
) -> (bool, ConsumerSnapshot) {
    let predicate = |snapshot: &ConsumerSnapshot| converged(snapshot, scenario, truth);
    match tokio::time::timeout(CONVERGENCE_TIMEOUT, consumer.wait_until(predicate)).await {
        Ok(Ok(snapshot)) => (true, snapshot),
        _ => (false, consumer.snapshot()),
    }
}

/// Whether every replica of `consumer` equals the reference's.
fn replicas_equal(consumer: &RelayConsumer, reference: &RelayConsumer) -> (bool, String) {
    let snapshot = reference.snapshot();
    let mut differing = Vec::new();
    for pool in &snapshot.pools {
        let pool_id = pool.producer.pool_id();
        let ours = consumer.filter_copy(&pool_id);
        let theirs = reference.filter_copy(&pool_id);
        if ours.is_none() || ours != theirs {
            differing.push(format!(
                "{} (consumer seq {:?}, relay seq {:?})",
                pool.descriptor.serving_endpoint,
                ours.map(|copy| copy.sequence),
                theirs.map(|copy| copy.sequence)
            ));
        }
    }
    if differing.is_empty() {
        (true, format!("{} pools identical", snapshot.pools.len()))
    } else {
        (false, format!("differ: {}", differing.join(", ")))
    }
}

/// Every block the truth model says the pool's listed workers hold (ranks of overlapping
/// incarnations excluded: their KV is withheld by design).
fn truth_hashes(dc: &SimulatedDc, endpoint: &str) -> Vec<u64> {
    dc.workers()
        .iter()
        .enumerate()
        .filter(|(index, worker)| {
            dc.is_listed(*index)
                && !dc.in_overlap(*index)
                && worker.spec().publishes_kv
                && worker.spec().endpoint.to_string() == endpoint
        })
        .flat_map(|(_, worker)| {
            worker.ranks().iter().flat_map(|rank| rank.canonical_hashes().collect::<Vec<_>>())
        })
        .collect()
}

/// Probe, in `consumer`'s replicas, every block the truth model holds for each pool the relay
/// catalogues (as `catalogued`, a fresh subscriber's view, shows it).
fn no_false_negatives(
    world: &World,
    consumer: &RelayConsumer,
    catalogued: &ConsumerSnapshot,
) -> Check {
    let probed: Vec<Probed> = catalogued
        .pools
        .iter()
        .map(|pool| {
            let endpoint = pool.descriptor.serving_endpoint.to_string();
            let mut hashes = world.dc.with(|dc| truth_hashes(dc, &endpoint));
            // A block cached by several ranks is one block of the pool's filter.
            hashes.sort_unstable();
            hashes.dedup();
            let addressing = Addressing::new(&pool.producer.format());
            let absent = consumer.filter_copy(&pool.producer.pool_id()).map(|copy| {
                hashes
                    .iter()
                    .filter(|hash| {
                        let probe = addressing.probe(**hash);
                        !(word_contains(copy.words[probe.bucket_a as usize], probe.fingerprint)
                            || word_contains(
                                copy.words[probe.bucket_b as usize],
                                probe.fingerprint,
                            ))
                    })
                    .count()
            });
            let slots = pool.producer.format().bucket_count
                * u64::from(kvrelay_core::filter::ckf::SLOTS_PER_BUCKET);
            Probed { endpoint, cached: hashes.len(), absent, slots }
        })
        .collect();
    settled::no_false_negatives(&probed, world.scenario.expect.capacity_omissions)
}

/// The load `snapshot` shows for every pool the relay catalogues (`catalogued`), against the
/// truth model's occupancy of the pool's listed workers.
fn load_converged(
    world: &World,
    snapshot: &ConsumerSnapshot,
    catalogued: &ConsumerSnapshot,
) -> Check {
    let seen: Vec<LoadSeen> = catalogued
        .pools
        .iter()
        .map(|pool| {
            let endpoint = pool.descriptor.serving_endpoint.to_string();
            let truth = world.dc.with(|dc| truth_hashes(dc, &endpoint)).len() as u64;
            let load = snapshot.load.iter().find(|load| load.producer == pool.producer);
            LoadSeen { endpoint, truth, used: load.and_then(|load| load.kv_used_blocks) }
        })
        .collect();
    settled::load_converges(&seen)
}

/// The relay's own state of each pool `catalogued` shows, read from the current boot's
/// pools (an empty map while the relay is down).
async fn relay_digests(
    world: &World,
    catalogued: &ConsumerSnapshot,
) -> BTreeMap<PoolId, (ProducerIdentity, PoolDigest)> {
    let publications = lock(&world.publications).clone();
    let mut digests = BTreeMap::new();
    let Some(publications) = publications else { return digests };
    for pool in &catalogued.pools {
        let pool_id = pool.producer.pool_id();
        if let Some(digest) = publications.digest(&pool_id).await {
            digests.insert(pool_id, digest);
        }
    }
    digests
}

/// Every replica of `consumer` of a pool `catalogued` shows has the relay's producer, sequence
/// and filter words (`relay`, read from the relay's pools).
fn replica_equals_relay(
    consumer: &RelayConsumer,
    catalogued: &ConsumerSnapshot,
    relay: &BTreeMap<PoolId, (ProducerIdentity, PoolDigest)>,
) -> Check {
    let mut differing = Vec::new();
    for pool in &catalogued.pools {
        let pool_id = pool.producer.pool_id();
        let ours = consumer.filter_copy(&pool_id);
        let theirs = relay.get(&pool_id);
        let equal = match (&ours, theirs) {
            (Some(copy), Some((producer, digest))) => {
                copy.producer == *producer
                    && copy.sequence == digest.sequence
                    && filter_words_digest(&copy.words) == digest.filter_digest
            }
            _ => false,
        };
        if !equal {
            differing.push(format!(
                "{} (consumer seq {:?}, relay seq {:?})",
                pool.descriptor.serving_endpoint,
                ours.map(|copy| copy.sequence),
                theirs.map(|(_, digest)| digest.sequence)
            ));
        }
    }
    Check {
        name: "replica-equals-relay",
        passed: differing.is_empty(),
        detail: if differing.is_empty() {
            format!("{} pools: words and sequence equal the relay's", catalogued.pools.len())
        } else {
            format!("differ: {}", differing.join(", "))
        },
    }
}

/// [`settled::consumer_followed`] on `consumer`'s counters now; `relay_lag_ends` is how many
/// streams the relay ended for lag over the run.
fn consumer_followed(
    expectation: scenario::ConsumerExpectation,
    pools: usize,
    relay_lag_ends: u64,
    consumer: &RelayConsumer,
) -> Check {
    settled::consumer_followed(expectation, pools, relay_lag_ends, &consumer.snapshot().counters)
}

fn final_view(world: &World, snapshot: &ConsumerSnapshot) -> FinalView {
    FinalView {
        catalog: snapshot
            .pools
            .iter()
            .map(|pool| FinalPool {
                endpoint: pool.descriptor.serving_endpoint.to_string(),
                roles: pool.descriptor.pool_roles.iter().map(|r| format!("{r:?}")).collect(),
                models: pool
                    .descriptor
                    .registrations
                    .iter()
                    .map(|r| r.canonical_model_id.clone())
                    .collect(),
                status: pool.status.name(),
            })
            .collect(),
        readiness: snapshot.readiness.iter().map(EntryTrace::of).collect(),
        trace_counts: BTreeMap::new(),
        faults: world
            .script
            .iter()
            .map(|scripted| format!("{} {}", scripted.at_ms, scripted.fault.action()))
            .collect(),
        relay_boots: world.boots.load(Ordering::Relaxed),
        convergence: Convergence::default(),
    }
}

/// One oracle over every long-lived consumer (by index): it holds if it holds at each; the
/// detail names the consumers where it failed.
fn at_every_consumer(
    consumers: &[(String, Arc<RelayConsumer>)],
    check: impl Fn(usize, &RelayConsumer) -> Check,
) -> Check {
    let results: Vec<(&str, Check)> = consumers
        .iter()
        .enumerate()
        .map(|(index, (host, consumer))| (host.as_str(), check(index, consumer)))
        .collect();
    let name = results.first().map_or("consumers", |(_, check)| check.name);
    let failed: Vec<String> = results
        .iter()
        .filter(|(_, check)| !check.passed)
        .map(|(host, check)| format!("{host}: {}", check.detail))
        .collect();
    if !failed.is_empty() || results.is_empty() {
        return Check { name, passed: false, detail: failed.join("; ") };
    }
    let mut details: Vec<&str> = results.iter().map(|(_, check)| check.detail.as_str()).collect();
    details.dedup();
    Check {
        name,
        passed: true,
        detail: format!("at {} consumers: {}", results.len(), details.join(" | ")),
    }
}

/// Re-run `check` every 100 ms of simulated time until it holds or the convergence bound ends.
async fn within_convergence(mut check: impl AsyncFnMut() -> Check) -> Check {
    let deadline = tokio::time::Instant::now() + CONVERGENCE_TIMEOUT;
    let mut result = check().await;
    while !result.passed && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        result = check().await;
    }
    result
}

/// When the long-lived consumers reached their final state (each observed once more now),
/// against the trace's last fault and traffic-off.
fn convergence(world: &World, consumers: &[(String, Arc<RelayConsumer>)]) -> Convergence {
    let events = world.trace.events();
    let last_fault_ms = events
        .iter()
        .rev()
        .find(|stamped| matches!(stamped.event, TraceEvent::Fault { .. }))
        .map_or(0, |stamped| stamped.ms);
    let traffic_off_ms = events
        .iter()
        .find(|stamped| matches!(stamped.event, TraceEvent::TrafficOff { .. }))
        .map_or(0, |stamped| stamped.ms);
    let mut settling = lock(&world.settling);
    for (index, (_, consumer)) in consumers.iter().enumerate() {
        if let Some(settling) = settling.get_mut(index) {
            settling.observe(sim_ms(), &consumer.snapshot());
        }
    }
    Convergence::of(last_fault_ms, traffic_off_ms, &settling)
}

async fn evaluate(world: &World) -> Verdict {
    let scenario = &world.scenario;
    let mut checks = oracles::trace_checks(&world.trace.events());
    let consumers: Vec<(String, Arc<RelayConsumer>)> = lock(&world.consumers)
        .iter()
        .enumerate()
        .filter_map(|(index, consumer)| {
            consumer.clone().map(|consumer| (scenario::consumer_host(index), consumer))
        })
        .collect();
    if consumers.is_empty() || consumers.len() != scenario.topology.consumers {
        let detail =
            format!("{} of {} consumers started", consumers.len(), scenario.topology.consumers);
        checks.push(Check { name: "setup", passed: false, detail });
        return (checks, String::new(), FinalView::default());
    }
    let truth = world.dc.with(|dc| settled::truth_catalog(dc, sim_dc_id()));
    let mut all_converged = true;
    let mut seen = Vec::new();
    for (host, consumer) in &consumers {
        let (converged, snapshot) = wait_converged(consumer, scenario, &truth).await;
        all_converged &= converged;
        seen.push(format!("{host}: {}", describe(&snapshot)));
    }
    let reference = match consumer_for(world.seed, CHECKER_HOST, None) {
        Ok(reference) => reference,
        Err(error) => {
            checks.push(Check { name: "setup", passed: false, detail: error.to_string() });
            return (checks, String::new(), FinalView::default());
        }
    };
    let (converged_ref, snapshot_ref) = wait_converged(&reference, scenario, &truth).await;
    seen.push(format!("fresh: {}", describe(&snapshot_ref)));
    if !(all_converged && converged_ref) {
        let truth: Vec<&str> = truth.iter().map(|key| key.endpoint.as_str()).collect();
        seen.push(format!("truth: [{}]", truth.join(", ")));
    }
    checks.push(Check {
        name: "catalog-and-readiness-converge",
        passed: all_converged && converged_ref,
        detail: seen.join("; "),
    });
    // Recovery may still be under way (a query held by a partition ends at the repair, or
    // times out and retries): the blocks must arrive within the convergence bound.
    let complete = within_convergence(async || {
        let catalogued = reference.snapshot();
        at_every_consumer(&consumers, |_, consumer| {
            no_false_negatives(world, consumer, &catalogued)
        })
    })
    .await;
    let equal = within_convergence(async || {
        let catalogued = reference.snapshot();
        let relay = relay_digests(world, &catalogued).await;
        at_every_consumer(&consumers, |_, consumer| {
            replica_equals_relay(consumer, &catalogued, &relay)
        })
    })
    .await;
    let stale = within_convergence(async || {
        let catalogued = reference.snapshot();
        at_every_consumer(&consumers, |_, consumer| {
            observed::no_stale_blocks(world, consumer, &catalogued)
        })
    })
    .await;
    let registrations = within_convergence(async || {
        at_every_consumer(&consumers, |_, consumer| {
            observed::registrations_equal_truth(world, &consumer.snapshot())
        })
    })
    .await;
    checks.push(equal);
    checks.push(complete);
    checks.push(stale);
    checks.push(observed::bounded_staleness(world));
    checks.push(registrations);
    checks.push(observed::registrations_follow_truth(world));
    let load = within_convergence(async || {
        let catalogued = reference.snapshot();
        at_every_consumer(&consumers, |_, consumer| {
            load_converged(world, &consumer.snapshot(), &catalogued)
        })
    })
    .await;
    checks.push(load);
    let convergence = convergence(world, &consumers);
    checks.push(settled::converges_within_bound(&convergence));
    checks.push(at_every_consumer(&consumers, |_, consumer| {
        settled::no_phantom_pools(&truth, &PoolKey::of_snapshot(&consumer.snapshot()))
    }));
    let relay_lag_ends: u64 = lock(&world.slow_ends).values().sum();
    checks.push(at_every_consumer(&consumers, |index, consumer| {
        consumer_followed(
            scenario.expect.consumer.of(index),
            scenario.expect.pools,
            relay_lag_ends,
            consumer,
        )
    }));
    let decode_errors = world.decode_errors.load(Ordering::Relaxed);
    checks.push(Check {
        name: "inputs-decode",
        passed: decode_errors == 0,
        detail: format!("{decode_errors} DC-plane messages the relay's decoders refused"),
    });
    let mut snapshots: Vec<ConsumerSnapshot> =
        consumers.iter().map(|(_, consumer)| consumer.snapshot()).collect();
    snapshots.push(reference.snapshot());
    let mut replicas: Vec<&RelayConsumer> =
        consumers.iter().map(|(_, consumer)| consumer.as_ref()).collect();
    replicas.push(&reference);
    let digest = digest(&snapshots.iter().collect::<Vec<_>>(), &replicas);
    let mut view = final_view(world, &snapshots[0]);
    view.convergence = convergence;
    reference.shutdown().await;
    (checks, digest, view)
}

/// Hash of every snapshot (catalog, readiness, load, counters) and every replica's words.
fn digest(snapshots: &[&ConsumerSnapshot], consumers: &[&RelayConsumer]) -> String {
    let mut hasher = blake3::Hasher::new();
    for snapshot in snapshots {
        hasher.update(format!("{snapshot:?}").as_bytes());
    }
    for consumer in consumers {
        for pool in &consumer.snapshot().pools {
            if let Some(copy) = consumer.filter_copy(&pool.producer.pool_id()) {
                hasher.update(&copy.sequence.to_le_bytes());
                for word in &copy.words {
                    hasher.update(&word.to_le_bytes());
                }
            }
        }
    }
    hasher.finalize().to_hex()[..16].to_owned()
}

#[cfg(test)]
mod tests {
    use kvrelay::node::NodeStatus;
    use kvrelay_core::control::ControlHealth;
    use kvrelay_core::host::HostHealth;

    use super::node_fault;

    fn status(healthy: bool, control_error: Option<&str>, fenced: usize) -> NodeStatus {
        let host = HostHealth {
            healthy: fenced == 0,
            shutting_down: false,
            host_last_error: None,
            endpoint_count: 2,
            active_endpoint_count: 2 - fenced,
            fenced_endpoint_count: fenced,
            budget_refused_endpoint_count: 0,
            pools_max: 2_048,
        };
        let control = ControlHealth {
            healthy,
            host,
            control_last_error: control_error.map(str::to_owned),
            catalog_revision: 1,
            topology_revision: 1,
            pool_count: 2 - fenced,
            degraded_load_coverage_pool_count: 0,
            counters: Default::default(),
        };
        NodeStatus { healthy, control: Some(control), ..NodeStatus::default() }
    }

    #[test]
    fn an_invariant_failure_or_an_unexplained_unhealthy_node_is_a_fault() {
        assert_eq!(node_fault(&status(true, None, 0)), None);
        assert_eq!(node_fault(&NodeStatus::default()), None, "before the first step");
        // A fenced endpoint explains an unhealthy node.
        assert_eq!(node_fault(&status(false, None, 1)), None);
        let failed = node_fault(&status(false, Some("a tracker without a pool"), 0));
        assert_eq!(failed.as_deref(), Some("control invariant failed: a tracker without a pool"));
        assert!(node_fault(&status(false, None, 0)).unwrap().contains("unhealthy"));
    }
}
