//! The supervisor: one event loop that executes `flock_core::epoch`'s decisions.
//!
//! Events: SIGHUP, config-file changes (inotify), SIGTERM/SIGINT, child exits, and
//! timers (heartbeat, restart gate, LIVE probes, restart backoff, shutdown stages).
//! Every event is handled to completion before the next (one task, single thread),
//! so no state is shared and the Envoy children are all forked from one thread (the
//! parent-death signal, see [`crate::envoy`], is tied to the forking thread).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flock_core::backoff::Backoff;
use flock_core::epoch::{
    AfterExit, EpochRecord, GateDecision, PredecessorStatus, RestartGate, StartDecision,
    WriteDecision, WriterId, after_newest_exit, predecessor_drained, start_epoch, start_input,
    write_decision,
};
use flock_core::{ContentHash, MonoMs};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::admin::AdminClient;
use crate::envoy::{EnvoySpec, describe_exit, shared_memory_path};
use crate::metrics::{Metrics, set_ready_file};
use crate::statefile::{ReadRecord, StateDir};
use crate::watch::ConfigWatcher;

/// Everything the supervisor needs; the binary's flags map onto it one to one.
#[derive(Clone, Debug)]
pub struct Config {
    /// The Envoy ELF.
    pub envoy_bin: PathBuf,
    /// The bootstrap config; also watched for changes.
    pub config: PathBuf,
    /// The base id used for a cold start with no state-file record.
    pub base_id: u32,
    /// The state directory (`epoch`, `epoch.lock`).
    pub state_dir: PathBuf,
    /// Envoy's admin address `HOST:PORT`, as in the bootstrap.
    pub admin_address: String,
    /// `--drain-time-s` for Envoy, and the drain at shutdown.
    pub drain_time_s: u64,
    /// `--parent-shutdown-time-s` for Envoy.
    pub parent_shutdown_time_s: u64,
    /// The restart gate's trailing debounce.
    pub debounce_ms: u64,
    /// The longest a stream of triggers can postpone a restart.
    pub max_debounce_ms: u64,
    /// Exists exactly while the newest epoch is LIVE.
    pub ready_file: Option<PathBuf>,
    /// Prometheus textfile.
    pub metrics_file: Option<PathBuf>,
    /// This supervisor's id in the state file.
    pub writer: WriterId,
    /// Heartbeat period (state file, LIVE probe).
    pub heartbeat: Duration,
    /// Records older than this are stale.
    pub heartbeat_max_age_ms: u64,
    /// A new epoch not LIVE after this long is stopped and counts as a failure.
    pub live_timeout: Duration,
    /// The longest the start decision may keep waiting before giving up.
    pub start_timeout: Duration,
    /// At SIGTERM, the longest to wait for an in-progress handoff to finish.
    pub handoff_timeout: Duration,
    /// At SIGTERM, after the drain: how long epochs get to exit before SIGKILL.
    pub shutdown_margin: Duration,
    /// Consecutive unexpected deaths tolerated before the supervisor gives up.
    pub max_restarts: u32,
    /// Restart backoff (initial, max).
    pub restart_backoff: (Duration, Duration),
    /// Watch the config file with inotify.
    pub watch_config: bool,
    /// `envoy --mode validate` time limit.
    pub validate_timeout: Duration,
    /// Extra Envoy arguments.
    pub envoy_args: Vec<OsString>,
    /// The exec shim setting the parent-death signal (the supervisor binary).
    pub shim: Option<PathBuf>,
}

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

/// How the supervisor ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// SIGTERM/SIGINT: every epoch drained and stopped.
    Terminated,
    /// Another supervisor took the chain over; our epochs were shut down by Envoy.
    Superseded,
}

struct ChildInfo {
    pid: Pid,
}

#[derive(Clone, Copy, Debug)]
enum Shutdown {
    /// Waiting for the new epoch of a handoff to become LIVE.
    WaitHandoff { deadline: Instant },
    /// Listeners draining gracefully.
    Draining { until: Instant },
    /// SIGTERM sent; SIGKILL at `kill_at`.
    Terminating { kill_at: Instant },
    /// SIGKILL sent; waiting for the exits.
    Killed,
}

type ExitMsg = (u32, io::Result<ExitStatus>);

/// Runs the supervisor until SIGTERM, supersession, or an error.
pub async fn run(config: Config) -> Result<Exit, SupervisorError> {
    Supervisor::new(config)?.run().await
}

struct Supervisor {
    cfg: Config,
    envoy: EnvoySpec,
    admin: AdminClient,
    state: StateDir,
    gate: RestartGate,
    metrics: Metrics,
    origin: Instant,
    children: BTreeMap<u32, ChildInfo>,
    exits_tx: mpsc::UnboundedSender<ExitMsg>,
    exits_rx: mpsc::UnboundedReceiver<ExitMsg>,
    base_id: u32,
    newest: Option<u32>,
    newest_live: bool,
    live_since: Option<Instant>,
    forked_at: Option<Instant>,
    next_live_probe: Instant,
    next_heartbeat: Instant,
    superseded: Option<Instant>,
    failures: u32,
    backoff: Backoff,
    respawn_at: Option<Instant>,
    start_waiting_since: Option<Instant>,
    shutdown: Option<Shutdown>,
    config_hash: Option<ContentHash>,
}

const LIVE_PROBE_EVERY: Duration = Duration::from_millis(100);
/// An epoch LIVE for this long resets the crash counter.
const STABLE_AFTER: Duration = Duration::from_secs(10);

impl Supervisor {
    fn new(cfg: Config) -> Result<Self, SupervisorError> {
        let state = StateDir::open(&cfg.state_dir).map_err(|e| {
            SupervisorError::Io(format!("state directory {}", cfg.state_dir.display()), e)
        })?;
        let envoy = EnvoySpec {
            bin: cfg.envoy_bin.clone(),
            config: cfg.config.clone(),
            drain_time_s: cfg.drain_time_s,
            parent_shutdown_time_s: cfg.parent_shutdown_time_s,
            extra_args: cfg.envoy_args.clone(),
            shim: cfg.shim.clone(),
        };
        let admin = AdminClient::new(cfg.admin_address.clone(), Duration::from_secs(1));
        let gate = RestartGate::new(cfg.debounce_ms).with_max_delay(cfg.max_debounce_ms);
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        let now = Instant::now();
        let backoff = Backoff::new(cfg.restart_backoff.0, cfg.restart_backoff.1);
        let metrics = Metrics {
            current_epoch: -1,
            base_id: cfg.base_id,
            ..Metrics::default()
        };
        Ok(Self {
            base_id: cfg.base_id,
            cfg,
            envoy,
            admin,
            state,
            gate,
            metrics,
            origin: now,
            children: BTreeMap::new(),
            exits_tx,
            exits_rx,
            newest: None,
            newest_live: false,
            live_since: None,
            forked_at: None,
            next_live_probe: now,
            next_heartbeat: now,
            superseded: None,
            failures: 0,
            backoff,
            respawn_at: Some(now),
            start_waiting_since: None,
            shutdown: None,
            config_hash: None,
        })
    }

    fn mono_ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
    }

    /// [`Self::mono_ms`] rounded up to the next millisecond.
    fn mono_ms_ceil(&self, at: Instant) -> u64 {
        let d = at.saturating_duration_since(self.origin);
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if d.subsec_nanos().is_multiple_of(1_000_000) {
            ms
        } else {
            ms.saturating_add(1)
        }
    }

    fn instant_of(&self, ms: u64) -> Instant {
        self.origin + Duration::from_millis(ms)
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
            admin = %self.cfg.admin_address,
            writer = %self.cfg.writer,
            "flock-supervisor starting"
        );
        self.publish_metrics();
        loop {
            if let Some(exit) = self.tick().await? {
                return Ok(exit);
            }
            let wake = self.next_wakeup();
            tokio::select! {
                _ = hup.recv() => self.on_trigger("SIGHUP"),
                _ = term.recv() => self.on_shutdown_signal("SIGTERM"),
                _ = int.recv() => self.on_shutdown_signal("SIGINT"),
                changed = async { watcher.as_mut().expect("guarded").changed().await }, if watcher.is_some() => {
                    match changed {
                        Ok(()) => self.on_config_event(),
                        Err(e) => {
                            error!(error = %e, "config watch failed; config changes are no longer noticed, SIGHUP still works");
                            watcher = None;
                        }
                    }
                }
                Some((epoch, status)) = self.exits_rx.recv() => self.on_exit(epoch, status)?,
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
            }
        }
    }

    fn next_wakeup(&self) -> Instant {
        let mut wake = self.next_heartbeat;
        if self.newest.is_some() && !self.newest_live {
            wake = wake.min(self.next_live_probe);
        }
        if let Some(at) = self.gate.next_wakeup() {
            wake = wake.min(self.instant_of(at.as_millis()));
        }
        if let Some(at) = self.respawn_at {
            wake = wake.min(at);
        }
        if let Some(since) = self.superseded {
            wake = wake.min(since + self.superseded_bound());
        }
        match self.shutdown {
            Some(Shutdown::WaitHandoff { deadline }) => wake = wake.min(deadline),
            Some(Shutdown::Draining { until }) => wake = wake.min(until),
            Some(Shutdown::Terminating { kill_at }) => wake = wake.min(kill_at),
            _ => {}
        }
        wake
    }

    fn superseded_bound(&self) -> Duration {
        Duration::from_secs(self.cfg.drain_time_s + self.cfg.parent_shutdown_time_s)
            + self.cfg.shutdown_margin
    }

    /// Does all the work that is due. `Some` ends the supervisor.
    async fn tick(&mut self) -> Result<Option<Exit>, SupervisorError> {
        let now = Instant::now();
        // 1. A new epoch: probe until it is LIVE (or give up on it).
        if self.newest.is_some() && !self.newest_live && now >= self.next_live_probe {
            self.next_live_probe = now + LIVE_PROBE_EVERY;
            let status = self.admin.probe().await;
            self.observe(status);
            if !self.newest_live
                && let Some(forked) = self.forked_at
                && forked.elapsed() > self.cfg.live_timeout
                && let Some(newest) = self.newest
                && let Some(child) = self.children.get(&newest)
            {
                error!(
                    epoch = newest,
                    "epoch {newest} is not LIVE {:?} after it started (a stuck initialization, \
                     e.g. envoy#33446); stopping it, it counts as a failed start",
                    self.cfg.live_timeout
                );
                let _ = kill(child.pid, Signal::SIGTERM);
                self.forked_at = None;
            }
        }
        // 2. Shutdown in progress: only drive it.
        if let Some(stage) = self.shutdown {
            return Ok(self.drive_shutdown(stage).await);
        }
        // 3. Superseded: wait for our epochs to be shut down by the successor.
        if let Some(since) = self.superseded {
            if self.children.is_empty() {
                return Ok(Some(Exit::Superseded));
            }
            if since.elapsed() >= self.superseded_bound() {
                warn!(
                    "our epochs are still running {:?} after the successor took over; killing them",
                    self.superseded_bound()
                );
                self.signal_all(Signal::SIGKILL);
                self.superseded = Some(Instant::now());
            }
            return Ok(None);
        }
        // 4. Heartbeat: probe, then the locked state-file update.
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + self.cfg.heartbeat;
            if self.newest.is_some() {
                let status = self.admin.probe().await;
                self.observe(status);
                self.heartbeat().await;
                if self.superseded.is_some() {
                    return Ok(None);
                }
            }
            if let Some(since) = self.live_since
                && since.elapsed() >= STABLE_AFTER
                && self.failures > 0
            {
                info!("epoch LIVE for {STABLE_AFTER:?}: restart failure count reset");
                self.failures = 0;
                self.backoff.reset();
            }
            self.publish_metrics();
        }
        // 5. A (re)start that is due.
        if let Some(at) = self.respawn_at
            && now >= at
        {
            self.respawn_at = None;
            self.respawn().await?;
        }
        // 6. The restart gate.
        if let Some(at) = self.gate.next_wakeup()
            && self.mono_ms(Instant::now()) >= at.as_millis()
        {
            // A fresh probe: the gate's input is the newest epoch's liveness right now.
            if self.newest.is_some() {
                let status = self.admin.probe().await;
                self.observe(status);
            }
            let live = self.ready_to_fork();
            match self.gate.poll(MonoMs(self.mono_ms(Instant::now())), live) {
                GateDecision::Fire => self.hot_restart().await,
                GateDecision::Deferred { until } => {
                    self.metrics.deferrals = self.gate.deferrals();
                    warn!(
                        epoch = ?self.newest,
                        consecutive = self.gate.consecutive_deferrals(),
                        "restart deferred: the newest epoch is not LIVE (forking now would fail, \
                         R7) or its predecessor is still draining; retrying in {} ms",
                        until.as_millis().saturating_sub(self.mono_ms(Instant::now()))
                    );
                    self.publish_metrics();
                }
                GateDecision::Idle | GateDecision::WaitUntil { .. } => {}
            }
        }
        Ok(None)
    }

    /// The gate's input: the newest epoch is LIVE **and** its predecessor has had its
    /// full drain time ([`predecessor_drained`]) and no crash restart is pending.
    fn ready_to_fork(&self) -> bool {
        // `live_since` rounded up and now rounded down: the rounding never shortens
        // the drain.
        let drained = predecessor_drained(
            self.children.len(),
            self.live_since.map(|t| self.mono_ms_ceil(t)),
            self.mono_ms(Instant::now()),
            self.cfg.drain_time_s.saturating_mul(1_000),
        );
        self.newest_live && drained && self.respawn_at.is_none()
    }

    /// Takes in an admin answer: our newest epoch LIVE, or a successor's epoch.
    fn observe(&mut self, status: PredecessorStatus) {
        let Some(newest) = self.newest else { return };
        let (live, higher) = match status {
            PredecessorStatus::Live { epoch, base_id } if base_id == self.base_id => {
                (epoch == newest, epoch > newest)
            }
            PredecessorStatus::NotLive { epoch, base_id } if base_id == self.base_id => {
                (false, epoch > newest)
            }
            _ => (false, false),
        };
        if higher {
            debug!(%status, "the admin endpoint answers for a later epoch of our chain");
        }
        if live && !self.newest_live {
            let took = self.forked_at.map(|t| t.elapsed());
            if let Some(took) = took {
                self.metrics.last_restart_seconds = took.as_secs_f64();
            }
            info!(
                epoch = newest,
                base_id = self.base_id,
                "epoch {newest} is LIVE{}",
                took.map(|t| format!(" {} ms after it started", t.as_millis()))
                    .unwrap_or_default()
            );
            self.newest_live = true;
            self.live_since = Some(Instant::now());
            self.forked_at = None;
            self.start_waiting_since = None;
            // Record it now rather than at the next heartbeat.
            self.next_heartbeat = Instant::now();
            self.set_ready(true);
        } else if !live && self.newest_live {
            if higher {
                info!(epoch = newest, %status, "a successor's epoch answers on the admin endpoint");
            } else {
                warn!(epoch = newest, %status, "epoch {newest} no longer answers LIVE on the admin endpoint");
            }
            self.newest_live = false;
            self.live_since = None;
            self.set_ready(false);
        }
    }

    async fn heartbeat(&mut self) {
        let Some(newest) = self.newest else { return };
        let mine = EpochRecord::new(newest, self.base_id, 0, self.cfg.writer.clone());
        let live = self.newest_live;
        let max_age = self.cfg.heartbeat_max_age_ms;
        let state = self.state.clone();
        let result = tokio::task::spawn_blocking(move || {
            state.locked_update(|on_disk| write_decision(on_disk, &mine, live, unix_ms(), max_age))
        })
        .await;
        match result {
            Ok(Ok((_, WriteDecision::Write { record, reason }))) => {
                debug!(%record, %reason, "state file written");
            }
            Ok(Ok((_, WriteDecision::Skip { reason }))) => {
                debug!(%reason, "state file not written")
            }
            Ok(Ok((_, decision @ WriteDecision::Yield { .. }))) => {
                info!(%decision, "another supervisor took the chain over; our epochs drain and are shut down by it");
                self.become_superseded();
            }
            Ok(Err(e)) => {
                error!(error = %e, dir = %self.state.path().display(), "state file update failed")
            }
            Err(e) => error!(error = %e, "state file update task failed"),
        }
    }

    fn become_superseded(&mut self) {
        if self.superseded.is_none() {
            self.superseded = Some(Instant::now());
            self.newest_live = false;
            self.set_ready(false);
            self.publish_metrics();
        }
    }

    fn on_trigger(&mut self, what: &str) {
        if self.shutdown.is_some() || self.superseded.is_some() {
            info!("{what} ignored: the supervisor is stopping");
            return;
        }
        let now = MonoMs(self.mono_ms(Instant::now()));
        self.gate.trigger(now);
        self.metrics.triggers = self.gate.triggers();
        info!(
            "{what}: hot restart requested (debounce {} ms)",
            self.gate.debounce_ms()
        );
    }

    fn on_config_event(&mut self) {
        let hash = match std::fs::read(&self.cfg.config) {
            Ok(bytes) => ContentHash::of(&bytes),
            Err(e) => {
                debug!(error = %e, "config file changing (not readable yet)");
                return;
            }
        };
        if self.config_hash == Some(hash) {
            debug!("config file event without a content change");
            return;
        }
        self.config_hash = Some(hash);
        self.on_trigger("config file changed");
    }

    async fn hot_restart(&mut self) {
        let Some(newest) = self.newest else { return };
        let Some(next) = newest.checked_add(1) else {
            error!("epoch {newest} is the last possible one; restart the supervisor for epoch 0");
            return;
        };
        if let Err(e) = self.envoy.validate(self.cfg.validate_timeout).await {
            self.metrics.validation_failures += 1;
            self.publish_metrics();
            error!(
                config = %self.cfg.config.display(),
                "config rejected by envoy --mode validate; NOT restarting, epoch {newest} keeps \
                 serving the previous config: {e}"
            );
            return;
        }
        info!(
            "hot restart: epoch {newest} -> {next} on base id {}",
            self.base_id
        );
        if self.fork(next) {
            self.metrics.restarts_trigger += 1;
            self.publish_metrics();
        }
    }

    /// Starts epoch `epoch` on `self.base_id`. Returns whether it started.
    fn fork(&mut self, epoch: u32) -> bool {
        let mut child = match self.envoy.spawn(epoch, self.base_id) {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, bin = %self.cfg.envoy_bin.display(), "could not start Envoy epoch {epoch}");
                return false;
            }
        };
        let Some(pid) = child.id() else {
            return false;
        };
        let pid = Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
        let tx = self.exits_tx.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = tx.send((epoch, status));
        });
        info!(
            epoch,
            base_id = self.base_id,
            pid = pid.as_raw(),
            "started Envoy epoch {epoch}"
        );
        self.children.insert(epoch, ChildInfo { pid });
        self.newest = Some(epoch);
        self.newest_live = false;
        self.live_since = None;
        self.forked_at = Some(Instant::now());
        self.next_live_probe = Instant::now() + LIVE_PROBE_EVERY;
        self.set_ready(false);
        self.metrics.current_epoch = i64::from(epoch);
        self.metrics.base_id = self.base_id;
        self.metrics.children = self.children.len() as u64;
        self.publish_metrics();
        true
    }

    /// Starts the chain (at startup), or restarts it after the newest epoch died.
    async fn respawn(&mut self) -> Result<(), SupervisorError> {
        if let Err(e) = self.envoy.validate(self.cfg.validate_timeout).await {
            self.metrics.validation_failures += 1;
            self.publish_metrics();
            let msg = format!(
                "config {} rejected by envoy --mode validate: {e}",
                self.cfg.config.display()
            );
            if self.newest.is_none() {
                return Err(SupervisorError::InvalidConfig(msg));
            }
            return self.fail_start(msg);
        }
        // An epoch of ours survives: hot restart from it.
        if let Some((&survivor, _)) = self.children.iter().next_back() {
            let next = survivor.saturating_add(1);
            info!("restarting: hot restart from surviving epoch {survivor} to {next}");
            self.newest = Some(survivor);
            if self.fork(next) {
                self.metrics.restarts_crash += 1;
                return Ok(());
            }
            return self.fail_start(format!("could not start epoch {next}"));
        }
        // None survives: the cross-process start decision.
        let read = self.state.read();
        let on_disk = match &read {
            Ok(ReadRecord::Record(r)) => Some(r.clone()),
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
        let input = start_input(on_disk.as_ref(), &self.cfg.writer);
        let status = self.admin.probe().await;
        let decision = start_epoch(input, unix_ms(), self.cfg.heartbeat_max_age_ms, status);
        match decision {
            StartDecision::Start { epoch, base_id, .. } => {
                info!(%decision, "start decision");
                self.base_id = base_id.resolve(self.cfg.base_id);
                let first = self.newest.is_none();
                if !self.fork(epoch) {
                    return self.fail_start(format!("could not start epoch {epoch}"));
                }
                if !first {
                    self.metrics.restarts_crash += 1;
                }
                Ok(())
            }
            StartDecision::Wait { until_ms, .. } => {
                let since = *self.start_waiting_since.get_or_insert_with(Instant::now);
                if since.elapsed() > self.cfg.start_timeout {
                    return Err(SupervisorError::CannotStart(format!(
                        "still cannot start after {:?}: {decision}",
                        self.cfg.start_timeout
                    )));
                }
                info!(%decision, "start decision");
                let wait = Duration::from_millis(until_ms.saturating_sub(unix_ms()).max(10));
                self.respawn_at = Some(Instant::now() + wait);
                Ok(())
            }
            StartDecision::Refuse { .. } => Err(SupervisorError::CannotStart(decision.to_string())),
        }
    }

    /// A start attempt failed without a process: count it like a death.
    fn fail_start(&mut self, why: String) -> Result<(), SupervisorError> {
        self.failures += 1;
        if self.failures > self.cfg.max_restarts {
            return Err(SupervisorError::GaveUp(format!(
                "Envoy could not be restarted {} times in a row; last: {why}",
                self.failures
            )));
        }
        self.schedule_respawn(&why);
        Ok(())
    }

    fn schedule_respawn(&mut self, why: &str) {
        let delay = self.backoff.next_delay(jitter());
        warn!(
            attempt = self.failures,
            max = self.cfg.max_restarts,
            "restarting in {} ms: {why}",
            delay.as_millis()
        );
        self.respawn_at = Some(Instant::now() + delay);
    }

    fn on_exit(
        &mut self,
        epoch: u32,
        status: io::Result<ExitStatus>,
    ) -> Result<(), SupervisorError> {
        self.children.remove(&epoch);
        self.metrics.children = self.children.len() as u64;
        let how = match &status {
            Ok(s) => describe_exit(*s),
            Err(e) => format!("wait failed: {e}"),
        };
        let clean = matches!(&status, Ok(s) if s.success());
        if self.shutdown.is_some() || self.superseded.is_some() {
            info!(epoch, "Envoy epoch {epoch} exited ({how})");
            if matches!(self.shutdown, Some(Shutdown::Terminating { .. })) {
                self.signal_newest_alive(Signal::SIGTERM);
            }
            self.publish_metrics();
            return Ok(());
        }
        if self.newest != Some(epoch) {
            if clean {
                info!(
                    epoch,
                    "Envoy epoch {epoch} exited ({how}): shut down by its successor"
                );
            } else {
                warn!(
                    epoch,
                    "draining Envoy epoch {epoch} exited abnormally ({how})"
                );
            }
            self.publish_metrics();
            return Ok(());
        }
        self.newest_live = false;
        self.live_since = None;
        self.forked_at = None;
        self.set_ready(false);
        let on_disk = self.state.read().ok().and_then(|r| r.record().cloned());
        let ours = EpochRecord::new(epoch, self.base_id, 0, self.cfg.writer.clone());
        let decision = after_newest_exit(
            on_disk.as_ref(),
            &ours,
            self.failures + 1,
            self.cfg.max_restarts,
            unix_ms(),
            self.cfg.heartbeat_max_age_ms,
        );
        match decision {
            AfterExit::Superseded { by } => {
                info!(
                    epoch,
                    "Envoy epoch {epoch} exited ({how}): superseded by {by}"
                );
                self.become_superseded();
            }
            AfterExit::Restart { attempt, .. } => {
                self.failures = attempt;
                error!(
                    epoch,
                    "the newest Envoy epoch {epoch} died unexpectedly ({how})"
                );
                self.schedule_respawn(&format!("epoch {epoch} died ({how})"));
            }
            AfterExit::GiveUp { failures } => {
                self.signal_all(Signal::SIGTERM);
                return Err(SupervisorError::GaveUp(format!(
                    "the newest Envoy epoch died {failures} times in a row (last: epoch {epoch}, \
                     {how}); giving up. Check Envoy's log above and the config {}",
                    self.cfg.config.display()
                )));
            }
        }
        self.publish_metrics();
        Ok(())
    }

    fn on_shutdown_signal(&mut self, name: &str) {
        if self.shutdown.is_some() {
            info!("{name} again: already stopping");
            return;
        }
        self.set_ready(false);
        self.respawn_at = None;
        let handoff =
            !self.newest_live && self.newest.is_some_and(|n| self.children.contains_key(&n));
        if handoff && self.superseded.is_none() {
            info!(
                "{name}: a hot restart is in progress; waiting up to {:?} for it to finish",
                self.cfg.handoff_timeout
            );
            self.shutdown = Some(Shutdown::WaitHandoff {
                deadline: Instant::now() + self.cfg.handoff_timeout,
            });
        } else {
            info!("{name}: draining and stopping");
            // Drained immediately on the next tick.
            self.shutdown = Some(Shutdown::WaitHandoff {
                deadline: Instant::now(),
            });
        }
    }

    async fn drive_shutdown(&mut self, stage: Shutdown) -> Option<Exit> {
        let now = Instant::now();
        if self.children.is_empty() {
            return Some(Exit::Terminated);
        }
        match stage {
            Shutdown::WaitHandoff { deadline } => {
                let newest_alive = self.newest.is_some_and(|n| self.children.contains_key(&n));
                if self.newest_live || !newest_alive || now >= deadline {
                    if !self.newest_live && newest_alive {
                        warn!("the handoff did not finish in time; stopping all epochs");
                    }
                    self.start_drain().await;
                }
            }
            Shutdown::Draining { until } if now >= until => {
                // Newest first: a hot-restart child that shuts down talks to its
                // parent, and retries for seconds if the parent is already gone.
                info!("drain time over: stopping Envoy epochs, newest first");
                self.signal_newest_alive(Signal::SIGTERM);
                self.shutdown = Some(Shutdown::Terminating {
                    kill_at: now + self.cfg.shutdown_margin,
                });
            }
            Shutdown::Terminating { kill_at } if now >= kill_at => {
                warn!("Envoy epochs still running after SIGTERM; sending SIGKILL");
                self.signal_all(Signal::SIGKILL);
                self.shutdown = Some(Shutdown::Killed);
            }
            _ => {}
        }
        None
    }

    async fn start_drain(&mut self) {
        // Only drain through the admin endpoint if it answers for our newest epoch
        // (never drain a successor's Envoy).
        let ours = matches!(
            self.admin.server_info().await,
            Ok(info) if Some(info.epoch) == self.newest && info.base_id == self.base_id
        );
        let drain = Duration::from_secs(self.cfg.drain_time_s);
        if ours && self.superseded.is_none() {
            match self.admin.drain_listeners_gracefully().await {
                Ok(()) => info!("draining listeners for {drain:?}"),
                Err(e) => warn!(error = %e, "drain_listeners failed; stopping without a drain"),
            }
            self.shutdown = Some(Shutdown::Draining {
                until: Instant::now() + drain,
            });
        } else {
            self.shutdown = Some(Shutdown::Draining {
                until: Instant::now(),
            });
        }
    }

    fn signal_newest_alive(&self, sig: Signal) {
        if let Some((epoch, child)) = self.children.iter().next_back()
            && let Err(e) = kill(child.pid, sig)
        {
            debug!(epoch, error = %e, "signal {sig} not delivered");
        }
    }

    fn signal_all(&self, sig: Signal) {
        for (epoch, child) in &self.children {
            if let Err(e) = kill(child.pid, sig) {
                debug!(epoch, error = %e, "signal {sig} not delivered");
            }
        }
    }

    fn finish(&mut self, exit: Exit) {
        self.set_ready(false);
        self.metrics.live = false;
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
        self.set_ready(false);
        self.metrics.live = false;
        self.publish_metrics();
        self.remove_shared_memory();
        info!("flock-supervisor giving up");
    }

    /// Our chain is over: Envoy leaves its shared memory behind; remove it (if we ever
    /// started an epoch on `self.base_id`).
    fn remove_shared_memory(&self) {
        if self.newest.is_none() {
            return;
        }
        let shm = shared_memory_path(self.base_id);
        if std::fs::remove_file(&shm).is_ok() {
            debug!(file = %shm.display(), "removed Envoy's shared memory");
        }
    }

    fn set_ready(&mut self, live: bool) {
        self.metrics.live = live;
        if let Some(path) = &self.cfg.ready_file {
            let epoch = if live { self.newest } else { None };
            if let Err(e) = set_ready_file(path, epoch) {
                error!(error = %e, file = %path.display(), "ready file update failed");
            }
        }
        self.publish_metrics();
    }

    fn publish_metrics(&self) {
        if let Some(path) = &self.cfg.metrics_file
            && let Err(e) = self.metrics.write_textfile(path)
        {
            warn!(error = %e, file = %path.display(), "metrics file update failed");
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A uniform sample in `[0, 1)` for the backoff (std's randomly keyed hasher).
fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(unix_ms());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}
