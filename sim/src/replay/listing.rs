//! The discovery state a prefix of a journal leaves, as a listing a freshly started node can
//! take: what a restarted relay (or a journal window cut out of a longer one) must learn before
//! the remaining inputs make sense.

use std::collections::BTreeMap;

use kvrelay_core::discovery::{CardChange, DiscoveryScope, DiscoveryView};
use kvrelay_core::inputs::{DcInput, EndpointInstances, KvEventSourceAdvert};
use kvrelay_core::model::identity::EndpointPath;

/// Cards (through the relay's own [`DiscoveryView`]), each endpoint's last instance set, and the
/// source adverts not withdrawn, in the order they were advertised.
#[derive(Debug, Clone)]
pub struct DiscoveryState {
    cards: DiscoveryView,
    cards_seen: bool,
    instances: BTreeMap<EndpointPath, EndpointInstances>,
    sources: Vec<KvEventSourceAdvert>,
}

impl DiscoveryState {
    /// Nothing discovered yet; cards outside `scope` are not held (as in the node).
    #[must_use]
    pub fn new(scope: DiscoveryScope) -> Self {
        DiscoveryState {
            cards: DiscoveryView::new(scope),
            cards_seen: false,
            instances: BTreeMap::new(),
            sources: Vec::new(),
        }
    }

    /// Fold one input (event-plane inputs change nothing).
    pub fn apply(&mut self, input: &DcInput) {
        if let Some(change) = CardChange::from_input(input) {
            self.cards_seen = true;
            let _ = self.cards.apply(change);
            return;
        }
        match input {
            DcInput::Instances(instances) => {
                self.instances.insert(instances.endpoint.clone(), instances.clone());
            }
            DcInput::SourceAdvertised(advert) => {
                let same = |held: &KvEventSourceAdvert| {
                    held.kv_state_endpoint == advert.kv_state_endpoint
                        && held.publisher_id == advert.publisher_id
                };
                match self.sources.iter_mut().find(|held| same(held)) {
                    Some(held) => *held = advert.clone(),
                    None => self.sources.push(advert.clone()),
                }
            }
            DcInput::SourceWithdrawn { kv_state_endpoint, publisher_id } => {
                self.sources.retain(|held| {
                    held.kv_state_endpoint != *kv_state_endpoint
                        || held.publisher_id != *publisher_id
                });
            }
            _ => {}
        }
    }

    /// The state as inputs: one `CardsListed` (when any card input was seen), the adverts in
    /// advertisement order, then every endpoint's instance set.
    #[must_use]
    pub fn listing(&self) -> Vec<DcInput> {
        let mut facts = Vec::new();
        if self.cards_seen {
            let cards = self.cards.cards().map(|(id, card)| (id.clone(), card.clone())).collect();
            facts.push(DcInput::CardsListed { cards });
        }
        facts.extend(self.sources.iter().cloned().map(DcInput::SourceAdvertised));
        facts.extend(self.instances.values().cloned().map(DcInput::Instances));
        facts
    }
}

/// The listing the first `inputs` leave.
#[must_use]
pub fn listing_after<'a>(
    scope: &DiscoveryScope,
    inputs: impl IntoIterator<Item = &'a DcInput>,
) -> Vec<DcInput> {
    let mut state = DiscoveryState::new(scope.clone());
    for input in inputs {
        state.apply(input);
    }
    state.listing()
}

#[cfg(test)]
mod tests {
    use kvrelay_core::rng::rng_from_seed;
    use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};

    use super::*;

    fn scope() -> DiscoveryScope {
        DiscoveryScope::new(Vec::new(), Vec::new(), true).unwrap()
    }

    #[test]
    fn the_listing_of_a_history_is_the_listing_of_its_end_state() {
        let mut rng = rng_from_seed(9);
        let mut dc = SimulatedDc::start(&Deployment::demo(), TrafficConfig::default(), &mut rng);
        let mut history = dc.discovery_facts();
        history.extend(dc.step(10, &mut rng));
        history.extend(dc.restart_worker(1, &mut rng));
        history.extend(dc.crash_worker(0));
        let replayed = listing_after(&scope(), &history);
        let direct = listing_after(&scope(), &dc.discovery_facts());
        let adverts = |facts: &[DcInput]| {
            facts.iter().filter(|f| matches!(f, DcInput::SourceAdvertised(_))).count()
        };
        assert_eq!(adverts(&replayed), adverts(&direct));
        let cards = |facts: &[DcInput]| match &facts[0] {
            DcInput::CardsListed { cards } => {
                cards.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
            }
            other => panic!("a listing starts with the cards, not {other:?}"),
        };
        assert_eq!(cards(&replayed), cards(&direct));
        assert!(replayed.iter().all(|f| !matches!(f, DcInput::KvEvents(_))));
    }
}
