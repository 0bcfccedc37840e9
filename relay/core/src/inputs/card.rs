//! Model deployment card JSON (dc-inputs §1) into [`ModelCard`].
//!
//! Decoding is two steps: serde reads the JSON into private wire structs that mirror it (unknown
//! fields ignored, `null` treated like an absent field, defaults per dc-inputs §1.2), then a
//! validating conversion turns the wire strings into typed values and bounds every list and
//! text. The conversion is strict about the vocabulary it needs: an unknown `model_type` flag,
//! `worker_type`, `needs` role or `model_input` rejects the card rather than guessing.
//!
//! Decoding is lossless with respect to the routing fields: it does not apply Dynamo's legacy
//! prefill normalization. Call [`normalize_legacy_prefill`] where readiness and roles are
//! computed, so a recorded journal keeps the card as the deployment wrote it.
//!
//! Taints are kept as canonical JSON text: the `runtime_config.taints` value re-serialized by
//! `serde_json` (object keys sorted, no insignificant whitespace, duplicate keys resolved to the
//! last occurrence). Two cards whose taints differ only in key order or spacing compare equal.

use serde::Deserialize;

use super::errors::{InputError, echo};
use super::facts::{LoraInfo, ModelCard, ModelInput, ModelTypeFlags, RuntimeConfig, WorkerType};
use super::limits::{
    ALIASES_MAX, DISCOVERY_RECORD_BYTES_MAX, NEEDS_ALTERNATIVES_MAX, NEEDS_ROLES_MAX,
    TAINTS_JSON_BYTES_MAX,
};
use super::wire::{Bounded, WireEndpoint, check_size, check_text, json};
use crate::model::identity::IndexerIdentitySpec;

/// Flag names of `model_type`, in bit order, as bitflags writes them.
const MODEL_TYPE_FLAG_NAMES: [(&str, u32); 11] = [
    ("Chat", ModelTypeFlags::CHAT),
    ("Completions", ModelTypeFlags::COMPLETIONS),
    ("Embedding", ModelTypeFlags::EMBEDDING),
    ("TensorBased", ModelTypeFlags::TENSOR_BASED),
    ("Prefill", ModelTypeFlags::PREFILL),
    ("Images", ModelTypeFlags::IMAGES),
    ("Audios", ModelTypeFlags::AUDIOS),
    ("Videos", ModelTypeFlags::VIDEOS),
    ("Realtime", ModelTypeFlags::REALTIME),
    ("Classify", ModelTypeFlags::CLASSIFY),
    ("Pooling", ModelTypeFlags::POOLING),
];

/// Decode a card from its JSON text (the `card_json` of a discovery Model record).
///
/// Rejects input over [`DISCOVERY_RECORD_BYTES_MAX`] before parsing.
pub fn decode_card_json(bytes: &[u8]) -> Result<ModelCard, InputError> {
    check_size(bytes.len(), DISCOVERY_RECORD_BYTES_MAX, "card JSON")?;
    let wire: WireCard = json(bytes, "card JSON")?;
    wire.into_card()
}

/// Parse a `model_type` string: flag names joined by `|` with optional spaces, e.g.
/// `"Chat | Completions"`, `"Prefill"`, or `""` for no surface.
pub fn parse_model_type(text: &str) -> Result<ModelTypeFlags, InputError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(ModelTypeFlags::default());
    }
    let mut bits = 0u32;
    for name in trimmed.split('|').map(str::trim) {
        let bit = MODEL_TYPE_FLAG_NAMES
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, bit)| *bit)
            .ok_or_else(|| InputError::UnknownModelTypeFlag { flag: echo(name) })?;
        bits |= bit;
    }
    Ok(ModelTypeFlags(bits))
}

/// Parse a lowercase worker type: `prefill`, `decode`, `encode` or `aggregated`.
///
/// `field` names where the value appeared, for the error.
pub fn parse_worker_type(text: &str, field: &'static str) -> Result<WorkerType, InputError> {
    match text {
        "prefill" => Ok(WorkerType::Prefill),
        "decode" => Ok(WorkerType::Decode),
        "encode" => Ok(WorkerType::Encode),
        "aggregated" => Ok(WorkerType::Aggregated),
        other => Err(InputError::UnknownWorkerType { field, value: echo(other) }),
    }
}

impl ModelTypeFlags {
    /// The wire string: known flag names in bit order joined by `" | "`; `""` when empty.
    ///
    /// Bits without a name are not written.
    #[must_use]
    pub fn to_wire_string(self) -> String {
        let names: Vec<&str> = MODEL_TYPE_FLAG_NAMES
            .iter()
            .filter(|(_, bit)| self.0 & bit != 0)
            .map(|(name, _)| *name)
            .collect();
        names.join(" | ")
    }
}

impl WorkerType {
    /// The lowercase wire name.
    #[must_use]
    pub const fn wire_name(self) -> &'static str {
        match self {
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
            WorkerType::Encode => "encode",
            WorkerType::Aggregated => "aggregated",
        }
    }
}

/// Dynamo's legacy prefill normalization (dc-inputs §1.5): a card without `worker_type` whose
/// `model_type` has the Prefill flag becomes a prefill worker, needing decode when it declares
/// no needs. Every other card is left as is. Returns whether the card was rewritten.
pub fn normalize_legacy_prefill(card: &mut ModelCard) -> bool {
    if card.worker_type.is_some() || !card.model_type.supports_prefill() {
        return false;
    }
    card.worker_type = Some(WorkerType::Prefill);
    if card.needs.is_empty() {
        card.needs = vec![vec![WorkerType::Decode]];
    }
    true
}

/// The card as JSON writes it. Only routing-relevant fields are read; `Option` everywhere a
/// field may be absent or `null`.
#[derive(Debug, Deserialize)]
pub(crate) struct WireCard {
    display_name: String,
    #[serde(default)]
    aliases: Option<Bounded<String, ALIASES_MAX>>,
    #[serde(default)]
    source_path: Option<String>,
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    model_input: Option<String>,
    /// Absent means 0, which identity derivation rejects ("block size must be nonzero").
    #[serde(default)]
    kv_cache_block_size: Option<u32>,
    #[serde(default)]
    worker_type: Option<String>,
    #[serde(default)]
    needs: Option<Bounded<Bounded<String, NEEDS_ROLES_MAX>, NEEDS_ALTERNATIVES_MAX>>,
    #[serde(default)]
    lora: Option<WireLora>,
    #[serde(default)]
    runtime_config: Option<WireRuntimeConfig>,
    #[serde(default)]
    indexer_identity: Option<IndexerIdentitySpec>,
}

#[derive(Debug, Deserialize)]
struct WireLora {
    name: String,
    #[serde(default)]
    max_gpu_lora_count: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
struct WireRuntimeConfig {
    #[serde(default)]
    total_kv_blocks: Option<u64>,
    #[serde(default)]
    data_parallel_start_rank: Option<u32>,
    #[serde(default)]
    data_parallel_size: Option<u32>,
    #[serde(default)]
    enable_local_indexer: Option<bool>,
    #[serde(default)]
    kv_state_endpoint: Option<WireEndpoint>,
    #[serde(default)]
    enable_eagle: Option<bool>,
    #[serde(default)]
    max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    context_length: Option<u64>,
    #[serde(default)]
    taints: Option<serde_json::Value>,
}

impl WireCard {
    /// Validate and convert into the domain card.
    pub(crate) fn into_card(self) -> Result<ModelCard, InputError> {
        check_text(&self.display_name, "display_name")?;
        let aliases = match self.aliases {
            Some(aliases) => aliases.into_checked("aliases")?,
            None => Vec::new(),
        };
        for alias in &aliases {
            check_text(alias, "aliases")?;
        }
        if let Some(source_path) = &self.source_path {
            check_text(source_path, "source_path")?;
        }
        let model_type = match &self.model_type {
            Some(text) => {
                check_text(text, "model_type")?;
                parse_model_type(text)?
            }
            None => ModelTypeFlags::default(),
        };
        let model_input = self.model_input.as_deref().map(parse_model_input).transpose()?;
        let worker_type = self
            .worker_type
            .as_deref()
            .map(|text| parse_worker_type(text, "worker_type"))
            .transpose()?;
        let needs = match self.needs {
            Some(alternatives) => alternatives
                .into_checked("needs alternatives")?
                .into_iter()
                .map(|roles| {
                    roles
                        .into_checked("needs roles")?
                        .iter()
                        .map(|role| parse_worker_type(role, "needs"))
                        .collect::<Result<Vec<_>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let lora = match self.lora {
            Some(lora) => {
                check_text(&lora.name, "lora.name")?;
                Some(LoraInfo { name: lora.name, max_gpu_lora_count: lora.max_gpu_lora_count })
            }
            None => None,
        };
        let runtime_config = self.runtime_config.unwrap_or_default().into_runtime_config()?;
        Ok(ModelCard {
            display_name: self.display_name,
            aliases,
            source_path: self.source_path,
            model_type,
            model_input,
            kv_cache_block_size: self.kv_cache_block_size.unwrap_or(0),
            worker_type,
            needs,
            lora,
            indexer_identity: self.indexer_identity,
            runtime_config,
        })
    }
}

impl WireRuntimeConfig {
    fn into_runtime_config(self) -> Result<RuntimeConfig, InputError> {
        let defaults = RuntimeConfig::default();
        let data_parallel_start_rank =
            self.data_parallel_start_rank.unwrap_or(defaults.data_parallel_start_rank);
        let data_parallel_size = self.data_parallel_size.unwrap_or(defaults.data_parallel_size);
        // Ranks are [start, start + size): the end must still be a representable rank bound.
        if data_parallel_start_rank.checked_add(data_parallel_size).is_none() {
            return Err(InputError::InvalidField {
                field: "runtime_config.data_parallel_size",
                reason: "start rank + size exceeds the u32 rank space",
            });
        }
        let kv_state_endpoint = self
            .kv_state_endpoint
            .map(|endpoint| endpoint.into_path("runtime_config.kv_state_endpoint"))
            .transpose()?;
        let taints_json = match self.taints {
            None | Some(serde_json::Value::Null) => None,
            Some(value) => {
                let text = value.to_string();
                check_size(text.len(), TAINTS_JSON_BYTES_MAX, "runtime_config.taints")?;
                Some(text)
            }
        };
        Ok(RuntimeConfig {
            total_kv_blocks: self.total_kv_blocks,
            data_parallel_start_rank,
            data_parallel_size,
            enable_local_indexer: self
                .enable_local_indexer
                .unwrap_or(defaults.enable_local_indexer),
            kv_state_endpoint,
            enable_eagle: self.enable_eagle.unwrap_or(defaults.enable_eagle),
            max_num_batched_tokens: self.max_num_batched_tokens,
            context_length: self.context_length,
            taints_json,
        })
    }
}

fn parse_model_input(text: &str) -> Result<ModelInput, InputError> {
    match text {
        "Text" => Ok(ModelInput::Text),
        "Tokens" => Ok(ModelInput::Tokens),
        "Tensor" => Ok(ModelInput::Tensor),
        other => Err(InputError::UnknownModelInput { value: echo(other) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::limits::TEXT_BYTES_MAX;
    use crate::inputs::test_fixtures::{ADAPTER_CARD_JSON, AGGREGATED_CARD_JSON};
    use crate::model::identity::EndpointPath;

    fn card(json: &str) -> Result<ModelCard, InputError> {
        decode_card_json(json.as_bytes())
    }

    /// A minimal valid card with `extra` fields spliced in.
    fn card_with(extra: &str) -> Result<ModelCard, InputError> {
        card(&format!(r#"{{"display_name":"m","kv_cache_block_size":16{extra}}}"#))
    }

    #[test]
    fn aggregated_card_sample_decodes_with_its_runtime_config() {
        let decoded = card(AGGREGATED_CARD_JSON).unwrap();
        assert_eq!(decoded.display_name, "tiny-llm");
        assert_eq!(decoded.source_path.as_deref(), Some("/tmp/dynlive/models/tiny-llm"));
        assert_eq!(decoded.kv_cache_block_size, 16);
        assert_eq!(
            decoded.model_type,
            ModelTypeFlags(ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS)
        );
        assert_eq!(decoded.model_input, Some(ModelInput::Tokens));
        assert_eq!(decoded.worker_type, Some(WorkerType::Aggregated));
        assert!(decoded.needs.is_empty());
        assert_eq!(decoded.lora, None);
        assert_eq!(decoded.indexer_identity, None);
        assert_eq!(
            decoded.runtime_config,
            RuntimeConfig {
                total_kv_blocks: Some(16384),
                data_parallel_start_rank: 0,
                data_parallel_size: 1,
                enable_local_indexer: false,
                kv_state_endpoint: None,
                enable_eagle: false,
                max_num_batched_tokens: Some(8192),
                context_length: None,
                taints_json: None,
            }
        );
    }

    #[test]
    fn adapter_card_sample_carries_its_lora_and_no_capacity() {
        let decoded = card(ADAPTER_CARD_JSON).unwrap();
        assert_eq!(decoded.display_name, "ad-1");
        assert_eq!(decoded.source_path(), "/tmp/dynlive/models/tiny-llm");
        assert_eq!(
            decoded.lora,
            Some(LoraInfo { name: "ad-1".into(), max_gpu_lora_count: Some(4) })
        );
        assert_eq!(decoded.runtime_config.total_kv_blocks, None);
        assert_eq!(decoded.runtime_config.context_length, Some(8192));
    }

    #[test]
    fn absent_or_null_runtime_fields_take_the_documented_defaults() {
        let absent = card_with("").unwrap();
        assert_eq!(absent.runtime_config, RuntimeConfig::default());
        assert_eq!(absent.runtime_config.data_parallel_size, 1);
        assert!(absent.runtime_config.enable_local_indexer);
        assert!(!absent.runtime_config.enable_eagle);
        let nulls = card_with(
            r#","runtime_config":{"data_parallel_size":null,"data_parallel_start_rank":null,
               "enable_local_indexer":null,"enable_eagle":null,"taints":null},
               "needs":null,"aliases":null,"worker_type":null,"lora":null"#,
        )
        .unwrap();
        assert_eq!(nulls, absent);
        assert_eq!(card(r#"{"display_name":"m"}"#).unwrap().kv_cache_block_size, 0);
    }

    #[test]
    fn unknown_card_fields_are_ignored() {
        let decoded = card_with(
            r#","slug":"m","tokenizer":{"kind":"x"},"user_data":{"lora_adapter":true},
               "runtime_config":{"kv_event_source_mode":"framework_v1","runtime_data":{"a":[1]}}"#,
        )
        .unwrap();
        assert_eq!(decoded.display_name, "m");
    }

    #[test]
    fn model_type_strings_parse_to_flag_bits_and_back() {
        assert_eq!(parse_model_type(""), Ok(ModelTypeFlags(0)));
        assert_eq!(parse_model_type("Prefill"), Ok(ModelTypeFlags(ModelTypeFlags::PREFILL)));
        assert_eq!(parse_model_type("Chat | Completions"), Ok(ModelTypeFlags(3)));
        assert_eq!(parse_model_type("Completions|Chat"), Ok(ModelTypeFlags(3)));
        let all = parse_model_type(
            "Chat | Completions | Embedding | TensorBased | Prefill | Images | Audios | Videos \
             | Realtime | Classify | Pooling",
        )
        .unwrap();
        assert_eq!(all, ModelTypeFlags(2047));
        assert_eq!(parse_model_type(&all.to_wire_string()), Ok(all));
        assert_eq!(ModelTypeFlags(3).to_wire_string(), "Chat | Completions");
        assert_eq!(ModelTypeFlags(0).to_wire_string(), "");
    }

    #[test]
    fn unknown_model_type_flags_reject_the_card() {
        assert_eq!(
            parse_model_type("Chat | chat"),
            Err(InputError::UnknownModelTypeFlag { flag: "chat".into() })
        );
        assert_eq!(
            parse_model_type("Chat || Completions"),
            Err(InputError::UnknownModelTypeFlag { flag: String::new() })
        );
        assert_eq!(
            card_with(r#","model_type":"Chat | Backend""#),
            Err(InputError::UnknownModelTypeFlag { flag: "Backend".into() })
        );
    }

    #[test]
    fn worker_types_and_needs_use_lowercase_role_names() {
        let decoded =
            card_with(r#","worker_type":"encode","needs":[["prefill","decode"],["aggregated"]]"#)
                .unwrap();
        assert_eq!(decoded.worker_type, Some(WorkerType::Encode));
        assert_eq!(
            decoded.needs,
            vec![vec![WorkerType::Prefill, WorkerType::Decode], vec![WorkerType::Aggregated]]
        );
        for role in
            [WorkerType::Prefill, WorkerType::Decode, WorkerType::Encode, WorkerType::Aggregated]
        {
            assert_eq!(parse_worker_type(role.wire_name(), "test"), Ok(role));
        }
    }

    #[test]
    fn unknown_worker_types_reject_the_card() {
        assert_eq!(
            card_with(r#","worker_type":"prefill|decode""#),
            Err(InputError::UnknownWorkerType {
                field: "worker_type",
                value: "prefill|decode".into()
            })
        );
        assert_eq!(
            card_with(r#","worker_type":"decode","needs":[["Prefill"]]"#),
            Err(InputError::UnknownWorkerType { field: "needs", value: "Prefill".into() })
        );
    }

    #[test]
    fn unknown_model_input_rejects_the_card() {
        assert_eq!(
            card_with(r#","model_input":"Audio""#),
            Err(InputError::UnknownModelInput { value: "Audio".into() })
        );
        for (text, input) in [
            ("Text", ModelInput::Text),
            ("Tokens", ModelInput::Tokens),
            ("Tensor", ModelInput::Tensor),
        ] {
            let extra = format!(r#","model_input":"{text}""#);
            assert_eq!(card_with(&extra).unwrap().model_input, Some(input));
        }
    }

    #[test]
    fn kv_state_endpoint_becomes_an_endpoint_path() {
        let decoded = card_with(
            r#","runtime_config":{"kv_state_endpoint":{"namespace":"ns","component":"kv","name":"state"}}"#,
        )
        .unwrap();
        assert_eq!(
            decoded.runtime_config.kv_state_endpoint,
            Some(EndpointPath::new("ns", "kv", "state").unwrap())
        );
        let error = card_with(
            r#","runtime_config":{"kv_state_endpoint":{"namespace":"","component":"kv","name":"state"}}"#,
        )
        .unwrap_err();
        assert!(matches!(
            error,
            InputError::InvalidEndpoint { field: "runtime_config.kv_state_endpoint", .. }
        ));
    }

    #[test]
    fn taints_are_kept_as_canonical_json_text() {
        let spaced = card_with(
            r#","runtime_config":{"taints":[ {"value":"b", "key":"gpu",  "effect":"NoSchedule"} ]}"#,
        )
        .unwrap();
        let compact = card_with(
            r#","runtime_config":{"taints":[{"effect":"NoSchedule","key":"gpu","value":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(
            spaced.runtime_config.taints_json.as_deref(),
            Some(r#"[{"effect":"NoSchedule","key":"gpu","value":"b"}]"#)
        );
        assert_eq!(spaced, compact);
        let empty = card_with(r#","runtime_config":{"taints":[]}"#).unwrap();
        assert_eq!(empty.runtime_config.taints_json.as_deref(), Some("[]"));
    }

    #[test]
    fn indexer_identity_is_decoded_by_the_identity_module() {
        let decoded = card_with(r#","indexer_identity":{"semantics":{"model":"m-v2"}}"#).unwrap();
        let identity = decoded.indexer_identity.unwrap();
        assert_eq!(identity.semantics.unwrap().get("model"), Some("m-v2"));
        assert_eq!(identity.routing_scope, None);
        // The identity module rejects duplicate keys even inside a card.
        let duplicate = card_with(r#","indexer_identity":{"semantics":{"a":"1","a":"2"}}"#);
        assert!(matches!(duplicate, Err(InputError::Json { what: "card JSON", .. })));
    }

    #[test]
    fn legacy_prefill_cards_are_normalized_to_prefill_needing_decode() {
        let mut legacy = card_with(r#","model_type":"Prefill""#).unwrap();
        assert!(normalize_legacy_prefill(&mut legacy));
        assert_eq!(legacy.worker_type, Some(WorkerType::Prefill));
        assert_eq!(legacy.needs, vec![vec![WorkerType::Decode]]);

        let mut with_needs =
            card_with(r#","model_type":"Prefill","needs":[["decode","encode"]]"#).unwrap();
        assert!(normalize_legacy_prefill(&mut with_needs));
        assert_eq!(with_needs.worker_type, Some(WorkerType::Prefill));
        assert_eq!(with_needs.needs, vec![vec![WorkerType::Decode, WorkerType::Encode]]);
    }

    #[test]
    fn typed_and_non_prefill_legacy_cards_are_not_normalized() {
        let mut typed = card_with(r#","model_type":"Prefill","worker_type":"decode""#).unwrap();
        let before = typed.clone();
        assert!(!normalize_legacy_prefill(&mut typed));
        assert_eq!(typed, before);
        let mut legacy_chat = card_with(r#","model_type":"Chat | Completions""#).unwrap();
        assert!(!normalize_legacy_prefill(&mut legacy_chat));
        assert_eq!(legacy_chat.worker_type, None);
        assert!(legacy_chat.needs.is_empty());
    }

    #[test]
    fn card_lists_over_their_limits_are_rejected() {
        let aliases: Vec<String> = (0..=ALIASES_MAX).map(|i| format!("\"a{i}\"")).collect();
        assert_eq!(
            card_with(&format!(r#","aliases":[{}]"#, aliases.join(","))),
            Err(InputError::TooMany { what: "aliases", count: ALIASES_MAX + 1, max: ALIASES_MAX })
        );
        let alternatives = vec![r#"["decode"]"#; NEEDS_ALTERNATIVES_MAX + 1].join(",");
        assert_eq!(
            card_with(&format!(r#","needs":[{alternatives}]"#)),
            Err(InputError::TooMany {
                what: "needs alternatives",
                count: NEEDS_ALTERNATIVES_MAX + 1,
                max: NEEDS_ALTERNATIVES_MAX
            })
        );
        let roles = [r#""decode""#; NEEDS_ROLES_MAX + 1].join(",");
        assert_eq!(
            card_with(&format!(r#","needs":[[{roles}]]"#)),
            Err(InputError::TooMany {
                what: "needs roles",
                count: NEEDS_ROLES_MAX + 1,
                max: NEEDS_ROLES_MAX
            })
        );
    }

    #[test]
    fn card_text_over_its_limit_is_rejected() {
        let long = "x".repeat(TEXT_BYTES_MAX + 1);
        assert_eq!(
            card(&format!(r#"{{"display_name":"{long}"}}"#)),
            Err(InputError::TooLarge {
                what: "display_name",
                bytes: TEXT_BYTES_MAX + 1,
                max: TEXT_BYTES_MAX
            })
        );
        assert!(matches!(
            card_with(&format!(r#","lora":{{"name":"{long}"}}"#)),
            Err(InputError::TooLarge { what: "lora.name", .. })
        ));
        let big_taints = format!(r#","runtime_config":{{"taints":["{}"]}}"#, "t".repeat(70_000));
        assert!(matches!(
            card_with(&big_taints),
            Err(InputError::TooLarge { what: "runtime_config.taints", .. })
        ));
        let oversized = vec![b' '; DISCOVERY_RECORD_BYTES_MAX + 1];
        assert_eq!(
            decode_card_json(&oversized),
            Err(InputError::TooLarge {
                what: "card JSON",
                bytes: DISCOVERY_RECORD_BYTES_MAX + 1,
                max: DISCOVERY_RECORD_BYTES_MAX
            })
        );
    }

    #[test]
    fn data_parallel_ranks_beyond_the_u32_space_are_rejected() {
        assert_eq!(
            card_with(
                r#","runtime_config":{"data_parallel_start_rank":4294967295,"data_parallel_size":2}"#
            ),
            Err(InputError::InvalidField {
                field: "runtime_config.data_parallel_size",
                reason: "start rank + size exceeds the u32 rank space",
            })
        );
        let last = card_with(
            r#","runtime_config":{"data_parallel_start_rank":4294967294,"data_parallel_size":1}"#,
        );
        assert!(last.is_ok());
    }

    #[test]
    fn malformed_card_json_is_a_json_error() {
        for text in ["", "{", "[]", r#"{"kv_cache_block_size":16}"#, r#"{"display_name":1}"#] {
            assert!(
                matches!(card(text), Err(InputError::Json { what: "card JSON", .. })),
                "{text}"
            );
        }
        // u64 values are exact; a negative block count is not a u64.
        assert!(card_with(r#","runtime_config":{"total_kv_blocks":-1}"#).is_err());
        let max = card_with(r#","runtime_config":{"total_kv_blocks":18446744073709551615}"#);
        assert_eq!(max.unwrap().runtime_config.total_kv_blocks, Some(u64::MAX));
    }
}
