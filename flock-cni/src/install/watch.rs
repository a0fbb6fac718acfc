//! The installer's inotify watch: one thread turning the directory's events into work
//! for the single queue the event loop consumes.

use std::fs;
use std::io;
use std::path::Path;

use inotify::{EventMask, Inotify, WatchMask};
use tokio::sync::mpsc::UnboundedSender as Sender;
use tracing::warn;

use super::{InstallError, Work};

/// Called with an entry's name after its change was queued (a test hook).
pub(super) type Queued = Option<super::QueuedHook>;

/// Arms an inotify watch on `dir` and starts the thread that feeds its events into
/// `tx` (calling `queued` after each change it queues). Returns once the watch is
/// armed: every change made after this returns produces an event.
pub(super) fn arm(dir: &Path, tx: Sender<Work>, queued: Queued) -> Result<(), InstallError> {
    let inotify = Inotify::init().map_err(|e| inotify_error("creating an inotify instance", &e))?;
    inotify
        .watches()
        .add(
            dir,
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
        .map_err(|e| inotify_error(&format!("watching {}", dir.display()), &e))?;
    let dir = dir.display().to_string();
    std::thread::Builder::new()
        .name("inotify".into())
        .spawn(move || watch_thread(inotify, &dir, &tx, &queued))
        .map_err(|e| InstallError(format!("cannot start the inotify thread: {e}")))?;
    Ok(())
}

fn watch_thread(mut inotify: Inotify, dir: &str, tx: &Sender<Work>, queued: &Queued) {
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
                Work::Overflow
            } else if ev
                .mask
                .intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED)
            {
                Work::Fatal(format!(
                    "the config directory {dir} was removed or moved away; cannot keep it patched"
                ))
            } else if let Some(name) = ev.name.and_then(|n| n.to_str()) {
                Work::Changed(name.to_owned())
            } else {
                continue;
            };
            let changed = match (&work, queued) {
                (Work::Changed(name), Some(_)) => Some(name.clone()),
                _ => None,
            };
            if tx.send(work).is_err() {
                return;
            }
            if let (Some(hook), Some(name)) = (queued, changed) {
                hook(&name);
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
