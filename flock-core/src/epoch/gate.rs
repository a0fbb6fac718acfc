//! The restart gate: a trailing debounce that never forks while the current epoch is
//! not LIVE (race R7, docs/races.md).

use crate::debounce::{Debounce, DebouncePoll};
use crate::time::MonoMs;

/// What the caller of [`RestartGate::poll`] does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateDecision {
    /// No restart is pending. Poll again after the next trigger.
    Idle,
    /// A restart is pending; its debounce ends at `until`. Poll again then.
    WaitUntil {
        /// The deadline.
        until: MonoMs,
    },
    /// Hot-restart now (fork the next epoch). The pending restart is consumed.
    Fire,
    /// The debounce ended but the current epoch is not LIVE: forking now would make
    /// the new epoch exit ("previous envoy process is still initializing"). The
    /// debounce was re-armed; poll again at `until`.
    Deferred {
        /// The re-armed deadline.
        until: MonoMs,
    },
}

/// Debounces hot-restart triggers and gates the restart on the current epoch being
/// LIVE.
///
/// * [`trigger`](Self::trigger) (a config change, SIGHUP) arms the gate or pushes its
///   deadline to `now + debounce_ms` (trailing debounce: a burst of triggers ends
///   in one restart, `debounce_ms` after the last one). The debounce is
///   [`crate::debounce::Debounce`].
/// * With [`with_max_delay`](Self::with_max_delay), the deadline is never pushed past
///   the first pending trigger + `max_delay_ms`, so a constant stream of triggers
///   (a flapping config source) still restarts. Without it, a stream of triggers
///   closer than `debounce_ms` postpones the restart for as long as it lasts. A max
///   delay of about 10× the debounce is a reasonable choice.
/// * [`poll`](Self::poll) at or after the deadline fires only if the current epoch is
///   LIVE. If not, it re-arms the debounce (`now + debounce_ms`, [`Debounce::defer`])
///   and returns [`GateDecision::Deferred`]: never fork while not LIVE. Once the epoch
///   is LIVE and the triggers stop, the restart fires at the first poll at or after
///   `max(last trigger, last deferral) + debounce_ms`.
///
/// **Contract:** `current_epoch_live` is the liveness of the **newest** epoch (the one
/// a fork would succeed), i.e. after a [`GateDecision::Fire`] the caller reports the
/// new epoch's liveness from then on, so a trigger while it initializes is deferred,
/// not fired.
///
/// A persistently deferred restart ([`consecutive_deferrals`](Self::consecutive_deferrals)
/// growing) means the epoch never becomes LIVE, e.g. Envoy's init flag left set after
/// a child exited early, which blocks later restarts; the supervisor alarms and recovers on its own schedule.
///
/// If the caller's clock ever goes backwards, the gate only waits longer; it never
/// fires early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartGate {
    debounce: Debounce,
    triggers: u64,
    fires: u64,
    deferrals: u64,
    consecutive_deferrals: u64,
}

impl RestartGate {
    /// A gate with a trailing debounce of `debounce_ms` and no max delay.
    pub fn new(debounce_ms: u64) -> Self {
        Self {
            debounce: Debounce::new(debounce_ms),
            triggers: 0,
            fires: 0,
            deferrals: 0,
            consecutive_deferrals: 0,
        }
    }

    /// Caps how far triggers push the deadline: at most `max_delay_ms` after the first
    /// pending trigger (raised to `debounce_ms` if smaller). Liveness deferrals are not
    /// capped: the gate never fires while the epoch is not LIVE.
    #[must_use]
    pub fn with_max_delay(mut self, max_delay_ms: u64) -> Self {
        self.debounce = self.debounce.with_cap(max_delay_ms);
        self
    }

    /// Requests a hot restart at `now`.
    pub fn trigger(&mut self, now: MonoMs) {
        self.triggers = self.triggers.saturating_add(1);
        self.debounce.trigger(now);
    }

    /// Decides at `now`; `current_epoch_live` is whether the newest epoch is LIVE
    /// (see the contract on [`RestartGate`]).
    pub fn poll(&mut self, now: MonoMs, current_epoch_live: bool) -> GateDecision {
        // Re-introduces R7 so the property test can show it catches it; never enabled
        // in builds: a supervisor that forked whenever the debounce ended.
        let current_epoch_live = current_epoch_live || crate::reintroduced!("r7");
        match self.debounce.deadline() {
            None => GateDecision::Idle,
            Some(until) if now < until => GateDecision::WaitUntil { until },
            Some(_) if current_epoch_live => {
                let fired = self.debounce.poll(now);
                debug_assert_eq!(fired, DebouncePoll::Fire);
                self.fires = self.fires.saturating_add(1);
                self.consecutive_deferrals = 0;
                GateDecision::Fire
            }
            Some(_) => {
                let until = self.debounce.defer(now);
                self.deferrals = self.deferrals.saturating_add(1);
                self.consecutive_deferrals = self.consecutive_deferrals.saturating_add(1);
                GateDecision::Deferred { until }
            }
        }
    }

    /// When the caller must poll next, or `None` if nothing is pending.
    pub fn next_wakeup(&self) -> Option<MonoMs> {
        self.debounce.deadline()
    }

    /// Whether a restart is pending.
    pub fn is_pending(&self) -> bool {
        self.debounce.is_pending()
    }

    /// The debounce, in milliseconds.
    pub fn debounce_ms(&self) -> u64 {
        self.debounce.quiet_ms()
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const fn m(t: u64) -> MonoMs {
        MonoMs(t)
    }

    #[test]
    fn idle_until_triggered() {
        let mut gate = RestartGate::new(500);
        assert_eq!(gate.poll(m(0), true), GateDecision::Idle);
        assert_eq!(gate.poll(m(10_000), false), GateDecision::Idle);
        assert_eq!(gate.next_wakeup(), None);
    }

    #[test]
    fn trigger_fires_after_debounce_when_live() {
        let mut gate = RestartGate::new(500);
        gate.trigger(m(1_000));
        assert_eq!(gate.next_wakeup(), Some(m(1_500)));
        assert_eq!(
            gate.poll(m(1_499), true),
            GateDecision::WaitUntil { until: m(1_500) }
        );
        assert_eq!(gate.poll(m(1_500), true), GateDecision::Fire);
        assert_eq!(gate.poll(m(1_501), true), GateDecision::Idle);
        assert_eq!((gate.triggers(), gate.fires(), gate.deferrals()), (1, 1, 0));
    }

    #[test]
    fn burst_of_triggers_collapses_into_one_fire_after_the_last() {
        let mut gate = RestartGate::new(500);
        for t in [0, 100, 400, 800, 1_200] {
            gate.trigger(m(t));
            assert!(matches!(
                gate.poll(m(t), true),
                GateDecision::WaitUntil { .. }
            ));
        }
        assert_eq!(gate.next_wakeup(), Some(m(1_700)));
        assert_eq!(
            gate.poll(m(1_699), true),
            GateDecision::WaitUntil { until: m(1_700) }
        );
        assert_eq!(gate.poll(m(1_700), true), GateDecision::Fire);
        assert_eq!(gate.fires(), 1);
    }

    #[test]
    fn deadline_passed_while_not_live_defers_and_rearms_never_forks() {
        // R7: two triggers wider apart than the debounce while epoch N initializes.
        let mut gate = RestartGate::new(500);
        gate.trigger(m(0));
        assert_eq!(
            gate.poll(m(500), false),
            GateDecision::Deferred { until: m(1_000) }
        );
        assert_eq!(gate.next_wakeup(), Some(m(1_000)));
        assert_eq!(
            gate.poll(m(700), true),
            GateDecision::WaitUntil { until: m(1_000) }
        );
        assert_eq!(
            gate.poll(m(1_000), false),
            GateDecision::Deferred { until: m(1_500) }
        );
        assert_eq!(gate.consecutive_deferrals(), 2);
        assert_eq!(gate.poll(m(1_500), true), GateDecision::Fire);
        assert_eq!(
            (gate.fires(), gate.deferrals(), gate.consecutive_deferrals()),
            (1, 2, 0)
        );
    }

    #[test]
    fn trigger_while_the_new_epoch_initializes_is_deferred_not_fired() {
        let mut gate = RestartGate::new(500);
        gate.trigger(m(0));
        assert_eq!(gate.poll(m(500), true), GateDecision::Fire);
        // Epoch N+1 is initializing; a second trigger arrives.
        gate.trigger(m(600));
        assert_eq!(
            gate.poll(m(1_100), false),
            GateDecision::Deferred { until: m(1_600) }
        );
        assert_eq!(
            gate.poll(m(1_600), false),
            GateDecision::Deferred { until: m(2_100) }
        );
        // N+1 became LIVE.
        assert_eq!(gate.poll(m(2_100), true), GateDecision::Fire);
        assert_eq!(gate.fires(), 2);
    }

    #[test]
    fn a_trigger_does_not_shorten_a_deferral() {
        let mut gate = RestartGate::new(500).with_max_delay(600);
        gate.trigger(m(0));
        assert_eq!(
            gate.poll(m(500), false),
            GateDecision::Deferred { until: m(1_000) }
        );
        // The max delay (0 + 600) is past, but the re-armed deadline stands.
        gate.trigger(m(700));
        assert_eq!(gate.next_wakeup(), Some(m(1_000)));
        assert_eq!(
            gate.poll(m(999), true),
            GateDecision::WaitUntil { until: m(1_000) }
        );
        assert_eq!(gate.poll(m(1_000), true), GateDecision::Fire);
    }

    #[test]
    fn max_delay_bounds_a_constant_stream_of_triggers() {
        let mut gate = RestartGate::new(500).with_max_delay(2_000);
        let mut fired_at = None;
        for t in (0..10_000).step_by(100) {
            gate.trigger(m(t));
            if gate.poll(m(t), true) == GateDecision::Fire {
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
            gate.trigger(m(t));
            assert_ne!(gate.poll(m(t), true), GateDecision::Fire);
        }
        assert_eq!(gate.poll(m(10_400), true), GateDecision::Fire);
    }

    #[test]
    fn max_delay_below_debounce_is_raised_to_it() {
        let mut gate = RestartGate::new(500).with_max_delay(10);
        gate.trigger(m(0));
        gate.trigger(m(100));
        assert_eq!(gate.next_wakeup(), Some(m(500)));
    }

    #[test]
    fn zero_debounce_fires_on_the_trigger_poll() {
        let mut gate = RestartGate::new(0);
        gate.trigger(m(42));
        assert_eq!(gate.poll(m(42), true), GateDecision::Fire);
    }

    #[test]
    fn clock_going_backwards_never_fires_early() {
        let mut gate = RestartGate::new(500);
        gate.trigger(m(10_000));
        gate.trigger(m(5_000));
        assert_eq!(gate.next_wakeup(), Some(m(10_500)));
        assert_eq!(
            gate.poll(m(6_000), true),
            GateDecision::WaitUntil { until: m(10_500) }
        );
    }

    #[test]
    fn extreme_times_saturate() {
        let mut gate = RestartGate::new(u64::MAX).with_max_delay(u64::MAX);
        gate.trigger(m(u64::MAX - 1));
        gate.trigger(m(u64::MAX));
        assert_eq!(gate.next_wakeup(), Some(m(u64::MAX)));
        assert_eq!(
            gate.poll(m(u64::MAX), false),
            GateDecision::Deferred { until: m(u64::MAX) }
        );
        assert_eq!(gate.poll(m(u64::MAX), true), GateDecision::Fire);
    }
}
