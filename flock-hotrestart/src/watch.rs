//! Watching the bootstrap config with inotify.
//!
//! The watch is on the config's **directory**, filtered by name, so edits that replace
//! the file (an editor's write-and-rename, a Kubernetes ConfigMap's `..data` symlink
//! swap) are seen as well as in-place writes. The caller compares contents: an event
//! is only a hint that the file may have changed.
//!
//! The watch is armed in [`ConfigWatcher::new`], before the caller reads the config
//! for the first time, so no change between the two is missed. A dedicated thread
//! does the blocking reads and forwards one wake-up per batch of events.

use std::ffi::OsString;
use std::io;
use std::path::Path;

use inotify::{Inotify, WatchMask};
use tokio::sync::mpsc;

/// The name a Kubernetes ConfigMap volume swaps atomically on every update.
const CONFIGMAP_DATA: &str = "..data";

/// Reports changes to one file.
pub struct ConfigWatcher {
    rx: mpsc::Receiver<io::Result<()>>,
}

impl ConfigWatcher {
    /// Watches `config` (its directory must exist).
    pub fn new(config: &Path) -> io::Result<Self> {
        let name: OsString = config
            .file_name()
            .ok_or_else(|| io::Error::other(format!("{} has no file name", config.display())))?
            .to_owned();
        let dir = match config.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        let mut inotify = Inotify::init()?;
        inotify.watches().add(
            &dir,
            WatchMask::CLOSE_WRITE
                | WatchMask::MODIFY
                | WatchMask::MOVED_TO
                | WatchMask::CREATE
                | WatchMask::ATTRIB,
        )?;
        // Capacity 1: a pending wake-up already covers every later event.
        let (tx, rx) = mpsc::channel(1);
        std::thread::Builder::new()
            .name("flock-config-watch".into())
            .spawn(move || {
                let mut buf = vec![0u8; 4096];
                loop {
                    let hit = match inotify.read_events_blocking(&mut buf) {
                        Ok(events) => events.into_iter().any(|e| {
                            e.name
                                .is_some_and(|n| n == name.as_os_str() || n == CONFIGMAP_DATA)
                        }),
                        Err(e) => {
                            let _ = tx.blocking_send(Err(e));
                            return;
                        }
                    };
                    if hit {
                        match tx.try_send(Ok(())) {
                            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                            Err(mpsc::error::TrySendError::Closed(_)) => return,
                        }
                    }
                }
            })?;
        Ok(Self { rx })
    }

    /// Resolves at the next event that may have changed the file.
    pub async fn changed(&mut self) -> io::Result<()> {
        match self.rx.recv().await {
            Some(r) => r,
            None => Err(io::Error::other("config watch thread ended")),
        }
    }
}
