//! The `flock-install-cni` daemon: keeps flock's plugin chained into every primary CNI
//! config of a directory, and takes it out again on exit.
//!
//! It only *executes* decisions: every "what should this file contain" answer comes
//! from [`flock_core::cniconf`] ([`decide`], [`unpatch`], [`dropin`]) and every "may I
//! write now" answer from [`flock_core::ratelimit`]. This module reads files, writes
//! them atomically, keeps the per-file [`Ledger`] and the readiness file.
//!
//! # Order of operations (the fixes for seed 2 and its relatives)
//!
//! 1. Install the plugin binary atomically (temp file, fsync, rename, fsync directory).
//! 2. Remove stale temp files of an earlier run (`.<name>.flock-tmp`; never loaded by a
//!    runtime, see [`temp_file_name_for`]).
//! 3. **Arm the inotify watch, then scan.** The watch thread and the scan feed one
//!    queue, consumed by one thread: a config created during startup is either in the
//!    scan or produces an event after the watch is armed (both, at worst; handling a
//!    file twice is harmless because decisions are per file and idempotent).
//! 4. For each queued file name: read its current bytes (never through a symlink for
//!    writing; never blocking on a FIFO), [`decide`], execute, [`Ledger::record`].
//!    Our own writes come back as events and are recognised per file.
//! 5. Readiness file: present only while the watch is armed, the first scan is done,
//!    at least one primary is patched and none is pending (write failed, throttled,
//!    refused or a symlink); empty or truncated files (mid-write) and invalid ones do
//!    not count: runtimes cannot load them either.
//! 6. SIGTERM/SIGINT or a fatal error: unpatch every config in the directory (a `.conf`
//!    we converted goes back to being a `.conf`), remove drop-ins, stale temp files, the
//!    plugin binary and the ready file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use flock_core::cniconf::{
    Action, ConfPolicy, InstallPolicy, Ledger, MAX_CONFIG_BYTES, OurPlugin, SkipReason, count_ours,
    decide, dropin, kind_for_file_name, parse_file, temp_file_name_for, unpatch, unpatch_to_conf,
};
use flock_core::ratelimit::TokenBucket;
use inotify::{EventMask, Inotify, WatchMask};
use nix::sys::signal::{SigSet, Signal};
use tracing::{debug, error, info, warn};

/// How flock's plugin is chained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Append our entry to each primary's `plugins` (any libcni).
    Chained,
    /// Write `<dir>/<network>/zz-flock.conf` drop-ins (libcni >= 1.3 only).
    Subdir,
}

/// What to leave behind on SIGTERM/SIGINT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExit {
    /// Unpatch every config and remove the plugin binary: no trace.
    Restore,
    /// Leave configs patched and the binary installed, so pods created while flock is
    /// down (e.g. during an upgrade) fail closed instead of starting unmeshed.
    Keep,
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

enum Work {
    File(String),
    ScanDone,
    Rescan(&'static str),
    Signal(Signal),
    Fatal(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum FileState {
    /// Holds our entry (or drop-in) as desired.
    Patched,
    /// A write of ours failed; retrying. Blocks readiness.
    Pending(String),
    /// Empty or truncated: another writer is mid-write (or left it so). Not loadable by
    /// runtimes either, so it does not block readiness; patched once complete.
    Partial(String),
    /// Rewritten faster than our write budget. Blocks readiness.
    Throttled,
    /// A primary we will not or cannot patch (refused, symlink, name clash). Blocks
    /// readiness: pods on this network would start without flock.
    Blocked(String),
    /// Not a valid config: runtimes cannot load it either. Does not block readiness.
    Invalid(String),
}

impl FileState {
    fn blocks_readiness(&self) -> bool {
        matches!(self, Self::Pending(_) | Self::Throttled | Self::Blocked(_))
    }
}

/// What reading a directory entry found.
enum Read_ {
    Missing,
    /// A regular file (not a link): its bytes (at most MAX_CONFIG_BYTES + 1) and
    /// metadata.
    File(Vec<u8>, Metadata),
    /// A symlink; the bytes of its target when that is a readable regular file.
    Symlink(PathBuf, io::Result<Vec<u8>>),
    /// A directory, FIFO, socket or device.
    NotRegular,
}

struct DropInRecord {
    dir_name: String,
    file_name: String,
    created_dir: bool,
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
    daemon.remove_stale_temp_files();

    let (tx, rx) = mpsc::channel::<Work>();
    // 1. Arm the watch. 2. Then scan. Both feed `tx`.
    if let Err(e) = daemon.arm_watch(tx.clone()) {
        daemon.shutdown();
        return Err(e);
    }
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
    match daemon.list_dir() {
        Ok(names) => {
            info!(dir = %daemon.dir.display(), files = names.len(), "watch armed; scanning");
            for name in names {
                let _ = tx.send(Work::File(name));
            }
            let _ = tx.send(Work::ScanDone);
        }
        Err(e) => {
            let msg = format!("cannot list {}: {e}", daemon.dir.display());
            daemon.shutdown();
            return Err(InstallError(msg));
        }
    }
    drop(tx);
    daemon.event_loop(&rx)
}

struct Daemon {
    cfg: Config,
    /// The canonical config directory: every path we write is `dir/<plain name>`.
    dir: PathBuf,
    policy: InstallPolicy,
    ledger: Ledger,
    files: BTreeMap<String, FileState>,
    buckets: BTreeMap<String, TokenBucket>,
    throttle_warned: BTreeSet<String>,
    retry_at: BTreeMap<String, Instant>,
    /// `.conflist` we wrote → the `.conf` it replaced.
    conversions: BTreeMap<String, String>,
    /// Primary file → its drop-in (subdir mode).
    dropins: BTreeMap<String, DropInRecord>,
    scan_done: bool,
    ready: Option<bool>,
    installed_bin: Option<PathBuf>,
    start: Instant,
    next_resync: Instant,
    writes: u64,
    own_write_events: u64,
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
        let policy = InstallPolicy {
            ours: cfg.ours.clone(),
            conf_policy: cfg.conf_policy,
        };
        let now = Instant::now();
        Ok(Self {
            next_resync: now + cfg.resync,
            cfg,
            dir,
            policy,
            ledger: Ledger::new(),
            files: BTreeMap::new(),
            buckets: BTreeMap::new(),
            throttle_warned: BTreeSet::new(),
            retry_at: BTreeMap::new(),
            conversions: BTreeMap::new(),
            dropins: BTreeMap::new(),
            scan_done: false,
            ready: None,
            installed_bin: None,
            start: now,
            writes: 0,
            own_write_events: 0,
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.dir.display())
    }

    // ------------------------------------------------------------------ startup

    fn install_binary(&mut self) -> Result<(), InstallError> {
        let fail = |what: String| InstallError(what);
        let bytes = fs::read(&self.cfg.plugin_bin).map_err(|e| {
            fail(format!(
                "cannot read the plugin binary --plugin-bin {}: {e}",
                self.cfg.plugin_bin.display()
            ))
        })?;
        fs::create_dir_all(&self.cfg.bin_dir).map_err(|e| {
            fail(format!(
                "cannot create --cni-bin-dir {}: {e}",
                self.cfg.bin_dir.display()
            ))
        })?;
        let name = self.cfg.ours.plugin_type().to_owned();
        let dest = self.cfg.bin_dir.join(&name);
        write_atomic(&self.cfg.bin_dir, &name, &bytes, Perm::Mode(0o755), None).map_err(|e| {
            fail(format!(
                "cannot install the plugin as {}: {e}",
                dest.display()
            ))
        })?;
        info!(binary = %dest.display(), bytes = bytes.len(), "installed plugin binary");
        self.installed_bin = Some(dest);
        Ok(())
    }

    fn remove_stale_temp_files(&self) {
        let mut dirs = vec![self.dir.clone()];
        if let Ok(entries) = fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    dirs.push(e.path());
                }
            }
        }
        dirs.push(self.cfg.bin_dir.clone());
        for d in dirs {
            let Ok(entries) = fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with('.') && name.ends_with(".flock-tmp") {
                    match fs::remove_file(e.path()) {
                        Ok(()) => {
                            info!(file = %e.path().display(), "removed a stale temp file of an earlier run")
                        }
                        Err(err) => {
                            warn!(file = %e.path().display(), error = %err, "cannot remove stale temp file")
                        }
                    }
                }
            }
        }
    }

    fn arm_watch(&self, tx: Sender<Work>) -> Result<(), InstallError> {
        let inotify =
            Inotify::init().map_err(|e| inotify_error("creating an inotify instance", &e))?;
        inotify
            .watches()
            .add(
                &self.dir,
                WatchMask::CREATE
                    | WatchMask::CLOSE_WRITE
                    | WatchMask::MODIFY
                    | WatchMask::MOVED_TO
                    | WatchMask::MOVED_FROM
                    | WatchMask::DELETE
                    | WatchMask::DELETE_SELF
                    | WatchMask::MOVE_SELF
                    | WatchMask::ONLYDIR,
            )
            .map_err(|e| inotify_error(&format!("watching {}", self.dir.display()), &e))?;
        let dir = self.dir.display().to_string();
        std::thread::Builder::new()
            .name("inotify".into())
            .spawn(move || watch_thread(inotify, &dir, &tx))
            .map_err(|e| InstallError(format!("cannot start the inotify thread: {e}")))?;
        Ok(())
    }

    fn list_dir(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for e in fs::read_dir(&self.dir)? {
            let e = e?;
            if let Ok(name) = e.file_name().into_string()
                && kind_for_file_name(&name).is_some()
            {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    // ------------------------------------------------------------------ loop

    fn event_loop(&mut self, rx: &Receiver<Work>) -> Result<(), InstallError> {
        loop {
            let now = Instant::now();
            let next = self
                .retry_at
                .values()
                .copied()
                .min()
                .map_or(self.next_resync, |t| t.min(self.next_resync));
            match rx.recv_timeout(next.saturating_duration_since(now)) {
                Ok(Work::File(name)) => self.handle(&name),
                Ok(Work::ScanDone) => {
                    self.scan_done = true;
                    info!(files = self.files.len(), "initial scan done");
                }
                Ok(Work::Rescan(why)) => self.rescan(why),
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
                    let now = Instant::now();
                    let due: Vec<String> = self
                        .retry_at
                        .iter()
                        .filter(|(_, t)| **t <= now)
                        .map(|(n, _)| n.clone())
                        .collect();
                    for name in due {
                        self.retry_at.remove(&name);
                        self.handle(&name);
                    }
                    if self.next_resync <= now {
                        self.next_resync = now + self.cfg.resync;
                        self.rescan("periodic resync");
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let msg = "the inotify watch stopped: refusing to run unwatched".to_owned();
                    error!("{msg}");
                    self.shutdown();
                    return Err(InstallError(msg));
                }
            }
            self.update_ready();
        }
    }

    fn rescan(&mut self, why: &'static str) {
        let mut names: BTreeSet<String> = self.files.keys().cloned().collect();
        match self.list_dir() {
            Ok(listed) => names.extend(listed),
            Err(e) => warn!(error = %e, "rescan: cannot list the config directory"),
        }
        debug!(reason = why, files = names.len(), "rescanning");
        for name in names {
            self.handle(&name);
        }
    }

    fn set_state(&mut self, name: &str, state: FileState) {
        let old = self.files.insert(name.to_owned(), state.clone());
        if old.as_ref() == Some(&state) {
            return;
        }
        match &state {
            FileState::Patched => debug!(file = name, "patched"),
            FileState::Pending(why) | FileState::Partial(why) => {
                if !matches!(old, Some(FileState::Partial(_))) {
                    info!(file = name, reason = %why, "not patched yet");
                }
            }
            FileState::Throttled => {}
            FileState::Blocked(why) => {
                warn!(file = name, reason = %why, "primary config NOT patched; pods on this network start without flock until this is fixed")
            }
            FileState::Invalid(why) => warn!(file = name, reason = %why, "skipped"),
        }
    }

    fn handle(&mut self, name: &str) {
        if name.is_empty() || name.contains('/') || kind_for_file_name(name).is_none() {
            return;
        }
        let key = self.key(name);
        match read_entry(&self.dir.join(name)) {
            Read_::Missing => {
                self.ledger.forget(&key);
                self.retry_at.remove(name);
                if self.files.remove(name).is_some() {
                    info!(file = name, "config removed");
                }
                if self.cfg.mode == Mode::Subdir {
                    self.remove_dropin_of(name);
                }
            }
            Read_::NotRegular => self.set_state(
                name,
                FileState::Invalid("not a regular file (directory, FIFO, socket or device)".into()),
            ),
            Read_::Symlink(target, bytes) => {
                let state = match bytes {
                    Err(e) => FileState::Blocked(format!(
                        "is a symlink to {} that cannot be read ({e}); flock never writes through links",
                        target.display()
                    )),
                    Ok(bytes) => match decide(&key, &bytes, &self.ledger, &self.policy) {
                        Action::IgnoreOwnWrite | Action::AlreadyPatched => FileState::Patched,
                        Action::Skip(SkipReason::Invalid(e)) => FileState::Invalid(e.to_string()),
                        _ => FileState::Blocked(format!(
                            "is a symlink to {}; flock never replaces a link or writes outside \
                             the config directory: make it a regular file, or point it at a \
                             config inside the directory",
                            target.display()
                        )),
                    },
                };
                self.set_state(name, state);
            }
            Read_::File(bytes, meta) => match self.cfg.mode {
                Mode::Chained => self.handle_chained(name, &key, &bytes, &meta),
                Mode::Subdir => self.handle_subdir(name, &bytes),
            },
        }
    }

    fn handle_chained(&mut self, name: &str, key: &str, bytes: &[u8], meta: &Metadata) {
        match decide(key, bytes, &self.ledger, &self.policy) {
            Action::IgnoreOwnWrite => {
                self.own_write_events += 1;
                self.set_state(name, FileState::Patched);
            }
            Action::AlreadyPatched => {
                self.ledger.record(key, bytes);
                self.set_state(name, FileState::Patched);
            }
            Action::Skip(reason) => {
                let state = match &reason {
                    SkipReason::NotAConfigFile => return,
                    SkipReason::Incomplete(_) => FileState::Partial(reason.to_string()),
                    SkipReason::Invalid(_) => FileState::Invalid(reason.to_string()),
                    SkipReason::Refused(_) => FileState::Blocked(reason.to_string()),
                };
                self.set_state(name, state);
            }
            Action::Write {
                bytes: patched,
                file_name_change,
            } => {
                if !self.take_write_token(name) {
                    return;
                }
                match file_name_change {
                    None => {
                        match write_atomic(&self.dir, name, &patched, Perm::Like(meta), Some(bytes))
                        {
                            Ok(true) => {
                                self.ledger.record(key, &patched);
                                self.writes += 1;
                                info!(
                                    file = name,
                                    bytes = patched.len(),
                                    writes = self.writes,
                                    "wrote config"
                                );
                                self.set_state(name, FileState::Patched);
                                self.recheck_symlinks();
                            }
                            Ok(false) => {
                                debug!(file = name, "changed while we patched it; re-reading");
                                self.retry_at.insert(name.to_owned(), Instant::now());
                            }
                            Err(e) => self.write_failed(name, &e),
                        }
                    }
                    Some(change) => {
                        let new_name = change
                            .new_path
                            .rsplit('/')
                            .next()
                            .unwrap_or(&change.new_path)
                            .to_owned();
                        self.convert(name, &new_name, &patched, meta);
                    }
                }
            }
        }
    }

    /// `.conf` → `.conflist`: write the list, then remove the `.conf` (until then the
    /// runtime still loads the valid `.conf`, which sorts first).
    fn convert(&mut self, conf_name: &str, list_name: &str, patched: &[u8], meta: &Metadata) {
        let list_key = self.key(list_name);
        match fs::symlink_metadata(self.dir.join(list_name)) {
            Ok(_) if self.ledger.get(&list_key).is_none() => {
                self.set_state(
                    conf_name,
                    FileState::Blocked(format!(
                        "converting it to a list would overwrite {list_name}, which flock did not write"
                    )),
                );
                return;
            }
            _ => {}
        }
        if let Err(e) = write_atomic(&self.dir, list_name, patched, Perm::Like(meta), None) {
            self.write_failed(conf_name, &e);
            return;
        }
        self.ledger.record(&list_key, patched);
        self.writes += 1;
        if let Err(e) = fs::remove_file(self.dir.join(conf_name)).and_then(|()| sync_dir(&self.dir))
        {
            warn!(file = conf_name, error = %e, "wrote the converted list but cannot remove the .conf");
        }
        self.ledger.forget(&self.key(conf_name));
        self.files.remove(conf_name);
        self.conversions
            .insert(list_name.to_owned(), conf_name.to_owned());
        info!(
            file = list_name,
            from = conf_name,
            bytes = patched.len(),
            writes = self.writes,
            "wrote config (converted a single-plugin .conf into a .conflist)"
        );
        self.set_state(list_name, FileState::Patched);
    }

    fn write_failed(&mut self, name: &str, e: &io::Error) {
        error!(file = name, error = %e, "cannot write config; retrying in 1 s");
        self.retry_at
            .insert(name.to_owned(), Instant::now() + Duration::from_secs(1));
        self.set_state(name, FileState::Pending(format!("write failed: {e}")));
    }

    fn take_write_token(&mut self, name: &str) -> bool {
        let now_ms = self.now_ms();
        let burst = self.cfg.write_burst;
        let every = u64::try_from(self.cfg.write_interval.as_millis()).unwrap_or(u64::MAX);
        let bucket = self
            .buckets
            .entry(name.to_owned())
            .or_insert_with(|| TokenBucket::new(burst, every, now_ms));
        match bucket.try_take(now_ms) {
            Ok(()) => {
                if self.throttle_warned.remove(name) {
                    info!(file = name, "write budget available again; re-patching");
                }
                true
            }
            Err(wait_ms) => {
                if self.throttle_warned.insert(name.to_owned()) {
                    warn!(
                        file = name,
                        burst,
                        interval_ms = every,
                        "another agent keeps rewriting this config (a primary CNI that owns the directory?): \
                           throttling re-patches to one per interval after a burst; not ready until it settles"
                    );
                }
                self.retry_at.insert(
                    name.to_owned(),
                    Instant::now() + Duration::from_millis(wait_ms),
                );
                self.set_state(name, FileState::Throttled);
                false
            }
        }
    }

    fn recheck_symlinks(&mut self) {
        let links: Vec<String> = self
            .files
            .iter()
            .filter(
                |(_, s)| matches!(s, FileState::Blocked(why) if why.starts_with("is a symlink")),
            )
            .map(|(n, _)| n.clone())
            .collect();
        for name in links {
            self.handle(&name);
        }
    }

    fn handle_subdir(&mut self, name: &str, bytes: &[u8]) {
        let primary = match parse_file(name, bytes) {
            Ok(c) => c,
            Err(e) if e.is_incomplete() => {
                return self.set_state(
                    name,
                    FileState::Partial(SkipReason::Incomplete(e).to_string()),
                );
            }
            Err(e) => {
                return self
                    .set_state(name, FileState::Invalid(SkipReason::Invalid(e).to_string()));
            }
        };
        let d = match dropin(&primary, &self.cfg.ours) {
            Ok(d) => d,
            Err(e) => return self.set_state(name, FileState::Blocked(format!("no drop-in: {e}"))),
        };
        let sub = self.dir.join(&d.dir_name);
        let created_dir = match fs::symlink_metadata(&sub) {
            Ok(m) if m.is_dir() => self.dropins.get(name).is_some_and(|r| r.created_dir),
            Ok(_) => {
                return self.set_state(
                    name,
                    FileState::Blocked(format!(
                        "{} exists and is not a directory (or is a symlink); flock never writes through links",
                        d.dir_name
                    )),
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let Err(e) = fs::create_dir(&sub).and_then(|()| sync_dir(&self.dir)) {
                    return self.write_failed(name, &e);
                }
                true
            }
            Err(e) => return self.write_failed(name, &e),
        };
        self.dropins.insert(
            name.to_owned(),
            DropInRecord {
                dir_name: d.dir_name.clone(),
                file_name: d.file_name.clone(),
                created_dir,
            },
        );
        let current = match read_entry(&sub.join(&d.file_name)) {
            Read_::File(b, _) => Some(b),
            _ => None,
        };
        if current.as_deref() != Some(d.bytes.as_slice()) {
            if !self.take_write_token(name) {
                return;
            }
            if let Err(e) = write_atomic(&sub, &d.file_name, &d.bytes, Perm::Mode(0o644), None) {
                return self.write_failed(name, &e);
            }
            self.writes += 1;
            info!(file = %format!("{}/{}", d.dir_name, d.file_name), primary = name, writes = self.writes, "wrote config (drop-in)");
        }
        if let Ok(entries) = fs::read_dir(&sub) {
            let names: Vec<String> = entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect();
            if !d.sorts_last_among(names.iter().map(String::as_str)) {
                warn!(dir = %d.dir_name, "another drop-in sorts after flock's: flock is not last in the chain");
            }
        }
        self.set_state(name, FileState::Patched);
    }

    fn remove_dropin_of(&mut self, primary: &str) {
        let Some(rec) = self.dropins.remove(primary) else {
            return;
        };
        if self.dropins.values().any(|r| r.dir_name == rec.dir_name) {
            return; // another primary of the same network still needs it
        }
        let sub = self.dir.join(&rec.dir_name);
        match fs::remove_file(sub.join(&rec.file_name)) {
            Ok(()) => {
                info!(file = %format!("{}/{}", rec.dir_name, rec.file_name), "removed drop-in")
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(dir = %rec.dir_name, error = %e, "cannot remove drop-in"),
        }
        if rec.created_dir {
            // Only if empty: someone else's drop-ins stay.
            let _ = fs::remove_dir(&sub);
        }
        let _ = sync_dir(&self.dir);
    }

    fn update_ready(&mut self) {
        let blocking: Vec<&str> = self
            .files
            .iter()
            .filter(|(_, s)| s.blocks_readiness())
            .map(|(n, _)| n.as_str())
            .collect();
        let patched = self
            .files
            .values()
            .filter(|s| **s == FileState::Patched)
            .count();
        let ready = self.scan_done && blocking.is_empty() && patched > 0;
        if self.ready == Some(ready) {
            return;
        }
        if ready {
            info!(
                patched,
                "ready: every primary config is patched and the watch is armed"
            );
        } else if self.scan_done {
            warn!(patched, waiting_for = ?blocking, "not ready");
        }
        self.ready = Some(ready);
        let Some(path) = self.cfg.ready_file.clone() else {
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
            remove_if_exists(&path)
        };
        if let Err(e) = result {
            error!(file = %path.display(), error = %e, "cannot update the ready file");
        }
    }

    // ------------------------------------------------------------------ exit

    /// Restores the directory (unless `--on-exit keep`); true when everything was
    /// restored.
    fn shutdown(&mut self) -> bool {
        if let Some(path) = &self.cfg.ready_file
            && let Err(e) = remove_if_exists(path)
        {
            error!(file = %path.display(), error = %e, "cannot remove the ready file");
        }
        if self.cfg.on_exit == OnExit::Keep {
            info!(
                writes = self.writes,
                own_write_events = self.own_write_events,
                "leaving configs patched and the plugin installed (--on-exit keep)"
            );
            return true;
        }
        let mut ok = true;
        let mut restored = 0u32;
        match self.cfg.mode {
            Mode::Chained => {
                let names = self.list_dir().unwrap_or_default();
                for name in names {
                    match self.restore_file(&name) {
                        Ok(true) => restored += 1,
                        Ok(false) => {}
                        Err(e) => {
                            ok = false;
                            error!(file = name, error = %e, "cannot restore config");
                        }
                    }
                }
            }
            Mode::Subdir => {
                let primaries: Vec<String> = self.dropins.keys().cloned().collect();
                for p in primaries {
                    self.remove_dropin_of(&p);
                    restored += 1;
                }
            }
        }
        self.remove_stale_temp_files();
        if let Some(bin) = self.installed_bin.take() {
            match remove_if_exists(&bin) {
                Ok(()) => info!(binary = %bin.display(), "removed plugin binary"),
                Err(e) => {
                    ok = false;
                    error!(binary = %bin.display(), error = %e, "cannot remove plugin binary");
                }
            }
        }
        info!(
            restored,
            writes = self.writes,
            own_write_events = self.own_write_events,
            "restored; exiting"
        );
        ok
    }

    fn restore_file(&mut self, name: &str) -> io::Result<bool> {
        let Read_::File(bytes, meta) = read_entry(&self.dir.join(name)) else {
            return Ok(false);
        };
        let Ok(config) = parse_file(name, &bytes) else {
            return Ok(false);
        };
        if count_ours(&config, &self.cfg.ours) == 0 {
            return Ok(false);
        }
        let invalid = |e: flock_core::cniconf::CniConfError| io::Error::other(e.to_string());
        if let Some(conf_name) = self.conversions.get(name).cloned()
            && let Some(conf) = unpatch_to_conf(&config, &self.cfg.ours).map_err(invalid)?
            && fs::symlink_metadata(self.dir.join(&conf_name)).is_err()
        {
            write_atomic(
                &self.dir,
                &conf_name,
                &conf.to_bytes(),
                Perm::Like(&meta),
                None,
            )?;
            fs::remove_file(self.dir.join(name))?;
            sync_dir(&self.dir)?;
            info!(file = %conf_name, from = name, "restored the original single-plugin .conf");
            return Ok(true);
        }
        let unpatched = unpatch(&config, &self.cfg.ours).map_err(invalid)?;
        if !unpatched.changed {
            return Ok(false);
        }
        let out = unpatched.config.to_bytes();
        if !write_atomic(&self.dir, name, &out, Perm::Like(&meta), Some(&bytes))? {
            return Err(io::Error::other("changed while we restored it"));
        }
        info!(file = name, "restored config (flock's entry removed)");
        Ok(true)
    }
}

fn watch_thread(mut inotify: Inotify, dir: &str, tx: &Sender<Work>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let events = match inotify.read_events_blocking(&mut buf) {
            Ok(events) => events,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let _ = tx.send(Work::Fatal(format!("reading inotify events failed: {e}")));
                return;
            }
        };
        for ev in events {
            let work = if ev.mask.contains(EventMask::Q_OVERFLOW) {
                warn!("inotify queue overflowed: rescanning the whole directory");
                Work::Rescan("inotify queue overflow")
            } else if ev
                .mask
                .intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED)
            {
                Work::Fatal(format!(
                    "the config directory {dir} was removed or moved away; cannot keep it patched"
                ))
            } else if let Some(name) = ev.name.and_then(|n| n.to_str()) {
                Work::File(name.to_owned())
            } else {
                continue;
            };
            if tx.send(work).is_err() {
                return;
            }
        }
    }
}

fn inotify_error(what: &str, e: &io::Error) -> InstallError {
    let limit = |file: &str| {
        fs::read_to_string(format!("/proc/sys/fs/inotify/{file}"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "?".into())
    };
    let msg = match e.raw_os_error() {
        Some(nix::libc::EMFILE) => format!(
            "{what}: the inotify instance limit is exhausted (fs.inotify.max_user_instances = {}): \
             raise it (sysctl -w fs.inotify.max_user_instances=512) or stop what holds the \
             instances; flock-install-cni refuses to run unwatched",
            limit("max_user_instances")
        ),
        Some(nix::libc::ENOSPC) => format!(
            "{what}: the inotify watch limit is exhausted (fs.inotify.max_user_watches = {}): \
             raise it (sysctl -w fs.inotify.max_user_watches=524288); flock-install-cni refuses \
             to run unwatched",
            limit("max_user_watches")
        ),
        _ => format!("{what}: {e}; flock-install-cni refuses to run unwatched"),
    };
    InstallError(msg)
}

/// Reads a directory entry without following a symlink for anything but reading its
/// target, and without blocking on FIFOs.
fn read_entry(path: &Path) -> Read_ {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(_) => return Read_::Missing,
    };
    if meta.file_type().is_symlink() {
        let target = fs::read_link(path).unwrap_or_default();
        return Read_::Symlink(target, read_regular(path, true).map(|(b, _)| b));
    }
    if !meta.is_file() {
        return Read_::NotRegular;
    }
    match read_regular(path, false) {
        Ok((bytes, meta)) => Read_::File(bytes, meta),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Read_::Missing,
        // Replaced by a link or something else between the two calls: look again later
        // (the change produced an event).
        Err(_) => Read_::Missing,
    }
}

fn read_regular(path: &Path, follow: bool) -> io::Result<(Vec<u8>, Metadata)> {
    let mut flags = nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC;
    if !follow {
        flags |= nix::libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok((bytes, meta))
}

enum Perm<'a> {
    Like(&'a Metadata),
    Mode(u32),
}

/// Writes `bytes` to `dir/name` atomically: a temp file in the same directory
/// (`O_EXCL`, so never through a planted link), mode and owner set, fsync, then —
/// when `expect` is given — only if `dir/name` still holds `expect` (else the temp file
/// is removed and `Ok(false)` returned), rename, fsync of the directory.
fn write_atomic(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    perm: Perm<'_>,
    expect: Option<&[u8]>,
) -> io::Result<bool> {
    let tmp = dir.join(temp_file_name_for(name));
    let target = dir.join(name);
    remove_if_exists(&tmp)?;
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        match perm {
            Perm::Like(meta) => {
                std::os::unix::fs::fchown(&f, Some(meta.uid()), Some(meta.gid()))?;
                f.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
            }
            Perm::Mode(mode) => f.set_permissions(fs::Permissions::from_mode(mode))?,
        }
        f.sync_all()?;
        drop(f);
        if let Some(expect) = expect {
            match read_regular(&target, false) {
                Ok((now, _)) if now == expect => {}
                _ => return Ok(false),
            }
        }
        fs::rename(&tmp, &target)?;
        sync_dir(dir)?;
        Ok(true)
    })();
    if !matches!(result, Ok(true)) {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
