//! The deterministic simulator of kvrelay.
//!
//! One turmoil simulation per (seed, scenario). Host `relay` runs a relay node fed by an
//! in-process [`SimulatedDc`] (the shape of `kvrelay::demo`, with the inline executor and a wall
//! clock derived from turmoil's simulated time) and serves the WAN contract on a turmoil
//! listener. Host `consumer-a` runs the reference [`RelayConsumer`] over turmoil's network. Host
//! `checker` plays the scenario's story (traffic, worker restarts, partitions), then stops the
//! DC's traffic, lets the system quiesce and evaluates the oracles:
//!
//! - **replica-equals-relay**: every pool replica of `consumer-a` equals the words a freshly
//!   subscribed consumer receives from the relay (the relay's current filter);
//! - **no-false-negatives**: every canonical block hash a simulated worker of a pool's endpoint
//!   caches is found in `consumer-a`'s replica of that pool;
//! - **catalog-and-readiness-converge**: every demo pool is catalogued with an installed replica
//!   and every demo model is READY;
//! - scenario-specific checks (a partitioned consumer must have resubscribed; a stalled one
//!   must not have had to).
//!
//! Run it with `cargo run -p kvrelay-sim -- run --seed N [--scenario NAME]` or
//! `cargo run -p kvrelay-sim -- sweep --seeds A..B`; a failing run prints the command that
//! reproduces it.
//!
//! Everything random derives from the one seed (turmoil's, tokio's, the relay's, the DC's and
//! the consumers'), so a run's [`Outcome::digest`] is a function of seed and scenario.

pub mod net;
mod scenario;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use kvrelay::ckf::{Addressing, word_contains};
use kvrelay::config::WanTuning;
use kvrelay::consumer::{ConsumerConfig, ConsumerSnapshot, FilterStatus, RelayConsumer};
use kvrelay::control::ControlConfig;
use kvrelay::demo::SharedDc;
use kvrelay::discovery::DiscoveryScope;
use kvrelay::identity::{RelayIdentity, stable_dc_id};
use kvrelay::inputs::DcInput;
use kvrelay::node::{NodeConfig, start_node};
use kvrelay::pool::ActorConfig;
use kvrelay::publication::HubConfig;
use kvrelay::readiness::ReadinessState;
use kvrelay::rng::{RelayRng, derive_seed, rng_from_seed};
use kvrelay::runtime::{InlineExecutor, WallClock};
use kvrelay::wan::{RelayService, serve};
use kvrelay::workload::{Deployment, SimulatedDc, TrafficConfig};
use tokio::sync::watch;

pub use scenario::{Scenario, Step};

/// The relay host's name on turmoil's network.
pub const RELAY_HOST: &str = "relay";
/// The long-lived consumer host's name.
pub const CONSUMER_HOST: &str = "consumer-a";
/// The host that plays the scenario and evaluates the oracles.
pub const CHECKER_HOST: &str = "checker";
/// The WAN port of the relay.
pub const RELAY_PORT: u16 = 7000;
/// Simulated wall-clock start: 2026-01-01T00:00:00Z.
pub const EPOCH_UNIX_SECONDS: u64 = 1_767_225_600;
/// Upper bound of simulated time per run.
pub const SIMULATION_DURATION: Duration = Duration::from_secs(600);
/// Pools the demo deployment publishes.
pub const DEMO_POOL_COUNT: usize = 4;
/// Models the demo deployment serves.
pub const DEMO_MODEL_COUNT: usize = 3;

/// DC traffic tick.
const TRAFFIC_TICK: Duration = Duration::from_millis(50);
/// Requests served per traffic tick.
const REQUESTS_PER_TICK: usize = 8;
/// Filter sizing (the demo's). The no-false-negatives oracle holds only while every pool stays
/// within it: past capacity the relay omits blocks by design (capacity omissions). The longest
/// scenario caches about 23k blocks in its largest pool; with 4096 the oracle fails, as it must.
const EXPECTED_UNIQUE_BLOCKS: u64 = 65_536;
/// How long traffic stays off before the oracles look.
const QUIESCENCE: Duration = Duration::from_secs(3);
/// Bound on every convergence wait of the oracles (simulated time).
const CONVERGENCE_TIMEOUT: Duration = Duration::from_secs(60);

/// A wall clock reading turmoil's simulated time since the builder's fixed epoch.
#[derive(Debug, Clone, Copy, Default)]
pub struct SimWallClock;

impl WallClock for SimWallClock {
    fn now_unix_us(&self) -> u64 {
        let since_epoch = turmoil::since_epoch().unwrap_or(Duration::from_secs(EPOCH_UNIX_SECONDS));
        u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX)
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

/// What one simulated run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The run's seed.
    pub seed: u64,
    /// The scenario played.
    pub scenario: Scenario,
    /// Every oracle's result, in evaluation order.
    pub checks: Vec<Check>,
    /// A hex digest of the final catalog, every replica's words and the consumers' counters.
    pub digest: String,
    /// The simulation itself failed (a host errored or the run exceeded its duration).
    pub error: Option<String>,
}

impl Outcome {
    /// Every oracle held and the simulation completed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.error.is_none() && !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }

    /// The one command that reproduces this run.
    #[must_use]
    pub fn reproduce_command(&self) -> String {
        format!(
            "cargo run -p kvrelay-sim -- run --seed {} --scenario {}",
            self.seed,
            self.scenario.name()
        )
    }

    /// A human-readable report.
    #[must_use]
    pub fn render(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(text, "scenario {} seed {}", self.scenario.name(), self.seed);
        for check in &self.checks {
            let verdict = if check.passed { "ok  " } else { "FAIL" };
            let _ = writeln!(text, "  {verdict} {}: {}", check.name, check.detail);
        }
        if let Some(error) = &self.error {
            let _ = writeln!(text, "  FAIL simulation: {error}");
        }
        let _ = writeln!(text, "  digest {}", self.digest);
        if !self.passed() {
            let _ = writeln!(text, "  reproduce: {}", self.reproduce_command());
        }
        text
    }
}

/// What the checker asks of the relay host's DC driver.
#[derive(Debug, Default)]
struct DriverControl {
    traffic_off: bool,
    restarts: Vec<usize>,
}

/// The oracles' checks and the trace digest.
type Verdict = (Vec<Check>, String);

/// State shared between the hosts (turmoil runs every host on one OS thread).
#[derive(Debug, Clone)]
struct World {
    seed: u64,
    dc: Arc<Mutex<Option<SharedDc>>>,
    control: Arc<Mutex<DriverControl>>,
    consumer: Arc<Mutex<Option<Arc<RelayConsumer>>>>,
    done: watch::Sender<bool>,
    result: Arc<Mutex<Option<Verdict>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One simulation: a seeded turmoil builder and the hosts of the demo deployment.
pub struct Sim {
    seed: u64,
    builder: turmoil::Builder,
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
            .tick_duration(Duration::from_millis(1));
        Sim { seed, builder }
    }

    /// Play `scenario` to the end and evaluate the oracles.
    #[must_use]
    pub fn run(self, scenario: Scenario) -> Outcome {
        let (done, _) = watch::channel(false);
        let world = World {
            seed: self.seed,
            dc: Arc::new(Mutex::new(None)),
            control: Arc::new(Mutex::new(DriverControl::default())),
            consumer: Arc::new(Mutex::new(None)),
            done,
            result: Arc::new(Mutex::new(None)),
        };
        let mut sim = self.builder.build();
        let relay_world = world.clone();
        sim.host(RELAY_HOST, move || run_relay(relay_world.clone()));
        sim.client(CONSUMER_HOST, run_consumer_host(world.clone()));
        sim.client(CHECKER_HOST, run_checker(world.clone(), scenario));
        let error = sim.run().err().map(|error| error.to_string());
        let (checks, digest) = lock(&world.result).take().unwrap_or_default();
        Outcome { seed: self.seed, scenario, checks, digest, error }
    }
}

type HostResult = Result<(), Box<dyn std::error::Error>>;

fn node_config(seed: u64) -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(seed, "sim/relay"));
    let relay = RelayIdentity::start(0x051d_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let mut control = ControlConfig::new(relay, stable_dc_id("sim-dc").expect("valid name"), scope);
    control.expected_unique_blocks = EXPECTED_UNIQUE_BLOCKS;
    NodeConfig {
        control,
        actor: ActorConfig::default(),
        hub: HubConfig::default(),
        max_kicks: kvrelay::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(seed, "sim/node"),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 1024,
        load_fanout_capacity: 16,
    }
}

/// The relay host: node, DC driver and WAN service on a turmoil listener.
async fn run_relay(world: World) -> HostResult {
    let mut dc_rng = rng_from_seed(derive_seed(world.seed, "sim/dc"));
    let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
        &Deployment::demo(),
        TrafficConfig::default(),
        &mut dc_rng,
    ))));
    *lock(&world.dc) = Some(dc.clone());
    let clock: Arc<dyn WallClock> = Arc::new(SimWallClock);
    let node = start_node(
        node_config(world.seed),
        Arc::new(InlineExecutor),
        Arc::clone(&clock),
        Arc::new(dc.clone()),
    )?;
    tokio::spawn(drive(dc, node.inputs.clone(), dc_rng, Arc::clone(&world.control)));
    let tuning = WanTuning::default();
    let service = RelayService::new(
        node.relay,
        node.views.clone(),
        Arc::clone(&node.publications),
        clock,
        tuning,
    );
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", RELAY_PORT)).await?;
    serve(service, Box::pin(net::incoming(listener)), &tuning, std::future::pending()).await?;
    node.shutdown().await;
    Ok(())
}

/// The DC driver: discovery first, then traffic every tick until the checker turns it off;
/// worker restarts when the checker asks.
async fn drive(
    dc: SharedDc,
    inputs: tokio::sync::mpsc::Sender<DcInput>,
    mut rng: RelayRng,
    control: Arc<Mutex<DriverControl>>,
) {
    for fact in dc.with(|dc| dc.discovery_facts()) {
        if inputs.send(fact).await.is_err() {
            return;
        }
    }
    let mut ticks = tokio::time::interval(TRAFFIC_TICK);
    let mut tick_count = 0u64;
    loop {
        ticks.tick().await;
        tick_count += 1;
        let (traffic_off, restarts) = {
            let mut control = lock(&control);
            (control.traffic_off, std::mem::take(&mut control.restarts))
        };
        let mut facts = Vec::new();
        for index in restarts {
            facts.extend(dc.with(|dc| dc.restart_worker(index, &mut rng)));
        }
        if !traffic_off {
            facts.extend(dc.with(|dc| dc.step(REQUESTS_PER_TICK, &mut rng)));
            if tick_count.is_multiple_of(10) {
                facts.extend(dc.with(|dc| dc.load_facts()));
            }
        }
        for fact in facts {
            if inputs.send(fact).await.is_err() {
                return;
            }
        }
    }
}

fn start_consumer(world: &World, host: &'static str) -> Result<RelayConsumer, HostResultError> {
    let endpoint = kvrelay::consumer::endpoint(&format!("http://{RELAY_HOST}:{RELAY_PORT}"))?;
    let channel = endpoint.connect_with_connector_lazy(net::connector(RELAY_HOST, RELAY_PORT));
    let config =
        ConsumerConfig { subscriber_id: format!("sim-{host}"), ..ConsumerConfig::default() };
    let mut rng = rng_from_seed(derive_seed(world.seed, host));
    Ok(RelayConsumer::start(channel, config, &mut rng)?)
}

type HostResultError = Box<dyn std::error::Error>;

/// The long-lived consumer: follows the relay until the checker is done.
async fn run_consumer_host(world: World) -> HostResult {
    let consumer = Arc::new(start_consumer(&world, CONSUMER_HOST)?);
    *lock(&world.consumer) = Some(Arc::clone(&consumer));
    let mut done = world.done.subscribe();
    let _ = done.wait_for(|done| *done).await;
    consumer.shutdown().await;
    Ok(())
}

/// Play the story, quiesce, evaluate the oracles, publish the result.
async fn run_checker(world: World, scenario: Scenario) -> HostResult {
    for step in scenario.steps() {
        match step {
            Step::Run(duration) => tokio::time::sleep(duration).await,
            Step::RestartWorker(index) => lock(&world.control).restarts.push(index),
            Step::PartitionConsumer => turmoil::partition(RELAY_HOST, CONSUMER_HOST),
            Step::RepairConsumer => turmoil::repair(RELAY_HOST, CONSUMER_HOST),
            Step::HoldConsumer => turmoil::hold(RELAY_HOST, CONSUMER_HOST),
            Step::ReleaseConsumer => turmoil::release(RELAY_HOST, CONSUMER_HOST),
        }
    }
    lock(&world.control).traffic_off = true;
    tokio::time::sleep(QUIESCENCE).await;
    let result = evaluate(&world, scenario).await;
    *lock(&world.result) = Some(result);
    let _ = world.done.send(true);
    Ok(())
}

/// The consumer's snapshot has every demo pool with a replica and every demo model READY.
fn converged(snapshot: &ConsumerSnapshot) -> bool {
    snapshot.pools.len() == DEMO_POOL_COUNT
        && snapshot.pools.iter().all(|pool| pool.status == FilterStatus::Ready)
        && snapshot.readiness.len() == DEMO_MODEL_COUNT
        && snapshot.readiness.iter().all(|entry| entry.state == ReadinessState::Ready)
}

fn describe(snapshot: &ConsumerSnapshot) -> String {
    let pools: Vec<String> = snapshot
        .pools
        .iter()
        .map(|pool| format!("{}={}", pool.descriptor.serving_endpoint, pool.status.name()))
        .collect();
    let ready =
        snapshot.readiness.iter().filter(|entry| entry.state == ReadinessState::Ready).count();
    format!(
        "{} pools [{}], {ready}/{} models READY, halted {:?}",
        snapshot.pools.len(),
        pools.join(", "),
        snapshot.readiness.len(),
        snapshot.halted
    )
}

async fn wait_converged(consumer: &RelayConsumer) -> (bool, ConsumerSnapshot) {
    match tokio::time::timeout(CONVERGENCE_TIMEOUT, consumer.wait_until(converged)).await {
        Ok(Ok(snapshot)) => (true, snapshot),
        _ => (false, consumer.snapshot()),
    }
}

/// Whether `words` (of the pool of `consumer`'s replica for `pool`) equal the reference's.
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

async fn evaluate(world: &World, scenario: Scenario) -> Verdict {
    let mut checks = Vec::new();
    let Some(consumer) = lock(&world.consumer).clone() else {
        checks.push(Check { name: "setup", passed: false, detail: "no consumer".into() });
        return (checks, String::new());
    };
    let Some(dc) = lock(&world.dc).clone() else {
        checks.push(Check { name: "setup", passed: false, detail: "no relay".into() });
        return (checks, String::new());
    };

    // (c) catalog and readiness converge, on the long-lived consumer and on a fresh one.
    let (converged_a, snapshot_a) = wait_converged(&consumer).await;
    let reference = match start_consumer(world, CHECKER_HOST) {
        Ok(reference) => reference,
        Err(error) => {
            checks.push(Check { name: "setup", passed: false, detail: error.to_string() });
            return (checks, String::new());
        }
    };
    let (converged_ref, snapshot_ref) = wait_converged(&reference).await;
    checks.push(Check {
        name: "catalog-and-readiness-converge",
        passed: converged_a && converged_ref,
        detail: format!(
            "{CONSUMER_HOST}: {}; fresh: {}",
            describe(&snapshot_a),
            describe(&snapshot_ref)
        ),
    });

    // (a) every replica equals the relay's current filter (as a fresh subscriber receives it).
    let mut equal = replicas_equal(&consumer, &reference);
    let deadline = tokio::time::Instant::now() + CONVERGENCE_TIMEOUT;
    while !equal.0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        equal = replicas_equal(&consumer, &reference);
    }
    checks.push(Check { name: "replica-equals-relay", passed: equal.0, detail: equal.1 });

    // (b) no false negatives: every block the workers of a pool's endpoint cache is in the replica.
    let snapshot_a = consumer.snapshot();
    let mut cached_total = 0usize;
    let mut missing = Vec::new();
    for pool in &snapshot_a.pools {
        let endpoint = pool.descriptor.serving_endpoint.to_string();
        let hashes: Vec<u64> = dc.with(|dc| {
            dc.workers()
                .iter()
                .filter(|worker| worker.spec().endpoint.to_string() == endpoint)
                .flat_map(|worker| {
                    worker
                        .ranks()
                        .iter()
                        .flat_map(|rank| rank.canonical_hashes().collect::<Vec<_>>())
                })
                .collect()
        });
        cached_total += hashes.len();
        let Some(copy) = consumer.filter_copy(&pool.producer.pool_id()) else {
            missing.push(format!("{endpoint}: no replica"));
            continue;
        };
        let addressing = Addressing::new(&pool.producer.format());
        let absent = hashes
            .iter()
            .filter(|hash| {
                let probe = addressing.probe(**hash);
                !(word_contains(copy.words[probe.bucket_a as usize], probe.fingerprint)
                    || word_contains(copy.words[probe.bucket_b as usize], probe.fingerprint))
            })
            .count();
        if absent > 0 {
            missing.push(format!("{endpoint}: {absent} of {} missing", hashes.len()));
        }
    }
    checks.push(Check {
        name: "no-false-negatives",
        passed: missing.is_empty() && cached_total > 0,
        detail: if missing.is_empty() {
            format!("{cached_total} cached blocks all present")
        } else {
            missing.join(", ")
        },
    });

    for check in scenario.extra_checks(&snapshot_a) {
        checks.push(check);
    }

    let digest = digest(&[&snapshot_a, &reference.snapshot()], &[&consumer, &reference]);
    reference.shutdown().await;
    (checks, digest)
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
