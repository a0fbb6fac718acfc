//! Envoy hot-restart epochs: the state-file record, the cross-process start decision,
//! the state-file write rule, the restart gate and the supervisor's in-process rules.
//!
//! Envoy hot restart (see docs/hot-restart.md) hands the listen sockets from epoch `N` to
//! epoch `N + 1` of the *same* base id. flock runs it in two ways: in place, inside one
//! supervisor (Strategy A: a config change), and across processes (Strategy B: a surge
//! replica of the DaemonSet reads a small state file, confirms that the epoch recorded
//! there is LIVE and its heartbeat fresh, and starts at `epoch + 1`). This module holds
//! every decision those two paths make; the supervisor binary executes them.
//!
//! Like the rest of flock-core it is pure: no I/O, no clock reads, no randomness. Time
//! is always a parameter and every function returns a decision value.
//!
//! # Time
//!
//! * Heartbeats and `now_unix_ms` are **wall-clock** instants,
//!   [`UnixMs`](crate::time::UnixMs), because several processes compare them through
//!   the state file (the record's field keeps the name `heartbeat_unix_ms`: it is
//!   part of the record format). The [`RestartGate`], [`predecessor_drained`] and the
//!   [`supervisor`] machine take **monotonic** instants, [`MonoMs`](crate::time::MonoMs).
//! * Spans in this module are `u64` milliseconds named `*_ms`
//!   (`heartbeat_max_age_ms`, `debounce_ms`): they are durations, added to instants
//!   with `plus`. Arithmetic saturates; no input makes these functions panic.
//!
//! # The pieces
//!
//! * [`EpochRecord`] — one line of text in the state file,
//!   `flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1764400000123 writer=node-a-7f9c\n`,
//!   with a strict parser ([`EpochRecord::parse`]) and its inverse
//!   ([`EpochRecord::encode`]). The format is specified under "Record format" below.
//! * [`start_epoch`] — which epoch and base id a newly started supervisor uses
//!   (Strategy B), or why it must wait.
//! * [`write_decision`] — whether a supervisor may write its record now. Only a LIVE
//!   epoch is recorded, and a fresh record with a higher epoch is never overwritten
//!   (race R8).
//! * [`RestartGate`] — the trailing debounce in front of an in-place hot restart that
//!   never forks while the current epoch is not LIVE (race R7).
//! * [`after_newest_exit`], [`start_input`], [`predecessor_drained`] — the
//!   supervisor's in-process rules: superseded, restart or give up after its newest
//!   epoch exited (bounded by the retry budget); never its own dead record as the
//!   predecessor of a crash restart; never fork before the predecessor's full drain
//!   time (the gate's second input); [`after_failure`], the one give-up rule.
//! * [`supervisor::Supervisor`] — the supervisor's whole lifecycle as a sans-IO state
//!   machine (events and monotonic time in, actions and the next deadline out): the
//!   live timeout, the failure count's reset, the give-up rule, the shutdown stages,
//!   and when to run each of the decisions above.
//!
//! # Freshness
//!
//! A record is *fresh* when its heartbeat is at most `heartbeat_max_age_ms` away from
//! `now_unix_ms`, in either direction ([`EpochRecord::freshness`]). A heartbeat in the
//! future (the wall clock was stepped back) therefore counts as fresh for at most
//! `heartbeat_max_age_ms` more: a live owner rewrites it on its next heartbeat, and a
//! dead owner's record cannot block handoffs for as long as the clock step. The
//! never-regress guarantee of [`write_decision`] assumes the host's wall clock is not
//! stepped back by more than `heartbeat_max_age_ms`. Owners heartbeat at least every
//! `heartbeat_max_age_ms / 3` so one delayed heartbeat does not make them stale.
//!
//! # Record format (version 1)
//!
//! ```text
//! flock-epoch v1 epoch=<u32> base_id=<u32> heartbeat_unix_ms=<u64> writer=<id>\n
//! ```
//!
//! * Exactly one line of printable ASCII, terminated by exactly one `\n` (a missing
//!   newline means a torn write and is rejected), at most [`MAX_RECORD_BYTES`] bytes.
//! * Tokens are separated by exactly one space. The first is the magic `flock-epoch`,
//!   the second the version `v1`. The four fields follow in exactly this order; each
//!   appears once; unknown fields are rejected (a new field means a new version).
//! * Numbers are plain decimal: digits only, no sign, no leading zero (`0` itself is
//!   fine), within the field's type.
//! * `writer` is the supervisor instance that wrote the record (e.g. its pod name):
//!   1 to 64 characters from `A-Z a-z 0-9 . _ -`, starting with a letter or digit.
//!   It tells two supervisors at the same epoch apart (a cold start beside an orphaned
//!   Envoy, or two newcomers racing) and tells an operator who wrote the file.
//!
//! There is one spelling per record, so `encode(parse(bytes)?) == bytes`. A reader of
//! version `n` refuses any other version; pass `None` to [`start_epoch`] for an
//! unreadable record, which keeps it conservative (it waits while any Envoy answers).
//!
//! # Example
//!
//! ```
//! use flock_core::epoch::{
//!     BaseId, EpochRecord, GateDecision, PredecessorStatus, RestartGate, StartDecision,
//!     WriteDecision, WriterId, start_epoch, write_decision,
//! };
//! use flock_core::{MonoMs, UnixMs};
//!
//! let max_age = 15_000;
//! let now = UnixMs(1_764_400_000_000);
//! // The predecessor (epoch 3, base id 7) heartbeated one second ago and is LIVE.
//! let on_disk = EpochRecord::parse(
//!     b"flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1764399999000 writer=node-a\n",
//! )?;
//! // The admin endpoint reports epoch 3 of base id 7 LIVE.
//! let admin = PredecessorStatus::Live { epoch: 3, base_id: 7 };
//! let decision = start_epoch(Some(&on_disk), now, max_age, admin);
//! let StartDecision::Start { epoch, base_id, .. } = decision else { panic!("{decision}") };
//! assert_eq!((epoch, base_id), (4, BaseId::Inherit(7)));
//!
//! // Epoch 4 is not LIVE yet: nothing is recorded.
//! let mine = EpochRecord::new(4, 7, now, WriterId::new("node-b")?);
//! assert!(matches!(
//!     write_decision(Some(&on_disk), &mine, false, now, max_age),
//!     WriteDecision::Skip { .. }
//! ));
//! // Once it is LIVE, it takes the file over; the old supervisor then yields.
//! let WriteDecision::Write { record, .. } =
//!     write_decision(Some(&on_disk), &mine, true, now.plus(2_000), max_age)
//! else {
//!     panic!()
//! };
//! let old = EpochRecord::new(3, 7, now.plus(2_500), WriterId::new("node-a")?);
//! assert!(matches!(
//!     write_decision(Some(&record), &old, true, now.plus(2_500), max_age),
//!     WriteDecision::Yield { .. }
//! ));
//!
//! // In place (Strategy A): a trigger while the current epoch initializes is deferred.
//! let mut gate = RestartGate::new(500);
//! gate.trigger(MonoMs(0));
//! assert_eq!(gate.poll(MonoMs(500), false), GateDecision::Deferred { until: MonoMs(1_000) });
//! assert_eq!(gate.poll(MonoMs(1_000), true), GateDecision::Fire);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod gate;
mod record;
mod start;
mod supervise;
pub mod supervisor;
mod write_rule;

pub use gate::{GateDecision, RestartGate};
pub use record::{
    EpochRecord, EpochRecordError, FORMAT_VERSION, Freshness, HeartbeatAge, InvalidWriterId, MAGIC,
    MAX_RECORD_BYTES, MAX_WRITER_LEN, WriterId,
};
pub use start::{
    BaseId, PredecessorStatus, RefuseReason, START_RETRY_MS, StartDecision, StartReason,
    WaitReason, start_epoch,
};
pub use supervise::{
    AfterExit, Retry, after_failure, after_newest_exit, may_remove_shared_memory,
    predecessor_drained, start_input,
};
pub use write_rule::{SkipReason, WriteDecision, WriteReason, YieldReason, write_decision};
