//! The epoch state file `<state-dir>/epoch` and its lock `<state-dir>/epoch.lock`.
//!
//! * Reads are lock-free: the file is only ever replaced by `rename(2)`, so a reader
//!   sees a whole old or a whole new record.
//! * Writes are [`flock_core::epoch::write_decision`] executed as one read-modify-write
//!   under `flock(LOCK_EX)` on the lock file (race R8: without the lock two writers
//!   can both read, both decide to write, and the later write regresses the file).
//! * Files are created `0600` with `O_NOFOLLOW`, the new record goes to a temporary
//!   file created with `O_EXCL` and is renamed over `epoch` (`rename` replaces a
//!   symlink, it never writes through one), and the directory is fsync'd. A state
//!   directory that is a symlink is refused.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use flock_core::epoch::{EpochRecord, EpochRecordError, MAX_RECORD_BYTES, WriteDecision};
use nix::fcntl::{Flock, FlockArg, OFlag};

/// The state file's name inside the state directory.
pub const STATE_FILE: &str = "epoch";
/// The lock file's name inside the state directory.
pub const LOCK_FILE: &str = "epoch.lock";
const TMP_FILE: &str = "epoch.tmp";

/// The state directory of one node's hot-restart chain.
#[derive(Clone, Debug)]
pub struct StateDir {
    dir: PathBuf,
}

/// What [`StateDir::read`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadRecord {
    /// No state file.
    Missing,
    /// A valid record.
    Record(EpochRecord),
    /// A file that does not parse (the caller logs it and treats it as no record).
    Invalid(EpochRecordError),
}

impl ReadRecord {
    /// The record, if valid.
    pub fn record(&self) -> Option<&EpochRecord> {
        match self {
            Self::Record(r) => Some(r),
            _ => None,
        }
    }
}

impl StateDir {
    /// Opens (creating it `0700` if needed) the state directory. Refuses a symlink or a
    /// non-directory.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(io::Error::other(format!(
                    "state directory {} is a symlink; refusing to follow it",
                    dir.display()
                )));
            }
            Ok(meta) if !meta.is_dir() => {
                return Err(io::Error::other(format!(
                    "state directory {} is not a directory",
                    dir.display()
                )));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&dir)?;
            }
            Err(e) => return Err(e),
        }
        Ok(Self { dir })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The state file's path.
    pub fn state_file(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Reads the state file without locking (see the module docs).
    pub fn read(&self) -> io::Result<ReadRecord> {
        read_record(&self.state_file())
    }

    /// Executes `decide(on_disk)` as a read-modify-write under the exclusive lock:
    /// reads the record, asks `decide`, and if it says
    /// [`WriteDecision::Write`] replaces the file atomically before unlocking. Another
    /// writer's `locked_update` waits meanwhile, so `decide` always sees the newest
    /// record and the file never regresses.
    /// Blocking: call it from a blocking context (`spawn_blocking`).
    pub fn locked_update(
        &self,
        decide: impl FnOnce(Option<&EpochRecord>) -> WriteDecision,
    ) -> io::Result<(ReadRecord, WriteDecision)> {
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(self.dir.join(LOCK_FILE))?;
        let _lock = if flock_core::reintroduced!("r8-lock") {
            // Re-introduces R8 so tests/statefile_lock.rs can show it catches it; never
            // in real builds: the read-decide-write without the lock, so a writer that
            // read an old record can replace a newer one written meanwhile.
            drop(lock_file);
            None
        } else {
            Some(
                Flock::lock(lock_file, FlockArg::LockExclusive)
                    .map_err(|(_, errno)| io::Error::from(errno))?,
            )
        };
        let on_disk = self.read()?;
        let decision = decide(on_disk.record());
        if let WriteDecision::Write { record, .. } = &decision {
            self.replace(record.encode().as_bytes())?;
        }
        Ok((on_disk, decision))
        // `_lock` drops here: LOCK_UN after the rename.
    }

    /// Replaces the state file with `bytes` (caller holds the lock).
    fn replace(&self, bytes: &[u8]) -> io::Result<()> {
        let tmp = self.dir.join(TMP_FILE);
        // Only the lock holder writes the temporary file: a leftover is from a writer
        // that died mid-write.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, self.state_file())?;
        File::open(&self.dir)?.sync_all()
    }
}

fn read_record(path: &Path) -> io::Result<ReadRecord> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReadRecord::Missing),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::with_capacity(MAX_RECORD_BYTES + 1);
    // One byte more than the limit, so the parser reports "too large".
    file.take(MAX_RECORD_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok(match EpochRecord::parse(&bytes) {
        Ok(r) => ReadRecord::Record(r),
        Err(e) => ReadRecord::Invalid(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flock_core::UnixMs;
    use flock_core::epoch::{WriterId, write_decision};
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "flock-statefile-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&p);
            Self(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn rec(epoch: u32, writer: &str) -> EpochRecord {
        EpochRecord::new(epoch, 7, UnixMs::ZERO, WriterId::new(writer).unwrap())
    }

    #[test]
    fn write_then_read_round_trips_with_private_modes() {
        let tmp = TempDir::new("rt");
        let dir = StateDir::open(tmp.0.join("state")).unwrap();
        assert_eq!(dir.read().unwrap(), ReadRecord::Missing);
        let (_, d) = dir
            .locked_update(|on_disk| {
                write_decision(on_disk, &rec(2, "a"), true, UnixMs(1_000), 5_000)
            })
            .unwrap();
        assert!(matches!(d, WriteDecision::Write { .. }), "{d}");
        let ReadRecord::Record(r) = dir.read().unwrap() else {
            panic!()
        };
        assert_eq!((r.epoch, r.heartbeat_unix_ms), (2, UnixMs(1_000)));
        let mode = |p: PathBuf| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(dir.state_file()), 0o600);
        assert_eq!(mode(tmp.0.join("state").join(LOCK_FILE)), 0o600);
        assert_eq!(mode(tmp.0.join("state")), 0o700);
    }

    #[test]
    fn invalid_file_is_reported_and_repaired() {
        let tmp = TempDir::new("bad");
        let dir = StateDir::open(&tmp.0).unwrap();
        fs::write(dir.state_file(), b"garbage").unwrap();
        assert!(matches!(dir.read().unwrap(), ReadRecord::Invalid(_)));
        let (before, _) = dir
            .locked_update(|on_disk| write_decision(on_disk, &rec(0, "a"), true, UnixMs(1), 5_000))
            .unwrap();
        assert!(matches!(before, ReadRecord::Invalid(_)));
        assert!(matches!(dir.read().unwrap(), ReadRecord::Record(_)));
    }

    #[test]
    fn symlinks_are_never_followed() {
        let tmp = TempDir::new("link");
        fs::create_dir_all(&tmp.0).unwrap();
        let target = tmp.0.join("target");
        fs::write(&target, b"precious").unwrap();
        // A symlinked state file: reads refuse it, the write replaces the link itself.
        let dir = StateDir::open(tmp.0.join("state")).unwrap();
        std::os::unix::fs::symlink(&target, dir.state_file()).unwrap();
        assert!(dir.read().is_err());
        // A symlinked lock file: refused.
        std::os::unix::fs::symlink(&target, tmp.0.join("state").join(LOCK_FILE)).unwrap();
        assert!(
            dir.locked_update(|d| write_decision(d, &rec(0, "a"), true, UnixMs(1), 5_000))
                .is_err()
        );
        assert_eq!(fs::read(&target).unwrap(), b"precious");
        // A symlinked state directory: refused.
        std::os::unix::fs::symlink(tmp.0.join("state"), tmp.0.join("alias")).unwrap();
        assert!(StateDir::open(tmp.0.join("alias")).is_err());
    }

    /// R8 with real files and real `flock(2)`: a draining epoch 3 and its successor
    /// epoch 4 heartbeat concurrently from many threads; every writer checks, under the
    /// lock, that the file never shows a lower epoch than one already written.
    #[test]
    fn concurrent_heartbeats_never_regress_the_file() {
        let tmp = TempDir::new("r8");
        let dir = StateDir::open(&tmp.0).unwrap();
        let floor = std::sync::Arc::new(AtomicU32::new(0));
        std::thread::scope(|s| {
            for t in 0..6u32 {
                let dir = dir.clone();
                let floor = floor.clone();
                s.spawn(move || {
                    let mine = if t % 2 == 0 {
                        rec(3, "old")
                    } else {
                        rec(4, "new")
                    };
                    for i in 0..200u64 {
                        let now = UnixMs(10_000 + i);
                        dir.locked_update(|on_disk| {
                            let seen = on_disk.map_or(0, |r| r.epoch);
                            let min = floor.load(Ordering::SeqCst);
                            assert!(seen >= min, "state file regressed from {min} to {seen}");
                            let d = write_decision(on_disk, &mine, true, now, 5_000);
                            if let WriteDecision::Write { record, .. } = &d {
                                floor.fetch_max(record.epoch, Ordering::SeqCst);
                            }
                            d
                        })
                        .unwrap();
                    }
                });
            }
        });
        assert_eq!(dir.read().unwrap().record().unwrap().epoch, 4);
    }
}
