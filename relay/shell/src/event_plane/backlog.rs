//! Decoded inputs the NATS plane holds for the node while the node's queue is full, bounded in
//! bytes.
//!
//! The NATS client's subscription queues count only messages, and the client fills them with
//! every message of a socket read before the plane runs. A plane that stopped taking messages
//! whenever the node's queue was full would leave them to fill (and the client to drop, or to
//! hold up to capacity × `max_payload` bytes). The plane therefore keeps taking messages into
//! this backlog while it waits for the node, and past its byte budget drops them itself,
//! counted, so the client's queues stay near empty.
//!
//! Invariants: inputs leave in the order they came; the bytes held are the sum of the held
//! inputs' [`DcInput::weight_bytes`], and an input is taken only while they are under the
//! budget, so at most the budget plus one input (bounded by the decoders' limits) is held.

use std::collections::VecDeque;

use kvrelay_core::inputs::DcInput;

/// Inputs waiting for room in the node's queue, in arrival order.
#[derive(Debug)]
pub(crate) struct Backlog {
    inputs: VecDeque<(DcInput, usize)>,
    bytes: usize,
    bytes_max: usize,
}

impl Backlog {
    /// An empty backlog holding at most `bytes_max` bytes (plus the one input that passes it).
    pub(crate) fn new(bytes_max: usize) -> Self {
        Backlog { inputs: VecDeque::new(), bytes: 0, bytes_max }
    }

    /// Whether another input may be taken.
    pub(crate) fn has_room(&self) -> bool {
        self.bytes < self.bytes_max
    }

    /// Hold `input` after the others.
    pub(crate) fn push(&mut self, input: DcInput) {
        debug_assert!(self.has_room(), "an input was taken into a full backlog");
        let weight = input.weight_bytes();
        self.bytes = self.bytes.saturating_add(weight);
        self.inputs.push_back((input, weight));
    }

    /// The weight of the oldest input, if any.
    pub(crate) fn front_weight(&self) -> Option<usize> {
        self.inputs.front().map(|&(_, weight)| weight)
    }

    /// Take the oldest input.
    pub(crate) fn pop(&mut self) -> Option<DcInput> {
        let (input, weight) = self.inputs.pop_front()?;
        self.bytes -= weight;
        debug_assert!(!self.inputs.is_empty() || self.bytes == 0, "bytes left in an empty backlog");
        Some(input)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::inputs::{CardInstanceId, DcInput};

    fn card_removed(instance_id: u64) -> DcInput {
        let endpoint = "ns/backend/generate".parse().expect("valid endpoint");
        DcInput::CardRemoved { id: CardInstanceId { endpoint, instance_id, model_suffix: None } }
    }

    #[test]
    fn inputs_leave_in_order_and_the_budget_admits_one_past_it() {
        let input = card_removed(0);
        let weight = input.weight_bytes();
        let mut backlog = Backlog::new(2 * weight + 1);
        let mut taken = 0;
        while backlog.has_room() {
            backlog.push(card_removed(taken));
            taken += 1;
        }
        // Two fit under the budget, the third passes it, the fourth is refused.
        assert_eq!((taken, backlog.bytes()), (3, 3 * weight));
        assert_eq!(backlog.front_weight(), Some(weight));
        for expected in 0..taken {
            let DcInput::CardRemoved { id } = backlog.pop().expect("held") else { panic!() };
            assert_eq!(id.instance_id, expected);
            assert!(backlog.has_room());
        }
        assert_eq!(
            (backlog.pop().is_none(), backlog.bytes(), backlog.front_weight()),
            (true, 0, None)
        );
    }
}
