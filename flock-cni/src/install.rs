//! The `flock-install-cni` daemon: keeps flock's plugin chained into every primary CNI
//! config of a directory, and takes it out again on exit.
//!
//! It only performs I/O. Every decision — what a file should contain, whether it may be
//! written now, what state it is in, when to retry, when the daemon is ready — is taken
//! by the sans-IO machine [`flock_core::cniconf::installer::Installer`]; this module
//! feeds it events (with the monotonic time, read once per event) and performs the
//! reads, listings, atomic writes and removals it asks for ([`Io`](flock_core::cniconf::installer::Io)).
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
//!    file twice is harmless because decisions are per file and idempotent). An event
//!    queued after the listing was taken reaches the machine before the listing, and
//!    is handled, not dropped: the listing does not hold that file.
//! 4. The event loop (`watch` feeds it): each event goes into the machine, then every
//!    request the machine makes is performed (`perform`) and its result fed back; between events
//!    the loop sleeps until the machine's next deadline (retries, throttling, resync).
//! 5. SIGTERM/SIGINT or a fatal error: `exit` unpatches every config (a `.conf` we
//!    converted goes back to being a `.conf`), removes drop-ins, stale temp files, the
//!    plugin binary and the ready file.

mod exit;
mod files;
mod perform;
mod watch;

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use flock_clock::{mono_instant, mono_now};
use flock_core::cniconf::installer::{Event, Installer, Settings};
use flock_core::cniconf::{ConfPolicy, InstallPolicy, OurPlugin};
use nix::sys::signal::{SigSet, Signal};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tracing::{error, info};

use files::{Perm, Replace, write_atomic};

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

/// A test hook that runs at one point of the daemon's startup.
pub type Hook = Arc<dyn Fn() + Send + Sync>;

/// A test hook the watch thread calls with the name of each entry whose change it
/// queued.
pub type QueuedHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Points where a test can act inside the daemon's startup. Empty in the binary.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs exactly between arming the watch and listing the directory for the first
    /// scan: a test creates a config here to show that one created in that window is
    /// still patched.
    pub between_arm_and_scan: Option<Hook>,
    /// Runs exactly between listing the directory for the first scan and handing that
    /// listing to the event loop: a config created here is in no listing, only in
    /// the watch's event, which the loop receives before the listing.
    pub between_listing_and_listed: Option<Hook>,
    /// Runs on the watch thread each time it has queued a change of the named entry
    /// for the event loop: a test waits on it to know an event is queued.
    pub watch_queued: Option<QueuedHook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("between_arm_and_scan", &self.between_arm_and_scan.is_some())
            .field(
                "between_listing_and_listed",
                &self.between_listing_and_listed.is_some(),
            )
            .field("watch_queued", &self.watch_queued.is_some())
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
/// error (then `Err`, after restoring what it can), on a single-threaded runtime of its
/// own.
pub fn run(config: Config) -> Result<(), InstallError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| InstallError(format!("cannot start the event loop's runtime: {e}")))?
        .block_on(run_async(config))
}

/// [`run`] on the caller's runtime. The event loop sleeps until the machine's deadlines
/// on tokio's clock, so on a paused clock (a test) time moves only when the test moves
/// it. It blocks the thread it runs on while it performs file I/O: give it a runtime
/// (or a thread) of its own.
pub async fn run_async(config: Config) -> Result<(), InstallError> {
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

    let (tx, mut rx) = mpsc::unbounded_channel::<Work>();
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
    let queued = daemon.cfg.hooks.watch_queued.clone();
    // Arm the watch, then list: both feed `tx`, one queue. Events the watch queues
    // after the listing was taken reach the loop before the listing does; the machine
    // reads them like any other (the listing does not hold their files).
    let startup = if flock_core::reintroduced!("install-scan-before-arm") {
        // Mutant: list first, arm afterwards. A config created in between is in neither.
        list_for_scan(&daemon.dir).and_then(|names| {
            between();
            watch::arm(&daemon.dir, tx.clone(), queued).map(|()| names)
        })
    } else {
        watch::arm(&daemon.dir, tx.clone(), queued).and_then(|()| {
            between();
            list_for_scan(&daemon.dir)
        })
    };
    match startup {
        Ok(names) => {
            info!(dir = %daemon.dir.display(), files = names.len(), "watch armed; scanning");
            daemon.machine.handle(mono_now(), Event::WatchArmed);
            if let Some(hook) = &daemon.cfg.hooks.between_listing_and_listed {
                hook();
            }
            let _ = tx.send(Work::Listed(names));
        }
        Err(e) => {
            daemon.shutdown();
            return Err(e);
        }
    }
    drop(tx);
    daemon.event_loop(&mut rx).await
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
        write_atomic(
            &self.cfg.bin_dir,
            &name,
            &bytes,
            Perm::Mode(0o755),
            Replace::Any,
        )
        .map_err(|e| {
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
    async fn event_loop(&mut self, rx: &mut UnboundedReceiver<Work>) -> Result<(), InstallError> {
        let mut now = mono_now();
        loop {
            self.perform_all(now);
            let deadline = mono_instant(self.machine.poll_timeout());
            let work = tokio::select! {
                work = rx.recv() => Some(work),
                () = tokio::time::sleep_until(deadline) => None,
            };
            now = mono_now();
            let event = match work {
                Some(Some(Work::Changed(name))) => Event::Changed(name),
                Some(Some(Work::Listed(names))) => Event::Listed(names),
                Some(Some(Work::Overflow)) => Event::Overflow,
                Some(Some(Work::Signal(sig))) => {
                    info!(signal = %sig, "signal received: restoring the config directory and exiting");
                    return if self.shutdown() {
                        Ok(())
                    } else {
                        Err(InstallError(
                            "exited on signal, but some files could not be restored (see the errors above)".into(),
                        ))
                    };
                }
                Some(Some(Work::Fatal(msg))) => {
                    error!(error = %msg, "fatal: restoring the config directory and exiting");
                    self.shutdown();
                    return Err(InstallError(msg));
                }
                None => {
                    self.machine.handle_timeout(now);
                    continue;
                }
                Some(None) => {
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
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
