//! Typed DC facts (dc-inputs §1–§6): the domain values that decoders produce.
//!
//! These types carry no wire details (serde names, MessagePack shapes); decoders map the wire
//! forms onto them and reject what cannot be represented.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use crate::model::identity::{EndpointPath, IndexerIdentitySpec};
use crate::model::kv_events::{RouterEvent, SourceKey};

/// A worker's processing stage. A card without one is a legacy card.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WorkerType {
    /// Prefill-only worker.
    Prefill,
    /// Decode-only worker.
    Decode,
    /// Encoder (multimodal) worker.
    Encode,
    /// Prefill and decode in one worker.
    Aggregated,
}

/// The OpenAI surfaces a card serves (`model_type` bitflags).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct ModelTypeFlags(pub u32);

impl ModelTypeFlags {
    /// Chat completions.
    pub const CHAT: u32 = 1;
    /// Text completions.
    pub const COMPLETIONS: u32 = 2;
    /// Embeddings.
    pub const EMBEDDING: u32 = 4;
    /// Tensor-based.
    pub const TENSOR_BASED: u32 = 8;
    /// Legacy prefill marker.
    pub const PREFILL: u32 = 16;
    /// Images.
    pub const IMAGES: u32 = 32;
    /// Audio.
    pub const AUDIOS: u32 = 64;
    /// Videos.
    pub const VIDEOS: u32 = 128;
    /// Realtime.
    pub const REALTIME: u32 = 256;
    /// Classification.
    pub const CLASSIFY: u32 = 512;
    /// Pooling.
    pub const POOLING: u32 = 1024;

    /// Whether the legacy prefill marker is set.
    #[must_use]
    pub fn supports_prefill(self) -> bool {
        self.0 & Self::PREFILL != 0
    }
}

/// How a card takes its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ModelInput {
    /// Text prompts.
    Text,
    /// Token ids.
    Tokens,
    /// Tensors.
    Tensor,
}

/// LoRA adapter metadata of an adapter card.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LoraInfo {
    /// Runtime adapter name: the salt of the adapter's block hashes.
    pub name: String,
    /// Adapter slots on the worker, if advertised.
    pub max_gpu_lora_count: Option<u32>,
}

/// The runtime facts of a card that matter to the relay.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// KV capacity per DP rank; `Some(0)` is the "unknown" sentinel.
    pub total_kv_blocks: Option<u64>,
    /// First DP rank the worker owns.
    pub data_parallel_start_rank: u32,
    /// Number of DP ranks the worker owns.
    pub data_parallel_size: u32,
    /// Whether the worker keeps a local indexer and answers recovery queries.
    pub enable_local_indexer: bool,
    /// Endpoint whose KV event sources describe this worker; `None` means the serving endpoint.
    pub kv_state_endpoint: Option<EndpointPath>,
    /// Eagle hash windows.
    pub enable_eagle: bool,
    /// Largest batch in tokens, if advertised.
    pub max_num_batched_tokens: Option<u64>,
    /// Context length, if advertised.
    pub context_length: Option<u64>,
    /// Routing taints as canonical JSON text (the only mutable part of a card).
    pub taints_json: Option<String>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            total_kv_blocks: None,
            data_parallel_start_rank: 0,
            data_parallel_size: 1,
            enable_local_indexer: true,
            kv_state_endpoint: None,
            enable_eagle: false,
            max_num_batched_tokens: None,
            context_length: None,
            taints_json: None,
        }
    }
}

/// A model deployment card, as far as routing is concerned.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelCard {
    /// Request-facing model name.
    pub display_name: String,
    /// Extra request-facing names.
    pub aliases: Vec<String>,
    /// Model source path (base model path for adapter cards); `None` falls back to the name.
    pub source_path: Option<String>,
    /// Served surfaces.
    pub model_type: ModelTypeFlags,
    /// Input kind, if given.
    pub model_input: Option<ModelInput>,
    /// Tokens per KV block.
    pub kv_cache_block_size: u32,
    /// Stage; `None` for legacy cards.
    pub worker_type: Option<WorkerType>,
    /// Peer roles needed, as an OR of AND-sets.
    pub needs: Vec<Vec<WorkerType>>,
    /// Adapter metadata (adapter cards only).
    pub lora: Option<LoraInfo>,
    /// Explicit indexer identity material.
    pub indexer_identity: Option<IndexerIdentitySpec>,
    /// Runtime facts.
    pub runtime_config: RuntimeConfig,
}

impl ModelCard {
    /// The default cache-semantics input: the source path, else the display name.
    #[must_use]
    pub fn source_path(&self) -> &str {
        self.source_path.as_deref().unwrap_or(&self.display_name)
    }
}

/// Discovery identity of one card: endpoint, worker instance and (for adapters) suffix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CardInstanceId {
    /// The serving endpoint.
    pub endpoint: EndpointPath,
    /// The worker's instance id (its `worker_id` in KV events).
    pub instance_id: u64,
    /// Adapter cards carry the slug of their adapter name.
    pub model_suffix: Option<String>,
}

impl CardInstanceId {
    /// Bytes of the id's texts (endpoint segments and adapter suffix).
    #[must_use]
    pub fn text_bytes(&self) -> usize {
        self.endpoint.text_bytes() + self.model_suffix.as_ref().map_or(0, String::len)
    }
}

/// The live worker set of one endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EndpointInstances {
    /// The endpoint.
    pub endpoint: EndpointPath,
    /// `None` until the first listing arrived (not yet authoritative); `Some(empty)` is an
    /// authoritative "no live worker".
    pub live_workers: Option<BTreeSet<u64>>,
}

/// Transport of a worker's request-plane endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RequestPlaneTransport {
    /// Dynamo's TCP request plane: `host:port/<path>`.
    Tcp(String),
    /// NATS request plane: subject.
    NatsTcp(String),
}

/// Where to send recovery queries for one publisher incarnation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RecoveryTarget {
    /// The recovery endpoint (`worker_kv_query_source_<publisher hex>` on the worker's component).
    pub endpoint: EndpointPath,
    /// The worker instance serving it.
    pub instance_id: u64,
    /// How to reach it.
    pub transport: RequestPlaneTransport,
}

/// One publisher incarnation's advertisement of a KV event source.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct KvEventSourceAdvert {
    /// Endpoint whose KV state the events describe.
    pub kv_state_endpoint: EndpointPath,
    /// The `(worker_id, dp_rank)` it publishes for.
    pub source: SourceKey,
    /// Random id of this publisher incarnation.
    pub publisher_id: u64,
    /// Present when the worker answers recovery queries.
    pub recovery_target: Option<RecoveryTarget>,
}

/// One event-plane message on `kv-events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// The endpoint scope the message was published on.
    pub endpoint: EndpointPath,
    /// The publishing incarnation.
    pub publisher_id: u64,
    /// Per-publisher message counter from 0.
    pub sequence: u64,
    /// Publisher wall clock, unix ms.
    pub published_at_ms: u64,
    /// The events, in order.
    pub events: Vec<RouterEvent>,
}

/// One `kv_metrics` report (`ActiveLoad`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoadObservation {
    /// The reporting rank.
    pub source: SourceKey,
    /// Occupied KV blocks; only worker reports carry it.
    pub kv_used_blocks: Option<u64>,
    /// Router-side decode blocks (advisory).
    pub active_decode_blocks: Option<u64>,
    /// Router-side prefill tokens (advisory).
    pub active_prefill_tokens: Option<u64>,
}

/// Every fact the relay can learn about its DC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DcInput {
    /// A card was added or replaced.
    CardUpserted {
        /// Its discovery identity.
        id: CardInstanceId,
        /// The card.
        card: Box<ModelCard>,
    },
    /// A card was removed.
    CardRemoved {
        /// Its discovery identity.
        id: CardInstanceId,
    },
    /// A known card's taints changed (unknown ids are ignored).
    CardTaintsUpdated {
        /// Its discovery identity.
        id: CardInstanceId,
        /// The new taints as canonical JSON text.
        taints_json: Option<String>,
    },
    /// The complete card set after a (re)listing: replaces every known card.
    CardsListed {
        /// Every card in scope.
        cards: Vec<(CardInstanceId, ModelCard)>,
    },
    /// An endpoint's live worker set changed.
    Instances(EndpointInstances),
    /// A publisher incarnation advertised a KV event source.
    SourceAdvertised(KvEventSourceAdvert),
    /// A publisher incarnation's advertisement went away.
    SourceWithdrawn {
        /// Endpoint scope of the advertisement.
        kv_state_endpoint: EndpointPath,
        /// The incarnation.
        publisher_id: u64,
    },
    /// A batch of KV events from one publisher.
    KvEvents(KvEventBatch),
    /// A load report on an endpoint's `kv_metrics` subject.
    Load {
        /// The serving endpoint the report was published on.
        endpoint: EndpointPath,
        /// The report.
        observation: LoadObservation,
    },
}
