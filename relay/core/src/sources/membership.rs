//! KV event source membership of one serving endpoint (dc-inputs §3.1–§3.2, relay-facts §9.4).
//!
//! Joins three facts into a [`SourceView`]: the base-card runtime configs of the endpoint's
//! workers, the live worker set, and the publisher incarnations that advertised a KV event
//! source. The view says, per expected `(worker_id, dp_rank)`, which incarnation (if any) is the
//! rank's active source, and carries the rank's lifecycle generation: the cold-reset fence a
//! consumer compares before accepting events from a source.
//!
//! Invariants:
//! - Expected ranks come only from workers that are live **and** have a base runtime config;
//!   an advertisement alone never creates an expected rank.
//! - A rank is active only with exactly one advertising incarnation and an unambiguous KV-state
//!   endpoint; anything else withholds the rank's KV (fail closed) while serving goes on.
//! - A lifecycle generation is drawn from one counter per membership and never reused: it
//!   changes exactly when a rank (re)activates a source, including when the same incarnation
//!   becomes active again after an ambiguity or an absence.
//! - Removal of an advertisement is specific to its publisher id (see [`AdvertTable`]).

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::inputs::{KvEventSourceAdvert, RecoveryTarget, RuntimeConfig};
use crate::model::identity::EndpointPath;
use crate::model::kv_events::SourceKey;

/// Largest `data_parallel_size` a worker may declare; larger (or zero) contributes no ranks.
pub const DATA_PARALLEL_SIZE_MAX: u32 = 4096;

/// Most expected ranks one endpoint may have. A worker whose ranks would exceed it contributes
/// none (diagnosed with [`MembershipDiagnostic::ExpectedRanksLimit`]); workers are considered in
/// worker-id order, so the choice is deterministic.
pub const EXPECTED_RANKS_MAX: usize = 65_536;

/// Most advertisement descriptors an [`AdvertTable`] holds; further advertisements are refused
/// (the rank stays `Missing`, so its KV is withheld rather than guessed).
pub const ADVERTS_MAX: usize = 65_536;

/// The KV-state endpoint the endpoint's workers publish their events under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvStateEndpointResolution {
    /// No live worker with a base card: nothing to resolve.
    NoWorkers,
    /// Every base runtime config maps to this endpoint.
    Resolved(EndpointPath),
    /// The base runtime configs disagree: KV handling fails closed for every rank.
    Ambiguous(BTreeSet<EndpointPath>),
}

/// Why a rank's source is ambiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceAmbiguity {
    /// More than one publisher incarnation advertises the rank (they overlap, e.g. during a
    /// Kubernetes restart).
    Incarnations {
        /// The overlapping incarnations.
        publisher_ids: BTreeSet<u64>,
    },
    /// One publisher id was advertised with more than one descriptor.
    ConflictingDescriptor {
        /// The conflicting publisher id.
        publisher_id: u64,
    },
    /// The endpoint's workers disagree on the KV-state endpoint.
    EndpointMapping,
}

/// The source status of one expected rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankSourceStatus {
    /// No incarnation advertises the rank.
    Missing,
    /// Exactly one incarnation, and it answers recovery queries.
    ActiveRecoverable {
        /// The active incarnation.
        publisher_id: u64,
        /// Where to send its recovery queries.
        recovery_target: RecoveryTarget,
    },
    /// Exactly one incarnation, without recovery: best-effort live events only.
    ActiveLiveOnly {
        /// The active incarnation.
        publisher_id: u64,
    },
    /// The rank's source cannot be determined; its KV is withheld.
    Ambiguous(SourceAmbiguity),
}

impl RankSourceStatus {
    /// The active incarnation, if the rank has one.
    #[must_use]
    pub fn active_publisher(&self) -> Option<u64> {
        match self {
            RankSourceStatus::ActiveRecoverable { publisher_id, .. }
            | RankSourceStatus::ActiveLiveOnly { publisher_id } => Some(*publisher_id),
            RankSourceStatus::Missing | RankSourceStatus::Ambiguous(_) => None,
        }
    }

    /// The recovery target of the active incarnation, if it has one.
    #[must_use]
    pub fn recovery_target(&self) -> Option<&RecoveryTarget> {
        match self {
            RankSourceStatus::ActiveRecoverable { recovery_target, .. } => Some(recovery_target),
            _ => None,
        }
    }
}

/// What the view says about one expected rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankView {
    /// The rank's source status.
    pub status: RankSourceStatus,
    /// Cumulative cold-reset fence: when it differs from the value a consumer last accepted, the
    /// consumer must cold-reset the rank before taking events from the active source. 0 means
    /// the rank never had an active source in this membership.
    pub lifecycle_generation: u64,
    /// The worker runs a local indexer (`enable_local_indexer`), so recovery is expected.
    pub recovery_expected: bool,
}

/// A non-fatal fact found while projecting membership. Each names the input it is about.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MembershipDiagnostic {
    /// The worker's `data_parallel_size` is outside `1..=DATA_PARALLEL_SIZE_MAX`; it contributes
    /// no ranks.
    #[error(
        "worker {worker_id} declares data_parallel_size {data_parallel_size}, outside 1..={DATA_PARALLEL_SIZE_MAX}"
    )]
    InvalidDataParallelSize {
        /// The worker.
        worker_id: u64,
        /// The declared size.
        data_parallel_size: u32,
    },
    /// The worker's rank range does not fit in `u32`; it contributes no ranks.
    #[error("worker {worker_id} declares ranks {start_rank}+{data_parallel_size}, beyond u32")]
    DataParallelRangeOverflow {
        /// The worker.
        worker_id: u64,
        /// The declared first rank.
        start_rank: u32,
        /// The declared size.
        data_parallel_size: u32,
    },
    /// Adding the worker's ranks would exceed [`EXPECTED_RANKS_MAX`]; it contributes no ranks.
    #[error("worker {worker_id} would exceed {EXPECTED_RANKS_MAX} expected ranks")]
    ExpectedRanksLimit {
        /// The worker.
        worker_id: u64,
    },
    /// The base runtime configs name more than one KV-state endpoint.
    #[error("base runtime configs name {} distinct KV-state endpoints", endpoints.len())]
    AmbiguousKvStateEndpoint {
        /// The distinct endpoints.
        endpoints: BTreeSet<EndpointPath>,
    },
    /// An advertisement in scope names a rank that is not expected (source-only): ignored.
    #[error("publisher {publisher_id:#x} advertises unexpected rank {rank:?}")]
    UnexpectedSource {
        /// The advertised rank.
        rank: SourceKey,
        /// The incarnation.
        publisher_id: u64,
    },
    /// The worker runs a local indexer but its active incarnation has no recovery target: the
    /// rank runs live-only.
    #[error("rank {rank:?} expects recovery but publisher {publisher_id:#x} has no target")]
    RecoveryTargetMissing {
        /// The rank.
        rank: SourceKey,
        /// The incarnation.
        publisher_id: u64,
    },
}

/// The joined source membership of one serving endpoint at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceView {
    /// The serving endpoint this view is for.
    pub serving_endpoint: EndpointPath,
    /// The endpoint's KV-state endpoint.
    pub kv_state_endpoint: KvStateEndpointResolution,
    /// Every expected rank (at most [`EXPECTED_RANKS_MAX`]).
    pub ranks: BTreeMap<SourceKey, RankView>,
    /// What was found along the way, in a deterministic order (at most one per worker config
    /// and one per advertisement, plus one for the endpoint mapping).
    pub diagnostics: Vec<MembershipDiagnostic>,
}

impl SourceView {
    /// The KV-state endpoint, when it resolved to exactly one.
    #[must_use]
    pub fn resolved_kv_state_endpoint(&self) -> Option<&EndpointPath> {
        match &self.kv_state_endpoint {
            KvStateEndpointResolution::Resolved(endpoint) => Some(endpoint),
            _ => None,
        }
    }

    /// Whether any expected rank has an active (recoverable or live-only) source: the
    /// materialization gate of relay-facts §9.5.
    #[must_use]
    pub fn has_active_source(&self) -> bool {
        self.ranks.values().any(|rank| rank.status.active_publisher().is_some())
    }
}

/// What a rank's last activation was, kept between projections.
#[derive(Debug, Clone)]
struct ActivationRecord {
    /// The activation in force now; `None` while the rank has no active source.
    active: Option<ActivationIdentity>,
    /// The generation of the last activation (0: never activated).
    generation: u64,
}

/// The stateful membership projection of one serving endpoint.
///
/// State between projections is only what lifecycle generations need: per expected rank, the
/// currently active advertisement and its generation (bounded by [`EXPECTED_RANKS_MAX`]; ranks
/// that stop being expected are forgotten, which is safe because generations are never reused).
#[derive(Debug, Clone)]
pub struct KvSourceMembership {
    serving_endpoint: EndpointPath,
    records: BTreeMap<SourceKey, ActivationRecord>,
    generation_last: u64,
}

impl KvSourceMembership {
    /// A membership for `serving_endpoint` with no history.
    #[must_use]
    pub fn new(serving_endpoint: EndpointPath) -> Self {
        KvSourceMembership { serving_endpoint, records: BTreeMap::new(), generation_last: 0 }
    }

    /// The serving endpoint.
    #[must_use]
    pub fn serving_endpoint(&self) -> &EndpointPath {
        &self.serving_endpoint
    }

    /// Project the current facts into a view, advancing lifecycle generations of ranks that
    /// (re)activate a source.
    ///
    /// - `runtime_configs`: the base-card runtime config of each worker of the endpoint;
    /// - `live_workers`: the endpoint's live instances;
    /// - `adverts`: advertisements, possibly of other scopes too (only those under the resolved
    ///   KV-state endpoint count for ranks; all of them count for descriptor conflicts).
    pub fn project<'a>(
        &mut self,
        runtime_configs: &BTreeMap<u64, RuntimeConfig>,
        live_workers: &BTreeSet<u64>,
        adverts: impl IntoIterator<Item = &'a KvEventSourceAdvert>,
    ) -> SourceView {
        let mut diagnostics = Vec::new();
        let configs: Vec<(u64, &RuntimeConfig)> = runtime_configs
            .iter()
            .filter(|(worker_id, _)| live_workers.contains(worker_id))
            .map(|(worker_id, config)| (*worker_id, config))
            .collect();

        let kv_state_endpoint = self.resolve_kv_state_endpoint(&configs, &mut diagnostics);
        let expected = expected_ranks(&configs, &mut diagnostics);

        // Distinct descriptors per publisher id, across every scope handed in.
        let mut by_publisher: BTreeMap<u64, BTreeSet<&KvEventSourceAdvert>> = BTreeMap::new();
        for advert in adverts {
            by_publisher.entry(advert.publisher_id).or_default().insert(advert);
        }

        let mut statuses: BTreeMap<SourceKey, RankSourceStatus> = BTreeMap::new();
        match &kv_state_endpoint {
            KvStateEndpointResolution::Resolved(scope) => {
                let mut conflicted: BTreeMap<SourceKey, u64> = BTreeMap::new();
                let mut candidates: BTreeMap<SourceKey, Vec<&KvEventSourceAdvert>> =
                    BTreeMap::new();
                for (&publisher_id, descriptors) in &by_publisher {
                    let conflicting = descriptors.len() > 1;
                    for advert in descriptors.iter().filter(|a| &a.kv_state_endpoint == scope) {
                        if !expected.contains_key(&advert.source) {
                            diagnostics.push(MembershipDiagnostic::UnexpectedSource {
                                rank: advert.source,
                                publisher_id,
                            });
                        } else if conflicting {
                            conflicted.entry(advert.source).or_insert(publisher_id);
                        } else {
                            candidates.entry(advert.source).or_default().push(advert);
                        }
                    }
                }
                for (&source, &recovery_expected) in &expected {
                    let status = if let Some(&publisher_id) = conflicted.get(&source) {
                        RankSourceStatus::Ambiguous(SourceAmbiguity::ConflictingDescriptor {
                            publisher_id,
                        })
                    } else {
                        match candidates.get(&source).map(Vec::as_slice) {
                            None | Some([]) => RankSourceStatus::Missing,
                            Some([advert]) => {
                                active_status(advert, recovery_expected, &mut diagnostics)
                            }
                            Some(many) => {
                                RankSourceStatus::Ambiguous(SourceAmbiguity::Incarnations {
                                    publisher_ids: many.iter().map(|a| a.publisher_id).collect(),
                                })
                            }
                        }
                    };
                    statuses.insert(source, status);
                }
            }
            KvStateEndpointResolution::Ambiguous(_) => {
                for &source in expected.keys() {
                    statuses.insert(
                        source,
                        RankSourceStatus::Ambiguous(SourceAmbiguity::EndpointMapping),
                    );
                }
            }
            // No configs means no expected ranks.
            KvStateEndpointResolution::NoWorkers => {}
        }

        let ranks = self.advance_generations(statuses, &expected);
        debug_assert!(ranks.len() <= EXPECTED_RANKS_MAX);
        debug_assert_eq!(ranks.len(), self.records.len());
        SourceView {
            serving_endpoint: self.serving_endpoint.clone(),
            kv_state_endpoint,
            ranks,
            diagnostics,
        }
    }

    /// Resolve the KV-state endpoint over every live base runtime config (omitted = serving).
    fn resolve_kv_state_endpoint(
        &self,
        configs: &[(u64, &RuntimeConfig)],
        diagnostics: &mut Vec<MembershipDiagnostic>,
    ) -> KvStateEndpointResolution {
        let endpoints: BTreeSet<EndpointPath> = configs
            .iter()
            .map(|(_, config)| {
                config.kv_state_endpoint.clone().unwrap_or_else(|| self.serving_endpoint.clone())
            })
            .collect();
        if endpoints.len() > 1 {
            diagnostics.push(MembershipDiagnostic::AmbiguousKvStateEndpoint {
                endpoints: endpoints.clone(),
            });
            return KvStateEndpointResolution::Ambiguous(endpoints);
        }
        endpoints
            .into_iter()
            .next()
            .map_or(KvStateEndpointResolution::NoWorkers, KvStateEndpointResolution::Resolved)
    }

    /// Attach lifecycle generations, drawing a new one for every (re)activation, and forget
    /// ranks that are no longer expected.
    fn advance_generations(
        &mut self,
        mut statuses: BTreeMap<SourceKey, RankSourceStatus>,
        expected: &BTreeMap<SourceKey, bool>,
    ) -> BTreeMap<SourceKey, RankView> {
        let mut previous = std::mem::take(&mut self.records);
        let mut ranks = BTreeMap::new();
        for (&source, &recovery_expected) in expected {
            let status = statuses.remove(&source).unwrap_or(RankSourceStatus::Missing);
            let active = activation_identity(&status);
            let record = match (previous.remove(&source), active) {
                (Some(record), Some(identity)) if record.active.as_ref() == Some(&identity) => {
                    record
                }
                (_, Some(identity)) => {
                    // 2^64 activations cannot happen within one process; saturating keeps the
                    // function total without a panic path.
                    self.generation_last = self.generation_last.saturating_add(1);
                    ActivationRecord { active: Some(identity), generation: self.generation_last }
                }
                (Some(record), None) => {
                    ActivationRecord { active: None, generation: record.generation }
                }
                (None, None) => ActivationRecord { active: None, generation: 0 },
            };
            ranks.insert(
                source,
                RankView { status, lifecycle_generation: record.generation, recovery_expected },
            );
            self.records.insert(source, record);
        }
        ranks
    }
}

/// What identifies one activation of a rank: the incarnation and its recovery target. The scope
/// is not part of it: a changed KV-state endpoint changes the resolution, which deactivates every
/// rank first.
type ActivationIdentity = (u64, Option<RecoveryTarget>);

/// The activation identity of an active status.
fn activation_identity(status: &RankSourceStatus) -> Option<ActivationIdentity> {
    match status {
        RankSourceStatus::ActiveRecoverable { publisher_id, recovery_target } => {
            Some((*publisher_id, Some(recovery_target.clone())))
        }
        RankSourceStatus::ActiveLiveOnly { publisher_id } => Some((*publisher_id, None)),
        RankSourceStatus::Missing | RankSourceStatus::Ambiguous(_) => None,
    }
}

/// The status of a rank with exactly one advertising incarnation.
fn active_status(
    advert: &KvEventSourceAdvert,
    recovery_expected: bool,
    diagnostics: &mut Vec<MembershipDiagnostic>,
) -> RankSourceStatus {
    match &advert.recovery_target {
        Some(target) => RankSourceStatus::ActiveRecoverable {
            publisher_id: advert.publisher_id,
            recovery_target: target.clone(),
        },
        None => {
            if recovery_expected {
                diagnostics.push(MembershipDiagnostic::RecoveryTargetMissing {
                    rank: advert.source,
                    publisher_id: advert.publisher_id,
                });
            }
            RankSourceStatus::ActiveLiveOnly { publisher_id: advert.publisher_id }
        }
    }
}

/// Expected ranks and whether each expects recovery, from the live base runtime configs.
fn expected_ranks(
    configs: &[(u64, &RuntimeConfig)],
    diagnostics: &mut Vec<MembershipDiagnostic>,
) -> BTreeMap<SourceKey, bool> {
    let mut expected = BTreeMap::new();
    for &(worker_id, config) in configs {
        let size = config.data_parallel_size;
        let start = config.data_parallel_start_rank;
        if !(1..=DATA_PARALLEL_SIZE_MAX).contains(&size) {
            diagnostics.push(MembershipDiagnostic::InvalidDataParallelSize {
                worker_id,
                data_parallel_size: size,
            });
            continue;
        }
        if start.checked_add(size - 1).is_none() {
            diagnostics.push(MembershipDiagnostic::DataParallelRangeOverflow {
                worker_id,
                start_rank: start,
                data_parallel_size: size,
            });
            continue;
        }
        if expected.len() + size as usize > EXPECTED_RANKS_MAX {
            diagnostics.push(MembershipDiagnostic::ExpectedRanksLimit { worker_id });
            continue;
        }
        for offset in 0..size {
            let source = SourceKey { worker_id, dp_rank: start + offset };
            expected.insert(source, config.enable_local_indexer);
        }
    }
    expected
}

/// How an advertisement changed an [`AdvertTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvertChange {
    /// A new incarnation was recorded.
    Added,
    /// The identical descriptor was already present.
    Unchanged,
    /// The publisher id was already advertised with a different descriptor; both are kept and
    /// the ranks they name become `Ambiguous{ConflictingDescriptor}` until one is withdrawn.
    Conflicting,
}

/// Why an advertisement was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum AdvertTableError {
    /// The table already holds [`ADVERTS_MAX`] descriptors.
    #[error("advertisement table is full ({capacity} descriptors)")]
    Full {
        /// The bound.
        capacity: usize,
    },
}

/// The advertisements currently present in discovery, fed by `SourceAdvertised` /
/// `SourceWithdrawn` inputs.
///
/// Keyed by publisher id; a publisher id normally has exactly one immutable descriptor. A second,
/// different descriptor under the same id is kept side by side (a conflict the membership
/// projection reports). Bounded by [`ADVERTS_MAX`] descriptors: beyond it new advertisements are
/// refused with [`AdvertTableError::Full`].
#[derive(Debug, Clone, Default)]
pub struct AdvertTable {
    by_publisher: BTreeMap<u64, BTreeSet<KvEventSourceAdvert>>,
    descriptor_count: usize,
}

impl AdvertTable {
    /// An empty table.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Record an advertisement.
    pub fn advertise(
        &mut self,
        advert: KvEventSourceAdvert,
    ) -> Result<AdvertChange, AdvertTableError> {
        let descriptors = self.by_publisher.get(&advert.publisher_id);
        if descriptors.is_some_and(|set| set.contains(&advert)) {
            return Ok(AdvertChange::Unchanged);
        }
        if self.descriptor_count >= ADVERTS_MAX {
            return Err(AdvertTableError::Full { capacity: ADVERTS_MAX });
        }
        let set = self.by_publisher.entry(advert.publisher_id).or_default();
        let change = if set.is_empty() { AdvertChange::Added } else { AdvertChange::Conflicting };
        set.insert(advert);
        self.descriptor_count += 1;
        Ok(change)
    }

    /// Remove the advertisement(s) of exactly this incarnation under this scope; returns how
    /// many descriptors went. Other incarnations of the same rank are untouched.
    pub fn withdraw(&mut self, kv_state_endpoint: &EndpointPath, publisher_id: u64) -> usize {
        let Some(set) = self.by_publisher.get_mut(&publisher_id) else {
            return 0;
        };
        let before = set.len();
        set.retain(|advert| &advert.kv_state_endpoint != kv_state_endpoint);
        let removed = before - set.len();
        if set.is_empty() {
            self.by_publisher.remove(&publisher_id);
        }
        self.descriptor_count -= removed;
        removed
    }

    /// Every descriptor, in publisher-id order.
    pub fn iter(&self) -> impl Iterator<Item = &KvEventSourceAdvert> + '_ {
        self.by_publisher.values().flatten()
    }

    /// Number of descriptors held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.descriptor_count
    }

    /// Whether the table is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.descriptor_count == 0
    }
}
