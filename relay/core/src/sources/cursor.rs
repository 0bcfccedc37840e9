//! The per-rank event cursor (dc-inputs §3.4): where one rank's applied state stands in its
//! publisher's event-id stream.
//!
//! A publisher numbers its events contiguously from 1 per incarnation, so the last applied id is
//! enough to classify every new id: the next one continues the state, a lower or equal one was
//! already covered, a higher one means events were lost in between. The cursor never decides what
//! to do about that; the recovery state machine does.

/// The last id of the event-id space. A rank whose cursor stood here could never advance again
/// (every later id would be stale), so the id space of the incarnation is exhausted: an event or
/// an answer carrying it is not applied and the rank is fenced until a new incarnation is
/// activated, as a publisher whose sequence would overflow needs a new producer generation
/// (relay-facts §7.2). Ids count from 1 per incarnation (dc-inputs §2.6), so no real publisher
/// gets here.
pub const EVENT_ID_EXHAUSTED: u64 = u64::MAX;

/// How far one rank's applied state reaches in its publisher's id stream.
///
/// Invariant: `Live(last)` means every event of the active incarnation with an id `<= last` is
/// reflected in the rank's state (applied, replaced by a dump, or superseded by a `Cleared`), and
/// no event with a higher id is. The recovery state machine never moves it to
/// [`EVENT_ID_EXHAUSTED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RankCursor {
    /// Nothing is known yet: the rank was just activated or reset without a known position.
    #[default]
    Initial,
    /// The state reflects the stream up to and including this id.
    Live(u64),
}

/// What an incoming event id means relative to the cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorObservation {
    /// The cursor had no position: the id cannot be judged.
    Initial,
    /// The id is exactly the next one.
    Contiguous,
    /// At least one id between the cursor and this one is missing.
    Gap {
        /// The first missing id (`last + 1`).
        missing_from: u64,
        /// The last missing id (`id - 1`).
        missing_to: u64,
    },
    /// The id is already covered (a duplicate or an old event).
    Stale,
}

impl RankCursor {
    /// Classify `event_id` against the cursor; changes nothing.
    #[must_use]
    pub fn observe(self, event_id: u64) -> CursorObservation {
        match self {
            RankCursor::Initial => CursorObservation::Initial,
            RankCursor::Live(last) if event_id <= last => CursorObservation::Stale,
            // `event_id > last` here, so `last + 1` cannot overflow.
            RankCursor::Live(last) if event_id == last + 1 => CursorObservation::Contiguous,
            RankCursor::Live(last) => {
                CursorObservation::Gap { missing_from: last + 1, missing_to: event_id - 1 }
            }
        }
    }

    /// The last covered id, if any.
    #[must_use]
    pub fn last(self) -> Option<u64> {
        match self {
            RankCursor::Initial => None,
            RankCursor::Live(last) => Some(last),
        }
    }

    /// Whether `event_id` is already covered by the cursor.
    #[must_use]
    pub fn covers(self, event_id: u64) -> bool {
        self.last().is_some_and(|last| event_id <= last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_follow_the_last_applied_id() {
        let cases = [
            (RankCursor::Initial, 7, CursorObservation::Initial),
            (RankCursor::Live(4), 5, CursorObservation::Contiguous),
            (RankCursor::Live(4), 4, CursorObservation::Stale),
            (RankCursor::Live(4), 1, CursorObservation::Stale),
            (RankCursor::Live(4), 8, CursorObservation::Gap { missing_from: 5, missing_to: 7 }),
            (RankCursor::Live(0), 1, CursorObservation::Contiguous),
            (RankCursor::Live(u64::MAX), u64::MAX, CursorObservation::Stale),
            (RankCursor::Live(u64::MAX - 1), u64::MAX, CursorObservation::Contiguous),
        ];
        for (cursor, id, expected) in cases {
            assert_eq!(cursor.observe(id), expected, "{cursor:?} observing {id}");
        }
        assert!(RankCursor::Live(3).covers(3));
        assert!(!RankCursor::Live(3).covers(4));
        assert!(!RankCursor::Initial.covers(0));
    }
}
