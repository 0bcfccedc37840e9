//! Every scenario file at a small fixed seed set: the oracles hold. The determinism meta-test
//! runs a seed twice and compares the traces; snapshots hold each scenario's final catalog,
//! readiness and a compact trace summary at seed 0 (in the top-level `snapshots/`).

use std::path::{Path, PathBuf};

use kvrelay_sim::scenario::Scenario;
use kvrelay_sim::{Outcome, Sim};

/// Seeds every scenario runs at in the test suite (the CI sweep in `.ci/run` covers 0..64).
const SEEDS: [u64; 2] = [1, 2];

fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios")
}

fn scenarios() -> Vec<Scenario> {
    let scenarios = Scenario::load_dir(&scenarios_dir()).expect("scenario files load");
    assert!(scenarios.len() >= 15, "the suite lost scenarios: {}", scenarios.len());
    scenarios
}

fn run(scenario: &Scenario, seed: u64) -> Outcome {
    Sim::new(seed).run(scenario)
}

#[test]
fn every_scenario_passes_at_the_fixed_seeds() {
    let mut failures = Vec::new();
    for scenario in scenarios() {
        for seed in SEEDS {
            let outcome = run(&scenario, seed);
            if !outcome.passed() {
                failures.push(outcome.render());
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Spawn one tokio task on a throwaway runtime: tokio's task ids are process-wide, so the next
/// simulation's tasks get other ids (and other runtime shards) than they would have.
fn shift_task_ids() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async { kvrelay::runtime::spawn(async {}).await.unwrap() });
}

#[test]
fn the_same_seed_yields_the_same_trace() {
    for (name, seed) in
        [("steady", 7), ("relay-restart", 7), ("event-noise", 7), ("random-faults", 0)]
    {
        let scenario = Scenario::load(&scenarios_dir().join(format!("{name}.toml"))).unwrap();
        let first = run(&scenario, seed);
        assert!(first.passed(), "{}", first.render());
        assert!(!first.trace.is_empty());
        let second = run(&scenario, seed);
        assert_eq!(first.trace, second.trace, "{}", first.reproduce_command());
        assert_eq!(first.digest, second.digest, "{}", first.reproduce_command());
        // What ran before in the process must not matter (a relay restart drops the relay
        // host's tasks in an order tokio derives from their ids, four shards on this runtime):
        // again after every residue of the id offset.
        for _ in 0..3 {
            shift_task_ids();
            let again = run(&scenario, seed);
            assert_eq!(first.digest, again.digest, "{}", first.reproduce_command());
        }
    }
}

#[test]
fn different_seeds_yield_different_digests() {
    let scenario = Scenario::load(&scenarios_dir().join("steady.toml")).unwrap();
    assert_ne!(run(&scenario, 1).digest, run(&scenario, 2).digest);
}

#[test]
fn a_wrong_expectation_fails_with_a_reproduction_line() {
    let mut scenario = Scenario::load(&scenarios_dir().join("pd-decode-missing.toml")).unwrap();
    scenario.expect.readiness.insert("pd-llm".into(), kvrelay_sim::scenario::ExpectedState::Ready);
    scenario.expect.pools = 2;
    let outcome = run(&scenario, 0);
    assert!(!outcome.passed());
    let failure = outcome.failure().unwrap();
    assert!(failure.starts_with("catalog-and-readiness-converge"), "{failure}");
    assert!(outcome.reproduce_command().contains("pd-decode-missing.toml --seed 0"));
}

#[test]
fn a_consumer_left_partitioned_fails_convergence_by_name() {
    let mut scenario = Scenario::load(&scenarios_dir().join("wan-split.toml")).unwrap();
    scenario.faults.retain(|scripted| {
        !matches!(scripted.fault, kvrelay_sim::scenario::Fault::WanRepair { .. })
    });
    scenario.run_ms = 4000;
    scenario.faults.retain(|scripted| scripted.at_ms <= scenario.run_ms);
    let outcome = run(&scenario, 0);
    assert!(!outcome.passed());
    for name in ["replica-equals-relay", "no-false-negatives"] {
        let check = outcome.checks.iter().find(|c| c.name == name).unwrap();
        assert!(!check.passed, "{name}");
        assert!(check.detail.starts_with("consumer-b: "), "{name}: {}", check.detail);
        assert!(!check.detail.contains("consumer-a") && !check.detail.contains("consumer-c"));
    }
}

#[test]
fn eviction_under_capacity_publishes_removals_and_eagle_blocks_are_probed() {
    let eviction = Scenario::load(&scenarios_dir().join("capacity-eviction.toml")).unwrap();
    let outcome = run(&eviction, 3);
    assert!(outcome.passed(), "{}", outcome.render());
    let planes = outcome
        .trace
        .iter()
        .find_map(|stamped| match &stamped.event {
            kvrelay_sim::trace::TraceEvent::TrafficOff { planes } => Some(*planes),
            _ => None,
        })
        .unwrap();
    assert!(planes.removed_events > 100, "{planes:?}");
    let eagle = run(&Scenario::load(&scenarios_dir().join("eagle.toml")).unwrap(), 3);
    assert!(eagle.passed(), "{}", eagle.render());
    assert_eq!(eagle.view.catalog.len(), 1);
    let probed = eagle.checks.iter().find(|check| check.name == "no-false-negatives").unwrap();
    assert!(!probed.detail.contains(" 0 cached blocks"), "{}", probed.detail);
}

#[test]
fn every_scenario_at_seed_zero_matches_its_snapshot() {
    for scenario in scenarios() {
        let outcome = run(&scenario, 0);
        assert!(outcome.passed(), "{}", outcome.render());
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path("../../snapshots");
        settings.set_prepend_module_to_snapshot(false);
        settings.set_sort_maps(true);
        settings.set_description(scenario.description.clone());
        settings.bind(|| {
            insta::assert_yaml_snapshot!(format!("sim_{}", scenario.name), outcome.view);
        });
    }
}
