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

impl UnixMs {
    /// RFC 3339 in UTC with milliseconds (`2026-12-06T23:30:00.123Z`), for logs read by
    /// people and log pipelines. Proleptic Gregorian calendar (the civil-from-days
    /// conversion of Howard Hinnant's `chrono`-compatible date algorithms).
    pub fn to_rfc3339(self) -> String {
        let ms = self.0 % 1000;
        let secs = self.0 / 1000;
        let (days, rem) = (secs / 86_400, secs % 86_400);
        let (h, m, s) = (rem / 3600, rem / 60 % 60, rem % 60);
        // Days since 1970-01-01 → (year, month, day); an era is 400 years.
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
    }
}

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
    fn rfc3339_names_the_utc_date_and_time() {
        assert_eq!(UnixMs(0).to_rfc3339(), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) and 2026-12-06.
        assert_eq!(
            UnixMs(951_782_400_007).to_rfc3339(),
            "2000-02-29T00:00:00.007Z"
        );
        assert_eq!(
            UnixMs(1_796_599_845_123).to_rfc3339(),
            "2026-12-06T23:30:45.123Z"
        );
        assert_eq!(
            UnixMs(4_107_542_399_999).to_rfc3339(),
            "2100-02-28T23:59:59.999Z"
        );
    }

    #[test]
    fn serializes_as_a_plain_number() {
        assert_eq!(serde_json::to_string(&UnixMs(42)).unwrap(), "42");
        assert_eq!(serde_json::from_str::<MonoMs>("7").unwrap(), MonoMs(7));
    }
}
