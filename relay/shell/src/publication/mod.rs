//! Publication: fan one pool's deltas out to many WAN subscribers (relay-facts §8).
//!
//! Per producer generation there is at most one hub, created lazily by the first subscriber: it
//! holds the pool's publication lease, a mirror of the filter (snapshot + applied deltas) and a
//! bounded queue per subscriber. A subscriber gets the mirror as CBI1 snapshot chunks, then every
//! delta from the mirror's sequence on. Bounds and behaviour at the bound:
//! - per subscriber, [`HubConfig::subscriber_queue_frames`] frames and
//!   [`HubConfig::subscriber_queue_bytes`] bytes: past either, the subscriber is dropped as lagged;
//! - per pool, [`HubConfig::subscribers_per_pool_max`] subscribers: more are refused;
//! - across pools, [`HubConfig::initialized_hubs_max`] hubs: a new one evicts an idle hub or is
//!   refused;
//! - a snapshot chunk that the subscriber does not take within
//!   [`HubConfig::snapshot_progress_timeout`] ends that subscriber (never the generation);
//! - across pools, at most [`HubConfig::encoding_concurrency`] snapshot chunks are being encoded
//!   at once; a subscriber whose chunk is next waits for a free encoder.
//!
//! Any publication failure (identity, lease, sequence or bucket drift; a snapshot that cannot
//! be built or whose encoder fails; the pool's delta stream closing) fails the hub and asks the host
//! to fence the generation, which withdraws it and publishes a new one.

mod hub;
mod registry;
mod stream;

use std::time::Duration;

use thiserror::Error;

use crate::config::WanTuning;

pub use hub::{FrameKind, Hub, HubFrame, MirrorSnapshot};
pub use registry::{FenceRequests, HubCounts, PoolPublications};
pub use stream::{PoolStream, StreamItem};

/// Bounds of publication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HubConfig {
    /// Frames queued per subscriber.
    pub subscriber_queue_frames: usize,
    /// Bytes queued per subscriber (each frame counts its payload plus 256).
    pub subscriber_queue_bytes: usize,
    /// Subscribers per pool.
    pub subscribers_per_pool_max: usize,
    /// Hubs with a mirror across all pools.
    pub initialized_hubs_max: usize,
    /// Largest delta sent as a delta; larger publications re-snapshot.
    pub max_delta_images: usize,
    /// How long one snapshot chunk may wait for its subscriber.
    pub snapshot_progress_timeout: Duration,
    /// Snapshot chunks encoded at once across all pools (at least 1). Journals recorded before
    /// this bound existed decode it as the default.
    #[serde(default = "default_encoding_concurrency")]
    pub encoding_concurrency: usize,
}

fn default_encoding_concurrency() -> usize {
    crate::config::PUBLICATION_ENCODING_CONCURRENCY_DEFAULT
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig {
            subscriber_queue_frames: 16,
            subscriber_queue_bytes: 16 << 20,
            subscribers_per_pool_max: 64,
            initialized_hubs_max: 64,
            max_delta_images: kvrelay_core::filter::cbi1::MAX_DELTA_IMAGES,
            snapshot_progress_timeout: Duration::from_secs(60),
            encoding_concurrency: default_encoding_concurrency(),
        }
    }
}

impl HubConfig {
    /// The bounds the WAN tuning sets (relay-facts §12); the largest delta stays at the CBI1
    /// maximum.
    #[must_use]
    pub fn from_tuning(tuning: &WanTuning) -> Self {
        HubConfig {
            subscriber_queue_frames: tuning.publication_queue_frames,
            subscriber_queue_bytes: tuning.publication_queue_bytes,
            subscribers_per_pool_max: tuning.max_subscribers_per_pool,
            initialized_hubs_max: tuning.max_initialized_pool_hubs,
            snapshot_progress_timeout: tuning.snapshot_progress_timeout,
            encoding_concurrency: tuning.publication_encoding_concurrency,
            ..HubConfig::default()
        }
    }
}

/// Bytes a frame reserves against a subscriber's budget beyond its payload.
pub const FRAME_OVERHEAD_BYTES: usize = 256;

/// Why a subscription could not start or had to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PublicationError {
    /// No active pool has this id.
    #[error("pool not found")]
    NotFound,
    /// The pool's current producer differs from the requested one.
    #[error("requested producer is no longer active")]
    ProducerChanged,
    /// The generation is being retired or the hub stopped.
    #[error("pool publication is unavailable")]
    Unavailable,
    /// Too many subscribers for this pool.
    #[error("pool subscriber limit reached")]
    SubscriberLimit,
    /// No room for another initialized hub and no idle one to evict.
    #[error("initialized hub limit reached")]
    InitializedHubLimit,
    /// The subscriber fell behind its queue bounds.
    #[error("subscriber lagged")]
    SubscriberLagged,
    /// The subscriber did not take a snapshot chunk in time.
    #[error("snapshot made no progress")]
    SnapshotProgressTimeout,
    /// The publication broke an invariant; the generation is fenced.
    #[error("invalid publication")]
    InvalidPublication,
    /// An internal job failed.
    #[error("internal publication failure")]
    Internal,
}

#[cfg(test)]
mod tests;
