//! Wall-clock seam. Monotonic time is `tokio::time` everywhere (the simulator drives it per
//! host); wall-clock stamps that go on the wire (`send_ts_us`, `observed_ms`) come from here.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};

/// A source of wall-clock time.
pub trait WallClock: Send + Sync + Debug + 'static {
    /// Microseconds since the Unix epoch.
    fn now_unix_us(&self) -> u64;

    /// Milliseconds since the Unix epoch.
    fn now_unix_ms(&self) -> u64 {
        self.now_unix_us() / 1000
    }

    /// Whether the runtime this clock is used with follows real time, so a loop may wait on a
    /// real-time timer ([`super::TimerKind::Precise`]). Only the operating system's clock says
    /// so: a manual or simulated clock goes with a paused or simulated runtime.
    fn follows_real_time(&self) -> bool {
        false
    }
}

/// The operating system's clock (production only).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemWallClock;

impl WallClock for SystemWallClock {
    #[allow(clippy::disallowed_methods, reason = "this is the production wall-clock seam")]
    fn now_unix_us(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
    }

    fn follows_real_time(&self) -> bool {
        true
    }
}

/// A clock that reads what it was last set to (tests and simulation).
#[derive(Debug, Default)]
pub struct ManualWallClock {
    unix_us: AtomicU64,
}

impl ManualWallClock {
    /// A clock reading `unix_us`.
    #[must_use]
    pub fn new(unix_us: u64) -> Self {
        ManualWallClock { unix_us: AtomicU64::new(unix_us) }
    }

    /// Set the reading.
    pub fn set_unix_us(&self, unix_us: u64) {
        self.unix_us.store(unix_us, Ordering::Relaxed);
    }

    /// Move the reading forward.
    pub fn advance_us(&self, by_us: u64) {
        self.unix_us.fetch_add(by_us, Ordering::Relaxed);
    }
}

impl WallClock for ManualWallClock {
    fn now_unix_us(&self) -> u64 {
        self.unix_us.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_reads_what_it_was_set_to() {
        let clock = ManualWallClock::new(5_000);
        assert_eq!(clock.now_unix_ms(), 5);
        clock.advance_us(2_500);
        assert_eq!(clock.now_unix_us(), 7_500);
        clock.set_unix_us(1);
        assert_eq!(clock.now_unix_us(), 1);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemWallClock.now_unix_ms() > 1_577_836_800_000);
    }
}
