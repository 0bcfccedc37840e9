//! Every scenario for a few seeds: the oracles hold, and the same seed yields the same digest.

use kvrelay_sim::{Scenario, Sim};

const SEEDS: [u64; 3] = [1, 2, 3];

fn assert_passes(scenario: Scenario) {
    for seed in SEEDS {
        let outcome = Sim::new(seed).run(scenario);
        assert!(outcome.passed(), "{}", outcome.render());
    }
}

#[test]
fn steady_state_replicas_match_the_relay_and_the_workers() {
    assert_passes(Scenario::Steady);
}

#[test]
fn a_worker_restart_mid_run_converges() {
    assert_passes(Scenario::WorkerRestart);
}

#[test]
fn a_partitioned_consumer_resubscribes_and_converges() {
    assert_passes(Scenario::Partition);
}

#[test]
fn the_same_seed_yields_the_same_digest() {
    for scenario in Scenario::ALL {
        let first = Sim::new(7).run(scenario);
        let second = Sim::new(7).run(scenario);
        assert!(first.passed(), "{}", first.render());
        assert!(!first.digest.is_empty());
        assert_eq!(first.digest, second.digest, "{}", first.reproduce_command());
    }
}

#[test]
fn different_seeds_yield_different_digests() {
    let one = Sim::new(1).run(Scenario::Steady);
    let two = Sim::new(2).run(Scenario::Steady);
    assert_ne!(one.digest, two.digest);
}

#[test]
fn workers_restarting_behind_a_partition_are_caught_up_after_repair() {
    assert_passes(Scenario::RestartDuringPartition);
}

#[test]
fn a_wan_stall_shorter_than_keepalive_keeps_every_stream() {
    assert_passes(Scenario::WanStall);
}
