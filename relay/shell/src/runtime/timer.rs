//! The deadline seam: how the node waits for the relay's next timer.
//!
//! Tokio's timer counts whole milliseconds and rounds every deadline up to the next one, so a
//! 1 ms publication delay ends 1–2 ms after the write it publishes. In production the node waits
//! on a Linux `timerfd` instead (armed to the nanosecond, read through tokio's reactor), so the
//! delay ends when it is due. The simulator and every test on tokio's paused clock keep tokio's
//! timer: a `timerfd` runs on the real monotonic clock, which a paused or simulated runtime
//! does not follow.
//!
//! Both wait for a deadline on tokio's clock; neither decides when it is due (the caller asks
//! the relay, on tokio's clock, once woken).

use std::io;
use std::os::fd::OwnedFd;

use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

/// Which timer a node waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimerKind {
    /// Tokio's timer (whole milliseconds, rounded up). The only one a paused or simulated
    /// runtime follows.
    #[default]
    Tokio,
    /// A `timerfd` on the monotonic clock, to the nanosecond. Real time only; where one cannot
    /// be created, the node falls back to tokio's timer.
    Precise,
}

/// A timer a loop awaits its next deadline on.
#[derive(Debug)]
pub enum DeadlineTimer {
    /// Tokio's timer.
    Tokio,
    /// A `timerfd`, and the deadline it is armed for.
    Precise {
        /// The timer.
        fd: AsyncFd<OwnedFd>,
        /// The deadline it is armed for (re-armed only when the deadline changes).
        armed: Option<Instant>,
    },
}

impl DeadlineTimer {
    /// A timer of `kind`; a precise one that cannot be created falls back to tokio's, with a
    /// warning.
    #[must_use]
    pub fn new(kind: TimerKind) -> Self {
        match kind {
            TimerKind::Tokio => DeadlineTimer::Tokio,
            TimerKind::Precise => match precise() {
                Ok(fd) => DeadlineTimer::Precise { fd, armed: None },
                Err(error) => {
                    tracing::warn!(%error, "no timerfd: deadlines wait on tokio's timer");
                    DeadlineTimer::Tokio
                }
            },
        }
    }

    /// Wait until `deadline` (forever when `None`). Cancel-safe: a precise timer stays armed
    /// when the wait is dropped, and the next wait for the same deadline continues it.
    pub async fn sleep_until(&mut self, deadline: Option<Instant>) {
        let Some(deadline) = deadline else {
            return std::future::pending().await;
        };
        match self {
            DeadlineTimer::Tokio => tokio::time::sleep_until(deadline).await,
            DeadlineTimer::Precise { fd, armed } => {
                if *armed != Some(deadline) {
                    if let Err(error) = arm(fd, deadline) {
                        tracing::warn!(%error, "timerfd arm failed: this wait uses tokio's timer");
                        *armed = None;
                        return tokio::time::sleep_until(deadline).await;
                    }
                    *armed = Some(deadline);
                }
                if let Err(error) = expire(fd).await {
                    tracing::warn!(%error, "timerfd wait failed: this wait uses tokio's timer");
                    *armed = None;
                    tokio::time::sleep_until(deadline).await;
                }
                *armed = None;
            }
        }
    }
}

#[allow(
    deprecated,
    reason = "tokio deprecates its safe constructors because a generic `AsRawFd` need not own \
              its descriptor (RUSTSEC-2026-0386); an `OwnedFd` owns a valid one that never \
              changes, which is what the unsafe `register` asks its caller to prove, and this \
              workspace forbids `unsafe`"
)]
fn precise() -> io::Result<AsyncFd<OwnedFd>> {
    let flags = TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC;
    let fd = timerfd_create(TimerfdClockId::Monotonic, flags)?;
    AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
}

/// Arm `fd` to expire once at `deadline` (at once when it has passed). Arming also resets the
/// expiration count, so an expiry of an older deadline is not read as this one's.
fn arm(fd: &AsyncFd<OwnedFd>, deadline: Instant) -> io::Result<()> {
    // At least 1 ns: a zero value would disarm the timer.
    let after =
        deadline.saturating_duration_since(Instant::now()).max(std::time::Duration::from_nanos(1));
    let value = Timespec {
        tv_sec: i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(after.subsec_nanos()),
    };
    let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
    let spec = Itimerspec { it_interval: zero, it_value: value };
    timerfd_settime(fd.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
    Ok(())
}

/// Wait for `fd`'s expiry and consume it.
async fn expire(fd: &AsyncFd<OwnedFd>) -> io::Result<()> {
    loop {
        let mut ready = fd.readable().await?;
        let mut count = [0u8; 8];
        match ready
            .try_io(|inner| rustix::io::read(inner.get_ref(), &mut count).map_err(io::Error::from))
        {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(error)) => return Err(error),
            // Readiness was stale (an older expiry already read, or a re-arm): wait again.
            Err(_would_block) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_precise_timer_wakes_at_its_deadline_and_not_before() {
        let mut timer = DeadlineTimer::new(TimerKind::Precise);
        assert!(matches!(timer, DeadlineTimer::Precise { .. }), "Linux has timerfd");
        for delay_us in [300u64, 1_000, 1_700] {
            let deadline = Instant::now() + Duration::from_micros(delay_us);
            timer.sleep_until(Some(deadline)).await;
            assert!(Instant::now() >= deadline, "woke before its {delay_us} µs deadline");
        }
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_timer_armed_and_a_new_deadline_replaces_it() {
        let mut timer = DeadlineTimer::new(TimerKind::Precise);
        let far = Instant::now() + Duration::from_secs(3_600);
        // The wait is dropped before it ends (as a `select!` that another branch won drops it).
        let dropped = tokio::time::timeout(Duration::from_millis(2), timer.sleep_until(Some(far)));
        assert!(dropped.await.is_err(), "an hour's deadline does not expire in 2 ms");
        assert!(matches!(timer, DeadlineTimer::Precise { armed: Some(at), .. } if at == far));
        let near = Instant::now() + Duration::from_millis(1);
        timer.sleep_until(Some(near)).await;
        assert!(Instant::now() >= near);
        // A deadline already past returns at once.
        timer.sleep_until(Some(Instant::now())).await;
    }
}
