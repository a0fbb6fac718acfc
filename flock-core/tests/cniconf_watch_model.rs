#![cfg(not(loom))]
//! The installer's infinite patching loop (a shell installer keeping one content hash
//! for the whole directory) as a property over a model of the installer's watch loop.
//!
//! The model: N config files (1..=5) in one directory, one event queue (inotify
//! serialises events; they carry a path but no content). The installer arms the watch,
//! then scans (one synthetic event per existing file). proptest picks steps:
//!
//! * an **external write** to file i: a new valid unpatched config, an already-patched
//!   one (compact, i.e. not byte-equal to what flock writes), one with our entry
//!   misplaced, a truncated prefix (non-atomic writer) or an invalid config; it enqueues
//!   1–3 events for that path;
//! * the **delivery** of any pending event, chosen by index, so events arrive in any
//!   order. The handler reads the file's *current* bytes, runs [`decide`], and on
//!   `Write` writes and records the bytes, which enqueues 1–3 more events (our own write
//!   is seen by the watch too); on `AlreadyPatched` it records.
//!
//! After the steps, the queue is drained, at most [`STEP_CAP`] events, so a loop is a
//! failure rather than a hang. Asserted:
//!
//! 1. **No write loop**: the queue drains within the cap, and flock's writes ≤ the
//!    number of external writes (and startup files) whose content needed patching.
//! 2. **Own writes are recognised per file**: events that `decide` treats as an external
//!    change to act on (`Write` or `AlreadyPatched`) ≤ external writes + startup files.
//! 3. **End state**: each file whose last external content was valid holds our entry
//!    exactly once, last, and otherwise means what that content meant; a file whose last
//!    external content was invalid or partial is untouched.
//!
//! Which mutation fails which assertion (see `flock-core/src/cniconf/ledger.rs`):
//!
//! * `reintroduced!("ledger-shared-hash")` (one hash slot for all files, as the
//!   shell installer had): **property 2** fails — our write to file A is compared with the hash
//!   of our later write to file B and counted as external (shrinks to: two files, one
//!   unpatched write each). No loop: the "already patched" brake stops it. The plain
//!   reproduction tests fail their property-2 assertion too.
//! * `reintroduced!("ledger-rewrite")` (rewrite every external change) alone:
//!   **property 1** (write count) fails as soon as an already-patched config is written
//!   externally (shrinks to: one external write of an already-patched config). The
//!   plain reproduction tests still pass: the per-file ledger alone prevents that loop.
//! * both together (the shell installer exactly): **property 1** fails. The plain
//!   reproduction tests hit the step cap deterministically — the infinite loop (5001
//!   writes when the cap of 10 000 events is reached). The proptest finds a loop too but
//!   may shrink to either property-1 violation: the step cap (two files, one unpatched
//!   write each) or the simpler rewrite of an already-patched file.
//!
//! ```text
//! RUSTFLAGS='--cfg flock_mutants' FLOCK_REINTRODUCE=ledger-shared-hash \
//!   cargo test -p flock-core --test cniconf_watch_model
//! RUSTFLAGS='--cfg flock_mutants' FLOCK_REINTRODUCE='ledger-shared-hash ledger-rewrite' \
//!   cargo test -p flock-core --test cniconf_watch_model
//! ```

use flock_core::cniconf::{
    Action, ConfPolicy, ConfigKind, InstallPolicy, Ledger, OurPlugin, count_ours, decide,
    is_patched, parse, patch, semantically_equal, unpatch,
};
use proptest::prelude::*;
use serde_json::json;

/// Events handled while draining before we call it a loop.
const STEP_CAP: usize = 10_000;

fn policy() -> InstallPolicy {
    InstallPolicy {
        ours: OurPlugin::new(json!({"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}))
            .unwrap(),
        conf_policy: ConfPolicy::ConvertToList,
    }
}

/// What an external writer puts in a file.
#[derive(Debug, Clone, Copy)]
enum Content {
    /// A valid primary config, not patched.
    Unpatched(u8),
    /// The same, already patched (compact JSON: not byte-equal to flock's output).
    Patched(u8),
    /// Valid, with our entry first instead of last: needs a fix.
    Misplaced(u8),
    /// A truncated prefix of `Unpatched(seed)`: `cut` percent of it, never all.
    Partial(u8, u8),
    /// Complete JSON but not a valid conflist (no `plugins`), or not JSON at all.
    Invalid(bool),
}

impl Content {
    fn bytes(self) -> Vec<u8> {
        match self {
            Content::Unpatched(seed) => primary(seed),
            Content::Patched(seed) => {
                let p = patch(&parse(&primary(seed), ConfigKind::ConfList).unwrap(), &policy().ours, ConfPolicy::Skip)
                    .unwrap();
                serde_json::to_vec(p.config.as_object()).unwrap()
            }
            Content::Misplaced(seed) => format!(
                r#"{{"cniVersion":"0.4.0","name":"net-{seed}","plugins":[{{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}},{{"type":"plugin-{seed}"}}]}}"#
            )
            .into_bytes(),
            Content::Partial(seed, cut) => {
                let mut b = primary(seed);
                let len = b.len() * usize::from(cut.min(99)) / 100;
                b.truncate(len);
                b
            }
            Content::Invalid(true) => br#"{"cniVersion":"0.4.0","name":"broken"}"#.to_vec(),
            Content::Invalid(false) => b"cni config, not JSON".to_vec(),
        }
    }

    fn is_valid(self) -> bool {
        matches!(
            self,
            Content::Unpatched(_) | Content::Patched(_) | Content::Misplaced(_)
        )
    }

    fn needs_patching(self) -> bool {
        matches!(self, Content::Unpatched(_) | Content::Misplaced(_))
    }
}

/// A primary config as the reproduction's `echo` writes it (with the `type` libcni requires).
fn primary(seed: u8) -> Vec<u8> {
    format!(
        r#"{{"cniVersion": "0.4.0", "name": "net-{seed}", "disableCheck": true, "plugins": [{{"name": "p{seed}", "type": "plugin-{seed}"}}]}}"#
    )
    .into_bytes()
}

/// The directory, the queue, the installer's ledger, and the counters.
struct World {
    policy: InstallPolicy,
    paths: Vec<String>,
    files: Vec<Option<Vec<u8>>>,
    last_external: Vec<Option<(Content, Vec<u8>)>>,
    ledger: Ledger,
    queue: Vec<usize>,
    /// How many events each of our writes generates, cycled.
    own_events: Vec<u8>,
    writes: usize,
    acted: usize,
    external_writes: usize,
    startup_files: usize,
    needing_patch: usize,
    handled: usize,
}

#[derive(Debug)]
struct Looped {
    writes: usize,
    handled: usize,
}

impl World {
    fn new(paths: Vec<String>, own_events: Vec<u8>) -> Self {
        let n = paths.len();
        Self {
            policy: policy(),
            paths,
            files: vec![None; n],
            last_external: vec![None; n],
            ledger: Ledger::new(),
            queue: Vec::new(),
            own_events,
            writes: 0,
            acted: 0,
            external_writes: 0,
            startup_files: 0,
            needing_patch: 0,
            handled: 0,
        }
    }

    /// A file that exists before the installer starts (no event).
    fn preexisting(&mut self, file: usize, content: Content) {
        self.files[file] = Some(content.bytes());
        self.last_external[file] = Some((content, content.bytes()));
        self.startup_files += 1;
        self.needing_patch += usize::from(content.needs_patching());
    }

    /// Arm the watch, then scan: one event per existing file.
    fn start(&mut self) {
        for file in 0..self.files.len() {
            if self.files[file].is_some() {
                self.queue.push(file);
            }
        }
    }

    fn external_write(&mut self, file: usize, content: Content, events: u8) {
        let bytes = content.bytes();
        self.files[file] = Some(bytes.clone());
        self.last_external[file] = Some((content, bytes));
        self.external_writes += 1;
        self.needing_patch += usize::from(content.needs_patching());
        self.queue
            .extend(std::iter::repeat_n(file, usize::from(events)));
    }

    fn deliver(&mut self, pick: usize) {
        if self.queue.is_empty() {
            return;
        }
        let file = self.queue.remove(pick % self.queue.len());
        self.handle(file);
    }

    /// The installer's event handler: read the current content, decide, execute.
    fn handle(&mut self, file: usize) {
        self.handled += 1;
        let Some(current) = self.files[file].clone() else {
            return;
        };
        let path = &self.paths[file];
        match decide(path, &current, &self.ledger, &self.policy) {
            Action::IgnoreOwnWrite | Action::Skip(_) => {}
            Action::AlreadyPatched => {
                self.ledger.record(path, &current);
                self.acted += 1;
            }
            Action::Write {
                bytes,
                file_name_change,
            } => {
                assert_eq!(file_name_change, None, "the model only has .conflist files");
                self.ledger.record(path, &bytes);
                self.files[file] = Some(bytes);
                self.writes += 1;
                self.acted += 1;
                let events = self.own_events[self.writes % self.own_events.len()];
                self.queue
                    .extend(std::iter::repeat_n(file, usize::from(events)));
            }
        }
    }

    /// Handle every pending event in queue order, up to the cap.
    fn drain(&mut self) -> Result<(), Looped> {
        let mut budget = STEP_CAP;
        while !self.queue.is_empty() {
            if budget == 0 {
                return Err(Looped {
                    writes: self.writes,
                    handled: self.handled,
                });
            }
            budget -= 1;
            let file = self.queue.remove(0);
            self.handle(file);
        }
        Ok(())
    }

    /// Properties 1 (count part), 2 and 3; `Err` names the first one violated.
    fn check(&self) -> Result<(), String> {
        if self.writes > self.needing_patch {
            return Err(format!(
                "property 1 (no write loop): flock wrote {} times for {} configs that needed patching",
                self.writes, self.needing_patch
            ));
        }
        if self.acted > self.external_writes + self.startup_files {
            return Err(format!(
                "property 2 (own writes recognised per file): {} events treated as external changes, \
                 but only {} external writes + {} startup files",
                self.acted, self.external_writes, self.startup_files
            ));
        }
        let ours = &self.policy.ours;
        for (file, last) in self.last_external.iter().enumerate() {
            let Some((content, written)) = last else {
                continue;
            };
            let current = self.files[file].as_deref().unwrap_or_default();
            if content.is_valid() {
                let now = parse(current, ConfigKind::ConfList)
                    .map_err(|e| format!("property 3: file {file} no longer parses: {e}"))?;
                if count_ours(&now, ours) != 1 || !is_patched(&now, ours) {
                    return Err(format!(
                        "property 3: file {file} is not patched exactly once, last"
                    ));
                }
                let before = parse(written, ConfigKind::ConfList).unwrap();
                let (a, b) = (
                    unpatch(&now, ours).unwrap().config,
                    unpatch(&before, ours).unwrap().config,
                );
                if !semantically_equal(&a, &b) {
                    return Err(format!(
                        "property 3: file {file} lost or changed the primary's content"
                    ));
                }
            } else if current != written.as_slice() {
                return Err(format!(
                    "property 3: invalid file {file} ({content:?}) was modified"
                ));
            }
        }
        Ok(())
    }
}

fn model_paths(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("/etc/cni/net.d/{:02}-net{i}.conflist", i * 10))
        .collect()
}

fn content() -> impl Strategy<Value = Content> {
    let seed = 0u8..4;
    prop_oneof![
        6 => seed.clone().prop_map(Content::Unpatched),
        2 => seed.clone().prop_map(Content::Patched),
        1 => seed.clone().prop_map(Content::Misplaced),
        2 => (seed, 0u8..100).prop_map(|(s, c)| Content::Partial(s, c)),
        1 => any::<bool>().prop_map(Content::Invalid),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    Write {
        file: usize,
        content: Content,
        events: u8,
    },
    Deliver {
        pick: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (0usize..5, content(), 1u8..=3).prop_map(|(file, content, events)| Step::Write { file, content, events }),
        3 => any::<usize>().prop_map(|pick| Step::Deliver { pick }),
    ]
}

proptest! {
    // No regression file: the mutation runs (scripts/test) fail this test on purpose and
    // would leave one in the source tree; the reproduction is a plain test below.
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Properties 1–3 over arbitrary interleavings (see the module doc).
    #[test]
    fn watcher_never_loops_and_recognises_its_own_writes(
        n in 1usize..=5,
        initial in prop::collection::vec(prop::option::of(content()), 5),
        steps in prop::collection::vec(step(), 0..40),
        own_events in prop::collection::vec(1u8..=3, 1..6),
    ) {
        let mut world = World::new(model_paths(n), own_events);
        for (file, c) in initial.into_iter().take(n).enumerate() {
            if let Some(c) = c {
                world.preexisting(file, c);
            }
        }
        world.start();
        for s in steps {
            match s {
                Step::Write { file, content, events } => world.external_write(file % n, content, events),
                Step::Deliver { pick } => world.deliver(pick),
            }
        }
        if let Err(looped) = world.drain() {
            prop_assert!(
                false,
                "property 1 (no write loop): queue not drained after {} more events; {} writes, {} events handled",
                STEP_CAP, looped.writes, looped.handled
            );
        }
        if let Err(violation) = world.check() {
            prop_assert!(false, "{}", violation);
        }
    }
}

/// The loop's reproduction: two configs written "within a millisecond"
/// (`echo ... > 01-foo.conflist; echo ... > 02-bar.conflist`), then the handler runs in
/// inotifywait's order: CREATE foo, CREATE bar, then the MODIFY/CREATE events of our own
/// writes, queued behind the other file's event, as inotifywait delivered them.
fn reproduction(foo_first: bool) {
    let foo_conf = br#"{"cniVersion": "0.4.0", "name": "aws-cni", "disableCheck": true, "plugins": [{"name": "foo", "type": "foo"}]}"#;
    let bar_conf = br#"{"cniVersion": "0.4.0", "name": "aws-cni", "disableCheck": true, "plugins": [{"name": "bar", "type": "bar"}]}"#;
    let paths = vec![
        "/host/etc/cni/net.d/01-foo.conflist".to_owned(),
        "/host/etc/cni/net.d/02-bar.conflist".to_owned(),
    ];
    // Our write (tmp + mv) shows up as MODIFY then CREATE: two events.
    let mut world = World::new(paths, vec![2]);
    world.start();
    let order: [(usize, &[u8]); 2] = if foo_first {
        [(0, foo_conf), (1, bar_conf)]
    } else {
        [(1, bar_conf), (0, foo_conf)]
    };
    for (file, bytes) in order {
        world.files[file] = Some(bytes.to_vec());
        world.last_external[file] = Some((Content::Unpatched(0), bytes.to_vec()));
        world.external_writes += 1;
        world.needing_patch += 1;
        world.queue.push(file); // CREATE
    }
    let drained = world.drain();
    assert!(drained.is_ok(), "property 1 (no write loop): {drained:?}");
    assert_eq!(world.writes, 2, "each config is patched exactly once");
    assert_eq!(
        world.acted, 2,
        "property 2: our own writes were taken for external changes"
    );
    assert_eq!(
        world.handled,
        2 + 2 * 2,
        "two CREATEs plus MODIFY+CREATE per write"
    );
    world.check().unwrap();
}

#[test]
fn two_configs_within_a_millisecond_foo_first() {
    reproduction(true);
}

#[test]
fn two_configs_within_a_millisecond_bar_first() {
    reproduction(false);
}

#[test]
fn model_content_is_what_it_claims() {
    let ours = &policy().ours;
    for seed in 0..4 {
        assert!(!is_patched(
            &parse(&Content::Unpatched(seed).bytes(), ConfigKind::ConfList).unwrap(),
            ours
        ));
        assert!(is_patched(
            &parse(&Content::Patched(seed).bytes(), ConfigKind::ConfList).unwrap(),
            ours
        ));
        assert!(!is_patched(
            &parse(&Content::Misplaced(seed).bytes(), ConfigKind::ConfList).unwrap(),
            ours
        ));
        for cut in [0, 50, 99, 255] {
            assert!(parse(&Content::Partial(seed, cut).bytes(), ConfigKind::ConfList).is_err());
        }
    }
    assert!(parse(&Content::Invalid(true).bytes(), ConfigKind::ConfList).is_err());
    assert!(parse(&Content::Invalid(false).bytes(), ConfigKind::ConfList).is_err());
}
