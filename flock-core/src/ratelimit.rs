//! A token bucket: the CNI installer's write-rate bound.
//!
//! A primary CNI that rewrites its config constantly (one that "owns" the directory)
//! would otherwise make the installer re-patch after every rewrite, as fast as the two
//! can go. The installer takes one token per write to a file; an empty bucket means
//! "not now: retry after the returned delay, warn, and report not ready".
//!
//! Pure, like the rest of flock-core: the caller passes `now` on the monotonic clock
//! ([`MonoMs`]); a wall-clock jump must not refill or drain the bucket. A `now` that
//! goes backwards refills nothing and never panics.
//!
//! # Example
//!
//! ```
//! use flock_core::ratelimit::TokenBucket;
//! use flock_core::time::MonoMs;
//!
//! // Bursts of 2 writes, then one write per 1000 ms.
//! let mut bucket = TokenBucket::new(2, 1000, MonoMs(0));
//! assert_eq!(bucket.try_take(MonoMs(0)), Ok(()));
//! assert_eq!(bucket.try_take(MonoMs(10)), Ok(()));
//! assert_eq!(bucket.try_take(MonoMs(20)), Err(980)); // next token at t = 1000
//! assert_eq!(bucket.try_take(MonoMs(1000)), Ok(()));
//! assert_eq!(bucket.try_take(MonoMs(1500)), Err(500));
//! ```

use crate::time::MonoMs;

/// A token bucket with `capacity` tokens, refilled by one every `refill_every_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u32,
    refill_every_ms: u64,
    tokens: u32,
    /// The instant the last counted refill happened (only meaningful below capacity).
    last_refill: MonoMs,
}

impl TokenBucket {
    /// A full bucket. A `capacity` of 0 is treated as 1 (a bucket that never grants
    /// would stall the installer forever); a `refill_every_ms` of 0 means "no limit".
    pub fn new(capacity: u32, refill_every_ms: u64, now: MonoMs) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            refill_every_ms,
            tokens: capacity,
            last_refill: now,
        }
    }

    /// The bucket's capacity (burst size).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Tokens available at `now`, without taking one.
    pub fn available(&self, now: MonoMs) -> u32 {
        let mut probe = self.clone();
        probe.refill(now);
        probe.tokens
    }

    fn refill(&mut self, now: MonoMs) {
        if self.refill_every_ms == 0 {
            self.tokens = self.capacity;
            return;
        }
        if self.tokens >= self.capacity {
            // Full: the refill clock starts when a token is taken.
            self.last_refill = now;
            return;
        }
        let elapsed = now.since(self.last_refill);
        let new_tokens = elapsed / self.refill_every_ms;
        if new_tokens == 0 {
            return;
        }
        let room = u64::from(self.capacity - self.tokens);
        if new_tokens >= room {
            self.tokens = self.capacity;
            self.last_refill = now;
        } else {
            // new_tokens < room <= u32::MAX.
            self.tokens += new_tokens as u32;
            self.last_refill = self.last_refill.plus(new_tokens * self.refill_every_ms);
        }
    }

    /// Takes a token at `now`: `Ok(())`, or `Err(ms)` with how long until the next
    /// token (at least 1).
    pub fn try_take(&mut self, now: MonoMs) -> Result<(), u64> {
        self.refill(now);
        if self.tokens > 0 {
            self.tokens -= 1;
            return Ok(());
        }
        let next = self.last_refill.plus(self.refill_every_ms);
        Err(next.since(now).max(1))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn burst_then_steady_rate() {
        let mut b = TokenBucket::new(3, 100, MonoMs(1_000));
        for t in 0..3 {
            assert_eq!(b.try_take(MonoMs(1_000 + t)), Ok(()));
        }
        assert_eq!(b.try_take(MonoMs(1_050)), Err(50));
        assert_eq!(b.try_take(MonoMs(1_100)), Ok(()));
        assert_eq!(b.try_take(MonoMs(1_101)), Err(99));
        // A long pause refills to capacity, not beyond.
        assert_eq!(b.available(MonoMs(10_000)), 3);
    }

    #[test]
    fn zero_settings_do_not_stall_or_panic() {
        let mut unlimited = TokenBucket::new(1, 0, MonoMs(0));
        for t in 0..1000 {
            assert_eq!(unlimited.try_take(MonoMs(t)), Ok(()));
        }
        let mut one = TokenBucket::new(0, 10, MonoMs(0));
        assert_eq!(one.capacity(), 1);
        assert_eq!(one.try_take(MonoMs(0)), Ok(()));
        assert_eq!(one.try_take(MonoMs(0)), Err(10));
    }

    #[test]
    fn clock_going_backwards_refills_nothing() {
        let mut b = TokenBucket::new(1, 100, MonoMs(1_000));
        assert_eq!(b.try_take(MonoMs(1_000)), Ok(()));
        assert!(b.try_take(MonoMs(500)).is_err());
        assert!(b.try_take(MonoMs(0)).is_err());
        assert_eq!(b.try_take(MonoMs(1_100)), Ok(()));
    }

    #[test]
    fn extreme_values_do_not_overflow() {
        let mut b = TokenBucket::new(u32::MAX, u64::MAX, MonoMs(u64::MAX));
        assert_eq!(b.try_take(MonoMs(u64::MAX)), Ok(()));
        assert_eq!(b.available(MonoMs(0)), u32::MAX - 1);
        let mut c = TokenBucket::new(1, u64::MAX, MonoMs(0));
        assert_eq!(c.try_take(MonoMs(0)), Ok(()));
        assert_eq!(c.try_take(MonoMs(u64::MAX)), Ok(()));
        assert!(c.try_take(MonoMs(u64::MAX)).unwrap_err() >= 1);
    }

    /// Over any window of `w` ms the bucket grants at most `capacity + w / refill + 1`.
    #[test]
    fn grants_are_bounded_over_any_schedule() {
        use proptest::prelude::*;
        proptest!(|(cap in 1u32..10, every in 1u64..500, gaps in proptest::collection::vec(0u64..300, 1..300))| {
            let mut b = TokenBucket::new(cap, every, MonoMs(0));
            let mut now = 0u64;
            let mut grants = Vec::new();
            for g in gaps {
                now += g;
                if b.try_take(MonoMs(now)).is_ok() {
                    grants.push(now);
                }
            }
            for (i, &start) in grants.iter().enumerate() {
                let in_window = grants[i..].iter().take_while(|&&t| t - start <= 10 * every).count();
                prop_assert!(in_window as u64 <= u64::from(cap) + 10 + 1);
            }
        });
    }
}
