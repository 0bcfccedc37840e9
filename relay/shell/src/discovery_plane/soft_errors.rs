//! The soft discovery errors a differ currently sees (see
//! [`kvrelay_core::discovery::SoftErrorKind`]), with their counters and their log lines.
//!
//! Invariants:
//!
//! - the current set is replaced as a whole by every [`SoftErrorLog::update`]; an error is
//!   identified by `(kind, key)`;
//! - an error is logged at warn when it appears or its reason changes, at debug while it stays
//!   unchanged, at debug when it clears; an error that clears and comes back warns again;
//! - `appeared` counts, per kind, every warn (an appearance or a change of reason), so a
//!   problem that stays is counted once however often the set is recomputed;
//! - at most [`SOFT_ERRORS_TRACKED`] errors are held and [`SOFT_ERRORS_LISTED`] reported by
//!   name; beyond that they are only counted in `current_total`.

use std::collections::BTreeMap;

use tracing::{debug, warn};

use kvrelay_core::discovery::{SoftDiscoveryError, SoftErrorKind};

/// Most soft errors a differ holds (and logs by name).
pub const SOFT_ERRORS_TRACKED: usize = 1 << 14;
/// Most soft errors the stats list by name (the `/engine/state` list).
pub const SOFT_ERRORS_LISTED: usize = 32;

/// What the operations surface shows of the soft errors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SoftErrorReport {
    /// The first [`SOFT_ERRORS_LISTED`] current errors, in `(kind, key)` order.
    pub listed: Vec<SoftDiscoveryError>,
    /// How many errors hold now (listed or not).
    pub current_total: u64,
    /// How many hold now, per kind.
    pub current: BTreeMap<SoftErrorKind, u64>,
    /// Appearances (and changes of reason) so far, per kind.
    pub appeared: BTreeMap<SoftErrorKind, u64>,
}

/// The current soft errors and their report.
#[derive(Debug, Default)]
pub struct SoftErrorLog {
    current: BTreeMap<(SoftErrorKind, String), String>,
    report: SoftErrorReport,
}

impl SoftErrorLog {
    /// Replace the current set with `errors` (any order; repeats of one `(kind, key)` keep
    /// the first reason in sorted order), logging and counting what changed.
    pub fn update(&mut self, errors: Vec<SoftDiscoveryError>) {
        let mut errors = errors;
        errors.sort();
        let total = errors.len();
        let mut next: BTreeMap<(SoftErrorKind, String), String> = BTreeMap::new();
        for error in errors {
            if next.len() >= SOFT_ERRORS_TRACKED {
                break;
            }
            next.entry((error.kind, error.key)).or_insert(error.reason);
        }
        for ((kind, key), reason) in &next {
            match self.current.get(&(*kind, key.clone())) {
                Some(previous) if previous == reason => {
                    debug!(%kind, key, reason, "soft discovery error unchanged");
                }
                _ => {
                    warn!(%kind, key, reason, "soft discovery error: record left out");
                    let appeared = self.report.appeared.entry(*kind).or_default();
                    *appeared = appeared.saturating_add(1);
                }
            }
        }
        for (kind, key) in self.current.keys() {
            if !next.contains_key(&(*kind, key.clone())) {
                debug!(%kind, key, "soft discovery error cleared");
            }
        }
        self.current = next;
        self.report.current_total = u64::try_from(total).unwrap_or(u64::MAX);
        self.report.current.clear();
        for (kind, _) in self.current.keys() {
            *self.report.current.entry(*kind).or_default() += 1;
        }
        self.report.listed = self
            .current
            .iter()
            .take(SOFT_ERRORS_LISTED)
            .map(|((kind, key), reason)| SoftDiscoveryError {
                kind: *kind,
                key: key.clone(),
                reason: reason.clone(),
            })
            .collect();
    }

    /// The report of the current set.
    #[must_use]
    pub fn report(&self) -> &SoftErrorReport {
        &self.report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(kind: SoftErrorKind, key: &str, reason: &str) -> SoftDiscoveryError {
        SoftDiscoveryError::new(kind, key, reason)
    }

    #[test]
    fn an_unchanged_error_is_counted_once_and_a_changed_reason_again() {
        let mut log = SoftErrorLog::default();
        let orphan = error(SoftErrorKind::OrphanAdapter, "ns/c/e/1f/ad", "no base card");
        for _ in 0..3 {
            log.update(vec![orphan.clone()]);
        }
        assert_eq!(log.report().appeared.get(&SoftErrorKind::OrphanAdapter), Some(&1));
        assert_eq!(log.report().listed, vec![orphan.clone()]);
        log.update(vec![error(SoftErrorKind::OrphanAdapter, "ns/c/e/1f/ad", "two base cards")]);
        assert_eq!(log.report().appeared.get(&SoftErrorKind::OrphanAdapter), Some(&2));
        // Cleared, then back: it warns (and counts) again.
        log.update(Vec::new());
        assert_eq!(log.report().current_total, 0);
        assert!(log.report().listed.is_empty());
        assert!(log.report().current.is_empty());
        log.update(vec![orphan]);
        assert_eq!(log.report().appeared.get(&SoftErrorKind::OrphanAdapter), Some(&3));
        assert_eq!(log.report().current.get(&SoftErrorKind::OrphanAdapter), Some(&1));
    }

    #[test]
    fn the_listing_is_bounded_and_ordered_while_the_total_counts_everything() {
        let mut log = SoftErrorLog::default();
        let errors: Vec<SoftDiscoveryError> = (0..SOFT_ERRORS_LISTED + 5)
            .rev()
            .map(|index| error(SoftErrorKind::InvalidAlias, &format!("key-{index:03}"), "bad"))
            .collect();
        log.update(errors);
        let report = log.report();
        assert_eq!(report.listed.len(), SOFT_ERRORS_LISTED);
        assert_eq!(report.listed[0].key, "key-000");
        assert_eq!(report.current_total, u64::try_from(SOFT_ERRORS_LISTED + 5).unwrap());
        assert_eq!(
            report.appeared.get(&SoftErrorKind::InvalidAlias),
            Some(&u64::try_from(SOFT_ERRORS_LISTED + 5).unwrap())
        );
    }
}
