//! When a short-lived certificate (an X.509-SVID) is rotated, whatever the wall clock
//! does.
//!
//! A certificate's validity is wall-clock time: `notBefore` and `notAfter` are what
//! peers check against their own clocks, so they are written from the issuer's wall
//! clock ([`UnixMs`]). *When to replace it* is a different question: "half of its
//! lifetime has passed" is a duration, and durations are measured on the monotonic
//! clock ([`MonoMs`]). Scheduling rotation on the wall clock breaks both ways when the
//! clock is stepped (NTP correcting a bad clock, an operator, a VM restored from a
//! snapshot):
//!
//! * stepped **forward** by more than half a lifetime, every certificate looks due at
//!   once: a rotation burst of every identity on the node, each one signing a fresh key;
//! * stepped **back**, every certificate's half-life moves into the future by the size
//!   of the step: nothing rotates for hours while the certificates already held run
//!   out on the peers' clocks.
//!
//! Neither clock can tell whether the step was the fault or the fix, so the schedule
//! ignores steps altogether: an issuance records the lifetime it wrote into the
//! certificate (`notAfter − issued`, both from the *same* wall-clock read, so a step
//! cannot split them) and the monotonic time it happened at, and the certificate is
//! due at that monotonic time plus half the lifetime. The number of issuances per
//! identity is then bounded by monotonic time alone — one per half-life — and a
//! certificate written under a wrong clock is replaced within half a lifetime of the
//! clock being right again.
//!
//! Monotonic time does not advance while the machine is suspended, so a node resumed
//! after longer than half a lifetime rotates half a lifetime late; that is the price of
//! never trusting a wall-clock step, and a node agent is not suspended in practice.
//!
//! ```
//! use flock_core::rotation::Issued;
//! use flock_core::{MonoMs, UnixMs};
//!
//! // Issued at monotonic 1 000 ms, valid for an hour from the wall-clock read.
//! let issued = Issued::new(MonoMs(1_000), UnixMs(1_764_400_000_000), UnixMs(1_764_403_600_000));
//! assert_eq!(issued.rotation_at(), MonoMs(1_000 + 1_800_000));
//! assert!(!issued.due(MonoMs(1_800_999)));
//! assert!(issued.due(MonoMs(1_801_000)));
//! ```

use crate::time::{MonoMs, UnixMs};

/// One issuance of a certificate, as the rotation schedule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Issued {
    /// When it was issued, on this process's monotonic clock.
    pub at: MonoMs,
    /// The lifetime written into the certificate: `notAfter` minus the wall-clock time
    /// of issuance, in milliseconds.
    pub lifetime_ms: u64,
}

impl Issued {
    /// An issuance at monotonic time `at` of a certificate the issuer wrote at wall
    /// time `issued` with `not_after`. `issued` and `not_after` must come from the same
    /// wall-clock read (a `notAfter` earlier than `issued` gives a zero lifetime: due at
    /// once).
    pub const fn new(at: MonoMs, issued: UnixMs, not_after: UnixMs) -> Self {
        Self {
            at,
            lifetime_ms: not_after.since(issued),
        }
    }

    /// When rotation is due: half the lifetime after issuance, on the monotonic clock.
    /// Rotating at half-life leaves the other half as margin for a failed or late
    /// rotation and for proxies to pick the new secret up.
    pub const fn rotation_at(&self) -> MonoMs {
        self.at.plus(self.lifetime_ms / 2)
    }

    /// Whether rotation is due at monotonic time `now`.
    pub fn due(&self, now: MonoMs) -> bool {
        now >= self.rotation_at()
    }
}

/// How long a rotation loop sleeps before its next round, in milliseconds.
///
/// `next`: the earliest [`Issued::rotation_at`] of the certificates held (`None`: none);
/// `rotated`: how many the round that just ran rotated. The loop wakes at the next due
/// time but at least every `max_sleep_ms` (new subscriptions are noticed) and at most
/// every `min_sleep_ms` (a failing issuance must not make it a busy loop). A due
/// certificate that the round could not rotate (the issuer's chain has expired, say) is
/// retried at the slowest pace, `max_sleep_ms`, so a persistent failure is not a warning
/// storm.
pub fn next_wake_ms(
    next: Option<MonoMs>,
    now: MonoMs,
    rotated: usize,
    max_sleep_ms: u64,
    min_sleep_ms: u64,
) -> u64 {
    let stuck = rotated == 0 && next.is_some_and(|at| at <= now);
    let wait = match next {
        Some(at) if !stuck => at.since(now).min(max_sleep_ms),
        _ => max_sleep_ms,
    };
    wait.max(min_sleep_ms)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn due_at_half_the_written_lifetime_on_the_monotonic_clock() {
        let i = Issued::new(MonoMs(500), UnixMs(10_000), UnixMs(13_600));
        assert_eq!(i.lifetime_ms, 3_600);
        assert_eq!(i.rotation_at(), MonoMs(2_300));
        assert!(!i.due(MonoMs(2_299)));
        assert!(i.due(MonoMs(2_300)));
        // A notAfter before issuance: due at once, never an underflow.
        assert!(Issued::new(MonoMs(7), UnixMs(10), UnixMs(5)).due(MonoMs(7)));
    }

    #[test]
    fn the_loop_sleeps_until_the_next_rotation_within_its_bounds() {
        // Nothing held: the slowest pace.
        assert_eq!(next_wake_ms(None, MonoMs(0), 0, 5_000, 100), 5_000);
        // Until the next one, capped.
        assert_eq!(
            next_wake_ms(Some(MonoMs(1_300)), MonoMs(1_000), 0, 5_000, 100),
            300
        );
        assert_eq!(
            next_wake_ms(Some(MonoMs(90_000)), MonoMs(0), 0, 5_000, 100),
            5_000
        );
        // Never a busy loop.
        assert_eq!(
            next_wake_ms(Some(MonoMs(1_010)), MonoMs(1_000), 1, 5_000, 100),
            100
        );
        // Due but not rotated (the issuer failed): retry slowly.
        assert_eq!(
            next_wake_ms(Some(MonoMs(900)), MonoMs(1_000), 0, 5_000, 100),
            5_000
        );
    }
}
