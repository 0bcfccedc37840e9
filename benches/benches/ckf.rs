//! kvrelay's cuckoo filter (CKF) against peer filters: insertion, lookup and removal.
//!
//! For each key count (1M and 10M under `cargo bench`; 1k and 10k when `cargo test` runs each
//! benchmark once) there is one criterion group per operation, named `<op>/<count>`, holding
//! every filter side by side: `kvrelay`, the `cuckoofilter` crate with its fastest hasher, and
//! `qfilter` (a rank-select quotient filter, the other dynamic filter family with deletion).
//! All are sized so the keys fill the same number of slots (see `kvrelay_benches`), and the
//! throughput is in elements, so criterion's `thrpt` line reads as operations per second and
//! `time / elements` is the time per operation.
//!
//! - `insert/<n>`: insert all `n` keys into a fresh empty filter (built outside the timed region).
//! - `lookup/<n>`: `min(n, 2^20)` lookups, half inserted keys and half never-inserted ones, in a
//!   shuffled order, against a filter holding all `n` keys.
//! - `remove/<n>`: remove all `n` keys from a copy of the filled filter (copied outside the
//!   timed region).
//! - `kvrelay/store16` in the `insert` and `remove` groups: the same keys 16 at a time through
//!   kvrelay's batch path (the relay applies a store's or a removal's blocks together, loading
//!   their buckets first so the cache misses overlap); the peers have no batch path.
//!
//! kvrelay's insertions and removals include recording the changed buckets for its next
//! publication, which the relay's filter always does; nothing is published during a benchmark.
//! A fill from empty therefore grows that record to about one entry per bucket, first-touch page
//! faults included, while the removals find their buckets already recorded by the fill.
//!
//! Every iteration of `insert` and `remove` touches the whole table, so the groups use flat
//! sampling with few samples (20 at 1M). The 10M groups fix their own 10 samples, 1 s warm-up
//! and 12 s measurement, which command-line times do not override, so a full run takes a few
//! minutes. Run with `cargo bench -p kvrelay-benches --bench ckf` (add `-- <regex>` to pick
//! benchmarks, e.g. `'/1M/'`).

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    BatchSize, BenchmarkGroup, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use kvrelay_benches::{
    BenchFilter, Cuckoofilter, KEY_SEED, KeySet, Kvrelay, Qfilter, count_label, key_counts,
    lookup_queries, lookup_query_count,
};

/// Key counts from which a group counts as large: fewer samples, shorter times.
const LARGE_KEY_COUNT: usize = 5_000_000;
/// Seed of the lookup query order.
const QUERY_SEED: u64 = 0x51;

/// A group for one operation at one key count, with sampling suited to whole-table iterations.
fn group<'a>(
    criterion: &'a mut Criterion,
    operation: &str,
    key_count: usize,
) -> BenchmarkGroup<'a, WallTime> {
    let mut group = criterion.benchmark_group(format!("{operation}/{}", count_label(key_count)));
    group.sampling_mode(SamplingMode::Flat);
    if key_count >= LARGE_KEY_COUNT {
        group.sample_size(10);
        group.warm_up_time(Duration::from_secs(1));
        group.measurement_time(Duration::from_secs(12));
    } else {
        group.sample_size(20);
    }
    group
}

/// Time inserting every key into a fresh filter.
fn insert<F: BenchFilter>(group: &mut BenchmarkGroup<'_, WallTime>, keys: &[u64]) {
    group.bench_function(F::NAME, |bencher| {
        bencher.iter_batched(
            || F::with_key_count(keys.len()),
            |mut filter| {
                for &key in keys {
                    assert!(filter.insert(key), "{}: insertion failed", F::NAME);
                }
                filter
            },
            BatchSize::PerIteration,
        );
    });
}

/// Blocks of one store (and of one removal) in the batch benchmarks.
const STORE_BLOCKS: usize = 16;

/// Time inserting every key into a fresh filter, [`STORE_BLOCKS`] keys at a time through the
/// filter's batch path (the relay inserts a store's blocks together).
fn insert_stores<F: BenchFilter>(group: &mut BenchmarkGroup<'_, WallTime>, keys: &[u64]) {
    group.bench_function(format!("{}/store{STORE_BLOCKS}", F::NAME), |bencher| {
        bencher.iter_batched(
            || F::with_key_count(keys.len()),
            |mut filter| {
                for store in keys.chunks(STORE_BLOCKS) {
                    assert_eq!(filter.insert_batch(store), store.len(), "{}", F::NAME);
                }
                filter
            },
            BatchSize::PerIteration,
        );
    });
}

/// Time removing every key from a copy of a filter holding them, [`STORE_BLOCKS`] at a time.
fn remove_stores<F: BenchFilter>(group: &mut BenchmarkGroup<'_, WallTime>, keys: &[u64]) {
    let mut filled: Option<F> = None;
    group.bench_function(format!("{}/store{STORE_BLOCKS}", F::NAME), |bencher| {
        let filter = filled.get_or_insert_with(|| F::prefilled(keys));
        bencher.iter_batched(
            || filter.duplicate(),
            |mut filter| {
                for store in keys.chunks(STORE_BLOCKS) {
                    assert_eq!(filter.remove_batch(store), store.len(), "{}", F::NAME);
                }
                filter
            },
            BatchSize::PerIteration,
        );
    });
}

/// Time a mixed batch of lookups against a filter holding every key.
fn lookup<F: BenchFilter>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    keys: &KeySet,
    queries: &[u64],
) {
    // Built on first use, so a filtered-out benchmark costs nothing.
    let mut filled: Option<F> = None;
    group.bench_function(F::NAME, |bencher| {
        let filter = filled.get_or_insert_with(|| F::prefilled(&keys.present));
        bencher.iter(|| {
            let mut hits = 0_usize;
            for &key in queries {
                hits += usize::from(filter.contains(key));
            }
            hits
        });
    });
    if let Some(filter) = &filled {
        // No false negatives; at most a small share of false positives.
        let hits = queries.iter().filter(|&&key| filter.contains(key)).count();
        assert!(hits >= queries.len() / 2 && hits < queries.len() * 6 / 10, "{}", F::NAME);
    }
}

/// Time removing every key from a copy of a filter holding them.
fn remove<F: BenchFilter>(group: &mut BenchmarkGroup<'_, WallTime>, keys: &[u64]) {
    let mut filled: Option<F> = None;
    group.bench_function(F::NAME, |bencher| {
        let filter = filled.get_or_insert_with(|| F::prefilled(keys));
        bencher.iter_batched(
            || filter.duplicate(),
            |mut filter| {
                for &key in keys {
                    assert!(filter.remove(key), "{}: removal missed", F::NAME);
                }
                filter
            },
            BatchSize::PerIteration,
        );
    });
}

/// All three operations at every key count, each filter side by side in its group.
fn ckf(criterion: &mut Criterion) {
    for key_count in key_counts() {
        let keys = KeySet::new(key_count, KEY_SEED);

        let mut insert_group = group(criterion, "insert", key_count);
        insert_group.throughput(Throughput::Elements(key_count as u64));
        insert::<Kvrelay>(&mut insert_group, &keys.present);
        insert_stores::<Kvrelay>(&mut insert_group, &keys.present);
        insert::<Cuckoofilter>(&mut insert_group, &keys.present);
        insert::<Qfilter>(&mut insert_group, &keys.present);
        insert_group.finish();

        let queries = lookup_queries(&keys, lookup_query_count(key_count), QUERY_SEED);
        let mut lookup_group = group(criterion, "lookup", key_count);
        lookup_group.throughput(Throughput::Elements(queries.len() as u64));
        lookup::<Kvrelay>(&mut lookup_group, &keys, &queries);
        lookup::<Cuckoofilter>(&mut lookup_group, &keys, &queries);
        lookup::<Qfilter>(&mut lookup_group, &keys, &queries);
        lookup_group.finish();

        let mut remove_group = group(criterion, "remove", key_count);
        remove_group.throughput(Throughput::Elements(key_count as u64));
        remove::<Kvrelay>(&mut remove_group, &keys.present);
        remove_stores::<Kvrelay>(&mut remove_group, &keys.present);
        remove::<Cuckoofilter>(&mut remove_group, &keys.present);
        remove::<Qfilter>(&mut remove_group, &keys.present);
        remove_group.finish();
    }
}

criterion_group!(benches, ckf);
criterion_main!(benches);
