//! Shrinking a failing run to a short, readable reproduction.
//!
//! [`shrink`] takes a scenario that fails at a seed, materializes its drawn faults as scripted
//! ones (the draw has its own generator, so the same faults at the same times replay the same
//! run), then searches by delta debugging (Zeller's ddmin: drop halves, then quarters, ...;
//! keep any smaller list that still fails) for a minimal fault list that still fails **with the
//! same oracle**, and finally bisects `run_ms` (in [`RUN_MS_STEP`] steps, never before the last
//! fault) for the shortest run that still does. Every candidate is a full run at the same seed.
//! The result is 1-minimal: dropping any single remaining fault makes the failure go away (or
//! change oracle).

use crate::scenario::{Scenario, ScriptedFault};
use crate::{Outcome, Sim};

/// Granularity of the `run_ms` bisection (simulated ms).
pub const RUN_MS_STEP: u64 = 100;

/// The oracle a run failed with: the first failing check's name, `simulation` when the
/// simulation itself failed, `None` when it passed.
#[must_use]
pub fn failing_oracle(outcome: &Outcome) -> Option<String> {
    if outcome.passed() {
        return None;
    }
    if outcome.error.is_some() {
        return Some("simulation".to_owned());
    }
    Some(outcome.checks.iter().find(|check| !check.passed).map_or("setup", |c| c.name).to_owned())
}

/// What shrinking found.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The reduced scenario: the minimal fault list, no drawn faults, the shortest run.
    pub scenario: Scenario,
    /// The seed it fails at.
    pub seed: u64,
    /// The oracle it fails with (as the original run did).
    pub oracle: String,
    /// The failure line of the reduced run.
    pub failure: String,
    /// Faults of the original run (scripted and drawn).
    pub faults_before: usize,
    /// Its `run_ms`.
    pub run_ms_before: u64,
    /// Runs the search took.
    pub runs: usize,
}

/// Why a scenario could not be shrunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShrinkError {
    /// The run passes: nothing to shrink.
    #[error("{scenario} passes at seed {seed}: nothing to shrink")]
    Passes {
        /// Scenario name.
        scenario: String,
        /// Seed.
        seed: u64,
    },
}

/// A candidate tester: runs `scenario` at the seed and tells whether it fails with the oracle.
struct Search<'a> {
    seed: u64,
    oracle: String,
    runs: usize,
    progress: &'a mut dyn FnMut(&str),
}

impl Search<'_> {
    fn fails(&mut self, scenario: &Scenario) -> Option<Outcome> {
        self.runs += 1;
        let outcome = Sim::new(self.seed).run(scenario);
        let same = failing_oracle(&outcome).as_deref() == Some(self.oracle.as_str());
        (self.progress)(&format!(
            "run {}: {} faults, run_ms {}: {}",
            self.runs,
            scenario.faults.len(),
            scenario.run_ms,
            if same { "fails the same way" } else { "does not" }
        ));
        same.then_some(outcome)
    }
}

/// `base` with `faults` as its whole script.
fn with_faults(base: &Scenario, faults: Vec<ScriptedFault>) -> Scenario {
    Scenario { faults, random_faults: None, ..base.clone() }
}

/// Delta debugging over `faults`: a 1-minimal sublist (order kept) for which `fails` holds.
fn ddmin(
    faults: Vec<ScriptedFault>,
    fails: &mut impl FnMut(&[ScriptedFault]) -> bool,
) -> Vec<ScriptedFault> {
    if faults.is_empty() || fails(&[]) {
        return Vec::new();
    }
    let mut current = faults;
    let mut parts = 2usize;
    while current.len() > 1 {
        let chunk = current.len().div_ceil(parts.min(current.len()));
        let chunks: Vec<Vec<ScriptedFault>> = current.chunks(chunk).map(<[_]>::to_vec).collect();
        let mut reduced = false;
        // A chunk alone, then everything but a chunk.
        for part in &chunks {
            if part.len() < current.len() && fails(part) {
                current.clone_from(part);
                parts = 2;
                reduced = true;
                break;
            }
        }
        if !reduced && chunks.len() > 2 {
            for index in 0..chunks.len() {
                let rest: Vec<ScriptedFault> = chunks
                    .iter()
                    .enumerate()
                    .filter(|(other, _)| *other != index)
                    .flat_map(|(_, part)| part.iter().cloned())
                    .collect();
                if fails(&rest) {
                    current = rest;
                    parts = (parts - 1).max(2);
                    reduced = true;
                    break;
                }
            }
        }
        if !reduced {
            if parts >= current.len() {
                break;
            }
            parts = (parts * 2).min(current.len());
        }
    }
    current
}

/// Shrink `scenario`'s failure at `seed` (see the module doc); `progress` hears of every run.
///
/// # Errors
/// [`ShrinkError::Passes`] when the run does not fail.
pub fn shrink(
    scenario: &Scenario,
    seed: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<Shrunk, ShrinkError> {
    let original = Sim::new(seed).run(scenario);
    let Some(oracle) = failing_oracle(&original) else {
        return Err(ShrinkError::Passes { scenario: scenario.name.clone(), seed });
    };
    progress(&format!("seed {seed} fails {oracle}: {}", original.failure().unwrap_or_default()));
    let workers = scenario.deployment().map_or(0, |deployment| deployment.workers.len());
    let script = scenario.script(seed, workers);
    let faults_before = script.len();
    let mut search = Search { seed, oracle, runs: 1, progress };
    // The drawn faults as scripted ones; if that changed the failure, keep the draw as it was.
    let materialized = with_faults(scenario, script.clone());
    let mut best = if scenario.random_faults.is_none() || search.fails(&materialized).is_some() {
        let mut fails = |faults: &[ScriptedFault]| {
            search.fails(&with_faults(scenario, faults.to_vec())).is_some()
        };
        with_faults(scenario, ddmin(script, &mut fails))
    } else {
        scenario.clone()
    };
    // The shortest run that still fails, never ending before the last fault.
    let last_fault = best.faults.iter().map(|scripted| scripted.at_ms).max().unwrap_or(0);
    let mut low = last_fault.div_ceil(RUN_MS_STEP).max(1);
    let mut high = best.run_ms.div_ceil(RUN_MS_STEP);
    if let Some(random) = &best.random_faults {
        low = low.max(random.until_ms.div_ceil(RUN_MS_STEP));
    }
    while low < high {
        let middle = low + (high - low) / 2;
        let candidate = Scenario { run_ms: middle * RUN_MS_STEP, ..best.clone() };
        if search.fails(&candidate).is_some() {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    let shortest = (high * RUN_MS_STEP).min(best.run_ms);
    if shortest < best.run_ms {
        best.run_ms = shortest;
    }
    let final_outcome = Sim::new(seed).run(&best);
    search.runs += 1;
    Ok(Shrunk {
        failure: final_outcome.failure().unwrap_or_default(),
        oracle: search.oracle,
        seed,
        faults_before,
        run_ms_before: scenario.run_ms,
        runs: search.runs,
        scenario: best,
    })
}

/// At most `count` characters of `text`, with an ellipsis when cut.
fn first_chars(text: &str, count: usize) -> String {
    match text.char_indices().nth(count) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

impl Shrunk {
    /// The reduced scenario as a scenario file, headed by how it was found and how to run it.
    ///
    /// # Errors
    /// When the scenario does not serialize (it always does for a parsed one).
    pub fn to_file(&self, original: &str, out: &str) -> Result<String, toml::ser::Error> {
        let mut scenario = self.scenario.clone();
        scenario.description = format!(
            "Shrunk from {original} at seed {}: fails {} with {} of {} faults in {} of {} ms. {}",
            self.seed,
            self.oracle,
            scenario.faults.len(),
            self.faults_before,
            scenario.run_ms,
            self.run_ms_before,
            self.scenario.description
        );
        let body = toml::to_string(&scenario)?;
        Ok(format!(
            "# Shrunk by `kvrelay-sim shrink {original} --seed {seed}` ({runs} runs).\n# Fails \
             {oracle} at seed {seed}: {failure}\n# Reproduce: cargo run --profile test -p \
             kvrelay-sim -- run {out} --seed {seed}\n\n{body}",
            seed = self.seed,
            runs = self.runs,
            oracle = self.oracle,
            failure = first_chars(self.failure.lines().next().unwrap_or_default(), 200),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Fault;

    fn fault(at_ms: u64) -> ScriptedFault {
        ScriptedFault { at_ms, fault: Fault::RelayRestart }
    }

    #[test]
    fn ddmin_finds_the_faults_the_failure_needs() {
        let faults: Vec<ScriptedFault> = (1..=9).map(|at| fault(at * 100)).collect();
        // Fails only with both the fault at 300 ms and the one at 800 ms.
        let mut calls = 0;
        let mut fails = |list: &[ScriptedFault]| {
            calls += 1;
            let has = |ms| list.iter().any(|f| f.at_ms == ms);
            has(300) && has(800)
        };
        let minimal = ddmin(faults.clone(), &mut fails);
        assert_eq!(minimal.iter().map(|f| f.at_ms).collect::<Vec<_>>(), [300, 800]);
        assert!(calls < 40, "{calls} calls");
        // A failure that needs nothing shrinks to nothing.
        assert!(ddmin(faults, &mut |_: &[ScriptedFault]| true).is_empty());
    }
}
