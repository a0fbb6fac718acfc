//! The supervisor's own small decisions about its children (pure, no I/O).
//!
//! Everything about epochs across processes lives in [`flock_core::epoch`]; these are
//! the in-process complements: what to do when the newest epoch exits, and what the
//! start decision is given after all of this supervisor's epochs died.

use flock_core::epoch::{EpochRecord, WriterId};

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
/// (epoch, base id, our writer id; the heartbeat is ignored). `on_disk` is the state file's record read after the exit;
/// `failures` counts consecutive unexpected deaths *including this one*.
///
/// The exit is expected exactly when a fresh record of a higher epoch on our base id,
/// written by another supervisor, is on disk: Envoy's hot restart ends the parent,
/// and the successor records its epoch before the parent-shutdown time ends (it
/// writes within a heartbeat of LIVE, the parent lives `parent-shutdown-time` after
/// that).
pub fn after_newest_exit(
    on_disk: Option<&EpochRecord>,
    ours: &EpochRecord,
    failures: u32,
    max_restarts: u32,
    now_unix_ms: u64,
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
    if failures > max_restarts {
        AfterExit::GiveUp { failures }
    } else {
        AfterExit::Restart {
            attempt: failures,
            max: max_restarts,
        }
    }
}

/// The record to pass to [`flock_core::epoch::start_epoch`] when **none** of this
/// supervisor's epochs is running: our own record describes Envoys we have reaped,
/// so it is no predecessor (`None`: cold start on our base id unless another Envoy
/// answers); anyone else's record is taken as it is.
pub fn start_input<'a>(on_disk: Option<&'a EpochRecord>, me: &WriterId) -> Option<&'a EpochRecord> {
    on_disk.filter(|r| r.writer != *me)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;
    fn rec(epoch: u32, base_id: u32, writer: &str, age: u64) -> EpochRecord {
        EpochRecord::new(epoch, base_id, NOW - age, WriterId::new(writer).unwrap())
    }
    fn me() -> WriterId {
        WriterId::new("me").unwrap()
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
    fn our_own_record_is_no_predecessor_once_our_envoys_are_gone() {
        let mine = rec(3, 7, "me", 0);
        let theirs = rec(3, 7, "other", 0);
        assert_eq!(start_input(Some(&mine), &me()), None);
        assert_eq!(start_input(Some(&theirs), &me()), Some(&theirs));
        assert_eq!(start_input(None, &me()), None);
    }
}
