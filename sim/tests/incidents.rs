//! Every incident of `scenarios/incidents/` (a journal window cut by `kvrelay-sim cut`, see
//! `scenarios/README.md`) replays in the simulator and meets its expectation, identically twice.

use std::path::Path;

use kvrelay_sim::incident::Incident;

#[test]
fn every_incident_meets_its_expectation_and_replays_identically() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/incidents");
    let incidents = Incident::load_dir(&dir).unwrap();
    assert!(!incidents.is_empty(), "no incident in {}", dir.display());
    assert!(
        incidents.iter().any(|incident| incident.faults.is_empty() && !incident.kv.is_empty()),
        "a plain cut incident expects the KV state it recorded"
    );
    for incident in incidents {
        let journal = std::fs::metadata(incident.journal_path()).unwrap();
        // A window carries its ranks' state at its start (tree dumps) besides its own inputs.
        assert!(journal.len() < 200_000, "{}: keep checked-in journals small", incident.name);
        for seed in [0, 1] {
            let outcome = incident.run(seed).unwrap();
            assert!(
                outcome.passed(),
                "{}\n{}",
                incident.reproduce_command(seed),
                outcome.render(false)
            );
            assert!(outcome.checks.iter().any(|c| c.name == "expected-outcome"));
            assert_eq!(
                outcome.checks.iter().any(|c| c.name == "expected-kv"),
                !incident.kv.is_empty(),
                "{}",
                incident.name
            );
            let again = incident.run(seed).unwrap();
            assert_eq!(outcome.trace, again.trace, "{}", incident.reproduce_command(seed));
        }
    }
}
