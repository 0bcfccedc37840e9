//! Serving readiness per `(namespace, canonical base model)`: the relay's topology projection
//! (relay-facts §10.2–§10.4, §3.3), pure and sans-IO.
//!
//! A remote router that considers sourcing KV from this data center needs to know whether the
//! model is actually servable here, and by which pools. This module answers from three inputs:
//!
//! - the discovery memberships ([`crate::discovery::EndpointMembership`]): who declares which
//!   roles, needs and adapters for which base model;
//! - the [`AvailabilityStore`]: each endpoint's live workers, written only by the endpoint slot
//!   that currently owns it (fenced by [`SlotIncarnation`]);
//! - the [`PoolLinks`]: which cataloged pool backs each `(endpoint, base model)`, failing
//!   closed on duplicate claims.
//!
//! [`project_topology`] turns them into [`TopologyEntry`]s using the shared evaluator of
//! [`crate::readiness`]; [`TopologyState`] keeps the published entries and a revision that
//! moves only when they change.
//!
//! Invariants kept here:
//! - entries are recomputed from the current inputs only: a departed endpoint is not a member,
//!   so a role only it provided is missing (UNAVAILABLE), never UNKNOWN;
//! - an entry is UNKNOWN exactly while some current member has no authoritative availability,
//!   and then reports no present or missing roles;
//! - a stale slot can never write availability, and a stale or ambiguous catalog claim can
//!   never link a pool;
//! - duplicated PREFILL / DECODE declarations are always reported; they change the state only
//!   under [`crate::readiness::AmbiguityPolicy::Unavailable`], fixed when the state is built;
//! - every output is ordered deterministically (entries by key, members by endpoint text,
//!   roles in wire order, adapters by id).

mod availability;
mod entry;
mod links;
mod projection;
mod state;

#[cfg(test)]
mod tests;

pub use availability::{
    AvailabilityStore, ClaimOutcome, ReleaseOutcome, ReplaceOutcome, SlotIncarnation,
};
pub use entry::{AdapterReadiness, TopologyEntry, TopologyKey, TopologyMember};
pub use links::PoolLinks;
pub use projection::project_topology;
pub use state::{TOPOLOGY_REVISION_INITIAL, TopologyOutcome, TopologySnapshot, TopologyState};
