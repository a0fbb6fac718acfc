//! Exponential backoff with caller-supplied jitter.
//!
//! Every retry loop in flock (restarting a crashed Envoy, reconnecting to the control
//! plane, retrying a CNI install) sleeps for [`Backoff::next_delay`]. Like the rest of
//! flock-core it is pure: the caller supplies the randomness (`jitter`, a uniform
//! sample in `[0, 1)`) and does the sleeping.
//!
//! # Scheme: "equal jitter"
//!
//! Attempt `n` (from 0) has the ceiling `c(n) = min(max, initial × multiplierⁿ)` and
//! sleeps `c(n)/2 + jitter × c(n)/2`, i.e. uniformly in `[c(n)/2, c(n)]`.
//!
//! Of the schemes in the AWS architecture blog's "Exponential Backoff And Jitter",
//! *full jitter* (`jitter × c(n)`) spreads contending clients best, but can sleep
//! almost nothing several times in a row. flock's retry loops mostly guard one local
//! resource (a crash-looping Envoy, a socket that is not there yet) rather than a
//! contended server, so a guaranteed floor of half the ceiling matters more: a crash
//! loop never spins. Half the range is still random, which de-synchronises a fleet of
//! nodes reconnecting to the control plane after an outage.
//!
//! # Durations
//!
//! Delays and settings are [`Duration`]s (they are only ever slept on; instants
//! elsewhere in flock-core are `MonoMs`, or Unix milliseconds where other processes
//! read them). Arithmetic is done in `u128` nanoseconds and saturates, so no attempt
//! count overflows: once the ceiling reaches `max` it stays there.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use flock_core::backoff::Backoff;
//!
//! let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
//! // The caller draws jitter from its RNG; here fixed values.
//! assert_eq!(backoff.next_delay(0.0), Duration::from_millis(50)); // ceiling 100 ms
//! assert_eq!(backoff.next_delay(0.5), Duration::from_millis(150)); // ceiling 200 ms
//! assert_eq!(backoff.next_delay(1.0), Duration::from_millis(400)); // ceiling 400 ms
//! for _ in 0..100 {
//!     assert!(backoff.next_delay(0.99) <= Duration::from_secs(1)); // capped at max
//! }
//! backoff.reset(); // e.g. after the process stayed up for a while
//! assert_eq!(backoff.next_delay(0.0), Duration::from_millis(50));
//! ```

use std::time::Duration;

/// Exponential backoff with equal jitter (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    multiplier: u32,
    attempt: u32,
}

impl Backoff {
    /// The default growth factor.
    pub const DEFAULT_MULTIPLIER: u32 = 2;

    /// Backoff from `initial` doubling up to `max`. If `max < initial`, every ceiling
    /// is `max`; a zero `initial` never sleeps.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            multiplier: Self::DEFAULT_MULTIPLIER,
            attempt: 0,
        }
    }

    /// Sets the growth factor; 0 is treated as 1 (constant ceiling), so the ceiling
    /// never decreases.
    pub fn with_multiplier(mut self, multiplier: u32) -> Self {
        self.multiplier = multiplier.max(1);
        self
    }

    /// The delay before the next retry, and counts the attempt.
    ///
    /// `jitter` is a uniform sample in `[0, 1)` from the caller's RNG. Values outside
    /// are clamped into `[0, 1]`, and NaN counts as 0 (the floor), so no input
    /// panics. The result lies in `[ceiling/2, ceiling]` for the current
    /// [`ceiling`](Self::ceiling).
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        let ceiling = nanos(self.ceiling());
        self.attempt = self.attempt.saturating_add(1);
        let jitter = if jitter.is_nan() {
            0.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        let floor = ceiling / 2;
        let span = ceiling - floor;
        // `as` from f64 saturates; the product is within [0, span] up to rounding.
        let random = ((span as f64) * jitter) as u128;
        from_nanos(floor + random.min(span))
    }

    /// Starts over from `initial` (call after a success that lasted).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Attempts counted since the last reset (saturates at `u32::MAX`).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The ceiling of the next delay: `min(max, initial × multiplier^attempt)`.
    pub fn ceiling(&self) -> Duration {
        self.ceiling_at(self.attempt)
    }

    /// The ceiling of attempt `attempt` (from 0); non-decreasing in `attempt`.
    pub fn ceiling_at(&self, attempt: u32) -> Duration {
        let max = nanos(self.max);
        let grown = u128::from(self.multiplier)
            .checked_pow(attempt)
            .and_then(|factor| nanos(self.initial).checked_mul(factor))
            .unwrap_or(u128::MAX);
        from_nanos(grown.min(max))
    }
}

fn nanos(d: Duration) -> u128 {
    d.as_nanos()
}

/// Saturating conversion back to a `Duration`.
fn from_nanos(n: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(n / NANOS_PER_SEC).unwrap_or(u64::MAX);
    // The remainder is below 10^9, so it fits.
    let sub = u32::try_from(n % NANOS_PER_SEC).unwrap_or(0);
    Duration::new(secs, sub)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn first_delay_is_between_half_and_all_of_initial() {
        let mut b = Backoff::new(ms(100), ms(10_000));
        assert_eq!(b.clone().next_delay(0.0), ms(50));
        assert_eq!(b.clone().next_delay(0.5), ms(75));
        assert_eq!(b.next_delay(1.0), ms(100));
        assert_eq!(b.attempt(), 1);
    }

    #[test]
    fn ceiling_doubles_then_caps_at_max() {
        let mut b = Backoff::new(ms(100), ms(1_000));
        let ceilings: Vec<_> = (0..6)
            .map(|_| {
                let c = b.ceiling();
                b.next_delay(0.3);
                c
            })
            .collect();
        assert_eq!(
            ceilings,
            [ms(100), ms(200), ms(400), ms(800), ms(1_000), ms(1_000)]
        );
    }

    #[test]
    fn reset_starts_over() {
        let mut b = Backoff::new(ms(100), ms(1_000));
        for _ in 0..5 {
            b.next_delay(0.5);
        }
        b.reset();
        assert_eq!(b.attempt(), 0);
        assert_eq!(b.ceiling(), ms(100));
    }

    #[test]
    fn out_of_range_and_nan_jitter_are_clamped() {
        let b = Backoff::new(ms(100), ms(1_000));
        assert_eq!(b.clone().next_delay(f64::NAN), ms(50));
        assert_eq!(b.clone().next_delay(-3.0), ms(50));
        assert_eq!(b.clone().next_delay(f64::NEG_INFINITY), ms(50));
        assert_eq!(b.clone().next_delay(7.0), ms(100));
        assert_eq!(b.clone().next_delay(f64::INFINITY), ms(100));
    }

    #[test]
    fn huge_attempt_counts_and_durations_never_overflow() {
        let mut b = Backoff::new(Duration::MAX, Duration::MAX).with_multiplier(u32::MAX);
        b.attempt = u32::MAX;
        assert_eq!(b.ceiling(), Duration::MAX);
        let d = b.next_delay(0.999);
        assert!(d <= Duration::MAX && d >= Duration::MAX / 2);
        assert_eq!(b.attempt(), u32::MAX);
        assert_eq!(b.ceiling_at(u32::MAX), Duration::MAX);
    }

    #[test]
    fn max_below_initial_caps_every_ceiling() {
        let mut b = Backoff::new(ms(1_000), ms(10));
        assert_eq!(b.next_delay(1.0), ms(10));
    }

    #[test]
    fn zero_initial_never_sleeps() {
        let mut b = Backoff::new(Duration::ZERO, ms(10));
        for _ in 0..10 {
            assert_eq!(b.next_delay(0.9), Duration::ZERO);
        }
    }

    #[test]
    fn multiplier_zero_is_constant_not_shrinking() {
        let b = Backoff::new(ms(100), ms(1_000)).with_multiplier(0);
        assert_eq!(b.ceiling_at(0), ms(100));
        assert_eq!(b.ceiling_at(5), ms(100));
        let b3 = Backoff::new(ms(100), ms(10_000)).with_multiplier(3);
        assert_eq!(b3.ceiling_at(2), ms(900));
    }

    #[test]
    fn sub_millisecond_precision_is_kept() {
        let mut b = Backoff::new(Duration::from_nanos(3), Duration::from_secs(1));
        assert_eq!(b.next_delay(0.0), Duration::from_nanos(1));
        assert_eq!(b.next_delay(1.0), Duration::from_nanos(6));
    }
}
