//! Which epoch and base id a newly started supervisor uses (Strategy B).

use std::fmt;

use super::record::{EpochRecord, Freshness};
use crate::time::UnixMs;

/// How long a [`StartDecision::Wait`] waits at most before the caller re-reads the
/// state file and re-probes the admin endpoint, in milliseconds.
///
/// Short, because the common wait (a predecessor finishing its initialization) ends
/// within a second or two, and a probe of a local admin endpoint is cheap.
pub const START_RETRY_MS: u64 = 500;

/// What the admin endpoint (`GET /server_info`) said when the newcomer probed it.
///
/// Both the epoch and the base id come from the answer's `command_line_options`
/// (`restart_epoch`, `base_id`): an epoch number alone does not say which hot-restart
/// chain answered (after a cold start on a new base id, two chains can be at the
/// same epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PredecessorStatus {
    /// `state == LIVE`.
    Live {
        /// The reported `restart_epoch`.
        epoch: u32,
        /// The reported `base_id`.
        base_id: u32,
    },
    /// The endpoint answered with any other state (PRE_INITIALIZING, INITIALIZING,
    /// DRAINING).
    NotLive {
        /// The reported `restart_epoch`.
        epoch: u32,
        /// The reported `base_id`.
        base_id: u32,
    },
    /// Nothing answered (connection refused, timeout, garbage).
    Unreachable,
}

impl PredecessorStatus {
    fn is_reachable(self) -> bool {
        !matches!(self, Self::Unreachable)
    }
}

impl fmt::Display for PredecessorStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Live { epoch, base_id } => write!(f, "epoch {epoch} of base id {base_id} LIVE"),
            Self::NotLive { epoch, base_id } => {
                write!(f, "epoch {epoch} of base id {base_id} not LIVE")
            }
            Self::Unreachable => f.write_str("unreachable"),
        }
    }
}

/// Which base id to start Envoy with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BaseId {
    /// Hot restart: exactly the predecessor's base id (Envoy requires it).
    Inherit(u32),
    /// Cold start on the stale record's base id: nothing answers on the admin
    /// endpoint, so no Envoy holds it any more. Remove a leftover
    /// `/dev/shm/envoy_shared_memory_<id>` first.
    Reuse(u32),
    /// Cold start with no record: the supervisor's configured base id.
    Configured,
    /// Cold start on any base id but this one: an Envoy still answers on the admin
    /// endpoint and may hold this base id's shared memory.
    AvoidInUse(u32),
}

impl BaseId {
    /// The concrete base id given the supervisor's `configured` one: the configured id
    /// unless it must be avoided, then the next one (wrapping).
    pub fn resolve(self, configured: u32) -> u32 {
        match self {
            Self::Inherit(id) | Self::Reuse(id) => id,
            Self::Configured => configured,
            Self::AvoidInUse(avoid) if avoid == configured => configured.wrapping_add(1),
            Self::AvoidInUse(_) => configured,
        }
    }
}

impl fmt::Display for BaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Inherit(id) => write!(f, "inherited base id {id}"),
            Self::Reuse(id) => write!(f, "reused base id {id}"),
            Self::Configured => f.write_str("the configured base id"),
            Self::AvoidInUse(id) => write!(f, "a base id other than {id}"),
        }
    }
}

/// What a newly started supervisor does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartDecision {
    /// Start Envoy with `--restart-epoch epoch` and the given base id.
    Start {
        /// The restart epoch.
        epoch: u32,
        /// The base id.
        base_id: BaseId,
        /// Why, for the log.
        reason: StartReason,
    },
    /// Start nothing yet; re-read the record and re-probe at `until_ms` (unix ms).
    ///
    /// A wait on a fresh record ends by itself: the record's owner heartbeats only
    /// while its epoch is LIVE, so either the predecessor becomes LIVE or the record
    /// goes stale within `heartbeat_max_age_ms`. A wait with no record
    /// ([`WaitReason::UnrecordedEnvoy`]) can last as long as an Envoy answers without
    /// a record; the caller bounds it and exits non-zero with the reason.
    Wait {
        /// When to decide again: at most [`START_RETRY_MS`] away, never after the
        /// record goes stale, and after `now_unix_ms` (unless that is `u64::MAX`).
        until_ms: UnixMs,
        /// Why, for the log.
        reason: WaitReason,
    },
    /// Cannot start while the record stays fresh; the caller exits with the reason.
    Refuse {
        /// Why, for the log.
        reason: RefuseReason,
    },
}

impl fmt::Display for StartDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Start {
                epoch,
                base_id,
                reason,
            } => write!(f, "start epoch {epoch} on {base_id}: {reason}"),
            Self::Wait { until_ms, reason } => {
                write!(f, "wait until {} ms: {reason}", until_ms.as_millis())
            }
            Self::Refuse { reason } => write!(f, "refuse to start: {reason}"),
        }
    }
}

/// Why [`StartDecision::Start`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartReason {
    /// The record is fresh and the admin endpoint reports its epoch and base id LIVE.
    HotRestart {
        /// The predecessor's record.
        from: EpochRecord,
        /// Its heartbeat.
        heartbeat: Freshness,
    },
    /// No record, and nothing answers on the admin endpoint.
    NoRecord,
    /// The record is stale and nothing answers on the admin endpoint.
    StaleRecordNothingAnswers {
        /// The stale record.
        record: EpochRecord,
        /// Its heartbeat.
        heartbeat: Freshness,
    },
    /// The record is stale but an Envoy still answers on the admin endpoint.
    StaleRecordEnvoyAnswers {
        /// The stale record.
        record: EpochRecord,
        /// Its heartbeat.
        heartbeat: Freshness,
        /// What answered.
        predecessor: PredecessorStatus,
    },
}

impl fmt::Display for StartReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HotRestart { from, heartbeat } => write!(
                f,
                "hot restart from {from}: its {heartbeat} and the admin endpoint reports it LIVE"
            ),
            Self::NoRecord => f.write_str(
                "no state-file record and no Envoy answers on the admin endpoint: cold start",
            ),
            Self::StaleRecordNothingAnswers { record, heartbeat } => write!(
                f,
                "{record} has a {heartbeat} and no Envoy answers on the admin endpoint: \
                 cold start on its base id, which nothing holds any more"
            ),
            Self::StaleRecordEnvoyAnswers {
                record,
                heartbeat,
                predecessor,
            } => write!(
                f,
                "{record} has a {heartbeat} but an Envoy still answers on the admin endpoint \
                 ({predecessor}): it may hold base id {}, so cold start on another one",
                record.base_id
            ),
        }
    }
}

/// Why [`StartDecision::Wait`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitReason {
    /// The record is fresh but the admin endpoint reports an Envoy that is not LIVE:
    /// forking now fails ("previous envoy process is still initializing") and a cold
    /// start would collide with the predecessor's base id.
    PredecessorNotLive {
        /// The fresh record.
        record: EpochRecord,
        /// What the admin endpoint reported.
        predecessor: PredecessorStatus,
    },
    /// The record is fresh, but the admin endpoint reports a different epoch or base
    /// id LIVE: the record is behind (its new owner writes within one heartbeat) or
    /// describes another chain; either way `record.epoch + 1` may already be taken.
    EpochMismatch {
        /// The fresh record.
        record: EpochRecord,
        /// What the admin endpoint reported.
        predecessor: PredecessorStatus,
    },
    /// The record is fresh but the admin endpoint does not answer: the predecessor may
    /// be alive (a slow probe), so neither fork nor cold start on its base id.
    PredecessorUnreachable {
        /// The fresh record.
        record: EpochRecord,
        /// Its heartbeat.
        heartbeat: Freshness,
    },
    /// No record, but an Envoy answers on the admin endpoint: its supervisor writes the
    /// record once it is LIVE (or it was started outside flock).
    UnrecordedEnvoy {
        /// What answered.
        predecessor: PredecessorStatus,
    },
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PredecessorNotLive {
                record,
                predecessor,
            } => write!(
                f,
                "{record} is fresh but the admin endpoint reports {predecessor}: forking now \
                 would fail, a cold start would collide"
            ),
            Self::EpochMismatch {
                record,
                predecessor,
            } => write!(
                f,
                "{record} is fresh but the admin endpoint reports {predecessor}: waiting for \
                 the record to catch up"
            ),
            Self::PredecessorUnreachable { record, heartbeat } => write!(
                f,
                "{record} has a {heartbeat} but the admin endpoint does not answer: \
                 waiting for an answer or for the record to go stale"
            ),
            Self::UnrecordedEnvoy { predecessor } => write!(
                f,
                "no state-file record but an Envoy answers on the admin endpoint \
                 ({predecessor}): waiting for its supervisor to record it"
            ),
        }
    }
}

/// Why [`StartDecision::Refuse`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefuseReason {
    /// The LIVE predecessor is at epoch `u32::MAX`: there is no next epoch.
    EpochExhausted {
        /// The fresh record.
        record: EpochRecord,
    },
}

impl fmt::Display for RefuseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EpochExhausted { record } => write!(
                f,
                "{record} is LIVE at the last possible epoch: stop its supervisor so the \
                 record goes stale, and the next start is a cold epoch 0"
            ),
        }
    }
}

/// Decides the epoch and base id of a newly started supervisor (Strategy B).
///
/// * `record`: the state file's record, `None` if there is no file **or it does not
///   parse** (log the parse error; `None` is the conservative reading, see below).
/// * `now_unix_ms`: the wall clock; `heartbeat_max_age_ms`: the freshness limit.
/// * `predecessor`: what the admin endpoint said, probed after reading the record.
///
/// | record             | admin endpoint         | decision                                 |
/// |--------------------|------------------------|------------------------------------------|
/// | fresh, `(e, b)`    | `Live { e, b }`        | start `e + 1`, [`BaseId::Inherit`]`(b)`  |
/// | fresh, `e = MAX`   | `Live { e, b }`        | [`StartDecision::Refuse`]                |
/// | fresh, `(e, b)`    | any other `Live`       | wait ([`WaitReason::EpochMismatch`])     |
/// | fresh              | `NotLive`              | wait (R7 across processes)               |
/// | fresh              | `Unreachable`          | wait                                     |
/// | stale              | `Unreachable`          | start 0, [`BaseId::Reuse`]               |
/// | stale              | `Live` / `NotLive`     | start 0, [`BaseId::AvoidInUse`]          |
/// | none               | `Unreachable`          | start 0, [`BaseId::Configured`]          |
/// | none               | `Live` / `NotLive`     | wait ([`WaitReason::UnrecordedEnvoy`])   |
///
/// A hot restart is only ever `record.epoch + 1` with the admin endpoint confirming
/// `record.epoch` of `record.base_id` LIVE right now, so the newcomer never picks the
/// epoch of a LIVE Envoy. Known limit: while a hot-restart child initializes, the admin endpoint
/// still answers for its LIVE parent, so two newcomers racing (a third pod on the
/// node) can both pick the child's epoch; Envoy's hot-restart socket then makes the
/// second one exit, and its supervisor restarts.
pub fn start_epoch(
    record: Option<&EpochRecord>,
    now_unix_ms: UnixMs,
    heartbeat_max_age_ms: u64,
    predecessor: PredecessorStatus,
) -> StartDecision {
    let retry_at = now_unix_ms.plus(START_RETRY_MS);
    let Some(record) = record else {
        return if predecessor.is_reachable() {
            StartDecision::Wait {
                until_ms: retry_at,
                reason: WaitReason::UnrecordedEnvoy { predecessor },
            }
        } else {
            StartDecision::Start {
                epoch: 0,
                base_id: BaseId::Configured,
                reason: StartReason::NoRecord,
            }
        };
    };
    let record = record.clone();
    let heartbeat = record.freshness(now_unix_ms, heartbeat_max_age_ms);
    if !heartbeat.is_fresh() {
        return if predecessor.is_reachable() {
            StartDecision::Start {
                epoch: 0,
                base_id: BaseId::AvoidInUse(record.base_id),
                reason: StartReason::StaleRecordEnvoyAnswers {
                    record,
                    heartbeat,
                    predecessor,
                },
            }
        } else {
            StartDecision::Start {
                epoch: 0,
                base_id: BaseId::Reuse(record.base_id),
                reason: StartReason::StaleRecordNothingAnswers { record, heartbeat },
            }
        };
    }
    let until_ms = retry_at
        .min(record.stale_at(heartbeat_max_age_ms))
        .max(now_unix_ms.plus(1));
    match predecessor {
        PredecessorStatus::Live { epoch, base_id }
            if (epoch, base_id) == (record.epoch, record.base_id) =>
        {
            match record.epoch.checked_add(1) {
                Some(next) => StartDecision::Start {
                    epoch: next,
                    base_id: BaseId::Inherit(record.base_id),
                    reason: StartReason::HotRestart {
                        from: record,
                        heartbeat,
                    },
                },
                None => StartDecision::Refuse {
                    reason: RefuseReason::EpochExhausted { record },
                },
            }
        }
        PredecessorStatus::Live { .. } => StartDecision::Wait {
            until_ms,
            reason: WaitReason::EpochMismatch {
                record,
                predecessor,
            },
        },
        PredecessorStatus::NotLive { .. } => StartDecision::Wait {
            until_ms,
            reason: WaitReason::PredecessorNotLive {
                record,
                predecessor,
            },
        },
        PredecessorStatus::Unreachable => StartDecision::Wait {
            until_ms,
            reason: WaitReason::PredecessorUnreachable { record, heartbeat },
        },
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::epoch::WriterId;

    const MAX_AGE: u64 = 15_000;
    const NOW: UnixMs = UnixMs(1_764_400_000_000);

    fn rec(epoch: u32, heartbeat_age: u64) -> EpochRecord {
        EpochRecord::new(
            epoch,
            7,
            UnixMs(NOW.as_millis() - heartbeat_age),
            WriterId::new("node-a").unwrap(),
        )
    }

    fn live(epoch: u32) -> PredecessorStatus {
        PredecessorStatus::Live { epoch, base_id: 7 }
    }

    fn not_live(epoch: u32) -> PredecessorStatus {
        PredecessorStatus::NotLive { epoch, base_id: 7 }
    }

    #[test]
    fn fresh_record_and_live_predecessor_hot_restarts_on_its_base_id() {
        let d = start_epoch(Some(&rec(3, 1_000)), NOW, MAX_AGE, live(3));
        let StartDecision::Start {
            epoch: 4,
            base_id: BaseId::Inherit(7),
            reason: StartReason::HotRestart { .. },
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(
            d.to_string(),
            "start epoch 4 on inherited base id 7: hot restart from epoch 3 (base id 7, \
             writer node-a, heartbeat at 1764399999000 ms): its heartbeat 1000 ms old \
             (fresh; limit 15000 ms) and the admin endpoint reports it LIVE"
        );
    }

    #[test]
    fn heartbeat_exactly_at_the_limit_is_fresh() {
        let d = start_epoch(Some(&rec(3, MAX_AGE)), NOW, MAX_AGE, live(3));
        assert!(matches!(d, StartDecision::Start { epoch: 4, .. }), "{d}");
        let d = start_epoch(Some(&rec(3, MAX_AGE + 1)), NOW, MAX_AGE, live(3));
        assert!(matches!(d, StartDecision::Start { epoch: 0, .. }), "{d}");
    }

    #[test]
    fn fresh_record_with_initializing_predecessor_waits_instead_of_forking() {
        let d = start_epoch(Some(&rec(3, 1_000)), NOW, MAX_AGE, not_live(3));
        assert_eq!(
            d,
            StartDecision::Wait {
                until_ms: NOW.plus(START_RETRY_MS),
                reason: WaitReason::PredecessorNotLive {
                    record: rec(3, 1_000),
                    predecessor: not_live(3)
                }
            }
        );
    }

    #[test]
    fn fresh_record_with_initializing_successor_waits() {
        // Another newcomer already started epoch 4 and it is initializing.
        let d = start_epoch(Some(&rec(3, 1_000)), NOW, MAX_AGE, not_live(4));
        assert!(matches!(d, StartDecision::Wait { .. }), "{d}");
    }

    #[test]
    fn fresh_record_with_a_different_live_epoch_waits() {
        for other in [2, 4, 0, u32::MAX] {
            let d = start_epoch(Some(&rec(3, 1_000)), NOW, MAX_AGE, live(other));
            let StartDecision::Wait {
                reason: WaitReason::EpochMismatch { predecessor, .. },
                ..
            } = d
            else {
                panic!("{d:?}")
            };
            assert_eq!(predecessor, live(other));
        }
    }

    #[test]
    fn fresh_record_with_its_epoch_live_on_another_base_id_waits() {
        // Another hot-restart chain (a cold start beside an orphan) is at the same
        // epoch: forking `record.epoch + 1` on the record's base id could collide.
        let other_chain = PredecessorStatus::Live {
            epoch: 3,
            base_id: 8,
        };
        let d = start_epoch(Some(&rec(3, 1_000)), NOW, MAX_AGE, other_chain);
        assert!(
            matches!(
                d,
                StartDecision::Wait {
                    reason: WaitReason::EpochMismatch { .. },
                    ..
                }
            ),
            "{d}"
        );
    }

    #[test]
    fn fresh_record_with_unreachable_admin_waits() {
        let d = start_epoch(
            Some(&rec(3, 1_000)),
            NOW,
            MAX_AGE,
            PredecessorStatus::Unreachable,
        );
        assert!(
            matches!(
                d,
                StartDecision::Wait {
                    reason: WaitReason::PredecessorUnreachable { .. },
                    ..
                }
            ),
            "{d}"
        );
    }

    #[test]
    fn wait_never_outlasts_the_record_freshness() {
        // The record goes stale 100 ms from now: re-decide then, not after 500 ms.
        let age = MAX_AGE - 100;
        let d = start_epoch(Some(&rec(3, age)), NOW, MAX_AGE, not_live(3));
        let StartDecision::Wait { until_ms, .. } = d else {
            panic!("{d:?}")
        };
        assert_eq!(until_ms, NOW.plus(101));
        assert!(!rec(3, age).is_fresh(until_ms, MAX_AGE));
    }

    #[test]
    fn no_record_and_nothing_answering_cold_starts_on_configured_base_id() {
        let d = start_epoch(None, NOW, MAX_AGE, PredecessorStatus::Unreachable);
        assert_eq!(
            d,
            StartDecision::Start {
                epoch: 0,
                base_id: BaseId::Configured,
                reason: StartReason::NoRecord
            }
        );
    }

    #[test]
    fn no_record_but_an_envoy_answering_waits() {
        for p in [live(0), not_live(0)] {
            let d = start_epoch(None, NOW, MAX_AGE, p);
            assert_eq!(
                d,
                StartDecision::Wait {
                    until_ms: NOW.plus(START_RETRY_MS),
                    reason: WaitReason::UnrecordedEnvoy { predecessor: p }
                }
            );
        }
    }

    #[test]
    fn stale_record_and_nothing_answering_reuses_its_base_id() {
        let d = start_epoch(
            Some(&rec(3, MAX_AGE * 10)),
            NOW,
            MAX_AGE,
            PredecessorStatus::Unreachable,
        );
        assert!(
            matches!(
                d,
                StartDecision::Start {
                    epoch: 0,
                    base_id: BaseId::Reuse(7),
                    reason: StartReason::StaleRecordNothingAnswers { .. }
                }
            ),
            "{d}"
        );
    }

    #[test]
    fn stale_record_with_an_envoy_answering_avoids_its_base_id() {
        for p in [live(3), not_live(3), live(9)] {
            let d = start_epoch(Some(&rec(3, MAX_AGE + 1)), NOW, MAX_AGE, p);
            assert!(
                matches!(
                    d,
                    StartDecision::Start {
                        epoch: 0,
                        base_id: BaseId::AvoidInUse(7),
                        reason: StartReason::StaleRecordEnvoyAnswers { .. }
                    }
                ),
                "{d}"
            );
        }
    }

    #[test]
    fn live_predecessor_at_last_epoch_is_refused_not_wrapped() {
        let d = start_epoch(Some(&rec(u32::MAX, 0)), NOW, MAX_AGE, live(u32::MAX));
        assert!(
            matches!(
                d,
                StartDecision::Refuse {
                    reason: RefuseReason::EpochExhausted { .. }
                }
            ),
            "{d}"
        );
        assert!(d.to_string().contains("last possible epoch"));
    }

    #[test]
    fn heartbeat_far_in_the_future_is_stale() {
        let mut r = rec(3, 0);
        r.heartbeat_unix_ms = NOW.plus(MAX_AGE + 1);
        let d = start_epoch(Some(&r), NOW, MAX_AGE, PredecessorStatus::Unreachable);
        assert!(matches!(d, StartDecision::Start { epoch: 0, .. }), "{d}");
        r.heartbeat_unix_ms = NOW.plus(MAX_AGE);
        let d = start_epoch(Some(&r), NOW, MAX_AGE, PredecessorStatus::Unreachable);
        assert!(matches!(d, StartDecision::Wait { .. }), "{d}");
    }

    #[test]
    fn extreme_clock_values_do_not_overflow() {
        let mut r = rec(3, 0);
        r.heartbeat_unix_ms = UnixMs(u64::MAX);
        let d = start_epoch(
            Some(&r),
            UnixMs(u64::MAX),
            u64::MAX,
            PredecessorStatus::Unreachable,
        );
        assert_eq!(
            d,
            StartDecision::Wait {
                until_ms: UnixMs(u64::MAX),
                reason: WaitReason::PredecessorUnreachable {
                    record: r.clone(),
                    heartbeat: r.freshness(UnixMs(u64::MAX), u64::MAX)
                }
            }
        );
        r.heartbeat_unix_ms = UnixMs::ZERO;
        assert!(matches!(
            start_epoch(Some(&r), UnixMs(u64::MAX), 0, live(3)),
            StartDecision::Start { epoch: 0, .. }
        ));
    }

    #[test]
    fn base_id_resolution() {
        assert_eq!(BaseId::Inherit(7).resolve(1), 7);
        assert_eq!(BaseId::Reuse(7).resolve(1), 7);
        assert_eq!(BaseId::Configured.resolve(1), 1);
        assert_eq!(BaseId::AvoidInUse(7).resolve(1), 1);
        assert_eq!(BaseId::AvoidInUse(1).resolve(1), 2);
        assert_eq!(BaseId::AvoidInUse(u32::MAX).resolve(u32::MAX), 0);
    }

    #[test]
    fn every_reason_reads_as_a_sentence() {
        let decisions = [
            start_epoch(None, NOW, MAX_AGE, PredecessorStatus::Unreachable),
            start_epoch(None, NOW, MAX_AGE, live(1)),
            start_epoch(
                Some(&rec(3, 0)),
                NOW,
                MAX_AGE,
                PredecessorStatus::Unreachable,
            ),
            start_epoch(Some(&rec(3, 0)), NOW, MAX_AGE, live(4)),
            start_epoch(Some(&rec(3, MAX_AGE + 1)), NOW, MAX_AGE, live(4)),
            start_epoch(
                Some(&rec(3, MAX_AGE + 1)),
                NOW,
                MAX_AGE,
                PredecessorStatus::Unreachable,
            ),
        ];
        let texts: Vec<String> = decisions.iter().map(ToString::to_string).collect();
        assert_eq!(
            texts,
            [
                "start epoch 0 on the configured base id: no state-file record and no Envoy \
                 answers on the admin endpoint: cold start",
                "wait until 1764400000500 ms: no state-file record but an Envoy answers on \
                 the admin endpoint (epoch 1 of base id 7 LIVE): waiting for its supervisor to record it",
                "wait until 1764400000500 ms: epoch 3 (base id 7, writer node-a, heartbeat at \
                 1764400000000 ms) has a heartbeat 0 ms old (fresh; limit 15000 ms) but the \
                 admin endpoint does not answer: waiting for an answer or for the record to \
                 go stale",
                "wait until 1764400000500 ms: epoch 3 (base id 7, writer node-a, heartbeat at \
                 1764400000000 ms) is fresh but the admin endpoint reports epoch 4 of base id 7 \
                 LIVE: \
                 waiting for the record to catch up",
                "start epoch 0 on a base id other than 7: epoch 3 (base id 7, writer node-a, \
                 heartbeat at 1764399984999 ms) has a heartbeat 15001 ms old (stale; limit \
                 15000 ms) but an Envoy still answers on the admin endpoint (epoch 4 of base id 7 LIVE): \
                 it may hold base id 7, so cold start on another one",
                "start epoch 0 on reused base id 7: epoch 3 (base id 7, writer node-a, \
                 heartbeat at 1764399984999 ms) has a heartbeat 15001 ms old (stale; limit \
                 15000 ms) and no Envoy answers on the admin endpoint: cold start on its base \
                 id, which nothing holds any more",
            ]
        );
    }
}
