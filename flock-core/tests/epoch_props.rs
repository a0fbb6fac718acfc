#![cfg(not(loom))]
//! Property tests of the epoch module: the record format, the start decision, the
//! state-file write rule (R8) and the restart gate (R7).
//!
//! Mutation checks (`flock_core::reintroduced!` re-introduces one race; `scripts/test --mutants r7 r8` runs both):
//!
//! * `FLOCK_REINTRODUCE=r8` on a `--cfg flock_mutants` build of `--test epoch_props`
//!   fails: the R8 mutation makes `write_decision` write
//!   a live epoch without comparing with the record on disk, so
//!   `write_rule_never_regresses_a_fresh_higher_epoch` fails its "file regressed"
//!   assertion (a draining parent whose last probe said LIVE overwrites its child's
//!   fresh record), `r8_interleaving_does_not_regress` fails the same way on the
//!   R8 interleaving, and `write_decision_contract` fails either its
//!   "overwrote a fresh record" assertion or, for an epoch that is not LIVE, its
//!   Skip assertion (the mutant skips where the rule yields).
//! * `FLOCK_REINTRODUCE=r7` on the same build fails: the R7 mutation makes the gate
//!   fire when the debounce ends whatever the liveness, so
//!   `gate_never_fires_while_not_live` fails its "fired while not LIVE" assertion.
//!   The other eight tests pass under either mutation.

use flock_core::epoch::{
    BaseId, EpochRecord, GateDecision, MAX_RECORD_BYTES, PredecessorStatus, RestartGate,
    START_RETRY_MS, StartDecision, WriteDecision, WriterId, start_epoch, write_decision,
};
use flock_core::{MonoMs, UnixMs};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------
// Record format.

fn writer() -> impl Strategy<Value = WriterId> {
    "[A-Za-z0-9][A-Za-z0-9._-]{0,63}".prop_map(|s| WriterId::new(s).expect("valid by regex"))
}

fn record() -> impl Strategy<Value = EpochRecord> {
    (
        prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()],
        any::<u32>(),
        prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()],
        writer(),
    )
        .prop_map(|(epoch, base_id, hb, w)| EpochRecord::new(epoch, base_id, UnixMs(hb), w))
}

/// A byte-level edit of a valid record: the inputs a parser gets wrong.
#[derive(Clone, Debug)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let byte = prop_oneof![
        Just(b' '),
        Just(b'='),
        Just(b'0'),
        Just(b'\n'),
        Just(b'+'),
        Just(b'v'),
        any::<u8>()
    ];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Delete),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn apply(bytes: &mut Vec<u8>, edit: &Edit) {
    let len = bytes.len();
    match *edit {
        Edit::Flip(i, b) if len > 0 => bytes[i % len] = b,
        Edit::Insert(i, b) => bytes.insert(i % (len + 1), b),
        Edit::Delete(i) if len > 0 => {
            bytes.remove(i % len);
        }
        Edit::Truncate(i) => bytes.truncate(i % (len + 1)),
        _ => {}
    }
}

/// A parse that succeeds must be of the one canonical spelling.
fn check_parse(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(r) = EpochRecord::parse(bytes) {
        let canonical = r.encode();
        prop_assert_eq!(
            canonical.as_bytes(),
            bytes,
            "accepted a non-canonical record"
        );
        prop_assert!(bytes.len() <= MAX_RECORD_BYTES);
    }
    Ok(())
}

proptest! {
    /// parse(encode(r)) == r for every record, and the encoding fits the limit.
    #[test]
    fn record_round_trips(r in record()) {
        let text = r.encode();
        prop_assert!(text.len() <= MAX_RECORD_BYTES);
        prop_assert_eq!(EpochRecord::parse(text.as_bytes()), Ok(r));
    }

    /// The parser is total on arbitrary bytes: it returns (never panics), and accepts
    /// only canonical records.
    #[test]
    fn parser_is_total_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check_parse(&bytes)?;
    }

    /// The same on near-misses of valid records (edits of an encoded record), which
    /// reach the deep error paths random bytes rarely reach.
    #[test]
    fn parser_is_total_on_edited_records(r in record(), edits in proptest::collection::vec(edit(), 1..4)) {
        let mut bytes = r.encode().into_bytes();
        for e in &edits {
            apply(&mut bytes, e);
        }
        check_parse(&bytes)?;
        // Every error renders.
        if let Err(e) = EpochRecord::parse(&bytes) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

// ---------------------------------------------------------------------------------
// The start decision and the write rule, one call at a time.

const MAX_AGE: u64 = 3_000;
const T0: u64 = 1_764_400_000_000;

fn predecessor() -> impl Strategy<Value = PredecessorStatus> {
    let epoch = prop_oneof![0u32..6, Just(u32::MAX), any::<u32>()];
    let id = (epoch, 0u32..3);
    prop_oneof![
        id.clone()
            .prop_map(|(epoch, base_id)| PredecessorStatus::Live { epoch, base_id }),
        id.prop_map(|(epoch, base_id)| PredecessorStatus::NotLive { epoch, base_id }),
        Just(PredecessorStatus::Unreachable),
    ]
}

fn small_record() -> impl Strategy<Value = EpochRecord> {
    (
        prop_oneof![0u32..6, Just(u32::MAX)],
        0u32..3,
        0u64..3 * MAX_AGE,
        0usize..3,
    )
        .prop_map(|(epoch, base, age, w)| {
            EpochRecord::new(
                epoch,
                base,
                UnixMs(T0 - MAX_AGE + age),
                WriterId::new(format!("w{w}")).unwrap(),
            )
        })
}

proptest! {
    /// start_epoch's contract on arbitrary inputs: a hot restart is only ever
    /// `record.epoch + 1` on the record's base id, with a fresh record and the admin
    /// endpoint reporting `record.epoch` LIVE; a cold start reuses a base id only when
    /// nothing answers; every wait is short and ends after now.
    #[test]
    fn start_epoch_contract(
        record in proptest::option::of(small_record()),
        now in T0 - 10..T0 + 2 * MAX_AGE,
        pred in predecessor(),
    ) {
        let now = UnixMs(now);
        let d = start_epoch(record.as_ref(), now, MAX_AGE, pred);
        let fresh = record.as_ref().is_some_and(|r| r.is_fresh(now, MAX_AGE));
        match d {
            StartDecision::Start { epoch, base_id, .. } if epoch > 0 => {
                let r = record.as_ref().expect("hot restart needs a record");
                prop_assert!(fresh);
                prop_assert_eq!(pred, PredecessorStatus::Live { epoch: r.epoch, base_id: r.base_id });
                prop_assert_eq!(epoch, r.epoch + 1);
                prop_assert_eq!(base_id, BaseId::Inherit(r.base_id));
            }
            StartDecision::Start { base_id, .. } => {
                prop_assert!(!fresh, "cold start beside a fresh record");
                match base_id {
                    BaseId::Configured => {
                        prop_assert!(record.is_none());
                        prop_assert_eq!(pred, PredecessorStatus::Unreachable);
                    }
                    BaseId::Reuse(b) => {
                        prop_assert_eq!(Some(b), record.as_ref().map(|r| r.base_id));
                        prop_assert_eq!(pred, PredecessorStatus::Unreachable);
                    }
                    BaseId::AvoidInUse(b) => {
                        prop_assert_eq!(Some(b), record.as_ref().map(|r| r.base_id));
                        prop_assert_ne!(pred, PredecessorStatus::Unreachable);
                    }
                    BaseId::Inherit(_) => prop_assert!(false, "inherit at epoch 0"),
                }
            }
            StartDecision::Wait { until_ms, .. } => {
                prop_assert!(until_ms > now && until_ms <= now.plus(START_RETRY_MS));
                prop_assert!(fresh || pred != PredecessorStatus::Unreachable);
            }
            StartDecision::Refuse { .. } => {
                prop_assert!(fresh);
                let r = record.as_ref().expect("refusal needs a record");
                prop_assert_eq!(pred, PredecessorStatus::Live { epoch: u32::MAX, base_id: r.base_id });
            }
        }
        prop_assert!(!d.to_string().is_empty());
    }

    /// write_decision's contract on arbitrary inputs: it writes only a LIVE epoch,
    /// stamped with now, and never over a fresh record with a higher epoch (or our
    /// epoch from another writer); it yields only to such a record.
    #[test]
    fn write_decision_contract(
        on_disk in proptest::option::of(small_record()),
        mine in small_record(),
        live in any::<bool>(),
        now in T0 - 10..T0 + 2 * MAX_AGE,
    ) {
        let now = UnixMs(now);
        let owned_by_other = |d: &EpochRecord| {
            d.is_fresh(now, MAX_AGE)
                && (d.epoch > mine.epoch || (d.epoch == mine.epoch && d.writer != mine.writer))
        };
        match write_decision(on_disk.as_ref(), &mine, live, now, MAX_AGE) {
            WriteDecision::Write { record, .. } => {
                prop_assert!(live, "recorded an epoch that is not LIVE");
                prop_assert_eq!(record.heartbeat_unix_ms, now);
                prop_assert_eq!(
                    (record.epoch, record.base_id, &record.writer),
                    (mine.epoch, mine.base_id, &mine.writer)
                );
                if let Some(d) = &on_disk {
                    prop_assert!(!owned_by_other(d), "overwrote a fresh record: {} with {}", d, record);
                }
            }
            WriteDecision::Yield { owner, .. } => {
                prop_assert!(owned_by_other(&owner), "yielded to {}, which does not own the file", owner);
                prop_assert_eq!(Some(owner), on_disk);
            }
            WriteDecision::Skip { .. } => {
                prop_assert!(!live, "skipped the write of a LIVE epoch");
                prop_assert!(
                    on_disk.as_ref().is_none_or(|d| !owned_by_other(d)),
                    "R8: skipped instead of yielding to the fresh record that owns the file: {:?}",
                    on_disk
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Several supervisors sharing one state file.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Envoy {
    Initializing,
    Live,
    Draining,
    Dead,
}

#[derive(Debug)]
struct Supervisor {
    epoch: u32,
    base_id: u32,
    writer: WriterId,
    envoy: Envoy,
    /// When the Envoy became LIVE (a sequence number): the admin endpoint answers for
    /// the newest LIVE Envoy.
    live_seq: u64,
    /// The supervisor's last probe of its own epoch: possibly out of date by the time
    /// it writes (the R8 interleaving).
    observed_live: bool,
    yielded: bool,
}

/// One step of the simulation. Indices pick a supervisor modulo how many there are.
#[derive(Clone, Debug)]
enum Step {
    /// A new supervisor reads the file, probes the admin endpoint and calls start_epoch.
    Spawn,
    /// Supervisor i's Envoy finishes initializing; a hot-restart child takes over from
    /// its parent, which starts draining.
    BecomeLive(usize),
    /// Supervisor i probes its epoch's liveness.
    Probe(usize),
    /// Supervisor i heartbeats: read, write_decision, write, all under the file lock
    /// (one atomic step), using its last probe.
    Heartbeat(usize),
    /// Supervisor i's pod dies.
    Die(usize),
    /// The wall clock advances.
    Tick(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => Just(Step::Spawn),
        3 => (0usize..6).prop_map(Step::BecomeLive),
        4 => (0usize..6).prop_map(Step::Probe),
        6 => (0usize..6).prop_map(Step::Heartbeat),
        1 => (0usize..6).prop_map(Step::Die),
        3 => (0..MAX_AGE / 2).prop_map(Step::Tick),
        1 => (MAX_AGE / 2..3 * MAX_AGE).prop_map(Step::Tick),
    ]
}

struct Host {
    now: u64,
    file: Option<Vec<u8>>,
    sups: Vec<Supervisor>,
    next_base_id: u32,
    live_seq: u64,
    hot_restarts: u32,
}

impl Host {
    fn new() -> Self {
        Self {
            now: T0,
            file: None,
            sups: Vec::new(),
            // 0 is the configured base id.
            next_base_id: 1,
            live_seq: 0,
            hot_restarts: 0,
        }
    }

    fn read(&self) -> Option<EpochRecord> {
        self.file.as_ref().map(|bytes| {
            EpochRecord::parse(bytes).expect("the file only ever holds encoded records")
        })
    }

    /// What `GET /server_info` says: the newest LIVE Envoy (a hot-restart child's
    /// admin endpoint is its parent's until it is LIVE), else whatever still runs.
    fn admin(&self) -> PredecessorStatus {
        let running = |s: &&Supervisor| s.envoy != Envoy::Dead;
        if let Some(s) = self
            .sups
            .iter()
            .filter(|s| s.envoy == Envoy::Live)
            .max_by_key(|s| s.live_seq)
        {
            PredecessorStatus::Live {
                epoch: s.epoch,
                base_id: s.base_id,
            }
        } else if let Some(s) = self.sups.iter().rfind(running) {
            PredecessorStatus::NotLive {
                epoch: s.epoch,
                base_id: s.base_id,
            }
        } else {
            PredecessorStatus::Unreachable
        }
    }

    fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let n = self.sups.len();
        match *step {
            Step::Spawn => self.spawn()?,
            Step::Tick(dt) => self.now += dt,
            _ if n == 0 => {}
            Step::BecomeLive(i) => {
                let i = i % n;
                if self.sups[i].envoy == Envoy::Initializing {
                    self.live_seq += 1;
                    let (epoch, base) = (self.sups[i].epoch, self.sups[i].base_id);
                    self.sups[i].envoy = Envoy::Live;
                    self.sups[i].live_seq = self.live_seq;
                    for s in &mut self.sups {
                        if s.envoy == Envoy::Live
                            && s.base_id == base
                            && s.epoch.checked_add(1) == Some(epoch)
                        {
                            s.envoy = Envoy::Draining;
                        }
                    }
                }
            }
            Step::Probe(i) => {
                let s = &mut self.sups[i % n];
                s.observed_live = s.envoy == Envoy::Live;
            }
            Step::Heartbeat(i) => self.heartbeat(i % n)?,
            Step::Die(i) => self.sups[i % n].envoy = Envoy::Dead,
        }
        Ok(())
    }

    fn spawn(&mut self) -> Result<(), TestCaseError> {
        let record = self.read();
        let admin = self.admin();
        let StartDecision::Start {
            epoch,
            base_id,
            reason,
        } = start_epoch(record.as_ref(), UnixMs(self.now), MAX_AGE, admin)
        else {
            return Ok(());
        };
        let base_id = match base_id {
            BaseId::Inherit(b) | BaseId::Reuse(b) => b,
            BaseId::Configured => 0,
            BaseId::AvoidInUse(avoid) => {
                let b = self.next_base_id;
                self.next_base_id += 1;
                prop_assert_ne!(b, avoid);
                b
            }
        };
        // The newcomer never picks the epoch of a LIVE Envoy...
        prop_assert!(
            !self
                .sups
                .iter()
                .any(|s| s.envoy == Envoy::Live && (s.base_id, s.epoch) == (base_id, epoch)),
            "picked epoch {} of base id {}, which is LIVE ({})",
            epoch,
            base_id,
            reason
        );
        // ...and a cold start never takes a base id a running Envoy holds.
        if epoch == 0 {
            prop_assert!(
                !self
                    .sups
                    .iter()
                    .any(|s| s.envoy != Envoy::Dead && s.base_id == base_id),
                "cold start on base id {} which a running Envoy holds ({})",
                base_id,
                reason
            );
        } else {
            self.hot_restarts += 1;
        }
        // Envoy arbitrates a race of two newcomers (the known limit of start_epoch):
        // the second child of the same parent cannot bind the hot-restart socket.
        if self
            .sups
            .iter()
            .any(|s| s.envoy != Envoy::Dead && (s.base_id, s.epoch) == (base_id, epoch))
        {
            return Ok(());
        }
        let writer = WriterId::new(format!("pod-{}", self.sups.len())).unwrap();
        self.sups.push(Supervisor {
            epoch,
            base_id,
            writer,
            envoy: Envoy::Initializing,
            live_seq: 0,
            observed_live: false,
            yielded: false,
        });
        Ok(())
    }

    fn heartbeat(&mut self, i: usize) -> Result<(), TestCaseError> {
        let s = &self.sups[i];
        if s.envoy == Envoy::Dead || s.yielded {
            return Ok(());
        }
        // --- under the exclusive file lock ---
        let on_disk = self.read();
        let mine = EpochRecord::new(s.epoch, s.base_id, UnixMs::ZERO, s.writer.clone());
        match write_decision(
            on_disk.as_ref(),
            &mine,
            s.observed_live,
            UnixMs(self.now),
            MAX_AGE,
        ) {
            WriteDecision::Write { record, .. } => {
                if let Some(old) = &on_disk {
                    prop_assert!(
                        record.epoch >= old.epoch || !old.is_fresh(UnixMs(self.now), MAX_AGE),
                        "R8: file regressed from fresh {} to {} at {}",
                        old,
                        record,
                        self.now
                    );
                }
                self.file = Some(record.encode().into_bytes());
            }
            WriteDecision::Yield { .. } => self.sups[i].yielded = true,
            WriteDecision::Skip { .. } => {}
        }
        // --- lock released ---
        Ok(())
    }
}

/// A scripted prefix that reaches the R8 window: epoch 0 LIVE and recorded, a
/// newcomer hot-restarts to epoch 1. The random steps that follow interleave probes,
/// take-overs and heartbeats.
fn prologue() -> Vec<Step> {
    vec![
        Step::Spawn,
        Step::BecomeLive(0),
        Step::Probe(0),
        Step::Heartbeat(0),
        Step::Spawn,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(512), ..ProptestConfig::default() })]

    /// The write rule never regresses: supervisors at epochs 0..k (some LIVE, some
    /// draining, some dead), heartbeating at random times with possibly out-of-date
    /// probes, their read-modify-writes interleaved at random (each atomic, as under
    /// the file lock). The file's epoch never decreases while the higher record is
    /// fresh, and a newcomer's start_epoch never picks the epoch of a LIVE Envoy nor
    /// cold-starts on a base id a running Envoy holds.
    #[test]
    fn write_rule_never_regresses_a_fresh_higher_epoch(
        scripted in any::<bool>(),
        steps in proptest::collection::vec(step(), 1..80),
    ) {
        let mut host = Host::new();
        let prefix = if scripted { prologue() } else { Vec::new() };
        for s in prefix.iter().chain(&steps) {
            host.step(s)?;
        }
    }
}

/// The R8 interleaving, step by step: the draining parent's out-of-date probe
/// must not regress the file to its epoch.
#[test]
fn r8_interleaving_does_not_regress() {
    let mut host = Host::new();
    let script = [
        Step::Spawn,         // pod-0: epoch 0
        Step::BecomeLive(0), // epoch 0 LIVE
        Step::Probe(0),
        Step::Heartbeat(0),  // file: epoch 0
        Step::Spawn,         // pod-1: epoch 1 (hot restart)
        Step::Probe(0),      // pod-0 sees itself LIVE...
        Step::BecomeLive(1), // ...then epoch 1 takes over; epoch 0 drains
        Step::Probe(1),
        Step::Heartbeat(1), // file: epoch 1
        Step::Tick(100),
        Step::Heartbeat(0), // pod-0's late heartbeat with its old probe
    ];
    for s in &script {
        host.step(s).unwrap();
    }
    assert_eq!(host.hot_restarts, 1);
    assert_eq!(host.read().unwrap().epoch, 1);
    assert!(host.sups[0].yielded);
    // A third pod now hot-restarts from epoch 1, not into it.
    host.step(&Step::Spawn).unwrap();
    assert_eq!(host.sups.len(), 3);
    assert_eq!(host.sups[2].epoch, 2);
}

// ---------------------------------------------------------------------------------
// The restart gate.

#[derive(Clone, Debug)]
enum GateStep {
    Trigger(u64),
    Poll(u64, bool),
}

fn gate_step(debounce: u64) -> impl Strategy<Value = GateStep> {
    let dt = 0..=debounce.saturating_mul(2).max(1);
    prop_oneof![
        dt.clone().prop_map(GateStep::Trigger),
        (dt, any::<bool>()).prop_map(|(d, live)| GateStep::Poll(d, live)),
    ]
}

fn gate_case() -> impl Strategy<Value = (u64, Option<u64>, Vec<GateStep>, u64)> {
    (0u64..2_000, proptest::option::of(0u64..10_000)).prop_flat_map(|(debounce, max_delay)| {
        (
            Just(debounce),
            Just(max_delay),
            proptest::collection::vec(gate_step(debounce), 0..60),
            0u64..5_000,
        )
    })
}

proptest! {
    /// The gate never fires while the current epoch is not LIVE, under arbitrary
    /// trigger/poll/liveness sequences; its answers are consistent with next_wakeup;
    /// and once the triggers stop and the epoch is LIVE from `t_live` on, a pending
    /// restart fires at the first poll at or after `t_live + debounce`.
    #[test]
    fn gate_never_fires_while_not_live((debounce, max_delay, steps, live_after) in gate_case()) {
        let mut gate = RestartGate::new(debounce);
        if let Some(m) = max_delay {
            gate = gate.with_max_delay(m);
        }
        let mut now = 0u64;
        for s in &steps {
            match *s {
                GateStep::Trigger(dt) => {
                    now += dt;
                    gate.trigger(MonoMs(now));
                    // At most a debounce away; in the past only when the max delay
                    // has passed (poll now).
                    let w = gate.next_wakeup();
                    prop_assert!(w.is_some_and(|w| w <= MonoMs(now + debounce)));
                    prop_assert!(w.is_some_and(|w| w >= MonoMs(now)) || max_delay.is_some());
                }
                GateStep::Poll(dt, live) => {
                    now += dt;
                    let wakeup = gate.next_wakeup();
                    match gate.poll(MonoMs(now), live) {
                        GateDecision::Fire => prop_assert!(live, "R7: fired while not LIVE at {}", now),
                        GateDecision::Deferred { until } => {
                            prop_assert!(!live);
                            prop_assert_eq!(until, MonoMs(now + debounce));
                            prop_assert_eq!(gate.next_wakeup(), Some(until));
                        }
                        GateDecision::WaitUntil { until } => {
                            prop_assert!(until > MonoMs(now));
                            prop_assert_eq!(wakeup, Some(until));
                        }
                        GateDecision::Idle => prop_assert_eq!(wakeup, None),
                    }
                }
            }
        }
        // Triggers stop; the epoch is LIVE from t_live on.
        let pending = gate.is_pending();
        let t_live = now + live_after;
        let mut fired = false;
        for t in [t_live, t_live + debounce / 2] {
            fired |= gate.poll(MonoMs(t), true) == GateDecision::Fire;
        }
        if !fired {
            fired = gate.poll(MonoMs(t_live + debounce), true) == GateDecision::Fire;
        }
        prop_assert_eq!(fired, pending, "pending restart did not fire within debounce of LIVE");
        prop_assert_eq!(gate.poll(MonoMs(t_live + 2 * debounce + 1), true), GateDecision::Idle);
    }

    /// The debounce collapses bursts: k triggers each within the debounce of the
    /// previous one, polled in between with the epoch LIVE, fire exactly once,
    /// `debounce` after the last trigger.
    #[test]
    fn gate_collapses_a_burst_into_one_fire(
        debounce in 1u64..5_000,
        gaps in proptest::collection::vec(0.0f64..1.0, 1..30),
    ) {
        let mut gate = RestartGate::new(debounce);
        let mut now = 0u64;
        gate.trigger(MonoMs(now));
        for g in gaps {
            // Strictly inside the debounce window of the previous trigger.
            let gap = ((debounce - 1) as f64 * g) as u64;
            prop_assert_ne!(gate.poll(MonoMs(now + gap / 2), true), GateDecision::Fire);
            now += gap;
            gate.trigger(MonoMs(now));
            prop_assert_ne!(gate.poll(MonoMs(now), true), GateDecision::Fire);
        }
        prop_assert_eq!(gate.poll(MonoMs(now + debounce - 1), true), GateDecision::WaitUntil { until: MonoMs(now + debounce) });
        prop_assert_eq!(gate.poll(MonoMs(now + debounce), true), GateDecision::Fire);
        prop_assert_eq!(gate.fires(), 1);
        prop_assert_eq!(gate.deferrals(), 0);
    }
}

/// A supervisor whose chain is over never removes the base id's shared memory while a
/// fresh record of another writer at a later epoch holds it (a surge upgrade's new
/// pod took Envoy over): that made the next hot restart on the node fail. Whatever the
/// successor's epoch, writer and heartbeat age within the limit.
#[test]
fn a_finishing_supervisor_never_removes_a_successors_shared_memory() {
    use flock_core::epoch::may_remove_shared_memory;
    let me = WriterId::new("old-pod").unwrap();
    let now = UnixMs(10_000_000);
    for (ours, theirs, age) in [(0u32, 1u32, 0u64), (3, 4, 4_000), (7, 100, 4_999)] {
        let successor = EpochRecord::new(
            theirs,
            7,
            UnixMs(now.0 - age),
            WriterId::new("new-pod").unwrap(),
        );
        assert!(
            !may_remove_shared_memory(Some(ours), 7, &me, Some(&successor), now, 5_000),
            "a finishing supervisor removed its successor's shared memory (epoch {ours} vs {theirs})"
        );
    }
}
