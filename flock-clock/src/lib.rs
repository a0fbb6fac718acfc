//! Reads the clocks and the jitter source for flock's I/O crates; flock-core takes their values as parameters.
//!
//! Everything time-dependent in flock is decided in `flock-core` from a time passed
//! in. This crate is the one place that reads the time flock-core's decisions take
//! (plain I/O timeouts and file ages elsewhere use tokio's or std's clock directly):
//!
//! * [`unix_now`]: wall-clock time as [`UnixMs`], for values other processes read
//!   (heartbeats in the hot-restart state file, timestamps in records);
//! * [`mono_now`]: monotonic time as [`MonoMs`], for deadlines and windows. It is read
//!   from `tokio::time::Instant`, so a test on a paused tokio clock
//!   (`#[tokio::test(start_paused = true)]`) drives every loop's deadlines without
//!   sleeping; [`mono_instant`] turns a deadline back into an instant to sleep until;
//! * [`jitter`]: a uniform sample in `[0, 1)` for backoff jitter.
//!
//! # Test-only wall-clock faults (feature `clock-fault`)
//!
//! A time namespace does not move `CLOCK_REALTIME`, and stepping the host's clock
//! would step every process on the machine, so the end-to-end clock-fault tests fake
//! the one source flock reads instead. With the `clock-fault` feature, and only when
//! the variable [`CLOCK_FAULT_ENV`] names a file, [`unix_now`] adds to the real time the
//! signed number of milliseconds that file holds (read on every call, so a test steps
//! a running agent's wall clock by rewriting the file; a missing or unparsable file is
//! an offset of 0). Monotonic time is never offset: a stepped wall clock is exactly
//! what an NTP step or an operator's `date -s` does to a real one. The feature is
//! enabled only by `flock-agent`'s dev-dependencies, i.e. in test builds, and is
//! absent from a release build (`cargo build --release -p flock-agent`);
//! [`CLOCK_FAULT_COMPILED`] says whether it is in.
#![forbid(unsafe_code)]

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use flock_core::time::{MonoMs, UnixMs};
use tokio::time::Instant;

/// Wall-clock time now (0 if the clock is set before 1970).
pub fn unix_now() -> UnixMs {
    let real = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    #[cfg(feature = "clock-fault")]
    let real = fault::stepped(real);
    UnixMs(real)
}

/// The variable naming the wall-clock offset file of the `clock-fault` feature.
pub const CLOCK_FAULT_ENV: &str = "FLOCK_TEST_CLOCK_OFFSET_FILE";

/// Whether this build has the test-only `clock-fault` hook (see the crate docs).
pub const CLOCK_FAULT_COMPILED: bool = cfg!(feature = "clock-fault");

#[cfg(feature = "clock-fault")]
mod fault {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// The offset file, if the variable is set (read once: a process's environment).
    fn file() -> Option<&'static PathBuf> {
        static FILE: OnceLock<Option<PathBuf>> = OnceLock::new();
        FILE.get_or_init(|| std::env::var_os(super::CLOCK_FAULT_ENV).map(PathBuf::from))
            .as_ref()
    }

    /// The offset in the file: a signed decimal number of milliseconds, at most 64
    /// bytes; anything else is 0.
    pub(super) fn offset_ms() -> i64 {
        let Some(path) = file() else { return 0 };
        let mut buf = [0u8; 64];
        let n = match std::fs::File::open(path) {
            Ok(mut f) => std::io::Read::read(&mut f, &mut buf).unwrap_or(0),
            Err(_) => 0,
        };
        std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// `real` milliseconds moved by the offset (saturating at 0 and `u64::MAX`).
    pub(super) fn stepped(real: u64) -> u64 {
        let off = offset_ms();
        if off >= 0 {
            real.saturating_add(off.unsigned_abs())
        } else {
            real.saturating_sub(off.unsigned_abs())
        }
    }
}

/// The instant [`MonoMs::ZERO`] stands for: the first monotonic read of the process.
fn mono_base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Monotonic time now, in milliseconds since this process first read it.
pub fn mono_now() -> MonoMs {
    mono_at(Instant::now())
}

/// The monotonic time of `instant` (0 for instants before the first read).
pub fn mono_at(instant: Instant) -> MonoMs {
    let since = instant.saturating_duration_since(mono_base());
    MonoMs(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// The instant a monotonic time stands for, e.g. to `tokio::time::sleep_until` a
/// deadline a flock-core machine returned.
pub fn mono_instant(at: MonoMs) -> Instant {
    mono_base() + Duration::from_millis(at.as_millis())
}

/// A uniform sample in `[0, 1)`, for backoff jitter. Not for anything secret: it is a
/// randomly keyed hash (std's `RandomState`) of the time and a counter.
pub fn jitter() -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u64(unix_now().as_millis());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_is_in_the_unit_interval_and_varies() {
        let samples: Vec<f64> = (0..64).map(|_| jitter()).collect();
        assert!(samples.iter().all(|j| (0.0..1.0).contains(j)));
        assert!(samples.windows(2).any(|w| w[0] != w[1]));
    }

    #[tokio::test(start_paused = true)]
    async fn mono_follows_a_paused_tokio_clock() {
        let before = mono_now();
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(mono_now().since(before), 1500);
        assert_eq!(mono_at(mono_instant(before.plus(10))), before.plus(10));
    }

    #[test]
    fn unix_now_is_after_2020() {
        assert!(unix_now() > UnixMs(1_577_836_800_000));
    }
}
