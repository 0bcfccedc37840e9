//! Text lines for a consumer CLI: `watch` (catalog, per-pool filter state, readiness, load,
//! counters, and what changed between two snapshots) and `query` (per-pool answers).
//!
//! Pure: every function takes values and returns `String`s; nothing prints. Lines list
//! everything in the snapshot's deterministic order and hold no wall-clock or random values,
//! so two runs that reach the same state render the same text. Identifiers render through their
//! `Display` forms; roles and readiness states by their wire enum names without prefix.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvrelay_proto::v1 as proto;

use super::policy::Plane;
use super::query::QueryAnswer;
use super::state::{ConsumerCounters, ConsumerHalt, ConsumerSnapshot, PoolReplicaState};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, WorkerRole};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{PoolId, ProducerIdentity};
use kvrelay_core::readiness::ReadinessState;
use kvrelay_core::readiness::topology::TopologyEntry;
use kvrelay_core::wire::PoolLoad;

/// `standard` or `eagle`.
#[must_use]
pub fn hash_format_name(format: HashFormat) -> &'static str {
    match format {
        HashFormat::StandardV1 => "standard",
        HashFormat::EagleV1 => "eagle",
    }
}

/// A role's wire name without its prefix, e.g. `PREFILL`.
#[must_use]
pub fn role_name(role: WorkerRole) -> &'static str {
    proto::WorkerRole::try_from(role.wire_value())
        .map(|role| role.as_str_name())
        .unwrap_or("WORKER_ROLE_UNSPECIFIED")
        .trim_start_matches("WORKER_ROLE_")
}

/// A readiness state's wire name without its prefix, e.g. `READY`.
#[must_use]
pub fn state_name(state: ReadinessState) -> &'static str {
    proto::ServingReadinessState::try_from(state.wire_value())
        .map(|state| state.as_str_name())
        .unwrap_or("SERVING_READINESS_STATE_UNKNOWN")
        .trim_start_matches("SERVING_READINESS_STATE_")
}

fn roles<'a>(roles: impl IntoIterator<Item = &'a WorkerRole>) -> String {
    let names: Vec<&str> = roles.into_iter().map(|role| role_name(*role)).collect();
    format!("[{}]", names.join(","))
}

/// `<pool id> gen=<layout generation> incarnation=<hex>`.
#[must_use]
pub fn producer_label(producer: &ProducerIdentity) -> String {
    format!(
        "{} gen={} incarnation={:016x}",
        producer.pool_id(),
        producer.layout_generation(),
        producer.producer_incarnation()
    )
}

/// One registration: canonical id, LoRA target and aliases, e.g.
/// `tiny-lora (lora adapter-a on tiny-llm)`.
#[must_use]
pub fn registration(registration: &ModelRegistration) -> String {
    let mut text = registration.canonical_model_id.clone();
    if let ModelTarget::Lora { base_model, adapter } = &registration.target {
        let _ = write!(text, " (lora {adapter} on {base_model})");
    }
    if !registration.aliases.is_empty() {
        let aliases: Vec<&str> = registration.aliases.iter().map(String::as_str).collect();
        let _ = write!(text, " (aliases {})", aliases.join(","));
    }
    text
}

/// One catalogued pool and its filter state.
#[must_use]
pub fn pool_line(pool: &PoolReplicaState) -> String {
    let descriptor = &pool.descriptor;
    let models: Vec<String> = descriptor.registrations.iter().map(registration).collect();
    let sequence = pool.sequence.map_or_else(|| "-".to_owned(), |sequence| sequence.to_string());
    format!(
        "pool {} endpoint={} roles={} block={} hash={} models=[{}] filter={} seq={} resident_slots={}",
        producer_label(&pool.producer),
        descriptor.serving_endpoint,
        roles(&descriptor.pool_roles),
        descriptor.query_semantics.kv_block_size,
        hash_format_name(descriptor.query_semantics.hash_format),
        models.join("; "),
        pool.status.name(),
        sequence,
        pool.resident_slots,
    )
}

/// One readiness entry.
#[must_use]
pub fn readiness_line(entry: &TopologyEntry) -> String {
    let mut line = format!(
        "readiness {}/{} state={} present={} missing={} members={}",
        entry.namespace,
        entry.canonical_model_id,
        state_name(entry.state),
        roles(&entry.present_roles),
        roles(&entry.missing_roles),
        entry.members.len(),
    );
    if !entry.duplicate_role_endpoints.is_empty() {
        let _ = write!(line, " duplicate_roles={}", roles(&entry.duplicate_role_endpoints));
    }
    if entry.legacy_fallback_active {
        line.push_str(" legacy_fallback");
    }
    if !entry.adapters.is_empty() {
        let adapters: Vec<String> = entry
            .adapters
            .iter()
            .map(|adapter| format!("{}:{}", adapter.canonical_model_id, state_name(adapter.state)))
            .collect();
        let _ = write!(line, " adapters=[{}]", adapters.join(","));
    }
    line
}

/// One pool's load; unknown numbers (incomplete coverage, unknown capacity) render as `?`.
#[must_use]
pub fn load_line(load: &PoolLoad) -> String {
    let number = |value: Option<u64>| value.map_or_else(|| "?".to_owned(), |n| n.to_string());
    format!(
        "load {} used={}/{} ranks={}/{}",
        producer_label(&load.producer),
        number(load.kv_used_blocks),
        number(load.total_kv_blocks),
        load.kv_observed_ranks,
        load.kv_expected_ranks,
    )
}

/// The counters on one line.
#[must_use]
pub fn counters_line(counters: &ConsumerCounters) -> String {
    format!(
        "counters subscriptions={} resubscribes={} installs={} deltas={} heartbeats={} \
         replicas_dropped={} producer_changes={} faults={}",
        counters.subscriptions,
        counters.resubscribes,
        counters.installs,
        counters.deltas_applied,
        counters.heartbeats_confirmed,
        counters.replicas_dropped,
        counters.producer_changes,
        counters.faults.values().sum::<u64>(),
    )
}

fn fault_lines(counters: &ConsumerCounters) -> Vec<String> {
    counters
        .faults
        .iter()
        .map(|((plane, kind), count)| format!("fault {plane} {kind} count={count}"))
        .collect()
}

fn halt_line(halt: &ConsumerHalt) -> String {
    format!("halted plane={} cause={}", halt.plane, halt.cause)
}

fn catalog_line(snapshot: &ConsumerSnapshot) -> String {
    let stream = snapshot.plane(Plane::Catalog).name();
    match (snapshot.relay, snapshot.catalog_revision) {
        (Some(relay), Some(revision)) => format!(
            "catalog relay={:016x}/{:016x} revision={} pools={} quarantined={} stream={}",
            relay.drt_instance_id,
            relay.relay_incarnation,
            revision,
            snapshot.pools.len(),
            snapshot.quarantined_pools.len(),
            stream,
        ),
        _ => format!("catalog (no view) stream={stream}"),
    }
}

fn quarantine_lines(snapshot: &ConsumerSnapshot) -> Vec<String> {
    snapshot
        .quarantined_pools
        .iter()
        .map(|entry| format!("quarantined {}: {}", entry.key, entry.error))
        .collect()
}

fn readiness_header(snapshot: &ConsumerSnapshot) -> String {
    let revision =
        snapshot.readiness_revision.map_or_else(|| "-".to_owned(), |revision| revision.to_string());
    format!(
        "readiness revision={} entries={} stream={}",
        revision,
        snapshot.readiness.len(),
        snapshot.plane(Plane::Readiness).name()
    )
}

fn load_header(snapshot: &ConsumerSnapshot) -> String {
    let window = snapshot.load_window.map_or_else(|| "-".to_owned(), |window| window.to_string());
    format!(
        "load window={} pools={} stream={}",
        window,
        snapshot.load.len(),
        snapshot.plane(Plane::Load).name()
    )
}

/// Everything in a snapshot: catalog, pools, quarantined entries, readiness, load, counters,
/// faults, halt.
#[must_use]
pub fn snapshot_lines(snapshot: &ConsumerSnapshot) -> Vec<String> {
    let mut lines = vec![catalog_line(snapshot)];
    lines.extend(snapshot.pools.iter().map(pool_line));
    lines.extend(quarantine_lines(snapshot));
    lines.push(readiness_header(snapshot));
    lines.extend(snapshot.readiness.iter().map(readiness_line));
    lines.push(load_header(snapshot));
    lines.extend(snapshot.load.iter().map(load_line));
    lines.push(counters_line(&snapshot.counters));
    lines.extend(fault_lines(&snapshot.counters));
    lines.extend(snapshot.halted.as_ref().map(halt_line));
    lines
}

/// What changed from `previous` to `current` (everything when there is no previous snapshot):
/// the catalog line when the view or its stream changed, `+`/`~`/`-` pool lines for added,
/// changed and withdrawn pools, the readiness and load sections when they changed, each fault
/// count that grew, and the halt.
#[must_use]
pub fn change_lines(
    previous: Option<&ConsumerSnapshot>,
    current: &ConsumerSnapshot,
) -> Vec<String> {
    let Some(previous) = previous else {
        return snapshot_lines(current);
    };
    let mut lines = Vec::new();
    if catalog_line(previous) != catalog_line(current)
        || previous.quarantined_pools != current.quarantined_pools
    {
        lines.push(catalog_line(current));
        lines.extend(quarantine_lines(current));
    }
    let before: BTreeMap<PoolId, &PoolReplicaState> =
        previous.pools.iter().map(|pool| (pool.descriptor.pool_id(), pool)).collect();
    let after: BTreeMap<PoolId, &PoolReplicaState> =
        current.pools.iter().map(|pool| (pool.descriptor.pool_id(), pool)).collect();
    for (pool_id, pool) in &after {
        match before.get(pool_id) {
            None => lines.push(format!("+ {}", pool_line(pool))),
            Some(old) if old.producer != pool.producer => {
                lines.push(format!(
                    "~ producer {} gen={} -> gen={}",
                    pool_id,
                    old.producer.layout_generation(),
                    pool.producer.layout_generation()
                ));
                lines.push(format!("~ {}", pool_line(pool)));
            }
            Some(old) if *old != *pool => lines.push(format!("~ {}", pool_line(pool))),
            Some(_) => {}
        }
    }
    for (pool_id, pool) in &before {
        if !after.contains_key(pool_id) {
            lines.push(format!("- pool {} withdrawn", producer_label(&pool.producer)));
        }
    }
    if readiness_header(previous) != readiness_header(current)
        || previous.readiness != current.readiness
    {
        lines.push(readiness_header(current));
        lines.extend(current.readiness.iter().map(readiness_line));
    }
    if load_header(previous) != load_header(current) || previous.load != current.load {
        lines.push(load_header(current));
        lines.extend(current.load.iter().map(load_line));
    }
    for (key, count) in &current.counters.faults {
        if previous.counters.faults.get(key).is_none_or(|old| old < count) {
            let (plane, kind) = key;
            lines.push(format!("fault {plane} {kind} count={count}"));
        }
    }
    if previous.halted.is_none()
        && let Some(halt) = &current.halted
    {
        lines.push(halt_line(halt));
    }
    lines
}

/// One line per answer, best first, or one line saying no pool serves the model.
#[must_use]
pub fn answer_lines(model: &str, answers: &[QueryAnswer]) -> Vec<String> {
    if answers.is_empty() {
        return vec![format!("no catalogued pool serves model {model}")];
    }
    answers
        .iter()
        .enumerate()
        .map(|(index, answer)| {
            let mut line = format!(
                "#{} pool {} endpoint={} model={} salt={} hash={}/{} matched={}/{} blocks",
                index + 1,
                producer_label(&answer.producer),
                answer.endpoint,
                answer.canonical_model_id,
                answer.lora_adapter.as_deref().unwrap_or("none"),
                hash_format_name(answer.query_semantics.hash_format),
                answer.query_semantics.kv_block_size,
                answer.matched_blocks,
                answer.total_blocks,
            );
            if !answer.replica_ready {
                line.push_str(" (no replica yet)");
            }
            line
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::state::FilterStatus;
    use kvrelay_core::discovery::QuerySemantics;
    use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED};
    use kvrelay_core::host::PoolDescriptor;
    use kvrelay_core::model::identity::{
        EndpointPath, RelayIdentity, resolve_indexer_domain, stable_dc_id,
    };

    pub(crate) fn pool(generation: u64, sequence: Option<u64>) -> PoolReplicaState {
        let endpoint: EndpointPath = "dynamo/backend/generate".parse().unwrap();
        let domain =
            resolve_indexer_domain("tiny-llm", 16, HashFormat::StandardV1, &endpoint, None)
                .unwrap();
        let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("dc-a").unwrap() };
        let producer =
            ProducerIdentity::new(pool_id, 0x1234, generation, CkfFormat::v1(DEFAULT_SEED, 1024))
                .unwrap();
        PoolReplicaState {
            producer,
            descriptor: PoolDescriptor {
                producer,
                serving_endpoint: endpoint,
                registrations: vec![
                    ModelRegistration {
                        canonical_model_id: "tiny-lora".into(),
                        target: ModelTarget::Lora {
                            base_model: "tiny-llm".into(),
                            adapter: "adapter-a".into(),
                        },
                        aliases: BTreeSet::new(),
                    },
                    ModelRegistration {
                        canonical_model_id: "tiny-llm".into(),
                        target: ModelTarget::Base { base_model: "tiny-llm".into() },
                        aliases: BTreeSet::from(["tiny".to_owned()]),
                    },
                ],
                query_semantics: QuerySemantics {
                    kv_block_size: 16,
                    hash_format: HashFormat::StandardV1,
                },
                pool_roles: BTreeSet::from([WorkerRole::Prefill, WorkerRole::Decode]),
            },
            status: if sequence.is_some() { FilterStatus::Ready } else { FilterStatus::Connecting },
            sequence,
            resident_slots: 12,
        }
    }

    pub(crate) fn snapshot(pools: Vec<PoolReplicaState>) -> ConsumerSnapshot {
        ConsumerSnapshot {
            relay: Some(RelayIdentity { drt_instance_id: 0x11, relay_incarnation: 0x1234 }),
            catalog_revision: Some(3),
            planes: BTreeMap::new(),
            pools,
            quarantined_pools: Vec::new(),
            readiness_revision: None,
            readiness: Vec::new(),
            load_window: None,
            load: Vec::new(),
            counters: ConsumerCounters::default(),
            halted: None,
        }
    }

    #[test]
    fn a_pool_line_names_everything_a_router_needs() {
        let line = pool_line(&pool(2, Some(14)));
        assert!(line.starts_with("pool "), "{line}");
        for part in [
            "gen=2 incarnation=0000000000001234",
            "endpoint=dynamo/backend/generate",
            "roles=[PREFILL,DECODE]",
            "block=16 hash=standard",
            "models=[tiny-lora (lora adapter-a on tiny-llm); tiny-llm (aliases tiny)]",
            "filter=ready seq=14 resident_slots=12",
        ] {
            assert!(line.contains(part), "{part} missing from {line}");
        }
    }

    #[test]
    fn changes_show_only_what_moved() {
        let before = snapshot(vec![pool(1, Some(3))]);
        assert!(change_lines(Some(&before), &before).is_empty());
        assert_eq!(change_lines(None, &before), snapshot_lines(&before));
        let mut after = snapshot(vec![pool(2, None)]);
        after.catalog_revision = Some(4);
        after.counters.faults.insert(
            (
                Plane::Filter,
                crate::FaultKind::Reason(kvrelay_core::wire::RelayErrorReason::ProducerChanged),
            ),
            1,
        );
        let lines = change_lines(Some(&before), &after);
        assert!(lines[0].starts_with("catalog relay=0000000000000011/0000000000001234 revision=4"));
        assert!(lines[1].starts_with("~ producer ") && lines[1].ends_with("gen=1 -> gen=2"));
        assert!(lines[2].contains("filter=connecting seq=-"));
        assert_eq!(lines[3], "fault filter RELAY_ERROR_REASON_PRODUCER_CHANGED count=1");
        assert_eq!(lines.len(), 4);
        let withdrawn = change_lines(Some(&after), &snapshot(Vec::new()));
        assert!(withdrawn.iter().any(|line| line.starts_with("- pool ")));
    }

    #[test]
    fn load_with_incomplete_coverage_renders_unknowns() {
        let load = PoolLoad {
            producer: pool(1, None).producer,
            kv_used_blocks: None,
            total_kv_blocks: Some(16384),
            kv_observed_ranks: 0,
            kv_expected_ranks: 1,
        };
        assert!(load_line(&load).ends_with("used=?/16384 ranks=0/1"));
    }

    #[test]
    fn answers_render_best_first_or_say_nothing_serves() {
        assert_eq!(answer_lines("x", &[]), ["no catalogued pool serves model x"]);
        let state = pool(1, None);
        let answer = QueryAnswer {
            producer: state.producer,
            endpoint: state.descriptor.serving_endpoint.clone(),
            canonical_model_id: "tiny-lora".into(),
            lora_adapter: Some("adapter-a".into()),
            query_semantics: state.descriptor.query_semantics,
            matched_blocks: 0,
            total_blocks: 4,
            replica_ready: false,
        };
        let lines = answer_lines("tiny-lora", &[answer]);
        assert!(lines[0].starts_with("#1 pool "));
        assert!(lines[0].ends_with(
            "model=tiny-lora salt=adapter-a hash=standard/16 matched=0/4 blocks (no replica yet)"
        ));
    }
}
