//! The supervisor's I/O loop around [`flock_core::epoch::supervisor::Supervisor`],
//! the lifecycle machine that makes every decision.
//!
//! Events: SIGHUP, config-file changes (inotify), SIGTERM/SIGINT, child exits, and
//! the machine's deadline. Each event is read with the monotonic clock read once and
//! fed to the machine; its actions are performed in order (spawn or signal Envoy
//! processes, probe the admin endpoint, update the state file under its lock, drain,
//! the ready file), and the answer to each is fed back as the next event. Everything
//! runs on one task on one thread, so no state is shared and the Envoy children are
//! all forked from one thread (the parent-death signal, see [`crate::envoy`], is tied
//! to the forking thread).

use std::collections::BTreeSet;
use std::io;
use std::process::ExitStatus;

use flock_clock::{jitter, mono_instant, mono_now, unix_now};
use flock_core::epoch::supervisor::{
    Action, Event, Failure, SpawnReason, StartInputs, Supervisor as Machine, Target, Why,
};
use flock_core::epoch::{EpochRecord, WriteDecision, write_decision};
use flock_core::{ContentHash, UnixMs};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

pub use flock_core::epoch::supervisor::Exit;

use crate::config::Config;
use crate::control::ensure_private_dir;
use crate::envoy::{describe_exit, shared_memory_path};
use crate::envoys::{Envoys, RealEnvoys};
use crate::metrics::{Metrics, set_ready_file};
use crate::statefile::{ReadRecord, StateDir};
use crate::watch::ConfigWatcher;

/// Why the supervisor stopped with an error (the binary exits non-zero).
#[derive(Debug)]
pub enum SupervisorError {
    /// The newest epoch kept dying.
    GaveUp(String),
    /// The start decision refused, or waited too long.
    CannotStart(String),
    /// The first config failed validation.
    InvalidConfig(String),
    /// Setup failed (state dir, signals, inotify).
    Io(String, io::Error),
}

impl std::fmt::Display for SupervisorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GaveUp(m) | Self::CannotStart(m) | Self::InvalidConfig(m) => f.write_str(m),
            Self::Io(what, e) => write!(f, "{what}: {e}"),
        }
    }
}

impl std::error::Error for SupervisorError {}

type ExitMsg = (u32, io::Result<ExitStatus>);

/// Runs the supervisor until SIGTERM, supersession, or an error.
pub async fn run(config: Config) -> Result<Exit, SupervisorError> {
    let envoys = RealEnvoys::new(&config);
    run_with(config, envoys).await
}

/// [`run`] with another Envoy side (a test's fake).
pub async fn run_with<E: Envoys>(config: Config, envoys: E) -> Result<Exit, SupervisorError> {
    Io::new(config, envoys)?.run().await
}

/// The I/O side: processes, admin endpoint, state file, files.
struct Io<E> {
    cfg: Config,
    envoys: E,
    state: StateDir,
    metrics: Metrics,
    machine: Machine,
    /// Our running Envoy processes' epochs.
    children: BTreeSet<u32>,
    exits_tx: mpsc::UnboundedSender<ExitMsg>,
    exits_rx: mpsc::UnboundedReceiver<ExitMsg>,
    config_hash: Option<ContentHash>,
}

/// What performing one action leads to.
enum Next {
    /// Nothing to feed back.
    Done,
    /// The action's answer.
    Feed(Event),
    /// The supervisor ends.
    Finish(Result<Exit, SupervisorError>),
}

impl<E: Envoys> Io<E> {
    fn new(cfg: Config, envoys: E) -> Result<Self, SupervisorError> {
        let state = StateDir::open(&cfg.state_dir).map_err(|e| {
            SupervisorError::Io(format!("state directory {}", cfg.state_dir.display()), e)
        })?;
        // Before any epoch starts: its hot-restart and admin sockets go in here.
        ensure_private_dir(&cfg.control_dir())
            .map_err(|e| SupervisorError::Io("not starting Envoy".into(), e))?;
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        let metrics = Metrics {
            current_epoch: -1,
            base_id: cfg.base_id,
            ..Metrics::default()
        };
        let machine = Machine::new(cfg.policy(), mono_now());
        Ok(Self {
            cfg,
            envoys,
            state,
            metrics,
            machine,
            children: BTreeSet::new(),
            exits_tx,
            exits_rx,
            config_hash: None,
        })
    }

    async fn run(mut self) -> Result<Exit, SupervisorError> {
        let result = self.event_loop().await;
        match &result {
            Ok(exit) => self.finish(*exit),
            Err(SupervisorError::GaveUp(_)) => self.give_up(),
            Err(_) => {}
        }
        result
    }

    async fn event_loop(&mut self) -> Result<Exit, SupervisorError> {
        let sig = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|e| SupervisorError::Io(format!("installing {name} handler"), e))
        };
        let mut hup = sig(SignalKind::hangup(), "SIGHUP")?;
        let mut term = sig(SignalKind::terminate(), "SIGTERM")?;
        let mut int = sig(SignalKind::interrupt(), "SIGINT")?;
        let mut watcher = if self.cfg.watch_config {
            Some(ConfigWatcher::new(&self.cfg.config).map_err(|e| {
                SupervisorError::Io(format!("watching {}", self.cfg.config.display()), e)
            })?)
        } else {
            None
        };
        self.config_hash = std::fs::read(&self.cfg.config)
            .ok()
            .map(|b| ContentHash::of(&b));
        info!(
            config = %self.cfg.config.display(),
            state_dir = %self.state.path().display(),
            control_dir = %self.cfg.control_dir().display(),
            admin = %self.cfg.admin(),
            writer = %self.cfg.writer,
            "flock-supervisor starting"
        );
        self.publish_metrics();
        let mut event = Some(Event::Timer);
        loop {
            if let Some(event) = event.take()
                && let Some(result) = self.feed(event).await
            {
                return result;
            }
            self.publish_metrics();
            let wake = self.machine.poll_timeout();
            let sleep = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(mono_instant(at)).await,
                    None => std::future::pending().await,
                }
            };
            event = tokio::select! {
                _ = hup.recv() => self.trigger("SIGHUP"),
                _ = term.recv() => self.shutdown_signal("SIGTERM"),
                _ = int.recv() => self.shutdown_signal("SIGINT"),
                changed = async { watcher.as_mut().expect("guarded").changed().await }, if watcher.is_some() => {
                    match changed {
                        Ok(()) => self.config_event(),
                        Err(e) => {
                            error!(error = %e, "config watch failed; config changes are no longer noticed, SIGHUP still works");
                            watcher = None;
                            None
                        }
                    }
                }
                Some((epoch, status)) = self.exits_rx.recv() => Some(self.exited(epoch, status)),
                () = sleep => Some(Event::Timer),
            };
        }
    }

    /// Feeds `event` (the clock read once for it) and performs the resulting actions,
    /// feeding each answer back. `Some` ends the supervisor.
    async fn feed(&mut self, event: Event) -> Option<Result<Exit, SupervisorError>> {
        let mut next = Some(event);
        while let Some(event) = next.take() {
            let failures = self.machine.failures();
            let exit = match &event {
                Event::Exited { epoch, how, .. } => Some((*epoch, how.clone())),
                _ => None,
            };
            self.machine.handle(event, mono_now(), jitter());
            if let Some((epoch, how)) = exit
                && self.machine.failures() > failures
            {
                error!(
                    epoch,
                    "the newest Envoy epoch {epoch} died unexpectedly ({how})"
                );
            }
            while let Some(action) = self.machine.poll_action() {
                match self.perform(action).await {
                    Next::Done => {}
                    Next::Feed(answer) => {
                        debug_assert!(next.is_none(), "one outstanding answer at a time");
                        next = Some(answer);
                    }
                    Next::Finish(result) => return Some(result),
                }
            }
        }
        None
    }

    async fn perform(&mut self, action: Action) -> Next {
        match action {
            Action::Probe => Next::Feed(Event::Probed(self.envoys.probe().await)),
            Action::PrepareStart { inputs } => {
                Next::Feed(Event::StartPrepared(self.prepare_start(inputs).await))
            }
            Action::Spawn {
                epoch,
                base_id,
                reason,
            } => {
                if reason == SpawnReason::Crash {
                    info!("restarting: epoch {epoch} on base id {base_id}");
                }
                Next::Feed(self.spawn(epoch, base_id, reason))
            }
            Action::HotRestart {
                from,
                epoch,
                base_id,
            } => {
                if let Err(e) = self.envoys.validate().await {
                    self.metrics.validation_failures += 1;
                    error!(
                        config = %self.cfg.config.display(),
                        "config rejected by envoy --mode validate; NOT restarting, epoch {from} keeps \
                         serving the previous config: {e}"
                    );
                    return Next::Feed(Event::SpawnFailed { epoch, why: e });
                }
                info!("hot restart: epoch {from} -> {epoch} on base id {base_id}");
                Next::Feed(self.spawn(epoch, base_id, SpawnReason::Trigger))
            }
            Action::Heartbeat {
                epoch,
                base_id,
                live,
            } => Next::Feed(Event::Heartbeat(self.heartbeat(epoch, base_id, live).await)),
            Action::Drain { epoch, base_id } => {
                let (ours, successor) = self.envoys.drain(epoch, base_id).await;
                Next::Feed(Event::DrainStarted { ours, successor })
            }
            Action::Signal { target, stop, why } => {
                let epochs: Vec<u32> = match target {
                    Target::Epoch(e) => vec![e],
                    Target::NewestRunning => self.children.last().copied().into_iter().collect(),
                    Target::All => self.children.iter().copied().collect(),
                };
                match why {
                    Why::LiveTimeout => error!(
                        "epoch {epochs:?} is not LIVE {:?} after it started (a stuck initialization: \
                         Envoy's init flag can stay set after a child exits early); stopping it, it \
                         counts as a failed start",
                        self.cfg.live_timeout
                    ),
                    Why::DrainOver => {
                        info!("drain time over: stopping Envoy epochs, newest first")
                    }
                    Why::ShutdownMargin => {
                        warn!("Envoy epochs still running after SIGTERM; sending SIGKILL")
                    }
                    Why::SupersededTooLong => warn!(
                        "our epochs are still running after the successor took over; killing them"
                    ),
                    Why::GaveUp => {}
                }
                for epoch in epochs {
                    if self.children.contains(&epoch) {
                        self.envoys.signal(epoch, stop);
                    }
                }
                Next::Done
            }
            Action::Ready { epoch, took_ms } => {
                if let Some(epoch) = epoch {
                    if let Some(took) = took_ms {
                        self.metrics.last_restart_seconds = took as f64 / 1_000.0;
                    }
                    info!(
                        epoch,
                        base_id = self.machine.base_id(),
                        "epoch {epoch} is LIVE{}",
                        took_ms
                            .map(|t| format!(" {t} ms after it started"))
                            .unwrap_or_default()
                    );
                }
                self.set_ready(epoch);
                Next::Done
            }
            Action::Deferred { until, consecutive } => {
                self.metrics.deferrals = self.machine.gate().deferrals();
                warn!(
                    epoch = ?self.machine.newest(),
                    consecutive,
                    "restart deferred: the newest epoch is not LIVE (forking now would fail, \
                     R7) or its predecessor is still draining; retrying at {until}"
                );
                Next::Done
            }
            Action::RestartIn {
                delay_ms,
                attempt,
                max,
                why,
            } => {
                warn!(attempt, max, "restarting in {delay_ms} ms: {why}");
                Next::Done
            }
            Action::FailuresReset => {
                info!(
                    "epoch LIVE for {:?}: restart failure count reset",
                    self.cfg.stable_after
                );
                Next::Done
            }
            Action::Superseded => {
                info!(
                    "another supervisor took the chain over; our epochs drain and are shut down by it"
                );
                Next::Done
            }
            Action::StartDecided(decision) => {
                info!(%decision, "start decision");
                Next::Done
            }
            Action::Finish(result) => Next::Finish(result.map_err(|f| match f {
                Failure::GaveUp(m) => SupervisorError::GaveUp(format!(
                    "{m}. Check Envoy's log above and the config {}",
                    self.cfg.config.display()
                )),
                Failure::CannotStart(m) => SupervisorError::CannotStart(m),
                Failure::InvalidConfig(m) => SupervisorError::InvalidConfig(format!(
                    "config {}: {m}",
                    self.cfg.config.display()
                )),
            })),
        }
    }

    /// Validates the config; with `inputs`, reads the start decision's inputs.
    async fn prepare_start(&mut self, inputs: bool) -> Result<Option<StartInputs>, String> {
        if let Err(e) = self.envoys.validate().await {
            self.metrics.validation_failures += 1;
            return Err(e);
        }
        if !inputs {
            return Ok(None);
        }
        let on_disk = match self.state.read() {
            Ok(ReadRecord::Record(r)) => Some(r),
            Ok(ReadRecord::Missing) => None,
            Ok(ReadRecord::Invalid(e)) => {
                warn!(error = %e, file = %self.state.state_file().display(), "state file does not parse; treating it as no record");
                None
            }
            Err(e) => {
                warn!(error = %e, file = %self.state.state_file().display(), "state file unreadable; treating it as no record");
                None
            }
        };
        let status = self.envoys.probe().await;
        Ok(Some(StartInputs {
            on_disk,
            status,
            now_unix: unix_now(),
        }))
    }

    /// Starts epoch `epoch` on `base_id`.
    fn spawn(&mut self, epoch: u32, base_id: u32, reason: SpawnReason) -> Event {
        let (pid, exit) = match self.envoys.spawn(epoch, base_id) {
            Ok(spawned) => spawned,
            Err(e) => {
                error!(error = %e, bin = %self.cfg.envoy_bin.display(), "could not start Envoy epoch {epoch}");
                return Event::SpawnFailed {
                    epoch,
                    why: e.to_string(),
                };
            }
        };
        let tx = self.exits_tx.clone();
        tokio::spawn(async move {
            let _ = tx.send((epoch, exit.await));
        });
        info!(epoch, base_id, pid, "started Envoy epoch {epoch}");
        self.children.insert(epoch);
        match reason {
            SpawnReason::Trigger => self.metrics.restarts_trigger += 1,
            SpawnReason::Crash => self.metrics.restarts_crash += 1,
            SpawnReason::First => {}
        }
        self.metrics.current_epoch = i64::from(epoch);
        self.metrics.base_id = base_id;
        self.metrics.children = self.children.len() as u64;
        Event::Spawned { epoch }
    }

    /// The locked state-file update; `None` if it failed.
    async fn heartbeat(&mut self, epoch: u32, base_id: u32, live: bool) -> Option<WriteDecision> {
        let mine = EpochRecord::new(epoch, base_id, UnixMs::ZERO, self.cfg.writer.clone());
        let max_age = self.cfg.heartbeat_max_age_ms;
        let state = self.state.clone();
        let result = tokio::task::spawn_blocking(move || {
            state.locked_update(|on_disk| write_decision(on_disk, &mine, live, unix_now(), max_age))
        })
        .await;
        match result {
            Ok(Ok((_, decision))) => {
                match &decision {
                    WriteDecision::Write { record, reason } => {
                        debug!(%record, %reason, "state file written")
                    }
                    WriteDecision::Skip { reason } => debug!(%reason, "state file not written"),
                    WriteDecision::Yield { .. } => info!(%decision, "state file: yielding"),
                }
                Some(decision)
            }
            Ok(Err(e)) => {
                error!(error = %e, dir = %self.state.path().display(), "state file update failed");
                None
            }
            Err(e) => {
                error!(error = %e, "state file update task failed");
                None
            }
        }
    }

    fn exited(&mut self, epoch: u32, status: io::Result<ExitStatus>) -> Event {
        self.children.remove(&epoch);
        self.metrics.children = self.children.len() as u64;
        let how = match &status {
            Ok(s) => describe_exit(*s),
            Err(e) => format!("wait failed: {e}"),
        };
        if self.machine.is_stopping() || self.machine.newest() != Some(epoch) {
            info!(epoch, "Envoy epoch {epoch} exited ({how})");
        }
        let on_disk = self.state.read().ok().and_then(|r| r.record().cloned());
        Event::Exited {
            epoch,
            how,
            on_disk,
            now_unix: unix_now(),
        }
    }

    fn trigger(&mut self, what: &str) -> Option<Event> {
        if self.machine.is_stopping() {
            info!("{what} ignored: the supervisor is stopping");
            return None;
        }
        info!(
            "{what}: hot restart requested (debounce {} ms)",
            self.machine.gate().debounce_ms()
        );
        Some(Event::Trigger)
    }

    fn shutdown_signal(&mut self, name: &str) -> Option<Event> {
        if self.machine.shutdown_stage().is_some() {
            info!("{name} again: already stopping");
            return None;
        }
        let handoff = !self.machine.newest_live()
            && self
                .machine
                .newest()
                .is_some_and(|n| self.children.contains(&n));
        if handoff && !self.machine.is_stopping() {
            info!(
                "{name}: a hot restart is in progress; waiting up to {:?} for it to finish",
                self.cfg.handoff_timeout
            );
        } else {
            info!("{name}: draining and stopping");
        }
        Some(Event::ShutdownSignal)
    }

    fn config_event(&mut self) -> Option<Event> {
        let hash = match std::fs::read(&self.cfg.config) {
            Ok(bytes) => ContentHash::of(&bytes),
            Err(e) => {
                debug!(error = %e, "config file changing (not readable yet)");
                return None;
            }
        };
        if self.config_hash == Some(hash) {
            debug!("config file event without a content change");
            return None;
        }
        self.config_hash = Some(hash);
        self.trigger("config file changed")
    }

    fn finish(&mut self, exit: Exit) {
        self.set_ready(None);
        self.metrics.children = 0;
        self.publish_metrics();
        if exit == Exit::Terminated {
            self.remove_shared_memory();
        }
        info!(?exit, "flock-supervisor exiting");
    }

    /// After [`SupervisorError::GaveUp`] (`--max-restarts` exhausted): our chain is
    /// over, as after SIGTERM, so the same cleanup as [`Self::finish`] runs. Any
    /// epoch of ours still running dies with us (parent-death signal); removing the
    /// shared memory's name does not disturb a process that has it mapped.
    fn give_up(&mut self) {
        self.set_ready(None);
        self.publish_metrics();
        self.remove_shared_memory();
        info!("flock-supervisor giving up");
    }

    /// Our chain is over: Envoy leaves its shared memory behind; remove it (if we ever
    /// started an epoch), unless another supervisor's chain continues on it
    /// ([`flock_core::epoch::may_remove_shared_memory`]).
    fn remove_shared_memory(&self) {
        let on_disk = match self.state.read() {
            Ok(ReadRecord::Record(r)) => Some(r),
            _ => None,
        };
        let keep_for_successor = !flock_core::epoch::may_remove_shared_memory(
            self.machine.newest(),
            self.machine.base_id(),
            &self.cfg.writer,
            on_disk.as_ref(),
            unix_now(),
            self.cfg.heartbeat_max_age_ms,
        );
        if self.machine.newest().is_none() || keep_for_successor {
            if self.machine.newest().is_some() {
                info!(
                    successor = ?on_disk.as_ref().map(|r| r.writer.to_string()),
                    "leaving Envoy's shared memory to the supervisor that took Envoy over"
                );
            }
            return;
        }
        let shm = shared_memory_path(self.machine.base_id());
        if std::fs::remove_file(&shm).is_ok() {
            debug!(file = %shm.display(), "removed Envoy's shared memory");
        }
    }

    fn set_ready(&mut self, epoch: Option<u32>) {
        self.metrics.live = epoch.is_some();
        if let Some(path) = &self.cfg.ready_file
            && let Err(e) = set_ready_file(path, epoch)
        {
            error!(error = %e, file = %path.display(), "ready file update failed");
        }
    }

    fn publish_metrics(&mut self) {
        self.metrics.triggers = self.machine.gate().triggers();
        self.metrics.deferrals = self.machine.gate().deferrals();
        if let Some(path) = &self.cfg.metrics_file
            && let Err(e) = self.metrics.write_textfile(path)
        {
            warn!(error = %e, file = %path.display(), "metrics file update failed");
        }
    }
}
