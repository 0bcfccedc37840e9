//! Pool starts off the node's loop: the exact state and filter of a starting generation are
//! built on the blocking executor while the node keeps taking inputs, reports and timers.
//!
//! # Two phases
//!
//! 1. **Reserve.** The control plane's `StartPool` holds the generation as *starting* (the host's
//!    slot, its layout generation and its place under the pool budget). The node issues the
//!    start here: it gets a ticket and an allocation job, launched at once while fewer than
//!    [`CKF_ALLOCATION_CONCURRENCY`] jobs run, queued otherwise.
//! 2. **Commit or roll back.** The job's outcome comes back on the completion channel. The node
//!    applies it at a point of its step sequence ([`StartTiming`]): success starts driving the pool and
//!    reports `StartSucceeded` (the catalog names the pool from then on), failure reports
//!    `StartFailed` (the host releases the generation and retries with back-off).
//!
//! A job always reports exactly once: its [`Completion`] sends a failure when dropped unsent (a
//! job that panicked, or that the executor dropped at shutdown), so no start stays reserved
//! forever. Dropping the node drops the channel, and a late result is freed where it was built.
//!
//! # Invariants
//!
//! - `in_flight ≤ concurrency`, and `in_flight` equals the launched jobs whose outcome has not
//!   been received; every queued ticket is pending and unlaunched.
//! - Outcomes are applied in ticket (issue) order among the starts whose timing allows them at
//!   the current point, so with an inline executor (the simulation) a start issued during a step
//!   is applied before that step's checkpoint, exactly where an inline allocation put it.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::runtime::BlockingExecutor;
use kvrelay_core::filter::ckf::CkfAllocationError;
use kvrelay_core::model::identity::{EndpointPath, ProducerIdentity};
use kvrelay_core::pool::PoolOwnership;

/// Allocation jobs running at once (the reference relay's CKF allocation concurrency).
pub const CKF_ALLOCATION_CONCURRENCY: usize = 2;

/// Where in the node's sequence of steps a start's outcome was (or is to be) applied. Ordered
/// as the steps run: `(n, within)` < `(n, between)` < `(n + 1, within)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StartPoint {
    /// DC inputs handled when it was applied.
    pub inputs_handled: u64,
    /// `false`: within the step of input `inputs_handled`, before that step's checkpoint;
    /// `true`: after that step, before the next input is taken.
    pub between_steps: bool,
}

/// When the node applies a start's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartTiming {
    /// As soon as the allocation is done (production, recording, simulation).
    Free,
    /// At this point (a replay of a recording): the node waits for the allocation there rather
    /// than take another input. `started: Some(false)` replays a recorded failure whatever the
    /// allocation does now; `None` takes the allocation's own outcome.
    At {
        /// The point.
        point: StartPoint,
        /// The recorded outcome, if there is one.
        started: Option<bool>,
    },
    /// Never (the recording ended while this start was allocating).
    Never,
}

/// Why a start failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// The filter could not be allocated.
    Allocation(CkfAllocationError),
    /// The job ended without a result (it panicked, or the executor dropped it).
    JobLost,
    /// A replay applies the failure its recording saw.
    Recorded,
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Allocation(error) => write!(f, "filter allocation failed: {error}"),
            StartError::JobLost => f.write_str("allocation job ended without a result"),
            StartError::Recorded => f.write_str("the recording's start failed here"),
        }
    }
}

/// Builds one generation's exact state and filter (runs on the blocking executor).
pub type BuildPool = Box<dyn FnOnce() -> Result<PoolOwnership, CkfAllocationError> + Send + Sync>;

/// A job's outcome, by ticket.
pub type Done = (u64, Result<PoolOwnership, StartError>);

/// The receiving side of the completion channel; the node's loop owns it.
pub type DoneReceiver = mpsc::UnboundedReceiver<Done>;

/// Sends a job's outcome exactly once: explicitly, or as [`StartError::JobLost`] when dropped.
struct Completion {
    ticket: u64,
    done: Option<mpsc::UnboundedSender<Done>>,
}

impl Completion {
    fn send(mut self, outcome: Result<PoolOwnership, StartError>) {
        if let Some(done) = self.done.take() {
            // A closed channel means the node is gone; the state is freed here.
            let _ = done.send((self.ticket, outcome));
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send((self.ticket, Err(StartError::JobLost)));
        }
    }
}

/// A start the node has issued and not yet applied.
pub struct PendingStart {
    /// The endpoint that serves the pool.
    pub endpoint: EndpointPath,
    /// The generation's producer.
    pub producer: ProducerIdentity,
    /// When to apply it.
    pub timing: StartTiming,
    /// The job, until launched.
    build: Option<BuildPool>,
    /// The outcome, once received.
    outcome: Option<Result<PoolOwnership, StartError>>,
}

impl fmt::Debug for PendingStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingStart")
            .field("endpoint", &self.endpoint)
            .field("producer", &self.producer)
            .field("timing", &self.timing)
            .field("launched", &self.build.is_none())
            .field("done", &self.outcome.is_some())
            .finish()
    }
}

/// A start to apply now, with its outcome.
#[derive(Debug)]
pub struct Ready {
    /// The start.
    pub start: PendingStart,
    /// Its exact state and filter, or why there are none.
    pub outcome: Result<PoolOwnership, StartError>,
}

/// What [`PoolStarts::next_due`] found.
#[derive(Debug)]
pub enum Due {
    /// Apply this start now.
    Apply(Box<Ready>),
    /// A start due at or before this point has no outcome yet: wait for a completion.
    Wait,
    /// Nothing to apply at this point.
    Idle,
}

/// The node's starts in flight.
pub struct PoolStarts {
    executor: Arc<dyn BlockingExecutor>,
    concurrency: usize,
    in_flight: usize,
    next_ticket: u64,
    pending: BTreeMap<u64, PendingStart>,
    queued: VecDeque<u64>,
    done: mpsc::UnboundedSender<Done>,
}

impl fmt::Debug for PoolStarts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolStarts")
            .field("concurrency", &self.concurrency)
            .field("in_flight", &self.in_flight)
            .field("pending", &self.pending)
            .field("queued", &self.queued)
            .finish_non_exhaustive()
    }
}

impl PoolStarts {
    /// Starts run on `executor`, at most `concurrency` (at least 1) at once.
    #[must_use]
    pub fn new(executor: Arc<dyn BlockingExecutor>, concurrency: usize) -> (Self, DoneReceiver) {
        let (done, receiver) = mpsc::unbounded_channel();
        let starts = PoolStarts {
            executor,
            concurrency: concurrency.max(1),
            in_flight: 0,
            next_ticket: 0,
            pending: BTreeMap::new(),
            queued: VecDeque::new(),
            done,
        };
        (starts, receiver)
    }

    /// Allocation jobs launched and not yet reported.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Starts issued and not yet applied.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Issue a start: its job launches now if a slot is free (with an inline executor it has
    /// run when this returns), otherwise when one frees up.
    pub fn issue(
        &mut self,
        endpoint: EndpointPath,
        producer: ProducerIdentity,
        timing: StartTiming,
        build: BuildPool,
    ) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let start = PendingStart { endpoint, producer, timing, build: Some(build), outcome: None };
        self.pending.insert(ticket, start);
        self.queued.push_back(ticket);
        self.launch_queued();
        self.check_invariants();
    }

    /// Record a job's outcome (from the completion channel) and launch the next queued job.
    pub fn completed(&mut self, (ticket, outcome): Done) {
        let Some(start) = self.pending.get_mut(&ticket) else {
            debug_assert!(false, "a completion for ticket {ticket}, which is not pending");
            return;
        };
        debug_assert!(start.outcome.is_none() && start.build.is_none());
        start.outcome = Some(outcome);
        self.in_flight -= 1;
        self.launch_queued();
        self.check_invariants();
    }

    /// The first start (in issue order) to apply at `point`, if any; [`Due::Wait`] when a start
    /// timed at or before `point` is still allocating.
    pub fn next_due(&mut self, point: StartPoint) -> Due {
        let mut waiting = false;
        let mut chosen = None;
        for (&ticket, start) in &self.pending {
            let due = match start.timing {
                StartTiming::Free => true,
                StartTiming::At { point: at, .. } => at <= point,
                StartTiming::Never => false,
            };
            if !due {
                continue;
            }
            if start.outcome.is_some() {
                chosen = Some(ticket);
                break;
            }
            if matches!(start.timing, StartTiming::At { .. }) {
                waiting = true;
            }
        }
        if let Some(ticket) = chosen
            && let Some(mut start) = self.pending.remove(&ticket)
            && let Some(mut outcome) = start.outcome.take()
        {
            if let StartTiming::At { started: Some(false), .. } = start.timing {
                outcome = Err(StartError::Recorded);
            }
            self.check_invariants();
            return Due::Apply(Box::new(Ready { start, outcome }));
        }
        if waiting { Due::Wait } else { Due::Idle }
    }

    fn launch_queued(&mut self) {
        while self.in_flight < self.concurrency {
            let Some(ticket) = self.queued.pop_front() else { break };
            let Some(build) = self.pending.get_mut(&ticket).and_then(|start| start.build.take())
            else {
                debug_assert!(false, "queued ticket {ticket} is not pending or already launched");
                continue;
            };
            self.in_flight += 1;
            let completion = Completion { ticket, done: Some(self.done.clone()) };
            self.executor.spawn(Box::new(move || {
                completion.send(build().map_err(StartError::Allocation));
            }));
        }
    }

    /// The relations between the counters and the pending starts (see the module doc).
    pub fn check_invariants(&self) {
        if cfg!(debug_assertions) {
            assert!(self.in_flight <= self.concurrency, "more jobs than the concurrency bound");
            let launched_unreported = self
                .pending
                .values()
                .filter(|start| start.build.is_none() && start.outcome.is_none())
                .count();
            assert_eq!(self.in_flight, launched_unreported, "in-flight count drifted");
            for ticket in &self.queued {
                assert!(
                    self.pending.get(ticket).is_some_and(|start| start.build.is_some()),
                    "a queued ticket must be pending and unlaunched"
                );
            }
        }
    }
}

#[cfg(test)]
#[path = "starts_tests.rs"]
mod tests;
