//! Serialization of discovery outputs for snapshots and diagnostics.
//!
//! Several shared value types (endpoint paths, domains, runtime configs, worker types) carry no
//! serde implementation of their own, so this module renders them through small borrowed
//! mirrors. The rendering is stable and contains no random or wall-clock values; it is an
//! output format for humans and snapshot tests, not a wire format.

use std::collections::BTreeMap;
use std::fmt;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use crate::inputs::{CardInstanceId, ModelTypeFlags, RuntimeConfig, WorkerType};
use crate::model::hashing::HashFormat;
use crate::model::identity::{EndpointPath, IdentitySource, IndexerDomainId};

/// Serializes any `Display` value as a string.
pub(super) struct Displayed<'a, T: fmt::Display>(pub(super) &'a T);

impl<T: fmt::Display> Serialize for Displayed<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self.0)
    }
}

/// Serializes a card's discovery identity as `{endpoint, instance_id, model_suffix?}`.
pub(super) struct CardId<'a>(pub(super) &'a CardInstanceId);

impl Serialize for CardId<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Repr<'a> {
            endpoint: Displayed<'a, EndpointPath>,
            instance_id: u64,
            #[serde(skip_serializing_if = "Option::is_none")]
            model_suffix: Option<&'a str>,
        }
        Repr {
            endpoint: Displayed(&self.0.endpoint),
            instance_id: self.0.instance_id,
            model_suffix: self.0.model_suffix.as_deref(),
        }
        .serialize(serializer)
    }
}

pub(super) fn endpoint<S: Serializer>(
    endpoint: &EndpointPath,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_str(endpoint)
}

fn source_name(source: IdentitySource) -> &'static str {
    match source {
        IdentitySource::DefaultDerived => "default_derived",
        IdentitySource::Explicit => "explicit",
    }
}

pub(super) fn domain<S: Serializer>(
    domain: &Option<IndexerDomainId>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Repr {
        cache_semantics: String,
        cache_semantics_source: &'static str,
        routing_scope: String,
        routing_scope_source: &'static str,
    }
    let repr = domain.as_ref().map(|domain| Repr {
        cache_semantics: domain.cache_semantics.to_string(),
        cache_semantics_source: source_name(domain.cache_semantics.source),
        routing_scope: domain.routing_scope.to_string(),
        routing_scope_source: source_name(domain.routing_scope.source),
    });
    repr.serialize(serializer)
}

pub(super) fn hash_format<S: Serializer>(
    format: &HashFormat,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(match format {
        HashFormat::StandardV1 => "DYNAMO_STANDARD_V1",
        HashFormat::EagleV1 => "DYNAMO_EAGLE_V1",
    })
}

fn worker_type_name(worker_type: WorkerType) -> &'static str {
    match worker_type {
        WorkerType::Prefill => "prefill",
        WorkerType::Decode => "decode",
        WorkerType::Encode => "encode",
        WorkerType::Aggregated => "aggregated",
    }
}

pub(super) fn worker_type<S: Serializer>(
    worker_type: &Option<WorkerType>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match worker_type {
        Some(worker_type) => serializer.serialize_some(worker_type_name(*worker_type)),
        None => serializer.serialize_none(),
    }
}

pub(super) fn needs<S: Serializer>(
    needs: &[Vec<WorkerType>],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let mut outer = serializer.serialize_seq(Some(needs.len()))?;
    for alternative in needs {
        let names: Vec<&str> = alternative.iter().copied().map(worker_type_name).collect();
        outer.serialize_element(&names)?;
    }
    outer.end()
}

/// Flag names of `model_type`, in bit order, as the card JSON spells them.
const MODEL_TYPE_NAMES: [(u32, &str); 11] = [
    (ModelTypeFlags::CHAT, "Chat"),
    (ModelTypeFlags::COMPLETIONS, "Completions"),
    (ModelTypeFlags::EMBEDDING, "Embedding"),
    (ModelTypeFlags::TENSOR_BASED, "TensorBased"),
    (ModelTypeFlags::PREFILL, "Prefill"),
    (ModelTypeFlags::IMAGES, "Images"),
    (ModelTypeFlags::AUDIOS, "Audios"),
    (ModelTypeFlags::VIDEOS, "Videos"),
    (ModelTypeFlags::REALTIME, "Realtime"),
    (ModelTypeFlags::CLASSIFY, "Classify"),
    (ModelTypeFlags::POOLING, "Pooling"),
];

/// Renders `model_type` as its flag names (unknown bits as one hex value), e.g. `["Chat"]`.
pub(super) fn model_type<S: Serializer>(
    model_type: &ModelTypeFlags,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let mut names: Vec<String> = Vec::new();
    let mut known_bits = 0u32;
    for (bit, name) in MODEL_TYPE_NAMES {
        known_bits |= bit;
        if model_type.0 & bit != 0 {
            names.push(name.to_owned());
        }
    }
    let unknown_bits = model_type.0 & !known_bits;
    if unknown_bits != 0 {
        names.push(format!("{unknown_bits:#x}"));
    }
    names.serialize(serializer)
}

pub(super) fn runtime_configs<S: Serializer>(
    configs: &BTreeMap<u64, RuntimeConfig>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Repr<'a> {
        total_kv_blocks: Option<u64>,
        data_parallel_start_rank: u32,
        data_parallel_size: u32,
        enable_local_indexer: bool,
        kv_state_endpoint: Option<Displayed<'a, EndpointPath>>,
        enable_eagle: bool,
        max_num_batched_tokens: Option<u64>,
        context_length: Option<u64>,
        taints_json: Option<&'a str>,
    }
    let mut map = serializer.serialize_map(Some(configs.len()))?;
    for (worker_id, config) in configs {
        let repr = Repr {
            total_kv_blocks: config.total_kv_blocks,
            data_parallel_start_rank: config.data_parallel_start_rank,
            data_parallel_size: config.data_parallel_size,
            enable_local_indexer: config.enable_local_indexer,
            kv_state_endpoint: config.kv_state_endpoint.as_ref().map(Displayed),
            enable_eagle: config.enable_eagle,
            max_num_batched_tokens: config.max_num_batched_tokens,
            context_length: config.context_length,
            taints_json: config.taints_json.as_deref(),
        };
        map.serialize_entry(worker_id, &repr)?;
    }
    map.end()
}
