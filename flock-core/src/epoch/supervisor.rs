//! The supervisor's lifecycle as a sans-IO state machine: events and the monotonic
//! time in, actions and the next deadline out (quinn-proto's `handle`/`poll` shape).
//!
//! The supervisor process (`flock-hotrestart`) performs I/O only: it spawns and
//! signals Envoy processes, probes the admin endpoint, reads and writes the state
//! file, and feeds each result back as an [`Event`] with the time it read once for
//! that event. Every decision is made here:
//!
//! * **the live timeout**: an epoch that is not LIVE `live_timeout_ms` after it
//!   started is stopped (a stuck initialization); its exit then counts as a failure;
//! * **the failure count's reset**: an epoch LIVE for `stable_after_ms` clears the
//!   consecutive-failure count and the restart backoff;
//! * **the give-up rule** ([`after_failure`], shared with [`after_newest_exit`]): a
//!   death of the newest epoch and a start that produced no process both count, and
//!   the supervisor gives up after `max_restarts` restarts in a row;
//! * **the shutdown stages**: wait for an in-progress handoff (bounded), drain the
//!   listeners for the drain time, SIGTERM the epochs newest first, SIGKILL what is
//!   left after a margin;
//! * **supersession**: another supervisor took the chain over; our epochs are shut
//!   down by Envoy, and killed if they outlive the successor's drain and parent
//!   shutdown;
//! * the start decision ([`start_epoch`]), the restart gate ([`RestartGate`], R7) and
//!   the predecessor's drain ([`predecessor_drained`]), driven at the right times.
//!
//! # Driving it
//!
//! ```text
//! loop {
//!     let event = <next I/O event, or Event::Timer when poll_timeout() is reached>;
//!     machine.handle(event, mono_now(), jitter());
//!     while let Some(action) = machine.poll_action() {
//!         perform(action);   // results come back as further events
//!     }
//! }
//! ```
//!
//! The machine never asks for two things at once: after an action that expects an
//! answer (a probe, a start, a spawn, a heartbeat, a drain) the caller performs it
//! and feeds the answer back before taking the next event.

mod shutdown;
mod vocab;

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use super::gate::{GateDecision, RestartGate};
use super::record::EpochRecord;
use super::start::{PredecessorStatus, StartDecision, start_epoch};
use super::supervise::{
    AfterExit, Retry, after_failure, after_newest_exit, predecessor_drained, start_input,
};
use super::write_rule::WriteDecision;
use crate::backoff::Backoff;
use crate::time::{MonoMs, UnixMs};

pub use vocab::*;

/// What an outstanding probe is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ProbeFor {
    heartbeat: bool,
    gate: bool,
}

/// The supervisor's lifecycle (see the module docs).
#[derive(Clone, Debug)]
pub struct Supervisor {
    policy: Policy,
    gate: RestartGate,
    backoff: Backoff,
    base_id: u32,
    running: BTreeSet<u32>,
    newest: Option<u32>,
    /// When the newest epoch was first seen LIVE; `Some` exactly while it is LIVE.
    live_since: Option<MonoMs>,
    /// When the newest epoch started; `None` once LIVE or once its live timeout acted.
    started_at: Option<MonoMs>,
    next_probe: MonoMs,
    next_heartbeat: MonoMs,
    failures: u32,
    start_at: Option<MonoMs>,
    start_waiting_since: Option<MonoMs>,
    superseded_at: Option<MonoMs>,
    shutdown: Option<Stage>,
    /// An answer the caller owes: no timer work until it arrives.
    awaiting: Option<Awaiting>,
    probe_for: ProbeFor,
    gate_after_heartbeat: bool,
    ever_started: bool,
    finished: bool,
    actions: VecDeque<Action>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaiting {
    Probe,
    Start,
    Spawn(SpawnReason),
    Heartbeat,
    Drain,
}

impl Supervisor {
    /// A supervisor that starts its first epoch at `now`.
    pub fn new(policy: Policy, now: MonoMs) -> Self {
        let gate = RestartGate::new(policy.debounce_ms).with_max_delay(policy.max_debounce_ms);
        let backoff = Backoff::new(
            Duration::from_millis(policy.backoff_ms.0),
            Duration::from_millis(policy.backoff_ms.1),
        );
        Self {
            base_id: policy.base_id,
            policy,
            gate,
            backoff,
            running: BTreeSet::new(),
            newest: None,
            live_since: None,
            started_at: None,
            next_probe: now,
            next_heartbeat: now,
            failures: 0,
            start_at: Some(now),
            start_waiting_since: None,
            superseded_at: None,
            shutdown: None,
            awaiting: None,
            probe_for: ProbeFor::default(),
            gate_after_heartbeat: false,
            ever_started: false,
            finished: false,
            actions: VecDeque::new(),
        }
    }

    /// The next thing to do, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to feed [`Event::Timer`] next; `None` after [`Action::Finish`].
    pub fn poll_timeout(&self) -> Option<MonoMs> {
        if self.finished {
            return None;
        }
        // Mirrors `run_timers`: every deadline returned here is consumed there.
        let mut wake: Option<MonoMs> = None;
        let mut at = |t: MonoMs| wake = Some(wake.map_or(t, |w| w.min(t)));
        if let Some(started) = self.started_at {
            at(started.plus(self.policy.live_timeout_ms));
        }
        if let Some(since) = self.live_since
            && self.failures > 0
        {
            at(since.plus(self.policy.stable_after_ms));
        }
        if let Some(stage) = self.shutdown {
            if self.live_since.is_none() && self.newest_running() {
                at(self.next_probe);
            }
            match stage {
                Stage::WaitHandoff { deadline } => at(deadline),
                Stage::Draining { until } => at(until),
                Stage::Terminating { kill_at } | Stage::AwaitSuccessor { kill_at } => at(kill_at),
                Stage::DrainRequested | Stage::Killed => {}
            }
            return wake;
        }
        if let Some(t) = self.superseded_at {
            at(t.plus(self.superseded_bound_ms()));
            return wake;
        }
        at(self.next_heartbeat);
        if self.newest.is_some() && self.live_since.is_none() {
            at(self.next_probe);
        }
        if let Some(t) = self.gate.next_wakeup() {
            at(t);
        }
        if let Some(t) = self.start_at {
            at(t);
        }
        wake
    }

    /// Takes in one event at `now`; `jitter` is a uniform sample in `[0, 1)` for the
    /// restart backoff.
    pub fn handle(&mut self, event: Event, now: MonoMs, jitter: f64) {
        if self.finished {
            return;
        }
        match event {
            Event::Timer => {}
            Event::Trigger => {
                if self.shutdown.is_none() && self.superseded_at.is_none() {
                    self.gate.trigger(now);
                }
            }
            Event::ShutdownSignal => self.on_shutdown_signal(now),
            Event::Probed(status) => self.on_probed(status, now),
            Event::StartPrepared(prepared) => self.on_start_prepared(prepared, now, jitter),
            Event::Spawned { epoch } => self.on_spawned(epoch, now),
            Event::SpawnFailed { epoch, why } => self.on_spawn_failed(epoch, why, now, jitter),
            Event::Heartbeat(decision) => self.on_heartbeat(decision, now),
            Event::DrainStarted { ours, successor } => self.on_drain_started(ours, successor, now),
            Event::Exited {
                epoch,
                how,
                on_disk,
                now_unix,
            } => self.on_exit(epoch, &how, on_disk, now_unix, now, jitter),
        }
        self.run_timers(now);
    }

    // ---- accessors (metrics, logs, tests)

    /// The restart gate (its counters are metrics).
    pub fn gate(&self) -> &RestartGate {
        &self.gate
    }

    /// Consecutive failures counted.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The newest epoch, if any was started.
    pub fn newest(&self) -> Option<u32> {
        self.newest
    }

    /// Whether the newest epoch is LIVE.
    pub fn newest_live(&self) -> bool {
        self.live_since.is_some()
    }

    /// The base id of our chain.
    pub fn base_id(&self) -> u32 {
        self.base_id
    }

    /// Our epochs still running.
    pub fn running(&self) -> &BTreeSet<u32> {
        &self.running
    }

    /// The shutdown stage, if shutting down.
    pub fn shutdown_stage(&self) -> Option<Stage> {
        self.shutdown
    }

    /// Whether the supervisor stops (shutdown or superseded): triggers are ignored.
    pub fn is_stopping(&self) -> bool {
        self.shutdown.is_some() || self.superseded_at.is_some()
    }

    // ---- events

    fn on_probed(&mut self, status: PredecessorStatus, now: MonoMs) {
        if self.awaiting == Some(Awaiting::Probe) {
            self.awaiting = None;
        }
        self.observe(status, now);
        let for_ = std::mem::take(&mut self.probe_for);
        if self.superseded_at.is_some() || self.shutdown.is_some() {
            return;
        }
        if for_.heartbeat && self.heartbeat_action() {
            self.gate_after_heartbeat = for_.gate;
            return;
        }
        if for_.gate {
            self.poll_gate(now);
        }
    }

    /// Takes in an admin answer: our newest epoch LIVE, or not (any more).
    fn observe(&mut self, status: PredecessorStatus, now: MonoMs) {
        let Some(newest) = self.newest else { return };
        let live = matches!(status, PredecessorStatus::Live { epoch, base_id }
            if base_id == self.base_id && epoch == newest)
            && self.running.contains(&newest);
        if live && self.live_since.is_none() {
            let took_ms = self.started_at.map(|t| now.since(t));
            self.live_since = Some(now);
            self.started_at = None;
            self.start_waiting_since = None;
            // Record it now rather than at the next heartbeat.
            self.next_heartbeat = now;
            self.actions.push_back(Action::Ready {
                epoch: Some(newest),
                took_ms,
            });
        } else if !live && self.live_since.is_some() {
            self.live_since = None;
            self.set_not_ready();
        }
    }

    fn on_start_prepared(
        &mut self,
        prepared: Result<Option<StartInputs>, String>,
        now: MonoMs,
        jitter: f64,
    ) {
        self.awaiting = None;
        if self.shutdown.is_some() || self.superseded_at.is_some() {
            return;
        }
        let inputs = match prepared {
            Err(why) => {
                let why = format!("the config was rejected by envoy --mode validate: {why}");
                if !self.ever_started {
                    return self.finish(Err(Failure::InvalidConfig(why)));
                }
                return self.fail_start(why, now, jitter);
            }
            Ok(inputs) => inputs,
        };
        // An epoch of ours survives: hot restart from it.
        if let Some(&survivor) = self.running.last() {
            self.newest = Some(survivor);
            return self.spawn(survivor.saturating_add(1), SpawnReason::Crash);
        }
        let Some(inputs) = inputs else {
            // Asked without inputs while a survivor ran; it is gone now: ask again.
            self.start_at = Some(now);
            return;
        };
        let input = start_input(inputs.on_disk.as_ref(), &self.policy.writer);
        let decision = start_epoch(
            input,
            inputs.now_unix,
            self.policy.heartbeat_max_age_ms,
            inputs.status,
        );
        match decision {
            StartDecision::Start { epoch, base_id, .. } => {
                self.actions
                    .push_back(Action::StartDecided(decision.clone()));
                self.start_waiting_since = None;
                self.base_id = base_id.resolve(self.policy.base_id);
                let reason = if self.ever_started {
                    SpawnReason::Crash
                } else {
                    SpawnReason::First
                };
                self.spawn(epoch, reason);
            }
            StartDecision::Wait { until_ms, .. } => {
                let since = *self.start_waiting_since.get_or_insert(now);
                if now.since(since) > self.policy.start_timeout_ms {
                    return self.finish(Err(Failure::CannotStart(format!(
                        "still cannot start after {} ms: {decision}",
                        self.policy.start_timeout_ms
                    ))));
                }
                let wait = until_ms.since(inputs.now_unix).max(10);
                self.start_at = Some(now.plus(wait));
                self.actions.push_back(Action::StartDecided(decision));
            }
            StartDecision::Refuse { .. } => {
                self.finish(Err(Failure::CannotStart(decision.to_string())));
            }
        }
    }

    fn spawn(&mut self, epoch: u32, reason: SpawnReason) {
        self.awaiting = Some(Awaiting::Spawn(reason));
        self.actions.push_back(Action::Spawn {
            epoch,
            base_id: self.base_id,
            reason,
        });
    }

    fn on_spawned(&mut self, epoch: u32, now: MonoMs) {
        if matches!(self.awaiting, Some(Awaiting::Spawn(_))) {
            self.awaiting = None;
        }
        self.ever_started = true;
        self.running.insert(epoch);
        self.newest = Some(epoch);
        self.live_since = None;
        self.started_at = Some(now);
        self.next_probe = now.plus(self.policy.live_probe_ms);
        self.set_not_ready();
    }

    fn on_spawn_failed(&mut self, epoch: u32, why: String, now: MonoMs, jitter: f64) {
        let reason = match self.awaiting {
            Some(Awaiting::Spawn(r)) => r,
            _ => SpawnReason::Trigger,
        };
        self.awaiting = None;
        // A hot restart that did not start leaves the serving epoch as it is.
        if reason != SpawnReason::Trigger {
            self.fail_start(format!("could not start epoch {epoch}: {why}"), now, jitter);
        }
    }

    /// A start attempt produced no process: it counts like a death.
    fn fail_start(&mut self, why: String, now: MonoMs, jitter: f64) {
        self.failures = self.failures.saturating_add(1);
        match after_failure(self.failures, self.policy.max_restarts) {
            Retry::GiveUp { failures } => self.finish(Err(Failure::GaveUp(format!(
                "Envoy could not be restarted {failures} times in a row; last: {why}"
            )))),
            Retry::Restart { attempt, max } => {
                self.schedule_restart(attempt, max, why, now, jitter)
            }
        }
    }

    fn schedule_restart(&mut self, attempt: u32, max: u32, why: String, now: MonoMs, jitter: f64) {
        let delay = self.backoff.next_delay(jitter);
        let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.start_at = Some(now.plus(delay_ms));
        self.actions.push_back(Action::RestartIn {
            delay_ms,
            attempt,
            max,
            why,
        });
    }

    fn on_heartbeat(&mut self, decision: Option<WriteDecision>, now: MonoMs) {
        if self.awaiting == Some(Awaiting::Heartbeat) {
            self.awaiting = None;
        }
        if let Some(WriteDecision::Yield { .. }) = decision {
            self.become_superseded(now);
        }
        if std::mem::take(&mut self.gate_after_heartbeat)
            && self.superseded_at.is_none()
            && self.shutdown.is_none()
        {
            self.poll_gate(now);
        }
    }

    fn on_exit(
        &mut self,
        epoch: u32,
        how: &str,
        on_disk: Option<EpochRecord>,
        now_unix: UnixMs,
        now: MonoMs,
        jitter: f64,
    ) {
        self.running.remove(&epoch);
        if self.shutdown.is_some() || self.superseded_at.is_some() {
            if matches!(self.shutdown, Some(Stage::Terminating { .. })) {
                self.signal(Target::NewestRunning, Stop::Term, Why::DrainOver);
            }
            return;
        }
        if self.newest != Some(epoch) {
            // A replaced epoch, shut down by its successor after its drain.
            return;
        }
        self.live_since = None;
        self.started_at = None;
        self.set_not_ready();
        let ours = EpochRecord::new(
            epoch,
            self.base_id,
            UnixMs::ZERO,
            self.policy.writer.clone(),
        );
        let decision = after_newest_exit(
            on_disk.as_ref(),
            &ours,
            self.failures.saturating_add(1),
            self.policy.max_restarts,
            now_unix,
            self.policy.heartbeat_max_age_ms,
        );
        match decision {
            AfterExit::Superseded { .. } => self.become_superseded(now),
            AfterExit::Restart { attempt, max } => {
                self.failures = attempt;
                self.schedule_restart(
                    attempt,
                    max,
                    format!("epoch {epoch} died ({how})"),
                    now,
                    jitter,
                );
            }
            AfterExit::GiveUp { failures } => {
                self.signal(Target::All, Stop::Term, Why::GaveUp);
                self.finish(Err(Failure::GaveUp(format!(
                    "the newest Envoy epoch died {failures} times in a row (last: epoch {epoch}, {how}); giving up"
                ))));
            }
        }
    }

    fn become_superseded(&mut self, now: MonoMs) {
        if self.superseded_at.is_none() {
            self.superseded_at = Some(now);
            self.live_since = None;
            self.started_at = None;
            self.start_at = None;
            self.actions.push_back(Action::Superseded);
            self.set_not_ready();
        }
    }

    // ---- timers

    /// Does whatever is due at `now`, unless an answer is outstanding.
    fn run_timers(&mut self, now: MonoMs) {
        if self.finished || self.awaiting.is_some() {
            return;
        }
        // The live timeout: a stuck initialization is stopped; its exit is a failure.
        if let Some(started) = self.started_at
            && now.since(started) >= self.policy.live_timeout_ms
        {
            self.started_at = None;
            if let Some(newest) = self.newest
                && self.live_since.is_none()
                && self.running.contains(&newest)
            {
                self.signal(Target::Epoch(newest), Stop::Term, Why::LiveTimeout);
            }
        }
        // A stable epoch resets the failure count and the backoff.
        if let Some(since) = self.live_since
            && self.failures > 0
            && now.since(since) >= self.policy.stable_after_ms
        {
            self.failures = 0;
            self.backoff.reset();
            self.actions.push_back(Action::FailuresReset);
        }
        if self.shutdown.is_some() {
            if self.live_since.is_none() && self.newest_running() && now >= self.next_probe {
                self.request_probe(now, ProbeFor::default());
                return;
            }
            return self.drive_shutdown(now);
        }
        if let Some(since) = self.superseded_at {
            if self.running.is_empty() {
                return self.finish(Ok(Exit::Superseded));
            }
            if now.since(since) >= self.superseded_bound_ms() {
                self.signal(Target::All, Stop::Kill, Why::SupersededTooLong);
                self.superseded_at = Some(now);
            }
            return;
        }
        if let Some(at) = self.start_at
            && now >= at
        {
            self.start_at = None;
            self.awaiting = Some(Awaiting::Start);
            self.actions.push_back(Action::PrepareStart {
                inputs: self.running.is_empty(),
            });
            return;
        }
        let mut for_ = ProbeFor::default();
        let live_probe =
            self.newest.is_some() && self.live_since.is_none() && now >= self.next_probe;
        if now >= self.next_heartbeat {
            self.next_heartbeat = now.plus(self.policy.heartbeat_ms);
            for_.heartbeat = self.newest.is_some();
        }
        let gate_due = self.gate.next_wakeup().is_some_and(|t| now >= t);
        // The gate's input is the newest epoch's liveness right now: probe first.
        for_.gate = gate_due && self.newest.is_some();
        if live_probe || for_.heartbeat || for_.gate {
            self.request_probe(now, for_);
        } else if gate_due {
            self.poll_gate(now);
        }
    }

    fn request_probe(&mut self, now: MonoMs, for_: ProbeFor) {
        self.next_probe = now.plus(self.policy.live_probe_ms);
        self.probe_for = for_;
        self.awaiting = Some(Awaiting::Probe);
        self.actions.push_back(Action::Probe);
    }

    fn heartbeat_action(&mut self) -> bool {
        let Some(epoch) = self.newest else {
            return false;
        };
        self.awaiting = Some(Awaiting::Heartbeat);
        self.actions.push_back(Action::Heartbeat {
            epoch,
            base_id: self.base_id,
            live: self.live_since.is_some(),
        });
        true
    }

    /// The gate's input: the newest epoch is LIVE **and** its predecessor has had its
    /// full drain time ([`predecessor_drained`]) **and** no crash restart is pending.
    fn ready_to_fork(&self, now: MonoMs) -> bool {
        let drained = predecessor_drained(
            self.running.len(),
            self.live_since,
            now,
            self.policy.drain_time_ms,
        );
        self.live_since.is_some() && drained && self.start_at.is_none()
    }

    fn poll_gate(&mut self, now: MonoMs) {
        let ready = self.ready_to_fork(now);
        match self.gate.poll(now, ready) {
            GateDecision::Fire => {
                let Some(from) = self.newest else { return };
                let Some(epoch) = from.checked_add(1) else {
                    return;
                };
                self.awaiting = Some(Awaiting::Spawn(SpawnReason::Trigger));
                self.actions.push_back(Action::HotRestart {
                    from,
                    epoch,
                    base_id: self.base_id,
                });
            }
            GateDecision::Deferred { until } => self.actions.push_back(Action::Deferred {
                until,
                consecutive: self.gate.consecutive_deferrals(),
            }),
            GateDecision::Idle | GateDecision::WaitUntil { .. } => {}
        }
    }

    // ---- helpers

    fn newest_running(&self) -> bool {
        self.newest.is_some_and(|n| self.running.contains(&n))
    }

    pub(super) fn superseded_bound_ms(&self) -> u64 {
        self.policy
            .drain_time_ms
            .saturating_add(self.policy.parent_shutdown_ms)
            .saturating_add(self.policy.shutdown_margin_ms)
    }

    fn signal(&mut self, target: Target, stop: Stop, why: Why) {
        self.actions.push_back(Action::Signal { target, stop, why });
    }

    fn set_not_ready(&mut self) {
        self.actions.push_back(Action::Ready {
            epoch: None,
            took_ms: None,
        });
    }

    fn finish(&mut self, result: Result<Exit, Failure>) {
        self.finished = true;
        self.awaiting = None;
        self.actions.push_back(Action::Finish(result));
    }
}
