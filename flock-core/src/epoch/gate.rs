//! The restart gate: a trailing debounce that never forks while the current epoch is
//! not LIVE (race R7 of the concurrency audit).

/// What the caller of [`RestartGate::poll`] does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateDecision {
    /// No restart is pending. Poll again after the next trigger.
    Idle,
    /// A restart is pending; its debounce ends at `until_ms`. Poll again then.
    WaitUntil {
        /// The deadline (monotonic ms).
        until_ms: u64,
    },
    /// Hot-restart now (fork the next epoch). The pending restart is consumed.
    Fire,
    /// The debounce ended but the current epoch is not LIVE: forking now would make
    /// the new epoch exit ("previous envoy process is still initializing"). The
    /// debounce was re-armed; poll again at `until_ms`.
    Deferred {
        /// The re-armed deadline (monotonic ms).
        until_ms: u64,
    },
}

/// Debounces hot-restart triggers and gates the restart on the current epoch being
/// LIVE.
///
/// * [`trigger`](Self::trigger) (a config change, SIGHUP) arms the gate or pushes its
///   deadline to `now_ms + debounce_ms` (trailing debounce: a burst of triggers ends
///   in one restart, `debounce_ms` after the last one).
/// * With [`with_max_delay`](Self::with_max_delay), the deadline is never pushed past
///   the first pending trigger + `max_delay_ms`, so a constant stream of triggers
///   (a flapping config source) still restarts. Without it, a stream of triggers
///   closer than `debounce_ms` postpones the restart for as long as it lasts. A max
///   delay of about 10× the debounce is a reasonable choice.
/// * [`poll`](Self::poll) at or after the deadline fires only if the current epoch is
///   LIVE. If not, it re-arms the debounce (`now_ms + debounce_ms`) and returns
///   [`GateDecision::Deferred`]: never fork while not LIVE. Once the epoch is LIVE and
///   the triggers stop, the restart fires at the first poll at or after
///   `max(last trigger, last deferral) + debounce_ms`.
///
/// **Contract:** `current_epoch_live` is the liveness of the **newest** epoch (the one
/// a fork would succeed), i.e. after a [`GateDecision::Fire`] the caller reports the
/// new epoch's liveness from then on, so a trigger while it initializes is deferred,
/// not fired.
///
/// A persistently deferred restart ([`consecutive_deferrals`](Self::consecutive_deferrals)
/// growing) means the epoch never becomes LIVE, e.g. Envoy's stuck init flag
/// (envoy#33446); the supervisor alarms and recovers on its own schedule.
///
/// Times are monotonic `u64` milliseconds with a caller-chosen origin. If the caller's
/// clock ever goes backwards, the gate only waits longer; it never fires early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartGate {
    debounce_ms: u64,
    max_delay_ms: Option<u64>,
    pending: Option<Pending>,
    triggers: u64,
    fires: u64,
    deferrals: u64,
    consecutive_deferrals: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    /// The first trigger since the last fire.
    first_ms: u64,
    /// When the debounce ends.
    deadline_ms: u64,
}

impl RestartGate {
    /// A gate with a trailing debounce of `debounce_ms` and no max delay.
    pub fn new(debounce_ms: u64) -> Self {
        Self {
            debounce_ms,
            max_delay_ms: None,
            pending: None,
            triggers: 0,
            fires: 0,
            deferrals: 0,
            consecutive_deferrals: 0,
        }
    }

    /// Caps how far triggers push the deadline: at most `max_delay_ms` after the first
    /// pending trigger (raised to `debounce_ms` if smaller). Liveness deferrals are not
    /// capped: the gate never fires while the epoch is not LIVE.
    pub fn with_max_delay(mut self, max_delay_ms: u64) -> Self {
        self.max_delay_ms = Some(max_delay_ms.max(self.debounce_ms));
        self
    }

    /// Requests a hot restart at `now_ms`.
    pub fn trigger(&mut self, now_ms: u64) {
        self.triggers = self.triggers.saturating_add(1);
        let debounced = now_ms.saturating_add(self.debounce_ms);
        self.pending = Some(match self.pending {
            None => Pending {
                first_ms: now_ms,
                deadline_ms: debounced,
            },
            Some(Pending {
                first_ms,
                deadline_ms,
            }) => {
                let pushed = match self.max_delay_ms {
                    Some(max) => debounced.min(first_ms.saturating_add(max)),
                    None => debounced,
                };
                Pending {
                    first_ms,
                    // Never earlier than already promised: a deferral's re-arm stands.
                    deadline_ms: deadline_ms.max(pushed),
                }
            }
        });
    }

    /// Decides at `now_ms`; `current_epoch_live` is whether the newest epoch is LIVE
    /// (see the contract on [`RestartGate`]).
    pub fn poll(&mut self, now_ms: u64, current_epoch_live: bool) -> GateDecision {
        // Re-introduces R7 so the property test can show it catches it; never enabled
        // in builds: the seed's supervisor forked whenever the debounce ended.
        let current_epoch_live = current_epoch_live || cfg!(flock_reintroduce = "r7");
        let Some(pending) = self.pending else {
            return GateDecision::Idle;
        };
        if now_ms < pending.deadline_ms {
            return GateDecision::WaitUntil {
                until_ms: pending.deadline_ms,
            };
        }
        if current_epoch_live {
            self.pending = None;
            self.fires = self.fires.saturating_add(1);
            self.consecutive_deferrals = 0;
            return GateDecision::Fire;
        }
        let until_ms = now_ms.saturating_add(self.debounce_ms);
        self.pending = Some(Pending {
            deadline_ms: until_ms,
            ..pending
        });
        self.deferrals = self.deferrals.saturating_add(1);
        self.consecutive_deferrals = self.consecutive_deferrals.saturating_add(1);
        GateDecision::Deferred { until_ms }
    }

    /// When the caller must poll next (monotonic ms), or `None` if nothing is pending.
    pub fn next_wakeup(&self) -> Option<u64> {
        self.pending.map(|p| p.deadline_ms)
    }

    /// Whether a restart is pending.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The debounce, in milliseconds.
    pub fn debounce_ms(&self) -> u64 {
        self.debounce_ms
    }

    /// Triggers received so far (a metric).
    pub fn triggers(&self) -> u64 {
        self.triggers
    }

    /// Restarts fired so far (a metric).
    pub fn fires(&self) -> u64 {
        self.fires
    }

    /// Deferrals so far because the epoch was not LIVE (a metric).
    pub fn deferrals(&self) -> u64 {
        self.deferrals
    }

    /// Deferrals since the last fire: grows while an epoch never becomes LIVE.
    pub fn consecutive_deferrals(&self) -> u64 {
        self.consecutive_deferrals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_until_triggered() {
        let mut gate = RestartGate::new(500);
        assert_eq!(gate.poll(0, true), GateDecision::Idle);
        assert_eq!(gate.poll(10_000, false), GateDecision::Idle);
        assert_eq!(gate.next_wakeup(), None);
    }

    #[test]
    fn trigger_fires_after_debounce_when_live() {
        let mut gate = RestartGate::new(500);
        gate.trigger(1_000);
        assert_eq!(gate.next_wakeup(), Some(1_500));
        assert_eq!(
            gate.poll(1_499, true),
            GateDecision::WaitUntil { until_ms: 1_500 }
        );
        assert_eq!(gate.poll(1_500, true), GateDecision::Fire);
        assert_eq!(gate.poll(1_501, true), GateDecision::Idle);
        assert_eq!((gate.triggers(), gate.fires(), gate.deferrals()), (1, 1, 0));
    }

    #[test]
    fn burst_of_triggers_collapses_into_one_fire_after_the_last() {
        let mut gate = RestartGate::new(500);
        for t in [0, 100, 400, 800, 1_200] {
            gate.trigger(t);
            assert!(matches!(gate.poll(t, true), GateDecision::WaitUntil { .. }));
        }
        assert_eq!(gate.next_wakeup(), Some(1_700));
        assert_eq!(
            gate.poll(1_699, true),
            GateDecision::WaitUntil { until_ms: 1_700 }
        );
        assert_eq!(gate.poll(1_700, true), GateDecision::Fire);
        assert_eq!(gate.fires(), 1);
    }

    #[test]
    fn deadline_passed_while_not_live_defers_and_rearms_never_forks() {
        // R7: two triggers wider apart than the debounce while epoch N initializes.
        let mut gate = RestartGate::new(500);
        gate.trigger(0);
        assert_eq!(
            gate.poll(500, false),
            GateDecision::Deferred { until_ms: 1_000 }
        );
        assert_eq!(gate.next_wakeup(), Some(1_000));
        assert_eq!(
            gate.poll(700, true),
            GateDecision::WaitUntil { until_ms: 1_000 }
        );
        assert_eq!(
            gate.poll(1_000, false),
            GateDecision::Deferred { until_ms: 1_500 }
        );
        assert_eq!(gate.consecutive_deferrals(), 2);
        assert_eq!(gate.poll(1_500, true), GateDecision::Fire);
        assert_eq!(
            (gate.fires(), gate.deferrals(), gate.consecutive_deferrals()),
            (1, 2, 0)
        );
    }

    #[test]
    fn trigger_while_the_new_epoch_initializes_is_deferred_not_fired() {
        let mut gate = RestartGate::new(500);
        gate.trigger(0);
        assert_eq!(gate.poll(500, true), GateDecision::Fire);
        // Epoch N+1 is initializing; a second trigger arrives.
        gate.trigger(600);
        assert_eq!(
            gate.poll(1_100, false),
            GateDecision::Deferred { until_ms: 1_600 }
        );
        assert_eq!(
            gate.poll(1_600, false),
            GateDecision::Deferred { until_ms: 2_100 }
        );
        // N+1 became LIVE.
        assert_eq!(gate.poll(2_100, true), GateDecision::Fire);
        assert_eq!(gate.fires(), 2);
    }

    #[test]
    fn a_trigger_does_not_shorten_a_deferral() {
        let mut gate = RestartGate::new(500).with_max_delay(600);
        gate.trigger(0);
        assert_eq!(
            gate.poll(500, false),
            GateDecision::Deferred { until_ms: 1_000 }
        );
        // The max delay (0 + 600) is past, but the re-armed deadline stands.
        gate.trigger(700);
        assert_eq!(gate.next_wakeup(), Some(1_000));
        assert_eq!(
            gate.poll(999, true),
            GateDecision::WaitUntil { until_ms: 1_000 }
        );
        assert_eq!(gate.poll(1_000, true), GateDecision::Fire);
    }

    #[test]
    fn max_delay_bounds_a_constant_stream_of_triggers() {
        let mut gate = RestartGate::new(500).with_max_delay(2_000);
        let mut fired_at = None;
        for t in (0..10_000).step_by(100) {
            gate.trigger(t);
            if gate.poll(t, true) == GateDecision::Fire {
                fired_at = Some(t);
                break;
            }
        }
        assert_eq!(fired_at, Some(2_000));
    }

    #[test]
    fn without_max_delay_a_constant_stream_postpones_the_restart() {
        let mut gate = RestartGate::new(500);
        for t in (0..10_000).step_by(100) {
            gate.trigger(t);
            assert_ne!(gate.poll(t, true), GateDecision::Fire);
        }
        assert_eq!(gate.poll(10_400, true), GateDecision::Fire);
    }

    #[test]
    fn max_delay_below_debounce_is_raised_to_it() {
        let mut gate = RestartGate::new(500).with_max_delay(10);
        gate.trigger(0);
        gate.trigger(100);
        assert_eq!(gate.next_wakeup(), Some(500));
    }

    #[test]
    fn zero_debounce_fires_on_the_trigger_poll() {
        let mut gate = RestartGate::new(0);
        gate.trigger(42);
        assert_eq!(gate.poll(42, true), GateDecision::Fire);
    }

    #[test]
    fn clock_going_backwards_never_fires_early() {
        let mut gate = RestartGate::new(500);
        gate.trigger(10_000);
        gate.trigger(5_000);
        assert_eq!(gate.next_wakeup(), Some(10_500));
        assert_eq!(
            gate.poll(6_000, true),
            GateDecision::WaitUntil { until_ms: 10_500 }
        );
    }

    #[test]
    fn extreme_times_saturate() {
        let mut gate = RestartGate::new(u64::MAX).with_max_delay(u64::MAX);
        gate.trigger(u64::MAX - 1);
        gate.trigger(u64::MAX);
        assert_eq!(gate.next_wakeup(), Some(u64::MAX));
        assert_eq!(
            gate.poll(u64::MAX, false),
            GateDecision::Deferred { until_ms: u64::MAX }
        );
        assert_eq!(gate.poll(u64::MAX, true), GateDecision::Fire);
    }
}
