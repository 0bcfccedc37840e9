//! How long the node's wake-ups keep its loop, for operators.
//!
//! Everything the relay decides runs on the node's loop, and on the default single worker
//! thread the transports' readers run only between its wake-ups. A wake-up that keeps the loop
//! longer than an event plane's buffer lasts can lose messages there (NATS's client holds 1,024
//! messages per subscription by default: a fifth of a second at 5,000 events/s), and each rank
//! with a gap is then reset or recovered. The node measures every wake-up on its own clock, from
//! the moment it woke until its work is done (its writes applied and its effects carried out,
//! awaits on its own hand-offs included; not the yield after a heavy batch, which lets the
//! others run), and reports the longest and how many passed [`SLOW_WAKEUP`] (`/metrics`:
//! `kvrelay_node_wakeup_seconds_max`, `kvrelay_node_slow_wakeups_total`).
//!
//! Invariant: `slow` counts exactly the recorded wake-ups longer than [`SLOW_WAKEUP`], and
//! `longest` is the longest recorded.

use std::time::Duration;

/// A wake-up longer than this is slow: half of what NATS's default client buffer lasts at
/// 5,000 events/s.
pub const SLOW_WAKEUP: Duration = Duration::from_millis(100);

/// The longest wake-up and the number of slow ones since the node started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WakeupStats {
    /// The longest wake-up recorded.
    pub longest: Duration,
    /// Wake-ups longer than [`SLOW_WAKEUP`].
    pub slow: u64,
}

impl WakeupStats {
    /// Record one wake-up that took `took`; true when it was slow and its count is a power of
    /// two (so a caller logs the 1st, 2nd, 4th, ... slow wake-up, not every one of a long
    /// overload).
    pub fn record(&mut self, took: Duration) -> bool {
        self.longest = self.longest.max(took);
        if took <= SLOW_WAKEUP {
            return false;
        }
        self.slow += 1;
        self.slow.is_power_of_two()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_is_kept_and_slow_ones_are_counted_and_logged_at_powers_of_two() {
        let mut stats = WakeupStats::default();
        assert!(!stats.record(Duration::from_millis(3)));
        assert!(!stats.record(SLOW_WAKEUP), "the bound itself is not slow");
        assert_eq!(stats, WakeupStats { longest: SLOW_WAKEUP, slow: 0 });
        let slow = SLOW_WAKEUP + Duration::from_millis(1);
        let logged: Vec<bool> = (0..5).map(|_| stats.record(slow)).collect();
        assert_eq!(logged, [true, true, false, true, false], "the 1st, 2nd and 4th are logged");
        assert!(!stats.record(Duration::from_millis(1)));
        assert_eq!(stats, WakeupStats { longest: slow, slow: 5 });
        stats.record(Duration::from_secs(2));
        assert_eq!(stats.longest, Duration::from_secs(2));
    }
}
