//! The revisioned readiness publisher state (relay-facts §10.2, revision rules).
//!
//! [`TopologyState`] holds the entries last published and their revision. The host recomputes
//! it whenever a membership, an availability or the catalog changes; the revision moves only
//! when the entries do, so subscribers (and the periodic heartbeat, which repeats the current
//! revision) can tell a real change from a repeated input. [`TopologyState::clear`] is the
//! terminal stop: it publishes an empty topology, after which recomputes are refused so that a
//! late input cannot resurrect entries the relay has withdrawn.

use std::collections::BTreeMap;

use serde::Serialize;

use super::availability::AvailabilityStore;
use super::entry::TopologyEntry;
use super::links::PoolLinks;
use super::projection::project_topology;
use crate::discovery::EndpointMembership;
use crate::model::identity::EndpointPath;
use crate::readiness::AmbiguityPolicy;

/// The first revision: the empty topology a fresh relay publishes.
pub const TOPOLOGY_REVISION_INITIAL: u64 = 1;

/// What one [`TopologyState::recompute`] or [`TopologyState::clear`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a published revision must reach the subscribers"]
pub enum TopologyOutcome {
    /// The entries changed and were published under this new revision.
    Published {
        /// The new revision.
        revision: u64,
    },
    /// The entries are identical to the published ones; the revision did not move.
    Unchanged {
        /// The current revision.
        revision: u64,
    },
    /// The state was cleared for good; nothing changes any more.
    Stopped,
}

/// A published topology: the entries and the revision they were published under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopologySnapshot {
    /// Revision of `entries`; starts at [`TOPOLOGY_REVISION_INITIAL`].
    pub revision: u64,
    /// Entries sorted and unique by `(namespace, canonical model)`.
    pub entries: Vec<TopologyEntry>,
}

/// The current topology and its revision.
///
/// Invariants: the revision starts at [`TOPOLOGY_REVISION_INITIAL`] with no entries and
/// increases by one exactly when the published entries change; entries are sorted and unique
/// by key; once stopped, the entries are empty and never change again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyState {
    policy: AmbiguityPolicy,
    revision: u64,
    entries: Vec<TopologyEntry>,
    stopped: bool,
}

impl TopologyState {
    /// An empty topology at revision 1 whose entries follow `policy` for duplicated roles.
    #[must_use]
    pub fn new(policy: AmbiguityPolicy) -> Self {
        TopologyState {
            policy,
            revision: TOPOLOGY_REVISION_INITIAL,
            entries: Vec::new(),
            stopped: false,
        }
    }

    /// The ambiguity policy fixed at construction.
    #[must_use]
    pub fn policy(&self) -> AmbiguityPolicy {
        self.policy
    }

    /// The current revision.
    #[must_use]
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The current entries, sorted by `(namespace, canonical model)`.
    #[must_use]
    pub fn entries(&self) -> &[TopologyEntry] {
        &self.entries
    }

    /// The entry for `canonical_model_id` in `namespace`, if there is one.
    #[must_use]
    pub fn entry(&self, namespace: &str, canonical_model_id: &str) -> Option<&TopologyEntry> {
        self.entries
            .binary_search_by(|entry| {
                (entry.namespace.as_str(), entry.canonical_model_id.as_str())
                    .cmp(&(namespace, canonical_model_id))
            })
            .ok()
            .and_then(|index| self.entries.get(index))
    }

    /// Whether [`TopologyState::clear`] has stopped this state.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The current revision and entries, as handed to subscribers.
    #[must_use]
    pub fn snapshot(&self) -> TopologySnapshot {
        TopologySnapshot { revision: self.revision, entries: self.entries.clone() }
    }

    /// Recompute the entries from the current inputs; bump the revision only if they differ
    /// from the published ones. Refused (nothing changes) once stopped.
    pub fn recompute(
        &mut self,
        memberships: &BTreeMap<EndpointPath, EndpointMembership>,
        availability: &AvailabilityStore,
        links: &PoolLinks,
    ) -> TopologyOutcome {
        if self.stopped {
            return TopologyOutcome::Stopped;
        }
        let entries = project_topology(memberships, availability, links, self.policy);
        self.publish(entries)
    }

    /// Terminal stop: publish an empty topology (a new revision if entries were published) and
    /// refuse every later recompute.
    pub fn clear(&mut self) -> TopologyOutcome {
        if self.stopped {
            return TopologyOutcome::Stopped;
        }
        let outcome = self.publish(Vec::new());
        self.stopped = true;
        outcome
    }

    fn publish(&mut self, entries: Vec<TopologyEntry>) -> TopologyOutcome {
        if entries == self.entries {
            return TopologyOutcome::Unchanged { revision: self.revision };
        }
        self.entries = entries;
        // One step per change: a u64 cannot be exhausted at any real rate. Saturating keeps the
        // revision monotonic without a panic path.
        self.revision = self.revision.saturating_add(1);
        TopologyOutcome::Published { revision: self.revision }
    }
}
