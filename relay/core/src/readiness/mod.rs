//! The serving-readiness evaluator (relay-facts §10.1, §10.3; dc-inputs §5), pure.
//!
//! The topology projection (a separate layer) groups the workers of one
//! `(namespace, canonical model)` into [`ReadinessUnit`]s — one per worker-set shape, each with
//! its declared role, its peer needs and how many of its workers are live — and calls
//! [`evaluate`] once per group. This module only answers "given these units, is the group
//! ready, which roles are present, which are missing, and which are ambiguous"; it never sees
//! endpoints, pools or availability watches.
//!
//! Rules kept here (Dynamo's shared evaluator):
//! - any legacy unit (no worker type) switches the whole group to the legacy fallback: ready iff
//!   some worker is live, nothing reported missing, ambiguity not evaluated;
//! - a typed role declared by some unit but live in none is missing;
//! - a live unit's needs are an OR of AND-sets of roles; when no alternative is fully present,
//!   every absent role of every alternative is missing; a dead unit's needs are ignored;
//! - roles match exactly: AGGREGATED satisfies neither PREFILL nor DECODE;
//! - no unit, or no live worker, is never ready;
//! - `ambiguous` lists the non-aggregated roles with more than one live unit. It is a fact,
//!   kept out of [`Evaluation::ready`]: whether it gates readiness is the relay's
//!   [`AmbiguityPolicy`].
//!
//! LoRA adapters are evaluated with the same rules over the units restricted to the workers
//! that advertise the adapter ([`evaluate_adapter`]), and their state is composed with the
//! base entry's state.

pub mod topology;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Serialize, Serializer};

use crate::inputs::WorkerType;

/// One worker-set shape of a `(namespace, model)` group: workers sharing a declared role and
/// needs, of which `live_count` are live.
///
/// Every element passed to [`evaluate`] is one distinct unit: the evaluator never merges
/// units, so the caller decides unit identity. (Dynamo's newest discovery also keys units by the
/// card's `model_type`, so same-role worker sets serving different surfaces stay distinct; that
/// is a grouping decision of the projection and changes nothing in the evaluation itself, except
/// through how many units it produces — which matters for `ambiguous`.)
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReadinessUnit {
    /// The declared role; `None` for legacy cards (which switch the group to legacy fallback).
    pub worker_type: Option<WorkerType>,
    /// Live workers of this unit; `0` means declared but dead.
    pub live_count: u32,
    /// Peer roles this unit needs: satisfied when every role of at least one inner set is present.
    /// Empty means no needs.
    pub needs: Vec<Vec<WorkerType>>,
}

/// Whether duplicate live units of a non-aggregated role make an entry unavailable.
///
/// The relay's configuration chooses. The default reports duplicates as a fact and leaves the
/// state alone; the strict policy treats an ambiguous topology as not ready for remote KV
/// sourcing (`ready && ambiguous.is_empty()`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum AmbiguityPolicy {
    /// Ambiguity is reported, readiness unchanged.
    #[default]
    Report,
    /// Ambiguity makes the entry unavailable.
    Unavailable,
}

/// The evaluation of one group of units.
///
/// Invariants: `missing` and `ambiguous` are empty when `legacy_fallback`; `ready` implies some
/// unit is live, and (outside the legacy fallback) that `missing` is empty; `ambiguous` never
/// contains AGGREGATED. `ready` does **not** include the ambiguity gate; see
/// [`Evaluation::ready_under`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Evaluation {
    /// Ready to serve under the shared rules, ignoring ambiguity.
    pub ready: bool,
    /// Typed roles with at least one live worker (legacy units contribute none).
    #[serde(serialize_with = "serialize_roles")]
    pub present: BTreeSet<WorkerType>,
    /// Roles declared but dead, or needed by a live unit and absent.
    #[serde(serialize_with = "serialize_roles")]
    pub missing: BTreeSet<WorkerType>,
    /// Some unit is legacy: strict gating is bypassed.
    pub legacy_fallback: bool,
    /// Non-aggregated roles with more than one live unit.
    #[serde(serialize_with = "serialize_roles")]
    pub ambiguous: BTreeSet<WorkerType>,
}

impl Evaluation {
    /// Readiness under `policy`: with [`AmbiguityPolicy::Unavailable`], an ambiguous role
    /// makes the group not ready.
    #[must_use]
    pub fn ready_under(&self, policy: AmbiguityPolicy) -> bool {
        match policy {
            AmbiguityPolicy::Report => self.ready,
            AmbiguityPolicy::Unavailable => self.ready_strict(),
        }
    }

    /// The strict composition a remote KV consumer needs: `ready && ambiguous.is_empty()`.
    #[must_use]
    pub fn ready_strict(&self) -> bool {
        self.ready && self.ambiguous.is_empty()
    }
}

/// Evaluate one `(namespace, model)` group of units.
#[must_use]
pub fn evaluate(units: &[ReadinessUnit]) -> Evaluation {
    evaluate_with_supplied(units, &BTreeSet::new())
}

/// [`evaluate`], with `supplied` roles counted as present although no unit provides them.
///
/// Adapter evaluation uses it for roles that are never adapter-bearing (ENCODE): their presence
/// comes from the base group.
fn evaluate_with_supplied(units: &[ReadinessUnit], supplied: &BTreeSet<WorkerType>) -> Evaluation {
    let any_live = units.iter().any(|unit| unit.live_count > 0);
    let mut present = supplied.clone();
    present.extend(
        units.iter().filter(|unit| unit.live_count > 0).filter_map(|unit| unit.worker_type),
    );

    if units.iter().any(|unit| unit.worker_type.is_none()) {
        return Evaluation {
            ready: any_live,
            present,
            missing: BTreeSet::new(),
            legacy_fallback: true,
            ambiguous: BTreeSet::new(),
        };
    }

    let mut live_units_per_role: BTreeMap<WorkerType, u32> = BTreeMap::new();
    let mut missing = BTreeSet::new();
    for unit in units {
        let Some(role) = unit.worker_type else { continue };
        if !present.contains(&role) {
            missing.insert(role);
        }
        if unit.live_count == 0 {
            continue;
        }
        let live_units = live_units_per_role.entry(role).or_insert(0);
        *live_units = live_units.saturating_add(1);
        if unit.needs.is_empty() {
            continue;
        }
        let satisfied =
            unit.needs.iter().any(|alternative| alternative.iter().all(|r| present.contains(r)));
        if !satisfied {
            missing.extend(unit.needs.iter().flatten().filter(|r| !present.contains(r)).copied());
        }
    }
    let ambiguous = live_units_per_role
        .into_iter()
        .filter(|&(role, live_units)| role != WorkerType::Aggregated && live_units > 1)
        .map(|(role, _)| role)
        .collect();

    let evaluation = Evaluation {
        ready: any_live && missing.is_empty(),
        present,
        missing,
        legacy_fallback: false,
        ambiguous,
    };
    debug_assert!(!evaluation.ambiguous.contains(&WorkerType::Aggregated));
    evaluation
}

/// The wire `ServingReadinessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReadinessState {
    /// Not yet authoritative (the zero value, and a valid state).
    Unknown,
    /// Authoritative and not ready.
    Unavailable,
    /// Authoritative and ready.
    Ready,
}

impl ReadinessState {
    /// The protobuf enum value: UNKNOWN=0, UNAVAILABLE=1, READY=2.
    #[must_use]
    pub fn wire_value(self) -> i32 {
        match self {
            ReadinessState::Unknown => 0,
            ReadinessState::Unavailable => 1,
            ReadinessState::Ready => 2,
        }
    }

    /// The state for a protobuf enum value; `None` for values this contract does not define.
    #[must_use]
    pub fn from_wire_value(value: i32) -> Option<Self> {
        match value {
            0 => Some(ReadinessState::Unknown),
            1 => Some(ReadinessState::Unavailable),
            2 => Some(ReadinessState::Ready),
            _ => None,
        }
    }

    /// A base entry's state: UNKNOWN until every participating endpoint has an authoritative
    /// availability snapshot, then READY iff the evaluation is ready under `policy`.
    #[must_use]
    pub fn of_base(
        authoritative: bool,
        evaluation: &Evaluation,
        policy: AmbiguityPolicy,
    ) -> ReadinessState {
        if !authoritative {
            ReadinessState::Unknown
        } else if evaluation.ready_under(policy) {
            ReadinessState::Ready
        } else {
            ReadinessState::Unavailable
        }
    }
}

/// Roles that never carry adapters: their presence comes from the base group.
const NON_ADAPTER_ROLES: [WorkerType; 1] = [WorkerType::Encode];

/// One adapter's readiness within a base entry.
///
/// Invariant: `missing` is empty when `state` is UNKNOWN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterEvaluation {
    /// The composed state.
    pub state: ReadinessState,
    /// Roles the adapter lacks, together with the base entry's missing roles.
    #[serde(serialize_with = "serialize_roles")]
    pub missing: BTreeSet<WorkerType>,
    /// The evaluation of the adapter's own units.
    pub evaluation: Evaluation,
}

/// Evaluate one LoRA adapter of a base entry.
///
/// `adapter_units` are the base unit construction restricted to the workers that advertise the
/// adapter. ENCODE workers never carry adapters: any ENCODE unit passed here is ignored, and
/// ENCODE counts as present for the adapter exactly when it is present in `base`, so an adapter
/// depends on the base's encoders without ever requiring them to advertise it.
///
/// The state passes UNKNOWN and UNAVAILABLE through from the base; otherwise it is READY iff the
/// adapter evaluation is ready under `policy`. Missing roles are the adapter's missing roles plus
/// the base's, and empty when UNKNOWN.
#[must_use]
pub fn evaluate_adapter(
    base_state: ReadinessState,
    base: &Evaluation,
    adapter_units: &[ReadinessUnit],
    policy: AmbiguityPolicy,
) -> AdapterEvaluation {
    let bearing_units: Vec<ReadinessUnit> = adapter_units
        .iter()
        .filter(|unit| !unit.worker_type.is_some_and(|role| NON_ADAPTER_ROLES.contains(&role)))
        .cloned()
        .collect();
    let supplied: BTreeSet<WorkerType> =
        NON_ADAPTER_ROLES.iter().filter(|role| base.present.contains(role)).copied().collect();
    let evaluation = evaluate_with_supplied(&bearing_units, &supplied);

    let state = adapter_state(base_state, &evaluation, policy);
    let missing = if state == ReadinessState::Unknown {
        BTreeSet::new()
    } else {
        evaluation.missing.union(&base.missing).copied().collect()
    };
    AdapterEvaluation { state, missing, evaluation }
}

/// Compose an adapter's state: the base's UNKNOWN or UNAVAILABLE passes through; a READY base
/// yields READY iff the adapter evaluation is ready under `policy`.
#[must_use]
pub fn adapter_state(
    base_state: ReadinessState,
    adapter: &Evaluation,
    policy: AmbiguityPolicy,
) -> ReadinessState {
    match base_state {
        ReadinessState::Unknown | ReadinessState::Unavailable => base_state,
        ReadinessState::Ready if adapter.ready_under(policy) => ReadinessState::Ready,
        ReadinessState::Ready => ReadinessState::Unavailable,
    }
}

/// Wire name of a role (the `WorkerRole` enum, without its prefix).
fn role_name(role: WorkerType) -> &'static str {
    match role {
        WorkerType::Prefill => "PREFILL",
        WorkerType::Decode => "DECODE",
        WorkerType::Encode => "ENCODE",
        WorkerType::Aggregated => "AGGREGATED",
    }
}

/// Serialize a role set as its wire names, in wire order (the set's order).
fn serialize_roles<S: Serializer>(
    roles: &BTreeSet<WorkerType>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(roles.iter().map(|&role| role_name(role)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use WorkerType::{Aggregated, Decode, Encode, Prefill};

    fn unit(
        worker_type: Option<WorkerType>,
        live_count: u32,
        needs: &[&[WorkerType]],
    ) -> ReadinessUnit {
        ReadinessUnit {
            worker_type,
            live_count,
            needs: needs.iter().map(|alternative| alternative.to_vec()).collect(),
        }
    }

    fn typed(role: WorkerType, live_count: u32, needs: &[&[WorkerType]]) -> ReadinessUnit {
        unit(Some(role), live_count, needs)
    }

    fn legacy(live_count: u32) -> ReadinessUnit {
        unit(None, live_count, &[])
    }

    fn roles(list: &[WorkerType]) -> BTreeSet<WorkerType> {
        list.iter().copied().collect()
    }

    const EPD_ENCODE_NEEDS: &[&[WorkerType]] = &[&[Prefill, Decode], &[Aggregated]];

    struct Case {
        name: &'static str,
        units: Vec<ReadinessUnit>,
        ready: bool,
        present: &'static [WorkerType],
        missing: &'static [WorkerType],
        legacy_fallback: bool,
        ambiguous: &'static [WorkerType],
    }

    fn cases() -> Vec<Case> {
        vec![
            Case {
                name: "aggregated ready",
                units: vec![typed(Aggregated, 2, &[])],
                ready: true,
                present: &[Aggregated],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "aggregated replicas on two endpoints are legal scale-out",
                units: vec![typed(Aggregated, 1, &[]), typed(Aggregated, 3, &[])],
                ready: true,
                present: &[Aggregated],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "pd ready with both present",
                units: vec![typed(Prefill, 1, &[&[Decode]]), typed(Decode, 1, &[&[Prefill]])],
                ready: true,
                present: &[Prefill, Decode],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "pd with decode dead misses decode",
                units: vec![typed(Prefill, 1, &[&[Decode]]), typed(Decode, 0, &[&[Prefill]])],
                ready: false,
                present: &[Prefill],
                missing: &[Decode],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "pd with prefill absent from membership misses prefill",
                units: vec![typed(Decode, 1, &[&[Prefill]])],
                ready: false,
                present: &[Decode],
                missing: &[Prefill],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "epd ready",
                units: vec![
                    typed(Encode, 1, EPD_ENCODE_NEEDS),
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                ready: true,
                present: &[Prefill, Decode, Encode],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "epd with encode dead misses encode",
                units: vec![
                    typed(Encode, 0, EPD_ENCODE_NEEDS),
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                ready: false,
                present: &[Prefill, Decode],
                missing: &[Encode],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "epd encode satisfied by the aggregated alternative",
                units: vec![typed(Encode, 1, EPD_ENCODE_NEEDS), typed(Aggregated, 1, &[])],
                ready: true,
                present: &[Encode, Aggregated],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "epd encode with nothing to hand off to misses every alternative's roles",
                units: vec![typed(Encode, 1, EPD_ENCODE_NEEDS)],
                ready: false,
                present: &[Encode],
                missing: &[Prefill, Decode, Aggregated],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "aggregated does not satisfy prefill or decode",
                units: vec![typed(Aggregated, 1, &[]), typed(Decode, 1, &[&[Prefill]])],
                ready: false,
                present: &[Decode, Aggregated],
                missing: &[Prefill],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "legacy only is ready iff any live",
                units: vec![legacy(1)],
                ready: true,
                present: &[],
                missing: &[],
                legacy_fallback: true,
                ambiguous: &[],
            },
            Case {
                name: "dead legacy only is not ready",
                units: vec![legacy(0)],
                ready: false,
                present: &[],
                missing: &[],
                legacy_fallback: true,
                ambiguous: &[],
            },
            Case {
                name: "mixed legacy and typed bypasses strict gating",
                units: vec![legacy(0), typed(Decode, 1, &[&[Prefill]]), typed(Prefill, 0, &[])],
                ready: true,
                present: &[Decode],
                missing: &[],
                legacy_fallback: true,
                ambiguous: &[],
            },
            Case {
                name: "mixed legacy and typed does not evaluate ambiguity",
                units: vec![legacy(1), typed(Prefill, 1, &[]), typed(Prefill, 1, &[])],
                ready: true,
                present: &[Prefill],
                missing: &[],
                legacy_fallback: true,
                ambiguous: &[],
            },
            Case {
                name: "dead unit's needs are ignored",
                units: vec![typed(Aggregated, 1, &[]), typed(Encode, 0, &[&[Prefill, Decode]])],
                ready: false,
                present: &[Aggregated],
                missing: &[Encode],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "a second, dead unit of a live role is not missing",
                units: vec![typed(Aggregated, 1, &[]), typed(Aggregated, 0, &[&[Encode]])],
                ready: true,
                present: &[Aggregated],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "empty input is not ready",
                units: vec![],
                ready: false,
                present: &[],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "duplicate live prefill units are ambiguous but ready",
                units: vec![
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Prefill, 2, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                ready: true,
                present: &[Prefill, Decode],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[Prefill],
            },
            Case {
                name: "a dead duplicate is not ambiguous",
                units: vec![
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Prefill, 0, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                ready: true,
                present: &[Prefill, Decode],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[],
            },
            Case {
                name: "duplicate encode and decode units are ambiguous, aggregated never",
                units: vec![
                    typed(Encode, 1, EPD_ENCODE_NEEDS),
                    typed(Encode, 1, EPD_ENCODE_NEEDS),
                    typed(Aggregated, 1, &[]),
                    typed(Aggregated, 1, &[]),
                    typed(Decode, 1, &[]),
                    typed(Decode, 1, &[]),
                ],
                ready: true,
                present: &[Decode, Encode, Aggregated],
                missing: &[],
                legacy_fallback: false,
                ambiguous: &[Decode, Encode],
            },
        ]
    }

    #[test]
    fn evaluation_follows_the_shared_rules() {
        for case in cases() {
            let evaluation = evaluate(&case.units);
            let expected = Evaluation {
                ready: case.ready,
                present: roles(case.present),
                missing: roles(case.missing),
                legacy_fallback: case.legacy_fallback,
                ambiguous: roles(case.ambiguous),
            };
            assert_eq!(evaluation, expected, "{}", case.name);
        }
    }

    #[test]
    fn ambiguity_gates_readiness_only_under_the_strict_policy() {
        let units = [
            typed(Prefill, 1, &[&[Decode]]),
            typed(Prefill, 1, &[&[Decode]]),
            typed(Decode, 1, &[&[Prefill]]),
        ];
        let evaluation = evaluate(&units);
        assert!(evaluation.ready, "the evaluator's ready excludes the ambiguity gate");
        assert!(evaluation.ready_under(AmbiguityPolicy::Report));
        assert!(!evaluation.ready_under(AmbiguityPolicy::Unavailable));
        assert!(!evaluation.ready_strict());
        assert_eq!(
            ReadinessState::of_base(true, &evaluation, AmbiguityPolicy::Report),
            ReadinessState::Ready
        );
        assert_eq!(
            ReadinessState::of_base(true, &evaluation, AmbiguityPolicy::Unavailable),
            ReadinessState::Unavailable
        );
        assert_eq!(AmbiguityPolicy::default(), AmbiguityPolicy::Report);
    }

    #[test]
    fn base_state_is_unknown_until_authoritative() {
        let ready = evaluate(&[typed(Aggregated, 1, &[])]);
        let dead = evaluate(&[typed(Aggregated, 0, &[])]);
        for policy in [AmbiguityPolicy::Report, AmbiguityPolicy::Unavailable] {
            assert_eq!(ReadinessState::of_base(false, &ready, policy), ReadinessState::Unknown);
            assert_eq!(ReadinessState::of_base(true, &ready, policy), ReadinessState::Ready);
            assert_eq!(ReadinessState::of_base(true, &dead, policy), ReadinessState::Unavailable);
        }
    }

    #[test]
    fn readiness_state_wire_values() {
        for (state, value) in [
            (ReadinessState::Unknown, 0),
            (ReadinessState::Unavailable, 1),
            (ReadinessState::Ready, 2),
        ] {
            assert_eq!(state.wire_value(), value);
            assert_eq!(ReadinessState::from_wire_value(value), Some(state));
        }
        assert_eq!(ReadinessState::from_wire_value(3), None);
        assert_eq!(ReadinessState::from_wire_value(-1), None);
    }

    #[test]
    fn adapter_state_passes_unknown_and_unavailable_through() {
        let ready = evaluate(&[typed(Aggregated, 1, &[])]);
        let not_ready = evaluate(&[typed(Aggregated, 0, &[])]);
        let policy = AmbiguityPolicy::Report;
        for adapter in [&ready, &not_ready] {
            assert_eq!(
                adapter_state(ReadinessState::Unknown, adapter, policy),
                ReadinessState::Unknown
            );
            assert_eq!(
                adapter_state(ReadinessState::Unavailable, adapter, policy),
                ReadinessState::Unavailable
            );
        }
        assert_eq!(adapter_state(ReadinessState::Ready, &ready, policy), ReadinessState::Ready);
        assert_eq!(
            adapter_state(ReadinessState::Ready, &not_ready, policy),
            ReadinessState::Unavailable
        );
    }

    struct AdapterCase {
        name: &'static str,
        base_units: Vec<ReadinessUnit>,
        authoritative: bool,
        adapter_units: Vec<ReadinessUnit>,
        state: ReadinessState,
        missing: &'static [WorkerType],
    }

    fn adapter_cases() -> Vec<AdapterCase> {
        let pd = || vec![typed(Prefill, 2, &[&[Decode]]), typed(Decode, 2, &[&[Prefill]])];
        let epd = || {
            vec![
                typed(Encode, 1, EPD_ENCODE_NEEDS),
                typed(Prefill, 1, &[&[Decode]]),
                typed(Decode, 1, &[&[Prefill, Encode]]),
            ]
        };
        vec![
            AdapterCase {
                name: "aggregated adapter on a live worker",
                base_units: vec![typed(Aggregated, 3, &[])],
                authoritative: true,
                adapter_units: vec![typed(Aggregated, 1, &[])],
                state: ReadinessState::Ready,
                missing: &[],
            },
            AdapterCase {
                name: "adapter only on dead workers",
                base_units: vec![typed(Aggregated, 3, &[])],
                authoritative: true,
                adapter_units: vec![typed(Aggregated, 0, &[])],
                state: ReadinessState::Unavailable,
                missing: &[Aggregated],
            },
            AdapterCase {
                name: "pd adapter present on both roles",
                base_units: pd(),
                authoritative: true,
                adapter_units: vec![
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                state: ReadinessState::Ready,
                missing: &[],
            },
            AdapterCase {
                name: "pd adapter only on decode misses prefill",
                base_units: pd(),
                authoritative: true,
                adapter_units: vec![typed(Decode, 1, &[&[Prefill]])],
                state: ReadinessState::Unavailable,
                missing: &[Prefill],
            },
            AdapterCase {
                name: "base unavailable passes through with the base's missing roles",
                base_units: vec![typed(Prefill, 1, &[&[Decode]]), typed(Decode, 0, &[&[Prefill]])],
                authoritative: true,
                adapter_units: vec![typed(Prefill, 1, &[&[Decode]])],
                state: ReadinessState::Unavailable,
                missing: &[Decode],
            },
            AdapterCase {
                name: "base unknown passes through with nothing missing",
                base_units: pd(),
                authoritative: false,
                adapter_units: vec![typed(Decode, 1, &[&[Prefill]])],
                state: ReadinessState::Unknown,
                missing: &[],
            },
            AdapterCase {
                name: "epd adapter never needs encode to advertise it",
                base_units: epd(),
                authoritative: true,
                adapter_units: vec![
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill, Encode]]),
                ],
                state: ReadinessState::Ready,
                missing: &[],
            },
            AdapterCase {
                name: "encode units handed in for an adapter are ignored",
                base_units: epd(),
                authoritative: true,
                adapter_units: vec![
                    typed(Encode, 0, EPD_ENCODE_NEEDS),
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill, Encode]]),
                ],
                state: ReadinessState::Ready,
                missing: &[],
            },
            AdapterCase {
                name: "epd with encode dead keeps the adapter unavailable",
                base_units: vec![
                    typed(Encode, 0, EPD_ENCODE_NEEDS),
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                authoritative: true,
                adapter_units: vec![
                    typed(Prefill, 1, &[&[Decode]]),
                    typed(Decode, 1, &[&[Prefill]]),
                ],
                state: ReadinessState::Unavailable,
                missing: &[Encode],
            },
            AdapterCase {
                name: "legacy adapter members are ready iff any is live",
                base_units: vec![legacy(2)],
                authoritative: true,
                adapter_units: vec![legacy(1)],
                state: ReadinessState::Ready,
                missing: &[],
            },
            AdapterCase {
                name: "dead legacy adapter members are unavailable",
                base_units: vec![legacy(2)],
                authoritative: true,
                adapter_units: vec![legacy(0)],
                state: ReadinessState::Unavailable,
                missing: &[],
            },
            AdapterCase {
                name: "no worker advertises the adapter",
                base_units: vec![typed(Aggregated, 1, &[])],
                authoritative: true,
                adapter_units: vec![],
                state: ReadinessState::Unavailable,
                missing: &[],
            },
        ]
    }

    #[test]
    fn adapter_readiness_composes_with_the_base() {
        let policy = AmbiguityPolicy::Report;
        for case in adapter_cases() {
            let base = evaluate(&case.base_units);
            let base_state = ReadinessState::of_base(case.authoritative, &base, policy);
            let adapter = evaluate_adapter(base_state, &base, &case.adapter_units, policy);
            assert_eq!(adapter.state, case.state, "{}", case.name);
            assert_eq!(adapter.missing, roles(case.missing), "{}", case.name);
        }
    }

    #[test]
    fn adapter_ambiguity_follows_the_policy() {
        let base_units = [typed(Aggregated, 1, &[]), typed(Decode, 1, &[])];
        let base = evaluate(&base_units);
        let adapter_units = [typed(Decode, 1, &[]), typed(Decode, 1, &[])];
        let report =
            evaluate_adapter(ReadinessState::Ready, &base, &adapter_units, AmbiguityPolicy::Report);
        assert_eq!(report.state, ReadinessState::Ready);
        assert_eq!(report.evaluation.ambiguous, roles(&[Decode]));
        let strict = evaluate_adapter(
            ReadinessState::Ready,
            &base,
            &adapter_units,
            AmbiguityPolicy::Unavailable,
        );
        assert_eq!(strict.state, ReadinessState::Unavailable);
    }

    #[test]
    fn evaluation_serializes_roles_by_wire_name_in_wire_order() {
        let evaluation = evaluate(&[
            typed(Encode, 0, EPD_ENCODE_NEEDS),
            typed(Decode, 1, &[&[Prefill]]),
            typed(Decode, 1, &[&[Prefill]]),
            typed(Prefill, 1, &[]),
        ]);
        let json = serde_json::to_string(&evaluation).unwrap();
        assert_eq!(
            json,
            r#"{"ready":false,"present":["PREFILL","DECODE"],"missing":["ENCODE"],"legacy_fallback":false,"ambiguous":["DECODE"]}"#
        );
        assert_eq!(
            serde_json::to_string(&ReadinessState::Unavailable).unwrap(),
            r#""UNAVAILABLE""#
        );
    }
}
