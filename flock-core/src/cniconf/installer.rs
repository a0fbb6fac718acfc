//! The CNI installer's decisions as a sans-IO state machine.
//!
//! The `flock-install-cni` daemon watches one config directory. Its I/O loop only reads
//! entries, lists the directory, writes atomically and removes files; everything it
//! decides is decided here, in the shape of quinn-proto's connection: the loop feeds
//! [`Event`]s in with the monotonic time `now` ([`Installer::handle`],
//! [`Installer::handle_timeout`]), then drains [`Io`] requests
//! ([`Installer::poll_io`]) and sleeps until [`Installer::poll_timeout`].
//!
//! What is decided here, and why:
//!
//! * **Which names matter**: only plain `.conf`/`.conflist`/`.json` names in the
//!   directory itself; temp files and sub-directory paths never reach a decision.
//! * **What a file's state is** ([`FileState`]): each [`SkipReason`](super::SkipReason) of
//!   [`decide`](super::decide) maps to exactly one state, and only the states a runtime would load
//!   unpatched block readiness (a half-written or invalid file is not loadable, so it
//!   does not).
//! * **Symlinks**: the I/O side reports "this entry is a symlink" as a typed
//!   [`Entry::Symlink`] from `symlink_metadata`. A link is never written through
//!   (writing would replace the link or write outside the directory); it is
//!   [`Blocked::Symlink`] unless its target already holds a patched config, and it is
//!   re-examined after every write of ours (it may point at the file just patched).
//! * **Refusal to overwrite**: converting `x.conf` into `x.conflist` would replace an
//!   existing `x.conflist`; that is only allowed when flock wrote that file (the
//!   ledger has it). Otherwise the write goes out with [`Expect::Absent`] and, if the
//!   file is there, the `.conf` is [`Blocked::WouldOverwrite`]. A patch of an existing
//!   file goes out with [`Expect::Holds`] (compare-and-swap on the bytes we decided
//!   on), so a concurrent rewrite by another agent is re-read instead of clobbered.
//! * **Write budget and re-patch timing**: one [`TokenBucket`] per file; an empty one
//!   makes the file [`FileState::Throttled`] and schedules a re-read when the next
//!   token is due. A failed write is retried after [`RETRY_AFTER_FAILURE_MS`]; a
//!   rewrite that raced ours is re-read at once; the whole directory is re-listed every
//!   `resync_ms` (level-triggered repair of anything an event could not tell).
//! * **Readiness**: ready exactly when the watch is armed, the first full scan has been
//!   handled (every entry it listed has been read and decided: readiness is only
//!   evaluated when no request is outstanding), at least one primary is patched and no
//!   file blocks readiness.
//!
//! The loop must arm the watch *before* it lists the directory for the first scan: a
//! config created between a scan and a later arm is seen by neither and stays unpatched
//! forever. Arming first means such a file is in the scan, produces an event, or both
//! (handling a file twice is harmless: decisions are per file and idempotent). The
//! other half of that rule is here: a [`Event::Changed`] handled before the scan's
//! [`Event::Listed`] is read like any other, never dropped as "the scan covers it": a
//! config written after the listing was taken is in no listing, only in its event.

mod per_file;
mod vocab;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::ratelimit::TokenBucket;
use crate::time::MonoMs;

use super::ledger::Ledger;
use super::parse::parse_file;
use super::patch::{count_ours, unpatch, unpatch_to_conf};

pub use vocab::*;

#[derive(Debug, Clone)]
struct DropInRecord {
    dir_name: String,
    file_name: String,
    created_dir: bool,
}

/// The installer's state for one config directory. See the module docs.
#[derive(Debug)]
pub struct Installer {
    settings: Settings,
    ledger: Ledger,
    files: BTreeMap<String, FileState>,
    buckets: BTreeMap<String, TokenBucket>,
    throttled: BTreeSet<String>,
    retry_at: BTreeMap<String, MonoMs>,
    /// `.conflist` we wrote → the `.conf` it replaced.
    conversions: BTreeMap<String, String>,
    /// Primary → its drop-in (subdir mode).
    dropins: BTreeMap<String, DropInRecord>,
    watch_armed: bool,
    scan_done: bool,
    scan_reported: bool,
    ready: Option<bool>,
    next_resync: MonoMs,
    queue: VecDeque<Io>,
    own_write_events: u64,
}

impl Installer {
    /// A machine that has seen nothing, at `now`.
    pub fn new(settings: Settings, now: MonoMs) -> Self {
        Self {
            next_resync: now.plus(settings.resync_ms),
            settings,
            ledger: Ledger::new(),
            files: BTreeMap::new(),
            buckets: BTreeMap::new(),
            throttled: BTreeSet::new(),
            retry_at: BTreeMap::new(),
            conversions: BTreeMap::new(),
            dropins: BTreeMap::new(),
            watch_armed: false,
            scan_done: false,
            scan_reported: false,
            ready: None,
            queue: VecDeque::new(),
            own_write_events: 0,
        }
    }

    /// The state of a file, if it is known.
    pub fn state(&self, name: &str) -> Option<&FileState> {
        self.files.get(name)
    }

    /// Every known file and its state, sorted by name.
    pub fn files(&self) -> impl Iterator<Item = (&str, &FileState)> {
        self.files.iter().map(|(n, s)| (n.as_str(), s))
    }

    /// The readiness last reported through [`Io::Ready`] (`None`: not yet decided).
    pub fn is_ready(&self) -> Option<bool> {
        self.ready
    }

    /// How many events were recognised as our own writes.
    pub fn own_write_events(&self) -> u64 {
        self.own_write_events
    }

    /// Feeds one event in.
    pub fn handle(&mut self, now: MonoMs, event: Event) {
        match event {
            Event::WatchArmed => self.watch_armed = true,
            Event::Listed(names) => self.listed(names),
            Event::Changed(name) => {
                // An event that arrives before the first scan's listing is handed in is
                // queued like any other: the change it reports may have happened after
                // the directory was listed, so the scan does not cover it.
                // `installer-drops-early-events` puts back the bug of dropping them
                // ("the scan will see it").
                let dropped =
                    crate::reintroduced!("installer-drops-early-events") && !self.scan_done;
                if Self::is_config_name(&name) && !dropped {
                    self.queue.push_back(Io::Read(name));
                }
            }
            Event::Overflow => self.queue.push_back(Io::List),
            Event::Observed { name, entry } => {
                if Self::is_config_name(&name) {
                    self.observed(now, &name, entry);
                }
            }
            Event::Written { write, outcome } => self.written(now, write, outcome),
            Event::DropInProbed {
                primary,
                dropin,
                dir,
            } => self.dropin_probed(now, &primary, dropin, dir),
        }
    }

    /// The next instant [`Installer::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> MonoMs {
        self.retry_at
            .values()
            .copied()
            .min()
            .map_or(self.next_resync, |t| t.min(self.next_resync))
    }

    /// Fires the retries and the resync due at `now`.
    pub fn handle_timeout(&mut self, now: MonoMs) {
        let due: Vec<String> = self
            .retry_at
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for name in due {
            self.retry_at.remove(&name);
            self.queue.push_back(Io::Read(name));
        }
        if self.next_resync <= now {
            self.next_resync = now.plus(self.settings.resync_ms);
            self.queue.push_back(Io::List);
        }
    }

    /// The next request for the I/O side. Readiness is decided only when nothing else
    /// is outstanding, so it always reflects every event fed in so far.
    pub fn poll_io(&mut self) -> Option<Io> {
        if let Some(io) = self.queue.pop_front() {
            return Some(io);
        }
        if self.scan_done && !self.scan_reported {
            self.scan_reported = true;
            return Some(Io::Notice(Notice::ScanDone(self.files.len())));
        }
        let waiting_for: Vec<String> = self
            .files
            .iter()
            .filter(|(_, s)| s.blocks_readiness())
            .map(|(n, _)| n.clone())
            .collect();
        let patched = self
            .files
            .values()
            .filter(|s| **s == FileState::Patched)
            .count();
        let ready = self.watch_armed && self.scan_done && waiting_for.is_empty() && patched > 0;
        if self.ready == Some(ready) {
            return None;
        }
        self.ready = Some(ready);
        Some(Io::Ready {
            ready,
            patched,
            waiting_for,
        })
    }

    /// What to do with config `name`, holding `bytes`, on exit (chained mode).
    /// `conf_exists`: whether the `.conf` a conversion replaced exists again (then the
    /// list is unpatched in place instead of being turned back).
    pub fn restore(&self, name: &str, bytes: &[u8], conf_exists: bool) -> Restore {
        let Ok(config) = parse_file(name, bytes) else {
            return Restore::Untouched;
        };
        let ours = &self.settings.policy.ours;
        if count_ours(&config, ours) == 0 {
            return Restore::Untouched;
        }
        if let Some(conf_name) = self.conversions.get(name)
            && !conf_exists
        {
            match unpatch_to_conf(&config, ours) {
                Ok(Some(conf)) => {
                    return Restore::BackToConf {
                        conf_name: conf_name.clone(),
                        bytes: conf.to_bytes(),
                    };
                }
                Ok(None) => {}
                Err(e) => return Restore::Error(e.to_string()),
            }
        }
        match unpatch(&config, ours) {
            Ok(u) if u.changed => Restore::Rewrite(u.config.to_bytes()),
            Ok(_) => Restore::Untouched,
            Err(e) => Restore::Error(e.to_string()),
        }
    }

    /// The `.conf` a list of ours replaced, if any.
    pub fn converted_from(&self, list_name: &str) -> Option<&str> {
        self.conversions.get(list_name).map(String::as_str)
    }

    /// Every drop-in removal to perform on exit (subdir mode).
    pub fn remove_all_dropins(&mut self) -> Vec<Io> {
        let primaries: Vec<String> = self.dropins.keys().cloned().collect();
        primaries
            .iter()
            .filter_map(|p| self.remove_dropin_of(p))
            .collect()
    }
}
