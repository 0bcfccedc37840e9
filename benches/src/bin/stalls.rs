//! The longest single-event applies while one pool grows to a large live set.
//!
//! The relay's event plane buffers a bounded number of messages (1,024 by default on NATS, a
//! fifth of a second at 5,000 events/s). An apply that pauses the relay's loop for longer than
//! the buffer lasts loses messages, and a rank that loses events is reset. This applies the
//! ingest bench's steady mix (4 blocks per store, half of them chained, two ranks) one event at
//! a time, up to a live set, and prints every apply slower than the threshold with the pool's
//! size at that moment, then the slowest, how long a reset of the largest rank takes, and how
//! long replacing the other rank by an empty dump takes (what a recovery does when it finds the
//! worker restarted with an empty cache).
//!
//! Run: `cargo run --release -p kvrelay-benches --bin stalls -- [live_blocks] [threshold_ms]`
//! (defaults 10,000,000 blocks and 5 ms).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

use kvrelay_benches::ingest;
use kvrelay_core::filter::ckf::{CkfFormat, MAX_KICKS_DEFAULT};
use kvrelay_core::model::kv_events::SourceKey;
use kvrelay_core::pool::{PoolOwnership, RankReplacement, TableKey};
use kvrelay_core::rng::rng_from_seed;

/// One apply slower than the threshold.
struct Stall {
    took: Duration,
    owned_blocks: usize,
    exact_state_bytes: usize,
}

/// Time single applies while one pool grows to a live set.
#[derive(Debug, Parser)]
#[command(name = "stalls")]
struct Args {
    /// Live blocks the pool grows to.
    #[arg(default_value_t = 10_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    live_blocks: u64,
    /// Applies slower than this many milliseconds are listed.
    #[arg(default_value_t = 5)]
    threshold_ms: u64,
}

#[allow(clippy::disallowed_methods, reason = "a benchmark times itself with the wall clock")]
fn main() -> ExitCode {
    let args = Args::parse();
    let threshold = Duration::from_millis(args.threshold_ms);
    let Ok(live) = usize::try_from(args.live_blocks) else {
        eprintln!("stalls: live_blocks does not fit this machine");
        return ExitCode::from(2);
    };
    eprintln!("stalls: generating {live} live blocks of the steady mix ...");
    let workload = ingest::generate(5, 2, live, live / 8);
    let expected = (live as u64).saturating_mul(3) / 2;
    let format = match CkfFormat::for_expected_blocks(expected.next_power_of_two()) {
        Ok(format) => format,
        Err(error) => {
            eprintln!("stalls: no filter for {live} blocks: {error}");
            return ExitCode::from(2);
        }
    };
    let mut pool = match PoolOwnership::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)) {
        Ok(pool) => pool,
        Err(error) => {
            eprintln!("stalls: could not allocate the filter: {error}");
            return ExitCode::from(1);
        }
    };
    pool.set_exact_state_bytes_max(usize::MAX).expect("nothing is held yet");
    let mut stalls = Vec::new();
    let mut slowest = Duration::ZERO;
    let total = workload.warmup.len() + workload.steady.len();
    let started = Instant::now();
    for (index, event) in workload.warmup.iter().chain(workload.steady.iter()).enumerate() {
        let before = Instant::now();
        let _ = pool.apply_event(event);
        let took = before.elapsed();
        slowest = slowest.max(took);
        if took > threshold {
            stalls.push(Stall {
                took,
                owned_blocks: pool.owned_block_count(),
                exact_state_bytes: pool.exact_state_bytes(),
            });
        }
        // Publications take the touched buckets' images, as the pool machine does.
        if index % 256 == 255 {
            let _ = pool.take_publication();
        }
        if index % 500_000 == 499_999 {
            eprintln!("stalls: {} of {total} events applied", index + 1);
        }
    }
    let elapsed = started.elapsed();
    println!(
        "{total} events ({} owned blocks at the end) in {elapsed:.2?}: {:.0} ns/event",
        pool.owned_block_count(),
        elapsed.as_nanos() as f64 / total as f64
    );
    println!("applies over {threshold:?}: {}", stalls.len());
    for stall in &stalls {
        println!(
            "  {:>9.1?} at {:>10} owned blocks, exact state {:>5} MiB",
            stall.took,
            stall.owned_blocks,
            stall.exact_state_bytes >> 20
        );
    }
    println!("slowest apply: {slowest:.1?}");
    // A rank reset (a gap on a live-only rank) drops the rank's whole lineage in one call.
    time_largest_rank(&mut pool, "reset of the largest rank", |pool, source| {
        pool.remove_rank(source).is_ok()
    });
    // A recovery that finds a worker restarted replaces the rank's lineage by an empty dump.
    time_largest_rank(
        &mut pool,
        "replacement of the other rank by an empty dump",
        |pool, source| {
            let empty = RankReplacement::new(TableKey::from_rng(&rng_from_seed(2)));
            pool.replace_ranks(BTreeMap::from([(source, empty)])).is_ok()
        },
    );
    ExitCode::SUCCESS
}

/// Time `work` on the rank that owns the most blocks now, and print it under `what`; `work`
/// says whether the pool took it.
#[allow(clippy::disallowed_methods, reason = "a benchmark times itself with the wall clock")]
fn time_largest_rank(
    pool: &mut PoolOwnership,
    what: &str,
    work: impl FnOnce(&mut PoolOwnership, SourceKey) -> bool,
) {
    let Some((source, blocks)) = pool.sources().max_by_key(|&(_, blocks)| blocks) else { return };
    let before = Instant::now();
    let took_it = work(pool, source);
    let took = before.elapsed();
    println!("{what} ({blocks} blocks): {took:.1?}{}", if took_it { "" } else { " (failed)" });
}
