//! A debounce with a cap: a burst of triggers becomes one action, a quiet period after
//! the last trigger, but never later than a cap after the first.
//!
//! Used wherever a stream of change notifications must turn into few, timely actions:
//! the hot-restart gate (config changes and SIGHUPs become one Envoy hot restart) and
//! the agent's registry refresher (watch events become one re-read). Without the quiet
//! period, every event of a burst would cost a full action; without the cap, a source
//! that never goes quiet (a flapping config, a registry under constant churn) would
//! postpone the action for as long as it lasts.
//!
//! Sans-IO: the caller passes the monotonic time in ([`Debounce::trigger`],
//! [`Debounce::poll`]) and sleeps until the deadline the debounce returns.
//!
//! ```
//! use flock_core::MonoMs;
//! use flock_core::debounce::{Debounce, DebouncePoll};
//!
//! let mut d = Debounce::new(500).with_cap(2_000);
//! d.trigger(MonoMs(0));
//! d.trigger(MonoMs(300));
//! assert_eq!(d.poll(MonoMs(400)), DebouncePoll::Wait { until: MonoMs(800) });
//! assert_eq!(d.poll(MonoMs(800)), DebouncePoll::Fire);
//! assert_eq!(d.poll(MonoMs(900)), DebouncePoll::Idle);
//! ```

use crate::time::MonoMs;

/// What the caller of [`Debounce::poll`] does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DebouncePoll {
    /// Nothing is pending: wait for the next trigger.
    Idle,
    /// A burst is pending; poll again at `until`.
    Wait {
        /// The deadline.
        until: MonoMs,
    },
    /// Act now. The pending burst is consumed.
    Fire,
}

/// A trailing debounce with an optional cap.
///
/// * [`trigger`](Self::trigger) at `now` arms the debounce or pushes its deadline to
///   `now + quiet_ms`: a burst of triggers fires once, `quiet_ms` after its last.
/// * With [`with_cap`](Self::with_cap), triggers never push the deadline past the
///   first pending trigger + `cap_ms`: a stream that never goes quiet still fires.
/// * [`poll`](Self::poll) at or after the deadline fires and consumes the burst.
/// * [`defer`](Self::defer) is for a caller that could not act when the debounce fired
///   (the restart gate, while the epoch is not LIVE): the burst stays pending and its
///   deadline moves to `now + quiet_ms`, past the cap if need be — the cap bounds how
///   long *triggers* may postpone the action, not a caller's own refusal.
///
/// If the caller's clock goes backwards, the debounce only waits longer: a deadline
/// once promised is never moved earlier. Arithmetic saturates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Debounce {
    quiet_ms: u64,
    cap_ms: Option<u64>,
    pending: Option<Pending>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    /// The first trigger of the pending burst.
    first: MonoMs,
    /// When it fires.
    deadline: MonoMs,
}

impl Debounce {
    /// A debounce that fires `quiet_ms` after the last trigger of a burst, uncapped.
    pub fn new(quiet_ms: u64) -> Self {
        Self {
            quiet_ms,
            cap_ms: None,
            pending: None,
        }
    }

    /// Fires at the latest `cap_ms` after the first trigger of a burst (raised to
    /// `quiet_ms` if smaller: a lone trigger always gets its full quiet period).
    #[must_use]
    pub fn with_cap(mut self, cap_ms: u64) -> Self {
        self.cap_ms = Some(cap_ms.max(self.quiet_ms));
        self
    }

    /// An event at `now`.
    pub fn trigger(&mut self, now: MonoMs) {
        let quiet = now.plus(self.quiet_ms);
        self.pending = Some(match self.pending {
            None => Pending {
                first: now,
                deadline: quiet,
            },
            Some(Pending { first, deadline }) => {
                let pushed = match self.cap_ms {
                    Some(cap) => quiet.min(first.plus(cap)),
                    None => quiet,
                };
                Pending {
                    first,
                    // Never earlier than already promised (a deferral, a clock step back).
                    deadline: deadline.max(pushed),
                }
            }
        });
    }

    /// Decides at `now`: fire (consuming the burst), wait until a deadline, or idle.
    pub fn poll(&mut self, now: MonoMs) -> DebouncePoll {
        match self.pending {
            None => DebouncePoll::Idle,
            Some(p) if now < p.deadline => DebouncePoll::Wait { until: p.deadline },
            Some(_) => {
                self.pending = None;
                DebouncePoll::Fire
            }
        }
    }

    /// Keeps a due burst pending and moves its deadline to `now + quiet_ms` (never
    /// earlier than it was); returns the new deadline. Without a pending burst it
    /// arms one, as a trigger would.
    pub fn defer(&mut self, now: MonoMs) -> MonoMs {
        let until = now.plus(self.quiet_ms);
        let p = self.pending.get_or_insert(Pending {
            first: now,
            deadline: until,
        });
        p.deadline = p.deadline.max(until);
        p.deadline
    }

    /// When the pending burst fires, `None` when idle: the caller's next wakeup.
    pub fn deadline(&self) -> Option<MonoMs> {
        self.pending.map(|p| p.deadline)
    }

    /// Whether a burst is pending.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The quiet period, in milliseconds.
    pub fn quiet_ms(&self) -> u64 {
        self.quiet_ms
    }

    /// The cap, in milliseconds, if any.
    pub fn cap_ms(&self) -> Option<u64> {
        self.cap_ms
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn ms(t: u64) -> MonoMs {
        MonoMs(t)
    }

    #[test]
    fn idle_until_triggered() {
        let mut d = Debounce::new(100);
        assert_eq!(d.poll(ms(0)), DebouncePoll::Idle);
        assert_eq!(d.deadline(), None);
        assert!(!d.is_pending());
    }

    #[test]
    fn fires_once_after_the_quiet_period() {
        let mut d = Debounce::new(100);
        d.trigger(ms(1_000));
        assert_eq!(d.poll(ms(1_099)), DebouncePoll::Wait { until: ms(1_100) });
        assert_eq!(d.poll(ms(1_100)), DebouncePoll::Fire);
        assert_eq!(d.poll(ms(1_101)), DebouncePoll::Idle);
    }

    #[test]
    fn each_trigger_restarts_the_quiet_period() {
        let mut d = Debounce::new(100);
        for t in [0, 50, 120, 200] {
            d.trigger(ms(t));
        }
        assert_eq!(d.deadline(), Some(ms(300)));
        assert_eq!(d.poll(ms(299)), DebouncePoll::Wait { until: ms(300) });
        assert_eq!(d.poll(ms(300)), DebouncePoll::Fire);
    }

    #[test]
    fn the_cap_bounds_a_stream_that_never_goes_quiet() {
        let mut d = Debounce::new(100).with_cap(1_000);
        let mut fired = None;
        for t in (0..5_000).step_by(10) {
            d.trigger(ms(t));
            if d.poll(ms(t)) == DebouncePoll::Fire {
                fired = Some(t);
                break;
            }
        }
        assert_eq!(fired, Some(1_000));
        // The next burst gets its own cap.
        d.trigger(ms(1_010));
        assert_eq!(d.deadline(), Some(ms(1_110)));
    }

    #[test]
    fn uncapped_a_stream_postpones_forever() {
        let mut d = Debounce::new(100);
        for t in (0..5_000).step_by(10) {
            d.trigger(ms(t));
            assert_ne!(d.poll(ms(t)), DebouncePoll::Fire);
        }
        assert_eq!(d.deadline(), Some(ms(5_090)));
    }

    #[test]
    fn a_cap_below_the_quiet_period_is_raised_to_it() {
        let d = Debounce::new(500).with_cap(10);
        assert_eq!(d.cap_ms(), Some(500));
    }

    #[test]
    fn defer_keeps_the_burst_and_may_pass_the_cap() {
        let mut d = Debounce::new(100).with_cap(150);
        d.trigger(ms(0));
        assert_eq!(d.defer(ms(100)), ms(200));
        assert_eq!(d.poll(ms(150)), DebouncePoll::Wait { until: ms(200) });
        // A trigger can neither shorten the deferral nor push past the first's cap.
        d.trigger(ms(160));
        assert_eq!(d.deadline(), Some(ms(200)));
        assert_eq!(d.poll(ms(200)), DebouncePoll::Fire);
        // Deferring with nothing pending arms a burst.
        assert_eq!(d.defer(ms(300)), ms(400));
    }

    #[test]
    fn a_clock_going_backwards_never_fires_early() {
        let mut d = Debounce::new(100);
        d.trigger(ms(1_000));
        d.trigger(ms(500));
        assert_eq!(d.deadline(), Some(ms(1_100)));
    }

    #[test]
    fn zero_quiet_period_fires_at_the_trigger_time() {
        let mut d = Debounce::new(0);
        d.trigger(ms(7));
        assert_eq!(d.poll(ms(7)), DebouncePoll::Fire);
    }

    #[test]
    fn extreme_times_saturate() {
        let mut d = Debounce::new(u64::MAX).with_cap(u64::MAX);
        d.trigger(ms(u64::MAX - 1));
        d.trigger(ms(u64::MAX));
        assert_eq!(d.deadline(), Some(ms(u64::MAX)));
        assert_eq!(d.poll(ms(u64::MAX)), DebouncePoll::Fire);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// One burst (triggers, each within `quiet` of the previous one when
            /// `gaps` say so), polled at every millisecond boundary of interest: it
            /// fires exactly once; never before `quiet` after the last trigger unless
            /// the cap forces it; never later than the cap after the first trigger;
            /// and, uncapped or not, no later than `quiet` after the last trigger.
            #[test]
            fn a_burst_fires_exactly_once_within_its_bounds(
                quiet in 0u64..500,
                cap in proptest::option::of(0u64..2_000),
                gaps in proptest::collection::vec(0u64..600, 0..20),
            ) {
                let mut d = Debounce::new(quiet);
                if let Some(c) = cap {
                    d = d.with_cap(c);
                }
                let cap = d.cap_ms();
                let first = 1_000u64;
                let mut triggers = vec![first];
                for g in &gaps {
                    let t = triggers[triggers.len() - 1] + g;
                    triggers.push(t);
                }
                let mut fires = Vec::new();
                let mut now = first;
                let mut next = triggers.iter().copied().peekable();
                let end = triggers[triggers.len() - 1] + quiet + 1;
                // The burst ends at the first fire: later triggers start a new one.
                while now <= end && fires.is_empty() {
                    while next.peek() == Some(&now) {
                        d.trigger(MonoMs(now));
                        next.next();
                    }
                    match d.poll(MonoMs(now)) {
                        DebouncePoll::Fire => fires.push(now),
                        DebouncePoll::Wait { until } => prop_assert!(until.as_millis() > now),
                        DebouncePoll::Idle => prop_assert!(false, "idle with a pending burst at {}", now),
                    }
                    now += 1;
                }
                prop_assert_eq!(fires.len(), 1, "fires: {:?}", fires);
                let fired = fires[0];
                let before: Vec<u64> = triggers.iter().copied().filter(|&t| t <= fired).collect();
                let last = before[before.len() - 1];
                // Never after the cap, nor after the quiet period of the last trigger.
                if let Some(c) = cap {
                    prop_assert!(fired <= first + c, "fired at {} after the cap {}", fired, first + c);
                }
                prop_assert!(fired <= last + quiet);
                // Never before the quiet period unless the cap forced it.
                let capped = cap.is_some_and(|c| fired == first + c);
                prop_assert!(fired >= last + quiet || capped, "fired at {} before {} + {}", fired, last, quiet);
                // Consumed: idle until the next trigger.
                if triggers.iter().all(|&t| t <= fired) {
                    prop_assert_eq!(d.poll(MonoMs(fired + 10_000)), DebouncePoll::Idle);
                }
            }

            /// Deadlines only move later, whatever the trigger/defer/poll order and
            /// even with a clock going backwards; a fire happens only at or after the
            /// deadline last reported.
            #[test]
            fn deadlines_never_move_earlier(
                quiet in 0u64..500,
                cap in proptest::option::of(0u64..2_000),
                steps in proptest::collection::vec((0u8..3, 0u64..3_000), 0..60),
            ) {
                let mut d = Debounce::new(quiet);
                if let Some(c) = cap {
                    d = d.with_cap(c);
                }
                for (op, t) in steps {
                    let before = d.deadline();
                    match op {
                        0 => {
                            d.trigger(MonoMs(t));
                            prop_assert!(d.deadline() >= before);
                        }
                        1 => {
                            let until = d.defer(MonoMs(t));
                            prop_assert!(Some(until) >= before);
                            prop_assert!(until >= MonoMs(t).plus(quiet));
                        }
                        _ => match d.poll(MonoMs(t)) {
                            DebouncePoll::Fire => prop_assert!(before.is_some_and(|b| b <= MonoMs(t))),
                            DebouncePoll::Wait { until } => prop_assert_eq!(Some(until), before),
                            DebouncePoll::Idle => prop_assert_eq!(before, None),
                        },
                    }
                }
            }
        }
    }
}
