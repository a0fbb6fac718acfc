//! The supervisor's I/O loop at SIGTERM, on a paused tokio clock against a fake Envoy
//! side: drain first, then stop the epochs at the end of the drain time. Its own test
//! binary: it sends SIGTERM to this process, which would reach any other supervisor
//! running in the same binary.

mod common;

use std::time::Duration;

use common::{Fake, config};
use flock_core::epoch::supervisor::Stop;
use flock_hotrestart::run_with;
use tokio::time::Instant;

/// SIGTERM with a LIVE epoch: the admin endpoint is asked to drain at once, the epoch
/// is stopped (SIGTERM) exactly when the drain time is over, and the supervisor then
/// exits cleanly, removing the ready file.
#[tokio::test(start_paused = true)]
async fn sigterm_drains_then_stops_the_epoch_at_the_end_of_the_drain_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.drain_time_s = 7;
    let ready = dir.path().join("ready");
    cfg.ready_file = Some(ready.clone());
    let fake = Fake::default();
    fake.world().live = true;
    let supervisor = run_with(cfg, fake.clone());
    tokio::pin!(supervisor);
    // Run until the epoch is LIVE (the ready file), with the signal handlers installed.
    tokio::select! {
        result = &mut supervisor => panic!("the supervisor ended: {result:?}"),
        () = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
    assert!(ready.exists());
    let t_term = Instant::now();
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
    let result = supervisor.await;
    assert!(
        matches!(result, Ok(flock_hotrestart::Exit::Terminated)),
        "{result:?}"
    );
    let w = fake.world();
    assert_eq!(w.drains.len(), 1);
    assert!(w.drains[0].duration_since(t_term) < Duration::from_millis(5));
    assert_eq!(w.signals.len(), 1, "one SIGTERM, no SIGKILL");
    let (at, epoch, stop) = w.signals[0];
    assert_eq!((epoch, stop), (0, Stop::Term));
    let drained = at.duration_since(w.drains[0]);
    assert!(
        drained >= Duration::from_secs(7) && drained < Duration::from_millis(7_005),
        "stopped {drained:?} after the drain started"
    );
    assert!(!ready.exists());
}
