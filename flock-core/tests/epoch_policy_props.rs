#![cfg(not(loom))]
//! Property tests of the supervisor's in-process epoch rules: [`after_newest_exit`]
//! (superseded, restart or give up), [`start_input`] (never our own record) and
//! [`predecessor_drained`] (the restart gate's drain condition).

use flock_core::epoch::{
    AfterExit, EpochRecord, WriterId, after_newest_exit, predecessor_drained, start_input,
};
use flock_core::time::{MonoMs, UnixMs};
use proptest::prelude::*;

fn writer() -> impl Strategy<Value = WriterId> {
    prop_oneof![
        Just("me".to_owned()),
        Just("other".to_owned()),
        "[A-Za-z0-9][A-Za-z0-9._-]{0,8}",
    ]
    .prop_map(|s| WriterId::new(s).expect("valid by construction"))
}

/// Records close to each other, so equal base ids / epochs / writers are common.
fn record(now: u64) -> impl Strategy<Value = EpochRecord> {
    (
        prop_oneof![0u32..6, Just(u32::MAX)],
        0u32..3,
        prop_oneof![
            (0u64..20_000).prop_map(move |age| now.saturating_sub(age)),
            (0u64..20_000).prop_map(move |ahead| now.saturating_add(ahead)),
            any::<u64>(),
        ],
        writer(),
    )
        .prop_map(|(epoch, base_id, hb, w)| EpochRecord::new(epoch, base_id, UnixMs(hb), w))
}

const NOW: u64 = 1_764_400_000_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Every decision's contract: superseded exactly for another supervisor's fresh,
    /// higher record on our base id; otherwise a restart numbered `failures` within
    /// the budget, or a give-up past it.
    #[test]
    fn after_exit_contract(
        on_disk in proptest::option::of(record(NOW)),
        ours in record(NOW),
        failures in prop_oneof![0u32..12, Just(u32::MAX)],
        max_restarts in prop_oneof![0u32..10, Just(u32::MAX)],
        max_age in prop_oneof![Just(0u64), 1u64..30_000, Just(u64::MAX)],
    ) {
        let decision = after_newest_exit(on_disk.as_ref(), &ours, failures, max_restarts, UnixMs(NOW), max_age);
        let successor = on_disk.as_ref().is_some_and(|r| {
            r.writer != ours.writer
                && r.base_id == ours.base_id
                && r.epoch > ours.epoch
                && r.is_fresh(UnixMs(NOW), max_age)
        });
        match decision {
            AfterExit::Superseded { by } => {
                prop_assert!(successor, "superseded by a non-successor {by}");
                prop_assert_eq!(Some(&by), on_disk.as_ref());
            }
            AfterExit::Restart { attempt, max } => {
                prop_assert!(!successor, "restarted against a fresh successor");
                prop_assert!(attempt <= max_restarts, "restart {attempt} beyond the budget {max_restarts}");
                prop_assert_eq!((attempt, max), (failures, max_restarts));
            }
            AfterExit::GiveUp { failures: f } => {
                prop_assert!(!successor, "gave up although superseded");
                prop_assert!(f > max_restarts, "gave up within the budget: {f} <= {max_restarts}");
                prop_assert_eq!(f, failures);
            }
        }
    }

    /// A crash loop, driven the way the supervisor drives it (failures counted from 1,
    /// the count kept by the caller): at most `max_restarts` restarts, then a give-up,
    /// whatever (non-successor) records are on disk along the way.
    #[test]
    fn after_exit_never_restarts_beyond_the_retry_budget(
        max_restarts in 0u32..20,
        records in proptest::collection::vec(proptest::option::of(record(NOW)), 1..40),
        max_age in 1u64..30_000,
    ) {
        let me = WriterId::new("me").expect("valid");
        let ours = EpochRecord::new(3, 1, UnixMs::ZERO, me);
        let mut failures = 0u32;
        let mut restarts = 0u32;
        for on_disk in &records {
            match after_newest_exit(on_disk.as_ref(), &ours, failures + 1, max_restarts, UnixMs(NOW), max_age) {
                AfterExit::Superseded { .. } => return Ok(()),
                AfterExit::Restart { attempt, max } => {
                    prop_assert_eq!(max, max_restarts);
                    failures = attempt;
                    restarts += 1;
                    prop_assert!(restarts <= max_restarts, "{restarts} restarts, budget {max_restarts}");
                }
                AfterExit::GiveUp { failures: f } => {
                    prop_assert_eq!(restarts, max_restarts, "gave up before using the budget");
                    prop_assert_eq!(f, max_restarts + 1);
                    return Ok(());
                }
            }
        }
        prop_assert!(restarts <= max_restarts);
    }

    /// The start input is never our own record, and anyone else's record is passed on
    /// as it is (the very same record).
    #[test]
    fn start_input_never_returns_our_own_record(
        on_disk in proptest::option::of(record(NOW)),
        me in writer(),
    ) {
        let input = start_input(on_disk.as_ref(), &me);
        if let Some(r) = input {
            prop_assert_ne!(&r.writer, &me, "our own record {} as the start input", r);
            prop_assert!(std::ptr::eq(r, on_disk.as_ref().expect("Some in, Some out")));
        } else {
            prop_assert!(on_disk.as_ref().is_none_or(|r| r.writer == me), "dropped {on_disk:?}");
        }
    }

    /// With a predecessor running, the newest epoch is never considered drained-for
    /// before its full drain time since it became LIVE, and once drained it stays
    /// drained as time passes.
    #[test]
    fn a_newest_epoch_is_never_drained_for_before_its_full_drain_time(
        running in 0usize..5,
        live_since in proptest::option::of(prop_oneof![0u64..100_000, any::<u64>()]),
        now in prop_oneof![0u64..200_000, any::<u64>()],
        later in prop_oneof![0u64..200_000, any::<u64>()],
        drain in prop_oneof![Just(0u64), 0u64..100_000, any::<u64>()],
    ) {
        let drained = predecessor_drained(running, live_since.map(MonoMs), MonoMs(now), drain);
        if running <= 1 {
            prop_assert!(drained, "no predecessor, yet not drained");
        } else if drained {
            let since = live_since.expect("drained before LIVE");
            // A clock before LIVE counts as no time elapsed: drained only without a
            // drain time.
            prop_assert!(now >= since || drain == 0, "drained with the clock before LIVE");
            let elapsed = now.saturating_sub(since);
            prop_assert!(elapsed >= drain, "drained {elapsed} ms after LIVE, drain time {drain}");
        } else {
            prop_assert!(live_since.is_none_or(|s| now.saturating_sub(s) < drain));
        }
        let then = now.saturating_add(later);
        if drained {
            prop_assert!(predecessor_drained(running, live_since.map(MonoMs), MonoMs(then), drain), "undrained at {then}");
        }
    }
}
