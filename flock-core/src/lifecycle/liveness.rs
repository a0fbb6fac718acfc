//! Per-pod liveness: a small health state machine driven by probe results, with time
//! as a parameter.
//!
//! States: [`Health::Unknown`] (just added, not yet decided) → [`Health::Healthy`]
//! after `healthy_threshold` consecutive successes, → [`Health::Unhealthy`] after
//! `unhealthy_threshold` consecutive failures; and back and forth between Healthy
//! and Unhealthy with the same thresholds (Envoy active health checking's
//! `healthy_threshold` / `unhealthy_threshold`). One deliberate difference from
//! Envoy: Envoy marks a new host healthy after a *single* success; here the first
//! decision also needs `healthy_threshold` successes, because a Healthy decision is
//! registered and fanned out to every agent, and one lucky probe during a pod's
//! start-up should not be.
//!
//! During the warm-up window (`warmup_ms` after the pod was added) failures do not
//! count toward Unhealthy — a slow-starting pod is not flapped in the registry — but
//! they still break a success streak. Successes during warm-up count normally, so a
//! fast pod becomes Healthy quickly.
//!
//! [`Liveness::observe`] returns each state change exactly once; the agent
//! re-registers the endpoint with the new health through
//! [`super::guard::register_if_live`] (never directly: that is R4's window).
//! Fewer transitions also means fewer such re-registrations racing with
//! `RemovePod`.
//!
//! Time is [`MonoMs`]: deadlines and the warm-up window are the agent's own, so
//! they are measured on the monotonic clock (a wall clock set back by an hour must
//! not put every pod back into warm-up, nor one set forward mark them all due). A
//! time that appears to go backwards is treated as still in warm-up, never as an
//! error.
//!
//! # Example
//!
//! ```
//! use flock_core::MonoMs;
//! use flock_core::lifecycle::liveness::{Health, Liveness, LivenessPolicy, Transition};
//!
//! let policy = LivenessPolicy::default(); // 5 s interval, 10 s warm-up, 2/3
//! let mut pod = Liveness::new(MonoMs(0), policy);
//! assert_eq!(pod.observe(MonoMs(5_000), false), None); // warm-up: ignored
//! assert_eq!(pod.observe(MonoMs(10_000), true), None);
//! assert_eq!(
//!     pod.observe(MonoMs(15_000), true),
//!     Some(Transition { from: Health::Unknown, to: Health::Healthy })
//! );
//! assert_eq!(pod.observe(MonoMs(20_000), false), None);
//! assert_eq!(pod.observe(MonoMs(25_000), false), None);
//! assert_eq!(
//!     pod.observe(MonoMs(30_000), false),
//!     Some(Transition { from: Health::Healthy, to: Health::Unhealthy })
//! );
//! assert_eq!(pod.observe(MonoMs(35_000), false), None); // reported once
//! ```

use crate::time::MonoMs;
use serde::{Deserialize, Serialize};

/// Probe scheduling and thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivenessPolicy {
    /// Time between probes of one pod. Default 5 000 ms.
    pub interval_ms: u64,
    /// After the pod was added, failures do not count for this long. Default
    /// 10 000 ms (two probe intervals: enough for a typical sidecar and app to
    /// start listening).
    pub warmup_ms: u64,
    /// Consecutive successes before Healthy. `0` is treated as `1`. Default 2.
    pub healthy_threshold: u32,
    /// Consecutive counted failures before Unhealthy. `0` is treated as `1`.
    /// Default 3 (a healthy pod survives two lost probes; a dead one is marked
    /// within 15 s).
    pub unhealthy_threshold: u32,
}

impl Default for LivenessPolicy {
    fn default() -> Self {
        Self {
            interval_ms: 5_000,
            warmup_ms: 10_000,
            healthy_threshold: 2,
            unhealthy_threshold: 3,
        }
    }
}

/// A pod's health as far as the agent has decided: the one health type of pods and
/// endpoints. The tracker starts at [`Health::Unknown`] and decides
/// [`Health::Healthy`] after `healthy_threshold` consecutive successes and
/// [`Health::Unhealthy`] after `unhealthy_threshold` consecutive counted failures; it
/// never decides [`Health::Draining`].
pub use crate::pod::Health;

/// A change of [`Health`], reported once by [`Liveness::observe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Transition {
    /// The health before.
    pub from: Health,
    /// The health after.
    pub to: Health,
}

/// One pod's liveness state machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    policy: LivenessPolicy,
    added: MonoMs,
    health: Health,
    successes: u32,
    failures: u32,
    last_probe: Option<MonoMs>,
}

impl Liveness {
    /// A tracker for a pod added at `added`.
    pub fn new(added: MonoMs, policy: LivenessPolicy) -> Self {
        Self {
            policy,
            added,
            health: Health::Unknown,
            successes: 0,
            failures: 0,
            last_probe: None,
        }
    }

    /// The current decision.
    pub fn health(&self) -> Health {
        self.health
    }

    /// The policy this tracker uses.
    pub fn policy(&self) -> &LivenessPolicy {
        &self.policy
    }

    /// Whether failures at `now` are ignored (still within warm-up).
    pub fn in_warmup(&self, now: MonoMs) -> bool {
        now.since(self.added) < self.policy.warmup_ms
    }

    /// When the next probe is due: at once for a never-probed pod, otherwise one
    /// interval after the last observation.
    pub fn next_probe(&self) -> MonoMs {
        match self.last_probe {
            None => self.added,
            Some(last) => last.plus(self.policy.interval_ms),
        }
    }

    /// Whether a probe is due at `now`.
    pub fn is_due(&self, now: MonoMs) -> bool {
        now >= self.next_probe()
    }

    /// Records one probe result at `now`. Returns the transition if this result
    /// changed the pod's health, `None` otherwise (each change is returned once).
    pub fn observe(&mut self, now: MonoMs, ok: bool) -> Option<Transition> {
        self.last_probe = Some(now);
        let target = if ok {
            self.successes = self.successes.saturating_add(1);
            self.failures = 0;
            (self.successes >= self.policy.healthy_threshold.max(1)).then_some(Health::Healthy)
        } else {
            self.successes = 0;
            if self.in_warmup(now) {
                return None; // Failures during warm-up do not count.
            }
            self.failures = self.failures.saturating_add(1);
            (self.failures >= self.policy.unhealthy_threshold.max(1)).then_some(Health::Unhealthy)
        };
        match target {
            Some(to) if to != self.health => {
                let from = std::mem::replace(&mut self.health, to);
                Some(Transition { from, to })
            }
            _ => None,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const HEALTHY: Option<Transition> = Some(Transition {
        from: Health::Unknown,
        to: Health::Healthy,
    });

    fn no_warmup() -> LivenessPolicy {
        LivenessPolicy {
            warmup_ms: 0,
            ..LivenessPolicy::default()
        }
    }

    #[test]
    fn default_policy_is_5s_interval_10s_warmup_2_up_3_down() {
        let p = LivenessPolicy::default();
        assert_eq!(
            (
                p.interval_ms,
                p.warmup_ms,
                p.healthy_threshold,
                p.unhealthy_threshold
            ),
            (5_000, 10_000, 2, 3)
        );
    }

    #[test]
    fn new_pod_is_unknown_and_due_immediately() {
        let l = Liveness::new(MonoMs(100), LivenessPolicy::default());
        assert_eq!(l.health(), Health::Unknown);
        assert!(l.is_due(MonoMs(100)));
        assert!(!l.is_due(MonoMs(99)));
    }

    #[test]
    fn healthy_only_after_healthy_threshold_consecutive_successes() {
        let mut l = Liveness::new(MonoMs(0), no_warmup());
        assert_eq!(l.observe(MonoMs(0), true), None);
        assert_eq!(l.observe(MonoMs(5), true), HEALTHY);
        assert_eq!(l.observe(MonoMs(10), true), None);
        assert_eq!(l.health(), Health::Healthy);
    }

    #[test]
    fn a_failure_breaks_the_success_streak() {
        let mut l = Liveness::new(MonoMs(0), no_warmup());
        l.observe(MonoMs(0), true);
        l.observe(MonoMs(1), false);
        assert_eq!(l.observe(MonoMs(2), true), None);
        assert_eq!(l.observe(MonoMs(3), true), HEALTHY);
    }

    #[test]
    fn unhealthy_only_after_unhealthy_threshold_consecutive_failures() {
        let mut l = Liveness::new(MonoMs(0), no_warmup());
        l.observe(MonoMs(0), true);
        l.observe(MonoMs(1), true);
        assert_eq!(l.observe(MonoMs(2), false), None);
        assert_eq!(l.observe(MonoMs(3), false), None);
        assert_eq!(
            l.observe(MonoMs(4), false),
            Some(Transition {
                from: Health::Healthy,
                to: Health::Unhealthy
            })
        );
        assert_eq!(l.observe(MonoMs(5), false), None, "reported once");
    }

    #[test]
    fn a_success_breaks_the_failure_streak() {
        let mut l = Liveness::new(MonoMs(0), no_warmup());
        l.observe(MonoMs(0), false);
        l.observe(MonoMs(1), false);
        l.observe(MonoMs(2), true);
        l.observe(MonoMs(3), false);
        l.observe(MonoMs(4), false);
        assert_eq!(l.health(), Health::Unknown);
        assert!(l.observe(MonoMs(5), false).is_some());
    }

    #[test]
    fn unknown_goes_straight_to_unhealthy_after_warmup() {
        let mut l = Liveness::new(MonoMs(0), LivenessPolicy::default());
        for t in [10_000, 15_000] {
            assert_eq!(l.observe(MonoMs(t), false), None);
        }
        assert_eq!(
            l.observe(MonoMs(20_000), false),
            Some(Transition {
                from: Health::Unknown,
                to: Health::Unhealthy
            })
        );
    }

    #[test]
    fn failures_during_warmup_never_count() {
        let mut l = Liveness::new(MonoMs(1_000), LivenessPolicy::default());
        for t in (1_000..11_000).step_by(100) {
            assert_eq!(l.observe(MonoMs(t), false), None);
        }
        assert_eq!(l.health(), Health::Unknown);
        // The first counted failure is the first one at or after added + warm-up.
        assert_eq!(l.observe(MonoMs(11_000), false), None);
        assert_eq!(l.observe(MonoMs(11_001), false), None);
        assert!(l.observe(MonoMs(11_002), false).is_some());
    }

    #[test]
    fn healthy_pod_is_not_flapped_by_failures_inside_warmup() {
        let mut l = Liveness::new(MonoMs(0), LivenessPolicy::default());
        l.observe(MonoMs(1_000), true);
        assert_eq!(l.observe(MonoMs(2_000), true), HEALTHY);
        for t in 3_000..3_010 {
            assert_eq!(l.observe(MonoMs(t), false), None);
        }
        assert_eq!(l.health(), Health::Healthy);
    }

    #[test]
    fn recovers_from_unhealthy_after_healthy_threshold_successes() {
        let mut l = Liveness::new(MonoMs(0), no_warmup());
        for t in 0..3 {
            l.observe(MonoMs(t), false);
        }
        assert_eq!(l.health(), Health::Unhealthy);
        assert_eq!(l.observe(MonoMs(3), true), None);
        assert_eq!(
            l.observe(MonoMs(4), true),
            Some(Transition {
                from: Health::Unhealthy,
                to: Health::Healthy
            })
        );
    }

    #[test]
    fn zero_thresholds_behave_as_one() {
        let policy = LivenessPolicy {
            healthy_threshold: 0,
            unhealthy_threshold: 0,
            ..no_warmup()
        };
        let mut l = Liveness::new(MonoMs(0), policy);
        assert_eq!(l.observe(MonoMs(0), true), HEALTHY);
        assert!(l.observe(MonoMs(1), false).is_some());
    }

    #[test]
    fn clock_going_backwards_is_warmup_not_a_panic() {
        let mut l = Liveness::new(MonoMs(50_000), LivenessPolicy::default());
        assert!(l.in_warmup(MonoMs(0)));
        assert_eq!(l.observe(MonoMs(0), false), None);
        assert_eq!(l.observe(MonoMs(u64::MAX), false), None);
        assert_eq!(l.next_probe(), MonoMs(u64::MAX), "saturates");
    }

    #[test]
    fn next_probe_is_one_interval_after_the_last() {
        let mut l = Liveness::new(MonoMs(0), LivenessPolicy::default());
        l.observe(MonoMs(7_000), true);
        assert_eq!(l.next_probe(), MonoMs(12_000));
        assert!(!l.is_due(MonoMs(11_999)));
        assert!(l.is_due(MonoMs(12_000)));
        assert_eq!(l.policy().interval_ms, 5_000);
    }
}
