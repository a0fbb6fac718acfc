//! An inotify watch of a directory's entries, shared by the directories the agent
//! follows (the CA directory, the policy directory): arming it on the directory itself,
//! and telling a live watch from one that no longer reports.

use std::path::Path;

/// The events of one watch.
pub(crate) type EventStream = inotify::EventStream<Vec<u8>>;

/// Watches `dir` for `mask` and for the directory itself going away (`DELETE_SELF`,
/// `MOVE_SELF`). `None` (logged, naming `what`) when the watch cannot be armed: the
/// caller then re-reads the directory on its timer alone.
pub(crate) fn arm(dir: &Path, mask: inotify::WatchMask, what: &str) -> Option<EventStream> {
    use inotify::{Inotify, WatchMask};
    let armed = Inotify::init().and_then(|inotify| {
        inotify.watches().add(
            dir,
            mask | WatchMask::DELETE_SELF | WatchMask::MOVE_SELF | WatchMask::ONLYDIR,
        )?;
        inotify.into_event_stream(vec![0u8; 4096])
    });
    match armed {
        Ok(stream) => Some(stream),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the {what}; re-reading it periodically instead");
            None
        }
    }
}

/// Whether the watch still reports on the directory after this event: not when the
/// stream ended or failed, nor when the directory itself was removed or moved away.
pub(crate) fn alive(ev: Option<&std::io::Result<inotify::Event<std::ffi::OsString>>>) -> bool {
    matches!(ev, Some(Ok(ev)) if !ev.mask.intersects(
        inotify::EventMask::IGNORED | inotify::EventMask::DELETE_SELF | inotify::EventMask::MOVE_SELF,
    ))
}
