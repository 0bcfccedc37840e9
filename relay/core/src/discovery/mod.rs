//! Discovery: from model deployment cards to per-endpoint memberships (relay-facts §9.1–9.3).
//!
//! The relay learns what is served where only from the cards its DC's discovery plane lists.
//! This module turns that card set into one [`EndpointMembership`] per serving endpoint: the
//! indexer domain its pool would publish under, the request-facing bindings (base models and
//! LoRA adapters) it serves, its workers' roles, runtime configs and readiness units, and every
//! [`MaterializationConflict`] found on the way. It is pure and sans-IO:
//!
//! - [`DiscoveryScope`] validates which namespaces and endpoint prefixes are watched;
//! - [`DiscoveryView`] holds the in-scope cards, applies [`CardChange`]s, re-projects, and
//!   hands out membership generations;
//! - [`pool_claims`] is the hook the registry uses to check one owner per pool.
//!
//! Invariants kept here:
//! - the projection depends on the card set only, never on arrival or listing order;
//! - conflicting facts are never resolved by picking a winner: a request-facing name that two
//!   bindings claim anywhere in the view is served by neither, an endpoint with two domains or
//!   two base models is fenced, and endpoints that would publish one pool are all fenced;
//! - a membership's generation changes exactly when its projection changes or the endpoint
//!   reappears, so downstream layers can compare generations instead of whole memberships.

mod conflicts;
mod membership;
mod projection;
mod render;
mod scope;
mod soft_errors;
mod view;

#[cfg(test)]
mod tests;

pub use conflicts::{ConflictReason, ConflictScope, ConflictSubject, MaterializationConflict};
pub use membership::{
    AdapterMembership, EndpointMembership, ModelRegistration, ModelTarget, QuerySemantics,
    UnknownWorkerRole, WorkerRole, WorkerTopology,
};
pub use projection::{card_soft_errors, is_valid_request_name, pool_claims, slugify};
pub use scope::{DiscoveryQuery, DiscoveryScope, NamespaceSelection, ScopeError};
pub use soft_errors::{SoftDiscoveryError, SoftErrorKind, card_key};
pub use view::{CardChange, DiscoveryView, MembershipChanges};
