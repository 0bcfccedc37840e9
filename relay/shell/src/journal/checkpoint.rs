//! Checkpoints of the node's logical state, their schedule, and their comparison.
//!
//! A checkpoint holds what a consumer of the relay can observe, in a form that does not depend
//! on timing inside one step: the catalog's descriptors and the readiness entries (each as the
//! JSON of its `control::wire` view), and per active pool generation the exact-block count, a
//! digest of the canonical hash set, a digest of the filter words and the published sequence.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::pool::BroadcastOutlet;
use kvrelay_core::control::wire::{KvPoolDescriptorView, TopologyEntryView};
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::pool::PoolDigest;
use kvrelay_core::relay::Relay;
use kvrelay_core::rng::RelayRng;

/// One pool generation's state in digest form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolCheckpoint {
    /// The pool id (`<domain>/<dc>`).
    pub pool: String,
    /// The generation.
    pub layout_generation: u64,
    /// Distinct owned canonical hashes.
    pub exact_blocks: u64,
    /// Digest of the sorted canonical hash set.
    pub canonical_digest: u64,
    /// Digest of the filter words.
    pub filter_digest: u64,
    /// Last published sequence.
    pub sequence: u64,
}

/// The node's logical state at one point of its input sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Inputs the node had handled.
    pub inputs_handled: u64,
    /// Catalog revision.
    pub catalog_revision: u64,
    /// Each catalog descriptor as JSON, in pool id order.
    pub catalog: Vec<String>,
    /// Readiness (topology) revision.
    pub readiness_revision: u64,
    /// Each readiness entry as JSON, in entry order.
    pub readiness: Vec<String>,
    /// Active pool generations in `(pool, generation)` order; a stopped one is left out.
    pub pools: Vec<PoolCheckpoint>,
}

impl Checkpoint {
    /// What a node started on a window cut out of a recording reproduces of this checkpoint:
    /// everything but the catalog and readiness revisions (they count every change since the
    /// node started, and the window's node learns the earlier ones as one listing), each pool's
    /// filter digest (the filter's words depend on the order blocks were inserted in, and the
    /// window's node learns the earlier blocks from a tree dump) and its sequence (publications
    /// are counted from the node's start).
    #[must_use]
    pub fn window_view(&self) -> Checkpoint {
        let mut view = self.clone();
        view.catalog_revision = 0;
        view.readiness_revision = 0;
        for pool in &mut view.pools {
            pool.filter_digest = 0;
            pool.sequence = 0;
        }
        view
    }
}

/// Both cadence fields of a journal header that has none (see `JournalHeader::is_window`).
pub const NO_CADENCE: u64 = u64::MAX;

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|error| format!("<unrenderable: {error}>"))
}

/// Take a checkpoint of the node's relay: its plane and its pools (the relay applies every held
/// write first, so the digests include everything the plane has issued).
pub(crate) fn capture_checkpoint(
    relay: &mut Relay<BroadcastOutlet>,
    now: Duration,
    rng: &mut RelayRng,
    inputs_handled: u64,
) -> Checkpoint {
    let pools = relay.digests(now, rng);
    let catalog = relay.plane().catalog_snapshot();
    let topology = relay.plane().topology_snapshot();
    let pools = pools
        .into_iter()
        .map(|((pool_id, layout_generation), digest)| {
            pool_checkpoint(&pool_id, layout_generation, digest)
        })
        .collect();
    Checkpoint {
        inputs_handled,
        catalog_revision: catalog.revision,
        catalog: catalog.pools.iter().map(|pool| json(&KvPoolDescriptorView::from(pool))).collect(),
        readiness_revision: topology.revision,
        readiness: topology
            .entries
            .iter()
            .map(|entry| json(&TopologyEntryView::from(entry)))
            .collect(),
        pools,
    }
}

fn pool_checkpoint(pool_id: &PoolId, layout_generation: u64, digest: PoolDigest) -> PoolCheckpoint {
    PoolCheckpoint {
        pool: pool_id.to_string(),
        layout_generation,
        exact_blocks: digest.owned_blocks,
        canonical_digest: digest.canonical_digest,
        filter_digest: digest.filter_digest,
        sequence: digest.sequence,
    }
}

/// When checkpoints are taken: after `every_inputs` inputs, or at the first input `interval` or
/// more after the last checkpoint. Asked after each input with that input's recorded time, it
/// is a pure function of the input stream, so a replay takes its checkpoints after the same
/// inputs, with the same times, as the recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointSchedule {
    every_inputs: u64,
    interval: Duration,
    last_inputs: u64,
    last_at: Duration,
}

impl CheckpointSchedule {
    /// A schedule (an `every_inputs` of 0 counts as 1).
    #[must_use]
    pub fn new(every_inputs: u64, interval: Duration) -> Self {
        CheckpointSchedule {
            every_inputs: every_inputs.max(1),
            interval,
            last_inputs: 0,
            last_at: Duration::ZERO,
        }
    }

    /// The inputs between checkpoints.
    #[must_use]
    pub fn every_inputs(&self) -> u64 {
        self.every_inputs
    }

    /// The time between checkpoints.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Whether a checkpoint is due at `at` after `inputs_handled` inputs; if so it counts as
    /// taken.
    pub fn due(&mut self, at: Duration, inputs_handled: u64) -> bool {
        let new_inputs = inputs_handled.saturating_sub(self.last_inputs);
        let due = new_inputs >= self.every_inputs
            || (new_inputs > 0 && at.saturating_sub(self.last_at) >= self.interval);
        if due {
            self.last_inputs = inputs_handled;
            self.last_at = at;
        }
        due
    }
}

/// How a replayed checkpoint differs from the recorded one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDiff {
    /// One line per difference: a scalar's two values, a catalog or readiness entry (or a pool
    /// generation) present on one side only, or a pool generation's differing fields.
    pub entries: Vec<String>,
}

/// Entries of `recorded` and `replayed` the other side lacks (as multisets, so one inserted or
/// missing entry is one line, not a shift of every later index), in list order.
fn diff_lists(what: &str, recorded: &[String], replayed: &[String], out: &mut Vec<String>) {
    fn unmatched<'a>(list: &'a [String], other: &[String]) -> Vec<&'a String> {
        let mut left: BTreeMap<&String, usize> = BTreeMap::new();
        for entry in other {
            *left.entry(entry).or_default() += 1;
        }
        list.iter()
            .filter(|entry| match left.get_mut(entry) {
                Some(count) if *count > 0 => {
                    *count -= 1;
                    false
                }
                _ => true,
            })
            .collect()
    }
    for entry in unmatched(recorded, replayed) {
        out.push(format!("{what}: recorded only {entry}"));
    }
    for entry in unmatched(replayed, recorded) {
        out.push(format!("{what}: replayed only {entry}"));
    }
}

/// Pool generations compared by (pool, generation): one line per generation on one side only,
/// and per generation on both sides one line naming each differing field.
fn diff_pools(recorded: &[PoolCheckpoint], replayed: &[PoolCheckpoint], out: &mut Vec<String>) {
    fn keyed(pools: &[PoolCheckpoint]) -> BTreeMap<(&str, u64), &PoolCheckpoint> {
        pools.iter().map(|pool| ((pool.pool.as_str(), pool.layout_generation), pool)).collect()
    }
    let (recorded, replayed) = (keyed(recorded), keyed(replayed));
    for (key, left) in &recorded {
        let Some(right) = replayed.get(key) else {
            out.push(format!("pools: recorded only {left:?}"));
            continue;
        };
        let fields = [
            ("exact_blocks", left.exact_blocks, right.exact_blocks),
            ("canonical_digest", left.canonical_digest, right.canonical_digest),
            ("filter_digest", left.filter_digest, right.filter_digest),
            ("sequence", left.sequence, right.sequence),
        ];
        let differing: Vec<String> = fields
            .iter()
            .filter(|(_, l, r)| l != r)
            .map(|(field, l, r)| format!("{field} recorded {l} / replayed {r}"))
            .collect();
        if !differing.is_empty() {
            out.push(format!("pool {} generation {}: {}", key.0, key.1, differing.join(", ")));
        }
    }
    for (key, right) in &replayed {
        if !recorded.contains_key(key) {
            out.push(format!("pools: replayed only {right:?}"));
        }
    }
}

/// The differences between a recorded and a replayed checkpoint; `None` when they are equal.
#[must_use]
pub fn compare_checkpoints(recorded: &Checkpoint, replayed: &Checkpoint) -> Option<CheckpointDiff> {
    if recorded == replayed {
        return None;
    }
    let mut entries = Vec::new();
    let scalars = [
        ("inputs_handled", recorded.inputs_handled, replayed.inputs_handled),
        ("catalog_revision", recorded.catalog_revision, replayed.catalog_revision),
        ("readiness_revision", recorded.readiness_revision, replayed.readiness_revision),
    ];
    for (what, left, right) in scalars {
        if left != right {
            entries.push(format!("{what}: recorded {left} / replayed {right}"));
        }
    }
    diff_lists("catalog", &recorded.catalog, &replayed.catalog, &mut entries);
    diff_lists("readiness", &recorded.readiness, &replayed.readiness, &mut entries);
    diff_pools(&recorded.pools, &replayed.pools, &mut entries);
    Some(CheckpointDiff { entries })
}
