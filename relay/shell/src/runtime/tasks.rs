//! The one place the relay starts a task.
//!
//! `tokio::spawn` is a disallowed method (`clippy.toml`): every task of the shell, of the
//! simulator and of the tests starts here, so the places that add concurrency are found with one
//! search for `runtime::spawn`. A task runs on the runtime of its caller: a turmoil host's in the
//! simulation (seeded scheduling, simulated time), tokio's in production. Nothing here starts an
//! OS thread.

use std::future::Future;

use tokio::task::JoinHandle;

/// Start `task` on the caller's runtime. Dropping the handle detaches the task; aborting it ends
/// the task at its next await point.
#[allow(clippy::disallowed_methods, reason = "the relay's single spawn point")]
pub fn spawn<F>(task: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(task)
}
