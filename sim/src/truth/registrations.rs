//! The registrations oracles: each catalogued pool's registrations (models, adapters and their
//! aliases) against the ones its listed workers' cards declare.
//!
//! - **registrations-equal-truth** (after quiescence): every catalogued pool of every consumer
//!   ([`registrations_equal_truth`]);
//! - **registrations-follow-truth** (during the run, at every truth sample): while a consumer's
//!   links to a pool are healthy, the pool's registrations in its catalog equal the truth's once
//!   the truth's have been unchanged for [`STALENESS_BOUND_MS`] ([`RegistrationFollowing`]).
//!   A card or adapter change reaches the relay as a discovery record in the planes host's next
//!   frame and the consumer as one catalog update, well within the bound blocks have; a
//!   difference shorter than [`TRANSIENT_MS`] does not count (an adapter loaded and unloaded
//!   within one sample interval leaves the truth unchanged while the relay shows both steps).

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::discovery::{ModelRegistration, ModelTarget};
use kvrelay_dc::SimulatedDc;

use super::{STALENESS_BOUND_MS, SampleAt, TRANSIENT_MS, Violations};
use crate::Check;
use crate::oracles::verdict;

/// A registration as the oracle compares it: canonical name, target, aliases.
pub type RegistrationKey = (String, ModelTarget, BTreeSet<String>);

/// The registrations each endpoint's listed workers declare: per base card its model (target
/// the base model) with the card's aliases, per loaded adapter the adapter on that base model;
/// bindings of one name merge their aliases. A name (model or alias) that binds more than one
/// target anywhere in the DC is dropped (the projection refuses ambiguous request names).
#[must_use]
pub fn truth_registrations(dc: &SimulatedDc) -> BTreeMap<String, BTreeSet<RegistrationKey>> {
    let mut bindings: BTreeMap<String, BTreeMap<(String, ModelTarget), BTreeSet<String>>> =
        BTreeMap::new();
    for worker in dc.listed_workers() {
        let spec = worker.spec();
        let card = worker.card();
        let base = card.display_name.clone();
        let endpoint = bindings.entry(spec.endpoint.to_string()).or_default();
        let target = ModelTarget::Base { base_model: base.clone() };
        endpoint.entry((base.clone(), target)).or_default().extend(card.aliases.iter().cloned());
        for adapter in &spec.adapters {
            let target = ModelTarget::Lora { base_model: base.clone(), adapter: adapter.clone() };
            endpoint.entry((adapter.clone(), target)).or_default();
        }
    }
    let mut targets: BTreeMap<&str, BTreeSet<&ModelTarget>> = BTreeMap::new();
    for ((model, target), aliases) in bindings.values().flatten() {
        targets.entry(model).or_default().insert(target);
        for alias in aliases {
            targets.entry(alias).or_default().insert(target);
        }
    }
    let ambiguous: BTreeSet<&str> =
        targets.into_iter().filter(|(_, t)| t.len() > 1).map(|(name, _)| name).collect();
    bindings
        .iter()
        .map(|(endpoint, bindings)| {
            let keys = bindings
                .iter()
                .filter(|((model, _), _)| !ambiguous.contains(model.as_str()))
                .map(|((model, target), aliases)| {
                    let aliases = aliases
                        .iter()
                        .filter(|alias| !ambiguous.contains(alias.as_str()))
                        .cloned()
                        .collect();
                    (model.clone(), target.clone(), aliases)
                })
                .collect();
            (endpoint.clone(), keys)
        })
        .collect()
}

/// The comparable keys of a catalogued pool's registrations.
#[must_use]
pub fn registration_keys(registrations: &[ModelRegistration]) -> BTreeSet<RegistrationKey> {
    registrations
        .iter()
        .map(|r| (r.canonical_model_id.clone(), r.target.clone(), r.aliases.clone()))
        .collect()
}

/// `keys` as the checks print them: `model[alias,…]`, space-separated.
fn names(keys: &BTreeSet<RegistrationKey>) -> String {
    let name = |(model, _, aliases): &RegistrationKey| {
        let aliases: Vec<&str> = aliases.iter().map(String::as_str).collect();
        format!("{model}[{}]", aliases.join(","))
    };
    keys.iter().map(name).collect::<Vec<_>>().join(" ")
}

/// Every catalogued pool (`endpoint`, its registrations) registers exactly what the truth
/// model's listed workers declare for its endpoint.
#[must_use]
pub fn registrations_equal_truth(
    truth: &BTreeMap<String, BTreeSet<RegistrationKey>>,
    catalogued: &[(String, BTreeSet<RegistrationKey>)],
) -> Check {
    let empty = BTreeSet::new();
    let wrong: Vec<String> = catalogued
        .iter()
        .filter_map(|(endpoint, seen)| {
            let expected = truth.get(endpoint).unwrap_or(&empty);
            (seen != expected).then(|| {
                format!("{endpoint}: registers {{{}}}, truth {{{}}}", names(seen), names(expected))
            })
        })
        .collect();
    let count: usize = catalogued.iter().map(|(_, keys)| keys.len()).sum();
    verdict(
        "registrations-equal-truth",
        &wrong,
        format!(
            "{} pools, {count} registrations with their aliases as the cards declare",
            catalogued.len()
        ),
    )
}

/// One endpoint's truth registrations and since when (simulated ms) they have been what they are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TruthSince {
    /// The registrations the listed workers' cards declare.
    pub keys: BTreeSet<RegistrationKey>,
    /// The first truth sample that showed them.
    pub since: u64,
}

/// Bring `last` (by endpoint) to `now`'s truth registrations `next`: an endpoint whose
/// registrations are unchanged keeps its `since`; a changed or new one starts at `now`.
#[must_use]
pub fn carry_registrations(
    last: &BTreeMap<String, TruthSince>,
    next: BTreeMap<String, BTreeSet<RegistrationKey>>,
    now: u64,
) -> BTreeMap<String, TruthSince> {
    next.into_iter()
        .map(|(endpoint, keys)| {
            let since = match last.get(&endpoint) {
                Some(last) if last.keys == keys => last.since,
                _ => now,
            };
            (endpoint, TruthSince { keys, since })
        })
        .collect()
}

/// One sample of one consumer's catalog entry for one pool.
#[derive(Debug, Clone, Copy)]
pub struct RegistrationSample<'a> {
    /// When and where.
    pub at: SampleAt<'a>,
    /// The truth's registrations of the endpoint (`None`: no listed worker declares any).
    pub truth: Option<&'a TruthSince>,
    /// The registrations the consumer's catalog shows for the pool.
    pub seen: &'a [ModelRegistration],
}

/// What the in-run registration samples found, over the whole run.
#[derive(Debug, Clone, Default)]
pub struct RegistrationFollowing {
    /// Samples of a (consumer, pool) pair due for equality.
    pub samples: u64,
    /// The longest a consumer's registrations were seen differing from the truth's, counted
    /// from the later of the truth's change and the links' health: the lag the bound covers.
    pub slowest_ms: u64,
    violations: Violations,
    /// Per (consumer, endpoint), the first sample of the current streak of due differences.
    streaks: BTreeMap<(String, String), u64>,
}

impl RegistrationFollowing {
    /// Judge one sample: the consumer's registrations differing from a truth unchanged for
    /// [`STALENESS_BOUND_MS`], over links healthy as long, for [`TRANSIENT_MS`] is a violation.
    pub fn observe(&mut self, sample: RegistrationSample<'_>) {
        let RegistrationSample { at, truth, seen } = sample;
        let SampleAt { now, consumer, endpoint, healthy_since } = at;
        let empty = TruthSince::default();
        let truth = truth.unwrap_or(&empty);
        let key = (consumer.to_owned(), endpoint.to_owned());
        let differs = registration_keys(seen) != truth.keys;
        if differs {
            let from = truth.since.max(healthy_since);
            self.slowest_ms = self.slowest_ms.max(now.saturating_sub(from));
        }
        let due = now
            .checked_sub(STALENESS_BOUND_MS)
            .is_some_and(|due| healthy_since <= due && truth.since <= due);
        if !due || !differs {
            self.streaks.remove(&key);
            self.samples += u64::from(due);
            return;
        }
        self.samples += 1;
        let first = *self.streaks.entry(key).or_insert(now);
        if now - first >= TRANSIENT_MS {
            self.violations.push(|| {
                format!(
                    "{consumer} at {now} ms: {endpoint} registers {{{}}}, truth {{{}}} since {} \
                     ms (differing for {} ms)",
                    names(&registration_keys(seen)),
                    names(&truth.keys),
                    truth.since,
                    now - first
                )
            });
        }
    }

    /// The registrations-follow-truth check over every sample.
    #[must_use]
    pub fn check(&self) -> Check {
        let fine = format!(
            "{} healthy samples: every pool's registrations equal the truth's within \
             {STALENESS_BOUND_MS} ms of a change; slowest lag {} ms",
            self.samples, self.slowest_ms
        );
        self.violations.check("registrations-follow-truth", fine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_other_than_the_cards_fail() {
        let base = ModelTarget::Base { base_model: "m".into() };
        let lora = ModelTarget::Lora { base_model: "m".into(), adapter: "a".into() };
        let truth: BTreeMap<String, BTreeSet<RegistrationKey>> = [(
            "e".to_owned(),
            [
                ("m".to_owned(), base.clone(), BTreeSet::from(["alias".to_owned()])),
                ("a".to_owned(), lora.clone(), BTreeSet::new()),
            ]
            .into(),
        )]
        .into();
        let same = vec![("e".to_owned(), truth["e"].clone())];
        assert!(registrations_equal_truth(&truth, &same).passed);
        let without_alias: BTreeSet<RegistrationKey> = [
            ("m".to_owned(), base.clone(), BTreeSet::new()),
            ("a".to_owned(), lora, BTreeSet::new()),
        ]
        .into();
        let check = registrations_equal_truth(&truth, &[("e".to_owned(), without_alias)]);
        assert!(!check.passed);
        assert!(check.detail.contains("truth {a[] m[alias]}"), "{}", check.detail);
        let lingering_adapter: BTreeSet<RegistrationKey> =
            [("m".to_owned(), base, BTreeSet::from(["alias".to_owned()]))].into();
        assert!(!registrations_equal_truth(&truth, &[("e".to_owned(), lingering_adapter)]).passed);
    }

    fn registration(model: &str, aliases: &[&str]) -> ModelRegistration {
        ModelRegistration {
            canonical_model_id: model.to_owned(),
            target: ModelTarget::Base { base_model: model.to_owned() },
            aliases: aliases.iter().map(|alias| (*alias).to_owned()).collect(),
        }
    }

    fn truth_of(seen: &[ModelRegistration], since: u64) -> TruthSince {
        TruthSince { keys: registration_keys(seen), since }
    }

    #[test]
    fn the_truth_keeps_its_since_while_unchanged() {
        let m = truth_of(&[registration("m", &[])], 0).keys;
        let m_alias = truth_of(&[registration("m", &["x"])], 0).keys;
        let first = carry_registrations(&BTreeMap::new(), [("e".to_owned(), m.clone())].into(), 60);
        assert_eq!(first["e"].since, 60);
        let same = carry_registrations(&first, [("e".to_owned(), m.clone())].into(), 120);
        assert_eq!(same["e"].since, 60, "unchanged registrations keep their since");
        let next = [("e".to_owned(), m_alias), ("f".to_owned(), m)].into();
        let changed = carry_registrations(&same, next, 180);
        assert_eq!((changed["e"].since, changed["f"].since), (180, 180), "changed and new");
    }

    /// Feed `following` consumer `c`'s view of endpoint `e` every 60 ms over `[from, to)`.
    fn feed(
        following: &mut RegistrationFollowing,
        (from, to): (u64, u64),
        healthy_since: u64,
        truth: &TruthSince,
        seen: &[ModelRegistration],
    ) {
        for now in (from..to).step_by(60) {
            let at = SampleAt { now, consumer: "c", endpoint: "e", healthy_since };
            let sample = RegistrationSample { at, truth: Some(truth), seen };
            following.observe(sample);
        }
    }

    #[test]
    fn registrations_that_do_not_follow_the_truth_within_the_bound_fail() {
        let old = [registration("m", &[])];
        let new = [registration("m", &[]), registration("a", &[])];
        let truth = truth_of(&new, 5_000);
        // The relay follows within the bound: the difference before it is not judged.
        let mut following = RegistrationFollowing::default();
        feed(&mut following, (5_000, 5_000 + STALENESS_BOUND_MS), 0, &truth, &old);
        feed(&mut following, (5_000 + STALENESS_BOUND_MS, 9_000), 0, &truth, &new);
        let check = following.check();
        assert!(check.passed, "{}", check.detail);
        assert!(following.samples > 0 && following.slowest_ms >= STALENESS_BOUND_MS - 60);
        // A relay that never shows the new adapter fails once the bound and the transient
        // allowance have passed.
        let mut stuck = RegistrationFollowing::default();
        feed(&mut stuck, (5_000, 9_000), 0, &truth, &old);
        let check = stuck.check();
        assert!(!check.passed);
        assert_eq!(check.name, "registrations-follow-truth");
        assert!(check.detail.contains("registers {m[]}, truth {a[] m[]}"), "{}", check.detail);
        // So does one showing an alias the cards no longer declare.
        let mut lingering = RegistrationFollowing::default();
        let aliased = [registration("m", &["x"])];
        feed(&mut lingering, (0, 3_000), 0, &truth_of(&old, 0), &aliased);
        assert!(!lingering.check().passed);
    }

    #[test]
    fn unhealthy_links_and_transient_differences_are_not_judged() {
        let old = [registration("m", &[])];
        let new = [registration("m", &[]), registration("a", &[])];
        let truth = truth_of(&new, 0);
        // Links healthy only from 4 s: the stale view before 5 s is not judged.
        let mut following = RegistrationFollowing::default();
        feed(&mut following, (0, 4_900), 4_000, &truth, &old);
        feed(&mut following, (4_900, 8_000), 4_000, &truth, &new);
        assert!(following.check().passed, "{}", following.check().detail);
        // A difference for less than the transient allowance, once due, passes; for as long
        // as the allowance it fails.
        let mut brief = RegistrationFollowing::default();
        feed(&mut brief, (2_000, 2_000 + TRANSIENT_MS), 0, &truth, &old);
        feed(&mut brief, (2_000 + TRANSIENT_MS, 4_000), 0, &truth, &new);
        assert!(brief.check().passed, "{}", brief.check().detail);
        let mut lasting = RegistrationFollowing::default();
        feed(&mut lasting, (2_000, 2_000 + TRANSIENT_MS + 60), 0, &truth, &old);
        assert!(!lasting.check().passed);
    }
}
