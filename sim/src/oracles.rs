//! Oracles over the recorded trace (pure functions of the events).
//!
//! - **producer-identity-never-reused**: once a producer leaves the relay's catalog it never
//!   appears in a catalog again (in any boot);
//! - **sequence-contiguity**: no consumer's replica sequence of a producer goes back while that
//!   consumer's subscriptions stay the same, and no consumer counted a replica (sequence, CBI1,
//!   assembly) or stream-guard fault;
//! - **withdrawal-precedes-teardown**: no catalogued producer lost its live publication while
//!   still catalogued;
//! - **no-ready-without-roles**: the relay never published READY for a model the truth model had
//!   called unservable for longer than [`SETTLE_MS`] (while the relay could see the DC);
//! - **unknown-only-before-authority**: the relay published UNKNOWN only within [`SETTLE_MS`]
//!   of a boot or of the end of a DC-plane partition (before authoritative availability);
//! - **node-healthy**: the node's status, read after every step of every boot, never showed a
//!   control-plane or host invariant failure (`control_last_error`, `host_last_error`), nor
//!   `healthy == false` without a fenced endpoint or a shutdown to explain it;
//! - **updates-valid**: every catalog and readiness update the relay published passes the wire
//!   validation, and no consumer counted an invalid message or a contract mismatch.

use std::collections::{BTreeMap, BTreeSet};

use crate::Check;
use crate::trace::{EntryTrace, ProducerTrace, Stamped, TraceEvent};

/// How long the relay may take to reflect a change of the DC (simulated ms).
pub const SETTLE_MS: u64 = 2_000;

/// Every trace oracle, in order.
#[must_use]
pub fn trace_checks(events: &[Stamped]) -> Vec<Check> {
    vec![
        producer_identity_never_reused(events),
        sequence_contiguity(events),
        withdrawal_precedes_teardown(events),
        no_ready_without_roles(events),
        unknown_only_before_authority(events),
        node_healthy(events),
        updates_valid(events),
    ]
}

/// No node-fault event: the node's status never showed an invariant failure or an
/// unexplained unhealthy state.
#[must_use]
pub fn node_healthy(events: &[Stamped]) -> Check {
    let violations: Vec<String> = events
        .iter()
        .filter_map(|stamped| match &stamped.event {
            TraceEvent::NodeFault { boot, detail } => {
                Some(format!("boot {boot} at {} ms: {detail}", stamped.ms))
            }
            _ => None,
        })
        .collect();
    let boots =
        events.iter().filter(|stamped| matches!(stamped.event, TraceEvent::RelayBoot { .. }));
    let fine = format!("{} boots, status healthy after every step", boots.count());
    verdict("node-healthy", &violations, fine)
}

/// No invalid update published, none counted invalid or mismatched at a consumer.
#[must_use]
pub fn updates_valid(events: &[Stamped]) -> Check {
    let mut violations = Vec::new();
    let mut updates = 0usize;
    let mut faults: BTreeMap<&str, &BTreeMap<String, u64>> = BTreeMap::new();
    for stamped in events {
        match &stamped.event {
            TraceEvent::InvalidUpdate { boot, plane, error } => violations.push(format!(
                "boot {boot} published an invalid {plane} update at {} ms: {error}",
                stamped.ms
            )),
            TraceEvent::RelayCatalog { .. } | TraceEvent::RelayReadiness { .. } => updates += 1,
            TraceEvent::Consumer(view) => {
                faults.insert(view.consumer.as_str(), &view.faults);
            }
            _ => {}
        }
    }
    for (consumer, counts) in &faults {
        for (kind, count) in counts.iter() {
            if kind.ends_with("/invalid-message") || kind.ends_with("/contract-mismatch") {
                violations.push(format!("{consumer}: {count} {kind} fault(s)"));
            }
        }
    }
    verdict("updates-valid", &violations, format!("{updates} published updates valid"))
}

/// The check `name`: passed with `fine` as its detail when there are no `violations`, else
/// failed naming their count and the first.
pub(crate) fn verdict(name: &'static str, violations: &[String], fine: String) -> Check {
    match violations.first() {
        None => Check { name, passed: true, detail: fine },
        Some(first) => Check {
            name,
            passed: false,
            detail: format!("{} violation(s), first: {first}", violations.len()),
        },
    }
}

/// Once out of the catalog, a producer never comes back.
#[must_use]
pub fn producer_identity_never_reused(events: &[Stamped]) -> Check {
    let mut current: BTreeSet<ProducerTrace> = BTreeSet::new();
    let mut retired: BTreeSet<ProducerTrace> = BTreeSet::new();
    let mut seen = 0usize;
    let mut violations = Vec::new();
    for stamped in events {
        let TraceEvent::RelayCatalog { pools, .. } = &stamped.event else { continue };
        let next: BTreeSet<ProducerTrace> = pools.iter().cloned().collect();
        for producer in next.difference(&current) {
            if retired.contains(producer) {
                violations.push(format!("{producer:?} reused at {} ms", stamped.ms));
            }
            seen += 1;
        }
        retired.extend(current.difference(&next).cloned());
        current = next;
    }
    verdict(
        "producer-identity-never-reused",
        &violations,
        format!("{seen} producers, {} retired", retired.len()),
    )
}

/// Replica sequences only move forward within a consumer's subscription epoch; no sequence
/// faults at any consumer.
#[must_use]
pub fn sequence_contiguity(events: &[Stamped]) -> Check {
    let mut last: BTreeMap<(&str, &ProducerTrace), (u64, u64)> = BTreeMap::new();
    let mut violations = Vec::new();
    let mut observed = 0usize;
    let mut faults: BTreeMap<&str, &BTreeMap<String, u64>> = BTreeMap::new();
    for stamped in events {
        let TraceEvent::Consumer(view) = &stamped.event else { continue };
        let consumer = view.consumer.as_str();
        for replica in &view.pools {
            let Some(sequence) = replica.sequence else { continue };
            observed += 1;
            let key = (consumer, &replica.producer);
            if let Some((epoch, previous)) = last.get(&key)
                && *epoch == view.subscriptions
                && sequence < *previous
            {
                violations.push(format!(
                    "{consumer}: {} went from {previous} back to {sequence} at {} ms",
                    replica.producer.endpoint, stamped.ms
                ));
            }
            last.insert(key, (view.subscriptions, sequence));
        }
        faults.insert(consumer, &view.faults);
    }
    for (consumer, counts) in &faults {
        for (kind, count) in counts.iter() {
            if kind.ends_with("/replica") || kind.ends_with("/stream-guard") {
                violations.push(format!("{consumer}: {count} {kind} fault(s)"));
            }
        }
    }
    verdict("sequence-contiguity", &violations, format!("{observed} replica sequences observed"))
}

/// No teardown of a catalogued producer.
#[must_use]
pub fn withdrawal_precedes_teardown(events: &[Stamped]) -> Check {
    let violations: Vec<String> = events
        .iter()
        .filter_map(|stamped| match &stamped.event {
            TraceEvent::TeardownBeforeWithdrawal { producer, .. } => {
                Some(format!("{} at {} ms", producer.endpoint, stamped.ms))
            }
            _ => None,
        })
        .collect();
    let withdrawn = events
        .iter()
        .filter(|stamped| matches!(stamped.event, TraceEvent::RelayCatalog { .. }))
        .count();
    verdict(
        "withdrawal-precedes-teardown",
        &violations,
        format!("{withdrawn} catalogs, every teardown after its withdrawal"),
    )
}

/// The readiness entries in effect at `ms`: the last published at or before it (a boot starts
/// from none), with the time they were published.
fn readiness_at(events: &[Stamped], ms: u64) -> Option<(u64, &[EntryTrace])> {
    let mut current = None;
    for stamped in events.iter().take_while(|stamped| stamped.ms <= ms) {
        match &stamped.event {
            TraceEvent::RelayBoot { .. } => current = None,
            TraceEvent::RelayReadiness { entries, .. } => {
                current = Some((stamped.ms, entries.as_slice()));
            }
            _ => {}
        }
    }
    current
}

/// Every readiness in effect during `[from, to)`: the one in effect at `from` and every one
/// published after it, before `to`.
fn readiness_during(events: &[Stamped], from: u64, to: u64) -> Vec<(u64, &[EntryTrace])> {
    let mut during: Vec<(u64, &[EntryTrace])> = readiness_at(events, from).into_iter().collect();
    for stamped in events.iter().filter(|stamped| stamped.ms > from && stamped.ms < to) {
        if let TraceEvent::RelayReadiness { entries, .. } = &stamped.event {
            during.push((stamped.ms, entries.as_slice()));
        }
    }
    during
}

/// READY is never in effect for a model that has been unservable (while the relay could see
/// the DC) for longer than the settle time.
#[must_use]
pub fn no_ready_without_roles(events: &[Stamped]) -> Check {
    let end = events.last().map_or(0, |stamped| stamped.ms + 1);
    let truths: Vec<(u64, bool, &BTreeMap<String, bool>)> = events
        .iter()
        .filter_map(|stamped| match &stamped.event {
            TraceEvent::Truth { visible, servable } => Some((stamped.ms, *visible, servable)),
            _ => None,
        })
        .collect();
    let mut violations = Vec::new();
    let mut checked = 0usize;
    for (index, (since, visible, servable)) in truths.iter().enumerate() {
        let until = truths.get(index + 1).map_or(end, |next| next.0);
        if !visible || since + SETTLE_MS >= until {
            continue;
        }
        for (ms, entries) in readiness_during(events, since + SETTLE_MS, until) {
            for entry in entries.iter().filter(|entry| entry.state == "ready") {
                checked += 1;
                if servable.get(&entry.model) == Some(&false) {
                    violations.push(format!(
                        "{} READY in effect at {} ms (published {ms} ms), unservable since \
                         {since} ms",
                        entry.model,
                        since + SETTLE_MS
                    ));
                }
            }
        }
    }
    verdict("no-ready-without-roles", &violations, format!("{checked} settled READY entries"))
}

/// UNKNOWN is in effect only while the relay is not yet authoritative: within the settle time
/// of a boot or of the end of a DC-plane partition.
#[must_use]
pub fn unknown_only_before_authority(events: &[Stamped]) -> Check {
    let end = events.last().map_or(0, |stamped| stamped.ms + 1);
    // Windows in which the relay must be authoritative: from settle after a boot or a repair
    // to the next boot or partition.
    let mut windows = Vec::new();
    let mut from: Option<u64> = None;
    for stamped in events {
        match &stamped.event {
            TraceEvent::RelayBoot { .. }
            | TraceEvent::Fault { fault: crate::scenario::Fault::DcPartition { .. } } => {
                if let Some(start) = from.take()
                    && start < stamped.ms
                {
                    windows.push((start, stamped.ms));
                }
                if matches!(stamped.event, TraceEvent::RelayBoot { .. }) {
                    from = Some(stamped.ms + SETTLE_MS);
                }
            }
            TraceEvent::Fault { fault: crate::scenario::Fault::DcRepair } => {
                from = Some(stamped.ms + SETTLE_MS);
            }
            _ => {}
        }
    }
    if let Some(start) = from
        && start < end
    {
        windows.push((start, end));
    }
    let mut violations = Vec::new();
    let mut checked = 0usize;
    for (start, stop) in windows {
        for (ms, entries) in readiness_during(events, start, stop) {
            for entry in entries {
                checked += 1;
                if entry.state == "unknown" {
                    violations.push(format!(
                        "{} UNKNOWN in effect after {start} ms (published {ms} ms)",
                        entry.model
                    ));
                }
            }
        }
    }
    verdict(
        "unknown-only-before-authority",
        &violations,
        format!("{checked} authoritative entries checked, none UNKNOWN"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn producer(generation: u64) -> ProducerTrace {
        ProducerTrace { endpoint: "ns/c/e".into(), pool: "p".into(), incarnation: 1, generation }
    }

    fn at(ms: u64, event: TraceEvent) -> Stamped {
        Stamped { ms, event }
    }

    fn catalog(ms: u64, pools: Vec<ProducerTrace>) -> Stamped {
        at(ms, TraceEvent::RelayCatalog { boot: 0, revision: ms, pools })
    }

    fn readiness(ms: u64, state: &'static str) -> Stamped {
        let entry = EntryTrace { model: "m".into(), state, missing: Vec::new() };
        at(ms, TraceEvent::RelayReadiness { boot: 0, revision: ms, entries: vec![entry] })
    }

    fn truth(ms: u64, servable: bool) -> Stamped {
        at(ms, TraceEvent::Truth { visible: true, servable: [("m".into(), servable)].into() })
    }

    #[test]
    fn a_producer_back_after_withdrawal_is_a_reuse() {
        let fine = [catalog(1, vec![producer(1)]), catalog(2, vec![producer(2)])];
        assert!(producer_identity_never_reused(&fine).passed);
        let reused =
            [catalog(1, vec![producer(1)]), catalog(2, vec![]), catalog(3, vec![producer(1)])];
        assert!(!producer_identity_never_reused(&reused).passed);
    }

    #[test]
    fn a_teardown_while_still_catalogued_is_a_violation() {
        let withdrawn = [catalog(1, vec![producer(1)]), catalog(2, vec![])];
        let fine = withdrawal_precedes_teardown(&withdrawn);
        assert!(fine.passed, "{}", fine.detail);
        let teardown =
            at(3, TraceEvent::TeardownBeforeWithdrawal { boot: 0, producer: producer(1) });
        let torn = [catalog(1, vec![producer(1)]), teardown, catalog(4, vec![])];
        let check = withdrawal_precedes_teardown(&torn);
        assert!(!check.passed);
        assert!(check.detail.contains("ns/c/e at 3 ms"), "{}", check.detail);
    }

    #[test]
    fn ready_is_allowed_only_while_the_truth_is_settling() {
        let boot = at(0, TraceEvent::RelayBoot { boot: 0, incarnation: 1 });
        let settling = [
            boot.clone(),
            truth(100, false),
            readiness(500, "ready"),
            readiness(600, "unavailable"),
        ];
        assert!(no_ready_without_roles(&settling).passed);
        let lingering =
            [boot.clone(), readiness(50, "ready"), truth(100, false), truth(5000, true)];
        assert!(!no_ready_without_roles(&lingering).passed);
        let stale = [boot.clone(), truth(100, false), readiness(100 + SETTLE_MS, "ready")];
        assert!(!no_ready_without_roles(&stale).passed);
        let servable = [boot, truth(100, true), readiness(100 + SETTLE_MS, "ready")];
        assert!(no_ready_without_roles(&servable).passed);
    }

    #[test]
    fn unknown_after_authority_is_a_violation() {
        let boot = at(0, TraceEvent::RelayBoot { boot: 0, incarnation: 1 });
        let ready = readiness(SETTLE_MS, "ready");
        let resolved = [boot.clone(), readiness(10, "unknown"), ready.clone()];
        assert!(unknown_only_before_authority(&resolved).passed);
        let lingering =
            [boot.clone(), readiness(10, "unknown"), at(SETTLE_MS + 5, truth(0, true).event)];
        assert!(!unknown_only_before_authority(&lingering).passed);
        assert!(!unknown_only_before_authority(&[boot, readiness(SETTLE_MS, "unknown")]).passed);
    }

    #[test]
    fn a_node_fault_or_an_invalid_update_fails_the_run() {
        let boot = at(0, TraceEvent::RelayBoot { boot: 0, incarnation: 1 });
        assert!(node_healthy(std::slice::from_ref(&boot)).passed);
        let fault =
            at(40, TraceEvent::NodeFault { boot: 0, detail: "control invariant: x".into() });
        let check = node_healthy(&[boot.clone(), fault]);
        assert!(!check.passed);
        assert!(check.detail.contains("boot 0 at 40 ms: control invariant: x"), "{}", check.detail);
        assert!(updates_valid(&[boot.clone(), catalog(1, vec![producer(1)])]).passed);
        let invalid =
            at(50, TraceEvent::InvalidUpdate { boot: 0, plane: "catalog", error: "bad".into() });
        assert!(!updates_valid(&[boot.clone(), invalid]).passed);
        let view = TraceEvent::Consumer(crate::trace::ConsumerTrace {
            consumer: "consumer-a".into(),
            catalog_revision: None,
            pools: Vec::new(),
            readiness: Vec::new(),
            subscriptions: 0,
            replicas_dropped: 0,
            faults: [("readiness/invalid-message".to_owned(), 1)].into(),
        });
        let check = updates_valid(&[boot, at(60, view)]);
        assert!(!check.passed);
        assert!(check.detail.contains("1 readiness/invalid-message"), "{}", check.detail);
    }

    #[test]
    fn a_sequence_going_back_within_one_subscription_is_a_violation() {
        use crate::trace::{ConsumerTrace, ReplicaTrace};
        let view_of = |consumer: &str, subscriptions, sequence| {
            TraceEvent::Consumer(ConsumerTrace {
                consumer: consumer.to_owned(),
                catalog_revision: Some(1),
                pools: vec![ReplicaTrace {
                    producer: producer(1),
                    status: "ready",
                    sequence: Some(sequence),
                }],
                readiness: Vec::new(),
                subscriptions,
                replicas_dropped: 0,
                faults: BTreeMap::new(),
            })
        };
        let view = |subscriptions, sequence| view_of("consumer-a", subscriptions, sequence);
        assert!(sequence_contiguity(&[at(1, view(1, 5)), at(2, view(1, 7))]).passed);
        assert!(!sequence_contiguity(&[at(1, view(1, 5)), at(2, view(1, 4))]).passed);
        assert!(sequence_contiguity(&[at(1, view(1, 5)), at(2, view(2, 1))]).passed);
        // Consumers are followed separately: one behind another is no step back.
        let other = view_of("consumer-b", 1, 3);
        assert!(sequence_contiguity(&[at(1, view(1, 5)), at(2, other), at(3, view(1, 6))]).passed);
        let behind = view_of("consumer-b", 1, 2);
        let b_first = view_of("consumer-b", 1, 4);
        assert!(!sequence_contiguity(&[at(1, b_first), at(2, view(1, 5)), at(3, behind)]).passed);
    }
}
