//! Waiting for a condition, the one way the suites do it.
//!
//! Every flavour takes the same three things: what is awaited (for the panic message),
//! a timeout, and a check. The check returns an [`Outcome`]: `bool`, `Option<T>` (the
//! value waited for), or `Result<T, E>`, whose `Err` is the state observed so far and is
//! printed if the wait times out. On timeout the wait panics with
//! `timed out after {timeout:?} waiting for {what}` and, when the check gave one, the
//! last observed state.
//!
//! - [`wait_for`]: a blocking check, polled on this thread;
//! - [`wait_for_async`]: a blocking (cheap, non-`.await`ing) check inside async code,
//!   polled with tokio's sleep;
//! - [`eventually`]: an async check (an RPC, an HTTP request).
//!
//! The async flavours measure the timeout on tokio's clock, so a test with paused time
//! advances through it instead of spinning. Poll only what cannot be awaited: a
//! `watch` channel or a stream a test holds is awaited directly.

use std::fmt::Debug;
use std::time::{Duration, Instant};

/// How often a check is repeated.
pub const POLL: Duration = Duration::from_millis(20);

/// What a check returns: done with a value, or not yet (with what it saw, if anything).
pub trait Outcome {
    /// What the wait returns when the check succeeds.
    type Value;
    /// `Ok(value)` when done; `Err(Some(state))` or `Err(None)` when not.
    fn settle(self) -> Result<Self::Value, Option<String>>;
}

impl Outcome for bool {
    type Value = ();
    fn settle(self) -> Result<(), Option<String>> {
        if self { Ok(()) } else { Err(None) }
    }
}

impl<T> Outcome for Option<T> {
    type Value = T;
    fn settle(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

impl<T, E: Debug> Outcome for Result<T, E> {
    type Value = T;
    fn settle(self) -> Result<T, Option<String>> {
        self.map_err(|seen| Some(format!("{seen:?}")))
    }
}

fn timed_out(what: &str, timeout: Duration, last: Option<String>) -> ! {
    match last {
        Some(seen) => {
            panic!("timed out after {timeout:?} waiting for {what}; last observed: {seen}")
        }
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Repeats `check` every [`POLL`] until it succeeds and returns its value; panics with
/// `what` (and the last observed state) after `timeout`. Blocks the thread.
pub fn wait_for<O: Outcome>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> O,
) -> O::Value {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().settle() {
            Ok(v) => return v,
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            timed_out(what, timeout, last);
        }
        std::thread::sleep(POLL);
    }
}

/// [`wait_for`] inside async code: `check` is synchronous, and the wait sleeps on
/// tokio's clock between tries.
pub async fn wait_for_async<O: Outcome>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> O,
) -> O::Value {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().settle() {
            Ok(v) => return v,
            Err(last) => last,
        };
        if tokio::time::Instant::now() >= deadline {
            timed_out(what, timeout, last);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`wait_for`] with an async `check`, on tokio's clock. A try still running at the
/// deadline is not cut short: give the check its own timeout if it can hang.
pub async fn eventually<O: Outcome>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> O,
) -> O::Value {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().await.settle() {
            Ok(v) => return v,
            Err(last) => last,
        };
        if tokio::time::Instant::now() >= deadline {
            timed_out(what, timeout, last);
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let err = std::panic::catch_unwind(f).expect_err("the wait should have timed out");
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn wait_for_returns_the_value_once_the_check_holds() {
        let mut tries = 0;
        let v = wait_for("the third try", Duration::from_secs(5), || {
            tries += 1;
            (tries == 3).then_some(tries * 10)
        });
        assert_eq!(v, 30);
    }

    #[test]
    fn a_timeout_names_what_was_awaited_and_the_last_state_seen() {
        let msg = panic_message(|| {
            let mut n = 0;
            wait_for("n to reach 1000", Duration::from_millis(50), || {
                n += 1;
                if n >= 1000 { Ok(()) } else { Err(n) }
            })
        });
        assert!(
            msg.starts_with("timed out after 50ms waiting for n to reach 1000; last observed: "),
            "{msg}"
        );
        let last: u32 = msg.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((2..1000).contains(&last), "{msg}");

        let msg = panic_message(|| wait_for("never", Duration::from_millis(20), || false));
        assert_eq!(msg, "timed out after 20ms waiting for never");
    }

    #[tokio::test(start_paused = true)]
    async fn the_async_flavours_time_out_on_tokios_clock() {
        let started = tokio::time::Instant::now();
        let r = tokio::spawn(wait_for_async("never", Duration::from_secs(60), || false)).await;
        assert!(r.is_err(), "the wait should have panicked");
        // Paused time: a minute passed on tokio's clock, (almost) none on the wall clock.
        assert!(started.elapsed() >= Duration::from_secs(60));

        let mut tries = 0;
        let v = eventually("the second try", Duration::from_secs(1), async || {
            tries += 1;
            tokio::task::yield_now().await;
            if tries == 2 { Ok("done") } else { Err(tries) }
        })
        .await;
        assert_eq!(v, "done");
    }
}
