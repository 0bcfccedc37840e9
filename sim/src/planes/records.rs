//! The discovery registrations of the simulated DC as the key/value JSON documents a Dynamo
//! worker writes (dc-inputs §1.3, §3.1): one `Model` record per card, one `Endpoint` record per
//! live instance, one `EventSource` record per advertised KV publisher.
//!
//! The records are derived from the workload model's typed discovery facts, so the DC model
//! stays the one source of truth; the relay host reads them back with the production
//! [`RecordDiffer`](kvrelay::discovery_plane::RecordDiffer). Every record is attached to the
//! lease of the worker process that wrote it (its instance id, as with etcd).

use std::collections::BTreeMap;

use kvrelay_core::inputs::{
    CardInstanceId, DcInput, DiscoveryKey, EventRecordKey, KV_EVENTS_TOPIC, KvEventSourceAdvert,
    ModelCard, ModelInput, RecoveryTarget, RequestPlaneTransport,
};
use kvrelay_core::model::identity::EndpointPath;
use serde_json::{Map, Value, json};

/// One registration: the JSON document and the lease (worker instance id) it lives under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The JSON document.
    pub value: Vec<u8>,
    /// The owning lease.
    pub lease: u64,
}

/// Every registration the discovery facts describe, by logical key (`v1/...`, etcd spelling).
/// Facts that are not registrations (events, withdrawals, removals) are ignored: a complete
/// listing of facts describes the complete store.
#[must_use]
pub fn registrations(facts: &[DcInput]) -> BTreeMap<String, Registration> {
    let mut out = BTreeMap::new();
    for fact in facts {
        match fact {
            DcInput::CardUpserted { id, card } => {
                let key = DiscoveryKey::Model(id.clone()).key_path();
                out.insert(key, registration(model_record(id, card), id.instance_id));
            }
            DcInput::CardsListed { cards } => {
                for (id, card) in cards {
                    let key = DiscoveryKey::Model(id.clone()).key_path();
                    out.insert(key, registration(model_record(id, card), id.instance_id));
                }
            }
            DcInput::SourceAdvertised(advert) => {
                let key = DiscoveryKey::EventSource(EventRecordKey {
                    scope: advert.kv_state_endpoint.clone(),
                    topic: KV_EVENTS_TOPIC.to_owned(),
                    publisher_id: advert.publisher_id,
                })
                .key_path();
                out.insert(key, registration(event_source_record(advert), advert.source.worker_id));
            }
            DcInput::Instances(instances) => {
                for instance in instances.live_workers.iter().flatten() {
                    let key = DiscoveryKey::Instance {
                        endpoint: instances.endpoint.clone(),
                        instance_id: *instance,
                    }
                    .key_path();
                    let record = endpoint_record(&instances.endpoint, *instance);
                    out.insert(key, registration(record, *instance));
                }
            }
            _ => {}
        }
    }
    out
}

fn registration(value: Value, lease: u64) -> Registration {
    Registration { value: value.to_string().into_bytes(), lease }
}

fn endpoint_json(endpoint: &EndpointPath) -> Value {
    json!({
        "namespace": endpoint.namespace(),
        "component": endpoint.component(),
        "name": endpoint.endpoint(),
    })
}

fn transport_json(transport: &RequestPlaneTransport) -> Value {
    match transport {
        RequestPlaneTransport::Tcp(address) => json!({ "tcp": address }),
        RequestPlaneTransport::NatsTcp(subject) => json!({ "nats_tcp": subject }),
    }
}

/// The request-plane address a simulated worker registers (answered by the planes host).
fn worker_address(instance_id: u64) -> String {
    format!("sim-worker-{instance_id:x}:0")
}

fn endpoint_record(endpoint: &EndpointPath, instance_id: u64) -> Value {
    json!({
        "type": "Endpoint",
        "namespace": endpoint.namespace(),
        "component": endpoint.component(),
        "endpoint": endpoint.endpoint(),
        "instance_id": instance_id,
        "transport": { "tcp": worker_address(instance_id) },
        "request_plane_codec": "msgpack",
    })
}

fn instance_json(target: &RecoveryTarget) -> Value {
    json!({
        "namespace": target.endpoint.namespace(),
        "component": target.endpoint.component(),
        "endpoint": target.endpoint.endpoint(),
        "instance_id": target.instance_id,
        "transport": transport_json(&target.transport),
    })
}

fn event_source_record(advert: &KvEventSourceAdvert) -> Value {
    let mut metadata = json!({
        "kv_state_endpoint": endpoint_json(&advert.kv_state_endpoint),
        "worker": { "worker_id": advert.source.worker_id, "dp_rank": advert.source.dp_rank },
        "publisher_id": advert.publisher_id,
    });
    if let (Some(target), Value::Object(map)) = (&advert.recovery_target, &mut metadata) {
        map.insert("recovery_target".into(), instance_json(target));
    }
    json!({
        "type": "EventSource",
        "scope": { "kind": "endpoint", "endpoint": endpoint_json(&advert.kv_state_endpoint) },
        "topic": KV_EVENTS_TOPIC,
        "publisher_id": advert.publisher_id,
        "metadata": metadata,
    })
}

fn model_record(id: &CardInstanceId, card: &ModelCard) -> Value {
    let mut record = json!({
        "type": "Model",
        "namespace": id.endpoint.namespace(),
        "component": id.endpoint.component(),
        "endpoint": id.endpoint.endpoint(),
        "instance_id": id.instance_id,
        "card_json": card_json(card),
    });
    if let (Some(suffix), Value::Object(map)) = (&id.model_suffix, &mut record) {
        map.insert("model_suffix".into(), json!(suffix));
    }
    record
}

/// The card as a worker serializes it (only the fields the relay reads, plus `slug`).
fn card_json(card: &ModelCard) -> Value {
    let mut out = Map::new();
    out.insert("display_name".into(), json!(card.display_name));
    out.insert("slug".into(), json!(kvrelay_core::discovery::slugify(&card.display_name)));
    if !card.aliases.is_empty() {
        out.insert("aliases".into(), json!(card.aliases));
    }
    if let Some(source_path) = &card.source_path {
        out.insert("source_path".into(), json!(source_path));
    }
    out.insert("model_type".into(), json!(card.model_type.to_wire_string()));
    if let Some(input) = card.model_input {
        let name = match input {
            ModelInput::Text => "Text",
            ModelInput::Tokens => "Tokens",
            ModelInput::Tensor => "Tensor",
        };
        out.insert("model_input".into(), json!(name));
    }
    out.insert("kv_cache_block_size".into(), json!(card.kv_cache_block_size));
    if let Some(worker_type) = card.worker_type {
        out.insert("worker_type".into(), json!(worker_type.wire_name()));
    }
    let needs: Vec<Vec<&str>> = card
        .needs
        .iter()
        .map(|roles| roles.iter().map(|role| role.wire_name()).collect())
        .collect();
    out.insert("needs".into(), json!(needs));
    if let Some(lora) = &card.lora {
        let mut value = json!({ "name": lora.name });
        if let (Some(count), Value::Object(map)) = (lora.max_gpu_lora_count, &mut value) {
            map.insert("max_gpu_lora_count".into(), json!(count));
        }
        out.insert("lora".into(), value);
    }
    if let Some(identity) = &card.indexer_identity {
        out.insert("indexer_identity".into(), json!(identity));
    }
    let runtime = &card.runtime_config;
    let mut config = Map::new();
    if let Some(total) = runtime.total_kv_blocks {
        config.insert("total_kv_blocks".into(), json!(total));
    }
    config.insert("data_parallel_start_rank".into(), json!(runtime.data_parallel_start_rank));
    config.insert("data_parallel_size".into(), json!(runtime.data_parallel_size));
    config.insert("enable_local_indexer".into(), json!(runtime.enable_local_indexer));
    config.insert("kv_event_publishing_enabled".into(), json!(true));
    if let Some(endpoint) = &runtime.kv_state_endpoint {
        config.insert("kv_state_endpoint".into(), endpoint_json(endpoint));
    }
    config.insert("enable_eagle".into(), json!(runtime.enable_eagle));
    if let Some(tokens) = runtime.max_num_batched_tokens {
        config.insert("max_num_batched_tokens".into(), json!(tokens));
    }
    if let Some(length) = runtime.context_length {
        config.insert("context_length".into(), json!(length));
    }
    if let Some(taints) = &runtime.taints_json
        && let Ok(value) = serde_json::from_str::<Value>(taints)
    {
        config.insert("taints".into(), value);
    }
    out.insert("runtime_config".into(), Value::Object(config));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use kvrelay_core::inputs::{DiscoveryRecord, decode_discovery_record};
    use kvrelay_core::rng::rng_from_seed;
    use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};

    use super::*;

    #[test]
    fn every_registration_decodes_back_to_the_fact_it_came_from() {
        let mut rng = rng_from_seed(7);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        dc.load_adapter(4, "adapter-c");
        let facts = dc.discovery_facts();
        let records = registrations(&facts);
        let mut cards = 0;
        let mut sources = 0;
        let mut instances = 0;
        for (key, registration) in &records {
            let record = decode_discovery_record(&registration.value).expect("decodes");
            assert_eq!(&record.key().key_path(), key);
            match record {
                DiscoveryRecord::Model(model) => {
                    cards += 1;
                    assert!(facts.iter().any(|fact| matches!(fact,
                        DcInput::CardUpserted { id, card } if *id == model.id && **card == model.card)));
                    assert_eq!(registration.lease, model.id.instance_id);
                }
                DiscoveryRecord::EventSource(source) => {
                    sources += 1;
                    let advert = source.advert.expect("a kv-events source");
                    assert!(facts.contains(&DcInput::SourceAdvertised(advert)));
                }
                DiscoveryRecord::Endpoint(endpoint) => {
                    instances += 1;
                    assert_eq!(registration.lease, endpoint.instance_id);
                }
                DiscoveryRecord::EventChannel(_) => panic!("no channels are written"),
            }
        }
        let card_facts = facts.iter().filter(|f| matches!(f, DcInput::CardUpserted { .. })).count();
        let advert_facts =
            facts.iter().filter(|f| matches!(f, DcInput::SourceAdvertised(_))).count();
        assert_eq!((cards, sources, instances), (card_facts, advert_facts, 5));
    }
}
