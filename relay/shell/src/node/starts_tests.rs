//! Pool starts: concurrency bound, timing, issue order, and lost jobs.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use super::*;
use crate::runtime::InlineExecutor;
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{DcId, PoolId, resolve_indexer_domain};
use kvrelay_core::rng::rng_from_seed;

/// Holds jobs until the test runs (or drops) them.
#[derive(Default)]
struct HeldJobs(Mutex<Vec<Box<dyn FnOnce() + Send + 'static>>>);

impl std::fmt::Debug for HeldJobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeldJobs({})", self.held())
    }
}

impl BlockingExecutor for HeldJobs {
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
        self.0.lock().unwrap().push(job);
    }
}

impl HeldJobs {
    fn held(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn run(&self, index: usize) {
        let job = self.0.lock().unwrap().remove(index);
        job();
    }

    fn drop_job(&self, index: usize) {
        drop(self.0.lock().unwrap().remove(index));
    }
}

fn endpoint(name: &str) -> EndpointPath {
    format!("ns/backend/{name}").parse().unwrap()
}

fn producer(name: &str, generation: u64) -> ProducerIdentity {
    let endpoint = endpoint(name);
    let domain =
        resolve_indexer_domain("model", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: DcId(7) };
    ProducerIdentity::new(pool_id, 42, generation, CkfFormat::v1(DEFAULT_SEED, 1024)).unwrap()
}

fn build() -> BuildPool {
    Box::new(|| {
        PoolOwnership::new(CkfFormat::v1(DEFAULT_SEED, 1024), MAX_KICKS_DEFAULT, rng_from_seed(2))
    })
}

fn issue(starts: &mut PoolStarts, generation: u64, timing: StartTiming) {
    let name = format!("generate{generation}");
    starts.issue(endpoint(&name), producer(&name, generation), timing, build());
}

fn point(inputs_handled: u64, between_steps: bool) -> StartPoint {
    StartPoint { inputs_handled, between_steps }
}

fn drain(starts: &mut PoolStarts, done: &mut DoneReceiver) {
    while let Ok(outcome) = done.try_recv() {
        starts.completed(outcome);
    }
}

fn applied(due: Due) -> (u64, bool) {
    match due {
        Due::Apply(ready) => (ready.start.producer.layout_generation(), ready.outcome.is_ok()),
        other => panic!("expected a start to apply, got {other:?}"),
    }
}

#[test]
fn points_order_as_the_steps_run() {
    assert!(point(3, false) < point(3, true));
    assert!(point(3, true) < point(4, false));
}

#[test]
fn an_inline_allocation_is_applied_at_once_and_the_state_is_built() {
    let (mut starts, mut done) = PoolStarts::new(Arc::new(InlineExecutor), 2);
    issue(&mut starts, 1, StartTiming::Free);
    assert_eq!(starts.in_flight(), 1, "launched, outcome not yet received");
    drain(&mut starts, &mut done);
    assert_eq!(starts.in_flight(), 0);
    let Due::Apply(ready) = starts.next_due(point(0, false)) else {
        panic!("the inline start is due");
    };
    let Ready { start, outcome: Ok(pool) } = *ready else { panic!("with its state") };
    assert_eq!(start.producer.layout_generation(), 1);
    assert_eq!(pool.owned_block_count(), 0);
    assert_eq!(*pool.filter().format(), CkfFormat::v1(DEFAULT_SEED, 1024));
    assert!(matches!(starts.next_due(point(0, false)), Due::Idle));
    assert_eq!(starts.pending(), 0);
}

#[test]
fn at_most_the_concurrency_bound_allocates_at_once_and_a_completion_launches_the_next() {
    let jobs = Arc::new(HeldJobs::default());
    let (mut starts, mut done) = PoolStarts::new(Arc::clone(&jobs) as _, 2);
    for generation in 1..=3 {
        issue(&mut starts, generation, StartTiming::Free);
    }
    assert_eq!((jobs.held(), starts.in_flight(), starts.pending()), (2, 2, 3));
    jobs.run(1);
    drain(&mut starts, &mut done);
    assert_eq!(jobs.held(), 2, "the queued third start launched when the second finished");
    assert_eq!(starts.in_flight(), 2);
    // Free starts are applied as they finish, not held behind an earlier one still allocating.
    assert_eq!(applied(starts.next_due(point(0, true))), (2, true));
    assert!(matches!(starts.next_due(point(0, true)), Due::Idle));
    jobs.run(0);
    jobs.run(0);
    drain(&mut starts, &mut done);
    assert_eq!(applied(starts.next_due(point(0, true))), (1, true));
    assert_eq!(applied(starts.next_due(point(0, true))), (3, true));
    assert_eq!((starts.in_flight(), starts.pending()), (0, 0));
}

#[test]
fn a_job_that_dies_or_is_dropped_still_reports_a_failed_start() {
    let jobs = Arc::new(HeldJobs::default());
    let (mut starts, mut done) = PoolStarts::new(Arc::clone(&jobs) as _, 2);
    let name = "generate1";
    starts.issue(
        endpoint(name),
        producer(name, 1),
        StartTiming::Free,
        Box::new(|| panic!("allocation job panics")),
    );
    issue(&mut starts, 2, StartTiming::Free);
    let job = jobs.0.lock().unwrap().remove(0);
    assert!(catch_unwind(AssertUnwindSafe(job)).is_err());
    jobs.drop_job(0);
    drain(&mut starts, &mut done);
    for generation in [1, 2] {
        let Due::Apply(ready) = starts.next_due(point(0, true)) else {
            panic!("a lost job is still applied");
        };
        assert_eq!(ready.start.producer.layout_generation(), generation);
        assert!(matches!(ready.outcome, Err(StartError::JobLost)), "as a failed start");
    }
    assert_eq!((starts.in_flight(), starts.pending()), (0, 0));
}

#[test]
fn a_timed_start_waits_for_its_point_and_its_point_waits_for_the_allocation() {
    let jobs = Arc::new(HeldJobs::default());
    let (mut starts, mut done) = PoolStarts::new(Arc::clone(&jobs) as _, 2);
    issue(&mut starts, 1, StartTiming::At { point: point(5, false), started: None });
    assert!(matches!(starts.next_due(point(4, true)), Due::Idle), "before its point");
    assert!(matches!(starts.next_due(point(5, false)), Due::Wait), "at its point, allocating");
    jobs.run(0);
    drain(&mut starts, &mut done);
    assert!(matches!(starts.next_due(point(4, true)), Due::Idle), "done, still before its point");
    assert_eq!(applied(starts.next_due(point(5, false))), (1, true));
}

#[test]
fn a_recorded_failure_is_replayed_and_a_start_the_recording_never_applied_never_is() {
    let (mut starts, mut done) = PoolStarts::new(Arc::new(InlineExecutor), 2);
    issue(&mut starts, 1, StartTiming::At { point: point(2, true), started: Some(false) });
    issue(&mut starts, 2, StartTiming::Never);
    drain(&mut starts, &mut done);
    let Due::Apply(ready) = starts.next_due(point(2, true)) else {
        panic!("the recorded start is applied at its point");
    };
    assert_eq!(ready.start.producer.layout_generation(), 1);
    assert!(
        matches!(ready.outcome, Err(StartError::Recorded)),
        "as the recorded failure, whatever the allocation did"
    );
    assert!(matches!(starts.next_due(point(u64::MAX, true)), Due::Idle));
    assert_eq!(starts.pending(), 1, "the never-applied start stays pending");
}
