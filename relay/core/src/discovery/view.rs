//! The discovery view: the current in-scope card set and its projected memberships, as a
//! sans-IO state machine (relay-facts §9.1, §9.3 step 9).
//!
//! The async watch loop feeds [`CardChange`]s (upserts, removals, taint updates, full relists)
//! into [`DiscoveryView::apply`] and gets back which memberships changed. Nothing here waits,
//! retries or reads a clock: rebinding with backoff and the 30 s reconciliation relist belong
//! to the shell.
//!
//! Invariants:
//! - only cards whose endpoint the scope includes are held; cards are held legacy-normalized;
//! - the memberships are always the projection of the held cards;
//! - generations come from one counter starting at 1: a membership keeps its generation while
//!   its projection is unchanged, and gets the next value whenever any field changes or the
//!   endpoint (re)appears. Generations are never reused, so a consumer that saw generation `g`
//!   for an endpoint knows any other value means "changed".
//!
//! Bound: the view holds what discovery lists for its scope, one entry per card identity (plus
//! any distinct duplicates a listing reports for one identity). Every change re-projects the
//! whole set, O(cards · log cards), because name ambiguity is decided across all endpoints.

use std::collections::{BTreeMap, BTreeSet};

use super::membership::EndpointMembership;
use super::projection::project;
use super::scope::DiscoveryScope;
use crate::inputs::normalize_legacy_prefill;
use crate::inputs::{CardInstanceId, DcInput, ModelCard};
use crate::model::identity::EndpointPath;

/// One change to the discovered card set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CardChange {
    /// A card was added or replaced (replaces every card held under `id`).
    Upserted {
        /// Its discovery identity.
        id: CardInstanceId,
        /// The card.
        card: Box<ModelCard>,
    },
    /// A card was removed; unknown ids are ignored.
    Removed {
        /// Its discovery identity.
        id: CardInstanceId,
    },
    /// A known card's taints changed; unknown ids are ignored.
    TaintsUpdated {
        /// Its discovery identity.
        id: CardInstanceId,
        /// The new taints as canonical JSON text.
        taints_json: Option<String>,
    },
    /// The complete card set after a (re)listing; replaces every held card.
    Listed {
        /// Every card the listing returned, in any order.
        cards: Vec<(CardInstanceId, ModelCard)>,
    },
}

impl CardChange {
    /// The card change an input carries, if it is a card input.
    #[must_use]
    pub fn from_input(input: &DcInput) -> Option<Self> {
        match input {
            DcInput::CardUpserted { id, card } => {
                Some(CardChange::Upserted { id: id.clone(), card: card.clone() })
            }
            DcInput::CardRemoved { id } => Some(CardChange::Removed { id: id.clone() }),
            DcInput::CardTaintsUpdated { id, taints_json } => {
                Some(CardChange::TaintsUpdated { id: id.clone(), taints_json: taints_json.clone() })
            }
            DcInput::CardsListed { cards } => Some(CardChange::Listed { cards: cards.clone() }),
            _ => None,
        }
    }
}

/// Which memberships one change affected. Empty when nothing observable changed, in which case
/// no new view needs to be published.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MembershipChanges {
    /// Endpoints whose membership is new or changed (each now has a fresh generation).
    pub upserted: BTreeSet<EndpointPath>,
    /// Endpoints that no longer have any card in scope.
    pub removed: BTreeSet<EndpointPath>,
}

impl MembershipChanges {
    /// True if no membership changed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.upserted.is_empty() && self.removed.is_empty()
    }
}

/// The in-scope card set and its memberships. See the module docs for the invariants.
#[derive(Debug, Clone)]
pub struct DiscoveryView {
    scope: DiscoveryScope,
    /// Held cards by identity. Usually one card per identity; a listing that reports several
    /// distinct cards for one identity keeps all of them (the projection then sees the
    /// duplicates instead of a silently chosen winner).
    cards: BTreeMap<CardInstanceId, Vec<ModelCard>>,
    memberships: BTreeMap<EndpointPath, EndpointMembership>,
    /// The next membership generation to hand out; starts at 1.
    generation_next: u64,
}

impl DiscoveryView {
    /// An empty view over `scope`.
    #[must_use]
    pub fn new(scope: DiscoveryScope) -> Self {
        DiscoveryView {
            scope,
            cards: BTreeMap::new(),
            memberships: BTreeMap::new(),
            generation_next: 1,
        }
    }

    /// The scope cards are filtered by.
    #[must_use]
    pub fn scope(&self) -> &DiscoveryScope {
        &self.scope
    }

    /// The current memberships by endpoint.
    #[must_use]
    pub fn memberships(&self) -> &BTreeMap<EndpointPath, EndpointMembership> {
        &self.memberships
    }

    /// The current membership of `endpoint`, if it has any in-scope card.
    #[must_use]
    pub fn membership(&self, endpoint: &EndpointPath) -> Option<&EndpointMembership> {
        self.memberships.get(endpoint)
    }

    /// The held (in-scope, legacy-normalized) cards in identity order; an identity a listing
    /// reported with several distinct cards appears once per card.
    pub fn cards(&self) -> impl Iterator<Item = (&CardInstanceId, &ModelCard)> {
        self.cards.iter().flat_map(|(id, cards)| cards.iter().map(move |card| (id, card)))
    }

    /// Number of card identities held.
    #[must_use]
    pub fn card_count(&self) -> usize {
        self.cards.len()
    }

    /// Apply one change and re-project. Out-of-scope cards and unknown ids are ignored.
    #[must_use = "a non-empty result means a new view must be published"]
    pub fn apply(&mut self, change: CardChange) -> MembershipChanges {
        if !self.apply_to_cards(change) {
            return MembershipChanges::default();
        }
        let projected = project(self.cards());
        self.commit(projected)
    }

    /// Update the held cards; returns whether they changed.
    fn apply_to_cards(&mut self, change: CardChange) -> bool {
        match change {
            CardChange::Upserted { id, card } => {
                if !self.scope.includes(&id.endpoint) {
                    return false;
                }
                let mut card = *card;
                let _ = normalize_legacy_prefill(&mut card);
                let replacement = vec![card];
                if self.cards.get(&id) == Some(&replacement) {
                    return false;
                }
                self.cards.insert(id, replacement);
                true
            }
            CardChange::Removed { id } => self.cards.remove(&id).is_some(),
            CardChange::TaintsUpdated { id, taints_json } => {
                let Some(cards) = self.cards.get_mut(&id) else {
                    return false;
                };
                let mut changed = false;
                for card in cards {
                    if card.runtime_config.taints_json != taints_json {
                        card.runtime_config.taints_json.clone_from(&taints_json);
                        changed = true;
                    }
                }
                changed
            }
            CardChange::Listed { cards } => {
                let mut listed: BTreeMap<CardInstanceId, Vec<ModelCard>> = BTreeMap::new();
                for (id, mut card) in cards {
                    if !self.scope.includes(&id.endpoint) {
                        continue;
                    }
                    let _ = normalize_legacy_prefill(&mut card);
                    let held = listed.entry(id).or_default();
                    if !held.contains(&card) {
                        held.push(card);
                    }
                }
                if listed == self.cards {
                    return false;
                }
                self.cards = listed;
                true
            }
        }
    }

    /// Install a fresh projection, carrying generations over for unchanged memberships.
    fn commit(
        &mut self,
        projected: BTreeMap<EndpointPath, EndpointMembership>,
    ) -> MembershipChanges {
        let mut previous = std::mem::take(&mut self.memberships);
        let mut changes = MembershipChanges::default();
        for (endpoint, mut membership) in projected {
            match previous.remove(&endpoint) {
                Some(old) if old.same_projection(&membership) => {
                    membership.generation = old.generation;
                }
                _ => {
                    membership.generation = self.allocate_generation();
                    changes.upserted.insert(endpoint.clone());
                }
            }
            self.memberships.insert(endpoint, membership);
        }
        changes.removed = previous.into_keys().collect();
        changes
    }

    /// The next generation. A u64 advanced once per changed membership cannot be exhausted at
    /// any real rate; it saturates rather than wrap so a generation is never reused early.
    fn allocate_generation(&mut self) -> u64 {
        let generation = self.generation_next;
        self.generation_next = self.generation_next.saturating_add(1);
        generation
    }
}
