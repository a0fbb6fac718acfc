//! The supervisor's I/O loop at SIGTERM, on a paused tokio clock against a fake Envoy
//! side: drain first, then stop the epochs at the end of the drain time. Its own test
//! binary: it sends SIGTERM to this process, which would reach any other supervisor
//! running in the same binary.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flock_core::epoch::supervisor::Stop;
use flock_core::epoch::{PredecessorStatus, WriterId};
use flock_hotrestart::envoys::ExitFuture;
use flock_hotrestart::{Config, Envoys, run_with};
use tokio::sync::oneshot;
use tokio::time::Instant;

#[derive(Default)]
struct World {
    /// Epochs that answer LIVE on the admin endpoint once started.
    live: bool,
    started: Vec<(Instant, u32)>,
    signals: Vec<(Instant, u32, Stop)>,
    drains: Vec<Instant>,
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
        self.world().drains.push(Instant::now());
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
