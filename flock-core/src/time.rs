//! Typed millisecond clocks: what kind of time a value is, said by its type.
//!
//! flock-core reads no clock; callers pass the time in. Two clocks are in play and
//! must never be mixed: wall-clock time, which is what other processes and files
//! agree on (the hot-restart state file's heartbeat, a lease written for another
//! node) and which can jump; and monotonic time, which only this process can
//! interpret and which never goes backwards (deadlines, debounce windows, warm-up).
//! A `u64` of milliseconds says neither; [`UnixMs`] and [`MonoMs`] do, so a deadline
//! cannot be compared with a heartbeat by accident. The I/O crates read both clocks
//! through the `flock-clock` crate.

use serde::{Deserialize, Serialize};

macro_rules! millis_clock {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The zero point of this clock.
            pub const ZERO: Self = Self(0);

            /// Milliseconds since this clock's zero point.
            pub const fn as_millis(self) -> u64 {
                self.0
            }

            /// This time plus `ms` milliseconds (saturating: far deadlines stay far).
            #[must_use]
            pub const fn plus(self, ms: u64) -> Self {
                Self(self.0.saturating_add(ms))
            }

            /// Milliseconds from `earlier` to `self`; zero when `earlier` is not earlier.
            pub const fn since(self, earlier: Self) -> u64 {
                self.0.saturating_sub(earlier.0)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}ms", self.0)
            }
        }
    };
}

millis_clock!(
    /// Wall-clock time: milliseconds since the Unix epoch. Comparable across processes
    /// and machines (within their clock skew); it can jump when the clock is set.
    UnixMs
);

millis_clock!(
    /// Monotonic time: milliseconds since an arbitrary, per-process zero point. Never
    /// goes backwards; meaningless outside the process that read it.
    MonoMs
);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        assert_eq!(MonoMs(5).since(MonoMs(9)), 0);
        assert_eq!(MonoMs(9).since(MonoMs(5)), 4);
        assert_eq!(UnixMs(u64::MAX).plus(1), UnixMs(u64::MAX));
        assert_eq!(MonoMs(1).plus(2), MonoMs(3));
    }

    #[test]
    fn serializes_as_a_plain_number() {
        assert_eq!(serde_json::to_string(&UnixMs(42)).unwrap(), "42");
        assert_eq!(serde_json::from_str::<MonoMs>("7").unwrap(), MonoMs(7));
    }
}
