//! One simulated worker: its cards, its per-rank KV event publishers and their LRU caches.
//!
//! Invariants per rank: event ids are contiguous from 1 within one publisher incarnation; a
//! stored chain's parent is a block the rank still holds; the cache is closed under prefixes
//! (only leaves are evicted), so a replay-ordered dump lists parents before children.

use std::collections::{BTreeSet, VecDeque};

use rand_core::Rng;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvrelay_core::inputs::{
    CardInstanceId, DcInput, KvEventSourceAdvert, LoadObservation, LoraInfo, ModelCard, ModelInput,
    ModelTypeFlags, RecoveryTarget, RequestPlaneTransport, RuntimeConfig, WorkerType,
};
use kvrelay_core::model::hashing::{
    ExternalBlockHash, HashFormat, block_hash_seed, local_block_hashes, sequence_hashes,
};
use kvrelay_core::model::identity::{EndpointPath, IndexerIdentitySpec};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, SourceKey, StorageTier, StoreData,
    StoredBlock,
};
use kvrelay_core::rng::RelayRng;

/// Events a rank keeps for range recovery.
pub const EVENT_HISTORY_MAX: usize = 1024;

/// A rank's block table is allocated for its whole capacity up to this many blocks (growing
/// it by rehashing was ~5% of a simulated 20-worker run); larger caches grow as they fill.
const PRESIZED_BLOCKS_MAX: usize = 1 << 16;

/// How a worker is deployed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The serving endpoint.
    pub endpoint: EndpointPath,
    /// Served model name (also its source path).
    pub model: String,
    /// Extra served names.
    pub aliases: Vec<String>,
    /// Stage; `None` for a legacy card.
    pub worker_type: Option<WorkerType>,
    /// Peer roles needed.
    pub needs: Vec<Vec<WorkerType>>,
    /// Tokens per block.
    pub block_size: u32,
    /// Data-parallel ranks.
    pub data_parallel_size: u32,
    /// Blocks each rank can hold.
    pub capacity_blocks_per_rank: usize,
    /// Whether the worker answers recovery queries.
    pub enable_local_indexer: bool,
    /// Eagle hash windows.
    pub eagle: bool,
    /// Loaded LoRA adapters (runtime names).
    pub adapters: Vec<String>,
    /// Whether the worker publishes KV events at all (encode workers do not).
    pub publishes_kv: bool,
    /// Explicit indexer identity material of the card (`None`: derived defaults).
    pub indexer_identity: Option<IndexerIdentitySpec>,
    /// The card's `model_type` (`None`: derived from the worker type). A legacy prefill worker
    /// is `worker_type: None` with the `Prefill` flag here.
    pub model_type: Option<ModelTypeFlags>,
}

impl WorkerSpec {
    /// An aggregated worker of `model` on `endpoint`.
    #[must_use]
    pub fn aggregated(endpoint: EndpointPath, model: &str) -> Self {
        WorkerSpec {
            endpoint,
            model: model.to_owned(),
            aliases: Vec::new(),
            worker_type: Some(WorkerType::Aggregated),
            needs: Vec::new(),
            block_size: 16,
            data_parallel_size: 1,
            capacity_blocks_per_rank: 4096,
            enable_local_indexer: true,
            eagle: false,
            adapters: Vec::new(),
            publishes_kv: true,
            indexer_identity: None,
            model_type: None,
        }
    }

    /// The `model_type` its cards carry.
    #[must_use]
    pub fn card_model_type(&self) -> ModelTypeFlags {
        self.model_type.unwrap_or(ModelTypeFlags(match self.worker_type {
            Some(WorkerType::Prefill) => ModelTypeFlags::PREFILL,
            Some(WorkerType::Encode) => 0,
            _ => ModelTypeFlags::CHAT | ModelTypeFlags::COMPLETIONS,
        }))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CachedBlock {
    canonical: u64,
    external: u64,
    local: u64,
    parent: Option<u64>,
    /// The last request whose chain ended at this block: for a leaf, its LRU recency.
    last_used: u64,
    inserted: u64,
    children: u32,
}

/// One rank's publisher incarnation and cache.
#[derive(Debug, Clone)]
pub struct RankCache {
    publisher_id: u64,
    next_event_id: u64,
    clock: u64,
    blocks: BlockTable,
    /// The evictable blocks (no cached child) by `(last_used, canonical)`: the LRU order.
    leaves: BTreeSet<(u64, u64)>,
    history: VecDeque<RouterEvent>,
}

impl RankCache {
    fn new(publisher_id: u64, capacity: usize) -> Self {
        RankCache {
            publisher_id,
            next_event_id: 1,
            clock: 0,
            blocks: BlockTable::for_capacity(capacity),
            leaves: BTreeSet::new(),
            history: VecDeque::new(),
        }
    }

    /// The publisher incarnation.
    #[must_use]
    pub fn publisher_id(&self) -> u64 {
        self.publisher_id
    }

    /// The newest event id published (0 before the first event).
    #[must_use]
    pub fn newest_event_id(&self) -> u64 {
        self.next_event_id - 1
    }

    /// Blocks held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the rank holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The canonical hashes held, in table order (deterministic for a given history).
    pub fn canonical_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.0.iter().map(|block| block.canonical)
    }
}

/// A rank's cached blocks by canonical hash.
///
/// Canonical hashes are xxh3 outputs, uniformly spread, so each is its own table hash; the
/// table has no random state, so its order is a function of the rank's history. Requests look
/// up blocks of their prefix, which made an ordered map the workload's hottest path.
#[derive(Debug, Clone)]
struct BlockTable(hashbrown::HashTable<CachedBlock>);

impl BlockTable {
    /// A table for a rank holding `capacity` blocks (plus the one request's chain stored before
    /// eviction), allocated up front up to [`PRESIZED_BLOCKS_MAX`].
    fn for_capacity(capacity: usize) -> Self {
        BlockTable(hashbrown::HashTable::with_capacity(
            capacity.saturating_add(1).min(PRESIZED_BLOCKS_MAX),
        ))
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn get(&self, canonical: u64) -> Option<&CachedBlock> {
        self.0.find(canonical, |block| block.canonical == canonical)
    }

    fn get_mut(&mut self, canonical: u64) -> Option<&mut CachedBlock> {
        self.0.find_mut(canonical, |block| block.canonical == canonical)
    }

    /// Insert or replace the block of `block.canonical`.
    fn insert(&mut self, block: CachedBlock) {
        match self.0.entry(block.canonical, |b| b.canonical == block.canonical, |b| b.canonical) {
            hashbrown::hash_table::Entry::Occupied(mut occupied) => *occupied.get_mut() = block,
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                vacant.insert(block);
            }
        }
    }

    fn remove(&mut self, canonical: u64) -> Option<CachedBlock> {
        match self.0.find_entry(canonical, |block| block.canonical == canonical) {
            Ok(occupied) => Some(occupied.remove().0),
            Err(_) => None,
        }
    }

    fn clear(&mut self) {
        self.0.clear();
    }

    fn values(&self) -> impl Iterator<Item = &CachedBlock> {
        self.0.iter()
    }
}

/// A simulated worker process.
#[derive(Debug, Clone)]
pub struct SimWorker {
    spec: WorkerSpec,
    worker_id: u64,
    ranks: Vec<RankCache>,
}

fn worker_event(
    worker_id: u64,
    dp_rank: u32,
    event_id: u64,
    data: KvCacheEventData,
) -> RouterEvent {
    RouterEvent {
        worker_id,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id, dp_rank, data },
    }
}

impl SimWorker {
    /// Start a worker: every rank gets a fresh publisher incarnation.
    pub fn start(spec: WorkerSpec, worker_id: u64, rng: &mut RelayRng) -> Self {
        let ranks = (0..spec.data_parallel_size.max(1))
            .map(|_| {
                RankCache::new(rng.next_u64() & ((1 << 53) - 1), spec.capacity_blocks_per_rank)
            })
            .collect();
        SimWorker { spec, worker_id, ranks }
    }

    /// Restart the process: new publisher incarnations, empty caches, event ids from 1.
    pub fn restart(&mut self, worker_id: u64, rng: &mut RelayRng) {
        *self = SimWorker::start(self.spec.clone(), worker_id, rng);
    }

    /// The worker's deployment.
    #[must_use]
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// The worker (instance) id.
    #[must_use]
    pub fn worker_id(&self) -> u64 {
        self.worker_id
    }

    /// The ranks' caches.
    #[must_use]
    pub fn ranks(&self) -> &[RankCache] {
        &self.ranks
    }

    fn hash_format(&self) -> HashFormat {
        if self.spec.eagle { HashFormat::EagleV1 } else { HashFormat::StandardV1 }
    }

    /// The base card.
    #[must_use]
    pub fn card(&self) -> ModelCard {
        ModelCard {
            display_name: self.spec.model.clone(),
            aliases: self.spec.aliases.clone(),
            source_path: Some(self.spec.model.clone()),
            model_type: self.spec.card_model_type(),
            model_input: Some(ModelInput::Tokens),
            kv_cache_block_size: self.spec.block_size,
            worker_type: self.spec.worker_type,
            needs: self.spec.needs.clone(),
            lora: None,
            indexer_identity: self.spec.indexer_identity.clone(),
            runtime_config: RuntimeConfig {
                total_kv_blocks: Some(self.spec.capacity_blocks_per_rank as u64),
                data_parallel_start_rank: 0,
                data_parallel_size: self.spec.data_parallel_size.max(1),
                enable_local_indexer: self.spec.enable_local_indexer,
                enable_eagle: self.spec.eagle,
                ..RuntimeConfig::default()
            },
        }
    }

    /// Discovery facts of this worker: base card, adapter cards, and one KV source advert per
    /// rank (instance sets are per endpoint and come from the DC).
    #[must_use]
    pub fn discovery_facts(&self) -> Vec<DcInput> {
        let mut facts = vec![DcInput::CardUpserted {
            id: CardInstanceId {
                endpoint: self.spec.endpoint.clone(),
                instance_id: self.worker_id,
                model_suffix: None,
            },
            card: Box::new(self.card()),
        }];
        facts.extend(self.spec.adapters.iter().map(|adapter| self.adapter_card(adapter)));
        if self.spec.publishes_kv {
            for (rank, cache) in self.ranks.iter().enumerate() {
                facts.push(DcInput::SourceAdvertised(self.advert(rank as u32, cache)));
            }
        }
        facts
    }

    /// The recovery endpoint of one publisher incarnation: `worker_kv_query_source_<hex id>` on
    /// the worker's component (dc-inputs §3.1).
    fn recovery_endpoint(&self, publisher_id: u64) -> EndpointPath {
        EndpointPath::new(
            self.spec.endpoint.namespace(),
            self.spec.endpoint.component(),
            format!("worker_kv_query_source_{publisher_id:x}"),
        )
        .expect("derived from a valid endpoint")
    }

    /// The rank whose recovery endpoint `target` names, if this process serves it: the worker
    /// runs a local indexer, `target` names this worker instance, and its endpoint is the one of
    /// a current publisher incarnation of this process.
    #[must_use]
    pub fn recovery_rank(&self, target: &RecoveryTarget) -> Option<u32> {
        if !self.spec.enable_local_indexer
            || !self.spec.publishes_kv
            || target.instance_id != self.worker_id
        {
            return None;
        }
        let rank = self
            .ranks
            .iter()
            .position(|cache| self.recovery_endpoint(cache.publisher_id) == target.endpoint)?;
        u32::try_from(rank).ok()
    }

    fn advert(&self, rank: u32, cache: &RankCache) -> KvEventSourceAdvert {
        let recovery_target = self.spec.enable_local_indexer.then(|| RecoveryTarget {
            endpoint: self.recovery_endpoint(cache.publisher_id),
            instance_id: self.worker_id,
            transport: RequestPlaneTransport::Tcp(format!("sim-worker-{:x}:0", self.worker_id)),
        });
        KvEventSourceAdvert {
            kv_state_endpoint: self.spec.endpoint.clone(),
            source: SourceKey { worker_id: self.worker_id, dp_rank: rank },
            publisher_id: cache.publisher_id,
            recovery_target,
        }
    }

    /// Withdrawals of every advert (the worker is going away).
    #[must_use]
    pub fn withdrawal_facts(&self) -> Vec<DcInput> {
        let mut facts: Vec<DcInput> = self
            .ranks
            .iter()
            .filter(|_| self.spec.publishes_kv)
            .map(|cache| DcInput::SourceWithdrawn {
                kv_state_endpoint: self.spec.endpoint.clone(),
                publisher_id: cache.publisher_id,
            })
            .collect();
        facts.push(DcInput::CardRemoved {
            id: CardInstanceId {
                endpoint: self.spec.endpoint.clone(),
                instance_id: self.worker_id,
                model_suffix: None,
            },
        });
        facts.extend(self.spec.adapters.iter().map(|adapter| self.adapter_removal(adapter)));
        facts
    }

    fn adapter_id(&self, adapter: &str) -> CardInstanceId {
        CardInstanceId {
            endpoint: self.spec.endpoint.clone(),
            instance_id: self.worker_id,
            model_suffix: Some(kvrelay_core::discovery::slugify(adapter)),
        }
    }

    /// The card of a loaded LoRA adapter.
    fn adapter_card(&self, adapter: &str) -> DcInput {
        let mut card = self.card();
        card.display_name = adapter.to_owned();
        card.aliases = Vec::new();
        card.lora = Some(LoraInfo { name: adapter.to_owned(), max_gpu_lora_count: Some(4) });
        card.runtime_config.total_kv_blocks = None;
        DcInput::CardUpserted { id: self.adapter_id(adapter), card: Box::new(card) }
    }

    fn adapter_removal(&self, adapter: &str) -> DcInput {
        DcInput::CardRemoved { id: self.adapter_id(adapter) }
    }

    /// Load a LoRA adapter (its card appears); nothing if it is already loaded.
    pub fn load_adapter(&mut self, adapter: &str) -> Vec<DcInput> {
        if self.spec.adapters.iter().any(|loaded| loaded == adapter) {
            return Vec::new();
        }
        self.spec.adapters.push(adapter.to_owned());
        vec![self.adapter_card(adapter)]
    }

    /// Unload a LoRA adapter (its card goes); nothing if it is not loaded. Blocks already cached
    /// under the adapter's salt stay until evicted, as in an engine.
    pub fn unload_adapter(&mut self, adapter: &str) -> Vec<DcInput> {
        let before = self.spec.adapters.len();
        self.spec.adapters.retain(|loaded| loaded != adapter);
        if self.spec.adapters.len() == before {
            return Vec::new();
        }
        vec![self.adapter_removal(adapter)]
    }

    /// Serve one request on `rank`: reuse the longest cached prefix, store the rest as one chain
    /// continuing it, evict least-recently-used leaves beyond capacity. Returns the KV events.
    pub fn serve(&mut self, rank: u32, tokens: &[u32], adapter: Option<&str>) -> Vec<RouterEvent> {
        if !self.spec.publishes_kv || self.ranks.is_empty() {
            return Vec::new();
        }
        let rank_index = (rank as usize) % self.ranks.len();
        let seed = block_hash_seed(adapter, None);
        let locals =
            local_block_hashes(tokens, self.spec.block_size as usize, self.hash_format(), seed);
        let sequence = sequence_hashes(&locals);
        let worker_id = self.worker_id;
        // The engine's own id for a block: sequence-aware and engine-specific.
        let external_id =
            |index: usize| xxh3_64_with_seed(&sequence[index].0.to_le_bytes(), worker_id);
        let capacity = self.spec.capacity_blocks_per_rank.max(1);
        let cache = &mut self.ranks[rank_index];
        cache.clock += 1;
        let now = cache.clock;
        // The cache is closed under prefixes, so the blocks it holds are a prefix of the chain.
        let hit = sequence.partition_point(|hash| cache.blocks.get(hash.0).is_some());
        if hit > 0 {
            // Only the deepest hit block is touched; eviction order still equals an LRU that
            // touches the whole chain. An interior block becomes a leaf only after each of its
            // descendants was evicted as the least recently used block, so their uses are older
            // than every remaining leaf's, and ranking it by its own last use orders it the same.
            let deepest = sequence[hit - 1].0;
            let block = cache.blocks.get_mut(deepest).expect("a hit block is cached");
            if block.children == 0 {
                cache.leaves.remove(&(block.last_used, deepest));
                cache.leaves.insert((now, deepest));
            }
            block.last_used = now;
        }
        let mut events = Vec::new();
        if hit < sequence.len() {
            let parent = (hit > 0).then(|| external_id(hit - 1));
            let mut previous = parent.map(|_| sequence[hit - 1].0);
            let mut blocks = Vec::new();
            for index in hit..sequence.len() {
                let canonical = sequence[index].0;
                let external = external_id(index);
                if let Some(p) = previous
                    && let Some(parent) = cache.blocks.get_mut(p)
                {
                    if parent.children == 0 {
                        cache.leaves.remove(&(parent.last_used, p));
                    }
                    parent.children += 1;
                }
                cache.leaves.insert((now, canonical));
                cache.blocks.insert(CachedBlock {
                    canonical,
                    external,
                    local: locals[index].0,
                    parent: previous,
                    last_used: now,
                    inserted: now * 1_000_000 + index as u64,
                    children: 0,
                });
                blocks.push(StoredBlock {
                    block_hash: ExternalBlockHash(external),
                    tokens_hash: locals[index],
                });
                previous = Some(canonical);
            }
            let data = KvCacheEventData::Stored(StoreData {
                parent_hash: parent.map(ExternalBlockHash),
                start_position: None,
                blocks,
            });
            events.push(Self::emit(cache, worker_id, rank_index as u32, data));
        }
        let mut evicted = Vec::new();
        while cache.blocks.len() > capacity {
            let Some((_, victim)) = cache.leaves.pop_first() else { break };
            let block = cache.blocks.remove(victim).expect("a leaf is cached");
            if let Some(p) = block.parent
                && let Some(parent) = cache.blocks.get_mut(p)
            {
                parent.children -= 1;
                if parent.children == 0 {
                    cache.leaves.insert((parent.last_used, p));
                }
            }
            evicted.push(ExternalBlockHash(block.external));
        }
        if !evicted.is_empty() {
            let data = KvCacheEventData::Removed(RemoveData { block_hashes: evicted });
            events.push(Self::emit(cache, worker_id, rank_index as u32, data));
        }
        events
    }

    /// Drop every block of `rank` (an engine cache reset): one `Cleared` event.
    pub fn clear(&mut self, rank: u32) -> Vec<RouterEvent> {
        if !self.spec.publishes_kv || self.ranks.is_empty() {
            return Vec::new();
        }
        let rank_index = (rank as usize) % self.ranks.len();
        let worker_id = self.worker_id;
        let cache = &mut self.ranks[rank_index];
        cache.blocks.clear();
        cache.leaves.clear();
        vec![Self::emit(cache, worker_id, rank_index as u32, KvCacheEventData::Cleared)]
    }

    fn emit(
        cache: &mut RankCache,
        worker_id: u64,
        rank: u32,
        data: KvCacheEventData,
    ) -> RouterEvent {
        let event = worker_event(worker_id, rank, cache.next_event_id, data);
        cache.next_event_id += 1;
        if cache.history.len() == EVENT_HISTORY_MAX {
            cache.history.pop_front();
        }
        cache.history.push_back(event.clone());
        event
    }

    /// A replay-ordered dump of `rank` (parents before children, synthetic ids from 0) and the
    /// last event id it covers.
    #[must_use]
    pub fn tree_dump(&self, rank: u32) -> (Vec<RouterEvent>, u64) {
        let Some(cache) = self.ranks.get(rank as usize) else { return (Vec::new(), 0) };
        let mut blocks: Vec<&CachedBlock> = cache.blocks.values().collect();
        blocks.sort_by_key(|block| block.inserted);
        let external_of = |canonical: u64| cache.blocks.get(canonical).map(|b| b.external);
        let events = blocks
            .iter()
            .enumerate()
            .map(|(index, block)| {
                let data = KvCacheEventData::Stored(StoreData {
                    parent_hash: block.parent.and_then(external_of).map(ExternalBlockHash),
                    start_position: None,
                    blocks: vec![StoredBlock {
                        block_hash: ExternalBlockHash(block.external),
                        tokens_hash: kvrelay_core::model::hashing::LocalBlockHash(block.local),
                    }],
                });
                worker_event(self.worker_id, rank, index as u64, data)
            })
            .collect();
        (events, cache.newest_event_id())
    }

    /// The events of `rank` from `start` through its newest one, if its ring still holds
    /// `start` (the ring keeps the last [`EVENT_HISTORY_MAX`] events).
    #[must_use]
    pub fn events_from(&self, rank: u32, start: u64) -> Option<Vec<RouterEvent>> {
        let cache = self.ranks.get(rank as usize)?;
        let first = cache.history.front()?.event.event_id;
        if start < first || start >= cache.next_event_id {
            return None;
        }
        let skip = usize::try_from(start - first).ok()?;
        Some(cache.history.iter().skip(skip).cloned().collect())
    }

    /// One occupancy report per rank.
    #[must_use]
    pub fn load_facts(&self) -> Vec<DcInput> {
        self.ranks
            .iter()
            .enumerate()
            .map(|(rank, cache)| DcInput::Load {
                endpoint: self.spec.endpoint.clone(),
                observation: LoadObservation {
                    source: SourceKey { worker_id: self.worker_id, dp_rank: rank as u32 },
                    kv_used_blocks: Some(cache.blocks.len() as u64),
                    active_decode_blocks: None,
                    active_prefill_tokens: None,
                },
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
