#![cfg(not(loom))]
//! The CNI installer's machine over any interleaving of other agents' changes, watch
//! events (delivered late, in any order, our own writes included) and startup steps.
//!
//! The model: up to four config files in an in-memory directory; the daemon's startup
//! (changes before the watch is armed are never reported; changes between the arm and
//! the scan's listing are both reported and listed; changes after the listing was
//! taken but before it is handed in are only reported, and their events may be
//! delivered before the listing, as the daemon's one queue does), then proptest picks steps: another
//! agent writes a file (unpatched, already patched, half-written or invalid content) or
//! removes it, a pending watch event is delivered (any one of them, so events arrive in
//! any order), or time passes. At the end every pending event is delivered.
//!
//! Asserted: once every event is delivered, before any retry or resync, every valid
//! config is patched (a dropped event is repaired by nothing sooner than the
//! resync); every valid config ends patched; each file is written at most once per
//! unpatched content another agent put there (no write loop, no ping-pong between
//! files: our own writes are recognised per file); once settled, redelivering an event
//! for every file plus a full relisting writes nothing; the installer is never ready
//! before the first scan has been handled, and ends ready exactly when some config is
//! patched.

mod installer_sim;

use std::collections::BTreeMap;

use flock_core::cniconf::ConfPolicy;
use flock_core::cniconf::installer::{Event, FileState, Io, Mode};
use flock_core::time::MonoMs;
use installer_sim::*;
use proptest::prelude::*;

const NAMES: [&str; 4] = [
    "10-a.conflist",
    "20-b.conflist",
    "30-c.conflist",
    "40-d.conflist",
];

#[derive(Debug, Clone)]
enum Content {
    Unpatched(u8),
    Patched(u8),
    Partial,
    Invalid,
}

impl Content {
    fn bytes(&self, file: usize) -> Vec<u8> {
        match self {
            Self::Unpatched(v) => unpatched(&format!("net{file}-{v}")),
            // Already patched, but compact: not byte-equal to what flock writes.
            Self::Patched(v) => format!(
                r#"{{"cniVersion":"1.0.0","name":"net{file}-{v}","plugins":[{{"type":"bridge"}},{{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}}]}}"#
            )
            .into_bytes(),
            Self::Partial => unpatched("cut")[..25].to_vec(),
            Self::Invalid => br#"{"cniVersion": "1.0.0", "name": "x"}"#.to_vec(),
        }
    }

    fn is_valid(&self) -> bool {
        matches!(self, Self::Unpatched(_) | Self::Patched(_))
    }
}

#[derive(Debug, Clone)]
enum Step {
    Write(usize, Content),
    Remove(usize),
    Deliver(usize),
    Advance(u64),
}

fn content() -> impl Strategy<Value = Content> {
    prop_oneof![
        4 => (0u8..4).prop_map(Content::Unpatched),
        1 => (0u8..4).prop_map(Content::Patched),
        1 => Just(Content::Partial),
        1 => Just(Content::Invalid),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..NAMES.len(), content()).prop_map(|(i, c)| Step::Write(i, c)),
        1 => (0..NAMES.len()).prop_map(Step::Remove),
        4 => any::<usize>().prop_map(Step::Deliver),
        1 => (0u64..3_000).prop_map(Step::Advance),
    ]
}

struct World {
    sim: Sim,
    now: MonoMs,
    /// Per file: what another agent last put there (None: absent).
    truth: BTreeMap<usize, Content>,
    /// Per file: how many times another agent wrote unpatched content.
    unpatched_writes: BTreeMap<usize, usize>,
    scanned: bool,
}

impl World {
    fn apply(&mut self, step: &Step) {
        match step {
            Step::Write(i, c) => {
                self.sim.dir.insert(NAMES[*i].into(), c.bytes(*i));
                if self.sim.armed {
                    self.sim.events.push_back(NAMES[*i].into());
                }
                if matches!(c, Content::Unpatched(_)) {
                    *self.unpatched_writes.entry(*i).or_default() += 1;
                }
                self.truth.insert(*i, c.clone());
            }
            Step::Remove(i) => {
                self.sim.dir.remove(NAMES[*i]);
                if self.sim.armed {
                    self.sim.events.push_back(NAMES[*i].into());
                }
                self.truth.remove(i);
            }
            Step::Deliver(k) => {
                if !self.sim.events.is_empty() {
                    let k = k % self.sim.events.len();
                    let name = self.sim.events.remove(k).unwrap();
                    self.sim.m.handle(self.now, Event::Changed(name));
                }
            }
            Step::Advance(ms) => {
                self.now = self.now.plus(*ms);
                self.sim.m.handle_timeout(self.now);
            }
        }
        self.settle_requests();
    }

    /// Performs the machine's requests, checking the readiness rule on the way.
    fn settle_requests(&mut self) {
        let before = self.sim.readiness.len();
        self.sim.perform_all(self.now);
        if !self.scanned {
            assert!(
                !self.sim.readiness[before..].contains(&true),
                "ready before the first scan"
            );
        }
    }
}

fn run(
    pre: Vec<Step>,
    gap: Vec<Step>,
    late: Vec<Step>,
    steps: Vec<Step>,
) -> Result<(), TestCaseError> {
    let mut w = World {
        sim: Sim::new(settings(Mode::Chained, ConfPolicy::Skip)),
        now: MonoMs(0),
        truth: BTreeMap::new(),
        unpatched_writes: BTreeMap::new(),
        scanned: false,
    };
    // Before the watch: changes are never reported, only the scan can see them.
    for s in pre
        .iter()
        .filter(|s| matches!(s, Step::Write(..) | Step::Remove(_)))
    {
        w.apply(s);
    }
    w.sim.arm(w.now);
    // Between arm and scan: reported and listed.
    for s in gap
        .iter()
        .filter(|s| matches!(s, Step::Write(..) | Step::Remove(_)))
    {
        w.apply(s);
    }
    let listing = w.sim.listing();
    // After the listing was taken, before it is handed in: changes only the watch
    // reports, and events delivered (and handled) before the listing.
    for s in late.iter().filter(|s| !matches!(s, Step::Advance(_))) {
        w.apply(s);
    }
    w.sim.m.handle(w.now, Event::Listed(listing));
    w.scanned = true;
    w.settle_requests();
    for s in &steps {
        w.apply(s);
    }
    w.sim.drain(w.now);
    // Every event delivered, nothing retried or re-listed yet: events alone patched
    // every valid config (write budget and conditions never fail in this model).
    for (i, name) in NAMES.iter().enumerate() {
        if w.truth.get(&i).is_some_and(Content::is_valid) {
            prop_assert!(
                is_patched(&w.sim.dir[*name]),
                "{name} not patched once every event was delivered (an event dropped?): {:?}",
                w.sim.m.state(name)
            );
        }
    }
    // Every pending retry and the next resync, then settled again.
    let later = w.now.plus(120_000);
    w.sim.m.handle_timeout(later);
    w.sim.drain(later);

    for (i, name) in NAMES.iter().enumerate() {
        match w.truth.get(&i) {
            Some(c) if c.is_valid() => {
                prop_assert!(
                    is_patched(&w.sim.dir[*name]),
                    "{name} not patched: {:?}",
                    w.sim.m.state(name)
                );
                prop_assert_eq!(w.sim.m.state(name), Some(&FileState::Patched));
            }
            Some(_) => prop_assert_eq!(&w.sim.dir[*name], &w.truth[&i].bytes(i)),
            None => prop_assert!(!w.sim.dir.contains_key(*name)),
        }
        let allowed = w.unpatched_writes.get(&i).copied().unwrap_or(0);
        prop_assert!(
            w.sim.writes_to(name) <= allowed,
            "{name} written {} times for {allowed} unpatched versions",
            w.sim.writes_to(name)
        );
    }
    // Settled: an event for every file and a relisting change nothing.
    let writes = w.sim.total_writes();
    for name in NAMES {
        w.sim.m.handle(later, Event::Changed(name.into()));
    }
    w.sim.m.handle(later, Event::Overflow);
    w.sim.drain(later);
    prop_assert_eq!(
        w.sim.total_writes(),
        writes,
        "writes after settling: a loop"
    );
    let any_patched = w.truth.values().any(Content::is_valid);
    prop_assert_eq!(w.sim.m.is_ready(), Some(any_patched));
    prop_assert!(
        !w.sim
            .performed
            .iter()
            .any(|io| matches!(io, Io::Write(x) if x.path.contains('/')))
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_interleaving_converges_without_a_write_loop(
        pre in proptest::collection::vec(step(), 0..6),
        gap in proptest::collection::vec(step(), 0..4),
        late in proptest::collection::vec(step(), 0..6),
        steps in proptest::collection::vec(step(), 0..60),
    ) {
        run(pre, gap, late, steps)?;
    }
}
