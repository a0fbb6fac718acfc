#![cfg(not(loom))]
//! The supervisor's lifecycle machine (`flock_core::epoch::supervisor`) against a
//! simulated host: Envoy processes that become LIVE after a delay (or never), die on
//! request, and an admin endpoint that answers for the newest one. One unit test per
//! rule the machine took over from the supervisor's I/O loop, and proptests over
//! arbitrary event sequences.

use std::collections::BTreeMap;

use flock_core::epoch::supervisor::{
    Action, Event, Exit, Failure, Policy, SpawnReason, Stage, StartInputs, Stop, Supervisor,
    Target, Why,
};
use flock_core::epoch::{EpochRecord, PredecessorStatus, WriteDecision, WriterId, write_decision};
use flock_core::{MonoMs, UnixMs};
use proptest::prelude::*;

const UNIX0: u64 = 1_764_400_000_000;

fn policy() -> Policy {
    Policy {
        writer: WriterId::new("me").unwrap(),
        base_id: 7,
        drain_time_ms: 2_000,
        parent_shutdown_ms: 3_000,
        debounce_ms: 500,
        max_debounce_ms: 5_000,
        heartbeat_ms: 1_000,
        heartbeat_max_age_ms: 5_000,
        live_probe_ms: 100,
        live_timeout_ms: 10_000,
        stable_after_ms: 10_000,
        start_timeout_ms: 60_000,
        handoff_timeout_ms: 4_000,
        shutdown_margin_ms: 1_000,
        max_restarts: 3,
        backoff_ms: (200, 2_000),
    }
}

#[derive(Clone, Debug)]
struct Proc {
    /// LIVE from this time on; `None`: never (a stuck initialization).
    live_at: Option<u64>,
    /// Exits on SIGTERM (else only on SIGKILL).
    obeys_term: bool,
}

/// A simulated host: performs the machine's actions and feeds the answers back.
struct Host {
    m: Supervisor,
    now: u64,
    procs: BTreeMap<u32, Proc>,
    /// Exits to deliver: (epoch, clean).
    exits: Vec<(u32, bool)>,
    log: Vec<(u64, Action)>,
    /// How long a new epoch takes to become LIVE (`None`: never).
    live_delay: Option<u64>,
    obeys_term: bool,
    validates: bool,
    /// The admin endpoint answers for another supervisor's later epoch (it took ours
    /// over).
    successor_answers: bool,
    on_disk: Option<EpochRecord>,
    finished: Option<Result<Exit, Failure>>,
    /// Invariant violations seen while performing actions.
    violations: Vec<String>,
}

impl Host {
    fn new(policy: Policy) -> Self {
        let mut h = Self {
            m: Supervisor::new(policy, MonoMs(0)),
            now: 0,
            procs: BTreeMap::new(),
            exits: Vec::new(),
            log: Vec::new(),
            live_delay: Some(300),
            obeys_term: true,
            validates: true,
            successor_answers: false,
            on_disk: None,
            finished: None,
            violations: Vec::new(),
        };
        h.feed(Event::Timer);
        h
    }

    fn is_live(&self, epoch: u32) -> bool {
        self.procs
            .get(&epoch)
            .is_some_and(|p| p.live_at.is_some_and(|t| t <= self.now))
    }

    fn feed(&mut self, event: Event) {
        self.m.handle(event, MonoMs(self.now), 0.5);
        while let Some(action) = self.m.poll_action() {
            self.log.push((self.now, action.clone()));
            self.perform(action);
        }
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::Probe => {
                let status = match self.procs.keys().next_back() {
                    Some(&epoch) if self.is_live(epoch) => {
                        PredecessorStatus::Live { epoch, base_id: 7 }
                    }
                    Some(&epoch) => PredecessorStatus::NotLive { epoch, base_id: 7 },
                    None => PredecessorStatus::Unreachable,
                };
                self.feed(Event::Probed(status));
            }
            Action::PrepareStart { inputs } => {
                let answer = if self.validates {
                    Ok(inputs.then(|| StartInputs {
                        on_disk: self.on_disk.clone(),
                        status: PredecessorStatus::Unreachable,
                        now_unix: UnixMs(UNIX0 + self.now),
                    }))
                } else {
                    Err("bad config".to_string())
                };
                self.feed(Event::StartPrepared(answer));
            }
            Action::Spawn { epoch, .. } | Action::HotRestart { epoch, .. } => {
                // Never two epochs started while one is not LIVE (R7 and its twin
                // for crash restarts).
                for &e in self.procs.keys() {
                    if !self.is_live(e) {
                        self.violations.push(format!(
                            "epoch {epoch} started at {} while epoch {e} was not LIVE",
                            self.now
                        ));
                    }
                }
                if !self.validates {
                    return self.feed(Event::SpawnFailed {
                        epoch,
                        why: "invalid".into(),
                    });
                }
                self.procs.insert(
                    epoch,
                    Proc {
                        live_at: self.live_delay.map(|d| self.now + d),
                        obeys_term: self.obeys_term,
                    },
                );
                self.feed(Event::Spawned { epoch });
            }
            Action::Heartbeat { .. } => self.feed(Event::Heartbeat(None)),
            Action::Drain { epoch, .. } => {
                let ours = !self.successor_answers
                    && self.procs.keys().next_back() == Some(&epoch)
                    && self.is_live(epoch);
                self.feed(Event::DrainStarted {
                    ours,
                    successor: self.successor_answers,
                });
            }
            Action::Signal { target, stop, .. } => {
                let targets: Vec<u32> = match target {
                    Target::Epoch(e) => vec![e],
                    Target::NewestRunning => {
                        self.procs.keys().next_back().copied().into_iter().collect()
                    }
                    Target::All => self.procs.keys().copied().collect(),
                };
                for e in targets {
                    if let Some(p) = self.procs.get(&e)
                        && (stop == Stop::Kill || p.obeys_term)
                        && !self.exits.iter().any(|(x, _)| *x == e)
                    {
                        self.exits.push((e, stop == Stop::Term));
                    }
                }
            }
            Action::Finish(result) => self.finished = Some(result),
            _ => {}
        }
    }

    /// Delivers pending exits, then timers, up to `t`.
    fn run_until(&mut self, t: u64) {
        loop {
            if self.finished.is_some() {
                return;
            }
            if let Some((epoch, clean)) = (!self.exits.is_empty()).then(|| self.exits.remove(0)) {
                self.procs.remove(&epoch);
                let on_disk = self.on_disk.clone();
                self.feed(Event::Exited {
                    epoch,
                    how: if clean {
                        "exit status 0".into()
                    } else {
                        "killed by signal 9".into()
                    },
                    on_disk,
                    now_unix: UnixMs(UNIX0 + self.now),
                });
                continue;
            }
            match self.m.poll_timeout() {
                Some(next) if next.as_millis() <= t => {
                    self.now = self.now.max(next.as_millis());
                    let before = self.log.len();
                    self.feed(Event::Timer);
                    // A deadline that does nothing when reached would spin the caller.
                    if self.log.len() == before && self.m.poll_timeout() == Some(next) {
                        panic!("deadline {next} reached at {} changed nothing", self.now);
                    }
                }
                _ => break,
            }
        }
        self.now = self.now.max(t);
    }

    /// An epoch dies on its own.
    fn crash(&mut self, epoch: u32) {
        if self.procs.contains_key(&epoch) && !self.exits.iter().any(|(x, _)| *x == epoch) {
            self.exits.push((epoch, false));
        }
    }

    fn actions(&self, pick: impl Fn(&Action) -> bool) -> Vec<(u64, Action)> {
        self.log.iter().filter(|(_, a)| pick(a)).cloned().collect()
    }

    fn spawns(&self) -> Vec<(u64, u32)> {
        self.log
            .iter()
            .filter_map(|(t, a)| match a {
                Action::Spawn { epoch, .. } | Action::HotRestart { epoch, .. } => {
                    Some((*t, *epoch))
                }
                _ => None,
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------
// One test per rule.

#[test]
fn first_start_is_the_start_decision_on_the_configured_base_id() {
    let mut h = Host::new(policy());
    assert_eq!(
        h.log
            .iter()
            .map(|(_, a)| a.clone())
            .filter(|a| !matches!(a, Action::StartDecided(_)))
            .take(2)
            .collect::<Vec<_>>(),
        vec![
            Action::PrepareStart { inputs: true },
            Action::Spawn {
                epoch: 0,
                base_id: 7,
                reason: SpawnReason::First
            },
        ]
    );
    h.run_until(1_000);
    assert!(h.m.newest_live());
    assert!(
        h.actions(|a| matches!(
            a,
            Action::Ready {
                epoch: Some(0),
                took_ms: Some(300)
            }
        ))
        .len()
            == 1
    );
}

#[test]
fn an_invalid_first_config_fails_at_once() {
    let mut p = policy();
    p.max_restarts = 10;
    let mut m = Supervisor::new(p, MonoMs(0));
    m.handle(Event::Timer, MonoMs(0), 0.5);
    assert_eq!(m.poll_action(), Some(Action::PrepareStart { inputs: true }));
    m.handle(Event::StartPrepared(Err("nope".into())), MonoMs(5), 0.5);
    assert!(matches!(
        m.poll_action(),
        Some(Action::Finish(Err(Failure::InvalidConfig(_))))
    ));
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn an_epoch_not_live_within_the_live_timeout_is_stopped_and_counts_as_a_failure() {
    let mut h = Host::new(policy());
    h.live_delay = None;
    // The first epoch was spawned with live_delay 300 before we changed it: crash it.
    h.crash(0);
    h.run_until(1_000);
    let (restarted, epoch) = *h.spawns().last().unwrap();
    assert!(restarted > 0);
    assert!(h.procs.values().all(|p| p.live_at.is_none()));
    h.run_until(restarted + 9_999);
    assert!(
        h.actions(|a| matches!(
            a,
            Action::Signal {
                why: Why::LiveTimeout,
                ..
            }
        ))
        .is_empty()
    );
    h.run_until(restarted + 10_000);
    let kills = h.actions(|a| {
        matches!(
            a,
            Action::Signal {
                why: Why::LiveTimeout,
                ..
            }
        )
    });
    assert_eq!(
        kills,
        vec![(
            restarted + 10_000,
            Action::Signal {
                target: Target::Epoch(epoch),
                stop: Stop::Term,
                why: Why::LiveTimeout
            }
        )]
    );
    h.run_until(restarted + 10_001);
    assert_eq!(h.m.failures(), 2, "the stopped epoch's exit is a failure");
}

#[test]
fn a_stable_epoch_resets_the_failure_count() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    h.crash(0);
    h.run_until(1_001);
    assert_eq!(h.m.failures(), 1);
    // Restarted after the backoff, LIVE 300 ms later.
    h.run_until(5_000);
    assert!(h.m.newest_live());
    // No record of ours counts after our epochs died: the restart is epoch 0 again.
    let live = h.actions(|a| matches!(a, Action::Ready { epoch: Some(_), .. }));
    let live_at = live.last().unwrap().0;
    assert!(live.len() == 2 && live_at > 1_000, "{live:?}");
    h.run_until(live_at + 9_999);
    assert_eq!(h.m.failures(), 1);
    h.run_until(live_at + 10_000);
    assert_eq!(h.m.failures(), 0);
    assert_eq!(
        h.actions(|a| *a == Action::FailuresReset),
        vec![(live_at + 10_000, Action::FailuresReset)]
    );
}

#[test]
fn gives_up_after_max_restarts_consecutive_deaths() {
    let mut h = Host::new(policy());
    for _ in 0..10 {
        h.run_until(h.now + 1_000);
        if let Some(&e) = h.procs.keys().next_back() {
            h.crash(e);
        }
        h.run_until(h.now + 1);
    }
    assert_eq!(
        h.spawns().len(),
        4,
        "the first start and max_restarts = 3 restarts"
    );
    assert!(matches!(h.finished, Some(Err(Failure::GaveUp(_)))));
}

#[test]
fn failed_starts_count_toward_the_same_give_up_rule() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    h.validates = false;
    h.crash(0);
    h.run_until(60_000);
    // The death, then failed starts: failures 1 (death), 2, 3, 4 → give up.
    assert!(
        matches!(h.finished, Some(Err(Failure::GaveUp(ref m))) if m.contains("4 times")),
        "{:?}",
        h.finished
    );
}

#[test]
fn a_trigger_while_initializing_is_deferred_then_fires_once_live() {
    let mut h = Host::new(policy());
    h.live_delay = Some(300);
    h.feed(Event::Trigger); // at 0: epoch 0 initializes until 300
    h.run_until(499);
    assert_eq!(h.spawns().len(), 1);
    h.run_until(600);
    // Debounce end at 500: LIVE since 300 and alone: fires.
    assert_eq!(h.spawns(), vec![(0, 0), (500, 1)]);
    // A trigger while epoch 1 initializes (LIVE at 800) and epoch 0 drains (2 s).
    h.feed(Event::Trigger);
    h.run_until(1_100);
    assert_eq!(h.actions(|a| matches!(a, Action::Deferred { .. })).len(), 1);
    // Epoch 1 LIVE at 800; its predecessor drained at 2_800.
    h.run_until(10_000);
    let spawns = h.spawns();
    assert_eq!(spawns.len(), 3);
    assert!(spawns[2].0 >= 2_800, "{spawns:?}");
    assert!(h.violations.is_empty(), "{:?}", h.violations);
}

#[test]
fn shutdown_drains_then_terminates_newest_first_then_kills() {
    let mut h = Host::new(policy());
    h.obeys_term = false;
    h.feed(Event::Trigger);
    h.run_until(1_000);
    // Two epochs now: 0 draining, 1 LIVE (spawned with obeys_term false).
    h.procs.values_mut().for_each(|p| p.obeys_term = false);
    h.feed(Event::ShutdownSignal);
    let t0 = h.now;
    assert!(
        h.actions(|a| matches!(a, Action::Drain { epoch: 1, .. }))
            .len()
            == 1
    );
    assert_eq!(
        h.m.shutdown_stage(),
        Some(Stage::Draining {
            until: MonoMs(t0 + 2_000)
        })
    );
    h.run_until(t0 + 1_999);
    assert!(h.actions(|a| matches!(a, Action::Signal { .. })).is_empty());
    h.run_until(t0 + 2_000);
    h.run_until(t0 + 2_999);
    assert_eq!(
        h.actions(|a| matches!(a, Action::Signal { .. })),
        vec![(
            t0 + 2_000,
            Action::Signal {
                target: Target::NewestRunning,
                stop: Stop::Term,
                why: Why::DrainOver
            }
        )]
    );
    h.run_until(t0 + 3_000);
    assert_eq!(
        h.actions(|a| matches!(a, Action::Signal { .. }))[1],
        (
            t0 + 3_000,
            Action::Signal {
                target: Target::All,
                stop: Stop::Kill,
                why: Why::ShutdownMargin
            }
        )
    );
    h.run_until(t0 + 3_001);
    assert_eq!(h.finished, Some(Ok(Exit::Terminated)));
}

/// SIGTERM after another supervisor took Envoy over (a surge upgrade's old pod): the
/// admin endpoint answers for the successor's epoch, so ours is left to the
/// successor's parent shutdown (stopping it sooner made the successor's Envoy abort on
/// its next message to its parent); it exits on its own and the supervisor finishes
/// superseded, without a signal. Only past the superseded bound is it killed.
#[test]
fn shutdown_after_a_takeover_leaves_our_epoch_to_the_successor() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    assert!(h.is_live(0));
    h.successor_answers = true;
    h.feed(Event::ShutdownSignal);
    let t0 = h.now;
    // drain 2 s + parent shutdown 3 s + margin 1 s.
    assert_eq!(
        h.m.shutdown_stage(),
        Some(Stage::AwaitSuccessor {
            kill_at: MonoMs(t0 + 6_000)
        }),
        "our epoch was stopped under the successor (the shutdown stage)"
    );
    h.run_until(t0 + 3_000);
    assert!(
        h.actions(|a| matches!(a, Action::Signal { .. })).is_empty(),
        "our epoch was stopped under the successor: {:?}",
        h.actions(|a| matches!(a, Action::Signal { .. }))
    );
    // The successor's Envoy shuts ours down (its parent shutdown).
    h.exits.push((0, true));
    h.run_until(t0 + 3_001);
    assert_eq!(h.finished, Some(Ok(Exit::Superseded)));
    assert!(h.actions(|a| matches!(a, Action::Signal { .. })).is_empty());

    // An epoch that outlives the bound is killed.
    let mut h = Host::new(policy());
    h.run_until(1_000);
    h.successor_answers = true;
    h.obeys_term = false;
    h.feed(Event::ShutdownSignal);
    let t0 = h.now;
    h.run_until(t0 + 6_001);
    assert_eq!(
        h.actions(|a| matches!(a, Action::Signal { .. })),
        vec![(
            t0 + 6_000,
            Action::Signal {
                target: Target::All,
                stop: Stop::Kill,
                why: Why::SupersededTooLong
            }
        )]
    );
}

#[test]
fn shutdown_during_a_handoff_waits_for_it_bounded_by_the_handoff_timeout() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    h.live_delay = None;
    h.feed(Event::Trigger);
    h.run_until(1_500); // epoch 1 started at 1_500, never LIVE
    assert_eq!(h.spawns().len(), 2);
    h.feed(Event::ShutdownSignal);
    h.run_until(5_499);
    assert!(h.actions(|a| matches!(a, Action::Drain { .. })).is_empty());
    h.run_until(5_500);
    assert_eq!(h.actions(|a| matches!(a, Action::Drain { .. })).len(), 1);
    // Epoch 1 does not answer LIVE: no drain; stopped at once, newest first.
    assert_eq!(
        h.actions(|a| matches!(a, Action::Signal { .. }))[0].0,
        5_500
    );
    h.run_until(6_000);
    assert_eq!(h.finished, Some(Ok(Exit::Terminated)));
}

#[test]
fn an_exit_with_a_fresh_successor_recorded_is_a_supersession_not_a_failure() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    // Our epoch exits: a fresh successor's record on our base id is on disk.
    h.on_disk = Some(EpochRecord::new(
        1,
        7,
        UnixMs(UNIX0 + 1_000),
        WriterId::new("other").unwrap(),
    ));
    h.crash(0);
    h.run_until(1_001);
    assert_eq!(h.finished, Some(Ok(Exit::Superseded)));
    assert_eq!(h.m.failures(), 0);
    assert_eq!(h.spawns().len(), 1, "no restart on the successor's base id");
}

#[test]
fn superseded_epochs_are_killed_if_they_outlive_the_successor_bound() {
    let mut h = Host::new(policy());
    h.run_until(1_000);
    h.procs.values_mut().for_each(|p| p.obeys_term = false);
    // The heartbeat finds a successor's fresh, higher record: yield.
    let successor = EpochRecord::new(1, 7, UnixMs(UNIX0 + 1_000), WriterId::new("other").unwrap());
    let mine = EpochRecord::new(0, 7, UnixMs::ZERO, WriterId::new("me").unwrap());
    let decision = write_decision(Some(&successor), &mine, true, UnixMs(UNIX0 + 1_000), 5_000);
    assert!(
        matches!(decision, WriteDecision::Yield { .. }),
        "{decision}"
    );
    h.feed(Event::Heartbeat(Some(decision)));
    assert!(h.m.is_stopping());
    // A trigger while superseded is ignored: the chain is the successor's.
    h.feed(Event::Trigger);
    assert!(!h.m.gate().is_pending());
    let t0 = h.now;
    // Envoy's parent shutdown should end our epoch; it does not. The bound is the
    // successor's drain + parent-shutdown time + the margin: 2 + 3 + 1 s.
    h.run_until(t0 + 5_999);
    assert!(h.actions(|a| matches!(a, Action::Signal { .. })).is_empty());
    assert!(h.finished.is_none());
    h.run_until(t0 + 6_000);
    assert_eq!(
        h.actions(|a| matches!(a, Action::Signal { .. })),
        vec![(
            t0 + 6_000,
            Action::Signal {
                target: Target::All,
                stop: Stop::Kill,
                why: Why::SupersededTooLong
            }
        )]
    );
    h.run_until(t0 + 6_001);
    assert_eq!(h.finished, Some(Ok(Exit::Superseded)));
    assert_eq!(h.spawns().len(), 1);
}

// ---------------------------------------------------------------------------------
// Properties.

#[derive(Clone, Debug)]
enum Op {
    Advance(u64),
    Trigger,
    Crash,
    LiveDelay(Option<u64>),
    Validates(bool),
    Shutdown,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..3_000).prop_map(Op::Advance),
        3 => Just(Op::Trigger),
        1 => Just(Op::Crash),
        1 => proptest::option::of(0u64..2_000).prop_map(Op::LiveDelay),
        1 => any::<bool>().prop_map(Op::Validates),
        1 => Just(Op::Shutdown),
    ]
}

proptest! {
    /// Under any sequence of triggers, crashes, slow or stuck initializations, failing
    /// validations and a shutdown: no epoch is started while another of ours is not
    /// LIVE; every action is performed at or after the deadline that asked for it
    /// (the host only advances to `poll_timeout`); and a shutdown always ends, within
    /// handoff + drain + margin, with every process gone.
    #[test]
    fn never_starts_an_epoch_beside_one_that_is_not_live(ops in proptest::collection::vec(op(), 0..40)) {
        let mut h = Host::new(policy());
        let mut shutdown_at = None;
        for op in ops {
            match op {
                Op::Advance(dt) => h.run_until(h.now + dt),
                Op::Trigger => h.feed(Event::Trigger),
                Op::Crash => {
                    if let Some(&e) = h.procs.keys().next_back() {
                        h.crash(e);
                    }
                }
                Op::LiveDelay(d) => h.live_delay = d,
                Op::Validates(v) => h.validates = v,
                Op::Shutdown => {
                    if shutdown_at.is_none() && h.finished.is_none() {
                        shutdown_at = Some(h.now);
                        h.feed(Event::ShutdownSignal);
                    }
                }
            }
            if h.finished.is_some() {
                break;
            }
        }
        prop_assert!(h.violations.is_empty(), "{:?}", h.violations);
        if let Some(t0) = shutdown_at && h.finished.is_none() {
            let p = policy();
            let bound = t0 + p.handoff_timeout_ms + p.drain_time_ms + p.shutdown_margin_ms + 1;
            h.run_until(bound);
            prop_assert!(h.finished.is_some(), "shutdown at {} not over at {}", t0, bound);
            prop_assert!(matches!(h.finished, Some(Ok(Exit::Terminated)) | Some(Err(_))));
        }
        if matches!(h.finished, Some(Ok(Exit::Terminated))) {
            prop_assert!(h.procs.is_empty());
        }
    }

    /// Give-up: with every epoch dying `life` ms after it started, the supervisor gives
    /// up after exactly `max_restarts` restarts when deaths come faster than the
    /// stable period, and never when each epoch outlives the stable period (unless no
    /// restart is allowed at all).
    #[test]
    fn gives_up_after_exactly_max_restarts_within_the_stable_window(
        max_restarts in 0u32..6,
        life in 400u64..20_000,
    ) {
        let mut p = policy();
        p.max_restarts = max_restarts;
        let mut h = Host::new(p.clone());
        let mut deaths = 0;
        while h.finished.is_none() && deaths < 12 {
            let Some((&e, _)) = h.procs.iter().next_back() else {
                h.run_until(h.now + 100);
                continue;
            };
            let started = h.spawns().last().unwrap().0;
            h.run_until(started + life);
            h.crash(e);
            h.run_until(h.now + 1);
            deaths += 1;
        }
        // LIVE after 300 ms: it counts as stable after 300 + stable_after_ms.
        let stable = life >= 300 + p.stable_after_ms;
        if stable && max_restarts > 0 {
            prop_assert!(h.finished.is_none(), "gave up although every epoch was stable: {:?}", h.finished);
        } else {
            prop_assert!(matches!(h.finished, Some(Err(Failure::GaveUp(_)))), "{:?}", h.finished);
            // The stable period only clears failures counted before it.
            let spawns = if stable { 1 } else { max_restarts + 1 };
            prop_assert_eq!(h.spawns().len() as u32, spawns);
        }
    }

    /// Shutdown stages come in order at their deadlines, whatever the timings: drain
    /// request at the signal (the newest epoch is LIVE), SIGTERM to the newest at the
    /// end of the drain, SIGKILL to all after the margin, then exit.
    #[test]
    fn shutdown_stages_in_order_at_their_deadlines(
        drain in 0u64..5_000,
        margin in 0u64..5_000,
        at in 1_000u64..20_000,
    ) {
        let mut p = policy();
        p.drain_time_ms = drain;
        p.shutdown_margin_ms = margin;
        let mut h = Host::new(p);
        h.obeys_term = false;
        h.run_until(at);
        h.procs.values_mut().for_each(|pr| pr.obeys_term = false);
        h.feed(Event::ShutdownSignal);
        h.run_until(at + drain + margin + 1);
        let stages: Vec<(u64, Action)> = h.actions(|a| matches!(a, Action::Drain { .. } | Action::Signal { .. } | Action::Finish(_)));
        prop_assert_eq!(stages.len(), 4, "{:?}", stages);
        let first_is_drain = matches!(stages[0], (t, Action::Drain { .. }) if t == at);
        prop_assert!(first_is_drain, "{:?}", stages);
        prop_assert_eq!(&stages[1], &(at + drain, Action::Signal { target: Target::NewestRunning, stop: Stop::Term, why: Why::DrainOver }));
        prop_assert_eq!(&stages[2], &(at + drain + margin, Action::Signal { target: Target::All, stop: Stop::Kill, why: Why::ShutdownMargin }));
        prop_assert_eq!(&stages[3], &(at + drain + margin, Action::Finish(Ok(Exit::Terminated))));
    }
}
