//! An incident's expected KV state: per pool generation, the exact-block count and the digest of
//! the canonical hash set the recorded node held after the window's last input, checked against
//! the state the replay ends with.

use std::fmt::Write as _;
use std::time::Duration;

use kvrelay::journal::{Checkpoint, PoolCheckpoint};
use serde::{Deserialize, Serialize};

use crate::Check;

/// One pool generation's expected KV state (`[[kv]]` in an incident file).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedPool {
    /// The pool id (`<domain>/<dc>`).
    pub pool: String,
    /// The generation.
    pub layout_generation: u64,
    /// Distinct owned canonical hashes.
    pub exact_blocks: u64,
    /// Digest of the sorted canonical hash set, 16 hex digits.
    pub canonical_digest: String,
}

impl ExpectedPool {
    /// The expectation `pool` meets.
    #[must_use]
    pub fn of(pool: &PoolCheckpoint) -> Self {
        ExpectedPool {
            pool: pool.pool.clone(),
            layout_generation: pool.layout_generation,
            exact_blocks: pool.exact_blocks,
            canonical_digest: format!("{:016x}", pool.canonical_digest),
        }
    }
}

/// The `expected-kv` check: `state` (the replay's state after its last input) holds exactly the
/// expected pool generations, each with the expected block count and digest.
#[must_use]
pub fn check(expected: &[ExpectedPool], state: Option<&(Duration, Checkpoint)>) -> Check {
    let fail = |detail: String| Check { name: "expected-kv", passed: false, detail };
    let Some((_, checkpoint)) = state else {
        return fail("the replay reached no state to compare".to_owned());
    };
    let replayed: Vec<ExpectedPool> = checkpoint.pools.iter().map(ExpectedPool::of).collect();
    fn key(pool: &ExpectedPool) -> (&str, u64) {
        (&pool.pool, pool.layout_generation)
    }
    let mut mismatches = String::new();
    for want in expected {
        match replayed.iter().find(|got| key(got) == key(want)) {
            None => {
                let _ = write!(
                    mismatches,
                    "; {} generation {}: expected, not in the replayed state",
                    want.pool, want.layout_generation
                );
            }
            Some(got) if got != want => {
                let _ = write!(
                    mismatches,
                    "; {} generation {}: expected {} exact blocks (digest {}), replayed {} \
                     (digest {})",
                    want.pool,
                    want.layout_generation,
                    want.exact_blocks,
                    want.canonical_digest,
                    got.exact_blocks,
                    got.canonical_digest
                );
            }
            Some(_) => {}
        }
    }
    for got in replayed.iter().filter(|got| !expected.iter().any(|want| key(want) == key(got))) {
        let _ = write!(
            mismatches,
            "; {} generation {}: replayed, not expected",
            got.pool, got.layout_generation
        );
    }
    if let Some(mismatches) = mismatches.strip_prefix("; ") {
        return fail(mismatches.to_owned());
    }
    let blocks: u64 = expected.iter().map(|pool| pool.exact_blocks).sum();
    Check {
        name: "expected-kv",
        passed: true,
        detail: format!(
            "{} pool generations, {blocks} exact blocks, every canonical digest as recorded",
            expected.len()
        ),
    }
}
