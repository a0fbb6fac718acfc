//! A fake Envoy side for the supervisor's I/O loop, shared by the paused-clock test
//! binaries: it records every start, signal and drain with the (virtual) time it
//! happened, and an epoch "exits" when it is signalled.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flock_core::epoch::supervisor::Stop;
use flock_core::epoch::{PredecessorStatus, WriterId};
use flock_hotrestart::envoys::ExitFuture;
use flock_hotrestart::{Config, Envoys};
use tokio::sync::oneshot;
use tokio::time::Instant;

#[derive(Default)]
pub struct World {
    /// Epochs that answer LIVE on the admin endpoint once started.
    pub live: bool,
    pub started: Vec<(Instant, u32)>,
    pub signals: Vec<(Instant, u32, Stop)>,
    pub drains: Vec<Instant>,
    running: Vec<(u32, oneshot::Sender<i32>)>,
}

#[derive(Clone, Default)]
pub struct Fake(Arc<Mutex<World>>);

impl Fake {
    pub fn world(&self) -> std::sync::MutexGuard<'_, World> {
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

    async fn drain(&mut self, _epoch: u32, _base_id: u32) -> (bool, bool) {
        self.world().drains.push(Instant::now());
        (true, false)
    }
}

/// A supervisor config for the fake: base id 7, no config watch, 30 s live timeout.
pub fn config(state_dir: &std::path::Path) -> Config {
    let mut c = Config::new(
        "/nonexistent/envoy",
        state_dir.join("envoy.yaml"),
        state_dir.join("state"),
        WriterId::new("paused-test").unwrap(),
    );
    c.base_id = 7;
    c.watch_config = false;
    c.live_timeout = Duration::from_secs(30);
    c
}
