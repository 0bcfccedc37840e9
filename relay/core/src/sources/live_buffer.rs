//! The live events one rank holds while its recovery is under way, weighed in bytes.

use crate::model::kv_events::{KvCacheEventData, RouterEvent};

/// Bytes one buffered event is taken to hold: the event value plus its block list (a stored
/// block is two 64-bit hashes, a removed one a single hash). An estimate that errs high: the
/// vectors' spare capacity is the only thing it leaves out, and decoders size them exactly.
#[must_use]
pub fn event_bytes(event: &RouterEvent) -> usize {
    let blocks = match &event.event.data {
        KvCacheEventData::Stored(store) => store.blocks.len() * 16,
        KvCacheEventData::Removed(remove) => remove.block_hashes.len() * 8,
        KvCacheEventData::Cleared => 0,
    };
    std::mem::size_of::<RouterEvent>() + blocks
}

/// A rank's buffered live events with their total [`event_bytes`].
///
/// Invariant: `bytes` is the sum of [`event_bytes`] over `events`.
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

    /// The buffered events' total [`event_bytes`].
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn push(&mut self, event: RouterEvent) {
        self.bytes += event_bytes(&event);
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
                bytes += event_bytes(event);
            }
            kept
        });
        self.bytes = bytes;
    }

    /// Whether `bytes` still equals the sum it stands for (O(events)).
    pub(super) fn weighs_what_it_holds(&self) -> bool {
        self.events.iter().map(event_bytes).sum::<usize>() == self.bytes
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
