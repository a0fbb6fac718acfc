//! The supervisor's in-process decisions about its own Envoy children: what to do when
//! the newest epoch exits ([`after_newest_exit`]), which record the start decision
//! gets once all of this supervisor's epochs died ([`start_input`]), and whether the
//! newest epoch's predecessor has had its full drain time ([`predecessor_drained`]),
//! which the restart gate waits on.
//!
//! They complement the cross-process rules ([`start_epoch`](super::start_epoch),
//! [`write_decision`](super::write_decision)) and, like them, are pure: the caller
//! reads the state file, the clock and its child table and passes the results in.

use super::record::{EpochRecord, WriterId};
use crate::time::{MonoMs, UnixMs};

/// What the supervisor does after its newest epoch exited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AfterExit {
    /// Another supervisor's epoch took the chain over (Strategy B) and shut ours down
    /// through Envoy's parent shutdown: expected. Wait for the remaining epochs, exit 0.
    Superseded {
        /// The successor's record.
        by: EpochRecord,
    },
    /// An unexpected death: restart (attempt `attempt` of at most `max`).
    Restart {
        /// This attempt, from 1.
        attempt: u32,
        /// The bound.
        max: u32,
    },
    /// Too many consecutive failures: stop and exit non-zero.
    GiveUp {
        /// Consecutive failures.
        failures: u32,
    },
}

/// Decides after the newest epoch of this supervisor exited; `ours` describes it
/// (epoch, base id, our writer id; the heartbeat is ignored). `on_disk` is the state
/// file's record read after the exit; `failures` counts consecutive unexpected deaths
/// *including this one*.
///
/// The exit is expected exactly when a fresh record of a higher epoch on our base id,
/// written by another supervisor, is on disk: Envoy's hot restart ends the parent,
/// and the successor records its epoch before the parent-shutdown time ends (it
/// writes within a heartbeat of LIVE, the parent lives `parent-shutdown-time` after
/// that).
///
/// # Failure modes prevented
///
/// * **Fighting a successor.** Without the superseded case, a handoff to another
///   supervisor (its epoch shuts ours down through Envoy's parent shutdown) would
///   look like a crash: we would restart an Envoy on the base id the successor owns
///   and take its sockets back, or exit non-zero and get the pod restarted. Our own
///   record, another base id's record, a record not higher than ours and a stale one
///   (an old successor that died) are no successor.
/// * **A crash loop.** Each unexpected death is restarted only while
///   `failures <= max_restarts`: a config that passes `envoy --mode validate` but
///   cannot start (a port in use) ends in [`AfterExit::GiveUp`] after `max_restarts`
///   restarts instead of restarting Envoy forever behind a healthy-looking supervisor.
///   A restart's `attempt` is `failures`, so it never exceeds `max_restarts`.
pub fn after_newest_exit(
    on_disk: Option<&EpochRecord>,
    ours: &EpochRecord,
    failures: u32,
    max_restarts: u32,
    now_unix_ms: UnixMs,
    heartbeat_max_age_ms: u64,
) -> AfterExit {
    if let Some(by) = on_disk.filter(|r| {
        r.writer != ours.writer
            && r.base_id == ours.base_id
            && r.epoch > ours.epoch
            && r.is_fresh(now_unix_ms, heartbeat_max_age_ms)
    }) {
        return AfterExit::Superseded { by: by.clone() };
    }
    match after_failure(failures, max_restarts) {
        Retry::Restart { attempt, max } => AfterExit::Restart { attempt, max },
        Retry::GiveUp { failures } => AfterExit::GiveUp { failures },
    }
}

/// The retry budget's verdict after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Retry {
    /// Try again: attempt `attempt` of at most `max`.
    Restart {
        /// This attempt, from 1.
        attempt: u32,
        /// The bound.
        max: u32,
    },
    /// Too many consecutive failures: stop and exit non-zero.
    GiveUp {
        /// Consecutive failures.
        failures: u32,
    },
}

/// The give-up rule, the one place it is written: after `failures` consecutive
/// failures (*including this one*: an unexpected death of the newest epoch, or a
/// start that produced no process), restart while `failures <= max_restarts`, else
/// give up. A restart's `attempt` is `failures`, so it never exceeds `max_restarts`;
/// with `max_restarts == 0` the first failure gives up.
pub fn after_failure(failures: u32, max_restarts: u32) -> Retry {
    if failures > max_restarts {
        Retry::GiveUp { failures }
    } else {
        Retry::Restart {
            attempt: failures,
            max: max_restarts,
        }
    }
}

/// The record to pass to [`start_epoch`](super::start_epoch) when **none** of this
/// supervisor's epochs is running: our own record describes Envoys we have reaped,
/// so it is no predecessor (`None`: cold start on our base id unless another Envoy
/// answers); anyone else's record is taken as it is.
///
/// # Failure mode prevented
///
/// **Waiting for a ghost.** Our own record stays fresh for up to
/// `heartbeat_max_age_ms` after our last Envoy died. Taken as a predecessor, it would
/// make the start decision wait for an epoch that can never answer again, so a crash
/// restart would stall until the record went stale. Another supervisor's record is still
/// authoritative: its Envoy may be alive, and [`start_epoch`](super::start_epoch)
/// keeps that case conservative.
pub fn start_input<'a>(on_disk: Option<&'a EpochRecord>, me: &WriterId) -> Option<&'a EpochRecord> {
    on_disk.filter(|r| r.writer != *me)
}

/// Whether the newest epoch's predecessor has had its full drain time: the
/// restart gate's input is "the newest epoch is LIVE **and** this".
///
/// * `epochs_running` counts this supervisor's Envoy processes still running,
///   the newest included. With at most one there is no predecessor: drained.
/// * `newest_live_since` is when the newest epoch was first seen LIVE, `None` if
///   it is not LIVE; `now` is now, both on the same monotonic clock (the
///   [`RestartGate`](super::RestartGate)'s). Round `newest_live_since` up and
///   `now` down if they come from a finer clock, so the drain is never cut short
///   by the rounding.
/// * `drain_time_ms` is Envoy's `--drain-time-s`, in milliseconds.
///
/// The predecessor started draining when the newest epoch became LIVE (Envoy's child
/// tells its parent to drain its listeners then), so it is drained once
/// `now - newest_live_since >= drain_time_ms`. A clock that went backwards
/// (`now` before `newest_live_since`) counts as no time elapsed.
///
/// # Failure mode prevented
///
/// **Cutting a draining epoch's connections.** Envoy's epoch `N + 1` terminates
/// epoch `N - 1` as soon as it starts (only one parent at a time), so forking while
/// `N - 1` is still within its drain time would close the connections it was still
/// draining. A newest epoch is therefore never considered drained-for before its full
/// drain time, whatever the trigger rate.
pub fn predecessor_drained(
    epochs_running: usize,
    newest_live_since: Option<MonoMs>,
    now: MonoMs,
    drain_time_ms: u64,
) -> bool {
    epochs_running <= 1 || newest_live_since.is_some_and(|since| now.since(since) >= drain_time_ms)
}

/// Whether a supervisor whose chain is over (SIGTERM, or giving up) may remove the
/// base id's Envoy shared memory: not when the state file holds a fresh record of
/// another writer on the same base id at a later epoch than ours (`newest`).
///
/// # Failure mode prevented
///
/// **Pulling the memory from under the successor.** In a surge upgrade the old pod's
/// supervisor is SIGTERMed right after the new pod's took Envoy over (Strategy B: the
/// same base id, so the same `/dev/shm` region); removing the region's name then left
/// the running epoch alone (it has it mapped) but made the next hot restart on that
/// node abort with "cannot open shared memory region".
pub fn may_remove_shared_memory(
    newest: Option<u32>,
    base_id: u32,
    me: &WriterId,
    on_disk: Option<&EpochRecord>,
    now_unix_ms: UnixMs,
    heartbeat_max_age_ms: u64,
) -> bool {
    let Some(newest) = newest else {
        return false;
    };
    // The mutant removes it whoever runs on it now.
    if crate::reintroduced!("shm-removed-under-successor") {
        return true;
    }
    !on_disk.is_some_and(|r| {
        r.base_id == base_id
            && &r.writer != me
            && r.epoch > newest
            && r.is_fresh(now_unix_ms, heartbeat_max_age_ms)
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_finishing_supervisor_leaves_a_successors_shared_memory() {
        let me = WriterId::new("old-pod").unwrap();
        let other = WriterId::new("new-pod").unwrap();
        let rec = |epoch, base_id, writer: &WriterId, at| {
            EpochRecord::new(epoch, base_id, UnixMs(at), writer.clone())
        };
        let now = UnixMs(1_000_000);
        // A fresh successor at a later epoch on our base id: keep it.
        let next = rec(4, 7, &other, 999_000);
        assert!(!may_remove_shared_memory(
            Some(3),
            7,
            &me,
            Some(&next),
            now,
            5000
        ));
        // Our own record, no record, a stale successor, another base id, an older
        // epoch: ours to remove.
        let own = rec(3, 7, &me, 999_000);
        assert!(may_remove_shared_memory(
            Some(3),
            7,
            &me,
            Some(&own),
            now,
            5000
        ));
        assert!(may_remove_shared_memory(Some(3), 7, &me, None, now, 5000));
        let stale = rec(4, 7, &other, 100_000);
        assert!(may_remove_shared_memory(
            Some(3),
            7,
            &me,
            Some(&stale),
            now,
            5000
        ));
        let elsewhere = rec(4, 8, &other, 999_000);
        assert!(may_remove_shared_memory(
            Some(3),
            7,
            &me,
            Some(&elsewhere),
            now,
            5000
        ));
        let older = rec(2, 7, &other, 999_000);
        assert!(may_remove_shared_memory(
            Some(3),
            7,
            &me,
            Some(&older),
            now,
            5000
        ));
        // Never started an epoch: nothing of ours to remove.
        assert!(!may_remove_shared_memory(None, 7, &me, None, now, 5000));
    }

    const NOW: UnixMs = UnixMs(1_000_000);
    fn rec(epoch: u32, base_id: u32, writer: &str, age: u64) -> EpochRecord {
        EpochRecord::new(
            epoch,
            base_id,
            UnixMs(NOW.as_millis() - age),
            WriterId::new(writer).unwrap(),
        )
    }
    fn me() -> WriterId {
        WriterId::new("me").unwrap()
    }
    fn drained(running: usize, live_since: Option<u64>, now: u64, drain_ms: u64) -> bool {
        predecessor_drained(running, live_since.map(MonoMs), MonoMs(now), drain_ms)
    }
    fn ours() -> EpochRecord {
        rec(3, 7, "me", 0)
    }

    #[test]
    fn a_fresh_successor_on_our_base_id_means_superseded() {
        let by = rec(4, 7, "other", 100);
        assert_eq!(
            after_newest_exit(Some(&by), &ours(), 1, 5, NOW, 5_000),
            AfterExit::Superseded { by }
        );
    }

    #[test]
    fn a_successor_supersedes_even_past_the_retry_budget() {
        let by = rec(9, 7, "other", 0);
        assert_eq!(
            after_newest_exit(Some(&by), &ours(), 100, 5, NOW, 5_000),
            AfterExit::Superseded { by }
        );
    }

    #[test]
    fn anything_else_is_a_crash_bounded_by_max_restarts() {
        let cases = [
            None,
            Some(rec(4, 7, "me", 0)),        // our own record
            Some(rec(4, 8, "other", 0)),     // another chain
            Some(rec(3, 7, "other", 0)),     // not higher
            Some(rec(4, 7, "other", 5_001)), // stale
        ];
        for on_disk in cases {
            assert_eq!(
                after_newest_exit(on_disk.as_ref(), &ours(), 2, 5, NOW, 5_000),
                AfterExit::Restart { attempt: 2, max: 5 },
                "{on_disk:?}"
            );
            assert_eq!(
                after_newest_exit(on_disk.as_ref(), &ours(), 6, 5, NOW, 5_000),
                AfterExit::GiveUp { failures: 6 }
            );
        }
    }

    #[test]
    fn the_last_restart_is_attempt_max_then_give_up() {
        assert_eq!(
            after_newest_exit(None, &ours(), 3, 3, NOW, 5_000),
            AfterExit::Restart { attempt: 3, max: 3 }
        );
        assert_eq!(
            after_newest_exit(None, &ours(), 4, 3, NOW, 5_000),
            AfterExit::GiveUp { failures: 4 }
        );
        // No restarts allowed: the first death gives up.
        assert_eq!(
            after_newest_exit(None, &ours(), 1, 0, NOW, 5_000),
            AfterExit::GiveUp { failures: 1 }
        );
    }

    #[test]
    fn the_give_up_rule_allows_exactly_max_restarts() {
        for max in 0..5 {
            for failures in 1..=max {
                assert_eq!(
                    after_failure(failures, max),
                    Retry::Restart {
                        attempt: failures,
                        max
                    }
                );
            }
            assert_eq!(
                after_failure(max + 1, max),
                Retry::GiveUp { failures: max + 1 }
            );
        }
    }

    #[test]
    fn our_own_record_is_no_predecessor_once_our_envoys_are_gone() {
        let mine = rec(3, 7, "me", 0);
        let theirs = rec(3, 7, "other", 0);
        assert_eq!(start_input(Some(&mine), &me()), None);
        assert_eq!(start_input(Some(&theirs), &me()), Some(&theirs));
        assert_eq!(start_input(None, &me()), None);
    }

    #[test]
    fn a_single_epoch_has_no_predecessor_to_drain() {
        assert!(drained(0, None, 0, 10_000));
        assert!(drained(1, None, 0, 10_000));
        assert!(drained(1, Some(500), 500, 10_000));
    }

    #[test]
    fn a_predecessor_drains_for_the_full_drain_time_after_live() {
        assert!(!drained(2, Some(1_000), 10_999, 10_000));
        assert!(drained(2, Some(1_000), 11_000, 10_000));
        assert!(drained(3, Some(1_000), 50_000, 10_000));
        // Not LIVE yet: its predecessor has not started draining.
        assert!(!drained(2, None, u64::MAX, 0));
        // Zero drain time: drained as soon as LIVE.
        assert!(drained(2, Some(1_000), 1_000, 0));
    }

    #[test]
    fn a_clock_going_backwards_never_shortens_the_drain() {
        assert!(!drained(2, Some(5_000), 4_000, 1));
        assert!(!drained(2, Some(u64::MAX), 0, 1));
        assert!(drained(2, Some(0), u64::MAX, u64::MAX));
    }
}
