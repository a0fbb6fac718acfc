//! The installer's event loop on a paused tokio clock: its only timers are the
//! machine's deadlines, and it sleeps until them on tokio's clock, so this test moves
//! time by hand. A config rewritten faster than the write budget is re-patched when the
//! next write token is due — not a moment earlier, and without any new event.
//!
//! The test task waits for conditions by yielding (never by sleeping), so the paused
//! clock never auto-advances: time moves only through `tokio::time::advance`. Real
//! inotify events still arrive from the watch thread.

mod common;

use std::fs;
use std::time::Duration;

use common::{conflist, patched};
use flock_cni::install::{self, Hooks};

/// Yields until `cond` holds (the daemon's task runs meanwhile); fails after 30 s of
/// real time.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_throttled_config_is_repatched_when_its_write_token_is_due() {
    const INTERVAL: Duration = Duration::from_secs(600);
    let d = common::dirs();
    let (conf, ready) = (d.conf.clone(), d.ready.clone());
    let file = conf.join("10-a.conflist");
    fs::write(&file, conflist("a")).unwrap();
    let config = common::config(
        &d,
        // Far beyond anything this test advances: no resync interferes.
        Duration::from_secs(86_400),
        // One write, then one per ten minutes.
        1,
        INTERVAL,
        Hooks::default(),
    );
    let daemon = tokio::spawn(install::run_async(config));
    until("patched at startup and ready", || {
        patched(&file) && ready.exists()
    })
    .await;

    // Another agent rewrites it: over budget, so throttled (and not ready).
    let start = tokio::time::Instant::now();
    fs::write(&file, conflist("a2")).unwrap();
    until("throttled: the ready file removed", || !ready.exists()).await;
    assert!(!patched(&file));

    // Just before the token is due: still not written.
    tokio::time::advance(INTERVAL - Duration::from_secs(1)).await;
    for _ in 0..1_000 {
        tokio::task::yield_now().await;
    }
    assert!(!patched(&file), "re-patched before the write token was due");
    assert!(!ready.exists());

    // Past it: re-patched by the loop's own deadline (no event happened meanwhile).
    tokio::time::advance(Duration::from_secs(2)).await;
    until("re-patched once the token is due", || {
        patched(&file) && ready.exists()
    })
    .await;
    assert!(start.elapsed() >= INTERVAL);
    assert!(fs::read_to_string(&file).unwrap().contains("a2"));

    // Removing the directory is fatal for the daemon (it never runs unwatched).
    fs::remove_dir_all(&conf).unwrap();
    until("the daemon stops", || daemon.is_finished()).await;
    let err = daemon
        .await
        .unwrap()
        .expect_err("must stop without its directory");
    assert!(err.0.contains("removed or moved away"), "{err}");
}
