//! The durable pod store: one JSON file per pod in one directory.
//!
//! Layout of the store directory (created `0700`):
//!
//! * `pod-<32 hex>.json`: one pod, `{"schema": 1, "pod": <PodRecord>}`. The name is the
//!   first 128 bits of `sha256(container_id ++ "\0" ++ ifname)` in hex ([`file_name_for`]),
//!   so any container ID or interface name (slashes, dots, NULs, 4 KiB of text) gives a
//!   safe, fixed-length name. The record inside carries its key, and loading checks the
//!   name against it: a renamed or copied file is quarantined instead of being loaded
//!   under a key it does not belong to.
//! * `pod-<32 hex>.json.tmp-<pid>-<nonce>-<counter>`: a write in progress (or the
//!   leftover of a writer that crashed). Never loaded; removed by [`PodStore::open`].
//! * `quarantine/<name>.<unix-ms>`: files [`PodStore::load_all`] could not use, kept for
//!   a human to look at (created `0700` when first needed).
//!
//! Durability: [`PodStore::put`] writes a temporary file (`O_CREAT|O_EXCL|O_NOFOLLOW`,
//! mode `0600`) and renames it over the final name, so a crash of the writing process at
//! any point leaves either the old file or the new one, never a torn file (a torn
//! *temporary* file is never loaded). How far a returned `put` or `remove` survives is
//! the store's [`Durability`]: with [`Durability::PowerLoss`] (what [`PodStore::open`]
//! gives) the file is fsynced before the rename and the directory after it, so the
//! change also survives a power loss or a kernel crash; with
//! [`Durability::ProcessCrash`] neither flush is made, and the change survives the
//! agent's crash, kill or restart (the kernel's page cache outlives the process and
//! `rename(2)` is atomic in it) but not the node's. `rename(2)` replaces a symlink
//! planted at the final name instead of writing through it, so nothing is ever written
//! outside the directory.
//!
//! Startup (rule R3): the agent calls [`PodStore::load_all`] and merges the result into
//! its in-memory table with `flock_core::lifecycle::merge::PodTable::load_merge`, which
//! adds what is missing and never replaces or removes what the running agent already
//! knows. The store only loads; it never decides.
//!
//! Every method is synchronous and **blocks** on disk I/O (with
//! [`Durability::PowerLoss`], each `put` and `remove` waits for its fsyncs): call them
//! from `tokio::task::spawn_blocking` or a blocking thread.
//! [`decode_record`], [`encode_record`], [`validate_record`] and [`file_name_for`] are
//! pure and do no I/O.

use std::collections::hash_map::RandomState;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flock_core::pod::PodKey;
use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::PodRecord;

/// The schema version this agent writes and the only one it loads.
pub const SCHEMA_VERSION: u32 = 1;
/// Maximum size of one pod file in bytes (checked on `put` and before reading on load).
pub const MAX_FILE_BYTES: usize = 64 * 1024;
/// Name of the quarantine subdirectory inside the store directory.
pub const QUARANTINE_DIR: &str = "quarantine";
/// Age after which a temporary file of another process is removed by
/// [`PodStore::open`] even if its writer's PID is alive (see there).
pub const STALE_TEMP_AGE: Duration = Duration::from_secs(60);

const FILE_PREFIX: &str = "pod-";
const FILE_SUFFIX: &str = ".json";
const TEMP_MARKER: &str = ".json.tmp-";
const HASH_HEX_LEN: usize = 32;

/// What went wrong in a [`PodStore`] call; every message names the file or directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store directory is a symlink: refused, it could point anywhere.
    #[error("pod store directory {path} is a symlink; refusing to use it (use the real directory)")]
    DirIsSymlink {
        /// The directory path given to `open`.
        path: PathBuf,
    },
    /// A pod file of a newer schema than this agent reads: the store was written by a
    /// newer agent (a rollback). Refused whole, the files left in place: quarantining
    /// them would drop those pods' records.
    #[error(
        "pod store file {path} has schema {version}, written by a newer flock-agent; this \
         one reads schema {SCHEMA_VERSION} and refuses to start rather than drop those pods: run \
         the newer agent (roll forward), or move the store directory aside to start with no pods"
    )]
    NewerSchema {
        /// The file.
        path: PathBuf,
        /// Its schema version.
        version: u64,
    },
    /// The store path exists but is not a directory.
    #[error("pod store path {path} exists and is not a directory")]
    NotADirectory {
        /// The path given to `open`.
        path: PathBuf,
    },
    /// An I/O operation failed. The message ends with what the error means for the
    /// store when the filesystem is full or read-only ([`fault_hint`]).
    #[error("pod store: cannot {action} {path}: {source}{}", fault_hint(source))]
    Io {
        /// What was being done ("create directory", "write", "fsync", "rename to" ...).
        action: &'static str,
        /// The file or directory it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `put` was given a record that the pod validator refuses.
    #[error("refusing to store pod file {path}: {reason}")]
    InvalidRecord {
        /// The file it would have been written to.
        path: PathBuf,
        /// Which field and which limit.
        reason: String,
    },
    /// `put` was given a record whose encoding exceeds [`MAX_FILE_BYTES`].
    #[error(
        "refusing to store pod file {path}: encoded record is {size} bytes, over the {limit}-byte limit"
    )]
    RecordTooLarge {
        /// The file it would have been written to.
        path: PathBuf,
        /// The encoded size.
        size: usize,
        /// [`MAX_FILE_BYTES`].
        limit: usize,
    },
    /// `get` found a file it cannot use (it is left in place; `load_all` quarantines it).
    #[error("pod file {path} is unusable: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// What [`PodStore::load_all`] found.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// The valid pods, sorted by key.
    pub pods: Vec<PodRecord>,
    /// Each file moved to quarantine: where it was (its original path) and why.
    pub quarantined: Vec<(PathBuf, String)>,
}

/// The on-disk envelope: the schema version and the record.
#[derive(Serialize)]
struct EnvelopeOut<'a> {
    schema: u32,
    pod: &'a PodRecord,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeIn {
    #[allow(dead_code)] // Checked through `SchemaProbe` first.
    schema: u32,
    pod: PodRecord,
}

/// Reads only the schema field, so an unknown version is reported as such rather than
/// as whatever field mismatch the new schema happens to cause.
#[derive(Deserialize)]
struct SchemaProbe {
    schema: Option<serde_json::Value>,
}

/// A validated, encoded pod record, ready for [`PodStore::put_encoded`].
#[derive(Debug, Clone)]
pub struct EncodedRecord {
    file_name: String,
    bytes: Vec<u8>,
}

/// The pod store: one directory, one file per pod. Cheap to share (`&self` methods;
/// it is `Send + Sync`).
///
/// Concurrency: `put`/`remove`/`get` of *different* pods may run concurrently from
/// different threads (each write has its own temporary file and the final `rename` is
/// atomic). Calls for the *same* pod must be serialized by the caller (the agent does):
/// two concurrent `put`s of one pod are each atomic, but which one wins is unspecified.
#[derive(Debug)]
pub struct PodStore {
    dir: PathBuf,
    durability: Durability,
}

/// What a returned [`PodStore::put`] or [`PodStore::remove`] survives.
///
/// A pod store holds pod sandboxes, and no sandbox survives its node's reboot: after a
/// power loss the runtime creates new sandboxes (new container IDs, new CNI ADDs), and
/// the records of the old ones are orphans the agent's GC removes. What the store must
/// survive is the agent's own crash or restart while the node runs, which a rename
/// gives without a flush. [`Durability::PowerLoss`] is for a store whose records must
/// outlive the node's kernel; it costs two flushes per change (about 0.5 ms on this
/// project's test machines, most of what a chained ADD adds over `portmap`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Fsync the file before the rename and the directory after it (and after a
    /// removal): the change survives a power loss or kernel crash.
    #[default]
    PowerLoss,
    /// No flush: the change survives the writing process's crash or kill, not the
    /// node's. After a power loss a record may be missing, stale or empty; an empty or
    /// torn one is quarantined at the next load like any unusable file.
    ProcessCrash,
}

impl PodStore {
    /// Opens the store at `dir`, creating it (mode `0700`) if missing, and removes
    /// temporary files left by a crashed writer. Blocks.
    ///
    /// Refuses a `dir` that is a symlink ([`StoreError::DirIsSymlink`]) or not a
    /// directory. Parent directories may be symlinks.
    ///
    /// Temporary-file cleanup: a `*.json.tmp-<pid>-<nonce>-<n>` file is removed unless it
    /// was written by this very process (same PID *and* nonce: another `PodStore` in
    /// this process may be writing it right now) or by another live process less than
    /// [`STALE_TEMP_AGE`] ago. The PID alone is not enough: an agent restarted in a
    /// container is PID 1 again, so a leftover of its previous life carries our PID but
    /// not our nonce. Removing a live foreign writer's file only makes that writer's
    /// `put` fail (its rename finds no file); it never corrupts a pod file.
    pub fn open(dir: &Path) -> Result<PodStore, StoreError> {
        PodStore::open_with(dir, Durability::PowerLoss)
    }

    /// [`open`](Self::open) with the given [`Durability`] for every later change.
    pub fn open_with(dir: &Path, durability: Durability) -> Result<PodStore, StoreError> {
        match fs::symlink_metadata(dir) {
            Ok(meta) => check_dir_meta(dir, &meta)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(io_err("create directory", dir))?;
                // Re-check: something may have raced us and planted a symlink.
                let meta = fs::symlink_metadata(dir).map_err(io_err("stat", dir))?;
                check_dir_meta(dir, &meta)?;
                // The new entry in the parent must survive a crash too.
                if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                    fsync_dir(parent)?;
                }
            }
            Err(e) => return Err(io_err("stat", dir)(e)),
        }
        let store = PodStore {
            dir: dir.to_path_buf(),
            durability,
        };
        store.remove_leftover_temps()?;
        Ok(store)
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What a returned change survives.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    fn flushes(&self) -> bool {
        self.durability == Durability::PowerLoss
    }

    /// The path of `key`'s file (it may not exist).
    pub fn path_for(&self, key: &PodKey) -> PathBuf {
        self.dir.join(file_name_for(key))
    }

    /// Stores `rec`, replacing any previous record of its key. Blocks (on two fsyncs
    /// with [`Durability::PowerLoss`]).
    ///
    /// Validates the record ([`validate_record`]) and its encoded size
    /// ([`MAX_FILE_BYTES`]) first. Writes a fresh temporary file
    /// (`O_CREAT|O_EXCL|O_NOFOLLOW`, `0600`) and renames it over the final name: on
    /// return the record survives the process's crash, and with
    /// [`Durability::PowerLoss`] (file fsynced before the rename, directory after it)
    /// a power loss too.
    /// On error the previous file (if any) is untouched and the temporary file removed.
    pub fn put(&self, rec: &PodRecord) -> Result<(), StoreError> {
        let encoded = self.encode(rec)?;
        self.put_encoded(&encoded)
    }

    /// The first half of [`put`](Self::put), which does no I/O: validates `rec` and
    /// encodes it. An error here is the record's own ([`StoreError::InvalidRecord`],
    /// [`StoreError::RecordTooLarge`]); [`put_encoded`](Self::put_encoded) writes it.
    pub fn encode(&self, rec: &PodRecord) -> Result<EncodedRecord, StoreError> {
        let path = self.path_for(&rec.key);
        validate_record(rec).map_err(|reason| StoreError::InvalidRecord {
            path: path.clone(),
            reason,
        })?;
        let bytes = encode_record(rec).map_err(|reason| StoreError::InvalidRecord {
            path: path.clone(),
            reason,
        })?;
        if bytes.len() > MAX_FILE_BYTES {
            return Err(StoreError::RecordTooLarge {
                path,
                size: bytes.len(),
                limit: MAX_FILE_BYTES,
            });
        }
        Ok(EncodedRecord {
            file_name: file_name_for(&rec.key),
            bytes,
        })
    }

    /// The second half of [`put`](Self::put): writes a record [`encode`](Self::encode)
    /// made, as durably as the store's [`Durability`] says. Blocks.
    pub fn put_encoded(&self, rec: &EncodedRecord) -> Result<(), StoreError> {
        let path = self.dir.join(&rec.file_name);
        let tmp = self.dir.join(temp_name(&rec.file_name));
        let result = write_new_file(&tmp, &rec.bytes, self.flushes()).and_then(|()| {
            // `rename` replaces whatever is at `path` as a directory entry: a symlink
            // there is replaced, never followed, so the write stays inside the store.
            fs::rename(&tmp, &path).map_err(io_err("rename temporary file into", &path))
        });
        if let Err(e) = result {
            // A full filesystem still lets the temporary file be unlinked; a read-only
            // one does not (it cannot have been created there either, unless the
            // filesystem went read-only mid-write). A leftover is never loaded and the
            // next `open` removes it.
            match fs::remove_file(&tmp) {
                Ok(()) => {}
                Err(rm) if rm.kind() == io::ErrorKind::NotFound => {}
                Err(rm) => {
                    tracing::warn!(path = %tmp.display(), error = %rm, "pod store: cannot remove the temporary file of a failed write (never loaded; the next start removes it)")
                }
            }
            return Err(e);
        }
        // Without this the rename may be lost in a power loss: the old file (or none)
        // would come back although `put` returned Ok.
        if self.flushes() {
            fsync_dir(&self.dir)?;
        }
        Ok(())
    }

    /// Removes `key`'s file; `true` if it existed. Blocks (one fsync of the directory
    /// with [`Durability::PowerLoss`]).
    ///
    /// An error means the record may still be there (the file could not be removed,
    /// or its removal could not be made durable): the caller must not treat the pod
    /// as deleted, or it comes back at the next start. Removing a pod that has no file
    /// is `Ok(false)` also on a read-only filesystem, where `unlink(2)` fails with
    /// `EROFS` before it looks the name up.
    pub fn remove(&self, key: &PodKey) -> Result<bool, StoreError> {
        let path = self.path_for(key);
        match fs::remove_file(&path) {
            Ok(()) => {
                // Otherwise a power loss could resurrect the pod at the next startup.
                if self.flushes() {
                    fsync_dir(&self.dir)?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => match fs::symlink_metadata(&path) {
                Err(gone) if gone.kind() == io::ErrorKind::NotFound => Ok(false),
                _ => Err(io_err("remove", &path)(e)),
            },
        }
    }

    /// Reads `key`'s record; `None` if there is no file. Blocks.
    ///
    /// A file that exists but cannot be used (too large, invalid, wrong key, not a
    /// regular file) is [`StoreError::Corrupt`] and is left in place: quarantining is
    /// [`PodStore::load_all`]'s job, at startup, where it is reported.
    pub fn get(&self, key: &PodKey) -> Result<Option<PodRecord>, StoreError> {
        let name = file_name_for(key);
        let path = self.dir.join(&name);
        let bytes = match read_limited(&path) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            Err(reason) => return Err(StoreError::Corrupt { path, reason }),
        };
        match decode_record(&name, &bytes) {
            Ok(rec) if rec.key == *key => Ok(Some(rec)),
            Ok(rec) => Err(StoreError::Corrupt {
                path,
                reason: format!("holds key {:?}, asked for {:?}", rec.key, key),
            }),
            Err(reason) => Err(StoreError::Corrupt { path, reason }),
        }
    }

    /// Loads every `pod-*.json` file; files it cannot use are moved to quarantine. Blocks;
    /// never panics because of a file, and fails because of one only when it is of a
    /// newer schema ([`StoreError::NewerSchema`]: a rollback; nothing is moved).
    ///
    /// A file that is unreadable, over [`MAX_FILE_BYTES`], not a regular file (a
    /// directory, a symlink, a FIFO), not UTF-8, not valid JSON, of an unknown schema
    /// version, refused by the pod validator, or whose name does not match the key inside is
    /// moved to `<dir>/quarantine/<name>.<unix-ms>` and logged with `tracing::warn!`
    /// (path, reason, destination); it never makes this call fail or panic. Temporary
    /// files (writes in progress) and files that are not ours are skipped (debug log).
    ///
    /// Errors only if the directory itself cannot be listed: an empty report would
    /// tell the agent "no pods" when it simply could not look.
    pub fn load_all(&self) -> Result<LoadReport, StoreError> {
        let mut report = LoadReport::default();
        let entries = fs::read_dir(&self.dir).map_err(io_err("list directory", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(io_err("list directory", &self.dir))?;
            let os_name = entry.file_name();
            let Some(name) = os_name.to_str() else {
                tracing::debug!(path = %entry.path().display(), "pod store: ignoring a file with a non-UTF-8 name (not ours)");
                continue;
            };
            if name == QUARANTINE_DIR {
                continue;
            }
            if is_temp_name(name) {
                tracing::debug!(path = %entry.path().display(), "pod store: skipping a temporary file (a write in progress or a crash leftover)");
                continue;
            }
            if !(name.starts_with(FILE_PREFIX) && name.ends_with(FILE_SUFFIX)) {
                tracing::debug!(path = %entry.path().display(), "pod store: ignoring a file that is not a pod file");
                continue;
            }
            let path = entry.path();
            let outcome = match read_limited(&path) {
                Ok(Some(bytes)) => {
                    if let Some(version) = newer_schema(&bytes) {
                        return Err(StoreError::NewerSchema { path, version });
                    }
                    decode_record(name, &bytes)
                }
                // Vanished between listing and reading: a concurrent `remove`.
                Ok(None) => continue,
                Err(reason) => Err(reason),
            };
            match outcome {
                Ok(rec) => report.pods.push(rec),
                Err(reason) => {
                    let reason = self.quarantine(&path, name, reason);
                    report.quarantined.push((path, reason));
                }
            }
        }
        report.pods.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(report)
    }

    /// Moves `path` to the quarantine directory and logs it; returns the reason,
    /// extended with the quarantine failure if the move failed.
    fn quarantine(&self, path: &Path, name: &str, reason: String) -> String {
        match self.move_to_quarantine(name) {
            Ok(dest) => {
                tracing::warn!(
                    path = %path.display(),
                    reason = %reason,
                    moved_to = %dest.display(),
                    "pod store: unusable pod file quarantined (not loaded)"
                );
                reason
            }
            Err(e) => {
                // Left in place, not loaded; the next startup tries again.
                tracing::error!(
                    path = %path.display(),
                    reason = %reason,
                    error = %e,
                    "pod store: unusable pod file could not be quarantined; skipped (not loaded)"
                );
                format!("{reason} (could not quarantine: {e})")
            }
        }
    }

    fn move_to_quarantine(&self, name: &str) -> Result<PathBuf, StoreError> {
        let qdir = self.dir.join(QUARANTINE_DIR);
        match fs::symlink_metadata(&qdir) {
            Ok(meta) => check_dir_meta(&qdir, &meta)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                match DirBuilder::new().mode(0o700).create(&qdir) {
                    Ok(()) => {}
                    // Another thread created it first.
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(io_err("create directory", &qdir)(e)),
                }
                let meta = fs::symlink_metadata(&qdir).map_err(io_err("stat", &qdir))?;
                check_dir_meta(&qdir, &meta)?;
            }
            Err(e) => return Err(io_err("stat", &qdir)(e)),
        }
        let ms = flock_clock::unix_now().as_millis();
        let src = self.dir.join(name);
        // `rename` would silently replace an earlier quarantined file of the same
        // millisecond; pick a free name (the check-then-rename race only matters if two
        // loads run at once, which the agent does not do).
        let mut dest = qdir.join(format!("{name}.{ms}"));
        let mut n = 1u32;
        while fs::symlink_metadata(&dest).is_ok() {
            dest = qdir.join(format!("{name}.{ms}-{n}"));
            n += 1;
        }
        fs::rename(&src, &dest).map_err(io_err("move to quarantine", &src))?;
        fsync_dir(&qdir)?;
        fsync_dir(&self.dir)?;
        Ok(dest)
    }

    fn remove_leftover_temps(&self) -> Result<(), StoreError> {
        let entries = fs::read_dir(&self.dir).map_err(io_err("list directory", &self.dir))?;
        let (my_pid, my_nonce) = (std::process::id(), process_nonce());
        let mut removed = 0usize;
        for entry in entries {
            let entry = entry.map_err(io_err("list directory", &self.dir))?;
            let os_name = entry.file_name();
            let Some(name) = os_name.to_str() else {
                continue;
            };
            if !is_temp_name(name) {
                continue;
            }
            let path = entry.path();
            let writer = parse_temp_writer(name);
            if writer == Some((my_pid, my_nonce)) {
                continue; // Another PodStore of this process may be writing it now.
            }
            let age = entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| SystemTime::now().duration_since(t).ok());
            let writer_may_be_alive = match writer {
                // Our PID with another nonce: a previous life of this PID, so dead.
                Some((pid, _)) if pid == my_pid => false,
                Some((pid, _)) => pid_alive(pid),
                None => true,
            };
            if writer_may_be_alive && age.is_none_or(|a| a < STALE_TEMP_AGE) {
                tracing::debug!(path = %path.display(), "pod store: keeping a recent temporary file of a live process");
                continue;
            }
            match fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // A directory named like a temp file, say: harmless, never loaded.
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "pod store: cannot remove a leftover temporary file")
                }
            }
        }
        if removed > 0 {
            tracing::info!(dir = %self.dir.display(), removed, "pod store: removed temporary files left by an interrupted write");
            fsync_dir(&self.dir)?;
        }
        Ok(())
    }
}

/// The file name of `key`'s record: `pod-<first 32 hex of sha256(container_id ++ "\0" ++ ifname)>.json`.
///
/// The NUL separator makes the pair unambiguous (`("ab","c")` and `("a","bc")` differ);
/// neither part can contain a NUL in a CNI request.
pub fn file_name_for(key: &PodKey) -> String {
    let mut h = Sha256::new();
    h.update(key.container_id.as_bytes());
    h.update([0u8]);
    h.update(key.ifname.as_bytes());
    let digest = h.finalize();
    let mut name = String::with_capacity(FILE_PREFIX.len() + HASH_HEX_LEN + FILE_SUFFIX.len());
    name.push_str(FILE_PREFIX);
    for b in &digest[..HASH_HEX_LEN / 2] {
        name.push_str(&format!("{b:02x}"));
    }
    name.push_str(FILE_SUFFIX);
    name
}

/// Checks `rec` with the pod validator the CNI plugin, the agent and the translation
/// share ([`flock_core::pod::validate`]): a record that parses but could not be
/// served (no IP, a service name the translation refuses, a port list whose listener
/// ports do not follow the rule) is refused here, so it is quarantined at load
/// instead of reaching the publisher. The error names the field. A captured record's
/// capture must give rules for its ports (lists within the capture limits, a nonzero
/// mark), or start-up repair could not re-apply them.
pub fn validate_record(rec: &PodRecord) -> Result<(), String> {
    flock_core::pod::validate(&rec.fields()).map_err(|e| e.to_string())?;
    if let Some(a) = &rec.authz {
        flock_core::authz::check_annotation_size(a)
            .map_err(|e| format!("{}: {e}", flock_core::authz::ANNOTATION))?;
    }
    match &rec.capture {
        Some(c) => c.check(&rec.ports).map_err(|e| format!("capture: {e}")),
        None => Ok(()),
    }
}

/// Encodes `rec` as the bytes of its pod file: `{"schema":1,"pod":{...}}`.
///
/// Does not check the limits (see [`validate_record`] and [`MAX_FILE_BYTES`]).
pub fn encode_record(rec: &PodRecord) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&EnvelopeOut {
        schema: SCHEMA_VERSION,
        pod: rec,
    })
    .map_err(|e| format!("cannot encode the record: {e}"))
}

/// The schema version of a pod file's bytes when it is newer than
/// [`SCHEMA_VERSION`] (what a newer agent wrote); `None` for anything else, which
/// [`decode_record`] judges.
pub fn newer_schema(bytes: &[u8]) -> Option<u64> {
    if bytes.len() > MAX_FILE_BYTES {
        return None;
    }
    let probe: SchemaProbe = serde_json::from_slice(bytes).ok()?;
    probe
        .schema?
        .as_u64()
        .filter(|v| *v > u64::from(SCHEMA_VERSION))
}

/// Decodes the bytes of a pod file named `file_name` (no directory); pure, no I/O.
///
/// Checks, in order: size ([`MAX_FILE_BYTES`]), UTF-8, JSON, the schema version
/// ([`SCHEMA_VERSION`] only), the record (unknown fields are errors), its fields
/// ([`validate_record`]), and that `file_name` is [`file_name_for`] the key inside.
/// The error says what is wrong, for the quarantine log.
pub fn decode_record(file_name: &str, bytes: &[u8]) -> Result<PodRecord, String> {
    if bytes.len() > MAX_FILE_BYTES {
        return Err(format!(
            "file is over the {MAX_FILE_BYTES}-byte limit ({}{} bytes)",
            if bytes.len() == MAX_FILE_BYTES + 1 {
                "at least "
            } else {
                ""
            },
            bytes.len()
        ));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|e| format!("not UTF-8 (invalid byte at offset {})", e.valid_up_to()))?;
    if text.trim().is_empty() {
        return Err("empty file".into());
    }
    let probe: SchemaProbe =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    match probe.schema {
        None => {
            return Err(format!(
                "no \"schema\" field; this agent supports schema {SCHEMA_VERSION}"
            ));
        }
        Some(v) if v.as_u64() != Some(u64::from(SCHEMA_VERSION)) => {
            return Err(format!(
                "schema version {v}; this agent supports only schema {SCHEMA_VERSION}"
            ));
        }
        Some(_) => {}
    }
    let envelope: EnvelopeIn = serde_json::from_str(text)
        .map_err(|e| format!("invalid schema-{SCHEMA_VERSION} record: {e}"))?;
    let rec = envelope.pod;
    validate_record(&rec).map_err(|e| format!("invalid record: {e}"))?;
    let expected = file_name_for(&rec.key);
    if file_name != expected {
        return Err(format!(
            "file name {file_name:?} does not match the key inside (container_id {:?}, ifname {:?}, whose file is {expected:?}): renamed or tampered with",
            rec.key.container_id, rec.key.ifname
        ));
    }
    Ok(rec)
}

fn check_dir_meta(path: &Path, meta: &fs::Metadata) -> Result<(), StoreError> {
    if meta.file_type().is_symlink() {
        return Err(StoreError::DirIsSymlink {
            path: path.to_path_buf(),
        });
    }
    if !meta.is_dir() {
        return Err(StoreError::NotADirectory {
            path: path.to_path_buf(),
        });
    }
    if meta.permissions().mode() & 0o022 != 0 {
        // Not changed (the operator chose it), but anyone who can write here can plant
        // pods that the agent will load.
        tracing::warn!(
            path = %path.display(),
            mode = format!("{:o}", meta.permissions().mode() & 0o7777),
            "pod store: directory is writable by group or others"
        );
    }
    Ok(())
}

/// What an I/O error means for the store, appended to [`StoreError::Io`]'s message:
/// the bare OS text ("No space left on device") does not say that the pod store is
/// what is affected, that the records already stored are safe, or what to do. Empty
/// for other errors.
pub fn fault_hint(source: &io::Error) -> &'static str {
    use nix::errno::Errno;
    match source.raw_os_error().map(Errno::from_raw) {
        Some(Errno::ENOSPC | Errno::EDQUOT) => {
            " (the filesystem holding the pod store is full or over quota; the records \
             already stored are intact; free space and retry)"
        }
        Some(Errno::EROFS) => {
            " (the filesystem holding the pod store is read-only; the records already \
             stored are intact; remount it read-write and retry)"
        }
        _ => "",
    }
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

fn fsync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync directory", dir))
}

fn write_new_file(path: &Path, bytes: &[u8], flush: bool) -> Result<(), StoreError> {
    // O_EXCL: never reuse or truncate an existing file (or a planted symlink: with
    // O_CREAT|O_EXCL the kernel fails on a symlink instead of following it);
    // O_NOFOLLOW says the same explicitly.
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(path)
        .map_err(io_err("create temporary file", path))?;
    file.write_all(bytes).map_err(io_err("write", path))?;
    if !flush {
        return Ok(());
    }
    // Data before rename: otherwise a power loss after the rename can leave an empty
    // file under the final name (ext4 delalloc, XFS).
    file.sync_all().map_err(io_err("fsync", path))
}

/// Reads a pod file, at most `MAX_FILE_BYTES + 1` bytes. `Ok(None)`: no such file.
/// `Err`: the reason it is unusable (not a regular file, unreadable, too large).
fn read_limited(path: &Path) -> Result<Option<Vec<u8>>, String> {
    // Check the type first: opening a FIFO would block, and a symlink (which we never
    // create) could point anywhere.
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot stat: {e}")),
    };
    let ft = meta.file_type();
    if ft.is_symlink() {
        return Err("is a symlink (the store never creates one)".into());
    }
    if ft.is_dir() {
        return Err("is a directory, not a pod file".into());
    }
    if !ft.is_file() {
        return Err("is not a regular file".into());
    }
    // O_NONBLOCK and O_NOFOLLOW: the entry may have been swapped since the stat.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open: {e}")),
    };
    let meta = file.metadata().map_err(|e| format!("cannot stat: {e}"))?;
    if !meta.is_file() {
        return Err("is not a regular file".into());
    }
    // Size limit before reading it all; `take` bounds the read anyway in case the
    // file grows after the stat.
    if meta.len() > MAX_FILE_BYTES as u64 {
        return Err(format!(
            "file is {} bytes, over the {MAX_FILE_BYTES}-byte limit",
            meta.len()
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    Ok(Some(bytes))
}

/// A random number fixed for the life of this process: tells our temporary files from
/// those of an earlier process that had the same PID.
fn process_nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        // RandomState is seeded from the OS's randomness; no extra dependency.
        let mut h = RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    })
}

/// `<final>.tmp-<pid>-<nonce hex>-<counter>`: unique across threads (the counter),
/// processes (the PID) and process lifetimes (the nonce).
fn temp_name(final_name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{final_name}.tmp-{}-{:016x}-{n}",
        std::process::id(),
        process_nonce()
    )
}

fn is_temp_name(name: &str) -> bool {
    name.starts_with(FILE_PREFIX) && name.contains(TEMP_MARKER)
}

/// The (PID, nonce) of a temporary file's writer, if its name has them.
fn parse_temp_writer(name: &str) -> Option<(u32, u64)> {
    let (_, tail) = name.split_once(TEMP_MARKER)?;
    let mut parts = tail.split('-');
    let pid = parts.next()?.parse().ok()?;
    let nonce = u64::from_str_radix(parts.next()?, 16).ok()?;
    Some((pid, nonce))
}

fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    // Signal 0: existence check only. EPERM means it exists (someone else's).
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_name_is_fixed_length_hex_and_separates_the_parts() {
        let a = file_name_for(&PodKey::new("ab", "c"));
        let b = file_name_for(&PodKey::new("a", "bc"));
        assert_ne!(a, b);
        assert_eq!(
            a.len(),
            FILE_PREFIX.len() + HASH_HEX_LEN + FILE_SUFFIX.len()
        );
        let weird = file_name_for(&PodKey::new("../../etc/passwd\0x/", "eth0/.."));
        assert!(weird.starts_with("pod-") && weird.ends_with(".json"));
        assert!(!weird[4..weird.len() - 5].contains(|c: char| !c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_full_or_read_only_filesystem_is_named_with_the_path_and_what_to_do() {
        let err = |errno: nix::errno::Errno| StoreError::Io {
            action: "write",
            path: PathBuf::from("/var/lib/flock/pods/pod-1.json.tmp-1-2-3"),
            source: io::Error::from_raw_os_error(errno as i32),
        };
        let full = err(nix::errno::Errno::ENOSPC).to_string();
        for needle in [
            "/var/lib/flock/pods/",
            "No space left on device",
            "full",
            "free space",
        ] {
            assert!(full.contains(needle), "{needle:?} not in {full:?}");
        }
        let ro = err(nix::errno::Errno::EROFS).to_string();
        for needle in [
            "/var/lib/flock/pods/",
            "Read-only file system",
            "remount it read-write",
        ] {
            assert!(ro.contains(needle), "{needle:?} not in {ro:?}");
        }
        let other = err(nix::errno::Errno::EIO).to_string();
        assert!(other.ends_with("(os error 5)"), "{other}");
    }

    #[test]
    fn temp_names_parse_back_to_this_process() {
        let t = temp_name(&file_name_for(&PodKey::new("c", "eth0")));
        assert!(is_temp_name(&t));
        assert_eq!(
            parse_temp_writer(&t),
            Some((std::process::id(), process_nonce()))
        );
        assert_ne!(t, temp_name(&file_name_for(&PodKey::new("c", "eth0"))));
    }
}
