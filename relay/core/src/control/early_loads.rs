//! Worker occupancy reports that arrived before their pool expected the reporting rank.
//!
//! Workers publish `kv_metrics` only when a rank's occupancy changes (dc-inputs §6), so a rank
//! that stays at one value reports it once, at start-up. That report can reach the relay before
//! discovery has shown the worker's card and runtime config (a file store is polled every
//! second), when no pool expects the rank yet. Dropped there, the rank would stay unobserved,
//! and its pool's load incomplete, for as long as its occupancy does not change. So the plane
//! keeps the latest such report per (serving endpoint, rank) here and records it once the
//! endpoint's pool expects the rank.
//!
//! Bounds: at most [`EARLY_LOADS_MAX`] reports are kept (the oldest is forgotten first), and a
//! report older than [`EARLY_LOAD_AGE_MAX`] is never recorded: a rank that has not appeared by
//! then belongs to no worker this relay will see start.
//!
//! Invariants ([`EarlyLoads::check_invariants`]): every kept report has exactly one place in
//! the arrival order and the order names exactly the kept reports; at most [`EARLY_LOADS_MAX`]
//! are kept; every arrival number is below the next one to be issued.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::model::identity::EndpointPath;
use crate::model::kv_events::SourceKey;

/// Most reports kept for ranks no pool expects yet.
pub const EARLY_LOADS_MAX: usize = 4096;

/// Oldest a kept report may be when its rank becomes expected.
pub const EARLY_LOAD_AGE_MAX: Duration = Duration::from_secs(60);

/// One kept report: its arrival number and time, and the occupancy it carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept {
    arrival: u64,
    at: Duration,
    used_blocks: u64,
}

/// The latest early report per (serving endpoint, rank); see the module docs.
#[derive(Debug, Clone, Default)]
pub struct EarlyLoads {
    reports: BTreeMap<(EndpointPath, SourceKey), Kept>,
    /// Arrival number → report, oldest first (what is forgotten when full).
    arrivals: BTreeMap<u64, (EndpointPath, SourceKey)>,
    next_arrival: u64,
}

impl EarlyLoads {
    /// Keep `used_blocks` as `source`'s latest report on `endpoint`, received at `now`
    /// (replacing an older one). Returns how many reports were forgotten to make room (0 or 1).
    pub fn keep(
        &mut self,
        endpoint: &EndpointPath,
        source: SourceKey,
        used_blocks: u64,
        now: Duration,
    ) -> u64 {
        let key = (endpoint.clone(), source);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let kept = Kept { arrival, at: now, used_blocks };
        let mut forgotten = 0;
        if let Some(previous) = self.reports.insert(key.clone(), kept) {
            self.arrivals.remove(&previous.arrival);
        } else if self.reports.len() > EARLY_LOADS_MAX
            && let Some((_, oldest)) = self.arrivals.pop_first()
        {
            self.reports.remove(&oldest);
            forgotten = 1;
        }
        self.arrivals.insert(arrival, key);
        forgotten
    }

    /// Take `endpoint`'s kept reports whose rank `expects` accepts and that are at most
    /// [`EARLY_LOAD_AGE_MAX`] old at `now`, oldest first; reports of that endpoint past the age
    /// are forgotten, the others stay.
    pub fn take_expected(
        &mut self,
        endpoint: &EndpointPath,
        now: Duration,
        expects: impl Fn(SourceKey) -> bool,
    ) -> Vec<(SourceKey, u64)> {
        let mut taken: Vec<(u64, SourceKey, u64)> = Vec::new();
        let mut gone = Vec::new();
        for ((_, source), kept) in self.endpoint_reports(endpoint) {
            let stale = now.saturating_sub(kept.at) > EARLY_LOAD_AGE_MAX;
            if stale {
                gone.push(*source);
            } else if expects(*source) {
                taken.push((kept.arrival, *source, kept.used_blocks));
                gone.push(*source);
            }
        }
        for source in gone {
            self.remove(endpoint, source);
        }
        taken.sort_unstable_by_key(|(arrival, _, _)| *arrival);
        taken.into_iter().map(|(_, source, used)| (source, used)).collect()
    }

    /// Forget every report kept for `endpoint` (its `kv_metrics` stream was interrupted: what
    /// arrived before the gap proves nothing).
    pub fn forget(&mut self, endpoint: &EndpointPath) {
        let sources: Vec<SourceKey> =
            self.endpoint_reports(endpoint).map(|((_, source), _)| *source).collect();
        for source in sources {
            self.remove(endpoint, source);
        }
    }

    /// Reports kept.
    #[cfg(test)]
    #[must_use]
    pub fn len(&self) -> usize {
        self.reports.len()
    }

    /// Whether nothing is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    /// Verify the invariants of the module docs.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.reports.len() > EARLY_LOADS_MAX {
            return Err(format!("{} early load reports kept", self.reports.len()));
        }
        if self.reports.len() != self.arrivals.len() {
            return Err(format!(
                "{} early load reports but {} arrivals",
                self.reports.len(),
                self.arrivals.len()
            ));
        }
        for (key, kept) in &self.reports {
            if kept.arrival >= self.next_arrival {
                return Err(format!("arrival {} was never issued", kept.arrival));
            }
            if self.arrivals.get(&kept.arrival) != Some(key) {
                return Err(format!("early load of {key:?} is out of the arrival order"));
            }
        }
        Ok(())
    }

    fn endpoint_reports<'a>(
        &'a self,
        endpoint: &'a EndpointPath,
    ) -> impl Iterator<Item = (&'a (EndpointPath, SourceKey), &'a Kept)> + 'a {
        let first = SourceKey { worker_id: 0, dp_rank: 0 };
        self.reports
            .range((endpoint.clone(), first)..)
            .take_while(move |((at, _), _)| at == endpoint)
    }

    fn remove(&mut self, endpoint: &EndpointPath, source: SourceKey) {
        if let Some(kept) = self.reports.remove(&(endpoint.clone(), source)) {
            self.arrivals.remove(&kept.arrival);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(text: &str) -> EndpointPath {
        text.parse().expect("valid endpoint")
    }

    fn rank(worker_id: u64, dp_rank: u32) -> SourceKey {
        SourceKey { worker_id, dp_rank }
    }

    #[test]
    fn the_latest_report_of_an_expected_rank_is_taken_and_the_others_wait() {
        let mut early = EarlyLoads::default();
        let backend = endpoint("ns/backend/generate");
        let other = endpoint("ns/prefill/generate");
        let at = Duration::from_secs(5);
        early.keep(&backend, rank(7, 1), 10, at);
        early.keep(&backend, rank(7, 0), 3, at);
        early.keep(&backend, rank(7, 1), 12, at);
        early.keep(&backend, rank(9, 0), 1, at);
        early.keep(&other, rank(7, 0), 99, at);
        assert_eq!(early.len(), 4, "a rank keeps its latest report only");
        early.check_invariants().unwrap();

        let taken = early.take_expected(&backend, at, |source| source.worker_id == 7);
        assert_eq!(taken, vec![(rank(7, 0), 3), (rank(7, 1), 12)], "in arrival order");
        assert_eq!(early.len(), 2, "worker 9 and the other endpoint wait");
        assert!(early.take_expected(&backend, at, |source| source.worker_id == 7).is_empty());
        early.forget(&other);
        assert_eq!(early.len(), 1);
        early.check_invariants().unwrap();
    }

    #[test]
    fn reports_past_the_age_are_never_recorded() {
        let mut early = EarlyLoads::default();
        let backend = endpoint("ns/backend/generate");
        early.keep(&backend, rank(1, 0), 5, Duration::ZERO);
        early.keep(&backend, rank(2, 0), 6, EARLY_LOAD_AGE_MAX);
        let now = EARLY_LOAD_AGE_MAX + Duration::from_millis(1);
        let taken = early.take_expected(&backend, now, |_| false);
        assert!(taken.is_empty());
        assert_eq!(early.len(), 1, "the stale report is forgotten, the fresh one waits");
        assert_eq!(early.take_expected(&backend, now, |_| true), vec![(rank(2, 0), 6)]);
        assert!(early.is_empty());
        early.check_invariants().unwrap();
    }

    #[test]
    fn the_oldest_report_is_forgotten_past_the_bound() {
        let mut early = EarlyLoads::default();
        let backend = endpoint("ns/backend/generate");
        let now = Duration::from_secs(1);
        for worker in 0..EARLY_LOADS_MAX as u64 {
            assert_eq!(early.keep(&backend, rank(worker, 0), worker, now), 0);
        }
        // Replacing a kept report makes no room and needs none.
        assert_eq!(early.keep(&backend, rank(0, 0), 42, now), 0);
        assert_eq!(early.keep(&backend, rank(u64::MAX, 0), 1, now), 1);
        assert_eq!(early.len(), EARLY_LOADS_MAX);
        early.check_invariants().unwrap();
        let taken = early.take_expected(&backend, now, |source| source.worker_id <= 1);
        assert_eq!(taken, vec![(rank(0, 0), 42)], "worker 1's report was the oldest");
    }

    #[test]
    fn a_broken_arrival_order_is_reported() {
        let mut early = EarlyLoads::default();
        let backend = endpoint("ns/backend/generate");
        early.keep(&backend, rank(1, 0), 5, Duration::ZERO);
        early.arrivals.clear();
        assert!(early.check_invariants().is_err());
    }
}
