//! `kvrelay-sim`: run one scenario file for one seed, sweep a directory of scenarios over a seed
//! range, check that a seed replays to the same trace digest, or replay a recorded journal.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kvrelay_sim::scenario::Scenario;
use kvrelay_sim::{Outcome, Sim, trace};

#[derive(Debug, Parser)]
#[command(name = "kvrelay-sim", about = "Deterministic simulation of kvrelay")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one scenario file for one seed and print every oracle's verdict.
    Run {
        /// The scenario file (`scenarios/*.toml`).
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
    },
    /// Run every scenario of a directory for every seed in `A..B` (end exclusive).
    Sweep {
        /// The directory of scenario files.
        dir: PathBuf,
        /// The seed range, `A..B`.
        #[arg(long)]
        seeds: String,
    },
    /// Replay a journal recorded by `kvrelay serve --record` (or a simulated run) through the
    /// relay node under a paused clock, with the recorded configuration and seed, and compare
    /// every checkpoint. Exits non-zero on a divergence or a journal fault.
    Replay {
        /// The recording directory (or one segment file).
        journal: PathBuf,
        /// Stop after the inputs recorded in the first SECS seconds (node time) and dump the
        /// state there: catalog, readiness and per-pool ownership.
        #[arg(long, value_name = "SECS")]
        until: Option<f64>,
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

/// Pass/fail counts and simulated/wall time of one scenario in a sweep.
#[derive(Debug, Default)]
struct Row {
    passed: u64,
    failed: u64,
    wall: std::time::Duration,
}

fn sweep(dir: &std::path::Path, seeds: std::ops::Range<u64>) -> anyhow::Result<ExitCode> {
    let scenarios = Scenario::load_dir(dir)?;
    anyhow::ensure!(!scenarios.is_empty(), "no *.toml scenario in {}", dir.display());
    let total = scenarios.len() as u64 * (seeds.end - seeds.start);
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut done = 0u64;
    for scenario in &scenarios {
        for seed in seeds.clone() {
            #[allow(clippy::disallowed_methods)] // the wall time of a run is a report, not logic
            let started = std::time::Instant::now();
            let outcome = Sim::new(seed).run(scenario);
            let row = rows.entry(scenario.name.clone()).or_default();
            row.wall += started.elapsed();
            done += 1;
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
        println!("[{done}/{total}] {} done", scenario.name);
        let _ = std::io::stdout().flush();
    }
    println!("{:<32} {:>6} {:>6} {:>10}", "scenario", "passed", "failed", "wall s");
    for (name, row) in &rows {
        println!("{name:<32} {:>6} {:>6} {:>10.1}", row.passed, row.failed, row.wall.as_secs_f64());
    }
    if failures.is_empty() {
        println!("sweep: {total} passed, 0 failed");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("sweep: {} passed, {} failed", total - failures.len() as u64, failures.len());
        for command in failures {
            println!("  {command}");
        }
        Ok(ExitCode::FAILURE)
    }
}

fn write_trace(outcome: &Outcome, path: &std::path::Path) -> anyhow::Result<()> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    trace::write_json_lines(&outcome.trace, &mut file)?;
    file.flush()?;
    Ok(())
}

fn main() -> anyhow::Result<ExitCode> {
    match Cli::parse().command {
        Command::Run { file, seed, trace, timeline } => {
            let scenario = Scenario::load(&file)?;
            #[allow(clippy::disallowed_methods)] // the wall time of a run is a report, not logic
            let started = std::time::Instant::now();
            let outcome = Sim::new(seed).run(&scenario);
            let wall = started.elapsed().as_secs_f64();
            print!("{}", outcome.render());
            let simulated = outcome.simulated.as_secs_f64();
            let stored = outcome.trace.iter().find_map(|event| match &event.event {
                trace::TraceEvent::TrafficOff { planes } => Some(planes.stored_events),
                _ => None,
            });
            println!(
                "  {simulated:.1} simulated s in {wall:.2} wall s ({:.0}x real time); {} stored \
                 events in {:.1} s of traffic ({:.0}/s)",
                simulated / wall.max(1e-9),
                stored.unwrap_or(0),
                scenario.run_ms as f64 / 1000.0,
                stored.unwrap_or(0) as f64 * 1000.0 / scenario.run_ms as f64
            );
            if let Some(path) = trace {
                write_trace(&outcome, &path)?;
                println!("  trace: {} events in {}", outcome.trace.len(), path.display());
            }
            if let Some(path) = timeline {
                let title = format!("{} seed {seed}", scenario.name);
                std::fs::write(&path, kvrelay_sim::timeline::render(&title, &outcome.trace))?;
                println!("  timeline: {}", path.display());
            }
            Ok(if outcome.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Sweep { dir, seeds } => sweep(&dir, parse_range(&seeds)?),
        Command::Replay { journal, until } => {
            let until = until
                .map(|seconds| {
                    anyhow::ensure!(
                        seconds.is_finite() && seconds >= 0.0,
                        "--until {seconds}: expected a non-negative number of seconds"
                    );
                    Ok(std::time::Duration::from_secs_f64(seconds))
                })
                .transpose()?;
            println!(
                "replaying {}{}",
                journal.display(),
                match until {
                    Some(until) => format!(" until {:.3} s", until.as_secs_f64()),
                    None => String::new(),
                }
            );
            let report = kvrelay_sim::replay::replay(&journal, until)
                .with_context(|| format!("replaying {}", journal.display()))?;
            print!("{}", kvrelay_sim::replay::render(&report, until.is_some()));
            Ok(if kvrelay_sim::replay::verdict(&report) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Determinism { file, seed } => {
            let scenario = Scenario::load(&file)?;
            let first = Sim::new(seed).run(&scenario);
            let second = Sim::new(seed).run(&scenario);
            if first.digest == second.digest && first.trace == second.trace {
                println!("deterministic: {} seed {seed} digest {}", scenario.name, first.digest);
                Ok(ExitCode::SUCCESS)
            } else {
                let diverged = first
                    .trace
                    .iter()
                    .zip(&second.trace)
                    .position(|(a, b)| a != b)
                    .unwrap_or(first.trace.len().min(second.trace.len()));
                println!(
                    "NOT deterministic: {} seed {seed}: digests {} and {}, traces diverge at \
                     event {diverged}; reproduce: cargo run --profile test -p kvrelay-sim -- determinism {} \
                     --seed {seed}",
                    scenario.name,
                    first.digest,
                    second.digest,
                    file.display()
                );
                Ok(ExitCode::FAILURE)
            }
        }
    }
}
