//! The turmoil hosts of a journal replay.
//!
//! - `relay` runs the real node. Its first boot is started by [`JournalReplay::start`] with the
//!   recorded configuration, seed, checkpoint schedule and recovery answers; a task on the same
//!   host feeds every journaled input at `origin + its recorded time` (so the node sees the
//!   recorded times exactly) with the wall clock set to the recorded reading (plus any scripted
//!   skew). The node serves the WAN contract on turmoil's network. A scripted `relay-restart`
//!   bounces the host: the new boot is a new node (new incarnation and seed derived from the
//!   recorded ones, no recovery answers: the journal's workers are not there to ask) that first
//!   takes the discovery state the inputs fed so far leave ([`listing_after`]), then the
//!   remaining inputs at their times.
//! - `consumer-a` runs the reference consumer for the whole replay.
//! - `checker` plays the fault script, takes the replay's report once the node's time passed
//!   the journal's end, lets the WAN quiesce and evaluates the checks.
//!
//! With `dc-partition` or `event-noise` in the script the inputs travel through the simulated
//! DC planes: a `planes` host as in a scenario ([`crate::planes`]). The feeder writes the
//! discovery state each discovery input leaves as registrations and encodes event-plane inputs
//! to their wire bytes; the relay host reads them back over turmoil TCP with the production
//! record differ and decoders, so a partition, stall or noise acts on them as on a live DC.
//! Otherwise the inputs go to the node as recorded.

use kvrelay::node::InputSender;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::journal::{END_MARGIN, JournalHeader, JournalReplay, ReplayReport};
use kvrelay::node::{NoRecovery, NodeConfig, start_node};
use kvrelay::runtime::{InlineExecutor, ManualWallClock, WallClock};
use kvrelay::wan::WanViews;
use kvrelay_consumer::ConsumerSnapshot;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::RelayIdentity;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_core::wire::{LoadUpdate, validate_load_update};
use tokio::sync::watch;
use tokio::time::Instant;

use super::listing::DiscoveryState;
use super::listing::listing_after;
use crate::planes::client::PlanesClient;
use crate::planes::frame::ToPlanes;
use crate::planes::publisher::Publisher;
use crate::planes::records::registrations;
use crate::planes::{self, Planes};
use crate::scenario::{Expect, Fault, ScriptedFault};
use crate::trace::{EntryTrace, Trace, TraceEvent};
use crate::{
    CHECKER_HOST, CONSUMER_HOST, CONVERGENCE_TIMEOUT, Check, HostResult, QUIESCENCE, RELAY_HOST,
    consumer_for, describe, lock, meets, oracles, replicas_equal,
};

/// What the checker hands back: the replay's report, the checks and the final-state digest.
pub(super) type Evaluation = (Option<ReplayReport>, Vec<Check>, String);

/// State shared by the replay's hosts (turmoil runs every host on one OS thread).
#[derive(Clone)]
pub(super) struct ReplayWorld {
    pub replay: Arc<JournalReplay>,
    pub seed: u64,
    pub script: Arc<Vec<ScriptedFault>>,
    pub expect: Option<Arc<Expect>>,
    /// The consumer connects only once the journal's end has passed.
    pub consumer_after_end: bool,
    /// The simulated DC planes, when the script has plane faults.
    pub plane: Option<Arc<Mutex<Planes>>>,
    /// The discovery state the inputs fed so far leave (kept only with planes).
    pub discovery: Arc<Mutex<DiscoveryState>>,
    /// Encodes event-plane inputs for the planes (and counts them).
    pub publisher: Arc<Mutex<Publisher>>,
    pub wall: Arc<ManualWallClock>,
    pub skew_ms: Arc<AtomicI64>,
    /// Index of the next journaled input to feed (survives relay restarts).
    pub next_input: Arc<AtomicUsize>,
    /// Simulated time of the first boot's node start.
    pub origin: Arc<Mutex<Option<Duration>>>,
    pub fed: watch::Sender<bool>,
    pub boots: Arc<AtomicU64>,
    pub bounce: crate::net::Bounce,
    pub decode_errors: Arc<AtomicU64>,
    /// The one long-lived consumer (`consumer-a`), in a one-slot list.
    pub consumer: crate::ConsumerSlots,
    pub trace: Trace,
    /// The current boot's WAN views (its published load is dumped at the end).
    pub views: Arc<Mutex<Option<WanViews>>>,
    /// The load window the relay published at the journal's end.
    pub load_at_end: Arc<Mutex<Option<LoadUpdate>>>,
    pub done: watch::Sender<bool>,
    pub result: Arc<Mutex<Option<Evaluation>>>,
}

/// The journal's wall-clock readings, shifted by the scripted skew.
#[derive(Debug)]
struct ReplayClock {
    wall: Arc<ManualWallClock>,
    skew_ms: Arc<AtomicI64>,
}

impl WallClock for ReplayClock {
    fn now_unix_us(&self) -> u64 {
        let now = i128::from(self.wall.now_unix_us());
        let skewed = now + i128::from(self.skew_ms.load(Ordering::Relaxed)) * 1000;
        u64::try_from(skewed.max(0)).unwrap_or(u64::MAX)
    }
}

/// The configuration of boot `boot` after a restart: the recorded one with a new relay
/// incarnation and node seed, both derived from the recorded seed.
fn restarted_config(header: &JournalHeader, boot: u64) -> NodeConfig {
    let mut config = (*header.node).clone();
    let mut rng = rng_from_seed(derive_seed(header.rng_seed, &format!("replay/relay/{boot}")));
    config.control.relay = RelayIdentity::start(config.control.relay.drt_instance_id, &mut rng);
    config.rng_seed = derive_seed(header.rng_seed, &format!("replay/node/{boot}"));
    config
}

fn sim_elapsed() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

/// Where the feeder hands inputs.
enum Sink {
    Node(InputSender),
    Planes(Arc<Mutex<Planes>>),
}

/// The relay host: a node (the journal's on the first boot), the feeder, the relay observer and
/// the WAN service.
pub(super) async fn run_relay(world: ReplayWorld) -> HostResult {
    let boot = world.boots.fetch_add(1, Ordering::Relaxed);
    let clock: Arc<dyn WallClock> =
        Arc::new(ReplayClock { wall: Arc::clone(&world.wall), skew_ms: world.skew_ms.clone() });
    let (node, base, listing) = if boot == 0 {
        let config = (*world.replay.header().node).clone();
        let (node, origin) =
            world.replay.start(config, Arc::new(InlineExecutor), Arc::clone(&clock))?;
        *lock(&world.origin) = Some(sim_elapsed());
        (node, origin, Vec::new())
    } else {
        let node = start_node(
            restarted_config(world.replay.header(), boot),
            Arc::new(InlineExecutor),
            Arc::clone(&clock),
            Arc::new(NoRecovery),
        )?;
        let first = lock(&world.origin).unwrap_or_default();
        let since = sim_elapsed().saturating_sub(first);
        let now = Instant::now();
        let fed = world.next_input.load(Ordering::Relaxed);
        let scope = &world.replay.header().node.control.scope;
        let listing = listing_after(scope, world.replay.inputs()[..fed].iter().map(|(_, i)| i));
        (node, now.checked_sub(since).unwrap_or(now), listing)
    };
    world.trace.record(TraceEvent::RelayBoot { boot, incarnation: node.relay.relay_incarnation });
    *lock(&world.views) = Some(node.views.clone());
    let sink = match &world.plane {
        Some(plane) => {
            // The planes host keeps the discovery state across relay restarts: a new boot lists it.
            let scope = world.replay.header().node.control.scope.clone();
            let (client, _) = PlanesClient::new(scope, Arc::clone(&world.decode_errors));
            #[allow(
                clippy::disallowed_methods,
                reason = "a !Send host task on the LocalSet (see above)"
            )]
            drop(tokio::task::spawn_local(client.run(node.inputs.clone())));
            Sink::Planes(Arc::clone(plane))
        }
        None => {
            for fact in listing {
                node.inputs.send(fact).await?;
            }
            Sink::Node(node.inputs.clone())
        }
    };
    kvrelay::runtime::spawn(feed(world.clone(), base, sink));
    let tuning = kvrelay::config::WanTuning::default();
    crate::serve_node(world.trace.clone(), boot, node, clock, tuning, world.bounce.crashing(), None)
        .await
}

/// Feed the journal's inputs from the next one on, each at `base + its recorded time`.
async fn feed(world: ReplayWorld, base: Instant, sink: Sink) {
    let inputs = world.replay.inputs();
    loop {
        let index = world.next_input.load(Ordering::Relaxed);
        let Some((at, input)) = inputs.get(index) else { break };
        tokio::time::sleep_until(base + at.mono()).await;
        world.wall.set_unix_us(at.wall_us);
        match &sink {
            Sink::Node(inputs) => {
                if inputs.send(input.clone()).await.is_err() {
                    return;
                }
            }
            Sink::Planes(plane) => publish(&world, plane, input),
        }
        world.next_input.store(index + 1, Ordering::Relaxed);
    }
    // Kept even when nobody waits yet (the checker subscribes once its script is played).
    world.fed.send_replace(true);
}

/// Hand `input` to the planes: a discovery input as the registrations the discovery state it
/// leaves describes, an event-plane input as its wire bytes.
fn publish(world: &ReplayWorld, plane: &Mutex<Planes>, input: &DcInput) {
    let now = crate::sim_ms();
    if planes::is_event_plane(input) {
        let mut publisher = lock(&world.publisher);
        publisher.publish(vec![input.clone()]);
        if let Some(ToPlanes::Publish(publications)) = publisher.take() {
            lock(plane).apply(publications, now);
        }
    } else {
        let mut discovery = lock(&world.discovery);
        discovery.apply(input);
        lock(plane).register(&registrations(&discovery.listing()), now);
    }
}

/// The planes host: serves the relay host (recovery queries reach no worker: a replay has
/// none). Discovery leases never expire here: removals are the journal's inputs.
pub(super) async fn run_planes(plane: Arc<Mutex<Planes>>) -> HostResult {
    planes::server::serve(plane, Arc::new(NoRecovery)).await?;
    Ok(())
}

/// Wait until every input was fed and the node's time passed the journal's end.
async fn journal_end(world: &ReplayWorld) {
    let _ = world.fed.subscribe().wait_for(|fed| *fed).await;
    let first = lock(&world.origin).unwrap_or_default();
    let end = first + world.replay.end() + END_MARGIN + Duration::from_millis(2);
    tokio::time::sleep(end.saturating_sub(sim_elapsed())).await;
}

/// The long-lived consumer (from the start, or from the journal's end).
pub(super) async fn run_consumer_host(world: ReplayWorld) -> HostResult {
    if world.consumer_after_end {
        journal_end(&world).await;
    }
    let slots = Arc::clone(&world.consumer);
    crate::hold_consumer(world.seed, CONSUMER_HOST, 0, slots, world.done.subscribe(), None).await
}

fn apply(world: &ReplayWorld, fault: &Fault) {
    match fault {
        // `faults::check` admits only targets naming consumer-a.
        Fault::WanPartition { .. } => turmoil::partition(RELAY_HOST, CONSUMER_HOST),
        Fault::WanRepair { .. } => turmoil::repair(RELAY_HOST, CONSUMER_HOST),
        Fault::WanHold { .. } => turmoil::hold(RELAY_HOST, CONSUMER_HOST),
        Fault::WanRelease { .. } => turmoil::release(RELAY_HOST, CONSUMER_HOST),
        Fault::DcPartition { .. } | Fault::DcRepair | Fault::EventNoise(_) => {
            if let Some(plane) = &world.plane {
                planes::apply_fault(plane, RELAY_HOST, fault);
            }
        }
        Fault::RelayRestart => world.bounce.request(),
        Fault::ClockSkew { ms } => world.skew_ms.store(*ms, Ordering::Relaxed),
        // Refused when the script was checked (`faults::check`).
        _ => {}
    }
}

/// Play the script, take the report after the journal's end, quiesce, evaluate.
pub(super) async fn run_checker(world: ReplayWorld) -> HostResult {
    let start = Instant::now();
    kvrelay::runtime::spawn(crate::follow_consumers(
        world.trace.clone(),
        vec![CONSUMER_HOST.to_owned()],
        Arc::clone(&world.consumer),
        world.done.subscribe(),
    ));
    for scripted in world.script.iter() {
        tokio::time::sleep_until(start + Duration::from_millis(scripted.at_ms)).await;
        apply(&world, &scripted.fault);
        world.trace.record(TraceEvent::Fault { fault: scripted.fault.clone() });
    }
    journal_end(&world).await;
    let report = world.replay.report();
    let load = lock(&world.views).as_ref().map(|views| views.current_load());
    *lock(&world.load_at_end) = load.and_then(|load| validate_load_update(&load).ok());
    let planes = world
        .plane
        .as_ref()
        .map_or_else(Default::default, |plane| planes::counters(plane, &world.publisher));
    world.trace.record(TraceEvent::TrafficOff { planes });
    tokio::time::sleep(QUIESCENCE).await;
    let (checks, digest) = evaluate(&world, &report).await;
    *lock(&world.result) = Some((Some(report), checks, digest));
    world.done.send_replace(true);
    Ok(())
}

/// The same catalog (producers and filter states) and readiness.
fn same_view(ours: &ConsumerSnapshot, theirs: &ConsumerSnapshot) -> bool {
    let pools = |s: &ConsumerSnapshot| {
        s.pools.iter().map(|pool| (pool.producer, pool.status)).collect::<Vec<_>>()
    };
    let readiness =
        |s: &ConsumerSnapshot| s.readiness.iter().map(EntryTrace::of).collect::<Vec<_>>();
    ours.catalog_revision.is_some()
        && pools(ours) == pools(theirs)
        && readiness(ours) == readiness(theirs)
        && ours.pools.iter().all(|pool| pool.status == kvrelay_consumer::FilterStatus::Ready)
}

/// Poll `check` every 100 ms until it holds or the convergence bound passes.
async fn within_bound<T>(mut check: impl FnMut() -> (bool, T)) -> (bool, T) {
    let deadline = Instant::now() + CONVERGENCE_TIMEOUT;
    loop {
        let (held, detail) = check();
        if held || Instant::now() >= deadline {
            return (held, detail);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn evaluate(world: &ReplayWorld, report: &ReplayReport) -> (Vec<Check>, String) {
    let events = world.trace.events();
    let mut checks = vec![
        oracles::producer_identity_never_reused(&events),
        oracles::sequence_contiguity(&events),
        oracles::withdrawal_precedes_teardown(&events),
        oracles::unknown_only_before_authority(&events),
    ];
    checks.push(checkpoints_check(report, !world.script.is_empty()));
    let Some(consumer) = lock(&world.consumer).first().cloned().flatten() else {
        checks.push(Check { name: "setup", passed: false, detail: "no consumer".into() });
        return (checks, String::new());
    };
    let reference = match consumer_for(world.seed, CHECKER_HOST, None) {
        Ok(reference) => reference,
        Err(error) => {
            checks.push(Check { name: "setup", passed: false, detail: error.to_string() });
            return (checks, String::new());
        }
    };
    let (caught_up, ()) =
        within_bound(|| (same_view(&consumer.snapshot(), &reference.snapshot()), ())).await;
    checks.push(Check {
        name: "consumer-caught-up",
        passed: caught_up,
        detail: format!(
            "{CONSUMER_HOST}: {}; fresh: {}",
            describe(&consumer.snapshot()),
            describe(&reference.snapshot())
        ),
    });
    let (equal, detail) = within_bound(|| replicas_equal(&consumer, &reference)).await;
    checks.push(Check { name: "replica-equals-relay", passed: equal, detail });
    if let Some(expect) = &world.expect {
        let (a, fresh) = (consumer.snapshot(), reference.snapshot());
        checks.push(Check {
            name: "expected-outcome",
            passed: meets(&a, expect) && meets(&fresh, expect),
            detail: format!(
                "expected {} pools, readiness {:?}; {CONSUMER_HOST} {}",
                expect.pools,
                expect.readiness,
                describe(&a)
            ),
        });
        // A replay does not sample its relay's WAN counters: `lagged` holds only on the
        // consumer's own count of lagging ends.
        checks.push(crate::consumer_followed(expect.consumer.of(0), expect.pools, 0, &consumer));
    }
    if world.plane.is_some() {
        let decode_errors = world.decode_errors.load(Ordering::Relaxed);
        checks.push(Check {
            name: "inputs-decode",
            passed: decode_errors == 0,
            detail: format!("{decode_errors} DC-plane messages the relay's decoders refused"),
        });
    }
    let digest =
        crate::digest(&[&consumer.snapshot(), &reference.snapshot()], &[&consumer, &reference]);
    reference.shutdown().await;
    (checks, digest)
}

/// Checkpoints must be reproduced without faults; with faults a divergence is expected and
/// reported, and only a damaged journal fails.
fn checkpoints_check(report: &ReplayReport, faulted: bool) -> Check {
    let detail = match (&report.divergence, &report.journal_fault) {
        (_, Some(fault)) => format!("journal error: {fault}"),
        (Some(divergence), None) => format!(
            "diverged at checkpoint {} of {}{}",
            divergence.index,
            report.checkpoints_compared,
            if faulted { " (expected: faults are layered on the replay)" } else { "" }
        ),
        (None, None) => format!("{} checkpoints reproduced", report.checkpoints_compared),
    };
    let passed = report.journal_fault.is_none() && (faulted || report.divergence.is_none());
    Check { name: "checkpoints", passed, detail }
}
