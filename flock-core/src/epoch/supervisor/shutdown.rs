//! The shutdown stages: wait (bounded) for an in-progress handoff's new epoch to become
//! LIVE, drain the listeners through the admin endpoint for the drain time, SIGTERM the
//! epochs newest first, SIGKILL what is left after a margin.

use super::{Action, Awaiting, Exit, Stage, Stop, Supervisor, Target, Why};
use crate::time::MonoMs;

impl Supervisor {
    pub(super) fn on_shutdown_signal(&mut self, now: MonoMs) {
        if self.shutdown.is_some() {
            return;
        }
        self.set_not_ready();
        self.start_at = None;
        let handoff = self.live_since.is_none() && self.newest_running();
        let deadline = if handoff && self.superseded_at.is_none() {
            now.plus(self.policy.handoff_timeout_ms)
        } else {
            now
        };
        self.shutdown = Some(Stage::WaitHandoff { deadline });
    }

    pub(super) fn on_drain_started(&mut self, ours: bool, successor: bool, now: MonoMs) {
        self.awaiting = None;
        // The mutant stops our epochs anyway, as before: the successor's Envoy, still
        // talking to ours as its hot-restart parent, then aborts.
        if successor
            && self.shutdown == Some(Stage::DrainRequested)
            && !crate::reintroduced!("supervisor-stops-successors-parent")
        {
            self.await_successor(now);
            return;
        }
        if self.shutdown == Some(Stage::DrainRequested) {
            let drain = if ours { self.policy.drain_time_ms } else { 0 };
            self.shutdown = Some(Stage::Draining {
                until: now.plus(drain),
            });
        }
    }

    /// Another supervisor's Envoy took ours over: it shuts our epochs down itself
    /// (Envoy's parent shutdown, after its own drain), so we wait for them to exit,
    /// killing what is left only after the superseded bound. Stopping them sooner
    /// made the successor's Envoy abort on its next message to its parent
    /// ("hot restart sendmsg() failed").
    fn await_successor(&mut self, now: MonoMs) {
        if self.superseded_at.is_none() {
            self.superseded_at = Some(now);
        }
        self.shutdown = Some(Stage::AwaitSuccessor {
            kill_at: now.plus(self.superseded_bound_ms()),
        });
    }

    pub(super) fn drive_shutdown(&mut self, now: MonoMs) {
        if self.running.is_empty() {
            let exit = if matches!(self.shutdown, Some(Stage::AwaitSuccessor { .. })) {
                Exit::Superseded
            } else {
                Exit::Terminated
            };
            return self.finish(Ok(exit));
        }
        match self.shutdown {
            Some(Stage::WaitHandoff { deadline }) => {
                let newest_alive = self.newest_running();
                if self.live_since.is_some() || !newest_alive || now >= deadline {
                    match self.newest {
                        // Only drain through the admin endpoint when it answers for our
                        // newest epoch: never drain a successor's Envoy.
                        Some(epoch) if self.superseded_at.is_none() => {
                            self.shutdown = Some(Stage::DrainRequested);
                            self.awaiting = Some(Awaiting::Drain);
                            self.actions.push_back(Action::Drain {
                                epoch,
                                base_id: self.base_id,
                            });
                        }
                        Some(_) if !crate::reintroduced!("supervisor-stops-successors-parent") => {
                            self.await_successor(now);
                        }
                        _ => {
                            self.shutdown = Some(Stage::Draining { until: now });
                            self.drive_shutdown(now);
                        }
                    }
                }
            }
            Some(Stage::Draining { until }) if now >= until => {
                self.signal(Target::NewestRunning, Stop::Term, Why::DrainOver);
                self.shutdown = Some(Stage::Terminating {
                    kill_at: now.plus(self.policy.shutdown_margin_ms),
                });
            }
            Some(Stage::AwaitSuccessor { kill_at }) if now >= kill_at => {
                self.signal(Target::All, Stop::Kill, Why::SupersededTooLong);
                self.shutdown = Some(Stage::Killed);
            }
            Some(Stage::Terminating { kill_at }) if now >= kill_at => {
                self.signal(Target::All, Stop::Kill, Why::ShutdownMargin);
                self.shutdown = Some(Stage::Killed);
            }
            _ => {}
        }
    }
}
