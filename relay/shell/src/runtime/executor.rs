//! Executor seam for blocking work (filter allocation, snapshot copies, large encodings).
//!
//! Production hands such jobs to tokio's blocking pool; the simulation runs them inline on the
//! calling task, so no code path it exercises spawns an OS thread.

use std::fmt::Debug;

use thiserror::Error;
use tokio::sync::oneshot;

/// Runs blocking jobs to completion.
pub trait BlockingExecutor: Send + Sync + Debug + 'static {
    /// Run `job`; it may run before this returns (inline) or later on another thread.
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>);
}

/// The job died before producing a result (it panicked on a pool thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("blocking job did not complete")]
pub struct ExecutorError;

/// Run `work` through `executor` and wait for its result.
pub async fn run_blocking<R: Send + 'static>(
    executor: &dyn BlockingExecutor,
    work: impl FnOnce() -> R + Send + 'static,
) -> Result<R, ExecutorError> {
    let (reply, result) = oneshot::channel();
    executor.spawn(Box::new(move || {
        let _ = reply.send(work());
    }));
    result.await.map_err(|_| ExecutorError)
}

/// Runs every job immediately on the calling task (simulation, tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct InlineExecutor;

impl BlockingExecutor for InlineExecutor {
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
        job();
    }
}

/// Runs jobs on tokio's blocking thread pool (production).
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioBlockingExecutor;

impl BlockingExecutor for TokioBlockingExecutor {
    #[allow(clippy::disallowed_methods, reason = "this is the production blocking-work seam")]
    fn spawn(&self, job: Box<dyn FnOnce() + Send + 'static>) {
        drop(tokio::task::spawn_blocking(job));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn inline_jobs_return_their_result() {
        assert_eq!(run_blocking(&InlineExecutor, || 6 * 7).await, Ok(42));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn pool_jobs_return_their_result_and_panics_are_errors() {
        assert_eq!(run_blocking(&TokioBlockingExecutor, || 6 * 7).await, Ok(42));
        let died = run_blocking(&TokioBlockingExecutor, || -> u32 { panic!("job fails") }).await;
        assert_eq!(died, Err(ExecutorError));
    }
}
