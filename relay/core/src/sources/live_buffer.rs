//! The live events one rank holds while its recovery is under way, weighed in bytes.

use crate::model::kv_events::RouterEvent;

/// A rank's buffered live events with their total [`RouterEvent::weight_bytes`].
///
/// Invariant: `bytes` is the sum of [`RouterEvent::weight_bytes`] over `events`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct LiveBuffer {
    events: Vec<RouterEvent>,
    bytes: usize,
}

impl LiveBuffer {
    pub(super) fn len(&self) -> usize {
        self.events.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The buffered events' total [`RouterEvent::weight_bytes`].
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn push(&mut self, event: RouterEvent) {
        self.bytes += event.weight_bytes();
        self.events.push(event);
    }

    pub(super) fn clear(&mut self) {
        self.events.clear();
        self.bytes = 0;
    }

    /// Take every event out, leaving the buffer empty.
    pub(super) fn take(&mut self) -> Vec<RouterEvent> {
        self.bytes = 0;
        std::mem::take(&mut self.events)
    }

    /// Whether `bytes` still equals the sum it stands for (O(events)).
    pub(super) fn weighs_what_it_holds(&self) -> bool {
        self.events.iter().map(RouterEvent::weight_bytes).sum::<usize>() == self.bytes
    }
}

impl FromIterator<RouterEvent> for LiveBuffer {
    fn from_iter<I: IntoIterator<Item = RouterEvent>>(events: I) -> Self {
        let mut buffer = LiveBuffer::default();
        for event in events {
            buffer.push(event);
        }
        buffer
    }
}

#[cfg(test)]
mod tests {
    use super::LiveBuffer;
    use crate::model::kv_events::RouterEvent;
    use crate::sources::tests::{R0, stored};

    #[test]
    fn the_weight_follows_every_change() {
        let mut buffer = LiveBuffer::default();
        assert!(buffer.is_empty() && buffer.weighs_what_it_holds());
        let events = vec![stored(R0, 1, 7), stored(R0, 2, 8)];
        let total: usize = events.iter().map(RouterEvent::weight_bytes).sum();
        assert!(total > 0);
        for event in events.clone() {
            buffer.push(event);
        }
        assert!(!buffer.is_empty());
        assert_eq!((buffer.len(), buffer.bytes()), (2, total));
        assert!(buffer.weighs_what_it_holds());
        assert_eq!(buffer.take(), events);
        assert!(buffer.is_empty() && buffer.weighs_what_it_holds());
        assert_eq!(buffer.bytes(), 0);

        let mut buffer: LiveBuffer = events.into_iter().collect();
        assert_eq!(buffer.bytes(), total);
        buffer.clear();
        assert_eq!((buffer.len(), buffer.bytes()), (0, 0));
    }

    #[test]
    fn a_weight_that_is_not_the_sum_is_seen() {
        let event = stored(R0, 1, 7);
        let short = LiveBuffer { bytes: event.weight_bytes() - 1, events: vec![event.clone()] };
        assert!(!short.weighs_what_it_holds());
        let phantom = LiveBuffer { bytes: 1, events: Vec::new() };
        assert!(!phantom.weighs_what_it_holds());
        assert!(
            LiveBuffer { bytes: event.weight_bytes(), events: vec![event] }.weighs_what_it_holds()
        );
    }
}
