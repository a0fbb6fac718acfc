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
#![forbid(unsafe_code)]

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use flock_core::time::{MonoMs, UnixMs};
use tokio::time::Instant;

/// Wall-clock time now (0 if the clock is set before 1970).
pub fn unix_now() -> UnixMs {
    UnixMs(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
    )
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
