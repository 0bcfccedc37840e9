//! Parsed event subjects by their text, so that a stream of messages on a few subjects (one per
//! endpoint and topic) parses and allocates each subject once instead of once per message.
//!
//! Invariants ([`SubjectCache::check_invariants`]):
//! - every entry is what [`parse_event_subject`] answers for its key, so a lookup and a parse
//!   are indistinguishable to the caller; a subject that does not parse is never kept and fails
//!   with the parser's error every time;
//! - `bytes` is the sum of the entries' weights ([`entry_weight`]) and never passes
//!   [`SUBJECT_CACHE_BYTES_MAX`]: when the next subject would pass it, the cache is emptied
//!   first (a DC's subjects fit many times over, so that happens only under a flood of distinct
//!   subjects, which then cost a parse each as they did without the cache).

use std::collections::BTreeMap;

use super::errors::InputError;
use super::event_plane::{EventSubject, parse_event_subject};

/// Most bytes the cache's entries weigh together.
pub const SUBJECT_CACHE_BYTES_MAX: usize = 1 << 20;

/// Bytes an entry is charged beyond its texts: the map node, the key's and the path's headers.
const ENTRY_OVERHEAD_BYTES: usize = 160;

/// What one entry weighs: its key, the parsed path's and topic's texts, and
/// [`ENTRY_OVERHEAD_BYTES`]. The parsed texts are at most the key's length.
fn entry_weight(subject: &str) -> usize {
    2 * subject.len() + ENTRY_OVERHEAD_BYTES
}

/// Parsed subjects by text (see the module doc).
#[derive(Debug, Default)]
pub struct SubjectCache {
    parsed: BTreeMap<Box<str>, EventSubject>,
    bytes: usize,
}

impl SubjectCache {
    /// An empty cache.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// `subject` parsed: from the cache, or parsed now and kept if it parses.
    pub fn parse(&mut self, subject: &str) -> Result<&EventSubject, InputError> {
        if self.parsed.contains_key(subject) {
            return Ok(&self.parsed[subject]);
        }
        let parsed = parse_event_subject(subject)?;
        let weight = entry_weight(subject);
        if self.bytes + weight > SUBJECT_CACHE_BYTES_MAX {
            self.parsed.clear();
            self.bytes = 0;
        }
        self.bytes += weight;
        Ok(self.parsed.entry(subject.into()).or_insert(parsed))
    }

    /// Bytes the entries weigh together.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Subjects kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.parsed.len()
    }

    /// Whether nothing is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.parsed.is_empty()
    }

    /// Verify the module doc's invariants (O(entries): every key is parsed again).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut bytes = 0;
        for (subject, parsed) in &self.parsed {
            match parse_event_subject(subject) {
                Ok(fresh) if fresh == *parsed => {}
                other => {
                    return Err(format!("{subject:?} is kept as {parsed:?}, parses as {other:?}"));
                }
            }
            bytes += entry_weight(subject);
        }
        if bytes != self.bytes {
            return Err(format!("entries weigh {bytes} bytes, the cache counts {}", self.bytes));
        }
        if self.bytes > SUBJECT_CACHE_BYTES_MAX {
            return Err(format!("{} bytes kept, more than {SUBJECT_CACHE_BYTES_MAX}", self.bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::event_subject;
    use crate::model::identity::EndpointPath;

    fn subject(namespace: &str, endpoint: &str, topic: &str) -> String {
        let path = EndpointPath::new(namespace, "backend", endpoint).unwrap();
        event_subject(&path, topic)
    }

    #[test]
    fn a_cached_subject_answers_what_a_parse_does() {
        let mut cache = SubjectCache::new();
        let text = subject("dynamo", "generate", "kv-events");
        let first = cache.parse(&text).unwrap().clone();
        assert_eq!(first, parse_event_subject(&text).unwrap());
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.parse(&text).unwrap(), &first);
        assert_eq!(cache.len(), 1, "a second lookup adds nothing");
        let other = subject("dynamo", "generate", "kv_metrics");
        assert_eq!(cache.parse(&other).unwrap(), &parse_event_subject(&other).unwrap());
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.bytes(), entry_weight(&text) + entry_weight(&other));
        cache.check_invariants().unwrap();
    }

    #[test]
    fn a_subject_that_does_not_parse_fails_every_time_and_is_not_kept() {
        let mut cache = SubjectCache::new();
        for bad in ["namespace.x", "namespace.a b.component.c.endpoint.e.kv-events", ""] {
            for _ in 0..2 {
                assert_eq!(cache.parse(bad).unwrap_err(), parse_event_subject(bad).unwrap_err());
            }
        }
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn a_flood_of_distinct_subjects_stays_within_the_byte_bound() {
        let mut cache = SubjectCache::new();
        let mut emptied = 0;
        for i in 0..20_000 {
            let text = subject("flood", &format!("endpoint{i}"), "kv-events");
            let before = cache.len();
            assert_eq!(cache.parse(&text).unwrap(), &parse_event_subject(&text).unwrap());
            if cache.len() <= before {
                emptied += 1;
            }
            assert!(cache.bytes() <= SUBJECT_CACHE_BYTES_MAX);
        }
        assert!(emptied > 0, "20,000 subjects pass the bound, so the cache was emptied");
        cache.check_invariants().unwrap();
    }

    #[test]
    fn the_invariant_check_fires_on_a_wrong_entry_and_a_wrong_count() {
        let mut cache = SubjectCache::new();
        let text = subject("dynamo", "generate", "kv-events");
        cache.parse(&text).unwrap();
        cache.bytes += 1;
        assert!(cache.check_invariants().unwrap_err().contains("weigh"));
        cache.bytes -= 1;
        let wrong = parse_event_subject(&subject("dynamo", "other", "kv-events")).unwrap();
        cache.parsed.insert(text.clone().into(), wrong);
        assert!(cache.check_invariants().unwrap_err().contains("parses as"));
    }
}
