//! The state-file write rule (race R8, docs/races.md).

use std::fmt;

use super::record::{EpochRecord, Freshness};
use crate::time::UnixMs;

/// What a supervisor does with the state file at one heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteDecision {
    /// Write `record` (the caller's record with the heartbeat set to `now_unix_ms`).
    Write {
        /// The record to write.
        record: EpochRecord,
        /// Why, for the log.
        reason: WriteReason,
    },
    /// Write nothing now; decide again at the next heartbeat.
    Skip {
        /// Why, for the log.
        reason: SkipReason,
    },
    /// Write nothing, now or later: another supervisor owns the file. The caller has
    /// been superseded (its epoch is draining, or lost a race) and stops heartbeating.
    Yield {
        /// The record that owns the file.
        owner: EpochRecord,
        /// Why, for the log.
        reason: YieldReason,
    },
}

impl fmt::Display for WriteDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Write { record, reason } => write!(f, "write {record}: {reason}"),
            Self::Skip { reason } => write!(f, "skip the write: {reason}"),
            Self::Yield { owner, reason } => {
                write!(f, "yield the state file to {owner}: {reason}")
            }
        }
    }
}

/// Why [`WriteDecision::Write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteReason {
    /// There is no record (or it did not parse).
    NoRecord,
    /// The record is ours (same epoch, same writer): refresh its heartbeat.
    Heartbeat,
    /// The record has a lower epoch: ours supersedes it, fresh or not.
    SupersedeLower {
        /// The epoch on disk.
        on_disk_epoch: u32,
    },
    /// The record has a higher epoch, or the same epoch from another writer, but it is
    /// stale: its owner has not confirmed it LIVE for longer than the limit, while we
    /// just did, so ours is the better description of the node.
    TakeOverStale {
        /// The stale record.
        on_disk: EpochRecord,
        /// Its heartbeat.
        heartbeat: Freshness,
    },
}

impl fmt::Display for WriteReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoRecord => f.write_str("no record on disk"),
            Self::Heartbeat => f.write_str("heartbeat of our own record"),
            Self::SupersedeLower { on_disk_epoch } => {
                write!(f, "supersedes the record of epoch {on_disk_epoch}")
            }
            Self::TakeOverStale { on_disk, heartbeat } => {
                write!(f, "takes over {on_disk}, whose {heartbeat}")
            }
        }
    }
}

/// Why [`WriteDecision::Skip`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Our epoch is not LIVE: recording it would make a newcomer fork from an epoch
    /// that cannot hand over yet (epoch cascades).
    NotLive {
        /// Our epoch.
        epoch: u32,
    },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotLive { epoch } => write!(f, "epoch {epoch} is not LIVE"),
        }
    }
}

/// Why [`WriteDecision::Yield`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum YieldReason {
    /// A fresh record with a higher epoch: a successor is LIVE and owns the file.
    HigherEpoch {
        /// Its heartbeat.
        heartbeat: Freshness,
    },
    /// A fresh record at our epoch from another writer: it recorded this epoch first.
    SameEpochOtherWriter {
        /// Its heartbeat.
        heartbeat: Freshness,
    },
}

impl fmt::Display for YieldReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HigherEpoch { heartbeat } => {
                write!(f, "a higher epoch with a {heartbeat} owns the file")
            }
            Self::SameEpochOtherWriter { heartbeat } => write!(
                f,
                "another supervisor recorded our epoch first; its {heartbeat}"
            ),
        }
    }
}

/// Decides whether a supervisor writes its record `mine` over `on_disk`.
///
/// **The caller performs the whole read-modify-write under an exclusive lock** (e.g.
/// `flock(LOCK_EX)` on a lock file next to the state file, held from reading
/// `on_disk` until the new record is renamed into place). Without the lock two
/// supervisors can both read, both decide to write, and the later write regresses the
/// file: the fix of race R8 is this function *and* the lock.
///
/// * `on_disk`: the current record; `None` if there is none or it does not parse
///   (overwriting an unparsable file is how a corrupt one is repaired; during a
///   downgrade across format versions it can regress the file once, until the newer
///   writer's next heartbeat).
/// * `mine`: our record; its `heartbeat_unix_ms` is ignored (the written record gets
///   `now_unix_ms`).
/// * `my_epoch_live`: the admin endpoint reported our epoch LIVE (probed at most one
///   heartbeat ago; the rule stays safe if the probe is out of date).
///
/// The rule, by epoch first and writer second:
///
/// 1. A **fresh** record with a **higher** epoch, or with **our** epoch from
///    **another** writer, owns the file: [`WriteDecision::Yield`]. The file never
///    regresses to a lower epoch while the higher one is fresh, however out of date
///    `my_epoch_live` is (a draining parent's last probe).
/// 2. Otherwise, if our epoch is not LIVE: [`WriteDecision::Skip`]. Only LIVE epochs
///    are recorded.
/// 3. Otherwise [`WriteDecision::Write`]: no record, our own record (heartbeat), a
///    lower epoch, or a **stale** higher/same epoch. Overwriting a stale higher record
///    is safe: a newcomer reading it would already ignore it (stale means cold start),
///    its owner heartbeats only while LIVE and has not for longer than the limit, and
///    we were LIVE at our last probe, so ours is the better description of the node.
///    If that owner is in fact alive, its next heartbeat supersedes ours (rule 3,
///    lower epoch).
pub fn write_decision(
    on_disk: Option<&EpochRecord>,
    mine: &EpochRecord,
    my_epoch_live: bool,
    now_unix_ms: UnixMs,
    heartbeat_max_age_ms: u64,
) -> WriteDecision {
    let verdict = if crate::reintroduced!("r8") {
        // Re-introduces R8 so the property test can show it catches it; never enabled
        // in builds: a writer that writes its own epoch whenever it is live,
        // without comparing with the record on disk.
        Verdict::Write(WriteReason::Heartbeat)
    } else {
        compare(on_disk, mine, now_unix_ms, heartbeat_max_age_ms)
    };
    match verdict {
        Verdict::Yield(owner, reason) => WriteDecision::Yield { owner, reason },
        Verdict::Write(_) if !my_epoch_live => WriteDecision::Skip {
            reason: SkipReason::NotLive { epoch: mine.epoch },
        },
        Verdict::Write(reason) => WriteDecision::Write {
            record: EpochRecord {
                heartbeat_unix_ms: now_unix_ms,
                ..mine.clone()
            },
            reason,
        },
    }
}

enum Verdict {
    Write(WriteReason),
    Yield(EpochRecord, YieldReason),
}

fn compare(
    on_disk: Option<&EpochRecord>,
    mine: &EpochRecord,
    now_unix_ms: UnixMs,
    heartbeat_max_age_ms: u64,
) -> Verdict {
    let Some(on_disk) = on_disk else {
        return Verdict::Write(WriteReason::NoRecord);
    };
    let heartbeat = on_disk.freshness(now_unix_ms, heartbeat_max_age_ms);
    if on_disk.epoch < mine.epoch {
        return Verdict::Write(WriteReason::SupersedeLower {
            on_disk_epoch: on_disk.epoch,
        });
    }
    if on_disk.epoch == mine.epoch && on_disk.writer == mine.writer {
        return Verdict::Write(WriteReason::Heartbeat);
    }
    // A higher epoch, or our epoch from another writer.
    if !heartbeat.is_fresh() {
        return Verdict::Write(WriteReason::TakeOverStale {
            on_disk: on_disk.clone(),
            heartbeat,
        });
    }
    let reason = if on_disk.epoch > mine.epoch {
        YieldReason::HigherEpoch { heartbeat }
    } else {
        YieldReason::SameEpochOtherWriter { heartbeat }
    };
    Verdict::Yield(on_disk.clone(), reason)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::epoch::WriterId;

    const MAX_AGE: u64 = 15_000;
    const NOW: UnixMs = UnixMs(1_764_400_000_000);

    fn rec(epoch: u32, writer: &str, heartbeat_age: u64) -> EpochRecord {
        EpochRecord::new(
            epoch,
            7,
            UnixMs(NOW.as_millis() - heartbeat_age),
            WriterId::new(writer).unwrap(),
        )
    }

    fn decide(on_disk: Option<&EpochRecord>, mine: &EpochRecord, live: bool) -> WriteDecision {
        write_decision(on_disk, mine, live, NOW, MAX_AGE)
    }

    #[test]
    fn not_live_epoch_is_never_recorded() {
        let mine = rec(4, "b", 0);
        for on_disk in [None, Some(rec(3, "a", 0)), Some(rec(4, "b", 0))] {
            let d = decide(on_disk.as_ref(), &mine, false);
            assert_eq!(
                d,
                WriteDecision::Skip {
                    reason: SkipReason::NotLive { epoch: 4 }
                }
            );
        }
    }

    #[test]
    fn live_epoch_writes_when_there_is_no_record_with_now_as_heartbeat() {
        let d = decide(None, &rec(0, "a", 99_999), true);
        assert_eq!(
            d,
            WriteDecision::Write {
                record: rec(0, "a", 0),
                reason: WriteReason::NoRecord
            }
        );
    }

    #[test]
    fn same_epoch_same_writer_is_a_heartbeat_even_when_stale() {
        for age in [0, MAX_AGE * 100] {
            let d = decide(Some(&rec(3, "a", age)), &rec(3, "a", 0), true);
            assert!(
                matches!(
                    d,
                    WriteDecision::Write {
                        reason: WriteReason::Heartbeat,
                        ..
                    }
                ),
                "{d}"
            );
        }
    }

    #[test]
    fn lower_epoch_on_disk_is_superseded_even_when_fresh() {
        let d = decide(Some(&rec(3, "a", 0)), &rec(4, "b", 0), true);
        assert!(
            matches!(
                d,
                WriteDecision::Write {
                    reason: WriteReason::SupersedeLower { on_disk_epoch: 3 },
                    ..
                }
            ),
            "{d}"
        );
    }

    #[test]
    fn fresh_higher_epoch_is_never_overwritten_the_writer_yields() {
        // The R8 interleaving: the draining parent (epoch 3) probed LIVE just
        // before its child (epoch 4) took over and wrote; its heartbeat write comes
        // after the child's.
        let child = rec(4, "b", 100);
        for live in [true, false] {
            let d = decide(Some(&child), &rec(3, "a", 0), live);
            assert_eq!(
                d,
                WriteDecision::Yield {
                    owner: child.clone(),
                    reason: YieldReason::HigherEpoch {
                        heartbeat: child.freshness(NOW, MAX_AGE)
                    }
                }
            );
        }
    }

    #[test]
    fn same_writer_never_regresses_its_own_higher_epoch() {
        // Strategy A: one supervisor went from epoch 3 to 4 in place; a late heartbeat
        // of epoch 3 must not overwrite its own epoch-4 record.
        let d = decide(Some(&rec(4, "a", 0)), &rec(3, "a", 0), true);
        assert!(matches!(d, WriteDecision::Yield { .. }), "{d}");
    }

    #[test]
    fn fresh_same_epoch_from_another_writer_yields() {
        let d = decide(Some(&rec(3, "b", 0)), &rec(3, "a", 0), true);
        assert!(
            matches!(
                d,
                WriteDecision::Yield {
                    reason: YieldReason::SameEpochOtherWriter { .. },
                    ..
                }
            ),
            "{d}"
        );
    }

    #[test]
    fn stale_higher_or_same_epoch_is_taken_over_by_a_live_epoch() {
        for on_disk in [rec(9, "b", MAX_AGE + 1), rec(3, "b", MAX_AGE + 1)] {
            let d = decide(Some(&on_disk), &rec(3, "a", 0), true);
            assert!(
                matches!(
                    d,
                    WriteDecision::Write {
                        reason: WriteReason::TakeOverStale { .. },
                        ..
                    }
                ),
                "{d}"
            );
            // ...but not by an epoch that is not LIVE.
            let d = decide(Some(&on_disk), &rec(3, "a", 0), false);
            assert!(matches!(d, WriteDecision::Skip { .. }), "{d}");
        }
    }

    #[test]
    fn higher_epoch_at_exactly_the_limit_is_still_fresh() {
        let d = decide(Some(&rec(4, "b", MAX_AGE)), &rec(3, "a", 0), true);
        assert!(matches!(d, WriteDecision::Yield { .. }), "{d}");
    }

    #[test]
    fn decisions_read_as_sentences() {
        let d = decide(Some(&rec(4, "b", 100)), &rec(3, "a", 0), true);
        assert_eq!(
            d.to_string(),
            "yield the state file to epoch 4 (base id 7, writer b, heartbeat at \
             1764399999900 ms): a higher epoch with a heartbeat 100 ms old (fresh; limit \
             15000 ms) owns the file"
        );
        let d = decide(Some(&rec(3, "a", 0)), &rec(4, "b", 0), false);
        assert_eq!(d.to_string(), "skip the write: epoch 4 is not LIVE");
        let d = decide(Some(&rec(3, "a", 0)), &rec(4, "b", 0), true);
        assert_eq!(
            d.to_string(),
            "write epoch 4 (base id 7, writer b, heartbeat at 1764400000000 ms): \
             supersedes the record of epoch 3"
        );
    }

    #[test]
    fn extreme_clock_values_do_not_overflow() {
        let mut on_disk = rec(4, "b", 0);
        on_disk.heartbeat_unix_ms = UnixMs(u64::MAX);
        let d = write_decision(
            Some(&on_disk),
            &rec(3, "a", 0),
            true,
            UnixMs::ZERO,
            u64::MAX,
        );
        assert!(matches!(d, WriteDecision::Yield { .. }), "{d}");
        let d = write_decision(Some(&on_disk), &rec(3, "a", 0), true, UnixMs::ZERO, 0);
        assert!(matches!(d, WriteDecision::Write { .. }), "{d}");
    }
}
