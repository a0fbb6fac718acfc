//! The CNI installer's decisions as a sans-IO state machine.
//!
//! The `flock-install-cni` daemon watches one config directory. Its I/O loop only reads
//! entries, lists the directory, writes atomically and removes files; everything it
//! decides is decided here, in the shape of quinn-proto's connection: the loop feeds
//! [`Event`]s in with the monotonic time `now` ([`Installer::handle`],
//! [`Installer::handle_timeout`]), then drains [`Io`] requests
//! ([`Installer::poll_io`]) and sleeps until [`Installer::poll_timeout`].
//!
//! What is decided here, and why:
//!
//! * **Which names matter**: only plain `.conf`/`.conflist`/`.json` names in the
//!   directory itself; temp files and sub-directory paths never reach a decision.
//! * **What a file's state is** ([`FileState`]): each [`SkipReason`] of
//!   [`decide`] maps to exactly one state, and only the states a runtime would load
//!   unpatched block readiness (a half-written or invalid file is not loadable, so it
//!   does not).
//! * **Symlinks**: the I/O side reports "this entry is a symlink" as a typed
//!   [`Entry::Symlink`] from `symlink_metadata`. A link is never written through
//!   (writing would replace the link or write outside the directory); it is
//!   [`Blocked::Symlink`] unless its target already holds a patched config, and it is
//!   re-examined after every write of ours (it may point at the file just patched).
//! * **Refusal to overwrite**: converting `x.conf` into `x.conflist` would replace an
//!   existing `x.conflist`; that is only allowed when flock wrote that file (the
//!   ledger has it). Otherwise the write goes out with [`Expect::Absent`] and, if the
//!   file is there, the `.conf` is [`Blocked::WouldOverwrite`]. A patch of an existing
//!   file goes out with [`Expect::Holds`] (compare-and-swap on the bytes we decided
//!   on), so a concurrent rewrite by another agent is re-read instead of clobbered.
//! * **Write budget and re-patch timing**: one [`TokenBucket`] per file; an empty one
//!   makes the file [`FileState::Throttled`] and schedules a re-read when the next
//!   token is due. A failed write is retried after [`RETRY_AFTER_FAILURE_MS`]; a
//!   rewrite that raced ours is re-read at once; the whole directory is re-listed every
//!   `resync_ms` (level-triggered repair of anything an event could not tell).
//! * **Readiness**: ready exactly when the watch is armed, the first full scan has been
//!   handled (every entry it listed has been read and decided: readiness is only
//!   evaluated when no request is outstanding), at least one primary is patched and no
//!   file blocks readiness.
//!
//! The loop must arm the watch *before* it lists the directory for the first scan: a
//! config created between a scan and a later arm is seen by neither and stays unpatched
//! forever. Arming first means such a file is in the scan, produces an event, or both
//! (handling a file twice is harmless: decisions are per file and idempotent).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use crate::ratelimit::TokenBucket;
use crate::time::MonoMs;

use super::dropin::{DropIn, dropin};
use super::ledger::{Action, InstallPolicy, Ledger, SkipReason, decide};
use super::parse::{kind_for_file_name, parse_file};
use super::patch::{count_ours, unpatch, unpatch_to_conf};

/// How long a failed write waits before the file is read and decided again.
pub const RETRY_AFTER_FAILURE_MS: u64 = 1_000;

/// How flock's plugin is chained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Append our entry to each primary's `plugins` (any libcni).
    Chained,
    /// Write `<dir>/<network>/zz-flock.conf` drop-ins (libcni >= 1.3 only).
    Subdir,
}

/// The machine's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// What to chain, and what to do with `.conf` primaries.
    pub policy: InstallPolicy,
    /// Chained or drop-ins.
    pub mode: Mode,
    /// Writes per file allowed in a burst.
    pub write_burst: u32,
    /// Then at most one write per file per this many milliseconds.
    pub write_interval_ms: u64,
    /// A full re-listing of the directory this often.
    pub resync_ms: u64,
}

/// What the I/O side found at a directory entry, looked at with `symlink_metadata`
/// (never following a link to decide what the entry *is*).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Nothing there (or it changed kind while being read: its change brings an event).
    Missing,
    /// A regular file and its bytes (at most `MAX_CONFIG_BYTES + 1` of them).
    File(Vec<u8>),
    /// A symbolic link: where it points, and its target's bytes when the target is a
    /// readable regular file (else why not).
    Symlink {
        /// The link's target as written in the link.
        target: String,
        /// The target's bytes, or the error reading them.
        content: Result<Vec<u8>, String>,
    },
    /// A directory, FIFO, socket or device.
    NotRegular,
}

/// Why a primary config will not be patched. Each blocks readiness: pods on that
/// network would start without flock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocked {
    /// Valid, but flock will not chain into it (version, `.conf` policy, ...).
    Refused(SkipReason),
    /// A symlink whose target is not patched: flock never writes through links.
    Symlink {
        /// The link's target.
        target: String,
    },
    /// A symlink whose target cannot be read.
    SymlinkUnreadable {
        /// The link's target.
        target: String,
        /// The read error.
        error: String,
    },
    /// Converting the `.conf` to a list would replace a `.conflist` flock did not write.
    WouldOverwrite {
        /// The existing list's name.
        list_name: String,
    },
    /// No drop-in can be derived for it (subdir mode).
    NoDropIn(String),
    /// The drop-in directory's name is taken by something that is not a directory (or
    /// is a symlink).
    DropInDirNotADirectory {
        /// The sub-directory's name.
        dir_name: String,
    },
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(reason) => write!(f, "{reason}"),
            Self::Symlink { target } => write!(
                f,
                "is a symlink to {target}; flock never replaces a link or writes outside the \
                 config directory: make it a regular file, or point it at a config inside the \
                 directory"
            ),
            Self::SymlinkUnreadable { target, error } => write!(
                f,
                "is a symlink to {target} that cannot be read ({error}); flock never writes \
                 through links"
            ),
            Self::WouldOverwrite { list_name } => write!(
                f,
                "converting it to a list would overwrite {list_name}, which flock did not write"
            ),
            Self::NoDropIn(e) => write!(f, "no drop-in: {e}"),
            Self::DropInDirNotADirectory { dir_name } => write!(
                f,
                "{dir_name} exists and is not a directory (or is a symlink); flock never \
                 writes through links"
            ),
        }
    }
}

/// What flock knows about one config file of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileState {
    /// Holds our entry (or its drop-in) as desired.
    Patched,
    /// A write of ours failed; retrying. Blocks readiness.
    Pending(String),
    /// Empty or truncated: another writer is mid-write. Runtimes cannot load it either,
    /// so it does not block readiness; patched once complete.
    Partial(SkipReason),
    /// Rewritten faster than the write budget. Blocks readiness.
    Throttled,
    /// A primary flock will not or cannot patch. Blocks readiness.
    Blocked(Blocked),
    /// Not a valid config (or not a regular file): runtimes cannot load it either. Does
    /// not block readiness.
    Invalid(String),
}

impl FileState {
    /// Whether this state keeps the installer from declaring itself ready.
    pub fn blocks_readiness(&self) -> bool {
        matches!(self, Self::Pending(_) | Self::Throttled | Self::Blocked(_))
    }

    /// The state a [`SkipReason`] of [`decide`] puts a file in; `None` for a name that
    /// is not a config file (it has no state at all).
    pub fn for_skip(reason: SkipReason) -> Option<Self> {
        match reason {
            SkipReason::NotAConfigFile => None,
            SkipReason::Incomplete(_) => Some(Self::Partial(reason)),
            SkipReason::Invalid(_) => Some(Self::Invalid(reason.to_string())),
            SkipReason::Refused(_) => Some(Self::Blocked(Blocked::Refused(reason))),
        }
    }
}

/// The condition under which a write may replace its target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Only if the target does not exist.
    Absent,
    /// Only if the target still holds exactly these bytes (what the decision was made on).
    Holds(Vec<u8>),
    /// Whatever the target holds (a file only flock writes).
    Anything,
}

/// Mode and owner of a written file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Perm<'a> {
    /// Those of this entry of the directory (the file being patched or converted).
    Like(&'a str),
    /// This mode, owned by us.
    Mode(u32),
}

/// Why a write is made; the machine needs it back with the outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteKind {
    /// Patching `name` in place.
    Patch,
    /// Writing the list that replaces the single-plugin `.conf` `conf_name`.
    Convert {
        /// The `.conf` being converted.
        conf_name: String,
    },
    /// The drop-in of primary `primary`.
    DropIn {
        /// The primary config the drop-in chains into.
        primary: String,
        /// The drop-in.
        dropin: DropIn,
        /// Create the sub-directory first.
        create_dir: bool,
    },
}

/// An atomic write the I/O side performs (temp file, fsync, rename, fsync of the
/// directory), then reports with [`Event::Written`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The path inside the config directory: a plain name, or `<network>/<drop-in>`.
    pub path: String,
    /// The bytes to write.
    pub bytes: Vec<u8>,
    /// When the write may replace the target.
    pub expect: Expect,
    /// Why.
    pub kind: WriteKind,
}

impl Write {
    /// Mode and owner for the written file.
    pub fn perm(&self) -> Perm<'_> {
        match &self.kind {
            WriteKind::Patch => Perm::Like(&self.path),
            WriteKind::Convert { conf_name } => Perm::Like(conf_name),
            WriteKind::DropIn { .. } => Perm::Mode(0o644),
        }
    }
}

/// How a [`Write`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The target now holds the bytes.
    Written,
    /// The [`Expect`] condition did not hold; nothing was written.
    ConditionFailed,
    /// The write failed.
    Failed(String),
}

/// What the sub-directory of a drop-in looks like (subdir mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DropInDir {
    /// A real directory; the drop-in's current bytes, if it exists as a regular file.
    Directory(Option<Vec<u8>>),
    /// Nothing by that name.
    Missing,
    /// Something that is not a directory, or a symlink.
    NotADirectory,
    /// Looking failed.
    Error(String),
}

/// What happened, as the I/O side saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The inotify watch on the directory is armed: every later change produces an event.
    WatchArmed,
    /// A listing of the directory's entry names. The first one is the initial scan.
    Listed(Vec<String>),
    /// The watch named this entry (created, written, moved or deleted).
    Changed(String),
    /// The watch lost events (queue overflow): re-list everything.
    Overflow,
    /// The result of [`Io::Read`].
    Observed {
        /// The entry's name.
        name: String,
        /// What is there.
        entry: Entry,
    },
    /// The result of [`Io::Write`].
    Written {
        /// The write requested.
        write: Write,
        /// How it ended.
        outcome: WriteOutcome,
    },
    /// The result of [`Io::ProbeDropIn`].
    DropInProbed {
        /// The primary config.
        primary: String,
        /// The drop-in it needs.
        dropin: DropIn,
        /// What its sub-directory holds.
        dir: DropInDir,
    },
}

/// Something worth a log line; the machine acts on none of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A file's state changed (`old` is `None` for a file seen for the first time).
    State {
        /// The file.
        name: String,
        /// Its previous state.
        old: Option<FileState>,
        /// Its state now.
        new: FileState,
    },
    /// A known config disappeared.
    Removed(String),
    /// The first write a file was refused by its write budget.
    ThrottleStarted(String),
    /// A throttled file may be written again.
    ThrottleEnded(String),
    /// Every entry of the initial scan has been read and decided; this many files
    /// are known.
    ScanDone(usize),
}

/// A request to the I/O side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Io {
    /// Read this entry (without following a link to decide what it is) and report
    /// [`Event::Observed`].
    Read(String),
    /// List the directory and report [`Event::Listed`].
    List,
    /// Perform this write and report [`Event::Written`].
    Write(Write),
    /// Remove this entry (the `.conf` a written list replaced); failures are only logged.
    Remove(String),
    /// Look at the drop-in's sub-directory and report [`Event::DropInProbed`].
    ProbeDropIn {
        /// The primary config.
        primary: String,
        /// The drop-in it needs.
        dropin: DropIn,
    },
    /// Remove a drop-in (and its sub-directory when flock created it and it is empty).
    RemoveDropIn {
        /// The sub-directory.
        dir_name: String,
        /// The drop-in's file name.
        file_name: String,
        /// Also remove the sub-directory if empty.
        remove_dir: bool,
    },
    /// Create (ready) or remove (not ready) the readiness file.
    Ready {
        /// Ready or not.
        ready: bool,
        /// How many files are patched.
        patched: usize,
        /// The files that block readiness.
        waiting_for: Vec<String>,
    },
    /// Log this.
    Notice(Notice),
}

/// What restoring one config on exit takes (chained mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// Nothing of ours in it (or not a config): leave it.
    Untouched,
    /// Write these bytes in place, only if the file still holds what was read.
    Rewrite(Vec<u8>),
    /// Write the original `.conf` back (only if absent), then remove the list.
    BackToConf {
        /// The `.conf` to recreate.
        conf_name: String,
        /// Its bytes.
        bytes: Vec<u8>,
    },
    /// Our entry is in it, but it cannot be taken out.
    Error(String),
}

#[derive(Debug, Clone)]
struct DropInRecord {
    dir_name: String,
    file_name: String,
    created_dir: bool,
}

/// The installer's state for one config directory. See the module docs.
#[derive(Debug)]
pub struct Installer {
    settings: Settings,
    ledger: Ledger,
    files: BTreeMap<String, FileState>,
    buckets: BTreeMap<String, TokenBucket>,
    throttled: BTreeSet<String>,
    retry_at: BTreeMap<String, MonoMs>,
    /// `.conflist` we wrote → the `.conf` it replaced.
    conversions: BTreeMap<String, String>,
    /// Primary → its drop-in (subdir mode).
    dropins: BTreeMap<String, DropInRecord>,
    watch_armed: bool,
    scan_done: bool,
    scan_reported: bool,
    ready: Option<bool>,
    next_resync: MonoMs,
    queue: VecDeque<Io>,
    own_write_events: u64,
}

impl Installer {
    /// A machine that has seen nothing, at `now`.
    pub fn new(settings: Settings, now: MonoMs) -> Self {
        Self {
            next_resync: now.plus(settings.resync_ms),
            settings,
            ledger: Ledger::new(),
            files: BTreeMap::new(),
            buckets: BTreeMap::new(),
            throttled: BTreeSet::new(),
            retry_at: BTreeMap::new(),
            conversions: BTreeMap::new(),
            dropins: BTreeMap::new(),
            watch_armed: false,
            scan_done: false,
            scan_reported: false,
            ready: None,
            queue: VecDeque::new(),
            own_write_events: 0,
        }
    }

    /// The state of a file, if it is known.
    pub fn state(&self, name: &str) -> Option<&FileState> {
        self.files.get(name)
    }

    /// Every known file and its state, sorted by name.
    pub fn files(&self) -> impl Iterator<Item = (&str, &FileState)> {
        self.files.iter().map(|(n, s)| (n.as_str(), s))
    }

    /// The readiness last reported through [`Io::Ready`] (`None`: not yet decided).
    pub fn is_ready(&self) -> Option<bool> {
        self.ready
    }

    /// How many events were recognised as our own writes.
    pub fn own_write_events(&self) -> u64 {
        self.own_write_events
    }

    /// Feeds one event in.
    pub fn handle(&mut self, now: MonoMs, event: Event) {
        match event {
            Event::WatchArmed => self.watch_armed = true,
            Event::Listed(names) => self.listed(names),
            Event::Changed(name) => {
                if Self::is_config_name(&name) {
                    self.queue.push_back(Io::Read(name));
                }
            }
            Event::Overflow => self.queue.push_back(Io::List),
            Event::Observed { name, entry } => {
                if Self::is_config_name(&name) {
                    self.observed(now, &name, entry);
                }
            }
            Event::Written { write, outcome } => self.written(now, write, outcome),
            Event::DropInProbed {
                primary,
                dropin,
                dir,
            } => self.dropin_probed(now, &primary, dropin, dir),
        }
    }

    /// The next instant [`Installer::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> MonoMs {
        self.retry_at
            .values()
            .copied()
            .min()
            .map_or(self.next_resync, |t| t.min(self.next_resync))
    }

    /// Fires the retries and the resync due at `now`.
    pub fn handle_timeout(&mut self, now: MonoMs) {
        let due: Vec<String> = self
            .retry_at
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for name in due {
            self.retry_at.remove(&name);
            self.queue.push_back(Io::Read(name));
        }
        if self.next_resync <= now {
            self.next_resync = now.plus(self.settings.resync_ms);
            self.queue.push_back(Io::List);
        }
    }

    /// The next request for the I/O side. Readiness is decided only when nothing else
    /// is outstanding, so it always reflects every event fed in so far.
    pub fn poll_io(&mut self) -> Option<Io> {
        if let Some(io) = self.queue.pop_front() {
            return Some(io);
        }
        if self.scan_done && !self.scan_reported {
            self.scan_reported = true;
            return Some(Io::Notice(Notice::ScanDone(self.files.len())));
        }
        let waiting_for: Vec<String> = self
            .files
            .iter()
            .filter(|(_, s)| s.blocks_readiness())
            .map(|(n, _)| n.clone())
            .collect();
        let patched = self
            .files
            .values()
            .filter(|s| **s == FileState::Patched)
            .count();
        let ready = self.watch_armed && self.scan_done && waiting_for.is_empty() && patched > 0;
        if self.ready == Some(ready) {
            return None;
        }
        self.ready = Some(ready);
        Some(Io::Ready {
            ready,
            patched,
            waiting_for,
        })
    }

    /// What to do with config `name`, holding `bytes`, on exit (chained mode).
    /// `conf_exists`: whether the `.conf` a conversion replaced exists again (then the
    /// list is unpatched in place instead of being turned back).
    pub fn restore(&self, name: &str, bytes: &[u8], conf_exists: bool) -> Restore {
        let Ok(config) = parse_file(name, bytes) else {
            return Restore::Untouched;
        };
        let ours = &self.settings.policy.ours;
        if count_ours(&config, ours) == 0 {
            return Restore::Untouched;
        }
        if let Some(conf_name) = self.conversions.get(name)
            && !conf_exists
        {
            match unpatch_to_conf(&config, ours) {
                Ok(Some(conf)) => {
                    return Restore::BackToConf {
                        conf_name: conf_name.clone(),
                        bytes: conf.to_bytes(),
                    };
                }
                Ok(None) => {}
                Err(e) => return Restore::Error(e.to_string()),
            }
        }
        match unpatch(&config, ours) {
            Ok(u) if u.changed => Restore::Rewrite(u.config.to_bytes()),
            Ok(_) => Restore::Untouched,
            Err(e) => Restore::Error(e.to_string()),
        }
    }

    /// The `.conf` a list of ours replaced, if any.
    pub fn converted_from(&self, list_name: &str) -> Option<&str> {
        self.conversions.get(list_name).map(String::as_str)
    }

    /// Every drop-in removal to perform on exit (subdir mode).
    pub fn remove_all_dropins(&mut self) -> Vec<Io> {
        let primaries: Vec<String> = self.dropins.keys().cloned().collect();
        primaries
            .iter()
            .filter_map(|p| self.remove_dropin_of(p))
            .collect()
    }

    // ---------------------------------------------------------------- internals

    /// Only plain config names of the directory itself reach a decision.
    fn is_config_name(name: &str) -> bool {
        !name.is_empty() && !name.contains('/') && kind_for_file_name(name).is_some()
    }

    fn listed(&mut self, names: Vec<String>) {
        let mut all: BTreeSet<String> = self.files.keys().cloned().collect();
        all.extend(names.into_iter().filter(|n| Self::is_config_name(n)));
        self.scan_done = true;
        self.queue.extend(all.into_iter().map(Io::Read));
    }

    fn notice(&mut self, n: Notice) {
        self.queue.push_back(Io::Notice(n));
    }

    fn set_state(&mut self, name: &str, state: FileState) {
        let old = self.files.insert(name.to_owned(), state.clone());
        if old.as_ref() != Some(&state) {
            self.notice(Notice::State {
                name: name.to_owned(),
                old,
                new: state,
            });
        }
    }

    fn observed(&mut self, now: MonoMs, name: &str, entry: Entry) {
        match entry {
            Entry::Missing => {
                self.ledger.forget(name);
                self.retry_at.remove(name);
                if self.files.remove(name).is_some() {
                    self.notice(Notice::Removed(name.to_owned()));
                }
                if self.settings.mode == Mode::Subdir
                    && let Some(io) = self.remove_dropin_of(name)
                {
                    self.queue.push_back(io);
                }
            }
            Entry::NotRegular => self.set_state(
                name,
                FileState::Invalid("not a regular file (directory, FIFO, socket or device)".into()),
            ),
            Entry::Symlink { target, content } => {
                let state = match content {
                    Err(error) => FileState::Blocked(Blocked::SymlinkUnreadable { target, error }),
                    Ok(bytes) => match decide(name, &bytes, &self.ledger, &self.settings.policy) {
                        Action::IgnoreOwnWrite | Action::AlreadyPatched => FileState::Patched,
                        Action::Skip(SkipReason::Invalid(e)) => FileState::Invalid(e.to_string()),
                        _ => FileState::Blocked(Blocked::Symlink { target }),
                    },
                };
                self.set_state(name, state);
            }
            Entry::File(bytes) => match self.settings.mode {
                Mode::Chained => self.chained(now, name, bytes),
                Mode::Subdir => self.subdir(name, &bytes),
            },
        }
    }

    fn chained(&mut self, now: MonoMs, name: &str, bytes: Vec<u8>) {
        match decide(name, &bytes, &self.ledger, &self.settings.policy) {
            Action::IgnoreOwnWrite => {
                self.own_write_events += 1;
                self.set_state(name, FileState::Patched);
            }
            Action::AlreadyPatched => {
                self.ledger.record(name, &bytes);
                self.set_state(name, FileState::Patched);
            }
            Action::Skip(reason) => {
                if let Some(state) = FileState::for_skip(reason) {
                    self.set_state(name, state);
                }
            }
            Action::Write {
                bytes: patched,
                file_name_change,
            } => {
                if !self.take_write_token(now, name) {
                    return;
                }
                let write = match file_name_change {
                    None => Write {
                        path: name.to_owned(),
                        bytes: patched,
                        expect: Expect::Holds(bytes),
                        kind: WriteKind::Patch,
                    },
                    Some(change) => {
                        let list_name = change
                            .new_path
                            .rsplit('/')
                            .next()
                            .unwrap_or(&change.new_path)
                            .to_owned();
                        // Replacing an existing list is only allowed when it is ours.
                        let expect = if self.ledger.get(&list_name).is_some() {
                            Expect::Anything
                        } else {
                            Expect::Absent
                        };
                        Write {
                            path: list_name,
                            bytes: patched,
                            expect,
                            kind: WriteKind::Convert {
                                conf_name: name.to_owned(),
                            },
                        }
                    }
                };
                self.queue.push_back(Io::Write(write));
            }
        }
    }

    fn subdir(&mut self, name: &str, bytes: &[u8]) {
        let primary = match parse_file(name, bytes) {
            Ok(c) => c,
            Err(e) if e.is_incomplete() => {
                return self.set_state(name, FileState::Partial(SkipReason::Incomplete(e)));
            }
            Err(e) => {
                return self
                    .set_state(name, FileState::Invalid(SkipReason::Invalid(e).to_string()));
            }
        };
        match dropin(&primary, &self.settings.policy.ours) {
            Ok(d) => self.queue.push_back(Io::ProbeDropIn {
                primary: name.to_owned(),
                dropin: d,
            }),
            Err(e) => self.set_state(name, FileState::Blocked(Blocked::NoDropIn(e.to_string()))),
        }
    }

    fn dropin_probed(&mut self, now: MonoMs, primary: &str, d: DropIn, dir: DropInDir) {
        let (created_dir, current) = match dir {
            DropInDir::Directory(current) => (
                self.dropins.get(primary).is_some_and(|r| r.created_dir),
                current,
            ),
            DropInDir::Missing => (true, None),
            DropInDir::NotADirectory => {
                return self.set_state(
                    primary,
                    FileState::Blocked(Blocked::DropInDirNotADirectory {
                        dir_name: d.dir_name,
                    }),
                );
            }
            DropInDir::Error(e) => return self.write_failed(now, primary, e),
        };
        self.dropins.insert(
            primary.to_owned(),
            DropInRecord {
                dir_name: d.dir_name.clone(),
                file_name: d.file_name.clone(),
                created_dir,
            },
        );
        if current.as_deref() == Some(d.bytes.as_slice()) {
            return self.set_state(primary, FileState::Patched);
        }
        if !self.take_write_token(now, primary) {
            return;
        }
        self.queue.push_back(Io::Write(Write {
            path: format!("{}/{}", d.dir_name, d.file_name),
            bytes: d.bytes.clone(),
            expect: Expect::Anything,
            kind: WriteKind::DropIn {
                primary: primary.to_owned(),
                create_dir: current.is_none() && created_dir,
                dropin: d,
            },
        }));
    }

    fn written(&mut self, now: MonoMs, write: Write, outcome: WriteOutcome) {
        let owner = match &write.kind {
            WriteKind::Patch => write.path.clone(),
            WriteKind::Convert { conf_name } => conf_name.clone(),
            WriteKind::DropIn { primary, .. } => primary.clone(),
        };
        match outcome {
            WriteOutcome::Failed(e) => self.write_failed(now, &owner, e),
            WriteOutcome::ConditionFailed => match write.kind {
                // Another agent rewrote it after we read it: decide again on what is
                // there now, at once.
                WriteKind::Patch | WriteKind::DropIn { .. } => {
                    self.queue.push_back(Io::Read(owner));
                }
                WriteKind::Convert { .. } => self.set_state(
                    &owner,
                    FileState::Blocked(Blocked::WouldOverwrite {
                        list_name: write.path,
                    }),
                ),
            },
            WriteOutcome::Written => {
                match &write.kind {
                    WriteKind::Patch => {
                        self.ledger.record(&write.path, &write.bytes);
                        self.set_state(&write.path, FileState::Patched);
                    }
                    WriteKind::Convert { conf_name } => {
                        self.ledger.record(&write.path, &write.bytes);
                        self.ledger.forget(conf_name);
                        self.files.remove(conf_name);
                        self.retry_at.remove(conf_name);
                        self.conversions
                            .insert(write.path.clone(), conf_name.clone());
                        // Until this removal the runtime still loads the valid `.conf`
                        // (it sorts first): loadable at every instant.
                        self.queue.push_back(Io::Remove(conf_name.clone()));
                        self.set_state(&write.path, FileState::Patched);
                    }
                    WriteKind::DropIn { primary, .. } => {
                        self.set_state(primary, FileState::Patched);
                    }
                }
                self.recheck_symlinks();
            }
        }
    }

    fn write_failed(&mut self, now: MonoMs, name: &str, error: String) {
        self.retry_at
            .insert(name.to_owned(), now.plus(RETRY_AFTER_FAILURE_MS));
        self.set_state(name, FileState::Pending(format!("write failed: {error}")));
    }

    fn take_write_token(&mut self, now: MonoMs, name: &str) -> bool {
        let (burst, every) = (self.settings.write_burst, self.settings.write_interval_ms);
        let bucket = self
            .buckets
            .entry(name.to_owned())
            .or_insert_with(|| TokenBucket::new(burst, every, now));
        match bucket.try_take(now) {
            Ok(()) => {
                if self.throttled.remove(name) {
                    self.notice(Notice::ThrottleEnded(name.to_owned()));
                }
                true
            }
            Err(wait_ms) => {
                if self.throttled.insert(name.to_owned()) {
                    self.notice(Notice::ThrottleStarted(name.to_owned()));
                }
                self.retry_at.insert(name.to_owned(), now.plus(wait_ms));
                self.set_state(name, FileState::Throttled);
                false
            }
        }
    }

    /// A link may point at the file just written: look at every blocked link again.
    fn recheck_symlinks(&mut self) {
        let links: Vec<String> = self
            .files
            .iter()
            .filter(|(_, s)| matches!(s, FileState::Blocked(Blocked::Symlink { .. })))
            .map(|(n, _)| n.clone())
            .collect();
        self.queue.extend(links.into_iter().map(Io::Read));
    }

    fn remove_dropin_of(&mut self, primary: &str) -> Option<Io> {
        let rec = self.dropins.remove(primary)?;
        if self.dropins.values().any(|r| r.dir_name == rec.dir_name) {
            return None; // another primary of the same network still needs it
        }
        Some(Io::RemoveDropIn {
            dir_name: rec.dir_name,
            file_name: rec.file_name,
            remove_dir: rec.created_dir,
        })
    }
}
