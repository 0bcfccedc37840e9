//! The control plane: every sans-IO core of the relay composed into one state machine that the
//! async host drives (DESIGN.md "Inside the relay crate"; relay-facts §9–§11).
//!
//! [`ControlPlane`] takes every fact the relay learns about its data center ([`DcInput`]s) and
//! every outcome the async shell reports back ([`ShellReport`]s: pool starts, recovery answers,
//! pool faults), each with the current monotonic time, and returns the [`ControlCommand`]s the
//! shell must carry out, in order. Inside it:
//!
//! - a [`DiscoveryView`] turns cards into endpoint memberships;
//! - per serving endpoint, a [`KvSourceMembership`] joins runtime configs, the endpoint's latest
//!   instance listing and the advertised KV event sources into a [`SourceView`];
//! - the [`EndpointHost`] (and its registry and catalog) decides which endpoints publish a pool;
//! - per *active* pool generation, a [`SourceTracker`] keeps per-rank cursors and recovery, and
//!   a [`PoolLoadState`] keeps KV occupancy;
//! - an [`AvailabilityStore`], written under the host's slot incarnations, and the catalog's
//!   [`PoolLinks`] feed the [`TopologyState`].
//!
//! Nothing here spawns, waits, reads a clock or draws randomness on its own: `now` comes in with
//! every call, jitter from the caller's [`RelayRng`](crate::rng::RelayRng). [`wire`] renders the
//! published outputs in the shape of the `dynamo.kvrelay.v1` messages, for snapshot tests and
//! diagnostics.
//!
//! [`DcInput`]: crate::inputs::DcInput
//! [`DiscoveryView`]: crate::discovery::DiscoveryView
//! [`KvSourceMembership`]: crate::sources::KvSourceMembership
//! [`SourceView`]: crate::sources::SourceView
//! [`EndpointHost`]: crate::host::EndpointHost
//! [`SourceTracker`]: crate::sources::SourceTracker
//! [`PoolLoadState`]: crate::load::PoolLoadState
//! [`AvailabilityStore`]: crate::readiness::topology::AvailabilityStore
//! [`PoolLinks`]: crate::readiness::topology::PoolLinks
//! [`TopologyState`]: crate::readiness::topology::TopologyState

mod config;
mod early_loads;
mod plane;
mod protocol;
pub mod wire;

#[cfg(test)]
pub(crate) mod tests;

pub use config::{
    ControlConfig, ControlError, EXPECTED_UNIQUE_BLOCKS_DEFAULT, INSTANCE_LISTINGS_MAX,
    LOAD_WINDOW_MS_DEFAULT,
};
pub use plane::ControlPlane;
pub use protocol::{ControlCommand, ControlCounters, ControlHealth, ShellReport};
