#![cfg(not(loom))]
//! Property tests of `Backoff`: every delay lies in `[ceiling/2, ceiling]`, the
//! ceiling never decreases and never exceeds `max`, and nothing overflows or panics
//! whatever the settings, jitter values or attempt counts.

use std::time::Duration;

use flock_core::backoff::Backoff;
use proptest::prelude::*;

fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        (0u64..10_000_000_000).prop_map(Duration::from_nanos),
        (0u64..u64::MAX, 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

/// Jitter as callers might get it wrong: in range, out of range, infinite, NaN.
fn jitter() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0f64..1.0,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(1.0),
        1 => any::<f64>(),
    ]
}

proptest! {
    #[test]
    fn delays_stay_within_bounds_and_the_ceiling_only_grows(
        initial in duration(),
        max in duration(),
        multiplier in 0u32..10,
        jitters in proptest::collection::vec(jitter(), 1..200),
    ) {
        let mut backoff = Backoff::new(initial, max).with_multiplier(multiplier);
        let mut previous_ceiling = Duration::ZERO;
        for (n, j) in jitters.into_iter().enumerate() {
            prop_assert_eq!(backoff.attempt() as usize, n);
            let ceiling = backoff.ceiling();
            prop_assert_eq!(backoff.ceiling_at(n as u32), ceiling);
            prop_assert!(ceiling <= max, "ceiling {:?} above max {:?}", ceiling, max);
            prop_assert!(ceiling >= previous_ceiling, "ceiling shrank");
            let delay = backoff.next_delay(j);
            prop_assert!(delay <= ceiling, "delay {:?} above ceiling {:?}", delay, ceiling);
            prop_assert!(delay >= ceiling / 2, "delay {:?} below half of {:?}", delay, ceiling);
            previous_ceiling = ceiling;
        }
    }

    #[test]
    fn ceiling_is_monotone_and_capped_for_any_attempt(
        initial in duration(),
        max in duration(),
        multiplier in 0u32..=u32::MAX,
        a in any::<u32>(),
        b in any::<u32>(),
    ) {
        let backoff = Backoff::new(initial, max).with_multiplier(multiplier);
        let (lo, hi) = (a.min(b), a.max(b));
        prop_assert!(backoff.ceiling_at(lo) <= backoff.ceiling_at(hi));
        prop_assert!(backoff.ceiling_at(hi) <= max);
        prop_assert_eq!(backoff.ceiling_at(0), initial.min(max));
    }

    #[test]
    fn larger_jitter_never_gives_a_shorter_delay(
        initial in duration(),
        max in duration(),
        j1 in 0.0f64..1.0,
        j2 in 0.0f64..1.0,
    ) {
        let backoff = Backoff::new(initial, max);
        let (lo, hi) = (j1.min(j2), j1.max(j2));
        prop_assert!(backoff.clone().next_delay(lo) <= backoff.clone().next_delay(hi));
    }

    #[test]
    fn reset_restores_the_first_delay(
        initial in duration(),
        max in duration(),
        n in 0usize..100,
        j in 0.0f64..1.0,
    ) {
        let fresh = Backoff::new(initial, max);
        let mut used = fresh.clone();
        for _ in 0..n {
            used.next_delay(0.5);
        }
        used.reset();
        prop_assert_eq!(used.next_delay(j), fresh.clone().next_delay(j));
    }
}
