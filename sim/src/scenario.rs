//! Scenarios as code: each is a story of steps the checker host plays before quiescence, plus
//! the checks specific to it. (A data-file form of the same steps can come later.)

use std::time::Duration;

use kvrelay::consumer::ConsumerSnapshot;

use crate::Check;

/// One step of a scenario's story.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Let the simulation (and the DC's traffic) run this long.
    Run(Duration),
    /// Restart the DC's worker at this index (new worker id, empty caches).
    RestartWorker(usize),
    /// Cut the network between the relay and the long-lived consumer.
    PartitionConsumer,
    /// Restore it.
    RepairConsumer,
    /// Hold (queue, not drop) every message between the relay and the long-lived consumer.
    HoldConsumer,
    /// Deliver the held messages and stop holding.
    ReleaseConsumer,
}

/// A named scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scenario {
    /// Traffic flows, nothing fails.
    Steady,
    /// A worker (the two-rank aggregated one) restarts mid-run.
    WorkerRestart,
    /// The WAN between relay and consumer is partitioned long enough for keepalive to notice,
    /// then repaired; the consumer must resubscribe and converge.
    Partition,
    /// Two workers restart while the consumer is partitioned away; after the repair the
    /// consumer must catch up with pools whose filters changed under it.
    RestartDuringPartition,
    /// The WAN to the consumer stalls (messages queue) for less than the keepalive timeout,
    /// then delivers the burst; the streams must survive without a resubscription.
    WanStall,
}

impl Scenario {
    /// Every scenario, in sweep order.
    pub const ALL: [Scenario; 5] = [
        Scenario::Steady,
        Scenario::WorkerRestart,
        Scenario::Partition,
        Scenario::RestartDuringPartition,
        Scenario::WanStall,
    ];

    /// The scenario's command-line name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::WorkerRestart => "worker-restart",
            Scenario::Partition => "partition",
            Scenario::RestartDuringPartition => "restart-during-partition",
            Scenario::WanStall => "wan-stall",
        }
    }

    /// The scenario named `name`.
    #[must_use]
    pub fn parse(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|scenario| scenario.name() == name)
    }

    /// The story the checker plays before stopping traffic.
    #[must_use]
    pub fn steps(self) -> Vec<Step> {
        let seconds = Duration::from_secs;
        match self {
            Scenario::Steady => vec![Step::Run(seconds(4))],
            Scenario::WorkerRestart => {
                vec![Step::Run(seconds(2)), Step::RestartWorker(1), Step::Run(seconds(2))]
            }
            Scenario::Partition => vec![
                Step::Run(seconds(2)),
                Step::PartitionConsumer,
                Step::Run(seconds(40)),
                Step::RepairConsumer,
                Step::Run(seconds(2)),
            ],
            Scenario::RestartDuringPartition => vec![
                Step::Run(seconds(2)),
                Step::PartitionConsumer,
                Step::Run(seconds(5)),
                Step::RestartWorker(0),
                Step::RestartWorker(4),
                Step::Run(seconds(35)),
                Step::RepairConsumer,
                Step::Run(seconds(2)),
            ],
            Scenario::WanStall => vec![
                Step::Run(seconds(2)),
                Step::HoldConsumer,
                Step::Run(seconds(5)),
                Step::ReleaseConsumer,
                Step::Run(seconds(2)),
            ],
        }
    }

    /// Checks specific to the scenario, on the long-lived consumer's final snapshot.
    #[must_use]
    pub fn extra_checks(self, snapshot: &ConsumerSnapshot) -> Vec<Check> {
        match self {
            Scenario::Steady | Scenario::WorkerRestart => Vec::new(),
            Scenario::Partition | Scenario::RestartDuringPartition => {
                // After the partition the catalog is lost, replicas are dropped and every pool is
                // subscribed afresh: more subscriptions and installs than pools.
                let counters = &snapshot.counters;
                let pools = crate::DEMO_POOL_COUNT as u64;
                vec![Check {
                    name: "consumer-resubscribed",
                    passed: counters.subscriptions > pools && counters.installs > pools,
                    detail: format!(
                        "{} subscriptions, {} installs, {} replicas dropped",
                        counters.subscriptions, counters.installs, counters.replicas_dropped
                    ),
                }]
            }
            Scenario::WanStall => {
                let counters = &snapshot.counters;
                let pools = crate::DEMO_POOL_COUNT as u64;
                vec![Check {
                    name: "streams-survive-stall",
                    passed: counters.subscriptions == pools && counters.replicas_dropped == 0,
                    detail: format!(
                        "{} subscriptions, {} replicas dropped",
                        counters.subscriptions, counters.replicas_dropped
                    ),
                }]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_is_found_by_its_name() {
        for scenario in Scenario::ALL {
            assert_eq!(Scenario::parse(scenario.name()), Some(scenario));
        }
        assert_eq!(Scenario::parse("no-such-scenario"), None);
    }
}
