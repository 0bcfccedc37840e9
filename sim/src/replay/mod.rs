//! `kvrelay-sim replay JOURNAL`: the real relay node on a turmoil host, fed a recorded
//! journal's inputs at their recorded times with the recorded configuration and seed, serving
//! the WAN contract to a reference consumer; optionally with scripted faults layered on top.
//!
//! [`replay`] runs one replay and returns a [`ReplayOutcome`]: the journal replay's report
//! (every recorded checkpoint compared with the replayed one), the checks, the typed trace and
//! its digest. The checks are the trace oracles that need no truth model (see [`crate::oracles`]),
//! `checkpoints` (reproduced; with faults a divergence is expected and only reported),
//! `consumer-caught-up` (the long-lived consumer's catalog and readiness equal a fresh
//! subscriber's, every replica ready), `replica-equals-relay`, and for an incident file its
//! `expected-outcome`. See `hosts.rs` for how the hosts run and [`faults`] for which faults apply.

pub mod dumps;
pub mod faults;
mod hosts;
pub mod listing;
mod report;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::journal::{JournalReplay, ReplayOptions, ReplayReport};
use kvrelay::runtime::ManualWallClock;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_core::wire::LoadUpdate;
use tokio::sync::watch;

pub use self::report::{render, replay_paused, verdict};
use crate::planes::{PLANES_HOST, Planes};
use crate::scenario::{Expect, ScriptedFault};
use crate::trace::{Stamped, Trace};
use crate::{CHECKER_HOST, CONSUMER_HOST, Check, RELAY_HOST, Sim, lock};

/// How to replay.
#[derive(Debug, Clone, Default)]
pub struct ReplaySetup {
    /// Replay only the inputs recorded in the first this-long of node time.
    pub until: Option<Duration>,
    /// Faults at simulated times (checked with [`faults::check`]).
    pub faults: Vec<ScriptedFault>,
    /// Seed of the simulation's own choices (turmoil, the consumers); the node's seed is the
    /// recorded one.
    pub seed: u64,
    /// The expected outcome of an incident file.
    pub expect: Option<Expect>,
    /// Connect the WAN consumer only once the journal's end has passed (to look at a window
    /// without WAN traffic). Checkpoints reproduce either way: until the journal's end every
    /// pool performs its recorded publication points and a replay subscriber moves none.
    pub consumer_after_end: bool,
}

/// What one replay produced.
#[derive(Debug, Clone)]
pub struct ReplayOutcome {
    /// The journal replay's report (`None` if the simulation failed before the end).
    pub report: Option<ReplayReport>,
    /// Every check, in evaluation order.
    pub checks: Vec<Check>,
    /// The typed trace.
    pub trace: Vec<Stamped>,
    /// Digest of the trace and the consumers' final state: the determinism witness.
    pub digest: String,
    /// The simulation itself failed (a host errored, e.g. the node refused the configuration).
    pub error: Option<String>,
    /// Simulated time the replay took.
    pub simulated: Duration,
    /// The load window the relay published at the journal's end.
    pub load: Option<LoadUpdate>,
}

impl ReplayOutcome {
    /// Every check held and the simulation completed.
    #[must_use]
    pub fn passed(&self) -> bool {
        crate::all_passed(&self.checks, self.error.as_deref())
    }

    /// The first failing check (or the simulation error), one line.
    #[must_use]
    pub fn failure(&self) -> Option<String> {
        crate::first_failure(&self.checks, self.error.as_deref())
    }

    /// The report (see [`render`]), then every check and the digest.
    #[must_use]
    pub fn render(&self, dump_state: bool) -> String {
        let mut text = self.report.as_ref().map(|r| render(r, dump_state)).unwrap_or_default();
        if dump_state {
            report::dump_load(&mut text, self.load.as_ref());
        }
        crate::render_checks(&mut text, &self.checks, self.error.as_deref());
        let _ = writeln!(
            text,
            "  digest {} ({} trace events, {:.1} simulated s)",
            self.digest,
            self.trace.len(),
            self.simulated.as_secs_f64()
        );
        text
    }
}

/// Replay the journal at `path` in the simulator (see the module doc).
pub fn replay(path: &Path, setup: &ReplaySetup) -> anyhow::Result<ReplayOutcome> {
    let script = faults::check(setup.faults.clone())?;
    // Through the planes the node's inputs are not the journal's one by one: its own clock.
    let own_clock = faults::need_planes(&script);
    let options = ReplayOptions { until: setup.until, own_clock };
    let replay = Arc::new(JournalReplay::open(path, options)?);
    let plane = own_clock.then(|| {
        Arc::new(Mutex::new(Planes::new(rng_from_seed(derive_seed(setup.seed, "replay/plane")))))
    });
    let (fed, _) = watch::channel(false);
    let (done, _) = watch::channel(false);
    let scope = replay.header().node.control.scope.clone();
    let world = hosts::ReplayWorld {
        wall: Arc::new(ManualWallClock::new(replay.header().wall_origin_us)),
        replay,
        seed: setup.seed,
        script: Arc::new(script),
        expect: setup.expect.clone().map(Arc::new),
        consumer_after_end: setup.consumer_after_end,
        discovery: Arc::new(Mutex::new(listing::DiscoveryState::new(scope))),
        publisher: Arc::default(),
        plane,
        skew_ms: Arc::default(),
        next_input: Arc::default(),
        origin: Arc::default(),
        fed,
        boots: Arc::default(),
        bounce: crate::net::Bounce::default(),
        decode_errors: Arc::default(),
        consumer: Arc::new(Mutex::new(vec![None])),
        trace: Trace::default(),
        views: Arc::default(),
        load_at_end: Arc::default(),
        done,
        result: Arc::default(),
    };
    let mut builder = Sim::new(setup.seed).builder;
    // The journal's span, the last fault, then quiescence and the convergence bounds.
    let last_fault = world.script.last().map_or(0, |scripted| scripted.at_ms);
    builder.simulation_duration(
        world.replay.end().max(Duration::from_millis(last_fault)) + crate::SIMULATION_DURATION,
    );
    let mut sim = builder.build();
    let relay_world = world.clone();
    sim.host(RELAY_HOST, move || hosts::run_relay(relay_world.clone()));
    if let Some(plane) = &world.plane {
        let plane = Arc::clone(plane);
        sim.host(PLANES_HOST, move || hosts::run_planes(Arc::clone(&plane)));
    }
    sim.client(CONSUMER_HOST, hosts::run_consumer_host(world.clone()));
    sim.client(CHECKER_HOST, hosts::run_checker(world.clone()));
    let error = crate::step_to_end(&mut sim, &world.bounce);
    let simulated = sim.elapsed();
    let (report, checks, final_digest) = lock(&world.result).take().unwrap_or_default();
    let trace = world.trace.events();
    let digest = crate::run_digest(&trace, &final_digest);
    let load = lock(&world.load_at_end).take();
    Ok(ReplayOutcome { report, checks, trace, digest, error, simulated, load })
}
