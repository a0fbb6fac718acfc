#![cfg(not(loom))]
//! Property tests of `rotation`: a rotation loop driven by `Issued` and `next_wake_ms`
//! issues exactly as many certificates over a stretch of monotonic time whatever the
//! wall clock does meanwhile (steps of hours, forward and back, at any moment), and
//! never more than one per half-life.

use flock_core::rotation::{Issued, next_wake_ms};
use flock_core::{MonoMs, UnixMs};
use proptest::prelude::*;

const MAX_SLEEP_MS: u64 = 5_000;
const MIN_SLEEP_MS: u64 = 100;
const HOUR_MS: i64 = 3_600_000;

/// The wall clock at monotonic `t`: real time plus the offset of the last step at or
/// before `t` (`steps`: (monotonic time, offset), sorted).
fn wall(t: MonoMs, steps: &[(u64, i64)]) -> UnixMs {
    const REAL_START: i64 = 1_764_400_000_000;
    let offset = steps
        .iter()
        .take_while(|(at, _)| *at <= t.as_millis())
        .last()
        .map_or(0, |(_, o)| *o);
    UnixMs(u64::try_from(REAL_START + t.as_millis() as i64 + offset).unwrap())
}

/// Runs a rotation loop for one certificate of lifetime `ttl_ms` from monotonic 0 to
/// `until`, the wall clock stepped as `steps` says; returns the monotonic times of its
/// issuances (the first one included).
fn simulate(ttl_ms: u64, until: u64, steps: &[(u64, i64)]) -> Vec<u64> {
    let issue = |at: MonoMs| {
        let now = wall(at, steps);
        Issued::new(at, now, now.plus(ttl_ms))
    };
    let mut held = issue(MonoMs(0));
    let mut issued = vec![0];
    let mut now = MonoMs(0);
    loop {
        let mut rotated = 0;
        if held.due(now) {
            held = issue(now);
            issued.push(now.as_millis());
            rotated = 1;
        }
        now = now.plus(next_wake_ms(
            Some(held.rotation_at()),
            now,
            rotated,
            MAX_SLEEP_MS,
            MIN_SLEEP_MS,
        ));
        if now.as_millis() > until {
            return issued;
        }
    }
}

fn steps() -> impl Strategy<Value = Vec<(u64, i64)>> {
    proptest::collection::vec(
        (
            0u64..600_000,
            prop_oneof![
                Just(6 * HOUR_MS),
                Just(-6 * HOUR_MS),
                -48 * HOUR_MS..48 * HOUR_MS
            ],
        ),
        0..6,
    )
    .prop_map(|mut v| {
        v.sort_by_key(|(at, _)| *at);
        v
    })
}

proptest! {
    #[test]
    fn wall_clock_steps_change_neither_when_nor_how_often_certificates_rotate(
        ttl_ms in 2_000u64..7_200_000,
        until in 0u64..600_000,
        steps in steps(),
    ) {
        let steady = simulate(ttl_ms, until, &[]);
        let stepped = simulate(ttl_ms, until, &steps);
        prop_assert_eq!(&stepped, &steady);
        // One per half-life at most (no burst), and never a half-life without one
        // beyond the loop's wake-up granularity (no stall).
        let half = ttl_ms / 2;
        for pair in stepped.windows(2) {
            let gap = pair[1] - pair[0];
            prop_assert!(gap >= half, "rotated {gap} ms after the last issuance, half-life {half}");
            prop_assert!(gap < half + MIN_SLEEP_MS, "rotated {gap} ms after the last issuance, half-life {half}");
        }
        let last = *stepped.last().unwrap();
        prop_assert!(until - last < half + MIN_SLEEP_MS, "no rotation for {} ms, half-life {half}", until - last);
    }
}

#[test]
fn a_step_forward_does_not_rotate_and_a_step_back_does_not_stall() {
    // An hour's certificate; the clock jumps +6 h at 1 min, then −6 h (12 h back) at
    // 2 min; 2 h of monotonic time pass.
    let steps = [(60_000, 6 * HOUR_MS), (120_000, -6 * HOUR_MS)];
    let issued = simulate(3_600_000, 7_200_000, &steps);
    // At 0, 30, 60, 90 and 120 minutes: neither a burst at the forward step nor a
    // 12-hour silence after the step back.
    let minutes: Vec<u64> = issued.iter().map(|ms| ms / 60_000).collect();
    assert_eq!(minutes, [0, 30, 60, 90, 120]);
}
