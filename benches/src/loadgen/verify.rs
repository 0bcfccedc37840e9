//! Check a relay's pool filters against a trace, through the reference consumer.
//!
//! The consumer (`kvrelay-consumer`) follows the relay's catalog and each pool's filter stream.
//! Once every traced pool has an installed replica whose sequence has not moved for the quiet
//! period, each live key of the trace is probed in the replica exactly as a router probes a
//! prefix (the filter format's two buckets, 16-bit fingerprint): a live key not found is a
//! false negative, which a cuckoo filter never produces for a key it holds, so any is a loss.
//! A removed key still found may be a false positive: the expected count is
//! `removed × 2·4·load / 2^16` (two buckets of four slots, `load` = occupied share of slots), and
//! more than that plus a wide Poisson margin is reported as stale removals.
//!
//! [`verify_following`] subscribes before the trace exists and follows the relay until the
//! trace appears (bounded), so one consumer is checked after living through a whole run.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvrelay_consumer::{ConsumerConfig, ConsumerSnapshot, FilterStatus, RelayConsumer};
use kvrelay_core::filter::ckf::{Addressing, word_contains};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::rng::rng_from_seed;
use serde::Serialize;
use tokio::time::Instant;

use super::trace::Trace;

/// How often [`verify_following`] looks for the trace.
const TRACE_POLL: Duration = Duration::from_millis(100);

/// How the verification waits.
#[derive(Debug, Clone, Copy)]
pub struct VerifyOptions {
    /// Bound of the whole wait (catalog, replicas, quiet).
    pub timeout: Duration,
    /// How long every replica's sequence must stay unchanged.
    pub quiet: Duration,
    /// Seed of the consumer's jitter.
    pub seed: u64,
}

/// The result for one pool.
#[derive(Debug, Clone, Serialize)]
pub struct PoolVerdict {
    /// The pool's serving endpoint.
    pub endpoint: String,
    /// Live keys in the trace.
    pub live: usize,
    /// Live keys the replica does not hold (must be 0).
    pub false_negatives: usize,
    /// A few of them, for the report.
    pub false_negative_examples: Vec<u64>,
    /// Removed keys checked.
    pub removed_checked: usize,
    /// Removed keys the replica still answers for.
    pub removed_present: usize,
    /// Expected false positives among the removed keys at the replica's load.
    pub removed_present_expected: f64,
    /// Most removed-present keys accepted as false positives.
    pub removed_present_allowed: u64,
    /// Occupied fingerprint slots of the replica.
    pub resident_slots: u64,
    /// The replica's sequence when checked.
    pub sequence: u64,
}

/// The result for every pool.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Per pool, in trace order.
    pub pools: Vec<PoolVerdict>,
    /// Sum of false negatives.
    pub false_negatives: usize,
    /// Whether any pool has more removed-present keys than its bound allows.
    pub removed_beyond_bound: bool,
}

fn endpoints(trace: &Trace) -> Result<Vec<EndpointPath>> {
    trace
        .pools
        .iter()
        .map(|pool| {
            pool.endpoint
                .parse::<EndpointPath>()
                .with_context(|| format!("trace endpoint {:?}", pool.endpoint))
        })
        .collect()
}

/// `(pool index in the snapshot, sequence)` of every traced pool with an installed replica.
fn ready(snapshot: &ConsumerSnapshot, wanted: &[EndpointPath]) -> Option<Vec<(usize, u64)>> {
    wanted
        .iter()
        .map(|endpoint| {
            let index = snapshot
                .pools
                .iter()
                .position(|pool| pool.descriptor.serving_endpoint == *endpoint)?;
            let pool = &snapshot.pools[index];
            let sequence = pool.sequence.filter(|_| pool.status == FilterStatus::Ready)?;
            Some((index, sequence))
        })
        .collect()
}

fn start_consumer(address: &str, options: &VerifyOptions) -> Result<RelayConsumer> {
    let channel = kvrelay_consumer::connect_lazy(address)
        .with_context(|| format!("relay address {address:?}"))?;
    RelayConsumer::start(channel, ConsumerConfig::default(), &mut rng_from_seed(options.seed))
        .context("starting the consumer")
}

/// Subscribe to the relay at `address`, wait for quiet replicas of every traced pool, compare.
pub async fn verify(address: &str, trace: &Trace, options: VerifyOptions) -> Result<Verdict> {
    let wanted = endpoints(trace)?;
    let consumer = start_consumer(address, &options)?;
    let result = verify_with(&consumer, trace, &wanted, options).await;
    consumer.shutdown().await;
    result
}

/// Subscribe to the relay at `address` first and follow it while waiting (at most
/// `trace_wait`, polled every 100 ms) for a trace to appear at `path`, then verify against it
/// as [`verify`] does, with the same consumer. The consumer thus rides through whatever
/// happens to the relay and its WAN link before the trace is written (a fault-injection run).
/// The trace is written by a rename, so a file that exists is complete.
pub async fn verify_following(
    address: &str,
    path: &Path,
    trace_wait: Duration,
    options: VerifyOptions,
) -> Result<Verdict> {
    let consumer = start_consumer(address, &options)?;
    let result = async {
        let deadline = Instant::now() + trace_wait;
        while !path.exists() {
            if Instant::now() >= deadline {
                bail!("no trace at {} within {trace_wait:?}", path.display());
            }
            tokio::time::sleep(TRACE_POLL).await;
        }
        let trace = Trace::read(path)?;
        let wanted = endpoints(&trace)?;
        verify_with(&consumer, &trace, &wanted, options).await
    }
    .await;
    consumer.shutdown().await;
    result
}

async fn verify_with(
    consumer: &RelayConsumer,
    trace: &Trace,
    wanted: &[EndpointPath],
    options: VerifyOptions,
) -> Result<Verdict> {
    let deadline = Instant::now() + options.timeout;
    let waited =
        tokio::time::timeout_at(deadline, consumer.wait_until(|s| ready(s, wanted).is_some()));
    match waited.await {
        Ok(Ok(_)) => {}
        Ok(Err(stopped)) => bail!("the consumer stopped: {stopped:?}"),
        Err(_) => {
            let snapshot = consumer.snapshot();
            let seen: Vec<String> = snapshot
                .pools
                .iter()
                .map(|pool| format!("{} ({:?})", pool.descriptor.serving_endpoint, pool.status))
                .collect();
            bail!(
                "not every traced pool had an installed replica within {:?}; the relay's catalog has: [{}]",
                options.timeout,
                seen.join(", ")
            );
        }
    }
    // Quiet: every replica's sequence unchanged for `quiet`.
    let mut last = ready(&consumer.snapshot(), wanted);
    loop {
        if Instant::now() + options.quiet > deadline {
            bail!(
                "the replicas did not stay quiet for {:?} within {:?}",
                options.quiet,
                options.timeout
            );
        }
        tokio::time::sleep(options.quiet).await;
        let now = ready(&consumer.snapshot(), wanted);
        if now.is_some() && now == last {
            break;
        }
        last = now;
    }
    let snapshot = consumer.snapshot();
    let Some(positions) = ready(&snapshot, wanted) else {
        bail!("a replica went away while checking");
    };
    let mut pools = Vec::with_capacity(trace.pools.len());
    for (expected, (index, _)) in trace.pools.iter().zip(positions) {
        let state = &snapshot.pools[index];
        let pool_id = state.descriptor.pool_id();
        let copy = consumer
            .filter_copy(&pool_id)
            .with_context(|| format!("no replica copy for {}", expected.endpoint))?;
        let format = copy.producer.format();
        let addressing = Addressing::new(&format);
        let words = &copy.words;
        let holds = |key: u64| {
            let probe = addressing.probe(key);
            let word = |bucket: u32| words.get(bucket as usize).copied().unwrap_or(0);
            word_contains(word(probe.bucket_a), probe.fingerprint)
                || word_contains(word(probe.bucket_b), probe.fingerprint)
        };
        let missing: Vec<u64> = expected.live.iter().copied().filter(|&key| !holds(key)).collect();
        let removed_present = expected.removed.iter().filter(|&&key| holds(key)).count();
        let slots = format.bucket_count.saturating_mul(u64::from(format.slots_per_bucket)).max(1);
        let load = (state.resident_slots as f64 / slots as f64).min(1.0);
        let per_probe = 2.0 * f64::from(format.slots_per_bucket) * load
            / 2f64.powi(format.fingerprint_bits as i32);
        let expected_fp = expected.removed.len() as f64 * per_probe;
        let allowed = (expected_fp + 4.0 * expected_fp.sqrt() + 4.0).ceil() as u64;
        pools.push(PoolVerdict {
            endpoint: expected.endpoint.clone(),
            live: expected.live.len(),
            false_negatives: missing.len(),
            false_negative_examples: missing.iter().take(5).copied().collect(),
            removed_checked: expected.removed.len(),
            removed_present,
            removed_present_expected: expected_fp,
            removed_present_allowed: allowed,
            resident_slots: state.resident_slots,
            sequence: copy.sequence,
        });
    }
    let false_negatives = pools.iter().map(|pool| pool.false_negatives).sum();
    let removed_beyond_bound =
        pools.iter().any(|pool| pool.removed_present as u64 > pool.removed_present_allowed);
    Ok(Verdict { pools, false_negatives, removed_beyond_bound })
}

/// Print the verdict (one JSON line on stdout, a summary on stderr); returns its exit code.
pub fn report(verdict: &Verdict) -> u8 {
    for pool in &verdict.pools {
        eprintln!(
            "[verify] {}: live {} (resident slots {}), false negatives {}{}, removed still present {} of {} (expected {:.2}, bound {})",
            pool.endpoint,
            pool.live,
            pool.resident_slots,
            pool.false_negatives,
            if pool.false_negatives > 0 {
                format!(" e.g. {:?}", pool.false_negative_examples)
            } else {
                String::new()
            },
            pool.removed_present,
            pool.removed_checked,
            pool.removed_present_expected,
            pool.removed_present_allowed,
        );
    }
    match serde_json::to_string(verdict) {
        Ok(line) => println!("{line}"),
        Err(error) => eprintln!("[verify] cannot encode the verdict: {error}"),
    }
    if verdict.false_negatives > 0 {
        eprintln!("[verify] FAILED: {} false negatives", verdict.false_negatives);
        1
    } else if verdict.removed_beyond_bound {
        eprintln!("[verify] FAILED: removed keys present beyond the false-positive bound");
        4
    } else {
        eprintln!("[verify] OK: every live key present");
        0
    }
}

/// The exit code of a verdict already reported: 1 false negatives, 4 removed keys beyond the
/// bound, else 0.
#[must_use]
pub fn report_code(verdict: &Verdict) -> u8 {
    if verdict.false_negatives > 0 {
        1
    } else if verdict.removed_beyond_bound {
        4
    } else {
        0
    }
}
