//! The installer machine's vocabulary: the settings, what the I/O side reports
//! ([`Event`], [`Entry`], [`WriteOutcome`], [`DropInDir`]), what it is asked to do
//! ([`Io`], [`Write`], [`Expect`]) and the per-file states ([`FileState`], [`Blocked`]).

use std::fmt;

use super::super::dropin::DropIn;
use super::super::ledger::{InstallPolicy, SkipReason};

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

    /// The state a [`SkipReason`] of [`decide`](crate::cniconf::decide) puts a file in; `None` for a name that
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
