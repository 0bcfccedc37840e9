//! Typed KV cache events as the relay applies them (dc-inputs §2.2).
//!
//! These are the decoded form of Dynamo's `RouterEvent`: the wire decoders produce them and the
//! pool ownership state consumes them. Multimodal data and salts are already folded into each
//! block's `tokens_hash`, so they do not appear here.

use crate::model::hashing::{ExternalBlockHash, LocalBlockHash};
use serde::{Deserialize, Serialize};

/// One publishing source of KV events: a worker's data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SourceKey {
    /// The worker (instance) id.
    pub worker_id: u64,
    /// The data-parallel rank within the worker.
    pub dp_rank: u32,
}

/// Where a stored block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StorageTier {
    /// GPU memory: the only tier the relay indexes.
    Device,
    /// Pinned host memory.
    HostPinned,
    /// Local disk.
    Disk,
    /// External storage.
    External,
}

/// Which residency domain an event describes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ResidencyDomain {
    /// The worker's own cache (the primary domain).
    Worker,
    /// A cache owner / state agent's view (not primary).
    CacheOwner,
    /// A domain this relay does not know: such events fail closed.
    Unsupported(String),
}

/// One KV event from one worker, as a relay ingests it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    /// The emitting worker.
    pub worker_id: u64,
    /// Storage tier of the blocks (device when the wire omits it).
    pub storage_tier: StorageTier,
    /// Residency domain; `None` for legacy events, which are primary.
    pub residency_domain: Option<ResidencyDomain>,
    /// The event itself.
    pub event: KvCacheEvent,
}

/// Whether an event targets the primary residency (device tier, worker or legacy domain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Apply it.
    Primary,
    /// Valid but not the primary residency: ignore it without counting it.
    NonPrimary,
}

/// The event names a residency domain the relay does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported residency domain {0:?}")]
pub struct UnsupportedResidencyDomain(pub String);

impl RouterEvent {
    /// Bytes this event is taken to hold in memory: the event value plus its block list (a
    /// stored block is two 64-bit hashes, a removed one a single hash). An estimate that errs
    /// high: the vectors' spare capacity is the only thing it leaves out, and decoders size them
    /// exactly. Every queue and buffer that bounds events in bytes weighs them with this.
    #[must_use]
    pub fn weight_bytes(&self) -> usize {
        let blocks = match &self.event.data {
            KvCacheEventData::Stored(store) => {
                store.blocks.len().saturating_mul(std::mem::size_of::<StoredBlock>())
            }
            KvCacheEventData::Removed(remove) => {
                remove.block_hashes.len().saturating_mul(std::mem::size_of::<ExternalBlockHash>())
            }
            KvCacheEventData::Cleared => 0,
        };
        let domain = match &self.residency_domain {
            Some(ResidencyDomain::Unsupported(name)) => name.len(),
            _ => 0,
        };
        std::mem::size_of::<RouterEvent>().saturating_add(blocks).saturating_add(domain)
    }

    /// The `(worker_id, dp_rank)` source of this event.
    #[must_use]
    pub fn source(&self) -> SourceKey {
        SourceKey { worker_id: self.worker_id, dp_rank: self.event.dp_rank }
    }

    /// Classify the event's residency; unknown domains fail closed.
    pub fn residency(&self) -> Result<Residency, UnsupportedResidencyDomain> {
        match &self.residency_domain {
            Some(ResidencyDomain::Unsupported(name)) => {
                Err(UnsupportedResidencyDomain(name.clone()))
            }
            Some(ResidencyDomain::CacheOwner) => Ok(Residency::NonPrimary),
            None | Some(ResidencyDomain::Worker) => {
                Ok(if self.storage_tier == StorageTier::Device {
                    Residency::Primary
                } else {
                    Residency::NonPrimary
                })
            }
        }
    }
}

/// A numbered event of one source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Per-publisher event id, contiguous from 1 within one publisher incarnation.
    pub event_id: u64,
    /// The data-parallel rank that emitted it.
    pub dp_rank: u32,
    /// What happened.
    pub data: KvCacheEventData,
}

/// What a KV event says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvCacheEventData {
    /// Blocks were stored.
    Stored(StoreData),
    /// Blocks were removed.
    Removed(RemoveData),
    /// Every block of the emitting `(worker, dp_rank)` was dropped.
    Cleared,
}

/// A chain of stored blocks, optionally continuing an earlier block of the same source.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoreData {
    /// The engine id of the block this chain continues, if any.
    pub parent_hash: Option<ExternalBlockHash>,
    /// Position of the first block in its sequence, for positional replay.
    pub start_position: Option<u32>,
    /// The blocks, parent first.
    pub blocks: Vec<StoredBlock>,
}

/// One stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's id for the block (lineage only).
    pub block_hash: ExternalBlockHash,
    /// Hash of the block's tokens (salted), the input of canonical hashing.
    pub tokens_hash: LocalBlockHash,
}

/// Engine block ids that were removed.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RemoveData {
    /// The removed blocks' engine ids.
    pub block_hashes: Vec<ExternalBlockHash>,
}

/// The residency domain a wire name denotes; any name but the two known ones is kept as
/// [`ResidencyDomain::Unsupported`] (the caller bounds its length).
#[must_use]
pub fn residency_domain_from_wire(name: &str) -> ResidencyDomain {
    match name {
        "worker" => ResidencyDomain::Worker,
        "cache_owner" => ResidencyDomain::CacheOwner,
        other => ResidencyDomain::Unsupported(other.to_owned()),
    }
}

/// The storage tier a wire name denotes; absent means device. `None` for an unknown name.
#[must_use]
pub fn storage_tier_from_wire(name: Option<&str>) -> Option<StorageTier> {
    match name {
        None | Some("device") => Some(StorageTier::Device),
        Some("host_pinned") => Some(StorageTier::HostPinned),
        Some("disk") => Some(StorageTier::Disk),
        Some("external") => Some(StorageTier::External),
        Some(_) => None,
    }
}

/// A store's start position does not fit the `u32` the relay keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("start_position {0} exceeds u32")]
pub struct StartPositionTooLarge(pub u64);

/// A `stored` event from its wire parts: parent id, start position and
/// `(block_hash, tokens_hash)` pairs as raw 64-bit values.
pub fn stored_from_wire(
    parent_hash: Option<u64>,
    start_position: Option<u64>,
    blocks: impl IntoIterator<Item = (u64, u64)>,
) -> Result<KvCacheEventData, StartPositionTooLarge> {
    let start_position = start_position
        .map(|position| u32::try_from(position).map_err(|_| StartPositionTooLarge(position)))
        .transpose()?;
    Ok(KvCacheEventData::Stored(StoreData {
        parent_hash: parent_hash.map(ExternalBlockHash),
        start_position,
        blocks: blocks
            .into_iter()
            .map(|(block_hash, tokens_hash)| StoredBlock {
                block_hash: ExternalBlockHash(block_hash),
                tokens_hash: LocalBlockHash(tokens_hash),
            })
            .collect(),
    }))
}

/// A `removed` event from raw 64-bit engine block ids.
pub fn removed_from_wire(block_hashes: impl IntoIterator<Item = u64>) -> KvCacheEventData {
    KvCacheEventData::Removed(RemoveData {
        block_hashes: block_hashes.into_iter().map(ExternalBlockHash).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(tier: StorageTier, domain: Option<ResidencyDomain>) -> RouterEvent {
        RouterEvent {
            worker_id: 1,
            storage_tier: tier,
            residency_domain: domain,
            event: KvCacheEvent { event_id: 1, dp_rank: 2, data: KvCacheEventData::Cleared },
        }
    }

    #[test]
    fn only_device_tier_worker_or_legacy_events_are_primary() {
        assert_eq!(event(StorageTier::Device, None).residency(), Ok(Residency::Primary));
        assert_eq!(
            event(StorageTier::Device, Some(ResidencyDomain::Worker)).residency(),
            Ok(Residency::Primary)
        );
        assert_eq!(
            event(StorageTier::Device, Some(ResidencyDomain::CacheOwner)).residency(),
            Ok(Residency::NonPrimary)
        );
        assert_eq!(event(StorageTier::HostPinned, None).residency(), Ok(Residency::NonPrimary));
        assert_eq!(
            event(StorageTier::Device, Some(ResidencyDomain::Unsupported("x".into()))).residency(),
            Err(UnsupportedResidencyDomain("x".into()))
        );
        assert_eq!(event(StorageTier::Disk, None).source(), SourceKey { worker_id: 1, dp_rank: 2 });
    }
}
