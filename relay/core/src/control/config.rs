//! How a [`ControlPlane`](super::ControlPlane) is configured, and why a configuration can be
//! refused.

use std::num::NonZeroU64;

use thiserror::Error;

use crate::discovery::DiscoveryScope;
use crate::filter::ckf::CkfFormatError;
use crate::host::RegistryError;
use crate::load::LoadWindowError;
use crate::model::identity::{DcId, RelayIdentity};
use crate::readiness::AmbiguityPolicy;
use crate::sources::{SourceConfigError, SourceTrackerConfig};

/// CKF sizing per pool when the operator sets none (`--expected-unique-blocks`).
pub const EXPECTED_UNIQUE_BLOCKS_DEFAULT: u64 = 1_048_576;

/// Load window interval when the operator sets none (`DYN_RELAY_LOAD_WINDOW_MS`).
pub const LOAD_WINDOW_MS_DEFAULT: u64 = 1_000;

/// Most endpoints whose latest instance listing is kept. A listing for a further endpoint is
/// refused and counted ([`instance_listings_refused`]); the endpoint then stays
/// non-authoritative (UNKNOWN) and expects no rank, which is fail-closed. Only endpoints with
/// a live instance or a card count: an empty listing of an endpoint no card serves is pruned
/// ([`instance_listings_pruned`]), so the table holds at most the live population.
///
/// [`instance_listings_pruned`]: super::ControlCounters::instance_listings_pruned
/// [`instance_listings_refused`]: super::ControlCounters::instance_listings_refused
pub const INSTANCE_LISTINGS_MAX: usize = 65_536;

/// Relay-level settings of a [`ControlPlane`](super::ControlPlane).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ControlConfig {
    /// This relay start; its incarnation is every producer's incarnation.
    pub relay: RelayIdentity,
    /// The data center every pool id carries.
    pub dc_id: DcId,
    /// CKF sizing per pool; decides every producer's bucket count.
    pub expected_unique_blocks: u64,
    /// Which endpoints are watched; cards outside it are ignored.
    pub scope: DiscoveryScope,
    /// Whether duplicated PREFILL / DECODE declarations make a topology entry UNAVAILABLE.
    pub ambiguity_policy: AmbiguityPolicy,
    /// Recovery bounds and timers of every pool's source tracker.
    pub source_tracker: SourceTrackerConfig,
    /// The load window interval carried in every window.
    pub load_window_ms: NonZeroU64,
    /// Most bytes the filters of all held pools take together
    /// ([`HostConfig::pool_filter_bytes_max`](crate::host::HostConfig::pool_filter_bytes_max));
    /// journals written before the budget existed read the default.
    #[serde(default = "default_pool_filter_bytes_max")]
    pub pool_filter_bytes_max: u64,
}

fn default_pool_filter_bytes_max() -> u64 {
    crate::host::POOL_FILTER_BYTES_MAX_DEFAULT
}

impl ControlConfig {
    /// The reference defaults for `relay` in data center `dc_id` watching `scope`:
    /// [`EXPECTED_UNIQUE_BLOCKS_DEFAULT`], [`AmbiguityPolicy::Report`], the default tracker
    /// bounds, [`LOAD_WINDOW_MS_DEFAULT`] and the default pool filter budget.
    #[must_use]
    pub fn new(relay: RelayIdentity, dc_id: DcId, scope: DiscoveryScope) -> Self {
        ControlConfig {
            relay,
            dc_id,
            expected_unique_blocks: EXPECTED_UNIQUE_BLOCKS_DEFAULT,
            scope,
            ambiguity_policy: AmbiguityPolicy::Report,
            source_tracker: SourceTrackerConfig::default(),
            load_window_ms: NonZeroU64::new(LOAD_WINDOW_MS_DEFAULT).unwrap_or(NonZeroU64::MIN),
            pool_filter_bytes_max: crate::host::POOL_FILTER_BYTES_MAX_DEFAULT,
        }
    }
}

/// Why a [`ControlPlane`](super::ControlPlane) cannot be built from a configuration.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ControlError {
    /// `expected_unique_blocks` sizes no executable CKF.
    #[error("CKF sizing: {0}")]
    CkfFormat(#[source] CkfFormatError),
    /// The pool registry refused the configuration (boxed: the registry's errors carry pool
    /// ids and endpoint paths).
    #[error("pool registry: {0}")]
    Registry(#[source] Box<RegistryError>),
    /// The source tracker bounds cannot work.
    #[error("source tracker configuration: {0}")]
    SourceTracker(#[source] SourceConfigError),
    /// The load window sequencer could not start.
    #[error("load windows: {0}")]
    LoadWindow(#[source] LoadWindowError),
}
