//! The shrinker on an injected failure: a wrong expectation that only the crash of the decode
//! worker exposes, among seven irrelevant faults, shrinks to that one fault and the shortest
//! run, and the written file reproduces the failure with the same oracle.

use std::path::Path;

use kvrelay_sim::Sim;
use kvrelay_sim::scenario::{Fault, Scenario};
use kvrelay_sim::shrink::{RUN_MS_STEP, failing_oracle, shrink};

#[test]
fn an_injected_failure_shrinks_to_the_one_fault_it_needs() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/shrink-injected.toml");
    let scenario = Scenario::load(&path).unwrap();
    assert_eq!(scenario.faults.len(), 8);
    let mut lines = Vec::new();
    let shrunk = shrink(&scenario, 0, &mut |line: &str| lines.push(line.to_owned())).unwrap();
    assert_eq!(shrunk.oracle, "catalog-and-readiness-converge", "{lines:#?}");
    let faults: Vec<(u64, &Fault)> =
        shrunk.scenario.faults.iter().map(|scripted| (scripted.at_ms, &scripted.fault)).collect();
    assert_eq!(faults, [(2000, &Fault::CrashWorker { worker: 3 })], "{lines:#?}");
    // The crash at 2 s is the last fault: the run can end there.
    assert!(shrunk.scenario.run_ms <= 2000 + RUN_MS_STEP, "{}", shrunk.scenario.run_ms);
    assert_eq!((shrunk.faults_before, shrunk.run_ms_before), (8, 6000));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shrunk.toml");
    let text = shrunk.to_file("sim/tests/data/shrink-injected.toml", "shrunk.toml").unwrap();
    assert!(text.contains("--seed 0"), "{text}");
    std::fs::write(&out, text).unwrap();
    let reloaded = Scenario::load(&out).unwrap();
    assert_eq!(reloaded.faults, shrunk.scenario.faults);
    let rerun = Sim::new(0).run(&reloaded);
    assert_eq!(failing_oracle(&rerun).as_deref(), Some("catalog-and-readiness-converge"));
}

#[test]
fn a_passing_run_is_not_shrunk() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/steady.toml");
    let scenario = Scenario::load(&path).unwrap();
    assert!(shrink(&scenario, 0, &mut |_: &str| {}).is_err());
}
