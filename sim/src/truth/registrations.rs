//! The registrations oracle: each catalogued pool's registrations (models, adapters and their
//! aliases) against the ones its listed workers' cards declare.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::discovery::{ModelRegistration, ModelTarget};
use kvrelay_dc::SimulatedDc;

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

/// Every catalogued pool (`endpoint`, its registrations) registers exactly what the truth
/// model's listed workers declare for its endpoint.
#[must_use]
pub fn registrations_equal_truth(
    truth: &BTreeMap<String, BTreeSet<RegistrationKey>>,
    catalogued: &[(String, BTreeSet<RegistrationKey>)],
) -> Check {
    let empty = BTreeSet::new();
    let names = |keys: &BTreeSet<RegistrationKey>| {
        keys.iter()
            .map(|(model, _, aliases)| {
                let aliases: Vec<&str> = aliases.iter().map(String::as_str).collect();
                format!("{model}[{}]", aliases.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
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
}
