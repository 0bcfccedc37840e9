//! A real `kvrelay serve --record` run replayed by the simulator: the relay runs as the binary
//! wires it over a real `nats-server` and a file-discovery directory (the relay's production
//! test setup, shared with `relay/shell/tests/production.rs`), then `kvrelay-sim replay`'s engine
//! runs the journal on a turmoil host with a WAN consumer attached. Every recorded checkpoint
//! must be reproduced exactly, and the consumer's replicas must equal the relay's.
//!
//! One recorded worker runs a local indexer (a fake Dynamo request plane) and was serving before
//! the relay started: the relay learns its blocks only from its tree dump, so the replay must
//! feed the journal's recovery answer to reproduce the checkpoints — and a journal without it
//! diverges.

#[path = "../../relay/shell/tests/fake_worker/mod.rs"]
mod fake_worker;
#[path = "../../relay/shell/tests/serve_setup/mod.rs"]
mod serve_setup;
#[path = "../../relay/shell/tests/servers/mod.rs"]
mod servers;

use std::path::PathBuf;
use std::time::Duration;

use kvrelay::journal::{self, Record, SegmentLimits, SegmentWriter};
use kvrelay_core::sources::RecoveryResponse;
use kvrelay_sim::replay::{ReplaySetup, replay};
use serve_setup::{WORKER_B, bounded, record_serve_run};

fn check<'a>(
    outcome: &'a kvrelay_sim::replay::ReplayOutcome,
    name: &str,
) -> &'a kvrelay_sim::Check {
    outcome
        .checks
        .iter()
        .find(|check| check.name == name)
        .unwrap_or_else(|| panic!("no {name} check: {}", outcome.render(false)))
}

#[test]
fn a_recorded_serve_run_replays_every_checkpoint_in_the_simulator_with_a_consumer() {
    let root = tempfile::tempdir().unwrap();
    let serving =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (config, identity) = serving.block_on(bounded(record_serve_run(root.path())));
    drop(serving);

    let dirs: Vec<PathBuf> =
        std::fs::read_dir(root.path()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "one recording per start: {dirs:?}");
    let (header, records, fault) = journal::read_journal(&dirs[0]).unwrap();
    assert_eq!(fault, None);
    assert_eq!(
        *header.node,
        kvrelay::serve::node_config(&config, identity, 7),
        "the header carries serve's node configuration"
    );
    let count = |kind: fn(&Record) -> bool| records.iter().filter(|record| kind(record)).count();
    let inputs = count(|record| matches!(record, Record::Input { .. }));
    let checkpoints = count(|record| matches!(record, Record::Checkpoint { .. }));
    let recoveries = count(|record| matches!(record, Record::Recovery { .. }));
    assert_eq!(count(|record| matches!(record, Record::Gap { .. })), 0, "nothing lost");
    assert!(inputs >= 10, "{inputs} inputs recorded");
    assert!(checkpoints >= 3, "{checkpoints} checkpoints recorded");
    assert!(
        count(|record| matches!(record, Record::Publication { .. })) > 0,
        "the pools' publication points (the subscriber's barrier) are recorded"
    );
    assert!(
        count(|record| matches!(record, Record::Timer { .. })) > 0,
        "the node's timer firings are recorded"
    );
    assert!(
        records.iter().any(|record| matches!(record,
            Record::Recovery { request, outcome: Ok(RecoveryResponse::TreeDump { events, last_event_id: 1, .. }), .. }
                if request.worker_id == WORKER_B && request.is_tree_dump() && events.len() == 1)),
        "worker B's tree dump is in the journal"
    );

    let outcome = replay(&dirs[0], &ReplaySetup { seed: 1, ..ReplaySetup::default() }).unwrap();
    let text = outcome.render(false);
    assert!(outcome.passed(), "{text}");
    let report = outcome.report.as_ref().expect("the replay reached the journal's end");
    assert_eq!(report.journal_fault, None);
    assert_eq!(report.inputs_replayed as usize, inputs);
    assert_eq!(report.recoveries_recorded as usize, recoveries);
    assert_eq!(report.divergence, None, "{text}");
    assert_eq!(report.checkpoints_compared, checkpoints);
    let recorded: Vec<(Duration, &journal::Checkpoint)> = records
        .iter()
        .filter_map(|record| match record {
            Record::Checkpoint { at, checkpoint } => Some((at.mono(), checkpoint)),
            _ => None,
        })
        .collect();
    assert_eq!(report.checkpoints.len(), recorded.len());
    for ((at, replayed), (recorded_at, checkpoint)) in report.checkpoints.iter().zip(&recorded) {
        assert_eq!((at, replayed), (recorded_at, *checkpoint));
    }
    assert!(
        recorded
            .iter()
            .any(|(_, checkpoint)| checkpoint.pools.iter().any(|pool| pool.sequence > 0)),
        "the consumer's lease made the pools publish: {recorded:?}"
    );
    // The recording ends with a checkpoint after its last input: the final state, blocks,
    // filter and sequence included, is reproduced.
    let (last_at, last) = recorded.last().unwrap();
    assert_eq!(last.inputs_handled as usize, inputs, "the last checkpoint follows every input");
    assert_eq!(report.final_state.as_ref(), Some(&(*last_at, (*last).clone())));
    assert!(last.pools.iter().any(|pool| pool.exact_blocks > 0), "{:?}", last.pools);

    let checkpoints_check = check(&outcome, "checkpoints");
    assert_eq!(checkpoints_check.detail, format!("{checkpoints} checkpoints reproduced"));
    assert!(check(&outcome, "consumer-caught-up").detail.contains("consumer-a: 1 pools"), "{text}");
    assert!(check(&outcome, "replica-equals-relay").passed, "{text}");

    // Without its recovery answers the journal does not reproduce: the answers are replayed.
    let unanswered = tempfile::tempdir().unwrap();
    let limits = SegmentLimits {
        max_segment_bytes: 64 << 20,
        max_segment_age: Duration::from_secs(3600),
        max_total_bytes: 1 << 30,
    };
    let mut writer = SegmentWriter::create(unanswered.path(), header, limits).unwrap();
    for record in records.iter().filter(|record| !matches!(record, Record::Recovery { .. })) {
        writer.append(record).unwrap();
    }
    writer.flush(true).unwrap();
    let without =
        replay(unanswered.path(), &ReplaySetup { seed: 1, ..ReplaySetup::default() }).unwrap();
    let report = without.report.as_ref().expect("the replay reached the journal's end");
    assert_eq!(report.recoveries_recorded, 0);
    assert!(report.divergence.is_some(), "{}", without.render(false));
}
