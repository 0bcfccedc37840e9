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

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&RouterEvent) -> bool) {
        let mut bytes = 0;
        self.events.retain(|event| {
            let kept = keep(event);
            if kept {
                bytes += event.weight_bytes();
            }
            kept
        });
        self.bytes = bytes;
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
