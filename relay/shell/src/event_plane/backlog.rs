//! Decoded inputs the NATS plane holds for the node while the node's queue is full, bounded in
//! bytes and shared fairly between endpoints.
//!
//! The NATS client's subscription queues count only messages, and the client fills them with
//! every message of a socket read before the plane runs. A plane that stopped taking messages
//! whenever the node's queue was full would leave them to fill (and the client to drop, or to
//! hold up to capacity × `max_payload` bytes). The plane therefore keeps taking messages into
//! this backlog while it waits for the node, and past its byte budget drops them itself,
//! counted, so the client's queues stay near empty.
//!
//! **Fair shares.** Every input belongs to a share: the serving endpoint it was published on
//! (its `kv-events` and `kv_metrics` together; anything else shares one). The node is given the
//! shares' inputs in turn (round robin over the shares holding any), each share's in the order
//! they came; so an endpoint's input waits behind at most one input of each other endpoint per
//! input of its own ahead of it, however many a flooding endpoint has queued. When the budget is
//! full, an arriving input does not simply lose to whatever came first: while the heaviest
//! share holds more than the arriving input's share would with it, the heaviest share's newest
//! input is dropped to make room. So an endpoint flooding the DC plane loses its own newest
//! messages, and an endpoint publishing at a normal rate beside it loses nothing (max-min
//! fairness over bytes). Within a share inputs are only ever dropped from the newest end, so
//! what a publisher sees downstream is a prefix and a gap. Endpoints are independent inputs to
//! the node (a pool's events never depend on another endpoint's), so serving them in turn
//! reorders nothing that matters.
//!
//! Invariants ([`Backlog::check_invariants`]): each share holds at least one input and its
//! byte count is its inputs' [`DcInput::weight_bytes`] plus [`ENTRY_BYTES`] each; the bytes held
//! are the shares' sum; an input is taken only while they are under the budget, so at most the
//! budget plus one input (bounded by the decoders' limits) is held.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;

use kvrelay_core::inputs::DcInput;
use xxhash_rust::xxh3::Xxh3;

/// What holding one input costs beyond its own weight: its place in its share's queue.
pub const ENTRY_BYTES: usize = 64;

/// One share's held inputs, oldest first, each with its weight.
#[derive(Debug, Default)]
struct Share {
    bytes: usize,
    inputs: VecDeque<(DcInput, usize)>,
}

/// Inputs waiting for room in the node's queue.
#[derive(Debug)]
pub(crate) struct Backlog {
    shares: BTreeMap<u64, Share>,
    /// The share served last: the next is the first after it.
    served: Option<u64>,
    bytes: usize,
    bytes_max: usize,
}

/// The share `input` belongs to: a hash of its endpoint (fixed-seed, so the same on every run).
fn share_of(input: &DcInput) -> u64 {
    let endpoint = match input {
        DcInput::KvEvents(batch) => &batch.endpoint,
        DcInput::Load { endpoint, .. } => endpoint,
        _ => return 0,
    };
    let mut hasher = Xxh3::new();
    for segment in [endpoint.namespace(), endpoint.component(), endpoint.endpoint()] {
        hasher.update(segment.as_bytes());
        hasher.update(&[0]);
    }
    hasher.digest()
}

impl Backlog {
    /// An empty backlog holding at most `bytes_max` bytes (plus the one input that passes it).
    pub(crate) fn new(bytes_max: usize) -> Self {
        Backlog { shares: BTreeMap::new(), served: None, bytes: 0, bytes_max }
    }

    /// Take `input` if the budget has room, making room first by dropping the heaviest share's
    /// newest inputs while that share would still hold more than `input`'s. Returns how many
    /// inputs were dropped (the arriving one included, if it was).
    pub(crate) fn offer(&mut self, input: DcInput) -> u64 {
        let weight = input.weight_bytes().saturating_add(ENTRY_BYTES);
        let share = share_of(&input);
        let mut dropped = 0;
        while self.bytes >= self.bytes_max {
            // Found by a scan: only a full budget needs it, and shares hold inputs only while
            // the node is behind.
            let heaviest = self.shares.iter().map(|(share, held)| (held.bytes, *share)).max();
            let Some((heaviest_bytes, heaviest)) = heaviest else { break };
            let own = self.shares.get(&share).map_or(0, |held| held.bytes);
            if heaviest == share || heaviest_bytes <= own.saturating_add(weight) {
                break;
            }
            let newest = self.shares.get_mut(&heaviest).and_then(|held| held.inputs.pop_back());
            let Some((_, weight)) = newest else { break };
            self.settle(heaviest, weight);
            dropped += 1;
        }
        if self.bytes >= self.bytes_max {
            return dropped + 1;
        }
        self.bytes = self.bytes.saturating_add(weight);
        let held = self.shares.entry(share).or_default();
        held.bytes += weight;
        held.inputs.push_back((input, weight));
        dropped
    }

    /// Account for an input of `weight` bytes that left `share`.
    fn settle(&mut self, share: u64, weight: usize) {
        self.bytes -= weight;
        let Some(held) = self.shares.get_mut(&share) else { return };
        held.bytes -= weight;
        if held.inputs.is_empty() {
            debug_assert_eq!(held.bytes, 0, "bytes left in an empty share");
            self.shares.remove(&share);
        }
    }

    /// The share whose turn it is: the first after the one served last, else the first.
    fn next_share(&self) -> Option<u64> {
        let after = self.served.map_or(Bound::Unbounded, Bound::Excluded);
        let next = self.shares.range((after, Bound::Unbounded)).next();
        next.or_else(|| self.shares.iter().next()).map(|(share, _)| *share)
    }

    /// The weight of the input [`pop`](Self::pop) takes next, if any.
    pub(crate) fn front_weight(&self) -> Option<usize> {
        let held = self.shares.get(&self.next_share()?)?;
        held.inputs.front().map(|(_, weight)| weight - ENTRY_BYTES)
    }

    /// Take the oldest input of the share whose turn it is.
    pub(crate) fn pop(&mut self) -> Option<DcInput> {
        let share = self.next_share()?;
        let (input, weight) = self.shares.get_mut(&share)?.inputs.pop_front()?;
        self.settle(share, weight);
        self.served = Some(share);
        debug_assert!(!self.shares.is_empty() || self.bytes == 0, "bytes left in an empty backlog");
        Some(input)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The relations between the shares and the byte counts (see the module documentation).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut bytes = 0;
        for (share, held) in &self.shares {
            let weights: usize = held
                .inputs
                .iter()
                .map(|(input, weight)| {
                    assert_eq!(*weight, input.weight_bytes() + ENTRY_BYTES);
                    weight
                })
                .sum();
            if weights != held.bytes || held.inputs.is_empty() {
                return Err(format!(
                    "share {share:x}: {} bytes counted, {weights} held",
                    held.bytes
                ));
            }
            bytes += held.bytes;
        }
        if bytes != self.bytes {
            return Err(format!("{} bytes counted, {bytes} held", self.bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::inputs::{CardInstanceId, DcInput};
    use kvrelay_core::rng::rng_from_seed;
    use rand_core::Rng;

    fn card_removed(instance_id: u64) -> DcInput {
        let endpoint = "ns/backend/generate".parse().expect("valid endpoint");
        DcInput::CardRemoved { id: CardInstanceId { endpoint, instance_id, model_suffix: None } }
    }

    /// A KV event batch of `namespace`'s endpoint storing 16 blocks, numbered `sequence`.
    fn batch(namespace: &str, sequence: u64) -> DcInput {
        crate::node::kv_batch(namespace, sequence, 16)
    }

    fn sequence_of(input: &DcInput) -> (String, u64) {
        let DcInput::KvEvents(batch) = input else { panic!("not a batch") };
        (batch.endpoint.namespace().to_owned(), batch.sequence)
    }

    #[test]
    fn inputs_leave_in_order_and_the_budget_admits_one_past_it() {
        let input = card_removed(0);
        let weight = input.weight_bytes() + ENTRY_BYTES;
        let mut backlog = Backlog::new(2 * weight + 1);
        for taken in 0..3 {
            assert_eq!(backlog.offer(card_removed(taken)), 0);
        }
        // Two fit under the budget, the third passes it, the fourth (same share) is refused.
        assert_eq!(backlog.bytes(), 3 * weight);
        assert_eq!(backlog.offer(card_removed(3)), 1, "the arriving input is dropped");
        assert_eq!(backlog.front_weight(), Some(weight - ENTRY_BYTES));
        for expected in 0..3 {
            let DcInput::CardRemoved { id } = backlog.pop().expect("held") else { panic!() };
            assert_eq!(id.instance_id, expected);
            backlog.check_invariants().unwrap();
        }
        assert_eq!(
            (backlog.pop().is_none(), backlog.bytes(), backlog.front_weight()),
            (true, 0, None)
        );
    }

    #[test]
    fn a_flooding_endpoint_loses_its_newest_inputs_and_a_light_one_loses_nothing() {
        // The node takes one input for every three the flood sends; the light endpoint sends
        // one input for every five of the flood's.
        let weight = batch("flood", 0).weight_bytes() + ENTRY_BYTES;
        let mut backlog = Backlog::new(8 * weight);
        let (mut flood_dropped, mut light) = (0, 0);
        let mut left = Vec::new();
        for sequence in 0..60 {
            flood_dropped += backlog.offer(batch("flood", sequence));
            if sequence % 5 == 4 {
                // What it drops to make room is the flood's.
                flood_dropped += backlog.offer(batch("light", light));
                light += 1;
            }
            if sequence % 3 == 2 {
                left.extend(backlog.pop().map(|input| sequence_of(&input)));
            }
            backlog.check_invariants().unwrap();
            assert!(backlog.bytes() <= 9 * weight, "{} bytes held", backlog.bytes());
        }
        assert!(flood_dropped > 20, "{flood_dropped} of the flood's 60 inputs dropped");
        while let Some(input) = backlog.pop() {
            left.push(sequence_of(&input));
            backlog.check_invariants().unwrap();
        }
        let lights: Vec<u64> = left
            .iter()
            .filter(|(name, _)| name == "light")
            .map(|(_, sequence)| *sequence)
            .collect();
        assert_eq!(lights, (0..light).collect::<Vec<_>>(), "every light input, in order");
        let floods: Vec<u64> = left
            .iter()
            .filter(|(name, _)| name == "flood")
            .map(|(_, sequence)| *sequence)
            .collect();
        assert!(floods.windows(2).all(|pair| pair[0] < pair[1]), "the flood's survivors in order");
        assert_eq!(floods.len() as u64 + flood_dropped, 60);
        assert_eq!(backlog.bytes(), 0);
    }

    #[test]
    fn without_the_fair_shares_the_light_endpoint_would_lose_inputs() {
        // The same flood with the light endpoint's inputs arriving when the budget is full:
        // they are taken only because the flood's newest inputs make room.
        let weight = batch("flood", 0).weight_bytes() + ENTRY_BYTES;
        let mut backlog = Backlog::new(4 * weight);
        for sequence in 0..4 {
            backlog.offer(batch("flood", sequence));
        }
        assert_eq!(backlog.offer(batch("flood", 4)), 1, "full: the flood's own input is refused");
        assert_eq!(backlog.offer(batch("light", 0)), 1, "one flood input dropped for it");
        let order: Vec<(String, u64)> =
            std::iter::from_fn(|| backlog.pop()).map(|input| sequence_of(&input)).collect();
        // Served in turn: the light endpoint's input does not wait behind the flood's.
        let first = share_of(&batch("flood", 0)).min(share_of(&batch("light", 0)));
        let expected = if first == share_of(&batch("flood", 0)) {
            [("flood", 0), ("light", 0), ("flood", 1), ("flood", 2)]
        } else {
            [("light", 0), ("flood", 0), ("flood", 1), ("flood", 2)]
        };
        assert_eq!(order, expected.map(|(name, sequence)| (name.to_owned(), sequence)));
    }

    #[test]
    fn random_offers_and_pops_keep_the_invariants_and_the_bound() {
        let weight = batch("a", 0).weight_bytes() + ENTRY_BYTES;
        let budget = 16 * weight;
        let mut backlog = Backlog::new(budget);
        let mut rng = rng_from_seed(5);
        let mut next = [0u64; 4];
        let mut last_popped: BTreeMap<String, u64> = BTreeMap::new();
        for _ in 0..5_000 {
            if rng.next_u32().is_multiple_of(3) {
                if let Some(input) = backlog.pop() {
                    let (name, sequence) = sequence_of(&input);
                    if let Some(previous) = last_popped.insert(name, sequence) {
                        assert!(previous < sequence, "an endpoint's inputs left out of order");
                    }
                }
            } else {
                // Share 0 publishes most, share 3 least.
                let share = (rng.next_u32() % 10).min(3 * (rng.next_u32() % 2)) as usize;
                backlog.offer(batch(&format!("e{share}"), next[share]));
                next[share] += 1;
            }
            backlog.check_invariants().unwrap();
            assert!(backlog.bytes() <= budget + weight, "{} bytes held", backlog.bytes());
        }
    }
}
