//! An in-memory directory that performs the installer machine's requests the way the
//! daemon does, with an inotify-like event queue: shared by the machine's unit tests
//! and its property test.
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};

use flock_core::cniconf::installer::{
    DropInDir, Entry, Event, Expect, Installer, Io, Mode, Settings, WriteOutcome,
};
use flock_core::cniconf::{ConfPolicy, InstallPolicy, OurPlugin, is_patched as core_patched};
use flock_core::time::MonoMs;

/// More requests than this in one drain means the machine never settles: a loop.
pub const DRAIN_CAP: usize = 20_000;

pub fn ours() -> OurPlugin {
    OurPlugin::from_bytes(br#"{"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}"#)
        .unwrap()
}

pub fn settings(mode: Mode, conf_policy: ConfPolicy) -> Settings {
    Settings {
        policy: InstallPolicy {
            ours: ours(),
            conf_policy,
        },
        mode,
        write_burst: 1_000,
        write_interval_ms: 1_000,
        resync_ms: 60_000,
    }
}

/// A valid primary `.conflist` without our entry.
pub fn unpatched(network: &str) -> Vec<u8> {
    format!(r#"{{"cniVersion": "1.0.0", "name": "{network}", "plugins": [{{"type": "bridge"}}]}}"#)
        .into_bytes()
}

/// A valid single-plugin `.conf`.
pub fn single_conf(network: &str) -> Vec<u8> {
    format!(r#"{{"cniVersion": "1.0.0", "name": "{network}", "type": "bridge"}}"#).into_bytes()
}

/// True when `bytes` are a list with exactly one entry of ours, last.
pub fn is_patched(bytes: &[u8]) -> bool {
    flock_core::cniconf::parse(bytes, flock_core::cniconf::ConfigKind::ConfList)
        .is_ok_and(|c| core_patched(&c, &ours()))
}

pub struct Sim {
    pub m: Installer,
    /// Path (a plain name, or `<sub>/<name>` for drop-ins) → bytes.
    pub dir: BTreeMap<String, Vec<u8>>,
    /// Names the watch reported and the machine has not been told about yet.
    pub events: VecDeque<String>,
    pub armed: bool,
    pub performed: Vec<Io>,
    pub readiness: Vec<bool>,
    pub writes: BTreeMap<String, usize>,
}

impl Sim {
    pub fn new(settings: Settings) -> Self {
        Self {
            m: Installer::new(settings, MonoMs(0)),
            dir: BTreeMap::new(),
            events: VecDeque::new(),
            armed: false,
            performed: Vec::new(),
            readiness: Vec::new(),
            writes: BTreeMap::new(),
        }
    }

    /// Armed, then scanned (the daemon's order), with `files` already there.
    pub fn started(settings: Settings, files: &[(&str, &[u8])]) -> Self {
        let mut sim = Self::new(settings);
        for (name, bytes) in files {
            sim.dir.insert((*name).into(), bytes.to_vec());
        }
        sim.arm(MonoMs(0));
        sim.scan(MonoMs(0));
        sim.drain(MonoMs(0));
        sim
    }

    pub fn arm(&mut self, now: MonoMs) {
        self.armed = true;
        self.m.handle(now, Event::WatchArmed);
    }

    pub fn scan(&mut self, now: MonoMs) {
        let names = self.listing();
        self.m.handle(now, Event::Listed(names));
    }

    /// The directory's entry names, as a listing sees them now.
    pub fn listing(&self) -> Vec<String> {
        self.dir
            .keys()
            .filter(|k| !k.contains('/'))
            .cloned()
            .collect()
    }

    fn changed(&mut self, name: &str) {
        if self.armed && !name.contains('/') {
            self.events.push_back(name.to_owned());
        }
    }

    /// Another agent writes `name`; then everything settles.
    pub fn external(&mut self, now: MonoMs, name: &str, bytes: &[u8]) {
        self.dir.insert(name.into(), bytes.to_vec());
        self.changed(name);
        self.drain(now);
    }

    /// Another agent removes `name`; then everything settles.
    pub fn remove(&mut self, now: MonoMs, name: &str) {
        self.dir.remove(name);
        self.changed(name);
        self.drain(now);
    }

    /// Performs requests and delivers events until there are none left; returns what
    /// was performed. Panics after [`DRAIN_CAP`] requests (a loop).
    pub fn drain(&mut self, now: MonoMs) -> Vec<Io> {
        let start = self.performed.len();
        loop {
            self.perform_all(now);
            let Some(name) = self.events.pop_front() else {
                break;
            };
            self.m.handle(now, Event::Changed(name));
        }
        self.performed[start..].to_vec()
    }

    /// Performs the machine's requests (not the pending watch events).
    pub fn perform_all(&mut self, now: MonoMs) {
        let start = self.performed.len();
        while let Some(io) = self.m.poll_io() {
            assert!(
                self.performed.len() - start < DRAIN_CAP,
                "the machine never settles: a loop"
            );
            self.performed.push(io.clone());
            self.perform(now, io);
        }
    }

    pub fn perform(&mut self, now: MonoMs, io: Io) {
        match io {
            Io::Read(name) => {
                let entry = match self.dir.get(&name) {
                    Some(b) => Entry::File(b.clone()),
                    None => Entry::Missing,
                };
                self.m.handle(now, Event::Observed { name, entry });
            }
            Io::List => {
                let names = self.listing();
                self.m.handle(now, Event::Listed(names));
            }
            Io::Write(w) => {
                let ok = match &w.expect {
                    Expect::Absent => !self.dir.contains_key(&w.path),
                    Expect::Holds(b) => self.dir.get(&w.path) == Some(b),
                    Expect::Anything => true,
                };
                let outcome = if ok {
                    self.dir.insert(w.path.clone(), w.bytes.clone());
                    *self.writes.entry(w.path.clone()).or_default() += 1;
                    self.changed(&w.path.clone());
                    WriteOutcome::Written
                } else {
                    WriteOutcome::ConditionFailed
                };
                self.m.handle(now, Event::Written { write: w, outcome });
            }
            Io::Remove(name) => {
                self.dir.remove(&name);
                self.changed(&name);
            }
            Io::ProbeDropIn { primary, dropin } => {
                let prefix = format!("{}/", dropin.dir_name);
                let dir = if self.dir.contains_key(&dropin.dir_name) {
                    DropInDir::NotADirectory
                } else if self.dir.keys().any(|k| k.starts_with(&prefix)) {
                    DropInDir::Directory(
                        self.dir
                            .get(&format!("{prefix}{}", dropin.file_name))
                            .cloned(),
                    )
                } else {
                    DropInDir::Missing
                };
                self.m.handle(
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
                ..
            } => {
                self.dir.remove(&format!("{dir_name}/{file_name}"));
            }
            Io::Ready { ready, .. } => self.readiness.push(ready),
            Io::Notice(_) => {}
        }
    }

    pub fn writes_to(&self, name: &str) -> usize {
        self.writes.get(name).copied().unwrap_or(0)
    }

    pub fn total_writes(&self) -> usize {
        self.writes.values().sum()
    }
}
