//! `kvrelay-sim`: run one scenario for one seed, or sweep every scenario over a seed range.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvrelay_sim::{Scenario, Sim};

#[derive(Debug, Parser)]
#[command(name = "kvrelay-sim", about = "Deterministic simulation of kvrelay")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one scenario (every scenario if none is named) for one seed.
    Run {
        /// The seed every random choice derives from.
        #[arg(long)]
        seed: u64,
        /// steady, worker-restart or partition.
        #[arg(long)]
        scenario: Option<String>,
    },
    /// Run every scenario for every seed in `A..B` (end exclusive).
    Sweep {
        /// The seed range, `A..B`.
        #[arg(long)]
        seeds: String,
    },
}

fn parse_range(text: &str) -> anyhow::Result<std::ops::Range<u64>> {
    let (start, end) =
        text.split_once("..").ok_or_else(|| anyhow::anyhow!("--seeds must be A..B"))?;
    Ok(start.trim().parse()?..end.trim().parse()?)
}

fn run_all(seeds: impl Iterator<Item = u64>, scenarios: &[Scenario]) -> ExitCode {
    let mut failures = Vec::new();
    for seed in seeds {
        for &scenario in scenarios {
            let outcome = Sim::new(seed).run(scenario);
            print!("{}", outcome.render());
            if !outcome.passed() {
                failures.push(outcome.reproduce_command());
            }
        }
    }
    if failures.is_empty() {
        println!("all runs passed");
        ExitCode::SUCCESS
    } else {
        println!("{} failing run(s); reproduce with:", failures.len());
        for command in failures {
            println!("  {command}");
        }
        ExitCode::FAILURE
    }
}

fn main() -> anyhow::Result<ExitCode> {
    match Cli::parse().command {
        Command::Run { seed, scenario } => {
            let scenarios = match scenario {
                Some(name) => vec![
                    Scenario::parse(&name)
                        .ok_or_else(|| anyhow::anyhow!("unknown scenario {name}"))?,
                ],
                None => Scenario::ALL.to_vec(),
            };
            Ok(run_all(std::iter::once(seed), &scenarios))
        }
        Command::Sweep { seeds } => Ok(run_all(parse_range(&seeds)?, &Scenario::ALL)),
    }
}
