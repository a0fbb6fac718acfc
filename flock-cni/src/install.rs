//! The `flock-install-cni` daemon: keeps flock's plugin chained into every primary CNI
//! config of a directory, and takes it out again on exit.
//!
//! It only performs I/O. Every decision — what a file should contain, whether it may be
//! written now, what state it is in, when to retry, when the daemon is ready — is taken
//! by the sans-IO machine [`flock_core::cniconf::installer::Installer`]; this module
//! feeds it events (with the monotonic time, read once per event) and performs the
//! reads, listings, atomic writes and removals it asks for ([`Io`]).
//!
//! # Order of operations
//!
//! 1. Install the plugin binary atomically (temp file, fsync, rename, fsync directory).
//! 2. Remove stale temp files of an earlier run (`.<name>.flock-tmp`, never loaded by a
//!    runtime).
//! 3. **Arm the inotify watch, then scan.** A config created between a scan and a
//!    later arm would be seen by neither and stay unpatched. Armed first, the watch
//!    thread and the scan feed one queue consumed by one thread: a config created
//!    during startup is in the scan or produces an event (both, at worst; handling a
//!    file twice is harmless because decisions are per file and idempotent).
//! 4. The event loop ([`watch`] feeds it): each event goes into the machine, then every
//!    request the machine makes is performed and its result fed back; between events
//!    the loop sleeps until the machine's next deadline (retries, throttling, resync).
//! 5. SIGTERM/SIGINT or a fatal error: [`exit`] unpatches every config (a `.conf` we
//!    converted goes back to being a `.conf`), removes drop-ins, stale temp files, the
//!    plugin binary and the ready file.

mod exit;
mod files;
mod watch;

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Duration;

use flock_clock::mono_now;
use flock_core::cniconf::installer::{
    Event, Expect, FileState, Installer, Io, Notice, Perm as WritePerm, Settings, Write, WriteKind,
    WriteOutcome,
};
use flock_core::cniconf::{ConfPolicy, InstallPolicy, OurPlugin};
use flock_core::time::MonoMs;
use nix::sys::signal::{SigSet, Signal};
use tracing::{debug, error, info, warn};

use files::{Perm, remove_if_exists, sync_dir, write_atomic};

pub use flock_core::cniconf::installer::Mode;

/// What to leave behind on SIGTERM/SIGINT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExit {
    /// Unpatch every config and remove the plugin binary: no trace.
    Restore,
    /// Leave configs patched and the binary installed, so pods created while flock is
    /// down (e.g. during an upgrade) fail closed instead of starting unmeshed.
    Keep,
}

/// Points where a test can act inside the daemon's startup. Empty in the binary.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs exactly between arming the watch and listing the directory for the first
    /// scan: a test creates a config here to show that one created in that window is
    /// still patched.
    pub between_arm_and_scan: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("between_arm_and_scan", &self.between_arm_and_scan.is_some())
            .finish()
    }
}

/// The daemon's settings (the binary's flags).
#[derive(Debug, Clone)]
pub struct Config {
    /// `--cni-conf-dir`.
    pub conf_dir: PathBuf,
    /// `--cni-bin-dir`.
    pub bin_dir: PathBuf,
    /// `--plugin-bin`.
    pub plugin_bin: PathBuf,
    /// `--plugin-config`.
    pub ours: OurPlugin,
    /// `--mode`.
    pub mode: Mode,
    /// `--conf-policy`.
    pub conf_policy: ConfPolicy,
    /// `--ready-file`.
    pub ready_file: Option<PathBuf>,
    /// `--on-exit`.
    pub on_exit: OnExit,
    /// `--resync-seconds`: a full rescan this often (level-triggered repair).
    pub resync: Duration,
    /// `--max-write-burst`: writes per file before throttling.
    pub write_burst: u32,
    /// `--write-interval-ms`: then at most one write per file per interval.
    pub write_interval: Duration,
    /// Test hooks; `Hooks::default()` outside tests.
    pub hooks: Hooks,
}

/// A fatal error: the daemon restored what it could and must exit non-zero.
#[derive(Debug)]
pub struct InstallError(pub String);

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InstallError {}

/// What the event loop's one queue carries.
enum Work {
    /// The watch named an entry.
    Changed(String),
    /// The first scan's listing.
    Listed(Vec<String>),
    /// The watch lost events.
    Overflow,
    Signal(Signal),
    Fatal(String),
}

/// Runs the daemon until SIGTERM/SIGINT (then `Ok` after a complete restore) or a fatal
/// error (then `Err`, after restoring what it can).
pub fn run(config: Config) -> Result<(), InstallError> {
    // Block the signals before any thread exists, so every thread inherits the mask
    // and only the signal thread receives them (sigwait).
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals
        .thread_block()
        .map_err(|e| InstallError(format!("cannot block SIGTERM/SIGINT: {e}")))?;

    let mut daemon = Daemon::new(config)?;
    if let Err(e) = daemon.install_binary() {
        daemon.shutdown();
        return Err(e);
    }
    files::remove_stale_temp_files(&daemon.dir, &daemon.cfg.bin_dir);

    let (tx, rx) = mpsc::channel::<Work>();
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if let Ok(sig) = signals.wait() {
                    let _ = tx.send(Work::Signal(sig));
                }
            })
            .map_err(|e| InstallError(format!("cannot start the signal thread: {e}")))?;
    }
    let between = || {
        if let Some(hook) = &daemon.cfg.hooks.between_arm_and_scan {
            hook();
        }
    };
    // Arm the watch, then list: both feed `tx`, one queue.
    #[cfg(not(flock_reintroduce = "install-scan-before-arm"))]
    let startup = watch::arm(&daemon.dir, tx.clone()).and_then(|()| {
        between();
        list_for_scan(&daemon.dir)
    });
    // Mutant: list first, arm afterwards. A config created in between is in neither.
    #[cfg(flock_reintroduce = "install-scan-before-arm")]
    let startup = list_for_scan(&daemon.dir).and_then(|names| {
        between();
        watch::arm(&daemon.dir, tx.clone()).map(|()| names)
    });
    match startup {
        Ok(names) => {
            info!(dir = %daemon.dir.display(), files = names.len(), "watch armed; scanning");
            daemon.machine.handle(mono_now(), Event::WatchArmed);
            let _ = tx.send(Work::Listed(names));
        }
        Err(e) => {
            daemon.shutdown();
            return Err(e);
        }
    }
    drop(tx);
    daemon.event_loop(&rx)
}

fn list_for_scan(dir: &std::path::Path) -> Result<Vec<String>, InstallError> {
    files::list_config_names(dir)
        .map_err(|e| InstallError(format!("cannot list {}: {e}", dir.display())))
}

struct Daemon {
    cfg: Config,
    /// The canonical config directory: every path we write is inside it.
    dir: PathBuf,
    machine: Installer,
    installed_bin: Option<PathBuf>,
    writes: u64,
}

impl Daemon {
    fn new(cfg: Config) -> Result<Self, InstallError> {
        let dir = fs::canonicalize(&cfg.conf_dir).map_err(|e| {
            InstallError(format!(
                "--cni-conf-dir {}: {e} (the directory must exist)",
                cfg.conf_dir.display()
            ))
        })?;
        if !fs::metadata(&dir).map(|m| m.is_dir()).unwrap_or(false) {
            return Err(InstallError(format!(
                "--cni-conf-dir {} is not a directory",
                cfg.conf_dir.display()
            )));
        }
        if dir != cfg.conf_dir {
            info!(given = %cfg.conf_dir.display(), real = %dir.display(),
                  "config directory path is not canonical (a symlink?); watching and writing only inside the real directory");
        }
        let settings = Settings {
            policy: InstallPolicy {
                ours: cfg.ours.clone(),
                conf_policy: cfg.conf_policy,
            },
            mode: cfg.mode,
            write_burst: cfg.write_burst,
            write_interval_ms: millis(cfg.write_interval),
            resync_ms: millis(cfg.resync),
        };
        Ok(Self {
            machine: Installer::new(settings, mono_now()),
            cfg,
            dir,
            installed_bin: None,
            writes: 0,
        })
    }

    fn install_binary(&mut self) -> Result<(), InstallError> {
        let bytes = fs::read(&self.cfg.plugin_bin).map_err(|e| {
            InstallError(format!(
                "cannot read the plugin binary --plugin-bin {}: {e}",
                self.cfg.plugin_bin.display()
            ))
        })?;
        fs::create_dir_all(&self.cfg.bin_dir).map_err(|e| {
            InstallError(format!(
                "cannot create --cni-bin-dir {}: {e}",
                self.cfg.bin_dir.display()
            ))
        })?;
        let name = self.cfg.ours.plugin_type().to_owned();
        let dest = self.cfg.bin_dir.join(&name);
        write_atomic(&self.cfg.bin_dir, &name, &bytes, Perm::Mode(0o755), None).map_err(|e| {
            InstallError(format!(
                "cannot install the plugin as {}: {e}",
                dest.display()
            ))
        })?;
        info!(binary = %dest.display(), bytes = bytes.len(), "installed plugin binary");
        self.installed_bin = Some(dest);
        Ok(())
    }

    /// One event at a time: read the clock once, feed the machine, perform what it
    /// asks for, sleep until its next deadline or the next event.
    fn event_loop(&mut self, rx: &Receiver<Work>) -> Result<(), InstallError> {
        let mut now = mono_now();
        loop {
            self.perform_all(now);
            let wait = Duration::from_millis(self.machine.poll_timeout().since(now));
            let work = rx.recv_timeout(wait);
            now = mono_now();
            let event = match work {
                Ok(Work::Changed(name)) => Event::Changed(name),
                Ok(Work::Listed(names)) => Event::Listed(names),
                Ok(Work::Overflow) => Event::Overflow,
                Ok(Work::Signal(sig)) => {
                    info!(signal = %sig, "signal received: restoring the config directory and exiting");
                    return if self.shutdown() {
                        Ok(())
                    } else {
                        Err(InstallError(
                            "exited on signal, but some files could not be restored (see the errors above)".into(),
                        ))
                    };
                }
                Ok(Work::Fatal(msg)) => {
                    error!(error = %msg, "fatal: restoring the config directory and exiting");
                    self.shutdown();
                    return Err(InstallError(msg));
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.machine.handle_timeout(now);
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let msg = "the inotify watch stopped: refusing to run unwatched".to_owned();
                    error!("{msg}");
                    self.shutdown();
                    return Err(InstallError(msg));
                }
            };
            self.machine.handle(now, event);
            self.machine.handle_timeout(now);
        }
    }

    /// Performs every request of the machine, feeding each result back, until it has
    /// none left.
    fn perform_all(&mut self, now: MonoMs) {
        while let Some(io) = self.machine.poll_io() {
            match io {
                Io::Read(name) => {
                    let entry = files::read_entry(&self.dir.join(&name));
                    self.machine.handle(now, Event::Observed { name, entry });
                }
                Io::List => match files::list_config_names(&self.dir) {
                    Ok(names) => {
                        debug!(files = names.len(), "rescanning");
                        self.machine.handle(now, Event::Listed(names));
                    }
                    Err(e) => warn!(error = %e, "rescan: cannot list the config directory"),
                },
                Io::Write(write) => {
                    let outcome = self.write(&write);
                    self.machine.handle(now, Event::Written { write, outcome });
                }
                Io::Remove(name) => {
                    if let Err(e) =
                        fs::remove_file(self.dir.join(&name)).and_then(|()| sync_dir(&self.dir))
                    {
                        warn!(file = name, error = %e, "wrote the converted list but cannot remove the .conf");
                    }
                }
                Io::ProbeDropIn { primary, dropin } => {
                    let dir = files::probe_dropin_dir(
                        &self.dir.join(&dropin.dir_name),
                        &dropin.file_name,
                    );
                    self.machine.handle(
                        now,
                        Event::DropInProbed {
                            primary,
                            dropin,
                            dir,
                        },
                    );
                }
                Io::RemoveDropIn {
                    dir_name,
                    file_name,
                    remove_dir,
                } => files::remove_dropin(&self.dir, &dir_name, &file_name, remove_dir),
                Io::Ready {
                    ready,
                    patched,
                    waiting_for,
                } => self.set_ready(ready, patched, &waiting_for),
                Io::Notice(notice) => self.log(notice),
            }
        }
    }

    /// Performs one write the machine asked for, under its condition.
    fn write(&mut self, w: &Write) -> WriteOutcome {
        let (dir, name) = match w.path.rsplit_once('/') {
            Some((sub, name)) => (self.dir.join(sub), name),
            None => (self.dir.clone(), w.path.as_str()),
        };
        let result = (|| {
            if let WriteKind::DropIn {
                create_dir: true, ..
            } = w.kind
            {
                match fs::create_dir(&dir) {
                    Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                    _ => sync_dir(&self.dir)?,
                }
            }
            let like;
            let perm = match w.perm() {
                WritePerm::Like(n) => {
                    like = fs::symlink_metadata(self.dir.join(n))?;
                    Perm::Like(&like)
                }
                WritePerm::Mode(m) => Perm::Mode(m),
            };
            let expect = match &w.expect {
                Expect::Absent if fs::symlink_metadata(dir.join(name)).is_ok() => {
                    return Ok(false);
                }
                Expect::Absent | Expect::Anything => None,
                Expect::Holds(bytes) => Some(bytes.as_slice()),
            };
            write_atomic(&dir, name, &w.bytes, perm, expect)
        })();
        match result {
            Ok(true) => {
                self.writes += 1;
                self.log_write(w);
                WriteOutcome::Written
            }
            Ok(false) => {
                debug!(file = %w.path, "changed while we wrote it (or is not ours); deciding again");
                WriteOutcome::ConditionFailed
            }
            Err(e) => {
                error!(file = %w.path, error = %e, "cannot write config; retrying in 1 s");
                WriteOutcome::Failed(e.to_string())
            }
        }
    }

    fn log_write(&self, w: &Write) {
        let bytes = w.bytes.len();
        let writes = self.writes;
        match &w.kind {
            WriteKind::Patch => info!(file = %w.path, bytes, writes, "wrote config"),
            WriteKind::Convert { conf_name } => info!(
                file = %w.path, from = %conf_name, bytes, writes,
                "wrote config (converted a single-plugin .conf into a .conflist)"
            ),
            WriteKind::DropIn {
                primary, dropin, ..
            } => {
                info!(file = %w.path, primary = %primary, writes, "wrote config (drop-in)");
                if let Ok(entries) = fs::read_dir(self.dir.join(&dropin.dir_name)) {
                    let names: Vec<String> = entries
                        .flatten()
                        .filter_map(|e| e.file_name().into_string().ok())
                        .collect();
                    if !dropin.sorts_last_among(names.iter().map(String::as_str)) {
                        warn!(dir = %dropin.dir_name, "another drop-in sorts after flock's: flock is not last in the chain");
                    }
                }
            }
        }
    }

    fn set_ready(&self, ready: bool, patched: usize, waiting_for: &[String]) {
        if ready {
            info!(
                patched,
                "ready: every primary config is patched and the watch is armed"
            );
        } else {
            warn!(patched, waiting_for = ?waiting_for, "not ready");
        }
        let Some(path) = &self.cfg.ready_file else {
            return;
        };
        let result = if ready {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
                _ => PathBuf::from("."),
            };
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            write_atomic(
                &dir,
                &name,
                format!("patched {patched}\n").as_bytes(),
                Perm::Mode(0o644),
                None,
            )
            .map(|_| ())
        } else {
            remove_if_exists(path)
        };
        if let Err(e) = result {
            error!(file = %path.display(), error = %e, "cannot update the ready file");
        }
    }

    fn log(&self, notice: Notice) {
        match notice {
            Notice::State { name, old, new } => match &new {
                FileState::Patched => debug!(file = name, "patched"),
                FileState::Pending(why) => info!(file = name, reason = %why, "not patched yet"),
                FileState::Partial(why) => {
                    if !matches!(old, Some(FileState::Partial(_))) {
                        info!(file = name, reason = %why, "not patched yet");
                    }
                }
                FileState::Throttled => {}
                FileState::Blocked(why) => {
                    warn!(file = name, reason = %why, "primary config NOT patched; pods on this network start without flock until this is fixed")
                }
                FileState::Invalid(why) => warn!(file = name, reason = %why, "skipped"),
            },
            Notice::Removed(name) => info!(file = name, "config removed"),
            Notice::ThrottleStarted(name) => warn!(
                file = name,
                burst = self.cfg.write_burst,
                interval_ms = millis(self.cfg.write_interval),
                "another agent keeps rewriting this config (a primary CNI that owns the directory?): \
                 throttling re-patches to one per interval after a burst; not ready until it settles"
            ),
            Notice::ThrottleEnded(name) => {
                info!(file = name, "write budget available again; re-patching")
            }
            Notice::ScanDone(files) => info!(files, "initial scan done"),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
