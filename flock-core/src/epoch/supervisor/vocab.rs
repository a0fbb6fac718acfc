//! The supervisor machine's vocabulary: its settings ([`Policy`]), what the I/O side
//! reports ([`Event`], [`StartInputs`]), what it is asked to do ([`Action`], with
//! [`SpawnReason`], [`Target`], [`Stop`], [`Why`]), how the supervisor ends ([`Exit`],
//! [`Failure`]) and the shutdown [`Stage`]s.

use std::fmt;

use super::super::record::{EpochRecord, WriterId};
use super::super::start::{PredecessorStatus, StartDecision};
use super::super::write_rule::WriteDecision;
use crate::time::{MonoMs, UnixMs};

/// The supervisor's timings and bounds (see `flock-hotrestart`'s config for their
/// defaults and what each protects).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// This supervisor's id in the state file.
    pub writer: WriterId,
    /// The base id of a cold start with no record.
    pub base_id: u32,
    /// Envoy's drain time: of a replaced epoch, and at shutdown.
    pub drain_time_ms: u64,
    /// Envoy's parent-shutdown time.
    pub parent_shutdown_ms: u64,
    /// The restart gate's debounce.
    pub debounce_ms: u64,
    /// The longest a stream of triggers postpones a restart.
    pub max_debounce_ms: u64,
    /// State-file heartbeat period (each heartbeat probes first).
    pub heartbeat_ms: u64,
    /// Records with an older heartbeat are stale.
    pub heartbeat_max_age_ms: u64,
    /// How often a new epoch is probed until it is LIVE.
    pub live_probe_ms: u64,
    /// A new epoch not LIVE after this long is stopped (counts as a failure).
    pub live_timeout_ms: u64,
    /// An epoch LIVE this long resets the failure count and the backoff.
    pub stable_after_ms: u64,
    /// The longest the start decision may keep waiting.
    pub start_timeout_ms: u64,
    /// At shutdown, the longest to wait for a handoff's new epoch to become LIVE.
    pub handoff_timeout_ms: u64,
    /// At shutdown, after SIGTERM: how long until SIGKILL.
    pub shutdown_margin_ms: u64,
    /// Consecutive failures tolerated.
    pub max_restarts: u32,
    /// Restart backoff: initial and maximum delay.
    pub backoff_ms: (u64, u64),
}

/// Something that happened, fed to [`Supervisor::handle`](super::Supervisor::handle).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A deadline from [`Supervisor::poll_timeout`](super::Supervisor::poll_timeout) was reached (or any wakeup).
    Timer,
    /// A hot restart was requested (SIGHUP, a config change).
    Trigger,
    /// SIGTERM or SIGINT.
    ShutdownSignal,
    /// The answer to [`Action::Probe`].
    Probed(PredecessorStatus),
    /// The answer to [`Action::PrepareStart`]: the config validated, and (when asked)
    /// the start decision's inputs.
    StartPrepared(Result<Option<StartInputs>, String>),
    /// The answer to [`Action::Spawn`] and [`Action::HotRestart`]: epoch `epoch` runs.
    Spawned {
        /// Its epoch.
        epoch: u32,
    },
    /// The answer to [`Action::Spawn`] and [`Action::HotRestart`]: no process (the
    /// config did not validate, or the spawn failed).
    SpawnFailed {
        /// The epoch that did not start.
        epoch: u32,
        /// Why, for the log and the give-up message.
        why: String,
    },
    /// The answer to [`Action::Heartbeat`]: what the locked write decided, or `None`
    /// when the state file could not be updated.
    Heartbeat(Option<WriteDecision>),
    /// The answer to [`Action::Drain`]: whether the admin endpoint answered for our
    /// newest epoch (and was asked to drain).
    DrainStarted {
        /// The admin endpoint answered for a later epoch on our base id: another
        /// supervisor's Envoy took ours over (Strategy B) and shuts it down itself
        /// (Envoy's parent shutdown); ours must not be stopped from under it.
        successor: bool,
        /// Our Envoy is draining.
        ours: bool,
    },
    /// An epoch exited. `on_disk` is the state file's record read after the exit,
    /// `now_unix` the wall-clock time of that read.
    Exited {
        /// The epoch.
        epoch: u32,
        /// How it exited ("exit status 1", "killed by signal 9"), for the messages.
        how: String,
        /// The state file's record.
        on_disk: Option<EpochRecord>,
        /// Wall-clock time.
        now_unix: UnixMs,
    },
}

/// The inputs of the cross-process start decision, read by the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartInputs {
    /// The state file's record (`None`: missing or unreadable).
    pub on_disk: Option<EpochRecord>,
    /// The admin endpoint's answer.
    pub status: PredecessorStatus,
    /// Wall-clock time of the read.
    pub now_unix: UnixMs,
}

/// Why an epoch is started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpawnReason {
    /// The first epoch of this supervisor.
    First,
    /// Replacing an epoch that died.
    Crash,
    /// A hot restart the gate fired.
    Trigger,
}

/// Which processes a signal goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// One epoch.
    Epoch(u32),
    /// The newest epoch still running (shutdown goes newest first: a hot-restart
    /// child that shuts down talks to its parent, and retries for seconds if the
    /// parent is already gone).
    NewestRunning,
    /// Every epoch still running.
    All,
}

/// How hard to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stop {
    /// SIGTERM.
    Term,
    /// SIGKILL.
    Kill,
}

/// How the supervisor ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exit {
    /// SIGTERM/SIGINT: every epoch drained and stopped.
    Terminated,
    /// Another supervisor took the chain over; our epochs were shut down by Envoy.
    Superseded,
}

/// Why the supervisor stops with an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The newest epoch kept dying (or kept failing to start).
    GaveUp(String),
    /// The start decision refused, or waited too long.
    CannotStart(String),
    /// The first config failed validation.
    InvalidConfig(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GaveUp(m) | Self::CannotStart(m) | Self::InvalidConfig(m) => f.write_str(m),
        }
    }
}

/// Something the caller does; see each variant for the answer it feeds back.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Ask the admin endpoint which epoch is LIVE; answer [`Event::Probed`].
    Probe,
    /// Validate the config; with `inputs`, read the state file, probe and read the
    /// wall clock too. Answer [`Event::StartPrepared`].
    PrepareStart {
        /// Read the start decision's inputs.
        inputs: bool,
    },
    /// Start epoch `epoch` on `base_id`; answer [`Event::Spawned`] or
    /// [`Event::SpawnFailed`].
    Spawn {
        /// The epoch.
        epoch: u32,
        /// The base id.
        base_id: u32,
        /// Why (metrics, log).
        reason: SpawnReason,
    },
    /// Validate the config, then start epoch `epoch` (a hot restart from `from`); a
    /// config that does not validate starts nothing and the old epoch keeps serving.
    /// Answer [`Event::Spawned`] or [`Event::SpawnFailed`].
    HotRestart {
        /// The epoch serving now.
        from: u32,
        /// The new epoch.
        epoch: u32,
        /// The base id.
        base_id: u32,
    },
    /// Update the state file under its lock with
    /// [`write_decision`](super::super::write_decision) on this record; answer
    /// [`Event::Heartbeat`].
    Heartbeat {
        /// Our newest epoch.
        epoch: u32,
        /// Its base id.
        base_id: u32,
        /// Whether it is LIVE.
        live: bool,
    },
    /// Drain through the admin endpoint if it answers for `epoch` of `base_id`; answer
    /// [`Event::DrainStarted`].
    Drain {
        /// Our newest epoch.
        epoch: u32,
        /// Its base id.
        base_id: u32,
    },
    /// Signal processes.
    Signal {
        /// Which.
        target: Target,
        /// How.
        stop: Stop,
        /// Why, for the log.
        why: Why,
    },
    /// The ready file and metric: `Some(epoch)` while the newest epoch is LIVE.
    Ready {
        /// The LIVE epoch.
        epoch: Option<u32>,
        /// How long it took from start to LIVE, when it just became LIVE.
        took_ms: Option<u64>,
    },
    /// A restart fired by the gate was deferred (metrics, log).
    Deferred {
        /// When the gate polls again.
        until: MonoMs,
        /// Deferrals in a row.
        consecutive: u64,
    },
    /// A crash restart is scheduled.
    RestartIn {
        /// The delay.
        delay_ms: u64,
        /// This attempt.
        attempt: u32,
        /// The bound.
        max: u32,
        /// What failed.
        why: String,
    },
    /// The failure count was reset after a stable period.
    FailuresReset,
    /// Another supervisor took the chain over.
    Superseded,
    /// The start decision (log): a start, or a wait.
    StartDecided(StartDecision),
    /// Stop the supervisor.
    Finish(Result<Exit, Failure>),
}

/// Why a signal is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Why {
    /// The epoch did not become LIVE within the live timeout.
    LiveTimeout,
    /// Shutdown: the drain time is over.
    DrainOver,
    /// Shutdown: an epoch outlived SIGTERM by the margin.
    ShutdownMargin,
    /// Our epochs outlived the successor's drain and parent-shutdown time.
    SupersededTooLong,
    /// Giving up: stop whatever is left.
    GaveUp,
}

/// Shutdown, in stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Waiting (until the deadline) for a handoff's new epoch to become LIVE.
    WaitHandoff {
        /// The deadline.
        deadline: MonoMs,
    },
    /// Asked the admin endpoint to drain; waiting for its answer.
    DrainRequested,
    /// Listeners draining until `until`.
    Draining {
        /// End of the drain.
        until: MonoMs,
    },
    /// SIGTERM sent (newest first); SIGKILL at `kill_at`.
    Terminating {
        /// When to SIGKILL.
        kill_at: MonoMs,
    },
    /// SIGKILL sent; waiting for the exits.
    Killed,
    /// Superseded: waiting for the successor's Envoy to shut our epochs down (its
    /// parent shutdown), SIGKILL at `kill_at`.
    AwaitSuccessor {
        /// When to SIGKILL what is left.
        kill_at: MonoMs,
    },
}
