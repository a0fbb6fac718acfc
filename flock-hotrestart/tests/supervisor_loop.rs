//! The supervisor's I/O loop on a paused tokio clock, against a fake Envoy side (no
//! Envoy, no sleeps): the loop must turn the lifecycle machine's deadlines into
//! actions at the right (virtual) times.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flock_core::epoch::supervisor::Stop;
use flock_core::epoch::{PredecessorStatus, WriterId};
use flock_hotrestart::envoys::ExitFuture;
use flock_hotrestart::{Config, Envoys, SupervisorError, run_with};
use tokio::sync::oneshot;
use tokio::time::Instant;

#[derive(Default)]
struct World {
    /// Epochs that answer LIVE on the admin endpoint once started.
    live: bool,
    started: Vec<(Instant, u32)>,
    signals: Vec<(Instant, u32, Stop)>,
    running: Vec<(u32, oneshot::Sender<i32>)>,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<World>>);

impl Fake {
    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.0.lock().unwrap()
    }
}

impl Envoys for Fake {
    async fn validate(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn spawn(&mut self, epoch: u32, _base_id: u32) -> io::Result<(u32, ExitFuture)> {
        let (tx, rx) = oneshot::channel::<i32>();
        let mut w = self.world();
        w.started.push((Instant::now(), epoch));
        w.running.push((epoch, tx));
        Ok((
            1_000 + epoch,
            Box::pin(async move {
                // The raw wait status of a process killed by signal `sig` is `sig`.
                let sig = rx.await.unwrap_or(9);
                Ok(ExitStatus::from_raw(sig))
            }),
        ))
    }

    fn signal(&mut self, epoch: u32, stop: Stop) {
        let mut w = self.world();
        w.signals.push((Instant::now(), epoch, stop));
        if let Some(i) = w.running.iter().position(|(e, _)| *e == epoch) {
            let (_, tx) = w.running.remove(i);
            let _ = tx.send(match stop {
                Stop::Term => 15,
                Stop::Kill => 9,
            });
        }
    }

    async fn probe(&mut self) -> PredecessorStatus {
        let w = self.world();
        match w.running.last() {
            Some(&(epoch, _)) if w.live => PredecessorStatus::Live { epoch, base_id: 7 },
            Some(&(epoch, _)) => PredecessorStatus::NotLive { epoch, base_id: 7 },
            None => PredecessorStatus::Unreachable,
        }
    }

    async fn drain(&mut self, _epoch: u32, _base_id: u32) -> bool {
        true
    }
}

fn config(state_dir: &std::path::Path) -> Config {
    let mut c = Config::new(
        "/nonexistent/envoy",
        state_dir.join("envoy.yaml"),
        state_dir.join("state"),
        "127.0.0.1:9",
        WriterId::new("paused-test").unwrap(),
    );
    c.base_id = 7;
    c.watch_config = false;
    c.live_timeout = Duration::from_secs(30);
    c
}

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
