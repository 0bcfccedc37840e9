//! What one [`DcInput`] is taken to weigh in memory, so queues of inputs are bounded in bytes.
//!
//! KV events dominate: they are weighed exactly as the live buffer weighs them
//! ([`RouterEvent::weight_bytes`]), so a message of a million blocks weighs about 16 MiB, not
//! "one item". Cards and listings are weighed by their value plus their free-form texts; their
//! nested identity maps are bounded by the decoders' record limit and are left out. Every weight
//! is at least the size of the input value itself, so no input is free.

use std::mem::size_of;

use super::facts::{CardInstanceId, DcInput, ModelCard};
use crate::model::kv_events::RouterEvent;

impl DcInput {
    /// Bytes this input is taken to hold (see the module documentation).
    #[must_use]
    pub fn weight_bytes(&self) -> usize {
        let extra = match self {
            DcInput::CardUpserted { id, card } => id.text_bytes().saturating_add(card_bytes(card)),
            DcInput::CardRemoved { id } => id.text_bytes(),
            DcInput::CardTaintsUpdated { id, taints_json } => {
                id.text_bytes().saturating_add(taints_json.as_ref().map_or(0, String::len))
            }
            DcInput::CardsListed { cards } => cards.iter().fold(0usize, |total, (id, card)| {
                total
                    .saturating_add(size_of::<CardInstanceId>())
                    .saturating_add(id.text_bytes())
                    .saturating_add(card_bytes(card))
            }),
            DcInput::Instances(instances) => {
                // A set entry costs about three words in its tree.
                let workers = instances.live_workers.as_ref().map_or(0, |set| set.len());
                instances.endpoint.text_bytes().saturating_add(workers.saturating_mul(24))
            }
            DcInput::SourceAdvertised(advert) => advert.kv_state_endpoint.text_bytes(),
            DcInput::SourceWithdrawn { kv_state_endpoint, .. } => kv_state_endpoint.text_bytes(),
            DcInput::KvEvents(batch) => batch
                .events
                .iter()
                .map(RouterEvent::weight_bytes)
                .fold(batch.endpoint.text_bytes(), usize::saturating_add),
            DcInput::Load { endpoint, .. } => endpoint.text_bytes(),
        };
        size_of::<DcInput>().saturating_add(extra)
    }
}

/// A card's value and its free-form texts.
fn card_bytes(card: &ModelCard) -> usize {
    let aliases = card.aliases.iter().map(|alias| size_of::<String>() + alias.len()).sum::<usize>();
    let needs = card.needs.iter().map(|set| size_of::<Vec<u8>>() + set.len()).sum::<usize>();
    [
        size_of::<ModelCard>(),
        card.display_name.len(),
        aliases,
        card.source_path.as_ref().map_or(0, String::len),
        card.lora.as_ref().map_or(0, |lora| lora.name.len()),
        card.runtime_config.taints_json.as_ref().map_or(0, String::len),
        card.runtime_config.kv_state_endpoint.as_ref().map_or(0, |endpoint| endpoint.text_bytes()),
        needs,
    ]
    .into_iter()
    .fold(0, usize::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::KvEventBatch;
    use crate::model::identity::EndpointPath;
    use crate::model::kv_events::{KvCacheEvent, StorageTier, StoredBlock, stored_from_wire};

    fn batch(blocks_per_event: u64, events: u64) -> DcInput {
        let endpoint: EndpointPath = "ns/backend/generate".parse().unwrap();
        let events = (0..events)
            .map(|id| RouterEvent {
                worker_id: 1,
                storage_tier: StorageTier::Device,
                residency_domain: None,
                event: KvCacheEvent {
                    event_id: id,
                    dp_rank: 0,
                    data: stored_from_wire(None, None, (0..blocks_per_event).map(|b| (b, b)))
                        .unwrap(),
                },
            })
            .collect();
        DcInput::KvEvents(KvEventBatch {
            endpoint,
            publisher_id: 1,
            sequence: 0,
            published_at_ms: 0,
            events,
        })
    }

    #[test]
    fn events_weigh_their_blocks_and_nothing_is_free() {
        let empty = batch(0, 0).weight_bytes();
        assert!(empty >= size_of::<DcInput>());
        let one = batch(1, 1).weight_bytes();
        let million = batch(1 << 20, 1).weight_bytes();
        assert!(one > empty);
        assert!(million >= 16 << 20, "a million stored blocks weigh at least 16 MiB: {million}");
        assert_eq!(million - one, ((1 << 20) - 1) * size_of::<StoredBlock>());
        let many = batch(4, 100).weight_bytes();
        assert_eq!(many - empty, 100 * batch(4, 1).weight_bytes() - 100 * empty);
    }
}
