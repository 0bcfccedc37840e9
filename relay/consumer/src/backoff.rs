//! Reconnect pacing for the consumer's streams: bounded exponential backoff with jitter.
//!
//! Pure: the caller supplies the random generator (seeded, so a simulated run repeats exactly)
//! and sleeps for the returned delay with `tokio::time`. Invariants:
//! - every delay lies in `[ceiling / 2, ceiling]`, where the ceiling doubles per consecutive
//!   failure from [`BackoffPolicy::initial`] and never exceeds [`BackoffPolicy::max`];
//! - the attempt counter saturates, so no number of failures overflows anything;
//! - [`Backoff::reset`] after a stream made progress restarts the ladder at `initial`.
//!
//! Retries are bounded in rate (at worst one per `max`), not in count: a reference consumer has
//! to converge whenever the relay comes back. Reasons that retrying cannot fix stop the stream
//! instead (see [`super::policy`]).

use std::time::Duration;

use rand_core::Rng;
use thiserror::Error;

/// Longest `max` a policy may name: a consumer never waits longer than this between attempts.
pub const BACKOFF_MAX_LIMIT: Duration = Duration::from_secs(600);

/// Doublings after which the ceiling is certainly capped (2^40 ns > [`BACKOFF_MAX_LIMIT`]).
const ATTEMPT_CAP: u32 = 40;

/// The shape of the backoff ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Ceiling of the first delay; nonzero.
    pub initial: Duration,
    /// Largest ceiling; at least `initial`, at most [`BACKOFF_MAX_LIMIT`].
    pub max: Duration,
}

impl Default for BackoffPolicy {
    /// 100 ms doubling up to 5 s.
    fn default() -> Self {
        BackoffPolicy { initial: Duration::from_millis(100), max: Duration::from_secs(5) }
    }
}

/// Why a [`BackoffPolicy`] is unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum BackoffPolicyError {
    /// `initial` is zero: retries would spin.
    #[error("backoff initial delay must be nonzero")]
    ZeroInitial,
    /// `max` is below `initial`.
    #[error("backoff max {max:?} is below the initial delay {initial:?}")]
    MaxBelowInitial {
        /// The initial delay.
        initial: Duration,
        /// The maximum delay.
        max: Duration,
    },
    /// `max` exceeds [`BACKOFF_MAX_LIMIT`].
    #[error("backoff max {0:?} exceeds {BACKOFF_MAX_LIMIT:?}")]
    MaxTooLarge(Duration),
}

impl BackoffPolicy {
    /// Check the policy's invariants.
    pub fn validate(&self) -> Result<(), BackoffPolicyError> {
        if self.initial.is_zero() {
            return Err(BackoffPolicyError::ZeroInitial);
        }
        if self.max < self.initial {
            return Err(BackoffPolicyError::MaxBelowInitial {
                initial: self.initial,
                max: self.max,
            });
        }
        if self.max > BACKOFF_MAX_LIMIT {
            return Err(BackoffPolicyError::MaxTooLarge(self.max));
        }
        Ok(())
    }
}

/// One stream's position on the backoff ladder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    policy: BackoffPolicy,
    attempt: u32,
}

impl Backoff {
    /// A ladder at its first step. The policy should be valid ([`BackoffPolicy::validate`]);
    /// an invalid one is clamped into `1 ms ≤ initial ≤ max ≤` [`BACKOFF_MAX_LIMIT`].
    #[must_use]
    pub fn new(policy: BackoffPolicy) -> Self {
        let initial = policy.initial.clamp(Duration::from_millis(1), BACKOFF_MAX_LIMIT);
        let max = policy.max.clamp(initial, BACKOFF_MAX_LIMIT);
        Backoff { policy: BackoffPolicy { initial, max }, attempt: 0 }
    }

    /// Consecutive delays handed out since the last reset.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The ceiling of the next delay: `initial × 2^attempt`, capped at `max`.
    #[must_use]
    pub fn ceiling(&self) -> Duration {
        // `initial` and `max` are at most 600 s (< 2^40 ns), so shifting by at most 40 fits u128.
        let initial_ns = self.policy.initial.as_nanos();
        let grown_ns = initial_ns.checked_shl(self.attempt.min(ATTEMPT_CAP)).unwrap_or(u128::MAX);
        let capped_ns = grown_ns.min(self.policy.max.as_nanos());
        Duration::from_nanos(u64::try_from(capped_ns).unwrap_or(u64::MAX))
    }

    /// The next delay, uniformly in `[ceiling / 2, ceiling]`, and one step up the ladder.
    pub fn next_delay<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let ceiling = self.ceiling();
        let ceiling_ns = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        let floor_ns = ceiling_ns / 2;
        let span_ns = ceiling_ns - floor_ns;
        let jitter_ns =
            if span_ns == u64::MAX { rng.next_u64() } else { rng.next_u64() % (span_ns + 1) };
        self.attempt = self.attempt.saturating_add(1).min(ATTEMPT_CAP);
        let delay = Duration::from_nanos(floor_ns.saturating_add(jitter_ns));
        debug_assert!(delay <= ceiling && delay >= ceiling / 2);
        delay
    }

    /// Back to the first step (the stream made progress).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::rng::rng_from_seed;

    fn policy() -> BackoffPolicy {
        BackoffPolicy::default()
    }

    #[test]
    fn delays_double_within_jitter_and_stop_at_the_cap() {
        let mut backoff = Backoff::new(policy());
        let mut rng = rng_from_seed(7);
        let mut ceilings = Vec::new();
        for _ in 0..12 {
            let ceiling = backoff.ceiling();
            let delay = backoff.next_delay(&mut rng);
            assert!(delay >= ceiling / 2 && delay <= ceiling, "{delay:?} outside {ceiling:?}");
            ceilings.push(ceiling.as_millis());
        }
        assert_eq!(&ceilings[..7], &[100, 200, 400, 800, 1600, 3200, 5000]);
        assert!(ceilings[7..].iter().all(|&ceiling| ceiling == 5000));
    }

    #[test]
    fn reset_restarts_the_ladder() {
        let mut backoff = Backoff::new(policy());
        let mut rng = rng_from_seed(1);
        for _ in 0..5 {
            let _ = backoff.next_delay(&mut rng);
        }
        assert_eq!(backoff.attempt(), 5);
        backoff.reset();
        assert_eq!(backoff.ceiling(), Duration::from_millis(100));
    }

    #[test]
    fn the_same_seed_gives_the_same_delays() {
        let delays = |seed| {
            let mut backoff = Backoff::new(policy());
            let mut rng = rng_from_seed(seed);
            (0..8).map(|_| backoff.next_delay(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(delays(42), delays(42));
        assert_ne!(delays(42), delays(43));
    }

    #[test]
    fn endless_failures_never_overflow() {
        let mut backoff = Backoff::new(BackoffPolicy {
            initial: Duration::from_nanos(1),
            max: BACKOFF_MAX_LIMIT,
        });
        let mut rng = rng_from_seed(3);
        for _ in 0..1000 {
            assert!(backoff.next_delay(&mut rng) <= BACKOFF_MAX_LIMIT);
        }
        assert_eq!(backoff.ceiling(), BACKOFF_MAX_LIMIT);
    }

    #[test]
    fn invalid_policies_are_named() {
        let zero = BackoffPolicy { initial: Duration::ZERO, max: Duration::from_secs(1) };
        assert_eq!(zero.validate(), Err(BackoffPolicyError::ZeroInitial));
        let inverted =
            BackoffPolicy { initial: Duration::from_secs(2), max: Duration::from_secs(1) };
        assert!(matches!(inverted.validate(), Err(BackoffPolicyError::MaxBelowInitial { .. })));
        let huge =
            BackoffPolicy { initial: Duration::from_secs(1), max: Duration::from_secs(3600) };
        assert!(matches!(huge.validate(), Err(BackoffPolicyError::MaxTooLarge(_))));
        assert_eq!(policy().validate(), Ok(()));
        // Clamped rather than trusted when used anyway.
        let mut backoff = Backoff::new(zero);
        assert!(backoff.next_delay(&mut rng_from_seed(0)) <= Duration::from_millis(1));
    }
}
