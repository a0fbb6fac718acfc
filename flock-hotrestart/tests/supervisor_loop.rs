//! The supervisor's I/O loop on a paused tokio clock, against a fake Envoy side (no
//! Envoy, no sleeps): the loop must turn the lifecycle machine's deadlines into
//! actions at the right (virtual) times.

mod common;

use std::time::Duration;

use common::{Fake, config};
use flock_core::epoch::supervisor::Stop;
use flock_hotrestart::{SupervisorError, run_with};
use tokio::time::Instant;

/// An epoch that never becomes LIVE is stopped exactly at the live timeout, and
/// its exit is a failure: with one restart allowed, the restarted epoch is stopped
/// 30 s after it started too, and the supervisor then gives up.
#[tokio::test(start_paused = true)]
async fn an_epoch_that_never_becomes_live_is_stopped_at_the_live_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.max_restarts = 1;
    let fake = Fake::default();
    let t0 = Instant::now();
    let result = run_with(cfg, fake.clone()).await;

    let w = fake.world();
    let msg = match result {
        Err(SupervisorError::GaveUp(m)) => m,
        other => panic!("expected a give-up, got {other:?}"),
    };
    assert!(
        msg.contains("died 2 times in a row") && msg.contains("killed by signal 15"),
        "{msg}"
    );
    assert_eq!(w.started.len(), 2, "the first start and one restart");
    let term_signals: Vec<_> = w
        .signals
        .iter()
        .filter(|(_, _, s)| *s == Stop::Term)
        .collect();
    assert!(term_signals.len() >= 2, "{:?}", w.signals.len());
    for ((started, epoch), (stopped, stopped_epoch, _)) in w.started.iter().zip(&term_signals) {
        assert_eq!(epoch, stopped_epoch);
        let alive = stopped.duration_since(*started);
        assert!(
            alive >= Duration::from_secs(30) && alive < Duration::from_millis(30_001),
            "epoch {epoch} stopped {alive:?} after it started"
        );
    }
    // The restart waited for the backoff (200 ms ceiling, half of it at least).
    let gap = w.started[1].0.duration_since(term_signals[0].0);
    assert!(
        gap >= Duration::from_millis(100) && gap <= Duration::from_millis(200),
        "{gap:?}"
    );
    assert!(w.started[0].0.duration_since(t0) < Duration::from_millis(1));
}

/// An epoch that becomes LIVE is recorded in the state file within a heartbeat, and
/// is never stopped by the live timeout.
#[tokio::test(start_paused = true)]
async fn a_live_epoch_is_recorded_and_not_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let ready = dir.path().join("ready");
    let mut cfg2 = cfg.clone();
    cfg2.ready_file = Some(ready.clone());
    let fake = Fake::default();
    fake.world().live = true;
    tokio::select! {
        result = run_with(cfg2, fake.clone()) => panic!("the supervisor ended: {result:?}"),
        () = tokio::time::sleep(Duration::from_secs(120)) => {}
    }
    let record = std::fs::read_to_string(dir.path().join("state/epoch")).unwrap();
    assert!(
        record.starts_with("flock-epoch v1 epoch=0 base_id=7 ")
            && record.contains("writer=paused-test"),
        "{record}"
    );
    assert_eq!(std::fs::read_to_string(&ready).unwrap().trim(), "0");
    assert!(fake.world().signals.is_empty());
    assert_eq!(fake.world().started.len(), 1);
}
