//! The per-file ledger of our own writes and the event decision: no patch loop.
//!
//! The loop this prevents: a shell installer kept a single `cni_conf_sha`
//! for the whole directory. Two configs created within a millisecond, A and B: it
//! patched A (hash := A'), then B (hash := B'); the event of its own write to A then
//! compared A' with B', looked external, and A was patched again (hash := A'), which
//! made B's own-write event look external, and so on forever.
//!
//! Two independent brakes here:
//! 1. [`Ledger`] keeps one hash *per file*, so our own write is recognised whatever
//!    happened to other files in between ([`Action::IgnoreOwnWrite`]).
//! 2. [`decide`] never writes a file that is already semantically patched
//!    ([`Action::AlreadyPatched`]), so even a misclassified event cannot cause a write.
//!
//! Inotify events carry no content: the installer reads the file's *current* bytes when
//! it handles an event and calls [`decide`] with them.

use std::collections::BTreeMap;
use std::fmt;

use crate::hash::ContentHash;

use super::error::CniConfError;
use super::parse::{conflist_file_name_for, kind_for_file_name, parse};
use super::patch::{ConfPolicy, OurPlugin, patch};

/// Re-introduces the patch loop's first cause (one hash slot shared by all files) so the property test
/// can show it catches it; never enabled in builds.
fn shared_hash() -> bool {
    crate::reintroduced!("ledger-shared-hash")
}

/// Re-introduces the patch loop's second cause (every external change is rewritten, even when already
/// patched) so the property test can show it catches it; never enabled in builds.
fn rewrite_patched() -> bool {
    crate::reintroduced!("ledger-rewrite")
}

/// Per-file record of the bytes flock last wrote (or adopted as already patched): path →
/// [`ContentHash`].
///
/// Paths are compared as given: the installer must spell each file's path the same way
/// every time (e.g. directory + file name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    entries: BTreeMap<String, ContentHash>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key a path is stored under: the path itself.
    fn slot(path: &str) -> &str {
        if shared_hash() { "" } else { path }
    }

    /// Records that `path` now holds `bytes` written (or adopted) by us; returns the hash.
    pub fn record(&mut self, path: &str, bytes: &[u8]) -> ContentHash {
        let hash = ContentHash::of(bytes);
        self.record_hash(path, hash);
        hash
    }

    /// Records a hash computed elsewhere.
    pub fn record_hash(&mut self, path: &str, hash: ContentHash) {
        self.entries.insert(Self::slot(path).to_owned(), hash);
    }

    /// Forgets `path` (deleted, restored or converted away); returns what was recorded.
    pub fn forget(&mut self, path: &str) -> Option<ContentHash> {
        self.entries.remove(Self::slot(path))
    }

    /// The hash recorded for `path`.
    pub fn get(&self, path: &str) -> Option<ContentHash> {
        self.entries.get(Self::slot(path)).copied()
    }

    /// True when `bytes` are exactly what we last wrote to `path`.
    pub fn is_own_write(&self, path: &str, bytes: &[u8]) -> bool {
        self.get(path) == Some(ContentHash::of(bytes))
    }

    /// Number of files recorded.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The recorded paths and hashes, sorted by path.
    pub fn iter(&self) -> impl Iterator<Item = (&str, ContentHash)> {
        self.entries.iter().map(|(p, h)| (p.as_str(), *h))
    }
}

/// What the installer chains, and how it treats `.conf` primaries.
#[derive(Debug, Clone)]
pub struct InstallPolicy {
    /// Our plugin entry.
    pub ours: OurPlugin,
    /// What to do with single-plugin `.conf`/`.json` primaries.
    pub conf_policy: ConfPolicy,
}

/// A `.conf` converted to a list must move to a `.conflist`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileNameChange {
    /// Where to write the bytes: `<stem>.conflist` next to the `.conf`.
    pub new_path: String,
}

/// Why an event leads to no write. `Display` tells an operator what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// Not `.conf`, `.conflist` or `.json`: runtimes never load it.
    NotAConfigFile,
    /// Empty or truncated JSON: a writer is probably mid-write; the next event brings
    /// the rest.
    Incomplete(CniConfError),
    /// Not a valid CNI config: left untouched.
    Invalid(CniConfError),
    /// Valid, but flock will not chain into it (version, `.conf` policy, ...).
    Refused(CniConfError),
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAConfigFile => f.write_str(
                "not a CNI config file name (.conf, .conflist, .json); runtimes ignore it",
            ),
            Self::Incomplete(e) => write!(
                f,
                "{e}; probably written non-atomically and still in progress: \
                 waiting for the next change (if it stays like this, fix the file)"
            ),
            Self::Invalid(e) => write!(
                f,
                "invalid CNI config, left untouched: {e}; fix or remove the file \
                 (runtimes cannot load it either)"
            ),
            Self::Refused(e) => write!(f, "not patched: {e}"),
        }
    }
}

/// What the installer does about one event for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The file holds exactly what we last wrote to *this* file: our own write.
    IgnoreOwnWrite,
    /// Write `bytes` atomically (temp file, fsync, rename, fsync dir), then
    /// [`Ledger::record`] them under the path written.
    Write {
        /// The patched config.
        bytes: Vec<u8>,
        /// `Some` when a `.conf` was converted: write `bytes` to `new_path` first, then
        /// remove the `.conf` and [`Ledger::forget`] it. (`<stem>.conf` sorts before
        /// `<stem>.conflist`, so until the removal the runtime still loads the valid,
        /// unpatched `.conf`: loadable at every instant.)
        file_name_change: Option<FileNameChange>,
    },
    /// An external change that is already patched: [`Ledger::record`] the current bytes,
    /// write nothing.
    AlreadyPatched,
    /// Do nothing; log the reason.
    Skip(SkipReason),
}

/// Decides what to do about an event for `path`, whose current content is `bytes`.
///
/// Pure. Order: file name (never a non-config file), own write (ledger hash of *this*
/// file), parse (invalid or partial files are never written), patch.
pub fn decide(path: &str, bytes: &[u8], ledger: &Ledger, policy: &InstallPolicy) -> Action {
    let Some(kind) = kind_for_file_name(path) else {
        return Action::Skip(SkipReason::NotAConfigFile);
    };
    if ledger.is_own_write(path, bytes) {
        return Action::IgnoreOwnWrite;
    }
    let config = match parse(bytes, kind) {
        Ok(config) => config,
        Err(e) if e.is_incomplete() => return Action::Skip(SkipReason::Incomplete(e)),
        Err(e) => return Action::Skip(SkipReason::Invalid(e)),
    };
    let patched = match patch(&config, &policy.ours, policy.conf_policy) {
        Ok(patched) => patched,
        Err(e) => return Action::Skip(SkipReason::Refused(e)),
    };
    if !patched.changed && !rewrite_patched() {
        return Action::AlreadyPatched;
    }
    let file_name_change = if patched.converted_from_conf {
        match conflist_file_name_for(path) {
            Some(new_path) => Some(FileNameChange { new_path }),
            // Unreachable: `kind` is Conf, so the name ends in .conf or .json.
            None => return Action::Skip(SkipReason::NotAConfigFile),
        }
    } else {
        None
    };
    Action::Write {
        bytes: patched.config.to_bytes(),
        file_name_change,
    }
}
