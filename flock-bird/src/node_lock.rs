//! One serving agent per node: an exclusive `flock(2)` on the state directory itself,
//! taken before the agent writes anything of the node's (the pod store, the registry
//! lease, the CNI and xDS sockets) and held until the process exits. The directory,
//! not a file in it: it needs no write access (an agent restarting on a read-only or
//! full store still starts and says why it cannot write), and adds nothing to the
//! store's listing.
//!
//! The race it closes: an upgrade that starts the new agent beside the old one (a
//! DaemonSet with `maxSurge: 1`) would otherwise have two agents on one store, one
//! renaming its records over the other's and each binding the sockets from under the
//! other. With the lock the newcomer waits, ready to take over (its API watches
//! synced), and takes the node the moment the old agent's process is gone: the kernel
//! drops a `flock(2)` lock with its last descriptor, so a killed or crashed agent never
//! leaves the node locked.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};

/// The held lock (released when dropped, and when the process exits).
#[derive(Debug)]
pub struct NodeLock {
    _lock: Flock<File>,
    path: PathBuf,
}

/// Whether the lock was free or another agent held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Nobody held it.
    AtOnce,
    /// Another process held it; this one waited for it to let go.
    AfterWaiting,
}

impl NodeLock {
    /// Takes the node's lock on `state_dir` (created 0700 when missing; never through
    /// a symlink), waiting for another agent that holds it to exit. `on_wait` runs once
    /// if it must wait (the agent then says it is standing by).
    pub async fn acquire(
        state_dir: &Path,
        on_wait: impl FnOnce(&Path),
    ) -> anyhow::Result<(NodeLock, Taken)> {
        let file = open(state_dir)?;
        let path = state_dir.to_path_buf();
        // The mutant takes a shared lock: a second agent gets it at once and serves
        // beside the first, as before the lock.
        let how = if flock_core::reintroduced!("agent-no-node-lock") {
            FlockArg::LockSharedNonblock
        } else {
            FlockArg::LockExclusiveNonblock
        };
        match Flock::lock(file, how) {
            Ok(lock) => Ok((NodeLock { _lock: lock, path }, Taken::AtOnce)),
            Err((file, Errno::EWOULDBLOCK)) => {
                on_wait(&path);
                let waited = path.clone();
                let lock = tokio::task::spawn_blocking(move || {
                    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| e)
                })
                .await
                .map_err(|e| anyhow::anyhow!("waiting for {}: {e}", waited.display()))?
                .map_err(|e| anyhow::anyhow!("locking {}: {e}", waited.display()))?;
                Ok((NodeLock { _lock: lock, path }, Taken::AfterWaiting))
            }
            Err((_, e)) => Err(anyhow::anyhow!("locking {}: {e}", path.display())),
        }
    }

    /// The locked directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Writes `text` to `path` atomically (a new temporary file beside it, renamed over
/// it), never through a symlink: the `--ready-file`, which a readiness probe tests.
pub fn write_ready_file(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(&tmp)?;
    f.write_all(format!("{text}\n").as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn open(state_dir: &Path) -> anyhow::Result<File> {
    match std::fs::symlink_metadata(state_dir) {
        Ok(meta) if meta.file_type().is_dir() => {}
        Ok(_) => anyhow::bail!(
            "the state directory {} is not a directory (a symlink is not followed)",
            state_dir.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(state_dir)
                .map_err(|e| anyhow::anyhow!("creating {}: {e}", state_dir.display()))?;
            let meta = std::fs::symlink_metadata(state_dir)
                .map_err(|e| anyhow::anyhow!("{}: {e}", state_dir.display()))?;
            anyhow::ensure!(
                meta.file_type().is_dir(),
                "the state directory {} is not a directory",
                state_dir.display()
            );
        }
        Err(e) => anyhow::bail!("{}: {e}", state_dir.display()),
    }
    OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(state_dir)
        .map_err(|e| anyhow::anyhow!("opening the state directory {}: {e}", state_dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_holder_waits_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let (first, taken) = NodeLock::acquire(&state, |_| panic!("the first must not wait"))
            .await
            .unwrap();
        assert_eq!(taken, Taken::AtOnce);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(first.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "a state directory it made");
        assert_eq!(
            std::fs::read_dir(&state).unwrap().count(),
            0,
            "no lock file"
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn({
            let state = state.clone();
            async move {
                NodeLock::acquire(&state, move |_| {
                    let _ = tx.send(());
                })
                .await
                .unwrap()
            }
        });
        // The second one says it waits, and does not get the lock while the first holds it.
        rx.await.expect("the second acquire reported waiting");
        assert!(!waiter.is_finished());
        drop(first);
        let (_second, taken) = waiter.await.unwrap();
        assert_eq!(taken, Taken::AfterWaiting);
    }

    #[tokio::test]
    async fn a_symlinked_state_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = NodeLock::acquire(&link, |_| {}).await.unwrap_err();
        assert!(e.to_string().contains("not followed"), "{e}");
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
    }
}
