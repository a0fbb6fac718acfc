//! Performing the installer machine's requests: reads, listings, conditional atomic
//! writes, removals, the ready file, and the log lines for its notices.

use std::fs;
use std::path::PathBuf;

use flock_core::cniconf::installer::{
    Event, Expect, FileState, Io, Notice, Perm as WritePerm, Write, WriteKind, WriteOutcome,
};
use flock_core::time::MonoMs;
use tracing::{debug, error, info, warn};

use super::files::{self, Perm, Replace, remove_if_exists, sync_dir, write_atomic};
use super::{Daemon, millis};

impl Daemon {
    /// Performs every request of the machine, feeding each result back, until it has
    /// none left.
    pub(super) fn perform_all(&mut self, now: MonoMs) {
        while let Some(io) = self.machine.poll_io() {
            match io {
                Io::Read(name) => {
                    let entry = files::read_entry(&self.dir.join(&name));
                    self.machine.handle(now, Event::Observed { name, entry });
                }
                Io::List => match files::list_config_names(&self.dir) {
                    Ok(names) => {
                        debug!(files = names.len(), "rescanning");
                        self.machine.handle(now, Event::Listed(names));
                    }
                    Err(e) => warn!(error = %e, "rescan: cannot list the config directory"),
                },
                Io::Write(write) => {
                    let outcome = self.write(&write);
                    self.machine.handle(now, Event::Written { write, outcome });
                }
                Io::Remove(name) => {
                    if let Err(e) =
                        fs::remove_file(self.dir.join(&name)).and_then(|()| sync_dir(&self.dir))
                    {
                        warn!(file = name, error = %e, "wrote the converted list but cannot remove the .conf");
                    }
                }
                Io::ProbeDropIn { primary, dropin } => {
                    let dir = files::probe_dropin_dir(
                        &self.dir.join(&dropin.dir_name),
                        &dropin.file_name,
                    );
                    self.machine.handle(
                        now,
                        Event::DropInProbed {
                            primary,
                            dropin,
                            dir,
                        },
                    );
                }
                Io::RemoveDropIn {
                    dir_name,
                    file_name,
                    remove_dir,
                } => files::remove_dropin(&self.dir, &dir_name, &file_name, remove_dir),
                Io::Ready {
                    ready,
                    patched,
                    waiting_for,
                } => self.set_ready(ready, patched, &waiting_for),
                Io::Notice(notice) => self.log(notice),
            }
        }
    }

    /// Performs one write the machine asked for, under its condition.
    fn write(&mut self, w: &Write) -> WriteOutcome {
        let (dir, name) = match w.path.rsplit_once('/') {
            Some((sub, name)) => (self.dir.join(sub), name),
            None => (self.dir.clone(), w.path.as_str()),
        };
        let result = (|| {
            if let WriteKind::DropIn {
                create_dir: true, ..
            } = w.kind
            {
                match fs::create_dir(&dir) {
                    Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                    _ => sync_dir(&self.dir)?,
                }
            }
            let like;
            let perm = match w.perm() {
                WritePerm::Like(n) => {
                    like = fs::symlink_metadata(self.dir.join(n))?;
                    Perm::Like(&like)
                }
                WritePerm::Mode(m) => Perm::Mode(m),
            };
            let replace = match &w.expect {
                Expect::Absent => Replace::Never,
                Expect::Anything => Replace::Any,
                Expect::Holds(bytes) => Replace::IfHolds(bytes),
            };
            write_atomic(&dir, name, &w.bytes, perm, replace)
        })();
        match result {
            Ok(true) => {
                self.writes += 1;
                self.log_write(w);
                WriteOutcome::Written
            }
            Ok(false) => {
                debug!(file = %w.path, "changed while we wrote it (or is not ours); deciding again");
                WriteOutcome::ConditionFailed
            }
            Err(e) => {
                error!(file = %w.path, error = %e, "cannot write config; retrying in 1 s");
                WriteOutcome::Failed(e.to_string())
            }
        }
    }

    fn log_write(&self, w: &Write) {
        let bytes = w.bytes.len();
        let writes = self.writes;
        match &w.kind {
            WriteKind::Patch => info!(file = %w.path, bytes, writes, "wrote config"),
            WriteKind::Convert { conf_name } => info!(
                file = %w.path, from = %conf_name, bytes, writes,
                "wrote config (converted a single-plugin .conf into a .conflist)"
            ),
            WriteKind::DropIn {
                primary, dropin, ..
            } => {
                info!(file = %w.path, primary = %primary, writes, "wrote config (drop-in)");
                if let Ok(entries) = fs::read_dir(self.dir.join(&dropin.dir_name)) {
                    let names: Vec<String> = entries
                        .flatten()
                        .filter_map(|e| e.file_name().into_string().ok())
                        .collect();
                    if !dropin.sorts_last_among(names.iter().map(String::as_str)) {
                        warn!(dir = %dropin.dir_name, "another drop-in sorts after flock's: flock is not last in the chain");
                    }
                }
            }
        }
    }

    fn set_ready(&self, ready: bool, patched: usize, waiting_for: &[String]) {
        if ready {
            info!(
                patched,
                "ready: every primary config is patched and the watch is armed"
            );
        } else {
            warn!(patched, waiting_for = ?waiting_for, "not ready");
        }
        let Some(path) = &self.cfg.ready_file else {
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
                Replace::Any,
            )
            .map(|_| ())
        } else {
            remove_if_exists(path)
        };
        if let Err(e) = result {
            error!(file = %path.display(), error = %e, "cannot update the ready file");
        }
    }

    fn log(&self, notice: Notice) {
        match notice {
            Notice::State { name, old, new } => match &new {
                FileState::Patched => debug!(file = name, "patched"),
                FileState::Pending(why) => info!(file = name, reason = %why, "not patched yet"),
                FileState::Partial(why) => {
                    if !matches!(old, Some(FileState::Partial(_))) {
                        info!(file = name, reason = %why, "not patched yet");
                    }
                }
                FileState::Throttled => {}
                FileState::Blocked(why) => {
                    warn!(file = name, reason = %why, "primary config NOT patched; pods on this network start without flock until this is fixed")
                }
                FileState::Invalid(why) => warn!(file = name, reason = %why, "skipped"),
            },
            Notice::Removed(name) => info!(file = name, "config removed"),
            Notice::ThrottleStarted(name) => warn!(
                file = name,
                burst = self.cfg.write_burst,
                interval_ms = millis(self.cfg.write_interval),
                "another agent keeps rewriting this config (a primary CNI that owns the directory?): \
                 throttling re-patches to one per interval after a burst; not ready until it settles"
            ),
            Notice::ThrottleEnded(name) => {
                info!(file = name, "write budget available again; re-patching")
            }
            Notice::ScanDone(files) => info!(files, "initial scan done"),
        }
    }
}
