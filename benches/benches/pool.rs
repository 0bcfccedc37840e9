//! Pool ingest throughput: steady-state apply of a realistic event mix, in stored blocks/s.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_benches::ingest::{IngestWorkload, generate};
use kvrelay_core::filter::ckf::{CkfFormat, MAX_KICKS_DEFAULT};
use kvrelay_core::pool::PoolOwnership;
use kvrelay_core::rng::rng_from_seed;

fn warmed_pool(workload: &IngestWorkload, live_blocks: usize) -> PoolOwnership {
    let format = CkfFormat::for_expected_blocks(live_blocks as u64).expect("valid sizing");
    let mut pool = PoolOwnership::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).expect("pool");
    for event in &workload.warmup {
        let _ = pool.apply_event(event);
    }
    pool
}

#[allow(clippy::disallowed_methods, reason = "a benchmark times itself with the wall clock")]
fn ingest(c: &mut Criterion) {
    let sizes: &[usize] =
        if kvrelay_benches::is_bench_mode() { &[1 << 16, 1 << 20] } else { &[1 << 12] };
    let mut group = c.benchmark_group("pool_ingest");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for &live_blocks in sizes {
        let steady_stores = live_blocks / 4;
        let workload = generate(7, 8, live_blocks, steady_stores);
        group.throughput(Throughput::Elements(workload.steady_stored_blocks));
        group.bench_function(format!("steady_mix/live_{live_blocks}"), |b| {
            b.iter_custom(|iterations| {
                let mut total = Duration::ZERO;
                for _ in 0..iterations {
                    let mut pool = warmed_pool(&workload, live_blocks);
                    let start = Instant::now();
                    for event in &workload.steady {
                        let _ = black_box(pool.apply_event(event));
                    }
                    total += start.elapsed();
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, ingest);
criterion_main!(benches);
