//! Runtime seams: the only places where the relay touches the wall clock, a real-time timer or a
//! blocking thread pool, or starts a task. Production and simulation plug different implementations into the
//! same code.

mod clock;
mod executor;
mod tasks;
mod timer;

pub use clock::{ManualWallClock, SystemWallClock, WallClock};
pub use executor::{
    BlockingExecutor, ExecutorError, InlineExecutor, TokioBlockingExecutor, run_blocking,
};
pub use tasks::spawn;
pub use timer::{DeadlineTimer, TimerKind};

/// A production root seed: eight bytes of OS entropy, read once at start-up (the RNG seam's one
/// read of the OS); without a random device, the wall-clock seam mixed with the process id.
#[must_use]
pub fn os_seed() -> u64 {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    match std::fs::File::open("/dev/urandom").and_then(|mut random| random.read_exact(&mut bytes)) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => {
            let now_us = SystemWallClock.now_unix_us();
            now_us ^ u64::from(std::process::id()).rotate_left(32)
        }
    }
}
