//! Side-by-side comparison of what two relays publish about the same deployment, pure.
//!
//! Two relays watching the same workers (say Dynamo's relay and `kvrelay serve`) should publish
//! the same catalog, readiness, load and filter membership. Their relay identities, producer
//! incarnations, layout generations, revisions and sequences legitimately differ, so those are
//! never compared. What is compared, per section:
//! - **catalog**, per pool id: presence, serving endpoint, registrations, query semantics,
//!   pool roles, CKF format, and the quarantined entries' keys;
//! - **readiness**, per `(namespace, canonical model)`: state, present and missing roles,
//!   members (endpoint, roles, linked pool), duplicate role endpoints, legacy fallback, adapters;
//! - **load**, per pool id: used blocks, capacity, observed and expected ranks;
//! - **filter**, per pool id catalogued by both: whether both replicas are installed, the
//!   occupied-slot count, and the multiset of canonical filter items.
//!
//! A cuckoo filter's bucket words depend on insertion order and on the random choices of its
//! kicks, so equal membership need not give equal words. A fingerprint `f` sitting in bucket `b`
//! stands for an item whose two candidate buckets are `b` and `alternate(b, f)`; the pair
//! `(min(b, alternate(b, f)), f)` is therefore the same wherever the item was placed. Two filters
//! of one format whose multisets of such pairs are equal answer every membership probe alike,
//! whatever their placement. Word equality is reported too, as information.
//!
//! Invariants: the result lists differences in section and key order, fields in check order; nothing here
//! panics on any input (a filter copy whose word count does not match its format is reported as
//! a difference, not decoded).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::render::{hash_format_name, registration, role_name, state_name};
use super::state::{ConsumerSnapshot, FilterCopy, FilterStatus};
use kvrelay_core::discovery::WorkerRole;
use kvrelay_core::filter::ckf::{Addressing, CkfFormat, FINGERPRINT_BITS, SLOTS_PER_BUCKET};
use kvrelay_core::host::PoolDescriptor;
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::readiness::topology::{TopologyEntry, TopologyMember};
use kvrelay_core::wire::PoolLoad;

/// What part of the relays' output a difference is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Section {
    /// `SubscribeKvPoolCatalog`.
    Catalog,
    /// `SubscribeServingReadiness`.
    Readiness,
    /// `SubscribeKvLoad`.
    Load,
    /// `SubscribeKvPool` replicas.
    Filter,
}

impl Section {
    /// Every section, in report order.
    pub const ALL: [Section; 4] =
        [Section::Catalog, Section::Readiness, Section::Load, Section::Filter];

    /// Lowercase name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Section::Catalog => "catalog",
            Section::Readiness => "readiness",
            Section::Load => "load",
            Section::Filter => "filter",
        }
    }
}

impl fmt::Display for Section {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// One field on which the two sides disagree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Where.
    pub section: Section,
    /// The pool id or readiness key.
    pub key: String,
    /// The field name.
    pub field: &'static str,
    /// The left side's value (`absent` when the key is missing there).
    pub left: String,
    /// The right side's value.
    pub right: String,
}

/// One pool's filter comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterSummary {
    /// The pool.
    pub pool_id: PoolId,
    /// Occupied slots of the left replica.
    pub left_slots: u64,
    /// Occupied slots of the right replica.
    pub right_slots: u64,
    /// Canonical items held by the left replica only (counted with multiplicity).
    pub only_left: u64,
    /// Canonical items held by the right replica only.
    pub only_right: u64,
    /// Whether the bucket words are identical too.
    pub identical_words: bool,
}

impl FilterSummary {
    /// Whether both replicas hold the same membership.
    #[must_use]
    pub fn same_membership(&self) -> bool {
        self.only_left == 0 && self.only_right == 0
    }
}

/// Which side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// The left side.
    Left,
    /// The right side.
    Right,
}

/// A pool whose load the two sides agree on except that one has observed every expected rank
/// and the other has not: same expected ranks and capacity, one complete (`kv_used_blocks`
/// known), the other degraded with fewer ranks observed. Kept apart from the differences so a
/// caller can accept one side seeing more (a worker's only report for a rank came before one
/// relay knew the rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoverageGap {
    /// The pool.
    pub pool_id: PoolId,
    /// The side that observed every expected rank.
    pub complete: Which,
    /// Ranks observed on the left side.
    pub left_observed: u32,
    /// Ranks observed on the right side.
    pub right_observed: u32,
    /// Ranks both sides expect.
    pub expected: u32,
}

/// Entry counts of one section on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Left side.
    pub left: usize,
    /// Right side.
    pub right: usize,
}

/// The result of comparing two sides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Comparison {
    /// Catalogued pools.
    pub pools: Counts,
    /// Readiness entries.
    pub readiness: Counts,
    /// Load entries.
    pub load: Counts,
    /// One summary per pool whose replicas are installed on both sides.
    pub filters: Vec<FilterSummary>,
    /// Every disagreement, in section, key and field order.
    pub differences: Vec<Difference>,
    /// Pools whose load differs only in coverage ([`CoverageGap`]), in pool order.
    pub coverage_gaps: Vec<CoverageGap>,
}

impl Comparison {
    /// Whether the sides agree on everything compared.
    #[must_use]
    pub fn matches(&self) -> bool {
        self.differences.is_empty() && self.coverage_gaps.is_empty()
    }

    /// Whether the sides agree on everything compared, except pools whose load `side` alone
    /// observed completely.
    #[must_use]
    pub fn matches_where_more_complete(&self, side: Which) -> bool {
        self.differences.is_empty() && self.coverage_gaps.iter().all(|gap| gap.complete == side)
    }

    /// Differences in `section`.
    #[must_use]
    pub fn differences_in(&self, section: Section) -> usize {
        self.differences.iter().filter(|difference| difference.section == section).count()
    }
}

/// One relay's view: the consumer snapshot and copies of its installed replicas.
#[derive(Debug, Clone, Copy)]
pub struct Side<'a> {
    /// Catalog, readiness and load.
    pub snapshot: &'a ConsumerSnapshot,
    /// Installed replicas by pool.
    pub filters: &'a BTreeMap<PoolId, FilterCopy>,
}

/// Collects differences of one key.
struct Fields<'d> {
    out: &'d mut Vec<Difference>,
    section: Section,
    key: String,
}

impl Fields<'_> {
    fn check(&mut self, field: &'static str, left: String, right: String) {
        if left != right {
            self.out.push(Difference {
                section: self.section,
                key: self.key.clone(),
                field,
                left,
                right,
            });
        }
    }
}

const ABSENT: &str = "absent";

fn role_list<'a>(roles: impl IntoIterator<Item = &'a WorkerRole>) -> String {
    let names: Vec<&str> = roles.into_iter().map(|role| role_name(*role)).collect();
    format!("[{}]", names.join(","))
}

fn registrations(descriptor: &PoolDescriptor) -> String {
    let models: Vec<String> = descriptor.registrations.iter().map(registration).collect();
    format!("[{}]", models.join("; "))
}

fn format_text(format: &CkfFormat) -> String {
    format!(
        "v{} seed={:#x} buckets={} fp_bits={} slots={}",
        format.format_version,
        format.seed,
        format.bucket_count,
        format.fingerprint_bits,
        format.slots_per_bucket
    )
}

fn member_text(member: &TopologyMember) -> String {
    let pool = member.pool_id.map_or_else(|| "-".to_owned(), |pool_id| pool_id.to_string());
    format!("{} {} pool={}", member.endpoint, role_list(&member.roles), pool)
}

fn joined(items: impl IntoIterator<Item = String>) -> String {
    let items: Vec<String> = items.into_iter().collect();
    format!("[{}]", items.join(", "))
}

fn compare_pool(fields: &mut Fields<'_>, left: &PoolDescriptor, right: &PoolDescriptor) {
    fields.check(
        "serving_endpoint",
        left.serving_endpoint.to_string(),
        right.serving_endpoint.to_string(),
    );
    fields.check("registrations", registrations(left), registrations(right));
    fields.check(
        "query_semantics",
        format!(
            "block={} hash={}",
            left.query_semantics.kv_block_size,
            hash_format_name(left.query_semantics.hash_format)
        ),
        format!(
            "block={} hash={}",
            right.query_semantics.kv_block_size,
            hash_format_name(right.query_semantics.hash_format)
        ),
    );
    fields.check("pool_roles", role_list(&left.pool_roles), role_list(&right.pool_roles));
    fields.check(
        "ckf_format",
        format_text(&left.producer.format()),
        format_text(&right.producer.format()),
    );
}

fn compare_catalog(left: &ConsumerSnapshot, right: &ConsumerSnapshot, out: &mut Vec<Difference>) {
    let left_pools: BTreeMap<PoolId, &PoolDescriptor> =
        left.pools.iter().map(|pool| (pool.descriptor.pool_id(), &pool.descriptor)).collect();
    let right_pools: BTreeMap<PoolId, &PoolDescriptor> =
        right.pools.iter().map(|pool| (pool.descriptor.pool_id(), &pool.descriptor)).collect();
    let keys: BTreeSet<PoolId> = left_pools.keys().chain(right_pools.keys()).copied().collect();
    for pool_id in keys {
        let mut fields = Fields { out, section: Section::Catalog, key: pool_id.to_string() };
        match (left_pools.get(&pool_id), right_pools.get(&pool_id)) {
            (Some(l), Some(r)) => compare_pool(&mut fields, l, r),
            (l, r) => {
                let describe = |side: Option<&&PoolDescriptor>| {
                    side.map_or_else(
                        || ABSENT.to_owned(),
                        |d| format!("{} {}", d.serving_endpoint, registrations(d)),
                    )
                };
                fields.check("pool", describe(l), describe(r));
            }
        }
    }
    let quarantined = |snapshot: &ConsumerSnapshot| {
        joined(snapshot.quarantined_pools.iter().map(|entry| format!("{}", entry.key)))
    };
    Fields { out, section: Section::Catalog, key: "quarantined".to_owned() }.check(
        "entries",
        quarantined(left),
        quarantined(right),
    );
}

fn compare_entry(fields: &mut Fields<'_>, left: &TopologyEntry, right: &TopologyEntry) {
    fields.check("state", state_name(left.state).to_owned(), state_name(right.state).to_owned());
    fields.check("present_roles", role_list(&left.present_roles), role_list(&right.present_roles));
    fields.check("missing_roles", role_list(&left.missing_roles), role_list(&right.missing_roles));
    fields.check(
        "members",
        joined(left.members.iter().map(member_text)),
        joined(right.members.iter().map(member_text)),
    );
    fields.check(
        "duplicate_role_endpoints",
        role_list(&left.duplicate_role_endpoints),
        role_list(&right.duplicate_role_endpoints),
    );
    fields.check(
        "legacy_fallback_active",
        left.legacy_fallback_active.to_string(),
        right.legacy_fallback_active.to_string(),
    );
    let adapters = |entry: &TopologyEntry| {
        joined(entry.adapters.iter().map(|adapter| {
            format!(
                "{}:{} missing={}",
                adapter.canonical_model_id,
                state_name(adapter.state),
                role_list(&adapter.missing_roles)
            )
        }))
    };
    fields.check("adapters", adapters(left), adapters(right));
}

fn compare_readiness(left: &ConsumerSnapshot, right: &ConsumerSnapshot, out: &mut Vec<Difference>) {
    let by_key = |snapshot: &ConsumerSnapshot| -> BTreeMap<String, TopologyEntry> {
        snapshot
            .readiness
            .iter()
            .map(|entry| {
                (format!("{}/{}", entry.namespace, entry.canonical_model_id), entry.clone())
            })
            .collect()
    };
    let (left_entries, right_entries) = (by_key(left), by_key(right));
    let keys: BTreeSet<&String> = left_entries.keys().chain(right_entries.keys()).collect();
    for key in keys {
        let mut fields = Fields { out, section: Section::Readiness, key: key.clone() };
        match (left_entries.get(key), right_entries.get(key)) {
            (Some(l), Some(r)) => compare_entry(&mut fields, l, r),
            (l, r) => {
                let describe = |side: Option<&TopologyEntry>| {
                    side.map_or_else(|| ABSENT.to_owned(), |e| state_name(e.state).to_owned())
                };
                fields.check("entry", describe(l), describe(r));
            }
        }
    }
}

fn load_text(load: Option<&PoolLoad>) -> [String; 4] {
    let number = |value: Option<u64>| value.map_or_else(|| "?".to_owned(), |n| n.to_string());
    match load {
        None => [ABSENT.to_owned(), ABSENT.to_owned(), ABSENT.to_owned(), ABSENT.to_owned()],
        Some(load) => [
            number(load.kv_used_blocks),
            number(load.total_kv_blocks),
            load.kv_observed_ranks.to_string(),
            load.kv_expected_ranks.to_string(),
        ],
    }
}

/// The side whose load alone covers every expected rank, when that is the only difference.
fn coverage_gap(pool_id: PoolId, left: &PoolLoad, right: &PoolLoad) -> Option<CoverageGap> {
    let complete = |load: &PoolLoad| {
        load.kv_used_blocks.is_some() && load.kv_observed_ranks == load.kv_expected_ranks
    };
    let short = |load: &PoolLoad| {
        load.kv_used_blocks.is_none() && load.kv_observed_ranks < load.kv_expected_ranks
    };
    if left.kv_expected_ranks != right.kv_expected_ranks
        || left.total_kv_blocks != right.total_kv_blocks
    {
        return None;
    }
    let side = if complete(left) && short(right) {
        Which::Left
    } else if complete(right) && short(left) {
        Which::Right
    } else {
        return None;
    };
    Some(CoverageGap {
        pool_id,
        complete: side,
        left_observed: left.kv_observed_ranks,
        right_observed: right.kv_observed_ranks,
        expected: left.kv_expected_ranks,
    })
}

fn compare_load(
    left: &ConsumerSnapshot,
    right: &ConsumerSnapshot,
    out: &mut Vec<Difference>,
    gaps: &mut Vec<CoverageGap>,
) {
    let by_pool = |snapshot: &ConsumerSnapshot| -> BTreeMap<PoolId, PoolLoad> {
        snapshot.load.iter().map(|load| (load.producer.pool_id(), *load)).collect()
    };
    let (left_loads, right_loads) = (by_pool(left), by_pool(right));
    let keys: BTreeSet<PoolId> = left_loads.keys().chain(right_loads.keys()).copied().collect();
    for pool_id in keys {
        if let (Some(l), Some(r)) = (left_loads.get(&pool_id), right_loads.get(&pool_id))
            && let Some(gap) = coverage_gap(pool_id, l, r)
        {
            gaps.push(gap);
            continue;
        }
        let mut fields = Fields { out, section: Section::Load, key: pool_id.to_string() };
        let [l_used, l_total, l_observed, l_expected] = load_text(left_loads.get(&pool_id));
        let [r_used, r_total, r_observed, r_expected] = load_text(right_loads.get(&pool_id));
        fields.check("kv_used_blocks", l_used, r_used);
        fields.check("total_kv_blocks", l_total, r_total);
        fields.check("kv_observed_ranks", l_observed, r_observed);
        fields.check("kv_expected_ranks", l_expected, r_expected);
    }
}

/// The placement-independent items of a filter: `(lower candidate bucket, fingerprint)` per
/// occupied slot, sorted (a multiset). `None` when the word count is not the format's bucket
/// count or the format is not executable.
#[must_use]
pub fn canonical_items(format: &CkfFormat, words: &[u64]) -> Option<Vec<(u32, u16)>> {
    if format.validate().is_err() || words.len() as u64 != format.bucket_count {
        return None;
    }
    let addressing = Addressing::new(format);
    let mut items = Vec::new();
    for (bucket, &word) in words.iter().enumerate() {
        let bucket = u32::try_from(bucket).ok()?;
        for slot in 0..SLOTS_PER_BUCKET {
            let fingerprint = (word >> (FINGERPRINT_BITS * slot)) as u16;
            if fingerprint != 0 {
                let alternate = addressing.alternate(bucket, fingerprint);
                items.push((bucket.min(alternate), fingerprint));
            }
        }
    }
    items.sort_unstable();
    Some(items)
}

/// Items of sorted multiset `a` missing from sorted multiset `b`, and the reverse.
fn multiset_difference(a: &[(u32, u16)], b: &[(u32, u16)]) -> (u64, u64) {
    let (mut i, mut j, mut only_a, mut only_b) = (0, 0, 0u64, 0u64);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Equal => {
                i += 1;
                j += 1;
            }
            std::cmp::Ordering::Less => {
                only_a += 1;
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                only_b += 1;
                j += 1;
            }
        }
    }
    (only_a + (a.len() - i) as u64, only_b + (b.len() - j) as u64)
}

fn compare_filters(left: Side<'_>, right: Side<'_>, comparison: &mut Comparison) {
    let statuses = |snapshot: &ConsumerSnapshot| -> BTreeMap<PoolId, FilterStatus> {
        snapshot.pools.iter().map(|pool| (pool.descriptor.pool_id(), pool.status)).collect()
    };
    let (left_status, right_status) = (statuses(left.snapshot), statuses(right.snapshot));
    for (pool_id, l_status) in &left_status {
        let Some(r_status) = right_status.get(pool_id) else { continue };
        let mut fields = Fields {
            out: &mut comparison.differences,
            section: Section::Filter,
            key: pool_id.to_string(),
        };
        let (l_copy, r_copy) = (left.filters.get(pool_id), right.filters.get(pool_id));
        let (Some(l_copy), Some(r_copy)) = (l_copy, r_copy) else {
            let installed = |copy: Option<&FilterCopy>, status: &FilterStatus| {
                if copy.is_some() { "installed".to_owned() } else { status.name().to_owned() }
            };
            fields.check("replica", installed(l_copy, l_status), installed(r_copy, r_status));
            continue;
        };
        let l_items = canonical_items(&l_copy.producer.format(), &l_copy.words);
        let r_items = canonical_items(&r_copy.producer.format(), &r_copy.words);
        let (Some(l_items), Some(r_items)) = (l_items, r_items) else {
            let shape = |copy: &FilterCopy| {
                format!("{} words for {}", copy.words.len(), format_text(&copy.producer.format()))
            };
            fields.check("replica_shape", shape(l_copy), shape(r_copy));
            continue;
        };
        let (only_left, only_right) = multiset_difference(&l_items, &r_items);
        let summary = FilterSummary {
            pool_id: *pool_id,
            left_slots: l_items.len() as u64,
            right_slots: r_items.len() as u64,
            only_left,
            only_right,
            identical_words: l_copy.words == r_copy.words,
        };
        fields.check(
            "occupied_slots",
            summary.left_slots.to_string(),
            summary.right_slots.to_string(),
        );
        if !summary.same_membership() {
            fields.check(
                "membership",
                format!("{only_left} items only here"),
                format!("{only_right} items only here"),
            );
        }
        comparison.filters.push(summary);
    }
}

/// Compare two relays' views; see the module docs for what is and is not compared.
#[must_use]
pub fn compare(left: Side<'_>, right: Side<'_>) -> Comparison {
    let mut comparison = Comparison {
        pools: Counts { left: left.snapshot.pools.len(), right: right.snapshot.pools.len() },
        readiness: Counts {
            left: left.snapshot.readiness.len(),
            right: right.snapshot.readiness.len(),
        },
        load: Counts { left: left.snapshot.load.len(), right: right.snapshot.load.len() },
        ..Comparison::default()
    };
    compare_catalog(left.snapshot, right.snapshot, &mut comparison.differences);
    compare_readiness(left.snapshot, right.snapshot, &mut comparison.differences);
    compare_load(
        left.snapshot,
        right.snapshot,
        &mut comparison.differences,
        &mut comparison.coverage_gaps,
    );
    compare_filters(left, right, &mut comparison);
    // Stable: fields keep the order they were checked in.
    comparison.differences.sort_by(|a, b| (a.section, &a.key).cmp(&(b.section, &b.key)));
    comparison
}

#[cfg(test)]
#[path = "compare_tests.rs"]
mod tests;
