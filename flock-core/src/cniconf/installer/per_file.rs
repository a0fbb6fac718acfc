//! How the installer machine handles one file: an observed entry, a write's outcome,
//! a drop-in probe; the write budget, retries and the symlink re-check.

use crate::time::MonoMs;

use super::super::dropin::{DropIn, dropin};
use super::super::ledger::{Action, SkipReason, decide};
use super::super::parse::{kind_for_file_name, parse_file};
use super::*;
use crate::ratelimit::TokenBucket;

impl Installer {
    /// Only plain config names of the directory itself reach a decision.
    pub(super) fn is_config_name(name: &str) -> bool {
        !name.is_empty() && !name.contains('/') && kind_for_file_name(name).is_some()
    }

    pub(super) fn listed(&mut self, names: Vec<String>) {
        let mut all: BTreeSet<String> = self.files.keys().cloned().collect();
        all.extend(names.into_iter().filter(|n| Self::is_config_name(n)));
        self.scan_done = true;
        self.queue.extend(all.into_iter().map(Io::Read));
    }

    pub(super) fn notice(&mut self, n: Notice) {
        self.queue.push_back(Io::Notice(n));
    }

    pub(super) fn set_state(&mut self, name: &str, state: FileState) {
        let old = self.files.insert(name.to_owned(), state.clone());
        if old.as_ref() != Some(&state) {
            self.notice(Notice::State {
                name: name.to_owned(),
                old,
                new: state,
            });
        }
    }

    pub(super) fn observed(&mut self, now: MonoMs, name: &str, entry: Entry) {
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

    pub(super) fn chained(&mut self, now: MonoMs, name: &str, bytes: Vec<u8>) {
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

    pub(super) fn subdir(&mut self, name: &str, bytes: &[u8]) {
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

    pub(super) fn dropin_probed(&mut self, now: MonoMs, primary: &str, d: DropIn, dir: DropInDir) {
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

    pub(super) fn written(&mut self, now: MonoMs, write: Write, outcome: WriteOutcome) {
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

    pub(super) fn write_failed(&mut self, now: MonoMs, name: &str, error: String) {
        self.retry_at
            .insert(name.to_owned(), now.plus(RETRY_AFTER_FAILURE_MS));
        self.set_state(name, FileState::Pending(format!("write failed: {error}")));
    }

    pub(super) fn take_write_token(&mut self, now: MonoMs, name: &str) -> bool {
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
    pub(super) fn recheck_symlinks(&mut self) {
        let links: Vec<String> = self
            .files
            .iter()
            .filter(|(_, s)| matches!(s, FileState::Blocked(Blocked::Symlink { .. })))
            .map(|(n, _)| n.clone())
            .collect();
        self.queue.extend(links.into_iter().map(Io::Read));
    }

    pub(super) fn remove_dropin_of(&mut self, primary: &str) -> Option<Io> {
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
