//! JSON for the consumer CLIs' `--json` mode (`watch`, `query`, `kvrelay-compare`): one JSON
//! object per output line, each with a `type` field. Pure, and deterministic like
//! [`super::render`]: the same state renders the same object. Identifiers render through their
//! `Display` forms (pool ids, endpoints), incarnations as 16 hex digits, roles and readiness
//! states by their wire names without prefix.

use serde_json::{Value, json};

use super::policy::Plane;
use super::query::QueryAnswer;
use super::render::{hash_format_name, role_name, state_name};
use super::state::{ConsumerSnapshot, PoolReplicaState};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, WorkerRole};
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::readiness::topology::TopologyEntry;
use kvrelay_core::wire::PoolLoad;

fn roles<'a>(roles: impl IntoIterator<Item = &'a WorkerRole>) -> Value {
    roles.into_iter().map(|role| role_name(*role)).collect()
}

fn producer(producer: &ProducerIdentity) -> Value {
    json!({
        "poolId": producer.pool_id().to_string(),
        "layoutGeneration": producer.layout_generation(),
        "incarnation": format!("{:016x}", producer.producer_incarnation()),
    })
}

fn registration(registration: &ModelRegistration) -> Value {
    let lora = match &registration.target {
        ModelTarget::Lora { base_model, adapter } => {
            json!({"baseModel": base_model, "adapter": adapter})
        }
        _ => Value::Null,
    };
    json!({
        "canonicalModelId": registration.canonical_model_id,
        "lora": lora,
        "aliases": registration.aliases,
    })
}

fn pool(pool: &PoolReplicaState) -> Value {
    let descriptor = &pool.descriptor;
    json!({
        "producer": producer(&pool.producer),
        "endpoint": descriptor.serving_endpoint.to_string(),
        "roles": roles(&descriptor.pool_roles),
        "blockSize": descriptor.query_semantics.kv_block_size,
        "hashFormat": hash_format_name(descriptor.query_semantics.hash_format),
        "models": descriptor.registrations.iter().map(registration).collect::<Vec<_>>(),
        "filter": pool.status.name(),
        "sequence": pool.sequence,
        "residentSlots": pool.resident_slots,
    })
}

fn readiness(entry: &TopologyEntry) -> Value {
    let adapters: Vec<Value> = entry
        .adapters
        .iter()
        .map(|adapter| {
            json!({"canonicalModelId": adapter.canonical_model_id, "state": state_name(adapter.state)})
        })
        .collect();
    json!({
        "namespace": entry.namespace,
        "canonicalModelId": entry.canonical_model_id,
        "state": state_name(entry.state),
        "presentRoles": roles(&entry.present_roles),
        "missingRoles": roles(&entry.missing_roles),
        "members": entry.members.len(),
        "legacyFallback": entry.legacy_fallback_active,
        "adapters": adapters,
    })
}

fn load(load: &PoolLoad) -> Value {
    json!({
        "producer": producer(&load.producer),
        "kvUsedBlocks": load.kv_used_blocks,
        "totalKvBlocks": load.total_kv_blocks,
        "observedRanks": load.kv_observed_ranks,
        "expectedRanks": load.kv_expected_ranks,
    })
}

/// The whole snapshot as one object of type `snapshot`.
#[must_use]
pub fn snapshot_json(snapshot: &ConsumerSnapshot) -> Value {
    let relay = snapshot.relay.map(|relay| {
        json!({
            "drtInstanceId": format!("{:016x}", relay.drt_instance_id),
            "relayIncarnation": format!("{:016x}", relay.relay_incarnation),
        })
    });
    let streams: serde_json::Map<String, Value> = [Plane::Catalog, Plane::Readiness, Plane::Load]
        .into_iter()
        .map(|plane| (plane.to_string(), Value::from(snapshot.plane(plane).name())))
        .collect();
    let counters = &snapshot.counters;
    let faults: Vec<Value> = counters
        .faults
        .iter()
        .map(|((plane, kind), count)| {
            json!({"plane": plane.to_string(), "kind": kind.to_string(), "count": count})
        })
        .collect();
    json!({
        "type": "snapshot",
        "relay": relay,
        "catalogRevision": snapshot.catalog_revision,
        "streams": streams,
        "pools": snapshot.pools.iter().map(pool).collect::<Vec<_>>(),
        "quarantined": snapshot
            .quarantined_pools
            .iter()
            .map(|entry| json!({"pool": entry.key.to_string(), "error": entry.error.to_string()}))
            .collect::<Vec<_>>(),
        "readinessRevision": snapshot.readiness_revision,
        "readiness": snapshot.readiness.iter().map(readiness).collect::<Vec<_>>(),
        "loadWindow": snapshot.load_window,
        "load": snapshot.load.iter().map(load).collect::<Vec<_>>(),
        "counters": {
            "subscriptions": counters.subscriptions,
            "resubscribes": counters.resubscribes,
            "installs": counters.installs,
            "deltasApplied": counters.deltas_applied,
            "heartbeatsConfirmed": counters.heartbeats_confirmed,
            "replicasDropped": counters.replicas_dropped,
            "producerChanges": counters.producer_changes,
            "faults": faults,
        },
        "halted": snapshot.halted.as_ref().map(|halt| {
            json!({"plane": halt.plane.to_string(), "cause": halt.cause.to_string()})
        }),
    })
}

/// A query's answers, best first, as one object of type `query`.
#[must_use]
pub fn answers_json(model: &str, answers: &[QueryAnswer]) -> Value {
    let answers: Vec<Value> = answers
        .iter()
        .map(|answer| {
            json!({
                "producer": producer(&answer.producer),
                "endpoint": answer.endpoint.to_string(),
                "canonicalModelId": answer.canonical_model_id,
                "loraAdapter": answer.lora_adapter,
                "hashFormat": hash_format_name(answer.query_semantics.hash_format),
                "blockSize": answer.query_semantics.kv_block_size,
                "matchedBlocks": answer.matched_blocks,
                "totalBlocks": answer.total_blocks,
                "replicaReady": answer.replica_ready,
            })
        })
        .collect();
    json!({"type": "query", "model": model, "answers": answers})
}
