//! Per-endpoint worker availability, fenced by endpoint-slot incarnation (relay-facts §10.2).
//!
//! The host keeps one slot per serving endpoint; each slot runs a watch of the endpoint's live
//! instances and writes what it sees here. Slots come and go (an endpoint disappears and
//! reappears, a slot is rebuilt), and the watch of a retired slot can still deliver a late
//! snapshot. The store therefore remembers which slot incarnation owns each endpoint and
//! accepts writes only from that owner:
//!
//! - [`AvailabilityStore::claim`] makes a slot the owner. A *new* owner starts with no
//!   availability (not yet authoritative), so nothing a previous slot saw leaks into the new
//!   slot's view; the *current* owner claiming again (a membership update of the same slot)
//!   keeps what it had.
//! - [`AvailabilityStore::replace`] installs the owner's latest snapshot; any other caller is
//!   fenced and changes nothing.
//! - [`AvailabilityStore::release`] drops the endpoint when its owning slot retires; a retired
//!   slot releasing after the endpoint was claimed again is fenced too.
//!
//! Availability itself is `None` until the owner's first successful listing (the topology
//! reads that as UNKNOWN), then `Some(set)`, where the empty set is an authoritative "no live
//! worker". A watch failure is reported as `None` again.
//!
//! Bound: one record per claimed endpoint, removed on release; a record holds at most the
//! worker ids one listing reported.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::model::identity::EndpointPath;

/// The incarnation of one endpoint slot in the host: a new value every time the host creates a
/// slot for an endpoint, so a retired slot and its successor never compare equal.
///
/// The store only compares incarnations for equality; it does not assume they increase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotIncarnation(pub u64);

impl fmt::Display for SlotIncarnation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "slot#{}", self.0)
    }
}

/// What a [`AvailabilityStore::claim`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum ClaimOutcome {
    /// The slot became the owner; any previous owner's availability was discarded and the
    /// endpoint is not authoritative until the new owner replaces it.
    Claimed {
        /// The owner that was displaced, if any.
        previous_owner: Option<SlotIncarnation>,
    },
    /// The slot already owned the endpoint: ownership and availability are unchanged.
    AlreadyOwned,
}

/// What a [`AvailabilityStore::replace`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum ReplaceOutcome {
    /// The owner's availability changed.
    Changed,
    /// The owner reported exactly what the store already held; nothing changed.
    Unchanged,
    /// The caller does not own the endpoint; nothing changed.
    Fenced {
        /// The endpoint's current owner, if any slot owns it.
        owner: Option<SlotIncarnation>,
    },
}

impl ReplaceOutcome {
    /// Whether the write changed the store (so dependent projections must be recomputed).
    #[must_use]
    pub fn changed(self) -> bool {
        self == ReplaceOutcome::Changed
    }
}

/// What a [`AvailabilityStore::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum ReleaseOutcome {
    /// The owner released the endpoint; it has no owner and no availability now.
    Released,
    /// The caller does not own the endpoint; nothing changed.
    Fenced {
        /// The endpoint's current owner, if any slot owns it.
        owner: Option<SlotIncarnation>,
    },
}

/// One endpoint's owner and its latest availability.
#[derive(Debug, Clone, PartialEq, Eq)]
struct OwnedAvailability {
    owner: SlotIncarnation,
    /// `None` until the owner's first authoritative listing.
    live_workers: Option<BTreeSet<u64>>,
}

/// Live worker sets of serving endpoints, each written only by the slot that owns it.
///
/// Invariant: every endpoint held has exactly one owner; its availability was written by that
/// owner (or is `None` since the owner's claim).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AvailabilityStore {
    endpoints: BTreeMap<EndpointPath, OwnedAvailability>,
}

impl AvailabilityStore {
    /// An empty store: no endpoint is owned or authoritative.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Make `slot` the owner of `endpoint`.
    ///
    /// A different (or no) previous owner is displaced and the endpoint's availability is
    /// cleared to "not yet authoritative". The current owner claiming again keeps its
    /// availability: a membership update of a live slot must not make the topology UNKNOWN.
    pub fn claim(&mut self, endpoint: &EndpointPath, slot: SlotIncarnation) -> ClaimOutcome {
        match self.endpoints.get_mut(endpoint) {
            Some(record) if record.owner == slot => ClaimOutcome::AlreadyOwned,
            Some(record) => {
                let previous_owner = Some(record.owner);
                *record = OwnedAvailability { owner: slot, live_workers: None };
                ClaimOutcome::Claimed { previous_owner }
            }
            None => {
                self.endpoints.insert(
                    endpoint.clone(),
                    OwnedAvailability { owner: slot, live_workers: None },
                );
                ClaimOutcome::Claimed { previous_owner: None }
            }
        }
    }

    /// Install `slot`'s latest view of `endpoint`'s live workers (`None`: the watch failed or
    /// has not listed yet). Ignored unless `slot` owns the endpoint.
    pub fn replace(
        &mut self,
        endpoint: &EndpointPath,
        slot: SlotIncarnation,
        live_workers: Option<BTreeSet<u64>>,
    ) -> ReplaceOutcome {
        let Some(record) = self.endpoints.get_mut(endpoint) else {
            return ReplaceOutcome::Fenced { owner: None };
        };
        if record.owner != slot {
            return ReplaceOutcome::Fenced { owner: Some(record.owner) };
        }
        if record.live_workers == live_workers {
            return ReplaceOutcome::Unchanged;
        }
        record.live_workers = live_workers;
        ReplaceOutcome::Changed
    }

    /// Drop `endpoint` when `slot`, its owner, retires. Ignored unless `slot` owns it, so a
    /// retired slot cannot remove its successor's record.
    pub fn release(&mut self, endpoint: &EndpointPath, slot: SlotIncarnation) -> ReleaseOutcome {
        match self.endpoints.get(endpoint) {
            Some(record) if record.owner == slot => {
                self.endpoints.remove(endpoint);
                ReleaseOutcome::Released
            }
            Some(record) => ReleaseOutcome::Fenced { owner: Some(record.owner) },
            None => ReleaseOutcome::Fenced { owner: None },
        }
    }

    /// The slot that owns `endpoint`, if any.
    #[must_use]
    pub fn owner(&self, endpoint: &EndpointPath) -> Option<SlotIncarnation> {
        self.endpoints.get(endpoint).map(|record| record.owner)
    }

    /// The authoritative live workers of `endpoint`; `None` when no slot owns it or its owner
    /// has no authoritative listing.
    #[must_use]
    pub fn live_workers(&self, endpoint: &EndpointPath) -> Option<&BTreeSet<u64>> {
        self.endpoints.get(endpoint).and_then(|record| record.live_workers.as_ref())
    }

    /// Number of owned endpoints.
    #[must_use]
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// True if no endpoint is owned.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(path: &str) -> EndpointPath {
        path.parse().unwrap()
    }

    fn workers(ids: &[u64]) -> Option<BTreeSet<u64>> {
        Some(ids.iter().copied().collect())
    }

    #[test]
    fn unclaimed_endpoints_are_not_authoritative_and_reject_writes() {
        let mut store = AvailabilityStore::new();
        let path = endpoint("prod/backend/generate");
        assert_eq!(
            store.replace(&path, SlotIncarnation(1), workers(&[1])),
            ReplaceOutcome::Fenced { owner: None }
        );
        assert_eq!(
            store.release(&path, SlotIncarnation(1)),
            ReleaseOutcome::Fenced { owner: None }
        );
        assert_eq!(store.live_workers(&path), None);
        assert!(store.is_empty());
    }

    #[test]
    fn a_new_owner_starts_unknown_and_the_old_owner_is_fenced() {
        let mut store = AvailabilityStore::new();
        let path = endpoint("prod/backend/generate");
        let (old, new) = (SlotIncarnation(7), SlotIncarnation(8));
        assert_eq!(store.claim(&path, old), ClaimOutcome::Claimed { previous_owner: None });
        assert_eq!(store.live_workers(&path), None);
        assert_eq!((store.len(), store.is_empty()), (1, false));
        assert!(store.replace(&path, old, workers(&[1, 2])).changed());
        assert_eq!(store.live_workers(&path), workers(&[1, 2]).as_ref());
        assert!(!store.replace(&path, old, workers(&[1, 2])).changed(), "the same workers again");

        assert_eq!(store.claim(&path, new), ClaimOutcome::Claimed { previous_owner: Some(old) });
        assert_eq!(store.owner(&path), Some(new));
        assert_eq!(store.live_workers(&path), None);
        assert_eq!(
            store.replace(&path, old, workers(&[1])),
            ReplaceOutcome::Fenced { owner: Some(new) }
        );
        assert!(!ReplaceOutcome::Fenced { owner: Some(new) }.changed());
        assert_eq!(store.release(&path, old), ReleaseOutcome::Fenced { owner: Some(new) });
        assert_eq!(store.owner(&path), Some(new));
        assert_eq!(store.live_workers(&path), None);
    }

    #[test]
    fn the_owner_claiming_again_keeps_its_availability() {
        let mut store = AvailabilityStore::new();
        let path = endpoint("prod/backend/generate");
        let slot = SlotIncarnation(3);
        let _ = store.claim(&path, slot);
        let _ = store.replace(&path, slot, workers(&[]));
        assert_eq!(store.claim(&path, slot), ClaimOutcome::AlreadyOwned);
        assert_eq!(store.live_workers(&path), workers(&[]).as_ref());
    }

    #[test]
    fn identical_and_failed_listings_are_distinguished() {
        let mut store = AvailabilityStore::new();
        let path = endpoint("prod/backend/generate");
        let slot = SlotIncarnation(1);
        let _ = store.claim(&path, slot);
        assert_eq!(store.replace(&path, slot, None), ReplaceOutcome::Unchanged);
        assert_eq!(store.replace(&path, slot, workers(&[4])), ReplaceOutcome::Changed);
        assert_eq!(store.replace(&path, slot, workers(&[4])), ReplaceOutcome::Unchanged);
        // A watch failure makes the endpoint non-authoritative again.
        assert_eq!(store.replace(&path, slot, None), ReplaceOutcome::Changed);
        assert_eq!(store.live_workers(&path), None);
        assert_eq!(store.release(&path, slot), ReleaseOutcome::Released);
        assert_eq!(store.owner(&path), None);
        assert_eq!(store.len(), 0);
    }
}
