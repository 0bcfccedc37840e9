//! `kvrelay-sim`: run one scenario (or incident) file for one seed, sweep a directory of
//! scenarios and its `incidents/` over a seed range, check that a seed replays to the same trace
//! digest, replay a recorded journal in the simulator, or cut a journal window into an incident.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kvrelay_sim::incident::Incident;
use kvrelay_sim::replay::{ReplayOutcome, ReplaySetup};
use kvrelay_sim::scenario::Scenario;
use kvrelay_sim::{Sim, trace};

/// The simulator allocates and frees many small buffers per simulated message (wire frames,
/// decoded events, gRPC bodies); mimalloc serves them about a third faster than glibc's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "kvrelay-sim",
    version = kvrelay::build_info::VERSION_LINE,
    about = "Deterministic simulation of kvrelay"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one scenario file for one seed and print every oracle's verdict; an incident file
    /// (`scenarios/incidents/*.toml`, it names a `journal`) replays its journal and checks its
    /// expectation.
    Run {
        /// The scenario file (`scenarios/*.toml`) or incident file.
        file: PathBuf,
        /// The seed every random choice derives from.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write the typed trace as JSON lines to this file.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Write a timeline (HTML with an SVG) of faults, readiness, catalog and consumer.
        #[arg(long)]
        timeline: Option<PathBuf>,
        /// Journal every relay boot's inputs under this directory (one recording directory per
        /// boot, as `kvrelay serve --record` names them).
        #[arg(long, value_name = "DIR")]
        record: Option<PathBuf>,
    },
    /// Run every scenario of a directory, and every incident of its `incidents/`, for every
    /// seed in `A..B` (end exclusive).
    Sweep {
        /// The directory of scenario files.
        dir: PathBuf,
        /// The seed range, `A..B`.
        #[arg(long)]
        seeds: String,
        /// Also check determinism: every scenario run twice at this seed (its sweep run and one
        /// more) must give identical traces and digests, or the sweep fails.
        #[arg(long, value_name = "SEED")]
        determinism_seed: Option<u64>,
    },
    /// Replay a journal recorded by `kvrelay serve --record` (or a simulated run) in the
    /// simulator: the relay node on a turmoil host with the recorded configuration and seed, fed
    /// the inputs at their recorded times, serving a WAN consumer. Compares every checkpoint and
    /// checks the consumer against a fresh subscriber. Exits non-zero when a check fails (a
    /// divergence fails only without faults) or the journal is damaged.
    Replay {
        /// The recording directory (or one segment file).
        journal: PathBuf,
        /// Stop after the inputs recorded in the first SECS seconds (node time) and dump the
        /// state there: catalog, readiness and per-pool ownership.
        #[arg(long, value_name = "SECS")]
        until: Option<f64>,
        /// Write the typed trace as JSON lines to this file.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Layer the `[[faults]]` of this TOML file (scenario schema) on the replay.
        #[arg(long)]
        fault: Option<PathBuf>,
        /// Seed of the simulation's own choices (network, consumers, plane noise).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replay twice and require identical traces and digests.
        #[arg(long)]
        twice: bool,
        /// Connect the WAN consumer only after the journal's end, to look at a window without
        /// WAN traffic (the checkpoints reproduce with or without it: the replayed pools
        /// follow their recorded publication points, a replay subscriber moves nothing).
        #[arg(long)]
        consumer_after_end: bool,
    },
    /// Cut the window [FROM, TO] (node seconds) of a journal into DIR/NAME.kvj and an incident
    /// file DIR/NAME.toml expecting what the recorded relay published at the window's end (pool
    /// count, readiness, per pool the exact blocks and canonical digest); the ranks' KV state at
    /// the window's start is carried as the tree dumps their workers would answer.
    Cut {
        /// The recording directory (or one segment file).
        journal: PathBuf,
        /// Start of the window, seconds of node time.
        #[arg(long, value_name = "SECS")]
        from: f64,
        /// End of the window, seconds of node time.
        #[arg(long, value_name = "SECS")]
        to: f64,
        /// Where to write: DIR/NAME (NAME.kvj and NAME.toml are written).
        #[arg(long, value_name = "DIR/NAME")]
        out: PathBuf,
    },
    /// Shrink a failing run: search for the smallest fault list (drawn faults materialized as
    /// scripted ones) and the shortest `run_ms` that still fail with the same oracle at the
    /// seed, and write them as a scenario file.
    Shrink {
        /// The failing scenario file.
        file: PathBuf,
        /// The seed it fails at.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Where to write the reduced scenario (default: `shrunk-<name>-seed<N>.toml` in the
        /// current directory, outside `scenarios/` so sweeps do not pick it up).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run a seed twice and compare the trace digests.
    Determinism {
        /// The scenario file.
        file: PathBuf,
        /// The seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn parse_range(text: &str) -> anyhow::Result<std::ops::Range<u64>> {
    let (start, end) =
        text.split_once("..").ok_or_else(|| anyhow::anyhow!("--seeds must be A..B"))?;
    let range = start.trim().parse()?..end.trim().parse()?;
    anyhow::ensure!(!range.is_empty(), "--seeds {text} is empty");
    Ok(range)
}

/// Pass/fail counts, wall time and slowest convergence of one scenario in a sweep.
#[derive(Debug, Default)]
struct Row {
    passed: u64,
    failed: u64,
    wall: std::time::Duration,
    /// Most simulated ms from the last fault to catalog and readiness convergence.
    converged_ms: u64,
}

/// Print (and flush) one sweep run's line: `name`, `seed`, ok or FAIL, its wall time, `extra`.
fn progress(name: &str, seed: u64, passed: bool, wall: std::time::Duration, extra: &str) {
    let verdict = if passed { "ok" } else { "FAIL" };
    println!("  {name} seed {seed}: {verdict} in {:.2} s{extra}", wall.as_secs_f64());
    let _ = std::io::stdout().flush();
}

/// Whether `second` (a run of `first`'s scenario file `file` at its seed) gave the same trace
/// and digest: the line to print, `Err` when they differ.
fn same_run(first: &kvrelay_sim::Outcome, second: &kvrelay_sim::Outcome) -> Result<String, String> {
    let seed = first.seed;
    if first.digest == second.digest && first.trace == second.trace {
        Ok(format!("deterministic: {} seed {seed} digest {}", first.scenario, first.digest))
    } else {
        let diverged = first_difference(&first.trace, &second.trace);
        Err(format!(
            "NOT deterministic: {} seed {seed}: digests {} and {}, traces diverge at event \
             {diverged}; reproduce: cargo run --profile test -p kvrelay-sim -- determinism {} \
             --seed {seed}",
            first.scenario, first.digest, second.digest, first.file
        ))
    }
}

fn sweep(
    dir: &std::path::Path,
    seeds: std::ops::Range<u64>,
    determinism_seed: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let scenarios = Scenario::load_dir(dir)?;
    anyhow::ensure!(!scenarios.is_empty(), "no *.toml scenario in {}", dir.display());
    let incidents = Incident::load_dir(&dir.join("incidents"))?;
    let total = (scenarios.len() + incidents.len()) as u64 * (seeds.end - seeds.start);
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut done = 0u64;
    let (mut deterministic, mut nondeterministic) = (0u64, 0u64);
    for scenario in &scenarios {
        let mut witness = None;
        for seed in seeds.clone() {
            #[allow(clippy::disallowed_methods)] // the wall time of a run is a report, not logic
            let started = std::time::Instant::now();
            let outcome = Sim::new(seed).run(scenario);
            if determinism_seed == Some(seed) {
                witness = Some(outcome.clone());
            }
            let row = rows.entry(scenario.name.clone()).or_default();
            let wall = started.elapsed();
            row.wall += wall;
            let converged_ms = outcome.view.convergence.after_last_fault_ms();
            row.converged_ms = row.converged_ms.max(converged_ms);
            done += 1;
            progress(
                &scenario.name,
                seed,
                outcome.passed(),
                wall,
                &format!(", converged {converged_ms} ms after the last fault"),
            );
            if outcome.passed() {
                row.passed += 1;
            } else {
                row.failed += 1;
                println!(
                    "FAIL {} seed {}: {} — reproduce: {}",
                    outcome.scenario,
                    seed,
                    outcome.failure().unwrap_or_default(),
                    outcome.reproduce_command()
                );
                failures.push(outcome.reproduce_command());
            }
        }
        if let Some(seed) = determinism_seed {
            // Other runs came between the two (tokio task ids and allocator state moved on).
            let first = witness.take().unwrap_or_else(|| Sim::new(seed).run(scenario));
            match same_run(&first, &Sim::new(seed).run(scenario)) {
                Ok(line) => {
                    deterministic += 1;
                    println!("  {line}");
                }
                Err(line) => {
                    nondeterministic += 1;
                    println!("FAIL {line}");
                    failures.push(format!(
                        "cargo run --profile test -p kvrelay-sim -- determinism {} --seed {seed}",
                        first.file
                    ));
                }
            }
        }
        println!("[{done}/{total}] {} done", scenario.name);
        let _ = std::io::stdout().flush();
    }
    for incident in &incidents {
        for seed in seeds.clone() {
            #[allow(clippy::disallowed_methods)] // the wall time of a run is a report, not logic
            let started = std::time::Instant::now();
            let outcome = incident.run(seed);
            let row = rows.entry(format!("incidents/{}", incident.name)).or_default();
            let wall = started.elapsed();
            row.wall += wall;
            done += 1;
            let failure = match &outcome {
                Ok(outcome) => outcome.failure(),
                Err(error) => Some(format!("{error:#}")),
            };
            progress(&format!("incidents/{}", incident.name), seed, failure.is_none(), wall, "");
            match failure {
                None => row.passed += 1,
                Some(failure) => {
                    row.failed += 1;
                    let command = incident.reproduce_command(seed);
                    println!(
                        "FAIL incident {} seed {seed}: {failure} — reproduce: {command}",
                        incident.name
                    );
                    failures.push(command);
                }
            }
        }
        println!("[{done}/{total}] incidents/{} done", incident.name);
        let _ = std::io::stdout().flush();
    }
    println!(
        "{:<40} {:>6} {:>6} {:>8} {:>14}",
        "scenario", "passed", "failed", "wall s", "max conv. ms"
    );
    for (name, row) in &rows {
        println!(
            "{name:<40} {:>6} {:>6} {:>8.1} {:>14}",
            row.passed,
            row.failed,
            row.wall.as_secs_f64(),
            row.converged_ms
        );
    }
    if let Some(seed) = determinism_seed {
        println!(
            "determinism: {deterministic} of {} scenarios replay seed {seed} identically",
            scenarios.len()
        );
    }
    if failures.is_empty() {
        println!("sweep: {total} passed, 0 failed");
        Ok(ExitCode::SUCCESS)
    } else {
        let failed = failures.len() as u64 - nondeterministic;
        println!("sweep: {} passed, {failed} failed", total - failed);
        for command in failures {
            println!("  {command}");
        }
        Ok(ExitCode::FAILURE)
    }
}

fn write_trace(events: &[trace::Stamped], path: &std::path::Path) -> anyhow::Result<()> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    trace::write_json_lines(events, &mut file)?;
    file.flush()?;
    Ok(())
}

fn seconds_arg(seconds: f64) -> anyhow::Result<std::time::Duration> {
    anyhow::ensure!(
        seconds.is_finite() && seconds >= 0.0,
        "{seconds}: expected a non-negative number of seconds"
    );
    Ok(std::time::Duration::from_secs_f64(seconds))
}

fn exit(passed: bool) -> ExitCode {
    if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// Index of the first event where two traces differ.
fn first_difference(a: &[trace::Stamped], b: &[trace::Stamped]) -> usize {
    a.iter().zip(b).position(|(a, b)| a != b).unwrap_or(a.len().min(b.len()))
}

fn write_outputs(
    outcome: &ReplayOutcome,
    trace: Option<&std::path::Path>,
    timeline: Option<&std::path::Path>,
    title: &str,
) -> anyhow::Result<()> {
    if let Some(path) = trace {
        write_trace(&outcome.trace, path)?;
        println!("  trace: {} events in {}", outcome.trace.len(), path.display());
    }
    if let Some(path) = timeline {
        std::fs::write(path, kvrelay_sim::timeline::render(title, &outcome.trace))?;
        println!("  timeline: {}", path.display());
    }
    Ok(())
}

fn main() -> anyhow::Result<ExitCode> {
    match Cli::parse().command {
        Command::Run { file, seed, trace, timeline, record } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            if Incident::is_incident(&text) {
                anyhow::ensure!(record.is_none(), "--record applies to scenarios, not incidents");
                let incident = Incident::load(&file)?;
                println!("incident {} seed {seed}: replaying {}", incident.name, incident.journal);
                let outcome = incident.run(seed)?;
                print!("{}", outcome.render(false));
                if !outcome.passed() {
                    println!("  reproduce: {}", incident.reproduce_command(seed));
                }
                let title = format!("{} seed {seed}", incident.name);
                write_outputs(&outcome, trace.as_deref(), timeline.as_deref(), &title)?;
                return Ok(exit(outcome.passed()));
            }
            let scenario = Scenario::load(&file)?;
            #[allow(clippy::disallowed_methods)] // the wall time of a run is a report, not logic
            let started = std::time::Instant::now();
            let mut sim = Sim::new(seed);
            if let Some(root) = &record {
                sim = sim.record(root.clone());
            }
            let outcome = sim.run(&scenario);
            let wall = started.elapsed().as_secs_f64();
            print!("{}", outcome.render());
            let simulated = outcome.simulated.as_secs_f64();
            let planes = outcome.trace.iter().find_map(|event| match &event.event {
                trace::TraceEvent::TrafficOff { planes } => Some(*planes),
                _ => None,
            });
            let stored = planes.map_or(0, |planes| planes.stored_events);
            println!(
                "  {simulated:.1} simulated s in {wall:.2} wall s ({:.0}x real time); {stored} stored \
                 events in {:.1} s of traffic ({:.0}/s), {} removed",
                simulated / wall.max(1e-9),
                scenario.run_ms as f64 / 1000.0,
                stored as f64 * 1000.0 / scenario.run_ms as f64,
                planes.map_or(0, |planes| planes.removed_events)
            );
            if let Some(root) = &record {
                println!("  journal: one recording directory per relay boot in {}", root.display());
            }
            if let Some(path) = trace {
                write_trace(&outcome.trace, &path)?;
                println!("  trace: {} events in {}", outcome.trace.len(), path.display());
            }
            if let Some(path) = timeline {
                let title = format!("{} seed {seed}", scenario.name);
                std::fs::write(&path, kvrelay_sim::timeline::render(&title, &outcome.trace))?;
                println!("  timeline: {}", path.display());
            }
            Ok(if outcome.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Sweep { dir, seeds, determinism_seed } => {
            sweep(&dir, parse_range(&seeds)?, determinism_seed)
        }
        Command::Replay { journal, until, trace, fault, seed, twice, consumer_after_end } => {
            let until = until.map(seconds_arg).transpose()?;
            let faults = fault.as_deref().map(kvrelay_sim::replay::faults::load).transpose()?;
            println!(
                "replaying {}{}{}",
                journal.display(),
                match until {
                    Some(until) => format!(" until {:.3} s", until.as_secs_f64()),
                    None => String::new(),
                },
                match &fault {
                    Some(path) => format!(" with the faults of {}", path.display()),
                    None => String::new(),
                }
            );
            let setup = ReplaySetup {
                until,
                faults: faults.unwrap_or_default(),
                seed,
                expect: None,
                consumer_after_end,
            };
            let outcome = kvrelay_sim::replay::replay(&journal, &setup)
                .with_context(|| format!("replaying {}", journal.display()))?;
            print!("{}", outcome.render(until.is_some()));
            write_outputs(&outcome, trace.as_deref(), None, "")?;
            let mut passed = outcome.passed();
            if twice {
                let again = kvrelay_sim::replay::replay(&journal, &setup)?;
                if again.trace == outcome.trace && again.digest == outcome.digest {
                    println!("deterministic: the second replay's trace and digest are identical");
                } else {
                    let at = first_difference(&outcome.trace, &again.trace);
                    println!(
                        "NOT deterministic: digests {} and {}, traces diverge at event {at}",
                        outcome.digest, again.digest
                    );
                    passed = false;
                }
            }
            Ok(exit(passed))
        }
        Command::Cut { journal, from, to, out } => {
            let cut =
                kvrelay_sim::incident::cut(&journal, seconds_arg(from)?, seconds_arg(to)?, &out)?;
            println!(
                "cut {} [{from:.3} s, {to:.3} s]: {} listed discovery facts, {} tree dumps of the \
                 ranks' state ({} blocks, {} orphaned blocks left out, {} live-only ranks not \
                 carried), {} inputs, {} recovery answers, {} checkpoints; {} bytes",
                journal.display(),
                cut.listing,
                cut.dumps,
                cut.carried_blocks,
                cut.orphans,
                cut.live_only,
                cut.inputs,
                cut.recoveries,
                cut.checkpoints,
                cut.bytes
            );
            println!("  journal:  {}", cut.journal.display());
            println!(
                "  incident: {} (expects {} pools, readiness {:?}, {} exact blocks over {} pool \
                 generations)",
                cut.incident.display(),
                cut.expect.pools,
                cut.expect.readiness,
                cut.kv.iter().map(|pool| pool.exact_blocks).sum::<u64>(),
                cut.kv.len()
            );
            println!(
                "  run it:   cargo run --profile test -p kvrelay-sim -- run {}",
                cut.incident.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Shrink { file, seed, out } => {
            let scenario = Scenario::load(&file)?;
            let out = out.unwrap_or_else(|| {
                PathBuf::from(format!("shrunk-{}-seed{seed}.toml", scenario.name))
            });
            let mut progress = |line: &str| {
                println!("  {line}");
                let _ = std::io::stdout().flush();
            };
            let shrunk = kvrelay_sim::shrink::shrink(&scenario, seed, &mut progress)?;
            let text = shrunk.to_file(&file.display().to_string(), &out.display().to_string())?;
            std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
            println!(
                "shrunk {} seed {seed} ({}): {} of {} faults, run_ms {} of {}, {} runs; wrote {}",
                scenario.name,
                shrunk.oracle,
                shrunk.scenario.faults.len(),
                shrunk.faults_before,
                shrunk.scenario.run_ms,
                shrunk.run_ms_before,
                shrunk.runs,
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Determinism { file, seed } => {
            let scenario = Scenario::load(&file)?;
            let first = Sim::new(seed).run(&scenario);
            let second = Sim::new(seed).run(&scenario);
            let verdict = same_run(&first, &second);
            println!("{}", verdict.as_ref().unwrap_or_else(|line| line));
            Ok(exit(verdict.is_ok()))
        }
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_sim::trace::{Stamped, TraceEvent};

    use super::*;

    fn outcome(digest: &str, trace: Vec<Stamped>) -> kvrelay_sim::Outcome {
        kvrelay_sim::Outcome {
            seed: 3,
            scenario: "s".into(),
            file: "scenarios/s.toml".into(),
            checks: Vec::new(),
            digest: digest.into(),
            trace,
            view: kvrelay_sim::FinalView::default(),
            error: None,
            simulated: std::time::Duration::ZERO,
        }
    }

    #[test]
    fn runs_that_differ_fail_the_determinism_check() {
        let boot = |ms| Stamped { ms, event: TraceEvent::RelayBoot { boot: 0, incarnation: 1 } };
        let first = outcome("aa", vec![boot(0), boot(5)]);
        assert!(same_run(&first, &first.clone()).is_ok());
        let other_digest = outcome("bb", first.trace.clone());
        let line = same_run(&first, &other_digest).unwrap_err();
        assert!(line.contains("digests aa and bb"), "{line}");
        let other_trace = outcome("aa", vec![boot(0), boot(10)]);
        let line = same_run(&first, &other_trace).unwrap_err();
        assert!(line.contains("diverge at event 1"), "{line}");
        assert!(line.contains("determinism scenarios/s.toml --seed 3"), "{line}");
    }
}
